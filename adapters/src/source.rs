//! What a source of deliveries must do. A source only maps broker calls; it never decides whether
//! a result commits — only the store's compare-and-set does.

use std::time::Duration;

use async_trait::async_trait;
use fence::{ClaimedJob, JobKey, Lease, QueueName};

/// One delivery as a source hands it to the runtime.
#[derive(Debug)]
pub enum Incoming<D> {
    /// A broker delivery: the runtime claims its key (batched with the rest of the receive).
    Unclaimed {
        /// The broker's handle on the delivery.
        delivery: D,
        /// The job key it maps to.
        key: JobKey,
        /// The body.
        payload: Vec<u8>,
    },
    /// A delivery the source already claimed (the table queue: there the claim *is* the receive).
    Claimed {
        /// The handle.
        delivery: D,
        /// The claim with its payload.
        job: ClaimedJob,
    },
    /// A delivery that cannot be turned into a job (undecodable, no key, bad attribute): it is
    /// dead-lettered with the reason and the loop goes on.
    Malformed {
        /// The handle.
        delivery: D,
        /// Why.
        reason: String,
    },
}

/// What a dead-letter move did ([`Source::dead_letter_once`]).
///
/// ```
/// use brokerfence::DeadLettered;
/// assert_ne!(DeadLettered::Moved, DeadLettered::AlreadyMoved);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum DeadLettered {
    /// This call completed the move: the copy is at the dead-letter destination (sent now, or by
    /// an earlier call that could not remove the delivery) and the delivery is removed.
    Moved,
    /// An earlier call had completed the move (the broker delivered the message again); this
    /// one only removed the delivery.
    AlreadyMoved,
}

