//! `brokerfence`: the operator's command line (feature `cli`).
//!
//! ```text
//! brokerfence migrate
//! brokerfence status [--queue Q] [--expiring-within 10s] [--limit N]
//! brokerfence job QUEUE KEY [--full]
//! brokerfence dead list [--queue Q] [--limit N]
//! brokerfence dead requeue QUEUE (KEY…|--all) [--batch N] [--broker-jobs]
//! brokerfence prune [--queue Q]… [--completed-age 15d] [--dead-age 30d] [--keep-completed] [--keep-dead]
//!                   [--ledger SCOPE=AGE]… [--batch N]
//! brokerfence serve [--listen 127.0.0.1:8080] [--token T] [--allow-write] [--refresh 2s]   (feature `web`)
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
//!
//! This file runs a command; `args` holds the command line (clap), `output` the text and JSON
//! it prints.

use std::process::ExitCode;

use brokerfence::admin::{Admin, Requeue};
use brokerfence::retention::{QueueRetention, Retention};
use brokerfence::{FenceError, FenceStore, PgFence, SqliteFence};
use clap::Parser;
use serde_json::json;

mod args;
mod output;
mod shown;
#[cfg(feature = "web")]
mod web;

use args::{Cli, Command, Dead};
use output::{
    JobBytes, dead_json, dead_text, job_json, job_text, print, prune_json, prune_text, requeue_json, requeue_text,
    status_json, status_text,
};

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

impl From<brokerfence::admin::AdminError> for Failure {
    fn from(e: brokerfence::admin::AdminError) -> Self {
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

    /// The store, shared (the dashboard's requests each hold it).
    #[cfg(feature = "web")]
    fn shared(&self) -> std::sync::Arc<dyn FenceStore> {
        match self {
            Store::Postgres(pg) => std::sync::Arc::new(pg.clone()),
            Store::Sqlite(lite) => std::sync::Arc::new(lite.clone()),
        }
    }
}

async fn connect(cli: &Cli) -> Result<Store, Failure> {
    let Some(url) = cli.database_url.as_deref().filter(|u| !u.is_empty()) else {
        return Err(Failure::Usage("no database: give --database-url URL or set DATABASE_URL".into()));
    };
    // A scheme is letters first, then letters, digits, `+`, `-`, `.`; anything else before the
    // first colon (a path, `C:\…` aside) means there is none.
    let scheme = url
        .split_once(':')
        .map(|(s, _)| s)
        .filter(|s| {
            s.starts_with(|c: char| c.is_ascii_alphabetic())
                && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
        })
        .unwrap_or_default()
        .to_ascii_lowercase();
    match scheme.as_str() {
        "postgres" | "postgresql" => Ok(Store::Postgres(PgFence::connect(url).await?.schema(cli.schema.clone()))),
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
            Ok(Store::Sqlite(SqliteFence::open(url).await?.schema(cli.schema.clone())))
        }
        _ => Err(Failure::Usage(
            FenceError::UnsupportedScheme {
                scheme,
                expected: "postgres://… or postgresql://… (PostgreSQL), or sqlite:PATH (SQLite; a file \
                           /var/lib/app/jobs.db is sqlite:/var/lib/app/jobs.db)",
            }
            .to_string(),
        )),
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let store = connect(&cli).await?;
    let fence = store.fence();
    if let Command::Migrate = cli.command {
        fence.migrate().await?;
        return print(
            cli.json,
            json!({"migrated": true, "backend": fence.backend().name(), "schema": cli.schema.as_str()}),
            || format!("migrated: {} schema {} is up to date\n", fence.backend().name(), cli.schema.as_str()),
        );
    }
    // Says "run migrations" on an old schema, and "no such schema" on one that has no migration
    // at all (a mistyped --schema, most often), rather than a missing table.
    match fence.check_schema().await {
        Err(FenceError::SchemaTooOld { found: 0, .. }) => {
            let schema = cli.schema.as_str();
            return Err(Failure::Failed(format!(
                "no such schema {schema} in this {} database (no fence tables under that name): check --schema \
                 (the default is {}); `brokerfence migrate --schema {schema}` creates it",
                fence.backend().name(),
                brokerfence::DEFAULT_SCHEMA
            )));
        }
        result => result?,
    }
    let admin = Admin::new(fence)?.timeout(cli.timeout);
    match &cli.command {
        Command::Migrate => Ok(()),
        Command::Status { queue, expiring_within, limit } => {
            let admin = admin.expiring_within(*expiring_within).list_limit(*limit);
            let status = admin.status(queue.as_ref()).await?;
            print(cli.json, status_json(&status, admin.backend()), || status_text(&status, *expiring_within))
        }
        Command::Job { queue, key, full } => match admin.job(queue, key).await? {
            Some(job) => {
                // The bytes themselves (the admin summary has their lengths): one more read.
                let record = tokio::time::timeout(cli.timeout, fence.job(queue, key))
                    .await
                    .map_err(|_| Failure::Failed(format!("reading job {key}: no answer within {:?}", cli.timeout)))??;
                let bytes = JobBytes::new(record.as_ref(), *full);
                print(cli.json, job_json(&job, &bytes), || job_text(&job, &bytes))
            }
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
        Command::Dead(Dead::Requeue { queue, keys, all, batch, broker_jobs }) => {
            let which = if *all { Requeue::AllDead } else { Requeue::Keys(keys.clone()) };
            // Jobs claimed from a broker are refused unless asked for (AdminError::BrokerJobs).
            let admin = admin.batch_size(*batch).broker_jobs(*broker_jobs);
            let report = admin.requeue_dead(queue, which).await?;
            print(cli.json, requeue_json(queue, &report), || requeue_text(queue, &report))?;
            if report.skipped.is_empty() { Ok(()) } else { Err(Failure::NotFound) }
        }
        #[cfg(feature = "web")]
        Command::Serve(args) => {
            let args = args.clone();
            web::serve(args, admin, store.shared(), cli.timeout).await.map_err(|e| match e {
                e @ (web::ServeError::NoToken(..)
                | web::ServeError::EmptyToken
                | web::ServeError::ShortToken(_)
                | web::ServeError::RefreshTooFrequent(_)) => Failure::Usage(e.to_string()),
                e => Failure::Failed(e.to_string()),
            })
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
