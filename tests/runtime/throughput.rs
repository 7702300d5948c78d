//! Issue #18: `claim_next` reads the jobs table in index order whatever its statistics say.
//!
//! A bulk enqueue lands before autovacuum's first `ANALYZE` (or autovacuum is off, as on the
//! project's own test database). On a table that was never analyzed the planner guesses a row or
//! two per queue; for `claim_next` it then chose a bitmap scan over every due row plus a sort that
//! spilled to disk: 62–67 ms per claim of ten with 76,000 jobs pending, about 170 jobs/s for a
//! whole consumer. The fence's session settings (`PG_SESSION_SETUP`) now rule bitmap scans out,
//! so the only plan left is the scan of `jobs_open` in `run_at` order that stops after the rows it
//! claims (and the running rows it reads past: the measured drain completes each claim's jobs
//! before the next claim, as a consumer does, so they stay few).

use brokerfence_testkit::store as common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use brokerfence::{FenceStore, JobKey, Owner, PgFence, QueueName};
use sqlx::AssertSqlSafe;

/// Pending jobs in the table: large enough that reading them all is unmistakable.
const PENDING: usize = 100_000;
/// Jobs per claim, the table queue's default batch.
const PER_CLAIM: u32 = 10;

/// What `claims` claims of [`PER_CLAIM`] cost on `s`: rows of `jobs` read per claim, and the
/// median time of one claim. Each claim's jobs are completed before the next claim (neither timed
/// nor counted), as a consumer's drain does; claims
/// that never finished would each read past every running row before them (`claim_next`).
async fn measure(s: &PgFence, queue: &QueueName, owner: &Owner, claims: usize) -> (i64, Duration) {
    // Past the server's first five custom plans: the kept generic plan is the one measured.
    let complete = |jobs: Vec<brokerfence::ClaimedJob>| async move {
        let items: Vec<_> = jobs.into_iter().map(|c| (c.lease, Vec::new())).collect();
        assert!(s.complete_batch(&items).await.unwrap().iter().all(|r| r.is_ok()));
    };
    for _ in 0..6 {
        let jobs = s.claim_next(queue, owner, common::lease(60), PER_CLAIM).await.unwrap();
        assert_eq!(jobs.len(), PER_CLAIM as usize);
        complete(jobs).await;
    }
    let mut read = 0;
    let mut times = Vec::with_capacity(claims);
    for _ in 0..claims {
        let before = common::jobs_rows_read(s).await;
        let sent = Instant::now();
        let jobs = s.claim_next(queue, owner, common::lease(60), PER_CLAIM).await.unwrap();
        times.push(sent.elapsed());
        read += common::jobs_rows_read(s).await - before;
        assert_eq!(jobs.len(), PER_CLAIM as usize);
        complete(jobs).await;
    }
    times.sort();
    (read / claims as i64, times[claims / 2])
}

/// Guard (issue #18, the collapse of `claim_next` on a never-analyzed table): with 100,000
/// pending jobs and no statistics, a claim of ten reads about ten rows, as it does once the table
/// is analyzed. Without `enable_bitmapscan = off` in `PG_SESSION_SETUP` the never-analyzed claim
/// read every pending row (100,000 per claim).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_claim_next_reads_in_index_order_on_a_never_analyzed_table() {
    // One connection: its backend's kept plans are the ones measured.
    let pool = PgFence::pool_options().max_connections(1).connect(&common::database_url()).await.unwrap();
    let s = PgFence::new(pool).schema(common::unique_schema());
    s.migrate().await.unwrap();
    let jobs_table = format!("{}.jobs", s.get_schema().as_str());
    sqlx::query(AssertSqlSafe(format!("ALTER TABLE {jobs_table} SET (autovacuum_enabled = false)")))
        .execute(s.pool())
        .await
        .unwrap();
    let queue = QueueName::new("bulk").unwrap();
    let all: Vec<(JobKey, Vec<u8>)> = (0..PENDING).map(|i| (common::key(&format!("job-{i:06}")), Vec::new())).collect();
    for chunk in all.chunks(10_000) {
        assert_eq!(s.enqueue_many(&queue, chunk).await.unwrap(), chunk.len() as u64);
    }
    let reltuples = || async {
        let (n,): (f32,) = sqlx::query_as("SELECT reltuples FROM pg_class WHERE oid = to_regclass($1)")
            .bind(&jobs_table)
            .fetch_one(s.pool())
            .await
            .unwrap();
        n
    };
    assert_eq!(reltuples().await, -1.0, "the jobs table must never have been analyzed for this test");
    let owner = Owner::new("claimer").unwrap();
    let (never_rows, never_time) = measure(&s, &queue, &owner, 20).await;
    sqlx::query(AssertSqlSafe(format!("ANALYZE {jobs_table}"))).execute(s.pool()).await.unwrap();
    assert!(reltuples().await > 0.0, "ANALYZE recorded the table");
    let (analyzed_rows, analyzed_time) = measure(&s, &queue, &owner, 20).await;
    println!(
        "claim_next of {PER_CLAIM} with {PENDING} pending: never analyzed {never_rows} rows, {never_time:?} \
         (median of 20); analyzed {analyzed_rows} rows, {analyzed_time:?}"
    );
    // In index order a claim reads the rows it claims (and, at worst, a few it skips).
    assert!(never_rows <= 3 * PER_CLAIM as i64, "never analyzed: {never_rows} rows read per claim of {PER_CLAIM}");
    assert!(analyzed_rows <= 3 * PER_CLAIM as i64, "analyzed: {analyzed_rows} rows read per claim of {PER_CLAIM}");
}

