//! Chaos, small: worker OS processes drain a few hundred jobs while they are paused past their
//! lease (SIGSTOP … SIGCONT), killed and restarted (SIGKILL), and cut off from PostgreSQL
//! (`pg_terminate_backend`); for Redis the server restarts too. An independent receiver records
//! every call. Asserted: jobs lost = 0, results committed twice = 0, receiver accepts of a lower
//! epoch = 0, zombie commits rejected ≥ 1, every job completed or dead-lettered.
//!
//! The runner is `examples/chaos.rs` (run a larger instance by hand with
//! `cargo run --release --example chaos -- --source table --workers 8 --jobs 5000`). The worker
//! processes are this test binary, re-executed in worker mode by [`worker_entry`].

#[path = "../examples/chaos.rs"]
mod chaos;

use chaos::{ChaosConfig, Launcher, SourceKind};

/// Not a test: the entry point of the worker processes. In a normal test run it returns at once.
#[test]
fn worker_entry() {
    if let Ok(args) = std::env::var(chaos::WORKER_ENV) {
        let args: Vec<String> = args.split('\u{1f}').map(str::to_owned).collect();
        std::process::exit(chaos::worker_main(args));
    }
}

fn launcher() -> Launcher {
    Launcher {
        exe: std::env::current_exe().expect("current exe"),
        args: ["worker_entry", "--exact", "--nocapture", "--test-threads=1", "-q"].map(String::from).to_vec(),
        via_env: true,
    }
}

fn database_url() -> String {
    brokerfence::services::var("DATABASE_URL")
        .expect("DATABASE_URL is not set and localstack/.env is missing: run `bash localstack/up` first")
}

/// One chaos run at a time: each spawns its own worker processes, and on two cores parallel runs
/// would only measure each other.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn run_small(source: SourceKind) {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut config = ChaosConfig::small(source, database_url(), launcher());
    if let Ok(seed) = std::env::var("CHAOS_SEED") {
        config.seed = seed.parse().expect("CHAOS_SEED is a number");
    }
    config.verbose = std::env::var_os("CHAOS_VERBOSE").is_some();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let report = rt.block_on(chaos::run(config)).expect("chaos run could not be set up");
    println!("{report}");
    assert_eq!(report.lost(), 0, "jobs lost\n{report}");
    assert_eq!(report.committed_twice, 0, "results committed twice\n{report}");
    assert_eq!(report.stale_accepts, 0, "receiver accepted a lower epoch\n{report}");
    assert!(report.zombie_commits_rejected >= 1, "no zombie commit was rejected\n{report}");
    assert_eq!(report.completed + report.dead, report.jobs, "not every job completed or dead-lettered\n{report}");
    assert_eq!(report.poison_not_dead_lettered, 0, "poison jobs not dead-lettered with their reason\n{report}");
    assert!(report.sigstops >= 1 && report.sigkills >= 1 && report.connections_terminated >= 1, "{report}");
    assert!(report.violations().is_empty(), "{report}");
}

#[test]
fn chaos_table_queue() {
    run_small(SourceKind::Table);
}

#[cfg(feature = "sqs")]
#[test]
fn chaos_sqs() {
    run_small(SourceKind::Sqs);
}

#[cfg(feature = "redis")]
#[test]
fn chaos_redis() {
    run_small(SourceKind::Redis);
}

/// The checks have teeth: with the commit compare-and-set switched off in the workers, zombies'
/// late commits land, and the run reports a violation.
#[cfg(feature = "guard-switches")]
#[test]
fn chaos_notices_a_missing_commit_guard() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    let mut config = ChaosConfig::small(SourceKind::Table, database_url(), launcher());
    config.worker_guards = vec!["no-commit-cas".into()];
    config.keep_on_failure = false;
    config.verbose = std::env::var_os("CHAOS_VERBOSE").is_some();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let report = rt.block_on(chaos::run(config)).expect("chaos run could not be set up");
    println!("{report}");
    assert!(report.committed_twice + report.effect_missing >= 1, "a missing commit guard went unnoticed\n{report}");
    assert!(!report.violations().is_empty(), "{report}");
}
