//! The [`FenceStore`] implementation of [`PgFence`]: batched claims, heartbeats, commits.

use async_trait::async_trait;
use sqlx::AssertSqlSafe;
use tracing::Instrument;

use super::migrations::{MIGRATIONS, REQUIRED_VERSION};
use super::rounds::{ClaimRow, claim_rounds};
use super::statements::{detached, lease_columns, sql};
use super::{Lane, PgFence};
use crate::error::{FenceError, Result};
use crate::key::{JobKey, Owner, QueueName};
use crate::lease::{
    Claim, ClaimedJob, DbTime, FailOutcome, Heartbeat, JobRecord, Lease, LeaseDuration, RetryPolicy, millis,
};
use crate::store::{
    FenceStore, JobRow, backoff_ms, committed_as, fail_outcome, job_record, schema_verdict, split_heartbeat,
};

impl PgFence {
    /// One renewal statement for `leases` on the heartbeat connections, detached from the caller.
    async fn renew(&self, leases: &[Lease], lease: LeaseDuration) -> Result<Heartbeat> {
        if leases.is_empty() {
            return Ok(Heartbeat::default());
        }
        type Row = (String, String, i64, String, Option<i64>, Option<i64>, bool);
        let ms = Some(lease.as_millis_i64());
        let rows: Vec<Row> = self.lease_statement(Lane::Heartbeat, &self.stmts.heartbeat, leases, ms).await?;
        let (mut renewed, mut held) = (Vec::with_capacity(rows.len()), Vec::new());
        for (queue, key, epoch, owner, until, ttl, was_renewed) in rows {
            match (was_renewed, until, ttl) {
                (true, Some(until), Some(ttl)) => renewed.push((queue, key, epoch, owner, until, ttl)),
                _ => held.push((queue, key, epoch, owner)),
            }
        }
        Ok(split_heartbeat(leases, renewed, held))
    }

    /// The rows of `statement` run with the identity columns of `leases` (`$1`–`$4`: queues,
    /// keys, epochs, owners) and, when given, `lease_ms` (`$5`), on a session of `lane`, in a task
    /// of its own (see [`detached`]).
    async fn lease_statement<R>(
        &self,
        lane: Lane,
        statement: &std::sync::Arc<str>,
        leases: &[Lease],
        lease_ms: Option<i64>,
    ) -> Result<Vec<R>>
    where
        R: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin + 'static,
    {
        let (queues, keys, epochs, owners) = lease_columns(leases);
        let (fence, statement) = (self.clone(), sql(statement));
        detached(async move {
            let mut session = fence.session(lane).await?;
            let mut query = sqlx::query_as(statement)
                .persistent(fence.persistent())
                .bind(queues)
                .bind(keys)
                .bind(epochs)
                .bind(owners);
            if let Some(ms) = lease_ms {
                query = query.bind(ms);
            }
            let rows = query.fetch_all(&mut *session).await?;
            session.done().await?;
            Ok(rows)
        })
        .await
    }

    /// Whether the job of `lease` is completed under it with `result` (its own commit, whose
    /// answer was lost: see [`FenceStore::complete`]).
    async fn committed_as(&self, lease: &Lease, result: &[u8]) -> Result<bool> {
        Ok(FenceStore::job(self, &lease.queue, &lease.key).await?.is_some_and(|job| committed_as(&job, lease, result)))
    }

    async fn claim_round(
        &self,
        queue: &QueueName,
        keys: &[String],
        owner: &Owner,
        lease: LeaseDuration,
    ) -> Result<Vec<ClaimRow>> {
        let mut session = self.session(Lane::Main).await?;
        let rows = sqlx::query_as::<_, ClaimRow>(sql(&self.stmts.claim))
            .persistent(self.persistent())
            .bind(queue.as_str().to_owned())
            .bind(keys.to_vec())
            .bind(owner.as_str().to_owned())
            .bind(lease.as_millis_i64())
            .bind(self.max_claims)
            .fetch_all(&mut *session)
            .await?;
        session.done().await?;
        Ok(rows)
    }

