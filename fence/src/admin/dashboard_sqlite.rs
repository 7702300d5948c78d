//! The dashboard's statements on SQLite, through the indexes of its migrations: `jobs_due`
//! (pending and failed by `run_at`), `jobs_leased` (running by `lease_until`), `jobs_finished`
//! (completed and dead by `updated_at`). Times are milliseconds of the database clock.

use std::collections::BTreeMap;

use sqlx::AssertSqlSafe;

use super::{AdminError, DeadRow, EventRow, FlightRow, MINUTES, QueueRead};
use crate::key::QueueName;
use crate::sqlite::SqliteFence;

/// The database clock in milliseconds.
const NOW: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

fn open_counts(s: &str) -> String {
    format!(
        "SELECT o.state, count(*) FROM (SELECT t.state FROM {s}_jobs t WHERE t.queue = ?1 \
           AND t.state IN ('pending', 'failed') LIMIT ?2) o GROUP BY o.state \
         UNION ALL SELECT 'running', count(*) FROM (SELECT 1 FROM {s}_jobs t WHERE t.queue = ?1 \
           AND t.state = 'running' LIMIT ?2)"
    )
}

/// The partial index's condition is spelled out: SQLite uses a partial index only for a query
/// whose WHERE implies it, and a bound state would not.
fn finished_count(s: &str, state: &str) -> String {
    format!(
        "SELECT count(*) FROM (SELECT 1 FROM {s}_jobs t WHERE t.queue = ?1 AND t.state IN ('completed', 'dead') \
           AND t.state = '{state}' LIMIT ?2)"
    )
}

fn oldest_pending(s: &str) -> String {
    format!(
        "SELECT {NOW} - t.run_at FROM {s}_jobs t WHERE t.queue = ?1 AND t.state IN ('pending', 'failed') \
           AND t.run_at <= {NOW} ORDER BY t.run_at LIMIT 1"
    )
}

fn running(s: &str) -> String {
    format!(
        "SELECT t.queue, t.key, t.epoch, t.owner, t.attempts, t.lease_until, t.lease_until - {NOW}, t.run_at, \
           CASE WHEN t.updated_at > t.run_at + 1 THEN t.updated_at END FROM {s}_jobs t WHERE t.queue = ?1 AND t.state = 'running' AND t.lease_until IS NOT NULL \
         ORDER BY t.lease_until, t.key LIMIT ?2"
    )
}

fn minutes(s: &str) -> String {
    format!(
        "SELECT a.minute, a.claims, a.commits, a.fenced, a.lost FROM {s}_activity a WHERE a.queue = ?1 \
           AND a.minute >= ({NOW} / 60000 - (?2 - 1)) * 60000 ORDER BY a.minute"
    )
}

fn events_sql(s: &str) -> String {
    format!(
        "SELECT e.seq, e.at, {NOW} - e.at, e.queue, e.key, e.kind, e.detail, e.epoch, e.owner, e.winner_epoch, \
           e.winner_owner, e.winner_state FROM {s}_fence_events e WHERE (?1 IS NULL OR e.queue = ?1) \
         ORDER BY e.seq DESC LIMIT ?2"
    )
}

fn dead_rows(s: &str) -> String {
    format!(
        "SELECT t.queue, t.key, t.epoch, t.owner, t.attempts, t.failures, substr(t.last_error, 1, 4096), \
           t.updated_at, {NOW} - t.updated_at FROM {s}_jobs t WHERE t.queue = ?1 \
           AND t.state IN ('completed', 'dead') AND t.state = 'dead' ORDER BY t.updated_at DESC LIMIT ?2"
    )
}

