//! Writing and pruning what the dashboard reads: the activity minutes and the ring of fence
//! events (migration 13 on PostgreSQL, 6 on SQLite). One statement per kind and flush, each in a
//! short transaction of its own with a statement timeout; never on a claim's or commit's path.

use std::time::Duration;

use sqlx::AssertSqlSafe;

use super::activity::{Activity, FENCE_EVENT_SLOTS, count_columns};
use crate::error::Result;

/// The statement limit of one write or prune of dashboard rows.
#[cfg(feature = "postgres")]
const RECORD_TIMEOUT_MS: &str = "5000";

/// Event columns: queue, key, kind, detail, epoch, owner, winner epoch, winner owner.
type EventColumns =
    (Vec<String>, Vec<String>, Vec<String>, Vec<String>, Vec<i64>, Vec<String>, Vec<Option<i64>>, Vec<Option<String>>);

fn event_columns(activity: &Activity) -> EventColumns {
    let mut c = EventColumns::default();
    // At most a ring's worth: older ones would be overwritten by the same statement.
    let skip = activity.events.len().saturating_sub(usize::try_from(FENCE_EVENT_SLOTS).unwrap_or(usize::MAX));
    for e in activity.events.iter().skip(skip) {
        c.0.push(e.queue.as_str().to_owned());
        c.1.push(e.key.as_str().to_owned());
        c.2.push(e.kind.as_str().to_owned());
        // Details are the worker's own words; bounded like `last_error` is not.
        c.3.push(e.detail.chars().take(500).collect());
        c.4.push(e.epoch);
        c.5.push(e.owner.as_str().to_owned());
        c.6.push(e.winner_epoch);
        c.7.push(e.winner_owner.clone());
    }
    c
}

#[cfg(feature = "postgres")]
pub(crate) async fn record_pg(pg: &crate::PgFence, activity: &Activity) -> Result<()> {
    if activity.is_empty() {
        return Ok(());
    }
    let s = pg.get_schema().as_str();
    let mut tx = pg.begin().await?;
    sqlx::query("SELECT set_config('statement_timeout', $1, true), set_config('lock_timeout', $1, true)")
        .persistent(false)
        .bind(RECORD_TIMEOUT_MS)
        .execute(&mut *tx)
        .await?;
    let (queues, claims, commits, fenced, lost) = count_columns(activity);
    if !queues.is_empty() {
        // Queues in order (a BTreeMap): two workers' flushes lock the same rows in one order.
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}.activity AS a (queue, minute, claims, commits, fenced, lost) \
             SELECT u.q, date_trunc('minute', clock_timestamp()), u.c, u.m, u.f, u.l \
             FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::bigint[], $5::bigint[]) AS u(q, c, m, f, l) \
             ON CONFLICT (queue, minute) DO UPDATE SET claims = a.claims + EXCLUDED.claims, \
               commits = a.commits + EXCLUDED.commits, fenced = a.fenced + EXCLUDED.fenced, lost = a.lost + EXCLUDED.lost"
        )))
        .persistent(false)
        .bind(queues)
        .bind(claims)
        .bind(commits)
        .bind(fenced)
        .bind(lost)
        .execute(&mut *tx)
        .await?;
    }
    if !activity.events.is_empty() {
        let c = event_columns(activity);
        // The winner: what the worker knew (a refused commit names the holder), else the job
        // row as it is now. A slot is `seq mod FENCE_EVENT_SLOTS`: the ring overwrites its oldest.
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}.fence_events AS e (slot, seq, at, queue, key, kind, detail, epoch, owner, \
               winner_epoch, winner_owner, winner_state) \
             SELECT n.seq % {FENCE_EVENT_SLOTS}, n.seq, clock_timestamp(), u.q, u.k, u.kind, u.detail, u.epoch, \
               u.owner, coalesce(u.we, j.epoch), coalesce(u.wo, j.owner), j.state \
             FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[], $6::text[], $7::bigint[], \
               $8::text[]) WITH ORDINALITY AS u(q, k, kind, detail, epoch, owner, we, wo, ord) \
             CROSS JOIN LATERAL (SELECT nextval('{s}.fence_event_seq') AS seq, u.ord) n \
             LEFT JOIN {s}.jobs j ON j.queue = u.q AND j.key = u.k \
             ORDER BY u.ord \
             ON CONFLICT (slot) DO UPDATE SET seq = EXCLUDED.seq, at = EXCLUDED.at, queue = EXCLUDED.queue, \
               key = EXCLUDED.key, kind = EXCLUDED.kind, detail = EXCLUDED.detail, epoch = EXCLUDED.epoch, \
               owner = EXCLUDED.owner, winner_epoch = EXCLUDED.winner_epoch, winner_owner = EXCLUDED.winner_owner, \
               winner_state = EXCLUDED.winner_state"
        )))
        .persistent(false)
        .bind(c.0)
        .bind(c.1)
        .bind(c.2)
        .bind(c.3)
        .bind(c.4)
        .bind(c.5)
        .bind(c.6)
        .bind(c.7)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Deletes activity minutes and fence events older than `age`: the rows deleted.
