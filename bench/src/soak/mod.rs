//! Soak: jobs through the fence for a long time with retention on, to see that storage stays
//! bounded and throughput holds (issue 14). A benchmark: it prints figures and asserts nothing.
//!
//! ```text
//! cargo run --release -p brokerfence-bench --bin soak                                   # 1,000,000 table-queue jobs
//! cargo run --release -p brokerfence-bench --features redis --bin soak -- --stream 200000  # + 200,000 Redis stream messages
//! ```
//!
//! Every `--every` jobs (default 100,000) it prints the size of the `jobs` and `ledger` tables with
//! their indexes (`pg_total_relation_size`, `pg_indexes_size`), the rows in each, the throughput of
//! that stretch and the resident memory. Each handler also accepts its stamp in a receiver's ledger
//! (as a downstream service would), so the ledger grows by a row per job unless pruned.
//! Retention: completed jobs and ledger rows are kept `--keep-secs` (default 5), pruned by the
//! consumer's background pruner every second. This PostgreSQL may run with autovacuum off: the soak
//! then runs `VACUUM (ANALYZE)` on both tables after each stretch, as autovacuum would (without the
//! statistics, `claim_next` on a large table collapses: issue 18).
//!
//! Options: `--jobs N` (table queue, 0 to skip), `--stream N` (Redis stream, feature `redis`),
//! `--every N`, `--keep-secs S`, `--concurrency C` (default 64), `--backlog N` (most jobs waiting,
//! default 50,000). PostgreSQL from `DATABASE_URL`, Redis from `REDIS_URL` (both fall back to
//! `localstack/.env`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use brokerfence::TableQueue;
use brokerfence::ledger::PgLedger;
use brokerfence::retention::{QueueRetention, Retention};
use brokerfence::{Consumer, ConsumerConfig, Source};
use brokerfence::{
    FenceStore, JobContext, JobError, JobKey, LeaseDuration, Metrics, PgFence, QueueName, SchemaName, SupervisorConfig,
};
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

use crate::args::{self, Common, HELP_TEMPLATE, Redis as RedisArgs};

/// Soak: jobs through the fence for a long time with retention on, to see that storage stays
/// bounded and throughput holds. A benchmark: it prints figures and asserts nothing. PostgreSQL
/// from DATABASE_URL, Redis from REDIS_URL (both fall back to localstack/.env). Exit codes: 0 done,
/// 1 failed, 2 bad command line.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "soak", help_template = HELP_TEMPLATE)]
struct Opts {
    /// Table-queue jobs (0 to skip)
    #[arg(long, value_name = "N", default_value_t = 1_000_000)]
    jobs: u64,
    /// Redis stream messages (feature redis)
    #[arg(long, value_name = "N", default_value_t = 0)]
    stream: u64,
    /// Jobs per stretch (a line of figures after each)
    #[arg(long, value_name = "N", default_value = "100000", value_parser = at_least_one)]
    every: u64,
    /// Seconds completed jobs and ledger rows are kept
    #[arg(long = "keep-secs", value_name = "S", default_value = "5", value_parser = secs)]
    keep: Duration,
    /// Most jobs waiting
    #[arg(long, value_name = "N", default_value = "50000", value_parser = at_least_one)]
    backlog: u64,
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    redis: RedisArgs,
}

impl Opts {
    /// Jobs run at once.
    fn concurrency(&self) -> usize {
        self.common.concurrency.unwrap_or(64)
    }
}

fn at_least_one(v: &str) -> Result<u64, String> {
    v.parse::<u64>().map(|n| n.max(1)).map_err(|e| format!("{v:?}: {e}"))
}

fn secs(v: &str) -> Result<Duration, String> {
    v.parse::<u64>().map(Duration::from_secs).map_err(|e| format!("{v:?}: {e}"))
}

pub fn main() {
    let o: Opts = match args::parse(&[("concurrency", "64")]) {
        Ok(o) => o,
        Err(e) => std::process::exit(args::report(&e)),
    };
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())
        .and_then(|rt| rt.block_on(soak(o)));
    if let Err(e) = result {
        eprintln!("soak: {e}");
        std::process::exit(1);
    }
}

