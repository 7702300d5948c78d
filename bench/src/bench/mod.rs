//! What the fence costs, per source, in one run:
//!
//! - fenced throughput against a plain baseline on the same database / broker, same concurrency,
//!   same work per job (the ratio);
//! - database round trips (statements) per job, counted by a wrapping [`FenceStore`];
//! - p50/p99 latency the fence adds to one job;
//! - how soon a handler is cancelled after its lease is lost (a takeover in the database);
//! - heartbeat statements per worker per tick for 1, 10, 100 and 1,000 jobs in flight;
//! - resident memory at the start, middle and end of a 100,000-job run.
//!
//! ```text
//! cargo run --release --example bench                      # table queue on PostgreSQL
//! cargo run --release --features sqs,redis --example bench  # + SQS (LocalStack) and Redis streams
//! cargo run --release --example bench -- --quick            # smaller runs, for a smoke test
//! ```
//!
//! Options: `--sources table,sqs,redis`, `--jobs N` (throughput runs), `--memory-jobs N` (the
//! long run, default 100000), `--work-ms W` (work per job, default 1), `--workers N`,
//! `--concurrency C` (per worker), `--batch B`, `--claim-window-ms MS`, `--commit-window-ms MS`
//! (default 5 each), `--rounds N`, `--quick`, `--own-commit-only` (only the comparison of a
//! handler-owned commit, `JobContext::complete_in` in the handler's transaction, with the
//! runtime's grouped commit: the median of `--rounds` paired rounds), `--defaults [--levels
//! 16,64,128]` (only the table queue at its defaults against a plain SKIP LOCKED loop, with
//! PostgreSQL CPU and WAL bytes per job: see `bench/defaults.rs`).
//! PostgreSQL from `DATABASE_URL`, Redis from `REDIS_URL`, SQS from the AWS environment (all fall
//! back to `localstack/.env`). A benchmark, not a test: it prints figures and asserts nothing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use brokerfence::adapters::{Consumer, ConsumerConfig, Source};
use brokerfence::fence::{
    Claim, ClaimedJob, DbTime, FailOutcome, FenceStore, Heartbeat, JobContext, JobError, JobKey, JobRecord, Lease,
    LeaseDuration, Owner, PgFence, QueueName, RetryPolicy, SchemaName, Supervisor, SupervisorConfig,
};
use brokerfence::table::TableQueue;
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;


mod defaults;

// ------------------------------------------------------------------------------------------------
// Counting store: every call of the store is one statement (one round trip)
// ------------------------------------------------------------------------------------------------

const METHODS: [&str; 13] = [
    "claim",
    "claim_batch",
    "enqueue",
    "claim_next",
    "heartbeat",
    "checkpoint",
    "complete",
    "complete_batch",
    "fail",
    "release",
    "job",
    "completed_under",
    "db_now",
];

/// A [`FenceStore`] that counts the statements sent through it, by method. Every method of the
/// PostgreSQL store is one statement; `claim_batch` may take a second round for keys inserted
/// concurrently by another claimer (rare; counted once here).
struct Counting {
    inner: Arc<dyn FenceStore>,
    counts: [AtomicU64; METHODS.len()],
    nanos: [AtomicU64; METHODS.len()],
}

