//! The scenarios of the table, each run end to end against a fresh database: the zombie
//! and the new owner in order ([`table_run`]), a cancelled handler ([`cancel_run`]), a stale
//! heartbeat ([`heartbeat_run`]).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use brokerfence::{JobRecord, MetricsSnapshot, Outcome, Owner};
use fence::Guards;

use super::{Backend, Db, NEW_OWNER, Receiver, Zombie, field, new_owner_runs, take_over};

/// Which of the two orderings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// The new owner reaches the receiver first; the zombie's call arrives after it.
    NewOwnerFirst,
    /// The zombie reaches the receiver first; the new owner's call supersedes it.
    ZombieFirst,
}

/// Guard settings of one scenario (all on by default).
#[derive(Debug, Clone, Default)]
pub struct Switches {
    /// Guards of the zombie's store, as worker flags (`no-commit-cas`, …).
    pub zombie: Vec<&'static str>,
    /// Guards of the new owner's store.
    pub new_owner: Guards,
    /// Guards of the receiver's ledger.
    pub receiver: Guards,
}

/// What one run of the table scenario observed.
#[derive(Debug)]
pub struct TableRun {
    pub label: String,
    pub zombie_epoch: i64,
    pub new_epoch: i64,
    pub zombie_outcome: String,
    pub zombie_metrics: HashMap<String, u64>,
    pub new_outcome: Outcome,
    pub new_metrics: MetricsSnapshot,
    pub new_owner_status: u16,
    /// (epoch, status) of every receiver call, in arrival order.
    pub receiver_calls: Vec<(i64, u16)>,
    pub newest: Option<i64>,
    pub effect: Option<(i64, String)>,
    pub job: JobRecord,
    pub stopped_for: Duration,
    pub timeline: String,
}

/// The table, one row: the zombie claims (epoch 1), is frozen with SIGSTOP past its lease
/// (in the zombie-first order after its receiver call, in the other before it), the new owner
/// takes over (epoch 2), calls the receiver and commits; then the zombie is resumed with SIGCONT,
/// makes its (blocking, un-cancellable) receiver call if it has not yet, and commits.
pub async fn table_run(backend: Backend, order: Order, switches: Switches) -> TableRun {
    let label = format!("{backend} {order:?} {switches:?}");
    let db = Db::new(backend).await;
    let receiver = Receiver::start(db.fence(switches.receiver).await.ledger("receiver")).await;
    let plan = match order {
        Order::NewOwnerFirst => "gate,call-sync",
        Order::ZombieFirst => "call,gate",
    };
    let mut zombie = Zombie::spawn(&label, &db, Some(&receiver.url), plan, &switches.zombie);
    let t0 = zombie.started;
    let mut timeline = String::new();
    let mut note = |at: Instant, what: &str| {
        timeline.push_str(&format!("  +{:.3}s {what}\n", at.duration_since(t0).as_secs_f64()))
    };

    let (at, line) = zombie.wait_for("claimed", Duration::from_secs(20)).await;
    note(at, &format!("zombie {line}"));
    let (at, _) = zombie.wait_for("gate", Duration::from_secs(10)).await;
    note(at, "zombie reached its gate");
    let stopped = zombie.stop();
    note(stopped, "zombie frozen with SIGSTOP");

    let new_store = db.fence(switches.new_owner).await.store();
    let lease2 = take_over(&new_store, &Owner::new(NEW_OWNER).expect("owner"), Duration::from_secs(10)).await;
    note(Instant::now(), &format!("new owner claimed epoch {} (zombie's lease expired)", lease2.epoch));
    let new_epoch = lease2.epoch;
    let (new_outcome, new_metrics, new_owner_status) = new_owner_runs(new_store, lease2, &receiver.url).await;
    note(Instant::now(), &format!("new owner: receiver {new_owner_status}, {new_outcome:?}"));

    zombie.open_gate().await;
    let resumed = zombie.cont();
    note(resumed, "zombie resumed with SIGCONT");
    let (at, line) = zombie.wait_for("outcome=", Duration::from_secs(10)).await;
    note(at, &format!("zombie {line}"));
    zombie.finish_ok().await;

    let run = TableRun {
        zombie_epoch: zombie.claimed_epoch(),
        new_epoch,
        zombie_outcome: zombie.outcome().unwrap_or_default(),
        zombie_metrics: zombie.metrics(),
        new_outcome,
        new_metrics,
        new_owner_status,
        receiver_calls: receiver.summary(),
        newest: receiver.newest().await,
        effect: receiver.effect(),
        job: db.job().await,
        stopped_for: resumed.duration_since(stopped),
        timeline: format!("{timeline}zombie process:\n{}", zombie.transcript()),
        label,
    };
    db.cleanup().await;
    run
}

/// What one run of the cancel scenario observed.
#[derive(Debug)]
pub struct CancelRun {
    pub label: String,
    /// SIGCONT to the handler's future being dropped.
    pub cancel_latency: Option<Duration>,
    pub zombie_outcome: String,
    pub zombie_metrics: HashMap<String, u64>,
    /// Receiver calls stamped with the zombie's epoch that arrived after SIGCONT.
    pub calls_after_resume: Vec<(i64, u16)>,
    /// `calling` events the zombie printed after SIGCONT.
    pub attempts_after_resume: usize,
    pub job: JobRecord,
    pub transcript: String,
}

