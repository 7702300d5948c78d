//! The Redis adapter end to end against the real Redis and PostgreSQL of `localstack/up`: the
//! Streams source (two consumers, duplicates, the heartbeat that keeps a live entry from being
//! auto-claimed, retries, dead letters, shutdown), the reliable list, and the list retrofit.
//! Every test has its own keys and its own PostgreSQL schema, so they run in parallel.
#![cfg(feature = "redis")]

use brokerfence_testkit::redis as redis_support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use brokerfence::redis::client;
use brokerfence::redis::{ItemKey, KeyFrom, ListRetrofit, ReliableList, StreamSource, token};
use brokerfence::{Claim, JobContext, JobError, JobState, Owner, QueueName, RetryPolicy, SupervisorConfig};
use brokerfence::{Detail, Disposition, Handler};
use redis_support::*;

type Log = Arc<Mutex<Vec<(String, i64, String)>>>;

/// A handler that logs (key, epoch, owner), waits `work`, and commits `owner@epoch`.
fn logging_handler(log: Log, work: Duration) -> impl Handler {
    move |ctx: JobContext| {
        let log = Arc::clone(&log);
        async move {
            log.lock().expect("log").push((ctx.key().to_string(), ctx.epoch(), ctx.owner().to_string()));
            tokio::time::sleep(work).await;
            Ok(format!("{}@{}", ctx.owner(), ctx.epoch()).into_bytes())
        }
    }
}

fn stream_source(env: &Env, stream: &str, group: &str) -> StreamSource {
    StreamSource::new(env.redis.clone(), QueueName::new(stream).expect("queue"), stream, group)
        .expect("source")
        .key_from(KeyFrom::Field("key".into()))
        .block(Duration::from_millis(200))
        .autoclaim_every(Duration::from_millis(100))
}

/// Two consumers of one group share 40 entries; every job is committed exactly once, at epoch 1;
/// a duplicate entry sent afterwards is acknowledged as a duplicate; nothing is left pending and no
/// lease key is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stream_end_to_end_with_two_consumers_and_a_duplicate() {
    let env = Env::new().await;
    let stream = env.name("orders");
    let mut conn = env.conn();
    for i in 0..40 {
        xadd_job(&mut conn, &stream, &format!("order-{i}"), &format!("body {i}")).await;
    }
    let log: Log = Arc::default();
    let a = spawn_consumer(
        stream_source(&env, &stream, "g"),
        env.store(),
        "worker-a",
        consumer_config(3, 8),
        logging_handler(Arc::clone(&log), Duration::from_millis(20)),
    );
    let b = spawn_consumer(
        stream_source(&env, &stream, "g"),
        env.store(),
        "worker-b",
        consumer_config(3, 8),
        logging_handler(Arc::clone(&log), Duration::from_millis(20)),
    );
    wait_for("40 completions", Duration::from_secs(20), || {
        let n = a.snapshot().completions + b.snapshot().completions;
        async move { (n == 40).then_some(()) }
    })
    .await;
    // A producer sends order-3 again: the fence says Done, the entry is acknowledged, not run.
    xadd_job(&mut conn, &stream, "order-3", "again").await;
    wait_for("the duplicate acknowledged", Duration::from_secs(10), || {
        let (sa, sb) = (a.snapshot(), b.snapshot());
        async move { (sa.duplicates + sb.duplicates == 1 && sa.acks + sb.acks == 41).then_some(()) }
    })
    .await;
    let (sa, sb) = (a.shutdown(Duration::from_secs(5)).await, b.shutdown(Duration::from_secs(5)).await);

    let log = log.lock().expect("log").clone();
    let mut runs: HashMap<String, usize> = HashMap::new();
    for (key, epoch, _) in &log {
        assert_eq!(*epoch, 1, "{key} ran at epoch {epoch}");
        *runs.entry(key.clone()).or_default() += 1;
    }
    assert_eq!(runs.len(), 40);
    assert!(runs.values().all(|n| *n == 1), "a job ran twice: {runs:?}");
    assert!(sa.completions > 0 && sb.completions > 0, "both consumers worked: {sa} / {sb}");
    let jobs = env.jobs(&stream).await;
    assert_eq!(jobs.len(), 40);
    for (key, state, epoch, result) in &jobs {
        assert_eq!((state.as_str(), *epoch), ("completed", 1), "{key}");
        assert!(result.as_deref().is_some_and(|r| r.ends_with("@1")), "{key}: {result:?}");
    }
    assert_eq!(pending_count(&mut conn, &stream, "g").await, 0, "entries left pending");
    assert!(env.keys(&format!("{{{stream}}}:lease:*")).await.is_empty(), "lease keys left behind");
    env.cleanup().await;
}

