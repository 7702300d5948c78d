//! The outbox relay's Redis publisher: `XADD` to a stream, the fence stamp as fields.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use async_trait::async_trait;
use fence::outbox::OutboxRow;

use super::conn::RedisConnections;
use super::handle::Topology;
use super::keys::key_slot;
use super::timeouts::bounded;
use crate::builder::setters;
use crate::outbox::{OUTBOX_ID, PublishError, Published, Publisher};

/// Publishes outbox rows to Redis streams: one `XADD` per row, all rows of a call in one
/// pipeline (no `MULTI`; on a Redis Cluster one pipeline per slot, sent side by side), each
/// bounded by the response timeout of the connections.
///
/// Each row's destination names a stream through [`route`](Self::route). An entry's fields are
/// the fence stamp (`Fence-Queue`, `Fence-Job`, `Fence-Epoch`, `Fence-Owner`, see
/// [`brokerfence::wire`](fence::wire)), [`OUTBOX_ID`], and the payload under the body field (default `body`, the
/// field [`StreamSource`](super::StreamSource) reads). A pipeline that fails or times out counts
/// as not accepted for all its rows, even though some `XADD`s may have run: those rows are sent
/// again in a later round (at least once).
///
/// ```no_run
/// # async fn demo(fence: brokerfence::PgFence) -> Result<(), brokerfence::redis::RedisError> {
/// use std::sync::Arc;
/// use brokerfence::outbox::{OutboxRelay, RelayConfig};
/// use brokerfence::redis::{RedisConnections, RedisPublisher};
/// let redis = RedisConnections::connect("redis://127.0.0.1:6379").await?;
/// let publisher = RedisPublisher::new(redis).route("audit", "audit-events");
/// let relay = OutboxRelay::new(fence, RelayConfig::default()).publisher(Arc::new(publisher));
/// # let _ = relay; Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct RedisPublisher {
    conns: RedisConnections,
    routes: HashMap<String, String>,
    body_field: String,
}

impl RedisPublisher {
    /// A publisher with no routes.
    pub fn new(conns: RedisConnections) -> Self {
        Self { conns, routes: HashMap::new(), body_field: "body".into() }
    }

    /// Sends rows of `destination` to the stream `stream`.
    pub fn route(mut self, destination: impl Into<String>, stream: impl Into<String>) -> Self {
        self.routes.insert(destination.into(), stream.into());
        self
    }

    setters! {
        /// The field that carries the payload (default `body`).
        pub fn body_field(field: impl Into<String>) { body_field = field.into() }
    }

    fn limit(&self) -> Duration {
        self.conns.get_timeouts().get_response()
    }
}

#[async_trait]
impl Publisher for RedisPublisher {
    fn serves(&self, destination: &str) -> bool {
        self.routes.contains_key(destination)
    }

    async fn publish(&self, rows: &[OutboxRow]) -> Result<Published, PublishError> {
        let mut out = Published::default();
        // On a cluster a pipeline must stay in one slot: one pipeline per slot, sent side by side.
        let cluster = self.conns.topology() == Topology::Cluster;
        let mut batches: BTreeMap<u16, (::redis::Pipeline, Vec<i64>)> = BTreeMap::new();
        for row in rows {
            let Some(stream) = self.routes.get(&row.destination) else {
                out.failed.push((row.id, PublishError::NoRoute(row.destination.clone())));
                continue;
            };
            let slot = if cluster { key_slot(stream.as_bytes()) } else { 0 };
            let (pipe, ids) = batches.entry(slot).or_insert_with(|| (::redis::pipe(), Vec::new()));
            let cmd = pipe.cmd("XADD").arg(stream).arg("*");
            for (name, value) in row.to_headers() {
                cmd.arg(name).arg(value);
            }
            cmd.arg(OUTBOX_ID).arg(row.id).arg(&self.body_field).arg(&row.payload[..]);
            ids.push(row.id);
        }
        let limit = self.limit();
        let sends = batches.into_values().map(|(pipe, ids)| {
            let mut conn = self.conns.commands();
            async move {
                let answer: Result<Vec<String>, _> = bounded("XADD", limit, pipe.query_async(&mut conn)).await;
                (ids, answer)
            }
        });
        for (ids, answer) in futures::future::join_all(sends).await {
            match answer {
                Ok(entry_ids) if entry_ids.len() == ids.len() => out.accepted.extend(ids),
                Ok(entry_ids) => {
                    let why = format!("pipeline answered {} entry ids for {} XADDs", entry_ids.len(), ids.len());
                    out.failed.extend(ids.into_iter().map(|id| (id, PublishError::Broker(why.clone()))));
                }
                Err(super::RedisError::Timeout { after, .. }) => {
                    out.failed.extend(ids.into_iter().map(|id| (id, PublishError::Timeout(after))));
                }
                Err(e) => {
                    let why = e.to_string();
                    out.failed.extend(ids.into_iter().map(|id| (id, PublishError::Broker(why.clone()))));
                }
            }
        }
        Ok(out)
    }
}
