//! The plain baseline of `bench --defaults` and `bench --processes`: an unfenced `FOR UPDATE SKIP
//! LOCKED` loop on a table of its own (no epochs, leases or heartbeats), pipelined the way a tuned
//! loop is, and the way the fenced consumer at its defaults is:
//!
//! - it claims ahead: up to `concurrency + prefetch` jobs claimed and not yet run, with `prefetch`
//!   the table queue's default (twice the concurrency, at most 256);
//! - up to 4 claim statements in flight, each for the places free (lingering up to 2 ms for more),
//!   at most 64 jobs;
//! - each job runs in its own slot as soon as one is free;
//! - finished jobs are marked done in groups: one UPDATE per group of at most 256 keys or a 5 ms
//!   window, whichever comes first (the fence's commit window).
//!
//! Issue #33: the loop it replaces claimed only for free slots and marked each claimed batch done
//! on its own, holding the batch's slots through its claim, its slowest job and its UPDATE, so
//! the ratio fenced / plain measured the fenced consumer's claims ahead more than the fence.

use super::*;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};

/// Most jobs one claim statement takes (the table queue's default batch).
const CLAIM_BATCH: usize = 64;
/// Claim statements in flight at once (the table queue's receives in flight).
const CLAIMS_IN_FLIGHT: usize = 4;
/// How long a claim waits for more free places before it leaves with what it has.
const CLAIM_LINGER: Duration = Duration::from_millis(2);
/// The pause of a claim slot after a claim that found nothing.
const IDLE_WAIT: Duration = Duration::from_millis(5);
/// Most keys one finishing UPDATE marks done.
const FINISH_GROUP: usize = 256;
/// How long a group of finished keys collects before its UPDATE leaves (the commit window).
const FINISH_WINDOW: Duration = Duration::from_millis(5);

/// Jobs claimed ahead of the handlers: the table queue's default prefetch.
pub(crate) fn prefetch(concurrency: usize) -> usize {
    concurrency.saturating_mul(2).min(4 * CLAIM_BATCH)
}

/// Creates the plain loop's table `{schema}.plain` and its index of pending jobs.
pub(crate) async fn create_table(pool: &sqlx::PgPool, s: &str) -> Result<(), String> {
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {s}.plain (queue text NOT NULL, key text NOT NULL, state text NOT NULL DEFAULT 'pending', \
         payload bytea, result bytea, PRIMARY KEY (queue, key))"
    )))
    .execute(pool)
    .await
    .map_err(|e| e.to_string())?;
    sqlx::query(AssertSqlSafe(format!("CREATE INDEX plain_pending ON {s}.plain (queue) WHERE state = 'pending'")))
        .execute(pool)
        .await
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// Enqueues `jobs` jobs on the plain queue `q` (one statement).
pub(crate) async fn fill_plain(pool: &sqlx::PgPool, s: &str, q: &str, jobs: usize) -> Result<(), String> {
    sqlx::query(AssertSqlSafe(format!(
        "INSERT INTO {s}.plain (queue, key, payload) SELECT $1, 'job-' || lpad(i::text, 7, '0'), \
         '{{\"n\":1}}'::bytea FROM generate_series(0, $2 - 1) i"
    )))
    .bind(q)
    .bind(i64::try_from(jobs).map_err(|e| e.to_string())?)
    .execute(pool)
    .await
    .map_err(|e| e.to_string())?;
    Ok(())
}

