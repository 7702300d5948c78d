//! Issue 13, "Effects that cannot be superseded": the handler's own transaction.
//!
//! - A handler run by `Consumer`, `Retrofit` or `ListRetrofit` writes its rows and the fenced
//!   completion in one transaction (`JobContext::complete_in`); the runtime acknowledges without a
//!   second commit, counts a completion and no fenced rejection (PostgreSQL and SQLite).
//! - A fenced `complete_in` leaves the caller's transaction unable to commit (guard
//!   `fenced_tx_rollback`; its switch shows the zombie's rows landing without it).
//! - The batched heartbeat never waits on the row an open handler transaction holds (the defect:
//!   it waited, timed out, and every other job of the worker was cancelled `Unconfirmed`).
//! - Transactional enqueue: `enqueue_in` / `enqueue_many_in`.
//!
//! Run: `cargo test -p brokerfence-tests --all-features --test effects own_tx::` (PostgreSQL from
//! `localstack/up`).

#[cfg(feature = "sqs")]
use brokerfence_testkit::sqs as sqs_support;
use brokerfence_testkit::store as common;

use std::sync::Arc;
use std::time::Duration;

use brokerfence::TableQueue;
use brokerfence::{
    Claim, FenceStore, JobContext, JobError, JobKey, JobState, Lease, LossReason, Outcome, Owner, PgFence, QueueName,
    SqliteFence, Supervisor, SupervisorConfig,
};
use brokerfence::{Consumer, ConsumerConfig, Retrofit};
use common::{key, lease, unique};
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

/// Creates the business table of these tests (job, epoch, owner) next to the fence's tables.
async fn pg_business_table(fence: &PgFence) -> String {
    let table = format!("\"{}\".effects_rows", fence.get_schema().as_str());
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {table} (job text NOT NULL, epoch bigint NOT NULL, owner text NOT NULL)"
    )))
    .execute(fence.pool())
    .await
    .expect("create business table");
    table
}

async fn sqlite_business_table(fence: &SqliteFence) -> String {
    let table = format!("effects_rows_{:08x}", rand::random::<u32>());
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {table} (job text NOT NULL, epoch integer NOT NULL, owner text NOT NULL)"
    )))
    .execute(fence.pool())
    .await
    .expect("create business table");
    table
}

/// The business rows, as (job, epoch, owner), in job order.
async fn pg_rows(fence: &PgFence, table: &str) -> Vec<(String, i64, String)> {
    sqlx::query_as(AssertSqlSafe(format!("SELECT job, epoch, owner FROM {table} ORDER BY job, epoch")))
        .fetch_all(fence.pool())
        .await
        .expect("read business rows")
}

async fn sqlite_rows(fence: &SqliteFence, table: &str) -> Vec<(String, i64, String)> {
    sqlx::query_as(AssertSqlSafe(format!("SELECT job, epoch, owner FROM {table} ORDER BY job, epoch")))
        .fetch_all(fence.pool())
        .await
        .expect("read business rows")
}

/// The handler of these tests on PostgreSQL: the business row and the completion in one
/// transaction of the fence's own pool.
async fn pg_handler(ctx: JobContext, fence: PgFence, table: String) -> Result<Vec<u8>, JobError> {
    let mut tx = fence.pool().begin().await.map_err(JobError::retry)?;
    sqlx::query(AssertSqlSafe(format!("INSERT INTO {table} (job, epoch, owner) VALUES ($1, $2, $3)")))
        .bind(ctx.key().as_str())
        .bind(ctx.epoch())
        .bind(ctx.owner().as_str())
        .execute(&mut *tx)
        .await
        .map_err(JobError::retry)?;
    let result = format!("done by {}", ctx.owner());
    ctx.complete_in(&mut *tx, result.as_bytes()).await.map_err(JobError::retry)?;
    tx.commit().await.map_err(JobError::retry)?;
    Ok(b"ignored: complete_in committed the result".to_vec())
}

