//! Shared by the example workers (`sqs_worker`, `redis_worker`, `table_worker`, `zombie_worker`)
//! and producers: command-line flags, `EVENT` lines, logging, and the fence connection. Each
//! example includes it with `#[path = "support/cli.rs"] mod common;` (a file directly in
//! `examples/` would be an example of its own). The formats are documented in
//! `examples/README.md`.
#![allow(dead_code)]

use std::fmt::Display;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use brokerfence::adapters::{Incoming, ReceiveContext, Source, SourceError};
use brokerfence::fence::{
    self, Claim, ClaimedJob, DbTime, FailOutcome, FenceError, FenceStore, Heartbeat, JobContext, JobError, JobKey,
    JobRecord, Lease, LeaseDuration, Owner, PgFence, QueueName, RetryPolicy, SchemaName,
};

// ------------------------------------------------------------------------------------ EVENT lines

/// Quotes a field value when it is empty or holds whitespace, `"`, `\` or a control character:
/// `"…"` with `\"`, `\\`, `\n`, `\r`, `\t` and `\u{XX}` escapes. Other values are printed as they are.
pub fn quote(value: &str) -> String {
    let plain =
        !value.is_empty() && !value.chars().any(|c| c.is_whitespace() || c.is_control() || c == '"' || c == '\\');
    if plain {
        return value.to_owned();
    }
    let mut out = String::with_capacity(value.len() + 2);
    out.push('"');
    for c in value.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Prints `EVENT <name> k=v …` on stdout as one write, flushed at once (a driving program reads
/// it through a pipe). Values are [`quote`]d where needed. A closed stdout is ignored.
pub fn event(name: &str, fields: &[(&str, &dyn Display)]) {
    let mut line = format!("EVENT {name}");
    for (k, v) in fields {
        line.push(' ');
        line.push_str(k);
        line.push('=');
        line.push_str(&quote(&v.to_string()));
    }
    line.push('\n');
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(line.as_bytes());
    let _ = out.flush();
}

/// `EVENT <name> queue=… key=… epoch=… owner=… [extra…]` for one lease.
pub fn lease_event(name: &str, lease: &Lease, extra: &[(&str, &dyn Display)]) {
    let mut fields: Vec<(&str, &dyn Display)> =
        vec![("queue", &lease.queue), ("key", &lease.key), ("epoch", &lease.epoch), ("owner", &lease.owner)];
    fields.extend_from_slice(extra);
    event(name, &fields);
}

/// `EVENT ready pid=… owner=… [extra…]`: the worker is connected and about to receive.
pub fn ready(owner: &Owner, extra: &[(&str, &dyn Display)]) {
    let pid = std::process::id();
    let mut fields: Vec<(&str, &dyn Display)> = vec![("pid", &pid), ("owner", owner)];
    fields.extend_from_slice(extra);
    event("ready", &fields);
}

// ----------------------------------------------------------------------------------------- flags

/// The help layout every example shares (clap): the usage line first, then what the program
/// does, then its flags. `--help` prints it on stdout and exits 0; a bad command line prints
/// clap's message on stderr and exits 2.
pub const HELP_TEMPLATE: &str = "usage: {usage}\n\n{about-with-newline}\n{all-args}{after-help}";

/// Parses `raw` (the arguments without the program name) as `prog`'s flags.
pub fn parse<A: clap::Parser>(prog: &str, raw: Vec<String>) -> Result<A, clap::Error> {
    A::try_parse_from(std::iter::once(prog.to_owned()).chain(raw))
}

/// A usage error found after parsing (a flag that is required unless an environment variable
/// is set, two flags that exclude each other), in clap's format: exit code 2.
pub fn usage_error<A: clap::CommandFactory>(message: impl Display) -> clap::Error {
    A::command().error(clap::error::ErrorKind::MissingRequiredArgument, message)
}

/// Prints a parse failure where it belongs (help on stdout, errors on stderr); its exit code
/// (0 for `--help`, 2 for a bad command line).
pub fn report_cli(e: &clap::Error) -> i32 {
    let _ = e.print();
    e.exit_code()
}

/// A duration in milliseconds (`--grace 500`).
pub fn millis(v: &str) -> Result<Duration, String> {
    v.parse::<u64>().map(Duration::from_millis).map_err(|e| format!("{v:?} is not a number of milliseconds: {e}"))
}

/// A count of at least one (0 is taken as 1).
pub fn at_least_one(v: &str) -> Result<usize, String> {
    v.parse::<usize>().map(|n| n.max(1)).map_err(|e| format!("{v:?}: {e}"))
}

/// A number of attempts of at least one (0 or less is taken as 1).
pub fn attempts(v: &str) -> Result<i64, String> {
    v.parse::<i64>().map(|n| n.max(1)).map_err(|e| format!("{v:?}: {e}"))
}

/// The flags every consumer worker has (see `examples/README.md`); each worker flattens them
/// into its own (`#[command(flatten)] common: Common`).
#[derive(Debug, Clone, clap::Args)]
pub struct Common {
    /// PostgreSQL URL (else DATABASE_URL, else localstack/.env)
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
    /// Schema of the fence tables
    #[arg(long, value_name = "NAME")]
    pub schema: Option<String>,
    /// Owner id (also PostgreSQL's application_name); default: a unique one
    #[arg(long, value_name = "NAME")]
    pub owner: Option<String>,
    /// Lease length in seconds
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub lease: u64,
    /// Apply the schema migrations at start (else refuse a schema older than this build)
    #[arg(long)]
    pub migrate: bool,
    /// HTTP receiver each job calls with its fencing stamp (else RECEIVER_URL)
    #[arg(long, value_name = "URL")]
    pub receiver_url: Option<String>,
    /// Failed attempts before a job is dead [default: 5]
    #[arg(long, value_name = "N", value_parser = attempts)]
    pub max_attempts: Option<i64>,
    /// Jobs run at once
    #[arg(long, value_name = "N", default_value = "16", value_parser = at_least_one)]
    pub concurrency: usize,
    /// Milliseconds running jobs get to finish at shutdown
    #[arg(long, value_name = "MS", default_value = "30000", value_parser = millis)]
    pub grace: Duration,
    /// Milliseconds each handler waits before the receiver call
    #[arg(long, value_name = "MS", default_value = "0", value_parser = millis)]
    pub handler_delay: Duration,
    /// Milliseconds each handler waits after the receiver call
    #[arg(long, value_name = "MS", default_value = "0", value_parser = millis)]
    pub after_call_delay: Duration,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any free port; needs the
    /// `metrics` feature)
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_addr: Option<String>,
}

impl Common {
    /// The owner: `--owner`, or a unique one from `prefix`.
    pub fn owner(&self, prefix: &str) -> Result<Owner, FenceError> {
        match &self.owner {
            Some(o) => Owner::new(o.clone()),
            None => Ok(Owner::unique(prefix)),
        }
    }

    /// The receiver: `--receiver-url`, else `RECEIVER_URL` (when not empty).
    pub fn receiver(&self) -> Option<String> {
        self.receiver_url.clone().or_else(|| std::env::var("RECEIVER_URL").ok().filter(|s| !s.is_empty()))
    }

    /// With `--metrics-addr`: installs the Prometheus recorder, listens, and prints
    /// `EVENT metrics_endpoint addr=HOST:PORT url=http://HOST:PORT/metrics` (the bound address:
    /// port 0 picks a free one). Call it before the consumer is built (the consumer takes its
    /// metric handles from the recorder installed then). Without the `metrics` feature the flag is
    /// refused (exit 2); an address that cannot be bound fails (exit 1).
    pub async fn serve_metrics(&self) -> Result<(), StartError> {
        let Some(addr) = self.metrics_addr.as_deref() else { return Ok(()) };
        if !cfg!(feature = "metrics") {
            return Err(StartError::Refused(
                "--metrics-addr needs the `metrics` feature (cargo run --features metrics --example …)".into(),
            ));
        }
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| StartError::Failed(format!("cannot listen on --metrics-addr {addr}: {e}")))?;
        let bound = listener.local_addr().map_err(|e| StartError::Failed(format!("--metrics-addr {addr}: {e}")))?;
        let handle = install_prometheus()?;
        let upkeep = handle.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                upkeep.run_upkeep();
            }
        });
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let handle = handle.clone();
                async move { ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], handle.render()) }
            }),
        );
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "metrics endpoint stopped");
            }
        });
        let url = format!("http://{bound}/metrics");
        event("metrics_endpoint", &[("addr", &bound), ("url", &url)]);
        Ok(())
    }

    /// The retry policy: the default with `--max-attempts`.
    pub fn retry_policy(&self) -> RetryPolicy {
        let default = RetryPolicy::default();
        RetryPolicy { max_attempts: self.max_attempts.unwrap_or(default.max_attempts), ..default }
    }
}

