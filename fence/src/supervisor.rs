//! The lease supervisor: runs handlers under leases, renews all of a worker's leases with one
//! statement per tick, cancels a handler the moment its lease is lost, and finishes every attempt
//! through the fenced commit.
//!
//! A finished attempt stays in the heartbeat set until the database has answered its commit (or
//! failure record, or release), so a slow commit never outlives its lease. Broker hooks
//! ([`LeaseHook`]) run beside the heartbeat, each in a task of its own with a timeout of at most
//! lease/3: a slow broker costs a visibility extension, never a renewal.
//!
//! A handler is never polled again once its lease is lost or its monotonic deadline has passed:
//! the [`Guarded`] wrapper checks both before every poll, so a worker resumed after a long stall
//! (a GC pause, a SIGSTOP) cannot take one more step before it notices.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::{Instant, Sleep};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};
use tracing::Instrument;

use crate::error::{FenceError, Result};
use crate::group::Grouper;
use crate::hook_runner::{HookRunner, LiveCheck};
use crate::job::{IntoJobResult, JobError};
#[cfg(feature = "metrics")]
use crate::metrics::LossKind;
use crate::metrics::{Counter, Distribution, Metrics};
use crate::model::{FailOutcome, Lease, LeaseDuration, RetryPolicy};
use crate::own_tx::FencedConnection;
use crate::store::FenceStore;
use crate::{JobKey, Owner, QueueName};

/// How a supervisor runs attempts.
///
/// ```
/// use std::time::Duration;
/// use brokerfence::{LeaseDuration, SupervisorConfig};
/// let config = SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap())
///     .attempt_timeout(Duration::from_secs(120));
/// assert_eq!(config.lease().heartbeat_interval(), Duration::from_secs(10));
/// assert_eq!(config.commit_window_length(), brokerfence::DEFAULT_COMMIT_WINDOW);
/// assert_eq!(config.hook_timeout_length(), Duration::from_secs(10)); // lease/3
/// assert_eq!(config.settle_timeout_length(), Duration::from_secs(60)); // 2 × lease, at least 30 s
/// ```
#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    lease: LeaseDuration,
    retry: RetryPolicy,
    attempt_timeout: Option<Duration>,
    commit_window: Duration,
    hook_timeout: Option<Duration>,
    settle_timeout: Option<Duration>,
    cancel_on_loss: bool,
}

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
        }
    }

    /// How long one call of a broker hook ([`LeaseHook`]) may take before it is dropped (a
    /// warning, and [`Counter::HookTimeouts`]; the database lease stands). Never more than the
    /// heartbeat interval, lease/3, which is also the default: a longer value is cut to it.
    ///
    /// Hooks run beside the heartbeat in tasks of their own, so a slow broker costs a visibility
    /// extension, never a renewal.
    ///
    /// ```
    /// use std::time::Duration;
    /// use brokerfence::{LeaseDuration, SupervisorConfig};
    /// let config = SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap());
    /// assert_eq!(config.clone().hook_timeout(Duration::from_secs(2)).hook_timeout_length(), Duration::from_secs(2));
    /// assert_eq!(config.hook_timeout(Duration::from_secs(60)).hook_timeout_length(), Duration::from_secs(10));
    /// ```
    pub fn hook_timeout(mut self, timeout: Duration) -> Self {
        self.hook_timeout = Some(timeout);
        self
    }

    /// The [`hook_timeout`](Self::hook_timeout) in force: at most lease/3.
    pub fn hook_timeout_length(&self) -> Duration {
        let most = self.lease.heartbeat_interval();
        self.hook_timeout.map_or(most, |t| t.min(most))
    }

    /// How long a finished attempt waits for the database's verdict on its commit, failure record
    /// or release (its lease is renewed all the while). Past it the outcome is
    /// [`Outcome::StoreError`] with [`FenceError::CommitUnconfirmed`]: never acknowledged, and a
    /// redelivery finds the job committed or claimable. Default: twice the lease, at least 30 s.
    ///
    /// ```
    /// use std::time::Duration;
    /// use brokerfence::{LeaseDuration, SupervisorConfig};
    /// let config = SupervisorConfig::new(LeaseDuration::from_secs(5).unwrap());
    /// assert_eq!(config.settle_timeout_length(), Duration::from_secs(30));
    /// let config = config.settle_timeout(Duration::from_secs(12));
    /// assert_eq!(config.settle_timeout_length(), Duration::from_secs(12));
    /// ```
    pub fn settle_timeout(mut self, timeout: Duration) -> Self {
        self.settle_timeout = Some(timeout);
        self
    }

    /// The [`settle_timeout`](Self::settle_timeout) in force.
    pub fn settle_timeout_length(&self) -> Duration {
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
    /// assert_eq!(config.commit_window_length(), Duration::from_millis(20));
    /// ```
    pub fn commit_window(mut self, window: Duration) -> Self {
        self.commit_window = window;
        self
    }

    /// The [`commit_window`](Self::commit_window).
    pub fn commit_window_length(&self) -> Duration {
        self.commit_window
    }

    /// Retry policy for failed attempts.
    pub fn retry(mut self, retry: RetryPolicy) -> Self {
        self.retry = retry;
        self
    }

    /// Per-attempt deadline: an attempt still running after it fails (and is retried).
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
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
    pub fn retry_policy(&self) -> &RetryPolicy {
        &self.retry
    }

    /// The margin kept between the worker's own deadline and the lease's end: a tenth of the
    /// lease, between 100 ms and 2 s. It covers the round trip and clock-rate drift.
    pub fn safety_margin(&self) -> Duration {
        (self.lease.get() / 10).clamp(Duration::from_millis(100), Duration::from_secs(2))
    }
}

/// Why a handler was stopped before it finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossReason {
    /// The database says another owner holds a newer epoch (or the job is no longer running).
    Superseded,
    /// No heartbeat could confirm the lease before the worker's monotonic deadline: it may have
    /// expired, so the worker stops before anyone else could take over.
    Unconfirmed,
    /// The supervisor is shutting down and the grace period ran out.
    Shutdown,
}

/// How one attempt ended. Only `Completed` may be acknowledged to a broker.
#[derive(Debug)]
pub enum Outcome {
    /// The result is committed under this epoch.
    Completed,
    /// The attempt failed and was recorded; the job may run again after `retry_in`.
    Failed {
        /// The backoff.
        retry_in: Duration,
        /// The handler's message.
        error: String,
    },
    /// The attempt failed for good; the job is dead.
    Dead {
        /// The handler's message.
        error: String,
    },
    /// The lease was lost while the handler ran; it was cancelled and nothing was committed.
    LeaseLost {
        /// Why.
        reason: LossReason,
    },
    /// The handler finished but its commit was refused: another owner superseded it.
    Fenced(FenceError),
    /// The attempt was given back without spending an attempt (shutdown).
    Released,
    /// The commit could not be made (database error): its fate is unknown to this worker, so the
    /// delivery must not be acknowledged; a redelivery finds the job completed or claimable.
    StoreError(FenceError),
}

impl Outcome {
    /// True for [`Outcome::Completed`].
    pub fn is_completed(&self) -> bool {
        matches!(self, Outcome::Completed)
    }
}

