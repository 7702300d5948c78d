//! Typed errors of the Redis adapter.

use std::time::Duration;

use crate::source::SourceError;

/// What went wrong talking to Redis.
///
/// ```
/// use brokerfence::redis::RedisError;
/// let e = RedisError::Config("stream name must not be empty".into());
/// assert_eq!(e.to_string(), "invalid redis adapter configuration: stream name must not be empty");
/// assert!(matches!(brokerfence::SourceError::from(e), brokerfence::SourceError::Fatal(_)));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisError {
    /// A command failed (connection, timeout, or an error reply).
    #[error("redis {command} failed: {source}")]
    Command {
        /// The command or script that failed.
        command: &'static str,
        /// The client's error.
        #[source]
        source: ::redis::RedisError,
    },
    /// Redis did not answer within the bound this adapter sets for the call (see
    /// [`RedisTimeouts`](super::RedisTimeouts)): the server is stalled, overloaded or unreachable.
    /// The call may still run on the server later; every call this adapter makes is safe then.
    #[error("redis {command} did not answer within {after:?}")]
    Timeout {
        /// The command or script that timed out.
        command: &'static str,
        /// The bound it was given.
        after: Duration,
    },
    /// Redis answered with a shape this adapter does not understand.
    #[error("unexpected reply to redis {command}: {detail}")]
    Reply {
        /// The command.
        command: &'static str,
        /// What was wrong with it.
        detail: String,
    },
    /// The adapter was configured with something unusable (empty names, bad durations).
    #[error("invalid redis adapter configuration: {0}")]
    Config(String),
    /// A URL whose scheme is not Redis's (`http://…`, a bare `host:port`): refused before any
    /// connection is made.
    ///
    /// ```
    /// use brokerfence::redis::RedisError;
    /// let e = RedisError::UnsupportedScheme { scheme: "http".into() };
    /// assert_eq!(
    ///     e.to_string(),
    ///     "unsupported Redis URL scheme \"http:\": expected redis://[USER:PASSWORD@]HOST:PORT[/DB], \
    ///      rediss://… for TLS, redis+unix:///PATH/TO/SOCKET (also unix://), \
    ///      redis+cluster://HOST:PORT,HOST:PORT,… for Redis Cluster, or \
    ///      redis+sentinel://HOST:PORT,HOST:PORT,…/MASTER[/DB] for Sentinel"
    /// );
    /// assert!(e.is_fatal());
    /// ```
    #[error(
        "unsupported Redis URL scheme \"{scheme}:\": expected redis://[USER:PASSWORD@]HOST:PORT[/DB], \
         rediss://… for TLS, redis+unix:///PATH/TO/SOCKET (also unix://), \
         redis+cluster://HOST:PORT,HOST:PORT,… for Redis Cluster, or \
         redis+sentinel://HOST:PORT,HOST:PORT,…/MASTER[/DB] for Sentinel"
    )]
    UnsupportedScheme {
        /// The scheme of the URL (empty when it has none), without the colon.
        scheme: String,
    },
    /// A cluster or Sentinel URL that is malformed (no master name, a port that is not a number,
    /// a database other than 0 on a cluster): refused before any connection is made. Never
    /// carries the password.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use brokerfence::redis::{RedisConnections, RedisError};
    /// let err = RedisConnections::connect("redis+sentinel://:pw@127.0.0.1:26379").await.unwrap_err();
    /// assert!(matches!(err, RedisError::BadUrl { .. }));
    /// assert!(err.to_string().contains("names the master") && !err.to_string().contains("pw"));
    /// assert!(err.is_fatal());
    /// # }
    /// ```
    #[error("invalid Redis URL: {reason}")]
    BadUrl {
        /// What is wrong with it.
        reason: String,
    },
    /// Keys that one script or pipeline of a source touches together fall in different slots of
    /// a Redis Cluster (a dead-letter stream or processing list named without the source key's
    /// hash tag): refused when the consumer starts, before anything is received, never at run
    /// time. Name them with the same `{tag}` (see [`sibling_key`](super::sibling_key)).
    #[error(
        "{what}: the keys {first:?} (slot {first_slot}) and {second:?} (slot {second_slot}) are in different \
         Redis Cluster slots, and one script touches both; give them the same hash tag, e.g. {{orders}} and \
         {{orders}}:dead"
    )]
    CrossSlot {
        /// The source or retrofit that would touch them.
        what: &'static str,
        /// The key the others must share a slot with.
        first: String,
        /// Its slot.
        first_slot: u16,
        /// The key in another slot.
        second: String,
        /// Its slot.
        second_slot: u16,
    },
    /// The connections could not be opened: nothing listens at the address, the server did not
    /// answer in time, or it refused the client (authentication, TLS). Names the address (never
    /// the password) and the cause.
    #[error(
        "cannot connect to Redis at {addr}: {}; check that Redis is running and listening there, and the \
         Redis URL",
        connect_cause(source)
    )]
    Unreachable {
        /// `host:port`, or the socket path.
        addr: String,
        /// What the connection attempt ran into.
        #[source]
        source: Box<RedisError>,
    },
    /// The fence refused to claim a popped item because the schema is older than this build
    /// needs ([`FenceError::SchemaTooOld`](fence::FenceError::SchemaTooOld), whose message says
    /// to run migrations). [`ListRetrofit::requeue_popped`](super::ListRetrofit::requeue_popped)
    /// answers it once the item is back on the list, so that your loop's `?` ends the loop, as
    /// [`Consumer::run`](crate::Consumer::run) ends on such a schema.
    ///
    /// ```
    /// use brokerfence::redis::RedisError;
    /// let e = RedisError::Refused(brokerfence::FenceError::SchemaTooOld { found: 0, required: 9 });
    /// assert!(e.to_string().starts_with("the fence refused to claim: the fence schema is at migration version 0"));
    /// assert!(e.to_string().contains("run migrations"));
    /// assert!(e.is_fatal());
    /// ```
    #[error("the fence refused to claim: {0}")]
    Refused(#[source] fence::FenceError),
    /// Popped items that Redis has not taken back yet when a flush gave up
    /// ([`ListRetrofit::flush`](super::ListRetrofit::flush)): they stay in the retrofit's holding
    /// area, sent again until Redis takes them, for as long as this process runs.
    ///
    /// ```
    /// use std::time::Duration;
    /// use brokerfence::redis::RedisError;
    /// let e = RedisError::StillHeld { held: 2, after: Duration::from_secs(5) };
    /// assert!(e.to_string().starts_with("2 popped item(s) still held after 5s"));
    /// assert!(!e.is_fatal());
    /// ```
    #[error(
        "{held} popped item(s) still held after {after:?}: Redis has not taken them back; they are sent again \
         until it does, for as long as this process runs"
    )]
    StillHeld {
        /// Items still held.
        held: usize,
        /// How long the flush waited.
        after: Duration,
    },
}

