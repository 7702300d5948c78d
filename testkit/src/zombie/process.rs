//! The zombie: a worker in its own OS process (the test binary in worker mode), observed through
//! its `EVENT …` lines, frozen with SIGSTOP and resumed with SIGCONT.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::Notify;

use super::{Db, KEY, LEASE_SECS, QUEUE, WORKER_ENTRY, WORKER_ENV};

/// The zombie: a worker in its own OS process.
pub struct Zombie {
    pub label: String,
    pub pid: i32,
    child: tokio::process::Child,
    stdin: Option<tokio::process::ChildStdin>,
    /// (arrival, line): stdout `EVENT …` lines without the prefix; stderr lines prefixed `stderr: `.
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
    notify: Arc<Notify>,
    /// The tasks reading stdout and stderr; they end at end-of-file.
    readers: Vec<tokio::task::JoinHandle<()>>,
    pub started: Instant,
}

impl Zombie {
    /// Spawns the worker against `db`, calling `receiver`, with a plan and test-only guard switches.
    pub fn spawn(label: &str, db: &Db, receiver: Option<&str>, plan: &str, guards: &[&str]) -> Zombie {
        Self::spawn_url(label, db, &db.url, receiver, plan, guards)
    }

    /// Like [`spawn`](Self::spawn) but connecting to `url` (e.g. through a proxy).
    pub fn spawn_url(label: &str, db: &Db, url: &str, receiver: Option<&str>, plan: &str, guards: &[&str]) -> Zombie {
        let mut args: Vec<String> = vec![
            "--db".into(),
            url.into(),
            "--schema".into(),
            db.schema.as_str().into(),
            "--queue".into(),
            QUEUE.into(),
            "--key".into(),
            KEY.into(),
            "--owner".into(),
            "zombie".into(),
            "--lease-secs".into(),
            LEASE_SECS.to_string(),
            "--plan".into(),
            plan.into(),
            "--result".into(),
            "result of zombie".into(),
        ];
        if let Some(r) = receiver {
            args.extend(["--receiver".into(), r.into()]);
        }
        if !guards.is_empty() {
            args.extend(["--guards".into(), guards.join(",")]);
        }
        let mut cmd = crate::process::reexec(WORKER_ENTRY, WORKER_ENV, &args);
        let log = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn,brokerfence_fence=info".into());
        cmd.env("RUST_LOG", log).stdin(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
        let (mut child, pid) = crate::process::spawn(&mut cmd, "zombie worker process");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let notify = Arc::new(Notify::new());
        let stdout = child.stdout.take().expect("stdout");
        let stderr = child.stderr.take().expect("stderr");
        let mut readers = Vec::new();
        for (stream, is_err) in
            [(Box::new(stdout) as Box<dyn tokio::io::AsyncRead + Unpin + Send>, false), (Box::new(stderr), true)]
        {
            let lines = Arc::clone(&lines);
            let notify = Arc::clone(&notify);
            readers.push(tokio::spawn(async move {
                let mut reader = BufReader::new(stream).lines();
                while let Ok(Some(line)) = reader.next_line().await {
                    let at = Instant::now();
                    let entry = if is_err {
                        format!("stderr: {line}")
                    } else if let Some(event) = line.strip_prefix("EVENT ") {
                        event.to_owned()
                    } else {
                        continue;
                    };
                    lines.lock().expect("lines").push((at, entry));
                    notify.notify_waiters();
                }
                notify.notify_waiters();
            }));
        }
        let stdin = child.stdin.take();
        Zombie { label: label.to_owned(), pid, child, stdin, lines, notify, readers, started: Instant::now() }
    }

    /// Every event so far (stderr lines excluded).
    pub fn events(&self) -> Vec<(Instant, String)> {
        self.lines.lock().expect("lines").iter().filter(|(_, l)| !l.starts_with("stderr: ")).cloned().collect()
    }

    /// Events that arrived after `t`.
    pub fn events_after(&self, t: Instant) -> Vec<String> {
        self.events().into_iter().filter(|(at, _)| *at > t).map(|(_, l)| l).collect()
    }

    /// Waits for the first event starting with `prefix` that arrived after `after`.
    pub async fn wait_for_after(&self, prefix: &str, after: Option<Instant>, timeout: Duration) -> (Instant, String) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(hit) =
                self.events().into_iter().find(|(at, l)| l.starts_with(prefix) && after.is_none_or(|t| *at > t))
            {
                return hit;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                panic!("[{}] no event {prefix:?} within {timeout:?}\n{}", self.label, self.transcript());
            }
        }
    }

    pub async fn wait_for(&self, prefix: &str, timeout: Duration) -> (Instant, String) {
        self.wait_for_after(prefix, None, timeout).await
    }

    /// Freezes the whole process (every thread, the heartbeat included) with SIGSTOP.
    pub fn stop(&self) -> Instant {
        crate::process::signal(self.pid, libc::SIGSTOP);
        let t = Instant::now();
        let until = t + Duration::from_secs(2);
        while proc_state(self.pid) != Some('T') {
            assert!(Instant::now() < until, "[{}] process did not stop", self.label);
            std::thread::sleep(Duration::from_millis(1));
        }
        t
    }

    /// Resumes it with SIGCONT; returns the instant just before the signal was sent (so every
    /// latency measured from it is an upper bound).
    pub fn cont(&self) -> Instant {
        let t = Instant::now();
        crate::process::signal(self.pid, libc::SIGCONT);
        t
    }

    /// Opens the `gate` step (the write is buffered in the pipe while the process is stopped).
    pub async fn open_gate(&mut self) {
        let stdin = self.stdin.as_mut().expect("stdin");
        stdin.write_all(b"go\n").await.expect("write gate");
        stdin.flush().await.expect("flush gate");
    }

    /// Waits for the process to exit; returns its exit code.
    pub async fn finish(&mut self, timeout: Duration) -> i32 {
        let code = match tokio::time::timeout(timeout, self.child.wait()).await {
            Ok(Ok(status)) => status.code().unwrap_or(-1),
            Ok(Err(e)) => panic!("[{}] wait: {e}", self.label),
            Err(_) => panic!("[{}] did not exit within {timeout:?}\n{}", self.label, self.transcript()),
        };
        // The process has exited, but its last lines may still be on their way through the
        // pipes: read to the end, so what it printed last (its counters) is there for the test.
        for reader in self.readers.drain(..) {
            if tokio::time::timeout(timeout, reader).await.is_err() {
                panic!("[{}] output not read to its end within {timeout:?}", self.label);
            }
        }
        code
    }

    /// Waits (10 s at most) for the process to exit, and fails the test unless it exited with 0.
    pub async fn finish_ok(&mut self) {
        let code = self.finish(Duration::from_secs(10)).await;
        assert_eq!(code, 0, "[{}] worker exit code\n{}", self.label, self.transcript());
    }

    /// The `outcome=…` event.
    pub fn outcome(&self) -> Option<String> {
        self.events().into_iter().map(|(_, l)| l).find(|l| l.starts_with("outcome="))
    }

    /// The counters the worker printed at its end.
    pub fn metrics(&self) -> HashMap<String, u64> {
        let line = self.events().into_iter().map(|(_, l)| l).find(|l| l.starts_with("metrics ")).unwrap_or_default();
        line.split_whitespace()
            .filter_map(|kv| kv.split_once('='))
            .filter_map(|(k, v)| Some((k.to_owned(), v.parse().ok()?)))
            .collect()
    }

    /// The claimed epoch.
    pub fn claimed_epoch(&self) -> i64 {
        let line = self.events().into_iter().map(|(_, l)| l).find(|l| l.starts_with("claimed ")).unwrap_or_default();
        field(&line, "epoch").and_then(|v| v.parse().ok()).unwrap_or(0)
    }

    /// Everything the process printed, with arrival times relative to its start.
    pub fn transcript(&self) -> String {
        let lines = self.lines.lock().expect("lines");
        lines.iter().map(|(at, l)| format!("  {:>7.3}s {l}\n", at.duration_since(self.started).as_secs_f64())).collect()
    }
}

/// The value of `name=` in an event line.
pub fn field<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
}

/// The state letter of /proc/<pid>/stat (`T` = stopped).
pub fn proc_state(pid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}
