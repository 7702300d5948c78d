//! Worker processes for the SQS tests: the `sqs_worker` example binary (built for the test by
//! [`crate::programs`]), driven and observed through the `EVENT …` lines it prints.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use brokerfence::PgFence;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::Notify;

use super::{TestQueue, aws};

/// The example binary `name` (`sqs_worker`, `sqs_produce`), built for this test by cargo (see
/// [`crate::programs`]).
pub fn example(name: &str) -> PathBuf {
    crate::programs::example(name)
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
        fence.get_schema().as_str().to_owned(),
        "--owner".into(),
        owner.to_owned(),
        "--wait".into(),
        "1".into(),
    ];
    v.extend(extra.iter().map(|s| (*s).to_owned()));
    v
}
