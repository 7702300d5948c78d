//! A fenced Redis worker to copy: it reads a stream as a consumer group (or a reliable list),
//! claims each entry's job in PostgreSQL, and calls an HTTP receiver carrying the job and its epoch
//! (the fencing token) in the `Fence-Queue` / `Fence-Job` / `Fence-Epoch` / `Fence-Owner` headers,
//! so the receiver can refuse a superseded (zombie) worker's late call. Same convention as
//! `examples/sqs_worker.rs`.
//!
//! ```text
//! cargo run -p brokerfence-examples --features redis --example redis_worker -- \
//!     --stream orders --group billing --key-field key \
//!     --receiver-url http://127.0.0.1:8080/apply --lease 30
//! ```
//!
//! Configuration: Redis from `--redis-url` or `REDIS_URL`, PostgreSQL from `--database-url` or
//! `DATABASE_URL`; both fall back to `localstack/.env`. Entries carry their payload in the field
//! `body` (and, with `--key-field`, the job key in that field; by default the entry id is the key).
//!
//! It prints one machine-readable `EVENT <name> key=value …` line per step to stdout (logs go to
//! stderr; `examples/README.md` lists every line and every flag), which the tests use to drive it
//! as a zombie. SIGTERM or Ctrl-C stops it gracefully: no more reads, running jobs get `--grace`
//! to finish, the rest are released and their entries made claimable at once.
//!
//! The schema must be migrated (`--migrate`, or `FenceStore::migrate` in your deploy step):
//! without `--migrate` the worker checks it and refuses to start (exit 2) when it is older than
//! this build needs.

#[path = "support/cli.rs"]
mod common;

#[cfg(feature = "redis")]
fn main() {
    brokerfence_testkit::services::load_dotenv();
    std::process::exit(run(std::env::args().skip(1).collect()));
}

#[cfg(not(feature = "redis"))]
fn main() {
    eprintln!(
        "redis_worker needs the `redis` feature: cargo run -p brokerfence-examples --features redis --example redis_worker"
    );
    std::process::exit(2);
}

#[cfg(feature = "redis")]
pub use worker::run;

#[cfg(feature = "redis")]
mod worker {
    use std::sync::Arc;
    use std::time::Duration;

    use brokerfence::redis::{ItemKey, KeyFrom, RedisConnections, RedisError, ReliableList, StreamSource};
    use brokerfence::{Consumer, ConsumerConfig, Handler, Source};
    use brokerfence::{FenceError, FenceStore, JobContext, LeaseDuration, Owner, QueueName, SupervisorConfig};

    use super::common::{self, CallReceiver, Common, EventSource, EventStore, StartError};

    const PROG: &str = "redis_worker";

    /// A fenced Redis worker: reads a stream as a consumer group (or a reliable list), claims
    /// each entry's job in PostgreSQL, and calls an HTTP receiver with the job's fencing stamp.
    /// Prints `EVENT` lines on stdout (examples/README.md). Exit codes: 0 stopped by
    /// SIGTERM/Ctrl-C, 1 failed, 2 refused.
    #[derive(clap::Parser)]
    #[command(name = PROG, help_template = common::HELP_TEMPLATE)]
    struct Args {
        /// Read this stream as a consumer group (give --stream or --list)
        #[arg(long, value_name = "KEY", required_unless_present = "list", conflicts_with = "list")]
        stream: Option<String>,
        /// Read this list reliably (BLMOVE to a processing list); needs --item-key
        #[arg(long, value_name = "KEY")]
        list: Option<String>,
        /// Consumer group of the stream
        #[arg(long, value_name = "NAME", default_value = "workers")]
        group: String,
        /// Queue name in the fence (default: the stream or list key)
        #[arg(long, value_name = "NAME")]
        queue: Option<String>,
        /// Stream field holding the job key (default: the entry id is the key)
        #[arg(long, value_name = "FIELD")]
        key_field: Option<String>,
        /// Job key of a list item: `hash` (identical items are one job) or `split:C` (the item
        /// names its job before the byte C)
        #[arg(long, value_name = "hash|split:C", value_parser = parse_item_key)]
        item_key: Option<ItemKey>,
        /// Milliseconds a read blocks
        #[arg(long, value_name = "MS", default_value = "2000", value_parser = common::millis)]
        block: Duration,
        /// Milliseconds before a stream entry's holder counts as gone (stream only)
        #[arg(long, value_name = "MS", value_parser = common::millis)]
        visibility: Option<Duration>,
        /// Milliseconds between XAUTOCLAIM rounds (stream only)
        #[arg(long, value_name = "MS", default_value = "1000", value_parser = common::millis)]
        autoclaim_every: Duration,
        /// Deliveries of an entry before it is dead-lettered (stream only)
        #[arg(long, value_name = "N", default_value_t = 10)]
        max_deliveries: u32,
        /// Redis URL, redis://HOST:PORT (else REDIS_URL, else localstack/.env)
        #[arg(long, value_name = "URL")]
        redis_url: Option<String>,
        #[command(flatten)]
        common: Common,
    }

