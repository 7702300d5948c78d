//! Counting store: every call of the store is one statement (one round trip).

use super::*;

pub(crate) const METHODS: [&str; 13] = [
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
pub(crate) struct Counting {
    pub(crate) inner: Arc<dyn FenceStore>,
    pub(crate) counts: [AtomicU64; METHODS.len()],
    pub(crate) nanos: [AtomicU64; METHODS.len()],
}

impl Counting {
    pub(crate) fn new(inner: Arc<dyn FenceStore>) -> Arc<Self> {
        Arc::new(Self { inner, counts: Default::default(), nanos: Default::default() })
    }
    pub(crate) fn hit(&self, method: &str) {
        if let Some(i) = METHODS.iter().position(|m| *m == method) {
            self.counts[i].fetch_add(1, Ordering::Relaxed);
        }
    }
    /// Counts one call of `method` and the time it took.
    pub(crate) async fn timed<T>(&self, method: &str, call: impl std::future::Future<Output = T>) -> T {
        self.hit(method);
        let started = Instant::now();
        let out = call.await;
        if let Some(i) = METHODS.iter().position(|m| *m == method) {
            self.nanos[i].fetch_add(u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
        }
        out
    }
    /// "method: calls (mean ms)" for every method called.
    pub(crate) fn describe(&self) -> String {
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
    pub(crate) fn get(&self, method: &str) -> u64 {
        METHODS.iter().position(|m| *m == method).map(|i| self.counts[i].load(Ordering::Relaxed)).unwrap_or(0)
    }
    pub(crate) fn total(&self) -> u64 {
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
    pub(crate) fn snapshot(&self) -> HashMap<&'static str, u64> {
        METHODS.iter().map(|m| (*m, self.get(m))).filter(|(_, n)| *n > 0).collect()
    }
    pub(crate) fn reset(&self) {
        for c in self.counts.iter().chain(&self.nanos) {
            c.store(0, Ordering::Relaxed);
        }
    }
}

#[async_trait]
impl FenceStore for Counting {
    async fn migrate(&self) -> brokerfence::fence::Result<()> {
        self.inner.migrate().await
    }
    async fn claim(
        &self,
        queue: &QueueName,
        key: &JobKey,
        owner: &Owner,
        lease: LeaseDuration,
    ) -> brokerfence::fence::Result<Claim> {
        self.timed("claim", self.inner.claim(queue, key, owner, lease)).await
    }
    async fn claim_batch(
        &self,
        queue: &QueueName,
        keys: &[JobKey],
        owner: &Owner,
        lease: LeaseDuration,
    ) -> brokerfence::fence::Result<Vec<Claim>> {
        self.timed("claim_batch", self.inner.claim_batch(queue, keys, owner, lease)).await
    }
    async fn enqueue(&self, queue: &QueueName, key: &JobKey, payload: &[u8]) -> brokerfence::fence::Result<bool> {
        self.timed("enqueue", self.inner.enqueue(queue, key, payload)).await
    }
    async fn enqueue_many(&self, queue: &QueueName, jobs: &[(JobKey, Vec<u8>)]) -> brokerfence::fence::Result<u64> {
        self.timed("enqueue", self.inner.enqueue_many(queue, jobs)).await
    }
    async fn claim_next(
        &self,
        queue: &QueueName,
        owner: &Owner,
        lease: LeaseDuration,
        n: u32,
    ) -> brokerfence::fence::Result<Vec<ClaimedJob>> {
        self.timed("claim_next", self.inner.claim_next(queue, owner, lease, n)).await
    }
    async fn heartbeat(&self, leases: &[Lease], lease: LeaseDuration) -> brokerfence::fence::Result<Heartbeat> {
        self.timed("heartbeat", self.inner.heartbeat(leases, lease)).await
    }
    async fn heartbeat_unless_locked(
        &self,
        leases: &[Lease],
        lease: LeaseDuration,
    ) -> brokerfence::fence::Result<Heartbeat> {
        self.timed("heartbeat", self.inner.heartbeat_unless_locked(leases, lease)).await
    }
    async fn checkpoint(&self, lease: &Lease, progress: &[u8]) -> brokerfence::fence::Result<()> {
        self.timed("checkpoint", self.inner.checkpoint(lease, progress)).await
    }
    async fn complete(&self, lease: &Lease, result: &[u8]) -> brokerfence::fence::Result<()> {
        self.timed("complete", self.inner.complete(lease, result)).await
    }
    async fn complete_batch(
        &self,
        items: &[(Lease, Vec<u8>)],
    ) -> brokerfence::fence::Result<Vec<brokerfence::fence::Result<()>>> {
        self.timed("complete_batch", self.inner.complete_batch(items)).await
    }
    async fn fail(
        &self,
        lease: &Lease,
        error: &str,
        retry: bool,
        policy: &RetryPolicy,
    ) -> brokerfence::fence::Result<FailOutcome> {
        self.timed("fail", self.inner.fail(lease, error, retry, policy)).await
    }
    async fn release(&self, lease: &Lease) -> brokerfence::fence::Result<()> {
        self.timed("release", self.inner.release(lease)).await
    }
    async fn job(&self, queue: &QueueName, key: &JobKey) -> brokerfence::fence::Result<Option<JobRecord>> {
        self.timed("job", self.inner.job(queue, key)).await
    }
    async fn completed_under(&self, leases: &[Lease]) -> brokerfence::fence::Result<Vec<bool>> {
        self.timed("completed_under", self.inner.completed_under(leases)).await
    }
    async fn db_now(&self) -> brokerfence::fence::Result<DbTime> {
        self.timed("db_now", self.inner.db_now()).await
    }
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn concrete(&self) -> brokerfence::fence::Backend<'_> {
        self.inner.concrete()
    }

    async fn prune(
        &self,
        retention: &brokerfence::fence::Retention,
    ) -> brokerfence::fence::Result<brokerfence::fence::PruneReport> {
        self.inner.prune(retention).await
    }
}
