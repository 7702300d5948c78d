//! The transactional outbox (issue 13), on real PostgreSQL, LocalStack SQS and Redis.
//!
//! - `effects_outbox_end_to_end_*`: 1,000 jobs through worker processes that are paused (SIGSTOP
//!   past the lease, then SIGCONT) and killed (SIGKILL, restarted) at random, one relay process
//!   killed and restarted twice, every job's outbox rows published to an SQS queue and a Redis
//!   stream, and a downstream consumer (here) that applies each message with
//!   `PgLedger::accept_in` and an idempotent effect row in one transaction.
//! - library tests: partial publish failures leave exactly the refused rows unsent; two relays
//!   side by side never have one row in flight at once (`SKIP LOCKED`); a relay that dies after
//!   the broker accepted a batch publishes it again and the consumer applies it once; a zombie's
//!   transaction leaves no outbox row, and (guard switch `without_fenced_tx_rollback`) a careless
//!   zombie's row shows up when the guard is off.
//!
//! The worker and relay processes are this test binary re-executed (see
//! [`effects_process_entry`]): they run `examples/outbox_relay.rs`, compiled into the test, so the
//! test never runs a stale example binary.

use brokerfence_testkit::redis as redis_support;
use brokerfence_testkit::sqs as sqs_support;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use brokerfence::ledger::PgLedger;
use brokerfence::outbox::OutboxRow;
use brokerfence::outbox::{OutboxRelay, PublishError, Published, Publisher, RelayConfig};
use brokerfence::redis::RedisPublisher;
use brokerfence::redis::client;
use brokerfence::sqs::SqsPublisher;
use brokerfence::wire::FenceStamp;
use brokerfence::{Claim, FenceStore, JobKey, LeaseDuration, Owner, PgFence, QueueName};
use sqlx::AssertSqlSafe;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio_util::sync::CancellationToken;

#[path = "../../examples/outbox_relay.rs"]
#[allow(dead_code)]
mod outbox_relay;

/// Environment variable that turns this test binary into an example process.
const PROCESS_ENV: &str = "BROKERFENCE_OUTBOX_PROCESS_ARGS";

/// Not a test: the entry point of the worker and relay processes. In a normal run it returns.
#[test]
fn effects_process_entry() {
    if let Some(args) = brokerfence_testkit::process::reexec_args(PROCESS_ENV) {
        std::process::exit(outbox_relay::run(args));
    }
}

// ------------------------------------------------------------------------------ processes

/// One example process and the `EVENT` lines it printed.
struct Proc {
    label: String,
    pid: i32,
    child: tokio::process::Child,
    events: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    fn spawn(label: &str, args: &[String]) -> Proc {
        let mut cmd = brokerfence_testkit::process::reexec("outbox::effects_process_entry", PROCESS_ENV, args);
        cmd.envs(sqs_support::aws().child_env()).env("REDIS_URL", redis_support::redis_url());
        cmd.env("RUST_LOG", std::env::var("WORKER_LOG").unwrap_or_else(|_| "warn".into()));
        let (mut child, pid) =
            brokerfence_testkit::process::spawn(cmd.stderr(std::process::Stdio::inherit()), "example");
        let events = Arc::new(Mutex::new(Vec::new()));
        let stdout = child.stdout.take().expect("stdout");
        let sink = Arc::clone(&events);
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(e) = line.strip_prefix("EVENT ") {
                    sink.lock().expect("events").push(e.to_owned());
                }
            }
        });
        Proc { label: label.to_owned(), pid, child, events }
    }

    fn count(&self, name: &str) -> usize {
        self.events.lock().expect("events").iter().filter(|e| e.split(' ').next() == Some(name)).count()
    }

    async fn wait_ready(&self, within: Duration) {
        let deadline = Instant::now() + within;
        while self.count("ready") == 0 {
            assert!(Instant::now() < deadline, "{} not ready within {within:?}", self.label);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn signal(&self, sig: i32) {
        // SAFETY: a signal to our own child process.
        unsafe { libc::kill(self.pid, sig) };
    }

    async fn kill(&mut self) {
        self.signal(libc::SIGCONT);
        self.signal(libc::SIGKILL);
        let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
    }
}

// ------------------------------------------------------------------------------ the downstream consumer

/// The consumer's tables: one effect per (via, job), the outbox id it came with.
async fn create_effects_table(pg: &PgFence) {
    let s = pg.get_schema().as_str();
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {s}.effects (via text NOT NULL, job text NOT NULL, epoch bigint NOT NULL, \
         outbox_id bigint NOT NULL, PRIMARY KEY (via, job))"
    )))
    .execute(pg.pool())
    .await
    .expect("create effects table");
}

