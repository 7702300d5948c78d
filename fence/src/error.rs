//! Typed errors of the epoch authority.

use std::time::Duration;

/// Everything that can go wrong in the fence, named for what happened.
///
/// ```
/// use brokerfence::FenceError;
/// let err = FenceError::Fenced { key: "job-1".into(), epoch: 1, current_epoch: 2, current_owner: Some("w2".into()) };
/// assert!(err.is_fenced());
/// assert_eq!(err.to_string(), "job job-1: epoch 1 was superseded (current epoch 2, owner w2)");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FenceError {
    /// The compare-and-set on (key, owner, epoch, state = running) matched no row: another owner
    /// holds a newer epoch, or the job is no longer running. Nothing was written.
    #[error("job {key}: epoch {epoch} was superseded (current epoch {current_epoch}, owner {})", current_owner.as_deref().unwrap_or("none"))]
    Fenced {
        /// The job key.
        key: String,
        /// The epoch the caller held.
        epoch: i64,
        /// The epoch the database holds now (0 when the job row does not exist).
        current_epoch: i64,
        /// The owner the database holds now.
        current_owner: Option<String>,
    },
    /// A lease was asked for that is shorter than the minimum (heartbeats run at lease/3).
    #[error("LeaseDuration::new: a lease of {lease:?} is shorter than the minimum {min:?}")]
    LeaseTooShort {
        /// What was asked for.
        lease: Duration,
        /// The minimum.
        min: Duration,
    },
    /// A job key, queue name or owner id was rejected.
    #[error("invalid {what}: {reason}")]
    InvalidInput {
        /// Which input ("key", "queue", "owner", "payload", …).
        what: &'static str,
        /// Why it was rejected.
        reason: String,
    },
    /// The schema name is not a plain SQL identifier.
    #[error("invalid schema name {name:?}: {reason}")]
    InvalidSchema {
        /// The rejected name.
        name: String,
        /// Why.
        reason: &'static str,
    },
    /// A migration failed to apply.
    #[error("migration {version} ({name}) failed: {source}")]
    Migration {
        /// Migration version.
        version: i64,
        /// Migration name.
        name: &'static str,
        /// The database error.
        #[source]
        source: sqlx::Error,
    },
    /// A batched commit failed as a whole (for example the connection dropped): whether this
    /// result was committed is unknown to the worker, so the delivery must not be acknowledged.
    #[error("commit outcome unknown: {0}")]
    CommitUnconfirmed(String),
    /// The database answered with something the fence does not understand (a bug or a foreign schema).
    #[error("unexpected database state: {0}")]
    Corrupt(String),
    /// The schema is older than this build needs (a worker refuses to start on it; a newer schema
    /// is fine). Migrations are an explicit step: run [`FenceStore::migrate`](crate::FenceStore::migrate)
    /// once per deploy before starting workers of this build. The message names that call; a
    /// program with a flag of its own for it (the examples' `--migrate`) adds it to what it prints.
    ///
    /// ```
    /// use brokerfence::FenceError;
    /// let err = FenceError::SchemaTooOld { found: 0, required: 3 };
    /// assert_eq!(
    ///     err.to_string(),
    ///     "the fence schema is at migration version 0 (0 = no schema) but this build needs version 3: \
    ///      run migrations: FenceStore::migrate, once per deploy, before workers of this build start"
    /// );
    /// ```
    #[error(
        "the fence schema is at migration version {found} (0 = no schema) but this build needs version {required}: \
         run migrations: FenceStore::migrate, once per deploy, before workers of this build start"
    )]
    SchemaTooOld {
        /// The newest migration version recorded in the schema (0 when there is no schema).
        found: i64,
        /// The migration version this build needs.
        required: i64,
    },
    /// [`complete_in`](crate::JobContext::complete_in) was given a connection that is not in
    /// exactly one (top-level) transaction: at depth 0 (a pooled connection in autocommit) the
    /// caller's rows and the completion do not commit together; inside a savepoint (depth 2 and
    /// more) a fenced answer could be rolled back to the savepoint and the outer `COMMIT` would
    /// commit a zombie's rows. Nothing was written. Pass `&mut *tx` of a `pool.begin()` (or
    /// [`PgFence::begin`](crate::PgFence::begin)) transaction (issue #30, item 6).
    ///
    /// ```
    /// use brokerfence::FenceError;
    /// let err = FenceError::TransactionDepth { depth: 2 };
    /// assert!(err.to_string().contains("savepoint"));
    /// ```
    #[error(
        "complete_in needs a connection in one top-level transaction (depth 1), found depth {depth}: {}",
        if *depth == 0 { "no transaction (autocommit), so the rows would not commit together with the result" }
        else { "inside a savepoint, whose rollback would clear the fenced abort" }
    )]
    TransactionDepth {
        /// sqlx's transaction depth of the connection (0: none, 1: a transaction, 2+: savepoints).
        depth: usize,
    },
    /// The store does not implement an optional operation (for example a wrapper that does not
    /// delegate it to the store it wraps).
    #[error("not supported by this store: {0}")]
    Unsupported(&'static str),
    /// A statement waited longer than its `lock_timeout` for a lock (PostgreSQL `55P03`): a row
    /// held by another transaction, or a table lock queued behind a migration. It wrote nothing;
    /// retry later. See [`PgTimeouts`](crate::PgTimeouts).
    #[error("gave up waiting for a lock (lock_timeout): {0}")]
    LockTimeout(String),
    /// A statement ran longer than its `statement_timeout` (PostgreSQL `57014`, cancelled by the
    /// timeout). It wrote nothing; retry later. See [`PgTimeouts`](crate::PgTimeouts).
    #[error("statement cancelled by statement_timeout: {0}")]
    StatementTimeout(String),
    /// The task that ran a statement ended without its answer (the runtime shut down, or a
    /// panic); whether the statement ran is unknown.
    #[error("statement ended without an answer: {0}")]
    StatementAborted(String),
    /// PostgreSQL could not be reached at all: nothing listens at the address (connection
    /// refused), the host name does not resolve, or no answer came in time. Found by one direct
    /// connection attempt when a fence connects, so it comes at once rather than after the pool's
    /// acquire timeout. The message names the database URL (the one given to
    /// [`PgFence::connect`](crate::PgFence::connect) or [`PgTarget`](crate::PgTarget)); a program
    /// that reads it from a flag or a variable of its own adds their names.
    ///
    /// ```
    /// use brokerfence::FenceError;
    /// let err = FenceError::Unreachable { host: "127.0.0.1".into(), port: 5432, cause: "connection refused (os error 111)".into() };
    /// assert_eq!(
    ///     err.to_string(),
    ///     "cannot connect to PostgreSQL at 127.0.0.1:5432: connection refused (os error 111); \
    ///      check that PostgreSQL is running and listening there, and the host and port of the \
    ///      database URL"
    /// );
    /// ```
    #[error(
        "cannot connect to PostgreSQL at {host}:{port}: {cause}; check that PostgreSQL is running and \
         listening there, and the host and port of the database URL"
    )]
    Unreachable {
        /// The host (or Unix socket directory) connected to.
        host: String,
        /// The port.
        port: u16,
        /// What the connection attempt ran into.
        cause: String,
    },
    /// PostgreSQL answered but refused the connection: authentication failed, the database or
    /// role does not exist, or too many connections. The server's own message is the cause.
    ///
    /// ```
    /// use brokerfence::FenceError;
    /// let err = FenceError::ConnectRejected {
    ///     host: "db".into(), port: 5432, user: "app".into(), database: "jobs".into(),
    ///     cause: "password authentication failed for user \"app\"".into(),
    /// };
    /// assert!(err.to_string().starts_with("PostgreSQL at db:5432 refused user app on database jobs: password"));
    /// ```
    #[error(
        "PostgreSQL at {host}:{port} refused user {user} on database {database}: {cause}; check the user, \
         password and database name of the database URL"
    )]
    ConnectRejected {
        /// The host (or Unix socket directory).
        host: String,
        /// The port.
        port: u16,
        /// The user connected as.
        user: String,
        /// The database asked for.
        database: String,
        /// The server's message.
        cause: String,
    },
    /// A database URL whose scheme names no backend this constructor serves (for example a
    /// `mysql://` URL given to [`PgFence::connect`](crate::PgFence::connect)). Refused before any
    /// connection is made.
    ///
    /// ```
    /// use brokerfence::FenceError;
    /// let err = FenceError::UnsupportedScheme { scheme: "mysql".into(), expected: "postgres:// or postgresql://" };
    /// assert_eq!(
    ///     err.to_string(),
    ///     "database URL scheme \"mysql:\" is not supported: expected postgres:// or postgresql://"
    /// );
    /// ```
    ///
    /// A bare path has no scheme at all, and is told so:
    ///
    /// ```
    /// use brokerfence::FenceError;
    /// let err = FenceError::UnsupportedScheme { scheme: "".into(), expected: "sqlite:PATH or sqlite::memory:" };
    /// assert_eq!(
    ///     err.to_string(),
    ///     "database URL has no scheme (a bare path?): expected sqlite:PATH or sqlite::memory:"
    /// );
    /// ```
    #[error("{}", unsupported_scheme(scheme, expected))]
    UnsupportedScheme {
        /// The scheme of the URL (empty when it has none), without the colon.
        scheme: String,
        /// The forms this constructor accepts.
        expected: &'static str,
    },
    /// Every host of the target answered, but none is a primary: each is a standby (in
    /// recovery) or read-only. The fence writes, so it needs the primary: during a failover,
    /// until the new primary is promoted; otherwise list the primary's address (or every host,
    /// `postgres://h1,h2/db`, in which case the fence finds the primary itself).
    ///
    /// ```
    /// use brokerfence::FenceError;
    /// let err = FenceError::NotPrimary { hosts: "db2:5432".into() };
    /// assert!(err.to_string().starts_with("no primary among db2:5432"), "{err}");
    /// ```
    #[error(
        "no primary among {hosts}: the server is a standby (in recovery) or read-only, and the fence          writes; connect to the primary, or list every host (postgres://h1:5432,h2:5432/db) so that          the fence finds it"
    )]
    NotPrimary {
        /// The hosts looked at, as `host:port, …`.
        hosts: String,
    },
    /// A connection pooler between the fence and PostgreSQL refused a startup parameter the
    /// fence sent (PgBouncer refuses every parameter not in its `ignore_startup_parameters`).
    ///
    /// ```
    /// use brokerfence::FenceError;
    /// let err = FenceError::PoolerRefused {
    ///     host: "pgbouncer".into(), port: 6432, parameter: "options".into(),
    ///     cause: "unsupported startup parameter: options".into(),
    /// };
    /// assert!(err.to_string().contains("?pooler=transaction"), "{err}");
    /// ```
    #[error(
        "the server at {host}:{port} refused the startup parameter {parameter} ({cause}): a connection          pooler (PgBouncer) is in front of PostgreSQL. Connect with ?pooler=transaction in the URL (or          Pooler::Transaction; Pooler::Auto, the default, finds out by itself), which sends no startup          options; or add {parameter} to PgBouncer's ignore_startup_parameters"
    )]
    PoolerRefused {
        /// The pooler's host.
        host: String,
        /// The pooler's port.
        port: u16,
        /// The startup parameter refused.
        parameter: String,
        /// The pooler's message.
        cause: String,
    },
    /// The database could not be reached or failed a statement.
    #[error("database error: {0}")]
    Database(sqlx::Error),
    /// A SQLite database file could not be opened or created: its directory does not exist
    /// (SQLite creates the file, not the directories above it), or it may not be read or
    /// written. Names the file, unlike SQLite's own "(code: 14) unable to open database file".
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let err = brokerfence::SqliteFence::open("sqlite:/nonexistent/brokerfence/jobs.db").await.unwrap_err();
    /// assert_eq!(
    ///     err.to_string(),
    ///     "cannot open the SQLite database /nonexistent/brokerfence/jobs.db: the directory \
    ///      /nonexistent/brokerfence does not exist (SQLite creates the file, not its directory)"
    /// );
    /// # }
    /// ```
    #[error("cannot open the SQLite database {path}: {reason}")]
    SqliteOpen {
        /// The database file.
        path: String,
        /// Why, in words: the missing directory, else SQLite's message.
        reason: String,
        /// SQLite's error.
        #[source]
        source: sqlx::Error,
    },
}

