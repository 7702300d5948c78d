//! `bench --processes P [--levels 128]`: the comparison of `bench --defaults` with the total
//! concurrency split across worker processes (issue #33). Per level L and per round: one drain
//! by 1 process × L and one by P processes × L/P, each fenced (the table queue at its defaults,
//! concurrency L/P per process) and plain (the pipelined loop of `bench/pipelined.rs`), the same
//! `--jobs` enqueued first, fenced and plain in alternating order.
//!
//! The workers are this executable run again with the hidden `--worker fenced|plain` (with
//! `--worker-schema`, `--worker-queue`, `--concurrency`, `--work-ms`, `--database-url`). A worker
//! connects, prints `ready`, starts at the line `go` on its stdin, prints `done N` (its jobs
//! done so far) as the count moves, and stops when its stdin closes, printing `exit statements=S
//! cpu_ticks=T` (its statements and its CPU since `go`). The parent starts them all, sends `go`
//! to each and measures from there until the workers' counts add up to the jobs: the wall time,
//! PostgreSQL's CPU (`/proc`) and the WAL written. Then it closes the stdins. A worker whose
//! parent dies sees its stdin close and stops; a parent that fails kills its workers (the
//! children are killed when dropped).

use super::*;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

/// What one drain cost, across its worker processes.
#[derive(Debug, Clone, Copy)]
struct Drain {
    rate: f64,
    /// PostgreSQL CPU per job, microseconds.
    cpu_us: f64,
    /// The workers' CPU per job, microseconds.
    workers_us: f64,
    /// WAL per job, bytes.
    wal: f64,
    /// 2 × jobs over the statements the workers sent.
    per_statement: f64,
}

/// A line of a worker, as its parent reads it.
#[derive(Debug)]
enum Said {
    /// Connected; waiting for `go`.
    Ready,
    /// Its jobs done so far.
    Done(u64),
    /// Stopped: its statements and CPU ticks since `go`.
    Exit { statements: u64, cpu_ticks: u64 },
    /// Its stdout closed.
    Closed,
}

/// A worker's line, if it is one of the four.
fn parse_line(line: &str) -> Option<Said> {
    let mut words = line.split_whitespace();
    match words.next()? {
        "ready" => Some(Said::Ready),
        "done" => words.next()?.parse().ok().map(Said::Done),
        "exit" => {
            let mut field = |name: &str| words.next()?.strip_prefix(name)?.parse().ok();
            let statements = field("statements=")?;
            let cpu_ticks = field("cpu_ticks=")?;
            Some(Said::Exit { statements, cpu_ticks })
        }
        _ => None,
    }
}

/// Where the workers find their queue.
struct Target<'a> {
    /// The database URL.
    url: &'a str,
    /// The schema of both queues (validated).
    schema: &'a str,
    /// Each job's work.
    work: Duration,
}

/// The next line of a worker, within `within`.
async fn next(rx: &mut mpsc::UnboundedReceiver<(usize, Said)>, within: Duration) -> Result<(usize, Said), String> {
    match tokio::time::timeout(within, rx.recv()).await {
        Ok(Some(said)) => Ok(said),
        Ok(None) => Err("the workers' lines ended".to_owned()),
        Err(_) => Err(format!("no word from the workers within {within:?}")),
    }
}

/// One drain of `queue` by `procs` worker processes of `mode` × `concurrency`.
async fn drain(
    pool: &sqlx::PgPool,
    t: &Target<'_>,
    mode: &str,
    queue: &str,
    (procs, concurrency): (usize, usize),
    jobs: usize,
) -> Result<Drain, String> {
    let exe = std::env::current_exe().map_err(|e| format!("this executable: {e}"))?;
    let (tx, mut rx) = mpsc::unbounded_channel::<(usize, Said)>();
    let (mut children, mut stdins) = (Vec::new(), Vec::new());
    for i in 0..procs {
        let mut child = tokio::process::Command::new(&exe)
            .args(["--worker", mode, "--worker-schema", t.schema, "--worker-queue", queue, "--database-url", t.url])
            .args(["--concurrency", &concurrency.to_string(), "--work-ms", &t.work.as_millis().to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("starting a worker: {e}"))?;
        let stdout = child.stdout.take().ok_or("a worker without stdout")?;
        stdins.push(child.stdin.take().ok_or("a worker without stdin")?);
        children.push(child);
        let tx = tx.clone();
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if let Some(said) = parse_line(&line) {
                    let _ = tx.send((i, said));
                }
            }
            let _ = tx.send((i, Said::Closed));
        });
    }
    let mut ready = 0;
    while ready < procs {
        match next(&mut rx, Duration::from_secs(60)).await? {
            (_, Said::Ready) => ready += 1,
            (i, said) => return Err(format!("worker {i} said {said:?} before it was ready")),
        }
    }
    let (wal0, cpu0, started) = (wal_lsn(pool).await?, CpuSample::now(), Instant::now());
    for stdin in &mut stdins {
        stdin.write_all(b"go\n").await.map_err(|e| format!("telling a worker to go: {e}"))?;
        stdin.flush().await.map_err(|e| e.to_string())?;
    }
    let mut counts = vec![0u64; procs];
    while counts.iter().sum::<u64>() < jobs as u64 {
        match next(&mut rx, Duration::from_secs(600)).await? {
            (i, Said::Done(n)) => counts[i] = n,
            (i, said) => return Err(format!("worker {i} said {said:?} before the jobs were done")),
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let cpu1 = CpuSample::now();
    let wal = wal_bytes(pool, &wal0, &wal_lsn(pool).await?).await?;
    drop(stdins);
    let (mut statements, mut ticks, mut exited) = (0u64, 0u64, vec![false; procs]);
    while !exited.iter().all(|e| *e) {
        match next(&mut rx, Duration::from_secs(60)).await? {
            (i, Said::Exit { statements: s, cpu_ticks: c }) => {
                statements += s;
                ticks += c;
                exited[i] = true;
            }
            (i, Said::Closed) if !exited[i] => return Err(format!("worker {i} stopped without its exit line")),
            _ => {}
        }
    }
    for child in &mut children {
        let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
            .await
            .map_err(|_| "a worker did not exit".to_owned())?
            .map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("a worker exited with {status}"));
        }
    }
    let n = jobs as f64;
    let us = |ticks: u64| ticks as f64 * 1e6 / ticks_per_sec() / n;
    Ok(Drain {
        rate: n / secs.max(1e-9),
        cpu_us: us(cpu1.postgres.saturating_sub(cpu0.postgres)),
        workers_us: us(ticks),
        wal: wal / n,
        per_statement: 2.0 * n / statements.max(1) as f64,
    })
}