#[cfg(feature = "postgres")]
pub(crate) async fn prune_pg(pg: &crate::PgFence, age: Duration, batch: u32) -> Result<u64> {
    let s = pg.get_schema().as_str();
    let ms = crate::retention::age_ms(age);
    let mut n = 0;
    for (table, column) in [("activity", "minute"), ("fence_events", "at")] {
        // In batches (by the index on the age column), each its own short transaction under the
        // record's time limits, so that a long backlog never outlasts them.
        let delete = format!(
            "DELETE FROM {s}.{table} WHERE ctid = ANY (ARRAY(SELECT ctid FROM {s}.{table} \
               WHERE {column} < clock_timestamp() - $1::bigint * interval '1 millisecond' LIMIT $2))"
        );
        loop {
            let mut tx = pg.begin().await?;
            sqlx::query("SELECT set_config('statement_timeout', $1, true), set_config('lock_timeout', $1, true)")
                .persistent(false)
                .bind(RECORD_TIMEOUT_MS)
                .execute(&mut *tx)
                .await?;
            let deleted = sqlx::query(AssertSqlSafe(delete.clone()))
                .persistent(false)
                .bind(ms)
                .bind(i64::from(batch.max(1)))
                .execute(&mut *tx)
                .await?
                .rows_affected();
            tx.commit().await?;
            n += deleted;
            if deleted < u64::from(batch.max(1)) {
                break;
            }
        }
    }
    Ok(n)
}

#[cfg(feature = "sqlite")]
pub(crate) async fn record_sqlite(lite: &crate::SqliteFence, activity: &Activity) -> Result<()> {
    use sqlx::Connection;
    if activity.is_empty() {
        return Ok(());
    }
    let s = lite.get_schema().as_str();
    let now = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";
    let mut conn = lite.pool().acquire().await?;
    let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
    let (queues, claims, commits, fenced, lost) = count_columns(activity);
    for (i, q) in queues.iter().enumerate() {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}_activity (queue, minute, claims, commits, fenced, lost) \
             VALUES (?1, ({now} / 60000) * 60000, ?2, ?3, ?4, ?5) \
             ON CONFLICT (queue, minute) DO UPDATE SET claims = claims + excluded.claims, \
               commits = commits + excluded.commits, fenced = fenced + excluded.fenced, lost = lost + excluded.lost"
        )))
        .bind(q)
        .bind(claims[i])
        .bind(commits[i])
        .bind(fenced[i])
        .bind(lost[i])
        .execute(&mut *tx)
        .await?;
    }
    let c = event_columns(activity);
    for i in 0..c.0.len() {
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}_fence_events (slot, seq, at, queue, key, kind, detail, epoch, owner, winner_epoch, \
               winner_owner, winner_state) \
             SELECT n.seq % {FENCE_EVENT_SLOTS}, n.seq, {now}, ?1, ?2, ?3, ?4, ?5, ?6, \
               coalesce(?7, (SELECT j.epoch FROM {s}_jobs j WHERE j.queue = ?1 AND j.key = ?2)), \
               coalesce(?8, (SELECT j.owner FROM {s}_jobs j WHERE j.queue = ?1 AND j.key = ?2)), \
               (SELECT j.state FROM {s}_jobs j WHERE j.queue = ?1 AND j.key = ?2) \
             FROM (SELECT coalesce(max(seq), 0) + 1 AS seq FROM {s}_fence_events) n WHERE true \
             ON CONFLICT (slot) DO UPDATE SET seq = excluded.seq, at = excluded.at, queue = excluded.queue, \
               key = excluded.key, kind = excluded.kind, detail = excluded.detail, epoch = excluded.epoch, \
               owner = excluded.owner, winner_epoch = excluded.winner_epoch, winner_owner = excluded.winner_owner, \
               winner_state = excluded.winner_state"
        )))
        .bind(&c.0[i])
        .bind(&c.1[i])
        .bind(&c.2[i])
        .bind(&c.3[i])
        .bind(c.4[i])
        .bind(&c.5[i])
        .bind(c.6[i])
        .bind(c.7[i].as_deref())
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Deletes activity minutes and fence events older than `age`: the rows deleted.
#[cfg(feature = "sqlite")]
pub(crate) async fn prune_sqlite(lite: &crate::SqliteFence, age: Duration, batch: u32) -> Result<u64> {
    use sqlx::Connection;
    let s = lite.get_schema().as_str();
    let now = "CAST(unixepoch('subsec') * 1000 AS INTEGER)";
    let ms = crate::retention::age_ms(age);
    let mut n = 0;
    for (table, column) in [("activity", "minute"), ("fence_events", "at")] {
        // In batches, each its own short write transaction: SQLite has one writer.
        let delete = format!(
            "DELETE FROM {s}_{table} WHERE rowid IN (SELECT rowid FROM {s}_{table} WHERE {column} < {now} - ?1 LIMIT ?2)"
        );
        loop {
            let mut conn = lite.pool().acquire().await?;
            let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
            let deleted = sqlx::query(AssertSqlSafe(delete.clone()))
                .bind(ms)
                .bind(i64::from(batch.max(1)))
                .execute(&mut *tx)
                .await?
                .rows_affected();
            tx.commit().await?;
            n += deleted;
            if deleted < u64::from(batch.max(1)) {
                break;
            }
        }
    }
    Ok(n)
}
