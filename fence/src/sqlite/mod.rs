//! The SQLite backend: the embedded, single-host default, with the same semantics as PostgreSQL.
//!
//! SQLite has one writer at a time, so a claim is an `UPDATE … RETURNING` (or an upsert) inside a
//! `BEGIN IMMEDIATE` transaction; there are no network round trips to batch away, so batch forms
//! run one statement per key inside one transaction. Times are milliseconds on SQLite's clock
//! (`unixepoch('subsec')`), never the caller's.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::Connection;
use sqlx::sqlite::{
    SqliteAutoVacuum, SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};

use crate::error::{FenceError, Result};
use crate::guards::Guards;
use crate::key::{JobKey, QueueName};
use crate::lease::Lease;
use crate::schema::SchemaName;
use crate::store::default_max_claims;

mod maintenance;
mod statements;
mod store;

pub use maintenance::ReclaimReport;
use statements::{Statements, sql};

/// The fence on SQLite: one file, one host, no server.
///
/// ```no_run
/// # async fn demo() -> brokerfence::Result<()> {
/// use brokerfence::{FenceStore, SqliteFence};
/// let fence = SqliteFence::open("sqlite:brokerfence.db").await?;
/// fence.migrate().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqliteFence {
    pool: SqlitePool,
    schema: SchemaName,
    guards: Guards,
    pub(crate) stmts: Arc<Statements>,
    max_claims: i64,
    /// Wakes this store's consumers (and its clones') after its own writes (see `crate::wake`).
    wake: Arc<crate::wake::Hub>,
}

/// How far a SQLite commit has reached the disk when it returns (`PRAGMA synchronous` in WAL
/// mode).
///
/// - [`Full`](Self::Full), the default: the WAL is synced at every commit. A commit that
///   returned survives a power loss or an OS crash.
/// - [`Normal`](Self::Normal): the WAL is synced only at checkpoints. Still safe against a crash
///   of the process, but a power loss or OS crash can roll back the last commits. For the fence
///   that means a completion can vanish after its broker message was acknowledged (the job runs
///   again), and a claim can vanish after its lease was handed out, so the same epoch can be
///   handed out twice: two holders with one fencing token. Use it only where the machine's
///   storage survives power loss (or losing the newest commits is acceptable), for the
///   throughput it buys (measured in the README).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SqliteDurability {
    /// `synchronous = FULL`: a returned commit is on disk.
    #[default]
    Full,
    /// `synchronous = NORMAL`: the newest commits can be lost at a power loss (see above).
    Normal,
}

impl std::fmt::Debug for SqliteFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqliteFence")
            .field("schema", &self.schema)
            .field("guards", &self.guards)
            .finish_non_exhaustive()
    }
}

/// A file that could not be opened, named, with its missing directory when that is why (SQLite
/// itself says only "(code: 14) unable to open database file").
fn open_error(file: &std::path::Path, source: sqlx::Error) -> FenceError {
    let missing_dir = file.parent().filter(|d| !d.as_os_str().is_empty() && !d.exists());
    let reason = match missing_dir {
        Some(dir) => {
            format!("the directory {} does not exist (SQLite creates the file, not its directory)", dir.display())
        }
        None => source.to_string(),
    };
    FenceError::SqliteOpen { path: file.display().to_string(), reason, source }
}

impl SqliteFence {
    /// The schema version this build needs (its newest migration): what `migrate` brings a
    /// schema to and `check_schema` asks for.
    ///
    /// ```
    /// assert!(brokerfence::SqliteFence::SCHEMA_VERSION >= 5);
    /// ```
    pub const SCHEMA_VERSION: i64 = statements::REQUIRED_VERSION;

    /// Opens (creating if missing) a database file: `sqlite:path.db` or `sqlite::memory:`.
    /// WAL journal, a 10 s busy timeout, `synchronous = FULL` (every commit synced, see
    /// [`SqliteDurability`]). A URL of another scheme (`postgres://`, `mysql://`, or a bare path)
    /// fails at once with [`FenceError::UnsupportedScheme`]; a file that cannot be opened or
    /// created (its directory missing, no permission) with [`FenceError::SqliteOpen`], naming it.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// let err = brokerfence::SqliteFence::open("mysql://root@127.0.0.1/jobs").await.unwrap_err();
    /// assert!(matches!(err, brokerfence::FenceError::UnsupportedScheme { ref scheme, .. } if scheme == "mysql"));
    /// # }
    /// ```
    pub async fn open(url: &str) -> Result<Self> {
        Self::open_with(url, SqliteDurability::Full).await
    }

