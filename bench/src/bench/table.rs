//! The table queue on PostgreSQL: fenced against a plain SKIP LOCKED loop, a handler-owned commit
//! against the runtime's grouped commit, and the long run's memory.

use super::*;

/// The bench's own schema on PostgreSQL, with a plain queue table next to the fence's.
pub struct Pg {
    pub fence: PgFence,
    /// The handlers' own pool, for transactions that end with `complete_in` (an application
    /// pool of its own, as a user's handlers would have).
    pub handlers: sqlx::PgPool,
}

impl Pg {
    pub async fn connect(url: &str) -> Result<Self, String> {
        let schema = SchemaName::new(format!("bench_{:08x}", rand::random::<u32>())).map_err(|e| e.to_string())?;
        let options: sqlx::postgres::PgConnectOptions = url.parse().map_err(|e: sqlx::Error| e.to_string())?;
        let pool = PgFence::pool_options()
            .max_connections(16)
            .connect_with(options.clone().application_name("brokerfence-bench"))
            .await
            .map_err(|e| format!("connect to PostgreSQL (run `bash localstack/up`): {e}"))?;
        let handlers = sqlx::postgres::PgPoolOptions::new()
            .max_connections(32)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(options.clone().application_name("brokerfence-bench-handlers"))
            .await
            .map_err(|e| format!("connect to PostgreSQL: {e}"))?;
        let fence = PgFence::new(pool).schema(schema);
        fence.migrate().await.map_err(|e| e.to_string())?;
        let s = fence.get_schema().as_str();
        for stmt in [
            format!(
                "CREATE TABLE {s}.plain (queue text NOT NULL, key text NOT NULL, state text NOT NULL DEFAULT 'pending', \
                 payload bytea, result bytea, PRIMARY KEY (queue, key))"
            ),
            format!("CREATE INDEX plain_pending ON {s}.plain (queue) WHERE state = 'pending'"),
        ] {
            sqlx::query(AssertSqlSafe(stmt)).execute(fence.pool()).await.map_err(|e| e.to_string())?;
        }
        Ok(Self { fence, handlers })
    }

    pub async fn describe(&self) -> Result<String, String> {
        let row: (String, String, String, String) = sqlx::query_as(
            "SELECT split_part(version(), ' on ', 1), current_setting('synchronous_commit'), current_setting('fsync'), \
             current_setting('shared_buffers')",
        )
        .fetch_one(self.fence.pool())
        .await
        .map_err(|e| e.to_string())?;
        Ok(format!(
            "{} on the same machine (synchronous_commit={}, fsync={}, shared_buffers={})",
            row.0, row.1, row.2, row.3
        ))
    }

    pub async fn cleanup(&self) {
        let s = self.fence.get_schema().as_str();
        let _ = sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {s} CASCADE"))).execute(self.fence.pool()).await;
    }

    async fn enqueue(&self, q: &QueueName, n: usize) -> Result<(), String> {
        for start in (0..n).step_by(5000) {
            let jobs: Vec<(JobKey, Vec<u8>)> = (start..(start + 5000).min(n))
                .map(|i| JobKey::new(format!("job-{i:07}")).map(|k| (k, b"{\"n\":1}".to_vec())))
                .collect::<Result<_, _>>()
                .map_err(|e| e.to_string())?;
            self.fence.enqueue_many(q, &jobs).await.map_err(|e| e.to_string())?;
        }
        sqlx::query("ANALYZE").execute(self.fence.pool()).await.map_err(|e| e.to_string())?;
        Ok(())
    }

    async fn enqueue_plain(&self, q: &str, n: usize) -> Result<(), String> {
        let s = self.fence.get_schema().as_str();
        sqlx::query(AssertSqlSafe(format!(
            "INSERT INTO {s}.plain (queue, key, payload) SELECT $1, 'job-' || lpad(i::text, 7, '0'), '{{\"n\":1}}'::bytea \
             FROM generate_series(0, $2 - 1) i"
        )))
        .bind(q.to_owned())
        .bind(i64::try_from(n).unwrap_or(i64::MAX))
        .execute(self.fence.pool())
        .await
        .map_err(|e| e.to_string())?;
        sqlx::query("ANALYZE").execute(self.fence.pool()).await.map_err(|e| e.to_string())?;
        Ok(())
    }
}

