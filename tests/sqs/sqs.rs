//! Issue #30 (see main.rs for the items of this module): SQS dead letters sent once and counted
//! as sent (item 9, SQS part), and FIFO group order under a paused holder (item 10). LocalStack
//! and PostgreSQL, a fresh queue and schema per test.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use brokerfence::sqs::aws_sdk_sqs::types::SendMessageBatchRequestEntry;
use brokerfence::sqs::{DeadLetterTarget, SOURCE_MESSAGE_ID_ATTRIBUTE, SqsConfig, SqsSource};
use brokerfence::{Consumer, ConsumerConfig};
use brokerfence::{JobContext, JobError, JobState, LeaseDuration, Owner, PgFence, RetryPolicy, SupervisorConfig};
use brokerfence_testkit::sqs::*;
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

fn secs(n: u64) -> LeaseDuration {
    LeaseDuration::from_secs(n).expect("lease")
}

/// One attempt, then the job is dead.
fn one_attempt() -> RetryPolicy {
    RetryPolicy { max_attempts: 1, base_backoff: Duration::from_millis(100), max_backoff: Duration::from_millis(100) }
}

/// A handler that fails every job for good.
fn poison() -> impl Fn(JobContext) -> std::future::Ready<Result<Vec<u8>, JobError>> + Clone + Send + Sync + 'static {
    |_ctx: JobContext| std::future::ready(Err(JobError::fatal("poison")))
}

/// The keys of the completed jobs, in the order their completion was written.
async fn commit_order(fence: &PgFence) -> Vec<String> {
    let s = fence.get_schema().as_str();
    sqlx::query_scalar(AssertSqlSafe(format!("SELECT key FROM {s}.jobs WHERE state = 'completed' ORDER BY updated_at")))
        .fetch_all(fence.pool())
        .await
        .expect("read the commit order")
}

/// Item 9 (SQS part), "dead letters counted or sent twice": `dead_letters` counts what was sent.
/// A job fails for good on a queue that has no dead-letter queue: the database declares it dead,
/// the source cannot move it (`NoDeadLetterQueue`), the message stays in the queue, hidden.
/// Guard: `dead_letters` counts messages moved to a dead-letter queue, not jobs the database
/// declared dead (those are `dead_jobs`); without it the counter says 1 for a copy that never
/// existed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item9_sqs_no_dead_letter_queue_counts_no_dead_letter() {
    init_tracing();
    let client = sqs().await;
    let fence = pg().await;
    let q = TestQueue::new(&client, "h9-nodlq", 3).await;
    let id = send(&client, &q.url, "poison").await;
    let config = SqsConfig::new(&q.url).expect("url").wait_time(Duration::from_secs(1));
    let consumer = Arc::new(Consumer::new(
        SqsSource::new(client.clone(), config),
        dyn_store(&fence),
        ConsumerConfig::new(SupervisorConfig::new(secs(3)).retry(one_attempt())).grace(Duration::from_secs(2)),
    ));
    let stop = CancellationToken::new();
    let (c, s) = (Arc::clone(&consumer), stop.clone());
    let run = tokio::spawn(async move { c.run(poison(), s).await });
    let queue = q.fence_queue();
    eventually(Duration::from_secs(20), "the job declared dead", || {
        let (fence, queue, id) = (fence.clone(), queue.clone(), id.clone());
        async move { job(&fence, &queue, &id).await.is_some_and(|j| j.state == JobState::Dead) }
    })
    .await;
    // Run returns once every delivery is settled at the broker: the move was tried by then.
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), run).await.expect("consumer stops").expect("join").expect("run");
    let m = consumer.metrics().snapshot();
    assert_eq!(m.dead_letters, 0, "no dead-letter queue, so no copy was sent, yet dead_letters counts one: {m}");
    assert_eq!(m.dead_jobs, 1, "the job the database declared dead is counted as such: {m}");
    assert_eq!(depth(&client, &q.url).await, 1, "the message stays in the queue (hidden), not lost");
    q.delete(&client).await;
    drop_schema(&fence).await;
}

