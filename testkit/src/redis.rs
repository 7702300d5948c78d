//! Support of the Redis tests (`tests/redis/`, feature `redis`): the shared Redis and
//! PostgreSQL of `localstack/up` (each test on its own random key prefix and its own PostgreSQL
//! schema), a private `redis-server` a test may kill and restart, in-process consumers, and Redis
//! commands that ride out a restart.
//!
//! Services come from `REDIS_URL` / `DATABASE_URL` (the environment, else `localstack/.env`). When
//! they are missing the tests fail with a message that says to run `localstack/up`; they never skip.

use std::cell::RefCell;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use brokerfence::redis::RedisConn;
use brokerfence::redis::RedisConnections;
use brokerfence::redis::client::{self, Value, aio::MultiplexedConnection};
use brokerfence::{Consumer, ConsumerConfig, Handler, Source, SourceError};
use brokerfence::{FenceStore, JobRecord, Metrics, MetricsSnapshot, Owner, PgFence, QueueName, SupervisorConfig};
use sqlx::AssertSqlSafe;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use crate::store::{database_url, lease, rand_hex};
pub use crate::wait::wait_for;

/// The shared Redis, or a panic that says what to do.
pub fn redis_url() -> String {
    crate::services::var("REDIS_URL").unwrap_or_else(|| {
        panic!("REDIS_URL is not set and localstack/.env has none: run `localstack/up` first, or export REDIS_URL")
    })
}

/// A consumer configuration: `lease_secs` leases, `concurrency` jobs, short grace, fast acks.
pub fn consumer_config(lease_secs: u64, concurrency: usize) -> ConsumerConfig {
    ConsumerConfig::new(SupervisorConfig::new(lease(lease_secs)))
        .concurrency(concurrency)
        .grace(Duration::from_millis(500))
        .ack_batching(10, Duration::from_millis(5))
}

/// One test's world: a fresh PostgreSQL schema, Redis connections, and a random key prefix.
pub struct Env {
    pub store: PgFence,
    pub redis_url: String,
    pub redis: RedisConnections,
    pub conn: RedisConn,
    pub prefix: String,
}

impl Env {
    /// On the shared Redis.
    pub async fn new() -> Env {
        Self::on(&redis_url()).await
    }

    /// On the Redis at `url`.
    pub async fn on(url: &str) -> Env {
        let store = crate::store::pg().await;
        let redis = RedisConnections::connect(url)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to Redis at {url}: {e}. Run `localstack/up` first."));
        let conn = redis.commands();
        Env { store, redis_url: url.to_owned(), redis, conn, prefix: format!("t-{}", rand_hex()) }
    }

    /// A key name unique to this test.
    pub fn name(&self, what: &str) -> String {
        format!("{}-{what}", self.prefix)
    }

    /// The store as the runtime takes it.
    pub fn store(&self) -> Arc<dyn FenceStore> {
        Arc::new(self.store.clone())
    }

    /// A plain auto-reconnecting connection (a cheap clone).
    pub fn conn(&self) -> RedisConn {
        self.conn.clone()
    }

    /// The job row of `key` in `queue`.
    pub async fn job(&self, queue: &str, key: &str) -> Option<JobRecord> {
        crate::store::job(&self.store, &QueueName::new(queue).expect("queue name"), key).await
    }

