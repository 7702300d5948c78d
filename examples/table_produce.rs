//! Enqueues N jobs on a table queue (the fence's own PostgreSQL table), for
//! `examples/table_worker.rs`.
//!
//! ```text
//! cargo run -p brokerfence-examples --example table_produce -- --queue thumbnails --count 100 --migrate
//! ```
//!
//! Job `i` (from `--start`, default 0) gets the key `<prefix>-<i>` and the payload `<body> <i>`.
//! Enqueueing a key that already exists is a no-op (running it twice sends nothing new), so the
//! line it prints, `EVENT produced queue=… count=N new=M`, says how many were new. PostgreSQL from
//! `--database-url`, else `DATABASE_URL`, else `localstack/.env`; `--migrate` applies the schema
//! migrations first, otherwise it refuses (exit 2) a schema older than this build needs.

use brokerfence::{FenceStore, JobKey, Owner, QueueName};

#[path = "support/cli.rs"]
mod common;

use common::StartError;

const PROG: &str = "table_produce";

/// Enqueues N jobs on a table queue (the fence's own PostgreSQL table), for table_worker: job i
/// gets the key <prefix>-<i> and the payload "<body> <i>". Prints `EVENT produced queue=… count=N
/// new=M`. Exit codes: 0 done, 1 failed, 2 refused.
#[derive(Debug, clap::Parser)]
#[command(name = PROG, help_template = common::HELP_TEMPLATE)]
struct Args {
    /// The queue
    #[arg(long, value_name = "NAME", required = true)]
    queue: Option<String>,
    /// How many jobs
    #[arg(long, value_name = "N", default_value_t = 10)]
    count: u64,
    /// The first job's number
    #[arg(long, value_name = "I", default_value_t = 0)]
    start: u64,
    /// Key prefix
    #[arg(long, value_name = "P", default_value = "job")]
    prefix: String,
    /// Payload text
    #[arg(long, value_name = "TEXT", default_value = "hello")]
    body: String,
    /// PostgreSQL URL (else DATABASE_URL, else localstack/.env)
    #[arg(long, value_name = "URL")]
    database_url: Option<String>,
    /// Schema of the fence tables
    #[arg(long, value_name = "NAME")]
    schema: Option<String>,
    /// Apply the schema migrations first (else refuse a schema older than this build)
    #[arg(long)]
    migrate: bool,
    /// Export spans by OTLP over HTTP to http://HOST:PORT; each enqueue statement stores its
    /// span's trace context with its jobs (needs the `otel` feature)
    #[arg(long, value_name = "URL", value_parser = common::otel::otlp_endpoint)]
    otlp_endpoint: Option<String>,
}

async fn produce(args: Args) -> Result<(), StartError> {
    let refuse = |e: brokerfence::FenceError| StartError::Refused(e.to_string());
    let queue = QueueName::new(args.queue.clone().unwrap_or_default()).map_err(refuse)?;
    let url = common::database_url(args.database_url.as_deref())?;
    let owner = Owner::unique(PROG);
    let store = common::connect_pg(&url, args.schema.as_deref(), &owner, args.migrate).await?;
    let mut new = 0;
    let ids: Vec<u64> = (args.start..args.start.saturating_add(args.count)).collect();
    for chunk in ids.chunks(500) {
        let mut jobs = Vec::with_capacity(chunk.len());
        for i in chunk {
            let key = JobKey::new(format!("{}-{i}", args.prefix)).map_err(refuse)?;
            jobs.push((key, format!("{} {i}", args.body).into_bytes()));
        }
        let span = tracing::info_span!("produce", queue = %queue, jobs = jobs.len());
        new += tracing::Instrument::instrument(store.enqueue_many(&queue, &jobs), span).await?;
    }
    common::event("produced", &[("queue", &queue), ("count", &args.count), ("new", &new)]);
    Ok(())
}

fn main() {
    brokerfence_testkit::services::load_dotenv();
    let code = common::run_program(PROG, "warn", common::parse(PROG, std::env::args().skip(1).collect()), produce);
    std::process::exit(code);
}
