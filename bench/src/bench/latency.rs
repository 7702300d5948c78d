//! `bench --latency [--rates 10,100,1000] [--latency-secs 5] [--rounds 3]`: pickup latency of the
//! table queue (issue #33). Jobs arrive one at a time, evenly spaced at each rate, each its own
//! `enqueue` call (its own transaction) from a producer in this process; an enqueue that is due
//! starts on time even while an earlier one is still out. One consumer at its defaults
//! (concurrency 16) runs them with a handler that notes its start and returns at once.
//!
//! A job's latency is its handler's start minus the instant just before the producer called
//! `enqueue` (one process, one monotonic clock), so it includes the enqueue's own round trip
//! and overstates the pickup by that much; its median is printed too. Per rate and backend:
//! p50, p90, p99 and max, each the median over the rounds. Backends: PostgreSQL connected as by
//! default (`PgFence::connect(url)`), PostgreSQL told it sits behind a transaction-mode pooler
//! (`?pooler=transaction`, straight to the server) and SQLite (a file in a temporary directory).
//! Each backend gets a fresh schema (file), dropped (removed) at the end; each rate and round a
//! queue of its own; the backends take turns in an order that rotates round by round.

use super::*;

/// Concurrency of the consumer under test.
const CONCURRENCY: usize = 16;
/// How long the consumer runs idle before the first job arrives.
const SETTLE: Duration = Duration::from_millis(300);

/// One backend under test.
struct Backend {
    name: &'static str,
    store: Arc<dyn FenceStore>,
}

/// One rate's latencies (sorted) and the enqueues' round trips (sorted).
struct Sample {
    latency: Vec<Duration>,
    enqueue: Vec<Duration>,
}

/// `url` with `param` added to its query.
fn with_param(url: &str, param: &str) -> String {
    format!("{url}{}{param}", if url.contains('?') { '&' } else { '?' })
}

/// Opens the three backends, each with a fresh schema (PostgreSQL) or file (SQLite).
async fn open(url: &str, dir: &std::path::Path, pg_schemas: &mut Vec<String>) -> Result<Vec<Backend>, String> {
    let mut backends = Vec::new();
    for (name, target) in
        [("PostgreSQL", url.to_owned()), ("PostgreSQL, pooler=transaction", with_param(url, "pooler=transaction"))]
    {
        let schema = SchemaName::new(format!("bench_{:08x}", rand::random::<u32>())).map_err(|e| e.to_string())?;
        pg_schemas.push(schema.as_str().to_owned());
        let store = PgFence::connect(&target).await.map_err(|e| format!("{name}: {e}"))?.schema(schema);
        store.migrate().await.map_err(|e| format!("{name}: {e}"))?;
        backends.push(Backend { name, store: Arc::new(store) });
    }
    let file = dir.join("latency.db");
    let store =
        brokerfence::SqliteFence::open(&format!("sqlite:{}", file.display())).await.map_err(|e| e.to_string())?;
    store.migrate().await.map_err(|e| format!("SQLite: {e}"))?;
    backends.push(Backend { name: "SQLite (file)", store: Arc::new(store) });
    Ok(backends)
}

/// Jobs arriving at `rate` per second on queue `q` of `store`, picked up by one consumer.
async fn measure(store: &Arc<dyn FenceStore>, q: QueueName, rate: f64, jobs: usize) -> Result<Sample, String> {
    let started: Arc<Mutex<Vec<Option<Instant>>>> = Arc::new(Mutex::new(vec![None; jobs]));
    let lease = LeaseDuration::from_secs(30).map_err(|e| e.to_string())?;
    let config = ConsumerConfig::new(SupervisorConfig::new(lease)).concurrency(CONCURRENCY);
    let consumer = Consumer::new(TableQueue::new(Arc::clone(store), q.clone()), Arc::clone(store), config);
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let (started, stop) = (Arc::clone(&started), stop.clone());
        async move {
            let handler = move |ctx: JobContext| {
                let at = Instant::now();
                let started = Arc::clone(&started);
                async move {
                    let i = ctx.key().as_str().strip_prefix('l').and_then(|n| n.parse::<usize>().ok());
                    let mut started = started.lock().unwrap_or_else(|p| p.into_inner());
                    if let Some(slot) = i.and_then(|i| started.get_mut(i)) {
                        slot.get_or_insert(at);
                    }
                    Ok::<_, JobError>(Vec::new())
                }
            };
            consumer.run(handler, stop).await.map_err(|e| e.to_string())
        }
    });
    let produced = async {
        tokio::time::sleep(SETTLE).await;
        let period = Duration::from_secs_f64(1.0 / rate);
        let first = tokio::time::Instant::now();
        let mut enqueues = tokio::task::JoinSet::new();
        for i in 0..jobs {
            tokio::time::sleep_until(first + period.mul_f64(i as f64)).await;
            let (store, q) = (Arc::clone(store), q.clone());
            enqueues.spawn(async move {
                let key = JobKey::new(format!("l{i:07}")).map_err(|e| e.to_string())?;
                let at = Instant::now();
                store.enqueue(&q, &key, b"{}").await.map_err(|e| e.to_string())?;
                Ok::<_, String>((i, at, at.elapsed()))
            });
        }
        let (mut sent, mut enqueue) = (vec![None; jobs], Vec::with_capacity(jobs));
        while let Some(r) = enqueues.join_next().await {
            let (i, at, took) = r.map_err(|e| e.to_string())??;
            sent[i] = Some(at);
            enqueue.push(took);
        }
        let all_started = || started.lock().unwrap_or_else(|p| p.into_inner()).iter().all(Option::is_some);
        wait_until("every job's handler to start", Duration::from_secs(60), all_started).await?;
        Ok::<_, String>((sent, enqueue))
    }
    .await;
    stop.cancel();
    run.await.map_err(|e| e.to_string())??;
    let (sent, mut enqueue) = produced?;
    let started = started.lock().unwrap_or_else(|p| p.into_inner());
    let mut latency: Vec<Duration> = sent
        .iter()
        .zip(started.iter())
        .filter_map(|(s, h)| Some(h.as_ref()?.saturating_duration_since(*s.as_ref()?)))
        .collect();
    latency.sort();
    enqueue.sort();
    Ok(Sample { latency, enqueue })
}

