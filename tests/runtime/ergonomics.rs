//! Issue #30 (see main.rs for the items of this module).

#[cfg(feature = "anyhow")]
mod anyhow_handlers {
    use std::sync::Arc;

    use anyhow::Context as _;
    use brokerfence::{
        Detail, FenceStore, Handler, JobContext, JobError, JobKey, JobResultExt, JobState, Outcome, QueueName,
        Retrofit, SupervisorConfig,
    };
    use brokerfence_testkit::store as common;

    /// What an application's own code looks like: anyhow all the way, context on the way up.
    fn load_template(path: &str) -> anyhow::Result<String> {
        std::fs::read_to_string(path).with_context(|| format!("loading the template {path}"))
    }

    /// Item 13: `?` on `anyhow::Error` in a handler compiles (feature `anyhow`) and keeps what
    /// anyhow carries: the message is the whole context chain, the error is retried, `.fatal()`
    /// on an `anyhow::Result` makes it final, and the original error stays reachable.
    ///
    /// Fix it covers: `JobError: From<E>` for every `E: Into<anyhow::Error>` with the feature on
    /// (`fence/src/job.rs`). Before it this module did not compile: "`?` couldn't convert the
    /// error to `JobError`: the trait `From<anyhow::Error>` is not implemented for `JobError`"
    /// (a plain `impl From<anyhow::Error>` conflicts with the impl for every std error, so the
    /// feature widens that impl instead).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hardening_item13_question_mark_on_anyhow_in_a_handler() {
        let store: Arc<dyn FenceStore> = Arc::new(common::sqlite().await);
        let queue = QueueName::new(common::unique("anyhow")).expect("queue");
        let retrofit = Retrofit::new(Arc::clone(&store), queue.clone(), SupervisorConfig::new(common::lease(10)));
        let missing = format!("/nonexistent/{}/template.txt", common::rand_hex());

        // `?` on anyhow::Error: a retried failure whose message is the chain.
        let key = JobKey::new("plain").expect("key");
        let path = missing.clone();
        let done = retrofit
            .process(&key, Vec::new(), |_ctx| async move {
                let template = load_template(&path)?;
                Ok(template)
            })
            .await;
        let Detail::Ran(Outcome::Failed { error, .. }) = &done.detail else {
            panic!("expected a failed attempt, got {:?}", done.detail);
        };
        assert!(error.starts_with(&format!("loading the template {missing}: No such file")), "{error}");
        let job = store.job(&queue, &key).await.expect("job").expect("row");
        assert_eq!((job.state, job.failures), (JobState::Failed, 1), "retried: {job:?}");

        // `.fatal()` on an anyhow::Result: dead at once.
        let key = JobKey::new("fatal").expect("key");
        let path = missing.clone();
        let done = retrofit
            .process(&key, Vec::new(), |_ctx| async move {
                let template = load_template(&path).fatal()?;
                Ok(template)
            })
            .await;
        assert!(
            matches!(&done.detail, Detail::Ran(Outcome::Dead { error }) if error.starts_with("loading the template")),
            "{:?}",
            done.detail
        );
        let job = store.job(&queue, &key).await.expect("job").expect("row");
        assert_eq!(job.state, JobState::Dead, "{job:?}");

        // `anyhow!` in a handler the consumer runs (the `Handler` bound). (`bail!` returns an
        // `anyhow::Error` itself, not `.into()` one: `return Err(anyhow!(…).into())` instead.)
        fn assert_handler<H: Handler>(_: H) {}
        assert_handler(|ctx: JobContext| async move {
            if ctx.payload().is_empty() {
                return Err(anyhow::anyhow!("empty payload").into());
            }
            let text = std::str::from_utf8(ctx.payload()).context("the payload is not UTF-8")?;
            Ok(text.to_uppercase())
        });

        // The conversion itself: the original error stays reachable, std errors are unchanged.
        let e = JobError::from(load_template(&missing).expect_err("missing file"));
        assert!(e.retry);
        let io = e.source().and_then(|s| s.source()).and_then(|s| s.downcast_ref::<std::io::Error>());
        assert_eq!(io.map(std::io::Error::kind), Some(std::io::ErrorKind::NotFound), "{e:?}");
        assert_eq!(JobError::from(anyhow::anyhow!("upstream 503")).message, "upstream 503");
        let parse = "x".parse::<u32>().expect_err("not a number");
        assert_eq!(JobError::from(parse).message, "invalid digit found in string");
    }
}

mod library_errors {
    use brokerfence::FenceError;

    /// The command-line flags and environment variables of the repository's example programs:
    /// a user's program has none of them.
    const EXAMPLE_SETTINGS: [&str; 3] = ["DATABASE_URL", "REDIS_URL", "SQS_QUEUE_URL"];

