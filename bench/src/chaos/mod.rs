//! The chaos run: N worker OS processes drain M jobs while the runner injects faults. An
//! independent HTTP receiver in the runner records every call the workers make; at the end the
//! runner checks:
//!
//! | figure | must be |
//! |---|---|
//! | jobs lost (not finished, or committed without their receiver effect) | 0 |
//! | results committed twice (an audit trigger records every commit) | 0 |
//! | receiver accepts of an epoch lower than one it already accepted | 0 |
//! | healthy cancellations: attempts whose lease was lost while the database was reachable for their worker and the worker was running (see [`faults`] for the exact rule) | 0 |
//! | lost attempts the workers reported vs. their `lease_losses` counters | equal |
//! | zombie commits rejected (`Fenced`) | ≥ 1 when `sigstop` is injected (the pauses really happened) |
//! | jobs completed or dead-lettered | all of them |
//!
//! The faults (`--faults`, comma-separated; default `classic` = the first four):
//!
//! | fault | what the runner does |
//! |---|---|
//! | `sigstop` | SIGSTOP a worker for lease + 1.2–2.5 s, then SIGCONT (it comes back a zombie) |
//! | `pg-terminate` | `pg_terminate_backend` on the connections of one worker or of all |
//! | `sigkill` | SIGKILL a worker and start it again |
//! | `redis-restart` | kill and restart the run's private redis-server (Redis only) |
//! | `broker-stall` | a TCP proxy between the workers and the broker (LocalStack, or the private redis-server) holds every byte, both directions, for `--stall-ms` (default lease + 2 s); not applicable to the table queue, which has no broker (the report says so) |
//! | `pg-lock` | a runner transaction holds `FOR UPDATE` locks on the rows one worker is running, for `--stall-ms` |
//! | `pg-pause` | the idle PostgreSQL backends of one worker (by `application_name`) are SIGSTOPped for `--stall-ms` |
//!
//! `pg-stall` names both PostgreSQL stalls, `all` every fault. The broker and PostgreSQL
//! servers themselves are never paused or restarted (LocalStack, PostgreSQL and the Redis on 6379
//! are shared); the Redis restart uses a private redis-server.
//!
//! ```text
//! cargo test --workspace --all-features --no-run   # builds target/debug/examples/chaos
//! target/debug/examples/chaos --source table --workers 8 --jobs 5000
//! target/debug/examples/chaos --source sqs --workers 4 --jobs 600 --faults all --slow-every 5
//! target/debug/examples/chaos --source redis --workers 4 --jobs 1000 --faults all --slow-every 5
//! ```
//!
//! Options: `--source table|sqs|redis`, `--workers N`, `--jobs M`, `--concurrency C` (per worker),
//! `--batch B`, `--work-ms W` (blocking work per job: a zombie paused inside it reaches its commit
//! after it resumes), `--lease-secs L` (≥ 3), `--fault-every-ms F`, `--deadline-secs D`,
//! `--poison-every P` (every P-th job is undecodable and must be dead-lettered; 0 = none),
//! `--flaky-every K` (every K-th job fails its first attempt), `--slow-every S` and `--slow-ms T`
//! (every S-th job also waits T ms, cancellably, so it needs heartbeats: default twice the
//! lease; a stall only bites attempts in flight with more than a lease still to go), `--faults LIST`, `--stall-ms D`, `--seed S`,
//! `--max-faults N` (stop injecting after N), `--keep-logs`, `--quiet`.
//! PostgreSQL comes from `DATABASE_URL` (else `localstack/.env`), SQS from the AWS environment,
//! Redis is a private `redis-server` the runner starts on a free port (never the shared one).
//! Exit code 0 when every invariant holds, 1 when one is violated, 2 on a setup error.
//!
//! `tests/chaos.rs` runs small instances in CI; the worker processes are that test binary
//! re-executed in worker mode (see [`Launcher`]), so no example binary must be built.
#![allow(dead_code)] // shared with tests/chaos.rs, which uses a subset

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use brokerfence::adapters::{Consumer, ConsumerConfig, Source, shutdown_signal};
use brokerfence::fence::wire::FenceStamp;
use brokerfence::fence::{
    FenceStore, JobContext, JobError, LeaseDuration, Owner, PgFence, PgLedger, QueueName, RetryPolicy, SchemaName,
    SupervisorConfig, Verdict,
};
use rand::{Rng, SeedableRng};
use sqlx::AssertSqlSafe;
use tokio::io::{AsyncBufReadExt, BufReader};


pub mod faults;

mod pg_stall;

pub mod proxy;

pub use faults::FaultKind;
use faults::{FaultLog, LossEvent, Target, now_ms};

/// Environment variable that carries a worker's arguments when the launcher re-executes a test
/// binary in worker mode (arguments joined by U+001F).
pub const WORKER_ENV: &str = "BROKERFENCE_CHAOS_WORKER_ARGS";
const SEP: char = '\u{1f}';

/// Which process this is: `chaos [RUNNER OPTIONS]` (the runner; its options are [`RunnerCli`]'s)
/// or `chaos --worker [WORKER OPTIONS]` (a worker the runner starts; [`WorkerCli`]'s). Help and
/// errors are left to those two parsers.
#[derive(clap::Parser)]
#[command(
    name = "chaos",
    disable_help_flag = true,
    disable_version_flag = true,
    args_conflicts_with_subcommands = true
)]
struct Process {
    #[command(subcommand)]
    worker: Option<WorkerMode>,
    /// The runner's options.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    runner: Vec<String>,
}

#[derive(clap::Subcommand)]
enum WorkerMode {
    /// A worker process (`--worker` first).
    #[command(name = "--worker", long_flag = "worker", disable_help_flag = true, hide = true)]
    Worker {
        /// The worker's options.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
}

pub fn main() {
    // A test binary re-executed as a worker gets its arguments in the environment.
    if let Ok(args) = std::env::var(WORKER_ENV) {
        std::process::exit(worker_main(args.split(SEP).map(str::to_owned).collect()));
    }
    let process = <Process as clap::Parser>::parse();
    std::process::exit(match process.worker {
        Some(WorkerMode::Worker { args }) => worker_main(args),
        None => runner_main(process.runner),
    });
}

// ------------------------------------------------------------------------------------------------
// Configuration
// ------------------------------------------------------------------------------------------------

/// Which source the workers read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceKind {
    /// The PostgreSQL table queue (`claim_next`).
    Table,
    /// An SQS queue on LocalStack (feature `sqs`).
    Sqs,
    /// A Redis stream consumer group on a private redis-server (feature `redis`).
    Redis,
}

impl SourceKind {
    /// Parses `table`, `sqs` or `redis`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "table" => Ok(SourceKind::Table),
            "sqs" => Ok(SourceKind::Sqs),
            "redis" => Ok(SourceKind::Redis),
            other => Err(format!("unknown source {other:?} (table|sqs|redis)")),
        }
    }

    /// The name.
    pub fn name(self) -> &'static str {
        match self {
            SourceKind::Table => "table",
            SourceKind::Sqs => "sqs",
            SourceKind::Redis => "redis",
        }
    }
}

/// How worker processes are started.
#[derive(Debug, Clone)]
pub struct Launcher {
    /// The executable.
    pub exe: PathBuf,
    /// Fixed arguments (for a test binary: the filter that selects its worker entry).
    pub args: Vec<String>,
    /// Pass the worker's arguments in [`WORKER_ENV`] (test binaries) instead of after `--worker`.
    pub via_env: bool,
}

impl Launcher {
    /// This very executable, with `--worker ARGS` (the example binary).
    pub fn this_example() -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
        Ok(Self { exe, args: Vec::new(), via_env: false })
    }

    fn command(&self, worker_args: &[String]) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.exe);
        cmd.args(&self.args);
        if self.via_env {
            cmd.env(WORKER_ENV, worker_args.join(&SEP.to_string()));
        } else {
            cmd.arg("--worker").args(worker_args);
        }
        cmd
    }
}

/// One chaos run.
#[derive(Debug, Clone)]
pub struct ChaosConfig {
    /// The source.
    pub source: SourceKind,
    /// Worker processes.
    pub workers: usize,
    /// Jobs.
    pub jobs: usize,
    /// Jobs each worker runs at once.
    pub concurrency: usize,
    /// Deliveries per receive.
    pub batch: usize,
    /// Blocking work per job.
    pub work: Duration,
    /// Lease length in seconds (≥ 3).
    pub lease_secs: u64,
    /// Mean time between faults.
    pub fault_every: Duration,
    /// The run fails when the jobs are not all finished by then.
    pub deadline: Duration,
    /// Every n-th job is poison (undecodable): it must end dead-lettered. 0 = none.
    pub poison_every: usize,
    /// Every n-th job fails its first attempt (retried). 0 = none.
    pub flaky_every: usize,
    /// Every n-th job also waits [`slow_work`](Self::slow_work) (cancellably) in its handler, so
    /// that attempts live across heartbeats and a stall finds them in flight. 0 = none.
    pub slow_every: usize,
    /// The extra wait of a slow job (default twice the lease: a stall must find attempts with
    /// more than a lease still to go, or it cannot cost one).
    pub slow_work: Option<Duration>,
    /// The faults injected: every one once early on, then at random.
    pub faults: Vec<FaultKind>,
    /// How long a broker or PostgreSQL stall lasts (default lease + 2 s).
    pub stall: Option<Duration>,
    /// Stop injecting after this many faults (the rest of the run drains in peace).
    pub max_faults: Option<usize>,
    /// Seed of the fault schedule.
    pub seed: u64,
    /// PostgreSQL URL.
    pub database_url: String,
    /// How workers are started.
    pub launcher: Launcher,
    /// Keep the workers' log files (printed at the end).
    pub keep_logs: bool,
    /// On a violation, keep the logs and the database schema for a look (default true).
    pub keep_on_failure: bool,
    /// Print progress lines.
    pub verbose: bool,
    /// TEST ONLY (feature `guard-switches`): guards the workers run without, e.g.
    /// `no-commit-cas`, to show that the checks notice.
    pub worker_guards: Vec<String>,
}

impl ChaosConfig {
    /// Defaults for a hand run of `source`.
    pub fn new(source: SourceKind, database_url: String, launcher: Launcher) -> Self {
        Self {
            source,
            workers: 4,
            jobs: 1000,
            concurrency: 4,
            batch: 10,
            work: Duration::from_millis(20),
            lease_secs: 3,
            fault_every: Duration::from_millis(1500),
            deadline: Duration::from_secs(300),
            poison_every: 97,
            flaky_every: 31,
            slow_every: 0,
            slow_work: None,
            faults: FaultKind::CLASSIC.to_vec(),
            stall: None,
            max_faults: None,
            seed: rand::random(),
            database_url,
            launcher,
            keep_logs: false,
            keep_on_failure: true,
            verbose: true,
            worker_guards: Vec::new(),
        }
    }

    /// The small instance CI runs: about 20–40 s with at least one of every fault.
    pub fn small(source: SourceKind, database_url: String, launcher: Launcher) -> Self {
        Self {
            workers: 3,
            jobs: 240,
            concurrency: 2,
            batch: 4,
            work: Duration::from_millis(120),
            fault_every: Duration::from_millis(1200),
            deadline: Duration::from_secs(90),
            poison_every: 40,
            flaky_every: 17,
            verbose: false,
            ..Self::new(source, database_url, launcher)
        }
    }