/// What the consumer saw.
#[derive(Default)]
struct Downstream {
    deliveries: u64,
    applied: HashMap<(String, String), u32>,
    stale: u64,
}

/// Applies one message: the ledger check and the effect row in one transaction; the effect is
/// idempotent (a re-sent message of the same epoch finds its row and applies nothing).
async fn apply(
    pg: &PgFence,
    ledger: &PgLedger,
    via: &str,
    stamp: &FenceStamp,
    outbox_id: i64,
    seen: &Mutex<Downstream>,
) {
    let s = pg.get_schema().as_str();
    let mut tx = pg.pool().begin().await.expect("begin");
    let verdict = ledger.accept_in(&mut tx, &stamp.ledger_job(), stamp.epoch).await.expect("ledger");
    {
        let mut seen = seen.lock().expect("seen");
        seen.deliveries += 1;
        if !verdict.is_accepted() {
            seen.stale += 1;
        }
    }
    if !verdict.is_accepted() {
        return;
    }
    let inserted = sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {s}.effects (via, job, epoch, outbox_id) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (via, job) DO UPDATE SET epoch = EXCLUDED.epoch, outbox_id = EXCLUDED.outbox_id \
         WHERE {s}.effects.epoch < EXCLUDED.epoch"
    )))
    .bind(via)
    .bind(&stamp.job)
    .bind(stamp.epoch)
    .bind(outbox_id)
    .execute(&mut *tx)
    .await
    .expect("effect")
    .rows_affected();
    tx.commit().await.expect("commit");
    if inserted == 1 {
        *seen.lock().expect("seen").applied.entry((via.to_owned(), stamp.job.clone())).or_default() += 1;
    }
}

async fn consume_sqs(pg: PgFence, url: String, seen: Arc<Mutex<Downstream>>, stop: CancellationToken) {
    let client = sqs_support::sqs().await;
    let ledger = PgLedger::new(&pg, "sqs-consumer");
    while !stop.is_cancelled() {
        for m in sqs_support::receive_raw(&client, &url, 1).await {
            let attrs = m.message_attributes().cloned().unwrap_or_default();
            let get = |n: &str| attrs.get(n).and_then(|a| a.string_value().map(str::to_owned));
            let stamp = FenceStamp::from_lookup(get).expect("stamp on every message");
            let id: i64 = get("Outbox-Id").and_then(|v| v.parse().ok()).expect("outbox id");
            apply(&pg, &ledger, "sqs", &stamp, id, &seen).await;
            if let Some(h) = m.receipt_handle() {
                client.delete_message().queue_url(&url).receipt_handle(h).send().await.expect("delete");
            }
        }
    }
}

async fn consume_redis(pg: PgFence, stream: String, seen: Arc<Mutex<Downstream>>, stop: CancellationToken) {
    let mut conn = redis_support::connect(&redis_support::redis_url()).await;
    let ledger = PgLedger::new(&pg, "redis-consumer");
    let mut cursor = "0-0".to_owned();
    while !stop.is_cancelled() {
        type Reply = Option<Vec<(String, Vec<(String, Vec<Vec<u8>>)>)>>;
        let reply: Reply = client::cmd("XREAD")
            .arg("COUNT")
            .arg(200)
            .arg("STREAMS")
            .arg(&stream)
            .arg(&cursor)
            .query_async(&mut conn)
            .await
            .expect("XREAD");
        let Some(reply) = reply else {
            // Not blocking: the connection's response timeout is short.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        for (_, entries) in reply {
            for (id, flat) in entries {
                let fields: Vec<(Vec<u8>, Vec<u8>)> =
                    flat.chunks(2).map(|c| (c[0].clone(), c.get(1).cloned().unwrap_or_default())).collect();
                let get = |n: &str| redis_support::field_of(&fields, n);
                let stamp = FenceStamp::from_lookup(get).expect("stamp on every entry");
                let outbox_id: i64 = get("Outbox-Id").and_then(|v| v.parse().ok()).expect("outbox id");
                apply(&pg, &ledger, "redis", &stamp, outbox_id, &seen).await;
                cursor = id;
            }
        }
    }
}

// ------------------------------------------------------------------------------ end to end

