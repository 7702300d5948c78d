//! Issue #12 ("Fault tolerance at the edges"), supervisor guards on PostgreSQL: the database
//! heartbeat never waits on a broker hook (§1, first bullet), and a lease is renewed until its
//! commit is confirmed (§1, fourth bullet). The same guards run on SQLite as unit tests
//! (`fence::supervisor::edges`); these show them on the production backend, each test on its own
//! schema.

use brokerfence_testkit::store as common;

mod edges {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::Duration;

    use async_trait::async_trait;
    use brokerfence::{
        Claim, ClaimedJob, Counter, DbTime, FailOutcome, FenceStore, Heartbeat, JobKey, JobRecord, JobState, Lease,
        LeaseDuration, LeaseHook, Owner, QueueName, Result, RetryPolicy, Supervisor, SupervisorConfig,
    };
    use tokio::time::Instant;

    use super::common;

    fn queue() -> QueueName {
        QueueName::new(common::unique("q")).expect("queue")
    }

    async fn claimed(store: &dyn FenceStore, q: &QueueName, key: &JobKey, owner: &Owner) -> Lease {
        match store.claim(q, key, owner, common::lease(3)).await.expect("claim") {
            Claim::Claimed(lease) => lease,
            other => panic!("expected a claim, got {other:?}"),
        }
    }

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

    /// A broker hook whose every `confirmed` call hangs for 5 s (a hung SQS or Redis call).
    struct HungBroker {
        calls: AtomicUsize,
    }

    #[async_trait]
    impl LeaseHook for HungBroker {
        async fn confirmed(&self, _leases: &[Lease]) {
            self.calls.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
    }

    /// Guard of issue #12 §1, first bullet, on PostgreSQL: a broker hook that hangs 5 s per call
    /// with a 3 s lease used to stop every renewal, and the attempt was cancelled as
    /// `Unconfirmed` with the database healthy. Now it completes; the hung calls are cut and
    /// counted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hung_broker_hook_never_cancels_a_healthy_attempt_on_postgres() {
        let store: Arc<dyn FenceStore> = Arc::new(common::pg().await);
        let (q, key, owner) = (queue(), common::key("hung-hook"), Owner::unique("edges"));
        let lease = claimed(&*store, &q, &key, &owner).await;
        let sup = Supervisor::new(Arc::clone(&store), owner, SupervisorConfig::new(common::lease(3)));
        let hook = Arc::new(HungBroker { calls: AtomicUsize::new(0) });
        sup.add_hook(Arc::clone(&hook) as Arc<dyn LeaseHook>);
        let outcome = sup
            .run(lease, Vec::new(), None, |_ctx| async {
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok(b"done".to_vec())
            })
            .await;
        assert!(outcome.is_completed(), "a hung broker hook cancelled a healthy attempt: {outcome:?}");
        assert!(hook.calls.load(Ordering::SeqCst) >= 2, "the hook was not called on every tick");
        assert!(sup.metrics().get(Counter::HookTimeouts) >= 1, "hung hook calls were not cut and counted");
        let job = store.job(&q, &key).await.expect("job").expect("row");
        assert_eq!((job.state, job.epoch), (JobState::Completed, 1));
    }

    /// A PostgreSQL store whose group commits wait until the test lets them go (a slow fsync, a
    /// commit stuck in the network).
    struct HeldCommits {
        inner: Arc<dyn FenceStore>,
        started: AtomicBool,
        gate: tokio::sync::Semaphore,
    }

    impl HeldCommits {
        async fn held(&self) {
            self.started.store(true, Ordering::SeqCst);
            if let Ok(Ok(permit)) = tokio::time::timeout(Duration::from_secs(20), self.gate.acquire()).await {
                permit.forget();
            }
        }
    }

