//! Fresh stores for the tests: real PostgreSQL and real SQLite files, each test on its own fresh
//! schema (PostgreSQL) or its own fresh file (SQLite), so tests run in parallel and re-run without
//! cleanup; unique names, leases and keys; the backend trait of the shared store suite.
//!
//! PostgreSQL comes from `DATABASE_URL` (the environment, else `localstack/.env`). When it is
//! missing the tests fail with a message that says to run `localstack/up`; they never skip.

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use brokerfence::ledger::{Ledger, PgLedger, SqliteLedger, Verdict};
use brokerfence::{
    self, FenceStore, JobKey, JobRecord, Lease, LeaseDuration, PgFence, QueueName, SchemaName, SqliteFence,
};
use sqlx::{AssertSqlSafe, Connection};

/// The PostgreSQL URL, or a panic that says what to do.
pub fn database_url() -> String {
    match crate::services::var("DATABASE_URL") {
        Some(url) => url,
        None => panic!(
            "DATABASE_URL is not set and localstack/.env has none: run `localstack/up` first \
             (it starts PostgreSQL and writes localstack/.env), or export DATABASE_URL"
        ),
    }
}

/// A fresh, unique schema name: `t_<16 hex digits>`.
pub fn unique_schema() -> SchemaName {
    SchemaName::new(format!("t_{:016x}", rand::random::<u64>())).expect("generated schema name is valid")
}

