//! The admin statements on PostgreSQL. Every statement is constant text plus the validated
//! schema name; every value is a bound parameter.

use std::time::Duration;

use sqlx::AssertSqlSafe;
use sqlx::postgres::Postgres;

use super::{
    AdminError, DeadRow, JobInfo, JobInfoRow, Requeue, RequeueReport, RunningRow, Status, absorb_requeued, assemble,
    dead_job, job_info, key_chunks, keyed_outcome, ms,
};
use crate::key::{JobKey, QueueName};
use crate::postgres::PgFence;

/// Milliseconds since the Unix epoch of a timestamptz (or of an interval) expression.
fn epoch_ms(e: &str) -> String {
    format!("floor(extract(epoch from {e}) * 1000)::bigint")
}

/// The queue filter of a statement whose `$1` is the queue or NULL (every queue).
fn queue_filter(queue: Option<&QueueName>) -> &'static str {
    if queue.is_some() { "t.queue = $1" } else { "$1::text IS NULL" }
}

/// What a requeued row becomes (see [`super::Admin::requeue_dead`]).
const REQUEUE_SET: &str = "state = 'pending', finished = NULL, epoch = t.epoch + 1, owner = NULL, \
     lease_until = NULL, attempts = 0, failures = 0, run_at = clock_timestamp(), updated_at = clock_timestamp()";

/// A transaction with the admin call's limits: `statement_timeout` = the call's limit,
/// `lock_timeout` half of it, at most 3 s. `report` also gives the planner back its usual choices for this
/// transaction (the fence's pool keeps it to index lookups, which suits key lookups, not counts).
pub(super) async fn begin(
    pg: &PgFence,
    timeout: Duration,
    report: bool,
) -> Result<sqlx::Transaction<'static, Postgres>, AdminError> {
    let mut tx = pg.begin().await?;
    let statement = ms(timeout).max(1).to_string();
    // Below the statement limit, so that a call stuck on a lock says so.
    let lock = ms((timeout / 2).min(Duration::from_secs(3))).max(1).to_string();
    sqlx::query("SELECT set_config('statement_timeout', $1, true), set_config('lock_timeout', $2, true)")
        .persistent(false)
        .bind(statement)
        .bind(lock)
        .execute(&mut *tx)
        .await?;
    if report {
        sqlx::query(
            "SELECT set_config('enable_seqscan', 'on', true), set_config('enable_hashjoin', 'on', true), \
             set_config('enable_mergejoin', 'on', true), set_config('plan_cache_mode', 'auto', true)",
        )
        .persistent(false)
        .execute(&mut *tx)
        .await?;
    }
    Ok(tx)
}

fn running_select(s: &str, filter: &str, extra: &str, order: &str) -> String {
    format!(
        "SELECT r.q, r.k, r.epoch, r.owner, r.attempts, r.lu, r.lease_left, r.ra FROM ( \
           SELECT t.queue COLLATE \"C\" AS q, t.key COLLATE \"C\" AS k, t.epoch, t.owner, t.attempts, \
             {lu} AS lu, {left} AS lease_left, {ra} AS ra, \
             row_number() OVER (PARTITION BY t.queue ORDER BY {order}, t.key) AS rn \
           FROM {s}.jobs t WHERE {filter} AND t.state = 'running' AND t.lease_until IS NOT NULL {extra}) r \
         WHERE r.rn <= $2 ORDER BY r.q, r.rn",
        lu = epoch_ms("t.lease_until"),
        left = epoch_ms("(t.lease_until - clock_timestamp())"),
        ra = epoch_ms("t.run_at"),
    )
}

pub(super) async fn status(
    pg: &PgFence,
    timeout: Duration,
    queue: Option<&QueueName>,
    within: Duration,
    limit: u32,
) -> Result<Status, AdminError> {
    let s = pg.get_schema().as_str();
    let f = queue_filter(queue);
    let q = queue.map(|q| q.as_str().to_owned());
    let mut tx = begin(pg, timeout, true).await?;
    let now: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT {}", epoch_ms("clock_timestamp()"))))
        .persistent(false)
        .fetch_one(&mut *tx)
        .await?;
    let counts: Vec<(String, String, i64, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT t.queue COLLATE \"C\", t.state, count(*)::bigint, \
           (count(*) FILTER (WHERE t.state = 'running' AND t.lease_until < clock_timestamp()))::bigint \
         FROM {s}.jobs t WHERE {f} GROUP BY t.queue, t.state ORDER BY 1, 2"
    )))
    .persistent(false)
    .bind(q.clone())
    .fetch_all(&mut *tx)
    .await?;
    let oldest: Vec<RunningRow> = sqlx::query_as(AssertSqlSafe(running_select(s, f, "", "t.run_at")))
        .persistent(false)
        .bind(q.clone())
        .bind(1i64)
        .fetch_all(&mut *tx)
        .await?;
    let expiring: Vec<RunningRow> = sqlx::query_as(AssertSqlSafe(running_select(
        s,
        f,
        "AND t.lease_until < clock_timestamp() + $3::bigint * interval '1 millisecond'",
        "t.lease_until",
    )))
    .persistent(false)
    .bind(q)
    .bind(i64::from(limit))
    .bind(ms(within))
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    assemble(now, counts, oldest, expiring)
}