impl Counting {
    fn new(inner: Arc<dyn FenceStore>) -> Arc<Self> {
        Arc::new(Self { inner, counts: Default::default(), nanos: Default::default() })
    }
    fn hit(&self, method: &str) {
        if let Some(i) = METHODS.iter().position(|m| *m == method) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
    }
    /// Counts one call of `method` and the time it took.
    async fn timed<T>(&self, method: &str, call: impl std::future::Future<Output = T>) -> T {
        self.hit(method);
        let started = Instant::now();
        let out = call.await;
        if let Some(i) = METHODS.iter().position(|m| *m == method) {
            self.nanos[i].fetch_add(u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
        }
        out
    }
    /// "method: calls (mean ms)" for every method called.
    fn describe(&self) -> String {
        METHODS
            .iter()
            .enumerate()
            .filter_map(|(i, m)| {
                let n = self.counts[i].load(Ordering::Relaxed);
                let ns = self.nanos[i].load(Ordering::Relaxed);
                (n > 0).then(|| format!("{m} {n} ({:.2} ms)", ns as f64 / n as f64 / 1e6))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
    fn get(&self, method: &str) -> u64 {
        METHODS.iter().position(|m| *m == method).map(|i| self.counts[i].load(Ordering::Relaxed)).unwrap_or(0)
    }
    fn total(&self) -> u64 {
        // Statements a worker sends while running jobs (not the bench's own enqueues / reads).
        [
            "claim",
            "claim_batch",
            "claim_next",
            "heartbeat",
            "checkpoint",
            "complete",
            "complete_batch",
            "fail",
            "release",
        ]
        .iter()
        .map(|m| self.get(m))
        .sum()
    }
    fn snapshot(&self) -> HashMap<&'static str, u64> {
        METHODS.iter().map(|m| (*m, self.get(m))).filter(|(_, n)| *n > 0).collect()
    }
    fn reset(&self) {
        for c in self.counts.iter().chain(&self.nanos) {
            c.store(0, Ordering::Relaxed);
        }
    }
}

#[async_trait]
impl FenceStore for Counting {
    async fn migrate(&self) -> brokerfence::fence::Result<()> {
        self.inner.migrate().await
    }
    async fn claim(
        &self,
        queue: &QueueName,
        key: &JobKey,
        owner: &Owner,
        lease: LeaseDuration,
    ) -> brokerfence::fence::Result<Claim> {
        self.timed("claim", self.inner.claim(queue, key, owner, lease)).await
    }
    async fn claim_batch(
        &self,
        queue: &QueueName,
        keys: &[JobKey],
        owner: &Owner,
        lease: LeaseDuration,
    ) -> brokerfence::fence::Result<Vec<Claim>> {
        self.timed("claim_batch", self.inner.claim_batch(queue, keys, owner, lease)).await
    }
    async fn enqueue(&self, queue: &QueueName, key: &JobKey, payload: &[u8]) -> brokerfence::fence::Result<bool> {
        self.timed("enqueue", self.inner.enqueue(queue, key, payload)).await
    }
    async fn enqueue_many(&self, queue: &QueueName, jobs: &[(JobKey, Vec<u8>)]) -> brokerfence::fence::Result<u64> {
        self.timed("enqueue", self.inner.enqueue_many(queue, jobs)).await
    }
    async fn claim_next(
        &self,
        queue: &QueueName,
        owner: &Owner,
        lease: LeaseDuration,
        n: u32,
    ) -> brokerfence::fence::Result<Vec<ClaimedJob>> {
        self.timed("claim_next", self.inner.claim_next(queue, owner, lease, n)).await
    }
    async fn heartbeat(&self, leases: &[Lease], lease: LeaseDuration) -> brokerfence::fence::Result<Heartbeat> {
        self.timed("heartbeat", self.inner.heartbeat(leases, lease)).await
    }
    async fn heartbeat_unless_locked(
        &self,
        leases: &[Lease],
        lease: LeaseDuration,
    ) -> brokerfence::fence::Result<Heartbeat> {
        self.timed("heartbeat", self.inner.heartbeat_unless_locked(leases, lease)).await
    }
    async fn checkpoint(&self, lease: &Lease, progress: &[u8]) -> brokerfence::fence::Result<()> {
        self.timed("checkpoint", self.inner.checkpoint(lease, progress)).await
    }
    async fn complete(&self, lease: &Lease, result: &[u8]) -> brokerfence::fence::Result<()> {
        self.timed("complete", self.inner.complete(lease, result)).await
    }
    async fn complete_batch(
        &self,
        items: &[(Lease, Vec<u8>)],
    ) -> brokerfence::fence::Result<Vec<brokerfence::fence::Result<()>>> {
        self.timed("complete_batch", self.inner.complete_batch(items)).await
    }
    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        retry: bool,
        policy: &RetryPolicy,
    ) -> brokerfence::fence::Result<FailOutcome> {
        self.timed("fail", self.inner.fail(lease, error, retry, policy)).await
    }
    async fn release(&self, lease: &Lease) -> brokerfence::fence::Result<()> {
        self.timed("release", self.inner.release(lease)).await
    }
    async fn job(&self, queue: &QueueName, key: &JobKey) -> brokerfence::fence::Result<Option<JobRecord>> {
        self.timed("job", self.inner.job(queue, key)).await
    }
    async fn completed_under(&self, leases: &[Lease]) -> brokerfence::fence::Result<Vec<bool>> {
        self.timed("completed_under", self.inner.completed_under(leases)).await
    }
    async fn db_now(&self) -> brokerfence::fence::Result<DbTime> {
        self.timed("db_now", self.inner.db_now()).await
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn concrete(&self) -> brokerfence::fence::Backend<'_> {
        self.inner.concrete()
    }

    async fn prune(
        &self,
        retention: &brokerfence::fence::Retention,
    ) -> brokerfence::fence::Result<brokerfence::fence::PruneReport> {
        self.inner.prune(retention).await
    }
}

// ------------------------------------------------------------------------------------------------
// Options, figures, helpers
// ------------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct Opts {
    sources: Vec<String>,
    jobs: usize,
    memory_jobs: usize,
    work: Duration,
    workers: usize,
    concurrency: usize,
    batch: usize,
    /// Concurrency of the SQS and Redis consumers (the fenced one and its plain baseline).
    broker_concurrency: usize,
    /// Throughput runs per figure (the best counts).
    rounds: usize,
    /// The consumers' claim window and the supervisors' commit window.
    claim_window: Duration,
    commit_window: Duration,
    quick: bool,
    /// Only the handler-owned commit against the grouped commit.
    own_commit_only: bool,
    /// Only the table queue at its defaults against a plain SKIP LOCKED loop, at these levels
    /// of concurrency.
    defaults: Option<Vec<usize>>,
}

/// Benchmark (by hand): throughput and overhead of the fence on the table queue (PostgreSQL),
/// and with features sqs/redis against plain SQS and Redis consumers. Exit codes: 0 done,
/// 1 failed, 2 bad command line.
#[derive(clap::Parser)]
#[command(name = "bench", help_template = "usage: {usage}\n\n{about-with-newline}\n{all-args}{after-help}")]
struct Cli {
    /// Sources to measure, comma separated: table, sqs, redis
    #[arg(long, value_name = "LIST", default_value = "table,sqs,redis")]
    sources: String,
    /// Jobs per throughput run [default: 30000; 3000 with --quick]
    #[arg(long, value_name = "N")]
    jobs: Option<usize>,
    /// Jobs of the long (memory) run [default: 100000; 10000 with --quick]
    #[arg(long, value_name = "N")]
    memory_jobs: Option<usize>,
    /// Milliseconds of work per job
    #[arg(long = "work-ms", value_name = "W", default_value_t = 1)]
    work: u64,
    /// Worker processes' worth of consumers
    #[arg(long, value_name = "N", default_value = "4", value_parser = at_least_one)]
    workers: usize,
    /// Jobs at once per worker
    #[arg(long, value_name = "C", default_value = "64", value_parser = at_least_one)]
    concurrency: usize,
    /// Claim batch
    #[arg(long, value_name = "B", default_value = "64", value_parser = at_least_one)]
    batch: usize,
    /// Concurrency of the SQS and Redis consumers (fenced and plain)
    #[arg(long, value_name = "C", default_value = "32", value_parser = at_least_one)]
    broker_concurrency: usize,
    /// Throughput runs per figure (the best counts) [default: 2; 1 with --quick]
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    rounds: Option<usize>,
    /// Milliseconds the consumers group claims for [default: 5]
    #[arg(long = "claim-window-ms", value_name = "MS")]
    claim_window: Option<u64>,
    /// Milliseconds the supervisors group commits for [default: 5]
    #[arg(long = "commit-window-ms", value_name = "MS")]
    commit_window: Option<u64>,
    /// Smaller runs, for a smoke test
    #[arg(long)]
    quick: bool,
    /// Only the handler-owned commit against the grouped commit
    #[arg(long)]
    own_commit_only: bool,
    /// Only the table queue at its defaults (concurrency set, nothing else) against a plain
    /// SKIP LOCKED loop, at each concurrency of --levels; jobs default to 20000, rounds to 3
    #[arg(long)]
    defaults: bool,
    /// Levels of concurrency for --defaults, comma separated
    #[arg(long, value_name = "LIST", default_value = "16,64,128", value_delimiter = ',')]
    levels: Vec<usize>,
}

fn at_least_one(v: &str) -> Result<usize, String> {
    v.parse::<usize>().map(|n| n.max(1)).map_err(|e| format!("{v:?}: {e}"))
}

fn parse_opts() -> Result<Opts, clap::Error> {
    let c = <Cli as clap::Parser>::try_parse()?;
    Ok(Opts {
        sources: c.sources.split(',').map(str::to_owned).collect(),
        jobs: c.jobs.unwrap_or(if c.quick {
            3_000
        } else if c.defaults {
            20_000
        } else {
            30_000
        }),
        memory_jobs: c.memory_jobs.unwrap_or(if c.quick { 10_000 } else { 100_000 }),
        work: Duration::from_millis(c.work),
        workers: c.workers,
        concurrency: c.concurrency,
        batch: c.batch,
        broker_concurrency: c.broker_concurrency,
        rounds: c.rounds.unwrap_or(if c.quick {
            1
        } else if c.defaults {
            3
        } else {
            2
        }),
        claim_window: c.claim_window.map_or(brokerfence::adapters::DEFAULT_CLAIM_WINDOW, Duration::from_millis),
        commit_window: c.commit_window.map_or(brokerfence::fence::DEFAULT_COMMIT_WINDOW, Duration::from_millis),
        quick: c.quick,
        own_commit_only: c.own_commit_only,
        defaults: c.defaults.then_some(c.levels),
    })
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

/// Resident memory of this process, from /proc/self/status (kB), and its peak.
fn rss_kb() -> (u64, u64) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find(|l| l.starts_with("model name"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_owned())
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let mem_kb: u64 = meminfo
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    format!("{cores} cores ({model}), {:.0} GiB RAM", mem_kb as f64 / 1_048_576.0)
}

/// One throughput figure.
#[derive(Debug, Clone, Copy)]
struct Rate {
    jobs: usize,
    secs: f64,
}

impl Rate {
    fn per_sec(self) -> f64 {
        self.jobs as f64 / self.secs.max(1e-9)
    }
}

impl std::fmt::Display for Rate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:>8.0} jobs/s ({} jobs in {:.2} s)", self.per_sec(), self.jobs, self.secs)
    }
}

fn line(label: &str, value: impl std::fmt::Display) {
    println!("  {label:<58} {value}");
}

