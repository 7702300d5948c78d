//! The receiver side of the fence for an HTTP service (axum 0.8): middleware that reads the
//! [fencing stamp](fence::wire) from the request headers and refuses a stale call before any
//! handler runs. Two guards; pick by what the handler's effect is:
//!
//! | guard | what it does | use it when the effect is |
//! |---|---|---|
//! | [`EpochGuard`] (check-only) | checks the [`Ledger`] (autocommit), then runs the handler | idempotent, or keyed so that the newer epoch's effect wins however the two land (it is check-then-act: a call accepted just before a newer epoch can still land its effect after the newer one's) |
//! | [`AtomicEpochGuard`](atomic::AtomicEpochGuard) (atomic) | moves the ledger row to the request's epoch inside a PostgreSQL transaction, hands that transaction to the handler ([`EffectTx`](atomic::EffectTx)), commits both on `2xx`, rolls both back otherwise | anything else that is rows in the ledger's PostgreSQL database: the final state is the newest epoch's effect, whatever the timing |
//!
//! Effects outside the database (an email, a call to a third party) are covered by neither: the
//! outbox carries those. The atomic guard is PostgreSQL-only (see [its docs](atomic)).
//!
//! The check-only guard answers:
//!
//! | request                                   | response                                  |
//! |-------------------------------------------|-------------------------------------------|
//! | no stamp, or a malformed one              | `400 Bad Request`, JSON naming the header |
//! | an epoch older than the newest accepted   | `409 Conflict`, JSON naming job, epoch and newest |
//! | the ledger cannot be reached              | `503 Service Unavailable` (retry later)   |
//! | otherwise (epoch newest or equal: a retry)| passed on; the handler can extract [`AcceptedStamp`] |
//!
//! ```no_run
//! # async fn demo(ledger: brokerfence::ledger::Ledger) -> std::io::Result<()> {
//! use axum::{Router, routing::post};
//! use brokerfence::http::{AcceptedStamp, EpochGuard};
//!
//! async fn charge(AcceptedStamp { stamp, .. }: AcceptedStamp, body: String) -> String {
//!     format!("charged {body} for {} at epoch {}", stamp.job, stamp.epoch)
//! }
//!
//! let app = Router::new().route("/charge", post(charge)).layer(EpochGuard::new(ledger).layer());
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! axum::serve(listener, app).await
//! # }
//! ```
//!
//! The atomic guard answers the same `400` and `409` (the handler does not run), `503` with
//! `Retry-After` when the ledger row cannot be taken in time or the commit fails, and otherwise
//! the handler's response, with its effect committed only when that response is a success. Its
//! [module docs](atomic) have the example, the full table and the limits. A handler that wants to
//! run the ledger's `accept_in` in a transaction it manages itself extracts [`Stamp`] (parsed,
//! not checked) on a route without either guard.

use axum::extract::{FromRequestParts, Request, State};
use axum::http::header::{CONTENT_TYPE, RETRY_AFTER};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::{FromFnLayer, Next};
use axum::response::{IntoResponse, Response};
use fence::ledger::{Ledger, Verdict};
use fence::wire::{self, FenceStamp, StampError};
use futures::future::BoxFuture;

#[cfg(feature = "postgres")]
pub mod atomic;

/// The middleware function behind [`EpochGuard::layer`], as a plain function pointer.
pub type EnforceFn = fn(State<EpochGuard>, Request, Next) -> BoxFuture<'static, Response>;

/// The layer [`EpochGuard::layer`] returns: add it to a `Router` with `.layer(…)` (every route)
/// or `.route_layer(…)` (matched routes only).
pub type FenceLayer = FromFnLayer<EnforceFn, EpochGuard, (State<EpochGuard>, Request)>;

/// Enforces the epoch convention on an HTTP receiver: one [`Ledger`] check per request.
///
/// ```no_run
/// # fn demo(ledger: brokerfence::ledger::Ledger) {
/// let app: axum::Router = axum::Router::new()
///     .route("/effect", axum::routing::post(|| async { "applied" }))
///     .layer(brokerfence::http::EpochGuard::new(ledger).layer());
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct EpochGuard {
    ledger: Ledger,
}

impl EpochGuard {
    /// A guard checking stamps against `ledger` (give each receiver its own ledger scope).
    ///
    /// ```no_run
    /// # fn demo(fence: brokerfence::PgFence) {
    /// let guard = brokerfence::http::EpochGuard::new(brokerfence::ledger::Ledger::Pg(brokerfence::ledger::PgLedger::new(&fence, "payments")));
    /// # }
    /// ```
    pub fn new(ledger: Ledger) -> Self {
        Self { ledger }
    }