    /// [`open`](Self::open) with an explicit durability: [`SqliteDurability::Normal`] trades
    /// the newest commits at a power loss for throughput.
    ///
    /// ```no_run
    /// # async fn demo() -> brokerfence::Result<()> {
    /// use brokerfence::{SqliteDurability, SqliteFence};
    /// // Only on storage that survives power loss, or where losing the last commits is acceptable.
    /// let fence = SqliteFence::open_with("sqlite:brokerfence.db", SqliteDurability::Normal).await?;
    /// # let _ = fence; Ok(()) }
    /// ```
    pub async fn open_with(url: &str, durability: SqliteDurability) -> Result<Self> {
        // sqlx would take any other string as a file name (`mysql://host/db` a file in `mysql:`).
        crate::error::require_scheme(
            url,
            &["sqlite"],
            "sqlite:PATH (a file /var/lib/app/jobs.db is sqlite:/var/lib/app/jobs.db) or sqlite::memory: \
             (SQLite; for PostgreSQL use PgFence::connect)",
        )?;
        let memory = url.contains(":memory:") || url.contains("mode=memory");
        let synchronous = match durability {
            SqliteDurability::Full => SqliteSynchronous::Full,
            SqliteDurability::Normal => SqliteSynchronous::Normal,
        };
        let opts = SqliteConnectOptions::from_str(url)?
            .create_if_missing(true)
            .journal_mode(if memory { SqliteJournalMode::Memory } else { SqliteJournalMode::Wal })
            .synchronous(synchronous)
            .busy_timeout(Duration::from_secs(10));
        // A file this call creates is made `auto_vacuum = INCREMENTAL` (so that pruned pages can
        // be given back, see `reclaim_space`) by one connection that sets it before anything
        // else (SQLite accepts it only before the file's first page is written, which switching
        // to WAL does). Not on every connection: on an existing file the pragma begins a write
        // transaction, so opening a connection would wait for the write lock.
        let file = opts.get_filename().to_path_buf();
        let cannot_open = |e: sqlx::Error| if memory { FenceError::from(e) } else { open_error(&file, e) };
        let new_file = !memory && std::fs::metadata(&file).map(|m| m.len() == 0).unwrap_or(true);
        if new_file {
            let first = opts.clone().auto_vacuum(SqliteAutoVacuum::Incremental);
            // Its pragmas run in order: auto_vacuum, then WAL, which writes the first page.
            let conn = sqlx::ConnectOptions::connect(&first).await.map_err(cannot_open)?;
            conn.close().await?;
        }
        // An in-memory database lives in one connection; a file serves several readers.
        let pool = SqlitePoolOptions::new()
            .max_connections(if memory { 1 } else { 8 })
            .connect_with(opts)
            .await
            .map_err(cannot_open)?;
        Ok(Self::new(pool))
    }

    /// Uses an existing pool, with the default schema (table prefix).
    pub fn new(pool: SqlitePool) -> Self {
        let schema = SchemaName::default();
        let guards = Guards::default();
        let stmts = Arc::new(Statements::new(&schema, guards));
        Self { pool, schema, guards, stmts, max_claims: default_max_claims(), wake: crate::wake::Hub::local() }
    }

    /// After a write through this store committed that made a job of `queue` due: wakes the
    /// consumers of this store (and its clones) in this process (see `crate::wake`).
    pub(crate) fn wake_here(&self, queue: &QueueName, delay: std::time::Duration) {
        self.wake.wake(queue.as_str(), delay);
    }

    /// Caps the claims of one job at `n` (at least 1; default 20): a claim that would exceed it
    /// makes the job dead, with the last error "claimed N times without finishing (max_claims =
    /// M)", and answers [`Claim::Dead`](crate::Claim::Dead). See [`PgFence::max_claims`](crate::PgFence::max_claims).
    pub fn max_claims(mut self, n: i64) -> Self {
        self.max_claims = n.max(1);
        self
    }

