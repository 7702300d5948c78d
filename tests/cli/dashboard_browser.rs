//! The dashboard in a real browser: headless Chromium (Debian's `chromium`, installed where
//! missing by `localstack/chromium`) driven through chromedriver's WebDriver HTTP API, while a
//! real table-queue consumer works. It checks that the live counts change without a reload,
//! that a requeue clicked on the dead-letter page takes the job out of the dead list, and saves
//! a screenshot of every page under `target/dashboard-screenshots/`.
#![cfg(feature = "web")]

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use brokerfence::{
    CancellationToken, Consumer, ConsumerConfig, FenceStore, JobContext, JobError, JobState, SupervisorConfig,
    TableQueue,
};
use brokerfence_testkit::store as common;
use serde_json::{Value, json};

use crate::dashboard::{Server, pg_db, queue};

/// chromedriver on a free port, and one browser session; both ended when dropped.
struct Browser {
    driver: tokio::process::Child,
    base: String,
    session: String,
    http: reqwest::Client,
}

/// The WebDriver's name of an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?.to_str()?.split(':').map(|d| PathBuf::from(d).join(program)).find(|p| p.is_file())
}

impl Browser {
    async fn start() -> Browser {
        if which("chromedriver").is_none() || which("chromium").is_none() {
            let script = brokerfence_testkit::tree::workspace_root().join("localstack/chromium");
            let out = std::process::Command::new("bash").arg(&script).output().expect("run localstack/chromium");
            assert!(
                out.status.success(),
                "chromium and chromedriver are needed (localstack/chromium installs them as root): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a port").port();
        let driver = tokio::process::Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("start chromedriver");
        let base = format!("http://127.0.0.1:{port}");
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().expect("client");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = match http.get(format!("{base}/status")).send().await {
                Ok(r) => r.text().await.ok().and_then(|t| serde_json::from_str::<Value>(&t).ok()),
                Err(_) => None,
            };
            if ready.is_some_and(|v| v["value"]["ready"] == true) {
                break;
            }
            assert!(Instant::now() < deadline, "chromedriver did not get ready within 30 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut browser = Browser { driver, base, session: String::new(), http };
        let chromium = which("chromium").map(|p| p.display().to_string()).unwrap_or_else(|| "chromium".into());
        let caps = json!({"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
            "binary": chromium,
            "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--window-size=1280,900", "--hide-scrollbars"]
        }}}});
        let v = browser.call(reqwest::Method::POST, "/session", Some(caps)).await;
        browser.session = v["sessionId"].as_str().expect("a session id").to_owned();
        browser
    }

    /// One WebDriver command: its `value`.
    async fn call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Value {
        let v = self.try_call(method.clone(), path, body).await;
        v.unwrap_or_else(|e| panic!("{method} {path}: {e}"))
    }

    /// One WebDriver command: its `value`, or the error it answered. The page refreshes its
    /// `<main>` every second, so an element found a moment ago may be stale: callers retry.
    async fn try_call(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Result<Value, Value> {
        let url = if path == "/session" {
            format!("{}{path}", self.base)
        } else {
            format!("{}/session/{}{path}", self.base, self.session)
        };
        let mut r = self.http.request(method.clone(), &url);
        if let Some(b) = body {
            r = r.header("content-type", "application/json").body(b.to_string());
        } else if method == reqwest::Method::POST {
            r = r.header("content-type", "application/json").body("{}");
        }
        let text = r.send().await.unwrap_or_else(|e| panic!("{method} {path}: {e}")).text().await.expect("body");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"));
        if v["value"].get("error").is_some() { Err(v) } else { Ok(v["value"].clone()) }
    }

    async fn open(&self, url: &str) {
        self.call(reqwest::Method::POST, "/url", Some(json!({"url": url}))).await;
    }

    /// The element matching `css`, if any.
    async fn find(&self, css: &str) -> Option<String> {
        let v =
            self.call(reqwest::Method::POST, "/elements", Some(json!({"using": "css selector", "value": css}))).await;
        v.as_array()?.first()?.get(ELEMENT)?.as_str().map(str::to_owned)
    }

    async fn text(&self, css: &str) -> Option<String> {
        let id = self.find(css).await?;
        let v = self.try_call(reqwest::Method::GET, &format!("/element/{id}/text"), None).await.ok()?;
        v.as_str().map(str::to_owned)
    }

    /// Runs `act` on the element matching `css`, again when the refresh made it stale (up to 20 s).
    async fn on_element(&self, css: &str, act: impl Fn(String) -> (reqwest::Method, String)) -> Value {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(id) = self.find(css).await {
                let (method, path) = act(id);
                match self.try_call(method, &path, None).await {
                    Ok(v) => return v,
                    Err(e) if e.to_string().contains("stale element") => {}
                    Err(e) => panic!("{path}: {e}"),
                }
            }
            assert!(Instant::now() < deadline, "{css}: no usable element within 20 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn source(&self) -> String {
        self.call(reqwest::Method::GET, "/source", None).await.as_str().unwrap_or_default().to_owned()
    }

    /// Waits up to 20 s for `css` to have text that `ok` accepts.
    async fn wait_text(&self, css: &str, ok: impl Fn(&str) -> bool) -> String {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(t) = self.text(css).await.filter(|t| ok(t)) {
                return t;
            }
            if Instant::now() > deadline {
                let page: String = self.source().await.chars().take(3000).collect();
                panic!("{css}: not as expected within 20 s: {:?}; the page: {page}", self.text(css).await);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Saves a PNG of the window as `target/dashboard-screenshots/<name>.png`.
    async fn screenshot(&self, name: &str) -> PathBuf {
        let b64 = self.call(reqwest::Method::GET, "/screenshot", None).await;
        let png = base64_decode(b64.as_str().expect("base64"));
        assert!(png.starts_with(b"\x89PNG"), "a PNG");
        let dir = brokerfence_testkit::tree::workspace_root().join("target/dashboard-screenshots");
        std::fs::create_dir_all(&dir).expect("screenshot dir");
        let path = dir.join(format!("{name}.png"));
        std::fs::write(&path, png).expect("write screenshot");
        path
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            // Best effort; chromedriver's end takes the browser with it.
            let url = format!("{}/session/{}", self.base, self.session);
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
                if let Ok(rt) = rt {
                    let _ = rt.block_on(async { reqwest::Client::new().delete(url).send().await });
                }
            })
            .join();
        }
        let _ = self.driver.start_kill();
    }
}