    /// A small instance for the edge faults (broker and PostgreSQL stalls): only `faults`, the
    /// first after 3 s, then one every 6 s or so (one stall of lease + 2 s at a time, four in
    /// all: a fault schedule without end would stall the last long job forever), on jobs
    /// of which every fourth waits 6 s (twice the lease) in its handler, so that a stall finds
    /// attempts in flight that live on their heartbeats. About 20–40 s here.
    pub fn edges(source: SourceKind, faults: &[FaultKind], database_url: String, launcher: Launcher) -> Self {
        Self {
            workers: 3,
            jobs: 60,
            concurrency: 2,
            batch: 2,
            work: Duration::from_millis(100),
            fault_every: Duration::from_millis(6000),
            deadline: Duration::from_secs(50),
            poison_every: 0,
            flaky_every: 0,
            slow_every: 4,
            faults: faults.to_vec(),
            max_faults: Some(4),
            verbose: false,
            ..Self::new(source, database_url, launcher)
        }
    }

    /// The wait of a slow job.
    pub fn slow_work(&self) -> Duration {
        self.slow_work.unwrap_or(Duration::from_secs(self.lease_secs * 2))
    }

    /// How long a stall lasts.
    pub fn stall(&self) -> Duration {
        self.stall.unwrap_or(Duration::from_secs(self.lease_secs + 2))
    }

    /// Whether `kind` is among the faults of this run.
    pub fn injects(&self, kind: FaultKind) -> bool {
        self.faults.contains(&kind)
    }
}

/// Chaos run: worker processes consume jobs while faults are injected (SIGSTOP, SIGKILL,
/// connections cut, broker and PostgreSQL stalls); the report checks that every job ended once,
/// with its newest epoch's effect. Exit codes: 0 no violation, 1 violations, 2 could not run.
/// (`chaos --worker …` is the worker process the runner starts.)
#[derive(clap::Parser)]
#[command(name = "chaos", help_template = "usage: {usage}\n\n{about-with-newline}\n{all-args}{after-help}")]
struct RunnerCli {
    /// table, sqs or redis
    #[arg(long, value_name = "SOURCE", value_parser = SourceKind::parse)]
    source: Option<SourceKind>,
    /// Worker processes at once
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    workers: Option<usize>,
    /// Jobs
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    jobs: Option<usize>,
    /// Jobs at once per worker
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    concurrency: Option<usize>,
    /// Claim batch per worker
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    batch: Option<usize>,
    /// Milliseconds of work per job
    #[arg(long = "work-ms", value_name = "MS")]
    work_ms: Option<u64>,
    /// Lease in seconds
    #[arg(long, value_name = "SECS")]
    lease_secs: Option<u64>,
    /// Milliseconds between faults (at least 100)
    #[arg(long = "fault-every-ms", value_name = "MS")]
    fault_every_ms: Option<u64>,
    /// Seconds the run may take
    #[arg(long, value_name = "SECS")]
    deadline_secs: Option<u64>,
    /// Every Nth job is poison (0: none)
    #[arg(long, value_name = "N")]
    poison_every: Option<usize>,
    /// Every Nth job fails its first attempt (0: none)
    #[arg(long, value_name = "N")]
    flaky_every: Option<usize>,
    /// Every Nth job is slow (0: none)
    #[arg(long, value_name = "N")]
    slow_every: Option<usize>,
    /// Milliseconds a slow job waits [default: twice the lease]
    #[arg(long = "slow-ms", value_name = "MS")]
    slow_ms: Option<u64>,
    /// Faults to inject, comma separated
    #[arg(long, value_name = "LIST")]
    faults: Option<String>,
    /// Milliseconds a stall lasts [default: lease + 2 s]
    #[arg(long = "stall-ms", value_name = "MS")]
    stall_ms: Option<u64>,
    /// Most faults to inject
    #[arg(long, value_name = "N")]
    max_faults: Option<usize>,
    /// Random seed
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
    /// PostgreSQL URL (else DATABASE_URL, else localstack/.env)
    #[arg(long, value_name = "URL")]
    database_url: Option<String>,
    /// Test only (the members' guard-switches, on in example builds): guards the workers turn off
    #[arg(long, value_name = "LIST")]
    guards: Option<String>,
    /// Keep the workers' logs
    #[arg(long)]
    keep_logs: bool,
    /// Less output
    #[arg(long)]
    quiet: bool,
}

fn at_least_one(v: &str) -> Result<usize, String> {
    v.parse::<usize>().map(|n| n.max(1)).map_err(|e| format!("{v:?}: {e}"))
}

/// Why the runner's command line was not run: clap's answer (help or a usage error), or a
/// setting that is missing or wrong.
enum RunnerArgsError {
    Cli(clap::Error),
    Setup(String),
}

impl From<String> for RunnerArgsError {
    fn from(e: String) -> Self {
        RunnerArgsError::Setup(e)
    }
}

fn parse_runner_args(args: &[String]) -> Result<ChaosConfig, RunnerArgsError> {
    let cli =
        <RunnerCli as clap::Parser>::try_parse_from(std::iter::once("chaos".to_owned()).chain(args.iter().cloned()))
            .map_err(RunnerArgsError::Cli)?;
    let database_url = match cli.database_url {
        Some(url) => url,
        None => brokerfence_testkit::services::var("DATABASE_URL").ok_or_else(|| {
            "DATABASE_URL is not set and localstack/.env has none: run `bash localstack/up` first".to_owned()
        })?,
    };
    let mut c = ChaosConfig::new(SourceKind::Table, database_url, Launcher::this_example()?);
    c.keep_logs = cli.keep_logs;
    if cli.quiet {
        c.verbose = false;
    }
    if let Some(v) = cli.source {
        c.source = v;
    }
    if let Some(v) = cli.workers {
        c.workers = v;
    }
    if let Some(v) = cli.jobs {
        c.jobs = v;
    }
    if let Some(v) = cli.concurrency {
        c.concurrency = v;
    }
    if let Some(v) = cli.batch {
        c.batch = v;
    }
    if let Some(v) = cli.work_ms {
        c.work = Duration::from_millis(v);
    }
    if let Some(v) = cli.lease_secs {
        c.lease_secs = v;
    }
    if let Some(v) = cli.fault_every_ms {
        c.fault_every = Duration::from_millis(v.max(100));
    }
    if let Some(v) = cli.deadline_secs {
        c.deadline = Duration::from_secs(v);
    }
    if let Some(v) = cli.poison_every {
        c.poison_every = v;
    }
    if let Some(v) = cli.flaky_every {
        c.flaky_every = v;
    }
    if let Some(v) = cli.slow_every {
        c.slow_every = v;
    }
    if let Some(v) = cli.slow_ms {
        c.slow_work = Some(Duration::from_millis(v));
    }
    if let Some(v) = cli.faults {
        c.faults = FaultKind::parse_list(&v)?;
    }
    if let Some(v) = cli.stall_ms {
        c.stall = Some(Duration::from_millis(v));
    }
    if cli.max_faults.is_some() {
        c.max_faults = cli.max_faults;
    }
    if let Some(v) = cli.seed {
        c.seed = v;
    }
    if let Some(v) = cli.guards {
        c.worker_guards = v.split(',').filter(|g| !g.is_empty()).map(str::to_owned).collect();
    }
    LeaseDuration::from_secs(c.lease_secs).map_err(|e| e.to_string())?;
    Ok(c)
}

