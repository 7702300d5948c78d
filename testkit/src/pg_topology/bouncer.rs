//! [`PgBouncer`]: a PgBouncer child process in front of one upstream, its files in a temp dir.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use super::sys::{self, TempRoot};

/// How often a start is retried on a new port when another process took the chosen one.
const START_ATTEMPTS: usize = 5;

/// How long a start waits for PgBouncer to accept connections.
const START_LIMIT: Duration = Duration::from_secs(15);

/// The limit on an admin console command.
const ADMIN_LIMIT: Duration = Duration::from_secs(30);

/// Where pgbouncer is; panics with "run `bash localstack/up` (it installs pgbouncer)" when missing.
pub fn pgbouncer_path() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let sbin = ["/usr/sbin", "/usr/local/sbin", "/usr/bin", "/usr/local/bin"].map(PathBuf::from);
    std::env::split_paths(&path).chain(sbin).map(|dir| dir.join("pgbouncer")).find(|p| p.is_file()).unwrap_or_else(
        || panic!("pgbouncer is not installed (not on PATH nor in /usr/sbin): run `bash localstack/up` (it installs pgbouncer)"),
    )
}

/// A PgBouncer in front of `upstream`, on a free port.
pub struct PgBouncer {
    /// Killed (SIGKILL) when dropped.
    child: tokio::process::Child,
    port: u16,
    logfile: PathBuf,
    /// PgBouncer's stderr (what it says before its log file is open).
    errfile: PathBuf,
    /// Removed after the child is gone.
    _root: Arc<TempRoot>,
}

impl PgBouncer {
    /// pool_mode as given ("transaction" or "session"); `ignore_startup_parameters` as given (e.g. "extra_float_digits", which is what sqlx users set; pass "" for none); auth_type = trust with an auth_file listing `users` (password ""; `postgres` is always added, for the admin console), one `[databases]` entry `* = host=127.0.0.1 port=<upstream port>`, `server_reset_query = DISCARD ALL` only in session mode, server connections handed out in turn (`server_round_robin = 1`: a statement split across two transactions of a client lands on another server connection, as on a busy pooler), pool 20, 500 clients, log to a file in its temp dir. Waits until it accepts a TCP connection.
    pub async fn start(
        upstream: SocketAddr,
        pool_mode: &str,
        ignore_startup_parameters: &str,
        users: &[&str],
    ) -> PgBouncer {
        let program = pgbouncer_path();
        let root = TempRoot::new();
        let dir = root.subdir("pgbouncer");
        let sock = dir.join("sock");
        std::fs::create_dir(&sock).unwrap_or_else(|e| panic!("pg_topology: create {}: {e}", sock.display()));
        sys::own(&sock);
        let mut names: Vec<&str> = users.to_vec();
        if !names.contains(&"postgres") {
            names.push("postgres");
        }
        let auth: String = names.iter().map(|u| format!("\"{}\" \"\"\n", u.replace('"', "\"\""))).collect();
        write(&dir.join("userlist.txt"), &auth);
        let (logfile, errfile) = (dir.join("pgbouncer.log"), dir.join("pgbouncer.stderr"));
        for attempt in 1..=START_ATTEMPTS {
            let port = sys::free_port();
            let ini = ini(&dir, upstream, port, pool_mode, ignore_startup_parameters);
            write(&dir.join("pgbouncer.ini"), &ini);
            let _ = std::fs::remove_file(&logfile);
            let _ = std::fs::remove_file(dir.join("pgbouncer.pid"));
            let child = spawn(&program, &dir.join("pgbouncer.ini"), &errfile);
            let mut bouncer =
                PgBouncer { child, port, logfile: logfile.clone(), errfile: errfile.clone(), _root: root.clone() };
            match bouncer.wait_up().await {
                Ok(()) => return bouncer,
                Err(e) => {
                    let said = bouncer.log() + &sys::read_lossy(&bouncer.errfile);
                    let raced = said.contains("Address already in use");
                    if !raced || attempt == START_ATTEMPTS {
                        panic!("pg_topology: PgBouncer did not start: {e}\n{}", bouncer.logs_tail());
                    }
                }
            }
        }
        unreachable!("the last attempt returns or panics")
    }

