//! The [`FenceStore`] implementation of [`SqliteFence`]: claims, heartbeats and commits under
//! `BEGIN IMMEDIATE`.

use async_trait::async_trait;
use sqlx::{AssertSqlSafe, Connection};
use tracing::Instrument;

use super::SqliteFence;
use super::statements::{MIGRATIONS, NOW, REQUIRED_VERSION, sql};
use crate::error::{FenceError, Result};
use crate::key::{JobKey, Owner, QueueName};
use crate::lease::{
    Claim, ClaimedJob, DbTime, FailOutcome, Heartbeat, JobRecord, Lease, LeaseDuration, RetryPolicy, millis,
};
use crate::schema::render;
use crate::store::claim_outcome;
use crate::store::{
    FenceStore, JobRow, backoff_ms, committed_as, distinct_keys, fail_outcome, job_record, schema_verdict,
    split_heartbeat,
};

type ClaimRow = (String, String, i64, Option<String>, Option<i64>, Option<i64>, i64, Option<i64>);

#[async_trait]
impl FenceStore for SqliteFence {
    async fn migrate(&self) -> Result<()> {
        let s = self.schema.as_str();
        let mut conn = self.pool.acquire().await?;
        // IMMEDIATE takes the write lock at once: concurrent migrators queue behind it.
        let mut tx = conn.begin_with("BEGIN IMMEDIATE").await?;
        sqlx::query(AssertSqlSafe(format!(
            "CREATE TABLE IF NOT EXISTS {s}__migrations (version INTEGER PRIMARY KEY, name TEXT NOT NULL, \
             applied_at INTEGER NOT NULL)"
        )))
        .execute(&mut *tx)
        .await?;
        let applied: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!("SELECT version FROM {s}__migrations")))
            .fetch_all(&mut *tx)
            .await?;
        for m in MIGRATIONS.iter().filter(|m| !applied.contains(&m.version)) {
            for stmt in m.statements {
                sqlx::query(AssertSqlSafe(render(stmt, &self.schema)))
                    .execute(&mut *tx)
                    .await
                    .map_err(|source| FenceError::Migration { version: m.version, name: m.name, source })?;
            }
            sqlx::query(AssertSqlSafe(format!(
                "INSERT INTO {s}__migrations (version, name, applied_at) VALUES (?1, ?2, {NOW})"
            )))
            .bind(m.version)
            .bind(m.name)
            .execute(&mut *tx)
            .await?;
            tracing::info!(schema = s, version = m.version, name = m.name, "applied migration");
        }
        tx.commit().await?;
        Ok(())
    }

    async fn check_schema(&self) -> Result<()> {
        let s = self.schema.as_str();
        let mut conn = self.pool.acquire().await?;
        let exists: i64 = sqlx::query_scalar("SELECT count(*) FROM sqlite_master WHERE type = 'table' AND name = ?1")
            .bind(format!("{s}__migrations"))
            .fetch_one(&mut *conn)
            .await?;
        let found: i64 = if exists == 0 {
            0
        } else {
            sqlx::query_scalar(AssertSqlSafe(format!("SELECT coalesce(max(version), 0) FROM {s}__migrations")))
                .fetch_one(&mut *conn)
                .await?
        };
        schema_verdict(found, REQUIRED_VERSION)
    }

    async fn claim_batch(
        &self,
        queue: &QueueName,
        keys: &[JobKey],
        owner: &Owner,
        lease: LeaseDuration,
    ) -> Result<Vec<Claim>> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let mut outcomes = std::collections::HashMap::new();
        for key in distinct_keys(keys) {
            let q = key.as_str().to_owned();
            let claimed: Option<ClaimRow> = sqlx::query_as(sql(&self.stmts.claim))
                .bind(queue.as_str().to_owned())
                .bind(q.clone())
                .bind(owner.as_str().to_owned())
                .bind(lease.as_millis_i64())
                .bind(self.max_claims)
                .fetch_optional(&mut *tx)
                .await?;
            let row = match claimed {
                Some(row) => row,
                None => {
                    sqlx::query_as(sql(&self.stmts.claim_seen))
                        .bind(queue.as_str().to_owned())
                        .bind(q)
                        .fetch_one(&mut *tx)
                        .await?
                }
            };
            outcomes.insert(key.as_str(), claim_outcome(queue, key, owner, &row)?);
        }
        tx.commit().await?;
        keys.iter()
            .map(|k| {
                outcomes
                    .get(k.as_str())
                    .cloned()
                    .ok_or_else(|| FenceError::Corrupt(format!("no claim outcome for {k}")))
            })
            .collect()
    }

    async fn enqueue_many(&self, queue: &QueueName, jobs: &[(JobKey, Vec<u8>)]) -> Result<u64> {
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let inserted = self.enqueue_many_in(&mut tx, queue, jobs).await?;
        tx.commit().await?;
        if inserted > 0 {
            self.wake.wake(queue.as_str(), std::time::Duration::ZERO);
        }
        Ok(inserted)
    }

    async fn claim_next(
        &self,
        queue: &QueueName,
        owner: &Owner,
        lease: LeaseDuration,
        n: u32,
    ) -> Result<Vec<ClaimedJob>> {
        // The key as bytes: a row written around the fence may hold a key that is not even
        // UTF-8, which must not fail the whole claim (issue #30).
        type Row = (
            i64,
            Vec<u8>,
            String,
            i64,
            Option<i64>,
            Option<i64>,
            i64,
            Option<Vec<u8>>,
            Option<Vec<u8>>,
            // The trace context as bytes, at most 64 and 513: a value written around the fence
            // that is not UTF-8 (or not text) must not fail the claim; it is ignored.
            Option<Vec<u8>>,
            Option<Vec<u8>>,
        );
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let rows: Vec<Row> = sqlx::query_as(sql(&self.stmts.claim_next))
            .bind(queue.as_str().to_owned())
            .bind(owner.as_str().to_owned())
            .bind(lease.as_millis_i64())
            .bind(i64::from(n))
            .bind(self.max_claims)
            .fetch_all(&mut *tx)
            .await?;
        // Rows over the cap on claims were made dead, not claimed. A row whose key `JobKey`
        // refuses is made dead with the reason, in the claim's transaction; its companions are
        // handed out.
        let mut jobs = Vec::with_capacity(rows.len());
        for (rowid, key, state, epoch, lease_until, ttl, attempts, payload, progress, traceparent, tracestate) in rows {
            if state != "running" {
                continue;
            }
            #[cfg(not(feature = "otel"))]
            let _ = (traceparent, tracestate);
            match JobKey::from_bytes(&key) {
                Ok(key) => jobs.push(ClaimedJob {
                    lease: Lease {
                        queue: queue.clone(),
                        key,
                        epoch,
                        owner: owner.clone(),
                        lease_until: DbTime(lease_until.unwrap_or(0)),
                        ttl: millis(ttl.unwrap_or(0)),
                        attempts,
                    },
                    payload: payload.unwrap_or_default(),
                    progress,
                    #[cfg(feature = "otel")]
                    trace: crate::otel::TraceContext::read(
                        traceparent.as_deref().map(String::from_utf8_lossy).as_deref(),
                        tracestate.as_deref().and_then(|s| std::str::from_utf8(s).ok()),
                        "jobs table",
                    ),
                }),
                Err(e) => {
                    tracing::error!(queue = queue.as_str(), key = ?String::from_utf8_lossy(&key), epoch, error = %e, "claimed a job row whose key is not valid: made dead");
                    sqlx::query(sql(&self.stmts.dead_key))
                        .bind(rowid)
                        .bind(crate::key::unusable_key(&e))
                        .bind(owner.as_str().to_owned())
                        .bind(epoch)
                        .execute(&mut *tx)
                        .await?;
                }
            }
        }
        tx.commit().await?;
        Ok(jobs)
    }

    async fn heartbeat(&self, leases: &[Lease], lease: LeaseDuration) -> Result<Heartbeat> {
        if leases.is_empty() {
            return Ok(Heartbeat::default());
        }
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let mut renewed = Vec::with_capacity(leases.len());
        for l in leases {
            let row: Option<(String, String, i64, String, i64, i64)> = sqlx::query_as(sql(&self.stmts.heartbeat))
                .bind(l.queue.as_str().to_owned())
                .bind(l.key.as_str().to_owned())
                .bind(l.epoch)
                .bind(l.owner.as_str().to_owned())
                .bind(lease.as_millis_i64())
                .fetch_optional(&mut *tx)
                .await?;
            renewed.extend(row);
        }
        tx.commit().await?;
        Ok(split_heartbeat(leases, renewed, Vec::new()))
    }

    async fn checkpoint(&self, lease: &Lease, progress: &[u8]) -> Result<()> {
        self.fenced(&self.stmts.checkpoint, lease, |q| q.bind(progress.to_vec())).await.map(drop)
    }

    async fn complete(&self, lease: &Lease, result: &[u8]) -> Result<()> {
        match self.fenced(&self.stmts.complete, lease, |q| q.bind(result.to_vec())).await {
            // Completed under this lease already: its own earlier commit (see `complete_batch`).
            Err(e)
                if e.is_fenced()
                    && self.job(&lease.queue, &lease.key).await?.is_some_and(|j| committed_as(&j, lease, result)) =>
            {
                Ok(())
            }
            other => other.map(drop),
        }
    }

    async fn complete_batch(&self, items: &[(Lease, Vec<u8>)]) -> Result<Vec<Result<()>>> {
        // One transaction: one write-lock acquisition and one WAL commit for the whole batch.
        let mut tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        let mut out = Vec::with_capacity(items.len());
        for (lease, result) in items {
            let row = self.cas_query(&self.stmts.complete, lease).bind(result.clone()).fetch_optional(&mut *tx).await?;
            out.push(match self.fenced_outcome(&mut tx, lease, row).await {
                Ok(_) => Ok(()),
                Err(e) if e.is_fenced() => Err(e),
                Err(e) => return Err(e),
            });
        }
        tx.commit().await?;
        // A refused lease whose job is completed under it committed before (a commit sent again
        // after its answer was lost): committed, not fenced.
        for (i, (lease, result)) in items.iter().enumerate() {
            if out[i].is_err()
                && self.job(&lease.queue, &lease.key).await?.is_some_and(|j| committed_as(&j, lease, result))
            {
                out[i] = Ok(());
            }
        }
        Ok(out)
    }

    async fn fail(&self, lease: &Lease, error: &str, retry: bool, policy: &RetryPolicy) -> Result<FailOutcome> {
        let (base_ms, max_ms) = backoff_ms(policy);
        let error = error.replace('\0', "\u{FFFD}");
        let answer = self
            .fenced(&self.stmts.fail, lease, |q| {
                q.bind(retry).bind(policy.max_attempts).bind(base_ms).bind(error).bind(max_ms)
            })
            .await?;
        let outcome = fail_outcome(&answer)?;
        if let FailOutcome::Retry { retry_in } = outcome {
            self.wake.wake(lease.queue.as_str(), retry_in);
        }
        Ok(outcome)
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        self.fenced(&self.stmts.release, lease, |q| q).await?;
        self.wake.wake(lease.queue.as_str(), std::time::Duration::ZERO);
        Ok(())
    }

    fn wakeups(&self, queue: &QueueName) -> crate::Wakeups {
        self.wake.subscribe(queue.as_str())
    }

    async fn next_due(&self, queue: &QueueName) -> Result<Option<std::time::Duration>> {
        let ms: Option<i64> = sqlx::query_scalar(sql(&self.stmts.next_due))
            .bind(queue.as_str().to_owned())
            .fetch_optional(&self.pool)
            .await?;
        Ok(ms.map(|ms| std::time::Duration::from_millis(u64::try_from(ms).unwrap_or(0))))
    }

    async fn job(&self, queue: &QueueName, key: &JobKey) -> Result<Option<JobRecord>> {
        let row: Option<JobRow> = sqlx::query_as(sql(&self.stmts.job))
            .bind(queue.as_str().to_owned())
            .bind(key.as_str().to_owned())
            .fetch_optional(&self.pool)
            .await?;
        row.map(|row| job_record(queue, key, row)).transpose()
    }

    /// SQLite has one writer at a time: each batch is a `BEGIN IMMEDIATE` transaction, so two
    /// pruners (or a pruner and a claim) never interleave; `contended` is always false.
    async fn prune(&self, retention: &crate::Retention) -> Result<crate::PruneReport> {
        let span = tracing::info_span!("fence.prune", backend = "sqlite", schema = self.schema.as_str());
        let started = std::time::Instant::now();
        let report = self.prune_all(retention).instrument(span.clone()).await?;
        span.in_scope(|| tracing::info!(?report, elapsed = ?started.elapsed(), "prune run"));
        Ok(report)
    }

    async fn record_activity(&self, activity: &crate::admin::Activity) -> Result<()> {
        crate::admin::record_sqlite(self, activity).await
    }

    async fn db_now(&self) -> Result<DbTime> {
        let ms: i64 =
            sqlx::query_scalar("SELECT CAST(unixepoch('subsec') * 1000 AS INTEGER)").fetch_one(&self.pool).await?;
        Ok(DbTime(ms))
    }

    fn backend(&self) -> crate::Backend<'_> {
        crate::Backend::Sqlite(self)
    }
}
