//! The two connections a Redis source needs: one for short commands (heartbeat scripts, acks),
//! one for blocking reads. A blocked `XREADGROUP … BLOCK` or `BLMOVE` holds its connection on the
//! server, so sharing it would delay every heartbeat by up to the block time.
//!
//! Every call this adapter makes is bounded ([`RedisTimeouts`]): a stalled Redis costs hints and
//! reads, never a database lease, and nothing waits on it for ever.
//!
//! The pair is opened from one URL ([`RedisConnections::connect`]) for a single server, a Redis
//! Cluster or a Sentinel master (the forms: [`RedisConnections::connect_with`]).

use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::cluster::{ClusterClient, ClusterClientBuilder, ClusterConfig};

use super::error::RedisError;
use super::handle::{RedisConn, Topology};
use super::sentinel::SentinelConn;
use super::timeouts::{RedisTimeouts, bounded};
use super::url::Target;
use crate::builder::setters;

/// A pair of auto-reconnecting connections to one Redis server, and the timeouts the sources
/// built on them apply ([`RedisTimeouts`]).
///
/// ```no_run
/// # async fn demo() -> Result<(), brokerfence::redis::RedisError> {
/// let redis = brokerfence::redis::RedisConnections::connect("redis://127.0.0.1:6379").await?;
/// let mut conn = redis.commands();
/// let pong: String = brokerfence::redis::client::cmd("PING").query_async(&mut conn).await
///     .map_err(|e| brokerfence::redis::RedisError::Command { command: "PING", source: e })?;
/// assert_eq!(pong, "PONG");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisConnections {
    commands: RedisConn,
    blocking: RedisConn,
    timeouts: RedisTimeouts,
}

impl std::fmt::Debug for RedisConnections {
    // Never prints the URL: it may carry a password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConnections")
            .field("topology", &self.topology())
            .field("timeouts", &self.timeouts)
            .finish_non_exhaustive()
    }
}

impl RedisConnections {
    /// Connects both connections to `url` with the default [`RedisTimeouts`]. Both reconnect by
    /// themselves after the server restarts. The URL forms: [`connect_with`](Self::connect_with).
    pub async fn connect(url: &str) -> Result<Self, RedisError> {
        Self::connect_with(url, RedisTimeouts::default()).await
    }

