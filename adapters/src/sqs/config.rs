//! The SQS client (from the standard AWS environment, one rustls/ring HTTP stack) and the
//! configuration of an SQS source.

use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::config::timeout::TimeoutConfig;
use aws_smithy_http_client::tls::{Provider, rustls_provider::CryptoMode};
use fence::{QueueName, RetryPolicy};

use super::error::SqsError;
use super::key::KeyStrategy;
use crate::builder::setters;

/// Longest visibility timeout SQS accepts (12 hours).
pub(crate) const MAX_VISIBILITY: Duration = Duration::from_secs(43_200);
/// Longest long-poll wait SQS accepts.
pub(crate) const MAX_WAIT: Duration = Duration::from_secs(20);
/// Most messages one receive (or one batch call) may carry.
pub(crate) const MAX_BATCH: usize = 10;

/// The HTTP client the SDK uses: hyper 1 with rustls on *ring* (no aws-lc, no second stack).
/// [`client`] puts it on every client it builds.
#[doc(hidden)]
pub fn http_client() -> aws_sdk_sqs::config::SharedHttpClient {
    aws_smithy_http_client::Builder::new().tls_provider(Provider::Rustls(CryptoMode::Ring)).build_https()
}

/// Timeouts of the SDK client: connecting, one attempt of an operation, and a whole operation
/// (all its retries). Without them a hung connection hangs the call for good.
///
/// The defaults fit SQS's longest long poll (20 s): connect 3 s, one attempt 25 s, an operation
/// 60 s. The calls the source makes on behalf of a live lease (visibility changes, deletes) are
/// bounded more tightly by the source itself ([`SqsConfig::call_timeout`], and a third of the
/// lease for the visibility extensions that follow a heartbeat), whatever the client allows.
///
/// **Bringing your own client?** Set an operation timeout and an operation attempt timeout on it
/// (`TimeoutConfig::builder().operation_timeout(..).operation_attempt_timeout(..)`, as
/// [`client`] sets them): the attempt timeout above your receive wait time, the operation
/// timeout a small multiple of it. The source bounds its own calls either way.
///
/// ```no_run
/// # async fn demo() {
/// use std::time::Duration;
/// use brokerfence::sqs::{SqsTimeouts, aws_config, client};
/// let timeouts = SqsTimeouts::default().attempt(Duration::from_secs(22));
/// let sqs = client(aws_config::from_env(), timeouts).await;
/// let attempt = sqs.config().timeout_config().and_then(|t| t.operation_attempt_timeout());
/// assert_eq!(attempt, Some(Duration::from_secs(22)));
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SqsTimeouts {
    connect: Duration,
    attempt: Duration,
    operation: Duration,
}

impl SqsTimeouts {
    setters! {
        /// Connect timeout.
        pub fn connect(d: Duration) { connect = d }

        /// Timeout of one attempt of an operation (keep it above the receive wait time).
        pub fn attempt(d: Duration) { attempt = d }

        /// Timeout of a whole operation, retries included.
        pub fn operation(d: Duration) { operation = d }
    }

    /// The SDK's timeout configuration for these values.
    pub(crate) fn timeout_config(&self) -> TimeoutConfig {
        TimeoutConfig::builder()
            .connect_timeout(self.connect)
            .operation_attempt_timeout(self.attempt)
            .operation_timeout(self.operation)
            .build()
    }
}

impl Default for SqsTimeouts {
    fn default() -> Self {
        Self { connect: Duration::from_secs(3), attempt: Duration::from_secs(25), operation: Duration::from_secs(60) }
    }
}

/// An SQS client from an AWS configuration loader, on rustls (*ring*) and with `timeouts`.
/// `aws_config::from_env()` reads the standard AWS environment (`AWS_ENDPOINT_URL_SQS` /
/// `AWS_ENDPOINT_URL`, `AWS_REGION`, credentials from the environment, a profile, web identity,
/// the container or instance metadata); set an endpoint, region or credentials on the loader
/// to choose them yourself.
///
/// ```no_run
/// # async fn demo() {
/// use brokerfence::sqs::{SqsTimeouts, aws_config, client};
/// let sqs = client(aws_config::from_env(), SqsTimeouts::default()).await;
/// assert!(sqs.config().timeout_config().and_then(|t| t.operation_timeout()).is_some());
/// let local = client(aws_config::from_env().endpoint_url("http://127.0.0.1:4566"), SqsTimeouts::default()).await;
/// # let _ = local; }
/// ```
pub async fn client(loader: aws_config::ConfigLoader, timeouts: SqsTimeouts) -> Client {
    let sdk = loader.http_client(http_client()).timeout_config(timeouts.timeout_config()).load().await;
    Client::new(&sdk)
}

