//! Credentials never appear in logs, nor in `Debug`/`Display` of configurations, stores, consumers
//! or errors; and the TLS options of PostgreSQL (rustls) behave: `sslmode=require` against a
//! server without TLS is a clear typed error, `prefer` and `disable` connect.
//!
//! Every test here runs with a process-wide `tracing` subscriber at TRACE level that writes into a
//! buffer; each test then asserts that its secret is nowhere in what was logged.
//!
//! PostgreSQL connections from 127.0.0.1 are trust-authenticated here, so any password is
//! accepted: the tests give a fresh role a password and connect with it in the URL.

use brokerfence_testkit::store as common;

use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use brokerfence::TableQueue;
use brokerfence::ledger::PgLedger;
use brokerfence::{
    Claim, FenceError, FenceStore, JobContext, JobError, JobKey, LeaseDuration, Owner, PgFence, QueueName, RetryPolicy,
    SchemaName, SupervisorConfig,
};
use brokerfence::{Consumer, ConsumerConfig, Retrofit};
use sqlx::postgres::{PgConnectOptions, PgSslMode};
use sqlx::{AssertSqlSafe, ConnectOptions};
use tokio_util::sync::CancellationToken;

// ------------------------------------------------------------------------------------------------
// Capturing every log line of the process
// ------------------------------------------------------------------------------------------------

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The process-wide capture: everything at TRACE level, from every crate.
fn capture() -> &'static Capture {
    static CAPTURE: OnceLock<Capture> = OnceLock::new();
    CAPTURE.get_or_init(|| {
        let capture = Capture::default();
        let writer = capture.clone();
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new("trace"))
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .init();
        capture
    })
}

fn logged() -> String {
    String::from_utf8_lossy(&capture().0.lock().unwrap_or_else(|p| p.into_inner())).into_owned()
}

/// A secret unlike anything else in the process.
fn secret() -> String {
    format!("Pw{:016x}x", rand::random::<u64>())
}

fn assert_absent(secret: &str, what: &str, text: &str) {
    assert!(!text.contains(secret), "the secret appears in {what}:\n{}", excerpt(text, secret));
}

fn excerpt(text: &str, secret: &str) -> String {
    let at = text.find(secret).unwrap_or(0);
    let start = text[..at].char_indices().rev().nth(200).map(|(i, _)| i).unwrap_or(0);
    text[start..].chars().take(400).collect()
}

// ------------------------------------------------------------------------------------------------
// PostgreSQL
// ------------------------------------------------------------------------------------------------

struct PgRole {
    admin: PgFence,
    name: String,
    base: PgConnectOptions,
}

