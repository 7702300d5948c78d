//! How `migrate` applies the embedded migrations (see the parent module): each step under the
//! migration lock and its lock timeout, retried with backoff when it let go of its locks; index
//! steps CONCURRENTLY, with an invalid or outdated index rebuilt; the migration recorded with its
//! last step.

use std::time::{Duration, Instant};

use sqlx::postgres::PgConnection;
use sqlx::{AssertSqlSafe, Connection};

use super::super::PgFence;
use super::super::prune::is_lock_timeout;
use super::super::session::pg_ms;
use super::{BACKFILL_BATCH, INDEX_BUILDS, MIGRATIONS, PgMigration, SMALL_TABLE, Step};
use crate::error::{FenceError, Result};
use crate::schema::render;

/// Retries of a step that let go of its locks: 200 ms doubling, at most 5 s, with jitter so that
/// migrators retrying together do not keep colliding, until `give_up_after` has passed since the
/// step started.
struct Retry {
    started: Instant,
    give_up_after: Duration,
    pauses: backon::ExponentialBackoff,
    tries: u32,
}

impl Retry {
    fn new(give_up_after: Duration) -> Self {
        use backon::BackoffBuilder as _;
        let pauses = backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(200))
            .with_max_delay(Duration::from_millis(2_500))
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
            .build();
        Self { started: Instant::now(), give_up_after, pauses, tries: 0 }
    }

    /// After a failed try: pauses and answers true when `e` was a lock timeout and there is time
    /// left; false otherwise (the caller returns `e`).
    async fn again(&mut self, e: &FenceError, schema: &str, version: i64) -> bool {
        self.tries += 1;
        if !(is_lock_timeout(e) || is_deadlock(e)) || self.started.elapsed() >= self.give_up_after {
            return false;
        }
        let pause = self.pauses.next().unwrap_or(Duration::from_secs(5)).min(Duration::from_secs(5));
        tracing::warn!(
            schema,
            version,
            tries = self.tries,
            retry_in = ?pause,
            "migration step let go of its locks after the lock timeout (the table is in use); retrying"
        );
        tokio::time::sleep(pause).await;
        true
    }
}

/// A deadlock the server broke by failing this statement (`40P01`): its transaction rolled back,
/// and the step is tried again like after a lock timeout.
fn is_deadlock(e: &FenceError) -> bool {
    let db = match e {
        FenceError::Database(sqlx::Error::Database(db)) => db,
        FenceError::Migration { source: sqlx::Error::Database(db), .. } => db,
        _ => return false,
    };
    db.code().as_deref() == Some("40P01")
}

/// A statement outside a transaction (`… CONCURRENTLY`) that failed because another migrator
/// ran the same at the same moment: the catalog entry of the index created by both
/// (`unique_violation` on its name, `duplicate_table`), the table's catalog row updated by both
/// ("tuple concurrently updated"), or a deadlock the server broke by failing this one. The step
/// looks at what is there and tries again.
fn raced(e: &FenceError) -> bool {
    match e {
        FenceError::Migration { source: sqlx::Error::Database(db), .. } => match db.code().as_deref() {
            Some("23505" | "42P07" | "40P01") => true,
            Some("XX000") => db.message().contains("concurrently"),
            _ => false,
        },
        _ => false,
    }
}

/// What an index step found under the migration lock.
enum IndexFound {
    /// Valid and of the shape this build wants.
    Ready,
    /// None of that name (any left over was dropped).
    Absent,
}

/// Runs `$try` (an expression that may be evaluated again) until it succeeds, retrying lock
/// timeouts (see [`Retry`]).
macro_rules! retrying {
    ($fence:expr, $version:expr, $try:expr) => {{
        let mut retry = Retry::new($fence.migration.give_up_after);
        loop {
            match $try.await {
                Ok(v) => break Ok(v),
                Err(e) if retry.again(&e, $fence.schema.as_str(), $version).await => continue,
                Err(e) => break Err(e),
            }
        }
    }};
}

