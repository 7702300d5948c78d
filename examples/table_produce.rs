//! Enqueues N jobs on a table queue (the fence's own PostgreSQL table), for
//! `examples/table_worker.rs`.
//!
//! ```text
//! cargo run --example table_produce -- --queue thumbnails --count 100 --migrate
//! ```
//!
//! Job `i` (from `--start`, default 0) gets the key `<prefix>-<i>` and the payload `<body> <i>`.
//! Enqueueing a key that already exists is a no-op (running it twice sends nothing new), so the
//! line it prints, `EVENT produced queue=… count=N new=M`, says how many were new. PostgreSQL from
//! `--database-url`, else `DATABASE_URL`, else `localstack/.env`; `--migrate` applies the schema
//! migrations first, otherwise it refuses (exit 2) a schema older than this build needs.

use brokerfence::fence::{FenceStore, JobKey, Owner, QueueName};

#[path = "support/cli.rs"]
mod common;

use common::{Cli, CliExit, StartError};

const PROG: &str = "table_produce";
const USAGE: &str = "usage: table_produce --queue NAME [--count N=10] [--start I=0] [--prefix P=job]
       [--body TEXT=hello] [--database-url URL] [--schema NAME] [--migrate] [--help]";

struct Args {
    queue: Option<String>,
    count: u64,
    start: u64,
    prefix: String,
    body: String,
    database_url: Option<String>,
    schema: Option<String>,
    migrate: bool,
}

fn parse_args(raw: Vec<String>) -> Result<Args, CliExit> {
    let mut args = Args {
        queue: None,
        count: 10,
        start: 0,
        prefix: "job".into(),
        body: "hello".into(),
        database_url: None,
        schema: None,
        migrate: false,
    };
    let mut cli = Cli::new(raw);
    while let Some(flag) = cli.next_flag() {
        let mut flag = flag?;
        match flag.name.as_str() {
            "--queue" => args.queue = Some(flag.value()?),
            "--count" => args.count = flag.num()?,
            "--start" => args.start = flag.num()?,
            "--prefix" => args.prefix = flag.value()?,
            "--body" => args.body = flag.value()?,
            "--database-url" => args.database_url = Some(flag.value()?),
            "--schema" => args.schema = Some(flag.value()?),
            "--migrate" => args.migrate = flag.switch()?,
            _ => return Err(flag.unknown()),
        }
    }
    if args.queue.is_none() {
        return Err(CliExit::Usage("--queue is required".into()));
    }
    Ok(args)
}

async fn produce(args: Args) -> Result<(), StartError> {
    let refuse = |e: brokerfence::fence::FenceError| StartError::Refused(e.to_string());
    let queue = QueueName::new(args.queue.clone().unwrap_or_default()).map_err(refuse)?;
    let url = common::database_url(args.database_url.as_deref())?;
    let owner = Owner::unique(PROG);
    let store = common::connect_pg(&url, args.schema.as_deref(), &owner, args.migrate).await?;
    let mut new = 0;
    let ids: Vec<u64> = (args.start..args.start.saturating_add(args.count)).collect();
    for chunk in ids.chunks(500) {
        let mut jobs = Vec::with_capacity(chunk.len());
        for i in chunk {
            let key = JobKey::new(format!("{}-{i}", args.prefix)).map_err(refuse)?;
            jobs.push((key, format!("{} {i}", args.body).into_bytes()));
        }
        new += store.enqueue_many(&queue, &jobs).await?;
    }
    common::event("produced", &[("queue", &queue), ("count", &args.count), ("new", &new)]);
    Ok(())
}

fn main() {
    brokerfence_testkit::services::load_dotenv();
    let code = common::run_program(
        PROG,
        &|| USAGE.to_owned(),
        "warn",
        parse_args(std::env::args().skip(1).collect()),
        produce,
    );
    std::process::exit(code);
}
