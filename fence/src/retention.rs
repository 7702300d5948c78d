//! Retention: how long finished jobs and ledger entries are kept, and the pruning that deletes
//! them in bounded batches (issue 14).
//!
//! A completed job row is what deduplicates redeliveries of its key: while it exists, a claim of
//! the same key answers [`Claim::Done`](crate::Claim::Done) and the handler does not run again.
//! Once the row is pruned, the same key is a new job. So the completed age is the
//! **deduplication window** of a key. Epochs never repeat across that boundary: the pruner raises
//! a per-queue epoch floor (`epoch_floors`) to the highest epoch it deletes, in the same
//! transaction, and every new row of the queue starts above it. A receiver's ledger that kept
//! epoch 3 for a key accepts the new job's epoch (at least 4) and still refuses 1..=3.
//!
//! ```no_run
//! # async fn demo(store: &dyn brokerfence::FenceStore) -> brokerfence::Result<()> {
//! use std::time::Duration;
//! use brokerfence::QueueName;
//! use brokerfence::retention::{QueueRetention, Retention};
//! let retention = Retention::new()
//!     .queue(QueueName::new("orders")?, QueueRetention::default()) // 15 days completed, 30 days dead
//!     .queue(QueueName::new("clicks")?, QueueRetention::completed_for(Duration::from_secs(3600)))
//!     .ledger("payments-api", Duration::from_secs(15 * 86_400));
//! let report = store.prune(&retention).await?;
//! println!("{report:?}");
//! # Ok(()) }
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use crate::key::QueueName;

/// The default age of a completed job: 15 days. SQS keeps an undeleted message for up to
/// 14 days (`MessageRetentionPeriod` at its maximum), so a message acknowledged late, or
/// redelivered after a lost acknowledgement, can come back up to 14 days after its first
/// delivery; a completed key must still deduplicate it then. One day of margin covers clock skew
/// between the broker and the database, and a pruner that ran late. A Redis stream keeps entries
/// until it is trimmed and a Redis list item until it is popped: choose an age at least as long as
/// an entry can be redelivered there.
pub const DEFAULT_COMPLETED_AGE: Duration = Duration::from_secs(15 * 86_400);

/// The default age of a dead job: 30 days. A dead job is kept for people: to read its last error,
/// and to decide whether to run it again, which takes longer than a broker's horizon. Until it is
/// pruned, redeliveries of its key answer [`Claim::Dead`](crate::Claim::Dead).
pub const DEFAULT_DEAD_AGE: Duration = Duration::from_secs(30 * 86_400);

/// The default age of a ledger entry (per receiver scope): 15 days, the completed age. A ledger
/// row refuses a zombie's older epoch; once it is pruned, a call with any epoch of that job is
/// accepted as the first one. Keep it at least as long as a superseded attempt could still call
/// the receiver (far shorter than days in practice: handlers have time limits), and no shorter
/// than the job rows whose epochs it judges.
pub const DEFAULT_LEDGER_AGE: Duration = Duration::from_secs(15 * 86_400);

/// The default rows per pruning transaction: 1,000 (a few milliseconds of locks on PostgreSQL).
pub const DEFAULT_PRUNE_BATCH: u32 = 1_000;

/// The default interval of the background pruner of the consumer runtime: 5 minutes.
pub const DEFAULT_PRUNE_EVERY: Duration = Duration::from_secs(300);

/// How long a queue's finished jobs are kept, per terminal state. `None` keeps them forever.
/// Pending, running and failed jobs are never pruned.
///
/// ```
/// use std::time::Duration;
/// use brokerfence::retention::QueueRetention;
/// let r = QueueRetention::default();
/// assert_eq!(r.completed, Some(Duration::from_secs(15 * 86_400)));
/// assert_eq!(r.dead, Some(Duration::from_secs(30 * 86_400)));
/// assert_eq!(QueueRetention::forever().completed, None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueRetention {
    /// Age (since the row last changed, on the database clock) after which a completed job is
    /// deleted: the deduplication window of its key. Default [`DEFAULT_COMPLETED_AGE`].
    pub completed: Option<Duration>,
    /// Age after which a dead job is deleted. Default [`DEFAULT_DEAD_AGE`].
    pub dead: Option<Duration>,
}

impl Default for QueueRetention {
    fn default() -> Self {
        Self { completed: Some(DEFAULT_COMPLETED_AGE), dead: Some(DEFAULT_DEAD_AGE) }
    }
}

impl QueueRetention {
    /// Keeps every finished job forever (the behaviour before retention existed).
    pub fn forever() -> Self {
        Self { completed: None, dead: None }
    }

    /// Completed jobs kept for `age`, dead ones for the default [`DEFAULT_DEAD_AGE`].
    pub fn completed_for(age: Duration) -> Self {
        Self { completed: Some(age), ..Self::default() }
    }

    /// Dead jobs kept for `age` (builder form).
    pub fn dead_for(mut self, age: Duration) -> Self {
        self.dead = Some(age);
        self
    }
}

/// A retention policy: per queue and terminal state, per ledger scope, and how pruning runs.
///
/// Queues and ledger scopes are listed explicitly: pruning reads an index by (queue, state, age)
/// or (scope, age), so it must know the queue; a queue not listed is never pruned.
///
/// ```
/// use std::time::Duration;
/// use brokerfence::QueueName;
/// use brokerfence::retention::{QueueRetention, Retention};
/// let r = Retention::new()
///     .queue(QueueName::new("orders").unwrap(), QueueRetention::default())
///     .ledger("billing", Duration::from_secs(86_400))
///     .batch_size(500)
///     .every(Duration::from_secs(60));
/// assert_eq!(r.queues().count(), 1);
/// assert_eq!(r.get_batch_size(), 500);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Retention {
    queues: BTreeMap<QueueName, QueueRetention>,
    ledger: BTreeMap<String, Duration>,
    batch: u32,
    every: Duration,
    pause: Duration,
    dashboard: Duration,
}

