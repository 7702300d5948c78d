//! `bench_failover`: the fence's figures on production PostgreSQL topologies (issue #29). Not a
//! test: it measures and prints, on real servers it starts itself (`brokerfence_testkit::
//! pg_topology`: a private primary with a streaming standby, a TCP relay as the VIP, PgBouncer).
//!
//! 1. **Failover**: three table-queue consumers (this process, two handlers each, 200 ms of work
//!    per job) drain a queue through one address; replication is cut, the primary works alone
//!    for `--alone-ms`, dies, the standby is promoted and the address re-pointed. Per round: the
//!    time from `pg_ctl promote` to the first commit on the promoted server (database clock, the
//!    same host), and the jobs whose handler ran under more than one epoch (work done twice).
//!    Variants: an asynchronous standby reached through a VIP, through a multi-host URL and
//!    through PgBouncer (transaction mode) in front of the VIP; a synchronous standby through
//!    the VIP. Medians of `--rounds` rounds.
//! 2. **Throughput through PgBouncer**: the shared PostgreSQL (`DATABASE_URL`), a table queue of
//!    `--jobs` jobs of `--work-ms` each drained by two consumers of `--concurrency` handlers,
//!    straight to PostgreSQL and through a PgBouncer in transaction mode in front of it, in
//!    turn (A/B/A/B); the median of the rounds' ratios.
//!
//! ```text
//! cargo run --release -p brokerfence-bench --bin bench_failover -- --rounds 5
//! ```

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use brokerfence::TableQueue;
use brokerfence::epoch::timeline_of;
use brokerfence::{Consumer, ConsumerConfig};
use brokerfence::{
    FenceStore, JobContext, JobKey, LeaseDuration, Owner, PgFence, QueueName, SchemaName, SupervisorConfig,
};
use brokerfence_testkit::pg_topology::{PgBouncer, PgPair, Relay, Replication};
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

use crate::args::{Common, HELP_TEMPLATE, Load, Rounds};
use crate::counters::{loadavg, machine, median};

/// The fence's figures on a primary with a standby that fails over, and through PgBouncer.
#[derive(clap::Parser)]
#[command(name = "bench_failover", help_template = HELP_TEMPLATE)]
struct Cli {
    /// Milliseconds the primary works alone between the cut of replication and its death
    #[arg(long = "alone-ms", value_name = "MS", default_value = "2000")]
    alone_ms: u64,
    /// Only the failover figures
    #[arg(long)]
    failover_only: bool,
    /// Only the throughput through PgBouncer
    #[arg(long)]
    throughput_only: bool,
    /// Jobs per throughput round
    #[arg(long, value_name = "N", default_value = "10000")]
    jobs: usize,
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    load: Load,
    #[command(flatten)]
    rounds: Rounds,
}

/// Entry point of `bench_failover`.
pub fn main() {
    let cli: Cli = match crate::args::parse(&[("rounds", "5"), ("concurrency", "32"), ("work_ms", "1")]) {
        Ok(c) => c,
        Err(e) => std::process::exit(crate::args::report(&e)),
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("bench_failover: tokio runtime: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = rt.block_on(run(cli)) {
        eprintln!("bench_failover: {e}");
        std::process::exit(1);
    }
}

async fn run(cli: Cli) -> Result<(), String> {
    let rounds = cli.rounds.rounds.unwrap_or(5);
    println!("bench_failover on {}; load average at start {}", machine(), loadavg());
    if !cli.throughput_only {
        println!(
            "\nFailover: 3 consumers x 2 handlers, 200 ms per job; replication cut, primary alone {} ms, killed, standby promoted, address re-pointed; {rounds} rounds",
            cli.alone_ms
        );
        println!("  {:<42} | {:<34} | jobs re-run per failover, median", "topology", "promotion -> 1st commit, median");
        for variant in [Variant::Vip, Variant::MultiHost, Variant::PgBouncer, Variant::SyncVip] {
            let mut first = Vec::new();
            let mut reruns = Vec::new();
            for _ in 0..rounds {
                let r = failover_round(variant, Duration::from_millis(cli.alone_ms)).await?;
                first.push(r.first_commit.as_secs_f64() * 1000.0);
                reruns.push(r.reruns as f64);
            }
            let first_ms: Vec<i64> = first.iter().map(|v| v.round() as i64).collect();
            let reruns_n: Vec<i64> = reruns.iter().map(|v| *v as i64).collect();
            println!(
                "  {:<42} | {:>6.0} ms {:<24} | {:>4.0} {:?}",
                variant.name(),
                median(first),
                format!("{first_ms:?}"),
                median(reruns),
                reruns_n
            );
        }
    }
    if !cli.failover_only {
        let url = cli.common.database_url()?;
        let concurrency = cli.common.concurrency.unwrap_or(32);
        let work = cli.load.work(1);
        println!(
            "\nThroughput, table queue, {} jobs of {} ms, 2 consumers x {concurrency}, never analyzed: straight vs through PgBouncer (transaction mode), in turn",
            cli.jobs,
            work.as_millis()
        );
        let (bouncer, bounced_url) = bouncer_in_front_of(&url).await?;
        let mut ratios = Vec::new();
        for round in 1..=rounds {
            let direct = drain(&url, cli.jobs, concurrency, work).await?;
            let pooled = drain(&bounced_url, cli.jobs, concurrency, work).await?;
            let ratio = pooled / direct;
            ratios.push(ratio);
            println!(
                "  round {round}: straight {direct:>8.0} jobs/s, through PgBouncer {pooled:>8.0} jobs/s, ratio {ratio:.2}"
            );
        }
        println!(
            "  median ratio (through PgBouncer / straight): {:.2}; load average at end {}",
            median(ratios),
            loadavg()
        );
        drop(bouncer);
    }
    Ok(())
}

/// How the consumers reach the primary in a failover round.
#[derive(Debug, Clone, Copy)]
enum Variant {
    Vip,
    MultiHost,
    PgBouncer,
    SyncVip,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Vip => "asynchronous standby, one address (VIP)",
            Variant::MultiHost => "asynchronous standby, multi-host URL",
            Variant::PgBouncer => "asynchronous standby, PgBouncer -> VIP",
            Variant::SyncVip => "synchronous standby, one address (VIP)",
        }
    }
}

