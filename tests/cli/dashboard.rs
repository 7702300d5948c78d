//! The web dashboard, `brokerfence serve` (feature `web`): every page, JSON endpoint and action
//! over HTTP against the real binary on PostgreSQL and SQLite; authentication, CSRF and the
//! security headers; escaping of hostile keys, errors and payloads; the index use of every
//! dashboard statement on a never-analyzed schema, and the time of each page with 100,000 jobs.
//! Every test name contains `dashboard`.
#![cfg(feature = "web")]

use brokerfence_testkit::store as common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use brokerfence::admin::{Activity, ActivityCounts, Admin, FENCE_EVENT_SLOTS, FenceEvent, FenceEventKind};
use brokerfence::retention::{QueueRetention, Retention};
use brokerfence::{Claim, FenceStore, JobState, Lease, Owner, QueueName, RetryPolicy, SchemaName};
use common::{key, lease};
use serde_json::Value;
use tokio::io::AsyncBufReadExt;

static BIN: std::sync::LazyLock<std::path::PathBuf> =
    std::sync::LazyLock::new(|| brokerfence_testkit::programs::bin("brokerfence"));

/// A running `brokerfence serve`, killed when dropped.
pub(crate) struct Server {
    child: tokio::process::Child,
    pub(crate) base: String,
}

impl Server {
    /// Starts the dashboard on `url`/`schema` with `extra` options on a free port.
    pub(crate) async fn start(url: &str, schema: &SchemaName, extra: &[&str]) -> Server {
        let mut cmd = tokio::process::Command::new(&*BIN);
        cmd.args(["--database-url", url, "--schema", schema.as_str(), "serve", "--listen", "127.0.0.1:0"])
            .args(extra)
            .env_remove("DATABASE_URL")
            .env_remove("BROKERFENCE_TOKEN")
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true);
        let mut child = cmd.spawn().expect("start brokerfence serve");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let first = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("the dashboard said where it listens within 60 s")
            .expect("read stdout")
            .expect("a first line");
        let addr = first
            .split("http://")
            .nth(1)
            .and_then(|r| r.split('/').next())
            .unwrap_or_else(|| panic!("no address in {first:?}"))
            .to_owned();
        Server { child, base: format!("http://{addr}") }
    }

    pub(crate) fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// A client that does not follow redirects (the tests look at them).
fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client")
}

async fn get(url: &str) -> (u16, reqwest::header::HeaderMap, String) {
    let r = client().get(url).send().await.unwrap_or_else(|e| panic!("GET {url}: {e}"));
    let (status, headers) = (r.status().as_u16(), r.headers().clone());
    (status, headers, r.text().await.expect("body"))
}

async fn get_ok(url: &str) -> String {
    let (status, _, body) = get(url).await;
    assert_eq!(status, 200, "GET {url}: {body}");
    body
}

async fn get_json(url: &str) -> Value {
    let body = get_ok(url).await;
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET {url}: not JSON ({e}): {body}"))
}

async fn post(url: &str, form: &[(&str, &str)], headers: &[(&str, &str)]) -> (u16, String, Option<String>) {
    let mut r = client().post(url).header("content-type", "application/x-www-form-urlencoded").body(encode(form));
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let r = r.send().await.unwrap_or_else(|e| panic!("POST {url}: {e}"));
    let status = r.status().as_u16();
    let location = r.headers().get("location").and_then(|v| v.to_str().ok()).map(str::to_owned);
    (status, r.text().await.expect("body"), location)
}

fn encode(form: &[(&str, &str)]) -> String {
    form.iter().map(|(k, v)| format!("{}={}", pct(k), pct(v))).collect::<Vec<_>>().join("&")
}

fn pct(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => char::from(b).to_string(),
            b => format!("%{b:02X}"),
        })
        .collect()
}

/// The CSRF token in the first form of `html`.
fn csrf(html: &str) -> String {
    let at = html.find("name=\"csrf\" value=\"").expect("a form with a CSRF token");
    let rest = &html[at + "name=\"csrf\" value=\"".len()..];
    rest[..rest.find('"').expect("end of the token")].to_owned()
}

/// A database for the dashboard and the store that prepares it.
pub(crate) struct Db {
    pub(crate) url: String,
    pub(crate) schema: SchemaName,
    pub(crate) store: Arc<dyn FenceStore>,
}

pub(crate) async fn pg_db() -> Db {
    let store = common::pg().await;
    Db { url: common::database_url(), schema: store.get_schema().clone(), store: Arc::new(store) }
}

async fn sqlite_db() -> Db {
    let path = common::sqlite_path();
    let schema = common::unique_schema();
    let store = common::sqlite_on(&path).await.schema(schema.clone());
    store.migrate().await.expect("migrate SQLite");
    Db { url: format!("sqlite:{}", path.display()), schema, store: Arc::new(store) }
}

pub(crate) fn queue(name: &str) -> QueueName {
    QueueName::new(common::unique(name)).expect("queue name")
}

async fn claim(store: &dyn FenceStore, q: &QueueName, k: &str, owner: &str) -> Lease {
    match store.claim(q, &key(k), &Owner::new(owner).expect("owner"), lease(60)).await.expect("claim") {
        Claim::Claimed(l) => l,
        other => panic!("claim of {k}: {other:?}"),
    }
}

