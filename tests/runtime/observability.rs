//! Issue #16, metrics: the fence's counters and latency histograms published through the
//! `metrics` façade (feature `metrics`), checked against what a run did.
//!
//! - a `table_worker` process with `--metrics-addr 127.0.0.1:0`, scraped over HTTP (Prometheus
//!   text) after it ran the jobs `table_produce` enqueued: names, types, labels and values;
//! - the middleware in process, under `metrics-util`'s debugging recorder;
//! - a supervisor whose lease is taken over: the lease-loss → cancellation histogram.
//!
//! Real PostgreSQL (a fresh schema per test) and SQLite files. Run them with
//! `cargo test --workspace --all-features ergonomics`.
#![cfg(feature = "metrics")]

#[cfg(feature = "sqs")]
use brokerfence_testkit::sqs as sqs_support;
use brokerfence_testkit::store as common;

use std::collections::BTreeMap;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use brokerfence::Retrofit;
use brokerfence::{
    Claim, FenceStore, JobContext, JobKey, LeaseDuration, LossReason, Metrics, Outcome, Owner, QueueName, Supervisor,
    SupervisorConfig,
};
use brokerfence_testkit::process::built_example;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tokio::io::{AsyncBufReadExt, BufReader};

// ------------------------------------------------------------------------------ a worker process

/// A running example whose stdout lines are collected (stderr is inherited: the test's output).
struct Proc {
    child: tokio::process::Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    fn spawn(name: &str, args: &[&str]) -> Proc {
        Proc::spawn_with(name, args, &[])
    }

    /// [`spawn`](Self::spawn) with more environment variables.
    fn spawn_with(name: &str, args: &[&str], env: &[(&str, String)]) -> Proc {
        let mut child = tokio::process::Command::new(built_example(name))
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("NO_COLOR", "1")
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        let stdout = child.stdout.take().expect("stdout");
        let lines: Arc<Mutex<Vec<String>>> = Arc::default();
        let l = Arc::clone(&lines);
        tokio::spawn(async move {
            let mut it = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = it.next_line().await {
                l.lock().expect("lines").push(line);
            }
        });
        Proc { child, lines }
    }

    fn events(&self, name: &str) -> Vec<String> {
        let prefix = format!("EVENT {name} ");
        self.lines.lock().expect("lines").iter().filter(|l| l.starts_with(&prefix)).cloned().collect()
    }

    /// Waits (polling) until `pred` holds; panics with the output after `within`.
    async fn wait(&self, within: Duration, what: &str, pred: impl Fn(&Proc) -> bool) {
        let deadline = tokio::time::Instant::now() + within;
        while !pred(self) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "no {what} within {within:?}; stdout: {:#?}",
                self.lines.lock().expect("lines")
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn stop(mut self) -> i32 {
        let pid = i32::try_from(self.child.id().expect("pid")).expect("pid fits");
        // SAFETY: a signal to the child process this test started, by its pid.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
            .await
            .expect("stopped within 30 s of SIGTERM")
            .expect("wait");
        status.code().unwrap_or(-1)
    }
}

/// The value of `field` in an `EVENT` line (unquoted values only).
fn field<'a>(line: &'a str, field: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|kv| kv.strip_prefix(field)?.strip_prefix('='))
}

// ------------------------------------------------------------------------- the Prometheus text

/// One sample of a scrape: name, labels, value.
#[derive(Debug)]
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
    value: f64,
}

/// A scrape: the `# TYPE` of each family, and the samples.
#[derive(Debug, Default)]
struct Scrape {
    types: BTreeMap<String, String>,
    samples: Vec<Sample>,
    text: String,
}

