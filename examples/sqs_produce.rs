//! Sends N messages to an SQS queue (batches of ten, several batches in flight).
//!
//! ```text
//! cargo run --features sqs --example sqs_produce -- \
//!     --queue-url http://127.0.0.1:4566/000000000000/orders --count 100
//! ```
//!
//! Each body is JSON, `{"id":"<prefix>-<n>","n":<n>}`, and carries the same id as the `job-id`
//! message attribute, so a worker can key jobs by `--key body:id` or `--key attr:job-id` (a re-sent
//! message is then the same job). On a FIFO queue (`.fifo`) the id is also the deduplication id and
//! `--group` names the message group. AWS settings come from the standard environment, falling
//! back to `localstack/.env`. Prints `EVENT sent count=N` when done.

use std::process::ExitCode;
use std::time::Instant;

use brokerfence::adapters::sqs::aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use brokerfence::adapters::sqs::{client_from_env, is_fifo_url};
use futures::{StreamExt, TryStreamExt};

#[path = "support/cli.rs"]
mod common;

use common::{Cli, CliExit};

const USAGE: &str =
    "usage: sqs_produce --queue-url URL [--count N=10] [--prefix P=msg] [--group G=group-1] [--in-flight N=8] [--help]";

struct Args {
    queue_url: String,
    count: usize,
    prefix: String,
    group: String,
    in_flight: usize,
}

fn parse_args() -> Result<Args, CliExit> {
    let mut args = Args {
        queue_url: std::env::var("SQS_QUEUE_URL").unwrap_or_default(),
        count: 10,
        prefix: "msg".into(),
        group: "group-1".into(),
        in_flight: 8,
    };
    let mut cli = Cli::new(std::env::args().skip(1).collect());
    while let Some(flag) = cli.next_flag() {
        let mut flag = flag?;
        match flag.name.as_str() {
            "--queue-url" => args.queue_url = flag.value()?,
            "--count" => args.count = flag.num()?,
            "--prefix" => args.prefix = flag.value()?,
            "--group" => args.group = flag.value()?,
            "--in-flight" => args.in_flight = flag.num::<usize>()?.max(1),
            _ => return Err(flag.unknown()),
        }
    }
    if args.queue_url.is_empty() {
        return Err(CliExit::Usage("--queue-url (or SQS_QUEUE_URL) is required".into()));
    }
    Ok(args)
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let client = client_from_env().await;
    let fifo = is_fifo_url(&args.queue_url);
    let started = Instant::now();
    let batches: Vec<Vec<usize>> = (0..args.count).collect::<Vec<_>>().chunks(10).map(<[usize]>::to_vec).collect();
    futures::stream::iter(batches)
        .map(|batch| {
            let client = client.clone();
            let args = &args;
            async move {
                let mut entries = Vec::with_capacity(batch.len());
                for (i, n) in batch.iter().enumerate() {
                    let id = format!("{}-{n}", args.prefix);
                    let attr = MessageAttributeValue::builder().data_type("String").string_value(&id).build()?;
                    let mut entry = SendMessageBatchRequestEntry::builder()
                        .id(format!("e{i}"))
                        .message_body(format!(r#"{{"id":"{id}","n":{n}}}"#))
                        .message_attributes("job-id", attr);
                    if fifo {
                        entry = entry.message_group_id(&args.group).message_deduplication_id(&id);
                    }
                    entries.push(entry.build()?);
                }
                let out =
                    client.send_message_batch().queue_url(&args.queue_url).set_entries(Some(entries)).send().await?;
                if let Some(f) = out.failed().first() {
                    return Err(format!(
                        "{} messages not sent, e.g. {}: {:?}",
                        out.failed().len(),
                        f.code(),
                        f.message()
                    )
                    .into());
                }
                Ok::<usize, Box<dyn std::error::Error>>(batch.len())
            }
        })
        // FIFO order within a group needs one batch at a time.
        .buffered(if fifo { 1 } else { args.in_flight })
        .try_collect::<Vec<usize>>()
        .await?;
    let secs = started.elapsed().as_secs_f64();
    eprintln!("sent {} messages in {secs:.2} s ({:.0}/s)", args.count, args.count as f64 / secs.max(1e-9));
    println!("EVENT sent count={}", args.count);
    Ok(())
}

fn main() -> ExitCode {
    brokerfence_testkit::services::load_dotenv();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => return ExitCode::from(u8::try_from(e.report("sqs_produce", USAGE)).unwrap_or(2)),
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sqs_produce: {e}");
            ExitCode::FAILURE
        }
    }
}
