//! [`PgServer`]: one private PostgreSQL server on a free port, started by `pg_ctl` from a data dir
//! in its topology's temp dir; torn down on drop.
//!
//! Primaries start as a copy (`cp -a`) of a template data dir `initdb` made once per test process;
//! standbys as a `pg_basebackup` of their primary. The port and the socket dir are given on
//! `pg_ctl`'s `-o`, so a base backup carries none of them over.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::sys::{self, TempRoot};

/// The settings of every server, appended to the template's `postgresql.conf`.
const SETTINGS: &str = "
# brokerfence pg_topology
listen_addresses = '127.0.0.1'
wal_level = replica
max_wal_senders = 10
max_replication_slots = 10
hot_standby = on
fsync = off
synchronous_commit = on
full_page_writes = on
wal_keep_size = '256MB'
shared_buffers = '32MB'
max_connections = 100
autovacuum = off
logging_collector = off
log_line_prefix = '%m [%p] %q%a '
# A standby whose link was cut reconnects 1 s after the cut ends (default 5 s).
wal_retrieve_retry_interval = '1s'
";

/// The template's `pg_hba.conf`: trust on 127.0.0.1 and the socket, for queries and replication.
const HBA: &str = "\
host all all 127.0.0.1/32 trust
host replication all 127.0.0.1/32 trust
local all all trust
local replication all trust
";

/// How often a server start is retried on a new port when another process took the chosen one.
const START_ATTEMPTS: usize = 5;

/// The limit on `initdb`, `cp -a`, `pg_basebackup` and every `pg_ctl` call (which itself waits at
/// most 60 s).
const COMMAND_LIMIT: Duration = Duration::from_secs(120);

/// How long [`PgServer::promote`] waits for the end of recovery after `pg_ctl promote`.
const PROMOTE_LIMIT: Duration = Duration::from_secs(30);

/// One private PostgreSQL server (a child of the test process), torn down on drop.
pub struct PgServer {
    /// The server's name in its topology (`primary`, `standby`): also its dir's name.
    name: String,
    /// `<root>/<name>`: data dir, socket dir and log.
    dir: PathBuf,
    data: PathBuf,
    sock: PathBuf,
    logfile: PathBuf,
    port: AtomicU16,
    /// The postmaster's pid while it runs (from `postmaster.pid`), for the SIGKILL in Drop.
    pid: Mutex<Option<i32>>,
    /// Keeps the topology's temp dir until its last server is dropped.
    _root: Arc<TempRoot>,
}

impl PgServer {
    /// A fresh primary alone in its own temp dir (the database `postgres`, superuser `postgres`, trust).
    pub async fn new_primary() -> PgServer {
        PgServer::primary_in(TempRoot::new(), "primary", "").await
    }

    /// A primary `name` in `root`, copied from the template, with `auto_conf` appended to its
    /// `postgresql.auto.conf` (settings only the primary gets), started.
    pub(super) async fn primary_in(root: Arc<TempRoot>, name: &str, auto_conf: &str) -> PgServer {
        let template = template().await;
        let server = PgServer::prepare(root, name);
        let mut cp = sys::command(Path::new("cp"), false);
        cp.arg("-a").arg(template).arg(&server.data);
        let what = format!("cp -a {} {}", template.display(), server.data.display());
        sys::run(cp, None, &what, COMMAND_LIMIT).await.unwrap_or_else(|e| panic!("pg_topology: {e}"));
        if !auto_conf.is_empty() {
            append(&server.data.join("postgresql.auto.conf"), auto_conf);
        }
        server.start_first().await;
        server
    }

    /// A standby `name` in `root`: a base backup taken through 127.0.0.1:`upstream_port` (the
    /// replication relay), streaming from there as `application_name=<name>`, started.
    pub(super) async fn standby_in(root: Arc<TempRoot>, name: &str, upstream_port: u16) -> PgServer {
        let server = PgServer::prepare(root, name);
        let mut backup = sys::command(&sys::pg_program("pg_basebackup"), true);
        backup.args(["-h", "127.0.0.1", "-p", &upstream_port.to_string(), "-U", "postgres", "-D"]);
        backup.arg(&server.data).args(["-R", "-X", "stream", "--no-sync", "-c", "fast"]);
        let what = format!("pg_basebackup of the {name} through port {upstream_port}");
        sys::run(backup, None, &what, COMMAND_LIMIT).await.unwrap_or_else(|e| panic!("pg_topology: {e}"));
        // The primary's own settings (synchronous replication) stay with the primary: a promoted
        // standby must not wait for a standby of its own.
        let auto = server.data.join("postgresql.auto.conf");
        let text = sys::read_lossy(&auto);
        let dropped = ["primary_conninfo", "synchronous_standby_names", "synchronous_commit"];
        let mut lines: Vec<String> = text
            .lines()
            .filter(|line| !dropped.contains(&line.split('=').next().unwrap_or_default().trim()))
            .map(str::to_owned)
            .collect();
        lines.push(format!(
            "primary_conninfo = 'host=127.0.0.1 port={upstream_port} user=postgres application_name={name}'"
        ));
        std::fs::write(&auto, lines.join("\n") + "\n")
            .unwrap_or_else(|e| panic!("pg_topology: write {}: {e}", auto.display()));
        server.start_first().await;
        server
    }