fn args(sub: &str, pg: &PgFence, extra: &[&str]) -> Vec<String> {
    let mut v = vec![sub.to_owned(), "--schema".to_owned(), pg.get_schema().as_str().to_owned()];
    v.extend(extra.iter().map(|s| (*s).to_owned()));
    v
}

async fn completed(pg: &PgFence, queue: &str) -> i64 {
    let s = pg.get_schema().as_str();
    sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*)::bigint FROM {s}.jobs WHERE queue = $1 AND state = 'completed'"
    )))
    .bind(queue)
    .fetch_one(pg.pool())
    .await
    .expect("count")
}

/// Covers: the outbox row commits with the fenced completion or not at all (a zombie's
/// transaction rolls back), the relay marks a row sent only after the broker accepted it, and a
/// relay killed mid-round re-publishes what it had not marked (consumers deduplicate with the
/// ledger and an idempotent effect).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_outbox_end_to_end_with_zombies_kills_and_relay_restarts() {
    const JOBS: usize = 1000;
    const WORKERS: usize = 4;
    let env = redis_support::Env::new().await;
    let pg = env.store.clone();
    let sqs = sqs_support::sqs().await;
    let queue_sqs = sqs_support::TestQueue::new(&sqs, "effects-outbox", 30).await;
    let stream = env.name("effects-outbox");
    outbox_relay::create_business_table(&pg).await.expect("business table");
    create_effects_table(&pg).await;
    let queue = "effects-outbox";
    let q = QueueName::new(queue).expect("queue");
    let jobs: Vec<(JobKey, Vec<u8>)> =
        (0..JOBS).map(|i| (JobKey::new(format!("job-{i:04}")).expect("key"), b"p".to_vec())).collect();
    assert_eq!(pg.enqueue_many(&q, &jobs).await.expect("enqueue"), JOBS as u64);

    let worker_args =
        args("worker", &pg, &["--queue", queue, "--destination", "billing", "--destination", "audit", "--lease", "3"]);
    let worker_args: Vec<String> = worker_args
        .into_iter()
        .chain(
            ["--concurrency", "4", "--handler-delay", "300", "--in-tx-delay", "150", "--idle-wait", "50"]
                .map(String::from),
        )
        .collect();
    let sqs_route = format!("billing={}", queue_sqs.url);
    let redis_route = format!("audit={stream}");
    let relay_args =
        args("relay", &pg, &["--sqs", &sqs_route, "--redis", &redis_route, "--batch", "20", "--idle-wait", "50"]);

    let seen = Arc::new(Mutex::new(Downstream::default()));
    let stop = CancellationToken::new();
    let consumers = [
        tokio::spawn(consume_sqs(pg.clone(), queue_sqs.url.clone(), Arc::clone(&seen), stop.clone())),
        tokio::spawn(consume_redis(pg.clone(), stream.clone(), Arc::clone(&seen), stop.clone())),
    ];

    let started = Instant::now();
    let mut workers: Vec<Proc> = (0..WORKERS).map(|i| Proc::spawn(&format!("worker-{i}"), &worker_args)).collect();
    let mut relay = Some(Proc::spawn("relay-0", &relay_args));
    for w in &workers {
        w.wait_ready(Duration::from_secs(30)).await;
    }
    if let Some(r) = &relay {
        r.wait_ready(Duration::from_secs(30)).await;
    }

    // Chaos until every job completed. The relay is killed at 4 s and restarted 3 s later, when
    // a backlog has built up; killed again as soon as it committed its first round of that
    // backlog (the next round is then likely between its publish and its commit), and
    // restarted. Every 1-2 s a random worker is either paused past its lease (4.5 s) or killed
    // and restarted.
    let mut relay_down_since = Instant::now();
    let (mut stops, mut kills, mut relay_kills, mut retired) = (0, 0, 0, Vec::new());
    let mut next_chaos = Instant::now() + Duration::from_secs(1);
    let mut paused: Vec<(usize, Instant)> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(90);
    while completed(&pg, queue).await < JOBS as i64 {
        assert!(Instant::now() < deadline, "jobs did not complete in time: {} of {JOBS}", completed(&pg, queue).await);
        let elapsed = started.elapsed();
        match (relay_kills, relay.as_ref()) {
            (0, Some(_)) if elapsed > Duration::from_secs(4) => {
                let mut old = relay.take().expect("relay");
                old.kill().await;
                retired.push(old);
                relay_kills = 1;
                relay_down_since = Instant::now();
            }
            (1, None) if relay_down_since.elapsed() > Duration::from_secs(3) => {
                relay = Some(Proc::spawn("relay-1", &relay_args));
            }
            (1, Some(r)) if r.count("published") > 0 => {
                let mut old = relay.take().expect("relay");
                old.kill().await;
                retired.push(old);
                relay_kills = 2;
                relay = Some(Proc::spawn("relay-2", &relay_args));
            }
            _ => {}
        }
        paused.retain(|(i, until)| {
            if Instant::now() >= *until {
                workers[*i].signal(libc::SIGCONT);
                false
            } else {
                true
            }
        });
        if Instant::now() >= next_chaos {
            let i = rand::random_range(0..WORKERS);
            if !paused.iter().any(|(p, _)| *p == i) {
                if rand::random_bool(0.5) {
                    workers[i].signal(libc::SIGSTOP);
                    paused.push((i, Instant::now() + Duration::from_millis(4500)));
                    stops += 1;
                } else {
                    workers[i].kill().await;
                    kills += 1;
                    let old =
                        std::mem::replace(&mut workers[i], Proc::spawn(&format!("worker-{i}-{kills}"), &worker_args));
                    retired.push(old);
                }
            }
            next_chaos = Instant::now() + Duration::from_millis(rand::random_range(1000..2000));
        }
        let tick = if relay_kills == 1 { 5 } else { 100 };
        tokio::time::sleep(Duration::from_millis(tick)).await;
    }
    for (i, _) in paused.drain(..) {
        workers[i].signal(libc::SIGCONT);
    }
    let jobs_done = started.elapsed();
    if relay.is_none() {
        relay = Some(Proc::spawn("relay-last", &relay_args));
    }

    // Everything published and applied downstream.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (unsent, applied) = (pg.outbox_unsent().await.expect("unsent"), seen.lock().expect("seen").applied.len());
        if unsent == 0 && applied >= 2 * JOBS {
            break;
        }
        assert!(Instant::now() < deadline, "downstream incomplete: unsent {unsent}, applied {applied} of {}", 2 * JOBS);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let all_done = started.elapsed();
    // A little longer, so that late duplicates would show.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.cancel();
    for c in consumers {
        let _ = c.await;
    }
    for p in workers.iter_mut().chain(relay.iter_mut()).chain(retired.iter_mut()) {
        p.kill().await;
    }

    // The database: each job completed once; its business row and its outbox rows are of its
    // final epoch and there is one of each.
    let s = pg.get_schema().as_str();
    let finals: HashMap<String, i64> =
        sqlx::query_as::<_, (String, i64)>(AssertSqlSafe(format!("SELECT key, epoch FROM {s}.jobs WHERE queue = $1")))
            .bind(queue)
            .fetch_all(pg.pool())
            .await
            .expect("jobs")
            .into_iter()
            .collect();
    assert_eq!(finals.len(), JOBS);
    let business: Vec<(String, i64)> =
        sqlx::query_as(AssertSqlSafe(format!("SELECT key, epoch FROM {s}.outbox_example_orders")))
            .fetch_all(pg.pool())
            .await
            .expect("business rows");
    assert_eq!(business.len(), JOBS, "one business row per job");
    for (key, epoch) in &business {
        assert_eq!(Some(epoch), finals.get(key), "business row of {key} is not of its final epoch");
    }
    let outbox: Vec<(String, String, i64)> =
        sqlx::query_as(AssertSqlSafe(format!("SELECT key, destination, epoch FROM {s}.outbox")))
            .fetch_all(pg.pool())
            .await
            .expect("outbox rows");
    assert_eq!(outbox.len(), 2 * JOBS, "one outbox row per job and destination");
    let distinct: HashSet<(&str, &str)> = outbox.iter().map(|(k, d, _)| (k.as_str(), d.as_str())).collect();
    assert_eq!(distinct.len(), 2 * JOBS);
    for (key, _, epoch) in &outbox {
        assert_eq!(Some(epoch), finals.get(key), "outbox row of {key} is from a fenced attempt");
    }

    // Downstream: every job's effect applied exactly once per broker, at its final epoch.
    let (deliveries, stale, applied) = {
        let seen = seen.lock().expect("seen");
        (seen.deliveries, seen.stale, seen.applied.clone())
    };
    for ((via, job), n) in &applied {
        assert_eq!(*n, 1, "{via} applied {job} {n} times");
    }
    let effects: Vec<(String, String, i64)> =
        sqlx::query_as(AssertSqlSafe(format!("SELECT via, job, epoch FROM {s}.effects")))
            .fetch_all(pg.pool())
            .await
            .expect("effects");
    assert_eq!(effects.len(), 2 * JOBS);
    for (via, job, epoch) in &effects {
        let key = job.rsplit('/').next().unwrap_or(job);
        assert_eq!(Some(epoch), finals.get(key), "{via} effect of {job} not at the final epoch");
    }
    let takeovers = finals.values().filter(|e| **e > 1).count();
    let rolled_back: usize = workers.iter().chain(retired.iter()).map(|p| p.count("rolled_back")).sum();
    eprintln!(
        "effects_outbox: {JOBS} jobs in {jobs_done:?}, all published and applied after {all_done:?}; \
         {stops} pauses, {kills} worker kills, {relay_kills} relay kills; {takeovers} jobs completed at epoch > 1, \
         {rolled_back} handler transactions rolled back (fenced or cancelled); {deliveries} deliveries downstream \
         for {} effects ({stale} stale)",
        effects.len(),
    );
    assert!(stops + kills > 0 && relay_kills == 2, "the chaos ran");
    assert!(takeovers > 0, "some jobs were taken over from paused or killed workers");
    queue_sqs.delete(&sqs).await;
    env.cleanup().await;
}

