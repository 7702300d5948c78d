//! The fence on the PostgreSQL topologies people run in production (issue #29): a primary with
//! a streaming standby that gets promoted (asynchronously replicated, so writes are lost, or
//! synchronously), an old primary that keeps running after the promotion, pools that follow the
//! primary through one address (a relay standing in for a VIP) or a multi-host URL, and
//! PgBouncer in transaction mode in front of it all. Every server, relay and pooler is a real
//! process on a free port (`brokerfence_testkit::pg_topology`); the receiver's ledger lives in
//! the shared PostgreSQL of `localstack/up`, apart from the servers that fail over. Every test
//! name contains `failover` (`cargo test --workspace --all-features failover`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use brokerfence::TableQueue;
use brokerfence::epoch::{EPOCHS_PER_TIMELINE, timeline_of};
use brokerfence::{
    Claim, FenceError, FenceStore, JobKey, JobState, Owner, PgFence, PgTarget, PgTimeouts, Pooler, QueueName,
    SchemaName, SupervisorConfig,
};
use brokerfence::{Consumer, ConsumerConfig, Handler};
use brokerfence_testkit::pg_topology::{PgBouncer, PgPair, Relay, Replication};
use brokerfence_testkit::receiver::{Call, Receiver, calling_handler_after};
use brokerfence_testkit::store as common;
use common::{key, lease};
use fence::Guards;
use tokio_util::sync::CancellationToken;

// ------------------------------------------------------------------------------------- helpers

/// The fence at `url` in `schema`, with `guards` (all on unless a negative control says).
async fn fence_at(url: &str, schema: &SchemaName, guards: Guards) -> PgFence {
    PgFence::connect(url).await.unwrap_or_else(|e| panic!("connect {url}: {e}")).schema(schema.clone()).guards(guards)
}

/// `postgres://postgres@<addr>/postgres`: the superuser of a private server (or of a relay in
/// front of one).
fn url_of(addr: std::net::SocketAddr) -> String {
    format!("postgres://postgres@{addr}/postgres")
}

/// Keys `job-000` … of `n` jobs.
fn job_keys(n: usize) -> Vec<JobKey> {
    (0..n).map(|i| key(&format!("job-{i:03}"))).collect()
}

/// A table queue: the URL of its fence, the schema and the queue name.
#[derive(Clone, Copy)]
struct QueueAt<'a> {
    url: &'a str,
    schema: &'a SchemaName,
    queue: &'a QueueName,
}

/// Consumers of one table queue, each with its own fence (pool) and owner, in this process.
struct Fleet {
    stop: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Fleet {
    /// `workers` consumers of `queue` at `url`, each running `concurrency` handlers that wait
    /// `delay` and then call `receiver` (owners `<prefix>-1` …).
    async fn start(
        QueueAt { url, schema, queue }: QueueAt<'_>,
        (prefix, workers): (&str, usize),
        (lease_secs, concurrency): (u64, usize),
        handler: impl Handler,
        guards: Guards,
    ) -> Fleet {
        let stop = CancellationToken::new();
        let mut tasks = Vec::new();
        for i in 1..=workers {
            let store: Arc<dyn FenceStore> = Arc::new(fence_at(url, schema, guards).await);
            let config = ConsumerConfig::new(SupervisorConfig::new(lease(lease_secs)))
                .concurrency(concurrency)
                .grace(Duration::from_millis(500));
            let owner = Owner::new(format!("{prefix}-{i}")).expect("owner");
            let consumer =
                Consumer::with_owner(TableQueue::new(Arc::clone(&store), queue.clone()), store, owner, config);
            let (handler, token) = (handler.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                if let Err(e) = consumer.run(handler, token).await {
                    eprintln!("consumer stopped with {e}");
                }
            }));
        }
        Fleet { stop, tasks }
    }

    async fn stop(self) {
        self.stop.cancel();
        for t in self.tasks {
            let _ = tokio::time::timeout(Duration::from_secs(20), t).await;
        }
    }
}

/// Every (job, epoch) that reached the receiver from more than one owner: a fencing token
/// handed out twice. Refused calls count too: what the fence handed out is what is checked.
fn tokens_held_twice(calls: &[Call]) -> BTreeMap<(String, i64), BTreeSet<String>> {
    let mut owners: BTreeMap<(String, i64), BTreeSet<String>> = BTreeMap::new();
    for c in calls {
        owners.entry((c.job.clone(), c.epoch)).or_default().insert(c.owner.clone().unwrap_or_default());
    }
    owners.retain(|_, o| o.len() > 1);
    owners
}