/// Jobs in every state: p1 pending, r1 running (worker-a), c1 completed, d1 dead (table queue,
/// "boom: disk full"), and one fence event (worker-a lost f1 to worker-b at epoch 2).
async fn seed(store: &dyn FenceStore) -> QueueName {
    let q = queue("orders");
    assert!(store.enqueue(&q, &key("p1"), b"hello").await.expect("enqueue"));
    claim(store, &q, "r1", "worker-a").await;
    let c1 = claim(store, &q, "c1", "worker-a").await;
    store.complete(&c1, b"done").await.expect("complete");
    assert!(store.enqueue(&q, &key("d1"), b"work").await.expect("enqueue"));
    let d1 = claim(store, &q, "d1", "worker-a").await;
    store.fail(&d1, "boom: disk full", false, &RetryPolicy::default()).await.expect("fail to dead");
    let mut activity = Activity::default();
    activity.counts.insert(q.clone(), ActivityCounts { claims: 7, commits: 5, fenced: 1, lost: 1 });
    activity.events.push(FenceEvent {
        queue: q.clone(),
        key: key("f1"),
        kind: FenceEventKind::Fenced,
        detail: "commit refused".into(),
        epoch: 1,
        owner: Owner::new("worker-a").expect("owner"),
        winner_epoch: Some(2),
        winner_owner: Some("worker-b".into()),
    });
    store.record_activity(&activity).await.expect("record activity");
    q
}

async fn pages_and_endpoints(db: Db) {
    let q = seed(&*db.store).await;
    let server = Server::start(&db.url, &db.schema, &["--refresh", "1s"]).await;
    let qs = format!("?queue={}", pct(q.as_str()));

    let overview = get_ok(&server.url("/")).await;
    assert!(overview.contains(q.as_str()) && overview.contains("data-refresh=\"1\""), "{overview}");
    assert!(overview.contains("<svg class=\"chart\""), "the activity chart: {overview}");
    let o = get_json(&server.url(&format!("/api/overview{qs}"))).await;
    let row = &o["queues"][0];
    assert_eq!(row["queue"], q.as_str());
    let counts = &row["counts"];
    for (state, n) in [("pending", 1), ("running", 1), ("completed", 1), ("dead", 1), ("failed", 0), ("total", 4)] {
        assert_eq!(counts[state], n, "{state}: {o}");
    }
    assert_eq!(row["expired_leases"], 0);
    assert_eq!(row["oldest_running"]["key"], "r1", "{o}");
    assert!(row["oldest_pending_ms"].as_i64().is_some_and(|ms| ms >= 0), "{o}");
    let minute = &row["minutes"][0];
    assert_eq!((minute["claims"].as_u64(), minute["commits"].as_u64()), (Some(7), Some(5)), "{o}");
    // The shape of `status --json`: the same top-level and per-queue fields.
    for field in ["backend", "now_ms", "now", "queues"] {
        assert!(o.get(field).is_some(), "{field}: {o}");
    }

    let flight = get_ok(&server.url(&format!("/in-flight{qs}"))).await;
    assert!(flight.contains(">r1<") && flight.contains("worker-a"), "{flight}");
    let f = get_json(&server.url(&format!("/api/in-flight{qs}"))).await;
    let job = &f["in_flight"][0];
    assert_eq!(
        (job["key"].as_str(), job["owner"].as_str(), job["epoch"].as_i64()),
        (Some("r1"), Some("worker-a"), Some(1))
    );
    assert!(job["lease_left_ms"].as_i64().is_some_and(|ms| ms > 50_000), "{f}");
    // Guards a review finding: before its first renewal a job showed the row's change before
    // the claim (a claim does not write it), which read like a stalled worker.
    assert!(job["last_renewal_ms"].is_null(), "not renewed since its claim: {f}");
    assert!(flight.contains("not since the claim"), "{flight}");
    // A heartbeat is a renewal.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let r1 = Lease {
        queue: q.clone(),
        key: key("r1"),
        epoch: 1,
        owner: Owner::new("worker-a").expect("owner"),
        lease_until: brokerfence::DbTime(0),
        ttl: Duration::from_secs(60),
        attempts: 1,
    };
    db.store.heartbeat(std::slice::from_ref(&r1), lease(60)).await.expect("heartbeat");
    let f = get_json(&server.url(&format!("/api/in-flight{qs}"))).await;
    assert!(f["in_flight"][0]["last_renewal_ms"].as_i64().is_some(), "renewed: {f}");

    let fences = get_ok(&server.url(&format!("/fences{qs}"))).await;
    assert!(fences.contains("worker-b at epoch 2") && fences.contains("worker-a at epoch 1"), "{fences}");
    let e = get_json(&server.url(&format!("/api/fences{qs}"))).await;
    let event = &e["fences"][0];
    assert_eq!((event["kind"].as_str(), event["winner_owner"].as_str()), (Some("fenced"), Some("worker-b")), "{e}");

    let dead = get_ok(&server.url(&format!("/dead{qs}"))).await;
    assert!(dead.contains(">d1<") && dead.contains("boom: disk full"), "{dead}");
    assert!(!dead.contains("/actions/requeue"), "a read-only dashboard shows no action: {dead}");
    let d = get_json(&server.url(&format!("/api/dead{qs}"))).await;
    assert_eq!(d["dead"][0]["key"], "d1");
    // `dead list --json`'s fields, one for one.
    for field in
        ["queue", "key", "epoch", "owner", "attempts", "failures", "last_error", "died_at_ms", "died_at", "age_ms"]
    {
        assert!(d["dead"][0].get(field).is_some(), "{field}: {d}");
    }

    let job = get_ok(&server.url(&format!("/job{qs}&key=d1"))).await;
    assert!(job.contains("boom: disk full") && job.contains("4 bytes: &quot;work&quot;"), "{job}");
    let j = get_json(&server.url(&format!("/api/job{qs}&key=d1"))).await;
    // `job --json`'s document.
    assert_eq!(
        (j["found"].as_bool(), j["state"].as_str(), j["payload"].as_str()),
        (Some(true), Some("dead"), Some("\"work\"")),
        "{j}"
    );
    let (status, _, _) = get(&server.url(&format!("/job{qs}&key=nope"))).await;
    assert_eq!(status, 404);
    let (status, _, body) = get(&server.url(&format!("/api/job{qs}&key=nope"))).await;
    assert_eq!(status, 404, "{body}");
    let (status, _, _) = get(&server.url("/in-flight?queue=")).await;
    assert_eq!(status, 200, "an empty filter is every queue");
    let (status, _, body) = get(&server.url(&format!("/dead?queue={}", "x".repeat(300)))).await;
    assert_eq!(status, 400, "a queue name too long is refused: {body}");
    let js = get_ok(&server.url("/static/app.js")).await;
    assert!(js.contains("DOMParser"), "{js}");
}

