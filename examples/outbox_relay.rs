//! The transactional outbox, as two processes (PostgreSQL only):
//!
//! - `outbox_relay worker`: a table-queue worker whose handler writes, in **one** transaction, its
//!   business row (`<schema>.outbox_example_orders`), one outbox row per `--destination`
//!   (`PgFence::outbox_in`) and the job's fenced completion (`JobContext::complete_in`). A
//!   superseded (zombie) attempt's completion is refused, its transaction rolls back, and neither
//!   its business row nor its outbox rows ever exist.
//! - `outbox_relay relay`: publishes outbox rows (`adapters::outbox::OutboxRelay`) to SQS queues
//!   (`--sqs DEST=QUEUE_URL`) and Redis streams (`--redis DEST=STREAM`) with the fence stamp as
//!   message attributes / stream fields, and marks each row sent once its broker accepted it.
//!   Several relays can run side by side (`FOR UPDATE SKIP LOCKED`).
//!
//! ```text
//! cargo run -p brokerfence-examples --features sqs,redis --example table_produce -- --queue orders --count 100 --migrate
//! cargo run -p brokerfence-examples --features sqs,redis --example outbox_relay -- worker --queue orders --destination billing --migrate
//! cargo run -p brokerfence-examples --features sqs,redis --example outbox_relay -- relay \
//!     --sqs billing=http://127.0.0.1:4566/000000000000/billing --redis audit=audit-events
//! ```
//!
//! Flags, `EVENT` lines and exit codes as in `examples/README.md` ("The outbox relay").

use std::sync::Arc;
use std::time::Duration;

use brokerfence::TableQueue;
use brokerfence::outbox::{OutboxRelay, RelayConfig, RelayRound};
use brokerfence::redis::{RedisConnections, RedisPublisher};
use brokerfence::sqs::{SqsPublisher, SqsTimeouts, aws_config};
use brokerfence::{
    Consumer, ConsumerConfig, FenceError, FenceStore, JobContext, JobError, LeaseDuration, PgFence, QueueName,
    SupervisorConfig,
};
use sqlx::AssertSqlSafe;

#[path = "support/cli.rs"]
mod common;

use common::{Common, EventSource, EventStore, StartError, event, lease_event};

const PROG: &str = "outbox_relay";

/// The transactional outbox: `worker` completes table-queue jobs and writes outbox rows in the
/// same transaction; `relay` publishes the outbox rows to SQS queues and Redis streams. Prints
/// `EVENT` lines on stdout (examples/README.md). Exit codes: 0 stopped by SIGTERM/Ctrl-C,
/// 1 failed, 2 refused.
#[derive(clap::Parser)]
#[command(name = PROG, help_template = common::HELP_TEMPLATE)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Subcommand)]
enum Command {
    /// Complete table-queue jobs, writing an order row and outbox rows in one transaction
    #[command(help_template = common::HELP_TEMPLATE)]
    Worker {
        /// The table queue
        #[arg(long, value_name = "NAME", required = true)]
        queue: Option<String>,
        /// An outbox destination of every job (repeat for several)
        #[arg(long = "destination", value_name = "DEST")]
        destinations: Vec<String>,
        /// Milliseconds to wait inside the transaction, before the commit
        #[arg(long, value_name = "MS", default_value = "0", value_parser = common::millis)]
        in_tx_delay: Duration,
        /// Milliseconds between polls of an idle queue when no wake-up comes
        #[arg(long, value_name = "MS", default_value = "1000", value_parser = common::millis)]
        idle_wait: Duration,
        #[command(flatten)]
        common: Common,
    },
    /// Publish outbox rows: DEST=QUEUE_URL to SQS, DEST=STREAM to Redis
    #[command(help_template = common::HELP_TEMPLATE)]
    Relay {
        /// Publish destination DEST to this SQS queue (repeat for several)
        #[arg(long, value_name = "DEST=QUEUE_URL", value_parser = common::pair)]
        sqs: Vec<(String, String)>,
        /// Publish destination DEST to this Redis stream (repeat for several)
        #[arg(long, value_name = "DEST=STREAM", value_parser = common::pair)]
        redis: Vec<(String, String)>,
        /// Redis URL (else REDIS_URL, else localstack/.env)
        #[arg(long, value_name = "URL")]
        redis_url: Option<String>,
        /// Rows per relay round
        #[arg(long, value_name = "N", default_value_t = 100, value_parser = common::batch_size)]
        batch: u32,
        /// Milliseconds to wait when the outbox is empty
        #[arg(long, value_name = "MS", default_value = "200", value_parser = common::millis)]
        idle_wait: Duration,
        #[command(flatten)]
        common: Common,
    },
}

