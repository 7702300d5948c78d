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
    Gate, Stalled, attr, await_commit, capture, check_zombie_trace, consumer, has_outcomes, owner_handler, receiver,
    stop_all, wait_until, zombie_handler,
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
    // Both attempts' spans exported (each ends after its verdict).
    let ended = || has_outcomes(&cap, &stream, &["fenced", "committed"]);
    wait_until(Duration::from_secs(20), "fenced and committed attempt spans", ended).await;
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

/// Issue #34, item 1 (the outbox): a message the relay publishes carries the trace context of
/// the attempt that wrote its outbox row, not the relay's, so the consumer of the stream continues
/// the writer's trace. A table-queue attempt writes the row and completes in one transaction; the
/// relay publishes inside its own span; the stream's consumer runs the message. The consumer's
/// attempt is a child of the writer's attempt (one trace, not the relay's). Guards the relay
/// that stamped every message with its own round's context (the row did not store the
/// writer's): the consumer's parent would then be the relay's `outbox_round` span. A row whose
/// stored context is malformed is published with the relay's context and a warning naming the
/// outbox row.
#[tokio::test(flavor = "current_thread")]
async fn otel_outbox_messages_continue_the_trace_of_the_attempt_that_wrote_them() {
    use brokerfence::TableQueue;
    use brokerfence::outbox::{OutboxRelay, RelayConfig};
    use brokerfence::redis::RedisPublisher;

    let cap = capture();
    let env = Env::new().await;
    let stream = env.name("otel-outbox");
    let fence = env.store.clone();
    let store: Arc<dyn FenceStore> = env.store();
    let jobs = QueueName::new(env.name("otel-outbox-jobs")).expect("queue");
    store.enqueue(&jobs, &brokerfence_testkit::store::key("order-1"), b"x").await.expect("enqueue");
    let writer_fence = fence.clone();
    let writer = consumer(
        TableQueue::new(Arc::clone(&store), jobs.clone()).idle_wait(Duration::from_millis(100)),
        Arc::clone(&store),
        "writer",
        SupervisorConfig::new(lease(5)),
        move |ctx: JobContext| {
            let fence = writer_fence.clone();
            async move {
                let mut tx = fence.begin().await.map_err(brokerfence::JobError::retry)?;
                fence
                    .outbox_in(&mut tx, ctx.lease(), "audit", b"order-1 paid")
                    .await
                    .map_err(brokerfence::JobError::retry)?;
                ctx.complete_in(&mut *tx, b"paid").await.map_err(brokerfence::JobError::retry)?;
                tx.commit().await.map_err(brokerfence::JobError::retry)?;
                Ok(b"paid".to_vec())
            }
        },
    );
    let q = jobs.as_str().to_owned();
    let committed = || cap.attempts(&q).iter().any(|s| attr(s, "brokerfence.outcome").as_deref() == Some("committed"));
    wait_until(Duration::from_secs(20), "the writer's committed attempt", committed).await;
    stop_all(vec![writer]).await;
    let written = cap.attempts(&q).into_iter().next().expect("the writer's attempt");

    // A second row, its stored context malformed (written around the fence).
    let lease2 = {
        store.enqueue(&jobs, &brokerfence_testkit::store::key("order-2"), b"x").await.expect("enqueue");
        let owner = brokerfence::Owner::new("w2").expect("owner");
        let claim =
            store.claim(&jobs, &brokerfence_testkit::store::key("order-2"), &owner, lease(5)).await.expect("claim");
        claim.lease().cloned().expect("claimed")
    };
    let mut tx = fence.begin().await.expect("begin");
    fence.outbox_in(&mut tx, &lease2, "audit", b"order-2 paid").await.expect("outbox row");
    tx.commit().await.expect("commit");
    let schema = fence.get_schema().as_str().to_owned();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "UPDATE {schema}.outbox SET traceparent = '00-bad' WHERE key = 'order-2'"
    )))
    .execute(fence.pool())
    .await
    .expect("corrupt the row's context");

    let relay = OutboxRelay::new(fence.clone(), RelayConfig::default())
        .publisher(Arc::new(RedisPublisher::new(env.redis.clone()).route("audit", &stream)));
    let round = relay.relay_once().await.expect("relay round");
    assert_eq!(round.sent.len(), 2, "both rows published: {round:?}");
    let relay_span = cap.spans().into_iter().find(|s| s.name == "outbox_round").expect("the relay's span");
    let entries = xrange(&mut env.conn(), &stream).await;
    let context_of = |job: &str| {
        let (_, fields) = entries
            .iter()
            .find(|(_, f)| f.iter().any(|(k, v)| k == b"Fence-Job" && v == job.as_bytes()))
            .expect("the entry");
        let pairs = fields
            .iter()
            .map(|(k, v)| (String::from_utf8_lossy(k).into_owned(), String::from_utf8_lossy(v).into_owned()));
        TraceContext::from_headers(pairs).expect("a traceparent field").span_context()
    };
    let first = context_of("order-1");
    assert_eq!(
        (first.trace_id(), first.span_id()),
        (written.span_context.trace_id(), written.span_context.span_id()),
        "the message carries the writer's attempt, not the relay's round"
    );
    let second = context_of("order-2");
    assert_eq!(
        (second.trace_id(), second.span_id()),
        (relay_span.span_context.trace_id(), relay_span.span_context.span_id()),
        "a malformed stored context falls back to the relay's"
    );
    let warnings = cap.warnings();
    assert!(warnings.iter().any(|w| w.contains("malformed trace context") && w.contains("outbox row")), "{warnings:?}");

    // The stream's consumer continues the writer's trace.
    let reader = consumer(
        StreamSource::new(env.redis.clone(), QueueName::new(stream.as_str()).expect("queue"), &stream, "g")
            .expect("source")
            .key_from(KeyFrom::Field("Fence-Job".into()))
            .block(Duration::from_millis(200)),
        Arc::clone(&store),
        "reader",
        SupervisorConfig::new(lease(5)),
        |_: JobContext| async { Ok(b"applied".to_vec()) },
    );
    wait_until(Duration::from_secs(20), "both messages applied", || cap.attempts(&stream).len() >= 2).await;
    stop_all(vec![reader]).await;
    let applied = cap
        .attempts(&stream)
        .into_iter()
        .find(|s| attr(s, "key").as_deref() == Some("order-1"))
        .expect("order-1's attempt downstream");
    assert_eq!(applied.span_context.trace_id(), written.span_context.trace_id(), "one trace across the outbox");
    assert_eq!(applied.parent_span_id, written.span_context.span_id(), "a child of the writer's attempt");
    env.cleanup().await;
}