async fn sqlite_handler(ctx: JobContext, fence: SqliteFence, table: String) -> Result<Vec<u8>, JobError> {
    let mut tx = fence.pool().begin_with("BEGIN IMMEDIATE").await.map_err(JobError::retry)?;
    sqlx::query(AssertSqlSafe(format!("INSERT INTO {table} (job, epoch, owner) VALUES (?1, ?2, ?3)")))
        .bind(ctx.key().as_str())
        .bind(ctx.epoch())
        .bind(ctx.owner().as_str())
        .execute(&mut *tx)
        .await
        .map_err(JobError::retry)?;
    let result = format!("done by {}", ctx.owner());
    ctx.complete_in(&mut *tx, result.as_bytes()).await.map_err(JobError::retry)?;
    tx.commit().await.map_err(JobError::retry)?;
    Ok(b"ignored: complete_in committed the result".to_vec())
}

const JOBS: usize = 40;

fn jobs() -> Vec<(JobKey, Vec<u8>)> {
    (0..JOBS).map(|i| (key(&format!("job-{i:03}")), format!("payload {i}").into_bytes())).collect()
}

/// Runs `consumer` with `handler` until every job is completed (or fails the test).
async fn drain<H: brokerfence::Handler>(consumer: Consumer<TableQueue>, handler: H) -> Consumer<TableQueue> {
    let stop = CancellationToken::new();
    let consumer = Arc::new(consumer);
    let running = {
        let (consumer, stop) = (Arc::clone(&consumer), stop.clone());
        tokio::spawn(async move { consumer.run(handler, stop).await })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while consumer.metrics().snapshot().completions < JOBS as u64 {
        assert!(tokio::time::Instant::now() < deadline, "not drained: {}", consumer.metrics().snapshot());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.cancel();
    running.await.expect("consumer task").expect("consumer run");
    Arc::into_inner(consumer).expect("consumer released")
}

/// Asserts what a handler-owned commit must leave: every job completed at its only epoch with the
/// handler's result, exactly one business row per job at that epoch, and counters that say
/// "completed in the handler's transaction" with no second commit and nothing fenced.
fn assert_own_commits(
    metrics: brokerfence::MetricsSnapshot,
    rows: &[(String, i64, String)],
    jobs: &[(String, JobState, i64, Option<Vec<u8>>)],
) {
    assert_eq!(metrics.completions, JOBS as u64, "{metrics}");
    assert_eq!(metrics.own_commits, JOBS as u64, "every completion was the handler's own: {metrics}");
    assert_eq!(metrics.commit_statements, 0, "no second commit by the runtime: {metrics}");
    assert_eq!(metrics.fenced_rejections, 0, "nothing reported fenced: {metrics}");
    assert_eq!(metrics.lease_losses, 0, "{metrics}");
    assert_eq!(metrics.failures, 0, "{metrics}");
    assert_eq!(rows.len(), JOBS, "one business row per job: {rows:?}");
    for ((job, state, epoch, result), row) in jobs.iter().zip(rows) {
        assert_eq!(*state, JobState::Completed, "{job}");
        assert_eq!((&row.0, row.1), (job, *epoch), "the business row is the completing epoch's");
        assert_eq!(result.as_deref(), Some(format!("done by {}", row.2).as_bytes()), "{job}: complete_in's result");
    }
}

async fn job_states(store: &dyn FenceStore, queue: &QueueName) -> Vec<(String, JobState, i64, Option<Vec<u8>>)> {
    let mut out = Vec::new();
    for (k, _) in jobs() {
        let job = store.job(queue, &k).await.expect("read job").expect("job exists");
        out.push((k.to_string(), job.state, job.epoch, job.result));
    }
    out
}

fn consumer_config() -> ConsumerConfig {
    ConsumerConfig::new(SupervisorConfig::new(lease(10))).concurrency(8).batch(8).grace(Duration::from_secs(5))
}

/// Enqueues the jobs on `store`'s table queue and drains them through a `Consumer` running
/// `handler`; the queue and the consumer's counters.
async fn through_the_consumer<H: brokerfence::Handler>(
    store: Arc<dyn FenceStore>,
    handler: H,
) -> (QueueName, brokerfence::MetricsSnapshot) {
    let queue = QueueName::new(unique("own")).expect("queue");
    store.enqueue_many(&queue, &jobs()).await.expect("enqueue");
    let consumer = Consumer::new(TableQueue::new(Arc::clone(&store), queue.clone()), store, consumer_config());
    let consumer = drain(consumer, handler).await;
    (queue, consumer.metrics().snapshot())
}

/// Handler-owned commit through `Consumer` on the PostgreSQL table queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_own_commit_through_the_consumer_pg() {
    let fence = common::pg().await;
    let table = pg_business_table(&fence).await;
    let (f, t) = (fence.clone(), table.clone());
    let (queue, m) =
        through_the_consumer(Arc::new(fence.clone()), move |ctx| pg_handler(ctx, f.clone(), t.clone())).await;
    assert_own_commits(m, &pg_rows(&fence, &table).await, &job_states(&fence, &queue).await);
}

/// Handler-owned commit through `Consumer` on the SQLite table queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_own_commit_through_the_consumer_sqlite() {
    let fence = common::sqlite().await;
    let table = sqlite_business_table(&fence).await;
    let (f, t) = (fence.clone(), table.clone());
    let handler = move |ctx| sqlite_handler(ctx, f.clone(), t.clone());
    let (queue, m) = through_the_consumer(Arc::new(fence.clone()), handler).await;
    assert_own_commits(m, &sqlite_rows(&fence, &table).await, &job_states(&fence, &queue).await);
}

