//! OpenTelemetry test support (feature `otel`), for the `otel` tests of the `runtime`, `sqs` and
//! `redis` binaries: the OpenTelemetry SDK's in-memory exporter behind a `tracing` subscriber of the test's
//! thread, a store whose heartbeats never reach the database (a zombie), a receiver behind
//! `EpochGuard`, the checks of one fenced-zombie trace, and its rendering as an SVG picture.
//!
//! The subscriber is the default of the test's thread only: run these tests on tokio's
//! `current_thread` runtime so that every task of the test (consumers, receiver) records into it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use brokerfence::{
    Claim, ClaimedJob, DbTime, FailOutcome, FenceError, FenceStore, Heartbeat, JobContext, JobError, JobKey, JobRecord,
    Lease, LeaseDuration, Owner, PgFence, QueueName, RetryPolicy,
};
use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use tracing_subscriber::layer::SubscriberExt;

/// The spans of this thread, exported in memory, and the warnings logged meanwhile.
pub struct Capture {
    exporter: InMemorySpanExporter,
    provider: SdkTracerProvider,
    warnings: Arc<Mutex<Vec<String>>>,
    _guard: tracing::subscriber::DefaultGuard,
}

/// Starts capturing (until the returned value is dropped); every span is exported when it ends.
pub fn capture() -> Capture {
    capture_with(false)
}

/// [`capture_with`], keeping only spans and events up to `level` (`INFO`: what an exporter set
/// to info receives).
pub fn capture_at(batch: bool, level: tracing::Level) -> Capture {
    capture_filtered(batch, tracing_subscriber::filter::LevelFilter::from_level(level))
}

/// [`capture`], or with `batch` through the SDK's batch processor (its own thread, as in
/// production) instead of exporting each span as it ends.
pub fn capture_with(batch: bool) -> Capture {
    capture_filtered(batch, tracing_subscriber::filter::LevelFilter::TRACE)
}

/// [`capture`] through the layer brokerfence recommends ([`brokerfence::otel::layer`]: no
/// context activation, no location, thread or poll-timing attributes) instead of the layer's
/// defaults.
pub fn capture_recommended() -> Capture {
    build(false, tracing_subscriber::filter::LevelFilter::TRACE, Layer::Recommended)
}

/// Which set-up of `tracing_opentelemetry`'s layer a capture uses.
enum Layer {
    /// The layer's defaults.
    Defaults,
    /// The defaults without location, thread and poll-timing attributes.
    Lean,
    /// [`brokerfence::otel::layer`].
    Recommended,
}

fn capture_filtered(batch: bool, level: tracing_subscriber::filter::LevelFilter) -> Capture {
    // OTEL_LAYER (read for the cost measurement): `brokerfence` for brokerfence's recommended
    // layer, `lean` for the defaults without per-span source location and thread attributes and
    // the timing of every poll (`busy_ns`, `idle_ns`); else the layer's defaults.
    let layer = match std::env::var("OTEL_LAYER").as_deref() {
        Ok("brokerfence") => Layer::Recommended,
        Ok("lean") => Layer::Lean,
        _ => Layer::Defaults,
    };
    build(batch, level, layer)
}

fn build(batch: bool, level: tracing_subscriber::filter::LevelFilter, layer: Layer) -> Capture {
    let exporter = InMemorySpanExporter::default();
    let builder = SdkTracerProvider::builder();
    let builder = if batch {
        builder.with_batch_exporter(exporter.clone())
    } else {
        builder.with_simple_exporter(exporter.clone())
    };
    let provider = builder.build();
    let tracer = provider.tracer("brokerfence-tests");
    let warnings: Arc<Mutex<Vec<String>>> = Arc::default();
    let layer = match layer {
        Layer::Defaults => tracing_opentelemetry::layer().with_tracer(tracer),
        Layer::Lean => tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_location(false)
            .with_threads(false)
            .with_tracked_inactivity(false),
        Layer::Recommended => brokerfence::otel::layer(tracer),
    };
    let subscriber = tracing_subscriber::registry().with(layer).with(Warnings(Arc::clone(&warnings))).with(level);
    let guard = tracing::subscriber::set_default(subscriber);
    Capture { exporter, provider, warnings, _guard: guard }
}