fn config(o: &Opts) -> Result<ConsumerConfig, String> {
    let lease = LeaseDuration::from_secs(30).map_err(|e| e.to_string())?;
    Ok(ConsumerConfig::new(SupervisorConfig::new(lease).commit_window(o.commit_window))
        .concurrency(o.concurrency)
        .batch(o.batch)
        .claim_window(o.claim_window)
        .grace(Duration::from_secs(5)))
}

/// The fenced consumer runtime (Consumer + TableQueue + Supervisor), `workers` consumers in
/// this process. Samples RSS at the start, the middle and the end.
async fn fenced_consumer(
    o: &Opts,
    pg: &Pg,
    jobs: usize,
    counting: &Arc<Counting>,
) -> Result<(Rate, [(u64, u64); 3]), String> {
    fenced_consumer_committing(o, pg, jobs, counting, None).await
}

/// [`fenced_consumer`], whose handlers commit their results themselves when `own` is given:
/// a transaction on that pool, `complete_in`, `COMMIT` (the handler-owned commit), instead of
/// returning them to the runtime's grouped commit.
async fn fenced_consumer_committing(
    o: &Opts,
    pg: &Pg,
    jobs: usize,
    counting: &Arc<Counting>,
    own: Option<&sqlx::PgPool>,
) -> Result<(Rate, [(u64, u64); 3]), String> {
    let q = QueueName::new(format!("fenced-{jobs}-{:x}", rand::random::<u32>())).map_err(|e| e.to_string())?;
    pg.enqueue(&q, jobs).await?;
    counting.reset();
    let store: Arc<dyn FenceStore> = counting.clone();
    let stop = CancellationToken::new();
    let rss_start = rss_kb();
    let started = Instant::now();
    let mut runs = Vec::new();
    let mut metrics = Vec::new();
    for _ in 0..o.workers {
        let source = TableQueue::new(Arc::clone(&store), q.clone()).idle_wait(Duration::from_millis(5));
        let consumer = Consumer::new(source, Arc::clone(&store), config(o)?);
        metrics.push(consumer.metrics());
        let (stop, work, own) = (stop.clone(), o.work, own.cloned());
        runs.push(tokio::spawn(async move {
            let handler = move |ctx: JobContext| {
                let own = own.clone();
                async move {
                    tokio::time::sleep(work).await;
                    if let Some(pool) = own {
                        let mut tx = pool.begin().await.map_err(JobError::retry)?;
                        ctx.complete_in(&mut *tx, b"ok").await.map_err(JobError::retry)?;
                        tx.commit().await.map_err(JobError::retry)?;
                    }
                    Ok::<_, JobError>(b"ok".to_vec())
                }
            };
            consumer.run(handler, stop).await
        }));
    }
    let target = jobs as u64;
    let completed = || metrics.iter().map(|m| m.snapshot().completions).sum::<u64>();
    let mut rss_mid = None;
    let deadline = Instant::now() + Duration::from_secs(900);
    loop {
        let n = completed();
        if rss_mid.is_none() && n >= target / 2 {
            rss_mid = Some(rss_kb());
        }
        if n >= target {
            break;
        }
        if Instant::now() > deadline {
            return Err("fenced consumer run did not finish in 15 minutes".into());
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // All commits are in: the elapsed time is the throughput time.
    let secs = started.elapsed().as_secs_f64();
    let rss_end = rss_kb();
    stop.cancel();
    for r in runs {
        r.await.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    }
    Ok((Rate { jobs, secs }, [rss_start, rss_mid.unwrap_or(rss_start), rss_end]))
}

/// A plain SKIP LOCKED table queue with the same shape of runtime as the consumer: claim up
/// to `batch` free slots, one task per job, the slot held until the job's commit is done.
/// Commits are one UPDATE per job, or (`group`) grouped like the supervisor's: a commit task
/// takes every completion queued at the moment and commits them with one UPDATE. No epochs,
/// no leases, no heartbeats.
async fn plain_consumer(o: &Opts, pg: &Pg, jobs: usize, group: bool) -> Result<Rate, String> {
    let q = format!("plain-{jobs}-{:x}", rand::random::<u32>());
    pg.enqueue_plain(&q, jobs).await?;
    let s = pg.fence.get_schema().as_str().to_owned();
    let claim: Arc<str> = format!(
        "UPDATE {s}.plain t SET state = 'running' FROM (SELECT queue, key FROM {s}.plain \
         WHERE queue = $1 AND state = 'pending' LIMIT $2 FOR UPDATE SKIP LOCKED) p \
         WHERE t.queue = p.queue AND t.key = p.key RETURNING t.key, t.payload"
    )
    .into();
    let complete_one: Arc<str> =
        format!("UPDATE {s}.plain SET state = 'done', result = $3 WHERE queue = $1 AND key = $2").into();
    let complete_many: Arc<str> = format!(
        "UPDATE {s}.plain t SET state = 'done', result = u.r FROM unnest($2::text[], $3::bytea[]) AS u(k, r) \
         WHERE t.queue = $1 AND t.key = u.k"
    )
    .into();
    type Commit = (String, tokio::sync::oneshot::Sender<bool>);
    let done = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut workers = Vec::new();
    for _ in 0..o.workers {
        let (pool, q, claim, done) = (pg.fence.pool().clone(), q.clone(), Arc::clone(&claim), Arc::clone(&done));
        let (concurrency, batch, work, total) = (o.concurrency, o.batch, o.work, jobs as u64);
        // The group-commit task of this worker.
        let (commit_tx, mut commit_rx) = tokio::sync::mpsc::unbounded_channel::<Commit>();
        let committer = {
            let (pool, q, many) = (pool.clone(), q.clone(), Arc::clone(&complete_many));
            tokio::spawn(async move {
                while let Some(first) = commit_rx.recv().await {
                    let mut batch = vec![first];
                    while batch.len() < 256 {
                        match commit_rx.try_recv() {
                            Ok(c) => batch.push(c),
                            Err(_) => break,
                        }
                    }
                    let (keys, replies): (Vec<String>, Vec<_>) = batch.into_iter().unzip();
                    let results = vec![b"ok".to_vec(); keys.len()];
                    let ok = sqlx::query(AssertSqlSafe(Arc::clone(&many)))
                        .bind(q.clone())
                        .bind(keys)
                        .bind(results)
                        .execute(&pool)
                        .await
                        .is_ok();
                    for r in replies {
                        let _ = r.send(ok);
                    }
                }
            })
        };
        let one = Arc::clone(&complete_one);
        workers.push(tokio::spawn(async move {
            let slots = Arc::new(tokio::sync::Semaphore::new(concurrency));
            let mut tasks = tokio::task::JoinSet::new();
            while done.load(Ordering::Relaxed) < total {
                while tasks.try_join_next().is_some() {}
                let free = slots.available_permits().min(batch);
                if free == 0 {
                    let _ = tasks.join_next().await;
                    continue;
                }
                let rows: Vec<(String, Vec<u8>)> = sqlx::query_as(AssertSqlSafe(Arc::clone(&claim)))
                    .bind(q.clone())
                    .bind(i64::try_from(free).unwrap_or(1))
                    .fetch_all(&pool)
                    .await
                    .map_err(|e| e.to_string())?;
                if rows.is_empty() {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    continue;
                }
                for (key, _payload) in rows {
                    let permit = Arc::clone(&slots).acquire_owned().await.map_err(|e| e.to_string())?;
                    let (pool, q, one, done, commit_tx) =
                        (pool.clone(), q.clone(), Arc::clone(&one), Arc::clone(&done), commit_tx.clone());
                    tasks.spawn(async move {
                        tokio::time::sleep(work).await;
                        let ok = if group {
                            let (tx, rx) = tokio::sync::oneshot::channel();
                            commit_tx.send((key, tx)).is_ok() && rx.await.unwrap_or(false)
                        } else {
                            sqlx::query(AssertSqlSafe(one))
                                .bind(q)
                                .bind(key)
                                .bind(b"ok".to_vec())
                                .execute(&pool)
                                .await
                                .is_ok()
                        };
                        if ok {
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                        drop(permit);
                    });
                }
            }
            while tasks.join_next().await.is_some() {}
            drop(commit_tx);
            let _ = committer.await;
            Ok::<(), String>(())
        }));
    }
    wait_until("the plain consumers", Duration::from_secs(600), || done.load(Ordering::Relaxed) >= jobs as u64).await?;
    let secs = started.elapsed().as_secs_f64();
    for w in workers {
        w.await.map_err(|e| e.to_string())??;
    }
    Ok(Rate { jobs, secs })
}

/// One job at a time, no concurrency: fenced (claim_next(1) → supervised handler → fenced
/// commit) against plain (claim → commit). Returns the sorted per-job times of each.
async fn latency(pg: &Pg, n: usize) -> Result<(Vec<Duration>, Vec<Duration>), String> {
    let q = QueueName::new("latency").map_err(|e| e.to_string())?;
    pg.enqueue(&q, n).await?;
    let store: Arc<dyn FenceStore> = Arc::new(pg.fence.clone());
    let lease = LeaseDuration::from_secs(30).map_err(|e| e.to_string())?;
    let owner = Owner::unique("lat");
    let sup = Supervisor::new(Arc::clone(&store), owner.clone(), SupervisorConfig::new(lease));
    let mut fenced = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let mut claimed = store.claim_next(&q, &owner, lease, 1).await.map_err(|e| e.to_string())?;
        let job = claimed.pop().ok_or("latency queue ran dry")?;
        let outcome = sup.run(job.lease, job.payload, None, |_ctx: JobContext| async { Ok(b"ok".to_vec()) }).await;
        if !outcome.is_completed() {
            return Err(format!("latency run: {outcome:?}"));
        }
        fenced.push(t.elapsed());
    }
    let pq = format!("plain-latency-{:x}", rand::random::<u32>());
    pg.enqueue_plain(&pq, n).await?;
    let s = pg.fence.get_schema().as_str();
    let claim = format!(
        "UPDATE {s}.plain t SET state = 'running' FROM (SELECT queue, key FROM {s}.plain \
         WHERE queue = $1 AND state = 'pending' LIMIT 1 FOR UPDATE SKIP LOCKED) p \
         WHERE t.queue = p.queue AND t.key = p.key RETURNING t.key, t.payload"
    );
    let complete = format!("UPDATE {s}.plain SET state = 'done', result = $3 WHERE queue = $1 AND key = $2");
    let mut plain = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        let (key, _payload): (String, Vec<u8>) = sqlx::query_as(AssertSqlSafe(claim.clone()))
            .bind(pq.clone())
            .fetch_one(pg.fence.pool())
            .await
            .map_err(|e| e.to_string())?;
        sqlx::query(AssertSqlSafe(complete.clone()))
            .bind(pq.clone())
            .bind(key)
            .bind(b"ok".to_vec())
            .execute(pg.fence.pool())
            .await
            .map_err(|e| e.to_string())?;
        plain.push(t.elapsed());
    }
    fenced.sort();
    plain.sort();
    Ok((fenced, plain))
}

/// The handler-owned commit against the runtime's grouped commit: the same consumer, the same
/// jobs and work, `rounds` paired rounds (the order alternating); medians.
async fn own_commit(o: &Opts, pg: &Pg, counting: &Arc<Counting>) -> Result<(), String> {
    let (mut grouped, mut own, mut own_statements) = (Vec::new(), Vec::new(), String::new());
    for round in 0..o.rounds {
        for handler_owned in if round % 2 == 0 { [false, true] } else { [true, false] } {
            let pool = handler_owned.then_some(&pg.handlers);
            let (rate, _) = fenced_consumer_committing(o, pg, o.jobs, counting, pool).await?;
            if handler_owned {
                own.push(rate.per_sec());
                own_statements = counting.describe();
            } else {
                grouped.push(rate.per_sec());
            }
        }
    }
    let (g, h) = (median(grouped), median(own));
    line(&format!("commit path, median of {} paired rounds ({} jobs each)", o.rounds, o.jobs), "");
    line("  runtime's grouped commit (the handler returns its result)", format!("{g:.0} jobs/s"));
    line("  handler-owned commit (BEGIN, complete_in, COMMIT; a grouped read)", format!("{h:.0} jobs/s"));
    line("  ratio handler-owned / grouped", format!("{:.2}", h / g.max(f64::MIN_POSITIVE)));
    line("  fence statements of the handler-owned run (besides the handler's 3)", own_statements);
    Ok(())
}

pub async fn run(o: &Opts, pg: &Pg) -> Result<(), String> {
    println!("\n[table queue on PostgreSQL]");
    let counting = Counting::new(Arc::new(pg.fence.clone()));
    if o.own_commit_only {
        return own_commit(o, pg, &counting).await;
    }

    // Throughput: the fenced consumer runtime against a plain SKIP LOCKED queue run the same
    // way (same workers, concurrency, claim batch, 1 ms of work; commits grouped the same way).
    // Best of `rounds`, alternating the order, because the machine is shared.
    let best = |a: Option<Rate>, b: Rate| Some(a.filter(|a| a.per_sec() >= b.per_sec()).unwrap_or(b));
    let (mut plain_single, mut plain, mut fenced) = (None, None, None);
    let (mut per_job, mut breakdown, mut described) = (0.0, HashMap::new(), String::new());
    for round in 0..o.rounds {
        if round % 2 == 1 {
            let (f, _) = fenced_consumer(o, pg, o.jobs, &counting).await?;
            fenced = best(fenced, f);
        }
        plain_single = best(plain_single, plain_consumer(o, pg, o.jobs, false).await?);
        plain = best(plain, plain_consumer(o, pg, o.jobs, true).await?);
        if round % 2 == 0 {
            let (f, _) = fenced_consumer(o, pg, o.jobs, &counting).await?;
            fenced = best(fenced, f);
            per_job = counting.total() as f64 / o.jobs as f64;
            breakdown = counting.snapshot();
            described = counting.describe();
        }
    }
    let (Some(plain_single), Some(plain), Some(fenced)) = (plain_single, plain, fenced) else {
        return Err("no rounds".into());
    };
    line(&format!("throughput, best of {} rounds", o.rounds), "");
    line("plain queue, one UPDATE per job (reference)", plain_single);
    line("plain queue, grouped commits (the baseline)", plain);
    line("fenced consumer runtime (Consumer + TableQueue)", fenced);
    line("  ratio fenced / plain baseline", format!("{:.2}", fenced.per_sec() / plain.per_sec()));
    line("  statements per job (fenced)", format!("{per_job:.3}: {described}"));
    let commits =
        breakdown.get("complete_batch").copied().unwrap_or(0) + breakdown.get("complete").copied().unwrap_or(0);
    line("  jobs per commit statement", format!("{:.1}", o.jobs as f64 / commits.max(1) as f64));

    own_commit(o, pg, &counting).await?;

    // Added latency, one job at a time.
    let n = if o.quick { 300 } else { 2000 };
    let (f, p) = latency(pg, n).await?;
    let (f50, f99, p50, p99) = (percentile(&f, 0.5), percentile(&f, 0.99), percentile(&p, 0.5), percentile(&p, 0.99));
    line(&format!("latency per job, sequential ({n} jobs): plain p50 / p99"), format!("{} / {}", ms(p50), ms(p99)));
    line("  fenced (claim_next + supervisor + fenced commit) p50 / p99", format!("{} / {}", ms(f50), ms(f99)));
    line(
        "  added by the fence p50 / p99",
        format!("{} / {}", ms(f50.saturating_sub(p50)), ms(f99.saturating_sub(p99))),
    );

    // Cancellation after a lease loss.
    let samples = if o.quick { 5 } else { 12 };
    let q = QueueName::new("cancel").map_err(|e| e.to_string())?;
    pg.enqueue(&q, samples).await?;
    let store: Arc<dyn FenceStore> = Arc::new(pg.fence.clone());
    let lat = consumer_cancellation(TableQueue::new(store, q), &pg.fence, samples).await?;
    print_cancellation(&lat);

    // Heartbeats: one statement per worker per tick, whatever is in flight.
    for (k, ticks, statements, renewals) in heartbeat_cost(&pg.fence, &[1, 10, 100, 1000]).await? {
        line(
            &format!("heartbeat with {k:>4} jobs in flight on one worker"),
            format!(
                "{statements} statements in {ticks} ticks = {:.2} per tick, {renewals} leases renewed",
                statements as f64 / ticks.max(1) as f64
            ),
        );
    }

    // Memory over a long run of the fenced consumer runtime.
    let (long, [start, mid, end]) = fenced_consumer(o, pg, o.memory_jobs, &counting).await?;
    line(&format!("{}-job run of the fenced consumer runtime", o.memory_jobs), long);
    line(
        "  RSS start / middle / end (peak)",
        format!("{} / {} / {} MiB ({} MiB)", start.0 / 1024, mid.0 / 1024, end.0 / 1024, end.1 / 1024),
    );
    Ok(())
}
