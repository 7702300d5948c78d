//! Issue #34 on SQS (LocalStack): one OpenTelemetry trace from a producer's `SendMessage`
//! through a fenced zombie's attempt and the new owner's attempt to the receiver; a malformed
//! `traceparent` attribute that changes nothing but a warning; the 10-attribute limit.
//!
//! `cargo test --workspace --all-features otel`.
#![cfg(all(feature = "otel", feature = "sqs", feature = "http"))]

use brokerfence_testkit::sqs as sqs_support;

use std::sync::Arc;
use std::time::Duration;

use brokerfence::sqs::aws_sdk_sqs::Client;
use brokerfence::sqs::aws_sdk_sqs::types::MessageAttributeValue;
use brokerfence::sqs::{MAX_MESSAGE_ATTRIBUTES, SqsConfig, SqsRetrofit, SqsSource, traced};
use brokerfence::{FenceStore, JobContext, JobKey, JobState, SupervisorConfig};
use brokerfence_testkit::store::{drop_schema, lease, pg};
use sqs_support::{TestQueue, receive_raw, sqs};

use brokerfence_testkit::otel::{
    Gate, Stalled, attr, await_commit, capture, check_zombie_trace, consumer, has_outcomes, owner_handler, receiver,
    stop_all, wait_until, zombie_handler,
};

fn source(client: &Client, q: &TestQueue) -> SqsSource {
    SqsSource::new(client.clone(), SqsConfig::new(&q.url).expect("url").wait_time(Duration::from_secs(1)))
}

fn string(v: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder().data_type("String").string_value(v).build().expect("attribute")
}

/// The trace of a zombie on SQS. The producer sends inside its span `produce` (attribute
/// `traceparent`, by `sqs::traced`); the zombie's heartbeats never reach the database, so its
/// visibility is never extended and the message comes back; the new owner claims epoch 2, calls
/// the receiver and commits; the zombie's late commit is fenced. One trace: the zombie's attempt
/// is the producer's child and says `fenced` by epoch 2; the new owner's links to the producer.
#[tokio::test(flavor = "current_thread")]
async fn otel_sqs_traces_a_fenced_zombie_from_the_producer_to_the_receiver() {
    let cap = capture();
    let client = sqs().await;
    let q = TestQueue::new(&client, "otel", 3).await;
    let fence = pg().await;
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    let url = receiver(&fence, "otel-sqs").await;
    let produce = tracing::info_span!("produce");
    let send = produce.in_scope(|| traced(client.send_message().queue_url(&q.url).message_body("x")));
    let id = send.send().await.expect("send").message_id().expect("id").to_owned();
    drop(produce);

    let (zombie_started, rival_done) = (Gate::default(), Gate::default());
    let stalled: Arc<dyn FenceStore> = Arc::new(Stalled(Arc::clone(&store)));
    let zombie = consumer(
        source(&client, &q),
        stalled,
        "zombie",
        SupervisorConfig::new(lease(3)).without_cancel_on_loss(),
        zombie_handler(zombie_started.clone(), rival_done.clone(), url.clone()),
    );
    zombie_started.wait(Duration::from_secs(15)).await;
    assert!(zombie_started.is_open(), "the zombie never started");
    let rival =
        consumer(source(&client, &q), Arc::clone(&store), "rival", SupervisorConfig::new(lease(3)), owner_handler(url));
    await_commit(&*store, &q.fence_queue(), &id, &rival_done).await;
    // Both attempts' spans exported (each ends after its verdict).
    let ended = || has_outcomes(&cap, &q.name, &["fenced", "committed"]);
    wait_until(Duration::from_secs(20), "fenced and committed attempt spans", ended).await;
    stop_all(vec![zombie, rival]).await;
    let spans = cap.spans();
    let shown = check_zombie_trace(&spans, &q.name, "aws_sqs");
    assert!(shown.iter().any(|s| attr(s, "messaging.message.id").as_deref() == Some(id.as_str())));
    q.delete(&client).await;
    drop_schema(&fence).await;
}

