//! Issue #12, the consumer runtime's edges: cancellation-safe receives and claims at shutdown
//! (§2 bullet 2), bounded memory while a broker hangs (§2 bullet 4), and dead letters counted only
//! when they moved (§3 bullet 4). Real PostgreSQL (and SQLite where the store does not matter).

#[cfg(feature = "sqs")]
use brokerfence_testkit::sqs as sqs_support;
use brokerfence_testkit::store as common;

mod edges {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use async_trait::async_trait;
    use brokerfence::TableQueue;
    use brokerfence::{
        self, Claim, ClaimedJob, DbTime, FailOutcome, FenceStore, Heartbeat, JobContext, JobKey, JobRecord, JobState,
        Lease, LeaseDuration, Owner, QueueName, RetryPolicy, SupervisorConfig,
    };
    use brokerfence::{Consumer, ConsumerConfig, Incoming, ReceiveContext, Retrofit, Source, SourceError};
    use tokio::sync::Notify;
    use tokio_util::sync::CancellationToken;

    use super::common;

    // --------------------------------------------------------------------------------------------
    // A store whose claims answer late: the database has committed the claim, the caller is still
    // waiting. That is the window a cancelled receive or claim falls into.
    // --------------------------------------------------------------------------------------------

    /// Wraps a store; once `armed`, every `claim_next` / `claim_batch` that claimed something
    /// signals `claimed` right after the database answered and then waits `delay` before
    /// returning.
    struct LateClaims {
        inner: Arc<dyn FenceStore>,
        delay: Duration,
        armed: AtomicBool,
        claimed: Notify,
    }

    impl LateClaims {
        fn new(inner: Arc<dyn FenceStore>, delay: Duration) -> Arc<Self> {
            Arc::new(Self { inner, delay, armed: AtomicBool::new(true), claimed: Notify::new() })
        }

        async fn late(&self, claimed_something: bool) {
            if claimed_something && self.armed.load(Ordering::SeqCst) {
                self.claimed.notify_one();
                tokio::time::sleep(self.delay).await;
            }
        }
    }

