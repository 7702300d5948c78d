//! # adapters — sources and the consumer runtime of brokerfence
//!
//! One consumer runtime ([`Consumer`]) serves every source; a source only maps broker calls
//! ([`Source`]). The retrofit entry point ([`Retrofit`]) applies the same step to one delivery
//! inside a loop you already own. What the broker is told always follows from what the fence
//! decided ([`Disposition`]): only a committed result is acknowledged.
//!
//! Sources: [`TableQueue`] (no broker, on PostgreSQL or SQLite), `sqs` (feature `sqs`), `redis` (feature `redis`);
//! `http` (feature `http`) is the receiver side: the axum middleware that enforces the epoch.
//!
//! This is a member of `brokerfence`: depend on `brokerfence`, which re-exports the public items
//! of this crate (`brokerfence::Consumer`, `brokerfence::sqs::SqsRetrofit`).
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

#[cfg(not(any(feature = "postgres", feature = "sqlite")))]
compile_error!("brokerfence: enable a backend feature, `postgres` or `sqlite` (both are on by default)");

mod builder;
mod caught;
mod disposition;
mod handler;
mod otel;
#[cfg(feature = "postgres")]
pub mod outbox;
mod retrofit;
mod runtime;
mod source;
mod table;
#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
pub mod tower;

#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub mod http;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
#[cfg(feature = "sqs")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqs")))]
pub mod sqs;

pub use disposition::Disposition;
pub use handler::Handler;
pub use retrofit::{Detail, Processed, Reason, Retrofit};
#[doc(hidden)]
pub use runtime::DEFAULT_CLAIM_WINDOW;
pub use runtime::{Consumer, ConsumerConfig, ReceiveContext, shutdown_signal};
pub use source::{DeadLettered, Incoming, Source, SourceError};
pub use table::TableQueue;
/// The token [`Consumer::run`] stops on (tokio-util's), so no direct dependency is needed.
pub use tokio_util::sync::CancellationToken;
