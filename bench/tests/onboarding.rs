//! Issue #15, "Clear errors", for the harness programs (moved here from the root package's
//! `tests/onboarding.rs` with the programs, issue #19): `--help` answers on stdout with exit 0,
//! an unknown flag is refused by clap with exit 2. The binaries are the ones cargo builds for this
//! test (`CARGO_BIN_EXE_<name>`), never a stale copy.
//!
//! Run them with `cargo test --workspace --all-features onboarding`.

use std::path::Path;

use brokerfence_testkit::process::run_to_end;

/// Every harness program this build has, with its binary.
fn all_programs() -> Vec<(&'static str, &'static str)> {
    #[allow(unused_mut)] // without the broker features
    let mut v = vec![
        ("soak", env!("CARGO_BIN_EXE_soak")),
        ("bench", env!("CARGO_BIN_EXE_bench")),
        ("chaos", env!("CARGO_BIN_EXE_chaos")),
        ("bench_failover", env!("CARGO_BIN_EXE_bench_failover")),
    ];
    #[cfg(feature = "sqs")]
    v.push(("bench_sqs", env!("CARGO_BIN_EXE_bench_sqs")));
    #[cfg(feature = "redis")]
    v.push(("bench_redis", env!("CARGO_BIN_EXE_bench_redis")));
    v
}

/// Old: `--help` exited 2 in some workers, and `bench --help` said "--help needs a value".
#[test]
fn onboarding_every_harness_program_answers_help_with_exit_0() {
    for (name, exe) in all_programs() {
        let (code, out, err) = run_to_end(Path::new(exe), &["--help"], &[]);
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
        let (code, out, err) = run_to_end(Path::new(exe), &["--no-such-flag"], &[]);
        assert_eq!(code, 2, "{name} --no-such-flag: exit {code}; stderr: {err}");
        assert!(err.contains("unexpected argument '--no-such-flag'"), "{name}: {err}");
        assert!(out.is_empty(), "{name} printed on stdout: {out}");
    }
}
