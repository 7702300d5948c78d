//! Issue #15, "Clear errors": what a new user sees when a service is missing or a URL is wrong.
//! Each test provokes the error for real (a closed port: a listener bound and dropped; the real
//! PostgreSQL, Redis and SQS endpoint; the example binaries run as processes) and checks the
//! message: the address, the cause, what to check, one readable line, in good time.
//!
//! Run them all with `cargo test --workspace --all-features onboarding`.

use brokerfence_testkit::process::{built_example, run_to_end};
#[cfg(feature = "sqs")]
use brokerfence_testkit::sqs as sqs_support;
use brokerfence_testkit::store as common;

use std::time::{Duration, Instant};

use brokerfence::{FenceError, PgFence, SqliteFence};

/// A TCP port on 127.0.0.1 where nothing listens: bound, then closed.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    let port = listener.local_addr().expect("local addr").port();
    drop(listener);
    port
}

/// Runs an example to its end (at most 60 s): exit code, stdout, stderr.
fn run_example(name: &str, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    run_to_end(&built_example(name), args, env)
}

/// The one line of `text` that contains `needle`.
fn line_with<'a>(text: &'a str, needle: &str) -> &'a str {
    let lines: Vec<&str> = text.lines().filter(|l| l.contains(needle)).collect();
    assert_eq!(lines.len(), 1, "expected one line with {needle:?} in:\n{text}");
    lines[0]
}

// ------------------------------------------------------------------------------------ PostgreSQL

/// Old: "pool timed out while waiting for an open connection" after 10 s, no host, port or cause.
#[tokio::test]
async fn onboarding_unreachable_postgres_names_host_port_and_cause_at_once() {
    let port = closed_port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/test");
    let started = Instant::now();
    let err = PgFence::connect(&url).await.expect_err("nothing listens there");
    let took = started.elapsed();
    let text = err.to_string();
    println!("after {took:?}: {text}");
    assert!(
        matches!(&err, FenceError::Unreachable { host, port: p, .. } if host == "127.0.0.1" && *p == port),
        "{err:?}"
    );
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    assert!(text.contains("refused"), "{text}");
    // The setting to check, not an example's variable (issue #30 item 14).
    assert!(text.contains("PostgreSQL is running") && text.contains("the database URL"), "{text}");
    assert!(took < Duration::from_secs(2), "took {took:?}; the pool's acquire timeout is 10 s");
}

/// The server answers but has no such database: its own message, with host, port, user and database.
#[tokio::test]
async fn onboarding_missing_postgres_database_is_named() {
    let base: sqlx::postgres::PgConnectOptions = common::database_url().parse().expect("DATABASE_URL");
    let options = base.clone().database("onboarding_no_such_database");
    let err = PgFence::connect_with(options).await.expect_err("no such database");
    let text = err.to_string();
    println!("{text}");
    assert!(matches!(err, FenceError::ConnectRejected { .. }), "{err:?}");
    assert!(text.contains(&format!("{}:{}", base.get_host(), base.get_port())), "{text}");
    assert!(text.contains("onboarding_no_such_database") && text.contains("does not exist"), "{text}");
}

/// Old: a `mysql://` URL was accepted and failed later as a missing role.
#[tokio::test]
async fn onboarding_a_mysql_url_is_refused_at_once() {
    let url = format!("mysql://root@127.0.0.1:{}/jobs", closed_port());
    let started = Instant::now();
    for err in [
        PgFence::connect(&url).await.expect_err("not PostgreSQL"),
        SqliteFence::open(&url).await.expect_err("not SQLite"),
    ] {
        let text = err.to_string();
        println!("{text}");
        assert!(matches!(&err, FenceError::UnsupportedScheme { scheme, .. } if scheme == "mysql"), "{err:?}");
        assert!(text.contains("\"mysql:\"") && text.contains("expected"), "{text}");
    }
    assert!(started.elapsed() < Duration::from_millis(500), "{:?}", started.elapsed());
    // A plain path is no SQLite URL either (sqlx would have made it a file name).
    let err = SqliteFence::open("jobs.db").await.expect_err("no scheme");
    assert!(matches!(err, FenceError::UnsupportedScheme { .. }), "{err:?}");
}

