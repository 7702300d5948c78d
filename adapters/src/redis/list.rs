//! Lists: the fence inside a `BRPOP`/`BLMOVE` loop you own ([`ListRetrofit`]), and a reliable-list
//! source ([`ReliableList`]).

use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::redis::Value;
use async_trait::async_trait;
use fence::{
    FenceStore, IntoJobResult, JobContext, JobError, JobKey, JobState, Lease, Owner, QueueName, SupervisorConfig,
};
use tokio::time::Instant;

use super::conn::{RedisConnections, bounded};
use super::error::RedisError;
use super::keys::{sibling_key, token};
use super::lease::{LeaseKeyHook, LeaseKeys};
use super::reply;
use super::scripts::SCRIPTS;
use crate::disposition::Disposition;
use crate::middleware::{Detail, Retrofit};
use crate::runtime::ReceiveContext;
use crate::source::{Incoming, Source, SourceError};

type DecodeFn = dyn Fn(&[u8]) -> Result<(JobKey, Vec<u8>), String> + Send + Sync;

/// How a list item maps to a job key and a payload. Lists carry no message id, so the identity
/// must come from the item itself, and there is no default: [`ReliableList::new`] and
/// [`ListRetrofit::new`] ask for one, because each choice says something different about two
/// identical items.
///
/// The job key is what deduplicates: a second item with the key of a completed job is acknowledged
/// as a duplicate without running, for as long as the completed job's row is kept (the
/// deduplication window); once that row is pruned, the same key is a new job.
/// - [`ContentHash`](Self::ContentHash): identical items are **one** job. Right for items that are
///   idempotent commands ("recompute report 7"); wrong for events that may repeat ("+1 page view"):
///   the second one is dropped as a duplicate while the first is remembered.
/// - [`Split`](Self::Split) / [`Custom`](Self::Custom): the producer names the job (an order id,
///   a UUID per event): identical payloads under different keys are different jobs, and a
///   redelivery of the same item (a put-back after a crash) is recognised.
///
/// ```
/// use brokerfence::redis::ItemKey;
/// let (key, payload) = ItemKey::Split(b'|').decode(b"order-7|{\"qty\":2}").unwrap();
/// assert_eq!(key.as_str(), "order-7");
/// assert_eq!(payload, b"{\"qty\":2}");
/// let (key, payload) = ItemKey::ContentHash.decode(b"hello").unwrap();
/// assert_eq!(key.as_str(), "sha1:aaf4c61ddcc5e8a2dabede0f3b482cd9aea9434d");
/// assert_eq!(payload, b"hello");
/// assert!(ItemKey::Split(b'|').decode(b"no separator").is_err());
/// ```
#[derive(Clone)]
pub enum ItemKey {
    /// `sha1:<hex>` of the whole item, which is also the payload: identical items are one job
    /// (within the deduplication window; see the type's docs).
    ContentHash,
    /// The bytes before the first separator are the key, the rest is the payload.
    Split(u8),
    /// Your own decoding: key and payload, or why the item cannot be used (it is dead-lettered).
    Custom(Arc<DecodeFn>),
}

impl std::fmt::Debug for ItemKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ItemKey::ContentHash => f.write_str("ContentHash"),
            ItemKey::Split(b) => f.debug_tuple("Split").field(&char::from(*b)).finish(),
            ItemKey::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

fn content_key(item: &[u8]) -> String {
    format!("sha1:{}", sha1_smol::Sha1::from(item).digest())
}

impl ItemKey {
    /// The job key and payload of `item`, or why it cannot be decoded.
    pub fn decode(&self, item: &[u8]) -> Result<(JobKey, Vec<u8>), String> {
        match self {
            ItemKey::ContentHash => {
                let key = JobKey::new(content_key(item)).map_err(|e| e.to_string())?;
                Ok((key, item.to_vec()))
            }
            ItemKey::Split(sep) => {
                let at = item
                    .iter()
                    .position(|b| b == sep)
                    .ok_or_else(|| format!("item has no {:?} separator before its payload", char::from(*sep)))?;
                let key = JobKey::from_bytes(&item[..at]).map_err(|e| format!("item has no usable job key: {e}"))?;
                Ok((key, item[at + 1..].to_vec()))
            }
            ItemKey::Custom(f) => f(item),
        }
    }

    /// The job key used for `item`'s lease key: its own, or (undecodable) its content hash.
    fn lease_job(&self, item: &[u8]) -> Option<JobKey> {
        match self.decode(item) {
            Ok((k, _)) => Some(k),
            Err(_) => JobKey::new(content_key(item)).ok(),
        }
    }
}