/// A table queue that records what each receive asked for and got.
struct Recording {
    inner: brokerfence::TableQueue,
    receives: Arc<std::sync::Mutex<Vec<(usize, usize)>>>,
    /// Receives running now, and the most that ever ran at once.
    running: Arc<(std::sync::atomic::AtomicUsize, std::sync::atomic::AtomicUsize)>,
}

#[async_trait::async_trait]
impl brokerfence::Source for Recording {
    type Delivery = ();

    fn queue(&self) -> &QueueName {
        self.inner.queue()
    }

    fn default_batch(&self) -> usize {
        self.inner.default_batch()
    }

    fn receives_in_flight(&self) -> usize {
        self.inner.receives_in_flight()
    }

    fn default_prefetch(&self, concurrency: usize) -> usize {
        self.inner.default_prefetch(concurrency)
    }

    async fn receive(
        &self,
        max: usize,
        ctx: &brokerfence::ReceiveContext,
    ) -> Result<Vec<brokerfence::Incoming<()>>, brokerfence::SourceError> {
        use std::sync::atomic::Ordering;
        let now = self.running.0.fetch_add(1, Ordering::SeqCst) + 1;
        self.running.1.fetch_max(now, Ordering::SeqCst);
        let got = self.inner.receive(max, ctx).await;
        self.running.0.fetch_sub(1, Ordering::SeqCst);
        let got = got?;
        self.receives.lock().unwrap().push((max, got.len()));
        Ok(got)
    }
}

/// What receives a consumer built as the README shows (only its concurrency set) asks for while
/// it drains `jobs` jobs of 20 ms each: (largest ask, jobs per receive that claimed any, most
/// receives in flight at once).
async fn default_asks(concurrency: usize, jobs: usize) -> (usize, f64, usize) {
    use brokerfence::{Consumer, ConsumerConfig, LeaseDuration, SupervisorConfig};
    let store: Arc<dyn FenceStore> = Arc::new(common::pg().await);
    let queue = QueueName::new("defaults").unwrap();
    let all: Vec<(JobKey, Vec<u8>)> = (0..jobs).map(|i| (common::key(&format!("job-{i:05}")), Vec::new())).collect();
    store.enqueue_many(&queue, &all).await.unwrap();
    let receives = Arc::new(std::sync::Mutex::new(Vec::new()));
    let running = Arc::new(Default::default());
    let source = Recording {
        inner: brokerfence::TableQueue::new(Arc::clone(&store), queue),
        receives: Arc::clone(&receives),
        running: Arc::clone(&running),
    };
    let config =
        ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap())).concurrency(concurrency);
    let consumer = Consumer::new(source, store, config);
    let metrics = consumer.metrics();
    let stop = brokerfence::CancellationToken::new();
    let run = {
        let stop = stop.clone();
        tokio::spawn(async move {
            consumer
                .run(
                    |_ctx| async move {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        Ok(())
                    },
                    stop,
                )
                .await
        })
    };
    brokerfence_testkit::wait::wait_for_completions(&metrics, jobs as u64, Duration::from_secs(60)).await;
    stop.cancel();
    run.await.unwrap().unwrap();
    let receives = receives.lock().unwrap().clone();
    let largest = receives.iter().map(|(asked, _)| *asked).max().unwrap_or(0);
    let claimed: Vec<usize> = receives.iter().map(|(_, got)| *got).filter(|n| *n > 0).collect();
    let most = running.1.load(std::sync::atomic::Ordering::SeqCst);
    (largest, claimed.iter().sum::<usize>() as f64 / claimed.len().max(1) as f64, most)
}

/// Guard (issue #18, defaults that did not scale): a consumer over the table queue at its
/// defaults asks each claim statement for what it has free, up to the table queue's batch of 64,
/// so at concurrency 128 one statement hands out dozens of jobs. With the old fixed batch of 10
/// it never asked for more than 10, and a consumer could start at most ten jobs per claim round
/// trip (8,476 jobs/s at concurrency 128 against 22,859 for a plain loop).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_table_queue_defaults_claim_what_is_free() {
    let (largest, per_receive, _) = default_asks(128, 1_280).await;
    println!("concurrency 128: largest ask {largest}, {per_receive:.1} jobs per claiming receive");
    assert_eq!(largest, 64, "the table queue's default batch, with 256 places (128 handlers, claims ahead)");
    // Measured 22.5 (four claims in flight share the places); the old fixed batch gave at most 10.
    assert!(per_receive > 15.0, "{per_receive:.1} jobs per claim statement at concurrency 128");
}

