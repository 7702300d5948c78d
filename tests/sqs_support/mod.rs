//! Support for the SQS tests: where SQS and PostgreSQL are, a fresh queue and schema per test, an
//! HTTP receiver with the epoch ledger, and worker processes driven by their `EVENT` lines.
//!
//! SQS: `AWS_ENDPOINT_URL_SQS` (the environment, else `localstack/.env`). Without one, when a
//! Docker engine answers, LocalStack is started once per test binary with testcontainers (and
//! removed at exit; `brokerfence_testkit::localstack`, feature `docker`). With neither, the tests
//! fail at once and say to run `localstack/up`.
#![allow(dead_code)] // each test binary uses its own subset

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use brokerfence::adapters::sqs::aws_config::{self, BehaviorVersion, Region};
use brokerfence::adapters::sqs::aws_sdk_sqs::Client;
use brokerfence::adapters::sqs::aws_sdk_sqs::config::Credentials;
use brokerfence::adapters::sqs::aws_sdk_sqs::types::{Message, MessageSystemAttributeName, QueueAttributeName};
use brokerfence::adapters::sqs::http_client;
use brokerfence::fence::wire::FenceStamp;
use brokerfence::fence::{FenceStore, JobKey, JobRecord, Ledger, PgFence, PgLedger, QueueName, SchemaName, Verdict};
use brokerfence_testkit::localstack;
use sqlx::AssertSqlSafe;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::{Notify, watch};

// ---------------------------------------------------------------- where the services are

/// The SQS endpoint and AWS settings the tests (and the worker processes they start) use.
#[derive(Debug, Clone)]
pub struct Aws {
    pub endpoint: String,
    pub region: String,
    pub key_id: String,
    pub secret: String,
}

impl Aws {
    /// Environment for a child process (worker, producer).
    pub fn child_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL_SQS", self.endpoint.clone()),
            ("AWS_REGION", self.region.clone()),
            ("AWS_ACCESS_KEY_ID", self.key_id.clone()),
            ("AWS_SECRET_ACCESS_KEY", self.secret.clone()),
            ("AWS_EC2_METADATA_DISABLED", "true".into()),
            ("DATABASE_URL", database_url()),
        ]
    }
}

/// The SQS endpoint: configured, or a LocalStack container, or a panic saying what to do.
pub fn aws() -> Aws {
    static AWS: OnceLock<Aws> = OnceLock::new();
    AWS.get_or_init(|| {
        let var = |n: &str, d: &str| brokerfence_testkit::services::var(n).unwrap_or_else(|| d.to_owned());
        let region = var("AWS_REGION", "us-east-1");
        let key_id = var("AWS_ACCESS_KEY_ID", "test");
        let secret = var("AWS_SECRET_ACCESS_KEY", "test");
        let configured =
            brokerfence_testkit::services::var("AWS_ENDPOINT_URL_SQS").or_else(|| brokerfence_testkit::services::var("AWS_ENDPOINT_URL"));
        let endpoint = match configured {
            Some(ep) => {
                assert!(
                    localstack::answers(&ep),
                    "the SQS endpoint {ep} (AWS_ENDPOINT_URL_SQS) does not answer: run `localstack/up` first"
                );
                ep
            }
            None if localstack::docker_answers() => localstack::start().unwrap_or_else(|e| panic!("{e}")),
            None => panic!(
                "no SQS endpoint: AWS_ENDPOINT_URL_SQS is not set (nor in localstack/.env) and no Docker engine \
                 answers for testcontainers. Run `localstack/up` first (it starts LocalStack and writes localstack/.env)."
            ),
        };
        Aws { endpoint, region, key_id, secret }
    })
    .clone()
}

/// An SQS client for the test endpoint.
pub async fn sqs() -> Client {
    let aws = aws();
    let sdk = aws_config::defaults(BehaviorVersion::latest())
        .http_client(http_client())
        .endpoint_url(&aws.endpoint)
        .region(Region::new(aws.region.clone()))
        .credentials_provider(Credentials::new(aws.key_id.clone(), aws.secret.clone(), None, None, "sqs-tests"))
        .load()
        .await;
    Client::new(&sdk)
}

/// The PostgreSQL URL, or a panic that says what to do.
pub fn database_url() -> String {
    brokerfence_testkit::services::var("DATABASE_URL").unwrap_or_else(|| {
        panic!(
            "DATABASE_URL is not set and localstack/.env has none: run `localstack/up` first, or export DATABASE_URL"
        )
    })
}

