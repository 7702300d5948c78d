//! Issue #12 §6, "Examples that other programs can drive": the example workers run as real
//! processes (built for the test by `brokerfence_testkit::programs`) and are checked the way an operator's script or a test drives them:
//! exit codes, usage on stdout, the schema check at start, `EVENT` lines, `application_name`, and
//! logs without colour codes when stderr is a pipe. Real PostgreSQL (a fresh schema per test) and
//! real Redis.

#[cfg(feature = "sqs")]
use brokerfence_testkit::sqs as sqs_support;
use brokerfence_testkit::store as common;

mod edges {
    use std::path::PathBuf;
    use std::process::Stdio;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use brokerfence::{FenceStore, JobState, PgFence, QueueName};
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, BufReader};
    use tokio::sync::Notify;

    use super::common;

    /// Every worker and producer the examples have (those of a feature this build lacks are skipped).
    fn programs() -> Vec<&'static str> {
        let mut v = vec!["table_worker", "table_produce", "zombie_worker"];
        if cfg!(feature = "sqs") {
            v.extend(["sqs_worker", "sqs_produce"]);
        }
        if cfg!(feature = "redis") {
            v.extend(["redis_worker", "redis_produce"]);
        }
        if cfg!(feature = "tower") {
            v.push("tower_worker");
        }
        v
    }

    /// The example `name`, built for this test by cargo (`brokerfence_testkit::programs`),
    /// whatever an earlier build left in `target/<profile>/examples/` (issue #30 item 15).
    fn example(name: &str) -> PathBuf {
        brokerfence_testkit::programs::example(name)
    }

    fn database_url() -> String {
        common::database_url()
    }

    /// A finished run: exit code, stdout, stderr.
    async fn run_to_end(name: &str, args: &[&str]) -> (i32, String, String) {
        let out = tokio::time::timeout(
            Duration::from_secs(30),
            tokio::process::Command::new(example(name)).args(args).kill_on_drop(true).output(),
        )
        .await
        .unwrap_or_else(|_| panic!("{name} {args:?} did not exit within 30 s"))
        .unwrap_or_else(|e| panic!("run {name}: {e}"));
        let code = out.status.code().unwrap_or(-1);
        (code, String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    }

    /// A worker process whose stdout lines and stderr text are collected as they arrive.
    struct Proc {
        name: String,
        child: tokio::process::Child,
        pid: i32,
        lines: Arc<Mutex<Vec<String>>>,
        stderr: Arc<Mutex<String>>,
        changed: Arc<Notify>,
        readers: Vec<tokio::task::JoinHandle<()>>,
    }

    impl Proc {
        /// Starts `name` with `args`; logs at info, `NO_COLOR` unset (so only the pipe decides).
        fn spawn(name: &str, args: &[&str]) -> Proc {
            let mut child = tokio::process::Command::new(example(name))
                .args(args)
                .env("RUST_LOG", "info")
                .env_remove("NO_COLOR")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
            let pid = i32::try_from(child.id().expect("pid")).expect("pid fits");
            let lines: Arc<Mutex<Vec<String>>> = Arc::default();
            let stderr: Arc<Mutex<String>> = Arc::default();
            let changed = Arc::new(Notify::new());
            let stdout = child.stdout.take().expect("stdout");
            let mut err = child.stderr.take().expect("stderr");
            let (l, n, tag) = (Arc::clone(&lines), Arc::clone(&changed), name.to_owned());
            let out_reader = tokio::spawn(async move {
                let mut it = BufReader::new(stdout).lines();
                while let Ok(Some(line)) = it.next_line().await {
                    eprintln!("[{tag}] {line}");
                    l.lock().expect("lines").push(line);
                    n.notify_waiters();
                }
                n.notify_waiters();
            });
            let s: Arc<Mutex<String>> = Arc::clone(&stderr);
            let err_reader = tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                while let Ok(n) = err.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    s.lock().expect("stderr").push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            });
            Proc { name: name.to_owned(), child, pid, lines, stderr, changed, readers: vec![out_reader, err_reader] }
        }

        fn lines(&self) -> Vec<String> {
            self.lines.lock().expect("lines").clone()
        }

        fn events(&self, name: &str) -> Vec<String> {
            let prefix = format!("EVENT {name} ");
            self.lines().into_iter().filter(|l| l.starts_with(&prefix)).collect()
        }

        /// Waits until `pred` holds over the lines so far.
        async fn wait(&self, within: Duration, what: &str, pred: impl Fn(&Proc) -> bool) {
            let deadline = tokio::time::Instant::now() + within;
            loop {
                let notified = self.changed.notified();
                if pred(self) {
                    return;
                }
                if tokio::time::timeout_at(deadline, notified).await.is_err() && !pred(self) {
                    panic!(
                        "{}: no {what} within {within:?}; stdout: {:#?}; stderr: {}",
                        self.name,
                        self.lines(),
                        self.stderr.lock().expect("stderr")
                    );
                }
            }
        }

        fn signal(&self, sig: i32) {
            // SAFETY: a signal to our own child process.
            let rc = unsafe { libc::kill(self.pid, sig) };
            assert_eq!(rc, 0, "kill({}, {sig})", self.pid);
        }

        /// SIGTERM, then the exit code and all of stderr.
        async fn stop(mut self) -> (i32, String, Vec<String>) {
            self.signal(libc::SIGTERM);
            let status = tokio::time::timeout(Duration::from_secs(30), self.child.wait())
                .await
                .unwrap_or_else(|_| panic!("{} did not stop within 30 s of SIGTERM", self.name))
                .expect("wait");
            for r in self.readers.drain(..) {
                let _ = tokio::time::timeout(Duration::from_secs(10), r).await;
            }
            let stderr = self.stderr.lock().expect("stderr").clone();
            (status.code().unwrap_or(-1), stderr, self.lines())
        }
    }

    /// The value of `field` in an `EVENT` line (unquoted values only).
    fn field<'a>(line: &'a str, field: &str) -> Option<&'a str> {
        line.split_whitespace().find_map(|kv| kv.strip_prefix(field)?.strip_prefix('='))
    }

    async fn schema_exists(fence: &PgFence, schema: &str) -> bool {
        let n: i64 = sqlx::query_scalar("SELECT count(*) FROM information_schema.schemata WHERE schema_name = $1")
            .bind(schema)
            .fetch_one(fence.pool())
            .await
            .expect("query schemata");
        n > 0
    }

    /// §6 bullet 2 (the same flags everywhere; `--help` exits 0): every worker and producer
    /// prints its usage on stdout and exits 0, and the usage names the common flags. Old code:
    /// the workers printed the usage on stderr and exited 2, and `table_worker` did not exist.
    #[tokio::test]
    async fn edges_every_example_prints_help_on_stdout_and_exits_0() {
        for name in programs() {
            let (code, out, err) = run_to_end(name, &["--help"]).await;
            assert_eq!(code, 0, "{name} --help: exit {code}; stderr: {err}");
            assert!(out.starts_with("usage: "), "{name} --help stdout: {out:?}");
            assert!(err.is_empty(), "{name} --help wrote to stderr: {err}");
            if name.ends_with("_worker") {
                for flag in ["--database-url", "--schema", "--owner", "--lease", "--receiver-url", "--migrate"] {
                    assert!(out.contains(flag), "{name} --help does not list {flag}: {out}");
                }
            }
        }
        let (_, out, _) = run_to_end("table_worker", &["--help"]).await;
        assert!(out.contains("--max-attempts"), "{out}");
        if cfg!(feature = "sqs") {
            let (_, out, _) = run_to_end("sqs_worker", &["--help"]).await;
            assert!(out.contains("--dead-letter-queue"), "sqs_worker --help: {out}");
        }
    }

    /// §6 bullet 2: an unknown flag exits 2 with a message naming it (on stderr, stdout empty).
    /// Old code: the workers took the next argument as the flag's value and said "needs a
    /// value", or (zombie_worker) "unknown option"; table_worker did not exist.
    #[tokio::test]
    async fn edges_an_unknown_flag_exits_2_naming_it() {
        for name in programs() {
            let (code, out, err) = run_to_end(name, &["--no-such-flag"]).await;
            assert_eq!(code, 2, "{name} --no-such-flag: exit {code}; stderr: {err}");
            assert!(err.contains("unexpected argument '--no-such-flag'"), "{name}: {err}");
            assert!(out.is_empty(), "{name} printed on stdout: {out}");
        }
    }

    /// §1 bullet 5 / §6 (migrations are an explicit step): without `--migrate`, every worker
    /// checks the schema and refuses to start on an empty one with exit code 2 and the store's
    /// message, creating nothing; with `--migrate` the table worker migrates and starts. Old code:
    /// every worker migrated at start (and ran), and there was no table worker.
    #[tokio::test]
    async fn edges_workers_refuse_an_unmigrated_schema_unless_told_to_migrate() {
        let url = database_url();
        let admin = common::pg_unmigrated().await;
        let mut runs: Vec<(&str, Vec<String>)> = Vec::new();
        let schema = || format!("h6_{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
        let base = |s: &str| vec!["--database-url".to_owned(), url.clone(), "--schema".into(), s.to_owned()];
        let mut table = base(&schema());
        table.extend(["--queue".into(), "q".into()]);
        runs.push(("table_worker", table));
        runs.push(("zombie_worker", base(&schema())));
        if cfg!(feature = "sqs") {
            let mut a = base(&schema());
            a.extend(["--queue-url".into(), "http://127.0.0.1:9/000000000000/never-used".into()]);
            runs.push(("sqs_worker", a));
        }
        if cfg!(feature = "redis") {
            let mut a = base(&schema());
            a.extend(["--stream".into(), "never-used".into(), "--redis-url".into(), "redis://127.0.0.1:9".into()]);
            runs.push(("redis_worker", a));
        }
        for (name, args) in &runs {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let (code, _, err) = run_to_end(name, &args).await;
            assert_eq!(code, 2, "{name} on an empty schema: exit {code}; stderr: {err}");
            assert!(err.contains("run migrations") && err.contains("--migrate"), "{name}: {err}");
            assert!(err.contains("version 0"), "{name}: {err}");
            let schema = args[3];
            assert!(!schema_exists(&admin, schema).await, "{name} created schema {schema} without --migrate");
        }

        // With --migrate it migrates and starts.
        let s = schema();
        let worker = Proc::spawn(
            "table_worker",
            &["--database-url", &url, "--schema", &s, "--queue", "q", "--migrate", "--owner", "h6-migrate"],
        );
        worker.wait(Duration::from_secs(30), "ready", |p| !p.events("ready").is_empty()).await;
        assert!(schema_exists(&admin, &s).await);
        let (code, _, _) = worker.stop().await;
        assert_eq!(code, 0);
        let fence = admin.clone().schema(brokerfence::SchemaName::new(s).expect("schema"));
        fence.check_schema().await.expect("migrated by --migrate");
    }

    /// §6 bullets 1-4: `table_produce` enqueues five jobs, `table_worker` runs them and prints
    /// `ready pid=<its pid>`, then `claimed`, `handled`, `committed` (epoch and owner) and `acked`
    /// for every job; while it runs, its owner is its `application_name` in `pg_stat_activity`;
    /// SIGTERM stops it with exit 0 and `stopped`; its log lines on a piped stderr carry no ANSI
    /// colour codes. Old code: no table worker, no `committed`/`acked` lines, no
    /// `application_name`.
    #[tokio::test]
    async fn edges_table_worker_runs_produced_jobs_and_tells_what_happened() {
        let url = database_url();
        let fence = common::pg_unmigrated().await;
        let schema = fence.get_schema().as_str().to_owned();
        let queue = common::unique("tq");
        let owner = common::unique("h6-table");
        let (code, out, err) = run_to_end(
            "table_produce",
            &["--database-url", &url, "--schema", &schema, "--queue", &queue, "--count", "5", "--migrate"],
        )
        .await;
        assert_eq!(code, 0, "table_produce: {err}");
        assert!(out.contains(&format!("EVENT produced queue={queue} count=5 new=5")), "{out}");

        let worker = Proc::spawn(
            "table_worker",
            &["--database-url", &url, "--schema", &schema, "--queue", &queue, "--owner", &owner, "--lease", "3"],
        );
        worker.wait(Duration::from_secs(30), "5 acked", |p| p.events("acked").len() >= 5).await;
        let ready = worker.events("ready");
        assert_eq!(ready.len(), 1, "{ready:?}");
        assert_eq!(field(&ready[0], "pid"), Some(worker.pid.to_string().as_str()), "{}", ready[0]);
        assert_eq!(field(&ready[0], "owner"), Some(owner.as_str()));
        let committed = worker.events("committed");
        assert_eq!(committed.len(), 5, "{committed:?}");
        let mut keys: Vec<&str> = committed.iter().filter_map(|l| field(l, "key")).collect();
        keys.sort_unstable();
        assert_eq!(keys, ["job-0", "job-1", "job-2", "job-3", "job-4"]);
        for line in &committed {
            assert_eq!(field(line, "epoch"), Some("1"), "{line}");
            assert_eq!(field(line, "owner"), Some(owner.as_str()), "{line}");
            assert_eq!(field(line, "queue"), Some(queue.as_str()), "{line}");
        }
        for name in ["claimed", "handled"] {
            assert_eq!(worker.events(name).len(), 5, "{name}: {:?}", worker.lines());
        }
        assert!(worker.events("dropped").is_empty() && worker.events("failed").is_empty(), "{:?}", worker.lines());

        let sessions: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1")
            .bind(&owner)
            .fetch_one(fence.pool())
            .await
            .expect("pg_stat_activity");
        assert!(sessions >= 1, "no session with application_name {owner}");

        let (code, stderr, lines) = worker.stop().await;
        assert_eq!(code, 0, "exit after SIGTERM; stderr: {stderr}");
        assert!(lines.iter().any(|l| l.starts_with("EVENT stopped ")), "{lines:?}");
        assert!(stderr.contains("INFO"), "expected log lines at info: {stderr}");
        assert!(!stderr.contains("\x1b["), "ANSI codes on a piped stderr: {stderr:?}");
        let q = QueueName::new(queue).expect("queue");
        for k in keys {
            let job = fence.job(&q, &common::key(k)).await.expect("job").expect("row");
            assert_eq!(job.state, JobState::Completed, "{k}");
        }
    }

    /// §6 bullet 1 (`dropped` only for a cancellation; a handler error gets its own event): a
    /// handler whose receiver is unreachable prints `failed` with the error, then
    /// `fail_recorded outcome=dead` (with `--max-attempts 1`) and `dead_lettered` — never
    /// `dropped`. Old code printed `dropped` for every handler error, and had no table worker.
    #[tokio::test]
    async fn edges_a_handler_error_is_failed_not_dropped() {
        let url = database_url();
        let fence = common::pg().await;
        let schema = fence.get_schema().as_str().to_owned();
        let queue = common::unique("tq");
        let q = QueueName::new(queue.clone()).expect("queue");
        fence.enqueue(&q, &common::key("doomed"), b"x").await.expect("enqueue");
        // A port nobody listens on: bind, note it, close.
        let port = std::net::TcpListener::bind("127.0.0.1:0").expect("bind").local_addr().expect("addr").port();
        let receiver = format!("http://127.0.0.1:{port}/apply");
        let worker = Proc::spawn(
            "table_worker",
            &[
                "--database-url",
                &url,
                "--schema",
                &schema,
                "--queue",
                &queue,
                "--receiver-url",
                &receiver,
                "--max-attempts",
                "1",
                "--owner",
                "h6-failing",
            ],
        );
        worker.wait(Duration::from_secs(30), "dead_lettered", |p| !p.events("dead_lettered").is_empty()).await;
        let failed = worker.events("failed");
        assert_eq!(failed.len(), 1, "{:?}", worker.lines());
        assert!(failed[0].contains("key=doomed epoch=1 owner=h6-failing"), "{}", failed[0]);
        assert!(failed[0].contains("receiver unreachable"), "{}", failed[0]);
        let recorded = worker.events("fail_recorded");
        assert!(recorded.iter().any(|l| field(l, "outcome") == Some("dead")), "{recorded:?}");
        assert!(worker.events("dead_lettered")[0].contains("key=doomed"));
        let (code, _, lines) = worker.stop().await;
        assert_eq!(code, 0);
        assert!(!lines.iter().any(|l| l.starts_with("EVENT dropped ")), "dropped for a handler error: {lines:#?}");
        let job = fence.job(&q, &common::key("doomed")).await.expect("job").expect("row");
        assert_eq!(job.state, JobState::Dead);
    }

    /// §6 bullet 1 (`dropped` for a cancellation): the worker is frozen (SIGSTOP) past its 3 s
    /// lease while its handler runs, the test takes the job over (epoch 2), and after SIGCONT the
    /// worker cancels the attempt (its lease ran out unconfirmed, or the heartbeat finds it lost):
    /// it prints `dropped` for epoch 1 and no `committed`.
    #[tokio::test]
    async fn edges_a_cancelled_attempt_prints_lease_lost_and_dropped() {
        let url = database_url();
        let fence = common::pg().await;
        let schema = fence.get_schema().as_str().to_owned();
        let queue = common::unique("tq");
        let q = QueueName::new(queue.clone()).expect("queue");
        fence.enqueue(&q, &common::key("slow"), b"x").await.expect("enqueue");
        let worker = Proc::spawn(
            "table_worker",
            &[
                "--database-url",
                &url,
                "--schema",
                &schema,
                "--queue",
                &queue,
                "--lease",
                "3",
                "--handler-delay",
                "60000",
                "--owner",
                "h6-frozen",
            ],
        );
        worker.wait(Duration::from_secs(30), "claimed", |p| !p.events("claimed").is_empty()).await;
        worker.signal(libc::SIGSTOP);
        let thief = brokerfence::Owner::new("h6-thief").expect("owner");
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        let taken = loop {
            let got = fence.claim_next(&q, &thief, common::lease(30), 1).await.expect("claim_next");
            if let Some(job) = got.into_iter().next() {
                break job;
            }
            assert!(tokio::time::Instant::now() < deadline, "the frozen worker's lease never lapsed");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        assert_eq!(taken.lease.epoch, 2);
        worker.signal(libc::SIGCONT);
        worker.wait(Duration::from_secs(15), "dropped", |p| !p.events("dropped").is_empty()).await;
        let dropped = worker.events("dropped");
        assert!(dropped[0].contains("key=slow epoch=1 owner=h6-frozen"), "{}", dropped[0]);
        let (code, _, lines) = worker.stop().await;
        assert_eq!(code, 0);
        assert!(!lines.iter().any(|l| l.starts_with("EVENT committed ")), "{lines:#?}");
        fence.complete(&taken.lease, b"thief").await.expect("the new holder commits");
    }

    /// §6 bullet 3 (no ANSI colour codes when stderr is not a terminal): the Redis worker, on a
    /// migrated schema, logs at info to a piped stderr without `ESC [` sequences. Old code
    /// coloured its log lines whatever stderr was.
    #[tokio::test]
    async fn edges_redis_worker_logs_without_colour_on_a_pipe() {
        if !cfg!(feature = "redis") {
            return;
        }
        let url = database_url();
        let redis_url =
            brokerfence_testkit::services::var("REDIS_URL").unwrap_or_else(|| "redis://127.0.0.1:6379".into());
        let fence = common::pg().await;
        let stream = common::unique("h6-ansi");
        let worker = Proc::spawn(
            "redis_worker",
            &[
                "--stream",
                &stream,
                "--group",
                "g",
                "--database-url",
                &url,
                "--schema",
                fence.get_schema().as_str(),
                "--redis-url",
                &redis_url,
                "--block",
                "200",
                "--owner",
                "h6-ansi",
            ],
        );
        worker.wait(Duration::from_secs(30), "ready", |p| !p.events("ready").is_empty()).await;
        let (code, stderr, _) = worker.stop().await;
        assert_eq!(code, 0, "{stderr}");
        assert!(stderr.contains("INFO"), "expected log lines at info: {stderr}");
        assert!(!stderr.contains("\x1b["), "ANSI codes on a piped stderr: {stderr:?}");
        delete_key(&redis_url, &stream).await;
    }

    /// §3 bullet 4 / §6 (`--dead-letter-queue`, and the `EVENT` lines of the SQS worker): on a
    /// queue without a `RedrivePolicy`, `sqs_worker --dead-letter-queue <url>` moves an
    /// undecodable message to that queue and prints `dead_lettered key=- reason=…`; a good
    /// message prints `committed` (epoch 1, its owner) and then `acked`. Old code: no
    /// `--dead-letter-queue` flag (exit 2), no `committed`/`acked`/`dead_lettered` lines.
    #[cfg(feature = "sqs")]
    #[tokio::test]
    async fn edges_sqs_worker_dead_letters_to_the_given_queue_and_tells_so() {
        use super::sqs_support::{TestQueue, Worker, depth, drain, drop_schema, pg, send, sqs, worker_args};
        let client = sqs().await;
        let fence = pg().await;
        let q = TestQueue::new(&client, "h6-events", 5).await;
        let dlq = TestQueue::new(&client, "h6-events-dlq", 5).await;
        send(&client, &q.url, "not json {").await;
        send(&client, &q.url, r#"{"id":"good-1"}"#).await;
        let extra = ["--key", "body:id", "--dead-letter-queue", dlq.url.as_str(), "--lease", "3"];
        let mut worker = Worker::spawn("h6-sqs", &worker_args(&q, &fence, "h6-sqs", &extra));
        worker
            .wait_event(Duration::from_secs(30), "acked good-1", |e| {
                e.name == "acked" && e.get("key") == Some("good-1")
            })
            .await;
        worker.wait_event(Duration::from_secs(30), "dead_lettered", |e| e.name == "dead_lettered").await;
        let events = worker.events();
        let ready = events.iter().find(|e| e.name == "ready").expect("ready");
        assert_eq!(ready.num("pid"), u64::try_from(worker.pid).expect("pid"), "{}", ready.line);
        assert_eq!(ready.get("queue_url"), Some(q.url.as_str()));
        let committed: Vec<_> = events.iter().filter(|e| e.name == "committed").collect();
        assert_eq!(committed.len(), 1, "{events:#?}");
        assert_eq!(committed[0].get("key"), Some("good-1"));
        assert_eq!(committed[0].get("epoch"), Some("1"));
        assert_eq!(committed[0].get("owner"), Some("h6-sqs"));
        let dead = events.iter().find(|e| e.name == "dead_lettered").expect("dead_lettered");
        assert_eq!(dead.get("key"), Some("-"), "{}", dead.line);
        assert!(dead.line.contains("reason="), "{}", dead.line);
        assert!(!events.iter().any(|e| e.name == "dropped" || e.name == "broker_error"), "{events:#?}");
        worker.signal(libc::SIGTERM);
        let status = worker.wait_exit(Duration::from_secs(30)).await;
        assert!(status.success(), "{status}");
        assert_eq!(drain(&client, &dlq.url, 1, Duration::from_secs(5)).await.len(), 1);
        assert_eq!(depth(&client, &q.url).await, 0);
        q.delete(&client).await;
        dlq.delete(&client).await;
        drop_schema(&fence).await;
    }

    /// Removes the test's stream from the shared Redis.
    #[cfg(feature = "redis")]
    async fn delete_key(url: &str, key: &str) {
        use brokerfence::redis::client;
        if let Ok(c) = client::Client::open(url)
            && let Ok(mut conn) = c.get_multiplexed_async_connection().await
        {
            let _: Result<i64, _> = client::cmd("DEL").arg(key).query_async(&mut conn).await;
        }
    }

    #[cfg(not(feature = "redis"))]
    async fn delete_key(_url: &str, _key: &str) {}
}
