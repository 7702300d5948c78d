//! A fenced table-queue worker whose handler is a tower service stack (feature `tower`): a
//! tracing span per job (a small layer, below), then tower's `TimeoutLayer`, then the work.
//! `brokerfence::tower::handler` turns the stack into the consumer's handler; a job past
//! `--timeout` is a failed attempt (retried after its backoff, dead after `--max-attempts`), and
//! only a result the fence committed is acknowledged, as with any handler.
//!
//! ```text
//! cargo run -p brokerfence-examples --example table_produce -- --queue resize --count 10 --migrate
//! cargo run -p brokerfence-examples --features tower --example tower_worker -- --queue resize --timeout 2000
//! ```
//!
//! A job whose payload is `sleep:<ms>` sleeps that long before it returns (to show the timeout);
//! any other payload returns at once, its result `<owner>@<epoch>`. Same common flags, exit codes
//! and `EVENT` lines as `examples/table_worker.rs` (`examples/README.md`); the span layer prints
//! `claimed`, then `handled` or `failed` (`error="request timed out"` for a timeout).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use brokerfence::BoxError;
use brokerfence::{JobContext, JobError};
use tower::{Layer, Service, ServiceBuilder};
use tracing::Instrument;

#[path = "support/cli.rs"]
mod common;

use common::{Common, StartError, lease_event};

const PROG: &str = "tower_worker";

/// A fenced table-queue worker whose handler is a tower stack (tracing span, timeout). Prints
/// `EVENT` lines on stdout (examples/README.md). Exit codes: 0 stopped by SIGTERM/Ctrl-C, 1
/// failed, 2 refused.
#[derive(Debug, clap::Parser)]
#[command(name = PROG, help_template = common::HELP_TEMPLATE)]
struct Args {
    /// The queue (a name in the fence's jobs table)
    #[arg(long, value_name = "NAME", required = true)]
    queue: Option<String>,
    /// Milliseconds one attempt may take (tower's TimeoutLayer) before it fails
    #[arg(long, value_name = "MS", default_value = "5000", value_parser = common::millis)]
    timeout: Duration,
    /// Milliseconds between polls of an idle queue when no wake-up comes
    #[arg(long, value_name = "MS", default_value = "1000", value_parser = common::millis)]
    idle_wait: Duration,
    #[command(flatten)]
    common: Common,
}

/// The tracing layer: each job runs in a `job` span (queue, key, epoch, owner), ends with an
/// event carrying its outcome and duration, and prints the worker's `EVENT` lines.
#[derive(Clone, Copy)]
struct JobSpanLayer;

impl<S> Layer<S> for JobSpanLayer {
    type Service = JobSpan<S>;
    fn layer(&self, inner: S) -> JobSpan<S> {
        JobSpan(inner)
    }
}

#[derive(Clone)]
struct JobSpan<S>(S);

impl<S> Service<JobContext> for JobSpan<S>
where
    S: Service<JobContext, Error = BoxError>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = JobError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, JobError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), JobError>> {
        self.0.poll_ready(cx).map_err(JobError::from_boxed)
    }

    fn call(&mut self, ctx: JobContext) -> Self::Future {
        let lease = ctx.lease().clone();
        let span = tracing::info_span!("job", queue = %lease.queue, key = %lease.key, epoch = lease.epoch, owner = %lease.owner);
        lease_event("claimed", &lease, &[("attempt", &lease.attempts)]);
        let started = Instant::now();
        let call = self.0.call(ctx);
        Box::pin(
            async move {
                let result = call.await.map_err(JobError::from_boxed);
                let ms = started.elapsed().as_millis();
                match &result {
                    Ok(_) => {
                        tracing::info!(ms, "job handled");
                        lease_event("handled", &lease, &[]);
                    }
                    Err(e) => {
                        tracing::warn!(ms, error = %e, retry = e.retry, "job failed");
                        lease_event("failed", &lease, &[("retry", &e.retry), ("error", &e.message)]);
                    }
                }
                result
            }
            .instrument(span),
        )
    }
}

/// The work: `sleep:<ms>` sleeps, then every job answers `<owner>@<epoch>`.
async fn work(ctx: JobContext) -> Result<String, JobError> {
    if let Some(ms) = std::str::from_utf8(ctx.payload()).ok().and_then(|p| p.strip_prefix("sleep:")) {
        let ms: u64 = ms.trim().parse().map_err(|e| JobError::fatal(format!("bad sleep payload: {e}")))?;
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    Ok(format!("{}@{}", ctx.owner(), ctx.epoch()))
}

async fn serve(args: Args) -> Result<(), StartError> {
    let (owner, queue, consumer) =
        common::table_consumer(&args.common, "tower-worker", args.queue.as_deref(), args.idle_wait).await?;
    let reporter = common::spawn_metrics(consumer.metrics());

    // Outermost first: the span sees the timeout's error; the timeout bounds the work.
    let stack = ServiceBuilder::new().layer(JobSpanLayer).timeout(args.timeout).service_fn(work);
    let handler = brokerfence::tower::handler(stack);

    let stop = common::shutdown_on_signals();
    let timeout_ms = args.timeout.as_millis();
    common::ready(&owner, &[("queue", &queue), ("source", &"table"), ("timeout_ms", &timeout_ms)]);
    let result = consumer.run(handler, stop).await;
    reporter.abort();
    println!("EVENT stopped {}", consumer.metrics().snapshot());
    result.map_err(|e| StartError::Failed(e.to_string()))
}

/// Runs the worker with command-line arguments (without the program name); the exit code.
pub fn run(raw: Vec<String>) -> i32 {
    common::run_program(PROG, "info", common::parse(PROG, raw), serve)
}

fn main() {
    brokerfence_testkit::services::load_dotenv();
    std::process::exit(run(std::env::args().skip(1).collect()));
}
