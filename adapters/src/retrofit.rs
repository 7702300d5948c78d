//! The retrofit entry point: the runtime's step (claim → supervise → commit) applied to one
//! delivery inside a consumer loop you already own. You keep receiving and acknowledging; the
//! fence tells you what to do with each delivery.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fence::{
    Claim, Counter, Distribution, FenceError, FenceStore, IntoJobResult, JobContext, JobError, JobKey, Lease, Metrics,
    Outcome, Owner, QueueName, Supervisor, SupervisorConfig,
};
use tokio::time::Instant;

use crate::caught::run_caught;
use crate::disposition::Disposition;
use crate::source::SourceError;

/// How long a retrofit waits for the store's schema check (the consumer runtime's bound too).
const SCHEMA_CHECK_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a "schema too old" verdict stands before a retrofit asks again: a worker started
/// before the migration ran picks the new schema up without a restart, and a loop that keeps
/// calling costs at most one check per interval, not one per delivery.
const SCHEMA_RECHECK: Duration = Duration::from_secs(5);

/// What happened to one delivery, and what to tell your broker: the one answer of
/// [`Retrofit::process`], [`SqsRetrofit::process`](crate::sqs::SqsRetrofit::process) and
/// [`ListRetrofit::process`](crate::redis::ListRetrofit::process).
///
/// [`should_ack`](Self::should_ack) says whether the delivery is done with, [`reason`](Self::reason)
/// says why in words, [`disposition`](Self::disposition) what the broker is told, and
/// [`detail`](Self::detail) what the fence saw.
///
/// ```no_run
/// # async fn demo(fence: brokerfence::Retrofit, key: brokerfence::JobKey) {
/// use brokerfence::Reason;
/// let done = fence.process(&key, b"body".to_vec(), |_ctx| async move { Ok(()) }).await;
/// match done.reason() {
///     Reason::Committed | Reason::Duplicate => assert!(done.should_ack()),
///     other => println!("{key}: {other}, so {:?}", done.disposition),
/// }
/// # }
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub struct Processed {
    /// What to do at the broker (for SQS: what was done). The redis list retrofit says, when
    /// the attempt ended without a verdict of its own, what the database says of the job now
    /// (see [`ListRetrofit::process`](crate::redis::ListRetrofit::process)).
    pub disposition: Disposition,
    /// What the fence saw: the claim outcome when the job was not claimed, else the attempt's.
    pub detail: Detail,
    /// The broker call that applied the disposition failed (SQS: the delivery comes back and
    /// the fence settles it again); its cause is the broker's typed error (`SqsError`). `None`
    /// when the retrofit makes no broker call itself (the table, the redis list).
    pub broker_error: Option<SourceError>,
    /// The database confirmed that a newer epoch holds or finished the job (set only by
    /// [`ListRetrofit::process`](crate::redis::ListRetrofit::process) with [`Disposition::Leave`]):
    /// that holder has its own copy, so `requeue_popped` may drop this one. A `Leave` from
    /// anywhere else (a lease lost unconfirmed, a fenced commit) is put back.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) newer_epoch_confirmed: bool,
}

/// The fence's side of a [`Processed`].
#[derive(Debug)]
#[non_exhaustive]
pub enum Detail {
    /// The job was not claimed (busy, done, dead, backing off).
    NotClaimed(Claim),
    /// The attempt ran; its outcome.
    Ran(Outcome),
    /// The claim itself failed (database unreachable): leave the delivery to the broker. Also
    /// the fence's refusal to claim on a schema older than this build needs
    /// ([`FenceError::SchemaTooOld`], see [`Processed::refused`]).
    ClaimFailed(FenceError),
    /// The delivery cannot be turned into a job (no usable job key, an undecodable item, an SQS
    /// message without its id or receipt handle), with the reason; nothing was claimed.
    Malformed(String),
}

