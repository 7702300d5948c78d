//! The operator CLI (`brokerfence`, feature `cli`): every command run as a process against real
//! PostgreSQL (a schema of its own) and a real SQLite file, its `--json` output parsed and
//! checked against jobs made through the store API (claim, complete, fail, fail to dead). Every
//! test name contains `ergonomics` (`cargo test --workspace --all-features ergonomics`).
#![cfg(feature = "cli")]

use brokerfence_testkit::store as common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use brokerfence::{
    Claim, FenceStore, JobState, Lease, Owner, PgFence, QueueName, RetryPolicy, SchemaName, SqliteFence,
};
use common::{key, lease};
use serde_json::Value;

static BIN: std::sync::LazyLock<std::path::PathBuf> =
    std::sync::LazyLock::new(|| brokerfence_testkit::programs::bin("brokerfence"));

/// A database the CLI is pointed at, and the store the test prepares it with.
struct Target {
    url: String,
    schema: SchemaName,
    store: Arc<dyn FenceStore>,
    /// The SQLite file, if SQLite.
    file: Option<PathBuf>,
}

async fn pg_target(migrated: bool) -> Target {
    let store = if migrated { common::pg().await } else { common::pg_unmigrated().await };
    Target { url: common::database_url(), schema: store.get_schema().clone(), store: Arc::new(store), file: None }
}

async fn sqlite_target(migrated: bool) -> Target {
    let path = common::sqlite_path();
    let schema = common::unique_schema();
    let url = format!("sqlite:{}", path.display());
    let store: Arc<dyn FenceStore> = if migrated {
        let store = common::sqlite_on(&path).await.schema(schema.clone());
        store.migrate().await.expect("migrate SQLite");
        Arc::new(store)
    } else {
        // Nothing opened: the file does not exist yet.
        Arc::new(SqliteFence::open("sqlite::memory:").await.expect("placeholder store"))
    };
    Target { url, schema, store, file: Some(path) }
}

/// What one run of the binary did.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {:?}; stderr: {}", self.stdout, self.stderr))
    }

    fn ok(self) -> Self {
        assert_eq!(self.code, 0, "exit code; stdout: {}; stderr: {}", self.stdout, self.stderr);
        self
    }
}

/// Runs the binary with `args` only (no DATABASE_URL in its environment).
async fn run_raw(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = tokio::process::Command::new(&*BIN);
    cmd.args(args).env_remove("DATABASE_URL").kill_on_drop(true);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .expect("the CLI ended within 60 s")
        .expect("run the CLI");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

impl Target {
    /// Runs the binary on this target: `--database-url URL --schema S ARGS`.
    async fn run(&self, args: &[&str]) -> Run {
        let mut all = vec!["--database-url", self.url.as_str(), "--schema", self.schema.as_str()];
        all.extend_from_slice(args);
        run_raw(&all, &[]).await
    }
}

fn queue(name: &str) -> QueueName {
    QueueName::new(common::unique(name)).expect("queue name")
}

/// Jobs in every state, made through the store API, and the leases the test needs later.
struct Seeded {
    q: QueueName,
    /// The lease under which d1 was failed to dead (epoch 1).
    dead_lease: Lease,
}

const OWNER: &str = "worker-a";

async fn seed(store: &dyn FenceStore) -> Seeded {
    let q = queue("orders");
    let me = Owner::new(OWNER).expect("owner");
    let pause = || tokio::time::sleep(Duration::from_millis(20));
    assert!(store.enqueue(&q, &key("p1"), b"hello").await.expect("enqueue"));
    let claim = |k: &'static str, secs: u64| {
        let (q, me) = (q.clone(), me.clone());
        async move {
            match store.claim(&q, &key(k), &me, lease(secs)).await.expect("claim") {
                Claim::Claimed(l) => l,
                other => panic!("claim of {k}: {other:?}"),
            }
        }
    };
    claim("r1", 60).await;
    pause().await;
    claim("e1", 3).await;
    let c1 = claim("c1", 30).await;
    store.complete(&c1, b"done!!").await.expect("complete");
    let f1 = claim("f1", 30).await;
    store.fail(&f1, "try again", true, &RetryPolicy::default()).await.expect("fail, retry");
    // The dead jobs are table-queue jobs (enqueued with a payload): `dead requeue` refuses jobs
    // claimed from a broker (issue #30 item 9).
    for k in ["d1", "d2"] {
        assert!(store.enqueue(&q, &key(k), b"work").await.expect("enqueue"));
    }
    let d1 = claim("d1", 30).await;
    store.fail(&d1, "boom: disk full", false, &RetryPolicy::default()).await.expect("fail, dead");
    pause().await;
    let d2 = claim("d2", 30).await;
    store.fail(&d2, "bad payload", false, &RetryPolicy::default()).await.expect("fail, dead");
    Seeded { q, dead_lease: d1 }
}