impl Scrape {
    /// Parses the text format (label values here hold no `,` `"` or `\`).
    fn parse(text: &str) -> Scrape {
        let mut scrape = Scrape { text: text.to_owned(), ..Scrape::default() };
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').expect("TYPE line");
                scrape.types.insert(name.to_owned(), kind.to_owned());
                continue;
            }
            if line.starts_with('#') {
                continue;
            }
            let (series, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("sample line {line:?}"));
            let value: f64 = value.parse().unwrap_or_else(|e| panic!("value of {line:?}: {e}"));
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => {
                    let inner = rest.strip_suffix('}').expect("closing brace");
                    let labels = inner
                        .split(',')
                        .filter(|kv| !kv.is_empty())
                        .map(|kv| {
                            let (k, v) = kv.split_once('=').expect("label k=v");
                            (k.to_owned(), v.trim_matches('"').to_owned())
                        })
                        .collect();
                    (name.to_owned(), labels)
                }
                None => (series.to_owned(), BTreeMap::new()),
            };
            scrape.samples.push(Sample { name, labels, value });
        }
        scrape
    }

    /// The one sample of `name` whose labels include `with`.
    fn value(&self, name: &str, with: &[(&str, &str)]) -> f64 {
        let found: Vec<&Sample> = self
            .samples
            .iter()
            .filter(|s| s.name == name && with.iter().all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v)))
            .collect();
        assert_eq!(found.len(), 1, "one sample {name} {with:?} expected, found {found:?} in:\n{}", self.text);
        found[0].value
    }
}

async fn scrape(url: &str) -> Scrape {
    let response = reqwest::get(url).await.unwrap_or_else(|e| panic!("GET {url}: {e}"));
    assert!(response.status().is_success(), "GET {url}: {}", response.status());
    let content_type = response.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    assert!(content_type.starts_with("text/plain"), "content type {content_type:?}");
    Scrape::parse(&response.text().await.expect("body"))
}

/// Jobs each scrape test runs, and the handler's delay (so heartbeats happen under a 3 s lease:
/// 12 jobs, 4 at a time, 1.2 s each).
const N: usize = 12;
const DELAY_MS: u64 = 1200;

/// The worker flags of the scrape tests: 4 at a time, the delay, a 3 s lease, a free port.
fn worker_flags(delay: &str) -> Vec<&str> {
    vec!["--lease", "3", "--concurrency", "4", "--handler-delay", delay, "--metrics-addr", "127.0.0.1:0"]
}

/// The metrics URL of `EVENT metrics_endpoint` (checked: the bound port, not 0).
async fn endpoint(worker: &Proc) -> String {
    worker.wait(Duration::from_secs(30), "metrics_endpoint", |p| !p.events("metrics_endpoint").is_empty()).await;
    let line = worker.events("metrics_endpoint").remove(0);
    let addr = field(&line, "addr").expect("addr").to_owned();
    assert!(addr.starts_with("127.0.0.1:") && !addr.ends_with(":0"), "bound address printed: {line}");
    let url = field(&line, "url").expect("url").to_owned();
    assert_eq!(url, format!("http://{addr}/metrics"));
    url
}

