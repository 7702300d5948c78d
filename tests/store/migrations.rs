//! Issue #30 (see main.rs for the items of this module): item 2, migrations that never hold a
//! claim, heartbeat or commit for longer than the migration lock timeout, and item 7, a row whose
//! key `JobKey::new` refuses does not poison the claim batch it comes back in.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use brokerfence::{DbTime, FenceStore, JobState, Lease, Owner, PgFence, QueueName};
use brokerfence_testkit::store as common;
use sqlx::AssertSqlSafe;

use common::lease;

async fn exec(pool: &sqlx::PgPool, sql: String) {
    sqlx::query(AssertSqlSafe(sql.clone())).execute(pool).await.unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// What one heartbeating worker saw while the schema was upgraded under it.
#[derive(Debug, Default)]
struct Beats {
    rounds: usize,
    longest: Duration,
    /// Each lease lost, each renewal that failed or did not answer within the heartbeat interval
    /// (a supervisor stops waiting then and counts the lease unconfirmed), and each lease whose
    /// renewals came further apart than the lease itself.
    losses: Vec<String>,
}

/// The lease of the upgrade test: the shortest the fence allows (3 s, renewed every second).
const LEASE_SECS: u64 = 3;
/// A supervisor renews every lease/3 and stops waiting for a renewal after one interval.
const INTERVAL: Duration = Duration::from_secs(1);

/// One worker of a release from before the upgrade: renews its leases every interval until `stop`.
async fn heartbeat_worker(fence: PgFence, mut leases: Vec<Lease>, stop: Arc<AtomicBool>) -> Beats {
    let mut beats = Beats::default();
    let mut renewed_at = vec![Instant::now(); leases.len()];
    while !stop.load(Ordering::SeqCst) {
        let started = Instant::now();
        let answer = tokio::time::timeout(INTERVAL, fence.heartbeat(&leases, lease(LEASE_SECS))).await;
        let took = started.elapsed();
        beats.rounds += 1;
        beats.longest = beats.longest.max(took);
        match answer {
            Ok(Ok(hb)) => {
                for l in &hb.lost {
                    beats.losses.push(format!("{} lost after {took:?}", l.key));
                }
                for l in hb.renewed {
                    if let Some(i) = leases.iter().position(|x| x.key == l.key) {
                        let gap = renewed_at[i].elapsed();
                        if gap > Duration::from_secs(LEASE_SECS) {
                            beats.losses.push(format!("{} renewed {gap:?} after the one before", l.key));
                        }
                        renewed_at[i] = Instant::now();
                        leases[i] = l;
                    }
                }
            }
            Ok(Err(e)) => beats.losses.push(format!("renewal failed after {took:?}: {e}")),
            Err(_) => beats.losses.push(format!("renewal did not answer within {INTERVAL:?}")),
        }
        tokio::time::sleep(INTERVAL.saturating_sub(took)).await;
    }
    beats
}

/// A claimer of a release from before the upgrade: claims the pending rows of queue `old` one by
/// one, in plain SQL (the statements of this build need the upgraded schema), until `stop`.
/// Answers the longest claim and the claims made.
async fn old_claimer(pool: sqlx::PgPool, sc: String, stop: Arc<AtomicBool>) -> Result<(Duration, usize), String> {
    let (mut longest, mut n) = (Duration::ZERO, 0usize);
    let claim = format!(
        "UPDATE {sc}.jobs SET state = 'running', epoch = epoch + 1, owner = 'old-claimer', \
         lease_until = clock_timestamp() + interval '30 seconds', attempts = attempts + 1 \
         WHERE queue = 'old' AND key = $1 AND state = 'pending'"
    );
    // The pending rows are every 50th that is not a 100th (see the fill).
    let mut g = 50i64;
    while !stop.load(Ordering::SeqCst) {
        let started = Instant::now();
        let key = format!("job-{g:07}");
        sqlx::query(AssertSqlSafe(claim.clone()))
            .bind(key.clone())
            .execute(&pool)
            .await
            .map_err(|e| format!("claim of {key} failed after {:?}: {e}", started.elapsed()))?;
        longest = longest.max(started.elapsed());
        n += 1;
        g += 100;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok((longest, n))
}

/// Item 2, "Migrations 5 and 8 are not online": a schema at migration 4 holding 1,000,000 rows
/// (finished mostly, 1 % dead, 1 % pending, 200 running under four workers' leases) is migrated
/// to the latest version while the workers renew their 3 s leases every second and an older
/// release claims pending rows: no lease is lost, no renewal takes longer than the heartbeat
/// interval, the upgraded schema is whole (every index valid, every CHECK validated, `finished`
/// set on every finished row). Prints the longest heartbeat and claim waits (the README's figure).
///
/// Fails without the online steps (indexes built CONCURRENTLY, the `finished` backfill in
/// batches, the CHECK validated apart): migration 5 built its indexes under a SHARE lock and
/// migration 8 rewrote every finished row, validated and built two indexes under ACCESS
/// EXCLUSIVE, so renewals waited for seconds (their lock timeout, 1 s, then failed).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hardening_item2_upgrade_from_4_with_a_million_rows_loses_no_lease() {
    const ROWS: i64 = 1_000_000;
    const WORKERS: usize = 4;
    const LEASES_PER_WORKER: usize = 50;
    let fence = common::pg_unmigrated().await;
    fence.migrate_to(4).await.expect("migrate to version 4");
    let sc = fence.get_schema().as_str().to_owned();
    let pool = fence.pool().clone();

    let filled = Instant::now();
    // The fill takes seconds (more on a loaded machine): past the pool's statement timeout.
    let mut fill = pool.begin().await.expect("begin");
    sqlx::query("SET LOCAL statement_timeout = '120s'").execute(&mut *fill).await.expect("statement timeout");
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {sc}.jobs (queue, key, state, epoch, owner, attempts, payload, result, run_at, created_at, \
             updated_at) \
             SELECT 'old', 'job-' || lpad(g::text, 7, '0'), \
               CASE WHEN g % 100 = 0 THEN 'dead' WHEN g % 50 = 0 THEN 'pending' ELSE 'completed' END, \
               CASE WHEN g % 100 <> 0 AND g % 50 = 0 THEN 0 ELSE 1 END, \
               CASE WHEN g % 100 <> 0 AND g % 50 = 0 THEN NULL ELSE 'gone' END, \
               CASE WHEN g % 100 <> 0 AND g % 50 = 0 THEN 0 ELSE 1 END, '\\x7061796c6f6164'::bytea, \
               CASE WHEN g % 50 <> 0 THEN '\\x6f6b'::bytea END, \
               clock_timestamp() - interval '2 days', clock_timestamp() - interval '2 days', \
               clock_timestamp() - interval '1 day' \
             FROM generate_series(1, {ROWS}) g"
    )))
    .execute(&mut *fill)
    .await
    .expect("fill the table");
    fill.commit().await.expect("commit the fill");
    let mut workers = Vec::new();
    let stop = Arc::new(AtomicBool::new(false));
    let live = QueueName::new("live").expect("queue");
    for w in 0..WORKERS {
        let owner = Owner::new(format!("worker-{w}")).expect("owner");
        exec(
            &pool,
            format!(
                "INSERT INTO {sc}.jobs (queue, key, state, epoch, owner, lease_until, attempts) \
                 SELECT 'live', 'w{w}-' || g, 'running', 1, '{owner}', clock_timestamp() + interval '{LEASE_SECS} seconds', 1 \
                 FROM generate_series(1, {LEASES_PER_WORKER}) g"
            ),
        )
        .await;
        let leases: Vec<Lease> = (1..=LEASES_PER_WORKER)
            .map(|g| Lease {
                queue: live.clone(),
                key: common::key(&format!("w{w}-{g}")),
                epoch: 1,
                owner: owner.clone(),
                lease_until: DbTime(0),
                ttl: Duration::ZERO,
                attempts: 1,
            })
            .collect();
        let worker = common::pg_on(fence.get_schema().clone()).await;
        workers.push(tokio::spawn(heartbeat_worker(worker, leases, stop.clone())));
    }
    println!("filled {ROWS} rows in {:?}", filled.elapsed());
    let claimer = tokio::spawn(old_claimer(pool.clone(), sc.clone(), stop.clone()));
    // Two rounds of renewals before the upgrade starts.
    tokio::time::sleep(2 * INTERVAL).await;

    let migrator = common::pg_on(fence.get_schema().clone()).await;
    let started = Instant::now();
    let migrated = migrator.migrate().await;
    let took = started.elapsed();
    // Two more rounds on the upgraded schema.
    tokio::time::sleep(2 * INTERVAL).await;
    stop.store(true, Ordering::SeqCst);
    let mut beats = Vec::new();
    for w in workers {
        beats.push(w.await.expect("worker task"));
    }
    let claims = claimer.await.expect("claimer task");
    migrated.expect("migrate from version 4");
    migrator.check_schema().await.expect("the upgraded schema is what this build needs");

    let longest = beats.iter().map(|b| b.longest).max().unwrap_or_default();
    let rounds: usize = beats.iter().map(|b| b.rounds).sum();
    let losses: Vec<&String> = beats.iter().flat_map(|b| &b.losses).collect();
    println!(
        "MIGRATION rows={ROWS} took={took:?} heartbeat_rounds={rounds} longest_heartbeat={longest:?} \
         old_claims={claims:?} lease_losses={}",
        losses.len()
    );
    assert!(losses.is_empty(), "leases lost while migrating ({took:?}): {losses:?}");
    assert!(longest < INTERVAL, "a renewal waited {longest:?}");
    let (longest_claim, n) = claims.expect("the older release's claims all went through");
    assert!(n > 0 && longest_claim < INTERVAL, "{n} claims, the longest waited {longest_claim:?}");

    // The upgraded schema is whole: no index left invalid, every CHECK validated, every finished
    // row marked, and the pruner's index the one migration 8 defines.
    let invalid: Vec<String> = sqlx::query_scalar(
        "SELECT c.relname::text FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid \
         JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = $1 AND NOT (i.indisvalid AND i.indisready)",
    )
    .bind(&sc)
    .fetch_all(&pool)
    .await
    .expect("indexes");
    assert!(invalid.is_empty(), "{invalid:?}");
    let not_valid: Vec<String> = sqlx::query_scalar(
        "SELECT conname::text FROM pg_constraint WHERE conrelid = to_regclass($1) AND NOT convalidated",
    )
    .bind(format!("{sc}.jobs"))
    .fetch_all(&pool)
    .await
    .expect("constraints");
    assert!(not_valid.is_empty(), "{not_valid:?}");
    let unmarked: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {sc}.jobs WHERE finished IS DISTINCT FROM \
         (CASE WHEN state IN ('completed', 'dead') THEN state END)"
    )))
    .fetch_one(&pool)
    .await
    .expect("count");
    assert_eq!(unmarked, 0);
    let finished_index: String =
        sqlx::query_scalar("SELECT indexdef FROM pg_indexes WHERE schemaname = $1 AND indexname = 'jobs_finished'")
            .bind(&sc)
            .fetch_one(&pool)
            .await
            .expect("jobs_finished");
    assert!(finished_index.contains("(queue, finished, updated_at)"), "{finished_index}");
    common::drop_schema(&fence).await;
}