/// A job that runs past the visibility hint is never auto-claimed by another consumer while its
/// database lease lives: every confirmed heartbeat `XCLAIM`s it (JUSTID) back to idle 0, and its
/// lease key carries `<owner>:<epoch>` renewed with it; both go when it is committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn heartbeat_keeps_a_live_entry_from_being_auto_claimed() {
    let env = Env::new().await;
    let stream = env.name("slow");
    let mut conn = env.conn();
    xadd_job(&mut conn, &stream, "slow-1", "x").await;
    let log: Log = Arc::default();
    let a = spawn_consumer(
        stream_source(&env, &stream, "g"),
        env.store(),
        "holder",
        consumer_config(3, 4),
        logging_handler(Arc::clone(&log), Duration::from_millis(5500)),
    );
    wait_for("the holder to start", Duration::from_secs(5), || {
        let started = !log.lock().expect("log").is_empty();
        async move { started.then_some(()) }
    })
    .await;
    let started = Instant::now();
    // Only now the rival: it sweeps idle entries every 100 ms with the same visibility (3 s).
    let b = spawn_consumer(
        stream_source(&env, &stream, "g"),
        env.store(),
        "rival",
        consumer_config(3, 4),
        logging_handler(Arc::clone(&log), Duration::ZERO),
    );
    let lease_key = brokerfence::redis::lease_key(
        &stream,
        &QueueName::new(stream.as_str()).expect("queue"),
        &brokerfence::JobKey::new("slow-1").expect("key"),
    );
    tokio::time::sleep(Duration::from_millis(1600).saturating_sub(started.elapsed())).await;
    let holder: Option<String> = client::cmd("GET").arg(&lease_key).query_async(&mut conn).await.expect("GET");
    assert_eq!(holder.as_deref(), Some("holder:1"), "lease key after the first confirmed heartbeat");
    // Past the visibility hint (3 s) the entry is still the holder's, delivered once, recently touched.
    tokio::time::sleep(Duration::from_millis(4200).saturating_sub(started.elapsed())).await;
    let rows = pending_rows(&mut conn, &stream, "g").await;
    assert_eq!(rows.len(), 1, "{rows:?}");
    let (_, consumer, idle, deliveries) = &rows[0];
    assert_eq!((consumer.as_str(), *deliveries), ("holder", 1), "{rows:?}");
    assert!(*idle < 1500, "heartbeat keeps the entry fresh: idle {idle} ms");
    let pttl: i64 = client::cmd("PTTL").arg(&lease_key).query_async(&mut conn).await.expect("PTTL");
    assert!(pttl > 1000, "lease key renewed with the lease: pttl {pttl}");
    wait_for("completion", Duration::from_secs(10), || {
        let n = a.snapshot().completions;
        async move { (n == 1).then_some(()) }
    })
    .await;
    let sb = b.shutdown(Duration::from_secs(5)).await;
    let sa = a.shutdown(Duration::from_secs(5)).await;
    assert_eq!((sb.claims, sb.busy), (0, 0), "the rival never got the live entry: {sb}");
    assert!(sa.renewals >= 4, "the holder renewed every second: {sa}");
    assert_eq!(log.lock().expect("log").len(), 1, "ran once");
    let job = env.job(&stream, "slow-1").await.expect("job row");
    assert_eq!((job.state, job.epoch), (JobState::Completed, 1));
    let holder: Option<String> = client::cmd("GET").arg(&lease_key).query_async(&mut conn).await.expect("GET");
    assert_eq!(holder, None, "lease key released after the commit");
    assert_eq!(pending_count(&mut conn, &stream, "g").await, 0);
    env.cleanup().await;
}