    /// Like [`connect`](Self::connect) with your timeouts.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), brokerfence::redis::RedisError> {
    /// use std::time::Duration;
    /// use brokerfence::redis::{RedisConnections, RedisTimeouts};
    /// let timeouts = RedisTimeouts::default().response(Duration::from_millis(500));
    /// let redis = RedisConnections::connect_with("redis://127.0.0.1:6379", timeouts).await?;
    /// assert_eq!(redis.get_timeouts().get_response(), Duration::from_millis(500));
    /// # Ok(()) }
    /// ```
    ///
    /// The forms of `url`:
    ///
    /// | topology | URL |
    /// |---|---|
    /// | one server | `redis://[USER:PASSWORD@]HOST:PORT[/DB]`, `rediss://…` (TLS), `redis+unix:///PATH` |
    /// | Redis Cluster | `redis+cluster://[USER:PASSWORD@]HOST:PORT,HOST:PORT,…` (seed nodes; only database 0), `rediss+cluster://…` |
    /// | Sentinel | `redis+sentinel://[USER:PASSWORD@]HOST:PORT,HOST:PORT,…/MASTER[/DB]` (sentinels, then the master's name), `rediss+sentinel://…` (TLS to the master and the sentinels) |
    ///
    /// A port left out is 6379 (26379 for a sentinel). On a cluster, MOVED and ASK replies (a slot
    /// being migrated) are followed by the client. Through Sentinel, the master the sentinels
    /// agree on is followed after a failover ([`RedisTimeouts::sentinel_poll`]); the credentials
    /// in the URL are the master's, and the sentinels are asked without any.
    ///
    /// A URL of another scheme fails at once with [`RedisError::UnsupportedScheme`], a malformed
    /// cluster or Sentinel URL with [`RedisError::BadUrl`]; servers that cannot be reached, or
    /// refuse the client, with [`RedisError::Unreachable`] naming their addresses (see
    /// [`from_client_with`](Self::from_client_with)).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use brokerfence::redis::{RedisConnections, RedisError};
    /// let err = RedisConnections::connect("http://127.0.0.1:6379").await.unwrap_err();
    /// assert!(matches!(err, RedisError::UnsupportedScheme { ref scheme } if scheme == "http"));
    /// let err = RedisConnections::connect("redis+cluster://127.0.0.1:7000/2").await.unwrap_err();
    /// assert!(matches!(err, RedisError::BadUrl { .. }));
    /// # }
    /// ```
    pub async fn connect_with(url: &str, timeouts: RedisTimeouts) -> Result<Self, RedisError> {
        let target = Target::parse(url)?;
        let describe = target.describe();
        match target {
            Target::Single(url) => {
                let client = ::redis::Client::open(url).map_err(RedisError::command("connect"))?;
                Self::from_client_with(client, timeouts).await
            }
            Target::Cluster(nodes) => {
                // MOVED, ASK and TRYAGAIN (a slot being migrated) are retried quickly; every call of the
                // adapter is bounded anyway.
                let client = ClusterClientBuilder::new(nodes)
                    .retries(8)
                    .min_retry_wait(10)
                    .max_retry_wait(500)
                    .build()
                    .map_err(RedisError::command("connect"))?;
                Self::open_cluster(client, timeouts, describe).await
            }
            Target::Sentinel(target) => {
                let (commands, blocking) = SentinelConn::open(target, timeouts).await?;
                Ok(Self { commands: RedisConn::sentinel(commands), blocking: RedisConn::sentinel(blocking), timeouts })
            }
        }
    }

    /// Connects both connections with a client you configured (TLS, credentials, protocol) and
    /// the default [`RedisTimeouts`].
    pub async fn from_client(client: ::redis::Client) -> Result<Self, RedisError> {
        Self::from_client_with(client, RedisTimeouts::default()).await
    }

    /// Like [`from_client`](Self::from_client) with your timeouts.
    ///
    /// When a connection cannot be opened (within `connect` × 2 + `response` of
    /// [`RedisTimeouts`], a few reconnect attempts included) the error is
    /// [`RedisError::Unreachable`], naming the client's address and the cause.
    pub async fn from_client_with(client: ::redis::Client, timeouts: RedisTimeouts) -> Result<Self, RedisError> {
        let addr = client.get_connection_info().addr().to_string();
        let unreachable = |e: RedisError| RedisError::Unreachable { addr: addr.clone(), source: Box::new(e) };
        Self::open_with(client, timeouts).await.map_err(unreachable)
    }

    /// Connects both connections to a Redis Cluster through a cluster client you configured (TLS
    /// certificates, credentials, protocol), with your timeouts: the command connection gets the
    /// `response` timeout, the blocking one none. The client's own retry settings apply to MOVED,
    /// ASK and `TRYAGAIN`; each call of the adapter is still bounded as [`RedisTimeouts`] says.
    ///
    /// A cluster none of whose seed nodes answers fails with [`RedisError::Unreachable`]. Leave
    /// the builder's `response_timeout` unset, or also call `.overall_response_timeout(None)`:
    /// the client crate bounds every request by that overall timeout, which the settings given
    /// here do not change, and a blocking read must be free to block for its block time.
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
    /// use brokerfence::redis::{RedisConnections, RedisTimeouts, client::cluster::ClusterClientBuilder};
    /// let client = ClusterClientBuilder::new(vec!["redis://10.0.0.1:7000", "redis://10.0.0.2:7000"])
    ///     .password("secret")
    ///     .build()?;
    /// let redis = RedisConnections::from_cluster_client_with(client, RedisTimeouts::default()).await?;
    /// # Ok(()) }
    /// ```
    pub async fn from_cluster_client_with(client: ClusterClient, timeouts: RedisTimeouts) -> Result<Self, RedisError> {
        Self::open_cluster(client, timeouts, "the cluster client's seed nodes".into()).await
    }

