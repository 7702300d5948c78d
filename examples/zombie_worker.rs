//! A scripted worker process for the zombie proof tests (and for poking at by hand).
//!
//! It claims one job, runs a handler made of the steps given with `--plan` under a
//! [`Supervisor`], calls an HTTP receiver with the fencing stamp (`Fence-*` headers), commits
//! through the supervisor, and prints one machine-readable line per step on stdout:
//!
//! ```text
//! EVENT ready pid=4242
//! EVENT claimed epoch=1 owner=zombie-… ttl_ms=2999
//! EVENT receiver epoch=1 status=200 mode=async
//! EVENT gate
//! EVENT heartbeat lost epoch=1
//! EVENT gate-passed
//! EVENT receiver epoch=1 status=409 mode=sync
//! EVENT handler-dropped finished=true
//! EVENT outcome=fenced detail=job k: epoch 1 was superseded (current epoch 2, owner new-owner)
//! EVENT metrics claims=1 busy=0 … lease_losses=0 fenced_rejections=1 completions=0 …
//! EVENT exit code=0
//! ```
//!
//! Plan steps (comma separated):
//! - `call`: an async HTTP call to the receiver (the handler can be cancelled while it waits);
//! - `call-sync`: a blocking HTTP call — no await point, so nothing can stop it once it started;
//! - `gate`: prints `EVENT gate` and blocks until a line arrives on stdin. The tests use it to
//!   choose the exact instruction at which they freeze the process with SIGSTOP;
//! - `sleep:MS`: an async sleep;
//! - `calls:N:MS`: N times (async call, then async sleep MS);
//! - `checkpoint`: stores progress under the lease;
//! - `fail`: the handler returns a retryable error instead of a result;
//! - `tx-begin`, `tx-write`, `tx-complete`, `tx-commit` (PostgreSQL): the handler's own
//!   transaction: begin it on the fence's pool, insert a business row (job, epoch, owner) into
//!   `<schema>.effects_rows` (the test creates it), commit the result in it with
//!   `JobContext::complete_in`, commit it. Each prints `EVENT tx step=… epoch=N result=ok|fenced|error`.
//!
//! ```text
//! cargo run -p brokerfence-examples --example zombie_worker -- --db sqlite:/tmp/zombie.db --queue demo --key job-1 \
//!     --receiver http://127.0.0.1:8080/effect --plan call,sleep:500
//! ```
//!
//! Options: `--database-url URL` (or `--db`; postgres://… or sqlite:…), `--schema NAME`,
//! `--queue`, `--key`, `--owner PREFIX`, `--lease SECS` (or `--lease-secs`; ≥ 3),
//! `--receiver-url URL` (or `--receiver`), `--plan STEPS`, `--result TEXT`, `--claim-wait-ms N`,
//! `--max-attempts N` (for the `fail` step), `--migrate` (apply the schema migrations first;
//! without it a schema older than this build needs is refused with exit code 2), `--help`, and
//! with the `guard-switches` feature `--guards` with any of
//! `no-epoch-increment,no-commit-cas,no-heartbeat-cas,no-cancel-on-loss` (tests only). On
//! PostgreSQL its `application_name` is its owner id. Besides the lines above it prints the
//! `committed` / `fenced` / `fail_recorded` / `dropped` lines of `examples/README.md`.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use brokerfence::{
    self, Claim, FenceStore, JobContext, JobError, JobKey, LeaseDuration, Metrics, Outcome, Owner, QueueName,
    RetryPolicy, SchemaName, SqliteFence, Supervisor, SupervisorConfig,
};

#[path = "support/cli.rs"]
mod common;
#[path = "support/zombie_steps.rs"]
mod steps;

use common::{EventStore, StartError};
use steps::{
    DropProbe, EventHook, List, OwnTx, Plan, Step, call_async, call_sync, event, guards, parse_list, parse_plan,
    tx_step,
};

const PROG: &str = "zombie_worker";

fn main() {
    std::process::exit(run(std::env::args().skip(1).collect()));
}

