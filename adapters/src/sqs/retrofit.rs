//! The retrofit entry point for SQS: you keep your `ReceiveMessage` loop; for each message the
//! adapter claims, supervises (extending visibility after every confirmed heartbeat), commits and
//! deletes.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use aws_sdk_sqs::types::Message;
use fence::{
    FenceError, FenceStore, IntoJobResult, JobContext, JobError, Lease, LeaseHook, Metrics, Owner, QueueName,
    SupervisorConfig,
};
use tracing::Instrument;

use super::delivery::SqsDelivery;
use super::error::SqsError;
use super::source::SqsSource;
use crate::disposition::Disposition;
use crate::retrofit::{Detail, Processed, Retrofit};
use crate::source::{DeadLettered, SourceError};

/// A lease's identity: (queue, key, epoch).
type LeaseId = (String, String, i64);

fn lease_id(l: &Lease) -> LeaseId {
    (l.queue.as_str().to_owned(), l.key.as_str().to_owned(), l.epoch)
}

/// Deliveries being processed, by the identity of the lease they run under, so the heartbeat
/// hook extends the message of *that* lease: with keys from an attribute or the body, two
/// messages may carry one key, and only the one whose attempt holds the lease may be extended.
#[derive(Default)]
struct InFlight {
    by_lease: Mutex<HashMap<LeaseId, SqsDelivery>>,
}

impl InFlight {
    fn insert(&self, id: LeaseId, d: SqsDelivery) {
        if let Ok(mut m) = self.by_lease.lock() {
            m.insert(id, d);
        }
    }

    fn remove(&self, id: &LeaseId) {
        let removed = self.by_lease.lock().ok().and_then(|mut m| m.remove(id));
        // Dropped outside the lock (a delivery's drop deregisters its handle).
        drop(removed);
    }

    /// The deliveries of these leases (those this middleware runs).
    fn pairs(&self, queue: &QueueName, leases: &[Lease]) -> Vec<(Lease, SqsDelivery)> {
        let Ok(m) = self.by_lease.lock() else { return Vec::new() };
        leases
            .iter()
            .filter(|l| &l.queue == queue)
            .filter_map(|l| m.get(&lease_id(l)).map(|d| (l.clone(), d.clone())))
            .collect()
    }
}

struct ExtendHook {
    source: SqsSource,
    in_flight: Arc<InFlight>,
}

#[async_trait]
impl LeaseHook for ExtendHook {
    async fn confirmed(&self, leases: &[Lease]) {
        let pairs = self.in_flight.pairs(self.source.config().get_fence_queue_name(), leases);
        if !pairs.is_empty()
            && let Err(e) = self.source.extend_visibility(&pairs).await
        {
            tracing::warn!(error = %e, n = pairs.len(), "could not extend SQS visibility (the database lease stands)");
        }
    }
}

/// The fence inside a consumer loop you already own. One per worker process.
///
/// ```no_run
/// # async fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>) -> Result<(), Box<dyn std::error::Error>> {
/// use brokerfence::sqs::{SqsConfig, SqsRetrofit, SqsSource};
/// use brokerfence::{LeaseDuration, SupervisorConfig};
/// let client = brokerfence::sqs::client(brokerfence::sqs::aws_config::from_env(), brokerfence::sqs::SqsTimeouts::default()).await;
/// let url = "http://127.0.0.1:4566/000000000000/orders";
/// let fence = SqsRetrofit::new(store, SqsSource::new(client.clone(), SqsConfig::new(url)?),
///     SupervisorConfig::new(LeaseDuration::from_secs(30)?));
/// fence.check_schema().await?; // "… run migrations …" on a schema this build cannot use
/// loop {
///     let out = client.receive_message().queue_url(url).wait_time_seconds(20).send().await?;
///     for message in out.messages() {
///         let done = fence.process(message, |ctx| async move {
///             Ok(format!("handled {} at epoch {}", ctx.key(), ctx.epoch()))
///         }).await;
///         if let Some(e) = done.refused() { return Err(e.to_string().into()); } // the schema went back
///         println!("{}: {:?}", done.reason(), done.disposition); // deleted, re-hidden, dead-lettered or left
///     }
/// }
/// # }
/// ```
#[derive(Clone)]
pub struct SqsRetrofit {
    retrofit: Retrofit,
    source: SqsSource,
    in_flight: Arc<InFlight>,
}

