//! The admin statements on SQLite. Every statement is constant text plus the validated table
//! prefix; every value is a bound parameter. Times are SQLite's clock in milliseconds.

use std::time::Duration;

use sqlx::AssertSqlSafe;

use super::{
    AdminError, DeadRow, JobInfo, JobInfoRow, Requeue, RequeueReport, RunningRow, Status, absorb_requeued, assemble,
    dead_job, job_info, key_chunks, keyed_outcome, ms,
};
use crate::key::{JobKey, QueueName};
use crate::sqlite::SqliteFence;

/// The database clock in milliseconds (as the store's statements read it).
const NOW: &str = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";

/// The queue filter of a statement whose `?1` is the queue or NULL (every queue).
fn queue_filter(queue: Option<&QueueName>) -> &'static str {
    if queue.is_some() { "t.queue = ?1" } else { "?1 IS NULL" }
}

/// What a requeued row becomes (see [`super::Admin::requeue_dead`]).
fn requeue_set() -> String {
    format!(
        "state = 'pending', epoch = epoch + 1, owner = NULL, lease_until = NULL, attempts = 0, failures = 0, \
         run_at = {NOW}, updated_at = {NOW}"
    )
}

fn running_select(s: &str, filter: &str, extra: &str, order: &str) -> String {
    format!(
        "SELECT r.q, r.k, r.epoch, r.owner, r.attempts, r.lu, r.lease_left, r.ra FROM ( \
           SELECT t.queue AS q, t.key AS k, t.epoch, t.owner, t.attempts, t.lease_until AS lu, \
             t.lease_until - {NOW} AS lease_left, t.run_at AS ra, \
             row_number() OVER (PARTITION BY t.queue ORDER BY {order}, t.key) AS rn \
           FROM {s}_jobs t WHERE {filter} AND t.state = 'running' AND t.lease_until IS NOT NULL {extra}) r \
         WHERE r.rn <= ?2 ORDER BY r.q, r.rn"
    )
}

pub(super) async fn status(
    lite: &SqliteFence,
    queue: Option<&QueueName>,
    within: Duration,
    limit: u32,
) -> Result<Status, AdminError> {
    let s = lite.get_schema().as_str();
    let f = queue_filter(queue);
    let q = queue.map(|q| q.as_str().to_owned());
    // One read transaction: every statement sees the same snapshot.
    let mut tx = lite.pool().begin().await?;
    let now: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT {NOW}"))).fetch_one(&mut *tx).await?;
    let counts: Vec<(String, String, i64, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT t.queue, t.state, count(*), \
           sum(CASE WHEN t.state = 'running' AND t.lease_until < {NOW} THEN 1 ELSE 0 END) \
         FROM {s}_jobs t WHERE {f} GROUP BY t.queue, t.state ORDER BY 1, 2"
    )))
    .bind(q.clone())
    .fetch_all(&mut *tx)
    .await?;
    let oldest: Vec<RunningRow> = sqlx::query_as(AssertSqlSafe(running_select(s, f, "", "t.run_at")))
        .bind(q.clone())
        .bind(1i64)
        .fetch_all(&mut *tx)
        .await?;
    let expiring: Vec<RunningRow> = sqlx::query_as(AssertSqlSafe(running_select(
        s,
        f,
        &format!("AND t.lease_until < {NOW} + ?3"),
        "t.lease_until",
    )))
    .bind(q)
    .bind(i64::from(limit))
    .bind(ms(within))
    .fetch_all(&mut *tx)
    .await?;
    tx.commit().await?;
    assemble(now, counts, oldest, expiring)
}

pub(super) async fn queues(lite: &SqliteFence) -> Result<Vec<String>, AdminError> {
    Ok(sqlx::query_scalar(AssertSqlSafe(queues_sql(lite.get_schema().as_str()))).fetch_all(lite.pool()).await?)
}