    /// Fails when `text`, the Display of a library error, carries an example's flag (`--name`) or
    /// environment variable, or does not name `api`.
    #[track_caller]
    fn names_api_not_example(text: &str, api: &str) {
        assert!(text.contains(api), "should name {api:?}: {text}");
        let flag = text.match_indices("--").find(|(i, _)| {
            text[i + 2..].chars().next().is_some_and(|c| c.is_ascii_lowercase())
                && !text[..*i].ends_with(|c: char| c.is_ascii_alphanumeric())
        });
        assert!(flag.is_none(), "an example's flag in a library error: {text}");
        for var in EXAMPLE_SETTINGS {
            assert!(!text.contains(var), "an example's environment variable {var} in a library error: {text}");
        }
    }

    /// Item 14: the library's errors name the API call or the setting to check, never the
    /// example programs' flags (`--migrate`, `--database-url`, `--redis-url`, `--queue-url`,
    /// `--dead-letter-queue`) or their environment variables (`DATABASE_URL`, `REDIS_URL`,
    /// `SQS_QUEUE_URL`): a user's own program has none of them. (The examples add their flags
    /// to what they print: `hardening_item14_examples_add_their_own_flags`.)
    ///
    /// Fix it covers: the messages of `FenceError::{SchemaTooOld, Unreachable,
    /// ConnectRejected}`, `RedisError::Unreachable` and `SqsError::{NoDeadLetterQueue,
    /// QueueNotFound}`. Before, the first assertion failed with "an example's flag in a library
    /// error: the fence schema is at migration version 0 (0 = no schema) but this build needs
    /// version N: run migrations: `store.migrate()` or the worker's `--migrate` flag".
    #[test]
    fn hardening_item14_library_errors_name_the_api_not_the_examples_flags() {
        let e = FenceError::SchemaTooOld { found: 0, required: 3 };
        names_api_not_example(&e.to_string(), "FenceStore::migrate");
        assert!(e.to_string().contains("run migrations"), "{e}");
        let e = FenceError::Unreachable { host: "db".into(), port: 5432, cause: "connection refused".into() };
        names_api_not_example(&e.to_string(), "the database URL");
        let e = FenceError::ConnectRejected {
            host: "db".into(),
            port: 5432,
            user: "app".into(),
            database: "jobs".into(),
            cause: "password authentication failed".into(),
        };
        names_api_not_example(&e.to_string(), "the database URL");
        #[cfg(feature = "redis")]
        {
            use brokerfence::redis::RedisError;
            let e = RedisError::Unreachable {
                addr: "127.0.0.1:6379".into(),
                source: Box::new(RedisError::Config("connection refused".into())),
            };
            names_api_not_example(&e.to_string(), "the Redis URL");
        }
        #[cfg(feature = "sqs")]
        {
            use brokerfence::sqs::SqsError;
            let e = SqsError::NoDeadLetterQueue {
                queue: "http://sqs/000000000000/orders".into(),
                message_id: "m-1".into(),
                reason: "no job key".into(),
                hidden_secs: 30,
            };
            names_api_not_example(&e.to_string(), "SqsConfig::dead_letter(DeadLetterTarget::Queue(url))");
            assert!(e.to_string().contains("RedrivePolicy"), "{e}");
            let e = SqsError::QueueNotFound {
                queue_url: "http://sqs/000000000000/orders".into(),
                endpoint: "http://sqs".into(),
                region: "us-east-1".into(),
            };
            names_api_not_example(&e.to_string(), "SqsConfig::new");
        }
    }
}

mod programs {
    use brokerfence_testkit::process::{built_example, run_to_end};
    use brokerfence_testkit::store as common;

    /// Item 14, the other half: an example program adds its own flag to the library's message.
    /// `table_worker` on an empty schema without `--migrate` refuses to start (exit 2) with the
    /// library's message (naming `FenceStore::migrate`) and its own flag (`--migrate`); with a
    /// closed PostgreSQL port, the library's "database URL" and its `--database-url`.
    ///
    /// Fix it covers: `examples/support/startup.rs` (`prepare_schema`, `connect_pg`) adding the
    /// flags now that the library no longer carries them. Without it: "table_worker should name
    /// --migrate: table_worker: the fence schema is at migration version 0 … run migrations:
    /// FenceStore::migrate, once per deploy, before workers of this build start".
    #[test]
    fn hardening_item14_examples_add_their_own_flags() {
        let (url, schema) = (common::database_url(), common::unique_schema());
        let args = ["--database-url", &url, "--schema", schema.as_str(), "--queue", "q", "--owner", "item14"];
        let (code, _, err) = run_to_end(&built_example("table_worker"), &args, &[]);
        assert_eq!(code, 2, "table_worker on an empty schema: {err}");
        assert!(err.contains("FenceStore::migrate"), "table_worker should name the library's call: {err}");
        assert!(err.contains("--migrate"), "table_worker should name --migrate: {err}");

        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
        let closed = format!("postgres://postgres@127.0.0.1:{port}/test");
        let args = ["--database-url", &closed, "--queue", "q", "--owner", "item14"];
        let (code, _, err) = run_to_end(&built_example("table_worker"), &args, &[]);
        assert_eq!(code, 1, "table_worker on a closed port: {err}");
        assert!(err.contains("database URL") && err.contains("--database-url"), "table_worker: {err}");
    }