/// Waits for `N` acks, then scrapes until the exported counters equal the worker's last
/// `EVENT metrics` line (the last ack is counted just after its `acked` line) and every
/// statement counted is timed (a statement still out is counted, not yet timed), and checks the
/// scrape against the run: claims and completions equal the jobs; the handler histogram counts
/// each job once and its sum is at least the jobs times the handler's delay; the commit and
/// claim histograms count one value per statement and their jobs add up to the jobs; every
/// heartbeat was timed; the in-flight gauge is back to 0; every series carries `queue` and
/// `source`; the types are counter / histogram / gauge.
async fn check_scrape(worker: &Proc, url: &str, queue: &str, source: &str) -> Scrape {
    worker.wait(Duration::from_secs(60), "all jobs acked", |p| p.events("acked").len() >= N).await;
    let l = [("queue", queue), ("source", source)];
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let (s, line) = loop {
        let s = scrape(url).await;
        let line = worker.events("metrics").pop().expect("a metrics line");
        let fields: Vec<(&str, f64)> = line
            .trim_start_matches("EVENT metrics ")
            .split_whitespace()
            .map(|kv| {
                let (k, v) = kv.split_once('=').expect("k=v");
                (k, v.parse().expect("number"))
            })
            .collect();
        let same = fields.iter().all(|(k, v)| {
            let name = format!("brokerfence_{k}_total");
            s.samples
                .iter()
                .any(|x| x.name == name && x.labels.get("queue").map(String::as_str) == Some(queue) && x.value == *v)
        });
        // A statement is counted when sent and timed when answered (`heartbeats_total`: "sent"):
        // a heartbeat out when the last job left is counted in that line before its histogram
        // has it (the CI flake of stop 40: `heartbeat_duration_seconds_count` 4 against 5).
        let v = |name: &str| s.value(name, &l);
        let timed = v("brokerfence_heartbeat_duration_seconds_count") == v("brokerfence_heartbeats_total")
            && v("brokerfence_commit_duration_seconds_count") == v("brokerfence_commit_statements_total")
            && v("brokerfence_commit_statement_jobs_count") == v("brokerfence_commit_statements_total")
            && v("brokerfence_claim_duration_seconds_count") == v("brokerfence_claim_statement_jobs_count")
            // The runtime's group claims (brokers; a table queue claims in its receive and counts
            // none): a redelivery's claim still out after the last ack.
            && (source == "table"
                || v("brokerfence_claim_duration_seconds_count") == v("brokerfence_claim_statements_total"));
        if same && timed && v("brokerfence_acks_total") == N as f64 {
            break (s, line);
        }
        assert!(tokio::time::Instant::now() < deadline, "scrape never matched {line}:\n{}", s.text);
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    println!("{line}\n{}", s.text);

    let v = |name: &str| s.value(name, &l);
    let n = N as f64;
    // What the run did.
    assert_eq!(v("brokerfence_claims_total"), n);
    assert_eq!(v("brokerfence_completions_total"), n);
    assert_eq!(v("brokerfence_completions_total"), worker.events("committed").len() as f64);
    assert_eq!(v("brokerfence_lease_losses_total"), 0.0);
    assert_eq!(v("brokerfence_fenced_rejections_total"), 0.0);
    assert_eq!(v("brokerfence_in_flight"), 0.0, "nothing runs at the end");
    // Handlers: once per job, each at least the handler's delay.
    assert_eq!(v("brokerfence_handler_duration_seconds_count"), n);
    let handler_sum = v("brokerfence_handler_duration_seconds_sum");
    assert!(handler_sum >= n * DELAY_MS as f64 / 1000.0, "handler sum {handler_sum}");
    assert!(handler_sum < n * 30.0, "handler sum {handler_sum}");
    // Group commit: one value per statement, the jobs add up to the completions.
    let commits = v("brokerfence_commit_statements_total");
    assert!((1.0..=n).contains(&commits), "commit statements {commits}");
    assert_eq!(v("brokerfence_commit_duration_seconds_count"), commits);
    assert_eq!(v("brokerfence_commit_statement_jobs_count"), commits);
    assert_eq!(v("brokerfence_commit_statement_jobs_sum"), n);
    // Claims: one value per claim statement; the deliveries they carried add up to the claims
    // (N) and those refused as busy or duplicate (none, unless the broker redelivered one).
    let claim_statements = v("brokerfence_claim_statement_jobs_count");
    assert!(claim_statements >= 1.0, "claim statements {claim_statements}");
    let refused = v("brokerfence_busy_total") + v("brokerfence_duplicates_total");
    assert_eq!(v("brokerfence_claim_statement_jobs_sum"), n + refused);
    assert_eq!(v("brokerfence_claim_duration_seconds_count"), claim_statements);
    // Heartbeats (every second under a 3 s lease; the jobs took 3 × 1.2 s): each one timed.
    let heartbeats = v("brokerfence_heartbeats_total");
    assert!(heartbeats >= 1.0, "no heartbeat in a {} s run", 3.0 * DELAY_MS as f64 / 1000.0);
    assert_eq!(v("brokerfence_heartbeat_duration_seconds_count"), heartbeats);
    // Buckets: the +Inf bucket is the count.
    assert_eq!(s.value("brokerfence_handler_duration_seconds_bucket", &[("queue", queue), ("le", "+Inf")]), n);
    // Types.
    for (name, kind) in [
        ("brokerfence_claims_total", "counter"),
        ("brokerfence_hook_skips_total", "counter"),
        ("brokerfence_handler_duration_seconds", "histogram"),
        ("brokerfence_commit_statement_jobs", "histogram"),
        ("brokerfence_in_flight", "gauge"),
    ] {
        assert_eq!(s.types.get(name).map(String::as_str), Some(kind), "TYPE of {name}");
    }
    // Every series of ours carries the queue and source labels.
    for sample in s.samples.iter().filter(|x| x.name.starts_with("brokerfence_")) {
        assert_eq!(sample.labels.get("queue").map(String::as_str), Some(queue), "{sample:?}");
        assert_eq!(sample.labels.get("source").map(String::as_str), Some(source), "{sample:?}");
    }
    s
}

/// `table_worker --metrics-addr 127.0.0.1:0` runs the jobs `table_produce` enqueued; its scrape
/// matches the run ([`check_scrape`]). The table queue claims in its receive: no group-claim
/// statement is counted, each receive that claimed is one claim value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ergonomics_metrics_scrape_of_a_table_worker_matches_its_run() {
    let url = common::database_url();
    let fence = common::pg_unmigrated().await;
    let schema = fence.get_schema().as_str().to_owned();
    let queue = common::unique("metrics");
    let n = N.to_string();
    let produce = ["--database-url", &url, "--schema", &schema, "--queue", &queue, "--count", &n, "--migrate"];
    let out =
        tokio::process::Command::new(built_example("table_produce")).args(produce).output().await.expect("produce");
    assert!(out.status.success(), "table_produce: {}", String::from_utf8_lossy(&out.stderr));

    let delay = DELAY_MS.to_string();
    let mut args = vec!["--database-url", &url, "--schema", &schema, "--queue", &queue];
    args.extend(worker_flags(&delay));
    let worker = Proc::spawn("table_worker", &args);
    let metrics_url = endpoint(&worker).await;
    let s = check_scrape(&worker, &metrics_url, &queue, "table").await;
    assert_eq!(s.value("brokerfence_claim_statements_total", &[("queue", &queue)]), 0.0);
    assert_eq!(worker.stop().await, 0);
}

