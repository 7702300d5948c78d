//! Issue #15, "Clear errors", for the harness programs (moved here from the root package's
//! `tests/onboarding.rs` with the programs, issue #19): `--help` answers on stdout with exit 0,
//! an unknown flag is refused by clap with exit 2. The binaries are the ones cargo builds for this
//! test (`CARGO_BIN_EXE_<name>`), never a stale copy.
//!
//! Run them with `cargo test --workspace --all-features onboarding`.

use std::time::Duration;

/// Every harness program this build has, with its binary.
fn all_programs() -> Vec<(&'static str, &'static str)> {
    #[allow(unused_mut)] // without the broker features
    let mut v = vec![
        ("soak", env!("CARGO_BIN_EXE_soak")),
        ("bench", env!("CARGO_BIN_EXE_bench")),
        ("chaos", env!("CARGO_BIN_EXE_chaos")),
    ];
    #[cfg(feature = "sqs")]
    v.push(("bench_sqs", env!("CARGO_BIN_EXE_bench_sqs")));
    #[cfg(feature = "redis")]
    v.push(("bench_redis", env!("CARGO_BIN_EXE_bench_redis")));
    v
}

/// Runs a program to its end (at most 60 s): exit code, stdout, stderr.
fn run(name: &str, exe: &str, args: &[&str]) -> (i32, String, String) {
    let child = std::process::Command::new(exe)
        .args(args)
        .env("NO_COLOR", "1")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {name}: {e}"));
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(out) => out.unwrap_or_else(|e| panic!("wait for {name}: {e}")),
        Err(_) => {
            // Not killed here (this test has no libc): the child ends with the test process.
            panic!("{name} {args:?} (pid {pid}) did not exit within 60 s");
        }
    };
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Old: `--help` exited 2 in some workers, and `bench --help` said "--help needs a value".
#[test]
fn onboarding_every_harness_program_answers_help_with_exit_0() {
    for (name, exe) in all_programs() {
        let (code, out, err) = run(name, exe, &["--help"]);
        assert_eq!(code, 0, "{name} --help: exit {code}; stderr: {err}");
        assert!(out.starts_with("usage: "), "{name} --help: {out:?}");
        assert!(out.contains("--help"), "{name} --help lists no flags: {out}");
        assert!(err.is_empty(), "{name} --help wrote to stderr: {err}");
    }
}

/// An unknown flag: clap's message naming it, exit 2, nothing on stdout.
#[test]
fn onboarding_every_harness_program_refuses_an_unknown_flag_with_exit_2() {
    for (name, exe) in all_programs() {
        let (code, out, err) = run(name, exe, &["--no-such-flag"]);
        assert_eq!(code, 2, "{name} --no-such-flag: exit {code}; stderr: {err}");
        assert!(err.contains("unexpected argument '--no-such-flag'"), "{name}: {err}");
        assert!(out.is_empty(), "{name} printed on stdout: {out}");
    }
}
