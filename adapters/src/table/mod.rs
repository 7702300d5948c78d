//! The table queue: jobs live in the fence's own table (PostgreSQL, or SQLite on one host), so
//! no broker is needed. The claim *is* the receive: `claim_next` takes due rows with
//! `FOR UPDATE SKIP LOCKED` and hands the runtime deliveries that are already claimed.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use fence::{FenceStore, QueueName};

use crate::builder::setters;
use crate::runtime::ReceiveContext;
use crate::source::{Incoming, Source, SourceError};

mod idle;
use idle::Idle;

/// A table-queue source over any [`FenceStore`]: [`PgFence`](fence::PgFence) or
/// [`SqliteFence`](fence::SqliteFence) alike.
///
/// When nothing is due, the consumer waits for a wake-up ([`FenceStore::wakeups`]): on
/// PostgreSQL a notification that an enqueue, release or retry sends when its transaction
/// commits; on SQLite, or behind a transaction-mode pooler, a write through the same store in
/// this process. A retry's backoff sets a timer for when it is due. A poll every
/// [`idle_wait`](Self::idle_wait) (1 s) covers what no wake-up announced (another process's
/// writes without a listener, a notification lost while the listener reconnected, a lease that
/// ran out): at most one claim statement per interval while the queue is idle.
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
    /// The idle state, made at the first receive and shared by every clone (a clone given its
    /// own `idle_wait` gets its own).
    idle: Arc<OnceLock<Idle>>,
}

impl std::fmt::Debug for TableQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TableQueue").field("queue", &self.queue).field("backend", &self.store.backend().name()).finish()
    }
}

impl TableQueue {
    /// A source for `queue`, woken when jobs become due and polling every second otherwise.
    pub fn new(store: Arc<dyn FenceStore>, queue: QueueName) -> Self {
        Self { store, queue, idle_wait: DEFAULT_IDLE_WAIT, idle: Arc::new(OnceLock::new()) }
    }

    setters! {
        /// The fallback poll: how long an idle consumer waits, when no wake-up comes, before it
        /// claims again (default 1 s, so an idle consumer sends at most one statement a
        /// second). Where no wake-ups arrive (another process enqueues, and this one cannot
        /// listen: behind a transaction-mode pooler, `PgFence::listen(false)`, SQLite) this is
        /// how long a job may wait to be picked up; shorter costs one statement per interval.
        ///
        /// ```no_run
        /// # fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>) -> brokerfence::Result<()> {
        /// use std::time::Duration;
        /// let q = brokerfence::QueueName::new("emails")?;
        /// let source = brokerfence::TableQueue::new(store, q).idle_wait(Duration::from_millis(200));
        /// # let _ = source; Ok(()) }
        /// ```
        pub fn idle_wait(wait: Duration) { idle_wait = wait; idle = Arc::new(OnceLock::new()) }
    }
}

/// The default [`TableQueue::idle_wait`].
const DEFAULT_IDLE_WAIT: Duration = Duration::from_secs(1);

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
    /// An idle queue is still polled once per [`idle_wait`](TableQueue::idle_wait): the
    /// receives share one idle state.
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

    /// Claims up to `max` due jobs; when none is due, waits (see [`TableQueue`]) and answers
    /// nothing, so that the runtime asks again at once: each claim is its own receive, and a
    /// claimed job's deadline counts from the receive that claimed it, never from before an idle
    /// wait (a claim after a wait longer than the lease would otherwise start past its deadline).
    async fn receive(&self, max: usize, ctx: &ReceiveContext) -> Result<Vec<Incoming<()>>, SourceError> {
        let n = u32::try_from(max).unwrap_or(u32::MAX);
        let idle = self.idle.get_or_init(|| Idle::new(self.store.wakeups(&self.queue), self.idle_wait));
        let jobs = self
            .store
            .claim_next(&self.queue, &ctx.owner, ctx.lease, n)
            .await
            .map_err(|e| SourceError::Transient(Box::new(e)))?;
        if jobs.len() >= max {
            // More may be due: another receive loop claims too.
            idle.pass_on();
        }
        if idle.take_sync() {
            match self.store.next_due(&self.queue).await {
                Ok(Some(after)) => idle.due_in(after),
                Ok(None) => {}
                Err(e) => {
                    idle.ask_again();
                    if jobs.is_empty() {
                        return Err(SourceError::Transient(Box::new(e)));
                    }
                }
            }
        }
        if jobs.is_empty() {
            idle.polled();
            idle.wait(&ctx.shutdown).await;
        }
        Ok(jobs.into_iter().map(|job| Incoming::Claimed { delivery: (), job }).collect())
    }
}
