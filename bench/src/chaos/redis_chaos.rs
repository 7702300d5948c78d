//! Redis Streams (feature `redis`): a private redis-server, the stream and the source of a worker.

use super::*;
use brokerfence::adapters::redis::client as redis;
use brokerfence::adapters::redis::{KeyFrom, RedisConnections, StreamSource};

/// A redis-server of this run alone, on a free port, persisting every write (AOF, fsync
/// always) so that a restart loses nothing it acknowledged. Never the shared one on 6379.
pub struct RedisBroker {
    port: u16,
    dir: PathBuf,
    child: Option<tokio::process::Child>,
    stream: String,
}

impl RedisBroker {
    pub async fn setup(_c: &ChaosConfig, queue: &QueueName, jobs: &[(String, Kind)]) -> Result<Self, String> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("free port: {e}"))?
            .port();
        let dir = std::env::temp_dir().join(format!("brokerfence-chaos-redis-{port}-{:x}", rand::random::<u32>()));
        std::fs::create_dir_all(&dir).map_err(|e| format!("create {}: {e}", dir.display()))?;
        let mut broker = Self { port, dir, child: None, stream: queue.as_str().to_owned() };
        broker.spawn().await?;
        let client = redis::Client::open(broker.url().as_str()).map_err(|e| e.to_string())?;
        let mut conn = client.get_multiplexed_async_connection().await.map_err(|e| e.to_string())?;
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

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    async fn spawn(&mut self) -> Result<(), String> {
        let child = tokio::process::Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "yes", "--appendfsync", "always", "--daemonize", "no", "--loglevel", "warning"])
            .arg("--dir")
            .arg(&self.dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("spawn redis-server (run `bash localstack/up` to install it): {e}"))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let ping = async {
                let client = redis::Client::open(self.url().as_str()).ok()?;
                let mut c = client.get_multiplexed_async_connection().await.ok()?;
                redis::cmd("PING").query_async::<String>(&mut c).await.ok()
            };
            if ping.await.as_deref() == Some("PONG") {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(format!("private redis-server on port {} did not answer", self.port));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL and start again on the same port and data: connections drop, lease keys that
    /// were not yet written survive only as far as the AOF has them.
    pub async fn restart(&mut self) -> Result<(), String> {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.spawn().await
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// With `via`, the workers connect to that URL (the stall proxy) instead.
    pub fn worker_args(&self, via: Option<String>) -> Vec<String> {
        vec!["--redis-url".into(), via.unwrap_or_else(|| self.url()), "--stream".into(), self.stream.clone()]
    }

    /// Poison jobs found in the dead-letter stream (by the `key` field the copy keeps).
    pub async fn dead_letters(&self, poison: &HashSet<String>) -> Result<usize, String> {
        let client = redis::Client::open(self.url().as_str()).map_err(|e| e.to_string())?;
        let mut conn = client.get_multiplexed_async_connection().await.map_err(|e| e.to_string())?;
        let dead = brokerfence::adapters::redis::sibling_key(&self.stream, ":dead");
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

    pub async fn cleanup(mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub async fn worker_source(o: &WorkerOpts, queue: QueueName) -> Result<StreamSource, String> {
    let url = o.redis_url.clone().ok_or("--redis-url is required for --source redis")?;
    let stream = o.stream.clone().ok_or("--stream is required for --source redis")?;
    let conns = RedisConnections::connect(&url).await.map_err(|e| e.to_string())?;
    Ok(StreamSource::new(conns, queue, stream, "chaos")
        .map_err(|e| e.to_string())?
        .key_from(KeyFrom::Field("key".into()))
        .block(Duration::from_millis(500))
        .max_deliveries(1000))
}
