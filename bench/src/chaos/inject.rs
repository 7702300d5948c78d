//! Fault injection (one fault at a time, see [`super::faults`]) and the database readings the
//! run's end needs (the audit trigger, the final rows, commits per job).

use super::*;

/// What every fault injection needs of the run.
pub(crate) struct FaultCtx<'a> {
    pub(crate) c: &'a ChaosConfig,
    pub(crate) store: &'a PgFence,
    pub(crate) queue: &'a QueueName,
    pub(crate) run_id: &'a str,
    pub(crate) lease: Duration,
    pub(crate) log: &'a FaultLog,
    pub(crate) proxy: Option<&'a proxy::StallProxy>,
    /// The workers reach PostgreSQL through PgBouncer in transaction mode (a `pg-failover` run):
    /// its server connections are shared by every worker, so a fault on connections or backends
    /// hits them all.
    pub(crate) pooled: bool,
    /// The runner's own `application_name` (its connections are never cut or paused).
    pub(crate) runner_app: &'a str,
}

pub(crate) async fn inject(
    x: &FaultCtx<'_>,
    fault: FaultKind,
    fleet: &mut Fleet,
    broker: &mut Broker,
    rng: &mut rand::rngs::StdRng,
    report: &mut Report,
    say: &impl Fn(String),
) -> Result<bool, String> {
    let (c, log) = (x.c, x.log);
    let running: Vec<usize> =
        fleet.workers.iter().enumerate().filter(|(_, w)| w.stopped_until.is_none()).map(|(i, _)| i).collect();
    match fault {
        FaultKind::SigStop => {
            // Keep one worker running, so the jobs of the paused one get taken over.
            if running.len() < 2 {
                return Ok(false);
            }
            // Prefer a worker inside its blocking work: resumed there, it reaches its commit.
            let busy: Vec<usize> = running
                .iter()
                .copied()
                .filter(|&i| fleet.workers[i].state.computing.load(Ordering::Relaxed) > 0)
                .collect();
            let pool = if busy.is_empty() { &running } else { &busy };
            let i = pool[rng.random_range(0..pool.len())];
            let pause = x.lease + Duration::from_millis(rng.random_range(1200..2500));
            let w = &mut fleet.workers[i];
            signal(w.pid, libc::SIGSTOP);
            w.stopped_until = Some(Instant::now() + pause);
            w.stop_record = Some(log.open(FaultKind::SigStop, Target::Worker(w.index), format!("pid {}", w.pid)));
            report.sigstops += 1;
            say(format!("SIGSTOP worker {} (pid {}) for {:.1} s", w.index, w.pid, pause.as_secs_f64()));
        }
        FaultKind::SigKill => {
            if running.is_empty() {
                return Ok(false);
            }
            let i = running[rng.random_range(0..running.len())];
            let start = now_ms();
            let (index, incarnation, old_pid) = {
                let w = &mut fleet.workers[i];
                let _ = w.child.start_kill();
                let _ = w.child.wait().await;
                say(format!("SIGKILL worker {} (pid {})", w.index, w.pid));
                (w.index, w.incarnation + 1, w.pid)
            };
            report.sigkills += 1;
            tokio::time::sleep(Duration::from_millis(rng.random_range(100..600))).await;
            fleet.workers[i] = fleet.spawn(index, incarnation).await?;
            let new_pid = fleet.workers[i].pid;
            log.record(
                FaultKind::SigKill,
                Target::Worker(index),
                start,
                now_ms(),
                format!("pid {old_pid}, restarted as pid {new_pid}"),
            );
            say(format!("restarted worker {index} (pid {new_pid})"));
        }
        FaultKind::PgTerminate if x.pooled => {
            // PgBouncer holds the server connections and lends them to every worker in turn (it
            // sets each client's application_name on the one it lends): cut them all, i.e. every
            // client backend of this private server but the runner's.
            let start = now_ms();
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE datname = current_database() AND backend_type = 'client backend' \
                 AND application_name <> $1 AND pid <> pg_backend_pid()) t",
            )
            .bind(x.runner_app.to_owned())
            .fetch_one(x.store.pool())
            .await
            .map_err(|e| format!("pg_terminate_backend: {e}"))?;
            report.connections_terminated += u64::try_from(n).unwrap_or(0);
            log.record(
                FaultKind::PgTerminate,
                Target::All,
                start,
                now_ms(),
                format!("{n} server connections of PgBouncer cut"),
            );
            say(format!("pg_terminate_backend: {n} server connections of PgBouncer"));
        }
        FaultKind::PgTerminate => {
            let (pattern, target) = if rng.random_bool(0.5) || c.workers == 1 {
                (format!("chaos-{}-w%", x.run_id), Target::All)
            } else {
                let w = rng.random_range(0..c.workers);
                (format!("chaos-{}-w{w}", x.run_id), Target::Worker(w))
            };
            let start = now_ms();
            let n: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
                 WHERE application_name LIKE $1 AND pid <> pg_backend_pid()) t",
            )
            .bind(pattern.clone())
            .fetch_one(x.store.pool())
            .await
            .map_err(|e| format!("pg_terminate_backend: {e}"))?;
            report.connections_terminated += u64::try_from(n).unwrap_or(0);
            log.record(FaultKind::PgTerminate, target, start, now_ms(), format!("{n} connections cut"));
            say(format!("pg_terminate_backend: {n} connections of {pattern}"));
        }
        // The run starts it itself, in a task of its own (see `failover.rs`).
        FaultKind::PgFailover | FaultKind::RedisFailover => return Ok(false),
        FaultKind::RedisRestart => {
            let start = now_ms();
            broker.restart_server().await?;
            log.record(FaultKind::RedisRestart, Target::All, start, now_ms(), "private redis-server killed".into());
            report.redis_restarts += 1;
            say("redis-server restarted".into());
        }
        FaultKind::BrokerStall => {
            let Some(proxy) = x.proxy else { return Ok(false) };
            if log.open_on(0, &[FaultKind::BrokerStall]) {
                return Ok(false);
            }
            let in_flight = live_attempts(x, None).await?;
            report.stalled_attempts += in_flight;
            let d = c.stall();
            let start = now_ms();
            proxy.stall_for(d);
            let conns = proxy.stats().connections.load(Ordering::Relaxed);
            log.record(
                FaultKind::BrokerStall,
                Target::All,
                start,
                start + d.as_millis() as u64,
                format!(
                    "proxy {} held every byte of {conns} connections (and new ones); {in_flight} attempts in flight",
                    proxy.addr()
                ),
            );
            report.broker_stalls += 1;
            say(format!("broker stall for {:.1} s (proxy {})", d.as_secs_f64(), proxy.addr()));
        }
        FaultKind::PgPause if x.pooled => {
            // Behind PgBouncer an idle server backend is no one worker's: the next transaction of
            // any worker may get it. Pause every idle backend the workers used, for all of them.
            let in_flight = live_attempts(x, None).await?;
            if in_flight == 0 {
                say("pg-pause: no attempt in flight now; later".into());
                return Ok(false);
            }
            let pattern = format!("chaos-{}-w%", x.run_id);
            let what = ("PgBouncer's server backends:".to_owned(), "backends behind PgBouncer".to_owned());
            return pause(x, pattern, Target::All, what, in_flight, report, say).await;
        }
        FaultKind::PgLock | FaultKind::PgPause => {
            let Some(i) = pg_victim(x, fleet).await? else {
                say(format!("{}: no running worker holds a running row now; later", fault.name()));
                return Ok(false);
            };
            let (index, pid) = (fleet.workers[i].index, fleet.workers[i].pid);
            let in_flight = live_attempts(x, Some(&owner_prefix(index, pid))).await?;
            let d = c.stall();
            if fault == FaultKind::PgLock {
                let prefix = owner_prefix(index, pid);
                let id = log.open(FaultKind::PgLock, Target::Worker(index), format!("owner {prefix}…:"));
                let app_prefix = format!("chaos-{}-w", x.run_id);
                let target = pg_stall::LockTarget {
                    schema: x.store.get_schema().as_str(),
                    queue: x.queue.as_str(),
                    owner_prefix: &prefix,
                    victim: index,
                    app_prefix: &app_prefix,
                };
                match pg_stall::lock_rows(x.store.pool(), target, d, log.clone(), id).await {
                    Ok(n) => {
                        say(format!("pg-lock: {n} running rows of worker {index} locked for {:.1} s", d.as_secs_f64()));
                        if n == 0 {
                            return Ok(false);
                        }
                        report.pg_locks += 1;
                        report.pg_locked_rows += n as u64;
                        report.stalled_attempts += in_flight;
                    }
                    Err(e) => {
                        log.close(id);
                        say(format!("pg-lock failed: {e}"));
                        return Ok(false);
                    }
                }
            } else {
                let app = format!("chaos-{}-w{index}", x.run_id);
                let what = (format!("backends of {app}:"), format!("backends of worker {index}"));
                return pause(x, app, Target::Worker(index), what, in_flight, report, say).await;
            }
        }
    }
    Ok(true)
}