    /// Makes the row `key` that this claim took at `epoch` dead, naming why its key is unusable
    /// (`refused`). Its lease is this claim's: a failure here leaves it to run out, and the next
    /// claim of the row tries again; it is logged, not returned (the claim's other rows are the
    /// caller's either way).
    async fn dead_key(&self, queue: &QueueName, owner: &Owner, key: String, epoch: i64, refused: &FenceError) {
        let why = crate::key::unusable_key(refused);
        tracing::error!(queue = queue.as_str(), key = ?key, epoch, error = %refused, "claimed a job row whose key is not valid: made dead");
        let answer: Result<()> = async {
            let mut session = self.session(Lane::Main).await?;
            let (matched, ..): super::FencedRow = sqlx::query_as(sql(&self.stmts.dead_key))
                .persistent(self.persistent())
                .bind(queue.as_str().to_owned())
                .bind(key.clone())
                .bind(owner.as_str().to_owned())
                .bind(epoch)
                .bind(why)
                .fetch_one(&mut *session)
                .await?;
            session.done().await?;
            if matched == 0 {
                tracing::warn!(queue = queue.as_str(), key = ?key, epoch, "a job row with an invalid key changed before it was made dead");
            }
            Ok(())
        }
        .await;
        if let Err(e) = answer {
            tracing::warn!(queue = queue.as_str(), key = ?key, error = %self.seen(e), "could not make a job row with an invalid key dead; its lease runs out");
        }
    }

    /// One `claim_next` statement for up to `n` jobs of `queue`, reading from `from` (the claim
    /// cursor; `None`: from the start), recorded in the cursor.
    async fn claim_next_from(
        &self,
        queue: &QueueName,
        owner: &Owner,
        lease: LeaseDuration,
        n: u32,
        from: Option<i64>,
    ) -> Result<Vec<NextRow>> {
        use futures::TryStreamExt as _;
        let mut session = self.session(Lane::Main).await?;
        // Room for the whole batch at once: a row is 200 bytes, and a vector grown row by row
        // is reallocated and copied at every doubling (4 times for 64 rows).
        let mut rows: Vec<NextRow> = Vec::with_capacity(n.min(1024) as usize);
        {
            let mut fetched = sqlx::query_as(sql(&self.stmts.claim_next))
                .persistent(self.persistent())
                .bind(queue.as_str().to_owned())
                .bind(owner.as_str().to_owned())
                .bind(lease.as_millis_i64())
                .bind(i64::from(n))
                .bind(self.max_claims)
                .bind(from)
                .fetch(&mut *session);
            while let Some(row) = fetched.try_next().await? {
                rows.push(row);
            }
        }
        session.done().await?;
        let run_at: Vec<i64> = rows.iter().map(|row| row.8).collect();
        self.cursors.claimed(queue.as_str(), from, n, &run_at);
        Ok(rows)
    }
}

/// A row of `claim_next`: key, state, epoch, lease_until ms, ttl ms, attempts, payload,
/// progress, run_at µs, traceparent, tracestate (read with the feature `otel`).
#[rustfmt::skip]
type NextRow = (String, String, i64, Option<i64>, Option<i64>, i64, Option<Vec<u8>>, Option<Vec<u8>>, i64, Option<String>, Option<String>);

#[async_trait]
impl FenceStore for PgFence {
    /// Applies the pending migrations online: each catalog change in its own short transaction
    /// that waits at most the migration lock timeout (200 ms by default) for its table locks, so
    /// that the exclusive lock a schema change asks for never sits in the lock queue holding up
    /// live claims, commits and heartbeats for longer than that; on a lock timeout it backs off
    /// and tries again (see [`PgFence::migration_lock_timeout`]). Migrations add columns with
    /// constant defaults (no table rewrite); indexes are built CONCURRENTLY, backfills run in
    /// batches, CHECKs are validated apart (see `postgres/migrations/`), and an interrupted
    /// migration is resumed from its first step, which are all idempotent. The limit that remains: once granted, migration 2
    /// (byte-order keys) holds its exclusive lock while it rebuilds the indexes on the key
    /// columns, which takes time in proportion to the table (milliseconds for thousands of rows,
    /// seconds for millions); statements on the table wait that long. Migration 2 also changes
    /// the collation of the key columns, and workers of releases before this one return those
    /// columns from prepared statements: on each of their open connections those statements then
    /// fail with "cached plan must not change result type" until the connection is replaced, so
    /// stop (or restart) such workers around a migration from version 1. This release's
    /// statements return key columns as `COLLATE "C"` and are not affected.
    async fn migrate(&self) -> Result<()> {
        let answer: Result<_> = async {
            let s = self.schema.as_str();
            // Fast path, and the one a role without CREATE on the database takes: when every
            // migration is recorded already there is nothing to lock or create. A role that may not
            // read the record falls through and gets the database's permission error below.
            let mut session = self.session(Lane::Main).await?;
            let recorded: std::result::Result<Vec<i64>, _> =
                sqlx::query_scalar(AssertSqlSafe(format!("SELECT version FROM {s}._migrations")))
                    .persistent(false)
                    .fetch_all(&mut *session)
                    .await;
            drop(session);
            if let Ok(applied) = recorded
                && MIGRATIONS.iter().all(|m| applied.contains(&m.version))
            {
                return Ok(());
            }
            self.migrate_to(REQUIRED_VERSION).await
        }
        .await;
        answer.map_err(|e| self.seen(e))
    }

