//! The worker process: its command line, the handler (an HTTP call to the receiver, then the
//! result), and the consumer it runs.

use super::*;

#[derive(Debug, Clone)]
pub(crate) struct WorkerOpts {
    pub(crate) source: SourceKind,
    pub(crate) db: String,
    pub(crate) app: String,
    pub(crate) schema: String,
    pub(crate) queue: String,
    pub(crate) receiver: String,
    pub(crate) lease_secs: u64,
    pub(crate) concurrency: usize,
    pub(crate) batch: usize,
    pub(crate) work: Duration,
    pub(crate) slow: Duration,
    pub(crate) id: usize,
    pub(crate) sqs_queue_url: Option<String>,
    pub(crate) redis_url: Option<String>,
    pub(crate) stream: Option<String>,
    pub(crate) guards: Vec<String>,
}

/// A chaos worker process (started by the chaos runner): runs one consumer until SIGTERM.
#[derive(clap::Parser)]
#[command(name = "chaos --worker", help_template = HELP_TEMPLATE)]
pub(crate) struct WorkerCli {
    /// table, sqs or redis
    #[arg(long, value_name = "SOURCE", default_value = "table", value_parser = SourceKind::parse)]
    pub(crate) source: SourceKind,
    /// PostgreSQL URL
    #[arg(long, value_name = "URL", default_value = "")]
    pub(crate) db: String,
    /// application_name prefix
    #[arg(long, value_name = "NAME", default_value = "chaos-w")]
    pub(crate) app: String,
    /// Schema of the fence tables
    #[arg(long, value_name = "NAME", default_value = "")]
    pub(crate) schema: String,
    /// The queue
    #[arg(long, value_name = "NAME", default_value = "")]
    pub(crate) queue: String,
    /// The receiver's URL
    #[arg(long, value_name = "URL", default_value = "")]
    pub(crate) receiver: String,
    /// Lease in seconds
    #[arg(long, value_name = "SECS", default_value_t = 3)]
    pub(crate) lease_secs: u64,
    /// Jobs at once
    #[arg(long, value_name = "N", default_value_t = 4)]
    pub(crate) concurrency: usize,
    /// Claim batch
    #[arg(long, value_name = "N", default_value_t = 10)]
    pub(crate) batch: usize,
    /// Milliseconds of work per job
    #[arg(long = "work-ms", value_name = "MS", default_value_t = 20)]
    pub(crate) work_ms: u64,
    /// Milliseconds a slow job waits
    #[arg(long = "slow-ms", value_name = "MS", default_value_t = 4000)]
    pub(crate) slow_ms: u64,
    /// Worker number
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub(crate) id: usize,
    /// SQS queue URL (source sqs)
    #[arg(long, value_name = "URL")]
    pub(crate) sqs_queue_url: Option<String>,
    /// Redis URL (source redis)
    #[arg(long, value_name = "URL")]
    pub(crate) redis_url: Option<String>,
    /// Redis stream (source redis)
    #[arg(long, value_name = "KEY")]
    pub(crate) stream: Option<String>,
    /// Test only (the members' guard-switches, on in the harness build): guards to turn off
    #[arg(long, value_name = "LIST", default_value = "")]
    pub(crate) guards: String,
}

pub(crate) fn parse_worker_args(args: &[String]) -> Result<WorkerOpts, clap::Error> {
    let c =
        <WorkerCli as clap::Parser>::try_parse_from(std::iter::once("chaos".to_owned()).chain(args.iter().cloned()))?;
    Ok(WorkerOpts {
        source: c.source,
        db: c.db,
        app: c.app,
        schema: c.schema,
        queue: c.queue,
        receiver: c.receiver,
        lease_secs: c.lease_secs,
        concurrency: c.concurrency,
        batch: c.batch,
        work: Duration::from_millis(c.work_ms),
        slow: Duration::from_millis(c.slow_ms),
        id: c.id,
        sqs_queue_url: c.sqs_queue_url,
        redis_url: c.redis_url,
        stream: c.stream,
        guards: c.guards.split(',').filter(|g| !g.is_empty()).map(str::to_owned).collect(),
    })
}

pub(crate) fn event(line: impl std::fmt::Display) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "EVENT {line}");
    let _ = out.flush();
}