/// A receive never asks for more than the consumer has places for: at concurrency 4 the table
/// queue holds 8 places (twice the concurrency, its claims ahead), and its batch of 64 is cut to
/// 8 (waiting for 56 places that cannot free up would only add the fill linger to every
/// receive).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_default_batch_is_cut_to_the_places() {
    let (largest, _, _) = default_asks(4, 40).await;
    assert_eq!(largest, 8);
}

/// Guard (issue #18, a serial claim step capped the table queue at concurrency 128: 0.66 of a
/// plain loop): a consumer whose places hold more than one batch keeps more than one claim
/// statement in flight (one per batch's worth of places, at most the table queue's 4), so the
/// places freed while one claim waits on the database are claimed by the next. One whose places
/// fit one batch keeps one (more would split its batch for nothing). With the table queue's
/// claims ahead the places are twice the concurrency: 256 at 128 (four batches), 32 at 16.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_table_queue_keeps_claims_in_flight_for_its_places() {
    let (_, per_receive, most) = default_asks(128, 2_560).await;
    println!("concurrency 128: at most {most} receives at once, {per_receive:.1} jobs per claiming receive");
    assert_eq!(most, 4, "256 places, batches of 64: four claim statements at once");
    let (_, _, most) = default_asks(16, 160).await;
    assert_eq!(most, 1, "32 places fit one batch: one claim statement at a time");
}

/// What a consumer over the table queue at concurrency 4 holds while its four handlers are
/// stuck: (jobs running in the database under its owner, handlers started). Then it lets the
/// handlers go and drains the queue.
async fn held_while_handlers_are_busy(prefetch: Option<usize>) -> (usize, usize) {
    use brokerfence::{Consumer, ConsumerConfig, LeaseDuration, SupervisorConfig};
    use std::sync::atomic::{AtomicUsize, Ordering};
    const JOBS: usize = 20;
    let pg = common::pg().await;
    let store: Arc<dyn FenceStore> = Arc::new(pg.clone());
    let queue = QueueName::new("ahead").unwrap();
    let all: Vec<(JobKey, Vec<u8>)> = (0..JOBS).map(|i| (common::key(&format!("job-{i:02}")), Vec::new())).collect();
    store.enqueue_many(&queue, &all).await.unwrap();
    let mut config = ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).unwrap())).concurrency(4);
    if let Some(n) = prefetch {
        config = config.prefetch(n);
    }
    let consumer = Consumer::new(brokerfence::TableQueue::new(Arc::clone(&store), queue), store, config);
    let metrics = consumer.metrics();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let started = Arc::new(AtomicUsize::new(0));
    let stop = brokerfence::CancellationToken::new();
    let run = {
        let (stop, gate, started) = (stop.clone(), Arc::clone(&gate), Arc::clone(&started));
        tokio::spawn(async move {
            let handler = move |_ctx| {
                let (gate, started) = (Arc::clone(&gate), Arc::clone(&started));
                async move {
                    started.fetch_add(1, Ordering::SeqCst);
                    gate.acquire().await.unwrap().forget();
                    Ok(())
                }
            };
            consumer.run(handler, stop).await
        })
    };
    let running = || async { common::jobs(&pg).await.iter().filter(|(_, state, ..)| state == "running").count() };
    // Four handlers start; then whatever the consumer claims ahead of them is claimed within a
    // few claim round trips.
    brokerfence_testkit::wait::eventually(Duration::from_secs(30), "four handlers started", || {
        let n = started.load(Ordering::SeqCst);
        async move { n == 4 }
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let held = (running().await, started.load(Ordering::SeqCst));
    gate.add_permits(JOBS);
    brokerfence_testkit::wait::wait_for_completions(&metrics, JOBS as u64, Duration::from_secs(60)).await;
    stop.cancel();
    run.await.unwrap().unwrap();
    assert!(common::jobs(&pg).await.iter().all(|(_, state, ..)| state == "completed"), "every job completed once");
    held
}

/// Guard (issue #18, a slot idle for every claim round trip capped the table queue at
/// concurrency 128: 0.62–0.69 of a plain loop; with claims ahead about 0.9): a consumer over
/// the table queue at its defaults claims ahead of its handlers (`TableQueue::default_prefetch`,
/// twice `concurrency`, up to 256). With four handlers stuck it holds twelve jobs: four running,
/// eight claimed and waiting for a handler; only four handlers run. With `prefetch(0)` it holds the
/// four it runs, as every consumer did before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn throughput_table_queue_claims_ahead_of_its_handlers_by_default() {
    let (held, started) = held_while_handlers_are_busy(None).await;
    assert_eq!((held, started), (12, 4), "defaults: four running and eight claimed ahead; four handlers started");
    let (held, started) = held_while_handlers_are_busy(Some(0)).await;
    assert_eq!((held, started), (4, 4), "prefetch(0): only what runs is claimed");
}
