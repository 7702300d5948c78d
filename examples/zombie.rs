//! The zombie demo — run it first: `cargo run --example zombie`.
//!
//! Two workers and a downstream payments service share one job. Worker A claims it (epoch 1)
//! and then freezes: its thread is blocked, as in a stop-the-world GC pause or a VM stall, so its
//! heartbeat cannot run and its 3 s lease runs out. Worker B takes the job over (epoch 2), charges
//! the customer and commits. Then A wakes up, still believing it owns the job, and carries on.
//! The demo plays both orderings of A's late call and B's call at the payments service:
//!
//! | case                                 | zombie's receiver call    | zombie's commit | final state                    |
//! |--------------------------------------|---------------------------|-----------------|--------------------------------|
//! | new owner reaches the receiver first | rejected                  | rejected        | epoch 2, the new owner's result |
//! | zombie reaches the receiver first    | accepted, then superseded | rejected        | epoch 2, the new owner's result |
//!
//! With no services it runs on SQLite (a temporary file). With `DATABASE_URL=postgres://…` in the
//! environment it runs on PostgreSQL, in a fresh schema it drops at the end.
//!
//! The payments service stands in for an HTTP receiver: it gets the same `Fence-*` headers
//! (`fence::wire`) and makes the same ledger check as the `adapters::http` middleware, in process
//! so that the demo needs no features and no ports. The proof that all of this also holds across
//! real processes frozen with SIGSTOP is `tests/supervisor/proof.rs`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use brokerfence::wire::FenceStamp;
use brokerfence::{
    Claim, JobKey, LeaseDuration, MetricsSnapshot, Outcome, Owner, QueueName, Supervisor, SupervisorConfig,
};

#[path = "support/zombie_demo.rs"]
mod demo;

use demo::{BoxError, Clock, Db, Network, Payments, describe, init_logging, print_final_state};

const LEASE: Duration = Duration::from_secs(3);
const QUEUE: &str = "payments";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    NewOwnerFirst,
    ZombieFirst,
}

impl Order {
    fn title(self) -> &'static str {
        match self {
            Order::NewOwnerFirst => "new owner reaches the receiver first",
            Order::ZombieFirst => "zombie reaches the receiver first",
        }
    }
}

/// What one case observed.
struct CaseResult {
    zombie_call: String,
    zombie_commit: String,
    final_state: String,
}

/// What worker A reports: its outcome, the status of its receiver call, its counters.
type WorkerAReport = (Outcome, Option<u16>, MetricsSnapshot);

