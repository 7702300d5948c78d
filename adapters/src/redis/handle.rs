//! [`RedisConn`]: one connection handle for every topology — a single server, a Redis Cluster
//! (MOVED and ASK followed by the client crate), or a master found through Sentinel (followed
//! after a failover) — so that every call of the adapter is written once.

use ::redis::aio::{ConnectionLike, ConnectionManager};
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Cmd, Pipeline, RedisFuture, Value};

use super::sentinel::SentinelConn;

/// Which kind of Redis a [`RedisConnections`](super::RedisConnections) talks to.
///
/// ```no_run
/// # async fn demo() -> Result<(), brokerfence::redis::RedisError> {
/// use brokerfence::redis::{RedisConnections, Topology};
/// let redis = RedisConnections::connect("redis+cluster://10.0.0.1:7000,10.0.0.2:7000").await?;
/// assert_eq!(redis.topology(), Topology::Cluster);
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Topology {
    /// One server (`redis://`, `rediss://`, a socket).
    Single,
    /// A Redis Cluster (`redis+cluster://`): keys live in 16,384 slots spread over the primaries,
    /// and a script's keys must share one slot.
    Cluster,
    /// A master with replicas watched by Sentinel (`redis+sentinel://`): the adapter asks the
    /// sentinels where the master is and follows a failover.
    Sentinel,
}

/// A cheap-to-clone, auto-reconnecting connection to a single server, a cluster, or a Sentinel
/// master. Use it with the client crate's commands as you would a `ConnectionManager`: it
/// implements [`ConnectionLike`].
///
/// ```no_run
/// # async fn demo(redis: brokerfence::redis::RedisConnections) -> Result<(), brokerfence::redis::client::RedisError> {
/// use brokerfence::redis::client;
/// let mut conn = redis.commands();
/// let n: i64 = client::cmd("INCR").arg("{orders}:counter").query_async(&mut conn).await?;
/// assert!(n >= 1);
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisConn(Inner);

#[derive(Clone)]
enum Inner {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
    Sentinel(SentinelConn),
}

impl std::fmt::Debug for RedisConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("RedisConn").field(&self.topology()).finish()
    }
}

impl RedisConn {
    /// The kind of Redis behind this connection.
    pub fn topology(&self) -> Topology {
        match &self.0 {
            Inner::Single(_) => Topology::Single,
            Inner::Cluster(_) => Topology::Cluster,
            Inner::Sentinel(_) => Topology::Sentinel,
        }
    }

    pub(crate) fn sentinel(conn: SentinelConn) -> Self {
        Self(Inner::Sentinel(conn))
    }
}

impl From<ConnectionManager> for RedisConn {
    fn from(conn: ConnectionManager) -> Self {
        Self(Inner::Single(conn))
    }
}

impl From<ClusterConnection> for RedisConn {
    fn from(conn: ClusterConnection) -> Self {
        Self(Inner::Cluster(conn))
    }
}

impl ConnectionLike for RedisConn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match &mut self.0 {
            Inner::Single(c) => c.req_packed_command(cmd),
            Inner::Cluster(c) => c.req_packed_command(cmd),
            Inner::Sentinel(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match &mut self.0 {
            Inner::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Inner::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
            Inner::Sentinel(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match &self.0 {
            Inner::Single(c) => c.get_db(),
            Inner::Cluster(c) => c.get_db(),
            Inner::Sentinel(c) => c.get_db(),
        }
    }
}
