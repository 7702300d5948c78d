//! The atomic receiver: the ledger check and the handler's effect in ONE PostgreSQL transaction.
//!
//! [`EpochGuard`](super::EpochGuard) checks the ledger, then runs the handler: two steps. A zombie
//! whose call was accepted first (epoch 1) but whose effect lands after the new owner's (epoch 2)
//! leaves the receiver holding the zombie's effect. [`AtomicEpochGuard`] closes that gap for
//! effects that are rows in the ledger's own database. Per request it
//!
//! 1. parses the stamp (`400` when missing or malformed; the handler does not run);
//! 2. begins a transaction on the ledger's pool and moves the ledger row of (scope, job) to the
//!    request's epoch INSIDE it ([`PgLedger::accept_in`]): the row stays locked until the
//!    transaction ends, so a concurrent call for the same job, whatever its epoch, waits;
//! 3. answers `409` on a stale epoch (rolled back; the handler does not run);
//! 4. hands the handler that transaction ([`EffectTx`]) and runs it;
//! 5. commits the handler's effect and the ledger update together when the response is a success
//!    (`2xx`), and rolls both back otherwise (the handler's response is passed on as it is).
//!
//! So the order in which effects land is the order of the epochs: a zombie's late call either
//! committed before the newer epoch took the row (and the newer effect then overwrites it) or
//! waits, sees the newer epoch and gets `409` with nothing applied.
//!
//! | situation                                            | response                                |
//! |------------------------------------------------------|-----------------------------------------|
//! | no stamp, or a malformed one                         | `400`, handler not run                  |
//! | an epoch older than the newest committed             | `409`, handler not run, nothing written |
//! | BEGIN or the ledger upsert fails, times out, or waits longer than `lock_timeout` on the row | `503` + `Retry-After: 1`, handler not run |
//! | handler answers `2xx`                                | effect and ledger committed; the handler's response |
//! | handler answers anything else                        | both rolled back; the handler's response |
//! | handler's transaction broken (a failed statement it ignored), or COMMIT fails or times out | `503` + `Retry-After: 1` (see below) |
//! | handler runs longer than the handler timeout         | `503` + `Retry-After: 1`, rolled back   |
//! | handler leaked its connection guard                  | `500`, rolled back (see below)          |
//!
//! ```no_run
//! # async fn demo(ledger: brokerfence::ledger::PgLedger) -> std::io::Result<()> {
//! use axum::{Router, http::StatusCode, routing::post};
//! use brokerfence::http::AcceptedStamp;
//! use brokerfence::http::atomic::{AtomicEpochGuard, EffectTx};
//!
//! async fn charge(AcceptedStamp { stamp, .. }: AcceptedStamp, tx: EffectTx, body: String)
//!     -> Result<&'static str, StatusCode>
//! {
//!     let mut conn = tx.conn().await.map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
//!     sqlx::query("INSERT INTO charges (job, epoch, body) VALUES ($1, $2, $3) \
//!                  ON CONFLICT (job) DO UPDATE SET epoch = EXCLUDED.epoch, body = EXCLUDED.body")
//!         .bind(stamp.ledger_job()).bind(stamp.epoch).bind(body)
//!         .execute(&mut *conn).await
//!         .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?; // not 2xx: charge and ledger roll back
//!     Ok("charged") // 2xx: the layer commits the charge and the ledger move together
//! }
//!
//! let app = Router::new().route("/charge", post(charge)).layer(AtomicEpochGuard::new(ledger).layer());
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! axum::serve(listener, app).await
//! # }
//! ```
//!
//! ## What it costs, and its limits
//!
//! - **PostgreSQL only.** The effect must be rows in the database (and through the pool) of the
//!   ledger's fence. On SQLite a transaction that writes holds the file's single write lock: one
//!   held for a handler's whole run would stop every other writer of the file (other receivers'
//!   requests, and the fence's own claims and heartbeats when they share the file), so there is no
//!   SQLite variant; an SQLite receiver uses [`SqliteLedger::accept_in`](fence::ledger::SqliteLedger::accept_in)
//!   in a short transaction of its own around a quick effect.
//! - **Effects elsewhere are not covered.** An email sent or an HTTP call made by the handler
//!   cannot be rolled back; for those use the outbox (write the message in this transaction,
//!   publish after commit) or an idempotent downstream with the check-only guard.
//! - **Calls for the same job are serialised** for the duration of the handler (the ledger row is
//!   locked): a newer epoch waits up to the pool's `lock_timeout` (3 s with the default
//!   [`PgTimeouts`](fence::PgTimeouts)) and then gets `503` + `Retry-After`. Keep handlers short.
//!   Calls for different jobs do not wait on each other.
//! - **Each request holds one pool connection** from BEGIN to COMMIT: the fence pool's size bounds
//!   the requests in flight (more wait for a connection, within the database timeout).
//! - **A commit whose outcome is unknown** (the COMMIT timed out or the connection dropped during
//!   it) answers `503`: the effect may have committed. The caller retries with the same epoch, which
//!   the ledger accepts again (equal epoch: the same owner retrying), so write the effect so that
//!   applying it twice at one epoch is harmless (an upsert keyed by the job, as above).
//! - **A broken transaction is not a success.** PostgreSQL turns the COMMIT of a transaction in
//!   which a statement failed into a silent ROLLBACK; a handler that ignores such an error and
//!   answers `2xx` would report an effect that never happened. The layer runs one trivial
//!   statement in the transaction before committing (one round trip): it fails on a broken
//!   transaction, and the layer answers `503` instead.
//! - **Time limits.** Opening (BEGIN and the ledger upsert) and closing (the check and COMMIT, or
//!   ROLLBACK) are each bounded by the database timeout ([`DEFAULT_DB_TIMEOUT`], on top of the
//!   server-side `statement_timeout`/`lock_timeout` of fence pools); the handler by the handler
//!   timeout ([`DEFAULT_HANDLER_TIMEOUT`]). Each database step runs in a task of its own, so giving
//!   up on it never drops a statement mid-flight: the abandoned step finishes on its own and rolls
//!   back. A request whose client goes away mid-way is dropped with its transaction: rolled back,
//!   unless its COMMIT had already been sent.
//!
//! ## If the handler leaks the transaction
//!
//! The layer takes the transaction back as soon as the handler's response is ready. An
//! [`EffectTx`] kept past that point (cloned into a spawned task) finds it gone:
//! [`EffectTx::conn`] answers [`EffectTxError::Finished`], and nothing that task does reaches the
//! committed transaction. An [`EffectConn`] still alive at that point (a guard moved into a spawned
//! task) is a bug the layer cannot repair: it answers `500` and commits nothing, and the
//! transaction rolls back when that guard is dropped; until then the ledger row stays locked and
//! newer epochs of the job get `503` after their `lock_timeout`. Never move the guard out of the
//! handler.
//!
//! ## The `receiver_ledger_lock` guard
//!
//! Taking the ledger row inside the effect's transaction is what [`Guards`](fence::Guards) calls
//! `receiver_ledger_lock` (on by default; only the test-only feature `guard-switches` can turn it
//! off, through the ledger's fence). Switched off, the layer accepts the epoch in an autocommit
//! statement of its own before beginning the effect's transaction: check-then-act, the
//! violation the guard-switch test (`tests/effects/receiver.rs`) shows.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRequestParts, Request, State};
use axum::http::header::RETRY_AFTER;
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{FromFnLayer, Next};
use axum::response::{IntoResponse, Response};
use fence::FenceError;
use fence::ledger::{PgLedger, Verdict};
use fence::wire::{self, FenceStamp, StampError};
use futures::future::BoxFuture;
use sqlx::{PgConnection, Postgres, Transaction};
use tokio::sync::{Mutex, OwnedMappedMutexGuard, OwnedMutexGuard};
use tracing::Instrument;

