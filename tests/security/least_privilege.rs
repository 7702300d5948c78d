//! Least privilege: the fence runs under a database role that owns nothing and holds only what
//! the fence schema needs — `USAGE` on the schema, `SELECT, INSERT, UPDATE` on its three tables
//! (jobs, ledger, outbox), `DELETE` on jobs and ledger and `SELECT, INSERT, UPDATE` on
//! epoch_floors (retention), and `USAGE` on the outbox id sequence. No superuser, no DDL.
//! The migrations are run by the schema's owner, itself a plain role (not a superuser) with
//! `CREATE` on the database.
//!
//! The roles are created here with random names and dropped at the end, so the test runs in
//! parallel and re-runs without cleanup. It needs a connecting user that can create roles
//! (a superuser, or a role with `CREATEROLE` and `CREATE` on the database); the grants are in
//! [`APP_GRANTS`].

use brokerfence_testkit::store as common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use brokerfence::TableQueue;
use brokerfence::ledger::PgLedger;
use brokerfence::retention::{QueueRetention, Retention};
use brokerfence::{
    Claim, FenceError, FenceStore, JobContext, JobKey, JobState, LeaseDuration, Owner, PgFence, QueueName, RetryPolicy,
    SchemaName, SupervisorConfig,
};
use brokerfence::{Consumer, ConsumerConfig};
use sqlx::AssertSqlSafe;
use sqlx::postgres::PgConnectOptions;
use tokio_util::sync::CancellationToken;

/// Everything the application role is granted, `{s}` the schema and `{app}` the role. This is the
/// whole list: the statements of the store and the ledger need nothing else.
pub const APP_GRANTS: &[&str] = &[
    "GRANT USAGE ON SCHEMA {s} TO {app}",
    "GRANT SELECT, INSERT, UPDATE ON {s}.jobs, {s}.ledger, {s}.outbox TO {app}",
    // Retention (migration 5), for the pruner only: it deletes finished jobs and old ledger rows
    // and raises the per-queue epoch floors. Job inserts read the floors through `epoch_floor`,
    // which runs as the schema's owner: claiming and enqueueing need no grant of their own.
    "GRANT DELETE ON {s}.jobs, {s}.ledger TO {app}",
    "GRANT SELECT, INSERT, UPDATE ON {s}.epoch_floors TO {app}",
    // The outbox's bigserial id (PostgreSQL only).
    "GRANT USAGE ON SEQUENCE {s}.outbox_id_seq TO {app}",
    // The dashboard's activity minutes and fence events (migration 13), written by supervisors
    // and deleted by the pruner.
    "GRANT SELECT, INSERT, UPDATE, DELETE ON {s}.activity, {s}.fence_events TO {app}",
    "GRANT USAGE ON SEQUENCE {s}.fence_event_seq TO {app}",
];

fn render(sql: &str, s: &SchemaName, app: &str) -> String {
    sql.replace("{s}", s.as_str()).replace("{app}", app)
}

fn options_as(role: &str) -> PgConnectOptions {
    let options: PgConnectOptions = common::database_url().parse().expect("DATABASE_URL parses");
    options.username(role).application_name(&format!("least-privilege-{role}"))
}

async fn exec(pool: &sqlx::PgPool, sql: String) {
    sqlx::query(AssertSqlSafe(sql.clone())).execute(pool).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
}