fn runner_main(args: Vec<String>) -> i32 {
    let config = match parse_runner_args(&args) {
        Ok(c) => c,
        Err(RunnerArgsError::Cli(e)) => {
            let _ = e.print();
            return e.exit_code();
        }
        Err(RunnerArgsError::Setup(e)) => {
            eprintln!("chaos: {e}");
            return 2;
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("chaos: tokio runtime: {e}");
            return 2;
        }
    };
    match rt.block_on(run(config)) {
        Ok(report) => {
            println!("{report}");
            if report.violations().is_empty() { 0 } else { 1 }
        }
        Err(e) => {
            eprintln!("chaos: {e}");
            2
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Report
// ------------------------------------------------------------------------------------------------

/// What a chaos run found.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Source name.
    pub source: &'static str,
    /// Jobs produced.
    pub jobs: usize,
    /// Worker processes (at once).
    pub workers: usize,
    /// Jobs completed.
    pub completed: usize,
    /// Jobs dead-lettered.
    pub dead: usize,
    /// Jobs neither completed nor dead at the end.
    pub unfinished: usize,
    /// Completed jobs whose committed epoch never reached the receiver, or whose result is not
    /// the one that epoch produced.
    pub effect_missing: usize,
    /// Jobs dead that should have completed (not poison).
    pub unexpected_dead: usize,
    /// Poison jobs that did not end dead, or whose reason was not recorded.
    pub poison_not_dead_lettered: usize,
    /// Jobs with more than one commit in the audit table.
    pub committed_twice: usize,
    /// Receiver accepts of an epoch lower than one already accepted for the job.
    pub stale_accepts: usize,
    /// Zombie commits refused by the compare-and-set (summed over worker incarnations).
    pub zombie_commits_rejected: u64,
    /// Handlers cancelled after a lease loss.
    pub lease_losses: u64,
    /// Receiver calls.
    pub receiver_calls: u64,
    /// Receiver calls refused as stale (409).
    pub receiver_refused: u64,
    /// Jobs whose final epoch is above 1 (taken over or retried).
    pub jobs_reclaimed: usize,
    /// Highest epoch seen.
    pub max_epoch: i64,
    /// SIGSTOPs sent.
    pub sigstops: u64,
    /// SIGKILLs sent (each followed by a restart).
    pub sigkills: u64,
    /// `pg_terminate_backend` calls that cut worker connections.
    pub connections_terminated: u64,
    /// Redis restarts.
    pub redis_restarts: u64,
    /// Broker stalls (the proxy held every byte for the stall length).
    pub broker_stalls: u64,
    /// `pg-lock` injections that locked at least one running row.
    pub pg_locks: u64,
    /// Rows locked by them in all.
    pub pg_locked_rows: u64,
    /// `pg-pause` injections that paused at least one backend.
    pub pg_pauses: u64,
    /// Backends paused by them (first round of each).
    pub pg_paused_backends: u64,
    /// Attempts in flight (rows `running` under a live lease) when the stalls began, summed:
    /// a stall that finds none cannot cost a lease.
    pub stalled_attempts: u64,
    /// The faults selected for the run.
    pub faults: Vec<FaultKind>,
    /// Selected faults that do not apply to this source, with the reason.
    pub not_applicable: Vec<String>,
    /// Every fault injected, with its window.
    pub timeline: Vec<faults::FaultRecord>,
    /// The run's start (ms since the Unix epoch): the timeline counts from here.
    pub t0_ms: u64,
    /// How long each stall lasted.
    pub stall_secs: f64,
    /// The lease.
    pub lease_secs: u64,
    /// Faults injected (counting each injection once).
    pub faults_injected: usize,
    /// Lost attempts, judged by the rule of [`faults`].
    pub losses: faults::LossSummary,
    /// Worker incarnations that stopped cleanly whose reported lost attempts do not add up to
    /// their `lease_losses` counter (the loss reports are incomplete).
    pub loss_reports_missing: u64,
    /// Poison deliveries found in the broker's dead-letter destination (SQS DLQ / dead stream).
    pub broker_dead_letters: Option<usize>,
    /// Seconds from the first worker start to the last job finished.
    pub drain_secs: f64,
    /// Seconds in all.
    pub total_secs: f64,
    /// Seed of the fault schedule.
    pub seed: u64,
    /// Where the workers' logs are (kept on failure or with `--keep-logs`).
    pub log_dir: Option<PathBuf>,
}

impl Report {
    /// Every invariant that does not hold, in words. Empty means the run passed.
    pub fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        let lost = self.unfinished + self.effect_missing + self.unexpected_dead;
        if lost > 0 {
            v.push(format!(
                "jobs lost = {lost} (unfinished {}, effect missing {}, dead unexpectedly {})",
                self.unfinished, self.effect_missing, self.unexpected_dead
            ));
        }
        if self.committed_twice > 0 {
            v.push(format!("results committed twice = {}", self.committed_twice));
        }
        if self.stale_accepts > 0 {
            v.push(format!("receiver accepted a lower epoch {} times", self.stale_accepts));
        }
        if self.faults.contains(&FaultKind::SigStop) && self.zombie_commits_rejected < 1 {
            v.push("no zombie commit was rejected: the pauses did not bite".into());
        }
        if self.losses.healthy > 0 {
            v.push(format!(
                "healthy cancellations = {} (leases lost while the database was reachable and the holder running)",
                self.losses.healthy
            ));
        }
        if self.loss_reports_missing > 0 {
            v.push(format!(
                "{} worker runs reported fewer lost attempts than their lease_losses counter",
                self.loss_reports_missing
            ));
        }
        if self.completed + self.dead != self.jobs {
            v.push(format!("completed {} + dead {} != jobs {}", self.completed, self.dead, self.jobs));
        }
        if self.poison_not_dead_lettered > 0 {
            v.push(format!("poison jobs not dead-lettered with their reason = {}", self.poison_not_dead_lettered));
        }
        v
    }

    /// Jobs lost in all.
    pub fn lost(&self) -> usize {
        self.unfinished + self.effect_missing + self.unexpected_dead
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "chaos [{}]: {} jobs, {} worker processes, seed {}",
            self.source, self.jobs, self.workers, self.seed
        )?;
        let names: Vec<&str> = self.faults.iter().map(|k| k.name()).collect();
        writeln!(
            f,
            "  faults selected: {} (lease {} s, stalls {:.1} s)",
            names.join(","),
            self.lease_secs,
            self.stall_secs
        )?;
        for na in &self.not_applicable {
            writeln!(f, "  not applicable: {na}")?;
        }
        writeln!(
            f,
            "  faults: {} SIGSTOP>lease, {} SIGKILL+restart, {} pg_terminate_backend, {} redis restarts",
            self.sigstops, self.sigkills, self.connections_terminated, self.redis_restarts,
        )?;
        let stalls = [FaultKind::BrokerStall, FaultKind::PgLock, FaultKind::PgPause];
        if self.faults.iter().any(|k| stalls.contains(k)) {
            writeln!(
                f,
                "  stalls: {} broker stalls, {} pg row locks ({} rows), {} pg backend pauses ({} backends); \
                 {} attempts in flight when they began",
                self.broker_stalls,
                self.pg_locks,
                self.pg_locked_rows,
                self.pg_pauses,
                self.pg_paused_backends,
                self.stalled_attempts
            )?;
        }
        if !self.timeline.is_empty() {
            writeln!(f, "  timeline (s after start):")?;
            for r in &self.timeline {
                let end = r.end_ms.unwrap_or(r.start_ms);
                writeln!(
                    f,
                    "    {:>6.1} +{:>4.1} s  {:<13} {:<12} {}",
                    faults::secs_after(self.t0_ms, r.start_ms),
                    end.saturating_sub(r.start_ms) as f64 / 1000.0,
                    r.kind.name(),
                    r.target.to_string(),
                    r.detail
                )?;
            }
        }
        writeln!(f, "  jobs lost                          = {}", self.lost())?;
        writeln!(f, "  results committed twice            = {}", self.committed_twice)?;
        writeln!(f, "  receiver accepts of a lower epoch  = {}", self.stale_accepts)?;
        writeln!(f, "  healthy cancellations              = {}", self.losses.healthy)?;
        let excused: Vec<String> = self.losses.excused.iter().map(|(k, n)| format!("{k} {n}")).collect();
        writeln!(
            f,
            "  attempts lost (lease)              = {} (excused: {})",
            self.losses.lost_attempts,
            if excused.is_empty() { "none".into() } else { excused.join(", ") }
        )?;
        for (during, n) in &self.losses.healthy_during {
            writeln!(f, "    healthy cancellations during {during}: {n}")?;
        }
        for e in &self.losses.healthy_examples {
            writeln!(f, "    e.g. {e}")?;
        }
        writeln!(f, "  zombie commits rejected            = {}", self.zombie_commits_rejected)?;
        writeln!(f, "  completed + dead-lettered          = {} + {} of {}", self.completed, self.dead, self.jobs)?;
        if let Some(n) = self.broker_dead_letters {
            writeln!(f, "  in the broker's dead-letter place  = {n}")?;
        }
        writeln!(
            f,
            "  lease losses {}, receiver calls {} ({} refused as stale), jobs reclaimed {}, max epoch {}",
            self.lease_losses, self.receiver_calls, self.receiver_refused, self.jobs_reclaimed, self.max_epoch
        )?;
        write!(f, "  drained in {:.1} s, {:.1} s in all", self.drain_secs, self.total_secs)?;
        if let Some(dir) = &self.log_dir {
            write!(f, "\n  worker logs: {}", dir.display())?;
        }
        let violations = self.violations();
        if violations.is_empty() {
            write!(f, "\n  PASS: every invariant holds")
        } else {
            for v in violations {
                write!(f, "\n  FAIL: {v}")?;
            }
            Ok(())
        }
    }
}

// ------------------------------------------------------------------------------------------------
// The independent receiver
// ------------------------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct JobLog {
    accepted: Vec<i64>,
    max_accepted: i64,
    refused: u64,
}

/// An HTTP receiver that checks every call against the fence ledger and records it in its own
/// log, so the runner can check the ledger's answers independently.
struct Receiver {
    ledger: PgLedger,
    log: Mutex<HashMap<String, JobLog>>,
    locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    calls: AtomicU64,
    refused: AtomicU64,
    stale_accepts: AtomicU64,
    errors: AtomicU64,
}

impl Receiver {
    fn lock_for(&self, job: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(locks.entry(job.to_owned()).or_default())
    }

    async fn call(&self, headers: &axum::http::HeaderMap) -> (axum::http::StatusCode, String) {
        use axum::http::StatusCode;
        self.calls.fetch_add(1, Ordering::Relaxed);
        let pairs = headers.iter().filter_map(|(k, v)| v.to_str().ok().map(|v| (k.as_str().to_owned(), v.to_owned())));
        let stamp = match FenceStamp::from_headers(pairs) {
            Ok(s) => s,
            Err(e) => return (StatusCode::BAD_REQUEST, e.to_json()),
        };
        let job = stamp.ledger_job();
        // One decision per job at a time, so the log's order is the ledger's order.
        let lock = self.lock_for(&job);
        let _held = lock.lock().await;
        let verdict = match self.ledger.accept(&job, stamp.epoch).await {
            Ok(v) => v,
            Err(e) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                return (StatusCode::SERVICE_UNAVAILABLE, e.to_string());
            }
        };
        let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        let entry = log.entry(stamp.job.clone()).or_default();
        match verdict {
            Verdict::Accepted { .. } => {
                if stamp.epoch < entry.max_accepted {
                    self.stale_accepts.fetch_add(1, Ordering::Relaxed);
                }
                entry.max_accepted = entry.max_accepted.max(stamp.epoch);
                entry.accepted.push(stamp.epoch);
                (StatusCode::OK, "applied".into())
            }
            Verdict::Stale { newest } => {
                entry.refused += 1;
                self.refused.fetch_add(1, Ordering::Relaxed);
                (StatusCode::CONFLICT, format!("stale epoch {} < {newest}", stamp.epoch))
            }
        }
    }
}

async fn start_receiver(receiver: Arc<Receiver>) -> Result<(String, tokio::task::JoinHandle<()>), String> {
    use axum::routing::post;
    let app = axum::Router::new().route(
        "/effect",
        post(move |headers: axum::http::HeaderMap| {
            let receiver = Arc::clone(&receiver);
            async move { receiver.call(&headers).await }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| format!("bind receiver: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let handle = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("chaos receiver stopped: {e}");
        }
    });
    Ok((format!("http://{addr}/effect"), handle))
}

// ------------------------------------------------------------------------------------------------
// Sources: setup, worker arguments, dead letters
// ------------------------------------------------------------------------------------------------

/// What a job is made to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Ok,
    Poison,
    Flaky,
    /// Waits past the lease in its handler (cancellably): lives on heartbeats.
    Slow,
}

fn job_kinds(c: &ChaosConfig) -> Vec<(String, Kind)> {
    (0..c.jobs)
        .map(|i| {
            let kind = if c.poison_every > 0 && i % c.poison_every == c.poison_every / 2 {
                Kind::Poison
            } else if c.flaky_every > 0 && i % c.flaky_every == 1 {
                Kind::Flaky
            } else if c.slow_every > 0 && i % c.slow_every == c.slow_every - 1 {
                Kind::Slow
            } else {
                Kind::Ok
            };
            (format!("job-{i:06}"), kind)
        })
        .collect()
}

fn payload_of(kind: Kind) -> &'static [u8] {
    match kind {
        Kind::Ok => b"{\"op\":\"apply\"}",
        Kind::Flaky => b"{\"op\":\"flaky\"}",
        Kind::Slow => b"{\"op\":\"slow\"}",
        // Not valid UTF-8 and not JSON: the handler cannot decode it.
        Kind::Poison => b"\xff\xfe{poison",
    }
}

/// Broker-side state of a run (queues, a private Redis server).
enum Broker {
    Table,
    #[cfg(feature = "sqs")]
    Sqs(sqs_chaos::SqsBroker),
    #[cfg(feature = "redis")]
    Redis(redis_chaos::RedisBroker),
}

impl Broker {
    async fn setup(
        c: &ChaosConfig,
        store: &PgFence,
        queue: &QueueName,
        jobs: &[(String, Kind)],
    ) -> Result<Self, String> {
        match c.source {
            SourceKind::Table => {
                let items: Vec<(brokerfence::fence::JobKey, Vec<u8>)> = jobs
                    .iter()
                    .map(|(k, kind)| Ok((brokerfence::fence::JobKey::new(k.clone())?, payload_of(*kind).to_vec())))
                    .collect::<Result<_, brokerfence::fence::FenceError>>()
                    .map_err(|e| e.to_string())?;
                for chunk in items.chunks(1000) {
                    store.enqueue_many(queue, chunk).await.map_err(|e| format!("enqueue: {e}"))?;
                }
                Ok(Broker::Table)
            }
            #[cfg(feature = "sqs")]
            SourceKind::Sqs => Ok(Broker::Sqs(sqs_chaos::SqsBroker::setup(c, queue, jobs).await?)),
            #[cfg(not(feature = "sqs"))]
            SourceKind::Sqs => Err("the sqs source needs the `sqs` feature (--features sqs)".into()),
            #[cfg(feature = "redis")]
            SourceKind::Redis => Ok(Broker::Redis(redis_chaos::RedisBroker::setup(c, queue, jobs).await?)),
            #[cfg(not(feature = "redis"))]
            SourceKind::Redis => Err("the redis source needs the `redis` feature (--features redis)".into()),
        }
    }

