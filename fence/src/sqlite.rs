//! The SQLite backend: the embedded, single-host default, with the same semantics as PostgreSQL.
//!
//! SQLite has one writer at a time, so a claim is an `UPDATE … RETURNING` (or an upsert) inside a
//! `BEGIN IMMEDIATE` transaction; there are no network round trips to batch away, so batch forms
//! run one statement per key inside one transaction. Times are milliseconds on SQLite's clock
//! (`unixepoch('subsec')`), never the caller's.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{
    SqliteAutoVacuum, SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePool, SqlitePoolOptions,
    SqliteSynchronous,
};
use sqlx::{AssertSqlSafe, Connection};
use tracing::Instrument;

use crate::error::{FenceError, Result};
use crate::guards::Guards;
use crate::key::{JobKey, Owner, QueueName};
use crate::model::{
    Claim, ClaimedJob, DbTime, FailOutcome, Heartbeat, JobRecord, Lease, LeaseDuration, RetryPolicy, millis,
};
use crate::schema::{Migration, SchemaName, render};
use crate::store::claim_outcome;
use crate::store::{
    FenceStore, JobRow, backoff_ms, default_max_claims, distinct_keys, fail_outcome, job_record, schema_verdict,
    split_heartbeat,
};

/// The database clock in milliseconds.
const NOW: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

const MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "jobs and ledger",
        statements: &[
            "CREATE TABLE {s}_jobs (
            queue       TEXT    NOT NULL,
            key         TEXT    NOT NULL,
            state       TEXT    NOT NULL DEFAULT 'pending'
                        CHECK (state IN ('pending', 'running', 'completed', 'failed', 'dead')),
            epoch       INTEGER NOT NULL DEFAULT 0 CHECK (epoch >= 0),
            owner       TEXT,
            lease_until INTEGER,
            attempts    INTEGER NOT NULL DEFAULT 0,
            run_at      INTEGER NOT NULL,
            payload     BLOB,
            progress    BLOB,
            result      BLOB,
            last_error  TEXT,
            created_at  INTEGER NOT NULL,
            updated_at  INTEGER NOT NULL,
            PRIMARY KEY (queue, key)
        )",
            "CREATE INDEX {s}_jobs_due ON {s}_jobs (queue, run_at) WHERE state IN ('pending', 'failed')",
            "CREATE INDEX {s}_jobs_leased ON {s}_jobs (queue, lease_until) WHERE state = 'running'",
            "CREATE TRIGGER {s}_jobs_epoch_never_decreases BEFORE UPDATE OF epoch ON {s}_jobs
         WHEN NEW.epoch < OLD.epoch
         BEGIN SELECT RAISE(ABORT, 'brokerfence: epoch would decrease'); END",
            "CREATE TABLE {s}_ledger (
            scope      TEXT    NOT NULL,
            job        TEXT    NOT NULL,
            epoch      INTEGER NOT NULL,
            updated_at INTEGER NOT NULL,
            PRIMARY KEY (scope, job)
        )",
        ],
    },
    Migration {
        version: 2,
        name: "failures apart from claims",
        // A constant default: SQLite only rewrites the schema text, not the rows.
        statements: &["ALTER TABLE {s}_jobs ADD COLUMN failures INTEGER NOT NULL DEFAULT 0"],
    },
    Migration {
        version: 3,
        name: "retention and epoch floors",
        // The per-queue epoch floor pruning raises (see `crate::retention`), and the indexes the
        // pruner reads: finished jobs by (queue, state, age), ledger rows by (scope, age). Index
        // builds hold the write lock while they read the table (one writer at a time anyway).
        statements: &[
            "CREATE TABLE IF NOT EXISTS {s}_epoch_floors (
            queue      TEXT    PRIMARY KEY,
            floor      INTEGER NOT NULL CHECK (floor >= 0),
            updated_at INTEGER NOT NULL
        )",
            "CREATE INDEX IF NOT EXISTS {s}_jobs_finished ON {s}_jobs (queue, state, updated_at) \
             WHERE state IN ('completed', 'dead')",
            "CREATE INDEX IF NOT EXISTS {s}_ledger_age ON {s}_ledger (scope, updated_at)",
        ],
    },
];

