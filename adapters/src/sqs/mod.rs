//! # SQS source (feature `sqs`)
//!
//! SQS deliveries mapped onto the fence. The database epoch is the authority; SQS's receipt handle
//! and visibility timeout are hints that follow it:
//!
//! * the job key of a message is its `MessageId`, or on FIFO queues its `MessageDeduplicationId`,
//!   or a message attribute / JSON body field you choose ([`KeyStrategy`]), so a producer's re-send
//!   is deduplicated;
//! * each received batch is claimed with one statement; `Busy` hides the message for the time left
//!   on the database lease, `Done` deletes it;
//! * visibility is extended only after the database confirmed a lease, with the newest receipt
//!   handle of the message, and never for a lost lease (on LocalStack an old handle still deletes
//!   or re-hides the message a newer receiver holds: a stale handle is no fence); every call with
//!   a handle is made only while the visibility this process set with it has not run out, so a
//!   handle another receiver may have superseded is never used;
//! * every SQS call is bounded: the client's [`SqsTimeouts`], the source's
//!   [`SqsConfig::call_timeout`], and a third of the lease time left for the extensions that
//!   follow a heartbeat;
//! * FIFO group order is kept by the consumer itself, whatever the broker hands out (see
//!   [`SqsDelivery`]);
//! * the queue's RedrivePolicy `maxReceiveCount` is checked against the retry policy at the first
//!   receive ([`SqsSource::check_max_receive_count`]);
//! * only a committed result deletes; a `Fenced` commit touches nothing.
//!
//! Run it under the shared [`Consumer`](crate::Consumer) with an [`SqsSource`], or call
//! [`SqsRetrofit::process`] from a receive loop you already own. The client comes from the
//! standard AWS environment over a single rustls (*ring*) HTTP stack ([`client`]).
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use brokerfence::sqs::{KeyStrategy, SqsConfig, SqsSource};
//! use brokerfence::{Consumer, ConsumerConfig};
//! use brokerfence::{FenceStore, LeaseDuration, PgFence, SupervisorConfig};
//!
//! let store = Arc::new(PgFence::connect("postgres://postgres@127.0.0.1/test").await?);
//! store.migrate().await?;
//! let config = SqsConfig::new("http://127.0.0.1:4566/000000000000/orders")?.key(KeyStrategy::attribute("order-id"));
//! let source = SqsSource::new(brokerfence::sqs::client(brokerfence::sqs::aws_config::from_env(), brokerfence::sqs::SqsTimeouts::default()).await, config);
//! let consumer = Consumer::new(source, store, ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30)?)));
//! consumer
//!     .run(|ctx: brokerfence::JobContext| async move { Ok(ctx.payload().to_vec()) }, brokerfence::shutdown_signal())
//!     .await?;
//! # Ok(()) }
//! ```

mod batch;
mod config;
mod dead_letter;
mod delivery;
mod error;
mod key;
mod order;
#[cfg(feature = "postgres")]
mod outbox;
mod receive;
mod retrofit;
mod source;
mod state;
#[cfg(feature = "otel")]
mod trace;

pub use config::{
    DEFAULT_CALL_TIMEOUT, DEFAULT_RECEIVE_HEADROOM, DeadLetterTarget, ReceiveCountCheck, SqsConfig, SqsTimeouts,
    client, is_fifo_url,
};
// The SDK's HTTP client (rustls on ring), for the repository's own tests and harnesses.
#[doc(hidden)]
pub use config::http_client;
pub use dead_letter::{REASON_ATTRIBUTE, SOURCE_MESSAGE_ID_ATTRIBUTE};
pub use delivery::SqsDelivery;
pub use error::{SqsError, error_chain};
pub use key::KeyStrategy;
#[cfg(feature = "postgres")]
pub use outbox::SqsPublisher;
pub use retrofit::SqsRetrofit;
#[doc(hidden)]
pub use source::CHECK_ATTEMPTS;
pub use source::SqsSource;
#[cfg(feature = "otel")]
#[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
pub use trace::{MAX_MESSAGE_ATTRIBUTES, traced, traced_entry};

/// The AWS configuration loader, re-exported for the same reason.
pub use aws_config;
/// The AWS SDK for SQS, re-exported so applications need no second dependency line (and get the
/// same version and features).
pub use aws_sdk_sqs;
