//! The store trait: one epoch authority, two backends (PostgreSQL, SQLite).

use std::time::Duration;

use async_trait::async_trait;

use crate::error::Result;
use crate::key::{JobKey, Owner, QueueName};
use crate::lease::{Claim, ClaimedJob, FailOutcome, Heartbeat, JobRecord, Lease, LeaseDuration, RetryPolicy};

/// The epoch authority. Every method that writes on behalf of a lease is a compare-and-set on
/// (queue, key, owner, epoch, state = running): zero rows matched is
/// [`FenceError::Fenced`](crate::FenceError::Fenced) and nothing was written.
///
/// ```no_run
/// # async fn demo() -> brokerfence::Result<()> {
/// use brokerfence::{FenceStore, JobKey, LeaseDuration, Owner, QueueName, SqliteFence, Claim};
/// let store = SqliteFence::open("sqlite:demo.db").await?;
/// store.migrate().await?;
/// let q = QueueName::new("emails")?;
/// let me = Owner::unique("worker");
/// if let Claim::Claimed(lease) = store.claim(&q, &JobKey::new("msg-1")?, &me, LeaseDuration::from_secs(30)?).await? {
///     store.complete(&lease, b"sent").await?; // Err(Fenced{..}) if someone took over meanwhile
/// }
/// # Ok(()) }
/// ```
#[async_trait]
pub trait FenceStore: Send + Sync + 'static {
    /// Applies the embedded migrations; idempotent and safe from several processes at once.
    async fn migrate(&self) -> Result<()>;

    /// Checks, without changing anything, that the schema is at least at the migration version
    /// this build needs: what a worker calls at start instead of migrating (migrations are an
    /// explicit deploy step). A newer schema is fine. An older one, or none, is
    /// [`FenceError::SchemaTooOld`](crate::FenceError::SchemaTooOld) (`found` = 0 when there is
    /// no schema), whose message says to run migrations.
    ///
    /// The default answers [`FenceError::Unsupported`](crate::FenceError::Unsupported): a store
    /// that wraps another one should delegate this call to it.
    ///
    /// ```no_run
    /// # async fn demo() -> brokerfence::Result<()> {
    /// use brokerfence::{FenceError, FenceStore, PgFence};
    /// let store = PgFence::connect("postgres://postgres@127.0.0.1/test").await?;
    /// match store.check_schema().await {
    ///     Ok(()) => {}
    ///     Err(e @ FenceError::SchemaTooOld { .. }) => {
    ///         eprintln!("{e}");
    ///         std::process::exit(2);
    ///     }
    ///     Err(e) => return Err(e),
    /// }
    /// # Ok(()) }
    /// ```
    async fn check_schema(&self) -> Result<()> {
        Err(crate::FenceError::Unsupported("check_schema (a wrapping store should delegate it)"))
    }

    /// Claims a broker delivery: creates the job if missing and, only if it is pending, failed
    /// with its backoff passed (`run_at` due on the database clock) or running with an expired
    /// lease, makes it running under a new epoch. Otherwise says why not, in the same round trip:
    /// [`Claim::Busy`](crate::Claim::Busy), [`Done`](crate::Claim::Done),
    /// [`Dead`](crate::Claim::Dead) or [`Backoff`](crate::Claim::Backoff).
    ///
    /// A claim that would exceed the store's cap on claims of one job (`max_claims`,
    /// default 20: a job that keeps killing or stalling its workers) makes the job dead instead,
    /// with the last error "claimed N times without finishing (max_claims = M)", and answers
    /// [`Dead`](crate::Claim::Dead). [`claim_next`](Self::claim_next) does the same and leaves
    /// such jobs out of its answer.
    async fn claim(&self, queue: &QueueName, key: &JobKey, owner: &Owner, lease: LeaseDuration) -> Result<Claim> {
        let mut out = self.claim_batch(queue, std::slice::from_ref(key), owner, lease).await?;
        out.pop().ok_or_else(|| crate::FenceError::Corrupt("claim returned no outcome".into()))
    }

    /// [`claim`](Self::claim) for many keys in one statement; outcomes in the order of `keys`.
    /// A key given twice gets the same outcome twice (one claim).
    async fn claim_batch(
        &self,
        queue: &QueueName,
        keys: &[JobKey],
        owner: &Owner,
        lease: LeaseDuration,
    ) -> Result<Vec<Claim>>;

    /// Table queue: adds a job unless the key exists; says whether it inserted.
    async fn enqueue(&self, queue: &QueueName, key: &JobKey, payload: &[u8]) -> Result<bool> {
        Ok(self.enqueue_many(queue, &[(key.clone(), payload.to_vec())]).await? == 1)
    }

    /// Table queue: adds many jobs in one statement; returns how many were new.
    async fn enqueue_many(&self, queue: &QueueName, jobs: &[(JobKey, Vec<u8>)]) -> Result<u64>;

    /// Table queue: claims up to `n` due jobs (pending or failed with run_at passed, or running
    /// with an expired lease) in one statement, skipping rows other claimers hold locked.
    ///
    /// Fewer than `n` jobs means no more were due when the queue was read from its start.
    /// [`PgFence`](crate::PgFence) reads from where its previous claims of the queue ended in
    /// `run_at` order (its claim cursor) rather than past every job still running, and from the
    /// start when that finds fewer than `n`; a job behind the cursor (a lease that ran out, a row
    /// skipped while locked) waits, while claims keep coming back full, at most the
    /// [`claim_rescan`](crate::PgFence::claim_rescan) interval (1 s).
    async fn claim_next(
        &self,
        queue: &QueueName,
        owner: &Owner,
        lease: LeaseDuration,
        n: u32,
    ) -> Result<Vec<ClaimedJob>>;

    /// Wake-ups for the consumers of `queue` (see [`Wakeups`](crate::Wakeups)): a consumer
    /// with nothing to claim waits for one instead of asking again and again. The default has
    /// none (a consumer then only polls); a store that wraps another delegates this call.
    ///
    /// ```no_run
    /// # async fn demo(store: &dyn brokerfence::FenceStore) -> brokerfence::Result<()> {
    /// let wakeups = store.wakeups(&brokerfence::QueueName::new("emails")?);
    /// println!("notifications arrive: {}", wakeups.is_listening());
    /// # Ok(()) }
    /// ```
    fn wakeups(&self, queue: &QueueName) -> crate::Wakeups {
        let _ = queue;
        crate::Wakeups::none()
    }

    /// How long until the earliest job of `queue` that is waiting to become due (a retry's
    /// backoff) is due, on the database clock; `None` when no job waits. A job due now is not
    /// counted (a claim takes it, or another transaction holds it). The default answers `None`;
    /// a store that wraps another delegates this call.
    ///
    /// ```no_run
    /// # async fn demo(store: &dyn brokerfence::FenceStore) -> brokerfence::Result<()> {
    /// if let Some(after) = store.next_due(&brokerfence::QueueName::new("emails")?).await? {
    ///     println!("the next retry is due in {after:?}");
    /// }
    /// # Ok(()) }
    /// ```
    async fn next_due(&self, queue: &QueueName) -> Result<Option<std::time::Duration>> {
        let _ = queue;
        Ok(None)
    }

    /// Renews every given lease still matching (key, owner, epoch, running) in one statement.
    async fn heartbeat(&self, leases: &[Lease], lease: LeaseDuration) -> Result<Heartbeat>;

    /// [`heartbeat`](Self::heartbeat) that never waits on a row another transaction holds
    /// locked: such a lease is neither renewed nor reported renewed (it comes back in `lost`,
    /// which for this call only means "not renewed now"). The supervisor renews attempts awaiting
    /// their commit verdict with it: their rows are often locked by their own commit statement,
    /// and while that statement holds the row nobody else can claim the job anyway. The default
    /// is [`heartbeat`](Self::heartbeat) (a backend without row locks, like SQLite, never waits
    /// on one).
    async fn heartbeat_unless_locked(&self, leases: &[Lease], lease: LeaseDuration) -> Result<Heartbeat> {
        self.heartbeat(leases, lease).await
    }

    /// Stores progress under the lease.
    async fn checkpoint(&self, lease: &Lease, progress: &[u8]) -> Result<()>;

    /// Commits the result: the job is completed under this epoch. A job already completed
    /// under this very lease with this very result (its own earlier commit, sent again because
    /// the answer was lost to a failed connection or a failover) is answered `Ok`: a commit may
    /// be sent again safely. Any other completed job is [`Fenced`](crate::FenceError::Fenced).
    async fn complete(&self, lease: &Lease, result: &[u8]) -> Result<()>;

    /// [`complete`](Self::complete) for many leases in one statement (one commit, one fsync):
    /// the throughput path. One answer per item, in order: `Ok(())` or
    /// [`FenceError::Fenced`](crate::FenceError::Fenced) for that item alone.
    async fn complete_batch(&self, items: &[(Lease, Vec<u8>)]) -> Result<Vec<Result<()>>> {
        let mut out = Vec::with_capacity(items.len());
        for (lease, result) in items {
            out.push(match self.complete(lease, result).await {
                Err(e) if !e.is_fenced() => return Err(e),
                other => other,
            });
        }
        Ok(out)
    }

    /// Records a handler failure (the job's `failures` count grows by one): failed with a backoff
    /// of `policy.backoff(failures)`, or dead when `retry` is false or the failures reach
    /// `policy.max_attempts` (then its last error reads "failed N times (max_attempts = M): …").
    /// Claims, takeovers included, are not failures: they have their own, higher cap
    /// (`max_claims` of the store).
    async fn fail(&self, lease: &Lease, error: &str, retry: bool, policy: &RetryPolicy) -> Result<FailOutcome>;

    /// Gives the job back without spending an attempt (it is pending again at once).
    async fn release(&self, lease: &Lease) -> Result<()>;

    /// Reads a job row.
    async fn job(&self, queue: &QueueName, key: &JobKey) -> Result<Option<JobRecord>>;

    /// For each lease, in order: whether its job is completed under it (state completed, same
    /// epoch and owner). The supervisor asks it, for many attempts in one statement, after
    /// handlers that committed in their own transaction
    /// ([`JobContext::complete_in`](crate::JobContext::complete_in)) have returned. The default
    /// reads each job with [`job`](Self::job).
    async fn completed_under(&self, leases: &[Lease]) -> Result<Vec<bool>> {
        let mut out = Vec::with_capacity(leases.len());
        for l in leases {
            out.push(self.job(&l.queue, &l.key).await?.is_some_and(|job| completed_under_lease(&job, l)));
        }
        Ok(out)
    }

    /// Deletes finished jobs (and ledger rows) older than `retention` allows, in bounded batches
    /// (each a short transaction of at most [`Retention::batch`](crate::retention::Retention::batch_size) rows,
    /// read by an index, ages on the database clock), and raises each queue's epoch floor to
    /// the highest epoch it deleted, so that a key sent again after its row was pruned starts
    /// above every epoch it ever had. Pending, running and failed jobs are never deleted. At
    /// most one pruner works on a schema at a time (PostgreSQL: an advisory lock; a call that
    /// finds another at work returns with [`PruneReport::contended`](crate::PruneReport::contended)).
    ///
    /// The default answers [`FenceError::Unsupported`](crate::FenceError::Unsupported): a store
    /// that wraps another one should delegate this call to it.
    ///
    /// ```no_run
    /// # async fn demo(store: &dyn brokerfence::FenceStore) -> brokerfence::Result<()> {
    /// use brokerfence::QueueName;
    /// use brokerfence::retention::{QueueRetention, Retention};
    /// let r = Retention::new().queue(QueueName::new("orders")?, QueueRetention::default());
    /// let report = store.prune(&r).await?;
    /// println!("deleted {} completed, {} dead", report.completed, report.dead);
    /// # Ok(()) }
    /// ```
    async fn prune(&self, retention: &crate::Retention) -> Result<crate::PruneReport> {
        let _ = retention;
        Err(crate::FenceError::Unsupported("prune (a wrapping store should delegate it)"))
    }

    /// The database clock now, in milliseconds since the Unix epoch.
    async fn db_now(&self) -> Result<crate::DbTime>;

    /// Adds a worker's counts to the current minute and stores its fence events, for the
    /// dashboard (see [`crate::admin::Activity`]; a [`Supervisor`](crate::Supervisor) calls it
    /// off the job path). The default stores nothing; a store that wraps another delegates.
    ///
    /// ```no_run
    /// # async fn demo(store: &dyn brokerfence::FenceStore) -> brokerfence::Result<()> {
    /// use brokerfence::admin::{Activity, ActivityCounts};
    /// let mut activity = Activity::default();
    /// activity.counts.insert(brokerfence::QueueName::new("emails")?, ActivityCounts { claims: 1, ..Default::default() });
    /// store.record_activity(&activity).await?;
    /// # Ok(()) }
    /// ```
    async fn record_activity(&self, activity: &crate::admin::Activity) -> Result<()> {
        let _ = activity;
        Ok(())
    }

    /// The concrete store behind this one ([`Backend::name`] names it in logs), for statements
    /// that run on the caller's own connection
    /// ([`JobContext::complete_in`](crate::JobContext::complete_in)). A store that wraps another
    /// one delegates this call to it; a store of its own kind answers [`Backend::Other`] with its
    /// name, and those statements then answer
    /// [`FenceError::Unsupported`](crate::FenceError::Unsupported).
    ///
    /// ```
    /// # async fn demo() -> brokerfence::Result<()> {
    /// use brokerfence::{Backend, FenceStore, SqliteFence};
    /// let store = SqliteFence::open("sqlite::memory:").await?;
    /// assert!(matches!(store.backend(), Backend::Sqlite(_)));
    /// assert_eq!(store.backend().name(), "sqlite");
    /// # Ok(()) }
    /// ```
    fn backend(&self) -> Backend<'_>;
}

