//! The dashboard's statements on PostgreSQL. Each reads through an index (the fence's sessions
//! plan generically with sequential scans off; `plans` shows the plans a test checks) and reads
//! a bounded number of job rows. Constant text plus the validated schema name; values bound.

use std::collections::BTreeMap;
use std::time::Duration;

use sqlx::AssertSqlSafe;

use super::postgres::begin;
use super::{AdminError, DeadRow, EventRow, FlightRow, MINUTES, QueueRead};
use crate::key::QueueName;
use crate::postgres::PgFence;

/// Milliseconds since the Unix epoch of a timestamptz (or an interval) expression.
fn ms(e: &str) -> String {
    format!("floor(extract(epoch from {e}) * 1000)::bigint")
}

/// (state, n, expired) of the first `$2` open jobs of queue `$1` in `run_at` order.
fn open_counts(s: &str) -> String {
    format!(
        "SELECT o.state, count(*)::bigint FROM (SELECT t.state FROM {s}.jobs t \
           WHERE t.queue = $1::text AND t.finished IS NULL ORDER BY t.run_at LIMIT $2::bigint) o GROUP BY o.state"
    )
}

/// Finished jobs of queue `$1` in state `$2` ('completed' or 'dead'), at most `$3`.
fn finished_count(s: &str) -> String {
    format!(
        "SELECT count(*)::bigint FROM (SELECT 1 FROM {s}.jobs t WHERE t.queue = $1::text \
           AND t.finished IS NOT NULL AND t.finished = $2::text LIMIT $3::bigint) f"
    )
}

/// How long the oldest due pending (or failed) job of queue `$1` has waited.
fn oldest_pending(s: &str) -> String {
    format!(
        "SELECT {age} FROM {s}.jobs t WHERE t.queue = $1::text AND t.finished IS NULL \
           AND t.run_at <= clock_timestamp() AND t.state IN ('pending', 'failed') ORDER BY t.run_at LIMIT 1",
        age = ms("(clock_timestamp() - t.run_at)")
    )
}

/// Running rows among the first `$2` open jobs of queue `$1`, soonest lease end first, at most `$3`.
fn running(s: &str) -> String {
    // Later than the job became due by more than the microseconds between two defaults of one
    // insert (`run_at` and `updated_at` are both the clock at an enqueue): a renewal.
    let renewed = ms("o.updated_at");
    format!(
        "SELECT o.queue COLLATE \"C\", o.key COLLATE \"C\", o.epoch, o.owner, o.attempts, {lu}, {left}, {ra}, \
           CASE WHEN o.updated_at > o.run_at + interval '1 millisecond' THEN {renewed} END \
         FROM (SELECT t.queue, t.key, t.state, t.epoch, t.owner, t.attempts, t.lease_until, t.run_at, t.updated_at \
           FROM {s}.jobs t WHERE t.queue = $1::text AND t.finished IS NULL ORDER BY t.run_at LIMIT $2::bigint) o \
         WHERE o.state = 'running' AND o.lease_until IS NOT NULL ORDER BY o.lease_until, o.key LIMIT $3::bigint",
        lu = ms("o.lease_until"),
        left = ms("(o.lease_until - clock_timestamp())"),
        ra = ms("o.run_at"),
    )
}

/// The last `$2` minutes of activity of queue `$1`.
fn minutes(s: &str) -> String {
    format!(
        "SELECT {m}, a.claims, a.commits, a.fenced, a.lost FROM {s}.activity a WHERE a.queue = $1::text \
           AND a.minute >= date_trunc('minute', clock_timestamp()) - ($2::bigint - 1) * interval '1 minute' \
         ORDER BY a.minute",
        m = ms("a.minute")
    )
}

/// The newest `$2` fence events (of queue `$1`, or of all when NULL).
fn events_sql(s: &str) -> String {
    format!(
        "SELECT e.seq, {at}, {age}, e.queue COLLATE \"C\", e.key COLLATE \"C\", e.kind, e.detail, e.epoch, e.owner, \
           e.winner_epoch, e.winner_owner, e.winner_state \
         FROM {s}.fence_events e WHERE ($1::text IS NULL OR e.queue = $1::text) ORDER BY e.seq DESC LIMIT $2::bigint",
        at = ms("e.at"),
        age = ms("(clock_timestamp() - e.at)"),
    )
}

