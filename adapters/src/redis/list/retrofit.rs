//! [`ListRetrofit`]: the fence inside a `BRPOP`/`BLMOVE` loop you own.

use std::future::Future;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fence::{
    FenceError, FenceStore, IntoJobResult, JobContext, JobError, JobKey, JobState, Owner, QueueName, SupervisorConfig,
};
use tokio::time::Instant;

use crate::disposition::Disposition;
use crate::redis::conn::RedisConnections;
use crate::redis::error::RedisError;
use crate::redis::handle::Topology;
use crate::redis::keys::{check_same_slot, sibling_key, token};
use crate::redis::lease::{LeaseKeyHook, LeaseKeys};
use crate::retrofit::{Detail, Processed, Retrofit};

use super::ItemKey;
use super::holding::{CloseOnDrop, DEFAULT_HOLDING, FIRST_PAUSE, Holding, Route, Target};

/// The fence around a handler inside a list loop you already own (`BRPOP`, `BLMOVE`): the job key
/// comes from the item ([`ItemKey`]), its lease key is set when the attempt starts, renewed on every
/// heartbeat the database confirmed (a [`LeaseKeyHook`] on the supervisor), and released by
/// compare-and-set when the attempt ends.
///
/// A destructive pop has one copy: [`requeue_popped`](Self::requeue_popped) puts the item back
/// unless the database settled its job (committed, done, dead, or a newer epoch holds it). What
/// Redis does not take at once (an error, a timeout) and a retry's delayed push-back wait in the
/// retrofit's bounded holding area, sent again with backoff until Redis takes them: nothing popped
/// is lost while the process runs, and `requeue_popped` fails only on a schema the fence refuses
/// ([`RedisError::Refused`], after the item is back). Before the process exits, [`flush`](Self::flush)
/// sends what is held. Every Redis call of the fence is bounded
/// ([`command_timeout`](Self::command_timeout)); bound your own blocking read too, as below
/// ([`RedisTimeouts::blocking`](crate::redis::RedisTimeouts::blocking)), and ride out a Redis
/// error rather than leave the loop on it (the held items need the process).
///
/// ```no_run
/// # async fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>) -> Result<(), Box<dyn std::error::Error>> {
/// use brokerfence::redis::{ItemKey, ListRetrofit, RedisConnections};
/// use brokerfence::{LeaseDuration, QueueName, SupervisorConfig};
/// let redis = RedisConnections::connect("redis://127.0.0.1:6379").await?;
/// let config = SupervisorConfig::new(LeaseDuration::from_secs(30)?);
/// let fence = ListRetrofit::new(store, QueueName::new("mail")?, config, &redis, "mail", ItemKey::Split(b'|'))?;
/// fence.retrofit().check_schema().await?; // "… run migrations …" on a schema this build cannot use
/// let mut conn = redis.blocking();
/// let block = std::time::Duration::from_secs(5);
/// loop {
///     // your loop, as before, with the blocking read bounded (block time + margin: a stalled
///     // Redis must not hang it for ever; the blocking connection has no response timeout):
///     let mut brpop = brokerfence::redis::client::cmd("BRPOP");
///     brpop.arg("mail").arg(block.as_secs());
///     let read = brpop.query_async::<Option<(String, Vec<u8>)>>(&mut conn);
///     let item = match tokio::time::timeout(redis.get_timeouts().blocking(block), read).await {
///         Ok(Ok(Some((_, item)))) => item,
///         Ok(Ok(None)) | Err(_) => continue,
///         Ok(Err(e)) => {
///             // Redis away: wait for it (what the retrofit holds is sent once it is back).
///             eprintln!("BRPOP: {e}");
///             tokio::time::sleep(std::time::Duration::from_secs(1)).await;
///             continue;
///         }
///     };
///     let done = fence.process(&item, |ctx| async move { Ok(ctx.payload().to_vec()) }).await;
///     fence.requeue_popped(&item, &done).await?; // puts back what must run again; fails only on a refused schema
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct ListRetrofit {
    retrofit: Retrofit,
    leases: LeaseKeys,
    item_key: ItemKey,
    list: String,
    dead: String,
    target: Target,
    holding: Arc<Holding>,
    /// Closes the holding area once the last clone is dropped (its task then sends what is
    /// left and ends).
    _close: Arc<CloseOnDrop>,
}

