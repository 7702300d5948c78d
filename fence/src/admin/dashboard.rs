//! What the operator's dashboard (`brokerfence serve`) reads: per queue an overview (jobs by
//! state, activity per minute, the oldest pending job, leases about to end), the jobs in flight,
//! the latest fence events and the dead letters.
//!
//! Every statement here reads through an index, and none reads more than a bounded number of job
//! rows: counts stop at [`Admin::count_limit`] rows per state group (the answer then says
//! "at least"), the running jobs are looked for among the first [`Admin::count_limit`] open jobs
//! of the queue in `run_at` order (claims take jobs in that order, so running jobs sit at its
//! front), dead letters are read newest first per queue. [`Admin::dashboard_plans`] shows the
//! plans (a test checks that none scans the jobs table).

use std::collections::BTreeMap;

use super::activity::{ActivityCounts, FenceEventKind};
use super::{Admin, AdminError, DeadJob, RunningJob, StateCounts, Store};
use crate::key::{JobKey, QueueName};
use crate::lease::DbTime;

/// The default [`Admin::count_limit`]: 10,000 rows per state group and queue.
pub const DEFAULT_COUNT_LIMIT: u32 = 10_000;

/// How many minutes of activity an overview carries.
pub(crate) const MINUTES: i64 = 30;

/// Counts of one queue, each exact unless the limit was reached.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StateCountsCapped {
    /// The counts (each at most the limit).
    pub counts: StateCounts,
    /// Pending, running and failed are read together from the open jobs: true when they reached
    /// the limit (there may be more of each).
    pub open_capped: bool,
    /// Completed reached the limit.
    pub completed_capped: bool,
    /// Dead reached the limit.
    pub dead_capped: bool,
}

/// One minute of a queue's activity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Minute {
    /// The minute's start (database clock).
    pub minute: DbTime,
    /// What workers reported for it.
    pub counts: ActivityCounts,
}

/// One queue on the overview.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueOverview {
    /// The queue.
    pub queue: QueueName,
    /// Jobs per state (bounded counts).
    pub counts: StateCountsCapped,
    /// Running jobs whose lease has ended (among those read).
    pub expired_leases: u64,
    /// Milliseconds the oldest due pending (or failed, due again) job has waited.
    pub oldest_pending_ms: Option<i64>,
    /// The running job due the longest.
    pub oldest_running: Option<RunningJob>,
    /// Leases ending within [`Admin::expiring_within`] (or ended), soonest first, at most
    /// [`Admin::list_limit`].
    pub expiring: Vec<RunningJob>,
    /// The last 30 minutes of activity that has rows, oldest first (minutes without any are absent).
    pub minutes: Vec<Minute>,
}

/// What [`Admin::overview`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Overview {
    /// The database clock when it was read.
    pub now: DbTime,
    /// The limit the counts were read with.
    pub count_limit: u32,
    /// The queues that have jobs, by name.
    pub queues: Vec<QueueOverview>,
}

/// A job in flight, as [`Admin::in_flight`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InFlightJob {
    /// Queue.
    pub queue: QueueName,
    /// Key, epoch, owner, attempts, lease end and time left (database clock).
    pub job: RunningJob,
    /// The last renewal of the lease (a heartbeat, or a checkpoint), when there was one since the
    /// job became due: a claim does not write the row's change time (it stays a HOT update), so
    /// a job not renewed since its claim has `None`. (After a takeover it can be the earlier
    /// holder's last renewal, until the new holder's first.)
    pub last_renewal: Option<DbTime>,
}

/// A fence event as stored, with the winner read when it was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedEvent {
    /// Its number (grows with every event of the schema).
    pub seq: i64,
    /// When it was written (database clock).
    pub at: DbTime,
    /// Milliseconds ago, when read.
    pub age_ms: i64,
    /// Queue.
    pub queue: QueueName,
    /// Key.
    pub key: JobKey,
    /// Fenced or lost.
    pub kind: FenceEventKind,
    /// The worker's words.
    pub detail: String,
    /// The loser's epoch.
    pub epoch: i64,
    /// The loser.
    pub owner: String,
    /// The epoch that held the job (the winner), if known.
    pub winner_epoch: Option<i64>,
    /// Its owner.
    pub winner_owner: Option<String>,
    /// The job's state when the event was written.
    pub winner_state: Option<String>,
}

/// An event row: seq, at, age, queue, key, kind, detail, epoch, owner, winner epoch/owner/state.
pub(crate) type EventRow =
    (i64, i64, i64, String, String, String, String, i64, String, Option<i64>, Option<String>, Option<String>);