    /// All job rows of `queue`: (key, state, epoch, result).
    pub async fn jobs(&self, queue: &str) -> Vec<(String, String, i64, Option<String>)> {
        let s = self.store.get_schema().as_str();
        let rows: Vec<(String, String, i64, Option<Vec<u8>>)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT key, state, epoch, result FROM {s}.jobs WHERE queue = $1 ORDER BY key"
        )))
        .bind(queue.to_owned())
        .fetch_all(self.store.pool())
        .await
        .expect("read job rows");
        rows.into_iter().map(|(k, st, e, r)| (k, st, e, r.map(|r| String::from_utf8_lossy(&r).into_owned()))).collect()
    }

    /// Keys matching `pattern` (SCAN). Retries while the server is away (a restart).
    pub async fn keys(&self, pattern: &str) -> Vec<String> {
        let conn = self.conn();
        let mut cursor: u64 = 0;
        let mut out = Vec::new();
        loop {
            let mut scan = client::cmd("SCAN");
            scan.arg(cursor).arg("MATCH").arg(pattern).arg("COUNT").arg(1000);
            let (next, batch): (u64, Vec<String>) = retry("SCAN", || {
                let (mut c, scan) = (conn.clone(), scan.clone());
                async move { scan.query_async(&mut c).await }
            })
            .await;
            out.extend(batch);
            if next == 0 {
                return out;
            }
            cursor = next;
        }
    }

    /// Drops the schema and this test's keys.
    pub async fn cleanup(&self) {
        crate::store::drop_schema(&self.store).await;
        let keys = self.keys(&format!("*{}*", self.prefix)).await;
        if !keys.is_empty() {
            let _: Result<i64, _> = client::cmd("DEL").arg(&keys).query_async(&mut self.conn()).await;
        }
    }
}

/// A multiplexed connection to `url`.
pub async fn connect(url: &str) -> MultiplexedConnection {
    client::Client::open(url)
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .unwrap_or_else(|e| panic!("cannot connect to Redis at {url}: {e}"))
}

/// Runs a Redis call until it succeeds (a connection manager answers the first call after a
/// server restart with an error while it reconnects), for up to 5 s.
pub async fn retry<T, F, Fut>(what: &str, mut call: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, client::RedisError>>,
{
    let last = RefCell::new(String::new());
    let check = || {
        let (answer, last) = (call(), &last);
        async move { answer.await.map_err(|e| *last.borrow_mut() = e.to_string()).ok() }
    };
    crate::wait::until(Duration::from_secs(5), check, || format!("{what}: {}", last.borrow())).await
}

/// `XADD stream * f v …`; returns the id.
pub async fn xadd(conn: &mut RedisConn, stream: &str, fields: &[(&[u8], &[u8])]) -> String {
    let mut cmd = client::cmd("XADD");
    cmd.arg(stream).arg("*");
    for (f, v) in fields {
        cmd.arg(*f).arg(*v);
    }
    retry("XADD", || {
        let (mut c, cmd) = (conn.clone(), cmd.clone());
        async move { cmd.query_async(&mut c).await }
    })
    .await
}

/// `XADD` of a job with a `key` field and a `body`.
pub async fn xadd_job(conn: &mut RedisConn, stream: &str, key: &str, body: &str) -> String {
    xadd(conn, stream, &[(b"key", key.as_bytes()), (b"body", body.as_bytes())]).await
}

/// Number of pending entries of `group` (0 when the group or stream does not exist).
pub async fn pending_count(conn: &mut RedisConn, stream: &str, group: &str) -> i64 {
    let v: Result<Value, _> = client::cmd("XPENDING").arg(stream).arg(group).query_async(conn).await;
    match v {
        Ok(Value::Array(parts)) => match parts.first() {
            Some(Value::Int(n)) => *n,
            _ => 0,
        },
        _ => 0,
    }
}

/// Pending rows: (id, consumer, idle ms, deliveries).
pub async fn pending_rows(conn: &mut RedisConn, stream: &str, group: &str) -> Vec<(String, String, i64, i64)> {
    client::cmd("XPENDING").arg(stream).arg(group).arg("-").arg("+").arg(100).query_async(conn).await.expect("XPENDING")
}

/// The entries of a stream as (id, field/value pairs).
pub async fn xrange(conn: &mut RedisConn, stream: &str) -> Vec<(String, Vec<(Vec<u8>, Vec<u8>)>)> {
    let raw: Vec<(String, Vec<Vec<u8>>)> =
        client::cmd("XRANGE").arg(stream).arg("-").arg("+").query_async(conn).await.expect("XRANGE");
    raw.into_iter()
        .map(|(id, flat)| (id, flat.chunks(2).map(|c| (c[0].clone(), c.get(1).cloned().unwrap_or_default())).collect()))
        .collect()
}

/// The value of `field` in a field list, as text.
pub fn field_of(fields: &[(Vec<u8>, Vec<u8>)], name: &str) -> Option<String> {
    fields.iter().find(|(k, _)| k == name.as_bytes()).map(|(_, v)| String::from_utf8_lossy(v).into_owned())
}

/// A consumer running in a task of this process.
pub struct Running {
    pub owner: Owner,
    pub metrics: Arc<Metrics>,
    pub stop: CancellationToken,
    pub task: JoinHandle<Result<(), SourceError>>,
}

impl Running {
    /// Counters now.
    pub fn snapshot(&self) -> MetricsSnapshot {
        self.metrics.snapshot()
    }

    /// Stops it (shutdown token) and waits for `run` to return.
    pub async fn shutdown(self, timeout: Duration) -> MetricsSnapshot {
        self.stop.cancel();
        match tokio::time::timeout(timeout, self.task).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => panic!("consumer {} ended with {e}", self.owner),
            Ok(Err(e)) => panic!("consumer {} panicked: {e}", self.owner),
            Err(_) => panic!("consumer {} did not stop within {timeout:?}", self.owner),
        }
        self.metrics.snapshot()
    }
}