/// The examples refuse it too (exit 2, one line naming the scheme), before connecting anywhere.
#[test]
fn onboarding_examples_refuse_a_mysql_database_url() {
    let url = format!("mysql://root@127.0.0.1:{}/jobs", closed_port());
    for (name, args) in [
        ("table_worker", vec!["--queue", "q", "--database-url", url.as_str()]),
        ("table_produce", vec!["--queue", "q", "--database-url", url.as_str()]),
        ("zombie_worker", vec!["--database-url", url.as_str()]),
    ] {
        let (code, out, err) = run_example(name, &args, &[]);
        assert_eq!(code, 2, "{name}: exit {code}; stderr: {err}");
        let line = line_with(&err, "scheme");
        assert!(line.contains("\"mysql:\"") && line.contains("postgres://"), "{name}: {line}");
        // (zombie_worker prints `ready` when its process starts, before it opens the database.)
        assert!(name == "zombie_worker" || !out.contains("EVENT ready"), "{name}: {out}");
        assert!(!out.contains("EVENT claimed"), "{name}: {out}");
    }
}

/// A worker on a closed PostgreSQL port: exit 1 at once with the address and the cause.
#[test]
fn onboarding_worker_on_a_closed_postgres_port_says_where_and_why() {
    let url = format!("postgres://postgres@127.0.0.1:{}/test", closed_port());
    let started = Instant::now();
    let (code, out, err) = run_example("table_worker", &["--queue", "q", "--database-url", &url], &[]);
    assert_eq!(code, 1, "exit {code}; stderr: {err}");
    let line = line_with(&err, "cannot connect to PostgreSQL");
    assert!(line.contains("127.0.0.1:") && line.contains("refused"), "{line}");
    assert!(!out.contains("EVENT ready"), "{out}");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
}

// ----------------------------------------------------------------------------------------- Redis

/// Old: the error named no address.
#[cfg(feature = "redis")]
#[tokio::test]
async fn onboarding_redis_on_a_closed_port_names_the_address() {
    use brokerfence::redis::{RedisConnections, RedisError};
    let port = closed_port();
    let err = RedisConnections::connect(&format!("redis://127.0.0.1:{port}")).await.expect_err("nothing listens");
    let text = err.to_string();
    println!("{text}");
    assert!(matches!(err, RedisError::Unreachable { .. }), "{err:?}");
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    assert!(text.to_lowercase().contains("refused"), "{text}");
    assert!(text.contains("the Redis URL"), "{text}");
}

/// Old: `http://` said only `InvalidClientConfig`.
#[cfg(feature = "redis")]
#[tokio::test]
async fn onboarding_a_non_redis_url_is_refused_naming_scheme_and_form() {
    use brokerfence::redis::{RedisConnections, RedisError};
    let err = RedisConnections::connect("http://127.0.0.1:6379").await.expect_err("not Redis");
    let text = err.to_string();
    println!("{text}");
    assert!(matches!(&err, RedisError::UnsupportedScheme { scheme } if scheme == "http"), "{err:?}");
    assert!(text.contains("\"http:\"") && text.contains("redis://") && text.contains("rediss://"), "{text}");
    assert!(err.is_fatal());
    // And through the examples: exit 2, one line.
    let (code, _, err) = run_example("redis_produce", &["--stream", "s", "--redis-url", "http://127.0.0.1:6379"], &[]);
    assert_eq!(code, 2, "stderr: {err}");
    line_with(&err, "unsupported Redis URL scheme \"http:\"");
    let port = closed_port();
    let url = format!("redis://127.0.0.1:{port}");
    let (code, _, err) = run_example("redis_produce", &["--stream", "s", "--redis-url", &url], &[]);
    assert_eq!(code, 1, "stderr: {err}");
    line_with(&err, &format!("cannot connect to Redis at 127.0.0.1:{port}"));
}

// ------------------------------------------------------------------------------------------- SQS

/// The environment of an SQS worker at `endpoint` (credentials and region of the test setup).
#[cfg(feature = "sqs")]
fn sqs_env(endpoint: &str) -> Vec<(&'static str, String)> {
    let aws = sqs_support::aws();
    vec![
        ("AWS_ENDPOINT_URL_SQS", endpoint.to_owned()),
        ("AWS_REGION", aws.region.clone()),
        ("AWS_ACCESS_KEY_ID", aws.key_id.clone()),
        ("AWS_SECRET_ACCESS_KEY", aws.secret.clone()),
        ("RUST_LOG", "info".to_owned()),
    ]
}