/// The concrete store behind a [`FenceStore`] (see [`FenceStore::backend`]).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Backend<'a> {
    /// PostgreSQL.
    #[cfg(feature = "postgres")]
    Postgres(&'a crate::PgFence),
    /// SQLite.
    #[cfg(feature = "sqlite")]
    Sqlite(&'a crate::SqliteFence),
    /// A store of another kind, with its name: statements on the caller's own connection are
    /// unsupported.
    Other(&'static str),
}

impl Backend<'_> {
    /// The backend's name, for logs: "postgres", "sqlite", or the name of another kind.
    ///
    /// ```
    /// assert_eq!(brokerfence::Backend::Other("memory").name(), "memory");
    /// ```
    pub fn name(&self) -> &'static str {
        match self {
            #[cfg(feature = "postgres")]
            Backend::Postgres(_) => "postgres",
            #[cfg(feature = "sqlite")]
            Backend::Sqlite(_) => "sqlite",
            Backend::Other(name) => name,
        }
    }
}

/// Helper for backends: a heartbeat outcome from the renewed subset.
/// `renewed` rows are (queue, key, epoch, owner, lease_until ms, ttl ms); a lease counts as renewed
/// only when all four of its identity fields match a row (a lease naming the right job and epoch
/// but another owner was not renewed). `held` rows name leases whose row was locked by another
/// transaction while its committed state still matched them (see [`Heartbeat::held`]).
pub(crate) fn split_heartbeat(
    leases: &[Lease],
    mut renewed: Vec<(String, String, i64, String, i64, i64)>,
    mut held: Vec<(String, String, i64, String)>,
) -> Heartbeat {
    let mut out = Heartbeat::default();
    renewed.sort();
    held.sort();
    for l in leases {
        let probe = (l.queue.as_str(), l.key.as_str(), l.epoch, l.owner.as_str());
        match renewed.binary_search_by(|r| (r.0.as_str(), r.1.as_str(), r.2, r.3.as_str()).cmp(&probe)) {
            Ok(i) => {
                let mut l = l.clone();
                l.lease_until = crate::DbTime(renewed[i].4);
                l.ttl = crate::lease::millis(renewed[i].5);
                out.renewed.push(l);
            }
            Err(_)
                if held.binary_search_by(|r| (r.0.as_str(), r.1.as_str(), r.2, r.3.as_str()).cmp(&probe)).is_ok() =>
            {
                out.held.push(l.clone())
            }
            Err(_) => out.lost.push(l.clone()),
        }
    }
    out
}