/// The message of [`FenceError::UnsupportedScheme`]: a URL without a scheme (a bare path) is
/// told so rather than shown an empty scheme.
fn unsupported_scheme(scheme: &str, expected: &str) -> String {
    if scheme.is_empty() {
        format!("database URL has no scheme (a bare path?): expected {expected}")
    } else {
        format!("database URL scheme \"{scheme}:\" is not supported: expected {expected}")
    }
}

/// The scheme of a URL (the letters before its first `:`), if it starts with one.
pub(crate) fn url_scheme(url: &str) -> Option<&str> {
    let (scheme, _) = url.split_once(':')?;
    let mut chars = scheme.chars();
    let first = chars.next()?;
    (first.is_ascii_alphabetic() && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.')))
        .then_some(scheme)
}

/// Refuses `url` unless its scheme is one of `accepted` (compared without case).
pub(crate) fn require_scheme(url: &str, accepted: &[&str], expected: &'static str) -> Result<()> {
    let scheme = url_scheme(url).unwrap_or("");
    if accepted.iter().any(|a| a.eq_ignore_ascii_case(scheme)) {
        Ok(())
    } else {
        Err(FenceError::UnsupportedScheme { scheme: scheme.to_owned(), expected })
    }
}

impl From<sqlx::Error> for FenceError {
    fn from(e: sqlx::Error) -> Self {
        if let sqlx::Error::Database(db) = &e {
            match db.code().as_deref() {
                Some("55P03") => return FenceError::LockTimeout(db.message().to_owned()),
                Some("57014") if db.message().contains("statement timeout") => {
                    return FenceError::StatementTimeout(db.message().to_owned());
                }
                _ => {}
            }
        }
        FenceError::Database(e)
    }
}

impl FenceError {
    /// True when this is a [`FenceError::Fenced`] rejection (the caller was superseded).
    pub fn is_fenced(&self) -> bool {
        matches!(self, FenceError::Fenced { .. })
    }

    /// Whether the server that answered does not take writes: a standby or a server in
    /// recovery (SQLSTATE 25006 `read_only_sql_transaction`, or "recovery is in progress"), or
    /// no primary was found at all. The session is not reused; the operation may be retried
    /// once the primary answers.
    ///
    /// ```
    /// assert!(brokerfence::FenceError::NotPrimary { hosts: "db2:5432".into() }.is_not_primary());
    /// ```
    pub fn is_not_primary(&self) -> bool {
        match self {
            FenceError::NotPrimary { .. } => true,
            FenceError::Database(sqlx::Error::Database(db)) => {
                db.code().as_deref() == Some("25006") || db.message().contains("recovery is in progress")
            }
            _ => false,
        }
    }

    /// Whether the connection to the server failed (closed, reset, refused, no connection
    /// free in time, the server shutting down): the statement's fate is unknown, and the same
    /// statement may succeed on a new connection.
    ///
    /// ```
    /// let err = brokerfence::FenceError::Database(sqlx::Error::PoolTimedOut);
    /// assert!(err.is_connection_failure());
    /// ```
    pub fn is_connection_failure(&self) -> bool {
        match self {
            FenceError::Unreachable { .. } => true,
            FenceError::Database(e) => match e {
                sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::Protocol(_) => true,
                sqlx::Error::Tls(_) | sqlx::Error::WorkerCrashed => true,
                // 08: connection exception; 57P01-57P03: admin/crash shutdown, cannot connect now.
                sqlx::Error::Database(db) => {
                    db.code().is_some_and(|c| c.starts_with("08") || matches!(&*c, "57P01" | "57P02" | "57P03"))
                }
                _ => false,
            },
            _ => false,
        }
    }

    pub(crate) fn invalid(what: &'static str, reason: impl Into<String>) -> Self {
        FenceError::InvalidInput { what, reason: reason.into() }
    }
}

/// Result alias of the fence.
pub type Result<T, E = FenceError> = std::result::Result<T, E>;
