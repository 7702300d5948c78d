//! Lists: the fence inside a `BRPOP`/`BLMOVE` loop you own ([`ListRetrofit`]), and a reliable-list
//! source ([`ReliableList`]).
//!
//! This file holds the reliable-list source ([`ReliableList`]) and its deliveries; how an item
//! maps to a job is in `item_key`, the retrofit for a loop you own in `retrofit`.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::redis::Value;
use async_trait::async_trait;
use fence::{Lease, QueueName};
use tokio::time::Instant;

use super::conn::RedisConnections;
use super::error::RedisError;
use super::handle::Topology;
use super::keys::{check_same_slot, sibling_key};
use super::lease::LeaseKeys;
use super::reply;
use super::scripts::SCRIPTS;
use super::timeouts::bounded;
use crate::builder::{debug_some, setters};
use crate::runtime::ReceiveContext;
use crate::source::{DeadLettered, Incoming, Source, SourceError};

mod envelope;
mod holding;
mod item_key;
mod retrofit;

#[cfg(feature = "otel")]
pub(crate) use envelope::{unwrap as unwrap_traced, wrap as wrap_traced};
pub use item_key::ItemKey;
pub use retrofit::ListRetrofit;

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
    /// The list's reap count at the previous pass (`None` before the first).
    reap_count: Option<i64>,
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
/// assert_eq!(source.get_processing(), "{mail}:processing");
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
    /// How many times any reaper put items back (`{list}:reaped`).
    reap_count: String,
    item_key: ItemKey,
    leases: LeaseKeys,
    state: Mutex<ListState>,
    block: Duration,
    reap_every: Duration,
    reap_scan: usize,
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
            return Err(RedisError::Config("ReliableList::new: the list name must not be empty".into()));
        }
        Ok(Self {
            leases: LeaseKeys::of_source(&conns, &list),
            processing: sibling_key(&list, ":processing"),
            reap_count: sibling_key(&list, ":reaped"),
            dead: sibling_key(&list, ":dead"),
            conns,
            queue,
            list,
            item_key,
            block: Duration::from_secs(2),
            reap_every: Duration::from_secs(1),
            reap_scan: 256,
            state: Mutex::new(ListState {
                next_reap: None,
                suspects: HashSet::new(),
                reap_count: None,
                lease: Duration::from_secs(30),
            }),
        })
    }

    setters! {
        /// The processing list (default `{list}:processing`). Keep it in the queue's cluster slot.
        pub fn processing(key: impl Into<String>) { processing = key.into() }

        /// The dead-letter stream (default `{list}:dead`).
        pub fn dead_letter_stream(key: impl Into<String>) { dead = key.into() }

        /// How long one `BLMOVE` blocks when the queue is empty (default 2 s, at least 10 ms).
        pub fn block(block: Duration) { block = block.max(Duration::from_millis(10)) }

        /// How often the reaper runs (default 1 s), and how many of the oldest processing items one
        /// pass looks at (default 256).
        pub fn reap_every(every: Duration, scan: usize) { reap_every = every; reap_scan = scan.max(1) }
    }

    /// The queue list.
    pub fn list(&self) -> &str {
        &self.list
    }

    /// The processing list (default `{list}:processing`).
    pub fn get_processing(&self) -> &str {
        &self.processing
    }

    /// The dead-letter stream (default `{list}:dead`).
    pub fn get_dead_letter_stream(&self) -> &str {
        &self.dead
    }

    /// The lease keys of this source's jobs.
    pub fn leases(&self) -> &LeaseKeys {
        &self.leases
    }

    fn response(&self) -> Duration {
        self.conns.get_timeouts().get_response()
    }

    fn lease_key_of(&self, item: &[u8]) -> String {
        match self.item_key.lease_job(item) {
            Some(k) => self.leases.key(&self.queue, &k),
            // Unreachable in practice (a content hash is always a valid key); keep a stable name.
            None => sibling_key(&self.list, ":lease:invalid"),
        }
    }

    /// One reaper pass: items of the processing list seen without a lease key on this pass and the
    /// previous one go back on the queue, unless any reaper (of any worker) put an item back in
    /// between: the value may then be another copy, taken again and not yet reserved, and it is
    /// only suspected again. Returns how many went back.
    pub async fn reap(&self) -> Result<usize, RedisError> {
        let scan = i64::try_from(self.reap_scan).unwrap_or(i64::MAX);
        let mut lrange = ::redis::cmd("LRANGE");
        lrange.arg(&self.processing).arg(-scan).arg(-1);
        let v: Value = bounded("LRANGE", self.response(), lrange.query_async(&mut self.conns.commands())).await?;
        let items = reply::bulks(v).map_err(|e| RedisError::reply("LRANGE", e))?;
        let (suspects, count) = self.state.lock().map(|s| (s.suspects.clone(), s.reap_count)).unwrap_or_default();
        if items.is_empty() {
            if let Ok(mut s) = self.state.lock() {
                s.suspects.clear();
            }
            return Ok(0);
        }
        let mut inv = SCRIPTS.list_reap.prepare_invoke();
        inv.key(&self.processing).key(&self.list).key(&self.reap_count);
        for item in &items {
            inv.key(self.lease_key_of(item)).arg(item.as_slice());
        }
        for item in &items {
            inv.arg(if suspects.contains(item) { "1" } else { "0" });
        }
        inv.arg(count.map_or_else(|| "none".to_owned(), |c| c.to_string()));
        let v: Value = bounded("EVALSHA reap", self.response(), inv.invoke_async(&mut self.conns.commands())).await?;
        let mut codes = reply::ints(v).map_err(|e| RedisError::reply("EVALSHA reap", e))?;
        let count = codes.pop().ok_or_else(|| RedisError::reply("EVALSHA reap", "no reap count"))?;
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
            s.reap_count = Some(count);
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
            let limit = self.conns.get_timeouts().blocking(self.block);
            let v: Value = bounded("BLMOVE", limit, blmove.query_async(&mut self.conns.blocking())).await?;
            items.extend(reply::bytes(v));
        }
        Ok(items)
    }
}