#[tokio::test]
async fn dashboard_pages_and_endpoints_on_postgres() {
    pages_and_endpoints(pg_db().await).await;
}

#[tokio::test]
async fn dashboard_pages_and_endpoints_on_sqlite() {
    pages_and_endpoints(sqlite_db().await).await;
}

/// Hostile keys (markup, quotes, 1 KB), an error with markup, an invalid UTF-8 payload: no page
/// and no endpoint lets any of it through unescaped.
#[tokio::test]
async fn dashboard_escapes_hostile_keys_errors_and_payloads() {
    for db in [pg_db().await, sqlite_db().await] {
        let store = &*db.store;
        let q = queue("hostile");
        let keys = [
            "<script>alert(1)</script>".to_owned(),
            "\"><img src=x onerror=alert(2)>".to_owned(),
            "it's a 'quote' & \"more\"".to_owned(),
            "<".repeat(1024),
        ];
        for (i, k) in keys.iter().enumerate() {
            let payload: &[u8] = if i == 0 { b"\xff\xfe<b>not utf-8</b>" } else { b"<i>p</i>" };
            assert!(store.enqueue(&q, &key(k), payload).await.expect("enqueue"));
            let l = claim(store, &q, k, "<svg onload=alert(3)>").await;
            // All but the second die (the second stays running, for the in-flight page).
            if i != 1 {
                store
                    .fail(&l, "<script>alert(4)</script> and \"quotes\"", false, &RetryPolicy::default())
                    .await
                    .expect("dead");
            }
        }
        let server = Server::start(&db.url, &db.schema, &["--allow-write"]).await;
        let qs = format!("?queue={}", pct(q.as_str()));
        let mut bodies = Vec::new();
        for path in ["/", "/in-flight", "/fences", "/dead", "/api/overview", "/api/in-flight", "/api/dead"] {
            let (status, headers, body) = get(&server.url(&format!("{path}{qs}"))).await;
            assert_eq!(status, 200, "{path}: {body}");
            let kind = headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
            // JSON carries the keys as they are (a string value, not markup: served as JSON, never sniffed).
            let want = if path.starts_with("/api/") { "application/json" } else { "text/html; charset=utf-8" };
            assert_eq!(kind, want, "{path}");
            bodies.push((path.to_owned(), body));
        }
        bodies.push(("job".into(), get_ok(&server.url(&format!("/job{qs}&key={}", pct(&keys[0])))).await));
        for (path, body) in bodies.iter().filter(|(p, _)| !p.starts_with("/api/")) {
            for raw in ["<script>alert", "<img src=x", "<svg onload", "\"><img", "<<"] {
                assert!(!body.contains(raw), "{path} lets {raw:?} through: {body}");
            }
        }
        let dead = &bodies[3].1;
        assert!(dead.contains("&lt;script&gt;alert(1)&lt;/script&gt;"), "{dead}");
        assert!(dead.contains("&lt;script&gt;alert(4)&lt;/script&gt; and &quot;quotes&quot;"), "{dead}");
        assert!(dead.contains(&format!("value=\"{}\"", "&lt;".repeat(1024))), "the long key whole in its form: {dead}");
        let flight = &bodies[1].1;
        assert!(flight.contains("&quot;&gt;&lt;img src=x onerror=alert(2)&gt;"), "{flight}");
        assert!(dead.contains("it&#39;s a &#39;quote&#39; &amp; &quot;more&quot;"), "{dead}");
        let job = &bodies[7].1;
        assert!(job.contains(r#"b&quot;\xff\xfe&lt;b&gt;not utf-8&lt;/b&gt;&quot;"#), "the payload, escaped: {job}");
        // The JSON is JSON: the keys come back exactly.
        let d: Value = serde_json::from_str(&bodies[6].1).expect("JSON");
        let listed: Vec<&str> = d["dead"].as_array().expect("dead").iter().filter_map(|j| j["key"].as_str()).collect();
        assert!(listed.contains(&keys[0].as_str()) && listed.contains(&keys[2].as_str()), "{d}");
        // A requeue of the hostile key through its own form works.
        let token = csrf(dead);
        let (status, body, _) =
            post(&server.url("/actions/requeue"), &[("csrf", &token), ("queue", q.as_str()), ("key", &keys[0])], &[])
                .await;
        assert_eq!(status, 303, "{body}");
        let job = common::job(store, &q, &keys[0]).await.expect("the job");
        assert_eq!(job.state, JobState::Pending);
    }
}

/// Read-only unless `--allow-write`; actions need the CSRF token and a same-origin request; a
/// requeue of a job a worker holds changes nothing (the fence holds); prune works.
#[tokio::test]
async fn dashboard_actions_need_allow_write_csrf_and_same_origin() {
    let db = pg_db().await;
    let store = &*db.store;
    let q = seed(store).await;
    let holder = claim(store, &q, "held", "worker-h").await;
    let read_only = Server::start(&db.url, &db.schema, &[]).await;
    let (status, body, _) =
        post(&read_only.url("/actions/requeue"), &[("csrf", "x"), ("queue", q.as_str()), ("key", "d1")], &[]).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("--allow-write"), "{body}");
    drop(read_only);

    let server = Server::start(&db.url, &db.schema, &["--allow-write"]).await;
    let page = get_ok(&server.url(&format!("/dead?queue={}", pct(q.as_str())))).await;
    assert!(page.contains("/actions/requeue") && page.contains("/actions/prune"), "{page}");
    let token = csrf(&page);
    let requeue = server.url("/actions/requeue");
    for (form, headers, why) in [
        (vec![("queue", q.as_str()), ("key", "d1")], vec![], "no token"),
        (vec![("csrf", "0000"), ("queue", q.as_str()), ("key", "d1")], vec![], "a wrong token"),
        (
            vec![("csrf", token.as_str()), ("queue", q.as_str()), ("key", "d1")],
            vec![("origin", "http://evil.example")],
            "another origin",
        ),
        (
            vec![("csrf", token.as_str()), ("queue", q.as_str()), ("key", "d1")],
            vec![("sec-fetch-site", "cross-site")],
            "a cross-site fetch",
        ),
    ] {
        let (status, body, _) = post(&requeue, &form, &headers).await;
        assert_eq!(status, 403, "{why}: {body}");
        let d1 = common::job(store, &q, "d1").await.expect("d1");
        assert_eq!(d1.state, JobState::Dead, "{why}: nothing changed");
    }
    let origin = server.base.clone();
    let (status, body, location) = post(
        &requeue,
        &[("csrf", &token), ("queue", q.as_str()), ("key", "d1"), ("key", "held")],
        &[("origin", &origin)],
    )
    .await;
    assert_eq!(status, 303, "{body}");
    assert_eq!(location.as_deref(), Some(format!("/dead?queue={}", pct(q.as_str())).as_str()));
    let d1 = common::job(store, &q, "d1").await.expect("d1");
    assert_eq!((d1.state, d1.epoch), (JobState::Pending, 2), "requeued under a new epoch");
    let held = common::job(store, &q, "held").await.expect("held");
    assert_eq!((held.state, held.epoch, held.owner.as_deref()), (JobState::Running, holder.epoch, Some("worker-h")));
    store.heartbeat(std::slice::from_ref(&holder), lease(60)).await.expect("the holder still renews");
    let page = get_ok(&server.url(&format!("/dead?queue={}", pct(q.as_str())))).await;
    assert!(page.contains("requeued 1 dead job(s)") && page.contains("held skipped (running)"), "{page}");
    assert!(!page.contains(">d1<"), "d1 left the dead letters: {page}");

    // Prune: completed older than 0s goes.
    let (status, body, _) = post(
        &server.url("/actions/prune"),
        &[("csrf", &token), ("queue", q.as_str()), ("completed_age", "0s"), ("dead_age", "30d")],
        &[],
    )
    .await;
    assert_eq!(status, 303, "{body}");
    assert!(common::job(store, &q, "c1").await.is_none(), "c1 pruned");
    let (status, body, _) =
        post(&server.url("/actions/prune"), &[("csrf", &token), ("completed_age", "soon")], &[]).await;
    assert_eq!(status, 400, "{body}");
}

/// A token is needed to listen beyond the loopback; with one, every page and endpoint asks for
/// it (bearer or login cookie); the login is a POST with a wrong-token delay.
#[tokio::test]
async fn dashboard_token_login_and_refusal_to_listen_openly() {
    let db = pg_db().await;
    seed(&*db.store).await;
    for listen in ["0.0.0.0:0", "[::]:0"] {
        let out = tokio::process::Command::new(&*BIN)
            .args(["--database-url", &db.url, "--schema", db.schema.as_str(), "serve", "--listen", listen])
            .env_remove("BROKERFENCE_TOKEN")
            .output()
            .await
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{listen}: {stderr}");
        assert!(stderr.contains("refusing to listen") && stderr.contains("--token"), "{stderr}");
    }
    let out = tokio::process::Command::new(&*BIN)
        .args(["--database-url", &db.url, "--schema", db.schema.as_str(), "serve", "--token", " "])
        .output()
        .await
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "an empty token is refused");
    // A token too short to resist guessing, and a refresh that would load the database.
    for args in [&["serve", "--token", "short-token"][..], &["serve", "--refresh", "100ms"][..]] {
        let out = tokio::process::Command::new(&*BIN)
            .args(["--database-url", &db.url, "--schema", db.schema.as_str()])
            .args(args)
            .output()
            .await
            .expect("run");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("at least 16") || stderr.contains("under 1 s"), "{args:?}: {stderr}");
    }

    let token = "s3cret-token-of-the-test";
    let server = Server::start(&db.url, &db.schema, &["--token", token]).await;
    let (status, headers, _) = get(&server.url("/")).await;
    assert_eq!((status, headers.get("location").and_then(|v| v.to_str().ok())), (303, Some("/login")));
    for path in ["/api/overview", "/api/dead", "/api/fences", "/api/in-flight"] {
        let (status, headers, _) = get(&server.url(path)).await;
        assert_eq!(status, 401, "{path}");
        assert_eq!(headers.get("www-authenticate").and_then(|v| v.to_str().ok()), Some("Bearer"));
        let r = client().get(server.url(path)).bearer_auth("wrong").send().await.expect("GET");
        assert_eq!(r.status().as_u16(), 401, "{path} with a wrong token");
        let r = client().get(server.url(path)).bearer_auth(token).send().await.expect("GET");
        assert_eq!(r.status().as_u16(), 200, "{path} with the token");
    }
    let started = Instant::now();
    let (status, body, _) = post(&server.url("/login"), &[("token", "guess")], &[]).await;
    assert_eq!(status, 401, "{body}");
    assert!(started.elapsed() >= Duration::from_millis(400), "a wrong token is answered slowly");
    let r = client()
        .post(server.url("/login"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(encode(&[("token", token)]))
        .send()
        .await
        .expect("login");
    assert_eq!(r.status().as_u16(), 303);
    let cookie = r.headers().get("set-cookie").and_then(|v| v.to_str().ok()).expect("a session cookie").to_owned();
    assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"), "{cookie}");
    let session = cookie.split(';').next().expect("name=value").to_owned();
    assert!(!session.contains(token), "the cookie is not the token: {session}");
    let r = client().get(server.url("/dead")).header("cookie", &session).send().await.expect("GET");
    assert_eq!(r.status().as_u16(), 200);
    let page = r.text().await.expect("body");
    assert!(page.contains("Log out"), "{page}");
    let r = client().get(server.url("/")).header("cookie", "brokerfence_session=forged").send().await.expect("GET");
    assert_eq!(r.status().as_u16(), 303, "a forged session is sent to the login");
    // Guards a review finding: a logout only cleared the browser's cookie, and a copy of it
    // stayed valid until the server restarted. Each login has its own session; a logout ends it.
    assert!(cookie.contains("Max-Age="), "a session ends: {cookie}");
    let (status, _, _) = post(&server.url("/logout"), &[("csrf", &csrf(&page))], &[("cookie", &session)]).await;
    assert_eq!(status, 303);
    let r = client().get(server.url("/dead")).header("cookie", &session).send().await.expect("GET");
    assert_eq!(r.status().as_u16(), 303, "the session ended at its logout");
}

/// Every response carries the policy: no inline or foreign code, no framing, no sniffing.
#[tokio::test]
async fn dashboard_security_headers_on_every_response() {
    let db = sqlite_db().await;
    seed(&*db.store).await;
    let server = Server::start(&db.url, &db.schema, &["--allow-write"]).await;
    for path in
        ["/", "/in-flight", "/fences", "/dead", "/api/overview", "/static/app.js", "/static/app.css", "/login", "/nope"]
    {
        let (status, headers, body) = get(&server.url(path)).await;
        let h = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
        let csp = h("content-security-policy");
        assert!(csp.contains("script-src 'self'") && csp.contains("frame-ancestors 'none'"), "{path}: {csp}");
        assert!(!csp.contains("unsafe-inline"), "{path}: {csp}");
        assert_eq!(
            (h("x-content-type-options").as_str(), h("x-frame-options").as_str()),
            ("nosniff", "DENY"),
            "{path}"
        );
        if status == 200 && h("content-type").starts_with("text/html") {
            // No inline script or style, no event handler attribute: the CSP would block them.
            for inline in ["<script>", "style=", " onclick", " onload", "javascript:"] {
                assert!(!body.contains(inline), "{path} has {inline:?}");
            }
        }
    }
}

/// Guards a review finding (DNS rebinding): without a token the dashboard answers only to a
/// loopback `Host`; a page of another site whose name resolves to 127.0.0.1 gets 421 for every
/// page, endpoint and action. With a token the token decides.
#[tokio::test]
async fn dashboard_without_a_token_refuses_a_foreign_host_header() {
    let db = sqlite_db().await;
    seed(&*db.store).await;
    let server = Server::start(&db.url, &db.schema, &["--allow-write"]).await;
    for path in ["/", "/dead", "/api/overview", "/static/app.js"] {
        let r = client().get(server.url(path)).header("host", "evil.example").send().await.expect("GET");
        assert_eq!(r.status().as_u16(), 421, "{path}");
        let r = client().get(server.url(path)).header("host", "localhost").send().await.expect("GET");
        assert_ne!(r.status().as_u16(), 421, "{path}");
    }
    let (status, _, _) = post(
        &server.url("/actions/prune"),
        &[("completed_age", "0s"), ("dead_age", "0s")],
        &[("host", "evil.example"), ("origin", "http://evil.example")],
    )
    .await;
    assert_eq!(status, 421);
}

/// The fence events are a ring of `FENCE_EVENT_SLOTS` rows (the newest kept), and every prune
/// deletes activity and events past `Retention::dashboard_age`.
#[tokio::test]
async fn dashboard_fence_events_are_a_bounded_ring_and_pruned() {
    let db = pg_db().await;
    let q = queue("ring");
    let owner = Owner::new("w").expect("owner");
    let per_call = usize::try_from(FENCE_EVENT_SLOTS).expect("slots") * 3 / 5;
    for round in 0..2 {
        let mut a = Activity::default();
        a.counts.insert(q.clone(), ActivityCounts { claims: 1, ..Default::default() });
        for i in 0..per_call {
            a.events.push(FenceEvent {
                queue: q.clone(),
                key: key(&format!("k{round}-{i}")),
                kind: FenceEventKind::LeaseLost,
                detail: "test".into(),
                epoch: 1,
                owner: owner.clone(),
                winner_epoch: None,
                winner_owner: None,
            });
        }
        db.store.record_activity(&a).await.expect("record");
    }
    let admin = Admin::new(&*db.store).expect("admin");
    let events = admin.fence_events(Some(&q), u32::MAX).await.expect("events");
    assert_eq!(events.len() as i64, FENCE_EVENT_SLOTS, "the ring keeps its size");
    assert_eq!(events[0].key.as_str(), format!("k1-{}", per_call - 1), "the newest first");
    let report = admin.prune(&Retention::new().dashboard_age(Duration::ZERO)).await.expect("prune");
    // The events and the minute rows (one, or two when the calls straddled a minute).
    let expected = FENCE_EVENT_SLOTS as u64 + 1..=FENCE_EVENT_SLOTS as u64 + 2;
    assert!(expected.contains(&report.dashboard), "{report:?}");
    assert!(admin.fence_events(Some(&q), 10).await.expect("events").is_empty());
}

/// Guards a review finding: a prune of the dashboard's rows that fails (here its table is gone;
/// in life a role without the new grants, or a timeout) failed the whole prune after the jobs
/// were pruned, and their report was lost. Now it is logged and the prune answers.
#[tokio::test]
async fn dashboard_a_failed_dashboard_prune_does_not_fail_the_prune() {
    let db = pg_db().await;
    let q = queue("prune-fails");
    let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(&db.url).await.expect("pool");
    db.store.enqueue(&q, &key("done"), b"p").await.expect("enqueue");
    let owner = Owner::new("w").expect("owner");
    let claimed = db.store.claim_next(&q, &owner, lease(30), 1).await.expect("claim");
    db.store.complete(&claimed[0].lease, b"ok").await.expect("complete");
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE {}.activity", db.schema.as_str())))
        .execute(&pool)
        .await
        .expect("drop");
    let retention =
        Retention::new().queue(q.clone(), QueueRetention::completed_for(Duration::ZERO)).dashboard_age(Duration::ZERO);
    let report = db.store.prune(&retention).await.expect("the prune answers");
    assert_eq!(report.completed, 1, "{report:?}");
    assert_eq!(report.dashboard, 0, "{report:?}");
}

/// Walks an `EXPLAIN (FORMAT JSON)` plan: the relations read by a sequential scan.
fn seq_scans(plan: &Value, out: &mut Vec<String>) {
    walk_scans(plan, false, out);
}

/// [`seq_scans`], knowing whether a `Limit` right above bounds what the node reads.
fn walk_scans(plan: &Value, limited: bool, out: &mut Vec<String>) {
    match plan {
        Value::Object(map) => {
            let node = map.get("Node Type").and_then(Value::as_str).unwrap_or_default();
            let relation = map.get("Relation Name").and_then(Value::as_str).unwrap_or("?");
            if node == "Seq Scan" {
                out.push(relation.to_owned());
            }
            // A review finding: an index scan with no condition reads the whole table as well
            // (in index order), and the planner picks one when sequential scans are off; under a
            // `Limit` (the first row of an index, as a skip scan reads it) it reads what it keeps.
            if matches!(node, "Index Scan" | "Index Only Scan") && !map.contains_key("Index Cond") && !limited {
                out.push(format!("{relation} (a whole index)"));
            }
            // Only a `Limit` right above the scan bounds it (a sort between would read it all).
            let limited = node == "Limit";
            map.values().for_each(|v| walk_scans(v, limited, out));
        }
        Value::Array(items) => items.iter().for_each(|v| walk_scans(v, limited, out)),
        _ => {}
    }
}

/// Every dashboard statement reads the jobs table through an index, planned as the fence plans
/// (generic plans) on a schema never analyzed (autovacuum is off here): no sequential scan.
#[tokio::test]
async fn dashboard_queries_use_indexes_on_a_never_analyzed_schema() {
    let db = pg_db().await;
    seed(&*db.store).await;
    let admin = Admin::new(&*db.store).expect("admin");
    let plans = admin.dashboard_plans().await.expect("plans");
    assert!(plans.len() >= 8, "{plans:?}");
    for (name, plan) in &plans {
        let plan: Value = serde_json::from_str(plan).unwrap_or_else(|e| panic!("{name}: {e}: {plan}"));
        let mut scans = Vec::new();
        seq_scans(&plan, &mut scans);
        assert!(!scans.iter().any(|r| r.starts_with("jobs")), "{name} reads the jobs table whole: {scans:?} {plan}");
        assert!(plan.to_string().contains("Index"), "{name} reads no index: {plan}");
    }
    // The check sees a scan where there is one: a count by state alone has no index to use, and
    // with sequential scans off the planner reads a whole index instead.
    let pg = common::pg_on(db.schema.clone()).await;
    let mut tx = pg.begin().await.expect("begin");
    let s = db.schema.as_str();
    let scans = explain_scans(&mut tx, &format!("SELECT count(*) FROM {s}.jobs WHERE state = 'running'")).await;
    assert_eq!(scans, ["jobs"], "the negative control");
    sqlx::query("SET LOCAL enable_seqscan = off").execute(&mut *tx).await.expect("set");
    let scans = explain_scans(&mut tx, &format!("SELECT DISTINCT queue FROM {s}.jobs")).await;
    assert_eq!(scans, ["jobs (a whole index)"], "the negative control");
}

/// The whole-table reads (`seq_scans`) of `statement`'s plan.
async fn explain_scans(tx: &mut sqlx::PgConnection, statement: &str) -> Vec<String> {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN (FORMAT JSON) {statement}")))
        .fetch_one(&mut *tx)
        .await
        .expect("explain");
    let text: String = sqlx::Row::try_get_unchecked(&row, 0).expect("the plan");
    let plan: Value = serde_json::from_str(&text).expect("JSON plan");
    let mut scans = Vec::new();
    seq_scans(&plan, &mut scans);
    scans
}

/// The `SCAN` lines of an SQLite query plan that read a table whole (`SCAN t`, `SCAN t USING
/// [COVERING] INDEX i` without a condition); the scans of a CTE (`q`) or a constant row are not
/// reads of a table.
fn sqlite_full_scans(plan: &str) -> Vec<String> {
    plan.lines()
        .map(|l| l.trim_start_matches(|c: char| c == '|' || c == '`' || c == '-' || c.is_whitespace()))
        .filter(|l| l.starts_with("SCAN ") && !l.starts_with("SCAN CONSTANT ROW") && !l.starts_with("SCAN q"))
        .map(str::to_owned)
        .collect()
}

/// Guards a review finding: on SQLite the queue list (`SELECT DISTINCT queue`, asked on every
/// page without a queue filter) read every row of the jobs table, and the plans check only
/// caught full index scans. Every dashboard statement on SQLite reads by an index search, and
/// the check sees a scan where there is one.
#[tokio::test]
async fn dashboard_queries_use_indexes_on_sqlite() {
    let db = sqlite_db().await;
    seed(&*db.store).await;
    let plans = Admin::new(&*db.store).expect("admin").dashboard_plans().await.expect("plans");
    assert!(plans.contains_key("queues"), "{plans:?}");
    let jobs = format!("{}_jobs", db.schema.as_str());
    for (name, plan) in &plans {
        let scans: Vec<String> =
            sqlite_full_scans(plan).into_iter().filter(|l| l.contains(&jobs) || l.starts_with("SCAN t")).collect();
        assert!(scans.is_empty(), "{name} scans the jobs table: {plan}");
    }
    // The negative control: the statement the queue list was before.
    let pool = sqlx::sqlite::SqlitePoolOptions::new().max_connections(1).connect(&db.url).await.expect("pool");
    let rows: Vec<(i64, i64, i64, String)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "EXPLAIN QUERY PLAN SELECT DISTINCT queue FROM {jobs} ORDER BY queue"
    )))
    .fetch_all(&pool)
    .await
    .expect("explain");
    let plan = rows.into_iter().map(|r| r.3).collect::<Vec<_>>().join("\n");
    assert_eq!(sqlite_full_scans(&plan).len(), 1, "the negative control: {plan}");
}

