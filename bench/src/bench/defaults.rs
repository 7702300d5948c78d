//! `bench --defaults`: the table queue as the README builds it, with only its concurrency set,
//! against a plain `FOR UPDATE SKIP LOCKED` loop on the same PostgreSQL (issue #18).
//!
//! The plain loop pipelines (issue #33, `bench/pipelined.rs`): it claims ahead of its handlers
//! as the table queue does at its defaults (up to twice the concurrency, at most 256, claimed and
//! waiting; up to 4 claims of at most 64 in flight), runs each job as soon as a slot is free, and
//! marks finished jobs done in groups (256 keys or a 5 ms window). Before, it claimed only for
//! free slots and marked each claimed batch done on its own, so the ratio measured the fenced
//! consumer's claims ahead more than the fence; figures before issue #33 are not comparable.
//!
//! Per concurrency (16, 64, 128 unless `--levels` says otherwise) and per round: one
//! fenced drain and one plain drain of `--jobs` jobs (20,000 by default) enqueued first, each job
//! sleeping `--work-ms` (1 ms). The order alternates round by round (fenced first, then plain
//! first), so drift on the machine falls on both. Nothing is analyzed: the tables are as a fresh
//! bulk enqueue leaves them. A drain's rate counts the time from its start to its last job done
//! (since issue #33 not the consumer's shutdown after it, which the fenced consumer's idle claims
//! could lengthen by up to its 100 ms poll); its CPU and WAL count the shutdown too. Printed per
//! concurrency: the median rate of each, the median of the per-round ratios, PostgreSQL's CPU
//! time per job of each (every `postgres` process in `/proc`) and the median of its per-round
//! ratios, WAL bytes per job (`pg_current_wal_lsn()`), this process's own CPU per job (the
//! consumer's side), and the jobs per statement (the fenced consumer's calls of its store,
//! counted by a wrapper; the plain loop's claims and finishes), medians too.

use super::*;

/// What one drain cost.
#[derive(Debug, Clone, Copy)]
struct Drain {
    rate: f64,
    /// PostgreSQL CPU per job, microseconds.
    cpu_us: f64,
    /// This process's CPU per job (the consumer under test), microseconds.
    own_us: f64,
    /// WAL per job, bytes.
    wal: f64,
    /// Jobs per statement: 2 × the drain's jobs over the statements it sent (a job takes one
    /// claim and one commit); the fenced side counts every store call a worker makes.
    per_statement: f64,
}

/// Measures `drain` (which runs until `jobs` are done and answers its statements and the instant
/// the last job was done): its rate up to that instant (not counting the shutdown), PostgreSQL
/// CPU and WAL per job (counting it).
async fn measured<F: std::future::Future<Output = Result<(u64, Instant), String>>>(
    pool: &sqlx::PgPool,
    jobs: usize,
    drain: F,
) -> Result<Drain, String> {
    let (wal0, cpu0, started) = (wal_lsn(pool).await?, CpuSample::now(), Instant::now());
    let (statements, done_at) = drain.await?;
    let secs = done_at.saturating_duration_since(started).as_secs_f64();
    let cpu1 = CpuSample::now();
    let wal = wal_bytes(pool, &wal0, &wal_lsn(pool).await?).await?;
    let n = jobs as f64;
    let us = |a: u64, b: u64| b.saturating_sub(a) as f64 * 1e6 / ticks_per_sec() / n;
    Ok(Drain {
        rate: n / secs.max(1e-9),
        cpu_us: us(cpu0.postgres, cpu1.postgres),
        own_us: us(cpu0.consumer, cpu1.consumer),
        wal: wal / n,
        per_statement: 2.0 * n / statements.max(1) as f64,
    })
}

/// The fenced consumer, built as the README shows, with only its concurrency set (and its
/// prefetch, with `--prefetch`).
async fn fenced(
    store: &Arc<PgFence>,
    q: &QueueName,
    concurrency: usize,
    prefetch: Option<usize>,
    jobs: usize,
    work: Duration,
) -> Result<(u64, Instant), String> {
    let lease = LeaseDuration::from_secs(30).map_err(|e| e.to_string())?;
    let counting = Counting::new(store.clone());
    let shared: Arc<dyn FenceStore> = counting.clone();
    let config = ConsumerConfig::new(SupervisorConfig::new(lease)).concurrency(concurrency);
    let config = match prefetch {
        Some(n) => config.prefetch(n),
        None => config,
    };
    let consumer = Arc::new(Consumer::new(TableQueue::new(Arc::clone(&shared), q.clone()), shared, config));
    let metrics = consumer.metrics();
    let stop = CancellationToken::new();
    let run = {
        let (consumer, stop) = (Arc::clone(&consumer), stop.clone());
        tokio::spawn(async move {
            let handler = move |_ctx: JobContext| async move {
                tokio::time::sleep(work).await;
                Ok::<_, JobError>(b"ok".to_vec())
            };
            consumer.run(handler, stop).await
        })
    };
    let done =
        wait_until("the fenced drain", Duration::from_secs(600), || metrics.snapshot().completions >= jobs as u64)
            .await;
    let done_at = Instant::now();
    stop.cancel();
    run.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    done?;
    Ok((counting.total(), done_at))
}

