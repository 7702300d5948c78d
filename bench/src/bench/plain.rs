//! The plain broker consumers' common shape, and the fenced run they are compared with (features
//! `sqs`, `redis`).

use super::*;

/// Common shape of the plain broker consumers: receive up to the free slots, one task per
/// delivery (the work), acknowledgements batched by 10 or 20 ms.
pub(crate) struct PlainLoop {
    pub(crate) concurrency: usize,
    pub(crate) batch: usize,
    pub(crate) work: Duration,
}

/// What a plain consumer needs from its broker.
pub(crate) trait PlainBroker: Send + Sync + 'static {
    type Handle: Send + 'static;
    fn receive(&self, max: usize) -> impl std::future::Future<Output = Result<Vec<Self::Handle>, String>> + Send;
    fn ack(&self, handles: Vec<Self::Handle>) -> impl std::future::Future<Output = Result<usize, String>> + Send;
}

/// Latencies of `m` messages handled one at a time by a plain consumer: receive one, acknowledge it.
pub(crate) async fn plain_latencies<B: PlainBroker>(broker: &B, m: usize) -> Result<Vec<Duration>, String> {
    let mut p = Vec::with_capacity(m);
    while p.len() < m {
        let t = Instant::now();
        let handles = broker.receive(1).await?;
        if handles.is_empty() {
            continue;
        }
        broker.ack(handles).await?;
        p.push(t.elapsed());
    }
    Ok(p)
}

impl PlainLoop {
    pub(crate) async fn run<B: PlainBroker>(&self, broker: Arc<B>, total: usize) -> Result<Rate, String> {
        let done = Arc::new(AtomicU64::new(0));
        let (ack_tx, mut ack_rx) = tokio::sync::mpsc::unbounded_channel::<B::Handle>();
        let acker = {
            let (broker, done) = (Arc::clone(&broker), Arc::clone(&done));
            tokio::spawn(async move {
                while let Some(first) = ack_rx.recv().await {
                    let mut batch = vec![first];
                    let until = tokio::time::Instant::now() + Duration::from_millis(20);
                    while batch.len() < 10 {
                        tokio::select! {
                            item = ack_rx.recv() => match item { Some(h) => batch.push(h), None => break },
                            _ = tokio::time::sleep_until(until) => break,
                        }
                    }
                    if let Ok(n) = broker.ack(batch).await {
                        done.fetch_add(n as u64, Ordering::Relaxed);
                    }
                }
            })
        };
        let started = Instant::now();
        let receiver = {
            let (broker, done, slots) =
                (Arc::clone(&broker), Arc::clone(&done), Arc::new(tokio::sync::Semaphore::new(self.concurrency)));
            let (work, batch) = (self.work, self.batch);
            tokio::spawn(async move {
                while done.load(Ordering::Relaxed) < total as u64 {
                    let free = slots.available_permits().min(batch);
                    if free == 0 {
                        let _ = Arc::clone(&slots).acquire_owned().await.map_err(|e| e.to_string())?;
                        continue;
                    }
                    for handle in broker.receive(free).await? {
                        let permit = Arc::clone(&slots).acquire_owned().await.map_err(|e| e.to_string())?;
                        let ack_tx = ack_tx.clone();
                        tokio::spawn(async move {
                            tokio::time::sleep(work).await;
                            let _ = ack_tx.send(handle);
                            drop(permit);
                        });
                    }
                }
                Ok::<(), String>(())
            })
        };
        // The clock stops when the last acknowledgement is in, not when the next long poll ends.
        let finished =
            wait_until("the plain consumer", Duration::from_secs(600), || done.load(Ordering::Relaxed) >= total as u64)
                .await;
        let secs = started.elapsed().as_secs_f64();
        receiver.abort();
        acker.abort();
        finished?;
        Ok(Rate { jobs: total, secs })
    }
}

/// The fenced consumer runtime over `source` until `total` completions; statements counted.
pub(crate) async fn fenced_run<S: Source>(
    o: &Opts,
    source: S,
    batch: usize,
    counting: &Arc<Counting>,
    total: usize,
) -> Result<(Rate, f64, String), String> {
    counting.reset();
    let store: Arc<dyn FenceStore> = counting.clone();
    let lease = LeaseDuration::from_secs(30).map_err(|e| e.to_string())?;
    let config = ConsumerConfig::new(SupervisorConfig::new(lease).commit_window(o.commit_window))
        .concurrency(o.broker_concurrency)
        .batch(batch)
        .claim_window(o.claim_window);
    let consumer = Consumer::new(source, store, config);
    let metrics = consumer.metrics();
    let stop = CancellationToken::new();
    let started = Instant::now();
    let work = o.work;
    let run = tokio::spawn({
        let stop = stop.clone();
        async move {
            let handler = move |_ctx: JobContext| async move {
                tokio::time::sleep(work).await;
                Ok::<_, JobError>(b"ok".to_vec())
            };
            consumer.run(handler, stop).await
        }
    });
    // A job counts once its result is committed and its delivery acknowledged.
    wait_until("the fenced consumer", Duration::from_secs(600), || metrics.snapshot().acks >= total as u64).await?;
    let secs = started.elapsed().as_secs_f64();
    stop.cancel();
    run.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    Ok((Rate { jobs: total, secs }, counting.total() as f64 / total as f64, counting.describe()))
}

pub(crate) fn print_broker_figures(
    plain: Rate,
    fenced: Rate,
    per_msg: f64,
    breakdown: &str,
    lat: (&[Duration], &[Duration]),
) {
    line("plain consumer (receive, handle, acknowledge)", plain);
    line("fenced consumer runtime", fenced);
    line("  ratio fenced / plain", format!("{:.2}", fenced.per_sec() / plain.per_sec()));
    line("  database statements per message", format!("{per_msg:.3}: {breakdown}"));
    let (f, p) = lat;
    let (f50, f99, p50, p99) = (percentile(f, 0.5), percentile(f, 0.99), percentile(p, 0.5), percentile(p, 0.99));
    line(
        &format!("latency per message, sequential ({}): plain p50 / p99", p.len()),
        format!("{} / {}", ms(p50), ms(p99)),
    );
    line("  fenced p50 / p99", format!("{} / {}", ms(f50), ms(f99)));
    line(
        "  added by the fence p50 / p99",
        format!("{} / {}", ms(f50.saturating_sub(p50)), ms(f99.saturating_sub(p99))),
    );
}
