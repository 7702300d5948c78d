//! Benchmark (by hand, not a test): the fenced Redis Streams consumer against a plain
//! `XREADGROUP`/`XACK` consumer, and (with `--topology sentinel`) the time from a Sentinel
//! failover to the first commit through the new master.
//!
//! ```text
//! cargo run --release -p brokerfence-bench --features redis --bin bench_redis -- --messages 20000 --concurrency 32 --work-ms 0
//! cargo run --release -p brokerfence-bench --features redis --bin bench_redis -- --topology cluster --work-ms 1 --rounds 5
//! cargo run --release -p brokerfence-bench --features redis --bin bench_redis -- --topology sentinel --rounds 5
//! ```
//!
//! `--topology single` (the default) reads `REDIS_URL`; `cluster` starts a private Redis Cluster
//! of 3 primaries (no replicas) and spreads the streams over them ([`rounds`]); `sentinel` starts
//! a private master, replica and three sentinels per round ([`sentinel`]). Throughput: each round
//! runs the plain consumer, then the fenced one, on fresh streams of the same size, with the same
//! concurrency and reads; the program prints every round's rates, the median of the rounds'
//! ratios, and the database statements per message of the fenced runs (counted by a wrapper
//! around the store: every `FenceStore` call is one statement). PostgreSQL from `DATABASE_URL`
//! (fallback `localstack/.env`); a fresh schema, removed at the end, as are the streams.

#[cfg(feature = "redis")]
mod rounds;
#[cfg(feature = "redis")]
mod sentinel;

#[cfg(feature = "redis")]
pub fn main() {
    std::process::exit(bench::run(std::env::args().skip(1).collect()));
}

#[cfg(not(feature = "redis"))]
pub fn main() {
    eprintln!(
        "bench_redis needs the `redis` feature: cargo run --release -p brokerfence-bench --features redis --bin bench_redis"
    );
    std::process::exit(2);
}

#[cfg(feature = "redis")]
mod bench {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    use brokerfence::redis::client::{self, Value};
    use brokerfence::redis::{KeyFrom, RedisConn, RedisConnections, StreamSource};
    use brokerfence::{Consumer, ConsumerConfig};
    use brokerfence::{FenceStore, JobContext, LeaseDuration, Owner, PgFence, QueueName, SchemaName, SupervisorConfig};
    use sqlx::AssertSqlSafe;

    use tokio::sync::Semaphore;

    use crate::args::{self, Common, HELP_TEMPLATE, Load, Redis as RedisArgs, at_least_one};
    use tokio_util::sync::CancellationToken;

    /// Benchmark: the fenced Redis Streams consumer against a plain XREADGROUP/XACK consumer,
    /// same stream size, concurrency and batch, in paired rounds; on one server (REDIS_URL), on a
    /// private Redis Cluster, or the time from a Sentinel failover to the first commit through the
    /// new master. PostgreSQL from DATABASE_URL (fallback localstack/.env). Exit codes: 0 done,
    /// 1 failed, 2 bad command line.
    #[derive(Debug, clap::Parser)]
    #[command(name = "bench_redis", help_template = HELP_TEMPLATE)]
    struct Cli {
        /// Messages per run (spread over the streams)
        #[arg(long, value_name = "N", default_value = "20000", value_parser = at_least_one)]
        messages: usize,
        /// Lease in seconds
        #[arg(long, value_name = "S", default_value_t = 30)]
        lease: u64,
        /// single (REDIS_URL), cluster (a private cluster of 3 primaries) or sentinel (a private
        /// master and replica under 3 sentinels: failover to first commit)
        #[arg(long, value_name = "TOPOLOGY", default_value = "single", value_parser = Topology::parse)]
        topology: Topology,
        /// Rounds: paired plain/fenced runs, or failovers [default: 1 on one server, else 5]
        #[arg(long, value_name = "N", value_parser = at_least_one)]
        rounds: Option<usize>,
        /// Deliveries the fenced consumers claim ahead of their handlers [default: none, the brokers' default]
        #[arg(long, value_name = "N")]
        prefetch: Option<usize>,
        /// sentinel: messages added per second while the failover runs
        #[arg(long, value_name = "N", default_value_t = 200, value_parser = at_least_one)]
        rate: usize,
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        load: Load,
        #[command(flatten)]
        redis: RedisArgs,
    }