/// The jobs of `queue` as the store has them: key → (state, epoch, owner).
async fn rows(
    fence: &PgFence,
    queue: &QueueName,
    keys: &[JobKey],
) -> BTreeMap<String, (JobState, i64, Option<String>)> {
    let mut out = BTreeMap::new();
    for k in keys {
        if let Some(job) = fence.job(queue, k).await.unwrap_or_else(|e| panic!("read {k}: {e}")) {
            out.insert(k.as_str().to_owned(), (job.state, job.epoch, job.owner));
        }
    }
    out
}

/// Waits until every job of `keys` is completed on `fence`, or panics after `within` naming
/// the ones that are not.
async fn wait_all_completed(fence: &PgFence, queue: &QueueName, keys: &[JobKey], within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let now = rows(fence, queue, keys).await;
        let open: Vec<_> = now.iter().filter(|(_, (s, _, _))| *s != JobState::Completed).collect();
        if open.is_empty() && now.len() == keys.len() {
            return;
        }
        if Instant::now() > deadline {
            panic!("not all jobs completed within {within:?}: {} rows, open: {open:?}", now.len());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

// ----------------------------------------------------------------- failover with lost writes

/// What one failover run left behind.
struct FailoverRun {
    calls: Vec<Call>,
    /// key → (state, epoch, owner) on the promoted server.
    rows: BTreeMap<String, (JobState, i64, Option<String>)>,
    /// key → the effect the receiver keeps: (epoch, owner).
    effects: BTreeMap<String, Option<(i64, Option<String>)>>,
    /// The promoted server's timeline.
    timeline: u32,
}

/// The scenario: three workers drain a table queue through one address (a relay, the
/// VIP) on a primary with a standby; the replication link is cut, the primary keeps working
/// alone for 3 s, dies, the standby is promoted and the address re-pointed; the workers ride
/// through it. `replication` chooses an asynchronous or a synchronous standby, `guards` the
/// workers' fence (a negative control switches the timeline epochs off).
async fn failover_run(replication: Replication, guards: Guards, jobs: usize, lease_secs: u64) -> FailoverRun {
    let pair = PgPair::start(replication).await;
    let vip = Relay::start(pair.primary.addr()).await;
    let url = url_of(vip.addr());
    let schema = common::unique_schema();
    let queue = QueueName::new("failover").expect("queue");
    let admin = fence_at(&url, &schema, Guards::default()).await;
    admin.migrate().await.expect("migrate");
    let keys = job_keys(jobs);
    let payloads: Vec<(JobKey, Vec<u8>)> = keys.iter().map(|k| (k.clone(), b"work".to_vec())).collect();
    admin.enqueue_many(&queue, &payloads).await.expect("enqueue");
    pair.wait_caught_up().await;

    let ledger_home = common::pg().await;
    let receiver = Receiver::start(&ledger_home).await;
    let handler = calling_handler_after(receiver.url.clone(), Duration::from_millis(600));
    let fleet =
        Fleet::start(QueueAt { url: &url, schema: &schema, queue: &queue }, ("w", 3), (lease_secs, 2), handler, guards)
            .await;

    tokio::time::sleep(Duration::from_secs(1)).await;
    pair.link.partition();
    let cut_at = receiver.calls().len();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let alone = receiver.calls().len() - cut_at;
    pair.primary.kill().await;
    pair.standby.promote().await;
    vip.point_to(pair.standby.addr());
    vip.drop_connections();
    eprintln!("failover: {alone} receiver calls while the primary was alone; standby promoted");

    let promoted = fence_at(&url_of(pair.standby.addr()), &schema, Guards::default()).await;
    wait_all_completed(&promoted, &queue, &keys, Duration::from_secs(90)).await;
    fleet.stop().await;
    let calls = receiver.calls();
    let rows = rows(&promoted, &queue, &keys).await;
    let effects = keys
        .iter()
        .map(|k| (k.as_str().to_owned(), receiver.effect(&Receiver::job_name("failover", k.as_str()))))
        .collect();
    let timeline = pair.standby.timeline().await;
    common::drop_schema(&ledger_home).await;
    FailoverRun { calls, rows, effects, timeline }
}

/// (a) An asynchronous failover that loses writes: jobs claimed and completed on the primary
/// while it was alone are lost with it and run again on the promoted standby, at epochs above
/// every epoch the lost primary handed out (timeline 2). No (job, epoch) reached the receiver
/// from two owners, the receiver's ledger ends with what the promoted primary committed, and
/// every job completes. Guard: the timeline epochs (the negative control below switches them
/// off and sees tokens handed out twice).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_async_standby_promoted_after_lost_writes_hands_out_no_token_twice() {
    let run = failover_run(Replication::Async, Guards::default(), 80, 6).await;
    assert_eq!(run.timeline, 2, "the promoted standby is on timeline 2");
    assert_eq!(tokens_held_twice(&run.calls), BTreeMap::new(), "a (job, epoch) held by two owners");
    // The scenario did lose writes: some jobs ran on the lost primary and again after it.
    let rerun: BTreeSet<&str> = run
        .calls
        .iter()
        .filter(|c| timeline_of(c.epoch) == 2)
        .map(|c| c.job.as_str())
        .filter(|job| run.calls.iter().any(|o| &o.job == job && timeline_of(o.epoch) == 1))
        .collect();
    assert!(!rerun.is_empty(), "no job ran on both timelines: the failover lost no work; calls {:?}", run.calls);
    for (key, (state, epoch, owner)) in &run.rows {
        assert_eq!(*state, JobState::Completed, "{key}");
        assert_eq!(run.effects[key], Some((*epoch, owner.clone())), "{key}: the receiver keeps the promoted primary's");
        // A receiver call refused as older is fine; an accepted one never comes after a newer one.
        let accepted: Vec<i64> =
            run.calls.iter().filter(|c| c.job.ends_with(key.as_str()) && c.accepted).map(|c| c.epoch).collect();
        assert!(accepted.windows(2).all(|w| w[0] <= w[1]), "{key}: accepted epochs went down: {accepted:?}");
    }
    eprintln!("failover (a): {} jobs ran on both timelines", rerun.len());
}

/// Negative control of (a): without the timeline epochs (the fence before this issue), the
/// promoted standby hands out epochs the lost primary had handed out already, to other owners.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_async_without_timeline_epochs_hands_out_tokens_twice() {
    let run = failover_run(Replication::Async, Guards::default().without_timeline_epochs(), 80, 6).await;
    let twice = tokens_held_twice(&run.calls);
    assert!(!twice.is_empty(), "guard off: expected a (job, epoch) held by two owners; calls {:?}", run.calls);
    eprintln!("failover (a) without timeline epochs: {} tokens handed out twice: {twice:?}", twice.len());
}