/// The queues of the jobs table, one index search each (a skip scan of the primary key): a
/// `SELECT DISTINCT queue` read every row of the table, and the dashboard asks on every refresh.
pub(super) fn queues_sql(s: &str) -> String {
    format!(
        "WITH RECURSIVE q(queue) AS (SELECT (SELECT min(queue) FROM {s}_jobs) \
           UNION ALL SELECT (SELECT min(queue) FROM {s}_jobs WHERE queue > q.queue) FROM q WHERE q.queue IS NOT NULL) \
         SELECT queue FROM q WHERE queue IS NOT NULL"
    )
}

pub(super) async fn job(lite: &SqliteFence, queue: &QueueName, key: &JobKey) -> Result<Option<JobInfo>, AdminError> {
    let s = lite.get_schema().as_str();
    let row: Option<JobInfoRow> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT t.state, t.epoch, t.owner, t.attempts, t.failures, t.lease_until, t.lease_until - {NOW}, t.run_at, \
           t.last_error, t.created_at, t.updated_at, length(t.payload), length(t.progress), length(t.result), {NOW} \
         FROM {s}_jobs t WHERE t.queue = ?1 AND t.key = ?2"
    )))
    .bind(queue.as_str().to_owned())
    .bind(key.as_str().to_owned())
    .fetch_optional(lite.pool())
    .await?;
    row.map(|row| job_info(queue, key, row)).transpose()
}

pub(super) async fn dead(
    lite: &SqliteFence,
    queue: Option<&QueueName>,
    limit: u32,
) -> Result<Vec<super::DeadJob>, AdminError> {
    let s = lite.get_schema().as_str();
    let f = queue_filter(queue);
    let rows: Vec<DeadRow> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT t.queue, t.key, t.epoch, t.owner, t.attempts, t.failures, t.last_error, t.updated_at, \
           {NOW} - t.updated_at \
         FROM {s}_jobs t WHERE {f} AND t.state IN ('completed', 'dead') AND t.state = 'dead' \
         ORDER BY t.updated_at DESC, t.queue, t.key LIMIT ?2"
    )))
    .bind(queue.map(|q| q.as_str().to_owned()))
    .bind(i64::from(limit))
    .fetch_all(lite.pool())
    .await?;
    rows.into_iter().map(dead_job).collect()
}

/// The condition that leaves out rows claimed from a broker (no payload: only the table queue's
/// enqueue stores one), unless they are to be requeued too.
fn broker_filter(brokers: bool) -> &'static str {
    // Keys `JobKey` refuses (rows a claim made dead, issue #30 item 7) are never requeued: the
    // claim would kill them again. They stay dead, listed with their key marked.
    if brokers {
        "AND key <> '' AND length(CAST(key AS BLOB)) <= 1024"
    } else {
        "AND key <> '' AND length(CAST(key AS BLOB)) <= 1024 AND payload IS NOT NULL"
    }
}

/// Dead jobs of `which` claimed from a broker: some of their keys (in key order) and how many.
pub(super) async fn broker_jobs(
    lite: &SqliteFence,
    queue: &QueueName,
    which: &Requeue,
) -> Result<(Vec<String>, i64), AdminError> {
    let s = lite.get_schema().as_str();
    let shown = i64::try_from(super::BROKER_KEYS_SHOWN).unwrap_or(10);
    match which {
        Requeue::Keys(keys) => {
            let probe =
                format!("SELECT 1 FROM {s}_jobs WHERE queue = ?1 AND key = ?2 AND state = 'dead' AND payload IS NULL");
            let mut found = Vec::new();
            for chunk in key_chunks(keys, 500) {
                for key in chunk {
                    let hit: Option<i64> = sqlx::query_scalar(AssertSqlSafe(probe.clone()))
                        .bind(queue.as_str().to_owned())
                        .bind(key.clone())
                        .fetch_optional(lite.pool())
                        .await?;
                    if hit.is_some() {
                        found.push(key);
                    }
                }
            }
            found.sort_unstable();
            let count = i64::try_from(found.len()).unwrap_or(i64::MAX);
            found.truncate(super::BROKER_KEYS_SHOWN);
            Ok((found, count))
        }
        Requeue::AllDead => {
            let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
                "SELECT key, count(*) OVER () FROM {s}_jobs \
                 WHERE queue = ?1 AND state = 'dead' AND payload IS NULL \
                   AND key <> '' AND length(CAST(key AS BLOB)) <= 1024 ORDER BY key LIMIT ?2"
            )))
            .bind(queue.as_str().to_owned())
            .bind(shown)
            .fetch_all(lite.pool())
            .await?;
            let count = rows.first().map(|r| r.1).unwrap_or(0);
            Ok((rows.into_iter().map(|r| r.0).collect(), count))
        }
    }
}

