//! Item 8 of issue #30, "pruning stalls without a word": `enqueue_in` took the queue's floor lock
//! (shared) and held it until the caller's COMMIT; the pruner waits 100 ms for the lock
//! (exclusive), gave up and logged at debug. Under steady business transactions a queue was
//! never pruned. Now an enqueue reads no floor (the row's first claim does, in a short fence
//! transaction), and a pruner that still finds a queue's floor lock held says so: a warning and
//! `PruneReport::floor_busy`, and it goes on with the next queue. Real PostgreSQL.

use std::sync::Arc;
use std::time::Duration;

use brokerfence::retention::{QueueRetention, Retention};
use brokerfence::{Claim, FenceStore, Owner, PgFence, QueueName};
use brokerfence_testkit::store::{self as common, key, lease, unique};
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

const HOUR: Duration = Duration::from_secs(3600);

/// Completes `n` jobs of `queue` and moves them two hours back on the database clock.
async fn finished_long_ago(fence: &PgFence, queue: &QueueName, n: usize) {
    let jobs: Vec<_> = (0..n).map(|i| (key(&format!("old-{i}")), Vec::new())).collect();
    fence.enqueue_many(queue, &jobs).await.expect("enqueue");
    let owner = Owner::unique("w");
    let claimed = fence.claim_next(queue, &owner, lease(30), n as u32).await.expect("claim");
    assert_eq!(claimed.len(), n);
    for c in &claimed {
        fence.complete(&c.lease, b"done").await.expect("complete");
    }
    let s = fence.get_schema().as_str();
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {s}.jobs SET updated_at = updated_at - interval '2 hours' WHERE queue = $1"
    )))
    .bind(queue.as_str().to_owned())
    .execute(fence.pool())
    .await
    .expect("backdate");
}

/// Business transactions that never stop: three tasks, staggered, each enqueueing a job in its
/// own transaction and holding it open 300 ms before COMMIT, so that one is always open.
fn steady_business(fence: &PgFence, queue: &QueueName, stop: &CancellationToken) -> Vec<tokio::task::JoinHandle<u64>> {
    (0..3u64)
        .map(|task| {
            let (fence, queue, stop) = (fence.clone(), queue.clone(), stop.clone());
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(100 * task)).await;
                let mut n = 0u64;
                while !stop.is_cancelled() {
                    let mut tx = fence.pool().begin().await.expect("begin");
                    let k = key(&format!("new-{task}-{n}"));
                    assert!(fence.enqueue_in(&mut tx, &queue, &k, b"order").await.expect("enqueue_in"));
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    tx.commit().await.expect("commit");
                    n += 1;
                }
                n
            })
        })
        .collect()
}

/// Item 8: a queue under steady business transactions (`enqueue_in`, each open 300 ms) is
/// pruned. Fails on the code before the fix: every batch found the floor lock held, the run
/// ended `contended` with nothing deleted (and said so at debug level only).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item8_a_queue_under_steady_business_transactions_is_pruned() {
    let fence = common::pg().await;
    let queue = QueueName::new(unique("busy")).expect("queue");
    finished_long_ago(&fence, &queue, 50).await;
    let stop = CancellationToken::new();
    let business = steady_business(&fence, &queue, &stop);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let retention = Retention::new().queue(queue.clone(), QueueRetention::completed_for(HOUR)).batch_size(20);
    let report = tokio::time::timeout(Duration::from_secs(30), fence.prune(&retention))
        .await
        .expect("prune within 30 s")
        .expect("prune");
    stop.cancel();
    let mut committed = 0;
    for b in business {
        committed += b.await.expect("business task");
    }
    assert!(committed >= 3, "the business transactions ran ({committed})");
    assert_eq!(
        (report.completed, report.contended, report.floor_busy),
        (50, false, 0),
        "the pruner must get through a queue whose business transactions enqueue: {report:?}"
    );
}

/// Item 8, what the fix relies on: an enqueue reads no epoch floor, so the row's first claim
/// must. An enqueue of a key racing a prune batch that deletes that key's old row (the batch
/// holds the floor lock, has deleted the row and raised the floor, and is still open) waits for
/// the batch, inserts, and the first claim starts above the raised floor. Guard: the floor term
/// for never-claimed rows in the claim statements (`capped_claim`); without it the claim
/// answered epoch 1 again, the pruned row's epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item8_an_enqueue_racing_a_prune_batch_is_claimed_above_the_floor() {
    let fence = common::pg().await;
    let sc = fence.get_schema().as_str().to_owned();
    let queue = QueueName::new(unique("race")).expect("queue");
    let me = Owner::unique("w");
    assert!(fence.enqueue(&queue, &key("k"), b"first").await.expect("enqueue"));
    let first = fence.claim_next(&queue, &me, lease(30), 1).await.expect("claim").remove(0).lease;
    fence.complete(&first, b"ok").await.expect("complete");
    assert_eq!(first.epoch, 1);

    // What a prune batch does, left open.
    let mut batch = fence.pool().begin().await.expect("begin");
    sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
        .bind(format!("brokerfence.floor.{sc}.{queue}"))
        .execute(&mut *batch)
        .await
        .expect("floor lock");
    sqlx::query(AssertSqlSafe(format!("DELETE FROM {sc}.jobs WHERE queue = $1 AND key = 'k'")))
        .bind(queue.as_str().to_owned())
        .execute(&mut *batch)
        .await
        .expect("delete");
    sqlx::query(AssertSqlSafe(format!("INSERT INTO {sc}.epoch_floors (queue, floor) VALUES ($1, 1)")))
        .bind(queue.as_str().to_owned())
        .execute(&mut *batch)
        .await
        .expect("raise floor");
    let racer = tokio::spawn({
        let (fence, queue) = (fence.clone(), queue.clone());
        async move {
            let mut tx = fence.pool().begin().await.expect("begin");
            let new = fence.enqueue_in(&mut tx, &queue, &key("k"), b"again").await.expect("enqueue_in");
            tx.commit().await.expect("commit");
            new
        }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!racer.is_finished(), "the enqueue waits for the delete in progress");
    batch.commit().await.expect("commit batch");
    assert!(racer.await.expect("racer"), "a pruned key is a new job");
    let again = fence.claim_next(&queue, &me, lease(30), 1).await.expect("claim").remove(0).lease;
    assert_eq!(again.epoch, 2, "the first claim of the re-enqueued key starts above the floor the batch raised");

    // A broker claim of a key enqueued after its row was pruned starts above the floor too.
    let b = QueueName::new(unique("race-broker")).expect("queue");
    let owner = Owner::unique("w");
    let l = match fence.claim(&b, &key("m"), &owner, lease(30)).await.expect("claim") {
        Claim::Claimed(l) => l,
        other => panic!("{other:?}"),
    };
    fence.complete(&l, b"ok").await.expect("complete");
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {sc}.jobs SET updated_at = updated_at - interval '2 hours' WHERE queue = $1"
    )))
    .bind(b.as_str().to_owned())
    .execute(fence.pool())
    .await
    .expect("backdate");
    let retention = Retention::new().queue(b.clone(), QueueRetention::completed_for(HOUR));
    assert_eq!(fence.prune(&retention).await.expect("prune").completed, 1);
    assert!(fence.enqueue(&b, &key("m"), b"again").await.expect("enqueue"));
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    match store.claim(&b, &key("m"), &owner, lease(30)).await.expect("claim") {
        Claim::Claimed(again) => assert!(again.epoch > l.epoch, "{} after {}", again.epoch, l.epoch),
        other => panic!("{other:?}"),
    }
}