/// Worker A: its own thread and its own single-threaded runtime, so that blocking the thread
/// freezes everything A does — handler and heartbeat alike.
#[allow(clippy::too_many_arguments)]
fn worker_a(
    db: Db,
    key: JobKey,
    order: Order,
    clock: Clock,
    net: Network,
    claimed: tokio::sync::oneshot::Sender<()>,
    frozen: tokio::sync::oneshot::Sender<()>,
    thaw: std::sync::mpsc::Receiver<()>,
) -> std::thread::JoinHandle<Result<WorkerAReport, String>> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
        rt.block_on(async move {
            let (store, _) = db.open().await.map_err(|e| e.to_string())?;
            let owner = Owner::new("worker-A").map_err(|e| e.to_string())?;
            let lease_len = LeaseDuration::new(LEASE).map_err(|e| e.to_string())?;
            let queue = QueueName::new(QUEUE).map_err(|e| e.to_string())?;
            let lease = match store.claim(&queue, &key, &owner, lease_len).await.map_err(|e| e.to_string())? {
                Claim::Claimed(lease) => lease,
                other => return Err(format!("worker A could not claim: {other:?}")),
            };
            clock.say("worker-A", format!("claimed {key} -> epoch {} (lease 3 s, heartbeat every 1 s)", lease.epoch));
            let _ = claimed.send(());
            let supervisor = Supervisor::new(store, owner, SupervisorConfig::new(lease_len));
            let call_status = Arc::new(Mutex::new(None));
            let seen = Arc::clone(&call_status);
            let outcome = supervisor
                .run(lease, Vec::new(), None, move |ctx| async move {
                    let stamp = ctx.stamp();
                    let charge = |status: &mut Option<u16>| {
                        clock.say("worker-A", format!("-> payments: charge {} (epoch {})", ctx.key(), ctx.epoch()));
                        let (code, _) = net.call_blocking(&stamp, "charge by worker-A");
                        *status = Some(code);
                        clock.say("worker-A", format!("<- payments answered {code}"));
                    };
                    if order == Order::ZombieFirst {
                        charge(&mut seen.lock().expect("status"));
                    }
                    clock.say("worker-A", "FREEZES: stop-the-world pause; its thread (heartbeat included) is blocked");
                    let paused = Instant::now();
                    let _ = frozen.send(());
                    let _ = thaw.recv(); // blocked here, like a GC pause: nothing of A runs
                    clock.say(
                        "worker-A",
                        format!(
                            "wakes up after {:.1} s, past its lease; still believes it holds epoch {}",
                            paused.elapsed().as_secs_f64(),
                            ctx.epoch()
                        ),
                    );
                    if order == Order::NewOwnerFirst {
                        charge(&mut seen.lock().expect("status"));
                    }
                    clock.say("worker-A", "handler returns \"charged by worker-A\"; the supervisor commits it");
                    Ok(b"charged by worker-A".to_vec())
                })
                .await;
            clock.say("worker-A", format!("commit {}", describe(&outcome)));
            let metrics = supervisor.metrics().snapshot();
            supervisor.shutdown(Duration::from_millis(100)).await;
            let status = *call_status.lock().map_err(|e| e.to_string())?;
            Ok((outcome, status, metrics))
        })
    })
}

