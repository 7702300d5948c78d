//! The `redis-failover` fault (Redis source on a Redis Cluster, `--redis-topology cluster`): the
//! primary that serves the stream's slot loses its replica, works alone, dies, and the replica
//! takes the slots over.
//!
//! ```text
//! workers ──cluster client──► node P (the stream's primary) ──replication──✂──► node R (its replica)
//!                             kill P; CLUSTER FAILOVER TAKEOVER on R; the clients follow the slot map
//! ```
//!
//! How replication is cut without a relay (the cluster's nodes announce their own addresses,
//! so nothing can sit between them): the replica is given replication credentials that the
//! primary does not know (`CONFIG SET masteruser` / `masterauth`), and the primary drops its
//! replica link (`CLIENT KILL TYPE replica`). The replica reconnects once a second, fails at
//! `AUTH`, and so receives nothing more; the workers, which use the default user, are not
//! touched. (Denying `PSYNC` and `SYNC` to the default user by ACL cuts replication as well on
//! Redis 7.0, but the replica then retries without pause, thousands of times a second, at most
//! of a core: a failed `AUTH` waits for the next second.)
//!
//! After `--failover-alone-ms` the primary is SIGKILLed and `CLUSTER FAILOVER TAKEOVER` makes
//! the replica a primary at once, without the other primaries' vote. Everything the primary
//! took alone is lost: the group's reads (`XREADGROUP` moving its last-delivered id), its acks,
//! lease keys and dead letters. The fault measures the acks: entries acknowledged on the old
//! primary just before it died that the new one does not have acknowledged.

use std::collections::BTreeSet;

use brokerfence::redis::client as redis_client;
use brokerfence_testkit::redis_topology::{RedisCluster, RedisNode};

use super::redis_chaos::{GROUP, field};
use super::*;

/// How long the takeover may take until the cluster names the replica the slot's primary.
const TAKEOVER_LIMIT: Duration = Duration::from_secs(20);

/// The failover, in a task of its own (the runner keeps resuming paused workers meanwhile).
/// Recorded in `log` as one `redis-failover` fault on every worker, from the cut until the
/// slot map names the replica.
pub(crate) fn fail_over(
    cluster: Arc<RedisCluster>,
    stream: String,
    alone: Duration,
    log: FaultLog,
) -> tokio::task::JoinHandle<Result<RedisFailoverFigures, String>> {
    tokio::spawn(async move {
        let id = log.open(FaultKind::RedisFailover, Target::All, String::new());
        let steps = steps(cluster, stream, alone, log.clone(), id);
        let result =
            match tokio::time::timeout(alone + TAKEOVER_LIMIT * 2, failover::caught("redis-failover", steps)).await {
                Ok(Ok(r)) => r,
                Ok(Err(e)) => Err(e),
                Err(_) => Err("redis-failover: not done in time".to_owned()),
            };
        match &result {
            Ok(t) => log.annotate(
                id,
                &format!(
                    " {} killed at +{:.1} s, {} took its slots over at +{:.1} s; {} bytes never replicated, {} acks \
                     lost",
                    t.primary,
                    secs(t.cut_ms, t.killed_ms),
                    t.replica,
                    secs(t.cut_ms, t.takeover_ms),
                    t.bytes_not_replicated.map_or("?".to_owned(), |n| n.to_string()),
                    t.acks_lost.map_or("?".to_owned(), |n| n.to_string()),
                ),
            ),
            Err(e) => log.annotate(id, &format!(" failed: {e}")),
        }
        log.close(id);
        result
    })
}

