//! The table queue: jobs live in the fence's own table (PostgreSQL, or SQLite on one host), so
//! no broker is needed. The claim *is* the receive: `claim_next` takes due rows with
//! `FOR UPDATE SKIP LOCKED` and hands the runtime deliveries that are already claimed.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use fence::{FenceStore, QueueName};

use crate::builder::setters;
use crate::runtime::ReceiveContext;
use crate::source::{Incoming, Source, SourceError};

/// A table-queue source over any [`FenceStore`]: [`PgFence`](fence::PgFence) or
/// [`SqliteFence`](fence::SqliteFence) alike. Also at `brokerfence::TableQueue` and
/// `brokerfence::TableQueue`.
///
/// ```no_run
/// # async fn demo() -> brokerfence::Result<()> {
/// use std::sync::Arc;
/// use brokerfence::{FenceStore, JobKey, PgFence, QueueName};
/// let store = Arc::new(PgFence::connect("postgres://postgres@127.0.0.1/test").await?);
/// store.migrate().await?;
/// let q = QueueName::new("thumbnails")?;
/// store.enqueue(&q, &JobKey::new("img-1")?, b"{\"w\":128}").await?;
/// let source = brokerfence::TableQueue::new(store, q);
/// # let _ = source; Ok(()) }
/// ```
#[derive(Clone)]
pub struct TableQueue {
    store: Arc<dyn FenceStore>,
    queue: QueueName,
    idle_wait: Duration,
}

impl std::fmt::Debug for TableQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableQueue").field("queue", &self.queue).field("backend", &self.store.backend().name()).finish()
    }
}

impl TableQueue {
    /// A source for `queue`; when nothing is due it polls again after 100 ms.
    pub fn new(store: Arc<dyn FenceStore>, queue: QueueName) -> Self {
        Self { store, queue, idle_wait: Duration::from_millis(100) }
    }

    setters! {
        /// How long to wait before asking again when nothing was due.
        pub fn idle_wait(wait: Duration) { idle_wait = wait }
    }
}

#[async_trait]
impl Source for TableQueue {
    /// The table queue needs no broker handle: the lease is the whole identity.
    type Delivery = ();

    fn queue(&self) -> &QueueName {
        &self.queue
    }

    fn kind(&self) -> &'static str {
        "table"
    }

    /// 64: the receive is the claim statement, so this is how many jobs one statement may hand
    /// out. A statement costs the database far more than a row does, and 64 is what a plain
    /// `FOR UPDATE SKIP LOCKED` loop usually claims at once; the consumer never asks for more
    /// than it has free places for.
    fn default_batch(&self) -> usize {
        64
    }

    /// Up to 4 `claim_next` statements at once: with 128 places and batches of 64, one claim
    /// statement waiting on the database would otherwise leave every place freed meanwhile idle
    /// until it returns. `FOR UPDATE SKIP LOCKED` keeps concurrent claims off each other's rows.
    /// An idle queue is polled by as many receives (each waits
    /// [`idle_wait`](Self::idle_wait) after finding nothing).
    fn receives_in_flight(&self) -> usize {
        4
    }

    /// Twice `concurrency`, at most 256 (four batches): jobs are claimed ahead of the handlers,
    /// so a handler that returns starts the next claimed job at once instead of standing idle
    /// while a claim statement goes to the database and back. Without places ahead a slot was
    /// held through the whole round trip (2–2.6 ms per claim of ~60 jobs on the 2-core machine
    /// under load), and at concurrency 128 a consumer at its defaults reached 0.62–0.69 of a
    /// plain `FOR UPDATE SKIP LOCKED` loop. Measured at 128 (`bench --defaults --prefetch N`,
    /// paired): 64 places ahead 0.78–0.82, 128 0.89–0.91, 256 0.93–0.95; at 16 and 64 twice the
    /// concurrency measured the same as once (1.46–1.52 and 1.41–1.43). The cost: a busy worker
    /// holds up to this many claimed jobs waiting (each under a heartbeated lease, its attempt
    /// counted) that another worker cannot take meanwhile; at shutdown the ones not started are
    /// released without spending an attempt. `ConsumerConfig::prefetch(0)` turns it off.
    fn default_prefetch(&self, concurrency: usize) -> usize {
        concurrency.saturating_mul(2).min(4 * self.default_batch())
    }

    async fn receive(&self, max: usize, ctx: &ReceiveContext) -> Result<Vec<Incoming<()>>, SourceError> {
        let n = u32::try_from(max).unwrap_or(u32::MAX);
        let jobs = self
            .store
            .claim_next(&self.queue, &ctx.owner, ctx.lease, n)
            .await
            .map_err(|e| SourceError::Transient(Box::new(e)))?;
        if jobs.is_empty() {
            tokio::time::sleep(self.idle_wait).await;
        }
        Ok(jobs.into_iter().map(|job| Incoming::Claimed { delivery: (), job }).collect())
    }
}
