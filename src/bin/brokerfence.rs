//! `brokerfence`: the operator's command line (feature `cli`).
//!
//! ```text
//! brokerfence migrate
//! brokerfence status [--queue Q] [--expiring-within 10s] [--limit N]
//! brokerfence job QUEUE KEY
//! brokerfence dead list [--queue Q] [--limit N]
//! brokerfence dead requeue QUEUE (KEY…|--all) [--batch N]
//! brokerfence prune [--queue Q]… [--completed-age 15d] [--dead-age 30d] [--keep-completed] [--keep-dead]
//!                   [--ledger SCOPE=AGE]… [--batch N]
//! ```
//!
//! Global options: `--database-url URL` (else `DATABASE_URL`; `postgres://…` or `sqlite:PATH`),
//! `--schema NAME`, `--json`, `--timeout 30s`. Everything it shows comes from
//! [`brokerfence::admin`]; times are the database clock's.
//!
//! Exit codes: 0 done; 1 failed (database unreachable, schema missing or too old, a statement
//! refused or timed out); 2 bad command line (including a missing or unsupported database URL);
//! 3 not found (`job` of a key the queue does not have, `dead requeue` of keys that were not
//! all dead).

use std::process::ExitCode;
use std::time::Duration;

use brokerfence::admin::{Admin, DeadJob, JobInfo, Requeue, RequeueReport, RunningJob, Status};
use brokerfence::{
    DbTime, FenceError, FenceStore, JobKey, PgFence, PruneReport, QueueName, QueueRetention, Retention, SchemaName,
    SqliteFence,
};
use clap::{Parser, Subcommand};
use serde_json::{Value, json};

const EXIT_CODES: &str = "Exit codes: 0 done, 1 failed, 2 bad command line or database URL, \
3 not found (job: no such job; dead requeue: a key named was not dead).";

