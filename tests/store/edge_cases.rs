//! Issue #12, the store's part: the schema check workers run instead of migrating (§1 bullet 5),
//! the heartbeat's reserved capacity and statement/lock timeouts (§1 bullet 3), online migrations
//! (§1 bullet 5), SQLite's durable default (§2 bullet 3), and failures counted apart from claims
//! (§3 bullet 3). Real PostgreSQL (a fresh schema per test) and real SQLite files.

use brokerfence_testkit::store as common;

mod edges {
    use std::time::{Duration, Instant};

    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use brokerfence::{
        Claim, FailOutcome, FenceError, FenceStore, JobState, Lease, LeaseDuration, Owner, PgFence, QueueName,
        RetryPolicy, SqliteDurability, SqliteFence,
    };
    use sqlx::{AssertSqlSafe, Connection};

    use super::common::{self, key, lease};

    /// Waits until the lease `l` has run out on the database clock.
    async fn lapse<S: FenceStore>(s: &S, l: &Lease) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while s.db_now().await.expect("db_now").0 <= l.lease_until.0 {
            assert!(Instant::now() < deadline, "lease of {} did not run out", l.key);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Claims `k` for a fresh owner, waiting out a backoff if there is one.
    async fn claim_when_due<S: FenceStore>(s: &S, q: &QueueName, k: &str, ttl: LeaseDuration) -> Claim {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match s.claim(q, &key(k), &Owner::unique("w"), ttl).await.expect("claim") {
                Claim::Backoff { retry_in, .. } if Instant::now() < deadline => {
                    tokio::time::sleep(retry_in + Duration::from_millis(10)).await
                }
                other => return other,
            }
        }
    }

