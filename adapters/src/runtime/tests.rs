//! Tests of the receive and claim loops together: claim statements shared by receives that
//! arrive close together, deliveries one at a time, the unsettled gauge.

use super::*;
use crate::source::Incoming;
use async_trait::async_trait;
use fence::{JobKey, LeaseDuration, MetricsSnapshot, QueueName, SqliteFence, SupervisorConfig};

/// A source that hands out one delivery per receive, as its keys arrive.
struct Trickle {
    queue: QueueName,
    keys: tokio::sync::Mutex<mpsc::UnboundedReceiver<JobKey>>,
}

#[async_trait]
impl Source for Trickle {
    type Delivery = ();

    fn queue(&self) -> &QueueName {
        &self.queue
    }

    async fn receive(&self, _max: usize, _ctx: &ReceiveContext) -> Result<Vec<Incoming<()>>, SourceError> {
        let mut keys = self.keys.lock().await;
        Ok(match tokio::time::timeout(Duration::from_millis(50), keys.recv()).await {
            Ok(Some(key)) => vec![Incoming::Unclaimed { delivery: (), key, payload: Vec::new() }],
            _ => Vec::new(),
        })
    }
}

/// A consumer with `window` over a [`Trickle`]; feeds it `feed`, waits for `n` completions
/// (10 s at most), stops it and returns its counters.
async fn trickled<F, Fut>(window: Duration, handler_ms: u64, n: u64, feed: F) -> MetricsSnapshot
where
    F: FnOnce(mpsc::UnboundedSender<JobKey>, Arc<Metrics>) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let store = SqliteFence::open("sqlite::memory:").await.expect("open");
    store.migrate().await.expect("migrate");
    let (tx, rx) = mpsc::unbounded_channel();
    let source = Trickle { queue: QueueName::new("trickle").expect("queue"), keys: tokio::sync::Mutex::new(rx) };
    let lease = LeaseDuration::from_secs(30).expect("lease");
    let config = ConsumerConfig::new(SupervisorConfig::new(lease)).concurrency(64).claim_window(window);
    let consumer = Arc::new(Consumer::new(source, Arc::new(store), config));
    let stop = CancellationToken::new();
    let work = Duration::from_millis(handler_ms);
    let run = {
        let (consumer, stop) = (Arc::clone(&consumer), stop.clone());
        tokio::spawn(async move {
            let handler = move |_ctx: fence::JobContext| async move {
                tokio::time::sleep(work).await;
                Ok(Vec::new())
            };
            consumer.run(handler, stop).await
        })
    };
    let metrics = consumer.metrics();
    feed(tx, Arc::clone(&metrics)).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while metrics.snapshot().completions < n && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.cancel();
    run.await.expect("consumer task").expect("consumer ran");
    metrics.snapshot()
}

/// Guard: the group-claim window. Forty receives of one delivery, one every millisecond,
/// whose handlers take 50 ms, must share a few claim statements; without the window each
/// claim slot took whatever single receive was queued (one statement per delivery on this
/// fast store).
///
/// Also covers a defect CI found (a run with 9 statements under the full suite's load): the
/// deliveries arriving while the first claim statement was still out found no attempt
/// running, so each was claimed at once in a statement of its own (up to four in flight).
/// A claim in flight now counts as "more can come". The bound follows the measured span of
/// the sends (one group per window, plus the first delivery's own statement), so a loaded
/// machine that stretches the sends does not make the test lie either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receives_arriving_close_together_share_claim_statements() {
    let window = Duration::from_millis(100);
    let span = Arc::new(Mutex::new(Duration::ZERO));
    let measured = Arc::clone(&span);
    let m = trickled(window, 50, 40, |tx, _| async move {
        let began = tokio::time::Instant::now();
        for i in 0..40 {
            tx.send(JobKey::new(format!("k{i}")).expect("key")).expect("source alive");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        *measured.lock().expect("span") = began.elapsed();
    })
    .await;
    assert_eq!((m.claims, m.completions), (40, 40), "{m}");
    let span = *span.lock().expect("span");
    // Without the window: one statement per delivery (40).
    let groups = span.as_millis().div_ceil(window.as_millis()) as u64;
    let bound = 2 + groups;
    assert!(bound < 20, "the sends took {span:?}: too loaded a machine to tell the window from none");
    assert!(
        m.claim_statements <= bound,
        "40 receives within {span:?} took {} claim statements (at most {bound} with a {window:?} window)",
        m.claim_statements
    );
}

/// Deliveries that come one at a time (each after the previous job is done) are claimed at
/// once: the window adds nothing to their latency, however large.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_one_at_a_time_do_not_wait_for_the_window() {
    let m = trickled(Duration::from_secs(5), 0, 5, |tx, metrics| async move {
        for i in 0..5u64 {
            let sent = tokio::time::Instant::now();
            tx.send(JobKey::new(format!("k{i}")).expect("key")).expect("source alive");
            while metrics.snapshot().completions <= i {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            assert!(sent.elapsed() < Duration::from_secs(1), "job {i} took {:?}", sent.elapsed());
        }
    })
    .await;
    assert_eq!((m.claims, m.completions, m.claim_statements), (5, 5, 5), "{m}");
}

/// Issue #12 §2 bullet 4 (the gauge and the bound). [`Consumer::unsettled`] counts
/// deliveries from their receive until the broker was told. With a bound of 5, five running
/// jobs hold every place: a sixth delivery waiting at the source is not received until they
/// are settled; once everything is acknowledged and the consumer stopped no place is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edges_the_unsettled_gauge_follows_deliveries() {
    let store = SqliteFence::open("sqlite::memory:").await.expect("open");
    store.migrate().await.expect("migrate");
    let (tx, rx) = mpsc::unbounded_channel();
    let source = Trickle { queue: QueueName::new("gauge").expect("queue"), keys: tokio::sync::Mutex::new(rx) };
    let config = ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30).expect("lease")))
        .concurrency(8)
        .max_unsettled(5);
    let consumer = Arc::new(Consumer::new(source, Arc::new(store), config));
    let gate = Arc::new(Semaphore::new(0));
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let (consumer, stop, gate) = (Arc::clone(&consumer), stop.clone(), Arc::clone(&gate));
        async move {
            let handler = move |_ctx: fence::JobContext| {
                let gate = Arc::clone(&gate);
                async move {
                    let _pass = gate.acquire().await;
                    Ok(Vec::new())
                }
            };
            consumer.run(handler, stop).await
        }
    });
    for i in 0..5 {
        tx.send(JobKey::new(format!("k{i}")).expect("key")).expect("source alive");
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while consumer.supervisor().in_flight() < 5 {
        assert!(tokio::time::Instant::now() < deadline, "five jobs running: {}", consumer.metrics().snapshot());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(consumer.unsettled(), 5);
    tx.send(JobKey::new("k5").expect("key")).expect("source alive");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(consumer.supervisor().in_flight(), 5, "a sixth delivery was received beyond the bound");
    assert_eq!(consumer.metrics().snapshot().claims, 5);
    gate.add_permits(6);
    while consumer.metrics().snapshot().acks < 6 {
        assert!(tokio::time::Instant::now() < deadline, "all acknowledged: {}", consumer.metrics().snapshot());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    stop.cancel();
    run.await.expect("join").expect("run");
    assert_eq!(consumer.unsettled(), 0);
}
