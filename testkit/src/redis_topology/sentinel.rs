//! [`RedisSentinels`]: a master, one replica and three sentinels that monitor them (quorum 2),
//! with forced and automatic failovers.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::node::{Launch, RedisNode};
use super::sys::TempRoot;

/// The name the sentinels monitor the master under.
const MASTER_NAME: &str = "mymaster";

/// How many sentinels there are.
const SENTINELS: usize = 3;

/// How long [`RedisSentinels::wait_monitoring`] waits.
const MONITOR_LIMIT: Duration = Duration::from_secs(30);

/// How long [`RedisSentinels::failover`] waits for the new master.
const FAILOVER_LIMIT: Duration = Duration::from_secs(30);

/// How long `SENTINEL FAILOVER` is retried while the sentinel has no replica it may promote yet.
const FAILOVER_ASK_LIMIT: Duration = Duration::from_secs(10);

/// A master and one replica (`--replicaof`), monitored as `mymaster` by three sentinels
/// (`down-after-milliseconds 1000`, `failover-timeout 5000`, `parallel-syncs 1`, quorum 2), each
/// with its own config file (sentinels rewrite theirs). All in one temp dir, on free ports;
/// dropping it kills every process and removes the dir.
pub struct RedisSentinels {
    /// `[primary, replica]` as started: their roles change with failovers.
    servers: [RedisNode; 2],
    sentinels: Vec<RedisNode>,
    /// Dropped after the nodes (fields drop in order), so the dir goes last.
    _root: Arc<TempRoot>,
}

impl RedisSentinels {
    /// Starts the master (`primary`), the replica (`replica`) and the sentinels (`sentinel0`…`2`);
    /// returns once [`wait_monitoring`](Self::wait_monitoring) holds.
    pub async fn start() -> RedisSentinels {
        let root = TempRoot::new();
        let primary = RedisNode::start_in(root.clone(), "primary", Launch::default()).await;
        let replicaof = ["--replicaof".to_owned(), "127.0.0.1".to_owned(), primary.port().to_string()];
        let replica =
            RedisNode::start_in(root.clone(), "replica", Launch { args: replicaof.to_vec(), ..Launch::default() })
                .await;
        let conf = format!(
            "sentinel monitor {MASTER_NAME} 127.0.0.1 {} 2\n\
             sentinel down-after-milliseconds {MASTER_NAME} 1000\n\
             sentinel failover-timeout {MASTER_NAME} 5000\n\
             sentinel parallel-syncs {MASTER_NAME} 1\n",
            primary.port()
        );
        let mut sentinels = Vec::with_capacity(SENTINELS);
        for i in 0..SENTINELS {
            let launch = Launch { conf: Some(conf.clone()), sentinel: true, ..Launch::default() };
            sentinels.push(RedisNode::start_in(root.clone(), &format!("sentinel{i}"), launch).await);
        }
        let topology = RedisSentinels { servers: [primary, replica], sentinels, _root: root };
        topology.wait_monitoring().await;
        topology
    }

    /// `redis+sentinel://127.0.0.1:S1,127.0.0.1:S2,127.0.0.1:S3/mymaster`.
    pub fn url(&self) -> String {
        let addrs: Vec<String> = self.sentinels.iter().map(|s| s.addr().to_string()).collect();
        format!("redis+sentinel://{}/{MASTER_NAME}", addrs.join(","))
    }

    /// `mymaster`.
    pub fn master_name(&self) -> &str {
        MASTER_NAME
    }

    /// The sentinels.
    pub fn sentinels(&self) -> &[RedisNode] {
        &self.sentinels
    }

    /// The two data servers as started: `[primary, replica]` (their roles change with failovers).
    pub fn servers(&self) -> &[RedisNode; 2] {
        &self.servers
    }

    /// The data server on `port`.
    pub fn server_on(&self, port: u16) -> &RedisNode {
        let found = self.servers.iter().find(|s| s.port() == port);
        found.unwrap_or_else(|| panic!("redis_topology: no data server on port {port}"))
    }