// ------------------------------------------------------------------------------ library tests

/// Claims `n` jobs of a fresh queue and writes, for each, an outbox row to `destination` and its
/// completion in one transaction.
async fn outbox_rows(pg: &PgFence, n: usize, destination: &str, payload: &[u8]) -> Vec<i64> {
    let q = QueueName::new(sqs_support::unique("effects-q")).expect("queue");
    let me = Owner::unique("effects");
    let lease = LeaseDuration::from_secs(30).expect("lease");
    let mut ids = Vec::new();
    for i in 0..n {
        let key = JobKey::new(format!("k{i}")).expect("key");
        let Claim::Claimed(l) = pg.claim(&q, &key, &me, lease).await.expect("claim") else { panic!("claim") };
        let mut tx = pg.pool().begin().await.expect("begin");
        ids.push(pg.outbox_in(&mut tx, &l, destination, payload).await.expect("outbox_in"));
        pg.complete_in(&mut tx, &l, b"done").await.expect("complete_in");
        tx.commit().await.expect("commit");
    }
    ids
}

async fn unsent_ids(pg: &PgFence) -> Vec<i64> {
    let s = pg.get_schema().as_str();
    sqlx::query_scalar(AssertSqlSafe(format!("SELECT id FROM {s}.outbox WHERE sent_at IS NULL ORDER BY id")))
        .fetch_all(pg.pool())
        .await
        .expect("unsent")
}