/// Entries that cannot be decoded go to the dead-letter stream with the reason and are
/// acknowledged; the loop goes on and later entries are processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_entries_are_dead_lettered_and_the_loop_goes_on() {
    let env = Env::new().await;
    let stream = env.name("bad");
    let mut conn = env.conn();
    let no_body = xadd(&mut conn, &stream, &[(b"key", b"k-nobody"), (b"note", b"no body")]).await;
    let bad_key = xadd(&mut conn, &stream, &[(b"key", b"\xff\xfe"), (b"body", b"x")]).await;
    let empty_key = xadd(&mut conn, &stream, &[(b"key", b""), (b"body", b"x")]).await;
    let binary = xadd(&mut conn, &stream, &[(b"\x00\xff", b"\xc3\x28")]).await;
    let lua = xadd(&mut conn, &stream, &[(b"key", b"x'); redis.call('FLUSHALL') --"), (b"body", b"ok")]).await;
    xadd_job(&mut conn, &stream, "good-1", "fine").await;
    let log: Log = Arc::default();
    let c = spawn_consumer(
        stream_source(&env, &stream, "g"),
        env.store(),
        "w",
        consumer_config(3, 4),
        logging_handler(Arc::clone(&log), Duration::ZERO),
    );
    wait_for("dead letters and completions", Duration::from_secs(10), || {
        let s = c.snapshot();
        async move { (s.dead_letters == 4 && s.completions == 2).then_some(()) }
    })
    .await;
    xadd_job(&mut conn, &stream, "good-2", "later").await;
    wait_for("the loop to go on", Duration::from_secs(10), || {
        let s = c.snapshot();
        async move { (s.completions == 3).then_some(()) }
    })
    .await;
    c.shutdown(Duration::from_secs(5)).await;

    let dead = xrange(&mut conn, &format!("{{{stream}}}:dead")).await;
    let reasons: HashMap<String, String> = dead
        .iter()
        .map(|(_, f)| (field_of(f, "dead.id").unwrap_or_default(), field_of(f, "dead.reason").unwrap_or_default()))
        .collect();
    assert_eq!(reasons.len(), 4, "{reasons:?}");
    assert!(reasons[&no_body].contains("no `body` field"), "{reasons:?}");
    assert!(reasons[&bad_key].contains("no usable job key"), "{reasons:?}");
    assert!(reasons[&empty_key].contains("no usable job key"), "{reasons:?}");
    assert!(reasons[&binary].contains("no `key` field"), "{reasons:?}");
    // The original fields travel with the dead letter.
    let copy = dead.iter().find(|(_, f)| field_of(f, "dead.id").as_deref() == Some(no_body.as_str())).expect("copy");
    assert_eq!(field_of(&copy.1, "note").as_deref(), Some("no body"));
    // A key full of Lua metacharacters is just a key.
    assert!(env.job(&stream, "x'); redis.call('FLUSHALL') --").await.is_some_and(|j| j.state == JobState::Completed));
    assert!(!lua.is_empty());
    assert_eq!(pending_count(&mut conn, &stream, "g").await, 0);
    env.cleanup().await;
}