/// The rows of the PostgreSQL `jobs` table of queue `q`, by key: (key, state, last_error).
async fn pg_rows(fence: &PgFence, q: &QueueName) -> Vec<(String, String, Option<String>)> {
    sqlx::query_as(AssertSqlSafe(format!(
        "SELECT key, state, last_error FROM {}.jobs WHERE queue = $1 ORDER BY key",
        fence.get_schema().as_str()
    )))
    .bind(q.as_str().to_owned())
    .fetch_all(fence.pool())
    .await
    .expect("rows")
}

/// Item 7, "One bad row poisons every claim batch" (PostgreSQL): rows whose keys `JobKey::new`
/// refuses (empty; 1,025 bytes) sit among good pending rows of a schema from before the key CHECK
/// (or a CHECK written before the key rules tightened). A table-queue claim hands the good rows
/// out, and makes each bad row dead with its reason in `last_error` (nothing lost silently); the
/// next claim is not poisoned either.
///
/// Fails without the fix in the claim's decoding: the whole claim was an error ("invalid key: must
/// not be empty") after the statement had committed, so the good rows waited out their lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item7_pg_bad_key_row_does_not_poison_the_claim_batch() {
    let fence = common::pg().await;
    let sc = fence.get_schema().as_str().to_owned();
    let q = QueueName::new(common::unique("bad-keys")).expect("queue");
    // A schema from before the key CHECK (migration 11).
    exec(fence.pool(), format!("ALTER TABLE {sc}.jobs DROP CONSTRAINT IF EXISTS jobs_key_is_valid")).await;
    for k in ["good-1", "good-2", "good-3"] {
        assert!(fence.enqueue(&q, &common::key(k), b"p").await.expect("enqueue"));
    }
    let long = "x".repeat(1025);
    for bad in ["", long.as_str()] {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {sc}.jobs (queue, key, state, payload, run_at) \
             VALUES ($1, $2, 'pending', 'p', clock_timestamp() - interval '1 minute')"
        )))
        .bind(q.as_str().to_owned())
        .bind(bad)
        .execute(fence.pool())
        .await
        .expect("insert a bad key by SQL");
    }
    let me = Owner::unique("item7");
    let got = fence.claim_next(&q, &me, lease(30), 10).await.expect("the claim hands out the good rows");
    let mut keys: Vec<&str> = got.iter().map(|c| c.lease.key.as_str()).collect();
    keys.sort();
    assert_eq!(keys, ["good-1", "good-2", "good-3"]);
    let rows = pg_rows(&fence, &q).await;
    for (key, state, last_error) in &rows {
        if key.starts_with("good-") {
            assert_eq!(state, "running", "{rows:?}");
        } else {
            assert_eq!(state, "dead", "{rows:?}");
            let why = last_error.as_deref().unwrap_or_default();
            assert!(why.contains("not a valid job key"), "{why}");
        }
    }
    assert!(fence.claim_next(&q, &me, lease(30), 10).await.expect("the next claim").is_empty());
    // The operator sees both dead rows, their keys escaped and marked (the listing failed on the
    // first key `JobKey` refused, "stored job key: …").
    let admin = brokerfence::admin::Admin::new(&fence).expect("admin");
    let dead = admin.dead(Some(&q), 10).await.expect("dead list with bad keys");
    let mut shown: Vec<String> = dead.iter().map(|d| d.key.as_str().chars().take(18).collect()).collect();
    shown.sort();
    assert_eq!(shown, ["<invalid key \"\">", "<invalid key \"xxxx"], "{dead:?}");
    // A requeue of every dead job leaves them dead: the claim would kill them again, and with
    // migration 11 the key CHECK refuses them outside the dead state (before, the requeue failed
    // on the first one: "stored job key: …", or the CHECK's violation).
    let report = admin
        .requeue_dead(&q, brokerfence::admin::Requeue::AllDead)
        .await
        .expect("requeue all dead beside bad-key rows");
    assert!(report.requeued.is_empty(), "{report:?}");
    assert_eq!(admin.dead(Some(&q), 10).await.expect("dead list").len(), 2);
    // The holders of the good rows commit as usual.
    for c in &got {
        fence.complete(&c.lease, b"done").await.expect("complete a good row");
    }
    common::drop_schema(&fence).await;
}