// ------------------------------------------------------------------------- logging and startup

/// Buckets (seconds) of the `brokerfence_*_seconds` histograms: 1 ms to 30 s.
pub const SECONDS_BUCKETS: [f64; 14] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// Buckets of the `brokerfence_*_statement_jobs` histograms (jobs per statement, up to the
/// group statements' 256).
pub const JOBS_BUCKETS: [f64; 9] = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];

/// Installs the Prometheus recorder as the global `metrics` recorder (histograms rendered with
/// [`SECONDS_BUCKETS`] / [`JOBS_BUCKETS`]); its handle renders the text format.
pub fn install_prometheus() -> Result<metrics_exporter_prometheus::PrometheusHandle, StartError> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    let failed = |e: &dyn Display| StartError::Failed(format!("metrics recorder: {e}"));
    let recorder = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &SECONDS_BUCKETS)
        .and_then(|b| b.set_buckets_for_metric(Matcher::Suffix("_jobs".into()), &JOBS_BUCKETS))
        .map_err(|e| failed(&e))?
        .build_recorder();
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|e| failed(&e))?;
    Ok(handle)
}

/// Colour only for a terminal, and never with `NO_COLOR` set (to anything but the empty string).
pub fn use_colour() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Logs to stderr (`RUST_LOG`, else `default_filter`), without ANSI codes unless [`use_colour`].
pub fn init_logging(default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(use_colour())
        .with_env_filter(filter)
        .try_init();
}