enum Args {
    Worker {
        common: Common,
        queue: String,
        destinations: Vec<String>,
        in_tx_delay: Duration,
        idle_wait: Duration,
    },
    Relay {
        common: Common,
        sqs: Vec<(String, String)>,
        redis: Vec<(String, String)>,
        redis_url: Option<String>,
        batch: u32,
        idle_wait: Duration,
    },
}

fn parse_args(raw: Vec<String>) -> Result<Args, clap::Error> {
    let cli: Cli = common::parse(PROG, raw)?;
    Ok(match cli.command {
        Command::Worker { queue, destinations, in_tx_delay, idle_wait, common } => {
            Args::Worker { common, queue: queue.unwrap_or_default(), destinations, in_tx_delay, idle_wait }
        }
        Command::Relay { sqs, redis, redis_url, batch, idle_wait, common } => {
            Args::Relay { common, sqs, redis, redis_url, batch, idle_wait }
        }
    })
}

/// The example's business table (created with `--migrate`).
pub async fn create_business_table(pg: &PgFence) -> Result<(), StartError> {
    let s = pg.get_schema().as_str();
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE IF NOT EXISTS {s}.outbox_example_orders (queue text NOT NULL, key text NOT NULL, \
         epoch bigint NOT NULL, owner text NOT NULL, done_at timestamptz NOT NULL DEFAULT clock_timestamp())"
    )))
    .execute(pg.pool())
    .await?;
    Ok(())
}

/// Prints `EVENT rolled_back … reason=cancelled` when the handler is dropped (its lease lost)
/// while its transaction is open: dropping the transaction rolls it back.
struct TxWatch<'a>(&'a brokerfence::Lease, bool);

impl Drop for TxWatch<'_> {
    fn drop(&mut self) {
        if !self.1 {
            lease_event("rolled_back", self.0, &[("reason", &"cancelled")]);
        }
    }
}

/// The handler: business row, outbox rows and the fenced completion in one transaction.
async fn handle(pg: PgFence, w: Arc<WorkerOpts>, ctx: JobContext) -> Result<Vec<u8>, JobError> {
    lease_event("claimed", ctx.lease(), &[("attempt", &ctx.lease().attempts)]);
    tokio::time::sleep(w.delay).await;
    let mut tx = pg.pool().begin().await.map_err(JobError::retry)?;
    let mut watch = TxWatch(ctx.lease(), false);
    let s = pg.get_schema().as_str();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {s}.outbox_example_orders (queue, key, epoch, owner) VALUES ($1, $2, $3, $4)"
    )))
    .bind(ctx.queue().as_str())
    .bind(ctx.key().as_str())
    .bind(ctx.epoch())
    .bind(ctx.owner().as_str())
    .execute(&mut *tx)
    .await
    .map_err(JobError::retry)?;
    for d in &w.destinations {
        let payload = format!("{} done by {}@{}", ctx.key(), ctx.owner(), ctx.epoch());
        // Unchecked on its own: the `complete_in` below, in the same transaction, decides for it.
        let id = pg.outbox_in(&mut tx, ctx.lease(), d, payload.as_bytes()).await.map_err(JobError::retry)?;
        lease_event("outbox_written", ctx.lease(), &[("id", &id), ("destination", d)]);
    }
    tokio::time::sleep(w.in_tx_delay).await;
    let result = format!("{}@{}", ctx.owner(), ctx.epoch());
    if let Err(e) = ctx.complete_in(&mut *tx, result.as_bytes()).await {
        // Fenced (a newer epoch holds the job) or failed: `tx` drops, rolling back the business
        // row and the outbox rows.
        watch.1 = true;
        let reason = if e.is_fenced() { "fenced" } else { "error" };
        lease_event("rolled_back", ctx.lease(), &[("reason", &reason), ("error", &e)]);
        return Err(JobError::retry(e));
    }
    tx.commit().await.map_err(JobError::retry)?;
    watch.1 = true;
    lease_event("tx_committed", ctx.lease(), &[]);
    Ok(Vec::new()) // not stored: the result given to complete_in is
}

/// What the worker's handler does.
struct WorkerOpts {
    destinations: Vec<String>,
    delay: Duration,
    in_tx_delay: Duration,
}