pub(crate) fn recorded_event(row: EventRow) -> Result<RecordedEvent, AdminError> {
    let (seq, at, age_ms, queue, key, kind, detail, epoch, owner, winner_epoch, winner_owner, winner_state) = row;
    Ok(RecordedEvent {
        seq,
        at: DbTime(at),
        age_ms,
        queue: super::stored_queue(queue)?,
        key: super::stored_key(key)?,
        kind: FenceEventKind::parse(&kind).ok_or_else(|| {
            AdminError::Fence(crate::FenceError::Corrupt(format!("stored fence event kind {kind:?}")))
        })?,
        detail,
        epoch,
        owner,
        winner_epoch,
        winner_owner,
        winner_state,
    })
}

/// A running row: queue, key, epoch, owner, attempts, lease_until, left, run_at, and the row's
/// change time when it is later than `run_at` (a renewal since the job became due) (ms).
pub(crate) type FlightRow = (String, String, i64, Option<String>, i64, i64, i64, i64, Option<i64>);

pub(crate) fn in_flight_job(row: FlightRow) -> Result<InFlightJob, AdminError> {
    let (queue, key, epoch, owner, attempts, lease_until, left, run_at, updated_at) = row;
    let (queue, job) = super::rows::running_job((queue, key, epoch, owner, attempts, lease_until, left, run_at))?;
    Ok(InFlightJob { queue: super::stored_queue(queue)?, job, last_renewal: updated_at.map(DbTime) })
}

/// What one backend read for one queue of the overview.
pub(crate) struct QueueRead {
    /// (state, n) of the first open jobs.
    pub(crate) open: Vec<(String, i64)>,
    /// Whether a read of open jobs stopped at the limit.
    pub(crate) open_capped: bool,
    pub(crate) completed: i64,
    pub(crate) dead: i64,
    pub(crate) oldest_pending_ms: Option<i64>,
    /// Running rows among the first open jobs, soonest lease end first.
    pub(crate) running: Vec<FlightRow>,
    /// (minute ms, claims, commits, fenced, lost).
    pub(crate) minutes: Vec<(i64, i64, i64, i64, i64)>,
}

/// Puts one queue's reads together.
pub(crate) fn queue_overview(
    queue: QueueName,
    read: QueueRead,
    limit: u32,
    within_ms: i64,
    list_limit: u32,
) -> Result<QueueOverview, AdminError> {
    let n = |v: i64| u64::try_from(v).unwrap_or(0);
    let mut counts = StateCountsCapped::default();
    for (state, c) in &read.open {
        counts.counts.add(crate::lease::JobState::parse(state)?, n(*c));
    }
    let limit64 = u64::from(limit);
    counts.open_capped = read.open_capped;
    counts.counts.completed = n(read.completed);
    counts.completed_capped = counts.counts.completed >= limit64;
    counts.counts.dead = n(read.dead);
    counts.dead_capped = counts.counts.dead >= limit64;
    let running: Vec<RunningJob> =
        read.running.into_iter().map(|r| in_flight_job(r).map(|f| f.job)).collect::<Result<_, _>>()?;
    let expired_leases = running.iter().filter(|r| r.expired()).count() as u64;
    let oldest_running = running.iter().min_by_key(|r| (r.due_since, r.key.clone())).cloned();
    let take = usize::try_from(list_limit).unwrap_or(usize::MAX);
    let expiring: Vec<RunningJob> = running.into_iter().filter(|r| r.lease_left_ms < within_ms).take(take).collect();
    let minutes = read
        .minutes
        .into_iter()
        .map(|(m, claims, commits, fenced, lost)| Minute {
            minute: DbTime(m),
            counts: ActivityCounts { claims: n(claims), commits: n(commits), fenced: n(fenced), lost: n(lost) },
        })
        .collect();
    Ok(QueueOverview {
        queue,
        counts,
        expired_leases,
        oldest_pending_ms: read.oldest_pending_ms,
        oldest_running,
        expiring,
        minutes,
    })
}

impl Admin {
    /// How many job rows one count or scan of the dashboard reads at most, per queue and state
    /// group (default [`DEFAULT_COUNT_LIMIT`], at least 1).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use brokerfence::{FenceStore, SqliteFence, admin::Admin};
    /// let store = SqliteFence::open("sqlite::memory:").await?;
    /// store.migrate().await?;
    /// let overview = Admin::new(&store)?.count_limit(1_000).overview(None).await?;
    /// assert_eq!(overview.count_limit, 1_000);
    /// # Ok(()) }
    /// ```
    pub fn count_limit(mut self, n: u32) -> Self {
        self.count_limit = n.max(1);
        self
    }

    /// Per queue (`queue`, or every queue that has jobs): bounded counts by state, the last 30
    /// minutes of activity, the oldest due pending job's wait, the oldest running job and the
    /// leases about to end. Reads through indexes only (see the module's documentation).
    pub async fn overview(&self, queue: Option<&QueueName>) -> Result<Overview, AdminError> {
        let queues = match queue {
            Some(q) => vec![q.clone()],
            None => self.queues().await?,
        };
        let (limit, within, list) = (self.count_limit, super::ms(self.expiring_within), self.list_limit);
        self.bounded("overview", async {
            let (now, reads) = match &self.store {
                #[cfg(feature = "postgres")]
                Store::Postgres(pg) => super::dashboard_pg::overview(pg, self.timeout, &queues, limit).await?,
                #[cfg(feature = "sqlite")]
                Store::Sqlite(lite) => super::dashboard_sqlite::overview(lite, &queues, limit).await?,
            };
            let mut out = Vec::with_capacity(queues.len());
            for (q, read) in queues.into_iter().zip(reads) {
                out.push(queue_overview(q, read, limit, within, list)?);
            }
            Ok(Overview { now: DbTime(now), count_limit: limit, queues: out })
        })
        .await
    }