/// Item 7 (PostgreSQL schema): migration 11 adds a CHECK matching `JobKey`'s rules, online (NOT
/// VALID, then VALIDATE apart). A schema that already holds bad keys is upgraded: the open bad
/// rows are made dead with the reason in `last_error` (the CHECK spares finished rows, so
/// nothing is deleted), the CHECK is validated, and from then on an insert of a bad key by SQL
/// fails naming the constraint.
///
/// Fails without the migration: the schema had no such CHECK, the insert succeeded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item7_pg_schema_checks_the_key_rules() {
    let fence = common::pg().await;
    let sc = fence.get_schema().as_str().to_owned();
    let q = QueueName::new(common::unique("key-check")).expect("queue");
    let insert = format!(
        "INSERT INTO {sc}.jobs (queue, key, state, finished, payload) \
         VALUES ($1, $2, $3, CASE WHEN $3 IN ('completed', 'dead') THEN $3 END, 'p')"
    );
    let try_insert = |key: String, state: &'static str| {
        let (insert, q, pool) = (insert.clone(), q.clone(), fence.pool().clone());
        async move {
            sqlx::query(AssertSqlSafe(insert)).bind(q.as_str().to_owned()).bind(key).bind(state).execute(&pool).await
        }
    };
    let refused = try_insert(String::new(), "pending").await;
    assert!(
        refused.as_ref().is_err_and(|e| e.to_string().contains("jobs_key_is_valid")),
        "an empty key was not refused: {refused:?}"
    );
    let refused = try_insert("y".repeat(1025), "pending").await;
    assert!(refused.is_err(), "a key of 1,025 bytes was not refused");
    try_insert("y".repeat(1024), "pending").await.expect("a key of 1,024 bytes is valid");

    // Back to a schema from before the CHECK, holding bad keys; then the upgrade.
    exec(fence.pool(), format!("ALTER TABLE {sc}.jobs DROP CONSTRAINT jobs_key_is_valid")).await;
    exec(fence.pool(), format!("DELETE FROM {sc}._migrations WHERE version = 11")).await;
    try_insert(String::new(), "pending").await.expect("insert before the CHECK");
    try_insert("z".repeat(2000), "failed").await.expect("insert before the CHECK");
    try_insert("k".repeat(1100), "completed").await.expect("insert before the CHECK");
    let upgraded = common::pg_on(fence.get_schema().clone()).await;
    upgraded.migrate().await.expect("migration 11 on a schema with bad keys");
    let validated: bool = sqlx::query_scalar(
        "SELECT convalidated FROM pg_constraint WHERE conrelid = to_regclass($1) AND conname = 'jobs_key_is_valid'",
    )
    .bind(format!("{sc}.jobs"))
    .fetch_one(fence.pool())
    .await
    .expect("the key CHECK exists");
    assert!(validated);
    let rows = pg_rows(&fence, &q).await;
    let states: Vec<(usize, &str, bool)> = rows
        .iter()
        .map(|(k, s, e)| (k.len(), s.as_str(), e.as_deref().is_some_and(|e| e.contains("not a valid job key"))))
        .collect();
    assert_eq!(states, [(0, "dead", true), (1100, "completed", false), (1024, "pending", false), (2000, "dead", true)]);
    common::drop_schema(&fence).await;
}