use super::{AcceptedStamp, json, stale_response, stamp_error_response, stamp_from_headers, unavailable_response};
use crate::builder::setters;

type Tx = Transaction<'static, Postgres>;

/// How long one database step of the atomic receiver may take (opening: BEGIN and the ledger
/// upsert; closing: the check and COMMIT, or ROLLBACK): 5 s, above the fence pool's default
/// `lock_timeout` (3 s) so that a wait on the ledger row ends with the server's own error first.
pub const DEFAULT_DB_TIMEOUT: Duration = Duration::from_secs(5);

/// How long the handler may run while it holds the transaction (and the ledger row): 30 s.
pub const DEFAULT_HANDLER_TIMEOUT: Duration = Duration::from_secs(30);

/// The middleware function behind [`AtomicEpochGuard::layer`], as a plain function pointer.
pub type AtomicEnforceFn = fn(State<AtomicEpochGuard>, Request, Next) -> BoxFuture<'static, Response>;

/// The layer [`AtomicEpochGuard::layer`] returns: add it to a `Router` with `.layer(…)` or
/// `.route_layer(…)`.
pub type AtomicFenceLayer = FromFnLayer<AtomicEnforceFn, AtomicEpochGuard, (State<AtomicEpochGuard>, Request)>;

/// The atomic receiver (see the [module docs](self)): the ledger check and the handler's effect
/// commit together, in one PostgreSQL transaction the handler gets as [`EffectTx`].
///
/// ```no_run
/// # fn demo(fence: brokerfence::PgFence) {
/// use std::time::Duration;
/// let guard = brokerfence::http::atomic::AtomicEpochGuard::new(brokerfence::ledger::PgLedger::new(&fence, "payments"))
///     .handler_timeout(Duration::from_secs(5));
/// let app: axum::Router = axum::Router::new()
///     .route("/effect", axum::routing::post(|| async { "applied" }))
///     .layer(guard.layer());
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct AtomicEpochGuard {
    ledger: PgLedger,
    db_timeout: Duration,
    handler_timeout: Duration,
}

