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
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::Owner;
use crate::group::Grouper;
use crate::job::{IntoJobResult, JobError};
use crate::lease::Lease;
#[cfg(feature = "metrics")]
use crate::metrics::LossKind;
use crate::metrics::{Counter, Distribution, Metrics};
use crate::store::FenceStore;
use hook_runner::{HookRunner, LiveCheck};

mod activity;
mod commit;
mod config;
mod context;
mod guarded;
mod heartbeat;
mod hook_runner;
mod outcome;
mod registry;

use commit::{COMMIT_QUEUE, MAX_COMMIT_BATCH, commit_loop, verify_loop};
pub use config::{DEFAULT_COMMIT_WINDOW, SupervisorConfig};
pub use context::JobContext;
use guarded::Guarded;
use heartbeat::heartbeat_loop;
pub use outcome::{LeaseHook, LossReason, Outcome};
use registry::{Inner, Registered, Slot, SlotState};

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
            activity: Arc::default(),
            activity_task: Mutex::new(None),
        });
        let every = inner.config.activity_interval;
        let task = tokio::spawn(activity::activity_loop(
            Arc::clone(&inner.store),
            Arc::clone(&inner.activity),
            inner.stop.clone(),
            every,
        ));
        if let Ok(mut slot) = inner.activity_task.lock() {
            *slot = Some(task);
        }
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
        tokio::spawn(heartbeat_loop(Arc::downgrade(&inner), inner.stop.clone(), interval));
        Self { inner }
    }

    /// Adds a broker-side hook, called after every heartbeat in a task of its own (see
    /// [`LeaseHook`]: each call bounded by [`SupervisorConfig::hook_timeout`], only the newest
    /// lease per job, never a lease past its deadline).
    pub fn add_hook(&self, hook: Arc<dyn LeaseHook>) {
        let inner = &self.inner;
        let registry = Arc::downgrade(inner);
        let live: LiveCheck = Arc::new(move |leases: &[Lease], spans: bool| match registry.upgrade() {
            Some(inner) => inner.live(leases, spans),
            None => vec![None; leases.len()],
        });
        if let Ok(mut hooks) = inner.hooks.write() {
            let runner = HookRunner::spawn(
                &inner.runtime,
                hook,
                hooks.len(),
                inner.config.get_hook_timeout(),
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
    pub fn run_claimed_at<F, Fut, R>(
        &self,
        lease: Lease,
        claimed_at: std::time::Instant,
        payload: Vec<u8>,
        progress: Option<Vec<u8>>,
        handler: F,
    ) -> impl Future<Output = Outcome>
    where
        F: FnOnce(JobContext) -> Fut,
        Fut: Future<Output = std::result::Result<R, JobError>>,
        R: IntoJobResult,
    {
        use futures::FutureExt as _;
        // Nothing happens until the first poll, as with an `async fn`; unlike one, the future
        // does not keep the arguments beside the attempt they move into (`Flatten` holds one or
        // the other), which keeps every consumer's per-job task small.
        futures::future::lazy(move |_| {
            // OpenTelemetry's messaging conventions where they apply (a "process" span on the
            // destination); `messaging.system` is filled in by the consumer runtime, which knows
            // the source. The project's own fields stay (`key` is the job key, not a broker
            // message id).
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
            #[cfg(feature = "otel")]
            crate::otel::attempt_started(&span, &lease);
            let attempt =
                self.run_inner(lease, Instant::from_std(claimed_at), payload, progress, span.clone(), handler);
            #[cfg(not(feature = "otel"))]
            let attempt = attempt.instrument(span);
            #[cfg(feature = "otel")]
            let attempt = attempt.instrument(span.clone()).map(move |outcome| {
                crate::otel::attempt_finished(&span, &outcome);
                outcome
            });
            attempt
        })
        .flatten()
    }

    async fn run_inner<F, Fut, R>(
        &self,
        lease: Lease,
        claimed_at: Instant,
        payload: Vec<u8>,
        progress: Option<Vec<u8>>,
        span: tracing::Span,
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
            committed: AtomicBool::new(false),
            #[cfg(feature = "metrics")]
            lost_at: std::sync::OnceLock::new(),
            // The parent of the debug-only heartbeat and broker-call spans: kept only when
            // those exist, and dropped when the attempt leaves the registry.
            span: Mutex::new(tracing::span_enabled!(tracing::Level::DEBUG).then_some(span)),
        });
        let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut map) = inner.inflight.lock() {
            map.insert(id, Slot { lease: lease.clone(), state: Arc::clone(&state) });
        }
        inner.running.fetch_add(1, Ordering::AcqRel);
        inner.metrics.in_flight(true);
        inner.activity.claimed(&lease.queue);
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
            // A handler that sent its own completion may have committed it before the loss was
            // found (a context call after its COMMIT is fenced; the row read after a heartbeat
            // can come too late): the row decides, so one commit is one ack (issue #30, item 5).
            Err(LossReason::Superseded | LossReason::Unconfirmed)
                if state.own_commit.load(Ordering::Acquire) && Box::pin(inner.own_commit_landed(&lease)).await =>
            {
                Outcome::Completed
            }
            Err(reason @ (LossReason::Superseded | LossReason::Unconfirmed)) => {
                registered.leave();
                inner.metrics.incr(Counter::LeaseLosses);
                Box::pin(inner.log_loss(&lease, reason)).await;
                Outcome::LeaseLost { reason }
            }
            result if state.own_commit.load(Ordering::Acquire) => {
                Box::pin(inner.after_own_commit(&lease, result, timeout)).await
            }
            result => inner.finish(&lease, result, timeout).await,
        };
        registered.leave();
        inner.activity.settled(&lease, &outcome);
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
        // The dashboard's last counts and events: written before this returns (a process that
        // exits next would otherwise drop them with its runtime), within the flush's own limits.
        let task = inner.activity_task.lock().ok().and_then(|mut t| t.take());
        if let Some(task) = task
            && tokio::time::timeout(activity::FINAL_FLUSH_WAIT, task).await.is_err()
        {
            tracing::warn!("the dashboard's last activity flush did not end in time");
        }
    }
}

#[cfg(all(test, feature = "sqlite"))]
mod edges;

#[cfg(all(test, feature = "sqlite"))]
mod tests {
    use super::*;
    use crate::{Claim, JobKey, LeaseDuration, QueueName, SqliteFence};

    /// A supervisor and the lease of one claimed job, on a fresh in-memory store (3 s leases).
    pub(super) async fn setup() -> (Supervisor, Lease) {
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