/// Item 9 (SQS part), "dead letters counted or sent twice": a failed delete after the copy sends
/// no second copy. A job fails for good; its message is copied to the dead-letter queue, and
/// the delete that follows fails (a proxy between the worker and LocalStack answers every
/// `DeleteMessage` with a server error until the message has come back). The redelivery finds
/// the job dead and the copy already sent: the message is deleted, nothing sent again.
/// Guard: the source remembers the copies it sent (bounded) and a repeat only deletes; without
/// it the dead-letter queue holds two copies of the message. `dead_letters` counts the move once,
/// when the redelivery completes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item9_sqs_failed_delete_after_the_copy_sends_no_second_copy() {
    init_tracing();
    let client = sqs().await;
    let fence = pg().await;
    let q = TestQueue::new(&client, "h9-src", 3).await;
    let dlq = TestQueue::new(&client, "h9-dlq", 3).await;
    let proxy = SqsProxy::start("w", ProxyLog::default()).await;
    proxy.refuse(Some("DeleteMessage"));
    let id = send(&client, &q.url, "poison").await;
    let config = SqsConfig::new(&q.url)
        .expect("url")
        .wait_time(Duration::from_secs(1))
        .call_timeout(Duration::from_secs(1))
        .dead_letter(DeadLetterTarget::Queue(dlq.url.clone()));
    let consumer = Arc::new(Consumer::new(
        SqsSource::new(proxy.client().await, config),
        dyn_store(&fence),
        ConsumerConfig::new(SupervisorConfig::new(secs(3)).retry(one_attempt())).grace(Duration::from_secs(2)),
    ));
    let stop = CancellationToken::new();
    let (c, s) = (Arc::clone(&consumer), stop.clone());
    let run = tokio::spawn(async move { c.run(poison(), s).await });
    // The message comes back after the failed delete (its first move is over by then: its
    // handle is no longer usable); from now on deletes go through.
    eventually(Duration::from_secs(30), "the message delivered again after the failed delete", || {
        let received = proxy
            .log()
            .iter()
            .filter(|e| matches!(e, ProxyEvent::Received { message_id, .. } if *message_id == id))
            .count();
        async move { received >= 2 }
    })
    .await;
    proxy.refuse(None);
    assert!(proxy.refused() >= 1, "the first delete was refused (the test is not blind)");
    eventually(Duration::from_secs(20), "the message deleted from the queue", || {
        let (client, url) = (client.clone(), q.url.clone());
        async move { depth(&client, &url).await == 0 }
    })
    .await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), run).await.expect("consumer stops").expect("join").expect("run");
    let copies = drain(&client, &dlq.url, 2, Duration::from_secs(3)).await;
    let sources: Vec<Option<&str>> = copies
        .iter()
        .map(|m| m.message_attributes().and_then(|a| a.get(SOURCE_MESSAGE_ID_ATTRIBUTE)).and_then(|v| v.string_value()))
        .collect();
    assert_eq!(sources, vec![Some(id.as_str())], "one copy in the dead-letter queue, not one per delivery");
    let m = consumer.metrics().snapshot();
    assert_eq!(m.dead_letters, 1, "one message moved, counted once: {m}");
    assert_eq!(m.dead_jobs, 1, "{m}");
    q.delete(&client).await;
    dlq.delete(&client).await;
    drop_schema(&fence).await;
}

/// The proxy's log with message ids and handles named by their letters (A = the first id).
fn summary(log: &[ProxyEvent], ids: &[String]) -> String {
    let letter = |id: &str| ids.iter().position(|i| i == id).map_or('?', |p| char::from(b'A' + p as u8));
    let mut handles: Vec<(String, char)> = Vec::new();
    let mut out = Vec::new();
    for e in log {
        match e {
            ProxyEvent::Received { message_id, handle, .. } => {
                handles.push((handle.clone(), letter(message_id)));
                out.push(format!("recv {}", letter(message_id)));
            }
            ProxyEvent::Used { op, handles: used, .. } => {
                let of: String =
                    used.iter().map(|h| handles.iter().find(|(k, _)| k == h).map_or('?', |(_, l)| *l)).collect();
                out.push(format!("{op} {of}"));
            }
            ProxyEvent::Unreadable { op, .. } => out.push(format!("unreadable {op}")),
        }
    }
    out.join(", ")
}

/// What the paused worker tells the test, and how the test wakes it.
struct Paused {
    started: std::sync::mpsc::Receiver<String>,
    wake: std::sync::mpsc::Sender<()>,
    stop: CancellationToken,
    thread: std::thread::JoinHandle<brokerfence::MetricsSnapshot>,
}