fn counts(status: &Value, q: &QueueName) -> Value {
    queue_entry(status, q)["counts"].clone()
}

fn queue_entry(status: &Value, q: &QueueName) -> Value {
    status["queues"]
        .as_array()
        .expect("queues")
        .iter()
        .find(|e| e["queue"] == q.as_str())
        .unwrap_or_else(|| panic!("queue {q} in {status}"))
        .clone()
}

// ------------------------------------------------------------------------------------------------
// migrate
// ------------------------------------------------------------------------------------------------

async fn migrate_case(t: Target) {
    // Before: every other command says to migrate, and a SQLite file is not created by it.
    let before = t.run(&["status"]).await;
    assert_eq!(before.code, 1, "status before migrate: {}", before.stderr);
    if let Some(file) = &t.file {
        assert!(before.stderr.contains("no SQLite database"), "{}", before.stderr);
        assert!(!file.exists(), "status created {}", file.display());
    } else {
        assert!(before.stderr.contains("brokerfence migrate"), "{}", before.stderr);
    }
    let done = t.run(&["--json", "migrate"]).await.ok().json();
    assert_eq!(done["migrated"], true);
    assert_eq!(done["schema"], t.schema.as_str());
    // The schema is there for the store's own check, and a second run is a no-op.
    let check = match &t.file {
        Some(file) => common::sqlite_on(file).await.schema(t.schema.clone()).check_schema().await,
        None => common::pg_on(t.schema.clone()).await.check_schema().await,
    };
    check.expect("schema up to date after `brokerfence migrate`");
    let again = t.run(&["migrate"]).await.ok();
    assert!(again.stdout.contains("up to date"), "{}", again.stdout);
    let empty = t.run(&["--json", "status"]).await.ok().json();
    assert_eq!(empty["queues"], Value::Array(vec![]));
}

#[tokio::test]
async fn ergonomics_cli_migrate_pg() {
    migrate_case(pg_target(false).await).await;
}

#[tokio::test]
async fn ergonomics_cli_migrate_sqlite() {
    migrate_case(sqlite_target(false).await).await;
}

/// DATABASE_URL is read when --database-url is not given.
#[tokio::test]
async fn ergonomics_cli_reads_database_url_from_the_environment_pg() {
    let t = pg_target(true).await;
    let s = seed(t.store.as_ref()).await;
    let run = run_raw(&["--schema", t.schema.as_str(), "--json", "status"], &[("DATABASE_URL", &t.url)]).await.ok();
    assert_eq!(counts(&run.json(), &s.q)["total"], 7);
}

// ------------------------------------------------------------------------------------------------
// status
// ------------------------------------------------------------------------------------------------