    /// The server's dirs in `root` (created), on a free port; nothing started yet.
    fn prepare(root: Arc<TempRoot>, name: &str) -> PgServer {
        let dir = root.subdir(name);
        let sock = dir.join("sock");
        std::fs::create_dir(&sock).unwrap_or_else(|e| panic!("pg_topology: create {}: {e}", sock.display()));
        sys::own(&sock);
        PgServer {
            name: name.to_owned(),
            data: dir.join("data"),
            logfile: dir.join("postgres.log"),
            sock,
            dir,
            port: AtomicU16::new(sys::free_port()),
            pid: Mutex::new(None),
            _root: root,
        }
    }

    /// The first start: on a port another process took meanwhile, again on a new one.
    async fn start_first(&self) {
        for attempt in 1..=START_ATTEMPTS {
            let seen = sys::read_lossy(&self.logfile).len();
            let Err(e) = self.try_start().await else { return };
            let log = sys::read_lossy(&self.logfile);
            let raced = log.get(seen..).is_some_and(|new| new.contains("Address already in use"));
            if !raced || attempt == START_ATTEMPTS {
                panic!("pg_topology: the {} did not start: {e}\n{}", self.name, sys::tail(&self.logfile));
            }
            self.port.store(sys::free_port(), Ordering::SeqCst);
        }
    }

    /// `pg_ctl start -w` on the server's port and socket dir; records the postmaster's pid.
    async fn try_start(&self) -> Result<(), String> {
        let options = format!("-p {} -k {}", self.port(), self.sock.display());
        let mut cmd = self.pg_ctl();
        cmd.arg("-l").arg(&self.logfile).args(["-w", "-t", "60", "-o", &options, "start"]);
        sys::run(cmd, None, &format!("pg_ctl start ({})", self.name), COMMAND_LIMIT).await?;
        *self.pid.lock().unwrap_or_else(|p| p.into_inner()) = self.pid_file();
        Ok(())
    }

    /// `pg_ctl -D <data>`, run as PostgreSQL's user.
    fn pg_ctl(&self) -> tokio::process::Command {
        let mut cmd = sys::command(&sys::pg_program("pg_ctl"), true);
        cmd.arg("-D").arg(&self.data);
        cmd
    }

    /// Runs `pg_ctl <args>`; panics with the log tail when it fails.
    async fn pg_ctl_run(&self, args: &[&str]) {
        let mut cmd = self.pg_ctl();
        cmd.args(args);
        let what = format!("pg_ctl {} ({})", args.join(" "), self.name);
        if let Err(e) = sys::run(cmd, None, &what, COMMAND_LIMIT).await {
            panic!("pg_topology: {e}\n{}", sys::tail(&self.logfile));
        }
    }

    /// The postmaster's pid from `postmaster.pid` (first line), if the file is there.
    fn pid_file(&self) -> Option<i32> {
        sys::read_lossy(&self.data.join("postmaster.pid")).lines().next()?.trim().parse().ok()
    }

