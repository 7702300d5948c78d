//! The receiver's epoch ledger: the downstream half of the fence.
//!
//! A receiver (an HTTP service, a consumer of the worker's output) keeps the newest epoch it has
//! seen per job, and who sent it. It accepts a higher epoch, refuses a lower one, and never
//! lowers what it keeps. One atomic statement each.
//!
//! An **equal** epoch is one claim's attempt calling again (a retry after a timeout): accepted
//! when it comes from the same owner, or when either call did not say its owner. An equal
//! epoch from a **different** owner is refused as [`Verdict::Conflict`]: one claim has one
//! owner, so two owners with one epoch means a token was handed out twice (a split brain of two
//! promoted servers, see [`crate::epoch`]). The first owner's effect stands; the second
//! owner's attempt fails and its job is claimed again at a higher epoch.

use std::sync::Arc;

use sqlx::AssertSqlSafe;

#[cfg(feature = "postgres")]
use crate::PgFence;
#[cfg(feature = "sqlite")]
use crate::SqliteFence;
use crate::error::{FenceError, Result};

/// The ledger's verdict on one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// The epoch is the newest (or equal to it): apply the effect.
    Accepted {
        /// The newest epoch now kept for the job.
        newest: i64,
    },
    /// An older epoch: the caller was superseded; apply nothing.
    Stale {
        /// The newest epoch kept for the job.
        newest: i64,
    },
    /// The newest epoch, but another owner already called with it: the token was handed out
    /// twice. Apply nothing (the other owner's effect stands) and alert: see [`crate::epoch`]
    /// for what can cause it.
    Conflict {
        /// The epoch both owners hold.
        newest: i64,
    },
}

impl Verdict {
    /// True when accepted.
    pub fn is_accepted(self) -> bool {
        matches!(self, Verdict::Accepted { .. })
    }
}

/// Longest ledger job id: room for [`crate::wire::FenceStamp::ledger_job`], which joins a
/// percent-escaped queue name (up to 3 × [`crate::MAX_NAME_BYTES`]), a `/` and the job key.
pub const MAX_LEDGER_JOB_BYTES: usize = crate::MAX_KEY_BYTES + 3 * crate::MAX_NAME_BYTES + 1;

/// Input checks shared by both backends.
fn check(scope: &str, job: &str, epoch: i64, owner: Option<&str>) -> Result<()> {
    let fields = [
        ("ledger scope", Some(scope), crate::MAX_NAME_BYTES),
        ("ledger job", Some(job), MAX_LEDGER_JOB_BYTES),
        ("ledger owner", owner, crate::MAX_NAME_BYTES),
    ];
    for (what, v, max) in fields {
        if let Some(v) = v
            && (v.is_empty() || v.contains('\0') || v.len() > max)
        {
            return Err(FenceError::InvalidInput { what, reason: format!("must be 1..={max} bytes without NUL") });
        }
    }
    if epoch < 1 {
        return Err(FenceError::InvalidInput {
            what: "epoch",
            reason: format!("{epoch} is not a claimed epoch (must be >= 1)"),
        });
    }
    Ok(())
}

/// The verdict from what the upsert returned (`accepted`) and, when it refused, the entry that
/// refused it (`current`: epoch and owner).
fn verdict(accepted: Option<i64>, current: Option<(i64, Option<String>)>, epoch: i64, owner: Option<&str>) -> Verdict {
    match (accepted, current) {
        (Some(newest), _) => Verdict::Accepted { newest },
        (None, Some((newest, holder))) if newest == epoch => {
            tracing::error!(
                epoch,
                owner,
                holder = holder.as_deref(),
                "ledger: the same epoch from two owners (a fencing token handed out twice); refused"
            );
            Verdict::Conflict { newest }
        }
        (None, current) => Verdict::Stale { newest: current.map_or(epoch, |(newest, _)| newest) },
    }
}