impl std::fmt::Debug for ReliableList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        debug_some!(f, self: "ReliableList" { queue, list, processing, dead, item_key })
    }
}

#[async_trait]
impl Source for ReliableList {
    type Delivery = ListDelivery;

    fn queue(&self) -> &QueueName {
        &self.queue
    }

    fn check(&self) -> Result<(), SourceError> {
        if self.conns.topology() != Topology::Cluster {
            return Ok(());
        }
        let lease = self.lease_key_of(b"");
        check_same_slot("ReliableList", &self.list, &[&self.processing, &self.dead, &self.reap_count, &lease])
            .map_err(SourceError::from)
    }

    fn kind(&self) -> &'static str {
        "redis_list"
    }

    #[cfg(feature = "otel")]
    fn origin(&self, delivery: &ListDelivery) -> fence::otel::Origin {
        envelope::origin(delivery.item())
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
        inv.key(&self.processing).key(&self.list).key(delivery.lease_key()).key(&self.reap_count);
        inv.arg(delivery.item()).arg(tok);
        let _: i64 = bounded("EVALSHA requeue", self.response(), inv.invoke_async(&mut self.conns.commands())).await?;
        Ok(())
    }

    async fn dead_letter(&self, delivery: ListDelivery, reason: &str) -> Result<(), SourceError> {
        self.dead_letter_once(delivery, reason).await.map(drop)
    }

    /// `Moved` when this call took the item out of the processing list and added it to the
    /// dead-letter stream; `AlreadyMoved` when the item was no longer there (moved by an earlier
    /// call, or reaped back to the queue): nothing was added, so `dead_letters` does not count it.
    async fn dead_letter_once(&self, delivery: ListDelivery, reason: &str) -> Result<DeadLettered, SourceError> {
        let tok = self.leases.forget(delivery.lease_key()).unwrap_or_default();
        let mut inv = SCRIPTS.list_dead.prepare_invoke();
        inv.key(&self.processing)
            .key(&self.dead)
            .key(delivery.lease_key())
            .arg(delivery.item())
            .arg(tok)
            .arg(reason)
            .arg(&self.list);
        let moved: i64 =
            bounded("EVALSHA list dead-letter", self.response(), inv.invoke_async(&mut self.conns.commands())).await?;
        if moved == 1 {
            tracing::warn!(%reason, dead = %self.dead, "item dead-lettered");
            Ok(DeadLettered::Moved)
        } else {
            // Moved by an earlier call, or no longer ours to move (reaped back to the queue).
            tracing::debug!(%reason, "item not in the processing list: nothing dead-lettered");
            Ok(DeadLettered::AlreadyMoved)
        }
    }
}
