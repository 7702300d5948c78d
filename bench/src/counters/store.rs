//! The counting store: a [`FenceStore`] wrapper that counts the statements sent through it, by
//! method, with the time each took, and (on request) where a message's time goes between the
//! fence's statements and its handler. Every harness program that prints "statements per job"
//! counts them here.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use async_trait::async_trait;
use brokerfence::{
    self, Claim, ClaimedJob, DbTime, FailOutcome, FenceStore, Heartbeat, JobKey, JobRecord, Lease, LeaseDuration,
    Owner, QueueName, RetryPolicy,
};

/// The store methods counted, in the order [`Counting::describe`] prints them.
pub const METHODS: [&str; 13] = [
    "claim",
    "claim_batch",
    "enqueue",
    "claim_next",
    "heartbeat",
    "checkpoint",
    "complete",
    "complete_batch",
    "fail",
    "release",
    "job",
    "completed_under",
    "db_now",
];

/// A [`FenceStore`] that counts the statements sent through it, by method. Every method of the
/// PostgreSQL store is one statement; `claim_batch` may take a second round for keys inserted
/// concurrently by another claimer (rare; counted once here).
pub struct Counting {
    inner: Arc<dyn FenceStore>,
    counts: [AtomicU64; METHODS.len()],
    nanos: [AtomicU64; METHODS.len()],
    /// Whether to follow each message through the [`Stages`] (`bench_sqs --stages`). Off by
    /// default: it takes a lock and two map updates per message, CPU the measurement would then
    /// charge to the fence.
    track_stages: bool,
    stages: Mutex<Stages>,
}

/// Where a fenced message's time goes: claim answered → handler started, and handler finished →
/// commit answered (microseconds, summed), by job key.
#[derive(Debug, Default)]
pub struct Stages {
    claimed: HashMap<String, Instant>,
    finished: HashMap<String, Instant>,
    pub claim_to_start_us: u64,
    pub starts: u64,
    pub finish_to_commit_us: u64,
    pub commits: u64,
}

fn micros(since: Instant) -> u64 {
    u64::try_from(since.elapsed().as_micros()).unwrap_or(u64::MAX)
}

