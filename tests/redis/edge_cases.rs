//! Issue #12 ("Fault tolerance at the edges"), the Redis parts, against the real Redis and
//! PostgreSQL of `localstack/up` (and private `redis-server`s this test starts, stops and kills):
//!
//! - §2 bullet 1: nothing popped is lost — [`ListRetrofit::requeue_popped`] puts back every item
//!   whose fate the database did not settle (lease unconfirmed, commit fenced with no newer
//!   holder, commit unknown), and only those.
//! - §3 bullet 1: the database decides every dead letter — a stream entry's delivery count is a
//!   hint; an entry is dead-lettered only when the database says its job is dead, and then once.
//! - §1 bullet 2 (Redis part): every Redis call has a timeout that fits the lease; a stalled Redis
//!   costs hints, never a healthy database lease.
//! - §4 bullet 2 (Redis part): after a takeover a stale `XCLAIM … JUSTID` is not sent.
//!
//! Run with `cargo test --workspace --all-features edges`.
#![cfg(feature = "redis")]

use brokerfence_testkit::redis as redis_support;

mod edges {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    use async_trait::async_trait;
    use brokerfence::redis::client;
    use brokerfence::redis::{
        ItemKey, KeyFrom, LeaseKeys, ListRetrofit, RedisConnections, RedisError, RedisTimeouts, StreamDelivery,
        StreamSource,
    };
    use brokerfence::{
        Claim, ClaimedJob, DbTime, FailOutcome, FenceError, FenceStore, Heartbeat, JobContext, JobError, JobKey,
        JobRecord, JobState, Lease, LeaseDuration, LossReason, Outcome, Owner, PgFence, QueueName, RetryPolicy,
        SupervisorConfig,
    };
    use brokerfence::{ConsumerConfig, Detail, Disposition, Incoming, Processed, ReceiveContext, Source, SourceError};

    use super::redis_support::*;

    /// A real [`PgFence`] with two faults a test can switch on: heartbeats that fail (the
    /// database unreachable for renewals, as when the heartbeat's connection is stuck) and
    /// commits that fail (the commit's fate unknown to the worker).
    struct FaultyStore {
        inner: PgFence,
        heartbeats_fail: AtomicBool,
        commits_fail: AtomicBool,
    }

    impl FaultyStore {
        fn new(inner: PgFence) -> Arc<FaultyStore> {
            Arc::new(FaultyStore {
                inner,
                heartbeats_fail: AtomicBool::new(false),
                commits_fail: AtomicBool::new(false),
            })
        }
    }

    fn unreachable() -> FenceError {
        FenceError::Database(sqlx::Error::PoolTimedOut)
    }

