//! Who may use the dashboard and how: a bearer token (or a login with it that sets a session
//! cookie) whenever one is configured, which it must be to listen beyond the loopback
//! interface; CSRF checks on every POST (a per-process secret in each form, and the Origin or
//! Fetch-Metadata headers when the browser sends them); security headers on every response.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};

use super::App;

/// The session cookie's name.
pub(crate) const COOKIE: &str = "brokerfence_session";

/// The per-process secrets: the operator's token (if any), the sessions logins handed out, and
/// the CSRF token every form carries.
pub(crate) struct Secrets {
    pub(crate) token: Option<String>,
    /// Each login's own random session, with when it was made; removed at its logout, ended
    /// after [`SESSION_TTL`], at most [`MAX_SESSIONS`] kept (the oldest goes first).
    sessions: std::sync::Mutex<std::collections::HashMap<String, std::time::Instant>>,
    pub(crate) csrf: String,
}

/// How long a login's session lasts.
pub(crate) const SESSION_TTL: std::time::Duration = std::time::Duration::from_secs(12 * 3600);

/// Sessions kept at once.
const MAX_SESSIONS: usize = 1_000;

impl Secrets {
    pub(crate) fn new(token: Option<String>) -> Self {
        Self { token, sessions: std::sync::Mutex::default(), csrf: random_hex() }
    }

    /// A new session for a login.
    pub(crate) fn open_session(&self) -> String {
        let session = random_hex();
        if let Ok(mut all) = self.sessions.lock() {
            all.retain(|_, made| made.elapsed() < SESSION_TTL);
            if all.len() >= MAX_SESSIONS
                && let Some(oldest) = all.iter().min_by_key(|(_, made)| **made).map(|(s, _)| s.clone())
            {
                all.remove(&oldest);
            }
            all.insert(session.clone(), std::time::Instant::now());
        }
        session
    }

    /// Whether `given` is a live session.
    fn has_session(&self, given: &str) -> bool {
        self.sessions
            .lock()
            .map(|all| all.iter().any(|(s, made)| same(s, given) && made.elapsed() < SESSION_TTL))
            .unwrap_or(false)
    }

    /// Ends the session of a logout.
    pub(crate) fn close_session(&self, given: &str) {
        if let Ok(mut all) = self.sessions.lock() {
            all.retain(|s, _| !same(s, given));
        }
    }
}

/// The session cookie of a request, if it has one.
pub(crate) fn session_of(headers: &HeaderMap) -> Option<&str> {
    cookie(headers, COOKIE)
}

/// 32 random bytes as hex.
fn random_hex() -> String {
    rand::random::<[u8; 32]>().iter().map(|b| format!("{b:02x}")).collect()
}

/// Equality in time independent of where the inputs differ (only of their lengths).
pub(crate) fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The value of cookie `name` in the request's `Cookie` headers.
fn cookie<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v)
}

/// Whether the request carries the token (as a bearer) or the session cookie.
fn authorized(app: &App, headers: &HeaderMap) -> bool {
    let Some(token) = &app.secrets.token else { return true };
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| same(t.trim(), token));
    bearer || cookie(headers, COOKIE).is_some_and(|s| app.secrets.has_session(s))
}

/// Whether a POST comes from a page of this dashboard, as far as the browser says: an `Origin`
/// must be this host's, `Sec-Fetch-Site` must not be another site's. Clients that send neither
/// (curl, scripts) still need the CSRF token of a form.
pub(crate) fn same_origin(headers: &HeaderMap) -> bool {
    let host = headers.get(header::HOST).and_then(|v| v.to_str().ok());
    let origin_ok = match headers.get(header::ORIGIN).map(|v| v.to_str()) {
        None => true,
        Some(Ok(origin)) => host.is_some_and(|h| origin == format!("http://{h}") || origin == format!("https://{h}")),
        Some(Err(_)) => false,
    };
    let site_ok = match headers.get("sec-fetch-site").and_then(|v| v.to_str().ok()) {
        None => true,
        Some(site) => matches!(site, "same-origin" | "none"),
    };
    origin_ok && site_ok
}

/// Whether the request names this machine's loopback as its `Host` (`localhost`, `127.0.0.1`,
/// `[::1]`, any port). Without a token that is required: a page of another site whose name was
/// made to resolve to 127.0.0.1 (DNS rebinding) is the browser's "same origin" under that name,
/// and would otherwise read the pages and, with `--allow-write`, post actions.
pub(crate) fn loopback_host(headers: &HeaderMap) -> bool {
    let Some(host) = headers.get(header::HOST).and_then(|v| v.to_str().ok()) else { return false };
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().map(|a| format!("[{a}]")).unwrap_or_default(),
        None => host.rsplit_once(':').map_or(host, |(name, _port)| name).to_owned(),
    };
    let name = name.to_ascii_lowercase();
    matches!(name.as_str(), "localhost" | "[::1]")
        || name.parse::<std::net::Ipv4Addr>().is_ok_and(|ip| ip.is_loopback())
}