    async fn open_cluster(client: ClusterClient, timeouts: RedisTimeouts, seeds: String) -> Result<Self, RedisError> {
        let connect = timeouts.get_connect().saturating_mul(2).saturating_add(timeouts.get_response());
        let config = ClusterConfig::new().set_connection_timeout(timeouts.get_connect());
        let open = async {
            let commands = bounded(
                "connect",
                connect,
                client.get_async_connection_with_config(config.clone().set_response_timeout(timeouts.get_response())),
            )
            .await?;
            // A day: the sources bound each blocking read by its own block time plus the margin.
            let blocking = bounded(
                "connect",
                connect,
                client.get_async_connection_with_config(config.set_response_timeout(Duration::from_secs(86_400))),
            )
            .await?;
            Ok::<_, RedisError>((commands, blocking))
        };
        let (commands, blocking) =
            open.await.map_err(|e| RedisError::Unreachable { addr: seeds, source: Box::new(e) })?;
        Ok(Self { commands: commands.into(), blocking: blocking.into(), timeouts })
    }

    async fn open_with(client: ::redis::Client, timeouts: RedisTimeouts) -> Result<Self, RedisError> {
        let base = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeouts.get_connect()))
            .set_max_delay(Duration::from_secs(2))
            .set_number_of_retries(4);
        let connect = timeouts.get_connect().saturating_mul(2).saturating_add(timeouts.get_response());
        let commands = bounded(
            "connect",
            connect,
            client.get_connection_manager_with_config(base.clone().set_response_timeout(Some(timeouts.get_response()))),
        )
        .await?;
        // The sources bound each blocking read by its own block time plus the margin.
        let blocking =
            bounded("connect", connect, client.get_connection_manager_with_config(base.set_response_timeout(None)))
                .await?;
        Ok(Self { commands: commands.into(), blocking: blocking.into(), timeouts })
    }

    /// Uses connections you built yourself, with the default [`RedisTimeouts`] (change them with
    /// [`timeouts`](Self::timeouts)). `blocking` must not time out responses sooner than
    /// the block time of the source that uses it plus the margin.
    pub fn from_managers(commands: ConnectionManager, blocking: ConnectionManager) -> Self {
        Self { commands: commands.into(), blocking: blocking.into(), timeouts: RedisTimeouts::default() }
    }

    setters! {
        /// The timeouts the sources built on these connections apply.
        pub fn timeouts(timeouts: RedisTimeouts) { timeouts = timeouts }
    }

    /// The timeouts the sources built on these connections apply.
    ///
    /// ```no_run
    /// # async fn demo(commands: brokerfence::redis::client::aio::ConnectionManager) {
    /// use std::time::Duration;
    /// use brokerfence::redis::{RedisConnections, RedisTimeouts};
    /// let redis = RedisConnections::from_managers(commands.clone(), commands)
    ///     .timeouts(RedisTimeouts::default().response(Duration::from_millis(500)));
    /// assert_eq!(redis.get_timeouts().get_response(), Duration::from_millis(500));
    /// # }
    /// ```
    pub fn get_timeouts(&self) -> RedisTimeouts {
        self.timeouts
    }

    /// The kind of Redis these connections talk to.
    pub fn topology(&self) -> Topology {
        self.commands.topology()
    }

    /// The connection for short commands (a cheap clone).
    pub fn commands(&self) -> RedisConn {
        self.commands.clone()
    }

    /// The connection for blocking reads (a cheap clone).
    pub fn blocking(&self) -> RedisConn {
        self.blocking.clone()
    }
}
