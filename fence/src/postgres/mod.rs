//! The PostgreSQL backend: the epoch authority on the database clock.

use std::sync::Arc;
use std::time::Duration;

use sqlx::postgres::{PgConnection, PgPool};

use crate::error::{FenceError, Result};
use crate::guards::Guards;
use crate::key::{JobKey, QueueName};
use crate::lease::{DbTime, Lease};
use crate::schema::SchemaName;

/// Milliseconds since the Unix epoch of a timestamptz expression.
macro_rules! ms {
    ($e:literal) => {
        concat!("floor(extract(epoch from ", $e, ") * 1000)::bigint")
    };
}

mod connect;
mod cursor;
mod locate;
mod migrations;
mod probe;
mod prune;
mod rounds;
mod route;
mod session;
mod statements;
mod store;
mod target;

pub(crate) use route::{Lane, Session};
pub use session::PgTimeouts;
pub(crate) use statements::Statements;
use statements::{ABORT_FENCED_TX, sql};
pub use target::{PgTarget, Pooler};

/// The fence on PostgreSQL.
///
/// ```no_run
/// # async fn demo() -> brokerfence::Result<()> {
/// use brokerfence::{FenceStore, PgFence, SchemaName};
/// let fence = PgFence::connect("postgres://postgres@127.0.0.1/test").await?
///     .schema(SchemaName::new("my_fence")?);
/// fence.migrate().await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgFence {
    pool: PgPool,
    /// Reserved capacity for [`heartbeat`](crate::FenceStore::heartbeat): claims and commits that fill
    /// `pool` never make a renewal wait for a connection.
    heartbeat_pool: PgPool,
    schema: SchemaName,
    guards: Guards,
    pub(crate) stmts: Arc<Statements>,
    max_claims: i64,
    migration: MigrationLimits,
    /// Where the next `claim_next` of each queue starts reading (see [`cursor`]).
    cursors: Arc<cursor::ClaimCursors>,
    /// How statements reach the server (straight, or behind a transaction-mode pooler).
    route: route::Route,
    /// Follows the primary of a multi-host target (none for one host).
    locator: Option<Arc<locate::Locator>>,
    /// Whether consumers listen for notifications ([`listen`](Self::listen)).
    listen: bool,
    /// Whether writes that make a job due notify ([`notify`](Self::notify)).
    notify: bool,
    /// The wake-ups of this fence's consumers (shared by its clones).
    wake: Arc<crate::wake::Hub>,
}

/// How [`PgFence::migrate`](crate::FenceStore::migrate) waits for its locks.
#[derive(Debug, Clone, Copy)]
struct MigrationLimits {
    lock_timeout: Duration,
    give_up_after: Duration,
}

impl Default for MigrationLimits {
    fn default() -> Self {
        Self { lock_timeout: Duration::from_millis(200), give_up_after: Duration::from_secs(600) }
    }
}

impl std::fmt::Debug for PgFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgFence").field("schema", &self.schema).field("guards", &self.guards).finish_non_exhaustive()
    }
}

impl PgFence {
    /// The schema version this build needs (its newest migration): what `migrate` brings a
    /// schema to and `check_schema` asks for.
    ///
    /// ```
    /// assert!(brokerfence::PgFence::SCHEMA_VERSION >= 12);
    /// ```
    pub const SCHEMA_VERSION: i64 = migrations::REQUIRED_VERSION;

    /// A session on the pool of `lane` (see [`Session`]): a connection, or behind a pooler a
    /// transaction that carries the fence's settings. Errors are shown to the primary watch.
    pub(crate) async fn session(&self, lane: Lane) -> Result<Session> {
        let pool = match lane {
            Lane::Main => &self.pool,
            Lane::Heartbeat => &self.heartbeat_pool,
        };
        self.route.session(pool, lane).await
    }

    /// Whether statements may be prepared once per session: not behind a transaction-mode pooler.
    pub(crate) fn persistent(&self) -> bool {
        self.route.persistent()
    }

    /// Shows an error of a fence statement to the primary watch (see `route::PrimaryWatch`).
    pub(crate) fn seen(&self, e: FenceError) -> FenceError {
        self.route.watch.seen(e)
    }

