//! Logging and startup: the Prometheus recorder, the log filter, the error a start ends with, the
//! schema check, and the connection to the fence database.

use super::*;

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
    use tracing_subscriber::Layer;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    // The log filter is the log's own: spans (`--otlp-endpoint`) are exported from level info on,
    // whatever the log shows.
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(use_colour()).with_filter(filter);
    let service = std::env::args().next().and_then(|p| p.rsplit('/').next().map(str::to_owned)).unwrap_or_default();
    // Filtered inside the `Option`: without an exporter the layer is absent and asks for
    // nothing, so the log's filter alone decides which spans are made.
    let spans = super::otel::layer(&service).map(|l| l.with_filter(tracing_subscriber::filter::LevelFilter::INFO));
    let _ = tracing_subscriber::registry().with(fmt).with(spans).try_init();
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
    if let Err(e) = super::otel::check() {
        return e.report(prog);
    }
    init_logging(log_filter);
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => return StartError::Failed(format!("cannot start the tokio runtime: {e}")).report(prog),
    };
    let code = match runtime.block_on(body(args)) {
        Ok(()) => 0,
        Err(e) => e.report(prog),
    };
    super::otel::shutdown();
    code
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
        // The library names its call; this program's way to make it is a flag.
        Err(e @ FenceError::SchemaTooOld { .. }) => Err(StartError::Refused(format!("{e} (here: --migrate)"))),
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
) -> Result<(Owner, QueueName, brokerfence::Consumer<EventSource<brokerfence::TableQueue>>), StartError> {
    let refuse = |e: FenceError| StartError::Refused(e.to_string());
    let owner = c.owner(owner_prefix).map_err(refuse)?;
    let queue = QueueName::new(queue.unwrap_or_default()).map_err(refuse)?;
    let lease = LeaseDuration::from_secs(c.lease).map_err(refuse)?;
    c.serve_metrics().await?;
    let url = database_url(c.database_url.as_deref())?;
    let pg = connect_pg(&url, c.schema.as_deref(), &owner, c.migrate).await?;
    let store: Arc<dyn FenceStore> = Arc::new(pg);
    let source = EventSource(brokerfence::TableQueue::new(Arc::clone(&store), queue.clone()).idle_wait(idle_wait));
    let supervisor = fence::SupervisorConfig::new(lease).retry(c.retry_policy());
    let config = brokerfence::ConsumerConfig::new(supervisor).concurrency(c.concurrency).grace(c.grace);
    let consumer = brokerfence::Consumer::with_owner(source, Arc::new(EventStore(store)), owner.clone(), config);
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

/// Connects to PostgreSQL (one host or a multi-host URL, straight or through a transaction-mode
/// pooler) with `application_name` = the owner (PostgreSQL keeps its first 63 bytes), in
/// `schema`, and [`prepare_schema`]s it. A URL of another scheme is refused at once
/// (exit 2, see [`database_kind`]).
pub async fn connect_pg(url: &str, schema: Option<&str>, owner: &Owner, migrate: bool) -> Result<PgFence, StartError> {
    if database_kind(url)? == DbKind::Sqlite {
        return Err(StartError::Refused(
            "this program needs PostgreSQL (a postgres:// or postgresql:// URL); sqlite: is not served here".into(),
        ));
    }
    // One host or several (`postgres://u@h1:5432,h2:5432/db`: the fence follows the primary), and
    // a transaction-mode pooler found out by itself (or `?pooler=transaction`).
    let target = brokerfence::PgTarget::parse(url)
        .map_err(|e| StartError::Refused(format!("--database-url: {e}")))?
        .application_name(owner.as_str());
    // The library's message names the database URL; this program's comes from a flag or a variable.
    let mut store = PgFence::connect_to(target).await.map_err(|e| match e {
        FenceError::Unreachable { .. } | FenceError::ConnectRejected { .. } => {
            StartError::Failed(format!("{e} (--database-url or DATABASE_URL)"))
        }
        e => e.into(),
    })?;
    if let Some(schema) = schema {
        store = store.schema(SchemaName::new(schema.to_owned()).map_err(|e| StartError::Refused(e.to_string()))?);
    }
    prepare_schema(&store, migrate).await?;
    Ok(store)
}