/// With 100,000 jobs (1,000 of them running, 1,000 dead) every page and endpoint answers within
/// 200 ms (the best of three, after a first load), on a never-analyzed table.
#[tokio::test]
async fn dashboard_pages_within_200ms_with_100k_jobs() {
    let db = pg_db().await;
    let pg = common::pg_on(db.schema.clone()).await;
    let q = queue("big");
    let s = db.schema.as_str();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {s}.jobs (queue, key, payload, run_at) \
         SELECT $1, 'job-' || i, 'payload', clock_timestamp() - interval '1 hour' + i * interval '1 millisecond' \
         FROM generate_series(1, 99000) i"
    )))
    .bind(q.as_str())
    .execute(pg.pool())
    .await
    .expect("fill pending");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {s}.jobs (queue, key, payload, state, finished, epoch, attempts, failures, last_error, owner) \
         SELECT $1, 'dead-' || i, 'payload', 'dead', 'dead', 1, 1, 1, 'boom ' || i, 'w' FROM generate_series(1, 1000) i"
    )))
    .bind(q.as_str())
    .execute(pg.pool())
    .await
    .expect("fill dead");
    let owner = Owner::new("filler").expect("owner");
    let mut running = 0;
    while running < 1000 {
        running += db.store.claim_next(&q, &owner, lease(600), 250).await.expect("claim").len();
    }
    let server = Server::start(&db.url, &db.schema, &[]).await;
    let qs = format!("?queue={}", pct(q.as_str()));
    for path in ["/", "/in-flight", "/fences", "/dead", "/api/overview", "/api/in-flight", "/api/dead"] {
        for with_queue in [false, true] {
            let url = server.url(&format!("{path}{}", if with_queue { qs.as_str() } else { "" }));
            get_ok(&url).await;
            let mut best = Duration::MAX;
            for _ in 0..3 {
                let started = Instant::now();
                let body = get_ok(&url).await;
                best = best.min(started.elapsed());
                assert!(!body.is_empty());
            }
            eprintln!("dashboard page {url}: {best:?}");
            assert!(best < Duration::from_millis(200), "{url} took {best:?}");
        }
    }
    let o = get_json(&server.url(&format!("/api/overview{qs}"))).await;
    let counts = &o["queues"][0]["counts"];
    assert_eq!(counts["running"], 1000, "{o}");
    assert_eq!(o["queues"][0]["counts_capped"]["open"], true, "the open jobs reached the limit: {o}");
    let f = get_json(&server.url(&format!("/api/in-flight{qs}"))).await;
    assert_eq!(f["in_flight"].as_array().map(Vec::len), Some(200), "the list limit");
}

