//! SQS (feature `sqs`): the queue, its dead-letter queue and the source of a worker.

use super::*;
use brokerfence::sqs::aws_sdk_sqs::Client;
use brokerfence::sqs::aws_sdk_sqs::error::{DisplayErrorContext, SdkError};
use brokerfence::sqs::aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName, SendMessageBatchRequestEntry};
use brokerfence::sqs::{KeyStrategy, SqsConfig, SqsSource, aws_config};

/// The message attribute that carries the job key.
pub const KEY_ATTRIBUTE: &str = "job-key";

/// The AWS settings of `localstack/up` (or the environment), for the runner and its workers.
pub fn aws_env() -> Vec<(String, String)> {
    ["AWS_ENDPOINT_URL_SQS", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
        .iter()
        .filter_map(|n| brokerfence_testkit::services::var(n).map(|v| ((*n).to_owned(), v)))
        .collect()
}

/// `host:port` of a plain-HTTP SQS endpoint on this machine (LocalStack), for the stall
/// proxy.
pub fn endpoint_host_port() -> Option<String> {
    let url = aws_env().into_iter().find(|(k, _)| k == "AWS_ENDPOINT_URL_SQS")?.1;
    let rest = url.strip_prefix("http://")?;
    let host_port = rest.split('/').next()?;
    let host = host_port.rsplit_once(':').map(|(h, _)| h).unwrap_or(host_port);
    matches!(host, "127.0.0.1" | "localhost").then(|| host_port.to_owned())
}

async fn client() -> Client {
    let env: HashMap<String, String> = aws_env().into_iter().collect();
    let mut loader = aws_config::defaults(aws_config::BehaviorVersion::latest());
    if let Some(endpoint) = env.get("AWS_ENDPOINT_URL_SQS") {
        loader = loader.endpoint_url(endpoint);
    }
    if let Some(region) = env.get("AWS_REGION") {
        loader = loader.region(aws_config::Region::new(region.clone()));
    }
    if let (Some(id), Some(secret)) = (env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")) {
        let creds = brokerfence::sqs::aws_sdk_sqs::config::Credentials::new(id, secret, None, None, "chaos");
        loader = loader.credentials_provider(creds);
    }
    brokerfence::sqs::client(loader, brokerfence::sqs::SqsTimeouts::default()).await
}

fn err<E, R>(what: &'static str) -> impl FnOnce(SdkError<E, R>) -> String
where
    SdkError<E, R>: std::error::Error + 'static,
{
    move |e| format!("{what}: {} (is LocalStack up? run `bash localstack/up`)", DisplayErrorContext(e))
}

pub struct SqsBroker {
    client: Client,
    url: String,
    dlq: String,
}

impl SqsBroker {
    pub async fn setup(c: &ChaosConfig, queue: &QueueName, jobs: &[(String, Kind)]) -> Result<Self, String> {
        let client = client().await;
        let (dlq, arn) = brokerfence_testkit::sqs::create_dlq(&client, &format!("{}-dlq", queue.as_str())).await?;
        let url = client
            .create_queue()
            .queue_name(queue.as_str())
            .attributes(QueueAttributeName::VisibilityTimeout, c.lease_secs.to_string())
            .attributes(
                QueueAttributeName::RedrivePolicy,
                format!("{{\"deadLetterTargetArn\":\"{arn}\",\"maxReceiveCount\":\"1000\"}}"),
            )
            .send()
            .await
            .map_err(err("CreateQueue"))?
            .queue_url()
            .ok_or("no queue url")?
            .to_owned();
        for chunk in jobs.chunks(10) {
            let entries = chunk
                .iter()
                .enumerate()
                .map(|(i, (key, kind))| {
                    let body = match kind {
                        // SQS bodies must be text: an undecodable one is simply not JSON.
                        Kind::Poison => "{poison".to_owned(),
                        other => String::from_utf8_lossy(payload_of(*other)).into_owned(),
                    };
                    let attr = MessageAttributeValue::builder()
                        .data_type("String")
                        .string_value(key)
                        .build()
                        .map_err(|e| e.to_string())?;
                    SendMessageBatchRequestEntry::builder()
                        .id(format!("m{i}"))
                        .message_body(body)
                        .message_attributes(KEY_ATTRIBUTE, attr)
                        .build()
                        .map_err(|e| e.to_string())
                })
                .collect::<Result<Vec<_>, String>>()?;
            let out = client
                .send_message_batch()
                .queue_url(&url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(err("SendMessageBatch"))?;
            if !out.failed().is_empty() {
                return Err(format!("SendMessageBatch refused {} entries", out.failed().len()));
            }
        }
        Ok(Self { client, url, dlq })
    }

    pub fn worker_args(&self) -> Vec<String> {
        vec!["--sqs-queue-url".into(), self.url.clone()]
    }

    /// Poison jobs found in the dead-letter queue (by the key attribute the copy keeps).
    pub async fn dead_letters(&self, poison: &HashSet<String>) -> Result<usize, String> {
        let mut found = HashSet::new();
        let mut empty = 0;
        while empty < 2 {
            let out = self
                .client
                .receive_message()
                .queue_url(&self.dlq)
                .max_number_of_messages(10)
                .wait_time_seconds(1)
                .visibility_timeout(60)
                .message_attribute_names("All")
                .send()
                .await
                .map_err(|e| format!("ReceiveMessage (dlq): {e}"))?;
            let messages = out.messages();
            if messages.is_empty() {
                empty += 1;
            }
            for m in messages {
                let key = m
                    .message_attributes()
                    .and_then(|a| a.get(KEY_ATTRIBUTE))
                    .and_then(|v| v.string_value())
                    .unwrap_or_default();
                if poison.contains(key) {
                    found.insert(key.to_owned());
                }
            }
        }
        Ok(found.len())
    }

    pub async fn cleanup(self) {
        for url in [&self.url, &self.dlq] {
            let _ = self.client.delete_queue().queue_url(url).send().await;
        }
    }
}

pub async fn worker_source(o: &WorkerOpts, _queue: QueueName) -> Result<SqsSource, String> {
    let url = o.sqs_queue_url.clone().ok_or("--sqs-queue-url is required for --source sqs")?;
    let config = SqsConfig::new(url)
        .map_err(|e| e.to_string())?
        .key(KeyStrategy::attribute(KEY_ATTRIBUTE))
        .wait_time(Duration::from_secs(1));
    Ok(SqsSource::new(
        brokerfence::sqs::client(brokerfence::sqs::aws_config::from_env(), brokerfence::sqs::SqsTimeouts::default())
            .await,
        config,
    ))
}
