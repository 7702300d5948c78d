//! A fenced table-queue worker to copy: the jobs live in the fence's own PostgreSQL table (no
//! broker), the claim is the receive, and each job's handler calls an HTTP receiver carrying the
//! job and its epoch (the fencing token) in the `Fence-Queue` / `Fence-Job` / `Fence-Epoch` /
//! `Fence-Owner` headers, so the receiver can refuse a superseded (zombie) worker's late call.
//! Same flags and `EVENT` lines as `examples/sqs_worker.rs` and `examples/redis_worker.rs`.
//!
//! ```text
//! cargo run -p brokerfence-examples --example table_produce -- --queue thumbnails --count 100 --migrate
//! cargo run -p brokerfence-examples --example table_worker -- --queue thumbnails \
//!     --receiver-url http://127.0.0.1:8080/apply --lease 30
//! ```
//!
//! Configuration: PostgreSQL from `--database-url`, else `DATABASE_URL`, else `localstack/.env`.
//! The schema must be migrated (`--migrate` here or on `table_produce`, or `FenceStore::migrate`
//! in your deploy step): without `--migrate` the worker checks it and refuses to start (exit 2)
//! when it is older than this build needs.
//!
//! It prints one machine-readable `EVENT <name> key=value …` line per step to stdout (logs go to
//! stderr); `examples/README.md` lists them all. SIGTERM or Ctrl-C stops it gracefully: no more
//! claims, running jobs get `--grace` to finish, the rest are released.

use std::time::Duration;

use brokerfence::JobContext;

#[path = "support/cli.rs"]
mod common;

use common::{CallReceiver, Common, StartError};

const PROG: &str = "table_worker";

/// A fenced table-queue worker: claims jobs from the fence's own PostgreSQL table and calls an
/// HTTP receiver with each job's fencing stamp. Prints `EVENT` lines on stdout
/// (examples/README.md). Exit codes: 0 stopped by SIGTERM/Ctrl-C, 1 failed, 2 refused.
#[derive(Debug, clap::Parser)]
#[command(name = PROG, help_template = common::HELP_TEMPLATE)]
struct Args {
    /// The queue (a name in the fence's jobs table)
    #[arg(long, value_name = "NAME", required = true)]
    queue: Option<String>,
    /// Milliseconds between polls of an idle queue when no wake-up comes
    #[arg(long, value_name = "MS", default_value = "1000", value_parser = common::millis)]
    idle_wait: Duration,
    #[command(flatten)]
    common: Common,
}

fn parse_args(raw: Vec<String>) -> Result<Args, clap::Error> {
    common::parse(PROG, raw)
}

async fn serve(args: Args) -> Result<(), StartError> {
    let (owner, queue, consumer) =
        common::table_consumer(&args.common, "table-worker", args.queue.as_deref(), args.idle_wait).await?;
    let reporter = common::spawn_metrics(consumer.metrics());
    let call = CallReceiver::new(&args.common);
    let handler = move |ctx: JobContext| call.clone().handle(ctx);

    let stop = common::shutdown_on_signals();

    common::ready(&owner, &[("queue", &queue), ("source", &"table")]);
    let result = consumer.run(handler, stop).await;
    reporter.abort();
    println!("EVENT stopped {}", consumer.metrics().snapshot());
    result.map_err(|e| StartError::Failed(e.to_string()))
}

/// Runs the worker with command-line arguments (without the program name); the exit code.
pub fn run(raw: Vec<String>) -> i32 {
    common::run_program(PROG, "info", parse_args(raw), serve)
}

fn main() {
    brokerfence_testkit::services::load_dotenv();
    std::process::exit(run(std::env::args().skip(1).collect()));
}
