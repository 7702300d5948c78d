//! The consumer runtime shared by every source: receive, claim in one batch, supervise under the
//! lease, commit through the fence, then tell the broker.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use fence::{
    Claim, Counter, Distribution, FenceStore, Grouper, JobKey, Lease, LeaseHook, Metrics, Owner, Supervisor,
    SupervisorConfig,
};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use tokio::sync::mpsc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::disposition::Disposition;
use crate::handler::Handler;
use crate::source::{Incoming, Source, SourceError};

/// How a consumer runs.
///
/// ```
/// use brokerfence::{LeaseDuration, SupervisorConfig};
/// let config = brokerfence::ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap()))
///     .concurrency(32)
///     .batch(10);
/// assert_eq!(config.concurrency_limit(), 32);
/// ```
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    supervisor: SupervisorConfig,
    concurrency: usize,
    prefetch: Option<usize>,
    batch: Option<usize>,
    claim_window: Duration,
    grace: Duration,
    ack_batch: usize,
    ack_linger: Duration,
    max_unsettled: Option<usize>,
    retention: Option<fence::Retention>,
}

/// The default [`ConsumerConfig::claim_window`]: 5 ms.
pub const DEFAULT_CLAIM_WINDOW: Duration = Duration::from_millis(5);

impl ConsumerConfig {
    /// 16 jobs at once, batches of the source's [`Source::default_batch`] (10 for a broker, 64
    /// for the table queue), claims grouped by [`DEFAULT_CLAIM_WINDOW`], 30 s shutdown grace,
    /// acks batched by 10 or 20 ms.
    pub fn new(supervisor: SupervisorConfig) -> Self {
        Self {
            supervisor,
            concurrency: 16,
            prefetch: None,
            batch: None,
            claim_window: DEFAULT_CLAIM_WINDOW,
            grace: Duration::from_secs(30),
            ack_batch: 10,
            ack_linger: Duration::from_millis(20),
            max_unsettled: None,
            retention: None,
        }
    }
    /// Prunes finished jobs (and ledger rows) by `retention` in the background while the
    /// consumer runs: one run at start, then one every
    /// [`Retention::interval`](fence::Retention::interval), each through
    /// [`FenceStore::prune`](fence::FenceStore::prune) (bounded batches; at most one pruner at a
    /// time across processes on PostgreSQL, so every worker may have this on). A run that fails
    /// is logged and tried again at the next interval; a store without pruning
    /// ([`FenceError::Unsupported`](fence::FenceError::Unsupported)) stops the pruner with a
    /// warning. Off by default: nothing is ever deleted unless this is set (or `prune` called).
    ///
    /// ```
    /// use brokerfence::{LeaseDuration, QueueName, QueueRetention, Retention, SupervisorConfig};
    /// let retention = Retention::new().queue(QueueName::new("emails").unwrap(), QueueRetention::default());
    /// let config = brokerfence::ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap()))
    ///     .retention(retention);
    /// assert!(config.retention_policy().is_some());
    /// ```
    pub fn retention(mut self, retention: fence::Retention) -> Self {
        self.retention = Some(retention);
        self
    }
    /// The background retention policy, if any (see [`retention`](Self::retention)).
    pub fn retention_policy(&self) -> Option<&fence::Retention> {
        self.retention.as_ref()
    }
    /// Jobs running at once.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }
    /// Opt in to prefetching: up to `n` deliveries are held ahead of the handlers (received,
    /// being claimed, or claimed and waiting for a handler slot under a heartbeated lease), on top
    /// of the `concurrency` handlers running. Without it (the default), one slot covers a
    /// delivery from its receive until its handler returns, so a worker never holds more than
    /// `concurrency` deliveries.
    pub fn prefetch(mut self, n: usize) -> Self {
        self.prefetch = Some(n.max(1));
        self
    }
    /// Deliveries asked for per receive, at most: a receive asks for what is free then (and what
    /// frees up within a 2 ms linger), up to this many and never more than the receive places
    /// (`prefetch`, else `concurrency`). Without it, the source's
    /// [`default_batch`](Source::default_batch) applies: 10 for the brokers (one SQS
    /// `ReceiveMessage` returns at most 10), 64 for the table queue, whose receive *is* the claim
    /// statement, so the batch is how many jobs one statement hands out: with 10, a consumer
    /// over the table queue could start at most ten jobs per claim round trip and stopped
    /// scaling past concurrency 64 (8,892 jobs/s at 64 and 8,476 at 128 against 14,659 and
    /// 22,859 for a plain SKIP LOCKED loop claiming 64 at a time).
    ///
    /// ```
    /// use brokerfence::{LeaseDuration, SupervisorConfig};
    /// let config = brokerfence::ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap()));
    /// assert_eq!(config.batch_limit(), None); // the source's default
    /// assert_eq!(config.batch(32).batch_limit(), Some(32));
    /// ```
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = Some(n.max(1));
        self
    }
    /// The batch set with [`batch`](Self::batch), if any.
    pub fn batch_limit(&self) -> Option<usize> {
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
    /// `Duration::ZERO` claims each receive as soon as a claim slot is free. Sources that claim
    /// in their own receive (the table queue) are not affected.
    ///
    /// ```
    /// use std::time::Duration;
    /// use brokerfence::{LeaseDuration, SupervisorConfig};
    /// let config = brokerfence::ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap()))
    ///     .claim_window(Duration::from_millis(10));
    /// assert_eq!(config.claim_window_length(), Duration::from_millis(10));
    /// ```
    pub fn claim_window(mut self, window: Duration) -> Self {
        self.claim_window = window;
        self
    }
    /// The [`claim_window`](Self::claim_window).
    pub fn claim_window_length(&self) -> Duration {
        self.claim_window
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
    /// assert_eq!(config.unsettled_limit(), 4 * 8 + 4 * 10);
    /// assert_eq!(config.max_unsettled(100).unsettled_limit(), 100);
    /// ```
    pub fn max_unsettled(mut self, n: usize) -> Self {
        self.max_unsettled = Some(n.max(1));
        self
    }
    /// The bound on unsettled deliveries (see [`max_unsettled`](Self::max_unsettled)).
    pub fn unsettled_limit(&self) -> usize {
        self.max_unsettled
            .unwrap_or_else(|| {
                4usize
                    .saturating_mul(self.concurrency.saturating_add(self.prefetch.unwrap_or(0)))
                    .saturating_add(4usize.saturating_mul(self.ack_batch))
            })
            .min(Semaphore::MAX_PERMITS)
    }
    /// Receive places: deliveries held ahead of the handlers (`prefetch`), else `concurrency`.
    fn places(&self) -> usize {
        self.prefetch.unwrap_or(self.concurrency)
    }
    /// The concurrency limit.
    pub fn concurrency_limit(&self) -> usize {
        self.concurrency
    }
    /// The supervisor configuration.
    pub fn supervisor_config(&self) -> &SupervisorConfig {
        &self.supervisor
    }
}

/// What the runtime tells a source's `receive` about the claims it may make itself.
#[derive(Debug, Clone)]
pub struct ReceiveContext {
    /// The worker's owner id.
    pub owner: Owner,
    /// The lease length.
    pub lease: fence::LeaseDuration,
}

type LeaseId = (String, String, i64);

fn lease_id(l: &Lease) -> LeaseId {
    (l.queue.as_str().to_owned(), l.key.as_str().to_owned(), l.epoch)
}

/// Deliveries of running attempts, by lease, so heartbeats can extend the right broker handle.
struct Tracked<D>(Mutex<HashMap<LeaseId, D>>);

impl<D: Clone> Tracked<D> {
    fn insert(&self, l: &Lease, d: D) {
        if let Ok(mut m) = self.0.lock() {
            m.insert(lease_id(l), d);
        }
    }
    fn remove(&self, l: &Lease) {
        if let Ok(mut m) = self.0.lock() {
            m.remove(&lease_id(l));
        }
    }
    fn pairs(&self, leases: &[Lease]) -> Vec<(Lease, D)> {
        let Ok(m) = self.0.lock() else { return Vec::new() };
        leases.iter().filter_map(|l| m.get(&lease_id(l)).map(|d| (l.clone(), d.clone()))).collect()
    }
}

struct SourceHook<S: Source> {
    source: Arc<S>,
    tracked: Arc<Tracked<S::Delivery>>,
}

#[async_trait]
impl<S: Source> LeaseHook for SourceHook<S> {
    async fn confirmed(&self, leases: &[Lease]) {
        let pairs = self.tracked.pairs(leases);
        if !pairs.is_empty()
            && let Err(e) = self.source.extend(&pairs).await
        {
            tracing::warn!(error = %e, n = pairs.len(), "could not extend broker visibility (the database lease stands)");
        }
    }

    async fn lost(&self, leases: &[Lease]) {
        let pairs = self.tracked.pairs(leases);
        if !pairs.is_empty()
            && let Err(e) = self.source.lost(&pairs).await
        {
            tracing::warn!(error = %e, "source could not drop state of lost leases");
        }
    }
}

/// A consumer: one worker (one owner) reading one source.
///
/// ```no_run
/// # async fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>) -> Result<(), brokerfence::SourceError> {
/// use brokerfence::{Consumer, ConsumerConfig, TableQueue};
/// use brokerfence::{LeaseDuration, QueueName, SupervisorConfig};
/// let source = TableQueue::new(store.clone(), QueueName::new("emails").unwrap());
/// let config = ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap()));
/// let consumer = Consumer::new(source, store, config);
/// let stop = brokerfence::shutdown_signal();
/// consumer.run(|ctx: brokerfence::JobContext| async move { Ok(ctx.payload().to_vec()) }, stop).await?;
/// # Ok(()) }
/// ```
pub struct Consumer<S: Source> {
    source: Arc<S>,
    supervisor: Supervisor,
    config: ConsumerConfig,
    tracked: Arc<Tracked<S::Delivery>>,
    unsettled: Arc<Semaphore>,
}

impl<S: Source> std::fmt::Debug for Consumer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer")
            .field("supervisor", &self.supervisor)
            .field("config", &self.config)
            .field("unsettled", &self.unsettled())
            .finish()
    }
}

