//! The bad-input sweep, across sources: malformed bodies, oversize messages, invalid UTF-8, wrong
//! attribute types, huge keys, keys full of SQL and Lua metacharacters. Each bad delivery gets a
//! clear typed error and ends dead-lettered with its reason; keys that are merely strange round
//! trip byte for byte; the consumer loop keeps running; nothing else is lost.
//!
//! The same sweep runs on the table queue (PostgreSQL and SQLite), and with their features on
//! SQS (LocalStack) and Redis streams (a real Redis). Source-specific decoding cases (a missing
//! key field, an entry without a body) are in those adapters' own tests; this file covers what
//! every source must do alike.

use brokerfence_testkit::store as common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use brokerfence::TableQueue;
use brokerfence::wire::{FenceStamp, StampError};
use brokerfence::{Consumer, ConsumerConfig, Handler, Source};
use brokerfence::{
    FenceError, FenceStore, JobContext, JobError, JobKey, JobState, LeaseDuration, MAX_KEY_BYTES, MetricsSnapshot,
    Owner, QueueName, SchemaName, SupervisorConfig,
};
use tokio_util::sync::CancellationToken;

// ------------------------------------------------------------------------------------------------
// The handler's typed decoder
// ------------------------------------------------------------------------------------------------

/// Largest body the handler accepts.
const MAX_BODY: usize = 64 * 1024;

/// Why a body cannot be handled: the typed error every bad body must get.
#[derive(Debug, Clone, PartialEq, Eq)]
enum DecodeError {
    TooLarge { len: usize, max: usize },
    NotUtf8 { valid_up_to: usize },
    NotJson { detail: String },
    Missing { field: &'static str },
    WrongType { field: &'static str, expected: &'static str, found: &'static str },
}

impl DecodeError {
    /// A stable tag, asserted in the stored reason.
    fn tag(&self) -> &'static str {
        match self {
            DecodeError::TooLarge { .. } => "too-large",
            DecodeError::NotUtf8 { .. } => "not-utf8",
            DecodeError::NotJson { .. } => "not-json",
            DecodeError::Missing { .. } => "missing-field",
            DecodeError::WrongType { .. } => "wrong-type",
        }
    }
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "undecodable body [{}]: ", self.tag())?;
        match self {
            DecodeError::TooLarge { len, max } => write!(f, "{len} bytes is over the limit of {max}"),
            DecodeError::NotUtf8 { valid_up_to } => write!(f, "not UTF-8 after byte {valid_up_to}"),
            DecodeError::NotJson { detail } => write!(f, "not JSON ({detail})"),
            DecodeError::Missing { field } => write!(f, "field {field:?} is missing"),
            DecodeError::WrongType { field, expected, found } => {
                write!(f, "field {field:?} must be {expected}, found {found}")
            }
        }
    }
}

fn kind_of(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The body every source carries: `{"amount": <integer>, "note": <string>}`.
fn decode(body: &[u8]) -> Result<(i64, String), DecodeError> {
    if body.len() > MAX_BODY {
        return Err(DecodeError::TooLarge { len: body.len(), max: MAX_BODY });
    }
    let text = std::str::from_utf8(body).map_err(|e| DecodeError::NotUtf8 { valid_up_to: e.valid_up_to() })?;
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| DecodeError::NotJson { detail: e.to_string() })?;
    let amount = value.get("amount").ok_or(DecodeError::Missing { field: "amount" })?;
    let amount = amount.as_i64().ok_or(DecodeError::WrongType {
        field: "amount",
        expected: "an integer",
        found: kind_of(amount),
    })?;
    let note = value.get("note").ok_or(DecodeError::Missing { field: "note" })?;
    let note =
        note.as_str().ok_or(DecodeError::WrongType { field: "note", expected: "a string", found: kind_of(note) })?;
    Ok((amount, note.to_owned()))
}

/// What the handler saw, per key.
type Seen = Arc<Mutex<HashMap<String, u32>>>;