    /// The ledger.
    ///
    /// ```no_run
    /// # async fn demo(guard: brokerfence::http::EpochGuard) -> brokerfence::Result<()> {
    /// println!("newest: {:?}", guard.ledger().newest("orders/o-1").await?);
    /// # Ok(()) }
    /// ```
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The axum layer.
    ///
    /// ```no_run
    /// # fn demo(guard: brokerfence::http::EpochGuard) {
    /// let app: axum::Router = axum::Router::new().layer(guard.layer());
    /// # }
    /// ```
    pub fn layer(&self) -> FenceLayer {
        axum::middleware::from_fn_with_state(self.clone(), enforce_boxed as EnforceFn)
    }

    /// Checks one request's headers: the accepted stamp, or the response refusing the call.
    ///
    /// ```no_run
    /// # async fn demo(guard: brokerfence::http::EpochGuard, headers: axum::http::HeaderMap) {
    /// match guard.check(&headers).await {
    ///     Ok(accepted) => println!("accepted {}", accepted.stamp),
    ///     Err(refusal) => println!("refused with {}", refusal.status()),
    /// }
    /// # }
    /// ```
    pub async fn check(&self, headers: &HeaderMap) -> Result<AcceptedStamp, Response> {
        let stamp = stamp_from_headers(headers).map_err(|e| {
            tracing::info!(error = %e, "request without a valid fence stamp refused");
            stamp_error_response(&e)
        })?;
        match stamp.accept(&self.ledger).await {
            Ok(Verdict::Accepted { newest }) => {
                tracing::debug!(%stamp, newest, "fence stamp accepted");
                Ok(AcceptedStamp { stamp, newest })
            }
            Ok(Verdict::Stale { newest }) => {
                tracing::warn!(
                    queue = %stamp.queue,
                    job = %stamp.job,
                    epoch = stamp.epoch,
                    newest,
                    owner = stamp.owner.as_deref().unwrap_or("-"),
                    "stale epoch refused: the caller was superseded"
                );
                Err(stale_response(&stamp, newest))
            }
            Ok(Verdict::Conflict { newest }) => {
                tracing::error!(
                    queue = %stamp.queue,
                    job = %stamp.job,
                    epoch = newest,
                    owner = stamp.owner.as_deref().unwrap_or("-"),
                    "epoch refused: another owner holds the same epoch (a fencing token handed out twice)"
                );
                Err(conflict_response(&stamp))
            }
            // A verdict this version does not know accepts nothing.
            Ok(_) => Err(conflict_response(&stamp)),
            Err(fence::FenceError::InvalidInput { what, reason }) => {
                let e = StampError::Malformed { name: wire::JOB, reason: format!("{what}: {reason}") };
                Err(stamp_error_response(&e))
            }
            Err(e) => {
                tracing::error!(%stamp, error = %e, "ledger unavailable; call refused");
                Err(unavailable_response())
            }
        }
    }
}

/// The middleware: refuses a request without a valid stamp (400) or with a stale epoch (409);
/// otherwise inserts the [`AcceptedStamp`] into the request's extensions and calls the handler.
/// Use it with `axum::middleware::from_fn_with_state(guard, enforce)`, or through
/// [`EpochGuard::layer`].
///
/// ```no_run
/// # fn demo(guard: brokerfence::http::EpochGuard) {
/// let app: axum::Router = axum::Router::new()
///     .layer(axum::middleware::from_fn_with_state(guard, brokerfence::http::enforce));
/// # }
/// ```
pub async fn enforce(State(guard): State<EpochGuard>, mut req: Request, next: Next) -> Response {
    // Feature `otel`: a span continuing the sender's trace (`traceparent`); else none.
    let span = crate::otel::receiver_span(req.headers());
    let run = async move {
        match guard.check(req.headers()).await {
            Ok(accepted) => {
                req.extensions_mut().insert(accepted);
                next.run(req).await
            }
            Err(refusal) => refusal,
        }
    };
    let response = tracing::Instrument::instrument(run, span.clone()).await;
    crate::otel::answered(&span, response.status().as_u16());
    response
}

fn enforce_boxed(state: State<EpochGuard>, req: Request, next: Next) -> BoxFuture<'static, Response> {
    Box::pin(enforce(state, req, next))
}

