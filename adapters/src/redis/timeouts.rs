//! [`RedisTimeouts`]: how long the adapter waits for Redis, and [`bounded`], the one wrapper every
//! call goes through.

use std::future::Future;
use std::time::Duration;

use super::error::RedisError;
use crate::builder::setters;

/// How long this adapter waits for Redis.
///
/// - `connect` (default 2 s): to (re)connect, on both connections.
/// - `response` (default 2 s): for the answer to a short command (acks, dead letters, reads that
///   do not block, the reaper). It is also the response timeout of the command connection that
///   [`RedisConnections::connect`](super::RedisConnections::connect) builds.
/// - Hint calls made for the heartbeat (the stream's `XCLAIM … JUSTID` with its lease keys, the
///   lease-key renewals of [`LeaseKeyHook`](super::LeaseKeyHook)) get
///   [`hint`](Self::hint)`(lease)`: `response`, but at most a quarter of the lease, so that even a
///   hook the heartbeat awaits inline leaves the database renewal on time (the heartbeat runs
///   every lease/3, and the worker gives up on a lease a tenth of it before its end). A hint
///   that times out is skipped; the next heartbeat sends the newest one.
/// - Blocking reads (`XREADGROUP … BLOCK`, `BLMOVE`) get their block time plus `block_margin`
///   (default 1 s) ([`blocking`](Self::blocking)); the blocking connection itself has no response
///   timeout, since its block time is the source's.
///
/// A call that times out fails with [`RedisError::Timeout`]; sources report it as a transient
/// error and the consumer retries with backoff. The command may still run on the server once it
/// answers again (a paused server works through what it was sent); every call this adapter makes
/// is safe to run late (compare-and-set scripts, idempotent acks, claims that check the lease key).
///
/// If you build your own connections
/// ([`RedisConnections::from_managers`](super::RedisConnections::from_managers)), give the command
/// connection a response timeout of about `response` and the blocking one none (or one longer
/// than your longest block time plus the margin), and pass the same values here with
/// [`RedisConnections::timeouts`](super::RedisConnections::timeouts).
///
/// ```
/// use std::time::Duration;
/// use brokerfence::redis::RedisTimeouts;
/// let t = RedisTimeouts::default().response(Duration::from_millis(500));
/// assert_eq!(t.get_response(), Duration::from_millis(500));
/// // With a 30 s lease hint calls get the whole response timeout; with a 1.2 s one, a quarter of it.
/// assert_eq!(t.hint(Duration::from_secs(30)), Duration::from_millis(500));
/// assert_eq!(t.hint(Duration::from_millis(1200)), Duration::from_millis(300));
/// assert_eq!(t.blocking(Duration::from_secs(2)), Duration::from_secs(3));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedisTimeouts {
    connect: Duration,
    response: Duration,
    block_margin: Duration,
    sentinel_poll: Duration,
}

impl Default for RedisTimeouts {
    fn default() -> Self {
        Self {
            connect: Duration::from_secs(2),
            response: Duration::from_secs(2),
            block_margin: Duration::from_secs(1),
            sentinel_poll: Duration::from_secs(1),
        }
    }
}

impl RedisTimeouts {
    setters! {
        /// The connection timeout (default 2 s, at least 1 ms).
        pub fn connect(timeout: Duration) { connect = timeout.max(Duration::from_millis(1)) }

        /// The response timeout of short commands (default 2 s, at least 1 ms).
        pub fn response(timeout: Duration) { response = timeout.max(Duration::from_millis(1)) }

        /// How much longer than its block time a blocking read may take (default 1 s).
        pub fn block_margin(margin: Duration) { block_margin = margin }

        /// How often the sentinels are asked where the master is (default 1 s, at least 10 ms;
        /// only for a `redis+sentinel://` URL). They are also asked at once after a call failed.
        /// After a failover the connections follow the new master within this interval and one
        /// connect.
        pub fn sentinel_poll(every: Duration) { sentinel_poll = every.max(Duration::from_millis(10)) }
    }

    /// How often the sentinels are asked where the master is.
    pub fn get_sentinel_poll(&self) -> Duration {
        self.sentinel_poll
    }

    /// The connection timeout.
    pub fn get_connect(&self) -> Duration {
        self.connect
    }

    /// The response timeout of short commands.
    pub fn get_response(&self) -> Duration {
        self.response
    }

    /// The margin of blocking reads.
    pub fn get_block_margin(&self) -> Duration {
        self.block_margin
    }

    /// The bound of a hint call for a lease of `lease`: the response timeout, at most a quarter
    /// of the lease (and at least 1 ms).
    pub fn hint(&self, lease: Duration) -> Duration {
        self.response.min(lease / 4).max(Duration::from_millis(1))
    }

    /// The bound of a blocking read that blocks for `block`.
    pub fn blocking(&self, block: Duration) -> Duration {
        block.saturating_add(self.block_margin)
    }
}

/// Runs one Redis call with a bound: its own error, or [`RedisError::Timeout`] once `limit` passed
/// (or the connection's own response timeout struck first).
pub(crate) async fn bounded<T>(
    command: &'static str,
    limit: Duration,
    call: impl Future<Output = Result<T, ::redis::RedisError>>,
) -> Result<T, RedisError> {
    match tokio::time::timeout(limit, call).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) if e.is_timeout() => Err(RedisError::Timeout { command, after: limit }),
        Ok(Err(e)) => Err(RedisError::Command { command, source: e }),
        Err(_) => Err(RedisError::Timeout { command, after: limit }),
    }
}

/// [`bounded`] for a call that already maps its errors.
pub(crate) async fn bounded_op<T>(
    command: &'static str,
    limit: Duration,
    call: impl Future<Output = Result<T, RedisError>>,
) -> Result<T, RedisError> {
    tokio::time::timeout(limit, call).await.unwrap_or(Err(RedisError::Timeout { command, after: limit }))
}