    /// Item 15: a test builds (or finds fresh) the program it runs itself, whatever an earlier
    /// build left in `target/`. The copy cargo puts at `target/<profile>/examples/table_produce`
    /// is deleted (what another build can do to it); the finder still yields a program that
    /// runs (`--help`, exit 0).
    ///
    /// Fix it covers: `brokerfence_testkit::programs` (`process::built_example` and the SQS
    /// finder go through it) runs `cargo build --example NAME --message-format=json` once per
    /// process and program and takes the `executable` cargo reports (cargo puts a missing copy
    /// back). Before, the finder only looked for the copy: "example table_produce not built
    /// (looked at [...]): run cargo test --workspace --all-features".
    #[test]
    fn hardening_item15_a_test_builds_the_program_it_runs() {
        let first = built_example("table_produce");
        std::fs::remove_file(&first).unwrap_or_else(|e| panic!("delete {}: {e}", first.display()));
        let started = std::time::Instant::now();
        let again = built_example("table_produce");
        let took = started.elapsed();
        assert!(again.is_file(), "{} missing after the finder ran", again.display());
        let (code, out, err) = run_to_end(&again, &["--help"], &[]);
        assert_eq!(code, 0, "table_produce --help: {err}");
        assert!(out.starts_with("usage: "), "{out}");
        println!("found again in {took:?} (cargo, everything fresh): {}", again.display());
    }
}

#[cfg(feature = "cli")]
mod small_errors {
    use std::sync::Arc;

    use brokerfence::{Claim, FenceStore, Owner, QueueName, SqliteFence};
    use brokerfence_testkit::process::run_to_end;
    use brokerfence_testkit::store as common;

    /// Runs the CLI to its end: exit code, stdout, stderr (the binary built for this test process
    /// by `brokerfence_testkit::programs`).
    fn cli(args: &[&str]) -> (i32, String, String) {
        run_to_end(&brokerfence_testkit::programs::bin("brokerfence"), args, &[])
    }

