//! The SQS source: receive with long polling, keys per the strategy, and broker calls that only
//! ever follow what the fence decided.

use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::Client;
use fence::{Lease, QueueName};
use tokio::sync::{Notify, OnceCell};
use tracing::Instrument;

use super::batch::{self, Entry};
use super::config::{DeadLetterTarget, SqsConfig, visibility_secs};
use super::delivery::{Registry, Settled, SqsDelivery};
use super::error::{SqsError, bounded, classify, is_missing_queue_code, short_cause};
use super::state::{Ahead, Redrive, SentCopies};
use crate::disposition::Disposition;
use crate::runtime::ReceiveContext;
use crate::source::{DeadLettered, Incoming, Source, SourceError};

/// How many attempts [`SqsSource::check`] makes while SQS cannot be reached.
pub const CHECK_ATTEMPTS: u32 = 3;

/// The endpoint `client` sends to, as far as the environment tells (`AWS_ENDPOINT_URL_SQS`,
/// then `AWS_ENDPOINT_URL`, as the AWS configuration reads them); else the AWS endpoint of the
/// client's region.
fn endpoint_of(client: &Client) -> String {
    ["AWS_ENDPOINT_URL_SQS", "AWS_ENDPOINT_URL"]
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| match client.config().region() {
            Some(r) => format!("https://sqs.{r}.amazonaws.com"),
            None => "the AWS default (no region set)".to_owned(),
        })
}

/// An SQS queue as a [`Source`] of the consumer runtime (or, through
/// [`SqsRetrofit`](super::SqsRetrofit), of your own loop).
///
/// * receive: long polling, up to 10 messages, system attributes `ApproximateReceiveCount`,
///   `MessageDeduplicationId`, `MessageGroupId` and all message attributes; the initial visibility
///   is the lease length; a message without a usable key is [`Incoming::Malformed`].
/// * extend: `ChangeMessageVisibilityBatch` to the time left on the database lease, with the
///   newest receipt handle, only for leases the database just confirmed, and bounded by a third of
///   that time.
/// * every call that uses a receipt handle uses the newest one this process holds, and only
///   while the visibility set with it has not run out (after that another receiver may hold a
///   newer one: the call is not made, and the message's redelivery is settled instead).
/// * ack: `DeleteMessageBatch`, ≤ 10 per call, distinct ids, failed entries retried or reported.
/// * retry later / hold: `ChangeMessageVisibilityBatch` (clamped to 12 h; on FIFO the messages
///   parked behind a kept head are hidden a little longer, and the head and they are remembered
///   as unfinished: a later message of the group waits for them in this worker); abandon:
///   visibility 0.
/// * dead letter: the message hidden long enough for two calls, `SendMessage` to the dead-letter
///   queue with the reason as the `Fence-Dead-Letter-Reason` attribute (and the original id as
///   `Fence-Source-Message-Id`), then `DeleteMessage`; a message this source already copied (its
///   delete had failed) is only deleted, not copied again.
///
/// ```no_run
/// # async fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>) -> Result<(), Box<dyn std::error::Error>> {
/// use brokerfence::sqs::{SqsConfig, SqsSource};
/// use brokerfence::{Consumer, ConsumerConfig};
/// use brokerfence::{LeaseDuration, SupervisorConfig};
/// let client = brokerfence::sqs::client(brokerfence::sqs::aws_config::from_env(), brokerfence::sqs::SqsTimeouts::default()).await;
/// let source = SqsSource::new(client, SqsConfig::new("http://127.0.0.1:4566/000000000000/orders")?);
/// let consumer = Consumer::new(source, store, ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30)?)));
/// consumer.run(|ctx: brokerfence::JobContext| async move { Ok(ctx.payload().to_vec()) }, brokerfence::shutdown_signal()).await?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct SqsSource {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub(super) client: Client,
    pub(super) config: SqsConfig,
    pub(super) registry: Arc<Registry>,
    pub(super) dead_letter_url: OnceCell<Option<String>>,
    pub(super) redrive: OnceCell<Redrive>,
    pub(super) receive_checked: OnceCell<()>,
    /// `ReceiveMessage` calls still running (see [`SqsSource::release_unstarted`]).
    pub(super) receiving: AtomicUsize,
    pub(super) idle: Notify,
    /// Read-ahead state (standard queues).
    pub(super) ahead: tokio::sync::Mutex<Ahead>,
    /// Messages copied to the dead-letter queue (bounded): a repeat only deletes.
    pub(super) sent_copies: std::sync::Mutex<SentCopies>,
}