/// The worker process: runs one consumer until SIGTERM. Returns the exit code.
pub fn worker_main(args: Vec<String>) -> i32 {
    {
        use tracing_subscriber::Layer as _;
        use tracing_subscriber::layer::SubscriberExt as _;
        use tracing_subscriber::util::SubscriberInitExt as _;
        let log = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .with_filter(tracing_subscriber::EnvFilter::from_default_env());
        // Every lost attempt, whatever RUST_LOG says, as an EVENT line for the runner.
        let losses =
            faults::LossLayer { emit: |line| event(line) }.with_filter(tracing_subscriber::filter::LevelFilter::WARN);
        let _ = tracing_subscriber::registry().with(log).with(losses).try_init();
    }
    let opts = match parse_worker_args(&args) {
        Ok(o) => o,
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("chaos worker: runtime: {e}");
            return 2;
        }
    };
    match rt.block_on(worker(opts)) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("chaos worker: {e}");
            event(format!("failed {e}"));
            1
        }
    }
}

/// What every handler shares.
pub(crate) struct HandlerEnv {
    pub(crate) client: reqwest::Client,
    pub(crate) receiver: String,
    pub(crate) work: Duration,
    pub(crate) slow: Duration,
}

/// The handler: decode, call the receiver with the fencing stamp, do blocking work, return the
/// result `key@epoch`. A zombie paused in the blocking work finishes it after SIGCONT and reaches
/// the fenced commit, which refuses it.
pub(crate) async fn handle(env: Arc<HandlerEnv>, ctx: JobContext) -> Result<Vec<u8>, JobError> {
    let body = std::str::from_utf8(ctx.payload())
        .map_err(|e| JobError::fatal(format!("undecodable payload: not UTF-8 ({e})")))?;
    let op = if body.contains("\"flaky\"") {
        "flaky"
    } else if body.contains("\"slow\"") {
        "slow"
    } else if body.contains("\"apply\"") {
        "apply"
    } else {
        return Err(JobError::fatal(format!("undecodable payload: unknown body {body:?}")));
    };
    let mut request = env.client.post(&env.receiver);
    for (name, value) in ctx.stamp().to_headers() {
        request = request.header(name, value);
    }
    let response = request.body(ctx.key().as_str().to_owned()).send().await.map_err(JobError::retry)?;
    match response.status().as_u16() {
        200 => {}
        409 => return Err(JobError::retry(format!("receiver refused epoch {} as stale", ctx.epoch()))),
        other => return Err(JobError::retry(format!("receiver answered {other}"))),
    }
    if op == "flaky" && ctx.lease().attempts == 1 {
        return Err(JobError::retry("flaky: first attempt fails on purpose"));
    }
    if op == "slow" {
        // Longer than the lease, and cancellable: the attempt lives only while its heartbeats
        // confirm the lease, so a stall that costs it the lease shows up as a lost attempt.
        tokio::time::sleep(env.slow).await;
    }
    event(format!("compute key={} epoch={}", ctx.key(), ctx.epoch()));
    let work = env.work;
    let stamp = ctx.stamp();
    // Blocking work, then a blocking call: no await point inside, so nothing stops it once it
    // started. A zombie paused in here finishes it after SIGCONT: its call reaches the receiver
    // (refused, or accepted and then superseded) and its commit is refused by the fence.
    let status = tokio::task::block_in_place(|| {
        std::thread::sleep(work);
        blocking_call(&env.receiver, &stamp)
    });
    event(format!("computed key={} epoch={}", ctx.key(), ctx.epoch()));
    match status {
        Ok(200) => Ok(format!("{}@{}", ctx.key(), ctx.epoch()).into_bytes()),
        Ok(409) => Err(JobError::retry(format!("receiver refused epoch {} as stale", ctx.epoch()))),
        Ok(other) => Err(JobError::retry(format!("receiver answered {other}"))),
        Err(e) => Err(JobError::retry(format!("receiver unreachable: {e}"))),
    }
}

/// A plain blocking HTTP/1.1 POST of the stamp; returns the status code.
pub(crate) fn blocking_call(url: &str, stamp: &FenceStamp) -> std::io::Result<u16> {
    use std::io::{BufRead, Write};
    let invalid = |m: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, m.to_owned());
    let rest = url.strip_prefix("http://").ok_or_else(|| invalid("receiver URL must be http://"))?;
    let (host, path) = rest.split_once('/').map(|(h, p)| (h, format!("/{p}"))).unwrap_or((rest, "/".into()));
    let mut stream = std::net::TcpStream::connect(host)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut request = format!("POST {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\nContent-Length: 0\r\n");
    for (name, value) in stamp.to_headers() {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("\r\n");
    stream.write_all(request.as_bytes())?;
    let mut status = String::new();
    std::io::BufReader::new(stream).read_line(&mut status)?;
    status.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| invalid("no HTTP status line"))
}

