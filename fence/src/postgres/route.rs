//! How a fence's statements reach the server: straight (settings once per session, statements
//! prepared once per session) or through a transaction-mode pooler (settings per transaction,
//! no named statements); and the rule that only a primary's sessions are used.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};
use sqlx::{AssertSqlSafe, Postgres, Transaction};

use super::session::{PG_SESSION_SETUP, PgTimeouts, pg_ms};
use crate::error::{FenceError, Result};

/// Which of a fence's pools a statement runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Lane {
    /// Claims, commits, reads.
    Main,
    /// Lease renewals (their own connections and tighter limits).
    Heartbeat,
}

/// How statements reach the server, decided when connecting.
#[derive(Debug, Clone)]
pub(crate) struct Route {
    /// Behind a transaction-mode pooler.
    pooled: bool,
    /// What opens a transaction of each lane when pooled: `BEGIN READ WRITE` plus the settings.
    begin_main: Arc<str>,
    begin_heartbeat: Arc<str>,
    pub(crate) watch: Arc<PrimaryWatch>,
}

impl Route {
    /// Straight to PostgreSQL: the settings are the sessions' own.
    pub(crate) fn direct(watch: Arc<PrimaryWatch>) -> Self {
        Self { pooled: false, begin_main: "BEGIN".into(), begin_heartbeat: "BEGIN".into(), watch }
    }

    /// Behind a transaction-mode pooler, with `timeouts` set in every transaction.
    pub(crate) fn pooled(timeouts: &PgTimeouts, watch: Arc<PrimaryWatch>) -> Self {
        Self {
            pooled: true,
            begin_main: begin_with_settings(timeouts.statement, timeouts.lock).into(),
            begin_heartbeat: begin_with_settings(timeouts.heartbeat_statement, timeouts.heartbeat_lock).into(),
            watch,
        }
    }

    pub(crate) fn is_pooled(&self) -> bool {
        self.pooled
    }

    /// Whether statements may be prepared once per session (named, cached): not when pooled.
    pub(crate) fn persistent(&self) -> bool {
        !self.pooled
    }

    /// What opens a transaction of `lane` that carries the fence's settings: behind a pooler
    /// the `BEGIN READ WRITE; SET LOCAL …` text, else a plain `BEGIN` (the session has them).
    pub(crate) fn begin_text(&self, lane: Lane) -> Arc<str> {
        match lane {
            Lane::Main => Arc::clone(&self.begin_main),
            Lane::Heartbeat => Arc::clone(&self.begin_heartbeat),
        }
    }

    /// A session on `pool` for the statements of `lane` (see [`Session`]). With several hosts,
    /// a session that takes longer than [`SLOW_SESSION`] to get also wakes the locator: a pool
    /// whose host is gone keeps trying to connect to it (connection refused) until its acquire
    /// timeout, and the locator finds the new primary meanwhile.
    pub(crate) async fn session(&self, pool: &PgPool, lane: Lane) -> Result<Session> {
        let opening = async {
            if self.pooled {
                pool.begin_with(AssertSqlSafe(self.begin_text(lane).to_string())).await.map(Session::Pooled)
            } else {
                pool.acquire().await.map(Session::Direct)
            }
        };
        let opened = if self.watch.locate.is_some() {
            tokio::pin!(opening);
            tokio::select! {
                opened = &mut opening => opened,
                () = tokio::time::sleep(SLOW_SESSION) => {
                    self.watch.wake_locator();
                    opening.await
                }
            }
        } else {
            opening.await
        };
        opened.map_err(|e| self.watch.seen(e.into()))
    }
}

/// How long getting a session may take before the locator of a multi-host target looks for
/// the primary (a healthy pool hands out a connection in microseconds, or waits for a busy one).
const SLOW_SESSION: Duration = Duration::from_millis(500);

/// `BEGIN READ WRITE` (a standby refuses it with SQLSTATE 25006 at once) and, for the rest of
/// the transaction, the fence's time limits and [`PG_SESSION_SETUP`]'s planner settings: one
/// simple query, one round trip.
fn begin_with_settings(statement: Duration, lock: Duration) -> String {
    let planner = PG_SESSION_SETUP.replace("SET ", "SET LOCAL ");
    format!(
        "BEGIN READ WRITE; SET LOCAL statement_timeout = {}; SET LOCAL lock_timeout = {}; {planner}",
        pg_ms(statement),
        pg_ms(lock)
    )
}

/// Where one or more fence statements run: a connection of the pool (straight to PostgreSQL),
/// or a transaction that carries the fence's settings (behind a pooler, where a transaction is
/// the only thing that stays on one server session). Statements run on it as on a
/// `PgConnection`; [`done`](Self::done) commits the transaction (dropping it rolls back).
pub(crate) enum Session {
    /// A pooled connection with the settings in its session.
    Direct(PoolConnection<Postgres>),
    /// A transaction begun with [`Route::begin_text`].
    Pooled(Transaction<'static, Postgres>),
}

impl Session {
    /// Ends the session: commits its transaction when pooled.
    pub(crate) async fn done(self) -> Result<()> {
        match self {
            Session::Direct(_) => Ok(()),
            Session::Pooled(tx) => Ok(tx.commit().await?),
        }
    }
}

impl std::ops::Deref for Session {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match self {
            Session::Direct(c) => c,
            Session::Pooled(t) => t,
        }
    }
}