/// A unique lowercase name with a prefix.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

// ---------------------------------------------------------------- database

/// A migrated PgFence on a fresh schema of its own.
pub async fn pg() -> PgFence {
    let schema = SchemaName::new(format!("sqs_{:016x}", rand::random::<u64>())).expect("schema name");
    let url = database_url();
    let fence = PgFence::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to PostgreSQL at {url}: {e}. Run `localstack/up` first."))
        .with_schema(schema);
    fence.migrate().await.expect("migrate");
    fence
}

/// Drops the test's schema (best effort).
pub async fn drop_schema(fence: &PgFence) {
    let s = fence.schema().as_str();
    let _ = sqlx::query(AssertSqlSafe(format!("DROP SCHEMA IF EXISTS {s} CASCADE"))).execute(fence.pool()).await;
}

/// A job row.
pub async fn job(fence: &PgFence, queue: &QueueName, key: &str) -> Option<JobRecord> {
    fence.job(queue, &JobKey::new(key).expect("key")).await.expect("read job")
}

/// Every job row of the schema: (key, state, epoch, owner, result).
pub async fn jobs(fence: &PgFence) -> Vec<(String, String, i64, Option<String>, Option<Vec<u8>>)> {
    let s = fence.schema().as_str();
    sqlx::query_as(AssertSqlSafe(format!("SELECT key, state, epoch, owner, result FROM {s}.jobs ORDER BY key")))
        .fetch_all(fence.pool())
        .await
        .expect("read jobs")
}

// ---------------------------------------------------------------- queues

/// A queue made for one test; delete it with [`TestQueue::delete`].
#[derive(Debug, Clone)]
pub struct TestQueue {
    pub url: String,
    pub name: String,
    pub dlq: Option<String>,
}

impl TestQueue {
    /// Standard queue with a visibility timeout.
    pub async fn new(client: &Client, prefix: &str, visibility: u32) -> Self {
        Self::create(client, prefix, visibility, None, false).await
    }

    /// Standard queue with a dead-letter queue after `max_receives`.
    pub async fn with_dlq(client: &Client, prefix: &str, visibility: u32, max_receives: u32) -> Self {
        Self::create(client, prefix, visibility, Some(max_receives), false).await
    }

    /// FIFO queue (explicit deduplication ids).
    pub async fn fifo(client: &Client, prefix: &str, visibility: u32) -> Self {
        Self::create(client, prefix, visibility, None, true).await
    }

    async fn create(client: &Client, prefix: &str, visibility: u32, max_receives: Option<u32>, fifo: bool) -> Self {
        let name = unique(&format!("t-{prefix}"));
        let full = if fifo { format!("{name}.fifo") } else { name.clone() };
        let mut dlq = None;
        let mut req = client
            .create_queue()
            .queue_name(&full)
            .attributes(QueueAttributeName::VisibilityTimeout, visibility.to_string());
        if fifo {
            req = req.attributes(QueueAttributeName::FifoQueue, "true");
        }
        if let Some(max) = max_receives {
            let dlq_url = client
                .create_queue()
                .queue_name(format!("{name}-dlq"))
                .send()
                .await
                .expect("create DLQ")
                .queue_url()
                .expect("DLQ url")
                .to_owned();
            let arn = client
                .get_queue_attributes()
                .queue_url(&dlq_url)
                .attribute_names(QueueAttributeName::QueueArn)
                .send()
                .await
                .expect("DLQ arn")
                .attributes()
                .and_then(|a| a.get(&QueueAttributeName::QueueArn).cloned())
                .expect("QueueArn");
            req = req.attributes(
                QueueAttributeName::RedrivePolicy,
                format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"{max}"}}"#),
            );
            dlq = Some(dlq_url);
        }
        let url = req.send().await.expect("create queue").queue_url().expect("queue url").to_owned();
        Self { url, name: full, dlq }
    }

    /// The fence queue name of this queue.
    pub fn fence_queue(&self) -> QueueName {
        QueueName::new(self.name.clone()).expect("queue name")
    }

    /// Deletes the queue and its DLQ (best effort).
    pub async fn delete(&self, client: &Client) {
        let _ = client.delete_queue().queue_url(&self.url).send().await;
        if let Some(d) = &self.dlq {
            let _ = client.delete_queue().queue_url(d).send().await;
        }
    }
}

