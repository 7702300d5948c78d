//! The consumer runtime shared by every source: receive, claim in one batch, supervise under the
//! lease, commit through the fence, then tell the broker.
//!
//! This file holds the [`Consumer`] (its construction, and the run that wires the parts together)
//! and what the parts share; each part has a file of its own:
//!
//! - `config`: [`ConsumerConfig`], how a consumer runs;
//! - `receive`: the receive loop, the budgets a delivery draws on, and the sorting of a received
//!   batch;
//! - `claim`: the group claim (claim loop, one statement per batch) and starting attempts;
//! - `settle`: telling the broker what became of a delivery, acknowledgements in batches;
//! - `tracked`: the broker handles of running attempts, for heartbeats;
//! - `prune`: the background pruner;
//! - `backoff`: retry pauses;
//! - `shutdown`: [`shutdown_signal`].

use std::collections::HashMap;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fence::{FenceStore, Metrics, Owner, Supervisor};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::handler::Handler;
use crate::source::{Source, SourceError};

mod backoff;
mod claim;
mod config;
mod prune;
mod receive;
mod settle;
mod shutdown;
#[cfg(all(test, feature = "sqlite"))]
mod tests;
mod tracked;

pub use config::ConsumerConfig;
#[doc(hidden)]
pub use config::DEFAULT_CLAIM_WINDOW;
pub use shutdown::shutdown_signal;

use claim::ClaimQueue;
use prune::prune_loop;
use receive::Budget;
use settle::{PendingAck, ack_loop};
use tracked::{SourceHook, Tracked};

/// What the runtime tells a source's `receive` about the claims it may make itself.
#[derive(Debug, Clone)]
pub struct ReceiveContext {
    /// The worker's owner id.
    pub owner: Owner,
    /// The lease length.
    pub lease: fence::LeaseDuration,
    /// Cancelled when the consumer stops: a receive that waits for deliveries to come (an idle
    /// table queue) returns what it has at once. (A receive that does not look at it is still
    /// given the grace period to finish, and what it returns is given back.)
    pub shutdown: CancellationToken,
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
        // The attempt timeout is the runtime's to apply (see `Shared::start`): a prefetched job
        // waits for its handler slot inside the supervised attempt, and that wait is no part of
        // the attempt's time.
        let supervisor_config = config.supervisor.clone().without_attempt_timeout();
        let supervisor = Supervisor::with_metrics(store, owner, supervisor_config, metrics);
        let tracked = Arc::new(Tracked(Mutex::new(HashMap::new())));
        let source_prefetch = source.default_prefetch(config.concurrency);
        let config = config.with_default_prefetch(source_prefetch);
        supervisor.add_hook(Arc::new(SourceHook { source: Arc::clone(&source), tracked: Arc::clone(&tracked) }));
        let unsettled = Arc::new(Semaphore::new(config.get_max_unsettled()));
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
                Err(SourceError::Fatal(Box::new(e)))
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
    /// [`ConsumerConfig::max_unsettled`].
    ///
    /// ```no_run
    /// # fn demo(consumer: &brokerfence::Consumer<brokerfence::TableQueue>) {
    /// println!("{} deliveries unsettled", consumer.unsettled());
    /// # }
    /// ```
    pub fn unsettled(&self) -> usize {
        self.config.get_max_unsettled().saturating_sub(self.unsettled.available_permits())
    }

    /// Runs until `shutdown` fires or the source fails fatally; then stops receiving, lets
    /// running jobs finish within the grace period, releases the leases of the rest, and returns.
    /// Transient source and database errors are retried with backoff and never end the loop.
    ///
    /// Claims are grouped and run in tasks of their own, so the next receive overlaps them. At
    /// most `concurrency` deliveries are held from receive until their handler returns (plus
    /// `prefetch` more ahead of the handlers, if set); a slot frees the moment its handler
    /// returns, so commits and acks overlap the next jobs. At most
    /// [`max_unsettled`](ConsumerConfig::max_unsettled) deliveries are held from receive until
    /// the broker call that settles them returned: a broker that hangs stops the receiving.
    /// The supervisor's [`attempt_timeout`](fence::SupervisorConfig::attempt_timeout) counts from
    /// when a handler starts, so a prefetched job waiting for a slot does not spend it.
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
    /// [`shutdown_signal`] makes one that fires on SIGTERM or Ctrl-C). To stop on any other
    /// event, cancel the token when it happens:
    ///
    /// ```no_run
    /// # async fn demo(consumer: brokerfence::Consumer<brokerfence::TableQueue>) -> Result<(), brokerfence::SourceError> {
    /// let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    /// # drop(stop);
    /// let shutdown = brokerfence::CancellationToken::new();
    /// let fire = shutdown.clone();
    /// tokio::spawn(async move {
    ///     let _ = stopped.await; // fires when `stop` is sent (or dropped)
    ///     fire.cancel();
    /// });
    /// consumer.run(|ctx| async move { Ok(format!("done at epoch {}", ctx.epoch())) }, shutdown).await?;
    /// # Ok(()) }
    /// ```
    pub async fn run<H: Handler>(&self, handler: H, shutdown: CancellationToken) -> Result<(), SourceError> {
        self.run_with_token(handler, &shutdown).await
    }

    async fn run_with_token<H: Handler>(&self, handler: H, shutdown: &CancellationToken) -> Result<(), SourceError> {
        if let Err(e) = self.source.check() {
            tracing::error!(error = %e, "the source's configuration cannot work; consumer refuses to start");
            return Err(e);
        }
        self.check_schema().await?;
        let places = self.config.places();
        // Every queued acknowledgement holds an unsettled place, so the channel never fills
        // before the receive loop stops; a sender waits when it does (an ack is never dropped).
        let (ack_tx, ack_rx) = mpsc::channel(self.config.get_max_unsettled().max(1));
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
            attempt_timeout: self.config.supervisor.get_attempt_timeout(),
            grace: self.config.grace,
            claim_failures: AtomicU32::new(0),
            // Fires with `shutdown`, and also when the loop ends on a fatal source error.
            stopping: shutdown.child_token(),
            tasks: TaskTracker::new(),
            slots: self.config.prefetching().map(|_| Arc::new(Semaphore::new(self.config.concurrency))),
            claims: Mutex::new(Some(claims_tx)),
        });
        let permits = Budget { places: Arc::new(Semaphore::new(places)), unsettled: Arc::clone(&self.unsettled) };
        shared.tasks.spawn(Arc::clone(&shared).claim_loop(
            claims_rx,
            self.config.get_claim_window(),
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

/// How long [`Consumer::run`] waits for the schema check before starting anyway.
const SCHEMA_CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// What the receive loop, the claim tasks and the job tasks share.
struct Shared<S: Source, H> {
    source: Arc<S>,
    supervisor: Supervisor,
    tracked: Arc<Tracked<S::Delivery>>,
    handler: H,
    /// Bounded: a sender waits while it is full.
    ack_tx: mpsc::Sender<PendingAck<S::Delivery>>,
    lease: fence::LeaseDuration,
    /// The attempt timeout, counted from when a handler starts (has its slot).
    attempt_timeout: Option<Duration>,
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
