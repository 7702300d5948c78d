//! The zombie on Redis Streams, as a real second OS process (`examples/redis_worker.rs`, run by
//! this test binary re-executing itself), frozen with SIGSTOP past its lease while it calls the
//! receiver, in both orderings of the receiver table:
//!
//! | case                                 | zombie's receiver call    | zombie's commit | final state |
//! |--------------------------------------|---------------------------|-----------------|-------------|
//! | new owner reaches the receiver first | rejected (409)            | none            | epoch 2, new owner's result |
//! | zombie reaches the receiver first    | accepted, then superseded | none            | epoch 2, new owner's result |
//!
//! The receiver is an axum server in this test with a fence ledger (PostgreSQL). It freezes the
//! zombie itself the moment the zombie's call arrives — before deciding it (new owner first: the
//! call is held until the new owner's has been accepted, like a slow network) or right after
//! accepting it (zombie first). The new owner runs in this process: it auto-claims the entry once
//! it has been idle past the visibility hint, gets epoch 2 from the database, and commits.
#![cfg(feature = "redis")]

use brokerfence_testkit::redis as redis_support;

#[allow(dead_code)]
#[path = "../../examples/redis_worker.rs"]
mod redis_worker;

use std::collections::HashMap;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use brokerfence::ledger::{Ledger, PgLedger, Verdict};
use brokerfence::redis::client;
use brokerfence::redis::{KeyFrom, StreamSource, lease_key};
use brokerfence::wire::FenceStamp;
use brokerfence::{JobContext, JobError, JobKey, JobState, QueueName};
use brokerfence_testkit::process::signal;
use redis_support::*;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::Notify;

/// Environment variable that turns this test binary into the worker process.
const WORKER_ENV: &str = "BROKERFENCE_REDIS_WORKER_ARGS";
const KEY: &str = "order-7";
const ZOMBIE: &str = "zombie";
const NEW_OWNER: &str = "new-owner";

/// Not a test: the entry point of the worker process. In a normal test run it returns at once.
#[test]
fn worker_entry() {
    if let Some(args) = brokerfence_testkit::process::reexec_args(WORKER_ENV) {
        std::process::exit(redis_worker::run(args));
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Order {
    NewOwnerFirst,
    ZombieFirst,
}

/// One decided call: (owner, epoch, status), in the order the receiver decided them.
type Calls = Arc<Mutex<Vec<(String, i64, u16)>>>;

struct Rx {
    ledger: Ledger,
    order: Order,
    zombie_pid: AtomicI32,
    stopped_at: Mutex<Option<Instant>>,
    new_owner_accepted: Notify,
    calls: Calls,
    effects: Mutex<Vec<(i64, String)>>,
}

async fn apply(State(rx): State<Arc<Rx>>, headers: HeaderMap, body: String) -> (StatusCode, String) {
    let pairs = headers.iter().filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?)));
    let stamp = match FenceStamp::from_headers(pairs) {
        Ok(s) => s,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_json()),
    };
    let owner = stamp.owner.clone().unwrap_or_default();
    let is_zombie = owner == ZOMBIE;
    let freeze = |rx: &Rx| {
        signal(rx.zombie_pid.load(Ordering::SeqCst), libc::SIGSTOP);
        *rx.stopped_at.lock().expect("stopped_at") = Some(Instant::now());
    };
    if is_zombie && rx.order == Order::NewOwnerFirst {
        // Freeze it mid-call and hold its request until the new owner's call has been accepted.
        freeze(&rx);
        let accepted = rx.new_owner_accepted.notified();
        if tokio::time::timeout(Duration::from_secs(30), accepted).await.is_err() {
            return (StatusCode::SERVICE_UNAVAILABLE, "new owner never came".into());
        }
    }
    let verdict = stamp.accept(&rx.ledger).await;
    let (status, text) = match verdict {
        Ok(Verdict::Accepted { .. }) => {
            rx.effects.lock().expect("effects").push((stamp.epoch, body));
            (StatusCode::OK, "applied".to_owned())
        }
        Ok(Verdict::Stale { newest }) => (StatusCode::CONFLICT, brokerfence::wire::stale_epoch_json(&stamp, newest)),
        Ok(_) => (StatusCode::CONFLICT, brokerfence::wire::epoch_conflict_json(&stamp)),
        Err(e) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    };
    rx.calls.lock().expect("calls").push((owner, stamp.epoch, status.as_u16()));
    if is_zombie && rx.order == Order::ZombieFirst {
        // Accepted: freeze it before it hears so, past its lease.
        freeze(&rx);
    }
    if !is_zombie && status == StatusCode::OK {
        rx.new_owner_accepted.notify_one();
    }
    (status, text)
}

