//! Redis Streams consumer groups as a [`Source`].
//!
//! This file holds the source ([`StreamSource`]), its deliveries and its [`Source`] implementation;
//! the Redis calls behind them (the group, reads, autoclaim, reclaim, heartbeats) are in `calls`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use fence::{JobKey, Lease, QueueName};
use tokio::time::Instant;

use super::conn::RedisConnections;
use super::error::RedisError;
use super::handle::Topology;
use super::keys::{check_same_slot, sibling_key};
use super::lease::LeaseKeys;
use super::scripts::SCRIPTS;
use super::timeouts::bounded;
use crate::builder::{debug_some, setters};
use crate::runtime::ReceiveContext;
use crate::source::{Incoming, Source, SourceError};

mod calls;

/// Where the job key of a stream entry comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyFrom {
    /// The entry id (`1700000000000-0`): every entry is its own job.
    EntryId,
    /// A field of the entry, so that an entry a producer sends again is the same job. An entry
    /// without the field (or with a value that is not a valid key) is dead-lettered.
    Field(String),
}

/// The handle on one stream entry: its id, and the lease key of its job.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StreamDelivery {
    id: Arc<str>,
    lease_key: Option<Arc<str>>,
    /// The producer's trace context, from the entry's `traceparent` / `tracestate` fields.
    #[cfg(feature = "otel")]
    trace: Option<Arc<fence::otel::TraceContext>>,
}

impl StreamDelivery {
    /// The producer's trace context (the entry's `traceparent` / `tracestate` fields).
    ///
    /// ```no_run
    /// # fn demo(d: brokerfence::redis::StreamDelivery) {
    /// println!("{:?}", d.trace());
    /// # }
    /// ```
    #[cfg(feature = "otel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
    pub fn trace(&self) -> Option<&fence::otel::TraceContext> {
        self.trace.as_deref()
    }

    /// The entry id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The lease key of the entry's job (none for an entry that could not be decoded).
    pub fn lease_key(&self) -> Option<&str> {
        self.lease_key.as_deref()
    }
}

#[derive(Debug)]
struct State {
    group_ready: bool,
    cursor: String,
    next_autoclaim: Option<Instant>,
    consumer: Option<String>,
    visibility: Duration,
}

/// A consumer-group reader of one stream.
///
/// - The group is created on first use (`XGROUP CREATE … MKSTREAM`; `BUSYGROUP` is fine), and again
///   when the server lost it (a restart without persistence).
/// - `receive`: `XAUTOCLAIM` of entries idle longer than the visibility hint (every
///   [`autoclaim_every`](Self::autoclaim_every)), then `XREADGROUP … BLOCK` for new ones. An entry
///   that cannot be decoded goes to the dead-letter stream with the reason; any other entry goes
///   there only when the database says its job is dead (the delivery count is a hint, see
///   [`max_deliveries`](Self::max_deliveries)), and only once (the move is a script that copies
///   the entry only if its `XACK` acknowledged it).
/// - `extend` (a heartbeat the database confirmed): one script that renews (or takes) each
///   in-flight job's lease key and `XCLAIM … JUSTID`s its entry to this consumer (idle back to 0:
///   no one auto-claims a live job) — only while the lease is the newest Redis knows of, so a
///   stale renewal after a takeover never takes the entry back. It gives up after
///   [`RedisTimeouts::hint`](super::RedisTimeouts::hint) (a quarter of the lease at most): a
///   stalled Redis costs hints, never the database lease.
/// - Every other call is bounded too: short commands by the response timeout, the blocking read
///   by its block time plus a margin ([`RedisTimeouts`](super::RedisTimeouts)).
/// - `ack` (a fenced commit succeeded): `XACK` in batches, lease keys released by compare-and-set.
///   `XACK` does not check the consumer, which is why nothing else ever calls it.
///
/// An entry is a set of fields; the payload is the [`body_field`](Self::body_field) (default
/// `body`), the job key the entry id or a field ([`KeyFrom`]).
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use brokerfence::redis::{KeyFrom, RedisConnections, StreamSource};
/// let redis = RedisConnections::connect("redis://127.0.0.1:6379").await?;
/// let source = StreamSource::new(redis, brokerfence::QueueName::new("orders")?, "orders", "billing")?
///     .key_from(KeyFrom::Field("order_id".into()))
///     .max_deliveries(5)
///     .block(Duration::from_secs(2));
/// assert_eq!(source.get_dead_letter_stream(), "{orders}:dead");
/// # Ok(()) }
/// ```
pub struct StreamSource {
    conns: RedisConnections,
    queue: QueueName,
    stream: String,
    group: String,
    dead: String,
    key_from: KeyFrom,
    body_field: String,
    block: Duration,
    visibility: Option<Duration>,
    autoclaim_every: Duration,
    max_deliveries: i64,
    start_id: String,
    leases: LeaseKeys,
    state: Mutex<State>,
}