async fn status_case(t: Target) {
    let s = seed(t.store.as_ref()).await;
    let other = queue("other");
    t.store.enqueue(&other, &key("o1"), b"x").await.expect("enqueue other");

    let status = t.run(&["--json", "status"]).await.ok().json();
    let c = counts(&status, &s.q);
    assert_eq!(
        (&c["pending"], &c["running"], &c["failed"], &c["dead"], &c["completed"], &c["total"]),
        (&1.into(), &2.into(), &1.into(), &2.into(), &1.into(), &7.into()),
        "{c}"
    );
    assert_eq!(counts(&status, &other)["pending"], 1);
    let q = queue_entry(&status, &s.q);
    assert_eq!(q["expired_leases"], 0);
    // r1 was claimed first: due the longest.
    assert_eq!(q["oldest_running"]["key"], "r1");
    assert_eq!(q["oldest_running"]["owner"], OWNER);
    // Only e1 (3 s lease) ends within the default 10 s.
    let expiring = q["expiring"].as_array().expect("expiring");
    assert_eq!(expiring.len(), 1, "{expiring:?}");
    assert_eq!(expiring[0]["key"], "e1");
    let left = expiring[0]["lease_left_ms"].as_i64().expect("lease left");
    assert!((0..=3_000).contains(&left), "lease left {left} ms");
    assert_eq!(expiring[0]["expired"], false);

    // A wider window lists both, soonest end first; --queue keeps to one queue.
    let wide = t.run(&["--json", "status", "--queue", s.q.as_str(), "--expiring-within", "2m"]).await.ok().json();
    assert_eq!(wide["queues"].as_array().expect("queues").len(), 1);
    let keys: Vec<&str> =
        wide["queues"][0]["expiring"].as_array().expect("expiring").iter().filter_map(|e| e["key"].as_str()).collect();
    assert_eq!(keys, ["e1", "r1"]);

    // Once e1's lease has ended (database clock), it counts as expired.
    tokio::time::sleep(Duration::from_millis(3_300)).await;
    let later = t.run(&["--json", "status", "--queue", s.q.as_str()]).await.ok().json();
    let q = queue_entry(&later, &s.q);
    assert_eq!(q["expired_leases"], 1, "{q}");
    assert_eq!(q["expiring"][0]["key"], "e1");
    assert_eq!(q["expiring"][0]["expired"], true);
    assert!(q["expiring"][0]["lease_left_ms"].as_i64().expect("lease left") < 0);

    let text = t.run(&["status"]).await.ok().stdout;
    for needle in ["QUEUE", "PENDING", "EXPIRED LEASES", s.q.as_str(), other.as_str(), "oldest running r1", "ended"] {
        assert!(text.contains(needle), "{needle:?} missing in:\n{text}");
    }
}

#[tokio::test]
async fn ergonomics_cli_status_pg() {
    status_case(pg_target(true).await).await;
}

#[tokio::test]
async fn ergonomics_cli_status_sqlite() {
    status_case(sqlite_target(true).await).await;
}

// ------------------------------------------------------------------------------------------------
// job
// ------------------------------------------------------------------------------------------------

async fn job_case(t: Target) {
    let s = seed(t.store.as_ref()).await;
    let q = s.q.as_str();
    let dead = t.run(&["--json", "job", q, "d1"]).await.ok().json();
    assert_eq!(dead["found"], true);
    assert_eq!(dead["state"], "dead");
    assert_eq!((&dead["epoch"], &dead["attempts"], &dead["failures"]), (&1.into(), &1.into(), &1.into()));
    assert_eq!(dead["last_error"], "boom: disk full");
    assert_eq!(dead["lease_left_ms"], Value::Null);

    let running = t.run(&["--json", "job", q, "r1"]).await.ok().json();
    assert_eq!(running["state"], "running");
    assert_eq!(running["owner"], OWNER);
    let left = running["lease_left_ms"].as_i64().expect("lease left");
    assert!((30_000..=60_000).contains(&left), "lease left {left} ms of 60 s");

    let pending = t.run(&["--json", "job", q, "p1"]).await.ok().json();
    assert_eq!(
        (&pending["state"], &pending["payload_bytes"], &pending["epoch"]),
        (&"pending".into(), &5.into(), &0.into())
    );
    let completed = t.run(&["--json", "job", q, "c1"]).await.ok().json();
    assert_eq!((&completed["state"], &completed["result_bytes"]), (&"completed".into(), &6.into()));
    let failed = t.run(&["--json", "job", q, "f1"]).await.ok().json();
    assert_eq!((&failed["state"], &failed["last_error"]), (&"failed".into(), &"try again".into()));

    let missing = t.run(&["--json", "job", q, "nope"]).await;
    assert_eq!(missing.code, 3, "{}", missing.stderr);
    assert_eq!(missing.json()["found"], false);

    let text = t.run(&["job", q, "d1"]).await.ok().stdout;
    for needle in ["state       dead", "epoch       1", "last error  boom: disk full", "failures    1"] {
        assert!(text.contains(needle), "{needle:?} missing in:\n{text}");
    }
    let text = t.run(&["job", q, "r1"]).await.ok().stdout;
    assert!(text.contains(" left)"), "{text}");
}

#[tokio::test]
async fn ergonomics_cli_job_pg() {
    job_case(pg_target(true).await).await;
}