/// The measurement, printed as a table per rate and backend.
pub async fn run(o: &Opts, url: &str, rates: &[f64], secs: f64) -> Result<(), String> {
    if let Some(r) = rates.iter().find(|r| !(r.is_finite() && **r > 0.0)) {
        return Err(format!("--rates: {r} is not a rate"));
    }
    let dir = std::env::temp_dir().join(format!("brokerfence-latency-{:08x}", rand::random::<u32>()));
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut schemas = Vec::new();
    let backends = open(url, &dir, &mut schemas).await;
    let result = match &backends {
        Ok(backends) => measure_all(o, backends, rates, secs).await,
        Err(e) => Err(e.clone()),
    };
    drop(backends);
    if let Ok(pool) = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect(url).await {
        for s in &schemas {
            let _ = sqlx::query(AssertSqlSafe(format!("DROP SCHEMA IF EXISTS {s} CASCADE"))).execute(&pool).await;
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Every rate, round and backend, printed as one table.
async fn measure_all(o: &Opts, backends: &[Backend], rates: &[f64], secs: f64) -> Result<(), String> {
    println!(
        "\n[latency] pickup latency: jobs arrive one at a time, evenly spaced (one enqueue = one transaction each), \
         {secs} s per rate, one consumer at its defaults (concurrency {CONCURRENCY}), {} rounds (backends in \
         rotating order); latency = handler start − just before `enqueue` was called, so it includes the \
         enqueue's round trip (its median is the last column); figures are medians over the rounds",
        o.rounds
    );
    println!(
        "  {:>7} | {:<31} | {:>6} | {:>9} | {:>9} | {:>9} | {:>9} | {:>11}",
        "jobs/s", "backend", "jobs", "p50", "p90", "p99", "max", "enqueue p50"
    );
    for &rate in rates {
        let jobs = ((rate * secs).round() as usize).max(1);
        let mut samples: Vec<Vec<Sample>> = backends.iter().map(|_| Vec::new()).collect();
        for round in 0..o.rounds {
            for turn in 0..backends.len() {
                let b = (turn + round) % backends.len();
                let q = QueueName::new(format!("latency-{rate}-{round}")).map_err(|e| e.to_string())?;
                let sample = measure(&backends[b].store, q, rate, jobs)
                    .await
                    .map_err(|e| format!("{} at {rate} jobs/s: {e}", backends[b].name))?;
                samples[b].push(sample);
            }
        }
        for (backend, samples) in backends.iter().zip(samples) {
            let m = |p: f64| {
                let v = samples.iter().map(|s| percentile(&s.latency, p).as_secs_f64() * 1000.0).collect();
                format!("{:.2} ms", median(v))
            };
            let enqueue = median(samples.iter().map(|s| percentile(&s.enqueue, 0.5).as_secs_f64() * 1000.0).collect());
            println!(
                "  {:>7} | {:<31} | {:>6} | {:>9} | {:>9} | {:>9} | {:>9} | {:>8.2} ms",
                rate,
                backend.name,
                jobs,
                m(0.5),
                m(0.9),
                m(0.99),
                m(1.0),
                enqueue
            );
        }
    }
    Ok(())
}
