//! The plumbing under the topology: PostgreSQL's programs, the `postgres` OS user, temp dirs,
//! free ports, commands with a time limit, log tails.

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Mutex, Once, OnceLock};
use std::time::Duration;

/// Where the temp dirs go: `/tmp`, not `$TMPDIR`, so that the `postgres` user can reach them and
/// the Unix socket paths stay short.
const TMP: &str = "/tmp";

/// The start of every temp dir's name: `brokerfence-pg-<pid>-<suffix>`.
const PREFIX: &str = "brokerfence-pg-";

/// How many lines of a log a failure message shows.
pub(super) const LOG_TAIL: usize = 30;

/// PostgreSQL's program `name`: in the highest `/usr/lib/postgresql/<v>/bin`, else in
/// `pg_config --bindir`, else found on PATH.
pub(super) fn pg_program(name: &str) -> PathBuf {
    match pg_bin_dir() {
        Some(dir) => dir.join(name),
        None => PathBuf::from(name),
    }
}

/// The directory of PostgreSQL's programs, looked up once.
fn pg_bin_dir() -> Option<&'static Path> {
    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    DIR.get_or_init(|| {
        let versions = std::fs::read_dir("/usr/lib/postgresql").into_iter().flatten().flatten();
        let mut found: Vec<(u32, PathBuf)> = versions
            .filter_map(|entry| {
                let version = entry.file_name().to_str()?.parse::<u32>().ok()?;
                let bin = entry.path().join("bin");
                bin.join("initdb").is_file().then_some((version, bin))
            })
            .collect();
        found.sort();
        if let Some((_, bin)) = found.pop() {
            return Some(bin);
        }
        let mut pg_config = std::process::Command::new("pg_config");
        pg_config.arg("--bindir");
        let out = blocking_output(pg_config, Duration::from_secs(10))?;
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        dir.join("initdb").is_file().then_some(dir)
    })
    .as_deref()
}

/// The uid and gid to run PostgreSQL's server programs and PgBouncer as: `postgres`'s when this
/// process is root (they refuse to run as root), else `None` (they run as this user).
fn run_as() -> Option<(u32, u32)> {
    static IDS: OnceLock<Option<(u32, u32)>> = OnceLock::new();
    // SAFETY: geteuid(2) has no preconditions.
    *IDS.get_or_init(|| (unsafe { libc::geteuid() } == 0).then(|| user_ids("postgres")))
}

/// The uid and gid of the OS user `name`; panics when there is none.
fn user_ids(name: &str) -> (u32, u32) {
    let cname = std::ffi::CString::new(name).expect("user name without NUL");
    // SAFETY: an all-zero passwd is a valid value (null pointers, zero ids); getpwnam_r fills it.
    let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
    let mut buf = vec![0 as libc::c_char; 16 * 1024];
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call and `buf.len()` is the buffer's length.
    let rc = unsafe { libc::getpwnam_r(cname.as_ptr(), &mut pwd, buf.as_mut_ptr(), buf.len(), &mut found) };
    assert!(
        rc == 0 && !found.is_null(),
        "pg_topology: running as root, but there is no OS user `{name}` to run PostgreSQL as (getpwnam_r: {rc}); \
         install the postgresql package (`bash localstack/up`)"
    );
    (pwd.pw_uid, pwd.pw_gid)
}

/// A command for `program`: no `PG*` variables from our environment, stdin closed, working dir
/// `/tmp`; with `as_owner`, run as the `postgres` user when we are root (`HOME=/tmp`).
pub(super) fn std_command(program: &Path, as_owner: bool) -> std::process::Command {
    let mut cmd = std::process::Command::new(program);
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("PG") {
            cmd.env_remove(key);
        }
    }
    cmd.current_dir(TMP).stdin(Stdio::null());
    if let (true, Some((uid, gid))) = (as_owner, run_as()) {
        cmd.uid(uid).gid(gid).env("HOME", TMP);
    }
    cmd
}

/// [`std_command`] for tokio, killed when dropped.
pub(super) fn command(program: &Path, as_owner: bool) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::from(std_command(program, as_owner));
    cmd.kill_on_drop(true);
    cmd
}

