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

/// Wraps a handler so that it is never polled once its lease is lost or its deadline has passed.
pub(super) struct Guarded<F> {
    inner: Pin<Box<F>>,
    state: Arc<SlotState>,
    cancelled: Pin<Box<WaitForCancellationFutureOwned>>,
    sleep: Pin<Box<Sleep>>,
    armed: u64,
    base: Instant,
    enforce: bool,
}

impl<F: Future> Guarded<F> {
    pub(super) fn new(inner: F, state: Arc<SlotState>, base: Instant, enforce: bool) -> Self {
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
        // A result its own transaction committed has nothing left to fence: no deadline.
        if this.enforce && !this.state.committed.load(Ordering::Acquire) {
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
