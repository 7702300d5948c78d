//! Retention (issue 14): pruning finished jobs and ledger rows by age, in bounded batches, with
//! one pruner at a time; epochs that never repeat for a key after its row is pruned; SQLite
//! giving the space back. Real PostgreSQL and real SQLite files; every test name contains
//! `retention` (`cargo test --workspace --all-features retention`).
//!
//! Rows are aged by moving their `updated_at` back (the database clock is what pruning reads):
//! a test never waits days.

use brokerfence_testkit::store as common;

use std::sync::Arc;
use std::time::Duration;

use brokerfence::TableQueue;
use brokerfence::ledger::{Ledger, PgLedger, SqliteLedger, Verdict};
use brokerfence::retention::{QueueRetention, Retention};
use brokerfence::{
    Claim, FenceStore, JobContext, JobState, Lease, LeaseDuration, Owner, PgFence, QueueName, SqliteFence,
    SupervisorConfig,
};
use brokerfence::{Consumer, ConsumerConfig};
use common::{TestStore, key, lease};
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

const HOUR: Duration = Duration::from_secs(3600);

/// What these tests need beyond [`TestStore`]: moving rows back in time.
trait Aged: TestStore {
    /// Moves the `updated_at` of job (`queue`, `key`) back by `secs`.
    fn backdate(&self, queue: &QueueName, key: &str, secs: i64) -> impl Future<Output = ()> + Send;
    /// Moves the `updated_at` of ledger row (`scope`, `job`) back by `secs`.
    fn backdate_ledger(&self, scope: &str, job: &str, secs: i64) -> impl Future<Output = ()> + Send;
    /// Job rows of `queue`.
    fn job_rows(&self, queue: &QueueName) -> impl Future<Output = i64> + Send;
}

impl Aged for PgFence {
    async fn backdate(&self, queue: &QueueName, key: &str, secs: i64) {
        let s = self.get_schema().as_str();
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {s}.jobs SET updated_at = updated_at - $1 * interval '1 second' WHERE queue = $2 AND key = $3"
        )))
        .bind(secs)
        .bind(queue.as_str().to_owned())
        .bind(key.to_owned())
        .execute(self.pool())
        .await
        .expect("backdate job");
    }

    async fn backdate_ledger(&self, scope: &str, job: &str, secs: i64) {
        let s = self.get_schema().as_str();
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {s}.ledger SET updated_at = updated_at - $1 * interval '1 second' WHERE scope = $2 AND job = $3"
        )))
        .bind(secs)
        .bind(scope.to_owned())
        .bind(job.to_owned())
        .execute(self.pool())
        .await
        .expect("backdate ledger row");
    }

    async fn job_rows(&self, queue: &QueueName) -> i64 {
        let s = self.get_schema().as_str();
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {s}.jobs WHERE queue = $1")))
            .bind(queue.as_str().to_owned())
            .fetch_one(self.pool())
            .await
            .expect("count jobs")
    }
}

impl Aged for SqliteFence {
    async fn backdate(&self, queue: &QueueName, key: &str, secs: i64) {
        sqlx::query("UPDATE brokerfence_jobs SET updated_at = updated_at - ?1 * 1000 WHERE queue = ?2 AND key = ?3")
            .bind(secs)
            .bind(queue.as_str().to_owned())
            .bind(key.to_owned())
            .execute(self.pool())
            .await
            .expect("backdate job");
    }

    async fn backdate_ledger(&self, scope: &str, job: &str, secs: i64) {
        sqlx::query("UPDATE brokerfence_ledger SET updated_at = updated_at - ?1 * 1000 WHERE scope = ?2 AND job = ?3")
            .bind(secs)
            .bind(scope.to_owned())
            .bind(job.to_owned())
            .execute(self.pool())
            .await
            .expect("backdate ledger row");
    }

    async fn job_rows(&self, queue: &QueueName) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM brokerfence_jobs WHERE queue = ?1")
            .bind(queue.as_str().to_owned())
            .fetch_one(self.pool())
            .await
            .expect("count jobs")
    }
}

fn queue(name: &str) -> QueueName {
    QueueName::new(common::unique(name)).expect("queue")
}