    /// Waits until the child is up (its log says so) and accepts a TCP connection; `Err` when it
    /// exits or [`START_LIMIT`] passes.
    async fn wait_up(&mut self) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + START_LIMIT;
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Err(format!("pgbouncer exited: {status}")),
                Ok(None) => {}
                Err(e) => return Err(format!("cannot wait for pgbouncer: {e}")),
            }
            if self.log().contains("process up") && tokio::net::TcpStream::connect(self.addr()).await.is_ok() {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!("not accepting on {} within {START_LIMIT:?}", self.addr()));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// 127.0.0.1:[`port`](Self::port).
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// PgBouncer's TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://<user>@127.0.0.1:<port>/<db>`.
    pub fn url(&self, user: &str, db: &str) -> String {
        format!("postgres://{user}@127.0.0.1:{}/{db}", self.port)
    }

    /// Runs SQL through PgBouncer as `user` on `db` (like [`PgServer::psql`](super::PgServer::psql)); panics with both logs' tails on failure.
    pub async fn psql(&self, user: &str, db: &str, sql: &str) -> String {
        match sys::psql(self.port, user, db, sql).await {
            Ok(out) => out,
            Err(e) => panic!("pg_topology: through PgBouncer, {sql:?} failed: {e}\n{}", self.logs_tail()),
        }
    }

    /// Runs a command on PgBouncer's admin console (`psql -X -A -h 127.0.0.1 -p port -U postgres pgbouncer -c "<cmd>"`: unaligned, with the header line), e.g. "RECONNECT" or "SHOW POOLS"; returns stdout.
    pub async fn admin(&self, cmd: &str) -> String {
        let mut psql = sys::psql_command(self.port, "postgres", "pgbouncer");
        psql.args(["-A", "-c", cmd]);
        match sys::run(psql, None, &format!("PgBouncer admin {cmd:?}"), ADMIN_LIMIT).await {
            Ok(out) => out,
            Err(e) => panic!("pg_topology: {e}\n{}", self.logs_tail()),
        }
    }

    /// PgBouncer's log file contents.
    pub fn log(&self) -> String {
        sys::read_lossy(&self.logfile)
    }

    /// Where PgBouncer's log file is (in its temp dir).
    pub fn log_path(&self) -> &Path {
        &self.logfile
    }

    /// The tails of the log file and of stderr, for a failure message.
    fn logs_tail(&self) -> String {
        format!("{}\n{}", sys::tail(&self.logfile), sys::tail(&self.errfile))
    }
}

impl Drop for PgBouncer {
    /// SIGKILL, and reap it (at most 2 s) before the temp dir goes.
    fn drop(&mut self) {
        let _ = self.child.start_kill();
        for _ in 0..200 {
            if !matches!(self.child.try_wait(), Ok(None)) {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// The configuration file.
fn ini(dir: &Path, upstream: SocketAddr, port: u16, pool_mode: &str, ignore_startup_parameters: &str) -> String {
    let mut ini = format!(
        "[databases]\n\
         * = host={host} port={upstream_port}\n\
         \n\
         [pgbouncer]\n\
         listen_addr = 127.0.0.1\n\
         listen_port = {port}\n\
         unix_socket_dir = {dir}/sock\n\
         auth_type = trust\n\
         auth_file = {dir}/userlist.txt\n\
         admin_users = postgres\n\
         pool_mode = {pool_mode}\n\
         default_pool_size = 20\n\
         max_client_conn = 500\n\
         server_login_retry = 1\n\
         server_connect_timeout = 3\n\
         query_wait_timeout = 30\n\
         server_round_robin = 1\n\
         logfile = {dir}/pgbouncer.log\n\
         pidfile = {dir}/pgbouncer.pid\n",
        host = upstream.ip(),
        upstream_port = upstream.port(),
        dir = dir.display(),
    );
    if !ignore_startup_parameters.is_empty() {
        ini.push_str(&format!("ignore_startup_parameters = {ignore_startup_parameters}\n"));
    }
    if pool_mode == "session" {
        ini.push_str("server_reset_query = DISCARD ALL\n");
    }
    ini
}

/// Writes a file PgBouncer reads (world-readable is fine: nothing secret in it).
fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap_or_else(|e| panic!("pg_topology: write {}: {e}", path.display()));
}

/// Starts `pgbouncer <ini>` in the foreground (no `-d`: it stays our child) as PostgreSQL's user
/// (it refuses root), its stderr in `errfile`, killed when dropped. (Should this process be killed
/// before its Drop runs, the next test process's sweep of stale temp dirs kills it.)
fn spawn(program: &Path, ini: &Path, errfile: &Path) -> tokio::process::Child {
    let err = std::fs::File::create(errfile).unwrap_or_else(|e| panic!("pg_topology: open {}: {e}", errfile.display()));
    let mut cmd = sys::std_command(program, true);
    cmd.arg(ini).stdout(std::process::Stdio::null()).stderr(err);
    let mut cmd = tokio::process::Command::from(cmd);
    cmd.kill_on_drop(true);
    cmd.spawn().unwrap_or_else(|e| panic!("pg_topology: cannot start {}: {e}", program.display()))
}
