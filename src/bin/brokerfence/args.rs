//! The command line: global options, commands, and the parsers of their values.

use std::time::Duration;

use brokerfence::{JobKey, QueueName, SchemaName};
use clap::{Parser, Subcommand};

const EXIT_CODES: &str = "Exit codes: 0 done, 1 failed, 2 bad command line or database URL, \
3 not found (job: no such job; dead requeue: a key named was not dead).";

/// Operator commands for brokerfence's fence tables (PostgreSQL or SQLite): migrations, queue
/// status, one job, dead letters and their fenced requeue, pruning. Times are the database clock's.
#[derive(Parser)]
#[command(name = "brokerfence", version, after_help = EXIT_CODES)]
pub(crate) struct Cli {
    /// Database URL: postgres://… or postgresql://… (PostgreSQL), sqlite:PATH (SQLite)
    #[arg(long, global = true, env = "DATABASE_URL", hide_env_values = true, value_name = "URL")]
    pub(crate) database_url: Option<String>,
    /// Schema (PostgreSQL) or table prefix (SQLite) of the fence's tables
    #[arg(long, global = true, default_value = brokerfence::DEFAULT_SCHEMA, value_parser = schema_name)]
    pub(crate) schema: SchemaName,
    /// Print one JSON document on stdout instead of text
    #[arg(long, global = true)]
    pub(crate) json: bool,
    /// Time limit of each database call (e.g. 30s, 2m)
    #[arg(long, global = true, default_value = "30s", value_parser = age, value_name = "AGE")]
    pub(crate) timeout: Duration,
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Apply the fence's migrations (idempotent; a deploy step of its own)
    Migrate,
    /// Jobs per state, expired leases, the oldest running job and leases about to end, per queue
    Status {
        /// Only this queue
        #[arg(long, value_parser = queue_name)]
        queue: Option<QueueName>,
        /// List leases that end within this window (or have ended)
        #[arg(long, default_value = "10s", value_parser = age, value_name = "AGE")]
        expiring_within: Duration,
        /// At most this many such leases per queue
        #[arg(long, default_value_t = 10)]
        limit: u32,
    },
    /// One job: state, epoch, owner, attempts, lease left, last error; its payload, progress
    /// and result, escaped, each cut at 200 bytes
    Job {
        /// Queue
        #[arg(value_parser = queue_name)]
        queue: QueueName,
        /// Job key
        #[arg(value_parser = job_key)]
        key: JobKey,
        /// Show the payload, progress and result whole
        #[arg(long)]
        full: bool,
    },
    /// Dead letters
    #[command(subcommand)]
    Dead(Dead),
    /// Serve the operators' web dashboard: queues, jobs in flight, fence events, dead letters
    #[cfg(feature = "web")]
    Serve(crate::web::ServeArgs),
    /// Delete completed and dead jobs older than their age (and ledger rows), in bounded batches
    Prune {
        /// Queue to prune (repeat for several; default: every queue that has jobs)
        #[arg(long = "queue", value_parser = queue_name)]
        queues: Vec<QueueName>,
        /// Age after which a completed job is deleted (the key's deduplication window)
        #[arg(long, default_value = "15d", value_parser = age, value_name = "AGE")]
        completed_age: Duration,
        /// Age after which a dead job is deleted
        #[arg(long, default_value = "30d", value_parser = age, value_name = "AGE")]
        dead_age: Duration,
        /// Keep completed jobs (prune none)
        #[arg(long)]
        keep_completed: bool,
        /// Keep dead jobs (prune none)
        #[arg(long)]
        keep_dead: bool,
        /// Also prune the ledger rows of receiver SCOPE older than AGE (repeatable)
        #[arg(long, value_parser = ledger_scope, value_name = "SCOPE=AGE")]
        ledger: Vec<(String, Duration)>,
        /// Rows per transaction
        #[arg(long, default_value_t = brokerfence::retention::DEFAULT_PRUNE_BATCH)]
        batch: u32,
    },
}

#[derive(Subcommand)]
pub(crate) enum Dead {
    /// Dead jobs, the most recent first
    List {
        /// Only this queue
        #[arg(long, value_parser = queue_name)]
        queue: Option<QueueName>,
        /// At most this many
        #[arg(long, default_value_t = 50)]
        limit: u32,
    },
    /// Make dead jobs pending again under a new epoch (their old holders stay fenced),
    /// attempts and failures reset, last error kept
    Requeue {
        /// Queue
        #[arg(value_parser = queue_name)]
        queue: QueueName,
        /// Keys to requeue
        #[arg(value_parser = job_key, required_unless_present = "all", conflicts_with = "all")]
        keys: Vec<JobKey>,
        /// Every job of the queue that is dead now
        #[arg(long)]
        all: bool,
        /// Also requeue jobs claimed from a broker (SQS, Redis), which are refused otherwise: their
        /// rows become pending, and you re-send their messages (from the dead-letter queue or
        /// stream), since only a broker message runs them
        #[arg(long)]
        broker_jobs: bool,
        /// Rows per transaction
        #[arg(long, default_value_t = brokerfence::admin::DEFAULT_REQUEUE_BATCH)]
        batch: u32,
    },
}

fn schema_name(s: &str) -> Result<SchemaName, String> {
    SchemaName::new(s).map_err(|e| e.to_string())
}

fn queue_name(s: &str) -> Result<QueueName, String> {
    QueueName::new(s).map_err(|e| e.to_string())
}

fn job_key(s: &str) -> Result<JobKey, String> {
    JobKey::new(s).map_err(|e| e.to_string())
}

/// An age such as `15d`, `12h`, `30m`, `90s`, `500ms`, `1h 30m` (days are 24 hours).
pub(crate) fn age(s: &str) -> Result<Duration, String> {
    let span: jiff::Span = s.parse().map_err(|e| format!("{s:?} is not an age like 15d, 12h, 30s: {e}"))?;
    let d = span.to_duration(jiff::SpanRelativeTo::days_are_24_hours()).map_err(|e| e.to_string())?;
    Duration::try_from(d).map_err(|_| format!("{s:?}: an age cannot be negative"))
}

/// `SCOPE=AGE`.
fn ledger_scope(s: &str) -> Result<(String, Duration), String> {
    let (scope, a) = s.split_once('=').ok_or_else(|| format!("{s:?} is not SCOPE=AGE"))?;
    if scope.is_empty() {
        return Err(format!("{s:?}: the scope is empty"));
    }
    Ok((scope.to_owned(), age(a)?))
}
