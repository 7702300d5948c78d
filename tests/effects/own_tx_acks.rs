//! Items 5 and 6 of issue #30: the handler's own transaction (`complete_in`).
//!
//! - Item 5, "a handler that commits its own transaction and keeps running is reported as a lost
//!   lease": after `complete_in` and `COMMIT` the row is no longer running, so the next heartbeat
//!   found the lease gone and cancelled the handler; the outcome was `LeaseLost` (no ack, a "lease
//!   lost … nothing committed" warning, no completion counted).
//! - Item 6, "the fenced-rollback guard can be bypassed": inside a savepoint a fenced
//!   `complete_in` aborted only the savepoint; rolling back to it cleared the abort and the outer
//!   `COMMIT` committed the zombie's rows. On a pooled connection (autocommit) nothing is atomic.
//!
//! Real PostgreSQL (a fresh schema per test) and real SQLite files.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use brokerfence::{
    Claim, FenceError, FenceStore, JobError, JobState, Lease, Outcome, Owner, PgFence, QueueName, Supervisor,
    SupervisorConfig,
};
use brokerfence_testkit::store::{self as common, key, lease, unique};
use fence::Guards;
use futures::future::BoxFuture;
use sqlx::{AssertSqlSafe, Connection};

/// Claims `k` for owner "zombie", gives it back and claims it for "current": the zombie's lease
/// is fenced from then on. Returns (zombie's lease, current lease).
async fn superseded(store: &dyn FenceStore, queue: &QueueName, k: &str) -> (Lease, Lease) {
    let claim = |o: &'static str| async move {
        match store.claim(queue, &key(k), &Owner::new(o).expect("owner"), lease(30)).await.expect("claim") {
            Claim::Claimed(l) => l,
            other => panic!("{other:?}"),
        }
    };
    let zombie = claim("zombie").await;
    store.release(&zombie).await.expect("release");
    let current = claim("current").await;
    assert!(current.epoch > zombie.epoch);
    (zombie, current)
}

// ---------------------------------------------------------------------------------------------
// Item 5: one commit, one ack, however long the handler runs on.
// ---------------------------------------------------------------------------------------------

/// Runs one attempt whose handler completes in its own transaction (`begin`), commits, then
/// keeps running past its 3 s lease (4 s: heartbeats every second find the row no longer
/// running). Returns the outcome, whether the handler reached its end, and the metrics.
async fn commit_then_run_on<S: FenceStore + Clone + 'static>(
    store: S,
    checkpoint_after: bool,
    begin: impl Fn() -> BoxFuture<'static, sqlx::Result<Box<dyn OwnTx>>> + Send + Sync + 'static,
) -> (Outcome, bool, brokerfence::MetricsSnapshot) {
    let queue = QueueName::new(unique("run-on")).expect("queue");
    let owner = Owner::unique("w");
    let lease_len = lease(3);
    let l = match store.claim(&queue, &key("k"), &owner, lease_len).await.expect("claim") {
        Claim::Claimed(l) => l,
        other => panic!("{other:?}"),
    };
    let sup = Supervisor::new(Arc::new(store.clone()), owner, SupervisorConfig::new(lease_len));
    let reached_end = Arc::new(AtomicBool::new(false));
    let outcome = {
        let reached_end = Arc::clone(&reached_end);
        sup.run(l, Vec::new(), None, move |ctx| async move {
            let mut tx = begin().await.map_err(JobError::retry)?;
            tx.complete(&ctx, b"committed in the handler's transaction").await?;
            tx.commit().await.map_err(JobError::retry)?;
            if checkpoint_after {
                // A context call after the commit is fenced (the row is no longer running): it
                // cancels the handler, but the result committed all the same.
                let fenced = ctx.checkpoint(b"after the commit").await;
                assert!(fenced.is_err(), "{fenced:?}");
            }
            // Work after the commit (logging, metrics, a slow cleanup): past the lease's end.
            tokio::time::sleep(Duration::from_secs(4)).await;
            reached_end.store(true, Ordering::SeqCst);
            Ok(Vec::new())
        })
        .await
    };
    let job = store.job(&queue, &key("k")).await.expect("read").expect("job");
    assert_eq!(job.state, JobState::Completed);
    (outcome, reached_end.load(Ordering::SeqCst), sup.metrics().snapshot())
}

/// A handler transaction of either backend, boxed so one test body serves both.
#[async_trait::async_trait]
trait OwnTx: Send {
    async fn complete(&mut self, ctx: &brokerfence::JobContext, result: &[u8]) -> Result<(), JobError>;
    async fn commit(self: Box<Self>) -> sqlx::Result<()>;
}

#[async_trait::async_trait]
impl OwnTx for sqlx::Transaction<'static, sqlx::Postgres> {
    async fn complete(&mut self, ctx: &brokerfence::JobContext, result: &[u8]) -> Result<(), JobError> {
        ctx.complete_in(&mut **self, result).await.map_err(JobError::retry)
    }
    async fn commit(self: Box<Self>) -> sqlx::Result<()> {
        (*self).commit().await
    }
}