/// Issue #34, item 2 (the outcome `duplicate`): a stream entry for a job already committed (the
/// producer sent it twice) is an `attempt` span with `brokerfence.outcome = duplicate`, the
/// epoch that committed the job, the messaging attributes, and a link to the producer's span of
/// that second entry; it is acknowledged and runs no handler. Guards the runtime that made no
/// span for a duplicate (the delivery vanished from the trace).
#[tokio::test(flavor = "current_thread")]
async fn otel_a_duplicate_delivery_is_an_attempt_with_outcome_duplicate() {
    let cap = capture();
    let env = Env::new().await;
    let stream = env.name("otel-dup");
    let store: Arc<dyn FenceStore> = env.store();
    produce(&env, &stream, "job-1", &[]).await;
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let worker = consumer(
        source(&env, &stream),
        Arc::clone(&store),
        "w",
        SupervisorConfig::new(lease(3)),
        move |_: JobContext| {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { Ok(b"ok".to_vec()) }
        },
    );
    let committed =
        || cap.attempts(&stream).iter().any(|s| attr(s, "brokerfence.outcome").as_deref() == Some("committed"));
    wait_until(Duration::from_secs(20), "the committed attempt", committed).await;
    let again = tracing::info_span!("produce-again");
    let trace = again.in_scope(|| TraceContext::current().expect("a context inside the span").to_headers());
    produce(&env, &stream, "job-1", &trace).await;
    let duplicate =
        || cap.attempts(&stream).iter().any(|s| attr(s, "brokerfence.outcome").as_deref() == Some("duplicate"));
    wait_until(Duration::from_secs(20), "the duplicate's attempt span", duplicate).await;
    stop_all(vec![worker]).await;
    drop(again);
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1, "the handler ran once");
    let spans = cap.spans();
    let producer = spans.iter().find(|s| s.name == "produce-again").expect("the second producer's span");
    let dup = cap
        .attempts(&stream)
        .into_iter()
        .find(|s| attr(s, "brokerfence.outcome").as_deref() == Some("duplicate"))
        .expect("the duplicate");
    assert_eq!(attr(&dup, "brokerfence.epoch").as_deref(), Some("1"), "the epoch that committed the job");
    assert_eq!(attr(&dup, "messaging.system").as_deref(), Some("redis"));
    assert_eq!(attr(&dup, "messaging.destination.name").as_deref(), Some(stream.as_str()));
    assert!(attr(&dup, "messaging.message.id").is_some_and(|id| id.contains('-')), "the entry id");
    assert!(
        dup.links.links.iter().any(|l| l.span_context.span_id() == producer.span_context.span_id()),
        "linked to the producer of the duplicate: {:?}",
        dup.links.links
    );
    assert!(!matches!(dup.status, opentelemetry::trace::Status::Error { .. }), "a duplicate is no error");
    let row = env.job(&stream, "job-1").await.expect("row");
    assert_eq!((row.state, row.epoch), (JobState::Completed, 1));
    env.cleanup().await;
}

