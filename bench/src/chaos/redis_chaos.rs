//! Redis Streams (feature `redis`): the run's private Redis (one server, or a Redis Cluster with
//! `--redis-topology cluster`), the stream, and the source of a worker.

use super::*;
use brokerfence::redis::client as redis;
use brokerfence::redis::{KeyFrom, RedisConn, RedisConnections, StreamSource};
use brokerfence_testkit::redis_topology::RedisCluster;

/// The consumer group the workers read the stream as.
pub(crate) const GROUP: &str = "chaos";

/// The run's Redis, never the shared one on 6379.
enum Server {
    /// A redis-server on a free port, persisting every write (AOF, fsync always) so that a
    /// restart loses nothing it acknowledged.
    Single(Box<Single>),
    /// A Redis Cluster of 3 primaries with a replica each (nothing on disk).
    Cluster(Arc<RedisCluster>),
}

/// The one server: its port, its dir (the AOF), the process while it runs.
struct Single {
    port: u16,
    dir: PathBuf,
    child: Option<tokio::process::Child>,
}

/// The run's Redis and its stream.
pub struct RedisBroker {
    server: Server,
    stream: String,
}

impl RedisBroker {
    pub async fn setup(c: &ChaosConfig, queue: &QueueName, jobs: &[(String, Kind)]) -> Result<Self, String> {
        let stream = queue.as_str().to_owned();
        let broker = match c.redis_topology {
            RedisTopology::Single => {
                let port = std::net::TcpListener::bind("127.0.0.1:0")
                    .and_then(|l| l.local_addr())
                    .map_err(|e| format!("free port: {e}"))?
                    .port();
                let dir =
                    std::env::temp_dir().join(format!("brokerfence-chaos-redis-{port}-{:x}", rand::random::<u32>()));
                std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
                let mut broker = Self { server: Server::Single(Box::new(Single { port, dir, child: None })), stream };
                broker.spawn().await?;
                broker
            }
            RedisTopology::Cluster => {
                let what = "start a Redis Cluster of 3 primaries with a replica each (needs redis-server and \
                            redis-cli: run `bash localstack/up`)";
                let cluster = failover::caught(what, RedisCluster::start(3, 1)).await?;
                Self { server: Server::Cluster(Arc::new(cluster)), stream }
            }
        };
        let mut conn = broker.conn().await?;
        for chunk in jobs.chunks(500) {
            let mut pipe = redis::pipe();
            for (key, kind) in chunk {
                pipe.cmd("XADD")
                    .arg(&broker.stream)
                    .arg("*")
                    .arg("key")
                    .arg(key)
                    .arg("body")
                    .arg(payload_of(*kind))
                    .ignore();
            }
            pipe.query_async::<()>(&mut conn).await.map_err(|e| format!("XADD: {e}"))?;
        }
        Ok(broker)
    }

    /// `redis://127.0.0.1:PORT`, or the cluster's `redis+cluster://` seed URL.
    pub fn url(&self) -> String {
        match &self.server {
            Server::Single(s) => format!("redis://127.0.0.1:{}", s.port),
            Server::Cluster(cluster) => cluster.seed_url(),
        }
    }

    /// The cluster, when the run has one.
    pub fn cluster(&self) -> Option<&Arc<RedisCluster>> {
        match &self.server {
            Server::Cluster(cluster) => Some(cluster),
            Server::Single(_) => None,
        }
    }

    /// The stream key.
    pub fn stream(&self) -> &str {
        &self.stream
    }

    /// A new connection (a restarted server breaks the old ones; the runner asks rarely).
    async fn conn(&self) -> Result<RedisConn, String> {
        let conns = RedisConnections::connect(&self.url()).await.map_err(|e| format!("connect to Redis: {e}"))?;
        Ok(conns.commands())
    }