    /// The running jobs of `queue` (or of every queue), soonest lease end first, at most `limit`
    /// in all; looked for among the first [`count_limit`](Self::count_limit) open jobs of each
    /// queue.
    pub async fn in_flight(&self, queue: Option<&QueueName>, limit: u32) -> Result<Vec<InFlightJob>, AdminError> {
        let queues = match queue {
            Some(q) => vec![q.clone()],
            None => self.queues().await?,
        };
        self.bounded("in flight", async {
            let rows = match &self.store {
                #[cfg(feature = "postgres")]
                Store::Postgres(pg) => {
                    super::dashboard_pg::in_flight(pg, self.timeout, &queues, self.count_limit, limit).await?
                }
                #[cfg(feature = "sqlite")]
                Store::Sqlite(lite) => super::dashboard_sqlite::in_flight(lite, &queues, limit).await?,
            };
            let mut jobs: Vec<InFlightJob> = rows.into_iter().map(in_flight_job).collect::<Result<_, _>>()?;
            jobs.sort_by_key(|j| (j.job.lease_left_ms, j.queue.clone(), j.job.key.clone()));
            jobs.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
            Ok(jobs)
        })
        .await
    }

    /// The latest fence events (of `queue`, or of all), newest first, at most `limit`.
    pub async fn fence_events(&self, queue: Option<&QueueName>, limit: u32) -> Result<Vec<RecordedEvent>, AdminError> {
        self.bounded("fence events", async {
            let rows = match &self.store {
                #[cfg(feature = "postgres")]
                Store::Postgres(pg) => super::dashboard_pg::events(pg, self.timeout, queue, limit).await?,
                #[cfg(feature = "sqlite")]
                Store::Sqlite(lite) => super::dashboard_sqlite::events(lite, queue, limit).await?,
            };
            rows.into_iter().map(recorded_event).collect()
        })
        .await
    }

    /// Dead letters of `queue` (or of every queue), the most recent first, at most `limit`,
    /// read newest first per queue through the finished-jobs index (what [`dead`](Self::dead)
    /// lists, without reading past the other finished jobs); `last_error` cut at 4,096 characters.
    pub async fn dead_letters(&self, queue: Option<&QueueName>, limit: u32) -> Result<Vec<DeadJob>, AdminError> {
        let queues = match queue {
            Some(q) => vec![q.clone()],
            None => self.queues().await?,
        };
        self.bounded("dead letters", async {
            let rows = match &self.store {
                #[cfg(feature = "postgres")]
                Store::Postgres(pg) => super::dashboard_pg::dead(pg, self.timeout, &queues, limit).await?,
                #[cfg(feature = "sqlite")]
                Store::Sqlite(lite) => super::dashboard_sqlite::dead(lite, &queues, limit).await?,
            };
            let mut dead: Vec<DeadJob> = rows.into_iter().map(super::dead_job).collect::<Result<_, _>>()?;
            dead.sort_by(|a, b| b.died_at.cmp(&a.died_at).then_with(|| a.queue.cmp(&b.queue)));
            dead.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
            Ok(dead)
        })
        .await
    }

    /// The plan of every statement the dashboard runs, by name: on PostgreSQL `EXPLAIN (FORMAT
    /// JSON)` of each, prepared and planned as the fence's sessions plan it (a generic plan, no
    /// sequential scan unless there is no other way); on SQLite `EXPLAIN QUERY PLAN`'s lines.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// use brokerfence::{FenceStore, SqliteFence, admin::Admin};
    /// let store = SqliteFence::open("sqlite::memory:").await?;
    /// store.migrate().await?;
    /// for (name, plan) in Admin::new(&store)?.dashboard_plans().await? {
    ///     // `t` is the jobs table: read by index searches only, never whole.
    ///     assert!(!plan.lines().any(|l| l == "SCAN t" || l.starts_with("SCAN t ")), "{name}: {plan}");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn dashboard_plans(&self) -> Result<BTreeMap<&'static str, String>, AdminError> {
        self.bounded("dashboard plans", async {
            match &self.store {
                #[cfg(feature = "postgres")]
                Store::Postgres(pg) => super::dashboard_pg::plans(pg, self.timeout).await,
                #[cfg(feature = "sqlite")]
                Store::Sqlite(lite) => super::dashboard_sqlite::plans(lite).await,
            }
        })
        .await
    }
}