/// A random tag of 12 hex digits.
pub fn rand_hex() -> String {
    format!("{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff)
}

/// A unique name with a prefix, for keys and queues: `<prefix>-<12 hex digits>`.
pub fn unique(prefix: &str) -> String {
    format!("{prefix}-{}", rand_hex())
}

/// A lease of `secs` seconds.
pub fn lease(secs: u64) -> LeaseDuration {
    LeaseDuration::from_secs(secs).expect("lease of at least 3 s")
}

/// A job key (panics on invalid input: for literals in tests).
pub fn key(k: &str) -> JobKey {
    JobKey::new(k).expect("valid key")
}

/// A PgFence on a fresh schema, not yet migrated.
pub async fn pg_unmigrated() -> PgFence {
    pg_on(unique_schema()).await
}

/// A PgFence on `schema` (its own pool), not migrated.
pub async fn pg_on(schema: SchemaName) -> PgFence {
    let url = database_url();
    let fence = PgFence::connect(&url).await.unwrap_or_else(|e| {
        panic!("cannot connect to PostgreSQL at {url}: {e}. Is it running? Run `localstack/up` first.")
    });
    fence.schema(schema)
}

/// A migrated PgFence on a fresh schema.
pub async fn pg() -> PgFence {
    let fence = pg_unmigrated().await;
    fence.migrate().await.expect("migrate PostgreSQL schema");
    fence
}

/// Drops the test's schema (best effort).
pub async fn drop_schema(fence: &PgFence) {
    let s = fence.get_schema().as_str();
    let _ = sqlx::query(AssertSqlSafe(format!("DROP SCHEMA IF EXISTS {s} CASCADE"))).execute(fence.pool()).await;
}

/// The job row of `key` in `queue`.
pub async fn job(fence: &(impl FenceStore + ?Sized), queue: &QueueName, key: &str) -> Option<JobRecord> {
    fence.job(queue, &self::key(key)).await.expect("read job row")
}

/// Every job row of the schema: (key, state, epoch, owner, result).
pub async fn jobs(fence: &PgFence) -> Vec<(String, String, i64, Option<String>, Option<Vec<u8>>)> {
    let s = fence.get_schema().as_str();
    sqlx::query_as(AssertSqlSafe(format!("SELECT key, state, epoch, owner, result FROM {s}.jobs ORDER BY key")))
        .fetch_all(fence.pool())
        .await
        .expect("read jobs")
}

fn sqlite_dir() -> PathBuf {
    let dir = std::env::temp_dir().join("brokerfence-tests");
    std::fs::create_dir_all(&dir).expect("create temp dir for SQLite test files");
    // Sweep files of earlier runs (older than an hour) so the directory does not grow forever.
    if let Ok(entries) = std::fs::read_dir(&dir) {
        for e in entries.flatten() {
            let old = e
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age > Duration::from_secs(3600));
            if old {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    dir
}

/// A fresh SQLite file path under the temp dir.
pub fn sqlite_path() -> PathBuf {
    sqlite_dir().join(format!("{}.db", unique("fence")))
}

/// A SqliteFence on `path` (its own pool), not migrated.
pub async fn sqlite_on(path: &std::path::Path) -> SqliteFence {
    SqliteFence::open(&format!("sqlite:{}", path.display()))
        .await
        .unwrap_or_else(|e| panic!("open SQLite file {}: {e}", path.display()))
}

/// A SqliteFence on a fresh file, not yet migrated.
pub async fn sqlite_unmigrated() -> SqliteFence {
    sqlite_on(&sqlite_path()).await
}

/// A migrated SqliteFence on a fresh temp file.
pub async fn sqlite() -> SqliteFence {
    let fence = sqlite_unmigrated().await;
    fence.migrate().await.expect("migrate SQLite file");
    fence
}

/// What the shared suite needs from a backend beyond [`FenceStore`]: fresh instances, a second
/// independent handle on the same database, and the backend-specific transaction forms.
pub trait TestStore: FenceStore + Clone + Sized {
    /// A store on a fresh schema/file, not migrated.
    fn unmigrated() -> impl Future<Output = Self> + Send;
    /// Another store with its own pool on the same schema/file (like a second process).
    fn reopen(&self) -> impl Future<Output = Self> + Send;
    /// The fence tables that exist, sorted.
    fn tables(&self) -> impl Future<Output = Vec<String>> + Send;
    /// Migrations this backend's schema has (one row each once migrated).
    const MIGRATIONS: i64;
    /// The fence's tables, by the end of their names.
    const TABLES: &'static [&'static str];
    /// Rows in the migrations table.
    fn migration_rows(&self) -> impl Future<Output = i64> + Send;
    /// The receiver ledger of this store.
    fn ledger(&self, scope: &str) -> Ledger;
    /// In ONE transaction: insert `marker` into a business table, then `complete_in(lease,
    /// result)`; commits when that succeeds, rolls back (and returns the error) when it fails.
    fn complete_with_business_row(
        &self,
        lease: &Lease,
        marker: &str,
        result: &[u8],
    ) -> impl Future<Output = fence::Result<()>> + Send;
    /// The markers in the business table.
    fn business_rows(&self) -> impl Future<Output = Vec<String>> + Send;
    /// In ONE transaction: `ledger.accept_in(job, epoch)` and insert `marker` into a business
    /// table; commits when `commit` is true and the verdict is accepted, else rolls back.
    fn ledger_accept_in(
        &self,
        scope: &str,
        job: &str,
        epoch: i64,
        marker: &str,
        commit: bool,
    ) -> impl Future<Output = Verdict> + Send;
}

/// Commits `tx` when `keep`, else rolls it back.
async fn end<DB: sqlx::Database>(tx: sqlx::Transaction<'_, DB>, keep: bool) -> Result<(), sqlx::Error> {
    if keep { tx.commit().await } else { tx.rollback().await }
}

impl TestStore for PgFence {
    const MIGRATIONS: i64 = 12;
    // The outbox (migration 4) is PostgreSQL only; epoch floors are migration 5; migration 6 sets
    // the jobs table's fillfactor; 7 the epoch trigger's WHEN; 8 the indexes of HOT claims; 9 the
    // epoch trigger after the row.
    const TABLES: &'static [&'static str] = &["_migrations", "epoch_floors", "jobs", "ledger", "outbox"];

    async fn unmigrated() -> Self {
        pg_unmigrated().await
    }

    async fn reopen(&self) -> Self {
        pg_on(self.get_schema().clone()).await
    }

    async fn tables(&self) -> Vec<String> {
        sqlx::query_scalar("SELECT table_name::text FROM information_schema.tables WHERE table_schema = $1 ORDER BY 1")
            .bind(self.get_schema().as_str().to_owned())
            .fetch_all(self.pool())
            .await
            .expect("list tables")
    }

    async fn migration_rows(&self) -> i64 {
        let s = self.get_schema().as_str();
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {s}._migrations")))
            .fetch_one(self.pool())
            .await
            .expect("count migrations")
    }

    fn ledger(&self, scope: &str) -> Ledger {
        Ledger::Pg(PgLedger::new(self, scope))
    }

    async fn complete_with_business_row(&self, lease: &Lease, marker: &str, result: &[u8]) -> fence::Result<()> {
        let s = self.get_schema().as_str();
        let mut tx = self.pool().begin().await?;
        sqlx::query(AssertSqlSafe(format!("CREATE TABLE IF NOT EXISTS {s}.business (marker text NOT NULL)")))
            .execute(&mut *tx)
            .await?;
        sqlx::query(AssertSqlSafe(format!("INSERT INTO {s}.business (marker) VALUES ($1)")))
            .bind(marker.to_owned())
            .execute(&mut *tx)
            .await?;
        let completed = self.complete_in(&mut tx, lease, result).await;
        end(tx, completed.is_ok()).await?;
        completed
    }

    async fn business_rows(&self) -> Vec<String> {
        let s = self.get_schema().as_str();
        sqlx::query(AssertSqlSafe(format!("CREATE TABLE IF NOT EXISTS {s}.business (marker text NOT NULL)")))
            .execute(self.pool())
            .await
            .expect("business table");
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT marker FROM {s}.business ORDER BY 1")))
            .fetch_all(self.pool())
            .await
            .expect("read business rows")
    }

    async fn ledger_accept_in(&self, scope: &str, job: &str, epoch: i64, marker: &str, commit: bool) -> Verdict {
        let s = self.get_schema().as_str();
        let ledger = PgLedger::new(self, scope);
        let mut conn = self.pool().acquire().await.expect("acquire");
        sqlx::query(AssertSqlSafe(format!("CREATE TABLE IF NOT EXISTS {s}.business (marker text NOT NULL)")))
            .execute(&mut *conn)
            .await
            .expect("business table");
        let mut tx = conn.begin().await.expect("begin");
        let verdict = ledger.accept_in(&mut tx, job, epoch).await.expect("accept_in");
        sqlx::query(AssertSqlSafe(format!("INSERT INTO {s}.business (marker) VALUES ($1)")))
            .bind(marker.to_owned())
            .execute(&mut *tx)
            .await
            .expect("insert business row");
        end(tx, commit && verdict.is_accepted()).await.expect("commit or roll back");
        verdict
    }
}

/// The file behind a SqliteFence (its pool's connect options).
fn sqlite_file(fence: &SqliteFence) -> PathBuf {
    fence.pool().connect_options().get_filename().to_path_buf()
}

impl TestStore for SqliteFence {
    const MIGRATIONS: i64 = 5;
    // Epoch floors are migration 3.
    const TABLES: &'static [&'static str] = &["_migrations", "epoch_floors", "jobs", "ledger"];

    async fn unmigrated() -> Self {
        sqlite_unmigrated().await
    }

    async fn reopen(&self) -> Self {
        sqlite_on(&sqlite_file(self)).await
    }

    async fn tables(&self) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name LIKE 'brokerfence%' ORDER BY 1",
        )
        .fetch_all(self.pool())
        .await
        .expect("list tables")
    }

    async fn migration_rows(&self) -> i64 {
        sqlx::query_scalar("SELECT count(*) FROM brokerfence__migrations")
            .fetch_one(self.pool())
            .await
            .expect("count migrations")
    }

    fn ledger(&self, scope: &str) -> Ledger {
        Ledger::Sqlite(SqliteLedger::new(self, scope))
    }

    async fn complete_with_business_row(&self, lease: &Lease, marker: &str, result: &[u8]) -> fence::Result<()> {
        sqlx::query("CREATE TABLE IF NOT EXISTS business (marker TEXT NOT NULL)").execute(self.pool()).await?;
        let mut tx = self.pool().begin_with("BEGIN IMMEDIATE").await?;
        sqlx::query("INSERT INTO business (marker) VALUES (?1)").bind(marker.to_owned()).execute(&mut *tx).await?;
        let completed = self.complete_in(&mut tx, lease, result).await;
        end(tx, completed.is_ok()).await?;
        completed
    }

    async fn business_rows(&self) -> Vec<String> {
        sqlx::query("CREATE TABLE IF NOT EXISTS business (marker TEXT NOT NULL)")
            .execute(self.pool())
            .await
            .expect("business table");
        sqlx::query_scalar("SELECT marker FROM business ORDER BY 1")
            .fetch_all(self.pool())
            .await
            .expect("read business rows")
    }

    async fn ledger_accept_in(&self, scope: &str, job: &str, epoch: i64, marker: &str, commit: bool) -> Verdict {
        let ledger = SqliteLedger::new(self, scope);
        sqlx::query("CREATE TABLE IF NOT EXISTS business (marker TEXT NOT NULL)")
            .execute(self.pool())
            .await
            .expect("business table");
        let mut tx = self.pool().begin_with("BEGIN IMMEDIATE").await.expect("begin");
        let verdict = ledger.accept_in(&mut tx, job, epoch).await.expect("accept_in");
        sqlx::query("INSERT INTO business (marker) VALUES (?1)")
            .bind(marker.to_owned())
            .execute(&mut *tx)
            .await
            .expect("insert business row");
        end(tx, commit && verdict.is_accepted()).await.expect("commit or roll back");
        verdict
    }
}

/// Rows of `jobs` read so far in `s`'s schema (sequential plus index fetches, bitmap scans
/// included), as the statistics views count them: the way a test tells a plan that reads rows by
/// key or in index order from one that reads the table.
pub async fn jobs_rows_read(s: &PgFence) -> i64 {
    // Pending statistics reach the shared view when the backend next goes idle (the
    // heartbeat's backend too).
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(s.get_heartbeat_pool()).await.expect("flush stats");
    sqlx::query("SELECT pg_stat_force_next_flush()").execute(s.pool()).await.expect("flush stats");
    let (n,): (i64,) = sqlx::query_as(
        "SELECT (coalesce(seq_tup_read, 0) + coalesce(idx_tup_fetch, 0))::bigint FROM pg_stat_user_tables \
         WHERE relid = to_regclass($1)",
    )
    .bind(format!("{}.jobs", s.get_schema().as_str()))
    .fetch_one(s.pool())
    .await
    .expect("read table statistics");
    n
}