async fn wait_until(what: &str, within: Duration, mut done: impl FnMut() -> bool) -> Result<(), String> {
    let deadline = Instant::now() + within;
    while !done() {
        if Instant::now() > deadline {
            return Err(format!("timed out waiting for {what}"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

pub fn main() {
    let opts = match parse_opts() {
        Ok(o) => o,
        Err(e) => {
            let _ = e.print();
            std::process::exit(e.exit_code());
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("bench: runtime: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = rt.block_on(bench(opts)) {
        eprintln!("bench: {e}");
        std::process::exit(1);
    }
}

async fn bench(o: Opts) -> Result<(), String> {
    let url = brokerfence_testkit::services::var("DATABASE_URL")
        .ok_or("DATABASE_URL is not set and localstack/.env has none: run `bash localstack/up` first")?;
    if let Some(levels) = &o.defaults {
        println!("brokerfence bench — {}; load average at start {}", machine(), loadavg());
        let result = defaults::run(&o, &url, levels).await;
        println!("\nload average at the end {} (other work on the machine skews the figures)", loadavg());
        return result;
    }
    let pg = table::Pg::connect(&url).await?;
    println!("brokerfence bench — {}; load average at start {}", machine(), loadavg());
    println!("  {}", pg.describe().await?);
    println!(
        "  work per job {}, {} workers × concurrency {}, batch {}{}",
        ms(o.work),
        o.workers,
        o.concurrency,
        o.batch,
        if cfg!(debug_assertions) { "  [DEBUG BUILD: use --release for figures]" } else { "" }
    );
    let result = async {
        if o.sources.iter().any(|s| s == "table") {
            table::run(&o, &pg).await?;
        }
        if o.sources.iter().any(|s| s == "sqs") {
            #[cfg(feature = "sqs")]
            sqs_bench::run(&o, &pg).await?;
            #[cfg(not(feature = "sqs"))]
            println!("\n[sqs] skipped: build with --features sqs");
        }
        if o.sources.iter().any(|s| s == "redis") {
            #[cfg(feature = "redis")]
            redis_bench::run(&o, &pg).await?;
            #[cfg(not(feature = "redis"))]
            println!("\n[redis] skipped: build with --features redis");
        }
        Ok::<(), String>(())
    }
    .await;
    pg.cleanup().await;
    println!("\nload average at the end {} (other work on the machine skews the figures)", loadavg());
    result
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

// ------------------------------------------------------------------------------------------------
// Source-independent measurements
// ------------------------------------------------------------------------------------------------

/// Heartbeat statements per tick with K jobs in flight on one worker, for several K at once (one
/// supervisor each). Returns (K, ticks, heartbeat statements, renewals, mean statement time).
async fn heartbeat_cost(pg: &PgFence, sizes: &[usize]) -> Result<Vec<(usize, u64, u64, u64)>, String> {
    let lease = LeaseDuration::from_secs(3).map_err(|e| e.to_string())?;
    let mut runs = Vec::new();
    for &k in sizes {
        let q = QueueName::new(format!("hb-{k}")).map_err(|e| e.to_string())?;
        let jobs: Vec<(JobKey, Vec<u8>)> = (0..k)
            .map(|i| JobKey::new(format!("j{i}")).map(|key| (key, Vec::new())))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        pg.enqueue_many(&q, &jobs).await.map_err(|e| e.to_string())?;
        let counting = Counting::new(Arc::new(pg.clone()));
        let store: Arc<dyn FenceStore> = counting.clone();
        let owner = Owner::unique("hb");
        let claimed = store
            .claim_next(&q, &owner, lease, u32::try_from(k).unwrap_or(u32::MAX))
            .await
            .map_err(|e| e.to_string())?;
        counting.reset();
        let sup = Supervisor::new(Arc::clone(&store), owner, SupervisorConfig::new(lease));
        runs.push((k, counting, sup, claimed));
    }
    // Every job holds for 3.5 s: three ticks (at 1, 2 and 3 s).
    let mut tasks = Vec::new();
    for (_, _, sup, claimed) in &runs {
        for job in claimed.iter().cloned() {
            let sup = sup.clone();
            tasks.push(tokio::spawn(async move {
                sup.run(job.lease, job.payload, None, |_ctx: JobContext| async {
                    tokio::time::sleep(Duration::from_millis(3500)).await;
                    Ok(Vec::new())
                })
                .await
            }));
        }
    }
    for t in tasks {
        t.await.map_err(|e| e.to_string())?;
    }
    Ok(runs
        .iter()
        .map(|(k, counting, sup, _)| {
            let m = sup.metrics().snapshot();
            (*k, m.heartbeats, counting.get("heartbeat"), m.renewals)
        })
        .collect())
}

/// Time from a takeover in the database to the moment the old holder's handler is cancelled,
/// through the consumer runtime over `source`: `samples` deliveries are claimed and held, then
/// given to another owner (a newer epoch) one at a time, spread over about 3 s; the heartbeat of
/// a 3 s lease ticks every second. Each latency is from the takeover statement's return to the
/// handler's cancellation token firing.
async fn consumer_cancellation<S: Source>(source: S, pg: &PgFence, samples: usize) -> Result<Vec<Duration>, String> {
    let queue = source.queue().clone();
    let store: Arc<dyn FenceStore> = Arc::new(pg.clone());
    let lease = LeaseDuration::from_secs(3).map_err(|e| e.to_string())?;
    let config = ConsumerConfig::new(SupervisorConfig::new(lease))
        .concurrency(samples)
        .batch(10)
        .grace(Duration::from_millis(100));
    let consumer = Consumer::new(source, store, config);
    type Marks = Arc<Mutex<HashMap<String, Arc<Mutex<Option<Instant>>>>>>;
    let held: Marks = Arc::default();
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let (held, stop) = (Arc::clone(&held), stop.clone());
        async move {
            let handler = move |ctx: JobContext| {
                let held = Arc::clone(&held);
                async move {
                    // The handler's future is dropped at cancellation; a watcher notes the moment.
                    let mark: Arc<Mutex<Option<Instant>>> = Arc::default();
                    held.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(ctx.key().as_str().to_owned(), Arc::clone(&mark));
                    let token = ctx.cancellation();
                    tokio::spawn(async move {
                        token.cancelled().await;
                        *mark.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
                    });
                    std::future::pending::<()>().await;
                    Ok::<_, JobError>(Vec::new())
                }
            };
            consumer.run(handler, stop).await
        }
    });
    let claimed = || held.lock().unwrap_or_else(|p| p.into_inner()).len();
    wait_until("every sample to be claimed", Duration::from_secs(60), || claimed() >= samples).await?;
    let keys: Vec<String> = held.lock().unwrap_or_else(|p| p.into_inner()).keys().cloned().collect();
    let s = pg.schema().as_str();
    let mut stolen_at = Vec::new();
    for key in &keys {
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {s}.jobs SET epoch = epoch + 1, owner = 'thief', \
             lease_until = clock_timestamp() + interval '30 seconds' WHERE queue = $1 AND key = $2"
        )))
        .bind(queue.as_str().to_owned())
        .bind(key.clone())
        .execute(pg.pool())
        .await
        .map_err(|e| e.to_string())?;
        stolen_at.push(Instant::now());
        let jitter = rand::random::<u64>() % 60;
        tokio::time::sleep(Duration::from_millis(2800 / samples.max(1) as u64 + jitter)).await;
    }
    let marks: Vec<Arc<Mutex<Option<Instant>>>> = {
        let held = held.lock().unwrap_or_else(|p| p.into_inner());
        keys.iter().filter_map(|k| held.get(k).cloned()).collect()
    };
    let fired = || marks.iter().all(|m| m.lock().unwrap_or_else(|p| p.into_inner()).is_some());
    wait_until("every handler to be cancelled", Duration::from_secs(10), fired).await?;
    stop.cancel();
    run.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    let mut lat: Vec<Duration> = marks
        .iter()
        .zip(stolen_at)
        .filter_map(|(m, stolen)| {
            m.lock().unwrap_or_else(|p| p.into_inner()).map(|at| at.saturating_duration_since(stolen))
        })
        .collect();
    lat.sort();
    Ok(lat)
}

fn print_cancellation(lat: &[Duration]) {
    line(
        "cancellation after a takeover, lease 3 s (tick 1 s): p50 / max",
        format!(
            "{} / {}  ({} samples)",
            ms(percentile(lat, 0.5)),
            ms(lat.last().copied().unwrap_or_default()),
            lat.len()
        ),
    );
}

// ------------------------------------------------------------------------------------------------
// Table queue on PostgreSQL
// ------------------------------------------------------------------------------------------------

mod table {
    use super::*;

    /// The bench's own schema on PostgreSQL, with a plain queue table next to the fence's.
    pub struct Pg {
        pub fence: PgFence,
        /// The handlers' own pool, for transactions that end with `complete_in` (an application
        /// pool of its own, as a user's handlers would have).
        pub handlers: sqlx::PgPool,
    }

    impl Pg {
        pub async fn connect(url: &str) -> Result<Self, String> {
            let schema = SchemaName::new(format!("bench_{:08x}", rand::random::<u32>())).map_err(|e| e.to_string())?;
            let options: sqlx::postgres::PgConnectOptions = url.parse().map_err(|e: sqlx::Error| e.to_string())?;
            let pool = PgFence::pool_options()
                .max_connections(16)
                .connect_with(options.clone().application_name("brokerfence-bench"))
                .await
                .map_err(|e| format!("connect to PostgreSQL (run `bash localstack/up`): {e}"))?;
            let handlers = sqlx::postgres::PgPoolOptions::new()
                .max_connections(32)
                .acquire_timeout(Duration::from_secs(10))
                .connect_with(options.clone().application_name("brokerfence-bench-handlers"))
                .await
                .map_err(|e| format!("connect to PostgreSQL: {e}"))?;
            let fence = PgFence::new(pool).with_schema(schema);
            fence.migrate().await.map_err(|e| e.to_string())?;
            let s = fence.schema().as_str();
            for stmt in [
                format!(
                    "CREATE TABLE {s}.plain (queue text NOT NULL, key text NOT NULL, state text NOT NULL DEFAULT 'pending', \
                     payload bytea, result bytea, PRIMARY KEY (queue, key))"
                ),
                format!("CREATE INDEX plain_pending ON {s}.plain (queue) WHERE state = 'pending'"),
            ] {
                sqlx::query(AssertSqlSafe(stmt)).execute(fence.pool()).await.map_err(|e| e.to_string())?;
            }
            Ok(Self { fence, handlers })
        }

        pub async fn describe(&self) -> Result<String, String> {
            let row: (String, String, String, String) = sqlx::query_as(
                "SELECT split_part(version(), ' on ', 1), current_setting('synchronous_commit'), current_setting('fsync'), \
                 current_setting('shared_buffers')",
            )
            .fetch_one(self.fence.pool())
            .await
            .map_err(|e| e.to_string())?;
            Ok(format!(
                "{} on the same machine (synchronous_commit={}, fsync={}, shared_buffers={})",
                row.0, row.1, row.2, row.3
            ))
        }

        pub async fn cleanup(&self) {
            let s = self.fence.schema().as_str();
            let _ = sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {s} CASCADE"))).execute(self.fence.pool()).await;
        }

        async fn enqueue(&self, q: &QueueName, n: usize) -> Result<(), String> {
            for start in (0..n).step_by(5000) {
                let jobs: Vec<(JobKey, Vec<u8>)> = (start..(start + 5000).min(n))
                    .map(|i| JobKey::new(format!("job-{i:07}")).map(|k| (k, b"{\"n\":1}".to_vec())))
                    .collect::<Result<_, _>>()
                    .map_err(|e| e.to_string())?;
                self.fence.enqueue_many(q, &jobs).await.map_err(|e| e.to_string())?;
            }
            sqlx::query("ANALYZE").execute(self.fence.pool()).await.map_err(|e| e.to_string())?;
            Ok(())
        }

        async fn enqueue_plain(&self, q: &str, n: usize) -> Result<(), String> {
            let s = self.fence.schema().as_str();
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {s}.plain (queue, key, payload) SELECT $1, 'job-' || lpad(i::text, 7, '0'), '{{\"n\":1}}'::bytea \
                 FROM generate_series(0, $2 - 1) i"
            )))
            .bind(q.to_owned())
            .bind(i64::try_from(n).unwrap_or(i64::MAX))
            .execute(self.fence.pool())
            .await
            .map_err(|e| e.to_string())?;
            sqlx::query("ANALYZE").execute(self.fence.pool()).await.map_err(|e| e.to_string())?;
            Ok(())
        }
    }

    fn config(o: &Opts) -> Result<ConsumerConfig, String> {
        let lease = LeaseDuration::from_secs(30).map_err(|e| e.to_string())?;
        Ok(ConsumerConfig::new(SupervisorConfig::new(lease).commit_window(o.commit_window))
            .concurrency(o.concurrency)
            .batch(o.batch)
            .claim_window(o.claim_window)
            .grace(Duration::from_secs(5)))
    }

    /// The fenced consumer runtime (Consumer + TableQueue + Supervisor), `workers` consumers in
    /// this process. Samples RSS at the start, the middle and the end.
    async fn fenced_consumer(
        o: &Opts,
        pg: &Pg,
        jobs: usize,
        counting: &Arc<Counting>,
    ) -> Result<(Rate, [(u64, u64); 3]), String> {
        fenced_consumer_committing(o, pg, jobs, counting, None).await
    }

    /// [`fenced_consumer`], whose handlers commit their results themselves when `own` is given:
    /// a transaction on that pool, `complete_in`, `COMMIT` (the handler-owned commit), instead of
    /// returning them to the runtime's grouped commit.
    async fn fenced_consumer_committing(
        o: &Opts,
        pg: &Pg,
        jobs: usize,
        counting: &Arc<Counting>,
        own: Option<&sqlx::PgPool>,
    ) -> Result<(Rate, [(u64, u64); 3]), String> {
        let q = QueueName::new(format!("fenced-{jobs}-{:x}", rand::random::<u32>())).map_err(|e| e.to_string())?;
        pg.enqueue(&q, jobs).await?;
        counting.reset();
        let store: Arc<dyn FenceStore> = counting.clone();
        let stop = CancellationToken::new();
        let rss_start = rss_kb();
        let started = Instant::now();
        let mut runs = Vec::new();
        let mut metrics = Vec::new();
        for _ in 0..o.workers {
            let source = TableQueue::new(Arc::clone(&store), q.clone()).idle_wait(Duration::from_millis(5));
            let consumer = Consumer::new(source, Arc::clone(&store), config(o)?);
            metrics.push(consumer.metrics());
            let (stop, work, own) = (stop.clone(), o.work, own.cloned());
            runs.push(tokio::spawn(async move {
                let handler = move |ctx: JobContext| {
                    let own = own.clone();
                    async move {
                        tokio::time::sleep(work).await;
                        if let Some(pool) = own {
                            let mut tx = pool.begin().await.map_err(JobError::retry)?;
                            ctx.complete_in(&mut *tx, b"ok").await.map_err(JobError::retry)?;
                            tx.commit().await.map_err(JobError::retry)?;
                        }
                        Ok::<_, JobError>(b"ok".to_vec())
                    }
                };
                consumer.run(handler, stop).await
            }));
        }
        let target = jobs as u64;
        let completed = || metrics.iter().map(|m| m.snapshot().completions).sum::<u64>();
        let mut rss_mid = None;
        let deadline = Instant::now() + Duration::from_secs(900);
        loop {
            let n = completed();
            if rss_mid.is_none() && n >= target / 2 {
                rss_mid = Some(rss_kb());
            }
            if n >= target {
                break;
            }
            if Instant::now() > deadline {
                return Err("fenced consumer run did not finish in 15 minutes".into());
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // All commits are in: the elapsed time is the throughput time.
        let secs = started.elapsed().as_secs_f64();
        let rss_end = rss_kb();
        stop.cancel();
        for r in runs {
            r.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
        }
        Ok((Rate { jobs, secs }, [rss_start, rss_mid.unwrap_or(rss_start), rss_end]))
    }

    /// A plain SKIP LOCKED table queue with the same shape of runtime as the consumer: claim up
    /// to `batch` free slots, one task per job, the slot held until the job's commit is done.
    /// Commits are one UPDATE per job, or (`group`) grouped like the supervisor's: a commit task
    /// takes every completion queued at the moment and commits them with one UPDATE. No epochs,
    /// no leases, no heartbeats.
    async fn plain_consumer(o: &Opts, pg: &Pg, jobs: usize, group: bool) -> Result<Rate, String> {
        let q = format!("plain-{jobs}-{:x}", rand::random::<u32>());
        pg.enqueue_plain(&q, jobs).await?;
        let s = pg.fence.schema().as_str().to_owned();
        let claim: Arc<str> = format!(
            "UPDATE {s}.plain t SET state = 'running' FROM (SELECT queue, key FROM {s}.plain \
             WHERE queue = $1 AND state = 'pending' LIMIT $2 FOR UPDATE SKIP LOCKED) p \
             WHERE t.queue = p.queue AND t.key = p.key RETURNING t.key, t.payload"
        )
        .into();
        let complete_one: Arc<str> =
            format!("UPDATE {s}.plain SET state = 'done', result = $3 WHERE queue = $1 AND key = $2").into();
        let complete_many: Arc<str> = format!(
            "UPDATE {s}.plain t SET state = 'done', result = u.r FROM unnest($2::text[], $3::bytea[]) AS u(k, r) \
             WHERE t.queue = $1 AND t.key = u.k"
        )
        .into();
        type Commit = (String, tokio::sync::oneshot::Sender<bool>);
        let done = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let mut workers = Vec::new();
        for _ in 0..o.workers {
            let (pool, q, claim, done) = (pg.fence.pool().clone(), q.clone(), Arc::clone(&claim), Arc::clone(&done));
            let (concurrency, batch, work, total) = (o.concurrency, o.batch, o.work, jobs as u64);
            // The group-commit task of this worker.
            let (commit_tx, mut commit_rx) = tokio::sync::mpsc::unbounded_channel::<Commit>();
            let committer = {
                let (pool, q, many) = (pool.clone(), q.clone(), Arc::clone(&complete_many));
                tokio::spawn(async move {
                    while let Some(first) = commit_rx.recv().await {
                        let mut batch = vec![first];
                        while batch.len() < 256 {
                            match commit_rx.try_recv() {
                                Ok(c) => batch.push(c),
                                Err(_) => break,
                            }
                        }
                        let (keys, replies): (Vec<String>, Vec<_>) = batch.into_iter().unzip();
                        let results = vec![b"ok".to_vec(); keys.len()];
                        let ok = sqlx::query(AssertSqlSafe(Arc::clone(&many)))
                            .bind(q.clone())
                            .bind(keys)
                            .bind(results)
                            .execute(&pool)
                            .await
                            .is_ok();
                        for r in replies {
                            let _ = r.send(ok);
                        }
                    }
                })
            };
            let one = Arc::clone(&complete_one);
            workers.push(tokio::spawn(async move {
                let slots = Arc::new(tokio::sync::Semaphore::new(concurrency));
                let mut tasks = tokio::task::JoinSet::new();
                while done.load(Ordering::Relaxed) < total {
                    while tasks.try_join_next().is_some() {}
                    let free = slots.available_permits().min(batch);
                    if free == 0 {
                        let _ = tasks.join_next().await;
                        continue;
                    }
                    let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(Arc::clone(&claim)))
                        .bind(q.clone())
                        .bind(i64::try_from(free).unwrap_or(1))
                        .fetch_all(&pool)
                        .await
                        .map_err(|e| e.to_string())?;
                    if rows.is_empty() {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        continue;
                    }
                    for (key, _payload) in rows {
                        let permit = Arc::clone(&slots).acquire_owned().await.map_err(|e| e.to_string())?;
                        let (pool, q, one, done, commit_tx) =
                            (pool.clone(), q.clone(), Arc::clone(&one), Arc::clone(&done), commit_tx.clone());
                        tasks.spawn(async move {
                            tokio::time::sleep(work).await;
                            let ok = if group {
                                let (tx, rx) = tokio::sync::oneshot::channel();
                                commit_tx.send((key, tx)).is_ok() && rx.await.unwrap_or(false)
                            } else {
                                sqlx::query(AssertSqlSafe(one))
                                    .bind(q)
                                    .bind(key)
                                    .bind(b"ok".to_vec())
                                    .execute(&pool)
                                    .await
                                    .is_ok()
                            };
                            if ok {
                                done.fetch_add(1, Ordering::Relaxed);
                            }
                            drop(permit);
                        });
                    }
                }
                while tasks.join_next().await.is_some() {}
                drop(commit_tx);
                let _ = committer.await;
                Ok::<(), String>(())
            }));
        }
        wait_until("the plain consumers", Duration::from_secs(600), || done.load(Ordering::Relaxed) >= jobs as u64)
            .await?;
        let secs = started.elapsed().as_secs_f64();
        for w in workers {
            w.await.map_err(|e| e.to_string())??;
        }
        Ok(Rate { jobs, secs })
    }

    /// One job at a time, no concurrency: fenced (claim_next(1) → supervised handler → fenced
    /// commit) against plain (claim → commit). Returns the sorted per-job times of each.
    async fn latency(pg: &Pg, n: usize) -> Result<(Vec<Duration>, Vec<Duration>), String> {
        let q = QueueName::new("latency").map_err(|e| e.to_string())?;
        pg.enqueue(&q, n).await?;
        let store: Arc<dyn FenceStore> = Arc::new(pg.fence.clone());
        let lease = LeaseDuration::from_secs(30).map_err(|e| e.to_string())?;
        let owner = Owner::unique("lat");
        let sup = Supervisor::new(Arc::clone(&store), owner.clone(), SupervisorConfig::new(lease));
        let mut fenced = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            let mut claimed = store.claim_next(&q, &owner, lease, 1).await.map_err(|e| e.to_string())?;
            let job = claimed.pop().ok_or("latency queue ran dry")?;
            let outcome = sup.run(job.lease, job.payload, None, |_ctx: JobContext| async { Ok(b"ok".to_vec()) }).await;
            if !outcome.is_completed() {
                return Err(format!("latency run: {outcome:?}"));
            }
            fenced.push(t.elapsed());
        }
        let pq = format!("plain-latency-{:x}", rand::random::<u32>());
        pg.enqueue_plain(&pq, n).await?;
        let s = pg.fence.schema().as_str();
        let claim = format!(
            "UPDATE {s}.plain t SET state = 'running' FROM (SELECT queue, key FROM {s}.plain \
             WHERE queue = $1 AND state = 'pending' LIMIT 1 FOR UPDATE SKIP LOCKED) p \
             WHERE t.queue = p.queue AND t.key = p.key RETURNING t.key, t.payload"
        );
        let complete = format!("UPDATE {s}.plain SET state = 'done', result = $3 WHERE queue = $1 AND key = $2");
        let mut plain = Vec::with_capacity(n);
        for _ in 0..n {
            let t = Instant::now();
            let (key, _payload): (String, Vec<u8>) = sqlx::query_as(AssertSqlSafe(claim.clone()))
                .bind(pq.clone())
                .fetch_one(pg.fence.pool())
                .await
                .map_err(|e| e.to_string())?;
            sqlx::query(AssertSqlSafe(complete.clone()))
                .bind(pq.clone())
                .bind(key)
                .bind(b"ok".to_vec())
                .execute(pg.fence.pool())
                .await
                .map_err(|e| e.to_string())?;
            plain.push(t.elapsed());
        }
        fenced.sort();
        plain.sort();
        Ok((fenced, plain))
    }

    /// The handler-owned commit against the runtime's grouped commit: the same consumer, the same
    /// jobs and work, `rounds` paired rounds (the order alternating); medians.
    async fn own_commit(o: &Opts, pg: &Pg, counting: &Arc<Counting>) -> Result<(), String> {
        let (mut grouped, mut own, mut own_statements) = (Vec::new(), Vec::new(), String::new());
        for round in 0..o.rounds {
            for handler_owned in if round % 2 == 0 { [false, true] } else { [true, false] } {
                let pool = handler_owned.then_some(&pg.handlers);
                let (rate, _) = fenced_consumer_committing(o, pg, o.jobs, counting, pool).await?;
                if handler_owned {
                    own.push(rate.per_sec());
                    own_statements = counting.describe();
                } else {
                    grouped.push(rate.per_sec());
                }
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(0.0)
        };
        let (g, h) = (median(&mut grouped), median(&mut own));
        line(&format!("commit path, median of {} paired rounds ({} jobs each)", o.rounds, o.jobs), "");
        line("  runtime's grouped commit (the handler returns its result)", format!("{g:.0} jobs/s"));
        line("  handler-owned commit (BEGIN, complete_in, COMMIT; a grouped read)", format!("{h:.0} jobs/s"));
        line("  ratio handler-owned / grouped", format!("{:.2}", h / g.max(f64::MIN_POSITIVE)));
        line("  fence statements of the handler-owned run (besides the handler's 3)", own_statements);
        Ok(())
    }

    pub async fn run(o: &Opts, pg: &Pg) -> Result<(), String> {
        println!("\n[table queue on PostgreSQL]");
        let counting = Counting::new(Arc::new(pg.fence.clone()));
        if o.own_commit_only {
            return own_commit(o, pg, &counting).await;
        }

        // Throughput: the fenced consumer runtime against a plain SKIP LOCKED queue run the same
        // way (same workers, concurrency, claim batch, 1 ms of work; commits grouped the same way).
        // Best of `rounds`, alternating the order, because the machine is shared.
        let best = |a: Option<Rate>, b: Rate| Some(a.filter(|a| a.per_sec() >= b.per_sec()).unwrap_or(b));
        let (mut plain_single, mut plain, mut fenced) = (None, None, None);
        let (mut per_job, mut breakdown, mut described) = (0.0, HashMap::new(), String::new());
        for round in 0..o.rounds {
            if round % 2 == 1 {
                let (f, _) = fenced_consumer(o, pg, o.jobs, &counting).await?;
                fenced = best(fenced, f);
            }
            plain_single = best(plain_single, plain_consumer(o, pg, o.jobs, false).await?);
            plain = best(plain, plain_consumer(o, pg, o.jobs, true).await?);
            if round % 2 == 0 {
                let (f, _) = fenced_consumer(o, pg, o.jobs, &counting).await?;
                fenced = best(fenced, f);
                per_job = counting.total() as f64 / o.jobs as f64;
                breakdown = counting.snapshot();
                described = counting.describe();
            }
        }
        let (Some(plain_single), Some(plain), Some(fenced)) = (plain_single, plain, fenced) else {
            return Err("no rounds".into());
        };
        line(&format!("throughput, best of {} rounds", o.rounds), "");
        line("plain queue, one UPDATE per job (reference)", plain_single);
        line("plain queue, grouped commits (the baseline)", plain);
        line("fenced consumer runtime (Consumer + TableQueue)", fenced);
        line("  ratio fenced / plain baseline", format!("{:.2}", fenced.per_sec() / plain.per_sec()));
        line("  statements per job (fenced)", format!("{per_job:.3}: {described}"));
        let commits =
            breakdown.get("complete_batch").copied().unwrap_or(0) + breakdown.get("complete").copied().unwrap_or(0);
        line("  jobs per commit statement", format!("{:.1}", o.jobs as f64 / commits.max(1) as f64));

        own_commit(o, pg, &counting).await?;

        // Added latency, one job at a time.
        let n = if o.quick { 300 } else { 2000 };
        let (f, p) = latency(pg, n).await?;
        let (f50, f99, p50, p99) =
            (percentile(&f, 0.5), percentile(&f, 0.99), percentile(&p, 0.5), percentile(&p, 0.99));
        line(&format!("latency per job, sequential ({n} jobs): plain p50 / p99"), format!("{} / {}", ms(p50), ms(p99)));
        line("  fenced (claim_next + supervisor + fenced commit) p50 / p99", format!("{} / {}", ms(f50), ms(f99)));
        line(
            "  added by the fence p50 / p99",
            format!("{} / {}", ms(f50.saturating_sub(p50)), ms(f99.saturating_sub(p99))),
        );

        // Cancellation after a lease loss.
        let samples = if o.quick { 5 } else { 12 };
        let q = QueueName::new("cancel").map_err(|e| e.to_string())?;
        pg.enqueue(&q, samples).await?;
        let store: Arc<dyn FenceStore> = Arc::new(pg.fence.clone());
        let lat = consumer_cancellation(TableQueue::new(store, q), &pg.fence, samples).await?;
        print_cancellation(&lat);

        // Heartbeats: one statement per worker per tick, whatever is in flight.
        for (k, ticks, statements, renewals) in heartbeat_cost(&pg.fence, &[1, 10, 100, 1000]).await? {
            line(
                &format!("heartbeat with {k:>4} jobs in flight on one worker"),
                format!(
                    "{statements} statements in {ticks} ticks = {:.2} per tick, {renewals} leases renewed",
                    statements as f64 / ticks.max(1) as f64
                ),
            );
        }

        // Memory over a long run of the fenced consumer runtime.
        let (long, [start, mid, end]) = fenced_consumer(o, pg, o.memory_jobs, &counting).await?;
        line(&format!("{}-job run of the fenced consumer runtime", o.memory_jobs), long);
        line(
            "  RSS start / middle / end (peak)",
            format!("{} / {} / {} MiB ({} MiB)", start.0 / 1024, mid.0 / 1024, end.0 / 1024, end.1 / 1024),
        );
        Ok(())
    }
}

/// Common shape of the plain broker consumers: receive up to the free slots, one task per
/// delivery (the work), acknowledgements batched by 10 or 20 ms.
#[cfg(any(feature = "sqs", feature = "redis"))]
struct PlainLoop {
    concurrency: usize,
    batch: usize,
    work: Duration,
}

/// What a plain consumer needs from its broker.
#[cfg(any(feature = "sqs", feature = "redis"))]
trait PlainBroker: Send + Sync + 'static {
    type Handle: Send + 'static;
    fn receive(&self, max: usize) -> impl std::future::Future<Output = Result<Vec<Self::Handle>, String>> + Send;
    fn ack(&self, handles: Vec<Self::Handle>) -> impl std::future::Future<Output = Result<usize, String>> + Send;
}