    /// The cap on claims of one job.
    pub fn get_max_claims(&self) -> i64 {
        self.max_claims
    }

    /// Uses another table prefix.
    pub fn schema(mut self, schema: SchemaName) -> Self {
        self.stmts = Arc::new(Statements::new(&schema, self.guards));
        self.schema = schema;
        self.wake = crate::wake::Hub::local();
        self
    }

    /// TEST ONLY (feature `guard-switches`): runs with some guards switched off.
    #[cfg(feature = "guard-switches")]
    #[doc(hidden)]
    pub fn guards(mut self, guards: Guards) -> Self {
        self.stmts = Arc::new(Statements::new(&self.schema, guards));
        self.guards = guards;
        self
    }

    /// The guards in force.
    #[doc(hidden)]
    pub fn get_guards(&self) -> Guards {
        self.guards
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The table prefix.
    pub fn get_schema(&self) -> &SchemaName {
        &self.schema
    }

    /// [`complete`](crate::FenceStore::complete) inside the caller's transaction, so that the caller's own
    /// rows commit together with the result or not at all. Inside a supervised handler, call
    /// [`JobContext::complete_in`](crate::JobContext::complete_in) instead.
    ///
    /// A [`Fenced`](crate::FenceError::Fenced) answer also makes the caller's transaction unable
    /// to commit: a deferred foreign-key violation is left in it, so `COMMIT` fails ("FOREIGN KEY
    /// constraint failed") and dropping the transaction rolls it back. A connection in
    /// autocommit or inside a savepoint (a nested `tx.begin()`) is refused with
    /// [`TransactionDepth`](crate::FenceError::TransactionDepth) before anything is written. On a connection with
    /// `PRAGMA foreign_keys = OFF` (sqlx turns it on by default) the transaction is rolled back
    /// at once instead, and statements the caller runs after ignoring the answer are outside any
    /// transaction. SQLite has one writer at a time: from the caller's first write on, its
    /// transaction holds the database's write lock, and every other writer (this worker's
    /// heartbeats included) waits for it, up to the busy timeout (10 s). Keep it short.
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::SqliteFence, lease: brokerfence::Lease) -> brokerfence::Result<()> {
    /// let mut tx = fence.pool().begin_with("BEGIN IMMEDIATE").await?;
    /// fence.complete_in(&mut tx, &lease, b"done").await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn complete_in(&self, conn: &mut SqliteConnection, lease: &Lease, result: &[u8]) -> Result<()> {
        if self.guards.own_tx_depth_check() {
            crate::own_tx::top_level::<sqlx::Sqlite>(conn)?;
        }
        let q = self.cas_query(&self.stmts.complete, lease).bind(result.to_vec());
        let row = q.fetch_optional(&mut *conn).await?;
        let answer = self.fenced_outcome(&mut *conn, lease, row).await.map(drop);
        if let Err(crate::FenceError::Fenced { .. }) = &answer
            && self.guards.fenced_tx_rollback()
        {
            let poisoned = poison_transaction(&mut *conn).await;
            tracing::debug!(key = %lease.key, epoch = lease.epoch, ?poisoned, "fenced complete_in: caller's transaction cannot commit");
        }
        answer
    }

