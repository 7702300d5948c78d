//! Issue 16, "tower": `examples/tower_worker.rs` (a fenced handler under tower's `TimeoutLayer`
//! and a tracing span layer) runs as a process over the PostgreSQL table queue and is checked by
//! its `EVENT` lines and the job rows: quick jobs commit; a job that outlasts the timeout fails
//! with "request timed out" on every attempt, is retried once, and is dead after
//! `--max-attempts 2`, never committed and never reported `dropped` (a timeout is a failure, not
//! a lost lease).
//!
//! Run: `cargo test --workspace --all-features tower_worker` (PostgreSQL from `localstack/up`;
//! the test builds the example with the `tower` feature).
#![cfg(feature = "tower")]

use brokerfence_testkit::store as common;

use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use brokerfence::{FenceStore, JobState, QueueName};
use brokerfence_testkit::process::built_example;
use tokio::io::{AsyncBufReadExt, BufReader};

/// The value of `name=` in an `EVENT` line (quoted values unescaped for `\"` and `\\` only).
fn field(line: &str, name: &str) -> Option<String> {
    let start = line.find(&format!(" {name}="))? + name.len() + 2;
    let rest = &line[start..];
    if let Some(quoted) = rest.strip_prefix('"') {
        let mut out = String::new();
        let mut chars = quoted.chars();
        while let Some(c) = chars.next() {
            match c {
                '"' => return Some(out),
                '\\' => out.extend(chars.next()),
                c => out.push(c),
            }
        }
        None
    } else {
        Some(rest.split_whitespace().next().unwrap_or("").to_owned())
    }
}

/// The lines of `event` about `key`.
fn events<'a>(lines: &'a [String], event: &str, key: &str) -> Vec<&'a String> {
    let prefix = format!("EVENT {event} ");
    lines.iter().filter(|l| l.starts_with(&prefix) && field(l, "key").as_deref() == Some(key)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ergonomics_tower_worker_times_out_retries_and_buries_a_slow_job() {
    let fence = common::pg().await;
    let schema = fence.get_schema().as_str().to_owned();
    let queue = common::unique("tower");
    let q = QueueName::new(queue.clone()).expect("queue");
    for (k, body) in [("fast-0", "hello"), ("fast-1", "hello"), ("slow", "sleep:3000")] {
        fence.enqueue(&q, &common::key(k), body.as_bytes()).await.expect("enqueue");
    }
    let owner = common::unique("tower-worker");
    let url = common::database_url();
    let args = [
        "--database-url",
        &url,
        "--schema",
        &schema,
        "--queue",
        &queue,
        "--owner",
        &owner,
        "--lease",
        "3",
        "--timeout",
        "500",
        "--max-attempts",
        "2",
        "--grace",
        "1000",
    ];
    let mut child = tokio::process::Command::new(built_example("tower_worker"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("start tower_worker");
    let lines = Arc::new(Mutex::new(Vec::<String>::new()));
    let stdout = child.stdout.take().expect("stdout");
    let reader = {
        let lines = Arc::clone(&lines);
        tokio::spawn(async move {
            let mut out = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = out.next_line().await {
                lines.lock().expect("lines").push(line);
            }
        })
    };
    let snapshot = || lines.lock().expect("lines").clone();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    loop {
        let now = snapshot();
        let done = events(&now, "committed", "fast-0").len() == 1
            && events(&now, "committed", "fast-1").len() == 1
            && events(&now, "fail_recorded", "slow").iter().any(|l| field(l, "outcome").as_deref() == Some("dead"));
        if done {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "not done within 40 s: {now:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let pid = i32::try_from(child.id().expect("pid")).expect("pid fits");
    // SAFETY: a plain kill(2) of the child this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let status = tokio::time::timeout(Duration::from_secs(20), child.wait()).await.expect("exits").expect("wait");
    reader.await.expect("reader");
    assert_eq!(status.code(), Some(0), "exit after SIGTERM");
    let all = snapshot();

    let ready = all.iter().find(|l| l.starts_with("EVENT ready ")).expect("ready");
    assert_eq!(field(ready, "timeout_ms").as_deref(), Some("500"), "{ready}");
    assert!(all.last().is_some_and(|l| l.starts_with("EVENT stopped ")), "{all:#?}");
    for k in ["fast-0", "fast-1"] {
        assert_eq!(events(&all, "handled", k).len(), 1, "{all:#?}");
        let job = fence.job(&q, &common::key(k)).await.expect("job").expect("row");
        assert_eq!(job.state, JobState::Completed, "{job:?}");
        assert_eq!(job.result.as_deref(), Some(format!("{owner}@1").as_bytes()), "{job:?}");
    }
    // The slow job: claimed twice (epochs 1 and 2), failed by the timeout each time, retried once,
    // then dead; never handled, committed or dropped.
    let claimed: Vec<_> = events(&all, "claimed", "slow").iter().filter_map(|l| field(l, "epoch")).collect();
    assert_eq!(claimed, ["1", "2"], "{all:#?}");
    let failed = events(&all, "failed", "slow");
    assert_eq!(failed.len(), 2, "{all:#?}");
    for line in &failed {
        assert_eq!(field(line, "error").as_deref(), Some("request timed out"), "{line}");
        assert_eq!(field(line, "retry").as_deref(), Some("true"), "{line}");
    }
    let outcomes: Vec<_> = events(&all, "fail_recorded", "slow").iter().filter_map(|l| field(l, "outcome")).collect();
    assert_eq!(outcomes, ["retry", "dead"], "{all:#?}");
    for name in ["handled", "committed", "dropped"] {
        assert!(events(&all, name, "slow").is_empty(), "{name}: {all:#?}");
    }
    let job = fence.job(&q, &common::key("slow")).await.expect("job").expect("row");
    assert_eq!((job.state, job.failures, job.epoch), (JobState::Dead, 2, 2), "{job:?}");
    let last = job.last_error.as_deref().unwrap_or_default();
    assert_eq!(last, "failed 2 times (max_attempts = 2): request timed out", "{job:?}");
    assert_eq!(job.result, None, "{job:?}");
}
