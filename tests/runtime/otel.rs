//! Issue #34 on the table queue: one OpenTelemetry trace from `enqueue` through a fenced zombie's
//! attempt and the new owner's attempt to the receiver, a malformed `traceparent` column that
//! changes nothing but a warning, and the throughput cost of `otel` (in-memory exporter) against
//! none, paired rounds.
//!
//! Real PostgreSQL (a fresh schema per test). `cargo test --workspace --all-features otel`.
#![cfg(feature = "otel")]

use std::sync::Arc;
use std::time::Duration;

use brokerfence::{FenceStore, JobContext, JobState, QueueName, SupervisorConfig, TableQueue};
use brokerfence_testkit::store::{drop_schema, job, key, lease, pg, unique};
use tracing::Instrument;

use crate::otel_support::{
    Gate, Stalled, attr, await_commit, capture, check_zombie_trace, consumer, owner_handler, receiver, stop_all,
    wait_until, zombie_handler,
};

fn table(store: &Arc<dyn FenceStore>, queue: &QueueName) -> TableQueue {
    TableQueue::new(Arc::clone(store), queue.clone()).idle_wait(Duration::from_millis(100))
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
    let stalled: Arc<dyn FenceStore> = Arc::new(Stalled(Arc::clone(&store)));
    let zombie = consumer(
        table(&stalled, &queue),
        stalled,
        "zombie",
        SupervisorConfig::new(lease(3)).without_cancel_on_loss(),
        zombie_handler(zombie_started.clone(), rival_done.clone(), url.clone()),
    );
    zombie_started.wait(Duration::from_secs(10)).await;
    assert!(zombie_started.is_open(), "the zombie never started");
    let rival = consumer(
        table(&store, &queue),
        Arc::clone(&store),
        "rival",
        SupervisorConfig::new(lease(3)),
        owner_handler(url),
    );
    await_commit(&*store, &queue, "job-1", &rival_done).await;
    let q = queue.as_str().to_owned();
    let fenced = || cap.attempts(&q).iter().any(|s| attr(s, "brokerfence.outcome").as_deref() == Some("fenced"));
    wait_until(Duration::from_secs(20), "fenced attempt span", fenced).await;
    stop_all(vec![zombie, rival]).await;
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
    let worker = consumer(
        table(&store, &queue),
        Arc::clone(&store),
        "w",
        SupervisorConfig::new(lease(3)),
        |_ctx: JobContext| async move { Ok(b"ok".to_vec()) },
    );
    let q = queue.as_str().to_owned();
    wait_until(Duration::from_secs(20), "the attempt span", || !cap.attempts(&q).is_empty()).await;
    stop_all(vec![worker]).await;
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
