//! The in-flight registry: one slot per attempt holding a lease, its cancellation and deadline.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::config::SupervisorConfig;
use super::hook_runner::HookRunner;
use super::outcome::LossReason;
use crate::Owner;
use crate::error::Result;
use crate::lease::Lease;
use crate::metrics::Metrics;
use crate::store::FenceStore;

/// A result waiting for the group commit, and where to send the verdict.
pub(super) type CommitRequest = (Lease, Vec<u8>, tokio::sync::oneshot::Sender<Result<()>>);

/// An attempt whose handler committed in its own transaction, and where to send whether its job
/// is completed under its lease.
pub(super) type VerifyRequest = (Lease, tokio::sync::oneshot::Sender<Result<bool>>);

pub(super) struct SlotState {
    pub(super) token: CancellationToken,
    /// Monotonic deadline, in nanoseconds after the supervisor's base instant.
    pub(super) deadline: AtomicU64,
    pub(super) loss: Mutex<Option<LossReason>>,
    /// The handler has returned; the attempt waits for the verdict on its commit, failure or
    /// release. Its lease is still renewed, but there is nothing left to cancel.
    pub(super) settling: AtomicBool,
    /// The handler sent its own fenced completion ([`JobContext::complete_in`]): once it returns,
    /// the job row, not the handler's answer, says whether the result committed.
    pub(super) own_commit: AtomicBool,
    /// The handler's own transaction committed this attempt's result (the job row says
    /// completed under this lease, read after a heartbeat found the lease gone): nothing is left
    /// to fence, so the handler runs on past the lease, uncancelled, and its return is
    /// acknowledged once (issue #30, item 5).
    pub(super) committed: AtomicBool,
    /// When the loss was found (`brokerfence_lease_loss_to_cancel_seconds`).
    #[cfg(feature = "metrics")]
    pub(super) lost_at: std::sync::OnceLock<Instant>,
    /// The attempt's span, kept only while debug spans are on (the parent of its heartbeats'
    /// and broker calls' spans, which exist at debug level only) and dropped when the attempt
    /// leaves the registry: a handle held here must not keep the attempt's span open (its end
    /// time is taken when the last handle drops) after the attempt ended, nor at all at info.
    pub(super) span: Mutex<Option<tracing::Span>>,
}

impl SlotState {
    /// The attempt's span when it is kept (debug spans on, attempt registered), else none.
    pub(super) fn attempt_span(&self) -> tracing::Span {
        self.span.lock().ok().and_then(|s| s.clone()).unwrap_or_else(tracing::Span::none)
    }

    pub(super) fn lose(&self, reason: LossReason) {
        #[cfg(feature = "metrics")]
        self.lost_at.get_or_init(Instant::now);
        if let Ok(mut loss) = self.loss.lock() {
            loss.get_or_insert(reason);
        }
        self.token.cancel();
    }

    pub(super) fn reason(&self) -> LossReason {
        self.loss.lock().ok().and_then(|l| *l).unwrap_or(LossReason::Superseded)
    }
}

pub(super) struct Slot {
    pub(super) lease: Lease,
    pub(super) state: Arc<SlotState>,
}

pub(super) struct Inner {
    pub(super) store: Arc<dyn FenceStore>,
    pub(super) owner: Owner,
    pub(super) config: SupervisorConfig,
    pub(super) metrics: Arc<Metrics>,
    pub(super) base: Instant,
    pub(super) next_id: AtomicU64,
    /// Every attempt holding a lease: running handlers and finished ones awaiting their verdict.
    pub(super) inflight: Mutex<HashMap<u64, Slot>>,
    /// Handlers running now (the registry minus the attempts awaiting their verdict).
    pub(super) running: AtomicUsize,
    pub(super) hooks: RwLock<Vec<HookRunner>>,
    /// Where hook tasks run.
    pub(super) runtime: tokio::runtime::Handle,
    pub(super) stop: CancellationToken,
    pub(super) draining: CancellationToken,
    pub(super) idle: tokio::sync::Notify,
    pub(super) committer: tokio::sync::mpsc::Sender<CommitRequest>,
    /// Asks, in groups, whether handlers that committed in their own transaction did commit.
    pub(super) verifier: tokio::sync::mpsc::Sender<VerifyRequest>,
    /// A renewal of the attempts awaiting their verdict is under way (one at a time).
    pub(super) renewing_settling: std::sync::atomic::AtomicBool,
    /// Counts and fence events for the dashboard, flushed by `activity_loop`.
    pub(super) activity: Arc<super::activity::Recorder>,
    /// The task of `activity_loop`, awaited by a graceful shutdown for its last flush.
    pub(super) activity_task: Mutex<Option<tokio::task::JoinHandle<()>>>,
}

