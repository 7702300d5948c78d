//! Settling at the broker: what to tell it about a delivery ([`Tell`]), the calls that tell it,
//! and acknowledgements sent in batches ([`ack_loop`]).

use std::sync::Arc;
use std::time::Duration;

use fence::{Counter, Metrics};
use tokio::sync::{OwnedSemaphorePermit, mpsc};

use super::Shared;
use super::backoff::Backoff;
use crate::disposition::Disposition;
use crate::handler::Handler;
use crate::source::{DeadLettered, Source};

/// An acknowledgement waiting for its batch, with the unsettled place it frees once sent.
pub(super) type PendingAck<D> = (D, Option<OwnedSemaphorePermit>);

/// What to tell the broker about one delivery.
#[derive(Debug)]
pub(super) enum Tell {
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

impl<S: Source, H: Handler> Shared<S, H> {
    /// Settles in a task of its own, so the caller does not wait on the broker. The task holds
    /// the delivery's unsettled place, so these tasks are bounded too.
    pub(super) fn settle_later(
        self: &Arc<Self>,
        delivery: S::Delivery,
        tell: Tell,
        unsettled: Option<OwnedSemaphorePermit>,
    ) {
        let shared = Arc::clone(self);
        self.tasks.spawn(async move { shared.settle(delivery, tell, unsettled).await });
    }

    /// Tells the broker; the unsettled place frees once it is told (for an acknowledgement: once
    /// its batch was sent). A full ack queue is waited on: an acknowledgement is never dropped.
    pub(super) async fn settle(&self, delivery: S::Delivery, tell: Tell, unsettled: Option<OwnedSemaphorePermit>) {
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
            // Counted by the move that completes it: a failed move, or a repeat of a completed
            // one that only removed the delivery, is no dead letter.
            Tell::Fence(Disposition::DeadLetter(reason)) => {
                self.source.dead_letter_once(delivery, reason).await.map(|moved| count_move(metrics, moved))
            }
            Tell::Fence(Disposition::Hold(ttl)) => self.source.hold(delivery, *ttl).await,
            Tell::Fence(Disposition::Abandon) => self.source.abandon(delivery).await,
            Tell::Fence(Disposition::Leave) => Ok(()),
            Tell::Malformed(reason) => {
                self.source.dead_letter_once(delivery, reason).await.map(|moved| count_move(metrics, moved))
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

/// `dead_letters` counts the messages moved to a dead-letter destination, once each.
fn count_move(metrics: &Metrics, moved: DeadLettered) {
    if moved == DeadLettered::Moved {
        metrics.incr(Counter::DeadLetters);
    }
}

/// Sends acknowledgements in batches of up to `max`, waiting up to `linger` to fill one. Each
/// delivery's unsettled place frees once its batch was sent (or given up on).
pub(super) async fn ack_loop<S: Source>(
    source: Arc<S>,
    mut rx: mpsc::Receiver<PendingAck<S::Delivery>>,
    max: usize,
    linger: Duration,
    metrics: Arc<Metrics>,
) {
    while let Some(first) = rx.recv().await {
        let mut batch = Vec::with_capacity(rx.len().saturating_add(1).min(max.max(1)));
        batch.push(first);
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
