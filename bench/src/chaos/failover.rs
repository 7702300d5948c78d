//! The `pg-failover` fault: the database topology it needs and the failover itself.
//!
//! A run whose faults contain `pg-failover` (table source) does not use the shared PostgreSQL
//! for its jobs. It starts, as real processes on free ports ([`brokerfence_testkit::pg_topology`]):
//!
//! ```text
//! workers ──► PgBouncer (transaction mode) ──► VIP (a TCP relay) ──► primary ──link──► standby
//! runner (migrate, enqueue, audit, faults, checks) ──► VIP
//! receiver's ledger ──► the shared PostgreSQL (DATABASE_URL), a schema of its own
//! ```
//!
//! The standby streams through `link` (a relay too), asynchronously unless `--failover-sync`.
//! The fault ([`fail_over`]) cuts the link, lets the workers go on with the primary alone for
//! `--failover-alone-ms`, kills the primary (`pg_ctl stop -m immediate`), promotes the standby
//! (timeline 2), re-points the VIP to it and drops the VIP's connections: PgBouncer connects
//! again, now to the promoted standby, and the workers ride through without a restart. With an
//! asynchronous standby everything the primary committed alone is lost: claims, heartbeats and
//! commits. The receiver's ledger must not be lost with it, so it stays on the shared server.

use std::future::Future;

use brokerfence_testkit::pg_topology::{PgBouncer, PgPair, Relay, Replication};

use super::*;

/// The longest a failover may take (the primary alone included).
const FAILOVER_LIMIT: Duration = Duration::from_secs(180);

/// The servers, the VIP and the pooler of a failover run (torn down when dropped).
pub(crate) struct Topology {
    pub(crate) pair: PgPair,
    /// The address the runner and PgBouncer use: the primary's, then the promoted standby's.
    pub(crate) vip: Relay,
    pub(crate) bouncer: PgBouncer,
    pub(crate) sync: bool,
}

/// What the failover did and when (ms since the Unix epoch).
#[derive(Debug, Clone, Default)]
pub(crate) struct FailoverTimes {
    pub(crate) cut_ms: u64,
    pub(crate) killed_ms: u64,
    pub(crate) promoted_ms: u64,
    pub(crate) repointed_ms: u64,
    /// The promoted standby's timeline.
    pub(crate) timeline: u32,
    /// (key, epoch) of every commit the old primary had recorded just before it died; `None`
    /// when it could not be read.
    pub(crate) commits_before_kill: Option<HashSet<(String, i64)>>,
}

/// Runs `fut` (pg_topology calls, which panic when something fails) in a task of its own, so a
/// panic becomes an error of the run.
pub(crate) async fn caught<T: Send + 'static>(
    what: &str,
    fut: impl Future<Output = T> + Send + 'static,
) -> Result<T, String> {
    tokio::spawn(fut).await.map_err(|e| {
        let why = match e.try_into_panic() {
            Ok(p) => p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_else(|| "panicked".to_owned()),
            Err(e) => e.to_string(),
        };
        format!("{what}: {why}")
    })
}

impl Topology {
    /// A primary with a streaming standby (synchronous with `sync`), a VIP in front of the
    /// primary and a PgBouncer in transaction mode in front of the VIP.
    pub(crate) async fn start(sync: bool) -> Result<Arc<Topology>, String> {
        let start = async move {
            let pair = PgPair::start(if sync { Replication::Sync } else { Replication::Async }).await;
            let vip = Relay::start(pair.primary.addr()).await;
            let bouncer = PgBouncer::start(vip.addr(), "transaction", "extra_float_digits", &["postgres"]).await;
            Topology { pair, vip, bouncer, sync }
        };
        let what = "pg-failover: start a primary, a standby, a VIP and PgBouncer (needs PostgreSQL's server \
                    programs and pgbouncer: run `bash localstack/up`)";
        caught(what, start).await.map(Arc::new)
    }

    /// The superuser's URL through the VIP (the runner's store).
    pub(crate) fn vip_url(&self) -> String {
        format!("postgres://postgres@{}/postgres", self.vip.addr())
    }

    /// The workers' URL: PgBouncer's.
    pub(crate) fn bouncer_url(&self) -> String {
        self.bouncer.url("postgres", "postgres")
    }

    /// In words, for the progress lines.
    pub(crate) fn describe(&self) -> String {
        format!(
            "primary {} with a{} standby {} (replication through {}); VIP {}; PgBouncer {} (transaction mode)",
            self.pair.primary.addr(),
            if self.sync { " synchronous" } else { "n asynchronous" },
            self.pair.standby.addr(),
            self.pair.link.addr(),
            self.vip.addr(),
            self.bouncer.addr()
        )
    }

