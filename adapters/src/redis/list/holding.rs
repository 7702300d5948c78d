//! The holding area of a [`ListRetrofit`](super::ListRetrofit): popped items on their way back
//! to the list (after a retry's delay, or a push-back Redis did not take) or to the dead-letter
//! stream (a dead letter Redis did not take).
//!
//! A destructive pop has one copy. Sending it back from a spawned task with one `LPUSH` lost it
//! on the first transient error or timeout; so an item stays here until Redis took it, retried
//! with a capped backoff by one task per retrofit, for as long as the process runs. The area is
//! bounded: when it is full, whoever adds to it waits for a place (a loop whose Redis is down
//! cannot pop anyway).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::redis::conn::RedisConnections;
use crate::redis::error::RedisError;
use crate::redis::keys::sibling_key;
use crate::redis::lease::LeaseKeys;
use crate::redis::scripts::SCRIPTS;
use crate::redis::timeouts::bounded;

/// The default number of items the holding area keeps.
pub(super) const DEFAULT_HOLDING: usize = 1024;

/// The first pause after a failed send; it doubles per failure up to [`MAX_PAUSE`].
pub(super) const FIRST_PAUSE: Duration = Duration::from_millis(50);

/// The longest pause between two sends of one item: an item lands within about this long of
/// Redis answering again.
const MAX_PAUSE: Duration = Duration::from_secs(1);

/// How long the marker of a dead letter lives: it only has to outlive the retries of that one
/// dead letter (a send whose answer was lost is retried within [`MAX_PAUSE`] of Redis answering).
const DEAD_MARKER_MS: u64 = 3_600_000;

/// What to do with a held item.
#[derive(Debug, Clone)]
pub(super) enum Route {
    /// `LPUSH` it on the list.
    Push,
    /// Add it to the dead-letter stream, at most once per `marker` (see [`Target::dead_letter`]).
    DeadLetter { reason: String, marker: String },
}

struct Held {
    due: Instant,
    item: Vec<u8>,
    route: Route,
    failures: u32,
    _place: OwnedSemaphorePermit,
}

/// Where held items go, and the bound of each call.
#[derive(Clone)]
pub(super) struct Target {
    redis: RedisConnections,
    leases: LeaseKeys,
    list: String,
    dead: String,
    markers: Arc<AtomicU64>,
    owner: String,
    /// `dead_letters` counts the items this target added to the dead-letter stream, once each.
    metrics: Arc<fence::Metrics>,
}

impl Target {
    pub(super) fn new(
        redis: &RedisConnections,
        leases: &LeaseKeys,
        list: &str,
        dead: &str,
        owner: &str,
        metrics: Arc<fence::Metrics>,
    ) -> Self {
        Self {
            redis: redis.clone(),
            leases: leases.clone(),
            list: list.to_owned(),
            dead: dead.to_owned(),
            markers: Arc::new(AtomicU64::new(0)),
            owner: owner.to_owned(),
            metrics,
        }
    }

    /// A dead letter to send: unique to this retrofit and this call, so that its retries add
    /// one entry in all.
    pub(super) fn dead_letter(&self, reason: &str) -> Route {
        let n = self.markers.fetch_add(1, Ordering::Relaxed);
        Route::DeadLetter {
            reason: reason.to_owned(),
            marker: sibling_key(&self.list, &format!(":dead-sent:{}:{n}", self.owner)),
        }
    }

    /// One bounded call that sends `item`.
    pub(super) async fn send(&self, item: &[u8], route: &Route) -> Result<(), RedisError> {
        let mut conn = self.redis.commands();
        let limit = self.leases.get_timeout();
        match route {
            Route::Push => {
                let mut lpush = ::redis::cmd("LPUSH");
                lpush.arg(&self.list).arg(item);
                bounded("LPUSH", limit, lpush.query_async::<i64>(&mut conn)).await.map(|_| ())
            }
            Route::DeadLetter { reason, marker } => {
                // A send that timed out may have run: the marker makes its retry add nothing.
                let mut inv = SCRIPTS.list_dead_once.prepare_invoke();
                inv.key(&self.dead).key(marker).arg(reason.as_str()).arg(&self.list).arg(item).arg(DEAD_MARKER_MS);
                let added = bounded("EVALSHA list dead-letter", limit, inv.invoke_async::<i64>(&mut conn)).await?;
                // 0: an earlier send of this dead letter added it (its answer was lost).
                if added == 1 {
                    self.metrics.incr(fence::Counter::DeadLetters);
                }
                Ok(())
            }
        }
    }
}

/// The holding area, shared by every clone of one retrofit and its task.
pub(super) struct Holding {
    items: Mutex<Vec<Held>>,
    /// One place per item held, taken until Redis took the item (so an item the task is sending
    /// right now still counts).
    places: Arc<Semaphore>,
    capacity: usize,
    /// Wakes the task: an item was added, or a flush made every item due.
    wake: Notify,
    /// Wakes flushes: an item landed.
    landed: Notify,
    /// Fired when the last retrofit handle is dropped: the task ends once the area is empty.
    closed: CancellationToken,
}

