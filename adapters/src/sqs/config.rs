//! The SQS client (from the standard AWS environment, one rustls/ring HTTP stack) and the
//! configuration of an SQS source.

use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_smithy_http_client::tls::{Provider, rustls_provider::CryptoMode};
use fence::QueueName;

use super::error::SqsError;
use super::key::KeyStrategy;

/// Longest visibility timeout SQS accepts (12 hours).
pub const MAX_VISIBILITY: Duration = Duration::from_secs(43_200);
/// Longest long-poll wait SQS accepts.
pub const MAX_WAIT: Duration = Duration::from_secs(20);
/// Most messages one receive (or one batch call) may carry.
pub const MAX_BATCH: usize = 10;

/// The HTTP client the SDK uses: hyper 1 with rustls on *ring* (no aws-lc, no second stack).
///
/// ```no_run
/// # async fn demo() {
/// let http = adapters::sqs::http_client();
/// let sdk = aws_config::defaults(aws_config::BehaviorVersion::latest()).http_client(http).load().await;
/// let client = aws_sdk_sqs::Client::new(&sdk);
/// # let _ = client; }
/// ```
pub fn http_client() -> aws_sdk_sqs::config::SharedHttpClient {
    aws_smithy_http_client::Builder::new().tls_provider(Provider::Rustls(CryptoMode::Ring)).build_https()
}

/// An SQS client configured from the standard AWS environment: `AWS_ENDPOINT_URL_SQS` /
/// `AWS_ENDPOINT_URL`, `AWS_REGION`, credentials (environment, profile, web identity, container,
/// instance metadata), on [`http_client`].
///
/// ```no_run
/// # async fn demo() {
/// let client = adapters::sqs::client_from_env().await;
/// # let _ = client; }
/// ```
pub async fn client_from_env() -> Client {
    let sdk = aws_config::defaults(aws_config::BehaviorVersion::latest()).http_client(http_client()).load().await;
    Client::new(&sdk)
}

/// Whether a queue URL names a FIFO queue (its name ends in `.fifo`).
///
/// ```
/// assert!(adapters::sqs::is_fifo_url("http://127.0.0.1:4566/000000000000/jobs.fifo"));
/// assert!(!adapters::sqs::is_fifo_url("https://sqs.eu-west-1.amazonaws.com/123/jobs"));
/// ```
pub fn is_fifo_url(url: &str) -> bool {
    url.trim_end_matches('/').ends_with(".fifo")
}

/// The queue name of a queue URL: its last path segment.
///
/// ```
/// let q = adapters::sqs::queue_name_of_url("http://127.0.0.1:4566/000000000000/orders").unwrap();
/// assert_eq!(q.as_str(), "orders");
/// assert!(adapters::sqs::queue_name_of_url("http://127.0.0.1:4566/").is_err());
/// ```
pub fn queue_name_of_url(url: &str) -> Result<QueueName, SqsError> {
    let invalid = |reason: String| SqsError::InvalidQueueUrl { url: url.to_owned(), reason };
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(invalid("must start with http:// or https://".into()));
    }
    let path = url.splitn(4, '/').nth(3).unwrap_or("");
    let name = path.trim_end_matches('/').rsplit('/').next().unwrap_or("");
    if name.is_empty() {
        return Err(invalid("has no queue name in its path".into()));
    }
    QueueName::new(name).map_err(|e| invalid(e.to_string()))
}

/// Where messages that must be dead-lettered go.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum DeadLetterTarget {
    /// The queue's own dead-letter queue, read once from its `RedrivePolicy`.
    #[default]
    Discover,
    /// This queue URL.
    Queue(String),
    /// None: such messages are left to the broker (and logged).
    None,
}

/// How an [`SqsSource`](super::SqsSource) reads its queue.
///
/// ```
/// use std::time::Duration;
/// use adapters::sqs::{KeyStrategy, SqsConfig};
/// let config = SqsConfig::new("http://127.0.0.1:4566/000000000000/orders")
///     .unwrap()
///     .key(KeyStrategy::attribute("order-id"))
///     .wait_time(Duration::from_secs(5));
/// assert_eq!(config.fence_queue().as_str(), "orders");
/// assert!(!config.is_fifo());
/// ```
#[derive(Debug, Clone)]
pub struct SqsConfig {
    pub(crate) queue_url: String,
    pub(crate) fence_queue: QueueName,
    pub(crate) key: KeyStrategy,
    pub(crate) wait_time: Duration,
    pub(crate) visibility: Option<Duration>,
    pub(crate) dead_letter: DeadLetterTarget,
    pub(crate) fifo: bool,
    pub(crate) read_ahead: bool,
}