/// Handler-owned commit through the `Retrofit` middleware: the delivery is to be acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_own_commit_through_the_retrofit_pg() {
    let fence = common::pg().await;
    let table = pg_business_table(&fence).await;
    let queue = QueueName::new(unique("retro")).expect("queue");
    let retrofit = Retrofit::new(Arc::new(fence.clone()), queue.clone(), SupervisorConfig::new(lease(10)));
    for (k, payload) in jobs() {
        let (f, t) = (fence.clone(), table.clone());
        let done = retrofit.process(&k, payload, move |ctx| pg_handler(ctx, f.clone(), t.clone())).await;
        assert!(done.should_ack(), "{k}: {done:?}");
    }
    let rows = pg_rows(&fence, &table).await;
    assert_own_commits(retrofit.metrics().snapshot(), &rows, &job_states(&fence, &queue).await);
}

/// Handler-owned commit through `ListRetrofit` (a Redis list the user pops): acknowledged, the
/// lease key released, one business row.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_own_commit_through_the_list_retrofit_pg() {
    use brokerfence::Disposition;
    use brokerfence::redis::{ItemKey, ListRetrofit, RedisConnections};
    let fence = common::pg().await;
    let table = pg_business_table(&fence).await;
    let url = brokerfence_testkit::services::var("REDIS_URL").unwrap_or_else(|| "redis://127.0.0.1:6379".into());
    let redis = RedisConnections::connect(&url).await.expect("connect to Redis (run `localstack/up`)");
    let list = unique("own-list");
    let retrofit = ListRetrofit::new(
        Arc::new(fence.clone()),
        QueueName::new(list.as_str()).expect("queue"),
        SupervisorConfig::new(lease(10)),
        &redis,
        list.as_str(),
        ItemKey::Split(b'|'),
    )
    .expect("retrofit");
    for (k, _) in jobs() {
        let item = format!("{k}|payload");
        let (f, t) = (fence.clone(), table.clone());
        let done = retrofit.process(item.as_bytes(), move |ctx| pg_handler(ctx, f.clone(), t.clone())).await;
        assert!(matches!(done.disposition, Disposition::Ack), "{k}: {done:?}");
    }
    let rows = pg_rows(&fence, &table).await;
    let queue = QueueName::new(list.as_str()).expect("queue");
    assert_own_commits(retrofit.retrofit().metrics().snapshot(), &rows, &job_states(&fence, &queue).await);
}

