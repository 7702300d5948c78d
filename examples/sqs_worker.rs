//! A fenced SQS worker to copy: it reads an SQS queue, claims each message's job in PostgreSQL,
//! and calls an HTTP receiver carrying the job and its epoch (the fencing token) in the
//! `Fence-Queue` / `Fence-Job` / `Fence-Epoch` / `Fence-Owner` headers, so the receiver can refuse
//! a superseded (zombie) worker's late call.
//!
//! ```text
//! cargo run -p brokerfence-examples --features sqs --example sqs_worker -- \
//!     --queue-url http://127.0.0.1:4566/000000000000/orders \
//!     --receiver-url http://127.0.0.1:8080/apply --lease 30
//! ```
//!
//! Configuration: AWS from the standard environment (`AWS_ENDPOINT_URL_SQS`, `AWS_REGION`,
//! credentials), PostgreSQL from `--database-url` or `DATABASE_URL`; both fall back to
//! `localstack/.env`. The queue URL and receiver URL may also come from `SQS_QUEUE_URL` and
//! `RECEIVER_URL`.
//!
//! It prints one machine-readable `EVENT <name> key=value …` line per step to stdout (logs go to
//! stderr; `examples/README.md` lists every line and every flag), which the tests use to drive it
//! as a zombie. SIGTERM or Ctrl-C stops it gracefully: no more receives, running jobs get
//! `--grace` to finish, the rest are released and their messages made visible again.
//!
//! The schema must be migrated (`--migrate`, or `FenceStore::migrate` in your deploy step):
//! without `--migrate` the worker checks it and refuses to start (exit 2) when it is older than
//! this build needs.

use std::sync::Arc;
use std::time::Duration;

use brokerfence::sqs::{DeadLetterTarget, KeyStrategy, ReceiveCountCheck, SqsConfig, SqsError, SqsSource};
use brokerfence::{Consumer, ConsumerConfig, Source};
use brokerfence::{FenceError, FenceStore, JobContext, LeaseDuration, SupervisorConfig};

#[path = "support/cli.rs"]
mod common;

use common::{CallReceiver, Common, EventSource, EventStore, StartError};

const PROG: &str = "sqs_worker";

/// A fenced SQS worker: reads an SQS queue, claims each message's job in PostgreSQL, and calls
/// an HTTP receiver with the job's fencing stamp. Prints `EVENT` lines on stdout
/// (examples/README.md). Exit codes: 0 stopped by SIGTERM/Ctrl-C, 1 failed, 2 refused (bad
/// command line, unusable queue URL or database URL, schema too old, queue missing).
#[derive(Debug, clap::Parser)]
#[command(name = PROG, help_template = common::HELP_TEMPLATE)]
struct Args {
    /// The queue's URL (else SQS_QUEUE_URL)
    #[arg(long, value_name = "URL")]
    queue_url: Option<String>,
    /// Long-poll wait of a receive, in seconds
    #[arg(long, value_name = "SECS", default_value_t = 20)]
    wait: u64,
    /// Dead-letter queue: its URL, `discover` (the queue's RedrivePolicy) or `none`
    #[arg(long = "dead-letter-queue", value_name = "URL|discover|none", default_value = "discover", value_parser = parse_dead_letter)]
    dead_letter: DeadLetterTarget,
    /// Job key of a message: auto, message-id, dedup-id, attr:NAME, binary-attr:NAME or body:FIELD
    #[arg(long, value_name = "STRATEGY", default_value = "auto", value_parser = parse_key)]
    key: KeyStrategy,
    /// Test only (the members' guard-switches, on in example builds): keep running a job whose lease was lost
    #[arg(long)]
    no_cancel_on_loss: bool,
    /// For the tests: print which test-only switches this build has, and exit
    #[arg(long, hide = true)]
    build_info: bool,
    #[command(flatten)]
    common: Common,
}

fn parse_args(raw: Vec<String>) -> Result<Args, clap::Error> {
    let mut args: Args = common::parse(PROG, raw)?;
    if args.build_info {
        // For the tests: which test-only switches this build has.
        let on = true; // the examples always build with the members' `guard-switches`
        common::event("build", &[("guard-switches", &on)]);
        std::process::exit(0);
    }
    args.queue_url = args.queue_url.or_else(|| std::env::var("SQS_QUEUE_URL").ok()).filter(|u| !u.is_empty());
    if args.queue_url.is_none() {
        return Err(common::usage_error::<Args>("--queue-url (or SQS_QUEUE_URL) is required"));
    }
    Ok(args)
}