/// The comparison, printed as a table.
pub async fn run(o: &Opts, url: &str, levels: &[usize]) -> Result<(), String> {
    let schema = SchemaName::new(format!("bench_{:08x}", rand::random::<u32>())).map_err(|e| e.to_string())?;
    let store = Arc::new(PgFence::connect(url).await.map_err(|e| e.to_string())?.schema(schema));
    store.migrate().await.map_err(|e| e.to_string())?;
    let s = store.get_schema().as_str().to_owned();
    // The plain loop's own pool, the size of the fence's (16).
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(16)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .map_err(|e| e.to_string())?;
    pipelined::create_table(&pool, &s).await?;
    println!(
        "\n[defaults] table queue at its defaults vs a plain SKIP LOCKED loop that pipelines (claims ahead, grouped \
         finishes): {} jobs per drain, {} of work each, {} paired rounds (order alternating), tables never analyzed{}",
        o.jobs,
        ms(o.work),
        o.rounds,
        o.defaults_prefetch.map(|n| format!("; fenced with prefetch({n})")).unwrap_or_default()
    );
    println!(
        "  {:>11} | {:>14} | {:>14} | {:>13} | {:>17} | {:>10} | {:>17} | {:>19} | {:>17}",
        "concurrency",
        "fenced jobs/s",
        "plain jobs/s",
        "fenced/plain",
        "PG CPU/job f / p",
        "PG CPU f/p",
        "WAL/job f / p",
        "client CPU/job f / p",
        "jobs/statement f / p"
    );
    let result = async {
        for &c in levels {
            let (mut f, mut p, mut ratios, mut cpu_ratios) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
            for round in 0..o.rounds {
                let fq = QueueName::new(format!("fenced-{c}-{round}")).map_err(|e| e.to_string())?;
                let pq = format!("plain-{c}-{round}");
                pipelined::fill_fenced(&store, &fq, o.jobs).await?;
                pipelined::fill_plain(&pool, &s, &pq, o.jobs).await?;
                let fenced_first = round % 2 == 0;
                let (mut fd, mut pd) = (None, None);
                for turn in 0..2 {
                    if (turn == 0) == fenced_first {
                        fd = Some(measured(&pool, o.jobs, fenced(&store, &fq, c, o.defaults_prefetch, o.jobs, o.work)).await?);
                    } else {
                        let looped = pipelined::PlainLoop::new(pool.clone(), &s, &pq, c, o.work);
                        pd = Some(measured(&pool, o.jobs, pipelined::drain(looped, o.jobs)).await?);
                    }
                }
                let (fd, pd) = (fd.ok_or("no fenced drain")?, pd.ok_or("no plain drain")?);
                ratios.push(fd.rate / pd.rate);
                cpu_ratios.push(fd.cpu_us / pd.cpu_us.max(1e-9));
                f.push(fd);
                p.push(pd);
            }
            let m = |v: &[Drain], g: fn(&Drain) -> f64| median(v.iter().map(g).collect());
            println!(
                "  {:>11} | {:>14.0} | {:>14.0} | {:>13.2} | {:>7.1} / {:>4.1} µs | {:>10.2} | {:>7.0} / {:>4.0} B | {:>9.0} / {:>4.0} µs | {:>9.1} / {:>5.1}",
                c,
                m(&f, |d| d.rate),
                m(&p, |d| d.rate),
                median(ratios),
                m(&f, |d| d.cpu_us),
                m(&p, |d| d.cpu_us),
                median(cpu_ratios),
                m(&f, |d| d.wal),
                m(&p, |d| d.wal),
                m(&f, |d| d.own_us),
                m(&p, |d| d.own_us),
                m(&f, |d| d.per_statement),
                m(&p, |d| d.per_statement),
            );
        }
        Ok::<(), String>(())
    }
    .await;
    let _ = sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {s} CASCADE"))).execute(&pool).await;
    result
}