impl AtomicEpochGuard {
    /// A guard on `ledger` (give each receiver its own ledger scope). The effect tables must be in
    /// the ledger's database: the transaction is begun on [`PgLedger::pool`].
    ///
    /// ```no_run
    /// # fn demo(fence: brokerfence::PgFence) {
    /// let guard = brokerfence::http::atomic::AtomicEpochGuard::new(brokerfence::ledger::PgLedger::new(&fence, "payments"));
    /// # }
    /// ```
    pub fn new(ledger: PgLedger) -> Self {
        Self { ledger, db_timeout: DEFAULT_DB_TIMEOUT, handler_timeout: DEFAULT_HANDLER_TIMEOUT }
    }

    setters! {
        /// Another limit for each database step ([`DEFAULT_DB_TIMEOUT`]; at least 1 ms).
        ///
        /// ```no_run
        /// # fn demo(guard: brokerfence::http::atomic::AtomicEpochGuard) {
        /// let guard = guard.db_timeout(std::time::Duration::from_secs(2));
        /// # }
        /// ```
        pub fn db_timeout(limit: Duration) { db_timeout = limit.max(Duration::from_millis(1)) }

        /// Another limit for the handler ([`DEFAULT_HANDLER_TIMEOUT`]; at least 1 ms). The ledger row
        /// of the job stays locked while the handler runs: newer epochs wait.
        ///
        /// ```no_run
        /// # fn demo(guard: brokerfence::http::atomic::AtomicEpochGuard) {
        /// let guard = guard.handler_timeout(std::time::Duration::from_secs(5));
        /// # }
        /// ```
        pub fn handler_timeout(limit: Duration) { handler_timeout = limit.max(Duration::from_millis(1)) }
    }

    /// The ledger.
    ///
    /// ```no_run
    /// # async fn demo(guard: brokerfence::http::atomic::AtomicEpochGuard) -> brokerfence::Result<()> {
    /// println!("newest: {:?}", guard.ledger().newest("orders/o-1").await?);
    /// # Ok(()) }
    /// ```
    pub fn ledger(&self) -> &PgLedger {
        &self.ledger
    }

    /// The axum layer.
    ///
    /// ```no_run
    /// # fn demo(guard: brokerfence::http::atomic::AtomicEpochGuard) {
    /// let app: axum::Router = axum::Router::new().layer(guard.layer());
    /// # }
    /// ```
    pub fn layer(&self) -> AtomicFenceLayer {
        axum::middleware::from_fn_with_state(self.clone(), enforce_atomic_boxed as AtomicEnforceFn)
    }