/// Issue #34, item 2 (heartbeats and broker calls): at debug level each heartbeat of a running
/// attempt is a `heartbeat` span and each broker call of the Redis lease hook a `broker_call`
/// span, both children of the attempt's span (one renewal statement and one hook call serve
/// every attempt of the worker, so each attempt gets its own child of them); at info level
/// neither exists, while the attempt span does. Guards the heartbeat that made no child spans
/// (a hung renewal was invisible in the attempt's trace) and spans that leak to info level.
#[tokio::test(flavor = "current_thread")]
async fn otel_heartbeats_and_broker_calls_are_child_spans_at_debug_level_only() {
    use brokerfence_testkit::otel::capture_at;
    let env = Env::new().await;
    for (level, job) in [(tracing::Level::DEBUG, "job-debug"), (tracing::Level::INFO, "job-info")] {
        let cap = capture_at(false, level);
        let stream = env.name(&format!("otel-beats-{job}"));
        let store: Arc<dyn FenceStore> = env.store();
        produce(&env, &stream, job, &[]).await;
        // Lease 3 s: heartbeats every second, so a 2.5 s handler sees two or three of them.
        let worker = consumer(
            source(&env, &stream),
            Arc::clone(&store),
            "w",
            SupervisorConfig::new(lease(3)),
            |_: JobContext| async {
                tokio::time::sleep(Duration::from_millis(2_500)).await;
                Ok(b"ok".to_vec())
            },
        );
        wait_until(Duration::from_secs(20), "the attempt span", || !cap.attempts(&stream).is_empty()).await;
        stop_all(vec![worker]).await;
        let attempt = cap.attempts(&stream).into_iter().next().expect("the attempt");
        assert_eq!(attr(&attempt, "brokerfence.outcome").as_deref(), Some("committed"));
        let spans = cap.spans();
        let children = |name: &str| -> Vec<_> {
            spans
                .iter()
                .filter(|s| s.name == name && s.parent_span_id == attempt.span_context.span_id())
                .cloned()
                .collect()
        };
        let (beats, calls) = (children("heartbeat"), children("broker_call"));
        if level == tracing::Level::DEBUG {
            assert!(beats.len() >= 2, "at least two heartbeats as children of the attempt: {}", beats.len());
            assert!(beats.iter().all(|b| attr(b, "answer").as_deref() == Some("renewed")), "every renewal answered");
            assert!(beats.iter().all(|b| b.span_context.trace_id() == attempt.span_context.trace_id()));
            assert!(!calls.is_empty(), "the lease hook's broker calls as children of the attempt");
            assert!(calls.iter().all(|c| attr(c, "call").as_deref() == Some("confirmed")));
        } else {
            let anywhere = spans.iter().filter(|s| s.name == "heartbeat" || s.name == "broker_call").count();
            assert_eq!(anywhere, 0, "no heartbeat or broker call span at info level");
        }
    }
    env.cleanup().await;
}