/// A publisher that accepts the rows `accept` says yes to, records what it accepted, and checks
/// that no row is ever being published by two calls at once.
struct Recording {
    accept: Box<dyn Fn(i64) -> bool + Send + Sync>,
    delay: Duration,
    in_flight: Mutex<HashSet<i64>>,
    accepted: Mutex<Vec<i64>>,
    overlaps: Mutex<Vec<i64>>,
}

impl Recording {
    fn new(delay: Duration, accept: impl Fn(i64) -> bool + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(Self {
            accept: Box::new(accept),
            delay,
            in_flight: Mutex::default(),
            accepted: Mutex::default(),
            overlaps: Mutex::default(),
        })
    }
}

#[async_trait]
impl Publisher for Recording {
    fn serves(&self, destination: &str) -> bool {
        destination == "recorded"
    }

    async fn publish(&self, rows: &[OutboxRow]) -> Result<Published, PublishError> {
        for r in rows {
            if !self.in_flight.lock().expect("in flight").insert(r.id) {
                self.overlaps.lock().expect("overlaps").push(r.id);
            }
        }
        tokio::time::sleep(self.delay).await;
        let mut out = Published::default();
        for r in rows {
            self.in_flight.lock().expect("in flight").remove(&r.id);
            if (self.accept)(r.id) {
                out.accepted.push(r.id);
            } else {
                out.failed.push((r.id, PublishError::Broker("refused by the test".into())));
            }
        }
        self.accepted.lock().expect("accepted").extend(&out.accepted);
        Ok(out)
    }
}

