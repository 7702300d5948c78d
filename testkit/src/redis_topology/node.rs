//! [`RedisNode`]: one private `redis-server` (a plain server, a cluster node or a sentinel) on a
//! free port, a child of the test process, in its own dir of its topology's temp dir.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use brokerfence::redis::client::aio::MultiplexedConnection;
use brokerfence::redis::client::{self, AsyncConnectionConfig, Cmd, FromRedisValue, RedisResult};

use super::sys::{self, TempRoot};

/// How often a first start is tried on new ports when another process took the chosen ones.
const START_ATTEMPTS: usize = 5;

/// How long a start waits for the server to answer PING.
const READY_LIMIT: Duration = Duration::from_secs(10);

/// How long a connection attempt to a node may take.
const CONNECT_LIMIT: Duration = Duration::from_secs(2);

/// How long a command may take (`MIGRATE` is given 5 s itself).
const RESPONSE_LIMIT: Duration = Duration::from_secs(10);

/// What a node is started with, besides what every node gets.
#[derive(Debug, Clone, Default)]
pub(super) struct Launch {
    /// A config file's contents, written into the node's dir before the first start and passed
    /// first (a sentinel's: it rewrites the file, and a restart reads the rewritten one).
    pub(super) conf: Option<String>,
    /// `--sentinel`.
    pub(super) sentinel: bool,
    /// A cluster node: a second free port for `--cluster-port` (the cluster bus).
    pub(super) cluster: bool,
    /// Further arguments (`--name value` pairs).
    pub(super) args: Vec<String>,
}

/// One private `redis-server` (a child of the test process, `kill_on_drop`) on 127.0.0.1 and a
/// free port, with nothing on disk (`--save "" --appendonly no`; a cluster node keeps its
/// `nodes.conf`, a sentinel its config), logging to `<dir>/redis.log`. Dropping it SIGKILLs the
/// server and removes its dir.
pub struct RedisNode {
    /// The node's name in its topology (`node0`, `primary`, `sentinel1`): also its dir's name.
    name: String,
    dir: PathBuf,
    logfile: PathBuf,
    port: AtomicU16,
    /// The cluster bus port (0 when not a cluster node).
    bus_port: AtomicU16,
    launch: Launch,
    /// The server while it runs.
    child: Mutex<Option<tokio::process::Child>>,
    /// Keeps the topology's temp dir until its last node is dropped.
    _root: Arc<TempRoot>,
}

impl RedisNode {
    /// A `redis-server` alone in its own temp dir, with `args` added to the command line (e.g.
    /// `&["--maxmemory", "10mb"]`); returns once it answers PING.
    pub async fn start(args: &[&str]) -> RedisNode {
        let launch = Launch { args: args.iter().map(|a| (*a).to_owned()).collect(), ..Launch::default() };
        RedisNode::start_in(TempRoot::new(), "node", launch).await
    }

