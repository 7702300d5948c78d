//! The group claim: received deliveries queue for one claim statement per batch (grouped within
//! the claim window, a few statements in flight), and each claimed job starts as an attempt
//! under the supervisor; a job claimed but never started is released.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use fence::{Claim, Counter, Distribution, Grouper, JobError, JobKey, Lease};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

use super::receive::{Held, Places};
use super::settle::Tell;
use super::tracked::Untrack;
use super::{Shared, messaging_system};
use crate::disposition::Disposition;
use crate::handler::Handler;
use crate::source::Source;

/// A received delivery waiting for the group claim.
pub(super) type Unclaimed<D> = (Held<D>, JobKey, Vec<u8>);

/// Where received deliveries queue for the group claim. Unbounded as a channel, bounded by the
/// receive places: every queued delivery holds one.
pub(super) type ClaimQueue<D> = mpsc::UnboundedSender<Unclaimed<D>>;

/// Most deliveries claimed by one statement.
const MAX_CLAIM_BATCH: usize = 500;

/// Claim statements in flight at once: the database flushes concurrent commits together.
const CLAIMS_IN_FLIGHT: usize = 4;

impl<S: Source, H: Handler> Shared<S, H> {
    /// Group claim: claims the deliveries queued at the moment with one statement (one round
    /// trip, one commit), grouped by a [`Grouper`] with the
    /// [`claim_window`](ConsumerConfig::claim_window): while claims are in flight or the window
    /// is open, the next receives pile up for the next statement instead of each paying for its
    /// own. Up to [`CLAIMS_IN_FLIGHT`] statements run at once.
    pub(super) async fn claim_loop(
        self: Arc<Self>,
        rx: mpsc::UnboundedReceiver<Unclaimed<S::Delivery>>,
        window: Duration,
        places: Arc<Semaphore>,
    ) {
        let in_flight = Arc::new(Semaphore::new(CLAIMS_IN_FLIGHT));
        // Claim statements sent and not answered yet: their attempts are about to run.
        let claiming = Arc::new(AtomicUsize::new(0));
        // Deliveries wait the window out only while more can come: attempts run or are being
        // claimed (a busy consumer keeps receiving) and the receive loop has free places to
        // receive them into. So deliveries that come one at a time wait for nothing, and waiting
        // never holds places the receive loop is short of.
        let supervisor = self.supervisor.clone();
        let probe = Arc::clone(&claiming);
        let mut groups = Grouper::new(rx, MAX_CLAIM_BATCH, window).busy(move || {
            (supervisor.in_flight() > 0 || probe.load(Ordering::Acquire) > 0) && places.available_permits() > 0
        });
        loop {
            // While every claim slot is busy, deliveries keep piling up for the next statement.
            let Ok(permit) = Arc::clone(&in_flight).acquire_owned().await else { return };
            let Some(batch) = groups.next().await else { return };
            let shared = Arc::clone(&self);
            claiming.fetch_add(1, Ordering::AcqRel);
            let claimed = Arc::clone(&claiming);
            self.tasks.spawn(async move {
                shared.claim_and_start(batch).await;
                claimed.fetch_sub(1, Ordering::AcqRel);
                drop(permit);
            });
        }
    }

    /// One statement claims the whole batch; each delivery then starts or is settled. Once
    /// shutdown began nothing more is claimed: the deliveries are given back. A claim that
    /// answers after shutdown began is not lost either: its leases are released (in
    /// [`start`](Self::start)).
    async fn claim_and_start(self: Arc<Self>, unclaimed: Vec<Unclaimed<S::Delivery>>) {
        if self.stopping.is_cancelled() {
            for ((delivery, places), _, _) in unclaimed {
                self.settle(delivery, Tell::Fence(Disposition::Abandon), Some(places.unsettled)).await;
            }
            return;
        }
        let metrics = self.supervisor.metrics();
        metrics.incr(Counter::ClaimStatements);
        let keys: Vec<JobKey> = unclaimed.iter().map(|(_, k, _)| k.clone()).collect();
        let claim_sent = std::time::Instant::now();
        let answer =
            self.supervisor.store().claim_batch(self.source.queue(), &keys, self.supervisor.owner(), self.lease).await;
        metrics.observe_duration(Distribution::ClaimDuration, claim_sent.elapsed());
        metrics.observe(Distribution::ClaimStatementJobs, keys.len() as f64);
        let claims = match answer {
            Ok(c) => {
                self.claim_failures.store(0, Ordering::Relaxed);
                c
            }
            Err(e) => {
                // Leave the deliveries to the broker's visibility timeout: they come back.
                self.claim_failures.fetch_add(1, Ordering::Relaxed);
                tracing::error!(error = %e, n = keys.len(), "claim failed; deliveries left to the broker");
                return;
            }
        };
        let mut started = HashSet::new();
        for ((held, key, payload), claim) in unclaimed.into_iter().zip(claims) {
            match Disposition::after_claim(&claim) {
                None if started.insert(key.clone()) => {
                    if let Claim::Claimed(lease) = claim {
                        metrics.incr(Counter::Claims);
                        let origin = crate::otel::of_delivery(&*self.source, &held.0);
                        self.start(lease, claim_sent, payload, None, held, origin);
                    }
                }
                None => {
                    // The same key twice in one batch: the first runs; this one waits its turn.
                    let hold = claim.lease().map(|l| l.ttl).unwrap_or_default();
                    metrics.incr(Counter::Busy);
                    let (delivery, Places { place, unsettled }) = held;
                    drop(place);
                    self.settle_later(delivery, Tell::Fence(Disposition::Hold(hold)), Some(unsettled));
                }
                Some(d) => {
                    match &d {
                        Disposition::Hold(_) => metrics.incr(Counter::Busy),
                        Disposition::Ack | Disposition::DeadLetter(_) => metrics.incr(Counter::Duplicates),
                        _ => {}
                    }
                    if let Claim::Done { epoch } = claim {
                        let origin = crate::otel::of_delivery(&*self.source, &held.0);
                        let system = messaging_system(self.source.kind());
                        crate::otel::duplicate(self.source.queue(), &key, epoch, Some(system), &origin);
                    }
                    tracing::debug!(%key, disposition = ?d, "delivery not claimed");
                    let (delivery, Places { place, unsettled }) = held;
                    drop(place);
                    self.settle_later(delivery, Tell::Fence(d), Some(unsettled));
                }
            }
        }
    }