/// The epoch ledger on PostgreSQL, in the fence's schema.
///
/// ```no_run
/// # async fn demo(fence: brokerfence::PgFence) -> brokerfence::Result<()> {
/// use brokerfence::ledger::{PgLedger, Verdict};
/// let ledger = PgLedger::new(&fence, "payments-api");
/// match ledger.accept_by("order-7", 2, "worker-a").await? {
///     Verdict::Accepted { .. } => { /* apply the effect */ }
///     Verdict::Stale { newest } => println!("refused: epoch 2 < {newest}"),
///     Verdict::Conflict { .. } => println!("refused: another owner holds epoch 2"),
///     _ => println!("refused"),
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[cfg(feature = "postgres")]
pub struct PgLedger {
    fence: PgFence,
    scope: Arc<str>,
}

#[cfg(feature = "postgres")]
impl PgLedger {
    /// A ledger for one receiver (`scope` separates receivers sharing a database).
    pub fn new(fence: &PgFence, scope: &str) -> Self {
        Self { fence: fence.clone(), scope: scope.into() }
    }

    /// The receiver scope this ledger keeps epochs for.
    ///
    /// ```no_run
    /// # fn demo(fence: brokerfence::PgFence) {
    /// assert_eq!(brokerfence::ledger::PgLedger::new(&fence, "payments-api").scope(), "payments-api");
    /// # }
    /// ```
    pub fn scope(&self) -> &str {
        &self.scope
    }

    /// The pool of the fence the ledger lives in: a receiver that applies its effect in the same
    /// transaction as [`accept_in`](Self::accept_in) begins that transaction here (its effect
    /// tables must be in the same database as the ledger).
    ///
    /// ```no_run
    /// # async fn demo(ledger: brokerfence::ledger::PgLedger) -> brokerfence::Result<()> {
    /// let mut tx = ledger.pool().begin().await?;
    /// let verdict = ledger.accept_in(&mut tx, "orders/o-1", 2).await?;
    /// if verdict.is_accepted() { tx.commit().await?; }
    /// # Ok(()) }
    /// ```
    pub fn pool(&self) -> &sqlx::PgPool {
        self.fence.pool()
    }