/// Why a worker did not run: refused at start (exit 2: bad input or a schema too old) or failed
/// (exit 1).
#[derive(Debug)]
pub enum StartError {
    /// Exit code 2.
    Refused(String),
    /// Exit code 1.
    Failed(String),
}

impl<E: std::error::Error> From<E> for StartError {
    fn from(e: E) -> Self {
        StartError::Failed(e.to_string())
    }
}

impl StartError {
    /// Prints the message on stderr; the exit code.
    pub fn report(self, prog: &str) -> i32 {
        match self {
            StartError::Refused(m) => {
                eprintln!("{prog}: {m}");
                2
            }
            StartError::Failed(m) => {
                eprintln!("{prog}: {m}");
                1
            }
        }
    }
}

/// Runs a program: `--help` prints the help on stdout (exit 0), a bad command line clap's
/// message on stderr (exit 2); otherwise starts logging (`log_filter` unless `RUST_LOG` says
/// otherwise) and a tokio runtime, runs `body` on it, and returns its exit code (0, or what
/// [`StartError::report`] says).
pub fn run_program<A, Fut>(
    prog: &str,
    log_filter: &str,
    parsed: Result<A, clap::Error>,
    body: impl FnOnce(A) -> Fut,
) -> i32
where
    Fut: std::future::Future<Output = Result<(), StartError>>,
{
    let args = match parsed {
        Ok(a) => a,
        Err(e) => return report_cli(&e),
    };
    init_logging(log_filter);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => return StartError::Failed(format!("cannot start the tokio runtime: {e}")).report(prog),
    };
    match runtime.block_on(body(args)) {
        Ok(()) => 0,
        Err(e) => e.report(prog),
    }
}

