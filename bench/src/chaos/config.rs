//! The chaos run's configuration: which source, how many workers and jobs, which faults, and how
//! the runner starts worker processes ([`Launcher`]); the runner's command line.

use super::*;

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

/// Which Redis the Redis source reads (`--redis-topology`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RedisTopology {
    /// One private redis-server, persisting every write (AOF, fsync always).
    Single,
    /// A private Redis Cluster of 3 primaries with a replica each
    /// (`brokerfence_testkit::redis_topology::RedisCluster`); the workers get its
    /// `redis+cluster://` seed URL.
    Cluster,
}

impl RedisTopology {
    /// Parses `single` or `cluster`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "single" => Ok(RedisTopology::Single),
            "cluster" => Ok(RedisTopology::Cluster),
            other => Err(format!("unknown Redis topology {other:?} (single|cluster)")),
        }
    }

    /// The name.
    pub fn name(self) -> &'static str {
        match self {
            RedisTopology::Single => "single",
            RedisTopology::Cluster => "cluster",
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
    /// This very executable, with `--worker ARGS` (the `chaos` binary).
    pub fn this_example() -> Result<Self, String> {
        let exe = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
        Ok(Self { exe, args: Vec::new(), via_env: false })
    }

    pub(crate) fn command(&self, worker_args: &[String]) -> tokio::process::Command {
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
    /// `pg-failover`: a synchronous standby (`synchronous_standby_names`) instead of an
    /// asynchronous one.
    pub failover_sync: bool,
    /// `pg-failover`, `redis-failover`: how long the primary works alone (replication cut)
    /// before it dies.
    pub failover_alone: Duration,
    /// The Redis source's topology (ignored by the other sources).
    pub redis_topology: RedisTopology,
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
            failover_sync: false,
            failover_alone: Duration::from_millis(3000),
            redis_topology: RedisTopology::Single,
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

    /// A small instance with a failover (table queue through PgBouncer): `pg-failover` after a
    /// first round of `sigstop`, `pg-terminate` and `sigkill` at short steps, on jobs that take
    /// about 100 ms each, so that many are claimed and finished by the primary while it is alone
    /// (and lost with it).
    pub fn failover(database_url: String, launcher: Launcher) -> Self {
        Self {
            workers: 3,
            jobs: 240,
            concurrency: 2,
            batch: 4,
            work: Duration::from_millis(100),
            lease_secs: 5,
            fault_every: Duration::from_millis(800),
            deadline: Duration::from_secs(50),
            poison_every: 40,
            flaky_every: 17,
            faults: vec![FaultKind::SigStop, FaultKind::SigKill, FaultKind::PgTerminate, FaultKind::PgFailover],
            verbose: false,
            ..Self::new(SourceKind::Table, database_url, launcher)
        }
    }

    /// A small instance of the Redis source on a Redis Cluster (3 primaries, a replica each)
    /// whose stream's primary fails over (`redis-failover`) after a first round of `sigstop` and
    /// `sigkill`: the primary works alone for 2 s, on jobs of about 100 ms, so that the group's
    /// reads and acks of that time are lost with it. About 30 s here.
    pub fn redis_cluster_failover(database_url: String, launcher: Launcher) -> Self {
        Self {
            workers: 3,
            jobs: 200,
            concurrency: 2,
            batch: 4,
            work: Duration::from_millis(100),
            fault_every: Duration::from_millis(800),
            deadline: Duration::from_secs(60),
            poison_every: 40,
            flaky_every: 17,
            faults: vec![FaultKind::SigStop, FaultKind::SigKill, FaultKind::RedisFailover],
            failover_alone: Duration::from_millis(2000),
            redis_topology: RedisTopology::Cluster,
            verbose: false,
            ..Self::new(SourceKind::Redis, database_url, launcher)
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
#[command(name = "chaos", help_template = HELP_TEMPLATE)]
pub(crate) struct RunnerCli {
    /// table, sqs or redis
    #[arg(long, value_name = "SOURCE", value_parser = SourceKind::parse)]
    pub(crate) source: Option<SourceKind>,
    /// Worker processes at once
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    pub(crate) workers: Option<usize>,
    /// Jobs
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    pub(crate) jobs: Option<usize>,
    /// Lease in seconds
    #[arg(long, value_name = "SECS")]
    pub(crate) lease_secs: Option<u64>,
    /// Milliseconds between faults (at least 100)
    #[arg(long = "fault-every-ms", value_name = "MS")]
    pub(crate) fault_every_ms: Option<u64>,
    /// Seconds the run may take
    #[arg(long, value_name = "SECS")]
    pub(crate) deadline_secs: Option<u64>,
    /// Every Nth job is poison (0: none)
    #[arg(long, value_name = "N")]
    pub(crate) poison_every: Option<usize>,
    /// Every Nth job fails its first attempt (0: none)
    #[arg(long, value_name = "N")]
    pub(crate) flaky_every: Option<usize>,
    /// Every Nth job is slow (0: none)
    #[arg(long, value_name = "N")]
    pub(crate) slow_every: Option<usize>,
    /// Milliseconds a slow job waits [default: twice the lease]
    #[arg(long = "slow-ms", value_name = "MS")]
    pub(crate) slow_ms: Option<u64>,
    /// Faults to inject, comma separated
    #[arg(long, value_name = "LIST")]
    pub(crate) faults: Option<String>,
    /// Milliseconds a stall lasts [default: lease + 2 s]
    #[arg(long = "stall-ms", value_name = "MS")]
    pub(crate) stall_ms: Option<u64>,
    /// Most faults to inject
    #[arg(long, value_name = "N")]
    pub(crate) max_faults: Option<usize>,
    /// pg-failover: a synchronous standby (default: asynchronous)
    #[arg(long)]
    pub(crate) failover_sync: bool,
    /// pg-failover, redis-failover: milliseconds the primary works alone before it dies [default: 3000]
    #[arg(long = "failover-alone-ms", value_name = "MS")]
    pub(crate) failover_alone_ms: Option<u64>,
    /// The redis source's Redis: single (a private server) or cluster (3 primaries, a replica each) [default: single]
    #[arg(long, value_name = "TOPOLOGY", value_parser = RedisTopology::parse)]
    pub(crate) redis_topology: Option<RedisTopology>,
    /// Random seed
    #[arg(long, value_name = "N")]
    pub(crate) seed: Option<u64>,
    /// Test only (the members' guard-switches, on in the harness build): guards the workers turn off
    #[arg(long, value_name = "LIST")]
    pub(crate) guards: Option<String>,
    /// Keep the workers' logs
    #[arg(long)]
    pub(crate) keep_logs: bool,
    /// Less output
    #[arg(long)]
    pub(crate) quiet: bool,
    /// `--database-url`, `--concurrency` (per worker).
    #[command(flatten)]
    pub(crate) common: Common,
    /// `--batch` (per worker), `--work-ms`.
    #[command(flatten)]
    pub(crate) load: Load,
}

/// Why the runner's command line was not run: clap's answer (help or a usage error), or a
/// setting that is missing or wrong.
pub(crate) enum RunnerArgsError {
    Cli(clap::Error),
    Setup(String),
}

impl From<String> for RunnerArgsError {
    fn from(e: String) -> Self {
        RunnerArgsError::Setup(e)
    }
}

pub(crate) fn parse_runner_args(args: &[String]) -> Result<ChaosConfig, RunnerArgsError> {
    let cli: RunnerCli = crate::args::parse_from(std::iter::once("chaos".to_owned()).chain(args.iter().cloned()), &[])
        .map_err(RunnerArgsError::Cli)?;
    let database_url = cli.common.database_url()?;
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
    if let Some(v) = cli.common.concurrency {
        c.concurrency = v;
    }
    if let Some(v) = cli.load.batch {
        c.batch = v;
    }
    if let Some(v) = cli.load.work_ms {
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
    c.failover_sync = cli.failover_sync;
    if let Some(v) = cli.failover_alone_ms {
        c.failover_alone = Duration::from_millis(v);
    }
    if let Some(v) = cli.redis_topology {
        c.redis_topology = v;
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

pub(crate) fn runner_main(args: Vec<String>) -> i32 {
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