/// Sends one message; returns its MessageId.
pub async fn send(client: &Client, url: &str, body: &str) -> String {
    client
        .send_message()
        .queue_url(url)
        .message_body(body)
        .send()
        .await
        .expect("send")
        .message_id()
        .expect("id")
        .to_owned()
}

/// Visible + in-flight (+ delayed) messages of a queue.
pub async fn depth(client: &Client, url: &str) -> u64 {
    let out = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
        .send()
        .await
        .expect("queue attributes");
    out.attributes().map(|a| a.values().filter_map(|v| v.parse::<u64>().ok()).sum()).unwrap_or(0)
}

/// Receives (and deletes) every message of a queue within `wait`, with all attributes.
pub async fn drain(client: &Client, url: &str, expect: usize, wait: Duration) -> Vec<Message> {
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + wait;
    while out.len() < expect && tokio::time::Instant::now() < deadline {
        let got = receive_raw(client, url, 1).await;
        for m in &got {
            if let Some(h) = m.receipt_handle() {
                let _ = client.delete_message().queue_url(url).receipt_handle(h).send().await;
            }
        }
        out.extend(got);
    }
    out
}

/// One plain receive (up to 10, all attributes), without deleting.
pub async fn receive_raw(client: &Client, url: &str, wait_secs: i32) -> Vec<Message> {
    client
        .receive_message()
        .queue_url(url)
        .max_number_of_messages(10)
        .wait_time_seconds(wait_secs)
        .message_attribute_names("All")
        .message_system_attribute_names(MessageSystemAttributeName::All)
        .send()
        .await
        .expect("receive")
        .messages
        .unwrap_or_default()
}

/// Polls `cond` every 50 ms until it holds or `within` passes.
pub async fn eventually<F, Fut>(within: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + within;
    loop {
        if cond().await {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "timed out after {within:?} waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---------------------------------------------------------------- the receiver

/// One call the receiver saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub job: String,
    pub epoch: i64,
    pub owner: Option<String>,
    /// Accepted (applied) or refused as stale.
    pub accepted: bool,
}

#[derive(Default)]
struct ReceiverState {
    /// Calls in the order the ledger judged them.
    calls: Vec<Call>,
    /// Arrivals (before judging), in order: (job, epoch).
    arrivals: Vec<(String, i64)>,
    /// The effect per job: the newest accepted (epoch, owner, body).
    effects: HashMap<String, (i64, Option<String>, Vec<u8>)>,
    /// How many times an effect was applied per job.
    applied: HashMap<String, usize>,
}

/// A downstream HTTP service that enforces the epoch with the fence's ledger (newest wins, equal
/// = retry) and records what it saw. It can park calls of one epoch until a newer epoch of the
/// same job was judged, to fix the order in which calls reach the ledger.
#[derive(Clone)]
pub struct Receiver {
    pub url: String,
    state: Arc<Mutex<ReceiverState>>,
    changed: Arc<Notify>,
    park_epoch: Arc<Mutex<Option<i64>>>,
}

struct App {
    ledger: Ledger,
    state: Arc<Mutex<ReceiverState>>,
    changed: Arc<Notify>,
    park_epoch: Arc<Mutex<Option<i64>>>,
    judged: watch::Sender<i64>,
}

impl Receiver {
    /// Starts the receiver on 127.0.0.1 (a random port), its ledger in `fence`'s schema.
    pub async fn start(fence: &PgFence) -> Self {
        let state = Arc::new(Mutex::new(ReceiverState::default()));
        let changed = Arc::new(Notify::new());
        let park_epoch = Arc::new(Mutex::new(None));
        let (judged, _) = watch::channel(0i64);
        let app = Arc::new(App {
            ledger: Ledger::Pg(PgLedger::new(fence, "receiver")),
            state: Arc::clone(&state),
            changed: Arc::clone(&changed),
            park_epoch: Arc::clone(&park_epoch),
            judged,
        });
        let router = axum::Router::new().route("/apply", post(apply)).with_state(app);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind receiver");
        let addr = listener.local_addr().expect("receiver addr");
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        Self { url: format!("http://{addr}/apply"), state, changed, park_epoch }
    }

    /// Calls carrying `epoch` wait until a newer epoch of any job has been judged.
    pub fn park(&self, epoch: i64) {
        if let Ok(mut p) = self.park_epoch.lock() {
            *p = Some(epoch);
        }
    }

    pub fn calls(&self) -> Vec<Call> {
        self.state.lock().map(|s| s.calls.clone()).unwrap_or_default()
    }

    pub fn arrivals(&self) -> Vec<(String, i64)> {
        self.state.lock().map(|s| s.arrivals.clone()).unwrap_or_default()
    }

    /// The effect kept for a job: (epoch, owner).
    pub fn effect(&self, job: &str) -> Option<(i64, Option<String>)> {
        self.state.lock().ok()?.effects.get(job).map(|(e, o, _)| (*e, o.clone()))
    }

    /// How many times an effect was applied for a job.
    pub fn applied(&self, job: &str) -> usize {
        self.state.lock().ok().and_then(|s| s.applied.get(job).copied()).unwrap_or(0)
    }

    pub fn effects_len(&self) -> usize {
        self.state.lock().map(|s| s.effects.len()).unwrap_or(0)
    }

    /// Waits until `cond` holds on the receiver's state.
    pub async fn wait_for(&self, within: Duration, what: &str, cond: impl Fn(&[Call], &[(String, i64)]) -> bool) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = self.changed.notified();
            if let Ok(s) = self.state.lock()
                && cond(&s.calls, &s.arrivals)
            {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!("receiver: timed out after {within:?} waiting for {what}; calls: {:?}", self.calls());
            }
        }
    }

    /// The ledger job name of a stamp for (queue, key).
    pub fn job_name(queue: &str, key: &str) -> String {
        FenceStamp::new(queue, key, 1).ledger_job()
    }
}