impl Counting {
    pub fn new(inner: Arc<dyn FenceStore>) -> Arc<Self> {
        Self::build(inner, false)
    }
    /// A counting store that also follows each message through the [`Stages`].
    pub fn with_stages(inner: Arc<dyn FenceStore>) -> Arc<Self> {
        Self::build(inner, true)
    }
    fn build(inner: Arc<dyn FenceStore>, track_stages: bool) -> Arc<Self> {
        Arc::new(Self {
            inner,
            counts: Default::default(),
            nanos: Default::default(),
            track_stages,
            stages: Mutex::default(),
        })
    }
    /// Mean milliseconds of one call of `method` (0 when it was not called).
    pub fn mean_ms(&self, method: &str) -> f64 {
        METHODS.iter().position(|m| *m == method).map_or(0.0, |i| {
            let n = self.counts[i].load(Ordering::Relaxed).max(1);
            self.nanos[i].load(Ordering::Relaxed) as f64 / n as f64 / 1e6
        })
    }
    /// The stages so far (with `with_stages`; empty otherwise).
    pub fn stages(&self) -> Option<std::sync::MutexGuard<'_, Stages>> {
        self.stages.lock().ok()
    }
    /// The handler of `key` started (with `with_stages`).
    pub fn started(&self, key: &str) {
        if !self.track_stages {
            return;
        }
        if let Ok(mut s) = self.stages.lock()
            && let Some(at) = s.claimed.remove(key)
        {
            s.claim_to_start_us += micros(at);
            s.starts += 1;
        }
    }
    /// The handler of `key` finished (with `with_stages`).
    pub fn finished(&self, key: &str) {
        if !self.track_stages {
            return;
        }
        if let Ok(mut s) = self.stages.lock() {
            s.finished.insert(key.to_owned(), Instant::now());
        }
    }
    fn claimed(&self, keys: &[JobKey]) {
        if !self.track_stages {
            return;
        }
        let now = Instant::now();
        if let Ok(mut s) = self.stages.lock() {
            for k in keys {
                s.claimed.insert(k.as_str().to_owned(), now);
            }
        }
    }
    fn committed(&self, items: &[(Lease, Vec<u8>)]) {
        if !self.track_stages {
            return;
        }
        if let Ok(mut s) = self.stages.lock() {
            for (l, _) in items {
                if let Some(at) = s.finished.remove(l.key.as_str()) {
                    s.finish_to_commit_us += micros(at);
                    s.commits += 1;
                }
            }
        }
    }
    pub fn hit(&self, method: &str) {
        if let Some(i) = METHODS.iter().position(|m| *m == method) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
    }
    /// Counts one call of `method` and the time it took.
    pub async fn timed<T>(&self, method: &str, call: impl std::future::Future<Output = T>) -> T {
        self.hit(method);
        let started = Instant::now();
        let out = call.await;
        if let Some(i) = METHODS.iter().position(|m| *m == method) {
            self.nanos[i].fetch_add(u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
        }
        out
    }
    /// "method: calls (mean ms)" for every method called.
    pub fn describe(&self) -> String {
        METHODS
            .iter()
            .enumerate()
            .filter_map(|(i, m)| {
                let n = self.counts[i].load(Ordering::Relaxed);
                let ns = self.nanos[i].load(Ordering::Relaxed);
                (n > 0).then(|| format!("{m} {n} ({:.2} ms)", ns as f64 / n as f64 / 1e6))
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
    pub fn get(&self, method: &str) -> u64 {
        METHODS.iter().position(|m| *m == method).map(|i| self.counts[i].load(Ordering::Relaxed)).unwrap_or(0)
    }
    pub fn total(&self) -> u64 {
        // Statements a worker sends while running jobs (not the bench's own enqueues / reads).
        [
            "claim",
            "claim_batch",
            "claim_next",
            "heartbeat",
            "checkpoint",
            "complete",
            "complete_batch",
            "fail",
            "release",
        ]
        .iter()
        .map(|m| self.get(m))
        .sum()
    }
    pub fn snapshot(&self) -> HashMap<&'static str, u64> {
        METHODS.iter().map(|m| (*m, self.get(m))).filter(|(_, n)| *n > 0).collect()
    }
    pub fn reset(&self) {
        for c in self.counts.iter().chain(&self.nanos) {
            c.store(0, Ordering::Relaxed);
        }
        if let Ok(mut s) = self.stages.lock() {
            *s = Stages::default();
        }
    }
}

#[async_trait]
impl FenceStore for Counting {
    async fn migrate(&self) -> fence::Result<()> {
        self.inner.migrate().await
    }
    async fn claim(
        &self,
        queue: &QueueName,
        key: &JobKey,
        owner: &Owner,
        lease: LeaseDuration,
    ) -> fence::Result<Claim> {
        self.timed("claim", self.inner.claim(queue, key, owner, lease)).await
    }
    async fn claim_batch(
        &self,
        queue: &QueueName,
        keys: &[JobKey],
        owner: &Owner,
        lease: LeaseDuration,
    ) -> fence::Result<Vec<Claim>> {
        let out = self.timed("claim_batch", self.inner.claim_batch(queue, keys, owner, lease)).await;
        self.claimed(keys);
        out
    }
    async fn enqueue(&self, queue: &QueueName, key: &JobKey, payload: &[u8]) -> fence::Result<bool> {
        self.timed("enqueue", self.inner.enqueue(queue, key, payload)).await
    }
    async fn enqueue_many(&self, queue: &QueueName, jobs: &[(JobKey, Vec<u8>)]) -> fence::Result<u64> {
        self.timed("enqueue", self.inner.enqueue_many(queue, jobs)).await
    }
    async fn claim_next(
        &self,
        queue: &QueueName,
        owner: &Owner,
        lease: LeaseDuration,
        n: u32,
    ) -> fence::Result<Vec<ClaimedJob>> {
        self.timed("claim_next", self.inner.claim_next(queue, owner, lease, n)).await
    }
    async fn heartbeat(&self, leases: &[Lease], lease: LeaseDuration) -> fence::Result<Heartbeat> {
        self.timed("heartbeat", self.inner.heartbeat(leases, lease)).await
    }
    async fn heartbeat_unless_locked(&self, leases: &[Lease], lease: LeaseDuration) -> fence::Result<Heartbeat> {
        self.timed("heartbeat", self.inner.heartbeat_unless_locked(leases, lease)).await
    }
    async fn checkpoint(&self, lease: &Lease, progress: &[u8]) -> fence::Result<()> {
        self.timed("checkpoint", self.inner.checkpoint(lease, progress)).await
    }
    async fn complete(&self, lease: &Lease, result: &[u8]) -> fence::Result<()> {
        self.timed("complete", self.inner.complete(lease, result)).await
    }
    async fn complete_batch(&self, items: &[(Lease, Vec<u8>)]) -> fence::Result<Vec<fence::Result<()>>> {
        let out = self.timed("complete_batch", self.inner.complete_batch(items)).await;
        self.committed(items);
        out
    }
    async fn fail(&self, lease: &Lease, error: &str, retry: bool, policy: &RetryPolicy) -> fence::Result<FailOutcome> {
        self.timed("fail", self.inner.fail(lease, error, retry, policy)).await
    }
    async fn release(&self, lease: &Lease) -> fence::Result<()> {
        self.timed("release", self.inner.release(lease)).await
    }
    async fn job(&self, queue: &QueueName, key: &JobKey) -> fence::Result<Option<JobRecord>> {
        self.timed("job", self.inner.job(queue, key)).await
    }
    async fn completed_under(&self, leases: &[Lease]) -> fence::Result<Vec<bool>> {
        self.timed("completed_under", self.inner.completed_under(leases)).await
    }
    async fn db_now(&self) -> fence::Result<DbTime> {
        self.timed("db_now", self.inner.db_now()).await
    }
    fn wakeups(&self, queue: &QueueName) -> brokerfence::Wakeups {
        self.inner.wakeups(queue)
    }
    async fn next_due(&self, queue: &QueueName) -> fence::Result<Option<std::time::Duration>> {
        self.timed("next_due", self.inner.next_due(queue)).await
    }
    async fn record_activity(&self, activity: &brokerfence::admin::Activity) -> fence::Result<()> {
        self.inner.record_activity(activity).await
    }

    fn backend(&self) -> fence::Backend<'_> {
        self.inner.backend()
    }

    async fn prune(&self, retention: &fence::retention::Retention) -> fence::Result<fence::retention::PruneReport> {
        self.inner.prune(retention).await
    }
}
