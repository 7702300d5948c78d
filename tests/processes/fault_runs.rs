//! Chaos, small: worker OS processes drain a few hundred jobs while they are paused past their
//! lease (SIGSTOP … SIGCONT), killed and restarted (SIGKILL), and cut off from PostgreSQL
//! (`pg_terminate_backend`); for Redis the server restarts too. An independent receiver records
//! every call. Asserted: jobs lost = 0, results committed twice = 0, receiver accepts of a lower
//! epoch = 0, zombie commits rejected ≥ 1, every job completed or dead-lettered.
//!
//! The runner is `bench/src/chaos/` (the `chaos` program of the `brokerfence-bench` member; run
//! a larger instance by hand with `cargo run --release -p brokerfence-bench --bin chaos --
//! --source table --workers 8 --jobs 5000`). This test runs it from the `brokerfence-bench`
//! library; the worker processes are this test binary, re-executed in worker mode by [`worker_entry`].
//!
//! The `edges` module adds the faults of issue #12 ("Done when"): a broker that stalls for
//! longer than the lease (a TCP proxy between the workers and LocalStack or Redis holds every
//! byte) and a PostgreSQL stall of one worker (its running rows locked, or its backends
//! paused), and asserts zero healthy cancellations besides zero lost and zero committed twice.
//!
//! `chaos_table_pg_failover_*` (issue #29) run the table queue through PgBouncer on a private
//! primary with a standby that fails over (the `pg-failover` fault), and assert besides that no
//! fencing token was handed out twice; their negative control switches the timeline epochs off.
//! `chaos_redis_cluster_failover` (issue #31) runs the Redis source on a private Redis Cluster
//! whose stream's primary fails over (the `redis-failover` fault).

use brokerfence_bench::chaos;

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
        args: ["fault_runs::worker_entry", "--exact", "--nocapture", "--test-threads=1", "-q"]
            .map(String::from)
            .to_vec(),
        via_env: true,
    }
}