#[tokio::test]
async fn ergonomics_cli_job_sqlite() {
    job_case(sqlite_target(true).await).await;
}

// ------------------------------------------------------------------------------------------------
// dead list
// ------------------------------------------------------------------------------------------------

async fn dead_list_case(t: Target) {
    let s = seed(t.store.as_ref()).await;
    let list = t.run(&["--json", "dead", "list"]).await.ok().json();
    let dead = list["dead"].as_array().expect("dead");
    let keys: Vec<&str> = dead.iter().filter_map(|d| d["key"].as_str()).collect();
    assert_eq!(keys, ["d2", "d1"], "the most recent first");
    assert_eq!(dead[1]["last_error"], "boom: disk full");
    assert_eq!(dead[1]["queue"], s.q.as_str());
    assert_eq!(dead[1]["failures"], 1);

    let one = t.run(&["--json", "dead", "list", "--queue", s.q.as_str(), "--limit", "1"]).await.ok().json();
    assert_eq!(one["dead"].as_array().map(Vec::len), Some(1));
    assert_eq!(one["dead"][0]["key"], "d2");
    let none = t.run(&["--json", "dead", "list", "--queue", "no-such-queue"]).await.ok().json();
    assert_eq!(none["dead"], Value::Array(vec![]));

    let text = t.run(&["dead", "list"]).await.ok().stdout;
    for needle in ["LAST ERROR", "boom: disk full", "bad payload", " ago"] {
        assert!(text.contains(needle), "{needle:?} missing in:\n{text}");
    }
}

#[tokio::test]
async fn ergonomics_cli_dead_list_pg() {
    dead_list_case(pg_target(true).await).await;
}

#[tokio::test]
async fn ergonomics_cli_dead_list_sqlite() {
    dead_list_case(sqlite_target(true).await).await;
}

// ------------------------------------------------------------------------------------------------
// dead requeue
// ------------------------------------------------------------------------------------------------

async fn requeue_case(t: Target) {
    let store = t.store.as_ref();
    let s = seed(store).await;
    let old = s.dead_lease.clone();
    let out = t.run(&["--json", "dead", "requeue", s.q.as_str(), "d1"]).await.ok().json();
    assert_eq!(out["requeued"], serde_json::json!([{"key": "d1", "epoch": 2}]), "{out}");
    assert_eq!(out["skipped"], Value::Array(vec![]));

    // A fresh attempt's row: pending at a new epoch nobody holds, counts reset, last error kept.
    let job = store.job(&s.q, &key("d1")).await.expect("read").expect("row");
    assert_eq!(job.state, JobState::Pending);
    assert_eq!((job.epoch, job.attempts, job.failures, job.owner.as_deref()), (2, 0, 0, None));
    assert_eq!(job.last_error.as_deref(), Some("boom: disk full"));

    // The old holder (epoch 1) stays fenced: commit, heartbeat, checkpoint and fail are refused.
    let err = store.complete(&old, b"late").await.expect_err("old lease's commit after requeue");
    assert!(matches!(err, brokerfence::FenceError::Fenced { current_epoch: 2, .. }), "{err}");
    let beat = store.heartbeat(std::slice::from_ref(&old), lease(30)).await.expect("heartbeat");
    assert!(beat.renewed.is_empty() && beat.lost == [old.clone()], "{beat:?}");
    assert!(store.checkpoint(&old, b"p").await.expect_err("checkpoint").is_fenced());
    assert!(store.fail(&old, "late", true, &RetryPolicy::default()).await.expect_err("fail").is_fenced());

    // The next claim runs it at epoch 3; the old lease is still refused, the new one commits.
    let b = Owner::new("worker-b").expect("owner");
    let new = match store.claim(&s.q, &key("d1"), &b, lease(30)).await.expect("claim") {
        Claim::Claimed(l) => l,
        other => panic!("requeued job not claimable: {other:?}"),
    };
    assert_eq!((new.epoch, new.attempts), (3, 1));
    assert!(store.complete(&old, b"late").await.expect_err("old lease after reclaim").is_fenced());
    store.complete(&new, b"ok").await.expect("new holder commits");

    // Keys that are not dead (or do not exist) are left alone: exit code 3, each named.
    let run = t.run(&["--json", "dead", "requeue", s.q.as_str(), "d1", "r1", "nope", "d2"]).await;
    assert_eq!(run.code, 3, "{}", run.stderr);
    let out = run.json();
    assert_eq!(out["requeued"], serde_json::json!([{"key": "d2", "epoch": 2}]), "{out}");
    assert_eq!(
        out["skipped"],
        serde_json::json!([
            {"key": "d1", "state": "completed"},
            {"key": "r1", "state": "running"},
            {"key": "nope", "state": null},
        ])
    );
    assert_eq!(store.job(&s.q, &key("r1")).await.expect("read").expect("row").epoch, 1, "r1 untouched");

    let text = t.run(&["dead", "requeue", s.q.as_str(), "d2"]).await;
    assert_eq!(text.code, 3);
    assert!(text.stdout.contains("d2 skipped: pending, not dead"), "{}", text.stdout);
}