    /// [`enqueue`](crate::FenceStore::enqueue) inside the caller's transaction: the job exists if and only
    /// if the caller's transaction commits. Says whether it inserted.
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::SqliteFence) -> brokerfence::Result<()> {
    /// use brokerfence::{JobKey, QueueName};
    /// let mut tx = fence.pool().begin_with("BEGIN IMMEDIATE").await?;
    /// fence.enqueue_in(&mut tx, &QueueName::new("emails")?, &JobKey::new("o-1/confirm")?, b"o-1").await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn enqueue_in(
        &self,
        conn: &mut SqliteConnection,
        queue: &QueueName,
        key: &JobKey,
        payload: &[u8],
    ) -> Result<bool> {
        Ok(self.enqueue_many_in(conn, queue, &[(key.clone(), payload.to_vec())]).await? == 1)
    }

    /// [`enqueue_many`](crate::FenceStore::enqueue_many) inside the caller's transaction; returns how many
    /// were new.
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::SqliteFence) -> brokerfence::Result<()> {
    /// use brokerfence::{JobKey, QueueName};
    /// let mut tx = fence.pool().begin_with("BEGIN IMMEDIATE").await?;
    /// let jobs = vec![(JobKey::new("a")?, b"1".to_vec()), (JobKey::new("b")?, b"2".to_vec())];
    /// fence.enqueue_many_in(&mut tx, &QueueName::new("q")?, &jobs).await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn enqueue_many_in(
        &self,
        conn: &mut SqliteConnection,
        queue: &QueueName,
        jobs: &[(JobKey, Vec<u8>)],
    ) -> Result<u64> {
        let mut inserted = 0;
        let (traceparent, tracestate) = crate::store::producer_trace();
        for (key, payload) in jobs {
            inserted += sqlx::query(sql(&self.stmts.enqueue))
                .bind(queue.as_str().to_owned())
                .bind(key.as_str().to_owned())
                .bind(payload.clone())
                .bind(traceparent.clone())
                .bind(tracestate.clone())
                .execute(&mut *conn)
                .await?
                .rows_affected();
        }
        Ok(inserted)
    }

    fn cas_query<'q>(
        &self,
        stmt: &Arc<str>,
        lease: &Lease,
    ) -> sqlx::query::QueryScalar<'q, sqlx::Sqlite, String, sqlx::sqlite::SqliteArguments> {
        sqlx::query_scalar::<_, String>(sql(stmt))
            .bind(lease.queue.as_str().to_owned())
            .bind(lease.key.as_str().to_owned())
            .bind(lease.owner.as_str().to_owned())
            .bind(lease.epoch)
    }

    async fn fenced_outcome(&self, conn: &mut SqliteConnection, lease: &Lease, row: Option<String>) -> Result<String> {
        match row {
            Some(r) => Ok(r),
            None => {
                let current: Option<(i64, Option<String>)> = sqlx::query_as(sql(&self.stmts.current))
                    .bind(lease.queue.as_str().to_owned())
                    .bind(lease.key.as_str().to_owned())
                    .fetch_optional(&mut *conn)
                    .await?;
                let (current_epoch, current_owner) = current.unwrap_or((0, None));
                Err(FenceError::Fenced {
                    key: lease.key.as_str().to_owned(),
                    epoch: lease.epoch,
                    current_epoch,
                    current_owner,
                })
            }
        }
    }

    async fn fenced<F>(&self, stmt: &Arc<str>, lease: &Lease, extra: F) -> Result<String>
    where
        F: for<'q> FnOnce(
            sqlx::query::QueryScalar<'q, sqlx::Sqlite, String, sqlx::sqlite::SqliteArguments>,
        ) -> sqlx::query::QueryScalar<'q, sqlx::Sqlite, String, sqlx::sqlite::SqliteArguments>,
    {
        let mut conn = self.pool.acquire().await?;
        let row = extra(self.cas_query(stmt, lease)).fetch_optional(&mut *conn).await?;
        self.fenced_outcome(&mut conn, lease, row).await
    }
}

/// Leaves the caller's transaction unable to commit after a fenced `complete_in`: a row that
/// violates a deferred foreign key, in temporary tables of this connection (created, and undone,
/// with the transaction), so that `COMMIT` fails and the rows go with the rollback. Without
/// foreign keys enforced on the connection, rolls the transaction back at once instead.
async fn poison_transaction(conn: &mut SqliteConnection) -> Result<()> {
    let enforced: i64 = sqlx::query_scalar("PRAGMA foreign_keys").fetch_one(&mut *conn).await?;
    let statement = if enforced == 1 {
        "CREATE TEMP TABLE IF NOT EXISTS brokerfence_fenced_parent (id INTEGER PRIMARY KEY); \
         CREATE TEMP TABLE IF NOT EXISTS brokerfence_fenced (parent INTEGER \
             REFERENCES brokerfence_fenced_parent (id) DEFERRABLE INITIALLY DEFERRED); \
         INSERT INTO brokerfence_fenced (parent) VALUES (1);"
    } else {
        "ROLLBACK"
    };
    sqlx::raw_sql(statement).execute(&mut *conn).await?;
    Ok(())
}