    /// Begins a transaction on the fence's pool that carries the fence's time limits, for a
    /// handler's own writes with [`complete_in`](Self::complete_in) or
    /// [`enqueue_in`](Self::enqueue_in). Straight to PostgreSQL that is a plain `BEGIN` (the
    /// sessions have the limits); behind a transaction-mode pooler ([`Pooler::Transaction`]) it
    /// is `BEGIN READ WRITE` plus `SET LOCAL` of the limits and planner settings, which is the
    /// only way they reach the server there. (Behind such a pooler, prepare your own statements
    /// unnamed, `sqlx::query(..).persistent(false)`, or use a pooler that keeps prepared
    /// statements, PgBouncer 1.21+ with `max_prepared_statements`.)
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::PgFence, lease: brokerfence::Lease) -> brokerfence::Result<()> {
    /// let mut tx = fence.begin().await?;
    /// sqlx::query("INSERT INTO receipts (id) VALUES ($1)").bind("r-1").persistent(false).execute(&mut *tx).await?;
    /// fence.complete_in(&mut tx, &lease, b"done").await?;
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn begin(&self) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
        let text = self.route.begin_text(Lane::Main);
        self.pool.begin_with(sqlx::AssertSqlSafe(text.to_string())).await.map_err(|e| self.seen(e.into()))
    }

    /// [`complete`](crate::FenceStore::complete) inside the caller's transaction, so that the caller's own
    /// rows (business data, outbox) commit together with the result or not at all. Inside a
    /// supervised handler, call [`JobContext::complete_in`](crate::JobContext::complete_in)
    /// instead: it tells the supervisor, which then acknowledges the delivery without a second
    /// commit.
    ///
    /// A [`Fenced`](FenceError::Fenced) answer also **aborts the caller's transaction** (an error
    /// raised on its connection): its rows can no longer commit, every later statement in it
    /// fails, and `COMMIT` rolls it back, even if the caller ignores the answer. That holds for
    /// a top-level transaction only: a connection in autocommit or inside a savepoint (a nested
    /// `tx.begin()`) is refused with [`TransactionDepth`](FenceError::TransactionDepth) before
    /// anything is written. Call it last,
    /// right before `COMMIT`: from here on the transaction holds the job's row lock (see
    /// [`Heartbeat::held`](crate::Heartbeat::held)).
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::PgFence, lease: brokerfence::Lease) -> brokerfence::Result<()> {
    /// let mut tx = fence.pool().begin().await?;
    /// sqlx::query("INSERT INTO outbox (body) VALUES ($1)").bind("hello").execute(&mut *tx).await?;
    /// fence.complete_in(&mut tx, &lease, b"done").await?; // Fenced => the transaction is aborted
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn complete_in(&self, conn: &mut PgConnection, lease: &Lease, result: &[u8]) -> Result<()> {
        if self.guards.own_tx_depth_check() {
            crate::own_tx::top_level::<sqlx::Postgres>(conn)?;
        }
        let answer = self.fenced_write(&mut *conn, &self.stmts.complete, lease, |q| q.bind(result.to_vec())).await;
        if let Err(FenceError::Fenced { .. }) = &answer
            && self.guards.fenced_tx_rollback()
        {
            // Raises on purpose: PostgreSQL then refuses every later statement of the transaction
            // and turns its COMMIT into a ROLLBACK. The raise is the expected answer; any other
            // error leaves the transaction aborted all the same.
            let raised = sqlx::raw_sql(ABORT_FENCED_TX).execute(&mut *conn).await;
            tracing::debug!(key = %lease.key, epoch = lease.epoch, ?raised, "fenced complete_in: caller's transaction aborted");
        }
        answer.map(drop)
    }

    /// [`enqueue`](crate::FenceStore::enqueue) inside the caller's transaction: the job exists if and only
    /// if the caller's transaction commits (transactional enqueue). Says whether it inserted (a key
    /// that exists is left as it is).
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::PgFence) -> brokerfence::Result<()> {
    /// use brokerfence::{JobKey, QueueName};
    /// let mut tx = fence.pool().begin().await?;
    /// sqlx::query("INSERT INTO orders (id) VALUES ($1)").bind("o-1").execute(&mut *tx).await?;
    /// fence.enqueue_in(&mut tx, &QueueName::new("emails")?, &JobKey::new("o-1/confirm")?, b"o-1").await?;
    /// tx.commit().await?; // the order and its job, or neither
    /// # Ok(()) }
    /// ```
    pub async fn enqueue_in(
        &self,
        conn: &mut PgConnection,
        queue: &QueueName,
        key: &JobKey,
        payload: &[u8],
    ) -> Result<bool> {
        Ok(self.enqueue_many_in(conn, queue, &[(key.clone(), payload.to_vec())]).await? == 1)
    }

    /// [`enqueue_many`](crate::FenceStore::enqueue_many) inside the caller's transaction (one statement);
    /// returns how many were new.
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::PgFence) -> brokerfence::Result<()> {
    /// use brokerfence::{JobKey, QueueName};
    /// let mut tx = fence.pool().begin().await?;
    /// let jobs = vec![(JobKey::new("a")?, b"1".to_vec()), (JobKey::new("b")?, b"2".to_vec())];
    /// assert_eq!(fence.enqueue_many_in(&mut tx, &QueueName::new("q")?, &jobs).await?, 2);
    /// tx.commit().await?;
    /// # Ok(()) }
    /// ```
    pub async fn enqueue_many_in(
        &self,
        conn: &mut PgConnection,
        queue: &QueueName,
        jobs: &[(JobKey, Vec<u8>)],
    ) -> Result<u64> {
        self.enqueue_on(&mut *conn, queue, jobs, true).await
    }

    /// The enqueue statement on `exec`: in the caller's transaction (`in_tx`, which notifies
    /// at its commit) or the fence's own (which announces after its commit).
    pub(super) async fn enqueue_on<'c>(
        &self,
        exec: impl sqlx::PgExecutor<'c>,
        queue: &QueueName,
        jobs: &[(JobKey, Vec<u8>)],
        in_tx: bool,
    ) -> Result<u64> {
        let keys: Vec<String> = jobs.iter().map(|(k, _)| k.as_str().to_owned()).collect();
        let payloads: Vec<Vec<u8>> = jobs.iter().map(|(_, p)| p.clone()).collect();
        let stmt = if in_tx && self.notify { &self.stmts.enqueue_notify } else { &self.stmts.enqueue };
        let (traceparent, tracestate) = crate::store::producer_trace();
        let (inserted, _notified): (i64, i64) = sqlx::query_as(sql(stmt))
            .persistent(self.persistent())
            .bind(queue.as_str().to_owned())
            .bind(keys)
            .bind(payloads)
            .bind(traceparent)
            .bind(tracestate)
            .fetch_one(exec)
            .await?;
        Ok(u64::try_from(inserted).unwrap_or(0))
    }

    /// Wake-ups for the outbox relays of this fence (a row written by
    /// [`outbox_in`](Self::outbox_in) notifies when its transaction commits). For
    /// `OutboxRelay`.
    #[doc(hidden)]
    pub fn outbox_wakeups(&self) -> crate::Wakeups {
        self.wake.subscribe(crate::wake::OUTBOX)
    }

    /// [`FenceStore::next_due`](crate::FenceStore::next_due).
    pub(super) async fn read_next_due(&self, queue: &QueueName) -> Result<Option<std::time::Duration>> {
        let answer: Result<_> = async {
            let mut session = self.session(Lane::Main).await?;
            let ms: Option<i64> = sqlx::query_scalar(sql(&self.stmts.next_due))
                .persistent(self.persistent())
                .bind(queue.as_str().to_owned())
                .fetch_optional(&mut *session)
                .await?;
            session.done().await?;
            Ok(ms.map(|ms| std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0))))
        }
        .await;
        answer.map_err(|e| self.seen(e))
    }

    /// [`FenceStore::db_now`](crate::FenceStore::db_now).
    pub(super) async fn read_db_now(&self) -> Result<DbTime> {
        let answer: Result<_> = async {
            let mut session = self.session(Lane::Main).await?;
            let ms: i64 = sqlx::query_scalar(concat!("SELECT ", ms!("clock_timestamp()")))
                .persistent(self.persistent())
                .fetch_one(&mut *session)
                .await?;
            session.done().await?;
            Ok(DbTime(ms))
        }
        .await;
        answer.map_err(|e| self.seen(e))
    }

    /// After a write of this fence committed that made a job of `queue` due after `delay`:
    /// wakes this process's consumers and announces the job to the others (see `crate::wake`).
    pub(crate) fn wake_here(&self, queue: &QueueName, delay: std::time::Duration) {
        self.wake.committed(queue.as_str(), delay);
    }

    pub(super) async fn fenced_write<'c, E, F>(
        &self,
        exec: E,
        stmt: &Arc<str>,
        lease: &Lease,
        extra: F,
    ) -> Result<Option<String>>
    where
        E: sqlx::PgExecutor<'c>,
        F: for<'q> FnOnce(
            sqlx::query::QueryAs<'q, sqlx::Postgres, FencedRow, sqlx::postgres::PgArguments>,
        ) -> sqlx::query::QueryAs<'q, sqlx::Postgres, FencedRow, sqlx::postgres::PgArguments>,
    {
        let q = sqlx::query_as::<_, FencedRow>(sql(stmt))
            .persistent(self.persistent())
            .bind(lease.queue.as_str().to_owned())
            .bind(lease.key.as_str().to_owned())
            .bind(lease.owner.as_str().to_owned())
            .bind(lease.epoch);
        let (matched, r, current_epoch, current_owner) = extra(q).fetch_one(exec).await?;
        if matched == 0 {
            return Err(FenceError::Fenced {
                key: lease.key.as_str().to_owned(),
                epoch: lease.epoch,
                current_epoch: current_epoch.unwrap_or(0),
                current_owner,
            });
        }
        Ok(r)
    }
}

type FencedRow = (i64, Option<String>, Option<i64>, Option<String>);