    /// Begins a transaction for a receiver's effect and [`accept_in`](Self::accept_in), with
    /// the fence's time limits (see [`PgFence::begin`]; behind a transaction-mode pooler that is
    /// the only way they reach the server).
    ///
    /// ```no_run
    /// # async fn demo(ledger: brokerfence::ledger::PgLedger) -> brokerfence::Result<()> {
    /// let mut tx = ledger.begin().await?;
    /// if ledger.accept_in_by(&mut tx, "orders/o-1", 2, "worker-a").await?.is_accepted() {
    ///     tx.commit().await?;
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn begin(&self) -> Result<sqlx::Transaction<'static, sqlx::Postgres>> {
        self.fence.begin().await
    }

    /// The guards of the fence the ledger was made from (test support).
    #[doc(hidden)]
    pub fn guards(&self) -> crate::Guards {
        self.fence.get_guards()
    }

    /// Accepts `epoch` for `job` if it is not older than the newest seen; one atomic statement.
    /// The caller does not say who it is: an equal epoch is accepted whoever sent it before
    /// (use [`accept_by`](Self::accept_by) to have a second owner of one epoch refused).
    pub async fn accept(&self, job: &str, epoch: i64) -> Result<Verdict> {
        self.accept_as(job, epoch, None).await
    }

    /// [`accept`](Self::accept) for a call that names its `owner` (the `Fence-Owner` of its
    /// stamp): an equal epoch from another owner is refused as [`Verdict::Conflict`].
    ///
    /// ```no_run
    /// # async fn demo(ledger: brokerfence::ledger::PgLedger) -> brokerfence::Result<()> {
    /// assert!(ledger.accept_by("orders/o-1", 7, "worker-a").await?.is_accepted());
    /// assert!(ledger.accept_by("orders/o-1", 7, "worker-a").await?.is_accepted()); // a retry
    /// let other = ledger.accept_by("orders/o-1", 7, "worker-b").await?;
    /// assert_eq!(other, brokerfence::ledger::Verdict::Conflict { newest: 7 });
    /// # Ok(()) }
    /// ```
    pub async fn accept_by(&self, job: &str, epoch: i64, owner: &str) -> Result<Verdict> {
        self.accept_as(job, epoch, Some(owner)).await
    }

    async fn accept_as(&self, job: &str, epoch: i64, owner: Option<&str>) -> Result<Verdict> {
        let mut session = self.fence.session(crate::postgres::Lane::Main).await?;
        let verdict = self.accept_in_as(&mut session, job, epoch, owner).await?;
        session.done().await?;
        Ok(verdict)
    }

    /// [`accept`](Self::accept) inside the receiver's own transaction, so that its effect and the
    /// ledger update commit together. A `Stale` (or `Conflict`) verdict means: roll back.
    ///
    /// Accepted inside a transaction, the ledger row of (scope, `job`) stays locked until that
    /// transaction ends: a concurrent call for the same job (any epoch) waits in its own
    /// `accept_in` (bounded by the connection's `lock_timeout`), then sees the committed epoch.
    pub async fn accept_in(&self, conn: &mut sqlx::PgConnection, job: &str, epoch: i64) -> Result<Verdict> {
        self.accept_in_as(conn, job, epoch, None).await
    }

    /// [`accept_in`](Self::accept_in) for a call that names its `owner` (see
    /// [`accept_by`](Self::accept_by)).
    pub async fn accept_in_by(
        &self,
        conn: &mut sqlx::PgConnection,
        job: &str,
        epoch: i64,
        owner: &str,
    ) -> Result<Verdict> {
        self.accept_in_as(conn, job, epoch, Some(owner)).await
    }

    async fn accept_in_as(
        &self,
        conn: &mut sqlx::PgConnection,
        job: &str,
        epoch: i64,
        owner: Option<&str>,
    ) -> Result<Verdict> {
        check(&self.scope, job, epoch, owner)?;
        let accepted: Option<i64> = sqlx::query_scalar(AssertSqlSafe(Arc::clone(&self.fence.stmts.ledger_accept)))
            .persistent(self.fence.persistent())
            .bind(self.scope.to_string())
            .bind(job.to_owned())
            .bind(epoch)
            .bind(owner.map(str::to_owned))
            .fetch_optional(&mut *conn)
            .await?;
        // Refused: the row that refused us is committed (the upsert waited for it), so a new
        // statement sees it, or a newer one; the statement's own snapshot might not have.
        let current = if accepted.is_none() { self.current_in(conn, job).await? } else { None };
        Ok(verdict(accepted, current, epoch, owner))
    }

    async fn current_in(&self, conn: &mut sqlx::PgConnection, job: &str) -> Result<Option<(i64, Option<String>)>> {
        Ok(sqlx::query_as(AssertSqlSafe(Arc::clone(&self.fence.stmts.ledger_current)))
            .persistent(self.fence.persistent())
            .bind(self.scope.to_string())
            .bind(job.to_owned())
            .fetch_optional(&mut *conn)
            .await?)
    }

    /// The newest epoch accepted for `job`, if any.
    pub async fn newest(&self, job: &str) -> Result<Option<i64>> {
        let mut session = self.fence.session(crate::postgres::Lane::Main).await?;
        let current = self.current_in(&mut session, job).await?;
        session.done().await?;
        Ok(current.map(|(epoch, _)| epoch))
    }

    /// Deletes this scope's entries not updated for `age` (database clock), in batches of
    /// `batch` rows per short transaction, read by the `ledger_age` index; at most one pruner
    /// per schema at a time (a call that finds another at work returns with `contended`). Once
    /// an entry is gone, the next call for that job is accepted whatever its epoch: keep `age`
    /// longer than a superseded attempt can still call (see
    /// [`DEFAULT_LEDGER_AGE`](crate::retention::DEFAULT_LEDGER_AGE)).
    ///
    /// ```no_run
    /// # async fn demo(ledger: brokerfence::ledger::PgLedger) -> brokerfence::Result<()> {
    /// let report = ledger.prune(brokerfence::retention::DEFAULT_LEDGER_AGE, 1_000).await?;
    /// println!("{} ledger rows deleted", report.ledger);
    /// # Ok(()) }
    /// ```
    pub async fn prune(&self, age: std::time::Duration, batch: u32) -> Result<crate::PruneReport> {
        let batch = batch.max(1);
        let span = tracing::info_span!("fence.ledger.prune", backend = "postgres", scope = &*self.scope);
        let (ledger, batches, contended) = tracing::Instrument::instrument(
            self.fence.prune_ledger_scope(&self.scope, age, batch, std::time::Duration::from_millis(10)),
            span,
        )
        .await?;
        Ok(crate::PruneReport { ledger, batches, contended, ..Default::default() })
    }
}