/// Latencies of `m` messages handled one at a time by a plain consumer: receive one, acknowledge it.
#[cfg(any(feature = "sqs", feature = "redis"))]
async fn plain_latencies<B: PlainBroker>(broker: &B, m: usize) -> Result<Vec<Duration>, String> {
    let mut p = Vec::with_capacity(m);
    while p.len() < m {
        let t = Instant::now();
        let handles = broker.receive(1).await?;
        if handles.is_empty() {
            continue;
        }
        broker.ack(handles).await?;
        p.push(t.elapsed());
    }
    Ok(p)
}

#[cfg(any(feature = "sqs", feature = "redis"))]
impl PlainLoop {
    async fn run<B: PlainBroker>(&self, broker: Arc<B>, total: usize) -> Result<Rate, String> {
        let done = Arc::new(AtomicU64::new(0));
        let (ack_tx, mut ack_rx) = tokio::sync::mpsc::unbounded_channel::<B::Handle>();
        let acker = {
            let (broker, done) = (Arc::clone(&broker), Arc::clone(&done));
            tokio::spawn(async move {
                while let Some(first) = ack_rx.recv().await {
                    let mut batch = vec![first];
                    let until = tokio::time::Instant::now() + Duration::from_millis(20);
                    while batch.len() < 10 {
                        tokio::select! {
                            item = ack_rx.recv() => match item { Some(h) => batch.push(h), None => break },
                            _ = tokio::time::sleep_until(until) => break,
                        }
                    }
                    if let Ok(n) = broker.ack(batch).await {
                        done.fetch_add(n as u64, Ordering::Relaxed);
                    }
                }
            })
        };
        let started = Instant::now();
        let receiver = {
            let (broker, done, slots) =
                (Arc::clone(&broker), Arc::clone(&done), Arc::new(tokio::sync::Semaphore::new(self.concurrency)));
            let (work, batch) = (self.work, self.batch);
            tokio::spawn(async move {
                while done.load(Ordering::Relaxed) < total as u64 {
                    let free = slots.available_permits().min(batch);
                    if free == 0 {
                        let _ = Arc::clone(&slots).acquire_owned().await.map_err(|e| e.to_string())?;
                        continue;
                    }
                    for handle in broker.receive(free).await? {
                        let permit = Arc::clone(&slots).acquire_owned().await.map_err(|e| e.to_string())?;
                        let ack_tx = ack_tx.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(work).await;
                            let _ = ack_tx.send(handle);
                            drop(permit);
                        });
                    }
                }
                Ok::<(), String>(())
            })
        };
        // The clock stops when the last acknowledgement is in, not when the next long poll ends.
        let finished =
            wait_until("the plain consumer", Duration::from_secs(600), || done.load(Ordering::Relaxed) >= total as u64)
                .await;
        let secs = started.elapsed().as_secs_f64();
        receiver.abort();
        acker.abort();
        finished?;
        Ok(Rate { jobs: total, secs })
    }
}

