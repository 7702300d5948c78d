//! The two connections a Redis source needs: one for short commands (heartbeat scripts, acks),
//! one for blocking reads. A blocked `XREADGROUP … BLOCK` or `BLMOVE` holds its connection on the
//! server, so sharing it would delay every heartbeat by up to the block time.

use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};

use super::error::RedisError;

/// A pair of auto-reconnecting connections to one Redis server.
///
/// ```no_run
/// # async fn demo() -> Result<(), adapters::redis::RedisError> {
/// let redis = adapters::redis::RedisConnections::connect("redis://127.0.0.1:6379").await?;
/// let mut conn = redis.commands();
/// let pong: String = adapters::redis::client::cmd("PING").query_async(&mut conn).await
///     .map_err(|e| adapters::redis::RedisError::Command { command: "PING", source: e })?;
/// assert_eq!(pong, "PONG");
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct RedisConnections {
    commands: ConnectionManager,
    blocking: ConnectionManager,
}

impl std::fmt::Debug for RedisConnections {
    // Never prints the URL: it may carry a password.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisConnections").finish_non_exhaustive()
    }
}

impl RedisConnections {
    /// Connects both connections to `url` (`redis://[user:password@]host:port[/db]`).
    ///
    /// Commands time out after 2 s; the blocking connection waits as long as a read blocks.
    /// Both reconnect by themselves after the server restarts.
    pub async fn connect(url: &str) -> Result<Self, RedisError> {
        let client = ::redis::Client::open(url).map_err(RedisError::command("connect"))?;
        Self::from_client(client).await
    }

    /// Connects both connections with a client you configured (TLS, credentials, protocol).
    pub async fn from_client(client: ::redis::Client) -> Result<Self, RedisError> {
        let base = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_max_delay(Duration::from_secs(2))
            .set_number_of_retries(4);
        let commands = client
            .get_connection_manager_with_config(base.clone().set_response_timeout(Some(Duration::from_secs(2))))
            .await
            .map_err(RedisError::command("connect"))?;
        let blocking = client
            .get_connection_manager_with_config(base.set_response_timeout(None))
            .await
            .map_err(RedisError::command("connect"))?;
        Ok(Self { commands, blocking })
    }

    /// Uses connections you built yourself. `blocking` must not time out responses sooner than
    /// the block time of the source that uses it.
    pub fn from_managers(commands: ConnectionManager, blocking: ConnectionManager) -> Self {
        Self { commands, blocking }
    }

    /// The connection for short commands (a cheap clone).
    pub fn commands(&self) -> ConnectionManager {
        self.commands.clone()
    }

    /// The connection for blocking reads (a cheap clone).
    pub fn blocking(&self) -> ConnectionManager {
        self.blocking.clone()
    }
}
