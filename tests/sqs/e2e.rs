//! The SQS adapter against LocalStack: each test has its own queue(s) and its own PostgreSQL
//! schema, so the tests run in parallel and re-run without cleanup. Worker processes are the
//! `sqs_worker` example, driven by its `EVENT` lines and stopped with real signals.
#![cfg(feature = "sqs")]

use brokerfence_testkit::sqs as sqs_support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use brokerfence::ledger::PgLedger;
use brokerfence::sqs::aws_sdk_sqs::Client;
use brokerfence::sqs::aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use brokerfence::sqs::{KeyStrategy, REASON_ATTRIBUTE, SOURCE_MESSAGE_ID_ATTRIBUTE, SqsConfig, SqsRetrofit, SqsSource};
use brokerfence::{
    Claim, JobContext, JobError, JobState, LeaseDuration, MetricsSnapshot, Owner, PgFence, RetryPolicy,
    SupervisorConfig,
};
use brokerfence::{Consumer, ConsumerConfig, Detail, Disposition, Handler, SourceError};
use sqs_support::*;
use tokio_util::sync::CancellationToken;

fn lease3() -> LeaseDuration {
    LeaseDuration::from_secs(3).expect("3 s lease")
}

/// A consumer running in this process.
struct Running {
    consumer: Arc<Consumer<SqsSource>>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Result<(), SourceError>>,
}

impl Running {
    fn start<H: Handler>(
        client: &Client,
        url: &str,
        fence: &PgFence,
        owner: &str,
        config: ConsumerConfig,
        key: KeyStrategy,
        handler: H,
    ) -> Self {
        let sqs_config = SqsConfig::new(url).expect("queue url").key(key).wait_time(Duration::from_secs(1));
        let source = SqsSource::new(client.clone(), sqs_config);
        let owner = Owner::new(owner).expect("owner");
        let consumer = Arc::new(Consumer::with_owner(source, dyn_store(fence), owner, config));
        let stop = CancellationToken::new();
        let (c, s) = (Arc::clone(&consumer), stop.clone());
        let task = tokio::spawn(async move { c.run(handler, s).await });
        Self { consumer, stop, task }
    }

    fn metrics(&self) -> MetricsSnapshot {
        self.consumer.metrics().snapshot()
    }

    async fn wait_metrics(&self, within: Duration, what: &str, cond: impl Fn(&MetricsSnapshot) -> bool) {
        let m = self.consumer.metrics();
        eventually(within, what, || {
            let ok = cond(&m.snapshot());
            async move { ok }
        })
        .await;
    }

    async fn stop(self) -> MetricsSnapshot {
        self.stop.cancel();
        let result = tokio::time::timeout(Duration::from_secs(15), self.task).await;
        match result {
            Ok(Ok(Ok(()))) => {}
            other => panic!("consumer did not stop cleanly: {other:?}"),
        }
        self.consumer.source().release_unstarted(Duration::from_secs(3)).await;
        self.consumer.metrics().snapshot()
    }
}

fn config(concurrency: usize) -> ConsumerConfig {
    ConsumerConfig::new(SupervisorConfig::new(lease3())).concurrency(concurrency).grace(Duration::from_secs(2))
}