#[tokio::test]
async fn ergonomics_cli_dead_requeue_fences_the_old_holder_pg() {
    requeue_case(pg_target(true).await).await;
}

#[tokio::test]
async fn ergonomics_cli_dead_requeue_fences_the_old_holder_sqlite() {
    requeue_case(sqlite_target(true).await).await;
}

async fn requeue_all_case(t: Target) {
    let store = t.store.as_ref();
    let (q, other) = (queue("bulk"), queue("keep"));
    let me = Owner::new(OWNER).expect("owner");
    let mut buried = Vec::new();
    for (queue, k) in (0..5).map(|i| (&q, format!("k{i}"))).chain([(&other, "o1".to_owned())]) {
        // Table-queue jobs: `dead requeue` refuses jobs claimed from a broker (issue #30 item 9).
        assert!(store.enqueue(queue, &key(&k), b"work").await.expect("enqueue"));
        let Claim::Claimed(l) = store.claim(queue, &key(&k), &me, lease(30)).await.expect("claim") else {
            panic!("claim {k}")
        };
        store.fail(&l, "poison", false, &RetryPolicy::default()).await.expect("fail to dead");
        buried.push(l);
    }
    let out = t.run(&["--json", "dead", "requeue", q.as_str(), "--all", "--batch", "2"]).await.ok().json();
    let mut keys: Vec<&str> =
        out["requeued"].as_array().expect("requeued").iter().filter_map(|r| r["key"].as_str()).collect();
    keys.sort_unstable();
    assert_eq!(keys, ["k0", "k1", "k2", "k3", "k4"]);
    assert!(out["requeued"].as_array().expect("requeued").iter().all(|r| r["epoch"] == 2), "{out}");
    assert_eq!(out["batches"], 3, "5 rows in batches of 2");

    let status = t.run(&["--json", "status"]).await.ok().json();
    assert_eq!((&counts(&status, &q)["dead"], &counts(&status, &q)["pending"]), (&0.into(), &5.into()));
    assert_eq!(counts(&status, &other)["dead"], 1, "another queue's dead letter is left alone");
    for l in buried.iter().filter(|l| l.queue == q) {
        assert!(store.complete(l, b"late").await.expect_err("old lease").is_fenced());
    }
    let text = t.run(&["dead", "requeue", q.as_str(), "--all"]).await.ok().stdout;
    assert!(text.contains("requeued 0 dead job(s)"), "{text}");
}

#[tokio::test]
async fn ergonomics_cli_dead_requeue_all_in_batches_pg() {
    requeue_all_case(pg_target(true).await).await;
}

#[tokio::test]
async fn ergonomics_cli_dead_requeue_all_in_batches_sqlite() {
    requeue_all_case(sqlite_target(true).await).await;
}

/// Every call is bounded: a requeue that meets a row (PostgreSQL) or the write lock (SQLite)
/// held by another transaction gives up after `--timeout`, exits 1 and changes nothing.
#[tokio::test]
async fn ergonomics_cli_requeue_gives_up_on_a_held_lock_pg() {
    let t = pg_target(true).await;
    let s = seed(t.store.as_ref()).await;
    let pg = common::pg_on(t.schema.clone()).await;
    let mut tx = pg.pool().begin().await.expect("begin");
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "SELECT 1 FROM {}.jobs WHERE queue = $1 AND key = 'd1' FOR UPDATE",
        t.schema.as_str()
    )))
    .bind(s.q.as_str().to_owned())
    .execute(&mut *tx)
    .await
    .expect("lock d1");
    let started = std::time::Instant::now();
    let run = t.run(&["--timeout", "1s", "dead", "requeue", s.q.as_str(), "d1"]).await;
    assert_eq!(run.code, 1, "stdout {} stderr {}", run.stdout, run.stderr);
    assert!(run.stderr.contains("lock_timeout"), "{}", run.stderr);
    assert!(started.elapsed() < Duration::from_secs(10), "gave up after {:?}", started.elapsed());
    tx.rollback().await.expect("rollback");
    assert_eq!(t.store.job(&s.q, &key("d1")).await.expect("read").expect("row").state, JobState::Dead);
    t.run(&["dead", "requeue", s.q.as_str(), "d1"]).await.ok();
}