/// Why a delivery ended as it did, in words ([`Processed::reason`]); its `Display` gives the
/// words.
///
/// ```
/// use brokerfence::Reason;
/// assert_eq!(Reason::Committed.to_string(), "committed");
/// assert_eq!(Reason::Retried.to_string(), "failed and retried");
/// assert_eq!(Reason::NotMigrated.to_string(), "not migrated");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reason {
    /// The handler's result is committed.
    Committed,
    /// The job was already completed: the delivery duplicates it.
    Duplicate,
    /// Another worker holds a live lease on the job.
    Busy,
    /// The attempt failed and the job is retried after its backoff (or the delivery came while
    /// an earlier failure's backoff runs).
    Retried,
    /// The job is dead: its last attempt failed for good, or it was buried before.
    Dead,
    /// The lease was lost while the handler ran (superseded, or its renewal unconfirmed).
    LeaseLost,
    /// The commit was fenced: a newer epoch holds or finished the job.
    Fenced,
    /// The attempt was released (shutdown, or its caller stopped waiting); no attempt is spent.
    Released,
    /// The store failed: the claim was not made, or the commit's fate is unknown.
    StoreFailed,
    /// The fence refused to claim: the schema is older than this build needs.
    NotMigrated,
    /// The delivery cannot be turned into a job.
    Malformed,
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Reason::Committed => "committed",
            Reason::Duplicate => "duplicate",
            Reason::Busy => "busy",
            Reason::Retried => "failed and retried",
            Reason::Dead => "dead",
            Reason::LeaseLost => "lease lost",
            Reason::Fenced => "fenced",
            Reason::Released => "released",
            Reason::StoreFailed => "store failed",
            Reason::NotMigrated => "not migrated",
            Reason::Malformed => "malformed",
        })
    }
}

impl Detail {
    /// The schema check's refusal, when the fence refused to claim because the schema is older
    /// than this build needs.
    fn refused(&self) -> Option<&FenceError> {
        match self {
            Detail::ClaimFailed(e @ FenceError::SchemaTooOld { .. }) => Some(e),
            _ => None,
        }
    }

    /// The reason in words.
    fn reason(&self) -> Reason {
        match self {
            Detail::NotClaimed(claim) => match claim {
                Claim::Done { .. } => Reason::Duplicate,
                Claim::Busy { .. } => Reason::Busy,
                Claim::Backoff { .. } => Reason::Retried,
                Claim::Dead { .. } => Reason::Dead,
                // `Claimed` is never "not claimed".
                _ => Reason::StoreFailed,
            },
            Detail::Ran(outcome) => match outcome {
                Outcome::Completed => Reason::Committed,
                Outcome::Failed { .. } => Reason::Retried,
                Outcome::Dead { .. } => Reason::Dead,
                Outcome::LeaseLost { .. } => Reason::LeaseLost,
                Outcome::Fenced(_) => Reason::Fenced,
                Outcome::Released => Reason::Released,
                // `StoreError`: the commit's fate is unknown.
                _ => Reason::StoreFailed,
            },
            Detail::ClaimFailed(FenceError::SchemaTooOld { .. }) => Reason::NotMigrated,
            Detail::ClaimFailed(_) => Reason::StoreFailed,
            Detail::Malformed(_) => Reason::Malformed,
        }
    }
}

impl Processed {
    /// A result for a delivery your loop settles itself, e.g. one it popped but never ran,
    /// handed to [`ListRetrofit::requeue_popped`](crate::redis::ListRetrofit::requeue_popped)
    /// to be put back.
    ///
    /// ```
    /// use brokerfence::{Detail, Disposition, Outcome, Processed, Reason};
    /// let released = Processed::new(Disposition::Abandon, Detail::Ran(Outcome::Released));
    /// assert_eq!(released.reason(), Reason::Released);
    /// assert!(!released.should_ack());
    /// ```
    pub fn new(disposition: Disposition, detail: Detail) -> Self {
        Self { disposition, detail, broker_error: None, newer_epoch_confirmed: false }
    }

    /// True when the delivery should be acknowledged (deleted) now: its result is committed, or
    /// it duplicates a completed job (for SQS: the message is deleted, unless
    /// [`broker_error`](Self::broker_error) says the delete failed).
    pub fn should_ack(&self) -> bool {
        self.disposition == Disposition::Ack
    }

    /// Why the delivery ended as it did; its `Display` says it in words ("committed",
    /// "duplicate", "failed and retried", …).
    pub fn reason(&self) -> Reason {
        self.detail.reason()
    }

    /// `Some` when the fence refused to run the delivery because the schema is older than this
    /// build needs ([`Reason::NotMigrated`]): nothing was claimed, the disposition is
    /// [`Disposition::Abandon`] (give the delivery back; SQS: made visible again at once), and
    /// your loop should stop with this error, as [`Consumer::run`](crate::Consumer::run) does
    /// (its message says to run migrations).
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::Retrofit, key: brokerfence::JobKey) -> Result<(), Box<dyn std::error::Error>> {
    /// let done = fence.process(&key, b"body".to_vec(), |_ctx| async move { Ok(()) }).await;
    /// if let Some(e) = done.refused() {
    ///     return Err(e.to_string().into()); // give the delivery back first
    /// }
    /// # Ok(()) }
    /// ```
    pub fn refused(&self) -> Option<&FenceError> {
        self.detail.refused()
    }
}