/// Enqueues the same `jobs` jobs on the fenced queue `q` (`enqueue_many`, 5,000 at a time).
pub(crate) async fn fill_fenced(store: &PgFence, q: &QueueName, jobs: usize) -> Result<(), String> {
    for start in (0..jobs).step_by(5000) {
        let batch: Vec<(JobKey, Vec<u8>)> = (start..(start + 5000).min(jobs))
            .map(|i| JobKey::new(format!("job-{i:07}")).map(|k| (k, b"{\"n\":1}".to_vec())))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        store.enqueue_many(q, &batch).await.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// The pipelined plain loop over one queue of `{schema}.plain`.
#[derive(Clone)]
pub(crate) struct PlainLoop {
    pool: sqlx::PgPool,
    claim: Arc<str>,
    finish: Arc<str>,
    queue: Arc<str>,
    concurrency: usize,
    work: Duration,
}

/// A claimed job waiting for a slot, with the place it holds.
type Claimed = (String, OwnedSemaphorePermit);

impl PlainLoop {
    /// The loop over queue `q` of schema `s` (a validated schema name), each job sleeping `work`.
    pub(crate) fn new(pool: sqlx::PgPool, s: &str, q: &str, concurrency: usize, work: Duration) -> Self {
        let claim = format!(
            "UPDATE {s}.plain t SET state = 'running' WHERE (t.queue, t.key) IN (SELECT queue, key FROM {s}.plain \
             WHERE queue = $1 AND state = 'pending' LIMIT $2 FOR UPDATE SKIP LOCKED) RETURNING t.key, t.payload"
        );
        let finish =
            format!("UPDATE {s}.plain SET state = 'done', result = 'ok' WHERE queue = $1 AND key = ANY($2::text[])");
        Self { pool, claim: claim.into(), finish: finish.into(), queue: q.into(), concurrency, work }
    }

    /// Runs jobs until `stop` (or a failed statement), adding the jobs marked done to `done`.
    /// Claims in flight when it stops still run their jobs and mark them done. Answers the
    /// statements sent: claims, including those that found nothing, and finishes.
    pub(crate) async fn run(&self, stop: CancellationToken, done: Arc<AtomicU64>) -> Result<u64, String> {
        let statements = Arc::new(AtomicU64::new(0));
        let halt = stop.child_token();
        let (ready_tx, ready_rx) = mpsc::unbounded_channel::<Claimed>();
        let (finished_tx, finished_rx) = mpsc::unbounded_channel::<String>();
        let finisher =
            tokio::spawn(self.clone().finish_groups(finished_rx, done, Arc::clone(&statements), halt.clone()));
        let runner = tokio::spawn(run_jobs(ready_rx, finished_tx, self.concurrency, self.work));
        let claimed = self.claim_ahead(ready_tx, &halt, &statements).await;
        let ran = runner.await.map_err(|e| e.to_string()).and_then(|r| r);
        let finished = finisher.await.map_err(|e| e.to_string()).and_then(|r| r);
        claimed.and(ran).and(finished)?;
        Ok(statements.load(Ordering::Relaxed))
    }

    /// Keeps up to `concurrency + prefetch` jobs claimed, with up to 4 claims in flight.
    async fn claim_ahead(
        &self,
        ready: mpsc::UnboundedSender<Claimed>,
        stop: &CancellationToken,
        statements: &Arc<AtomicU64>,
    ) -> Result<(), String> {
        let places = Arc::new(Semaphore::new(self.concurrency + prefetch(self.concurrency)));
        let in_flight = Arc::new(Semaphore::new(CLAIMS_IN_FLIGHT));
        let mut claims = tokio::task::JoinSet::new();
        loop {
            while let Some(r) = claims.try_join_next() {
                r.map_err(|e| e.to_string())??;
            }
            let slot = tokio::select! {
                s = Arc::clone(&in_flight).acquire_owned() => s.map_err(|e| e.to_string())?,
                _ = stop.cancelled() => break,
            };
            let mut held = tokio::select! {
                p = Arc::clone(&places).acquire_owned() => p.map_err(|e| e.to_string())?,
                _ = stop.cancelled() => break,
            };
            // The places free now, and those that free up within the linger, up to a batch.
            let deadline = tokio::time::Instant::now() + CLAIM_LINGER;
            while held.num_permits() < CLAIM_BATCH {
                let more = (CLAIM_BATCH - held.num_permits()).min(places.available_permits());
                if let Some(p) = u32::try_from(more)
                    .ok()
                    .filter(|n| *n > 0)
                    .and_then(|n| Arc::clone(&places).try_acquire_many_owned(n).ok())
                {
                    held.merge(p);
                    continue;
                }
                match tokio::time::timeout_at(deadline, Arc::clone(&places).acquire_owned()).await {
                    Ok(p) => held.merge(p.map_err(|e| e.to_string())?),
                    Err(_) => break,
                }
            }
            claims.spawn(self.clone().claim(held, slot, ready.clone(), Arc::clone(statements)));
        }
        while let Some(r) = claims.join_next().await {
            r.map_err(|e| e.to_string())??;
        }
        Ok(())
    }

    /// One claim statement for as many jobs as `held` has places; each claimed job goes to the
    /// runner with one place, the rest go back at once.
    async fn claim(
        self,
        mut held: OwnedSemaphorePermit,
        _in_flight: OwnedSemaphorePermit,
        ready: mpsc::UnboundedSender<Claimed>,
        statements: Arc<AtomicU64>,
    ) -> Result<(), String> {
        let n = i64::try_from(held.num_permits()).map_err(|e| e.to_string())?;
        let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(Arc::clone(&self.claim)))
            .bind(&*self.queue)
            .bind(n)
            .fetch_all(&self.pool)
            .await
            .map_err(|e| e.to_string())?;
        statements.fetch_add(1, Ordering::Relaxed);
        if rows.is_empty() {
            drop(held);
            tokio::time::sleep(IDLE_WAIT).await;
            return Ok(());
        }
        for (key, _payload) in rows {
            let Some(place) = held.split(1) else { break };
            if ready.send((key, place)).is_err() {
                break;
            }
        }
        Ok(())
    }

    /// Marks finished jobs done, one UPDATE per group (at most 256 keys or a 5 ms window).
    /// A failed UPDATE stops the claims (`halt`).
    async fn finish_groups(
        self,
        mut finished: mpsc::UnboundedReceiver<String>,
        done: Arc<AtomicU64>,
        statements: Arc<AtomicU64>,
        halt: CancellationToken,
    ) -> Result<(), String> {
        let mut group = Vec::with_capacity(FINISH_GROUP);
        while let Some(first) = finished.recv().await {
            group.push(first);
            let deadline = tokio::time::Instant::now() + FINISH_WINDOW;
            while group.len() < FINISH_GROUP {
                match tokio::time::timeout_at(deadline, finished.recv()).await {
                    Ok(Some(key)) => group.push(key),
                    Ok(None) | Err(_) => break,
                }
            }
            let sent = sqlx::query(AssertSqlSafe(Arc::clone(&self.finish)))
                .bind(&*self.queue)
                .bind(&group)
                .execute(&self.pool)
                .await;
            if let Err(e) = sent {
                halt.cancel();
                return Err(e.to_string());
            }
            statements.fetch_add(1, Ordering::Relaxed);
            done.fetch_add(group.len() as u64, Ordering::Relaxed);
            group.clear();
        }
        Ok(())
    }
}

/// Runs each claimed job in its own slot (at most `concurrency` at once) as soon as one is free,
/// and hands its key to the finisher. Returns once the claims are over and every job has run.
async fn run_jobs(
    mut ready: mpsc::UnboundedReceiver<Claimed>,
    finished: mpsc::UnboundedSender<String>,
    concurrency: usize,
    work: Duration,
) -> Result<(), String> {
    let slots = Arc::new(Semaphore::new(concurrency));
    while let Some((key, place)) = ready.recv().await {
        let slot = Arc::clone(&slots).acquire_owned().await.map_err(|e| e.to_string())?;
        let finished = finished.clone();
        tokio::spawn(async move {
            tokio::time::sleep(work).await;
            let _ = finished.send(key);
            drop((slot, place));
        });
    }
    // Every job has run once every slot is back.
    let all = u32::try_from(concurrency).map_err(|e| e.to_string())?;
    let _all = slots.acquire_many(all).await.map_err(|e| e.to_string())?;
    Ok(())
}

/// A drain of the plain queue: runs the loop until `jobs` are done (or it fails; at most 600 s).
/// Answers its statements and the instant the last job was done (before the loop's shutdown).
pub(crate) async fn drain(looped: PlainLoop, jobs: usize) -> Result<(u64, Instant), String> {
    let (stop, done) = (CancellationToken::new(), Arc::new(AtomicU64::new(0)));
    let run = tokio::spawn({
        let (stop, done) = (stop.clone(), Arc::clone(&done));
        async move { looped.run(stop, done).await }
    });
    let reached = wait_until("the plain drain", Duration::from_secs(600), || {
        done.load(Ordering::Relaxed) >= jobs as u64 || run.is_finished()
    })
    .await;
    let done_at = Instant::now();
    stop.cancel();
    let statements = run.await.map_err(|e| e.to_string())??;
    reached?;
    match done.load(Ordering::Relaxed) {
        n if n >= jobs as u64 => Ok((statements, done_at)),
        n => Err(format!("the plain drain stopped after {n} of {jobs} jobs")),
    }
}