/// Rows `running` under a live lease (of owners starting with `owner_prefix`, when given).
/// `pg-pause`: SIGSTOPs the idle backends whose `application_name` is `LIKE pattern` for the
/// stall, recorded against `target`; `what` is (the fault log's opening, the progress line's
/// subject). False (try again soon) when none was paused or the pause failed.
async fn pause(
    x: &FaultCtx<'_>,
    pattern: String,
    target: Target,
    (opening, subject): (String, String),
    in_flight: u64,
    report: &mut Report,
    say: &(impl Fn(String) + ?Sized),
) -> Result<bool, String> {
    let d = x.c.stall();
    let id = x.log.open(FaultKind::PgPause, target, opening);
    match pg_stall::pause_backends(x.store.pool().clone(), pattern, d, x.log.clone(), id).await {
        Ok(n) => {
            say(format!("pg-pause: {n} {subject} SIGSTOPped for {:.1} s", d.as_secs_f64()));
            if n == 0 {
                // The task ends the (empty) pause by itself; try again soon.
                return Ok(false);
            }
            report.pg_pauses += 1;
            report.pg_paused_backends += n as u64;
            report.stalled_attempts += in_flight;
            Ok(true)
        }
        Err(e) => {
            x.log.close(id);
            say(format!("pg-pause failed: {e}"));
            Ok(false)
        }
    }
}