/// The newest `$2` dead jobs of queue `$1`.
fn dead_rows(s: &str) -> String {
    format!(
        "SELECT t.queue COLLATE \"C\", t.key COLLATE \"C\", t.epoch, t.owner, t.attempts, t.failures, \
           left(t.last_error, 4096), {ua}, {age} FROM {s}.jobs t WHERE t.queue = $1::text \
           AND t.finished IS NOT NULL AND t.finished = 'dead' ORDER BY t.updated_at DESC LIMIT $2::bigint",
        ua = ms("t.updated_at"),
        age = ms("(clock_timestamp() - t.updated_at)"),
    )
}

/// The queues that have jobs: one primary-key probe per queue.
fn queues(s: &str) -> String {
    format!(
        "WITH RECURSIVE q(name) AS ( \
           (SELECT t.queue FROM {s}.jobs t ORDER BY t.queue LIMIT 1) \
           UNION ALL \
           SELECT (SELECT t.queue FROM {s}.jobs t WHERE t.queue > q.name ORDER BY t.queue LIMIT 1) \
           FROM q WHERE q.name IS NOT NULL) \
         SELECT q.name COLLATE \"C\" FROM q WHERE q.name IS NOT NULL"
    )
}

pub(super) async fn overview(
    pg: &PgFence,
    timeout: Duration,
    queues: &[QueueName],
    limit: u32,
) -> Result<(i64, Vec<QueueRead>), AdminError> {
    let s = pg.get_schema().as_str();
    let limit = i64::from(limit);
    let mut tx = begin(pg, timeout, false).await?;
    let now: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT {}", ms("clock_timestamp()"))))
        .persistent(false)
        .fetch_one(&mut *tx)
        .await?;
    let (open_sql, finished_sql, oldest_sql, running_sql, minutes_sql) =
        (open_counts(s), finished_count(s), oldest_pending(s), running(s), minutes(s));
    let mut reads = Vec::with_capacity(queues.len());
    for queue in queues {
        let q = queue.as_str().to_owned();
        let open: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(open_sql.clone()))
            .persistent(false)
            .bind(&q)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        let mut finished = [0i64; 2];
        for (slot, state) in finished.iter_mut().zip(["completed", "dead"]) {
            *slot = sqlx::query_scalar(AssertSqlSafe(finished_sql.clone()))
                .persistent(false)
                .bind(&q)
                .bind(state)
                .bind(limit)
                .fetch_one(&mut *tx)
                .await?;
        }
        let oldest_pending_ms: Option<i64> = sqlx::query_scalar(AssertSqlSafe(oldest_sql.clone()))
            .persistent(false)
            .bind(&q)
            .fetch_optional(&mut *tx)
            .await?;
        let running: Vec<FlightRow> = sqlx::query_as(AssertSqlSafe(running_sql.clone()))
            .persistent(false)
            .bind(&q)
            .bind(limit)
            .bind(limit)
            .fetch_all(&mut *tx)
            .await?;
        let minutes: Vec<(i64, i64, i64, i64, i64)> = sqlx::query_as(AssertSqlSafe(minutes_sql.clone()))
            .persistent(false)
            .bind(&q)
            .bind(MINUTES)
            .fetch_all(&mut *tx)
            .await?;
        // One scan of the open jobs, stopped at the limit.
        let open_capped = open.iter().map(|(_, n)| *n).sum::<i64>() >= limit;
        reads.push(QueueRead {
            open,
            open_capped,
            completed: finished[0],
            dead: finished[1],
            oldest_pending_ms,
            running,
            minutes,
        });
    }
    tx.commit().await?;
    Ok((now, reads))
}