    async fn check_schema(&self) -> Result<()> {
        let answer: Result<_> = async {
            let s = self.schema.as_str();
            let mut session = self.session(Lane::Main).await?;
            let found: std::result::Result<i64, sqlx::Error> = sqlx::query_scalar(AssertSqlSafe(format!(
                "SELECT coalesce(max(version), 0)::bigint FROM {s}._migrations"
            )))
            .persistent(false)
            .fetch_one(&mut *session)
            .await;
            drop(session);
            let found = match found {
                Ok(v) => v,
                // 42P01 undefined_table, 3F000 invalid_schema_name: no schema yet.
                Err(sqlx::Error::Database(db)) if matches!(db.code().as_deref(), Some("42P01" | "3F000")) => 0,
                Err(e) => return Err(e.into()),
            };
            schema_verdict(found, REQUIRED_VERSION)
        }
        .await;
        answer.map_err(|e| self.seen(e))
    }

    async fn claim_batch(
        &self,
        queue: &QueueName,
        keys: &[JobKey],
        owner: &Owner,
        lease: LeaseDuration,
    ) -> Result<Vec<Claim>> {
        let answer: Result<_> = async {
            claim_rounds(queue, keys, owner, |todo| async move { self.claim_round(queue, &todo, owner, lease).await })
                .await
        }
        .await;
        answer.map_err(|e| self.seen(e))
    }

    async fn enqueue_many(&self, queue: &QueueName, jobs: &[(JobKey, Vec<u8>)]) -> Result<u64> {
        let answer: Result<_> = async {
            let mut session = self.session(Lane::Main).await?;
            let new = self.enqueue_on(&mut *session, queue, jobs, false).await?;
            session.done().await?;
            if new > 0 {
                self.wake_here(queue, std::time::Duration::ZERO);
            }
            Ok(new)
        }
        .await;
        answer.map_err(|e| self.seen(e))
    }