/// Covers: only rows the broker accepted are marked sent. Real brokers and a scripted one:
/// rows for a queue that does not exist, a payload SQS cannot carry, a destination nobody serves
/// and rows the scripted broker refuses stay unsent; the rest are sent and not sent again.
#[tokio::test]
async fn effects_outbox_partial_publish_failure_leaves_rows_unsent() {
    let env = redis_support::Env::new().await;
    let pg = env.store.clone();
    let sqs = sqs_support::sqs().await;
    let queue = sqs_support::TestQueue::new(&sqs, "effects-partial", 30).await;
    let missing = format!("{}-missing", queue.url);
    let stream = env.name("effects-partial");
    let to_redis = outbox_rows(&pg, 5, "audit", b"r").await;
    let to_sqs = outbox_rows(&pg, 5, "billing", b"s").await;
    let to_missing_queue = outbox_rows(&pg, 2, "gone", b"m").await;
    let not_utf8 = outbox_rows(&pg, 1, "billing", &[0xff, 0xfe]).await;
    let no_route = outbox_rows(&pg, 1, "nowhere", b"n").await;
    let recorded = outbox_rows(&pg, 6, "recorded", b"x").await;
    let odd_refused = Recording::new(Duration::ZERO, |id| id % 2 == 0);
    let relay = OutboxRelay::new(pg.clone(), RelayConfig::default())
        .publisher(Arc::new(SqsPublisher::new(sqs.clone()).route("billing", &queue.url).route("gone", &missing)))
        .publisher(Arc::new(RedisPublisher::new(env.redis.clone()).route("audit", &stream)))
        .publisher(odd_refused.clone());
    let round = relay.relay_once().await.expect("round");
    assert_eq!(round.claimed, 20);
    let refused: Vec<i64> = recorded.iter().copied().filter(|id| id % 2 == 1).collect();
    let mut want_unsent: Vec<i64> =
        to_missing_queue.iter().chain(&not_utf8).chain(&no_route).chain(&refused).copied().collect();
    want_unsent.sort_unstable();
    assert_eq!(unsent_ids(&pg).await, want_unsent, "exactly the refused rows stay unsent");
    let mut sent: Vec<i64> = round.sent.iter().map(|r| r.id).collect();
    sent.sort_unstable();
    let mut want_sent: Vec<i64> =
        to_redis.iter().chain(&to_sqs).chain(recorded.iter().filter(|id| *id % 2 == 0)).copied().collect();
    want_sent.sort_unstable();
    assert_eq!(sent, want_sent);
    assert_eq!(redis_support::xrange(&mut env.conn(), &stream).await.len(), 5, "five entries in the stream");
    let got = sqs_support::drain(&sqs, &queue.url, 5, Duration::from_secs(10)).await;
    assert_eq!(got.len(), 5, "five messages in the queue");
    for m in &got {
        let attrs = m.message_attributes().cloned().unwrap_or_default();
        let stamp =
            FenceStamp::from_lookup(|n| attrs.get(n).and_then(|a| a.string_value().map(str::to_owned))).expect("stamp");
        assert_eq!(stamp.epoch, 1);
    }

    // A second round sends none of the sent rows again; the refused ones are tried again.
    let round = relay.relay_once().await.expect("round");
    assert_eq!(round.claimed, want_unsent.len());
    assert!(round.sent.is_empty());
    assert_eq!(redis_support::xrange(&mut env.conn(), &stream).await.len(), 5);
    let accepted = odd_refused.accepted.lock().expect("accepted").clone();
    assert_eq!(accepted.len(), 3, "each accepted row published once: {accepted:?}");
    queue.delete(&sqs).await;
    env.cleanup().await;
}

/// Covers: `FOR UPDATE SKIP LOCKED` in the relay's claim. Two relays run side by side on one
/// outbox with a slow broker: no row is ever in flight in both, every row is published once, and
/// both relays did part of the work.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_outbox_two_relays_never_publish_the_same_row_concurrently() {
    let pg = sqs_support::pg().await;
    let ids = outbox_rows(&pg, 300, "recorded", b"x").await;
    let broker = Recording::new(Duration::from_millis(30), |_| true);
    let config = RelayConfig::default().batch(20);
    let relays: Vec<OutboxRelay> =
        (0..2).map(|_| OutboxRelay::new(pg.clone(), config).publisher(broker.clone())).collect();
    let tasks: Vec<_> = relays
        .into_iter()
        .map(|relay| {
            tokio::spawn(async move {
                let mut sent = 0;
                loop {
                    let round = relay.relay_once().await.expect("round");
                    if round.claimed == 0 {
                        return sent;
                    }
                    sent += round.sent.len();
                }
            })
        })
        .collect();
    let mut per_relay = Vec::new();
    for t in tasks {
        per_relay.push(t.await.expect("relay task"));
    }
    assert!(broker.overlaps.lock().expect("overlaps").is_empty(), "a row was in flight in two relays");
    let mut accepted = broker.accepted.lock().expect("accepted").clone();
    accepted.sort_unstable();
    assert_eq!(accepted, ids, "every row published exactly once");
    assert!(per_relay.iter().all(|n| *n > 0), "both relays published: {per_relay:?}");
    assert_eq!(pg.outbox_unsent().await.expect("unsent"), 0);
    sqs_support::drop_schema(&pg).await;
}

