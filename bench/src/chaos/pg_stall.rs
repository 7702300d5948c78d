//! PostgreSQL stalls of one worker, on the shared local server (in a `pg-failover` run: on the
//! private server that is the primary now, which the runner reaches through the VIP), touching
//! only this run's rows and this run's backends:
//!
//! - `pg-lock`: a transaction of the runner takes `FOR UPDATE` locks on the rows one worker is
//!   running (its owner id, this run's schema), holds them for longer than the lease, and rolls
//!   back. The worker's heartbeats and commits of those rows wait on the locks.
//! - `pg-pause`: the worker's PostgreSQL backends (found in `pg_stat_activity` by the
//!   `application_name` the run gave that worker) are SIGSTOPped for longer than the lease and
//!   then SIGCONTed (behind PgBouncer, which lends its server connections to every worker in
//!   turn, the idle backends of every worker: `chaos-RUN-w%`). Only backends that are `idle` (waiting for their client, holding no lock)
//!   are paused, and a backend found active right after the stop is resumed at once, so a paused
//!   backend never holds a lock or a buffer another session of the shared server needs. Each
//!   pause also starts a detached `sh -c "sleep …; kill -CONT …"` watchdog, so a runner that dies
//!   mid-pause still leaves no backend stopped.

use std::collections::BTreeSet;
use std::time::Duration;

use sqlx::{AssertSqlSafe, PgPool};

use super::faults::{FaultKind, FaultLog, Target};

/// Which rows to lock, and whom the lock stalls.
pub struct LockTarget<'a> {
    /// The run's schema.
    pub schema: &'a str,
    /// The run's queue.
    pub queue: &'a str,
    /// How the victim's owner ids begin.
    pub owner_prefix: &'a str,
    /// The victim's index.
    pub victim: usize,
    /// `application_name` of the workers without their index (`chaos-RUN-w`).
    pub app_prefix: &'a str,
}

/// Locks the rows of this queue that the victim is running under a live lease, in a transaction
/// of its own, and keeps them locked for `hold` in a background task that then rolls back and
/// closes fault `id` in `log`. Returns how many rows were locked (0: nothing was held, and the
/// fault is closed at once).
///
/// While it holds them, the task looks every 150 ms for statements of other workers that wait
/// on this lock (`pg_blocking_pids`: a claim of a locked job whose lease ran out meanwhile) and
/// records a `pg-lock` fault on each such worker too, from when it was seen until the lock goes:
/// the database was stalled for that worker as well.
pub async fn lock_rows(
    pool: &PgPool,
    target: LockTarget<'_>,
    hold: Duration,
    log: FaultLog,
    id: usize,
) -> Result<usize, String> {
    let LockTarget { schema, queue, owner_prefix, victim, app_prefix } = target;
    let err = |e: sqlx::Error| format!("pg-lock: {e}");
    let mut tx = pool.begin().await.map_err(err)?;
    // Never wait long for a row another statement is changing right now (SKIP LOCKED below), and
    // never outlive the hold by much even if this runner hangs.
    sqlx::query("SET LOCAL lock_timeout = '2s'").execute(&mut *tx).await.map_err(err)?;
    let idle_limit = format!("SET LOCAL idle_in_transaction_session_timeout = '{}ms'", (hold * 2).as_millis());
    sqlx::query(AssertSqlSafe(idle_limit)).execute(&mut *tx).await.map_err(err)?;
    let lock_pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()").fetch_one(&mut *tx).await.map_err(err)?;
    let keys: Vec<String> = sqlx::query_scalar(AssertSqlSafe(format!(
        "SELECT key FROM {schema}.jobs WHERE queue = $1 AND state = 'running' AND owner LIKE $2 \
         AND lease_until > clock_timestamp() ORDER BY key FOR UPDATE SKIP LOCKED"
    )))
    .bind(queue.to_owned())
    .bind(format!("{owner_prefix}%"))
    .fetch_all(&mut *tx)
    .await
    .map_err(err)?;
    if keys.is_empty() {
        let _ = tx.rollback().await;
        log.close(id);
        return Ok(0);
    }
    log.annotate(id, &format!(" {} rows locked ({})", keys.len(), keys.join(" ")));
    let (pool, app_prefix) = (pool.clone(), app_prefix.to_owned());
    tokio::spawn(async move {
        let until = tokio::time::Instant::now() + hold;
        let mut blocked: Vec<(usize, usize)> = Vec::new();
        loop {
            let now = tokio::time::Instant::now();
            if now >= until {
                break;
            }
            tokio::time::sleep((until - now).min(Duration::from_millis(150))).await;
            let waiting: Vec<Option<String>> = sqlx::query_scalar(
                "SELECT DISTINCT application_name FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
            )
            .bind(lock_pid)
            .fetch_all(&pool)
            .await
            .unwrap_or_default();
            for app in waiting.into_iter().flatten() {
                let Some(w) = app.strip_prefix(&app_prefix).and_then(|n| n.parse::<usize>().ok()) else { continue };
                if w != victim && !blocked.iter().any(|(b, _)| *b == w) {
                    let detail = format!("a statement of worker {w} waited on the rows locked for worker {victim}");
                    blocked.push((w, log.open(FaultKind::PgLock, Target::Worker(w), detail)));
                }
            }
        }
        let _ = tx.rollback().await;
        for (_, b) in blocked {
            log.close(b);
        }
        log.close(id);
    });
    Ok(keys.len())
}

