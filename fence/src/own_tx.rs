//! Statements that run on the caller's own connection, inside the caller's transaction: the
//! fenced completion a handler commits together with its own rows
//! ([`JobContext::complete_in`](crate::JobContext::complete_in)).

use std::future::Future;
use std::pin::Pin;

#[cfg(feature = "postgres")]
use sqlx::PgConnection;
#[cfg(feature = "sqlite")]
use sqlx::SqliteConnection;

use crate::error::{FenceError, Result};
use crate::lease::Lease;
use crate::store::Backend;

/// A connection a handler's own transaction runs on: `sqlx::PgConnection` for a
/// [`PgFence`](crate::PgFence), `sqlx::SqliteConnection` for a [`SqliteFence`](crate::SqliteFence).
/// Pass `&mut *tx` of a top-level `sqlx::Transaction` (`pool.begin()`): a connection in
/// autocommit or inside a savepoint (a nested `tx.begin()`) is refused with
/// [`FenceError::TransactionDepth`] before anything is written (issue #30, item 6). Savepoints
/// and transactions opened with raw SQL (`SAVEPOINT …`) are not seen by sqlx: do not use them
/// around `complete_in`.
///
/// Sealed: the statements it runs are the fence's own.
///
/// ```no_run
/// # async fn handler(ctx: brokerfence::JobContext, pool: sqlx::PgPool) -> Result<Vec<u8>, brokerfence::JobError> {
/// let mut tx = pool.begin().await.map_err(brokerfence::JobError::retry)?;
/// sqlx::query("INSERT INTO shipments (job) VALUES ($1)")
///     .bind(ctx.key().as_str())
///     .execute(&mut *tx)
///     .await
///     .map_err(brokerfence::JobError::retry)?;
/// ctx.complete_in(&mut *tx, b"shipped").await.map_err(brokerfence::JobError::retry)?; // Fenced: rolled back
/// tx.commit().await.map_err(brokerfence::JobError::retry)?;
/// Ok(Vec::new()) // ignored: the result above is what committed
/// # }
/// ```
pub trait FencedConnection: Send + sealed::Sealed {
    #[doc(hidden)]
    fn complete_on<'a>(
        &'a mut self,
        store: Backend<'a>,
        lease: &'a Lease,
        result: &'a [u8],
    ) -> Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>>;
}

mod sealed {
    pub trait Sealed {}
    #[cfg(feature = "postgres")]
    impl Sealed for sqlx::PgConnection {}
    #[cfg(feature = "sqlite")]
    impl Sealed for sqlx::SqliteConnection {}
}

#[cfg(feature = "postgres")]
impl FencedConnection for PgConnection {
    fn complete_on<'a>(
        &'a mut self,
        store: Backend<'a>,
        lease: &'a Lease,
        result: &'a [u8],
    ) -> Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>> {
        Box::pin(async move {
            match store {
                Backend::Postgres(fence) => fence.complete_in(self, lease, result).await,
                _ => Err(mismatch("a PostgreSQL connection", store)),
            }
        })
    }
}

#[cfg(feature = "sqlite")]
impl FencedConnection for SqliteConnection {
    fn complete_on<'a>(
        &'a mut self,
        store: Backend<'a>,
        lease: &'a Lease,
        result: &'a [u8],
    ) -> Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>> {
        Box::pin(async move {
            match store {
                Backend::Sqlite(fence) => fence.complete_in(self, lease, result).await,
                _ => Err(mismatch("a SQLite connection", store)),
            }
        })
    }
}

/// Refuses a connection outside a transaction or inside a savepoint: the fenced abort (BF409 on
/// PostgreSQL, the deferred-FK trap on SQLite) holds only for a top-level transaction; a
/// savepoint's rollback clears it and autocommit has nothing to abort.
pub(crate) fn top_level<DB: sqlx::Database>(conn: &DB::Connection) -> Result<()> {
    use sqlx_core::transaction::TransactionManager;
    match DB::TransactionManager::get_transaction_depth(conn) {
        1 => Ok(()),
        depth => Err(FenceError::TransactionDepth { depth }),
    }
}

fn mismatch(connection: &'static str, store: Backend<'_>) -> FenceError {
    FenceError::Unsupported(match (connection, store) {
        (_, Backend::Other(_)) => {
            "complete_in: the supervisor's store does not name its backend (a wrapping store must delegate FenceStore::concrete)"
        }
        ("a PostgreSQL connection", _) => "complete_in: a PostgreSQL connection for a store that is not PostgreSQL",
        _ => "complete_in: a SQLite connection for a store that is not SQLite",
    })
}