/// A job row as both backends' `job` statements return it: state, epoch, owner, lease_until
/// (ms), attempts, failures, run_at (ms), payload, progress, result, last_error.
pub(crate) type JobRow = (
    String,
    i64,
    Option<String>,
    Option<i64>,
    i64,
    i64,
    i64,
    Option<Vec<u8>>,
    Option<Vec<u8>>,
    Option<Vec<u8>>,
    Option<String>,
);

/// The [`JobRecord`] of a [`JobRow`] of `queue`/`key`.
pub(crate) fn job_record(queue: &QueueName, key: &JobKey, row: JobRow) -> Result<JobRecord> {
    let (state, epoch, owner, lease_until, attempts, failures, run_at, payload, progress, result, last_error) = row;
    Ok(JobRecord {
        queue: queue.clone(),
        key: key.clone(),
        state: crate::lease::JobState::parse(&state)?,
        epoch,
        owner,
        lease_until: lease_until.map(crate::DbTime),
        attempts,
        failures,
        run_at: crate::DbTime(run_at),
        payload,
        progress,
        result,
        last_error,
    })
}

/// Deduplicates keys for a batch statement, keeping first-seen order.
pub(crate) fn distinct_keys(keys: &[JobKey]) -> Vec<&JobKey> {
    let mut seen = std::collections::HashSet::with_capacity(keys.len());
    keys.iter().filter(|k| seen.insert(k.as_str())).collect()
}