impl Holding {
    /// An area of `capacity` places, and its task sending to `target`.
    pub(super) fn start(capacity: usize, target: Target) -> Arc<Holding> {
        let capacity = capacity.max(1);
        let holding = Arc::new(Holding {
            items: Mutex::new(Vec::new()),
            places: Arc::new(Semaphore::new(capacity)),
            capacity,
            wake: Notify::new(),
            landed: Notify::new(),
            closed: CancellationToken::new(),
        });
        tokio::spawn(Arc::clone(&holding).run(target));
        holding
    }

    /// Items held now (waiting, or being sent).
    pub(super) fn len(&self) -> usize {
        self.capacity.saturating_sub(self.places.available_permits())
    }

    /// Keeps `item` until it is sent, first at `due`. Waits for a place when the area is full.
    pub(super) async fn hold(&self, item: Vec<u8>, route: Route, due: Instant, failures: u32) {
        // The semaphore is never closed: `acquire_owned` can only answer a place.
        let Ok(place) = Arc::clone(&self.places).acquire_owned().await else {
            tracing::error!("the holding area is closed; the item cannot be kept");
            return;
        };
        match self.items.lock() {
            Ok(mut items) => items.push(Held { due, item, route, failures, _place: place }),
            Err(_) => {
                tracing::error!(
                    ?route,
                    "the holding area's lock is poisoned (a panic while it was held); the item is lost"
                );
                return;
            }
        }
        self.wake.notify_one();
    }

    /// Makes every held item due now and waits until the area is empty, at most `within`.
    /// Returns how many items are still held.
    pub(super) async fn flush(&self, within: Duration) -> usize {
        let deadline = Instant::now() + within;
        if let Ok(mut items) = self.items.lock() {
            let now = Instant::now();
            for h in items.iter_mut() {
                h.due = h.due.min(now);
            }
        }
        self.wake.notify_one();
        loop {
            let landed = self.landed.notified();
            let held = self.len();
            if held == 0 || Instant::now() >= deadline {
                return held;
            }
            let _ = tokio::time::timeout_at(deadline, landed).await;
        }
    }

    /// Stops the task once the area is empty (the last retrofit handle is gone).
    pub(super) fn close(&self) {
        self.closed.cancel();
    }

    fn take_due(&self, now: Instant) -> Vec<Held> {
        let Ok(mut items) = self.items.lock() else { return Vec::new() };
        let (due, later): (Vec<Held>, Vec<Held>) = items.drain(..).partition(|h| h.due <= now);
        *items = later;
        due
    }

    fn next_due(&self) -> Option<Instant> {
        self.items.lock().ok().and_then(|items| items.iter().map(|h| h.due).min())
    }

    fn put_back(&self, held: Vec<Held>) {
        if let Ok(mut items) = self.items.lock() {
            items.extend(held);
        }
    }

    async fn run(self: Arc<Self>, target: Target) {
        loop {
            let mut due = self.take_due(Instant::now()).into_iter();
            let mut failed = Vec::new();
            for mut h in due.by_ref() {
                match target.send(&h.item, &h.route).await {
                    Ok(()) => {
                        if h.failures > 0 {
                            tracing::info!(failures = h.failures, route = ?h.route, "a held item reached Redis");
                        }
                        drop(h);
                        self.landed.notify_waiters();
                    }
                    Err(e) => {
                        h.failures += 1;
                        let pause = FIRST_PAUSE.saturating_mul(1 << h.failures.min(10)).min(MAX_PAUSE);
                        if h.failures == 1 || h.failures % 20 == 0 {
                            tracing::warn!(error = %e, failures = h.failures, route = ?h.route, "Redis did not take a held item; it stays held and is sent again");
                        }
                        h.due = Instant::now() + pause;
                        failed.push(h);
                        // Redis is not answering: the rest waits for the same pause, rather
                        // than each costing a timeout now.
                        break;
                    }
                }
            }
            if let Some(pause_until) = failed.first().map(|h| h.due) {
                for mut h in due {
                    h.due = h.due.max(pause_until);
                    failed.push(h);
                }
            }
            self.put_back(failed);
            let next = self.next_due();
            if next.is_none() && self.closed.is_cancelled() {
                return;
            }
            let until = next.unwrap_or_else(|| Instant::now() + Duration::from_secs(3600));
            tokio::select! {
                _ = self.wake.notified() => {}
                _ = tokio::time::sleep_until(until) => {}
                _ = self.closed.cancelled(), if next.is_none() => {}
            }
        }
    }
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target").field("list", &self.list).field("dead", &self.dead).finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Holding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Holding").field("held", &self.len()).field("capacity", &self.capacity).finish()
    }
}

/// Closes the holding area when the last handle of a retrofit is dropped.
#[derive(Debug)]
pub(super) struct CloseOnDrop(pub(super) Arc<Holding>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        self.0.close();
    }
}