#[cfg(any(feature = "sqs", feature = "redis"))]
/// The fenced consumer runtime over `source` until `total` completions; statements counted.
async fn fenced_run<S: Source>(
    o: &Opts,
    source: S,
    batch: usize,
    counting: &Arc<Counting>,
    total: usize,
) -> Result<(Rate, f64, String), String> {
    counting.reset();
    let store: Arc<dyn FenceStore> = counting.clone();
    let lease = LeaseDuration::from_secs(30).map_err(|e| e.to_string())?;
    let config = ConsumerConfig::new(SupervisorConfig::new(lease).commit_window(o.commit_window))
        .concurrency(o.broker_concurrency)
        .batch(batch)
        .claim_window(o.claim_window);
    let consumer = Consumer::new(source, store, config);
    let metrics = consumer.metrics();
    let stop = CancellationToken::new();
    let started = Instant::now();
    let work = o.work;
    let run = tokio::spawn({
        let stop = stop.clone();
        async move {
            let handler = move |_ctx: JobContext| async move {
                tokio::time::sleep(work).await;
                Ok::<_, JobError>(b"ok".to_vec())
            };
            consumer.run(handler, stop).await
        }
    });
    // A job counts once its result is committed and its delivery acknowledged.
    wait_until("the fenced consumer", Duration::from_secs(600), || metrics.snapshot().acks >= total as u64).await?;
    let secs = started.elapsed().as_secs_f64();
    stop.cancel();
    run.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    Ok((Rate { jobs: total, secs }, counting.total() as f64 / total as f64, counting.describe()))
}

