//! Redis (feature `redis`): a lease key per job as a broker-side hint, a Streams consumer-group
//! source, and two ways to fence list consumers.
//!
//! The database epoch decides; Redis only carries hints that follow it:
//!
//! - **Lease key** ([`LeaseKeys`]): `<owner>:<epoch>` under a hash-tagged key, set with
//!   `SET … NX PX`, renewed (`GET == token → PEXPIRE`) and released (`GET == token → DEL`) by Lua
//!   compare-and-set scripts that take `KEYS`/`ARGV` only. Renewal runs for all of a worker's
//!   in-flight jobs in one script call per heartbeat tick, and only for leases the database just
//!   confirmed.
//! - **Streams** ([`StreamSource`]): `XREADGROUP` with a group created idempotently, `XAUTOCLAIM`
//!   for entries idle past the visibility hint, `XCLAIM … JUSTID` on every confirmed heartbeat so a
//!   live job is never auto-claimed (and never for a lease a newer epoch took over), `XACK` only
//!   after a fenced commit, and a dead-letter stream for entries that cannot be decoded or whose
//!   job the database says is dead (a delivery count is only a hint).
//! - **Timeouts** ([`RedisTimeouts`]): every call is bounded; the heartbeat's hints within a
//!   quarter of the lease, so a stalled Redis costs hints, never a database lease.
//! - **Lists**: [`ListRetrofit`] puts the fence around a handler inside a `BRPOP`/`BLMOVE` loop you
//!   already own; [`ReliableList`] is a source that `BLMOVE`s items to a processing list and puts an
//!   item whose lease key lapsed back on the queue.
//!
//! ```no_run
//! # async fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>) -> Result<(), Box<dyn std::error::Error>> {
//! use brokerfence::redis::{RedisConnections, StreamSource};
//! use brokerfence::{Consumer, ConsumerConfig};
//! use brokerfence::{LeaseDuration, QueueName, SupervisorConfig};
//! let redis = RedisConnections::connect("redis://127.0.0.1:6379").await?;
//! let source = StreamSource::new(redis, QueueName::new("orders")?, "orders", "billing")?;
//! let config = ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30)?));
//! let consumer = Consumer::new(source, store, config);
//! consumer.run(|ctx: brokerfence::JobContext| async move { Ok(ctx.payload().to_vec()) }, brokerfence::shutdown_signal()).await?;
//! # Ok(()) }
//! ```

mod conn;
mod error;
mod handle;
mod keys;
mod lease;
mod list;
#[cfg(feature = "postgres")]
mod outbox;
mod reply;
mod scripts;
mod sentinel;
mod stream;
mod timeouts;
mod url;

/// The `redis` client crate this adapter is built on (same version), for your own commands.
pub use ::redis as client;

pub use conn::RedisConnections;
pub use error::RedisError;
pub use handle::{RedisConn, Topology};
pub use keys::{key_slot, lease_key, sibling_key};
// The value of a lease key, for the repository's own tests.
#[doc(hidden)]
pub use keys::token;
pub use lease::{Acquired, LeaseKeyHook, LeaseKeys, Renewed};
pub use list::{ItemKey, ListDelivery, ListRetrofit, ReliableList};

/// `item` in a trace envelope carrying the current span's W3C context (feature `otel`), for an
/// `LPUSH` to a list a [`ReliableList`] or [`ListRetrofit`] consumes: the attempt then continues
/// the producer's trace, as with a stream's `traceparent` field. Outside a traced span the item
/// is returned as it is; an item already in an envelope gets the current context in place of
/// its own (or, outside a span, comes out of it). The consumers unwrap the envelope before [`ItemKey`] decodes the item,
/// so keys and content hashes see the item alone; a consumer older than this version would read
/// the envelope as part of the item, so wrap items only once every consumer of the list runs it.
///
/// ```
/// let item = brokerfence::redis::traced_item(b"order-7|{\"qty\":2}");
/// let (key, payload) = brokerfence::redis::ItemKey::Split(b'|').decode(&item).unwrap();
/// assert_eq!((key.as_str(), payload.as_slice()), ("order-7", &b"{\"qty\":2}"[..]));
/// ```
#[cfg(feature = "otel")]
#[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
pub fn traced_item(item: &[u8]) -> Vec<u8> {
    // An item already in an envelope (a loop passing on what it popped) gets the new context in
    // place of the old: consumers unwrap one envelope.
    let item = list::unwrap_traced(item);
    match fence::otel::TraceContext::current() {
        Some(tc) => list::wrap_traced(item, tc.traceparent(), tc.tracestate()),
        None => item.to_vec(),
    }
}
#[cfg(feature = "postgres")]
pub use outbox::RedisPublisher;
pub use stream::{KeyFrom, StreamDelivery, StreamSource};
pub use timeouts::RedisTimeouts;
