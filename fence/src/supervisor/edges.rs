//! Issue #12 ("Fault tolerance at the edges") guards of the supervisor: the database heartbeat
//! never waits on a broker hook (§1, first bullet), a lease is renewed until its commit is
//! confirmed (§1, fourth bullet), and the commit queue is bounded (§2, last bullet).
//!
//! All of them run against an in-memory SQLite store (the database clock is SQLite's), with the
//! shortest lease the fence accepts (3 s, renewed every second).

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::commit::COMMITS_IN_FLIGHT;
use super::*;
use crate::error::Result;
use crate::lease::{Claim, ClaimedJob, FailOutcome, Heartbeat, JobRecord, LeaseDuration, RetryPolicy};
use crate::{DbTime, JobKey, QueueName, SqliteFence};

const LEASE_SECS: u64 = 3;

fn lease_len() -> LeaseDuration {
    LeaseDuration::from_secs(LEASE_SECS).expect("lease")
}

fn queue() -> QueueName {
    QueueName::new("q").expect("queue")
}

async fn store() -> Arc<SqliteFence> {
    let store = SqliteFence::open("sqlite::memory:").await.expect("open");
    store.migrate().await.expect("migrate");
    Arc::new(store)
}

async fn claim(store: &dyn FenceStore, key: &str, owner: &Owner) -> Claim {
    let key = JobKey::new(key).expect("key");
    store.claim(&queue(), &key, owner, lease_len()).await.expect("claim")
}

async fn claimed(store: &dyn FenceStore, key: &str, owner: &Owner) -> Lease {
    match claim(store, key, owner).await {
        Claim::Claimed(lease) => lease,
        other => panic!("expected a claim of {key}, got {other:?}"),
    }
}

/// Waits (up to `limit`) until `done` holds.
async fn wait_for(limit: Duration, mut done: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + limit;
    while !done() {
        if Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    true
}

/// A hook whose `confirmed` takes `delay` (a hung broker call); records how long each call lasted
/// before it returned or was dropped.
struct SlowHook {
    delay: Duration,
    calls: AtomicUsize,
    longest: Mutex<Duration>,
}

impl SlowHook {
    fn new(delay: Duration) -> Arc<Self> {
        Arc::new(Self { delay, calls: AtomicUsize::new(0), longest: Mutex::new(Duration::ZERO) })
    }
}

/// Records the length of a hook call when dropped (a call cut by a timeout is dropped).
struct CallTimer<'a> {
    started: Instant,
    longest: &'a Mutex<Duration>,
}

impl Drop for CallTimer<'_> {
    fn drop(&mut self) {
        if let Ok(mut longest) = self.longest.lock() {
            *longest = (*longest).max(self.started.elapsed());
        }
    }
}

#[async_trait]
impl LeaseHook for SlowHook {
    async fn confirmed(&self, _leases: &[Lease]) {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let _timer = CallTimer { started: Instant::now(), longest: &self.longest };
        tokio::time::sleep(self.delay).await;
    }
}

/// Guard of issue #12 §1, first bullet ("the database heartbeat never waits on a broker"): a
/// hook whose `confirmed` takes 5 s with a 3 s lease used to stall every renewal, and the attempt
/// was cancelled as `Unconfirmed` at ~3.7 s though the database was healthy. Now the hook runs
/// off the heartbeat path, each call cut at most at lease/3, and the 6 s attempt completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edges_a_slow_hook_never_cancels_a_healthy_attempt() {
    let store = store().await;
    let owner = Owner::unique("edges");
    let lease = claimed(&*store, "slow-hook", &owner).await;
    let sup = Supervisor::new(store, owner, SupervisorConfig::new(lease_len()));
    let hook = SlowHook::new(Duration::from_secs(5));
    sup.add_hook(Arc::clone(&hook) as Arc<dyn LeaseHook>);
    let outcome = sup
        .run(lease, Vec::new(), None, |_ctx| async {
            tokio::time::sleep(Duration::from_secs(6)).await;
            Ok(b"done".to_vec())
        })
        .await;
    assert!(outcome.is_completed(), "a slow hook cancelled a healthy attempt: {outcome:?}");
    let calls = hook.calls.load(Ordering::SeqCst);
    assert!(calls >= 2, "the hook was called {calls} times during a 6 s attempt renewed every second");
    let bound = lease_len().heartbeat_interval() + Duration::from_millis(500);
    let longest = *hook.longest.lock().expect("lock");
    assert!(longest <= bound, "a hook call lasted {longest:?}, more than lease/3 (+0.5 s slack)");
    assert!(sup.metrics().get(Counter::HookTimeouts) >= 1, "the cut hook calls were not counted");
}