impl Capture {
    /// Every span ended so far.
    pub fn spans(&self) -> Vec<SpanData> {
        let _ = self.provider.force_flush();
        self.exporter.get_finished_spans().expect("finished spans")
    }

    /// The `attempt` spans of `queue`, in the order they ended.
    pub fn attempts(&self, queue: &str) -> Vec<SpanData> {
        self.spans().into_iter().filter(|s| s.name == "attempt" && attr(s, "queue").as_deref() == Some(queue)).collect()
    }

    /// The warnings logged so far (message and fields).
    pub fn warnings(&self) -> Vec<String> {
        self.warnings.lock().expect("warnings").clone()
    }
}

/// Collects WARN events as text.
struct Warnings(Arc<Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Warnings {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if *event.metadata().level() == tracing::Level::WARN {
            struct Text(String);
            impl tracing::field::Visit for Text {
                fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                    self.0.push_str(&format!("{}={value:?} ", field.name()));
                }
            }
            let mut text = Text(String::new());
            event.record(&mut text);
            self.0.lock().expect("warnings").push(text.0);
        }
    }
}

/// The value of attribute `key` of a span, as text.
pub fn attr(span: &SpanData, key: &str) -> Option<String> {
    span.attributes.iter().find(|kv| kv.key.as_str() == key).map(|kv| kv.value.to_string())
}

/// Whether the attempt spans of `queue` exported so far include one of each outcome in
/// `outcomes`. A span is exported when it ends, which can be after its attempt's commit: with
/// debug spans on, a heartbeat statement still out when the attempt ends is a child that keeps
/// it open until the statement returns.
pub fn has_outcomes(cap: &Capture, queue: &str, outcomes: &[&str]) -> bool {
    let attempts = cap.attempts(queue);
    outcomes.iter().all(|o| attempts.iter().any(|s| attr(s, "brokerfence.outcome").as_deref() == Some(*o)))
}

/// Waits until `cond` holds, polling; panics after `within`.
pub async fn wait_until(within: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + within;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "no {what} within {within:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ------------------------------------------------------------------------------------ the zombie

/// A store whose heartbeats never reach the database, as if the worker were frozen: its leases
/// lapse on the database clock while its handler runs on (with `without_cancel_on_loss`).
pub struct Stalled(pub Arc<dyn FenceStore>);

#[async_trait]
impl FenceStore for Stalled {
    async fn migrate(&self) -> brokerfence::Result<()> {
        self.0.migrate().await
    }
    async fn claim(&self, q: &QueueName, k: &JobKey, o: &Owner, l: LeaseDuration) -> brokerfence::Result<Claim> {
        self.0.claim(q, k, o, l).await
    }
    async fn claim_batch(
        &self,
        q: &QueueName,
        keys: &[JobKey],
        o: &Owner,
        l: LeaseDuration,
    ) -> brokerfence::Result<Vec<Claim>> {
        self.0.claim_batch(q, keys, o, l).await
    }
    async fn enqueue_many(&self, q: &QueueName, jobs: &[(JobKey, Vec<u8>)]) -> brokerfence::Result<u64> {
        self.0.enqueue_many(q, jobs).await
    }
    async fn claim_next(
        &self,
        q: &QueueName,
        o: &Owner,
        l: LeaseDuration,
        n: u32,
    ) -> brokerfence::Result<Vec<ClaimedJob>> {
        self.0.claim_next(q, o, l, n).await
    }
    async fn heartbeat(&self, _: &[Lease], _: LeaseDuration) -> brokerfence::Result<Heartbeat> {
        Err(FenceError::Database(sqlx::Error::PoolTimedOut))
    }
    async fn checkpoint(&self, lease: &Lease, progress: &[u8]) -> brokerfence::Result<()> {
        self.0.checkpoint(lease, progress).await
    }
    async fn complete(&self, lease: &Lease, result: &[u8]) -> brokerfence::Result<()> {
        self.0.complete(lease, result).await
    }
    async fn fail(&self, l: &Lease, e: &str, retry: bool, p: &RetryPolicy) -> brokerfence::Result<FailOutcome> {
        self.0.fail(l, e, retry, p).await
    }
    async fn release(&self, lease: &Lease) -> brokerfence::Result<()> {
        self.0.release(lease).await
    }
    async fn job(&self, q: &QueueName, k: &JobKey) -> brokerfence::Result<Option<JobRecord>> {
        self.0.job(q, k).await
    }
    async fn db_now(&self) -> brokerfence::Result<DbTime> {
        self.0.db_now().await
    }
    fn wakeups(&self, q: &QueueName) -> brokerfence::Wakeups {
        self.0.wakeups(q)
    }
    async fn next_due(&self, q: &QueueName) -> brokerfence::Result<Option<Duration>> {
        self.0.next_due(q).await
    }
    fn backend(&self) -> brokerfence::Backend<'_> {
        brokerfence::Backend::Other("stalled")
    }
}

