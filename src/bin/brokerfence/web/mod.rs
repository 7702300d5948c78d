//! `brokerfence serve` (feature `web`): the operators' dashboard. Pages are rendered here, on
//! the server, from [`brokerfence::admin`]; a little plain JavaScript (`static/app.js`, no build
//! step) refreshes the page's `<main>` every `--refresh`. Every page has a JSON endpoint under
//! `/api/` in the shapes of `brokerfence status --json` and `dead list --json`.
//!
//! Safe by default: it listens on 127.0.0.1 unless told otherwise, and refuses to listen
//! anywhere else without a token (`--token` or `BROKERFENCE_TOKEN`); it is read-only unless
//! started with `--allow-write`; actions are POSTs carrying a per-process CSRF token; every
//! text from the database is escaped (`escape`); every response carries a Content-Security-Policy
//! that allows no inline code (`auth`).

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use brokerfence::FenceStore;
use brokerfence::admin::Admin;

mod auth;
mod escape;
mod pages;
mod routes;
mod views;

/// `brokerfence serve`'s options.
#[derive(Clone, clap::Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on (anything but a loopback address needs a token)
    #[arg(long, default_value = "127.0.0.1:8080", value_name = "ADDR")]
    pub(crate) listen: SocketAddr,
    /// Token that requests must carry (`Authorization: Bearer T`, or a login with it)
    #[arg(long, env = "BROKERFENCE_TOKEN", hide_env_values = true, value_name = "T")]
    pub(crate) token: Option<String>,
    /// Offer the fenced dead-letter requeue and prune (read-only otherwise)
    #[arg(long)]
    pub(crate) allow_write: bool,
    /// How often the pages refresh themselves (0s: never)
    #[arg(long, default_value = "2s", value_parser = crate::args::age, value_name = "AGE")]
    pub(crate) refresh: Duration,
    /// Rows each count or scan of the jobs table reads at most, per queue
    #[arg(long, default_value_t = brokerfence::admin::DEFAULT_COUNT_LIMIT)]
    pub(crate) count_limit: u32,
    /// Rows each list shows at most
    #[arg(long, default_value_t = 200)]
    pub(crate) list_limit: u32,
}

/// The shortest token taken.
const MIN_TOKEN_BYTES: usize = 16;

/// What can stop the dashboard.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ServeError {
    /// Listening beyond the loopback interface without a token.
    #[error(
        "refusing to listen on {0} without a token: anyone who can reach it could read the queues{1}; give \
         --token T (or set BROKERFENCE_TOKEN), or listen on 127.0.0.1"
    )]
    NoToken(SocketAddr, &'static str),
    /// An empty token.
    #[error("the token is empty: give a long random one (--token or BROKERFENCE_TOKEN)")]
    EmptyToken,
    /// A token too short to resist guessing.
    #[error("the token has {0} bytes: give at least {MIN_TOKEN_BYTES} random ones (e.g. `openssl rand -hex 32`)")]
    ShortToken(usize),
    /// A refresh so frequent that open pages would load the database.
    #[error("--refresh {0:?} is under 1 s (0s turns the refresh off)")]
    RefreshTooFrequent(Duration),
    /// The address could not be bound.
    #[error("cannot listen on {0}: {1}")]
    Bind(SocketAddr, std::io::Error),
    /// The server failed.
    #[error("the dashboard's server failed: {0}")]
    Serve(std::io::Error),
}

/// The state every request shares.
pub(crate) struct App {
    pub(crate) admin: Admin,
    pub(crate) store: Arc<dyn FenceStore>,
    pub(crate) secrets: auth::Secrets,
    pub(crate) allow_write: bool,
    pub(crate) refresh: Duration,
    pub(crate) list_limit: u32,
    /// The limit of each database call (`--timeout`).
    pub(crate) timeout: Duration,
    /// The last actions taken through this dashboard, newest last (at most [`ACTIONS_KEPT`]).
    pub(crate) actions: Mutex<VecDeque<String>>,
}

/// A JSON response.
pub(crate) fn json(status: axum::http::StatusCode, value: &serde_json::Value) -> axum::response::Response {
    use axum::response::IntoResponse;
    (status, [(axum::http::header::CONTENT_TYPE, "application/json")], value.to_string()).into_response()
}

/// How many past actions the dead-letter page lists.
pub(crate) const ACTIONS_KEPT: usize = 20;

impl App {
    /// Notes an action for the dead-letter page (and the log).
    pub(crate) fn note(&self, what: String) {
        tracing_free_log(&what);
        if let Ok(mut actions) = self.actions.lock() {
            if actions.len() == ACTIONS_KEPT {
                actions.pop_front();
            }
            actions.push_back(what);
        }
    }
}

/// One line on stderr per action: the binary has no logger.
fn tracing_free_log(what: &str) {
    eprintln!("brokerfence serve: {}", what.escape_debug());
}

/// Serves the dashboard until Ctrl-C.
pub(crate) async fn serve(
    args: ServeArgs,
    admin: Admin,
    store: Arc<dyn FenceStore>,
    timeout: Duration,
) -> Result<(), ServeError> {
    if args.token.as_deref().is_some_and(|t| t.trim().is_empty()) {
        return Err(ServeError::EmptyToken);
    }
    if let Some(n) = args.token.as_deref().map(|t| t.trim().len()).filter(|&n| n < MIN_TOKEN_BYTES) {
        return Err(ServeError::ShortToken(n));
    }
    if !args.refresh.is_zero() && args.refresh < Duration::from_secs(1) {
        return Err(ServeError::RefreshTooFrequent(args.refresh));
    }
    if !args.listen.ip().is_loopback() && args.token.is_none() {
        let write = if args.allow_write { " and requeue or prune them" } else { "" };
        return Err(ServeError::NoToken(args.listen, write));
    }
    let admin = admin.count_limit(args.count_limit).list_limit(10);
    let app = Arc::new(App {
        admin,
        store,
        secrets: auth::Secrets::new(args.token),
        allow_write: args.allow_write,
        refresh: args.refresh,
        list_limit: args.list_limit.max(1),
        timeout,
        actions: Mutex::new(VecDeque::new()),
    });
    let listener = tokio::net::TcpListener::bind(args.listen).await.map_err(|e| ServeError::Bind(args.listen, e))?;
    let bound = listener.local_addr().map_err(|e| ServeError::Bind(args.listen, e))?;
    // The first line says where (a test or a script reads it when it asked for port 0).
    println!(
        "brokerfence dashboard on http://{bound}/ ({}, {})",
        if app.allow_write { "read-write" } else { "read-only" },
        if app.secrets.token.is_some() { "token required" } else { "no token: loopback only" }
    );
    axum::serve(listener, routes::router(app))
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .map_err(ServeError::Serve)
}
