//! The scripted worker's plumbing (`zombie_worker.rs`): its `EVENT` line, the `--plan` steps and
//! their parsing, the `--guards` switches, the heartbeat and drop probes, the `tx-*` steps and the
//! receiver calls (async, and a blocking one nothing can interrupt). Included by
//! `zombie_worker.rs` with `#[path = "support/zombie_steps.rs"] mod steps;`.

use std::future::Future;
use std::io::{Read, Write};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use brokerfence::{self, JobContext, JobError, Lease, LeaseHook};

use super::common;

/// Prints one `EVENT …` line and flushes it at once (the tests read it through a pipe).
pub fn event(line: impl std::fmt::Display) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "EVENT {line}");
    let _ = out.flush();
}

#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    Call,
    CallSync,
    Gate,
    Sleep(u64),
    Calls(u32, u64),
    Checkpoint,
    Fail,
    TxBegin,
    TxWrite,
    TxComplete,
    TxCommit,
}

/// The steps of `--plan`.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan(pub Vec<Step>);

impl std::ops::Deref for Plan {
    type Target = Vec<Step>;
    fn deref(&self) -> &Vec<Step> {
        &self.0
    }
}

/// A comma-separated list.
#[derive(Debug, Clone, PartialEq)]
pub struct List(pub Vec<String>);

impl std::ops::Deref for List {
    type Target = Vec<String>;
    fn deref(&self) -> &Vec<String> {
        &self.0
    }
}

pub fn parse_plan(v: &str) -> Result<Plan, String> {
    v.split(',').filter(|s| !s.is_empty()).map(parse_step).collect::<Result<_, _>>().map(Plan)
}

pub fn parse_list(v: &str) -> Result<List, String> {
    Ok(List(v.split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect()))
}

pub fn parse_step(s: &str) -> Result<Step, String> {
    let parts: Vec<&str> = s.split(':').collect();
    let num = |i: usize| -> Result<u64, String> {
        parts.get(i).ok_or_else(|| format!("step {s}: missing number"))?.parse().map_err(|e| format!("step {s}: {e}"))
    };
    Ok(match parts[0] {
        "call" => Step::Call,
        "call-sync" => Step::CallSync,
        "gate" => Step::Gate,
        "sleep" => Step::Sleep(num(1)?),
        "calls" => Step::Calls(u32::try_from(num(1)?).map_err(|e| e.to_string())?, num(2)?),
        "checkpoint" => Step::Checkpoint,
        "fail" => Step::Fail,
        "tx-begin" => Step::TxBegin,
        "tx-write" => Step::TxWrite,
        "tx-complete" => Step::TxComplete,
        "tx-commit" => Step::TxCommit,
        other => return Err(format!("unknown step {other}")),
    })
}

pub fn guards(names: &[String]) -> Result<fence::Guards, String> {
    let mut g = fence::Guards::default();
    for name in names {
        {
            g = match name.as_str() {
                "no-epoch-increment" => g.without_epoch_increment(),
                "no-commit-cas" => g.without_commit_cas(),
                "no-heartbeat-cas" => g.without_heartbeat_cas(),
                "no-ledger-check" => g.without_ledger_check(),
                "no-cancel-on-loss" => g, // a supervisor setting, applied below
                other => return Err(format!("unknown guard {other}")),
            };
        }
    }
    Ok(g)
}

/// Prints what every heartbeat found. (`LeaseHook` is an `async_trait`; this is its expansion,
/// written out because the example does not depend on the macro crate.)
pub struct EventHook;

pub type HookFuture<'a> = Pin<Box<dyn Future<Output = ()> + Send + 'a>>;

impl LeaseHook for EventHook {
    fn confirmed<'a, 'b, 'c>(&'a self, leases: &'b [Lease]) -> HookFuture<'c>
    where
        'a: 'c,
        'b: 'c,
        Self: 'c,
    {
        for l in leases {
            event(format!("heartbeat renewed epoch={} lease_until={}", l.epoch, l.lease_until.0));
        }
        Box::pin(std::future::ready(()))
    }

    fn lost<'a, 'b, 'c>(&'a self, leases: &'b [Lease]) -> HookFuture<'c>
    where
        'a: 'c,
        'b: 'c,
        Self: 'c,
    {
        for l in leases {
            event(format!("heartbeat lost epoch={}", l.epoch));
        }
        Box::pin(std::future::ready(()))
    }
}

/// Prints when the handler's future is dropped: at its end, or when the supervisor cancels it
/// (then also the `dropped` line of `examples/README.md`).
pub struct DropProbe(pub Arc<AtomicBool>, pub Lease);

impl Drop for DropProbe {
    fn drop(&mut self) {
        let finished = self.0.load(Ordering::SeqCst);
        event(format!("handler-dropped finished={finished}"));
        if !finished {
            common::lease_event("dropped", &self.1, &[]);
        }
    }
}

/// The handler's own transaction, for the `tx-*` steps: the fence's PostgreSQL pool, if any.
pub struct OwnTx {
    pub pool: Option<sqlx::PgPool>,
    pub schema: String,
}