    #[async_trait]
    impl FenceStore for HeldCommits {
        async fn migrate(&self) -> Result<()> {
            self.inner.migrate().await
        }
        async fn claim_batch(&self, q: &QueueName, k: &[JobKey], o: &Owner, l: LeaseDuration) -> Result<Vec<Claim>> {
            self.inner.claim_batch(q, k, o, l).await
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
            self.held().await;
            self.inner.complete(lease, result).await
        }
        async fn complete_batch(&self, items: &[(Lease, Vec<u8>)]) -> Result<Vec<Result<()>>> {
            self.held().await;
            self.inner.complete_batch(items).await
        }
        async fn fail(&self, lease: &Lease, error: &str, retry: bool, policy: &RetryPolicy) -> Result<FailOutcome> {
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
        fn wakeups(&self, queue: &brokerfence::QueueName) -> brokerfence::Wakeups {
            self.inner.wakeups(queue)
        }
        async fn next_due(&self, queue: &brokerfence::QueueName) -> brokerfence::Result<Option<std::time::Duration>> {
            self.inner.next_due(queue).await
        }
        fn backend(&self) -> brokerfence::Backend<'_> {
            brokerfence::Backend::Other("held-postgres")
        }
    }

    /// Guard of issue #12 §1, fourth bullet, on PostgreSQL: a commit held for longer than the
    /// lease used to let a second owner claim the job (it ran again) and fenced the first
    /// commit. Now the lease is renewed until the verdict: the second owner is refused (Busy) and
    /// the first attempt's result is the one committed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lease_is_renewed_until_its_commit_is_confirmed_on_postgres() {
        let real: Arc<dyn FenceStore> = Arc::new(common::pg().await);
        let held = Arc::new(HeldCommits {
            inner: Arc::clone(&real),
            started: AtomicBool::new(false),
            gate: tokio::sync::Semaphore::new(0),
        });
        let (q, key, first) = (queue(), common::key("held-commit"), Owner::unique("first"));
        let lease = claimed(&*real, &q, &key, &first).await;
        let sup = Supervisor::new(
            Arc::clone(&held) as Arc<dyn FenceStore>,
            first.clone(),
            SupervisorConfig::new(common::lease(3)),
        );
        let attempt = {
            let sup = sup.clone();
            tokio::spawn(async move { sup.run(lease, Vec::new(), None, |_ctx| async { Ok(b"first".to_vec()) }).await })
        };
        assert!(wait_for(Duration::from_secs(5), || held.started.load(Ordering::SeqCst)).await, "no commit started");
        tokio::time::sleep(Duration::from_millis(4500)).await;
        let second = real.claim(&q, &key, &Owner::unique("second"), common::lease(3)).await.expect("claim");
        held.gate.add_permits(1_000);
        let outcome =
            tokio::time::timeout(Duration::from_secs(20), attempt).await.expect("attempt ends").expect("task");
        assert!(
            matches!(second, Claim::Busy { .. }),
            "a second owner took the job while its commit was pending: {second:?}"
        );
        assert!(outcome.is_completed(), "{outcome:?}");
        let job = real.job(&q, &key).await.expect("job").expect("row");
        assert_eq!((job.state, job.epoch, job.owner.as_deref()), (JobState::Completed, 1, Some(first.as_str())));
    }

    /// Guard of issue #12 §1 (the heartbeat never waits on anything but the attempts it
    /// renews), found by the chaos run's PostgreSQL stalls: attempts awaiting their commit verdict
    /// are still renewed (§1, fourth bullet), but by a statement of their own that skips rows
    /// another transaction holds locked. In one statement with the running attempts, a renewal
    /// blocked on a committing attempt's row (its commit waiting on a lock held elsewhere) made
    /// every renewal of the worker time out, and a healthy attempt beside it was cancelled
    /// `Unconfirmed`; a separate statement that waited on the lock still tied up the heartbeat
    /// connections until the healthy renewal found none. Here job A's row is locked by another
    /// session for 5 s just as A's handler returns; job B's handler runs 6 s under a 3 s lease
    /// and must complete.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_committing_attempt_stuck_on_a_lock_costs_no_other_attempt_its_lease() {
        let fence = common::pg().await;
        let (q, owner) = (queue(), Owner::unique("edges"));
        let (key_a, key_b) = (common::key("stuck-commit"), common::key("healthy-beside"));
        let lease_a = claimed(&fence, &q, &key_a, &owner).await;
        let lease_b = claimed(&fence, &q, &key_b, &owner).await;
        let pool = fence.pool().clone();
        let table = format!("{}.jobs", fence.get_schema().as_str());
        let store: Arc<dyn FenceStore> = Arc::new(fence);
        let sup = Supervisor::new(Arc::clone(&store), owner, SupervisorConfig::new(common::lease(3)));

        // B: a healthy attempt that needs its lease renewed twice or more.
        let running_b = {
            let sup = sup.clone();
            tokio::spawn(async move {
                sup.run(lease_b, Vec::new(), None, |_ctx| async {
                    tokio::time::sleep(Duration::from_secs(6)).await;
                    Ok(b"b".to_vec())
                })
                .await
            })
        };
        // A: returns after 1.5 s, once another session holds its row for 5 s; its commit waits.
        let locked = Arc::new(AtomicBool::new(false));
        let holder = {
            let (pool, table, key, locked) = (pool.clone(), table.clone(), key_a.clone(), Arc::clone(&locked));
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(1_300)).await;
                let mut tx = pool.begin().await.expect("begin");
                sqlx::query(sqlx::AssertSqlSafe(format!("SELECT 1 FROM {table} WHERE key = $1 FOR UPDATE")))
                    .bind(key.as_str().to_owned())
                    .execute(&mut *tx)
                    .await
                    .expect("lock A's row");
                locked.store(true, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(5)).await;
                tx.rollback().await.expect("rollback");
            })
        };
        let outcome_a = sup
            .run(lease_a, Vec::new(), None, |_ctx| {
                let locked = Arc::clone(&locked);
                async move {
                    assert!(wait_for(Duration::from_secs(5), || locked.load(Ordering::SeqCst)).await, "lock taken");
                    Ok(b"a".to_vec())
                }
            })
            .await;
        let outcome_b = running_b.await.expect("B's task");
        holder.await.expect("lock holder");
        assert!(
            outcome_b.is_completed(),
            "a healthy attempt was cancelled because another attempt's commit waited on a lock: {outcome_b:?}"
        );
        // A's own fate is the database's: committed once the lock went, or unknown (not acked).
        assert!(
            matches!(outcome_a, brokerfence::Outcome::Completed | brokerfence::Outcome::StoreError(_)),
            "{outcome_a:?}"
        );
        let b = store.job(&q, &key_b).await.expect("job").expect("row");
        assert_eq!((b.state, b.epoch), (JobState::Completed, 1));
    }

    /// Guard of issue #12 §1 (the heartbeat's own connections), found by the chaos run's
    /// PostgreSQL stalls: a heartbeat the caller stops waiting for (the supervisor's timeout of
    /// one interval) while it waits on a locked row used to be dropped mid-statement; once the
    /// lock_timeout ended the statement, sqlx's ping of the returned connection failed and the
    /// connection stayed lost to the pool, so after two such heartbeats every later renewal of the
    /// worker timed out, long after the lock was gone. Statements now run detached from their
    /// caller and end on their own.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn abandoned_heartbeats_leave_the_heartbeat_connections_usable() {
        let fence = common::pg().await;
        let (q, owner, key) = (queue(), Owner::unique("edges"), common::key("abandoned"));
        let lease = match fence.claim(&q, &key, &owner, common::lease(30)).await.expect("claim") {
            Claim::Claimed(l) => l,
            other => panic!("{other:?}"),
        };
        let table = format!("{}.jobs", fence.get_schema().as_str());
        // A table lock (a heartbeat skips locked rows since issue 13, but waits on a table lock
        // such as a migration's, up to its lock_timeout).
        let mut tx = fence.pool().begin().await.expect("begin");
        sqlx::query(sqlx::AssertSqlSafe(format!("LOCK TABLE {table} IN EXCLUSIVE MODE")))
            .execute(&mut *tx)
            .await
            .expect("lock the table");
        for _ in 0..4 {
            let waited = tokio::time::timeout(
                Duration::from_millis(300),
                fence.heartbeat(std::slice::from_ref(&lease), common::lease(30)),
            )
            .await;
            assert!(waited.is_err(), "a heartbeat on a locked table answered within 300 ms: {waited:?}");
        }
        // Past the heartbeat connections' lock_timeout (1 s): the abandoned statements have ended.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        tx.rollback().await.expect("release the table");
        let answer = tokio::time::timeout(
            Duration::from_secs(5),
            fence.heartbeat(std::slice::from_ref(&lease), common::lease(30)),
        )
        .await;
        assert!(
            matches!(answer, Ok(Ok(ref hb)) if hb.renewed.len() == 1),
            "the heartbeat connections stayed unusable after abandoned heartbeats: {answer:?}"
        );
    }
}
