//! What an idle table-queue consumer does between claims that found nothing: it waits for a
//! wake-up ([`fence::Wakeups`]), a job announced as due, or its poll, whichever comes first.
//! The receive loops of one consumer share one [`Idle`], so an idle consumer polls once per
//! interval however many receive loops it runs.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use fence::{Wake, Wakeups};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Added to a due time read from the database, so that the timer does not fire a moment
/// before the job is due on the database clock (its claim would find nothing).
const DUE_MARGIN: Duration = Duration::from_millis(2);

/// The idle state of one table-queue consumer (shared by its receive loops).
pub(super) struct Idle {
    wakeups: Wakeups,
    /// The fallback poll interval.
    poll: Duration,
    /// When the next poll is due: one claim per interval for all the receive loops.
    next_poll: Mutex<Instant>,
    /// Ask the store for the next due job before the next claim (at the start, after a due
    /// timer fired, after the listener reconnected).
    sync: AtomicBool,
}

impl Idle {
    pub(super) fn new(wakeups: Wakeups, poll: Duration) -> Self {
        Self { wakeups, poll, next_poll: Mutex::new(Instant::now() + poll), sync: AtomicBool::new(true) }
    }

    /// Whether the next due job should be asked for now (and clears the flag).
    pub(super) fn take_sync(&self) -> bool {
        self.sync.swap(false, Ordering::AcqRel)
    }

    /// `next_due` failed: ask again after the next claim.
    pub(super) fn ask_again(&self) {
        self.sync.store(true, Ordering::Release);
    }

    /// The answer of `next_due`: the wait ends when that job is due.
    pub(super) fn due_in(&self, after: Duration) {
        self.wakeups.due_in(after + DUE_MARGIN);
    }

    /// A claim came back full: another receive loop may claim too.
    pub(super) fn pass_on(&self) {
        self.wakeups.pass_on();
    }

    /// A claim found nothing: that was this interval's poll.
    pub(super) fn polled(&self) {
        *self.next_poll.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now() + self.poll;
    }

    /// Waits until it is worth claiming again, or the consumer stops.
    pub(super) async fn wait(&self, shutdown: &CancellationToken) {
        loop {
            let deadline = *self.next_poll.lock().unwrap_or_else(|e| e.into_inner());
            let wake = tokio::select! {
                () = shutdown.cancelled() => return,
                w = self.wakeups.wait(deadline) => w,
            };
            match wake {
                Wake::Notified => return,
                Wake::Due | Wake::Resync => {
                    self.sync.store(true, Ordering::Release);
                    return;
                }
                _ => {
                    // The poll: the first loop past the deadline claims, the others wait on.
                    let mut next = self.next_poll.lock().unwrap_or_else(|e| e.into_inner());
                    let now = Instant::now();
                    if now >= *next {
                        *next = now + self.poll;
                        return;
                    }
                }
            }
        }
    }
}
