//! The rows the backends read and the functions that turn them into the typed answers.

use std::time::Duration;

use super::{
    AdminError, DeadJob, JobInfo, QueueStatus, RequeueReport, Requeued, RunningJob, Skipped, StateCounts, Status,
};
use crate::error::FenceError;
use crate::key::{JobKey, QueueName};
use crate::lease::{DbTime, JobState};

/// A key read back from the database.
pub(crate) fn stored_key(k: String) -> Result<JobKey, AdminError> {
    JobKey::new(k).map_err(|e| AdminError::Fence(FenceError::Corrupt(format!("stored job key: {e}"))))
}

/// The key of a dead row, for listing: a stored key that `JobKey` refuses (an empty or too long
/// key written by SQL, which a claim made dead, issue #30 item 7) is shown escaped and marked,
/// `<invalid key "…">` (at most 200 characters of it), instead of failing the whole listing. Such
/// a row cannot be requeued by key: its `last_error` says why it died.
pub(crate) fn listed_key(k: String) -> Result<JobKey, AdminError> {
    match JobKey::new(k.clone()) {
        Ok(key) => Ok(key),
        // 200 escaped characters are at most 800 bytes: the marked form is always a valid key.
        Err(_) => stored_key(format!("<invalid key \"{}\">", k.escape_debug().take(200).collect::<String>())),
    }
}

/// Adds one batch of a requeue-all (`(key, new epoch)` rows) to `report`; true when the batch was
/// full, so another one may follow.
pub(crate) fn absorb_requeued(
    report: &mut RequeueReport,
    rows: Vec<(String, i64)>,
    batch: u32,
) -> Result<bool, AdminError> {
    let n = rows.len();
    if n > 0 {
        report.batches += 1;
    }
    for (key, epoch) in rows {
        report.requeued.push(Requeued { key: stored_key(key)?, epoch });
    }
    Ok(n >= usize::try_from(batch).unwrap_or(usize::MAX))
}

/// A queue name read back from the database.
pub(crate) fn stored_queue(q: String) -> Result<QueueName, AdminError> {
    QueueName::new(q).map_err(|e| AdminError::Fence(FenceError::Corrupt(format!("stored queue name: {e}"))))
}

/// A count from the database.
pub(crate) fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}

/// Milliseconds of a duration for a statement parameter (saturating).
pub(crate) fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A running-job row: key, epoch, owner, attempts, lease_until, lease left, run_at (ms).
pub(crate) type RunningRow = (String, String, i64, Option<String>, i64, i64, i64, i64);

/// Puts status rows together: counts (queue, state, n, expired), then running rows of the oldest
/// (`oldest`) and the expiring (`expiring`) kind, each with its queue first.
pub(crate) fn assemble(
    now: i64,
    counts: Vec<(String, String, i64, i64)>,
    oldest: Vec<RunningRow>,
    expiring: Vec<RunningRow>,
) -> Result<Status, AdminError> {
    let mut queues: std::collections::BTreeMap<String, QueueStatus> = std::collections::BTreeMap::new();
    for (queue, state, n, expired) in counts {
        let entry = match queues.entry(queue.clone()) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(v) => v.insert(QueueStatus {
                queue: stored_queue(queue)?,
                counts: StateCounts::default(),
                expired_leases: 0,
                oldest_running: None,
                expiring: Vec::new(),
            }),
        };
        entry.counts.add(JobState::parse(&state)?, count(n));
        entry.expired_leases += count(expired);
    }
    for row in oldest {
        let (queue, job) = running_job(row)?;
        if let Some(q) = queues.get_mut(&queue) {
            q.oldest_running = Some(job);
        }
    }
    for row in expiring {
        let (queue, job) = running_job(row)?;
        if let Some(q) = queues.get_mut(&queue) {
            q.expiring.push(job);
        }
    }
    Ok(Status { now: DbTime(now), queues: queues.into_values().collect() })
}

/// A dead-job row: queue, key, epoch, owner, attempts, failures, last_error, updated_at, age (ms).
pub(crate) type DeadRow = (String, String, i64, Option<String>, i64, i64, Option<String>, i64, i64);

pub(crate) fn dead_job(row: DeadRow) -> Result<DeadJob, AdminError> {
    let (queue, key, epoch, owner, attempts, failures, last_error, died_at, age_ms) = row;
    Ok(DeadJob {
        queue: stored_queue(queue)?,
        key: listed_key(key)?,
        epoch,
        owner,
        attempts,
        failures,
        last_error,
        died_at: DbTime(died_at),
        age_ms,
    })
}

/// A job row: state, epoch, owner, attempts, failures, lease_until, lease left, run_at,
/// last_error, created_at, updated_at, payload/progress/result bytes, now (ms).
pub(crate) type JobInfoRow = (
    String,
    i64,
    Option<String>,
    i64,
    i64,
    Option<i64>,
    Option<i64>,
    i64,
    Option<String>,
    i64,
    i64,
    Option<i64>,
    Option<i64>,
    Option<i64>,
    i64,
);

pub(crate) fn job_info(queue: &QueueName, key: &JobKey, row: JobInfoRow) -> Result<JobInfo, AdminError> {
    let (
        state,
        epoch,
        owner,
        attempts,
        failures,
        lease_until,
        lease_left_ms,
        run_at,
        last_error,
        created_at,
        updated_at,
        payload,
        progress,
        result,
        now,
    ) = row;
    let bytes = |n: Option<i64>| n.map(count);
    Ok(JobInfo {
        queue: queue.clone(),
        key: key.clone(),
        state: JobState::parse(&state)?,
        epoch,
        owner,
        attempts,
        failures,
        lease_until: lease_until.map(DbTime),
        lease_left_ms,
        run_at: DbTime(run_at),
        last_error,
        created_at: DbTime(created_at),
        updated_at: DbTime(updated_at),
        payload_bytes: bytes(payload),
        progress_bytes: bytes(progress),
        result_bytes: bytes(result),
        now: DbTime(now),
    })
}

/// Sorts the outcome of a keyed requeue: `rows` are (key, new epoch if requeued, state seen).
pub(crate) fn keyed_outcome(
    report: &mut RequeueReport,
    rows: Vec<(String, Option<i64>, Option<String>)>,
) -> Result<(), AdminError> {
    let mut changed = false;
    for (key, epoch, state) in rows {
        let key = stored_key(key)?;
        match epoch {
            Some(epoch) => {
                changed = true;
                report.requeued.push(Requeued { key, epoch });
            }
            None => report.skipped.push(Skipped { key, state: state.as_deref().map(JobState::parse).transpose()? }),
        }
    }
    if changed {
        report.batches += 1;
    }
    Ok(())
}

/// The distinct keys of `keys`, first-seen order, in chunks of `batch`.
pub(crate) fn key_chunks(keys: &[JobKey], batch: u32) -> Vec<Vec<String>> {
    let distinct = crate::store::distinct_keys(keys);
    distinct
        .chunks(usize::try_from(batch.max(1)).unwrap_or(usize::MAX))
        .map(|c| c.iter().map(|k| k.as_str().to_owned()).collect())
        .collect()
}

/// A running row as the queue's name (as stored) and its [`RunningJob`].
pub(crate) fn running_job(row: RunningRow) -> Result<(String, RunningJob), AdminError> {
    let (queue, key, epoch, owner, attempts, lease_until, left, run_at) = row;
    Ok((
        queue,
        RunningJob {
            key: stored_key(key)?,
            epoch,
            owner,
            attempts,
            lease_until: DbTime(lease_until),
            lease_left_ms: left,
            due_since: DbTime(run_at),
        },
    ))
}