    /// Gives back a job claimed but never started: the lease is released (pending again, no
    /// attempt spent) and the delivery abandoned at the broker.
    pub(super) async fn release_unstarted(
        &self,
        lease: &Lease,
        delivery: S::Delivery,
        unsettled: Option<OwnedSemaphorePermit>,
    ) {
        match self.supervisor.store().release(lease).await {
            Ok(()) => {
                self.supervisor.metrics().incr(Counter::Releases);
                tracing::info!(key = %lease.key, epoch = lease.epoch, "released a job claimed but never started");
                self.settle(delivery, Tell::Fence(Disposition::Abandon), unsettled).await;
            }
            Err(e) => tracing::warn!(
                error = %e,
                key = %lease.key,
                "could not release a job claimed but never started; it is claimable again when its lease ends"
            ),
        }
    }

    /// Runs one attempt in its own task; the places return as the delivery moves on (the
    /// receive place when the handler starts or returns, the unsettled place once settled).
    /// A job that has not started when shutdown begins (claimed after it, or waiting for a
    /// handler slot) is released instead.
    pub(super) fn start(
        self: &Arc<Self>,
        lease: Lease,
        claimed_at: std::time::Instant,
        payload: Vec<u8>,
        progress: Option<Vec<u8>>,
        (delivery, places): Held<S::Delivery>,
        origin: crate::otel::Origin,
    ) {
        let shared = Arc::clone(self);
        self.tasks.spawn(async move {
            let Places { place, unsettled } = places;
            if shared.stopping.is_cancelled() {
                // Claimed while shutting down: give it straight back.
                drop(place);
                Box::pin(shared.release_unstarted(&lease, delivery, Some(unsettled))).await;
                return;
            }
            shared.tracked.insert(&lease, delivery.clone());
            let untrack = Untrack { tracked: &shared.tracked, lease: &lease };
            let handler = shared.handler.clone();
            // The concurrency slot is the handler's: it frees the moment the handler returns (or
            // is cancelled), so the commit and the broker call overlap the next job.
            let slots = shared.slots.clone();
            let timeout = shared.attempt_timeout;
            let stopping = shared.stopping.clone();
            let system = messaging_system(shared.source.kind());
            let (gave_up, not_started) = tokio::sync::oneshot::channel::<()>();
            let run = move |ctx| async move {
                tracing::Span::current().record("messaging.system", system);
                // Prefetching: wait for a handler slot under the lease (the supervisor already
                // heartbeats it), then give the prefetch place back. Otherwise the receive permit
                // is the slot. Either frees the moment the handler returns. Shutdown before the
                // slot came: the job never starts (the attempt is dropped and released below).
                let slot = match slots {
                    Some(slots) => {
                        let slot = tokio::select! {
                            biased;
                            _ = stopping.cancelled() => {
                                let _ = gave_up.send(());
                                return std::future::pending().await;
                            }
                            slot = slots.acquire_owned() => slot.ok(),
                        };
                        drop(place);
                        (slot, None)
                    }
                    None => (None, Some(place)),
                };
                // The attempt timeout starts now that the handler has its slot: time spent
                // waiting for the slot is not the handler's (a prefetched job would otherwise fail
                // as timed out, and die at max_attempts, without having run). A panic is a failed
                // attempt (`run_caught`).
                let result = match timeout {
                    Some(t) => tokio::time::timeout(t, crate::caught::run_caught(handler, ctx))
                        .await
                        .unwrap_or_else(|_| Err(JobError::retry(format!("attempt timed out after {t:?}")))),
                    None => crate::caught::run_caught(handler, ctx).await,
                };
                drop(slot);
                result
            };
            // The deadline counts from before the claim was asked for, not from when it started.
            let attempt = shared.supervisor.run_claimed_at(lease.clone(), claimed_at, payload, progress, run);
            // Boxed: the attempt's state (the handler's path to its verdict) is most of this
            // task's size, and a task that large is copied on every move and allocated outside
            // the allocator's small-size caches.
            let attempt = Box::pin(crate::otel::scope(origin, attempt));
            let outcome = tokio::select! {
                outcome = attempt => Some(outcome),
                Ok(()) = not_started => None,
            };
            drop(untrack);
            match outcome {
                Some(outcome) => {
                    shared.settle(delivery, Tell::Fence(Disposition::after_run(&outcome)), Some(unsettled)).await;
                }
                None => Box::pin(shared.release_unstarted(&lease, delivery, Some(unsettled))).await,
            }
        });
    }
}