/// Whether a queue URL names a FIFO queue (its name ends in `.fifo`).
///
/// ```
/// assert!(brokerfence::sqs::is_fifo_url("http://127.0.0.1:4566/000000000000/jobs.fifo"));
/// assert!(!brokerfence::sqs::is_fifo_url("https://sqs.eu-west-1.amazonaws.com/123/jobs"));
/// ```
pub fn is_fifo_url(url: &str) -> bool {
    url.trim_end_matches('/').ends_with(".fifo")
}

/// The queue name of a queue URL: its last path segment.
pub(crate) fn queue_name_of_url(url: &str) -> Result<QueueName, SqsError> {
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
#[non_exhaustive]
pub enum DeadLetterTarget {
    /// The queue's own dead-letter queue, read once from its `RedrivePolicy`.
    #[default]
    Discover,
    /// This queue URL.
    Queue(String),
    /// None: such messages stay in the queue, hidden for a while (see
    /// [`SqsError::NoDeadLetterQueue`](super::SqsError::NoDeadLetterQueue)), and are logged.
    None,
}

/// What the source does when the queue's RedrivePolicy `maxReceiveCount` is lower than the retry
/// policy needs (see [`SqsSource::check_max_receive_count`](super::SqsSource::check_max_receive_count)).
#[non_exhaustive]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ReceiveCountCheck {
    /// No check.
    Off,
    /// Log a warning naming the numbers and the fix, then run.
    #[default]
    Warn,
    /// Refuse to receive: the first receive fails with
    /// [`SqsError::MaxReceiveCountTooLow`](super::SqsError::MaxReceiveCountTooLow) and the
    /// consumer stops.
    Refuse,
}

/// How an [`SqsSource`](super::SqsSource) reads its queue.
///
/// ```
/// use std::time::Duration;
/// use brokerfence::sqs::{KeyStrategy, SqsConfig};
/// let config = SqsConfig::new("http://127.0.0.1:4566/000000000000/orders")
///     .unwrap()
///     .key(KeyStrategy::attribute("order-id"))
///     .wait_time(Duration::from_secs(5));
/// assert_eq!(config.get_fence_queue_name().as_str(), "orders");
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
    pub(crate) call_timeout: Duration,
    pub(crate) receive_check: ReceiveCountCheck,
    pub(crate) retry: RetryPolicy,
    pub(crate) receive_headroom: u32,
}