    /// A node `name` in `root`, started (on new ports while another process takes the chosen ones).
    pub(super) async fn start_in(root: Arc<TempRoot>, name: &str, launch: Launch) -> RedisNode {
        let dir = root.subdir(name);
        if let Some(conf) = &launch.conf {
            let path = dir.join("redis.conf");
            std::fs::write(&path, conf).unwrap_or_else(|e| panic!("redis_topology: write {}: {e}", path.display()));
        }
        let node = RedisNode {
            name: name.to_owned(),
            logfile: dir.join("redis.log"),
            dir,
            port: AtomicU16::new(0),
            bus_port: AtomicU16::new(0),
            launch,
            child: Mutex::new(None),
            _root: root,
        };
        for attempt in 1..=START_ATTEMPTS {
            node.port.store(sys::free_port(), Ordering::SeqCst);
            if node.launch.cluster {
                node.bus_port.store(sys::free_port(), Ordering::SeqCst);
            }
            let seen = sys::read_lossy(&node.logfile).len();
            let Err(e) = node.try_start().await else { return node };
            let log = sys::read_lossy(&node.logfile);
            let raced = log.get(seen..).is_some_and(|new| new.contains("Address already in use"));
            if !raced || attempt == START_ATTEMPTS {
                panic!("redis_topology: the {} did not start: {e}\n{}", node.name, node.log_tail());
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// Spawns the server on its ports and waits until it answers PING (or has exited).
    async fn try_start(&self) -> Result<(), String> {
        let mut cmd = tokio::process::Command::new(sys::program("redis-server"));
        if self.launch.conf.is_some() {
            cmd.arg(self.dir.join("redis.conf"));
        }
        if self.launch.sentinel {
            cmd.arg("--sentinel");
        }
        cmd.args(["--port", &self.port().to_string(), "--bind", "127.0.0.1", "--daemonize", "no"]);
        cmd.args(["--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0"]);
        cmd.args(["--enable-debug-command", "local"]);
        cmd.arg("--dir").arg(&self.dir).arg("--logfile").arg(&self.logfile);
        cmd.arg("--pidfile").arg(self.dir.join("redis.pid"));
        if self.launch.cluster {
            cmd.args(["--cluster-port", &self.bus_port.load(Ordering::SeqCst).to_string()]);
        }
        cmd.args(&self.launch.args);
        // Errors before the log file is open (a bad argument) go to stderr: into the same log.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.logfile)
            .map_err(|e| format!("open {}: {e}", self.logfile.display()))?;
        let log2 = log.try_clone().map_err(|e| format!("dup {}: {e}", self.logfile.display()))?;
        // Its own working dir, which is how the sweep of a dead test process finds it.
        cmd.current_dir(&self.dir).stdin(Stdio::null()).stdout(log).stderr(log2).kill_on_drop(true);
        let child = cmd.spawn().map_err(|e| {
            let program = sys::program("redis-server");
            format!("cannot start {}: {e} (`bash localstack/up` installs it)", program.display())
        })?;
        *self.child.lock().unwrap_or_else(|p| p.into_inner()) = Some(child);
        let deadline = tokio::time::Instant::now() + READY_LIMIT;
        loop {
            let exited = {
                let mut guard = self.child.lock().unwrap_or_else(|p| p.into_inner());
                match guard.as_mut().map(tokio::process::Child::try_wait) {
                    Some(Ok(Some(status))) => {
                        *guard = None;
                        Some(status.to_string())
                    }
                    _ => None,
                }
            };
            if let Some(status) = exited {
                return Err(format!("redis-server exited ({status}) on port {}", self.port()));
            }
            if self.try_cmd::<String>(&["PING"]).await.is_ok() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!("no PONG on port {} within {READY_LIMIT:?}", self.port()));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// The node's name in its topology (`node0`…, `primary`, `replica`, `sentinel0`…): also its dir's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The TCP port.
    pub fn port(&self) -> u16 {
        self.port.load(Ordering::SeqCst)
    }

    /// 127.0.0.1:[`port`](Self::port).
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port()))
    }

    /// `redis://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port())
    }

    /// The node's dir (its log, pid file, `nodes.conf` or sentinel config).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The log file (`<dir>/redis.log`).
    pub fn log_path(&self) -> &Path {
        &self.logfile
    }

    /// The last 30 lines of the log, indented, for a failure message.
    pub fn log_tail(&self) -> String {
        sys::tail(&self.logfile)
    }

    /// Whether the server was started and has not been killed (nor exited by itself).
    pub fn is_running(&self) -> bool {
        let mut guard = self.child.lock().unwrap_or_else(|p| p.into_inner());
        match guard.as_mut().map(tokio::process::Child::try_wait) {
            Some(Ok(None)) => true,
            Some(_) => {
                *guard = None;
                false
            }
            None => false,
        }
    }

    /// Crash: SIGKILL, and wait until the process is gone. Nothing if it is not running.
    pub async fn kill(&self) {
        let child = self.child.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(mut child) = child {
            let _ = child.kill().await;
        }
    }

    /// Start again after a [`kill`](Self::kill), on the same port and with the same arguments (a
    /// cluster node rejoins with its `nodes.conf`, a sentinel reads its rewritten config); panics
    /// when it does not answer.
    pub async fn restart(&self) {
        self.kill().await;
        if let Err(e) = self.try_start().await {
            panic!("redis_topology: the {} did not start again: {e}\n{}", self.name, self.log_tail());
        }
    }