async fn run_case(
    db: &Db,
    order: Order,
    key: &str,
    payments: &Payments,
    net: &Network,
) -> Result<CaseResult, BoxError> {
    let clock = Clock(Instant::now());
    *payments.clock.lock().expect("clock") = clock;
    println!("\n=== case: {} ===", order.title());
    let key = JobKey::new(key)?;
    let (claimed_tx, claimed_rx) = tokio::sync::oneshot::channel();
    let (frozen_tx, frozen_rx) = tokio::sync::oneshot::channel();
    let (thaw_tx, thaw_rx) = std::sync::mpsc::channel();
    let a = worker_a(db.clone(), key.clone(), order, clock, net.clone(), claimed_tx, frozen_tx, thaw_rx);
    claimed_rx.await?;
    frozen_rx.await?;

    // Worker B: an ordinary worker on the main runtime.
    let (store, _) = db.open().await?;
    let owner = Owner::new("worker-B")?;
    let lease_len = LeaseDuration::new(LEASE)?;
    let queue = QueueName::new(QUEUE)?;
    let mut told = false;
    let lease = loop {
        match store.claim(&queue, &key, &owner, lease_len).await? {
            Claim::Claimed(lease) => break lease,
            Claim::Busy { owner, epoch, ttl, .. } => {
                if !told {
                    let holder = owner.unwrap_or_default();
                    clock.say(
                        "worker-B",
                        format!("{key} is busy: {holder} holds epoch {epoch} for {:.1} s more", ttl.as_secs_f64()),
                    );
                    told = true;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => return Err(format!("unexpected claim outcome {other:?}").into()),
        }
    };
    clock.say("worker-B", format!("A's lease expired unrenewed -> B claimed {key}: epoch {}", lease.epoch));
    let supervisor = Supervisor::new(Arc::clone(&store), owner, SupervisorConfig::new(lease_len));
    let b_net = net.clone();
    let outcome = supervisor
        .run(lease, Vec::new(), None, move |ctx| async move {
            clock.say("worker-B", format!("-> payments: charge {} (epoch {})", ctx.key(), ctx.epoch()));
            let (code, _) = b_net.call(&ctx.stamp(), "charge by worker-B").await;
            clock.say("worker-B", format!("<- payments answered {code}"));
            Ok(b"charged by worker-B".to_vec())
        })
        .await;
    clock.say("worker-B", format!("commit {}", describe(&outcome)));
    let b_metrics = supervisor.metrics().snapshot();
    supervisor.shutdown(Duration::from_millis(100)).await;

    let _ = thaw_tx.send(());
    let (a_outcome, a_status, a_metrics) =
        tokio::task::spawn_blocking(move || a.join()).await?.map_err(|_| "worker A panicked")??;

    let job = store.job(&queue, &key).await?.ok_or("job row missing")?;
    let result = String::from_utf8_lossy(job.result.as_deref().unwrap_or_default()).into_owned();
    let ledger_job = FenceStamp::new(QUEUE, key.as_str(), 1).ledger_job();
    let newest = payments.ledger.newest(&ledger_job).await?;
    let charge = payments.charges.lock().expect("charges").get(&ledger_job).cloned();
    print_final_state(&key, &job, newest, charge.as_ref(), [("worker-A", a_metrics), ("worker-B", b_metrics)]);

    let zombie_call = match (order, a_status) {
        (Order::NewOwnerFirst, Some(409)) => "rejected (409)".to_owned(),
        (Order::ZombieFirst, Some(200)) if newest == Some(job.epoch) && job.epoch > 1 => {
            format!("accepted, then superseded by epoch {}", job.epoch)
        }
        (_, status) => format!("unexpected: {status:?}"),
    };
    let zombie_commit = match a_outcome {
        Outcome::Fenced(_) => "rejected (Fenced)".to_owned(),
        other => format!("unexpected: {}", describe(&other)),
    };
    Ok(CaseResult {
        zombie_call,
        zombie_commit,
        final_state: format!("{} at epoch {}, {result:?}", job.state, job.epoch),
    })
}

/// What `--help` prints.
const USAGE: &str = "usage: zombie

The zombie demo: a worker stalls past its lease, a second one takes the job over, and the
stalled one wakes up; its late receiver call and its commit are refused by their epoch. Runs
on SQLite in a temporary file, or on PostgreSQL when DATABASE_URL=postgres://… is set
(RUST_LOG for logs).

options:
  -h, --help  Print help";

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    match std::env::args().nth(1).as_deref() {
        None => {}
        Some("-h" | "--help") => {
            println!("{USAGE}");
            return Ok(());
        }
        Some(other) => {
            eprintln!("error: unexpected argument '{other}'\n\n{USAGE}");
            std::process::exit(2);
        }
    }
    init_logging()?;
    let db = Db::from_env()?;
    println!("lease 3 s, renewed every 1 s; every claim increments the job's epoch (its fencing token)");

    let (_, ledger) = db.open().await?;
    let payments = Arc::new(Payments::new(ledger));
    let (net, server) = Network::serve(Arc::clone(&payments));

    let mut rows = Vec::new();
    for (order, key) in [(Order::NewOwnerFirst, "order-1"), (Order::ZombieFirst, "order-2")] {
        rows.push((order, run_case(&db, order, key, &payments, &net).await?));
    }

    println!("\n| case | zombie's receiver call | zombie's commit | final state |");
    println!("|---|---|---|---|");
    for (order, r) in &rows {
        println!("| {} | {} | {} | {} |", order.title(), r.zombie_call, r.zombie_commit, r.final_state);
    }
    println!(
        "\nBoth orderings end the same way: the newest epoch wins. Had worker A awaited anything after\n\
         waking, its supervisor would have cancelled the handler right there (its lease deadline had\n\
         passed); the receiver's check and the fenced commit cover the steps no one can interrupt."
    );

    drop(net);
    let _ = server.await;
    db.remove().await?;
    Ok(())
}