    /// §3 bullet 3 (a takeover is not the job's fault): three holders stall (each lease runs out
    /// and the next claim takes the job over), then the receiver answers 503 twice. With
    /// `max_attempts = 3` the job is `failed` (retryable) with failures = 2 and attempts
    /// (claims) = 5, the backoff follows the failures (100 ms, 200 ms, not 2^(claims-1) × 100 ms);
    /// the third failure buries it, naming the cap. Guard: the `failures` counter in the fail
    /// statements; counting claims, the job is dead at the first 503 ("attempts 4 ≥ 3").
    async fn takeovers_are_not_failures<S: FenceStore>(s: S) {
        let q = queue();
        let p = RetryPolicy {
            max_attempts: 3,
            base_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(3600),
        };
        for stall in 1..=3 {
            let l = claimed(Ok(claim_when_due(&s, &q, "stalled", lease(3)).await));
            assert_eq!(l.attempts, stall);
            lapse(&s, &l).await;
        }
        for failure in 1..=2i64 {
            let l = claimed(Ok(claim_when_due(&s, &q, "stalled", lease(3)).await));
            let out = s.fail(&l, "receiver answered 503", true, &p).await.expect("fail");
            let backoff = Duration::from_millis(100 << (failure - 1));
            assert_eq!(out, FailOutcome::Retry { retry_in: backoff }, "failure {failure} after {} claims", l.attempts);
        }
        let r = s.job(&q, &key("stalled")).await.expect("job").expect("row");
        assert_eq!((r.state, r.attempts, r.failures), (JobState::Failed, 5, 2), "{r:?}");
        assert_eq!(r.last_error.as_deref(), Some("receiver answered 503"));
        let l = claimed(Ok(claim_when_due(&s, &q, "stalled", lease(3)).await));
        assert_eq!(s.fail(&l, "receiver answered 503", true, &p).await.expect("fail"), FailOutcome::Dead);
        let r = s.job(&q, &key("stalled")).await.expect("job").expect("row");
        assert_eq!((r.state, r.attempts, r.failures), (JobState::Dead, 6, 3), "{r:?}");
        assert_eq!(r.last_error.as_deref(), Some("failed 3 times (max_attempts = 3): receiver answered 503"));
        assert_eq!(
            s.claim(&q, &key("stalled"), &Owner::unique("late"), lease(3)).await.expect("claim"),
            Claim::Dead { epoch: 6 }
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_pg_takeovers_are_not_failures() {
        takeovers_are_not_failures(common::pg().await).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_sqlite_takeovers_are_not_failures() {
        takeovers_are_not_failures(common::sqlite().await).await
    }

    /// §3 bullet 3 (a separate, higher cap on claims, against a job that kills its workers):
    /// with `max_claims = 2`, a broker delivery and a table-queue job each claimed twice by
    /// holders that never finish are dead at the third claim: the broker claim answers
    /// `Claim::Dead`, `claim_next` hands nothing out, and the last error names the cap. The last
    /// holder stays fenced. Guard: the cap in the claim and `claim_next` statements.
    async fn claims_are_capped<S: FenceStore>(s: S) {
        let q = queue();
        assert!(s.enqueue(&q, &key("queued"), b"p").await.expect("enqueue"));
        let mut last = None;
        for claim in 1..=2 {
            let a = claimed(s.claim(&q, &key("delivered"), &Owner::unique("killed"), lease(3)).await);
            let b = s.claim_next(&q, &Owner::unique("killed"), lease(3), 10).await.expect("claim_next");
            assert_eq!(b.len(), 1, "claim {claim}: {b:?}");
            assert_eq!((a.attempts, b[0].lease.attempts), (claim, claim));
            lapse(&s, &a).await;
            lapse(&s, &b[0].lease).await;
            last = Some(a);
        }
        assert_eq!(
            s.claim(&q, &key("delivered"), &Owner::unique("next"), lease(3)).await.expect("claim"),
            Claim::Dead { epoch: 2 }
        );
        assert!(s.claim_next(&q, &Owner::unique("next"), lease(3), 10).await.expect("claim_next").is_empty());
        for k in ["delivered", "queued"] {
            let r = s.job(&q, &key(k)).await.expect("job").expect("row");
            assert_eq!((r.state, r.attempts, r.failures, r.epoch), (JobState::Dead, 2, 0, 2), "{k}: {r:?}");
            assert_eq!(r.last_error.as_deref(), Some("claimed 2 times without finishing (max_claims = 2)"), "{k}");
        }
        let last = last.expect("claimed");
        assert!(s.complete(&last, b"late").await.is_err_and(|e| e.is_fenced()));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_pg_claims_are_capped() {
        claims_are_capped(common::pg().await.max_claims(2)).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_sqlite_claims_are_capped() {
        claims_are_capped(common::sqlite().await.max_claims(2)).await
    }

    /// The default cap sits well above the default `max_attempts`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_default_claims_cap_is_above_max_attempts() {
        let policy = RetryPolicy::default();
        assert_eq!(policy.max_claims(), 20);
        assert!(common::pg().await.get_max_claims() >= 4 * policy.max_attempts);
        assert!(common::sqlite().await.get_max_claims() >= 4 * policy.max_attempts);
    }

    /// §2 bullet 3 (SQLite durability): a fence opened with `SqliteFence::open` runs with
    /// `synchronous = FULL` (2) on every connection of its pool; `NORMAL` (1) only when asked for
    /// with `open_with(.., SqliteDurability::Normal)`. Guard: the default in `open`; with NORMAL
    /// a commit can roll back at a power loss after its broker message was deleted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_sqlite_is_synchronous_full_unless_asked_otherwise() {
        async fn synchronous(s: &SqliteFence) -> Vec<i64> {
            // Several connections at once, so that each one of the pool is asked.
            let mut conns = Vec::new();
            for _ in 0..3 {
                conns.push(s.pool().acquire().await.expect("conn"));
            }
            let mut out = Vec::new();
            for c in &mut conns {
                out.push(sqlx::query_scalar("PRAGMA synchronous").fetch_one(&mut **c).await.expect("pragma"));
            }
            out
        }
        let path = common::sqlite_path();
        let url = format!("sqlite:{}", path.display());
        let default = SqliteFence::open(&url).await.expect("open");
        default.migrate().await.expect("migrate");
        assert_eq!(synchronous(&default).await, [2, 2, 2], "open() is synchronous = FULL");
        let journal: String =
            sqlx::query_scalar("PRAGMA journal_mode").fetch_one(default.pool()).await.expect("journal_mode");
        assert_eq!(journal, "wal");
        let full = SqliteFence::open_with(&url, SqliteDurability::Full).await.expect("open");
        assert_eq!(synchronous(&full).await, [2, 2, 2]);
        let normal = SqliteFence::open_with(&url, SqliteDurability::Normal).await.expect("open");
        assert_eq!(synchronous(&normal).await, [1, 1, 1], "opt-in NORMAL");
        assert_eq!(SqliteDurability::default(), SqliteDurability::Full);
    }

    /// The key columns' collations, to tell migration 2's state.
    async fn key_collations(s: &PgFence) -> Vec<String> {
        sqlx::query_scalar(
            "SELECT coalesce(l.collname::text, '') FROM pg_attribute a \
             JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
             LEFT JOIN pg_collation l ON l.oid = a.attcollation \
             WHERE n.nspname = $1 AND (c.relname, a.attname) IN (('jobs', 'queue'), ('jobs', 'key')) ORDER BY 1",
        )
        .bind(s.get_schema().as_str().to_owned())
        .fetch_all(s.pool())
        .await
        .expect("collations")
    }

    /// §1 bullet 5 (rolling deploys: schema changes are online): a worker heartbeats its lease
    /// every 200 ms while another live transaction holds a lock on `jobs` for 3 s (a row updated
    /// and not yet committed, as a commit inside a business transaction holds it), and a second
    /// process runs `migrate()` on a schema at version 1 (migration 2 asks for an exclusive
    /// lock on `jobs`). Every heartbeat renews within lease/3 (1 s), and the migration completes
    /// once the transaction ends. Guard: the migration's short lock_timeout and retry; without
    /// them its exclusive lock request waits behind the transaction for 3 s, and every heartbeat
    /// queues behind it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn edges_pg_migrate_on_a_live_table_does_not_stall_heartbeats() {
        let worker = common::pg().await;
        let sc = worker.get_schema().as_str().to_owned();
        let q = queue();
        let me = Owner::unique("live");
        let l = claimed(worker.claim(&q, &key("heartbeated"), &me, lease(3)).await);
        claimed(worker.claim(&q, &key("held"), &me, lease(30)).await);
        // Back to the schema an older release left: migration 1 only.
        for sql in [
            format!(
                "ALTER TABLE {sc}.jobs ALTER COLUMN queue TYPE text COLLATE \"default\", ALTER COLUMN key TYPE text COLLATE \"default\""
            ),
            format!(
                "ALTER TABLE {sc}.ledger ALTER COLUMN scope TYPE text COLLATE \"default\", ALTER COLUMN job TYPE text COLLATE \"default\""
            ),
            format!("ALTER TABLE {sc}.jobs DROP COLUMN IF EXISTS failures"),
            format!("DELETE FROM {sc}._migrations WHERE version >= 2"),
        ] {
            sqlx::query(AssertSqlSafe(sql)).execute(worker.pool()).await.expect("downgrade");
        }
        assert!(key_collations(&worker).await.iter().all(|c| c != "C"));

        // A live transaction holds a lock on jobs.
        let mut live = sqlx::PgConnection::connect(&common::database_url()).await.expect("connect");
        let mut tx = live.begin().await.expect("begin");
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {sc}.jobs SET updated_at = clock_timestamp() WHERE queue = $1 AND key = 'held'"
        )))
        .bind(q.as_str().to_owned())
        .execute(&mut *tx)
        .await
        .expect("hold a row");

