//! Operator queries and repairs: what is in the queues, one job's state, dead letters and their
//! fenced requeue. The `brokerfence` binary (feature `cli` of the `brokerfence` crate) is built on
//! this module; everything it shows is available here as typed values.
//!
//! Every time in these answers is on the **database clock** (the clock leases are judged by), in
//! milliseconds since the Unix epoch ([`DbTime`](crate::DbTime)), and every "time left" is computed by the
//! database in the same statement. Each call is bounded: on PostgreSQL by a `statement_timeout`
//! (the call's limit) and a `lock_timeout` (half of it, at most 3 s) set for its own
//! transactions, and on both backends by a client-side limit ([`Admin::timeout`], default
//! 30 s, plus 2 s for the server's answer) past which it answers [`AdminError::Timeout`].
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use brokerfence::admin::{Admin, Requeue};
//! use brokerfence::{FenceStore, JobKey, PgFence, QueueName};
//! let store = PgFence::connect("postgres://postgres@127.0.0.1/test").await?;
//! let admin = Admin::new(&store)?;
//! for q in admin.status(None).await?.queues {
//!     println!("{}: {} dead, {} expired leases", q.queue, q.counts.dead, q.expired_leases);
//! }
//! let orders = QueueName::new("orders")?;
//! let report = admin.requeue_dead(&orders, Requeue::Keys(vec![JobKey::new("order-7")?])).await?;
//! println!("requeued {:?}", report.requeued);
//! # Ok(()) }
//! ```

use std::time::Duration;

use crate::error::FenceError;
use crate::key::{JobKey, QueueName};
use crate::store::{Backend, FenceStore};

#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "sqlite")]
mod sqlite;

mod activity;
mod dashboard;
#[cfg(feature = "postgres")]
mod dashboard_pg;
#[cfg(feature = "sqlite")]
mod dashboard_sqlite;
mod record;
mod rows;
mod types;

pub use activity::{
    Activity, ActivityCounts, DEFAULT_ACTIVITY_INTERVAL, FENCE_EVENT_SLOTS, FenceEvent, FenceEventKind,
};
pub use dashboard::{
    DEFAULT_COUNT_LIMIT, InFlightJob, Minute, Overview, QueueOverview, RecordedEvent, StateCountsCapped,
};
// For the backends' statement files (imported through here: they and `dashboard` use each other).
pub(crate) use dashboard::{EventRow, FlightRow, MINUTES, QueueRead};
#[cfg(feature = "postgres")]
pub(crate) use record::{prune_pg, record_pg};
#[cfg(feature = "sqlite")]
pub(crate) use record::{prune_sqlite, record_sqlite};

pub(crate) use rows::{
    DeadRow, JobInfoRow, RunningRow, absorb_requeued, assemble, dead_job, job_info, key_chunks, keyed_outcome, ms,
    stored_key, stored_queue,
};
pub use types::{
    DeadJob, JobInfo, QueueStatus, Requeue, RequeueReport, Requeued, RunningJob, Skipped, StateCounts, Status,
};

/// The default client-side limit of one admin call: 30 s.
pub const DEFAULT_ADMIN_TIMEOUT: Duration = Duration::from_secs(30);

/// The default window of [`QueueStatus::expiring`]: leases that end within 10 s (or have ended).
pub const DEFAULT_EXPIRING_WITHIN: Duration = Duration::from_secs(10);

/// The default number of rows a requeue changes per statement (one short transaction each): 500.
pub const DEFAULT_REQUEUE_BATCH: u32 = 500;