/// Brings the store up: migrates with `--migrate`, else checks the schema and refuses to start
/// (exit 2, the store's message) when it is older than this build needs.
pub async fn prepare_schema(store: &dyn FenceStore, migrate: bool) -> Result<(), StartError> {
    if migrate {
        store.migrate().await?;
        return Ok(());
    }
    match store.check_schema().await {
        Ok(()) => Ok(()),
        Err(e @ FenceError::SchemaTooOld { .. }) => Err(StartError::Refused(e.to_string())),
        Err(e) => Err(e.into()),
    }
}

/// A table-queue worker as the example workers build it: the metrics endpoint (`--metrics-addr`),
/// PostgreSQL (`--database-url`, `--schema`, `--migrate`), the source and store that print the
/// `EVENT` lines, the shared flags (lease, retry, concurrency, grace) and the lost-lease hook.
/// Returns the owner, the queue and the consumer.
pub async fn table_consumer(
    c: &Common,
    owner_prefix: &str,
    queue: Option<&str>,
    idle_wait: Duration,
) -> Result<(Owner, QueueName, brokerfence::adapters::Consumer<EventSource<brokerfence::table::TableQueue>>), StartError>
{
    let refuse = |e: FenceError| StartError::Refused(e.to_string());
    let owner = c.owner(owner_prefix).map_err(refuse)?;
    let queue = QueueName::new(queue.unwrap_or_default()).map_err(refuse)?;
    let lease = LeaseDuration::from_secs(c.lease).map_err(refuse)?;
    c.serve_metrics().await?;
    let url = database_url(c.database_url.as_deref())?;
    let pg = connect_pg(&url, c.schema.as_deref(), &owner, c.migrate).await?;
    let store: Arc<dyn FenceStore> = Arc::new(pg);
    let source =
        EventSource(brokerfence::table::TableQueue::new(Arc::clone(&store), queue.clone()).idle_wait(idle_wait));
    let supervisor = fence::SupervisorConfig::new(lease).retry(c.retry_policy());
    let config = brokerfence::adapters::ConsumerConfig::new(supervisor).concurrency(c.concurrency).grace(c.grace);
    let consumer =
        brokerfence::adapters::Consumer::with_owner(source, Arc::new(EventStore(store)), owner.clone(), config);
    consumer.supervisor().add_hook(Arc::new(LostHook));
    Ok((owner, queue, consumer))
}

/// The PostgreSQL URL: `--database-url`, else `DATABASE_URL` (or `localstack/.env`).
pub fn database_url(given: Option<&str>) -> Result<String, StartError> {
    given.map(str::to_owned).or_else(|| brokerfence_testkit::services::var("DATABASE_URL")).ok_or_else(|| {
        StartError::Refused("no database: give --database-url or set DATABASE_URL (localstack/up writes it)".into())
    })
}

/// The backend a database URL names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DbKind {
    /// `postgres://` or `postgresql://`.
    Postgres,
    /// `sqlite:`.
    Sqlite,
}

/// The backend of `url` by its scheme; any other scheme (`mysql://`, `http://`, none) is
/// refused at once (exit 2) with [`FenceError::UnsupportedScheme`]'s message.
pub fn database_kind(url: &str) -> Result<DbKind, StartError> {
    let scheme = url.split_once(':').map(|(s, _)| s).unwrap_or("");
    match scheme.to_ascii_lowercase().as_str() {
        "postgres" | "postgresql" => Ok(DbKind::Postgres),
        "sqlite" => Ok(DbKind::Sqlite),
        _ => Err(StartError::Refused(
            FenceError::UnsupportedScheme {
                scheme: scheme.to_owned(),
                expected: "postgres://USER@HOST:PORT/DB or postgresql://… (PostgreSQL), or sqlite:PATH (SQLite)",
            }
            .to_string(),
        )),
    }
}

