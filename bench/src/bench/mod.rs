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
//! cargo run --release -p brokerfence-bench --bin bench                      # table queue on PostgreSQL
//! cargo run --release -p brokerfence-bench --features sqs,redis --bin bench  # + SQS (LocalStack) and Redis streams
//! cargo run --release -p brokerfence-bench --bin bench -- --quick            # smaller runs, for a smoke test
//! ```
//!
//! Options: `--sources table,sqs,redis`, `--jobs N` (throughput runs), `--memory-jobs N` (the
//! long run, default 100000), `--work-ms W` (work per job, default 1), `--workers N`,
//! `--concurrency C` (per worker), `--batch B`, `--claim-window-ms MS`, `--commit-window-ms MS`
//! (default 5 each), `--rounds N`, `--quick`, `--own-commit-only` (only the comparison of a
//! handler-owned commit, `JobContext::complete_in` in the handler's transaction, with the
//! runtime's grouped commit: the median of `--rounds` paired rounds), `--defaults [--levels
//! 16,64,128]` (only the table queue at its defaults against a plain SKIP LOCKED loop, with
//! PostgreSQL CPU and WAL bytes per job: see `bench/defaults.rs`; the plain loop pipelines, see
//! `bench/pipelined.rs`), `--processes P [--levels 128]` (the same comparison with each level's
//! concurrency split across P worker processes, 1 × L against P × L/P: see
//! `bench/processes.rs`), `--latency [--rates 10,100,1000] [--latency-secs 5]` (pickup latency of
//! jobs arriving one at a time at each rate, on PostgreSQL direct, PostgreSQL with
//! `?pooler=transaction` and SQLite: see `bench/latency.rs`). `--processes` runs this program
//! again as its workers, with the hidden flags `--worker fenced|plain --worker-schema S
//! --worker-queue Q` (and `--concurrency`, `--work-ms`, `--database-url`).
//! PostgreSQL from `DATABASE_URL`, Redis from `REDIS_URL`, SQS from the AWS environment (all fall
//! back to `localstack/.env`). A benchmark, not a test: it prints figures and asserts nothing.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use brokerfence::TableQueue;
use brokerfence::{Consumer, ConsumerConfig, Source};
use brokerfence::{
    FenceStore, JobContext, JobError, JobKey, LeaseDuration, Owner, PgFence, QueueName, SchemaName, Supervisor,
    SupervisorConfig,
};
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

mod defaults;
mod latency;
mod measure;
mod pipelined;
#[cfg(any(feature = "sqs", feature = "redis"))]
mod plain;
mod processes;
#[cfg(feature = "redis")]
mod redis_bench;
#[cfg(feature = "sqs")]
mod sqs_bench;
mod table;

use crate::args::{self, Common, HELP_TEMPLATE, Load, Redis as RedisArgs, Rounds, at_least_one};
use crate::counters::*;
use measure::*;
#[cfg(any(feature = "sqs", feature = "redis"))]
use plain::*;

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
    #[cfg_attr(not(any(feature = "sqs", feature = "redis")), allow(dead_code))]
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
    /// `--prefetch` for the fenced consumer of --defaults (`None`: the source's default).
    defaults_prefetch: Option<usize>,
    /// `--processes`: the --defaults comparison with each level split across this many
    /// worker processes.
    processes: Option<usize>,
    /// `--latency`: pickup latency at these rates (jobs per second), for this many seconds each.
    latency: Option<(Vec<f64>, f64)>,
    /// `--worker`: this process is a worker of `--processes`.
    worker: Option<processes::Worker>,
    /// `--database-url` or the environment's (an error to report when there is neither).
    database_url: Result<String, String>,
    /// `--redis-url` or the environment's, if any.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    redis_url: Option<String>,
}