/// The comparison, printed as a table: per level, 1 × L and P × L/P.
pub async fn run(o: &Opts, url: &str, levels: &[usize], procs: usize) -> Result<(), String> {
    if let Some(l) = levels.iter().find(|l| **l % procs != 0 || **l == 0) {
        return Err(format!("--levels: {l} does not split into {procs} processes"));
    }
    let schema = SchemaName::new(format!("bench_{:08x}", rand::random::<u32>())).map_err(|e| e.to_string())?;
    let store = PgFence::connect(url).await.map_err(|e| e.to_string())?.schema(schema);
    store.migrate().await.map_err(|e| e.to_string())?;
    let s = store.get_schema().as_str().to_owned();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .map_err(|e| e.to_string())?;
    let result = async {
        pipelined::create_table(&pool, &s).await?;
        println!(
            "\n[processes] table queue at its defaults vs the plain SKIP LOCKED loop that pipelines (claims ahead, \
             grouped finishes), one process against {procs} worker processes: {} jobs per drain, {} of work each, \
             {} paired rounds (order alternating), tables never analyzed; the wall time runs from `go` to the \
             workers' last job done",
            o.jobs,
            ms(o.work),
            o.rounds,
        );
        println!(
            "  {:>8} | {:>14} | {:>14} | {:>13} | {:>17} | {:>17} | {:>19} | {:>17}",
            "split",
            "fenced jobs/s",
            "plain jobs/s",
            "fenced/plain",
            "PG CPU/job f / p",
            "WAL/job f / p",
            "worker CPU/job f / p",
            "jobs/statement f / p"
        );
        let target = Target { url, schema: &s, work: o.work };
        for &total in levels {
            let splits = [(1, total), (procs, total / procs)];
            let mut figures: Vec<(Vec<Drain>, Vec<Drain>, Vec<f64>)> = vec![Default::default(); splits.len()];
            for round in 0..o.rounds {
                for (k, &split) in splits.iter().enumerate() {
                    let name = format!("{}x{}-{round}", split.0, split.1);
                    let fq = QueueName::new(format!("fenced-{name}")).map_err(|e| e.to_string())?;
                    let pq = format!("plain-{name}");
                    pipelined::fill_fenced(&store, &fq, o.jobs).await?;
                    pipelined::fill_plain(&pool, &s, &pq, o.jobs).await?;
                    let fenced_first = (round + k) % 2 == 0;
                    let (mut fd, mut pd) = (None, None);
                    for turn in 0..2 {
                        if (turn == 0) == fenced_first {
                            fd = Some(drain(&pool, &target, "fenced", fq.as_str(), split, o.jobs).await?);
                        } else {
                            pd = Some(drain(&pool, &target, "plain", &pq, split, o.jobs).await?);
                        }
                    }
                    let (fd, pd) = (fd.ok_or("no fenced drain")?, pd.ok_or("no plain drain")?);
                    figures[k].2.push(fd.rate / pd.rate);
                    figures[k].0.push(fd);
                    figures[k].1.push(pd);
                }
            }
            for ((n, c), (f, p, ratios)) in splits.iter().zip(figures) {
                let m = |v: &[Drain], g: fn(&Drain) -> f64| median(v.iter().map(g).collect());
                println!(
                    "  {:>8} | {:>14.0} | {:>14.0} | {:>13.2} | {:>7.1} / {:>4.1} µs | {:>7.0} / {:>4.0} B | {:>9.0} / {:>4.0} µs | {:>9.1} / {:>5.1}",
                    format!("{n}×{c}"),
                    m(&f, |d| d.rate),
                    m(&p, |d| d.rate),
                    median(ratios),
                    m(&f, |d| d.cpu_us),
                    m(&p, |d| d.cpu_us),
                    m(&f, |d| d.wal),
                    m(&p, |d| d.wal),
                    m(&f, |d| d.workers_us),
                    m(&p, |d| d.workers_us),
                    m(&f, |d| d.per_statement),
                    m(&p, |d| d.per_statement),
                );
            }
        }
        Ok::<(), String>(())
    }
    .await;
    let _ = sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {s} CASCADE"))).execute(&pool).await;
    result
}