/// Connects to PostgreSQL with `application_name` = the owner (PostgreSQL keeps its first 63
/// bytes), in `schema`, and [`prepare_schema`]s it. A URL of another scheme is refused at once
/// (exit 2, see [`database_kind`]).
pub async fn connect_pg(url: &str, schema: Option<&str>, owner: &Owner, migrate: bool) -> Result<PgFence, StartError> {
    if database_kind(url)? == DbKind::Sqlite {
        return Err(StartError::Refused(
            "this program needs PostgreSQL (a postgres:// or postgresql:// URL); sqlite: is not served here".into(),
        ));
    }
    let options: sqlx::postgres::PgConnectOptions =
        url.parse().map_err(|e| StartError::Refused(format!("--database-url: {e}")))?;
    let mut store = PgFence::connect_with(options.application_name(owner.as_str())).await?;
    if let Some(schema) = schema {
        store = store.with_schema(SchemaName::new(schema.to_owned()).map_err(|e| StartError::Refused(e.to_string()))?);
    }
    prepare_schema(&store, migrate).await?;
    Ok(store)
}

// --------------------------------------------------------------------------------- the handler

/// Prints `EVENT dropped` if the attempt is cancelled (its future dropped) before it returned.
struct DropWatch<'a> {
    lease: &'a Lease,
    returned: bool,
}

impl Drop for DropWatch<'_> {
    fn drop(&mut self) {
        if !self.returned {
            lease_event("dropped", self.lease, &[]);
        }
    }
}

/// What the handler of the consumer workers does after `handler_delay`.
#[derive(Clone)]
pub struct CallReceiver {
    /// The HTTP client.
    pub http: reqwest::Client,
    /// `--receiver-url`.
    pub receiver: Option<Arc<str>>,
    /// `--handler-delay`.
    pub delay: Duration,
    /// `--after-call-delay`.
    pub after_call: Duration,
}

impl CallReceiver {
    /// From the common flags.
    pub fn new(common: &Common) -> Self {
        Self {
            http: reqwest::Client::new(),
            receiver: common.receiver().as_deref().map(Arc::from),
            delay: common.handler_delay,
            after_call: common.after_call_delay,
        }
    }

    /// The handler: `claimed`, then calls the receiver with the job's fencing stamp (`calling`,
    /// `called`), and returns "owner@epoch" (`handled`) or the error (`failed`). A cancelled
    /// attempt prints `dropped`.
    pub async fn handle(self, ctx: JobContext) -> Result<Vec<u8>, JobError> {
        let lease = ctx.lease().clone();
        let mut watch = DropWatch { lease: &lease, returned: false };
        lease_event("claimed", &lease, &[("attempt", &lease.attempts)]);
        let result = self.call(&ctx, &lease).await;
        watch.returned = true;
        match &result {
            Ok(_) => lease_event("handled", &lease, &[]),
            Err(e) => lease_event("failed", &lease, &[("retry", &e.retry), ("error", &e.message)]),
        }
        result
    }

    async fn call(&self, ctx: &JobContext, lease: &Lease) -> Result<Vec<u8>, JobError> {
        tokio::time::sleep(self.delay).await;
        if let Some(url) = self.receiver.as_deref() {
            lease_event("calling", lease, &[]);
            let mut request = self.http.post(url).body(ctx.payload().to_vec());
            for (name, value) in ctx.stamp().to_headers() {
                request = request.header(name, value);
            }
            let response = request.send().await.map_err(|e| JobError::retry(format!("receiver unreachable: {e}")))?;
            let status = response.status().as_u16();
            lease_event("called", lease, &[("status", &status)]);
            match status {
                200..=299 => {}
                // The receiver has seen a newer epoch: this worker was superseded. The fenced
                // failure is refused by the database too; nothing is acknowledged.
                409 => return Err(JobError::retry(format!("receiver refused epoch {}: superseded", ctx.epoch()))),
                s => return Err(JobError::retry(format!("receiver answered {s}"))),
            }
        }
        tokio::time::sleep(self.after_call).await;
        Ok(format!("{}@{}", ctx.owner(), ctx.epoch()).into_bytes())
    }
}