/// What can go wrong in an admin call.
///
/// ```
/// use std::time::Duration;
/// use brokerfence::admin::AdminError;
/// let err = AdminError::Timeout { operation: "status", after: Duration::from_secs(30) };
/// assert_eq!(err.to_string(), "status did not finish within 30s (admin timeout)");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// The store or the database refused or failed: unreachable, a statement or lock timeout on
    /// the server ([`FenceError::StatementTimeout`], [`FenceError::LockTimeout`]), a schema that
    /// is missing or too old ([`FenceError::SchemaTooOld`]), and so on.
    #[error(transparent)]
    Fence(#[from] FenceError),
    /// The call did not finish within the client-side limit ([`Admin::timeout`]).
    #[error("{operation} did not finish within {after:?} (admin timeout)")]
    Timeout {
        /// The call.
        operation: &'static str,
        /// The limit.
        after: Duration,
    },
    /// The store is neither a [`PgFence`](crate::PgFence) nor a
    /// [`SqliteFence`](crate::SqliteFence), and does not name one through
    /// [`FenceStore::backend`].
    #[error(
        "the admin API needs a PgFence or a SqliteFence; this {backend} store does not expose one (FenceStore::backend)"
    )]
    UnsupportedStore {
        /// [`FenceStore::backend`] of the store.
        backend: &'static str,
    },
    /// [`Admin::requeue_dead`] refused, and changed nothing: dead jobs it was to requeue were
    /// claimed from a broker (SQS, Redis, or a loop of your own through a retrofit), not enqueued
    /// in the table (their rows carry no payload). A requeue makes such a row pending, but nothing
    /// runs a pending row without a broker message: only the table queue's consumer claims rows
    /// by themselves. Re-send their messages from the dead-letter queue or stream; when the job
    /// key comes from the message (an attribute, the body, a stream field, the list item), the
    /// re-sent message is claimed under the same key, which a dead row refuses: requeue first
    /// with [`Admin::broker_jobs`] (CLI: `--broker-jobs`). With the broker's message id as
    /// the key, the re-sent message is a new job and needs no requeue.
    ///
    /// ```
    /// use brokerfence::admin::AdminError;
    /// use brokerfence::{JobKey, QueueName};
    /// let err = AdminError::BrokerJobs {
    ///     queue: QueueName::new("orders").unwrap(),
    ///     keys: vec![JobKey::new("m-1").unwrap()],
    ///     count: 1,
    /// };
    /// assert!(err.to_string().starts_with("queue orders: 1 dead job(s) were claimed from a broker (m-1)"), "{err}");
    /// assert!(err.to_string().contains("--broker-jobs"));
    /// ```
    #[error(
        "queue {queue}: {count} dead job(s) were claimed from a broker ({}), not enqueued in the table: a requeue \
         would make them pending with no broker message to run them, so nothing was changed. Re-send their \
         messages from the dead-letter queue or stream; when the job key comes from the message (not the broker's \
         message id), requeue them first with --broker-jobs (Admin::broker_jobs)",
        key_list(keys, *count)
    )]
    BrokerJobs {
        /// The queue.
        queue: QueueName,
        /// Some of them (at most 10), by key.
        keys: Vec<JobKey>,
        /// How many there are.
        count: u64,
    },
}

/// How many keys an [`AdminError::BrokerJobs`] names.
pub(crate) const BROKER_KEYS_SHOWN: usize = 10;

/// `a, b, c` and how many more.
fn key_list(keys: &[JobKey], count: u64) -> String {
    let shown: Vec<&str> = keys.iter().map(JobKey::as_str).collect();
    let more = count.saturating_sub(shown.len() as u64);
    if more > 0 { format!("{} and {more} more", shown.join(", ")) } else { shown.join(", ") }
}

impl From<sqlx::Error> for AdminError {
    fn from(e: sqlx::Error) -> Self {
        AdminError::Fence(FenceError::from(e))
    }
}

/// [`AdminError::BrokerJobs`] when a requeue would take dead jobs claimed from a broker: `found`
/// is (some of their keys, how many).
fn refuse_broker_jobs(queue: &QueueName, found: (Vec<String>, i64)) -> Result<(), AdminError> {
    let (keys, count) = found;
    if count <= 0 {
        return Ok(());
    }
    let keys = keys.into_iter().take(BROKER_KEYS_SHOWN).map(stored_key).collect::<Result<_, _>>()?;
    Err(AdminError::BrokerJobs { queue: queue.clone(), keys, count: u64::try_from(count).unwrap_or(0) })
}