impl<S: Source> Consumer<S> {
    /// A consumer with a fresh owner id. Must be created inside a tokio runtime.
    pub fn new(source: S, store: Arc<dyn FenceStore>, config: ConsumerConfig) -> Self {
        Self::with_owner(source, store, Owner::unique("worker"), config)
    }

    /// A consumer with the given owner id.
    pub fn with_owner(source: S, store: Arc<dyn FenceStore>, owner: Owner, config: ConsumerConfig) -> Self {
        let source = Arc::new(source);
        // The exported metrics (feature `metrics`) carry this consumer's queue and source kind.
        let metrics = Arc::new(Metrics::labelled(source.queue().as_str(), source.kind()));
        let supervisor = Supervisor::with_metrics(store, owner, config.supervisor.clone(), metrics);
        let tracked = Arc::new(Tracked(Mutex::new(HashMap::new())));
        supervisor.add_hook(Arc::new(SourceHook { source: Arc::clone(&source), tracked: Arc::clone(&tracked) }));
        let unsettled = Arc::new(Semaphore::new(config.unsettled_limit()));
        Self { source, supervisor, config, tracked, unsettled }
    }

    /// The supervisor (owner, metrics, in-flight count).
    pub fn supervisor(&self) -> &Supervisor {
        &self.supervisor
    }

    /// The counters.
    pub fn metrics(&self) -> Arc<Metrics> {
        Arc::clone(self.supervisor.metrics())
    }

    /// The source.
    pub fn source(&self) -> &Arc<S> {
        &self.source
    }

