//! Pruning finished jobs and ledger rows in small batches, under the pruner and floor locks.

use std::time::Duration;

use super::PgFence;
use super::statements::sql;
use crate::error::{FenceError, Result};
use crate::key::QueueName;

/// What one pruning transaction did: rows deleted, or nothing because another pruner held the
/// pruner lock, or because claims kept the queue's floor lock for longer than the pruner waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PruneBatch {
    Deleted(u64),
    Contended,
    FloorBusy,
}

/// How long a pruning batch waits for a queue's floor lock. Claims of the queue that come
/// meanwhile wait behind it, so this is short. Only claims take the lock (shared, for their own
/// short transaction; an enqueue reads no floor, so a caller's transaction around `enqueue_in`
/// never holds it): a pruner that does not get it in time warns, counts the queue in
/// [`PruneReport::floor_busy`](crate::PruneReport::floor_busy) and goes on with the next queue.
const FLOOR_LOCK_WAIT_MS: &str = "100";

impl PgFence {
    /// Begins a pruning transaction holding the schema's pruner lock, or `None` when another
    /// pruner holds it (never waits for it).
    async fn begin_prune(&self) -> Result<Option<sqlx::Transaction<'static, sqlx::Postgres>>> {
        let mut tx = self.begin().await?;
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_xact_lock(hashtextextended($1, 0))")
            .persistent(false)
            .bind(format!("brokerfence.pruner.{}", self.schema.as_str()))
            .fetch_one(&mut *tx)
            .await?;
        if !got {
            tx.rollback().await?;
            return Ok(None);
        }
        Ok(Some(tx))
    }

    /// One batch of job pruning in its own transaction: the pruner lock, the queue's floor lock
    /// (exclusive, see migration 5), then one statement that deletes and raises the floor.
    async fn prune_jobs_batch(&self, queue: &QueueName, state: &str, age: Duration, batch: u32) -> Result<PruneBatch> {
        let Some(mut tx) = self.begin_prune().await? else { return Ok(PruneBatch::Contended) };
        sqlx::query("SELECT set_config('lock_timeout', $1, true)")
            .persistent(false)
            .bind(FLOOR_LOCK_WAIT_MS)
            .execute(&mut *tx)
            .await?;
        let floor_lock = sqlx::query("SELECT pg_advisory_xact_lock(hashtextextended($1, 0))")
            .persistent(false)
            .bind(format!("brokerfence.floor.{}.{}", self.schema.as_str(), queue.as_str()))
            .execute(&mut *tx)
            .await;
        match floor_lock.map_err(FenceError::from) {
            Ok(_) => {}
            Err(FenceError::LockTimeout(_)) => {
                tx.rollback().await?;
                tracing::warn!(
                    queue = %queue,
                    wait_ms = FLOOR_LOCK_WAIT_MS,
                    "pruner did not get the queue's floor lock in time (claims of the queue held it); \
                     the queue is left for the next run"
                );
                return Ok(PruneBatch::FloorBusy);
            }
            Err(e) => return Err(e),
        }
        let (n, floor): (i64, Option<i64>) = sqlx::query_as(sql(&self.stmts.prune_jobs))
            .persistent(false)
            .bind(queue.as_str().to_owned())
            .bind(state.to_owned())
            .bind(crate::retention::age_ms(age))
            .bind(i64::from(batch))
            .fetch_one(&mut *tx)
            .await?;
        tx.commit().await?;
        if n > 0 {
            tracing::debug!(queue = %queue, state, deleted = n, floor, "pruned a batch");
        }
        Ok(PruneBatch::Deleted(u64::try_from(n).unwrap_or(0)))
    }

    /// One batch of ledger pruning (receiver `scope`) in its own transaction, under the pruner
    /// lock: the rows deleted, or `None` when another pruner held the lock.
    async fn prune_ledger_batch(&self, scope: &str, age: Duration, batch: u32) -> Result<Option<u64>> {
        let Some(mut tx) = self.begin_prune().await? else { return Ok(None) };
        let done = sqlx::query(sql(&self.stmts.prune_ledger))
            .persistent(false)
            .bind(scope.to_owned())
            .bind(crate::retention::age_ms(age))
            .bind(i64::from(batch))
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(Some(done.rows_affected()))
    }

    /// Prunes the ledger rows of `scope` older than `age`, batch after batch: (rows, batches,
    /// contended), contended when another pruner held the pruner lock (the run stopped there).
    pub(crate) async fn prune_ledger_scope(
        &self,
        scope: &str,
        age: Duration,
        batch: u32,
        pause: Duration,
    ) -> Result<(u64, u64, bool)> {
        let (mut rows, mut batches) = (0u64, 0u64);
        loop {
            match self.prune_ledger_batch(scope, age, batch).await? {
                None => return Ok((rows, batches, true)),
                Some(n) => {
                    rows += n;
                    if n > 0 {
                        batches += 1;
                    }
                    if n < u64::from(batch) {
                        return Ok((rows, batches, false));
                    }
                }
            }
            tokio::time::sleep(pause).await;
        }
    }

    pub(super) async fn prune_all(&self, retention: &crate::Retention) -> Result<crate::PruneReport> {
        let mut report = crate::PruneReport::default();
        let batch = retention.get_batch_size();
        let mut floor_busy: Vec<&QueueName> = Vec::new();
        for (queue, state, age) in retention.targets() {
            if floor_busy.contains(&queue) {
                continue;
            }
            loop {
                match self.prune_jobs_batch(queue, state, age, batch).await? {
                    PruneBatch::Contended => {
                        report.contended = true;
                        return Ok(report);
                    }
                    PruneBatch::FloorBusy => {
                        floor_busy.push(queue);
                        report.floor_busy += 1;
                        break;
                    }
                    PruneBatch::Deleted(n) => {
                        if state == "completed" {
                            report.completed += n;
                        } else {
                            report.dead += n;
                        }
                        if n > 0 {
                            report.batches += 1;
                        }
                        if n < u64::from(batch) {
                            break;
                        }
                    }
                }
                tokio::time::sleep(retention.get_pause_between_batches()).await;
            }
        }
        for (scope, age) in retention.ledger_scopes() {
            let (rows, batches, contended) =
                self.prune_ledger_scope(scope, age, batch, retention.get_pause_between_batches()).await?;
            report.ledger += rows;
            report.batches += batches;
            if contended {
                report.contended = true;
                return Ok(report);
            }
        }
        // The dashboard's rows are the operators' view, not the fence's: a failure here (a role
        // without the grants, a timeout) is logged and leaves the jobs' pruning reported.
        match crate::admin::prune_pg(self, retention.get_dashboard_age(), batch).await {
            Ok(n) => report.dashboard = n,
            Err(e) => tracing::warn!(error = %e, "could not prune the dashboard's activity and fence events"),
        }
        Ok(report)
    }
}

/// A lock timeout, typed or inside a migration error.
pub(super) fn is_lock_timeout(e: &FenceError) -> bool {
    match e {
        FenceError::LockTimeout(_) => true,
        FenceError::Migration { source: sqlx::Error::Database(db), .. } => db.code().as_deref() == Some("55P03"),
        _ => false,
    }
}