/// A failure of the broker side, and whether it is worth retrying. Each variant carries its cause
/// as the error's [`source`](std::error::Error::source): the broker's own typed error (`SqsError`,
/// `RedisError`, [`FenceError`](fence::FenceError) for the table queue), which a caller of
/// [`Consumer::run`](crate::Consumer::run) reaches by downcasting, or a message (`"…".into()`)
/// from a source of your own. The error's message says what happened in words.
///
/// ```
/// use std::error::Error as _;
/// use brokerfence::{FenceError, SourceError};
/// let e = SourceError::Fatal(Box::new(FenceError::SchemaTooOld { found: 0, required: 3 }));
/// assert!(e.to_string().starts_with("source error: the fence schema is at migration version 0"));
/// let cause = e.source().and_then(|c| c.downcast_ref::<FenceError>());
/// assert!(matches!(cause, Some(FenceError::SchemaTooOld { .. })));
///
/// // A source of your own may give a message instead.
/// let e = SourceError::Transient("the broker is restarting".into());
/// assert_eq!(e.to_string(), "transient source error: the broker is restarting");
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SourceError {
    /// Worth retrying (throttling, a dropped connection, a timeout): the consumer backs off and
    /// receives again.
    #[error("transient source error: {0}")]
    Transient(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
    /// Not worth retrying (bad configuration, missing queue, permissions): ends
    /// [`Consumer::run`](crate::Consumer::run).
    #[error("source error: {0}")]
    Fatal(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),
}

/// A source of deliveries: SQS, a Redis stream, the table queue, or your own.
///
/// Every method but [`receive`](Source::receive) has a default that does nothing, for sources
/// whose broker keeps no state of its own (the table queue).
#[async_trait]
pub trait Source: Send + Sync + 'static {
    /// The broker's handle on one delivery (receipt handle, stream entry id, …).
    type Delivery: Clone + Send + Sync + 'static;

    /// The queue name jobs of this source are fenced under.
    fn queue(&self) -> &QueueName;

    /// What kind of source this is, for the `source` label of the exported metrics (feature
    /// `metrics`) and the attempt span's `messaging.system`: `table`, `sqs`, `redis_stream`,
    /// `redis_list`; `custom` unless a source says otherwise. A wrapper delegates it.
    ///
    /// ```
    /// # fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>) {
    /// use brokerfence::{QueueName, Source, TableQueue};
    /// let source = TableQueue::new(store, QueueName::new("emails").unwrap());
    /// assert_eq!(source.kind(), "table");
    /// # }
    /// ```
    fn kind(&self) -> &'static str {
        "custom"
    }

    /// How many deliveries the consumer asks one [`receive`](Self::receive) for when its
    /// [`ConsumerConfig::batch`](crate::ConsumerConfig::batch) is not set: 10 unless a source
    /// says otherwise (one SQS `ReceiveMessage` returns at most 10; more per receive only pays
    /// where one call can really serve more). The table queue says 64. A wrapper delegates it.
    ///
    /// ```
    /// # fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>) {
    /// use brokerfence::{QueueName, Source, TableQueue};
    /// let source = TableQueue::new(store, QueueName::new("emails").unwrap());
    /// assert_eq!(source.default_batch(), 64);
    /// # }
    /// ```
    fn default_batch(&self) -> usize {
        10
    }

    /// How many [`receive`](Self::receive) calls the consumer may have in flight at once: 1
    /// unless a source says otherwise. The consumer runs one receive per batch's worth of
    /// places, up to this many (so a consumer whose places fit one batch keeps one receive), and
    /// each asks only for the places free when it starts: while one receive waits on the
    /// database, the places that free up meanwhile are not idle until it returns. A source says
    /// more than 1 only if concurrent receives are safe and cheap for it: the table queue says 4
    /// (each receive is one `claim_next` statement; `FOR UPDATE SKIP LOCKED` keeps them from
    /// taking the same rows). The brokers keep 1 (a Redis `XREADGROUP … BLOCK` holds its
    /// connection; an SQS FIFO queue's group order is kept by receiving one batch at a time).
    /// A wrapper delegates it.
    ///
    /// ```
    /// # fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>) {
    /// use brokerfence::{QueueName, Source, TableQueue};
    /// let source = TableQueue::new(store, QueueName::new("emails").unwrap());
    /// assert_eq!(source.receives_in_flight(), 4);
    /// # }
    /// ```
    fn receives_in_flight(&self) -> usize {
        1
    }

    /// How many deliveries a consumer of `concurrency` handlers holds ahead of them when its
    /// [`ConsumerConfig::prefetch`](crate::ConsumerConfig::prefetch) is not set: 0 (no
    /// prefetching; one slot covers a delivery from its receive until its handler returns) unless
    /// a source says otherwise. The table queue says twice `concurrency`, at most 256: its receive is
    /// a claim statement, and without places ahead each slot stood idle for the statement's round
    /// trip (see [`TableQueue`](crate::TableQueue)). A wrapper delegates it.
    ///
    /// ```
    /// # fn demo(store: std::sync::Arc<dyn brokerfence::FenceStore>) {
    /// use brokerfence::{QueueName, Source, TableQueue};
    /// let source = TableQueue::new(store, QueueName::new("emails").unwrap());
    /// assert_eq!(source.default_prefetch(16), 32);
    /// assert_eq!(source.default_prefetch(1_000), 256);
    /// # }
    /// ```
    fn default_prefetch(&self, concurrency: usize) -> usize {
        let _ = concurrency;
        0
    }

    /// Checked once when the consumer starts, before anything is received: a configuration that
    /// cannot work ends the run at once with [`SourceError::Fatal`] instead of failing at run
    /// time. The Redis sources refuse, on a Redis Cluster, keys that one script would touch
    /// together but that lie in different slots. A wrapper delegates it. The default accepts.
    ///
    /// ```no_run
    /// # fn demo(source: brokerfence::redis::StreamSource) {
    /// use brokerfence::Source;
    /// if let Err(e) = source.check() {
    ///     eprintln!("this source cannot work: {e}");
    /// }
    /// # }
    /// ```
    fn check(&self) -> Result<(), SourceError> {
        Ok(())
    }

    /// The producer's trace context and the broker's message id of a delivery (feature `otel`),
    /// read off the message: the attempt's span continues that trace. Defaults to none.
    ///
    /// ```no_run
    /// # use brokerfence::Source;
    /// # fn demo(source: brokerfence::sqs::SqsSource, d: brokerfence::sqs::SqsDelivery) {
    /// let origin = source.origin(&d);
    /// println!("{:?}", origin.get_trace());
    /// # }
    /// ```
    #[cfg(feature = "otel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
    fn origin(&self, _delivery: &Self::Delivery) -> fence::otel::Origin {
        fence::otel::Origin::default()
    }

    /// Receives up to `max` deliveries, waiting a while (long poll) when there are none.
    async fn receive(
        &self,
        max: usize,
        ctx: &crate::ReceiveContext,
    ) -> Result<Vec<Incoming<Self::Delivery>>, SourceError>;

    /// The database just confirmed these leases: extend the broker's visibility hint.
    async fn extend(&self, _leases: &[(Lease, Self::Delivery)]) -> Result<(), SourceError> {
        Ok(())
    }

    /// The database found these leases lost: drop any broker-side state (never delete or extend
    /// the message with a stale handle).
    async fn lost(&self, _leases: &[(Lease, Self::Delivery)]) -> Result<(), SourceError> {
        Ok(())
    }

    /// The results of these deliveries are committed (or they were duplicates of completed jobs):
    /// acknowledge them to the broker.
    async fn ack(&self, _deliveries: Vec<Self::Delivery>) -> Result<(), SourceError> {
        Ok(())
    }

    /// A fenced failure was recorded: redeliver after `delay`.
    async fn retry_later(&self, _delivery: Self::Delivery, _delay: Duration) -> Result<(), SourceError> {
        Ok(())
    }

    /// Move the delivery to the dead-letter destination with `reason`.
    async fn dead_letter(&self, _delivery: Self::Delivery, _reason: &str) -> Result<(), SourceError> {
        Ok(())
    }

    /// [`dead_letter`](Self::dead_letter), saying whether this call completed the move: the
    /// runtime counts `dead_letters` by it, once per message moved. The default calls
    /// `dead_letter` and answers [`DeadLettered::Moved`]; a source that can tell a repeat (the SQS
    /// source remembers the copies it sent, and whether their delete went through) sends no
    /// second copy and answers [`DeadLettered::AlreadyMoved`] for a move completed before. A
    /// wrapper delegates it.
    ///
    /// ```no_run
    /// # async fn demo(source: brokerfence::sqs::SqsSource, d: brokerfence::sqs::SqsDelivery) -> Result<(), brokerfence::SourceError> {
    /// use brokerfence::{DeadLettered, Source};
    /// if source.dead_letter_once(d, "poison").await? == DeadLettered::AlreadyMoved {
    ///     println!("moved before; the redelivery was only deleted");
    /// }
    /// # Ok(()) }
    /// ```
    async fn dead_letter_once(&self, delivery: Self::Delivery, reason: &str) -> Result<DeadLettered, SourceError> {
        self.dead_letter(delivery, reason).await.map(|()| DeadLettered::Moved)
    }

    /// Another owner holds a live lease for `ttl` more: hide the delivery that long (the hint
    /// follows the authority).
    async fn hold(&self, _delivery: Self::Delivery, _ttl: Duration) -> Result<(), SourceError> {
        Ok(())
    }

    /// Give the delivery back at once (shutdown, or received but never started).
    async fn abandon(&self, _delivery: Self::Delivery) -> Result<(), SourceError> {
        Ok(())
    }

    /// The consumer has stopped: give back whatever this source received but never handed on
    /// (read-ahead, a long poll that was abandoned), waiting at most `grace`.
    async fn close(&self, _grace: Duration) {}
}