/// Adds the security headers: no script or style from anywhere but this server (no inline
/// code at all), no framing, no sniffing, no referrer to other sites, no caching.
fn harden(response: &mut Response) {
    let h = response.headers_mut();
    let set = |h: &mut HeaderMap, name: &'static str, value: &'static str| {
        h.insert(name, HeaderValue::from_static(value));
    };
    set(
        h,
        "content-security-policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; \
         form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    );
    set(h, "x-content-type-options", "nosniff");
    set(h, "x-frame-options", "DENY");
    // `no-referrer` would make a browser send `Origin: null` with the forms' POSTs.
    set(h, "referrer-policy", "same-origin");
    set(h, "cache-control", "no-store");
}

/// The middleware in front of every route.
pub(crate) async fn guard(State(app): State<Arc<App>>, request: Request<Body>, next: Next) -> Response {
    let path = request.uri().path().to_owned();
    let open = path == "/login" || path.starts_with("/static/");
    let mut response = if app.secrets.token.is_none() && !loopback_host(request.headers()) {
        (
            StatusCode::MISDIRECTED_REQUEST,
            "without a token this dashboard answers only to a loopback Host (localhost, 127.0.0.1, [::1])\n",
        )
            .into_response()
    } else if request.method() == Method::POST && !same_origin(request.headers()) {
        (StatusCode::FORBIDDEN, "cross-site request refused\n").into_response()
    } else if open || authorized(&app, request.headers()) {
        // Every query has its own limit (`--timeout`); this bounds the whole request.
        match tokio::time::timeout(app.timeout.saturating_mul(2), next.run(request)).await {
            Ok(response) => response,
            Err(_) => (StatusCode::SERVICE_UNAVAILABLE, "the request took too long\n").into_response(),
        }
    } else if path.starts_with("/api/") {
        let mut r = super::json(StatusCode::UNAUTHORIZED, &serde_json::json!({"error": "unauthorized"}));
        r.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        r
    } else if request.method() == Method::GET {
        Redirect::to("/login").into_response()
    } else {
        (StatusCode::UNAUTHORIZED, "unauthorized\n").into_response()
    };
    harden(&mut response);
    response
}

/// The `Set-Cookie` value of a login (`Some`) or a logout.
pub(crate) fn session_cookie(session: Option<&str>) -> String {
    match session {
        Some(s) => format!("{COOKIE}={s}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}", SESSION_TTL.as_secs()),
        None => format!("{COOKIE}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guards a review finding (DNS rebinding): without a token, a request naming another host
    /// was served.
    #[test]
    fn dashboard_without_a_token_answers_only_to_loopback_hosts() {
        let with_host = |h: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::HOST, HeaderValue::from_str(h).expect("header"));
            loopback_host(&headers)
        };
        for ok in ["127.0.0.1:8080", "localhost", "LOCALHOST:1", "[::1]:8080", "[::1]", "127.0.0.2:9"] {
            assert!(with_host(ok), "{ok} refused");
        }
        for bad in ["evil.example", "evil.example:8080", "127.0.0.1.evil.example", "10.0.0.1:8080", "[::2]:80", ""] {
            assert!(!with_host(bad), "{bad} accepted");
        }
        assert!(!loopback_host(&HeaderMap::new()));
    }

    #[test]
    fn dashboard_auth_compares_whole_tokens() {
        assert!(same("abc", "abc"));
        assert!(!same("abc", "abd"));
        assert!(!same("abc", "abcd"));
        assert!(!same("", "a"));
    }

    #[test]
    fn dashboard_auth_reads_origin_and_fetch_metadata() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, HeaderValue::from_static("127.0.0.1:8080"));
        assert!(same_origin(&h));
        h.insert(header::ORIGIN, HeaderValue::from_static("http://127.0.0.1:8080"));
        assert!(same_origin(&h));
        h.insert("sec-fetch-site", HeaderValue::from_static("cross-site"));
        assert!(!same_origin(&h));
        h.remove("sec-fetch-site");
        h.insert(header::ORIGIN, HeaderValue::from_static("http://evil.example"));
        assert!(!same_origin(&h));
    }
}