/// An entry delivered more often than `max_deliveries` (a consumer died holding it, four times) is
/// still claimed and run: the delivery count is a hint, and only the database dead-letters
/// (issue #12 §3 bullet 1; this test asserted the opposite before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn entries_past_max_deliveries_are_claimed_not_dead_lettered() {
    let env = Env::new().await;
    let stream = env.name("poison");
    let mut conn = env.conn();
    let _: () = client::cmd("XGROUP")
        .arg("CREATE")
        .arg(&stream)
        .arg("g")
        .arg("0")
        .arg("MKSTREAM")
        .query_async(&mut conn)
        .await
        .expect("XGROUP");
    let id = xadd_job(&mut conn, &stream, "poison-1", "boom").await;
    // A consumer that died holding it, after four deliveries.
    let _: client::Value = client::cmd("XREADGROUP")
        .arg("GROUP")
        .arg("g")
        .arg("dead-worker")
        .arg("STREAMS")
        .arg(&stream)
        .arg(">")
        .query_async(&mut conn)
        .await
        .expect("XREADGROUP");
    let _: client::Value = client::cmd("XCLAIM")
        .arg(&stream)
        .arg("g")
        .arg("dead-worker")
        .arg(0)
        .arg(&id)
        .arg("RETRYCOUNT")
        .arg(4)
        .arg("JUSTID")
        .query_async(&mut conn)
        .await
        .expect("XCLAIM");
    let log: Log = Arc::default();
    let source = stream_source(&env, &stream, "g").max_deliveries(3).visibility(Duration::from_millis(1));
    let c = spawn_consumer(
        source,
        env.store(),
        "w",
        consumer_config(3, 4),
        logging_handler(Arc::clone(&log), Duration::ZERO),
    );
    wait_for("the commit", Duration::from_secs(10), || {
        let s = c.snapshot();
        async move { (s.completions == 1 && s.acks == 1).then_some(()) }
    })
    .await;
    let s = c.shutdown(Duration::from_secs(5)).await;
    assert_eq!(s.dead_letters, 0, "{s}");
    assert!(xrange(&mut conn, &format!("{{{stream}}}:dead")).await.is_empty(), "dead-lettered by its count");
    assert_eq!(log.lock().expect("log").len(), 1, "ran once");
    let job = env.job(&stream, "poison-1").await.expect("claimed");
    assert_eq!((job.state, job.epoch), (JobState::Completed, 1));
    assert_eq!(pending_count(&mut conn, &stream, "g").await, 0);
    env.cleanup().await;
}

/// A failed attempt is recorded by the fence and its entry comes back after the backoff (not after
/// the visibility hint): the second attempt runs at epoch 2 and commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_attempts_come_back_after_the_backoff() {
    let env = Env::new().await;
    let stream = env.name("retry");
    let mut conn = env.conn();
    xadd_job(&mut conn, &stream, "flaky-1", "x").await;
    let attempts = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&attempts);
    let handler = move |ctx: JobContext| {
        let seen = Arc::clone(&seen);
        async move {
            seen.lock().expect("attempts").push((ctx.epoch(), Instant::now()));
            if ctx.epoch() == 1 { Err(JobError::retry("upstream 503")) } else { Ok(b"ok".to_vec()) }
        }
    };
    let retry =
        RetryPolicy { max_attempts: 5, base_backoff: Duration::from_millis(400), max_backoff: Duration::from_secs(1) };
    let config = brokerfence::ConsumerConfig::new(SupervisorConfig::new(lease(3)).retry(retry)).concurrency(2);
    let c = spawn_consumer(stream_source(&env, &stream, "g"), env.store(), "w", config, handler);
    wait_for("the retry to commit", Duration::from_secs(10), || {
        let s = c.snapshot();
        async move { (s.completions == 1).then_some(()) }
    })
    .await;
    let s = c.shutdown(Duration::from_secs(5)).await;
    assert_eq!(s.failures, 1, "{s}");
    let attempts = attempts.lock().expect("attempts").clone();
    assert_eq!(attempts.iter().map(|(e, _)| *e).collect::<Vec<_>>(), vec![1, 2]);
    let gap = attempts[1].1.duration_since(attempts[0].1);
    assert!(gap >= Duration::from_millis(350), "came back before the backoff: {gap:?}");
    assert!(gap < Duration::from_millis(2500), "came back only after the visibility hint: {gap:?}");
    let job = env.job(&stream, "flaky-1").await.expect("job");
    assert_eq!((job.state, job.epoch, job.attempts), (JobState::Completed, 2, 2));
    assert_eq!(pending_count(&mut conn, &stream, "g").await, 0);
    env.cleanup().await;
}

