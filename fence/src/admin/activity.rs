//! What workers record for the dashboard: claims, commits, fenced rejections and lease losses
//! per queue and minute, and the fence events themselves (who lost a job to whom, at which
//! epochs). A [`Supervisor`](crate::Supervisor) gathers them in memory and hands them to
//! [`FenceStore::record_activity`](crate::FenceStore::record_activity): fence events within a
//! second of their happening (they are rare: a zombie, a takeover), the counts at most every
//! [`SupervisorConfig::activity_interval`](crate::SupervisorConfig::activity_interval) (20 s by
//! default), one statement per flush whatever the number of jobs. Nothing is added to a claim or
//! a commit statement.
//!
//! Storage is bounded: fence events live in a ring of [`FENCE_EVENT_SLOTS`] rows (the oldest is
//! overwritten), minutes are one row per queue and minute; both are deleted past
//! [`Retention::dashboard_age`](crate::retention::Retention::dashboard_age) by
//! [`FenceStore::prune`](crate::FenceStore::prune).

use std::collections::BTreeMap;

use crate::key::{JobKey, Owner, QueueName};

/// The default [`SupervisorConfig::activity_interval`](crate::SupervisorConfig::activity_interval): 20 s.
pub const DEFAULT_ACTIVITY_INTERVAL: std::time::Duration = std::time::Duration::from_secs(20);

/// How many fence events a schema keeps: a ring, the newest overwrites the oldest.
pub const FENCE_EVENT_SLOTS: i64 = 10_000;

/// Counts of one queue over some span of time.
///
/// ```
/// use brokerfence::admin::ActivityCounts;
/// let c = ActivityCounts { claims: 3, commits: 2, ..ActivityCounts::default() };
/// assert!(!c.is_empty());
/// assert!(ActivityCounts::default().is_empty());
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ActivityCounts {
    /// Attempts started (each under a claim).
    pub claims: u64,
    /// Results committed.
    pub commits: u64,
    /// Commits refused by the fence (a newer epoch held the job).
    pub fenced: u64,
    /// Leases lost while the handler ran (superseded, or not confirmed in time).
    pub lost: u64,
}

impl ActivityCounts {
    /// True when every count is zero.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// What happened to the loser of a [`FenceEvent`].
///
/// ```
/// use brokerfence::admin::FenceEventKind;
/// assert_eq!(FenceEventKind::parse("lease_lost"), Some(FenceEventKind::LeaseLost));
/// assert_eq!(FenceEventKind::Fenced.as_str(), "fenced");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FenceEventKind {
    /// A write of the loser (a commit, a failure record, a checkpoint) was refused.
    Fenced,
    /// The loser's lease was lost while its handler ran, which was cancelled.
    LeaseLost,
}

impl FenceEventKind {
    /// `fenced` or `lease_lost`, as stored.
    pub fn as_str(&self) -> &'static str {
        match self {
            FenceEventKind::Fenced => "fenced",
            FenceEventKind::LeaseLost => "lease_lost",
        }
    }

    /// The kind of a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "fenced" => Some(FenceEventKind::Fenced),
            "lease_lost" => Some(FenceEventKind::LeaseLost),
            _ => None,
        }
    }
}

/// One fenced rejection or lease loss, as a worker reports it.
///
/// ```
/// use brokerfence::admin::{FenceEvent, FenceEventKind};
/// use brokerfence::{JobKey, Owner, QueueName};
/// let e = FenceEvent {
///     queue: QueueName::new("orders")?,
///     key: JobKey::new("order-7")?,
///     kind: FenceEventKind::Fenced,
///     detail: "commit refused".into(),
///     epoch: 4,
///     owner: Owner::new("worker-a")?,
///     winner_epoch: Some(5),
///     winner_owner: Some("worker-b".into()),
/// };
/// assert_eq!(e.kind.as_str(), "fenced");
/// # Ok::<(), brokerfence::FenceError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceEvent {
    /// Queue.
    pub queue: QueueName,
    /// Key.
    pub key: JobKey,
    /// Fenced or lost.
    pub kind: FenceEventKind,
    /// In words: which write was refused, or why the lease was lost.
    pub detail: String,
    /// The loser's epoch.
    pub epoch: i64,
    /// The loser.
    pub owner: Owner,
    /// The epoch that superseded it, when the worker knows it (a refused commit names it);
    /// otherwise the store records the job row's epoch when the event is written.
    pub winner_epoch: Option<i64>,
    /// The owner that superseded it, likewise.
    pub winner_owner: Option<String>,
}

/// What one flush of a worker hands to
/// [`FenceStore::record_activity`](crate::FenceStore::record_activity).
///
/// ```
/// use brokerfence::admin::{Activity, ActivityCounts};
/// use brokerfence::QueueName;
/// let mut a = Activity::default();
/// a.counts.insert(QueueName::new("orders")?, ActivityCounts { claims: 1, ..Default::default() });
/// assert!(!a.is_empty());
/// # Ok::<(), brokerfence::FenceError>(())
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Activity {
    /// Counts per queue since the last flush (added to the database clock's current minute).
    pub counts: BTreeMap<QueueName, ActivityCounts>,
    /// Fence events since the last flush, oldest first.
    pub events: Vec<FenceEvent>,
}

impl Activity {
    /// True when there is nothing to write.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty() && self.counts.values().all(ActivityCounts::is_empty)
    }
}

/// `counts` as columns for a statement: queues, claims, commits, fenced, lost (non-empty only).
pub(crate) type CountColumns = (Vec<String>, Vec<i64>, Vec<i64>, Vec<i64>, Vec<i64>);

pub(crate) fn count_columns(activity: &Activity) -> CountColumns {
    let mut cols = CountColumns::default();
    let n = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    for (queue, c) in activity.counts.iter().filter(|(_, c)| !c.is_empty()) {
        cols.0.push(queue.as_str().to_owned());
        cols.1.push(n(c.claims));
        cols.2.push(n(c.commits));
        cols.3.push(n(c.fenced));
        cols.4.push(n(c.lost));
    }
    cols
}
