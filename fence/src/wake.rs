//! Wake-ups for the idle consumers of a table queue: instead of asking the database again and
//! again whether a job is due, a consumer waits for a [`Wake`] and claims when one comes.
//!
//! Where the wake-ups come from:
//! - **PostgreSQL**: the fence's own writes that make a job due (an enqueue, a release, a
//!   retry) are announced with `pg_notify` after they committed, by one task per fence that
//!   gathers them (`announce`); a transactional enqueue (`enqueue_in`, `enqueue_many_in`,
//!   `outbox_in`) calls `pg_notify` inside the caller's transaction, so the notification is
//!   sent when that transaction commits and never when it rolls back. One listener connection
//!   per [`PgFence`](crate::PgFence) (its clones share it) receives them for every queue of the
//!   schema and wakes that queue's consumers in this process. A retry announces its delay, and
//!   the consumers set a timer for it. Behind a transaction-mode pooler (where `LISTEN` does not
//!   work) or with [`PgFence::listen`](crate::PgFence::listen)`(false)` there is no listener:
//!   only the fence's own writes in this process wake its consumers. An admin requeue of a dead
//!   job sends nothing (the poll finds it).
//! - **SQLite**: an enqueue, release or retry through the store wakes the consumers of the same
//!   store (and its clones) in this process; a transactional enqueue does not.
//!
//! A wake-up is only a hint: the claim statement decides what is due and who gets it. A lost
//! notification (the listener connection was cut, another process wrote without a listener
//! here) delays a job until the consumer's next poll, which every consumer keeps as a fallback
//! (see `TableQueue::idle_wait`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Why [`Wakeups::wait`] returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Wake {
    /// A job of the queue became due (an enqueue, a release or a retry committed), or another
    /// consumer of the same [`Wakeups`] claimed a full batch and passed the wake-up on.
    Notified,
    /// A job announced as due later is due now.
    Due,
    /// Notifications may have been missed (the listener connection was lost and replaced):
    /// claim, and ask for the next due job again ([`FenceStore::next_due`](crate::FenceStore::next_due)).
    Resync,
    /// The deadline passed without any of the above.
    Timeout,
}

/// A consumer's subscription to the wake-ups of one queue (from
/// [`FenceStore::wakeups`](crate::FenceStore::wakeups)). Cheap to share behind an `Arc`: the
/// receive loops of one consumer wait on one subscription, and each wake-up wakes one of them.
///
/// ```no_run
/// # async fn demo(store: &dyn brokerfence::FenceStore) -> brokerfence::Result<()> {
/// use std::time::Duration;
/// use brokerfence::{QueueName, Wake};
/// let wakeups = store.wakeups(&QueueName::new("emails")?);
/// let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
/// match wakeups.wait(deadline).await {
///     Wake::Timeout => println!("nothing announced: poll"),
///     _ => println!("claim now"),
/// }
/// # Ok(()) }
/// ```
pub struct Wakeups {
    sub: Option<Arc<Subscriber>>,
    hub: Option<Arc<Hub>>,
}

impl std::fmt::Debug for Wakeups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wakeups").field("listening", &self.is_listening()).finish_non_exhaustive()
    }
}

impl Wakeups {
    /// No wake-ups: [`wait`](Self::wait) only times out (a store that cannot announce jobs).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let w = brokerfence::Wakeups::none();
    /// assert!(!w.is_listening());
    /// let now = tokio::time::Instant::now();
    /// assert_eq!(w.wait(now).await, brokerfence::Wake::Timeout);
    /// # }
    /// ```
    pub fn none() -> Self {
        Self { sub: None, hub: None }
    }

    /// Waits until a wake-up comes or `deadline` passes, and says which. Cancellation-safe: a
    /// wake-up that comes while nobody waits is kept for the next wait.
    pub async fn wait(&self, deadline: Instant) -> Wake {
        let (Some(sub), Some(hub)) = (&self.sub, &self.hub) else {
            tokio::time::sleep_until(deadline).await;
            return Wake::Timeout;
        };
        loop {
            let generation = hub.generation.load(Ordering::Acquire);
            if sub.seen.swap(generation, Ordering::AcqRel) != generation {
                return Wake::Resync;
            }
            // Registered before the timer is read: a timer set from here on wakes this wait.
            let rearmed = sub.rearm.notified();
            tokio::pin!(rearmed);
            rearmed.as_mut().enable();
            let due = sub.due();
            if let Some(d) = due
                && d <= Instant::now()
            {
                if sub.take_due(d) {
                    return Wake::Due;
                }
                continue;
            }
            let until = due.map_or(deadline, |d| d.min(deadline));
            tokio::select! {
                () = sub.notify.notified() => {
                    let generation = hub.generation.load(Ordering::Acquire);
                    return if sub.seen.swap(generation, Ordering::AcqRel) != generation {
                        Wake::Resync
                    } else {
                        Wake::Notified
                    };
                }
                () = &mut rearmed => continue,
                () = tokio::time::sleep_until(until) => {
                    if let Some(d) = due
                        && d <= Instant::now()
                        && sub.take_due(d)
                    {
                        return Wake::Due;
                    }
                    if Instant::now() >= deadline {
                        return Wake::Timeout;
                    }
                }
            }
        }
    }