    /// Item 16: a bare path where a SQLite URL belongs. The library and the CLI say the URL has
    /// no scheme and how a path is written (`sqlite:PATH`).
    ///
    /// Fix it covers: `FenceError::UnsupportedScheme`'s message for an empty scheme, SQLite's
    /// expected form, the CLI's URL check. Before: "database URL scheme \":\" is not supported:
    /// expected sqlite:PATH or sqlite::memory: (SQLite; for PostgreSQL use PgFence::connect)".
    #[tokio::test]
    async fn hardening_item16_a_bare_sqlite_path_says_it_has_no_scheme() {
        let path = common::sqlite_path();
        let bare = path.display().to_string();
        let e = SqliteFence::open(&bare).await.expect_err("a bare path is not a URL");
        let text = e.to_string();
        assert!(!text.contains("scheme \":\""), "{text}");
        assert!(text.contains("has no scheme") && text.contains("sqlite:PATH"), "{text}");
        assert!(!path.exists(), "nothing was created at {bare}");

        let (code, _, err) = cli(&["--database-url", &bare, "status"]);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains("has no scheme") && err.contains("sqlite:PATH"), "{err}");
        assert!(!err.contains("scheme \"\""), "{err}");
    }

    /// Item 16: a SQLite file in a directory that does not exist. The error names the file and
    /// the missing directory (SQLite creates the file, not its directories).
    ///
    /// Fix it covers: `SqliteFence::open_with` reporting a failed open as
    /// `FenceError::SqliteOpen` with the path. Before: "database error: error returned from
    /// database: (code: 14) unable to open database file", no path.
    #[tokio::test]
    async fn hardening_item16_a_missing_sqlite_directory_is_named() {
        let dir = std::env::temp_dir().join(common::unique("brokerfence-missing-dir"));
        let file = dir.join("jobs.db");
        let url = format!("sqlite:{}", file.display());
        let e = SqliteFence::open(&url).await.expect_err("the directory does not exist");
        let text = e.to_string();
        assert!(text.contains(&file.display().to_string()), "names the file: {text}");
        assert!(text.contains(&format!("directory {} does not exist", dir.display())), "{text}");

        let (code, _, err) = cli(&["--database-url", &url, "migrate"]);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains(&format!("directory {} does not exist", dir.display())), "{err}");
    }

    /// A SQLite database with completed jobs whose results are given; its URL and queue.
    async fn completed(results: &[(&str, &[u8])]) -> (String, QueueName) {
        let path = common::sqlite_path();
        let store: Arc<dyn FenceStore> = Arc::new(common::sqlite_on(&path).await);
        store.migrate().await.expect("migrate");
        let q = QueueName::new(common::unique("results")).expect("queue");
        let me = Owner::new("item16").expect("owner");
        for (k, result) in results {
            assert!(store.enqueue(&q, &common::key(k), b"payload\tbytes").await.expect("enqueue"));
            let lease = match store.claim(&q, &common::key(k), &me, common::lease(10)).await.expect("claim") {
                Claim::Claimed(l) => l,
                other => panic!("{other:?}"),
            };
            store.complete(&lease, result).await.expect("complete");
        }
        (format!("sqlite:{}", path.display()), q)
    }

    /// Item 16: `brokerfence job` shows the result (and the payload), escaped, and a long one
    /// truncated with a note that `--full` shows all of it; `--json` carries the same text.
    ///
    /// Fix it covers: `job_text`/`job_json` in `src/bin/brokerfence/output.rs` and the `--full`
    /// flag. Before: "result      14 bytes" and nothing else ("the result is shown: …").
    #[tokio::test]
    async fn hardening_item16_cli_job_shows_the_result() {
        let long = "x".repeat(1000);
        let (url, q) =
            completed(&[("text", "done\nat \"7\" é".as_bytes()), ("binary", b"\xff\x00ok"), ("long", long.as_bytes())])
                .await;
        let job = |key: &str, more: &[&str]| {
            let mut args = vec!["--database-url", url.as_str(), "job", q.as_str(), key];
            args.extend_from_slice(more);
            let (code, out, err) = cli(&args);
            assert_eq!(code, 0, "job {key}: {err}");
            out
        };
        let out = job("text", &[]);
        assert!(out.contains(r#"result      14 bytes: "done\nat \"7\" é""#), "the result is shown: {out}");
        assert!(out.contains(r#"payload     13 bytes: "payload\tbytes""#), "the payload is shown: {out}");
        let out = job("binary", &[]);
        assert!(out.contains(r#"result      4 bytes: b"\xff\x00ok""#), "{out}");
        let out = job("long", &[]);
        let line = out.lines().find(|l| l.starts_with("result")).expect("a result line");
        assert!(line.len() < 300, "a long result is truncated: {line}");
        assert!(line.contains("1000 bytes") && line.contains("…") && line.contains("--full"), "{line}");
        let out = job("long", &["--full"]);
        assert!(out.contains(&format!("result      1000 bytes: \"{long}\"")), "--full shows it all: {out}");
        let out = job("long", &["--json"]);
        let json: serde_json::Value = serde_json::from_str(&out).expect("JSON");
        assert_eq!(json["result_bytes"], 1000);
        assert_eq!(json["result_truncated"], true, "{json}");
        assert!(json["result"].as_str().is_some_and(|r| r.starts_with("\"xxxx") && r.len() < 300), "{json}");
    }

    /// Item 16: a mistyped `--schema` says there is no such schema, not to run the worker's
    /// `--migrate`.
    ///
    /// Fix it covers: the CLI's reading of `SchemaTooOld { found: 0 }` (no migration recorded
    /// under that name). Before: "the fence schema is at migration version 0 (0 = no schema) but
    /// this build needs version 10: run migrations: `store.migrate()` or the worker's
    /// `--migrate` flag; with this tool: `brokerfence migrate`".
    #[tokio::test]
    async fn hardening_item16_a_mistyped_schema_says_no_such_schema() {
        let store = common::pg().await;
        let typo = format!("{}x", store.get_schema().as_str());
        let url = common::database_url();
        let (code, _, err) = cli(&["--database-url", &url, "--schema", &typo, "status"]);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains(&format!("no such schema {typo}")), "{err}");
        assert!(!err.contains("--migrate"), "{err}");
        // The right one works.
        let (code, _, err) = cli(&["--database-url", &url, "--schema", store.get_schema().as_str(), "status"]);
        assert_eq!(code, 0, "{err}");
        common::drop_schema(&store).await;
    }
}
