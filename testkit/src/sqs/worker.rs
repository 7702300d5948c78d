//! Worker processes for the SQS tests: the `sqs_worker` example binary (built on demand with the
//! test binary's features), driven and observed through the `EVENT …` lines it prints.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use brokerfence::fence::PgFence;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::Notify;

use super::{TestQueue, aws};

/// The workspace root (this crate's parent directory).
fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("testkit/ lies in the workspace root")
}

/// The newest modification time of the sources the example binaries are built from.
fn newest_source() -> Option<std::time::SystemTime> {
    fn walk(dir: &std::path::Path, newest: &mut Option<std::time::SystemTime>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            let path = e.path();
            if path.is_dir() {
                walk(&path, newest);
            } else if path.extension().is_some_and(|x| x == "rs")
                && let Ok(m) = e.metadata().and_then(|m| m.modified())
            {
                *newest = Some(newest.map_or(m, |n| n.max(m)));
            }
        }
    }
    let root = workspace_root();
    let mut newest = None;
    for dir in ["src", "fence/src", "adapters/src", "examples/support"] {
        walk(&root.join(dir), &mut newest);
    }
    for file in ["examples/sqs_worker.rs", "examples/sqs_produce.rs", "examples/support/cli.rs"] {
        if let Ok(m) = std::fs::metadata(root.join(file)).and_then(|m| m.modified()) {
            newest = Some(newest.map_or(m, |n: std::time::SystemTime| n.max(m)));
        }
    }
    newest
}

/// The examples' binaries, next to this test binary's directory (`target/<profile>/examples`):
/// `cargo test` builds them. When they are missing, older than their sources, or built without the
/// `guard-switches` feature this test binary has (`cargo test --test sqs_e2e` builds no
/// examples), they are built here once, with this test binary's features.
pub fn example(name: &str) -> PathBuf {
    static BUILT: OnceLock<Result<(), String>> = OnceLock::new();
    let exe = std::env::current_exe().expect("current exe");
    let profile_dir = exe.parent().and_then(|d| d.parent()).expect("target/<profile>").to_path_buf();
    let path = profile_dir.join("examples").join(name);
    let worker = profile_dir.join("examples").join("sqs_worker");
    let sources = newest_source();
    let fresh = |p: &PathBuf| {
        let built = std::fs::metadata(p).and_then(|m| m.modified()).ok();
        matches!((built, sources), (Some(b), Some(s)) if b >= s)
    };
    let same_features = || {
        // Tests and examples always have the members' `guard-switches` (root dev-dependencies).
        let want = "guard-switches=true";
        std::process::Command::new(&worker)
            .arg("--build-info")
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(want))
    };
    if !(fresh(&path) && fresh(&worker) && same_features()) {
        let built = BUILT.get_or_init(|| {
            let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
            // The same features as this test binary, so the workers match it, plus `metrics`
            // (the root's feature, which testkit cannot see): a worker rebuilt here without it
            // refused `--metrics-addr`, and `ergonomics_metrics` failed when it ran after a
            // rebuild (seen when sources changed during a test run).
            let mut features = vec!["sqs", "metrics"];
            for (on, f) in
                [(cfg!(feature = "redis"), "redis"), (cfg!(feature = "http"), "http"), (cfg!(feature = "tls"), "tls")]
            {
                if on {
                    features.push(f);
                }
            }
            let mut cmd = std::process::Command::new(cargo);
            cmd.current_dir(workspace_root()).args(["build", "--features", &features.join(",")]);
            cmd.args(["--example", "sqs_worker", "--example", "sqs_produce"]);
            if profile_dir.file_name().is_some_and(|n| n == "release") {
                cmd.arg("--release");
            }
            match cmd.status() {
                Ok(s) if s.success() => Ok(()),
                Ok(s) => Err(format!("cargo build of the examples exited with {s}")),
                Err(e) => Err(format!("cannot run cargo: {e}")),
            }
        });
        if let Err(e) = built {
            panic!("{e}; build them first: cargo build --features sqs --examples");
        }
    }
    assert!(path.exists(), "{} missing: cargo build --features sqs --examples", path.display());
    path
}

/// One `EVENT name k=v …` line.
#[derive(Debug, Clone)]
pub struct Event {
    pub name: String,
    pub fields: HashMap<String, String>,
    pub line: String,
}