/// The verdict of [`FenceStore::check_schema`] from the newest applied migration version.
/// Whether `job` is completed under `lease` (its epoch and owner): the lease's own commit.
pub(crate) fn completed_under_lease(job: &JobRecord, lease: &Lease) -> bool {
    job.state == crate::lease::JobState::Completed
        && job.epoch == lease.epoch
        && job.owner.as_deref() == Some(lease.owner.as_str())
}

/// Whether `job` is completed under `lease` with `result`: the lease's own commit of that
/// result. A commit sent again after its answer was lost (the connection failed, the server
/// failed over) finds the row so and is answered as committed, not as fenced; a commit of
/// another result under the same lease is still fenced.
pub(crate) fn committed_as(job: &JobRecord, lease: &Lease, result: &[u8]) -> bool {
    completed_under_lease(job, lease) && job.result.as_deref().unwrap_or_default() == result
}

pub(crate) fn schema_verdict(found: i64, required: i64) -> Result<()> {
    if found >= required { Ok(()) } else { Err(crate::FenceError::SchemaTooOld { found, required }) }
}

/// The backoff parameters a store's fail statement computes `base * 2^failures` (capped) from:
/// the base in milliseconds, at most 2^32 so that the product cannot overflow, and the cap.
pub(crate) fn backoff_ms(policy: &RetryPolicy) -> (i64, i64) {
    let ms = |d: Duration| i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
    (ms(policy.base_backoff).min(1 << 32), ms(policy.max_backoff))
}