    /// The server's name in its topology (`primary`, `standby`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// 127.0.0.1:[`port`](Self::port).
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port()))
    }

    /// The server's TCP port.
    pub fn port(&self) -> u16 {
        self.port.load(Ordering::SeqCst)
    }

    /// The data dir (owned by the `postgres` OS user when the tests run as root).
    pub fn data_dir(&self) -> &Path {
        &self.data
    }

    /// `postgres://postgres@127.0.0.1:<port>/<db>` (the database `postgres` exists; `create_database` makes others).
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port())
    }

    /// `CREATE DATABASE "<name>"`.
    pub async fn create_database(&self, name: &str) {
        self.psql("postgres", &format!("CREATE DATABASE \"{}\"", name.replace('"', "\"\""))).await;
    }

    /// Runs SQL as the superuser through psql (`psql -X -q -At -v ON_ERROR_STOP=1`, the SQL on stdin, so each statement is its own transaction), returns stdout trimmed; panics with stderr on failure.
    pub async fn psql(&self, db: &str, sql: &str) -> String {
        match self.try_psql(db, sql).await {
            Ok(out) => out,
            Err(e) => {
                panic!("pg_topology: on the {} ({db}), {sql:?} failed: {e}\n{}", self.name, sys::tail(&self.logfile))
            }
        }
    }

    /// [`psql`](Self::psql) that returns the failure (psql's stderr) instead of panicking.
    pub async fn try_psql(&self, db: &str, sql: &str) -> Result<String, String> {
        sys::psql(self.port(), "postgres", db, sql).await
    }

    /// Crash: `pg_ctl stop -m immediate` (no checkpoint; what a dead host looks like to the standby).
    pub async fn kill(&self) {
        self.pg_ctl_run(&["-m", "immediate", "-w", "-t", "60", "stop"]).await;
        *self.pid.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Clean stop (`-m fast`).
    pub async fn stop(&self) {
        self.pg_ctl_run(&["-m", "fast", "-w", "-t", "60", "stop"]).await;
        *self.pid.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// Start again after a stop/kill (same data dir/port).
    pub async fn start(&self) {
        if let Err(e) = self.try_start().await {
            panic!("pg_topology: the {} did not start again: {e}\n{}", self.name, sys::tail(&self.logfile));
        }
    }

    /// `pg_ctl promote -w`, then waits until `pg_is_in_recovery()` is false.
    pub async fn promote(&self) {
        self.pg_ctl_run(&["-w", "-t", "60", "promote"]).await;
        let check = || async { (!self.is_in_recovery().await).then_some(()) };
        let failure = || {
            format!(
                "pg_topology: the {} still in recovery {PROMOTE_LIMIT:?} after pg_ctl promote\n{}",
                self.name,
                sys::tail(&self.logfile)
            )
        };
        crate::wait::until(PROMOTE_LIMIT, check, failure).await;
    }

    /// `SELECT pg_is_in_recovery()`.
    pub async fn is_in_recovery(&self) -> bool {
        self.psql("postgres", "SELECT pg_is_in_recovery()").await == "t"
    }

    /// The server's log file contents (for failure messages).
    pub fn log(&self) -> String {
        sys::read_lossy(&self.logfile)
    }

    /// The last 30 lines of the log, indented, for a failure message.
    pub fn log_tail(&self) -> String {
        sys::tail(&self.logfile)
    }

    /// The current timeline: first 8 hex digits of `pg_walfile_name(pg_current_wal_insert_lsn())` on a primary (or `timeline_id` of pg_control_checkpoint() in recovery).
    pub async fn timeline(&self) -> u32 {
        let sql = "SELECT CASE WHEN pg_is_in_recovery() \
                   THEN lpad(to_hex((SELECT timeline_id FROM pg_control_checkpoint())), 8, '0') \
                   ELSE substr(pg_walfile_name(pg_current_wal_insert_lsn()), 1, 8) END";
        let hex = self.psql("postgres", sql).await;
        u32::from_str_radix(&hex, 16)
            .unwrap_or_else(|e| panic!("pg_topology: timeline {hex:?} of the {}: {e}", self.name))
    }
}

impl Drop for PgServer {
    /// `pg_ctl stop -m immediate` (at most 30 s), SIGKILL to a postmaster still there, then the
    /// server's dir is removed. Errors are ignored: this also runs while a failed test unwinds.
    fn drop(&mut self) {
        let recorded = *self.pid.lock().unwrap_or_else(|p| p.into_inner());
        let running = self.pid_file();
        if running.is_some() {
            let mut cmd = sys::std_command(&sys::pg_program("pg_ctl"), true);
            cmd.arg("-D").arg(&self.data).args(["-m", "immediate", "-w", "-t", "20", "stop"]);
            let _ = sys::blocking_output(cmd, Duration::from_secs(30));
        }
        for pid in recorded.into_iter().chain(running) {
            sys::kill_if_ours(pid, &self.data);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Appends `text` to the file at `path`.
fn append(path: &Path, text: &str) {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("pg_topology: open {} to append: {e}", path.display()));
    file.write_all(text.as_bytes()).unwrap_or_else(|e| panic!("pg_topology: append to {}: {e}", path.display()));
}

/// The template data dir, made once per test process by `initdb` (removed when the process exits).
async fn template() -> &'static Path {
    static TEMPLATE: tokio::sync::OnceCell<PathBuf> = tokio::sync::OnceCell::const_new();
    TEMPLATE.get_or_init(make_template).await
}

/// `initdb` into `/tmp/brokerfence-pg-<pid>-template/data`, then the settings and `pg_hba.conf`.
async fn make_template() -> PathBuf {
    let root = sys::make_root("template");
    sys::remove_at_exit(root.clone());
    let data = root.join("data");
    let mut initdb = sys::command(&sys::pg_program("initdb"), true);
    initdb.arg("-D").arg(&data).args([
        "-A",
        "trust",
        "-U",
        "postgres",
        "--no-sync",
        "-E",
        "UTF8",
        "--locale=C.UTF-8",
        "--no-instructions",
    ]);
    sys::run(initdb, None, "initdb (the template)", COMMAND_LIMIT).await.unwrap_or_else(|e| panic!("pg_topology: {e}"));
    append(&data.join("postgresql.conf"), SETTINGS);
    let hba = data.join("pg_hba.conf");
    std::fs::write(&hba, HBA).unwrap_or_else(|e| panic!("pg_topology: write {}: {e}", hba.display()));
    data
}