        let stop = Arc::new(AtomicBool::new(false));
        let beats = tokio::spawn({
            let (worker, stop, l) = (worker.clone(), stop.clone(), l.clone());
            async move {
                let mut latencies = Vec::new();
                let mut l = l;
                while !stop.load(Ordering::SeqCst) {
                    let t0 = Instant::now();
                    let hb = tokio::time::timeout(
                        Duration::from_secs(1),
                        worker.heartbeat(std::slice::from_ref(&l), lease(3)),
                    )
                    .await;
                    let took = t0.elapsed();
                    match hb {
                        Ok(Ok(hb)) if hb.renewed.len() == 1 => l = hb.renewed[0].clone(),
                        other => return Err(format!("heartbeat after {latencies:?} failed after {took:?}: {other:?}")),
                    }
                    latencies.push(took);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                Ok(latencies)
            }
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let migrator = common::pg_on(worker.get_schema().clone()).await;
        let migration = tokio::spawn(async move { migrator.migrate().await });
        tokio::time::sleep(Duration::from_secs(3)).await;
        tx.commit().await.expect("the live transaction ends");
        let migrated = tokio::time::timeout(Duration::from_secs(15), migration).await;
        // A few more beats after the migration, on the changed table.
        tokio::time::sleep(Duration::from_millis(600)).await;
        stop.store(true, Ordering::SeqCst);
        let latencies = beats.await.expect("heartbeat task").unwrap_or_else(|e| panic!("{e}"));
        migrated.expect("migrate finished").expect("migrate task").expect("migrate");
        assert!(latencies.len() >= 10, "{latencies:?}");
        let slowest = latencies.iter().max().copied().unwrap_or_default();
        assert!(slowest < Duration::from_secs(1), "slowest heartbeat {slowest:?} of {latencies:?}");
        worker.check_schema().await.expect("schema is current");
        assert!(key_collations(&worker).await.iter().all(|c| c == "C"));
    }

    #[track_caller]
    fn claimed(c: brokerfence::Result<Claim>) -> Lease {
        match c {
            Ok(Claim::Claimed(l)) => l,
            other => panic!("expected Claimed, got {other:?}"),
        }
    }

    fn queue() -> QueueName {
        QueueName::new(common::unique("q")).expect("queue")
    }

    fn is_lock_timeout(e: &FenceError) -> bool {
        matches!(e, FenceError::LockTimeout(_))
    }

    /// §1 bullet 3 (the heartbeat does not queue behind claims and commits on a shared pool):
    /// every connection of the fence's main pool is held, as claims and commits stuck on a slow
    /// database would hold them, and a heartbeat through the same `PgFence` still renews within
    /// lease/3. Guard: the heartbeat's reserved connections (`PgFence::heartbeat_pool`); on one
    /// shared pool the renewal waits for a connection (up to the pool's 10 s acquire timeout).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_pg_heartbeat_renews_while_the_main_pool_is_saturated() {
        let pool = PgFence::pool_options().max_connections(2).connect(&common::database_url()).await.expect("pool");
        let s = PgFence::new(pool).schema(common::unique_schema());
        s.migrate().await.expect("migrate");
        let q = queue();
        let me = Owner::unique("w");
        let l = claimed(s.claim(&q, &key("k"), &me, lease(3)).await);
        let held = [s.pool().acquire().await.expect("conn 1"), s.pool().acquire().await.expect("conn 2")];
        // The main pool is full: a claim now waits for a connection.
        let blocked = tokio::time::timeout(Duration::from_millis(300), s.claim(&q, &key("other"), &me, lease(3))).await;
        assert!(blocked.is_err(), "the main pool was not saturated: {blocked:?}");
        for round in 0..3 {
            let t0 = Instant::now();
            let hb = tokio::time::timeout(Duration::from_secs(1), s.heartbeat(std::slice::from_ref(&l), lease(3)))
                .await
                .unwrap_or_else(|_| {
                    panic!("heartbeat {round} did not answer within lease/3 (1 s): it queued for a connection")
                })
                .expect("heartbeat");
            assert_eq!((hb.renewed.len(), hb.lost.len()), (1, 0), "{hb:?}");
            assert!(t0.elapsed() < Duration::from_secs(1));
        }
        drop(held);
        s.complete(&l, b"r").await.expect("complete once the pool frees up");
    }

    /// §1 bullet 3 (fence statements run with a lock_timeout that fits the lease): a job row is
    /// locked by another transaction that does not end (a stalled session). A commit gives up
    /// after the main pool's lock_timeout (3 s) with `FenceError::LockTimeout`, instead of
    /// hanging; once the lock is gone it goes through. A heartbeat does not wait at all (issue
    /// 13): it skips the locked row and reports its lease `held` (neither renewed nor lost).
    /// Guard: the `lock_timeout` startup options of `PgTimeouts`; without them the commit waits
    /// forever.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_pg_statements_blocked_on_a_lock_give_up_after_lock_timeout() {
        let s = common::pg().await;
        let q = queue();
        let me = Owner::unique("w");
        let l = claimed(s.claim(&q, &key("locked"), &me, lease(30)).await);
        let mut stalled = sqlx::PgConnection::connect(&common::database_url()).await.expect("connect");
        let mut tx = stalled.begin().await.expect("begin");
        sqlx::query(AssertSqlSafe(format!(
            "SELECT 1 FROM {}.jobs WHERE queue = $1 AND key = $2 FOR UPDATE",
            s.get_schema().as_str()
        )))
        .bind(q.as_str().to_owned())
        .bind("locked")
        .execute(&mut *tx)
        .await
        .expect("lock the row");

        let t0 = Instant::now();
        let hb = tokio::time::timeout(Duration::from_secs(8), s.heartbeat(std::slice::from_ref(&l), lease(30)))
            .await
            .expect("heartbeat hung on a locked row");
        let waited = t0.elapsed();
        let hb = hb.expect("a heartbeat never waits on a row lock");
        assert_eq!((hb.renewed.len(), hb.lost.len(), hb.held.len()), (0, 0, 1), "{hb:?}");
        assert!(waited < Duration::from_millis(900), "heartbeat waited {waited:?} on a locked row");

        let t0 = Instant::now();
        let done = tokio::time::timeout(Duration::from_secs(10), s.complete(&l, b"r"))
            .await
            .expect("complete hung on a locked row");
        let waited = t0.elapsed();
        assert!(done.as_ref().is_err_and(is_lock_timeout), "{done:?}");
        assert!(
            waited >= Duration::from_millis(2_900) && waited < Duration::from_secs(6),
            "commit gave up after {waited:?}"
        );
        let msg = done.expect_err("timed out").to_string();
        assert!(msg.contains("lock_timeout"), "{msg}");

        tx.rollback().await.expect("rollback");
        let hb = s.heartbeat(std::slice::from_ref(&l), lease(30)).await.expect("heartbeat after the lock");
        assert_eq!(hb.renewed.len(), 1);
        s.complete(&l, b"r").await.expect("commit after the lock");
    }