/// Benchmark (by hand): throughput and overhead of the fence on the table queue (PostgreSQL),
/// and with features sqs/redis against plain SQS and Redis consumers. Exit codes: 0 done,
/// 1 failed, 2 bad command line.
#[derive(clap::Parser)]
#[command(name = "bench", help_template = HELP_TEMPLATE)]
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
    /// Worker processes' worth of consumers
    #[arg(long, value_name = "N", default_value = "4", value_parser = at_least_one)]
    workers: usize,
    /// Concurrency of the SQS and Redis consumers (fenced and plain)
    #[arg(long, value_name = "C", default_value = "32", value_parser = at_least_one)]
    broker_concurrency: usize,
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    load: Load,
    #[command(flatten)]
    rounds: Rounds,
    #[command(flatten)]
    redis: RedisArgs,
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
    /// With --defaults: set the fenced consumer's prefetch (0: none, as before issue #18's
    /// claims ahead) [default: the table queue's own]
    #[arg(long, value_name = "N")]
    prefetch: Option<usize>,
    /// Only the --defaults comparison with each level of --levels split across P worker
    /// processes (1 × L against P × L/P, fenced and plain); jobs default to 20000, rounds to 3
    #[arg(long, value_name = "P", value_parser = at_least_one)]
    processes: Option<usize>,
    /// Only the pickup latency of the table queue (jobs arriving one at a time at each of
    /// --rates) on PostgreSQL, PostgreSQL with ?pooler=transaction, and SQLite; rounds default to 3
    #[arg(long)]
    latency: bool,
    /// Arrival rates for --latency, jobs per second, comma separated
    #[arg(long, value_name = "LIST", default_value = "10,100,1000", value_delimiter = ',')]
    rates: Vec<f64>,
    /// Seconds of arrivals per rate and round for --latency
    #[arg(long, value_name = "S", default_value = "5")]
    latency_secs: f64,
    /// A worker process of --processes: fenced or plain (internal)
    #[arg(long, value_name = "MODE", hide = true)]
    worker: Option<String>,
    /// The worker's schema (internal)
    #[arg(long, value_name = "S", hide = true, default_value = "")]
    worker_schema: String,
    /// The worker's queue (internal)
    #[arg(long, value_name = "Q", hide = true, default_value = "")]
    worker_queue: String,
}

fn parse_opts() -> Result<Opts, clap::Error> {
    // The shared flags' defaults here; --rounds depends on --quick and --defaults (below).
    let c: Cli = args::parse(&[("concurrency", "64"), ("batch", "64"), ("work_ms", "1")])?;
    Ok(Opts {
        sources: c.sources.split(',').map(str::to_owned).collect(),
        jobs: c.jobs.unwrap_or(if c.quick {
            3_000
        } else if c.defaults || c.processes.is_some() {
            20_000
        } else {
            30_000
        }),
        memory_jobs: c.memory_jobs.unwrap_or(if c.quick { 10_000 } else { 100_000 }),
        work: c.load.work(1),
        workers: c.workers,
        concurrency: c.common.concurrency.unwrap_or(64),
        batch: c.load.batch.unwrap_or(64),
        broker_concurrency: c.broker_concurrency,
        rounds: c.rounds.rounds.unwrap_or(if c.quick {
            1
        } else if c.defaults || c.processes.is_some() || c.latency {
            3
        } else {
            2
        }),
        claim_window: c.rounds.claim_window(),
        commit_window: c.rounds.commit_window(),
        database_url: c.common.database_url(),
        redis_url: c.redis.redis_url_if_any(),
        quick: c.quick,
        own_commit_only: c.own_commit_only,
        worker: c.worker.map(|mode| processes::Worker {
            mode,
            schema: c.worker_schema,
            queue: c.worker_queue,
            concurrency: c.common.concurrency.unwrap_or(64),
            work: c.load.work(1),
        }),
        processes: c.processes,
        latency: c.latency.then_some((c.rates, c.latency_secs)),
        defaults: (c.defaults || c.processes.is_some()).then_some(c.levels),
        defaults_prefetch: c.prefetch,
    })
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
    if let Some(w) = &opts.worker {
        let result = opts.database_url.clone().map(|url| rt.block_on(processes::worker(&url, w)));
        if let Err(e) = result.and_then(|r| r) {
            eprintln!("bench worker: {e}");
            std::process::exit(1);
        }
        return;
    }
    if let Err(e) = rt.block_on(bench(opts)) {
        eprintln!("bench: {e}");
        std::process::exit(1);
    }
}

async fn bench(o: Opts) -> Result<(), String> {
    let url = o.database_url.clone()?;
    if o.defaults.is_some() || o.latency.is_some() {
        println!("brokerfence bench — {}; load average at start {}", machine(), loadavg());
        if cfg!(debug_assertions) {
            println!("  [DEBUG BUILD: use --release for figures]");
        }
        let result = match (&o.latency, &o.defaults, o.processes) {
            (Some((rates, secs)), _, _) => latency::run(&o, &url, rates, *secs).await,
            (None, Some(levels), Some(p)) => processes::run(&o, &url, levels, p).await,
            (None, Some(levels), None) => defaults::run(&o, &url, levels).await,
            (None, None, _) => Ok(()),
        };
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