async fn worker(common: Common, queue: String, opts: WorkerOpts, idle_wait: Duration) -> Result<(), StartError> {
    let refuse = |e: FenceError| StartError::Refused(e.to_string());
    let owner = common.owner("outbox-worker").map_err(refuse)?;
    let queue = QueueName::new(queue).map_err(refuse)?;
    let lease = LeaseDuration::from_secs(common.lease).map_err(refuse)?;
    common.serve_metrics().await?;
    let url = common::database_url(common.database_url.as_deref())?;
    let pg = common::connect_pg(&url, common.schema.as_deref(), &owner, common.migrate).await?;
    if common.migrate {
        create_business_table(&pg).await?;
    }
    let store: Arc<dyn FenceStore> = Arc::new(pg.clone());
    let source = EventSource(TableQueue::new(Arc::clone(&store), queue.clone()).idle_wait(idle_wait));
    let config = ConsumerConfig::new(SupervisorConfig::new(lease).retry(common.retry_policy()))
        .concurrency(common.concurrency)
        .grace(common.grace);
    let consumer = Consumer::with_owner(source, Arc::new(EventStore(store)), owner.clone(), config);
    consumer.supervisor().add_hook(Arc::new(common::LostHook));
    let reporter = common::spawn_metrics(consumer.metrics());
    let opts = Arc::new(opts);
    let handler = move |ctx: JobContext| handle(pg.clone(), Arc::clone(&opts), ctx);
    let stop = common::shutdown_on_signals();
    common::ready(&owner, &[("queue", &queue), ("source", &"table")]);
    let result = consumer.run(handler, stop).await;
    reporter.abort();
    println!("EVENT stopped {}", consumer.metrics().snapshot());
    result.map_err(|e| StartError::Failed(e.to_string()))
}

fn print_round(round: &RelayRound) {
    for r in &round.sent {
        let f: [(&str, &dyn std::fmt::Display); 5] =
            [("queue", &r.queue), ("key", &r.key), ("epoch", &r.epoch), ("id", &r.id), ("destination", &r.destination)];
        event("published", &f);
    }
    for (r, why) in &round.failed {
        let f: [(&str, &dyn std::fmt::Display); 6] = [
            ("queue", &r.queue),
            ("key", &r.key),
            ("epoch", &r.epoch),
            ("id", &r.id),
            ("destination", &r.destination),
            ("error", why),
        ];
        event("unsent", &f);
    }
}

#[allow(clippy::too_many_arguments)]
async fn relay(
    common: Common,
    sqs: Vec<(String, String)>,
    redis: Vec<(String, String)>,
    redis_url: Option<String>,
    batch: u32,
    idle_wait: Duration,
) -> Result<(), StartError> {
    let owner = common.owner("outbox-relay").map_err(|e| StartError::Refused(e.to_string()))?;
    let url = common::database_url(common.database_url.as_deref())?;
    let pg = common::connect_pg(&url, common.schema.as_deref(), &owner, common.migrate).await?;
    let config = RelayConfig::default().batch(batch).idle_wait(idle_wait);
    let mut relay = OutboxRelay::new(pg, config).observe(Arc::new(print_round));
    if !sqs.is_empty() {
        let client = brokerfence::sqs::client(aws_config::from_env(), SqsTimeouts::default()).await;
        let publisher = sqs.iter().fold(SqsPublisher::new(client), |p, (d, u)| p.route(d, u));
        relay = relay.publisher(Arc::new(publisher));
    }
    if !redis.is_empty() {
        let redis_url = redis_url.or_else(|| brokerfence_testkit::services::var("REDIS_URL")).ok_or_else(|| {
            StartError::Refused("no Redis: give --redis-url or set REDIS_URL (localstack/up writes it)".into())
        })?;
        let conns = RedisConnections::connect(&redis_url).await?;
        let publisher = redis.iter().fold(RedisPublisher::new(conns), |p, (d, s)| p.route(d, s));
        relay = relay.publisher(Arc::new(publisher));
    }
    let stop = common::shutdown_on_signals();
    let destinations = sqs.len() + redis.len();
    common::ready(&owner, &[("source", &"outbox"), ("destinations", &destinations)]);
    let sent = relay.run(stop).await.map_err(|e| StartError::Failed(e.to_string()))?;
    event("stopped", &[("sent", &sent)]);
    Ok(())
}

async fn serve(args: Args) -> Result<(), StartError> {
    match args {
        Args::Worker { common, queue, destinations, in_tx_delay, idle_wait } => {
            let opts = WorkerOpts { destinations, delay: common.handler_delay, in_tx_delay };
            worker(common, queue, opts, idle_wait).await
        }
        Args::Relay { common, sqs, redis, redis_url, batch, idle_wait } => {
            relay(common, sqs, redis, redis_url, batch, idle_wait).await
        }
    }
}

/// Runs the program with command-line arguments (without the program name); the exit code.
pub fn run(raw: Vec<String>) -> i32 {
    common::run_program(PROG, "info", parse_args(raw), serve)
}

#[allow(dead_code)] // not called when a test includes this file as a module
fn main() {
    brokerfence_testkit::services::load_dotenv();
    std::process::exit(run(std::env::args().skip(1).collect()));
}