    async fn check_schema(&self) -> Result<(), SourceError> {
        let store = self.supervisor.store();
        match tokio::time::timeout(SCHEMA_CHECK_TIMEOUT, store.check_schema()).await {
            Ok(Err(e @ fence::FenceError::SchemaTooOld { .. })) => {
                tracing::error!(error = %e, "schema too old; consumer refuses to start");
                Err(SourceError::Fatal(e.to_string()))
            }
            Ok(Ok(())) | Ok(Err(fence::FenceError::Unsupported(_))) => Ok(()),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not check the schema; starting anyway");
                Ok(())
            }
            Err(_) => {
                tracing::warn!(timeout = ?SCHEMA_CHECK_TIMEOUT, "schema check timed out; starting anyway");
                Ok(())
            }
        }
    }

    /// Unsettled places taken now: deliveries received and not yet settled at the broker, plus
    /// the places a receive in progress reserved. A gauge that never exceeds
    /// [`ConsumerConfig::unsettled_limit`].
    ///
    /// ```no_run
    /// # fn demo(consumer: &brokerfence::Consumer<brokerfence::TableQueue>) {
    /// println!("{} deliveries unsettled", consumer.unsettled());
    /// # }
    /// ```
    pub fn unsettled(&self) -> usize {
        self.config.unsettled_limit().saturating_sub(self.unsettled.available_permits())
    }

    /// Runs until `shutdown` fires or the source fails fatally; then stops receiving, lets
    /// running jobs finish within the grace period, releases the leases of the rest, and returns.
    /// Transient source and database errors are retried with backoff and never end the loop.
    ///
    /// Claims are grouped and run in tasks of their own, so the next receive overlaps them. At
    /// most `concurrency` deliveries are held from receive until their handler returns (plus
    /// `prefetch` more ahead of the handlers, if set); a slot frees the moment its handler
    /// returns, so commits and acks overlap the next jobs. At most
    /// [`unsettled_limit`](ConsumerConfig::unsettled_limit) deliveries are held from receive until
    /// the broker call that settles them returned: a broker that hangs stops the receiving.
    ///
    /// Shutdown is cancellation-safe: a receive in progress when `shutdown` fires is not dropped
    /// (a source may have claimed or popped what it returns); it may finish within the grace
    /// period, and what it returned is given back (jobs claimed by the source released without spending an attempt, deliveries
    /// abandoned). Jobs claimed but not started (waiting for their claim, or for a handler slot
    /// when prefetching) are released the same way.
    ///
    /// Before anything is received, the store's schema is checked
    /// ([`FenceStore::check_schema`](fence::FenceStore::check_schema)): a schema older than this
    /// build needs ends the run at once with [`SourceError::Fatal`] naming the versions, since
    /// migrations are a deploy step of their own and never run here. A store that cannot answer
    /// yet (database down) is not a reason to refuse: the loop starts and retries as usual.
    ///
    /// `shutdown` is a [`CancellationToken`] (re-exported as `brokerfence::CancellationToken`;
    /// [`shutdown_signal`] makes one that fires on SIGTERM or Ctrl-C); to stop on any other
    /// future, use [`run_until`](Self::run_until).
    pub async fn run<H: Handler>(&self, handler: H, shutdown: CancellationToken) -> Result<(), SourceError> {
        self.run_until(handler, shutdown.cancelled_owned()).await
    }

    /// [`run`](Self::run) until the future `shutdown` completes: a channel, a timer, your own
    /// signal handling, `token.cancelled_owned()`. It is polled beside the receive loop (it need
    /// not be `'static`); once it completes, the consumer stops as [`run`](Self::run) describes.
    ///
    /// ```no_run
    /// # async fn demo(consumer: brokerfence::Consumer<brokerfence::TableQueue>) -> Result<(), brokerfence::SourceError> {
    /// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    /// # drop(stop);
    /// consumer
    ///     .run_until(|ctx| async move { Ok(format!("done at epoch {}", ctx.epoch())) }, async {
    ///         let _ = stopped.await; // fires when `stop` is sent (or dropped)
    ///     })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn run_until<H: Handler>(
        &self,
        handler: H,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<(), SourceError> {
        // The loop and its tasks watch a token; the caller's future fires it.
        let shutdown_token = CancellationToken::new();
        let watch = async {
            shutdown.await;
            shutdown_token.cancel();
            std::future::pending::<std::convert::Infallible>().await
        };
        let run = self.run_with_token(handler, &shutdown_token);
        tokio::select! {
            result = run => result,
            never = watch => match never {},
        }
    }

    async fn run_with_token<H: Handler>(&self, handler: H, shutdown: &CancellationToken) -> Result<(), SourceError> {
        self.check_schema().await?;
        let places = self.config.places();
        // Every queued acknowledgement holds an unsettled place, so the channel never fills
        // before the receive loop stops; a sender waits when it does (an ack is never dropped).
        let (ack_tx, ack_rx) = mpsc::channel(self.config.unsettled_limit().max(1));
        // Every queued delivery holds a receive place: at most `places` wait for a claim.
        let (claims_tx, claims_rx) = mpsc::unbounded_channel();
        let acker = tokio::spawn(ack_loop(
            Arc::clone(&self.source),
            ack_rx,
            self.config.ack_batch,
            self.config.ack_linger,
            Arc::clone(self.supervisor.metrics()),
        ));
        let shared = Arc::new(Shared {
            source: Arc::clone(&self.source),
            supervisor: self.supervisor.clone(),
            tracked: Arc::clone(&self.tracked),
            handler,
            ack_tx,
            lease: self.config.supervisor.lease(),
            grace: self.config.grace,
            claim_failures: AtomicU32::new(0),
            // Fires with `shutdown`, and also when the loop ends on a fatal source error.
            stopping: shutdown.child_token(),
            tasks: TaskTracker::new(),
            slots: self.config.prefetch.map(|_| Arc::new(Semaphore::new(self.config.concurrency))),
            claims: Mutex::new(Some(claims_tx)),
        });
        let permits = Budget { places: Arc::new(Semaphore::new(places)), unsettled: Arc::clone(&self.unsettled) };
        shared.tasks.spawn(Arc::clone(&shared).claim_loop(
            claims_rx,
            self.config.claim_window,
            Arc::clone(&permits.places),
        ));
        let pruner = self.config.retention.clone().map(|retention| {
            tokio::spawn(prune_loop(Arc::clone(self.supervisor.store()), retention, shared.stopping.clone()))
        });
        let result = self.receive_loop(&shared, &permits, shutdown).await;
        // However the loop ended, jobs not started yet are given back, not started.
        shared.stopping.cancel();
        if let Some(pruner) = pruner
            && let Err(e) = pruner.await
        {
            tracing::error!(error = %e, "pruner task panicked");
        }
        // No more batches to claim: the claimer gives back what is queued and stops.
        if let Ok(mut claims) = shared.claims.lock() {
            claims.take();
        }
        tracing::info!(in_flight = self.supervisor.in_flight(), "consumer stopping");
        self.supervisor.shutdown(self.config.grace).await;
        // Receives and claims in flight release what they get; attempts settle at the broker:
        // wait for all of them.
        shared.tasks.close();
        if tokio::time::timeout(Duration::from_secs(30), shared.tasks.wait()).await.is_err() {
            tracing::error!(
                unsettled = self.unsettled(),
                "deliveries still unsettled 30 s after shutdown; returning anyway"
            );
        }
        self.source.close(self.config.grace).await;
        drop(shared);
        if let Err(e) = acker.await {
            tracing::error!(error = %e, "ack task panicked");
        }
        tracing::info!(metrics = %self.supervisor.metrics().snapshot(), "consumer stopped");
        result
    }

    async fn receive_loop<H: Handler>(
        &self,
        shared: &Arc<Shared<S, H>>,
        permits: &Budget,
        shutdown: &CancellationToken,
    ) -> Result<(), SourceError> {
        let ctx = ReceiveContext { owner: self.supervisor.owner().clone(), lease: self.config.supervisor.lease() };
        let mut backoff = Backoff::default();
        // More than the receive places can never be held: waiting for them would only add the
        // linger to every receive.
        let batch = self.config.batch.unwrap_or_else(|| self.source.default_batch()).clamp(1, self.config.places());
        loop {
            // While claims fail (database unreachable), slow down instead of piling up deliveries.
            let failures = shared.claim_failures.load(Ordering::Relaxed);
            if failures > 0 {
                let wait = Backoff::nth(failures.saturating_sub(1));
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(wait) => {}
                }
            }
            // One receive place and one unsettled place per delivery asked for: wait for the
            // first, take what else is free.
            let first = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                p = permits.acquire() => match p {
                    Some(p) => p,
                    None => return Ok(()),
                },
            };
            // Fill the batch: what is free now, then whatever frees up within a short linger, so
            // that one claim statement serves a full batch rather than one delivery at a time.
            let mut held = vec![first];
            let fill_until = tokio::time::Instant::now() + BATCH_FILL_LINGER;
            while held.len() < batch {
                if let Some(p) = permits.try_acquire() {
                    held.push(p);
                    continue;
                }
                tokio::select! {
                    p = permits.acquire() => match p {
                        Some(p) => held.push(p),
                        None => break,
                    },
                    _ = tokio::time::sleep_until(fill_until) => break,
                }
            }
            let asked_at = std::time::Instant::now();
            // Cancellation-safe: at shutdown the receive is not dropped (a source may already
            // have claimed or popped what it is about to return); it finishes in a task of its
            // own, which gives back whatever it returns.
            let mut receive: Receive<S::Delivery> = {
                let (source, ctx, n) = (Arc::clone(&self.source), ctx.clone(), held.len());
                Box::pin(async move { source.receive(n, &ctx).await })
            };
            let received = tokio::select! {
                r = &mut receive => Some(r),
                _ = shutdown.cancelled() => None,
            };
            let Some(received) = received else {
                shared.give_back_receive(receive, held);
                return Ok(());
            };
            let incoming = match received {
                Ok(v) => {
                    backoff.reset();
                    v
                }
                Err(SourceError::Fatal(e)) => {
                    tracing::error!(error = %e, "source failed; consumer stops");
                    return Err(SourceError::Fatal(e));
                }
                Err(SourceError::Transient(e)) => {
                    let wait = backoff.next();
                    tracing::warn!(error = %e, ?wait, "receive failed; retrying");
                    tokio::select! {
                        _ = shutdown.cancelled() => return Ok(()),
                        _ = tokio::time::sleep(wait) => continue,
                    }
                }
            };
            // A source that returns more than asked still gets places for each (waiting for
            // them; at shutdown the rest is given back).
            while held.len() < incoming.len() {
                let more = tokio::select! {
                    p = permits.acquire() => p,
                    _ = shutdown.cancelled() => None,
                };
                match more {
                    Some(p) => held.push(p),
                    None => {
                        shared.give_back_receive(Box::pin(async move { Ok(incoming) }), held);
                        return Ok(());
                    }
                }
            }
            held.truncate(incoming.len());
            shared.dispatch(incoming, held, asked_at).await;
        }
    }
}