/// The stamp a request was accepted with, and the newest epoch the ledger now keeps for its job
/// (equal to the stamp's epoch). Put into the request's extensions by the middleware; extract it
/// in a handler. Extracting it on a route without the middleware is a `500` (a wiring mistake).
///
/// ```no_run
/// async fn handler(brokerfence::http::AcceptedStamp { stamp, newest }: brokerfence::http::AcceptedStamp) -> String {
///     format!("{stamp} accepted (newest {newest})")
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptedStamp {
    /// The stamp as sent.
    pub stamp: FenceStamp,
    /// The newest epoch kept for the job after this call.
    pub newest: i64,
}

impl<S: Send + Sync> FromRequestParts<S> for AcceptedStamp {
    type Rejection = (StatusCode, &'static str);

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<AcceptedStamp>().cloned().ok_or((
            StatusCode::INTERNAL_SERVER_ERROR,
            "AcceptedStamp extracted on a route without the EpochGuard layer",
        ))
    }
}

/// The stamp of a request, parsed from its headers but NOT checked against a ledger: for handlers
/// that run `accept_in` inside a transaction they manage themselves (on a route without a guard;
/// [`AtomicEpochGuard`](atomic::AtomicEpochGuard) does it for them). Behind either guard it is the accepted stamp. Missing or malformed:
/// `400` with the same body as the middleware.
///
/// ```no_run
/// async fn handler(brokerfence::http::Stamp(stamp): brokerfence::http::Stamp) -> String {
///     format!("job {} epoch {}", stamp.job, stamp.epoch)
/// }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stamp(pub FenceStamp);

impl<S: Send + Sync> FromRequestParts<S> for Stamp {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        if let Some(accepted) = parts.extensions.get::<AcceptedStamp>() {
            return Ok(Stamp(accepted.stamp.clone()));
        }
        stamp_from_headers(&parts.headers).map(Stamp).map_err(|e| stamp_error_response(&e))
    }
}

