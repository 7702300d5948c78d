//! A fenced Redis worker to copy: it reads a stream as a consumer group (or a reliable list),
//! claims each entry's job in PostgreSQL, and calls an HTTP receiver carrying the job and its epoch
//! (the fencing token) in the `Fence-Queue` / `Fence-Job` / `Fence-Epoch` / `Fence-Owner` headers,
//! so the receiver can refuse a superseded (zombie) worker's late call. Same convention as
//! `examples/sqs_worker.rs`.
//!
//! ```text
//! cargo run --features redis --example redis_worker -- \
//!     --stream orders --group billing --key-field key \
//!     --receiver-url http://127.0.0.1:8080/apply --lease 30
//! ```
//!
//! Configuration: Redis from `REDIS_URL`, PostgreSQL from `DATABASE_URL`; both fall back to
//! `localstack/.env`. Entries carry their payload in the field `body` (and, with `--key-field`, the
//! job key in that field; by default the entry id is the key).
//!
//! It prints one machine-readable `EVENT <name> key=value …` line per step to stdout (logs go to
//! stderr), which the tests use to drive it as a zombie: `ready`, `claimed`, `calling`, `called`,
//! `handled`, `dropped` (the attempt was cancelled: its lease was lost), `metrics` (whenever a
//! counter changed) and `stopped`. SIGTERM or Ctrl-C stops it gracefully: no more reads, running
//! jobs get `--grace` to finish, the rest are released and their entries made claimable at once.

#[cfg(feature = "redis")]
fn main() {
    std::process::exit(run(std::env::args().skip(1).collect()));
}

#[cfg(not(feature = "redis"))]
fn main() {
    eprintln!("redis_worker needs the `redis` feature: cargo run --features redis --example redis_worker");
    std::process::exit(2);
}

#[cfg(feature = "redis")]
pub use worker::run;

#[cfg(feature = "redis")]
mod worker {
    use std::sync::Arc;
    use std::time::Duration;

    use brokerfence::adapters::redis::{ItemKey, KeyFrom, RedisConnections, ReliableList, StreamSource};
    use brokerfence::adapters::{Consumer, ConsumerConfig, Handler, Source, shutdown_signal};
    use brokerfence::fence::{
        FenceStore, JobContext, JobError, LeaseDuration, Owner, PgFence, QueueName, SchemaName, SupervisorConfig,
    };

    const USAGE: &str = "usage: redis_worker (--stream KEY [--group NAME=workers] | --list KEY) [--queue NAME]
       [--key-field FIELD] [--item-key hash|split:C] [--receiver-url URL] [--lease SECS=30]
       [--owner NAME] [--schema NAME] [--concurrency N=16] [--block MS=2000] [--visibility MS]
       [--autoclaim-every MS=1000] [--max-deliveries N=10] [--handler-delay MS=0]
       [--after-call-delay MS=0] [--grace MS=30000] [--redis-url URL] [--database-url URL]";

    #[derive(Debug, Default)]
    struct Args {
        stream: Option<String>,
        list: Option<String>,
        group: String,
        queue: Option<String>,
        key_field: Option<String>,
        item_split: Option<u8>,
        receiver_url: Option<String>,
        lease: u64,
        owner: Option<String>,
        schema: Option<String>,
        concurrency: usize,
        block: Duration,
        visibility: Option<Duration>,
        autoclaim_every: Duration,
        max_deliveries: u32,
        handler_delay: Duration,
        after_call_delay: Duration,
        grace: Duration,
        redis_url: Option<String>,
        database_url: Option<String>,
    }

    fn parse_args(raw: Vec<String>) -> Result<Args, String> {
        let mut args = Args {
            group: "workers".into(),
            receiver_url: std::env::var("RECEIVER_URL").ok().filter(|s| !s.is_empty()),
            lease: 30,
            concurrency: 16,
            block: Duration::from_secs(2),
            autoclaim_every: Duration::from_secs(1),
            max_deliveries: 10,
            grace: Duration::from_secs(30),
            ..Args::default()
        };
        let mut it = raw.into_iter();
        while let Some(arg) = it.next() {
            let (name, inline) = match arg.split_once('=') {
                Some((n, v)) if n.starts_with("--") => (n.to_owned(), Some(v.to_owned())),
                _ => (arg.clone(), None),
            };
            if name == "--help" || name == "-h" {
                return Err(USAGE.to_owned());
            }
            let Some(value) = inline.or_else(|| it.next()) else {
                return Err(format!("{name} needs a value\n{USAGE}"));
            };
            let num = |v: &str| v.parse::<u64>().map_err(|e| format!("{name} {v:?}: {e}"));
            let ms = |v: &str| num(v).map(Duration::from_millis);
            match name.as_str() {
                "--stream" => args.stream = Some(value),
                "--list" => args.list = Some(value),
                "--group" => args.group = value,
                "--queue" => args.queue = Some(value),
                "--key-field" => args.key_field = Some(value),
                "--item-key" => {
                    args.item_split = match value.as_str() {
                        "hash" => None,
                        v => match v.strip_prefix("split:").map(str::as_bytes) {
                            Some([c]) => Some(*c),
                            _ => return Err(format!("--item-key {v:?}: expected hash or split:C\n{USAGE}")),
                        },
                    }
                }
                "--receiver-url" => args.receiver_url = Some(value),
                "--lease" => args.lease = num(&value)?,
                "--owner" => args.owner = Some(value),
                "--schema" => args.schema = Some(value),
                "--concurrency" => args.concurrency = usize::try_from(num(&value)?).unwrap_or(1),
                "--block" => args.block = ms(&value)?,
                "--visibility" => args.visibility = Some(ms(&value)?),
                "--autoclaim-every" => args.autoclaim_every = ms(&value)?,
                "--max-deliveries" => args.max_deliveries = u32::try_from(num(&value)?).unwrap_or(u32::MAX),
                "--handler-delay" => args.handler_delay = ms(&value)?,
                "--after-call-delay" => args.after_call_delay = ms(&value)?,
                "--grace" => args.grace = ms(&value)?,
                "--redis-url" => args.redis_url = Some(value),
                "--database-url" => args.database_url = Some(value),
                other => return Err(format!("unknown argument {other}\n{USAGE}")),
            }
        }
        if args.stream.is_some() == args.list.is_some() {
            return Err(format!("give exactly one of --stream and --list\n{USAGE}"));
        }
        Ok(args)
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
        let fields = format!("key={} epoch={} owner={}", ctx.key(), ctx.epoch(), ctx.owner());
        let mut watch = DropWatch { fields: fields.clone(), finished: false };
        event("claimed", &fields);
        tokio::time::sleep(delay).await;
        if let Some(url) = receiver.as_deref() {
            event("calling", &fields);
            let mut request = http.post(url).body(ctx.payload().to_vec());
            for (name, value) in ctx.stamp().to_headers() {
                request = request.header(name, value);
            }
            let response = request.send().await.map_err(|e| JobError::retry(format!("receiver unreachable: {e}")))?;
            let status = response.status().as_u16();
            event("called", &format!("{fields} status={status}"));
            match status {
                200..=299 => {}
                // The receiver has seen a newer epoch: this worker was superseded. The fenced
                // failure is refused by the database too; nothing is acknowledged.
                409 => return Err(JobError::retry(format!("receiver refused epoch {}: superseded", ctx.epoch()))),
                s => return Err(JobError::retry(format!("receiver answered {s}"))),
            }
        }
        tokio::time::sleep(after_call).await;
        watch.finished = true;
        event("handled", &fields);
        Ok(format!("{}@{}", ctx.owner(), ctx.epoch()).into_bytes())
    }