    /// The newest migration version recorded, read directly.
    async fn pg_version(s: &PgFence) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT max(version) FROM {}._migrations", s.get_schema().as_str())))
            .fetch_one(s.pool())
            .await
            .expect("read migrations")
    }

    async fn sqlite_version(s: &SqliteFence) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT max(version) FROM {}__migrations", s.get_schema().as_str())))
            .fetch_one(s.pool())
            .await
            .expect("read migrations")
    }

    #[track_caller]
    fn too_old(r: brokerfence::Result<()>, found: i64, required: i64) {
        match r {
            Err(e @ FenceError::SchemaTooOld { .. }) => {
                let FenceError::SchemaTooOld { found: f, required: q } = e else { unreachable!() };
                assert_eq!((f, q), (found, required), "{e}");
                let msg = e.to_string();
                // The library names its call (the examples add their `--migrate`: issue #30 item 14).
                assert!(msg.contains("run migrations") && msg.contains("FenceStore::migrate"), "{msg}");
            }
            other => panic!("expected SchemaTooOld {{ found: {found}, required: {required} }}, got {other:?}"),
        }
    }

    /// §1 bullet 5 (rolling deploys): a worker checks the schema instead of migrating. No
    /// schema: `SchemaTooOld { found: 0 }` with a message that says to run migrations; migrated:
    /// Ok; one migration short: refused; a newer schema (a version this build does not know):
    /// Ok. Guard: `PgFence::check_schema`'s comparison against the newest embedded migration.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_pg_check_schema_refuses_an_older_schema_and_accepts_a_newer_one() {
        let s = common::pg_unmigrated().await;
        let required = {
            let probe = common::pg_unmigrated().await;
            probe.migrate().await.expect("migrate");
            pg_version(&probe).await
        };
        too_old(s.check_schema().await, 0, required);
        s.migrate().await.expect("migrate");
        s.check_schema().await.expect("a migrated schema passes");
        let sc = s.get_schema().as_str().to_owned();
        let exec = |sql: String| {
            let pool = s.pool().clone();
            async move { sqlx::query(AssertSqlSafe(sql)).execute(&pool).await.expect("edit migrations") }
        };
        exec(format!("DELETE FROM {sc}._migrations WHERE version = {required}")).await;
        too_old(s.check_schema().await, required - 1, required);
        exec(format!("INSERT INTO {sc}._migrations (version, name) VALUES ({required}, 'back'), (999, 'newer')")).await;
        s.check_schema().await.expect("a newer schema passes");
        assert_eq!(pg_version(&s).await, 999);
    }

    /// §1 bullet 5, SQLite: the same check on a SQLite file. Guard: `SqliteFence::check_schema`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_sqlite_check_schema_refuses_an_older_schema_and_accepts_a_newer_one() {
        let s = common::sqlite_unmigrated().await;
        let required = {
            let probe = common::sqlite().await;
            sqlite_version(&probe).await
        };
        too_old(s.check_schema().await, 0, required);
        s.migrate().await.expect("migrate");
        s.check_schema().await.expect("a migrated schema passes");
        let sc = s.get_schema().as_str().to_owned();
        let exec = |sql: String| {
            let pool = s.pool().clone();
            async move { sqlx::query(AssertSqlSafe(sql)).execute(&pool).await.expect("edit migrations") }
        };
        exec(format!("DELETE FROM {sc}__migrations WHERE version = {required}")).await;
        too_old(s.check_schema().await, required - 1, required);
        exec(format!(
            "INSERT INTO {sc}__migrations (version, name, applied_at) VALUES ({required}, 'back', 0), (999, 'newer', 0)"
        ))
        .await;
        s.check_schema().await.expect("a newer schema passes");
        assert_eq!(sqlite_version(&s).await, 999);
    }

    /// §2 bullet 3, the measured cost of `synchronous = FULL` (a benchmark, not a check: run it
    /// with `cargo test --workspace --all-features edges_sqlite_durability_cost -- --ignored
    /// --nocapture`). Rounds alternate FULL and NORMAL (A/B/A/B…), each on a fresh
    /// file in the system's temp directory: 300 jobs claimed and completed one by one (two commits
    /// each), then 300 more in batches of ten (`claim_batch` + `complete_batch`, two commits per
    /// ten jobs). Prints the median jobs/s of each.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "benchmark: run with --ignored --nocapture"]
    async fn edges_sqlite_durability_cost() {
        const ROUNDS: usize = 6;
        const JOBS: usize = 300;
        async fn round(durability: SqliteDurability) -> (f64, f64) {
            let path = common::sqlite_path();
            let s = SqliteFence::open_with(&format!("sqlite:{}", path.display()), durability).await.expect("open");
            s.migrate().await.expect("migrate");
            let q = queue();
            let me = Owner::unique("bench");
            let t0 = Instant::now();
            for i in 0..JOBS {
                let l = claimed(s.claim(&q, &key(&format!("one-{i}")), &me, lease(30)).await);
                s.complete(&l, b"r").await.expect("complete");
            }
            let single = JOBS as f64 / t0.elapsed().as_secs_f64();
            let t0 = Instant::now();
            for b in 0..JOBS / 10 {
                let keys: Vec<_> = (0..10).map(|i| key(&format!("batch-{b}-{i}"))).collect();
                let items: Vec<(Lease, Vec<u8>)> = s
                    .claim_batch(&q, &keys, &me, lease(30))
                    .await
                    .expect("claim_batch")
                    .into_iter()
                    .map(|c| (claimed(Ok(c)), b"r".to_vec()))
                    .collect();
                assert!(s.complete_batch(&items).await.expect("complete_batch").iter().all(Result::is_ok));
            }
            let batched = JOBS as f64 / t0.elapsed().as_secs_f64();
            s.pool().close().await;
            for suffix in ["", "-wal", "-shm"] {
                let _ = std::fs::remove_file(format!("{}{suffix}", path.display()));
            }
            (single, batched)
        }
        fn median(mut v: Vec<f64>) -> f64 {
            v.sort_by(f64::total_cmp);
            let n = v.len();
            if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
        }
        let (mut full, mut normal) = (Vec::new(), Vec::new());
        for r in 0..ROUNDS {
            for durability in [SqliteDurability::Full, SqliteDurability::Normal] {
                let got = round(durability).await;
                eprintln!(
                    "round {r} {durability:?}: {:.0} jobs/s one by one, {:.0} jobs/s in batches of 10",
                    got.0, got.1
                );
                if durability == SqliteDurability::Full { full.push(got) } else { normal.push(got) }
            }
        }
        let med =
            |v: &Vec<(f64, f64)>| (median(v.iter().map(|x| x.0).collect()), median(v.iter().map(|x| x.1).collect()));
        let (f, n) = (med(&full), med(&normal));
        eprintln!(
            "median of {ROUNDS} rounds each: FULL {:.0} / {:.0} jobs/s, NORMAL {:.0} / {:.0} jobs/s (one by one / batches of 10); \
             FULL costs {:.0} % / {:.0} %",
            f.0,
            f.1,
            n.0,
            n.1,
            100.0 * (1.0 - f.0 / n.0),
            100.0 * (1.0 - f.1 / n.1)
        );
    }
}
