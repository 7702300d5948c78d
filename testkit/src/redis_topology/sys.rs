//! The plumbing under the Redis topologies: the programs, temp dirs (and the sweep of those a
//! killed test process left), free ports, `redis-cli` with a time limit, log tails.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Once};
use std::time::Duration;

/// Where the temp dirs go (`/tmp`, not `$TMPDIR`: short, known paths).
const TMP: &str = "/tmp";

/// The start of every temp dir's name: `brokerfence-redis-<pid>-<random>`.
const PREFIX: &str = "brokerfence-redis-";

/// The program `name` (`redis-server`, `redis-cli`): `/usr/bin/<name>` when it is there (the
/// Debian packages), else looked up on PATH.
pub(super) fn program(name: &str) -> PathBuf {
    let usr = Path::new("/usr/bin").join(name);
    if usr.is_file() { usr } else { PathBuf::from(name) }
}

/// A free TCP port on 127.0.0.1 (bound, read, released: another process may take it meanwhile;
/// the callers retry on `Address already in use`).
pub(super) fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).expect("redis_topology: bind 127.0.0.1:0");
    listener.local_addr().expect("redis_topology: local address of a bound listener").port()
}

/// A file's contents (lossy UTF-8), empty when it cannot be read.
pub(super) fn read_lossy(path: &Path) -> String {
    std::fs::read(path).map(|b| String::from_utf8_lossy(&b).into_owned()).unwrap_or_default()
}

/// The last lines of the file at `path`, indented and headed by its path, for a failure message.
pub(super) use crate::pg_topology::sys::tail;

/// Runs `redis-cli <args>` for at most `within`, its output appended to `log`: stdout, or why it
/// failed (with the output).
pub(super) async fn redis_cli(args: &[String], log: &Path, within: Duration) -> Result<String, String> {
    let mut cmd = tokio::process::Command::new(program("redis-cli"));
    cmd.args(args).current_dir(TMP).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    cmd.kill_on_drop(true);
    let what = format!("redis-cli {}", args.join(" "));
    let child = cmd.spawn().map_err(|e| format!("{what}: cannot start it: {e} (`bash localstack/up` installs it)"))?;
    let out = match tokio::time::timeout(within, child.wait_with_output()).await {
        Err(_) => return Err(format!("{what}: no answer within {within:?} (killed)")),
        Ok(Err(e)) => return Err(format!("{what}: cannot wait for it: {e}")),
        Ok(Ok(out)) => out,
    };
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let _ = std::fs::write(log, format!("$ {what}\n{stdout}\n{stderr}"));
    // `redis-cli --cluster` says `[ERR]` and still exits 0 in some failures.
    if out.status.success() && !stdout.contains("[ERR]") {
        return Ok(stdout);
    }
    Err(format!("{what}: {}\n  stderr: {}\n  stdout: {}", out.status, stderr.trim(), stdout.trim()))
}

/// A temp dir of one topology (its servers' dirs inside), removed on drop (after its servers,
/// which each hold it).
pub(super) struct TempRoot {
    path: PathBuf,
}

impl TempRoot {
    /// A fresh `/tmp/brokerfence-redis-<pid>-<random>` (first sweeping what dead test processes left).
    pub(super) fn new() -> Arc<TempRoot> {
        static SWEEP: Once = Once::new();
        SWEEP.call_once(sweep_stale);
        let name = format!("{PREFIX}{}-{:016x}", std::process::id(), rand::random::<u64>());
        let path = Path::new(TMP).join(name);
        std::fs::create_dir(&path).unwrap_or_else(|e| panic!("redis_topology: create {}: {e}", path.display()));
        Arc::new(TempRoot { path })
    }

    /// The dir itself.
    pub(super) fn path(&self) -> &Path {
        &self.path
    }

    /// A new dir `name` inside.
    pub(super) fn subdir(&self, name: &str) -> PathBuf {
        let path = self.path.join(name);
        std::fs::create_dir(&path).unwrap_or_else(|e| panic!("redis_topology: create {}: {e}", path.display()));
        path
    }
}

impl Drop for TempRoot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// SIGKILLs `pid` and waits (at most 2 s) until it no longer runs (a zombie or gone), so that it
/// writes nothing more into its dir.
pub(super) fn kill_and_settle(pid: u32) {
    // SAFETY: kill(2) on a process we started (the caller's child, not yet reaped).
    unsafe { libc::kill(pid as libc::pid_t, libc::SIGKILL) };
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while running(pid) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Whether process `pid` exists and is not a zombie.
fn running(pid: u32) -> bool {
    let stat = read_lossy(Path::new(&format!("/proc/{pid}/stat")));
    // `pid (comm) S ...`: the state follows the last `)`.
    let state = stat.rfind(')').and_then(|at| stat[at + 1..].trim_start().chars().next());
    !matches!(state, None | Some('Z' | 'X'))
}

/// Removes the temp dirs of test processes that are gone (killed before their drops ran), first
/// SIGKILLing the processes still working in them. A redis-server rewrites its command line (its
/// process title), so they are found by their working directory: every server runs in its own dir.
fn sweep_stale() {
    let Ok(entries) = std::fs::read_dir(TMP) else { return };
    let stale: Vec<PathBuf> = entries
        .flatten()
        .filter(|entry| {
            let name = entry.file_name();
            let owner = name.to_str().and_then(|n| n.strip_prefix(PREFIX)).and_then(|rest| rest.split('-').next());
            owner.and_then(|p| p.parse::<u32>().ok()).is_some_and(|pid| pid != std::process::id() && !running(pid))
        })
        .map(|entry| entry.path())
        .collect();
    if stale.is_empty() {
        return;
    }
    let processes = std::fs::read_dir("/proc").into_iter().flatten().flatten();
    for process in processes {
        let Some(pid) = process.file_name().to_str().and_then(|p| p.parse::<i32>().ok()) else { continue };
        let Ok(cwd) = std::fs::read_link(process.path().join("cwd")) else { continue };
        if stale.iter().any(|root| cwd.starts_with(root)) {
            // SAFETY: kill(2) on a server a test process of this kit started in its own temp dir.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    for root in stale {
        let _ = std::fs::remove_dir_all(root);
    }
}