/// Backends SIGSTOPped by this run; SIGCONT on drop, whatever happens.
struct Paused(BTreeSet<i32>);

impl Drop for Paused {
    fn drop(&mut self) {
        for &pid in &self.0 {
            signal(pid, libc::SIGCONT);
        }
    }
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a PostgreSQL backend pid read from pg_stat_activity; touches no memory.
    unsafe {
        libc::kill(pid, sig);
    }
}

/// Idle backends whose `application_name` is `LIKE application_name` (a worker's name, or
/// `chaos-RUN-w%` for all of them).
async fn idle_backends(pool: &PgPool, application_name: &str) -> Result<Vec<i32>, String> {
    sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE $1 AND datname = current_database() \
         AND state = 'idle' AND pid <> pg_backend_pid()",
    )
    .bind(application_name.to_owned())
    .fetch_all(pool)
    .await
    .map_err(|e| format!("pg-pause: pg_stat_activity: {e}"))
}

async fn state_of(pool: &PgPool, pid: i32) -> Option<String> {
    sqlx::query_scalar("SELECT state FROM pg_stat_activity WHERE pid = $1")
        .bind(pid)
        .fetch_optional(pool)
        .await
        .ok()
        .flatten()
        .flatten()
}

/// Starts pausing the idle backends of `application_name` (a `LIKE` pattern) for `hold` (new idle backends of it
/// that appear meanwhile are paused too, until the end), in a background task that resumes them
/// all and closes fault `id`. Returns once the first round is paused, with its count.
pub async fn pause_backends(
    pool: PgPool,
    application_name: String,
    hold: Duration,
    log: FaultLog,
    id: usize,
) -> Result<usize, String> {
    let until = tokio::time::Instant::now() + hold;
    let mut paused = Paused(BTreeSet::new());
    let first = pause_round(&pool, &application_name, &mut paused, hold).await?;
    if first == 0 {
        log.annotate(id, " no idle backend to pause");
        log.close(id);
        return Ok(0);
    }
    tokio::spawn(async move {
        let mut total = paused.0.len();
        while tokio::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(100).min(until - tokio::time::Instant::now())).await;
            if tokio::time::Instant::now() >= until {
                break;
            }
            let left = until - tokio::time::Instant::now();
            if let Ok(n) = pause_round(&pool, &application_name, &mut paused, left).await {
                total += n;
            }
        }
        drop(paused);
        log.annotate(id, &format!(" ({total} backends paused in all)"));
        log.close(id);
    });
    Ok(first)
}

/// One round: SIGSTOP every idle backend not yet paused; resume at once any that turns out not
/// idle. Returns how many it left paused.
async fn pause_round(
    pool: &PgPool,
    application_name: &str,
    paused: &mut Paused,
    left: Duration,
) -> Result<usize, String> {
    let mut n = 0;
    for pid in idle_backends(pool, application_name).await? {
        if paused.0.contains(&pid) {
            continue;
        }
        signal(pid, libc::SIGSTOP);
        if state_of(pool, pid).await.as_deref() != Some("idle") {
            signal(pid, libc::SIGCONT);
            continue;
        }
        paused.0.insert(pid);
        watchdog(pid, left + Duration::from_secs(2));
        n += 1;
    }
    Ok(n)
}

/// A detached shell that SIGCONTs `pid` after `after`, even if this process is gone by then.
fn watchdog(pid: i32, after: Duration) {
    let script = format!("sleep {:.1}; kill -CONT {pid} 2>/dev/null", after.as_secs_f64());
    if let Ok(mut child) = tokio::process::Command::new("sh")
        .args(["-c", &script])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
    {
        tokio::spawn(async move {
            let _ = child.wait().await;
        });
    }
}
