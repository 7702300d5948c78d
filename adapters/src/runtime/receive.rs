//! The receive loop: places for what is asked for, a receive that survives shutdown, and the
//! sorting of a received batch (dead-letter the malformed, start what the source claimed, queue
//! the rest for the group claim).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use fence::{Counter, Distribution};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use super::backoff::Backoff;
use super::settle::Tell;
use super::{Consumer, ReceiveContext, Shared};
use crate::disposition::Disposition;
use crate::handler::Handler;
use crate::source::{Incoming, Source, SourceError};

impl<S: Source> Consumer<S> {
    /// Runs [`receives`](Self::receives) receive loops over the same places; the first
    /// fatal source error stops them all and is returned.
    pub(super) async fn receive_loop<H: Handler>(
        &self,
        shared: &Arc<Shared<S, H>>,
        permits: &Budget,
        shutdown: &CancellationToken,
    ) -> Result<(), SourceError> {
        let (batch, receives) = self.receives();
        if receives == 1 {
            return self.receive_one(shared, permits, shutdown, batch).await;
        }
        let stop = shutdown.child_token();
        let loops = (0..receives).map(|_| async {
            let r = self.receive_one(shared, permits, &stop, batch).await;
            if r.is_err() {
                stop.cancel();
            }
            r
        });
        futures::future::join_all(loops).await.into_iter().find(Result::is_err).unwrap_or(Ok(()))
    }

    /// The batch one receive asks for at most, and how many receives run at once: one per
    /// batch's worth of places, up to the source's [`Source::receives_in_flight`].
    pub(super) fn receives(&self) -> (usize, usize) {
        let places = self.config.places();
        // More than the receive places can never be held: waiting for them would only add the
        // linger to every receive.
        let batch = self.config.batch.unwrap_or_else(|| self.source.default_batch()).clamp(1, places);
        (batch, places.div_ceil(batch).clamp(1, self.source.receives_in_flight().max(1)))
    }

    /// One receive loop: waits for a place, fills a batch, receives, dispatches.
    async fn receive_one<H: Handler>(
        &self,
        shared: &Arc<Shared<S, H>>,
        permits: &Budget,
        shutdown: &CancellationToken,
        batch: usize,
    ) -> Result<(), SourceError> {
        let ctx = ReceiveContext {
            owner: self.supervisor.owner().clone(),
            lease: self.config.supervisor.lease(),
            shutdown: shutdown.clone(),
        };
        let mut backoff = Backoff::default();
        loop {
            // While claims fail (database unreachable), slow down instead of piling up deliveries.
            let failures = shared.claim_failures.load(Ordering::Relaxed);
            if failures > 0 {
                let wait = Backoff::nth(failures.saturating_sub(1));
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    _ = tokio::time::sleep(wait) => {}
                }
            }
            // One receive place and one unsettled place per delivery asked for: wait for the
            // first, take what else is free.
            let first = tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                p = permits.acquire() => match p {
                    Some(p) => p,
                    None => return Ok(()),
                },
            };
            // Fill the batch: what is free now, then whatever frees up within a short linger, so
            // that one claim statement serves a full batch rather than one delivery at a time.
            let mut held = Vec::with_capacity(batch.min(1024));
            held.push(first);
            let fill_until = tokio::time::Instant::now() + BATCH_FILL_LINGER;
            while held.len() < batch {
                if let Some(p) = permits.try_acquire() {
                    held.push(p);
                    continue;
                }
                tokio::select! {
                    p = permits.acquire() => match p {
                        Some(p) => held.push(p),
                        None => break,
                    },
                    _ = tokio::time::sleep_until(fill_until) => break,
                }
            }
            let asked_at = std::time::Instant::now();
            // Cancellation-safe: at shutdown the receive is not dropped (a source may already
            // have claimed or popped what it is about to return); it finishes in a task of its
            // own, which gives back whatever it returns.
            let mut receive: Receive<S::Delivery> = {
                let (source, ctx, n) = (Arc::clone(&self.source), ctx.clone(), held.len());
                Box::pin(async move { source.receive(n, &ctx).await })
            };
            let received = tokio::select! {
                r = &mut receive => Some(r),
                _ = shutdown.cancelled() => None,
            };
            let Some(received) = received else {
                shared.give_back_receive(receive, held);
                return Ok(());
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
            // A source that returns more than asked still gets places for each (waiting for
            // them; at shutdown the rest is given back).
            while held.len() < incoming.len() {
                let more = tokio::select! {
                    p = permits.acquire() => p,
                    _ = shutdown.cancelled() => None,
                };
                match more {
                    Some(p) => held.push(p),
                    None => {
                        shared.give_back_receive(Box::pin(async move { Ok(incoming) }), held);
                        return Ok(());
                    }
                }
            }
            held.truncate(incoming.len());
            shared.dispatch(incoming, held, asked_at).await;
        }
    }
}

/// A receive, boxed so that shutdown can hand it to a task of its own instead of dropping it.
type Receive<D> = futures::future::BoxFuture<'static, Result<Vec<Incoming<D>>, SourceError>>;