/// Prints the `tx` line of one step; the step's value when it succeeded.
pub fn tx_event<T>(ctx: &JobContext, step: &str, answer: Result<T, String>) -> Option<T> {
    match answer {
        Ok(v) => {
            event(format!("tx step={step} epoch={} result=ok", ctx.epoch()));
            Some(v)
        }
        Err(e) => {
            event(format!("tx step={step} epoch={} result=error detail={e}", ctx.epoch()));
            None
        }
    }
}

pub fn body_of(ctx: &JobContext) -> String {
    format!("effect of {} at epoch {}", ctx.owner(), ctx.epoch())
}

pub async fn call_async(ctx: &JobContext, client: &reqwest::Client, receiver: Option<&str>) {
    let Some(url) = receiver else { return };
    let mut request = client.post(url).body(body_of(ctx));
    for (name, value) in ctx.stamp().to_headers() {
        request = request.header(name, value);
    }
    event(format!("calling epoch={} mode=async", ctx.epoch()));
    match request.send().await {
        Ok(response) => {
            event(format!("receiver epoch={} status={} mode=async", ctx.epoch(), response.status().as_u16()))
        }
        Err(e) => event(format!("receiver epoch={} status=0 mode=async error={e}", ctx.epoch())),
    }
}

/// A plain HTTP/1.1 POST over a blocking socket: once it starts, it runs to its end without
/// giving the async runtime (or the supervisor) a chance to intervene.
pub fn call_sync(ctx: &JobContext, receiver: Option<&str>) {
    let Some(url) = receiver else { return };
    event(format!("calling epoch={} mode=sync", ctx.epoch()));
    match post_blocking(url, &ctx.stamp().to_headers(), &body_of(ctx)) {
        Ok(status) => event(format!("receiver epoch={} status={status} mode=sync", ctx.epoch())),
        Err(e) => event(format!("receiver epoch={} status=0 mode=sync error={e}", ctx.epoch())),
    }
}

pub fn post_blocking(url: &str, headers: &[(&str, String)], body: &str) -> std::io::Result<u16> {
    let bad = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, m.to_owned());
    let rest = url.strip_prefix("http://").ok_or_else(|| bad("only http:// URLs"))?;
    let (host, path) = rest.split_once('/').map_or((rest, "/".to_owned()), |(h, p)| (h, format!("/{p}")));
    let mut stream = std::net::TcpStream::connect(host)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut request = format!(
        "POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for (name, value) in headers {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(body);
    stream.write_all(request.as_bytes())?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    let head = String::from_utf8_lossy(&response);
    head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| bad("no HTTP status line"))
}

/// One `tx-*` step of the handler's own transaction (`tx` holds it between steps); prints its
/// `EVENT tx step=… epoch=N result=…` line.
pub async fn tx_step(
    step: &Step,
    ctx: &JobContext,
    tx: &mut Option<sqlx::Transaction<'static, sqlx::Postgres>>,
    own: &OwnTx,
    result: &str,
) -> Result<(), JobError> {
    match step {
        Step::TxBegin => {
            let begun = match &own.pool {
                Some(pool) => pool.begin().await.map_err(|e| e.to_string()),
                None => Err("tx steps need PostgreSQL".to_owned()),
            };
            *tx = tx_event(ctx, "begin", begun);
        }
        Step::TxWrite => {
            let Some(t) = tx.as_mut() else { return Err(JobError::fatal("tx-write before tx-begin")) };
            let sql = format!("INSERT INTO \"{}\".effects_rows (job, epoch, owner) VALUES ($1, $2, $3)", own.schema);
            let q = sqlx::query(sqlx::AssertSqlSafe(sql)).bind(ctx.key().as_str()).bind(ctx.epoch());
            let written = q.bind(ctx.owner().as_str()).execute(&mut **t).await.map(drop).map_err(|e| e.to_string());
            tx_event(ctx, "write", written).ok_or_else(|| JobError::retry("tx-write failed"))?;
        }
        Step::TxComplete => {
            let Some(t) = tx.as_mut() else { return Err(JobError::fatal("tx-complete before tx-begin")) };
            let done = ctx.complete_in(&mut **t, result.as_bytes()).await;
            if let Err(e) = &done
                && e.is_fenced()
            {
                event(format!("tx step=complete epoch={} result=fenced", ctx.epoch()));
                return Err(JobError::retry(e));
            }
            tx_event(ctx, "complete", done.map_err(|e| e.to_string()))
                .ok_or_else(|| JobError::retry("tx-complete failed"))?;
        }
        Step::TxCommit => {
            let Some(t) = tx.take() else { return Err(JobError::fatal("tx-commit before tx-begin")) };
            tx_event(ctx, "commit", t.commit().await.map_err(|e| e.to_string()))
                .ok_or_else(|| JobError::retry("tx-commit failed"))?;
        }
        _ => {}
    }
    Ok(())
}
