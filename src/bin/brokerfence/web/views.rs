//! The JSON documents of the `/api/` endpoints: the shapes of `brokerfence status --json`
//! (`overview`), `dead list --json` (`dead`) and `job --json` (`job`), with what the dashboard
//! adds beside them (bounded-count flags, activity minutes, the oldest pending job).

use brokerfence::admin::{DeadJob, InFlightJob, Minute, Overview, RecordedEvent};
use serde_json::{Value, json};

use crate::output::{at, dead_json, running_json};

fn minute_json(m: &Minute) -> Value {
    json!({
        "minute_ms": m.minute.0,
        "minute": at(m.minute),
        "claims": m.counts.claims,
        "commits": m.counts.commits,
        "fenced": m.counts.fenced,
        "lost": m.counts.lost,
    })
}

/// `status --json`'s document, from an overview.
pub(crate) fn overview_json(o: &Overview, backend: &str) -> Value {
    let queues: Vec<Value> = o
        .queues
        .iter()
        .map(|q| {
            let c = q.counts.counts;
            json!({
                "queue": q.queue.as_str(),
                "counts": {
                    "pending": c.pending,
                    "running": c.running,
                    "failed": c.failed,
                    "dead": c.dead,
                    "completed": c.completed,
                    "total": c.total(),
                },
                "counts_capped": {
                    "open": q.counts.open_capped,
                    "completed": q.counts.completed_capped,
                    "dead": q.counts.dead_capped,
                },
                "expired_leases": q.expired_leases,
                "oldest_running": q.oldest_running.as_ref().map(running_json),
                "expiring": q.expiring.iter().map(running_json).collect::<Vec<_>>(),
                "oldest_pending_ms": q.oldest_pending_ms,
                "minutes": q.minutes.iter().map(minute_json).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({
        "backend": backend,
        "now_ms": o.now.0,
        "now": at(o.now),
        "count_limit": o.count_limit,
        "queues": queues,
    })
}

/// The jobs in flight: `running_json` (as in `status --json`) with the queue and last renewal.
pub(crate) fn in_flight_json(jobs: &[InFlightJob]) -> Value {
    let jobs: Vec<Value> = jobs
        .iter()
        .map(|j| {
            let mut v = running_json(&j.job);
            if let Some(map) = v.as_object_mut() {
                map.insert("queue".into(), json!(j.queue.as_str()));
                map.insert("last_renewal_ms".into(), json!(j.last_renewal.map(|t| t.0)));
                map.insert("last_renewal".into(), json!(j.last_renewal.map(at)));
            }
            v
        })
        .collect();
    json!({ "in_flight": jobs })
}

pub(crate) fn events_json(events: &[RecordedEvent]) -> Value {
    let events: Vec<Value> = events
        .iter()
        .map(|e| {
            json!({
                "seq": e.seq,
                "at_ms": e.at.0,
                "at": at(e.at),
                "age_ms": e.age_ms,
                "queue": e.queue.as_str(),
                "key": e.key.as_str(),
                "kind": e.kind.as_str(),
                "detail": e.detail,
                "epoch": e.epoch,
                "owner": e.owner,
                "winner_epoch": e.winner_epoch,
                "winner_owner": e.winner_owner,
                "winner_state": e.winner_state,
            })
        })
        .collect();
    json!({ "fences": events })
}

/// `dead list --json`'s document.
pub(crate) fn dead_list_json(dead: &[DeadJob]) -> Value {
    json!({ "dead": dead.iter().map(dead_json).collect::<Vec<_>>() })
}
