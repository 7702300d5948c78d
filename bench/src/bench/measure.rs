//! Source-independent measurements: heartbeat statements per tick, and how soon a handler is
//! cancelled after a takeover.

use super::*;

/// Heartbeat statements per tick with K jobs in flight on one worker, for several K at once (one
/// supervisor each). Returns (K, ticks, heartbeat statements, renewals, mean statement time).
pub(crate) async fn heartbeat_cost(pg: &PgFence, sizes: &[usize]) -> Result<Vec<(usize, u64, u64, u64)>, String> {
    let lease = LeaseDuration::from_secs(3).map_err(|e| e.to_string())?;
    let mut runs = Vec::new();
    for &k in sizes {
        let q = QueueName::new(format!("hb-{k}")).map_err(|e| e.to_string())?;
        let jobs: Vec<(JobKey, Vec<u8>)> = (0..k)
            .map(|i| JobKey::new(format!("j{i}")).map(|key| (key, Vec::new())))
            .collect::<Result<_, _>>()
            .map_err(|e| e.to_string())?;
        pg.enqueue_many(&q, &jobs).await.map_err(|e| e.to_string())?;
        let counting = Counting::new(Arc::new(pg.clone()));
        let store: Arc<dyn FenceStore> = counting.clone();
        let owner = Owner::unique("hb");
        let claimed = store
            .claim_next(&q, &owner, lease, u32::try_from(k).unwrap_or(u32::MAX))
            .await
            .map_err(|e| e.to_string())?;
        counting.reset();
        let sup = Supervisor::new(Arc::clone(&store), owner, SupervisorConfig::new(lease));
        runs.push((k, counting, sup, claimed));
    }
    // Every job holds for 3.5 s: three ticks (at 1, 2 and 3 s).
    let mut tasks = Vec::new();
    for (_, _, sup, claimed) in &runs {
        for job in claimed.iter().cloned() {
            let sup = sup.clone();
            tasks.push(tokio::spawn(async move {
                sup.run(job.lease, job.payload, None, |_ctx: JobContext| async {
                    tokio::time::sleep(Duration::from_millis(3500)).await;
                    Ok(Vec::new())
                })
                .await
            }));
        }
    }
    for t in tasks {
        t.await.map_err(|e| e.to_string())?;
    }
    Ok(runs
        .iter()
        .map(|(k, counting, sup, _)| {
            let m = sup.metrics().snapshot();
            (*k, m.heartbeats, counting.get("heartbeat"), m.renewals)
        })
        .collect())
}

/// Time from a takeover in the database to the moment the old holder's handler is cancelled,
/// through the consumer runtime over `source`: `samples` deliveries are claimed and held, then
/// given to another owner (a newer epoch) one at a time, spread over about 3 s; the heartbeat of
/// a 3 s lease ticks every second. Each latency is from the takeover statement's return to the
/// handler's cancellation token firing.
pub(crate) async fn consumer_cancellation<S: Source>(
    source: S,
    pg: &PgFence,
    samples: usize,
) -> Result<Vec<Duration>, String> {
    let queue = source.queue().clone();
    let store: Arc<dyn FenceStore> = Arc::new(pg.clone());
    let lease = LeaseDuration::from_secs(3).map_err(|e| e.to_string())?;
    let config = ConsumerConfig::new(SupervisorConfig::new(lease))
        .concurrency(samples)
        .batch(10)
        .grace(Duration::from_millis(100));
    let consumer = Consumer::new(source, store, config);
    type Marks = Arc<Mutex<HashMap<String, Arc<Mutex<Option<Instant>>>>>>;
    let held: Marks = Arc::default();
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let (held, stop) = (Arc::clone(&held), stop.clone());
        async move {
            let handler = move |ctx: JobContext| {
                let held = Arc::clone(&held);
                async move {
                    // The handler's future is dropped at cancellation; a watcher notes the moment.
                    let mark: Arc<Mutex<Option<Instant>>> = Arc::default();
                    held.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(ctx.key().as_str().to_owned(), Arc::clone(&mark));
                    let token = ctx.cancellation();
                    tokio::spawn(async move {
                        token.cancelled().await;
                        *mark.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
                    });
                    std::future::pending::<()>().await;
                    Ok::<_, JobError>(Vec::new())
                }
            };
            consumer.run(handler, stop).await
        }
    });
    let claimed = || held.lock().unwrap_or_else(|p| p.into_inner()).len();
    wait_until("every sample to be claimed", Duration::from_secs(60), || claimed() >= samples).await?;
    let keys: Vec<String> = held.lock().unwrap_or_else(|p| p.into_inner()).keys().cloned().collect();
    let s = pg.get_schema().as_str();
    let mut stolen_at = Vec::new();
    for key in &keys {
        sqlx::query(AssertSqlSafe(format!(
            "UPDATE {s}.jobs SET epoch = epoch + 1, owner = 'thief', \
             lease_until = clock_timestamp() + interval '30 seconds' WHERE queue = $1 AND key = $2"
        )))
        .bind(queue.as_str().to_owned())
        .bind(key.clone())
        .execute(pg.pool())
        .await
        .map_err(|e| e.to_string())?;
        stolen_at.push(Instant::now());
        let jitter = rand::random::<u64>() % 60;
        tokio::time::sleep(Duration::from_millis(2800 / samples.max(1) as u64 + jitter)).await;
    }
    let marks: Vec<Arc<Mutex<Option<Instant>>>> = {
        let held = held.lock().unwrap_or_else(|p| p.into_inner());
        keys.iter().filter_map(|k| held.get(k).cloned()).collect()
    };
    let fired = || marks.iter().all(|m| m.lock().unwrap_or_else(|p| p.into_inner()).is_some());
    wait_until("every handler to be cancelled", Duration::from_secs(10), fired).await?;
    stop.cancel();
    run.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    let mut lat: Vec<Duration> = marks
        .iter()
        .zip(stolen_at)
        .filter_map(|(m, stolen)| {
            m.lock().unwrap_or_else(|p| p.into_inner()).map(|at| at.saturating_duration_since(stolen))
        })
        .collect();
    lat.sort();
    Ok(lat)
}

pub(crate) fn print_cancellation(lat: &[Duration]) {
    line(
        "cancellation after a takeover, lease 3 s (tick 1 s): p50 / max",
        format!(
            "{} / {}  ({} samples)",
            ms(percentile(lat, 0.5)),
            ms(lat.last().copied().unwrap_or_default()),
            lat.len()
        ),
    );
}