/// The epoch ledger on SQLite.
///
/// ```no_run
/// # async fn demo(fence: brokerfence::SqliteFence) -> brokerfence::Result<()> {
/// let ledger = brokerfence::ledger::SqliteLedger::new(&fence, "mailer");
/// assert!(ledger.accept("job-1", 1).await?.is_accepted());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
#[cfg(feature = "sqlite")]
pub struct SqliteLedger {
    fence: SqliteFence,
    scope: Arc<str>,
}

#[cfg(feature = "sqlite")]
impl SqliteLedger {
    /// A ledger for one receiver.
    pub fn new(fence: &SqliteFence, scope: &str) -> Self {
        Self { fence: fence.clone(), scope: scope.into() }
    }

    /// Accepts `epoch` for `job` if it is not older than the newest seen; one atomic statement
    /// (see [`PgLedger::accept`]).
    pub async fn accept(&self, job: &str, epoch: i64) -> Result<Verdict> {
        let mut conn = self.fence.pool().acquire().await?;
        self.accept_in_as(&mut conn, job, epoch, None).await
    }

    /// [`accept`](Self::accept) for a call that names its `owner` (see [`PgLedger::accept_by`]).
    ///
    /// ```no_run
    /// # async fn demo(ledger: brokerfence::ledger::SqliteLedger) -> brokerfence::Result<()> {
    /// assert!(ledger.accept_by("mail/m-1", 3, "worker-a").await?.is_accepted());
    /// assert!(!ledger.accept_by("mail/m-1", 3, "worker-b").await?.is_accepted());
    /// # Ok(()) }
    /// ```
    pub async fn accept_by(&self, job: &str, epoch: i64, owner: &str) -> Result<Verdict> {
        let mut conn = self.fence.pool().acquire().await?;
        self.accept_in_as(&mut conn, job, epoch, Some(owner)).await
    }

    /// [`accept`](Self::accept) inside the receiver's own transaction.
    pub async fn accept_in(&self, conn: &mut sqlx::SqliteConnection, job: &str, epoch: i64) -> Result<Verdict> {
        self.accept_in_as(conn, job, epoch, None).await
    }

    /// [`accept_in`](Self::accept_in) for a call that names its `owner`.
    pub async fn accept_in_by(
        &self,
        conn: &mut sqlx::SqliteConnection,
        job: &str,
        epoch: i64,
        owner: &str,
    ) -> Result<Verdict> {
        self.accept_in_as(conn, job, epoch, Some(owner)).await
    }