async fn soak(o: Opts) -> Result<(), String> {
    let url = o.common.database_url()?;
    let schema = SchemaName::new(format!("soak_{:08x}", rand::random::<u32>())).map_err(|e| e.to_string())?;
    let fence = PgFence::connect(&url).await.map_err(|e| e.to_string())?.schema(schema);
    fence.migrate().await.map_err(|e| e.to_string())?;
    let autovacuum: String = sqlx::query_scalar("SELECT current_setting('autovacuum')")
        .fetch_one(fence.pool())
        .await
        .map_err(|e| e.to_string())?;
    println!(
        "brokerfence soak — {} cores, autovacuum={autovacuum}, keep {:?}, concurrency {}, backlog ≤ {}{}",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        o.keep,
        o.concurrency(),
        o.backlog,
        if cfg!(debug_assertions) { "  [DEBUG BUILD: use --release for figures]" } else { "" }
    );
    let result = async {
        if o.jobs > 0 {
            let queue = QueueName::new("soak").map_err(|e| e.to_string())?;
            let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
            let source = TableQueue::new(Arc::clone(&store), queue.clone());
            let producer = TableProducer { fence: fence.clone(), queue: queue.clone() };
            run("table queue on PostgreSQL", &o, &fence, queue, source, o.jobs, producer).await?;
        }
        if o.stream > 0 {
            #[cfg(feature = "redis")]
            redis_soak::run(&o, &fence).await?;
            #[cfg(not(feature = "redis"))]
            println!("\n[redis stream] skipped: build with --features redis");
        }
        Ok::<(), String>(())
    }
    .await;
    let _ = sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {} CASCADE", fence.get_schema().as_str())))
        .execute(fence.pool())
        .await;
    result
}

/// Puts `n` more jobs, numbered from `from`, where the consumer will find them.
trait Producer: Send + 'static {
    fn produce(&mut self, from: u64, n: u64) -> impl std::future::Future<Output = Result<(), String>> + Send;
}

struct TableProducer {
    fence: PgFence,
    queue: QueueName,
}

impl Producer for TableProducer {
    async fn produce(&mut self, from: u64, n: u64) -> Result<(), String> {
        let jobs: Vec<(JobKey, Vec<u8>)> = (from..from + n)
            .map(|i| JobKey::new(format!("job-{i:08}")).map(|k| (k, b"{}".to_vec())))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        self.fence.enqueue_many(&self.queue, &jobs).await.map_err(|e| e.to_string())?;
        Ok(())
    }
}

/// One soak: a producer keeps at most `backlog` jobs waiting, a consumer with retention drains
/// them; a line of figures every `every` completions.
async fn run<S: Source, P: Producer>(
    label: &str,
    o: &Opts,
    fence: &PgFence,
    queue: QueueName,
    source: S,
    total: u64,
    mut producer: P,
) -> Result<(), String> {
    println!("\n[{label}] {total} jobs");
    let retention = Retention::new()
        .queue(queue, QueueRetention::completed_for(o.keep))
        .ledger("soak", o.keep)
        .every(Duration::from_secs(1));
    let lease = LeaseDuration::from_secs(30).map_err(|e| e.to_string())?;
    let config = ConsumerConfig::new(SupervisorConfig::new(lease)).concurrency(o.concurrency()).retention(retention);
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    let consumer = Arc::new(Consumer::new(source, store, config));
    let metrics: Arc<Metrics> = consumer.metrics();
    let stop = CancellationToken::new();
    let ledger = PgLedger::new(fence, "soak");
    let running = {
        let (consumer, stop) = (Arc::clone(&consumer), stop.clone());
        tokio::spawn(async move {
            let handler = move |ctx: JobContext| {
                let ledger = ledger.clone();
                async move {
                    ledger.accept(&ctx.stamp().ledger_job(), ctx.epoch()).await.map_err(JobError::retry)?;
                    Ok(Vec::new())
                }
            };
            consumer.run(handler, stop).await
        })
    };
    let (mut produced, mut mark, mut mark_at) = (0u64, 0u64, Instant::now());
    let mut stretches: Vec<f64> = Vec::new();
    println!("  {:>9} {:>10} {:>22} {:>22} {:>9}", "jobs", "jobs/s", "jobs table (rows)", "ledger (rows)", "RSS");
    while mark < total {
        let done = metrics.snapshot().completions;
        if produced < total && produced - done.min(produced) < o.backlog {
            let n = (o.backlog / 5).clamp(1, 10_000).min(total - produced);
            producer.produce(produced, n).await?;
            produced += n;
            continue;
        }
        if done >= mark + o.every || (done >= total && mark < total) {
            let n = done - mark;
            let rate = n as f64 / mark_at.elapsed().as_secs_f64();
            stretches.push(rate);
            (mark, mark_at) = (done, Instant::now());
            println!(
                "  {done:>9} {rate:>10.0} {:>22} {:>22} {:>6} MiB",
                size(fence, "jobs").await?,
                size(fence, "ledger").await?,
                rss_mib()
            );
            if autovacuum_off(fence).await? {
                vacuum(fence).await?;
                mark_at = Instant::now(); // the VACUUM is not the consumer's time
            }
            continue;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.cancel();
    running.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    if let (Some(first), Some(last)) = (stretches.first(), stretches.last()) {
        println!("  last stretch / first: {:.2}", last / first);
    }
    Ok(())
}

/// "total size (indexes) (rows)" of a table of the fence's schema.
async fn size(fence: &PgFence, table: &str) -> Result<String, String> {
    let name = format!("{}.{table}", fence.get_schema().as_str());
    let (total, indexes, rows): (i64, i64, i64) = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT pg_total_relation_size('{name}'), pg_indexes_size('{name}'), (SELECT count(*) FROM {name})"
    )))
    .fetch_one(fence.pool())
    .await
    .map_err(|e| e.to_string())?;
    let mib = |b: i64| b as f64 / 1_048_576.0;
    Ok(format!("{:.1} MiB ({:.1} idx) ({rows})", mib(total), mib(indexes)))
}