pub(super) async fn overview(
    lite: &SqliteFence,
    queues: &[QueueName],
    limit: u32,
) -> Result<(i64, Vec<QueueRead>), AdminError> {
    let s = lite.get_schema().as_str();
    let limit = i64::from(limit);
    // One read transaction: every statement sees the same snapshot.
    let mut tx = lite.pool().begin().await?;
    let now: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT {NOW}"))).fetch_one(&mut *tx).await?;
    let mut reads = Vec::with_capacity(queues.len());
    for queue in queues {
        let q = queue.as_str().to_owned();
        let open: Vec<(String, i64)> =
            sqlx::query_as(AssertSqlSafe(open_counts(s))).bind(&q).bind(limit).fetch_all(&mut *tx).await?;
        let mut finished = [0i64; 2];
        for (slot, state) in finished.iter_mut().zip(["completed", "dead"]) {
            *slot = sqlx::query_scalar(AssertSqlSafe(finished_count(s, state)))
                .bind(&q)
                .bind(limit)
                .fetch_one(&mut *tx)
                .await?;
        }
        let oldest_pending_ms: Option<i64> =
            sqlx::query_scalar(AssertSqlSafe(oldest_pending(s))).bind(&q).fetch_optional(&mut *tx).await?;
        let running: Vec<FlightRow> =
            sqlx::query_as(AssertSqlSafe(running(s))).bind(&q).bind(limit).fetch_all(&mut *tx).await?;
        let minutes: Vec<(i64, i64, i64, i64, i64)> =
            sqlx::query_as(AssertSqlSafe(minutes(s))).bind(&q).bind(MINUTES).fetch_all(&mut *tx).await?;
        // Two reads (pending and failed by one index, running by another), each stopped at the limit.
        let waiting: i64 = open.iter().filter(|(s, _)| s != "running").map(|(_, n)| *n).sum();
        let open_capped = waiting >= limit || open.iter().any(|(s, n)| s == "running" && *n >= limit);
        let open = open.into_iter().filter(|(_, n)| *n > 0).collect();
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
    lite: &SqliteFence,
    queues: &[QueueName],
    limit: u32,
) -> Result<Vec<FlightRow>, AdminError> {
    let s = lite.get_schema().as_str();
    let mut tx = lite.pool().begin().await?;
    let mut rows = Vec::new();
    for queue in queues {
        let mut more: Vec<FlightRow> = sqlx::query_as(AssertSqlSafe(running(s)))
            .bind(queue.as_str().to_owned())
            .bind(i64::from(limit))
            .fetch_all(&mut *tx)
            .await?;
        rows.append(&mut more);
    }
    tx.commit().await?;
    Ok(rows)
}

pub(super) async fn events(
    lite: &SqliteFence,
    queue: Option<&QueueName>,
    limit: u32,
) -> Result<Vec<EventRow>, AdminError> {
    Ok(sqlx::query_as(AssertSqlSafe(events_sql(lite.get_schema().as_str())))
        .bind(queue.map(|q| q.as_str().to_owned()))
        .bind(i64::from(limit))
        .fetch_all(lite.pool())
        .await?)
}

pub(super) async fn dead(lite: &SqliteFence, queues: &[QueueName], limit: u32) -> Result<Vec<DeadRow>, AdminError> {
    let s = lite.get_schema().as_str();
    let mut tx = lite.pool().begin().await?;
    let mut rows = Vec::new();
    for queue in queues {
        let mut more: Vec<DeadRow> = sqlx::query_as(AssertSqlSafe(dead_rows(s)))
            .bind(queue.as_str().to_owned())
            .bind(i64::from(limit))
            .fetch_all(&mut *tx)
            .await?;
        rows.append(&mut more);
    }
    tx.commit().await?;
    Ok(rows)
}

pub(super) async fn plans(lite: &SqliteFence) -> Result<BTreeMap<&'static str, String>, AdminError> {
    let s = lite.get_schema().as_str();
    let statements = [
        ("open_counts", open_counts(s)),
        ("completed_count", finished_count(s, "completed")),
        ("dead_count", finished_count(s, "dead")),
        ("oldest_pending", oldest_pending(s)),
        ("running", running(s)),
        ("minutes", minutes(s)),
        ("events", events_sql(s)),
        ("dead", dead_rows(s)),
        ("queues", super::sqlite::queues_sql(s)),
    ];
    let mut plans = BTreeMap::new();
    for (name, statement) in statements {
        let rows: Vec<(i64, i64, i64, String)> =
            sqlx::query_as(AssertSqlSafe(format!("EXPLAIN QUERY PLAN {statement}"))).fetch_all(lite.pool()).await?;
        plans.insert(name, rows.into_iter().map(|r| r.3).collect::<Vec<_>>().join("\n"));
    }
    Ok(plans)
}