    /// The broker's `host:port` on this machine, for a stall proxy in front of it; `None` when
    /// there is no broker (the table queue) or it is not a plain address here.
    fn upstream(&self) -> Option<String> {
        match self {
            Broker::Table => None,
            #[cfg(feature = "sqs")]
            Broker::Sqs(_) => sqs_chaos::endpoint_host_port(),
            #[cfg(feature = "redis")]
            Broker::Redis(b) => Some(format!("127.0.0.1:{}", b.port())),
        }
    }

    /// The workers' arguments; with `proxy`, they reach the broker through it.
    fn worker_args(&self, proxy: Option<std::net::SocketAddr>) -> Vec<String> {
        let _ = proxy;
        match self {
            Broker::Table => Vec::new(),
            #[cfg(feature = "sqs")]
            Broker::Sqs(b) => b.worker_args(),
            #[cfg(feature = "redis")]
            Broker::Redis(b) => b.worker_args(proxy.map(|a| format!("redis://{a}"))),
        }
    }

    /// Environment the workers need (the AWS settings for SQS; with `proxy`, its endpoint).
    fn worker_env(&self, proxy: Option<std::net::SocketAddr>) -> Vec<(String, String)> {
        let _ = proxy;
        match self {
            #[cfg(feature = "sqs")]
            Broker::Sqs(_) => {
                let mut env = sqs_chaos::aws_env();
                if let Some(addr) = proxy {
                    env.retain(|(k, _)| k != "AWS_ENDPOINT_URL_SQS");
                    env.push(("AWS_ENDPOINT_URL_SQS".into(), format!("http://{addr}")));
                }
                env
            }
            _ => Vec::new(),
        }
    }

    fn can_restart_server(&self) -> bool {
        match self {
            #[cfg(feature = "redis")]
            Broker::Redis(_) => true,
            _ => false,
        }
    }

    async fn restart_server(&mut self) -> Result<(), String> {
        match self {
            #[cfg(feature = "redis")]
            Broker::Redis(b) => b.restart().await,
            _ => Ok(()),
        }
    }

    /// Poison deliveries found in the broker's dead-letter place, when it has one.
    async fn dead_letters(&self, poison: &HashSet<String>) -> Result<Option<usize>, String> {
        if poison.is_empty() {
            return Ok(None);
        }
        match self {
            Broker::Table => {
                let _ = poison;
                Ok(None)
            }
            #[cfg(feature = "sqs")]
            Broker::Sqs(b) => b.dead_letters(poison).await.map(Some),
            #[cfg(feature = "redis")]
            Broker::Redis(b) => b.dead_letters(poison).await.map(Some),
        }
    }