/// Broker-side follow-up of the heartbeat, e.g. extending SQS visibility or a Redis lease key.
/// Called only with leases the database has just confirmed (or found lost).
///
/// Hooks never hold up the heartbeat: each runs in a task of its own, one call at a time, and a
/// call is dropped after [`SupervisorConfig::hook_timeout`] (at most lease/3). While a call is
/// out, later heartbeats' answers replace the waiting ones, so the next call carries only the
/// newest lease per job. Right before a `confirmed` call goes out, leases whose attempt has ended
/// or whose worker-side deadline has passed are left out, and each lease's `ttl` is what is left
/// of it at that moment: extend the broker by `ttl`, never by the full lease length. A lease whose
/// handler has returned keeps being confirmed until its commit has a verdict.
///
/// ```
/// use async_trait::async_trait;
/// use brokerfence::{Lease, LeaseHook};
/// struct Visibility;
/// #[async_trait]
/// impl LeaseHook for Visibility {
///     async fn confirmed(&self, leases: &[Lease]) {
///         for l in leases {
///             // e.g. ChangeMessageVisibility(handle of l, l.ttl), with the client's own timeout
///             println!("extend {} epoch {} by {:?}", l.key, l.epoch, l.ttl);
///         }
///     }
/// }
/// ```
#[async_trait]
pub trait LeaseHook: Send + Sync + 'static {
    /// The database confirmed and extended these leases (`ttl`: the time left now).
    async fn confirmed(&self, leases: &[Lease]);
    /// The database found these leases lost.
    async fn lost(&self, _leases: &[Lease]) {}
}

/// What a handler sees of its attempt.
#[derive(Clone)]
pub struct JobContext {
    lease: Lease,
    payload: Arc<[u8]>,
    progress: Option<Arc<[u8]>>,
    slot: Arc<SlotState>,
    store: Arc<dyn FenceStore>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for JobContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobContext").field("lease", &self.lease).field("payload_len", &self.payload.len()).finish()
    }
}

impl JobContext {
    /// The queue.
    pub fn queue(&self) -> &QueueName {
        &self.lease.queue
    }
    /// The job key.
    pub fn key(&self) -> &JobKey {
        &self.lease.key
    }
    /// The fencing token of this attempt: send it with every downstream call.
    pub fn epoch(&self) -> i64 {
        self.lease.epoch
    }
    /// This worker.
    pub fn owner(&self) -> &Owner {
        &self.lease.owner
    }
    /// The lease as claimed.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }
    /// The payload of the delivery.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }
    /// The last checkpoint of an earlier attempt, if any.
    pub fn progress(&self) -> Option<&[u8]> {
        self.progress.as_deref()
    }
    /// Fires when the lease is lost: pass it to work the handler spawns.
    pub fn cancellation(&self) -> CancellationToken {
        self.slot.token.clone()
    }
    /// True once the lease is lost.
    pub fn is_cancelled(&self) -> bool {
        self.slot.token.is_cancelled()
    }

    /// The fencing stamp to send with every downstream call of this attempt (see [`crate::wire`]).
    ///
    /// ```no_run
    /// # fn demo(ctx: brokerfence::JobContext) {
    /// for (name, value) in ctx.stamp().to_headers() {
    ///     println!("{name}: {value}"); // e.g. request.header(name, value)
    /// }
    /// # }
    /// ```
    pub fn stamp(&self) -> crate::wire::FenceStamp {
        crate::wire::FenceStamp::of_lease(&self.lease)
    }

    /// Stores progress under the lease. A `Fenced` answer also cancels this attempt.
    ///
    /// ```no_run
    /// # async fn handler(ctx: brokerfence::JobContext) -> Result<Vec<u8>, brokerfence::JobError> {
    /// ctx.checkpoint(b"page 3 of 10").await?; // a FenceError: the attempt fails (retried)
    /// # Ok(vec![]) }
    /// ```
    pub async fn checkpoint(&self, progress: &[u8]) -> Result<()> {
        match self.store.checkpoint(&self.lease, progress).await {
            Err(e @ FenceError::Fenced { .. }) => {
                self.metrics.incr(Counter::FencedRejections);
                self.slot.lose(LossReason::Superseded);
                Err(e)
            }
            other => other,
        }
    }

    /// Commits this attempt's result inside the handler's own transaction (`conn`: a
    /// `sqlx::PgConnection` for a [`PgFence`](crate::PgFence), a `sqlx::SqliteConnection` for a
    /// [`SqliteFence`](crate::SqliteFence)), so that the handler's rows and the fenced completion
    /// commit together or not at all. Once the handler returns, the supervisor reads the job row
    /// (one grouped statement for the attempts returning meanwhile, like the group commit)
    /// instead of committing the returned bytes: completed under this epoch means
    /// [`Outcome::Completed`] (the delivery is acknowledged, no second commit); still running under
    /// it means the transaction did not commit, and the attempt counts as failed (retried).
    ///
    /// A [`Fenced`](FenceError::Fenced) answer means a newer epoch holds the job: the transaction
    /// can no longer commit (PostgreSQL aborts it, SQLite is left with a deferred violation), and
    /// this attempt is cancelled like any superseded one. Call it last, right before `COMMIT`:
    /// from then on the transaction holds the job's row lock, which no claim can pass, but the
    /// lease's end does not move either ([`Heartbeat::held`](crate::Heartbeat::held)): past the
    /// worker-side deadline the handler is cancelled and its transaction dropped (rolled back).
    ///
    /// ```no_run
    /// # async fn handler(ctx: brokerfence::JobContext, pool: sqlx::PgPool) -> Result<Vec<u8>, brokerfence::JobError> {
    /// let mut tx = pool.begin().await?; // `?` on any error: the attempt fails and is retried
    /// sqlx::query("INSERT INTO invoices (job, epoch) VALUES ($1, $2)")
    ///     .bind(ctx.key().as_str())
    ///     .bind(ctx.epoch())
    ///     .execute(&mut *tx)
    ///     .await?;
    /// ctx.complete_in(&mut *tx, b"invoiced").await?;
    /// tx.commit().await?;
    /// Ok(Vec::new()) // not stored: the result given to complete_in is
    /// # }
    /// ```
    pub async fn complete_in<C: FencedConnection + ?Sized>(&self, conn: &mut C, result: &[u8]) -> Result<()> {
        // Set before the statement goes out: whatever its answer, the row decides afterwards.
        self.slot.own_commit.store(true, Ordering::Release);
        match conn.complete_on(self.store.concrete(), &self.lease, result).await {
            Err(e @ FenceError::Fenced { .. }) => {
                self.metrics.incr(Counter::FencedRejections);
                self.slot.lose(LossReason::Superseded);
                Err(e)
            }
            other => other,
        }
    }
}

struct SlotState {
    token: CancellationToken,
    /// Monotonic deadline, in nanoseconds after the supervisor's base instant.
    deadline: AtomicU64,
    loss: Mutex<Option<LossReason>>,
    /// The handler has returned; the attempt waits for the verdict on its commit, failure or
    /// release. Its lease is still renewed, but there is nothing left to cancel.
    settling: AtomicBool,
    /// The handler sent its own fenced completion ([`JobContext::complete_in`]): once it returns,
    /// the job row, not the handler's answer, says whether the result committed.
    own_commit: AtomicBool,
    /// When the loss was found (`brokerfence_lease_loss_to_cancel_seconds`).
    #[cfg(feature = "metrics")]
    lost_at: std::sync::OnceLock<Instant>,
}