/// (c) A synchronous standby: while replication is cut the primary commits nothing (every
/// commit waits for the standby), so nothing acknowledged is lost when it dies; the workers'
/// leases outlast the failover, their commits are sent again to the promoted standby, and no job
/// runs twice: each job reached the receiver under one epoch only.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_sync_standby_promoted_reruns_no_job() {
    let run = failover_run(Replication::Sync, Guards::default(), 60, 12).await;
    assert_eq!(tokens_held_twice(&run.calls), BTreeMap::new());
    let mut epochs: HashMap<&str, BTreeSet<i64>> = HashMap::new();
    for c in &run.calls {
        epochs.entry(c.job.as_str()).or_default().insert(c.epoch);
    }
    let rerun: Vec<_> = epochs.iter().filter(|(_, e)| e.len() > 1).collect();
    assert!(rerun.is_empty(), "jobs that ran under more than one epoch: {rerun:?}");
    for (key, (state, epoch, owner)) in &run.rows {
        assert_eq!(*state, JobState::Completed, "{key}");
        assert_eq!(run.effects[key], Some((*epoch, owner.clone())), "{key}");
    }
}

// ------------------------------------------------------------ an old primary still running

/// (b) The old primary is not dead after the promotion (cut off, not yet shut down): workers
/// that still reach it go on claiming there, on timeline 1, while the others work on the
/// promoted standby, on timeline 2. Every token of the old primary loses to the new primary's
/// at the receiver: each job's effect is the new primary's, and each call from the old
/// primary after it is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_old_primary_still_running_loses_to_the_promoted_one() {
    let (accepted_old, newest) = split_brain_run(Guards::default()).await;
    assert_eq!(accepted_old, Vec::<(String, i64)>::new(), "old primary's tokens accepted after the new one's");
    assert!(newest.values().all(|e| timeline_of(*e) == 2), "the receiver keeps timeline-2 epochs: {newest:?}");
}

