//! Shared machinery of the zombie proof tests (`tests/zombie_proof.rs`, `tests/guards.rs`):
//! a fresh database per scenario (PostgreSQL schema or SQLite file), an HTTP receiver that uses
//! the fence middleware and records every call, the zombie worker as a real OS process that the
//! tests freeze with SIGSTOP and resume with SIGCONT, and the scenarios of the table.
//!
//! The zombie process is this very test binary, re-executed in worker mode (see [`worker_entry`]):
//! it runs `examples/zombie_worker.rs`, compiled into the test, so `cargo test --test …` never
//! runs a stale or missing example binary.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::post;
use brokerfence::adapters::http::{AcceptedStamp, EpochGuard, stamp_from_headers};
use brokerfence::fence::wire::FenceStamp;
use brokerfence::fence::{
    Claim, FenceStore, Guards, JobKey, JobRecord, Lease, LeaseDuration, Ledger, MetricsSnapshot, Outcome, Owner,
    PgFence, PgLedger, QueueName, SchemaName, SqliteFence, SqliteLedger, Supervisor, SupervisorConfig,
};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::Notify;

#[path = "../../examples/zombie_worker.rs"]
pub mod worker;

/// Environment variable that turns this test binary into a zombie worker process.
pub const WORKER_ENV: &str = "BROKERFENCE_ZOMBIE_WORKER_ARGS";
/// The lease of every scenario: the minimum, so heartbeats run every second.
pub const LEASE_SECS: u64 = 3;
pub const QUEUE: &str = "payments";
pub const KEY: &str = "order-7";
pub const NEW_OWNER: &str = "new-owner";
pub const NEW_OWNER_RESULT: &str = "result of new-owner";

/// Not a test: the entry point of the worker process. In a normal test run it returns at once.
#[test]
fn worker_entry() {
    if let Ok(args) = std::env::var(WORKER_ENV) {
        let args: Vec<String> = args.split('\u{1f}').map(str::to_owned).collect();
        std::process::exit(worker::run(args));
    }
}

pub fn lease() -> LeaseDuration {
    LeaseDuration::from_secs(LEASE_SECS).expect("3 s is a valid lease")
}

fn random_suffix() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// The PostgreSQL of `localstack/up`, or a loud failure.
pub fn pg_url() -> String {
    brokerfence_testkit::services::var("DATABASE_URL")
        .expect("DATABASE_URL is not set and localstack/.env is missing: run localstack/up first")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Postgres,
    Sqlite,
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Postgres => "postgres",
            Backend::Sqlite => "sqlite",
        })
    }
}

/// One open fence (one pool), with the guards it was built with.
#[derive(Clone, Debug)]
pub enum AnyFence {
    Pg(PgFence),
    Sqlite(SqliteFence),
}

impl AnyFence {
    pub fn store(&self) -> Arc<dyn FenceStore> {
        match self {
            AnyFence::Pg(f) => Arc::new(f.clone()),
            AnyFence::Sqlite(f) => Arc::new(f.clone()),
        }
    }

    pub fn ledger(&self, scope: &str) -> Ledger {
        match self {
            AnyFence::Pg(f) => Ledger::Pg(PgLedger::new(f, scope)),
            AnyFence::Sqlite(f) => Ledger::Sqlite(SqliteLedger::new(f, scope)),
        }
    }
}

fn with_guards_pg(f: PgFence, g: Guards) -> PgFence {
    f.with_guards(g)
}

fn with_guards_sqlite(f: SqliteFence, g: Guards) -> SqliteFence {
    f.with_guards(g)
}

async fn open_fence(backend: Backend, url: &str, schema: &SchemaName, guards: Guards) -> AnyFence {
    match backend {
        Backend::Postgres => {
            let f = PgFence::connect(url)
                .await
                .unwrap_or_else(|e| panic!("cannot reach PostgreSQL at {url} ({e}): run localstack/up first"))
                .with_schema(schema.clone());
            AnyFence::Pg(with_guards_pg(f, guards))
        }
        Backend::Sqlite => {
            let f = SqliteFence::open(url).await.expect("open sqlite").with_schema(schema.clone());
            AnyFence::Sqlite(with_guards_sqlite(f, guards))
        }
    }
}

