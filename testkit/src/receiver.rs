//! A downstream HTTP service for the tests (feature `receiver`): it judges each call's epoch with
//! the fence's ledger (newest wins, equal = the same owner retrying), records what it saw, and can hold calls back
//! to fix the order in which they reach the ledger. [`calling_handler`] is the handler that calls it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use brokerfence::PgFence;
use brokerfence::ledger::{Ledger, PgLedger, Verdict};
use brokerfence::wire::FenceStamp;
use tokio::sync::{Notify, watch};

/// One call the receiver saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub job: String,
    pub epoch: i64,
    pub owner: Option<String>,
    /// Accepted (applied) or refused as stale.
    pub accepted: bool,
}

#[derive(Default)]
struct ReceiverState {
    /// Calls in the order the ledger judged them.
    calls: Vec<Call>,
    /// Arrivals (before judging), in order: (job, epoch).
    arrivals: Vec<(String, i64)>,
    /// The effect per job: the newest accepted (epoch, owner, body).
    effects: HashMap<String, (i64, Option<String>, Vec<u8>)>,
    /// How many times an effect was applied per job.
    applied: HashMap<String, usize>,
}

/// A downstream HTTP service that enforces the epoch with the fence's ledger (newest wins, equal
/// = retry) and records what it saw. It can park calls of one epoch until a newer epoch of the
/// same job was judged, to fix the order in which calls reach the ledger.
#[derive(Clone)]
pub struct Receiver {
    pub url: String,
    state: Arc<Mutex<ReceiverState>>,
    changed: Arc<Notify>,
    park_epoch: Arc<Mutex<Option<i64>>>,
}

struct App {
    ledger: Ledger,
    state: Arc<Mutex<ReceiverState>>,
    changed: Arc<Notify>,
    park_epoch: Arc<Mutex<Option<i64>>>,
    judged: watch::Sender<i64>,
}

impl Receiver {
    /// Starts the receiver on 127.0.0.1 (a random port), its ledger in `fence`'s schema.
    pub async fn start(fence: &PgFence) -> Self {
        let state = Arc::new(Mutex::new(ReceiverState::default()));
        let changed = Arc::new(Notify::new());
        let park_epoch = Arc::new(Mutex::new(None));
        let (judged, _) = watch::channel(0i64);
        let app = Arc::new(App {
            ledger: Ledger::Pg(PgLedger::new(fence, "receiver")),
            state: Arc::clone(&state),
            changed: Arc::clone(&changed),
            park_epoch: Arc::clone(&park_epoch),
            judged,
        });
        let router = axum::Router::new().route("/apply", post(apply)).with_state(app);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind receiver");
        let addr = listener.local_addr().expect("receiver addr");
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        Self { url: format!("http://{addr}/apply"), state, changed, park_epoch }
    }

    /// Calls carrying `epoch` wait until a newer epoch of any job has been judged.
    pub fn park(&self, epoch: i64) {
        if let Ok(mut p) = self.park_epoch.lock() {
            *p = Some(epoch);
        }
    }

    pub fn calls(&self) -> Vec<Call> {
        self.state.lock().map(|s| s.calls.clone()).unwrap_or_default()
    }

    pub fn arrivals(&self) -> Vec<(String, i64)> {
        self.state.lock().map(|s| s.arrivals.clone()).unwrap_or_default()
    }

    /// The effect kept for a job: (epoch, owner).
    pub fn effect(&self, job: &str) -> Option<(i64, Option<String>)> {
        self.state.lock().ok()?.effects.get(job).map(|(e, o, _)| (*e, o.clone()))
    }

    /// How many times an effect was applied for a job.
    pub fn applied(&self, job: &str) -> usize {
        self.state.lock().ok().and_then(|s| s.applied.get(job).copied()).unwrap_or(0)
    }

    pub fn effects_len(&self) -> usize {
        self.state.lock().map(|s| s.effects.len()).unwrap_or(0)
    }

