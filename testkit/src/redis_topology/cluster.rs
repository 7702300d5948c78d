//! [`RedisCluster`]: a Redis Cluster of private nodes made by `redis-cli --cluster create`, with
//! the slot map, slot migrations a test drives step by step, and killed nodes.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use brokerfence::redis::client::{self, Value};

use super::node::{Launch, RedisNode, parse_fields};
use super::sys::{self, TempRoot};

/// The number of hash slots.
const SLOTS: u16 = 16384;

/// How long `redis-cli --cluster create` may take.
const CREATE_LIMIT: Duration = Duration::from_secs(60);

/// How long [`RedisCluster::wait_healthy`] waits.
const HEALTH_LIMIT: Duration = Duration::from_secs(30);

/// How long [`RedisCluster::finish_migration`] waits for every node to agree on the new owner.
const SETTLE_LIMIT: Duration = Duration::from_secs(10);

/// How many keys one `MIGRATE` moves.
const MIGRATE_BATCH: usize = 100;

/// One range of `CLUSTER SLOTS`: slots `start..=end` served by the primary on port `primary`,
/// replicated to the nodes on the ports `replicas` (sorted).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct SlotRange {
    /// The first slot.
    pub start: u16,
    /// The last slot (inclusive).
    pub end: u16,
    /// The port of the primary that serves the range.
    pub primary: u16,
    /// The ports of its replicas that are not failed, sorted.
    pub replicas: Vec<u16>,
}

/// A slot migration under way ([`RedisCluster::begin_migration`]): `slot` moves from the node
/// with index `from` to the node with index `to`. While it lasts, the source answers `ASK` for
/// the slot's keys it no longer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migration {
    /// The slot.
    pub slot: u16,
    /// The index of the source node (the slot's owner when the migration began).
    pub from: usize,
    /// The index of the target node.
    pub to: usize,
}

/// A Redis Cluster of private nodes on free ports (`--cluster-node-timeout 2000`), in one temp
/// dir; dropping it kills every node and removes the dir. Nodes are addressed by their index
/// (`node0`, `node1`, …, in creation order).
pub struct RedisCluster {
    nodes: Vec<RedisNode>,
    /// `CLUSTER MYID` of each node.
    ids: Vec<String>,
    /// The indexes of the primaries right after the creation (the seeds of [`seed_url`](Self::seed_url)).
    seeds: Vec<usize>,
    /// `redis-cli --cluster create`'s output.
    create_log: PathBuf,
    /// Dropped after the nodes (fields drop in order), so the dir goes last.
    _root: Arc<TempRoot>,
}