/// A flag a zombie's handler waits on: set when the new owner's result committed.
#[derive(Clone, Default)]
pub struct Gate(Arc<tokio::sync::Notify>, Arc<std::sync::atomic::AtomicBool>);

impl Gate {
    /// Opens it.
    pub fn open(&self) {
        self.1.store(true, std::sync::atomic::Ordering::SeqCst);
        self.0.notify_waiters();
    }
    /// Whether it is open.
    pub fn is_open(&self) -> bool {
        self.1.load(std::sync::atomic::Ordering::SeqCst)
    }
    /// Waits until it is open, at most `within`.
    pub async fn wait(&self, within: Duration) {
        let _ = tokio::time::timeout(within, async {
            while !self.is_open() {
                let notified = self.0.notified();
                if self.is_open() {
                    break;
                }
                let _ = tokio::time::timeout(Duration::from_millis(100), notified).await;
            }
        })
        .await;
    }
}

// ---------------------------------------------------------------------------------- the receiver

/// A receiver behind `EpochGuard` on its own ledger scope; answers 200 to an accepted stamp.
pub async fn receiver(fence: &PgFence, scope: &str) -> String {
    use brokerfence::http::EpochGuard;
    use brokerfence::ledger::{Ledger, PgLedger};
    let guard = EpochGuard::new(Ledger::Pg(PgLedger::new(fence, scope)));
    let app = axum::Router::new().route("/apply", axum::routing::post(|| async { "applied" })).layer(guard.layer());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/apply")
}

/// Calls the receiver with the attempt's stamp (and so its trace context); the status code.
pub async fn call(url: &str, ctx: &JobContext) -> Result<u16, JobError> {
    let mut req = reqwest::Client::new().post(url).timeout(Duration::from_secs(5));
    for (name, value) in ctx.stamp().to_headers() {
        req = req.header(name, value);
    }
    let resp = req.send().await.map_err(JobError::retry)?;
    Ok(resp.status().as_u16())
}

// --------------------------------------------------------------------------------- the checks