/// A zombie and its successor on one job: the zombie (its lease run out, as if it had been paused
/// past it) writes its outbox row and then calls `complete_in`; a careless zombie ignores the
/// `Fenced` answer and commits anyway. Then the new owner writes its row and completes. Returns
/// the outbox rows (epoch, payload) and the two epochs.
async fn zombie_and_successor(pg: &PgFence, careless: bool) -> (Vec<(i64, Vec<u8>)>, i64, i64) {
    let q = QueueName::new("effects-zombie").expect("queue");
    let key = JobKey::new("order-7").expect("key");
    let lease = LeaseDuration::from_secs(30).expect("lease");
    let Claim::Claimed(old) = pg.claim(&q, &key, &Owner::unique("zombie"), lease).await.expect("claim") else {
        panic!("claim")
    };
    let s = pg.get_schema().as_str();
    sqlx::query(AssertSqlSafe(format!("UPDATE {s}.jobs SET lease_until = clock_timestamp() - interval '1 second'")))
        .execute(pg.pool())
        .await
        .expect("expire");
    let Claim::Claimed(new) = pg.claim(&q, &key, &Owner::unique("new"), lease).await.expect("claim") else {
        panic!("takeover")
    };
    assert_eq!(new.epoch, old.epoch + 1);
    let mut tx = pg.pool().begin().await.expect("begin");
    pg.outbox_in(&mut tx, &old, "billing", b"zombie").await.expect("outbox_in writes, unchecked");
    let err = pg.complete_in(&mut tx, &old, b"zombie").await.expect_err("the zombie is fenced");
    assert!(err.is_fenced());
    if careless {
        let _ = tx.commit().await;
    } else {
        drop(tx);
    }
    let mut tx = pg.pool().begin().await.expect("begin");
    pg.outbox_in(&mut tx, &new, "billing", b"new").await.expect("outbox_in");
    pg.complete_in(&mut tx, &new, b"new").await.expect("complete_in");
    tx.commit().await.expect("commit");
    let rows = sqlx::query_as(AssertSqlSafe(format!("SELECT epoch, payload FROM {s}.outbox ORDER BY id")))
        .fetch_all(pg.pool())
        .await
        .expect("outbox");
    (rows, old.epoch, new.epoch)
}

/// Covers: the rollback on a fenced compare-and-set. A superseded attempt writes its outbox row
/// and then fails its `complete_in`: whether it drops its transaction or (carelessly) commits it,
/// the row never exists; the new owner's row does.
#[tokio::test]
async fn effects_outbox_zombie_transaction_leaves_no_outbox_row() {
    for careless in [false, true] {
        let pg = sqs_support::pg().await;
        let (rows, _, new) = zombie_and_successor(&pg, careless).await;
        assert_eq!(rows, vec![(new, b"new".to_vec())], "careless = {careless}");
        sqs_support::drop_schema(&pg).await;
    }
}

/// Guard switch (`without_fenced_tx_rollback`): with the fenced `complete_in` no longer aborting
/// the caller's transaction, a careless zombie that commits after `Fenced` leaves an outbox row
/// of its superseded epoch, which a relay would publish. The test above notices the missing guard.
#[tokio::test]
async fn effects_outbox_guard_off_a_careless_zombie_commits_its_outbox_row() {
    let pg = sqs_support::pg().await;
    let pg = pg.clone().guards(fence::Guards::default().without_fenced_tx_rollback());
    let (rows, old, new) = zombie_and_successor(&pg, true).await;
    assert_eq!(rows, vec![(old, b"zombie".to_vec()), (new, b"new".to_vec())], "the violation shows");
    sqs_support::drop_schema(&pg).await;
}

/// A publisher that publishes through Redis and then cuts the relay's database connection, as a
/// relay process dying between the broker's answer and its own commit would.
struct CrashAfterPublish {
    inner: RedisPublisher,
    pg: PgFence,
}

#[async_trait]
impl Publisher for CrashAfterPublish {
    fn serves(&self, destination: &str) -> bool {
        self.inner.serves(destination)
    }