/// The zombie calls the receiver, waits 1.5 s (an async wait, where a real handler would await a
/// slow dependency), then calls it every 150 ms. It is frozen with SIGSTOP during that wait, the
/// new owner takes over, and the zombie is resumed: its handler must be dropped at once and never
/// call again. (The wait is long so that even a loaded machine stops the zombie inside it, not in
/// the middle of a poll, which would legitimately run to its next await point.)
pub async fn cancel_run(backend: Backend, zombie_guards: &[&str]) -> CancelRun {
    let (label, db) = begin(backend, "cancel", zombie_guards).await;
    let receiver = Receiver::start(db.admin.ledger("receiver")).await;
    let mut zombie = Zombie::spawn(&label, &db, Some(&receiver.url), "call,sleep:1500,calls:20:150", zombie_guards);
    zombie.wait_for("receiver epoch=1 status=200", Duration::from_secs(20)).await;
    let stopped = zombie.stop();
    let calls_before = zombie.events().iter().filter(|(at, l)| *at < stopped && l.starts_with("calling")).count();
    assert_eq!(
        calls_before,
        1,
        "[{label}] the test was too slow to stop the zombie in its wait\n{}",
        zombie.transcript()
    );
    let new_store = db.fence(Guards::default()).await.store();
    let lease2 = take_over(&new_store, &Owner::new(NEW_OWNER).expect("owner"), Duration::from_secs(10)).await;
    let (outcome, _, status) = new_owner_runs(new_store, lease2, &receiver.url).await;
    assert!(outcome.is_completed() && status == 200, "[{label}] new owner: {outcome:?} {status}");

    let resumed = zombie.cont();
    let dropped = zombie.wait_for_after("handler-dropped", Some(resumed), Duration::from_secs(10)).await;
    zombie.wait_for("outcome=", Duration::from_secs(10)).await;
    // Leave time for a call that should not come (the zombie called every 150 ms).
    tokio::time::sleep(Duration::from_millis(600)).await;
    zombie.finish_ok().await;
    let calls_after_resume =
        receiver.calls().iter().filter(|c| c.at > resumed && c.epoch() == 1).map(|c| (c.epoch(), c.status)).collect();
    let attempts_after_resume = zombie.events_after(resumed).iter().filter(|l| l.starts_with("calling")).count();
    let finished_early = field(&dropped.1, "finished") == Some("false");
    let run = CancelRun {
        cancel_latency: finished_early.then(|| dropped.0.duration_since(resumed)),
        zombie_outcome: zombie.outcome().unwrap_or_default(),
        zombie_metrics: zombie.metrics(),
        calls_after_resume,
        attempts_after_resume,
        job: db.job().await,
        transcript: zombie.transcript(),
        label,
    };
    db.cleanup().await;
    run
}

/// What one run of the heartbeat scenario observed.
#[derive(Debug)]
pub struct HeartbeatRun {
    pub label: String,
    /// The new owner's lease end right after its claim (database clock, ms).
    pub new_lease_until: i64,
    /// The job's lease end after the zombie's heartbeat ran.
    pub lease_until_after: i64,
    pub owner_after: Option<String>,
    pub epoch_after: i64,
    /// What the zombie's post-resume heartbeat reported: `heartbeat lost epoch=1` or `heartbeat renewed …`.
    pub zombie_heartbeat: String,
    pub zombie_outcome: String,
    pub transcript: String,
}

/// The zombie is frozen inside a blocking step; the new owner claims (and deliberately sends no
/// heartbeat, so only a foreign write could move its lease end); a second later the zombie is
/// resumed but kept in its blocking step until its heartbeat task — on another thread — has run
/// its overdue tick with the old epoch. That heartbeat must not extend the new owner's lease.
pub async fn heartbeat_run(backend: Backend, zombie_guards: &[&str]) -> HeartbeatRun {
    let (label, db) = begin(backend, "heartbeat", zombie_guards).await;
    let mut zombie = Zombie::spawn(&label, &db, None, "gate", zombie_guards);
    zombie.wait_for("gate", Duration::from_secs(20)).await;
    zombie.stop();
    let new_store = db.fence(Guards::default()).await.store();
    let lease2 = take_over(&new_store, &Owner::new(NEW_OWNER).expect("owner"), Duration::from_secs(10)).await;
    let new_lease_until = db.job().await.lease_until.expect("running").0;
    assert_eq!(new_lease_until, lease2.lease_until.0);
    // Let a second of the new owner's lease pass, so that a wrongly accepted heartbeat would
    // visibly push its end out (by about that second).
    tokio::time::sleep(Duration::from_secs(1)).await;

    let resumed = zombie.cont();
    let (_, hb) = zombie.wait_for_after("heartbeat", Some(resumed), Duration::from_secs(3)).await;
    let after = db.job().await;
    zombie.open_gate().await;
    zombie.wait_for("outcome=", Duration::from_secs(10)).await;
    zombie.finish_ok().await;
    let run = HeartbeatRun {
        new_lease_until,
        lease_until_after: after.lease_until.map_or(0, |t| t.0),
        owner_after: after.owner.clone(),
        epoch_after: after.epoch,
        zombie_heartbeat: hb,
        zombie_outcome: zombie.outcome().unwrap_or_default(),
        transcript: zombie.transcript(),
        label,
    };
    db.cleanup().await;
    run
}

/// A scenario's label (`<backend> <what> <zombie guards>`) and its fresh database.
async fn begin(backend: Backend, what: &str, zombie_guards: &[&str]) -> (String, Db) {
    (format!("{backend} {what} {zombie_guards:?}"), Db::new(backend).await)
}