#[tokio::test]
async fn ergonomics_cli_requeue_gives_up_on_a_held_lock_sqlite() {
    let t = sqlite_target(true).await;
    let s = seed(t.store.as_ref()).await;
    let file = t.file.clone().expect("SQLite file");
    let lite = common::sqlite_on(&file).await;
    let tx = lite.pool().begin_with("BEGIN IMMEDIATE").await.expect("hold the write lock");
    let started = std::time::Instant::now();
    let run = t.run(&["--timeout", "1s", "dead", "requeue", s.q.as_str(), "d1"]).await;
    assert_eq!(run.code, 1, "stdout {} stderr {}", run.stdout, run.stderr);
    assert!(run.stderr.contains("did not finish within 1s"), "{}", run.stderr);
    assert!(
        started.elapsed() < Duration::from_secs(9),
        "gave up after {:?} (the busy timeout is 10 s)",
        started.elapsed()
    );
    tx.rollback().await.expect("rollback");
    assert_eq!(t.store.job(&s.q, &key("d1")).await.expect("read").expect("row").state, JobState::Dead);
    t.run(&["dead", "requeue", s.q.as_str(), "d1"]).await.ok();
}

// ------------------------------------------------------------------------------------------------
// prune
// ------------------------------------------------------------------------------------------------

async fn prune_case(t: Target) {
    let s = seed(t.store.as_ref()).await;
    let q = s.q.as_str();
    // The default ages (15 days completed, 30 days dead) delete nothing this young.
    let none = t.run(&["--json", "prune", "--queue", q]).await.ok().json();
    assert_eq!((&none["completed"], &none["dead"]), (&0.into(), &0.into()), "{none}");

    let completed = t.run(&["--json", "prune", "--queue", q, "--completed-age", "0s", "--keep-dead"]).await.ok().json();
    assert_eq!((&completed["completed"], &completed["dead"]), (&1.into(), &0.into()), "{completed}");
    assert_eq!(t.run(&["job", q, "c1"]).await.code, 3, "the completed job is gone");

    // Without --queue: every queue that has jobs.
    let dead = t.run(&["--json", "prune", "--dead-age", "0s", "--keep-completed"]).await.ok().json();
    assert_eq!((&dead["completed"], &dead["dead"]), (&0.into(), &2.into()), "{dead}");
    assert_eq!(dead["queues"], serde_json::json!([q]));
    let status = t.run(&["--json", "status"]).await.ok().json();
    let c = counts(&status, &s.q);
    assert_eq!((&c["pending"], &c["running"], &c["failed"], &c["total"]), (&1.into(), &2.into(), &1.into(), &4.into()));

    let text = t.run(&["prune", "--queue", q, "--ledger", "billing=1d"]).await.ok().stdout;
    assert!(text.starts_with("pruned 0 completed, 0 dead, 0 ledger row(s)"), "{text}");
}

#[tokio::test]
async fn ergonomics_cli_prune_pg() {
    prune_case(pg_target(true).await).await;
}

#[tokio::test]
async fn ergonomics_cli_prune_sqlite() {
    prune_case(sqlite_target(true).await).await;
}

// ------------------------------------------------------------------------------------------------
// the command line itself
// ------------------------------------------------------------------------------------------------

