//! The run: set up, start the fleet, inject faults until every job is finished or the deadline
//! passes, then count.

use super::*;

/// How long the runner's store may fail (while the database fails over and its pool reconnects)
/// before the run gives up.
const STORE_PATIENCE: Duration = Duration::from_secs(60);

/// Runs one chaos instance and returns what it found (it does not judge: see
/// [`Report::violations`]).
pub async fn run(c: ChaosConfig) -> Result<Report, String> {
    let started = Instant::now();
    let t0_ms = now_ms();
    let run_id = format!("{:08x}", rand::random::<u32>());
    let schema = SchemaName::new(format!("chaos_{run_id}")).map_err(|e| e.to_string())?;
    let runner_app = format!("chaos-{run_id}-runner");
    // pg-failover (table queue only): the jobs live on a private primary with a standby, which
    // the runner reaches through the VIP and the workers through PgBouncer (see failover.rs).
    let topology = if c.injects(FaultKind::PgFailover) && c.source == SourceKind::Table {
        Some(failover::Topology::start(c.failover_sync).await?)
    } else {
        None
    };
    let jobs_url = topology.as_ref().map_or_else(|| c.database_url.clone(), |t| t.vip_url());
    let options: sqlx::postgres::PgConnectOptions =
        jobs_url.parse().map_err(|e: sqlx::Error| format!("DATABASE_URL: {e}"))?;
    let store = PgFence::connect_with(options.application_name(&runner_app))
        .await
        .map_err(|e| format!("connect to PostgreSQL (run `bash localstack/up`): {e}"))?
        .schema(schema.clone());
    store.migrate().await.map_err(|e| format!("migrate: {e}"))?;
    // The audit trigger lives with the jobs: in a failover run it counts the commits that
    // survived on the promoted standby.
    install_audit(&store).await?;
    // The receiver's ledger must outlive a failover: on the shared server, in a schema of its own.
    let ledger_store = match &topology {
        None => store.clone(),
        Some(_) => {
            let options: sqlx::postgres::PgConnectOptions =
                c.database_url.parse().map_err(|e: sqlx::Error| format!("DATABASE_URL: {e}"))?;
            let rx_schema = SchemaName::new(format!("chaos_{run_id}_rx")).map_err(|e| e.to_string())?;
            let rx = PgFence::connect_with(options.application_name(&format!("chaos-{run_id}-receiver")))
                .await
                .map_err(|e| format!("connect to PostgreSQL for the receiver (run `bash localstack/up`): {e}"))?
                .schema(rx_schema);
            rx.migrate().await.map_err(|e| format!("migrate the receiver's schema: {e}"))?;
            rx
        }
    };

    let queue = QueueName::new(format!("chaos-{}-{run_id}", c.source.name())).map_err(|e| e.to_string())?;
    let jobs = job_kinds(&c);
    let mut broker = Broker::setup(&c, &store, &queue, &jobs).await?;

    // The faults that apply to this source; the others are named in the report.
    let mut kinds: Vec<FaultKind> = Vec::new();
    let mut not_applicable = Vec::new();
    for &k in &c.faults {
        match broker.not_applicable(&c, k) {
            Some(why) => not_applicable.push(why),
            // Once per run, started by the loop below in a task of its own.
            None if matches!(k, FaultKind::PgFailover | FaultKind::RedisFailover) => {}
            None => kinds.push(k),
        }
    }
    let proxy = match broker.upstream() {
        Some(upstream) if kinds.contains(&FaultKind::BrokerStall) => Some(proxy::StallProxy::start(upstream).await?),
        _ => None,
    };
    let proxy_addr = proxy.as_ref().map(|p| p.addr());

    let receiver = Arc::new(Receiver::new(PgLedger::new(&ledger_store, "chaos-receiver")));
    let (receiver_url, receiver_task) = start_receiver(Arc::clone(&receiver)).await?;

    let log_dir = std::env::temp_dir().join("brokerfence-chaos").join(&run_id);
    std::fs::create_dir_all(&log_dir).map_err(|e| format!("create {}: {e}", log_dir.display()))?;
    let mut base_args: Vec<String> = vec![
        "--source".into(),
        c.source.name().into(),
        "--db".into(),
        topology.as_ref().map_or_else(|| c.database_url.clone(), |t| t.bouncer_url()),
        "--app".into(),
        format!("chaos-{run_id}-w"),
        "--schema".into(),
        schema.as_str().into(),
        "--queue".into(),
        queue.as_str().into(),
        "--receiver".into(),
        receiver_url,
        "--lease-secs".into(),
        c.lease_secs.to_string(),
        "--concurrency".into(),
        c.concurrency.to_string(),
        "--batch".into(),
        c.batch.to_string(),
        "--work-ms".into(),
        c.work.as_millis().to_string(),
        "--slow-ms".into(),
        c.slow_work().as_millis().to_string(),
    ];
    base_args.extend(broker.worker_args(proxy_addr));
    if !c.worker_guards.is_empty() {
        base_args.extend(["--guards".to_owned(), c.worker_guards.join(",")]);
    }
    let mut fleet = Fleet {
        launcher: c.launcher.clone(),
        base_args,
        env: broker.worker_env(proxy_addr),
        log_dir: log_dir.clone(),
        workers: Vec::new(),
        states: (0..c.workers).map(|_| Arc::new(WorkerState::default())).collect(),
    };
    let say = |msg: String| {
        if c.verbose {
            eprintln!("[chaos {:>6.1}s] {msg}", started.elapsed().as_secs_f64());
        }
    };
    for na in &not_applicable {
        say(format!("not applicable: {na}"));
    }
    if let Some(p) = &proxy {
        say(format!("workers reach the broker through the stall proxy on {}", p.addr()));
    }
    if let Some(t) = &topology {
        say(format!("pg-failover topology: {}", t.describe()));
    }
    let first_start = Instant::now();
    for i in 0..c.workers {
        let w = fleet.spawn(i, 0).await?;
        fleet.workers.push(w);
    }
    say(format!("{} workers started on {} jobs ({})", c.workers, c.jobs, c.source.name()));

    let mut rng = rand::rngs::StdRng::seed_from_u64(c.seed);
    let lease = Duration::from_secs(c.lease_secs);
    let mut report = Report {
        source: c.source.name(),
        jobs: c.jobs,
        workers: c.workers,
        seed: c.seed,
        faults: c.faults.clone(),
        not_applicable,
        t0_ms,
        stall_secs: c.stall().as_secs_f64(),
        lease_secs: c.lease_secs,
        ..Default::default()
    };
    let log = FaultLog::default();
    let ctx = FaultCtx {
        c: &c,
        store: &store,
        queue: &queue,
        run_id: &run_id,
        lease,
        log: &log,
        proxy: proxy.as_ref(),
        pooled: topology.is_some(),
        runner_app: &runner_app,
    };
    // Every kind of fault early on (a second SIGSTOP at the end of the round), then at random.
    let mut schedule: Vec<FaultKind> = FaultKind::ALL.iter().copied().filter(|k| kinds.contains(k)).collect();
    if kinds.contains(&FaultKind::SigStop) {
        schedule.push(FaultKind::SigStop);
    }
    schedule.reverse();
    let mut next_fault = Instant::now() + c.fault_every / 2;
    let deadline = first_start + c.deadline;
    let mut drained_at = None;
    let mut last_progress = Instant::now();
    // The failover: once, in a task of its own; its result when it is over.
    let mut failover_due = topology.is_some();
    let mut failover_task: Option<tokio::task::JoinHandle<Result<failover::FailoverTimes, String>>> = None;
    let mut failover_times: Option<failover::FailoverTimes> = None;
    // The same for redis-failover (the Redis source on a cluster).
    let mut redis_failover_due =
        c.injects(FaultKind::RedisFailover) && broker.not_applicable(&c, FaultKind::RedisFailover).is_none();
    let mut redis_task: Option<tokio::task::JoinHandle<Result<RedisFailoverFigures, String>>> = None;
    // The runner's store loses its connections in a failover: how long it has been failing.
    let mut store_failing_since: Option<Instant> = None;
    let mut finished = 0;
    loop {
        let now = Instant::now();
        // Resume paused workers whose pause is over.
        for w in fleet.workers.iter_mut() {
            if w.stopped_until.is_some_and(|t| t <= now) {
                signal(w.pid, libc::SIGCONT);
                w.stopped_until = None;
                if let Some(id) = w.stop_record.take() {
                    log.close(id);
                }
                say(format!("SIGCONT worker {} (pid {})", w.index, w.pid));
            }
        }
        if failover_task.as_ref().is_some_and(|t| t.is_finished())
            && let Some(task) = failover_task.take()
        {
            let t = task.await.map_err(|e| format!("pg-failover task: {e}"))??;
            say(format!(
                "pg-failover done: VIP re-pointed to the promoted standby (timeline {}) {:.1} s after the cut",
                t.timeline,
                t.repointed_ms.saturating_sub(t.cut_ms) as f64 / 1000.0
            ));
            failover_times = Some(t);
            report.pg_failovers += 1;
            next_fault = Instant::now() + c.fault_every;
        }
        if redis_task.as_ref().is_some_and(|t| t.is_finished())
            && let Some(task) = redis_task.take()
        {
            let t = task.await.map_err(|e| format!("redis-failover task: {e}"))??;
            let took = t.takeover_ms.saturating_sub(t.cut_ms) as f64 / 1000.0;
            say(format!(
                "redis-failover done: {} serves the slots of {} {took:.1} s after the cut",
                t.replica, t.primary
            ));
            report.redis_failover = Some(t);
            report.redis_failovers += 1;
            next_fault = Instant::now() + c.fault_every;
        }
        let failing_over = failover_task.is_some() || redis_task.is_some();
        match count_finished(&store, &queue).await {
            Ok(n) => {
                finished = n;
                store_failing_since = None;
            }
            // While the database fails over (and a little after) the runner's store cannot
            // count; the workers go on.
            Err(e) if topology.is_some() => {
                let since = *store_failing_since.get_or_insert(now);
                if now.duration_since(since) > STORE_PATIENCE {
                    return Err(format!("{e} (for {STORE_PATIENCE:?})"));
                }
            }
            Err(e) => return Err(e),
        }
        if c.verbose && now.duration_since(last_progress) > Duration::from_secs(2) {
            last_progress = now;
            say(format!(
                "{finished}/{} finished; fenced so far {}, lease losses {}",
                c.jobs,
                fleet.metric("fenced_rejections"),
                fleet.metric("lease_losses")
            ));
        }
        // Jobs finished on a primary that is failing over may be lost with it: not drained yet.
        if finished >= c.jobs && !failing_over {
            drained_at = Some(Instant::now());
            break;
        }
        if now >= deadline {
            say("deadline reached with jobs unfinished".into());
            break;
        }
        // The failover once every other kind had its first round and about a quarter of the jobs
        // are finished; at half of them whatever the round (fast jobs drain before a round is
        // over), so that many jobs remain. Other faults wait while it is under way.
        let round_over = schedule.is_empty() && now >= next_fault;
        if let Some(t) = &topology
            && failover_due
            && ((round_over && finished >= c.jobs / 4) || finished >= c.jobs / 2)
        {
            failover_due = false;
            report.faults_injected += 1;
            say(format!(
                "pg-failover: replication cut at {finished}/{} finished; the primary alone for {:.1} s",
                c.jobs,
                c.failover_alone.as_secs_f64()
            ));
            failover_task =
                Some(failover::fail_over(Arc::clone(t), c.failover_alone, log.clone(), store.clone(), queue.clone()));
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        if redis_failover_due && ((round_over && finished >= c.jobs / 4) || finished >= c.jobs / 2) {
            redis_failover_due = false;
            report.faults_injected += 1;
            say(format!(
                "redis-failover: replication cut at {finished}/{} finished; the primary alone for {:.1} s",
                c.jobs,
                c.failover_alone.as_secs_f64()
            ));
            redis_task = broker.start_redis_failover(c.failover_alone, log.clone());
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let injected = report.faults_injected;
        if now >= next_fault && !failing_over && !kinds.is_empty() && c.max_faults.is_none_or(|m| injected < m) {
            let fault = schedule.pop().unwrap_or_else(|| {
                let mut weighted = kinds.clone();
                if kinds.contains(&FaultKind::SigStop) {
                    weighted.push(FaultKind::SigStop);
                }
                weighted[rng.random_range(0..weighted.len())]
            });
            let done = match inject(&ctx, fault, &mut fleet, &mut broker, &mut rng, &mut report, &say).await {
                Ok(done) => done,
                // Right after a failover the runner's store may still be reconnecting: later.
                Err(e) if topology.is_some() => {
                    say(format!("{}: {e}; later", fault.name()));
                    false
                }
                Err(e) => return Err(e),
            };
            if done {
                report.faults_injected += 1;
                // The first round comes at even steps, so every kind is injected early on.
                let jitter = if schedule.is_empty() { rng.random_range(0.5..1.5) } else { 1.0 };
                let mut gap = c.fault_every.mul_f64(jitter);
                if matches!(fault, FaultKind::BrokerStall | FaultKind::PgLock | FaultKind::PgPause) {
                    // One stall at a time, with a second of calm between two.
                    gap = gap.max(c.stall() + Duration::from_secs(1));
                }
                next_fault = Instant::now() + gap;
            } else {
                // Not possible right now (nothing to stall, a stall still in force): soon again.
                schedule.push(fault);
                next_fault = Instant::now() + Duration::from_millis(500);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    report.drain_secs = drained_at.unwrap_or_else(Instant::now).duration_since(first_start).as_secs_f64();
    // A failover still under way (the deadline came first) ends before the workers stop.
    if let Some(task) = failover_task.take() {
        let t = task.await.map_err(|e| format!("pg-failover task: {e}"))??;
        failover_times = Some(t);
        report.pg_failovers += 1;
    }
    if let Some(task) = redis_task.take() {
        report.redis_failover = Some(task.await.map_err(|e| format!("redis-failover task: {e}"))??);
        report.redis_failovers += 1;
    }
    // After a Redis failover the broker holds again what the old primary had settled alone
    // (deliveries it acknowledged, dead letters it copied): the jobs are done in the database,
    // and their entries come back (re-read, or auto-claimed after the lease) to be acknowledged
    // (or dead-lettered) once more. Wait for that (four leases at most).
    if let Some(fo) = report.redis_failover.as_mut() {
        let from = Instant::now();
        let until = from + lease * 4;
        let unsettled = loop {
            let left = broker.unsettled().await.ok().flatten();
            if left == Some(0) || Instant::now() >= until {
                break left;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        fo.unsettled_at_end = unsettled;
        fo.settle_secs = (unsettled == Some(0)).then(|| from.elapsed().as_secs_f64());
        say(format!("broker after the redis-failover: {unsettled:?} entries unacknowledged"));
    }
    // A broker stall still in force ends now: the workers need their broker to stop cleanly.
    if let Some(p) = &proxy {
        p.resume();
        log.cut_short(FaultKind::BrokerStall);
    }

    // Let every paused worker resume and finish its zombie attempts, let every stall end, then
    // stop the workers gracefully.
    let resume_by = fleet.workers.iter().filter_map(|w| w.stopped_until).max();
    if let Some(t) = resume_by {
        tokio::time::sleep(t.saturating_duration_since(Instant::now())).await;
    }
    for w in fleet.workers.iter_mut() {
        if w.stopped_until.take().is_some() {
            signal(w.pid, libc::SIGCONT);
        }
        if let Some(id) = w.stop_record.take() {
            log.close(id);
        }
    }
    let stalls_end = Instant::now() + c.stall() + Duration::from_secs(3);
    while log.any_open() && Instant::now() < stalls_end {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for w in &fleet.workers {
        signal(w.pid, libc::SIGTERM);
    }
    for w in fleet.workers.iter_mut() {
        match tokio::time::timeout(Duration::from_secs(15), w.child.wait()).await {
            Ok(_) => {}
            Err(_) => {
                say(format!("worker {} did not stop on SIGTERM; killing it", w.index));
                let _ = w.child.kill().await;
            }
        }
    }
    // The stdout readers deliver the final metrics lines.
    tokio::time::sleep(Duration::from_millis(200)).await;
    if let Some(p) = &proxy {
        p.resume();
    }

    // ---- checks ----
    // After a failover the runner's store may need a moment to reach the promoted standby.
    let patience = if topology.is_some() { STORE_PATIENCE } else { Duration::ZERO };
    let rows = failover::retrying(patience, || final_rows(&store, &queue)).await?;
    let commits = failover::retrying(patience, || commit_counts(&store, &queue)).await?;
    let accepted: HashMap<String, Vec<i64>> = receiver
        .log
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|(k, v)| (k.clone(), v.accepted.clone()))
        .collect();
    let poison: HashSet<String> = jobs.iter().filter(|(_, k)| *k == Kind::Poison).map(|(j, _)| j.clone()).collect();
    for (key, kind) in &jobs {
        let Some(row) = rows.get(key) else {
            report.unfinished += 1;
            continue;
        };
        report.max_epoch = report.max_epoch.max(row.epoch);
        if row.epoch > 1 {
            report.jobs_reclaimed += 1;
        }
        match row.state.as_str() {
            "completed" => {
                report.completed += 1;
                let expected = format!("{key}@{}", row.epoch);
                let reached = accepted.get(key).is_some_and(|e| e.contains(&row.epoch));
                if row.result.as_deref() != Some(expected.as_bytes()) || !reached || *kind == Kind::Poison {
                    report.effect_missing += 1;
                }
            }
            "dead" => {
                report.dead += 1;
                if *kind != Kind::Poison {
                    report.unexpected_dead += 1;
                } else if !row.last_error.as_deref().is_some_and(|e| e.contains("undecodable payload")) {
                    report.poison_not_dead_lettered += 1;
                }
            }
            _ => report.unfinished += 1,
        }
        if commits.get(key).copied().unwrap_or(0) > 1 {
            report.committed_twice += 1;
        }
    }
    report.poison_not_dead_lettered += poison.iter().filter(|k| rows.get(*k).is_none_or(|r| r.state != "dead")).count();
    report.broker_dead_letters = broker.dead_letters(&poison).await?;
    if let Some(n) = report.broker_dead_letters
        && n < poison.len()
    {
        report.poison_not_dead_lettered += poison.len() - n;
    }
    report.stale_accepts = receiver.stale_accepts.load(Ordering::Relaxed) as usize;
    report.receiver_calls = receiver.calls.load(Ordering::Relaxed);
    report.receiver_refused = receiver.refused.load(Ordering::Relaxed);
    report.receiver_conflicts = receiver.conflicts.load(Ordering::Relaxed);
    let twice = receiver.tokens_handed_out_twice();
    report.tokens_handed_out_twice = twice.len();
    report.tokens_twice_examples = twice
        .iter()
        .take(5)
        .map(|(job, epoch, owners)| {
            format!(
                "{job} epoch {epoch} (timeline {}) from {}",
                brokerfence::epoch::timeline_of(*epoch),
                owners.join(" and ")
            )
        })
        .collect();
    report.jobs_rerun_after_failover = receiver.jobs_rerun_after_failover();
    if let Some(t) = &failover_times {
        let after = |ms: u64| ms.saturating_sub(t.promoted_ms) as f64 / 1000.0;
        let first_commit = failover::retrying(patience, || failover::first_commit_since(&store, &queue, t.promoted_ms))
            .await
            .ok()
            .flatten();
        let commits_lost = match &t.commits_before_kill {
            Some(before) => {
                let now = failover::retrying(patience, || failover::commit_keys(&store, &queue)).await?;
                Some(before.difference(&now).count())
            }
            None => None,
        };
        let first_accept = receiver.first_promoted_accept_ms.load(Ordering::Relaxed);
        report.failover = Some(FailoverFigures {
            sync: c.failover_sync,
            timeline: t.timeline,
            alone_secs: t.killed_ms.saturating_sub(t.cut_ms) as f64 / 1000.0,
            promote_secs: t.promoted_ms.saturating_sub(t.killed_ms) as f64 / 1000.0,
            cut_to_repoint_secs: t.repointed_ms.saturating_sub(t.cut_ms) as f64 / 1000.0,
            promotion_to_first_commit_secs: first_commit.map(after),
            promotion_to_first_promoted_accept_secs: (first_accept > 0).then(|| after(first_accept)),
            commits_lost,
        });
    }
    report.zombie_commits_rejected = fleet.metric("fenced_rejections");
    report.lease_losses = fleet.metric("lease_losses");

    // Every lost attempt against the timeline; and the loss reports against the counters.
    report.timeline = log.snapshot();
    let mut losses: Vec<LossEvent> = Vec::new();
    for (i, state) in fleet.states.iter().enumerate() {
        let mine: Vec<LossEvent> = state.losses.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let metrics = state.metrics.lock().unwrap_or_else(|p| p.into_inner());
        for incarnation in state.stopped.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            let counted = metrics.get(incarnation).and_then(|m| m.get("lease_losses")).copied().unwrap_or(0);
            let reported = mine.iter().filter(|l| l.incarnation == *incarnation).count() as u64;
            if reported < counted {
                say(format!("worker {i} run {incarnation}: {reported} lost attempts reported, {counted} counted"));
                report.loss_reports_missing += 1;
            }
        }
        losses.extend(mine);
    }
    losses.sort_by_key(|l| l.at_ms);
    report.losses = faults::summarize(&losses, &report.timeline, lease + Duration::from_secs(1), t0_ms);
    report.total_secs = started.elapsed().as_secs_f64();

    receiver_task.abort();
    drop(proxy);
    broker.cleanup().await;
    let keep = c.keep_logs || (c.keep_on_failure && !report.violations().is_empty());
    if keep {
        report.log_dir = Some(log_dir);
        if topology.is_some() {
            say(format!(
                "kept: the receiver's ledger in schema {} of DATABASE_URL (the jobs' schema goes with the private \
                 servers)",
                ledger_store.get_schema().as_str()
            ));
        }
    } else {
        let _ = std::fs::remove_dir_all(&log_dir);
        // In a failover run the jobs' schema goes with the private servers.
        drop_schema(&ledger_store).await;
    }
    if let Some(t) = topology {
        drop(store);
        failover::Topology::teardown(t).await;
    }
    Ok(report)
}