/// Records, for every lease a hook is asked to extend, its `lease_until` and the database clock
/// when the call came.
struct ClockHook {
    store: Arc<SqliteFence>,
    seen: Mutex<Vec<(DbTime, DbTime)>>,
}

#[async_trait]
impl LeaseHook for ClockHook {
    async fn confirmed(&self, leases: &[Lease]) {
        let Ok(now) = self.store.db_now().await else { return };
        if let Ok(mut seen) = self.seen.lock() {
            seen.extend(leases.iter().map(|l| (l.lease_until, now)));
        }
    }
}

/// Guard of issue #12 §1, first bullet, and §4, second bullet ("before every broker call, check
/// the lease's own deadline"): with two hooks, the second used to be called only after the first
/// had returned, 5 s later, with leases the database had let expire meanwhile, so it extended
/// broker visibility for a lease nobody held. Every hook call now comes while its leases live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edges_a_hook_is_never_called_with_an_expired_lease() {
    let store = store().await;
    let owner = Owner::unique("edges");
    let lease = claimed(&*store, "two-hooks", &owner).await;
    let sup = Supervisor::new(Arc::clone(&store) as Arc<dyn FenceStore>, owner, SupervisorConfig::new(lease_len()));
    sup.add_hook(SlowHook::new(Duration::from_secs(5)));
    let clock = Arc::new(ClockHook { store: Arc::clone(&store), seen: Mutex::new(Vec::new()) });
    sup.add_hook(Arc::clone(&clock) as Arc<dyn LeaseHook>);
    let outcome = sup
        .run(lease, Vec::new(), None, |_ctx| async {
            tokio::time::sleep(Duration::from_secs(4)).await;
            Ok(Vec::new())
        })
        .await;
    let seen_any = wait_for(Duration::from_secs(10), || clock.seen.lock().is_ok_and(|s| !s.is_empty())).await;
    assert!(seen_any, "the second hook was never called");
    let seen = clock.seen.lock().expect("lock").clone();
    for (until, now) in &seen {
        assert!(until > now, "a hook was asked to extend a lease that ended at {until}, at {now} (database clock)");
    }
    assert!(outcome.is_completed(), "{outcome:?}");
}

/// What a [`SlowStore`] holds back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Hold {
    Commit,
    Fail,
}

/// A real store whose commits (or fails) wait until the test lets them go, like a commit
/// statement stuck behind a row lock or a slow fsync.
struct SlowStore {
    inner: Arc<SqliteFence>,
    hold: Hold,
    started: AtomicBool,
    gate: tokio::sync::Semaphore,
}

impl SlowStore {
    fn new(inner: Arc<SqliteFence>, hold: Hold) -> Arc<Self> {
        Arc::new(Self { inner, hold, started: AtomicBool::new(false), gate: tokio::sync::Semaphore::new(0) })
    }

    async fn held(&self, what: Hold) {
        if what != self.hold {
            return;
        }
        self.started.store(true, Ordering::SeqCst);
        // Bounded: a test that forgets to open the gate fails instead of hanging.
        if let Ok(Ok(permit)) = tokio::time::timeout(Duration::from_secs(20), self.gate.acquire()).await {
            permit.forget();
        }
    }

    fn open(&self) {
        self.gate.add_permits(1_000_000);
    }
}

#[async_trait]
impl FenceStore for SlowStore {
    async fn migrate(&self) -> Result<()> {
        self.inner.migrate().await
    }
    async fn claim_batch(&self, q: &QueueName, keys: &[JobKey], o: &Owner, l: LeaseDuration) -> Result<Vec<Claim>> {
        self.inner.claim_batch(q, keys, o, l).await
    }
    async fn enqueue_many(&self, queue: &QueueName, jobs: &[(JobKey, Vec<u8>)]) -> Result<u64> {
        self.inner.enqueue_many(queue, jobs).await
    }
    async fn claim_next(&self, q: &QueueName, o: &Owner, l: LeaseDuration, n: u32) -> Result<Vec<ClaimedJob>> {
        self.inner.claim_next(q, o, l, n).await
    }
    async fn heartbeat(&self, leases: &[Lease], lease: LeaseDuration) -> Result<Heartbeat> {
        self.inner.heartbeat(leases, lease).await
    }
    async fn checkpoint(&self, lease: &Lease, progress: &[u8]) -> Result<()> {
        self.inner.checkpoint(lease, progress).await
    }
    async fn complete(&self, lease: &Lease, result: &[u8]) -> Result<()> {
        self.held(Hold::Commit).await;
        self.inner.complete(lease, result).await
    }
    async fn complete_batch(&self, items: &[(Lease, Vec<u8>)]) -> Result<Vec<Result<()>>> {
        self.held(Hold::Commit).await;
        self.inner.complete_batch(items).await
    }
    async fn fail(&self, lease: &Lease, error: &str, retry: bool, policy: &RetryPolicy) -> Result<FailOutcome> {
        self.held(Hold::Fail).await;
        self.inner.fail(lease, error, retry, policy).await
    }
    async fn release(&self, lease: &Lease) -> Result<()> {
        self.inner.release(lease).await
    }
    async fn job(&self, queue: &QueueName, key: &JobKey) -> Result<Option<JobRecord>> {
        self.inner.job(queue, key).await
    }
    async fn db_now(&self) -> Result<DbTime> {
        self.inner.db_now().await
    }
    fn wakeups(&self, queue: &crate::QueueName) -> crate::Wakeups {
        self.inner.wakeups(queue)
    }
    async fn next_due(&self, queue: &crate::QueueName) -> crate::Result<Option<std::time::Duration>> {
        self.inner.next_due(queue).await
    }
    fn backend(&self) -> crate::Backend<'_> {
        crate::Backend::Other("slow-sqlite")
    }
}

