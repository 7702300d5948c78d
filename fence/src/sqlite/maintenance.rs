//! Maintenance of the SQLite file: reclaiming free pages ([`ReclaimReport`]) and pruning finished
//! jobs and ledger rows.

use std::time::Duration;

use sqlx::AssertSqlSafe;
use tracing::Instrument;

use super::SqliteFence;
use super::statements::sql;
use crate::error::Result;
use crate::key::QueueName;

/// What [`SqliteFence::reclaim_space`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReclaimReport {
    /// `PRAGMA auto_vacuum` of the file: 0 none, 1 full, 2 incremental. Only 2 gives pages back
    /// without a `VACUUM`.
    pub auto_vacuum: i64,
    /// Free pages in the file before.
    pub free_pages_before: i64,
    /// Free pages in the file after.
    pub free_pages_after: i64,
    /// Pages in the file after.
    pub pages_after: i64,
    /// Bytes per page.
    pub page_size: i64,
}

impl SqliteFence {
    /// Returns free pages (left by pruning, or any delete) to the file system: `PRAGMA
    /// incremental_vacuum(pages)` (`None`: every free page), then a passive WAL checkpoint, after
    /// which the file is shorter by the pages given back. It works on files whose `auto_vacuum`
    /// is `INCREMENTAL`:
    ///
    /// - **New files** are: [`open`](Self::open) makes a file it creates `auto_vacuum =
    ///   INCREMENTAL` before anything else is written to it.
    /// - **Existing files** made before (or by other tools) are `NONE`: there the setting only
    ///   changes with a full `VACUUM`, which [`enable_incremental_vacuum`](Self::enable_incremental_vacuum)
    ///   runs once. Until then this call gives nothing back (`auto_vacuum` = 0 in the report) and
    ///   SQLite reuses the free pages for new rows instead, so the file stops growing but does not
    ///   shrink.
    ///
    /// Each call holds the write lock while it moves pages; give a page count to bound it.
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::SqliteFence) -> brokerfence::Result<()> {
    /// let report = fence.reclaim_space(Some(10_000)).await?; // at most 10,000 pages per call
    /// println!("{} free pages left", report.free_pages_after);
    /// # Ok(()) }
    /// ```
    pub async fn reclaim_space(&self, pages: Option<u32>) -> Result<ReclaimReport> {
        let span = tracing::info_span!("fence.reclaim_space", backend = "sqlite", pages);
        async move {
            let mut conn = self.pool.acquire().await?;
            // freelist_count reads the file's header first: `auto_vacuum` answers from what this
            // connection last read, which is stale after another connection's VACUUM.
            let free_pages_before: i64 = sqlx::query_scalar("PRAGMA freelist_count").fetch_one(&mut *conn).await?;
            let auto_vacuum: i64 = sqlx::query_scalar("PRAGMA auto_vacuum").fetch_one(&mut *conn).await?;
            if auto_vacuum == 2 && free_pages_before > 0 {
                let n = pages.map_or(0, i64::from);
                // The pragma's argument cannot be a bound parameter; it is an integer we format.
                sqlx::raw_sql(AssertSqlSafe(format!("PRAGMA incremental_vacuum({n})"))).execute(&mut *conn).await?;
                sqlx::raw_sql("PRAGMA wal_checkpoint(PASSIVE)").execute(&mut *conn).await?;
            }
            let free_pages_after: i64 = sqlx::query_scalar("PRAGMA freelist_count").fetch_one(&mut *conn).await?;
            let pages_after: i64 = sqlx::query_scalar("PRAGMA page_count").fetch_one(&mut *conn).await?;
            let page_size: i64 = sqlx::query_scalar("PRAGMA page_size").fetch_one(&mut *conn).await?;
            let report = ReclaimReport { auto_vacuum, free_pages_before, free_pages_after, pages_after, page_size };
            tracing::info!(?report, "reclaimed space");
            Ok(report)
        }
        .instrument(span)
        .await
    }

    /// Makes an existing file give space back: `PRAGMA auto_vacuum = INCREMENTAL` and a full
    /// `VACUUM`, which rewrites the whole file. It holds the write lock for as long as that takes
    /// (every other writer, heartbeats included, waits up to the busy timeout, 10 s, then fails),
    /// and needs free disk space of up to twice the file. Run it once, in a maintenance window;
    /// afterwards [`reclaim_space`](Self::reclaim_space) works on the file.
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::SqliteFence) -> brokerfence::Result<()> {
    /// fence.enable_incremental_vacuum().await?;
    /// assert_eq!(fence.reclaim_space(None).await?.auto_vacuum, 2);
    /// # Ok(()) }
    /// ```
    pub async fn enable_incremental_vacuum(&self) -> Result<()> {
        let mut conn = self.pool.acquire().await?;
        sqlx::raw_sql("PRAGMA auto_vacuum = INCREMENTAL").execute(&mut *conn).await?;
        sqlx::raw_sql("VACUUM").execute(&mut *conn).await?;
        Ok(())
    }

    /// One batch of job pruning: one `BEGIN IMMEDIATE` transaction that deletes and raises the
    /// queue's epoch floor.
    async fn prune_jobs_batch(&self, queue: &QueueName, state: &str, age: Duration, batch: u32) -> Result<u64> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let epochs: Vec<i64> = sqlx::query_scalar(sql(&self.stmts.prune_jobs))
            .bind(queue.as_str().to_owned())
            .bind(state.to_owned())
            .bind(crate::retention::age_ms(age))
            .bind(i64::from(batch))
            .fetch_all(&mut *tx)
            .await?;
        if let Some(floor) = epochs.iter().max() {
            sqlx::query(sql(&self.stmts.raise_floor))
                .bind(queue.as_str().to_owned())
                .bind(*floor)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(epochs.len() as u64)
    }

    /// Prunes the ledger rows of `scope` older than `age`: (rows, batches).
    pub(crate) async fn prune_ledger_scope(
        &self,
        scope: &str,
        age: Duration,
        batch: u32,
        pause: Duration,
    ) -> Result<(u64, u64)> {
        let (mut rows, mut batches) = (0u64, 0u64);
        loop {
            let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
            let n = sqlx::query(sql(&self.stmts.prune_ledger))
                .bind(scope.to_owned())
                .bind(crate::retention::age_ms(age))
                .bind(i64::from(batch))
                .execute(&mut *tx)
                .await?
                .rows_affected();
            tx.commit().await?;
            rows += n;
            if n > 0 {
                batches += 1;
            }
            if n < u64::from(batch) {
                return Ok((rows, batches));
            }
            tokio::time::sleep(pause).await;
        }
    }

    pub(super) async fn prune_all(&self, retention: &crate::Retention) -> Result<crate::PruneReport> {
        let mut report = crate::PruneReport::default();
        let batch = retention.get_batch_size();
        for (queue, state, age) in retention.targets() {
            loop {
                let n = self.prune_jobs_batch(queue, state, age, batch).await?;
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
                tokio::time::sleep(retention.get_pause_between_batches()).await;
            }
        }
        for (scope, age) in retention.ledger_scopes() {
            let (rows, batches) =
                self.prune_ledger_scope(scope, age, batch, retention.get_pause_between_batches()).await?;
            report.ledger += rows;
            report.batches += batches;
        }
        // The dashboard's rows are the operators' view, not the fence's: a failure here is logged
        // and leaves the jobs' pruning reported.
        match crate::admin::prune_sqlite(self, retention.get_dashboard_age(), batch).await {
            Ok(n) => report.dashboard = n,
            Err(e) => tracing::warn!(error = %e, "could not prune the dashboard's activity and fence events"),
        }
        Ok(report)
    }
}