/// The migration version this build needs: the newest embedded migration.
const REQUIRED_VERSION: i64 = MIGRATIONS[MIGRATIONS.len() - 1].version;

/// The SET list of a claim by `owner` until `lease_end`, with the cap on claims (`cap`, a
/// parameter): a claim that would exceed it makes the job dead instead (epoch and owner kept),
/// naming the cap in `last_error`. `t` is the prefix of the old row's columns. As on PostgreSQL
/// (see `postgres::capped_claim`), `updated_at` changes only when the claim makes the job dead.
fn capped_claim(t: &str, owner: &str, lease_end: &str, cap: &str, inc: &str) -> String {
    let over = format!("{t}attempts >= {cap}");
    format!(
        "state = CASE WHEN {over} THEN 'dead' ELSE 'running' END, \
         epoch = CASE WHEN {over} THEN {t}epoch ELSE {t}epoch + {inc} END, \
         owner = CASE WHEN {over} THEN {t}owner ELSE {owner} END, \
         lease_until = CASE WHEN {over} THEN NULL ELSE {lease_end} END, \
         attempts = CASE WHEN {over} THEN {t}attempts ELSE {t}attempts + 1 END, \
         last_error = CASE WHEN {over} THEN 'claimed ' || {t}attempts || \
           ' times without finishing (max_claims = ' || {cap} || ')' ELSE {t}last_error END, \
         updated_at = CASE WHEN {over} THEN {NOW} ELSE {t}updated_at END"
    )
}

#[derive(Debug)]
pub(crate) struct Statements {
    claim: Arc<str>,
    claim_seen: Arc<str>,
    enqueue: Arc<str>,
    claim_next: Arc<str>,
    heartbeat: Arc<str>,
    checkpoint: Arc<str>,
    complete: Arc<str>,
    fail: Arc<str>,
    release: Arc<str>,
    current: Arc<str>,
    job: Arc<str>,
    pub(crate) ledger_accept: Arc<str>,
    pub(crate) ledger_current: Arc<str>,
    prune_jobs: Arc<str>,
    raise_floor: Arc<str>,
    pub(crate) prune_ledger: Arc<str>,
}

