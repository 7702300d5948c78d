//! Shared machinery of the zombie proof tests (`tests/supervisor/proof.rs`, `tests/supervisor/guard_switches.rs`,
//! `tests/supervisor/stalled_own_tx.rs`; feature `http`): a fresh database per scenario (PostgreSQL
//! schema or SQLite file), an HTTP receiver that uses the fence middleware and records every call,
//! the zombie worker as a real OS process that the tests freeze with SIGSTOP and resume with
//! SIGCONT ([`process`]), and the scenarios of the table ([`scenarios`]).
//!
//! The zombie process is the test binary itself, re-executed in worker mode: its entry point
//! (`tests/zombie_support/mod.rs`, test `zombie_support::worker_entry`) runs
//! `examples/zombie_worker.rs`, compiled into the test, so a test run never runs a
//! stale or missing example binary. That entry is the one piece that must stay in the test binary.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::post;
use brokerfence::http::{AcceptedStamp, EpochGuard, stamp_from_headers};
use brokerfence::ledger::{Ledger, PgLedger, SqliteLedger};
use brokerfence::wire::FenceStamp;
use brokerfence::{
    Claim, FenceStore, JobKey, JobRecord, Lease, LeaseDuration, MetricsSnapshot, Outcome, Owner, PgFence, QueueName,
    SchemaName, SqliteFence, Supervisor, SupervisorConfig,
};
use fence::Guards;

pub mod pg_proxy;
pub mod process;
pub mod scenarios;

pub use pg_proxy::Proxy;
pub use process::{Zombie, field, proc_state};
pub use scenarios::*;

/// Environment variable that turns the test binary into a zombie worker process (read by its
/// `worker_entry`).
pub const WORKER_ENV: &str = "BROKERFENCE_ZOMBIE_WORKER_ARGS";
/// The lease of every scenario: the minimum, so heartbeats run every second.
pub const LEASE_SECS: u64 = 3;
pub const QUEUE: &str = "payments";
pub const KEY: &str = "order-7";
pub const NEW_OWNER: &str = "new-owner";
pub const NEW_OWNER_RESULT: &str = "result of new-owner";

/// The test that is the worker's entry point: the test binary runs it alone in worker mode.
pub const WORKER_ENTRY: &str = "zombie_support::worker_entry";

/// The lease of every scenario ([`LEASE_SECS`]).
pub fn lease() -> LeaseDuration {
    crate::store::lease(LEASE_SECS)
}

/// The two stores a scenario runs on.
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

async fn open_fence(backend: Backend, url: &str, schema: &SchemaName, guards: Guards) -> AnyFence {
    match backend {
        Backend::Postgres => AnyFence::Pg(crate::store::pg_on(schema.clone()).await.guards(guards)),
        Backend::Sqlite => {
            let f = SqliteFence::open(url).await.expect("open sqlite").schema(schema.clone());
            AnyFence::Sqlite(f.guards(guards))
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
            Backend::Postgres => (crate::store::database_url(), crate::store::unique_schema(), None),
            Backend::Sqlite => {
                let path = crate::store::sqlite_path();
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

    /// The scenario's job row.
    pub async fn job(&self) -> JobRecord {
        let queue = QueueName::new(QUEUE).expect("queue");
        crate::store::job(&*self.admin.store(), &queue, KEY).await.expect("job row exists")
    }

    pub async fn cleanup(&self) {
        match (&self.admin, &self.sqlite_path) {
            (AnyFence::Pg(f), _) => {
                crate::store::drop_schema(f).await;
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

/// Claims the job as the new owner, retrying while the zombie's lease is live.
pub async fn take_over(store: &Arc<dyn FenceStore>, owner: &Owner, timeout: Duration) -> Lease {
    let (q, k) = (QueueName::new(QUEUE).expect("queue"), JobKey::new(KEY).expect("key"));
    let last = Mutex::new(None);
    let claim = || async {
        match store.claim(&q, &k, owner, lease()).await.expect("claim") {
            Claim::Claimed(l) => Some(l),
            other => {
                *last.lock().expect("last claim") = Some(other);
                None
            }
        }
    };
    crate::wait::until(timeout, claim, || {
        format!("no takeover within {timeout:?}: {:?}", last.lock().expect("last claim"))
    })
    .await
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