/// OpenTelemetry's `messaging.system` for a [`Source::kind`]: its well-known value where there is
/// one (`aws_sqs`), else the kind.
fn messaging_system(kind: &'static str) -> &'static str {
    match kind {
        "sqs" => "aws_sqs",
        "redis_stream" | "redis_list" => "redis",
        other => other,
    }
}

/// A receive, boxed so that shutdown can hand it to a task of its own instead of dropping it.
type Receive<D> = futures::future::BoxFuture<'static, Result<Vec<Incoming<D>>, SourceError>>;

/// The two budgets a delivery draws on.
struct Budget {
    /// Receive places: held until the handler starts (prefetching) or returns.
    places: Arc<Semaphore>,
    /// Unsettled places: held until the broker call that settles the delivery returned.
    unsettled: Arc<Semaphore>,
}

impl Budget {
    /// Waits for one place of each kind (cancellation-safe: dropping it returns what it took).
    async fn acquire(&self) -> Option<Places> {
        let unsettled = Arc::clone(&self.unsettled).acquire_owned().await.ok()?;
        let place = Arc::clone(&self.places).acquire_owned().await.ok()?;
        Some(Places { place, unsettled })
    }

    /// One place of each kind, if both are free now.
    fn try_acquire(&self) -> Option<Places> {
        let unsettled = Arc::clone(&self.unsettled).try_acquire_owned().ok()?;
        let place = Arc::clone(&self.places).try_acquire_owned().ok()?;
        Some(Places { place, unsettled })
    }
}

/// What one received delivery holds.
struct Places {
    /// Its receive place (a handler slot, or a prefetch place).
    place: OwnedSemaphorePermit,
    /// Its unsettled place, returned once the broker was told.
    unsettled: OwnedSemaphorePermit,
}

/// How long [`Consumer::run`] waits for the schema check before starting anyway.
const SCHEMA_CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// The longest one background prune run may take (each of its statements has its own, shorter,
/// limit): a run cut short rolls back only its current batch; the next run carries on.
const PRUNE_RUN_TIMEOUT: Duration = Duration::from_secs(600);

/// The consumer's background pruner (see [`ConsumerConfig::retention`]): a run now, then one
/// every interval, until `stop` fires (a run in progress then is dropped: its open batch rolls
/// back).
async fn prune_loop(store: Arc<dyn FenceStore>, retention: fence::Retention, stop: CancellationToken) {
    use tracing::Instrument;
    let span = tracing::info_span!("consumer.pruner", backend = store.backend());
    async move {
        loop {
            let run = tokio::time::timeout(PRUNE_RUN_TIMEOUT, store.prune(&retention));
            let outcome = tokio::select! {
                _ = stop.cancelled() => return,
                outcome = run => outcome,
            };
            match outcome {
                Ok(Ok(report)) => tracing::debug!(?report, "background prune run"),
                Ok(Err(fence::FenceError::Unsupported(what))) => {
                    tracing::warn!(what, "the store cannot prune; background pruner stopped");
                    return;
                }
                Ok(Err(e)) => tracing::warn!(error = %e, "background prune run failed; next run at the next interval"),
                Err(_) => tracing::warn!(timeout = ?PRUNE_RUN_TIMEOUT, "background prune run timed out"),
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(retention.interval()) => {}
            }
        }
    }
    .instrument(span)
    .await
}

/// How long the receive loop waits for more free slots to fill a batch once it has one.
const BATCH_FILL_LINGER: Duration = Duration::from_millis(2);

/// A received delivery with the places it holds.
type Held<D> = (D, Places);

/// A received delivery waiting for the group claim.
type Unclaimed<D> = (Held<D>, JobKey, Vec<u8>);

/// Where received deliveries queue for the group claim. Unbounded as a channel, bounded by the
/// receive places: every queued delivery holds one.
type ClaimQueue<D> = mpsc::UnboundedSender<Unclaimed<D>>;

/// An acknowledgement waiting for its batch, with the unsettled place it frees once sent.
type PendingAck<D> = (D, Option<OwnedSemaphorePermit>);

/// Most deliveries claimed by one statement.
const MAX_CLAIM_BATCH: usize = 500;

/// Claim statements in flight at once: the database flushes concurrent commits together.
const CLAIMS_IN_FLIGHT: usize = 4;

/// What to tell the broker about one delivery.
#[derive(Debug)]
enum Tell {
    /// What the fence decided for a delivery with a job key.
    Fence(Disposition),
    /// A delivery that maps to no job (undecodable, no key): dead-letter it with the reason.
    Malformed(String),
}

impl Tell {
    /// What becomes of the delivery when the broker call fails, for the log.
    fn when_the_call_fails(&self) -> &'static str {
        match self {
            Tell::Fence(d) => d.when_broker_call_fails(),
            Tell::Malformed(_) => {
                "the malformed delivery maps to no job, so the fence cannot deduplicate it: it will come back \
                 and be dead-lettered again, every time, until a move succeeds; give the source a dead-letter \
                 destination it can write to (SQS: `SqsConfig::dead_letter` or the queue's RedrivePolicy; \
                 Redis: `dead_letter_stream`)"
            }
        }
    }
}