#[cfg(any(feature = "sqs", feature = "redis"))]
fn print_broker_figures(plain: Rate, fenced: Rate, per_msg: f64, breakdown: &str, lat: (&[Duration], &[Duration])) {
    line("plain consumer (receive, handle, acknowledge)", plain);
    line("fenced consumer runtime", fenced);
    line("  ratio fenced / plain", format!("{:.2}", fenced.per_sec() / plain.per_sec()));
    line("  database statements per message", format!("{per_msg:.3}: {breakdown}"));
    let (f, p) = lat;
    let (f50, f99, p50, p99) = (percentile(f, 0.5), percentile(f, 0.99), percentile(p, 0.5), percentile(p, 0.99));
    line(
        &format!("latency per message, sequential ({}): plain p50 / p99", p.len()),
        format!("{} / {}", ms(p50), ms(p99)),
    );
    line("  fenced p50 / p99", format!("{} / {}", ms(f50), ms(f99)));
    line(
        "  added by the fence p50 / p99",
        format!("{} / {}", ms(f50.saturating_sub(p50)), ms(f99.saturating_sub(p99))),
    );
}

#[cfg(feature = "sqs")]
mod sqs_bench {
    use super::*;
    use brokerfence::adapters::sqs::aws_sdk_sqs::Client;
    use brokerfence::adapters::sqs::aws_sdk_sqs::types::{
        DeleteMessageBatchRequestEntry, SendMessageBatchRequestEntry,
    };
    use brokerfence::adapters::sqs::{KeyStrategy, SqsConfig, SqsRetrofit, SqsSource, aws_config, http_client};
    use futures::StreamExt;

