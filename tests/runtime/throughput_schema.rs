//! Issue #18, migrations 8 and 9: claims are HOT updates. One index (`jobs_open`) holds every job
//! not yet finished whatever its state, `finished` says which finished rows `jobs_finished`
//! holds, a CHECK keeps `finished` in step with `state`, and the epoch guard is an AFTER
//! trigger.

use brokerfence_testkit::store as common;

use std::time::Duration;

use brokerfence::retention::{QueueRetention, Retention};
use brokerfence::{FenceStore, JobKey, Owner, PgFence, QueueName};
use sqlx::AssertSqlSafe;

async fn exec(s: &PgFence, sql: String) {
    sqlx::query(AssertSqlSafe(sql.clone())).execute(s.pool()).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// The definitions of the jobs table's indexes, by name.
async fn indexes(s: &PgFence) -> Vec<(String, String)> {
    sqlx::query_as(
        "SELECT indexname::text, indexdef FROM pg_indexes WHERE schemaname = $1 AND tablename = 'jobs' ORDER BY 1",
    )
    .bind(s.get_schema().as_str())
    .fetch_all(s.pool())
    .await
    .unwrap()
}

/// Covers: migrations 8 and 9 on a schema an earlier build left (no `finished` column, the former
/// `jobs_due`, `jobs_leased` and `jobs_finished` indexes, the BEFORE epoch trigger, completed and
/// dead rows): the finished rows get `finished`, the open ones stay claimable (a running row whose
/// lease ran out too), the pruner finds the old completed row through the new `jobs_finished`, the
/// former indexes are gone, and the epoch trigger runs AFTER and still refuses a lower epoch. Guard: without the migration's UPDATE the CHECK cannot be validated and `migrate` fails;
/// without the new `jobs_finished` the pruner's plan test in `retention.rs` fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_hot_claims_migration_upgrades_an_earlier_schema() {
    let s = common::pg().await;
    let sc = s.get_schema().as_str().to_owned();
    // Back to what migrations 1-7 left (the BEFORE trigger of migration 7 included).
    for sql in [
        format!("ALTER TABLE {sc}.jobs DROP CONSTRAINT jobs_finished_is_final_state"),
        format!("ALTER TABLE {sc}.jobs DROP COLUMN finished"),
        format!("CREATE INDEX jobs_due ON {sc}.jobs (queue, run_at) WHERE state IN ('pending', 'failed')"),
        format!("CREATE INDEX jobs_leased ON {sc}.jobs (queue, lease_until) WHERE state = 'running'"),
        format!(
            "CREATE INDEX jobs_finished ON {sc}.jobs (queue, state, updated_at) WHERE state IN ('completed', 'dead')"
        ),
        format!("ALTER TABLE {sc}.jobs SET (fillfactor = 70)"),
        format!("DROP TRIGGER jobs_epoch_never_decreases ON {sc}.jobs"),
        format!(
            "CREATE TRIGGER jobs_epoch_never_decreases BEFORE UPDATE OF epoch ON {sc}.jobs FOR EACH ROW \
             WHEN (NEW.epoch < OLD.epoch) EXECUTE FUNCTION {sc}.epoch_never_decreases()"
        ),
        format!("DELETE FROM {sc}._migrations WHERE version >= 8"),
        // Rows as the earlier build wrote them.
        format!(
            "INSERT INTO {sc}.jobs (queue, key, state, epoch, owner, lease_until, attempts, result, updated_at) VALUES \
             ('up', 'done', 'completed', 3, 'w', NULL, 1, '\\x6f6b', clock_timestamp() - interval '2 hours'), \
             ('up', 'gave-up', 'dead', 5, 'w', NULL, 5, NULL, clock_timestamp()), \
             ('up', 'waiting', 'pending', 0, NULL, NULL, 0, NULL, clock_timestamp()), \
             ('up', 'expired', 'running', 2, 'gone', clock_timestamp() - interval '1 minute', 1, NULL, clock_timestamp())"
        ),
    ] {
        exec(&s, sql).await;
    }
    let upgraded = common::pg_on(s.get_schema().clone()).await;
    upgraded.migrate().await.unwrap();

    let finished: Vec<(String, Option<String>)> =
        sqlx::query_as(AssertSqlSafe(format!("SELECT key, finished FROM {sc}.jobs WHERE queue = 'up' ORDER BY key")))
            .fetch_all(upgraded.pool())
            .await
            .unwrap();
    let expected = [("done", Some("completed")), ("expired", None), ("gave-up", Some("dead")), ("waiting", None)];
    let expected: Vec<(String, Option<String>)> =
        expected.iter().map(|(k, f)| (k.to_string(), f.map(str::to_owned))).collect();
    assert_eq!(finished, expected);

    let defs = indexes(&upgraded).await;
    let names: Vec<&str> = defs.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["jobs_finished", "jobs_open", "jobs_pkey"], "{defs:?}");
    assert!(defs.iter().any(|(n, d)| n == "jobs_finished" && d.contains("(queue, finished, updated_at)")), "{defs:?}");

    // The epoch guard runs after the row (migration 9), and still refuses a lower epoch.
    let timing: Vec<String> = sqlx::query_scalar(
        "SELECT action_timing::text FROM information_schema.triggers \
         WHERE event_object_schema = $1 AND trigger_name = 'jobs_epoch_never_decreases'",
    )
    .bind(&sc)
    .fetch_all(upgraded.pool())
    .await
    .unwrap();
    assert_eq!(timing, ["AFTER"]);
    let lowered = sqlx::query(AssertSqlSafe(format!("UPDATE {sc}.jobs SET epoch = 0 WHERE key = 'gave-up'")))
        .execute(upgraded.pool())
        .await;
    assert!(lowered.is_err_and(|e| e.to_string().contains("would go from 5 to 0")));

    // Both open rows are claimable, the expired lease at a new epoch.
    let q = QueueName::new("up").unwrap();
    let got = upgraded.claim_next(&q, &Owner::new("after").unwrap(), common::lease(30), 10).await.unwrap();
    let mut got: Vec<(String, i64)> = got.iter().map(|c| (c.lease.key.as_str().to_owned(), c.lease.epoch)).collect();
    got.sort();
    assert_eq!(got, [("expired".to_owned(), 3), ("waiting".to_owned(), 1)]);

    // The pruner finds the old completed row (and leaves the dead one, younger than its age).
    let retention = Retention::new()
        .queue(q.clone(), QueueRetention::completed_for(Duration::from_secs(3600)))
        .pause_between_batches(Duration::ZERO);
    let report = upgraded.prune(&retention).await.unwrap();
    assert_eq!(report.completed, 1, "{report:?}");
    assert!(common::job(&upgraded, &q, "done").await.is_none());
    assert!(common::job(&upgraded, &q, "gave-up").await.is_some());
}

