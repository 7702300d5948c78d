//! Benchmark (by hand, not a test): the fenced Redis Streams consumer against a plain
//! `XREADGROUP`/`XACK` consumer, same stream size, same concurrency, same batch, one run each.
//!
//! ```text
//! cargo run --release --features redis --example bench_redis -- --messages 20000 --concurrency 32 --work-ms 0
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
    eprintln!("bench_redis needs the `redis` feature: cargo run --release --features redis --example bench_redis");
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
        self, Claim, ClaimedJob, DbTime, FailOutcome, FenceStore, Heartbeat, JobContext, JobKey, JobRecord, Lease,
        LeaseDuration, Owner, PgFence, QueueName, RetryPolicy, SchemaName, SupervisorConfig,
    };
    use sqlx::AssertSqlSafe;
    use std::future::Future;
    use std::pin::Pin;
    use tokio::sync::Semaphore;
    use tokio_util::sync::CancellationToken;

    /// Benchmark: the fenced Redis Streams consumer against a plain XREADGROUP/XACK consumer,
    /// same stream size, concurrency and batch. Redis from REDIS_URL, PostgreSQL from
    /// DATABASE_URL (fallback localstack/.env). Exit codes: 0 done, 1 failed, 2 bad command line.
    #[derive(Debug, clap::Parser)]
    #[command(name = "bench_redis", help_template = "usage: {usage}\n\n{about-with-newline}\n{all-args}{after-help}")]
    struct Args {
        /// Messages per run
        #[arg(long, value_name = "N", default_value = "20000", value_parser = at_least_one)]
        messages: usize,
        /// Jobs at once
        #[arg(long, value_name = "C", default_value = "32", value_parser = at_least_one)]
        concurrency: usize,
        /// Entries per read
        #[arg(long, value_name = "B", default_value = "10", value_parser = at_least_one)]
        batch: usize,
        /// Milliseconds of work per message
        #[arg(long = "work-ms", value_name = "W", default_value = "0", value_parser = millis)]
        work: Duration,
        /// Lease in seconds
        #[arg(long, value_name = "S", default_value_t = 30)]
        lease: u64,
    }

    fn at_least_one(v: &str) -> Result<usize, String> {
        v.parse::<usize>().map(|n| n.max(1)).map_err(|e| format!("{v:?}: {e}"))
    }

    fn millis(v: &str) -> Result<Duration, String> {
        v.parse::<u64>().map(Duration::from_millis).map_err(|e| format!("{v:?}: {e}"))
    }

    /// Counts the statements the fence sends (one per store call).
    struct Counting {
        inner: Arc<dyn FenceStore>,
        claims: AtomicU64,
        claim_nanos: Arc<AtomicU64>,
        commit_nanos: Arc<AtomicU64>,
        completes: AtomicU64,
        heartbeats: AtomicU64,
        other: AtomicU64,
    }

    impl Counting {
        fn total(&self) -> u64 {
            [&self.claims, &self.completes, &self.heartbeats, &self.other]
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .sum()
        }
    }

    /// Adds the time `fut` takes to `sum`.
    fn timed<'f, T: 'f>(fut: Fut<'f, T>, sum: Arc<AtomicU64>) -> Fut<'f, T> {
        Box::pin(async move {
            let t = Instant::now();
            let r = fut.await;
            sum.fetch_add(u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
            r
        })
    }

    fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    type Fut<'a, T> = Pin<Box<dyn Future<Output = fence::Result<T>> + Send + 'a>>;

    // `FenceStore` is an `async_trait`; this example spells out its desugared signatures so that it
    // needs no macro crate of its own.
    impl FenceStore for Counting {
        fn migrate<'s, 'f>(&'s self) -> Fut<'f, ()>
        where
            's: 'f,
        {
            self.inner.migrate()
        }
        fn claim_batch<'s, 'q, 'k, 'o, 'f>(
            &'s self,
            queue: &'q QueueName,
            keys: &'k [JobKey],
            owner: &'o Owner,
            lease: LeaseDuration,
        ) -> Fut<'f, Vec<Claim>>
        where
            's: 'f,
            'q: 'f,
            'k: 'f,
            'o: 'f,
        {
            bump(&self.claims);
            timed(self.inner.claim_batch(queue, keys, owner, lease), Arc::clone(&self.claim_nanos))
        }
        fn enqueue_many<'s, 'q, 'j, 'f>(&'s self, queue: &'q QueueName, jobs: &'j [(JobKey, Vec<u8>)]) -> Fut<'f, u64>
        where
            's: 'f,
            'q: 'f,
            'j: 'f,
        {
            bump(&self.other);
            self.inner.enqueue_many(queue, jobs)
        }
        fn claim_next<'s, 'q, 'o, 'f>(
            &'s self,
            queue: &'q QueueName,
            owner: &'o Owner,
            lease: LeaseDuration,
            n: u32,
        ) -> Fut<'f, Vec<ClaimedJob>>
        where
            's: 'f,
            'q: 'f,
            'o: 'f,
        {
            bump(&self.claims);
            self.inner.claim_next(queue, owner, lease, n)
        }
        fn heartbeat<'s, 'l, 'f>(&'s self, leases: &'l [Lease], lease: LeaseDuration) -> Fut<'f, Heartbeat>
        where
            's: 'f,
            'l: 'f,
        {
            bump(&self.heartbeats);
            self.inner.heartbeat(leases, lease)
        }
        fn heartbeat_unless_locked<'s, 'l, 'f>(
            &'s self,
            leases: &'l [Lease],
            lease: LeaseDuration,
        ) -> Fut<'f, Heartbeat>
        where
            's: 'f,
            'l: 'f,
        {
            bump(&self.heartbeats);
            self.inner.heartbeat_unless_locked(leases, lease)
        }
        fn checkpoint<'s, 'l, 'p, 'f>(&'s self, lease: &'l Lease, progress: &'p [u8]) -> Fut<'f, ()>
        where
            's: 'f,
            'l: 'f,
            'p: 'f,
        {
            bump(&self.other);
            self.inner.checkpoint(lease, progress)
        }
        fn complete<'s, 'l, 'r, 'f>(&'s self, lease: &'l Lease, result: &'r [u8]) -> Fut<'f, ()>
        where
            's: 'f,
            'l: 'f,
            'r: 'f,
        {
            bump(&self.completes);
            self.inner.complete(lease, result)
        }
        fn complete_batch<'s, 'i, 'f>(&'s self, items: &'i [(Lease, Vec<u8>)]) -> Fut<'f, Vec<fence::Result<()>>>
        where
            's: 'f,
            'i: 'f,
        {
            bump(&self.completes);
            timed(self.inner.complete_batch(items), Arc::clone(&self.commit_nanos))
        }
        fn fail<'s, 'l, 'e, 'p, 'f>(
            &'s self,
            lease: &'l Lease,
            error: &'e str,
            retry: bool,
            policy: &'p RetryPolicy,
        ) -> Fut<'f, FailOutcome>
        where
            's: 'f,
            'l: 'f,
            'e: 'f,
            'p: 'f,
        {
            bump(&self.other);
            self.inner.fail(lease, error, retry, policy)
        }
        fn release<'s, 'l, 'f>(&'s self, lease: &'l Lease) -> Fut<'f, ()>
        where
            's: 'f,
            'l: 'f,
        {
            bump(&self.other);
            self.inner.release(lease)
        }
        fn job<'s, 'q, 'k, 'f>(&'s self, queue: &'q QueueName, key: &'k JobKey) -> Fut<'f, Option<JobRecord>>
        where
            's: 'f,
            'q: 'f,
            'k: 'f,
        {
            self.inner.job(queue, key)
        }
        fn db_now<'s, 'f>(&'s self) -> Fut<'f, DbTime>
        where
            's: 'f,
        {
            self.inner.db_now()
        }
        fn backend(&self) -> &'static str {
            self.inner.backend()
        }

        fn concrete(&self) -> brokerfence::fence::Backend<'_> {
            self.inner.concrete()
        }
    }

    async fn produce(
        conn: &mut client::aio::ConnectionManager,
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
        let redis_url =
            brokerfence_testkit::services::var("REDIS_URL").ok_or("REDIS_URL is not set (run localstack/up)")?;
        let db_url =
            brokerfence_testkit::services::var("DATABASE_URL").ok_or("DATABASE_URL is not set (run localstack/up)")?;
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
        let store = Arc::new(Counting {
            inner: Arc::new(pg.clone()),
            claims: AtomicU64::new(0),
            claim_nanos: Arc::default(),
            commit_nanos: Arc::default(),
            completes: AtomicU64::new(0),
            heartbeats: AtomicU64::new(0),
            other: AtomicU64::new(0),
        });
        let t_fenced = fenced(&redis, Arc::clone(&store), &fenced_stream, &a).await?;

        let n = a.messages as f64;
        let (plain_rate, fenced_rate) = (n / t_plain.as_secs_f64(), n / t_fenced.as_secs_f64());
        println!("  plain  XREADGROUP/XACK: {:>9.0} msg/s ({:.2} s)", plain_rate, t_plain.as_secs_f64());
        println!("  fenced (PostgreSQL):    {:>9.0} msg/s ({:.2} s)", fenced_rate, t_fenced.as_secs_f64());
        println!("  ratio fenced/plain:     {:>9.3}", fenced_rate / plain_rate);
        println!(
            "  DB statements/message:  {:>9.3} (claim batches {}, completes {}, heartbeats {}, other {})",
            store.total() as f64 / n,
            store.claims.load(Ordering::Relaxed),
            store.completes.load(Ordering::Relaxed),
            store.heartbeats.load(Ordering::Relaxed),
            store.other.load(Ordering::Relaxed)
        );
        let avg = |sum: &AtomicU64, n: &AtomicU64| {
            sum.load(Ordering::Relaxed) as f64 / 1e6 / n.load(Ordering::Relaxed).max(1) as f64
        };
        println!(
            "  DB round trip:          claim batch {:.2} ms avg ({:.1} jobs), group commit {:.2} ms avg ({:.1} jobs)",
            avg(&store.claim_nanos, &store.claims),
            n / store.claims.load(Ordering::Relaxed).max(1) as f64,
            avg(&store.commit_nanos, &store.completes),
            n / store.completes.load(Ordering::Relaxed).max(1) as f64,
        );

        let _: Value = client::cmd("DEL").arg(&plain_stream).arg(&fenced_stream).query_async(&mut conn).await?;
        sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {} CASCADE", schema.as_str()))).execute(pg.pool()).await?;
        Ok(())
    }

    pub fn run(raw: Vec<String>) -> i32 {
        let a = match <Args as clap::Parser>::try_parse_from(std::iter::once("bench_redis".to_owned()).chain(raw)) {
            Ok(a) => a,
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