    /// A new connection to the node (connect limit 2 s, response limit 10 s).
    pub async fn try_connection(&self) -> RedisResult<MultiplexedConnection> {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECT_LIMIT))
            .set_response_timeout(Some(RESPONSE_LIMIT));
        client::Client::open(self.url())?.get_multiplexed_async_connection_with_config(&config).await
    }

    /// [`try_connection`](Self::try_connection) that panics (with the log tail) on failure.
    pub async fn connection(&self) -> MultiplexedConnection {
        match self.try_connection().await {
            Ok(conn) => conn,
            Err(e) => panic!("redis_topology: connect to the {} ({}): {e}\n{}", self.name, self.url(), self.log_tail()),
        }
    }

    /// Runs `cmd` on a new connection to the node.
    pub async fn try_query<T: FromRedisValue>(&self, cmd: &Cmd) -> RedisResult<T> {
        let mut conn = self.try_connection().await?;
        cmd.query_async(&mut conn).await
    }

    /// [`try_query`](Self::try_query) that panics (naming the command, with the log tail) on failure.
    pub async fn query<T: FromRedisValue>(&self, cmd: &Cmd) -> T {
        match self.try_query(cmd).await {
            Ok(v) => v,
            Err(e) => panic!(
                "redis_topology: on the {} ({}), {:?} failed: {e}\n{}",
                self.name,
                self.url(),
                cmd.args_iter().map(arg_text).collect::<Vec<_>>(),
                self.log_tail()
            ),
        }
    }

    /// Runs the command `args` (`&["CLUSTER", "INFO"]`) on a new connection to the node.
    pub async fn try_cmd<T: FromRedisValue>(&self, args: &[&str]) -> RedisResult<T> {
        self.try_query(&command(args)).await
    }

    /// [`try_cmd`](Self::try_cmd) that panics (naming the command, with the log tail) on failure.
    pub async fn cmd<T: FromRedisValue>(&self, args: &[&str]) -> T {
        self.query(&command(args)).await
    }

    /// `INFO <section>` as field → value (the `# Section` headers and blank lines left out).
    pub async fn info(&self, section: &str) -> BTreeMap<String, String> {
        parse_fields(&self.cmd::<String>(&["INFO", section]).await)
    }

    /// `INFO replication` as field → value (`role`, `master_link_status`, `master_repl_offset`, `connected_slaves`, …).
    pub async fn info_replication(&self) -> BTreeMap<String, String> {
        self.info("replication").await
    }

    /// The first element of `ROLE`: `master`, `slave` or `sentinel`; panics when the node does not answer.
    pub async fn role(&self) -> String {
        match self.try_role().await {
            Ok(role) => role,
            Err(e) => panic!("redis_topology: ROLE of the {} ({}): {e}\n{}", self.name, self.url(), self.log_tail()),
        }
    }

    /// [`role`](Self::role) that returns the failure instead of panicking.
    pub async fn try_role(&self) -> RedisResult<String> {
        let role: Vec<client::Value> = self.try_cmd(&["ROLE"]).await?;
        let first = role.first().cloned().unwrap_or(client::Value::Nil);
        Ok(client::from_redis_value::<String>(first)?)
    }
}

impl Drop for RedisNode {
    /// SIGKILLs the server (waiting until it no longer runs), then removes the node's dir.
    fn drop(&mut self) {
        let child = self.child.get_mut().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(pid) = child.as_ref().and_then(tokio::process::Child::id) {
            sys::kill_and_settle(pid);
        }
        // Dropped after the kill: tokio reaps it.
        drop(child);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The command `args[0]` with the arguments `args[1..]`.
fn command(args: &[&str]) -> Cmd {
    let (name, rest) = args.split_first().expect("redis_topology: a command needs a name");
    let mut cmd = client::cmd(name);
    for arg in rest {
        cmd.arg(*arg);
    }
    cmd
}

/// One argument of a command, as text for a failure message.
fn arg_text(arg: client::Arg<&[u8]>) -> String {
    match arg {
        client::Arg::Simple(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        // `Arg::Cursor`, and whatever a later version adds.
        _ => "<cursor>".to_owned(),
    }
}

/// `field:value` lines (INFO, CLUSTER INFO) as a map; other lines left out.
pub(super) fn parse_fields(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| line.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}
