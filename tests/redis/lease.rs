//! The Redis lease key against a real Redis: the Lua compare-and-set scripts (a stale token can
//! neither renew nor release, a reservation never displaces a holder, an older epoch is taken
//! over), keys full of Lua and Redis metacharacters, the `NOSCRIPT` fallback after `SCRIPT FLUSH`,
//! and one script call per heartbeat tick for all of a worker's in-flight jobs.
#![cfg(feature = "redis")]

use brokerfence_testkit::redis as redis_support;

use std::sync::Arc;
use std::time::Duration;

use brokerfence::redis::client;
use brokerfence::redis::{Acquired, KeyFrom, LeaseKeys, Renewed, StreamSource, lease_key, token};
use brokerfence::{JobContext, JobKey, Owner, QueueName};
use redis_support::*;
use tokio::sync::Semaphore;

const TTL: Duration = Duration::from_secs(30);

async fn get(conn: &mut brokerfence::redis::RedisConn, key: &str) -> Option<String> {
    client::cmd("GET").arg(key).query_async(conn).await.expect("GET")
}

async fn pttl(conn: &mut brokerfence::redis::RedisConn, key: &str) -> i64 {
    client::cmd("PTTL").arg(key).query_async(conn).await.expect("PTTL")
}

/// The zombie's token after a takeover: renew and release are refused and touch nothing; it cannot
/// acquire over the newer epoch either. The holder renews and releases; a released key is missing.
#[tokio::test]
async fn a_stale_token_can_neither_renew_nor_release() {
    let env = Env::new().await;
    let mut conn = env.conn();
    let leases = LeaseKeys::new(env.redis.commands(), env.name("s"));
    let key = leases.key(&QueueName::new("q").expect("q"), &JobKey::new("job-1").expect("k"));
    let (zombie, holder) = ("zombie:1".to_owned(), "holder:2".to_owned());

    assert_eq!(leases.acquire(&[(key.clone(), zombie.clone(), 1)], TTL).await.expect("acquire"), [Acquired::Set]);
    // The database handed epoch 2 to another worker: its first confirmation takes the key over.
    assert_eq!(
        leases.acquire(&[(key.clone(), holder.clone(), 2)], Duration::from_secs(10)).await.expect("acquire"),
        [Acquired::TookOver]
    );
    let before = pttl(&mut conn, &key).await;
    assert!(before <= 10_000);

    assert_eq!(leases.renew(&[(key.clone(), zombie.clone())], TTL).await.expect("renew"), [Renewed::HeldByOther]);
    assert!(pttl(&mut conn, &key).await <= before, "a stale renew must not extend the key");
    assert_eq!(leases.release(&[(key.clone(), zombie.clone())]).await.expect("release"), [false]);
    assert_eq!(get(&mut conn, &key).await.as_deref(), Some("holder:2"), "a stale release must not delete");
    assert_eq!(leases.acquire(&[(key.clone(), zombie.clone(), 1)], TTL).await.expect("acquire"), [Acquired::Refused]);
    assert_eq!(get(&mut conn, &key).await.as_deref(), Some("holder:2"));

    assert_eq!(leases.renew(&[(key.clone(), holder.clone())], TTL).await.expect("renew"), [Renewed::Renewed]);
    assert!(pttl(&mut conn, &key).await > 20_000, "the holder's renew extends");
    assert_eq!(leases.release(&[(key.clone(), holder.clone())]).await.expect("release"), [true]);
    assert_eq!(get(&mut conn, &key).await, None);
    assert_eq!(leases.renew(&[(key.clone(), holder)], TTL).await.expect("renew"), [Renewed::Missing]);
    assert_eq!(get(&mut conn, &key).await, None, "renew never creates a key");
    env.cleanup().await;
}