async fn is_superuser(pool: &sqlx::PgPool) -> bool {
    sqlx::query_scalar("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
        .fetch_one(pool)
        .await
        .expect("read rolsuper")
}

/// Roles made for one test, dropped at the end (also on failure, best effort).
struct Roles {
    admin: PgFence,
    database: String,
    owner: String,
    owner_created: bool,
    app: String,
    schema: SchemaName,
}

impl Roles {
    /// Creates the application role and, when the connecting user is a superuser, a plain owner
    /// role for the schema (a non-superuser connecting user owns the schema itself).
    async fn create() -> Self {
        let admin = common::pg_unmigrated().await;
        let pool = admin.pool();
        let database: String = sqlx::query_scalar("SELECT current_database()").fetch_one(pool).await.expect("db");
        let suffix = format!("{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
        let app = format!("bf_app_{suffix}");
        exec(pool, format!("CREATE ROLE {app} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT")).await;
        let (owner, owner_created) = if is_superuser(pool).await {
            let owner = format!("bf_owner_{suffix}");
            exec(pool, format!("CREATE ROLE {owner} LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE")).await;
            exec(pool, format!("GRANT CREATE ON DATABASE \"{database}\" TO {owner}")).await;
            (owner, true)
        } else {
            (sqlx::query_scalar("SELECT current_user::text").fetch_one(pool).await.expect("user"), false)
        };
        let schema = admin.get_schema().clone();
        Self { admin, database, owner, owner_created, app, schema }
    }

    async fn connect(&self, role: &str) -> PgFence {
        PgFence::connect_with(options_as(role))
            .await
            .unwrap_or_else(|e| panic!("connect as {role}: {e}"))
            .schema(self.schema.clone())
    }

    async fn drop(self) {
        let pool = self.admin.pool();
        let s = self.schema.as_str();
        let _ = sqlx::query(AssertSqlSafe(format!("DROP SCHEMA IF EXISTS {s} CASCADE"))).execute(pool).await;
        if self.owner_created {
            let _ = sqlx::query(AssertSqlSafe(format!(
                "REVOKE CREATE ON DATABASE \"{}\" FROM {}",
                self.database, self.owner
            )))
            .execute(pool)
            .await;
            let _ = sqlx::query(AssertSqlSafe(format!("DROP ROLE IF EXISTS {}", self.owner))).execute(pool).await;
        }
        let _ = sqlx::query(AssertSqlSafe(format!("DROP ROLE IF EXISTS {}", self.app))).execute(pool).await;
    }
}

fn sqlstate(e: &FenceError) -> Option<String> {
    match e {
        FenceError::Database(sqlx::Error::Database(db))
        | FenceError::Migration { source: sqlx::Error::Database(db), .. } => db.code().map(|c| c.into_owned()),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fence_runs_under_a_least_privilege_role() {
    let roles = Roles::create().await;
    let result = std::panic::AssertUnwindSafe(scenario(&roles));
    let outcome = futures::FutureExt::catch_unwind(result).await;
    roles.drop().await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

async fn scenario(roles: &Roles) {
    // The owner (not a superuser) runs the migrations and grants the application role its rights.
    let owner = roles.connect(&roles.owner).await;
    assert!(!is_superuser(owner.pool()).await, "the schema owner must not be a superuser");
    owner.migrate().await.expect("the owner runs the migrations");
    owner.migrate().await.expect("migrations are idempotent for the owner");
    for grant in APP_GRANTS {
        exec(owner.pool(), render(grant, &roles.schema, &roles.app)).await;
    }

    let app = roles.connect(&roles.app).await;
    assert!(!is_superuser(app.pool()).await);
    let owns: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM pg_class WHERE relowner = r.oid) + (SELECT count(*) FROM pg_namespace WHERE nspowner = r.oid) \
         FROM pg_roles r WHERE r.rolname = current_user",
    )
    .fetch_one(app.pool())
    .await
    .expect("ownership");
    assert_eq!(owns, 0, "the application role owns nothing");

    // Every store operation.
    let store: Arc<dyn FenceStore> = Arc::new(app.clone());
    let q = QueueName::new("least-privilege").expect("queue");
    let lease = LeaseDuration::from_secs(5).expect("lease");
    let me = Owner::unique("app");
    let k = |s: &str| JobKey::new(s).expect("key");
    assert!(store.enqueue(&q, &k("t1"), b"one").await.expect("enqueue"));
    assert_eq!(
        store
            .enqueue_many(&q, &[(k("t2"), b"two".to_vec()), (k("t3"), b"three".to_vec())])
            .await
            .expect("enqueue_many"),
        2
    );
    let claimed = store.claim_next(&q, &me, lease, 2).await.expect("claim_next");
    assert_eq!(claimed.len(), 2);
    let hb =
        store.heartbeat(&claimed.iter().map(|c| c.lease.clone()).collect::<Vec<_>>(), lease).await.expect("heartbeat");
    assert_eq!(hb.renewed.len(), 2);
    store.checkpoint(&claimed[0].lease, b"half").await.expect("checkpoint");
    store.complete(&claimed[0].lease, b"done").await.expect("complete");
    store.release(&claimed[1].lease).await.expect("release");
    let outcomes = store.claim_batch(&q, &[k("b1"), k("b2"), k("t1")], &me, lease).await.expect("claim_batch");
    assert!(matches!(outcomes[2], Claim::Done { .. }));
    let leases: Vec<_> = outcomes.iter().filter_map(|c| c.lease().cloned()).collect();
    let batch: Vec<_> = leases.iter().map(|l| (l.clone(), b"r".to_vec())).collect();
    assert!(store.complete_batch(&batch).await.expect("complete_batch").iter().all(Result::is_ok));
    let Claim::Claimed(failing) = store.claim(&q, &k("f1"), &me, lease).await.expect("claim") else { panic!("claim") };
    store.fail(&failing, "boom", false, &RetryPolicy::default()).await.expect("fail");
    assert_eq!(store.job(&q, &k("f1")).await.expect("job").expect("row").state, JobState::Dead);
    store.db_now().await.expect("db_now");
    let ledger = PgLedger::new(&app, "receiver");
    assert!(ledger.accept("t1", 2).await.expect("ledger").is_accepted());
    assert!(!ledger.accept("t1", 1).await.expect("ledger").is_accepted());
    assert_eq!(ledger.newest("t1").await.expect("ledger"), Some(2));
    let mut tx = app.pool().begin().await.expect("begin");
    let Claim::Claimed(in_tx) = store.claim(&q, &k("tx1"), &me, lease).await.expect("claim") else { panic!("claim") };
    app.outbox_in(&mut tx, &in_tx, "billing", b"effect").await.expect("outbox_in");
    app.complete_in(&mut tx, &in_tx, b"in tx").await.expect("complete_in");
    tx.commit().await.expect("commit");
    // The outbox relay's statements.
    let mut tx = app.pool().begin().await.expect("begin");
    let rows = app.outbox_claim_in(&mut tx, 10).await.expect("outbox_claim_in");
    assert_eq!(rows.len(), 1);
    let ids: Vec<i64> = rows.iter().map(|r| r.id).collect();
    assert_eq!(app.outbox_mark_sent_in(&mut tx, &ids).await.expect("outbox_mark_sent_in"), 1);
    tx.commit().await.expect("commit");
    assert_eq!(app.outbox_unsent().await.expect("outbox_unsent"), 0);
    // Retention (migration 5) under this role: a finished job of its own queue pruned at age
    // zero raises the queue's floor, and the key sent again starts above it; ledger pruning.
    let pq = QueueName::new("least-privilege-prune").expect("queue");
    let Claim::Claimed(p1) = store.claim(&pq, &k("p1"), &me, lease).await.expect("claim") else { panic!("claim") };
    store.complete(&p1, b"done").await.expect("complete");
    PgLedger::new(&app, "prune-receiver").accept("p1", 1).await.expect("ledger");
    let retention = Retention::new()
        .queue(pq.clone(), QueueRetention { completed: Some(Duration::ZERO), dead: Some(Duration::ZERO) })
        .ledger("prune-receiver", Duration::ZERO);
    let report = store.prune(&retention).await.expect("prune");
    assert_eq!((report.completed, report.ledger), (1, 1), "{report:?}");
    let Claim::Claimed(again) = store.claim(&pq, &k("p1"), &me, lease).await.expect("claim") else { panic!("claim") };
    assert_eq!(again.epoch, 2, "the key sent again starts above the pruned epoch");

    // A consumer end to end: these 50, and t2 (released) and t3 (never claimed) from above.
    let jobs: Vec<(JobKey, Vec<u8>)> = (0..50).map(|i| (k(&format!("c{i}")), format!("p{i}").into_bytes())).collect();
    store.enqueue_many(&q, &jobs).await.expect("enqueue");
    let config = ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(3).expect("lease")))
        .concurrency(4)
        .grace(Duration::from_secs(2));
    let consumer = Consumer::new(
        TableQueue::new(Arc::clone(&store), q.clone()).idle_wait(Duration::from_millis(20)),
        Arc::clone(&store),
        config,
    );
    let metrics = consumer.metrics();
    let stop = CancellationToken::new();
    let seen = Arc::new(Mutex::new(0usize));
    let run = tokio::spawn({
        let stop = stop.clone();
        let seen = Arc::clone(&seen);
        async move {
            consumer
                .run(
                    move |ctx: JobContext| {
                        let seen = Arc::clone(&seen);
                        async move {
                            *seen.lock().expect("lock") += 1;
                            // Long enough for a heartbeat (every second) to renew under this role.
                            if ctx.key().as_str() == "c0" {
                                tokio::time::sleep(Duration::from_millis(1500)).await;
                            }
                            Ok(ctx.payload().to_vec())
                        }
                    },
                    stop,
                )
                .await
        }
    });
    brokerfence_testkit::wait::wait_for_completions(&metrics, 52, Duration::from_secs(20)).await;
    stop.cancel();
    run.await.expect("join").expect("consumer ran without errors");
    let m = metrics.snapshot();
    assert_eq!((m.completions, m.fenced_rejections, m.lease_losses), (52, 0, 0), "{m}");
    assert!(m.renewals >= 1, "a heartbeat renewed under the app role: {m}");
    for (key, payload) in &jobs {
        let row = store.job(&q, key).await.expect("job").expect("row");
        assert_eq!((row.state, row.result.as_deref()), (JobState::Completed, Some(payload.as_slice())));
    }

    // What the role cannot do: DDL, deletes, other schemas, migrations.
    let s = roles.schema.as_str();
    for sql in [
        // DELETE on jobs and ledger is granted for retention; the outbox and the floors keep theirs.
        format!("DELETE FROM {s}.outbox"),
        format!("DELETE FROM {s}.epoch_floors"),
        format!("TRUNCATE {s}.jobs"),
        format!("DROP TABLE {s}.jobs"),
        format!("ALTER TABLE {s}.jobs DROP COLUMN epoch"),
        format!("CREATE TABLE {s}.evil (x int)"),
        format!("ALTER TABLE {s}.jobs DISABLE TRIGGER jobs_epoch_never_decreases"),
        format!("UPDATE {s}._migrations SET version = 0"),
        "CREATE SCHEMA evil".to_owned(),
    ] {
        let err = sqlx::query(AssertSqlSafe(sql.clone())).execute(app.pool()).await.expect_err(&sql);
        let code = err.as_database_error().and_then(|d| d.code()).map(|c| c.into_owned());
        assert!(
            matches!(code.as_deref(), Some("42501") | Some("42P01")),
            "{sql}: expected permission denied, got {err}"
        );
    }
    // The epoch-never-decreases trigger still guards the table against this role.
    let err = sqlx::query(AssertSqlSafe(format!("UPDATE {s}.jobs SET epoch = 0 WHERE key = 't1'")))
        .execute(app.pool())
        .await
        .expect_err("lowering an epoch");
    assert!(err.to_string().contains("epoch"), "{err}");
    // Migrations belong to the owner: the application role gets a typed permission error.
    let err = app.migrate().await.expect_err("the app role cannot run migrations");
    assert_eq!(sqlstate(&err).as_deref(), Some("42501"), "{err}");
}