/// One fenced-zombie trace, checked: the producer's span `produce`; the zombie's attempt, its
/// child at epoch 1, outcome `fenced` by the new owner's epoch; the new owner's attempt at epoch
/// 2, linked to the producer's span, outcome `committed`; the receiver's span, a child of the
/// new owner's attempt. Returns the spans of the picture, in start order.
pub fn check_zombie_trace(spans: &[SpanData], queue: &str, system: &str) -> Vec<SpanData> {
    let producer = spans.iter().find(|s| s.name == "produce").expect("the producer's span");
    let attempts: Vec<&SpanData> =
        spans.iter().filter(|s| s.name == "attempt" && attr(s, "queue").as_deref() == Some(queue)).collect();
    let outcome = |o: &str| {
        attempts.iter().find(|s| attr(s, "brokerfence.outcome").as_deref() == Some(o)).unwrap_or_else(|| {
            panic!("no {o} attempt among {:#?}", attempts.iter().map(|s| &s.attributes).collect::<Vec<_>>())
        })
    };
    let zombie = outcome("fenced");
    let owner = outcome("committed");
    let trace = producer.span_context.trace_id();
    assert_eq!(zombie.span_context.trace_id(), trace, "the zombie's attempt is in the producer's trace");
    assert_eq!(zombie.parent_span_id, producer.span_context.span_id(), "the first attempt is the producer's child");
    assert_eq!(attr(zombie, "brokerfence.attempt").as_deref(), Some("1"));
    assert_eq!(attr(owner, "brokerfence.attempt").as_deref(), Some("2"));
    let (z, o) = (attr(zombie, "brokerfence.epoch"), attr(owner, "brokerfence.epoch"));
    assert_eq!(attr(zombie, "brokerfence.fenced_by.epoch"), o, "the zombie's span names the epoch that superseded it");
    assert_ne!(z, o);
    assert!(
        owner
            .links
            .links
            .iter()
            .any(|l| l.span_context.span_id() == producer.span_context.span_id() && l.span_context.trace_id() == trace),
        "the later attempt links to the producer's span: {:?}",
        owner.links.links
    );
    for s in [zombie, owner] {
        assert_eq!(attr(s, "messaging.system").as_deref(), Some(system));
        assert_eq!(attr(s, "messaging.destination.name").as_deref(), Some(queue));
        assert_eq!(attr(s, "messaging.operation.type").as_deref(), Some("process"));
        assert!(attr(s, "messaging.message.id").is_some_and(|id| !id.is_empty()));
        assert!(attr(s, "brokerfence.owner").is_some());
    }
    let receiver = spans
        .iter()
        .find(|s| s.name == "fenced_receiver" && s.parent_span_id == owner.span_context.span_id())
        .expect("the receiver's span, a child of the new owner's attempt");
    assert_eq!(receiver.span_context.trace_id(), owner.span_context.trace_id());
    assert_eq!(attr(receiver, "http.response.status_code").as_deref(), Some("200"), "the new owner's call is accepted");
    // The zombie's own call to the receiver, refused there (a review found the handler's own
    // check of the 409 could not fail the test: its panic became a failed, fenced attempt).
    let refused = spans
        .iter()
        .find(|s| s.name == "fenced_receiver" && s.parent_span_id == zombie.span_context.span_id())
        .expect("the receiver's span of the zombie's call, a child of the zombie's attempt");
    assert_eq!(attr(refused, "http.response.status_code").as_deref(), Some("409"), "the zombie's call is refused");
    let mut shown = vec![producer.clone(), (*zombie).clone(), (*owner).clone(), receiver.clone(), refused.clone()];
    shown.sort_by_key(|s| s.start_time);
    if let Ok(path) = std::env::var("BROKERFENCE_TRACE_SVG") {
        std::fs::write(&path, render_svg(&shown, system)).expect("write the picture");
    }
    shown
}

// --------------------------------------------------------------------------------- the picture

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn short(id: TraceId) -> String {
    id.to_string()[..8].to_string()
}

fn short_span(id: SpanId) -> String {
    id.to_string()[..8].to_string()
}

/// The spans as a timeline (one row each, bars to scale), with their ids, parents, links and
/// brokerfence attributes: what a trace viewer shows, drawn from the exporter's data.
pub fn render_svg(spans: &[SpanData], system: &str) -> String {
    let t0 = spans.iter().map(|s| s.start_time).min().expect("spans");
    let t1 = spans.iter().map(|s| s.end_time).max().expect("spans");
    let total = t1.duration_since(t0).unwrap_or_default().as_secs_f64().max(0.001);
    let (left, width, row) = (20.0, 900.0, 64.0);
    let height = 70.0 + row * spans.len() as f64 + 30.0;
    let mut out = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{height}\" font-family=\"monospace\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{left}\" y=\"22\" font-size=\"14\" font-weight=\"bold\">A fenced zombie in one trace ({system}): in-memory exporter spans of a test run, {total:.2} s</text>\n",
        w = width + 2.0 * left
    );
    for (i, s) in spans.iter().enumerate() {
        let y = 50.0 + row * i as f64;
        let x0 = left + width * s.start_time.duration_since(t0).unwrap_or_default().as_secs_f64() / total;
        let x1 = left + width * s.end_time.duration_since(t0).unwrap_or_default().as_secs_f64() / total;
        let outcome = attr(s, "brokerfence.outcome");
        let colour = match outcome.as_deref() {
            Some("fenced") => "#d9534f",
            Some("committed") => "#5cb85c",
            _ => "#5b8def",
        };
        let title = match (s.name.as_ref(), outcome.as_deref()) {
            ("attempt", Some(o)) => format!(
                "attempt {} epoch {} owner {} → {o}{}",
                attr(s, "brokerfence.attempt").unwrap_or_default(),
                attr(s, "brokerfence.epoch").unwrap_or_default(),
                attr(s, "brokerfence.owner").unwrap_or_default(),
                attr(s, "brokerfence.fenced_by.epoch")
                    .map(|e| format!(" (superseded by epoch {e})"))
                    .unwrap_or_default()
            ),
            (name, _) => match attr(s, "http.response.status_code") {
                Some(code) => format!("{name} → HTTP {code}"),
                None => name.to_string(),
            },
        };
        let relation = if s.parent_span_id != SpanId::INVALID {
            format!("parent {}", short_span(s.parent_span_id))
        } else if let Some(l) = s.links.links.first() {
            format!("root, link → {}", short_span(l.span_context.span_id()))
        } else {
            "root".to_string()
        };
        out.push_str(&format!(
            "<rect x=\"{x0:.1}\" y=\"{y:.1}\" width=\"{:.1}\" height=\"18\" fill=\"{colour}\" rx=\"3\"/>\n\
             <text x=\"{left}\" y=\"{:.1}\">{}</text>\n\
             <text x=\"{left}\" y=\"{:.1}\" fill=\"#555\">trace {} span {} {} · {:.0} ms</text>\n",
            (x1 - x0).max(2.0),
            y + 32.0,
            esc(&title),
            y + 46.0,
            short(s.span_context.trace_id()),
            short_span(s.span_context.span_id()),
            esc(&relation),
            s.end_time.duration_since(s.start_time).unwrap_or_default().as_secs_f64() * 1000.0
        ));
    }
    out.push_str("</svg>\n");
    out
}