    fn parse_item_key(v: &str) -> Result<ItemKey, String> {
        match v {
            "hash" => Ok(ItemKey::ContentHash),
            v => match v.strip_prefix("split:").map(str::as_bytes) {
                Some([c]) => Ok(ItemKey::Split(*c)),
                _ => Err(format!("{v:?}: expected hash or split:C")),
            },
        }
    }

    fn parse_args(raw: Vec<String>) -> Result<Args, clap::Error> {
        common::parse(PROG, raw)
    }

    async fn consume<S: Source, H: Handler>(
        source: S,
        store: Arc<dyn FenceStore>,
        owner: Owner,
        config: ConsumerConfig,
        handler: H,
        what: &[(&str, &dyn std::fmt::Display)],
    ) -> Result<(), StartError> {
        let consumer = Consumer::with_owner(EventSource(source), Arc::new(EventStore(store)), owner.clone(), config);
        consumer.supervisor().add_hook(Arc::new(common::LostHook));
        let reporter = common::spawn_metrics(consumer.metrics());
        let stop = common::shutdown_on_signals();
        common::ready(&owner, what);
        let result = consumer.run(handler, stop).await;
        reporter.abort();
        println!("EVENT stopped {}", consumer.metrics().snapshot());
        result.map_err(|e| StartError::Failed(e.to_string()))
    }

    async fn serve(args: Args) -> Result<(), StartError> {
        let c = &args.common;
        let refuse = |e: FenceError| StartError::Refused(e.to_string());
        let owner = c.owner("redis-worker").map_err(refuse)?;
        let lease = LeaseDuration::from_secs(c.lease).map_err(refuse)?;
        c.serve_metrics().await?;
        let redis_url =
            args.redis_url.clone().or_else(|| brokerfence_testkit::services::var("REDIS_URL")).ok_or_else(|| {
                StartError::Refused("no Redis: give --redis-url or set REDIS_URL (localstack/up writes it)".into())
            })?;
        let url = common::database_url(c.database_url.as_deref())?;
        let store: Arc<dyn FenceStore> =
            Arc::new(common::connect_pg(&url, c.schema.as_deref(), &owner, c.migrate).await?);
        let redis = RedisConnections::connect(&redis_url).await.map_err(|e| match e {
            RedisError::UnsupportedScheme { .. } => StartError::Refused(e.to_string()),
            // The library names the Redis URL; this program's comes from a flag or a variable.
            e @ RedisError::Unreachable { .. } => StartError::Failed(format!("{e} (--redis-url or REDIS_URL)")),
            e => StartError::Failed(e.to_string()),
        })?;

        let supervisor = SupervisorConfig::new(lease).retry(c.retry_policy());
        let config = ConsumerConfig::new(supervisor).concurrency(c.concurrency).grace(c.grace);
        let call = CallReceiver::new(c);
        let handler = move |ctx: JobContext| call.clone().handle(ctx);

        if let Some(stream) = &args.stream {
            let queue = QueueName::new(args.queue.clone().unwrap_or_else(|| stream.clone())).map_err(refuse)?;
            let mut source = StreamSource::new(redis, queue.clone(), stream.clone(), args.group.clone())?
                .block(args.block)
                .autoclaim_every(args.autoclaim_every)
                .max_deliveries(args.max_deliveries);
            if let Some(field) = &args.key_field {
                source = source.key_from(KeyFrom::Field(field.clone()));
            }
            if let Some(v) = args.visibility {
                source = source.visibility(v);
            }
            let what: [(&str, &dyn std::fmt::Display); 4] =
                [("queue", &queue), ("source", &"stream"), ("stream", stream), ("group", &args.group)];
            consume(source, store, owner, config, handler, &what).await
        } else if let Some(list) = &args.list {
            let queue = QueueName::new(args.queue.clone().unwrap_or_else(|| list.clone())).map_err(refuse)?;
            // No default: what identical items mean is the user's call (see `ItemKey`).
            let Some(item_key) = args.item_key.clone() else {
                return Err(StartError::Refused(
                    "--list needs --item-key: `hash` (identical items are one job) or `split:C` \
                     (the item names its job before the byte C)"
                        .into(),
                ));
            };
            let source = ReliableList::new(redis, queue.clone(), list.clone(), item_key)?.block(args.block);
            let what: [(&str, &dyn std::fmt::Display); 3] = [("queue", &queue), ("source", &"list"), ("list", list)];
            consume(source, store, owner, config, handler, &what).await
        } else {
            Err(StartError::Refused("give exactly one of --stream and --list".into()))
        }
    }

    /// Runs the worker with command-line arguments (without the program name); returns the exit
    /// code. The tests call it in a child process of their own binary.
    pub fn run(raw: Vec<String>) -> i32 {
        common::run_program(PROG, "info", parse_args(raw), serve)
    }
}