fn parse_dead_letter(v: &str) -> Result<DeadLetterTarget, String> {
    Ok(match v {
        "discover" => DeadLetterTarget::Discover,
        "none" => DeadLetterTarget::None,
        url => DeadLetterTarget::Queue(url.to_owned()),
    })
}

fn parse_key(v: &str) -> Result<KeyStrategy, String> {
    Ok(match v.split_once(':') {
        None if v == "auto" => KeyStrategy::Auto,
        None if v == "message-id" => KeyStrategy::MessageId,
        None if v == "dedup-id" => KeyStrategy::DeduplicationId,
        Some(("attr", name)) => KeyStrategy::attribute(name),
        Some(("binary-attr", name)) => KeyStrategy::binary_attribute(name),
        Some(("body", field)) => KeyStrategy::body_field(field),
        _ => return Err(format!("unknown key strategy {v:?}")),
    })
}

async fn serve(args: Args) -> Result<(), StartError> {
    let c = &args.common;
    let refuse = |e: FenceError| StartError::Refused(e.to_string());
    let owner = c.owner("sqs-worker").map_err(refuse)?;
    let lease = LeaseDuration::from_secs(c.lease).map_err(refuse)?;
    c.serve_metrics().await?;
    let url = common::database_url(c.database_url.as_deref())?;
    let store: Arc<dyn FenceStore> = Arc::new(common::connect_pg(&url, c.schema.as_deref(), &owner, c.migrate).await?);

    let queue_url = args.queue_url.clone().unwrap_or_default();
    let config = SqsConfig::new(queue_url.clone())
        .map_err(|e| StartError::Refused(e.to_string()))?
        .key(args.key.clone())
        .wait_time(Duration::from_secs(args.wait))
        .dead_letter(args.dead_letter.clone())
        .check_receive_count(c.retry_policy(), ReceiveCountCheck::Warn);
    let source = SqsSource::new(
        brokerfence::sqs::client(brokerfence::sqs::aws_config::from_env(), brokerfence::sqs::SqsTimeouts::default())
            .await,
        config,
    );
    // Before `ready`: a queue that does not exist (exit 2) or an endpoint that does not answer
    // after a few attempts (exit 1) stops the worker with one line saying so.
    source.check().await.map_err(|e| match e {
        // The library names SqsConfig::new; this program's queue URL comes from a flag or a variable.
        SqsError::QueueNotFound { .. } => StartError::Refused(format!("{e} (here: --queue-url or SQS_QUEUE_URL)")),
        e => StartError::Failed(e.to_string()),
    })?;
    let source = EventSource(source);

    #[allow(unused_mut)]
    let mut supervisor = SupervisorConfig::new(lease).retry(c.retry_policy());
    if args.no_cancel_on_loss {
        {
            supervisor = supervisor.without_cancel_on_loss();
        }
    }
    let config = ConsumerConfig::new(supervisor).concurrency(c.concurrency).grace(c.grace);
    let consumer = Consumer::with_owner(source, Arc::new(EventStore(store)), owner.clone(), config);
    consumer.supervisor().add_hook(Arc::new(common::LostHook));
    let reporter = common::spawn_metrics(consumer.metrics());
    let call = CallReceiver::new(c);
    let handler = move |ctx: JobContext| call.clone().handle(ctx);

    let stop = common::shutdown_on_signals();

    let queue = consumer.source().0.queue().clone();
    common::ready(&owner, &[("queue", &queue), ("source", &"sqs"), ("queue_url", &queue_url)]);
    let result = consumer.run(handler, stop).await;
    // A long poll the consumer abandoned at shutdown may still hand out messages: wait for it, so
    // they are made visible again now rather than after their visibility timeout.
    consumer.source().0.release_unstarted(c.grace.max(Duration::from_secs(1))).await;
    reporter.abort();
    println!("EVENT stopped {}", consumer.metrics().snapshot());
    result.map_err(|e| StartError::Failed(e.to_string()))
}

/// Runs the worker with command-line arguments (without the program name); the exit code.
pub fn run(raw: Vec<String>) -> i32 {
    common::run_program(PROG, "info", parse_args(raw), serve)
}

fn main() {
    // Before any thread exists: copies localstack/.env into the environment for the AWS SDK.
    brokerfence_testkit::services::load_dotenv();
    std::process::exit(run(std::env::args().skip(1).collect()));
}