/// The handle on one list item taken by a [`ReliableList`]: the item itself (list entries have no
/// id; it is removed from the processing list by value) and its lease key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ListDelivery {
    item: Arc<[u8]>,
    lease_key: Arc<str>,
}

impl ListDelivery {
    /// The item as it sits in the list.
    pub fn item(&self) -> &[u8] {
        &self.item
    }

    /// Its lease key: the delivery's identity in Redis.
    pub fn lease_key(&self) -> &str {
        &self.lease_key
    }
}

#[derive(Debug)]
struct ListState {
    next_reap: Option<Instant>,
    suspects: HashSet<Vec<u8>>,
    lease: Duration,
}

/// A reliable list: items move atomically from the queue list to a processing list
/// (`BLMOVE queue processing RIGHT LEFT`), and each gets a lease key at once (a reservation that the
/// claimed epoch takes over on the first confirmed heartbeat). Nothing leaves the processing list
/// but through a fenced outcome:
///
/// - committed (or a duplicate of a completed job): removed;
/// - failed, to retry: its lease key is shortened to the backoff;
/// - undecodable or dead: moved to the dead-letter stream with the reason;
/// - released at shutdown: pushed back on the queue at once.
///
/// A reaper in every consumer (one script call every [`reap_every`](Self::reap_every)) puts back on
/// the queue any item of the processing list whose lease key lapsed — a crashed or stalled worker's,
/// a failed attempt's after its backoff — once it saw it without a key on two passes in a row (so an
/// item just moved, whose key is being set, is never taken).
///
/// Producers `LPUSH` to the queue list.
///
/// ```no_run
/// # async fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>) -> Result<(), Box<dyn std::error::Error>> {
/// use brokerfence::redis::{ItemKey, RedisConnections, ReliableList};
/// use brokerfence::{Consumer, ConsumerConfig};
/// use brokerfence::{LeaseDuration, QueueName, SupervisorConfig};
/// let redis = RedisConnections::connect("redis://127.0.0.1:6379").await?;
/// let source = ReliableList::new(redis, QueueName::new("mail")?, "mail", ItemKey::Split(b'|'))?;
/// assert_eq!(source.processing_list(), "{mail}:processing");
/// let consumer = Consumer::new(source, store, ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30)?)));
/// consumer.run(|ctx: brokerfence::JobContext| async move { Ok(ctx.payload().to_vec()) }, brokerfence::shutdown_signal()).await?;
/// # Ok(()) }
/// ```
pub struct ReliableList {
    conns: RedisConnections,
    queue: QueueName,
    list: String,
    processing: String,
    dead: String,
    item_key: ItemKey,
    block: Duration,
    reap_every: Duration,
    reap_scan: usize,
    leases: LeaseKeys,
    state: Mutex<ListState>,
}

impl std::fmt::Debug for ReliableList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReliableList")
            .field("queue", &self.queue)
            .field("list", &self.list)
            .field("processing", &self.processing)
            .field("dead", &self.dead)
            .field("item_key", &self.item_key)
            .finish_non_exhaustive()
    }
}

impl ReliableList {
    /// Takes items from `list`; jobs are fenced under `queue`, each item's job key and payload
    /// taken by `item_key` (see [`ItemKey`] for what each choice means for identical items). The
    /// processing list is `{list}:processing`, dead letters go to the stream `{list}:dead` (same
    /// cluster slot).
    pub fn new(
        conns: RedisConnections,
        queue: QueueName,
        list: impl Into<String>,
        item_key: ItemKey,
    ) -> Result<Self, RedisError> {
        let list = list.into();
        if list.is_empty() {
            return Err(RedisError::Config("list name must not be empty".into()));
        }
        Ok(Self {
            leases: LeaseKeys::new(conns.commands(), list.clone()).with_timeout(conns.timeouts().response_timeout()),
            processing: sibling_key(&list, ":processing"),
            dead: sibling_key(&list, ":dead"),
            conns,
            queue,
            list,
            item_key,
            block: Duration::from_secs(2),
            reap_every: Duration::from_secs(1),
            reap_scan: 256,
            state: Mutex::new(ListState { next_reap: None, suspects: HashSet::new(), lease: Duration::from_secs(30) }),
        })
    }

    /// The processing list (default `{list}:processing`). Keep it in the queue's cluster slot.
    pub fn processing(mut self, key: impl Into<String>) -> Self {
        self.processing = key.into();
        self
    }

    /// The dead-letter stream (default `{list}:dead`).
    pub fn dead_letter_stream(mut self, key: impl Into<String>) -> Self {
        self.dead = key.into();
        self
    }

    /// How long one `BLMOVE` blocks when the queue is empty (default 2 s, at least 10 ms).
    pub fn block(mut self, block: Duration) -> Self {
        self.block = block.max(Duration::from_millis(10));
        self
    }

