//! Sends N jobs to a Redis stream (`XADD`, field `body`, optionally a `key` field) or list
//! (`LPUSH key|body`), for `examples/redis_worker.rs`.
//!
//! ```text
//! cargo run --features redis --example redis_produce -- --stream orders --count 1000 --key-prefix order
//! cargo run --features redis --example redis_produce -- --list mail --count 100 --key-prefix mail
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
    eprintln!("redis_produce needs the `redis` feature: cargo run --features redis --example redis_produce");
    std::process::exit(2);
}

#[cfg(feature = "redis")]
pub use producer::run;

#[cfg(feature = "redis")]
mod producer {
    use brokerfence::adapters::redis::client::{self, aio::MultiplexedConnection};

    use super::common::{Cli, CliExit};

    const USAGE: &str = "usage: redis_produce (--stream KEY | --list KEY) [--count N=100] [--start I=0]
       [--key-prefix P] [--body TEXT=hello] [--bad N=0] [--redis-url URL] [--help]";

    #[derive(Debug, Default)]
    struct Args {
        stream: Option<String>,
        list: Option<String>,
        count: u64,
        start: u64,
        key_prefix: Option<String>,
        body: String,
        bad: u64,
        redis_url: Option<String>,
    }

    fn parse_args(raw: Vec<String>) -> Result<Args, CliExit> {
        let mut args = Args { count: 100, body: "hello".into(), ..Args::default() };
        let mut cli = Cli::new(raw);
        while let Some(flag) = cli.next_flag() {
            let mut flag = flag?;
            match flag.name.as_str() {
                "--stream" => args.stream = Some(flag.value()?),
                "--list" => args.list = Some(flag.value()?),
                "--count" => args.count = flag.num()?,
                "--start" => args.start = flag.num()?,
                "--key-prefix" => args.key_prefix = Some(flag.value()?),
                "--body" => args.body = flag.value()?,
                "--bad" => args.bad = flag.num()?,
                "--redis-url" => args.redis_url = Some(flag.value()?),
                _ => return Err(flag.unknown()),
            }
        }
        if args.stream.is_some() == args.list.is_some() {
            return Err(CliExit::Usage("give exactly one of --stream and --list".into()));
        }
        Ok(args)
    }

    async fn produce(args: Args) -> Result<u64, client::RedisError> {
        let url = args
            .redis_url
            .clone()
            .or_else(|| brokerfence_testkit::services::var("REDIS_URL"))
            .unwrap_or_else(|| "redis://127.0.0.1:6379".into());
        let mut conn: MultiplexedConnection =
            client::Client::open(url.as_str())?.get_multiplexed_async_connection().await?;
        let mut sent = 0;
        let ids: Vec<u64> = (args.start..args.start + args.count).collect();
        for chunk in ids.chunks(500) {
            let mut pipe = client::pipe();
            for i in chunk {
                let body = format!("{} #{i}", args.body);
                match (&args.stream, &args.list, &args.key_prefix) {
                    (Some(s), _, Some(p)) => {
                        pipe.cmd("XADD").arg(s).arg("*").arg("key").arg(format!("{p}-{i}")).arg("body").arg(body);
                    }
                    (Some(s), _, None) => {
                        pipe.cmd("XADD").arg(s).arg("*").arg("body").arg(body);
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
        let args = match parse_args(raw) {
            Ok(a) => a,
            Err(e) => return e.report("redis_produce", USAGE),
        };
        let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
            Ok(r) => r,
            Err(e) => {
                eprintln!("cannot start the tokio runtime: {e}");
                return 1;
            }
        };
        match runtime.block_on(produce(args)) {
            Ok(n) => {
                println!("EVENT produced n={n}");
                0
            }
            Err(e) => {
                eprintln!("redis_produce: {e}");
                1
            }
        }
    }
}
