//! The consumer runtime shared by every source: receive, claim in one batch, supervise under the
//! lease, commit through the fence, then tell the broker.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use fence::{Claim, Counter, FenceStore, Lease, LeaseHook, Metrics, Owner, Supervisor, SupervisorConfig};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::disposition::Disposition;
use crate::handler::Handler;
use crate::source::{Incoming, Source, SourceError};

/// How a consumer runs.
///
/// ```
/// use fence::{LeaseDuration, SupervisorConfig};
/// let config = adapters::ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap()))
///     .concurrency(32)
///     .batch(10);
/// assert_eq!(config.concurrency_limit(), 32);
/// ```
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    supervisor: SupervisorConfig,
    concurrency: usize,
    batch: usize,
    grace: Duration,
    ack_batch: usize,
    ack_linger: Duration,
}

impl ConsumerConfig {
    /// 16 jobs at once, batches of 10, 30 s shutdown grace, acks batched by 10 or 20 ms.
    pub fn new(supervisor: SupervisorConfig) -> Self {
        Self {
            supervisor,
            concurrency: 16,
            batch: 10,
            grace: Duration::from_secs(30),
            ack_batch: 10,
            ack_linger: Duration::from_millis(20),
        }
    }
    /// Jobs running at once.
    pub fn concurrency(mut self, n: usize) -> Self {
        self.concurrency = n.max(1);
        self
    }
    /// Deliveries asked for per receive.
    pub fn batch(mut self, n: usize) -> Self {
        self.batch = n.max(1);
        self
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
/// # async fn demo(store: std::sync::Arc<dyn fence::FenceStore>) -> Result<(), adapters::SourceError> {
/// use adapters::{Consumer, ConsumerConfig, postgres::TableQueue};
/// use fence::{LeaseDuration, QueueName, SupervisorConfig};
/// let source = TableQueue::new(store.clone(), QueueName::new("emails").unwrap());
/// let config = ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap()));
/// let consumer = Consumer::new(source, store, config);
/// let stop = adapters::shutdown_signal();
/// consumer.run(|ctx: fence::JobContext| async move { Ok(ctx.payload().to_vec()) }, stop).await?;
/// # Ok(()) }
/// ```
pub struct Consumer<S: Source> {
    source: Arc<S>,
    supervisor: Supervisor,
    config: ConsumerConfig,
    tracked: Arc<Tracked<S::Delivery>>,
}

impl<S: Source> std::fmt::Debug for Consumer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Consumer").field("supervisor", &self.supervisor).field("config", &self.config).finish()
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
        let supervisor = Supervisor::new(store, owner, config.supervisor.clone());
        let tracked = Arc::new(Tracked(Mutex::new(HashMap::new())));
        supervisor.add_hook(Arc::new(SourceHook { source: Arc::clone(&source), tracked: Arc::clone(&tracked) }));
        Self { source, supervisor, config, tracked }
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

    /// Runs until `shutdown` fires or the source fails fatally; then stops receiving, lets
    /// running jobs finish within the grace period, releases the leases of the rest, and returns.
    /// Transient source and database errors are retried with backoff and never end the loop.
    pub async fn run<H: Handler>(&self, handler: H, shutdown: CancellationToken) -> Result<(), SourceError> {
        let (ack_tx, ack_rx) = mpsc::unbounded_channel();
        let acker = tokio::spawn(ack_loop(
            Arc::clone(&self.source),
            ack_rx,
            self.config.ack_batch,
            self.config.ack_linger,
            Arc::clone(self.supervisor.metrics()),
        ));
        let mut tasks = JoinSet::new();
        let result = self.receive_loop(&handler, &shutdown, &ack_tx, &mut tasks).await;
        tracing::info!(in_flight = self.supervisor.in_flight(), "consumer stopping");
        self.supervisor.shutdown(self.config.grace).await;
        while let Some(joined) = tasks.join_next().await {
            if let Err(e) = joined {
                tracing::error!(error = %e, "job task panicked");
            }
        }
        drop(ack_tx);
        if let Err(e) = acker.await {
            tracing::error!(error = %e, "ack task panicked");
        }
        tracing::info!(metrics = %self.supervisor.metrics().snapshot(), "consumer stopped");
        result
    }

    async fn receive_loop<H: Handler>(
        &self,
        handler: &H,
        shutdown: &CancellationToken,
        ack_tx: &mpsc::UnboundedSender<S::Delivery>,
        tasks: &mut JoinSet<()>,
    ) -> Result<(), SourceError> {
        let ctx = ReceiveContext { owner: self.supervisor.owner().clone(), lease: self.config.supervisor.lease() };
        let mut backoff = Backoff::default();
        loop {
            while let Some(joined) = tasks.try_join_next() {
                if let Err(e) = joined {
                    tracing::error!(error = %e, "job task panicked");
                }
            }
            if shutdown.is_cancelled() {
                return Ok(());
            }
            let free = self.config.concurrency.saturating_sub(tasks.len());
            if free == 0 {
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tasks.join_next() => continue,
                }
            }
            let asked_at = std::time::Instant::now();
            let received = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                r = self.source.receive(free.min(self.config.batch), &ctx) => r,
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
            if let Err(wait) = self.dispatch(incoming, asked_at, handler, ack_tx, tasks).await {
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(wait.min(backoff.next())) => {}
                }
            }
        }
    }

    /// Claims what needs claiming (one statement for the whole batch) and starts the attempts.
    /// Returns Err(wait) when the database could not be asked.
    async fn dispatch<H: Handler>(
        &self,
        incoming: Vec<Incoming<S::Delivery>>,
        asked_at: std::time::Instant,
        handler: &H,
        ack_tx: &mpsc::UnboundedSender<S::Delivery>,
        tasks: &mut JoinSet<()>,
    ) -> Result<(), Duration> {
        let metrics = self.supervisor.metrics();
        let mut unclaimed = Vec::new();
        for item in incoming {
            match item {
                Incoming::Malformed { delivery, reason } => {
                    tracing::warn!(%reason, "malformed delivery: dead-lettering it");
                    metrics.incr(Counter::DeadLetters);
                    self.settle(delivery, Disposition::DeadLetter(reason), ack_tx).await;
                }
                Incoming::Claimed { delivery, job } => {
                    metrics.incr(Counter::Claims);
                    self.start(job.lease, asked_at, job.payload, job.progress, delivery, handler, ack_tx, tasks);
                }
                Incoming::Unclaimed { delivery, key, payload } => unclaimed.push((delivery, key, payload)),
            }
        }
        if unclaimed.is_empty() {
            return Ok(());
        }
        let keys: Vec<_> = unclaimed.iter().map(|(_, k, _)| k.clone()).collect();
        let claim_sent = std::time::Instant::now();
        let claims = match self
            .supervisor
            .store()
            .claim_batch(self.source.queue(), &keys, self.supervisor.owner(), self.config.supervisor.lease())
            .await
        {
            Ok(c) => c,
            Err(e) => {
                // Leave the deliveries to the broker's visibility timeout: they come back.
                tracing::error!(error = %e, n = keys.len(), "claim failed; deliveries left to the broker");
                return Err(Duration::from_millis(500));
            }
        };
        let mut started = HashSet::new();
        for ((delivery, key, payload), claim) in unclaimed.into_iter().zip(claims) {
            match Disposition::after_claim(&claim) {
                None if started.insert(key.clone()) => {
                    if let Claim::Claimed(lease) = claim {
                        metrics.incr(Counter::Claims);
                        self.start(lease, claim_sent, payload, None, delivery, handler, ack_tx, tasks);
                    }
                }
                None => {
                    // The same key twice in one batch: the first runs; this one waits its turn.
                    let hold = claim.lease().map(|l| l.ttl).unwrap_or_default();
                    metrics.incr(Counter::Busy);
                    self.settle(delivery, Disposition::Hold(hold), ack_tx).await;
                }
                Some(d) => {
                    match &d {
                        Disposition::Hold(_) => metrics.incr(Counter::Busy),
                        Disposition::Ack | Disposition::DeadLetter(_) => metrics.incr(Counter::Duplicates),
                        _ => {}
                    }
                    tracing::debug!(%key, disposition = ?d, "delivery not claimed");
                    self.settle(delivery, d, ack_tx).await;
                }
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn start<H: Handler>(
        &self,
        lease: Lease,
        claimed_at: std::time::Instant,
        payload: Vec<u8>,
        progress: Option<Vec<u8>>,
        delivery: S::Delivery,
        handler: &H,
        ack_tx: &mpsc::UnboundedSender<S::Delivery>,
        tasks: &mut JoinSet<()>,
    ) {
        let supervisor = self.supervisor.clone();
        let tracked = Arc::clone(&self.tracked);
        let source = Arc::clone(&self.source);
        let handler = handler.clone();
        let ack_tx = ack_tx.clone();
        tracked.insert(&lease, delivery.clone());
        tasks.spawn(async move {
            // The deadline counts from before the claim was asked for, not from when it started.
            let outcome = supervisor
                .run_claimed_at(lease.clone(), claimed_at, payload, progress, move |ctx| handler.call(ctx))
                .await;
            tracked.remove(&lease);
            let disposition = Disposition::after_run(&outcome);
            settle(&*source, delivery, disposition, &ack_tx, supervisor.metrics()).await;
        });
    }

    async fn settle(&self, delivery: S::Delivery, d: Disposition, ack_tx: &mpsc::UnboundedSender<S::Delivery>) {
        settle(&*self.source, delivery, d, ack_tx, self.supervisor.metrics()).await;
    }
}

async fn settle<S: Source>(
    source: &S,
    delivery: S::Delivery,
    d: Disposition,
    ack_tx: &mpsc::UnboundedSender<S::Delivery>,
    metrics: &Metrics,
) {
    let result = match d {
        Disposition::Ack => {
            if ack_tx.send(delivery.clone()).is_err() {
                // The ack task is gone (shutdown): acknowledge directly.
                source.ack(vec![delivery]).await.map(|()| metrics.incr(Counter::Acks))
            } else {
                Ok(())
            }
        }
        Disposition::RetryLater(delay) => source.retry_later(delivery, delay).await,
        Disposition::DeadLetter(reason) => source.dead_letter(delivery, &reason).await,
        Disposition::Hold(ttl) => source.hold(delivery, ttl).await,
        Disposition::Abandon => source.abandon(delivery).await,
        Disposition::Leave => Ok(()),
    };
    if let Err(e) = result {
        tracing::warn!(error = %e, "broker call failed; the delivery will come back and be deduplicated by the fence");
    }
}

async fn ack_loop<S: Source>(
    source: Arc<S>,
    mut rx: mpsc::UnboundedReceiver<S::Delivery>,
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
        let n = batch.len() as u64;
        let mut backoff = Backoff::default();
        let mut tries = 0;
        loop {
            tries += 1;
            match source.ack(batch.clone()).await {
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
                    tracing::error!(error = %e, n, "ack failed for good; redeliveries will be acked as duplicates");
                    break;
                }
            }
        }
    }
}

/// Exponential backoff, 100 ms doubling to 5 s.
#[derive(Debug, Default)]
struct Backoff(u32);

impl Backoff {
    fn next(&mut self) -> Duration {
        let d = Duration::from_millis(100).saturating_mul(1 << self.0.min(6)).min(Duration::from_secs(5));
        self.0 = self.0.saturating_add(1);
        d
    }
    fn reset(&mut self) {
        self.0 = 0;
    }
}

/// A token that fires on SIGTERM or Ctrl-C: pass it to [`Consumer::run`].
///
/// ```no_run
/// # async fn demo() {
/// let stop = adapters::shutdown_signal();
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