/// Item 7 (SQLite, whose claim is its own statement and transaction): bad keys (empty, not UTF-8,
/// with a NUL byte, 1,025 bytes) among good rows: the claim hands the good rows out, the bad ones
/// are dead with the reason in `last_error`, all in the claim's transaction.
///
/// Fails without the fix: the claim was an error (a row's key could not even be decoded as text).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item7_sqlite_bad_key_row_does_not_poison_the_claim_batch() {
    let fence = common::sqlite().await;
    let t = format!("{}_jobs", fence.get_schema().as_str());
    let q = QueueName::new("bad-keys").expect("queue");
    for k in ["good-1", "good-2"] {
        assert!(fence.enqueue(&q, &common::key(k), b"p").await.expect("enqueue"));
    }
    // Keys as bytes cast to text: '' , invalid UTF-8, an embedded NUL, 1,025 bytes.
    for bad in [&b""[..], &b"\xff\xfe"[..], &b"nul\0byte"[..], &[b'x'; 1025][..]] {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {t} (queue, key, state, payload, run_at, created_at, updated_at) \
             VALUES (?1, CAST(?2 AS TEXT), 'pending', x'70', 0, 0, 0)"
        )))
        .bind(q.as_str().to_owned())
        .bind(bad.to_vec())
        .execute(fence.pool())
        .await
        .expect("insert a bad key by SQL");
    }
    let me = Owner::unique("item7");
    let got = fence.claim_next(&q, &me, lease(30), 10).await.expect("the claim hands out the good rows");
    let mut keys: Vec<&str> = got.iter().map(|c| c.lease.key.as_str()).collect();
    keys.sort();
    assert_eq!(keys, ["good-1", "good-2"]);
    let rows: Vec<(Vec<u8>, String, Option<String>)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT CAST(key AS BLOB), state, last_error FROM {t} WHERE queue = ?1 ORDER BY key"
    )))
    .bind(q.as_str().to_owned())
    .fetch_all(fence.pool())
    .await
    .expect("rows");
    assert_eq!(rows.len(), 6, "{rows:?}");
    for (key, state, last_error) in &rows {
        if key.starts_with(b"good-") {
            assert_eq!(state, "running", "{rows:?}");
        } else {
            assert_eq!(state, "dead", "{rows:?}");
            assert!(last_error.as_deref().is_some_and(|e| e.contains("not a valid job key")), "{rows:?}");
        }
    }
    for c in &got {
        fence.complete(&c.lease, b"done").await.expect("complete a good row");
        let job = common::job(&fence, &q, c.lease.key.as_str()).await.expect("job");
        assert_eq!(job.state, JobState::Completed);
    }
    assert!(fence.claim_next(&q, &me, lease(30), 10).await.expect("the next claim").is_empty());
}