/// Issue #34, item 1 (a Redis list): an item a producer wraps with `redis::traced_item` carries
/// its span's context in a trace envelope; the `ReliableList` consumer unwraps it, the job's key
/// and payload come from the item alone, and the attempt is the producer's child. A bare item
/// beside it runs as before (no parent), and an envelope whose `traceparent` is malformed runs
/// and commits with a warning naming the list item. Guards the list consumer that read no
/// context (lists had none: the attempt started a trace of its own).
#[tokio::test(flavor = "current_thread")]
async fn otel_a_list_item_in_a_trace_envelope_continues_the_producers_trace() {
    use brokerfence::redis::{ItemKey, ReliableList, client, traced_item};
    let cap = capture();
    let env = Env::new().await;
    let list = env.name("otel-list");
    let store: Arc<dyn FenceStore> = env.store();
    let produce = tracing::info_span!("produce");
    let wrapped = produce.in_scope(|| traced_item(b"job-1|{\"qty\":2}"));
    drop(produce);
    assert!(wrapped.len() > 16 && wrapped.ends_with(b"job-1|{\"qty\":2}"), "wrapped in an envelope");
    let bad = b"\0trace\x0000-not-a-context\0\0job-3|x".to_vec();
    let mut conn = env.conn();
    for item in [wrapped.as_slice(), b"job-2|x", bad.as_slice()] {
        let _: i64 = client::cmd("LPUSH").arg(&list).arg(item).query_async(&mut conn).await.expect("LPUSH");
    }
    type Seen = Arc<std::sync::Mutex<Vec<(String, Vec<u8>)>>>;
    let payloads: Seen = Arc::default();
    let seen = Arc::clone(&payloads);
    let worker = consumer(
        ReliableList::new(
            env.redis.clone(),
            QueueName::new(list.as_str()).expect("queue"),
            list.as_str(),
            ItemKey::Split(b'|'),
        )
        .expect("source")
        .block(Duration::from_millis(200)),
        Arc::clone(&store),
        "w",
        SupervisorConfig::new(lease(3)),
        move |ctx: JobContext| {
            seen.lock().expect("seen").push((ctx.key().to_string(), ctx.payload().to_vec()));
            async { Ok(b"ok".to_vec()) }
        },
    );
    wait_until(Duration::from_secs(20), "three attempts", || cap.attempts(&list).len() >= 3).await;
    stop_all(vec![worker]).await;
    let mut got = payloads.lock().expect("payloads").clone();
    got.sort();
    assert_eq!(
        got,
        vec![
            ("job-1".into(), b"{\"qty\":2}".to_vec()),
            ("job-2".into(), b"x".to_vec()),
            ("job-3".into(), b"x".to_vec())
        ],
        "keys and payloads come from the items alone"
    );
    let spans = cap.spans();
    let producer = spans.iter().find(|s| s.name == "produce").expect("the producer's span");
    let attempt_of = |key: &str| {
        cap.attempts(&list).into_iter().find(|s| attr(s, "key").as_deref() == Some(key)).expect("the attempt")
    };
    let first = attempt_of("job-1");
    assert_eq!(first.span_context.trace_id(), producer.span_context.trace_id(), "one trace");
    assert_eq!(first.parent_span_id, producer.span_context.span_id(), "the producer's child");
    assert_eq!(attr(&first, "messaging.system").as_deref(), Some("redis"));
    for bare in ["job-2", "job-3"] {
        let a = attempt_of(bare);
        assert_eq!(a.parent_span_id, opentelemetry::trace::SpanId::INVALID, "{bare}: no parent");
        assert_eq!(attr(&a, "brokerfence.outcome").as_deref(), Some("committed"), "{bare}");
    }
    let warnings = cap.warnings();
    assert!(warnings.iter().any(|w| w.contains("malformed trace context") && w.contains("list item")), "{warnings:?}");
    for key in ["job-1", "job-2", "job-3"] {
        let row = env.job(&list, key).await.expect("row");
        assert_eq!((row.state, row.epoch), (JobState::Completed, 1), "{key}");
    }
    // Each item left the processing list by its value as it sits in the list, envelope included.
    let processing: i64 =
        client::cmd("LLEN").arg(format!("{list}:processing")).query_async(&mut conn).await.expect("LLEN");
    assert_eq!(processing, 0, "the processing list is empty");
    env.cleanup().await;
}