    async fn spawn(&mut self) -> Result<(), String> {
        let url = self.url();
        let Server::Single(single) = &mut self.server else { return Ok(()) };
        let Single { port, dir, child } = &mut **single;
        let spawned = tokio::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "yes", "--appendfsync", "always", "--daemonize", "no", "--loglevel", "warning"])
            .arg("--dir")
            .arg(&*dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("spawn redis-server (run `bash localstack/up` to install it): {e}"))?;
        *child = Some(spawned);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let ping = async {
                let client = redis::Client::open(url.as_str()).ok()?;
                let mut c = client.get_multiplexed_async_connection().await.ok()?;
                redis::cmd("PING").query_async::<String>(&mut c).await.ok()
            };
            if ping.await.as_deref() == Some("PONG") {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("private redis-server on port {port} did not answer"));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// One server: SIGKILL and start again on the same port and data (connections drop, lease
    /// keys that were not yet written survive only as far as the AOF has them). Nothing on a
    /// cluster (the run does not offer the fault there).
    pub async fn restart(&mut self) -> Result<(), String> {
        if let Server::Single(single) = &mut self.server
            && let Some(mut child) = single.child.take()
        {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.spawn().await
    }

    /// The port of the one server (the stall proxy's upstream); `None` on a cluster, whose
    /// clients connect to the addresses the nodes announce, so no proxy can sit in front of it.
    pub fn port(&self) -> Option<u16> {
        match &self.server {
            Server::Single(s) => Some(s.port),
            Server::Cluster(_) => None,
        }
    }

    /// With `via`, the workers connect to that URL (the stall proxy) instead.
    pub fn worker_args(&self, via: Option<String>) -> Vec<String> {
        vec!["--redis-url".into(), via.unwrap_or_else(|| self.url()), "--stream".into(), self.stream.clone()]
    }

    /// Poison jobs found in the dead-letter stream (by the `key` field the copy keeps).
    pub async fn dead_letters(&self, poison: &HashSet<String>) -> Result<usize, String> {
        let mut conn = self.conn().await?;
        let dead = brokerfence::redis::sibling_key(&self.stream, ":dead");
        type Entries = Vec<(String, Vec<(Vec<u8>, Vec<u8>)>)>;
        let entries: Entries = redis::cmd("XRANGE")
            .arg(&dead)
            .arg("-")
            .arg("+")
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        let found: HashSet<String> = entries
            .iter()
            .filter_map(|(_, fields)| {
                fields.iter().find(|(k, _)| k == b"key").map(|(_, v)| String::from_utf8_lossy(v).into_owned())
            })
            .filter(|k| poison.contains(k))
            .collect();
        Ok(found.len())
    }

    /// Entries of the group not yet acknowledged: pending (delivered, not acked) plus not yet
    /// delivered (`lag`), from `XINFO GROUPS`.
    pub async fn unsettled(&self) -> Result<u64, String> {
        let mut conn = self.conn().await?;
        let groups: Vec<Vec<redis::Value>> = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&self.stream)
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        let group = groups.iter().find(|g| field(g, "name").is_some_and(|n| n == GROUP));
        let number = |name: &str| group.and_then(|g| field(g, name)).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        Ok(number("pending") + number("lag"))
    }

    pub async fn cleanup(self) {
        match self.server {
            Server::Single(single) => {
                let Single { dir, child, .. } = *single;
                if let Some(mut child) = child {
                    let _ = child.start_kill();
                    let _ = child.wait().await;
                }
                let _ = std::fs::remove_dir_all(&dir);
            }
            // The nodes' drops wait until each is gone: off the runtime's worker threads.
            Server::Cluster(cluster) => {
                let _ = tokio::task::spawn_blocking(move || drop(cluster)).await;
            }
        }
    }
}

/// The value of `name` in a flat `[name, value, …]` reply, as text.
pub(crate) fn field(flat: &[redis::Value], name: &str) -> Option<String> {
    flat.chunks_exact(2).find_map(|kv| {
        let key: String = redis::from_redis_value_ref(&kv[0]).ok()?;
        if key != name {
            return None;
        }
        match &kv[1] {
            redis::Value::Int(n) => Some(n.to_string()),
            other => redis::from_redis_value_ref::<String>(other).ok(),
        }
    })
}

pub async fn worker_source(o: &WorkerOpts, queue: QueueName) -> Result<StreamSource, String> {
    let url = o.redis_url.clone().ok_or("--redis-url is required for --source redis")?;
    let stream = o.stream.clone().ok_or("--stream is required for --source redis")?;
    let conns = RedisConnections::connect(&url).await.map_err(|e| e.to_string())?;
    Ok(StreamSource::new(conns, queue, stream, GROUP)
        .map_err(|e| e.to_string())?
        .key_from(KeyFrom::Field("key".into()))
        .block(Duration::from_millis(500))
        .max_deliveries(1000))
}