/// End to end: `sqs_produce` sends 30 messages; a fenced consumer calls the receiver for each
/// with its stamp, commits, and deletes every message once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn end_to_end_produce_consume_commit_delete() {
    init_tracing();
    let client = sqs().await;
    let fence = pg().await;
    let q = TestQueue::new(&client, "e2e", 3).await;
    let receiver = Receiver::start(&fence).await;

    let out = tokio::process::Command::new(example("sqs_produce"))
        .args(["--queue-url", &q.url, "--count", "30", "--prefix", "e2e"])
        .envs(aws().child_env())
        .output()
        .await
        .expect("run sqs_produce");
    assert!(out.status.success(), "sqs_produce failed: {}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("EVENT sent count=30"));

    let run = Running::start(
        &client,
        &q.url,
        &fence,
        "e2e-worker",
        config(16),
        KeyStrategy::Auto,
        calling_handler(receiver.url.clone()),
    );
    run.wait_metrics(Duration::from_secs(30), "30 completed and acked", |m| m.completions == 30 && m.acks == 30).await;
    let m = run.stop().await;
    assert_eq!((m.claims, m.duplicates, m.fenced_rejections, m.lease_losses), (30, 0, 0, 0), "{m}");

    assert_eq!(receiver.effects_len(), 30);
    assert!(receiver.calls().iter().all(|c| c.accepted && c.epoch == 1), "{:?}", receiver.calls());
    let rows = jobs(&fence).await;
    assert_eq!(rows.len(), 30);
    for (key, state, epoch, owner, result) in &rows {
        assert_eq!((state.as_str(), *epoch), ("completed", 1), "{key}");
        assert_eq!(owner.as_deref(), Some("e2e-worker"));
        assert_eq!(result.as_deref(), Some(&b"e2e-worker@1"[..]));
        assert_eq!(receiver.applied(&Receiver::job_name(&q.name, key)), 1);
    }
    assert_eq!(depth(&client, &q.url).await, 0, "every message deleted");
    q.delete(&client).await;
    drop_schema(&fence).await;
}

/// A producer's re-send (same `job-id` attribute) is the same job: the duplicate is deleted
/// without running the handler, whether it arrives after completion or in the same batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resent_message_with_the_same_key_is_a_duplicate() {
    init_tracing();
    let client = sqs().await;
    let fence = pg().await;
    let q = TestQueue::new(&client, "dedupe", 3).await;
    let runs: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let seen = Arc::clone(&runs);
    let handler = move |ctx: JobContext| {
        let seen = Arc::clone(&seen);
        async move {
            *seen.lock().expect("lock").entry(ctx.key().to_string()).or_default() += 1;
            Ok::<_, JobError>(ctx.payload().to_vec())
        }
    };
    let run = Running::start(&client, &q.url, &fence, "dedupe", config(8), KeyStrategy::attribute("job-id"), handler);
    let attr = |v: &str| MessageAttributeValue::builder().data_type("String").string_value(v).build().expect("attr");
    let send_keyed = |key: &'static str, body: &'static str| {
        client.send_message().queue_url(&q.url).message_body(body).message_attributes("job-id", attr(key)).send()
    };
    send_keyed("order-1", "first").await.expect("send");
    run.wait_metrics(Duration::from_secs(10), "order-1 completed", |m| m.completions == 1 && m.acks == 1).await;
    send_keyed("order-1", "re-sent").await.expect("send");
    run.wait_metrics(Duration::from_secs(10), "re-send acked as duplicate", |m| m.duplicates == 1 && m.acks == 2).await;

    // Two copies in one batch: one runs; the other is held for the lease's time left, comes back,
    // and is deleted as a duplicate.
    let entries = ["copy-a", "copy-b"]
        .iter()
        .enumerate()
        .map(|(i, body)| {
            SendMessageBatchRequestEntry::builder()
                .id(format!("e{i}"))
                .message_body(*body)
                .message_attributes("job-id", attr("order-2"))
                .build()
                .expect("entry")
        })
        .collect::<Vec<_>>();
    client.send_message_batch().queue_url(&q.url).set_entries(Some(entries)).send().await.expect("send batch");
    run.wait_metrics(Duration::from_secs(15), "order-2 done once, its copy deleted", |m| {
        m.completions == 2 && m.acks == 4
    })
    .await;
    let m = run.stop().await;
    let runs = runs.lock().expect("lock").clone();
    assert_eq!(runs.get("order-1"), Some(&1), "{runs:?}");
    assert_eq!(runs.get("order-2"), Some(&1), "{runs:?}");
    assert_eq!(m.claims, 2, "{m}");
    assert_eq!(depth(&client, &q.url).await, 0);
    let order1 = job(&fence, &q.fence_queue(), "order-1").await.expect("row");
    assert_eq!((order1.state, order1.epoch, order1.result.as_deref()), (JobState::Completed, 1, Some(&b"first"[..])));
    q.delete(&client).await;
    drop_schema(&fence).await;
}