#[tokio::test]
async fn ergonomics_cli_bad_command_lines_exit_2() {
    let sqlite = format!("sqlite:{}", common::sqlite_path().display());
    for (args, says) in [
        (vec![], "Usage"),
        (vec!["--database-url", sqlite.as_str(), "dead", "requeue", "q"], "required"),
        (vec!["--database-url", sqlite.as_str(), "dead", "requeue", "q", "k", "--all"], "cannot be used with"),
        (vec!["--database-url", sqlite.as_str(), "--timeout", "soon", "status"], "not an age"),
        (vec!["--database-url", sqlite.as_str(), "--schema", "Bad-Name", "status"], "schema"),
        (vec!["status"], "no database"),
        (vec!["--database-url", "mysql://root@127.0.0.1/jobs", "status"], "not supported"),
    ] {
        let run = run_raw(&args, &[]).await;
        assert_eq!(run.code, 2, "{args:?}: stdout {} stderr {}", run.stdout, run.stderr);
        assert!(run.stderr.contains(says), "{args:?}: {says:?} missing in {}", run.stderr);
    }
    let help = run_raw(&["--help"], &[]).await.ok();
    for needle in ["migrate", "status", "job", "dead", "prune", "--json", "Exit codes"] {
        assert!(help.stdout.contains(needle), "{needle:?} missing in --help:\n{}", help.stdout);
    }
}

/// The admin API the CLI is built on refuses a store that names no concrete backend.
#[tokio::test]
async fn ergonomics_admin_refuses_a_store_without_a_concrete_backend() {
    struct Opaque(PgFence);
    #[async_trait::async_trait]
    impl FenceStore for Opaque {
        async fn migrate(&self) -> brokerfence::Result<()> {
            self.0.migrate().await
        }
        async fn claim_batch(
            &self,
            q: &QueueName,
            k: &[brokerfence::JobKey],
            o: &Owner,
            l: brokerfence::LeaseDuration,
        ) -> brokerfence::Result<Vec<Claim>> {
            self.0.claim_batch(q, k, o, l).await
        }
        async fn enqueue_many(&self, q: &QueueName, j: &[(brokerfence::JobKey, Vec<u8>)]) -> brokerfence::Result<u64> {
            self.0.enqueue_many(q, j).await
        }
        async fn claim_next(
            &self,
            q: &QueueName,
            o: &Owner,
            l: brokerfence::LeaseDuration,
            n: u32,
        ) -> brokerfence::Result<Vec<brokerfence::ClaimedJob>> {
            self.0.claim_next(q, o, l, n).await
        }
        async fn heartbeat(
            &self,
            l: &[Lease],
            d: brokerfence::LeaseDuration,
        ) -> brokerfence::Result<brokerfence::Heartbeat> {
            self.0.heartbeat(l, d).await
        }
        async fn checkpoint(&self, l: &Lease, p: &[u8]) -> brokerfence::Result<()> {
            self.0.checkpoint(l, p).await
        }
        async fn complete(&self, l: &Lease, r: &[u8]) -> brokerfence::Result<()> {
            self.0.complete(l, r).await
        }
        async fn fail(
            &self,
            l: &Lease,
            e: &str,
            r: bool,
            p: &RetryPolicy,
        ) -> brokerfence::Result<brokerfence::FailOutcome> {
            self.0.fail(l, e, r, p).await
        }
        async fn release(&self, l: &Lease) -> brokerfence::Result<()> {
            self.0.release(l).await
        }
        async fn job(
            &self,
            q: &QueueName,
            k: &brokerfence::JobKey,
        ) -> brokerfence::Result<Option<brokerfence::JobRecord>> {
            self.0.job(q, k).await
        }
        async fn db_now(&self) -> brokerfence::Result<brokerfence::DbTime> {
            self.0.db_now().await
        }
        fn wakeups(&self, queue: &brokerfence::QueueName) -> brokerfence::Wakeups {
            self.0.wakeups(queue)
        }
        async fn next_due(&self, queue: &brokerfence::QueueName) -> brokerfence::Result<Option<std::time::Duration>> {
            self.0.next_due(queue).await
        }
        fn backend(&self) -> brokerfence::Backend<'_> {
            brokerfence::Backend::Other("opaque")
        }
    }
    let opaque = Opaque(common::pg().await);
    let err = brokerfence::admin::Admin::new(&opaque).expect_err("no concrete store");
    assert!(matches!(err, brokerfence::admin::AdminError::UnsupportedStore { backend: "opaque" }), "{err}");
    // The concrete store itself works.
    let admin = brokerfence::admin::Admin::new(&opaque.0).expect("PgFence");
    assert!(admin.status(None).await.expect("status").queues.is_empty());
}