impl SqsConfig {
    /// A source for `queue_url`: jobs fenced under the queue's name, keys by
    /// [`KeyStrategy::Auto`], 20 s long polls, initial visibility = the lease, dead-letter queue
    /// from the queue's RedrivePolicy.
    pub fn new(queue_url: impl Into<String>) -> Result<Self, SqsError> {
        let queue_url = queue_url.into();
        let fence_queue = queue_name_of_url(&queue_url)?;
        let fifo = is_fifo_url(&queue_url);
        Ok(Self {
            queue_url,
            fence_queue,
            key: KeyStrategy::Auto,
            wait_time: MAX_WAIT,
            visibility: None,
            dead_letter: DeadLetterTarget::Discover,
            fifo,
            read_ahead: false,
        })
    }

    /// How the job key of a message is chosen.
    pub fn key(mut self, key: KeyStrategy) -> Self {
        self.key = key;
        self
    }

    /// The fence's queue name for these jobs (default: the SQS queue name). Jobs of two SQS queues
    /// sharing a fence queue name share keys.
    pub fn fence_queue_name(mut self, name: QueueName) -> Self {
        self.fence_queue = name;
        self
    }

    /// Long-poll wait per receive, at most 20 s (whole seconds; 0 = short polling).
    pub fn wait_time(mut self, wait: Duration) -> Self {
        self.wait_time = wait.min(MAX_WAIT);
        self
    }

    /// Visibility timeout asked for at receive. Default: the lease length, so the broker's hint
    /// starts out equal to the database lease.
    pub fn visibility_timeout(mut self, visibility: Duration) -> Self {
        self.visibility = Some(visibility.min(MAX_VISIBILITY));
        self
    }

    /// Where dead-lettered messages go.
    pub fn dead_letter(mut self, target: DeadLetterTarget) -> Self {
        self.dead_letter = target;
        self
    }

    /// Read ahead (default off; standard queues only): while the queue has a backlog, the next
    /// batch's `ReceiveMessage` calls are sent as soon as one batch is handed to the runtime, so
    /// the next receive finds its messages already there. Up to one batch may then be in hand
    /// beyond the consumer's concurrency; a message left waiting longer than half its visibility
    /// timeout is given back unstarted, and
    /// [`SqsSource::release_unstarted`](super::SqsSource::release_unstarted) gives back the rest at
    /// shutdown. It hides the receive round trip; measure (`examples/bench_sqs.rs --read-ahead`)
    /// before turning it on: with the runtime claiming in its own task the gain was within noise.
    ///
    /// ```
    /// let config = adapters::sqs::SqsConfig::new("http://127.0.0.1:4566/000000000000/q").unwrap().read_ahead(true);
    /// # let _ = config;
    /// ```
    pub fn read_ahead(mut self, on: bool) -> Self {
        self.read_ahead = on;
        self
    }

    /// The queue URL.
    pub fn queue_url(&self) -> &str {
        &self.queue_url
    }

    /// The fence's queue name.
    pub fn fence_queue(&self) -> &QueueName {
        &self.fence_queue
    }

    /// The key strategy.
    pub fn key_strategy(&self) -> &KeyStrategy {
        &self.key
    }

    /// Whether the queue is a FIFO queue.
    pub fn is_fifo(&self) -> bool {
        self.fifo
    }
}

/// Whole seconds for a visibility timeout: rounded up, clamped to SQS's 0..=12 h.
///
/// ```
/// use std::time::Duration;
/// assert_eq!(adapters::sqs::visibility_secs(Duration::from_millis(1)), 1);
/// assert_eq!(adapters::sqs::visibility_secs(Duration::from_secs(3)), 3);
/// assert_eq!(adapters::sqs::visibility_secs(Duration::from_secs(100_000)), 43_200);
/// ```
pub fn visibility_secs(d: Duration) -> i32 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    i32::try_from(secs.min(MAX_VISIBILITY.as_secs())).unwrap_or(i32::MAX)
}