/// A reservation (epoch 0, made before the database claim) never displaces a holder; any claimed
/// epoch takes a reservation over; the same token refreshes; a batch answers per key.
#[tokio::test]
async fn reservations_and_batches() {
    let env = Env::new().await;
    let mut conn = env.conn();
    let leases = LeaseKeys::new(env.redis.commands(), env.name("r"));
    let q = QueueName::new("q").expect("q");
    let keys: Vec<String> = (0..3).map(|i| leases.key(&q, &JobKey::new(format!("j{i}")).expect("k"))).collect();
    let (w1, w2) = (Owner::new("w1").expect("o"), Owner::new("w2").expect("o"));

    leases.acquire(&[(keys[0].clone(), token(&w1, 3), 3)], TTL).await.expect("acquire");
    let r = leases.reserve(&keys, &w2, TTL).await.expect("reserve");
    assert_eq!(r, [Acquired::Refused, Acquired::Set, Acquired::Set]);
    assert_eq!(get(&mut conn, &keys[0]).await.as_deref(), Some("w1:3"));
    assert_eq!(get(&mut conn, &keys[1]).await.as_deref(), Some("w2:0"));
    // w1 claims j1 in the database (epoch 1): its confirmation takes over w2's reservation.
    let r = leases
        .acquire(&[(keys[1].clone(), token(&w1, 1), 1), (keys[0].clone(), token(&w1, 3), 3)], TTL)
        .await
        .expect("acquire");
    assert_eq!(r, [Acquired::TookOver, Acquired::Set]);
    let renewed = leases
        .renew(
            &[(keys[0].clone(), "w1:3".into()), (keys[1].clone(), "w2:0".into()), (keys[2].clone(), "w2:0".into())],
            TTL,
        )
        .await
        .expect("renew");
    assert_eq!(renewed, [Renewed::Renewed, Renewed::HeldByOther, Renewed::Renewed]);
    let released = leases
        .release(&[
            (keys[0].clone(), "w1:3".into()),
            (keys[1].clone(), "w2:0".into()),
            (keys[2].clone(), "w2:0".into()),
        ])
        .await
        .expect("release");
    assert_eq!(released, [true, false, true]);
    assert_eq!(get(&mut conn, &keys[1]).await.as_deref(), Some("w1:1"));
    env.cleanup().await;
}

/// Keys and tokens full of Lua, Redis-protocol and hash-tag metacharacters are data, never code:
/// each maps to its own key in its anchor's slot, round-trips, and nothing else is touched.
#[tokio::test]
async fn metacharacters_are_data() {
    let env = Env::new().await;
    let mut conn = env.conn();
    let anchor = env.name("meta");
    let sentinel = env.name("sentinel");
    let _: () = client::cmd("SET").arg(&sentinel).arg("alive").query_async(&mut conn).await.expect("SET");
    let leases = LeaseKeys::new(env.redis.commands(), anchor.clone());
    let q = QueueName::new("q'); redis.call('FLUSHALL') --").expect("q");
    let nasty = [
        "'); redis.call('FLUSHALL') --",
        "]] redis.call('DEL', KEYS[1]) [[",
        "*3\r\n$3\r\nDEL\r\n",
        "{other-slot}",
        "100%; ${x} \\ \" '",
        "ключ 🔑",
    ];
    let mut items = Vec::new();
    for (i, k) in nasty.iter().enumerate() {
        let key = leases.key(&q, &JobKey::new(*k).expect("key"));
        assert!(key.starts_with(&format!("{{{anchor}}}")), "{key}");
        let owner = Owner::new(format!("own'er\"{k}")).expect("owner");
        items.push((key, token(&owner, i64::try_from(i).expect("i") + 1), i64::try_from(i).expect("i") + 1));
    }
    let r = leases.acquire(&items, TTL).await.expect("acquire");
    assert!(r.iter().all(|a| *a == Acquired::Set), "{r:?}");
    for (key, tok, _) in &items {
        assert_eq!(get(&mut conn, key).await.as_deref(), Some(tok.as_str()));
    }
    let pairs: Vec<(String, String)> = items.iter().map(|(k, t, _)| (k.clone(), t.clone())).collect();
    assert!(leases.release(&pairs).await.expect("release").iter().all(|b| *b));
    assert_eq!(get(&mut conn, &sentinel).await.as_deref(), Some("alive"));
    let distinct: std::collections::HashSet<_> = items.iter().map(|(k, _, _)| k).collect();
    assert_eq!(distinct.len(), nasty.len());
    assert_eq!(
        lease_key(&anchor, &q, &JobKey::new("x").expect("k")),
        format!("{{{anchor}}}:lease:{}:{}:x", q.as_str().len(), q.as_str())
    );
    env.cleanup().await;
}