impl SlotState {
    fn lose(&self, reason: LossReason) {
        #[cfg(feature = "metrics")]
        self.lost_at.get_or_init(Instant::now);
        if let Ok(mut loss) = self.loss.lock() {
            loss.get_or_insert(reason);
        }
        self.token.cancel();
    }

    fn reason(&self) -> LossReason {
        self.loss.lock().ok().and_then(|l| *l).unwrap_or(LossReason::Superseded)
    }
}

struct Slot {
    lease: Lease,
    state: Arc<SlotState>,
}

struct Inner {
    store: Arc<dyn FenceStore>,
    owner: Owner,
    config: SupervisorConfig,
    metrics: Arc<Metrics>,
    base: Instant,
    next_id: AtomicU64,
    /// Every attempt holding a lease: running handlers and finished ones awaiting their verdict.
    inflight: Mutex<HashMap<u64, Slot>>,
    /// Handlers running now (the registry minus the attempts awaiting their verdict).
    running: AtomicUsize,
    hooks: RwLock<Vec<HookRunner>>,
    /// Where hook tasks run.
    runtime: tokio::runtime::Handle,
    stop: CancellationToken,
    draining: CancellationToken,
    idle: tokio::sync::Notify,
    committer: tokio::sync::mpsc::Sender<CommitRequest>,
    /// Asks, in groups, whether handlers that committed in their own transaction did commit.
    verifier: tokio::sync::mpsc::Sender<VerifyRequest>,
    /// A renewal of the attempts awaiting their verdict is under way (one at a time).
    renewing_settling: std::sync::atomic::AtomicBool,
}

/// A result waiting for the group commit, and where to send the verdict.
/// How a handler's run ended: stopped (a loss), timed out (`Err(())`), or its own answer.
type HandlerResult = std::result::Result<std::result::Result<std::result::Result<Vec<u8>, JobError>, ()>, LossReason>;

type CommitRequest = (Lease, Vec<u8>, tokio::sync::oneshot::Sender<Result<()>>);

/// An attempt whose handler committed in its own transaction, and where to send whether its job
/// is completed under its lease.
type VerifyRequest = (Lease, tokio::sync::oneshot::Sender<Result<bool>>);

/// Most completions committed by one statement.
const MAX_COMMIT_BATCH: usize = 256;

/// Completions that may wait for a commit statement; past it, a completing attempt waits to
/// enqueue (its lease still renewed) instead of the queue growing.
const COMMIT_QUEUE: usize = 4 * MAX_COMMIT_BATCH;

/// Commit statements in flight at once. Two rather than more: completions that arrive while
/// both are busy make the next statement larger, so fewer statements carry the same commits
/// (measured with the table queue: 21 commits per statement at two, 11 at four, and 8 % more
/// throughput), and one slow statement (a row lock held by a claimer) still does not hold up
/// the next group.
const COMMITS_IN_FLIGHT: usize = 2;

/// Group commit: commits the queued completions with one `complete_batch` statement (one round
/// trip, one fsync), then answers each; up to [`COMMITS_IN_FLIGHT`] such statements run at once,
/// in the groups `groups` hands out ([`SupervisorConfig::commit_window`]). Each completion is
/// still its own compare-and-set: a fenced one is refused alone.
async fn commit_loop(store: Arc<dyn FenceStore>, metrics: Arc<Metrics>, mut groups: Grouper<CommitRequest>) {
    let in_flight = Arc::new(tokio::sync::Semaphore::new(COMMITS_IN_FLIGHT));
    loop {
        // While every commit slot is busy, completions keep piling up for the next statement.
        let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else { return };
        let Some(batch) = groups.next().await else { return };
        metrics.incr(Counter::CommitStatements);
        let (store, metrics) = (Arc::clone(&store), Arc::clone(&metrics));
        tokio::spawn(async move {
            let (n, sent) = (batch.len(), Instant::now());
            commit_batch(&*store, batch).await;
            metrics.observe_duration(Distribution::CommitDuration, sent.elapsed());
            metrics.observe(Distribution::CommitStatementJobs, n as f64);
            drop(permit);
        });
    }
}

/// Commits one group and answers each of its completions.
async fn commit_batch(store: &dyn FenceStore, batch: Vec<CommitRequest>) {
    let (items, replies): (Vec<(Lease, Vec<u8>)>, Vec<_>) =
        batch.into_iter().map(|(lease, result, reply)| ((lease, result), reply)).unzip();
    match store.complete_batch(&items).await {
        Ok(answers) => {
            for (reply, answer) in replies.into_iter().zip(answers) {
                let _ = reply.send(answer);
            }
        }
        Err(e) => {
            tracing::error!(error = %e, n = items.len(), "batched commit failed");
            let msg = e.to_string();
            for reply in replies {
                let _ = reply.send(Err(FenceError::CommitUnconfirmed(msg.clone())));
            }
        }
    }
}

/// The group read behind [`JobContext::complete_in`]: one
/// [`completed_under`](FenceStore::completed_under) statement answers every attempt that
/// queued meanwhile, grouped like the commits, up to [`COMMITS_IN_FLIGHT`] statements at once.
async fn verify_loop(store: Arc<dyn FenceStore>, mut groups: Grouper<VerifyRequest>) {
    let in_flight = Arc::new(tokio::sync::Semaphore::new(COMMITS_IN_FLIGHT));
    loop {
        let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else { return };
        let Some(batch) = groups.next().await else { return };
        let store = Arc::clone(&store);
        tokio::spawn(async move {
            let (leases, replies): (Vec<Lease>, Vec<_>) = batch.into_iter().unzip();
            match store.completed_under(&leases).await {
                Ok(answers) => {
                    for (reply, answer) in replies.into_iter().zip(answers) {
                        let _ = reply.send(Ok(answer));
                    }
                }
                Err(e) => {
                    tracing::error!(error = %e, n = leases.len(), "reading the handlers' own commits failed");
                    let msg = e.to_string();
                    for reply in replies {
                        let _ = reply.send(Err(FenceError::CommitUnconfirmed(msg.clone())));
                    }
                }
            }
            drop(permit);
        });
    }
}