impl std::ops::DerefMut for Session {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match self {
            Session::Direct(c) => c,
            Session::Pooled(t) => t,
        }
    }
}

/// What the fence learns about where its sessions are: a session of a server that is not (or
/// no longer) a primary is never reused, and a multi-host target looks for the primary again.
///
/// Every connection of a fence pool is checked when it opens (`pg_is_in_recovery()`,
/// `transaction_read_only`: see [`check_primary`]); a connection that turns out to be on a
/// standby is closed and the pool connects again. A statement that fails because the server is
/// read-only (SQLSTATE 25006, or "recovery is in progress") marks every connection opened up to
/// then as not to be reused: each is closed at its next acquire instead of being handed out.
#[derive(Debug)]
pub(crate) struct PrimaryWatch {
    started: Instant,
    /// Connections opened before this many nanoseconds after `started` are closed at their next
    /// acquire (0: none).
    distrust_before: AtomicU64,
    /// Wakes the locator of a multi-host target (none for one host).
    locate: Option<Arc<tokio::sync::Notify>>,
}

impl PrimaryWatch {
    pub(crate) fn new(locate: Option<Arc<tokio::sync::Notify>>) -> Arc<Self> {
        Arc::new(Self { started: Instant::now(), distrust_before: AtomicU64::new(0), locate })
    }

    fn now_nanos(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// Every connection opened until now is closed at its next acquire.
    pub(crate) fn distrust_open_connections(&self) {
        self.distrust_before.fetch_max(self.now_nanos(), Ordering::Relaxed);
    }

    /// Whether a connection `age` old may be handed out.
    fn trusts(&self, age: Duration) -> bool {
        let opened = self.now_nanos().saturating_sub(u64::try_from(age.as_nanos()).unwrap_or(u64::MAX));
        opened >= self.distrust_before.load(Ordering::Relaxed)
    }

    /// Looks at an error of a fence statement: a server that is not a primary makes the open
    /// connections untrusted; that or a connection that failed wakes the locator. Returns the
    /// error as it came.
    pub(crate) fn seen(&self, e: FenceError) -> FenceError {
        if e.is_not_primary() {
            self.distrust_open_connections();
            tracing::warn!(error = %e, "the server is not a primary: its sessions will not be reused");
        }
        if (e.is_not_primary() || e.is_connection_failure())
            && let Some(locate) = &self.locate
        {
            locate.notify_one();
        }
        e
    }

    /// A connection to a server that is not a primary was refused when it opened.
    fn refused_standby(&self) {
        self.wake_locator();
    }

    /// Asks the locator (of a multi-host target) to look for the primary.
    fn wake_locator(&self) {
        if let Some(locate) = &self.locate {
            locate.notify_one();
        }
    }
}

/// The query [`check_primary`] runs: true when the server will not take writes.
const NOT_PRIMARY: &str = "SELECT pg_is_in_recovery() OR current_setting('transaction_read_only') = 'on'";

/// Whether `conn` is on a server that takes writes (not in recovery, not read-only). A simple
/// query (one message, so one server session even behind a transaction pooler).
pub(crate) async fn is_primary(conn: &mut PgConnection) -> Result<bool> {
    use sqlx::Row as _;
    let row = sqlx::raw_sql(NOT_PRIMARY).fetch_one(&mut *conn).await?;
    Ok(!row.try_get::<bool, _>(0)?)
}

/// The pool options of a fence pool on `route`: straight to PostgreSQL, every new connection
/// runs [`PG_SESSION_SETUP`] and the primary check in one round trip; behind a pooler, only the
/// check (a session's settings would stay behind on the pooler's server connection for the next
/// client). A connection on a standby fails (the pool connects again); a connection opened before
/// the watch distrusted them is closed at acquire.
pub(crate) fn pool_options(pooled: bool, watch: &Arc<PrimaryWatch>) -> PgPoolOptions {
    let (on_connect, on_acquire) = (Arc::clone(watch), Arc::clone(watch));
    PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(10))
        .after_connect(move |conn, _| {
            let watch = Arc::clone(&on_connect);
            Box::pin(async move {
                let primary = if pooled { is_primary(conn).await } else { setup_and_check(conn).await };
                match primary {
                    Ok(true) => Ok(()),
                    Ok(false) => {
                        watch.refused_standby();
                        Err(sqlx::Error::Configuration(
                            "brokerfence: the server is a standby or read-only (pg_is_in_recovery() or \
                             transaction_read_only); the session is closed and the pool connects again"
                                .into(),
                        ))
                    }
                    Err(FenceError::Database(e)) => Err(e),
                    Err(e) => Err(sqlx::Error::Configuration(e.to_string().into())),
                }
            })
        })
        .before_acquire(move |_conn, meta| {
            let trusted = on_acquire.trusts(meta.age);
            Box::pin(async move { Ok(trusted) })
        })
}

/// [`PG_SESSION_SETUP`] and the primary check, one simple query.
async fn setup_and_check(conn: &mut PgConnection) -> Result<bool> {
    use futures::TryStreamExt as _;
    use sqlx::Row as _;
    let sql = format!("{PG_SESSION_SETUP}; {NOT_PRIMARY}");
    let mut rows = sqlx::raw_sql(AssertSqlSafe(sql)).fetch(&mut *conn);
    let mut not_primary = None;
    while let Some(row) = rows.try_next().await? {
        not_primary = Some(row.try_get::<bool, _>(0)?);
    }
    Ok(not_primary == Some(false))
}