/// A fresh database for one scenario: its own PostgreSQL schema, or its own SQLite file.
#[derive(Debug)]
pub struct Db {
    pub backend: Backend,
    /// What the worker process connects to.
    pub url: String,
    pub schema: SchemaName,
    sqlite_path: Option<PathBuf>,
    /// A fence with every guard on, for inspecting the database.
    pub admin: AnyFence,
}

impl Db {
    pub async fn new(backend: Backend) -> Db {
        let (url, schema, sqlite_path) = match backend {
            Backend::Postgres => {
                (pg_url(), SchemaName::new(format!("zp_{}", random_suffix())).expect("valid schema"), None)
            }
            Backend::Sqlite => {
                let path = std::env::temp_dir().join(format!("brokerfence-zp-{}.db", random_suffix()));
                (format!("sqlite:{}", path.display()), SchemaName::default(), Some(path))
            }
        };
        let admin = open_fence(backend, &url, &schema, Guards::default()).await;
        admin.store().migrate().await.expect("migrate");
        Db { backend, url, schema, sqlite_path, admin }
    }

    /// A new pool on this database, with these guards.
    pub async fn fence(&self, guards: Guards) -> AnyFence {
        open_fence(self.backend, &self.url, &self.schema, guards).await
    }

    pub async fn job(&self) -> JobRecord {
        self.admin
            .store()
            .job(&QueueName::new(QUEUE).expect("queue"), &JobKey::new(KEY).expect("key"))
            .await
            .expect("read job")
            .expect("job row exists")
    }

    pub async fn cleanup(&self) {
        match (&self.admin, &self.sqlite_path) {
            (AnyFence::Pg(f), _) => {
                let _ =
                    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA IF EXISTS {} CASCADE", self.schema.as_str())))
                        .execute(f.pool())
                        .await;
            }
            (AnyFence::Sqlite(f), Some(path)) => {
                f.pool().close().await;
                for ext in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!("{}{ext}", path.display()));
                }
            }
            _ => {}
        }
    }
}

/// One call the receiver got.
#[derive(Debug, Clone)]
pub struct Call {
    pub stamp: Option<FenceStamp>,
    pub status: u16,
    pub at: Instant,
}

impl Call {
    pub fn epoch(&self) -> i64 {
        self.stamp.as_ref().map_or(0, |s| s.epoch)
    }
}

#[derive(Clone, Default)]
struct Recorder {
    calls: Arc<Mutex<Vec<Call>>>,
    /// The effect applied per ledger job: (epoch, body). Last accepted writer wins.
    effects: Arc<Mutex<HashMap<String, (i64, String)>>>,
}

/// An HTTP receiver on 127.0.0.1:0 guarded by the fence middleware, recording every call.
pub struct Receiver {
    pub url: String,
    pub ledger: Ledger,
    rec: Recorder,
    task: tokio::task::JoinHandle<()>,
}

async fn record(State(rec): State<Recorder>, req: Request, next: Next) -> Response {
    let stamp = stamp_from_headers(req.headers()).ok();
    let at = Instant::now();
    let response = next.run(req).await;
    rec.calls.lock().expect("calls").push(Call { stamp, status: response.status().as_u16(), at });
    response
}

async fn effect(State(rec): State<Recorder>, AcceptedStamp { stamp, newest }: AcceptedStamp, body: String) -> String {
    assert_eq!(newest, stamp.epoch, "an accepted stamp is the newest");
    rec.effects.lock().expect("effects").insert(stamp.ledger_job(), (stamp.epoch, body));
    format!("applied {stamp}")
}