/// What a retrofit knows of its store's schema (checked on first use).
#[derive(Debug, Clone, Copy)]
enum SchemaVerdict {
    /// Not asked yet, or the store could not answer.
    Unknown,
    /// At least the version this build needs (or the store cannot tell: a wrapper that does not
    /// delegate the check).
    Current,
    /// Too old, as found at that instant.
    TooOld { found: i64, required: i64, at: Instant },
}

/// The fence as middleware: one per worker process (it owns the heartbeat task).
///
/// ```no_run
/// # async fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>) -> brokerfence::Result<()> {
/// use brokerfence::Retrofit;
/// use brokerfence::{JobKey, LeaseDuration, QueueName, SupervisorConfig};
/// let fence = Retrofit::new(store, QueueName::new("orders")?, SupervisorConfig::new(LeaseDuration::from_secs(30)?));
/// // inside your existing loop, for each message you popped:
/// let done = fence.process(&JobKey::new("msg-123")?, b"body".to_vec(), |ctx| async move {
///     Ok(format!("handled epoch {}", ctx.epoch()))
/// }).await;
/// if done.should_ack() { /* delete / XACK / LREM the message */ }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Retrofit {
    supervisor: Supervisor,
    queue: QueueName,
    schema: Arc<Mutex<SchemaVerdict>>,
}

impl Retrofit {
    /// Middleware for `queue` with a fresh owner id. Must be created inside a tokio runtime.
    pub fn new(store: Arc<dyn FenceStore>, queue: QueueName, config: SupervisorConfig) -> Self {
        Self::with_owner(store, queue, Owner::unique("worker"), config)
    }

    /// Middleware with the given owner id.
    pub fn with_owner(store: Arc<dyn FenceStore>, queue: QueueName, owner: Owner, config: SupervisorConfig) -> Self {
        let metrics = Arc::new(Metrics::labelled(queue.as_str(), "middleware"));
        Self {
            supervisor: Supervisor::with_metrics(store, owner, config, metrics),
            queue,
            schema: Arc::new(Mutex::new(SchemaVerdict::Unknown)),
        }
    }

    /// Checks that the store's schema is at least at the migration version this build needs
    /// ([`FenceStore::check_schema`]), as [`Consumer::run`](crate::Consumer::run) does before it
    /// receives anything: call it before your loop. A schema that is too old (or missing) is
    /// [`FenceError::SchemaTooOld`], whose message says to run migrations; a store that does not
    /// answer within 5 s is [`FenceError::StatementAborted`]. A pass is remembered, so
    /// [`process`](Self::process) does not ask again.
    ///
    /// [`process`](Self::process) runs the same check on first use whether or not you call this:
    /// on a schema too old it claims nothing and answers [`Processed::refused`].
    ///
    /// ```no_run
    /// # async fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>) -> Result<(), Box<dyn std::error::Error>> {
    /// use brokerfence::{LeaseDuration, QueueName, Retrofit, SupervisorConfig};
    /// // Migrations are a deploy step (`brokerfence migrate`, or `store.migrate()`); a worker checks:
    /// let fence = Retrofit::new(store, QueueName::new("orders")?, SupervisorConfig::new(LeaseDuration::from_secs(30)?));
    /// fence.check_schema().await?; // "… run migrations …" on a schema this build cannot use
    /// # Ok(()) }
    /// ```
    pub async fn check_schema(&self) -> Result<(), FenceError> {
        match self.ask_schema().await {
            Ok(()) => Ok(()),
            Err(Some(e)) => Err(e),
            Err(None) => Err(FenceError::StatementAborted(format!(
                "the schema check did not answer within {SCHEMA_CHECK_TIMEOUT:?}"
            ))),
        }
    }