/// `redis_worker --metrics-addr 127.0.0.1:0` on a stream `redis_produce` fills: its scrape
/// matches the run ([`check_scrape`], `source="redis_stream"`), and the runtime's group claims
/// are each counted and timed once (`claim_statements_total` = the claim histograms' count).
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ergonomics_metrics_scrape_of_a_redis_worker_matches_its_run() {
    let url = common::database_url();
    let redis_url = brokerfence_testkit::services::var("REDIS_URL").unwrap_or_else(|| "redis://127.0.0.1:6379".into());
    let fence = common::pg().await;
    let schema = fence.get_schema().as_str().to_owned();
    let stream = common::unique("metrics-stream");
    let delay = DELAY_MS.to_string();
    let mut args = vec![
        "--stream",
        &stream,
        "--group",
        "g",
        "--database-url",
        &url,
        "--schema",
        &schema,
        "--redis-url",
        &redis_url,
        "--block",
        "200",
    ];
    args.extend(worker_flags(&delay));
    let worker = Proc::spawn("redis_worker", &args);
    let metrics_url = endpoint(&worker).await;
    worker.wait(Duration::from_secs(30), "ready", |p| !p.events("ready").is_empty()).await;
    let n = N.to_string();
    let out = tokio::process::Command::new(built_example("redis_produce"))
        .args(["--stream", &stream, "--count", &n, "--redis-url", &redis_url])
        .output()
        .await
        .expect("produce");
    assert!(out.status.success(), "redis_produce: {}", String::from_utf8_lossy(&out.stderr));
    let s = check_scrape(&worker, &metrics_url, &stream, "redis_stream").await;
    assert_eq!(
        s.value("brokerfence_claim_statements_total", &[("queue", &stream)]),
        s.value("brokerfence_claim_duration_seconds_count", &[("queue", &stream)])
    );
    assert_eq!(worker.stop().await, 0);
    use brokerfence::redis::client;
    if let Ok(c) = client::Client::open(redis_url.as_str())
        && let Ok(mut conn) = c.get_multiplexed_async_connection().await
    {
        let _: Result<i64, _> = client::cmd("DEL").arg(&stream).query_async(&mut conn).await;
    }
}