/// A job that runs longer than the visibility timeout and the lease keeps its message hidden:
/// every confirmed heartbeat extends the visibility, so no other receiver sees it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn visibility_follows_the_confirmed_lease() {
    init_tracing();
    let client = sqs().await;
    let fence = pg().await;
    let q = TestQueue::new(&client, "extend", 3).await;
    let handler = |ctx: JobContext| async move {
        tokio::time::sleep(Duration::from_millis(5500)).await;
        Ok::<_, JobError>(ctx.payload().to_vec())
    };
    let run = Running::start(&client, &q.url, &fence, "slow", config(4), KeyStrategy::Auto, handler);
    let id = send(&client, &q.url, "slow job").await;
    run.wait_metrics(Duration::from_secs(10), "claimed", |m| m.claims == 1).await;
    // A thief polls for the whole run: it must never see the message.
    let mut stolen = Vec::new();
    while run.metrics().completions == 0 {
        stolen.extend(receive_raw(&client, &q.url, 1).await);
    }
    assert!(stolen.is_empty(), "message became visible while its lease was confirmed: {stolen:?}");
    run.wait_metrics(Duration::from_secs(5), "acked", |m| m.acks == 1).await;
    let m = run.stop().await;
    assert!(m.renewals >= 3, "heartbeats confirmed the lease: {m}");
    let row = job(&fence, &q.fence_queue(), &id).await.expect("row");
    assert_eq!((row.state, row.epoch, row.attempts), (JobState::Completed, 1, 1));
    assert_eq!(depth(&client, &q.url).await, 0);
    q.delete(&client).await;
    drop_schema(&fence).await;
}

/// Retrofit: the user's own receive loop hands each message to `SqsRetrofit::process`, which
/// claims, supervises (extending visibility), commits and deletes; a malformed message is
/// dead-lettered with its reason; a stale duplicate of a done job is deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retrofit_process_claims_extends_commits_and_deletes() {
    init_tracing();
    let client = sqs().await;
    let fence = pg().await;
    let q = TestQueue::with_dlq(&client, "retrofit", 3, 5).await;
    let source =
        SqsSource::new(client.clone(), SqsConfig::new(&q.url).expect("url").key(KeyStrategy::body_field("id")));
    let fence_mw = SqsRetrofit::with_owner(
        dyn_store(&fence),
        source,
        Owner::new("retro").expect("owner"),
        SupervisorConfig::new(lease3()),
    );
    send(&client, &q.url, r#"{"id":"r-1"}"#).await;
    send(&client, &q.url, "not json").await;

    // The user's loop: receive until both are in hand.
    let mut messages = Vec::new();
    while messages.len() < 2 {
        messages.extend(receive_raw(&client, &q.url, 1).await);
    }
    let handler = |ctx: JobContext| async move {
        if ctx.key().as_str() == "r-1" {
            tokio::time::sleep(Duration::from_millis(4500)).await;
        }
        Ok::<_, JobError>(format!("done@{}", ctx.epoch()).into_bytes())
    };
    let thief = {
        let (client, url) = (client.clone(), q.url.clone());
        tokio::spawn(async move {
            let mut stolen = Vec::new();
            let until = tokio::time::Instant::now() + Duration::from_secs(4);
            while tokio::time::Instant::now() < until {
                stolen.extend(receive_raw(&client, &url, 1).await);
            }
            stolen
        })
    };
    let results = futures::future::join_all(messages.iter().map(|m| fence_mw.process(m, handler))).await;
    let stolen = thief.await.expect("thief");
    assert!(stolen.is_empty(), "a message became visible while processed: {stolen:?}");
    let mut completed = 0;
    for (m, r) in messages.iter().zip(&results) {
        if m.body() == Some("not json") {
            assert!(matches!(&r.detail, Detail::Malformed(reason) if reason.contains("not JSON")), "{r:?}");
            assert!(matches!(&r.disposition, Disposition::DeadLetter(_)));
            assert!(r.broker_error.is_none(), "{r:?}");
        } else {
            assert!(r.reason() == brokerfence::Reason::Committed && r.broker_error.is_none(), "{r:?}");
            completed += 1;
        }
    }
    assert_eq!(completed, 1);
    let r1 = job(&fence, &q.fence_queue(), "r-1").await.expect("row");
    assert_eq!((r1.state, r1.epoch, r1.result.as_deref()), (JobState::Completed, 1, Some(&b"done@1"[..])));

    // The same delivery again (a duplicate): claim says Done; the message is deleted, not run.
    let again = messages.iter().find(|m| m.body() != Some("not json")).expect("r-1 message");
    let dup = fence_mw.process(again, handler).await;
    assert!(matches!(dup.detail, Detail::NotClaimed(Claim::Done { epoch: 1 })), "{dup:?}");
    assert_eq!(dup.disposition, Disposition::Ack);

    let dlq = drain(&client, q.dlq.as_deref().expect("dlq"), 1, Duration::from_secs(5)).await;
    assert_eq!(dlq.len(), 1);
    let reason = dlq[0].message_attributes().and_then(|a| a.get(REASON_ATTRIBUTE)).and_then(|v| v.string_value());
    assert!(reason.is_some_and(|r| r.contains("not JSON")), "{:?}", dlq[0]);
    assert_eq!(depth(&client, &q.url).await, 0);
    let m = fence_mw.metrics().snapshot();
    assert!(m.renewals >= 2, "{m}");
    q.delete(&client).await;
    drop_schema(&fence).await;
}

