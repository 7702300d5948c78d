//! Support for the SQS tests (feature `sqs`): where SQS is, a fresh queue per test, worker
//! processes driven by their `EVENT` lines ([`worker`]), and a recording proxy in front of SQS
//! ([`proxy`]). The store helpers ([`crate::store`]) and the receiver ([`crate::receiver`]) are
//! re-exported here for the SQS tests' glob imports.
//!
//! SQS: `AWS_ENDPOINT_URL_SQS` (the environment, else `localstack/.env`). Without one, when a
//! Docker engine answers, LocalStack is started once per test binary with testcontainers (and
//! removed at exit; [`crate::localstack`], feature `docker`). With neither, the tests fail at once
//! and say to run `localstack/up`.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use brokerfence::sqs::aws_config::{self, BehaviorVersion, Region};
use brokerfence::sqs::aws_sdk_sqs::Client;
use brokerfence::sqs::aws_sdk_sqs::config::Credentials;
use brokerfence::sqs::aws_sdk_sqs::types::{Message, MessageSystemAttributeName, QueueAttributeName};
use brokerfence::{FenceStore, PgFence, QueueName};

use crate::localstack;

pub mod proxy;
pub mod worker;

pub use crate::receiver::{Call, Receiver, calling_handler};
pub use crate::store::{database_url, drop_schema, job, jobs, pg, unique};
pub use crate::wait::eventually;
pub use proxy::{ProxyEvent, ProxyLog, SqsProxy, stale_handle_uses};
pub use worker::{Event, Worker, example, worker_args};

// ---------------------------------------------------------------- where the services are

/// The SQS endpoint and AWS settings the tests (and the worker processes they start) use.
#[derive(Debug, Clone)]
pub struct Aws {
    pub endpoint: String,
    pub region: String,
    pub key_id: String,
    pub secret: String,
}

impl Aws {
    /// Environment for a child process (worker, producer).
    pub fn child_env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL_SQS", self.endpoint.clone()),
            ("AWS_REGION", self.region.clone()),
            ("AWS_ACCESS_KEY_ID", self.key_id.clone()),
            ("AWS_SECRET_ACCESS_KEY", self.secret.clone()),
            ("AWS_EC2_METADATA_DISABLED", "true".into()),
            ("DATABASE_URL", database_url()),
        ]
    }
}

/// The SQS endpoint: configured, or a LocalStack container, or a panic saying what to do.
pub fn aws() -> Aws {
    static AWS: OnceLock<Aws> = OnceLock::new();
    AWS.get_or_init(|| {
        let var = |n: &str, d: &str| crate::services::var(n).unwrap_or_else(|| d.to_owned());
        let region = var("AWS_REGION", "us-east-1");
        let key_id = var("AWS_ACCESS_KEY_ID", "test");
        let secret = var("AWS_SECRET_ACCESS_KEY", "test");
        let configured = crate::services::var("AWS_ENDPOINT_URL_SQS").or_else(|| crate::services::var("AWS_ENDPOINT_URL"));
        let endpoint = match configured {
            Some(ep) => {
                assert!(
                    localstack::answers(&ep),
                    "the SQS endpoint {ep} (AWS_ENDPOINT_URL_SQS) does not answer: run `localstack/up` first"
                );
                ep
            }
            None if localstack::docker_answers() => localstack::start().unwrap_or_else(|e| panic!("{e}")),
            None => panic!(
                "no SQS endpoint: AWS_ENDPOINT_URL_SQS is not set (nor in localstack/.env) and no Docker engine \
                 answers for testcontainers. Run `localstack/up` first (it starts LocalStack and writes localstack/.env)."
            ),
        };
        Aws { endpoint, region, key_id, secret }
    })
    .clone()
}

/// An SQS client for the test endpoint.
pub async fn sqs() -> Client {
    client_at(&aws().endpoint).await
}

/// An SQS client for `endpoint` (the test endpoint, or a proxy in front of it), with the test's
/// region and credentials and the adapter's HTTP client.
pub async fn client_at(endpoint: &str) -> Client {
    brokerfence::sqs::client(loader_at(endpoint), brokerfence::sqs::SqsTimeouts::default()).await
}

/// The SDK loader for `endpoint` with the test's region and credentials, nothing else set.
pub fn loader_at(endpoint: &str) -> aws_config::ConfigLoader {
    let aws = aws();
    aws_config::defaults(BehaviorVersion::latest())
        .endpoint_url(endpoint)
        .region(Region::new(aws.region.clone()))
        .credentials_provider(Credentials::new(aws.key_id.clone(), aws.secret.clone(), None, None, "sqs-tests"))
}

// ---------------------------------------------------------------- queues

/// A queue made for one test; delete it with [`TestQueue::delete`].
#[derive(Debug, Clone)]
pub struct TestQueue {
    pub url: String,
    pub name: String,
    pub dlq: Option<String>,
}

impl TestQueue {
    /// Standard queue with a visibility timeout.
    pub async fn new(client: &Client, prefix: &str, visibility: u32) -> Self {
        Self::create(client, prefix, visibility, None, false).await
    }

    /// Standard queue with a dead-letter queue after `max_receives`.
    pub async fn with_dlq(client: &Client, prefix: &str, visibility: u32, max_receives: u32) -> Self {
        Self::create(client, prefix, visibility, Some(max_receives), false).await
    }