    /// Where the streams are.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub(super) enum Topology {
        Single,
        Cluster,
        Sentinel,
    }

    impl Topology {
        fn parse(s: &str) -> Result<Self, String> {
            match s {
                "single" => Ok(Topology::Single),
                "cluster" => Ok(Topology::Cluster),
                "sentinel" => Ok(Topology::Sentinel),
                other => Err(format!("unknown topology {other:?} (single|cluster|sentinel)")),
            }
        }
    }

    /// The options, the shared flags' defaults applied.
    #[derive(Debug)]
    pub(super) struct Args {
        pub(super) messages: usize,
        pub(super) concurrency: usize,
        pub(super) batch: usize,
        pub(super) work: Duration,
        pub(super) lease: u64,
        pub(super) topology: Topology,
        pub(super) rounds: usize,
        pub(super) rate: usize,
        pub(super) prefetch: Option<usize>,
        pub(super) database_url: Result<String, String>,
        pub(super) redis_url: Result<String, String>,
    }

    /// The shared flags' defaults of this program.
    const DEFAULTS: &[(&str, &str)] = &[("concurrency", "32"), ("batch", "10"), ("work_ms", "0")];

    impl From<Cli> for Args {
        fn from(c: Cli) -> Self {
            Args {
                messages: c.messages,
                concurrency: c.common.concurrency.unwrap_or(32),
                batch: c.load.batch.unwrap_or(10),
                work: c.load.work(0),
                lease: c.lease,
                topology: c.topology,
                rounds: c.rounds.unwrap_or(if c.topology == Topology::Single { 1 } else { 5 }),
                rate: c.rate,
                prefetch: c.prefetch,
                database_url: c.common.database_url(),
                redis_url: c.redis.redis_url(),
            }
        }
    }

    /// The fenced consumers' configuration: concurrency, batch, lease, prefetch.
    pub(super) fn consumer_config(a: &Args) -> Result<ConsumerConfig, brokerfence::FenceError> {
        let config = ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(a.lease)?))
            .concurrency(a.concurrency)
            .batch(a.batch);
        Ok(match a.prefetch {
            Some(n) => config.prefetch(n),
            None => config,
        })
    }

    /// Adds `n` entries (`key` = `m-<i>`) to `stream` and creates group `g` at its start.
    pub(super) async fn produce(conn: &mut RedisConn, stream: &str, n: usize) -> Result<(), client::RedisError> {
        let ids: Vec<usize> = (0..n).collect();
        for chunk in ids.chunks(1000) {
            let mut pipe = client::pipe();
            for i in chunk {
                pipe.cmd("XADD")
                    .arg(stream)
                    .arg("*")
                    .arg("key")
                    .arg(format!("m-{i}"))
                    .arg("body")
                    .arg("payload")
                    .ignore();
            }
            pipe.query_async::<()>(conn).await?;
        }
        let _: Value = client::cmd("XGROUP").arg("CREATE").arg(stream).arg("g").arg("0").query_async(conn).await?;
        Ok(())
    }

    /// The baseline: read a batch, handle each entry in its own task (bounded), `XACK` each;
    /// until `n` are acknowledged.
    pub(super) async fn plain(
        redis: &RedisConnections,
        stream: &str,
        n: usize,
        a: &Args,
    ) -> Result<Duration, client::RedisError> {
        let permits = Arc::new(Semaphore::new(a.concurrency));
        let acked = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let mut reader = redis.blocking();
        let total = n as u64;
        while acked.load(Ordering::Relaxed) < total {
            let free = permits.available_permits().min(a.batch);
            if free == 0 {
                let p = permits
                    .clone()
                    .acquire_owned()
                    .await
                    .map_err(|_| client::RedisError::from((client::ErrorKind::Client, "closed")))?;
                drop(p);
                continue;
            }
            let v: Value = client::cmd("XREADGROUP")
                .arg("GROUP")
                .arg("g")
                .arg("plain")
                .arg("COUNT")
                .arg(free)
                .arg("BLOCK")
                .arg(100)
                .arg("STREAMS")
                .arg(stream)
                .arg(">")
                .query_async(&mut reader)
                .await?;
            for id in entry_ids(v) {
                let Ok(permit) = permits.clone().acquire_owned().await else { break };
                let (mut conn, acked, stream, work) = (redis.commands(), Arc::clone(&acked), stream.to_owned(), a.work);
                tokio::spawn(async move {
                    if !work.is_zero() {
                        tokio::time::sleep(work).await;
                    }
                    let r: Result<i64, _> =
                        client::cmd("XACK").arg(&stream).arg("g").arg(&id).query_async(&mut conn).await;
                    if r.is_ok() {
                        acked.fetch_add(1, Ordering::Relaxed);
                    }
                    drop(permit);
                });
            }
        }
        Ok(started.elapsed())
    }

    fn entry_ids(v: Value) -> Vec<String> {
        let mut out = Vec::new();
        let Value::Array(streams) = v else { return out };
        for s in streams {
            let Value::Array(mut parts) = s else { continue };
            let Some(Value::Array(entries)) = parts.pop() else { continue };
            for e in entries {
                if let Value::Array(e) = e
                    && let Some(Value::BulkString(id)) = e.into_iter().next()
                {
                    out.push(String::from_utf8_lossy(&id).into_owned());
                }
            }
        }
        out
    }

    /// The fenced consumer (the runtime, the stream source, PostgreSQL) on `stream`, fenced
    /// under `queue`, until `n` messages are completed and acknowledged.
    pub(super) async fn fenced(
        redis: &RedisConnections,
        store: Arc<dyn FenceStore>,
        (queue, stream): (&str, &str),
        n: usize,
        a: &Args,
    ) -> Result<Duration, Box<dyn std::error::Error + Send + Sync>> {
        let source = StreamSource::new(redis.clone(), QueueName::new(queue)?, stream, "g")?
            .key_from(KeyFrom::Field("key".into()))
            .block(Duration::from_millis(100));
        let consumer = Consumer::with_owner(source, store, Owner::new("bench")?, consumer_config(a)?);
        let metrics = consumer.metrics();
        let stop = CancellationToken::new();
        let work = a.work;
        let handler = move |_ctx: JobContext| async move {
            if !work.is_zero() {
                tokio::time::sleep(work).await;
            }
            Ok(Vec::new())
        };
        let started = Instant::now();
        let total = n as u64;
        let token = stop.clone();
        let watch = tokio::spawn(async move {
            loop {
                let s = metrics.snapshot();
                if s.completions >= total && s.acks >= total {
                    return Instant::now();
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        });
        let run = tokio::spawn(async move { consumer.run(handler, token).await });
        let done = watch.await?;
        stop.cancel();
        run.await??;
        Ok(done.duration_since(started))
    }

    async fn go(a: Args) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let db_url = a.database_url.clone()?;
        let tag = format!("{:08x}", rand::random::<u32>());
        let schema = SchemaName::new(format!("bench_redis_{tag}"))?;
        let pg = PgFence::connect(&db_url).await?.schema(schema.clone());
        pg.migrate().await?;
        let result = match a.topology {
            Topology::Single | Topology::Cluster => super::rounds::run(&a, &pg, &tag).await,
            Topology::Sentinel => super::sentinel::run(&a, &pg, &tag).await,
        };
        sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {} CASCADE", schema.as_str()))).execute(pg.pool()).await?;
        result
    }

    pub fn run(raw: Vec<String>) -> i32 {
        let a: Args = match args::parse_from::<Cli>(std::iter::once("bench_redis".to_owned()).chain(raw), DEFAULTS) {
            Ok(c) => c.into(),
            Err(e) => {
                let _ = e.print();
                return e.exit_code();
            }
        };
        let _ = tracing_subscriber::fmt()
            .with_writer(std::io::stderr)
            .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
            .try_init();
        let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
            Ok(rt) => rt,
            Err(e) => {
                eprintln!("tokio: {e}");
                return 1;
            }
        };
        match rt.block_on(go(a)) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("bench_redis: {e}");
                1
            }
        }
    }
}