fn handler(seen: Seen) -> impl Handler {
    move |ctx: JobContext| {
        let seen = Arc::clone(&seen);
        async move {
            *seen.lock().expect("lock").entry(ctx.key().as_str().to_owned()).or_default() += 1;
            match decode(ctx.payload()) {
                Ok((amount, note)) => Ok(format!("{}|{amount}|{note}", ctx.key()).into_bytes()),
                // Retrying cannot fix a body: final, so the job is dead-lettered with the reason.
                Err(e) => Err(JobError::fatal(e)),
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// The sweep
// ------------------------------------------------------------------------------------------------

/// A key that is strange but valid: it must round trip byte for byte.
fn strange_keys() -> Vec<String> {
    vec![
        "'; DROP TABLE brokerfence.jobs; --".into(),
        "\" OR \"1\"=\"1".into(),
        "x' OR '1'='1' /*".into(),
        "$1::text; SELECT pg_sleep(10)".into(),
        "%_\\%\\_ LIKE wildcards".into(),
        "back\\slash\\\\ and 'quotes'".into(),
        "x'); redis.call('FLUSHALL') --".into(),
        "]]..os.exit()..[[".into(),
        "--[==[ lua long comment".into(),
        "{hash}tag}{ braces {".into(),
        "*?[glob] KEYS pattern".into(),
        "new\nline\r\ttab".into(),
        "ünïcødé ✓ 🦀 עִבְרִית".into(),
        "   ".into(),
        "k".repeat(MAX_KEY_BYTES),                     // exactly at the limit
        format!("{}é", "k".repeat(MAX_KEY_BYTES - 2)), // multi-byte char ending at the limit
    ]
}

/// A body that the handler must refuse, and the tag of its typed error.
fn bad_bodies() -> Vec<(&'static str, Vec<u8>, &'static str)> {
    let nested = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    vec![
        ("not-utf8", b"{\"amount\":1,\"note\":\"\xff\xfe\"}".to_vec(), "not-utf8"),
        ("lone-surrogate", b"\xed\xa0\x80".to_vec(), "not-utf8"),
        ("truncated-json", b"{\"amount\":1,\"note\":".to_vec(), "not-json"),
        ("not-json", b"amount=1&note=x".to_vec(), "not-json"),
        ("empty", Vec::new(), "not-json"),
        ("deep-nesting", nested.into_bytes(), "too-large"),
        ("deep-nesting-small", format!("{}{}", "[".repeat(5_000), "]".repeat(5_000)).into_bytes(), "not-json"),
        ("oversize", format!("{{\"amount\":1,\"note\":\"{}\"}}", "x".repeat(MAX_BODY)).into_bytes(), "too-large"),
        ("missing-field", b"{\"note\":\"no amount\"}".to_vec(), "missing-field"),
        ("amount-is-string", b"{\"amount\":\"ten\",\"note\":\"x\"}".to_vec(), "wrong-type"),
        ("amount-is-float", b"{\"amount\":1.5,\"note\":\"x\"}".to_vec(), "wrong-type"),
        ("amount-overflows", b"{\"amount\":99999999999999999999,\"note\":\"x\"}".to_vec(), "wrong-type"),
        ("note-is-object", b"{\"amount\":1,\"note\":{\"$ne\":null}}".to_vec(), "wrong-type"),
        ("top-level-array", b"[1,2,3]".to_vec(), "missing-field"),
    ]
}

fn good_body(i: usize) -> Vec<u8> {
    format!("{{\"amount\":{i},\"note\":\"nul \\u0000 and 'quotes'; --\"}}").into_bytes()
}

/// Keys and names that are invalid: each is a typed `InvalidInput` before anything is written.
#[test]
fn invalid_keys_and_names_are_typed_errors() {
    let huge = "k".repeat(MAX_KEY_BYTES + 1);
    let megabyte = "k".repeat(1 << 20);
    for (what, result) in [
        ("empty", JobKey::new("")),
        ("one byte over", JobKey::new(huge)),
        ("a megabyte", JobKey::new(megabyte)),
        ("NUL", JobKey::new("a\0b")),
        ("invalid UTF-8", JobKey::from_bytes(b"\xff\xfe")),
        ("lone surrogate", JobKey::from_bytes(b"\xed\xa0\x80")),
        ("overlong encoding", JobKey::from_bytes(b"\xc0\xaf")),
    ] {
        match result {
            Err(FenceError::InvalidInput { what: "key", reason }) => assert!(!reason.is_empty(), "{what}"),
            other => panic!("{what}: expected a typed InvalidInput for the key, got {other:?}"),
        }
    }
    assert!(matches!(QueueName::new("q".repeat(257)), Err(FenceError::InvalidInput { what: "queue", .. })));
    assert!(matches!(QueueName::from_bytes(b"\xff"), Err(FenceError::InvalidInput { what: "queue", .. })));
    assert!(matches!(Owner::new("o\0"), Err(FenceError::InvalidInput { what: "owner", .. })));
    for bad in ["x; DROP TABLE jobs", "brokerfence\"", "Upper", "pg_catalog", "", "a-b", &"s".repeat(64), "é"] {
        assert!(matches!(SchemaName::new(bad), Err(FenceError::InvalidSchema { .. })), "{bad:?}");
    }
    assert!(matches!(LeaseDuration::from_secs(1), Err(FenceError::LeaseTooShort { .. })));
}

/// Fencing stamps from hostile headers / attributes: each is a typed `StampError` naming the
/// field; strange but valid values round trip.
#[test]
fn hostile_stamps_are_typed_errors() {
    let base = |epoch: &str| {
        vec![("Fence-Queue", "q".to_owned()), ("Fence-Job", "k".to_owned()), ("Fence-Epoch", epoch.to_owned())]
    };
    for epoch in ["0", "-1", "1; DROP TABLE ledger", "1e3", "0x10", "99999999999999999999", " ", "1.0", "١"] {
        match FenceStamp::from_headers(base(epoch)) {
            Err(e @ (StampError::Malformed { .. } | StampError::Missing { .. })) => {
                assert_eq!(e.name(), "Fence-Epoch", "{epoch:?}: {e}");
                assert!(e.to_json().starts_with("{\"error\":"), "{e}");
            }
            other => panic!("epoch {epoch:?}: expected a typed error, got {other:?}"),
        }
    }
    let mut twice = base("1");
    twice.push(("fence-epoch", "2".into()));
    assert!(matches!(FenceStamp::from_headers(twice), Err(StampError::Conflicting { name: "Fence-Epoch" })));
    for job in ["%", "%zz", "%f", "%C3%28"] {
        let pairs =
            vec![("Fence-Queue", "q".to_owned()), ("Fence-Job", job.to_owned()), ("Fence-Epoch", "1".to_owned())];
        assert!(
            matches!(FenceStamp::from_headers(pairs), Err(StampError::Malformed { name: "Fence-Job", .. })),
            "{job:?}"
        );
    }
    for key in strange_keys() {
        let stamp = FenceStamp::new("q{1}", key.clone(), 7);
        let headers = stamp.to_headers();
        assert!(headers.iter().all(|(_, v)| v.bytes().all(|b| (b'!'..=b'~').contains(&b))), "{headers:?}");
        let back = FenceStamp::from_headers(headers.iter().map(|(k, v)| (*k, v.as_str()))).expect("round trip");
        assert_eq!(back, stamp);
    }
}

/// The ledger with hostile job names: refused inputs are typed; strange names are just names.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_with_hostile_names() {
    let fence = common::pg().await;
    let ledger = brokerfence::ledger::PgLedger::new(&fence, "sweep'; --");
    for key in strange_keys() {
        assert!(ledger.accept(&key, 2).await.expect("accept").is_accepted(), "{key:?}");
        assert!(!ledger.accept(&key, 1).await.expect("accept").is_accepted(), "{key:?}");
        assert_eq!(ledger.newest(&key).await.expect("newest"), Some(2));
    }
    for (job, epoch) in [("", 1), ("a\0b", 1), ("ok", 0), ("ok", -5)] {
        assert!(matches!(ledger.accept(job, epoch).await, Err(FenceError::InvalidInput { .. })), "{job:?} {epoch}");
    }
    let huge = "j".repeat(brokerfence::ledger::MAX_LEDGER_JOB_BYTES + 1);
    assert!(matches!(ledger.accept(&huge, 1).await, Err(FenceError::InvalidInput { what: "ledger job", .. })));
    let long_scope = brokerfence::ledger::PgLedger::new(&fence, &"s".repeat(brokerfence::MAX_NAME_BYTES + 1));
    assert!(matches!(long_scope.accept("ok", 1).await, Err(FenceError::InvalidInput { what: "ledger scope", .. })));
}

// ------------------------------------------------------------------------------------------------
// Running a consumer over a source and checking the outcome
// ------------------------------------------------------------------------------------------------

struct Running {
    stop: CancellationToken,
    handle: tokio::task::JoinHandle<MetricsSnapshot>,
    metrics: Arc<brokerfence::Metrics>,
}

fn start<S: Source>(source: S, store: Arc<dyn FenceStore>, seen: Seen) -> Running {
    let config = ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(5).expect("lease")))
        .concurrency(4)
        .batch(10)
        .grace(Duration::from_secs(3));
    let consumer = Consumer::new(source, store, config);
    let metrics = consumer.metrics();
    let stop = CancellationToken::new();
    let handle = tokio::spawn({
        let stop = stop.clone();
        async move {
            if let Err(e) = consumer.run(handler(seen), stop).await {
                panic!("the consumer loop ended with an error: {e}");
            }
            consumer.metrics().snapshot()
        }
    });
    Running { stop, handle, metrics }
}

impl Running {
    async fn wait(&self, what: &str, within: Duration, cond: impl Fn(&MetricsSnapshot) -> bool) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let m = self.metrics.snapshot();
            if cond(&m) {
                return;
            }
            assert!(!self.handle.is_finished(), "the consumer loop stopped while waiting for {what}: {m}");
            assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}: {m}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn stop(self) -> MetricsSnapshot {
        assert!(!self.handle.is_finished(), "the consumer loop stopped on its own");
        self.stop.cancel();
        tokio::time::timeout(Duration::from_secs(20), self.handle).await.expect("stops in time").expect("join")
    }
}