/// Handler-owned commit through `SqsRetrofit` (LocalStack): each message is completed in the
/// handler's transaction, deleted from the queue, and nothing is committed twice or fenced.
#[cfg(feature = "sqs")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_own_commit_through_the_sqs_retrofit_pg() {
    use brokerfence::Disposition;
    use brokerfence::sqs::{KeyStrategy, SqsConfig, SqsRetrofit, SqsSource};
    let client = sqs_support::sqs().await;
    let fence = common::pg().await;
    let table = pg_business_table(&fence).await;
    let q = sqs_support::TestQueue::new(&client, "own", 30).await;
    let source =
        SqsSource::new(client.clone(), SqsConfig::new(&q.url).expect("url").key(KeyStrategy::body_field("id")));
    let retrofit = SqsRetrofit::new(Arc::new(fence.clone()), source, SupervisorConfig::new(lease(10)));
    const N: usize = 5;
    for i in 0..N {
        sqs_support::send(&client, &q.url, &format!(r#"{{"id":"job-{i:03}"}}"#)).await;
    }
    let mut messages = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while messages.len() < N && tokio::time::Instant::now() < deadline {
        messages.extend(sqs_support::receive_raw(&client, &q.url, 1).await);
    }
    assert_eq!(messages.len(), N);
    for m in &messages {
        let (f, t) = (fence.clone(), table.clone());
        let done = retrofit.process(m, move |ctx| pg_handler(ctx, f.clone(), t.clone())).await;
        assert!(done.reason() == brokerfence::Reason::Committed && done.broker_error.is_none(), "{done:?}");
        assert_eq!(done.disposition, Disposition::Ack, "{done:?}");
    }
    assert_eq!(sqs_support::depth(&client, &q.url).await, 0, "every message deleted");
    let rows = pg_rows(&fence, &table).await;
    assert_eq!(rows.len(), N, "{rows:?}");
    assert!(rows.iter().all(|r| r.1 == 1), "{rows:?}");
    let m = retrofit.metrics().snapshot();
    assert_eq!(
        (m.completions, m.own_commits, m.commit_statements, m.fenced_rejections),
        (N as u64, N as u64, 0, 0),
        "{m}"
    );
    q.delete(&client).await;
}

/// A handler that calls `complete_in` but never commits its transaction (it is dropped, so rolled
/// back) and returns `Ok`: the delivery must not be acknowledged as done, since nothing
/// committed; the attempt is recorded as a retried failure and the job runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_own_commit_that_never_commits_is_a_failure_not_a_completion() {
    let fence = common::pg().await;
    let table = pg_business_table(&fence).await;
    let queue = QueueName::new(unique("nocommit")).expect("queue");
    let retrofit = Retrofit::new(Arc::new(fence.clone()), queue.clone(), SupervisorConfig::new(lease(10)));
    let (f, t) = (fence.clone(), table.clone());
    let done = retrofit
        .process(&key("forgot"), Vec::new(), move |ctx: JobContext| {
            let (f, t) = (f.clone(), t.clone());
            async move {
                let mut tx = f.pool().begin().await.map_err(JobError::retry)?;
                sqlx::query(AssertSqlSafe(format!("INSERT INTO {t} (job, epoch, owner) VALUES ($1, $2, $3)")))
                    .bind(ctx.key().as_str())
                    .bind(ctx.epoch())
                    .bind(ctx.owner().as_str())
                    .execute(&mut *tx)
                    .await
                    .map_err(JobError::retry)?;
                ctx.complete_in(&mut *tx, b"never committed").await.map_err(JobError::retry)?;
                drop(tx); // no commit: rolled back
                Ok(Vec::new())
            }
        })
        .await;
    assert!(!done.should_ack(), "{done:?}");
    assert!(matches!(done.detail, brokerfence::Detail::Ran(Outcome::Failed { .. })), "{done:?}");
    let job = fence.job(&queue, &key("forgot")).await.expect("read").expect("job");
    assert_eq!(job.state, JobState::Failed);
    assert!(job.last_error.as_deref().unwrap_or_default().contains("did not commit"), "{job:?}");
    assert!(pg_rows(&fence, &table).await.is_empty(), "the rolled-back business row is gone");
    let m = retrofit.metrics().snapshot();
    assert_eq!((m.completions, m.own_commits, m.fenced_rejections), (0, 0, 0), "{m}");
}