/// `--metrics-addr` with an address that cannot be bound (taken) fails at start, before
/// `ready`, with exit 1 and a message naming the address.
#[tokio::test]
async fn ergonomics_metrics_addr_that_cannot_bind_fails_at_start() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let out = tokio::process::Command::new(built_example("table_worker"))
        .args(["--queue", "q", "--database-url", &common::database_url(), "--metrics-addr", &addr])
        .env("NO_COLOR", "1")
        .output()
        .await
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert!(stderr.contains(&format!("cannot listen on --metrics-addr {addr}")), "{stderr}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("EVENT ready"));
}

/// `sqs_worker --metrics-addr 127.0.0.1:0` on a standard queue (LocalStack) with `N` messages:
/// its scrape matches the run ([`check_scrape`], `source="sqs"`, the queue label is the fence
/// queue, the SQS queue's name), and the runtime's group claims are each counted and timed once.
#[cfg(feature = "sqs")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ergonomics_metrics_scrape_of_an_sqs_worker_matches_its_run() {
    use sqs_support::{TestQueue, aws, drop_schema, pg, send, sqs, worker_args};
    let client = sqs().await;
    let fence = pg().await;
    let q = TestQueue::new(&client, "metrics", 5).await;
    for i in 0..N {
        send(&client, &q.url, &format!("message {i}")).await;
    }
    let delay = DELAY_MS.to_string();
    let args = worker_args(&q, &fence, &common::unique("metrics-sqs"), &worker_flags(&delay));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let worker = Proc::spawn_with("sqs_worker", &args, &aws().child_env());
    let metrics_url = endpoint(&worker).await;
    let queue = q.fence_queue();
    let s = check_scrape(&worker, &metrics_url, queue.as_str(), "sqs").await;
    assert_eq!(
        s.value("brokerfence_claim_statements_total", &[("queue", queue.as_str())]),
        s.value("brokerfence_claim_duration_seconds_count", &[("queue", queue.as_str())])
    );
    assert_eq!(worker.stop().await, 0);
    q.delete(&client).await;
    drop_schema(&fence).await;
}

// ------------------------------------------------------------------------------------ in process

/// Values per series name (labels must include `with`) from a debugging recorder's snapshot.
fn debug_values(recorder: &DebuggingRecorder, with: &[(&str, &str)]) -> BTreeMap<String, Vec<DebugValue>> {
    let mut out: BTreeMap<String, Vec<DebugValue>> = BTreeMap::new();
    for (key, _, _, value) in recorder.snapshotter().snapshot().into_vec() {
        let key = key.key();
        if with.iter().all(|(k, v)| key.labels().any(|l| l.key() == *k && l.value() == *v)) {
            let reason = key.labels().find(|l| l.key() == "reason").map(|l| format!("{{reason={}}}", l.value()));
            out.entry(format!("{}{}", key.name(), reason.unwrap_or_default())).or_default().push(value);
        }
    }
    out
}