/// Guards a review finding of the trace columns (migration 5 on SQLite): `claim_next` read them
/// as text, so one value written around the fence that is not UTF-8 (or a BLOB) failed every
/// claim of the queue, with or without feature `otel`. Now they are read as bounded bytes and
/// such a value is ignored: the job is claimed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otel_sqlite_trace_columns_that_are_not_text_never_fail_a_claim() {
    let fence = common::sqlite().await;
    let t = format!("{}_jobs", fence.get_schema().as_str());
    let q = QueueName::new("bad-trace").expect("queue");
    for k in ["blob", "latin1", "long"] {
        assert!(fence.enqueue(&q, &common::key(k), b"p").await.expect("enqueue"));
    }
    for (k, value) in [("blob", vec![0xff, 0x00, 0x01]), ("latin1", b"00-\xe9".to_vec()), ("long", vec![b'-'; 100_000])]
    {
        // The first as a BLOB, the second as invalid UTF-8 cast to TEXT, the third as a huge text.
        let cast = if k == "blob" { "?1" } else { "CAST(?1 AS TEXT)" };
        sqlx::query(AssertSqlSafe(format!("UPDATE {t} SET traceparent = {cast}, tracestate = {cast} WHERE key = ?2")))
            .bind(value)
            .bind(k)
            .execute(fence.pool())
            .await
            .expect("write a bad trace context by SQL");
    }
    let got = fence.claim_next(&q, &Owner::unique("trace"), lease(30), 10).await.expect("the claim answers");
    let mut keys: Vec<&str> = got.iter().map(|c| c.lease.key.as_str()).collect();
    keys.sort();
    assert_eq!(keys, ["blob", "latin1", "long"]);
}