/// What the receive loop, the claim tasks and the job tasks share.
struct Shared<S: Source, H> {
    source: Arc<S>,
    supervisor: Supervisor,
    tracked: Arc<Tracked<S::Delivery>>,
    handler: H,
    /// Bounded: a sender waits while it is full.
    ack_tx: mpsc::Sender<PendingAck<S::Delivery>>,
    lease: fence::LeaseDuration,
    /// How long shutdown waits for running jobs, and for a receive in progress.
    grace: Duration,
    claim_failures: AtomicU32,
    stopping: CancellationToken,
    /// Handlers running at once, when prefetching (else the receive permits bound them).
    slots: Option<Arc<Semaphore>>,
    /// Received deliveries waiting for the group claim; taken (closed) at shutdown.
    claims: Mutex<Option<ClaimQueue<S::Delivery>>>,
    /// Receives abandoned at shutdown, claim tasks and attempts until they are settled at the
    /// broker.
    tasks: TaskTracker,
}

impl<S: Source, H: Handler> Shared<S, H> {
    /// Sorts one received batch: malformed ones are dead-lettered, already-claimed ones start,
    /// the rest are claimed together in a task of their own.
    async fn dispatch(
        self: &Arc<Self>,
        incoming: Vec<Incoming<S::Delivery>>,
        held: Vec<Places>,
        asked_at: std::time::Instant,
    ) {
        let mut unclaimed = Vec::new();
        // Jobs the source claimed in its receive (the table queue's `claim_next`): that receive
        // was their claim statement.
        let claimed = incoming.iter().filter(|i| matches!(i, Incoming::Claimed { .. })).count();
        if claimed > 0 {
            let metrics = self.supervisor.metrics();
            metrics.observe_duration(Distribution::ClaimDuration, asked_at.elapsed());
            metrics.observe(Distribution::ClaimStatementJobs, claimed as f64);
        }
        for (item, places) in incoming.into_iter().zip(held) {
            match item {
                Incoming::Malformed { delivery, reason } => {
                    tracing::warn!(%reason, "malformed delivery: dead-lettering it");
                    let Places { place, unsettled } = places;
                    drop(place);
                    self.settle_later(delivery, Tell::Malformed(reason), Some(unsettled));
                }
                Incoming::Claimed { delivery, job } => {
                    self.supervisor.metrics().incr(Counter::Claims);
                    self.start(job.lease, asked_at, job.payload, job.progress, (delivery, places));
                }
                Incoming::Unclaimed { delivery, key, payload } => unclaimed.push(((delivery, places), key, payload)),
            }
        }
        if unclaimed.is_empty() {
            return;
        }
        let queue = self.claims.lock().ok().and_then(|claims| claims.clone());
        for u in unclaimed {
            let refused = match &queue {
                Some(tx) => tx.send(u).err().map(|e| e.0),
                None => Some(u),
            };
            if let Some(((delivery, places), _, _)) = refused {
                tracing::debug!("consumer stopping: giving a received delivery back");
                self.settle_later(delivery, Tell::Fence(Disposition::Abandon), Some(places.unsettled));
            }
        }
    }