/// The two budgets a delivery draws on.
pub(super) struct Budget {
    /// Receive places: held until the handler starts (prefetching) or returns.
    pub(super) places: Arc<Semaphore>,
    /// Unsettled places: held until the broker call that settles the delivery returned.
    pub(super) unsettled: Arc<Semaphore>,
}

impl Budget {
    /// Waits for one place of each kind (cancellation-safe: dropping it returns what it took).
    pub(super) async fn acquire(&self) -> Option<Places> {
        let unsettled = Arc::clone(&self.unsettled).acquire_owned().await.ok()?;
        let place = Arc::clone(&self.places).acquire_owned().await.ok()?;
        Some(Places { place, unsettled })
    }

    /// One place of each kind, if both are free now.
    pub(super) fn try_acquire(&self) -> Option<Places> {
        let unsettled = Arc::clone(&self.unsettled).try_acquire_owned().ok()?;
        let place = Arc::clone(&self.places).try_acquire_owned().ok()?;
        Some(Places { place, unsettled })
    }
}

/// What one received delivery holds.
pub(super) struct Places {
    /// Its receive place (a handler slot, or a prefetch place).
    pub(super) place: OwnedSemaphorePermit,
    /// Its unsettled place, returned once the broker was told.
    pub(super) unsettled: OwnedSemaphorePermit,
}

/// How long the receive loop waits for more free slots to fill a batch once it has one.
const BATCH_FILL_LINGER: Duration = Duration::from_millis(2);

/// A received delivery with the places it holds.
pub(super) type Held<D> = (D, Places);

impl<S: Source, H: Handler> Shared<S, H> {
    /// Sorts one received batch: malformed ones are dead-lettered, already-claimed ones start,
    /// the rest are claimed together in a task of their own.
    async fn dispatch(
        self: &Arc<Self>,
        incoming: Vec<Incoming<S::Delivery>>,
        held: Vec<Places>,
        asked_at: std::time::Instant,
    ) {
        let mut unclaimed = Vec::new();
        // Jobs the source claimed in its receive (the table queue's `claim_next`): that receive
        // was their claim statement.
        let claimed = incoming.iter().filter(|i| matches!(i, Incoming::Claimed { .. })).count();
        if claimed > 0 {
            let metrics = self.supervisor.metrics();
            metrics.observe_duration(Distribution::ClaimDuration, asked_at.elapsed());
            metrics.observe(Distribution::ClaimStatementJobs, claimed as f64);
        }
        for (item, places) in incoming.into_iter().zip(held) {
            match item {
                Incoming::Malformed { delivery, reason } => {
                    tracing::warn!(%reason, "malformed delivery: dead-lettering it");
                    let Places { place, unsettled } = places;
                    drop(place);
                    self.settle_later(delivery, Tell::Malformed(reason), Some(unsettled));
                }
                Incoming::Claimed { delivery, job } => {
                    self.supervisor.metrics().incr(Counter::Claims);
                    let origin = crate::otel::of_job(&*self.source, &delivery, &job);
                    self.start(job.lease, asked_at, job.payload, job.progress, (delivery, places), origin);
                }
                Incoming::Unclaimed { delivery, key, payload } => unclaimed.push(((delivery, places), key, payload)),
            }
        }
        if unclaimed.is_empty() {
            return;
        }
        let queue = self.claims.lock().ok().and_then(|claims| claims.clone());
        for u in unclaimed {
            let refused = match &queue {
                Some(tx) => tx.send(u).err().map(|e| e.0),
                None => Some(u),
            };
            if let Some(((delivery, places), _, _)) = refused {
                tracing::debug!("consumer stopping: giving a received delivery back");
                self.settle_later(delivery, Tell::Fence(Disposition::Abandon), Some(places.unsettled));
            }
        }
    }

    /// A receive still in progress at shutdown: let it finish in a task of its own (within the
    /// grace period: a long poll of a source that is cancellation-safe itself, SQS, may take
    /// longer) and give back whatever it returns (release what the source claimed, abandon the
    /// rest).
    fn give_back_receive(self: &Arc<Self>, receive: Receive<S::Delivery>, held: Vec<Places>) {
        let shared = Arc::clone(self);
        self.tasks.spawn(async move {
            let incoming = match tokio::time::timeout(shared.grace, receive).await {
                Ok(Ok(incoming)) => incoming,
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "a receive in progress at shutdown failed");
                    return;
                }
                Err(_) => {
                    tracing::warn!(
                        grace = ?shared.grace,
                        "a receive in progress at shutdown did not finish within the grace period; dropped \
                         (a source that claims in its receive leaves such claims to their lease)"
                    );
                    return;
                }
            };
            if !incoming.is_empty() {
                tracing::info!(
                    n = incoming.len(),
                    "a receive in progress at shutdown returned deliveries: giving them back"
                );
            }
            for item in incoming {
                match item {
                    Incoming::Claimed { delivery, job } => shared.release_unstarted(&job.lease, delivery, None).await,
                    Incoming::Unclaimed { delivery, .. } | Incoming::Malformed { delivery, .. } => {
                        shared.settle(delivery, Tell::Fence(Disposition::Abandon), None).await;
                    }
                }
            }
            drop(held);
        });
    }
}