/// A token cancelled on SIGTERM or SIGINT. Unlike `adapters::shutdown_signal`, the handlers are
/// in place when this returns, so a driver that waits for `EVENT ready` (printed after it) can
/// send SIGTERM at once without killing the process.
pub fn shutdown_on_signals() -> tokio_util::sync::CancellationToken {
    use tokio::signal::unix::{SignalKind, signal};
    let token = tokio_util::sync::CancellationToken::new();
    let (term, int) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt()));
    let fire = token.clone();
    tokio::spawn(async move {
        match (term, int) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
        tracing::info!("shutdown signal received");
        fire.cancel();
    });
    token
}

/// Prints a `metrics` line whenever a counter changed (every 50 ms at most); abort it at the end.
pub fn spawn_metrics(metrics: Arc<fence::Metrics>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut last = metrics.snapshot();
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let now = metrics.snapshot();
            if now != last {
                println!("EVENT metrics {now}");
                last = now;
            }
        }
    })
}

// ------------------------------------------------------------- what the fence decided: the store

/// A [`FenceStore`] that prints what the database decided about this worker's attempts:
/// `committed`, `fenced` and `fail_recorded`. Everything is delegated unchanged.
pub struct EventStore(pub Arc<dyn FenceStore>);

fn fenced_event(lease: &Lease, op: &str, e: &FenceError) {
    let (current_epoch, current_owner) = match e {
        FenceError::Fenced { current_epoch, current_owner, .. } => {
            (*current_epoch, current_owner.clone().unwrap_or_else(|| "none".into()))
        }
        _ => (0, "none".into()),
    };
    lease_event("fenced", lease, &[("op", &op), ("current_epoch", &current_epoch), ("current_owner", &current_owner)]);
}

fn commit_event(lease: &Lease, result: &fence::Result<()>) {
    match result {
        Ok(()) => lease_event("committed", lease, &[]),
        Err(e) if e.is_fenced() => fenced_event(lease, "commit", e),
        Err(_) => {}
    }
}

#[async_trait]
impl FenceStore for EventStore {
    async fn migrate(&self) -> fence::Result<()> {
        self.0.migrate().await
    }
    async fn check_schema(&self) -> fence::Result<()> {
        self.0.check_schema().await
    }
    async fn claim(&self, q: &QueueName, k: &JobKey, o: &Owner, l: LeaseDuration) -> fence::Result<Claim> {
        self.0.claim(q, k, o, l).await
    }
    async fn claim_batch(
        &self,
        q: &QueueName,
        keys: &[JobKey],
        o: &Owner,
        l: LeaseDuration,
    ) -> fence::Result<Vec<Claim>> {
        self.0.claim_batch(q, keys, o, l).await
    }
    async fn enqueue(&self, q: &QueueName, k: &JobKey, payload: &[u8]) -> fence::Result<bool> {
        self.0.enqueue(q, k, payload).await
    }
    async fn enqueue_many(&self, q: &QueueName, jobs: &[(JobKey, Vec<u8>)]) -> fence::Result<u64> {
        self.0.enqueue_many(q, jobs).await
    }
    async fn claim_next(&self, q: &QueueName, o: &Owner, l: LeaseDuration, n: u32) -> fence::Result<Vec<ClaimedJob>> {
        self.0.claim_next(q, o, l, n).await
    }
    async fn heartbeat(&self, leases: &[Lease], l: LeaseDuration) -> fence::Result<Heartbeat> {
        self.0.heartbeat(leases, l).await
    }
    async fn heartbeat_unless_locked(&self, leases: &[Lease], l: LeaseDuration) -> fence::Result<Heartbeat> {
        self.0.heartbeat_unless_locked(leases, l).await
    }
    async fn checkpoint(&self, lease: &Lease, progress: &[u8]) -> fence::Result<()> {
        let r = self.0.checkpoint(lease, progress).await;
        if let Err(e) = &r
            && e.is_fenced()
        {
            fenced_event(lease, "checkpoint", e);
        }
        r
    }
    async fn complete(&self, lease: &Lease, result: &[u8]) -> fence::Result<()> {
        let r = self.0.complete(lease, result).await;
        commit_event(lease, &r);
        r
    }
    async fn complete_batch(&self, items: &[(Lease, Vec<u8>)]) -> fence::Result<Vec<fence::Result<()>>> {
        let out = self.0.complete_batch(items).await?;
        for ((lease, _), r) in items.iter().zip(&out) {
            commit_event(lease, r);
        }
        Ok(out)
    }
    async fn fail(&self, lease: &Lease, error: &str, retry: bool, p: &RetryPolicy) -> fence::Result<FailOutcome> {
        let r = self.0.fail(lease, error, retry, p).await;
        match &r {
            Ok(FailOutcome::Retry { retry_in }) => {
                let ms = retry_in.as_millis();
                lease_event("fail_recorded", lease, &[("outcome", &"retry"), ("retry_in_ms", &ms)]);
            }
            Ok(FailOutcome::Dead) => lease_event("fail_recorded", lease, &[("outcome", &"dead")]),
            Err(e) if e.is_fenced() => fenced_event(lease, "fail", e),
            Err(_) => {}
        }
        r
    }
    async fn release(&self, lease: &Lease) -> fence::Result<()> {
        self.0.release(lease).await
    }
    async fn job(&self, q: &QueueName, k: &JobKey) -> fence::Result<Option<JobRecord>> {
        self.0.job(q, k).await
    }
    async fn db_now(&self) -> fence::Result<DbTime> {
        self.0.db_now().await
    }
    fn backend(&self) -> &'static str {
        self.0.backend()
    }

    fn concrete(&self) -> brokerfence::fence::Backend<'_> {
        self.0.concrete()
    }

    async fn prune(
        &self,
        retention: &brokerfence::fence::Retention,
    ) -> brokerfence::fence::Result<brokerfence::fence::PruneReport> {
        self.0.prune(retention).await
    }
}