/// Runs `cmd` for at most `within`, feeding it `stdin`: its stdout trimmed, or why it failed
/// (spawn error, time-out, exit status with stderr and stdout), naming `what`. A command that
/// overruns is killed.
pub(super) async fn run(
    mut cmd: tokio::process::Command,
    stdin: Option<&str>,
    what: &str,
    within: Duration,
) -> Result<String, String> {
    use tokio::io::AsyncWriteExt;
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).kill_on_drop(true);
    if stdin.is_some() {
        cmd.stdin(Stdio::piped());
    }
    let mut child = cmd.spawn().map_err(|e| format!("{what}: cannot start it: {e}"))?;
    let pipe = child.stdin.take();
    let feed = async move {
        if let (Some(text), Some(mut pipe)) = (stdin, pipe) {
            // A program that exits without reading everything closes the pipe: not our failure.
            let _ = pipe.write_all(text.as_bytes()).await;
        }
    };
    let both = async { tokio::join!(feed, child.wait_with_output()).1 };
    let out = match tokio::time::timeout(within, both).await {
        Err(_) => return Err(format!("{what}: no answer within {within:?} (killed)")),
        Ok(Err(e)) => return Err(format!("{what}: cannot wait for it: {e}")),
        Ok(Ok(out)) => out,
    };
    let stdout = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if out.status.success() {
        return Ok(stdout);
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    Err(format!("{what}: {}\n  stderr: {}\n  stdout: {stdout}", out.status, stderr.trim()))
}

/// Runs `cmd` to its end from synchronous code (Drop), at most `within` (then kills it): its
/// output, or `None` when it could not start or overran.
pub(super) fn blocking_output(mut cmd: std::process::Command, within: Duration) -> Option<std::process::Output> {
    cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = cmd.spawn().ok()?;
    let pid = i32::try_from(child.id()).ok()?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(within) {
        Ok(out) => out.ok(),
        Err(_) => {
            // SAFETY: kill(2) on our own child, not yet reaped (the waiting thread still owns it).
            unsafe { libc::kill(pid, libc::SIGKILL) };
            let _ = rx.recv_timeout(Duration::from_secs(5));
            None
        }
    }
}

/// SIGKILLs `pid` if it is still a process whose command line names `marker` (the data dir of the
/// postmaster we started: a recycled pid is left alone).
pub(super) fn kill_if_ours(pid: i32, marker: &Path) {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { return };
    let marker = marker.as_os_str().as_encoded_bytes();
    if cmdline.windows(marker.len()).any(|w| w == marker) {
        // SAFETY: kill(2) on a process we started (checked through its command line above).
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// A free TCP port on 127.0.0.1 (bound, read, released: a race with another process is possible;
/// the callers retry).
pub(super) fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).expect("bind 127.0.0.1:0 for a free port");
    listener.local_addr().expect("local address of a bound listener").port()
}

/// The last [`LOG_TAIL`] lines of the file at `path`, indented, for a failure message.
pub(crate) fn tail(path: &Path) -> String {
    let text = match std::fs::read(path) {
        Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
        Err(e) => return format!("    ({} unreadable: {e})", path.display()),
    };
    let lines: Vec<&str> = text.lines().collect();
    let from = lines.len().saturating_sub(LOG_TAIL);
    let shown: Vec<String> = lines[from..].iter().map(|l| format!("    | {l}")).collect();
    format!("  last {} lines of {}:\n{}", shown.len(), path.display(), shown.join("\n"))
}

/// A file's contents (lossy UTF-8), empty when it cannot be read.
pub(super) fn read_lossy(path: &Path) -> String {
    std::fs::read(path).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
}

/// Makes `path` (a dir) belong to the user PostgreSQL runs as, mode 0700.
pub(super) fn own(path: &Path) {
    if let Some((uid, gid)) = run_as() {
        std::os::unix::fs::chown(path, Some(uid), Some(gid))
            .unwrap_or_else(|e| panic!("pg_topology: chown {} to postgres: {e}", path.display()));
    }
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))
        .unwrap_or_else(|e| panic!("pg_topology: chmod 0700 {}: {e}", path.display()));
}