    /// A receive still in progress at shutdown: let it finish in a task of its own (within the
    /// grace period: a long poll of a source that is cancellation-safe itself, SQS, may take
    /// longer) and give back whatever it returns (release what the source claimed, abandon the
    /// rest).
    fn give_back_receive(self: &Arc<Self>, receive: Receive<S::Delivery>, held: Vec<Places>) {
        let shared = Arc::clone(self);
        self.tasks.spawn(async move {
            let incoming = match tokio::time::timeout(shared.grace, receive).await {
                Ok(Ok(incoming)) => incoming,
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "a receive in progress at shutdown failed");
                    return;
                }
                Err(_) => {
                    tracing::warn!(
                        grace = ?shared.grace,
                        "a receive in progress at shutdown did not finish within the grace period; dropped \
                         (a source that claims in its receive leaves such claims to their lease)"
                    );
                    return;
                }
            };
            if !incoming.is_empty() {
                tracing::info!(
                    n = incoming.len(),
                    "a receive in progress at shutdown returned deliveries: giving them back"
                );
            }
            for item in incoming {
                match item {
                    Incoming::Claimed { delivery, job } => shared.release_unstarted(&job.lease, delivery, None).await,
                    Incoming::Unclaimed { delivery, .. } | Incoming::Malformed { delivery, .. } => {
                        shared.settle(delivery, Tell::Fence(Disposition::Abandon), None).await;
                    }
                }
            }
            drop(held);
        });
    }

    /// Group claim: claims the deliveries queued at the moment with one statement (one round
    /// trip, one commit), grouped by a [`Grouper`] with the
    /// [`claim_window`](ConsumerConfig::claim_window): while claims are in flight or the window
    /// is open, the next receives pile up for the next statement instead of each paying for its
    /// own. Up to [`CLAIMS_IN_FLIGHT`] statements run at once.
    async fn claim_loop(
        self: Arc<Self>,
        rx: mpsc::UnboundedReceiver<Unclaimed<S::Delivery>>,
        window: Duration,
        places: Arc<Semaphore>,
    ) {
        let in_flight = Arc::new(Semaphore::new(CLAIMS_IN_FLIGHT));
        // Claim statements sent and not answered yet: their attempts are about to run.
        let claiming = Arc::new(AtomicUsize::new(0));
        // Deliveries wait the window out only while more can come: attempts run or are being
        // claimed (a busy consumer keeps receiving) and the receive loop has free places to
        // receive them into. So deliveries that come one at a time wait for nothing, and waiting
        // never holds places the receive loop is short of.
        let supervisor = self.supervisor.clone();
        let probe = Arc::clone(&claiming);
        let mut groups = Grouper::new(rx, MAX_CLAIM_BATCH, window).busy(move || {
            (supervisor.in_flight() > 0 || probe.load(Ordering::Acquire) > 0) && places.available_permits() > 0
        });
        loop {
            // While every claim slot is busy, deliveries keep piling up for the next statement.
            let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else { return };
            let Some(batch) = groups.next().await else { return };
            let shared = Arc::clone(&self);
            claiming.fetch_add(1, Ordering::AcqRel);
            let claimed = Arc::clone(&claiming);
            self.tasks.spawn(async move {
                shared.claim_and_start(batch).await;
                claimed.fetch_sub(1, Ordering::AcqRel);
                drop(permit);
            });
        }
    }

    /// One statement claims the whole batch; each delivery then starts or is settled. Once
    /// shutdown began nothing more is claimed: the deliveries are given back. A claim that
    /// answers after shutdown began is not lost either: its leases are released (in
    /// [`start`](Self::start)).
    async fn claim_and_start(self: Arc<Self>, unclaimed: Vec<Unclaimed<S::Delivery>>) {
        if self.stopping.is_cancelled() {
            for ((delivery, places), _, _) in unclaimed {
                self.settle(delivery, Tell::Fence(Disposition::Abandon), Some(places.unsettled)).await;
            }
            return;
        }
        let metrics = self.supervisor.metrics();
        metrics.incr(Counter::ClaimStatements);
        let keys: Vec<JobKey> = unclaimed.iter().map(|(_, k, _)| k.clone()).collect();
        let claim_sent = std::time::Instant::now();
        let answer =
            self.supervisor.store().claim_batch(self.source.queue(), &keys, self.supervisor.owner(), self.lease).await;
        metrics.observe_duration(Distribution::ClaimDuration, claim_sent.elapsed());
        metrics.observe(Distribution::ClaimStatementJobs, keys.len() as f64);
        let claims = match answer {
            Ok(c) => {
                self.claim_failures.store(0, Ordering::Relaxed);
                c
            }
            Err(e) => {
                // Leave the deliveries to the broker's visibility timeout: they come back.
                self.claim_failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, n = keys.len(), "claim failed; deliveries left to the broker");
                return;
            }
        };
        let mut started = HashSet::new();
        for ((held, key, payload), claim) in unclaimed.into_iter().zip(claims) {
            match Disposition::after_claim(&claim) {
                None if started.insert(key.clone()) => {
                    if let Claim::Claimed(lease) = claim {
                        metrics.incr(Counter::Claims);
                        self.start(lease, claim_sent, payload, None, held);
                    }
                }
                None => {
                    // The same key twice in one batch: the first runs; this one waits its turn.
                    let hold = claim.lease().map(|l| l.ttl).unwrap_or_default();
                    metrics.incr(Counter::Busy);
                    let (delivery, Places { place, unsettled }) = held;
                    drop(place);
                    self.settle_later(delivery, Tell::Fence(Disposition::Hold(hold)), Some(unsettled));
                }
                Some(d) => {
                    match &d {
                        Disposition::Hold(_) => metrics.incr(Counter::Busy),
                        Disposition::Ack | Disposition::DeadLetter(_) => metrics.incr(Counter::Duplicates),
                        _ => {}
                    }
                    tracing::debug!(%key, disposition = ?d, "delivery not claimed");
                    let (delivery, Places { place, unsettled }) = held;
                    drop(place);
                    self.settle_later(delivery, Tell::Fence(d), Some(unsettled));
                }
            }
        }
    }

    /// Gives back a job claimed but never started: the lease is released (pending again, no
    /// attempt spent) and the delivery abandoned at the broker.
    async fn release_unstarted(&self, lease: &Lease, delivery: S::Delivery, unsettled: Option<OwnedSemaphorePermit>) {
        match self.supervisor.store().release(lease).await {
            Ok(()) => {
                self.supervisor.metrics().incr(Counter::Releases);
                tracing::info!(key = %lease.key, epoch = lease.epoch, "released a job claimed but never started");
                self.settle(delivery, Tell::Fence(Disposition::Abandon), unsettled).await;
            }
            Err(e) => tracing::warn!(
                error = %e,
                key = %lease.key,
                "could not release a job claimed but never started; it is claimable again when its lease ends"
            ),
        }
    }

    /// Runs one attempt in its own task; the places return as the delivery moves on (the
    /// receive place when the handler starts or returns, the unsettled place once settled).
    /// A job that has not started when shutdown begins (claimed after it, or waiting for a
    /// handler slot) is released instead.
    fn start(
        self: &Arc<Self>,
        lease: Lease,
        claimed_at: std::time::Instant,
        payload: Vec<u8>,
        progress: Option<Vec<u8>>,
        (delivery, places): Held<S::Delivery>,
    ) {
        let shared = Arc::clone(self);
        self.tasks.spawn(async move {
            let Places { place, unsettled } = places;
            if shared.stopping.is_cancelled() {
                // Claimed while shutting down: give it straight back.
                drop(place);
                shared.release_unstarted(&lease, delivery, Some(unsettled)).await;
                return;
            }
            shared.tracked.insert(&lease, delivery.clone());
            let untrack = Untrack { tracked: &shared.tracked, lease: &lease };
            let handler = shared.handler.clone();
            // The concurrency slot is the handler's: it frees the moment the handler returns (or
            // is cancelled), so the commit and the broker call overlap the next job.
            let slots = shared.slots.clone();
            let stopping = shared.stopping.clone();
            let system = messaging_system(shared.source.kind());
            let (gave_up, not_started) = tokio::sync::oneshot::channel::<()>();
            let run = move |ctx| async move {
                tracing::Span::current().record("messaging.system", system);
                // Prefetching: wait for a handler slot under the lease (the supervisor already
                // heartbeats it), then give the prefetch place back. Otherwise the receive permit
                // is the slot. Either frees the moment the handler returns. Shutdown before the
                // slot came: the job never starts (the attempt is dropped and released below).
                let slot = match slots {
                    Some(slots) => {
                        let slot = tokio::select! {
                            biased;
                            _ = stopping.cancelled() => {
                                let _ = gave_up.send(());
                                return std::future::pending().await;
                            }
                            slot = slots.acquire_owned() => slot.ok(),
                        };
                        drop(place);
                        (slot, None)
                    }
                    None => (None, Some(place)),
                };
                let result = handler(ctx).await;
                drop(slot);
                result
            };
            // The deadline counts from before the claim was asked for, not from when it started.
            let attempt = shared.supervisor.run_claimed_at(lease.clone(), claimed_at, payload, progress, run);
            let outcome = tokio::select! {
                outcome = attempt => Some(outcome),
                Ok(()) = not_started => None,
            };
            drop(untrack);
            match outcome {
                Some(outcome) => {
                    shared.settle(delivery, Tell::Fence(Disposition::after_run(&outcome)), Some(unsettled)).await;
                }
                None => shared.release_unstarted(&lease, delivery, Some(unsettled)).await,
            }
        });
    }

    /// Settles in a task of its own, so the caller does not wait on the broker. The task holds
    /// the delivery's unsettled place, so these tasks are bounded too.
    fn settle_later(self: &Arc<Self>, delivery: S::Delivery, tell: Tell, unsettled: Option<OwnedSemaphorePermit>) {
        let shared = Arc::clone(self);
        self.tasks.spawn(async move { shared.settle(delivery, tell, unsettled).await });
    }

    /// Tells the broker; the unsettled place frees once it is told (for an acknowledgement: once
    /// its batch was sent). A full ack queue is waited on: an acknowledgement is never dropped.
    async fn settle(&self, delivery: S::Delivery, tell: Tell, unsettled: Option<OwnedSemaphorePermit>) {
        let metrics = self.supervisor.metrics();
        let result = match &tell {
            Tell::Fence(Disposition::Ack) => match self.ack_tx.send((delivery, unsettled)).await {
                Ok(()) => return,
                Err(mpsc::error::SendError((delivery, _unsettled))) => {
                    // The ack task is gone: acknowledge directly.
                    self.source.ack(vec![delivery]).await.map(|()| metrics.incr(Counter::Acks))
                }
            },
            Tell::Fence(Disposition::RetryLater(delay)) => self.source.retry_later(delivery, *delay).await,
            Tell::Fence(Disposition::DeadLetter(reason)) => self.source.dead_letter(delivery, reason).await,
            Tell::Fence(Disposition::Hold(ttl)) => self.source.hold(delivery, *ttl).await,
            Tell::Fence(Disposition::Abandon) => self.source.abandon(delivery).await,
            Tell::Fence(Disposition::Leave) => Ok(()),
            Tell::Malformed(reason) => {
                // Counted once it moved: a failed move is no dead letter.
                self.source.dead_letter(delivery, reason).await.map(|()| metrics.incr(Counter::DeadLetters))
            }
        };
        if let Err(e) = result {
            let what = match &tell {
                Tell::Fence(d) => format!("{d:?}"),
                Tell::Malformed(reason) => format!("dead-letter malformed delivery ({reason})"),
            };
            tracing::warn!(error = %e, broker_call = %what, "broker call failed; {}", tell.when_the_call_fails());
        }
    }
}