/// A scripted worker for the zombie proof tests: claims one job, runs the --plan steps under a
/// supervisor (calling the receiver with the fencing stamp), commits, and prints one `EVENT`
/// line per step. Exit codes: 0 done, 1 failed, 2 refused.
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = PROG,
    help_template = common::HELP_TEMPLATE,
    after_help = "steps: call, call-sync, gate, sleep:MS, calls:N:MS, checkpoint, fail, tx-begin, tx-write, tx-complete, tx-commit"
)]
struct Opts {
    /// postgres://… or sqlite:…
    #[arg(long = "database-url", visible_alias = "db", value_name = "URL", required = true)]
    db: Option<String>,
    /// Schema of the fence tables
    #[arg(long, value_name = "NAME", default_value = fence::DEFAULT_SCHEMA)]
    schema: String,
    /// The queue
    #[arg(long, value_name = "NAME", default_value = "zombie")]
    queue: String,
    /// The job key
    #[arg(long, value_name = "KEY", default_value = "job-1")]
    key: String,
    /// Owner id prefix
    #[arg(long, value_name = "PREFIX", default_value = "zombie")]
    owner: String,
    /// Lease length in seconds (at least 3)
    #[arg(long = "lease", visible_alias = "lease-secs", value_name = "SECS", default_value_t = 3)]
    lease_secs: u64,
    /// The receiver the call steps call
    #[arg(long = "receiver-url", visible_alias = "receiver", value_name = "URL")]
    receiver: Option<String>,
    /// The handler's steps, comma separated (see below)
    #[arg(long, value_name = "STEPS", default_value = "", value_parser = parse_plan)]
    plan: Plan,
    /// The result to commit
    #[arg(long, value_name = "TEXT")]
    result: Option<String>,
    /// Milliseconds to keep trying to claim a busy job
    #[arg(long = "claim-wait-ms", value_name = "N", default_value = "10000", value_parser = common::millis)]
    claim_wait: Duration,
    /// Test only (the members' guard-switches, on in example builds): guards to turn off (no-epoch-increment,
    /// no-commit-cas, no-heartbeat-cas, no-ledger-check, no-cancel-on-loss)
    #[arg(long, value_name = "LIST", default_value = "", value_parser = parse_list)]
    guards: List,
    /// Apply the schema migrations first (else refuse a schema older than this build)
    #[arg(long)]
    migrate: bool,
    /// Failed attempts before the job is dead (for the fail step) [default: 5]
    #[arg(long, value_name = "N", value_parser = common::attempts)]
    max_attempts: Option<i64>,
}

/// Runs the worker with these arguments; returns the process exit code.
pub fn run(args: Vec<String>) -> i32 {
    let opts: Opts = match common::parse(PROG, args) {
        Ok(o) => o,
        Err(e) => return common::report_cli(&e),
    };
    common::init_logging("warn,brokerfence_fence=info");
    // Two worker threads: a blocking step holds one, the heartbeat keeps running on the other
    // (until the whole process is stopped with SIGSTOP).
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("zombie_worker: runtime: {e}");
            return 2;
        }
    };
    let code = rt.block_on(async move {
        match worker(opts).await {
            Ok(code) => code,
            Err(StartError::Refused(e)) => {
                eprintln!("zombie_worker: {e}");
                2
            }
            Err(StartError::Failed(e)) => {
                event(format!("error detail={e}"));
                1
            }
        }
    });
    event(format!("exit code={code}"));
    code
}

async fn open(o: &Opts, owner: &Owner) -> Result<Arc<dyn FenceStore>, StartError> {
    let refused = |e: String| StartError::Refused(e);
    let g = guards(&o.guards).map_err(refused)?;
    let db = o.db.as_deref().unwrap_or_default();
    let store: Arc<dyn FenceStore> = if common::database_kind(db)? == common::DbKind::Postgres {
        // `application_name` = the owner, so the worker shows in `pg_stat_activity`.
        let f = common::connect_pg(db, Some(&o.schema), owner, o.migrate).await?;
        let f = f.guards(g);
        Arc::new(f)
    } else {
        let schema = SchemaName::new(o.schema.clone()).map_err(|e| refused(e.to_string()))?;
        let f = SqliteFence::open(db).await?.schema(schema);
        common::prepare_schema(&f, o.migrate).await?;
        let f = f.guards(g);
        Arc::new(f)
    };
    // Prints `committed`, `fenced` and `fail_recorded` as the database decides them.
    Ok(Arc::new(EventStore(store)))
}