pub(crate) async fn live_attempts(x: &FaultCtx<'_>, owner_prefix: Option<&str>) -> Result<u64, String> {
    let s = x.store.get_schema().as_str();
    let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {s}.jobs WHERE queue = $1 AND state = 'running' \
         AND lease_until > clock_timestamp() AND owner LIKE $2"
    )))
    .bind(x.queue.as_str().to_owned())
    .bind(format!("{}%", owner_prefix.unwrap_or("")))
    .fetch_one(x.store.pool())
    .await
    .map_err(|e| format!("live attempts: {e}"))?;
    Ok(u64::try_from(n).unwrap_or(0))
}

/// How the owner ids of worker `index` (process `pid`) begin (see `Owner::unique`).
pub(crate) fn owner_prefix(index: usize, pid: i32) -> String {
    format!("w{index}-{pid}-")
}

/// The worker (not paused, not already under a PostgreSQL stall) that holds running rows under
/// a live lease and was stalled the fewest times so far (then: the most rows); `None` when none
/// holds any. Taking turns keeps one worker's long jobs from being stalled again and again.
pub(crate) async fn pg_victim(x: &FaultCtx<'_>, fleet: &Fleet) -> Result<Option<usize>, String> {
    let s = x.store.get_schema().as_str();
    let owners: Vec<(Option<String>, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT owner, count(*) FROM {s}.jobs WHERE queue = $1 AND state = 'running' \
         AND lease_until > clock_timestamp() GROUP BY owner"
    )))
    .bind(x.queue.as_str().to_owned())
    .fetch_all(x.store.pool())
    .await
    .map_err(|e| format!("running rows by owner: {e}"))?;
    let timeline = x.log.snapshot();
    let mut best: Option<(usize, (usize, i64))> = None;
    for (i, w) in fleet.workers.iter().enumerate() {
        if w.stopped_until.is_some() || x.log.open_on(w.index, &[FaultKind::PgLock, FaultKind::PgPause]) {
            continue;
        }
        let prefix = owner_prefix(w.index, w.pid);
        let n: i64 =
            owners.iter().filter(|(o, _)| o.as_deref().is_some_and(|o| o.starts_with(&prefix))).map(|(_, n)| n).sum();
        let stalled = timeline
            .iter()
            .filter(|r| matches!(r.kind, FaultKind::PgLock | FaultKind::PgPause) && r.target == Target::Worker(w.index))
            .count();
        // Fewest stalls first, then most rows.
        let rank = (usize::MAX - stalled, n);
        if n > 0 && best.is_none_or(|(_, r)| rank > r) {
            best = Some((i, rank));
        }
    }
    Ok(best.map(|(i, _)| i))
}