/// Forgets a delivery's broker handle when its attempt ends, however it ends.
struct Untrack<'a, D: Clone> {
    tracked: &'a Tracked<D>,
    lease: &'a Lease,
}

impl<D: Clone> Drop for Untrack<'_, D> {
    fn drop(&mut self) {
        self.tracked.remove(self.lease);
    }
}

/// Sends acknowledgements in batches of up to `max`, waiting up to `linger` to fill one. Each
/// delivery's unsettled place frees once its batch was sent (or given up on).
async fn ack_loop<S: Source>(
    source: Arc<S>,
    mut rx: mpsc::Receiver<PendingAck<S::Delivery>>,
    max: usize,
    linger: Duration,
    metrics: Arc<Metrics>,
) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        let until = tokio::time::Instant::now() + linger;
        while batch.len() < max {
            tokio::select! {
                item = rx.recv() => match item {
                    Some(d) => batch.push(d),
                    None => break,
                },
                _ = tokio::time::sleep_until(until) => break,
            }
        }
        let (deliveries, places): (Vec<S::Delivery>, Vec<Option<OwnedSemaphorePermit>>) = batch.into_iter().unzip();
        let n = deliveries.len() as u64;
        let mut backoff = Backoff::default();
        let mut tries = 0;
        loop {
            tries += 1;
            match source.ack(deliveries.clone()).await {
                Ok(()) => {
                    metrics.add(Counter::Acks, n);
                    break;
                }
                Err(e) if tries < 4 => {
                    tracing::warn!(error = %e, n, "ack failed; retrying");
                    tokio::time::sleep(backoff.next()).await;
                }
                Err(e) => {
                    // The results are committed; a redelivery is claimed as Done and acked then.
                    tracing::error!(error = %e, n, "ack failed for good; {}", Disposition::Ack.when_broker_call_fails());
                    break;
                }
            }
        }
        drop(places);
    }
}

/// Exponential backoff with jitter (backon), within 100 ms..5 s: the step doubles from 100 ms
/// up to 2.5 s and each pause is between the step and twice it, so that the workers a database
/// or broker outage failed together do not all retry at the same moments.
#[derive(Debug)]
struct Backoff(backon::ExponentialBackoff);

/// The longest pause of a [`Backoff`].
const BACKOFF_MAX: Duration = Duration::from_secs(5);

impl Default for Backoff {
    fn default() -> Self {
        use backon::BackoffBuilder as _;
        Self(
            backon::ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(100))
                .with_max_delay(BACKOFF_MAX / 2)
                .with_factor(2.0)
                .with_jitter()
                .without_max_times()
                .build(),
        )
    }
}

