//! What a supervisor records for the dashboard (see [`crate::admin::Activity`]): counts per
//! queue in memory, flushed at most every [`SupervisorConfig::activity_interval`]; fence events
//! (fenced commits, lost leases; rare) within a second. One statement per flush, in a task of
//! its own: nothing is added to a claim's, a heartbeat's or a commit's path but a short mutex.
//!
//! [`SupervisorConfig::activity_interval`]: super::SupervisorConfig::activity_interval

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{LossReason, Outcome};
use crate::admin::{Activity, ActivityCounts, FenceEvent, FenceEventKind};
use crate::error::FenceError;
use crate::key::QueueName;
use crate::lease::Lease;
use crate::store::FenceStore;

/// Events kept between two flushes; more are counted, not kept (a storm of takeovers is in the
/// counts; the ring of the store keeps the newest anyway).
const MAX_EVENTS: usize = 1_000;

/// Queues counted between two flushes (more are dropped from the counts until the next flush).
const MAX_QUEUES: usize = 1_024;

/// How often fence events are flushed.
const EVENT_FLUSH: Duration = Duration::from_secs(1);

/// The limit of one flush statement.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(10);

/// The limit of each of the two tries of the last flush, at shutdown (shorter: a shutdown waits
/// for it).
const FINAL_FLUSH_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a graceful shutdown waits for the last flush: its two tries and a margin.
pub(super) const FINAL_FLUSH_WAIT: Duration = Duration::from_secs(7);

#[derive(Debug, Default)]
pub(super) struct Recorder {
    pending: Mutex<Activity>,
}

/// The counts of `queue` in `a`, added when there is room (the queue's name is cloned only
/// then, once per queue and flush).
fn counts<'a>(a: &'a mut Activity, queue: &QueueName) -> Option<&'a mut ActivityCounts> {
    if !a.counts.contains_key(queue) {
        if a.counts.len() >= MAX_QUEUES {
            return None;
        }
        a.counts.insert(queue.clone(), ActivityCounts::default());
    }
    a.counts.get_mut(queue)
}

impl Recorder {
    /// An attempt started under a claim of `queue`.
    pub(super) fn claimed(&self, queue: &QueueName) {
        if let Ok(mut a) = self.pending.lock()
            && let Some(c) = counts(&mut a, queue)
        {
            c.claims += 1;
        }
    }

    /// An attempt under `lease` ended with `outcome`.
    pub(super) fn settled(&self, lease: &Lease, outcome: &Outcome) {
        let event = match outcome {
            Outcome::Completed => None,
            Outcome::Fenced(FenceError::Fenced { current_epoch, current_owner, .. }) => Some((
                FenceEventKind::Fenced,
                "commit refused: a newer epoch holds the job".to_owned(),
                // 0 and no owner: the holder could not be read; the store reads the row instead.
                (*current_epoch > 0).then_some(*current_epoch),
                current_owner.clone(),
            )),
            Outcome::LeaseLost { reason: reason @ (LossReason::Superseded | LossReason::Unconfirmed) } => {
                let detail = match reason {
                    LossReason::Superseded => "lease lost: the database answered that another epoch holds the job",
                    _ => "lease lost: no heartbeat confirmed it before the worker's deadline",
                };
                Some((FenceEventKind::LeaseLost, detail.to_owned(), None, None))
            }
            _ => return,
        };
        let Ok(mut a) = self.pending.lock() else { return };
        if let Some(c) = counts(&mut a, &lease.queue) {
            match &event {
                None => c.commits += 1,
                Some((FenceEventKind::Fenced, ..)) => c.fenced += 1,
                Some(_) => c.lost += 1,
            }
        }
        if let Some((kind, detail, winner_epoch, winner_owner)) = event
            && a.events.len() < MAX_EVENTS
        {
            a.events.push(FenceEvent {
                queue: lease.queue.clone(),
                key: lease.key.clone(),
                kind,
                detail,
                epoch: lease.epoch,
                owner: lease.owner.clone(),
                winner_epoch,
                winner_owner,
            });
        }
    }

    /// What to write now: the events, and the counts when `counts`.
    fn take(&self, counts: bool) -> Activity {
        let Ok(mut a) = self.pending.lock() else { return Activity::default() };
        let events = std::mem::take(&mut a.events);
        let counts = if counts { std::mem::take(&mut a.counts) } else { Default::default() };
        Activity { counts, events }
    }