    async fn publish(&self, rows: &[OutboxRow]) -> Result<Published, PublishError> {
        let out = self.inner.publish(rows).await;
        let cut: Vec<bool> = sqlx::query_scalar(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid() \
             AND state = 'idle in transaction' AND query LIKE '%' || $1 || '.outbox%SKIP LOCKED%'",
        )
        .bind(self.pg.get_schema().as_str())
        .fetch_all(self.pg.pool())
        .await
        .expect("terminate the relay's connection");
        assert_eq!(cut, vec![true], "exactly the relay's transaction was cut");
        out
    }
}

/// Covers: a relay that dies after the broker accepted a batch but before its commit leaves the
/// rows unsent, the next round publishes them again, and the consumer (ledger `accept_in` and an
/// idempotent effect in one transaction) applies each once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn effects_outbox_relay_crash_after_publish_republishes_and_the_consumer_applies_once() {
    let env = redis_support::Env::new().await;
    let pg = env.store.clone();
    create_effects_table(&pg).await;
    let stream = env.name("effects-crash");
    let ids = outbox_rows(&pg, 10, "audit", b"r").await;
    let publisher = RedisPublisher::new(env.redis.clone()).route("audit", &stream);
    let crashing = OutboxRelay::new(pg.clone(), RelayConfig::default())
        .publisher(Arc::new(CrashAfterPublish { inner: publisher.clone(), pg: pg.clone() }));
    assert!(crashing.relay_once().await.is_err(), "the round dies before its commit");
    assert_eq!(unsent_ids(&pg).await, ids, "nothing was marked sent");
    assert_eq!(redis_support::xrange(&mut env.conn(), &stream).await.len(), 10, "yet the broker has them");
    let relay = OutboxRelay::new(pg.clone(), RelayConfig::default()).publisher(Arc::new(publisher));
    assert_eq!(relay.relay_once().await.expect("round").sent.len(), 10);
    assert!(unsent_ids(&pg).await.is_empty());
    let entries = redis_support::xrange(&mut env.conn(), &stream).await;
    assert_eq!(entries.len(), 20, "each row published twice");

    let ledger = PgLedger::new(&pg, "redis-consumer");
    let seen = Mutex::new(Downstream::default());
    for (_, fields) in &entries {
        let get = |n: &str| redis_support::field_of(fields, n);
        let stamp = FenceStamp::from_lookup(get).expect("stamp");
        let id: i64 = get("Outbox-Id").and_then(|v| v.parse().ok()).expect("outbox id");
        apply(&pg, &ledger, "redis", &stamp, id, &seen).await;
    }
    let seen = seen.into_inner().expect("seen");
    assert_eq!(seen.deliveries, 20);
    assert_eq!(seen.applied.len(), 10);
    assert!(seen.applied.values().all(|n| *n == 1), "each effect applied once: {:?}", seen.applied);
    env.cleanup().await;
}

/// Covers (a review finding of issue #34): a relay of this build on a schema older than it needs
/// (migration 13: the outbox has no trace columns) fails each round with
/// `FenceError::SchemaTooOld` naming both versions, not with the SQL error of a missing column,
/// and loses nothing: once migrated, the same relay publishes the row.
#[tokio::test]
async fn effects_outbox_relay_on_an_older_schema_names_it_and_loses_nothing() {
    let fence = brokerfence_testkit::store::pg_unmigrated().await;
    fence.migrate_to(13).await.expect("migrate to version 13");
    let schema = fence.get_schema().as_str().to_owned();
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {schema}.outbox (queue, key, epoch, owner, destination, payload) VALUES ('q', 'k', 1, 'w', 'recorded', 'x')"
    )))
    .execute(fence.pool())
    .await
    .expect("a row written by an older build");
    let recorded = Recording::new(Duration::ZERO, |_| true);
    let relay = OutboxRelay::new(fence.clone(), RelayConfig::default()).publisher(recorded.clone());
    match relay.relay_once().await {
        Err(brokerfence::outbox::RelayError::Database(brokerfence::FenceError::SchemaTooOld { found, required })) => {
            assert_eq!((found, required), (13, PgFence::SCHEMA_VERSION));
        }
        other => panic!("expected SchemaTooOld, got {other:?}"),
    }
    fence.migrate().await.expect("migrate");
    let round = relay.relay_once().await.expect("round after the migration");
    assert_eq!(round.sent.len(), 1, "the row written before is published");
    brokerfence_testkit::store::drop_schema(&fence).await;
}