impl PgRole {
    /// A fresh role with `password` and the fence's privileges on `schema`, which the connecting
    /// (admin) user creates and migrates. Works for a superuser and for a `CREATEROLE` admin.
    async fn create(password: &str, schema: &SchemaName) -> Self {
        // The admin's own statements carry the password as a literal: they are not logged.
        let quiet: PgConnectOptions = common::database_url().parse().expect("DATABASE_URL");
        let admin = PgFence::connect_with(quiet.disable_statement_logging())
            .await
            .expect("connect as admin")
            .schema(schema.clone());
        admin.migrate().await.expect("migrate as admin");
        let name = format!("bf_secret_{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
        let s = schema.as_str();
        for sql in [
            format!("CREATE ROLE {name} LOGIN PASSWORD '{password}'"),
            format!("GRANT USAGE ON SCHEMA {s} TO {name}"),
            format!("GRANT SELECT, INSERT, UPDATE ON {s}.jobs, {s}.ledger TO {name}"),
        ] {
            sqlx::query(AssertSqlSafe(sql)).execute(admin.pool()).await.expect("create role");
        }
        let base: PgConnectOptions = common::database_url().parse().expect("DATABASE_URL");
        Self { admin, name, base }
    }

    /// `postgres://role:password@host:port/db` (+ `?extra`).
    fn url(&self, password: &str, extra: &str) -> String {
        let db = self.base.get_database().unwrap_or("postgres");
        let (host, port) = (self.base.get_host(), self.base.get_port());
        format!("postgres://{}:{password}@{host}:{port}/{db}{extra}", self.name)
    }

    async fn drop(self) {
        let pool = self.admin.pool();
        let s = self.admin.get_schema().as_str();
        for sql in [format!("DROP SCHEMA IF EXISTS {s} CASCADE"), format!("DROP ROLE IF EXISTS {}", self.name)] {
            let _ = sqlx::query(AssertSqlSafe(sql)).execute(pool).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_credentials_never_appear_in_logs_debug_or_errors() {
    capture();
    let secret = secret();
    let schema = common::unique_schema();
    let role = PgRole::create(&secret, &schema).await;
    let url = role.url(&secret, "");

    let fence = PgFence::connect(&url).await.expect("connect with a password URL").schema(schema.clone());
    let outcome =
        futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(exercise(&fence, &secret, &role))).await;
    role.drop().await;
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
    let log = logged();
    assert!(log.contains("applied migration"), "the capture works (it saw the migration)");
    assert!(log.contains("SELECT") || log.contains("INSERT"), "the capture sees sqlx's statement logs");
    assert_absent(&secret, "the tracing output", &log);
}

/// A run with everything that logs: migrations, a consumer with completions, a retry, a dead
/// letter, a fenced commit, a lost lease, the retrofit path, the ledger; then connection errors
/// that carry the URL.
async fn exercise(fence: &PgFence, secret: &str, role: &PgRole) {
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    let q = QueueName::new("secrets").expect("queue");
    let jobs: Vec<(JobKey, Vec<u8>)> =
        ["ok-1", "ok-2", "retry", "fatal"].iter().map(|k| (JobKey::new(*k).expect("key"), b"x".to_vec())).collect();
    store.enqueue_many(&q, &jobs).await.expect("enqueue");
    let retry = RetryPolicy {
        max_attempts: 2,
        base_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(50),
    };
    let config = ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(3).expect("lease")).retry(retry))
        .grace(Duration::from_secs(1));
    let consumer = Consumer::new(
        TableQueue::new(Arc::clone(&store), q.clone()).idle_wait(Duration::from_millis(20)),
        Arc::clone(&store),
        config,
    );
    let metrics = consumer.metrics();
    let debug_consumer = format!("{consumer:?} {:?} {:?}", consumer.supervisor(), consumer.source());
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let stop = stop.clone();
        async move {
            consumer
                .run(
                    |ctx: JobContext| async move {
                        match ctx.key().as_str() {
                            "retry" => Err(JobError::retry("transient")),
                            "fatal" => Err(JobError::fatal("bad body")),
                            _ => Ok(b"done".to_vec()),
                        }
                    },
                    stop,
                )
                .await
        }
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !(metrics.snapshot().completions == 2 && metrics.snapshot().dead_letters == 2) {
        assert!(tokio::time::Instant::now() < deadline, "{}", metrics.snapshot());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    run.await.expect("join").expect("run");

    // A fenced commit and a lost lease, logged with their details.
    let k = JobKey::new("fenced").expect("key");
    let lease = LeaseDuration::from_secs(3).expect("lease");
    let Claim::Claimed(old) = store.claim(&q, &k, &Owner::unique("a"), lease).await.expect("claim") else { panic!() };
    sqlx::query(AssertSqlSafe(format!(
        "UPDATE {}.jobs SET lease_until = clock_timestamp() - interval '1 second' WHERE key = 'fenced'",
        fence.get_schema().as_str()
    )))
    .execute(fence.pool())
    .await
    .expect("expire");
    let Claim::Claimed(_new) = store.claim(&q, &k, &Owner::unique("b"), lease).await.expect("claim") else { panic!() };
    let fenced = store.complete(&old, b"late").await.expect_err("fenced");
    assert!(fenced.is_fenced());
    let retrofit = Retrofit::new(Arc::clone(&store), q.clone(), SupervisorConfig::new(lease));
    let done = retrofit
        .process(&JobKey::new("retrofit").expect("key"), b"x".to_vec(), |_ctx: JobContext| async { Ok(Vec::new()) })
        .await;
    assert!(done.should_ack());
    let ledger = PgLedger::new(fence, "receiver");
    ledger.accept("fenced", 2).await.expect("ledger");
    ledger.accept("fenced", 1).await.expect("ledger");

    // Connection failures with the secret in the URL: neither Display nor Debug of the error shows it.
    let base = role.url(secret, "");
    let wrong_port = base.replace(&format!(":{}/", role.base.get_port()), ":1/");
    let wrong_db = format!("{}_nope", base);
    let bad_port = base.replace(&format!(":{}/", role.base.get_port()), ":notaport/");
    let mut errors = vec![format!("{fenced} {fenced:?}")];
    for url in [wrong_port, wrong_db, bad_port, format!("{base}?sslmode=verify-full"), format!("{base}?sslmode=bogus")]
    {
        let started = tokio::time::Instant::now();
        match tokio::time::timeout(Duration::from_secs(30), PgFence::connect(&url)).await {
            Ok(Ok(_)) => panic!("connecting to {url:?} should fail"),
            Ok(Err(e)) => errors.push(format!("{e} | {e:?}")),
            Err(_) => panic!("connecting to a broken URL hung for {:?}", started.elapsed()),
        }
    }
    // Debug of everything a user might log.
    let options: PgConnectOptions = base.parse().expect("options");
    let with_options = PgFence::connect_with(options.clone()).await.expect("connect_with");
    let debug = format!(
        "{fence:?} {:?} {with_options:?} {:?} {debug_consumer} {retrofit:?} {ledger:?}",
        fence.pool(),
        with_options.pool()
    );
    assert!(debug.contains("PgFence"), "{debug}");
    assert_absent(secret, "Debug of the fence, pools, consumer, supervisor, retrofit or ledger", &debug);
    for e in &errors {
        assert_absent(secret, "a connection error", e);
    }
    // sqlx's own PgConnectOptions prints the password in Debug: never log it (documented on
    // PgFence::connect_with). Kept here so a change in sqlx is noticed either way.
    let raw = format!("{options:?}");
    if raw.contains(secret) {
        eprintln!("note: sqlx::postgres::PgConnectOptions's Debug shows the password; brokerfence never logs it");
    }
}

// ------------------------------------------------------------------------------------------------
// TLS options (rustls)
// ------------------------------------------------------------------------------------------------

/// A PostgreSQL "without TLS" in front of the real one: it answers `N` to the SSLRequest (as a
/// server with `ssl = off` does) and then relays the plain connection.
async fn no_tls_proxy(upstream: String) -> std::net::SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            let upstream = upstream.clone();
            tokio::spawn(async move {
                let mut first = [0u8; 8];
                if client.read_exact(&mut first).await.is_err() {
                    return;
                }
                let Ok(mut server) = tokio::net::TcpStream::connect(&upstream).await else { return };
                if first == SSL_REQUEST {
                    if client.write_all(b"N").await.is_err() {
                        return;
                    }
                } else if server.write_all(&first).await.is_err() {
                    return;
                }
                let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
            });
        }
    });
    addr
}