/// The worker process: its `EVENT` lines with arrival times.
struct Worker {
    pid: i32,
    child: tokio::process::Child,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    /// The tasks reading stdout and stderr; they end at end-of-file.
    readers: Vec<tokio::task::JoinHandle<()>>,
}

impl Worker {
    fn spawn(args: &[String]) -> Worker {
        let mut cmd = brokerfence_testkit::process::reexec("stalled_worker::worker_entry", WORKER_ENV, args);
        cmd.env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into()));
        let (mut child, pid) = brokerfence_testkit::process::spawn(cmd.stderr(std::process::Stdio::piped()), "worker");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        let out_lines = Arc::clone(&lines);
        let out = tokio::spawn(async move {
            let mut reader = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                if let Some(event) = line.strip_prefix("EVENT ") {
                    out_lines.lock().expect("lines").push((Instant::now(), event.to_owned()));
                }
            }
        });
        let err_lines = Arc::clone(&lines);
        let err = tokio::spawn(async move {
            let mut reader = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                err_lines.lock().expect("lines").push((Instant::now(), format!("stderr: {line}")));
            }
        });
        Worker { pid, child, lines, readers: vec![out, err] }
    }

    fn find(&self, prefix: &str) -> Option<(Instant, String)> {
        self.lines.lock().expect("lines").iter().find(|(_, l)| l.starts_with(prefix)).cloned()
    }

    fn last(&self, prefix: &str) -> Option<String> {
        self.lines.lock().expect("lines").iter().rev().find(|(_, l)| l.starts_with(prefix)).map(|(_, l)| l.clone())
    }

    async fn wait(&self, prefix: &str, timeout: Duration) -> (Instant, String) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(hit) = self.find(prefix) {
                return hit;
            }
            assert!(Instant::now() < deadline, "no event {prefix:?} within {timeout:?}:\n{}", self.transcript());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn transcript(&self) -> String {
        self.lines.lock().expect("lines").iter().map(|(_, l)| format!("  {l}\n")).collect()
    }

    /// SIGTERM, then the counters of its final `stopped` line.
    async fn stop(mut self) -> HashMap<String, u64> {
        signal(self.pid, libc::SIGTERM);
        match tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await {
            Ok(Ok(status)) => assert!(status.success(), "worker exited with {status}:\n{}", self.transcript()),
            other => panic!("worker did not exit: {other:?}\n{}", self.transcript()),
        }
        // Its last lines may still be in the pipes: read them to the end first.
        for reader in self.readers.drain(..) {
            assert!(tokio::time::timeout(Duration::from_secs(10), reader).await.is_ok(), "output not read to its end");
        }
        let line = self.last("stopped ").unwrap_or_else(|| panic!("no stopped line:\n{}", self.transcript()));
        line.split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .filter_map(|(k, v)| Some((k.to_owned(), v.parse().ok()?)))
            .collect()
    }
}