#[async_trait::async_trait]
impl OwnTx for sqlx::Transaction<'static, sqlx::Sqlite> {
    async fn complete(&mut self, ctx: &brokerfence::JobContext, result: &[u8]) -> Result<(), JobError> {
        ctx.complete_in(&mut **self, result).await.map_err(JobError::retry)
    }
    async fn commit(self: Box<Self>) -> sqlx::Result<()> {
        (*self).commit().await
    }
}

fn assert_one_ack(outcome: Outcome, reached_end: bool, m: brokerfence::MetricsSnapshot) {
    assert!(matches!(outcome, Outcome::Completed), "one commit must be one ack, got {outcome:?} ({m})");
    assert!(reached_end, "the handler was cancelled after its own commit");
    assert_one_completion(m);
}

fn assert_one_completion(m: brokerfence::MetricsSnapshot) {
    assert_eq!((m.completions, m.own_commits, m.lease_losses), (1, 1, 0), "{m}");
}

/// Item 5 (PostgreSQL): a handler that commits in its own transaction and keeps running is one
/// ack, not a lost lease. Fails without the row check after a heartbeat finds the lease gone
/// (`Inner::settle_own_commits`): the outcome was `LeaseLost { reason: Superseded }`, the
/// handler cancelled one heartbeat after its commit, no completion counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item5_a_handler_that_commits_and_runs_on_is_one_ack_pg() {
    let fence = common::pg().await;
    let pool = fence.pool().clone();
    let (outcome, reached_end, m) = commit_then_run_on(fence, false, move || {
        let pool = pool.clone();
        Box::pin(async move { Ok(Box::new(pool.begin().await?) as Box<dyn OwnTx>) })
    })
    .await;
    assert_one_ack(outcome, reached_end, m);
}

/// Item 5 (SQLite): as above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item5_a_handler_that_commits_and_runs_on_is_one_ack_sqlite() {
    let fence = common::sqlite().await;
    let pool = fence.pool().clone();
    let (outcome, reached_end, m) = commit_then_run_on(fence, false, move || {
        let pool = pool.clone();
        Box::pin(async move { Ok(Box::new(pool.begin_with("BEGIN IMMEDIATE").await?) as Box<dyn OwnTx>) })
    })
    .await;
    assert_one_ack(outcome, reached_end, m);
}

// ---------------------------------------------------------------------------------------------
// Item 6: complete_in in a savepoint or in autocommit.
// ---------------------------------------------------------------------------------------------

/// The zombie of the defect (PostgreSQL): it writes its business row in its transaction, opens a
/// savepoint, calls `complete_in` there, ignores the answer, rolls back to the savepoint (drops
/// the nested transaction) and commits the outer one. Returns the answer it got and the business
/// rows that committed.
async fn zombie_through_a_savepoint_pg(fence: &PgFence) -> (Result<(), FenceError>, i64) {
    let table = format!("\"{}\".item6_rows", fence.get_schema().as_str());
    sqlx::query(AssertSqlSafe(format!("CREATE TABLE {table} (job text NOT NULL, owner text NOT NULL)")))
        .execute(fence.pool())
        .await
        .expect("business table");
    let queue = QueueName::new(unique("savepoint")).expect("queue");
    let (zombie, current) = superseded(fence, &queue, "order-1").await;
    let mut tx = fence.pool().begin().await.expect("begin");
    sqlx::query(AssertSqlSafe(format!("INSERT INTO {table} (job, owner) VALUES ('order-1', 'zombie')")))
        .execute(&mut *tx)
        .await
        .expect("business row");
    let answer = {
        let mut savepoint = tx.begin().await.expect("savepoint");
        fence.complete_in(&mut savepoint, &zombie, b"zombie's result").await
        // dropped: ROLLBACK TO SAVEPOINT
    };
    let _ = tx.commit().await; // the zombie ignores the answer
    let job = fence.job(&queue, &key("order-1")).await.expect("read").expect("job");
    assert_eq!((job.state, job.epoch), (JobState::Running, current.epoch), "the job stays the current holder's");
    let rows: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
        .fetch_one(fence.pool())
        .await
        .expect("count");
    (answer, rows)
}