/// Default [`SqsConfig::call_timeout`].
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_secs(10);
/// Default [`SqsConfig::receive_headroom`]: receives a job may take beyond its attempts (holds
/// while another worker has it, takeovers).
pub const DEFAULT_RECEIVE_HEADROOM: u32 = 3;

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
            call_timeout: DEFAULT_CALL_TIMEOUT,
            receive_check: ReceiveCountCheck::Warn,
            retry: RetryPolicy::default(),
            receive_headroom: DEFAULT_RECEIVE_HEADROOM,
        })
    }

    setters! {
        /// How the job key of a message is chosen.
        pub fn key(key: KeyStrategy) { key = key }

        /// The fence's queue name for these jobs (default: the SQS queue name). Jobs of two SQS queues
        /// sharing a fence queue name share keys.
        pub fn fence_queue_name(name: QueueName) { fence_queue = name }

        /// Long-poll wait per receive, at most 20 s (whole seconds; 0 = short polling).
        pub fn wait_time(wait: Duration) { wait_time = wait.min(MAX_WAIT) }

        /// Visibility timeout asked for at receive. Default: the lease length, so the broker's hint
        /// starts out equal to the database lease. Keep it no shorter than the lease: a receipt handle
        /// is used only while the visibility set with it lasts (after that another receiver may hold
        /// a newer one), so with a shorter one a message may be neither extended nor deleted through
        /// this receive (its redelivery is settled instead).
        pub fn visibility_timeout(visibility: Duration) { visibility = Some(visibility.min(MAX_VISIBILITY)) }

        /// Where dead-lettered messages go (default: the queue's RedrivePolicy target). A queue with
        /// neither cannot dead-letter a message without a job key: name one here, e.g.
        /// `SqsConfig::dead_letter(DeadLetterTarget::Queue(url))` (`sqs_worker --dead-letter-queue URL`).
        ///
        /// ```
        /// use brokerfence::sqs::{DeadLetterTarget, SqsConfig};
        /// let config = SqsConfig::new("http://127.0.0.1:4566/000000000000/orders")
        ///     .unwrap()
        ///     .dead_letter(DeadLetterTarget::Queue("http://127.0.0.1:4566/000000000000/orders-dlq".into()));
        /// # let _ = config;
        /// ```
        pub fn dead_letter(target: DeadLetterTarget) { dead_letter = target }

        /// Read ahead (default off; standard queues only): while the queue has a backlog, the next
        /// batch's `ReceiveMessage` calls are sent as soon as one batch is handed to the runtime, so
        /// the next receive finds its messages already there. Up to one batch may then be in hand
        /// beyond the consumer's concurrency; a message left waiting longer than half its visibility
        /// timeout is given back unstarted, and
        /// [`SqsSource::release_unstarted`](super::SqsSource::release_unstarted) gives back the rest at
        /// shutdown. It hides the receive round trip; measure (`bench_sqs --read-ahead`)
        /// before turning it on: with the runtime claiming in its own task the gain was within noise.
        ///
        /// ```
        /// let config = brokerfence::sqs::SqsConfig::new("http://127.0.0.1:4566/000000000000/q").unwrap().read_ahead(true);
        /// # let _ = config;
        /// ```
        pub fn read_ahead(on: bool) { read_ahead = on }

        /// The longest the source waits for one SQS call it makes on behalf of a lease (delete,
        /// visibility change, dead-letter move; a receive gets its wait time on top). Default
        /// [`DEFAULT_CALL_TIMEOUT`]. The visibility extensions that follow a heartbeat are bounded by
        /// the smaller of this and a third of the lease time left. A call that runs out fails with
        /// [`SqsError::Timeout`](super::SqsError::Timeout) (transient: the message comes back and
        /// the fence deduplicates it).
        pub fn call_timeout(d: Duration) { call_timeout = d.max(Duration::from_millis(10)) }

        /// How the queue's RedrivePolicy `maxReceiveCount` is checked at the first receive, against
        /// `retry` (the retry policy of the consumer's
        /// [`SupervisorConfig`](fence::SupervisorConfig): pass the same one). Default: warn, against
        /// [`RetryPolicy::default`]. The rule is in
        /// [`SqsSource::check_max_receive_count`](super::SqsSource::check_max_receive_count).
        ///
        /// ```
        /// use brokerfence::sqs::{ReceiveCountCheck, SqsConfig};
        /// let config = SqsConfig::new("http://127.0.0.1:4566/000000000000/orders")
        ///     .unwrap()
        ///     .check_receive_count(brokerfence::RetryPolicy::default(), ReceiveCountCheck::Refuse);
        /// # let _ = config;
        /// ```
        pub fn check_receive_count(retry: RetryPolicy, mode: ReceiveCountCheck) { retry = retry; receive_check = mode }

        /// Receives a job may take beyond one per attempt, for holds (another worker has the job)
        /// and takeovers. Default [`DEFAULT_RECEIVE_HEADROOM`].
        pub fn receive_headroom(n: u32) { receive_headroom = n }
    }

    /// The queue URL.
    pub fn queue_url(&self) -> &str {
        &self.queue_url
    }

    /// The fence's queue name.
    pub fn get_fence_queue_name(&self) -> &QueueName {
        &self.fence_queue
    }

    /// The key strategy.
    pub fn get_key(&self) -> &KeyStrategy {
        &self.key
    }

    /// Whether the queue is a FIFO queue.
    pub fn is_fifo(&self) -> bool {
        self.fifo
    }
}

/// Whole seconds for a visibility timeout: rounded up, clamped to SQS's 0..=12 h.
pub(crate) fn visibility_secs(d: Duration) -> i32 {
    let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
    i32::try_from(secs.min(MAX_VISIBILITY.as_secs())).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_names_and_visibility_seconds() {
        let q = queue_name_of_url("http://127.0.0.1:4566/000000000000/orders").unwrap();
        assert_eq!(q.as_str(), "orders");
        assert!(queue_name_of_url("http://127.0.0.1:4566/").is_err());
        assert_eq!(visibility_secs(Duration::from_millis(1)), 1);
        assert_eq!(visibility_secs(Duration::from_secs(3)), 3);
        assert_eq!(visibility_secs(Duration::from_secs(100_000)), 43_200);
    }

    #[test]
    fn timeouts_become_the_sdk_timeout_config() {
        let t = SqsTimeouts::default().attempt(Duration::from_secs(22));
        let c = t.timeout_config();
        assert_eq!(c.operation_attempt_timeout(), Some(Duration::from_secs(22)));
        assert_eq!(c.operation_timeout(), Some(Duration::from_secs(60)));
    }
}