pub(super) async fn requeue(
    lite: &SqliteFence,
    queue: &QueueName,
    which: &Requeue,
    batch: u32,
    brokers: bool,
) -> Result<RequeueReport, AdminError> {
    let s = lite.get_schema().as_str();
    let set = requeue_set();
    // Checked before (`broker_jobs`); this keeps a row that died meanwhile out as well.
    let only = broker_filter(brokers);
    let mut report = RequeueReport::default();
    match which {
        Requeue::Keys(keys) => {
            let update = format!(
                "UPDATE {s}_jobs SET {set} WHERE queue = ?1 AND key = ?2 AND state = 'dead' {only} RETURNING epoch"
            );
            let seen = format!("SELECT state FROM {s}_jobs WHERE queue = ?1 AND key = ?2");
            for chunk in key_chunks(keys, batch) {
                // One writer at a time: the chunk is one IMMEDIATE transaction.
                let mut tx = lite.pool().begin_with("BEGIN IMMEDIATE").await?;
                let mut rows = Vec::with_capacity(chunk.len());
                for key in chunk {
                    let epoch: Option<i64> = sqlx::query_scalar(AssertSqlSafe(update.clone()))
                        .bind(queue.as_str().to_owned())
                        .bind(key.clone())
                        .fetch_optional(&mut *tx)
                        .await?;
                    let state: Option<String> = match epoch {
                        Some(_) => None,
                        None => {
                            sqlx::query_scalar(AssertSqlSafe(seen.clone()))
                                .bind(queue.as_str().to_owned())
                                .bind(key.clone())
                                .fetch_optional(&mut *tx)
                                .await?
                        }
                    };
                    rows.push((key, epoch, state));
                }
                tx.commit().await?;
                if rows.iter().any(|r| r.1.is_some()) {
                    // Pending again and due now: this process's idle consumers claim it at once.
                    lite.wake_here(queue, std::time::Duration::ZERO);
                }
                keyed_outcome(&mut report, rows)?;
            }
        }
        Requeue::AllDead => {
            let cutoff: i64 = sqlx::query_scalar(AssertSqlSafe(format!("SELECT {NOW}"))).fetch_one(lite.pool()).await?;
            let update = format!(
                "UPDATE {s}_jobs SET {set} WHERE rowid IN (SELECT rowid FROM {s}_jobs \
                   WHERE queue = ?1 AND state IN ('completed', 'dead') AND state = 'dead' AND updated_at <= ?2 {only} \
                   ORDER BY updated_at LIMIT ?3) RETURNING key, epoch"
            );
            loop {
                let mut tx = lite.pool().begin_with("BEGIN IMMEDIATE").await?;
                let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(update.clone()))
                    .bind(queue.as_str().to_owned())
                    .bind(cutoff)
                    .bind(i64::from(batch))
                    .fetch_all(&mut *tx)
                    .await?;
                tx.commit().await?;
                if !rows.is_empty() {
                    lite.wake_here(queue, std::time::Duration::ZERO);
                }
                if !absorb_requeued(&mut report, rows, batch)? {
                    break;
                }
            }
        }
    }
    Ok(report)
}