pub(super) async fn queues(pg: &PgFence, timeout: Duration) -> Result<Vec<String>, AdminError> {
    let s = pg.get_schema().as_str();
    let mut tx = begin(pg, timeout, false).await?;
    // A loose index scan: the next queue name above the last one, by the primary key.
    let names: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "WITH RECURSIVE q(name) AS ( \
           (SELECT t.queue FROM {s}.jobs t ORDER BY t.queue LIMIT 1) \
           UNION ALL \
           SELECT (SELECT t.queue FROM {s}.jobs t WHERE t.queue > q.name ORDER BY t.queue LIMIT 1) \
           FROM q WHERE q.name IS NOT NULL) \
         SELECT q.name COLLATE \"C\" FROM q WHERE q.name IS NOT NULL"
    )))
    .persistent(false)
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(names)
}

pub(super) async fn job(
    pg: &PgFence,
    timeout: Duration,
    queue: &QueueName,
    key: &JobKey,
) -> Result<Option<JobInfo>, AdminError> {
    let s = pg.get_schema().as_str();
    let mut tx = begin(pg, timeout, false).await?;
    let row: Option<JobInfoRow> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT t.state, t.epoch, t.owner, t.attempts, t.failures, {lu}, {left}, {ra}, t.last_error, {ca}, {ua}, \
           octet_length(t.payload)::bigint, octet_length(t.progress)::bigint, octet_length(t.result)::bigint, {now} \
         FROM {s}.jobs t WHERE t.queue = $1 AND t.key = $2",
        lu = epoch_ms("t.lease_until"),
        left = epoch_ms("(t.lease_until - clock_timestamp())"),
        ra = epoch_ms("t.run_at"),
        ca = epoch_ms("t.created_at"),
        ua = epoch_ms("t.updated_at"),
        now = epoch_ms("clock_timestamp()"),
    )))
    .persistent(false)
    .bind(queue.as_str().to_owned())
    .bind(key.as_str().to_owned())
    .fetch_optional(&mut *tx)
    .await?;
    tx.commit().await?;
    row.map(|row| job_info(queue, key, row)).transpose()
}

pub(super) async fn dead(
    pg: &PgFence,
    timeout: Duration,
    queue: Option<&QueueName>,
    limit: u32,
) -> Result<Vec<super::DeadJob>, AdminError> {
    let s = pg.get_schema().as_str();
    let f = queue_filter(queue);
    let mut tx = begin(pg, timeout, true).await?;
    // `finished IS NOT NULL` lets the planner use the `jobs_finished` index (queue, finished, updated_at).
    let rows: Vec<DeadRow> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT t.queue COLLATE \"C\", t.key COLLATE \"C\", t.epoch, t.owner, t.attempts, t.failures, t.last_error, \
           {ua}, {age} \
         FROM {s}.jobs t WHERE {f} AND t.finished IS NOT NULL AND t.finished = 'dead' \
         ORDER BY t.updated_at DESC, t.queue, t.key LIMIT $2",
        ua = epoch_ms("t.updated_at"),
        age = epoch_ms("(clock_timestamp() - t.updated_at)"),
    )))
    .persistent(false)
    .bind(queue.map(|q| q.as_str().to_owned()))
    .bind(i64::from(limit))
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    rows.into_iter().map(dead_job).collect()
}

/// The condition that leaves out rows claimed from a broker (no payload: only the table queue's
/// enqueue stores one), unless they are to be requeued too.
fn broker_filter(brokers: bool) -> &'static str {
    // Keys `JobKey` refuses (rows a claim made dead, issue #30 item 7) are never requeued: the
    // key CHECK (migration 11) refuses them outside the dead state, and the claim would kill them
    // again. They stay dead, listed with their key marked.
    if brokers {
        "AND t.key <> '' AND octet_length(t.key) <= 1024"
    } else {
        "AND t.key <> '' AND octet_length(t.key) <= 1024 AND t.payload IS NOT NULL"
    }
}

