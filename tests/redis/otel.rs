//! Issue #34 on a Redis stream: one OpenTelemetry trace from a producer's `XADD` (with the
//! `traceparent` field) through a fenced zombie's attempt and the new owner's attempt to the
//! receiver; a malformed `traceparent` field that changes nothing but a warning.
//!
//! `cargo test --workspace --all-features otel`.
#![cfg(all(feature = "otel", feature = "redis"))]

use brokerfence_testkit::redis as redis_support;

use std::sync::Arc;
use std::time::Duration;

use brokerfence::otel::TraceContext;
use brokerfence::redis::{KeyFrom, StreamSource};
use brokerfence::{FenceStore, JobContext, JobState, QueueName, SupervisorConfig};
use brokerfence_testkit::store::lease;
use redis_support::*;

use brokerfence_testkit::otel::{
    Gate, Stalled, attr, await_commit, capture, check_zombie_trace, consumer, owner_handler, receiver, stop_all,
    wait_until, zombie_handler,
};

fn source(env: &Env, stream: &str) -> StreamSource {
    StreamSource::new(env.redis.clone(), QueueName::new(stream).expect("queue"), stream, "g")
        .expect("source")
        .key_from(KeyFrom::Field("key".into()))
        .block(Duration::from_millis(200))
        .autoclaim_every(Duration::from_millis(200))
}

/// `XADD` of job `key` with the current span's context as fields (what a producer does).
async fn produce(env: &Env, stream: &str, key: &str, trace: &[(&'static str, String)]) {
    let mut fields: Vec<(&[u8], &[u8])> = vec![(b"key", key.as_bytes()), (b"body", b"x")];
    fields.extend(trace.iter().map(|(k, v)| (k.as_bytes(), v.as_bytes())));
    xadd(&mut env.conn(), stream, &fields).await;
}

/// The trace of a zombie on a Redis stream. The producer adds the entry inside its span
/// `produce` (field `traceparent`); the zombie's heartbeats never reach the database, so its
/// lease key is never renewed and the entry is auto-claimed by the new owner, which claims epoch
/// 2, calls the receiver and commits; the zombie's late commit is fenced.
#[tokio::test(flavor = "current_thread")]
async fn otel_redis_stream_traces_a_fenced_zombie_from_the_producer_to_the_receiver() {
    let cap = capture();
    let env = Env::new().await;
    let stream = env.name("otel");
    let store: Arc<dyn FenceStore> = env.store();
    let url = receiver(&env.store, "otel-redis").await;
    let span = tracing::info_span!("produce");
    let trace = span.in_scope(|| TraceContext::current().expect("a context inside the span").to_headers());
    produce(&env, &stream, "job-1", &trace).await;
    drop(span);

    let (zombie_started, rival_done) = (Gate::default(), Gate::default());
    let stalled: Arc<dyn FenceStore> = Arc::new(Stalled(Arc::clone(&store)));
    let zombie = consumer(
        source(&env, &stream),
        stalled,
        "zombie",
        SupervisorConfig::new(lease(3)).without_cancel_on_loss(),
        zombie_handler(zombie_started.clone(), rival_done.clone(), url.clone()),
    );
    zombie_started.wait(Duration::from_secs(15)).await;
    assert!(zombie_started.is_open(), "the zombie never started");
    let rival = consumer(
        source(&env, &stream),
        Arc::clone(&store),
        "rival",
        SupervisorConfig::new(lease(3)),
        owner_handler(url),
    );
    let queue = QueueName::new(stream.as_str()).expect("queue");
    await_commit(&*store, &queue, "job-1", &rival_done).await;
    let fenced = || cap.attempts(&stream).iter().any(|s| attr(s, "brokerfence.outcome").as_deref() == Some("fenced"));
    wait_until(Duration::from_secs(20), "fenced attempt span", fenced).await;
    stop_all(vec![zombie, rival]).await;
    check_zombie_trace(&cap.spans(), &stream, "redis");
    env.cleanup().await;
}

/// An entry whose `traceparent` field is malformed runs and commits once, with a warning.
#[tokio::test(flavor = "current_thread")]
async fn otel_redis_malformed_traceparent_is_ignored_with_a_warning() {
    let cap = capture();
    let env = Env::new().await;
    let stream = env.name("otel-bad");
    let store: Arc<dyn FenceStore> = env.store();
    produce(&env, &stream, "job-1", &[("traceparent", "01-xyz".into())]).await;
    let worker = consumer(
        source(&env, &stream),
        Arc::clone(&store),
        "w",
        SupervisorConfig::new(lease(3)),
        |_: JobContext| async { Ok(b"ok".to_vec()) },
    );
    wait_until(Duration::from_secs(20), "the attempt span", || !cap.attempts(&stream).is_empty()).await;
    stop_all(vec![worker]).await;
    let row = env.job(&stream, "job-1").await.expect("row");
    assert_eq!((row.state, row.epoch), (JobState::Completed, 1));
    let attempt = &cap.attempts(&stream)[0];
    assert_eq!(attr(attempt, "brokerfence.outcome").as_deref(), Some("committed"));
    assert_eq!(attempt.parent_span_id, opentelemetry::trace::SpanId::INVALID);
    let warnings = cap.warnings();
    assert!(
        warnings.iter().any(|w| w.contains("malformed trace context") && w.contains("stream entry")),
        "{warnings:?}"
    );
    env.cleanup().await;
}