async fn autovacuum_off(fence: &PgFence) -> Result<bool, String> {
    let on: String = sqlx::query_scalar("SELECT current_setting('autovacuum')")
        .fetch_one(fence.pool())
        .await
        .map_err(|e| e.to_string())?;
    Ok(on != "on")
}

/// What autovacuum would do: makes the space of deleted rows reusable, and keeps the statistics
/// current (without them, `claim_next` on a large table is planned as a scan and sort of every
/// pending row: issue 18).
async fn vacuum(fence: &PgFence) -> Result<(), String> {
    for table in ["jobs", "ledger"] {
        let stmt = format!("VACUUM (ANALYZE) {}.{table}", fence.get_schema().as_str());
        sqlx::query(AssertSqlSafe(stmt)).execute(fence.pool()).await.map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn rss_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb: u64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    kb / 1024
}

#[cfg(feature = "redis")]
mod redis_soak {
    use super::*;
    use brokerfence::redis::{RedisConnections, StreamSource, client};

    struct StreamProducer {
        conn: brokerfence::redis::RedisConn,
        stream: String,
    }

    impl Producer for StreamProducer {
        async fn produce(&mut self, from: u64, n: u64) -> Result<(), String> {
            let mut pipe = client::pipe();
            for i in from..from + n {
                pipe.cmd("XADD").arg(&self.stream).arg("*").arg("body").arg(format!("{{\"n\":{i}}}")).ignore();
            }
            pipe.query_async::<()>(&mut self.conn).await.map_err(|e| e.to_string())
        }
    }

    pub async fn run(o: &Opts, fence: &PgFence) -> Result<(), String> {
        let url = o.redis.redis_url_if_any().unwrap_or_else(|| "redis://127.0.0.1:6379".into());
        let redis = RedisConnections::connect(&url).await.map_err(|e| e.to_string())?;
        let stream = format!("soak-{:08x}", rand::random::<u32>());
        let queue = QueueName::new(stream.as_str()).map_err(|e| e.to_string())?;
        let source =
            StreamSource::new(redis.clone(), queue.clone(), stream.as_str(), "soak").map_err(|e| e.to_string())?;
        let producer = StreamProducer { conn: redis.commands(), stream: stream.clone() };
        let result = super::run("Redis stream", o, fence, queue, source, o.stream, producer).await;
        let _: Result<i64, _> = client::cmd("DEL").arg(&stream).query_async(&mut redis.commands()).await;
        result
    }
}