/// Shutdown: no more reads; a job still running after the grace period is cancelled, its lease
/// released in the database and its lease key deleted, and its entry made claimable at once — a
/// second consumer takes it over well before the visibility hint would have let it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn shutdown_releases_the_lease_and_hands_the_entry_over_at_once() {
    let env = Env::new().await;
    let stream = env.name("shutdown");
    let mut conn = env.conn();
    xadd_job(&mut conn, &stream, "long-1", "x").await;
    let log: Log = Arc::default();
    let a = spawn_consumer(
        stream_source(&env, &stream, "g"),
        env.store(),
        "leaving",
        consumer_config(3, 2),
        logging_handler(Arc::clone(&log), Duration::from_secs(60)),
    );
    wait_for("the job to start", Duration::from_secs(5), || {
        let started = !log.lock().expect("log").is_empty();
        async move { started.then_some(()) }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1200)).await; // one heartbeat: the lease key is set
    let stopped = Instant::now();
    let sa = a.shutdown(Duration::from_secs(5)).await;
    assert!(stopped.elapsed() < Duration::from_secs(3), "shutdown took {:?}", stopped.elapsed());
    assert_eq!((sa.releases, sa.acks, sa.completions), (1, 0, 0), "{sa}");
    let job = env.job(&stream, "long-1").await.expect("job");
    assert_eq!((job.state, job.epoch), (JobState::Pending, 1), "released without spending an attempt");
    assert!(env.keys(&format!("{{{stream}}}:lease:*")).await.is_empty(), "lease key released");

    let handed = Instant::now();
    let b = spawn_consumer(
        stream_source(&env, &stream, "g"),
        env.store(),
        "taking",
        consumer_config(3, 2),
        logging_handler(Arc::clone(&log), Duration::ZERO),
    );
    wait_for("the takeover", Duration::from_secs(10), || {
        let n = b.snapshot().completions;
        async move { (n == 1).then_some(()) }
    })
    .await;
    assert!(handed.elapsed() < Duration::from_millis(2000), "handed over after {:?}", handed.elapsed());
    b.shutdown(Duration::from_secs(5)).await;
    let job = env.job(&stream, "long-1").await.expect("job");
    assert_eq!((job.state, job.epoch), (JobState::Completed, 2));
    assert_eq!(job.result.as_deref(), Some(&b"taking@2"[..]));
    assert_eq!(pending_count(&mut conn, &stream, "g").await, 0);
    env.cleanup().await;
}

/// The reliable list: items move to the processing list, are committed through the fence and then
/// removed; an undecodable item goes to the dead-letter stream; nothing is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliable_list_end_to_end() {
    let env = Env::new().await;
    let list = env.name("mail");
    let mut conn = env.conn();
    for i in 0..20 {
        let _: i64 = client::cmd("LPUSH")
            .arg(&list)
            .arg(format!("mail-{i}|hello {i}"))
            .query_async(&mut conn)
            .await
            .expect("LPUSH");
    }
    let _: i64 = client::cmd("LPUSH").arg(&list).arg("no separator here").query_async(&mut conn).await.expect("LPUSH");
    let log: Log = Arc::default();
    let q = QueueName::new(list.as_str()).expect("q");
    let source = ReliableList::new(env.redis.clone(), q, list.as_str(), ItemKey::Split(b'|'))
        .expect("source")
        .block(Duration::from_millis(200));
    let processing = source.get_processing().to_owned();
    let c = spawn_consumer(
        source,
        env.store(),
        "w",
        consumer_config(3, 8),
        logging_handler(Arc::clone(&log), Duration::from_millis(10)),
    );
    wait_for("20 completions and a dead letter", Duration::from_secs(15), || {
        let s = c.snapshot();
        async move { (s.completions == 20 && s.dead_letters == 1 && s.acks == 20).then_some(()) }
    })
    .await;
    c.shutdown(Duration::from_secs(5)).await;
    let left: i64 = client::cmd("LLEN").arg(&processing).query_async(&mut conn).await.expect("LLEN");
    assert_eq!(left, 0, "processing list empty");
    let dead = xrange(&mut conn, &format!("{{{list}}}:dead")).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(field_of(&dead[0].1, "item").as_deref(), Some("no separator here"));
    assert!(field_of(&dead[0].1, "dead.reason").is_some_and(|r| r.contains("separator")));
    let jobs = env.jobs(&list).await;
    assert_eq!(jobs.len(), 20);
    assert!(jobs.iter().all(|(_, s, e, _)| s == "completed" && *e == 1), "{jobs:?}");
    assert!(env.keys(&format!("{{{list}}}:lease:*")).await.is_empty(), "lease keys left behind");
    env.cleanup().await;
}

