//! Issue #12, the store's part: the schema check workers run instead of migrating (§1 bullet 5),
//! the heartbeat's reserved capacity and statement/lock timeouts (§1 bullet 3), online migrations
//! (§1 bullet 5), SQLite's durable default (§2 bullet 3), and failures counted apart from claims
//! (§3 bullet 3). Real PostgreSQL (a fresh schema per test) and real SQLite files.

mod common;

mod edges {
    use std::time::{Duration, Instant};

    use brokerfence::fence::{Claim, FenceError, FenceStore, Lease, Owner, PgFence, QueueName, SqliteFence};
    use sqlx::{AssertSqlSafe, Connection};

    use super::common::{self, key, lease};

    #[track_caller]
    fn claimed(c: brokerfence::fence::Result<Claim>) -> Lease {
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
        let s = PgFence::new(pool).with_schema(common::unique_schema());
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
    /// after the main pool's lock_timeout (3 s) and a heartbeat after the heartbeat's (1 s), each
    /// with `FenceError::LockTimeout`, instead of hanging; once the lock is gone both go through.
    /// Guard: the `lock_timeout` startup options of `PgTimeouts`; without them both wait forever.
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
            s.schema().as_str()
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
        assert!(hb.as_ref().is_err_and(is_lock_timeout), "{hb:?}");
        assert!(
            waited >= Duration::from_millis(900) && waited < Duration::from_secs(4),
            "heartbeat gave up after {waited:?}"
        );

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
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT max(version) FROM {}._migrations", s.schema().as_str())))
            .fetch_one(s.pool())
            .await
            .expect("read migrations")
    }

    async fn sqlite_version(s: &SqliteFence) -> i64 {
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT max(version) FROM {}__migrations", s.schema().as_str())))
            .fetch_one(s.pool())
            .await
            .expect("read migrations")
    }

    #[track_caller]
    fn too_old(r: brokerfence::fence::Result<()>, found: i64, required: i64) {
        match r {
            Err(e @ FenceError::SchemaTooOld { .. }) => {
                let FenceError::SchemaTooOld { found: f, required: q } = e else { unreachable!() };
                assert_eq!((f, q), (found, required), "{e}");
                let msg = e.to_string();
                assert!(msg.contains("run migrations") && msg.contains("--migrate"), "{msg}");
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
        let sc = s.schema().as_str().to_owned();
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
        let sc = s.schema().as_str().to_owned();
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
}
