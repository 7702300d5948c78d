//! Benchmark (by hand, not a test): the fenced Redis Streams consumer against a plain
//! `XREADGROUP`/`XACK` consumer, same stream size, same concurrency, same batch, one run each.
//!
//! ```text
//! cargo run --release -p brokerfence-bench --features redis --bin bench_redis -- --messages 20000 --concurrency 32 --work-ms 0
//! ```
//!
//! Prints messages per second of both, their ratio, and the database statements per message of
//! the fenced one (counted by a wrapper around the store: every `FenceStore` call is one
//! statement). Redis from `REDIS_URL`, PostgreSQL from `DATABASE_URL` (fallback
//! `localstack/.env`); it uses fresh stream keys and a fresh schema, and removes both at the end.

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

    use brokerfence::adapters::redis::client::{self, Value};
    use brokerfence::adapters::redis::{KeyFrom, RedisConnections, StreamSource};
    use brokerfence::adapters::{Consumer, ConsumerConfig};
    use brokerfence::fence::{
        FenceStore, JobContext, LeaseDuration, Owner, PgFence, QueueName, SchemaName, SupervisorConfig,
    };
    use sqlx::AssertSqlSafe;

    use tokio::sync::Semaphore;

    use crate::args::{self, Common, HELP_TEMPLATE, Load, Redis as RedisArgs, at_least_one};
    use crate::counters::Counting;
    use tokio_util::sync::CancellationToken;

    /// Benchmark: the fenced Redis Streams consumer against a plain XREADGROUP/XACK consumer,
    /// same stream size, concurrency and batch. Redis from REDIS_URL, PostgreSQL from
    /// DATABASE_URL (fallback localstack/.env). Exit codes: 0 done, 1 failed, 2 bad command line.
    #[derive(Debug, clap::Parser)]
    #[command(name = "bench_redis", help_template = HELP_TEMPLATE)]
    struct Cli {
        /// Messages per run
        #[arg(long, value_name = "N", default_value = "20000", value_parser = at_least_one)]
        messages: usize,
        /// Lease in seconds
        #[arg(long, value_name = "S", default_value_t = 30)]
        lease: u64,
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        load: Load,
        #[command(flatten)]
        redis: RedisArgs,
    }

    /// The options, the shared flags' defaults applied.
    #[derive(Debug)]
    struct Args {
        messages: usize,
        concurrency: usize,
        batch: usize,
        work: Duration,
        lease: u64,
        database_url: Result<String, String>,
        redis_url: Result<String, String>,
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
                database_url: c.common.database_url(),
                redis_url: c.redis.redis_url(),
            }
        }
    }

    async fn produce(
        conn: &mut brokerfence::redis::RedisConn,
        stream: &str,
        n: usize,
    ) -> Result<(), client::RedisError> {
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

    /// The baseline: read a batch, handle each entry in its own task (bounded), `XACK` each.
    async fn plain(redis: &RedisConnections, stream: &str, a: &Args) -> Result<Duration, client::RedisError> {
        let permits = Arc::new(Semaphore::new(a.concurrency));
        let acked = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let mut reader = redis.blocking();
        let total = a.messages as u64;
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

    /// The fenced consumer: the runtime, the stream source, PostgreSQL.
    async fn fenced(
        redis: &RedisConnections,
        store: Arc<Counting>,
        stream: &str,
        a: &Args,
    ) -> Result<Duration, Box<dyn std::error::Error>> {
        let source = StreamSource::new(redis.clone(), QueueName::new(stream)?, stream, "g")?
            .key_from(KeyFrom::Field("key".into()))
            .block(Duration::from_millis(100));
        let config = ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(a.lease)?))
            .concurrency(a.concurrency)
            .batch(a.batch);
        let consumer = Consumer::with_owner(source, store, Owner::new("bench")?, config);
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
        let total = a.messages as u64;
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
        let run = tokio::spawn(async move {
            let r = consumer.run(handler, token).await;
            (r, consumer.metrics().snapshot())
        });
        let done = watch.await?;
        stop.cancel();
        let (r, snapshot) = run.await?;
        r?;
        println!("  fenced counters: {snapshot}");
        Ok(done.duration_since(started))
    }

    async fn go(a: Args) -> Result<(), Box<dyn std::error::Error>> {
        let redis_url = a.redis_url.clone()?;
        let db_url = a.database_url.clone()?;
        let tag = format!("{:08x}", rand::random::<u32>());
        let schema = SchemaName::new(format!("bench_redis_{tag}"))?;
        let pg = PgFence::connect(&db_url).await?.with_schema(schema.clone());
        pg.migrate().await?;
        let redis = RedisConnections::connect(&redis_url).await?;
        let mut conn = redis.commands();
        let (plain_stream, fenced_stream) = (format!("bench-{tag}-plain"), format!("bench-{tag}-fenced"));

        println!(
            "bench_redis: {} messages, concurrency {}, batch {}, work {} ms, lease {} s",
            a.messages,
            a.concurrency,
            a.batch,
            a.work.as_millis(),
            a.lease
        );
        produce(&mut conn, &plain_stream, a.messages).await?;
        let t_plain = plain(&redis, &plain_stream, &a).await?;
        produce(&mut conn, &fenced_stream, a.messages).await?;
        let store = Counting::new(Arc::new(pg.clone()));
        let t_fenced = fenced(&redis, Arc::clone(&store), &fenced_stream, &a).await?;

        let n = a.messages as f64;
        let (plain_rate, fenced_rate) = (n / t_plain.as_secs_f64(), n / t_fenced.as_secs_f64());
        println!("  plain  XREADGROUP/XACK: {:>9.0} msg/s ({:.2} s)", plain_rate, t_plain.as_secs_f64());
        println!("  fenced (PostgreSQL):    {:>9.0} msg/s ({:.2} s)", fenced_rate, t_fenced.as_secs_f64());
        println!("  ratio fenced/plain:     {:>9.3}", fenced_rate / plain_rate);
        let claims = store.get("claim") + store.get("claim_batch") + store.get("claim_next");
        let completes = store.get("complete") + store.get("complete_batch");
        println!(
            "  DB statements/message:  {:>9.3} (claim batches {}, completes {}, heartbeats {}, other {})",
            store.total() as f64 / n,
            claims,
            completes,
            store.get("heartbeat"),
            ["enqueue", "checkpoint", "fail", "release"].iter().map(|m| store.get(m)).sum::<u64>()
        );
        println!(
            "  DB round trip:          claim batch {:.2} ms avg ({:.1} jobs), group commit {:.2} ms avg ({:.1} jobs)",
            store.mean_ms("claim_batch"),
            n / claims.max(1) as f64,
            store.mean_ms("complete_batch"),
            n / completes.max(1) as f64,
        );

        let _: Value = client::cmd("DEL").arg(&plain_stream).arg(&fenced_stream).query_async(&mut conn).await?;
        sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {} CASCADE", schema.as_str()))).execute(pg.pool()).await?;
        Ok(())
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