/// A worker on a runtime of its own whose handler blocks that runtime's only thread: its
/// heartbeats, visibility extensions and commits all stop, as in a process stopped with SIGSTOP.
/// It receives one message at a time, with a 1 s visibility and a 5 s lease, so another worker
/// sees the message again while the database lease is still the paused one's.
fn paused_worker(url: &str, schema: brokerfence::SchemaName) -> Paused {
    let (started_tx, started) = std::sync::mpsc::channel::<String>();
    let (wake, wake_rx) = std::sync::mpsc::channel::<()>();
    let wake_rx = Arc::new(Mutex::new(wake_rx));
    let stop = CancellationToken::new();
    let (url, s) = (url.to_owned(), stop.clone());
    let thread = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async move {
            let store = brokerfence_testkit::store::pg_on(schema).await;
            let config = SqsConfig::new(&url)
                .expect("url")
                .wait_time(Duration::from_secs(1))
                .visibility_timeout(Duration::from_secs(1));
            let consumer = Consumer::with_owner(
                SqsSource::new(sqs().await, config),
                Arc::new(store),
                Owner::new("paused-w1").expect("owner"),
                ConsumerConfig::new(SupervisorConfig::new(secs(5))).concurrency(1).batch(1),
            );
            let handler = move |ctx: JobContext| {
                let (started_tx, wake_rx) = (started_tx.clone(), Arc::clone(&wake_rx));
                async move {
                    let _ = started_tx.send(ctx.key().to_string());
                    // Blocks the runtime's only thread: the whole worker is paused.
                    if let Ok(rx) = wake_rx.lock() {
                        let _ = rx.recv_timeout(Duration::from_secs(90));
                    }
                    Ok::<_, JobError>(b"paused-w1".to_vec())
                }
            };
            let _ = consumer.run(handler, s).await;
            consumer.metrics().snapshot()
        })
    });
    Paused { started, wake, stop, thread }
}

