//! Issue #30 (see main.rs for the items of this module).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use brokerfence::TableQueue;
use brokerfence::{Consumer, ConsumerConfig};
use brokerfence::{FenceStore, JobContext, JobKey, JobState, QueueName, RetryPolicy, SupervisorConfig};
use brokerfence_testkit::store as common;
use tokio_util::sync::CancellationToken;

/// How long each fast handler takes, and the attempt timeout: a handler alone fits well within
/// the timeout, two handlers in a row do not.
const WORK: Duration = Duration::from_millis(400);
const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(600);

/// Item 4: `attempt_timeout` starts with the handler, not with the claim. One handler slot, five
/// jobs claimed at once by the table queue (prefetch 5): the four fast ones (400 ms each) wait
/// their turn for the slot under heartbeated leases, up to 1.2 s, while the attempt timeout is
/// 600 ms; the fifth never returns. With `RetryPolicy::never()` a timed-out attempt is final.
///
/// Guard: the consumer runtime applies the attempt timeout once the handler has its slot
/// (`Shared::start` in `adapters/src/runtime/claim.rs`; the supervisor it builds has none of its
/// own). Before, the supervisor's timeout wrapped the wait for the slot too: the jobs after the
/// first were recorded as failed ("attempt timed out after 600ms") and went dead without their
/// handler having run (or while it ran). The slow job shows the timeout still ends a handler
/// that overruns it: dead, timed out, its handler cancelled before it finished.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item4_attempt_timeout_starts_when_the_handler_gets_its_slot() {
    let store: Arc<dyn FenceStore> = Arc::new(common::pg().await);
    let queue = QueueName::new(common::unique("slot-wait")).expect("queue");
    let fast: Vec<String> = (0..4).map(|i| format!("fast-{i}")).collect();
    let mut jobs: Vec<(JobKey, Vec<u8>)> = fast.iter().map(|k| (common::key(k), b"fast".to_vec())).collect();
    // Enqueued last: the table queue hands out the oldest due jobs first.
    jobs.push((common::key("slow"), b"slow".to_vec()));
    store.enqueue_many(&queue, &jobs).await.expect("enqueue");

    let supervisor =
        SupervisorConfig::new(common::lease(20)).attempt_timeout(ATTEMPT_TIMEOUT).retry(RetryPolicy::never());
    let config = ConsumerConfig::new(supervisor).concurrency(1).prefetch(5).batch(5);
    let consumer = Arc::new(Consumer::new(
        TableQueue::new(Arc::clone(&store), queue.clone()).idle_wait(Duration::from_millis(20)),
        Arc::clone(&store),
        config,
    ));
    let started: Arc<Mutex<Vec<String>>> = Arc::default();
    let slow_finished = Arc::new(AtomicBool::new(false));
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let (consumer, stop, started, slow_finished) =
            (Arc::clone(&consumer), stop.clone(), Arc::clone(&started), Arc::clone(&slow_finished));
        async move {
            let handler = move |ctx: JobContext| {
                let (started, slow_finished) = (Arc::clone(&started), Arc::clone(&slow_finished));
                async move {
                    started.lock().expect("lock").push(ctx.key().as_str().to_owned());
                    if ctx.payload() == b"slow" {
                        tokio::time::sleep(Duration::from_secs(5)).await;
                        slow_finished.store(true, Ordering::SeqCst);
                    } else {
                        tokio::time::sleep(WORK).await;
                    }
                    Ok(b"done".to_vec())
                }
            };
            consumer.run(handler, stop).await
        }
    });

    // Every job finished (completed or dead), or the deadline.
    let keys: Vec<String> = fast.iter().cloned().chain(["slow".to_owned()]).collect();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let rows = loop {
        let mut rows = Vec::new();
        for k in &keys {
            rows.push(common::job(&*store, &queue, k).await.expect("job row"));
        }
        if rows.iter().all(|r| matches!(r.state, JobState::Completed | JobState::Dead)) {
            break rows;
        }
        assert!(tokio::time::Instant::now() < deadline, "jobs still unfinished after 20 s: {rows:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), run).await.expect("shutdown in time").expect("join").expect("run");

    let started = started.lock().expect("lock").clone();
    for row in &rows[..4] {
        assert_eq!(
            row.state,
            JobState::Completed,
            "{}: a job waiting for the handler slot was failed by the attempt timeout (last error {:?}, \
             failures {}); handlers started, in order: {started:?}",
            row.key,
            row.last_error,
            row.failures,
        );
        assert_eq!(row.failures, 0, "{}: {:?}", row.key, row.last_error);
    }
    for k in &fast {
        assert_eq!(started.iter().filter(|s| *s == k).count(), 1, "{k} ran once: {started:?}");
    }
    // The timeout still ends a handler that overruns it.
    let slow = &rows[4];
    assert_eq!(slow.state, JobState::Dead, "the slow job: {slow:?}");
    let error = slow.last_error.as_deref().unwrap_or_default();
    assert!(error.contains("attempt timed out after 600ms"), "the slow job's last error: {error:?}");
    assert!(started.iter().any(|s| s == "slow"), "the slow job's handler started: {started:?}");
    assert!(!slow_finished.load(Ordering::SeqCst), "the slow handler was not cancelled by the timeout");
}