/// What a worker process is given (the hidden `--worker` flags).
#[derive(Debug, Clone)]
pub struct Worker {
    /// `fenced` or `plain`.
    pub mode: String,
    /// The schema of the queue (a `SchemaName`).
    pub schema: String,
    /// The queue to drain.
    pub queue: String,
    /// Jobs at once in this process.
    pub concurrency: usize,
    /// Each job's work.
    pub work: Duration,
}

/// Writes one line to the parent (a parent gone is noticed on stdin).
fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// A worker process: connects, says `ready`, runs from `go` on stdin until stdin closes.
pub async fn worker(url: &str, w: &Worker) -> Result<(), String> {
    let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
    let stop = CancellationToken::new();
    {
        let stop = stop.clone();
        // A thread, not a task: a blocked read of stdin must not hold up the runtime's end.
        std::thread::spawn(move || {
            let mut lines = std::io::stdin().lines();
            if matches!(lines.next(), Some(Ok(l)) if l.trim() == "go") {
                let _ = go_tx.send(());
                while let Some(Ok(_)) = lines.next() {}
            }
            stop.cancel();
        });
    }
    let own_ticks = || std::fs::read_to_string("/proc/self/stat").ok().and_then(|t| process_ticks(&t)).unwrap_or(0);
    match w.mode.as_str() {
        "fenced" => {
            let schema = SchemaName::new(w.schema.clone()).map_err(|e| e.to_string())?;
            let q = QueueName::new(w.queue.clone()).map_err(|e| e.to_string())?;
            let store = Arc::new(PgFence::connect(url).await.map_err(|e| e.to_string())?.schema(schema));
            let counting = Counting::new(store);
            let shared: Arc<dyn FenceStore> = counting.clone();
            let lease = LeaseDuration::from_secs(30).map_err(|e| e.to_string())?;
            let config = ConsumerConfig::new(SupervisorConfig::new(lease)).concurrency(w.concurrency);
            let consumer = Consumer::new(TableQueue::new(Arc::clone(&shared), q), shared, config);
            let metrics = consumer.metrics();
            say("ready");
            if go_rx.await.is_err() {
                return Ok(());
            }
            let ticks0 = own_ticks();
            let work = w.work;
            let run = tokio::spawn(async move {
                let handler = move |_ctx: JobContext| async move {
                    tokio::time::sleep(work).await;
                    Ok::<_, JobError>(b"ok".to_vec())
                };
                consumer.run(handler, stop).await.map_err(|e| e.to_string())
            });
            report_progress(run, || metrics.snapshot().completions).await?;
            say(&format!("exit statements={} cpu_ticks={}", counting.total(), own_ticks().saturating_sub(ticks0)));
        }
        "plain" => {
            SchemaName::new(w.schema.clone()).map_err(|e| e.to_string())?;
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(16)
                .acquire_timeout(Duration::from_secs(10))
                .connect(url)
                .await
                .map_err(|e| e.to_string())?;
            let looped = pipelined::PlainLoop::new(pool, &w.schema, &w.queue, w.concurrency, w.work);
            let done = Arc::new(AtomicU64::new(0));
            say("ready");
            if go_rx.await.is_err() {
                return Ok(());
            }
            let ticks0 = own_ticks();
            let run = tokio::spawn({
                let done = Arc::clone(&done);
                async move { looped.run(stop, done).await }
            });
            let statements = report_progress(run, || done.load(Ordering::Relaxed)).await?;
            say(&format!("exit statements={statements} cpu_ticks={}", own_ticks().saturating_sub(ticks0)));
        }
        other => return Err(format!("--worker {other}: fenced or plain")),
    }
    Ok(())
}

/// Awaits `run`, saying `done N` every 2 ms while the count moves (and once more at the end).
async fn report_progress<T>(
    mut run: tokio::task::JoinHandle<Result<T, String>>,
    count: impl Fn() -> u64,
) -> Result<T, String> {
    let mut last = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(2));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            out = &mut run => {
                say(&format!("done {}", count()));
                return out.map_err(|e| e.to_string())?;
            }
            _ = tick.tick() => {
                let n = count();
                if n != last {
                    say(&format!("done {n}"));
                    last = n;
                }
            }
        }
    }
}
