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
//! credentials), PostgreSQL from `DATABASE_URL`; both fall back to `localstack/.env`. The queue URL
//! and receiver URL may also come from `SQS_QUEUE_URL` and `RECEIVER_URL`.
//!
//! It prints one machine-readable `EVENT <name> key=value …` line per step to stdout (logs go to
//! stderr), which the tests use to drive it as a zombie:
//! `ready`, `claimed`, `calling`, `called`, `handled`, `dropped` (the attempt was cancelled: its
//! lease was lost), `metrics` (whenever a counter changed) and `stopped`.
//! SIGTERM or Ctrl-C stops it gracefully: no more receives, running jobs get `--grace` to finish,
//! the rest are released and their messages made visible again.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use brokerfence::adapters::sqs::{KeyStrategy, SqsConfig, SqsSource, client_from_env};
use brokerfence::adapters::{Consumer, ConsumerConfig, shutdown_signal};
use brokerfence::fence::wire::FenceStamp;
use brokerfence::fence::{
    FenceStore, JobContext, JobError, LeaseDuration, Owner, PgFence, SchemaName, SupervisorConfig,
};

const USAGE: &str = "usage: sqs_worker --queue-url URL [--receiver-url URL] [--lease SECS=30] [--owner NAME]
       [--schema NAME] [--concurrency N=16] [--wait SECS=20] [--handler-delay MS=0]
       [--after-call-delay MS=0] [--grace MS=30000]
       [--key auto|message-id|dedup-id|attr:NAME|binary-attr:NAME|body:FIELD]
       [--no-cancel-on-loss (test builds with feature guard-switches only)]";

#[derive(Debug)]
struct Args {
    queue_url: String,
    receiver_url: Option<String>,
    lease: u64,
    owner: Option<String>,
    schema: Option<String>,
    concurrency: usize,
    wait: u64,
    handler_delay: Duration,
    after_call_delay: Duration,
    grace: Duration,
    key: KeyStrategy,
    no_cancel_on_loss: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        queue_url: std::env::var("SQS_QUEUE_URL").unwrap_or_default(),
        receiver_url: std::env::var("RECEIVER_URL").ok().filter(|s| !s.is_empty()),
        lease: 30,
        owner: None,
        schema: None,
        concurrency: 16,
        wait: 20,
        handler_delay: Duration::ZERO,
        after_call_delay: Duration::ZERO,
        grace: Duration::from_secs(30),
        key: KeyStrategy::Auto,
        no_cancel_on_loss: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n.to_owned(), Some(v.to_owned())),
            _ => (arg.clone(), None),
        };
        if name == "--no-cancel-on-loss" {
            args.no_cancel_on_loss = true;
            continue;
        }
        if name == "--build-info" {
            // For the tests: which test-only switches this build has.
            event("build", &format!("guard-switches={}", cfg!(feature = "guard-switches")));
            std::process::exit(0);
        }
        if name == "--help" || name == "-h" {
            return Err(USAGE.to_owned());
        }
        let value = match inline.or_else(|| it.next()) {
            Some(v) => v,
            None => return Err(format!("{name} needs a value\n{USAGE}")),
        };
        let num = |v: &str| v.parse::<u64>().map_err(|e| format!("{name} {v:?}: {e}"));
        match name.as_str() {
            "--queue-url" => args.queue_url = value,
            "--receiver-url" => args.receiver_url = Some(value),
            "--lease" => args.lease = num(&value)?,
            "--owner" => args.owner = Some(value),
            "--schema" => args.schema = Some(value),
            "--concurrency" => args.concurrency = usize::try_from(num(&value)?).unwrap_or(1),
            "--wait" => args.wait = num(&value)?,
            "--handler-delay" => args.handler_delay = Duration::from_millis(num(&value)?),
            "--after-call-delay" => args.after_call_delay = Duration::from_millis(num(&value)?),
            "--grace" => args.grace = Duration::from_millis(num(&value)?),
            "--key" => args.key = parse_key(&value)?,
            other => return Err(format!("unknown argument {other}\n{USAGE}")),
        }
    }
    if args.queue_url.is_empty() {
        return Err(format!("--queue-url (or SQS_QUEUE_URL) is required\n{USAGE}"));
    }
    Ok(args)
}

fn parse_key(v: &str) -> Result<KeyStrategy, String> {
    Ok(match v.split_once(':') {
        None if v == "auto" => KeyStrategy::Auto,
        None if v == "message-id" => KeyStrategy::MessageId,
        None if v == "dedup-id" => KeyStrategy::DeduplicationId,
        Some(("attr", name)) => KeyStrategy::attribute(name),
        Some(("binary-attr", name)) => KeyStrategy::binary_attribute(name),
        Some(("body", field)) => KeyStrategy::body_field(field),
        _ => return Err(format!("unknown key strategy {v:?}\n{USAGE}")),
    })
}