fn claimed(c: Claim) -> Lease {
    match c {
        Claim::Claimed(l) => l,
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// A job of `q`/`k` in `state` (completed, dead, failed, running, pending), aged by `secs`.
async fn job_in_state<S: Aged>(s: &S, q: &QueueName, k: &str, state: JobState, secs: i64) {
    let me = Owner::unique("w");
    match state {
        JobState::Pending => assert!(s.enqueue(q, &key(k), b"p").await.unwrap()),
        _ => {
            let l = claimed(s.claim(q, &key(k), &me, lease(30)).await.unwrap());
            match state {
                JobState::Completed => s.complete(&l, b"ok").await.unwrap(),
                JobState::Dead => drop(s.fail(&l, "boom", false, &Default::default()).await.unwrap()),
                JobState::Failed => drop(s.fail(&l, "again", true, &Default::default()).await.unwrap()),
                _ => {}
            }
        }
    }
    s.backdate(q, k, secs).await;
    assert_eq!(s.job(q, &key(k)).await.unwrap().unwrap().state, state);
}

// ---------------------------------------------------------------------------------------------
// Ages per state and per queue; only completed and dead rows are ever pruned.
// ---------------------------------------------------------------------------------------------

/// Covers: pruning honours each terminal state's age and each queue's policy, and never touches
/// pending, running or failed jobs however old, nor a queue without a policy.
async fn ages_per_state_and_queue<S: Aged>(s: S) {
    let (a, b, c) = (queue("ret-a"), queue("ret-b"), queue("ret-c"));
    // Queue a: completed kept 1 h, dead 3 h.
    job_in_state(&s, &a, "c-old", JobState::Completed, 2 * 3600).await;
    job_in_state(&s, &a, "c-new", JobState::Completed, 30 * 60).await;
    job_in_state(&s, &a, "d-mid", JobState::Dead, 2 * 3600).await;
    job_in_state(&s, &a, "d-old", JobState::Dead, 4 * 3600).await;
    for (k, st) in [("p", JobState::Pending), ("r", JobState::Running), ("f", JobState::Failed)] {
        job_in_state(&s, &a, k, st, 100 * 86_400).await;
    }
    // Queue b: completed forever, dead 1 h. Queue c: no policy at all.
    job_in_state(&s, &b, "c-old", JobState::Completed, 100 * 86_400).await;
    job_in_state(&s, &b, "d-old", JobState::Dead, 2 * 3600).await;
    job_in_state(&s, &c, "c-old", JobState::Completed, 100 * 86_400).await;
    let retention = Retention::new()
        .queue(a.clone(), QueueRetention { completed: Some(HOUR), dead: Some(3 * HOUR) })
        .queue(b.clone(), QueueRetention { completed: None, dead: Some(HOUR) });
    let report = s.prune(&retention).await.unwrap();
    assert_eq!((report.completed, report.dead, report.contended), (1, 2, false), "{report:?}");
    let gone = |q: &QueueName, k: &'static str| {
        let (s, q) = (s.clone(), q.clone());
        async move { s.job(&q, &key(k)).await.unwrap().is_none() }
    };
    assert!(gone(&a, "c-old").await && gone(&a, "d-old").await && gone(&b, "d-old").await);
    for k in ["c-new", "d-mid", "p", "r", "f"] {
        assert!(!gone(&a, k).await, "{k} was pruned");
    }
    assert!(!gone(&b, "c-old").await && !gone(&c, "c-old").await);
    // Nothing left to prune: a second run deletes nothing.
    assert_eq!(s.prune(&retention).await.unwrap().total(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_prunes_by_age_per_state_and_queue_pg() {
    ages_per_state_and_queue(common::pg().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_prunes_by_age_per_state_and_queue_sqlite() {
    ages_per_state_and_queue(common::sqlite().await).await;
}

// ---------------------------------------------------------------------------------------------
// Bounded batches.
// ---------------------------------------------------------------------------------------------

/// Covers: pruning deletes at most `batch_size` rows per transaction (25 rows, batches of 10:
/// three transactions) and carries on until nothing old is left.
async fn bounded_batches<S: Aged>(s: S) {
    let q = queue("ret-batch");
    let me = Owner::unique("w");
    let keys: Vec<_> = (0..25).map(|i| key(&format!("k{i}"))).collect();
    let leases: Vec<_> =
        s.claim_batch(&q, &keys, &me, lease(30)).await.unwrap().into_iter().map(claimed).collect::<Vec<_>>();
    let items: Vec<_> = leases.iter().map(|l| (l.clone(), b"ok".to_vec())).collect();
    assert!(s.complete_batch(&items).await.unwrap().iter().all(Result::is_ok));
    for k in &keys {
        s.backdate(&q, k.as_str(), 2 * 3600).await;
    }
    let retention = Retention::new().queue(q.clone(), QueueRetention::completed_for(HOUR)).batch_size(10);
    let report = s.prune(&retention).await.unwrap();
    assert_eq!((report.completed, report.batches), (25, 3), "{report:?}");
    assert_eq!(s.job_rows(&q).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_prunes_in_bounded_batches_pg() {
    bounded_batches(common::pg().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_prunes_in_bounded_batches_sqlite() {
    bounded_batches(common::sqlite().await).await;
}

// ---------------------------------------------------------------------------------------------
// Epochs never repeat for a key.
// ---------------------------------------------------------------------------------------------

/// Covers the defect of issue 14: a key whose row was pruned started at epoch 1 again, and a
/// receiver that kept epoch 3 for it refused the new job forever. Now the key completes at epoch
/// 3 (the ledger accepted 3), its row is pruned, the same key is sent again: the new epoch is
/// above 3, the ledger accepts it and still refuses every older epoch. The same through the
/// table queue (enqueue after the prune, claim_next).
async fn key_reuse_after_prune<S: Aged>(s: S) {
    let q = queue("ret-reuse");
    let me = Owner::unique("w");
    let ledger: Ledger = s.ledger("receiver");
    let job = format!("{q}/order-1");
    // Three claims of one key: released twice, completed under epoch 3.
    let mut l = claimed(s.claim(&q, &key("order-1"), &me, lease(30)).await.unwrap());
    for _ in 0..2 {
        assert!(ledger.accept(&job, l.epoch).await.unwrap().is_accepted());
        s.release(&l).await.unwrap();
        l = claimed(s.claim(&q, &key("order-1"), &me, lease(30)).await.unwrap());
    }
    assert_eq!(l.epoch, 3);
    assert_eq!(ledger.accept(&job, 3).await.unwrap(), Verdict::Accepted { newest: 3 });
    s.complete(&l, b"done").await.unwrap();
    // While the row exists the key deduplicates.
    assert!(matches!(s.claim(&q, &key("order-1"), &me, lease(30)).await.unwrap(), Claim::Done { epoch: 3 }));

    s.backdate(&q, "order-1", 2 * 3600).await;
    let retention = Retention::new().queue(q.clone(), QueueRetention::completed_for(HOUR));
    assert_eq!(s.prune(&retention).await.unwrap().completed, 1);
    assert!(s.job(&q, &key("order-1")).await.unwrap().is_none());

    // Sent again: a new job, above every epoch the key ever had.
    let again = claimed(s.claim(&q, &key("order-1"), &me, lease(30)).await.unwrap());
    assert!(again.epoch > 3, "epoch {} repeats an epoch of the pruned row", again.epoch);
    assert_eq!(ledger.accept(&job, again.epoch).await.unwrap(), Verdict::Accepted { newest: again.epoch });
    for old in 1..=3 {
        assert_eq!(ledger.accept(&job, old).await.unwrap(), Verdict::Stale { newest: again.epoch }, "epoch {old}");
    }
    s.complete(&again, b"done again").await.unwrap();

    // Table queue: a key enqueued after its row was pruned is claimed above the floor too.
    let t = queue("ret-reuse-table");
    assert!(s.enqueue(&t, &key("mail-1"), b"x").await.unwrap());
    let first = s.claim_next(&t, &me, lease(30), 1).await.unwrap().remove(0).lease;
    s.complete(&first, b"sent").await.unwrap();
    s.backdate(&t, "mail-1", 2 * 3600).await;
    let retention = Retention::new().queue(t.clone(), QueueRetention::completed_for(HOUR));
    assert_eq!(s.prune(&retention).await.unwrap().completed, 1);
    assert!(s.enqueue(&t, &key("mail-1"), b"x").await.unwrap(), "a pruned key is a new job");
    let second = s.claim_next(&t, &me, lease(30), 1).await.unwrap().remove(0).lease;
    assert!(second.epoch > first.epoch, "{} after {}", second.epoch, first.epoch);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_key_reuse_after_prune_gets_a_newer_epoch_pg() {
    key_reuse_after_prune(common::pg().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_key_reuse_after_prune_gets_a_newer_epoch_sqlite() {
    key_reuse_after_prune(common::sqlite().await).await;
}

/// Covers the race of a prune batch with a claim of the key it deletes (PostgreSQL, where they
/// run concurrently): a transaction does what a prune batch does (takes the queue's floor lock,
/// deletes the key's row, raises the floor) and stays open; a claim of that key meanwhile must
/// wait and then start above the new floor. Guard: the floor lock `epoch_floor()` takes. Without
/// it the claim waits only for the deleted row, then inserts with the floor it read before the
/// delete committed: epoch 1 again (checked with psql: the same scenario with a copy of
/// `epoch_floor` without its `pg_advisory_xact_lock_shared` gave the re-created row epoch 1, the
/// real function epoch 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_a_claim_racing_a_prune_batch_starts_above_the_new_floor_pg() {
    let s = common::pg().await;
    let sc = s.get_schema().as_str().to_owned();
    let q = queue("ret-race");
    let me = Owner::unique("w");
    let l = claimed(s.claim(&q, &key("k"), &me, lease(30)).await.unwrap());
    s.complete(&l, b"ok").await.unwrap();
    assert_eq!(l.epoch, 1);

    let mut tx = s.pool().begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(format!("brokerfence.floor.{sc}.{q}"))
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query(AssertSqlSafe(format!("DELETE FROM {sc}.jobs WHERE queue = $1 AND key = 'k'")))
        .bind(q.as_str().to_owned())
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query(AssertSqlSafe(format!("INSERT INTO {sc}.epoch_floors (queue, floor) VALUES ($1, 1)")))
        .bind(q.as_str().to_owned())
        .execute(&mut *tx)
        .await
        .unwrap();
    let racer = tokio::spawn({
        let (s, q, me) = (s.clone(), q.clone(), me.clone());
        async move { s.claim(&q, &key("k"), &me, lease(30)).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!racer.is_finished(), "the claim must wait for the prune batch");
    tx.commit().await.unwrap();
    let again = claimed(racer.await.unwrap().unwrap());
    assert_eq!(again.epoch, 2, "the claim starts above the floor the batch raised");
}

// ---------------------------------------------------------------------------------------------
// The ledger.
// ---------------------------------------------------------------------------------------------

/// Covers: ledger rows are pruned by their own age and per scope (a scope not listed keeps its
/// rows), through `FenceStore::prune` and through the ledger's own `prune`.
async fn ledger_pruning<S: Aged>(s: S, direct: impl AsyncFn(&S, Duration) -> u64) {
    let (a, b) = (s.ledger("ret-a"), s.ledger("ret-b"));
    for (l, job) in [(&a, "old"), (&a, "new"), (&b, "old")] {
        assert!(l.accept(job, 5).await.unwrap().is_accepted());
    }
    s.backdate_ledger("ret-a", "old", 2 * 3600).await;
    s.backdate_ledger("ret-b", "old", 2 * 3600).await;
    let report = s.prune(&Retention::new().ledger("ret-a", HOUR)).await.unwrap();
    assert_eq!(report.ledger, 1, "{report:?}");
    assert_eq!(a.newest("old").await.unwrap(), None);
    assert_eq!(a.newest("new").await.unwrap(), Some(5));
    assert_eq!(b.newest("old").await.unwrap(), Some(5));
    // The ledger's own call, for receivers without a consumer.
    assert_eq!(direct(&s, HOUR).await, 1);
    assert_eq!(b.newest("old").await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_prunes_ledger_rows_by_age_and_scope_pg() {
    ledger_pruning(common::pg().await, async |s: &PgFence, age| {
        PgLedger::new(s, "ret-b").prune(age, 100).await.unwrap().ledger
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_prunes_ledger_rows_by_age_and_scope_sqlite() {
    ledger_pruning(common::sqlite().await, async |s: &SqliteFence, age| {
        SqliteLedger::new(s, "ret-b").prune(age, 100).await.unwrap().ledger
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// One pruner at a time (PostgreSQL).
// ---------------------------------------------------------------------------------------------

/// Covers: at most one pruner per schema at a time. While another holds the pruner lock, a
/// prune call deletes nothing and says it was contended; once the lock is free it prunes. Two
/// pruners started together delete every row once between them, without an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_two_pruners_never_prune_at_once_pg() {
    let s = common::pg().await;
    let q = queue("ret-one");
    let me = Owner::unique("w");
    let keys: Vec<_> = (0..200).map(|i| key(&format!("k{i}"))).collect();
    let leases: Vec<_> = s.claim_batch(&q, &keys, &me, lease(30)).await.unwrap().into_iter().map(claimed).collect();
    let items: Vec<_> = leases.iter().map(|l| (l.clone(), b"ok".to_vec())).collect();
    assert!(s.complete_batch(&items).await.unwrap().iter().all(Result::is_ok));
    let sc = s.get_schema().as_str().to_owned();
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {sc}.jobs SET updated_at = updated_at - interval '2 hours' WHERE queue = $1"
    )))
    .bind(q.as_str().to_owned())
    .execute(s.pool())
    .await
    .unwrap();
    let retention = Retention::new()
        .queue(q.clone(), QueueRetention::completed_for(HOUR))
        .batch_size(10)
        .pause_between_batches(Duration::from_millis(1));

    // Another pruner at work: this one stands back.
    let mut other = s.pool().begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(format!("brokerfence.pruner.{sc}"))
        .execute(&mut *other)
        .await
        .unwrap();
    let report = s.prune(&retention).await.unwrap();
    assert!(report.contended && report.total() == 0, "{report:?}");
    assert_eq!(s.job_rows(&q).await, 200);
    other.rollback().await.unwrap();

    // Two pruners (two processes' pools) at once: every row deleted once, no error.
    let t = s.reopen().await;
    let (r1, r2) = tokio::join!(s.prune(&retention), t.prune(&retention));
    let (r1, r2) = (r1.unwrap(), r2.unwrap());
    let mut total = r1.completed + r2.completed;
    // A pruner that found the other at work stopped early; one more run finishes the job.
    if r1.contended || r2.contended {
        total += s.prune(&retention).await.unwrap().completed;
    }
    assert_eq!(total, 200, "{r1:?} {r2:?}");
    assert_eq!(s.job_rows(&q).await, 0);
}

// ---------------------------------------------------------------------------------------------
// The consumer runtime's background pruner.
// ---------------------------------------------------------------------------------------------

/// Covers: `ConsumerConfig::retention` prunes in the background while the consumer runs (here
/// every 100 ms): old finished jobs of the listed queue disappear without any explicit call,
/// while the consumer keeps processing its own jobs.
async fn background_pruner<S: Aged>(s: S) {
    let (old, work) = (queue("ret-old"), queue("ret-work"));
    for i in 0..5 {
        job_in_state(&s, &old, &format!("k{i}"), JobState::Completed, 2 * 3600).await;
    }
    let store: Arc<dyn FenceStore> = Arc::new(s.clone());
    let jobs: Vec<_> = (0..5).map(|i| (key(&format!("w{i}")), b"p".to_vec())).collect();
    store.enqueue_many(&work, &jobs).await.unwrap();
    let retention =
        Retention::new().queue(old.clone(), QueueRetention::completed_for(HOUR)).every(Duration::from_millis(100));
    let config = ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(5).unwrap()))
        .concurrency(2)
        .grace(Duration::from_secs(2))
        .retention(retention);
    let consumer = Consumer::new(
        TableQueue::new(Arc::clone(&store), work.clone()).idle_wait(Duration::from_millis(20)),
        Arc::clone(&store),
        config,
    );
    let metrics = consumer.metrics();
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let stop = stop.clone();
        async move { consumer.run(|ctx: JobContext| async move { Ok(ctx.payload().to_vec()) }, stop).await }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while s.job_rows(&old).await > 0 {
        assert!(tokio::time::Instant::now() < deadline, "the background pruner did not prune");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    brokerfence_testkit::wait::wait_for_completions(&metrics, 5, Duration::from_secs(15)).await;
    stop.cancel();
    run.await.unwrap().unwrap();
    // The consumer's own fresh completions are younger than the age: kept.
    assert_eq!(s.job_rows(&work).await, 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_background_pruner_runs_in_the_consumer_pg() {
    background_pruner(common::pg().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_background_pruner_runs_in_the_consumer_sqlite() {
    background_pruner(common::sqlite().await).await;
}

// ---------------------------------------------------------------------------------------------
// Plans (PostgreSQL): the pruner's read is an index scan on an unanalyzed table.
// ---------------------------------------------------------------------------------------------

/// Covers: the pruner's reads (the text of its statements' `victims` part) use `jobs_finished`
/// and `ledger_age` with the age as an index condition, never a sequential scan, on a freshly
/// migrated (never analyzed; autovacuum is off here) schema, both with the fence's session
/// settings (its pool) and on a plain connection (generic plans, as the fence keeps).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_prune_reads_by_index_on_an_unanalyzed_table_pg() {
    let s = common::pg().await;
    let sc = s.get_schema().as_str();
    let jobs = format!(
        "SELECT t.ctid FROM {sc}.jobs t WHERE t.queue = $1 AND t.finished IS NOT NULL AND t.finished = $2 \
         AND t.updated_at < statement_timestamp() - $3::bigint * interval '1 millisecond' \
         ORDER BY t.updated_at LIMIT $4 FOR UPDATE SKIP LOCKED"
    );
    let ledger = format!(
        "SELECT l.ctid FROM {sc}.ledger l WHERE l.scope = $1 \
         AND l.updated_at < statement_timestamp() - $2::bigint * interval '1 millisecond' \
         ORDER BY l.updated_at LIMIT $3 FOR UPDATE SKIP LOCKED"
    );
    let plain = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&common::database_url()).await.unwrap();
    for (pool, label) in [(s.pool().clone(), "fence pool"), (plain, "plain connection")] {
        let mut conn = pool.acquire().await.unwrap();
        sqlx::raw_sql("SET plan_cache_mode = force_generic_plan").execute(&mut *conn).await.unwrap();
        for (name, stmt, args, index) in [
            ("rj", &jobs, "('q', 'completed', 3600000, 1000)", "jobs_finished"),
            ("rl", &ledger, "('scope', 3600000, 1000)", "ledger_age"),
        ] {
            sqlx::raw_sql(AssertSqlSafe(format!("PREPARE {name} AS {stmt}"))).execute(&mut *conn).await.unwrap();
            let plan: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!("EXPLAIN EXECUTE {name}{args}")))
                .fetch_all(&mut *conn)
                .await
                .unwrap();
            let plan = plan.join("\n");
            println!("{label}, {name}:\n{plan}");
            assert!(plan.contains(index) && !plan.contains("Seq Scan"), "{label}: {plan}");
            // The age is an index condition: the scan stops at the cutoff (a filter would read
            // every younger row of the queue once fewer than a batch are old).
            assert!(plan.lines().any(|l| l.contains("Index Cond") && l.contains("updated_at <")), "{label}: {plan}");
            sqlx::raw_sql(AssertSqlSafe(format!("DEALLOCATE {name}"))).execute(&mut *conn).await.unwrap();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// SQLite gives the space back.
// ---------------------------------------------------------------------------------------------

/// 400 completed jobs of 8 KiB each, aged and pruned: the pages they held are free.
async fn fill_and_prune(s: &SqliteFence) {
    let q = queue("ret-space");
    let jobs: Vec<_> = (0..400).map(|i| (key(&format!("k{i}")), vec![7u8; 8192])).collect();
    s.enqueue_many(&q, &jobs).await.unwrap();
    let me = Owner::unique("w");
    let got = s.claim_next(&q, &me, lease(30), 400).await.unwrap();
    let items: Vec<_> = got.iter().map(|c| (c.lease.clone(), Vec::new())).collect();
    assert!(s.complete_batch(&items).await.unwrap().iter().all(Result::is_ok));
    sqlx::query("UPDATE brokerfence_jobs SET updated_at = updated_at - 7200000 WHERE queue = ?1")
        .bind(q.as_str().to_owned())
        .execute(s.pool())
        .await
        .unwrap();
    let report = s.prune(&Retention::new().queue(q, QueueRetention::completed_for(HOUR))).await.unwrap();
    assert_eq!(report.completed, 400);
}

/// Covers: on a file made by this release (`auto_vacuum = INCREMENTAL` from the start), pruning
/// plus `reclaim_space` gives the pages back: the free list empties and the file gets shorter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_sqlite_reclaims_space_after_pruning() {
    let path = common::sqlite_path();
    let s = common::sqlite_on(&path).await;
    s.migrate().await.unwrap();
    fill_and_prune(&s).await;
    let before = std::fs::metadata(&path).unwrap().len();
    let report = s.reclaim_space(None).await.unwrap();
    println!("{report:?}, file {before} bytes before");
    assert_eq!(report.auto_vacuum, 2, "new files are incremental");
    assert!(report.free_pages_before > 400, "{report:?}");
    assert_eq!(report.free_pages_after, 0, "{report:?}");
    let after = std::fs::metadata(&path).unwrap().len();
    println!("file {after} bytes after");
    assert!(after < before / 2, "file {before} -> {after} bytes");
}

/// Covers: a file made before (`auto_vacuum = NONE`) gives nothing back through
/// `reclaim_space` (and says so), until `enable_incremental_vacuum` rewrote it once; then it does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_sqlite_existing_file_needs_one_vacuum_to_reclaim() {
    let path = common::sqlite_path();
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
    let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(2).connect_with(options).await.unwrap();
    let s = SqliteFence::new(pool);
    s.migrate().await.unwrap();
    fill_and_prune(&s).await;
    let report = s.reclaim_space(None).await.unwrap();
    assert_eq!(report.auto_vacuum, 0, "{report:?}");
    assert!(report.free_pages_after > 400, "nothing given back without the setting: {report:?}");
    s.enable_incremental_vacuum().await.unwrap();
    let after_vacuum = s.reclaim_space(None).await.unwrap();
    assert_eq!((after_vacuum.auto_vacuum, after_vacuum.free_pages_after), (2, 0), "{after_vacuum:?}");
    assert!(after_vacuum.pages_after < report.pages_after / 2, "{report:?} -> {after_vacuum:?}");
    // From now on, pruning and reclaiming works on this file like on a new one.
    fill_and_prune(&s).await;
    let again = s.reclaim_space(Some(1_000_000)).await.unwrap();
    assert!(again.free_pages_before > 400 && again.free_pages_after == 0, "{again:?}");
}

// ---------------------------------------------------------------------------------------------
// Figures (not a timed test: run with `--ignored --nocapture`).
// ---------------------------------------------------------------------------------------------

/// Prints the prune rate on PostgreSQL: 200,000 completed jobs (generated by SQL, aged two
/// hours) deleted in batches of 1,000, and a claim's latency while a pruner runs.
/// `cargo test --workspace --all-features retention_prune_rate -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "figures, not a test"]
async fn retention_prune_rate_pg() {
    let s = common::pg().await;
    let sc = s.get_schema().as_str().to_owned();
    let q = queue("ret-rate");
    let n = 200_000i64;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {sc}.jobs (queue, key, state, finished, epoch, owner, attempts, result, updated_at) \
         SELECT $1, 'k' || i, 'completed', 'completed', 1 + i % 3, 'w', 1, '\\x6f6b', clock_timestamp() - interval '2 hours' \
         FROM generate_series(1, $2) AS i"
    )))
    .bind(q.as_str().to_owned())
    .bind(n)
    .execute(s.pool())
    .await
    .unwrap();
    let retention = Retention::new()
        .queue(q.clone(), QueueRetention::completed_for(HOUR))
        .batch_size(1_000)
        .pause_between_batches(Duration::ZERO);
    // Claims (each followed by its commit) of another queue, alone and while the pruner runs.
    let claims = |stop: CancellationToken| {
        let s = s.clone();
        tokio::spawn(async move {
            let (other, me) = (queue("ret-rate-claims"), Owner::unique("w"));
            let mut lat = Vec::new();
            while !stop.is_cancelled() {
                let t = std::time::Instant::now();
                let l = claimed(s.claim(&other, &key(&common::unique("c")), &me, lease(30)).await.unwrap());
                lat.push(t.elapsed());
                s.complete(&l, b"ok").await.unwrap();
            }
            lat.sort();
            lat
        })
    };
    let stop = CancellationToken::new();
    let alone = claims(stop.clone());
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.cancel();
    let alone = alone.await.unwrap();
    let stop = CancellationToken::new();
    let claimer = claims(stop.clone());
    let started = std::time::Instant::now();
    let report = s.prune(&retention).await.unwrap();
    let took = started.elapsed();
    stop.cancel();
    let lat = claimer.await.unwrap();
    assert_eq!(report.completed, n as u64);
    let pct = |lat: &[Duration], p: usize| lat[(lat.len() * p / 100).min(lat.len() - 1)];
    println!(
        "pruned {} rows in {} batches in {:.2?}: {:.0} rows/s",
        report.completed,
        report.batches,
        took,
        report.completed as f64 / took.as_secs_f64()
    );
    for (label, lat) in [("claims alone", &alone), ("claims while pruning", &lat)] {
        println!(
            "{label}: {} claims, p50 {:.2?}, p99 {:.2?}, max {:.2?}",
            lat.len(),
            pct(lat, 50),
            pct(lat, 99),
            lat[lat.len() - 1]
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The deduplication window for identical list items (Redis lists, `ItemKey::ContentHash`).
// ---------------------------------------------------------------------------------------------

/// Covers the defect of issue 14 for lists: with `ItemKey::ContentHash` an identical item sent
/// again after its job completed was acknowledged as `Done` for ever and never ran. Now it is
/// deduplicated while the completed row is kept (the window) and, once retention pruned the row,
/// the same item is a new job that runs, under an epoch above the old one.
#[cfg(feature = "redis")]
async fn identical_list_items_run_again_after_the_window<S: Aged + 'static>(s: S) {
    use brokerfence::Outcome;
    use brokerfence::redis::{ItemKey, ListRetrofit, RedisConnections};
    use brokerfence::{Detail, Disposition};
    use std::sync::atomic::{AtomicI64, Ordering};

    let url = brokerfence_testkit::services::var("REDIS_URL")
        .unwrap_or_else(|| panic!("REDIS_URL is not set and localstack/.env has none: run `localstack/up` first"));
    let redis = RedisConnections::connect(&url).await.expect("Redis (run `localstack/up` first)");
    let list = common::unique("ret-list");
    let q = QueueName::new(list.as_str()).expect("queue");
    let store: Arc<dyn FenceStore> = Arc::new(s.clone());
    let fence = ListRetrofit::new(
        store,
        q.clone(),
        SupervisorConfig::new(lease(30)),
        &redis,
        list.as_str(),
        ItemKey::ContentHash,
    )
    .expect("retrofit");
    let item = b"invoice 42 paid".as_slice();
    let (job_key, _) = ItemKey::ContentHash.decode(item).expect("content key");
    // How many times the handler ran, and the epoch of its last run.
    let (runs, last) = (Arc::new(AtomicI64::new(0)), Arc::new(AtomicI64::new(0)));
    let handler = {
        let (runs, last) = (Arc::clone(&runs), Arc::clone(&last));
        move |ctx: JobContext| {
            let (runs, last) = (Arc::clone(&runs), Arc::clone(&last));
            async move {
                runs.fetch_add(1, Ordering::SeqCst);
                last.store(ctx.epoch(), Ordering::SeqCst);
                Ok(b"ran".to_vec())
            }
        }
    };
    let ran_under = |p: &brokerfence::Processed| {
        assert!(matches!(&p.detail, Detail::Ran(Outcome::Completed)), "expected a completed run: {p:?}");
        last.load(Ordering::SeqCst)
    };

    let first = fence.process(item, handler.clone()).await;
    assert_eq!(first.disposition, Disposition::Ack, "{first:?}");
    let first_epoch = ran_under(&first);
    // Within the window: the identical item is a redelivery of a completed job, acked unrun.
    let again = fence.process(item, handler.clone()).await;
    assert!(matches!(&again.detail, Detail::NotClaimed(Claim::Done { epoch }) if *epoch == first_epoch), "{again:?}");
    assert_eq!(again.disposition, Disposition::Ack);
    assert_eq!(runs.load(Ordering::SeqCst), 1, "the identical item ran again inside the window");

    // The window passes (the row is aged past the retention) and the pruner deletes the row.
    s.backdate(&q, job_key.as_str(), 2 * 3600).await;
    let retention = Retention::new().queue(q.clone(), QueueRetention::completed_for(HOUR));
    assert_eq!(s.prune(&retention).await.unwrap().completed, 1);
    // After it: the same item is a new job, and it runs under a newer epoch.
    let later = fence.process(item, handler).await;
    assert_eq!(later.disposition, Disposition::Ack, "{later:?}");
    assert!(ran_under(&later) > first_epoch, "{later:?}");
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_identical_list_items_run_again_after_the_window_pg() {
    identical_list_items_run_again_after_the_window(common::pg().await).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_identical_list_items_run_again_after_the_window_sqlite() {
    identical_list_items_run_again_after_the_window(common::sqlite().await).await;
}
