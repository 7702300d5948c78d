//! The topologies' own tests: a cluster that migrates a slot (ASK, then MOVED) and loses a
//! primary, a sentinel failover (forced, then after a crash), a promotion after a cut link, a node
//! killed and restarted. Every name contains `cluster`, so `cargo test -p brokerfence-testkit
//! --all-features cluster` runs them.

use std::time::{Duration, Instant};

use brokerfence::redis::client::{self, RedisResult};

use super::{RedisCluster, RedisNode, RedisPair, RedisSentinels};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_starts_and_migrates_a_slot() {
    let t0 = Instant::now();
    let cluster = RedisCluster::start(3, 1).await;
    eprintln!("cluster of 3 primaries and 3 replicas up in {:?}", t0.elapsed());
    let root = cluster.node(0).dir().parent().expect("a node dir is in the root").to_owned();
    assert_eq!(cluster.nodes().len(), 6);
    assert_eq!(cluster.node_urls().len(), 6);
    let primaries = cluster.primary_indexes().await;
    assert_eq!(primaries.len(), 3, "{:?}", cluster.slots().await);
    let seed = cluster.seed_url();
    assert!(seed.starts_with("redis+cluster://127.0.0.1:") && seed.matches(',').count() == 2, "{seed}");

    let slot = cluster.slot_of("{job}:a").await;
    assert_eq!(slot, cluster.slot_of("{job}:b").await, "one hash tag, one slot");
    let source = cluster.index_for_slot(slot).await;
    let owner = cluster.node_for_slot(slot).await;
    for key in ["{job}:a", "{job}:b"] {
        let _: String = owner.cmd(&["SET", key, "1"]).await;
    }
    let to = primaries.iter().copied().find(|&i| i != source).unwrap();
    let moved = cluster.node(to).try_cmd::<String>(&["GET", "{job}:a"]).await;
    assert_eq!(redirect(&moved), Some("MOVED"), "{moved:?}");

    let t1 = Instant::now();
    let migration = cluster.begin_migration(slot, to).await;
    let ask = owner.try_cmd::<Option<String>>(&["GET", "{job}:missing"]).await;
    assert_eq!(redirect(&ask), Some("ASK"), "a key the source lacks while migrating: {ask:?}");
    assert_eq!(owner.cmd::<Option<String>>(&["GET", "{job}:a"]).await.as_deref(), Some("1"), "not moved yet");
    assert_eq!(cluster.move_keys(&migration).await, 2);
    let ask = owner.try_cmd::<Option<String>>(&["GET", "{job}:a"]).await;
    assert_eq!(redirect(&ask), Some("ASK"), "a moved key: {ask:?}");
    let mut asking = client::pipe();
    asking.cmd("ASKING").ignore().cmd("GET").arg("{job}:a");
    let mut conn = cluster.node(to).connection().await;
    let (value,): (Option<String>,) = asking.query_async(&mut conn).await.unwrap();
    assert_eq!(value.as_deref(), Some("1"), "the target serves it after ASKING");
    cluster.finish_migration(&migration).await;
    eprintln!("slot {slot} migrated from node{source} to node{to} in {:?}", t1.elapsed());
    assert_eq!(cluster.index_for_slot(slot).await, to);
    assert_eq!(cluster.node(to).cmd::<Option<String>>(&["GET", "{job}:b"]).await.as_deref(), Some("1"));
    let moved = owner.try_cmd::<Option<String>>(&["GET", "{job}:b"]).await;
    assert_eq!(redirect(&moved), Some("MOVED"), "{moved:?}");
    cluster.migrate_slot(slot, source).await;
    assert_eq!(cluster.index_for_slot(slot).await, source, "migrate_slot moves it back");
    assert_eq!(owner.cmd::<Option<String>>(&["GET", "{job}:a"]).await.as_deref(), Some("1"));
    // The keys moved back reach the source's replica asynchronously: wait for it before the kill
    // (under load the replica was seen promoted without `{job}:a`). `WAIT` counts its own
    // connection's writes, and the keys came back by the target's MIGRATE: a write on the same
    // connection, after them in the replication stream, makes the acknowledgement cover them (a
    // `WAIT` alone, on a connection of its own, returned at once and the test failed under load).
    let mut sync = client::pipe();
    sync.cmd("SET").arg("{job}:sync").arg("1").ignore().cmd("WAIT").arg(1).arg(5000);
    let mut conn = owner.connection().await;
    let (acked,): (i64,) = sync.query_async(&mut conn).await.unwrap();
    assert!(acked >= 1, "the source's replica acknowledged its writes ({acked})");

    let t2 = Instant::now();
    cluster.kill_node(source).await;
    cluster.wait_healthy().await;
    let new_owner = cluster.index_for_slot(slot).await;
    eprintln!("node{source} killed; node{new_owner} serves slot {slot} after {:?}", t2.elapsed());
    assert_ne!(new_owner, source);
    assert_eq!(cluster.node(new_owner).cmd::<Option<String>>(&["GET", "{job}:a"]).await.as_deref(), Some("1"));

    cluster.down().await;
    assert!(cluster.nodes().iter().all(|n| !n.is_running()));
    assert!(cluster.node(new_owner).try_cmd::<String>(&["PING"]).await.is_err(), "the cluster is down");
    drop(cluster);
    assert!(!root.exists(), "{} is removed on drop", root.display());
    eprintln!("cluster_starts_and_migrates_a_slot: {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_sentinel_failover_moves_the_master() {
    let t0 = Instant::now();
    let sentinels = RedisSentinels::start().await;
    eprintln!("master, replica and 3 sentinels up in {:?}", t0.elapsed());
    let url = sentinels.url();
    assert!(url.starts_with("redis+sentinel://127.0.0.1:") && url.ends_with("/mymaster"), "{url}");
    assert_eq!(sentinels.master_name(), "mymaster");
    let [first, second] = sentinels.servers();
    assert_eq!(sentinels.current_master_port().await, first.port());
    let _: String = first.cmd(&["SET", "job", "1"]).await;

    let took = sentinels.failover().await;
    eprintln!("forced failover: {took:?}");
    assert_eq!(sentinels.current_master_port().await, second.port());
    assert_eq!(second.role().await, "master");
    assert_eq!(second.cmd::<Option<String>>(&["GET", "job"]).await.as_deref(), Some("1"));
    eprintln!("cluster_sentinel_failover_moves_the_master: {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_sentinel_kill_master_promotes_the_replica() {
    let t0 = Instant::now();
    let sentinels = RedisSentinels::start().await;
    let [first, second] = sentinels.servers();
    let _: String = first.cmd(&["SET", "job", "1"]).await;
    let t1 = Instant::now();
    let killed = sentinels.kill_master().await;
    assert_eq!(killed, first.port());
    assert!(!first.is_running());
    let now = sentinels.wait_master_changed(killed, Duration::from_secs(30)).await;
    eprintln!("master killed; the sentinels promoted port {now} after {:?}", t1.elapsed());
    assert_eq!(now, second.port());
    assert_eq!(sentinels.master().await.port(), second.port());
    assert_eq!(second.cmd::<Option<String>>(&["GET", "job"]).await.as_deref(), Some("1"));
    eprintln!("cluster_sentinel_kill_master_promotes_the_replica: {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_pair_partition_promotes() {
    let t0 = Instant::now();
    let pair = RedisPair::start().await;
    eprintln!("pair up in {:?}", t0.elapsed());
    let mut conn = client::Client::open(pair.client_url()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let _: () = client::cmd("SET").arg("job").arg("1").query_async(&mut conn).await.unwrap();
    pair.wait_caught_up().await;
    assert_eq!(pair.replica.cmd::<Option<String>>(&["GET", "job"]).await.as_deref(), Some("1"));

    pair.cut_link();
    let _: () = client::cmd("SET").arg("job").arg("2").query_async(&mut conn).await.unwrap();
    pair.kill_primary().await;
    pair.promote_replica().await;
    pair.repoint_clients_to_replica();
    let mut conn = client::Client::open(pair.client_url()).unwrap().get_multiplexed_async_connection().await.unwrap();
    let job: Option<String> = client::cmd("GET").arg("job").query_async(&mut conn).await.unwrap();
    assert_eq!(job.as_deref(), Some("1"), "the write after the cut never reached the replica");
    let _: () = client::cmd("SET").arg("job").arg("3").query_async(&mut conn).await.unwrap();
    assert_eq!(pair.replica.cmd::<Option<String>>(&["GET", "job"]).await.as_deref(), Some("3"));
    eprintln!("cluster_pair_partition_promotes: {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_kit_node_kills_and_restarts() {
    let t0 = Instant::now();
    let node = RedisNode::start(&["--maxmemory", "10mb"]).await;
    let port = node.port();
    assert_eq!(node.url(), format!("redis://127.0.0.1:{port}"));
    assert_eq!(node.role().await, "master");
    assert_eq!(node.info_replication().await.get("role").map(String::as_str), Some("master"));
    let config: Vec<String> = node.cmd(&["CONFIG", "GET", "maxmemory"]).await;
    assert_eq!(config, ["maxmemory", "10485760"]);
    node.kill().await;
    assert!(!node.is_running());
    assert!(node.try_cmd::<String>(&["PING"]).await.is_err());
    node.restart().await;
    assert_eq!(node.port(), port);
    assert_eq!(node.cmd::<String>(&["PING"]).await, "PONG");
    let dir = node.dir().to_owned();
    drop(node);
    assert!(!dir.exists());
    eprintln!("cluster_kit_node_kills_and_restarts: {:?}", t0.elapsed());
}

/// The redirection code (`MOVED`, `ASK`) of a failed answer.
fn redirect<T>(answer: &RedisResult<T>) -> Option<&str> {
    answer.as_ref().err().and_then(|e| e.code())
}