    /// How often the reaper runs (default 1 s), and how many of the oldest processing items one
    /// pass looks at (default 256).
    pub fn reap_every(mut self, every: Duration, scan: usize) -> Self {
        self.reap_every = every;
        self.reap_scan = scan.max(1);
        self
    }

    /// The queue list.
    pub fn list(&self) -> &str {
        &self.list
    }

    /// The processing list.
    pub fn processing_list(&self) -> &str {
        &self.processing
    }

    /// The dead-letter stream.
    pub fn dead_stream(&self) -> &str {
        &self.dead
    }

    /// The lease keys of this source's jobs.
    pub fn leases(&self) -> &LeaseKeys {
        &self.leases
    }

    fn response(&self) -> Duration {
        self.conns.timeouts().response_timeout()
    }

    fn lease_key_of(&self, item: &[u8]) -> String {
        match self.item_key.lease_job(item) {
            Some(k) => self.leases.key(&self.queue, &k),
            // Unreachable in practice (a content hash is always a valid key); keep a stable name.
            None => sibling_key(&self.list, ":lease:invalid"),
        }
    }

    /// One reaper pass: items of the processing list seen without a lease key on this pass and the
    /// previous one go back on the queue. Returns how many went back.
    pub async fn reap(&self) -> Result<usize, RedisError> {
        let scan = i64::try_from(self.reap_scan).unwrap_or(i64::MAX);
        let mut lrange = ::redis::cmd("LRANGE");
        lrange.arg(&self.processing).arg(-scan).arg(-1);
        let v: Value = bounded("LRANGE", self.response(), lrange.query_async(&mut self.conns.commands())).await?;
        let items = reply::bulks(v).map_err(|e| RedisError::reply("LRANGE", e))?;
        let suspects = self.state.lock().map(|s| s.suspects.clone()).unwrap_or_default();
        if items.is_empty() {
            if let Ok(mut s) = self.state.lock() {
                s.suspects.clear();
            }
            return Ok(0);
        }
        let mut inv = SCRIPTS.list_reap.prepare_invoke();
        inv.key(&self.processing).key(&self.list);
        for item in &items {
            inv.key(self.lease_key_of(item)).arg(item.as_slice());
        }
        for item in &items {
            inv.arg(if suspects.contains(item) { "1" } else { "0" });
        }
        let v: Value = bounded("EVALSHA reap", self.response(), inv.invoke_async(&mut self.conns.commands())).await?;
        let codes = reply::ints(v).map_err(|e| RedisError::reply("EVALSHA reap", e))?;
        let mut next = HashSet::new();
        let mut reaped = 0;
        for (item, code) in items.into_iter().zip(codes) {
            match code {
                1 => {
                    next.insert(item);
                }
                2 => reaped += 1,
                _ => {}
            }
        }
        if let Ok(mut s) = self.state.lock() {
            s.suspects = next;
        }
        if reaped > 0 {
            tracing::info!(reaped, list = %self.list, "items whose lease lapsed went back to the queue");
        }
        Ok(reaped)
    }

    async fn take(&self, max: usize) -> Result<Vec<Vec<u8>>, RedisError> {
        let mut take = SCRIPTS.list_take.prepare_invoke();
        take.key(&self.list).key(&self.processing).arg(max);
        let v: Value = bounded("EVALSHA take", self.response(), take.invoke_async(&mut self.conns.commands())).await?;
        let mut items = reply::bulks(v).map_err(|e| RedisError::reply("EVALSHA take", e))?;
        if items.is_empty() {
            let mut blmove = ::redis::cmd("BLMOVE");
            blmove
                .arg(&self.list)
                .arg(&self.processing)
                .arg("RIGHT")
                .arg("LEFT")
                .arg(format!("{:.3}", self.block.as_secs_f64()));
            let limit = self.conns.timeouts().blocking(self.block);
            let v: Value = bounded("BLMOVE", limit, blmove.query_async(&mut self.conns.blocking())).await?;
            items.extend(reply::bytes(v));
        }
        Ok(items)
    }
}

#[async_trait]
impl Source for ReliableList {
    type Delivery = ListDelivery;

    fn queue(&self) -> &QueueName {
        &self.queue
    }