struct RoundFigures {
    first_commit: Duration,
    reruns: usize,
}

fn wall_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// One failover round of `variant`.
async fn failover_round(variant: Variant, alone: Duration) -> Result<RoundFigures, String> {
    let replication = if matches!(variant, Variant::SyncVip) { Replication::Sync } else { Replication::Async };
    let pair = PgPair::start(replication).await;
    let vip = Relay::start(pair.primary.addr()).await;
    let bouncer = match variant {
        Variant::PgBouncer => {
            Some(PgBouncer::start(vip.addr(), "transaction", "extra_float_digits", &["postgres"]).await)
        }
        _ => None,
    };
    let url = match (variant, &bouncer) {
        (_, Some(b)) => b.url("postgres", "postgres"),
        (Variant::MultiHost, _) => {
            format!("postgres://postgres@{},{}/postgres", pair.primary.addr(), pair.standby.addr())
        }
        _ => format!("postgres://postgres@{}/postgres", vip.addr()),
    };
    let schema = SchemaName::new(format!("failover_{:08x}", rand::random::<u32>())).map_err(|e| e.to_string())?;
    let queue = QueueName::new("failover").map_err(|e| e.to_string())?;
    let direct = format!("postgres://postgres@{}/postgres", pair.primary.addr());
    let admin = PgFence::connect(&direct).await.map_err(|e| e.to_string())?.schema(schema.clone());
    admin.migrate().await.map_err(|e| e.to_string())?;
    let jobs: Vec<(JobKey, Vec<u8>)> = (0..400)
        .map(|i| JobKey::new(format!("job-{i:04}")).map(|k| (k, b"work".to_vec())))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    admin.enqueue_many(&queue, &jobs).await.map_err(|e| e.to_string())?;
    pair.wait_caught_up().await;

    // Which epochs each job's handler ran under.
    let ran: Arc<Mutex<HashMap<String, BTreeSet<i64>>>> = Arc::default();
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    for i in 1..=3 {
        let store: Arc<dyn FenceStore> =
            Arc::new(PgFence::connect(&url).await.map_err(|e| format!("connect {url}: {e}"))?.schema(schema.clone()));
        let lease = LeaseDuration::from_secs(10).map_err(|e| e.to_string())?;
        let config = ConsumerConfig::new(SupervisorConfig::new(lease)).concurrency(2).grace(Duration::from_millis(500));
        let owner = Owner::new(format!("w-{i}")).map_err(|e| e.to_string())?;
        let consumer = Consumer::with_owner(TableQueue::new(Arc::clone(&store), queue.clone()), store, owner, config);
        let (ran, token) = (Arc::clone(&ran), stop.clone());
        tasks.push(tokio::spawn(async move {
            let handler = move |ctx: JobContext| {
                let ran = Arc::clone(&ran);
                async move {
                    if let Ok(mut ran) = ran.lock() {
                        ran.entry(ctx.key().as_str().to_owned()).or_default().insert(ctx.epoch());
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Ok::<_, brokerfence::JobError>(())
                }
            };
            let _ = consumer.run(handler, token).await;
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    pair.link.partition();
    tokio::time::sleep(alone).await;
    pair.primary.kill().await;
    let promoted_at = wall_ms();
    pair.standby.promote().await;
    vip.point_to(pair.standby.addr());
    vip.drop_connections();

    let promoted = PgFence::connect(&format!("postgres://postgres@{}/postgres", pair.standby.addr()))
        .await
        .map_err(|e| e.to_string())?
        .schema(schema.clone());
    let s = schema.as_str();
    let first_commit = format!(
        "SELECT floor(extract(epoch from min(updated_at)) * 1000)::bigint FROM {s}.jobs \
         WHERE state = 'completed' AND updated_at >= 'epoch'::timestamptz + $1::bigint * interval '1 millisecond'"
    );
    let open = format!("SELECT count(*) FROM {s}.jobs WHERE state <> 'completed'");
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut first = None;
    loop {
        if first.is_none() {
            let at: Option<i64> = sqlx::query_scalar(AssertSqlSafe(first_commit.clone()))
                .bind(promoted_at)
                .fetch_one(promoted.pool())
                .await
                .map_err(|e| e.to_string())?;
            first = at.map(|at| Duration::from_millis((at - promoted_at).max(0) as u64));
        }
        let left: i64 = sqlx::query_scalar(AssertSqlSafe(open.clone()))
            .fetch_one(promoted.pool())
            .await
            .map_err(|e| e.to_string())?;
        if left == 0 && first.is_some() {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("{}: {left} jobs not completed 120 s after the promotion", variant.name()));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.cancel();
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(20), t).await;
    }
    let reruns = ran.lock().map(|r| r.values().filter(|e| e.len() > 1).count()).unwrap_or(0);
    let timelines: BTreeSet<u32> =
        ran.lock().map(|r| r.values().flatten().map(|e| timeline_of(*e)).collect()).unwrap_or_default();
    if timelines.len() > 2 {
        return Err(format!("epochs of more than two timelines: {timelines:?}"));
    }
    Ok(RoundFigures { first_commit: first.unwrap_or_default(), reruns })
}

/// A PgBouncer (transaction mode) in front of the server of `url`, and the URL through it.
async fn bouncer_in_front_of(url: &str) -> Result<(PgBouncer, String), String> {
    let options: sqlx::postgres::PgConnectOptions = url.parse().map_err(|e: sqlx::Error| e.to_string())?;
    let upstream = format!("{}:{}", options.get_host(), options.get_port())
        .parse()
        .map_err(|e| format!("{}: {e}", options.get_host()))?;
    let user = options.get_username().to_owned();
    let db = options.get_database().unwrap_or("postgres").to_owned();
    let bouncer = PgBouncer::start(upstream, "transaction", "extra_float_digits", &[&user]).await;
    let url = bouncer.url(&user, &db);
    Ok((bouncer, url))
}

/// Drains `jobs` jobs of `work` with two consumers of `concurrency` handlers at `url`: jobs/s.
async fn drain(url: &str, jobs: usize, concurrency: usize, work: Duration) -> Result<f64, String> {
    let schema = SchemaName::new(format!("bouncer_{:08x}", rand::random::<u32>())).map_err(|e| e.to_string())?;
    let queue = QueueName::new("drain").map_err(|e| e.to_string())?;
    let admin = PgFence::connect(url).await.map_err(|e| e.to_string())?.schema(schema.clone());
    admin.migrate().await.map_err(|e| e.to_string())?;
    for start in (0..jobs).step_by(5000) {
        let batch: Vec<(JobKey, Vec<u8>)> = (start..(start + 5000).min(jobs))
            .map(|i| JobKey::new(format!("job-{i:07}")).map(|k| (k, b"{}".to_vec())))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        admin.enqueue_many(&queue, &batch).await.map_err(|e| e.to_string())?;
    }
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stop = CancellationToken::new();
    let mut consumers = Vec::new();
    for i in 0..2 {
        let store: Arc<dyn FenceStore> =
            Arc::new(PgFence::connect(url).await.map_err(|e| e.to_string())?.schema(schema.clone()));
        let lease = LeaseDuration::from_secs(30).map_err(|e| e.to_string())?;
        let config = ConsumerConfig::new(SupervisorConfig::new(lease)).concurrency(concurrency);
        let owner = Owner::new(format!("drain-{i}")).map_err(|e| e.to_string())?;
        consumers.push(Consumer::with_owner(TableQueue::new(Arc::clone(&store), queue.clone()), store, owner, config));
    }
    let started = Instant::now();
    let mut tasks = Vec::new();
    for consumer in consumers {
        let (done, token) = (Arc::clone(&done), stop.clone());
        tasks.push(tokio::spawn(async move {
            let handler = move |_ctx: JobContext| {
                let done = Arc::clone(&done);
                async move {
                    tokio::time::sleep(work).await;
                    done.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    Ok::<_, brokerfence::JobError>(())
                }
            };
            let _ = consumer.run(handler, token).await;
        }));
    }
    let s = schema.as_str();
    let open = format!("SELECT count(*) FROM {s}.jobs WHERE state <> 'completed'");
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let left: i64 = sqlx::query_scalar(AssertSqlSafe(open.clone()))
            .persistent(false)
            .fetch_one(&mut *admin.begin().await.map_err(|e| e.to_string())?)
            .await
            .map_err(|e| e.to_string())?;
        if left == 0 {
            break;
        }
        if Instant::now() > deadline {
            return Err(format!("{left} jobs left after 600 s"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let secs = started.elapsed().as_secs_f64();
    stop.cancel();
    for t in tasks {
        let _ = tokio::time::timeout(Duration::from_secs(20), t).await;
    }
    let mut tx = admin.begin().await.map_err(|e| e.to_string())?;
    sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {s} CASCADE")))
        .persistent(false)
        .execute(&mut *tx)
        .await
        .map_err(|e| e.to_string())?;
    tx.commit().await.map_err(|e| e.to_string())?;
    Ok(jobs as f64 / secs)
}
