//! A fenced SQS worker to copy: it reads an SQS queue, claims each message's job in PostgreSQL,
//! and calls an HTTP receiver carrying the job and its epoch (the fencing token) in the
//! `Fence-Queue` / `Fence-Job` / `Fence-Epoch` / `Fence-Owner` headers, so the receiver can refuse
//! a superseded (zombie) worker's late call.
//!
//! ```text
//! cargo run --features sqs --example sqs_worker -- \
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

use brokerfence::adapters::sqs::{
    DeadLetterTarget, KeyStrategy, ReceiveCountCheck, SqsConfig, SqsSource, client_from_env,
};
use brokerfence::adapters::{Consumer, ConsumerConfig, Source};
use brokerfence::fence::{FenceError, FenceStore, JobContext, LeaseDuration, SupervisorConfig};

#[path = "support/cli.rs"]
mod common;

use common::{CallReceiver, Cli, CliExit, Common, EventSource, EventStore, StartError};

const PROG: &str = "sqs_worker";

fn usage() -> String {
    format!(
        "usage: sqs_worker --queue-url URL [--wait SECS=20] [--dead-letter-queue URL|discover|none]
       [--key auto|message-id|dedup-id|attr:NAME|binary-attr:NAME|body:FIELD]
       [--no-cancel-on-loss (test builds with feature guard-switches only)]
{}",
        common::COMMON_USAGE
    )
}

struct Args {
    common: Common,
    queue_url: String,
    wait: u64,
    key: KeyStrategy,
    dead_letter: DeadLetterTarget,
    no_cancel_on_loss: bool,
}

fn parse_args(raw: Vec<String>) -> Result<Args, CliExit> {
    let mut args = Args {
        common: Common::default(),
        queue_url: std::env::var("SQS_QUEUE_URL").unwrap_or_default(),
        wait: 20,
        key: KeyStrategy::Auto,
        dead_letter: DeadLetterTarget::Discover,
        no_cancel_on_loss: false,
    };
    let mut cli = Cli::new(raw);
    while let Some(flag) = cli.next_flag() {
        let mut flag = flag?;
        if args.common.take(&mut flag)? {
            continue;
        }
        match flag.name.as_str() {
            "--queue-url" => args.queue_url = flag.value()?,
            "--wait" => args.wait = flag.num()?,
            "--key" => args.key = parse_key(&flag.value()?)?,
            "--dead-letter-queue" => {
                args.dead_letter = match flag.value()?.as_str() {
                    "discover" => DeadLetterTarget::Discover,
                    "none" => DeadLetterTarget::None,
                    url => DeadLetterTarget::Queue(url.to_owned()),
                }
            }
            "--no-cancel-on-loss" => args.no_cancel_on_loss = flag.switch()?,
            "--build-info" => {
                // For the tests: which test-only switches this build has.
                let on = true; // the examples always build with the members' `guard-switches`
                common::event("build", &[("guard-switches", &on)]);
                std::process::exit(0);
            }
            _ => return Err(flag.unknown()),
        }
    }
    if args.queue_url.is_empty() {
        return Err(CliExit::Usage("--queue-url (or SQS_QUEUE_URL) is required".into()));
    }
    Ok(args)
}

fn parse_key(v: &str) -> Result<KeyStrategy, CliExit> {
    Ok(match v.split_once(':') {
        None if v == "auto" => KeyStrategy::Auto,
        None if v == "message-id" => KeyStrategy::MessageId,
        None if v == "dedup-id" => KeyStrategy::DeduplicationId,
        Some(("attr", name)) => KeyStrategy::attribute(name),
        Some(("binary-attr", name)) => KeyStrategy::binary_attribute(name),
        Some(("body", field)) => KeyStrategy::body_field(field),
        _ => return Err(CliExit::Usage(format!("unknown key strategy {v:?}"))),
    })
}

async fn serve(args: Args) -> Result<(), StartError> {
    let c = &args.common;
    let refuse = |e: FenceError| StartError::Refused(e.to_string());
    let owner = c.owner("sqs-worker").map_err(refuse)?;
    let lease = LeaseDuration::from_secs(c.lease).map_err(refuse)?;
    let url = common::database_url(c.database_url.as_deref())?;
    let store: Arc<dyn FenceStore> = Arc::new(common::connect_pg(&url, c.schema.as_deref(), &owner, c.migrate).await?);

    let config = SqsConfig::new(args.queue_url.clone())
        .map_err(|e| StartError::Refused(e.to_string()))?
        .key(args.key.clone())
        .wait_time(Duration::from_secs(args.wait))
        .dead_letter(args.dead_letter.clone())
        .check_receive_count(c.retry_policy(), ReceiveCountCheck::Warn);
    let source = EventSource(SqsSource::new(client_from_env().await, config));

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
    common::ready(&owner, &[("queue", &queue), ("source", &"sqs"), ("queue_url", &args.queue_url)]);
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
    common::run_program(PROG, &usage, "info", parse_args(raw), serve)
}

fn main() {
    // Before any thread exists: copies localstack/.env into the environment for the AWS SDK.
    brokerfence_testkit::services::load_dotenv();
    std::process::exit(run(std::env::args().skip(1).collect()));
}