impl Backoff {
    /// The pause after failure number `n + 1` of a run of failures.
    fn nth(n: u32) -> Duration {
        // The step stops growing after 5 doublings.
        Self::default().0.nth(n.min(8) as usize).unwrap_or(BACKOFF_MAX).min(BACKOFF_MAX)
    }
    fn next(&mut self) -> Duration {
        self.0.next().unwrap_or(BACKOFF_MAX).min(BACKOFF_MAX)
    }
    fn reset(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod backoff_tests {
    use super::*;

    /// The pauses stay within 100 ms..5 s, grow with the step, and start over after a reset.
    #[test]
    fn ergonomics_runtime_backoff_stays_within_its_bounds() {
        for _ in 0..50 {
            let mut b = Backoff::default();
            let pauses: Vec<Duration> = (0..12).map(|_| b.next()).collect();
            for (i, p) in pauses.iter().enumerate() {
                let step = Duration::from_millis(100 << i.min(5)).min(BACKOFF_MAX / 2);
                assert!(*p >= step && *p <= (step * 2).min(BACKOFF_MAX), "pause {i}: {p:?} (step {step:?})");
            }
            b.reset();
            assert!(b.next() < Duration::from_millis(200));
            assert!(Backoff::nth(0) < Duration::from_millis(200));
            assert!((BACKOFF_MAX / 2..=BACKOFF_MAX).contains(&Backoff::nth(u32::MAX)));
        }
    }
}

/// A token that fires on SIGTERM or Ctrl-C: pass it to [`Consumer::run`].
///
/// ```no_run
/// # async fn demo() {
/// let stop = brokerfence::shutdown_signal();
/// stop.cancelled().await;
/// # }
/// ```
pub fn shutdown_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let fire = token.clone();
    tokio::spawn(async move {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            match signal(SignalKind::terminate()) {
                Ok(mut term) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = tokio::signal::ctrl_c() => {}
                    }
                }
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
        tracing::info!("shutdown signal received");
        fire.cancel();
    });
    token
}

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use fence::{LeaseDuration, MetricsSnapshot, QueueName, SqliteFence};

    /// A source that hands out one delivery per receive, as its keys arrive.
    struct Trickle {
        queue: QueueName,
        keys: tokio::sync::Mutex<mpsc::UnboundedReceiver<JobKey>>,
    }

    #[async_trait]
    impl Source for Trickle {
        type Delivery = ();

        fn queue(&self) -> &QueueName {
            &self.queue
        }

        async fn receive(&self, _max: usize, _ctx: &ReceiveContext) -> Result<Vec<Incoming<()>>, SourceError> {
            let mut keys = self.keys.lock().await;
            Ok(match tokio::time::timeout(Duration::from_millis(50), keys.recv()).await {
                Ok(Some(key)) => vec![Incoming::Unclaimed { delivery: (), key, payload: Vec::new() }],
                _ => Vec::new(),
            })
        }
    }

    /// A consumer with `window` over a [`Trickle`]; feeds it `feed`, waits for `n` completions
    /// (10 s at most), stops it and returns its counters.
    async fn trickled<F, Fut>(window: Duration, handler_ms: u64, n: u64, feed: F) -> MetricsSnapshot
    where
        F: FnOnce(mpsc::UnboundedSender<JobKey>, Arc<Metrics>) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let store = SqliteFence::open("sqlite::memory:").await.expect("open");
        store.migrate().await.expect("migrate");
        let (tx, rx) = mpsc::unbounded_channel();
        let source = Trickle { queue: QueueName::new("trickle").expect("queue"), keys: tokio::sync::Mutex::new(rx) };
        let lease = LeaseDuration::from_secs(30).expect("lease");
        let config = ConsumerConfig::new(SupervisorConfig::new(lease)).concurrency(64).claim_window(window);
        let consumer = Arc::new(Consumer::new(source, Arc::new(store), config));
        let stop = CancellationToken::new();
        let work = Duration::from_millis(handler_ms);
        let run = {
            let (consumer, stop) = (Arc::clone(&consumer), stop.clone());
            tokio::spawn(async move {
                let handler = move |_ctx: fence::JobContext| async move {
                    tokio::time::sleep(work).await;
                    Ok(Vec::new())
                };
                consumer.run(handler, stop).await
            })
        };
        let metrics = consumer.metrics();
        feed(tx, Arc::clone(&metrics)).await;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while metrics.snapshot().completions < n && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stop.cancel();
        run.await.expect("consumer task").expect("consumer ran");
        metrics.snapshot()
    }

    /// Guard: the group-claim window. Forty receives of one delivery, one every millisecond,
    /// whose handlers take 50 ms, must share a few claim statements; without the window each
    /// claim slot took whatever single receive was queued (one statement per delivery on this
    /// fast store).
    ///
    /// Also covers a defect CI found (a run with 9 statements under the full suite's load): the
    /// deliveries arriving while the first claim statement was still out found no attempt
    /// running, so each was claimed at once in a statement of its own (up to four in flight).
    /// A claim in flight now counts as "more can come". The bound follows the measured span of
    /// the sends (one group per window, plus the first delivery's own statement), so a loaded
    /// machine that stretches the sends does not make the test lie either way.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn receives_arriving_close_together_share_claim_statements() {
        let window = Duration::from_millis(100);
        let span = Arc::new(Mutex::new(Duration::ZERO));
        let measured = Arc::clone(&span);
        let m = trickled(window, 50, 40, |tx, _| async move {
            let began = tokio::time::Instant::now();
            for i in 0..40 {
                tx.send(JobKey::new(format!("k{i}")).expect("key")).expect("source alive");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            *measured.lock().expect("span") = began.elapsed();
        })
        .await;
        assert_eq!((m.claims, m.completions), (40, 40), "{m}");
        let span = *span.lock().expect("span");
        // Without the window: one statement per delivery (40).
        let groups = span.as_millis().div_ceil(window.as_millis()) as u64;
        let bound = 2 + groups;
        assert!(bound < 20, "the sends took {span:?}: too loaded a machine to tell the window from none");
        assert!(
            m.claim_statements <= bound,
            "40 receives within {span:?} took {} claim statements (at most {bound} with a {window:?} window)",
            m.claim_statements
        );
    }

    /// Deliveries that come one at a time (each after the previous job is done) are claimed at
    /// once: the window adds nothing to their latency, however large.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn deliveries_one_at_a_time_do_not_wait_for_the_window() {
        let m = trickled(Duration::from_secs(5), 0, 5, |tx, metrics| async move {
            for i in 0..5u64 {
                let sent = tokio::time::Instant::now();
                tx.send(JobKey::new(format!("k{i}")).expect("key")).expect("source alive");
                while metrics.snapshot().completions <= i {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
                assert!(sent.elapsed() < Duration::from_secs(1), "job {i} took {:?}", sent.elapsed());
            }
        })
        .await;
        assert_eq!((m.claims, m.completions, m.claim_statements), (5, 5, 5), "{m}");
    }

    /// Issue #12 §2 bullet 4 (the gauge and the bound). [`Consumer::unsettled`] counts
    /// deliveries from their receive until the broker was told. With a bound of 5, five running
    /// jobs hold every place: a sixth delivery waiting at the source is not received until they
    /// are settled; once everything is acknowledged and the consumer stopped no place is taken.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_the_unsettled_gauge_follows_deliveries() {
        let store = SqliteFence::open("sqlite::memory:").await.expect("open");
        store.migrate().await.expect("migrate");
        let (tx, rx) = mpsc::unbounded_channel();
        let source = Trickle { queue: QueueName::new("gauge").expect("queue"), keys: tokio::sync::Mutex::new(rx) };
        let config = ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).expect("lease")))
            .concurrency(8)
            .max_unsettled(5);
        let consumer = Arc::new(Consumer::new(source, Arc::new(store), config));
        let gate = Arc::new(Semaphore::new(0));
        let stop = CancellationToken::new();
        let run = tokio::spawn({
            let (consumer, stop, gate) = (Arc::clone(&consumer), stop.clone(), Arc::clone(&gate));
            async move {
                let handler = move |_ctx: fence::JobContext| {
                    let gate = Arc::clone(&gate);
                    async move {
                        let _pass = gate.acquire().await;
                        Ok(Vec::new())
                    }
                };
                consumer.run(handler, stop).await
            }
        });
        for i in 0..5 {
            tx.send(JobKey::new(format!("k{i}")).expect("key")).expect("source alive");
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while consumer.supervisor().in_flight() < 5 {
            assert!(tokio::time::Instant::now() < deadline, "five jobs running: {}", consumer.metrics().snapshot());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(consumer.unsettled(), 5);
        tx.send(JobKey::new("k5").expect("key")).expect("source alive");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(consumer.supervisor().in_flight(), 5, "a sixth delivery was received beyond the bound");
        assert_eq!(consumer.metrics().snapshot().claims, 5);
        gate.add_permits(6);
        while consumer.metrics().snapshot().acks < 6 {
            assert!(tokio::time::Instant::now() < deadline, "all acknowledged: {}", consumer.metrics().snapshot());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stop.cancel();
        run.await.expect("join").expect("run");
        assert_eq!(consumer.unsettled(), 0);
    }
}
