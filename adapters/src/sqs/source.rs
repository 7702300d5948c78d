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
use super::error::{SqsError, classify};
use crate::disposition::Disposition;
use crate::runtime::ReceiveContext;
use crate::source::{Incoming, Source, SourceError};

/// An SQS queue as a [`Source`] of the consumer runtime (or, through
/// [`SqsRetrofit`](super::SqsRetrofit), of your own loop).
///
/// * receive: long polling, up to 10 messages, system attributes `ApproximateReceiveCount`,
///   `MessageDeduplicationId`, `MessageGroupId` and all message attributes; the initial visibility
///   is the lease length; a message without a usable key is [`Incoming::Malformed`].
/// * extend: `ChangeMessageVisibilityBatch` to the time left on the database lease, with the
///   newest receipt handle, only for leases the database just confirmed.
/// * ack: `DeleteMessageBatch`, ≤ 10 per call, distinct ids, failed entries retried or reported.
/// * retry later / hold: `ChangeMessageVisibility` (clamped to 12 h); abandon: visibility 0.
/// * dead letter: `SendMessage` to the dead-letter queue with the reason as the
///   `Fence-Dead-Letter-Reason` attribute, then `DeleteMessage`.
///
/// ```no_run
/// # async fn demo(store: std::sync::Arc<dyn fence::FenceStore>) -> Result<(), Box<dyn std::error::Error>> {
/// use adapters::sqs::{SqsConfig, SqsSource, client_from_env};
/// use adapters::{Consumer, ConsumerConfig};
/// use fence::{LeaseDuration, SupervisorConfig};
/// let client = client_from_env().await;
/// let source = SqsSource::new(client, SqsConfig::new("http://127.0.0.1:4566/000000000000/orders")?);
/// let consumer = Consumer::new(source, store, ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30)?)));
/// consumer.run(|ctx: fence::JobContext| async move { Ok(ctx.payload().to_vec()) }, adapters::shutdown_signal()).await?;
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
    /// `ReceiveMessage` calls still running (see [`SqsSource::release_unstarted`]).
    pub(super) receiving: AtomicUsize,
    pub(super) idle: Notify,
    /// Read-ahead state (standard queues).
    pub(super) ahead: tokio::sync::Mutex<super::receive::Ahead>,
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
                receiving: AtomicUsize::new(0),
                idle: Notify::new(),
                ahead: tokio::sync::Mutex::default(),
            }),
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
    /// # async fn demo(source: adapters::sqs::SqsSource, m: aws_sdk_sqs::types::Message) -> Result<(), adapters::sqs::SqsError> {
    /// let d = source.delivery(m)?;
    /// source.apply(&d, &adapters::Disposition::Abandon).await?; // visible again at once
    /// # Ok(()) }
    /// ```
    pub fn delivery(&self, message: aws_sdk_sqs::types::Message) -> Result<SqsDelivery, SqsError> {
        self.inner.registry.register(message)
    }

    /// What the runtime gets for a delivery: its key and body, or the reason it has no key.
    ///
    /// ```no_run
    /// # fn demo(source: adapters::sqs::SqsSource, d: adapters::sqs::SqsDelivery) {
    /// if let adapters::Incoming::Malformed { reason, .. } = source.incoming(d) {
    ///     eprintln!("no job key: {reason}");
    /// }
    /// # }
    /// ```
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

    /// Sets the visibility of the message (newest handle) to `secs`.
    async fn set_visibility(&self, d: &SqsDelivery, secs: i32) -> Result<(), SqsError> {
        self.inner
            .client
            .change_message_visibility()
            .queue_url(&self.inner.config.queue_url)
            .receipt_handle(self.inner.registry.newest_handle(d))
            .visibility_timeout(secs)
            .send()
            .await
            .map_err(|e| classify("ChangeMessageVisibility", e))?;
        Ok(())
    }

    /// Deletes the messages (newest handles), ≤ 10 per call, distinct entry ids; entries SQS
    /// failed on its side are retried, the others reported.
    ///
    /// ```no_run
    /// # async fn demo(source: adapters::sqs::SqsSource, done: Vec<adapters::sqs::SqsDelivery>) -> Result<(), adapters::sqs::SqsError> {
    /// source.delete(&done).await?; // only after the fenced commit succeeded
    /// # Ok(()) }
    /// ```
    pub async fn delete(&self, deliveries: &[SqsDelivery]) -> Result<(), SqsError> {
        let entries = deliveries
            .iter()
            .map(|d| {
                d.mark(Settled::Removed);
                Entry {
                    message_id: d.0.message_id.clone(),
                    handle: self.inner.registry.newest_handle(d),
                    visibility: 0,
                }
            })
            .collect();
        batch::delete(&self.inner.client, &self.inner.config.queue_url, entries).await
    }

    /// Extends the visibility of messages whose leases the database just confirmed, to the time
    /// left on each lease. FIFO messages parked behind one of them follow it. Never call it for a
    /// lease the database did not just confirm: a stale handle is no fence.
    ///
    /// ```no_run
    /// # async fn demo(source: adapters::sqs::SqsSource, confirmed: Vec<(fence::Lease, adapters::sqs::SqsDelivery)>) -> Result<(), adapters::sqs::SqsError> {
    /// source.extend_visibility(&confirmed).await?;
    /// # Ok(()) }
    /// ```
    pub async fn extend_visibility(&self, leases: &[(Lease, SqsDelivery)]) -> Result<(), SqsError> {
        let registry = &self.inner.registry;
        let mut entries = Vec::with_capacity(leases.len());
        for (lease, d) in leases {
            let visibility = visibility_secs(lease.ttl).max(1);
            entries.push(Entry { message_id: d.0.message_id.clone(), handle: registry.newest_handle(d), visibility });
            for (message_id, handle) in registry.parked_behind(d) {
                entries.push(Entry { message_id, handle, visibility });
            }
        }
        batch::change_visibility(&self.inner.client, &self.inner.config.queue_url, entries).await
    }

    /// Tells SQS what the fence decided for one delivery (the retrofit path; the runtime calls
    /// the [`Source`] methods itself). `Leave` touches nothing.
    ///
    /// ```no_run
    /// # async fn demo(source: adapters::sqs::SqsSource, d: adapters::sqs::SqsDelivery) -> Result<(), adapters::sqs::SqsError> {
    /// source.apply(&d, &adapters::Disposition::Ack).await?; // DeleteMessage
    /// # Ok(()) }
    /// ```
    pub async fn apply(&self, d: &SqsDelivery, disposition: &Disposition) -> Result<(), SqsError> {
        match disposition {
            Disposition::Ack => self.delete(std::slice::from_ref(d)).await,
            Disposition::RetryLater(delay) => {
                d.mark(Settled::Kept);
                self.set_visibility(d, visibility_secs(*delay)).await
            }
            Disposition::DeadLetter(reason) => self.move_to_dead_letter(d, reason).await,
            Disposition::Hold(ttl) => {
                d.mark(Settled::Kept);
                self.set_visibility(d, visibility_secs(*ttl)).await
            }
            Disposition::Abandon => self.give_back(d).await,
            Disposition::Leave => Ok(()),
        }
    }

    /// Visibility 0 for the message and, on FIFO, for the messages parked behind it.
    async fn give_back(&self, d: &SqsDelivery) -> Result<(), SqsError> {
        d.mark(Settled::Abandoned);
        let registry = &self.inner.registry;
        let mut entries =
            vec![Entry { message_id: d.0.message_id.clone(), handle: registry.newest_handle(d), visibility: 0 }];
        for p in registry.take_parked_behind(d) {
            entries.push(Entry {
                message_id: p.0.message_id.clone(),
                handle: registry.newest_handle(&p),
                visibility: 0,
            });
        }
        batch::change_visibility(&self.inner.client, &self.inner.config.queue_url, entries).await
    }
}

#[async_trait]
impl Source for SqsSource {
    type Delivery = SqsDelivery;

    fn queue(&self) -> &QueueName {
        &self.inner.config.fence_queue
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
        let span = tracing::info_span!("sqs_dead_letter", queue = %self.inner.config.fence_queue, message_id = %delivery.message_id());
        Ok(self.move_to_dead_letter(&delivery, reason).instrument(span).await?)
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