/// Messages that cannot become jobs (not JSON, no key field, a key of the wrong type, a key
/// over the length limit) go to the dead-letter queue with their reason; the loop goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_messages_are_dead_lettered_with_their_reason() {
    init_tracing();
    let client = sqs().await;
    let fence = pg().await;
    let q = TestQueue::with_dlq(&client, "malformed", 3, 5).await;
    let run = Running::start(
        &client,
        &q.url,
        &fence,
        "decoder",
        config(4),
        KeyStrategy::body_field("id"),
        |ctx: JobContext| async move { Ok::<_, JobError>(ctx.payload().to_vec()) },
    );
    let long = format!(r#"{{"id":"{}"}}"#, "k".repeat(brokerfence::MAX_KEY_BYTES + 1));
    let bad = [
        ("not json {".to_owned(), "not JSON"),
        (r#"{"other":1}"#.to_owned(), "no field"),
        (r#"{"id":{"x":1}}"#.to_owned(), "an object"),
        (long, "over the limit"),
    ];
    let mut ids = HashMap::new();
    for (body, reason) in &bad {
        ids.insert(send(&client, &q.url, body).await, *reason);
    }
    send(&client, &q.url, r#"{"id":"good-1"}"#).await;
    run.wait_metrics(Duration::from_secs(15), "4 dead-lettered, 1 completed", |m| {
        m.dead_letters == 4 && m.completions == 1
    })
    .await;
    let m = run.stop().await;
    assert_eq!(m.claims, 1, "{m}");
    let dlq = drain(&client, q.dlq.as_deref().expect("dlq"), 4, Duration::from_secs(5)).await;
    assert_eq!(dlq.len(), 4);
    for d in &dlq {
        let attrs = d.message_attributes().expect("attributes");
        let source_id = attrs.get(SOURCE_MESSAGE_ID_ATTRIBUTE).and_then(|v| v.string_value()).expect("source id");
        let want = ids.get(source_id).expect("a message we sent");
        let reason = attrs.get(REASON_ATTRIBUTE).and_then(|v| v.string_value()).expect("reason");
        assert!(reason.contains(want), "reason {reason:?} should mention {want:?}");
    }
    let rows = jobs(&fence).await;
    assert_eq!(rows.iter().map(|r| r.0.as_str()).collect::<Vec<_>>(), ["good-1"]);
    assert_eq!(depth(&client, &q.url).await, 0);
    q.delete(&client).await;
    drop_schema(&fence).await;
}

/// A failing job is retried through the visibility timeout until the queue's RedrivePolicy moves
/// it to the DLQ after max receives; a fatal failure is moved at once, with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letter_after_max_receives_and_on_fatal_failure() {
    init_tracing();
    let client = sqs().await;
    let fence = pg().await;
    let q = TestQueue::with_dlq(&client, "dlq", 3, 2).await;
    let retry =
        RetryPolicy { max_attempts: 10, base_backoff: Duration::from_millis(100), max_backoff: Duration::from_secs(1) };
    let config = ConsumerConfig::new(SupervisorConfig::new(lease3()).retry(retry)).concurrency(4);
    let handler = |ctx: JobContext| async move {
        match ctx.payload() {
            b"fatal" => Err::<(), _>(JobError::fatal("poison order")),
            _ => Err(JobError::retry("upstream down")),
        }
    };
    let run = Running::start(&client, &q.url, &fence, "failing", config, KeyStrategy::Auto, handler);
    let fatal_id = send(&client, &q.url, "fatal").await;
    let retry_id = send(&client, &q.url, "retry").await;
    let dlq = drain(&client, q.dlq.as_deref().expect("dlq"), 2, Duration::from_secs(20)).await;
    let m = run.stop().await;
    assert_eq!(dlq.len(), 2, "both in the DLQ: {dlq:?}; {m}");
    let fatal = dlq.iter().find(|d| d.body() == Some("fatal")).expect("fatal in DLQ");
    let reason = fatal.message_attributes().and_then(|a| a.get(REASON_ATTRIBUTE)).and_then(|v| v.string_value());
    assert_eq!(reason, Some("poison order"));
    let retried = dlq.iter().find(|d| d.body() == Some("retry")).expect("retried one in DLQ");
    assert!(
        retried.message_attributes().and_then(|a| a.get(REASON_ATTRIBUTE)).is_none(),
        "moved by the redrive policy"
    );
    let fq = q.fence_queue();
    assert_eq!(job(&fence, &fq, &fatal_id).await.expect("row").state, JobState::Dead);
    let r = job(&fence, &fq, &retry_id).await.expect("row");
    assert_eq!((r.state, r.attempts), (JobState::Failed, 2), "{r:?}");
    assert_eq!(depth(&client, &q.url).await, 0);
    q.delete(&client).await;
    drop_schema(&fence).await;
}

/// FIFO: the key is the deduplication id; messages of one group run one at a time, in order,
/// even when SQS returns several of a group in one batch and the consumer could run them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_group_runs_in_order_keyed_by_deduplication_id() {
    init_tracing();
    let client = sqs().await;
    let fence = pg().await;
    let q = TestQueue::fifo(&client, "fifo", 3).await;
    for group in ["a", "b"] {
        let entries = (0..5)
            .map(|i| {
                SendMessageBatchRequestEntry::builder()
                    .id(format!("e{i}"))
                    .message_body(format!("{group}-{i}"))
                    .message_group_id(group)
                    .message_deduplication_id(format!("{group}-{i}"))
                    .build()
                    .expect("entry")
            })
            .collect::<Vec<_>>();
        client.send_message_batch().queue_url(&q.url).set_entries(Some(entries)).send().await.expect("send");
    }
    let log: Arc<Mutex<Vec<(String, &'static str)>>> = Arc::default();
    let l = Arc::clone(&log);
    let handler = move |ctx: JobContext| {
        let l = Arc::clone(&l);
        async move {
            let key = ctx.key().to_string();
            l.lock().expect("lock").push((key.clone(), "start"));
            tokio::time::sleep(Duration::from_millis(150)).await;
            l.lock().expect("lock").push((key, "end"));
            Ok::<_, JobError>(Vec::new())
        }
    };
    let run = Running::start(&client, &q.url, &fence, "fifo", config(8), KeyStrategy::Auto, handler);
    run.wait_metrics(Duration::from_secs(30), "10 completed and acked", |m| m.completions == 10 && m.acks == 10).await;
    let m = run.stop().await;
    assert_eq!((m.claims, m.duplicates), (10, 0), "{m}");
    let log = log.lock().expect("lock").clone();
    for group in ["a", "b"] {
        let events: Vec<String> =
            log.iter().filter(|(k, _)| k.starts_with(group)).map(|(k, e)| format!("{k}:{e}")).collect();
        let want: Vec<String> =
            (0..5).flat_map(|i| [format!("{group}-{i}:start"), format!("{group}-{i}:end")]).collect();
        assert_eq!(events, want, "group {group} ran in order, one at a time");
    }
    let rows = jobs(&fence).await;
    assert_eq!(rows.len(), 10);
    assert!(rows.iter().all(|r| r.1 == "completed" && r.2 == 1), "{rows:?}");
    assert_eq!(depth(&client, &q.url).await, 0);
    q.delete(&client).await;
    drop_schema(&fence).await;
}

/// Graceful shutdown on SIGTERM (the worker process): no more receives, the grace period runs
/// out, the leases are released (pending again, no attempt spent) and the messages are made
/// visible at once. In-process, a job that finishes within the grace period is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_releases_leases_and_returns_messages() {
    init_tracing();
    let client = sqs().await;
    let fence = pg().await;
    let q = TestQueue::new(&client, "shutdown", 30).await;
    let a = send(&client, &q.url, "a").await;
    let b = send(&client, &q.url, "b").await;
    let mut worker = Worker::spawn(
        "stopping",
        &worker_args(&q, &fence, "stopping", &["--lease", "30", "--handler-delay", "60000", "--grace", "300"]),
    );
    eventually(Duration::from_secs(10), "both claimed", || {
        let n = worker.events().iter().filter(|e| e.name == "claimed").count();
        async move { n == 2 }
    })
    .await;
    worker.signal(libc::SIGTERM);
    let status = worker.wait_exit(Duration::from_secs(10)).await;
    assert!(status.success(), "{status}");
    let stopped = worker.wait_event(Duration::from_secs(1), "stopped", |e| e.name == "stopped").await;
    assert_eq!(stopped.num("releases"), 2, "{}", stopped.line);
    assert_eq!(stopped.num("acks"), 0, "{}", stopped.line);
    // Visibility 0: back at once, though the visibility timeout is 30 s.
    let mut back = Vec::new();
    let until = tokio::time::Instant::now() + Duration::from_secs(3);
    while back.len() < 2 && tokio::time::Instant::now() < until {
        back.extend(receive_raw(&client, &q.url, 1).await);
    }
    assert_eq!(back.len(), 2, "messages made visible again at shutdown");
    for id in [&a, &b] {
        let row = job(&fence, &q.fence_queue(), id).await.expect("row");
        assert_eq!((row.state, row.epoch, row.attempts), (JobState::Pending, 1, 0), "{row:?}");
    }
    for m in &back {
        if let Some(h) = m.receipt_handle() {
            let _ = client
                .change_message_visibility()
                .queue_url(&q.url)
                .receipt_handle(h)
                .visibility_timeout(0)
                .send()
                .await;
        }
    }

    // In-process: a job that ends within the grace period still commits and is deleted.
    let handler = |_ctx: JobContext| async move {
        tokio::time::sleep(Duration::from_millis(400)).await;
        Ok::<_, JobError>(b"finished in grace".to_vec())
    };
    let run = Running::start(&client, &q.url, &fence, "graceful", config(4), KeyStrategy::Auto, handler);
    run.wait_metrics(Duration::from_secs(10), "re-claimed", |m| m.claims == 2).await;
    let m = run.stop().await;
    assert_eq!((m.completions, m.acks, m.releases), (2, 2, 0), "{m}");
    let row = job(&fence, &q.fence_queue(), &a).await.expect("row");
    assert_eq!((row.state, row.epoch), (JobState::Completed, 2));
    assert_eq!(depth(&client, &q.url).await, 0);
    q.delete(&client).await;
    drop_schema(&fence).await;
}

/// A worker process killed with SIGKILL mid-job: the message comes back after the visibility
/// timeout, the database lease has lapsed, a new owner claims epoch 2 and completes it once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_worker_job_is_redelivered_and_completed_once() {
    init_tracing();
    let client = sqs().await;
    let fence = pg().await;
    let q = TestQueue::new(&client, "sigkill", 3).await;
    let receiver = Receiver::start(&fence).await;
    let id = send(&client, &q.url, "kill me").await;
    let mut doomed = Worker::spawn(
        "doomed",
        &worker_args(
            &q,
            &fence,
            "doomed",
            &["--lease", "3", "--handler-delay", "30000", "--receiver-url", &receiver.url],
        ),
    );
    doomed.wait_event(Duration::from_secs(10), "claimed", |e| e.name == "claimed").await;
    doomed.signal(libc::SIGKILL);
    let _ = doomed.wait_exit(Duration::from_secs(5)).await;

    let run = Running::start(
        &client,
        &q.url,
        &fence,
        "heir",
        config(4),
        KeyStrategy::Auto,
        calling_handler(receiver.url.clone()),
    );
    run.wait_metrics(Duration::from_secs(20), "completed and acked", |m| m.completions == 1 && m.acks == 1).await;
    let m = run.stop().await;
    assert_eq!(m.claims, 1, "{m}");
    let row = job(&fence, &q.fence_queue(), &id).await.expect("row");
    assert_eq!((row.state, row.epoch, row.attempts, row.owner.as_deref()), (JobState::Completed, 2, 2, Some("heir")));
    let jn = Receiver::job_name(&q.name, &id);
    assert_eq!(receiver.applied(&jn), 1, "applied exactly once");
    assert_eq!(receiver.effect(&jn), Some((2, Some("heir".into()))));
    assert_eq!(depth(&client, &q.url).await, 0, "deleted: it cannot come back");
    q.delete(&client).await;
    drop_schema(&fence).await;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    /// The new owner's call reaches the receiver's ledger first; the zombie's arrives late.
    NewOwnerFirst,
    /// The zombie's call is applied first, then superseded by the new owner's.
    ZombieFirst,
}

