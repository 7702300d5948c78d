//! How a supervisor runs attempts: [`SupervisorConfig`] and its defaults.

use std::time::Duration;

use crate::lease::{LeaseDuration, RetryPolicy};

/// How a supervisor runs attempts.
///
/// ```
/// use std::time::Duration;
/// use brokerfence::{LeaseDuration, SupervisorConfig};
/// let config = SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap())
///     .attempt_timeout(Duration::from_secs(120));
/// assert_eq!(config.lease().heartbeat_interval(), Duration::from_secs(10));
/// assert_eq!(config.get_commit_window(), Duration::from_millis(5));
/// assert_eq!(config.get_hook_timeout(), Duration::from_secs(10)); // lease/3
/// assert_eq!(config.get_settle_timeout(), Duration::from_secs(60)); // 2 × lease, at least 30 s
/// ```
#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    pub(super) lease: LeaseDuration,
    pub(super) retry: RetryPolicy,
    pub(super) attempt_timeout: Option<Duration>,
    pub(super) commit_window: Duration,
    pub(super) hook_timeout: Option<Duration>,
    pub(super) settle_timeout: Option<Duration>,
    pub(super) cancel_on_loss: bool,
    pub(super) activity_interval: Duration,
}

use crate::admin::DEFAULT_ACTIVITY_INTERVAL;

/// The default [`SupervisorConfig::commit_window`]: 5 ms.
pub const DEFAULT_COMMIT_WINDOW: Duration = Duration::from_millis(5);

impl SupervisorConfig {
    /// Leases of `lease`, renewed every lease/3; the default retry policy; no attempt timeout;
    /// completions grouped by [`DEFAULT_COMMIT_WINDOW`].
    pub fn new(lease: LeaseDuration) -> Self {
        Self {
            lease,
            retry: RetryPolicy::default(),
            attempt_timeout: None,
            commit_window: DEFAULT_COMMIT_WINDOW,
            hook_timeout: None,
            settle_timeout: None,
            cancel_on_loss: true,
            activity_interval: DEFAULT_ACTIVITY_INTERVAL,
        }
    }

    /// How often the counts the dashboard charts (claims, commits, fenced rejections, lease
    /// losses per queue) are written: one statement per interval, whatever the number of jobs
    /// (default [`DEFAULT_ACTIVITY_INTERVAL`](crate::admin::DEFAULT_ACTIVITY_INTERVAL), at least 1 s). Fence events are written within a
    /// second of their happening. See [`crate::admin::Activity`].
    ///
    /// ```
    /// use std::time::Duration;
    /// use brokerfence::{LeaseDuration, SupervisorConfig};
    /// let config = SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap()).activity_interval(Duration::from_secs(60));
    /// assert_eq!(config.get_activity_interval(), Duration::from_secs(60));
    /// ```
    pub fn activity_interval(mut self, interval: Duration) -> Self {
        self.activity_interval = interval.max(Duration::from_secs(1));
        self
    }

    /// The [`activity_interval`](Self::activity_interval).
    pub fn get_activity_interval(&self) -> Duration {
        self.activity_interval
    }

    /// How long one call of a broker hook ([`LeaseHook`](crate::LeaseHook)) may take before it is dropped (a
    /// warning, and [`Counter::HookTimeouts`](crate::Counter::HookTimeouts); the database lease stands). Never more than the
    /// heartbeat interval, lease/3, which is also the default: a longer value is cut to it.
    ///
    /// Hooks run beside the heartbeat in tasks of their own, so a slow broker costs a visibility
    /// extension, never a renewal.
    ///
    /// ```
    /// use std::time::Duration;
    /// use brokerfence::{LeaseDuration, SupervisorConfig};
    /// let config = SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap());
    /// assert_eq!(config.clone().hook_timeout(Duration::from_secs(2)).get_hook_timeout(), Duration::from_secs(2));
    /// assert_eq!(config.hook_timeout(Duration::from_secs(60)).get_hook_timeout(), Duration::from_secs(10));
    /// ```
    pub fn hook_timeout(mut self, timeout: Duration) -> Self {
        self.hook_timeout = Some(timeout);
        self
    }

    /// The [`hook_timeout`](Self::hook_timeout) in force: at most lease/3.
    pub fn get_hook_timeout(&self) -> Duration {
        let most = self.lease.heartbeat_interval();
        self.hook_timeout.map_or(most, |t| t.min(most))
    }