/// Runs handlers under leases for one worker (one owner).
///
/// ```no_run
/// # async fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>, lease: brokerfence::Lease) {
/// use brokerfence::{Supervisor, SupervisorConfig, LeaseDuration};
/// let sup = Supervisor::new(store, lease.owner.clone(), SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap()));
/// let outcome = sup.run(lease, b"payload".to_vec(), None, |ctx| async move {
///     // call downstream with ctx.key() and ctx.epoch() ...
///     Ok(b"result".to_vec())
/// }).await;
/// assert!(outcome.is_completed());
/// # }
/// ```
#[derive(Clone)]
pub struct Supervisor {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor")
            .field("owner", &self.inner.owner)
            .field("config", &self.inner.config)
            .field("in_flight", &self.in_flight())
            .field("leases_held", &self.leases_held())
            .finish()
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl Supervisor {
    /// A supervisor for `owner`; starts its heartbeat task on the current tokio runtime.
    pub fn new(store: Arc<dyn FenceStore>, owner: Owner, config: SupervisorConfig) -> Self {
        Self::with_metrics(store, owner, config, Arc::new(Metrics::default()))
    }

    /// Like [`new`](Self::new), counting into shared metrics.
    pub fn with_metrics(
        store: Arc<dyn FenceStore>,
        owner: Owner,
        config: SupervisorConfig,
        metrics: Arc<Metrics>,
    ) -> Self {
        let (committer, commits) = tokio::sync::mpsc::channel(COMMIT_QUEUE);
        let (verifier, verifies) = tokio::sync::mpsc::channel(COMMIT_QUEUE);
        let inner = Arc::new(Inner {
            committer,
            verifier,
            store,
            owner,
            config,
            metrics,
            base: Instant::now(),
            next_id: AtomicU64::new(0),
            inflight: Mutex::new(HashMap::new()),
            running: AtomicUsize::new(0),
            hooks: RwLock::new(Vec::new()),
            runtime: tokio::runtime::Handle::current(),
            stop: CancellationToken::new(),
            draining: CancellationToken::new(),
            idle: tokio::sync::Notify::new(),
            renewing_settling: std::sync::atomic::AtomicBool::new(false),
        });
        // A completion waits the window out only while other handlers run: only their
        // completions can join it (attempts awaiting their own verdict do not count). Jobs
        // handled one at a time wait for nothing.
        let running = Arc::downgrade(&inner);
        let groups = Grouper::bounded(commits, MAX_COMMIT_BATCH, inner.config.commit_window)
            .busy(move || running.upgrade().is_some_and(|inner| inner.in_flight() > 0));
        tokio::spawn(commit_loop(Arc::clone(&inner.store), Arc::clone(&inner.metrics), groups));
        let running = Arc::downgrade(&inner);
        let groups = Grouper::bounded(verifies, MAX_COMMIT_BATCH, inner.config.commit_window)
            .busy(move || running.upgrade().is_some_and(|inner| inner.in_flight() > 0));
        tokio::spawn(verify_loop(Arc::clone(&inner.store), groups));
        let interval = inner.config.lease.heartbeat_interval();
        tokio::spawn(tick_loop(Arc::downgrade(&inner), inner.stop.clone(), interval));
        Self { inner }
    }

    /// Adds a broker-side hook, called after every heartbeat in a task of its own (see
    /// [`LeaseHook`]: each call bounded by [`SupervisorConfig::hook_timeout`], only the newest
    /// lease per job, never a lease past its deadline).
    pub fn add_hook(&self, hook: Arc<dyn LeaseHook>) {
        let inner = &self.inner;
        let registry = Arc::downgrade(inner);
        let live: LiveCheck = Arc::new(move |leases: &[Lease]| match registry.upgrade() {
            Some(inner) => inner.live(leases),
            None => vec![false; leases.len()],
        });
        if let Ok(mut hooks) = inner.hooks.write() {
            let runner = HookRunner::spawn(
                &inner.runtime,
                hook,
                hooks.len(),
                inner.config.hook_timeout_length(),
                live,
                Arc::clone(&inner.metrics),
                inner.stop.clone(),
            );
            hooks.push(runner);
        }
    }

    /// This worker's owner id.
    pub fn owner(&self) -> &Owner {
        &self.inner.owner
    }

    /// The configuration.
    pub fn config(&self) -> &SupervisorConfig {
        &self.inner.config
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn FenceStore> {
        &self.inner.store
    }

    /// The counters.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    /// Handlers running now. Attempts whose handler has returned and that wait for the verdict
    /// on their commit are not counted (see [`leases_held`](Self::leases_held)).
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight()
    }

    /// Leases this supervisor renews now: running handlers, and finished attempts waiting for
    /// the verdict on their commit, failure record or release (a lease is renewed until then).
    ///
    /// ```no_run
    /// # fn demo(sup: brokerfence::Supervisor) {
    /// assert!(sup.leases_held() >= sup.in_flight());
    /// # }
    /// ```
    pub fn leases_held(&self) -> usize {
        self.inner.leases_held()
    }

    /// True once [`shutdown`](Self::shutdown) began: take no more work.
    pub fn is_draining(&self) -> bool {
        self.inner.draining.is_cancelled()
    }

    /// A token that fires when shutdown begins.
    pub fn draining(&self) -> CancellationToken {
        self.inner.draining.clone()
    }

    /// Runs one attempt under `lease` and finishes it through the fenced commit.
    ///
    /// The handler is cancelled (its future dropped, its token fired) as soon as the lease is
    /// lost, the monotonic deadline passes unconfirmed, or the attempt timeout strikes.
    ///
    /// The worker's monotonic deadline counts the lease's `ttl` from *now*: call this right after
    /// the claim answered. When leases wait before they run (a batch claimed ahead), use
    /// [`run_claimed_at`](Self::run_claimed_at) so the time already spent counts.
    pub async fn run<F, Fut, R>(&self, lease: Lease, payload: Vec<u8>, progress: Option<Vec<u8>>, handler: F) -> Outcome
    where
        F: FnOnce(JobContext) -> Fut,
        Fut: Future<Output = std::result::Result<R, JobError>>,
        R: IntoJobResult,
    {
        self.run_claimed_at(lease, std::time::Instant::now(), payload, progress, handler).await
    }

    /// [`run`](Self::run) for a lease whose claim was *sent* at `claimed_at` (the instant taken
    /// just before the claim statement went out; a later instant shortens the safety margin by
    /// the delay). The worker stops trusting the lease at `claimed_at + ttl - safety margin`
    /// unless a heartbeat confirms it first, so a lease that waited in a local queue cannot
    /// outlive its database lease.
    ///
    /// ```no_run
    /// # async fn demo(sup: brokerfence::Supervisor, store: std::sync::Arc<dyn brokerfence::FenceStore>,
    /// #   q: brokerfence::QueueName, me: brokerfence::Owner) -> brokerfence::Result<()> {
    /// let sent = std::time::Instant::now();
    /// let jobs = store.claim_next(&q, &me, sup.config().lease(), 10).await?;
    /// for job in jobs {
    ///     let outcome = sup.run_claimed_at(job.lease, sent, job.payload, job.progress, |ctx| async move {
    ///         Ok(ctx.payload().to_vec())
    ///     }).await;
    ///     println!("{outcome:?}");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn run_claimed_at<F, Fut, R>(
        &self,
        lease: Lease,
        claimed_at: std::time::Instant,
        payload: Vec<u8>,
        progress: Option<Vec<u8>>,
        handler: F,
    ) -> Outcome
    where
        F: FnOnce(JobContext) -> Fut,
        Fut: Future<Output = std::result::Result<R, JobError>>,
        R: IntoJobResult,
    {
        // OpenTelemetry's messaging conventions where they apply (a "process" span on the
        // destination); `messaging.system` is filled in by the consumer runtime, which knows the
        // source. The project's own fields stay (`key` is the job key, not a broker message id).
        let span = tracing::info_span!(
            "attempt",
            queue = %lease.queue,
            key = %lease.key,
            epoch = lease.epoch,
            owner = %lease.owner,
            messaging.operation.type = "process",
            messaging.destination.name = %lease.queue,
            messaging.system = tracing::field::Empty,
        );
        self.run_inner(lease, Instant::from_std(claimed_at), payload, progress, handler).instrument(span).await
    }

