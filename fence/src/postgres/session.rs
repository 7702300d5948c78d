//! What every session of a fence is set up with: the planner settings ([`PG_SESSION_SETUP`]), the
//! server-side time limits ([`PgTimeouts`]), the time a connect probe may take and the schemes a
//! PostgreSQL URL may have.

use std::time::Duration;

/// What every connection of a fence pool runs once, when it opens (see [`PgFence::pool_options`](super::PgFence::pool_options)):
/// the planner may use only index scans and nested loops on that connection, so that a plan the
/// server keeps for a fence statement looks rows up by key whatever the jobs table looked like
/// when it was made, and it keeps that one plan from the first call on. Bitmap scans are off
/// too: on a jobs table that was never analyzed the planner guesses a row or two per queue, and
/// for `claim_next` it then picked a bitmap scan over every due row plus a sort (62–67 ms per
/// claim of ten with 76,000 jobs pending, the sort spilling to disk) over the index-order scan
/// that stops after ten rows. A pool built some other way starts from
/// [`PgFence::pool_options`](super::PgFence::pool_options), which runs it.
pub(crate) const PG_SESSION_SETUP: &str = "SET enable_seqscan = off; SET enable_bitmapscan = off; SET enable_hashjoin = off; \
                                     SET enable_mergejoin = off; SET plan_cache_mode = force_generic_plan";

/// The schemes [`PgFence::connect`](super::PgFence::connect) accepts, as its [`FenceError::UnsupportedScheme`](crate::FenceError::UnsupportedScheme) names them.
pub(super) const PG_SCHEMES: &str =
    "postgres:// or postgresql:// (PostgreSQL; for SQLite use SqliteFence::open with sqlite:PATH)";

/// How long the one direct connection attempt [`PgFence::connect`](super::PgFence::connect) and
/// [`PgFence::connect_with`](super::PgFence::connect_with) make before building their pool may take (10 s, the pool's acquire
/// timeout): past it the connect fails with [`FenceError::Unreachable`](crate::FenceError::Unreachable).
pub(crate) const CONNECT_PROBE_TIMEOUT: Duration = Duration::from_secs(10);

/// Server-side time limits of a fence's connections, sent as startup options of each connection
/// (`-c statement_timeout=… -c lock_timeout=…` in the startup packet): no statement pays an extra
/// round trip for them.
///
/// Fence statements touch a few rows by key and take milliseconds; one that waits longer for a
/// lock (a row held by a stalled transaction, a table lock queued by a migration) or runs longer
/// gives up with [`FenceError::LockTimeout`](crate::FenceError::LockTimeout) or [`FenceError::StatementTimeout`](crate::FenceError::StatementTimeout) instead of
/// hanging past the lease it serves. Nothing the statement wrote is kept; the caller retries.
///
/// The defaults fit the shortest lease ([`MIN_LEASE`](crate::MIN_LEASE), 3 s, renewed every
/// second): a heartbeat gives up after 1 s waiting for a lock (by then the next one is due) or
/// 2 s in all (a renewal that ends later than that renews a lease that may have ended already);
/// claims and commits wait at most 3 s for a lock and run at most 10 s. Longer leases can afford
/// longer limits; shorter limits than the defaults make spurious failures likelier on a loaded
/// server. (A [`Supervisor`](crate::Supervisor) also stops waiting for a heartbeat after one
/// heartbeat interval; these limits free the server's side of it.)
///
/// The main pool's limits also apply to what a caller runs on [`PgFence::pool`](super::PgFence::pool) connections (for
/// example the business statements of a [`complete_in`](super::PgFence::complete_in) transaction).
/// Migrations override both per transaction (see [`PgFence::migration_lock_timeout`](super::PgFence::migration_lock_timeout)).
/// Behind a transaction-mode pooler (PgBouncer), which refuses or drops startup options, the
/// fence sets the same limits at the start of every transaction instead (`SET LOCAL`, see
/// [`Pooler`](super::Pooler)); they hold there too.
///
/// ```no_run
/// # async fn demo() -> brokerfence::Result<()> {
/// use std::time::Duration;
/// use brokerfence::{PgFence, PgTimeouts};
/// let timeouts = PgTimeouts { lock: Duration::from_secs(10), statement: Duration::from_secs(30), ..PgTimeouts::default() };
/// let options: sqlx::postgres::PgConnectOptions = "postgres://127.0.0.1/jobs".parse()?;
/// let fence = PgFence::connect_with_timeouts(options, timeouts).await?;
/// # let _ = fence; Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PgTimeouts {
    /// `statement_timeout` of the main pool (claims, commits, fail, release, the ledger). Default 10 s.
    pub statement: Duration,
    /// `lock_timeout` of the main pool. Default 3 s.
    pub lock: Duration,
    /// `statement_timeout` of the heartbeat connections. Default 2 s.
    pub heartbeat_statement: Duration,
    /// `lock_timeout` of the heartbeat connections. Default 1 s (below the statement limit, so
    /// that a renewal stuck on a lock says so).
    pub heartbeat_lock: Duration,
    /// Connections reserved for heartbeats, apart from the main pool. Default 2 (a renewal in
    /// flight and the next one).
    pub heartbeat_connections: u32,
}

impl Default for PgTimeouts {
    fn default() -> Self {
        Self {
            statement: Duration::from_secs(10),
            lock: Duration::from_secs(3),
            heartbeat_statement: Duration::from_secs(2),
            heartbeat_lock: Duration::from_secs(1),
            heartbeat_connections: 2,
        }
    }
}

/// A duration as a PostgreSQL time setting in whole milliseconds, at least 1 (0 would mean "no limit").
pub(super) fn pg_ms(d: Duration) -> u128 {
    d.as_millis().max(1)
}

impl PgTimeouts {
    /// `options` with the main pool's limits added as startup options (later ones win, so these
    /// override a `statement_timeout` or `lock_timeout` already in `options`).
    pub fn apply(&self, options: sqlx::postgres::PgConnectOptions) -> sqlx::postgres::PgConnectOptions {
        options.options([("statement_timeout", pg_ms(self.statement)), ("lock_timeout", pg_ms(self.lock))])
    }

    /// `options` with the heartbeat connections' limits added as startup options.
    pub(crate) fn apply_heartbeat(
        &self,
        options: sqlx::postgres::PgConnectOptions,
    ) -> sqlx::postgres::PgConnectOptions {
        options.options([
            ("statement_timeout", pg_ms(self.heartbeat_statement)),
            ("lock_timeout", pg_ms(self.heartbeat_lock)),
        ])
    }
}