/// A supervisor hook printing `lease_lost` for every lease a heartbeat found taken over or
/// expired (add it with `consumer.supervisor().add_hook(Arc::new(LostHook))`).
pub struct LostHook;

#[async_trait]
impl fence::LeaseHook for LostHook {
    async fn confirmed(&self, _leases: &[Lease]) {}

    async fn lost(&self, leases: &[Lease]) {
        for lease in leases {
            lease_event("lease_lost", lease, &[]);
        }
    }
}

// ---------------------------------------------------- what the broker was told: the source side

/// A delivery with the job key it maps to (none for a malformed one).
#[derive(Clone)]
pub struct Tagged<D> {
    inner: D,
    key: Option<JobKey>,
}

impl<D> Tagged<D> {
    fn key(&self) -> String {
        self.key.as_ref().map_or_else(|| "-".to_owned(), |k| k.as_str().to_owned())
    }
}

/// A [`Source`] that prints what the broker was told, as the runtime's disposition says:
/// `acked`, `hidden` (visibility changed: `why=busy|retry|heartbeat`), `dead_lettered`,
/// `abandoned`, and `broker_error` when a call failed. Every call is delegated.
pub struct EventSource<S>(pub S);

impl<S: Source> EventSource<S> {
    fn queue_name(&self) -> &QueueName {
        self.0.queue()
    }

    fn outcome(&self, op: &str, key: &str, r: &Result<(), SourceError>, ok: impl FnOnce()) {
        match r {
            Ok(()) => ok(),
            Err(e) => {
                let error = e.to_string();
                event("broker_error", &[("queue", self.queue_name()), ("key", &key), ("op", &op), ("error", &error)]);
            }
        }
    }

    /// `EVENT <name> queue=… key=… [extra…]` for one delivery.
    fn delivery_event(&self, name: &str, key: &str, extra: &[(&str, &dyn Display)]) {
        let mut fields: Vec<(&str, &dyn Display)> = vec![("queue", self.queue_name()), ("key", &key)];
        fields.extend_from_slice(extra);
        event(name, &fields);
    }
}