async fn apply(State(app): State<Arc<App>>, headers: HeaderMap, body: axum::body::Bytes) -> (StatusCode, String) {
    let pairs = headers.iter().filter_map(|(k, v)| v.to_str().ok().map(|v| (k.as_str().to_owned(), v.to_owned())));
    let stamp = match FenceStamp::from_headers(pairs) {
        Ok(s) => s,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_json()),
    };
    let job = stamp.ledger_job();
    if let Ok(mut s) = app.state.lock() {
        s.arrivals.push((job.clone(), stamp.epoch));
    }
    app.changed.notify_waiters();
    let park = app.park_epoch.lock().ok().and_then(|p| *p);
    if park == Some(stamp.epoch) {
        let mut rx = app.judged.subscribe();
        let _ = tokio::time::timeout(Duration::from_secs(60), rx.wait_for(|newest| *newest > stamp.epoch)).await;
    }
    let verdict = match stamp.accept(&app.ledger).await {
        Ok(v) => v,
        Err(e) => return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    let accepted = verdict.is_accepted();
    if let Ok(mut s) = app.state.lock() {
        s.calls.push(Call { job: job.clone(), epoch: stamp.epoch, owner: stamp.owner.clone(), accepted });
        if accepted {
            s.effects.insert(job.clone(), (stamp.epoch, stamp.owner.clone(), body.to_vec()));
            *s.applied.entry(job.clone()).or_default() += 1;
        }
    }
    app.judged.send_modify(|newest| *newest = (*newest).max(stamp.epoch));
    app.changed.notify_waiters();
    match verdict {
        Verdict::Accepted { .. } => (StatusCode::OK, "applied".into()),
        Verdict::Stale { newest } => (StatusCode::CONFLICT, brokerfence::fence::wire::stale_epoch_json(&stamp, newest)),
    }
}

/// The handler the in-process workers of the tests run: calls the receiver with the stamp and
/// commits "owner@epoch" (the same behaviour as `examples/sqs_worker.rs`).
pub fn calling_handler(receiver_url: String) -> impl brokerfence::adapters::Handler {
    let http = reqwest::Client::new();
    move |ctx: brokerfence::fence::JobContext| {
        let http = http.clone();
        let url = receiver_url.clone();
        async move {
            let mut req = http.post(&url).body(ctx.payload().to_vec());
            for (k, v) in FenceStamp::of_lease(ctx.lease()).to_headers() {
                req = req.header(k, v);
            }
            let resp = req.send().await.map_err(brokerfence::fence::JobError::retry)?;
            if !resp.status().is_success() {
                return Err(brokerfence::fence::JobError::retry(format!("receiver answered {}", resp.status())));
            }
            Ok(format!("{}@{}", ctx.owner(), ctx.epoch()).into_bytes())
        }
    }
}

// ---------------------------------------------------------------- worker processes