/// Items left in the processing list by a worker that died go back to the queue once their lease
/// key has lapsed — not before: one without a key is back within two reaper passes, one whose key
/// still lives (another worker's) only after it expired.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reliable_list_puts_back_items_whose_lease_lapsed() {
    let env = Env::new().await;
    let list = env.name("jobs");
    let q = QueueName::new(list.as_str()).expect("q");
    let mut conn = env.conn();
    let source = ReliableList::new(env.redis.clone(), q.clone(), list.as_str(), ItemKey::Split(b'|'))
        .expect("source")
        .block(Duration::from_millis(100))
        .reap_every(Duration::from_millis(200), 100);
    let processing = source.get_processing().to_owned();
    // A dead worker's leftovers: "orphan" without a lease key, "held" with one that lapses in 2.5 s.
    let _: i64 = client::cmd("LPUSH")
        .arg(&processing)
        .arg("orphan|1")
        .arg("held|2")
        .query_async(&mut conn)
        .await
        .expect("LPUSH");
    let held_key = source.leases().key(&q, &brokerfence::JobKey::new("held").expect("key"));
    let _: () = client::cmd("SET")
        .arg(&held_key)
        .arg("dead-worker:1")
        .arg("PX")
        .arg(2500)
        .query_async(&mut conn)
        .await
        .expect("SET");
    let t0 = Instant::now();
    let done: Arc<Mutex<HashMap<String, Duration>>> = Arc::default();
    let seen = Arc::clone(&done);
    let handler = move |ctx: JobContext| {
        let seen = Arc::clone(&seen);
        async move {
            seen.lock().expect("done").insert(ctx.key().to_string(), t0.elapsed());
            Ok(b"ok".to_vec())
        }
    };
    let c = spawn_consumer(source, env.store(), "w", consumer_config(3, 4), handler);
    wait_for("both items", Duration::from_secs(10), || {
        let n = c.snapshot().completions;
        async move { (n == 2).then_some(()) }
    })
    .await;
    c.shutdown(Duration::from_secs(5)).await;
    let done = done.lock().expect("done").clone();
    assert!(done["orphan"] < Duration::from_millis(1500), "orphan came back after {:?}", done["orphan"]);
    assert!(
        done["held"] >= Duration::from_millis(2500),
        "held item taken while its lease key lived: {:?}",
        done["held"]
    );
    let left: i64 = client::cmd("LLEN").arg(&processing).query_async(&mut conn).await.expect("LLEN");
    assert_eq!(left, 0);
    env.cleanup().await;
}

