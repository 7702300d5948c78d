//! Benchmark: messages per second of the fenced SQS consumer against a plain consumer (receive,
//! handle, delete) on the same queue, with the same concurrency, in one run; and the database
//! statements the fence spends per message. Not a test: run it by hand, in release.
//!
//! ```text
//! bash localstack/up
//! cargo run --release -p brokerfence-bench --features sqs --bin bench_sqs -- --messages 3000 --rounds 9 --concurrency 32 --work-ms 5
//! ```
//!
//! Both consumers receive with one long-poll loop (batches of `--batch`, ten per ReceiveMessage
//! call, the calls of one batch sent at once), run `concurrency` handlers at a time (a sleep of
//! `--work-ms`, standing in for I/O), and delete in batches of ten (or after 20 ms). The fenced
//! one claims up to `--prefetch` messages (default: twice `concurrency`) ahead of its handlers,
//! under heartbeated leases: a message holds a prefetch place from its receive until its handler
//! starts (receive, the claim window, the claim: ~10 ms here), so at ~2,500 msg/s about 25 places
//! are taken on average, and with only `concurrency` (32) the receive loop waited for a free place
//! before 14 % of its receives. Keep `--batch 10` on LocalStack: concurrent ReceiveMessage calls slow
//! each other there (one poller measured 2,000 msg/s, two 1,300). The fenced one adds the claim
//! statements (receives grouped by `--claim-window-ms`), the commit statements (completions
//! grouped by `--commit-window-ms`) and the heartbeat per tick.
//!
//! After a warm-up of both, `--rounds` rounds (default 9) alternate which consumer goes first; the
//! ratio is the median of the rounds' ratios (each round runs both back to back, so the machine's
//! drift between rounds cancels out), printed with the ratio of the two medians. Also printed: database statements per message (counted by a wrapper around the
//! store), mean claim and commit latencies, and where each phase's CPU went, per message:
//! LocalStack, PostgreSQL and this process share the machine's cores, so CPU the fence spends
//! (in PostgreSQL and in the consumer) is CPU LocalStack does not get. With `--stages`, also where
//! a fenced message's time goes (claim answered → handler started, handler done → commit
//! answered); off by default, since following every message costs the fenced side CPU. AWS and
//! PostgreSQL settings come from the standard environment, falling back to `localstack/.env`.
//! LocalStack's heap grows with every message it has served (here from 120 MB to 500 MB over a
//! day of runs) and its CPU per message with it: compare runs on a freshly started LocalStack
//! (`bash localstack/down && bash localstack/up`). `localstack/up` keeps a host LocalStack on one
//! CPU, and the header says which CPUs it found LocalStack on: floating, its threads wait for the
//! CPU the database work keeps busy, and both consumers (the fenced one more) measured 20-30 %
//! slower (`localstack/README.md`).

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use brokerfence::sqs::aws_sdk_sqs::Client;
use brokerfence::sqs::aws_sdk_sqs::types::{DeleteMessageBatchRequestEntry, SendMessageBatchRequestEntry};
use brokerfence::sqs::{SqsConfig, SqsSource};
use brokerfence::{Consumer, ConsumerConfig};
use brokerfence::{FenceStore, JobContext, JobError, LeaseDuration, PgFence, SchemaName, SupervisorConfig};
use futures::StreamExt;
use sqlx::AssertSqlSafe;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::args::{self, Common, HELP_TEMPLATE, Load, Rounds, at_least_one};
use crate::counters::*;

/// Benchmark (by hand): the fenced SQS consumer against a plain receive/delete consumer on the
/// same queue, rounds alternating which goes first. AWS and PostgreSQL settings from the standard
/// environment, falling back to localstack/.env. Exit codes: 0 done, 1 failed, 2 bad command line.
#[derive(clap::Parser)]
#[command(name = "bench_sqs", help_template = HELP_TEMPLATE)]
struct Cli {
    /// Let the SQS source receive the next batch while the last one is claimed
    #[arg(long)]
    read_ahead: bool,
    /// Also print where a fenced message's time goes (costs the fenced side CPU)
    #[arg(long)]
    stages: bool,
    /// Messages received ahead of free places [default: 2 × concurrency]
    #[arg(long, value_name = "P", value_parser = at_least_one)]
    prefetch: Option<usize>,
    /// Messages per run
    #[arg(long, value_name = "N", default_value = "3000", value_parser = at_least_one)]
    messages: usize,
    /// Lease in seconds
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    lease: u64,
    #[command(flatten)]
    common: Common,
    #[command(flatten)]
    load: Load,
    #[command(flatten)]
    rounds: Rounds,
}