/// Issue #34, the list envelope with `ItemKey::ContentHash` and with `ListRetrofit`: the same
/// item sent under two contexts is one job (the hash sees the item, not its envelope: the second
/// is a duplicate); an item wrapped twice (a loop passing on what it popped) carries only the
/// newest context. `ListRetrofit::process` continues an enveloped item's trace, and for a bare
/// item keeps the `scope` its caller set (guards a review finding: the envelope's empty origin
/// replaced the caller's).
#[tokio::test(flavor = "current_thread")]
async fn otel_list_envelopes_keep_content_hashes_and_the_retrofits_scope() {
    use brokerfence::otel::{Origin, scope};
    use brokerfence::redis::{ItemKey, ListRetrofit, ReliableList, client, traced_item};
    let cap = capture();
    let env = Env::new().await;
    let list = env.name("otel-hash");
    let store: Arc<dyn FenceStore> = env.store();
    let (a, b) = (tracing::info_span!("produce-a"), tracing::info_span!("produce-b"));
    let first = a.in_scope(|| traced_item(b"recompute report 7"));
    let second = b.in_scope(|| traced_item(&a.in_scope(|| traced_item(b"recompute report 7"))));
    assert_eq!(second.iter().filter(|b| **b == 0).count(), 4, "one envelope, not two");
    drop((a, b)); // exported when they end
    let mut conn = env.conn();
    for item in [&first, &second] {
        let _: i64 = client::cmd("RPUSH").arg(&list).arg(item.as_slice()).query_async(&mut conn).await.expect("RPUSH");
    }
    let worker = consumer(
        ReliableList::new(
            env.redis.clone(),
            QueueName::new(list.as_str()).expect("queue"),
            list.as_str(),
            ItemKey::ContentHash,
        )
        .expect("source")
        .block(Duration::from_millis(200)),
        Arc::clone(&store),
        "w",
        SupervisorConfig::new(lease(3)),
        |_: JobContext| async { Ok(b"ok".to_vec()) },
    );
    wait_until(Duration::from_secs(20), "a committed and a duplicate attempt", || {
        let outcomes: Vec<_> = cap.attempts(&list).iter().filter_map(|s| attr(s, "brokerfence.outcome")).collect();
        outcomes.iter().any(|o| o == "committed") && outcomes.iter().any(|o| o == "duplicate")
    })
    .await;
    stop_all(vec![worker]).await;
    let jobs = env.jobs(&list).await;
    assert_eq!(jobs.len(), 1, "one job for the same item under two contexts: {jobs:?}");
    let outcome = |o: &str| {
        cap.attempts(&list).into_iter().find(|s| attr(s, "brokerfence.outcome").as_deref() == Some(o)).expect(o)
    };
    let (ran, dup) = (outcome("committed"), outcome("duplicate"));
    let spans = cap.spans();
    let id_of = |name: &str| spans.iter().find(|s| s.name == name).map(|s| s.span_context.span_id()).expect("span");
    // Whichever item ran first: one attempt per context, each item's own (the re-wrapped item's
    // is b's, not a's).
    let mut seen = vec![ran.parent_span_id, dup.links.links.first().map(|l| l.span_context.span_id()).expect("a link")];
    let mut want = vec![id_of("produce-a"), id_of("produce-b")];
    seen.sort_by_key(|id| id.to_string());
    want.sort_by_key(|id| id.to_string());
    assert_eq!(seen, want, "each item's own context, the newest for the re-wrapped one");

    // ListRetrofit: an enveloped item continues its producer's trace; a bare one keeps the
    // caller's scope.
    let retro_list = env.name("otel-retro");
    let retrofit = ListRetrofit::new(
        Arc::clone(&store),
        QueueName::new(retro_list.as_str()).expect("queue"),
        SupervisorConfig::new(lease(3)),
        &env.redis,
        retro_list.as_str(),
        ItemKey::Split(b'|'),
    )
    .expect("retrofit");
    let c = tracing::info_span!("produce-c");
    let wrapped = c.in_scope(|| traced_item(b"job-1|x"));
    let done = retrofit.process(&wrapped, |_ctx| async { Ok(b"ok".to_vec()) }).await;
    assert!(done.should_ack(), "{done:?}");
    let outer = tracing::info_span!("caller");
    let tc = outer.in_scope(TraceContext::current).expect("the caller's context");
    let done = scope(
        Origin::new(Some(tc)).message_id("popped-2"),
        retrofit.process(b"job-2|x", |_ctx| async { Ok(b"ok".to_vec()) }),
    )
    .await;
    assert!(done.should_ack(), "{done:?}");
    drop((c, outer));
    let spans = cap.spans();
    let id_of = |name: &str| spans.iter().find(|s| s.name == name).map(|s| s.span_context.span_id()).expect("span");
    let attempt = |key: &str| {
        cap.attempts(&retro_list).into_iter().find(|s| attr(s, "key").as_deref() == Some(key)).expect("attempt")
    };
    assert_eq!(attempt("job-1").parent_span_id, id_of("produce-c"), "the envelope's producer is the parent");
    let bare = attempt("job-2");
    assert_eq!(bare.parent_span_id, id_of("caller"), "the caller's scope is kept for a bare item");
    assert_eq!(attr(&bare, "messaging.message.id").as_deref(), Some("popped-2"));
    env.cleanup().await;
}