/// Negative control of (b): without the timeline epochs the old primary's second attempt (its
/// epoch 2) beats the new primary's first (epoch 1): a zombie's effect counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_old_primary_without_timeline_epochs_wins_at_the_receiver() {
    let (accepted_old, _) = split_brain_run(Guards::default().without_timeline_epochs()).await;
    assert!(!accepted_old.is_empty(), "guard off: expected the old primary's calls accepted after the new one's");
}

/// Runs (b): the jobs are replicated, replication is cut, the standby promoted while the old
/// primary runs on; workers on the promoted standby complete every job; then workers that still
/// reach the old primary claim the same jobs there and call the receiver. Returns the old
/// primary's calls the receiver accepted (job, epoch) and the newest epoch per job at the end.
async fn split_brain_run(guards: Guards) -> (Vec<(String, i64)>, BTreeMap<String, i64>) {
    let pair = PgPair::start(Replication::Async).await;
    let schema = common::unique_schema();
    let queue = QueueName::new("split").expect("queue");
    let (old_url, new_url) = (url_of(pair.primary.addr()), url_of(pair.standby.addr()));
    let admin = fence_at(&old_url, &schema, Guards::default()).await;
    admin.migrate().await.expect("migrate");
    let keys = job_keys(12);
    let payloads: Vec<(JobKey, Vec<u8>)> = keys.iter().map(|k| (k.clone(), b"work".to_vec())).collect();
    admin.enqueue_many(&queue, &payloads).await.expect("enqueue");
    pair.wait_caught_up().await;
    pair.link.partition();
    pair.standby.promote().await;

    let ledger_home = common::pg().await;
    let receiver = Receiver::start(&ledger_home).await;
    let handler = calling_handler_after(receiver.url.clone(), Duration::ZERO);
    let new_side = Fleet::start(
        QueueAt { url: &new_url, schema: &schema, queue: &queue },
        ("new", 2),
        (5, 4),
        handler.clone(),
        guards,
    )
    .await;
    let promoted = fence_at(&new_url, &schema, Guards::default()).await;
    wait_all_completed(&promoted, &queue, &keys, Duration::from_secs(60)).await;
    new_side.stop().await;
    let new_calls = receiver.calls().len();

    // The old primary, still up, hands the same jobs out again: each of its calls is refused
    // (the handler fails the attempt, which is retried at the next epoch there, refused again).
    let old_side =
        Fleet::start(QueueAt { url: &old_url, schema: &schema, queue: &queue }, ("old", 2), (5, 4), handler, guards)
            .await;
    // Until every job was handed out there twice (epochs 1 and 2 of timeline 1): the second
    // attempt is the one that beats an epoch 1 of the new primary when the epochs ignore timelines.
    let twice = || {
        let calls = receiver.calls();
        keys.iter().all(|k| {
            let job = Receiver::job_name("split", k.as_str());
            calls[new_calls..].iter().any(|c| c.job == job && c.epoch == 2)
        })
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while !twice() {
        assert!(
            Instant::now() < deadline,
            "the old primary's workers did not call twice per job: {:?}",
            receiver.calls()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    old_side.stop().await;
    let calls = receiver.calls();
    assert!(calls[..new_calls].iter().all(|c| c.owner.as_deref().is_some_and(|o| o.starts_with("new-"))));
    let accepted_old: Vec<(String, i64)> = calls[new_calls..]
        .iter()
        .filter(|c| c.accepted && c.owner.as_deref().is_some_and(|o| o.starts_with("old-")))
        .map(|c| (c.job.clone(), c.epoch))
        .collect();
    let mut newest = BTreeMap::new();
    for k in &keys {
        let (epoch, _) = receiver.effect(&Receiver::job_name("split", k.as_str())).expect("an effect per job");
        newest.insert(k.as_str().to_owned(), epoch);
    }
    common::drop_schema(&ledger_home).await;
    (accepted_old, newest)
}

// ------------------------------------------------------------------------- pools that follow

/// One claim and commit through `fence`: Ok when the primary took both.
async fn claim_and_complete(fence: &PgFence, queue: &QueueName, name: &str) -> Result<i64, FenceError> {
    let owner = Owner::new("follower").expect("owner");
    match fence.claim(queue, &key(name), &owner, lease(10)).await? {
        Claim::Claimed(l) => {
            fence.complete(&l, b"ok").await?;
            Ok(l.epoch)
        }
        other => panic!("{name}: not claimed: {other:?}"),
    }
}

/// Tries [`claim_and_complete`] until it succeeds; how long it took. Panics after `within`.
async fn until_committed(fence: &PgFence, queue: &QueueName, name: &str, within: Duration) -> (Duration, i64) {
    let started = Instant::now();
    loop {
        match claim_and_complete(fence, queue, name).await {
            Ok(epoch) => return (started.elapsed(), epoch),
            Err(e) => {
                assert!(
                    e.is_not_primary() || e.is_connection_failure() || matches!(e, FenceError::StatementTimeout(_)),
                    "{name}: an error other than 'no primary' while failing over: {e}"
                );
                assert!(started.elapsed() < within, "{name}: no commit within {within:?}; last error {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// (d) A pool behind one address (a VIP) that comes to point at a standby: the sessions that
/// land there are closed, never used for a write; once that server is promoted the same fence
/// (no restart) commits again, within a bounded time.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_pool_behind_a_vip_that_points_at_a_standby_recovers() {
    let pair = PgPair::start(Replication::Async).await;
    let vip = Relay::start(pair.primary.addr()).await;
    let schema = common::unique_schema();
    let queue = QueueName::new("vip").expect("queue");
    let target = PgTarget::parse(&url_of(vip.addr())).expect("url").application_name("vip-fence");
    let fence = PgFence::connect_to(target).await.expect("connect").schema(schema.clone());
    fence.migrate().await.expect("migrate");
    assert_eq!(claim_and_complete(&fence, &queue, "before").await.expect("before"), 1);
    pair.wait_caught_up().await;

    pair.primary.kill().await;
    vip.point_to(pair.standby.addr());
    vip.drop_connections();
    // The address leads to a standby now: nothing commits, and no session there is kept.
    for _ in 0..3 {
        let e = claim_and_complete(&fence, &queue, "during").await.expect_err("a write on a standby");
        assert!(e.is_not_primary() || e.is_connection_failure(), "{e}");
    }
    let standby_url = url_of(pair.standby.addr());
    brokerfence_testkit::wait::eventually(Duration::from_secs(5), "no fence session left on the standby", || {
        let url = standby_url.clone();
        async move {
            let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&url).await.expect("standby");
            let n: i64 =
                sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'vip-fence'")
                    .fetch_one(&mut conn)
                    .await
                    .expect("count");
            n == 0
        }
    })
    .await;
    let promoted_at = Instant::now();
    pair.standby.promote().await;
    let (took, epoch) = until_committed(&fence, &queue, "after", Duration::from_secs(30)).await;
    assert_eq!(timeline_of(epoch), 2, "the first claim after the promotion is on timeline 2: {epoch}");
    let recovered: bool = sqlx::query_scalar("SELECT NOT pg_is_in_recovery()")
        .fetch_one(fence.pool())
        .await
        .expect("the pool's sessions are the primary's");
    assert!(recovered);
    eprintln!("failover (d): committed {took:?} after asking, {:?} after the promotion", promoted_at.elapsed());
}

/// (d) A multi-host URL (`postgres://h1,h2/db?target_session_attrs=read-write`), the standby
/// listed first: the fence connects to the primary; when the primary dies and the standby is
/// promoted, the same fence finds it and commits there, without a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_multi_host_url_follows_the_primary() {
    let pair = PgPair::start(Replication::Async).await;
    let url = format!(
        "postgres://postgres@{},{}/postgres?target_session_attrs=read-write",
        pair.standby.addr(),
        pair.primary.addr()
    );
    let target = PgTarget::parse(&url).expect("multi-host URL");
    assert_eq!(target.hosts().len(), 2);
    let schema = common::unique_schema();
    let queue = QueueName::new("multi").expect("queue");
    let fence = PgFence::connect_to(target).await.expect("connect").schema(schema.clone());
    fence.migrate().await.expect("migrate on the primary (the second host)");
    assert_eq!(claim_and_complete(&fence, &queue, "before").await.expect("before"), 1);
    pair.wait_caught_up().await;

    pair.primary.kill().await;
    pair.standby.promote().await;
    let promoted_at = Instant::now();
    let (took, epoch) = until_committed(&fence, &queue, "after", Duration::from_secs(30)).await;
    assert!(epoch > EPOCHS_PER_TIMELINE, "timeline-2 epoch: {epoch}");
    eprintln!("failover (d, multi-host): committed after {took:?} ({:?} after the promotion)", promoted_at.elapsed());

    // Every host a standby: a clear error at connect.
    let err = PgFence::connect(&format!("postgres://postgres@{}/postgres", pair.standby.addr())).await.map(drop);
    assert!(err.is_ok(), "the promoted standby is a primary now: {err:?}");
}

/// Every host a standby: the connect fails with [`FenceError::NotPrimary`] naming them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_connect_to_standbys_only_is_refused_clearly() {
    let pair = PgPair::start(Replication::Async).await;
    let url = format!("postgres://postgres@{}/postgres", pair.standby.addr());
    let err = PgFence::connect(&url).await.expect_err("a standby");
    assert!(matches!(err, FenceError::NotPrimary { .. }), "{err}");
    assert!(err.to_string().contains(&pair.standby.port().to_string()), "{err}");
}

// --------------------------------------------------------------------------- behind PgBouncer

/// The user and database of `DATABASE_URL` (the shared server), for a PgBouncer in front of it.
fn shared_user_and_db() -> (String, String) {
    let url = common::database_url();
    let options: sqlx::postgres::PgConnectOptions = url.parse().expect("DATABASE_URL");
    (options.get_username().to_owned(), options.get_database().unwrap_or("postgres").to_owned())
}

/// A PgBouncer in transaction mode in front of the shared server, with `ignore` as its
/// `ignore_startup_parameters`; the URL a user would write for it.
async fn bouncer(ignore: &str) -> (PgBouncer, String) {
    let shared: sqlx::postgres::PgConnectOptions = common::database_url().parse().expect("DATABASE_URL");
    let upstream = format!("{}:{}", shared.get_host(), shared.get_port()).parse().expect("upstream address");
    let (user, db) = shared_user_and_db();
    let bouncer = PgBouncer::start(upstream, "transaction", ignore, &[&user]).await;
    let url = bouncer.url(&user, &db);
    (bouncer, url)
}

/// (e) The table queue through PgBouncer in transaction mode, with the URL users write and
/// nothing else: the fence finds out it is behind a transaction pooler (PgBouncer refuses the
/// startup `options`, or drops them when told to ignore them), and two consumers drain 200 jobs,
/// each committed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_table_queue_through_pgbouncer_transaction_mode() {
    for ignore in ["extra_float_digits", "", "extra_float_digits,options"] {
        let (_bouncer, url) = bouncer(ignore).await;
        let schema = common::unique_schema();
        let fence = fence_at(&url, &schema, Guards::default()).await;
        assert_eq!(fence.get_pooler(), Pooler::Transaction, "ignore_startup_parameters = {ignore:?}");
        fence.migrate().await.expect("migrate through PgBouncer");
        let queue = QueueName::new("bounced").expect("queue");
        let keys = job_keys(200);
        let payloads: Vec<(JobKey, Vec<u8>)> = keys.iter().map(|k| (k.clone(), b"p".to_vec())).collect();
        fence.enqueue_many(&queue, &payloads).await.expect("enqueue");
        let ledger_home = common::pg().await;
        let receiver = Receiver::start(&ledger_home).await;
        let handler = calling_handler_after(receiver.url.clone(), Duration::from_millis(2));
        let fleet = Fleet::start(
            QueueAt { url: &url, schema: &schema, queue: &queue },
            ("pooled", 2),
            (5, 8),
            handler,
            Guards::default(),
        )
        .await;
        wait_all_completed(&fence, &queue, &keys, Duration::from_secs(60)).await;
        fleet.stop().await;
        let calls = receiver.calls();
        assert_eq!(calls.len(), 200, "one call per job: {ignore:?}");
        assert!(calls.iter().all(|c| c.accepted && c.epoch == 1), "{ignore:?}");
        common::drop_schema(&ledger_home).await;
        common::drop_schema(&fence).await;
    }
}

/// (e) The time limits hold behind the pooler: they are set in every transaction, so a claim
/// that waits for a row lock held elsewhere gives up after the lock limit instead of hanging.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_pgbouncer_time_limits_hold_per_transaction() {
    let (_bouncer, url) = bouncer("extra_float_digits").await;
    let schema = common::unique_schema();
    let timeouts = PgTimeouts { lock: Duration::from_millis(300), ..PgTimeouts::default() };
    let fence = PgFence::connect_to(PgTarget::parse(&url).expect("url").timeouts(timeouts))
        .await
        .expect("connect")
        .schema(schema.clone());
    assert_eq!(fence.get_pooler(), Pooler::Transaction);
    fence.migrate().await.expect("migrate");
    let queue = QueueName::new("locked").expect("queue");
    assert!(fence.enqueue(&queue, &key("held"), b"x").await.expect("enqueue"));
    // Another session holds the job's row.
    let mut other = common::pg_on(schema.clone()).await.pool().begin().await.expect("begin");
    sqlx::query(sqlx::AssertSqlSafe(format!("SELECT 1 FROM {}.jobs WHERE key = 'held' FOR UPDATE", schema.as_str())))
        .execute(&mut *other)
        .await
        .expect("lock the row");
    let started = Instant::now();
    let (held, owner) = (key("held"), Owner::new("o").expect("owner"));
    let claim = fence.claim(&queue, &held, &owner, lease(5));
    let err = tokio::time::timeout(Duration::from_secs(15), claim)
        .await
        .expect("the claim gave up by itself (a lock limit that did not reach the server would leave it waiting)")
        .expect_err("the row is locked");
    assert!(matches!(err, FenceError::LockTimeout(_)), "{err}");
    assert!(started.elapsed() < Duration::from_secs(3), "gave up after {:?}", started.elapsed());
    other.rollback().await.expect("rollback");
    common::drop_schema(&fence).await;
}

/// Defect (CI at 4494902): `migrate` through a transaction-mode pooler asked whether a migration
/// was recorded outside a transaction, as an extended-protocol query: sqlx parses it (one
/// `Sync`), then binds it (another), and PgBouncer may hand the bind to another server
/// connection, which has no such statement ("unnamed prepared statement does not exist"). The
/// test's PgBouncer hands out its server connections in turn (`server_round_robin`), with two of
/// them open before `migrate`, so a statement split across server connections fails every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_migrate_through_pgbouncer_whose_server_connections_rotate() {
    use sqlx::Connection as _;
    let (_bouncer, url) = bouncer("extra_float_digits").await;
    // Two server connections open (two transactions at once), then idle in the pooler.
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut conn = sqlx::PgConnection::connect(&url).await.expect("connect through PgBouncer");
        sqlx::raw_sql("BEGIN; SELECT 1").execute(&mut conn).await.expect("begin");
        held.push(conn);
    }
    for mut conn in held {
        sqlx::raw_sql("COMMIT").execute(&mut conn).await.expect("commit");
    }
    for round in 0..2 {
        let schema = common::unique_schema();
        let fence = fence_at(&url, &schema, Guards::default()).await;
        assert_eq!(fence.get_pooler(), Pooler::Transaction);
        fence.migrate().await.unwrap_or_else(|e| panic!("migrate through PgBouncer (round {round}): {e}"));
        fence.migrate().await.expect("migrate again: nothing to do");
        fence.check_schema().await.expect("migrated");
        common::drop_schema(&fence).await;
    }
}