impl Event {
    fn parse(line: &str) -> Option<Self> {
        let rest = line.strip_prefix("EVENT ")?;
        let mut parts = rest.split_whitespace();
        let name = parts.next()?.to_owned();
        let fields = parts.filter_map(|p| p.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect();
        Some(Self { name, fields, line: line.to_owned() })
    }

    pub fn get(&self, k: &str) -> Option<&str> {
        self.fields.get(k).map(String::as_str)
    }

    pub fn num(&self, k: &str) -> u64 {
        self.get(k).and_then(|v| v.parse().ok()).unwrap_or(0)
    }
}

/// A worker process (examples/sqs_worker) and the events it printed.
pub struct Worker {
    pub child: tokio::process::Child,
    pub pid: i32,
    pub name: String,
    events: Arc<Mutex<Vec<Event>>>,
    changed: Arc<Notify>,
    /// The task reading stdout; it ends at end-of-file.
    reader: Option<tokio::task::JoinHandle<()>>,
}

impl Worker {
    /// Starts `sqs_worker` with `args` (queue URL, schema etc. are the caller's).
    pub fn spawn(name: &str, args: &[String]) -> Self {
        let aws = aws();
        let mut cmd = tokio::process::Command::new(example("sqs_worker"));
        cmd.args(args)
            .envs(aws.child_env())
            .env("RUST_LOG", std::env::var("WORKER_LOG").unwrap_or_else(|_| "warn".into()))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true);
        let mut child = cmd.spawn().expect("spawn sqs_worker");
        let pid = crate::process::pid(&child);
        let events = Arc::new(Mutex::new(Vec::new()));
        let changed = Arc::new(Notify::new());
        let stdout = child.stdout.take().expect("stdout");
        let (ev, ch, tag) = (Arc::clone(&events), Arc::clone(&changed), name.to_owned());
        let reader = tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                eprintln!("[{tag}] {line}");
                if let Some(e) = Event::parse(&line)
                    && let Ok(mut v) = ev.lock()
                {
                    v.push(e);
                }
                ch.notify_waiters();
            }
            ch.notify_waiters();
        });
        Self { child, pid, name: name.to_owned(), events, changed, reader: Some(reader) }
    }

    pub fn events(&self) -> Vec<Event> {
        self.events.lock().map(|v| v.clone()).unwrap_or_default()
    }

    /// The newest `metrics` event (all zero if none yet).
    pub fn metrics(&self) -> Event {
        self.events().into_iter().rev().find(|e| e.name == "metrics" || e.name == "stopped").unwrap_or(Event {
            name: "metrics".into(),
            fields: HashMap::new(),
            line: String::new(),
        })
    }

    /// Waits for an event matching `pred`.
    pub async fn wait_event(&self, within: Duration, what: &str, pred: impl Fn(&Event) -> bool) -> Event {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let notified = self.changed.notified();
            if let Some(e) = self.events().into_iter().find(|e| pred(e)) {
                return e;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!(
                    "worker {}: timed out after {within:?} waiting for {what}; events: {:#?}",
                    self.name,
                    self.events()
                );
            }
        }
    }

    pub fn signal(&self, sig: i32) {
        crate::process::signal(self.pid, sig);
    }

    /// Waits for the process to exit and its output to be read to the end; returns its status.
    pub async fn wait_exit(&mut self, within: Duration) -> std::process::ExitStatus {
        let status = match tokio::time::timeout(within, self.child.wait()).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => panic!("wait for {}: {e}", self.name),
            Err(_) => panic!("worker {} did not exit within {within:?}", self.name),
        };
        // Its last lines (the final counters) may still be in the pipe.
        if let Some(reader) = self.reader.take() {
            assert!(
                tokio::time::timeout(within, reader).await.is_ok(),
                "worker {}: output not read to its end",
                self.name
            );
        }
        status
    }
}

/// Standard arguments of a worker on `queue` with the fence in `fence`'s schema.
pub fn worker_args(queue: &TestQueue, fence: &PgFence, owner: &str, extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = vec![
        "--queue-url".into(),
        queue.url.clone(),
        "--schema".into(),
        fence.schema().as_str().to_owned(),
        "--owner".into(),
        owner.to_owned(),
        "--wait".into(),
        "1".into(),
    ];
    v.extend(extra.iter().map(|s| (*s).to_owned()));
    v
}