    /// Waits until `cond` holds on the receiver's state.
    pub async fn wait_for(&self, within: Duration, what: &str, cond: impl Fn(&[Call], &[(String, i64)]) -> bool) {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = self.changed.notified();
            if let Ok(s) = self.state.lock()
                && cond(&s.calls, &s.arrivals)
            {
                return;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!("receiver: timed out after {within:?} waiting for {what}; calls: {:?}", self.calls());
            }
        }
    }

    /// The ledger job name of a stamp for (queue, key).
    pub fn job_name(queue: &str, key: &str) -> String {
        FenceStamp::new(queue, key, 1).ledger_job()
    }
}

async fn apply(State(app): State<Arc<App>>, headers: HeaderMap, body: axum::body::Bytes) -> (StatusCode, String) {
    let pairs = headers.iter().filter_map(|(k, v)| v.to_str().ok().map(|v| (k.as_str().to_owned(), v.to_owned())));
    let stamp = match FenceStamp::from_headers(pairs) {
        Ok(s) => s,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_json()),
    };
    let job = stamp.ledger_job();
    if let Ok(mut s) = app.state.lock() {
        s.arrivals.push((job.clone(), stamp.epoch));
    }
    app.changed.notify_waiters();
    let park = app.park_epoch.lock().ok().and_then(|p| *p);
    if park == Some(stamp.epoch) {
        let mut rx = app.judged.subscribe();
        let _ = tokio::time::timeout(Duration::from_secs(60), rx.wait_for(|newest| *newest > stamp.epoch)).await;
    }
    let verdict = match stamp.accept(&app.ledger).await {
        Ok(v) => v,
        Err(e) => return (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    };
    let accepted = verdict.is_accepted();
    if let Ok(mut s) = app.state.lock() {
        s.calls.push(Call { job: job.clone(), epoch: stamp.epoch, owner: stamp.owner.clone(), accepted });
        if accepted {
            s.effects.insert(job.clone(), (stamp.epoch, stamp.owner.clone(), body.to_vec()));
            *s.applied.entry(job.clone()).or_default() += 1;
        }
    }
    app.judged.send_modify(|newest| *newest = (*newest).max(stamp.epoch));
    app.changed.notify_waiters();
    match verdict {
        Verdict::Accepted { .. } => (StatusCode::OK, "applied".into()),
        Verdict::Stale { newest } => (StatusCode::CONFLICT, brokerfence::wire::stale_epoch_json(&stamp, newest)),
        _ => (StatusCode::CONFLICT, brokerfence::wire::epoch_conflict_json(&stamp)),
    }
}

/// The handler the in-process workers of the tests run: calls the receiver with the stamp and
/// commits "owner@epoch" (the same behaviour as `examples/sqs_worker.rs`).
pub fn calling_handler(receiver_url: String) -> impl brokerfence::Handler {
    calling_handler_after(receiver_url, Duration::ZERO)
}

/// [`calling_handler`] that first works for `delay` (a sleep), so that attempts are in flight.
pub fn calling_handler_after(receiver_url: String, delay: Duration) -> impl brokerfence::Handler {
    let http = reqwest::Client::builder().timeout(Duration::from_secs(10)).build().unwrap_or_default();
    move |ctx: brokerfence::JobContext| {
        let http = http.clone();
        let url = receiver_url.clone();
        async move {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let mut req = http.post(&url).body(ctx.payload().to_vec());
            for (k, v) in FenceStamp::from(ctx.lease()).to_headers() {
                req = req.header(k, v);
            }
            let resp = req.send().await.map_err(brokerfence::JobError::retry)?;
            if !resp.status().is_success() {
                return Err(brokerfence::JobError::retry(format!("receiver answered {}", resp.status())));
            }
            Ok(format!("{}@{}", ctx.owner(), ctx.epoch()).into_bytes())
        }
    }
}