/// The default [`Retention::dashboard_age`]: 7 days.
pub const DEFAULT_DASHBOARD_AGE: Duration = Duration::from_secs(7 * 24 * 3600);

impl Default for Retention {
    fn default() -> Self {
        Self::new()
    }
}

impl Retention {
    /// No queue, no ledger scope; batches of [`DEFAULT_PRUNE_BATCH`], background runs every
    /// [`DEFAULT_PRUNE_EVERY`], 10 ms between batches.
    pub fn new() -> Self {
        Self {
            queues: BTreeMap::new(),
            ledger: BTreeMap::new(),
            batch: DEFAULT_PRUNE_BATCH,
            every: DEFAULT_PRUNE_EVERY,
            pause: Duration::from_millis(10),
            dashboard: DEFAULT_DASHBOARD_AGE,
        }
    }

    /// Age past which the dashboard's activity minutes and fence events are deleted (default
    /// [`DEFAULT_DASHBOARD_AGE`]); every prune deletes them, whichever queues it names.
    ///
    /// ```
    /// use std::time::Duration;
    /// use brokerfence::retention::Retention;
    /// let r = Retention::new().dashboard_age(Duration::from_secs(3600));
    /// assert_eq!(r.get_dashboard_age(), Duration::from_secs(3600));
    /// ```
    pub fn dashboard_age(mut self, age: Duration) -> Self {
        self.dashboard = age;
        self
    }

    /// The [`dashboard_age`](Self::dashboard_age).
    pub fn get_dashboard_age(&self) -> Duration {
        self.dashboard
    }

    /// Prunes `queue` by `policy`.
    pub fn queue(mut self, queue: QueueName, policy: QueueRetention) -> Self {
        self.queues.insert(queue, policy);
        self
    }

    /// Prunes the ledger rows of receiver `scope` not updated for `age` (see
    /// [`DEFAULT_LEDGER_AGE`]).
    pub fn ledger(mut self, scope: impl Into<String>, age: Duration) -> Self {
        self.ledger.insert(scope.into(), age);
        self
    }

    /// Rows deleted per transaction (at least 1; default [`DEFAULT_PRUNE_BATCH`]).
    pub fn batch_size(mut self, n: u32) -> Self {
        self.batch = n.max(1);
        self
    }

    /// How often the consumer runtime's background pruner runs (default [`DEFAULT_PRUNE_EVERY`]).
    pub fn every(mut self, interval: Duration) -> Self {
        self.every = interval.max(Duration::from_millis(10));
        self
    }

    /// The pause between two batches, which lets other writers in (default 10 ms).
    pub fn pause_between_batches(mut self, pause: Duration) -> Self {
        self.pause = pause;
        self
    }

    /// The queues and their policies.
    pub fn queues(&self) -> impl Iterator<Item = (&QueueName, &QueueRetention)> {
        self.queues.iter()
    }

    /// The ledger scopes and their ages.
    pub fn ledger_scopes(&self) -> impl Iterator<Item = (&str, Duration)> {
        self.ledger.iter().map(|(s, d)| (s.as_str(), *d))
    }

    /// Rows per transaction.
    pub fn get_batch_size(&self) -> u32 {
        self.batch
    }

    /// The background interval.
    pub fn get_every(&self) -> Duration {
        self.every
    }

    /// The pause between batches.
    pub fn get_pause_between_batches(&self) -> Duration {
        self.pause
    }

    /// Every (queue, state, age) to prune, in order: completed before dead, per queue.
    pub(crate) fn targets(&self) -> Vec<(&QueueName, &'static str, Duration)> {
        let mut out = Vec::new();
        for (q, p) in &self.queues {
            if let Some(age) = p.completed {
                out.push((q, "completed", age));
            }
            if let Some(age) = p.dead {
                out.push((q, "dead", age));
            }
        }
        out
    }
}

/// What one [`FenceStore::prune`](crate::FenceStore::prune) call deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PruneReport {
    /// Completed jobs deleted.
    pub completed: u64,
    /// Dead jobs deleted.
    pub dead: u64,
    /// Ledger rows deleted.
    pub ledger: u64,
    /// Transactions that deleted rows.
    pub batches: u64,
    /// True when another pruner was at work (PostgreSQL: it held the pruner lock), so this call
    /// stopped without finishing; the next run carries on.
    pub contended: bool,
    /// Queues left for the next run because their floor lock stayed held past the pruner's wait
    /// (PostgreSQL, 100 ms): a claim of the queue kept it (claims hold it for their short
    /// transaction). Each is also logged as a warning; the run goes on with the next queue.
    pub floor_busy: u64,
    /// The dashboard's activity minutes and fence events deleted (older than
    /// [`Retention::dashboard_age`]).
    pub dashboard: u64,
}

impl PruneReport {
    /// Rows deleted in all.
    pub fn total(&self) -> u64 {
        self.completed + self.dead + self.ledger + self.dashboard
    }
}

/// Milliseconds of a duration for a statement parameter (saturating).
pub(crate) fn age_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_skip_kept_forever_states() {
        const DAY: Duration = Duration::from_secs(86_400);
        let q = QueueName::new("q").unwrap();
        let r = Retention::new().queue(q.clone(), QueueRetention { completed: Some(DAY), dead: None });
        assert_eq!(r.targets(), vec![(&q, "completed", DAY)]);
    }
}