/// A TLS failure as sqlx reports it: `Error::Tls` for a refused or impossible upgrade, an I/O
/// error of kind `InvalidData` from rustls for a certificate that does not verify.
fn is_tls_error(e: &FenceError) -> bool {
    match e {
        FenceError::Database(sqlx::Error::Tls(_)) => true,
        FenceError::Database(sqlx::Error::Io(io)) => {
            io.kind() == std::io::ErrorKind::InvalidData && e.to_string().to_lowercase().contains("certificate")
        }
        _ => false,
    }
}

async fn uses_tls(fence: &PgFence) -> bool {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(fence.pool())
        .await
        .expect("pg_stat_ssl")
}

async fn works(fence: PgFence) -> bool {
    let fence = fence.schema(common::unique_schema());
    fence.migrate().await.expect("migrate");
    let q = QueueName::new("tls").expect("queue");
    assert!(fence.enqueue(&q, &JobKey::new("k").expect("key"), b"x").await.expect("enqueue"));
    let tls = uses_tls(&fence).await;
    let _ = sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {} CASCADE", fence.get_schema().as_str())))
        .execute(fence.pool())
        .await;
    tls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_require_against_a_server_without_tls_is_a_typed_error_prefer_and_disable_work() {
    capture();
    let real: PgConnectOptions = common::database_url().parse().expect("DATABASE_URL");
    let proxy = no_tls_proxy(format!("{}:{}", real.get_host(), real.get_port())).await;
    let options = real.clone().host(&proxy.ip().to_string()).port(proxy.port());

    for mode in [PgSslMode::Require, PgSslMode::VerifyCa, PgSslMode::VerifyFull] {
        let started = std::time::Instant::now();
        let err = PgFence::connect_with(options.clone().ssl_mode(mode)).await.expect_err("TLS is required");
        assert!(is_tls_error(&err), "{mode:?}: expected a typed TLS error, got {err:?}");
        let text = err.to_string();
        #[cfg(feature = "tls")]
        assert!(text.contains("server does not support TLS"), "{mode:?}: {text}");
        #[cfg(not(feature = "tls"))]
        assert!(text.contains("without TLS support"), "{mode:?}: {text}");
        assert!(started.elapsed() < Duration::from_secs(5), "{mode:?}: fails at once, not after retries");
    }
    // The same through the URL.
    let url = format!(
        "postgres://{}@{proxy}/{}?sslmode=require",
        real.get_username(),
        real.get_database().unwrap_or("postgres")
    );
    let err = PgFence::connect(&url).await.expect_err("sslmode=require");
    assert!(is_tls_error(&err), "{err:?}");

    for mode in [PgSslMode::Prefer, PgSslMode::Allow, PgSslMode::Disable] {
        let fence = PgFence::connect_with(options.clone().ssl_mode(mode))
            .await
            .unwrap_or_else(|e| panic!("{mode:?} connects without TLS: {e}"));
        assert!(!works(fence).await, "{mode:?}: plain connection");
    }
}

/// Against the local server itself (which, on these machines, offers TLS with a self-signed
/// certificate): with the `tls` feature, `require` encrypts, `prefer` encrypts, `disable` does not,
/// and `verify-full` refuses the untrusted certificate with a typed error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_modes_against_the_local_server() {
    capture();
    let options: PgConnectOptions = common::database_url().parse().expect("DATABASE_URL");
    let admin = common::pg_unmigrated().await;
    let ssl: String = sqlx::query_scalar("SHOW ssl").fetch_one(admin.pool()).await.expect("show ssl");
    if ssl != "on" {
        println!("the local PostgreSQL has ssl = {ssl}: covered by the proxy test only");
        return;
    }
    assert!(!works(PgFence::connect_with(options.clone().ssl_mode(PgSslMode::Disable)).await.expect("disable")).await);
    #[cfg(feature = "tls")]
    {
        assert!(
            works(PgFence::connect_with(options.clone().ssl_mode(PgSslMode::Require)).await.expect("require")).await
        );
        assert!(works(PgFence::connect_with(options.clone().ssl_mode(PgSslMode::Prefer)).await.expect("prefer")).await);
        let err = PgFence::connect_with(options.clone().ssl_mode(PgSslMode::VerifyFull))
            .await
            .expect_err("a self-signed certificate is not trusted");
        assert!(is_tls_error(&err), "{err:?}");
    }
    #[cfg(not(feature = "tls"))]
    {
        let err =
            PgFence::connect_with(options.clone().ssl_mode(PgSslMode::Require)).await.expect_err("no TLS built in");
        assert!(is_tls_error(&err) && err.to_string().contains("without TLS support"), "{err:?}");
        assert!(
            !works(PgFence::connect_with(options.clone().ssl_mode(PgSslMode::Prefer)).await.expect("prefer")).await
        );
    }
}