    async fn run_inner<F, Fut, R>(
        &self,
        lease: Lease,
        claimed_at: Instant,
        payload: Vec<u8>,
        progress: Option<Vec<u8>>,
        handler: F,
    ) -> Outcome
    where
        F: FnOnce(JobContext) -> Fut,
        Fut: Future<Output = std::result::Result<R, JobError>>,
        R: IntoJobResult,
    {
        let inner = &self.inner;
        let margin = inner.config.safety_margin();
        let state = Arc::new(SlotState {
            token: CancellationToken::new(),
            deadline: AtomicU64::new(inner.nanos(claimed_at + lease.ttl.saturating_sub(margin))),
            loss: Mutex::new(None),
            settling: AtomicBool::new(false),
            own_commit: AtomicBool::new(false),
            #[cfg(feature = "metrics")]
            lost_at: std::sync::OnceLock::new(),
        });
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut map) = inner.inflight.lock() {
            map.insert(id, Slot { lease: lease.clone(), state: Arc::clone(&state) });
        }
        inner.running.fetch_add(1, Ordering::AcqRel);
        inner.metrics.in_flight(true);
        // Leaves the in-flight registry however this attempt ends: normally, by a panic in the
        // handler, or because the caller dropped this future. Otherwise the heartbeat would keep
        // renewing the lease of an attempt nobody runs any more, and the job would be stuck.
        let mut registered = Registered { inner, id: Some(id), state: Arc::clone(&state), running: true };
        let ctx = JobContext {
            lease: lease.clone(),
            payload: payload.into(),
            progress: progress.map(Into::into),
            slot: Arc::clone(&state),
            store: Arc::clone(&inner.store),
            metrics: Arc::clone(&inner.metrics),
        };
        let timeout = inner.config.attempt_timeout;
        let work = async move {
            // The result's conversion (a `Json` result's serialization) is part of the attempt.
            let handled = async move { handler(ctx).await.and_then(IntoJobResult::into_job_result) };
            match timeout {
                Some(t) => tokio::time::timeout(t, handled).await.map_err(|_| ()),
                None => Ok(handled.await),
            }
        };
        let guarded = Guarded::new(work, Arc::clone(&state), inner.base, inner.config.cancel_on_loss);
        let started = Instant::now();
        let result = guarded.await;
        match &result {
            Ok(_) => inner.metrics.observe_duration(Distribution::HandlerDuration, started.elapsed()),
            // The handler's future is dropped by now: the loss has reached it.
            #[cfg(feature = "metrics")]
            Err(reason @ (LossReason::Superseded | LossReason::Unconfirmed)) => {
                let kind = if *reason == LossReason::Superseded { LossKind::Superseded } else { LossKind::Unconfirmed };
                let found = state.lost_at.get().copied().unwrap_or(started);
                inner.metrics.loss_to_cancel(kind, found.elapsed());
            }
            Err(_) => {}
        }
        // The handler is done, but the lease stays registered, and renewed, until the database's
        // verdict on what follows: a commit that outlives the lease would let the job run again.
        registered.settle();

        let outcome = match result {
            Err(reason @ (LossReason::Superseded | LossReason::Unconfirmed)) => {
                registered.leave();
                inner.metrics.incr(Counter::LeaseLosses);
                inner.log_loss(&lease, reason).await;
                Outcome::LeaseLost { reason }
            }
            result if state.own_commit.load(Ordering::Acquire) => inner.after_own_commit(&lease, result, timeout).await,
            result => inner.finish(&lease, result, timeout).await,
        };
        registered.leave();
        outcome
    }
    /// Graceful shutdown: stop taking work ([`is_draining`](Self::is_draining)), wait up to `grace`
    /// for running attempts to finish, then cancel the rest and release their leases.
    pub async fn shutdown(&self, grace: Duration) {
        let inner = &self.inner;
        inner.draining.cancel();
        let deadline = Instant::now() + grace;
        while self.leases_held() > 0 && Instant::now() < deadline {
            let _ = tokio::time::timeout_at(
                deadline.min(Instant::now() + Duration::from_millis(100)),
                inner.idle.notified(),
            )
            .await;
        }
        // Attempts awaiting their verdict have nothing left to cancel: they settle on their own.
        let left: Vec<Arc<SlotState>> = inner
            .inflight
            .lock()
            .map(|m| {
                m.values().filter(|s| !s.state.settling.load(Ordering::Acquire)).map(|s| Arc::clone(&s.state)).collect()
            })
            .unwrap_or_default();
        for s in &left {
            s.lose(LossReason::Shutdown);
        }
        // Give the cancelled attempts a moment to release their leases.
        let release_deadline = Instant::now() + Duration::from_secs(10);
        while self.leases_held() > 0 && Instant::now() < release_deadline {
            let _ = tokio::time::timeout(Duration::from_millis(50), inner.idle.notified()).await;
        }
        inner.stop.cancel();
    }
}

/// Removes an attempt from the in-flight registry when dropped (or at [`leave`](Self::leave)),
/// and keeps the count of running handlers.
struct Registered<'a> {
    inner: &'a Inner,
    id: Option<u64>,
    state: Arc<SlotState>,
    running: bool,
}

impl Registered<'_> {
    /// The handler has returned: the attempt stays registered (its lease renewed) but no longer
    /// counts as running, and nothing cancels it any more.
    fn settle(&mut self) {
        self.state.settling.store(true, Ordering::Release);
        self.stop_running();
    }

    fn stop_running(&mut self) {
        if std::mem::take(&mut self.running) {
            self.inner.running.fetch_sub(1, Ordering::AcqRel);
            self.inner.metrics.in_flight(false);
        }
    }

    fn leave(&mut self) {
        self.stop_running();
        if let Some(id) = self.id.take() {
            self.inner.remove(id);
        }
    }
}

impl Drop for Registered<'_> {
    fn drop(&mut self) {
        if self.id.is_some() {
            tracing::warn!("attempt abandoned (handler panicked or its future was dropped); lease no longer renewed");
        }
        self.leave();
    }
}

impl Inner {
    fn in_flight(&self) -> usize {
        self.running.load(Ordering::Acquire)
    }

    fn leases_held(&self) -> usize {
        self.inflight.lock().map(|m| m.len()).unwrap_or(0)
    }

    /// For each lease, whether a broker may still be told to extend it: its attempt is
    /// registered, not cancelled, and before its worker-side deadline.
    fn live(&self, leases: &[Lease]) -> Vec<bool> {
        let now = self.nanos(Instant::now());
        let Ok(map) = self.inflight.lock() else { return vec![false; leases.len()] };
        let held: HashMap<(&str, &str, i64), bool> = map
            .values()
            .map(|s| {
                let live = !s.state.token.is_cancelled() && s.state.deadline.load(Ordering::Acquire) > now;
                ((s.lease.queue.as_str(), s.lease.key.as_str(), s.lease.epoch), live)
            })
            .collect();
        leases
            .iter()
            .map(|l| held.get(&(l.queue.as_str(), l.key.as_str(), l.epoch)).copied().unwrap_or(false))
            .collect()
    }

