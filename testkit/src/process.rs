//! Child processes of the tests: the test binary re-executed as a worker ([`reexec`] and, in the
//! child, [`reexec_args`]), and signals to a child ([`signal`]).

/// Separates the arguments in the environment variable (a byte no argument contains).
const SEP: char = '\u{1f}';

/// A command that runs this test binary again with only its test `entry` (`--exact`, one
/// thread, output not captured), passing `args` in the environment variable `var`, its stdout
/// piped, killed when dropped. The caller adds its environment and stderr, then [`spawn`]s it.
pub fn reexec(entry: &str, var: &str, args: &[String]) -> tokio::process::Command {
    let exe = std::env::current_exe().expect("current exe");
    let mut cmd = tokio::process::Command::new(exe);
    cmd.args([entry, "--exact", "--nocapture", "--test-threads=1", "-q"])
        .env(var, args.join(&SEP.to_string()))
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true);
    cmd
}

/// Spawns `cmd` (failing the test, naming `what`, when it cannot); the child and its pid.
pub fn spawn(cmd: &mut tokio::process::Command, what: &str) -> (tokio::process::Child, i32) {
    let child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {what}: {e}"));
    let pid = pid(&child);
    (child, pid)
}

/// In the test `entry` of a binary started by [`reexec`]: the arguments passed in `var`; `None`
/// in a normal test run (the entry then returns at once).
pub fn reexec_args(var: &str) -> Option<Vec<String>> {
    std::env::var(var).ok().map(|args| args.split(SEP).map(str::to_owned).collect())
}

/// The process id of a child that is running.
pub fn pid(child: &tokio::process::Child) -> i32 {
    i32::try_from(child.id().expect("the child is running")).expect("pid fits")
}

/// Sends `sig` to the child `pid`; fails the test when it cannot.
pub fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on the pid of a child this test spawned and still owns.
    let rc = unsafe { libc::kill(pid, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig}) failed");
}

/// The example binary `name`, built for this test by cargo (see [`crate::programs`]): never
/// what an earlier build happened to leave in `target/`.
pub fn built_example(name: &str) -> std::path::PathBuf {
    crate::programs::example(name)
}

/// Runs the program `exe` to its end, at most 60 s (then kills it and panics): exit code, stdout,
/// stderr. `NO_COLOR=1`, stdin closed, `env` added. For the checks of what a program prints.
pub fn run_to_end(exe: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let name = exe.display().to_string();
    let mut cmd = std::process::Command::new(exe);
    cmd.args(args).env("NO_COLOR", "1").stdin(std::process::Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {name}: {e}"));
    let pid = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(std::time::Duration::from_secs(60)) {
        Ok(out) => out.unwrap_or_else(|e| panic!("wait for {name}: {e}")),
        Err(_) => {
            signal(pid, libc::SIGKILL);
            panic!("{name} {args:?} did not exit within 60 s");
        }
    };
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