/// Runs one attempt whose commit (or fail) is held by a [`SlowStore`] for longer than the lease,
/// while a second owner tries to claim the same job; returns the first attempt's outcome and
/// what the second owner got.
async fn settle_outlives_the_lease(hold: Hold) -> (Outcome, Claim) {
    let real = store().await;
    let slow = SlowStore::new(Arc::clone(&real), hold);
    let first = Owner::unique("first");
    let lease = claimed(&*real, "slow-settle", &first).await;
    let sup = Supervisor::new(Arc::clone(&slow) as Arc<dyn FenceStore>, first, SupervisorConfig::new(lease_len()));
    let attempt = {
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.run(lease, Vec::new(), None, move |_ctx| async move {
                match hold {
                    Hold::Commit => Ok(b"result".to_vec()),
                    Hold::Fail => Err(JobError::retry("downstream said 503")),
                }
            })
            .await
        })
    };
    assert!(wait_for(Duration::from_secs(5), || slow.started.load(Ordering::SeqCst)).await, "the settle never started");
    // Well past the lease: without renewals the database has let the lease go by now.
    tokio::time::sleep(lease_len().get() + Duration::from_millis(1500)).await;
    let second = claim(&*real, "slow-settle", &Owner::unique("second")).await;
    slow.open();
    let outcome = tokio::time::timeout(Duration::from_secs(20), attempt).await.expect("attempt ends").expect("task");
    (outcome, second)
}

/// Guard of issue #12 §1, fourth bullet ("a lease keeps being heartbeated until its commit is
/// confirmed"): the attempt used to leave the heartbeat set before the group commit, so a commit
/// held for longer than the lease let a second owner claim the job (it ran again) and the first
/// commit was fenced. Now the lease is renewed until the verdict: the second claim is Busy and the
/// first attempt completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edges_a_lease_is_renewed_until_its_commit_is_confirmed() {
    let (outcome, second) = settle_outlives_the_lease(Hold::Commit).await;
    assert!(
        matches!(second, Claim::Busy { .. }),
        "a second owner took the job while its commit was pending: {second:?}"
    );
    assert!(outcome.is_completed(), "{outcome:?}");
}

/// Guard of issue #12 §1, fourth bullet, for `fail`: a failure record held for longer than the
/// lease used to let a second owner claim the job before the failure (and its backoff) was
/// written; now the lease is renewed until the database has recorded the failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edges_a_lease_is_renewed_until_its_failure_is_recorded() {
    let (outcome, second) = settle_outlives_the_lease(Hold::Fail).await;
    assert!(
        matches!(second, Claim::Busy { .. }),
        "a second owner took the job while its failure was pending: {second:?}"
    );
    assert!(matches!(outcome, Outcome::Failed { .. }), "{outcome:?}");
}

/// Records the leases of every `confirmed` call.
#[derive(Default)]
struct Seen(Mutex<Vec<Vec<Lease>>>);

#[async_trait]
impl LeaseHook for Seen {
    async fn confirmed(&self, leases: &[Lease]) {
        if let Ok(mut seen) = self.0.lock() {
            seen.push(leases.to_vec());
        }
    }
}