    /// Logs a lost lease with both epochs: ours and, when the database answers quickly, the one
    /// that superseded it.
    async fn log_loss(&self, lease: &Lease, reason: LossReason) {
        let current = match reason {
            LossReason::Superseded => {
                tokio::time::timeout(Duration::from_millis(500), self.store.job(&lease.queue, &lease.key)).await.ok()
            }
            _ => None,
        };
        match current {
            Some(Ok(Some(job))) => tracing::warn!(
                ?reason,
                key = %lease.key,
                epoch = lease.epoch,
                current_epoch = job.epoch,
                current_owner = job.owner.as_deref().unwrap_or("none"),
                current_state = %job.state,
                "lease lost: handler cancelled, nothing committed"
            ),
            _ => tracing::warn!(
                ?reason,
                key = %lease.key,
                epoch = lease.epoch,
                "lease lost: handler cancelled, nothing committed"
            ),
        }
    }

    /// Cancels every attempt whose monotonic deadline has passed, so that work spawned with
    /// [`JobContext::cancellation`] stops even when the attempt's own task is not being polled
    /// (for example because the handler is stuck in blocking code).
    fn expire_overdue(&self) {
        if !self.config.cancel_on_loss {
            return;
        }
        let now = self.nanos(Instant::now());
        if let Ok(map) = self.inflight.lock() {
            for slot in map.values() {
                // An attempt awaiting its verdict has no handler left to stop: its commit decides.
                if !slot.state.token.is_cancelled()
                    && !slot.state.settling.load(Ordering::Acquire)
                    && slot.state.deadline.load(Ordering::Acquire) <= now
                {
                    tracing::warn!(key = %slot.lease.key, epoch = slot.lease.epoch, "lease unconfirmed past its deadline; cancelling");
                    slot.state.lose(LossReason::Unconfirmed);
                }
            }
        }
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX)
    }

    fn remove(&self, id: u64) {
        if let Ok(mut map) = self.inflight.lock() {
            map.remove(&id);
            if map.is_empty() {
                self.idle.notify_waiters();
            }
        }
    }

    /// Finishes an attempt whose handler ended (or was stopped by shutdown) without a commit of
    /// its own: commits its result, records its failure or releases its lease.
    async fn finish(&self, lease: &Lease, result: HandlerResult, timeout: Option<Duration>) -> Outcome {
        match result {
            Err(LossReason::Shutdown) => match self.settled(self.store.release(lease)).await {
                Ok(()) => {
                    self.metrics.incr(Counter::Releases);
                    tracing::info!("lease released at shutdown");
                    Outcome::Released
                }
                Err(e) => self.commit_error(e),
            },
            Err(reason) => Outcome::LeaseLost { reason },
            Ok(Err(())) => {
                let msg = format!("attempt timed out after {:?}", timeout.unwrap_or_default());
                self.fail(lease, JobError::retry(msg)).await
            }
            Ok(Ok(Ok(result))) => match self.commit(lease, result).await {
                Ok(()) => {
                    self.metrics.incr(Counter::Completions);
                    tracing::debug!("result committed");
                    Outcome::Completed
                }
                Err(e) => self.commit_error(e),
            },
            Ok(Ok(Err(job_error))) => self.fail(lease, job_error).await,
        }
    }

    /// Finishes an attempt whose handler sent its own completion ([`JobContext::complete_in`]):
    /// the job row says whether the handler's transaction committed. Completed under this epoch
    /// and owner: done, nothing more to commit. Otherwise the transaction did not commit (rolled
    /// back, dropped, or never committed): the attempt ends as if the handler had not completed,
    /// and a handler that returned `Ok` anyway is recorded as a (retried) failure.
    async fn after_own_commit(&self, lease: &Lease, result: HandlerResult, timeout: Option<Duration>) -> Outcome {
        match self.completed_under(lease).await {
            Ok(true) => {
                self.metrics.incr(Counter::Completions);
                self.metrics.incr(Counter::OwnCommits);
                tracing::debug!("result committed in the handler's transaction");
                Outcome::Completed
            }
            Ok(false) => match result {
                Ok(Ok(Ok(_))) => {
                    let error = JobError::retry("the handler called complete_in, but its transaction did not commit");
                    self.fail(lease, error).await
                }
                other => self.finish(lease, other, timeout).await,
            },
            Err(e) => self.commit_error(e),
        }
    }

    /// Whether the job of `lease` is completed under it, through the group read (see
    /// [`verify_loop`]), bounded like a commit's verdict.
    async fn completed_under(&self, lease: &Lease) -> Result<bool> {
        let (reply, verdict) = tokio::sync::oneshot::channel();
        self.settled(async {
            match self.verifier.send((lease.clone(), reply)).await {
                Ok(()) => {
                    verdict.await.unwrap_or_else(|_| Err(FenceError::CommitUnconfirmed("the verifier stopped".into())))
                }
                Err(_) => {
                    Ok(self.store.completed_under(std::slice::from_ref(lease)).await?.first().copied().unwrap_or(false))
                }
            }
        })
        .await
    }

    /// Commits a result through the group commit (the fenced compare-and-set, batched). While
    /// the commit queue is full the attempt waits to enqueue (backpressure; its lease is still
    /// renewed); nothing is dropped.
    async fn commit(&self, lease: &Lease, result: Vec<u8>) -> Result<()> {
        let (reply, verdict) = tokio::sync::oneshot::channel();
        self.settled(async {
            match self.committer.send((lease.clone(), result, reply)).await {
                Ok(()) => {
                    verdict.await.unwrap_or_else(|_| Err(FenceError::CommitUnconfirmed("the committer stopped".into())))
                }
                Err(tokio::sync::mpsc::error::SendError((lease, result, _))) => {
                    self.store.complete(&lease, &result).await
                }
            }
        })
        .await
    }

    /// Waits for the database's verdict on a commit, failure record or release, at most
    /// [`SupervisorConfig::settle_timeout`]: past it the fate is unknown
    /// ([`FenceError::CommitUnconfirmed`]), so the delivery is not acknowledged.
    async fn settled<T>(&self, verdict: impl Future<Output = Result<T>>) -> Result<T> {
        let limit = self.config.settle_timeout_length();
        tokio::time::timeout(limit, verdict).await.unwrap_or_else(|_| {
            Err(FenceError::CommitUnconfirmed(format!("no verdict from the database within {limit:?}")))
        })
    }

    fn commit_error(&self, e: FenceError) -> Outcome {
        if e.is_fenced() {
            self.metrics.incr(Counter::FencedRejections);
            tracing::warn!(error = %e, "commit fenced: result dropped, delivery not acknowledged");
            Outcome::Fenced(e)
        } else {
            tracing::error!(error = %e, "commit failed: delivery not acknowledged");
            Outcome::StoreError(e)
        }
    }

    async fn fail(&self, lease: &Lease, error: JobError) -> Outcome {
        match self.settled(self.store.fail(lease, &error.message, error.retry, &self.config.retry)).await {
            Ok(FailOutcome::Retry { retry_in }) => {
                self.metrics.incr(Counter::Failures);
                tracing::info!(error = %error.message, ?retry_in, "attempt failed; will retry");
                Outcome::Failed { retry_in, error: error.message }
            }
            Ok(FailOutcome::Dead) => {
                self.metrics.incr(Counter::DeadLetters);
                tracing::warn!(error = %error.message, "attempt failed for good; job is dead");
                Outcome::Dead { error: error.message }
            }
            Err(e) => self.commit_error(e),
        }
    }

    /// One heartbeat: renews every in-flight lease in one statement. Returns false when the
    /// database could not confirm (so the next tick comes sooner).
    async fn tick(self: &Arc<Self>) -> bool {
        let snapshot: Vec<(u64, Lease, Arc<SlotState>)> = match self.inflight.lock() {
            Ok(map) => map.iter().map(|(id, s)| (*id, s.lease.clone(), Arc::clone(&s.state))).collect(),
            Err(_) => return false,
        };
        if snapshot.is_empty() {
            return true;
        }
        // Attempts awaiting their verdict are renewed by a statement of their own, in a task of
        // its own. Their rows may be locked by this worker's own commit statement (which may
        // itself wait on a lock held elsewhere): a renewal that waits on those locks must never
        // hold up, or delay the answer of, the renewal of the attempts still running, or one
        // stuck commit would cost every other lease of the worker.
        let (settling, running): (Vec<_>, Vec<_>) =
            snapshot.into_iter().partition(|(_, _, s)| s.settling.load(Ordering::Acquire));
        if !settling.is_empty() && !self.renewing_settling.swap(true, Ordering::AcqRel) {
            let me = Arc::clone(self);
            tokio::spawn(async move {
                let sent = Instant::now();
                let leases: Vec<Lease> = settling.iter().map(|(_, l, _)| l.clone()).collect();
                match me.renew(&leases, true).await {
                    Some(Ok(hb)) => me.apply_renewals(&settling, sent, hb.renewed, Vec::new()),
                    Some(Err(e)) => {
                        // Nothing to cancel: the verdict decides; the next tick tries again.
                        tracing::debug!(error = %e, leases = leases.len(), "renewal of attempts awaiting their verdict failed");
                    }
                    None => {}
                }
                me.renewing_settling.store(false, Ordering::Release);
            });
        }
        if running.is_empty() {
            return true;
        }
        let leases: Vec<Lease> = running.iter().map(|(_, l, _)| l.clone()).collect();
        let sent = Instant::now();
        match self.renew(&leases, false).await {
            Some(Ok(hb)) => {
                self.apply_renewals(&running, sent, hb.renewed, hb.lost);
                true
            }
            Some(Err(e)) => {
                tracing::warn!(error = %e, leases = leases.len(), "heartbeat failed; leases unconfirmed");
                false
            }
            None => true,
        }
    }

    /// Applies one renewal statement's answer for the attempts of `snapshot`: moves the
    /// deadlines of the renewed, cancels the lost that still run, and posts both to the hooks.
    fn apply_renewals(
        &self,
        snapshot: &[(u64, Lease, Arc<SlotState>)],
        sent: Instant,
        renewed: Vec<Lease>,
        lost: Vec<Lease>,
    ) {
        // (queue, key, epoch) → the slot's id and state, for the answers of this heartbeat.
        let by_id: HashMap<(&str, &str, i64), (u64, &Arc<SlotState>)> =
            snapshot.iter().map(|(id, l, s)| ((l.queue.as_str(), l.key.as_str(), l.epoch), (*id, s))).collect();
        let margin = self.config.safety_margin();
        for l in &renewed {
            if let Some((_, s)) = by_id.get(&(l.queue.as_str(), l.key.as_str(), l.epoch)) {
                let deadline = sent + l.ttl.saturating_sub(margin);
                s.deadline.fetch_max(self.nanos(deadline), Ordering::AcqRel);
            }
        }
        self.metrics.add(Counter::Renewals, renewed.len() as u64);
        let mut gone = Vec::with_capacity(lost.len());
        for l in lost {
            if let Some((_, s)) = by_id.get(&(l.queue.as_str(), l.key.as_str(), l.epoch)) {
                if s.settling.load(Ordering::Acquire) {
                    // Usually its own commit landed first; otherwise the commit is fenced. Either
                    // way the verdict decides, and the source hears of it through the outcome.
                    tracing::debug!(queue = %l.queue, key = %l.key, epoch = l.epoch, "lease ended while its verdict was pending");
                    continue;
                }
                tracing::warn!(queue = %l.queue, key = %l.key, epoch = l.epoch, "heartbeat found lease lost; cancelling");
                if self.config.cancel_on_loss {
                    s.lose(LossReason::Superseded);
                }
            }
            gone.push(l);
        }
        if let Ok(mut map) = self.inflight.lock() {
            for l in &renewed {
                let found = by_id.get(&(l.queue.as_str(), l.key.as_str(), l.epoch));
                if let Some(slot) = found.and_then(|(id, _)| map.get_mut(id)) {
                    slot.lease.lease_until = l.lease_until;
                    slot.lease.ttl = l.ttl;
                }
            }
        }
        // The broker hooks run in tasks of their own: posting never waits on a broker.
        if let Ok(hooks) = self.hooks.read() {
            for hook in hooks.iter() {
                hook.submit(sent, &renewed, &gone);
            }
        }
    }

    /// One renewal statement for `leases` (none when there are none), bounded by the heartbeat
    /// interval; `unless_locked`: skip rows another transaction holds locked.
    async fn renew(
        &self,
        leases: &[Lease],
        unless_locked: bool,
    ) -> Option<std::result::Result<crate::model::Heartbeat, String>> {
        if leases.is_empty() {
            return None;
        }
        self.metrics.incr(Counter::Heartbeats);
        let interval = self.config.lease.heartbeat_interval();
        let statement = async {
            if unless_locked {
                self.store.heartbeat_unless_locked(leases, self.config.lease).await
            } else {
                self.store.heartbeat(leases, self.config.lease).await
            }
        };
        let sent = Instant::now();
        let answer = tokio::time::timeout(interval, statement).await;
        self.metrics.observe_duration(Distribution::HeartbeatDuration, sent.elapsed());
        Some(match answer {
            Ok(answer) => answer.map_err(|e| e.to_string()),
            Err(_) => Err(format!("no answer within {interval:?}")),
        })
    }
}