impl PgFence {
    /// Applies the embedded migrations up to `version` (all of them: [`migrate`](crate::FenceStore::migrate)).
    /// For tests of upgrades, which need a schema as an earlier release left it.
    #[doc(hidden)]
    pub async fn migrate_to(&self, version: i64) -> Result<()> {
        let mut conn = self.pool.acquire().await?;
        // Steps outside a transaction change session settings (see `outside_tx`): the
        // connection is closed after, not handed to another user of the pool.
        conn.close_on_drop();
        // The schema and the record first (an empty step), then each migration.
        retrying!(self, 0, self.tx_step(&mut conn, None, &[]))?;
        for m in MIGRATIONS.iter().filter(|m| m.version <= version) {
            self.apply(&mut conn, m).await?;
        }
        Ok(())
    }

    /// Whether migration `version` is recorded as applied.
    async fn recorded(&self, conn: &mut PgConnection, version: i64) -> Result<bool> {
        let s = self.schema.as_str();
        let found: Option<i64> =
            sqlx::query_scalar(AssertSqlSafe(format!("SELECT version FROM {s}._migrations WHERE version = $1")))
                .persistent(false)
                .bind(version)
                .fetch_optional(&mut *conn)
                .await?;
        Ok(found.is_some())
    }

    /// One migration, step by step, unless it is recorded already; recorded with its last step.
    async fn apply(&self, conn: &mut PgConnection, m: &PgMigration) -> Result<()> {
        let s = self.schema.as_str();
        // In a transaction: behind a transaction-mode pooler a statement with parameters outside
        // one is parsed and bound in two round trips, which the pooler may send to two server
        // sessions ("unnamed prepared statement does not exist").
        let mut tx = conn.begin().await?;
        let recorded = self.recorded(&mut tx, m.version).await?;
        tx.commit().await?;
        if recorded {
            return Ok(());
        }
        let last = m.steps.len().saturating_sub(1);
        for (i, step) in m.steps.iter().enumerate() {
            match step {
                // The last step, a transaction, records the migration in that transaction, as
                // every migration did when it was one transaction.
                Step::Tx(statements) if i == last => {
                    return retrying!(self, m.version, self.tx_step(conn, Some(m), statements));
                }
                Step::Tx(statements) => retrying!(self, m.version, self.tx_step(conn, None, statements))?,
                Step::Backfill(sql) => self.backfill(conn, m, sql).await?,
                Step::Index { name, table, create, shape } => self.index(conn, m, name, table, create, shape).await?,
                Step::DropIndex { name, table } => {
                    if retrying!(self, m.version, self.drop_if_small(conn, m, name, table))? {
                        continue;
                    }
                    let drop = format!("DROP INDEX CONCURRENTLY IF EXISTS {s}.{name}");
                    let mut tries = 0;
                    while let Err(e) = self.outside_tx(conn, m, &drop).await {
                        tries += 1;
                        if !raced(&e) || tries >= INDEX_BUILDS {
                            return Err(e);
                        }
                    }
                }
            }
        }
        retrying!(self, m.version, self.tx_step(conn, Some(m), &[]))
    }