fn counter(values: &BTreeMap<String, Vec<DebugValue>>, name: &str) -> u64 {
    match values.get(name).map(Vec::as_slice) {
        Some([DebugValue::Counter(n)]) => *n,
        other => panic!("{name}: {other:?}"),
    }
}

fn histogram(values: &BTreeMap<String, Vec<DebugValue>>, name: &str) -> Vec<f64> {
    match values.get(name).map(Vec::as_slice) {
        Some([DebugValue::Histogram(v)]) => v.iter().map(|f| f.0).collect(),
        other => panic!("{name}: {other:?}"),
    }
}

/// The middleware (SQLite) under a debugging recorder: `source="middleware"`, one claim
/// statement of one job per message, every handler timed (each at least its 20 ms sleep),
/// completions in the commit statements add up, the gauge back at 0, and a busy job's second
/// claim counted as `busy`, not as a claim.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ergonomics_metrics_middleware_under_a_debugging_recorder() {
    let recorder = DebuggingRecorder::new();
    let store: Arc<dyn FenceStore> = Arc::new(common::sqlite().await);
    let queue = common::unique("mw");
    let config = SupervisorConfig::new(common::lease(10));
    let fence = metrics::with_local_recorder(&recorder, || {
        Retrofit::new(Arc::clone(&store), QueueName::new(queue.clone()).expect("queue"), config)
    });
    const N: usize = 5;
    for i in 0..N {
        let done = fence
            .process(&common::key(&format!("job-{i}")), b"x".to_vec(), |ctx: JobContext| async move {
                tokio::time::sleep(Duration::from_millis(20)).await;
                Ok(ctx.payload().to_vec())
            })
            .await;
        assert!(done.should_ack(), "{done:?}");
    }
    // A job another owner holds: refused as busy.
    let other = Owner::new("someone-else").expect("owner");
    let held = store.claim(fence.queue(), &common::key("held"), &other, common::lease(10)).await.expect("claim");
    assert!(matches!(held, Claim::Claimed(_)));
    let busy = fence.process(&common::key("held"), Vec::new(), |_ctx: JobContext| async { Ok(Vec::new()) }).await;
    assert!(!busy.should_ack());

    let values = debug_values(&recorder, &[("queue", &queue), ("source", "middleware")]);
    println!("{values:#?}");
    assert_eq!(counter(&values, "brokerfence_claims_total"), N as u64);
    assert_eq!(counter(&values, "brokerfence_busy_total"), 1);
    assert_eq!(counter(&values, "brokerfence_completions_total"), N as u64);
    let claims = histogram(&values, "brokerfence_claim_duration_seconds");
    assert_eq!(claims.len(), N + 1, "one claim statement per message");
    assert!(claims.iter().all(|s| *s > 0.0 && *s < 10.0), "{claims:?}");
    assert_eq!(histogram(&values, "brokerfence_claim_statement_jobs"), vec![1.0; N + 1]);
    let handlers = histogram(&values, "brokerfence_handler_duration_seconds");
    assert_eq!(handlers.len(), N);
    assert!(handlers.iter().all(|s| *s >= 0.02), "each handler slept 20 ms: {handlers:?}");
    let per_commit = histogram(&values, "brokerfence_commit_statement_jobs");
    assert_eq!(per_commit.iter().sum::<f64>(), N as f64);
    assert_eq!(per_commit.len() as u64, counter(&values, "brokerfence_commit_statements_total"));
    assert_eq!(histogram(&values, "brokerfence_commit_duration_seconds").len(), per_commit.len());
    assert!(histogram(&values, "brokerfence_lease_loss_to_cancel_seconds{reason=superseded}").is_empty());
    match values.get("brokerfence_in_flight").map(Vec::as_slice) {
        Some([DebugValue::Gauge(g)]) => assert_eq!(g.0, 0.0),
        other => panic!("in_flight: {other:?}"),
    }
}