    /// Passes a wake-up on to another waiter of this subscription (a consumer that claimed a
    /// full batch: more may be due).
    pub fn pass_on(&self) {
        if let Some(sub) = &self.sub {
            sub.notify.notify_one();
        }
    }

    /// Sets a timer: [`wait`](Self::wait) answers [`Wake::Due`] once `after` has passed (the
    /// earliest of the timers set wins). For the answer of
    /// [`FenceStore::next_due`](crate::FenceStore::next_due).
    pub fn due_in(&self, after: Duration) {
        if let Some(sub) = &self.sub {
            sub.set_due(Instant::now() + after);
        }
    }

    /// Whether notifications arrive from the database now (PostgreSQL with its listener
    /// connected). `false` for [`none`](Self::none), SQLite (only this process's writes wake)
    /// and PostgreSQL behind a transaction-mode pooler, or while the listener reconnects.
    pub fn is_listening(&self) -> bool {
        self.hub.as_ref().is_some_and(|h| h.listening.load(Ordering::Acquire))
    }
}

/// One subscription's state.
struct Subscriber {
    /// A job became due (one permit is kept when nobody waits).
    notify: Notify,
    /// The due timer changed: waiters look at it again.
    rearm: Notify,
    due: Mutex<Option<Instant>>,
    /// The hub's generation this subscription has seen.
    seen: AtomicU64,
}

