//! The guarded future: a handler is never polled once its lease is lost or its deadline has passed.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};
use tokio_util::sync::WaitForCancellationFutureOwned;

use super::outcome::LossReason;
use super::registry::SlotState;

pin_project_lite::pin_project! {
    /// Wraps a handler so that it is never polled once its lease is lost or its deadline has
    /// passed. The cancellation and the deadline's timer are kept in place, not boxed: two
    /// allocations fewer per attempt (issue #33). The handler's future stays boxed, so that the
    /// attempt's own future does not grow by the handler's size.
    pub(super) struct Guarded<F> {
        inner: Pin<Box<F>>,
        state: Arc<SlotState>,
        #[pin]
        cancelled: WaitForCancellationFutureOwned,
        #[pin]
        sleep: Sleep,
        armed: u64,
        base: Instant,
        enforce: bool,
    }
}

impl<F: Future> Guarded<F> {
    pub(super) fn new(inner: F, state: Arc<SlotState>, base: Instant, enforce: bool) -> Self {
        let armed = state.deadline.load(Ordering::Acquire);
        Self {
            inner: Box::pin(inner),
            cancelled: state.token.clone().cancelled_owned(),
            sleep: tokio::time::sleep_until(base + Duration::from_nanos(armed)),
            state,
            armed,
            base,
            enforce,
        }
    }
}

impl<F: Future> Future for Guarded<F> {
    type Output = std::result::Result<F::Output, LossReason>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        // With cancel-on-loss switched off (tests only) a lost lease is ignored, but shutdown still stops.
        let enforce = *this.enforce;
        let watch = enforce || (this.state.reason() == LossReason::Shutdown && this.state.token.is_cancelled());
        if watch && this.cancelled.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Err(this.state.reason()));
        }
        // A result its own transaction committed has nothing left to fence: no deadline.
        if enforce && !this.state.committed.load(Ordering::Acquire) {
            loop {
                let deadline = this.state.deadline.load(Ordering::Acquire);
                if Instant::now() >= *this.base + Duration::from_nanos(deadline) {
                    this.state.lose(LossReason::Unconfirmed);
                    return Poll::Ready(Err(this.state.reason()));
                }
                if deadline != *this.armed {
                    *this.armed = deadline;
                    this.sleep.as_mut().reset(*this.base + Duration::from_nanos(deadline));
                }
                if this.sleep.as_mut().poll(cx).is_pending() {
                    break;
                }
            }
        }
        this.inner.as_mut().poll(cx).map(Ok)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue #33, the consumer's CPU per job: the guard boxed its cancellation and its deadline
    /// timer, two allocations per attempt on top of the handler's. Both are now fields pinned in
    /// place, so the guard holds them whole; with the boxes back it holds two pointers and this
    /// fails.
    #[tokio::test]
    async fn latency_per_job_task_the_guard_keeps_its_timer_and_cancellation_in_place() {
        let state = Arc::new(SlotState {
            token: tokio_util::sync::CancellationToken::new(),
            deadline: std::sync::atomic::AtomicU64::new(60_000_000_000),
            loss: std::sync::Mutex::new(None),
            settling: std::sync::atomic::AtomicBool::new(false),
            own_commit: std::sync::atomic::AtomicBool::new(false),
            committed: std::sync::atomic::AtomicBool::new(false),
            #[cfg(feature = "metrics")]
            lost_at: std::sync::OnceLock::new(),
            span: std::sync::Mutex::new(None),
        });
        let guarded = Guarded::new(async {}, state, Instant::now(), true);
        let in_place = size_of::<Sleep>() + size_of::<WaitForCancellationFutureOwned>();
        assert!(size_of_val(&guarded) >= in_place, "guard {} bytes, its two parts {in_place}", size_of_val(&guarded));
        // It still runs the handler to its end while the lease holds.
        assert_eq!(guarded.await, Ok(()));
    }
}