    /// Opens the request's transaction with the ledger row moved to `epoch` (or, guard switched
    /// off, accepts in autocommit first, then opens a transaction for the effect alone).
    async fn open(&self, job: String, epoch: i64, owner: Option<String>) -> Result<Opened, Response> {
        let ledger = self.ledger.clone();
        let locked = ledger.guards().receiver_ledger_lock();
        let opening = async move {
            if !locked {
                // Guard off (test only): check-then-act, like the check-only guard.
                let verdict = match &owner {
                    Some(owner) => ledger.accept_by(&job, epoch, owner).await?,
                    None => ledger.accept(&job, epoch).await?,
                };
                match verdict {
                    Verdict::Stale { newest } => return Ok(Opened::Stale { newest }),
                    Verdict::Conflict { .. } => return Ok(Opened::Conflict),
                    _ => {}
                }
            }
            let mut tx = ledger.begin().await?;
            if !locked {
                return Ok(Opened::Accepted { tx, newest: epoch });
            }
            let verdict = match &owner {
                Some(owner) => ledger.accept_in_by(&mut tx, &job, epoch, owner).await?,
                None => ledger.accept_in(&mut tx, &job, epoch).await?,
            };
            let refused = match verdict {
                Verdict::Accepted { newest } => return Ok(Opened::Accepted { tx, newest }),
                Verdict::Stale { newest } => Opened::Stale { newest },
                _ => Opened::Conflict,
            };
            if let Err(e) = tx.rollback().await {
                tracing::warn!(error = %e, "rollback after a refused epoch failed (the connection rolls back on release)");
            }
            Ok(refused)
        };
        match detached(self.db_timeout, opening).await {
            Ok(opened) => Ok(opened),
            Err(Step::Failed(FenceError::InvalidInput { what, reason })) => {
                let e = StampError::Malformed { name: wire::JOB, reason: format!("{what}: {reason}") };
                Err(stamp_error_response(&e))
            }
            Err(e) => {
                tracing::error!(error = %e, "ledger unavailable; call refused");
                Err(unavailable_response())
            }
        }
    }

    async fn run(self, stamp: FenceStamp, mut req: Request, next: Next) -> Response {
        let (tx, newest) = match self.open(stamp.ledger_job(), stamp.epoch, stamp.owner.clone()).await {
            Ok(Opened::Accepted { tx, newest }) => (tx, newest),
            Ok(Opened::Stale { newest }) => {
                tracing::warn!(
                    newest,
                    owner = stamp.owner.as_deref().unwrap_or("-"),
                    "stale epoch refused: the caller was superseded"
                );
                return stale_response(&stamp, newest);
            }
            Ok(Opened::Conflict) => {
                tracing::error!(
                    owner = stamp.owner.as_deref().unwrap_or("-"),
                    "epoch refused: another owner holds the same epoch (a fencing token handed out twice)"
                );
                return super::conflict_response(&stamp);
            }
            Err(refusal) => return refusal,
        };
        tracing::debug!(newest, "fence stamp accepted; ledger row held by the request's transaction");
        let slot = Arc::new(Mutex::new(Some(tx)));
        req.extensions_mut().insert(EffectTx { slot: Arc::clone(&slot) });
        req.extensions_mut().insert(AcceptedStamp { stamp, newest });
        let response = match tokio::time::timeout(self.handler_timeout, next.run(req)).await {
            Ok(response) => Some(response),
            Err(_) => {
                tracing::error!(limit = ?self.handler_timeout, "handler ran past its time limit; effect rolled back");
                None
            }
        };
        // Take the transaction back: later `EffectTx::conn` calls find it gone.
        let tx = match slot.try_lock() {
            Ok(mut held) => held.take(),
            Err(_) => {
                tracing::error!(
                    "a connection guard (EffectConn) outlived the handler; nothing committed, \
                     the transaction rolls back when that guard is dropped"
                );
                return error_json(StatusCode::INTERNAL_SERVER_ERROR, "effect_leaked", LEAKED);
            }
        };
        let Some(tx) = tx else {
            tracing::error!("the request's transaction was gone when the handler returned");
            return error_json(StatusCode::INTERNAL_SERVER_ERROR, "effect_leaked", LEAKED);
        };
        let Some(response) = response else {
            self.roll_back(tx).await;
            return retry_later("effect_timeout", "the effect took too long and was rolled back; retry later");
        };
        if !response.status().is_success() {
            tracing::debug!(status = %response.status(), "handler refused; effect and ledger rolled back");
            self.roll_back(tx).await;
            return response;
        }
        match detached(self.db_timeout, commit_checked(tx)).await {
            Ok(()) => {
                tracing::debug!("effect and ledger committed");
                response
            }
            Err(e) => {
                tracing::error!(error = %e, "effect not committed (or outcome unknown); answered 503");
                retry_later("effect_not_committed", "the effect could not be committed; retry later")
            }
        }
    }

