//! [`ConsumerConfig`]: how a consumer runs (concurrency, batches, the claim window, grace,
//! acknowledgement batching, the unsettled bound, retention).

use std::time::Duration;

use fence::SupervisorConfig;
use tokio::sync::Semaphore;

/// How a consumer runs.
///
/// Every configuration and builder type of the crate follows one naming convention: a setting is
/// set by a method named after it that takes `self` and returns `Self` (`concurrency(32)`), and
/// read back by `get_` and the same name (`get_concurrency()`); what `new` takes is read back
/// under its own name (`supervisor()`).
///
/// ```
/// use brokerfence::{LeaseDuration, SupervisorConfig};
/// let config = brokerfence::ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap()))
///     .concurrency(32)
///     .batch(10);
/// assert_eq!(config.get_concurrency(), 32);
/// ```
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    pub(super) supervisor: SupervisorConfig,
    pub(super) concurrency: usize,
    pub(super) prefetch: Option<usize>,
    pub(super) batch: Option<usize>,
    pub(super) claim_window: Option<Duration>,
    pub(super) grace: Duration,
    pub(super) ack_batch: usize,
    pub(super) ack_linger: Duration,
    pub(super) max_unsettled: Option<usize>,
    pub(super) retention: Option<fence::retention::Retention>,
}

/// The default [`ConsumerConfig::claim_window`] of a consumer that prefetches: 5 ms. A consumer
/// that does not prefetch claims without a window by default (see
/// [`claim_window`](ConsumerConfig::claim_window)).
pub const DEFAULT_CLAIM_WINDOW: Duration = Duration::from_millis(5);