/// The newest modification time of the sources the example binaries are built from.
fn newest_source() -> Option<std::time::SystemTime> {
    fn walk(dir: &std::path::Path, newest: &mut Option<std::time::SystemTime>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            let path = e.path();
            if path.is_dir() {
                walk(&path, newest);
            } else if path.extension().is_some_and(|x| x == "rs")
                && let Ok(m) = e.metadata().and_then(|m| m.modified())
            {
                *newest = Some(newest.map_or(m, |n| n.max(m)));
            }
        }
    }
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut newest = None;
    for dir in ["src", "fence/src", "adapters/src", "examples/support"] {
        walk(&root.join(dir), &mut newest);
    }
    for file in ["examples/sqs_worker.rs", "examples/sqs_produce.rs", "examples/support/cli.rs"] {
        if let Ok(m) = std::fs::metadata(root.join(file)).and_then(|m| m.modified()) {
            newest = Some(newest.map_or(m, |n: std::time::SystemTime| n.max(m)));
        }
    }
    newest
}

/// The examples' binaries, next to this test binary's directory (`target/<profile>/examples`):
/// `cargo test` builds them. When they are missing, older than their sources, or built without the
/// `guard-switches` feature this test binary has (`cargo test --test sqs_e2e` builds no
/// examples), they are built here once, with this test binary's features.
pub fn example(name: &str) -> PathBuf {
    static BUILT: OnceLock<Result<(), String>> = OnceLock::new();
    let exe = std::env::current_exe().expect("current exe");
    let profile_dir = exe.parent().and_then(|d| d.parent()).expect("target/<profile>").to_path_buf();
    let path = profile_dir.join("examples").join(name);
    let worker = profile_dir.join("examples").join("sqs_worker");
    let sources = newest_source();
    let fresh = |p: &PathBuf| {
        let built = std::fs::metadata(p).and_then(|m| m.modified()).ok();
        matches!((built, sources), (Some(b), Some(s)) if b >= s)
    };
    let same_features = || {
        // Tests and examples always have the members' `guard-switches` (root dev-dependencies).
        let want = "guard-switches=true";
        std::process::Command::new(&worker)
            .arg("--build-info")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(want))
    };
    if !(fresh(&path) && fresh(&worker) && same_features()) {
        let built = BUILT.get_or_init(|| {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            // The same features as this test binary, so the workers match it.
            let mut features = vec!["sqs"];
            for (on, f) in
                [(cfg!(feature = "redis"), "redis"), (cfg!(feature = "http"), "http"), (cfg!(feature = "tls"), "tls")]
            {
                if on {
                    features.push(f);
                }
            }
            let mut cmd = std::process::Command::new(cargo);
            cmd.current_dir(env!("CARGO_MANIFEST_DIR")).args(["build", "--features", &features.join(",")]);
            cmd.args(["--example", "sqs_worker", "--example", "sqs_produce"]);
            if profile_dir.file_name().is_some_and(|n| n == "release") {
                cmd.arg("--release");
            }
            match cmd.status() {
                Ok(s) if s.success() => Ok(()),
                Ok(s) => Err(format!("cargo build of the examples exited with {s}")),
                Err(e) => Err(format!("cannot run cargo: {e}")),
            }
        });
        if let Err(e) = built {
            panic!("{e}; build them first: cargo build --features sqs --examples");
        }
    }
    assert!(path.exists(), "{} missing: cargo build --features sqs --examples", path.display());
    path
}

/// One `EVENT name k=v …` line.
#[derive(Debug, Clone)]
pub struct Event {
    pub name: String,
    pub fields: HashMap<String, String>,
    pub line: String,
}