    /// The master's port, as the first running sentinel reports it (`SENTINEL GET-MASTER-ADDR-BY-NAME mymaster`).
    pub async fn current_master_port(&self) -> u16 {
        let sentinel = self.sentinels.iter().find(|s| s.is_running()).expect("redis_topology: no sentinel runs");
        let addr: Vec<String> = sentinel.cmd(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME]).await;
        addr.get(1)
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("redis_topology: SENTINEL GET-MASTER-ADDR-BY-NAME answered {addr:?}"))
    }

    /// The data server that is the master now (per [`current_master_port`](Self::current_master_port)).
    pub async fn master(&self) -> &RedisNode {
        self.server_on(self.current_master_port().await)
    }

    /// A forced failover: `SENTINEL FAILOVER mymaster` on the first sentinel (retried while it has
    /// no replica to promote yet), then [`wait_master_changed`](Self::wait_master_changed).
    /// Returns how long it took.
    pub async fn failover(&self) -> Duration {
        let t0 = Instant::now();
        let from = self.current_master_port().await;
        let ask_until = Instant::now() + FAILOVER_ASK_LIMIT;
        loop {
            match self.sentinels[0].try_cmd::<String>(&["SENTINEL", "FAILOVER", MASTER_NAME]).await {
                Ok(_) => break,
                Err(e) if Instant::now() < ask_until && e.to_string().contains("NOGOODSLAVE") => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("redis_topology: SENTINEL FAILOVER {MASTER_NAME}: {e}\n  logs: {}", self.log_paths()),
            }
        }
        self.wait_master_changed(from, FAILOVER_LIMIT).await;
        t0.elapsed()
    }

    /// Crash the master (SIGKILL); returns its port. The sentinels fail over after 1 s
    /// (`down-after-milliseconds`) and an election: [`wait_master_changed`](Self::wait_master_changed).
    pub async fn kill_master(&self) -> u16 {
        let port = self.current_master_port().await;
        self.server_on(port).kill().await;
        port
    }

    /// Waits until every running sentinel reports the same master, not on `from_port`, and that
    /// server answers `ROLE` with `master`; returns its port. Panics after `timeout`.
    pub async fn wait_master_changed(&self, from_port: u16, timeout: Duration) -> u16 {
        let check = || async {
            let mut agreed = None;
            for sentinel in self.sentinels.iter().filter(|s| s.is_running()) {
                let addr: Vec<String> =
                    sentinel.try_cmd(&["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME]).await.ok()?;
                let port: u16 = addr.get(1)?.parse().ok()?;
                if port == from_port || agreed.is_some_and(|p| p != port) {
                    return None;
                }
                agreed = Some(port);
            }
            let port = agreed?;
            let server = self.servers.iter().find(|s| s.port() == port)?;
            (server.try_role().await.ok()? == "master").then_some(port)
        };
        let failure = || {
            format!(
                "redis_topology: the sentinels do not all report a new master (other than port {from_port}) \
                 answering ROLE master within {timeout:?}\n  logs: {}",
                self.log_paths()
            )
        };
        crate::wait::until(timeout, check, failure).await
    }

    /// Waits (up to 30 s) until every running sentinel sees the master up with one replica that is
    /// not down, and the two other sentinels (`SENTINEL MASTER`, `SENTINEL REPLICAS`), and the
    /// replica itself says `master_link_status:up`: after `start`, or before a second failover.
    /// After a forced failover this takes about 10 s: the sentinels turn the old master (which
    /// still says it is a master) into a replica only 8 s after they see it, a rule of Sentinel's.
    pub async fn wait_monitoring(&self) {
        let deadline = tokio::time::Instant::now() + MONITOR_LIMIT;
        loop {
            let Err(why) = self.monitoring().await else { return };
            if tokio::time::Instant::now() >= deadline {
                panic!(
                    "redis_topology: the sentinels do not monitor {MASTER_NAME} fully within {MONITOR_LIMIT:?}: \
                     {why}\n  logs: {}",
                    self.log_paths()
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// `Ok` when the sentinels monitor everything (see [`wait_monitoring`](Self::wait_monitoring)), else what they miss.
    async fn monitoring(&self) -> Result<(), String> {
        let mut replica_port = None;
        for sentinel in self.sentinels.iter().filter(|s| s.is_running()) {
            let name = sentinel.name();
            let master: Vec<String> =
                sentinel.try_cmd(&["SENTINEL", "MASTER", MASTER_NAME]).await.map_err(|e| format!("{name}: {e}"))?;
            let master = pairs(&master);
            let field = |k: &str| master.get(k).map_or("", String::as_str);
            if field("flags") != "master" || field("num-slaves") != "1" || field("num-other-sentinels") != "2" {
                return Err(format!(
                    "{name}: flags={} num-slaves={} num-other-sentinels={}",
                    field("flags"),
                    field("num-slaves"),
                    field("num-other-sentinels")
                ));
            }
            let replicas: Vec<Vec<String>> =
                sentinel.try_cmd(&["SENTINEL", "REPLICAS", MASTER_NAME]).await.map_err(|e| format!("{name}: {e}"))?;
            let replica = replicas.first().map(|r| pairs(r)).unwrap_or_default();
            let field = |k: &str| replica.get(k).map_or("", String::as_str);
            // Not its `master-link-status`: a sentinel refreshes a replica's INFO every 10 s only,
            // so after a failover it says `err` for that long. The replica itself is asked below.
            if field("flags") != "slave" {
                return Err(format!("{name}: the replica's flags={}", field("flags")));
            }
            replica_port = field("port").parse::<u16>().ok();
        }
        let port = replica_port.ok_or("no sentinel runs")?;
        let replica = self.servers.iter().find(|s| s.port() == port).ok_or(format!("no server on port {port}"))?;
        let info: String = replica.try_cmd(&["INFO", "replication"]).await.map_err(|e| format!("{port}: {e}"))?;
        if !info.lines().any(|l| l.trim() == "master_link_status:up") {
            return Err(format!("the replica on port {port} is not linked to its master yet"));
        }
        Ok(())
    }

    /// The log paths of every process, for failure messages.
    fn log_paths(&self) -> String {
        let all = self.servers.iter().chain(&self.sentinels);
        all.map(|n| n.log_path().display().to_string()).collect::<Vec<_>>().join(", ")
    }
}

/// A flat `[field, value, field, value, …]` answer as a map.
fn pairs(flat: &[String]) -> BTreeMap<String, String> {
    flat.chunks_exact(2).map(|kv| (kv[0].clone(), kv[1].clone())).collect()
}
