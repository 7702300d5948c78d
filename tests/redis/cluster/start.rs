//! What a user sees at start: the URL forms, a cluster or sentinels that are down, and a
//! configuration whose keys would span cluster slots — each a clear, typed error before anything
//! is received, never a failure at run time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use brokerfence::CancellationToken;
use brokerfence::redis::client;
use brokerfence::redis::{
    ItemKey, ListRetrofit, RedisConnections, RedisError, RedisTimeouts, ReliableList, StreamSource, Topology,
};
use brokerfence::{Consumer, Source, SourceError};
use brokerfence::{JobContext, QueueName, SupervisorConfig};
use brokerfence_testkit::redis::{Env, consumer_config, lease, redis_url, xadd_job};
use brokerfence_testkit::redis_topology::{RedisCluster, RedisSentinels};

fn quick() -> RedisTimeouts {
    RedisTimeouts::default().connect(Duration::from_millis(300)).response(Duration::from_millis(300))
}

/// A port nobody listens on (bound, then released).
fn dead_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    listener.local_addr().expect("addr").port()
}

/// Malformed cluster and Sentinel URLs, and other schemes, are refused before any connection is
/// made, with an error that says what is wrong and never shows the password.
#[tokio::test]
async fn cluster_bad_url_forms_are_refused_before_connecting() {
    let cases: &[(&str, &str)] = &[
        ("redis+cluster://:hunter2@127.0.0.1:7000/3", "only database 0"),
        ("redis+cluster://:hunter2@127.0.0.1:7000,,127.0.0.1:7001", "empty host"),
        ("redis+cluster://:hunter2@127.0.0.1:seven", "port \"seven\""),
        ("redis+sentinel://:hunter2@127.0.0.1:26379", "names the master"),
        ("redis+sentinel://:hunter2@127.0.0.1:26379/mymaster/zero", "is not a number"),
        ("redis+sentinel://:hunter2@127.0.0.1:26379/mymaster?x=1", "takes no query"),
        ("cluster://127.0.0.1:7000", "unsupported Redis URL scheme \"cluster:\""),
    ];
    for (url, says) in cases {
        let started = Instant::now();
        let err = RedisConnections::connect(url).await.expect_err(url);
        assert!(started.elapsed() < Duration::from_millis(200), "{url}: took {:?}", started.elapsed());
        assert!(matches!(err, RedisError::BadUrl { .. } | RedisError::UnsupportedScheme { .. }), "{url}: {err:?}");
        let text = err.to_string();
        assert!(text.contains(says), "{url}: {text}");
        assert!(!text.contains("hunter2") && !format!("{err:?}").contains("hunter2"), "{url}: {text}");
        assert!(err.is_fatal() && matches!(SourceError::from(err), SourceError::Fatal(_)), "{url}");
    }
}