/// Starts a consumer of `source` as `owner`.
pub fn spawn_consumer<S: Source, H: Handler>(
    source: S,
    store: Arc<dyn FenceStore>,
    owner: &str,
    config: ConsumerConfig,
    handler: H,
) -> Running {
    let owner = Owner::new(owner).expect("owner");
    let consumer = Consumer::with_owner(source, store, owner.clone(), config);
    let metrics = consumer.metrics();
    let stop = CancellationToken::new();
    let token = stop.clone();
    let task = tokio::spawn(async move { consumer.run(handler, token).await });
    Running { owner, metrics, stop, task }
}

/// A `redis-server` of this test alone (no persistence), on a free port, that the test may kill
/// and restart without disturbing anyone else.
pub struct PrivateRedis {
    pub port: u16,
    child: Option<tokio::process::Child>,
}

impl PrivateRedis {
    /// Starts one and waits until it answers.
    pub async fn start() -> PrivateRedis {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
            l.local_addr().expect("local addr").port()
        };
        let mut r = PrivateRedis { port, child: None };
        r.spawn().await;
        r
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    async fn spawn(&mut self) {
        let child = tokio::process::Command::new("redis-server")
            .args(["--port", &self.port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--daemonize", "no", "--loglevel", "warning"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn redis-server (is it installed? run `localstack/up`)");
        self.child = Some(child);
        let url = self.url();
        wait_for("private redis-server to answer", Duration::from_secs(10), || {
            let url = url.clone();
            async move {
                let client = client::Client::open(url.as_str()).ok()?;
                let mut c = client.get_multiplexed_async_connection().await.ok()?;
                let pong: String = client::cmd("PING").query_async(&mut c).await.ok()?;
                (pong == "PONG").then_some(())
            }
        })
        .await;
    }

    /// Kills it (SIGKILL: everything in it is lost).
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
            let _ = child.wait().await;
        }
    }

    /// Starts it again on the same port, empty.
    pub async fn restart(&mut self) {
        self.kill().await;
        self.spawn().await;
    }

    /// Freezes it (SIGSTOP): it keeps its connections and its data, and answers nothing (the
    /// kernel still accepts new connections) until [`resume`](Self::resume).
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Lets a paused server run again (SIGCONT): it then works through what was sent meanwhile.
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, sig: i32) {
        let child = self.child.as_ref().expect("private redis-server is running");
        crate::process::signal(crate::process::pid(child), sig);
    }

    /// `INFO commandstats` as (command, calls).
    pub async fn command_calls(&self) -> std::collections::HashMap<String, u64> {
        let mut c = connect(&self.url()).await;
        let info: String = client::cmd("INFO").arg("commandstats").query_async(&mut c).await.expect("INFO");
        info.lines()
            .filter_map(|l| {
                let (name, rest) = l.strip_prefix("cmdstat_")?.split_once(':')?;
                let calls = rest.split(',').find_map(|kv| kv.strip_prefix("calls="))?.parse().ok()?;
                Some((name.to_owned(), calls))
            })
            .collect()
    }
}