    async fn accept_in_as(
        &self,
        conn: &mut sqlx::SqliteConnection,
        job: &str,
        epoch: i64,
        owner: Option<&str>,
    ) -> Result<Verdict> {
        check(&self.scope, job, epoch, owner)?;
        let accepted: Option<i64> = sqlx::query_scalar(AssertSqlSafe(Arc::clone(&self.fence.stmts.ledger_accept)))
            .bind(self.scope.to_string())
            .bind(job.to_owned())
            .bind(epoch)
            .bind(owner.map(str::to_owned))
            .fetch_optional(&mut *conn)
            .await?;
        let current = if accepted.is_none() { self.current_in(conn, job).await? } else { None };
        Ok(verdict(accepted, current, epoch, owner))
    }

    async fn current_in(&self, conn: &mut sqlx::SqliteConnection, job: &str) -> Result<Option<(i64, Option<String>)>> {
        Ok(sqlx::query_as(AssertSqlSafe(Arc::clone(&self.fence.stmts.ledger_current)))
            .bind(self.scope.to_string())
            .bind(job.to_owned())
            .fetch_optional(&mut *conn)
            .await?)
    }

    /// The newest epoch accepted for `job`, if any.
    pub async fn newest(&self, job: &str) -> Result<Option<i64>> {
        let mut conn = self.fence.pool().acquire().await?;
        Ok(self.current_in(&mut conn, job).await?.map(|(epoch, _)| epoch))
    }

    /// Deletes this scope's entries not updated for `age`, in batches of `batch` rows (see
    /// [`PgLedger::prune`]).
    ///
    /// ```no_run
    /// # async fn demo(ledger: brokerfence::ledger::SqliteLedger) -> brokerfence::Result<()> {
    /// let report = ledger.prune(brokerfence::retention::DEFAULT_LEDGER_AGE, 1_000).await?;
    /// println!("{} ledger rows deleted", report.ledger);
    /// # Ok(()) }
    /// ```
    pub async fn prune(&self, age: std::time::Duration, batch: u32) -> Result<crate::PruneReport> {
        let batch = batch.max(1);
        let span = tracing::info_span!("fence.ledger.prune", backend = "sqlite", scope = &*self.scope);
        let (ledger, batches) = tracing::Instrument::instrument(
            self.fence.prune_ledger_scope(&self.scope, age, batch, std::time::Duration::from_millis(10)),
            span,
        )
        .await?;
        Ok(crate::PruneReport { ledger, batches, ..Default::default() })
    }
}

/// Either ledger, for code that serves both backends.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Ledger {
    /// PostgreSQL.
    #[cfg(feature = "postgres")]
    Pg(PgLedger),
    /// SQLite.
    #[cfg(feature = "sqlite")]
    Sqlite(SqliteLedger),
}

impl Ledger {
    /// Accepts or refuses `epoch` for `job`.
    pub async fn accept(&self, job: &str, epoch: i64) -> Result<Verdict> {
        match self {
            #[cfg(feature = "postgres")]
            Ledger::Pg(l) => l.accept(job, epoch).await,
            #[cfg(feature = "sqlite")]
            Ledger::Sqlite(l) => l.accept(job, epoch).await,
        }
    }

    /// Accepts or refuses `epoch` for `job` from `owner` (see [`PgLedger::accept_by`]).
    pub async fn accept_by(&self, job: &str, epoch: i64, owner: &str) -> Result<Verdict> {
        match self {
            #[cfg(feature = "postgres")]
            Ledger::Pg(l) => l.accept_by(job, epoch, owner).await,
            #[cfg(feature = "sqlite")]
            Ledger::Sqlite(l) => l.accept_by(job, epoch, owner).await,
        }
    }

    /// The newest epoch accepted for `job`.
    pub async fn newest(&self, job: &str) -> Result<Option<i64>> {
        match self {
            #[cfg(feature = "postgres")]
            Ledger::Pg(l) => l.newest(job).await,
            #[cfg(feature = "sqlite")]
            Ledger::Sqlite(l) => l.newest(job).await,
        }
    }
}