/// A real takeover: worker-a runs job `stalled` under a supervisor (activity flushed every second);
/// its lease runs out (set in the past, as for a stalled worker) and worker-b claims the job;
/// then worker-a's handler returns. Answers worker-a's lease, worker-b's and the outcome.
pub(crate) async fn takeover(db: &Db, q: &QueueName) -> (Lease, Lease, brokerfence::Outcome) {
    use brokerfence::{Supervisor, SupervisorConfig};
    let pg = common::pg_on(db.schema.clone()).await;
    let store = Arc::clone(&db.store);
    let config = SupervisorConfig::new(lease(3)).activity_interval(Duration::from_secs(1));
    let a = Supervisor::new(Arc::clone(&store), Owner::new("worker-a").expect("owner"), config);
    let lost = claim(&*store, q, "stalled", "worker-a").await;
    let go = Arc::new(tokio::sync::Notify::new());
    let run = {
        let (a, go, lost) = (a.clone(), Arc::clone(&go), lost.clone());
        tokio::spawn(async move {
            a.run(lost, Vec::new(), None, move |_ctx| async move {
                go.notified().await;
                Ok(b"late".to_vec())
            })
            .await
        })
    };
    let winner = loop {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {}.jobs SET lease_until = clock_timestamp() - interval '1 second' WHERE queue = $1 AND key = 'stalled'",
            db.schema.as_str()
        )))
        .bind(q.as_str())
        .execute(pg.pool())
        .await
        .expect("expire the lease");
        match store.claim(q, &key("stalled"), &Owner::new("worker-b").expect("owner"), lease(60)).await.expect("claim")
        {
            Claim::Claimed(l) => break l,
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    };
    go.notify_one();
    let outcome = tokio::time::timeout(Duration::from_secs(15), run).await.expect("the attempt ended").expect("join");
    // The supervisor's drop flushes what it recorded.
    drop(a);
    (lost, winner, outcome)
}