async fn tick_loop(inner: Weak<Inner>, stop: CancellationToken, interval: Duration) {
    let retry = interval.min(Duration::from_millis(250));
    let mut wait = interval;
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        let Some(inner) = inner.upgrade() else { return };
        wait = if Inner::tick(&inner).await { interval } else { retry };
        inner.expire_overdue();
    }
}

/// Wraps a handler so that it is never polled once its lease is lost or its deadline has passed.
struct Guarded<F> {
    inner: Pin<Box<F>>,
    state: Arc<SlotState>,
    cancelled: Pin<Box<WaitForCancellationFutureOwned>>,
    sleep: Pin<Box<Sleep>>,
    armed: u64,
    base: Instant,
    enforce: bool,
}

impl<F: Future> Guarded<F> {
    fn new(inner: F, state: Arc<SlotState>, base: Instant, enforce: bool) -> Self {
        let armed = state.deadline.load(Ordering::Acquire);
        Self {
            inner: Box::pin(inner),
            cancelled: Box::pin(state.token.clone().cancelled_owned()),
            sleep: Box::pin(tokio::time::sleep_until(base + Duration::from_nanos(armed))),
            state,
            armed,
            base,
            enforce,
        }
    }
}

impl<F: Future> Future for Guarded<F> {
    type Output = std::result::Result<F::Output, LossReason>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        // With cancel-on-loss switched off (tests only) a lost lease is ignored, but shutdown still stops.
        let watch = this.enforce || (this.state.reason() == LossReason::Shutdown && this.state.token.is_cancelled());
        if watch && this.cancelled.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(this.state.reason()));
        }
        if this.enforce {
            loop {
                let deadline = this.state.deadline.load(Ordering::Acquire);
                if Instant::now() >= this.base + Duration::from_nanos(deadline) {
                    this.state.lose(LossReason::Unconfirmed);
                    return Poll::Ready(Err(this.state.reason()));
                }
                if deadline != this.armed {
                    this.armed = deadline;
                    this.sleep.as_mut().reset(this.base + Duration::from_nanos(deadline));
                }
                if this.sleep.as_mut().poll(cx).is_pending() {
                    break;
                }
            }
        }
        this.inner.as_mut().poll(cx).map(Ok)
    }
}

