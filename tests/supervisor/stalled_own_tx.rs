//! Issue 13: a handler's own transaction with a real zombie process (PostgreSQL).
//!
//! The zombie is `examples/zombie_worker.rs` as a separate OS process (this test binary
//! re-executed), whose handler writes a business row and its fenced completion in one transaction
//! (`tx-begin,tx-write,tx-complete,tx-commit`). It is frozen with SIGSTOP past its 3 s lease at
//! one of two points, and resumed with SIGCONT:
//! - before `complete_in` (its transaction open, its business row written, the job row free): the
//!   new owner claims epoch 2 and commits first; the zombie's `complete_in` is fenced and its
//!   transaction can no longer commit;
//! - after `complete_in`, before `COMMIT` (its transaction holds the job's row lock): nobody can
//!   claim the job while it is frozen; once resumed, the zombie is past its deadline and is
//!   cancelled (its transaction rolled back), or its commit wins; the new owner then finds the job
//!   done, or claims it and commits.
//!
//! Either way: exactly one set of business rows, from the epoch the job completed under.
//! Run: `cargo test --workspace --all-features stalled_own_tx -- --nocapture` for the timelines.
#![cfg(feature = "http")]

use std::time::Duration;

use crate::zombie_support::*;
use brokerfence::{JobState, Owner, QueueName};
use sqlx::AssertSqlSafe;

const PLAN_NEW_OWNER: &str = "tx-begin,tx-write,tx-complete,tx-commit";
const WAIT: Duration = Duration::from_secs(30);

async fn business_table(db: &Db) -> String {
    let AnyFence::Pg(fence) = &db.admin else { panic!("PostgreSQL only") };
    let table = format!("\"{}\".effects_rows", db.schema.as_str());
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {table} (job text NOT NULL, epoch bigint NOT NULL, owner text NOT NULL)"
    )))
    .execute(fence.pool())
    .await
    .expect("create business table");
    table
}

async fn business_rows(db: &Db, table: &str) -> Vec<(String, i64, String)> {
    let AnyFence::Pg(fence) = &db.admin else { panic!("PostgreSQL only") };
    sqlx::query_as(AssertSqlSafe(format!("SELECT job, epoch, owner FROM {table} ORDER BY epoch")))
        .fetch_all(fence.pool())
        .await
        .expect("read business rows")
}

/// The invariant of both orderings: the job is completed, and the business rows are exactly one
/// row, written by the owner and epoch the job completed under.
async fn assert_one_set_from_the_final_epoch(db: &Db, table: &str, transcript: &str) -> (i64, String) {
    let job = db.job().await;
    let rows = business_rows(db, table).await;
    assert_eq!(job.state, JobState::Completed, "{job:?}\n{transcript}");
    assert_eq!(rows.len(), 1, "exactly one set of business rows: {rows:?}\n{transcript}");
    let (_, epoch, owner) = &rows[0];
    assert_eq!(
        (*epoch, Some(owner.as_str())),
        (job.epoch, job.owner.as_deref()),
        "rows of the final epoch\n{transcript}"
    );
    (*epoch, owner.clone())
}

/// Stalled before `complete_in`: the new owner (epoch 2) commits first; the zombie's completion is
/// fenced and its transaction, business row included, never commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_zombie_own_tx_stalled_before_complete_in() {
    let db = Db::new(Backend::Postgres).await;
    let table = business_table(&db).await;
    let mut zombie = Zombie::spawn("zombie", &db, None, "tx-begin,tx-write,gate,tx-complete,tx-commit", &[]);
    zombie.wait_for("gate", WAIT).await;
    zombie.stop();
    // The new owner claims once the zombie's lease has run out (its claim loop retries while busy).
    let mut new_owner = Zombie::spawn("new-owner", &db, None, PLAN_NEW_OWNER, &[]);
    assert_eq!(new_owner.finish(WAIT).await, 0, "{}", new_owner.transcript());
    assert_eq!(new_owner.outcome().as_deref(), Some("outcome=completed"), "{}", new_owner.transcript());
    assert_eq!((zombie.claimed_epoch(), new_owner.claimed_epoch()), (1, 2));

    zombie.cont();
    zombie.open_gate().await;
    assert_eq!(zombie.finish(WAIT).await, 0, "{}", zombie.transcript());
    let transcript = format!("zombie:\n{}new owner:\n{}", zombie.transcript(), new_owner.transcript());
    println!("{transcript}");
    let outcome = zombie.outcome().unwrap_or_default();
    // Cancelled at its deadline (`lease_lost`), or, when it reaches `complete_in` before the
    // cancellation, fenced there (its transaction aborted, its failure record fenced too).
    assert!(
        outcome.starts_with("outcome=lease_lost") || outcome.starts_with("outcome=fenced"),
        "the zombie's attempt ends without a commit: {outcome}\n{transcript}"
    );
    assert!(
        !zombie.events().iter().any(|(_, l)| l.starts_with("tx step=commit") && l.ends_with("result=ok")),
        "the zombie's transaction must not commit\n{transcript}"
    );
    let (epoch, _) = assert_one_set_from_the_final_epoch(&db, &table, &transcript).await;
    assert_eq!(epoch, 2);
    db.cleanup().await;
}

/// Stalled after `complete_in`, holding the job's row lock: while it is frozen nobody can claim the
/// job (the table queue's claim skips the locked row); afterwards exactly one epoch's rows exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_zombie_own_tx_stalled_holding_the_row_lock() {
    let db = Db::new(Backend::Postgres).await;
    let table = business_table(&db).await;
    let mut zombie = Zombie::spawn("zombie", &db, None, "tx-begin,tx-write,tx-complete,gate,tx-commit", &[]);
    zombie.wait_for("gate", WAIT).await;
    zombie.stop();
    tokio::time::sleep(lease().get() + Duration::from_secs(1)).await;
    // Past the lease on the database clock, yet the row is locked by the zombie's transaction.
    let store = db.admin.store();
    let queue = QueueName::new(QUEUE).expect("queue");
    let taken = store.claim_next(&queue, &Owner::unique("thief"), lease(), 1).await.expect("claim_next");
    assert!(taken.is_empty(), "a row locked by the zombie's transaction was claimed: {taken:?}");

    zombie.cont();
    zombie.open_gate().await;
    assert_eq!(zombie.finish(WAIT).await, 0, "{}", zombie.transcript());
    let mut new_owner = Zombie::spawn("new-owner", &db, None, PLAN_NEW_OWNER, &[]);
    let code = new_owner.finish(WAIT).await;
    let transcript = format!("zombie:\n{}new owner:\n{}", zombie.transcript(), new_owner.transcript());
    println!("{transcript}");
    let (epoch, _) = assert_one_set_from_the_final_epoch(&db, &table, &transcript).await;
    if epoch == 1 {
        // The zombie's transaction committed: its compare-and-set ran while its epoch was current
        // and the row lock kept it current. (When it resumes past its deadline it is cancelled at
        // once, but a COMMIT already on the wire still lands: it reports its lease lost and
        // acknowledges nothing, and the new owner finds the job done.)
        assert_eq!(code, 3, "the new owner finds the job done\n{transcript}");
    } else {
        // Cancelled with its transaction rolled back: the new owner claimed epoch 2 and committed.
        assert_eq!(epoch, 2, "{transcript}");
        assert_eq!(new_owner.outcome().as_deref(), Some("outcome=completed"), "{transcript}");
    }
    db.cleanup().await;
}