/// A message whose `traceparent` attribute is malformed runs and commits once (deleted, not
/// dead-lettered), with a warning; its attempt span has no parent and no link.
#[tokio::test(flavor = "current_thread")]
async fn otel_sqs_malformed_traceparent_is_ignored_with_a_warning() {
    let cap = capture();
    let client = sqs().await;
    let q = TestQueue::with_dlq(&client, "otel-bad", 3, 1).await;
    let fence = pg().await;
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    let sent = client
        .send_message()
        .queue_url(&q.url)
        .message_body("x")
        .message_attributes("traceparent", string("00-zzzz-01"))
        .send()
        .await
        .expect("send");
    let id = sent.message_id().expect("id").to_owned();
    let worker = consumer(
        source(&client, &q),
        Arc::clone(&store),
        "w",
        SupervisorConfig::new(lease(3)),
        |_: JobContext| async { Ok(b"ok".to_vec()) },
    );
    wait_until(Duration::from_secs(20), "the attempt span", || !cap.attempts(&q.name).is_empty()).await;
    stop_all(vec![worker]).await;
    let row = store.job(&q.fence_queue(), &JobKey::new(id).expect("key")).await.expect("job").expect("row");
    assert_eq!((row.state, row.epoch), (JobState::Completed, 1));
    let attempt = &cap.attempts(&q.name)[0];
    assert_eq!(attr(attempt, "brokerfence.outcome").as_deref(), Some("committed"));
    assert_eq!(attempt.parent_span_id, opentelemetry::trace::SpanId::INVALID);
    let warnings = cap.warnings();
    assert!(warnings.iter().any(|w| w.contains("malformed trace context") && w.contains("SQS")), "{warnings:?}");
    let dlq = q.dlq.as_deref().expect("dlq");
    assert!(receive_raw(&client, dlq, 1).await.is_empty(), "dead-lettered");
    assert!(receive_raw(&client, &q.url, 1).await.is_empty(), "not deleted");
    q.delete(&client).await;
    drop_schema(&fence).await;
}

/// SQS takes 10 attributes per message: a message with 10 of the user's goes out without the
/// context, unchanged, and a warning says so; with 9, `traceparent` is the tenth. No attribute
/// of the user's is ever pushed out.
#[tokio::test(flavor = "current_thread")]
async fn otel_sqs_attribute_limit_never_pushes_out_a_users_attribute() {
    let cap = capture();
    let client = sqs().await;
    let q = TestQueue::new(&client, "otel-limit", 30).await;
    let span = tracing::info_span!("produce");
    for n in [MAX_MESSAGE_ATTRIBUTES, MAX_MESSAGE_ATTRIBUTES - 1] {
        let mut send = client.send_message().queue_url(&q.url).message_body(format!("{n}"));
        for i in 0..n {
            send = send.message_attributes(format!("user-{i}"), string("v"));
        }
        let send = span.in_scope(|| traced(send));
        send.send().await.expect("SQS accepts the message");
    }
    drop(span);
    let mut got = Vec::new();
    for _ in 0..10 {
        got.extend(receive_raw(&client, &q.url, 1).await);
        if got.len() == 2 {
            break;
        }
    }
    assert_eq!(got.len(), 2);
    for m in got {
        let attrs = m.message_attributes().expect("attributes");
        let users = attrs.keys().filter(|k| k.starts_with("user-")).count();
        match m.body() {
            Some("10") => {
                assert_eq!(users, 10, "every attribute of the user's kept");
                assert!(!attrs.contains_key("traceparent"), "no room: no context");
            }
            Some("9") => {
                assert_eq!(users, 9);
                assert!(attrs.contains_key("traceparent"), "the tenth attribute is the context");
            }
            other => panic!("unexpected body {other:?}"),
        }
    }
    let warnings = cap.warnings();
    assert!(warnings.iter().any(|w| w.contains("sent without its trace context")), "{warnings:?}");
    q.delete(&client).await;
}

/// `SqsRetrofit` in the user's own receive loop continues the producer's trace too: the attempt
/// of a message sent inside a span (with `sqs::traced`) is that span's child, with the message's
/// id, and the message is deleted after the commit.
#[tokio::test(flavor = "current_thread")]
async fn otel_sqs_retrofit_continues_the_producers_trace() {
    let cap = capture();
    let client = sqs().await;
    let q = TestQueue::new(&client, "otel-retrofit", 30).await;
    let fence = pg().await;
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    let produce = tracing::info_span!("produce");
    let send = produce.in_scope(|| traced(client.send_message().queue_url(&q.url).message_body("x")));
    let id = send.send().await.expect("send").message_id().expect("id").to_owned();
    let producer = produce.id().is_some();
    drop(produce);
    assert!(producer);
    let retrofit = SqsRetrofit::new(store, source(&client, &q), SupervisorConfig::new(lease(30)));
    let messages = receive_raw(&client, &q.url, 5).await;
    assert_eq!(messages.len(), 1);
    let done = retrofit.process(&messages[0], |_: JobContext| async { Ok(b"ok".to_vec()) }).await;
    assert!(done.should_ack(), "{done:?}");
    let spans = cap.spans();
    let producer = spans.iter().find(|s| s.name == "produce").expect("the producer's span");
    let attempt = cap.attempts(&q.name).pop().expect("the attempt's span");
    assert_eq!(attempt.parent_span_id, producer.span_context.span_id(), "the attempt is the producer's child");
    assert_eq!(attempt.span_context.trace_id(), producer.span_context.trace_id());
    assert_eq!(attr(&attempt, "messaging.message.id").as_deref(), Some(id.as_str()));
    assert_eq!(attr(&attempt, "brokerfence.outcome").as_deref(), Some("committed"));
    q.delete(&client).await;
    drop_schema(&fence).await;
}