impl Statements {
    fn new(schema: &SchemaName, guards: Guards) -> Self {
        let s = schema.as_str();
        let inc = if guards.epoch_increment { "1" } else { "0" };
        let cas = if guards.commit_cas {
            "queue = ?1 AND key = ?2 AND owner = ?3 AND epoch = ?4 AND state = 'running'"
        } else {
            "queue = ?1 AND key = ?2"
        };
        let hb_cas = if guards.heartbeat_cas {
            "queue = ?1 AND key = ?2 AND epoch = ?3 AND owner = ?4 AND state = 'running'"
        } else {
            "queue = ?1 AND key = ?2"
        };
        let ledger_where = if guards.ledger_check { "WHERE epoch <= excluded.epoch" } else { "" };
        // The queue's epoch floor (0 without a row): one primary-key probe.
        let floor = format!("coalesce((SELECT f.floor FROM {s}_epoch_floors f WHERE f.queue = ?1), 0)");
        let claim = format!(
            "INSERT INTO {s}_jobs AS t (queue, key, state, epoch, owner, lease_until, attempts, run_at, created_at, updated_at) \
             VALUES (?1, ?2, 'running', {floor} + 1, ?3, {NOW} + ?4, 1, {NOW}, {NOW}, {NOW}) \
             ON CONFLICT (queue, key) DO UPDATE SET {capped} \
             WHERE t.state = 'pending' OR (t.state = 'failed' AND t.run_at <= {NOW}) \
                OR (t.state = 'running' AND t.lease_until < {NOW}) \
             RETURNING key, CASE WHEN state = 'dead' THEN 'dead' ELSE 'claimed' END, epoch, owner, lease_until, \
               lease_until - {NOW}, attempts, run_at - {NOW}",
            capped = capped_claim("t.", "excluded.owner", "excluded.lease_until", "?5", inc),
        );
        // SQLite has one writer at a time: the floor read here and the pruner's delete never
        // interleave (both run in `BEGIN IMMEDIATE` transactions).
        let claim_seen = format!(
            "SELECT key, state, epoch, owner, lease_until, lease_until - {NOW}, attempts, run_at - {NOW} \
             FROM {s}_jobs WHERE queue = ?1 AND key = ?2"
        );
        let enqueue = format!(
            "INSERT INTO {s}_jobs (queue, key, state, epoch, payload, run_at, created_at, updated_at) \
             VALUES (?1, ?2, 'pending', {floor}, ?3, {NOW}, {NOW}, {NOW}) ON CONFLICT (queue, key) DO NOTHING"
        );
        let claim_next = format!(
            "UPDATE {s}_jobs SET {capped} \
             WHERE rowid IN (SELECT rowid FROM {s}_jobs WHERE queue = ?1 AND \
               ((state IN ('pending', 'failed') AND run_at <= {NOW}) OR (state = 'running' AND lease_until < {NOW})) \
               ORDER BY state = 'running' DESC, run_at LIMIT ?4) \
             RETURNING key, state, epoch, lease_until, lease_until - {NOW}, attempts, payload, progress",
            capped = capped_claim("", "?2", &format!("{NOW} + ?3"), "?5", inc),
        );
        let heartbeat = format!(
            "UPDATE {s}_jobs SET lease_until = {NOW} + ?5, updated_at = {NOW} WHERE {hb_cas} \
             RETURNING queue, key, {epoch}, {owner}, lease_until, lease_until - {NOW}",
            epoch = if guards.heartbeat_cas { "epoch" } else { "?3" },
            owner = if guards.heartbeat_cas { "owner" } else { "?4" }
        );
        let checkpoint = format!("UPDATE {s}_jobs SET progress = ?5, updated_at = {NOW} WHERE {cas} RETURNING ''");
        let complete = format!(
            "UPDATE {s}_jobs SET state = 'completed', result = ?5, lease_until = NULL, updated_at = {NOW} \
             WHERE {cas} RETURNING ''"
        );
        let fail = format!(
            "UPDATE {s}_jobs SET state = CASE WHEN ?5 AND failures + 1 < ?6 THEN 'failed' ELSE 'dead' END, \
             failures = failures + 1, run_at = {NOW} + min(?9, ?7 << min(failures, 30)), \
             last_error = CASE WHEN ?5 AND failures + 1 >= ?6 \
               THEN 'failed ' || (failures + 1) || ' times (max_attempts = ' || ?6 || '): ' || ?8 ELSE ?8 END, \
             lease_until = NULL, updated_at = {NOW} WHERE {cas} \
             RETURNING state || ':' || min(?9, ?7 << min(failures - 1, 30))"
        );
        let release = format!(
            "UPDATE {s}_jobs SET state = 'pending', attempts = max(attempts - 1, 0), lease_until = NULL, \
             run_at = {NOW}, updated_at = {NOW} WHERE {cas} RETURNING ''"
        );
        let current = format!("SELECT epoch, owner FROM {s}_jobs WHERE queue = ?1 AND key = ?2");
        let job = format!(
            "SELECT state, epoch, owner, lease_until, attempts, failures, run_at, payload, progress, result, last_error \
             FROM {s}_jobs WHERE queue = ?1 AND key = ?2"
        );
        let ledger_accept = format!(
            "INSERT INTO {s}_ledger (scope, job, epoch, updated_at) VALUES (?1, ?2, ?3, {NOW}) \
             ON CONFLICT (scope, job) DO UPDATE SET epoch = excluded.epoch, updated_at = excluded.updated_at \
             {ledger_where} RETURNING epoch"
        );
        let ledger_current = format!("SELECT epoch FROM {s}_ledger WHERE scope = ?1 AND job = ?2");
        // ?1 queue, ?2 state, ?3 age ms, ?4 rows: the oldest finished rows by `jobs_finished`
        // (the literal state list lets the planner use the partial index).
        let prune_jobs = format!(
            "DELETE FROM {s}_jobs WHERE rowid IN (SELECT rowid FROM {s}_jobs \
               WHERE queue = ?1 AND state IN ('completed', 'dead') AND state = ?2 AND updated_at < {NOW} - ?3 \
               ORDER BY updated_at LIMIT ?4) RETURNING epoch"
        );
        let raise_floor = format!(
            "INSERT INTO {s}_epoch_floors (queue, floor, updated_at) VALUES (?1, ?2, {NOW}) \
             ON CONFLICT (queue) DO UPDATE SET floor = max(floor, excluded.floor), updated_at = excluded.updated_at"
        );
        let prune_ledger = format!(
            "DELETE FROM {s}_ledger WHERE rowid IN (SELECT rowid FROM {s}_ledger \
               WHERE scope = ?1 AND updated_at < {NOW} - ?2 ORDER BY updated_at LIMIT ?3)"
        );
        Self {
            claim: claim.into(),
            claim_seen: claim_seen.into(),
            enqueue: enqueue.into(),
            claim_next: claim_next.into(),
            heartbeat: heartbeat.into(),
            checkpoint: checkpoint.into(),
            complete: complete.into(),
            fail: fail.into(),
            release: release.into(),
            current: current.into(),
            job: job.into(),
            ledger_accept: ledger_accept.into(),
            ledger_current: ledger_current.into(),
            prune_jobs: prune_jobs.into(),
            raise_floor: raise_floor.into(),
            prune_ledger: prune_ledger.into(),
        }
    }
}