impl RedisCluster {
    /// `primaries × (1 + replicas_per_primary)` nodes joined by `redis-cli --cluster create
    /// … --cluster-replicas <replicas_per_primary> --cluster-yes` (the slots spread evenly over
    /// the primaries); returns once [`wait_healthy`](Self::wait_healthy) holds. `primaries` must be
    /// 3 or more (`redis-cli` refuses fewer).
    pub async fn start(primaries: usize, replicas_per_primary: usize) -> RedisCluster {
        assert!(primaries >= 3, "redis_topology: a cluster needs at least 3 primaries (redis-cli --cluster create)");
        let root = TempRoot::new();
        let count = primaries * (1 + replicas_per_primary);
        let args =
            ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000"];
        let launch = Launch { cluster: true, args: args.map(str::to_owned).to_vec(), ..Launch::default() };
        let mut starting = tokio::task::JoinSet::new();
        for i in 0..count {
            let (root, launch) = (root.clone(), launch.clone());
            starting.spawn(async move { (i, RedisNode::start_in(root, &format!("node{i}"), launch).await) });
        }
        let mut started = Vec::with_capacity(count);
        while let Some(done) = starting.join_next().await {
            started.push(done.unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic())));
        }
        started.sort_by_key(|(i, _)| *i);
        let nodes: Vec<RedisNode> = started.into_iter().map(|(_, node)| node).collect();

        let create_log = root.path().join("cluster-create.log");
        let mut create = vec!["--cluster".to_owned(), "create".to_owned()];
        create.extend(nodes.iter().map(|n| n.addr().to_string()));
        create.extend(["--cluster-replicas".to_owned(), replicas_per_primary.to_string(), "--cluster-yes".to_owned()]);
        if let Err(e) = sys::redis_cli(&create, &create_log, CREATE_LIMIT).await {
            panic!("redis_topology: {e}\n  node logs: {}", log_paths(&nodes));
        }
        let mut ids = Vec::with_capacity(count);
        for node in &nodes {
            ids.push(node.cmd::<String>(&["CLUSTER", "MYID"]).await);
        }
        let mut cluster = RedisCluster { nodes, ids, seeds: Vec::new(), create_log, _root: root };
        cluster.wait_healthy().await;
        let mut seeds: Vec<usize> = cluster.slots().await.iter().map(|r| cluster.index_of_port(r.primary)).collect();
        seeds.sort_unstable();
        seeds.dedup();
        cluster.seeds = seeds;
        cluster
    }

    /// Every node, by index.
    pub fn nodes(&self) -> &[RedisNode] {
        &self.nodes
    }

    /// The node with index `i`.
    pub fn node(&self, i: usize) -> &RedisNode {
        &self.nodes[i]
    }

    /// The cluster node id (`CLUSTER MYID`) of the node with index `i`.
    pub fn node_id(&self, i: usize) -> &str {
        &self.ids[i]
    }

    /// `redis+cluster://127.0.0.1:P1,127.0.0.1:P2,…`: the primaries as they were at the start.
    pub fn seed_url(&self) -> String {
        let seeds: Vec<String> = self.seeds.iter().map(|&i| self.nodes[i].addr().to_string()).collect();
        format!("redis+cluster://{}", seeds.join(","))
    }

    /// `redis://127.0.0.1:<port>` of every node, by index.
    pub fn node_urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisNode::url).collect()
    }

    /// The indexes of the primaries that serve slots now (from `CLUSTER SLOTS`), sorted.
    pub async fn primary_indexes(&self) -> Vec<usize> {
        let mut primaries: Vec<usize> = self.slots().await.iter().map(|r| self.index_of_port(r.primary)).collect();
        primaries.sort_unstable();
        primaries.dedup();
        primaries
    }

    /// The primaries that serve slots now (from `CLUSTER SLOTS`), in index order.
    pub async fn primaries(&self) -> Vec<&RedisNode> {
        self.primary_indexes().await.into_iter().map(|i| &self.nodes[i]).collect()
    }

    /// `CLUSTER SLOTS` as one running node sees it, sorted by slot.
    pub async fn slots(&self) -> Vec<SlotRange> {
        let node = self.live_node();
        let slots: Value = node.cmd(&["CLUSTER", "SLOTS"]).await;
        parse_slots(slots).unwrap_or_else(|e| panic!("redis_topology: CLUSTER SLOTS of the {}: {e}", node.name()))
    }

    /// The index of the primary that serves `slot` now (from `CLUSTER SLOTS`).
    pub async fn index_for_slot(&self, slot: u16) -> usize {
        let slots = self.slots().await;
        let range = slots.iter().find(|r| (r.start..=r.end).contains(&slot));
        let range = range.unwrap_or_else(|| panic!("redis_topology: no node serves slot {slot}: {slots:?}"));
        self.index_of_port(range.primary)
    }

    /// The primary that serves `slot` now (from `CLUSTER SLOTS`).
    pub async fn node_for_slot(&self, slot: u16) -> &RedisNode {
        &self.nodes[self.index_for_slot(slot).await]
    }

    /// The hash slot of `key` (`CLUSTER KEYSLOT` on a running node).
    pub async fn slot_of(&self, key: &str) -> u16 {
        let slot: i64 = self.live_node().cmd(&["CLUSTER", "KEYSLOT", key]).await;
        u16::try_from(slot).unwrap_or_else(|_| panic!("redis_topology: CLUSTER KEYSLOT {key:?} answered {slot}"))
    }

    /// Moves `slot`, keys and all, to the primary with index `to` (nothing if it serves it
    /// already): [`begin_migration`](Self::begin_migration), [`move_keys`](Self::move_keys),
    /// [`finish_migration`](Self::finish_migration). Clients may keep working meanwhile.
    pub async fn migrate_slot(&self, slot: u16, to: usize) {
        if self.index_for_slot(slot).await == to {
            return;
        }
        let migration = self.begin_migration(slot, to).await;
        self.move_keys(&migration).await;
        self.finish_migration(&migration).await;
    }

    /// Starts moving `slot` to the primary with index `to`: `CLUSTER SETSLOT <slot> IMPORTING
    /// <source-id>` on the target, then `CLUSTER SETSLOT <slot> MIGRATING <target-id>` on the
    /// source. From here until [`finish_migration`](Self::finish_migration), the source answers
    /// `ASK` for the slot's keys it does not hold (any, after [`move_keys`](Self::move_keys)).
    pub async fn begin_migration(&self, slot: u16, to: usize) -> Migration {
        let from = self.index_for_slot(slot).await;
        assert_ne!(from, to, "redis_topology: slot {slot} is on node{to} already");
        let text = slot.to_string();
        let _: String = self.nodes[to].cmd(&["CLUSTER", "SETSLOT", &text, "IMPORTING", &self.ids[from]]).await;
        let _: String = self.nodes[from].cmd(&["CLUSTER", "SETSLOT", &text, "MIGRATING", &self.ids[to]]).await;
        Migration { slot, from, to }
    }

    /// Moves the keys of the migration's slot from the source to the target (`CLUSTER
    /// GETKEYSINSLOT` and `MIGRATE 127.0.0.1 <port> "" 0 5000 KEYS …`, 100 at a time) until the
    /// source holds none; returns how many it moved.
    pub async fn move_keys(&self, migration: &Migration) -> usize {
        let (source, target) = (&self.nodes[migration.from], &self.nodes[migration.to]);
        let (slot, batch) = (migration.slot.to_string(), MIGRATE_BATCH.to_string());
        let mut moved = 0;
        loop {
            let keys: Vec<Vec<u8>> = source.cmd(&["CLUSTER", "GETKEYSINSLOT", &slot, &batch]).await;
            if keys.is_empty() {
                return moved;
            }
            let mut migrate = client::cmd("MIGRATE");
            migrate.arg("127.0.0.1").arg(target.port()).arg("").arg(0).arg(5000).arg("KEYS");
            for key in &keys {
                migrate.arg(key.as_slice());
            }
            // `OK`, or `NOKEY` when every key went (deleted or expired) meanwhile.
            let _: Value = source.query(&migrate).await;
            moved += keys.len();
        }
    }

    /// Ends a migration: moves the keys still on the source, then `CLUSTER SETSLOT <slot> NODE
    /// <target-id>` on the target, the source and every other primary, and waits until every
    /// running node's `CLUSTER SLOTS` gives the slot to the target.
    pub async fn finish_migration(&self, migration: &Migration) {
        let Migration { slot, from, to } = *migration;
        let text = slot.to_string();
        let target_id = self.ids[to].as_str();
        self.move_keys(migration).await;
        let _: String = self.nodes[to].cmd(&["CLUSTER", "SETSLOT", &text, "NODE", target_id]).await;
        let setslot = ["CLUSTER", "SETSLOT", &text, "NODE", target_id];
        for attempt in 1.. {
            match self.nodes[from].try_cmd::<String>(&setslot).await {
                Ok(_) => break,
                // Keys that arrived after the last move (there should be none: the source sends
                // writes of keys it lacks to the target): move them, and try again.
                Err(e) if attempt < 5 && e.to_string().contains("still hold keys") => {
                    self.move_keys(migration).await;
                }
                Err(e) => {
                    panic!("redis_topology: {setslot:?} on node{from} failed: {e}\n{}", self.nodes[from].log_tail())
                }
            }
        }
        for i in self.primary_indexes().await {
            if i != from && i != to {
                let _: String = self.nodes[i].cmd(&["CLUSTER", "SETSLOT", &text, "NODE", target_id]).await;
            }
        }
        let port = self.nodes[to].port();
        let check = || async {
            for node in self.nodes.iter().filter(|n| n.is_running()) {
                let slots: Value = node.try_cmd(&["CLUSTER", "SLOTS"]).await.ok()?;
                let slots = parse_slots(slots).ok()?;
                let owner = slots.iter().find(|r| (r.start..=r.end).contains(&slot)).map(|r| r.primary);
                if owner != Some(port) {
                    return None;
                }
            }
            Some(())
        };
        let failure = || {
            format!(
                "redis_topology: slot {slot} was given to node{to} (port {port}), and not every node agrees \
                 within {SETTLE_LIMIT:?}\n  node logs: {}",
                log_paths(&self.nodes)
            )
        };
        crate::wait::until(SETTLE_LIMIT, check, failure).await;
    }

    /// Crash the node with index `i` (SIGKILL); its replica takes over after the node timeout (2 s)
    /// and an election. [`wait_healthy`](Self::wait_healthy) waits for that.
    pub async fn kill_node(&self, i: usize) {
        self.nodes[i].kill().await;
    }

    /// The whole cluster is down: every node SIGKILLed.
    pub async fn down(&self) {
        for node in &self.nodes {
            node.kill().await;
        }
    }

    /// Waits (up to 30 s) until every running node says `cluster_state:ok` and
    /// `cluster_slots_ok:16384`, all of them give the same `CLUSTER SLOTS`, every node in it
    /// runs, and every running replica's link to its primary is up. After [`kill_node`](Self::kill_node)
    /// that is once the others marked the node failed and (for a primary) its replica took over;
    /// a primary killed without a replica never gets there (panics after 30 s).
    pub async fn wait_healthy(&self) {
        let deadline = tokio::time::Instant::now() + HEALTH_LIMIT;
        loop {
            let Err(why) = self.health().await else { return };
            if tokio::time::Instant::now() >= deadline {
                panic!(
                    "redis_topology: the cluster is not healthy within {HEALTH_LIMIT:?}: {why}\n  \
                     redis-cli --cluster create: {}\n  node logs: {}",
                    self.create_log.display(),
                    log_paths(&self.nodes)
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// `Ok` when the cluster is healthy (see [`wait_healthy`](Self::wait_healthy)), else what is not.
    async fn health(&self) -> Result<(), String> {
        let mut seen: Option<(String, Vec<SlotRange>)> = None;
        let running: Vec<&RedisNode> = self.nodes.iter().filter(|n| n.is_running()).collect();
        if running.is_empty() {
            return Err("no node runs".to_owned());
        }
        for node in &running {
            let name = node.name();
            let info: String = node.try_cmd(&["CLUSTER", "INFO"]).await.map_err(|e| format!("{name}: {e}"))?;
            let info = parse_fields(&info);
            let field = |k: &str| info.get(k).map_or("", String::as_str).to_owned();
            if field("cluster_state") != "ok" || field("cluster_slots_ok") != SLOTS.to_string() {
                return Err(format!(
                    "{name}: cluster_state:{} cluster_slots_ok:{}",
                    field("cluster_state"),
                    field("cluster_slots_ok")
                ));
            }
            let slots: Value = node.try_cmd(&["CLUSTER", "SLOTS"]).await.map_err(|e| format!("{name}: {e}"))?;
            let slots = parse_slots(slots).map_err(|e| format!("{name}: CLUSTER SLOTS: {e}"))?;
            match &seen {
                Some((other, theirs)) if *theirs != slots => {
                    return Err(format!("{name} and {other} disagree: {slots:?} / {theirs:?}"));
                }
                Some(_) => {}
                None => seen = Some((name.to_owned(), slots)),
            }
            let replication: String =
                node.try_cmd(&["INFO", "replication"]).await.map_err(|e| format!("{name}: {e}"))?;
            let replication = parse_fields(&replication);
            let link = replication.get("master_link_status").map_or("", String::as_str);
            if replication.get("role").is_some_and(|r| r == "slave") && link != "up" {
                return Err(format!("{name}: a replica whose master_link_status is {link:?}"));
            }
        }
        let (_, slots) = seen.expect("a running node was asked");
        for range in &slots {
            for port in std::iter::once(&range.primary).chain(&range.replicas) {
                if !running.iter().any(|n| n.port() == *port) {
                    return Err(format!("the slot map names port {port}, which is not running: {range:?}"));
                }
            }
        }
        Ok(())
    }

    /// The first running node; panics when none runs.
    fn live_node(&self) -> &RedisNode {
        let running = self.nodes.iter().find(|n| n.is_running());
        running.unwrap_or_else(|| panic!("redis_topology: no cluster node is running"))
    }

    /// The index of the node on `port`.
    fn index_of_port(&self, port: u16) -> usize {
        let found = self.nodes.iter().position(|n| n.port() == port);
        found.unwrap_or_else(|| panic!("redis_topology: no node of the cluster is on port {port}"))
    }
}

/// The log paths of `nodes`, for failure messages.
fn log_paths(nodes: &[RedisNode]) -> String {
    nodes.iter().map(|n| n.log_path().display().to_string()).collect::<Vec<_>>().join(", ")
}

/// `CLUSTER SLOTS` (`[[start, end, [ip, port, id, …], [replica…]…], …]`) as ranges sorted by slot.
fn parse_slots(value: Value) -> Result<Vec<SlotRange>, String> {
    let ranges: Vec<Vec<Value>> = client::from_redis_value(value).map_err(|e| e.to_string())?;
    let mut parsed = Vec::with_capacity(ranges.len());
    for range in ranges {
        let [start, end, primary, replicas @ ..] = range.as_slice() else {
            return Err(format!("a range of fewer than 3 elements: {range:?}"));
        };
        let number = |v: &Value| client::from_redis_value_ref::<u16>(v).map_err(|e| e.to_string());
        let port = |v: &Value| {
            let node: Vec<Value> = client::from_redis_value_ref(v).map_err(|e| e.to_string())?;
            node.get(1).map_or_else(|| Err(format!("a node without a port: {node:?}")), number)
        };
        let mut replicas = replicas.iter().map(port).collect::<Result<Vec<u16>, String>>()?;
        replicas.sort_unstable();
        parsed.push(SlotRange { start: number(start)?, end: number(end)?, primary: port(primary)?, replicas });
    }
    parsed.sort();
    Ok(parsed)
}