impl Event {
    fn parse(line: &str) -> Option<Self> {
        let rest = line.strip_prefix("EVENT ")?;
        let mut parts = rest.split_whitespace();
        let name = parts.next()?.to_owned();
        let fields = parts.filter_map(|p| p.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
        Some(Self { name, fields, line: line.to_owned() })
    }

    pub fn get(&self, k: &str) -> Option<&str> {
        self.fields.get(k).map(String::as_str)
    }

    pub fn num(&self, k: &str) -> u64 {
        self.get(k).and_then(|v| v.parse().ok()).unwrap_or(0)
    }
}

/// A worker process (examples/sqs_worker) and the events it printed.
pub struct Worker {
    pub child: tokio::process::Child,
    pub pid: i32,
    pub name: String,
    events: Arc<Mutex<Vec<Event>>>,
    changed: Arc<Notify>,
    /// The task reading stdout; it ends at end-of-file.
    reader: Option<tokio::task::JoinHandle<()>>,
}

impl Worker {
    /// Starts `sqs_worker` with `args` (queue URL, schema etc. are the caller's).
    pub fn spawn(name: &str, args: &[String]) -> Self {
        let aws = aws();
        let mut cmd = tokio::process::Command::new(example("sqs_worker"));
        cmd.args(args)
            .envs(aws.child_env())
            .env("RUST_LOG", std::env::var("WORKER_LOG").unwrap_or_else(|_| "warn".into()))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = cmd.spawn().expect("spawn sqs_worker");
        let pid = i32::try_from(child.id().expect("pid")).expect("pid fits");
        let events = Arc::new(Mutex::new(Vec::new()));
        let changed = Arc::new(Notify::new());
        let stdout = child.stdout.take().expect("stdout");
        let (ev, ch, tag) = (Arc::clone(&events), Arc::clone(&changed), name.to_owned());
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("[{tag}] {line}");
                if let Some(e) = Event::parse(&line)
                    && let Ok(mut v) = ev.lock()
                {
                    v.push(e);
                }
                ch.notify_waiters();
            }
            ch.notify_waiters();
        });
        Self { child, pid, name: name.to_owned(), events, changed, reader: Some(reader) }
    }

    pub fn events(&self) -> Vec<Event> {
        self.events.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// The newest `metrics` event (all zero if none yet).
    pub fn metrics(&self) -> Event {
        self.events().into_iter().rev().find(|e| e.name == "metrics" || e.name == "stopped").unwrap_or(Event {
            name: "metrics".into(),
            fields: HashMap::new(),
            line: String::new(),
        })
    }

    /// Waits for an event matching `pred`.
    pub async fn wait_event(&self, within: Duration, what: &str, pred: impl Fn(&Event) -> bool) -> Event {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = self.changed.notified();
            if let Some(e) = self.events().into_iter().find(|e| pred(e)) {
                return e;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!(
                    "worker {}: timed out after {within:?} waiting for {what}; events: {:#?}",
                    self.name,
                    self.events()
                );
            }
        }
    }

    pub fn signal(&self, sig: i32) {
        // SAFETY: sending a signal to our own child process.
        let rc = unsafe { libc::kill(self.pid, sig) };
        assert_eq!(rc, 0, "kill({}, {sig}) failed", self.pid);
    }

    /// Waits for the process to exit and its output to be read to the end; returns its status.
    pub async fn wait_exit(&mut self, within: Duration) -> std::process::ExitStatus {
        let status = match tokio::time::timeout(within, self.child.wait()).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => panic!("wait for {}: {e}", self.name),
            Err(_) => panic!("worker {} did not exit within {within:?}", self.name),
        };
        // Its last lines (the final counters) may still be in the pipe.
        if let Some(reader) = self.reader.take() {
            assert!(
                tokio::time::timeout(within, reader).await.is_ok(),
                "worker {}: output not read to its end",
                self.name
            );
        }
        status
    }
}

/// Standard arguments of a worker on `queue` with the fence in `fence`'s schema.
pub fn worker_args(queue: &TestQueue, fence: &PgFence, owner: &str, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = vec![
        "--queue-url".into(),
        queue.url.clone(),
        "--schema".into(),
        fence.schema().as_str().to_owned(),
        "--owner".into(),
        owner.to_owned(),
        "--wait".into(),
        "1".into(),
    ];
    v.extend(extra.iter().map(|s| (*s).to_owned()));
    v
}

/// Tracing to the test output (once per binary); `RUST_LOG` to tune.
pub fn init_tracing() {
    static INIT: OnceLock<()> = OnceLock::new();
    INIT.get_or_init(|| {
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
            .try_init();
    });
}

/// A store handle as the runtime wants it.
pub fn dyn_store(fence: &PgFence) -> Arc<dyn FenceStore> {
    Arc::new(fence.clone())
}

// ---------------------------------------------------------------- an HTTP proxy in front of SQS

/// What an [`SqsProxy`] saw, in the order it saw it (shared by several proxies, so the order
/// across workers is the order the requests and answers passed through).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ProxyEvent {
    /// A `ReceiveMessage` answer handed this receipt handle for this message to the worker `tag`.
    Received { tag: String, message_id: String, handle: String },
    /// The worker `tag` sent `op` (the `X-Amz-Target` operation) with these receipt handles.
    Used { tag: String, op: String, handles: Vec<String> },
    /// A request or answer the proxy could not read as JSON (the check would be blind to it).
    Unreadable { tag: String, op: String, what: String },
}