fn sql(s: &Arc<str>) -> AssertSqlSafe<Arc<str>> {
    // Every statement is rendered from constant text plus the validated schema name.
    AssertSqlSafe(Arc::clone(s))
}

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

impl SqliteFence {
    /// Opens (creating if missing) a database file: `sqlite:path.db` or `sqlite::memory:`.
    /// WAL journal, a 10 s busy timeout, `synchronous = FULL` (every commit synced, see
    /// [`SqliteDurability`]). A URL of another scheme (`postgres://`, `mysql://`, or a bare path)
    /// fails at once with [`FenceError::UnsupportedScheme`].
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
            "sqlite:PATH or sqlite::memory: (SQLite; for PostgreSQL use PgFence::connect)",
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
        let file = opts.get_filename();
        let new_file = !memory && std::fs::metadata(file).map(|m| m.len() == 0).unwrap_or(true);
        if new_file {
            let first = opts.clone().auto_vacuum(SqliteAutoVacuum::Incremental);
            // Its pragmas run in order: auto_vacuum, then WAL, which writes the first page.
            let conn = sqlx::ConnectOptions::connect(&first).await?;
            conn.close().await?;
        }
        // An in-memory database lives in one connection; a file serves several readers.
        let pool = SqlitePoolOptions::new().max_connections(if memory { 1 } else { 8 }).connect_with(opts).await?;
        Ok(Self::new(pool))
    }

    /// Uses an existing pool, with the default schema (table prefix).
    pub fn new(pool: SqlitePool) -> Self {
        let schema = SchemaName::default();
        let guards = Guards::default();
        let stmts = Arc::new(Statements::new(&schema, guards));
        Self { pool, schema, guards, stmts, max_claims: default_max_claims() }
    }

    /// Caps the claims of one job at `n` (at least 1; default 20): a claim that would exceed it
    /// makes the job dead, with the last error "claimed N times without finishing (max_claims =
    /// M)", and answers [`Claim::Dead`]. See [`PgFence::with_max_claims`](crate::PgFence::with_max_claims).
    pub fn with_max_claims(mut self, n: i64) -> Self {
        self.max_claims = n.max(1);
        self
    }

    /// The cap on claims of one job.
    pub fn max_claims(&self) -> i64 {
        self.max_claims
    }

    /// Uses another table prefix.
    pub fn with_schema(mut self, schema: SchemaName) -> Self {
        self.stmts = Arc::new(Statements::new(&schema, self.guards));
        self.schema = schema;
        self
    }

    /// TEST ONLY (feature `guard-switches`): runs with some guards switched off.
    #[cfg(feature = "guard-switches")]
    #[doc(hidden)]
    pub fn with_guards(mut self, guards: Guards) -> Self {
        self.stmts = Arc::new(Statements::new(&self.schema, guards));
        self.guards = guards;
        self
    }

    /// The guards in force.
    pub fn guards(&self) -> Guards {
        self.guards
    }

    /// The pool.
    pub fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    /// The table prefix.
    pub fn schema(&self) -> &SchemaName {
        &self.schema
    }

    /// [`complete`](FenceStore::complete) inside the caller's transaction, so that the caller's own
    /// rows commit together with the result or not at all. Inside a supervised handler, call
    /// [`JobContext::complete_in`](crate::JobContext::complete_in) instead.
    ///
    /// A [`Fenced`](crate::FenceError::Fenced) answer also makes the caller's transaction unable
    /// to commit: a deferred foreign-key violation is left in it, so `COMMIT` fails ("FOREIGN KEY
    /// constraint failed") and dropping the transaction rolls it back. On a connection with
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

    /// [`enqueue`](FenceStore::enqueue) inside the caller's transaction: the job exists if and only
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

    /// [`enqueue_many`](FenceStore::enqueue_many) inside the caller's transaction; returns how many
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
        for (key, payload) in jobs {
            inserted += sqlx::query(sql(&self.stmts.enqueue))
                .bind(queue.as_str().to_owned())
                .bind(key.as_str().to_owned())
                .bind(payload.clone())
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

type ClaimRow = (String, String, i64, Option<String>, Option<i64>, Option<i64>, i64, Option<i64>);

/// What [`SqliteFence::reclaim_space`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReclaimReport {
    /// `PRAGMA auto_vacuum` of the file: 0 none, 1 full, 2 incremental. Only 2 gives pages back
    /// without a `VACUUM`.
    pub auto_vacuum: i64,
    /// Free pages in the file before.
    pub free_pages_before: i64,
    /// Free pages in the file after.
    pub free_pages_after: i64,
    /// Pages in the file after.
    pub pages_after: i64,
    /// Bytes per page.
    pub page_size: i64,
}

