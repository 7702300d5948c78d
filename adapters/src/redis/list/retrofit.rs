//! [`ListRetrofit`]: the fence inside a `BRPOP`/`BLMOVE` loop you own, and what it did with one
//! item ([`ListProcessed`]).

use std::future::Future;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::redis::Value;
use fence::{FenceStore, IntoJobResult, JobContext, JobError, JobKey, JobState, Owner, QueueName, SupervisorConfig};

use crate::disposition::Disposition;
use crate::middleware::{Detail, Retrofit};
use crate::redis::conn::{RedisConnections, bounded};
use crate::redis::error::RedisError;
use crate::redis::keys::{sibling_key, token};
use crate::redis::lease::{LeaseKeyHook, LeaseKeys};

use super::ItemKey;

/// What [`ListRetrofit::process`] did with one item.
#[derive(Debug)]
pub struct ListProcessed {
    /// What to do with the item. When the attempt ended without a verdict of its own (lease lost
    /// or unconfirmed, commit fenced or unknown), it is what the database says of the job now:
    /// [`Disposition::Ack`] (completed), [`Disposition::DeadLetter`] (dead),
    /// [`Disposition::Leave`] (a newer epoch holds or finished it) or, in every other case,
    /// [`Disposition::Abandon`] (put the item back now).
    pub disposition: Disposition,
    /// What the fence saw; `None` when the item could not be decoded (then the disposition is
    /// [`Disposition::DeadLetter`] with the reason).
    pub detail: Option<Detail>,
    /// The lease key of the item's job: its identity in Redis (`None` when undecodable).
    pub lease_key: Option<String>,
}

impl ListProcessed {
    /// True when the item is done with (committed, or a duplicate of a completed job).
    pub fn should_ack(&self) -> bool {
        self.disposition == Disposition::Ack
    }
}