    async fn cleanup(self) {
        match self {
            Broker::Table => {}
            #[cfg(feature = "sqs")]
            Broker::Sqs(b) => b.cleanup().await,
            #[cfg(feature = "redis")]
            Broker::Redis(b) => b.cleanup().await,
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Worker processes, seen from the runner
// ------------------------------------------------------------------------------------------------

#[derive(Default)]
struct WorkerState {
    /// Handlers inside their blocking work right now.
    computing: AtomicI64,
    /// Last metrics line of each incarnation.
    metrics: Mutex<BTreeMap<u32, HashMap<String, u64>>>,
    /// Attempts each incarnation reported lost.
    losses: Mutex<Vec<LossEvent>>,
    /// Incarnations that stopped cleanly (their last metrics line is final).
    stopped: Mutex<HashSet<u32>>,
}

struct Worker {
    index: usize,
    incarnation: u32,
    child: tokio::process::Child,
    pid: i32,
    state: Arc<WorkerState>,
    stopped_until: Option<Instant>,
    /// The timeline entry of the SIGSTOP in force.
    stop_record: Option<usize>,
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a pid we spawned; no memory is touched.
    unsafe {
        libc::kill(pid, sig);
    }
}

struct Fleet {
    launcher: Launcher,
    base_args: Vec<String>,
    env: Vec<(String, String)>,
    log_dir: PathBuf,
    workers: Vec<Worker>,
    states: Vec<Arc<WorkerState>>,
}

impl Fleet {
    async fn spawn(&self, index: usize, incarnation: u32) -> Result<Worker, String> {
        let mut args = self.base_args.clone();
        args.extend(["--id".into(), index.to_string()]);
        let log = self.log_dir.join(format!("worker-{index}-{incarnation}.log"));
        let stderr = std::fs::File::create(&log).map_err(|e| format!("create {}: {e}", log.display()))?;
        let mut cmd = self.launcher.command(&args);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .env("RUST_LOG", std::env::var("CHAOS_WORKER_LOG").unwrap_or_else(|_| "warn".into()))
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| format!("spawn worker {index}: {e}"))?;
        let pid = child.id().and_then(|p| i32::try_from(p).ok()).ok_or("worker has no pid")?;
        let state = Arc::clone(&self.states[index]);
        state.computing.store(0, Ordering::Relaxed);
        if let Some(out) = child.stdout.take() {
            let state = Arc::clone(&state);
            tokio::spawn(async move {
                let mut lines = BufReader::new(out).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let Some(rest) = line.strip_prefix("EVENT ") else { continue };
                    let (name, fields) = rest.split_once(' ').unwrap_or((rest, ""));
                    match name {
                        "compute" => {
                            state.computing.fetch_add(1, Ordering::Relaxed);
                        }
                        "computed" => {
                            state.computing.fetch_sub(1, Ordering::Relaxed);
                        }
                        "metrics" => {
                            let parsed: HashMap<String, u64> = fields
                                .split_whitespace()
                                .filter_map(|kv| kv.split_once('='))
                                .filter_map(|(k, v)| v.parse().ok().map(|v| (k.to_owned(), v)))
                                .collect();
                            state.metrics.lock().unwrap_or_else(|p| p.into_inner()).insert(incarnation, parsed);
                        }
                        "lost" => {
                            if let Some(loss) = LossEvent::parse(index, incarnation, fields) {
                                state.losses.lock().unwrap_or_else(|p| p.into_inner()).push(loss);
                            }
                        }
                        "stopped" => {
                            state.stopped.lock().unwrap_or_else(|p| p.into_inner()).insert(incarnation);
                        }
                        _ => {}
                    }
                }
            });
        }
        Ok(Worker { index, incarnation, child, pid, state, stopped_until: None, stop_record: None })
    }

    fn metric(&self, name: &str) -> u64 {
        self.states
            .iter()
            .map(|s| {
                s.metrics.lock().unwrap_or_else(|p| p.into_inner()).values().filter_map(|m| m.get(name)).sum::<u64>()
            })
            .sum()
    }
}

// ------------------------------------------------------------------------------------------------
// The run
// ------------------------------------------------------------------------------------------------

/// Runs one chaos instance and returns what it found (it does not judge: see
/// [`Report::violations`]).
pub async fn run(c: ChaosConfig) -> Result<Report, String> {
    let started = Instant::now();
    let t0_ms = now_ms();
    let run_id = format!("{:08x}", rand::random::<u32>());
    let schema = SchemaName::new(format!("chaos_{run_id}")).map_err(|e| e.to_string())?;
    let options: sqlx::postgres::PgConnectOptions =
        c.database_url.parse().map_err(|e: sqlx::Error| format!("DATABASE_URL: {e}"))?;
    let store = PgFence::connect_with(options.application_name(&format!("chaos-{run_id}-runner")))
        .await
        .map_err(|e| format!("connect to PostgreSQL (run `bash localstack/up`): {e}"))?
        .with_schema(schema.clone());
    store.migrate().await.map_err(|e| format!("migrate: {e}"))?;
    install_audit(&store).await?;

    let queue = QueueName::new(format!("chaos-{}-{run_id}", c.source.name())).map_err(|e| e.to_string())?;
    let jobs = job_kinds(&c);
    let mut broker = Broker::setup(&c, &store, &queue, &jobs).await?;

    // The faults that apply to this source; the others are named in the report.
    let mut kinds: Vec<FaultKind> = Vec::new();
    let mut not_applicable = Vec::new();
    for &k in &c.faults {
        match k {
            FaultKind::RedisRestart if !broker.can_restart_server() => not_applicable
                .push("redis-restart: only the Redis source runs a private server that can be restarted".to_owned()),
            FaultKind::BrokerStall if broker.upstream().is_none() => not_applicable.push(match c.source {
                SourceKind::Table => "broker-stall: the table queue has no broker (its receive is a PostgreSQL \
                                      statement: pg-lock and pg-pause stall that path)"
                    .to_owned(),
                _ => "broker-stall: the broker endpoint is not a plain address on 127.0.0.1".to_owned(),
            }),
            k => kinds.push(k),
        }
    }
    let proxy = match broker.upstream() {
        Some(upstream) if kinds.contains(&FaultKind::BrokerStall) => Some(proxy::StallProxy::start(upstream).await?),
        _ => None,
    };
    let proxy_addr = proxy.as_ref().map(|p| p.addr());

    let receiver = Arc::new(Receiver {
        ledger: PgLedger::new(&store, "chaos-receiver"),
        log: Mutex::default(),
        locks: Mutex::default(),
        calls: AtomicU64::new(0),
        refused: AtomicU64::new(0),
        stale_accepts: AtomicU64::new(0),
        errors: AtomicU64::new(0),
    });
    let (receiver_url, receiver_task) = start_receiver(Arc::clone(&receiver)).await?;

    let log_dir = std::env::temp_dir().join("brokerfence-chaos").join(&run_id);
    std::fs::create_dir_all(&log_dir).map_err(|e| format!("create {}: {e}", log_dir.display()))?;
    let mut base_args: Vec<String> = vec![
        "--source".into(),
        c.source.name().into(),
        "--db".into(),
        c.database_url.clone(),
        "--app".into(),
        format!("chaos-{run_id}-w"),
        "--schema".into(),
        schema.as_str().into(),
        "--queue".into(),
        queue.as_str().into(),
        "--receiver".into(),
        receiver_url,
        "--lease-secs".into(),
        c.lease_secs.to_string(),
        "--concurrency".into(),
        c.concurrency.to_string(),
        "--batch".into(),
        c.batch.to_string(),
        "--work-ms".into(),
        c.work.as_millis().to_string(),
        "--slow-ms".into(),
        c.slow_work().as_millis().to_string(),
    ];
    base_args.extend(broker.worker_args(proxy_addr));
    if !c.worker_guards.is_empty() {
        base_args.extend(["--guards".to_owned(), c.worker_guards.join(",")]);
    }
    let mut fleet = Fleet {
        launcher: c.launcher.clone(),
        base_args,
        env: broker.worker_env(proxy_addr),
        log_dir: log_dir.clone(),
        workers: Vec::new(),
        states: (0..c.workers).map(|_| Arc::new(WorkerState::default())).collect(),
    };
    let say = |msg: String| {
        if c.verbose {
            eprintln!("[chaos {:>6.1}s] {msg}", started.elapsed().as_secs_f64());
        }
    };
    for na in &not_applicable {
        say(format!("not applicable: {na}"));
    }
    if let Some(p) = &proxy {
        say(format!("workers reach the broker through the stall proxy on {}", p.addr()));
    }
    let first_start = Instant::now();
    for i in 0..c.workers {
        let w = fleet.spawn(i, 0).await?;
        fleet.workers.push(w);
    }
    say(format!("{} workers started on {} jobs ({})", c.workers, c.jobs, c.source.name()));

    let mut rng = rand::rngs::StdRng::seed_from_u64(c.seed);
    let lease = Duration::from_secs(c.lease_secs);
    let mut report = Report {
        source: c.source.name(),
        jobs: c.jobs,
        workers: c.workers,
        seed: c.seed,
        faults: c.faults.clone(),
        not_applicable,
        t0_ms,
        stall_secs: c.stall().as_secs_f64(),
        lease_secs: c.lease_secs,
        ..Default::default()
    };
    let log = FaultLog::default();
    let ctx =
        FaultCtx { c: &c, store: &store, queue: &queue, run_id: &run_id, lease, log: &log, proxy: proxy.as_ref() };
    // Every kind of fault early on (a second SIGSTOP at the end of the round), then at random.
    let mut schedule: Vec<FaultKind> = FaultKind::ALL.iter().copied().filter(|k| kinds.contains(k)).collect();
    if kinds.contains(&FaultKind::SigStop) {
        schedule.push(FaultKind::SigStop);
    }
    schedule.reverse();
    let mut next_fault = Instant::now() + c.fault_every / 2;
    let deadline = first_start + c.deadline;
    let mut drained_at = None;
    let mut last_progress = Instant::now();
    loop {
        let now = Instant::now();
        // Resume paused workers whose pause is over.
        for w in fleet.workers.iter_mut() {
            if w.stopped_until.is_some_and(|t| t <= now) {
                signal(w.pid, libc::SIGCONT);
                w.stopped_until = None;
                if let Some(id) = w.stop_record.take() {
                    log.close(id);
                }
                say(format!("SIGCONT worker {} (pid {})", w.index, w.pid));
            }
        }
        let finished = count_finished(&store, &queue).await?;
        if c.verbose && now.duration_since(last_progress) > Duration::from_secs(2) {
            last_progress = now;
            say(format!(
                "{finished}/{} finished; fenced so far {}, lease losses {}",
                c.jobs,
                fleet.metric("fenced_rejections"),
                fleet.metric("lease_losses")
            ));
        }
        if finished >= c.jobs {
            drained_at = Some(Instant::now());
            break;
        }
        if now >= deadline {
            say("deadline reached with jobs unfinished".into());
            break;
        }
        let injected = report.faults_injected;
        if now >= next_fault && !kinds.is_empty() && c.max_faults.is_none_or(|m| injected < m) {
            let fault = schedule.pop().unwrap_or_else(|| {
                let mut weighted = kinds.clone();
                if kinds.contains(&FaultKind::SigStop) {
                    weighted.push(FaultKind::SigStop);
                }
                weighted[rng.random_range(0..weighted.len())]
            });
            if inject(&ctx, fault, &mut fleet, &mut broker, &mut rng, &mut report, &say).await? {
                report.faults_injected += 1;
                // The first round comes at even steps, so every kind is injected early on.
                let jitter = if schedule.is_empty() { rng.random_range(0.5..1.5) } else { 1.0 };
                let mut gap = c.fault_every.mul_f64(jitter);
                if matches!(fault, FaultKind::BrokerStall | FaultKind::PgLock | FaultKind::PgPause) {
                    // One stall at a time, with a second of calm between two.
                    gap = gap.max(c.stall() + Duration::from_secs(1));
                }
                next_fault = Instant::now() + gap;
            } else {
                // Not possible right now (nothing to stall, a stall still in force): soon again.
                schedule.push(fault);
                next_fault = Instant::now() + Duration::from_millis(500);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    report.drain_secs = drained_at.unwrap_or_else(Instant::now).duration_since(first_start).as_secs_f64();
    // A broker stall still in force ends now: the workers need their broker to stop cleanly.
    if let Some(p) = &proxy {
        p.resume();
        log.cut_short(FaultKind::BrokerStall);
    }

    // Let every paused worker resume and finish its zombie attempts, let every stall end, then
    // stop the workers gracefully.
    let resume_by = fleet.workers.iter().filter_map(|w| w.stopped_until).max();
    if let Some(t) = resume_by {
        tokio::time::sleep(t.saturating_duration_since(Instant::now())).await;
    }
    for w in fleet.workers.iter_mut() {
        if w.stopped_until.take().is_some() {
            signal(w.pid, libc::SIGCONT);
        }
        if let Some(id) = w.stop_record.take() {
            log.close(id);
        }
    }
    let stalls_end = Instant::now() + c.stall() + Duration::from_secs(3);
    while log.any_open() && Instant::now() < stalls_end {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for w in &fleet.workers {
        signal(w.pid, libc::SIGTERM);
    }
    for w in fleet.workers.iter_mut() {
        match tokio::time::timeout(Duration::from_secs(15), w.child.wait()).await {
            Ok(_) => {}
            Err(_) => {
                say(format!("worker {} did not stop on SIGTERM; killing it", w.index));
                let _ = w.child.kill().await;
            }
        }
    }
    // The stdout readers deliver the final metrics lines.
    tokio::time::sleep(Duration::from_millis(200)).await;
    if let Some(p) = &proxy {
        p.resume();
    }

    // ---- checks ----
    let rows = final_rows(&store, &queue).await?;
    let commits = commit_counts(&store, &queue).await?;
    let accepted: HashMap<String, Vec<i64>> = receiver
        .log
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|(k, v)| (k.clone(), v.accepted.clone()))
        .collect();
    let poison: HashSet<String> = jobs.iter().filter(|(_, k)| *k == Kind::Poison).map(|(j, _)| j.clone()).collect();
    for (key, kind) in &jobs {
        let Some(row) = rows.get(key) else {
            report.unfinished += 1;
            continue;
        };
        report.max_epoch = report.max_epoch.max(row.epoch);
        if row.epoch > 1 {
            report.jobs_reclaimed += 1;
        }
        match row.state.as_str() {
            "completed" => {
                report.completed += 1;
                let expected = format!("{key}@{}", row.epoch);
                let reached = accepted.get(key).is_some_and(|e| e.contains(&row.epoch));
                if row.result.as_deref() != Some(expected.as_bytes()) || !reached || *kind == Kind::Poison {
                    report.effect_missing += 1;
                }
            }
            "dead" => {
                report.dead += 1;
                if *kind != Kind::Poison {
                    report.unexpected_dead += 1;
                } else if !row.last_error.as_deref().is_some_and(|e| e.contains("undecodable payload")) {
                    report.poison_not_dead_lettered += 1;
                }
            }
            _ => report.unfinished += 1,
        }
        if commits.get(key).copied().unwrap_or(0) > 1 {
            report.committed_twice += 1;
        }
    }
    report.poison_not_dead_lettered += poison.iter().filter(|k| rows.get(*k).is_none_or(|r| r.state != "dead")).count();
    report.broker_dead_letters = broker.dead_letters(&poison).await?;
    if let Some(n) = report.broker_dead_letters
        && n < poison.len()
    {
        report.poison_not_dead_lettered += poison.len() - n;
    }
    report.stale_accepts = receiver.stale_accepts.load(Ordering::Relaxed) as usize;
    report.receiver_calls = receiver.calls.load(Ordering::Relaxed);
    report.receiver_refused = receiver.refused.load(Ordering::Relaxed);
    report.zombie_commits_rejected = fleet.metric("fenced_rejections");
    report.lease_losses = fleet.metric("lease_losses");

    // Every lost attempt against the timeline; and the loss reports against the counters.
    report.timeline = log.snapshot();
    let mut losses: Vec<LossEvent> = Vec::new();
    for (i, state) in fleet.states.iter().enumerate() {
        let mine: Vec<LossEvent> = state.losses.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let metrics = state.metrics.lock().unwrap_or_else(|p| p.into_inner());
        for incarnation in state.stopped.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let counted = metrics.get(incarnation).and_then(|m| m.get("lease_losses")).copied().unwrap_or(0);
            let reported = mine.iter().filter(|l| l.incarnation == *incarnation).count() as u64;
            if reported < counted {
                say(format!("worker {i} run {incarnation}: {reported} lost attempts reported, {counted} counted"));
                report.loss_reports_missing += 1;
            }
        }
        losses.extend(mine);
    }
    losses.sort_by_key(|l| l.at_ms);
    report.losses = faults::summarize(&losses, &report.timeline, lease + Duration::from_secs(1), t0_ms);
    report.total_secs = started.elapsed().as_secs_f64();

    receiver_task.abort();
    drop(proxy);
    broker.cleanup().await;
    let keep = c.keep_logs || (c.keep_on_failure && !report.violations().is_empty());
    if keep {
        report.log_dir = Some(log_dir);
    } else {
        let _ = std::fs::remove_dir_all(&log_dir);
        drop_schema(&store).await;
    }
    Ok(report)
}

/// What every fault injection needs of the run.
struct FaultCtx<'a> {
    c: &'a ChaosConfig,
    store: &'a PgFence,
    queue: &'a QueueName,
    run_id: &'a str,
    lease: Duration,
    log: &'a FaultLog,
    proxy: Option<&'a proxy::StallProxy>,
}

async fn inject(
    x: &FaultCtx<'_>,
    fault: FaultKind,
    fleet: &mut Fleet,
    broker: &mut Broker,
    rng: &mut rand::rngs::StdRng,
    report: &mut Report,
    say: &impl Fn(String),
) -> Result<bool, String> {
    let (c, log) = (x.c, x.log);
    let running: Vec<usize> =
        fleet.workers.iter().enumerate().filter(|(_, w)| w.stopped_until.is_none()).map(|(i, _)| i).collect();
    match fault {
        FaultKind::SigStop => {
            // Keep one worker running, so the jobs of the paused one get taken over.
            if running.len() < 2 {
                return Ok(false);
            }
            // Prefer a worker inside its blocking work: resumed there, it reaches its commit.
            let busy: Vec<usize> = running
                .iter()
                .copied()
                .filter(|&i| fleet.workers[i].state.computing.load(Ordering::Relaxed) > 0)
                .collect();
            let pool = if busy.is_empty() { &running } else { &busy };
            let i = pool[rng.random_range(0..pool.len())];
            let pause = x.lease + Duration::from_millis(rng.random_range(1200..2500));
            let w = &mut fleet.workers[i];
            signal(w.pid, libc::SIGSTOP);
            w.stopped_until = Some(Instant::now() + pause);
            w.stop_record = Some(log.open(FaultKind::SigStop, Target::Worker(w.index), format!("pid {}", w.pid)));
            report.sigstops += 1;
            say(format!("SIGSTOP worker {} (pid {}) for {:.1} s", w.index, w.pid, pause.as_secs_f64()));
        }
        FaultKind::SigKill => {
            if running.is_empty() {
                return Ok(false);
            }
            let i = running[rng.random_range(0..running.len())];
            let start = now_ms();
            let (index, incarnation, old_pid) = {
                let w = &mut fleet.workers[i];
                let _ = w.child.start_kill();
                let _ = w.child.wait().await;
                say(format!("SIGKILL worker {} (pid {})", w.index, w.pid));
                (w.index, w.incarnation + 1, w.pid)
            };
            report.sigkills += 1;
            tokio::time::sleep(Duration::from_millis(rng.random_range(100..600))).await;
            fleet.workers[i] = fleet.spawn(index, incarnation).await?;
            let new_pid = fleet.workers[i].pid;
            log.record(
                FaultKind::SigKill,
                Target::Worker(index),
                start,
                now_ms(),
                format!("pid {old_pid}, restarted as pid {new_pid}"),
            );
            say(format!("restarted worker {index} (pid {new_pid})"));
        }
        FaultKind::PgTerminate => {
            let (pattern, target) = if rng.random_bool(0.5) || c.workers == 1 {
                (format!("chaos-{}-w%", x.run_id), Target::All)
            } else {
                let w = rng.random_range(0..c.workers);
                (format!("chaos-{}-w{w}", x.run_id), Target::Worker(w))
            };
            let start = now_ms();
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE application_name LIKE $1 AND pid <> pg_backend_pid()) t",
            )
            .bind(pattern.clone())
            .fetch_one(x.store.pool())
            .await
            .map_err(|e| format!("pg_terminate_backend: {e}"))?;
            report.connections_terminated += u64::try_from(n).unwrap_or(0);
            log.record(FaultKind::PgTerminate, target, start, now_ms(), format!("{n} connections cut"));
            say(format!("pg_terminate_backend: {n} connections of {pattern}"));
        }
        FaultKind::RedisRestart => {
            let start = now_ms();
            broker.restart_server().await?;
            log.record(FaultKind::RedisRestart, Target::All, start, now_ms(), "private redis-server killed".into());
            report.redis_restarts += 1;
            say("redis-server restarted".into());
        }
        FaultKind::BrokerStall => {
            let Some(proxy) = x.proxy else { return Ok(false) };
            if log.open_on(0, &[FaultKind::BrokerStall]) {
                return Ok(false);
            }
            let in_flight = live_attempts(x, None).await?;
            report.stalled_attempts += in_flight;
            let d = c.stall();
            let start = now_ms();
            proxy.stall_for(d);
            let conns = proxy.stats().connections.load(Ordering::Relaxed);
            log.record(
                FaultKind::BrokerStall,
                Target::All,
                start,
                start + d.as_millis() as u64,
                format!(
                    "proxy {} held every byte of {conns} connections (and new ones); {in_flight} attempts in flight",
                    proxy.addr()
                ),
            );
            report.broker_stalls += 1;
            say(format!("broker stall for {:.1} s (proxy {})", d.as_secs_f64(), proxy.addr()));
        }
        FaultKind::PgLock | FaultKind::PgPause => {
            let Some(i) = pg_victim(x, fleet).await? else {
                say(format!("{}: no running worker holds a running row now; later", fault.name()));
                return Ok(false);
            };
            let (index, pid) = (fleet.workers[i].index, fleet.workers[i].pid);
            let in_flight = live_attempts(x, Some(&owner_prefix(index, pid))).await?;
            let d = c.stall();
            if fault == FaultKind::PgLock {
                let prefix = owner_prefix(index, pid);
                let id = log.open(FaultKind::PgLock, Target::Worker(index), format!("owner {prefix}…:"));
                let app_prefix = format!("chaos-{}-w", x.run_id);
                let target = pg_stall::LockTarget {
                    schema: x.store.schema().as_str(),
                    queue: x.queue.as_str(),
                    owner_prefix: &prefix,
                    victim: index,
                    app_prefix: &app_prefix,
                };
                match pg_stall::lock_rows(x.store.pool(), target, d, log.clone(), id).await {
                    Ok(n) => {
                        say(format!("pg-lock: {n} running rows of worker {index} locked for {:.1} s", d.as_secs_f64()));
                        if n == 0 {
                            return Ok(false);
                        }
                        report.pg_locks += 1;
                        report.pg_locked_rows += n as u64;
                        report.stalled_attempts += in_flight;
                    }
                    Err(e) => {
                        log.close(id);
                        say(format!("pg-lock failed: {e}"));
                        return Ok(false);
                    }
                }
            } else {
                let app = format!("chaos-{}-w{index}", x.run_id);
                let id = log.open(FaultKind::PgPause, Target::Worker(index), format!("backends of {app}:"));
                match pg_stall::pause_backends(x.store.pool().clone(), app, d, log.clone(), id).await {
                    Ok(n) => {
                        say(format!(
                            "pg-pause: {n} backends of worker {index} SIGSTOPped for {:.1} s",
                            d.as_secs_f64()
                        ));
                        if n == 0 {
                            // The task ends the (empty) pause by itself; try again soon.
                            return Ok(false);
                        }
                        report.pg_pauses += 1;
                        report.pg_paused_backends += n as u64;
                        report.stalled_attempts += in_flight;
                    }
                    Err(e) => {
                        log.close(id);
                        say(format!("pg-pause failed: {e}"));
                        return Ok(false);
                    }
                }
            }
        }
    }
    Ok(true)
}