fn base64_decode(s: &str) -> Vec<u8> {
    let value = |c: u8| match c {
        b'A'..=b'Z' => Some(c - b'A'),
        b'a'..=b'z' => Some(c - b'a' + 26),
        b'0'..=b'9' => Some(c - b'0' + 52),
        b'+' => Some(62),
        b'/' => Some(63),
        _ => None,
    };
    let (mut out, mut acc, mut bits) = (Vec::with_capacity(s.len() * 3 / 4), 0u32, 0);
    for v in s.bytes().filter_map(value) {
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
        }
    }
    out
}

#[tokio::test]
async fn dashboard_in_a_real_browser_while_a_worker_runs() {
    let db = pg_db().await;
    let store: Arc<dyn FenceStore> = Arc::clone(&db.store);
    let q = queue("shop");
    let jobs: Vec<_> = (0..3000)
        .map(|i| {
            let key = if i % 40 == 7 { format!("bad-{i}") } else { format!("order-{i}") };
            (common::key(&key), format!("{{\"order\":{i}}}").into_bytes())
        })
        .collect();
    store.enqueue_many(&q, &jobs).await.expect("enqueue");
    // A real consumer: 8 at a time, 200 ms a job (about 40 a second, so the queue lasts the
    // test); `bad-*` keys fail for good the first time.
    let failed_once = Arc::new(Mutex::new(HashSet::new()));
    let stop = CancellationToken::new();
    let supervisor = SupervisorConfig::new(common::lease(10)).activity_interval(Duration::from_secs(1));
    let consumer = Consumer::new(
        TableQueue::new(Arc::clone(&store), q.clone()),
        Arc::clone(&store),
        ConsumerConfig::new(supervisor).concurrency(8),
    );
    let worker = {
        let (stop, failed_once) = (stop.clone(), Arc::clone(&failed_once));
        tokio::spawn(async move {
            consumer
                .run(
                    move |ctx: JobContext| {
                        let failed_once = Arc::clone(&failed_once);
                        async move {
                            tokio::time::sleep(Duration::from_millis(200)).await;
                            let key = ctx.key().as_str().to_owned();
                            if key.starts_with("bad-") && failed_once.lock().map(|mut s| s.insert(key)).unwrap_or(false)
                            {
                                return Err(JobError::fatal("card declined: <b>insufficient funds</b>"));
                            }
                            Ok(b"shipped".to_vec())
                        }
                    },
                    stop,
                )
                .await
        })
    };
    crate::dashboard::takeover(&db, &q).await;

    let server = Server::start(&db.url, &db.schema, &["--allow-write", "--refresh", "1s"]).await;
    let browser = Browser::start().await;
    let qs = format!("?queue={}", q.as_str());

    // Overview: the counts change while the page stays open (the live refresh).
    browser.open(&server.url("/")).await;
    let completed = "tr[data-queue] td[data-count=\"completed\"]";
    let first = browser.wait_text(completed, |t| t.parse::<u64>().is_ok()).await;
    let later = browser.wait_text(completed, |t| t != first).await;
    assert!(later.parse::<u64>().expect("a count") > first.parse::<u64>().expect("a count"), "{first} -> {later}");
    browser.wait_text("#refresh-state", |t| t.starts_with("live ")).await;
    // Let the chart get a few points.
    tokio::time::sleep(Duration::from_secs(3)).await;
    browser.screenshot("overview").await;

    browser.open(&server.url(&format!("/in-flight{qs}"))).await;
    browser.wait_text("#in-flight-count", |t| t.contains("running")).await;
    browser.screenshot("in-flight").await;

    browser.open(&server.url(&format!("/fences{qs}"))).await;
    browser.wait_text("main table tbody tr", |t| t.contains("worker-b at epoch")).await;
    browser.screenshot("fences").await;

    // Dead letters: click a requeue, see the job leave the list.
    browser.open(&server.url(&format!("/dead{qs}"))).await;
    browser.wait_text("#dead-count", |t| t.contains("shown")).await;
    let key = browser
        .on_element("form[action=\"/actions/requeue\"] input[name=\"key\"]", |id| {
            (reqwest::Method::GET, format!("/element/{id}/property/value"))
        })
        .await;
    let key = key.as_str().expect("the key").to_owned();
    assert!(key.starts_with("bad-"), "{key}");
    browser.screenshot("dead").await;
    // The first requeue button is the first row's: the newest dead letter, which stays first
    // across refreshes unless another job dies meanwhile (then that one is requeued: checked below).
    browser
        .on_element("form[action=\"/actions/requeue\"] button", |id| {
            (reqwest::Method::POST, format!("/element/{id}/click"))
        })
        .await;
    let done = browser.wait_text("ul.actions li", |t| t.contains("requeued 1 dead job(s)")).await;
    let key = done.split("; ").nth(1).and_then(|s| s.split(' ').next()).expect("the requeued key").to_owned();
    let page = browser.source().await;
    assert!(!page.contains(&format!(">{key}<")), "{key} left the dead letters");
    let job = common::job(&*store, &q, &key).await.expect("the job");
    assert_ne!(job.state, JobState::Dead, "{job:?}");
    browser.screenshot("dead-after-requeue").await;

    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(30), worker).await;
}