/// The fence around a handler inside a list loop you already own (`BRPOP`, `BLMOVE`): the job key
/// comes from the item ([`ItemKey`]), its lease key is set when the attempt starts, renewed on every
/// heartbeat the database confirmed (a [`LeaseKeyHook`] on the supervisor), and released by
/// compare-and-set when the attempt ends.
///
/// A destructive pop has one copy: [`requeue_popped`](Self::requeue_popped) puts the item back
/// unless the database settled its job (committed, done, dead, or a newer epoch holds it). Every
/// Redis call of the fence is bounded ([`command_timeout`](Self::command_timeout)); bound your own
/// blocking read too, as below ([`RedisTimeouts::blocking`](crate::redis::RedisTimeouts::blocking)).
///
/// ```no_run
/// # async fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>) -> Result<(), Box<dyn std::error::Error>> {
/// use brokerfence::redis::{ItemKey, ListRetrofit, RedisConnections};
/// use brokerfence::{LeaseDuration, QueueName, SupervisorConfig};
/// let redis = RedisConnections::connect("redis://127.0.0.1:6379").await?;
/// let config = SupervisorConfig::new(LeaseDuration::from_secs(30)?);
/// let fence = ListRetrofit::new(store, QueueName::new("mail")?, config, &redis, "mail", ItemKey::Split(b'|'));
/// let mut conn = redis.blocking();
/// let block = std::time::Duration::from_secs(5);
/// loop {
///     // your loop, as before, with the blocking read bounded (block time + margin: a stalled
///     // Redis must not hang it for ever; the blocking connection has no response timeout):
///     let mut brpop = brokerfence::redis::client::cmd("BRPOP");
///     brpop.arg("mail").arg(block.as_secs());
///     let read = brpop.query_async::<Option<(String, Vec<u8>)>>(&mut conn);
///     let Ok(popped) = tokio::time::timeout(redis.timeouts().blocking(block), read).await else { continue };
///     let Some((_, item)) = popped? else { continue };
///     let done = fence.process(&item, |ctx| async move { Ok(ctx.payload().to_vec()) }).await;
///     fence.requeue_popped(&item, &done).await?; // puts back what must run again
/// }
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct ListRetrofit {
    retrofit: Retrofit,
    leases: LeaseKeys,
    item_key: ItemKey,
    redis: RedisConnections,
    list: String,
    dead: String,
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
    pub fn new(
        store: Arc<dyn FenceStore>,
        queue: QueueName,
        config: SupervisorConfig,
        redis: &RedisConnections,
        list: impl Into<String>,
        item_key: ItemKey,
    ) -> Self {
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
    ) -> Self {
        let list = list.into();
        let retrofit = Retrofit::with_owner(store, queue, owner, config);
        let leases = LeaseKeys::of_source(redis, &list);
        retrofit.supervisor().add_hook(Arc::new(LeaseKeyHook::new(leases.clone())));
        Self { retrofit, leases, item_key, redis: redis.clone(), dead: sibling_key(&list, ":dead"), list }
    }

    /// The response timeout of this fence's Redis calls (default 2 s): lease keys, the push back
    /// and the dead letter of [`requeue_popped`](Self::requeue_popped). The heartbeat's lease-key
    /// renewals get at most a quarter of the lease ([`LeaseKeys::hint_timeout`]). A call that
    /// times out fails with [`RedisError::Timeout`]. Use the value of your connection's response
    /// timeout, or lower.
    ///
    /// ```no_run
    /// # async fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>, redis: brokerfence::redis::RedisConnections) -> brokerfence::Result<()> {
    /// use std::time::Duration;
    /// use brokerfence::redis::{ItemKey, ListRetrofit};
    /// use brokerfence::{LeaseDuration, QueueName, SupervisorConfig};
    /// let config = SupervisorConfig::new(LeaseDuration::from_secs(30)?);
    /// let fence = ListRetrofit::new(store, QueueName::new("mail")?, config, &redis, "mail", ItemKey::Split(b'|'))
    ///     .command_timeout(Duration::from_millis(500));
    /// assert_eq!(fence.leases().timeout(), Duration::from_millis(500));
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

    /// The dead-letter stream (`{list}:dead`).
    pub fn dead_stream(&self) -> &str {
        &self.dead
    }

    /// Claims the item's job, sets its lease key, runs `handler` under the lease, commits through
    /// the fence, releases the lease key, and says what to do with the item.
    ///
    /// The handler is awaited in place: any `FnOnce` closure, borrowing locals or moving loop
    /// state in (see [`Retrofit::process`]).
    pub async fn process<F, Fut, R>(&self, item: &[u8], handler: F) -> ListProcessed
    where
        F: FnOnce(JobContext) -> Fut,
        Fut: Future<Output = Result<R, JobError>>,
        R: IntoJobResult,
    {
        let (key, payload) = match self.item_key.decode(item) {
            Ok(v) => v,
            Err(reason) => {
                tracing::warn!(%reason, "undecodable list item");
                return ListProcessed { disposition: Disposition::DeadLetter(reason), detail: None, lease_key: None };
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
        ListProcessed { disposition, detail: Some(done.detail), lease_key: Some(lease_key) }
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
    /// dead job ([`Disposition::DeadLetter`], moved to [`dead_stream`](Self::dead_stream)), or a
    /// newer epoch that holds or finished the job from its own copy ([`Disposition::Leave`], which
    /// [`process`](Self::process) answers only when the database said so).
    ///
    /// A retry or hold is pushed back after its delay by a task of this process (an item popped
    /// destructively lives only in memory until then: use [`ReliableList`](super::ReliableList) where that matters).
    /// Everything else — a lease lost or unconfirmed, a commit fenced with no newer holder, a claim
    /// or commit whose fate is unknown, a release at shutdown — is pushed back at once, and the
    /// fence deduplicates it.
    pub async fn requeue_popped(&self, item: &[u8], done: &ListProcessed) -> Result<(), RedisError> {
        let push_now = match &done.disposition {
            Disposition::Ack => return Ok(()),
            Disposition::DeadLetter(reason) => {
                let mut xadd = ::redis::cmd("XADD");
                xadd.arg(&self.dead)
                    .arg("*")
                    .arg("dead.reason")
                    .arg(reason.as_str())
                    .arg("dead.list")
                    .arg(&self.list)
                    .arg("item")
                    .arg(item);
                let mut conn = self.redis.commands();
                let _: Value = bounded("XADD", self.leases.timeout(), xadd.query_async(&mut conn)).await?;
                return Ok(());
            }
            Disposition::RetryLater(d) | Disposition::Hold(d) => Some(*d),
            Disposition::Abandon => None,
            // The database confirmed a newer epoch: its holder has its own copy of the item.
            Disposition::Leave => return Ok(()),
        };
        let push = {
            let (mut conn, list, item, limit) =
                (self.redis.commands(), self.list.clone(), item.to_vec(), self.leases.timeout());
            async move {
                let mut lpush = ::redis::cmd("LPUSH");
                lpush.arg(&list).arg(item);
                bounded("LPUSH", limit, lpush.query_async::<i64>(&mut conn)).await.map(|_| ())
            }
        };
        match push_now {
            None | Some(Duration::ZERO) => push.await,
            Some(delay) => {
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    if let Err(e) = push.await {
                        tracing::error!(error = %e, "could not push a retried item back");
                    }
                });
                Ok(())
            }
        }
    }
}