/// Rows `running` under a live lease (of owners starting with `owner_prefix`, when given).
async fn live_attempts(x: &FaultCtx<'_>, owner_prefix: Option<&str>) -> Result<u64, String> {
    let s = x.store.schema().as_str();
    let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {s}.jobs WHERE queue = $1 AND state = 'running' \
         AND lease_until > clock_timestamp() AND owner LIKE $2"
    )))
    .bind(x.queue.as_str().to_owned())
    .bind(format!("{}%", owner_prefix.unwrap_or("")))
    .fetch_one(x.store.pool())
    .await
    .map_err(|e| format!("live attempts: {e}"))?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// How the owner ids of worker `index` (process `pid`) begin (see `Owner::unique`).
fn owner_prefix(index: usize, pid: i32) -> String {
    format!("w{index}-{pid}-")
}

/// The worker (not paused, not already under a PostgreSQL stall) that holds running rows under
/// a live lease and was stalled the fewest times so far (then: the most rows); `None` when none
/// holds any. Taking turns keeps one worker's long jobs from being stalled again and again.
async fn pg_victim(x: &FaultCtx<'_>, fleet: &Fleet) -> Result<Option<usize>, String> {
    let s = x.store.schema().as_str();
    let owners: Vec<(Option<String>, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT owner, count(*) FROM {s}.jobs WHERE queue = $1 AND state = 'running' \
         AND lease_until > clock_timestamp() GROUP BY owner"
    )))
    .bind(x.queue.as_str().to_owned())
    .fetch_all(x.store.pool())
    .await
    .map_err(|e| format!("running rows by owner: {e}"))?;
    let timeline = x.log.snapshot();
    let mut best: Option<(usize, (usize, i64))> = None;
    for (i, w) in fleet.workers.iter().enumerate() {
        if w.stopped_until.is_some() || x.log.open_on(w.index, &[FaultKind::PgLock, FaultKind::PgPause]) {
            continue;
        }
        let prefix = owner_prefix(w.index, w.pid);
        let n: i64 =
            owners.iter().filter(|(o, _)| o.as_deref().is_some_and(|o| o.starts_with(&prefix))).map(|(_, n)| n).sum();
        let stalled = timeline
            .iter()
            .filter(|r| matches!(r.kind, FaultKind::PgLock | FaultKind::PgPause) && r.target == Target::Worker(w.index))
            .count();
        // Fewest stalls first, then most rows.
        let rank = (usize::MAX - stalled, n);
        if n > 0 && best.is_none_or(|(_, r)| rank > r) {
            best = Some((i, rank));
        }
    }
    Ok(best.map(|(i, _)| i))
}

async fn install_audit(store: &PgFence) -> Result<(), String> {
    let s = store.schema().as_str();
    for stmt in [
        format!(
            "CREATE TABLE {s}.chaos_commits (queue text NOT NULL, key text NOT NULL, epoch bigint NOT NULL, \
             owner text, at timestamptz NOT NULL DEFAULT clock_timestamp())"
        ),
        format!(
            "CREATE FUNCTION {s}.chaos_audit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
             INSERT INTO {s}.chaos_commits (queue, key, epoch, owner) VALUES (NEW.queue, NEW.key, NEW.epoch, NEW.owner); \
             RETURN NULL; END $$"
        ),
        // Every UPDATE that leaves a row completed is a commit, including a second one.
        format!(
            "CREATE TRIGGER chaos_audit AFTER UPDATE ON {s}.jobs FOR EACH ROW \
             WHEN (NEW.state = 'completed') EXECUTE FUNCTION {s}.chaos_audit()"
        ),
    ] {
        sqlx::query(AssertSqlSafe(stmt)).execute(store.pool()).await.map_err(|e| format!("audit trigger: {e}"))?;
    }
    Ok(())
}

async fn drop_schema(store: &PgFence) {
    let s = store.schema().as_str();
    let _ = sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {s} CASCADE"))).execute(store.pool()).await;
}

async fn count_finished(store: &PgFence, queue: &QueueName) -> Result<usize, String> {
    let s = store.schema().as_str();
    let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {s}.jobs WHERE queue = $1 AND state IN ('completed', 'dead')"
    )))
    .bind(queue.as_str().to_owned())
    .fetch_one(store.pool())
    .await
    .map_err(|e| format!("count finished: {e}"))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

struct Row {
    state: String,
    epoch: i64,
    result: Option<Vec<u8>>,
    last_error: Option<String>,
}

async fn final_rows(store: &PgFence, queue: &QueueName) -> Result<HashMap<String, Row>, String> {
    let s = store.schema().as_str();
    type Raw = (String, String, i64, Option<Vec<u8>>, Option<String>);
    let rows: Vec<Raw> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT key, state, epoch, result, last_error FROM {s}.jobs WHERE queue = $1"
    )))
    .bind(queue.as_str().to_owned())
    .fetch_all(store.pool())
    .await
    .map_err(|e| format!("read jobs: {e}"))?;
    Ok(rows
        .into_iter()
        .map(|(key, state, epoch, result, last_error)| (key, Row { state, epoch, result, last_error }))
        .collect())
}

async fn commit_counts(store: &PgFence, queue: &QueueName) -> Result<HashMap<String, i64>, String> {
    let s = store.schema().as_str();
    let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT key, count(*) FROM {s}.chaos_commits WHERE queue = $1 GROUP BY key"
    )))
    .bind(queue.as_str().to_owned())
    .fetch_all(store.pool())
    .await
    .map_err(|e| format!("read audit: {e}"))?;
    Ok(rows.into_iter().collect())
}

// ------------------------------------------------------------------------------------------------
// The worker process
// ------------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
struct WorkerOpts {
    source: SourceKind,
    db: String,
    app: String,
    schema: String,
    queue: String,
    receiver: String,
    lease_secs: u64,
    concurrency: usize,
    batch: usize,
    work: Duration,
    slow: Duration,
    id: usize,
    sqs_queue_url: Option<String>,
    redis_url: Option<String>,
    stream: Option<String>,
    guards: Vec<String>,
}

/// A chaos worker process (started by the chaos runner): runs one consumer until SIGTERM.
#[derive(clap::Parser)]
#[command(name = "chaos --worker", help_template = "usage: {usage}\n\n{about-with-newline}\n{all-args}{after-help}")]
struct WorkerCli {
    /// table, sqs or redis
    #[arg(long, value_name = "SOURCE", default_value = "table", value_parser = SourceKind::parse)]
    source: SourceKind,
    /// PostgreSQL URL
    #[arg(long, value_name = "URL", default_value = "")]
    db: String,
    /// application_name prefix
    #[arg(long, value_name = "NAME", default_value = "chaos-w")]
    app: String,
    /// Schema of the fence tables
    #[arg(long, value_name = "NAME", default_value = "")]
    schema: String,
    /// The queue
    #[arg(long, value_name = "NAME", default_value = "")]
    queue: String,
    /// The receiver's URL
    #[arg(long, value_name = "URL", default_value = "")]
    receiver: String,
    /// Lease in seconds
    #[arg(long, value_name = "SECS", default_value_t = 3)]
    lease_secs: u64,
    /// Jobs at once
    #[arg(long, value_name = "N", default_value_t = 4)]
    concurrency: usize,
    /// Claim batch
    #[arg(long, value_name = "N", default_value_t = 10)]
    batch: usize,
    /// Milliseconds of work per job
    #[arg(long = "work-ms", value_name = "MS", default_value_t = 20)]
    work_ms: u64,
    /// Milliseconds a slow job waits
    #[arg(long = "slow-ms", value_name = "MS", default_value_t = 4000)]
    slow_ms: u64,
    /// Worker number
    #[arg(long, value_name = "N", default_value_t = 0)]
    id: usize,
    /// SQS queue URL (source sqs)
    #[arg(long, value_name = "URL")]
    sqs_queue_url: Option<String>,
    /// Redis URL (source redis)
    #[arg(long, value_name = "URL")]
    redis_url: Option<String>,
    /// Redis stream (source redis)
    #[arg(long, value_name = "KEY")]
    stream: Option<String>,
    /// Test only (the members' guard-switches, on in example builds): guards to turn off
    #[arg(long, value_name = "LIST", default_value = "")]
    guards: String,
}