    /// Begins a step's transaction: the limits, the migrator's lock (one per schema at a time,
    /// across processes; released at commit) and, from then on, the migration lock timeout.
    async fn begin_step<'c>(&self, conn: &'c mut PgConnection) -> Result<sqlx::Transaction<'c, sqlx::Postgres>> {
        let mut tx = conn.begin().await?;
        // Waiting for the other migrator blocks no traffic, so that wait has no lock timeout;
        // every statement is bounded by `give_up_after`. The NOTICEs of the idempotent
        // statements ("already exists, skipping", "does not exist, skipping") are not sent: a
        // worker that migrates at start-up would log one per statement, every start.
        sqlx::query(
            "SELECT set_config('lock_timeout', '0', true), set_config('statement_timeout', $1, true), \
             set_config('client_min_messages', 'warning', true)",
        )
        .persistent(false)
        .bind(pg_ms(self.migration.give_up_after).to_string())
        .execute(&mut *tx)
        .await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended('brokerfence.migrate.' || $1, 0))")
            .persistent(false)
            .bind(self.schema.as_str().to_owned())
            .execute(&mut *tx)
            .await?;
        // Every lock on a fence table from here on: wait briefly, or let go and retry.
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .persistent(false)
            .bind(pg_ms(self.migration.lock_timeout).to_string())
            .execute(&mut *tx)
            .await?;
        Ok(tx)
    }

    /// One try of a transaction step: the schema and its record table, then `statements`, then
    /// (with `record`) the migration's row, unless another migrator recorded it meanwhile.
    async fn tx_step(&self, conn: &mut PgConnection, record: Option<&PgMigration>, statements: &[&str]) -> Result<()> {
        let s = self.schema.as_str();
        let mut tx = self.begin_step(conn).await?;
        sqlx::query(AssertSqlSafe(format!("CREATE SCHEMA IF NOT EXISTS {s}")))
            .persistent(false)
            .execute(&mut *tx)
            .await?;
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {s}._migrations (version bigint PRIMARY KEY, name text NOT NULL, \
             applied_at timestamptz NOT NULL DEFAULT clock_timestamp())"
        )))
        .persistent(false)
        .execute(&mut *tx)
        .await?;
        if let Some(m) = record
            && self.recorded(&mut tx, m.version).await?
        {
            return Ok(tx.commit().await?);
        }
        for stmt in statements {
            let (version, name) = record.map_or((0, "step"), |m| (m.version, m.name));
            sqlx::query(AssertSqlSafe(render(stmt, &self.schema)))
                .persistent(false)
                .execute(&mut *tx)
                .await
                .map_err(|source| FenceError::Migration { version, name, source })?;
        }
        if let Some(m) = record {
            sqlx::query(AssertSqlSafe(format!("INSERT INTO {s}._migrations (version, name) VALUES ($1, $2)")))
                .persistent(false)
                .bind(m.version)
                .bind(m.name)
                .execute(&mut *tx)
                .await?;
            tracing::info!(schema = s, version = m.version, name = m.name, "applied migration");
        }
        Ok(tx.commit().await?)
    }

    /// A [`Step::Backfill`]: batch after batch, each its own transaction, until the table's end.
    async fn backfill(&self, conn: &mut PgConnection, m: &PgMigration, sql: &str) -> Result<()> {
        let (first, next) =
            (render(&sql.replace("{after}", ">="), &self.schema), render(&sql.replace("{after}", ">"), &self.schema));
        let mut after = (String::new(), String::new());
        let mut sql = &first;
        let (started, mut batches) = (Instant::now(), 0u64);
        loop {
            let last = retrying!(self, m.version, self.backfill_batch(conn, m, sql, &after))?;
            batches += 1;
            match last {
                Some(last) => after = last,
                None => break,
            }
            sql = &next;
        }
        tracing::info!(schema = self.schema.as_str(), version = m.version, batches, elapsed = ?started.elapsed(), "backfill done");
        Ok(())
    }

    async fn backfill_batch(
        &self,
        conn: &mut PgConnection,
        m: &PgMigration,
        sql: &str,
        after: &(String, String),
    ) -> Result<Option<(String, String)>> {
        let mut tx = self.begin_step(conn).await?;
        let last: Option<(String, String)> = sqlx::query_as(AssertSqlSafe(sql.to_owned()))
            .persistent(false)
            .bind(after.0.clone())
            .bind(after.1.clone())
            .bind(BACKFILL_BATCH)
            .fetch_optional(&mut *tx)
            .await
            .map_err(|source| FenceError::Migration { version: m.version, name: m.name, source })?;
        tx.commit().await?;
        Ok(last)
    }

    /// A [`Step::Index`]: drops an index of that name left invalid or of another shape (under
    /// the migration lock), builds it CONCURRENTLY, and looks again.
    async fn index(
        &self,
        conn: &mut PgConnection,
        m: &PgMigration,
        name: &str,
        table: &str,
        create: &str,
        shape: &str,
    ) -> Result<()> {
        let create = render(create, &self.schema);
        for _ in 0..INDEX_BUILDS {
            if let IndexFound::Ready =
                retrying!(self, m.version, self.index_found(conn, m, name, table, &create, shape))?
            {
                return Ok(());
            }
            match self.outside_tx(conn, m, &create).await {
                Ok(()) => {}
                // What is there is looked at next (an invalid index is dropped and built again).
                Err(e) if raced(&e) => {}
                Err(e) => return Err(e),
            }
        }
        match retrying!(self, m.version, self.index_found(conn, m, name, table, &create, shape))? {
            IndexFound::Ready => Ok(()),
            IndexFound::Absent => Err(FenceError::Corrupt(format!(
                "migration {} ({}): index {name} was built {INDEX_BUILDS} times and is still not valid with {shape}",
                m.version, m.name
            ))),
        }
    }

    /// One look at the index `name` under the migration lock. An invalid one with no build
    /// running (a build holds SHARE UPDATE EXCLUSIVE on its table until it ends: the lock
    /// below times out and the look is retried), or one of another shape, is dropped.
    async fn index_found(
        &self,
        conn: &mut PgConnection,
        m: &PgMigration,
        name: &str,
        table: &str,
        create: &str,
        shape: &str,
    ) -> Result<IndexFound> {
        let s = self.schema.as_str();
        let mut tx = self.begin_step(conn).await?;
        let found: Option<(bool, String)> = sqlx::query_as(
            "SELECT i.indisvalid AND i.indisready, pg_get_indexdef(i.indexrelid) FROM pg_index i \
             WHERE i.indexrelid = to_regclass($1)",
        )
        .persistent(false)
        .bind(format!("{s}.{name}"))
        .fetch_optional(&mut *tx)
        .await?;
        let Some((valid, definition)) = found else {
            return self.build_if_small(tx, m, table, create).await;
        };
        if valid && definition.contains(shape) {
            tx.commit().await?;
            return Ok(IndexFound::Ready);
        }
        let migration_error = |source| FenceError::Migration { version: m.version, name: m.name, source };
        // NOWAIT: this transaction must not wait for the build it asks about, which waits for
        // every transaction that holds a snapshot, this one included (a deadlock). Not granted
        // at once (55P03, as a lock timeout): the look is retried after a pause.
        sqlx::query(AssertSqlSafe(format!("LOCK TABLE {s}.{table} IN SHARE UPDATE EXCLUSIVE MODE NOWAIT")))
            .persistent(false)
            .execute(&mut *tx)
            .await
            .map_err(migration_error)?;
        // A plain DROP: a catalog change under ACCESS EXCLUSIVE for milliseconds, asked for under
        // the lock timeout like every other.
        sqlx::query(AssertSqlSafe(format!("DROP INDEX {s}.{name}")))
            .persistent(false)
            .execute(&mut *tx)
            .await
            .map_err(migration_error)?;
        tracing::warn!(
            schema = s,
            version = m.version,
            index = name,
            valid,
            definition,
            "dropping an index to build it again"
        );
        self.build_if_small(tx, m, table, create).await
    }

    /// Drops the index `name` in a step's transaction when `table` is small (see
    /// `build_if_small`); answers whether it did.
    async fn drop_if_small(&self, conn: &mut PgConnection, m: &PgMigration, name: &str, table: &str) -> Result<bool> {
        let s = self.schema.as_str();
        let mut tx = self.begin_step(conn).await?;
        let rows: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM (SELECT 1 FROM {s}.{table} LIMIT {SMALL_TABLE}) t"
        )))
        .persistent(false)
        .fetch_one(&mut *tx)
        .await?;
        if rows < SMALL_TABLE {
            sqlx::query(AssertSqlSafe(format!("DROP INDEX IF EXISTS {s}.{name}")))
                .persistent(false)
                .execute(&mut *tx)
                .await
                .map_err(|source| FenceError::Migration { version: m.version, name: m.name, source })?;
        }
        tx.commit().await?;
        Ok(rows < SMALL_TABLE)
    }

    /// Builds the index in `tx` (a plain `CREATE INDEX`, under the lock timeout) when its table
    /// holds fewer than [`SMALL_TABLE`] rows, commits, and says what is there. The SHARE lock
    /// of such a build lasts milliseconds, where `CONCURRENTLY` would wait for every
    /// transaction of the database that holds a snapshot (a fresh schema next to a busy one).
    async fn build_if_small(
        &self,
        mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
        m: &PgMigration,
        table: &str,
        create: &str,
    ) -> Result<IndexFound> {
        let s = self.schema.as_str();
        let rows: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM (SELECT 1 FROM {s}.{table} LIMIT {SMALL_TABLE}) t"
        )))
        .persistent(false)
        .fetch_one(&mut *tx)
        .await?;
        if rows >= SMALL_TABLE {
            tx.commit().await?;
            return Ok(IndexFound::Absent);
        }
        sqlx::query(AssertSqlSafe(create.replacen(" CONCURRENTLY", "", 1)))
            .persistent(false)
            .execute(&mut *tx)
            .await
            .map_err(|source| FenceError::Migration { version: m.version, name: m.name, source })?;
        tx.commit().await?;
        Ok(IndexFound::Ready)
    }

    /// A statement that cannot run in a transaction (`… CONCURRENTLY`). It takes SHARE UPDATE
    /// EXCLUSIVE on its table, which no claim, heartbeat or commit waits for, and waits for the
    /// transactions that use the table to end; so its limits are the migration's
    /// `give_up_after` for the lock and the statement alike (with the lock timeout of a
    /// transaction step, a build would fail behind any transaction longer than that, and start
    /// over). Session settings, as there is no transaction to scope them: reset after, and the
    /// connection is not handed back to the pool (`close_on_drop`), so no other user of the pool
    /// sees them.
    ///
    /// Behind a transaction-mode pooler no session setting stays on one server session, and a
    /// statement sent as parse and bind may reach two: the statement goes alone as one simple
    /// query, under the server's own limits, and the migration's `give_up_after` bounds it from
    /// this side (a build given up on may still run on the server, which the pooler does not
    /// cancel: the next `migrate` finds the index valid, or retries its look until the build
    /// ended and builds it again if it was left invalid).
    async fn outside_tx(&self, conn: &mut PgConnection, m: &PgMigration, sql: &str) -> Result<()> {
        if self.route.is_pooled() {
            let migration_error = |source| FenceError::Migration { version: m.version, name: m.name, source };
            return match tokio::time::timeout(
                self.migration.give_up_after,
                sqlx::raw_sql(AssertSqlSafe(sql.to_owned())).execute(&mut *conn),
            )
            .await
            {
                Ok(done) => done.map(drop).map_err(migration_error),
                Err(_) => Err(FenceError::StatementTimeout(format!(
                    "migration {} ({}): `{sql}` did not finish within give_up_after ({:?}) behind a \
                     transaction-mode pooler",
                    m.version, m.name, self.migration.give_up_after
                ))),
            };
        }
        let limit = pg_ms(self.migration.give_up_after).to_string();
        sqlx::query(
            "SELECT set_config('lock_timeout', $1, false), set_config('statement_timeout', $1, false), \
             set_config('client_min_messages', 'warning', false)",
        )
        .persistent(false)
        .bind(limit)
        .execute(&mut *conn)
        .await?;
        let answer = sqlx::query(AssertSqlSafe(sql.to_owned()))
            .persistent(false)
            .execute(&mut *conn)
            .await
            .map(drop)
            .map_err(|source| FenceError::Migration { version: m.version, name: m.name, source });
        sqlx::raw_sql("RESET lock_timeout; RESET statement_timeout; RESET client_min_messages")
            .execute(&mut *conn)
            .await?;
        answer
    }
}