/// The zombie: a worker process stopped with SIGSTOP, mid-job, past both the visibility timeout
/// and its database lease. A new owner takes the job over (epoch 2). When the zombie resumes, its
/// late work counts for nothing: its call is refused by the receiver's ledger (or was superseded),
/// it commits nothing and deletes nothing; the final state is epoch 2 with the new owner's result.
async fn zombie_scenario(order: Order, guard_off: bool) {
    init_tracing();
    let client = sqs().await;
    let fence = pg().await;
    let q = TestQueue::new(&client, "zombie", 3).await;
    let receiver = Receiver::start(&fence).await;
    if order == Order::NewOwnerFirst {
        receiver.park(1);
    }
    let id = send(&client, &q.url, r#"{"amount":10}"#).await;
    let jn = Receiver::job_name(&q.name, &id);
    let mut extra = vec!["--lease", "3", "--concurrency", "1", "--receiver-url", receiver.url.as_str()];
    if order == Order::ZombieFirst {
        extra.extend(["--after-call-delay", "2000"]);
    }
    if guard_off {
        extra.push("--no-cancel-on-loss");
    }
    let mut zombie = Worker::spawn("zombie", &worker_args(&q, &fence, "zombie", &extra));
    match order {
        Order::NewOwnerFirst => {
            receiver
                .wait_for(Duration::from_secs(15), "the zombie's call (parked)", |_, arrivals| {
                    arrivals.iter().any(|(j, e)| *j == jn && *e == 1)
                })
                .await;
        }
        Order::ZombieFirst => {
            receiver
                .wait_for(Duration::from_secs(15), "the zombie's call applied", |calls, _| {
                    calls.iter().any(|c| c.job == jn && c.epoch == 1 && c.accepted)
                })
                .await;
        }
    }
    zombie.signal(libc::SIGSTOP);
    let stopped_at = tokio::time::Instant::now();

    let heir = Running::start(
        &client,
        &q.url,
        &fence,
        "successor",
        config(4),
        KeyStrategy::Auto,
        calling_handler(receiver.url.clone()),
    );
    heir.wait_metrics(Duration::from_secs(20), "the new owner committed and deleted", |m| {
        m.completions == 1 && m.acks == 1
    })
    .await;
    assert!(stopped_at.elapsed() > Duration::from_secs(3), "stopped past the visibility timeout and the lease");
    if order == Order::NewOwnerFirst {
        receiver
            .wait_for(Duration::from_secs(5), "the zombie's call refused", |calls, _| {
                calls.iter().any(|c| c.job == jn && c.epoch == 1 && !c.accepted)
            })
            .await;
    }

    zombie.signal(libc::SIGCONT);
    if guard_off {
        zombie
            .wait_event(Duration::from_secs(10), "commit fenced", |e| {
                e.name == "metrics" && e.num("fenced_rejections") == 1
            })
            .await;
    } else {
        zombie
            .wait_event(Duration::from_secs(10), "lease lost", |e| e.name == "metrics" && e.num("lease_losses") == 1)
            .await;
    }
    zombie.signal(libc::SIGTERM);
    let status = zombie.wait_exit(Duration::from_secs(10)).await;
    assert!(status.success(), "zombie exit: {status}");
    let zm = zombie.metrics();
    assert_eq!(
        (zm.num("completions"), zm.num("acks")),
        (0, 0),
        "the zombie committed and deleted nothing: {}",
        zm.line
    );
    let hm = heir.stop().await;
    assert_eq!((hm.completions, hm.acks, hm.fenced_rejections), (1, 1, 0), "{hm}");

    let row = job(&fence, &q.fence_queue(), &id).await.expect("row");
    assert_eq!((row.state, row.epoch, row.owner.as_deref()), (JobState::Completed, 2, Some("successor")), "{row:?}");
    assert_eq!(row.result.as_deref(), Some(&b"successor@2"[..]));
    assert_eq!(PgLedger::new(&fence, "receiver").newest(&jn).await.expect("ledger"), Some(2));
    assert_eq!(receiver.effect(&jn), Some((2, Some("successor".into()))), "the new owner's effect stands");
    let calls: Vec<(i64, bool)> =
        receiver.calls().iter().filter(|c| c.job == jn).map(|c| (c.epoch, c.accepted)).collect();
    match order {
        Order::NewOwnerFirst => assert_eq!(calls, [(2, true), (1, false)]),
        Order::ZombieFirst => assert_eq!(calls, [(1, true), (2, true)]),
    }
    assert_eq!(depth(&client, &q.url).await, 0);
    q.delete(&client).await;
    drop_schema(&fence).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zombie_new_owner_reaches_receiver_first() {
    zombie_scenario(Order::NewOwnerFirst, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zombie_reaches_receiver_first_then_is_superseded() {
    zombie_scenario(Order::ZombieFirst, false).await;
}

/// With the worker's own guard switched off (the handler runs on after its lease is lost), the
/// database still refuses the zombie's commit or failure: the fence does not depend on the worker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zombie_without_worker_guard_new_owner_first_commit_fenced() {
    zombie_scenario(Order::NewOwnerFirst, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zombie_without_worker_guard_zombie_first_commit_fenced() {
    zombie_scenario(Order::ZombieFirst, true).await;
}