    async fn roll_back(&self, tx: Tx) {
        // A no-op on the server when the handler's statements already aborted the transaction.
        let rollback = async move { tx.rollback().await.map_err(FenceError::from) };
        if let Err(e) = detached(self.db_timeout, rollback).await {
            tracing::warn!(error = %e, "rollback failed; the connection rolls back when it is released");
        }
    }
}

const LEAKED: &str = "the effect's transaction was still in use when the handler returned; nothing was committed";

enum Opened {
    Accepted { tx: Tx, newest: i64 },
    Stale { newest: i64 },
    Conflict,
}

/// Commits only a healthy transaction: PostgreSQL answers the COMMIT of a transaction in which a
/// statement failed with a silent ROLLBACK, so one trivial statement first proves it is not.
async fn commit_checked(mut tx: Tx) -> Result<(), FenceError> {
    sqlx::query("SELECT 1").execute(&mut *tx).await?;
    tx.commit().await?;
    Ok(())
}

/// Why a database step gave no answer.
#[derive(Debug, thiserror::Error)]
enum Step {
    #[error(transparent)]
    Failed(#[from] FenceError),
    #[error("no answer within {0:?} (the step goes on in the background and rolls back)")]
    TimedOut(Duration),
    #[error("the step's task ended without an answer: {0}")]
    Aborted(String),
}

/// Runs one database step in a task of its own, bounded by `limit`. Giving up never drops a
/// statement mid-flight (see `fence`'s own `detached`): the abandoned step finishes on its own, and
/// a transaction it still owns is dropped there, i.e. rolled back, and its connection returned.
async fn detached<T: Send + 'static>(
    limit: Duration,
    step: impl Future<Output = Result<T, FenceError>> + Send + 'static,
) -> Result<T, Step> {
    let task = tokio::spawn(step.in_current_span());
    match tokio::time::timeout(limit, task).await {
        Ok(Ok(answer)) => answer.map_err(Step::Failed),
        Ok(Err(join)) => Err(Step::Aborted(join.to_string())),
        Err(_) => Err(Step::TimedOut(limit)),
    }
}