async fn steps(
    cluster: Arc<RedisCluster>,
    stream: String,
    alone: Duration,
    log: FaultLog,
    id: usize,
) -> Result<RedisFailoverFigures, String> {
    let slot = cluster.slot_of(&stream).await;
    let p = cluster.index_for_slot(slot).await;
    let range = cluster.slots().await.into_iter().find(|r| (r.start..=r.end).contains(&slot));
    let replica_port = range.and_then(|r| r.replicas.first().copied()).ok_or("the stream's primary has no replica")?;
    let r = cluster.nodes().iter().position(|n| n.port() == replica_port).ok_or("no node on the replica's port")?;
    let (primary, replica) = (cluster.node(p), cluster.node(r));
    let name = |i: usize, n: &RedisNode| format!("node{i} (port {})", n.port());
    let mut t = RedisFailoverFigures { primary: name(p, primary), replica: name(r, replica), ..Default::default() };

    // Cut: credentials the primary does not know, then the link dropped.
    let secret = format!("{:016x}", rand::random::<u64>());
    for (param, value) in [("masteruser", "brokerfence-chaos-cut"), ("masterauth", secret.as_str())] {
        replica.try_cmd::<String>(&["CONFIG", "SET", param, value]).await.map_err(|e| format!("CONFIG SET: {e}"))?;
    }
    t.cut_ms = now_ms();
    let killed: i64 =
        primary.try_cmd(&["CLIENT", "KILL", "TYPE", "replica"]).await.map_err(|e| format!("CLIENT KILL: {e}"))?;
    let down = wait_for(Duration::from_secs(3), || async {
        replica.info_replication().await.get("master_link_status").is_some_and(|s| s == "down")
    })
    .await;
    log.annotate(
        id,
        &format!(
            "replication of {} to {} cut ({killed} link dropped, the replica's link {}), the primary alone for \
             {:.1} s;",
            t.primary,
            t.replica,
            if down { "down" } else { "NOT down" },
            alone.as_secs_f64()
        ),
    );
    if !down {
        return Err(format!("redis-failover: {} still replicates after the cut", t.replica));
    }
    tokio::time::sleep(alone).await;

    // Just before the kill: what the primary took alone, and what it had acknowledged.
    let offset =
        |info: &std::collections::BTreeMap<String, String>, k: &str| info.get(k).and_then(|v| v.parse::<i64>().ok());
    let ahead = offset(&primary.info_replication().await, "master_repl_offset");
    let behind = offset(&replica.info_replication().await, "slave_repl_offset");
    t.bytes_not_replicated = ahead.zip(behind).map(|(a, b)| a - b);
    let acked_before = acked_on(primary, &stream).await;
    t.killed_ms = now_ms();
    cluster.kill_node(p).await;
    replica
        .try_cmd::<String>(&["CLUSTER", "FAILOVER", "TAKEOVER"])
        .await
        .map_err(|e| format!("CLUSTER FAILOVER TAKEOVER: {e}"))?;
    let took = wait_for(TAKEOVER_LIMIT, || async {
        replica.try_role().await.is_ok_and(|role| role == "master") && cluster.index_for_slot(slot).await == r
    })
    .await;
    if !took {
        return Err(format!("redis-failover: {} did not take slot {slot} over within {TAKEOVER_LIMIT:?}", t.replica));
    }
    t.takeover_ms = now_ms();
    let acked_after = acked_on(replica, &stream).await;
    t.acks_lost = match (acked_before, acked_after) {
        (Ok(before), Ok(after)) => Some(before.difference(&after).count()),
        _ => None,
    };
    Ok(t)
}

/// Polls `check` every 20 ms for up to `within`; whether it came true.
async fn wait_for<F, Fut>(within: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The entries of `stream` the group has acknowledged on `node` (asked directly): those at or
/// below its last-delivered id that are not pending.
async fn acked_on(node: &RedisNode, stream: &str) -> Result<BTreeSet<String>, String> {
    let err = |what: &'static str| move |e: redis_client::RedisError| format!("{what} on {}: {e}", node.name());
    let groups: Vec<Vec<redis_client::Value>> =
        node.try_cmd(&["XINFO", "GROUPS", stream]).await.map_err(err("XINFO"))?;
    let group = groups.iter().find(|g| field(g, "name").is_some_and(|n| n == GROUP)).ok_or("no group")?;
    let last = field(group, "last-delivered-id").and_then(|id| entry_id(&id)).ok_or("no last-delivered-id")?;
    let pending: Vec<(String, String, i64, i64)> =
        node.try_cmd(&["XPENDING", stream, GROUP, "-", "+", "1000000"]).await.map_err(err("XPENDING"))?;
    let pending: BTreeSet<String> = pending.into_iter().map(|(id, ..)| id).collect();
    let entries: Vec<(String, Vec<Vec<u8>>)> =
        node.try_cmd(&["XRANGE", stream, "-", "+"]).await.map_err(err("XRANGE"))?;
    Ok(entries
        .into_iter()
        .map(|(id, _)| id)
        .filter(|id| entry_id(id).is_some_and(|e| e <= last) && !pending.contains(id))
        .collect())
}

/// `ms-seq` as a pair that orders like the stream.
fn entry_id(id: &str) -> Option<(u64, u64)> {
    let (ms, seq) = id.split_once('-')?;
    Some((ms.parse().ok()?, seq.parse().ok()?))
}

fn secs(from_ms: u64, to_ms: u64) -> f64 {
    to_ms.saturating_sub(from_ms) as f64 / 1000.0
}