fn parse_worker_args(args: &[String]) -> Result<WorkerOpts, clap::Error> {
    let c =
        <WorkerCli as clap::Parser>::try_parse_from(std::iter::once("chaos".to_owned()).chain(args.iter().cloned()))?;
    Ok(WorkerOpts {
        source: c.source,
        db: c.db,
        app: c.app,
        schema: c.schema,
        queue: c.queue,
        receiver: c.receiver,
        lease_secs: c.lease_secs,
        concurrency: c.concurrency,
        batch: c.batch,
        work: Duration::from_millis(c.work_ms),
        slow: Duration::from_millis(c.slow_ms),
        id: c.id,
        sqs_queue_url: c.sqs_queue_url,
        redis_url: c.redis_url,
        stream: c.stream,
        guards: c.guards.split(',').filter(|g| !g.is_empty()).map(str::to_owned).collect(),
    })
}

fn event(line: impl std::fmt::Display) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "EVENT {line}");
    let _ = out.flush();
}

/// The worker process: runs one consumer until SIGTERM. Returns the exit code.
pub fn worker_main(args: Vec<String>) -> i32 {
    {
        use tracing_subscriber::Layer as _;
        use tracing_subscriber::layer::SubscriberExt as _;
        use tracing_subscriber::util::SubscriberInitExt as _;
        let log = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .with_filter(tracing_subscriber::EnvFilter::from_default_env());
        // Every lost attempt, whatever RUST_LOG says, as an EVENT line for the runner.
        let losses =
            faults::LossLayer { emit: |line| event(line) }.with_filter(tracing_subscriber::filter::LevelFilter::WARN);
        let _ = tracing_subscriber::registry().with(log).with(losses).try_init();
    }
    let opts = match parse_worker_args(&args) {
        Ok(o) => o,
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("chaos worker: runtime: {e}");
            return 2;
        }
    };
    match rt.block_on(worker(opts)) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("chaos worker: {e}");
            event(format!("failed {e}"));
            1
        }
    }
}

/// What every handler shares.
struct HandlerEnv {
    client: reqwest::Client,
    receiver: String,
    work: Duration,
    slow: Duration,
}

/// The handler: decode, call the receiver with the fencing stamp, do blocking work, return the
/// result `key@epoch`. A zombie paused in the blocking work finishes it after SIGCONT and reaches
/// the fenced commit, which refuses it.
async fn handle(env: Arc<HandlerEnv>, ctx: JobContext) -> Result<Vec<u8>, JobError> {
    let body = std::str::from_utf8(ctx.payload())
        .map_err(|e| JobError::fatal(format!("undecodable payload: not UTF-8 ({e})")))?;
    let op = if body.contains("\"flaky\"") {
        "flaky"
    } else if body.contains("\"slow\"") {
        "slow"
    } else if body.contains("\"apply\"") {
        "apply"
    } else {
        return Err(JobError::fatal(format!("undecodable payload: unknown body {body:?}")));
    };
    let mut request = env.client.post(&env.receiver);
    for (name, value) in ctx.stamp().to_headers() {
        request = request.header(name, value);
    }
    let response = request.body(ctx.key().as_str().to_owned()).send().await.map_err(JobError::retry)?;
    match response.status().as_u16() {
        200 => {}
        409 => return Err(JobError::retry(format!("receiver refused epoch {} as stale", ctx.epoch()))),
        other => return Err(JobError::retry(format!("receiver answered {other}"))),
    }
    if op == "flaky" && ctx.lease().attempts == 1 {
        return Err(JobError::retry("flaky: first attempt fails on purpose"));
    }
    if op == "slow" {
        // Longer than the lease, and cancellable: the attempt lives only while its heartbeats
        // confirm the lease, so a stall that costs it the lease shows up as a lost attempt.
        tokio::time::sleep(env.slow).await;
    }
    event(format!("compute key={} epoch={}", ctx.key(), ctx.epoch()));
    let work = env.work;
    let stamp = ctx.stamp();
    // Blocking work, then a blocking call: no await point inside, so nothing stops it once it
    // started. A zombie paused in here finishes it after SIGCONT: its call reaches the receiver
    // (refused, or accepted and then superseded) and its commit is refused by the fence.
    let status = tokio::task::block_in_place(|| {
        std::thread::sleep(work);
        blocking_call(&env.receiver, &stamp)
    });
    event(format!("computed key={} epoch={}", ctx.key(), ctx.epoch()));
    match status {
        Ok(200) => Ok(format!("{}@{}", ctx.key(), ctx.epoch()).into_bytes()),
        Ok(409) => Err(JobError::retry(format!("receiver refused epoch {} as stale", ctx.epoch()))),
        Ok(other) => Err(JobError::retry(format!("receiver answered {other}"))),
        Err(e) => Err(JobError::retry(format!("receiver unreachable: {e}"))),
    }
}

/// A plain blocking HTTP/1.1 POST of the stamp; returns the status code.
fn blocking_call(url: &str, stamp: &FenceStamp) -> std::io::Result<u16> {
    use std::io::{BufRead, Write};
    let invalid = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, m.to_owned());
    let rest = url.strip_prefix("http://").ok_or_else(|| invalid("receiver URL must be http://"))?;
    let (host, path) = rest.split_once('/').map(|(h, p)| (h, format!("/{p}"))).unwrap_or((rest, "/".into()));
    let mut stream = std::net::TcpStream::connect(host)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut request = format!("POST {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: 0\r\n");
    for (name, value) in stamp.to_headers() {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes())?;
    let mut status = String::new();
    std::io::BufReader::new(stream).read_line(&mut status)?;
    status.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| invalid("no HTTP status line"))
}

async fn worker(o: WorkerOpts) -> Result<(), String> {
    let options: sqlx::postgres::PgConnectOptions = o.db.parse().map_err(|e: sqlx::Error| e.to_string())?;
    let store = PgFence::connect_with(options.application_name(&format!("{}{}", o.app, o.id)))
        .await
        .map_err(|e| e.to_string())?
        .with_schema(SchemaName::new(o.schema.clone()).map_err(|e| e.to_string())?);
    // The harness stalls the same long jobs again and again (a PostgreSQL stall picks the rows its
    // victim runs, and a slow job is nearly always running), far beyond any production rate:
    // neither failures nor takeovers may bury a job here, so both caps are out of reach. The
    // claims cap itself is tested in tests/edges_store.rs.
    let retry = RetryPolicy {
        max_attempts: 1000,
        base_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_secs(1),
    };
    let store = store.with_max_claims(retry.max_claims());
    let store: Arc<dyn FenceStore> = Arc::new(without_guards(store, &o.guards)?);
    let queue = QueueName::new(o.queue.clone()).map_err(|e| e.to_string())?;
    let lease = LeaseDuration::from_secs(o.lease_secs).map_err(|e| e.to_string())?;
    let config = ConsumerConfig::new(SupervisorConfig::new(lease).retry(retry))
        .concurrency(o.concurrency)
        .batch(o.batch)
        .grace(Duration::from_secs(2));
    let env = Arc::new(HandlerEnv {
        client: reqwest::Client::builder().timeout(Duration::from_secs(5)).build().map_err(|e| e.to_string())?,
        receiver: o.receiver.clone(),
        work: o.work,
        slow: o.slow,
    });
    let owner = Owner::unique(&format!("w{}", o.id));
    event(format!("ready pid={} owner={owner}", std::process::id()));
    match o.source {
        SourceKind::Table => {
            let source =
                brokerfence::table::TableQueue::new(Arc::clone(&store), queue).idle_wait(Duration::from_millis(50));
            consume(source, store, owner, config, env).await
        }
        #[cfg(feature = "sqs")]
        SourceKind::Sqs => {
            let source = sqs_chaos::worker_source(&o, queue).await?;
            consume(source, store, owner, config, env).await
        }
        #[cfg(feature = "redis")]
        SourceKind::Redis => {
            let source = redis_chaos::worker_source(&o, queue).await?;
            consume(source, store, owner, config, env).await
        }
        #[allow(unreachable_patterns)]
        other => Err(format!("source {} not compiled in", other.name())),
    }
}

fn without_guards(store: PgFence, names: &[String]) -> Result<PgFence, String> {
    let mut guards = brokerfence::fence::Guards::default();
    for name in names {
        guards = match name.as_str() {
            "no-epoch-increment" => guards.without_epoch_increment(),
            "no-commit-cas" => guards.without_commit_cas(),
            "no-heartbeat-cas" => guards.without_heartbeat_cas(),
            other => return Err(format!("unknown guard switch {other}")),
        };
    }
    Ok(store.with_guards(guards))
}