    /// Tears everything down off the runtime's worker threads (the servers' drops wait for
    /// `pg_ctl stop`).
    pub(crate) async fn teardown(topology: Arc<Topology>) {
        let _ = tokio::task::spawn_blocking(move || drop(topology)).await;
    }
}

/// The failover, in a task of its own (the runner keeps resuming paused workers meanwhile):
/// cut replication, `alone`, kill the primary, promote the standby, re-point the VIP and drop its
/// connections. Recorded in `log` as one `pg-failover` fault on every worker, from the cut until
/// the VIP is re-pointed.
pub(crate) fn fail_over(
    topology: Arc<Topology>,
    alone: Duration,
    log: FaultLog,
    store: PgFence,
    queue: QueueName,
) -> tokio::task::JoinHandle<Result<FailoverTimes, String>> {
    tokio::spawn(async move {
        let cut_ms = now_ms();
        topology.pair.link.partition();
        let id = log.open(
            FaultKind::PgFailover,
            Target::All,
            format!("replication cut, the primary alone for {:.1} s;", alone.as_secs_f64()),
        );
        let steps = async move {
            tokio::time::sleep(alone).await;
            // What the old primary committed: the audit rows it has now (the commits it acknowledged
            // alone are not on the standby). Read while it is still alone (about 0.2 s), so the
            // alone window counts until the kill.
            let commits = tokio::time::timeout(Duration::from_secs(2), commit_keys(&store, &queue))
                .await
                .ok()
                .and_then(Result::ok);
            let killed_ms = now_ms();
            topology.pair.primary.kill().await;
            topology.pair.standby.promote().await;
            let promoted_ms = now_ms();
            topology.vip.point_to(topology.pair.standby.addr());
            topology.vip.drop_connections();
            let repointed_ms = now_ms();
            let timeline = topology.pair.standby.timeline().await;
            FailoverTimes { cut_ms, killed_ms, promoted_ms, repointed_ms, timeline, commits_before_kill: commits }
        };
        // Every step is bounded (pg_ctl waits at most 60 s, the promotion 30 s more): a bound
        // on the whole as well.
        let result = match tokio::time::timeout(FAILOVER_LIMIT, caught("pg-failover", steps)).await {
            Ok(r) => r,
            Err(_) => Err(format!("pg-failover: not done within {FAILOVER_LIMIT:?}")),
        };
        match &result {
            Ok(t) => log.annotate(
                id,
                &format!(
                    " primary killed at +{:.1} s, standby promoted (timeline {}) at +{:.1} s, VIP re-pointed at +{:.1} s",
                    secs(t.cut_ms, t.killed_ms),
                    t.timeline,
                    secs(t.cut_ms, t.promoted_ms),
                    secs(t.cut_ms, t.repointed_ms)
                ),
            ),
            Err(e) => log.annotate(id, &format!(" failed: {e}")),
        }
        log.close(id);
        result
    })
}

fn secs(from_ms: u64, to_ms: u64) -> f64 {
    to_ms.saturating_sub(from_ms) as f64 / 1000.0
}

/// (key, epoch) of every commit in the audit table.
pub(crate) async fn commit_keys(store: &PgFence, queue: &QueueName) -> Result<HashSet<(String, i64)>, String> {
    let s = store.get_schema().as_str();
    let rows: Vec<(String, i64)> =
        sqlx::query_as(AssertSqlSafe(format!("SELECT key, epoch FROM {s}.chaos_commits WHERE queue = $1")))
            .bind(queue.as_str().to_owned())
            .fetch_all(store.pool())
            .await
            .map_err(|e| format!("read audit: {e}"))?;
    Ok(rows.into_iter().collect())
}

/// When (ms since the Unix epoch) the first commit at or after `since_ms` was recorded.
pub(crate) async fn first_commit_since(
    store: &PgFence,
    queue: &QueueName,
    since_ms: u64,
) -> Result<Option<u64>, String> {
    let s = store.get_schema().as_str();
    let at: Option<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT (extract(epoch FROM min(at)) * 1000)::bigint FROM {s}.chaos_commits \
         WHERE queue = $1 AND at >= to_timestamp($2)"
    )))
    .bind(queue.as_str().to_owned())
    .bind(since_ms as f64 / 1000.0)
    .fetch_one(store.pool())
    .await
    .map_err(|e| format!("first commit after the promotion: {e}"))?;
    Ok(at.and_then(|v| u64::try_from(v).ok()))
}

/// Tries `f` until it succeeds, for up to `within` (the runner's store may need a moment to
/// reach the promoted standby); the last error after that.
pub(crate) async fn retrying<T, F, Fut>(within: Duration, mut f: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + within;
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
        }
    }
}