// ---------------------------------------------------------------------------------- consumers

/// A consumer of `source` as `owner`, one job at a time and nothing read ahead (a zombie holds
/// its only place, so it takes nothing else); its stop token and task.
pub fn consumer<S: brokerfence::Source>(
    source: S,
    store: Arc<dyn FenceStore>,
    owner: &str,
    config: brokerfence::SupervisorConfig,
    handler: impl brokerfence::Handler,
) -> (brokerfence::CancellationToken, tokio::task::JoinHandle<()>) {
    let config = brokerfence::ConsumerConfig::new(config).concurrency(1).prefetch(0).grace(Duration::from_millis(500));
    let consumer = brokerfence::Consumer::with_owner(source, store, Owner::new(owner).expect("owner"), config);
    let stop = brokerfence::CancellationToken::new();
    let token = stop.clone();
    let task = tokio::spawn(async move {
        let _ = consumer.run(handler, token).await;
    });
    (stop, task)
}

/// Stops consumers and waits (bounded) for them.
pub async fn stop_all(consumers: Vec<(brokerfence::CancellationToken, tokio::task::JoinHandle<()>)>) {
    for (stop, task) in consumers {
        stop.cancel();
        let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
    }
}

/// The zombie's handler: says it started, waits until the new owner committed, calls the
/// receiver (which must refuse its older epoch) and returns a result that will be fenced.
pub fn zombie_handler(started: Gate, done: Gate, url: String) -> impl brokerfence::Handler {
    move |ctx: JobContext| {
        let (started, done, url) = (started.clone(), done.clone(), url.clone());
        async move {
            started.open();
            done.wait(Duration::from_secs(30)).await;
            let status = call(&url, &ctx).await?;
            assert_eq!(status, 409, "the receiver refuses the zombie's older epoch");
            Ok(b"zombie".to_vec())
        }
    }
}

/// The new owner's handler: calls the receiver (which accepts) and returns its result.
pub fn owner_handler(url: String) -> impl brokerfence::Handler {
    move |ctx: JobContext| {
        let url = url.clone();
        async move {
            let status = call(&url, &ctx).await?;
            assert_eq!(status, 200, "the receiver accepts the new owner");
            Ok(b"owner".to_vec())
        }
    }
}

/// Waits until job `key` of `queue` is completed (by the new owner), then opens `gate`.
pub async fn await_commit(store: &dyn FenceStore, queue: &QueueName, key: &str, gate: &Gate) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    loop {
        let row = store.job(queue, &JobKey::new(key).expect("key")).await.expect("job");
        if row.as_ref().is_some_and(|r| r.state == brokerfence::JobState::Completed) {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the new owner never committed: {row:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    gate.open();
}
