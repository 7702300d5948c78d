//! The data the fence hands out: leases, claim outcomes, job records.

use std::fmt;
use std::time::Duration;

use crate::error::{FenceError, Result};
use crate::key::{JobKey, Owner, QueueName};

/// Shortest lease accepted. Heartbeats run every lease/3, so a 3 s lease renews every second.
pub const MIN_LEASE: Duration = Duration::from_secs(3);

/// How long a claim holds a job without a heartbeat, judged on the database clock.
///
/// ```
/// use std::time::Duration;
/// use brokerfence::LeaseDuration;
/// let lease = LeaseDuration::new(Duration::from_secs(30)).unwrap();
/// assert_eq!(lease.heartbeat_interval(), Duration::from_secs(10));
/// assert!(LeaseDuration::new(Duration::from_secs(1)).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LeaseDuration(Duration);

impl LeaseDuration {
    /// Validates a lease length: at least [`MIN_LEASE`], at most one day.
    pub fn new(lease: Duration) -> Result<Self> {
        if lease < MIN_LEASE {
            return Err(FenceError::LeaseTooShort { lease, min: MIN_LEASE });
        }
        if lease > Duration::from_secs(86_400) {
            return Err(FenceError::invalid("lease", format!("LeaseDuration::new: {lease:?} is longer than one day")));
        }
        Ok(Self(lease))
    }

    /// A lease of whole seconds.
    pub fn from_secs(secs: u64) -> Result<Self> {
        Self::new(Duration::from_secs(secs))
    }

    /// The length.
    pub fn get(self) -> Duration {
        self.0
    }

    /// Milliseconds, as bound into statements.
    #[doc(hidden)]
    pub fn as_millis_i64(self) -> i64 {
        i64::try_from(self.0.as_millis()).unwrap_or(i64::MAX)
    }

    /// How often a holder renews: a third of the lease.
    pub fn heartbeat_interval(self) -> Duration {
        self.0 / 3
    }
}

/// A point in time on the database clock, in milliseconds since the Unix epoch.
///
/// Only the database produces these; the worker's own wall clock is never consulted for leases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DbTime(pub i64);

impl fmt::Display for DbTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:03}", self.0.div_euclid(1000), self.0.rem_euclid(1000))
    }
}

/// The lifecycle of a job row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum JobState {
    /// Waiting to be claimed (new, or released).
    Pending,
    /// Held under a lease.
    Running,
    /// Finished; its result is committed. Further deliveries are duplicates.
    Completed,
    /// An attempt failed; claimable again once `run_at` is due.
    Failed,
    /// Out of attempts (or failed without retry); dead-lettered.
    Dead,
}

impl JobState {
    /// The name stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "pending",
            JobState::Running => "running",
            JobState::Completed => "completed",
            JobState::Failed => "failed",
            JobState::Dead => "dead",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "pending" => JobState::Pending,
            "running" => JobState::Running,
            "completed" => JobState::Completed,
            "failed" => JobState::Failed,
            "dead" => JobState::Dead,
            other => return Err(FenceError::Corrupt(format!("unknown job state {other:?}"))),
        })
    }
}

impl fmt::Display for JobState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Proof of one claim: the fencing token every later write must present.
///
/// `epoch` is the fencing token: it grows by one on every claim of the job and never decreases.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Queue of the job.
    pub queue: QueueName,
    /// Key of the job.
    pub key: JobKey,
    /// The fencing token of this claim.
    pub epoch: i64,
    /// Who holds it.
    pub owner: Owner,
    /// When it lapses, on the database clock.
    pub lease_until: DbTime,
    /// Time left on the lease when the database answered (database clock), so a worker can keep a
    /// monotonic deadline without trusting its own wall clock.
    pub ttl: Duration,
    /// Attempts so far, this one included.
    pub attempts: i64,
}

/// The outcome of claiming one key.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Claim {
    /// The job is yours under this lease.
    Claimed(Lease),
    /// Another owner holds a live lease.
    Busy {
        /// The holder.
        owner: Option<String>,
        /// The holder's epoch.
        epoch: i64,
        /// When the holder's lease lapses (database clock).
        lease_until: DbTime,
        /// Time left on the holder's lease when the database answered.
        ttl: Duration,
    },
    /// Already completed: the delivery is a duplicate.
    Done {
        /// The epoch that completed it.
        epoch: i64,
    },
    /// Dead-lettered earlier (out of attempts): the delivery is a duplicate of a dead job.
    Dead {
        /// The epoch that buried it.
        epoch: i64,
    },
    /// Failed and waiting for its backoff to pass (database clock).
    Backoff {
        /// The epoch of the failed attempt.
        epoch: i64,
        /// Time left until it may run again.
        retry_in: Duration,
    },
}