impl ConsumerConfig {
    /// 16 jobs at once, batches of the source's [`Source::default_batch`](crate::Source::default_batch)
    /// (10 for a broker, 64 for the table queue), claims sent as claim slots free up (no claim
    /// window unless prefetching: see [`claim_window`](Self::claim_window)), 30 s shutdown
    /// grace, acks batched by 10 or 20 ms.
    pub fn new(supervisor: SupervisorConfig) -> Self {
        Self {
            supervisor,
            concurrency: 16,
            prefetch: None,
            batch: None,
            claim_window: None,
            grace: Duration::from_secs(30),
            ack_batch: 10,
            ack_linger: Duration::from_millis(20),
            max_unsettled: None,
            retention: None,
        }
    }
    /// Prunes finished jobs (and ledger rows) by `retention` in the background while the
    /// consumer runs: one run at start, then one every
    /// [`Retention::every`](fence::retention::Retention::every), each through
    /// [`FenceStore::prune`](fence::FenceStore::prune) (bounded batches; at most one pruner at a
    /// time across processes on PostgreSQL, so every worker may have this on). A run that fails
    /// is logged and tried again at the next interval; a store without pruning
    /// ([`FenceError::Unsupported`](fence::FenceError::Unsupported)) stops the pruner with a
    /// warning. Off by default: nothing is ever deleted unless this is set (or `prune` called).
    ///
    /// ```
    /// use brokerfence::{LeaseDuration, QueueName, SupervisorConfig};
    /// use brokerfence::retention::{QueueRetention, Retention};
    /// let retention = Retention::new().queue(QueueName::new("emails").unwrap(), QueueRetention::default());
    /// let config = brokerfence::ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap()))
    ///     .retention(retention);
    /// assert!(config.get_retention().is_some());
    /// ```
    pub fn retention(mut self, retention: fence::retention::Retention) -> Self {
        self.retention = Some(retention);
        self
    }
    /// The background retention policy, if any (see [`retention`](Self::retention)).
    pub fn get_retention(&self) -> Option<&fence::retention::Retention> {
        self.retention.as_ref()
    }
    /// Jobs running at once.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }
    /// Prefetching: up to `n` deliveries are held ahead of the handlers (received, being
    /// claimed, or claimed and waiting for a handler slot under a heartbeated lease), on top of
    /// the `concurrency` handlers running. `prefetch(0)` turns it off: one slot then covers a
    /// delivery from its receive until its handler returns, so a worker never holds more than
    /// `concurrency` deliveries. Not set, the source's
    /// [`default_prefetch`](crate::Source::default_prefetch) applies: none for the brokers,
    /// twice `concurrency` (at most 256) for the table queue.
    ///
    /// ```
    /// use brokerfence::{LeaseDuration, SupervisorConfig};
    /// let config = brokerfence::ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap()));
    /// assert_eq!(config.get_prefetch(), None); // the source's default
    /// assert_eq!(config.clone().prefetch(0).get_prefetch(), Some(0)); // off
    /// assert_eq!(config.prefetch(64).get_prefetch(), Some(64));
    /// ```
    pub fn prefetch(mut self, n: usize) -> Self {
        self.prefetch = Some(n);
        self
    }
    /// The prefetch set with [`prefetch`](Self::prefetch) (`Some(0)`: off), if any.
    pub fn get_prefetch(&self) -> Option<usize> {
        self.prefetch
    }
    /// This configuration with the source's default prefetch where none was set: what a
    /// [`Consumer`](crate::Consumer) runs with.
    pub(super) fn with_default_prefetch(mut self, source_default: usize) -> Self {
        self.prefetch.get_or_insert(source_default);
        self
    }
    /// The places ahead of the handlers, when prefetching.
    pub(super) fn prefetching(&self) -> Option<usize> {
        self.prefetch.filter(|&n| n > 0)
    }
    /// Deliveries asked for per receive, at most: a receive asks for what is free then (and what
    /// frees up within a 2 ms linger), up to this many and never more than the receive places
    /// (`prefetch`, else `concurrency`). Without it, the source's
    /// [`default_batch`](crate::Source::default_batch) applies: 10 for the brokers (one SQS
    /// `ReceiveMessage` returns at most 10), 64 for the table queue, whose receive *is* the claim
    /// statement, so the batch is how many jobs one statement hands out: with 10, a consumer
    /// over the table queue could start at most ten jobs per claim round trip and stopped
    /// scaling past concurrency 64 (8,892 jobs/s at 64 and 8,476 at 128 against 14,659 and
    /// 22,859 for a plain SKIP LOCKED loop claiming 64 at a time).
    ///
    /// ```
    /// use brokerfence::{LeaseDuration, SupervisorConfig};
    /// let config = brokerfence::ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap()));
    /// assert_eq!(config.get_batch(), None); // the source's default
    /// assert_eq!(config.batch(32).get_batch(), Some(32));
    /// ```
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = Some(n.max(1));
        self
    }
    /// The batch set with [`batch`](Self::batch), if any.
    pub fn get_batch(&self) -> Option<usize> {
        self.batch
    }
    /// How long received deliveries may gather into one claim statement while claims are busy:
    /// the same rule as the supervisor's
    /// [`commit_window`](fence::SupervisorConfig::commit_window). Deliveries that find the
    /// claimer idle (no claim sent within the last `window`) are claimed at once, and so are
    /// deliveries while no more can come: no attempt runs (deliveries that come one at a time), or
    /// the receive loop has no free place to receive into. Otherwise the next claim leaves `window`
    /// after the previous one with every delivery received meanwhile, so a busy consumer sends
    /// about one claim statement per `window` (and one commit statement per commit window)
    /// whatever its rate, and a job may start up to `window` later. A delivery keeps its place
    /// (its concurrency slot, or its prefetch place when prefetching) until its handler starts,
    /// so leave room for about rate × (receive time + window + claim time) deliveries there:
    /// measured on SQS at 2,500 msg/s, with 32 prefetch places the receive loop waited for a place
    /// before 14 % of its receives, with 64 before none.
    /// `Duration::ZERO` claims each receive as soon as one of the 4 claim slots is free;
    /// deliveries then group only while all four statements are out.
    ///
    /// The default follows [`prefetch`](Self::prefetch). Without prefetching a delivery waits
    /// for its claim in its concurrency slot, so a window is time the slot stands idle: the
    /// default is zero (with a 5 ms window, 1 ms handlers over a Redis stream reached 0.35–0.38
    /// of a plain `XREADGROUP`/`XACK` consumer, 0.51–0.62 without; `bench_redis --work-ms 1`,
    /// 32 jobs at once). A prefetching consumer claims ahead of its handlers, so the window costs
    /// them nothing and saves statements: its default is 5 ms. Sources
    /// that claim in their own receive (the table queue) are not affected.
    ///
    /// ```
    /// use std::time::Duration;
    /// use brokerfence::{LeaseDuration, SupervisorConfig};
    /// let config = brokerfence::ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap()))
    ///     .claim_window(Duration::from_millis(10));
    /// assert_eq!(config.get_claim_window(), Duration::from_millis(10));
    /// ```
    pub fn claim_window(mut self, window: Duration) -> Self {
        self.claim_window = Some(window);
        self
    }
    /// The [`claim_window`](Self::claim_window): the one set, else zero, or
    /// 5 ms when prefetching.
    ///
    /// ```
    /// use std::time::Duration;
    /// use brokerfence::{ConsumerConfig, LeaseDuration, SupervisorConfig};
    /// let config = ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap()));
    /// assert_eq!(config.clone().get_claim_window(), Duration::ZERO);
    /// assert_eq!(config.prefetch(64).get_claim_window(), Duration::from_millis(5));
    /// ```
    pub fn get_claim_window(&self) -> Duration {
        self.claim_window.unwrap_or(if self.prefetching().is_some() { DEFAULT_CLAIM_WINDOW } else { Duration::ZERO })
    }
    /// How long shutdown waits for running jobs before releasing their leases.
    pub fn grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }
    /// Acknowledgements per broker call, and how long to wait to fill a batch.
    pub fn ack_batching(mut self, max: usize, linger: Duration) -> Self {
        self.ack_batch = max.max(1);
        self.ack_linger = linger;
        self
    }
    /// At most `n` deliveries unsettled at once: received and not yet settled at the broker
    /// (acknowledged, dead-lettered, hidden, given back, or left). A delivery holds its unsettled
    /// place from its receive until the broker call that settles it returned, so a broker that
    /// hangs (a DeleteMessageBatch that never answers) stops the receive loop after `n`
    /// deliveries instead of letting finished jobs pile up in memory: backpressure, never a
    /// dropped acknowledgement. The default is 4 × (`concurrency` + `prefetch`) + 4 ×
    /// [`ack_batching`](Self::ack_batching)'s `max`: room for commits and acks to overlap the
    /// next jobs. A bound below the receive places (`prefetch`, else `concurrency`) holds fewer
    /// deliveries ahead; at least 1.
    ///
    /// ```
    /// use brokerfence::{LeaseDuration, SupervisorConfig};
    /// let config = brokerfence::ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap()))
    ///     .concurrency(8);
    /// assert_eq!(config.get_max_unsettled(), 4 * 8 + 4 * 10);
    /// assert_eq!(config.max_unsettled(100).get_max_unsettled(), 100);
    /// ```
    pub fn max_unsettled(mut self, n: usize) -> Self {
        self.max_unsettled = Some(n.max(1));
        self
    }
    /// The bound on unsettled deliveries (see [`max_unsettled`](Self::max_unsettled)).
    pub fn get_max_unsettled(&self) -> usize {
        self.max_unsettled
            .unwrap_or_else(|| {
                4usize
                    .saturating_mul(self.concurrency.saturating_add(self.prefetch.unwrap_or(0)))
                    .saturating_add(4usize.saturating_mul(self.ack_batch))
            })
            .min(Semaphore::MAX_PERMITS)
    }
    /// Receive places: deliveries held ahead of the handlers (`prefetch`), else `concurrency`.
    pub(super) fn places(&self) -> usize {
        self.prefetching().unwrap_or(self.concurrency)
    }
    /// The concurrency limit.
    pub fn get_concurrency(&self) -> usize {
        self.concurrency
    }
    /// The supervisor configuration.
    pub fn supervisor(&self) -> &SupervisorConfig {
        &self.supervisor
    }
}