/// The shared, ordered log of one or more proxies.
pub type ProxyLog = Arc<Mutex<Vec<ProxyEvent>>>;

/// A TCP proxy on 127.0.0.1 in front of the SQS endpoint that reads each HTTP/1.1 exchange:
/// it records which receipt handles every `ReceiveMessage` answer handed out and which handles
/// every other call used (the SDK speaks the JSON protocol). [`SqsProxy::stall`] makes it stop
/// forwarding: requests are read and then held, their connections left open (a hung broker).
#[derive(Clone)]
pub struct SqsProxy {
    /// `http://127.0.0.1:<port>`: the endpoint to give a client.
    pub endpoint: String,
    stalled: Arc<std::sync::atomic::AtomicBool>,
    log: ProxyLog,
}

impl SqsProxy {
    /// Starts a proxy for the worker `tag`, logging into `log`.
    pub async fn start(tag: &str, log: ProxyLog) -> Self {
        let upstream = aws().endpoint.split("://").nth(1).unwrap_or("127.0.0.1:4566").trim_end_matches('/').to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let stalled = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (s, l, tag) = (Arc::clone(&stalled), Arc::clone(&log), tag.to_owned());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (s, l, tag, upstream) = (Arc::clone(&s), Arc::clone(&l), tag.clone(), upstream.clone());
                tokio::spawn(async move {
                    let _ = proxy_connection(client, &upstream, &tag, &s, &l).await;
                });
            }
        });
        Self { endpoint: format!("http://{addr}"), stalled, log }
    }

    /// Stops (true) or resumes (false) forwarding.
    pub fn stall(&self, on: bool) {
        self.stalled.store(on, std::sync::atomic::Ordering::SeqCst);
    }

    /// The shared log.
    pub fn log(&self) -> Vec<ProxyEvent> {
        self.log.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// An SQS client through this proxy, configured as a user who brings their own client
    /// would (no timeouts set).
    pub async fn client(&self) -> Client {
        let aws = aws();
        let sdk = aws_config::defaults(BehaviorVersion::latest())
            .http_client(http_client())
            .endpoint_url(&self.endpoint)
            .region(Region::new(aws.region.clone()))
            .credentials_provider(Credentials::new(aws.key_id.clone(), aws.secret.clone(), None, None, "sqs-tests"))
            .load()
            .await;
        Client::new(&sdk)
    }

    /// The loader [`client`](Self::client) uses, for clients with settings of their own.
    pub fn loader(&self) -> aws_config::ConfigLoader {
        let aws = aws();
        aws_config::defaults(BehaviorVersion::latest())
            .endpoint_url(&self.endpoint)
            .region(Region::new(aws.region.clone()))
            .credentials_provider(Credentials::new(aws.key_id.clone(), aws.secret.clone(), None, None, "sqs-tests"))
    }
}

/// One HTTP/1.1 message read off a stream: the head (as sent) and the body (de-chunked), plus
/// the raw bytes to forward.
struct HttpMessage {
    head: String,
    body: Vec<u8>,
    raw: Vec<u8>,
}

impl HttpMessage {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }
}

async fn read_http<R: tokio::io::AsyncRead + Unpin>(r: &mut BufReader<R>) -> std::io::Result<Option<HttpMessage>> {
    use tokio::io::AsyncReadExt;
    let mut raw = Vec::new();
    let mut head = String::new();
    loop {
        let mut line = String::new();
        let n = r.read_line(&mut line).await?;
        if n == 0 {
            return Ok(None);
        }
        raw.extend_from_slice(line.as_bytes());
        head.push_str(&line);
        if line == "\r\n" || line == "\n" {
            break;
        }
    }
    let mut msg = HttpMessage { head, body: Vec::new(), raw };
    if msg.header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked")) {
        loop {
            let mut size = String::new();
            r.read_line(&mut size).await?;
            msg.raw.extend_from_slice(size.as_bytes());
            let n = usize::from_str_radix(size.trim().split(';').next().unwrap_or("0"), 16).unwrap_or(0);
            let mut chunk = vec![0u8; n + 2];
            r.read_exact(&mut chunk).await?;
            msg.raw.extend_from_slice(&chunk);
            msg.body.extend_from_slice(&chunk[..n]);
            if n == 0 {
                break;
            }
        }
    } else if let Some(len) = msg.header("content-length").and_then(|v| v.parse::<usize>().ok()) {
        let mut body = vec![0u8; len];
        r.read_exact(&mut body).await?;
        msg.raw.extend_from_slice(&body);
        msg.body = body;
    }
    Ok(Some(msg))
}