/// Operator commands for brokerfence's fence tables (PostgreSQL or SQLite): migrations, queue
/// status, one job, dead letters and their fenced requeue, pruning. Times are the database clock's.
#[derive(Parser)]
#[command(name = "brokerfence", version, after_help = EXIT_CODES)]
struct Cli {
    /// Database URL: postgres://… or postgresql://… (PostgreSQL), sqlite:PATH (SQLite)
    #[arg(long, global = true, env = "DATABASE_URL", hide_env_values = true, value_name = "URL")]
    database_url: Option<String>,
    /// Schema (PostgreSQL) or table prefix (SQLite) of the fence's tables
    #[arg(long, global = true, default_value = brokerfence::DEFAULT_SCHEMA, value_parser = schema_name)]
    schema: SchemaName,
    /// Print one JSON document on stdout instead of text
    #[arg(long, global = true)]
    json: bool,
    /// Time limit of each database call (e.g. 30s, 2m)
    #[arg(long, global = true, default_value = "30s", value_parser = age, value_name = "AGE")]
    timeout: Duration,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
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
    /// One job: state, epoch, owner, attempts, lease left, last error
    Job {
        /// Queue
        #[arg(value_parser = queue_name)]
        queue: QueueName,
        /// Job key
        #[arg(value_parser = job_key)]
        key: JobKey,
    },
    /// Dead letters
    #[command(subcommand)]
    Dead(Dead),
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
enum Dead {
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
fn age(s: &str) -> Result<Duration, String> {
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

/// What ended a command, and its exit code.
enum Failure {
    /// 1: the database or the store failed.
    Failed(String),
    /// 2: the command line (or the database URL) is wrong.
    Usage(String),
    /// 3: something named does not exist (or is not in the state asked for); the output is printed.
    NotFound,
}

impl From<FenceError> for Failure {
    fn from(e: FenceError) -> Self {
        match e {
            FenceError::SchemaTooOld { .. } => Failure::Failed(format!("{e}; with this tool: `brokerfence migrate`")),
            e => Failure::Failed(e.to_string()),
        }
    }
}

impl From<brokerfence::AdminError> for Failure {
    fn from(e: brokerfence::AdminError) -> Self {
        Failure::Failed(e.to_string())
    }
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // --help and --version print and end with 0; usage errors with 2.
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("brokerfence: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure::NotFound) => ExitCode::from(3),
        Err(Failure::Usage(msg)) => {
            eprintln!("brokerfence: {msg}");
            ExitCode::from(2)
        }
        Err(Failure::Failed(msg)) => {
            eprintln!("brokerfence: {msg}");
            ExitCode::from(1)
        }
    }
}

/// The store of `url`.
enum Store {
    Postgres(PgFence),
    Sqlite(SqliteFence),
}

impl Store {
    fn fence(&self) -> &dyn FenceStore {
        match self {
            Store::Postgres(pg) => pg,
            Store::Sqlite(lite) => lite,
        }
    }
}

async fn connect(cli: &Cli) -> Result<Store, Failure> {
    let Some(url) = cli.database_url.as_deref().filter(|u| !u.is_empty()) else {
        return Err(Failure::Usage("no database: give --database-url URL or set DATABASE_URL".into()));
    };
    let scheme = url.split_once(':').map(|(s, _)| s.to_ascii_lowercase()).unwrap_or_default();
    match scheme.as_str() {
        "postgres" | "postgresql" => Ok(Store::Postgres(PgFence::connect(url).await?.with_schema(cli.schema.clone()))),
        "sqlite" => {
            // Opening creates a missing file: only `migrate` may do that (a mistyped path would
            // otherwise show an empty, new database).
            let options: sqlx::sqlite::SqliteConnectOptions =
                url.parse().map_err(|e| Failure::Usage(format!("bad SQLite URL: {e}")))?;
            let file = options.get_filename();
            let memory = url.contains(":memory:") || url.contains("mode=memory");
            if !memory && !matches!(cli.command, Command::Migrate) && !file.exists() {
                return Err(Failure::Failed(format!(
                    "no SQLite database at {}: check the path, or run `brokerfence migrate` to create it",
                    file.display()
                )));
            }
            Ok(Store::Sqlite(SqliteFence::open(url).await?.with_schema(cli.schema.clone())))
        }
        _ => Err(Failure::Usage(format!(
            "database URL scheme {scheme:?} is not supported: use postgres://… or postgresql://… (PostgreSQL) \
             or sqlite:PATH (SQLite)"
        ))),
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let store = connect(&cli).await?;
    let fence = store.fence();
    if let Command::Migrate = cli.command {
        fence.migrate().await?;
        return print(
            cli.json,
            json!({"migrated": true, "backend": fence.backend(), "schema": cli.schema.as_str()}),
            || format!("migrated: {} schema {} is up to date\n", fence.backend(), cli.schema.as_str()),
        );
    }
    // Says "run migrations" on a missing or old schema, rather than a missing table.
    fence.check_schema().await?;
    let admin = Admin::new(fence)?.with_timeout(cli.timeout);
    match &cli.command {
        Command::Migrate => Ok(()),
        Command::Status { queue, expiring_within, limit } => {
            let admin = admin.with_expiring_within(*expiring_within).with_list_limit(*limit);
            let status = admin.status(queue.as_ref()).await?;
            print(cli.json, status_json(&status, admin.backend()), || status_text(&status, *expiring_within))
        }
        Command::Job { queue, key } => match admin.job(queue, key).await? {
            Some(job) => print(cli.json, job_json(&job), || job_text(&job)),
            None => {
                print(cli.json, json!({"found": false, "queue": queue.as_str(), "key": key.as_str()}), || {
                    format!("no job {key} in queue {queue}\n")
                })?;
                Err(Failure::NotFound)
            }
        },
        Command::Dead(Dead::List { queue, limit }) => {
            let dead = admin.dead(queue.as_ref(), *limit).await?;
            print(cli.json, json!({"dead": dead.iter().map(dead_json).collect::<Vec<_>>()}), || dead_text(&dead))
        }
        Command::Dead(Dead::Requeue { queue, keys, all, batch }) => {
            let which = if *all { Requeue::AllDead } else { Requeue::Keys(keys.clone()) };
            let report = admin.with_batch_size(*batch).requeue_dead(queue, which).await?;
            print(cli.json, requeue_json(queue, &report), || requeue_text(queue, &report))?;
            if report.skipped.is_empty() { Ok(()) } else { Err(Failure::NotFound) }
        }
        Command::Prune { queues, completed_age, dead_age, keep_completed, keep_dead, ledger, batch } => {
            let queues = if queues.is_empty() { admin.queues().await? } else { queues.clone() };
            let policy = QueueRetention {
                completed: (!keep_completed).then_some(*completed_age),
                dead: (!keep_dead).then_some(*dead_age),
            };
            let mut retention = Retention::new().batch_size(*batch);
            for q in &queues {
                retention = retention.queue(q.clone(), policy);
            }
            for (scope, age) in ledger {
                retention = retention.ledger(scope.clone(), *age);
            }
            let report = admin.prune(&retention).await?;
            print(cli.json, prune_json(&queues, &report), || prune_text(&queues, &report))
        }
    }
}

/// Prints `value` (with `--json`) or the text.
fn print(json: bool, value: Value, text: impl FnOnce() -> String) -> Result<(), Failure> {
    if json {
        println!("{value}");
    } else {
        print!("{}", text());
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// Formatting
// ------------------------------------------------------------------------------------------------

/// A database-clock time as RFC 3339 (UTC, milliseconds).
fn at(t: DbTime) -> String {
    match jiff::Timestamp::from_millisecond(t.0) {
        Ok(ts) => format!("{ts:.3}"),
        Err(_) => t.to_string(),
    }
}

/// A length of time for people: `2h 3m 12s`, `25s 100ms`.
fn span(ms: i64) -> String {
    let d = jiff::SignedDuration::from_millis(ms.abs());
    let unit = if ms.abs() >= 60_000 { jiff::Unit::Second } else { jiff::Unit::Millisecond };
    let d = d.round(unit).unwrap_or(d);
    if d.is_zero() { "0s".to_owned() } else { format!("{d:#}") }
}

/// Time left on a lease: `25s 100ms left` or `ended 3s ago`.
fn left(ms: i64) -> String {
    if ms >= 0 { format!("{} left", span(ms)) } else { format!("ended {} ago", span(ms)) }
}

/// Columns padded to their widest cell, two spaces apart.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<w$}  "));
            }
        }
        out.trim_end().to_owned() + "\n"
    };
    let mut out = line(header.to_vec());
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

fn opt(s: &Option<String>) -> String {
    s.clone().unwrap_or_else(|| "-".to_owned())
}

fn running_json(r: &RunningJob) -> Value {
    json!({
        "key": r.key.as_str(),
        "epoch": r.epoch,
        "owner": r.owner,
        "attempts": r.attempts,
        "lease_until_ms": r.lease_until.0,
        "lease_until": at(r.lease_until),
        "lease_left_ms": r.lease_left_ms,
        "expired": r.expired(),
        "due_since_ms": r.due_since.0,
        "due_since": at(r.due_since),
    })
}

fn status_json(status: &Status, backend: &str) -> Value {
    let queues: Vec<Value> = status
        .queues
        .iter()
        .map(|q| {
            json!({
                "queue": q.queue.as_str(),
                "counts": {
                    "pending": q.counts.pending,
                    "running": q.counts.running,
                    "failed": q.counts.failed,
                    "dead": q.counts.dead,
                    "completed": q.counts.completed,
                    "total": q.counts.total(),
                },
                "expired_leases": q.expired_leases,
                "oldest_running": q.oldest_running.as_ref().map(running_json),
                "expiring": q.expiring.iter().map(running_json).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({"backend": backend, "now_ms": status.now.0, "now": at(status.now), "queues": queues})
}

fn status_text(status: &Status, within: Duration) -> String {
    let mut out = format!("database clock {}\n\n", at(status.now));
    if status.queues.is_empty() {
        out.push_str("no jobs\n");
        return out;
    }
    let rows: Vec<Vec<String>> = status
        .queues
        .iter()
        .map(|q| {
            let c = q.counts;
            vec![
                q.queue.to_string(),
                c.pending.to_string(),
                c.running.to_string(),
                c.failed.to_string(),
                c.dead.to_string(),
                c.completed.to_string(),
                q.expired_leases.to_string(),
            ]
        })
        .collect();
    out.push_str(&table(&["QUEUE", "PENDING", "RUNNING", "FAILED", "DEAD", "COMPLETED", "EXPIRED LEASES"], &rows));
    for q in &status.queues {
        if let Some(r) = &q.oldest_running {
            out.push_str(&format!(
                "\n{}: oldest running {} (epoch {}, owner {}), due for {}, lease {}\n",
                q.queue,
                r.key,
                r.epoch,
                opt(&r.owner),
                span(status.now.0 - r.due_since.0),
                left(r.lease_left_ms)
            ));
        }
        if !q.expiring.is_empty() {
            let ms = i64::try_from(within.as_millis()).unwrap_or(i64::MAX);
            out.push_str(&format!("{}: leases ending within {} or ended:\n", q.queue, span(ms)));
            let rows: Vec<Vec<String>> = q
                .expiring
                .iter()
                .map(|r| vec![format!("  {}", r.key), r.epoch.to_string(), opt(&r.owner), left(r.lease_left_ms)])
                .collect();
            out.push_str(&table(&["  KEY", "EPOCH", "OWNER", "LEASE"], &rows));
        }
    }
    out
}

fn job_json(j: &JobInfo) -> Value {
    json!({
        "found": true,
        "queue": j.queue.as_str(),
        "key": j.key.as_str(),
        "state": j.state.as_str(),
        "epoch": j.epoch,
        "owner": j.owner,
        "attempts": j.attempts,
        "failures": j.failures,
        "lease_until_ms": j.lease_until.map(|t| t.0),
        "lease_left_ms": j.lease_left_ms,
        "run_at_ms": j.run_at.0,
        "run_at": at(j.run_at),
        "last_error": j.last_error,
        "created_at_ms": j.created_at.0,
        "updated_at_ms": j.updated_at.0,
        "payload_bytes": j.payload_bytes,
        "progress_bytes": j.progress_bytes,
        "result_bytes": j.result_bytes,
        "now_ms": j.now.0,
    })
}

fn job_text(j: &JobInfo) -> String {
    let lease = match (j.lease_until, j.lease_left_ms) {
        (Some(until), Some(ms)) => format!("until {} ({})", at(until), left(ms)),
        _ => "-".to_owned(),
    };
    let due = j.run_at.0 - j.now.0;
    let run_at = if due > 0 { format!("{} (in {})", at(j.run_at), span(due)) } else { at(j.run_at) };
    let bytes = |n: Option<u64>| n.map_or_else(|| "-".to_owned(), |n| format!("{n} bytes"));
    let rows = [
        ("queue", j.queue.to_string()),
        ("key", j.key.to_string()),
        ("state", j.state.to_string()),
        ("epoch", j.epoch.to_string()),
        ("owner", opt(&j.owner)),
        ("attempts", format!("{} (claims)", j.attempts)),
        ("failures", j.failures.to_string()),
        ("lease", lease),
        ("run at", run_at),
        ("last error", opt(&j.last_error)),
        ("created", at(j.created_at)),
        ("updated", format!("{} ({} ago)", at(j.updated_at), span(j.now.0 - j.updated_at.0))),
        ("payload", bytes(j.payload_bytes)),
        ("progress", bytes(j.progress_bytes)),
        ("result", bytes(j.result_bytes)),
    ];
    rows.iter().map(|(k, v)| format!("{k:<11} {v}\n")).collect()
}

fn dead_json(d: &DeadJob) -> Value {
    json!({
        "queue": d.queue.as_str(),
        "key": d.key.as_str(),
        "epoch": d.epoch,
        "owner": d.owner,
        "attempts": d.attempts,
        "failures": d.failures,
        "last_error": d.last_error,
        "died_at_ms": d.died_at.0,
        "died_at": at(d.died_at),
        "age_ms": d.age_ms,
    })
}

fn dead_text(dead: &[DeadJob]) -> String {
    if dead.is_empty() {
        return "no dead jobs\n".to_owned();
    }
    let rows: Vec<Vec<String>> = dead
        .iter()
        .map(|d| {
            vec![
                d.queue.to_string(),
                d.key.to_string(),
                d.epoch.to_string(),
                d.attempts.to_string(),
                d.failures.to_string(),
                format!("{} ago", span(d.age_ms)),
                opt(&d.last_error).replace('\n', " "),
            ]
        })
        .collect();
    table(&["QUEUE", "KEY", "EPOCH", "ATTEMPTS", "FAILURES", "DIED", "LAST ERROR"], &rows)
}

fn requeue_json(queue: &QueueName, r: &RequeueReport) -> Value {
    json!({
        "queue": queue.as_str(),
        "requeued": r.requeued.iter().map(|q| json!({"key": q.key.as_str(), "epoch": q.epoch})).collect::<Vec<_>>(),
        "skipped": r.skipped.iter().map(|s| json!({"key": s.key.as_str(), "state": s.state.map(|s| s.as_str())})).collect::<Vec<_>>(),
        "batches": r.batches,
    })
}

fn requeue_text(queue: &QueueName, r: &RequeueReport) -> String {
    let mut out = format!("requeued {} dead job(s) of {queue} in {} batch(es)\n", r.requeued.len(), r.batches);
    for q in &r.requeued {
        out.push_str(&format!("  {} now pending at epoch {}\n", q.key, q.epoch));
    }
    for s in &r.skipped {
        match s.state {
            Some(state) => out.push_str(&format!("  {} skipped: {state}, not dead\n", s.key)),
            None => out.push_str(&format!("  {} skipped: no such job\n", s.key)),
        }
    }
    out
}

fn prune_json(queues: &[QueueName], r: &PruneReport) -> Value {
    json!({
        "queues": queues.iter().map(QueueName::as_str).collect::<Vec<_>>(),
        "completed": r.completed,
        "dead": r.dead,
        "ledger": r.ledger,
        "batches": r.batches,
        "contended": r.contended,
    })
}

fn prune_text(queues: &[QueueName], r: &PruneReport) -> String {
    let names: Vec<&str> = queues.iter().map(QueueName::as_str).collect();
    let mut out = format!(
        "pruned {} completed, {} dead, {} ledger row(s) in {} batch(es) (queues: {})\n",
        r.completed,
        r.dead,
        r.ledger,
        r.batches,
        if names.is_empty() { "none".to_owned() } else { names.join(", ") }
    );
    if r.contended {
        out.push_str("another pruner was at work: this run stopped early; the next one carries on\n");
    }
    out
}