pub(crate) async fn install_audit(store: &PgFence) -> Result<(), String> {
    let s = store.get_schema().as_str();
    for stmt in [
        format!(
            "CREATE TABLE {s}.chaos_commits (queue text NOT NULL, key text NOT NULL, epoch bigint NOT NULL, \
             owner text, at timestamptz NOT NULL DEFAULT clock_timestamp())"
        ),
        format!(
            "CREATE FUNCTION {s}.chaos_audit() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN \
             INSERT INTO {s}.chaos_commits (queue, key, epoch, owner) VALUES (NEW.queue, NEW.key, NEW.epoch, NEW.owner); \
             RETURN NULL; END $$"
        ),
        // Every UPDATE that leaves a row completed is a commit, including a second one.
        format!(
            "CREATE TRIGGER chaos_audit AFTER UPDATE ON {s}.jobs FOR EACH ROW \
             WHEN (NEW.state = 'completed') EXECUTE FUNCTION {s}.chaos_audit()"
        ),
    ] {
        sqlx::query(AssertSqlSafe(stmt)).execute(store.pool()).await.map_err(|e| format!("audit trigger: {e}"))?;
    }
    Ok(())
}

pub(crate) async fn drop_schema(store: &PgFence) {
    let s = store.get_schema().as_str();
    let _ = sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {s} CASCADE"))).execute(store.pool()).await;
}

pub(crate) async fn count_finished(store: &PgFence, queue: &QueueName) -> Result<usize, String> {
    let s = store.get_schema().as_str();
    let n: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT count(*) FROM {s}.jobs WHERE queue = $1 AND state IN ('completed', 'dead')"
    )))
    .bind(queue.as_str().to_owned())
    .fetch_one(store.pool())
    .await
    .map_err(|e| format!("count finished: {e}"))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

pub(crate) struct Row {
    pub(crate) state: String,
    pub(crate) epoch: i64,
    pub(crate) result: Option<Vec<u8>>,
    pub(crate) last_error: Option<String>,
}

pub(crate) async fn final_rows(store: &PgFence, queue: &QueueName) -> Result<HashMap<String, Row>, String> {
    let s = store.get_schema().as_str();
    type Raw = (String, String, i64, Option<Vec<u8>>, Option<String>);
    let rows: Vec<Raw> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT key, state, epoch, result, last_error FROM {s}.jobs WHERE queue = $1"
    )))
    .bind(queue.as_str().to_owned())
    .fetch_all(store.pool())
    .await
    .map_err(|e| format!("read jobs: {e}"))?;
    Ok(rows
        .into_iter()
        .map(|(key, state, epoch, result, last_error)| (key, Row { state, epoch, result, last_error }))
        .collect())
}

pub(crate) async fn commit_counts(store: &PgFence, queue: &QueueName) -> Result<HashMap<String, i64>, String> {
    let s = store.get_schema().as_str();
    let rows: Vec<(String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT key, count(*) FROM {s}.chaos_commits WHERE queue = $1 GROUP BY key"
    )))
    .bind(queue.as_str().to_owned())
    .fetch_all(store.pool())
    .await
    .map_err(|e| format!("read audit: {e}"))?;
    Ok(rows.into_iter().collect())
}