/// (f) The CLI through PgBouncer: `migrate` and `status` with the pooler's URL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_cli_migrate_and_status_through_pgbouncer() {
    let (_bouncer, url) = bouncer("extra_float_digits").await;
    let schema = common::unique_schema();
    let bin = brokerfence_testkit::programs::bin("brokerfence");
    for args in [vec!["migrate"], vec!["status", "--json"]] {
        let mut cmd = std::process::Command::new(&bin);
        cmd.args(&args).args(["--database-url", &url, "--schema", schema.as_str()]).env("NO_COLOR", "1");
        let out = tokio::task::spawn_blocking(move || cmd.output()).await.expect("join").expect("run the CLI");
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "brokerfence {args:?} through PgBouncer: {stdout}\n{stderr}");
        if args[0] == "status" {
            let v: serde_json::Value = serde_json::from_str(&stdout).expect("status --json");
            assert!(v.is_object() || v.is_array(), "{stdout}");
        }
    }
    let fence = common::pg_on(schema).await;
    fence.check_schema().await.expect("migrated through PgBouncer");
    common::drop_schema(&fence).await;
}

/// (e) `SqsSource` (LocalStack) and the Redis stream source with their fence behind PgBouncer in
/// transaction mode: every message and entry is processed once (epoch 1), acknowledged, and
/// committed through the pooler.
#[cfg(all(feature = "sqs", feature = "redis"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failover_sqs_and_redis_sources_through_pgbouncer() {
    use brokerfence::redis::{KeyFrom, StreamSource};
    use brokerfence::sqs::{KeyStrategy, SqsConfig, SqsSource};
    use brokerfence_testkit::redis::{Env, consumer_config, spawn_consumer, xadd_job};
    use brokerfence_testkit::sqs::{TestQueue, depth, send, sqs};

    let (_bouncer, url) = bouncer("extra_float_digits").await;
    let schema = common::unique_schema();
    let fence = fence_at(&url, &schema, Guards::default()).await;
    assert_eq!(fence.get_pooler(), Pooler::Transaction);
    fence.migrate().await.expect("migrate through PgBouncer");
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    let ledger_home = common::pg().await;
    let receiver = Receiver::start(&ledger_home).await;

    // SQS: 20 messages.
    let client = sqs().await;
    let q = TestQueue::new(&client, "bounced", 5).await;
    for i in 0..20 {
        send(&client, &q.url, &format!("sqs-{i}")).await;
    }
    let source = SqsSource::new(
        client.clone(),
        SqsConfig::new(&q.url).expect("queue url").key(KeyStrategy::Auto).wait_time(Duration::from_secs(1)),
    );
    let sqs_run = spawn_consumer(
        source,
        Arc::clone(&store),
        "sqs-bounced",
        consumer_config(5, 8),
        calling_handler_after(receiver.url.clone(), Duration::ZERO),
    );

    // Redis: 20 stream entries.
    let env = Env::new().await;
    let stream = env.name("bounced");
    let mut conn = env.conn();
    for i in 0..20 {
        xadd_job(&mut conn, &stream, &format!("entry-{i}"), "body").await;
    }
    let source = StreamSource::new(env.redis.clone(), QueueName::new(stream.clone()).expect("queue"), &stream, "g")
        .expect("stream source")
        .key_from(KeyFrom::Field("key".into()))
        .block(Duration::from_millis(200));
    let redis_run = spawn_consumer(
        source,
        Arc::clone(&store),
        "redis-bounced",
        consumer_config(5, 8),
        calling_handler_after(receiver.url.clone(), Duration::ZERO),
    );

    brokerfence_testkit::wait::wait_for(
        "20 SQS and 20 Redis jobs completed and acknowledged",
        Duration::from_secs(60),
        || {
            let (s, r) = (sqs_run.snapshot(), redis_run.snapshot());
            async move { (s.completions == 20 && s.acks == 20 && r.completions == 20 && r.acks == 20).then_some(()) }
        },
    )
    .await;
    let (s, r) = (sqs_run.shutdown(Duration::from_secs(15)).await, redis_run.shutdown(Duration::from_secs(15)).await);
    assert_eq!((s.claims, s.fenced_rejections, s.lease_losses), (20, 0, 0), "{s}");
    assert_eq!((r.claims, r.fenced_rejections, r.lease_losses), (20, 0, 0), "{r}");
    let calls = receiver.calls();
    assert_eq!(calls.len(), 40);
    assert!(calls.iter().all(|c| c.accepted && c.epoch == 1), "{calls:?}");
    assert_eq!(depth(&client, &q.url).await, 0, "every SQS message deleted");
    q.delete(&client).await;
    env.cleanup().await;
    common::drop_schema(&ledger_home).await;
    common::drop_schema(&fence).await;
}

/// (e) Told there is no pooler (`?pooler=none`), a connect that PgBouncer refuses for a startup
/// parameter fails at once with [`FenceError::PoolerRefused`], which names the parameter and both
/// ways out (the URL setting, PgBouncer's `ignore_startup_parameters`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_pgbouncer_refused_startup_names_the_setting() {
    let (_bouncer, url) = bouncer("").await;
    let err = PgFence::connect(&format!("{url}?pooler=none")).await.expect_err("PgBouncer refuses the parameters");
    let FenceError::PoolerRefused { ref parameter, .. } = err else { panic!("{err}") };
    assert!(["extra_float_digits", "options"].contains(&parameter.as_str()), "{err}");
    let text = err.to_string();
    assert!(text.contains("?pooler=transaction") && text.contains("ignore_startup_parameters"), "{text}");
    // The URL as users write it finds the pooler out by itself.
    assert_eq!(PgFence::connect(&url).await.expect("auto").get_pooler(), Pooler::Transaction);
}