impl Receiver {
    pub async fn start(ledger: Ledger) -> Receiver {
        let rec = Recorder::default();
        let app = Router::new()
            .route("/effect", post(effect))
            .layer(EpochGuard::new(ledger.clone()).layer())
            .layer(axum::middleware::from_fn_with_state(rec.clone(), record))
            .with_state(rec.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind receiver");
        let url = format!("http://{}/effect", listener.local_addr().expect("addr"));
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Receiver { url, ledger, rec, task }
    }

    pub fn calls(&self) -> Vec<Call> {
        self.rec.calls.lock().expect("calls").clone()
    }

    /// (epoch, status) of every call, in arrival order.
    pub fn summary(&self) -> Vec<(i64, u16)> {
        let mut calls = self.calls();
        calls.sort_by_key(|c| c.at);
        calls.iter().map(|c| (c.epoch(), c.status)).collect()
    }

    pub fn effect(&self) -> Option<(i64, String)> {
        let job = FenceStamp::new(QUEUE, KEY, 1).ledger_job();
        self.rec.effects.lock().expect("effects").get(&job).cloned()
    }

    pub async fn newest(&self) -> Option<i64> {
        self.ledger.newest(&FenceStamp::new(QUEUE, KEY, 1).ledger_job()).await.expect("ledger newest")
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The zombie: a worker in its own OS process.
pub struct Zombie {
    pub label: String,
    pub pid: i32,
    child: tokio::process::Child,
    stdin: Option<tokio::process::ChildStdin>,
    /// (arrival, line): stdout `EVENT …` lines without the prefix; stderr lines prefixed `stderr: `.
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    notify: Arc<Notify>,
    /// The tasks reading stdout and stderr; they end at end-of-file.
    readers: Vec<tokio::task::JoinHandle<()>>,
    pub started: Instant,
}

impl Zombie {
    /// Spawns the worker against `db`, calling `receiver`, with a plan and test-only guard switches.
    pub fn spawn(label: &str, db: &Db, receiver: Option<&str>, plan: &str, guards: &[&str]) -> Zombie {
        Self::spawn_url(label, db, &db.url, receiver, plan, guards)
    }

    /// Like [`spawn`](Self::spawn) but connecting to `url` (e.g. through a proxy).
    pub fn spawn_url(label: &str, db: &Db, url: &str, receiver: Option<&str>, plan: &str, guards: &[&str]) -> Zombie {
        let mut args: Vec<String> = vec![
            "--db".into(),
            url.into(),
            "--schema".into(),
            db.schema.as_str().into(),
            "--queue".into(),
            QUEUE.into(),
            "--key".into(),
            KEY.into(),
            "--owner".into(),
            "zombie".into(),
            "--lease-secs".into(),
            LEASE_SECS.to_string(),
            "--plan".into(),
            plan.into(),
            "--result".into(),
            "result of zombie".into(),
        ];
        if let Some(r) = receiver {
            args.extend(["--receiver".into(), r.into()]);
        }
        if !guards.is_empty() {
            args.extend(["--guards".into(), guards.join(",")]);
        }
        let exe = std::env::current_exe().expect("current exe");
        let mut child = tokio::process::Command::new(exe)
            .args(["zombie_support::worker_entry", "--exact", "--nocapture", "--test-threads=1", "-q"])
            .env(WORKER_ENV, args.join("\u{1f}"))
            .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "warn,brokerfence_fence=info".into()))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn zombie worker process");
        let pid = i32::try_from(child.id().expect("pid")).expect("pid fits");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let notify = Arc::new(Notify::new());
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        let mut readers = Vec::new();
        for (stream, is_err) in
            [(Box::new(stdout) as Box<dyn tokio::io::AsyncRead + Unpin + Send>, false), (Box::new(stderr), true)]
        {
            let lines = Arc::clone(&lines);
            let notify = Arc::clone(&notify);
            readers.push(tokio::spawn(async move {
                let mut reader = BufReader::new(stream).lines();
                while let Ok(Some(line)) = reader.next_line().await {
                    let at = Instant::now();
                    let entry = if is_err {
                        format!("stderr: {line}")
                    } else if let Some(event) = line.strip_prefix("EVENT ") {
                        event.to_owned()
                    } else {
                        continue;
                    };
                    lines.lock().expect("lines").push((at, entry));
                    notify.notify_waiters();
                }
                notify.notify_waiters();
            }));
        }
        let stdin = child.stdin.take();
        Zombie { label: label.to_owned(), pid, child, stdin, lines, notify, readers, started: Instant::now() }
    }

    /// Every event so far (stderr lines excluded).
    pub fn events(&self) -> Vec<(Instant, String)> {
        self.lines.lock().expect("lines").iter().filter(|(_, l)| !l.starts_with("stderr: ")).cloned().collect()
    }

    /// Events that arrived after `t`.
    pub fn events_after(&self, t: Instant) -> Vec<String> {
        self.events().into_iter().filter(|(at, _)| *at > t).map(|(_, l)| l).collect()
    }

    /// Waits for the first event starting with `prefix` that arrived after `after`.
    pub async fn wait_for_after(&self, prefix: &str, after: Option<Instant>, timeout: Duration) -> (Instant, String) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(hit) =
                self.events().into_iter().find(|(at, l)| l.starts_with(prefix) && after.is_none_or(|t| *at > t))
            {
                return hit;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!("[{}] no event {prefix:?} within {timeout:?}\n{}", self.label, self.transcript());
            }
        }
    }

    pub async fn wait_for(&self, prefix: &str, timeout: Duration) -> (Instant, String) {
        self.wait_for_after(prefix, None, timeout).await
    }

    /// Freezes the whole process (every thread, the heartbeat included) with SIGSTOP.
    pub fn stop(&self) -> Instant {
        // SAFETY: plain syscall on our own child's pid.
        let rc = unsafe { libc::kill(self.pid, libc::SIGSTOP) };
        assert_eq!(rc, 0, "SIGSTOP failed");
        let t = Instant::now();
        let until = t + Duration::from_secs(2);
        while proc_state(self.pid) != Some('T') {
            assert!(Instant::now() < until, "[{}] process did not stop", self.label);
            std::thread::sleep(Duration::from_millis(1));
        }
        t
    }

    /// Resumes it with SIGCONT; returns the instant just before the signal was sent (so every
    /// latency measured from it is an upper bound).
    pub fn cont(&self) -> Instant {
        let t = Instant::now();
        // SAFETY: plain syscall on our own child's pid.
        let rc = unsafe { libc::kill(self.pid, libc::SIGCONT) };
        assert_eq!(rc, 0, "SIGCONT failed");
        t
    }

    /// Opens the `gate` step (the write is buffered in the pipe while the process is stopped).
    pub async fn open_gate(&mut self) {
        let stdin = self.stdin.as_mut().expect("stdin");
        stdin.write_all(b"go\n").await.expect("write gate");
        stdin.flush().await.expect("flush gate");
    }

    /// Waits for the process to exit; returns its exit code.
    pub async fn finish(&mut self, timeout: Duration) -> i32 {
        let code = match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(Ok(status)) => status.code().unwrap_or(-1),
            Ok(Err(e)) => panic!("[{}] wait: {e}", self.label),
            Err(_) => panic!("[{}] did not exit within {timeout:?}\n{}", self.label, self.transcript()),
        };
        // The process has exited, but its last lines may still be on their way through the
        // pipes: read to the end, so what it printed last (its counters) is there for the test.
        for reader in self.readers.drain(..) {
            if tokio::time::timeout(timeout, reader).await.is_err() {
                panic!("[{}] output not read to its end within {timeout:?}", self.label);
            }
        }
        code
    }

    /// The `outcome=…` event.
    pub fn outcome(&self) -> Option<String> {
        self.events().into_iter().map(|(_, l)| l).find(|l| l.starts_with("outcome="))
    }

    /// The counters the worker printed at its end.
    pub fn metrics(&self) -> HashMap<String, u64> {
        let line = self.events().into_iter().map(|(_, l)| l).find(|l| l.starts_with("metrics ")).unwrap_or_default();
        line.split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .filter_map(|(k, v)| Some((k.to_owned(), v.parse().ok()?)))
            .collect()
    }

    /// The claimed epoch.
    pub fn claimed_epoch(&self) -> i64 {
        let line = self.events().into_iter().map(|(_, l)| l).find(|l| l.starts_with("claimed ")).unwrap_or_default();
        field(&line, "epoch").and_then(|v| v.parse().ok()).unwrap_or(0)
    }

    /// Everything the process printed, with arrival times relative to its start.
    pub fn transcript(&self) -> String {
        let lines = self.lines.lock().expect("lines");
        lines.iter().map(|(at, l)| format!("  {:>7.3}s {l}\n", at.duration_since(self.started).as_secs_f64())).collect()
    }
}