    async fn client() -> Client {
        let var = |n: &str| brokerfence_testkit::services::var(n);
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest()).http_client(http_client());
        if let Some(endpoint) = var("AWS_ENDPOINT_URL_SQS") {
            loader = loader.endpoint_url(endpoint);
        }
        loader = loader.region(aws_config::Region::new(var("AWS_REGION").unwrap_or_else(|| "us-east-1".into())));
        if let (Some(id), Some(secret)) = (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY")) {
            let creds =
                brokerfence::adapters::sqs::aws_sdk_sqs::config::Credentials::new(id, secret, None, None, "bench");
            loader = loader.credentials_provider(creds);
        }
        Client::new(&loader.load().await)
    }

    async fn queue(client: &Client, n: usize) -> Result<String, String> {
        let name = format!("bench-{:08x}", rand::random::<u32>());
        let url = client
            .create_queue()
            .queue_name(&name)
            .send()
            .await
            .map_err(|e| format!("CreateQueue: {e}"))?
            .queue_url()
            .ok_or("no queue url")?
            .to_owned();
        let batches: Vec<Vec<SendMessageBatchRequestEntry>> = (0..n)
            .collect::<Vec<_>>()
            .chunks(10)
            .map(|c| {
                c.iter()
                    .map(|i| {
                        SendMessageBatchRequestEntry::builder()
                            .id(format!("m{i}"))
                            .message_body(format!("job {i}"))
                            .build()
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        let sent: Vec<Result<(), String>> = futures::stream::iter(batches)
            .map(|entries| {
                let (client, url) = (client.clone(), url.clone());
                async move {
                    client
                        .send_message_batch()
                        .queue_url(url)
                        .set_entries(Some(entries))
                        .send()
                        .await
                        .map(drop)
                        .map_err(|e| e.to_string())
                }
            })
            .buffer_unordered(8)
            .collect()
            .await;
        sent.into_iter().collect::<Result<Vec<()>, String>>()?;
        Ok(url)
    }

    struct PlainSqs {
        client: Client,
        url: String,
    }

    impl PlainBroker for PlainSqs {
        type Handle = String;
        async fn receive(&self, max: usize) -> Result<Vec<String>, String> {
            let out = self
                .client
                .receive_message()
                .queue_url(&self.url)
                .max_number_of_messages(i32::try_from(max.min(10)).unwrap_or(10))
                .wait_time_seconds(1)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            Ok(out.messages().iter().filter_map(|m| m.receipt_handle().map(str::to_owned)).collect())
        }
        async fn ack(&self, handles: Vec<String>) -> Result<usize, String> {
            let entries = handles
                .into_iter()
                .enumerate()
                .map(|(i, h)| DeleteMessageBatchRequestEntry::builder().id(format!("d{i}")).receipt_handle(h).build())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| e.to_string())?;
            let out = self
                .client
                .delete_message_batch()
                .queue_url(&self.url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(|e| e.to_string())?;
            Ok(out.successful().len())
        }
    }

    fn source(client: &Client, url: &str) -> Result<SqsSource, String> {
        let config = SqsConfig::new(url.to_owned())
            .map_err(|e| e.to_string())?
            .key(KeyStrategy::MessageId)
            .wait_time(Duration::from_secs(1));
        Ok(SqsSource::new(client.clone(), config))
    }

    pub async fn run(o: &Opts, pg: &table::Pg) -> Result<(), String> {
        println!("\n[sqs on LocalStack] (batches of 10, concurrency {})", o.broker_concurrency);
        let client = client().await;
        if let Err(e) = tokio::time::timeout(Duration::from_secs(5), client.list_queues().send())
            .await
            .map_err(|_| "timeout".to_owned())
            .and_then(|r| r.map_err(|e| e.to_string()))
        {
            println!("  skipped: SQS does not answer ({e}); run `bash localstack/up`");
            return Ok(());
        }
        let n = if o.quick { 300 } else { 2000 };
        let counting = Counting::new(Arc::new(pg.fence.clone()));
        let mut queues = Vec::new();
        let (mut plain, mut fenced, mut per_msg, mut breakdown) = (None::<Rate>, None::<Rate>, 0.0, String::new());
        for _ in 0..o.rounds {
            let url = queue(&client, n).await?;
            queues.push(url.clone());
            let p = PlainLoop { concurrency: o.broker_concurrency, batch: 10, work: o.work }
                .run(Arc::new(PlainSqs { client: client.clone(), url }), n)
                .await?;
            plain = Some(plain.filter(|b| b.per_sec() >= p.per_sec()).unwrap_or(p));
            let url = queue(&client, n).await?;
            queues.push(url.clone());
            let (f, per, br) = fenced_run(o, source(&client, &url)?, 10, &counting, n).await?;
            if fenced.is_none_or(|b| f.per_sec() > b.per_sec()) {
                (fenced, per_msg, breakdown) = (Some(f), per, br);
            }
        }
        let (Some(plain), Some(fenced)) = (plain, fenced) else { return Err("no rounds".into()) };

        // Sequential latency: receive one, handle, delete; fenced through the retrofit path.
        let m = if o.quick { 50 } else { 200 };
        let url = queue(&client, 2 * m).await?;
        queues.push(url.clone());
        let plain_broker = PlainSqs { client: client.clone(), url: url.clone() };
        let mut p = plain_latencies(&plain_broker, m).await?;
        let store: Arc<dyn FenceStore> = Arc::new(pg.fence.clone());
        let lease = LeaseDuration::from_secs(30).map_err(|e| e.to_string())?;
        let retrofit = SqsRetrofit::new(store, source(&client, &url)?, SupervisorConfig::new(lease));
        let mut f = Vec::new();
        while f.len() < m {
            let t = Instant::now();
            let out = client
                .receive_message()
                .queue_url(&url)
                .max_number_of_messages(1)
                .wait_time_seconds(1)
                .send()
                .await
                .map_err(|e| e.to_string())?;
            let Some(msg) = out.messages().first() else { continue };
            let done = retrofit.process(msg, |_ctx: JobContext| async { Ok(b"ok".to_vec()) }).await;
            if !done.is_completed() {
                return Err(format!("retrofit: {done:?}"));
            }
            f.push(t.elapsed());
        }
        p.sort();
        f.sort();
        print_broker_figures(plain, fenced, per_msg, &breakdown, (&f, &p));

        let samples = if o.quick { 5 } else { 12 };
        let url = queue(&client, samples).await?;
        queues.push(url.clone());
        print_cancellation(&consumer_cancellation(source(&client, &url)?, &pg.fence, samples).await?);
        for u in queues {
            let _ = client.delete_queue().queue_url(u).send().await;
        }
        Ok(())
    }
}

#[cfg(feature = "redis")]
mod redis_bench {
    use super::*;
    use brokerfence::adapters::Retrofit;
    use brokerfence::adapters::redis::client as redis;
    use brokerfence::adapters::redis::{RedisConnections, StreamSource};
    use redis::aio::MultiplexedConnection;
    use redis::streams::StreamReadReply;

    struct PlainStream {
        read: tokio::sync::Mutex<MultiplexedConnection>,
        write: MultiplexedConnection,
        stream: String,
    }

    impl PlainBroker for PlainStream {
        type Handle = String;
        async fn receive(&self, max: usize) -> Result<Vec<String>, String> {
            let mut conn = self.read.lock().await;
            let reply: Option<StreamReadReply> = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg("plain")
                .arg("c1")
                .arg("COUNT")
                .arg(max)
                .arg("BLOCK")
                .arg(100)
                .arg("STREAMS")
                .arg(&self.stream)
                .arg(">")
                .query_async(&mut *conn)
                .await
                .map_err(|e| e.to_string())?;
            Ok(reply
                .map(|r| r.keys.into_iter().flat_map(|k| k.ids.into_iter().map(|i| i.id)).collect())
                .unwrap_or_default())
        }
        async fn ack(&self, ids: Vec<String>) -> Result<usize, String> {
            let mut conn = self.write.clone();
            let n: usize = redis::cmd("XACK")
                .arg(&self.stream)
                .arg("plain")
                .arg(&ids)
                .query_async(&mut conn)
                .await
                .map_err(|e| e.to_string())?;
            Ok(n)
        }
    }

    async fn stream(conn: &mut MultiplexedConnection, n: usize) -> Result<String, String> {
        let stream = format!("bench-{:08x}", rand::random::<u32>());
        for start in (0..n).step_by(1000) {
            let mut pipe = redis::pipe();
            for i in start..(start + 1000).min(n) {
                pipe.cmd("XADD").arg(&stream).arg("*").arg("body").arg(format!("job {i}")).ignore();
            }
            pipe.query_async::<()>(conn).await.map_err(|e| e.to_string())?;
        }
        Ok(stream)
    }

    pub async fn run(o: &Opts, pg: &table::Pg) -> Result<(), String> {
        println!("\n[redis streams] (reads of up to {0}, concurrency {0})", o.broker_concurrency);
        let Some(url) = brokerfence_testkit::services::var("REDIS_URL") else {
            println!("  skipped: REDIS_URL is not set; run `bash localstack/up`");
            return Ok(());
        };
        let client = redis::Client::open(url.as_str()).map_err(|e| e.to_string())?;
        let mut conn =
            match tokio::time::timeout(Duration::from_secs(5), client.get_multiplexed_async_connection()).await {
                Ok(Ok(c)) => c,
                _ => {
                    println!(
                        "  skipped: Redis does not answer at {}; run `bash localstack/up`",
                        url.split('@').next_back().unwrap_or("")
                    );
                    return Ok(());
                }
            };
        let n = if o.quick { 3000 } else { 20_000 };
        let counting = Counting::new(Arc::new(pg.fence.clone()));
        let mut streams = Vec::new();

        // Streams read any number at once: both sides take up to the concurrency per read.
        let batch = o.broker_concurrency;
        let conns = RedisConnections::connect(&url).await.map_err(|e| e.to_string())?;
        let (mut plain, mut fenced, mut per_msg, mut breakdown) = (None::<Rate>, None::<Rate>, 0.0, String::new());
        for _ in 0..o.rounds {
            let s = stream(&mut conn, n).await?;
            streams.push(s.clone());
            let _: () = redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(&s)
                .arg("plain")
                .arg("0")
                .query_async(&mut conn)
                .await
                .map_err(|e| e.to_string())?;
            let plain_broker = Arc::new(PlainStream {
                read: tokio::sync::Mutex::new(
                    client.get_multiplexed_async_connection().await.map_err(|e| e.to_string())?,
                ),
                write: conn.clone(),
                stream: s,
            });
            let p = PlainLoop { concurrency: o.broker_concurrency, batch, work: o.work }.run(plain_broker, n).await?;
            plain = Some(plain.filter(|b| b.per_sec() >= p.per_sec()).unwrap_or(p));
            let s = stream(&mut conn, n).await?;
            streams.push(s.clone());
            let source =
                StreamSource::new(conns.clone(), QueueName::new(s.clone()).map_err(|e| e.to_string())?, s, "bench")
                    .map_err(|e| e.to_string())?
                    .block(Duration::from_millis(100));
            let (f, per, br) = fenced_run(o, source, batch, &counting, n).await?;
            if fenced.is_none_or(|b| f.per_sec() > b.per_sec()) {
                (fenced, per_msg, breakdown) = (Some(f), per, br);
            }
        }
        let (Some(plain), Some(fenced)) = (plain, fenced) else { return Err("no rounds".into()) };

        // Sequential latency: XREADGROUP one, handle, XACK; fenced adds claim + supervised run + commit.
        let m = if o.quick { 100 } else { 1000 };
        let s = stream(&mut conn, 2 * m).await?;
        streams.push(s.clone());
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&s)
            .arg("plain")
            .arg("0")
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        let seq = PlainStream {
            read: tokio::sync::Mutex::new(client.get_multiplexed_async_connection().await.map_err(|e| e.to_string())?),
            write: conn.clone(),
            stream: s.clone(),
        };
        let mut p = plain_latencies(&seq, m).await?;
        let store: Arc<dyn FenceStore> = Arc::new(pg.fence.clone());
        let lease = LeaseDuration::from_secs(30).map_err(|e| e.to_string())?;
        let fence =
            Retrofit::new(store, QueueName::new(s.clone()).map_err(|e| e.to_string())?, SupervisorConfig::new(lease));
        let mut f = Vec::new();
        while f.len() < m {
            let t = Instant::now();
            let ids = seq.receive(1).await?;
            let Some(id) = ids.first() else { continue };
            let key = JobKey::new(id.clone()).map_err(|e| e.to_string())?;
            let done = fence.process(&key, Vec::new(), |_ctx: JobContext| async { Ok(b"ok".to_vec()) }).await;
            if !done.should_ack() {
                return Err(format!("retrofit: {done:?}"));
            }
            seq.ack(ids).await?;
            f.push(t.elapsed());
        }
        p.sort();
        f.sort();
        print_broker_figures(plain, fenced, per_msg, &breakdown, (&f, &p));

        let samples = if o.quick { 5 } else { 12 };
        let s = stream(&mut conn, samples).await?;
        streams.push(s.clone());
        let source = StreamSource::new(conns, QueueName::new(s.clone()).map_err(|e| e.to_string())?, s, "cancel")
            .map_err(|e| e.to_string())?
            .block(Duration::from_millis(100));
        print_cancellation(&consumer_cancellation(source, &pg.fence, samples).await?);
        for s in streams {
            let dead = brokerfence::adapters::redis::sibling_key(&s, ":dead");
            let _: Result<(), _> = redis::cmd("DEL").arg(&s).arg(&dead).query_async(&mut conn).await;
        }
        Ok(())
    }
}