    /// Puts back what a failed flush could not write (bounded as above).
    fn put_back(&self, failed: Activity) {
        let Ok(mut a) = self.pending.lock() else { return };
        for (queue, c) in failed.counts {
            if let Some(e) = counts(&mut a, &queue) {
                e.claims += c.claims;
                e.commits += c.commits;
                e.fenced += c.fenced;
                e.lost += c.lost;
            }
        }
        let room = MAX_EVENTS.saturating_sub(a.events.len());
        let mut events: Vec<FenceEvent> = failed.events.into_iter().take(room).collect();
        events.append(&mut a.events);
        a.events = events;
    }
}

/// Flushes `recorder` to `store`: events every second, counts every `interval`, everything at
/// `stop` (the supervisor's shutdown or drop).
pub(super) async fn activity_loop(
    store: Arc<dyn FenceStore>,
    recorder: Arc<Recorder>,
    stop: CancellationToken,
    interval: Duration,
) {
    let mut since_counts = Duration::ZERO;
    loop {
        let stopping = tokio::select! {
            _ = tokio::time::sleep(EVENT_FLUSH) => false,
            _ = stop.cancelled() => true,
        };
        since_counts += EVENT_FLUSH;
        let counts = stopping || since_counts >= interval;
        if counts {
            since_counts = Duration::ZERO;
        }
        let activity = recorder.take(counts);
        // The last flush (at stop) is tried twice: there is no next one.
        for last_try in [!stopping, true] {
            if activity.is_empty() {
                break;
            }
            let limit = if stopping { FINAL_FLUSH_TIMEOUT } else { FLUSH_TIMEOUT };
            match tokio::time::timeout(limit, store.record_activity(&activity)).await {
                Ok(Ok(())) => break,
                Ok(Err(e)) if last_try && !stopping => {
                    tracing::warn!(error = %e, "could not record the dashboard's activity; kept for the next flush");
                    recorder.put_back(activity);
                    break;
                }
                Ok(Err(e)) if last_try => {
                    tracing::warn!(error = %e, "could not record the dashboard's last activity; dropped");
                }
                Ok(Err(_)) => {}
                Err(_) => {
                    // It may have committed meanwhile: never written twice, so dropped.
                    tracing::warn!(after = ?limit, "recording the dashboard's activity timed out; dropped");
                    break;
                }
            }
        }
        if stopping {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::{JobKey, Owner};

    fn lease(q: &str, k: &str) -> Lease {
        Lease {
            queue: QueueName::new(q).unwrap(),
            key: JobKey::new(k).unwrap(),
            owner: Owner::new("w").unwrap(),
            epoch: 3,
            lease_until: crate::lease::DbTime(0),
            attempts: 1,
            ttl: Duration::from_secs(30),
        }
    }

    #[test]
    fn dashboard_recorder_counts_outcomes_and_bounds_its_events() {
        let r = Recorder::default();
        let l = lease("q", "k");
        r.claimed(&l.queue);
        r.settled(&l, &Outcome::Completed);
        let fenced =
            FenceError::Fenced { key: "k".into(), epoch: 3, current_epoch: 4, current_owner: Some("b".into()) };
        for _ in 0..MAX_EVENTS + 5 {
            r.settled(&l, &Outcome::Fenced(clone_fenced(&fenced)));
        }
        r.settled(&l, &Outcome::LeaseLost { reason: LossReason::Superseded });
        r.settled(&l, &Outcome::Released);
        let events_only = r.take(false);
        assert!(events_only.counts.is_empty());
        assert_eq!(events_only.events.len(), MAX_EVENTS, "bounded");
        assert_eq!(
            (events_only.events[0].winner_epoch, events_only.events[0].winner_owner.as_deref()),
            (Some(4), Some("b"))
        );
        let all = r.take(true);
        let c = all.counts[&l.queue];
        assert_eq!((c.claims, c.commits, c.fenced, c.lost), (1, 1, MAX_EVENTS as u64 + 5, 1));
        r.put_back(all);
        assert_eq!(r.take(true).counts[&l.queue].claims, 1, "a failed flush's counts come back");
    }

    fn clone_fenced(e: &FenceError) -> FenceError {
        match e {
            FenceError::Fenced { key, epoch, current_epoch, current_owner } => FenceError::Fenced {
                key: key.clone(),
                epoch: *epoch,
                current_epoch: *current_epoch,
                current_owner: current_owner.clone(),
            },
            _ => unreachable!(),
        }
    }
}
