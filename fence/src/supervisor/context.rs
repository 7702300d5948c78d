//! What a handler sees of its attempt: [`JobContext`].

use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio_util::sync::CancellationToken;

use super::outcome::LossReason;
use super::registry::SlotState;
use crate::error::{FenceError, Result};
use crate::lease::Lease;
use crate::metrics::{Counter, Metrics};
use crate::own_tx::FencedConnection;
use crate::store::FenceStore;
use crate::{JobKey, Owner, QueueName};

/// What a handler sees of its attempt.
#[derive(Clone)]
pub struct JobContext {
    pub(super) lease: Lease,
    pub(super) payload: Arc<[u8]>,
    pub(super) progress: Option<Arc<[u8]>>,
    pub(super) slot: Arc<SlotState>,
    pub(super) store: Arc<dyn FenceStore>,
    pub(super) metrics: Arc<Metrics>,
}

impl std::fmt::Debug for JobContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JobContext").field("lease", &self.lease).field("payload_len", &self.payload.len()).finish()
    }
}

impl JobContext {
    /// The queue.
    pub fn queue(&self) -> &QueueName {
        &self.lease.queue
    }
    /// The job key.
    pub fn key(&self) -> &JobKey {
        &self.lease.key
    }
    /// The fencing token of this attempt: send it with every downstream call.
    pub fn epoch(&self) -> i64 {
        self.lease.epoch
    }
    /// This worker.
    pub fn owner(&self) -> &Owner {
        &self.lease.owner
    }
    /// The lease as claimed.
    pub fn lease(&self) -> &Lease {
        &self.lease
    }
    /// The payload of the delivery.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }
    /// The last checkpoint of an earlier attempt, if any.
    pub fn progress(&self) -> Option<&[u8]> {
        self.progress.as_deref()
    }
    /// Fires when the lease is lost: pass it to work the handler spawns.
    pub fn cancellation(&self) -> CancellationToken {
        self.slot.token.clone()
    }
    /// True once the lease is lost.
    pub fn is_cancelled(&self) -> bool {
        self.slot.token.is_cancelled()
    }

    /// The fencing stamp to send with every downstream call of this attempt (see [`crate::wire`]).
    ///
    /// ```no_run
    /// # fn demo(ctx: brokerfence::JobContext) {
    /// for (name, value) in ctx.stamp().to_headers() {
    ///     println!("{name}: {value}"); // e.g. request.header(name, value)
    /// }
    /// # }
    /// ```
    pub fn stamp(&self) -> crate::wire::FenceStamp {
        crate::wire::FenceStamp::from(&self.lease)
    }

    /// Stores progress under the lease. A `Fenced` answer also cancels this attempt.
    ///
    /// ```no_run
    /// # async fn handler(ctx: brokerfence::JobContext) -> Result<Vec<u8>, brokerfence::JobError> {
    /// ctx.checkpoint(b"page 3 of 10").await?; // a FenceError: the attempt fails (retried)
    /// # Ok(vec![]) }
    /// ```
    pub async fn checkpoint(&self, progress: &[u8]) -> Result<()> {
        match self.store.checkpoint(&self.lease, progress).await {
            Err(e @ FenceError::Fenced { .. }) => {
                self.metrics.incr(Counter::FencedRejections);
                self.slot.lose(LossReason::Superseded);
                Err(e)
            }
            other => other,
        }
    }

    /// Commits this attempt's result inside the handler's own transaction (`conn`: a
    /// `sqlx::PgConnection` for a [`PgFence`](crate::PgFence), a `sqlx::SqliteConnection` for a
    /// [`SqliteFence`](crate::SqliteFence)), so that the handler's rows and the fenced completion
    /// commit together or not at all. Once the handler returns, the supervisor reads the job row
    /// (one grouped statement for the attempts returning meanwhile, like the group commit)
    /// instead of committing the returned bytes: completed under this epoch means
    /// [`Outcome::Completed`](crate::Outcome::Completed) (the delivery is acknowledged, no second commit); still running under
    /// it means the transaction did not commit, and the attempt counts as failed (retried).
    ///
    /// A [`Fenced`](FenceError::Fenced) answer means a newer epoch holds the job: the transaction
    /// can no longer commit (PostgreSQL aborts it, SQLite is left with a deferred violation), and
    /// this attempt is cancelled like any superseded one. Call it last, right before `COMMIT`:
    /// from then on the transaction holds the job's row lock, which no claim can pass, but the
    /// lease's end does not move either ([`Heartbeat::held`](crate::Heartbeat::held)): past the
    /// worker-side deadline the handler is cancelled and its transaction dropped (rolled back).
    ///
    /// ```no_run
    /// # async fn handler(ctx: brokerfence::JobContext, pool: sqlx::PgPool) -> Result<Vec<u8>, brokerfence::JobError> {
    /// let mut tx = pool.begin().await?; // `?` on any error: the attempt fails and is retried
    /// sqlx::query("INSERT INTO invoices (job, epoch) VALUES ($1, $2)")
    ///     .bind(ctx.key().as_str())
    ///     .bind(ctx.epoch())
    ///     .execute(&mut *tx)
    ///     .await?;
    /// ctx.complete_in(&mut *tx, b"invoiced").await?;
    /// tx.commit().await?;
    /// Ok(Vec::new()) // not stored: the result given to complete_in is
    /// # }
    /// ```
    pub async fn complete_in<C: FencedConnection + ?Sized>(&self, conn: &mut C, result: &[u8]) -> Result<()> {
        // Set before the statement goes out: whatever its answer, the row decides afterwards.
        self.slot.own_commit.store(true, Ordering::Release);
        match conn.complete_on(self.store.backend(), &self.lease, result).await {
            Err(e @ FenceError::Fenced { .. }) => {
                self.metrics.incr(Counter::FencedRejections);
                self.slot.lose(LossReason::Superseded);
                Err(e)
            }
            other => other,
        }
    }
}