/// The retrofit in a `BRPOP` loop the user owns: the job key comes from the item, the lease key is
/// set when the attempt starts and carries `<owner>:<epoch>`, the heartbeat renews it, it is
/// released afterwards; a duplicate item is acknowledged without running, an undecodable one is
/// dead-lettered with its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_retrofit_in_a_brpop_loop() {
    let env = Env::new().await;
    let list = env.name("legacy");
    let mut conn = env.conn();
    let owner = Owner::new("legacy-loop").expect("owner");
    let fence = ListRetrofit::with_owner(
        env.store(),
        QueueName::new(list.as_str()).expect("q"),
        owner.clone(),
        SupervisorConfig::new(lease(3)),
        &env.redis,
        list.as_str(),
        ItemKey::Split(b'|'),
    )
    .expect("retrofit");
    for item in ["r-0|slow", "r-1|a", "r-2|b", "r-1|a", "garbage"] {
        let _: i64 = client::cmd("LPUSH").arg(&list).arg(item).query_async(&mut conn).await.expect("LPUSH");
    }
    /// (job key, lease key holder seen by the handler, its PTTL)
    type Seen = Arc<Mutex<Vec<(String, Option<String>, i64)>>>;
    let observed: Seen = Arc::default();
    let mut outcomes = Vec::new();
    let mut blocking = env.redis.blocking();
    loop {
        // The user's loop, unchanged but for the call to `process`.
        let popped: Option<(String, Vec<u8>)> =
            client::cmd("BRPOP").arg(&list).arg(0.3).query_async(&mut blocking).await.expect("BRPOP");
        let Some((_, item)) = popped else { break };
        let (leases, seen, pconn) = (fence.leases().clone(), Arc::clone(&observed), env.conn());
        let done = fence
            .process(&item, move |ctx: JobContext| {
                let (leases, seen, mut pconn) = (leases.clone(), Arc::clone(&seen), pconn.clone());
                async move {
                    let key = leases.key(ctx.queue(), ctx.key());
                    if ctx.payload() == b"slow" {
                        tokio::time::sleep(Duration::from_millis(1600)).await;
                    }
                    let holder = leases.holder(&key).await.map_err(JobError::retry)?;
                    let pttl: i64 =
                        client::cmd("PTTL").arg(&key).query_async(&mut pconn).await.map_err(JobError::retry)?;
                    seen.lock().expect("seen").push((ctx.key().to_string(), holder, pttl));
                    Ok(b"done".to_vec())
                }
            })
            .await;
        fence.requeue_popped(&item, &done).await.expect("requeue");
        outcomes.push((String::from_utf8_lossy(&item).into_owned(), done));
    }
    assert_eq!(outcomes.len(), 5);
    let by_item = |i: usize| &outcomes[i].1;
    // BRPOP takes from the right: the order of LPUSH.
    assert!(by_item(0).should_ack() && by_item(1).should_ack() && by_item(2).should_ack());
    assert!(
        matches!(&by_item(3).detail, Detail::NotClaimed(Claim::Done { epoch: 1 })) && by_item(3).should_ack(),
        "duplicate: {:?}",
        by_item(3)
    );
    assert!(
        matches!(&by_item(4).disposition, Disposition::DeadLetter(r) if r.contains("separator")),
        "{:?}",
        by_item(4)
    );
    let observed = observed.lock().expect("seen").clone();
    assert_eq!(observed.len(), 3);
    for (key, holder, pttl) in &observed {
        assert_eq!(holder.as_deref(), Some(token(&owner, 1).as_str()), "{key}");
        assert!(*pttl > 0, "{key}: {pttl}");
    }
    // The slow one ran past the first heartbeat (1 s): its key was renewed, not left to run down.
    let slow = observed.iter().find(|(k, _, _)| k == "r-0").expect("slow");
    assert!(slow.2 > 2000, "lease key renewed by the heartbeat: pttl {} ms after 1.6 s of a 3 s lease", slow.2);
    assert!(env.keys(&format!("{{{list}}}:lease:*")).await.is_empty(), "lease keys released");
    let dead = xrange(&mut conn, fence.get_dead_letter_stream()).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(field_of(&dead[0].1, "item").as_deref(), Some("garbage"));
    assert_eq!(fence.retrofit().metrics().snapshot().completions, 3);
    env.cleanup().await;
}