impl std::fmt::Debug for SqsRetrofit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SqsRetrofit").field("retrofit", &self.retrofit).field("source", &self.source).finish()
    }
}

impl SqsRetrofit {
    /// Middleware with a fresh owner id. Must be created inside a tokio runtime.
    pub fn new(store: Arc<dyn FenceStore>, source: SqsSource, config: SupervisorConfig) -> Self {
        Self::with_owner(store, source, Owner::unique("worker"), config)
    }

    /// Middleware with the given owner id.
    pub fn with_owner(store: Arc<dyn FenceStore>, source: SqsSource, owner: Owner, config: SupervisorConfig) -> Self {
        let retrofit = Retrofit::with_owner(store, source.config().get_fence_queue_name().clone(), owner, config);
        let in_flight = Arc::new(InFlight::default());
        retrofit
            .supervisor()
            .add_hook(Arc::new(ExtendHook { source: source.clone(), in_flight: Arc::clone(&in_flight) }));
        Self { retrofit, source, in_flight }
    }

    /// The generic middleware underneath.
    pub fn retrofit(&self) -> &Retrofit {
        &self.retrofit
    }

    /// Checks the store's schema before your loop starts ([`Retrofit::check_schema`]): a schema
    /// older than this build needs is [`FenceError::SchemaTooOld`], whose message says to run
    /// migrations. [`process`](Self::process) checks on first use anyway and then refuses every
    /// message ([`Processed::refused`]), making it visible again at once.
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::sqs::SqsRetrofit) -> Result<(), Box<dyn std::error::Error>> {
    /// fence.check_schema().await?; // before the receive loop
    /// # Ok(()) }
    /// ```
    pub async fn check_schema(&self) -> Result<(), FenceError> {
        self.retrofit.check_schema().await
    }

    /// The source used for broker calls.
    pub fn source(&self) -> &SqsSource {
        &self.source
    }

    /// The counters.
    pub fn metrics(&self) -> &Arc<Metrics> {
        self.retrofit.metrics()
    }

    /// Claims the message's job, runs `handler` under the lease (visibility extended after each
    /// confirmed heartbeat), commits through the fence, then tells SQS: delete on a committed
    /// result or a duplicate, re-hide on a failure or a busy job, dead-letter a malformed or dead
    /// message, and touch nothing when the lease was lost or the commit fenced.
    ///
    /// On first use it checks the schema: on one older than this build needs it claims nothing,
    /// makes the message visible again at once and answers [`Processed::refused`], with an
    /// error logged (see [`check_schema`](Self::check_schema)). A handler that panics is a
    /// failed attempt, retried by policy, with the panic's message as the job's `last_error`.
    ///
    /// The heartbeat extends the visibility of *this* message, under *this* attempt's lease
    /// (another message carrying the same key is never extended for it). A message your loop
    /// received has a visibility the adapter does not know until its first extension: receive
    /// with a visibility timeout of at least the lease.
    ///
    /// The handler is awaited in place: any `FnOnce` closure, borrowing locals or moving loop
    /// state in (see [`Retrofit::process`]).
    ///
    /// The answer is the [`Processed`] every retrofit gives; its
    /// [`broker_error`](Processed::broker_error) is set when the SQS call applying the
    /// disposition failed (its cause is the [`SqsError`]).
    ///
    /// (A crate of its own: a user's `async fn` around `process` and nothing else, whose layout
    /// overflowed the compiler's query depth before `process` boxed its inner future.)
    ///
    /// ```no_run,standalone_crate
    /// # async fn demo(fence: brokerfence::sqs::SqsRetrofit, m: aws_sdk_sqs::types::Message) {
    /// use brokerfence::Reason;
    /// let done = fence.process(&m, |_ctx| async move { Ok(()) }).await;
    /// assert_eq!(done.reason(), Reason::Committed);
    /// assert!(done.should_ack() && done.broker_error.is_none(), "committed and deleted");
    /// # }
    /// ```
    pub async fn process<F, Fut, R>(&self, message: &Message, handler: F) -> Processed
    where
        F: FnOnce(JobContext) -> Fut,
        Fut: Future<Output = Result<R, JobError>>,
        R: IntoJobResult,
    {
        let span = tracing::info_span!(
            "sqs_process",
            queue = %self.retrofit.queue(),
            message_id = message.message_id().unwrap_or("?"),
        );
        // Boxed: a caller's async fn would otherwise nest every layer of this future (the SDK's
        // calls, the retrofit, the supervisor, the handler's future) and computing its layout
        // overflows the compiler's query depth.
        Box::pin(self.process_inner(message, handler).instrument(span)).await
    }

    /// Tells SQS what the fence decided; a dead letter counts in `dead_letters` when this call
    /// completed the move (copy sent and message deleted), once per message.
    async fn settle(&self, delivery: &SqsDelivery, disposition: &Disposition) -> Option<SqsError> {
        match disposition {
            Disposition::DeadLetter(reason) => match self.source.dead_letter_message(delivery, reason).await {
                Ok(DeadLettered::Moved) => {
                    self.metrics().incr(fence::Counter::DeadLetters);
                    None
                }
                Ok(DeadLettered::AlreadyMoved) => None,
                Err(e) => Some(e),
            },
            other => self.source.apply(delivery, other).await.err(),
        }
    }

    async fn process_inner<F, Fut, R>(&self, message: &Message, handler: F) -> Processed
    where
        F: FnOnce(JobContext) -> Fut,
        Fut: Future<Output = Result<R, JobError>>,
        R: IntoJobResult,
    {
        let delivery = match self.source.delivery(message.clone()) {
            Ok(d) => d,
            Err(e) => {
                tracing::error!(error = %e, "message cannot be processed");
                return Processed::new(Disposition::Leave, Detail::Malformed(e.to_string()));
            }
        };
        let config = self.source.config();
        let key = match config.get_key().key_of(message, config.is_fifo()) {
            Ok(k) => k,
            Err(reason) => {
                tracing::warn!(%reason, "malformed message: dead-lettering it");
                let disposition = Disposition::DeadLetter(reason.clone());
                let broker_error = self.settle(&delivery, &disposition).await;
                if let Some(e) = &broker_error {
                    tracing::error!(error = %e, "malformed message not dead-lettered; it has no job key, so it comes back")
                }
                let mut done = Processed::new(disposition, Detail::Malformed(reason));
                done.broker_error = broker_error.map(SourceError::from);
                return done;
            }
        };
        let payload = message.body().unwrap_or_default().as_bytes().to_vec();
        // The delivery is registered under its lease once the attempt starts (the claim may say
        // the job is someone else's: then it never is).
        let running: Arc<Mutex<Option<LeaseId>>> = Arc::default();
        let (in_flight, d, slot) = (Arc::clone(&self.in_flight), delivery.clone(), Arc::clone(&running));
        let wrapped = move |ctx: JobContext| {
            let id = lease_id(ctx.lease());
            in_flight.insert(id.clone(), d.clone());
            if let Ok(mut s) = slot.lock() {
                *s = Some(id);
            }
            handler(ctx)
        };
        let processed = self.retrofit.process(&key, payload, wrapped);
        // Feature `otel`: the attempt continues the trace of the message's `traceparent`.
        #[cfg(feature = "otel")]
        let processed = fence::otel::scope(super::trace::origin(&delivery), processed);
        let mut processed = processed.await;
        if let Some(id) = running.lock().ok().and_then(|mut s| s.take()) {
            self.in_flight.remove(&id);
        }
        let broker_error = self.settle(&delivery, &processed.disposition).await;
        match (&processed.disposition, &broker_error) {
            (Disposition::Ack, None) => self.metrics().incr(fence::Counter::Acks),
            (_, Some(e)) => {
                tracing::warn!(error = %e, "SQS call failed; the message comes back and the fence settles it again")
            }
            _ => {}
        }
        processed.broker_error = broker_error.map(SourceError::from);
        processed
    }
}