impl SqliteFence {
    /// Returns free pages (left by pruning, or any delete) to the file system: `PRAGMA
    /// incremental_vacuum(pages)` (`None`: every free page), then a passive WAL checkpoint, after
    /// which the file is shorter by the pages given back. It works on files whose `auto_vacuum`
    /// is `INCREMENTAL`:
    ///
    /// - **New files** are: [`open`](Self::open) makes a file it creates `auto_vacuum =
    ///   INCREMENTAL` before anything else is written to it.
    /// - **Existing files** made before (or by other tools) are `NONE`: there the setting only
    ///   changes with a full `VACUUM`, which [`enable_incremental_vacuum`](Self::enable_incremental_vacuum)
    ///   runs once. Until then this call gives nothing back (`auto_vacuum` = 0 in the report) and
    ///   SQLite reuses the free pages for new rows instead, so the file stops growing but does not
    ///   shrink.
    ///
    /// Each call holds the write lock while it moves pages; give a page count to bound it.
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::SqliteFence) -> brokerfence::Result<()> {
    /// let report = fence.reclaim_space(Some(10_000)).await?; // at most 10,000 pages per call
    /// println!("{} free pages left", report.free_pages_after);
    /// # Ok(()) }
    /// ```
    pub async fn reclaim_space(&self, pages: Option<u32>) -> Result<ReclaimReport> {
        let span = tracing::info_span!("fence.reclaim_space", backend = "sqlite", pages);
        async move {
            let mut conn = self.pool.acquire().await?;
            // freelist_count reads the file's header first: `auto_vacuum` answers from what this
            // connection last read, which is stale after another connection's VACUUM.
            let free_pages_before: i64 = sqlx::query_scalar("PRAGMA freelist_count").fetch_one(&mut *conn).await?;
            let auto_vacuum: i64 = sqlx::query_scalar("PRAGMA auto_vacuum").fetch_one(&mut *conn).await?;
            if auto_vacuum == 2 && free_pages_before > 0 {
                let n = pages.map_or(0, i64::from);
                // The pragma's argument cannot be a bound parameter; it is an integer we format.
                sqlx::raw_sql(AssertSqlSafe(format!("PRAGMA incremental_vacuum({n})"))).execute(&mut *conn).await?;
                sqlx::raw_sql("PRAGMA wal_checkpoint(PASSIVE)").execute(&mut *conn).await?;
            }
            let free_pages_after: i64 = sqlx::query_scalar("PRAGMA freelist_count").fetch_one(&mut *conn).await?;
            let pages_after: i64 = sqlx::query_scalar("PRAGMA page_count").fetch_one(&mut *conn).await?;
            let page_size: i64 = sqlx::query_scalar("PRAGMA page_size").fetch_one(&mut *conn).await?;
            let report = ReclaimReport { auto_vacuum, free_pages_before, free_pages_after, pages_after, page_size };
            tracing::info!(?report, "reclaimed space");
            Ok(report)
        }
        .instrument(span)
        .await
    }

    /// Makes an existing file give space back: `PRAGMA auto_vacuum = INCREMENTAL` and a full
    /// `VACUUM`, which rewrites the whole file. It holds the write lock for as long as that takes
    /// (every other writer, heartbeats included, waits up to the busy timeout, 10 s, then fails),
    /// and needs free disk space of up to twice the file. Run it once, in a maintenance window;
    /// afterwards [`reclaim_space`](Self::reclaim_space) works on the file.
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::SqliteFence) -> brokerfence::Result<()> {
    /// fence.enable_incremental_vacuum().await?;
    /// assert_eq!(fence.reclaim_space(None).await?.auto_vacuum, 2);
    /// # Ok(()) }
    /// ```
    pub async fn enable_incremental_vacuum(&self) -> Result<()> {
        let mut conn = self.pool.acquire().await?;
        sqlx::raw_sql("PRAGMA auto_vacuum = INCREMENTAL").execute(&mut *conn).await?;
        sqlx::raw_sql("VACUUM").execute(&mut *conn).await?;
        Ok(())
    }

    /// One batch of job pruning: one `BEGIN IMMEDIATE` transaction that deletes and raises the
    /// queue's epoch floor.
    async fn prune_jobs_batch(&self, queue: &QueueName, state: &str, age: Duration, batch: u32) -> Result<u64> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let epochs: Vec<i64> = sqlx::query_scalar(sql(&self.stmts.prune_jobs))
            .bind(queue.as_str().to_owned())
            .bind(state.to_owned())
            .bind(crate::retention::age_ms(age))
            .bind(i64::from(batch))
            .fetch_all(&mut *tx)
            .await?;
        if let Some(floor) = epochs.iter().max() {
            sqlx::query(sql(&self.stmts.raise_floor))
                .bind(queue.as_str().to_owned())
                .bind(*floor)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(epochs.len() as u64)
    }

    /// Prunes the ledger rows of `scope` older than `age`: (rows, batches).
    pub(crate) async fn prune_ledger_scope(
        &self,
        scope: &str,
        age: Duration,
        batch: u32,
        pause: Duration,
    ) -> Result<(u64, u64)> {
        let (mut rows, mut batches) = (0u64, 0u64);
        loop {
            let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
            let n = sqlx::query(sql(&self.stmts.prune_ledger))
                .bind(scope.to_owned())
                .bind(crate::retention::age_ms(age))
                .bind(i64::from(batch))
                .execute(&mut *tx)
                .await?
                .rows_affected();
            tx.commit().await?;
            rows += n;
            if n > 0 {
                batches += 1;
            }
            if n < u64::from(batch) {
                return Ok((rows, batches));
            }
            tokio::time::sleep(pause).await;
        }
    }

    async fn prune_all(&self, retention: &crate::Retention) -> Result<crate::PruneReport> {
        let mut report = crate::PruneReport::default();
        let batch = retention.batch();
        for (queue, state, age) in retention.targets() {
            loop {
                let n = self.prune_jobs_batch(queue, state, age, batch).await?;
                if state == "completed" {
                    report.completed += n;
                } else {
                    report.dead += n;
                }
                if n > 0 {
                    report.batches += 1;
                }
                if n < u64::from(batch) {
                    break;
                }
                tokio::time::sleep(retention.pause()).await;
            }
        }
        for (scope, age) in retention.ledger_scopes() {
            let (rows, batches) = self.prune_ledger_scope(scope, age, batch, retention.pause()).await?;
            report.ledger += rows;
            report.batches += batches;
        }
        Ok(report)
    }
}