/// Claims `k` for owner "zombie" (epoch 1), gives it back and claims it for "current" (epoch 2):
/// the zombie's lease is fenced from then on. Returns (zombie's lease, current lease).
async fn superseded(store: &dyn FenceStore, queue: &QueueName, k: &JobKey) -> (Lease, Lease) {
    let claim = |o: &'static str| async move {
        match store.claim(queue, k, &Owner::new(o).expect("owner"), lease(30)).await.expect("claim") {
            Claim::Claimed(l) => l,
            other => panic!("{other:?}"),
        }
    };
    let zombie = claim("zombie").await;
    store.release(&zombie).await.expect("release");
    let current = claim("current").await;
    assert_eq!((zombie.epoch, current.epoch), (1, 2));
    (zombie, current)
}

/// Guard `fenced_tx_rollback` (PostgreSQL): a superseded holder writes its business row, its
/// `complete_in` is fenced, and it ignores the answer and commits. With the guard the
/// transaction was aborted by the fenced statement: the row is gone, the job untouched.
/// Without it (switch `without_fenced_tx_rollback`), the zombie's row lands: the violation.
async fn fenced_complete_in_pg(fence: PgFence) -> usize {
    let table = pg_business_table(&fence).await;
    let queue = QueueName::new(unique("fenced")).expect("queue");
    let k = key("order-1");
    let (zombie, current) = superseded(&fence, &queue, &k).await;
    let mut tx = fence.pool().begin().await.expect("begin");
    sqlx::query(AssertSqlSafe(format!("INSERT INTO {table} (job, epoch, owner) VALUES ($1, 1, 'zombie')")))
        .bind(k.as_str())
        .execute(&mut *tx)
        .await
        .expect("business row");
    let answer = fence.complete_in(&mut tx, &zombie, b"zombie's result").await;
    assert!(answer.as_ref().is_err_and(|e| e.is_fenced()), "{answer:?}");
    let _ = tx.commit().await; // the zombie ignores the answer
    let job = fence.job(&queue, &k).await.expect("read").expect("job");
    assert_eq!((job.state, job.epoch, job.owner.as_deref()), (JobState::Running, 2, Some(current.owner.as_str())));
    pg_rows(&fence, &table).await.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_fenced_complete_in_aborts_the_transaction_pg() {
    assert_eq!(fenced_complete_in_pg(common::pg().await).await, 0, "the fenced transaction's row committed");
}

async fn fenced_complete_in_sqlite(fence: SqliteFence) -> usize {
    let table = sqlite_business_table(&fence).await;
    let queue = QueueName::new(unique("fenced")).expect("queue");
    let k = key("order-1");
    let (zombie, current) = superseded(&fence, &queue, &k).await;
    let mut tx = fence.pool().begin_with("BEGIN IMMEDIATE").await.expect("begin");
    sqlx::query(AssertSqlSafe(format!("INSERT INTO {table} (job, epoch, owner) VALUES (?1, 1, 'zombie')")))
        .bind(k.as_str())
        .execute(&mut *tx)
        .await
        .expect("business row");
    let answer = fence.complete_in(&mut tx, &zombie, b"zombie's result").await;
    assert!(answer.as_ref().is_err_and(|e| e.is_fenced()), "{answer:?}");
    let _ = tx.commit().await; // the zombie ignores the answer
    let job = fence.job(&queue, &k).await.expect("read").expect("job");
    assert_eq!((job.state, job.epoch, job.owner.as_deref()), (JobState::Running, 2, Some(current.owner.as_str())));
    sqlite_rows(&fence, &table).await.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_fenced_complete_in_aborts_the_transaction_sqlite() {
    assert_eq!(fenced_complete_in_sqlite(common::sqlite().await).await, 0, "the fenced transaction's row committed");
}

/// The negative controls: with the guard switched off the zombie's row commits, on both backends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_guard_switch_fenced_tx_rollback_off_lets_the_zombies_rows_commit() {
    let off = fence::Guards::default().without_fenced_tx_rollback();
    assert_eq!(fenced_complete_in_pg(common::pg().await.guards(off)).await, 1, "PostgreSQL without the guard");
    assert_eq!(fenced_complete_in_sqlite(common::sqlite().await.guards(off)).await, 1, "SQLite without the guard");
}

/// The heartbeat beside an open handler transaction (PostgreSQL). One job's handler completes
/// in its own transaction and then keeps it open for twice the lease, holding the job's row
/// lock; seven other jobs of the same worker run for 1.5 leases each and need their renewals.
///
/// The defect this covers: the batched heartbeat waited on that row lock, hit its lock timeout,
/// and every other job of the worker lost its lease (`Unconfirmed`). Now the locked row is
/// skipped (reported `held`), the other jobs are renewed and complete, and the job with the open
/// transaction is cancelled at its deadline with its transaction rolled back (or, had it
/// committed first, completed): never both, and never a business row of an epoch that did not
/// complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_heartbeat_beside_an_open_handler_transaction_pg() {
    let fence = common::pg().await;
    let table = pg_business_table(&fence).await;
    let queue = QueueName::new(unique("hold")).expect("queue");
    let lease_len = lease(3);
    let keys: Vec<(JobKey, Vec<u8>)> = (0..8).map(|i| (key(&format!("job-{i}")), Vec::new())).collect();
    fence.enqueue_many(&queue, &keys).await.expect("enqueue");
    let owner = Owner::unique("holder");
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    let sup = Supervisor::new(Arc::clone(&store), owner.clone(), SupervisorConfig::new(lease_len));
    let claimed = store.claim_next(&queue, &owner, lease_len, 8).await.expect("claim");
    assert_eq!(claimed.len(), 8);
    let started = std::time::Instant::now();
    let runs: Vec<_> = claimed
        .into_iter()
        .map(|job| {
            let (sup, fence, table) = (sup.clone(), fence.clone(), table.clone());
            tokio::spawn(async move {
                let k = job.lease.key.to_string();
                let holds = k == "job-0";
                let outcome = sup
                    .run(job.lease, job.payload, None, move |ctx| async move {
                        if !holds {
                            tokio::time::sleep(lease_len.get() * 3 / 2).await;
                            return Ok(b"plain".to_vec());
                        }
                        let mut tx = fence.pool().begin().await.map_err(JobError::retry)?;
                        sqlx::query(AssertSqlSafe(format!(
                            "INSERT INTO {table} (job, epoch, owner) VALUES ($1, $2, $3)"
                        )))
                        .bind(ctx.key().as_str())
                        .bind(ctx.epoch())
                        .bind(ctx.owner().as_str())
                        .execute(&mut *tx)
                        .await
                        .map_err(JobError::retry)?;
                        ctx.complete_in(&mut *tx, b"held").await.map_err(JobError::retry)?;
                        tokio::time::sleep(lease_len.get() * 2).await; // the row lock stays held
                        tx.commit().await.map_err(JobError::retry)?;
                        Ok(Vec::new())
                    })
                    .await;
                (k, outcome)
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for run in runs {
        outcomes.push(run.await.expect("attempt task"));
    }
    let took = started.elapsed();
    for (k, outcome) in &outcomes {
        if k != "job-0" {
            assert!(outcome.is_completed(), "{k} lost its lease beside the open transaction: {outcome:?}");
        }
    }
    let (_, held) = outcomes.iter().find(|(k, _)| k == "job-0").expect("job-0 ran");
    let job = fence.job(&queue, &key("job-0")).await.expect("read").expect("job");
    let rows = pg_rows(&fence, &table).await;
    match held {
        Outcome::Completed => {
            assert_eq!((job.state, job.epoch), (JobState::Completed, 1));
            assert_eq!(rows.len(), 1, "{rows:?}");
        }
        Outcome::LeaseLost { reason: LossReason::Unconfirmed } => {
            assert_ne!(job.state, JobState::Completed, "cancelled, yet its completion committed: {job:?}");
            assert!(rows.is_empty(), "the cancelled transaction's row committed: {rows:?}");
            // Rolled back: the row lock is gone, and the job is claimable by anyone once its
            // lease has run out.
            let other = Owner::unique("next");
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            loop {
                let got = store.claim_next(&queue, &other, lease_len, 1).await.expect("claim_next");
                if let Some(next) = got.first() {
                    assert_eq!((next.lease.key.as_str(), next.lease.epoch), ("job-0", 2));
                    break;
                }
                assert!(tokio::time::Instant::now() < deadline, "job-0 never became claimable again");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        other => panic!("job-0: {other:?}"),
    }
    let m = sup.metrics().snapshot();
    println!("heartbeat beside an open transaction: {took:?}, {m}");
    assert_eq!(m.completions, 7 + u64::from(held.is_completed()), "{m}");
    assert!(m.renewals >= 7, "the other jobs were renewed: {m}");
}

/// Transactional enqueue (PostgreSQL): the job exists if and only if the caller's transaction
/// commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_enqueue_in_commits_or_rolls_back_with_the_callers_rows_pg() {
    let fence = common::pg().await;
    let table = pg_business_table(&fence).await;
    let queue = QueueName::new(unique("enq")).expect("queue");
    for commit in [false, true] {
        let mut tx = fence.pool().begin().await.expect("begin");
        let order = if commit { "kept" } else { "dropped" };
        sqlx::query(AssertSqlSafe(format!("INSERT INTO {table} (job, epoch, owner) VALUES ($1, 0, 'app')")))
            .bind(order)
            .execute(&mut *tx)
            .await
            .expect("business row");
        assert!(fence.enqueue_in(&mut tx, &queue, &key(order), b"one").await.expect("enqueue_in"));
        let many = vec![(key(&format!("{order}-a")), b"a".to_vec()), (key(&format!("{order}-b")), b"b".to_vec())];
        assert_eq!(fence.enqueue_many_in(&mut tx, &queue, &many).await.expect("enqueue_many_in"), 2);
        if commit {
            tx.commit().await.expect("commit");
        } else {
            tx.rollback().await.expect("rollback");
        }
    }
    for (k, exists) in [("dropped", false), ("dropped-a", false), ("kept", true), ("kept-a", true), ("kept-b", true)] {
        let job = fence.job(&queue, &key(k)).await.expect("read");
        assert_eq!(job.is_some(), exists, "{k}");
    }
    assert_eq!(pg_rows(&fence, &table).await.len(), 1);
    let owner = Owner::unique("w");
    let claimed = fence.claim_next(&queue, &owner, lease(10), 10).await.expect("claim");
    assert_eq!(claimed.len(), 3, "only the committed jobs are claimable");
    assert!(
        !fence
            .enqueue_in(&mut fence.pool().acquire().await.expect("conn"), &queue, &key("kept"), b"x")
            .await
            .expect("again")
    );
}

/// Transactional enqueue (SQLite).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_enqueue_in_commits_or_rolls_back_with_the_callers_rows_sqlite() {
    let fence = common::sqlite().await;
    let queue = QueueName::new(unique("enq")).expect("queue");
    for commit in [false, true] {
        let order = if commit { "kept" } else { "dropped" };
        let mut tx = fence.pool().begin_with("BEGIN IMMEDIATE").await.expect("begin");
        assert!(fence.enqueue_in(&mut tx, &queue, &key(order), b"one").await.expect("enqueue_in"));
        let many = vec![(key(&format!("{order}-a")), b"a".to_vec())];
        assert_eq!(fence.enqueue_many_in(&mut tx, &queue, &many).await.expect("enqueue_many_in"), 1);
        if commit {
            tx.commit().await.expect("commit");
        } else {
            tx.rollback().await.expect("rollback");
        }
    }
    for (k, exists) in [("dropped", false), ("dropped-a", false), ("kept", true), ("kept-a", true)] {
        assert_eq!(fence.job(&queue, &key(k)).await.expect("read").is_some(), exists, "{k}");
    }
}