/// The cause of a failed connect, without repeating "connect".
fn connect_cause(e: &RedisError) -> String {
    match e {
        RedisError::Command { source, .. } => {
            let text = source.to_string();
            let mut chars = text.chars();
            chars.next().map(|c| c.to_lowercase().chain(chars).collect()).unwrap_or(text)
        }
        RedisError::Timeout { after, .. } => format!("no answer within {after:?}"),
        other => other.to_string(),
    }
}

impl RedisError {
    pub(crate) fn command(command: &'static str) -> impl FnOnce(::redis::RedisError) -> Self {
        move |source| RedisError::Command { command, source }
    }

    pub(crate) fn reply(command: &'static str, detail: impl Into<String>) -> Self {
        RedisError::Reply { command, detail: detail.into() }
    }

    /// The server's error code (`NOGROUP`, `BUSYGROUP`, `NOSCRIPT`, `WRONGTYPE`, …), if any.
    pub fn code(&self) -> Option<&str> {
        match self {
            RedisError::Command { source, .. } => source.code(),
            RedisError::Unreachable { source, .. } => source.code(),
            _ => None,
        }
    }

    /// True when Redis did not answer in time: a [`RedisError::Timeout`], or the client's own
    /// response or connection timeout.
    ///
    /// ```
    /// use std::time::Duration;
    /// let e = brokerfence::redis::RedisError::Timeout { command: "XCLAIM", after: Duration::from_millis(750) };
    /// assert!(e.is_timeout() && !e.is_fatal());
    /// assert_eq!(e.to_string(), "redis XCLAIM did not answer within 750ms");
    /// ```
    pub fn is_timeout(&self) -> bool {
        match self {
            RedisError::Timeout { .. } => true,
            RedisError::Unreachable { source, .. } => source.is_timeout(),
            RedisError::Command { source, .. } => source.is_timeout(),
            _ => false,
        }
    }

    /// True when retrying cannot help: bad configuration, authentication, permissions, or a key
    /// of the wrong type.
    pub fn is_fatal(&self) -> bool {
        match self {
            RedisError::Config(_)
            | RedisError::UnsupportedScheme { .. }
            | RedisError::BadUrl { .. }
            | RedisError::CrossSlot { .. }
            | RedisError::Refused(_) => true,
            RedisError::Unreachable { source, .. } => source.is_fatal(),
            RedisError::Reply { .. } | RedisError::Timeout { .. } | RedisError::StillHeld { .. } => false,
            RedisError::Command { source, .. } => {
                matches!(
                    source.kind(),
                    ::redis::ErrorKind::AuthenticationFailed | ::redis::ErrorKind::InvalidClientConfig
                ) || matches!(source.code(), Some("WRONGTYPE" | "NOPERM" | "NOAUTH" | "WRONGPASS"))
            }
        }
    }
}

impl From<RedisError> for SourceError {
    fn from(e: RedisError) -> Self {
        if e.is_fatal() { SourceError::Fatal(Box::new(e)) } else { SourceError::Transient(Box::new(e)) }
    }
}