/// Item 6 (PostgreSQL): `complete_in` refuses a connection inside a savepoint and one in
/// autocommit, before writing anything, with `TransactionDepth`; at depth 1 it works. Fails
/// without the depth check (`Guards::own_tx_depth_check`): in the savepoint the answer was
/// `Fenced`, the rollback to the savepoint cleared the BF409 abort and the zombie's row committed
/// (the negative control below shows it), and on a pooled connection the completion committed on
/// its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item6_complete_in_refuses_savepoints_and_autocommit_pg() {
    let fence = common::pg().await;
    let (answer, _) = zombie_through_a_savepoint_pg(&fence).await;
    assert!(matches!(answer, Err(FenceError::TransactionDepth { depth: 2 })), "{answer:?}");

    // The current holder too: a savepoint is refused whoever calls, so no code path relies on it.
    let queue = QueueName::new(unique("depth")).expect("queue");
    let (_, current) = superseded(&fence, &queue, "k").await;
    let mut tx = fence.pool().begin().await.expect("begin");
    let mut savepoint = tx.begin().await.expect("savepoint");
    let nested = fence.complete_in(&mut savepoint, &current, b"r").await;
    assert!(matches!(nested, Err(FenceError::TransactionDepth { depth: 2 })), "{nested:?}");
    drop(savepoint);
    tx.rollback().await.expect("rollback");
    let mut pooled = fence.pool().acquire().await.expect("connection");
    let autocommit = fence.complete_in(&mut pooled, &current, b"r").await;
    assert!(matches!(autocommit, Err(FenceError::TransactionDepth { depth: 0 })), "{autocommit:?}");
    assert!(autocommit.unwrap_err().to_string().contains("autocommit"));
    drop(pooled);
    let job = fence.job(&queue, &key("k")).await.expect("read").expect("job");
    assert_eq!(job.state, JobState::Running, "a refused complete_in wrote nothing");

    // Depth 1 still completes.
    let mut tx = fence.pool().begin().await.expect("begin");
    fence.complete_in(&mut tx, &current, b"r").await.expect("complete_in at depth 1");
    tx.commit().await.expect("commit");
    let job = fence.job(&queue, &key("k")).await.expect("read").expect("job");
    assert_eq!(job.state, JobState::Completed);
}

/// Item 6, the negative control (PostgreSQL): with the depth check switched off, the zombie of
/// the defect gets `Fenced` inside its savepoint and its business row commits all the same: the
/// bypass the check closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item6_guard_switch_depth_check_off_lets_a_savepoint_commit_the_zombies_rows() {
    let fence = common::pg().await.guards(Guards::default().without_own_tx_depth_check());
    let (answer, rows) = zombie_through_a_savepoint_pg(&fence).await;
    assert!(answer.as_ref().is_err_and(FenceError::is_fenced), "{answer:?}");
    assert_eq!(rows, 1, "without the check the savepoint's rollback clears the abort: the zombie's row commits");
}

/// Item 6 (SQLite): the same refusals; the deferred-FK trap would be cleared by a rollback to
/// the savepoint just as BF409 is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item6_complete_in_refuses_savepoints_and_autocommit_sqlite() {
    let fence = common::sqlite().await;
    let queue = QueueName::new(unique("depth")).expect("queue");
    let (zombie, current) = superseded(&fence, &queue, "k").await;
    let mut tx = fence.pool().begin_with("BEGIN IMMEDIATE").await.expect("begin");
    for lease in [&zombie, &current] {
        let mut savepoint = tx.begin().await.expect("savepoint");
        let nested = fence.complete_in(&mut savepoint, lease, b"r").await;
        assert!(matches!(nested, Err(FenceError::TransactionDepth { depth: 2 })), "{nested:?}");
    }
    tx.rollback().await.expect("rollback");
    let mut pooled = fence.pool().acquire().await.expect("connection");
    let autocommit = fence.complete_in(&mut pooled, &current, b"r").await;
    assert!(matches!(autocommit, Err(FenceError::TransactionDepth { depth: 0 })), "{autocommit:?}");
    drop(pooled);
    assert_eq!(fence.job(&queue, &key("k")).await.expect("read").expect("job").state, JobState::Running);
    let mut tx = fence.pool().begin_with("BEGIN IMMEDIATE").await.expect("begin");
    fence.complete_in(&mut tx, &current, b"r").await.expect("complete_in at depth 1");
    tx.commit().await.expect("commit");
    assert_eq!(fence.job(&queue, &key("k")).await.expect("read").expect("job").state, JobState::Completed);
}

/// Item 5, a context call after the handler's own commit (PostgreSQL): the checkpoint is fenced
/// (the row is completed) and cancels the handler, but the row says the result committed under
/// this epoch, so the attempt is one ack, not a lost lease. Fails without the row read for an
/// attempt that lost its lease after `complete_in` (`Inner::own_commit_landed`): `LeaseLost {
/// reason: Superseded }`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item5_a_fenced_call_after_the_own_commit_is_still_one_ack_pg() {
    let fence = common::pg().await;
    let pool = fence.pool().clone();
    let (outcome, reached_end, m) = commit_then_run_on(fence, true, move || {
        let pool = pool.clone();
        Box::pin(async move { Ok(Box::new(pool.begin().await?) as Box<dyn OwnTx>) })
    })
    .await;
    assert!(matches!(outcome, Outcome::Completed), "one commit must be one ack, got {outcome:?} ({m})");
    assert!(!reached_end, "the fenced checkpoint cancels the handler");
    assert_one_completion(m);
}
