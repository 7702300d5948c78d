//! Sends N messages to an SQS queue (batches of ten, several batches in flight).
//!
//! ```text
//! cargo run -p brokerfence-examples --features sqs --example sqs_produce -- \
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

use brokerfence::sqs::aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use brokerfence::sqs::is_fifo_url;
use futures::{StreamExt, TryStreamExt};

#[path = "support/cli.rs"]
mod common;

const PROG: &str = "sqs_produce";

/// Sends N messages to an SQS queue (batches of ten, several batches in flight). Each body is
/// {"id":"<prefix>-<n>","n":<n>} with the same id in the `job-id` attribute (and, on a FIFO
/// queue, as the deduplication id). Prints `EVENT sent count=N`. Exit codes: 0 sent, 1 failed,
/// 2 bad command line.
#[derive(Debug, clap::Parser)]
#[command(name = PROG, help_template = common::HELP_TEMPLATE)]
struct Args {
    /// The queue's URL (else SQS_QUEUE_URL)
    #[arg(long, value_name = "URL")]
    queue_url: Option<String>,
    /// How many messages
    #[arg(long, value_name = "N", default_value_t = 10)]
    count: usize,
    /// Id prefix
    #[arg(long, value_name = "P", default_value = "msg")]
    prefix: String,
    /// Message group (FIFO queues)
    #[arg(long, value_name = "G", default_value = "group-1")]
    group: String,
    /// Batches in flight at once (standard queues)
    #[arg(long, value_name = "N", default_value = "8", value_parser = common::at_least_one)]
    in_flight: usize,
    /// Export spans by OTLP over HTTP to http://HOST:PORT; each message carries its span's
    /// `traceparent` attribute (needs the `otel` feature)
    #[arg(long, value_name = "URL", value_parser = common::otel::otlp_endpoint)]
    otlp_endpoint: Option<String>,
}

fn parse_args() -> Result<(Args, String), clap::Error> {
    let args: Args = common::parse(PROG, std::env::args().skip(1).collect())?;
    match args.queue_url.clone().or_else(|| std::env::var("SQS_QUEUE_URL").ok()).filter(|u| !u.is_empty()) {
        Some(url) => Ok((args, url)),
        None => Err(common::usage_error::<Args>("--queue-url (or SQS_QUEUE_URL) is required")),
    }
}

async fn run(args: Args, queue_url: String) -> Result<(), Box<dyn std::error::Error>> {
    let client =
        brokerfence::sqs::client(brokerfence::sqs::aws_config::from_env(), brokerfence::sqs::SqsTimeouts::default())
            .await;
    let fifo = is_fifo_url(&queue_url);
    let started = Instant::now();
    let batches: Vec<Vec<usize>> = (0..args.count).collect::<Vec<_>>().chunks(10).map(<[usize]>::to_vec).collect();
    futures::stream::iter(batches)
        .map(|batch| {
            let client = client.clone();
            let (args, queue_url) = (&args, &queue_url);
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
                    // One trace per message: its `produce` span's context as attributes (SQS
                    // takes 10 per message; this one has room).
                    let span = tracing::info_span!("produce", job = %id);
                    for (name, value) in common::otel::trace_fields(&span) {
                        let v = MessageAttributeValue::builder().data_type("String").string_value(value).build()?;
                        entry = entry.message_attributes(name, v);
                    }
                    entries.push(entry.build()?);
                }
                let out = client.send_message_batch().queue_url(queue_url).set_entries(Some(entries)).send().await?;
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
    let (args, queue_url) = match parse_args() {
        Ok(a) => a,
        Err(e) => return ExitCode::from(u8::try_from(common::report_cli(&e)).unwrap_or(2)),
    };
    if let Err(e) = common::otel::check() {
        return ExitCode::from(u8::try_from(e.report(PROG)).unwrap_or(2));
    }
    common::init_logging("warn");
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("cannot start the tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let done = runtime.block_on(run(args, queue_url));
    common::otel::shutdown();
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{PROG}: {}", brokerfence::sqs::error_chain(&*e));
            ExitCode::FAILURE
        }
    }
}