/// Migration 12 (the producer's trace context, feature `otel`) on a schema of migration 11 that
/// holds a job: online — the table keeps its file (no rewrite), the columns are nullable text
/// without a default — and the job is still there and claimable, with no context. SQLite's
/// migration 5 is the same `ADD COLUMN` (run by every SQLite test's `migrate`).
#[cfg(feature = "otel")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn otel_migration_12_adds_the_trace_columns_online() {
    let fence = common::pg().await;
    let sc = fence.get_schema().as_str().to_owned();
    let q = QueueName::new(common::unique("otel-migration")).expect("queue");
    exec(fence.pool(), format!("ALTER TABLE {sc}.jobs DROP COLUMN traceparent, DROP COLUMN tracestate")).await;
    exec(fence.pool(), format!("DELETE FROM {sc}._migrations WHERE version = 12")).await;
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {sc}.jobs (queue, key, state, payload) VALUES ($1, 'old', 'pending', 'p')"
    )))
    .bind(q.as_str().to_owned())
    .execute(fence.pool())
    .await
    .expect("a job from before");
    let file = |pool: sqlx::PgPool, sc: String| async move {
        let n: i64 = sqlx::query_scalar("SELECT pg_relation_filenode(to_regclass($1))::bigint")
            .bind(format!("{sc}.jobs"))
            .fetch_one(&pool)
            .await
            .expect("filenode");
        n
    };
    let before = file(fence.pool().clone(), sc.clone()).await;
    let upgraded = common::pg_on(fence.get_schema().clone()).await;
    upgraded.migrate().await.expect("migration 12");
    assert_eq!(file(fence.pool().clone(), sc.clone()).await, before, "the table was rewritten");
    let columns: Vec<(String, String, String, Option<String>)> = sqlx::query_as(
        "SELECT column_name::text, data_type::text, is_nullable::text, column_default::text \
         FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'jobs' \
         AND column_name IN ('traceparent', 'tracestate') ORDER BY column_name",
    )
    .bind(&sc)
    .fetch_all(fence.pool())
    .await
    .expect("columns");
    let expected = |name: &str| (name.to_owned(), "text".to_owned(), "YES".to_owned(), None);
    assert_eq!(columns, [expected("traceparent"), expected("tracestate")]);
    let jobs = upgraded.claim_next(&q, &Owner::new("w").expect("owner"), lease(30), 10).await.expect("claim_next");
    assert_eq!(jobs.len(), 1, "the job from before the migration is claimable");
    assert_eq!(jobs[0].trace, None);
    common::drop_schema(&fence).await;
}