#[async_trait]
impl<S: Source> Source for EventSource<S> {
    type Delivery = Tagged<S::Delivery>;

    fn queue(&self) -> &QueueName {
        self.0.queue()
    }

    fn kind(&self) -> &'static str {
        self.0.kind()
    }

    fn default_batch(&self) -> usize {
        self.0.default_batch()
    }

    async fn receive(&self, max: usize, ctx: &ReceiveContext) -> Result<Vec<Incoming<Self::Delivery>>, SourceError> {
        let got = self.0.receive(max, ctx).await?;
        Ok(got
            .into_iter()
            .map(|incoming| match incoming {
                Incoming::Unclaimed { delivery, key, payload } => {
                    Incoming::Unclaimed { delivery: Tagged { inner: delivery, key: Some(key.clone()) }, key, payload }
                }
                Incoming::Claimed { delivery, job } => {
                    Incoming::Claimed { delivery: Tagged { inner: delivery, key: Some(job.lease.key.clone()) }, job }
                }
                Incoming::Malformed { delivery, reason } => {
                    Incoming::Malformed { delivery: Tagged { inner: delivery, key: None }, reason }
                }
            })
            .collect())
    }

    async fn extend(&self, leases: &[(Lease, Self::Delivery)]) -> Result<(), SourceError> {
        let inner: Vec<(Lease, S::Delivery)> = leases.iter().map(|(l, d)| (l.clone(), d.inner.clone())).collect();
        let r = self.0.extend(&inner).await;
        for (lease, d) in leases {
            self.outcome("extend", &d.key(), &r, || {
                let ms = lease.ttl.as_millis();
                lease_event("hidden", lease, &[("why", &"heartbeat"), ("ms", &ms)]);
            });
        }
        r
    }

    async fn lost(&self, leases: &[(Lease, Self::Delivery)]) -> Result<(), SourceError> {
        let inner: Vec<(Lease, S::Delivery)> = leases.iter().map(|(l, d)| (l.clone(), d.inner.clone())).collect();
        self.0.lost(&inner).await
    }

    async fn ack(&self, deliveries: Vec<Self::Delivery>) -> Result<(), SourceError> {
        let keys: Vec<String> = deliveries.iter().map(Tagged::key).collect();
        let r = self.0.ack(deliveries.into_iter().map(|d| d.inner).collect()).await;
        for key in &keys {
            self.outcome("ack", key, &r, || self.delivery_event("acked", key, &[]));
        }
        r
    }

    async fn retry_later(&self, delivery: Self::Delivery, delay: Duration) -> Result<(), SourceError> {
        let key = delivery.key();
        let r = self.0.retry_later(delivery.inner, delay).await;
        let ms = delay.as_millis();
        self.outcome("retry_later", &key, &r, || {
            self.delivery_event("hidden", &key, &[("why", &"retry"), ("ms", &ms)])
        });
        r
    }

    async fn dead_letter(&self, delivery: Self::Delivery, reason: &str) -> Result<(), SourceError> {
        let key = delivery.key();
        let r = self.0.dead_letter(delivery.inner, reason).await;
        self.outcome("dead_letter", &key, &r, || self.delivery_event("dead_lettered", &key, &[("reason", &reason)]));
        r
    }

    async fn hold(&self, delivery: Self::Delivery, ttl: Duration) -> Result<(), SourceError> {
        let key = delivery.key();
        let r = self.0.hold(delivery.inner, ttl).await;
        let ms = ttl.as_millis();
        self.outcome("hold", &key, &r, || self.delivery_event("hidden", &key, &[("why", &"busy"), ("ms", &ms)]));
        r
    }

    async fn abandon(&self, delivery: Self::Delivery) -> Result<(), SourceError> {
        let key = delivery.key();
        let r = self.0.abandon(delivery.inner).await;
        self.outcome("abandon", &key, &r, || self.delivery_event("abandoned", &key, &[]));
        r
    }

    async fn close(&self, grace: Duration) {
        self.0.close(grace).await;
    }
}