/// Checks the stored outcome of every job of the sweep: strange keys completed once with their
/// exact key, bad bodies dead with their typed reason after one attempt.
async fn check_rows(
    store: &dyn FenceStore,
    queue: &QueueName,
    good: &[(String, usize)],
    bad: &[(String, &'static str)],
    seen: &Seen,
) {
    for (key, i) in good {
        let row = store.job(queue, &JobKey::new(key.clone()).expect("key")).await.expect("job").expect("row");
        assert_eq!(row.state, JobState::Completed, "{key:?}: {row:?}");
        let want = format!("{key}|{i}|nul \0 and 'quotes'; --");
        assert_eq!(row.result.as_deref(), Some(want.as_bytes()), "{key:?}");
        assert_eq!(row.key.as_str(), key, "the key round trips");
    }
    for (key, tag) in bad {
        let row = store.job(queue, &JobKey::new(key.clone()).expect("key")).await.expect("job").expect("row");
        assert_eq!(row.state, JobState::Dead, "{key}: {row:?}");
        assert_eq!(row.attempts, 1, "{key}: a bad body is not retried");
        let reason = row.last_error.unwrap_or_default();
        assert!(reason.contains(&format!("undecodable body [{tag}]")), "{key}: reason {reason:?}");
        assert!(reason.len() < 4096, "{key}: the reason is short and clear, not the body");
    }
    let seen = seen.lock().expect("lock");
    for (key, _) in good.iter().map(|(k, i)| (k, *i)).chain(bad.iter().map(|(k, _)| (k, 0))) {
        assert_eq!(seen.get(key.as_str()).copied(), Some(1), "{key:?} ran once");
    }
}

// ------------------------------------------------------------------------------------------------
// Table queue (PostgreSQL and SQLite)
// ------------------------------------------------------------------------------------------------

async fn table_queue_sweep(store: Arc<dyn FenceStore>) {
    let queue = QueueName::new("sweep 'q'; --").expect("queue");
    let good: Vec<(String, usize)> = strange_keys().into_iter().enumerate().map(|(i, k)| (k, i)).collect();
    let bad: Vec<(String, &'static str)> =
        bad_bodies().into_iter().map(|(name, _, tag)| (format!("bad-{name}"), tag)).collect();
    let mut items: Vec<(JobKey, Vec<u8>)> = Vec::new();
    for (k, i) in &good {
        items.push((JobKey::new(k.clone()).expect("strange but valid key"), good_body(*i)));
    }
    for (name, body, _) in bad_bodies() {
        items.push((JobKey::new(format!("bad-{name}")).expect("key"), body));
    }
    // A megabyte payload is stored and handed out intact (then refused by the handler as too large).
    assert_eq!(store.enqueue_many(&queue, &items).await.expect("enqueue"), items.len() as u64);
    assert!(!store.enqueue(&queue, &JobKey::new(good[0].0.clone()).expect("key"), b"dup").await.expect("enqueue"));

    let seen: Seen = Arc::default();
    let source = TableQueue::new(Arc::clone(&store), queue.clone()).idle_wait(Duration::from_millis(20));
    let run = start(source, Arc::clone(&store), Arc::clone(&seen));
    let (g, b) = (good.len() as u64, bad.len() as u64);
    run.wait("the sweep", Duration::from_secs(30), |m| m.completions == g && m.dead_letters == b).await;
    // The loop keeps running: a job enqueued afterwards completes.
    let later = JobKey::new("after-the-sweep").expect("key");
    store.enqueue(&queue, &later, &good_body(99)).await.expect("enqueue");
    run.wait("the job after the sweep", Duration::from_secs(10), |m| m.completions == g + 1).await;
    let m = run.stop().await;
    assert_eq!((m.fenced_rejections, m.lease_losses, m.failures), (0, 0, 0), "{m}");
    check_rows(&*store, &queue, &good, &bad, &seen).await;
    // Nothing else is touched: the fence's table still holds exactly these jobs.
    assert_eq!(
        store
            .claim_next(&queue, &Owner::unique("probe"), LeaseDuration::from_secs(3).expect("lease"), 100)
            .await
            .expect("claim")
            .len(),
        0
    );
}

/// A failure message that is itself hostile (NUL bytes, a megabyte) is stored safely.
async fn hostile_failure_messages(store: Arc<dyn FenceStore>) {
    let queue = QueueName::new("hostile-errors").expect("queue");
    let key = JobKey::new("k").expect("key");
    store.enqueue(&queue, &key, b"x").await.expect("enqueue");
    let owner = Owner::unique("w");
    let jobs = store.claim_next(&queue, &owner, LeaseDuration::from_secs(5).expect("lease"), 1).await.expect("claim");
    let message = format!("nul\0inside; DROP TABLE x; -- {}", "e".repeat(1 << 20));
    let outcome = store
        .fail(&jobs[0].lease, &message, false, &brokerfence::RetryPolicy::default())
        .await
        .expect("fail with a hostile message");
    assert_eq!(outcome, brokerfence::FailOutcome::Dead);
    let row = store.job(&queue, &key).await.expect("job").expect("row");
    let stored = row.last_error.expect("stored");
    assert!(stored.starts_with("nul\u{FFFD}inside; DROP TABLE x; --"), "{}", &stored[..40]);
    assert_eq!(row.state, JobState::Dead);
}

mod table_on_postgres {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sweep() {
        table_queue_sweep(Arc::new(common::pg().await)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn failure_messages() {
        hostile_failure_messages(Arc::new(common::pg().await)).await;
    }
}

mod table_on_sqlite {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sweep() {
        table_queue_sweep(Arc::new(common::sqlite().await)).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn failure_messages() {
        hostile_failure_messages(Arc::new(common::sqlite().await)).await;
    }
}

// ------------------------------------------------------------------------------------------------
// SQS (feature `sqs`, LocalStack)
// ------------------------------------------------------------------------------------------------

#[cfg(feature = "sqs")]
mod sqs_sweep {
    use super::*;
    use brokerfence::sqs::aws_sdk_sqs::Client;
    use brokerfence::sqs::aws_sdk_sqs::primitives::Blob;
    use brokerfence::sqs::aws_sdk_sqs::types::MessageAttributeValue;
    use brokerfence::sqs::{KeyStrategy, REASON_ATTRIBUTE, SqsConfig, SqsSource};
    use brokerfence_testkit::sqs::{TestQueue, sqs};

    const KEY: &str = "job-key";

    fn string_attr(v: &str) -> MessageAttributeValue {
        MessageAttributeValue::builder().data_type("String").string_value(v).build().expect("attribute")
    }

    async fn send(client: &Client, url: &str, body: &str, key: Option<MessageAttributeValue>) -> String {
        let mut req = client.send_message().queue_url(url).message_body(body);
        if let Some(k) = key {
            req = req.message_attributes(KEY, k);
        }
        req.send().await.expect("SendMessage (run `bash localstack/up`)").message_id().expect("id").to_owned()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqs_sweep() {
        let client = sqs().await;
        let fence = common::pg().await;
        let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
        let test_queue = TestQueue::with_dlq(&client, "sweep", 5, 5).await;
        let (name, url) = (test_queue.name.clone(), test_queue.url.clone());
        let dlq = test_queue.dlq.clone().expect("the queue has a DLQ");

        // Strange keys (SQS allows any text but control characters other than tab, CR, LF).
        let good: Vec<(String, usize)> = strange_keys().into_iter().enumerate().map(|(i, k)| (k, i)).collect();
        for (k, i) in &good {
            send(&client, &url, std::str::from_utf8(&good_body(*i)).expect("text"), Some(string_attr(k))).await;
        }
        // Bad bodies SQS can carry (text, 1 B..256 KiB).
        let mut bad = Vec::new();
        for (name, body, tag) in bad_bodies() {
            let Ok(text) = String::from_utf8(body) else { continue };
            if text.is_empty() {
                continue;
            }
            let key = format!("bad-{name}");
            send(&client, &url, &text, Some(string_attr(&key))).await;
            bad.push((key, tag));
        }
        // Keys the adapter cannot use: dead-lettered by the source with its reason, never claimed.
        let huge = "k".repeat(MAX_KEY_BYTES + 1);
        let binary = MessageAttributeValue::builder()
            .data_type("Binary")
            .binary_value(Blob::new(b"\xff\xfe".to_vec()))
            .build()
            .expect("attribute");
        let number =
            MessageAttributeValue::builder().data_type("Number").string_value("42").build().expect("attribute");
        let bad_keys = vec![
            (send(&client, &url, "{}", Some(string_attr(&huge))).await, "over the limit"),
            (send(&client, &url, "{}", Some(binary)).await, "type Binary"),
            (send(&client, &url, "{}", None).await, "is missing"),
        ];
        // A Number attribute is a valid key of its own (the attribute type is allowed).
        send(&client, &url, std::str::from_utf8(&good_body(42)).expect("text"), Some(number)).await;

        let seen: Seen = Arc::default();
        let config = SqsConfig::new(url.clone())
            .expect("config")
            .key(KeyStrategy::attribute(KEY))
            .wait_time(Duration::from_secs(1));
        let source = SqsSource::new(client.clone(), config);
        let queue = QueueName::new(name.clone()).expect("queue");
        let run = start(source, Arc::clone(&store), Arc::clone(&seen));
        let (g, b, k) = (good.len() as u64 + 1, bad.len() as u64, bad_keys.len() as u64);
        run.wait("the SQS sweep", Duration::from_secs(60), |m| m.completions == g && m.dead_letters == b + k).await;
        send(&client, &url, std::str::from_utf8(&good_body(7)).expect("text"), Some(string_attr("after-the-sweep")))
            .await;
        run.wait("the job after the sweep", Duration::from_secs(20), |m| m.completions == g + 1).await;
        let m = run.stop().await;
        assert_eq!((m.fenced_rejections, m.lease_losses), (0, 0), "{m}");
        check_rows(&*store, &queue, &good, &bad, &seen).await;

        // The DLQ holds every bad one, each with its reason.
        let mut reasons: HashMap<String, String> = HashMap::new();
        let mut empty = 0;
        while empty < 2 {
            let out = client
                .receive_message()
                .queue_url(&dlq)
                .max_number_of_messages(10)
                .wait_time_seconds(1)
                .message_attribute_names("All")
                .send()
                .await
                .expect("receive dlq");
            if out.messages().is_empty() {
                empty += 1;
            }
            for msg in out.messages() {
                let attrs = msg.message_attributes();
                let get = |n: &str| {
                    attrs.and_then(|a| a.get(n)).and_then(|v| v.string_value()).unwrap_or_default().to_owned()
                };
                let source_id = get(brokerfence::sqs::SOURCE_MESSAGE_ID_ATTRIBUTE);
                let key = get(KEY);
                reasons.insert(
                    if key.is_empty() || key.len() > MAX_KEY_BYTES { source_id } else { key },
                    get(REASON_ATTRIBUTE),
                );
            }
        }
        for (key, tag) in &bad {
            let reason = reasons.get(key).unwrap_or_else(|| panic!("{key} is not in the DLQ: {reasons:?}"));
            assert!(reason.contains(&format!("undecodable body [{tag}]")), "{key}: {reason:?}");
        }
        for (id, want) in &bad_keys {
            let reason = reasons.get(id).unwrap_or_else(|| panic!("message {id} is not in the DLQ: {reasons:?}"));
            assert!(reason.contains(want), "{id}: {reason:?} should say {want:?}");
        }
        assert_eq!(reasons.len(), bad.len() + bad_keys.len(), "{reasons:?}");
        test_queue.delete(&client).await;
        common::drop_schema(&fence).await;
    }
}

// ------------------------------------------------------------------------------------------------
// Redis streams (feature `redis`)
// ------------------------------------------------------------------------------------------------

#[cfg(feature = "redis")]
mod redis_sweep {
    use super::*;
    use brokerfence::redis::client as redis;
    use brokerfence::redis::{KeyFrom, RedisConnections, StreamSource};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_sweep() {
        let url = brokerfence_testkit::services::var("REDIS_URL").expect("REDIS_URL (run `bash localstack/up`)");
        let fence = common::pg().await;
        let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
        let client = redis::Client::open(url.as_str()).expect("redis url");
        let mut conn = client.get_multiplexed_async_connection().await.expect("connect to Redis");
        let stream = common::unique("sweep");
        let xadd = |fields: Vec<(&'static str, Vec<u8>)>| {
            let mut cmd = redis::cmd("XADD");
            cmd.arg(&stream).arg("*");
            for (k, v) in fields {
                cmd.arg(k).arg(v);
            }
            cmd
        };
        let good: Vec<(String, usize)> = strange_keys().into_iter().enumerate().map(|(i, k)| (k, i)).collect();
        for (k, i) in &good {
            let _: String = xadd(vec![("key", k.clone().into_bytes()), ("body", good_body(*i))])
                .query_async(&mut conn)
                .await
                .expect("xadd");
        }
        let mut bad = Vec::new();
        for (name, body, tag) in bad_bodies() {
            let key = format!("bad-{name}");
            let _: String = xadd(vec![("key", key.clone().into_bytes()), ("body", body)])
                .query_async(&mut conn)
                .await
                .expect("xadd");
            bad.push((key, tag));
        }
        // A megabyte body: carried, then refused by the handler as too large.
        let _: String = xadd(vec![("key", b"bad-megabyte".to_vec()), ("body", vec![b'x'; 1 << 20])])
            .query_async(&mut conn)
            .await
            .expect("xadd");
        bad.push(("bad-megabyte".into(), "too-large"));
        // Keys the adapter cannot use.
        let mut bad_keys = Vec::new();
        for key in [vec![b'k'; MAX_KEY_BYTES + 1], b"\xff\xfe".to_vec(), b"a\0b".to_vec(), Vec::new()] {
            let id: String =
                xadd(vec![("key", key), ("body", good_body(0))]).query_async(&mut conn).await.expect("xadd");
            bad_keys.push(id);
        }

        let seen: Seen = Arc::default();
        let conns = RedisConnections::connect(&url).await.expect("connect");
        let queue = QueueName::new(stream.clone()).expect("queue");
        let source = StreamSource::new(conns, queue.clone(), stream.clone(), "sweep")
            .expect("source")
            .key_from(KeyFrom::Field("key".into()))
            .block(Duration::from_millis(200));
        let dead_stream = source.get_dead_letter_stream().to_owned();
        let run = start(source, Arc::clone(&store), Arc::clone(&seen));
        let (g, b, k) = (good.len() as u64, bad.len() as u64, bad_keys.len() as u64);
        run.wait("the Redis sweep", Duration::from_secs(30), |m| m.completions == g && m.dead_letters == b + k).await;
        let _: String = xadd(vec![("key", b"after-the-sweep".to_vec()), ("body", good_body(7))])
            .query_async(&mut conn)
            .await
            .expect("xadd");
        run.wait("the job after the sweep", Duration::from_secs(10), |m| m.completions == g + 1).await;
        let m = run.stop().await;
        assert_eq!((m.fenced_rejections, m.lease_losses), (0, 0), "{m}");
        check_rows(&*store, &queue, &good, &bad, &seen).await;

        // Nothing else in Redis was touched by the metacharacter keys.
        let n: i64 = redis::cmd("XLEN").arg(&stream).query_async(&mut conn).await.expect("xlen");
        assert_eq!(n as usize, good.len() + bad.len() + bad_keys.len() + 1);
        type Entries = Vec<(String, Vec<(Vec<u8>, Vec<u8>)>)>;
        let dead: Entries =
            redis::cmd("XRANGE").arg(&dead_stream).arg("-").arg("+").query_async(&mut conn).await.expect("xrange");
        let field = |f: &[(Vec<u8>, Vec<u8>)], name: &str| {
            f.iter().find(|(k, _)| k == name.as_bytes()).map(|(_, v)| String::from_utf8_lossy(v).into_owned())
        };
        let reasons: HashMap<String, String> = dead
            .iter()
            .map(|(_, f)| (field(f, "dead.id").unwrap_or_default(), field(f, "dead.reason").unwrap_or_default()))
            .collect();
        assert_eq!(dead.len(), bad.len() + bad_keys.len(), "{reasons:?}");
        for id in &bad_keys {
            let reason = reasons.get(id).unwrap_or_else(|| panic!("entry {id} is not dead-lettered: {reasons:?}"));
            assert!(reason.contains("key"), "{id}: {reason:?}");
        }
        for (key, tag) in &bad {
            let entry = dead.iter().find(|(_, f)| field(f, "key").as_deref() == Some(key.as_str()));
            let reason =
                entry.and_then(|(_, f)| field(f, "dead.reason")).unwrap_or_else(|| panic!("{key} not dead-lettered"));
            assert!(reason.contains(&format!("undecodable body [{tag}]")), "{key}: {reason:?}");
        }
        let _: () = redis::cmd("DEL").arg(&stream).arg(&dead_stream).query_async(&mut conn).await.expect("del");
        let _ = sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {} CASCADE", fence.get_schema().as_str())))
            .execute(fence.pool())
            .await;
    }
}