impl ListRetrofit {
    /// The fence for items of `list`, fenced under `queue`, with a fresh owner id; `item_key` maps
    /// each item to its job key and payload (see [`ItemKey`] for what each choice means for
    /// identical items). Must be created inside a tokio runtime.
    ///
    /// The fence's own calls (lease keys, the push back and dead letter of
    /// [`requeue_popped`](Self::requeue_popped)) go over `redis`'s command connection
    /// ([`RedisConnections::commands`]), each bounded by its response timeout
    /// ([`RedisTimeouts::response`](crate::redis::RedisTimeouts::response), default 2 s; change it with
    /// [`command_timeout`](Self::command_timeout)); your blocking pop belongs on
    /// [`RedisConnections::blocking`], which has no response timeout of its own.
    ///
    /// On a Redis Cluster, a list name whose derived keys (`{list}:dead`, the lease keys) would
    /// fall in another slot than the list (a `}` without a `{…}` hash tag before it) is refused
    /// here with [`RedisError::CrossSlot`]; on one server every name is taken.
    pub fn new(
        store: Arc<dyn FenceStore>,
        queue: QueueName,
        config: SupervisorConfig,
        redis: &RedisConnections,
        list: impl Into<String>,
        item_key: ItemKey,
    ) -> Result<Self, RedisError> {
        Self::with_owner(store, queue, Owner::unique("worker"), config, redis, list, item_key)
    }

    /// Like [`new`](Self::new) with the given owner id.
    pub fn with_owner(
        store: Arc<dyn FenceStore>,
        queue: QueueName,
        owner: Owner,
        config: SupervisorConfig,
        redis: &RedisConnections,
        list: impl Into<String>,
        item_key: ItemKey,
    ) -> Result<Self, RedisError> {
        let list = list.into();
        let dead = sibling_key(&list, ":dead");
        let leases = LeaseKeys::of_source(redis, &list);
        if redis.topology() == Topology::Cluster {
            let lease = sibling_key(&list, ":lease:");
            check_same_slot("ListRetrofit", &list, &[&dead, &lease])?;
        }
        let retrofit = Retrofit::with_owner(store, queue, owner.clone(), config);
        let target = Target::new(redis, &leases, &list, &dead, owner.as_str(), Arc::clone(retrofit.metrics()));
        retrofit.supervisor().add_hook(Arc::new(LeaseKeyHook::new(leases.clone())));
        let holding = Holding::start(DEFAULT_HOLDING, target.clone());
        let _close = Arc::new(CloseOnDrop(Arc::clone(&holding)));
        Ok(Self { retrofit, leases, item_key, list, dead, target, holding, _close })
    }

    /// How many popped items the holding area keeps (default 1,024, at least 1): items on their
    /// way back after a retry's delay, and items Redis did not take at once. When it is full,
    /// [`requeue_popped`](Self::requeue_popped) waits for a place (Redis is not answering: the
    /// loop could not pop anyway). Set it before the first item.
    ///
    /// ```no_run
    /// # async fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>, redis: brokerfence::redis::RedisConnections) -> Result<(), Box<dyn std::error::Error>> {
    /// use brokerfence::redis::{ItemKey, ListRetrofit};
    /// use brokerfence::{LeaseDuration, QueueName, SupervisorConfig};
    /// let config = SupervisorConfig::new(LeaseDuration::from_secs(30)?);
    /// let fence = ListRetrofit::new(store, QueueName::new("mail")?, config, &redis, "mail", ItemKey::Split(b'|'))?
    ///     .holding_capacity(64);
    /// # drop(fence);
    /// # Ok(()) }
    /// ```
    pub fn holding_capacity(mut self, capacity: usize) -> Self {
        let holding = Holding::start(capacity, self.target.clone());
        // The area it replaces ends its task once empty (it is, before the first item).
        self._close = Arc::new(CloseOnDrop(Arc::clone(&holding)));
        self.holding = holding;
        self
    }

    /// Popped items held now: waiting for a retry's delay to pass, or for Redis to take them.
    #[doc(hidden)]
    pub fn held(&self) -> usize {
        self.holding.len()
    }