    async fn consume<S: Source, H: Handler>(
        source: S,
        store: Arc<dyn FenceStore>,
        owner: Owner,
        config: ConsumerConfig,
        handler: H,
        what: &str,
    ) -> Result<(), Box<dyn std::error::Error>> {
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
        event("ready", &format!("owner={owner} {what} pid={}", std::process::id()));
        let result = consumer.run(handler, shutdown_signal()).await;
        reporter.abort();
        event("stopped", &consumer.metrics().snapshot().to_string());
        Ok(result?)
    }

    async fn serve(args: Args) -> Result<(), Box<dyn std::error::Error>> {
        let redis_url = args
            .redis_url
            .clone()
            .or_else(|| brokerfence::services::var("REDIS_URL"))
            .ok_or("REDIS_URL is not set (run localstack/up, which writes localstack/.env)")?;
        let database_url = args
            .database_url
            .clone()
            .or_else(|| brokerfence::services::var("DATABASE_URL"))
            .ok_or("DATABASE_URL is not set (run localstack/up, which writes localstack/.env)")?;
        let mut store = PgFence::connect(&database_url).await?;
        if let Some(schema) = &args.schema {
            store = store.with_schema(SchemaName::new(schema.clone())?);
        }
        store.migrate().await?;
        let store: Arc<dyn FenceStore> = Arc::new(store);
        let redis = RedisConnections::connect(&redis_url).await?;

        let supervisor = SupervisorConfig::new(LeaseDuration::from_secs(args.lease)?);
        let config = ConsumerConfig::new(supervisor).concurrency(args.concurrency).grace(args.grace);
        let owner = match &args.owner {
            Some(o) => Owner::new(o.clone())?,
            None => Owner::unique("redis-worker"),
        };
        let http = reqwest::Client::new();
        let receiver: Option<Arc<str>> = args.receiver_url.as_deref().map(Arc::from);
        let (delay, after_call) = (args.handler_delay, args.after_call_delay);
        let handler = move |ctx: JobContext| handle(ctx, http.clone(), receiver.clone(), delay, after_call);

        if let Some(stream) = &args.stream {
            let queue = QueueName::new(args.queue.clone().unwrap_or_else(|| stream.clone()))?;
            let mut source = StreamSource::new(redis, queue, stream.clone(), args.group.clone())?
                .block(args.block)
                .autoclaim_every(args.autoclaim_every)
                .max_deliveries(args.max_deliveries);
            if let Some(field) = &args.key_field {
                source = source.key_from(KeyFrom::Field(field.clone()));
            }
            if let Some(v) = args.visibility {
                source = source.visibility(v);
            }
            let what = format!("stream={stream} group={}", args.group);
            consume(source, store, owner, config, handler, &what).await
        } else if let Some(list) = &args.list {
            let queue = QueueName::new(args.queue.clone().unwrap_or_else(|| list.clone()))?;
            let item_key = args.item_split.map_or(ItemKey::ContentHash, ItemKey::Split);
            let source = ReliableList::new(redis, queue, list.clone())?.item_key(item_key).block(args.block);
            let what = format!("list={list}");
            consume(source, store, owner, config, handler, &what).await
        } else {
            Err(USAGE.into())
        }
    }

    /// Runs the worker with command-line arguments (without the program name); returns the exit
    /// code. The tests call it in a child process of their own binary.
    pub fn run(raw: Vec<String>) -> i32 {
        let args = match parse_args(raw) {
            Ok(a) => a,
            Err(e) => {
                eprintln!("{e}");
                return 2;
            }
        };
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
            .try_init();
        let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
            Ok(r) => r,
            Err(e) => {
                eprintln!("cannot start the tokio runtime: {e}");
                return 1;
            }
        };
        match runtime.block_on(serve(args)) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("redis_worker: {e}");
                1
            }
        }
    }
}