fn database_url() -> String {
    brokerfence_testkit::services::var("DATABASE_URL")
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

/// One failover run (the small instance of [`ChaosConfig::failover`]) with the workers'
/// `guards` switched off; the report.
fn run_failover(guards: &[&str], faults: Option<&[chaos::FaultKind]>) -> chaos::Report {
    let mut config = ChaosConfig::failover(database_url(), launcher());
    if let Some(faults) = faults {
        config.faults = faults.to_vec();
    }
    config.worker_guards = guards.iter().map(|g| (*g).to_owned()).collect();
    run_kept(config)
}

/// Runs `config` (one run at a time) with the environment's `CHAOS_SEED` and `CHAOS_VERBOSE`;
/// the worker logs and the receiver's schema of a failed run stay only when asked for
/// (`CHAOS_KEEP`). Prints the report and returns it.
fn run_kept(mut config: ChaosConfig) -> chaos::Report {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
    if let Ok(seed) = std::env::var("CHAOS_SEED") {
        config.seed = seed.parse().expect("CHAOS_SEED is a number");
    }
    config.verbose = std::env::var_os("CHAOS_VERBOSE").is_some();
    config.keep_on_failure = std::env::var_os("CHAOS_KEEP").is_some();
    config.keep_logs = config.keep_on_failure;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let report = rt.block_on(chaos::run(config)).expect("chaos run could not be set up");
    println!("{report}");
    report
}

/// Issue #29 in the chaos harness: the table queue's workers reach a primary with an
/// asynchronous standby through PgBouncer (transaction mode) and a VIP, while they are paused,
/// killed and cut off; once, replication is cut, the primary works alone for 3 s (its writes are
/// lost with it), dies, the standby is promoted and the VIP re-pointed. Asserted: nothing lost,
/// nothing committed twice on the promoted server, no stale accept, no fencing token handed out
/// twice (no (job, epoch) from two owners at the receiver, whose ledger lives apart on the shared
/// server), no healthy cancellation, every job completed or dead-lettered, and the scenario did
/// lose work: some job ran on both timelines. Guard: the timeline epochs (the negative control
/// below switches them off).
#[test]
fn chaos_table_pg_failover_through_pgbouncer() {
    let report = run_failover(&[], None);
    assert_eq!(report.pg_failovers, 1, "the failover did not happen\n{report}");
    assert_eq!(report.lost(), 0, "jobs lost\n{report}");
    assert_eq!(report.committed_twice, 0, "results committed twice\n{report}");
    assert_eq!(report.stale_accepts, 0, "receiver accepted a lower epoch\n{report}");
    assert_eq!(report.tokens_handed_out_twice, 0, "a (job, epoch) reached the receiver from two owners\n{report}");
    assert_eq!(report.receiver_conflicts, 0, "{report}");
    assert_eq!(report.losses.healthy, 0, "healthy cancellations\n{report}");
    assert_eq!(report.completed + report.dead, report.jobs, "not every job completed or dead-lettered\n{report}");
    assert!(report.sigstops >= 1 && report.sigkills >= 1 && report.connections_terminated >= 1, "{report}");
    let failover = report.failover.as_ref().expect("failover figures");
    assert_eq!(failover.timeline, 2, "{report}");
    assert!(
        report.jobs_rerun_after_failover >= 1,
        "no job ran on both timelines: the failover lost no work, it proved nothing\n{report}"
    );
    assert!(report.violations().is_empty(), "{report}");
}

/// Negative control: the failover with the workers' timeline epochs switched off (the fence
/// before issue #29). The promoted standby hands out epochs the lost primary had already handed
/// out, to other owners, and the receiver sees the same (job, epoch) from two owners. The
/// failover is the only fault, so that every worker works while the primary is alone: in CI a run
/// with SIGSTOPs found two of three workers paused through the whole window, lost 7 commits and
/// reused no token.
#[test]
fn chaos_table_pg_failover_without_timeline_epochs_hands_out_tokens_twice() {
    let report = run_failover(&["no-timeline-epochs"], Some(&[chaos::FaultKind::PgFailover]));
    assert_eq!(report.pg_failovers, 1, "the failover did not happen\n{report}");
    assert!(report.tokens_handed_out_twice >= 1, "guard off: expected a token handed out twice\n{report}");
    assert!(!report.violations().is_empty(), "{report}");
}

/// Issue #31 in the chaos harness: the Redis source on a private Redis Cluster (3 primaries, a
/// replica each), its workers paused past their lease and killed while, once, the stream's
/// primary fails over (`redis-failover`): replication to its replica is cut (the replica's
/// replication credentials made wrong, its link dropped), the primary works alone for 2 s,
/// is SIGKILLed, and the replica takes its slots over (`CLUSTER FAILOVER TAKEOVER`); the
/// workers' cluster clients follow the slot map. The group's reads, acks, lease keys and dead
/// letters of those 2 s are lost. Asserted: nothing lost, nothing committed twice, no stale
/// accept, no fencing token handed out twice, no healthy cancellation (a Redis failover excuses
/// no lost lease: the heartbeat renews in PostgreSQL only), every job completed or dead-lettered
/// with its copy in the dead-letter stream, zombie commits refused; and the scenario did lose
/// Redis writes (bytes never replicated, acks lost), which the broker settled again afterwards
/// (the entries re-read or auto-claimed, found done in the database, acknowledged). The broker
/// stall and the server restart do not apply on a cluster, and the report says so. Guards: the
/// fenced commit and claim (`chaos_notices_a_missing_commit_guard` shows the same checks fail
/// without the commit compare-and-set; by hand on the cluster: `chaos --source redis
/// --redis-topology cluster --faults sigstop,sigkill,redis-failover --guards no-commit-cas`).
#[cfg(feature = "redis")]
#[test]
fn chaos_redis_cluster_failover() {
    use chaos::FaultKind;
    let mut config = ChaosConfig::redis_cluster_failover(database_url(), launcher());
    config.faults.extend([FaultKind::BrokerStall, FaultKind::RedisRestart]);
    let report = run_kept(config);
    assert_eq!(report.redis_failovers, 1, "the Redis failover did not happen\n{report}");
    assert_eq!(report.lost(), 0, "jobs lost\n{report}");
    assert_eq!(report.committed_twice, 0, "results committed twice\n{report}");
    assert_eq!(report.stale_accepts, 0, "receiver accepted a lower epoch\n{report}");
    assert_eq!(report.tokens_handed_out_twice, 0, "a (job, epoch) reached the receiver from two owners\n{report}");
    assert_eq!(report.losses.healthy, 0, "healthy cancellations\n{report}");
    assert_eq!(report.loss_reports_missing, 0, "lost attempts went unreported\n{report}");
    assert_eq!(report.completed + report.dead, report.jobs, "not every job completed or dead-lettered\n{report}");
    assert_eq!(report.poison_not_dead_lettered, 0, "poison jobs not dead-lettered with their copy\n{report}");
    assert!(report.zombie_commits_rejected >= 1, "no zombie commit was rejected\n{report}");
    assert!(report.sigstops >= 1 && report.sigkills >= 1, "{report}");
    for fault in ["broker-stall: the TCP proxy cannot sit in front of a Redis Cluster", "redis-restart: the cluster"] {
        assert!(report.not_applicable.iter().any(|n| n.starts_with(fault)), "{fault}\n{report}");
    }
    assert_eq!((report.broker_stalls, report.redis_restarts), (0, 0), "{report}");
    let failover = report.redis_failover.as_ref().expect("redis failover figures");
    assert!(failover.bytes_not_replicated.is_some_and(|n| n > 0), "replication was not cut\n{report}");
    assert!(
        failover.acks_lost.is_some_and(|n| n >= 1),
        "no ack was lost with the old primary: the failover lost nothing, it proved nothing\n{report}"
    );
    assert_eq!(failover.unsettled_at_end, Some(0), "entries left unacknowledged after the failover\n{report}");
    assert!(report.violations().is_empty(), "{report}");
}

/// The faults of issue #12's "Done when": broker stalls and PostgreSQL stalls, per source.
mod edges {
    use super::*;
    use chaos::FaultKind;
    use chaos::faults::{FaultRecord, Judgement, LossEvent, Target, judge, summarize};
    use chaos::proxy::StallProxy;
    use std::time::Duration;

    fn run_edges(source: SourceKind, faults: &[FaultKind]) -> chaos::Report {
        run_kept(ChaosConfig::edges(source, faults, database_url(), launcher()))
    }

    /// What every edge run must show: nothing lost, nothing committed twice, no stale accept,
    /// no lease lost while the database was reachable and the holder running, and loss reports
    /// that add up to the workers' counters.
    fn assert_edges(report: &chaos::Report) {
        assert_eq!(report.lost(), 0, "jobs lost\n{report}");
        assert_eq!(report.committed_twice, 0, "results committed twice\n{report}");
        assert_eq!(report.stale_accepts, 0, "receiver accepted a lower epoch\n{report}");
        assert_eq!(report.loss_reports_missing, 0, "lost attempts went unreported\n{report}");
        assert_eq!(report.completed + report.dead, report.jobs, "not every job completed or dead-lettered\n{report}");
        assert!(report.stalled_attempts >= 1, "no stall found an attempt in flight: it proved nothing\n{report}");
        assert_eq!(
            report.losses.healthy, 0,
            "attempts cancelled while the database was reachable and their holder running\n{report}"
        );
        assert!(report.violations().is_empty(), "{report}");
    }

    fn broker_stall(source: SourceKind) {
        let report = run_edges(source, &[FaultKind::BrokerStall]);
        assert!(report.broker_stalls >= 1, "no broker stall was injected\n{report}");
        assert_edges(&report);
    }

    fn pg_stall(source: SourceKind) {
        let report = run_edges(source, &[FaultKind::PgLock, FaultKind::PgPause]);
        assert!(report.pg_locks >= 1 && report.pg_locked_rows >= 1, "no running row was locked\n{report}");
        assert!(report.pg_pauses >= 1 && report.pg_paused_backends >= 1, "no backend was paused\n{report}");
        assert_edges(&report);
    }

    /// Issue #12, "Done when" (broker stall) and item 1 bullets 1–2: the stall proxy in front of
    /// LocalStack holds every byte for lease + 2 s while attempts that need their heartbeats are
    /// in flight. Guard: the database heartbeat never waits on a broker call (hooks off the
    /// heartbeat path, each bounded by a timeout), so no healthy lease is cancelled.
    #[cfg(feature = "sqs")]
    #[test]
    fn edges_broker_stall_sqs() {
        broker_stall(SourceKind::Sqs);
    }

    /// Issue #12, "Done when" (broker stall) and item 1 bullets 1–2, for Redis streams: the stall
    /// proxy in front of the run's private redis-server holds every byte for lease + 2 s
    /// (XCLAIM and the lease-key scripts hang). Guard: the heartbeat never waits on Redis.
    #[cfg(feature = "redis")]
    #[test]
    fn edges_broker_stall_redis_stream() {
        broker_stall(SourceKind::Redis);
    }

    /// Issue #12, "Done when" (PostgreSQL stall), table queue: one worker's live rows are
    /// locked, and later another worker's idle backends SIGSTOPped, each for lease + 2 s (the
    /// victims take turns). A victim's own attempts may be lost (excused: the database was
    /// stalled for it, and so for a worker seen waiting on the lock); no job is lost or
    /// committed twice, and no other worker loses a lease (guards: fenced commits and claims;
    /// the other workers' heartbeats share no statement and no connection with the victim's).
    /// On today's code this holds: a stalled worker's attempts end `LeaseLost { Unconfirmed }`
    /// or, when the stall caught them in their commit, `Fenced` after a takeover.
    #[test]
    fn edges_pg_stall_table_queue() {
        pg_stall(SourceKind::Table);
    }

    /// Issue #12, "Done when" (PostgreSQL stall), SQS: as for the table queue; in addition the
    /// stalled worker's messages become visible again (no confirmed heartbeat, no visibility
    /// extension) and other workers receive them: their claims of a locked row wait on the lock
    /// (those workers are excused while seen waiting), and no worker's heartbeat may queue behind
    /// such a claim (item 1 bullet 3).
    #[cfg(feature = "sqs")]
    #[test]
    fn edges_pg_stall_sqs() {
        pg_stall(SourceKind::Sqs);
    }

    /// Issue #12, "Done when" (PostgreSQL stall), Redis streams: as for SQS.
    #[cfg(feature = "redis")]
    #[test]
    fn edges_pg_stall_redis_stream() {
        pg_stall(SourceKind::Redis);
    }

    /// The table queue has no broker: a run asked for a broker stall says so and runs without it.
    #[test]
    fn edges_broker_stall_is_not_applicable_to_the_table_queue() {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner());
        let mut config = ChaosConfig::edges(SourceKind::Table, &[FaultKind::BrokerStall], database_url(), launcher());
        config.jobs = 12;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        let report = rt.block_on(chaos::run(config)).expect("chaos run could not be set up");
        println!("{report}");
        assert!(
            report.not_applicable.iter().any(|n| n.starts_with("broker-stall: the table queue has no broker")),
            "{report}"
        );
        assert_eq!(report.broker_stalls, 0, "{report}");
        assert!(report.to_string().contains("not applicable: broker-stall"), "{report}");
        assert!(report.violations().is_empty(), "{report}");
    }

    fn fault(kind: FaultKind, target: Target, start_ms: u64, end_ms: u64) -> FaultRecord {
        FaultRecord { kind, target, start_ms, end_ms: Some(end_ms), detail: String::new() }
    }

    fn loss(worker: usize, at_ms: u64) -> LossEvent {
        LossEvent { worker, incarnation: 0, key: format!("job-{at_ms}"), epoch: 1, reason: "Unconfirmed".into(), at_ms }
    }

    /// The rule that tells a healthy cancellation from an excused one (see `chaos::faults`): a
    /// pause or a database stall excuses only the worker it hit, within its window plus the
    /// slack; a broker stall or a Redis failover excuses nobody.
    #[test]
    fn edges_chaos_healthy_cancellation_rule() {
        let slack = Duration::from_secs(4);
        let faults = vec![
            fault(FaultKind::SigStop, Target::Worker(1), 1_000, 6_000),
            fault(FaultKind::BrokerStall, Target::All, 20_000, 25_000),
            fault(FaultKind::PgLock, Target::Worker(2), 40_000, 45_000),
            fault(FaultKind::PgTerminate, Target::All, 60_000, 60_010),
            fault(FaultKind::RedisFailover, Target::All, 80_000, 82_000),
        ];
        let excused = |w, t| judge(&loss(w, t), &faults, slack);
        assert_eq!(excused(1, 6_500), Judgement::Excused(FaultKind::SigStop));
        assert_eq!(excused(1, 9_900), Judgement::Excused(FaultKind::SigStop));
        assert_eq!(excused(1, 10_100), Judgement::Healthy(vec![]), "after the window and its slack");
        assert_eq!(excused(0, 6_500), Judgement::Healthy(vec![FaultKind::SigStop]), "another worker's pause");
        assert_eq!(excused(0, 22_000), Judgement::Healthy(vec![FaultKind::BrokerStall]));
        assert_eq!(excused(2, 22_000), Judgement::Healthy(vec![FaultKind::BrokerStall]));
        assert_eq!(excused(2, 44_000), Judgement::Excused(FaultKind::PgLock));
        assert_eq!(excused(0, 44_000), Judgement::Healthy(vec![FaultKind::PgLock]), "rows of another worker");
        assert_eq!(excused(0, 62_000), Judgement::Excused(FaultKind::PgTerminate));
        assert_eq!(
            excused(1, 81_000),
            Judgement::Healthy(vec![FaultKind::RedisFailover]),
            "the broker decides nothing"
        );
        let losses = [loss(1, 6_500), loss(0, 22_000), loss(2, 44_000), loss(0, 99_000)];
        let s = summarize(&losses, &faults, slack, 0);
        assert_eq!((s.lost_attempts, s.healthy), (4, 2), "{s:?}");
        assert_eq!(s.excused.get("sigstop"), Some(&1));
        assert_eq!(s.healthy_during.get("broker-stall"), Some(&1));
        assert_eq!(s.healthy_during.get("no fault"), Some(&1));
    }

    /// The loss reports the workers print parse back (the runner counts them against the
    /// workers' `lease_losses`).
    #[test]
    fn edges_chaos_loss_event_parses() {
        let l =
            LossEvent::parse(2, 1, "key=job-000007 epoch=3 reason=Unconfirmed at_ms=1700000000123").expect("parses");
        assert_eq!((l.worker, l.incarnation, l.key.as_str(), l.epoch), (2, 1, "job-000007", 3));
        assert_eq!((l.reason.as_str(), l.at_ms), ("Unconfirmed", 1_700_000_000_123));
        assert!(LossEvent::parse(0, 0, "key=job epoch=x reason=R at_ms=1").is_none());
    }

    /// The stall proxy forwards both ways, and while stalled holds every byte (of open and new
    /// connections) until the stall ends.
    #[test]
    fn edges_chaos_stall_proxy_holds_every_byte() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
        rt.block_on(async {
            let echo = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let upstream = echo.local_addr().expect("addr").to_string();
            tokio::spawn(async move {
                while let Ok((mut s, _)) = echo.accept().await {
                    tokio::spawn(async move {
                        let mut buf = [0u8; 64];
                        while let Ok(n) = s.read(&mut buf).await {
                            if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    });
                }
            });
            let proxy = StallProxy::start(upstream).await.expect("proxy");
            let mut a = tokio::net::TcpStream::connect(proxy.addr()).await.expect("connect");
            let mut buf = [0u8; 4];
            a.write_all(b"ping").await.expect("write");
            tokio::time::timeout(Duration::from_secs(5), a.read_exact(&mut buf)).await.expect("echo").expect("read");
            assert_eq!(&buf, b"ping");

            let stalled_at = std::time::Instant::now();
            proxy.stall_for(Duration::from_millis(1500));
            a.write_all(b"pong").await.expect("write");
            let mut b = tokio::net::TcpStream::connect(proxy.addr()).await.expect("connect during the stall");
            b.write_all(b"new!").await.expect("write");
            let early = tokio::time::timeout(Duration::from_millis(900), a.read_exact(&mut buf)).await;
            assert!(early.is_err(), "a byte went through the stalled proxy");
            tokio::time::timeout(Duration::from_secs(5), a.read_exact(&mut buf)).await.expect("after").expect("read");
            assert_eq!(&buf, b"pong");
            assert!(stalled_at.elapsed() >= Duration::from_millis(1400), "released early: {:?}", stalled_at.elapsed());
            tokio::time::timeout(Duration::from_secs(5), b.read_exact(&mut buf)).await.expect("new").expect("read");
            assert_eq!(&buf, b"new!");
            assert!(proxy.stats().connections.load(std::sync::atomic::Ordering::Relaxed) >= 2);
        });
    }
}