    fn kind(&self) -> &'static str {
        "redis_list"
    }

    async fn receive(&self, max: usize, ctx: &ReceiveContext) -> Result<Vec<Incoming<ListDelivery>>, SourceError> {
        let lease = ctx.lease.get();
        let due = self
            .state
            .lock()
            .map(|mut s| {
                s.lease = lease;
                let due = s.next_reap.is_none_or(|t| Instant::now() >= t);
                if due {
                    s.next_reap = Some(Instant::now() + self.reap_every);
                }
                due
            })
            .unwrap_or(false);
        if due && let Err(e) = self.reap().await {
            tracing::warn!(error = %e, "reaper pass failed");
        }
        let items = self.take(max).await?;
        let mut out = Vec::with_capacity(items.len());
        let mut reserve = Vec::new();
        for item in items {
            let lease_key: Arc<str> = Arc::from(self.lease_key_of(&item));
            let delivery = ListDelivery { item: Arc::from(item.as_slice()), lease_key: lease_key.clone() };
            match self.item_key.decode(&item) {
                Ok((key, payload)) => {
                    reserve.push(lease_key.to_string());
                    out.push(Incoming::Unclaimed { delivery, key, payload });
                }
                Err(reason) => out.push(Incoming::Malformed { delivery, reason }),
            }
        }
        if let Err(e) = self.leases.reserve(&reserve, &ctx.owner, lease).await {
            // The items are safe in the processing list; the reaper returns any that stay keyless.
            tracing::warn!(error = %e, "could not reserve lease keys");
        }
        Ok(out)
    }

    async fn extend(&self, leases: &[(Lease, ListDelivery)]) -> Result<(), SourceError> {
        let keyed: Vec<(String, &Lease)> = leases.iter().map(|(l, d)| (d.lease_key().to_owned(), l)).collect();
        self.leases.confirm(&keyed).await.map_err(Into::into)
    }

    async fn lost(&self, leases: &[(Lease, ListDelivery)]) -> Result<(), SourceError> {
        let keyed: Vec<(String, &Lease)> = leases.iter().map(|(l, d)| (d.lease_key().to_owned(), l)).collect();
        self.leases.release_lost(&keyed).await.map_err(Into::into)
    }

    async fn ack(&self, deliveries: Vec<ListDelivery>) -> Result<(), SourceError> {
        if deliveries.is_empty() {
            return Ok(());
        }
        let tokens: Vec<String> =
            deliveries.iter().map(|d| self.leases.forget(d.lease_key()).unwrap_or_default()).collect();
        let mut inv = SCRIPTS.list_ack.prepare_invoke();
        inv.key(&self.processing);
        for d in &deliveries {
            inv.key(d.lease_key()).arg(d.item());
        }
        for t in &tokens {
            inv.arg(t.as_str());
        }
        let removed: i64 =
            bounded("EVALSHA list ack", self.response(), inv.invoke_async(&mut self.conns.commands())).await?;
        tracing::debug!(removed, n = deliveries.len(), "items acknowledged");
        Ok(())
    }

    async fn retry_later(&self, delivery: ListDelivery, delay: Duration) -> Result<(), SourceError> {
        // The item stays in the processing list; when its lease key lapses the reaper returns it.
        self.leases.shorten(delivery.lease_key(), delay).await.map(|_| ()).map_err(Into::into)
    }

    async fn hold(&self, delivery: ListDelivery, ttl: Duration) -> Result<(), SourceError> {
        self.leases.shorten(delivery.lease_key(), ttl).await.map(|_| ()).map_err(Into::into)
    }

    async fn abandon(&self, delivery: ListDelivery) -> Result<(), SourceError> {
        let tok = self.leases.forget(delivery.lease_key()).unwrap_or_default();
        let mut inv = SCRIPTS.list_requeue.prepare_invoke();
        inv.key(&self.processing).key(&self.list).key(delivery.lease_key()).arg(delivery.item()).arg(tok);
        let _: i64 = bounded("EVALSHA requeue", self.response(), inv.invoke_async(&mut self.conns.commands())).await?;
        Ok(())
    }

    async fn dead_letter(&self, delivery: ListDelivery, reason: &str) -> Result<(), SourceError> {
        let tok = self.leases.forget(delivery.lease_key()).unwrap_or_default();
        let mut inv = SCRIPTS.list_dead.prepare_invoke();
        inv.key(&self.processing)
            .key(&self.dead)
            .key(delivery.lease_key())
            .arg(delivery.item())
            .arg(tok)
            .arg(reason)
            .arg(&self.list);
        let _: i64 =
            bounded("EVALSHA list dead-letter", self.response(), inv.invoke_async(&mut self.conns.commands())).await?;
        tracing::warn!(%reason, dead = %self.dead, "item dead-lettered");
        Ok(())
    }
}

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
/// blocking read too, as below ([`RedisTimeouts::blocking`](super::RedisTimeouts::blocking)).
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
    /// ([`RedisTimeouts::response`](super::RedisTimeouts::response), default 2 s; change it with
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
        let leases = LeaseKeys::new(redis.commands(), list.clone()).with_timeout(redis.timeouts().response_timeout());
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
    /// destructively lives only in memory until then: use [`ReliableList`] where that matters).
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