/// A supervisor records for the dashboard what happens to its attempts: claims and commits per
/// minute, and a takeover as a fence event naming the loser and the winner (its epoch and owner).
#[tokio::test]
async fn dashboard_supervisor_records_a_takeover_with_its_winner() {
    use brokerfence::{Outcome, Supervisor, SupervisorConfig};
    let db = pg_db().await;
    let store = Arc::clone(&db.store);
    let q = queue("takeover");
    let config = SupervisorConfig::new(lease(3)).activity_interval(Duration::from_secs(1));
    let a = Supervisor::new(Arc::clone(&store), Owner::new("worker-a").expect("owner"), config);
    let done = claim(&*store, &q, "done", "worker-a").await;
    let outcome = a.run(done, Vec::new(), None, |_ctx| async { Ok(b"ok".to_vec()) }).await;
    assert!(outcome.is_completed(), "{outcome:?}");
    let (lost, winner, outcome) = takeover(&db, &q).await;
    assert!(matches!(outcome, Outcome::Fenced(_) | Outcome::LeaseLost { .. }), "{outcome:?}");
    let admin = Admin::new(&*store).expect("admin");
    let deadline = Instant::now() + Duration::from_secs(10);
    let event = loop {
        if let Some(e) = admin.fence_events(Some(&q), 10).await.expect("events").into_iter().next() {
            break e;
        }
        assert!(Instant::now() < deadline, "no fence event recorded within 10 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        (event.key.as_str(), event.owner.as_str(), event.epoch),
        ("stalled", "worker-a", lost.epoch),
        "{event:?}"
    );
    assert_eq!(
        (event.winner_owner.as_deref(), event.winner_epoch),
        (Some("worker-b"), Some(winner.epoch)),
        "{event:?}"
    );
    assert!(winner.epoch > lost.epoch);
    // The counts arrive within the interval: 2 claims, 1 commit, 1 fenced or lost.
    let counts = loop {
        let o = admin.overview(Some(&q)).await.expect("overview");
        let total = o.queues[0].minutes.iter().fold(ActivityCounts::default(), |mut t, m| {
            t.claims += m.counts.claims;
            t.commits += m.counts.commits;
            t.fenced += m.counts.fenced;
            t.lost += m.counts.lost;
            t
        });
        if total.claims >= 2 && total.commits >= 1 && total.fenced + total.lost >= 1 || Instant::now() > deadline {
            break total;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!((counts.claims, counts.commits, counts.fenced + counts.lost), (2, 1, 1), "{counts:?}");
}

/// Guards a review finding: a graceful shutdown returned before the supervisor's last flush,
/// so a process that exited next lost up to an interval of counts (and a second of events).
/// Here the interval is an hour: only the shutdown's flush can write them.
#[tokio::test]
async fn dashboard_shutdown_writes_the_last_counts_before_it_returns() {
    use brokerfence::{Supervisor, SupervisorConfig};
    let db = pg_db().await;
    let store = Arc::clone(&db.store);
    let q = queue("last-flush");
    let config = SupervisorConfig::new(lease(30)).activity_interval(Duration::from_secs(3600));
    let a = Supervisor::new(Arc::clone(&store), Owner::new("worker-a").expect("owner"), config);
    let job = claim(&*store, &q, "one", "worker-a").await;
    let outcome = a.run(job, Vec::new(), None, |_ctx| async { Ok(b"ok".to_vec()) }).await;
    assert!(outcome.is_completed(), "{outcome:?}");
    a.shutdown(Duration::from_secs(1)).await;
    let o = Admin::new(&*store).expect("admin").overview(Some(&q)).await.expect("overview");
    let (claims, commits) =
        o.queues[0].minutes.iter().fold((0, 0), |(c, k), m| (c + m.counts.claims, k + m.counts.commits));
    assert_eq!((claims, commits), (1, 1), "{o:?}");
}

/// Counts stop at `count_limit` and say so; below it they are exact and say that too.
#[tokio::test]
async fn dashboard_counts_stop_at_the_limit_and_say_so() {
    for db in [pg_db().await, sqlite_db().await] {
        let q = seed(&*db.store).await;
        let admin = Admin::new(&*db.store).expect("admin");
        let exact = admin.clone().count_limit(10).overview(Some(&q)).await.expect("overview");
        let c = exact.queues[0].counts;
        assert_eq!((c.counts.pending, c.counts.running, c.counts.completed, c.counts.dead), (1, 1, 1, 1));
        assert!(!c.open_capped && !c.completed_capped && !c.dead_capped, "{c:?}");
        let capped = admin.count_limit(1).overview(Some(&q)).await.expect("overview");
        let c = capped.queues[0].counts;
        assert!(c.open_capped && c.completed_capped && c.dead_capped, "{c:?}");
        assert!(c.counts.pending + c.counts.running <= 2 && c.counts.completed == 1, "{c:?}");
    }
}