// ------------------------------------------------------------------------------------------------
// SQS (feature `sqs`): the AWS secret key
// ------------------------------------------------------------------------------------------------

/// A consumer (3 s lease) whose handler returns its payload, running until the token fires.
#[cfg(any(feature = "sqs", feature = "redis"))]
fn echo_consumer<S: brokerfence::Source>(
    source: S,
    store: Arc<dyn FenceStore>,
) -> (Arc<brokerfence::Metrics>, CancellationToken, tokio::task::JoinHandle<Result<(), brokerfence::SourceError>>) {
    let consumer = Consumer::new(
        source,
        store,
        ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(3).expect("lease"))),
    );
    let metrics = consumer.metrics();
    let stop = CancellationToken::new();
    let run = tokio::spawn({
        let stop = stop.clone();
        async move { consumer.run(|ctx: JobContext| async move { Ok(ctx.payload().to_vec()) }, stop).await }
    });
    (metrics, stop, run)
}

#[cfg(feature = "sqs")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aws_secret_key_never_appears_in_logs_or_debug() {
    use brokerfence::sqs::aws_sdk_sqs::Client;
    use brokerfence::sqs::aws_sdk_sqs::config::Credentials;
    use brokerfence::sqs::{KeyStrategy, SqsConfig, SqsRetrofit, SqsSource, aws_config, http_client};
    capture();
    let secret = secret();
    // LocalStack accepts any secret key; the access key id is LocalStack's account.
    let id = brokerfence_testkit::services::var("AWS_ACCESS_KEY_ID").unwrap_or_else(|| "test".into());
    let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest())
        .http_client(http_client())
        .credentials_provider(Credentials::new(id, secret.clone(), Some(format!("session-{secret}")), None, "test"))
        .region(aws_config::Region::new(
            brokerfence_testkit::services::var("AWS_REGION").unwrap_or_else(|| "us-east-1".into()),
        ));
    if let Some(endpoint) = brokerfence_testkit::services::var("AWS_ENDPOINT_URL_SQS") {
        loader = loader.endpoint_url(endpoint);
    }
    let sdk = loader.load().await;
    let client = Client::new(&sdk);
    let name = common::unique("secrets");
    let url = client
        .create_queue()
        .queue_name(&name)
        .send()
        .await
        .expect("CreateQueue (run `bash localstack/up`)")
        .queue_url()
        .expect("url")
        .to_owned();
    for i in 0..3 {
        client.send_message().queue_url(&url).message_body(format!("m{i}")).send().await.expect("send");
    }
    let fence = common::pg().await;
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    let config =
        SqsConfig::new(url.clone()).expect("config").key(KeyStrategy::MessageId).wait_time(Duration::from_secs(1));
    let source = SqsSource::new(client.clone(), config.clone());
    let debug = format!("{sdk:?} {client:?} {config:?} {source:?}");
    let (metrics, stop, run) = echo_consumer(source, Arc::clone(&store));
    brokerfence_testkit::wait::wait_for_completions(&metrics, 3, Duration::from_secs(30)).await;
    stop.cancel();
    run.await.expect("join").expect("run");
    let retrofit = SqsRetrofit::new(
        Arc::clone(&store),
        SqsSource::new(client.clone(), config),
        SupervisorConfig::new(LeaseDuration::from_secs(3).expect("lease")),
    );
    let debug = format!("{debug} {retrofit:?}");
    let _ = client.delete_queue().queue_url(&url).send().await;
    let _ = sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {} CASCADE", fence.get_schema().as_str())))
        .execute(fence.pool())
        .await;
    assert_absent(&secret, "Debug of the SDK config, client, SqsConfig, SqsSource or SqsRetrofit", &debug);
    let log = logged();
    assert!(log.contains("ReceiveMessage") || log.contains("receive_message"), "the capture sees the SDK's logs");
    assert_absent(&secret, "the tracing output of an SQS run", &log);
}