    /// FIFO queue (explicit deduplication ids).
    pub async fn fifo(client: &Client, prefix: &str, visibility: u32) -> Self {
        Self::create(client, prefix, visibility, None, true).await
    }

    async fn create(client: &Client, prefix: &str, visibility: u32, max_receives: Option<u32>, fifo: bool) -> Self {
        let name = unique(&format!("t-{prefix}"));
        let full = if fifo { format!("{name}.fifo") } else { name.clone() };
        let mut dlq = None;
        let mut req = client
            .create_queue()
            .queue_name(&full)
            .attributes(QueueAttributeName::VisibilityTimeout, visibility.to_string());
        if fifo {
            req = req.attributes(QueueAttributeName::FifoQueue, "true");
        }
        if let Some(max) = max_receives {
            let (dlq_url, arn) = create_dlq(client, &format!("{name}-dlq")).await.expect("create DLQ");
            req = req.attributes(
                QueueAttributeName::RedrivePolicy,
                format!(r#"{{"deadLetterTargetArn":"{arn}","maxReceiveCount":"{max}"}}"#),
            );
            dlq = Some(dlq_url);
        }
        let url = req.send().await.expect("create queue").queue_url().expect("queue url").to_owned();
        Self { url, name: full, dlq }
    }

    /// The fence queue name of this queue.
    pub fn fence_queue(&self) -> QueueName {
        QueueName::new(self.name.clone()).expect("queue name")
    }

    /// Deletes the queue and its DLQ (best effort).
    pub async fn delete(&self, client: &Client) {
        let _ = client.delete_queue().queue_url(&self.url).send().await;
        if let Some(d) = &self.dlq {
            let _ = client.delete_queue().queue_url(d).send().await;
        }
    }
}

/// Sends one message; returns its MessageId.
pub async fn send(client: &Client, url: &str, body: &str) -> String {
    client
        .send_message()
        .queue_url(url)
        .message_body(body)
        .send()
        .await
        .expect("send")
        .message_id()
        .expect("id")
        .to_owned()
}

/// Visible + in-flight (+ delayed) messages of a queue.
pub async fn depth(client: &Client, url: &str) -> u64 {
    let out = client
        .get_queue_attributes()
        .queue_url(url)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessages)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesNotVisible)
        .attribute_names(QueueAttributeName::ApproximateNumberOfMessagesDelayed)
        .send()
        .await
        .expect("queue attributes");
    out.attributes().map(|a| a.values().filter_map(|v| v.parse::<u64>().ok()).sum()).unwrap_or(0)
}

/// Receives (and deletes) every message of a queue within `wait`, with all attributes.
pub async fn drain(client: &Client, url: &str, expect: usize, wait: Duration) -> Vec<Message> {
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + wait;
    while out.len() < expect && tokio::time::Instant::now() < deadline {
        let got = receive_raw(client, url, 1).await;
        for m in &got {
            if let Some(h) = m.receipt_handle() {
                let _ = client.delete_message().queue_url(url).receipt_handle(h).send().await;
            }
        }
        out.extend(got);
    }
    out
}

/// One plain receive (up to 10, all attributes), without deleting.
pub async fn receive_raw(client: &Client, url: &str, wait_secs: i32) -> Vec<Message> {
    client
        .receive_message()
        .queue_url(url)
        .max_number_of_messages(10)
        .wait_time_seconds(wait_secs)
        .message_attribute_names("All")
        .message_system_attribute_names(MessageSystemAttributeName::All)
        .send()
        .await
        .expect("receive")
        .messages
        .unwrap_or_default()
}

/// Tracing to the test output (once per binary); `RUST_LOG` to tune.
pub fn init_tracing() {
    static INIT: OnceLock<()> = OnceLock::new();
    INIT.get_or_init(|| {
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
            .try_init();
    });
}

/// A store handle as the runtime wants it.
pub fn dyn_store(fence: &PgFence) -> Arc<dyn FenceStore> {
    Arc::new(fence.clone())
}

/// Creates the dead-letter queue `name` and returns its URL and ARN (for a redrive policy). Used
/// by the tests' queues and by the chaos harness.
pub async fn create_dlq(client: &Client, name: &str) -> Result<(String, String), String> {
    use brokerfence::sqs::aws_sdk_sqs::error::DisplayErrorContext;
    let said =
        |what: &str, e: &dyn std::fmt::Display| format!("{what}: {e} (is LocalStack up? run `bash localstack/up`)");
    let created = client.create_queue().queue_name(name).send().await;
    let url = created
        .map_err(|e| said("CreateQueue (dlq)", &DisplayErrorContext(e)))?
        .queue_url()
        .ok_or("CreateQueue (dlq) answered no queue url")?
        .to_owned();
    let attributes =
        client.get_queue_attributes().queue_url(&url).attribute_names(QueueAttributeName::QueueArn).send().await;
    let arn = attributes
        .map_err(|e| said("GetQueueAttributes (dlq)", &DisplayErrorContext(e)))?
        .attributes()
        .and_then(|a| a.get(&QueueAttributeName::QueueArn).cloned())
        .ok_or("the dlq has no ARN")?;
    Ok((url, arn))
}
