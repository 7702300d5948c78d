//! Readings of the machine the harness shares with its services: CPU time of PostgreSQL,
//! LocalStack and this process (Linux `/proc`), and PostgreSQL's WAL position, so that a figure
//! per job says where the CPU and the writes went.

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`), the unit of `/proc` CPU times.
pub fn ticks_per_sec() -> f64 {
    // SAFETY: sysconf reads a constant of the system; no memory is touched.
    let n = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if n > 0 { n as f64 } else { 100.0 }
}

pub async fn wal_lsn(pool: &sqlx::PgPool) -> Result<String, String> {
    sqlx::query_scalar::<_, String>("SELECT pg_current_wal_lsn()::text")
        .fetch_one(pool)
        .await
        .map_err(|e| e.to_string())
}

pub async fn wal_bytes(pool: &sqlx::PgPool, from: &str, to: &str) -> Result<f64, String> {
    sqlx::query_scalar::<_, f64>("SELECT pg_wal_lsn_diff($2::pg_lsn, $1::pg_lsn)::float8")
        .bind(from)
        .bind(to)
        .fetch_one(pool)
        .await
        .map_err(|e| e.to_string())
}

/// CPU time (clock ticks) spent so far, by the processes that share this machine's cores in the
/// benchmark: LocalStack (the broker), PostgreSQL (every backend, the WAL writer, ...) and this
/// benchmark (both consumers), plus the machine's busy and total ticks (Linux `/proc`). The
/// difference of two samples says where one phase's CPU went.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuSample {
    pub localstack: u64,
    pub postgres: u64,
    pub consumer: u64,
    pub busy: u64,
    pub total: u64,
}

/// utime + stime of one `/proc/<pid>/stat` (fields 14 and 15, after the parenthesised name).
pub fn process_ticks(stat: &str) -> Option<u64> {
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

impl CpuSample {
    pub fn now() -> Self {
        let mut s = CpuSample::default();
        if let Ok(stat) = std::fs::read_to_string("/proc/stat")
            && let Some(line) = stat.lines().next()
        {
            let v: Vec<u64> = line.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
            s.total = v.iter().sum();
            s.busy = s.total - v.get(3).copied().unwrap_or(0) - v.get(4).copied().unwrap_or(0);
        }
        s.consumer = std::fs::read_to_string("/proc/self/stat").ok().and_then(|t| process_ticks(&t)).unwrap_or(0);
        let Ok(dir) = std::fs::read_dir("/proc") else { return s };
        for entry in dir.flatten() {
            if !entry.file_name().to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
            let slot = if comm.trim() == "postgres" {
                &mut s.postgres
            } else if is_localstack(&entry.path()) {
                &mut s.localstack
            } else {
                continue;
            };
            *slot +=
                std::fs::read_to_string(entry.path().join("stat")).ok().and_then(|t| process_ticks(&t)).unwrap_or(0);
        }
        s
    }

    /// Where the CPU went from `start` to `end`, per message: microseconds of LocalStack,
    /// PostgreSQL and this process, and how busy the machine was (percent of all cores).
    pub fn per_message(start: CpuSample, end: CpuSample, messages: usize) -> String {
        let hz = ticks_per_sec();
        let us = |a: u64, b: u64| b.saturating_sub(a) as f64 * 1e6 / hz / messages.max(1) as f64;
        let busy = (end.busy.saturating_sub(start.busy)) as f64 * 100.0
            / (end.total.saturating_sub(start.total)).max(1) as f64;
        format!(
            "CPU µs/msg: LocalStack {:.0}, PostgreSQL {:.0}, consumer {:.0}; machine {busy:.0}% busy",
            us(start.localstack, end.localstack),
            us(start.postgres, end.postgres),
            us(start.consumer, end.consumer),
        )
    }
}

/// Whether `/proc/<pid>` is the LocalStack process (`python -m localstack.runtime.main`, as
/// `localstack/up` starts it): not merely a command line that names the `localstack/` folder.
pub fn is_localstack(proc_dir: &std::path::Path) -> bool {
    const MAIN: &[u8] = b"localstack.runtime.main";
    std::fs::read(proc_dir.join("cmdline")).is_ok_and(|c| c.windows(MAIN.len()).any(|w| w == MAIN))
}

/// The CPUs the local LocalStack process may run on (its `Cpus_allowed_list`), if there is one.
pub fn localstack_cpus() -> Option<String> {
    std::fs::read_dir("/proc").ok()?.flatten().find(|entry| is_localstack(&entry.path())).and_then(|entry| {
        let status = std::fs::read_to_string(entry.path().join("status")).ok()?;
        status.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).map(|v| v.trim().to_owned())
    })
}