/// Reads the stamp from an HTTP header map (a value that is not visible ASCII is malformed).
///
/// ```
/// use axum::http::HeaderMap;
/// let mut headers = HeaderMap::new();
/// brokerfence::http::insert_stamp(&mut headers, &brokerfence::wire::FenceStamp::new("q", "k 1", 3));
/// let stamp = brokerfence::http::stamp_from_headers(&headers).unwrap();
/// assert_eq!((stamp.job.as_str(), stamp.epoch), ("k 1", 3));
/// ```
pub fn stamp_from_headers(headers: &HeaderMap) -> Result<FenceStamp, StampError> {
    let mut pairs: Vec<(&'static str, &str)> = Vec::with_capacity(4);
    for name in wire::NAMES {
        for value in headers.get_all(name) {
            let value = value
                .to_str()
                .map_err(|_| StampError::Malformed { name, reason: "not visible ASCII (encode the value)".into() })?;
            pairs.push((name, value));
        }
    }
    FenceStamp::from_headers(pairs)
}

/// Writes the stamp into an HTTP header map (replacing earlier stamp headers). Works with any
/// client built on the `http` 1.x crate (reqwest 0.12, hyper 1).
///
/// ```
/// let mut headers = axum::http::HeaderMap::new();
/// brokerfence::http::insert_stamp(&mut headers, &brokerfence::wire::FenceStamp::new("q", "k", 2).with_owner("w"));
/// assert_eq!(headers["fence-epoch"], "2");
/// assert_eq!(headers.len(), 4);
/// ```
pub fn insert_stamp(headers: &mut HeaderMap, stamp: &FenceStamp) {
    for name in wire::NAMES {
        headers.remove(name);
    }
    for (name, value) in stamp.to_headers() {
        // Each pair under its own name: the stamp's, and with feature `otel` the trace
        // context's. A value a header cannot carry is left out.
        if let (Some(name), Ok(value)) = (header_name(name), HeaderValue::from_str(&value)) {
            headers.insert(name, value);
        }
    }
}

/// The header name of a pair of [`FenceStamp::to_headers`]: the name in lower case.
fn header_name(name: &str) -> Option<HeaderName> {
    HeaderName::from_bytes(name.to_ascii_lowercase().as_bytes()).ok()
}

/// The `409 Conflict` for a stale epoch, with a JSON body naming job, epoch and newest.
///
/// ```
/// let stamp = brokerfence::wire::FenceStamp::new("orders", "o-1", 1);
/// let response = brokerfence::http::stale_response(&stamp, 2);
/// assert_eq!(response.status(), axum::http::StatusCode::CONFLICT);
/// ```
pub fn stale_response(stamp: &FenceStamp, newest: i64) -> Response {
    json(StatusCode::CONFLICT, wire::stale_epoch_json(stamp, newest))
}

/// The `409 Conflict` for an epoch another owner holds already ([`Verdict::Conflict`]), with
/// [`wire::epoch_conflict_json`] as its body.
///
/// ```
/// let stamp = brokerfence::wire::FenceStamp::new("q", "k", 2).with_owner("w2");
/// assert_eq!(brokerfence::http::conflict_response(&stamp).status(), 409);
/// ```
pub fn conflict_response(stamp: &FenceStamp) -> Response {
    json(StatusCode::CONFLICT, wire::epoch_conflict_json(stamp))
}

/// The `400 Bad Request` for a missing or malformed stamp, with a JSON body naming the header.
///
/// ```
/// let err = brokerfence::wire::StampError::Missing { name: brokerfence::wire::EPOCH };
/// assert_eq!(brokerfence::http::stamp_error_response(&err).status(), axum::http::StatusCode::BAD_REQUEST);
/// ```
pub fn stamp_error_response(err: &StampError) -> Response {
    json(StatusCode::BAD_REQUEST, err.to_json())
}

/// The `503 Service Unavailable` when the ledger cannot answer. The body is the same whatever
/// failed: the database's own error text (hosts, table names, SQL) goes to the log
/// ([`EpochGuard::check`] logs it at error level), never to the caller.
fn unavailable_response() -> Response {
    let body = r#"{"error":"ledger_unavailable","message":"the epoch ledger could not be reached; retry later"}"#;
    let mut response = json(StatusCode::SERVICE_UNAVAILABLE, body.to_owned());
    response.headers_mut().insert(RETRY_AFTER, HeaderValue::from_static("1"));
    response
}

fn json(status: StatusCode, body: String) -> Response {
    let mut response = (status, body).into_response();
    response.headers_mut().insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

#[cfg(all(test, feature = "sqlite"))]
mod edges {
    use super::*;

    /// Issue #12 §5, third bullet: when the ledger's database fails, the guard answers 503 with a
    /// generic body; the database's own error text (table names, hosts, SQL) goes to the log only.
    /// The ledger here is an SQLite fence that was never migrated, so every ledger statement
    /// fails with "no such table: …".
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_unavailable_body_does_not_echo_the_database_error() {
        let fence = fence::SqliteFence::open("sqlite::memory:").await.expect("sqlite");
        let ledger = Ledger::Sqlite(fence::ledger::SqliteLedger::new(&fence, "receiver"));
        let direct = ledger.newest("orders/o-1").await.expect_err("no ledger table");
        let detail = direct.to_string();
        assert!(detail.contains("no such table"), "{detail}");

        let guard = EpochGuard::new(ledger);
        let mut headers = HeaderMap::new();
        for (name, value) in FenceStamp::new("orders", "o-1", 1).with_owner("w1").to_headers() {
            headers.insert(name, HeaderValue::from_str(&value).expect("header"));
        }
        let refusal = guard.check(&headers).await.expect_err("the ledger is unavailable");
        assert_eq!(refusal.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(refusal.headers().get(RETRY_AFTER).and_then(|v| v.to_str().ok()), Some("1"));
        let body = axum::body::to_bytes(refusal.into_body(), 64 * 1024).await.expect("body");
        let body = String::from_utf8_lossy(&body);
        assert!(body.contains(r#""error":"ledger_unavailable""#), "{body}");
        for leak in ["no such table", "error returned from database", "sqlite", detail.as_str()] {
            assert!(!body.to_lowercase().contains(&leak.to_lowercase()), "503 body echoes {leak:?}: {body}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guards a review finding: every name other than queue, job and epoch became
    /// `fence-owner`, so with feature `otel` the trace context's `traceparent` overwrote the
    /// stamp's owner.
    #[test]
    fn otel_stamp_pairs_keep_their_own_header_names() {
        for name in [wire::QUEUE, wire::JOB, wire::EPOCH, wire::OWNER, "traceparent", "tracestate"] {
            let header = header_name(name).expect("a header name");
            assert_eq!(header.as_str(), name.to_ascii_lowercase());
        }
        let mut headers = HeaderMap::new();
        insert_stamp(&mut headers, &FenceStamp::new("q", "k", 2).with_owner("w"));
        assert_eq!(headers["fence-owner"], "w");
    }
}