#[async_trait]
impl FenceStore for SqliteFence {
    async fn migrate(&self) -> Result<()> {
        let s = self.schema.as_str();
        let mut conn = self.pool.acquire().await?;
        // IMMEDIATE takes the write lock at once: concurrent migrators queue behind it.
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {s}__migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, \
             applied_at INTEGER NOT NULL)"
        )))
        .execute(&mut *tx)
        .await?;
        let applied: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!("SELECT version FROM {s}__migrations")))
            .fetch_all(&mut *tx)
            .await?;
        for m in MIGRATIONS.iter().filter(|m| !applied.contains(&m.version)) {
            for stmt in m.statements {
                sqlx::query(AssertSqlSafe(render(stmt, &self.schema)))
                    .execute(&mut *tx)
                    .await
                    .map_err(|source| FenceError::Migration { version: m.version, name: m.name, source })?;
            }
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {s}__migrations (version, name, applied_at) VALUES (?1, ?2, {NOW})"
            )))
            .bind(m.version)
            .bind(m.name)
            .execute(&mut *tx)
            .await?;
            tracing::info!(schema = s, version = m.version, name = m.name, "applied migration");
        }
        tx.commit().await?;
        Ok(())
    }

    async fn check_schema(&self) -> Result<()> {
        let s = self.schema.as_str();
        let mut conn = self.pool.acquire().await?;
        let exists: i64 = sqlx::query_scalar("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1")
            .bind(format!("{s}__migrations"))
            .fetch_one(&mut *conn)
            .await?;
        let found: i64 = if exists == 0 {
            0
        } else {
            sqlx::query_scalar(AssertSqlSafe(format!("SELECT coalesce(max(version), 0) FROM {s}__migrations")))
                .fetch_one(&mut *conn)
                .await?
        };
        schema_verdict(found, REQUIRED_VERSION)
    }

    async fn claim_batch(
        &self,
        queue: &QueueName,
        keys: &[JobKey],
        owner: &Owner,
        lease: LeaseDuration,
    ) -> Result<Vec<Claim>> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let mut outcomes = std::collections::HashMap::new();
        for key in distinct_keys(keys) {
            let q = key.as_str().to_owned();
            let claimed: Option<ClaimRow> = sqlx::query_as(sql(&self.stmts.claim))
                .bind(queue.as_str().to_owned())
                .bind(q.clone())
                .bind(owner.as_str().to_owned())
                .bind(lease.as_millis_i64())
                .bind(self.max_claims)
                .fetch_optional(&mut *tx)
                .await?;
            let row = match claimed {
                Some(row) => row,
                None => {
                    sqlx::query_as(sql(&self.stmts.claim_seen))
                        .bind(queue.as_str().to_owned())
                        .bind(q)
                        .fetch_one(&mut *tx)
                        .await?
                }
            };
            outcomes.insert(key.as_str(), claim_outcome(queue, key, owner, &row)?);
        }
        tx.commit().await?;
        keys.iter()
            .map(|k| {
                outcomes
                    .get(k.as_str())
                    .cloned()
                    .ok_or_else(|| FenceError::Corrupt(format!("no claim outcome for {k}")))
            })
            .collect()
    }

    async fn enqueue_many(&self, queue: &QueueName, jobs: &[(JobKey, Vec<u8>)]) -> Result<u64> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let inserted = self.enqueue_many_in(&mut tx, queue, jobs).await?;
        tx.commit().await?;
        Ok(inserted)
    }

    async fn claim_next(
        &self,
        queue: &QueueName,
        owner: &Owner,
        lease: LeaseDuration,
        n: u32,
    ) -> Result<Vec<ClaimedJob>> {
        type Row = (String, String, i64, Option<i64>, Option<i64>, i64, Option<Vec<u8>>, Option<Vec<u8>>);
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let rows: Vec<Row> = sqlx::query_as(sql(&self.stmts.claim_next))
            .bind(queue.as_str().to_owned())
            .bind(owner.as_str().to_owned())
            .bind(lease.as_millis_i64())
            .bind(i64::from(n))
            .bind(self.max_claims)
            .fetch_all(&mut *tx)
            .await?;
        tx.commit().await?;
        // Rows over the cap on claims were made dead, not claimed.
        rows.into_iter()
            .filter(|row| row.1 == "running")
            .map(|(key, _, epoch, lease_until, ttl, attempts, payload, progress)| {
                Ok(ClaimedJob {
                    lease: Lease {
                        queue: queue.clone(),
                        key: JobKey::new(key)?,
                        epoch,
                        owner: owner.clone(),
                        lease_until: DbTime(lease_until.unwrap_or(0)),
                        ttl: millis(ttl.unwrap_or(0)),
                        attempts,
                    },
                    payload: payload.unwrap_or_default(),
                    progress,
                })
            })
            .collect()
    }

    async fn heartbeat(&self, leases: &[Lease], lease: LeaseDuration) -> Result<Heartbeat> {
        if leases.is_empty() {
            return Ok(Heartbeat::default());
        }
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let mut renewed = Vec::with_capacity(leases.len());
        for l in leases {
            let row: Option<(String, String, i64, String, i64, i64)> = sqlx::query_as(sql(&self.stmts.heartbeat))
                .bind(l.queue.as_str().to_owned())
                .bind(l.key.as_str().to_owned())
                .bind(l.epoch)
                .bind(l.owner.as_str().to_owned())
                .bind(lease.as_millis_i64())
                .fetch_optional(&mut *tx)
                .await?;
            renewed.extend(row);
        }
        tx.commit().await?;
        Ok(split_heartbeat(leases, renewed, Vec::new()))
    }

    async fn checkpoint(&self, lease: &Lease, progress: &[u8]) -> Result<()> {
        self.fenced(&self.stmts.checkpoint, lease, |q| q.bind(progress.to_vec())).await.map(drop)
    }

    async fn complete(&self, lease: &Lease, result: &[u8]) -> Result<()> {
        self.fenced(&self.stmts.complete, lease, |q| q.bind(result.to_vec())).await.map(drop)
    }

    async fn complete_batch(&self, items: &[(Lease, Vec<u8>)]) -> Result<Vec<Result<()>>> {
        // One transaction: one write-lock acquisition and one WAL commit for the whole batch.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let mut out = Vec::with_capacity(items.len());
        for (lease, result) in items {
            let row = self.cas_query(&self.stmts.complete, lease).bind(result.clone()).fetch_optional(&mut *tx).await?;
            out.push(match self.fenced_outcome(&mut tx, lease, row).await {
                Ok(_) => Ok(()),
                Err(e) if e.is_fenced() => Err(e),
                Err(e) => return Err(e),
            });
        }
        tx.commit().await?;
        Ok(out)
    }

    async fn fail(&self, lease: &Lease, error: &str, retry: bool, policy: &RetryPolicy) -> Result<FailOutcome> {
        let (base_ms, max_ms) = backoff_ms(policy);
        let error = error.replace('\0', "\u{FFFD}");
        let answer = self
            .fenced(&self.stmts.fail, lease, |q| {
                q.bind(retry).bind(policy.max_attempts).bind(base_ms).bind(error).bind(max_ms)
            })
            .await?;
        fail_outcome(&answer)
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.fenced(&self.stmts.release, lease, |q| q).await.map(drop)
    }

    async fn job(&self, queue: &QueueName, key: &JobKey) -> Result<Option<JobRecord>> {
        let row: Option<JobRow> = sqlx::query_as(sql(&self.stmts.job))
            .bind(queue.as_str().to_owned())
            .bind(key.as_str().to_owned())
            .fetch_optional(&self.pool)
            .await?;
        row.map(|row| job_record(queue, key, row)).transpose()
    }

    /// SQLite has one writer at a time: each batch is a `BEGIN IMMEDIATE` transaction, so two
    /// pruners (or a pruner and a claim) never interleave; `contended` is always false.
    async fn prune(&self, retention: &crate::Retention) -> Result<crate::PruneReport> {
        let span = tracing::info_span!("fence.prune", backend = "sqlite", schema = self.schema.as_str());
        let started = std::time::Instant::now();
        let report = self.prune_all(retention).instrument(span.clone()).await?;
        span.in_scope(|| tracing::info!(?report, elapsed = ?started.elapsed(), "prune run"));
        Ok(report)
    }

    async fn db_now(&self) -> Result<DbTime> {
        let ms: i64 =
            sqlx::query_scalar("SELECT CAST(unixepoch('subsec') * 1000 AS INTEGER)").fetch_one(&self.pool).await?;
        Ok(DbTime(ms))
    }

    fn backend(&self) -> &'static str {
        "sqlite"
    }

    fn concrete(&self) -> crate::Backend<'_> {
        crate::Backend::Sqlite(self)
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