    #[async_trait]
    impl FenceStore for FaultyStore {
        async fn migrate(&self) -> brokerfence::Result<()> {
            self.inner.migrate().await
        }
        async fn claim(
            &self,
            queue: &QueueName,
            key: &JobKey,
            owner: &Owner,
            lease: LeaseDuration,
        ) -> brokerfence::Result<Claim> {
            self.inner.claim(queue, key, owner, lease).await
        }
        async fn claim_batch(
            &self,
            queue: &QueueName,
            keys: &[JobKey],
            owner: &Owner,
            lease: LeaseDuration,
        ) -> brokerfence::Result<Vec<Claim>> {
            self.inner.claim_batch(queue, keys, owner, lease).await
        }
        async fn enqueue_many(&self, queue: &QueueName, jobs: &[(JobKey, Vec<u8>)]) -> brokerfence::Result<u64> {
            self.inner.enqueue_many(queue, jobs).await
        }
        async fn claim_next(
            &self,
            queue: &QueueName,
            owner: &Owner,
            lease: LeaseDuration,
            n: u32,
        ) -> brokerfence::Result<Vec<ClaimedJob>> {
            self.inner.claim_next(queue, owner, lease, n).await
        }
        async fn heartbeat(&self, leases: &[Lease], lease: LeaseDuration) -> brokerfence::Result<Heartbeat> {
            if self.heartbeats_fail.load(Ordering::SeqCst) {
                return Err(unreachable());
            }
            self.inner.heartbeat(leases, lease).await
        }
        async fn checkpoint(&self, lease: &Lease, progress: &[u8]) -> brokerfence::Result<()> {
            self.inner.checkpoint(lease, progress).await
        }
        async fn complete(&self, lease: &Lease, result: &[u8]) -> brokerfence::Result<()> {
            if self.commits_fail.load(Ordering::SeqCst) {
                return Err(unreachable());
            }
            self.inner.complete(lease, result).await
        }
        async fn complete_batch(
            &self,
            items: &[(Lease, Vec<u8>)],
        ) -> brokerfence::Result<Vec<brokerfence::Result<()>>> {
            if self.commits_fail.load(Ordering::SeqCst) {
                return Err(unreachable());
            }
            self.inner.complete_batch(items).await
        }
        async fn fail(
            &self,
            lease: &Lease,
            error: &str,
            retry: bool,
            policy: &RetryPolicy,
        ) -> brokerfence::Result<FailOutcome> {
            self.inner.fail(lease, error, retry, policy).await
        }
        async fn release(&self, lease: &Lease) -> brokerfence::Result<()> {
            self.inner.release(lease).await
        }
        async fn job(&self, queue: &QueueName, key: &JobKey) -> brokerfence::Result<Option<JobRecord>> {
            self.inner.job(queue, key).await
        }
        async fn db_now(&self) -> brokerfence::Result<DbTime> {
            self.inner.db_now().await
        }
        fn wakeups(&self, queue: &brokerfence::QueueName) -> brokerfence::Wakeups {
            self.inner.wakeups(queue)
        }
        async fn next_due(&self, queue: &brokerfence::QueueName) -> brokerfence::Result<Option<std::time::Duration>> {
            self.inner.next_due(queue).await
        }
        fn backend(&self) -> brokerfence::Backend<'_> {
            brokerfence::Backend::Other("faulty-postgres")
        }
    }

    async fn llen(env: &Env, list: &str) -> i64 {
        client::cmd("LLEN").arg(list).query_async(&mut env.conn()).await.expect("LLEN")
    }

    async fn lpush(env: &Env, list: &str, item: &str) {
        let _: i64 = client::cmd("LPUSH").arg(list).arg(item).query_async(&mut env.conn()).await.expect("LPUSH");
    }

    fn list_fence(
        env: &Env,
        store: Arc<dyn FenceStore>,
        list: &str,
        owner: &str,
        config: SupervisorConfig,
    ) -> ListRetrofit {
        ListRetrofit::with_owner(
            store,
            QueueName::new(list).expect("queue"),
            Owner::new(owner).expect("owner"),
            config,
            &env.redis,
            list,
            ItemKey::Split(b'|'),
        )
        .expect("retrofit")
    }

    /// The user's `BRPOP` loop with a quick handler, until the job of `key` is completed and the
    /// list stays empty: returns how many times the handler ran to a committed result.
    async fn drain_until_completed(env: &Env, fence: &ListRetrofit, list: &str, key: &str) -> usize {
        let committed = Arc::new(AtomicUsize::new(0));
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut blocking = env.redis.blocking();
        loop {
            assert!(Instant::now() < deadline, "job {key} not completed within 20 s: {:?}", env.job(list, key).await);
            let popped: Option<(String, Vec<u8>)> =
                client::cmd("BRPOP").arg(list).arg(0.3).query_async(&mut blocking).await.expect("BRPOP");
            let Some((_, item)) = popped else {
                let done = env.job(list, key).await.is_some_and(|j| j.state == JobState::Completed);
                if done && llen(env, list).await == 0 {
                    return committed.load(Ordering::SeqCst);
                }
                continue;
            };
            let seen = Arc::clone(&committed);
            let done = fence
                .process(&item, move |_ctx: JobContext| {
                    let seen = Arc::clone(&seen);
                    async move {
                        seen.fetch_add(1, Ordering::SeqCst);
                        Ok(b"done".to_vec())
                    }
                })
                .await;
            fence.requeue_popped(&item, &done).await.expect("requeue");
        }
    }

    /// Issue #12 §2 bullet 1. Guard: an item popped with `BRPOP` whose attempt ended
    /// `LeaseLost { Unconfirmed }` (heartbeats failed until the worker's own deadline passed, the
    /// row still `running` under its epoch) goes back on the list, and the job then completes
    /// exactly once. Before the fix the item was dropped as if "a newer epoch held the job": no
    /// copy anywhere, the row `running` with nothing to drive it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_list_retrofit_pushes_back_an_item_whose_lease_went_unconfirmed() {
        let env = Env::new().await;
        let list = env.name("unconfirmed");
        let store = FaultyStore::new(env.store.clone());
        let fence = list_fence(&env, store.clone(), &list, "popper", SupervisorConfig::new(lease(3)));
        lpush(&env, &list, "job-1|x").await;

        store.heartbeats_fail.store(true, Ordering::SeqCst);
        let popped: Option<(String, Vec<u8>)> =
            client::cmd("BRPOP").arg(&list).arg(1).query_async(&mut env.redis.blocking()).await.expect("BRPOP");
        let (_, item) = popped.expect("the item");
        let done = fence
            .process(&item, |_ctx: JobContext| async move {
                tokio::time::sleep(Duration::from_secs(30)).await;
                Ok(b"never".to_vec())
            })
            .await;
        assert!(
            matches!(&done.detail, Detail::Ran(Outcome::LeaseLost { reason: LossReason::Unconfirmed })),
            "{done:?}"
        );
        let row = env.job(&list, "job-1").await.expect("row");
        assert_eq!((row.state, row.epoch), (JobState::Running, 1), "the row is still ours, running");
        fence.requeue_popped(&item, &done).await.expect("requeue");
        assert_eq!(
            llen(&env, &list).await,
            1,
            "an item whose lease went unconfirmed must go back on the list (disposition {:?})",
            done.disposition
        );

        store.heartbeats_fail.store(false, Ordering::SeqCst);
        let committed = drain_until_completed(&env, &fence, &list, "job-1").await;
        assert_eq!(committed, 1, "the job completed exactly once");
        let row = env.job(&list, "job-1").await.expect("row");
        assert_eq!((row.state, row.epoch), (JobState::Completed, 2));
        env.cleanup().await;
    }

    /// Issue #12 §2 bullet 1. Guard: a commit refused (`Fenced`) although no newer epoch exists
    /// (the lease was released under the attempt, the row is `pending` at the attempt's own epoch)
    /// puts the item back. Before the fix it was dropped and the pending row had no copy left.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_list_retrofit_pushes_back_an_item_fenced_without_a_newer_holder() {
        let env = Env::new().await;
        let list = env.name("fenced");
        let fence = list_fence(&env, env.store(), &list, "popper", SupervisorConfig::new(lease(3)));
        lpush(&env, &list, "job-1|x").await;
        let popped: Option<(String, Vec<u8>)> =
            client::cmd("BRPOP").arg(&list).arg(1).query_async(&mut env.redis.blocking()).await.expect("BRPOP");
        let (_, item) = popped.expect("the item");
        let other = env.store.clone();
        let done = fence
            .process(&item, move |ctx: JobContext| {
                let other = other.clone();
                async move {
                    // Someone gives the lease back under the running attempt (an operator, a
                    // shutdown path): nobody holds a newer epoch.
                    other.release(ctx.lease()).await.map_err(JobError::retry)?;
                    Ok(b"late".to_vec())
                }
            })
            .await;
        assert!(matches!(&done.detail, Detail::Ran(Outcome::Fenced(_))), "{done:?}");
        let row = env.job(&list, "job-1").await.expect("row");
        assert_eq!((row.state, row.epoch), (JobState::Pending, 1), "no newer holder");
        fence.requeue_popped(&item, &done).await.expect("requeue");
        assert_eq!(
            llen(&env, &list).await,
            1,
            "an item fenced with no newer holder must go back on the list (disposition {:?})",
            done.disposition
        );
        assert_eq!(drain_until_completed(&env, &fence, &list, "job-1").await, 1);
        env.cleanup().await;
    }

    /// Issue #12 §2 bullet 1. Guard: a commit whose fate is unknown (`StoreError`) puts the item
    /// back, and the fence deduplicates it: it completes once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_list_retrofit_pushes_back_an_item_whose_commit_is_unknown() {
        let env = Env::new().await;
        let list = env.name("unknown");
        let store = FaultyStore::new(env.store.clone());
        let fence = list_fence(&env, store.clone(), &list, "popper", SupervisorConfig::new(lease(3)));
        lpush(&env, &list, "job-1|x").await;
        let popped: Option<(String, Vec<u8>)> =
            client::cmd("BRPOP").arg(&list).arg(1).query_async(&mut env.redis.blocking()).await.expect("BRPOP");
        let (_, item) = popped.expect("the item");
        store.commits_fail.store(true, Ordering::SeqCst);
        let done = fence.process(&item, |_ctx: JobContext| async move { Ok(b"lost?".to_vec()) }).await;
        store.commits_fail.store(false, Ordering::SeqCst);
        assert!(matches!(&done.detail, Detail::Ran(Outcome::StoreError(_))), "{done:?}");
        fence.requeue_popped(&item, &done).await.expect("requeue");
        assert_eq!(llen(&env, &list).await, 1, "disposition {:?}", done.disposition);
        assert_eq!(drain_until_completed(&env, &fence, &list, "job-1").await, 1);
        env.cleanup().await;
    }

    /// Issue #12 §2 bullet 1, the other side of the rule. Guard: when the database confirms a
    /// newer holder (a zombie's commit is fenced by epoch 2, which another worker claimed from
    /// its own copy of the item), the zombie's copy is not pushed back: the job completes once
    /// and the list is left empty.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_list_retrofit_drops_a_copy_whose_job_a_newer_epoch_holds() {
        let env = Env::new().await;
        let list = env.name("newer");
        let store = FaultyStore::new(env.store.clone());
        // The zombie: its heartbeats fail and (test switch) it runs on after its lease is gone.
        let zombie =
            list_fence(&env, store.clone(), &list, "zombie", SupervisorConfig::new(lease(3)).without_cancel_on_loss());
        let rival = list_fence(&env, env.store(), &list, "rival", SupervisorConfig::new(lease(3)));
        store.heartbeats_fail.store(true, Ordering::SeqCst);
        lpush(&env, &list, "job-1|x").await;
        lpush(&env, &list, "job-1|x").await;
        let mut blocking = env.redis.blocking();
        let popped: Option<(String, Vec<u8>)> =
            client::cmd("BRPOP").arg(&list).arg(1).query_async(&mut blocking).await.expect("BRPOP");
        let (_, zombie_item) = popped.expect("copy 1");
        let z = zombie.clone();
        let zombie_run = tokio::spawn(async move {
            let done = z
                .process(&zombie_item, |_ctx: JobContext| async move {
                    tokio::time::sleep(Duration::from_millis(5000)).await;
                    Ok(b"zombie".to_vec())
                })
                .await;
            z.requeue_popped(&zombie_item, &done).await.expect("requeue");
            done
        });
        // The rival takes copy 2 once the zombie's lease has lapsed in the database.
        let key = JobKey::new("job-1").expect("key");
        let q = QueueName::new(list.as_str()).expect("queue");
        wait_for("the zombie's lease to lapse", Duration::from_secs(10), || {
            let (store, q, key) = (env.store.clone(), q.clone(), key.clone());
            async move {
                let now = store.db_now().await.ok()?;
                let job = store.job(&q, &key).await.ok()??;
                job.lease_until.is_some_and(|u| u < now).then_some(())
            }
        })
        .await;
        let popped: Option<(String, Vec<u8>)> =
            client::cmd("BRPOP").arg(&list).arg(1).query_async(&mut blocking).await.expect("BRPOP");
        let (_, rival_item) = popped.expect("copy 2");
        let done = rival.process(&rival_item, |_ctx: JobContext| async move { Ok(b"rival".to_vec()) }).await;
        assert!(done.should_ack(), "{done:?}");
        let zombie_done = zombie_run.await.expect("zombie task");
        assert!(matches!(&zombie_done.detail, Detail::Ran(Outcome::Fenced(_))), "{zombie_done:?}");
        assert_eq!(llen(&env, &list).await, 0, "the zombie's copy was pushed back although epoch 2 completed the job");
        let row = env.job(&list, "job-1").await.expect("row");
        assert_eq!((row.state, row.epoch), (JobState::Completed, 2));
        env.cleanup().await;
    }

    fn stream_source(env: &Env, stream: &str) -> StreamSource {
        StreamSource::new(env.redis.clone(), QueueName::new(stream).expect("queue"), stream, "g")
            .expect("source")
            .key_from(KeyFrom::Field("key".into()))
            .block(Duration::from_millis(200))
            .autoclaim_every(Duration::from_millis(100))
    }

    /// Delivery count of entry `id` in group `g` (None when it is not pending).
    async fn deliveries(env: &Env, stream: &str, id: &str) -> Option<i64> {
        let rows: Result<Vec<(String, String, i64, i64)>, _> =
            client::cmd("XPENDING").arg(stream).arg("g").arg("-").arg("+").arg(100).query_async(&mut env.conn()).await;
        rows.ok()?.into_iter().find(|r| r.0 == id).map(|r| r.3)
    }

    /// Issue #12 §3 bullet 1 (the reproduction, scaled down: a retry backoff longer than the
    /// visibility hint, and a delivery limit of 2 instead of 10). Guard: the delivery count is a
    /// hint. While the database says the job is retryable (`failed`, backing off), its entry stays
    /// pending however often it is auto-claimed; when the database says `dead` (out of attempts)
    /// the entry is moved to `{stream}:dead` once, with the database's reason. Before the fix the
    /// entry was in `{stream}:dead` with "delivered 3 times" while its row was `failed`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_stream_dead_letters_only_when_the_database_says_dead() {
        let env = Env::new().await;
        let stream = env.name("retrying");
        let dead_stream = format!("{{{stream}}}:dead");
        let id = xadd_job(&mut env.conn(), &stream, "job-1", "x").await;
        let attempts = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&attempts);
        let handler = move |_ctx: JobContext| {
            let seen = Arc::clone(&seen);
            async move {
                seen.fetch_add(1, Ordering::SeqCst);
                Err::<Vec<u8>, _>(JobError::retry("upstream keeps failing"))
            }
        };
        let retry = RetryPolicy {
            max_attempts: 3,
            base_backoff: Duration::from_millis(1500),
            max_backoff: Duration::from_secs(300),
        };
        let config = ConsumerConfig::new(SupervisorConfig::new(lease(3)).retry(retry))
            .concurrency(2)
            .grace(Duration::from_millis(500))
            .ack_batching(10, Duration::from_millis(5));
        let source = stream_source(&env, &stream).max_deliveries(2).visibility(Duration::from_millis(300));
        let c = spawn_consumer(source, env.store(), "w", config, handler);

        // During the first backoff (1.5 s) the entry is auto-claimed every ~0.3 s.
        wait_for("four deliveries during the backoff, or a dead letter", Duration::from_secs(10), || {
            let (env, stream, dead_stream, id) = (&env, stream.clone(), dead_stream.clone(), id.clone());
            async move {
                let dead = xrange(&mut env.conn(), &dead_stream).await;
                let n = deliveries(env, &stream, &id).await.unwrap_or(0);
                (!dead.is_empty() || n >= 4).then_some(())
            }
        })
        .await;
        let dead = xrange(&mut env.conn(), &dead_stream).await;
        let row = env.job(&stream, "job-1").await.expect("row");
        assert!(
            dead.is_empty(),
            "entry dead-lettered by its delivery count while its row is {} (attempts {}): {:?}",
            row.state,
            row.attempts,
            dead.iter().map(|(_, f)| field_of(f, "dead.reason")).collect::<Vec<_>>()
        );
        assert!(row.state != JobState::Dead && row.attempts < 3, "still retryable: {row:?}");

        // Out of attempts: the database says dead, and the entry moves once, with its reason.
        wait_for("the job dead and its entry dead-lettered", Duration::from_secs(15), || {
            let (env, stream, dead_stream) = (&env, stream.clone(), dead_stream.clone());
            async move {
                let row = env.job(&stream, "job-1").await?;
                let dead = xrange(&mut env.conn(), &dead_stream).await;
                (row.state == JobState::Dead && !dead.is_empty()).then_some(())
            }
        })
        .await;
        // A few more sweeps: nothing moves twice.
        tokio::time::sleep(Duration::from_millis(800)).await;
        let s = c.shutdown(Duration::from_secs(5)).await;
        let dead = xrange(&mut env.conn(), &dead_stream).await;
        assert_eq!(dead.len(), 1, "moved once: {dead:?}");
        assert_eq!(field_of(&dead[0].1, "dead.id").as_deref(), Some(id.as_str()));
        assert_eq!(field_of(&dead[0].1, "dead.reason").as_deref(), Some("upstream keeps failing"));
        assert_eq!(attempts.load(Ordering::SeqCst), 3, "{s}");
        assert_eq!(pending_count(&mut env.conn(), &stream, "g").await, 0);
        env.cleanup().await;
    }

    /// Issue #12 §3 bullet 1, the live-holder case. Guard: a rival that keeps auto-claiming a
    /// live holder's entry (its visibility hint far below the heartbeat) sees `Busy` from the
    /// database and holds the entry back; it never dead-letters it by delivery count, and the
    /// holder commits and acknowledges it. Before the fix the rival moved the live job's entry to
    /// the dead-letter stream after two deliveries.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn edges_stream_never_dead_letters_a_live_holders_entry() {
        let env = Env::new().await;
        let stream = env.name("live");
        let dead_stream = format!("{{{stream}}}:dead");
        xadd_job(&mut env.conn(), &stream, "job-1", "x").await;
        let started = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&started);
        let holder = spawn_consumer(
            stream_source(&env, &stream),
            env.store(),
            "holder",
            consumer_config(3, 2),
            move |_ctx: JobContext| {
                let flag = Arc::clone(&flag);
                async move {
                    flag.store(true, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(3500)).await;
                    Ok(b"held".to_vec())
                }
            },
        );
        wait_for("the holder to start", Duration::from_secs(5), || {
            let s = started.load(Ordering::SeqCst);
            async move { s.then_some(()) }
        })
        .await;
        let rival = spawn_consumer(
            stream_source(&env, &stream).max_deliveries(1).visibility(Duration::from_millis(1)),
            env.store(),
            "rival",
            consumer_config(3, 2),
            |_ctx: JobContext| async move { Ok(b"rival".to_vec()) },
        );
        wait_for("the holder's commit", Duration::from_secs(10), || {
            let s = holder.snapshot();
            async move { (s.completions == 1 && s.acks == 1).then_some(()) }
        })
        .await;
        let r = rival.shutdown(Duration::from_secs(5)).await;
        holder.shutdown(Duration::from_secs(5)).await;
        let dead = xrange(&mut env.conn(), &dead_stream).await;
        assert!(
            dead.is_empty(),
            "a live holder's entry was dead-lettered: {:?} (rival {r})",
            dead.iter().map(|(_, f)| field_of(f, "dead.reason")).collect::<Vec<_>>()
        );
        assert!(r.busy > 0, "the rival saw the holder's lease: {r}");
        let row = env.job(&stream, "job-1").await.expect("row");
        assert_eq!((row.state, row.epoch), (JobState::Completed, 1));
        assert_eq!(pending_count(&mut env.conn(), &stream, "g").await, 0);
        env.cleanup().await;
    }

    fn lease_of(queue: &str, key: &str, owner: &str, epoch: i64) -> Lease {
        Lease {
            queue: QueueName::new(queue).expect("queue"),
            key: JobKey::new(key).expect("key"),
            epoch,
            owner: Owner::new(owner).expect("owner"),
            lease_until: DbTime(0),
            ttl: Duration::from_secs(3),
            attempts: epoch,
        }
    }

    fn receive_ctx(owner: &str) -> ReceiveContext {
        ReceiveContext { owner: Owner::new(owner).expect("owner"), lease: lease(3), shutdown: Default::default() }
    }

    /// The one delivery a receive returned.
    fn only_delivery(got: Vec<Incoming<StreamDelivery>>) -> StreamDelivery {
        assert_eq!(got.len(), 1, "{got:?}");
        match got.into_iter().next() {
            Some(Incoming::Unclaimed { delivery, .. }) => delivery,
            other => panic!("{other:?}"),
        }
    }

    /// The consumer that holds entry `id` in group `g`.
    async fn holder_of(env: &Env, stream: &str, id: &str) -> Option<String> {
        pending_rows(&mut env.conn(), stream, "g").await.into_iter().find(|r| r.0 == id).map(|r| r.1)
    }

    /// Issue #12 §4 bullet 2 (Redis part). Guard: the stream source's extend (the heartbeat's
    /// `XCLAIM … JUSTID`) is never applied for a lease that is no longer the newest. A worker that
    /// froze between the database's renewal answer and its `XCLAIM` sends it after another
    /// consumer auto-claimed the entry and the database gave that consumer epoch 2: the entry stays
    /// with the new holder, whether the new holder's lease key is set yet or not. The live holder
    /// still takes its entry back from a rival that only held it back (`Busy`). Before the fix the
    /// stale `XCLAIM` moved the entry back to the stale worker.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_stream_extend_skips_a_stale_lease_after_a_takeover() {
        let env = Env::new().await;
        let stream = env.name("takeover");
        let id = xadd_job(&mut env.conn(), &stream, "job-1", "x").await;
        let old_src = stream_source(&env, &stream);
        let d_old = only_delivery(old_src.receive(10, &receive_ctx("old")).await.expect("receive"));
        let l1 = lease_of(&stream, "job-1", "old", 1);
        old_src.extend(&[(l1.clone(), d_old.clone())]).await.expect("extend");
        let lease_key = d_old.lease_key().expect("lease key").to_owned();
        assert_eq!(old_src.leases().holder(&lease_key).await.expect("GET").as_deref(), Some("old:1"));

        // The old worker freezes; its lease and its lease key run out; a new consumer auto-claims
        // the entry and the database hands it epoch 2.
        let _: i64 = client::cmd("DEL").arg(&lease_key).query_async(&mut env.conn()).await.expect("DEL");
        let new_src = stream_source(&env, &stream).visibility(Duration::from_millis(50));
        tokio::time::sleep(Duration::from_millis(120)).await;
        let d_new = only_delivery(new_src.receive(10, &receive_ctx("new")).await.expect("autoclaim"));
        assert_eq!(d_new.id(), id);
        assert_eq!(holder_of(&env, &stream, &id).await.as_deref(), Some("new"));

        // The frozen worker wakes up and sends the XCLAIM of its renewal answer (epoch 1).
        let _ = old_src.extend(&[(l1.clone(), d_old.clone())]).await;
        assert_eq!(
            holder_of(&env, &stream, &id).await.as_deref(),
            Some("new"),
            "a stale XCLAIM (epoch 1, before the new holder's first renewal) took the entry back"
        );
        let l2 = lease_of(&stream, "job-1", "new", 2);
        new_src.extend(&[(l2.clone(), d_new.clone())]).await.expect("extend");
        assert_eq!(new_src.leases().holder(&lease_key).await.expect("GET").as_deref(), Some("new:2"));
        let _ = old_src.extend(&[(l1.clone(), d_old.clone())]).await;
        assert_eq!(
            holder_of(&env, &stream, &id).await.as_deref(),
            Some("new"),
            "a stale XCLAIM (epoch 1, after the new holder's renewal) took the entry back"
        );
        assert_eq!(new_src.leases().holder(&lease_key).await.expect("GET").as_deref(), Some("new:2"));

        // A rival that found the job Busy holds the entry back (XCLAIM to itself); the live holder
        // takes it back on its next renewal.
        let _: client::Value = client::cmd("XCLAIM")
            .arg(&stream)
            .arg("g")
            .arg("rival")
            .arg(0)
            .arg(&id)
            .arg("JUSTID")
            .query_async(&mut env.conn())
            .await
            .expect("XCLAIM");
        new_src.extend(&[(l2, d_new)]).await.expect("extend");
        assert_eq!(holder_of(&env, &stream, &id).await.as_deref(), Some("new"), "the live holder keeps its entry");
        env.cleanup().await;
    }

    /// Issue #12 §1 bullet 2 (Redis part). Guard: a blocking read against a stalled Redis (a
    /// private server under SIGSTOP: connections open, no answers) fails with a timeout error after
    /// its block time plus a margin instead of waiting for ever. Before the fix the blocking
    /// connection had no response timeout and the receive never returned.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_stream_receive_fails_fast_when_redis_stalls() {
        let redis = PrivateRedis::start().await;
        let conns = RedisConnections::connect(&redis.url()).await.expect("connect");
        let source = StreamSource::new(conns, QueueName::new("stalled").expect("queue"), "stalled", "g")
            .expect("source")
            .block(Duration::from_millis(200))
            .autoclaim_every(Duration::from_secs(60));
        let ctx = receive_ctx("w");
        assert!(source.receive(10, &ctx).await.expect("first receive").is_empty());
        redis.pause();
        let sent = Instant::now();
        let got = tokio::time::timeout(Duration::from_secs(8), source.receive(10, &ctx)).await;
        let took = sent.elapsed();
        redis.resume();
        let got = got.unwrap_or_else(|_| panic!("receive still waiting on a stalled Redis after {took:?}"));
        let err = got.expect_err("a stalled Redis is an error");
        assert!(matches!(err, SourceError::Transient(_)), "{err}");
        assert!(err.to_string().contains("did not answer within"), "{err}");
        assert!(took < Duration::from_millis(2500), "block 200 ms + margin 1 s, took {took:?}");
        // And it works again once the server is back.
        assert!(source.receive(10, &ctx).await.expect("receive after the stall").is_empty());
    }

    /// Issue #12 §1 bullet 2 (Redis part) and the rule "a slow broker may cost a hint, never a
    /// healthy lease". Guard: Redis stalled (SIGSTOP) for 4.5 s, longer than the 3 s lease, while
    /// a Streams consumer runs a 6 s job: the database lease is renewed on time throughout (every
    /// Redis call on the heartbeat path gives up within a quarter of the lease), the job commits
    /// at epoch 1, and its entry is acknowledged once Redis is back. Before the fix the heartbeat
    /// waited on the stalled `XCLAIM` and lease-key scripts and the attempt was cancelled
    /// `Unconfirmed` with its row still `running` under its own owner.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn edges_redis_stall_longer_than_the_lease_costs_no_database_lease() {
        let redis = PrivateRedis::start().await;
        let env = Env::on(&redis.url()).await;
        let stream = env.name("stall");
        xadd_job(&mut env.conn(), &stream, "job-1", "x").await;
        let started = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&started);
        let c = spawn_consumer(
            stream_source(&env, &stream),
            env.store(),
            "holder",
            consumer_config(3, 2),
            move |_ctx: JobContext| {
                let flag = Arc::clone(&flag);
                async move {
                    flag.store(true, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_secs(6)).await;
                    Ok(b"done".to_vec())
                }
            },
        );
        wait_for("the job to start", Duration::from_secs(5), || {
            let s = started.load(Ordering::SeqCst);
            async move { s.then_some(()) }
        })
        .await;
        redis.pause();
        tokio::time::sleep(Duration::from_millis(4500)).await;
        let during = c.snapshot();
        redis.resume();
        wait_for("the commit, or a lost lease", Duration::from_secs(10), || {
            let s = c.snapshot();
            async move { (s.completions == 1 || s.lease_losses > 0).then_some(()) }
        })
        .await;
        let s = c.snapshot();
        assert_eq!(s.lease_losses, 0, "a Redis stall cost a healthy database lease: {s} (during the stall: {during})");
        assert_eq!(s.completions, 1, "{s}");
        wait_for("the entry acknowledged", Duration::from_secs(10), || {
            let env = &env;
            let stream = stream.clone();
            async move { (pending_count(&mut env.conn(), &stream, "g").await == 0).then_some(()) }
        })
        .await;
        c.shutdown(Duration::from_secs(5)).await;
        let row = env.job(&stream, "job-1").await.expect("row");
        assert_eq!((row.state, row.epoch), (JobState::Completed, 1));
        env.cleanup().await;
    }

    /// Issue #12 §1 bullet 2 (Redis part). Guard: against a stalled Redis (SIGSTOP) every kind of
    /// call fails with the typed [`RedisError::Timeout`] within its configured bound: a lease-key
    /// call within the response timeout, the heartbeat's renewal within a quarter of the lease,
    /// the list retrofit's push back, a source's ack, and connecting at all.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_redis_calls_time_out_with_a_typed_error_within_their_bound() {
        let redis = PrivateRedis::start().await;
        let response = Duration::from_millis(300);
        let timeouts = RedisTimeouts::default().response(response).connect(Duration::from_millis(300));
        let conns = RedisConnections::connect_with(&redis.url(), timeouts).await.expect("connect");
        let leases = LeaseKeys::new(conns.commands(), "stalled").timeout(response);
        let stream = StreamSource::new(conns.clone(), QueueName::new("stalled").expect("queue"), "stalled", "g")
            .expect("source")
            .block(Duration::from_millis(100));
        let ctx = receive_ctx("w");
        assert!(stream.receive(10, &ctx).await.expect("receive").is_empty());
        let _: String = client::cmd("XADD")
            .arg("stalled")
            .arg("*")
            .arg("key")
            .arg("k")
            .arg("body")
            .arg("x")
            .query_async(&mut conns.commands())
            .await
            .expect("XADD");
        let d = only_delivery(stream.receive(10, &ctx).await.expect("receive"));
        redis.pause();
        // Slack for a loaded machine: the bound plus 500 ms.
        let within = |bound: Duration, sent: Instant| {
            let took = sent.elapsed();
            assert!(took < bound + Duration::from_millis(500), "took {took:?} for a bound of {bound:?}");
        };

        let sent = Instant::now();
        let e = leases.renew(&[("k".into(), "w:1".into())], Duration::from_secs(3)).await.expect_err("stalled");
        within(response, sent);
        assert!(matches!(e, RedisError::Timeout { command: "EVALSHA renew", after } if after == response), "{e}");
        assert!(e.is_timeout() && !e.is_fatal());

        // The heartbeat's renewal of a 0.8 s lease gives up after 200 ms (a quarter of it).
        let mut short = lease_of("stalled", "k", "w", 1);
        short.ttl = Duration::from_millis(800);
        let sent = Instant::now();
        let e = leases.confirm(&[("k".into(), &short)]).await.expect_err("stalled");
        within(Duration::from_millis(200), sent);
        assert!(matches!(e, RedisError::Timeout { after, .. } if after == Duration::from_millis(200)), "{e}");

        let sent = Instant::now();
        let e = stream.ack(vec![d]).await.expect_err("stalled");
        within(response, sent);
        assert!(matches!(e, SourceError::Transient(_)) && e.to_string().contains("did not answer"), "{e}");

        let store: Arc<dyn FenceStore> = Arc::new(PgFence::connect(&database_url()).await.expect("pg"));
        let fence = ListRetrofit::new(
            store,
            QueueName::new("stalled").expect("queue"),
            SupervisorConfig::new(lease(3)),
            &conns,
            "stalled-list",
            ItemKey::Split(b'|'),
        )
        .expect("retrofit")
        .command_timeout(response);
        let unsettled = Processed::new(Disposition::Abandon, Detail::Ran(Outcome::Released));
        // The push-back's try is bounded too; the item Redis did not take is held (issue #30
        // item 3), not handed back as an error that the caller's `?` would drop.
        let sent = Instant::now();
        fence.requeue_popped(b"k|x", &unsettled).await.expect("held, not lost");
        within(response, sent);
        assert_eq!(fence.held(), 1, "the item Redis did not take is held");

        let sent = Instant::now();
        let e = RedisConnections::connect_with(&redis.url(), timeouts).await.expect_err("stalled");
        within(Duration::from_millis(900), sent);
        assert!(e.is_timeout(), "{e}");
        redis.resume();
        fence.flush(Duration::from_secs(10)).await.expect("the held item is sent once Redis answers");
    }
}