async fn consume<S: Source>(
    source: S,
    store: Arc<dyn FenceStore>,
    owner: Owner,
    config: ConsumerConfig,
    env: Arc<HandlerEnv>,
) -> Result<(), String> {
    let consumer = Consumer::with_owner(source, store, owner, config);
    let metrics = consumer.metrics();
    let reporter = tokio::spawn({
        let metrics = Arc::clone(&metrics);
        async move {
            let mut last = None;
            loop {
                let now = metrics.snapshot();
                if last != Some(now) {
                    event(format!("metrics {now}"));
                    last = Some(now);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    });
    let handler = move |ctx: JobContext| handle(Arc::clone(&env), ctx);
    let result = consumer.run(handler, shutdown_signal()).await;
    reporter.abort();
    event(format!("metrics {}", metrics.snapshot()));
    event("stopped");
    result.map_err(|e| e.to_string())
}

// ------------------------------------------------------------------------------------------------
// SQS (feature `sqs`)
// ------------------------------------------------------------------------------------------------

#[cfg(feature = "sqs")]
mod sqs_chaos {
    use super::*;
    use brokerfence::adapters::sqs::aws_sdk_sqs::Client;
    use brokerfence::adapters::sqs::aws_sdk_sqs::error::{DisplayErrorContext, SdkError};
    use brokerfence::adapters::sqs::aws_sdk_sqs::types::{
        MessageAttributeValue, QueueAttributeName, SendMessageBatchRequestEntry,
    };
    use brokerfence::adapters::sqs::{KeyStrategy, SqsConfig, SqsSource, aws_config, client_from_env, http_client};

    /// The message attribute that carries the job key.
    pub const KEY_ATTRIBUTE: &str = "job-key";

    /// The AWS settings of `localstack/up` (or the environment), for the runner and its workers.
    pub fn aws_env() -> Vec<(String, String)> {
        ["AWS_ENDPOINT_URL_SQS", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
            .iter()
            .filter_map(|n| brokerfence_testkit::services::var(n).map(|v| ((*n).to_owned(), v)))
            .collect()
    }

    /// `host:port` of a plain-HTTP SQS endpoint on this machine (LocalStack), for the stall
    /// proxy.
    pub fn endpoint_host_port() -> Option<String> {
        let url = aws_env().into_iter().find(|(k, _)| k == "AWS_ENDPOINT_URL_SQS")?.1;
        let rest = url.strip_prefix("http://")?;
        let host_port = rest.split('/').next()?;
        let host = host_port.rsplit_once(':').map(|(h, _)| h).unwrap_or(host_port);
        matches!(host, "127.0.0.1" | "localhost").then(|| host_port.to_owned())
    }

    async fn client() -> Client {
        let env: HashMap<String, String> = aws_env().into_iter().collect();
        let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest()).http_client(http_client());
        if let Some(endpoint) = env.get("AWS_ENDPOINT_URL_SQS") {
            loader = loader.endpoint_url(endpoint);
        }
        if let Some(region) = env.get("AWS_REGION") {
            loader = loader.region(aws_config::Region::new(region.clone()));
        }
        if let (Some(id), Some(secret)) = (env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")) {
            let creds =
                brokerfence::adapters::sqs::aws_sdk_sqs::config::Credentials::new(id, secret, None, None, "chaos");
            loader = loader.credentials_provider(creds);
        }
        Client::new(&loader.load().await)
    }

    fn err<E, R>(what: &'static str) -> impl FnOnce(SdkError<E, R>) -> String
    where
        SdkError<E, R>: std::error::Error + 'static,
    {
        move |e| format!("{what}: {} (is LocalStack up? run `bash localstack/up`)", DisplayErrorContext(e))
    }

    pub struct SqsBroker {
        client: Client,
        url: String,
        dlq: String,
    }

    impl SqsBroker {
        pub async fn setup(c: &ChaosConfig, queue: &QueueName, jobs: &[(String, Kind)]) -> Result<Self, String> {
            let client = client().await;
            let dlq = client
                .create_queue()
                .queue_name(format!("{}-dlq", queue.as_str()))
                .send()
                .await
                .map_err(err("CreateQueue (dlq)"))?
                .queue_url()
                .ok_or("no dlq url")?
                .to_owned();
            let arn = client
                .get_queue_attributes()
                .queue_url(&dlq)
                .attribute_names(QueueAttributeName::QueueArn)
                .send()
                .await
                .map_err(err("GetQueueAttributes"))?
                .attributes()
                .and_then(|a| a.get(&QueueAttributeName::QueueArn).cloned())
                .ok_or("the dlq has no ARN")?;
            let url = client
                .create_queue()
                .queue_name(queue.as_str())
                .attributes(QueueAttributeName::VisibilityTimeout, c.lease_secs.to_string())
                .attributes(
                    QueueAttributeName::RedrivePolicy,
                    format!("{{\"deadLetterTargetArn\":\"{arn}\",\"maxReceiveCount\":\"1000\"}}"),
                )
                .send()
                .await
                .map_err(err("CreateQueue"))?
                .queue_url()
                .ok_or("no queue url")?
                .to_owned();
            for chunk in jobs.chunks(10) {
                let entries = chunk
                    .iter()
                    .enumerate()
                    .map(|(i, (key, kind))| {
                        let body = match kind {
                            // SQS bodies must be text: an undecodable one is simply not JSON.
                            Kind::Poison => "{poison".to_owned(),
                            other => String::from_utf8_lossy(payload_of(*other)).into_owned(),
                        };
                        let attr = MessageAttributeValue::builder()
                            .data_type("String")
                            .string_value(key)
                            .build()
                            .map_err(|e| e.to_string())?;
                        SendMessageBatchRequestEntry::builder()
                            .id(format!("m{i}"))
                            .message_body(body)
                            .message_attributes(KEY_ATTRIBUTE, attr)
                            .build()
                            .map_err(|e| e.to_string())
                    })
                    .collect::<Result<Vec<_>, String>>()?;
                let out = client
                    .send_message_batch()
                    .queue_url(&url)
                    .set_entries(Some(entries))
                    .send()
                    .await
                    .map_err(err("SendMessageBatch"))?;
                if !out.failed().is_empty() {
                    return Err(format!("SendMessageBatch refused {} entries", out.failed().len()));
                }
            }
            Ok(Self { client, url, dlq })
        }

        pub fn worker_args(&self) -> Vec<String> {
            vec!["--sqs-queue-url".into(), self.url.clone()]
        }

        /// Poison jobs found in the dead-letter queue (by the key attribute the copy keeps).
        pub async fn dead_letters(&self, poison: &HashSet<String>) -> Result<usize, String> {
            let mut found = HashSet::new();
            let mut empty = 0;
            while empty < 2 {
                let out = self
                    .client
                    .receive_message()
                    .queue_url(&self.dlq)
                    .max_number_of_messages(10)
                    .wait_time_seconds(1)
                    .visibility_timeout(60)
                    .message_attribute_names("All")
                    .send()
                    .await
                    .map_err(|e| format!("ReceiveMessage (dlq): {e}"))?;
                let messages = out.messages();
                if messages.is_empty() {
                    empty += 1;
                }
                for m in messages {
                    let key = m
                        .message_attributes()
                        .and_then(|a| a.get(KEY_ATTRIBUTE))
                        .and_then(|v| v.string_value())
                        .unwrap_or_default();
                    if poison.contains(key) {
                        found.insert(key.to_owned());
                    }
                }
            }
            Ok(found.len())
        }

        pub async fn cleanup(self) {
            for url in [&self.url, &self.dlq] {
                let _ = self.client.delete_queue().queue_url(url).send().await;
            }
        }
    }

    pub async fn worker_source(o: &WorkerOpts, _queue: QueueName) -> Result<SqsSource, String> {
        let url = o.sqs_queue_url.clone().ok_or("--sqs-queue-url is required for --source sqs")?;
        let config = SqsConfig::new(url)
            .map_err(|e| e.to_string())?
            .key(KeyStrategy::attribute(KEY_ATTRIBUTE))
            .wait_time(Duration::from_secs(1));
        Ok(SqsSource::new(client_from_env().await, config))
    }
}

// ------------------------------------------------------------------------------------------------
// Redis (feature `redis`)
// ------------------------------------------------------------------------------------------------

#[cfg(feature = "redis")]
mod redis_chaos {
    use super::*;
    use brokerfence::adapters::redis::client as redis;
    use brokerfence::adapters::redis::{KeyFrom, RedisConnections, StreamSource};

    /// A redis-server of this run alone, on a free port, persisting every write (AOF, fsync
    /// always) so that a restart loses nothing it acknowledged. Never the shared one on 6379.
    pub struct RedisBroker {
        port: u16,
        dir: PathBuf,
        child: Option<tokio::process::Child>,
        stream: String,
    }

    impl RedisBroker {
        pub async fn setup(_c: &ChaosConfig, queue: &QueueName, jobs: &[(String, Kind)]) -> Result<Self, String> {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| format!("free port: {e}"))?
                .port();
            let dir = std::env::temp_dir().join(format!("brokerfence-chaos-redis-{port}-{:x}", rand::random::<u32>()));
            std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
            let mut broker = Self { port, dir, child: None, stream: queue.as_str().to_owned() };
            broker.spawn().await?;
            let client = redis::Client::open(broker.url().as_str()).map_err(|e| e.to_string())?;
            let mut conn = client.get_multiplexed_async_connection().await.map_err(|e| e.to_string())?;
            for chunk in jobs.chunks(500) {
                let mut pipe = redis::pipe();
                for (key, kind) in chunk {
                    pipe.cmd("XADD")
                        .arg(&broker.stream)
                        .arg("*")
                        .arg("key")
                        .arg(key)
                        .arg("body")
                        .arg(payload_of(*kind))
                        .ignore();
                }
                pipe.query_async::<()>(&mut conn).await.map_err(|e| format!("XADD: {e}"))?;
            }
            Ok(broker)
        }

        pub fn url(&self) -> String {
            format!("redis://127.0.0.1:{}", self.port)
        }

        async fn spawn(&mut self) -> Result<(), String> {
            let child = tokio::process::Command::new("redis-server")
                .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", ""])
                .args(["--appendonly", "yes", "--appendfsync", "always", "--daemonize", "no", "--loglevel", "warning"])
                .arg("--dir")
                .arg(&self.dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| format!("spawn redis-server (run `bash localstack/up` to install it): {e}"))?;
            self.child = Some(child);
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let ping = async {
                    let client = redis::Client::open(self.url().as_str()).ok()?;
                    let mut c = client.get_multiplexed_async_connection().await.ok()?;
                    redis::cmd("PING").query_async::<String>(&mut c).await.ok()
                };
                if ping.await.as_deref() == Some("PONG") {
                    return Ok(());
                }
                if Instant::now() > deadline {
                    return Err(format!("private redis-server on port {} did not answer", self.port));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }

        /// SIGKILL and start again on the same port and data: connections drop, lease keys that
        /// were not yet written survive only as far as the AOF has them.
        pub async fn restart(&mut self) -> Result<(), String> {
            if let Some(mut child) = self.child.take() {
                let _ = child.start_kill();
                let _ = child.wait().await;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
            self.spawn().await
        }

        pub fn port(&self) -> u16 {
            self.port
        }

        /// With `via`, the workers connect to that URL (the stall proxy) instead.
        pub fn worker_args(&self, via: Option<String>) -> Vec<String> {
            vec!["--redis-url".into(), via.unwrap_or_else(|| self.url()), "--stream".into(), self.stream.clone()]
        }

        /// Poison jobs found in the dead-letter stream (by the `key` field the copy keeps).
        pub async fn dead_letters(&self, poison: &HashSet<String>) -> Result<usize, String> {
            let client = redis::Client::open(self.url().as_str()).map_err(|e| e.to_string())?;
            let mut conn = client.get_multiplexed_async_connection().await.map_err(|e| e.to_string())?;
            let dead = brokerfence::adapters::redis::sibling_key(&self.stream, ":dead");
            type Entries = Vec<(String, Vec<(Vec<u8>, Vec<u8>)>)>;
            let entries: Entries = redis::cmd("XRANGE")
                .arg(&dead)
                .arg("-")
                .arg("+")
                .query_async(&mut conn)
                .await
                .map_err(|e| e.to_string())?;
            let found: HashSet<String> = entries
                .iter()
                .filter_map(|(_, fields)| {
                    fields.iter().find(|(k, _)| k == b"key").map(|(_, v)| String::from_utf8_lossy(v).into_owned())
                })
                .filter(|k| poison.contains(k))
                .collect();
            Ok(found.len())
        }

        pub async fn cleanup(mut self) {
            if let Some(mut child) = self.child.take() {
                let _ = child.start_kill();
                let _ = child.wait().await;
            }
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    pub async fn worker_source(o: &WorkerOpts, queue: QueueName) -> Result<StreamSource, String> {
        let url = o.redis_url.clone().ok_or("--redis-url is required for --source redis")?;
        let stream = o.stream.clone().ok_or("--stream is required for --source redis")?;
        let conns = RedisConnections::connect(&url).await.map_err(|e| e.to_string())?;
        Ok(StreamSource::new(conns, queue, stream, "chaos")
            .map_err(|e| e.to_string())?
            .key_from(KeyFrom::Field("key".into()))
            .block(Duration::from_millis(500))
            .max_deliveries(1000))
    }
}