async fn run_table(order: Order) {
    let env = Env::new().await;
    let stream = env.name(match order {
        Order::NewOwnerFirst => "zombie-new-first",
        Order::ZombieFirst => "zombie-zombie-first",
    });
    let rx = Arc::new(Rx {
        ledger: Ledger::Pg(PgLedger::new(&env.store, "receiver")),
        order,
        zombie_pid: AtomicI32::new(0),
        stopped_at: Mutex::new(None),
        new_owner_accepted: Notify::new(),
        calls: Arc::default(),
        effects: Mutex::new(Vec::new()),
    });
    let app = axum::Router::new().route("/apply", post(apply)).with_state(Arc::clone(&rx));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind receiver");
    let url = format!("http://{}/apply", listener.local_addr().expect("addr"));
    let server = tokio::spawn(async move { axum::serve(listener, app).await });

    let args: Vec<String> = [
        "--stream",
        &stream,
        "--group",
        "g",
        "--key-field",
        "key",
        "--owner",
        ZOMBIE,
        "--lease",
        "3",
        "--schema",
        env.store.get_schema().as_str(),
        "--receiver-url",
        &url,
        "--concurrency",
        "1",
        "--block",
        "200",
        "--autoclaim-every",
        "200",
        "--grace",
        "200",
        "--redis-url",
        &env.redis_url,
        "--database-url",
        &database_url(),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let zombie = Worker::spawn(&args);
    rx.zombie_pid.store(zombie.pid, Ordering::SeqCst);
    zombie.wait("ready", Duration::from_secs(20)).await;
    let mut conn = env.conn();
    xadd_job(&mut conn, &stream, KEY, "pay 10").await;
    zombie.wait("calling", Duration::from_secs(10)).await;
    let stopped = wait_for("the receiver to freeze the zombie", Duration::from_secs(10), || {
        let at = *rx.stopped_at.lock().expect("stopped_at");
        async move { at }
    })
    .await;

    // The new owner: auto-claims the entry once idle past the hint, gets epoch 2, calls, commits.
    let http = reqwest::Client::new();
    let new_url = url.clone();
    let handler = move |ctx: JobContext| {
        let (http, url) = (http.clone(), new_url.clone());
        async move {
            tokio::time::sleep(Duration::from_millis(1300)).await; // a heartbeat sets its lease key
            let mut req = http.post(url).body(ctx.payload().to_vec());
            for (k, v) in ctx.stamp().to_headers() {
                req = req.header(k, v);
            }
            let status = req.send().await.map_err(JobError::retry)?.status();
            if !status.is_success() {
                return Err(JobError::retry(format!("receiver answered {status}")));
            }
            Ok(format!("{}@{}", ctx.owner(), ctx.epoch()).into_bytes())
        }
    };
    let source =
        StreamSource::new(env.redis.clone(), QueueName::new(stream.as_str()).expect("q"), stream.as_str(), "g")
            .expect("source")
            .key_from(KeyFrom::Field("key".into()))
            .block(Duration::from_millis(200))
            .autoclaim_every(Duration::from_millis(100));
    let new_owner = spawn_consumer(source, env.store(), NEW_OWNER, consumer_config(3, 4), handler);
    let lkey = lease_key(&stream, &QueueName::new(stream.as_str()).expect("q"), &JobKey::new(KEY).expect("key"));
    // A liveness bound, not an assertion on timing: the zombie's 3 s lease must lapse on the
    // database clock, the entry idle past the hint, then a heartbeat set the key; on a loaded
    // 2-core machine (the whole suite running) that took over 10 s once.
    wait_for("the new owner's lease key with epoch 2", Duration::from_secs(30), || {
        let mut c = env.conn();
        let k = lkey.clone();
        async move {
            let v: Option<String> = client::cmd("GET").arg(&k).query_async(&mut c).await.ok()?;
            (v.as_deref() == Some("new-owner:2")).then_some(())
        }
    })
    .await;
    let taken = Instant::now();
    wait_for("the new owner's commit", Duration::from_secs(10), || {
        let (env, stream) = (&env, &stream);
        async move { env.job(stream, KEY).await.filter(|j| j.state == JobState::Completed) }
    })
    .await;
    let committed = Instant::now();

    // Both calls decided (new owner first: the held call of the zombie is answered while it is
    // still frozen; were it resumed first, its disconnect would cancel the held request).
    wait_for("the receiver to decide both calls", Duration::from_secs(10), || {
        let n = rx.calls.lock().expect("calls").len();
        async move { (n == 2).then_some(()) }
    })
    .await;
    // Resume the zombie: it finds its lease lost and its handler is dropped; nothing it does counts.
    signal(zombie.pid, libc::SIGCONT);
    let resumed = Instant::now();
    let (dropped_at, _) = zombie.wait("dropped", Duration::from_secs(5)).await;
    let cancel = dropped_at.duration_since(resumed);
    tokio::time::sleep(Duration::from_millis(1500)).await; // its next heartbeat and receive loop
    let new_metrics = new_owner.shutdown(Duration::from_secs(5)).await;
    let zombie_transcript = zombie.transcript();
    let zm = zombie.stop().await;
    server.abort();

    println!(
        "{order:?}: zombie frozen {:.1} s (lease 3 s); new owner's lease key to its commit {:.1} s; \
         zombie's handler dropped {:.1} ms after SIGCONT",
        resumed.duration_since(stopped).as_secs_f64(),
        committed.duration_since(taken).as_secs_f64(),
        cancel.as_secs_f64() * 1000.0
    );
    let calls = rx.calls.lock().expect("calls").clone();
    let expected: Vec<(String, i64, u16)> = match order {
        Order::NewOwnerFirst => vec![(NEW_OWNER.into(), 2, 200), (ZOMBIE.into(), 1, 409)],
        Order::ZombieFirst => vec![(ZOMBIE.into(), 1, 200), (NEW_OWNER.into(), 2, 200)],
    };
    assert_eq!(
        calls, expected,
        "receiver table, {order:?}; new owner {new_metrics}; zombie {zm:?}\n{zombie_transcript}"
    );
    let effects = rx.effects.lock().expect("effects").clone();
    assert_eq!(effects.last().map(|(e, _)| *e), Some(2), "the newest effect is epoch 2: {effects:?}");
    let job = env.job(&stream, KEY).await.expect("job");
    assert_eq!((job.state, job.epoch), (JobState::Completed, 2));
    assert_eq!(job.result.as_deref(), Some(&b"new-owner@2"[..]), "the new owner's result");
    assert_eq!(
        rx.ledger.newest(&FenceStamp::new(stream.as_str(), KEY, 2).ledger_job()).await.expect("newest"),
        Some(2)
    );
    // The zombie committed nothing and never reached XACK.
    let get = |k: &str| zm.get(k).copied().unwrap_or(0);
    assert_eq!((get("completions"), get("acks")), (0, 0), "zombie: {zm:?}\n{zombie_transcript}");
    assert!(get("lease_losses") + get("fenced_rejections") >= 1, "zombie: {zm:?}");
    assert_eq!((new_metrics.completions, new_metrics.acks), (1, 1), "{new_metrics}");
    assert!(cancel < Duration::from_millis(2000), "cancelled {cancel:?} after SIGCONT");
    assert_eq!(pending_count(&mut conn, &stream, "g").await, 0);
    let holder: Option<String> = client::cmd("GET").arg(&lkey).query_async(&mut conn).await.expect("GET");
    assert_eq!(holder, None, "lease key released by the new owner; the zombie's stale release touched nothing else");
    env.cleanup().await;
}

/// New owner first: the zombie's call is refused, its commit never happens.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn zombie_process_new_owner_reaches_the_receiver_first() {
    run_table(Order::NewOwnerFirst).await;
}

/// Zombie first: its call is accepted, then superseded by epoch 2; its commit never happens.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn zombie_process_reaches_the_receiver_first() {
    run_table(Order::ZombieFirst).await;
}
