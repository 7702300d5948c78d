//! The worker processes, seen from the runner: start, signal, restart, and their event lines.

use super::*;

#[derive(Default)]
pub(crate) struct WorkerState {
    /// Handlers inside their blocking work right now.
    pub(crate) computing: AtomicI64,
    /// Last metrics line of each incarnation.
    pub(crate) metrics: Mutex<BTreeMap<u32, HashMap<String, u64>>>,
    /// Attempts each incarnation reported lost.
    pub(crate) losses: Mutex<Vec<LossEvent>>,
    /// Incarnations that stopped cleanly (their last metrics line is final).
    pub(crate) stopped: Mutex<HashSet<u32>>,
}

pub(crate) struct Worker {
    pub(crate) index: usize,
    pub(crate) incarnation: u32,
    pub(crate) child: tokio::process::Child,
    pub(crate) pid: i32,
    pub(crate) state: Arc<WorkerState>,
    pub(crate) stopped_until: Option<Instant>,
    /// The timeline entry of the SIGSTOP in force.
    pub(crate) stop_record: Option<usize>,
}

pub(crate) fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a pid we spawned; no memory is touched.
    unsafe {
        libc::kill(pid, sig);
    }
}

pub(crate) struct Fleet {
    pub(crate) launcher: Launcher,
    pub(crate) base_args: Vec<String>,
    pub(crate) env: Vec<(String, String)>,
    pub(crate) log_dir: PathBuf,
    pub(crate) workers: Vec<Worker>,
    pub(crate) states: Vec<Arc<WorkerState>>,
}

impl Fleet {
    pub(crate) async fn spawn(&self, index: usize, incarnation: u32) -> Result<Worker, String> {
        let mut args = self.base_args.clone();
        args.extend(["--id".into(), index.to_string()]);
        let log = self.log_dir.join(format!("worker-{index}-{incarnation}.log"));
        let stderr = std::fs::File::create(&log).map_err(|e| format!("create {}: {e}", log.display()))?;
        let mut cmd = self.launcher.command(&args);
        cmd.stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .env("RUST_LOG", std::env::var("CHAOS_WORKER_LOG").unwrap_or_else(|_| "warn".into()))
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .kill_on_drop(true);
        let mut child = cmd.spawn().map_err(|e| format!("spawn worker {index}: {e}"))?;
        let pid = child.id().and_then(|p| i32::try_from(p).ok()).ok_or("worker has no pid")?;
        let state = Arc::clone(&self.states[index]);
        state.computing.store(0, Ordering::Relaxed);
        if let Some(out) = child.stdout.take() {
            let state = Arc::clone(&state);
            tokio::spawn(async move {
                let mut lines = BufReader::new(out).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let Some(rest) = line.strip_prefix("EVENT ") else { continue };
                    let (name, fields) = rest.split_once(' ').unwrap_or((rest, ""));
                    match name {
                        "compute" => {
                            state.computing.fetch_add(1, Ordering::Relaxed);
                        }
                        "computed" => {
                            state.computing.fetch_sub(1, Ordering::Relaxed);
                        }
                        "metrics" => {
                            let parsed: HashMap<String, u64> = fields
                                .split_whitespace()
                                .filter_map(|kv| kv.split_once('='))
                                .filter_map(|(k, v)| v.parse().ok().map(|v| (k.to_owned(), v)))
                                .collect();
                            state.metrics.lock().unwrap_or_else(|p| p.into_inner()).insert(incarnation, parsed);
                        }
                        "lost" => {
                            if let Some(loss) = LossEvent::parse(index, incarnation, fields) {
                                state.losses.lock().unwrap_or_else(|p| p.into_inner()).push(loss);
                            }
                        }
                        "stopped" => {
                            state.stopped.lock().unwrap_or_else(|p| p.into_inner()).insert(incarnation);
                        }
                        _ => {}
                    }
                }
            });
        }
        Ok(Worker { index, incarnation, child, pid, state, stopped_until: None, stop_record: None })
    }

    pub(crate) fn metric(&self, name: &str) -> u64 {
        self.states
            .iter()
            .map(|s| {
                s.metrics.lock().unwrap_or_else(|p| p.into_inner()).values().filter_map(|m| m.get(name)).sum::<u64>()
            })
            .sum()
    }
}