fn error_json(status: StatusCode, error: &str, message: &str) -> Response {
    json(status, format!(r#"{{"error":"{error}","message":"{message}"}}"#))
}

fn retry_later(error: &str, message: &str) -> Response {
    let mut response = error_json(StatusCode::SERVICE_UNAVAILABLE, error, message);
    response.headers_mut().insert(RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

/// The middleware behind [`AtomicEpochGuard::layer`]: use it with
/// `axum::middleware::from_fn_with_state(guard, enforce_atomic)`, or through the layer.
///
/// ```no_run
/// # fn demo(guard: brokerfence::http::atomic::AtomicEpochGuard) {
/// let app: axum::Router = axum::Router::new()
///     .layer(axum::middleware::from_fn_with_state(guard, brokerfence::http::atomic::enforce_atomic));
/// # }
/// ```
pub async fn enforce_atomic(State(guard): State<AtomicEpochGuard>, req: Request, next: Next) -> Response {
    let stamp = match stamp_from_headers(req.headers()) {
        Ok(stamp) => stamp,
        Err(e) => {
            tracing::info!(error = %e, "request without a valid fence stamp refused");
            return stamp_error_response(&e);
        }
    };
    let span = tracing::info_span!(
        "atomic_receiver",
        scope = guard.ledger.scope(),
        queue = %stamp.queue,
        job = %stamp.job,
        epoch = stamp.epoch
    );
    crate::otel::continue_from(&span, req.headers());
    guard.run(stamp, req, next).instrument(span).await
}

fn enforce_atomic_boxed(state: State<AtomicEpochGuard>, req: Request, next: Next) -> BoxFuture<'static, Response> {
    Box::pin(enforce_atomic(state, req, next))
}

/// The request's transaction, for the handler behind an [`AtomicEpochGuard`]: the ledger row of
/// the job is locked in it and already moved to the request's epoch. Write the effect through
/// [`conn`](Self::conn); the layer commits (handler answered `2xx`) or rolls back (anything else).
/// Extracting it on a route without the layer is a `500` (a wiring mistake).
///
/// Cloning is cheap and shares the one transaction; statements from clones run one at a time.
///
/// ```no_run
/// use brokerfence::http::atomic::{EffectTx, EffectTxError};
/// async fn handler(tx: EffectTx) -> Result<&'static str, EffectTxError> {
///     let mut conn = tx.conn().await?;
///     sqlx::query("UPDATE accounts SET balance = balance - 10 WHERE id = 7")
///         .execute(&mut *conn).await.map_err(EffectTxError::from)?;
///     Ok("debited")
/// }
/// ```
#[derive(Clone)]
pub struct EffectTx {
    slot: Arc<Mutex<Option<Tx>>>,
}

impl std::fmt::Debug for EffectTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EffectTx").finish_non_exhaustive()
    }
}

impl EffectTx {
    /// The transaction's connection, held until the returned guard is dropped (other clones wait).
    /// [`EffectTxError::Finished`] once the layer has taken the transaction back (the handler
    /// returned).
    ///
    /// ```no_run
    /// # async fn demo(tx: brokerfence::http::atomic::EffectTx) -> Result<(), Box<dyn std::error::Error>> {
    /// let mut conn = tx.conn().await?;
    /// let n: i64 = sqlx::query_scalar("SELECT count(*) FROM charges").fetch_one(&mut *conn).await?;
    /// # let _ = n; Ok(()) }
    /// ```
    pub async fn conn(&self) -> Result<EffectConn, EffectTxError> {
        let held = Arc::clone(&self.slot).lock_owned().await;
        OwnedMutexGuard::try_map(held, Option::as_mut)
            .map(|guard| EffectConn { guard })
            .map_err(|_| EffectTxError::Finished)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for EffectTx {
    type Rejection = (StatusCode, &'static str);

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<EffectTx>().cloned().ok_or((
            StatusCode::INTERNAL_SERVER_ERROR,
            "EffectTx extracted on a route without the AtomicEpochGuard layer",
        ))
    }
}

/// The request transaction's connection (from [`EffectTx::conn`]): derefs to
/// [`PgConnection`], so `&mut *conn` is an executor. Drop it before the handler returns.
///
/// ```no_run
/// # async fn demo(tx: brokerfence::http::atomic::EffectTx) -> Result<(), Box<dyn std::error::Error>> {
/// let mut conn = tx.conn().await?;
/// sqlx::query("INSERT INTO audit (what) VALUES ($1)").bind("charged").execute(&mut *conn).await?;
/// drop(conn);
/// # Ok(()) }
/// ```
pub struct EffectConn {
    guard: OwnedMappedMutexGuard<Option<Tx>, Tx>,
}

impl std::fmt::Debug for EffectConn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EffectConn").finish_non_exhaustive()
    }
}

impl std::ops::Deref for EffectConn {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.guard
    }
}

impl std::ops::DerefMut for EffectConn {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.guard
    }
}

/// What can go wrong with the request's transaction in a handler. As a response it is a `500`
/// for [`Finished`](Self::Finished) and a `503` (retry later) for a database error; the body never
/// carries the database's own error text.
///
/// ```
/// use axum::response::IntoResponse;
/// let response = brokerfence::http::atomic::EffectTxError::Finished.into_response();
/// assert_eq!(response.status(), axum::http::StatusCode::INTERNAL_SERVER_ERROR);
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EffectTxError {
    /// The layer already took the transaction back (used after the handler returned).
    #[error("the request's transaction is finished (used after the handler returned)")]
    Finished,
    /// A statement of the handler failed; any status but `2xx` rolls the transaction back.
    #[error("database: {0}")]
    Database(#[from] sqlx::Error),
}

impl IntoResponse for EffectTxError {
    fn into_response(self) -> Response {
        match self {
            EffectTxError::Finished => {
                tracing::error!("EffectTx used after the handler returned");
                error_json(StatusCode::INTERNAL_SERVER_ERROR, "effect_finished", "the effect's transaction is finished")
            }
            EffectTxError::Database(e) => {
                tracing::error!(error = %e, "effect statement failed; rolled back");
                retry_later("effect_failed", "the effect could not be applied; retry later")
            }
        }
    }
}
