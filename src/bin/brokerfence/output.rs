//! What a command prints: one JSON document (`--json`) or text tables, times as the database
//! clock gives them.

use std::time::Duration;

use brokerfence::admin::{DeadJob, JobInfo, RequeueReport, RunningJob, Status};
use brokerfence::retention::PruneReport;
use brokerfence::{DbTime, JobRecord, QueueName};
use serde_json::{Value, json};

use crate::Failure;
use crate::shown::Shown;

/// A job's payload, progress and result as `job` shows them.
pub(crate) struct JobBytes {
    payload: Option<Shown>,
    progress: Option<Shown>,
    result: Option<Shown>,
}

impl JobBytes {
    /// From the job's row (none when it was deleted meanwhile), whole when `full`.
    pub(crate) fn new(record: Option<&JobRecord>, full: bool) -> Self {
        let shown = |b: Option<&Vec<u8>>| b.map(|b| Shown::new(b, full));
        Self {
            payload: shown(record.and_then(|r| r.payload.as_ref())),
            progress: shown(record.and_then(|r| r.progress.as_ref())),
            result: shown(record.and_then(|r| r.result.as_ref())),
        }
    }
}

/// Prints `value` (with `--json`) or the text.
pub(crate) fn print(json: bool, value: Value, text: impl FnOnce() -> String) -> Result<(), Failure> {
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
pub(crate) fn at(t: DbTime) -> String {
    match jiff::Timestamp::from_millisecond(t.0) {
        Ok(ts) => format!("{ts:.3}"),
        Err(_) => t.to_string(),
    }
}

/// A length of time for people: `2h 3m 12s`, `25s 100ms`.
pub(crate) fn span(ms: i64) -> String {
    let d = jiff::SignedDuration::from_millis(ms.abs());
    let unit = if ms.abs() >= 60_000 { jiff::Unit::Second } else { jiff::Unit::Millisecond };
    let d = d.round(unit).unwrap_or(d);
    if d.is_zero() { "0s".to_owned() } else { format!("{d:#}") }
}

/// Time left on a lease: `25s 100ms left` or `ended 3s ago`.
pub(crate) fn left(ms: i64) -> String {
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

pub(crate) fn running_json(r: &RunningJob) -> Value {
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

pub(crate) fn status_json(status: &Status, backend: &str) -> Value {
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

pub(crate) fn status_text(status: &Status, within: Duration) -> String {
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

pub(crate) fn job_json(j: &JobInfo, b: &JobBytes) -> Value {
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
        "payload": Shown::json(b.payload.as_ref()),
        "payload_truncated": b.payload.as_ref().is_some_and(|s| s.truncated),
        "progress": Shown::json(b.progress.as_ref()),
        "progress_truncated": b.progress.as_ref().is_some_and(|s| s.truncated),
        "result": Shown::json(b.result.as_ref()),
        "result_truncated": b.result.as_ref().is_some_and(|s| s.truncated),
        "now_ms": j.now.0,
    })
}

pub(crate) fn job_text(j: &JobInfo, b: &JobBytes) -> String {
    let lease = match (j.lease_until, j.lease_left_ms) {
        (Some(until), Some(ms)) => format!("until {} ({})", at(until), left(ms)),
        _ => "-".to_owned(),
    };
    let due = j.run_at.0 - j.now.0;
    let run_at = if due > 0 { format!("{} (in {})", at(j.run_at), span(due)) } else { at(j.run_at) };
    // The bytes when the row was read, else only their length.
    let bytes = |shown: &Option<Shown>, n: Option<u64>| match (shown, n) {
        (Some(s), _) => s.line(),
        (None, Some(n)) => format!("{n} bytes"),
        (None, None) => "-".to_owned(),
    };
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
        ("payload", bytes(&b.payload, j.payload_bytes)),
        ("progress", bytes(&b.progress, j.progress_bytes)),
        ("result", bytes(&b.result, j.result_bytes)),
    ];
    rows.iter().map(|(k, v)| format!("{k:<11} {v}\n")).collect()
}

pub(crate) fn dead_json(d: &DeadJob) -> Value {
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

pub(crate) fn dead_text(dead: &[DeadJob]) -> String {
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

pub(crate) fn requeue_json(queue: &QueueName, r: &RequeueReport) -> Value {
    json!({
        "queue": queue.as_str(),
        "requeued": r.requeued.iter().map(|q| json!({"key": q.key.as_str(), "epoch": q.epoch})).collect::<Vec<_>>(),
        "skipped": r.skipped.iter().map(|s| json!({"key": s.key.as_str(), "state": s.state.map(|s| s.as_str())})).collect::<Vec<_>>(),
        "batches": r.batches,
    })
}

pub(crate) fn requeue_text(queue: &QueueName, r: &RequeueReport) -> String {
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

pub(crate) fn prune_json(queues: &[QueueName], r: &PruneReport) -> Value {
    json!({
        "queues": queues.iter().map(QueueName::as_str).collect::<Vec<_>>(),
        "completed": r.completed,
        "dead": r.dead,
        "ledger": r.ledger,
        "batches": r.batches,
        "contended": r.contended,
        "floor_busy": r.floor_busy,
    })
}

pub(crate) fn prune_text(queues: &[QueueName], r: &PruneReport) -> String {
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
    if r.floor_busy > 0 {
        out.push_str(&format!(
            "{} queue(s) left for the next run: their claims held the floor lock past the pruner's wait\n",
            r.floor_busy
        ));
    }
    out
}
