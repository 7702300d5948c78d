//! Issue #12, the store's part: the schema check workers run instead of migrating (§1 bullet 5),
//! the heartbeat's reserved capacity and statement/lock timeouts (§1 bullet 3), online migrations
//! (§1 bullet 5), SQLite's durable default (§2 bullet 3), and failures counted apart from claims
//! (§3 bullet 3). Real PostgreSQL (a fresh schema per test) and real SQLite files.

mod common;

mod edges {
    use brokerfence::fence::{FenceError, FenceStore, PgFence, SqliteFence};
    use sqlx::AssertSqlSafe;

    use super::common;

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