impl std::fmt::Debug for SqsSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsSource").field("config", &self.inner.config).finish()
    }
}

impl SqsSource {
    /// A source reading `config.queue_url()` with `client`.
    pub fn new(client: Client, config: SqsConfig) -> Self {
        let dead_letter_url = match &config.dead_letter {
            DeadLetterTarget::Queue(url) => OnceCell::new_with(Some(Some(url.clone()))),
            DeadLetterTarget::None => OnceCell::new_with(Some(None)),
            DeadLetterTarget::Discover => OnceCell::new(),
        };
        Self {
            inner: Arc::new(Inner {
                client,
                config,
                registry: Arc::default(),
                dead_letter_url,
                redrive: OnceCell::new(),
                receive_checked: OnceCell::new(),
                receiving: AtomicUsize::new(0),
                idle: Notify::new(),
                ahead: tokio::sync::Mutex::default(),
                sent_copies: std::sync::Mutex::default(),
            }),
        }
    }

    /// Checks, before the first receive, that the queue exists and SQS answers: one
    /// `GetQueueAttributes` (`QueueArn`) call, bounded by [`SqsConfig::call_timeout`], made up to
    /// [`CHECK_ATTEMPTS`] times while SQS cannot be reached (the SDK's own retries off, so each
    /// attempt is one request; a warning line per failed attempt: attempt n of N, the endpoint,
    /// the cause; 0.5 s, then 1 s between them).
    ///
    /// Fails with [`SqsError::QueueNotFound`] when the queue does not exist,
    /// [`SqsError::Unreachable`] when no attempt got an answer, or the refusal SQS answered
    /// (credentials, permissions). A [`Consumer`](crate::Consumer) does not call it; call it
    /// before announcing that a worker is ready (for [`SqsRetrofit`](super::SqsRetrofit):
    /// `retrofit.source().check()`).
    ///
    /// ```no_run
    /// # async fn demo() -> Result<(), brokerfence::sqs::SqsError> {
    /// use brokerfence::sqs::{SqsConfig, SqsSource};
    /// let source = SqsSource::new(brokerfence::sqs::client(brokerfence::sqs::aws_config::from_env(), brokerfence::sqs::SqsTimeouts::default()).await, SqsConfig::new("http://127.0.0.1:4566/000000000000/orders")?);
    /// source.check().await?; // "SQS queue … does not exist …" rather than failing receives
    /// # Ok(()) }
    /// ```
    pub async fn check(&self) -> Result<(), SqsError> {
        use aws_sdk_sqs::config::retry::RetryConfig;
        use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};
        use aws_sdk_sqs::types::QueueAttributeName;