    /// Asks the store (bounded) and records the verdict. `Err(None)`: no answer in time.
    async fn ask_schema(&self) -> Result<(), Option<FenceError>> {
        let store = self.supervisor.store();
        let answer = tokio::time::timeout(SCHEMA_CHECK_TIMEOUT, store.check_schema()).await;
        let verdict = match &answer {
            Ok(Ok(())) | Ok(Err(FenceError::Unsupported(_))) => SchemaVerdict::Current,
            Ok(Err(FenceError::SchemaTooOld { found, required })) => {
                SchemaVerdict::TooOld { found: *found, required: *required, at: Instant::now() }
            }
            Ok(Err(_)) | Err(_) => SchemaVerdict::Unknown,
        };
        if let Ok(mut v) = self.schema.lock() {
            *v = verdict;
        }
        match answer {
            Ok(Ok(())) | Ok(Err(FenceError::Unsupported(_))) => Ok(()),
            Ok(Err(e)) => Err(Some(e)),
            Err(_) => Err(None),
        }
    }

    /// The schema check of [`process`](Self::process): `Some` refusal when the schema is too old
    /// (asked on first use, again at most every [`SCHEMA_RECHECK`] while it is). A store that
    /// cannot answer is no reason to refuse (the claim that follows says what is wrong), as for
    /// the consumer runtime.
    async fn schema_refusal(&self) -> Option<FenceError> {
        let known = self.schema.lock().map(|v| *v).unwrap_or(SchemaVerdict::Unknown);
        match known {
            SchemaVerdict::Current => return None,
            SchemaVerdict::TooOld { found, required, at } if at.elapsed() < SCHEMA_RECHECK => {
                return Some(FenceError::SchemaTooOld { found, required });
            }
            _ => {}
        }
        match self.ask_schema().await {
            Ok(()) => None,
            Err(Some(e @ FenceError::SchemaTooOld { .. })) => {
                tracing::error!(queue = %self.queue, error = %e, "schema too old: the retrofit claims nothing");
                Some(e)
            }
            Err(Some(e)) => {
                tracing::warn!(queue = %self.queue, error = %e, "could not check the schema; claiming anyway");
                None
            }
            Err(None) => {
                tracing::warn!(queue = %self.queue, timeout = ?SCHEMA_CHECK_TIMEOUT, "schema check timed out; claiming anyway");
                None
            }
        }
    }

    /// The supervisor (add a [`LeaseHook`](fence::LeaseHook) to extend your broker's visibility).
    pub fn supervisor(&self) -> &Supervisor {
        &self.supervisor
    }

    /// The queue.
    pub fn queue(&self) -> &QueueName {
        &self.queue
    }

    /// The counters.
    pub fn metrics(&self) -> &Arc<Metrics> {
        self.supervisor.metrics()
    }