/// A lease taken over while its handler runs (PostgreSQL; the row's epoch and owner moved on, as
/// a takeover after an expiry leaves them): the next heartbeat finds it lost and the handler is
/// cancelled. `brokerfence_lease_loss_to_cancel_seconds{reason="superseded"}` holds one value,
/// under 0.5 s (from the heartbeat's answer to the dropped handler; 82 µs measured here); the
/// cancelled handler is not in the handler histogram; `lease_losses` counts 1; every heartbeat
/// was timed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ergonomics_metrics_lease_loss_to_cancellation_is_timed() {
    let recorder = DebuggingRecorder::new();
    let fence = common::pg().await;
    let schema = fence.get_schema().as_str().to_owned();
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    let queue = QueueName::new(common::unique("loss")).expect("queue");
    let key = JobKey::new("stolen").expect("key");
    let me = Owner::new("metrics-victim").expect("owner");
    let lease = LeaseDuration::from_secs(3).expect("lease");
    let sup = metrics::with_local_recorder(&recorder, || {
        let metrics = Arc::new(Metrics::labelled(queue.as_str(), "test"));
        Supervisor::with_metrics(Arc::clone(&store), me.clone(), SupervisorConfig::new(lease), metrics)
    });
    let Claim::Claimed(granted) = store.claim(&queue, &key, &me, lease).await.expect("claim") else {
        panic!("not claimed")
    };
    let steal = {
        let (pool, q, k) = (fence.pool().clone(), queue.as_str().to_owned(), key.as_str().to_owned());
        async move {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let sql = format!(
                "UPDATE {schema}.jobs SET epoch = epoch + 1, owner = 'metrics-thief', \
                 lease_until = clock_timestamp() + interval '30 seconds' WHERE queue = $1 AND key = $2"
            );
            let done = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(q).bind(k).execute(&pool).await.expect("take over");
            assert_eq!(done.rows_affected(), 1);
        }
    };
    let run = sup.run(granted, Vec::new(), None, |ctx: JobContext| async move {
        tokio::time::sleep(Duration::from_secs(30)).await;
        Ok(ctx.payload().to_vec())
    });
    let (outcome, ()) = tokio::time::timeout(Duration::from_secs(20), async { tokio::join!(run, steal) })
        .await
        .expect("the handler is cancelled within a few heartbeats");
    assert!(matches!(outcome, Outcome::LeaseLost { reason: LossReason::Superseded }), "{outcome:?}");

    let values = debug_values(&recorder, &[("queue", queue.as_str()), ("source", "test")]);
    println!("{values:#?}");
    let took = histogram(&values, "brokerfence_lease_loss_to_cancel_seconds{reason=superseded}");
    assert_eq!(took.len(), 1, "{took:?}");
    // The loss is found by the heartbeat a second after the claim; a value timed from the
    // claim or the handler's start would be about 1 s.
    assert!(took[0] >= 0.0 && took[0] < 0.5, "loss to cancellation took {} s", took[0]);
    assert!(histogram(&values, "brokerfence_lease_loss_to_cancel_seconds{reason=unconfirmed}").is_empty());
    assert!(histogram(&values, "brokerfence_handler_duration_seconds").is_empty(), "a cancelled handler is not timed");
    assert_eq!(counter(&values, "brokerfence_lease_losses_total"), 1);
    let heartbeats = counter(&values, "brokerfence_heartbeats_total");
    assert!(heartbeats >= 1);
    assert_eq!(histogram(&values, "brokerfence_heartbeat_duration_seconds").len() as u64, heartbeats);
    match values.get("brokerfence_in_flight").map(Vec::as_slice) {
        Some([DebugValue::Gauge(g)]) => assert_eq!(g.0, 0.0),
        other => panic!("in_flight: {other:?}"),
    }
}