/// Guard (migration 8's CHECK): a statement that finishes a job without setting `finished`, or
/// sets it on an open job, fails, instead of leaving a finished row in `jobs_open` (every claim
/// would read past it, and the pruner would never see it). Without the CHECK both updates pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_hot_claims_finished_follows_state() {
    let s = common::pg().await;
    let sc = s.get_schema().as_str().to_owned();
    let q = QueueName::new("check").unwrap();
    s.enqueue_many(&q, &[(JobKey::new("a").unwrap(), Vec::new())]).await.unwrap();
    for sql in [
        format!("UPDATE {sc}.jobs SET state = 'completed' WHERE key = 'a'"),
        format!("UPDATE {sc}.jobs SET state = 'dead', finished = 'completed' WHERE key = 'a'"),
        format!("UPDATE {sc}.jobs SET finished = 'dead' WHERE key = 'a'"),
    ] {
        let err = sqlx::query(AssertSqlSafe(sql.clone())).execute(s.pool()).await.expect_err(&sql);
        let code = err.as_database_error().and_then(|e| e.code()).map(|c| c.into_owned());
        assert_eq!(code.as_deref(), Some("23514"), "{sql}: {err}");
    }
    // The fence's own statements keep it: a completion and a dead letter pass.
    let owner = Owner::new("w").unwrap();
    let claimed = s.claim_next(&q, &owner, common::lease(30), 1).await.unwrap();
    let lease = claimed.into_iter().next().map(|c| c.lease).unwrap();
    s.complete(&lease, b"ok").await.unwrap();
    let row: (String, Option<String>) =
        sqlx::query_as(AssertSqlSafe(format!("SELECT state, finished FROM {sc}.jobs WHERE key = 'a'")))
            .fetch_one(s.pool())
            .await
            .unwrap();
    assert_eq!(row, ("completed".to_owned(), Some("completed".to_owned())));
}