/// A cluster that is down (every node killed), and seed nodes nobody listens on, fail at start
/// with `Unreachable` naming the seeds, within the connect bound; a Sentinel set that is down, or
/// that does not know the master's name, the same, naming the master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_or_sentinels_down_is_a_clear_error_at_start() {
    let cluster = RedisCluster::start(3, 0).await;
    let url = cluster.seed_url();
    let up = RedisConnections::connect_with(&url, quick()).await.expect("the cluster is up");
    assert_eq!(up.topology(), Topology::Cluster);
    cluster.down().await;
    let started = Instant::now();
    let err = RedisConnections::connect_with(&url, quick()).await.expect_err("the cluster is down");
    let took = started.elapsed();
    assert!(matches!(err, RedisError::Unreachable { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.starts_with("cannot connect to Redis at cluster seeds 127.0.0.1:"), "{text}");
    assert!(took < Duration::from_secs(5), "a down cluster took {took:?} to report");

    let (a, b) = (dead_port(), dead_port());
    let err = RedisConnections::connect_with(&format!("redis+cluster://127.0.0.1:{a},127.0.0.1:{b}"), quick())
        .await
        .expect_err("nobody listens");
    assert!(err.to_string().contains(&format!("cluster seeds 127.0.0.1:{a},127.0.0.1:{b}")), "{err}");

    let err =
        RedisConnections::connect_with(&format!("redis+sentinel://:pw@127.0.0.1:{a},127.0.0.1:{b}/orders"), quick())
            .await
            .expect_err("no sentinel listens");
    let text = err.to_string();
    assert!(matches!(err, RedisError::Unreachable { .. }), "{err:?}");
    assert!(text.contains("master \"orders\" through sentinels"), "{text}");
    assert!(!text.contains("pw@"), "{text}");

    let sentinels = RedisSentinels::start().await;
    let wrong = sentinels.url().replace(&format!("/{}", sentinels.master_name()), "/nosuchmaster");
    let err = RedisConnections::connect_with(&wrong, quick()).await.expect_err("an unknown master");
    assert!(err.to_string().contains("does not monitor a master named \"nosuchmaster\""), "{err}");
    let right = RedisConnections::connect_with(&sentinels.url(), quick()).await.expect("the master");
    assert_eq!(right.topology(), Topology::Sentinel);
}

/// Guard: keys that one script touches together must share a cluster slot. A dead-letter stream
/// or processing list named without the source key's hash tag is refused when the consumer starts
/// (`Source::check`), before anything is received; a list name whose derived keys would fall in
/// another slot is refused by `ListRetrofit::new`. Without the check the consumer would start,
/// take the entry, and fail with CROSSSLOT only when it dead-letters it. On one server the same
/// configurations are fine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_cross_slot_configuration_is_refused_at_start() {
    let cluster = RedisCluster::start(3, 0).await;
    let env = Env::on(&cluster.seed_url()).await;
    let stream = env.name("orders");
    let mut conn = env.conn();
    xadd_job(&mut conn, &stream, "k1", "body").await;
    let queue = QueueName::new("orders").expect("queue");

    let source = StreamSource::new(env.redis.clone(), queue.clone(), stream.as_str(), "g")
        .expect("source")
        .dead_letter_stream(env.name("elsewhere"));
    let err = source.check().expect_err("dead-letter stream in another slot");
    assert!(
        matches!(&err, SourceError::Fatal(m) if m.to_string().contains("different Redis Cluster slots")),
        "{err:?}"
    );
    let consumer = Consumer::new(source, env.store(), consumer_config(3, 2));
    let started = Instant::now();
    let run = tokio::time::timeout(
        Duration::from_secs(5),
        consumer.run(|ctx: JobContext| async move { Ok(ctx.payload().to_vec()) }, CancellationToken::new()),
    )
    .await
    .expect("the consumer must refuse at start, not run");
    let err = run.expect_err("a cross-slot configuration");
    assert!(
        matches!(&err, SourceError::Fatal(m) if m.to_string().contains("StreamSource") && m.to_string().contains("elsewhere")),
        "{err:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(2));
    let groups: client::Value =
        client::cmd("XINFO").arg("GROUPS").arg(&stream).query_async(&mut conn).await.expect("XINFO GROUPS");
    assert_eq!(groups, client::Value::Array(vec![]), "nothing was received: no group was even created");

    let list = env.name("mail");
    let reliable = ReliableList::new(env.redis.clone(), queue.clone(), list.as_str(), ItemKey::Split(b'|'))
        .expect("source")
        .processing(env.name("processing"));
    let err = reliable.check().expect_err("processing list in another slot");
    assert!(matches!(&err, SourceError::Fatal(m) if m.to_string().contains("ReliableList")), "{err:?}");
    let tagged = ReliableList::new(env.redis.clone(), queue.clone(), "{mail}", ItemKey::Split(b'|'))
        .expect("source")
        .processing("{mail}:working")
        .dead_letter_stream("{mail}:dead-letters");
    tagged.check().expect("keys with the list's hash tag share its slot");

    let store: Arc<dyn brokerfence::FenceStore> = env.store();
    let config = SupervisorConfig::new(lease(3));
    let err = ListRetrofit::new(
        Arc::clone(&store),
        queue.clone(),
        config.clone(),
        &env.redis,
        "mail}box",
        ItemKey::Split(b'|'),
    )
    .expect_err("a list whose derived keys leave its slot");
    assert!(matches!(err, RedisError::CrossSlot { what: "ListRetrofit", .. }), "{err:?}");
    ListRetrofit::new(Arc::clone(&store), queue.clone(), config.clone(), &env.redis, "mailbox", ItemKey::Split(b'|'))
        .expect("a plain list name is wrapped in a hash tag");

    // One server: no slots, every name is taken.
    let single = RedisConnections::connect(&redis_url()).await.expect("the shared Redis");
    let source = StreamSource::new(single.clone(), queue.clone(), stream.as_str(), "g")
        .expect("source")
        .dead_letter_stream(env.name("elsewhere"));
    source.check().expect("one server has no slots");
    ListRetrofit::new(store, queue, config, &single, "mail}box", ItemKey::Split(b'|')).expect("one server");
    env.cleanup().await;
}