impl Claim {
    /// The lease, when claimed.
    pub fn lease(&self) -> Option<&Lease> {
        match self {
            Claim::Claimed(l) => Some(l),
            _ => None,
        }
    }
}

/// A job handed out by the table queue's `claim_next`: the lease and the stored payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedJob {
    /// The lease.
    pub lease: Lease,
    /// The payload given to `enqueue`.
    pub payload: Vec<u8>,
    /// The last checkpoint of an earlier attempt, if any.
    pub progress: Option<Vec<u8>>,
    /// The producer's trace context, as `enqueue` stored it (feature `otel`).
    #[cfg(feature = "otel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
    pub trace: Option<crate::otel::TraceContext>,
}

/// What one batched heartbeat found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Heartbeat {
    /// Leases the database confirmed and extended (with their new `lease_until`/`ttl`).
    pub renewed: Vec<Lease>,
    /// Leases that matched no row: superseded, completed or released. Their holders must stop.
    pub lost: Vec<Lease>,
    /// Leases neither renewed nor lost: their row is locked by another transaction (usually the
    /// handler's own, after [`JobContext::complete_in`](crate::JobContext::complete_in), or a
    /// commit in flight), and its last committed state is still this lease. Nobody can claim the
    /// row while that lock is held, but the lease's end on the database clock has not moved: the
    /// holder keeps its old deadline.
    pub held: Vec<Lease>,
}

/// When a failed attempt may run again, and when a job is given up.
///
/// ```
/// use std::time::Duration;
/// use brokerfence::RetryPolicy;
/// let p = RetryPolicy::default();
/// assert_eq!(p.backoff(1), Duration::from_secs(1));
/// assert_eq!(p.backoff(3), Duration::from_secs(4));
/// assert_eq!(p.backoff(60), p.max_backoff);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Handler failures after which a failure is final (the job goes `dead`, its last error
    /// naming this cap). Takeovers of stalled holders do not count: the stores cap claims
    /// apart (`max_claims`, see [`RetryPolicy::max_claims`]).
    pub max_attempts: i64,
    /// Backoff after the first failed attempt; doubles per attempt.
    pub base_backoff: Duration,
    /// Upper bound of the backoff.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self { max_attempts: 5, base_backoff: Duration::from_secs(1), max_backoff: Duration::from_secs(300) }
    }
}

impl RetryPolicy {
    /// No retries: the first failure is final.
    pub fn never() -> Self {
        Self { max_attempts: 1, ..Self::default() }
    }

    /// The cap on claims this policy suggests for a store (`max_claims`): claims count
    /// takeovers of stalled holders too, so it sits well above `max_attempts`:
    /// `max(4 × max_attempts, 20)`.
    ///
    /// ```
    /// use brokerfence::RetryPolicy;
    /// assert_eq!(RetryPolicy::default().max_claims(), 20);
    /// assert_eq!(RetryPolicy { max_attempts: 10, ..RetryPolicy::default() }.max_claims(), 40);
    /// ```
    pub fn max_claims(&self) -> i64 {
        self.max_attempts.saturating_mul(4).max(20)
    }

    /// Backoff after failure number `attempts`: `base * 2^(attempts-1)`, capped. The stores
    /// count failures (not claims) for it: a takeover does not lengthen the backoff.
    pub fn backoff(&self, attempts: i64) -> Duration {
        let exp = u32::try_from(attempts.saturating_sub(1).clamp(0, 30)).unwrap_or(30);
        self.base_backoff.saturating_mul(1u32 << exp).min(self.max_backoff)
    }
}

/// What a fenced failure did to the job.
#[non_exhaustive]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailOutcome {
    /// Claimable again once `retry_in` has passed.
    Retry {
        /// The backoff.
        retry_in: Duration,
    },
    /// Given up: the job is `dead`.
    Dead,
}

/// A job row as stored (for inspection and tests).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobRecord {
    /// Queue.
    pub queue: QueueName,
    /// Key.
    pub key: JobKey,
    /// State.
    pub state: JobState,
    /// The newest epoch handed out.
    pub epoch: i64,
    /// Last owner.
    pub owner: Option<String>,
    /// Lease end (database clock), when running.
    pub lease_until: Option<DbTime>,
    /// Claims so far (each claim counts, a takeover of a stalled holder too; a release gives
    /// one back).
    pub attempts: i64,
    /// Handler failures so far (each [`fail`](crate::FenceStore::fail) counts one): what
    /// [`RetryPolicy::max_attempts`] and the backoff count.
    pub failures: i64,
    /// When it is due (database clock).
    pub run_at: DbTime,
    /// Payload.
    pub payload: Option<Vec<u8>>,
    /// Last checkpoint.
    pub progress: Option<Vec<u8>>,
    /// Committed result.
    pub result: Option<Vec<u8>>,
    /// Last error.
    pub last_error: Option<String>,
}

pub(crate) fn millis(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}