/// Dead jobs of `which` claimed from a broker: some of their keys (in key order) and how many.
pub(super) async fn broker_jobs(
    pg: &PgFence,
    timeout: Duration,
    queue: &QueueName,
    which: &Requeue,
) -> Result<(Vec<String>, i64), AdminError> {
    let s = pg.get_schema().as_str();
    let keys: Option<Vec<String>> = match which {
        Requeue::Keys(keys) => Some(keys.iter().map(|k| k.as_str().to_owned()).collect()),
        Requeue::AllDead => None,
    };
    // `finished = 'dead'` lets the planner use the `jobs_finished` index for a whole queue.
    let mut tx = begin(pg, timeout, false).await?;
    let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT t.key COLLATE \"C\", count(*) OVER ()::bigint FROM {s}.jobs t \
         WHERE t.queue = $1 AND t.finished IS NOT NULL AND t.finished = 'dead' AND t.state = 'dead' \
           AND t.payload IS NULL AND t.key <> '' AND octet_length(t.key) <= 1024 \
           AND ($2::text[] IS NULL OR t.key = ANY ($2::text[])) \
         ORDER BY t.key LIMIT $3"
    )))
    .persistent(false)
    .bind(queue.as_str().to_owned())
    .bind(keys)
    .bind(i64::try_from(super::BROKER_KEYS_SHOWN).unwrap_or(10))
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    let count = rows.first().map(|r| r.1).unwrap_or(0);
    Ok((rows.into_iter().map(|r| r.0).collect(), count))
}

pub(super) async fn requeue(
    pg: &PgFence,
    timeout: Duration,
    queue: &QueueName,
    which: &Requeue,
    batch: u32,
    brokers: bool,
) -> Result<RequeueReport, AdminError> {
    let s = pg.get_schema().as_str();
    // Checked before (`broker_jobs`); this keeps a row that died meanwhile out as well.
    let only = broker_filter(brokers);
    let mut report = RequeueReport::default();
    match which {
        Requeue::Keys(keys) => {
            // Rows are locked in key order (the lateral lookup, as the fence's batch statements
            // do), so two requeues of overlapping keys cannot deadlock.
            let statement = format!(
                "WITH u AS (SELECT k FROM unnest($2::text[]) AS u(k)), \
                 locked AS (SELECT l.key FROM (SELECT k FROM u ORDER BY k) o CROSS JOIN LATERAL \
                   (SELECT t.key FROM {s}.jobs t WHERE t.queue = $1 AND t.key = o.k AND t.state = 'dead' {only} \
                    OFFSET 0 FOR UPDATE) l), \
                 upd AS (UPDATE {s}.jobs t SET {REQUEUE_SET} FROM locked \
                   WHERE t.queue = $1 AND t.key = locked.key AND t.state = 'dead' {only} RETURNING t.key, t.epoch) \
                 SELECT u.k COLLATE \"C\", upd.epoch, j.state FROM u \
                 LEFT JOIN upd ON upd.key = u.k \
                 LEFT JOIN LATERAL (SELECT j.state FROM {s}.jobs j WHERE j.queue = $1 AND j.key = u.k OFFSET 0) j ON true"
            );
            for chunk in key_chunks(keys, batch) {
                let mut tx = begin(pg, timeout, false).await?;
                let rows: Vec<(String, Option<i64>, Option<String>)> = sqlx::query_as(AssertSqlSafe(statement.clone()))
                    .persistent(false)
                    .bind(queue.as_str().to_owned())
                    .bind(chunk)
                    .fetch_all(&mut *tx)
                    .await?;
                tx.commit().await?;
                if rows.iter().any(|r| r.1.is_some()) {
                    // Pending again and due now: idle consumers claim it at once (issue #33).
                    pg.wake_here(queue, Duration::ZERO);
                }
                keyed_outcome(&mut report, rows)?;
            }
        }
        Requeue::AllDead => {
            let mut tx = begin(pg, timeout, false).await?;
            let cutoff: String =
                sqlx::query_scalar("SELECT clock_timestamp()::text").persistent(false).fetch_one(&mut *tx).await?;
            tx.commit().await?;
            // The oldest dead rows by the `jobs_finished` index, rows another transaction holds
            // (a pruner's batch) skipped, changed by their row address.
            let statement = format!(
                "WITH victims AS (SELECT t.ctid AS id FROM {s}.jobs t WHERE t.queue = $1 \
                   AND t.finished IS NOT NULL AND t.finished = 'dead' AND t.updated_at <= $2::timestamptz {only} \
                   ORDER BY t.updated_at LIMIT $3 FOR UPDATE SKIP LOCKED) \
                 UPDATE {s}.jobs t SET {REQUEUE_SET} WHERE t.ctid = ANY (ARRAY(SELECT v.id FROM victims v)) \
                   AND t.state = 'dead' {only} RETURNING t.key COLLATE \"C\", t.epoch"
            );
            loop {
                let mut tx = begin(pg, timeout, false).await?;
                let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(statement.clone()))
                    .persistent(false)
                    .bind(queue.as_str().to_owned())
                    .bind(cutoff.clone())
                    .bind(i64::from(batch))
                    .fetch_all(&mut *tx)
                    .await?;
                tx.commit().await?;
                if !rows.is_empty() {
                    pg.wake_here(queue, Duration::ZERO);
                }
                if !absorb_requeued(&mut report, rows, batch)? {
                    break;
                }
            }
        }
    }
    Ok(report)
}
