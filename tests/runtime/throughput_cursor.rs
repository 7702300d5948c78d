//! Issue #18, the claim cursor of `PgFence::claim_next`: a claim starts where the store's last
//! claims of the queue ended in `run_at` order instead of reading past every job still running
//! (about 2 µs of PostgreSQL CPU per job at concurrency 128), and the jobs it leaves behind (a
//! lease that ran out, a row skipped while locked) are still claimed: by the same call when the
//! claim from the cursor comes up short, within the rescan interval while a backlog keeps the
//! claims full.

use brokerfence_testkit::store as common;

use std::time::Duration;

use brokerfence::{ClaimedJob, FenceStore, JobKey, Owner, PgFence, QueueName};
use sqlx::{AssertSqlSafe, Connection};

/// A migrated store on a fresh schema with one connection (its statistics are the claims'),
/// scanning each queue from the start at most every `rescan`.
async fn store(rescan: Duration) -> PgFence {
    let pool = PgFence::pool_options().max_connections(1).connect(&common::database_url()).await.unwrap();
    let s = PgFence::new(pool).schema(common::unique_schema()).claim_rescan(rescan);
    s.migrate().await.unwrap();
    s
}

async fn enqueue(s: &PgFence, q: &QueueName, n: usize) {
    let jobs: Vec<(JobKey, Vec<u8>)> = (0..n).map(|i| (common::key(&format!("job-{i:05}")), Vec::new())).collect();
    assert_eq!(s.enqueue_many(q, &jobs).await.unwrap(), n as u64);
}

/// The keys claimed, sorted (a claim's answer comes in no particular order).
fn keys(claimed: &[ClaimedJob]) -> Vec<String> {
    let mut keys: Vec<String> = claimed.iter().map(|c| c.lease.key.as_str().to_owned()).collect();
    keys.sort();
    keys
}

/// Rows of the jobs table read per claim of 10 over five claims, with 300 jobs running ahead.
async fn rows_read_past_running(s: &PgFence) -> i64 {
    let q = QueueName::new("ahead").unwrap();
    let owner = Owner::new("claimer").unwrap();
    enqueue(s, &q, 400).await;
    assert_eq!(s.claim_next(&q, &owner, common::lease(30), 300).await.unwrap().len(), 300);
    let before = common::jobs_rows_read(s).await;
    for _ in 0..5 {
        assert_eq!(s.claim_next(&q, &owner, common::lease(30), 10).await.unwrap().len(), 10);
    }
    (common::jobs_rows_read(s).await - before) / 5
}

/// Guard (issue #18, the fence's PostgreSQL CPU per job): with 300 jobs running, a claim of 10
/// from the cursor reads about the 10 rows it claims. Scanning from the start (rescan interval
/// 0, as every claim did before the cursor) it reads past the 300 running rows each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_claim_cursor_skips_the_jobs_already_running() {
    let with = store(Duration::from_secs(600)).await;
    let without = store(Duration::ZERO).await;
    let (cursor, from_start) = (rows_read_past_running(&with).await, rows_read_past_running(&without).await);
    println!("rows read per claim of 10 with 300 running: from the cursor {cursor}, from the start {from_start}");
    assert!(cursor <= 30, "a claim from the cursor reads what it claims: {cursor} rows per claim of 10");
    assert!(from_start >= 300, "from the start a claim reads past the running jobs: {from_start}");
    common::drop_schema(&with).await;
    common::drop_schema(&without).await;
}