/// Item 10, "FIFO order still breaks under a paused holder": one FIFO group A…F; worker w1
/// receives A and is paused past its lease (its whole runtime blocked). Worker w2 receives A
/// (busy: w1's lease) and B, holds A and hides B behind it; when A's visibility runs out,
/// LocalStack hands w2 A and C while B is still hidden; w2 takes A over (epoch 2) and commits it.
/// Guard: the consumer remembers (bounded, for a lease past its hiding) every message of a group
/// it has seen and not finished, and never starts a later one of the group before it: C waits
/// for B. Without it w2 commits C before B (order A C B D E F).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item10_fifo_order_holds_under_a_paused_holder() {
    init_tracing();
    let client = sqs().await;
    let fence = pg().await;
    let q = TestQueue::fifo(&client, "h10", 30).await;
    let keys: Vec<String> = ["A", "B", "C", "D", "E", "F"].iter().map(|k| (*k).to_owned()).collect();
    let entries = keys
        .iter()
        .enumerate()
        .map(|(i, k)| {
            SendMessageBatchRequestEntry::builder()
                .id(format!("e{i}"))
                .message_body(k)
                .message_group_id("g")
                .message_deduplication_id(k)
                .build()
                .expect("entry")
        })
        .collect::<Vec<_>>();
    let sent = client.send_message_batch().queue_url(&q.url).set_entries(Some(entries)).send().await.expect("send");
    let id_of = |i: usize| {
        let entry = format!("e{i}");
        sent.successful().iter().find(|e| e.id() == entry).map(|e| e.message_id().to_owned()).expect("sent")
    };
    let ids: Vec<String> = (0..keys.len()).map(id_of).collect();
    let (b_id, c_id) = (ids[1].clone(), ids[2].clone());

    let w1 = paused_worker(&q.url, fence.get_schema().clone());
    let first = tokio::task::spawn_blocking(move || {
        let got = w1.started.recv_timeout(Duration::from_secs(20));
        (got, w1)
    });
    let (got, w1) = first.await.expect("join");
    assert_eq!(got.as_deref(), Ok("A"), "the paused worker holds the group's head");
    // w1's 1 s visibility lapses (on LocalStack after 1.4–1.9 s) while its 5 s lease runs: w2's
    // first receive then finds A and B visible and takes both.
    tokio::time::sleep(Duration::from_millis(2500)).await;

    let ran: Arc<Mutex<Vec<String>>> = Arc::default();
    let r = Arc::clone(&ran);
    let handler = move |ctx: JobContext| {
        let r = Arc::clone(&r);
        async move {
            r.lock().expect("lock").push(ctx.key().to_string());
            tokio::time::sleep(Duration::from_millis(50)).await;
            Ok::<_, JobError>(b"w2".to_vec())
        }
    };
    let proxy = SqsProxy::start("w2", ProxyLog::default()).await;
    let config = SqsConfig::new(&q.url).expect("url").wait_time(Duration::from_secs(1));
    let w2 = Arc::new(Consumer::with_owner(
        SqsSource::new(proxy.client().await, config),
        dyn_store(&fence),
        Owner::new("w2").expect("owner"),
        ConsumerConfig::new(SupervisorConfig::new(secs(5))).concurrency(2).batch(2).grace(Duration::from_secs(2)),
    ));
    let stop = CancellationToken::new();
    let (c, s) = (Arc::clone(&w2), stop.clone());
    let run = tokio::spawn(async move { c.run(handler, s).await });
    // w2 receives A (busy: w1's lease) with B, and hides A for w1's time left. The scripted rounds
    // saw LocalStack then hand out A with C while B was still hidden in 1 of 3 rounds; here B's
    // hiding is stretched to 5 s from the hold (with the receipt handle the proxy saw w2 receive,
    // once w2's own calls for the hold are answered), so it does every time.
    let handles_of = |log: &[ProxyEvent], id: &str| -> Vec<String> {
        log.iter()
            .filter_map(|e| match e {
                ProxyEvent::Received { message_id, handle, .. } if message_id == id => Some(handle.clone()),
                _ => None,
            })
            .collect()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let log = proxy.log();
        let a_handles = handles_of(&log, &ids[0]);
        let held = log.iter().any(|e| {
            matches!(e, ProxyEvent::Used { op, handles, .. }
                if op.starts_with("ChangeMessageVisibility") && handles.iter().any(|h| a_handles.contains(h)))
        });
        if held && !handles_of(&log, &b_id).is_empty() {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "w2 never held A with B received: {}", summary(&log, &ids));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The hold's calls are logged before they are forwarded: let them be answered first.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let newest_b = handles_of(&proxy.log(), &b_id).pop().expect("B received");
    client
        .change_message_visibility()
        .queue_url(&q.url)
        .receipt_handle(newest_b)
        .visibility_timeout(5)
        .send()
        .await
        .expect("stretch B's hiding");
    let m = w2.metrics();
    eventually(Duration::from_secs(60), "w2 completes the six jobs", || {
        let s = m.snapshot();
        async move { s.completions == 6 && s.acks == 6 }
    })
    .await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(20), run).await.expect("w2 stops").expect("join").expect("run");
    // Wake the paused worker (told to stop first): its late commit of A is fenced.
    w1.stop.cancel();
    let _ = w1.wake.send(());
    let w1_metrics = tokio::task::spawn_blocking(move || w1.thread.join()).await.expect("join").expect("w1");

    let ran = ran.lock().expect("lock").clone();
    // The broker did hand w2 a later message while an earlier one was hidden (else the test would
    // not exercise the guard): C was received before B's second receive.
    let receives: Vec<&str> = proxy
        .log()
        .iter()
        .filter_map(|e| match e {
            ProxyEvent::Received { message_id, .. } if *message_id == b_id => Some("B"),
            ProxyEvent::Received { message_id, .. } if *message_id == c_id => Some("C"),
            ProxyEvent::Received { .. } => Some("-"),
            _ => None,
        })
        .collect();
    let second_b = receives.iter().enumerate().filter(|(_, k)| **k == "B").nth(1).map(|(i, _)| i);
    let first_c = receives.iter().position(|k| *k == "C");
    let snapshot = w2.metrics().snapshot();
    assert!(snapshot.busy >= 1, "w2 found A held by the paused worker: {snapshot}");
    let seen = summary(&proxy.log(), &ids);
    assert_eq!(ran, keys, "w2 ran the group out of order (what w2 received and sent: {seen})");
    assert!(
        matches!((first_c, second_b), (Some(c), Some(b)) if c < b),
        "the broker did not hand out C while B was hidden; the guard was not exercised: {seen}"
    );
    assert_eq!(commit_order(&fence).await, keys, "the group committed out of order");
    let rows = jobs(&fence).await;
    assert_eq!((rows[0].0.as_str(), rows[0].1.as_str(), rows[0].2), ("A", "completed", 2), "{rows:?}");
    assert_eq!(rows[0].4.as_deref(), Some(&b"w2"[..]), "the paused worker's late result was dropped");
    assert_eq!(w1_metrics.completions, 0, "the paused worker committed nothing: {w1_metrics}");
    assert_eq!(depth(&client, &q.url).await, 0);
    q.delete(&client).await;
    drop_schema(&fence).await;
}