/// The outcome of a fail statement that answered `state:delay_ms`.
pub(crate) fn fail_outcome(answer: &str) -> Result<FailOutcome> {
    match answer.split_once(':') {
        Some(("failed", ms)) => Ok(FailOutcome::Retry {
            retry_in: crate::lease::millis(
                ms.parse().map_err(|_| crate::FenceError::Corrupt(format!("fail answered {answer:?}")))?,
            ),
        }),
        Some(("dead", _)) => Ok(FailOutcome::Dead),
        _ => Err(crate::FenceError::Corrupt(format!("fail left state {answer:?}"))),
    }
}

/// The default cap on claims of one job: [`RetryPolicy::max_claims`] of the default policy.
pub(crate) fn default_max_claims() -> i64 {
    RetryPolicy::default().max_claims()
}

/// A claim statement's row, the same on both backends: key, outcome/state, epoch, owner,
/// lease_until ms, ttl ms, attempts, ms until run_at.
pub(crate) type ClaimRow = (String, String, i64, Option<String>, Option<i64>, Option<i64>, i64, Option<i64>);

/// The [`Claim`] a claim statement's row stands for (shared by both backends).
pub(crate) fn claim_outcome(queue: &QueueName, key: &JobKey, owner: &Owner, row: &ClaimRow) -> Result<Claim> {
    let (_, outcome, epoch, holder, lease_until, ttl, attempts, run_in) = row;
    Ok(match outcome.as_str() {
        "claimed" => Claim::Claimed(Lease {
            queue: queue.clone(),
            key: key.clone(),
            epoch: *epoch,
            owner: owner.clone(),
            lease_until: crate::DbTime(lease_until.unwrap_or(0)),
            ttl: crate::lease::millis(ttl.unwrap_or(0)),
            attempts: *attempts,
        }),
        other => match crate::JobState::parse(other)? {
            crate::JobState::Running => Claim::Busy {
                owner: holder.clone(),
                epoch: *epoch,
                lease_until: crate::DbTime(lease_until.unwrap_or(0)),
                ttl: crate::lease::millis(ttl.unwrap_or(0)),
            },
            crate::JobState::Completed => Claim::Done { epoch: *epoch },
            crate::JobState::Dead => Claim::Dead { epoch: *epoch },
            crate::JobState::Failed => {
                Claim::Backoff { epoch: *epoch, retry_in: crate::lease::millis(run_in.unwrap_or(0)) }
            }
            // Pending rows are always claimable; seeing one here means the row changed under us.
            crate::JobState::Pending => {
                return Err(crate::FenceError::Corrupt(format!("claim of {key} saw a pending row it did not take")));
            }
        },
    })
}

/// The producer's trace context for the rows an enqueue writes: the current span's
/// `traceparent` and `tracestate` with the feature `otel` (none outside a traced span), else none.
pub(crate) fn producer_trace() -> (Option<String>, Option<String>) {
    #[cfg(feature = "otel")]
    if let Some(tc) = crate::otel::TraceContext::current() {
        return (Some(tc.traceparent().to_owned()), tc.tracestate().map(str::to_owned));
    }
    (None, None)
}