impl std::fmt::Debug for StreamSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        debug_some!(f, self: "StreamSource" { queue, stream, group, dead, key_from })
    }
}

impl StreamSource {
    /// Reads `stream` as consumer group `group`; jobs are fenced under `queue`. The consumer name is
    /// the worker's owner id. Dead letters go to `{stream}:dead` (same cluster slot).
    pub fn new(
        conns: RedisConnections,
        queue: QueueName,
        stream: impl Into<String>,
        group: impl Into<String>,
    ) -> Result<Self, RedisError> {
        let (stream, group) = (stream.into(), group.into());
        if stream.is_empty() || group.is_empty() {
            return Err(RedisError::Config("StreamSource::new: the stream and group names must not be empty".into()));
        }
        let leases = LeaseKeys::of_source(&conns, &stream);
        Ok(Self {
            dead: sibling_key(&stream, ":dead"),
            conns,
            queue,
            stream,
            group,
            key_from: KeyFrom::EntryId,
            body_field: "body".into(),
            block: Duration::from_secs(2),
            visibility: None,
            autoclaim_every: Duration::from_secs(1),
            max_deliveries: 10,
            start_id: "0".into(),
            leases,
            state: Mutex::new(State {
                group_ready: false,
                cursor: "0-0".into(),
                next_autoclaim: None,
                consumer: None,
                visibility: Duration::from_secs(30),
            }),
        })
    }

    setters! {
        /// Where job keys come from (default: the entry id).
        pub fn key_from(key_from: KeyFrom) { key_from = key_from }

        /// The field holding the payload (default `body`).
        pub fn body_field(field: impl Into<String>) { body_field = field.into() }

        /// The dead-letter stream (default `{stream}:dead`).
        pub fn dead_letter_stream(key: impl Into<String>) { dead = key.into() }

        /// How long one `XREADGROUP` blocks when nothing is there (default 2 s, at least 1 ms).
        pub fn block(block: Duration) { block = block.max(Duration::from_millis(1)) }

        /// Idle time after which another consumer may auto-claim an entry (default: the lease). Keep it
        /// well above the heartbeat interval (lease/3), or live jobs get auto-claimed (harmlessly: the
        /// database refuses the claim, but it costs a delivery).
        pub fn visibility(visibility: Duration) { visibility = Some(visibility.max(Duration::from_millis(1))) }

        /// How often the `XAUTOCLAIM` sweep runs (default 1 s).
        pub fn autoclaim_every(every: Duration) { autoclaim_every = every }

        /// Deliveries after which an entry is logged as suspicious (default 10). The delivery count is
        /// a hint, like visibility: every auto-claim counts one, including those of an entry held back
        /// by a retry backoff longer than the visibility hint and those of an entry a live holder has,
        /// so it never dead-letters anything. An entry goes to the dead-letter stream only when the
        /// database says its job is dead: its claim answers [`Claim::Dead`](fence::Claim::Dead), or a
        /// fenced failure finds it out of attempts ([`RetryPolicy`](fence::RetryPolicy)), or `retry =
        /// false`; the reason is the database's (the job's last error).
        pub fn max_deliveries(n: u32) { max_deliveries = i64::from(n.max(1)) }

        /// Where a newly created group starts (default `0`: every entry already in the stream; `$`:
        /// only new ones).
        pub fn start_id(id: impl Into<String>) { start_id = id.into() }
    }

    /// The stream key.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// The group.
    pub fn group(&self) -> &str {
        &self.group
    }

    /// The dead-letter stream key (default `{stream}:dead`).
    pub fn get_dead_letter_stream(&self) -> &str {
        &self.dead
    }

    /// The lease keys of this source's jobs.
    pub fn leases(&self) -> &LeaseKeys {
        &self.leases
    }

    /// On a Redis Cluster: the dead-letter stream and the lease keys must share the stream's
    /// slot, since one script touches them together.
    fn check_slots(&self) -> Result<(), RedisError> {
        if self.conns.topology() != Topology::Cluster {
            return Ok(());
        }
        let lease = self.leases.key(&self.queue, &JobKey::new("0-1").map_err(|e| RedisError::Config(e.to_string()))?);
        check_same_slot("StreamSource", &self.stream, &[&self.dead, &lease])
    }
}

#[async_trait]
impl Source for StreamSource {
    type Delivery = StreamDelivery;

    fn queue(&self) -> &QueueName {
        &self.queue
    }

    #[cfg(feature = "otel")]
    fn origin(&self, delivery: &StreamDelivery) -> fence::otel::Origin {
        fence::otel::Origin::new(delivery.trace().cloned()).message_id(delivery.id())
    }