/// Creates `/tmp/brokerfence-pg-<pid>-<suffix>`, owned by PostgreSQL's user (first removing the
/// dirs that processes no longer alive left behind).
pub(super) fn make_root(suffix: &str) -> PathBuf {
    static SWEEP: Once = Once::new();
    SWEEP.call_once(sweep_stale);
    let path = Path::new(TMP).join(format!("{PREFIX}{}-{suffix}", std::process::id()));
    // Left by an earlier attempt of this process (a template whose initdb failed).
    let _ = std::fs::remove_dir_all(&path);
    std::fs::create_dir(&path).unwrap_or_else(|e| panic!("pg_topology: create {}: {e}", path.display()));
    own(&path);
    path
}

/// Removes the temp dirs of test processes that are gone (killed before their Drop ran), first
/// killing the postmasters and PgBouncers still running from them (found by their pid files).
fn sweep_stale() {
    if !Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(TMP) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(PREFIX)) else { continue };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else { continue };
        if pid != std::process::id() && !alive(pid) {
            let root = entry.path();
            let servers = std::fs::read_dir(&root).into_iter().flatten().flatten().map(|e| e.path());
            for dir in servers {
                for pid_file in [dir.join("data/postmaster.pid"), dir.join("pgbouncer.pid")] {
                    if let Ok(pid) = read_lossy(&pid_file).lines().next().unwrap_or_default().trim().parse() {
                        kill_if_ours(pid, &dir);
                    }
                }
            }
            let _ = std::fs::remove_dir_all(root);
        }
    }
}

/// Whether process `pid` exists and is not a zombie (a killed test process may stay one for a while).
fn alive(pid: u32) -> bool {
    let stat = read_lossy(Path::new(&format!("/proc/{pid}/stat")));
    // `pid (comm) S ...`: the state follows the last `)`.
    let state = stat.rfind(')').and_then(|at| stat[at + 1..].trim_start().chars().next());
    !matches!(state, None | Some('Z' | 'X'))
}

/// The dirs to remove when the process exits (the template, which lives in a static).
static AT_EXIT: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Removes `path` when this process exits normally (`atexit`).
pub(super) fn remove_at_exit(path: PathBuf) {
    static REGISTER: Once = Once::new();
    AT_EXIT.lock().unwrap_or_else(|p| p.into_inner()).push(path);
    // SAFETY: registers a plain `extern "C"` function without arguments.
    REGISTER.call_once(|| unsafe {
        libc::atexit(remove_registered);
    });
}

/// The `atexit` handler of [`remove_at_exit`].
extern "C" fn remove_registered() {
    if let Ok(paths) = AT_EXIT.lock() {
        for path in paths.iter() {
            let _ = std::fs::remove_dir_all(path);
        }
    }
}

/// A temp dir of one topology (its servers' dirs inside), removed on drop.
pub(super) struct TempRoot {
    path: PathBuf,
}

impl TempRoot {
    /// A fresh `/tmp/brokerfence-pg-<pid>-<random>`.
    pub(super) fn new() -> std::sync::Arc<TempRoot> {
        std::sync::Arc::new(TempRoot { path: make_root(&format!("{:016x}", rand::random::<u64>())) })
    }

    /// A new dir `name` inside, owned by PostgreSQL's user, mode 0700.
    pub(super) fn subdir(&self, name: &str) -> PathBuf {
        let path = self.path.join(name);
        std::fs::create_dir(&path).unwrap_or_else(|e| panic!("pg_topology: create {}: {e}", path.display()));
        own(&path);
        path
    }
}

impl Drop for TempRoot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// A `psql` command to 127.0.0.1:`port` as `user` on `db` (`-X`, `PGCONNECT_TIMEOUT=5`); the
/// caller adds the output flags and the SQL.
pub(super) fn psql_command(port: u16, user: &str, db: &str) -> tokio::process::Command {
    let mut cmd = command(&pg_program("psql"), false);
    cmd.args(["-X", "-h", "127.0.0.1", "-p", &port.to_string(), "-U", user, "-d", db]).env("PGCONNECT_TIMEOUT", "5");
    cmd
}

/// Runs `sql` (any number of statements, each in its own transaction unless it says otherwise)
/// through `psql -q -At -v ON_ERROR_STOP=1` on 127.0.0.1:`port`; stdout trimmed, or the error.
pub(super) async fn psql(port: u16, user: &str, db: &str, sql: &str) -> Result<String, String> {
    let mut cmd = psql_command(port, user, db);
    cmd.args(["-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-f", "-"]);
    run(cmd, Some(sql), &format!("psql -p {port} -U {user} -d {db}"), Duration::from_secs(60)).await
}