fn handles_in(v: &serde_json::Value) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(h) = v.get("ReceiptHandle").and_then(|h| h.as_str()) {
        out.push(h.to_owned());
    }
    if let Some(entries) = v.get("Entries").and_then(|e| e.as_array()) {
        out.extend(entries.iter().filter_map(|e| e.get("ReceiptHandle").and_then(|h| h.as_str()).map(str::to_owned)));
    }
    out
}

async fn proxy_connection(
    client: tokio::net::TcpStream,
    upstream: &str,
    tag: &str,
    stalled: &std::sync::atomic::AtomicBool,
    log: &Mutex<Vec<ProxyEvent>>,
) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt;
    let up = tokio::net::TcpStream::connect(upstream).await?;
    let (cr, mut cw) = client.into_split();
    let (ur, mut uw) = up.into_split();
    let (mut cr, mut ur) = (BufReader::new(cr), BufReader::new(ur));
    let push = |e: ProxyEvent| {
        if let Ok(mut l) = log.lock() {
            l.push(e);
        }
    };
    while let Some(req) = read_http(&mut cr).await? {
        // A stalled broker: the request was read, nothing is forwarded, the connection stays open.
        while stalled.load(std::sync::atomic::Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let op = req.header("x-amz-target").unwrap_or("?").rsplit('.').next().unwrap_or("?").to_owned();
        if op != "ReceiveMessage" {
            match serde_json::from_slice::<serde_json::Value>(&req.body) {
                Ok(v) => {
                    let handles = handles_in(&v);
                    if !handles.is_empty() {
                        push(ProxyEvent::Used { tag: tag.to_owned(), op: op.clone(), handles });
                    }
                }
                Err(e) if !req.body.is_empty() => {
                    push(ProxyEvent::Unreadable { tag: tag.to_owned(), op: op.clone(), what: e.to_string() })
                }
                Err(_) => {}
            }
        }
        uw.write_all(&req.raw).await?;
        let Some(resp) = read_http(&mut ur).await? else { return Ok(()) };
        if op == "ReceiveMessage" {
            match serde_json::from_slice::<serde_json::Value>(&resp.body) {
                Ok(v) => {
                    for m in v.get("Messages").and_then(|m| m.as_array()).into_iter().flatten() {
                        if let (Some(id), Some(h)) = (
                            m.get("MessageId").and_then(|x| x.as_str()),
                            m.get("ReceiptHandle").and_then(|x| x.as_str()),
                        ) {
                            push(ProxyEvent::Received {
                                tag: tag.to_owned(),
                                message_id: id.to_owned(),
                                handle: h.to_owned(),
                            });
                        }
                    }
                }
                Err(e) => push(ProxyEvent::Unreadable { tag: tag.to_owned(), op: op.clone(), what: e.to_string() }),
            }
        }
        cw.write_all(&resp.raw).await?;
    }
    Ok(())
}

/// Uses of a receipt handle older than another worker's receive of the same message, as a proxy
/// between the workers and SQS sees them: `(tag, op, message id)` for each.
pub fn stale_handle_uses(log: &[ProxyEvent]) -> Vec<(String, String, String)> {
    // handle -> (message id, index of the receive that handed it out)
    let mut handed: HashMap<String, (String, usize)> = HashMap::new();
    // message id -> receives so far: (index, tag)
    let mut receives: HashMap<String, Vec<(usize, String)>> = HashMap::new();
    let mut stale = Vec::new();
    for (i, e) in log.iter().enumerate() {
        match e {
            ProxyEvent::Received { tag, message_id, handle } => {
                handed.insert(handle.clone(), (message_id.clone(), i));
                receives.entry(message_id.clone()).or_default().push((i, tag.clone()));
            }
            ProxyEvent::Used { tag, op, handles } => {
                for h in handles {
                    let Some((mid, at)) = handed.get(h) else { continue };
                    let newer_elsewhere =
                        receives.get(mid).is_some_and(|r| r.iter().any(|(j, other)| *j > *at && other != tag));
                    if newer_elsewhere {
                        stale.push((tag.clone(), op.clone(), mid.clone()));
                    }
                }
            }
            ProxyEvent::Unreadable { .. } => {}
        }
    }
    stale
}