    fn check(&self) -> Result<(), SourceError> {
        self.check_slots().map_err(SourceError::from)
    }

    fn kind(&self) -> &'static str {
        "redis_stream"
    }

    async fn receive(&self, max: usize, ctx: &ReceiveContext) -> Result<Vec<Incoming<StreamDelivery>>, SourceError> {
        let consumer = ctx.owner.as_str().to_owned();
        let visibility = self.visibility.unwrap_or(ctx.lease.get());
        let due = self
            .with_state(|s| {
                s.consumer.get_or_insert_with(|| consumer.clone());
                s.visibility = visibility;
                s.next_autoclaim.is_none_or(|t| Instant::now() >= t)
            })
            .unwrap_or(false);
        if let Err(e) = self.ensure_group().await {
            return Err(e.into());
        }
        let mut raw = Vec::new();
        if due {
            match self.autoclaim(&consumer, max).await {
                Ok(v) => raw = v,
                Err(e) => {
                    self.group_lost(&e);
                    return Err(e.into());
                }
            }
        }
        if raw.len() < max {
            match self.read_new(&consumer, max - raw.len(), raw.is_empty()).await {
                Ok(v) => raw.extend(v.into_iter().map(|e| (e, None))),
                Err(e) => {
                    self.group_lost(&e);
                    if raw.is_empty() {
                        return Err(e.into());
                    }
                    tracing::warn!(error = %e, "XREADGROUP failed; handing on the auto-claimed entries");
                }
            }
        }
        Ok(raw.into_iter().map(|(e, n)| self.decode(e, n)).collect())
    }

    async fn extend(&self, leases: &[(Lease, StreamDelivery)]) -> Result<(), SourceError> {
        self.extend_newest(leases).await.map_err(Into::into)
    }

    async fn lost(&self, leases: &[(Lease, StreamDelivery)]) -> Result<(), SourceError> {
        let keyed: Vec<(String, &Lease)> =
            leases.iter().filter_map(|(l, d)| d.lease_key().map(|k| (k.to_owned(), l))).collect();
        self.leases.release_lost(&keyed).await.map_err(Into::into)
    }

    async fn ack(&self, deliveries: Vec<StreamDelivery>) -> Result<(), SourceError> {
        if deliveries.is_empty() {
            return Ok(());
        }
        let mut xack = ::redis::cmd("XACK");
        xack.arg(&self.stream).arg(&self.group);
        for d in &deliveries {
            xack.arg(d.id());
        }
        let keys: Vec<String> = deliveries.iter().filter_map(|d| d.lease_key().map(str::to_owned)).collect();
        let mut conn = self.conns.commands();
        let (acked, released) = tokio::join!(
            bounded("XACK", self.response(), xack.query_async::<i64>(&mut conn)),
            self.leases.release_held(&keys)
        );
        if let Err(e) = released {
            tracing::warn!(error = %e, "could not release lease keys (they expire)");
        }
        let acked = acked?;
        tracing::debug!(acked, n = deliveries.len(), "entries acknowledged");
        Ok(())
    }

    async fn retry_later(&self, delivery: StreamDelivery, delay: Duration) -> Result<(), SourceError> {
        let (r, ()) = tokio::join!(self.reclaim_after(&delivery, delay), self.release(&delivery));
        r.map_err(Into::into)
    }

    async fn dead_letter(&self, delivery: StreamDelivery, reason: &str) -> Result<(), SourceError> {
        let mut inv = SCRIPTS.stream_dead.prepare_invoke();
        inv.key(&self.stream).key(&self.dead).arg(&self.group).arg(delivery.id()).arg(reason);
        if let Some(k) = delivery.lease_key()
            && let Some(tok) = self.leases.held_token(k)
        {
            inv.key(k).arg(tok);
        }
        let mut conn = self.conns.commands();
        let acked: i64 = bounded("EVALSHA dead-letter", self.response(), inv.invoke_async(&mut conn)).await?;
        if let Some(k) = delivery.lease_key() {
            // The script released it by compare-and-set.
            self.leases.forget(k);
        }
        if acked == 1 {
            tracing::warn!(id = delivery.id(), %reason, dead = %self.dead, "entry dead-lettered");
        } else {
            tracing::info!(id = delivery.id(), %reason, "entry no longer pending (moved or acknowledged before); not moved again");
        }
        Ok(())
    }

    async fn hold(&self, delivery: StreamDelivery, ttl: Duration) -> Result<(), SourceError> {
        self.reclaim_after(&delivery, ttl).await.map_err(Into::into)
    }

    async fn abandon(&self, delivery: StreamDelivery) -> Result<(), SourceError> {
        let (r, ()) = tokio::join!(self.reclaim_after(&delivery, Duration::ZERO), self.release(&delivery));
        r.map_err(Into::into)
    }
}