/// Removes an attempt from the in-flight registry when dropped (or at [`leave`](Self::leave)),
/// and keeps the count of running handlers.
pub(super) struct Registered<'a> {
    pub(super) inner: &'a Inner,
    pub(super) id: Option<u64>,
    pub(super) state: Arc<SlotState>,
    pub(super) running: bool,
}

impl Registered<'_> {
    /// The handler has returned: the attempt stays registered (its lease renewed) but no longer
    /// counts as running, and nothing cancels it any more.
    pub(super) fn settle(&mut self) {
        self.state.settling.store(true, Ordering::Release);
        self.stop_running();
    }

    fn stop_running(&mut self) {
        if std::mem::take(&mut self.running) {
            self.inner.running.fetch_sub(1, Ordering::AcqRel);
            self.inner.metrics.in_flight(false);
        }
    }

    pub(super) fn leave(&mut self) {
        self.stop_running();
        if let Ok(mut span) = self.state.span.lock() {
            span.take();
        }
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
    pub(super) fn in_flight(&self) -> usize {
        self.running.load(Ordering::Acquire)
    }

    pub(super) fn leases_held(&self) -> usize {
        self.inflight.lock().map(|m| m.len()).unwrap_or(0)
    }

    /// For each lease, `Some` when a broker may still be told to extend it now (its attempt is registered, not
    /// cancelled, before its deadline): the attempt's span with `spans`, else `Span::none()`.
    pub(super) fn live(&self, leases: &[Lease], spans: bool) -> Vec<Option<tracing::Span>> {
        let now = self.nanos(Instant::now());
        let Ok(map) = self.inflight.lock() else { return vec![None; leases.len()] };
        let held: HashMap<(&str, &str, i64), &Arc<SlotState>> = map
            .values()
            .filter(|s| !s.state.token.is_cancelled() && s.state.deadline.load(Ordering::Acquire) > now)
            .map(|s| ((s.lease.queue.as_str(), s.lease.key.as_str(), s.lease.epoch), &s.state))
            .collect();
        leases
            .iter()
            .map(|l| {
                let state = held.get(&(l.queue.as_str(), l.key.as_str(), l.epoch))?;
                Some(if spans { state.attempt_span() } else { tracing::Span::none() })
            })
            .collect()
    }

    /// Logs a lost lease with both epochs: ours and, when the database answers quickly, the one
    /// that superseded it.
    pub(super) async fn log_loss(&self, lease: &Lease, reason: LossReason) {
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
    pub(super) fn expire_overdue(&self) {
        if !self.config.cancel_on_loss {
            return;
        }
        let now = self.nanos(Instant::now());
        if let Ok(map) = self.inflight.lock() {
            for slot in map.values() {
                // An attempt awaiting its verdict has no handler left to stop: its commit decides.
                if !slot.state.token.is_cancelled()
                    && !slot.state.settling.load(Ordering::Acquire)
                    && !slot.state.committed.load(Ordering::Acquire)
                    && slot.state.deadline.load(Ordering::Acquire) <= now
                {
                    tracing::warn!(key = %slot.lease.key, epoch = slot.lease.epoch, "lease unconfirmed past its deadline; cancelling");
                    slot.state.lose(LossReason::Unconfirmed);
                }
            }
        }
    }

    pub(super) fn nanos(&self, at: Instant) -> u64 {
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
}