/// The concrete store an [`Admin`] works on.
#[derive(Debug, Clone)]
enum Store {
    #[cfg(feature = "postgres")]
    Postgres(crate::PgFence),
    #[cfg(feature = "sqlite")]
    Sqlite(crate::SqliteFence),
}

/// Operator queries and repairs on a [`PgFence`](crate::PgFence) or
/// [`SqliteFence`](crate::SqliteFence) (same schema, same pool).
///
/// ```no_run
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use brokerfence::admin::Admin;
/// use brokerfence::{JobKey, QueueName, SqliteFence};
/// let store = SqliteFence::open("sqlite:jobs.db").await?;
/// let admin = Admin::new(&store)?.timeout(Duration::from_secs(5));
/// if let Some(job) = admin.job(&QueueName::new("emails")?, &JobKey::new("welcome-42")?).await? {
///     println!("{} at epoch {}, last error {:?}", job.state, job.epoch, job.last_error);
/// }
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Admin {
    store: Store,
    timeout: Duration,
    expiring_within: Duration,
    list_limit: u32,
    batch: u32,
    broker_jobs: bool,
    count_limit: u32,
}

impl Admin {
    /// An admin on the concrete store behind `store` ([`FenceStore::backend`]): its pool and
    /// schema. A store that names none answers [`AdminError::UnsupportedStore`].
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use brokerfence::{FenceStore, SqliteFence, admin::Admin};
    /// let store = SqliteFence::open("sqlite::memory:").await?;
    /// store.migrate().await?;
    /// let status = Admin::new(&store)?.status(None).await?;
    /// assert!(status.queues.is_empty());
    /// # Ok(()) }
    /// ```
    pub fn new<S: FenceStore + ?Sized>(store: &S) -> Result<Self, AdminError> {
        let store = match store.backend() {
            #[cfg(feature = "postgres")]
            Backend::Postgres(pg) => Store::Postgres(pg.clone()),
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(lite) => Store::Sqlite(lite.clone()),
            _ => return Err(AdminError::UnsupportedStore { backend: store.backend().name() }),
        };
        Ok(Self {
            store,
            timeout: DEFAULT_ADMIN_TIMEOUT,
            expiring_within: DEFAULT_EXPIRING_WITHIN,
            list_limit: 10,
            batch: DEFAULT_REQUEUE_BATCH,
            broker_jobs: false,
            count_limit: DEFAULT_COUNT_LIMIT,
        })
    }