/// One machine-readable line on stdout.
fn event(name: &str, fields: &str) {
    println!("EVENT {name} {fields}");
}

/// Prints `EVENT dropped` if the attempt is cancelled (its future dropped) before it finished.
struct DropWatch {
    fields: String,
    finished: bool,
}

impl Drop for DropWatch {
    fn drop(&mut self) {
        if !self.finished {
            event("dropped", &self.fields);
        }
    }
}

/// The handler: calls the receiver with the job's fencing stamp, commits the owner and epoch.
async fn handle(
    ctx: JobContext,
    http: reqwest::Client,
    receiver: Option<Arc<str>>,
    delay: Duration,
    after_call: Duration,
) -> Result<Vec<u8>, JobError> {
    let stamp = FenceStamp::of_lease(ctx.lease());
    let fields = format!("key={} epoch={} owner={}", ctx.key(), ctx.epoch(), ctx.owner());
    let mut watch = DropWatch { fields: fields.clone(), finished: false };
    event("claimed", &fields);
    tokio::time::sleep(delay).await;
    if let Some(url) = receiver.as_deref() {
        event("calling", &fields);
        let mut request = http.post(url).body(ctx.payload().to_vec());
        for (name, value) in stamp.to_headers() {
            request = request.header(name, value);
        }
        let response = request.send().await.map_err(|e| JobError::retry(format!("receiver unreachable: {e}")))?;
        let status = response.status().as_u16();
        event("called", &format!("{fields} status={status}"));
        match status {
            200..=299 => {}
            // The receiver has seen a newer epoch: this worker was superseded. The fenced
            // failure below is refused by the database too; nothing is acknowledged.
            409 => return Err(JobError::retry(format!("receiver refused epoch {}: superseded", ctx.epoch()))),
            s => return Err(JobError::retry(format!("receiver answered {s}"))),
        }
    }
    tokio::time::sleep(after_call).await;
    watch.finished = true;
    event("handled", &fields);
    Ok(format!("{}@{}", ctx.owner(), ctx.epoch()).into_bytes())
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let database_url = brokerfence::services::var("DATABASE_URL")
        .ok_or("DATABASE_URL is not set (run localstack/up, which writes localstack/.env)")?;
    let mut store = PgFence::connect(&database_url).await?;
    if let Some(schema) = &args.schema {
        store = store.with_schema(SchemaName::new(schema.clone())?);
    }
    store.migrate().await?;
    let store: Arc<dyn FenceStore> = Arc::new(store);

    let config =
        SqsConfig::new(args.queue_url.clone())?.key(args.key.clone()).wait_time(Duration::from_secs(args.wait));
    let source = SqsSource::new(client_from_env().await, config);

    #[allow(unused_mut)]
    let mut supervisor = SupervisorConfig::new(LeaseDuration::from_secs(args.lease)?);
    if args.no_cancel_on_loss {
        #[cfg(feature = "guard-switches")]
        {
            supervisor = supervisor.without_cancel_on_loss();
        }
        #[cfg(not(feature = "guard-switches"))]
        return Err("--no-cancel-on-loss needs a build with feature guard-switches".into());
    }
    let config = ConsumerConfig::new(supervisor).concurrency(args.concurrency).grace(args.grace);
    let owner = match &args.owner {
        Some(o) => Owner::new(o.clone())?,
        None => Owner::unique("sqs-worker"),
    };
    let consumer = Consumer::with_owner(source, store, owner.clone(), config);

    let metrics = consumer.metrics();
    let reporter = tokio::spawn(async move {
        let mut last = metrics.snapshot();
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let now = metrics.snapshot();
            if now != last {
                event("metrics", &now.to_string());
                last = now;
            }
        }
    });

    let http = reqwest::Client::new();
    let receiver: Option<Arc<str>> = args.receiver_url.as_deref().map(Arc::from);
    let (delay, after_call) = (args.handler_delay, args.after_call_delay);
    let handler = move |ctx: JobContext| handle(ctx, http.clone(), receiver.clone(), delay, after_call);

    event("ready", &format!("owner={owner} queue={}", args.queue_url));
    let result = consumer.run(handler, shutdown_signal()).await;
    // A long poll the consumer abandoned at shutdown may still hand out messages: wait for it, so
    // they are made visible again now rather than after their visibility timeout.
    consumer.source().release_unstarted(args.grace.max(Duration::from_secs(1))).await;
    reporter.abort();
    event("stopped", &consumer.metrics().snapshot().to_string());
    Ok(result?)
}

fn main() -> ExitCode {
    // Before any thread exists: copies localstack/.env into the environment for the AWS SDK.
    brokerfence::services::load_dotenv();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sqs_worker: {e}");
            ExitCode::FAILURE
        }
    }
}