    #[async_trait]
    impl FenceStore for LateClaims {
        async fn migrate(&self) -> fence::Result<()> {
            self.inner.migrate().await
        }
        async fn claim_batch(
            &self,
            queue: &QueueName,
            keys: &[JobKey],
            owner: &Owner,
            lease: LeaseDuration,
        ) -> fence::Result<Vec<Claim>> {
            let out = self.inner.claim_batch(queue, keys, owner, lease).await;
            let claimed = out.as_ref().is_ok_and(|c| c.iter().any(|c| matches!(c, Claim::Claimed(_))));
            self.late(claimed).await;
            out
        }
        async fn enqueue_many(&self, queue: &QueueName, jobs: &[(JobKey, Vec<u8>)]) -> fence::Result<u64> {
            self.inner.enqueue_many(queue, jobs).await
        }
        async fn claim_next(
            &self,
            queue: &QueueName,
            owner: &Owner,
            lease: LeaseDuration,
            n: u32,
        ) -> fence::Result<Vec<ClaimedJob>> {
            let out = self.inner.claim_next(queue, owner, lease, n).await;
            self.late(out.as_ref().is_ok_and(|j| !j.is_empty())).await;
            out
        }
        async fn heartbeat(&self, leases: &[Lease], lease: LeaseDuration) -> fence::Result<Heartbeat> {
            self.inner.heartbeat(leases, lease).await
        }
        async fn checkpoint(&self, lease: &Lease, progress: &[u8]) -> fence::Result<()> {
            self.inner.checkpoint(lease, progress).await
        }
        async fn complete(&self, lease: &Lease, result: &[u8]) -> fence::Result<()> {
            self.inner.complete(lease, result).await
        }
        async fn complete_batch(&self, items: &[(Lease, Vec<u8>)]) -> fence::Result<Vec<fence::Result<()>>> {
            self.inner.complete_batch(items).await
        }
        async fn fail(
            &self,
            lease: &Lease,
            error: &str,
            retry: bool,
            policy: &RetryPolicy,
        ) -> fence::Result<FailOutcome> {
            self.inner.fail(lease, error, retry, policy).await
        }
        async fn release(&self, lease: &Lease) -> fence::Result<()> {
            self.inner.release(lease).await
        }
        async fn job(&self, queue: &QueueName, key: &JobKey) -> fence::Result<Option<JobRecord>> {
            self.inner.job(queue, key).await
        }
        async fn db_now(&self) -> fence::Result<DbTime> {
            self.inner.db_now().await
        }
        fn wakeups(&self, queue: &brokerfence::QueueName) -> brokerfence::Wakeups {
            self.inner.wakeups(queue)
        }
        async fn next_due(&self, queue: &brokerfence::QueueName) -> brokerfence::Result<Option<std::time::Duration>> {
            self.inner.next_due(queue).await
        }
        fn backend(&self) -> brokerfence::Backend<'_> {
            self.inner.backend()
        }
    }

    async fn pg() -> Arc<dyn FenceStore> {
        Arc::new(common::pg().await)
    }

    fn keys(prefix: &str, n: usize) -> Vec<JobKey> {
        (0..n).map(|i| common::key(&format!("{prefix}-{i}"))).collect()
    }

    async fn enqueue(store: &dyn FenceStore, queue: &QueueName, keys: &[JobKey]) {
        let jobs: Vec<(JobKey, Vec<u8>)> = keys.iter().map(|k| (k.clone(), b"x".to_vec())).collect();
        assert_eq!(store.enqueue_many(queue, &jobs).await.expect("enqueue") as usize, keys.len());
    }

    async fn row(store: &dyn FenceStore, queue: &QueueName, key: &JobKey) -> JobRecord {
        store.job(queue, key).await.expect("read job").expect("job row exists")
    }

    /// Every key's row, as (key, state, attempts, owner).
    async fn rows(store: &dyn FenceStore, queue: &QueueName, keys: &[JobKey]) -> Vec<(String, JobState, i64)> {
        let mut out = Vec::new();
        for k in keys {
            let r = row(store, queue, k).await;
            out.push((k.as_str().to_owned(), r.state, r.attempts));
        }
        out
    }

    /// Asserts that every job is pending again with no attempt spent (released, not orphaned).
    async fn assert_released(store: &dyn FenceStore, queue: &QueueName, keys: &[JobKey], what: &str) {
        let rows = rows(store, queue, keys).await;
        let orphaned: Vec<_> = rows.iter().filter(|(_, s, a)| *s != JobState::Pending || *a != 0).collect();
        assert!(
            orphaned.is_empty(),
            "{what}: jobs claimed but never started must be released (pending, attempt not spent) when `run` \
             returns; found (key, state, attempts): {orphaned:?}"
        );
    }

    fn handler_counting(
        ran: Arc<AtomicUsize>,
    ) -> impl Fn(JobContext) -> futures::future::BoxFuture<'static, Result<Vec<u8>, fence::JobError>>
    + Clone
    + Send
    + Sync
    + 'static {
        move |_ctx: JobContext| {
            let ran = Arc::clone(&ran);
            Box::pin(async move {
                ran.fetch_add(1, Ordering::SeqCst);
                Ok(b"done".to_vec())
            })
        }
    }

    /// Issue #12 §2 bullet 2 (table queue). Guard: a receive in progress is not dropped at
    /// shutdown. The table queue claims in its receive; the store answers 500 ms after the
    /// database committed the claim, and shutdown fires in between. The receive must be allowed
    /// to finish and its jobs released: right after `run` returns they are pending again with
    /// their attempt not spent. (Dropping the receive left them `running` under the dead
    /// consumer's owner, an attempt spent, until the lease ran out.)
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_shutdown_during_a_table_claim_releases_the_claimed_jobs() {
        let db = pg().await;
        let late = LateClaims::new(Arc::clone(&db), Duration::from_millis(500));
        let store: Arc<dyn FenceStore> = late.clone();
        let queue = QueueName::new("late-claim").expect("queue");
        let keys = keys("job", 5);
        enqueue(&*db, &queue, &keys).await;
        let config = ConsumerConfig::new(SupervisorConfig::new(common::lease(20)))
            .concurrency(8)
            .batch(8)
            .grace(Duration::from_secs(5));
        let consumer = Consumer::new(TableQueue::new(Arc::clone(&store), queue.clone()), store, config);
        let ran = Arc::new(AtomicUsize::new(0));
        let stop = CancellationToken::new();
        let run = tokio::spawn({
            let (stop, ran) = (stop.clone(), Arc::clone(&ran));
            async move { consumer.run(handler_counting(ran), stop).await }
        });
        tokio::time::timeout(Duration::from_secs(10), late.claimed.notified()).await.expect("the jobs were claimed");
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(20), run)
            .await
            .expect("shutdown in time")
            .expect("join")
            .expect("run");
        assert_eq!(ran.load(Ordering::SeqCst), 0, "no job should have started after shutdown");
        assert_released(&*db, &queue, &keys, "claim in flight at shutdown").await;
    }

    /// Issue #12 §2 bullet 2 (prefetch path). Guard: claimed jobs waiting for a handler slot at
    /// shutdown are released, not started. One handler slot, four prefetch places: one job runs
    /// (1 s), four wait under heartbeated leases. At shutdown the running one finishes within the
    /// grace and the four are released at once (pending, no attempt spent); before, each got the
    /// slot in turn and ran during the grace period.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_prefetched_jobs_waiting_for_a_slot_are_released_at_shutdown() {
        let store = pg().await;
        let queue = QueueName::new("prefetch-stop").expect("queue");
        let keys = keys("job", 5);
        enqueue(&*store, &queue, &keys).await;
        let config = ConsumerConfig::new(SupervisorConfig::new(common::lease(20)))
            .concurrency(1)
            .prefetch(4)
            .batch(5)
            .grace(Duration::from_secs(10));
        let consumer = Arc::new(Consumer::new(
            TableQueue::new(Arc::clone(&store), queue.clone()).idle_wait(Duration::from_millis(20)),
            Arc::clone(&store),
            config,
        ));
        let started: Arc<Mutex<Vec<String>>> = Arc::default();
        let stop = CancellationToken::new();
        let run = tokio::spawn({
            let (consumer, stop, started) = (Arc::clone(&consumer), stop.clone(), Arc::clone(&started));
            async move {
                let handler = move |ctx: JobContext| {
                    let started = Arc::clone(&started);
                    async move {
                        started.lock().expect("lock").push(ctx.key().as_str().to_owned());
                        tokio::time::sleep(Duration::from_secs(1)).await;
                        Ok(b"done".to_vec())
                    }
                };
                consumer.run(handler, stop).await
            }
        });
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !(consumer.supervisor().in_flight() == 5 && started.lock().expect("lock").len() == 1) {
            assert!(tokio::time::Instant::now() < deadline, "1 running and 4 waiting never reached");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(20), run)
            .await
            .expect("shutdown in time")
            .expect("join")
            .expect("run");
        let started = started.lock().expect("lock").clone();
        assert_eq!(started.len(), 1, "jobs waiting for a handler slot started after shutdown: {started:?}");
        let first = common::key(&started[0]);
        assert_eq!(row(&*store, &queue, &first).await.state, JobState::Completed);
        let rest: Vec<JobKey> = keys.iter().filter(|k| **k != first).cloned().collect();
        assert_released(&*store, &queue, &rest, "prefetched at shutdown").await;
        assert!(consumer.metrics().snapshot().releases >= 4, "{}", consumer.metrics().snapshot());
    }

    // --------------------------------------------------------------------------------------------
    // A broker-like source that hands out each key once, and records what it is told.
    // --------------------------------------------------------------------------------------------

    /// Hands out `keys` as unclaimed deliveries (Delivery = the key's index), then nothing.
    /// Malformed deliveries come from `malformed` (their index is the delivery).
    struct Listed {
        queue: QueueName,
        pending: Mutex<Vec<Incoming<usize>>>,
        abandoned: Mutex<Vec<usize>>,
        dead_lettered: Mutex<Vec<usize>>,
        /// `dead_letter` fails for these deliveries (a queue without a dead-letter target).
        dead_letter_fails: Vec<usize>,
        dead_letter_calls: AtomicUsize,
    }

    impl Listed {
        fn new(queue: QueueName, items: Vec<Incoming<usize>>) -> Self {
            Self {
                queue,
                pending: Mutex::new(items),
                abandoned: Mutex::default(),
                dead_lettered: Mutex::default(),
                dead_letter_fails: Vec::new(),
                dead_letter_calls: AtomicUsize::new(0),
            }
        }
    }

    #[async_trait]
    impl Source for Listed {
        type Delivery = usize;

        fn queue(&self) -> &QueueName {
            &self.queue
        }

        async fn receive(&self, max: usize, _ctx: &ReceiveContext) -> Result<Vec<Incoming<usize>>, SourceError> {
            let out: Vec<_> = {
                let mut pending = self.pending.lock().expect("lock");
                let n = max.min(pending.len());
                pending.drain(..n).collect()
            };
            if out.is_empty() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(out)
        }

        async fn dead_letter(&self, delivery: usize, _reason: &str) -> Result<(), SourceError> {
            self.dead_letter_calls.fetch_add(1, Ordering::SeqCst);
            if self.dead_letter_fails.contains(&delivery) {
                return Err(SourceError::Transient("the queue has no dead-letter target".into()));
            }
            self.dead_lettered.lock().expect("lock").push(delivery);
            Ok(())
        }

        async fn abandon(&self, delivery: usize) -> Result<(), SourceError> {
            self.abandoned.lock().expect("lock").push(delivery);
            Ok(())
        }
    }

    /// Issue #12 §2 bullet 2 / task item 4 (`claim_and_start` at shutdown). Guard: a group claim
    /// that the database committed while shutdown fired is not lost: its jobs are released and
    /// their deliveries given back to the broker before `run` returns.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_shutdown_during_a_group_claim_releases_and_gives_back() {
        let db = pg().await;
        let late = LateClaims::new(Arc::clone(&db), Duration::from_millis(500));
        let store: Arc<dyn FenceStore> = late.clone();
        let queue = QueueName::new("late-group").expect("queue");
        let keys = keys("msg", 4);
        let items =
            keys.iter().enumerate().map(|(i, k)| Incoming::Unclaimed { delivery: i, key: k.clone(), payload: vec![] });
        let config = ConsumerConfig::new(SupervisorConfig::new(common::lease(20)))
            .concurrency(8)
            .batch(8)
            .grace(Duration::from_secs(5));
        let consumer = Arc::new(Consumer::new(Listed::new(queue.clone(), items.collect()), store, config));
        let ran = Arc::new(AtomicUsize::new(0));
        let stop = CancellationToken::new();
        let run = tokio::spawn({
            let (consumer, stop, ran) = (Arc::clone(&consumer), stop.clone(), Arc::clone(&ran));
            async move { consumer.run(handler_counting(ran), stop).await }
        });
        tokio::time::timeout(Duration::from_secs(10), late.claimed.notified()).await.expect("the keys were claimed");
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(20), run)
            .await
            .expect("shutdown in time")
            .expect("join")
            .expect("run");
        assert_eq!(ran.load(Ordering::SeqCst), 0, "no job should have started after shutdown");
        assert_released(&*db, &queue, &keys, "group claim in flight at shutdown").await;
        let mut abandoned = consumer.source().abandoned.lock().expect("lock").clone();
        abandoned.sort_unstable();
        assert_eq!(abandoned, vec![0, 1, 2, 3], "every delivery is given back to the broker");
    }

    /// Issue #12 §3 bullet 4 (runtime part). Guard: `dead_letters` counts moves that happened.
    /// Two malformed deliveries; the source's dead-letter move fails for one (a queue without a
    /// dead-letter target) and succeeds for the other: the counter says 1 (it said 2, counting
    /// before the move), and the log says the failed one will come back and be dead-lettered
    /// again, not that the fence will deduplicate it (it has no key).
    #[tokio::test]
    async fn edges_dead_letters_count_only_moves_that_succeeded() {
        let logs = LogCapture::default();
        let _guard = tracing::subscriber::set_default(
            tracing_subscriber::fmt()
                .with_writer(logs.clone())
                .with_ansi(false)
                .with_max_level(tracing::Level::WARN)
                .finish(),
        );
        let store: Arc<dyn FenceStore> = Arc::new(common::sqlite().await);
        let queue = QueueName::new("malformed").expect("queue");
        let items = vec![
            Incoming::Malformed { delivery: 0, reason: "body is not JSON".into() },
            Incoming::Malformed { delivery: 1, reason: "no key attribute".into() },
        ];
        let mut source = Listed::new(queue, items);
        source.dead_letter_fails = vec![0];
        let consumer = Consumer::new(source, store, ConsumerConfig::new(SupervisorConfig::new(common::lease(10))));
        let stop = CancellationToken::new();
        let ran = Arc::new(AtomicUsize::new(0));
        let run = consumer.run(handler_counting(ran), stop.clone());
        let watch = async {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
            while consumer.source().dead_letter_calls.load(Ordering::SeqCst) < 2 {
                assert!(tokio::time::Instant::now() < deadline, "the source was never asked to dead-letter both");
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            stop.cancel();
        };
        let (result, ()) = tokio::join!(run, watch);
        result.expect("run");
        assert_eq!(*consumer.source().dead_lettered.lock().expect("lock"), vec![1]);
        let m = consumer.metrics().snapshot();
        assert_eq!(m.dead_letters, 1, "a failed dead-letter move was counted: {m}");
        let text = logs.text();
        assert!(!text.contains("deduplicated by the fence"), "misleading log for a malformed delivery:\n{text}");
        assert!(text.contains("dead-lettered again"), "the log should say what happens next:\n{text}");
    }

    /// Collects formatted log lines.
    #[derive(Clone, Default)]
    struct LogCapture(Arc<Mutex<Vec<u8>>>);

    impl LogCapture {
        fn text(&self) -> String {
            String::from_utf8_lossy(&self.0.lock().expect("lock")).into_owned()
        }
    }

    impl std::io::Write for LogCapture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("lock").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogCapture {
        type Writer = LogCapture;
        fn make_writer(&'a self) -> Self::Writer {
            self.clone()
        }
    }

    // --------------------------------------------------------------------------------------------
    // The retrofit middleware, dropped by its caller.
    // --------------------------------------------------------------------------------------------

    /// Waits until `key` is pending again with no attempt spent, or fails with its row.
    async fn wait_released(store: &dyn FenceStore, queue: &QueueName, key: &JobKey, what: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        loop {
            let r = row(store, queue, key).await;
            if r.state == JobState::Pending && r.attempts == 0 {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{what}: the job was not released within 5 s (state {:?}, attempts {}, owner {:?}); it stays \
                 orphaned until its lease ends",
                r.state,
                r.attempts,
                r.owner
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Task item 4 (retrofit middleware, §2 bullet 2's hazard). Guard: `Retrofit::process` is
    /// cancellation-safe during its claim. A caller's `select!` drops `process` after the database
    /// committed the claim (the answer is 500 ms late): the job is released at once, without an
    /// attempt spent, and the handler never runs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_retrofit_dropped_during_its_claim_releases_the_job() {
        let db = pg().await;
        let late = LateClaims::new(Arc::clone(&db), Duration::from_millis(500));
        let queue = QueueName::new("retrofit-drop").expect("queue");
        let fence = Retrofit::new(late.clone(), queue.clone(), SupervisorConfig::new(common::lease(20)));
        let key = common::key("msg-1");
        let ran = Arc::new(AtomicUsize::new(0));
        tokio::select! {
            p = fence.process(&key, b"body".to_vec(), handler_counting(Arc::clone(&ran))) => {
                panic!("process finished before the caller gave up: {p:?}")
            }
            _ = late.claimed.notified() => {}
        }
        wait_released(&*db, &queue, &key, "process dropped during its claim").await;
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert_eq!(ran.load(Ordering::SeqCst), 0, "the handler ran for a caller that had gone");
        let r = row(&*db, &queue, &key).await;
        assert_eq!((r.state, r.attempts), (JobState::Pending, 0), "{r:?}");
    }

    /// Task item 4 (retrofit middleware). Guard: dropping `process` while its handler runs
    /// releases the lease at once (the job is pending again, no attempt spent) instead of leaving
    /// the row `running` under this owner until the lease ends.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_retrofit_dropped_while_its_handler_runs_releases_the_job() {
        let store = pg().await;
        let queue = QueueName::new("retrofit-drop-run").expect("queue");
        let fence = Retrofit::new(Arc::clone(&store), queue.clone(), SupervisorConfig::new(common::lease(20)));
        let key = common::key("msg-1");
        let started = Arc::new(Notify::new());
        let handler = {
            let started = Arc::clone(&started);
            move |_ctx: JobContext| {
                let started = Arc::clone(&started);
                async move {
                    started.notify_one();
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    Ok(Vec::new())
                }
            }
        };
        tokio::select! {
            p = fence.process(&key, b"body".to_vec(), handler) => panic!("process finished: {p:?}"),
            _ = started.notified() => {}
        }
        wait_released(&*store, &queue, &key, "process dropped while its handler ran").await;
    }

    // --------------------------------------------------------------------------------------------
    // A broker whose acknowledgements hang.
    // --------------------------------------------------------------------------------------------

    /// The table queue with a broker-like acknowledgement: deliveries carry their job key, and
    /// `ack` waits while `held` is set (a hung DeleteMessageBatch). Counts what it hands out and
    /// what it acknowledged.
    struct HeldAcks {
        inner: TableQueue,
        held: tokio::sync::watch::Receiver<bool>,
        received: AtomicUsize,
        acked: Mutex<HashMap<String, u32>>,
        acked_n: AtomicUsize,
    }

    impl HeldAcks {
        /// Deliveries handed to the runtime and not yet acknowledged.
        fn outstanding(&self) -> usize {
            self.received.load(Ordering::SeqCst) - self.acked_n.load(Ordering::SeqCst)
        }
    }

    #[async_trait]
    impl Source for HeldAcks {
        type Delivery = JobKey;

        fn queue(&self) -> &QueueName {
            self.inner.queue()
        }

        async fn receive(&self, max: usize, ctx: &ReceiveContext) -> Result<Vec<Incoming<JobKey>>, SourceError> {
            let got = self.inner.receive(max, ctx).await?;
            self.received.fetch_add(got.len(), Ordering::SeqCst);
            Ok(got
                .into_iter()
                .map(|i| match i {
                    Incoming::Claimed { job, .. } => Incoming::Claimed { delivery: job.lease.key.clone(), job },
                    Incoming::Unclaimed { key, payload, .. } => {
                        Incoming::Unclaimed { delivery: key.clone(), key, payload }
                    }
                    Incoming::Malformed { reason, .. } => Incoming::Malformed { delivery: common::key("bad"), reason },
                })
                .collect())
        }

        async fn ack(&self, deliveries: Vec<JobKey>) -> Result<(), SourceError> {
            let mut held = self.held.clone();
            let _ = held.wait_for(|h| !*h).await;
            let mut acked = self.acked.lock().expect("lock");
            for d in &deliveries {
                *acked.entry(d.as_str().to_owned()).or_default() += 1;
            }
            self.acked_n.fetch_add(deliveries.len(), Ordering::SeqCst);
            Ok(())
        }
    }

    /// How long the acknowledgements hang: `EDGES_ACK_HOLD_SECS`, default 12 s. The queue fills
    /// the runtime's bound within about a second (each job takes 1 ms); the rest of the hold shows
    /// it stays there. The 30 s: `EDGES_ACK_HOLD_SECS=30`.
    fn ack_hold() -> Duration {
        let secs = std::env::var("EDGES_ACK_HOLD_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(12);
        Duration::from_secs(secs)
    }

    /// Issue #12 §2 bullet 4. Guard: memory and queued work stay bounded while the broker's
    /// acknowledgements hang, and everything is acknowledged once they return. 300 jobs are due;
    /// the ack call hangs for [`ack_hold`]. Throughout, the deliveries received and not yet
    /// acknowledged stay within the configured unsettled bound (before: a handler slot freed when
    /// the handler returned, the unbounded ack channel took every finished delivery, and all 300
    /// were received within a second or two), and so do the runtime's tasks. Then the acks
    /// return: every job is completed once and acknowledged exactly once.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_a_hung_ack_keeps_memory_and_queued_work_bounded() {
        const JOBS: usize = 300;
        // concurrency 4, ack batches of 4: the documented default bound is
        // 4 × (concurrency + prefetch) + 4 × ack batch = 32.
        const BOUND: usize = 4 * 4 + 4 * 4;
        let store = pg().await;
        let queue = QueueName::new("hung-ack").expect("queue");
        let keys = keys("job", JOBS);
        enqueue(&*store, &queue, &keys).await;
        let (release, held) = tokio::sync::watch::channel(true);
        let source = HeldAcks {
            inner: TableQueue::new(Arc::clone(&store), queue.clone()).idle_wait(Duration::from_millis(20)),
            held,
            received: AtomicUsize::new(0),
            acked: Mutex::default(),
            acked_n: AtomicUsize::new(0),
        };
        let config = ConsumerConfig::new(SupervisorConfig::new(common::lease(20)))
            .concurrency(4)
            .batch(4)
            .ack_batching(4, Duration::from_millis(10))
            .grace(Duration::from_secs(5));
        let consumer = Arc::new(Consumer::new(source, Arc::clone(&store), config));
        let tasks_before = tokio::runtime::Handle::current().metrics().num_alive_tasks();
        let stop = CancellationToken::new();
        let run = tokio::spawn({
            let (consumer, stop) = (Arc::clone(&consumer), stop.clone());
            async move {
                let handler = |ctx: JobContext| async move {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    Ok(ctx.key().as_str().as_bytes().to_vec())
                };
                consumer.run(handler, stop).await
            }
        });
        let source = Arc::clone(consumer.source());
        let hold_until = tokio::time::Instant::now() + ack_hold();
        let (mut max_outstanding, mut max_tasks) = (0, 0);
        let mut late_growth = 0;
        let plateau_from = tokio::time::Instant::now() + ack_hold() / 3;
        let mut at_plateau = None;
        while tokio::time::Instant::now() < hold_until {
            let outstanding = source.outstanding();
            let tasks = tokio::runtime::Handle::current().metrics().num_alive_tasks().saturating_sub(tasks_before);
            max_outstanding = max_outstanding.max(outstanding);
            max_tasks = max_tasks.max(tasks);
            // Nothing more is received in the last two thirds of the hold.
            if tokio::time::Instant::now() >= plateau_from {
                let received = source.received.load(Ordering::SeqCst);
                let first = *at_plateau.get_or_insert(received);
                late_growth = received - first;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(
            max_outstanding <= BOUND,
            "up to {max_outstanding} deliveries were received and unacknowledged while the ack hung (bound \
             {BOUND}); received {} of {JOBS}: {}",
            source.received.load(Ordering::SeqCst),
            consumer.metrics().snapshot()
        );
        // The runtime's own tasks (receive, claim, ack, heartbeat, commit loops) plus at most one
        // per unsettled delivery.
        assert!(max_tasks <= BOUND + 16, "{max_tasks} tasks alive while the ack hung (bound {BOUND} + 16)");
        assert_eq!(late_growth, 0, "deliveries kept coming in while the ack hung");
        assert!(max_outstanding >= 4, "the consumer never got going: {}", consumer.metrics().snapshot());
        assert_eq!(source.acked_n.load(Ordering::SeqCst), 0, "an ack returned while held");
        // The broker answers again: everything drains and is acknowledged.
        release.send(false).expect("release the acks");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while source.acked_n.load(Ordering::SeqCst) < JOBS {
            assert!(
                tokio::time::Instant::now() < deadline,
                "only {} of {JOBS} acknowledged 30 s after the broker came back: {}",
                source.acked_n.load(Ordering::SeqCst),
                consumer.metrics().snapshot()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        stop.cancel();
        tokio::time::timeout(Duration::from_secs(20), run).await.expect("stopped").expect("join").expect("run");
        let m = consumer.metrics().snapshot();
        assert_eq!((m.completions, m.acks), (JOBS as u64, JOBS as u64), "{m}");
        let acked = source.acked.lock().expect("lock").clone();
        assert_eq!(acked.len(), JOBS, "every job acknowledged");
        assert!(acked.values().all(|n| *n == 1), "a delivery was acknowledged twice");
        for r in rows(&*store, &queue, &keys).await {
            assert_eq!((r.1, r.2), (JobState::Completed, 1), "{r:?}");
        }
        eprintln!(
            "hung ack for {:?}: at most {max_outstanding} deliveries unacknowledged (bound {BOUND}), at most \
             {max_tasks} extra tasks; {m}",
            ack_hold()
        );
    }

    /// Issue #12 §1 bullet 5 (rolling deploys): migrations are a deploy step, so a consumer never
    /// migrates; on a schema older than the build needs it refuses to start, naming the versions,
    /// before it receives or claims anything. Guard: `Consumer::run`'s schema check (without it
    /// the consumer runs on the unmigrated schema and the run does not end with this error).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn edges_a_consumer_refuses_to_start_on_an_old_schema() {
        let store: Arc<dyn FenceStore> = Arc::new(common::pg_unmigrated().await);
        let queue = QueueName::new("old-schema").expect("queue");
        let config = ConsumerConfig::new(SupervisorConfig::new(common::lease(3)));
        let consumer = Consumer::new(TableQueue::new(Arc::clone(&store), queue), store, config);
        let ran = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&ran);
        let handler = move |_ctx: JobContext| {
            seen.fetch_add(1, Ordering::SeqCst);
            async move { Ok(Vec::new()) }
        };
        let outcome = tokio::time::timeout(Duration::from_secs(10), consumer.run(handler, CancellationToken::new()))
            .await
            .expect("a consumer on an old schema must return at once, not run");
        match outcome {
            Err(SourceError::Fatal(msg)) => {
                let msg = msg.to_string();
                assert!(msg.contains("migrat"), "the refusal should say to run migrations: {msg}");
            }
            other => panic!("expected a fatal refusal, got {other:?}"),
        }
        assert_eq!(ran.load(Ordering::SeqCst), 0);
        assert_eq!(consumer.metrics().snapshot().claim_statements, 0);
    }

    /// The same on a real broker: SQS (LocalStack), DeleteMessageBatch held.
    #[cfg(feature = "sqs")]
    mod sqs {
        use std::collections::HashMap;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::{Arc, Mutex};
        use std::time::Duration;

        use async_trait::async_trait;
        use brokerfence::sqs::aws_sdk_sqs::types::SendMessageBatchRequestEntry;
        use brokerfence::sqs::{KeyStrategy, SqsConfig, SqsDelivery, SqsSource};
        use brokerfence::{Consumer, ConsumerConfig, Incoming, ReceiveContext, Source, SourceError};
        use brokerfence::{JobContext, JobState, Lease, LeaseDuration, QueueName, SupervisorConfig};
        use tokio_util::sync::CancellationToken;

        use super::super::sqs_support::{TestQueue, depth, drop_schema, dyn_store, jobs, pg, sqs};
        use super::ack_hold;

        /// An SQS source whose DeleteMessageBatch waits while `held` is set, then goes out for
        /// real. Counts the messages handed out and the ones deleted.
        struct HeldDeletes {
            inner: SqsSource,
            held: tokio::sync::watch::Receiver<bool>,
            received: AtomicUsize,
            deleted: Mutex<HashMap<String, u32>>,
            deleted_n: AtomicUsize,
        }

        #[async_trait]
        impl Source for HeldDeletes {
            type Delivery = SqsDelivery;

            fn queue(&self) -> &QueueName {
                self.inner.queue()
            }
            async fn receive(
                &self,
                max: usize,
                ctx: &ReceiveContext,
            ) -> Result<Vec<Incoming<SqsDelivery>>, SourceError> {
                let got = self.inner.receive(max, ctx).await?;
                self.received.fetch_add(got.len(), Ordering::SeqCst);
                Ok(got)
            }
            async fn extend(&self, leases: &[(Lease, SqsDelivery)]) -> Result<(), SourceError> {
                self.inner.extend(leases).await
            }
            async fn lost(&self, leases: &[(Lease, SqsDelivery)]) -> Result<(), SourceError> {
                self.inner.lost(leases).await
            }
            async fn ack(&self, deliveries: Vec<SqsDelivery>) -> Result<(), SourceError> {
                let mut held = self.held.clone();
                let _ = held.wait_for(|h| !*h).await;
                let ids: Vec<String> = deliveries.iter().map(|d| d.message_id().to_owned()).collect();
                self.inner.ack(deliveries).await?;
                let mut deleted = self.deleted.lock().expect("lock");
                for id in ids {
                    *deleted.entry(id).or_default() += 1;
                    self.deleted_n.fetch_add(1, Ordering::SeqCst);
                }
                Ok(())
            }
            async fn retry_later(&self, delivery: SqsDelivery, delay: Duration) -> Result<(), SourceError> {
                self.inner.retry_later(delivery, delay).await
            }
            async fn dead_letter(&self, delivery: SqsDelivery, reason: &str) -> Result<(), SourceError> {
                self.inner.dead_letter(delivery, reason).await
            }
            async fn hold(&self, delivery: SqsDelivery, ttl: Duration) -> Result<(), SourceError> {
                self.inner.hold(delivery, ttl).await
            }
            async fn abandon(&self, delivery: SqsDelivery) -> Result<(), SourceError> {
                self.inner.abandon(delivery).await
            }
            async fn close(&self, grace: Duration) {
                self.inner.close(grace).await
            }
        }

        /// Issue #12 §2 bullet 4, on SQS (LocalStack). Guard: while DeleteMessageBatch hangs,
        /// the messages received and not deleted stay within the consumer's unsettled bound
        /// (before: every finished job freed its slot and queued its delete, so the worker kept
        /// receiving the whole queue into memory); once the deletes go out, every message is
        /// deleted exactly once and every job completed once. The lease (30 s, the messages'
        /// visibility) outlasts the hold (`EDGES_ACK_HOLD_SECS`, at most 20 s here), so no message
        /// comes back meanwhile.
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn edges_a_hung_delete_message_batch_keeps_queued_work_bounded() {
            const MESSAGES: usize = 200;
            // concurrency 4, deletes of up to 10: 4 × 4 + 4 × 10.
            const BOUND: usize = 4 * 4 + 4 * 10;
            let client = sqs().await;
            let fence = pg().await;
            let q = TestQueue::new(&client, "hung-delete", 30).await;
            for chunk in 0..MESSAGES / 10 {
                let entries = (0..10)
                    .map(|i| {
                        let n = chunk * 10 + i;
                        SendMessageBatchRequestEntry::builder()
                            .id(format!("m{i}"))
                            .message_body(format!("message {n}"))
                            .build()
                            .expect("entry")
                    })
                    .collect::<Vec<_>>();
                let out = client
                    .send_message_batch()
                    .queue_url(&q.url)
                    .set_entries(Some(entries))
                    .send()
                    .await
                    .expect("send batch");
                assert!(out.failed().is_empty(), "send failed: {:?}", out.failed());
            }
            let (release, held) = tokio::sync::watch::channel(true);
            let config = SqsConfig::new(&q.url).expect("url").key(KeyStrategy::Auto).wait_time(Duration::from_secs(1));
            let source = HeldDeletes {
                inner: SqsSource::new(client.clone(), config),
                held,
                received: AtomicUsize::new(0),
                deleted: Mutex::default(),
                deleted_n: AtomicUsize::new(0),
            };
            let lease = LeaseDuration::from_secs(30).expect("lease");
            let config = ConsumerConfig::new(SupervisorConfig::new(lease)).concurrency(4).grace(Duration::from_secs(3));
            let consumer = Arc::new(Consumer::new(source, dyn_store(&fence), config));
            assert_eq!(consumer.unsettled(), 0);
            let stop = CancellationToken::new();
            let run = tokio::spawn({
                let (consumer, stop) = (Arc::clone(&consumer), stop.clone());
                async move { consumer.run(|ctx: JobContext| async move { Ok(ctx.payload().to_vec()) }, stop).await }
            });
            let source = Arc::clone(consumer.source());
            let hold = ack_hold().min(Duration::from_secs(20));
            let hold_until = tokio::time::Instant::now() + hold;
            let (mut max_received, mut max_unsettled) = (0, 0);
            while tokio::time::Instant::now() < hold_until {
                max_received = max_received.max(source.received.load(Ordering::SeqCst));
                max_unsettled = max_unsettled.max(consumer.unsettled());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(
                max_received <= BOUND,
                "{max_received} of {MESSAGES} messages received while DeleteMessageBatch hung (bound {BOUND}): {}",
                consumer.metrics().snapshot()
            );
            assert!(max_received >= 4, "the consumer never got going: {}", consumer.metrics().snapshot());
            assert!(max_unsettled <= BOUND, "gauge {max_unsettled} above the bound {BOUND}");
            assert_eq!(source.deleted_n.load(Ordering::SeqCst), 0, "a delete went out while held");
            release.send(false).expect("release the deletes");
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            while source.deleted_n.load(Ordering::SeqCst) < MESSAGES {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "only {} of {MESSAGES} deleted 60 s after the broker came back: {}",
                    source.deleted_n.load(Ordering::SeqCst),
                    consumer.metrics().snapshot()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            stop.cancel();
            tokio::time::timeout(Duration::from_secs(20), run).await.expect("stopped").expect("join").expect("run");
            let m = consumer.metrics().snapshot();
            let deleted = source.deleted.lock().expect("lock").clone();
            assert_eq!(deleted.len(), MESSAGES, "every message deleted: {m}");
            assert!(deleted.values().all(|n| *n == 1), "a message was deleted twice: {m}");
            assert_eq!(m.completions, MESSAGES as u64, "{m}");
            let rows = jobs(&fence).await;
            assert_eq!(rows.len(), MESSAGES);
            assert!(rows.iter().all(|r| r.1 == JobState::Completed.as_str() && r.2 == 1), "{rows:?}");
            assert_eq!(depth(&client, &q.url).await, 0, "messages left in the queue");
            eprintln!(
                "SQS DeleteMessageBatch held {hold:?}: at most {max_received} of {MESSAGES} received (bound {BOUND}), \
                 gauge at most {max_unsettled}; {m}"
            );
            q.delete(&client).await;
            drop_schema(&fence).await;
        }
    }
}