    /// The limit of one call (default [`DEFAULT_ADMIN_TIMEOUT`], at least 1 ms). On PostgreSQL it
    /// is also the `statement_timeout` of the call's statements.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout.max(Duration::from_millis(1));
        self
    }

    /// Which leases [`QueueStatus::expiring`] lists: those ending within `window` (default
    /// [`DEFAULT_EXPIRING_WITHIN`]) or ended already.
    pub fn expiring_within(mut self, window: Duration) -> Self {
        self.expiring_within = window;
        self
    }

    /// How many leases [`QueueStatus::expiring`] lists per queue (default 10, at least 1).
    pub fn list_limit(mut self, n: u32) -> Self {
        self.list_limit = n.max(1);
        self
    }

    /// Rows a requeue changes per statement (default [`DEFAULT_REQUEUE_BATCH`], at least 1).
    pub fn batch_size(mut self, n: u32) -> Self {
        self.batch = n.max(1);
        self
    }

    /// Whether [`requeue_dead`](Self::requeue_dead) requeues jobs claimed from a broker too
    /// (default no: it refuses with [`AdminError::BrokerJobs`]). Say yes when you re-send their
    /// messages yourself (from the dead-letter queue or stream), after the requeue: a pending row
    /// is run only by a broker message that carries its key.
    ///
    /// ```no_run
    /// # async fn demo(admin: brokerfence::admin::Admin) -> Result<(), Box<dyn std::error::Error>> {
    /// use brokerfence::admin::Requeue;
    /// let orders = brokerfence::QueueName::new("orders")?;
    /// let report = admin.broker_jobs(true).requeue_dead(&orders, Requeue::AllDead).await?;
    /// // now re-send the messages of report.requeued from the dead-letter queue
    /// # Ok(()) }
    /// ```
    pub fn broker_jobs(mut self, yes: bool) -> Self {
        self.broker_jobs = yes;
        self
    }

    /// The backend's name ("postgres", "sqlite").
    pub fn backend(&self) -> &'static str {
        match &self.store {
            #[cfg(feature = "postgres")]
            Store::Postgres(_) => "postgres",
            #[cfg(feature = "sqlite")]
            Store::Sqlite(_) => "sqlite",
        }
    }

    async fn bounded<T>(
        &self,
        operation: &'static str,
        call: impl Future<Output = Result<T, AdminError>>,
    ) -> Result<T, AdminError> {
        // On PostgreSQL the server's statement_timeout (the same limit) normally answers first;
        // the margin lets its typed error through.
        let limit = self.timeout.saturating_add(Duration::from_secs(2));
        tokio::time::timeout(limit, call).await.unwrap_or(Err(AdminError::Timeout { operation, after: self.timeout }))
    }

    /// The queues that have jobs, by name. On PostgreSQL it skips through the primary-key
    /// index one queue at a time (as many index probes as there are queues).
    pub async fn queues(&self) -> Result<Vec<QueueName>, AdminError> {
        self.bounded("queues", async {
            let names = match &self.store {
                #[cfg(feature = "postgres")]
                Store::Postgres(pg) => postgres::queues(pg, self.timeout).await?,
                #[cfg(feature = "sqlite")]
                Store::Sqlite(lite) => sqlite::queues(lite).await?,
            };
            names.into_iter().map(stored_queue).collect()
        })
        .await
    }

    /// Jobs per state, expired leases, the oldest running job and the leases about to end, per
    /// queue (`queue`, or every queue that has jobs). Counting reads every row of the queue(s),
    /// within the call's time limit.
    pub async fn status(&self, queue: Option<&QueueName>) -> Result<Status, AdminError> {
        let (within, limit) = (self.expiring_within, self.list_limit);
        self.bounded("status", async {
            match &self.store {
                #[cfg(feature = "postgres")]
                Store::Postgres(pg) => postgres::status(pg, self.timeout, queue, within, limit).await,
                #[cfg(feature = "sqlite")]
                Store::Sqlite(lite) => sqlite::status(lite, queue, within, limit).await,
            }
        })
        .await
    }

    /// One job, with its lease's time left on the database clock; `None` when the queue has no
    /// such job (never enqueued or claimed, or pruned).
    pub async fn job(&self, queue: &QueueName, key: &JobKey) -> Result<Option<JobInfo>, AdminError> {
        self.bounded("job", async {
            match &self.store {
                #[cfg(feature = "postgres")]
                Store::Postgres(pg) => postgres::job(pg, self.timeout, queue, key).await,
                #[cfg(feature = "sqlite")]
                Store::Sqlite(lite) => sqlite::job(lite, queue, key).await,
            }
        })
        .await
    }

    /// Dead letters of `queue` (or of every queue), the most recent first, at most `limit`.
    pub async fn dead(&self, queue: Option<&QueueName>, limit: u32) -> Result<Vec<DeadJob>, AdminError> {
        self.bounded("dead list", async {
            match &self.store {
                #[cfg(feature = "postgres")]
                Store::Postgres(pg) => postgres::dead(pg, self.timeout, queue, limit).await,
                #[cfg(feature = "sqlite")]
                Store::Sqlite(lite) => sqlite::dead(lite, queue, limit).await,
            }
        })
        .await
    }

    /// Gives dead jobs of `queue` another run, fenced. Each requeued job:
    ///
    /// - **epoch + 1**: the requeue is a new epoch of the job that nobody holds, so whoever held
    ///   the job before (the attempt that failed it, or the stalled holder whose job hit
    ///   `max_claims`) stays fenced: its heartbeats, checkpoints, commits and failures match no
    ///   row, and a receiver's ledger refuses its epoch once the next attempt's is seen. The next
    ///   claim hands out epoch + 2.
    /// - **state pending**, due now (`run_at` = the database clock), owner and lease cleared.
    /// - **attempts and failures back to 0**: a full budget of claims and failures, as a new
    ///   job has (a job that died of `max_attempts` or `max_claims` would otherwise die again at
    ///   its next failure or claim).
    /// - **last error kept**, as the reason of the last death, until the next failure
    ///   replaces it; the **progress** of the last checkpoint is kept too (the next attempt
    ///   receives it, as after any retry).
    ///
    /// Only jobs that are dead are changed; other keys come back in
    /// [`RequeueReport::skipped`].
    ///
    /// Jobs claimed from a broker (SQS, Redis: their rows have no payload, unlike the table
    /// queue's) are refused, with nothing changed, as [`AdminError::BrokerJobs`]: a pending row
    /// without a broker message would never run. [`broker_jobs`](Self::broker_jobs)
    /// requeues them too, for an operator who re-sends their messages. Keys are changed in batches of [`Admin::batch_size`]
    /// rows, each one statement (a short transaction); [`Requeue::AllDead`] works the same way
    /// through the jobs dead when the call started, oldest first. The time limit applies to the
    /// whole call: a call that runs out of it leaves the batches done so far committed. Each
    /// batch that requeued jobs wakes the queue's idle consumers once it committed (as an
    /// enqueue does; see [`FenceStore::wakeups`]).
    ///
    /// ```no_run
    /// # async fn demo(admin: brokerfence::admin::Admin) -> Result<(), Box<dyn std::error::Error>> {
    /// use brokerfence::admin::Requeue;
    /// let report = admin.requeue_dead(&brokerfence::QueueName::new("orders")?, Requeue::AllDead).await?;
    /// println!("{} requeued in {} batches", report.requeued.len(), report.batches);
    /// # Ok(()) }
    /// ```
    pub async fn requeue_dead(&self, queue: &QueueName, which: Requeue) -> Result<RequeueReport, AdminError> {
        let (batch, brokers) = (self.batch, self.broker_jobs);
        self.bounded("dead requeue", async {
            match &self.store {
                #[cfg(feature = "postgres")]
                Store::Postgres(pg) => {
                    if !brokers {
                        refuse_broker_jobs(queue, postgres::broker_jobs(pg, self.timeout, queue, &which).await?)?;
                    }
                    postgres::requeue(pg, self.timeout, queue, &which, batch, brokers).await
                }
                #[cfg(feature = "sqlite")]
                Store::Sqlite(lite) => {
                    if !brokers {
                        refuse_broker_jobs(queue, sqlite::broker_jobs(lite, queue, &which).await?)?;
                    }
                    sqlite::requeue(lite, queue, &which, batch, brokers).await
                }
            }
        })
        .await
    }

    /// [`FenceStore::prune`] of the store, within the call's time limit (a run cut short keeps
    /// the batches it committed; the next run carries on).
    ///
    /// ```no_run
    /// # async fn demo(admin: brokerfence::admin::Admin) -> Result<(), Box<dyn std::error::Error>> {
    /// use brokerfence::QueueName;
    /// use brokerfence::retention::{QueueRetention, Retention};
    /// let retention = Retention::new().queue(QueueName::new("orders")?, QueueRetention::default());
    /// println!("{:?}", admin.prune(&retention).await?);
    /// # Ok(()) }
    /// ```
    pub async fn prune(&self, retention: &crate::Retention) -> Result<crate::PruneReport, AdminError> {
        self.bounded("prune", async {
            Ok(match &self.store {
                #[cfg(feature = "postgres")]
                Store::Postgres(pg) => pg.prune(retention).await?,
                #[cfg(feature = "sqlite")]
                Store::Sqlite(lite) => lite.prune(retention).await?,
            })
        })
        .await
    }
}