    /// How long a finished attempt waits for the database's verdict on its commit, failure record
    /// or release (its lease is renewed all the while). Past it the outcome is
    /// [`Outcome::StoreError`](crate::Outcome::StoreError) with [`FenceError::CommitUnconfirmed`](crate::FenceError::CommitUnconfirmed): never acknowledged, and a
    /// redelivery finds the job committed or claimable. Default: twice the lease, at least 30 s.
    ///
    /// ```
    /// use std::time::Duration;
    /// use brokerfence::{LeaseDuration, SupervisorConfig};
    /// let config = SupervisorConfig::new(LeaseDuration::from_secs(5).unwrap());
    /// assert_eq!(config.get_settle_timeout(), Duration::from_secs(30));
    /// let config = config.settle_timeout(Duration::from_secs(12));
    /// assert_eq!(config.get_settle_timeout(), Duration::from_secs(12));
    /// ```
    pub fn settle_timeout(mut self, timeout: Duration) -> Self {
        self.settle_timeout = Some(timeout);
        self
    }

    /// The [`settle_timeout`](Self::settle_timeout) in force.
    pub fn get_settle_timeout(&self) -> Duration {
        self.settle_timeout.unwrap_or_else(|| (self.lease.get() * 2).max(Duration::from_secs(30)))
    }

    /// How long completions may gather into one commit statement while the committer is busy.
    ///
    /// A completion that finds the committer idle (no commit statement sent within the last
    /// `window`) is committed at once, and so is one while no other attempt runs (no other
    /// completion could join it): a lone job, or jobs handled one after another, wait for
    /// nothing. Otherwise the next statement leaves `window` after the previous one, carrying
    /// every completion that arrived meanwhile: under load the database sees about one commit
    /// statement per `window` whatever the rate of jobs (each completion is still its own
    /// compare-and-set), at the price of up to `window` more before each result is committed and
    /// acknowledged. `Duration::ZERO` sends a statement whenever one of the committer's two slots
    /// is free. The rule is [`Grouper`](crate::Grouper)'s.
    ///
    /// A statement costs the database far more than a row does (PostgreSQL 15 here: a claim and a
    /// commit of one job took 0.8 ms of its CPU together, of ten jobs 0.63 ms, of fifty 1.7 ms).
    /// In the SQS benchmark at ~2,500 jobs/s the default 5 ms window cut commit statements from
    /// one per 3.7 jobs to one per 14.
    ///
    /// ```
    /// use std::time::Duration;
    /// use brokerfence::{LeaseDuration, SupervisorConfig};
    /// let config = SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap())
    ///     .commit_window(Duration::from_millis(20)); // fewer, larger statements
    /// assert_eq!(config.get_commit_window(), Duration::from_millis(20));
    /// ```
    pub fn commit_window(mut self, window: Duration) -> Self {
        self.commit_window = window;
        self
    }

    /// The [`commit_window`](Self::commit_window).
    pub fn get_commit_window(&self) -> Duration {
        self.commit_window
    }

    /// Retry policy for failed attempts.
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Per-attempt deadline: an attempt still running after it fails (and is retried), with the
    /// last error "attempt timed out after …". It counts from when the handler starts: under a
    /// [`Consumer`](https://docs.rs/brokerfence/latest/brokerfence/struct.Consumer.html) that
    /// prefetches, a claimed job waiting for a handler slot has not started yet (its lease is
    /// heartbeated meanwhile).
    ///
    /// ```
    /// use std::time::Duration;
    /// use brokerfence::{LeaseDuration, SupervisorConfig};
    /// let config = SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap());
    /// assert_eq!(config.get_attempt_timeout(), None);
    /// let config = config.attempt_timeout(Duration::from_secs(120));
    /// assert_eq!(config.get_attempt_timeout(), Some(Duration::from_secs(120)));
    /// assert_eq!(config.without_attempt_timeout().get_attempt_timeout(), None);
    /// ```
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
        self
    }

    /// The [`attempt_timeout`](Self::attempt_timeout), if one is set.
    pub fn get_attempt_timeout(&self) -> Option<Duration> {
        self.attempt_timeout
    }

    /// No [`attempt_timeout`](Self::attempt_timeout) (the default). The consumer runtime gives
    /// its supervisor this and applies the timeout itself once a handler has its slot.
    pub fn without_attempt_timeout(mut self) -> Self {
        self.attempt_timeout = None;
        self
    }

    /// TEST ONLY (feature `guard-switches`): let a handler run on after its lease is lost.
    #[cfg(feature = "guard-switches")]
    #[doc(hidden)]
    pub fn without_cancel_on_loss(mut self) -> Self {
        self.cancel_on_loss = false;
        self
    }

    /// The lease length.
    pub fn lease(&self) -> LeaseDuration {
        self.lease
    }

    /// The retry policy.
    pub fn get_retry(&self) -> &RetryPolicy {
        &self.retry
    }

    /// The margin kept between the worker's own deadline and the lease's end: a tenth of the
    /// lease, between 100 ms and 2 s. It covers the round trip and clock-rate drift.
    pub fn safety_margin(&self) -> Duration {
        (self.lease.get() / 10).clamp(Duration::from_millis(100), Duration::from_secs(2))
    }
}