/// Covers: a job behind the cursor whose lease ran out is taken over while a backlog keeps every
/// claim full, once the rescan interval has passed, at a new epoch and as the oldest due job
/// first. Guard: without the rescan by time it would wait until the backlog is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_claim_cursor_takes_over_an_expired_lease_behind_it() {
    let s = store(Duration::from_secs(2)).await;
    let q = QueueName::new("expired").unwrap();
    let (a, b) = (Owner::new("stalled").unwrap(), Owner::new("busy").unwrap());
    enqueue(&s, &q, 200).await;
    let first = s.claim_next(&q, &a, common::lease(30), 1).await.unwrap();
    assert_eq!(keys(&first), ["job-00000"]);
    assert_eq!(s.claim_next(&q, &b, common::lease(30), 20).await.unwrap().len(), 20, "the cursor moves past job-00000");
    // The stalled holder's lease runs out (on the database clock).
    let sc = s.get_schema().as_str();
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {sc}.jobs SET lease_until = clock_timestamp() - interval '1 second' WHERE key = 'job-00000'"
    )))
    .execute(s.pool())
    .await
    .unwrap();
    // Before the rescan interval: claims from the cursor, full, without job-00000.
    let early = s.claim_next(&q, &b, common::lease(30), 10).await.unwrap();
    assert_eq!(early.len(), 10);
    assert!(!keys(&early).contains(&"job-00000".to_owned()), "{:?}", keys(&early));
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    let late = s.claim_next(&q, &b, common::lease(30), 10).await.unwrap();
    assert_eq!(late.len(), 10, "the backlog keeps the claim full");
    let taken =
        late.iter().find(|c| c.lease.key.as_str() == "job-00000").expect("job-00000 taken over after the rescan");
    assert_eq!(taken.lease.epoch, first[0].lease.epoch + 1, "taken over at a new epoch");
    assert_eq!(taken.lease.owner.as_str(), "busy");
    // The stalled holder is fenced out.
    let stale = s.complete(&first[0].lease, b"late").await;
    assert!(stale.as_ref().is_err_and(|e| e.is_fenced()), "{stale:?}");
    common::drop_schema(&s).await;
}

/// Covers: jobs a claim skipped because another transaction held them locked (a claim that then
/// rolled back) are behind the cursor; a claim from the cursor that finds fewer jobs than asked
/// scans from the start for the rest in the same call and takes them, however long the rescan
/// interval. No job is handed out twice, none is left. Guard: without that second scan the claim
/// would answer 10 of the 20 and the skipped jobs would wait for the rescan interval (600 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_claim_cursor_finds_skipped_jobs_when_a_claim_comes_up_short() {
    let s = store(Duration::from_secs(600)).await;
    let q = QueueName::new("skipped").unwrap();
    let owner = Owner::new("worker").unwrap();
    enqueue(&s, &q, 30).await;
    // Another transaction holds the first 10 rows locked while the store claims.
    let sc = s.get_schema().as_str().to_owned();
    let mut other = sqlx::postgres::PgConnection::connect(&common::database_url()).await.unwrap();
    sqlx::query("BEGIN").execute(&mut other).await.unwrap();
    sqlx::query(AssertSqlSafe(format!("SELECT key FROM {sc}.jobs WHERE queue = $1 AND key < 'job-00010' FOR UPDATE")))
        .bind(q.as_str())
        .fetch_all(&mut other)
        .await
        .unwrap();
    let first = s.claim_next(&q, &owner, common::lease(30), 10).await.unwrap();
    let after: Vec<String> = (10..20).map(|i| format!("job-{i:05}")).collect();
    assert_eq!(keys(&first), after, "the locked rows are skipped");
    sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
    // From the cursor only the 10 jobs after the first claim are left; the same call scans from
    // the start for the other 10 and finds the skipped ones.
    let second = s.claim_next(&q, &owner, common::lease(30), 20).await.unwrap();
    let rest: Vec<String> = (0..10).chain(20..30).map(|i| format!("job-{i:05}")).collect();
    assert_eq!(keys(&second), rest);
    let mut all: Vec<String> = [&first, &second].iter().flat_map(|c| keys(c)).collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 30, "every job handed out once");
    assert!(s.claim_next(&q, &owner, common::lease(30), 20).await.unwrap().is_empty());
    common::drop_schema(&s).await;
}