#[cfg(all(test, feature = "sqlite"))]
#[path = "supervisor_edges.rs"]
mod edges;

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use crate::{Claim, SqliteFence};

    async fn setup() -> (Supervisor, Lease) {
        let store = SqliteFence::open("sqlite::memory:").await.expect("open");
        store.migrate().await.expect("migrate");
        let lease_len = LeaseDuration::from_secs(3).expect("lease");
        let owner = Owner::unique("test");
        let (q, k) = (QueueName::new("q").expect("q"), JobKey::new("k").expect("k"));
        let lease = match store.claim(&q, &k, &owner, lease_len).await.expect("claim") {
            Claim::Claimed(l) => l,
            other => panic!("{other:?}"),
        };
        (Supervisor::new(Arc::new(store), owner, SupervisorConfig::new(lease_len)), lease)
    }

    /// Claims `n` keys on a fresh in-memory store; a supervisor with `window` for its owner.
    async fn claimed_many(n: usize, window: Duration) -> (Supervisor, Vec<Lease>) {
        let store = SqliteFence::open("sqlite::memory:").await.expect("open");
        store.migrate().await.expect("migrate");
        let lease_len = LeaseDuration::from_secs(30).expect("lease");
        let owner = Owner::unique("test");
        let q = QueueName::new("q").expect("q");
        let keys: Vec<JobKey> = (0..n).map(|i| JobKey::new(format!("k{i}")).expect("key")).collect();
        let leases = store
            .claim_batch(&q, &keys, &owner, lease_len)
            .await
            .expect("claim")
            .into_iter()
            .map(|c| match c {
                Claim::Claimed(l) => l,
                other => panic!("{other:?}"),
            })
            .collect();
        let config = SupervisorConfig::new(lease_len).commit_window(window);
        (Supervisor::new(Arc::new(store), owner, config), leases)
    }

    /// Runs one attempt whose handler returns after `work`; the time from its return to the
    /// committed outcome.
    async fn commit_latency(sup: &Supervisor, lease: Lease, work: Duration) -> Duration {
        let returned = Arc::new(Mutex::new(None));
        let mark = Arc::clone(&returned);
        let outcome = sup
            .run(lease, Vec::new(), None, move |_ctx| async move {
                tokio::time::sleep(work).await;
                *mark.lock().expect("lock") = Some(std::time::Instant::now());
                Ok(Vec::new())
            })
            .await;
        assert!(outcome.is_completed(), "{outcome:?}");
        let at = returned.lock().expect("lock").expect("handler returned");
        at.elapsed()
    }

    /// Guard: the group-commit window. Forty completions spread over 40 ms must share a few
    /// statements; without the window each found a free slot and went out alone (one statement
    /// per completion on this fast store).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn completions_arriving_close_together_share_commit_statements() {
        let (sup, leases) = claimed_many(40, Duration::from_millis(100)).await;
        let runs: Vec<_> = leases
            .into_iter()
            .enumerate()
            .map(|(i, lease)| {
                let sup = sup.clone();
                let work = Duration::from_millis(u64::try_from(i).unwrap_or(0));
                tokio::spawn(async move { commit_latency(&sup, lease, work).await })
            })
            .collect();
        for run in runs {
            run.await.expect("attempt task");
        }
        let m = sup.metrics().snapshot();
        assert_eq!(m.completions, 40);
        assert!(m.commit_statements <= 3, "40 completions within 40 ms took {} statements", m.commit_statements);
    }

    /// The window costs a worker handling one job at a time nothing: a completion that finds no
    /// statement sent within the window, or no other attempt running, is committed at once; one
    /// that arrives while another attempt still runs waits the window out.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_completion_waits_for_the_window_only_while_other_attempts_run() {
        let window = Duration::from_millis(400);
        let (sup, mut leases) = claimed_many(4, window).await;
        let alone = commit_latency(&sup, leases.remove(0), Duration::ZERO).await;
        assert!(alone < Duration::from_millis(200), "a lone completion waited {alone:?}");
        let next = commit_latency(&sup, leases.remove(0), Duration::ZERO).await;
        assert!(next < Duration::from_millis(200), "the next job of a one-at-a-time worker waited {next:?}");
        let long = {
            let (sup, lease) = (sup.clone(), leases.remove(0));
            tokio::spawn(async move { commit_latency(&sup, lease, Duration::from_millis(600)).await })
        };
        tokio::time::sleep(Duration::from_millis(10)).await;
        let beside = commit_latency(&sup, leases.remove(0), Duration::ZERO).await;
        assert!(beside >= Duration::from_millis(300), "a completion beside a running attempt waited only {beside:?}");
        long.await.expect("long attempt");
        assert_eq!(sup.metrics().snapshot().commit_statements, 4);
    }

    #[tokio::test]
    async fn a_panicking_handler_leaves_the_registry() {
        let (sup, lease) = setup().await;
        let s = sup.clone();
        let joined = tokio::spawn(async move {
            s.run::<_, _, ()>(lease, Vec::new(), None, |_ctx| async move {
                tokio::task::yield_now().await;
                panic!("handler bug")
            })
            .await
        })
        .await;
        assert!(joined.is_err_and(|e| e.is_panic()));
        assert_eq!(sup.in_flight(), 0, "a panicked attempt must not be renewed forever");
        assert_eq!(sup.leases_held(), 0, "a panicked attempt must not be renewed forever");
    }

    #[tokio::test]
    async fn a_dropped_attempt_leaves_the_registry() {
        let (sup, lease) = setup().await;
        let run = sup.run(lease, Vec::new(), None, |_ctx| std::future::pending::<Result<(), JobError>>());
        assert!(tokio::time::timeout(Duration::from_millis(50), run).await.is_err());
        assert_eq!(sup.in_flight(), 0, "a dropped attempt must not be renewed forever");
        assert_eq!(sup.leases_held(), 0, "a dropped attempt must not be renewed forever");
    }

    #[tokio::test]
    async fn the_deadline_counts_from_the_claim() {
        let (sup, lease) = setup().await;
        let Some(long_ago) = std::time::Instant::now().checked_sub(Duration::from_secs(10)) else { return };
        let started = std::time::Instant::now();
        let outcome = sup
            .run_claimed_at(lease, long_ago, Vec::new(), None, |_ctx| async move {
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok(Vec::new())
            })
            .await;
        assert!(matches!(outcome, Outcome::LeaseLost { reason: LossReason::Unconfirmed }), "{outcome:?}");
        assert!(started.elapsed() < Duration::from_secs(1));
    }
}
