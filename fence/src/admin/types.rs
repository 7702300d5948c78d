//! The typed answers of the admin calls: queue status, one job, dead letters, requeue reports.

use crate::key::{JobKey, QueueName};
use crate::lease::{DbTime, JobState};

/// Jobs per state in one queue.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateCounts {
    /// Waiting to be claimed.
    pub pending: u64,
    /// Held under a lease (live or expired).
    pub running: u64,
    /// Failed, waiting for their backoff to pass.
    pub failed: u64,
    /// Dead letters.
    pub dead: u64,
    /// Completed (kept until retention prunes them).
    pub completed: u64,
}

impl StateCounts {
    /// All jobs of the queue.
    ///
    /// ```
    /// use brokerfence::admin::StateCounts;
    /// assert_eq!(StateCounts { pending: 2, dead: 1, ..StateCounts::default() }.total(), 3);
    /// ```
    pub fn total(&self) -> u64 {
        self.pending + self.running + self.failed + self.dead + self.completed
    }

    pub(crate) fn add(&mut self, state: JobState, n: u64) {
        match state {
            JobState::Pending => self.pending += n,
            JobState::Running => self.running += n,
            JobState::Failed => self.failed += n,
            JobState::Dead => self.dead += n,
            JobState::Completed => self.completed += n,
        }
    }
}

/// A running job, as the status shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningJob {
    /// Key.
    pub key: JobKey,
    /// The epoch of the holder's claim.
    pub epoch: i64,
    /// The holder.
    pub owner: Option<String>,
    /// Claims so far.
    pub attempts: i64,
    /// When the lease ends (database clock).
    pub lease_until: DbTime,
    /// Milliseconds left on the lease when the database answered; negative when the lease has
    /// ended that long ago (a stalled holder no claimer has taken over from yet).
    pub lease_left_ms: i64,
    /// When the job became due (its `run_at`: enqueued, or its backoff passed), so it has been
    /// waiting or running for at least `now - due_since`.
    pub due_since: DbTime,
}

impl RunningJob {
    /// True when the lease has ended.
    pub fn expired(&self) -> bool {
        self.lease_left_ms < 0
    }
}

/// One queue in a [`Status`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueStatus {
    /// The queue.
    pub queue: QueueName,
    /// Jobs per state.
    pub counts: StateCounts,
    /// Running jobs whose lease has ended (their holder stalled or died; the next claim takes
    /// them over).
    pub expired_leases: u64,
    /// The running job that has been due the longest (smallest `run_at`), if any is running.
    pub oldest_running: Option<RunningJob>,
    /// Running jobs whose lease ends within [`Admin::expiring_within`](crate::admin::Admin::expiring_within) (or has ended),
    /// soonest first, at most [`Admin::list_limit`](crate::admin::Admin::list_limit) of them.
    pub expiring: Vec<RunningJob>,
}

/// What [`Admin::status`](crate::admin::Admin::status) found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The database clock when the status was read.
    pub now: DbTime,
    /// The queues that have jobs, by name.
    pub queues: Vec<QueueStatus>,
}

/// One job, as [`Admin::job`](crate::admin::Admin::job) shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobInfo {
    /// Queue.
    pub queue: QueueName,
    /// Key.
    pub key: JobKey,
    /// State.
    pub state: JobState,
    /// The newest epoch handed out (the fencing token a holder must present).
    pub epoch: i64,
    /// Last owner (none after a requeue).
    pub owner: Option<String>,
    /// Claims so far (takeovers included; checked against the store's `max_claims`).
    pub attempts: i64,
    /// Handler failures so far (checked against `RetryPolicy::max_attempts`).
    pub failures: i64,
    /// Lease end (database clock), while running.
    pub lease_until: Option<DbTime>,
    /// Milliseconds left on the lease when the database answered (negative: ended that long ago).
    pub lease_left_ms: Option<i64>,
    /// When the job is (or was) due.
    pub run_at: DbTime,
    /// Last error (kept after a requeue; see [`Admin::requeue_dead`](crate::admin::Admin::requeue_dead)).
    pub last_error: Option<String>,
    /// When the row was created.
    pub created_at: DbTime,
    /// When the row last changed (claims, heartbeats, commits, failures).
    pub updated_at: DbTime,
    /// Bytes of the payload (table queue), if any.
    pub payload_bytes: Option<u64>,
    /// Bytes of the last checkpoint, if any.
    pub progress_bytes: Option<u64>,
    /// Bytes of the committed result, if any.
    pub result_bytes: Option<u64>,
    /// The database clock when the job was read.
    pub now: DbTime,
}

/// A dead letter, as [`Admin::dead`](crate::admin::Admin::dead) lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadJob {
    /// Queue.
    pub queue: QueueName,
    /// Key.
    pub key: JobKey,
    /// The epoch that buried it.
    pub epoch: i64,
    /// Its last owner.
    pub owner: Option<String>,
    /// Claims.
    pub attempts: i64,
    /// Handler failures.
    pub failures: i64,
    /// Why it died.
    pub last_error: Option<String>,
    /// When it died (the row's last change, database clock).
    pub died_at: DbTime,
    /// Milliseconds since it died, when the database answered.
    pub age_ms: i64,
}

/// Which dead jobs of a queue [`Admin::requeue_dead`](crate::admin::Admin::requeue_dead) gives another run.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Requeue {
    /// These keys (a key that is not dead is reported in [`RequeueReport::skipped`]).
    Keys(Vec<JobKey>),
    /// Every job of the queue that was dead when the call started (dead letters made while it
    /// runs are left for the next call, so the call ends even while jobs keep dying).
    AllDead,
}

/// A job [`Admin::requeue_dead`](crate::admin::Admin::requeue_dead) made pending again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Requeued {
    /// Key.
    pub key: JobKey,
    /// Its new epoch (one above the epoch it died under).
    pub epoch: i64,
}

/// A key [`Admin::requeue_dead`](crate::admin::Admin::requeue_dead) left alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// Key.
    pub key: JobKey,
    /// Its state (not dead), or `None` when the queue has no such job.
    pub state: Option<JobState>,
}

/// What [`Admin::requeue_dead`](crate::admin::Admin::requeue_dead) did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequeueReport {
    /// Jobs made pending, with their new epochs.
    pub requeued: Vec<Requeued>,
    /// Keys named that were not dead (or do not exist): nothing was changed for them.
    pub skipped: Vec<Skipped>,
    /// Statements (each its own short transaction) that changed rows.
    pub batches: u64,
}
