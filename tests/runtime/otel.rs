//! Issue #34 on the table queue: one OpenTelemetry trace from `enqueue` through a fenced zombie's
//! attempt and the new owner's attempt to the receiver, a malformed `traceparent` column that
//! changes nothing but a warning, and the throughput cost of `otel` (in-memory exporter) against
//! none, paired rounds.
//!
//! Real PostgreSQL (a fresh schema per test). `cargo test --workspace --all-features otel`.
#![cfg(feature = "otel")]

use std::sync::Arc;
use std::time::{Duration, Instant};

use brokerfence::{
    Consumer, ConsumerConfig, FenceStore, JobContext, JobState, Owner, QueueName, SupervisorConfig, TableQueue,
};
use brokerfence_testkit::store::{drop_schema, job, key, lease, pg, unique};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::otel_support::{Gate, Stalled, attr, call, capture, check_zombie_trace, receiver, wait_until};

/// Starts a consumer of the table queue `queue` on `store` as `owner`.
fn consumer(
    store: Arc<dyn FenceStore>,
    queue: &QueueName,
    owner: &str,
    config: SupervisorConfig,
    handler: impl brokerfence::Handler,
) -> (CancellationToken, tokio::task::JoinHandle<()>) {
    let source = TableQueue::new(Arc::clone(&store), queue.clone()).idle_wait(Duration::from_millis(100));
    let config = ConsumerConfig::new(config).concurrency(1).prefetch(0).grace(Duration::from_millis(500));
    let consumer = Consumer::with_owner(source, store, Owner::new(owner).expect("owner"), config);
    let stop = CancellationToken::new();
    let token = stop.clone();
    let task = tokio::spawn(async move {
        let _ = consumer.run(handler, token).await;
    });
    (stop, task)
}

/// The trace of a zombie on the table queue. The producer enqueues inside its span `produce`
/// (the `traceparent` column); the zombie's heartbeats never reach the database, its lease
/// lapses, the new owner claims epoch 2, calls the receiver and commits; then the zombie's late
/// commit is fenced (and its receiver call refused). One trace: the zombie's attempt is the
/// producer's child and says `fenced` by epoch 2; the new owner's attempt links to the
/// producer's span and says `committed`; the receiver's span is the new owner's child.
#[tokio::test(flavor = "current_thread")]
async fn otel_table_queue_traces_a_fenced_zombie_from_enqueue_to_the_receiver() {
    let cap = capture();
    let fence = pg().await;
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    let queue = QueueName::new(unique("otel-table")).expect("queue");
    let url = receiver(&fence, "otel-table").await;
    let produce = tracing::info_span!("produce");
    store.enqueue(&queue, &key("job-1"), b"x").instrument(produce.clone()).await.expect("enqueue");
    drop(produce);

    let (zombie_started, rival_done) = (Gate::default(), Gate::default());
    let (z_started, z_done, z_url) = (zombie_started.clone(), rival_done.clone(), url.clone());
    let (zombie_stop, zombie_task) = consumer(
        Arc::new(Stalled(Arc::clone(&store))),
        &queue,
        "zombie",
        SupervisorConfig::new(lease(3)).without_cancel_on_loss(),
        move |ctx: JobContext| {
            let (started, done, url) = (z_started.clone(), z_done.clone(), z_url.clone());
            async move {
                started.open();
                done.wait(Duration::from_secs(30)).await;
                let status = call(&url, &ctx).await?;
                assert_eq!(status, 409, "the receiver refuses the zombie's older epoch");
                Ok(b"zombie".to_vec())
            }
        },
    );
    zombie_started.wait(Duration::from_secs(10)).await;
    assert!(zombie_started.is_open(), "the zombie never started");
    let rival_url = url.clone();
    let (rival_stop, rival_task) =
        consumer(Arc::clone(&store), &queue, "rival", SupervisorConfig::new(lease(3)), move |ctx: JobContext| {
            let url = rival_url.clone();
            async move {
                let status = call(&url, &ctx).await?;
                assert_eq!(status, 200, "the receiver accepts the new owner");
                Ok(b"rival".to_vec())
            }
        });
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let row = job(&*store, &queue, "job-1").await.expect("row");
        if row.state == JobState::Completed {
            assert_eq!(row.epoch, 2);
            break;
        }
        assert!(Instant::now() < deadline, "the new owner never committed: {row:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    rival_done.open();
    let q = queue.as_str().to_owned();
    let fenced = || cap.attempts(&q).iter().any(|s| attr(s, "brokerfence.outcome").as_deref() == Some("fenced"));
    wait_until(Duration::from_secs(20), "fenced attempt span", fenced).await;
    for (stop, task) in [(zombie_stop, zombie_task), (rival_stop, rival_task)] {
        stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
    }
    let spans = cap.spans();
    check_zombie_trace(&spans, queue.as_str(), "table");
    drop_schema(&fence).await;
}

/// A malformed `traceparent` in the jobs table (written around the fence) is ignored with a
/// warning: the job runs and commits, its attempt span starts a trace of its own.
#[tokio::test(flavor = "current_thread")]
async fn otel_malformed_traceparent_in_the_table_is_ignored_with_a_warning() {
    let cap = capture();
    let fence = pg().await;
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    let queue = QueueName::new(unique("otel-bad")).expect("queue");
    store.enqueue(&queue, &key("job-1"), b"x").await.expect("enqueue");
    let schema = fence.get_schema().as_str().to_owned();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {schema}.jobs SET traceparent = '00-not-a-trace-01', tracestate = 'x=1' WHERE queue = $1"
    )))
    .bind(queue.as_str())
    .execute(fence.pool())
    .await
    .expect("corrupt the column");
    let (stop, task) =
        consumer(Arc::clone(&store), &queue, "w", SupervisorConfig::new(lease(3)), |_ctx: JobContext| async move {
            Ok(b"ok".to_vec())
        });
    let q = queue.as_str().to_owned();
    wait_until(Duration::from_secs(20), "the attempt span", || !cap.attempts(&q).is_empty()).await;
    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
    let row = job(&*store, &queue, "job-1").await.expect("row");
    assert_eq!((row.state, row.epoch), (JobState::Completed, 1), "the job ran and committed");
    let attempt = &cap.attempts(&q)[0];
    assert_eq!(attr(attempt, "brokerfence.outcome").as_deref(), Some("committed"));
    assert_eq!(attempt.parent_span_id, opentelemetry::trace::SpanId::INVALID, "no parent from a malformed context");
    assert!(attempt.links.links.is_empty());
    let warnings = cap.warnings();
    assert!(
        warnings.iter().any(|w| w.contains("malformed trace context") && w.contains("jobs table")),
        "no warning: {warnings:?}"
    );
    drop_schema(&fence).await;
}