        let queue_url = &self.inner.config.queue_url;
        let limit = self.inner.config.call_timeout;
        let endpoint = endpoint_of(&self.inner.client);
        // 0.5 s, then 1 s: CHECK_ATTEMPTS attempts in all (one process at start-up: no jitter).
        let mut waits = {
            use backon::BackoffBuilder as _;
            backon::ExponentialBuilder::default()
                .with_min_delay(Duration::from_millis(500))
                .with_factor(2.0)
                .with_max_times(CHECK_ATTEMPTS.saturating_sub(1) as usize)
                .build()
        };
        let mut attempt = 1;
        loop {
            let call = self
                .inner
                .client
                .get_queue_attributes()
                .queue_url(queue_url)
                .attribute_names(QueueAttributeName::QueueArn)
                .customize()
                .config_override(aws_sdk_sqs::config::Builder::default().retry_config(RetryConfig::disabled()))
                .send();
            let cause = match tokio::time::timeout(limit, call).await {
                Ok(Ok(_)) => return Ok(()),
                Ok(Err(SdkError::ServiceError(ctx))) if ctx.err().code().is_some_and(is_missing_queue_code) => {
                    return Err(self.queue_not_found());
                }
                Ok(Err(e)) => {
                    let cause = short_cause(&e);
                    let classified = classify("GetQueueAttributes", e);
                    if !classified.is_transient() {
                        return Err(classified);
                    }
                    cause
                }
                Err(_) => format!("no answer within {limit:?}"),
            };
            let Some(wait) = waits.next() else {
                return Err(SqsError::Unreachable { endpoint, queue_url: queue_url.clone(), attempts: attempt, cause });
            };
            tracing::warn!(
                "SQS at {endpoint}: attempt {attempt} of {CHECK_ATTEMPTS} failed: {cause}; retrying in {wait:?}"
            );
            tokio::time::sleep(wait).await;
            attempt += 1;
        }
    }

    /// [`SqsError::QueueNotFound`] for this source's queue, at its client's endpoint and region.
    fn queue_not_found(&self) -> SqsError {
        let client = &self.inner.client;
        let region = client.config().region().map_or_else(|| "not set".to_owned(), |r| r.to_string());
        SqsError::QueueNotFound {
            queue_url: self.inner.config.queue_url.clone(),
            endpoint: endpoint_of(client),
            region,
        }
    }

    /// An error of a call on this source's queue, with a refusal because the queue does not
    /// exist made [`SqsError::QueueNotFound`] (which names the URL, the endpoint and the region).
    pub(super) fn name_missing_queue(&self, e: SqsError) -> SqsError {
        match &e {
            SqsError::Service { code: Some(code), .. } if is_missing_queue_code(code) => self.queue_not_found(),
            _ => e,
        }
    }

    /// The SQS client.
    pub fn client(&self) -> &Client {
        &self.inner.client
    }

    /// The configuration.
    pub fn config(&self) -> &SqsConfig {
        &self.inner.config
    }

    /// Wraps a message received elsewhere (your own `ReceiveMessage`) so this source can act on it.
    ///
    /// ```no_run
    /// # async fn demo(source: brokerfence::sqs::SqsSource, m: aws_sdk_sqs::types::Message) -> Result<(), brokerfence::sqs::SqsError> {
    /// let d = source.delivery(m)?;
    /// source.apply(&d, &brokerfence::Disposition::Abandon).await?; // visible again at once
    /// # Ok(()) }
    /// ```
    pub fn delivery(&self, message: aws_sdk_sqs::types::Message) -> Result<SqsDelivery, SqsError> {
        self.inner.registry.register(message, None)
    }

    /// What the runtime gets for a delivery: its key and body, or the reason it has no key.
    ///
    /// ```no_run
    /// # fn demo(source: brokerfence::sqs::SqsSource, d: brokerfence::sqs::SqsDelivery) {
    /// if let brokerfence::Incoming::Malformed { reason, .. } = source.incoming(d) {
    ///     eprintln!("no job key: {reason}");
    /// }
    /// # }
    /// ```
    #[doc(hidden)]
    pub fn incoming(&self, delivery: SqsDelivery) -> Incoming<SqsDelivery> {
        let config = &self.inner.config;
        match config.key.key_of(delivery.message(), config.fifo) {
            Ok(key) => {
                let payload = delivery.message().body().unwrap_or_default().as_bytes().to_vec();
                Incoming::Unclaimed { delivery, key, payload }
            }
            Err(reason) => Incoming::Malformed { delivery, reason },
        }
    }

    /// Sets the visibility of the message (newest handle, if still ours) to `secs`.
    pub(super) async fn set_visibility(&self, d: &SqsDelivery, secs: i32) -> Result<(), SqsError> {
        self.change_visibility(vec![(d.0.message_id.clone(), secs)], self.inner.config.call_timeout).await
    }

    /// Visibility changes, one per message, with the newest handle of each while it is still
    /// ours (the others are not sent), bounded by `limit`; each that succeeds renews its handle.
    pub(super) async fn change_visibility(&self, items: Vec<(String, i32)>, limit: Duration) -> Result<(), SqsError> {
        let registry = &self.inner.registry;
        let entries: Vec<Entry> = items
            .into_iter()
            .filter_map(|(message_id, visibility)| {
                let handle = registry.usable_handle(&message_id)?;
                Some(Entry { message_id, handle, visibility })
            })
            .collect();
        if entries.is_empty() {
            return Ok(());
        }
        let sent = tokio::time::Instant::now();
        let resolve = |id: &str| registry.usable_handle(id);
        let call =
            batch::change_visibility(&self.inner.client, &self.inner.config.queue_url, entries.clone(), &resolve);
        let refused = bounded("ChangeMessageVisibilityBatch", limit, call).await?;
        for e in entries.iter().filter(|e| !refused.contains(&e.message_id)) {
            registry.hidden(&e.message_id, &e.handle, sent, e.visibility);
        }
        Ok(())
    }

    /// Deletes one message (newest handle, if still ours).
    pub(super) async fn delete_one(&self, d: &SqsDelivery) -> Result<(), SqsError> {
        let Some(handle) = self.inner.registry.usable_handle(&d.0.message_id) else {
            return Err(SqsError::HandleNotOurs { operation: "DeleteMessage", message_id: d.0.message_id.clone() });
        };
        let call = async {
            self.inner
                .client
                .delete_message()
                .queue_url(&self.inner.config.queue_url)
                .receipt_handle(handle)
                .send()
                .await
                .map_err(|e| classify("DeleteMessage", e))
        };
        bounded("DeleteMessage", self.inner.config.call_timeout, call).await?;
        Ok(())
    }

    /// Deletes the messages (newest handles), ≤ 10 per call, distinct entry ids; entries SQS
    /// failed on its side are retried, the others reported. A message whose handle is no longer
    /// ours (its visibility ran out, so another receiver may hold a newer handle) is not deleted
    /// with it: it comes back, and its redelivery is acknowledged as a duplicate.
    ///
    /// ```no_run
    /// # async fn demo(source: brokerfence::sqs::SqsSource, done: Vec<brokerfence::sqs::SqsDelivery>) -> Result<(), brokerfence::sqs::SqsError> {
    /// source.delete(&done).await?; // only after the fenced commit succeeded
    /// # Ok(()) }
    /// ```
    pub async fn delete(&self, deliveries: &[SqsDelivery]) -> Result<(), SqsError> {
        let registry = &self.inner.registry;
        let entries: Vec<Entry> = deliveries
            .iter()
            .filter_map(|d| {
                d.mark(Settled::Removed);
                let Some(handle) = registry.usable_handle(&d.0.message_id) else {
                    tracing::debug!(message_id = %d.0.message_id, "not deleted: its receipt handle may be stale; the redelivery is acknowledged");
                    return None;
                };
                Some(Entry { message_id: d.0.message_id.clone(), handle, visibility: 0 })
            })
            .collect();
        if entries.is_empty() {
            return Ok(());
        }
        let resolve = |id: &str| registry.usable_handle(id);
        let call = batch::delete(&self.inner.client, &self.inner.config.queue_url, entries, &resolve);
        bounded("DeleteMessageBatch", self.inner.config.call_timeout, call).await?;
        Ok(())
    }

    /// Extends the visibility of messages whose leases the database just confirmed, to the time
    /// left on each lease. FIFO messages parked behind one of them follow it. The call is bounded
    /// by a third of the shortest lease time left (and [`SqsConfig::call_timeout`]), so a hung
    /// broker costs a hint, never the lease; a message whose handle is no longer ours is skipped.
    /// Never call it for a lease the database did not just confirm: a stale handle is no fence.
    ///
    /// ```no_run
    /// # async fn demo(source: brokerfence::sqs::SqsSource, confirmed: Vec<(brokerfence::Lease, brokerfence::sqs::SqsDelivery)>) -> Result<(), brokerfence::sqs::SqsError> {
    /// source.extend_visibility(&confirmed).await?;
    /// # Ok(()) }
    /// ```
    pub async fn extend_visibility(&self, leases: &[(Lease, SqsDelivery)]) -> Result<(), SqsError> {
        let registry = &self.inner.registry;
        let mut items = Vec::with_capacity(leases.len());
        let mut limit = self.inner.config.call_timeout;
        for (lease, d) in leases {
            let visibility = visibility_secs(lease.ttl).max(1);
            limit = limit.min(lease.ttl / 3);
            items.push((d.0.message_id.clone(), visibility));
            for message_id in registry.parked_behind(d) {
                items.push((message_id, visibility));
            }
        }
        self.change_visibility(items, limit.max(Duration::from_millis(50))).await
    }

    /// Tells SQS what the fence decided for one delivery (the retrofit path; the runtime calls
    /// the [`Source`] methods itself). `Leave` touches nothing.
    ///
    /// ```no_run
    /// # async fn demo(source: brokerfence::sqs::SqsSource, d: brokerfence::sqs::SqsDelivery) -> Result<(), brokerfence::sqs::SqsError> {
    /// source.apply(&d, &brokerfence::Disposition::Ack).await?; // DeleteMessage
    /// # Ok(()) }
    /// ```
    pub async fn apply(&self, d: &SqsDelivery, disposition: &Disposition) -> Result<(), SqsError> {
        match disposition {
            Disposition::Ack => self.delete(std::slice::from_ref(d)).await,
            Disposition::RetryLater(delay) => self.keep(d, *delay).await,
            Disposition::DeadLetter(reason) => self.move_to_dead_letter(d, reason).await,
            Disposition::Hold(ttl) => self.keep(d, *ttl).await,
            Disposition::Abandon => self.give_back(d).await,
            Disposition::Leave => Ok(()),
        }
    }

    /// Keeps the message in the queue, hidden for `hide` (retry later, busy elsewhere). On FIFO
    /// it is remembered as unfinished in this worker (its group's later messages wait for it),
    /// and the messages parked behind it are hidden a little longer, so none of them comes back
    /// before it.
    async fn keep(&self, d: &SqsDelivery, hide: Duration) -> Result<(), SqsError> {
        d.mark(Settled::Kept);
        let secs = visibility_secs(hide);
        let until = tokio::time::Instant::now() + Duration::from_secs(u64::try_from(secs).unwrap_or(0));
        let followers = self.inner.registry.keep_head(d, until);
        let mut items = vec![(d.0.message_id.clone(), secs)];
        for (f, fsecs) in &followers {
            f.mark(Settled::Kept);
            items.push((f.0.message_id.clone(), (*fsecs).max(secs)));
        }
        let hidden = self.change_visibility(items, self.inner.config.call_timeout).await;
        // Dropped only now: a delivery dropped before the call would take its receipt handle out
        // of the registry, and the call would leave its message out (it then stayed visible
        // under the receive's timeout, and came back before the head).
        drop(followers);
        hidden
    }

    /// Visibility 0 for the message and, on FIFO, for the messages parked behind it.
    async fn give_back(&self, d: &SqsDelivery) -> Result<(), SqsError> {
        d.mark(Settled::Abandoned);
        let registry = &self.inner.registry;
        let parked = registry.take_parked_behind(d);
        let mut items = vec![(d.0.message_id.clone(), 0)];
        for p in &parked {
            p.mark(Settled::Abandoned);
            items.push((p.0.message_id.clone(), 0));
        }
        let given = self.change_visibility(items, self.inner.config.call_timeout).await;
        // As in `keep`: alive until the call is made, so their handles are used.
        drop(parked);
        given
    }
}