pub(super) async fn in_flight(
    pg: &PgFence,
    timeout: Duration,
    queues: &[QueueName],
    scan: u32,
    limit: u32,
) -> Result<Vec<FlightRow>, AdminError> {
    let statement = running(pg.get_schema().as_str());
    let mut tx = begin(pg, timeout, false).await?;
    let mut rows = Vec::new();
    for queue in queues {
        let mut more: Vec<FlightRow> = sqlx::query_as(AssertSqlSafe(statement.clone()))
            .persistent(false)
            .bind(queue.as_str().to_owned())
            .bind(i64::from(scan))
            .bind(i64::from(limit))
            .fetch_all(&mut *tx)
            .await?;
        rows.append(&mut more);
    }
    tx.commit().await?;
    Ok(rows)
}

pub(super) async fn events(
    pg: &PgFence,
    timeout: Duration,
    queue: Option<&QueueName>,
    limit: u32,
) -> Result<Vec<EventRow>, AdminError> {
    let mut tx = begin(pg, timeout, false).await?;
    let rows = sqlx::query_as(AssertSqlSafe(events_sql(pg.get_schema().as_str())))
        .persistent(false)
        .bind(queue.map(|q| q.as_str().to_owned()))
        .bind(i64::from(limit))
        .fetch_all(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok(rows)
}

pub(super) async fn dead(
    pg: &PgFence,
    timeout: Duration,
    queues: &[QueueName],
    limit: u32,
) -> Result<Vec<DeadRow>, AdminError> {
    let statement = dead_rows(pg.get_schema().as_str());
    let mut tx = begin(pg, timeout, false).await?;
    let mut rows = Vec::new();
    for queue in queues {
        let mut more: Vec<DeadRow> = sqlx::query_as(AssertSqlSafe(statement.clone()))
            .persistent(false)
            .bind(queue.as_str().to_owned())
            .bind(i64::from(limit))
            .fetch_all(&mut *tx)
            .await?;
        rows.append(&mut more);
    }
    tx.commit().await?;
    Ok(rows)
}

/// Every statement above with sample arguments (SQL literals of the parameters' types: the plan
/// is the generic one, which does not depend on them).
fn statements(s: &str) -> Vec<(&'static str, String, &'static str)> {
    vec![
        ("queues", queues(s), ""),
        ("open_counts", open_counts(s), "('q', 10000)"),
        ("finished_count", finished_count(s), "('q', 'completed', 10000)"),
        ("oldest_pending", oldest_pending(s), "('q')"),
        ("running", running(s), "('q', 10000, 1000)"),
        ("minutes", minutes(s), "('q', 30)"),
        ("events", events_sql(s), "(NULL, 100)"),
        ("dead", dead_rows(s), "('q', 100)"),
    ]
}

pub(super) async fn plans(pg: &PgFence, timeout: Duration) -> Result<BTreeMap<&'static str, String>, AdminError> {
    let s = pg.get_schema().as_str();
    let mut tx = begin(pg, timeout, false).await?;
    // As the fence's sessions plan (PG_SESSION_SETUP): generic plans, no sequential scan unless
    // there is no other way.
    sqlx::query(
        "SELECT set_config('enable_seqscan', 'off', true), set_config('plan_cache_mode', 'force_generic_plan', true)",
    )
    .persistent(false)
    .execute(&mut *tx)
    .await?;
    let mut plans = BTreeMap::new();
    for (name, statement, args) in statements(s) {
        let prepared = format!("brokerfence_dashboard_{name}");
        sqlx::query(AssertSqlSafe(format!("PREPARE {prepared} AS {statement}")))
            .persistent(false)
            .execute(&mut *tx)
            .await?;
        let row = sqlx::query(AssertSqlSafe(format!("EXPLAIN (FORMAT JSON) EXECUTE {prepared}{args}")))
            .persistent(false)
            .fetch_one(&mut *tx)
            .await?;
        // A `json` value: its text (sqlx's String does not claim the type).
        let plan: String = sqlx::Row::try_get_unchecked(&row, 0)?;
        sqlx::query(AssertSqlSafe(format!("DEALLOCATE {prepared}"))).persistent(false).execute(&mut *tx).await?;
        plans.insert(name, plan);
    }
    tx.commit().await?;
    Ok(plans)
}
