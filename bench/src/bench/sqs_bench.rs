//! SQS (LocalStack): fenced against a plain receive/delete consumer.

use super::*;
use brokerfence::sqs::aws_sdk_sqs::Client;
use brokerfence::sqs::aws_sdk_sqs::types::{DeleteMessageBatchRequestEntry, SendMessageBatchRequestEntry};
use brokerfence::sqs::{KeyStrategy, SqsConfig, SqsRetrofit, SqsSource, aws_config};
use futures::StreamExt;

async fn client() -> Client {
    let var = |n: &str| brokerfence_testkit::services::var(n);
    let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
    if let Some(endpoint) = var("AWS_ENDPOINT_URL_SQS") {
        loader = loader.endpoint_url(endpoint);
    }
    loader = loader.region(aws_config::Region::new(var("AWS_REGION").unwrap_or_else(|| "us-east-1".into())));
    if let (Some(id), Some(secret)) = (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY")) {
        let creds = brokerfence::sqs::aws_sdk_sqs::config::Credentials::new(id, secret, None, None, "bench");
        loader = loader.credentials_provider(creds);
    }
    brokerfence::sqs::client(loader, brokerfence::sqs::SqsTimeouts::default()).await
}

async fn queue(client: &Client, n: usize) -> Result<String, String> {
    let name = format!("bench-{:08x}", rand::random::<u32>());
    let url = client
        .create_queue()
        .queue_name(&name)
        .send()
        .await
        .map_err(|e| format!("CreateQueue: {e}"))?
        .queue_url()
        .ok_or("no queue url")?
        .to_owned();
    let batches: Vec<Vec<SendMessageBatchRequestEntry>> = (0..n)
        .collect::<Vec<_>>()
        .chunks(10)
        .map(|c| {
            c.iter()
                .map(|i| {
                    SendMessageBatchRequestEntry::builder().id(format!("m{i}")).message_body(format!("job {i}")).build()
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let sent: Vec<Result<(), String>> = futures::stream::iter(batches)
        .map(|entries| {
            let (client, url) = (client.clone(), url.clone());
            async move {
                client
                    .send_message_batch()
                    .queue_url(url)
                    .set_entries(Some(entries))
                    .send()
                    .await
                    .map(drop)
                    .map_err(|e| e.to_string())
            }
        })
        .buffer_unordered(8)
        .collect()
        .await;
    sent.into_iter().collect::<Result<Vec<()>, String>>()?;
    Ok(url)
}

struct PlainSqs {
    client: Client,
    url: String,
}

impl PlainBroker for PlainSqs {
    type Handle = String;
    async fn receive(&self, max: usize) -> Result<Vec<String>, String> {
        let out = self
            .client
            .receive_message()
            .queue_url(&self.url)
            .max_number_of_messages(i32::try_from(max.min(10)).unwrap_or(10))
            .wait_time_seconds(1)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        Ok(out.messages().iter().filter_map(|m| m.receipt_handle().map(str::to_owned)).collect())
    }
    async fn ack(&self, handles: Vec<String>) -> Result<usize, String> {
        let entries = handles
            .into_iter()
            .enumerate()
            .map(|(i, h)| DeleteMessageBatchRequestEntry::builder().id(format!("d{i}")).receipt_handle(h).build())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let out = self
            .client
            .delete_message_batch()
            .queue_url(&self.url)
            .set_entries(Some(entries))
            .send()
            .await
            .map_err(|e| e.to_string())?;
        Ok(out.successful().len())
    }
}

fn source(client: &Client, url: &str) -> Result<SqsSource, String> {
    let config = SqsConfig::new(url.to_owned())
        .map_err(|e| e.to_string())?
        .key(KeyStrategy::MessageId)
        .wait_time(Duration::from_secs(1));
    Ok(SqsSource::new(client.clone(), config))
}

pub async fn run(o: &Opts, pg: &table::Pg) -> Result<(), String> {
    println!("\n[sqs on LocalStack] (batches of 10, concurrency {})", o.broker_concurrency);
    let client = client().await;
    if let Err(e) = tokio::time::timeout(Duration::from_secs(5), client.list_queues().send())
        .await
        .map_err(|_| "timeout".to_owned())
        .and_then(|r| r.map_err(|e| e.to_string()))
    {
        println!("  skipped: SQS does not answer ({e}); run `bash localstack/up`");
        return Ok(());
    }
    let n = if o.quick { 300 } else { 2000 };
    let counting = Counting::new(Arc::new(pg.fence.clone()));
    let mut queues = Vec::new();
    let (mut plain, mut fenced, mut per_msg, mut breakdown) = (None::<Rate>, None::<Rate>, 0.0, String::new());
    for _ in 0..o.rounds {
        let url = queue(&client, n).await?;
        queues.push(url.clone());
        let p = PlainLoop { concurrency: o.broker_concurrency, batch: 10, work: o.work }
            .run(Arc::new(PlainSqs { client: client.clone(), url }), n)
            .await?;
        plain = Some(plain.filter(|b| b.per_sec() >= p.per_sec()).unwrap_or(p));
        let url = queue(&client, n).await?;
        queues.push(url.clone());
        let (f, per, br) = fenced_run(o, source(&client, &url)?, 10, &counting, n).await?;
        if fenced.is_none_or(|b| f.per_sec() > b.per_sec()) {
            (fenced, per_msg, breakdown) = (Some(f), per, br);
        }
    }
    let (Some(plain), Some(fenced)) = (plain, fenced) else { return Err("no rounds".into()) };

    // Sequential latency: receive one, handle, delete; fenced through the retrofit path.
    let m = if o.quick { 50 } else { 200 };
    let url = queue(&client, 2 * m).await?;
    queues.push(url.clone());
    let plain_broker = PlainSqs { client: client.clone(), url: url.clone() };
    let mut p = plain_latencies(&plain_broker, m).await?;
    let store: Arc<dyn FenceStore> = Arc::new(pg.fence.clone());
    let lease = LeaseDuration::from_secs(30).map_err(|e| e.to_string())?;
    let retrofit = SqsRetrofit::new(store, source(&client, &url)?, SupervisorConfig::new(lease));
    let mut f = Vec::new();
    while f.len() < m {
        let t = Instant::now();
        let out = client
            .receive_message()
            .queue_url(&url)
            .max_number_of_messages(1)
            .wait_time_seconds(1)
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let Some(msg) = out.messages().first() else { continue };
        let done = retrofit.process(msg, |_ctx: JobContext| async { Ok(b"ok".to_vec()) }).await;
        if done.reason() != brokerfence::Reason::Committed || done.broker_error.is_some() {
            return Err(format!("retrofit: {done:?}"));
        }
        f.push(t.elapsed());
    }
    p.sort();
    f.sort();
    print_broker_figures(plain, fenced, per_msg, &breakdown, (&f, &p));

    let samples = if o.quick { 5 } else { 12 };
    let url = queue(&client, samples).await?;
    queues.push(url.clone());
    print_cancellation(&consumer_cancellation(source(&client, &url)?, &pg.fence, samples).await?);
    for u in queues {
        let _ = client.delete_queue().queue_url(u).send().await;
    }
    Ok(())
}