/// Ten jobs in flight on one worker cost one script call per heartbeat tick (it renews the ten
/// lease keys and `XCLAIM`s the ten entries inside the script, issue #12 §4 bullet 2), not ten;
/// and after `SCRIPT FLUSH` the next call reloads the script by itself (`NOSCRIPT`
/// fallback), on a private server so no one else's scripts are flushed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_script_call_per_tick_for_all_in_flight_jobs_and_noscript_fallback() {
    let redis = PrivateRedis::start().await;
    let env = Env::on(&redis.url()).await;
    let stream = env.name("batch");
    let mut conn = env.conn();
    for i in 0..10 {
        xadd_job(&mut conn, &stream, &format!("job-{i}"), "x").await;
    }
    let gate = Arc::new(Semaphore::new(0));
    let started = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (g, s) = (Arc::clone(&gate), Arc::clone(&started));
    let handler = move |ctx: JobContext| {
        let (g, s) = (Arc::clone(&g), Arc::clone(&s));
        async move {
            s.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _permit = g.acquire().await.map_err(brokerfence::JobError::retry)?;
            Ok(format!("{}", ctx.epoch()).into_bytes())
        }
    };
    let source =
        StreamSource::new(env.redis.clone(), QueueName::new(stream.as_str()).expect("q"), stream.as_str(), "g")
            .expect("source")
            .key_from(KeyFrom::Field("key".into()))
            .block(Duration::from_millis(100))
            .autoclaim_every(Duration::from_secs(60));
    let c = spawn_consumer(source, env.store(), "batcher", consumer_config(3, 10), handler);
    wait_for("10 jobs in flight", Duration::from_secs(10), || {
        let n = started.load(std::sync::atomic::Ordering::SeqCst);
        async move { (n == 10).then_some(()) }
    })
    .await;
    let before = redis.command_calls().await;
    let hb_before = c.snapshot().heartbeats;
    tokio::time::sleep(Duration::from_millis(3300)).await;
    let after = redis.command_calls().await;
    let ticks = c.snapshot().heartbeats - hb_before;
    let delta = |cmd: &str| after.get(cmd).copied().unwrap_or(0) - before.get(cmd).copied().unwrap_or(0);
    assert!(ticks >= 3, "ticks: {ticks}");
    // Inside the script: one XCLAIM per entry and tick, no XCLAIM round trip of its own.
    assert_eq!(delta("xclaim"), 10 * ticks, "one XCLAIM per entry inside each tick's script");
    // One script per tick (the first confirmation acquires, later ones renew): never one per job.
    // A script's first use on this fresh server is one EVALSHA answered NOSCRIPT, then SCRIPT LOAD
    // and the EVALSHA again: those retries are not calls of their own.
    let scripts = delta("evalsha") + delta("eval") - delta("script|load");
    assert!(scripts <= ticks, "{scripts} script calls over {ticks} ticks");
    assert!(scripts + 1 >= ticks, "{scripts} script calls over {ticks} ticks");
    let keys = env.keys(&format!("{{{stream}}}:lease:*")).await;
    assert_eq!(keys.len(), 10, "every in-flight job has its lease key");
    assert_eq!(get(&mut conn, &keys[0]).await.map(|v| v.starts_with("batcher:")), Some(true));

    // The server forgets every script; the next heartbeat's EVALSHA gets NOSCRIPT and falls back.
    let _: () = client::cmd("SCRIPT").arg("FLUSH").query_async(&mut conn).await.expect("SCRIPT FLUSH");
    tokio::time::sleep(Duration::from_millis(1300)).await;
    // Left alone the key would be down to at most 3000 - 1300 ms; renewed every second it is not.
    let left = pttl(&mut conn, &keys[0]).await;
    assert!(left > 1800, "renewed after SCRIPT FLUSH: pttl {left} ms");
    let flushed = redis.command_calls().await;
    assert!(flushed.get("script|load").copied().unwrap_or(0) >= 1, "script loaded again: {flushed:?}");

    gate.add_permits(10);
    wait_for("completions", Duration::from_secs(10), || {
        let n = c.snapshot().completions;
        async move { (n == 10).then_some(()) }
    })
    .await;
    c.shutdown(Duration::from_secs(5)).await;
    assert!(env.keys(&format!("{{{stream}}}:lease:*")).await.is_empty(), "released after commit");
    env.cleanup().await;
}
