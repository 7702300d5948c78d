//! Sends N jobs to a Redis stream (`XADD`, field `body`, optionally a `key` field) or list
//! (`LPUSH key|body`), for `examples/redis_worker.rs`.
//!
//! ```text
//! cargo run -p brokerfence-examples --features redis --example redis_produce -- --stream orders --count 1000 --key-prefix order
//! cargo run -p brokerfence-examples --features redis --example redis_produce -- --list mail --count 100 --key-prefix mail
//! ```
//!
//! With `--key-prefix P` every job gets the key `P-<i>` (so running it twice sends duplicates the
//! fence deduplicates; a list worker then takes `--item-key split:|`); without it the entry id is
//! the key (stream), and a list item is only its body (a list worker then takes `--item-key hash`:
//! identical bodies are one job).
//! `--bad N` adds N entries without a `body` field (dead-lettered by the worker). Redis from
//! `REDIS_URL` or `--redis-url`, falling back to `localstack/.env`. Prints `EVENT produced n=…`.

#[path = "support/cli.rs"]
mod common;

#[cfg(feature = "redis")]
fn main() {
    std::process::exit(run(std::env::args().skip(1).collect()));
}

#[cfg(not(feature = "redis"))]
fn main() {
    eprintln!(
        "redis_produce needs the `redis` feature: cargo run -p brokerfence-examples --features redis --example redis_produce"
    );
    std::process::exit(2);
}

#[cfg(feature = "redis")]
pub use producer::run;

#[cfg(feature = "redis")]
mod producer {
    use brokerfence::redis::client;
    use brokerfence::redis::{RedisConnections, RedisError};

    /// Why the producer did not finish: exit 2 (refused) or 1 (failed).
    enum Failure {
        Refused(String),
        Failed(String),
    }

    impl From<client::RedisError> for Failure {
        fn from(e: client::RedisError) -> Self {
            Failure::Failed(e.to_string())
        }
    }

    use super::common;

    const PROG: &str = "redis_produce";

    /// Sends N jobs to a Redis stream (XADD, field `body`, optionally a `key` field) or list
    /// (LPUSH key|body), for redis_worker. Prints `EVENT produced n=…`. Exit codes: 0 done,
    /// 1 failed, 2 bad command line or Redis URL.
    #[derive(Debug, clap::Parser)]
    #[command(name = PROG, help_template = common::HELP_TEMPLATE)]
    struct Args {
        /// Send to this stream (give --stream or --list)
        #[arg(long, value_name = "KEY", required_unless_present = "list", conflicts_with = "list")]
        stream: Option<String>,
        /// Send to this list
        #[arg(long, value_name = "KEY")]
        list: Option<String>,
        /// How many jobs
        #[arg(long, value_name = "N", default_value_t = 100)]
        count: u64,
        /// The first job's number
        #[arg(long, value_name = "I", default_value_t = 0)]
        start: u64,
        /// Give every job the key P-<i> (else the entry id is the key; a list item is its body)
        #[arg(long, value_name = "P")]
        key_prefix: Option<String>,
        /// Payload text
        #[arg(long, value_name = "TEXT", default_value = "hello")]
        body: String,
        /// Also send N stream entries without a body field (dead-lettered by the worker)
        #[arg(long, value_name = "N", default_value_t = 0)]
        bad: u64,
        /// Redis URL, redis://HOST:PORT (else REDIS_URL, else localstack/.env)
        #[arg(long, value_name = "URL")]
        redis_url: Option<String>,
        /// Export spans by OTLP over HTTP to http://HOST:PORT; each stream entry carries its
        /// span's `traceparent` field (needs the `otel` feature)
        #[arg(long, value_name = "URL", value_parser = common::otel::otlp_endpoint)]
        otlp_endpoint: Option<String>,
    }

    async fn produce(args: Args) -> Result<u64, Failure> {
        let url = args
            .redis_url
            .clone()
            .or_else(|| brokerfence_testkit::services::var("REDIS_URL"))
            .unwrap_or_else(|| "redis://127.0.0.1:6379".into());
        // The library's checks and messages: the scheme (exit 2), the address on a failed connect.
        let conns = RedisConnections::connect(&url).await.map_err(|e| match e {
            RedisError::UnsupportedScheme { .. } => Failure::Refused(e.to_string()),
            // The library names the Redis URL; this program's comes from a flag or a variable.
            e @ RedisError::Unreachable { .. } => Failure::Failed(format!("{e} (--redis-url or REDIS_URL)")),
            e => Failure::Failed(e.to_string()),
        })?;
        let mut conn = conns.commands();
        let mut sent = 0;
        let ids: Vec<u64> = (args.start..args.start + args.count).collect();
        for chunk in ids.chunks(500) {
            let mut pipe = client::pipe();
            for i in chunk {
                let body = format!("{} #{i}", args.body);
                // One trace per stream entry: its `produce` span's context as fields.
                let trace = match &args.stream {
                    Some(s) => common::otel::trace_fields(&tracing::info_span!("produce", stream = %s, n = i)),
                    None => Vec::new(),
                };
                match (&args.stream, &args.list, &args.key_prefix) {
                    (Some(s), _, Some(p)) => {
                        let cmd =
                            pipe.cmd("XADD").arg(s).arg("*").arg("key").arg(format!("{p}-{i}")).arg("body").arg(body);
                        trace.iter().for_each(|(k, v)| _ = cmd.arg(*k).arg(v));
                    }
                    (Some(s), _, None) => {
                        let cmd = pipe.cmd("XADD").arg(s).arg("*").arg("body").arg(body);
                        trace.iter().for_each(|(k, v)| _ = cmd.arg(*k).arg(v));
                    }
                    (None, Some(l), Some(p)) => {
                        pipe.cmd("LPUSH").arg(l).arg(format!("{p}-{i}|{body}"));
                    }
                    (None, Some(l), None) => {
                        pipe.cmd("LPUSH").arg(l).arg(body);
                    }
                    (None, None, _) => {}
                }
                pipe.ignore();
            }
            pipe.query_async::<()>(&mut conn).await?;
            sent += chunk.len() as u64;
        }
        for i in 0..args.bad {
            if let Some(s) = &args.stream {
                let _: String = client::cmd("XADD").arg(s).arg("*").arg("nobody").arg(i).query_async(&mut conn).await?;
                sent += 1;
            }
        }
        Ok(sent)
    }

    /// Runs the producer with command-line arguments (without the program name); returns the exit
    /// code.
    pub fn run(raw: Vec<String>) -> i32 {
        let args: Args = match common::parse(PROG, raw) {
            Ok(a) => a,
            Err(e) => return common::report_cli(&e),
        };
        if let Err(e) = common::otel::check() {
            return e.report(PROG);
        }
        common::init_logging("warn");
        let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(r) => r,
            Err(e) => {
                eprintln!("cannot start the tokio runtime: {e}");
                return 1;
            }
        };
        let done = runtime.block_on(produce(args));
        common::otel::shutdown();
        match done {
            Ok(n) => {
                println!("EVENT produced n={n}");
                0
            }
            Err(Failure::Refused(e)) => {
                eprintln!("{PROG}: {e}");
                2
            }
            Err(Failure::Failed(e)) => {
                eprintln!("{PROG}: {e}");
                1
            }
        }
    }
}