/// The value of `name=` in an event line.
pub fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
}

/// The state letter of /proc/<pid>/stat (`T` = stopped).
pub fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// Claims the job as the new owner, retrying while the zombie's lease is live.
pub async fn take_over(store: &Arc<dyn FenceStore>, owner: &Owner, timeout: Duration) -> Lease {
    let deadline = tokio::time::Instant::now() + timeout;
    let (q, k) = (QueueName::new(QUEUE).expect("queue"), JobKey::new(KEY).expect("key"));
    loop {
        match store.claim(&q, &k, owner, lease()).await.expect("claim") {
            Claim::Claimed(l) => return l,
            other => {
                assert!(tokio::time::Instant::now() < deadline, "no takeover within {timeout:?}: {other:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// POSTs to the receiver with a stamp; returns the status and body.
pub async fn post_stamped(url: &str, stamp: &FenceStamp, body: String) -> (u16, String) {
    let mut request = reqwest::Client::new().post(url).body(body);
    for (name, value) in stamp.to_headers() {
        request = request.header(name, value);
    }
    let response = request.send().await.expect("receiver reachable");
    let status = response.status().as_u16();
    (status, response.text().await.unwrap_or_default())
}

/// The new owner does its job under its own supervisor: calls the receiver, commits its result.
pub async fn new_owner_runs(
    store: Arc<dyn FenceStore>,
    lease: Lease,
    receiver: &str,
) -> (Outcome, MetricsSnapshot, u16) {
    let supervisor = Supervisor::new(Arc::clone(&store), lease.owner.clone(), SupervisorConfig::new(self::lease()));
    let url = receiver.to_owned();
    let status = Arc::new(Mutex::new(0u16));
    let seen = Arc::clone(&status);
    let outcome = supervisor
        .run(lease, Vec::new(), None, move |ctx| async move {
            let body = format!("effect of {} at epoch {}", ctx.owner(), ctx.epoch());
            let (code, _) = post_stamped(&url, &ctx.stamp(), body).await;
            *seen.lock().expect("status") = code;
            Ok(NEW_OWNER_RESULT.as_bytes().to_vec())
        })
        .await;
    let metrics = supervisor.metrics().snapshot();
    supervisor.shutdown(Duration::from_millis(100)).await;
    let code = *status.lock().expect("status");
    (outcome, metrics, code)
}

/// Which of the two orderings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// The new owner reaches the receiver first; the zombie's call arrives after it.
    NewOwnerFirst,
    /// The zombie reaches the receiver first; the new owner's call supersedes it.
    ZombieFirst,
}

/// Guard settings of one scenario (all on by default).
#[derive(Debug, Clone, Default)]
pub struct Switches {
    /// Guards of the zombie's store, as worker flags (`no-commit-cas`, …).
    pub zombie: Vec<&'static str>,
    /// Guards of the new owner's store.
    pub new_owner: Guards,
    /// Guards of the receiver's ledger.
    pub receiver: Guards,
}

/// What one run of the table scenario observed.
#[derive(Debug)]
pub struct TableRun {
    pub label: String,
    pub zombie_epoch: i64,
    pub new_epoch: i64,
    pub zombie_outcome: String,
    pub zombie_metrics: HashMap<String, u64>,
    pub new_outcome: Outcome,
    pub new_metrics: MetricsSnapshot,
    pub new_owner_status: u16,
    /// (epoch, status) of every receiver call, in arrival order.
    pub receiver_calls: Vec<(i64, u16)>,
    pub newest: Option<i64>,
    pub effect: Option<(i64, String)>,
    pub job: JobRecord,
    pub stopped_for: Duration,
    pub timeline: String,
}

/// The table, one row: the zombie claims (epoch 1), is frozen with SIGSTOP past its lease
/// (in the zombie-first order after its receiver call, in the other before it), the new owner
/// takes over (epoch 2), calls the receiver and commits; then the zombie is resumed with SIGCONT,
/// makes its (blocking, un-cancellable) receiver call if it has not yet, and commits.
pub async fn table_run(backend: Backend, order: Order, switches: Switches) -> TableRun {
    let label = format!("{backend} {order:?} {switches:?}");
    let db = Db::new(backend).await;
    let receiver = Receiver::start(db.fence(switches.receiver).await.ledger("receiver")).await;
    let plan = match order {
        Order::NewOwnerFirst => "gate,call-sync",
        Order::ZombieFirst => "call,gate",
    };
    let mut zombie = Zombie::spawn(&label, &db, Some(&receiver.url), plan, &switches.zombie);
    let t0 = zombie.started;
    let mut timeline = String::new();
    let mut note = |at: Instant, what: &str| {
        timeline.push_str(&format!("  +{:.3}s {what}\n", at.duration_since(t0).as_secs_f64()))
    };

    let (at, line) = zombie.wait_for("claimed", Duration::from_secs(20)).await;
    note(at, &format!("zombie {line}"));
    let (at, _) = zombie.wait_for("gate", Duration::from_secs(10)).await;
    note(at, "zombie reached its gate");
    let stopped = zombie.stop();
    note(stopped, "zombie frozen with SIGSTOP");

    let new_store = db.fence(switches.new_owner).await.store();
    let lease2 = take_over(&new_store, &Owner::new(NEW_OWNER).expect("owner"), Duration::from_secs(10)).await;
    note(Instant::now(), &format!("new owner claimed epoch {} (zombie's lease expired)", lease2.epoch));
    let new_epoch = lease2.epoch;
    let (new_outcome, new_metrics, new_owner_status) = new_owner_runs(new_store, lease2, &receiver.url).await;
    note(Instant::now(), &format!("new owner: receiver {new_owner_status}, {new_outcome:?}"));

    zombie.open_gate().await;
    let resumed = zombie.cont();
    note(resumed, "zombie resumed with SIGCONT");
    let (at, line) = zombie.wait_for("outcome=", Duration::from_secs(10)).await;
    note(at, &format!("zombie {line}"));
    let code = zombie.finish(Duration::from_secs(10)).await;
    assert_eq!(code, 0, "[{label}] worker exit code\n{}", zombie.transcript());

    let run = TableRun {
        zombie_epoch: zombie.claimed_epoch(),
        new_epoch,
        zombie_outcome: zombie.outcome().unwrap_or_default(),
        zombie_metrics: zombie.metrics(),
        new_outcome,
        new_metrics,
        new_owner_status,
        receiver_calls: receiver.summary(),
        newest: receiver.newest().await,
        effect: receiver.effect(),
        job: db.job().await,
        stopped_for: resumed.duration_since(stopped),
        timeline: format!("{timeline}zombie process:\n{}", zombie.transcript()),
        label,
    };
    db.cleanup().await;
    run
}

/// What one run of the cancel scenario observed.
#[derive(Debug)]
pub struct CancelRun {
    pub label: String,
    /// SIGCONT to the handler's future being dropped.
    pub cancel_latency: Option<Duration>,
    pub zombie_outcome: String,
    pub zombie_metrics: HashMap<String, u64>,
    /// Receiver calls stamped with the zombie's epoch that arrived after SIGCONT.
    pub calls_after_resume: Vec<(i64, u16)>,
    /// `calling` events the zombie printed after SIGCONT.
    pub attempts_after_resume: usize,
    pub job: JobRecord,
    pub transcript: String,
}

/// The zombie calls the receiver, waits 1.5 s (an async wait, where a real handler would await a
/// slow dependency), then calls it every 150 ms. It is frozen with SIGSTOP during that wait, the
/// new owner takes over, and the zombie is resumed: its handler must be dropped at once and never
/// call again. (The wait is long so that even a loaded machine stops the zombie inside it, not in
/// the middle of a poll, which would legitimately run to its next await point.)
pub async fn cancel_run(backend: Backend, zombie_guards: &[&str]) -> CancelRun {
    let label = format!("{backend} cancel {zombie_guards:?}");
    let db = Db::new(backend).await;
    let receiver = Receiver::start(db.admin.ledger("receiver")).await;
    let mut zombie = Zombie::spawn(&label, &db, Some(&receiver.url), "call,sleep:1500,calls:20:150", zombie_guards);
    zombie.wait_for("receiver epoch=1 status=200", Duration::from_secs(20)).await;
    let stopped = zombie.stop();
    let calls_before = zombie.events().iter().filter(|(at, l)| *at < stopped && l.starts_with("calling")).count();
    assert_eq!(
        calls_before,
        1,
        "[{label}] the test was too slow to stop the zombie in its wait\n{}",
        zombie.transcript()
    );
    let new_store = db.fence(Guards::default()).await.store();
    let lease2 = take_over(&new_store, &Owner::new(NEW_OWNER).expect("owner"), Duration::from_secs(10)).await;
    let (outcome, _, status) = new_owner_runs(new_store, lease2, &receiver.url).await;
    assert!(outcome.is_completed() && status == 200, "[{label}] new owner: {outcome:?} {status}");

    let resumed = zombie.cont();
    let dropped = zombie.wait_for_after("handler-dropped", Some(resumed), Duration::from_secs(10)).await;
    zombie.wait_for("outcome=", Duration::from_secs(10)).await;
    // Leave time for a call that should not come (the zombie called every 150 ms).
    tokio::time::sleep(Duration::from_millis(600)).await;
    let code = zombie.finish(Duration::from_secs(10)).await;
    assert_eq!(code, 0, "[{label}] worker exit code\n{}", zombie.transcript());
    let calls_after_resume =
        receiver.calls().iter().filter(|c| c.at > resumed && c.epoch() == 1).map(|c| (c.epoch(), c.status)).collect();
    let attempts_after_resume = zombie.events_after(resumed).iter().filter(|l| l.starts_with("calling")).count();
    let finished_early = field(&dropped.1, "finished") == Some("false");
    let run = CancelRun {
        cancel_latency: finished_early.then(|| dropped.0.duration_since(resumed)),
        zombie_outcome: zombie.outcome().unwrap_or_default(),
        zombie_metrics: zombie.metrics(),
        calls_after_resume,
        attempts_after_resume,
        job: db.job().await,
        transcript: zombie.transcript(),
        label,
    };
    db.cleanup().await;
    run
}

/// What one run of the heartbeat scenario observed.
#[derive(Debug)]
pub struct HeartbeatRun {
    pub label: String,
    /// The new owner's lease end right after its claim (database clock, ms).
    pub new_lease_until: i64,
    /// The job's lease end after the zombie's heartbeat ran.
    pub lease_until_after: i64,
    pub owner_after: Option<String>,
    pub epoch_after: i64,
    /// What the zombie's post-resume heartbeat reported: `heartbeat lost epoch=1` or `heartbeat renewed …`.
    pub zombie_heartbeat: String,
    pub zombie_outcome: String,
    pub transcript: String,
}

/// The zombie is frozen inside a blocking step; the new owner claims (and deliberately sends no
/// heartbeat, so only a foreign write could move its lease end); a second later the zombie is
/// resumed but kept in its blocking step until its heartbeat task — on another thread — has run
/// its overdue tick with the old epoch. That heartbeat must not extend the new owner's lease.
pub async fn heartbeat_run(backend: Backend, zombie_guards: &[&str]) -> HeartbeatRun {
    let label = format!("{backend} heartbeat {zombie_guards:?}");
    let db = Db::new(backend).await;
    let mut zombie = Zombie::spawn(&label, &db, None, "gate", zombie_guards);
    zombie.wait_for("gate", Duration::from_secs(20)).await;
    zombie.stop();
    let new_store = db.fence(Guards::default()).await.store();
    let lease2 = take_over(&new_store, &Owner::new(NEW_OWNER).expect("owner"), Duration::from_secs(10)).await;
    let new_lease_until = db.job().await.lease_until.expect("running").0;
    assert_eq!(new_lease_until, lease2.lease_until.0);
    // Let a second of the new owner's lease pass, so that a wrongly accepted heartbeat would
    // visibly push its end out (by about that second).
    tokio::time::sleep(Duration::from_secs(1)).await;

    let resumed = zombie.cont();
    let (_, hb) = zombie.wait_for_after("heartbeat", Some(resumed), Duration::from_secs(3)).await;
    let after = db.job().await;
    zombie.open_gate().await;
    zombie.wait_for("outcome=", Duration::from_secs(10)).await;
    let code = zombie.finish(Duration::from_secs(10)).await;
    assert_eq!(code, 0, "[{label}] worker exit code\n{}", zombie.transcript());
    let run = HeartbeatRun {
        new_lease_until,
        lease_until_after: after.lease_until.map_or(0, |t| t.0),
        owner_after: after.owner.clone(),
        epoch_after: after.epoch,
        zombie_heartbeat: hb,
        zombie_outcome: zombie.outcome().unwrap_or_default(),
        transcript: zombie.transcript(),
        label,
    };
    db.cleanup().await;
    run
}

/// A TCP proxy in front of PostgreSQL, so a test can cut a worker's database connections.
pub struct Proxy {
    /// The database URL through the proxy.
    pub url: String,
    accept: tokio::task::JoinHandle<()>,
    conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Proxy {
    pub async fn start(db_url: &str) -> Proxy {
        let rest_at = db_url.find("://").map_or(0, |i| i + 3);
        let end = db_url[rest_at..].find(['/', '?']).map_or(db_url.len(), |i| rest_at + i);
        let host_at = db_url[rest_at..end].rfind('@').map_or(rest_at, |i| rest_at + i + 1);
        let hostport = &db_url[host_at..end];
        let upstream = if hostport.contains(':') { hostport.to_owned() } else { format!("{hostport}:5432") };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>> = Arc::default();
        let tracked = Arc::clone(&conns);
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let upstream = upstream.clone();
                let pipe = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                tracked.lock().expect("conns").push(pipe);
            }
        });
        Proxy { url: format!("{}{addr}{}", &db_url[..host_at], &db_url[end..]), accept, conns }
    }

    /// Closes the listener and every proxied connection: the database is gone for the worker.
    pub fn cut(&self) -> Instant {
        self.accept.abort();
        for pipe in self.conns.lock().expect("conns").drain(..) {
            pipe.abort();
        }
        Instant::now()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
    }
}