    /// Claims `key`, runs `handler` under the lease, commits through the fence, and says what to
    /// tell the broker.
    ///
    /// On first use it checks the schema ([`check_schema`](Self::check_schema)): on a schema
    /// older than this build needs it claims nothing and answers [`Disposition::Abandon`] with
    /// [`Processed::refused`] set (its message says to run migrations); stop your loop then.
    ///
    /// A handler that panics is a failed attempt: the panic's message is the job's `last_error`
    /// (`"handler panicked: …"`) and the job is retried by its policy; the panic does not reach
    /// your loop.
    ///
    /// Cancellation-safe: when the caller drops the returned future (a `select!` on shutdown, a
    /// timeout), nothing stays claimed. A claim the database already made is released (the job
    /// is pending again, no attempt spent) whether it was still on its way back or its handler
    /// was running; the handler is dropped with the future. The delivery stays with the caller,
    /// who still has to give it back to the broker (or let it come back).
    ///
    /// The handler is awaited in place, so it may be any `FnOnce`: a closure that moves loop
    /// state in, or borrows locals (its future need not be `Send` or `'static`). It returns its
    /// result ([`IntoJobResult`]: bytes, a `String`, `()`, …) or a [`JobError`]; `?` turns any
    /// error into a retried one, [`.fatal()`](fence::JobResultExt::fatal) into a final one.
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::Retrofit, deliveries: Vec<(String, Vec<u8>)>) -> brokerfence::Result<()> {
    /// use brokerfence::{JobKey, JobResultExt};
    /// let mut handled = Vec::new(); // loop state
    /// for (id, body) in deliveries {
    ///     let handled = &mut handled; // the handler borrows it
    ///     let done = fence.process(&JobKey::new(id.as_str())?, body, |ctx| async move {
    ///         let text = std::str::from_utf8(ctx.payload()).fatal()?; // not UTF-8: dead at once
    ///         std::fs::write(format!("/tmp/{id}"), text)?; // an io::Error: retried
    ///         handled.push(id); // `id` moved in: a FnOnce
    ///         Ok("written")
    ///     }).await;
    ///     if done.should_ack() { /* delete the delivery */ }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn process<F, Fut, R>(&self, key: &JobKey, payload: Vec<u8>, handler: F) -> Processed
    where
        F: FnOnce(JobContext) -> Fut,
        Fut: Future<Output = Result<R, JobError>>,
        R: IntoJobResult,
    {
        if let Some(refusal) = self.schema_refusal().await {
            return Processed::new(Disposition::Abandon, Detail::ClaimFailed(refusal));
        }
        let claim_sent = std::time::Instant::now();
        let claim = match self.claim_detached(key).await {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(%key, error = %e, "claim failed; leaving the delivery to the broker");
                return Processed::new(Disposition::Leave, Detail::ClaimFailed(e));
            }
        };
        match claim {
            Claim::Claimed(lease) => {
                self.metrics().incr(Counter::Claims);
                // Dropped with this future before the attempt is over: release the lease.
                let mut guard = ReleaseOnDrop {
                    store: Arc::clone(self.supervisor.store()),
                    metrics: Arc::clone(self.metrics()),
                    lease: Some(lease.clone()),
                };
                let handler = move |ctx: JobContext| run_caught(handler, ctx);
                let outcome = self.supervisor.run_claimed_at(lease, claim_sent, payload, None, handler).await;
                guard.lease = None;
                Processed::new(Disposition::after_run(&outcome), Detail::Ran(outcome))
            }
            other => {
                if let Claim::Done { epoch } = other {
                    crate::otel::duplicate(&self.queue, key, epoch, None, &crate::otel::current_origin());
                }
                let disposition = Disposition::after_claim(&other).unwrap_or(Disposition::Leave);
                match disposition {
                    Disposition::Hold(_) => self.metrics().incr(Counter::Busy),
                    Disposition::Ack | Disposition::DeadLetter(_) => self.metrics().incr(Counter::Duplicates),
                    _ => {}
                }
                Processed::new(disposition, Detail::NotClaimed(other))
            }
        }
    }

    /// The claim, in a task of its own: if the caller stops waiting while the statement is on its
    /// way, the task still gets the answer and releases a lease nobody will run.
    async fn claim_detached(&self, key: &JobKey) -> Result<Claim, FenceError> {
        let store = Arc::clone(self.supervisor.store());
        let metrics = Arc::clone(self.metrics());
        let (queue, key, owner) = (self.queue.clone(), key.clone(), self.supervisor.owner().clone());
        let lease = self.supervisor.config().lease();
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let sent = std::time::Instant::now();
            let claim = store.claim(&queue, &key, &owner, lease).await;
            metrics.observe_duration(Distribution::ClaimDuration, sent.elapsed());
            metrics.observe(Distribution::ClaimStatementJobs, 1.0);
            if let Err(Ok(Claim::Claimed(lease))) = tx.send(claim) {
                release(&*store, &metrics, &lease, "claimed for a caller that stopped waiting").await;
            }
        });
        rx.await.unwrap_or_else(|_| Err(FenceError::Corrupt("the claim task ended without an answer".into())))
    }
}

/// Releases a lease whose attempt was dropped by its caller (see [`Retrofit::process`]).
struct ReleaseOnDrop {
    store: Arc<dyn FenceStore>,
    metrics: Arc<Metrics>,
    lease: Option<Lease>,
}

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        let Some(lease) = self.lease.take() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(key = %lease.key, "attempt dropped outside a runtime; its lease runs out on its own");
            return;
        };
        let (store, metrics) = (Arc::clone(&self.store), Arc::clone(&self.metrics));
        runtime.spawn(async move { release(&*store, &metrics, &lease, "attempt dropped by its caller").await });
    }
}

/// Gives the job back without spending an attempt; a lease already superseded or finished is
/// left alone (the compare-and-set refuses it).
async fn release(store: &dyn FenceStore, metrics: &Metrics, lease: &Lease, why: &'static str) {
    match store.release(lease).await {
        Ok(()) => {
            metrics.incr(Counter::Releases);
            tracing::info!(key = %lease.key, epoch = lease.epoch, "{why}: lease released");
        }
        Err(e) if e.is_fenced() => tracing::debug!(key = %lease.key, "{why}: lease already gone"),
        Err(e) => tracing::warn!(
            key = %lease.key,
            error = %e,
            "{why}: could not release the lease; the job is claimable again when it ends"
        ),
    }
}