#[async_trait]
impl Source for SqsSource {
    type Delivery = SqsDelivery;

    fn queue(&self) -> &QueueName {
        &self.inner.config.fence_queue
    }

    fn kind(&self) -> &'static str {
        "sqs"
    }

    #[cfg(feature = "otel")]
    fn origin(&self, delivery: &SqsDelivery) -> fence::otel::Origin {
        super::trace::origin(delivery)
    }

    async fn receive(&self, max: usize, ctx: &ReceiveContext) -> Result<Vec<Incoming<SqsDelivery>>, SourceError> {
        let span = tracing::debug_span!("sqs_receive", queue = %self.inner.config.fence_queue, max);
        Ok(self.receive_inner(max, ctx).instrument(span).await?)
    }

    async fn extend(&self, leases: &[(Lease, SqsDelivery)]) -> Result<(), SourceError> {
        let span = tracing::debug_span!("sqs_extend", queue = %self.inner.config.fence_queue, n = leases.len());
        Ok(self.extend_visibility(leases).instrument(span).await?)
    }

    async fn lost(&self, leases: &[(Lease, SqsDelivery)]) -> Result<(), SourceError> {
        // Never extend or delete with a lost lease's handle: a stale handle is no fence. The
        // deliveries deregister themselves once the runtime drops them.
        for (lease, d) in leases {
            tracing::debug!(key = %lease.key, epoch = lease.epoch, message_id = %d.message_id(), "lease lost; message left to SQS");
        }
        Ok(())
    }

    async fn ack(&self, deliveries: Vec<SqsDelivery>) -> Result<(), SourceError> {
        let span = tracing::debug_span!("sqs_ack", queue = %self.inner.config.fence_queue, n = deliveries.len());
        Ok(self.delete(&deliveries).instrument(span).await?)
    }

    async fn retry_later(&self, delivery: SqsDelivery, delay: Duration) -> Result<(), SourceError> {
        Ok(self.apply(&delivery, &Disposition::RetryLater(delay)).await?)
    }

    async fn dead_letter(&self, delivery: SqsDelivery, reason: &str) -> Result<(), SourceError> {
        self.dead_letter_once(delivery, reason).await.map(|_| ())
    }

    async fn dead_letter_once(&self, delivery: SqsDelivery, reason: &str) -> Result<DeadLettered, SourceError> {
        let span = tracing::info_span!("sqs_dead_letter", queue = %self.inner.config.fence_queue, message_id = %delivery.message_id());
        Ok(self.dead_letter_message(&delivery, reason).instrument(span).await?)
    }

    async fn hold(&self, delivery: SqsDelivery, ttl: Duration) -> Result<(), SourceError> {
        Ok(self.apply(&delivery, &Disposition::Hold(ttl)).await?)
    }

    async fn abandon(&self, delivery: SqsDelivery) -> Result<(), SourceError> {
        Ok(self.give_back(&delivery).await?)
    }

    async fn close(&self, grace: Duration) {
        let n = self.release_unstarted(grace).await;
        if n > 0 {
            tracing::info!(n, "gave back messages received but never started");
        }
    }
}
