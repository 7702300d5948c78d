//! The chaos run: N worker OS processes drain M jobs while the runner injects faults. An
//! independent HTTP receiver in the runner records every call the workers make; at the end the
//! runner checks:
//!
//! | figure | must be |
//! |---|---|
//! | jobs lost (not finished, or committed without their receiver effect) | 0 |
//! | results committed twice (an audit trigger records every commit) | 0 |
//! | receiver accepts of an epoch lower than one it already accepted | 0 |
//! | fencing tokens handed out twice: a (job, epoch) that reached the receiver from two owners (accepted or refused) | 0 |
//! | healthy cancellations: attempts whose lease was lost while the database was reachable for their worker and the worker was running (see [`faults`] for the exact rule) | 0 |
//! | lost attempts the workers reported vs. their `lease_losses` counters | equal |
//! | zombie commits rejected (`Fenced`) | ≥ 1 when `sigstop` is injected (the pauses really happened) |
//! | jobs completed or dead-lettered | all of them |
//! | failovers | 1 when `pg-failover` is selected (table queue) |
//! | Redis failovers | 1 when `redis-failover` is selected (Redis source on a cluster) |
//!
//! Besides, the report counts the receiver's `Conflict` verdicts (the same epoch from another
//! owner, refused), and after a failover: the jobs re-run after it (their receiver calls span
//! timelines 1 and 2: work lost with the old primary, or cut short by it, and done again), the
//! commits lost with the old primary, and how long it took (cut to re-point, promotion to the
//! first commit on the promoted standby and to the receiver's first timeline-2 accept).
//!
//! The faults (`--faults`, comma-separated; default `classic` = the first four):
//!
//! | fault | what the runner does |
//! |---|---|
//! | `sigstop` | SIGSTOP a worker for lease + 1.2–2.5 s, then SIGCONT (it comes back a zombie) |
//! | `pg-terminate` | `pg_terminate_backend` on the connections of one worker or of all (behind PgBouncer: all its server connections) |
//! | `sigkill` | SIGKILL a worker and start it again |
//! | `redis-restart` | kill and restart the run's private redis-server (Redis on one server only: a cluster's nodes keep nothing on disk) |
//! | `broker-stall` | a TCP proxy between the workers and the broker (LocalStack, or the private redis-server) holds every byte, both directions, for `--stall-ms` (default lease + 2 s); not applicable to the table queue, which has no broker, nor to a Redis Cluster, whose clients connect to the addresses its nodes announce (the report says so) |
//! | `pg-lock` | a runner transaction holds `FOR UPDATE` locks on the rows one worker is running, for `--stall-ms` |
//! | `pg-pause` | the idle PostgreSQL backends of one worker (by `application_name`; behind PgBouncer, of every worker) are SIGSTOPped for `--stall-ms` |
//! | `pg-failover` | table queue only, once per run (after the first round of the others, at about a quarter of the jobs finished; at half of them whatever the round), the other faults waiting while it is under way: the replication link of a private primary/standby pair is cut, the primary works alone for `--failover-alone-ms` (default 3000), is killed, the standby is promoted and the VIP re-pointed to it (its connections dropped); see [`failover`] |
//!
//! | `redis-failover` | Redis source on a cluster only (`--redis-topology cluster`), once per run, when `pg-failover` would come: replication from the stream's primary to its replica is cut (the replica's replication credentials made wrong, its link dropped), the primary works alone for `--failover-alone-ms`, is killed, and the replica takes its slots over (`CLUSTER FAILOVER TAKEOVER`); the workers' cluster clients follow the slot map. Afterwards the run waits (up to four leases) until the group holds nothing unacknowledged; see `redis_failover.rs` |
//!
//! `pg-stall` names both PostgreSQL stalls, `all` every fault (for the table queue, the failover
//! too). The broker and PostgreSQL
//! servers themselves are never paused or restarted (LocalStack, PostgreSQL and the Redis on 6379
//! are shared); the Redis restart uses a private redis-server, and the failover private
//! PostgreSQL servers.
//!
//! With `pg-failover` the jobs do not live in the shared PostgreSQL: the runner starts a primary
//! with a streaming standby (asynchronous; `--failover-sync` for a synchronous one), a VIP (a TCP
//! relay) in front of the primary and PgBouncer in transaction mode in front of the VIP
//! (`brokerfence_testkit::pg_topology`; PostgreSQL's server programs and pgbouncer come from
//! `bash localstack/up`). The workers connect through PgBouncer, the runner (migrations, jobs,
//! the audit trigger, faults, final checks) through the VIP; the receiver's ledger stays on the
//! shared server (`DATABASE_URL`), in a schema of its own, so that the failover cannot lose it.
//! The audit trigger lives with the jobs, so "committed twice" counts the commits that survived
//! on the promoted standby. Behind PgBouncer the server connections are shared by all workers:
//! `pg-terminate` cuts all of them (every client backend but the runner's) and `pg-pause` pauses
//! the idle ones of every worker, each excusing every worker.
//!
//! ```text
//! cargo build -p brokerfence-bench --all-features   # builds target/debug/chaos
//! target/debug/chaos --source table --workers 8 --jobs 5000
//! target/debug/chaos --source sqs --workers 4 --jobs 600 --faults all --slow-every 5
//! target/debug/chaos --source redis --workers 4 --jobs 1000 --faults all --slow-every 5
//! target/debug/chaos --source table --workers 3 --jobs 400 --faults pg-failover,sigstop,sigkill,pg-terminate
//! target/debug/chaos --source table --jobs 400 --faults pg-failover --failover-sync --failover-alone-ms 5000
//! target/debug/chaos --source redis --redis-topology cluster --workers 3 --jobs 200 --concurrency 2 --batch 4 \
//!     --work-ms 100 --faults sigstop,sigkill,redis-failover --failover-alone-ms 2000
//! ```
//!
//! With `--redis-topology cluster` the Redis source reads a private Redis Cluster of 3 primaries
//! with a replica each (`brokerfence_testkit::redis_topology::RedisCluster`, nothing on disk):
//! the workers get its `redis+cluster://` seed URL, and the stream (one slot, so one primary)
//! lives wherever its name hashes.
//!
//! Options: `--source table|sqs|redis`, `--workers N`, `--jobs M`, `--concurrency C` (per worker),
//! `--batch B`, `--work-ms W` (blocking work per job: a zombie paused inside it reaches its commit
//! after it resumes), `--lease-secs L` (≥ 3), `--fault-every-ms F`, `--deadline-secs D`,
//! `--poison-every P` (every P-th job is undecodable and must be dead-lettered; 0 = none),
//! `--flaky-every K` (every K-th job fails its first attempt), `--slow-every S` and `--slow-ms T`
//! (every S-th job also waits T ms, cancellably, so it needs heartbeats: default twice the
//! lease; a stall only bites attempts in flight with more than a lease still to go), `--faults LIST`, `--stall-ms D`, `--seed S`,
//! `--max-faults N` (stop injecting after N; the failover comes all the same), `--failover-sync`,
//! `--failover-alone-ms MS`, `--redis-topology single|cluster`, `--guards LIST` (test only: e.g. `no-timeline-epochs`), `--keep-logs`, `--quiet`.
//! PostgreSQL comes from `DATABASE_URL` (else `localstack/.env`), SQS from the AWS environment,
//! Redis is a private `redis-server` the runner starts on a free port (never the shared one).
//! Exit code 0 when every invariant holds, 1 when one is violated, 2 on a setup error.
//!
//! `tests/processes/fault_runs.rs` runs small instances in CI; the worker processes are that test binary
//! re-executed in worker mode (see [`Launcher`]), so no harness binary must be built.
#![allow(dead_code)] // the `chaos` program and tests/processes/fault_runs.rs each use a subset

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use brokerfence::ledger::{PgLedger, Verdict};
use brokerfence::wire::FenceStamp;
use brokerfence::{Consumer, ConsumerConfig, Source, shutdown_signal};
use brokerfence::{
    FenceStore, JobContext, JobError, LeaseDuration, Owner, PgFence, QueueName, RetryPolicy, SchemaName,
    SupervisorConfig,
};
use rand::{Rng, SeedableRng};
use sqlx::AssertSqlSafe;
use tokio::io::{AsyncBufReadExt, BufReader};

use crate::args::{Common, HELP_TEMPLATE, Load, at_least_one};

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

mod broker;
mod config;
pub mod failover;
mod fleet;
mod inject;
mod receiver;
#[cfg(feature = "redis")]
mod redis_chaos;
#[cfg(feature = "redis")]
mod redis_failover;
mod report;
mod run;
#[cfg(feature = "sqs")]
mod sqs_chaos;
mod worker;

use broker::*;
pub use config::*;
use fleet::*;
use inject::*;
use receiver::*;
pub use report::*;
pub use run::*;
pub use worker::*;