// ------------------------------------------------------------------------------------------------
// Redis (feature `redis`): a password-protected private redis-server
// ------------------------------------------------------------------------------------------------

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_password_never_appears_in_logs_debug_or_errors() {
    use brokerfence::redis::client as redis;
    use brokerfence::redis::{KeyFrom, LeaseKeys, RedisConnections, StreamSource};
    capture();
    let secret = secret();
    let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
    let mut server = tokio::process::Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .args(["--requirepass", &secret, "--daemonize", "no", "--loglevel", "warning"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn redis-server (run `bash localstack/up` to install it)");
    let url = format!("redis://:{secret}@127.0.0.1:{port}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let conns = loop {
        match RedisConnections::connect(&url).await {
            Ok(c) => break c,
            Err(e) => {
                assert!(tokio::time::Instant::now() < deadline, "private redis-server did not answer: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let client = redis::Client::open(url.as_str()).expect("client");
    let mut conn = client.get_multiplexed_async_connection().await.expect("connect");
    for i in 0..3 {
        let _: String = redis::cmd("XADD")
            .arg("orders")
            .arg("*")
            .arg("key")
            .arg(format!("k{i}"))
            .arg("body")
            .arg("x")
            .query_async(&mut conn)
            .await
            .expect("xadd");
    }
    let fence = common::pg().await;
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    let source = StreamSource::new(conns.clone(), QueueName::new("orders").expect("queue"), "orders", "g")
        .expect("source")
        .key_from(KeyFrom::Field("key".into()))
        .block(Duration::from_millis(200));
    let mut debug = format!("{client:?} {conns:?} {source:?} {:?}", LeaseKeys::new(conns.commands(), "orders"));
    let (metrics, stop, run) = echo_consumer(source, Arc::clone(&store));
    brokerfence_testkit::wait::wait_for_completions(&metrics, 3, Duration::from_secs(20)).await;
    // The server goes away mid-run: reconnect attempts log errors, none with the password.
    let _ = server.start_kill();
    let _ = server.wait().await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    stop.cancel();
    let _ = run.await.expect("join");
    // A wrong password and an unreachable server: the errors name neither password.
    let wrong = secret.replace("Pw", "Wr");
    for bad in [format!("redis://:{wrong}@127.0.0.1:{port}"), format!("redis://:{secret}@127.0.0.1:1")] {
        match tokio::time::timeout(Duration::from_secs(20), RedisConnections::connect(&bad)).await {
            Ok(Ok(_)) => panic!("connecting to a dead server should fail"),
            Ok(Err(e)) => debug.push_str(&format!(" {e} {e:?}")),
            Err(_) => {}
        }
    }
    let _ = sqlx::query(AssertSqlSafe(format!("DROP SCHEMA {} CASCADE", fence.get_schema().as_str())))
        .execute(fence.pool())
        .await;
    assert_absent(&secret, "Debug of the Redis client, connections, source or lease keys, or an error", &debug);
    assert_absent(&wrong, "a connection error", &debug);
    assert_absent(&secret, "the tracing output of a Redis run", &logged());
}