    /// Sends every held item now (a retry's delay cut short: the fence still holds its job
    /// until the backoff has passed, and answers a pop before then with a retry again) and waits
    /// until Redis took them all, at most `within`. Call it before the process exits: held items
    /// live in its memory. [`RedisError::StillHeld`] when Redis did not take them in time (they
    /// stay held and are sent again).
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::redis::ListRetrofit) -> Result<(), brokerfence::redis::RedisError> {
    /// // after your loop, before exiting:
    /// fence.flush(std::time::Duration::from_secs(10)).await?;
    /// # Ok(()) }
    /// ```
    pub async fn flush(&self, within: Duration) -> Result<(), RedisError> {
        match self.holding.flush(within).await {
            0 => Ok(()),
            held => Err(RedisError::StillHeld { held, after: within }),
        }
    }

    /// The response timeout of this fence's Redis calls (default 2 s): lease keys, the push back
    /// and the dead letter of [`requeue_popped`](Self::requeue_popped) (each try of them). The heartbeat's lease-key
    /// renewals get at most a quarter of the lease ([`RedisTimeouts::hint`](crate::redis::RedisTimeouts::hint)). A call that
    /// times out fails with [`RedisError::Timeout`]. Use the value of your connection's response
    /// timeout, or lower.
    ///
    /// ```no_run
    /// # async fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>, redis: brokerfence::redis::RedisConnections) -> Result<(), Box<dyn std::error::Error>> {
    /// use std::time::Duration;
    /// use brokerfence::redis::{ItemKey, ListRetrofit};
    /// use brokerfence::{LeaseDuration, QueueName, SupervisorConfig};
    /// let config = SupervisorConfig::new(LeaseDuration::from_secs(30)?);
    /// let fence = ListRetrofit::new(store, QueueName::new("mail")?, config, &redis, "mail", ItemKey::Split(b'|'))?
    ///     .command_timeout(Duration::from_millis(500));
    /// assert_eq!(fence.leases().get_timeout(), Duration::from_millis(500));
    /// # Ok(()) }
    /// ```
    pub fn command_timeout(self, timeout: Duration) -> Self {
        self.leases.set_timeout(timeout);
        self
    }

    /// The underlying retrofit (supervisor, metrics).
    pub fn retrofit(&self) -> &Retrofit {
        &self.retrofit
    }

    /// The lease keys.
    pub fn leases(&self) -> &LeaseKeys {
        &self.leases
    }

    /// The list popped items go back to.
    pub fn list(&self) -> &str {
        &self.list
    }

    /// The dead-letter stream (`{list}:dead`).
    pub fn get_dead_letter_stream(&self) -> &str {
        &self.dead
    }

    /// The lease key of `item`'s job: its identity in Redis (`None` when the item cannot be
    /// decoded).
    ///
    /// ```no_run
    /// # fn demo(fence: brokerfence::redis::ListRetrofit) {
    /// let key = fence.lease_key(b"order-7|{\"qty\":1}").expect("a decodable item");
    /// assert!(key.contains("order-7"), "{key}");
    /// # }
    /// ```
    pub fn lease_key(&self, item: &[u8]) -> Option<String> {
        let (key, _) = self.item_key.decode(item).ok()?;
        Some(self.leases.key(self.retrofit.queue(), &key))
    }

    /// Claims the item's job, sets its lease key, runs `handler` under the lease, commits through
    /// the fence, releases the lease key, and says what to do with the item: the [`Processed`]
    /// every retrofit gives. An item that cannot be decoded is [`Detail::Malformed`], with the
    /// disposition [`Disposition::DeadLetter`] and the reason.
    ///
    /// When the attempt ended without a verdict of its own (lease lost or unconfirmed, commit
    /// fenced or unknown), the disposition is what the database says of the job now:
    /// [`Disposition::Ack`] (completed), [`Disposition::DeadLetter`] (dead),
    /// [`Disposition::Leave`] (a newer epoch holds or finished it) or, in every other case,
    /// [`Disposition::Abandon`] (put the item back now); the [`reason`](Processed::reason)
    /// still says what happened to this attempt.
    ///
    /// The handler is awaited in place: any `FnOnce` closure, borrowing locals or moving loop
    /// state in (see [`Retrofit::process`]).
    pub async fn process<F, Fut, R>(&self, item: &[u8], handler: F) -> Processed
    where
        F: FnOnce(JobContext) -> Fut,
        Fut: Future<Output = Result<R, JobError>>,
        R: IntoJobResult,
    {
        let (key, payload) = match self.item_key.decode(item) {
            Ok(v) => v,
            Err(reason) => {
                tracing::warn!(%reason, "undecodable list item");
                return Processed::new(Disposition::DeadLetter(reason.clone()), Detail::Malformed(reason));
            }
        };
        let lease_key = self.leases.key(self.retrofit.queue(), &key);
        let ours: Arc<Mutex<Option<String>>> = Arc::new(Mutex::new(None));
        // The epoch this worker claimed (0: the handler never started).
        let claimed = Arc::new(AtomicI64::new(0));
        let wrapped = {
            let (leases, lease_key, ours, claimed) =
                (self.leases.clone(), lease_key.clone(), Arc::clone(&ours), Arc::clone(&claimed));
            move |ctx: JobContext| {
                claimed.store(ctx.epoch(), Ordering::SeqCst);
                async move {
                    let l = ctx.lease();
                    let tok = token(&l.owner, l.epoch);
                    match leases.acquire(&[(lease_key.clone(), tok.clone(), l.epoch)], l.ttl).await {
                        Ok(a) if a.first().is_some_and(|a| a.is_held()) => {
                            if let Ok(mut o) = ours.lock() {
                                *o = Some(tok);
                            }
                        }
                        Ok(_) => {
                            tracing::warn!(key = %lease_key, "lease key held by a newer epoch (the database decides)")
                        }
                        Err(e) => tracing::warn!(error = %e, "could not set the lease key (the database lease stands)"),
                    }
                    handler(ctx).await
                }
            }
        };
        // Feature `otel`: the attempt continues the trace of an item in a trace envelope; a bare
        // item keeps the scope the caller may have set around `process`.
        #[cfg(feature = "otel")]
        let done = {
            let origin = super::envelope::origin(item);
            let done = self.retrofit.process(&key, payload, wrapped);
            if origin.get_trace().is_some() { fence::otel::scope(origin, done).await } else { done.await }
        };
        #[cfg(not(feature = "otel"))]
        let done = self.retrofit.process(&key, payload, wrapped).await;
        let tok = ours.lock().ok().and_then(|mut o| o.take());
        if let Some(tok) = tok
            && let Err(e) = self.leases.release(&[(lease_key.clone(), tok)]).await
        {
            tracing::warn!(error = %e, "could not release the lease key (it expires)");
        }
        let disposition = match done.disposition {
            Disposition::Leave => self.settle_unknown(&key, claimed.load(Ordering::SeqCst), &done.detail).await,
            other => other,
        };
        let newer_epoch_confirmed = disposition == Disposition::Leave;
        let mut processed = Processed::new(disposition, done.detail);
        processed.newer_epoch_confirmed = newer_epoch_confirmed;
        processed
    }

    /// The disposition of an item whose attempt ended without a verdict of its own (lease lost,
    /// commit fenced or unknown, claim failed), from what the database says of the job now. A
    /// popped item has no other copy, so it goes back ([`Disposition::Abandon`]) unless the
    /// database settled the job: completed ([`Disposition::Ack`]), dead at this worker's epoch
    /// ([`Disposition::DeadLetter`]), or taken by a newer epoch, whose holder has its own copy
    /// ([`Disposition::Leave`]). When the database cannot be asked, the item goes back and the
    /// fence deduplicates it.
    async fn settle_unknown(&self, key: &JobKey, epoch: i64, detail: &Detail) -> Disposition {
        if epoch == 0 || matches!(detail, Detail::ClaimFailed(_)) {
            // No claim answered: the claim may even have committed unseen. The fence sorts it out.
            return Disposition::Abandon;
        }
        let store = self.retrofit.supervisor().store();
        let limit = self.retrofit.supervisor().config().lease().heartbeat_interval();
        match tokio::time::timeout(limit, store.job(self.retrofit.queue(), key)).await {
            Ok(Ok(Some(job))) => {
                let verdict = match job.state {
                    JobState::Completed => Disposition::Ack,
                    _ if job.epoch > epoch => Disposition::Leave,
                    JobState::Dead => Disposition::DeadLetter(
                        job.last_error.unwrap_or_else(|| format!("job is dead (buried at epoch {})", job.epoch)),
                    ),
                    _ => Disposition::Abandon,
                };
                tracing::info!(%key, epoch, db_epoch = job.epoch, db_state = %job.state, ?verdict, "attempt ended without a verdict; the database decides the item's fate");
                verdict
            }
            Ok(Ok(None)) => Disposition::Abandon,
            Ok(Err(e)) => {
                tracing::warn!(%key, error = %e, "cannot read the job after a lost lease; pushing the item back");
                Disposition::Abandon
            }
            Err(_) => {
                tracing::warn!(%key, ?limit, "reading the job after a lost lease timed out; pushing the item back");
                Disposition::Abandon
            }
        }
    }

    /// For a loop that popped `item` destructively (`BRPOP`): puts back what must run again and
    /// dead-letters what must not. A popped item has no other copy, so it is pushed back unless the
    /// database settled its job: a confirmed commit or a completed job ([`Disposition::Ack`]), a
    /// dead job ([`Disposition::DeadLetter`], moved to [`get_dead_letter_stream`](Self::get_dead_letter_stream)), or a
    /// newer epoch that holds or finished the job from its own copy ([`Disposition::Leave`] as
    /// [`process`](Self::process) answers it, only when the database said so; any other `Leave`
    /// is put back).
    ///
    /// A retry or hold is pushed back after its delay; everything else — a lease lost or
    /// unconfirmed, a commit fenced with no newer holder, a claim or commit whose fate is
    /// unknown, a release at shutdown — at once, and the fence deduplicates it. What Redis does
    /// not take at once (an error, a timeout), and a retry waiting for its delay, stays in the
    /// retrofit's holding area and is sent again with backoff until Redis takes it (a dead
    /// letter is added once however often it is sent): an error from Redis never drops the
    /// item, so this answers `Ok` then.
    ///
    /// It fails only when the fence refused the item because the schema is older than this build
    /// needs ([`Processed::refused`]): the item is put back first (waiting up to the lease
    /// for Redis to take it), then [`RedisError::Refused`] ends your loop through its `?`.
    pub async fn requeue_popped(&self, item: &[u8], done: &Processed) -> Result<(), RedisError> {
        let (route, delay) = match &done.disposition {
            Disposition::Ack => return Ok(()),
            // The database confirmed a newer epoch: its holder has its own copy of the item.
            Disposition::Leave if done.newer_epoch_confirmed => return Ok(()),
            // A `Leave` the database did not confirm (from `Retrofit::process` or
            // `Processed::new`): this may be the only copy, so it goes back.
            Disposition::Leave => (Route::Push, Duration::ZERO),
            Disposition::DeadLetter(reason) => (self.target.dead_letter(reason), Duration::ZERO),
            Disposition::RetryLater(d) | Disposition::Hold(d) => (Route::Push, *d),
            Disposition::Abandon => (Route::Push, Duration::ZERO),
        };
        if delay.is_zero() {
            if let Err(e) = self.target.send(item, &route).await {
                tracing::warn!(error = %e, ?route, "Redis did not take the popped item; it is held and sent again until Redis does");
                self.holding.hold(item.to_vec(), route, Instant::now() + FIRST_PAUSE, 1).await;
            }
        } else {
            self.holding.hold(item.to_vec(), route, Instant::now() + delay, 0).await;
        }
        if let Some(&FenceError::SchemaTooOld { found, required }) = done.refused() {
            // The caller's `?` may end the process next: the item must be back in Redis first.
            let budget = self.retrofit.supervisor().config().lease().get();
            if let Err(e) = self.flush(budget).await {
                tracing::error!(error = %e, "the refused item is not back in Redis yet");
            }
            return Err(RedisError::Refused(FenceError::SchemaTooOld { found, required }));
        }
        Ok(())
    }
}