/// The shared flags' defaults of this program.
const DEFAULTS: &[(&str, &str)] = &[("concurrency", "32"), ("batch", "10"), ("work_ms", "5"), ("rounds", "9")];

struct Args {
    read_ahead: bool,
    stages: bool,
    claim_window: Duration,
    commit_window: Duration,
    prefetch: Option<usize>,
    batch: usize,
    rounds: usize,
    messages: usize,
    concurrency: usize,
    work: Duration,
    lease: u64,
    database_url: Result<String, String>,
}

fn parse_args() -> Result<Args, clap::Error> {
    let c: Cli = args::parse(DEFAULTS)?;
    Ok(Args {
        read_ahead: c.read_ahead,
        stages: c.stages,
        claim_window: c.rounds.claim_window(),
        commit_window: c.rounds.commit_window(),
        prefetch: c.prefetch,
        batch: c.load.batch.unwrap_or(10),
        rounds: c.rounds.rounds.unwrap_or(9),
        messages: c.messages,
        concurrency: c.common.concurrency.unwrap_or(32),
        work: c.load.work(5),
        lease: c.lease,
        database_url: c.common.database_url(),
    })
}

// ---------------------------------------------------------------- the queue

async fn produce(client: &Client, url: &str, n: usize, tag: &str) -> Result<(), Box<dyn std::error::Error>> {
    let batches: Vec<Vec<usize>> = (0..n).collect::<Vec<_>>().chunks(10).map(<[usize]>::to_vec).collect();
    let results: Vec<Result<(), String>> = futures::stream::iter(batches)
        .map(|batch| async move {
            let entries = batch
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    SendMessageBatchRequestEntry::builder()
                        .id(format!("e{i}"))
                        .message_body(format!(r#"{{"run":"{tag}","n":{m}}}"#))
                        .build()
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| e.to_string())?;
            let out = client
                .send_message_batch()
                .queue_url(url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(|e| e.to_string())?;
            if out.failed().is_empty() { Ok(()) } else { Err(format!("{} not sent", out.failed().len())) }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    results.into_iter().collect::<Result<(), String>>()?;
    Ok(())
}

// ---------------------------------------------------------------- plain consumer

/// Receive, handle, delete: the same loop shape as the fenced runtime, without the fence.
/// The time (and the CPU sample) is taken when the n-th delete is confirmed.
async fn plain(
    client: &Client,
    url: &str,
    n: usize,
    concurrency: usize,
    batch: usize,
    work: Duration,
    lease: i32,
) -> Result<(Duration, CpuSample), Box<dyn std::error::Error>> {
    let started = Instant::now();
    let (tx, mut rx) = mpsc::unbounded_channel::<String>();
    let deleter = {
        let (client, url) = (client.clone(), url.to_owned());
        tokio::spawn(async move {
            let mut deleted = 0usize;
            while let Some(first) = rx.recv().await {
                let mut batch = vec![first];
                let until = tokio::time::Instant::now() + Duration::from_millis(20);
                while batch.len() < 10 {
                    tokio::select! {
                        h = rx.recv() => match h { Some(h) => batch.push(h), None => break },
                        _ = tokio::time::sleep_until(until) => break,
                    }
                }
                let entries: Vec<_> = batch
                    .iter()
                    .enumerate()
                    .filter_map(|(i, h)| {
                        DeleteMessageBatchRequestEntry::builder().id(format!("e{i}")).receipt_handle(h).build().ok()
                    })
                    .collect();
                match client.delete_message_batch().queue_url(&url).set_entries(Some(entries)).send().await {
                    Ok(out) => deleted += batch.len() - out.failed().len(),
                    Err(e) => eprintln!("plain: delete failed: {e}"),
                }
                if deleted >= n {
                    return (started.elapsed(), CpuSample::now());
                }
            }
            (started.elapsed(), CpuSample::now())
        })
    };
    let mut tasks = JoinSet::new();
    let mut received = 0usize;
    while received < n {
        while tasks.try_join_next().is_some() {}
        let free = concurrency.saturating_sub(tasks.len());
        if free == 0 {
            tasks.join_next().await;
            continue;
        }
        // As many ReceiveMessage calls at once as the fenced consumer makes for one batch.
        let want = free.min(batch);
        let calls = (0..want.div_ceil(10)).map(|i| {
            client
                .receive_message()
                .queue_url(url)
                .max_number_of_messages(i32::try_from((want - i * 10).min(10)).unwrap_or(10))
                .wait_time_seconds(1)
                .visibility_timeout(lease)
                .send()
        });
        for out in futures::future::join_all(calls).await {
            for m in out?.messages.unwrap_or_default() {
                let Some(handle) = m.receipt_handle().map(str::to_owned) else { continue };
                received += 1;
                let tx = tx.clone();
                tasks.spawn(async move {
                    let _body = m.body().unwrap_or_default().len();
                    tokio::time::sleep(work).await;
                    let _ = tx.send(handle);
                });
            }
        }
    }
    drop(tx);
    while tasks.join_next().await.is_some() {}
    Ok(deleter.await?)
}

// ---------------------------------------------------------------- fenced consumer

async fn fenced(
    client: &Client,
    url: &str,
    store: Arc<dyn FenceStore>,
    counts: Arc<Counting>,
    n: usize,
    args: &Args,
) -> Result<(Duration, CpuSample), Box<dyn std::error::Error>> {
    let (concurrency, work, lease) = (args.concurrency, args.work, args.lease);
    let source = SqsSource::new(
        client.clone(),
        SqsConfig::new(url)?.wait_time(Duration::from_secs(1)).read_ahead(args.read_ahead),
    );
    let supervisor = SupervisorConfig::new(LeaseDuration::from_secs(lease)?).commit_window(args.commit_window);
    let config = ConsumerConfig::new(supervisor)
        .claim_window(args.claim_window)
        .concurrency(concurrency)
        // `concurrency` handlers, as in the plain consumer; claims happen ahead of them.
        .prefetch(args.prefetch.unwrap_or(2 * concurrency))
        .batch(args.batch)
        .ack_batching(10, Duration::from_millis(20));
    let consumer = Arc::new(Consumer::new(source, store, config));
    let metrics = consumer.metrics();
    let stop = CancellationToken::new();
    let started = Instant::now();
    let run = {
        let (consumer, stop) = (Arc::clone(&consumer), stop.clone());
        tokio::spawn(async move {
            consumer
                .run(
                    move |ctx: JobContext| {
                        let counts = Arc::clone(&counts);
                        async move {
                            counts.started(ctx.key().as_str());
                            let _body = ctx.payload().len();
                            tokio::time::sleep(work).await;
                            counts.finished(ctx.key().as_str());
                            Ok::<_, JobError>(Vec::new())
                        }
                    },
                    stop,
                )
                .await
        })
    };
    while (metrics.snapshot().acks as usize) < n {
        tokio::time::sleep(Duration::from_millis(2)).await;
        if run.is_finished() {
            return Err("fenced consumer stopped early".into());
        }
    }
    let (elapsed, cpu) = (started.elapsed(), CpuSample::now());
    stop.cancel();
    run.await??;
    consumer.source().release_unstarted(Duration::from_secs(5)).await;
    let m = metrics.snapshot();
    if m.duplicates > 0 || m.fenced_rejections > 0 || m.lease_losses > 0 {
        eprintln!("fenced: unexpected: {m}");
    }
    Ok((elapsed, cpu))
}

// ---------------------------------------------------------------- main

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let client =
        brokerfence::sqs::client(brokerfence::sqs::aws_config::from_env(), brokerfence::sqs::SqsTimeouts::default())
            .await;
    let name = format!("bench-{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff);
    let url = client.create_queue().queue_name(&name).send().await?.queue_url().unwrap_or_default().to_owned();
    let database_url = args.database_url.clone()?;
    let schema = SchemaName::new(format!("bench_{:012x}", rand::random::<u64>() & 0xffff_ffff_ffff))?;
    let pg = PgFence::connect(&database_url).await?.schema(schema.clone());
    pg.migrate().await?;
    let pg_store: Arc<dyn FenceStore> = Arc::new(pg.clone());
    let counts = if args.stages { Counting::with_stages(pg_store) } else { Counting::new(pg_store) };
    let store: Arc<dyn FenceStore> = counts.clone();
    let lease_secs = i32::try_from(args.lease).unwrap_or(30);
    println!(
        "bench_sqs: {} rounds of {} messages each way, concurrency {}, handler {:?}, lease {} s, fenced batch {}, \
         claim window {:?}, commit window {:?}, read-ahead {}, queue {name}",
        args.rounds,
        args.messages,
        args.concurrency,
        args.work,
        args.lease,
        args.batch,
        args.claim_window,
        args.commit_window,
        args.read_ahead
    );
    // Whether the broker floats over the CPUs or keeps to some (`localstack/up` keeps a host
    // LocalStack on one): a floating one was 20-30 % slower here, and slower still beside the
    // fenced consumer's database work.
    println!("LocalStack runs on CPUs: {}", localstack_cpus().unwrap_or_else(|| "? (not a local process)".into()));

    // Warm up both paths (connections, LocalStack's queue, PostgreSQL's caches).
    let warm = 200.min(args.messages);
    produce(&client, &url, warm, "warm-plain").await?;
    plain(&client, &url, warm, args.concurrency, args.batch, args.work, lease_secs).await?;
    produce(&client, &url, warm, "warm-fenced").await?;
    fenced(&client, &url, Arc::clone(&store), Arc::clone(&counts), warm, &args).await?;
    counts.reset();

    // Alternate which goes first, so neither profits from the other's warm-up or suffers from a
    // noisy neighbour alone. The two phases of a round run back to back, so their ratio compares
    // them under the same conditions: this machine's speed drifts by 20 % and more over seconds
    // (LocalStack's, PostgreSQL's and this process's CPU per message rise and fall together), and
    // the median of the rounds' ratios is steadier than the ratio of the two medians.
    let rate = |t: Duration| args.messages as f64 / t.as_secs_f64().max(1e-9);
    let (mut plain_rates, mut fenced_rates, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    let (mut plain_cpu, mut fenced_cpu) = (String::new(), String::new());
    for round in 0..args.rounds {
        for fenced_turn in if round % 2 == 0 { [false, true] } else { [true, false] } {
            produce(&client, &url, args.messages, if fenced_turn { "fenced" } else { "plain" }).await?;
            let cpu = CpuSample::now();
            if fenced_turn {
                let (t, end) =
                    fenced(&client, &url, Arc::clone(&store), Arc::clone(&counts), args.messages, &args).await?;
                fenced_rates.push(rate(t));
                fenced_cpu = CpuSample::per_message(cpu, end, args.messages);
            } else {
                let (t, end) =
                    plain(&client, &url, args.messages, args.concurrency, args.batch, args.work, lease_secs).await?;
                plain_rates.push(rate(t));
                plain_cpu = CpuSample::per_message(cpu, end, args.messages);
            }
        }
        let (p, f) = (plain_rates.last().copied().unwrap_or(0.0), fenced_rates.last().copied().unwrap_or(0.0));
        ratios.push(f / p.max(1e-9));
        println!(
            "round {}: plain  {p:>6.0} msg/s ({plain_cpu})\n         fenced {f:>6.0} msg/s ({fenced_cpu}); ratio {:.3}",
            round + 1,
            f / p.max(1e-9),
        );
    }
    ratios.sort_by(f64::total_cmp);
    let (p, f, paired) = (median(plain_rates), median(fenced_rates), median(ratios.clone()));
    println!("plain : {p:>8.0} msg/s (median of {})", args.rounds);
    println!("fenced: {f:>8.0} msg/s (median of {})", args.rounds);
    println!(
        "ratio fenced/plain: {paired:.3}, median of the rounds' ratios (goal >= 0.9); ratio of the medians {:.3}; rounds {:.3}..{:.3}",
        f / p.max(1e-9),
        ratios.first().copied().unwrap_or(0.0),
        ratios.last().copied().unwrap_or(0.0),
    );
    let fenced_messages = (args.messages * args.rounds) as f64;
    let statements = counts.total() as f64 / fenced_messages;
    let other: u64 = ["enqueue", "claim_next", "checkpoint", "fail", "release"].iter().map(|m| counts.get(m)).sum();
    println!(
        "database statements per message: {statements:.3} (claim batches {}, completes {}, complete batches {}, heartbeats {}, other {other})",
        counts.get("claim") + counts.get("claim_batch"),
        counts.get("complete"),
        counts.get("complete_batch"),
        counts.get("heartbeat"),
    );
    println!(
        "mean statement latency: claim batch {:.2} ms, commit batch {:.2} ms",
        counts.mean_ms("claim_batch"),
        counts.mean_ms("complete_batch"),
    );
    if args.stages
        && let Some(s) = counts.stages()
    {
        println!(
            "mean per fenced message: claim answered -> handler started {:.2} ms, handler done -> commit answered {:.2} ms",
            s.claim_to_start_us as f64 / 1000.0 / s.starts.max(1) as f64,
            s.finish_to_commit_us as f64 / 1000.0 / s.commits.max(1) as f64,
        );
    }

    let _ = client.delete_queue().queue_url(&url).send().await;
    let _ = sqlx::query(AssertSqlSafe(format!("DROP SCHEMA IF EXISTS {} CASCADE", schema.as_str())))
        .execute(pg.pool())
        .await;
    Ok(())
}

pub fn main() -> ExitCode {
    brokerfence_testkit::services::load_dotenv();
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .init();
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
            eprintln!("bench_sqs: {e}");
            ExitCode::FAILURE
        }
    }
}