/// Old: `EVENT ready`, then a 2 KB Debug dump of the HTTP response on every receive.
#[cfg(feature = "sqs")]
#[test]
fn onboarding_sqs_worker_on_a_missing_queue_stops_before_ready_naming_it() {
    let aws = sqs_support::aws();
    let queue_url = format!("{}/000000000000/onboarding-missing-{}", aws.endpoint, std::process::id());
    let env = sqs_env(&aws.endpoint);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (db, schema) = (common::database_url(), common::unique_schema());
    // A schema of its own: CI runs as a plain role that may not create in the default one.
    let args = ["--queue-url", &queue_url, "--database-url", &db, "--schema", schema.as_str(), "--migrate"];
    let (code, out, err) = run_example("sqs_worker", &args, &env);
    println!("exit {code}\nstdout:\n{out}\nstderr:\n{err}");
    assert_ne!(code, 0, "{err}");
    assert!(!out.contains("EVENT ready"), "{out}");
    let line = line_with(&err, "does not exist");
    assert!(line.contains(&queue_url), "{line}");
    assert!(line.len() < 400, "{} characters: {line}", line.len());
    assert!(!err.contains("HttpResponse") && !err.contains("Response {"), "a Debug dump: {err}");
}

/// Old: WARN lines of about 600 characters, for ever.
#[cfg(feature = "sqs")]
#[test]
fn onboarding_sqs_worker_on_a_closed_endpoint_retries_briefly_then_exits() {
    let port = closed_port();
    let endpoint = format!("http://127.0.0.1:{port}");
    let queue_url = format!("{endpoint}/000000000000/onboarding-closed");
    let env = sqs_env(&endpoint);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let (db, schema) = (common::database_url(), common::unique_schema());
    let args = ["--queue-url", &queue_url, "--database-url", &db, "--schema", schema.as_str(), "--migrate"];
    let started = Instant::now();
    let (code, out, err) = run_example("sqs_worker", &args, &env);
    let took = started.elapsed();
    println!("exit {code} after {took:?}\nstdout:\n{out}\nstderr:\n{err}");
    assert_eq!(code, 1, "{err}");
    assert!(!out.contains("EVENT ready"), "{out}");
    let attempts = brokerfence::sqs::CHECK_ATTEMPTS;
    for n in 1..attempts {
        let line = line_with(&err, &format!("attempt {n} of {attempts}"));
        assert!(line.contains(&endpoint) && line.contains("refused"), "{line}");
        assert!(line.len() < 300, "{} characters: {line}", line.len());
    }
    let last = line_with(&err, "cannot reach SQS");
    assert!(last.contains(&endpoint) && last.contains(&format!("after {attempts} attempts")), "{last}");
    assert!(last.contains("refused") && last.contains("AWS_ENDPOINT_URL_SQS"), "{last}");
    assert!(last.len() < 400, "{} characters: {last}", last.len());
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

// ------------------------------------------------------------------------------- example flags

/// Every example the build has. The harness programs (`chaos`, `bench`, `bench_sqs`,
/// `bench_redis`, `soak`) are binaries of the `brokerfence-bench` member now: the same two checks
/// run on them in `bench/tests/onboarding.rs`, on the binaries cargo builds for that test.
fn all_examples() -> Vec<&'static str> {
    let mut v = vec!["table_worker", "table_produce", "zombie", "zombie_worker"];
    if cfg!(feature = "sqs") {
        v.extend(["sqs_worker", "sqs_produce"]);
    }
    if cfg!(feature = "redis") {
        v.extend(["redis_worker", "redis_produce"]);
    }
    if cfg!(all(feature = "sqs", feature = "redis")) {
        v.push("outbox_relay");
    }
    if cfg!(feature = "tower") {
        v.push("tower_worker");
    }
    v
}

/// Old: `--help` exited 2 in some workers, and `bench --help` said "--help needs a value".
#[test]
fn onboarding_every_example_answers_help_with_exit_0() {
    for name in all_examples() {
        let (code, out, err) = run_example(name, &["--help"], &[]);
        assert_eq!(code, 0, "{name} --help: exit {code}; stderr: {err}");
        assert!(out.starts_with("usage: "), "{name} --help: {out:?}");
        assert!(out.contains("--help"), "{name} --help lists no flags: {out}");
        assert!(err.is_empty(), "{name} --help wrote to stderr: {err}");
    }
}

/// An unknown flag: clap's message naming it, exit 2, nothing on stdout.
#[test]
fn onboarding_every_example_refuses_an_unknown_flag_with_exit_2() {
    for name in all_examples() {
        let (code, out, err) = run_example(name, &["--no-such-flag"], &[]);
        assert_eq!(code, 2, "{name} --no-such-flag: exit {code}; stderr: {err}");
        assert!(err.contains("unexpected argument '--no-such-flag'"), "{name}: {err}");
        assert!(out.is_empty(), "{name} printed on stdout: {out}");
    }
}