/// Guard of issue #12 §4, second bullet ("before every broker call, check the lease's own
/// deadline"), through the supervisor's registry: of four renewals waiting for a hook, the one
/// whose worker-side deadline has passed, the one whose attempt was cancelled and the one whose
/// attempt has left the registry are never handed to the hook; only the live one is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edges_a_hook_never_sees_a_lease_past_its_deadline_or_ended() {
    let store = store().await;
    let owner = Owner::unique("edges");
    // A 30 s lease: no heartbeat of its own runs during this test.
    let long = LeaseDuration::from_secs(30).expect("lease");
    let keys: Vec<JobKey> =
        ["live", "past", "cancelled", "ended"].iter().map(|k| JobKey::new(*k).expect("key")).collect();
    let leases: Vec<Lease> = store
        .claim_batch(&queue(), &keys, &owner, long)
        .await
        .expect("claim")
        .into_iter()
        .map(|c| match c {
            Claim::Claimed(l) => l,
            other => panic!("{other:?}"),
        })
        .collect();
    let sup = Supervisor::new(store, owner, SupervisorConfig::new(long));
    let seen = Arc::new(Seen::default());
    sup.add_hook(Arc::clone(&seen) as Arc<dyn LeaseHook>);
    let inner = &sup.inner;
    let far = inner.nanos(Instant::now() + Duration::from_secs(60));
    let slots = [("live", far, false), ("past", 0, false), ("cancelled", far, true)];
    if let Ok(mut map) = inner.inflight.lock() {
        for (i, (key, deadline, cancelled)) in slots.into_iter().enumerate() {
            let lease = leases.iter().find(|l| l.key.as_str() == key).expect("claimed").clone();
            let state = Arc::new(SlotState {
                token: CancellationToken::new(),
                deadline: AtomicU64::new(deadline),
                loss: Mutex::new(None),
                settling: AtomicBool::new(false),
                own_commit: AtomicBool::new(false),
                committed: AtomicBool::new(false),
                #[cfg(feature = "metrics")]
                lost_at: std::sync::OnceLock::new(),
                span: Mutex::new(None),
            });
            if cancelled {
                state.token.cancel();
            }
            map.insert(1_000 + i as u64, Slot { lease, state });
        }
    }
    if let Ok(hooks) = inner.hooks.read() {
        hooks[0].submit(Instant::now(), &leases, &[]);
    }
    assert!(
        wait_for(Duration::from_secs(5), || sup.metrics().get(Counter::HookSkips) == 3).await,
        "stale leases were not skipped"
    );
    let called = wait_for(Duration::from_secs(5), || seen.0.lock().is_ok_and(|s| !s.is_empty())).await;
    assert!(called, "the live lease never reached the hook");
    let seen = seen.0.lock().expect("lock").clone();
    let keys: Vec<Vec<&str>> = seen.iter().map(|call| call.iter().map(|l| l.key.as_str()).collect()).collect();
    assert_eq!(keys, vec![vec!["live"]]);
}

/// Guard of issue #12 §2, last bullet ("memory stays bounded"), supervisor part: with every
/// commit statement held, completions fill the commit queue up to its bound and the rest wait
/// to enqueue (their leases still renewed) instead of the queue growing; once the database
/// answers, every one of them completes: nothing was dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edges_the_commit_queue_is_bounded_and_drops_nothing() {
    let real = store().await;
    let slow = SlowStore::new(Arc::clone(&real), Hold::Commit);
    let owner = Owner::unique("edges");
    let long = LeaseDuration::from_secs(30).expect("lease");
    let n = COMMIT_QUEUE + COMMITS_IN_FLIGHT * MAX_COMMIT_BATCH + 200;
    let keys: Vec<JobKey> = (0..n).map(|i| JobKey::new(format!("k{i}")).expect("key")).collect();
    let leases = real.claim_batch(&queue(), &keys, &owner, long).await.expect("claim");
    let sup = Supervisor::new(Arc::clone(&slow) as Arc<dyn FenceStore>, owner, SupervisorConfig::new(long));
    let runs: Vec<_> = leases
        .into_iter()
        .map(|c| {
            let Claim::Claimed(lease) = c else { panic!("{c:?}") };
            let sup = sup.clone();
            tokio::spawn(async move { sup.run(lease, Vec::new(), None, |_ctx| async { Ok(vec![7; 64]) }).await })
        })
        .collect();
    let committer = sup.inner.committer.clone();
    // Every handler has returned, every attempt still holds its (renewed) lease, the queue is full.
    let full = wait_for(Duration::from_secs(15), || {
        sup.leases_held() == n && sup.in_flight() == 0 && committer.capacity() == 0
    })
    .await;
    assert!(
        full,
        "not all {n} attempts were waiting with a full queue: {} held, {} running, {} of {} queue places free",
        sup.leases_held(),
        sup.in_flight(),
        committer.capacity(),
        committer.max_capacity()
    );
    assert_eq!(committer.max_capacity(), COMMIT_QUEUE, "the commit queue has a bound");
    drop(committer);
    slow.open();
    for run in runs {
        let outcome = tokio::time::timeout(Duration::from_secs(30), run).await.expect("settles").expect("task");
        assert!(outcome.is_completed(), "{outcome:?}");
    }
    assert_eq!(sup.metrics().get(Counter::Completions), n as u64);
    assert_eq!(sup.leases_held(), 0);
}