impl Subscriber {
    fn due(&self) -> Option<Instant> {
        *self.due.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Clears the timer if it is still `at` (another waiter may have taken it, or set an
    /// earlier one); says whether it did.
    fn take_due(&self, at: Instant) -> bool {
        let mut due = self.due.lock().unwrap_or_else(|e| e.into_inner());
        if *due == Some(at) {
            *due = None;
            return true;
        }
        false
    }

    fn set_due(&self, at: Instant) {
        let mut due = self.due.lock().unwrap_or_else(|e| e.into_inner());
        if due.is_none_or(|d| at < d) {
            *due = Some(at);
            drop(due);
            self.rearm.notify_waiters();
        }
    }
}

/// The wake-ups of one store (and its clones): subscriptions per queue, and the listener.
pub(crate) struct Hub {
    subs: Mutex<HashMap<String, Vec<Weak<Subscriber>>>>,
    /// Grows each time the listener (re)connects: subscriptions then answer [`Wake::Resync`].
    generation: AtomicU64,
    /// The listener is connected.
    listening: AtomicBool,
    /// Whether the listener was started (PostgreSQL with one).
    #[cfg(feature = "postgres")]
    started: AtomicBool,
    #[cfg(feature = "postgres")]
    listen: Option<ListenSpec>,
    /// Sends the notifications of the fence's own writes after they committed (none: the
    /// fence does not notify, or SQLite).
    #[cfg(feature = "postgres")]
    announce: Option<announce::Announcer>,
    /// Stops the listener task when the hub goes.
    stop: CancellationToken,
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// What the PostgreSQL listener listens with.
#[cfg(feature = "postgres")]
pub(crate) struct ListenSpec {
    pub(crate) pool: sqlx::PgPool,
    pub(crate) channel: String,
}

impl Hub {
    /// A hub whose wake-ups come from this process's own writes only.
    pub(crate) fn local() -> Arc<Self> {
        Arc::new(Self {
            subs: Mutex::new(HashMap::new()),
            generation: AtomicU64::new(0),
            listening: AtomicBool::new(false),
            #[cfg(feature = "postgres")]
            started: AtomicBool::new(false),
            #[cfg(feature = "postgres")]
            listen: None,
            #[cfg(feature = "postgres")]
            announce: None,
            stop: CancellationToken::new(),
        })
    }

    /// A PostgreSQL hub: listening on `listen.channel` (started with the first subscription)
    /// when given, and announcing the fence's own writes when `announce` is.
    #[cfg(feature = "postgres")]
    pub(crate) fn postgres(listen: Option<ListenSpec>, announce: Option<(sqlx::PgPool, String, bool)>) -> Arc<Self> {
        Arc::new(Self {
            subs: Mutex::new(HashMap::new()),
            generation: AtomicU64::new(0),
            listening: AtomicBool::new(false),
            started: AtomicBool::new(false),
            listen,
            announce: announce.map(|(pool, channel, pooled)| announce::Announcer::new(pool, channel, pooled)),
            stop: CancellationToken::new(),
        })
    }

    /// After a write of the fence committed that made a job of `queue` due (after `delay`):
    /// wakes this process's consumers when no notification will (nothing listens here), and
    /// sends the notification to the other processes (coalesced, in a task of its own).
    #[cfg(feature = "postgres")]
    pub(crate) fn committed(&self, queue: &str, delay: Duration) {
        // The notification wakes this process too when it listens, unless none is sent.
        if !self.is_listening() || self.announce.is_none() {
            self.wake(queue, delay);
        }
        if let Some(a) = &self.announce {
            a.send(queue, delay);
        }
    }

    /// A subscription to `queue`'s wake-ups; starts the listener if there is one to start (in
    /// a tokio runtime).
    pub(crate) fn subscribe(self: &Arc<Self>, queue: &str) -> Wakeups {
        let sub = Arc::new(Subscriber {
            notify: Notify::new(),
            rearm: Notify::new(),
            due: Mutex::new(None),
            seen: AtomicU64::new(self.generation.load(Ordering::Acquire)),
        });
        {
            let mut subs = self.subs.lock().unwrap_or_else(|e| e.into_inner());
            let list = subs.entry(queue.to_owned()).or_default();
            list.retain(|w| w.strong_count() > 0);
            list.push(Arc::downgrade(&sub));
        }
        #[cfg(feature = "postgres")]
        if self.listen.is_some()
            && tokio::runtime::Handle::try_current().is_ok()
            && !self.started.swap(true, Ordering::AcqRel)
        {
            tokio::spawn(listener::run(Arc::downgrade(self), self.stop.clone()));
        }
        Wakeups { sub: Some(sub), hub: Some(Arc::clone(self)) }
    }

    /// Whether the database's notifications arrive here now.
    #[cfg(feature = "postgres")]
    pub(crate) fn is_listening(&self) -> bool {
        self.listening.load(Ordering::Acquire)
    }

    /// Wakes the consumers of `queue` in this process: at once (`delay` zero) or with a timer.
    pub(crate) fn wake(&self, queue: &str, delay: Duration) {
        let subs: Vec<Arc<Subscriber>> = {
            let mut map = self.subs.lock().unwrap_or_else(|e| e.into_inner());
            let Some(list) = map.get_mut(queue) else { return };
            list.retain(|w| w.strong_count() > 0);
            list.iter().filter_map(Weak::upgrade).collect()
        };
        for sub in subs {
            if delay.is_zero() {
                sub.notify.notify_one();
            } else {
                sub.set_due(Instant::now() + delay);
            }
        }
    }

    /// A notification's payload, `<delay ms>:<queue>` (see [`payload_sql`]), or
    /// [`OUTBOX_PAYLOAD`].
    #[cfg(feature = "postgres")]
    pub(crate) fn deliver(&self, payload: &str) {
        if payload == OUTBOX_PAYLOAD {
            return self.wake(OUTBOX, Duration::ZERO);
        }
        if payload == listener::PING {
            return;
        }
        match payload.split_once(':') {
            Some((ms, queue)) => {
                let delay = ms.parse::<u64>().map(Duration::from_millis).unwrap_or(Duration::ZERO);
                self.wake(queue, delay);
            }
            None => tracing::debug!(payload, "a notification brokerfence did not send: ignored"),
        }
    }

    /// The listener (re)connected: every subscription claims and asks for its next due job.
    #[cfg(feature = "postgres")]
    pub(crate) fn resync(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        let subs: Vec<Arc<Subscriber>> = {
            let map = self.subs.lock().unwrap_or_else(|e| e.into_inner());
            map.values().flatten().filter_map(Weak::upgrade).collect()
        };
        for sub in subs {
            sub.notify.notify_one();
        }
    }
}

/// The subscription key of the outbox relays (no queue name holds a NUL).
#[cfg(feature = "postgres")]
pub(crate) const OUTBOX: &str = "\0outbox";

/// The payload of the notification an outbox row sends when its transaction commits.
#[cfg(feature = "postgres")]
pub(crate) const OUTBOX_PAYLOAD: &str = "outbox";

/// The notification channel of a schema: `<schema>.wake`, or a shortened name with a hash of the
/// schema when that is longer than PostgreSQL's 63 bytes. Schema names are lowercase ASCII
/// letters, digits and underscores, so the name needs no quoting as a literal.
#[cfg(feature = "postgres")]
pub(crate) fn channel(schema: &str) -> String {
    let plain = format!("{schema}.wake");
    if plain.len() <= 63 {
        return plain;
    }
    // FNV-1a: stable across builds and platforms.
    let hash = schema.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3));
    format!("{}.{hash:016x}.wake", &schema[..40])
}

/// The SQL expression of a notification's payload for queue `queue` (an SQL expression) due
/// `delay_ms` (an SQL expression, milliseconds) from now: `<delay ms>:<queue>`.
#[cfg(feature = "postgres")]
pub(crate) fn payload_sql(queue: &str, delay_ms: &str) -> String {
    format!("greatest(0, ({delay_ms})::bigint)::text || ':' || {queue}")
}

#[cfg(feature = "postgres")]
mod listener;

#[cfg(feature = "postgres")]
mod announce;