    async fn claim_next(
        &self,
        queue: &QueueName,
        owner: &Owner,
        lease: LeaseDuration,
        n: u32,
    ) -> Result<Vec<ClaimedJob>> {
        let answer: Result<_> = async {
            let from = self.cursors.start(queue.as_str());
            let mut rows = self.claim_next_from(queue, owner, lease, n, from).await?;
            // Fewer than asked from the cursor: the rest may be behind it (a lease that ran out, a
            // row skipped while locked). Scan from the start for them in the same call, so that a
            // claim that answers fewer than `n` has looked at the whole queue. The jobs claimed so
            // far are the caller's either way: a failure of this second statement is logged, not
            // returned (their leases would otherwise run out unused).
            let got = u32::try_from(rows.len()).unwrap_or(u32::MAX);
            if from.is_some() && got < n {
                match self.claim_next_from(queue, owner, lease, n - got, None).await {
                    Ok(more) => rows.extend(more),
                    Err(e) if rows.is_empty() => return Err(e),
                    Err(e) => tracing::warn!(error = %e, queue = queue.as_str(), "claim from the queue's start failed"),
                }
            }
            // Rows over the cap on claims were made dead, not claimed. A row whose key `JobKey`
            // refuses is made dead with the reason (issue #30): the claim committed, so failing
            // the whole answer left its companions to wait out their lease, claim after claim.
            let mut jobs = Vec::with_capacity(rows.len());
            for (key, state, epoch, lease_until, ttl, attempts, payload, progress, _, _tp, _ts) in rows {
                if state != "running" {
                    continue;
                }
                match JobKey::try_from(key.as_str()) {
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
                        trace: crate::otel::TraceContext::read(_tp.as_deref(), _ts.as_deref(), "jobs table"),
                    }),
                    Err(e) => self.dead_key(queue, owner, key, epoch, &e).await,
                }
            }
            Ok(jobs)
        }
        .await;
        answer.map_err(|e| self.seen(e))
    }

    /// Never waits on a row lock: see [`Heartbeat::held`].
    async fn heartbeat(&self, leases: &[Lease], lease: LeaseDuration) -> Result<Heartbeat> {
        self.renew(leases, lease).await.map_err(|e| self.seen(e))
    }

    async fn checkpoint(&self, lease: &Lease, progress: &[u8]) -> Result<()> {
        let answer: Result<_> = async {
            let mut session = self.session(Lane::Main).await?;
            self.fenced_write(&mut *session, &self.stmts.checkpoint, lease, |q| q.bind(progress.to_vec())).await?;
            session.done().await
        }
        .await;
        answer.map_err(|e| self.seen(e))
    }

    async fn complete(&self, lease: &Lease, result: &[u8]) -> Result<()> {
        let answer: Result<_> = async {
            let mut session = self.session(Lane::Main).await?;
            let answer =
                self.fenced_write(&mut *session, &self.stmts.complete, lease, |q| q.bind(result.to_vec())).await;
            session.done().await?;
            match answer {
                Err(FenceError::Fenced { .. }) if self.committed_as(lease, result).await? => Ok(()),
                other => other.map(drop),
            }
        }
        .await;
        answer.map_err(|e| self.seen(e))
    }

    async fn complete_batch(&self, items: &[(Lease, Vec<u8>)]) -> Result<Vec<Result<()>>> {
        let answer: Result<_> = async {
            if items.is_empty() {
                return Ok(Vec::new());
            }
            // A key twice in one statement would make the UPDATE ambiguous: batch the first of each,
            // send any repeat on its own.
            let mut seen = std::collections::HashSet::with_capacity(items.len());
            let (first, repeats): (Vec<usize>, Vec<usize>) =
                (0..items.len()).partition(|&i| seen.insert((items[i].0.queue.as_str(), items[i].0.key.as_str())));
            // The arrays borrow the items' strings and results: nothing is copied per item before
            // the encoding itself.
            let pick = |f: fn(&Lease) -> &str| first.iter().map(|&i| f(&items[i].0)).collect::<Vec<&str>>();
            let mut session = self.session(Lane::Main).await?;
            let committed: Vec<(i64,)> = sqlx::query_as(sql(&self.stmts.complete_batch))
                .persistent(self.persistent())
                .bind(pick(|l| l.queue.as_str()))
                .bind(pick(|l| l.key.as_str()))
                .bind(pick(|l| l.owner.as_str()))
                .bind(first.iter().map(|&i| items[i].0.epoch).collect::<Vec<i64>>())
                .bind(first.iter().map(|&i| items[i].1.as_slice()).collect::<Vec<&[u8]>>())
                .fetch_all(&mut *session)
                .await?;
            session.done().await?;
            // The statement answers the ordinals (from 1, in the order of `first`) it committed.
            let mut done = vec![false; first.len()];
            for (ordinal,) in committed {
                let slot = usize::try_from(ordinal - 1).ok().and_then(|j| done.get_mut(j));
                *slot.ok_or_else(|| FenceError::Corrupt(format!("batch completion answered ordinal {ordinal}")))? = true;
            }
            let mut out: Vec<Option<Result<()>>> = (0..items.len()).map(|_| None).collect();
            for (&i, committed) in first.iter().zip(done) {
                let lease = &items[i].0;
                out[i] = Some(if committed {
                    Ok(())
                } else {
                    // Refused: name the job's holder now, read after the statement (a row the
                    // statement waited for was compared in its newest version, so the refusal names
                    // the takeover that beat it). The verdict stands either way; a read that fails
                    // (the other items are committed already) names no holder.
                    // A row completed under this very lease is this lease's own earlier commit
                    // (a commit sent again after its answer was lost to a failed connection):
                    // committed, not fenced.
                    let (epoch, owner) = match self.job(&lease.queue, &lease.key).await {
                        Ok(Some(job)) if committed_as(&job, lease, &items[i].1) => {
                            out[i] = Some(Ok(()));
                            continue;
                        }
                        Ok(Some(job)) => (job.epoch, job.owner),
                        Ok(None) => (0, None),
                        Err(e) => {
                            tracing::warn!(error = %e, key = lease.key.as_str(), "could not read the new holder of a fenced job");
                            (0, None)
                        }
                    };
                    Err(FenceError::Fenced {
                        key: lease.key.as_str().to_owned(),
                        epoch: lease.epoch,
                        current_epoch: epoch,
                        current_owner: owner,
                    })
                });
            }
            for &i in &repeats {
                out[i] = Some(match self.complete(&items[i].0, &items[i].1).await {
                    Err(e) if !e.is_fenced() => return Err(e),
                    other => other,
                });
            }
            Ok(out
                .into_iter()
                .map(|r| r.unwrap_or_else(|| Err(FenceError::Corrupt("missing batch answer".into()))))
                .collect())
        }
        .await;
        answer.map_err(|e| self.seen(e))
    }

    async fn fail(&self, lease: &Lease, error: &str, retry: bool, policy: &RetryPolicy) -> Result<FailOutcome> {
        let answer: Result<_> = async {
            let (base_ms, max_ms) = backoff_ms(policy);
            let error: String = error.replace('\0', "\u{FFFD}");
            let mut session = self.session(Lane::Main).await?;
            let answer = self
                .fenced_write(&mut *session, &self.stmts.fail, lease, |q| {
                    q.bind(retry).bind(policy.max_attempts).bind(base_ms).bind(error).bind(max_ms)
                })
                .await?;
            session.done().await?;
            let outcome = fail_outcome(answer.as_deref().unwrap_or_default())?;
            if let FailOutcome::Retry { retry_in } = outcome {
                self.wake_here(&lease.queue, retry_in);
            }
            Ok(outcome)
        }
        .await;
        answer.map_err(|e| self.seen(e))
    }

    async fn release(&self, lease: &Lease) -> Result<()> {
        let answer: Result<_> = async {
            let mut session = self.session(Lane::Main).await?;
            self.fenced_write(&mut *session, &self.stmts.release, lease, |q| q).await?;
            session.done().await?;
            self.wake_here(&lease.queue, std::time::Duration::ZERO);
            Ok(())
        }
        .await;
        answer.map_err(|e| self.seen(e))
    }

    async fn job(&self, queue: &QueueName, key: &JobKey) -> Result<Option<JobRecord>> {
        let answer: Result<_> = async {
            let (fence, statement) = (self.clone(), sql(&self.stmts.job));
            let (q, k) = (queue.as_str().to_owned(), key.as_str().to_owned());
            let row: Option<JobRow> = detached(async move {
                let mut session = fence.session(Lane::Main).await?;
                let row = sqlx::query_as(statement)
                    .persistent(fence.persistent())
                    .bind(q)
                    .bind(k)
                    .fetch_optional(&mut *session)
                    .await?;
                session.done().await?;
                Ok(row)
            })
            .await?;
            row.map(|row| job_record(queue, key, row)).transpose()
        }
        .await;
        answer.map_err(|e| self.seen(e))
    }

    /// One statement for every lease.
    async fn completed_under(&self, leases: &[Lease]) -> Result<Vec<bool>> {
        let answer: Result<_> = async {
            if leases.is_empty() {
                return Ok(Vec::new());
            }
            let rows: Vec<(i64, bool)> =
                self.lease_statement(Lane::Main, &self.stmts.completed_under, leases, None).await?;
            let mut out = vec![false; leases.len()];
            for (i, completed) in rows {
                let slot = usize::try_from(i - 1).ok().and_then(|i| out.get_mut(i));
                match slot {
                    Some(slot) => *slot = completed,
                    None => return Err(FenceError::Corrupt(format!("completed_under answered for item {i}"))),
                }
            }
            Ok(out)
        }
        .await;
        answer.map_err(|e| self.seen(e))
    }

    async fn prune(&self, retention: &crate::Retention) -> Result<crate::PruneReport> {
        let answer: Result<_> = async {
            let span = tracing::info_span!("fence.prune", backend = "postgres", schema = self.schema.as_str());
            let started = std::time::Instant::now();
            let report = self.prune_all(retention).instrument(span.clone()).await?;
            span.in_scope(|| tracing::info!(?report, elapsed = ?started.elapsed(), "prune run"));
            Ok(report)
        }
        .await;
        answer.map_err(|e| self.seen(e))
    }

    fn wakeups(&self, queue: &QueueName) -> crate::Wakeups {
        self.wake.subscribe(queue.as_str())
    }

    async fn next_due(&self, queue: &QueueName) -> Result<Option<std::time::Duration>> {
        self.read_next_due(queue).await
    }

    async fn record_activity(&self, activity: &crate::admin::Activity) -> Result<()> {
        crate::admin::record_pg(self, activity).await
    }
    async fn db_now(&self) -> Result<DbTime> {
        self.read_db_now().await
    }

    fn backend(&self) -> crate::Backend<'_> {
        crate::Backend::Postgres(self)
    }
}