pub(crate) async fn worker(o: WorkerOpts) -> Result<(), String> {
    let options: sqlx::postgres::PgConnectOptions = o.db.parse().map_err(|e: sqlx::Error| e.to_string())?;
    let store = PgFence::connect_with(options.application_name(&format!("{}{}", o.app, o.id)))
        .await
        .map_err(|e| e.to_string())?
        .schema(SchemaName::new(o.schema.clone()).map_err(|e| e.to_string())?);
    // The harness stalls the same long jobs again and again (a PostgreSQL stall picks the rows its
    // victim runs, and a slow job is nearly always running), far beyond any production rate:
    // neither failures nor takeovers may bury a job here, so both caps are out of reach. The
    // claims cap itself is tested in tests/store/edge_cases.rs.
    let retry = RetryPolicy {
        max_attempts: 1000,
        base_backoff: Duration::from_millis(100),
        max_backoff: Duration::from_secs(1),
    };
    let store = store.max_claims(retry.max_claims());
    let store: Arc<dyn FenceStore> = Arc::new(without_guards(store, &o.guards)?);
    let queue = QueueName::new(o.queue.clone()).map_err(|e| e.to_string())?;
    let lease = LeaseDuration::from_secs(o.lease_secs).map_err(|e| e.to_string())?;
    let config = ConsumerConfig::new(SupervisorConfig::new(lease).retry(retry))
        .concurrency(o.concurrency)
        .batch(o.batch)
        .grace(Duration::from_secs(2));
    let env = Arc::new(HandlerEnv {
        client: reqwest::Client::builder().timeout(Duration::from_secs(5)).build().map_err(|e| e.to_string())?,
        receiver: o.receiver.clone(),
        work: o.work,
        slow: o.slow,
    });
    let owner = Owner::unique(&format!("w{}", o.id));
    event(format!("ready pid={} owner={owner}", std::process::id()));
    match o.source {
        SourceKind::Table => {
            let source = brokerfence::TableQueue::new(Arc::clone(&store), queue).idle_wait(Duration::from_millis(50));
            consume(source, store, owner, config, env).await
        }
        #[cfg(feature = "sqs")]
        SourceKind::Sqs => {
            let source = sqs_chaos::worker_source(&o, queue).await?;
            consume(source, store, owner, config, env).await
        }
        #[cfg(feature = "redis")]
        SourceKind::Redis => {
            let source = redis_chaos::worker_source(&o, queue).await?;
            consume(source, store, owner, config, env).await
        }
        #[allow(unreachable_patterns)]
        other => Err(format!("source {} not compiled in", other.name())),
    }
}

pub(crate) fn without_guards(store: PgFence, names: &[String]) -> Result<PgFence, String> {
    let mut guards = fence::Guards::default();
    for name in names {
        guards = match name.as_str() {
            "no-epoch-increment" => guards.without_epoch_increment(),
            "no-commit-cas" => guards.without_commit_cas(),
            "no-heartbeat-cas" => guards.without_heartbeat_cas(),
            "no-timeline-epochs" => guards.without_timeline_epochs(),
            other => return Err(format!("unknown guard switch {other}")),
        };
    }
    Ok(store.guards(guards))
}

pub(crate) async fn consume<S: Source>(
    source: S,
    store: Arc<dyn FenceStore>,
    owner: Owner,
    config: ConsumerConfig,
    env: Arc<HandlerEnv>,
) -> Result<(), String> {
    let consumer = Consumer::with_owner(source, store, owner, config);
    let metrics = consumer.metrics();
    let reporter = tokio::spawn({
        let metrics = Arc::clone(&metrics);
        async move {
            let mut last = None;
            loop {
                let now = metrics.snapshot();
                if last != Some(now) {
                    event(format!("metrics {now}"));
                    last = Some(now);
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    });
    let handler = move |ctx: JobContext| handle(Arc::clone(&env), ctx);
    let result = consumer.run(handler, shutdown_signal()).await;
    reporter.abort();
    event(format!("metrics {}", metrics.snapshot()));
    event("stopped");
    result.map_err(|e| e.to_string())
}