async fn worker(o: Opts) -> Result<i32, StartError> {
    event(format!("ready pid={}", std::process::id()));
    let refused = |e: fence::FenceError| StartError::Refused(e.to_string());
    let queue = QueueName::new(o.queue.clone()).map_err(refused)?;
    let key = JobKey::new(o.key.clone()).map_err(refused)?;
    let owner = Owner::unique(&o.owner);
    let lease_len = LeaseDuration::from_secs(o.lease_secs).map_err(refused)?;
    let store = open(&o, &owner).await?;

    let deadline = tokio::time::Instant::now() + o.claim_wait;
    let lease = loop {
        match store.claim(&queue, &key, &owner, lease_len).await? {
            Claim::Claimed(lease) => break lease,
            other if tokio::time::Instant::now() >= deadline => {
                event(format!("not-claimed detail={other:?}"));
                return Ok(3);
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    event(format!(
        "claimed epoch={} owner={} ttl_ms={} lease_until={}",
        lease.epoch,
        lease.owner,
        lease.ttl.as_millis(),
        lease.lease_until.0
    ));

    #[allow(unused_mut)]
    let mut config = SupervisorConfig::new(lease_len);
    if let Some(n) = o.max_attempts {
        config = config.retry(RetryPolicy { max_attempts: n, ..RetryPolicy::default() });
    }
    if o.guards.iter().any(|g| g == "no-cancel-on-loss") {
        config = config.without_cancel_on_loss();
    }
    let metrics = Arc::new(Metrics::default());
    metrics.incr(fence::Counter::Claims);
    let supervisor = Supervisor::with_metrics(Arc::clone(&store), owner.clone(), config, Arc::clone(&metrics));
    supervisor.add_hook(Arc::new(EventHook));

    let client = reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?;
    let result = o.result.clone().unwrap_or_else(|| format!("result of {owner}"));
    let plan = o.plan.0.clone();
    let receiver = o.receiver.clone();
    let pool = match store.backend() {
        fence::Backend::Postgres(f) => Some(f.pool().clone()),
        _ => None,
    };
    let own = OwnTx { pool, schema: o.schema.clone() };
    let outcome =
        supervisor.run(lease, Vec::new(), None, move |ctx| handler(ctx, plan, receiver, client, result, own)).await;
    let line = match &outcome {
        Outcome::Completed => "outcome=completed".to_owned(),
        Outcome::Failed { error, .. } => format!("outcome=failed detail={error}"),
        Outcome::Dead { error } => format!("outcome=dead detail={error}"),
        Outcome::LeaseLost { reason } => format!("outcome=lease_lost reason={reason:?}"),
        Outcome::Fenced(e) => format!("outcome=fenced detail={e}"),
        Outcome::Released => "outcome=released".to_owned(),
        Outcome::StoreError(e) => format!("outcome=store_error detail={e}"),
        other => format!("outcome=other detail={other:?}"),
    };
    event(line);
    event(format!("metrics {}", metrics.snapshot()));
    supervisor.shutdown(Duration::from_secs(1)).await;
    Ok(0)
}

async fn handler(
    ctx: JobContext,
    plan: Vec<Step>,
    receiver: Option<String>,
    client: reqwest::Client,
    result: String,
    own: OwnTx,
) -> Result<Vec<u8>, JobError> {
    let mut tx: Option<sqlx::Transaction<'static, sqlx::Postgres>> = None;
    let finished = Arc::new(AtomicBool::new(false));
    let _probe = DropProbe(Arc::clone(&finished), ctx.lease().clone());
    let mut fail = false;
    for step in plan {
        match step {
            Step::Call => call_async(&ctx, &client, receiver.as_deref()).await,
            Step::CallSync => {
                tokio::task::block_in_place(|| call_sync(&ctx, receiver.as_deref()));
            }
            Step::Gate => {
                event("gate");
                tokio::task::block_in_place(|| {
                    let mut line = String::new();
                    let _ = std::io::stdin().read_line(&mut line);
                });
                event("gate-passed");
            }
            Step::Sleep(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
            Step::Calls(n, ms) => {
                for _ in 0..n {
                    call_async(&ctx, &client, receiver.as_deref()).await;
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
            }
            Step::Checkpoint => match ctx.checkpoint(format!("progress of {}", ctx.owner()).as_bytes()).await {
                Ok(()) => event(format!("checkpoint epoch={} result=ok", ctx.epoch())),
                Err(e) if e.is_fenced() => event(format!("checkpoint epoch={} result=fenced", ctx.epoch())),
                Err(e) => event(format!("checkpoint epoch={} result=error detail={e}", ctx.epoch())),
            },
            Step::Fail => fail = true,
            Step::TxBegin | Step::TxWrite | Step::TxComplete | Step::TxCommit => {
                tx_step(&step, &ctx, &mut tx, &own, &result).await?;
            }
        }
    }
    finished.store(true, Ordering::SeqCst);
    if fail { Err(JobError::retry(format!("failure reported by {}", ctx.owner()))) } else { Ok(result.into_bytes()) }
}
