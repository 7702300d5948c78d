//! # brokerfence
//!
//! Makes message consumers safe against **zombie workers**: a worker that claimed a job, stalled
//! past its lease (a GC-like pause, a hung call, `SIGSTOP`) and woke up after another worker took
//! the job over finds its late work refused.
//!
//! Every claim of a job increments a monotonic **epoch** (a fencing token) in PostgreSQL or
//! SQLite, judged on the database clock. Heartbeats, checkpoints, completion and failure are
//! compare-and-set on (job, owner, epoch): zero rows matched means the worker was superseded, its
//! handler is cancelled at once and its result dropped ([`FenceError::Fenced`]). The broker's
//! visibility timeout is only a hint: **the database epoch decides which result commits**, and the
//! broker is acknowledged only after that commit. Downstream receivers keep the newest epoch per
//! job ([`Ledger`]) and refuse older ones.
//!
//! ## Ways in
//!
//! | you have | use | feature |
//! |---|---|---|
//! | no broker: jobs in a database table | [`Consumer`] over a [`TableQueue`], on [`PgFence`] or [`SqliteFence`] | `postgres` / `sqlite` |
//! | your own receive loop, any broker | [`Retrofit::process`] per delivery; ack when [`Processed::should_ack`] says so | — |
//! | your own SQS `ReceiveMessage` loop | [`SqsRetrofit::process`][sqs-retrofit]: it deletes the message itself | `sqs` |
//! | your own Redis `BRPOP` loop | [`ListRetrofit::process`][list-retrofit], then [`requeue_popped`][list-requeue] | `redis` |
//! | an SQS queue, a Redis stream or list, and no loop yet | [`Consumer`] over an [`SqsSource`][sqs-source], [`StreamSource`][stream-source] or [`ReliableList`][reliable-list] | `sqs` / `redis` |
//! | a handler that writes its own rows | [`JobContext::complete_in`]: your rows and the fenced completion in one transaction | `postgres` / `sqlite` |
//! | a downstream HTTP receiver | [`EpochGuard`][epoch-guard] / [`AtomicEpochGuard`][atomic-guard] on an axum router | `http` |
//!
//! A handler is a closure `|ctx| async move { … }` taking a [`JobContext`] and returning its
//! result (anything [`IntoJobResult`]: bytes, a `String`, `()`, …) or a [`JobError`]: `?` on any
//! error retries the attempt, [`.fatal()`](JobResultExt::fatal) makes the failure final. With the
//! feature `tower`, a tower service stack is a handler too ([`tower::handler`][tower-handler]).
//!
//! ```no_run
//! use std::sync::Arc;
//! use brokerfence::{
//!     Consumer, ConsumerConfig, FenceStore, JobKey, LeaseDuration, PgFence, QueueName, SupervisorConfig,
//!     TableQueue, shutdown_signal,
//! };
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let store = Arc::new(PgFence::connect("postgres://postgres@127.0.0.1/test").await?);
//! store.migrate().await?; // a deploy step of its own; workers only check the schema
//! let queue = QueueName::new("emails")?;
//! store.enqueue(&queue, &JobKey::new("welcome-42")?, b"ada@example.com").await?;
//!
//! let config = ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(30)?));
//! let consumer = Consumer::new(TableQueue::new(store.clone(), queue), store, config);
//! consumer
//!     .run(
//!         |ctx| async move {
//!             // send ctx.stamp() (queue, job, epoch, owner) with every downstream call
//!             Ok(format!("sent at epoch {}", ctx.epoch()))
//!         },
//!         shutdown_signal(),
//!     )
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! ## Features
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `postgres` | yes | [`PgFence`], [`PgLedger`](ledger::PgLedger), the transactional outbox |
//! | `sqlite` | yes | [`SqliteFence`], [`SqliteLedger`](ledger::SqliteLedger) (compiles the bundled SQLite from C) |
//! | `sqs` | | [`sqs`][sqs-mod]: source, retrofit and outbox publisher |
//! | `redis` | | [`redis`][redis-mod]: streams, lists, lease keys, outbox publisher |
//! | `redis-tls` | | `rediss://` URLs |
//! | `http` | | [`http`][http-mod]: the axum middleware that enforces the epoch on a receiver |
//! | `tls` | | TLS to PostgreSQL |
//! | `tower` | | [`tower::handler`][tower-handler]: a tower `Service<JobContext>` stack as the handler |
//! | `serde` | | `ctx.json::<T>()` and the `Json(T)` result |
//! | `anyhow` | | `?` on `anyhow::Error` in a handler |
//! | `metrics` | | counters and histograms through the `metrics` façade |
//! | `otel` | | [`otel`][otel-mod]: W3C trace context through brokers and the jobs table, attempt spans continuing it |
//!
//! ## Where to read next
//!
//! The [`guide`] modules: [handlers](guide::handlers), [SQS](guide::sqs), [Redis](guide::redis),
//! [side effects](guide::side_effects), [at the edges](guide::edges),
//! [operations](guide::operations), [tracing](guide::tracing), [the model and the guards](guide::model),
//! [performance](guide::performance). In the reference: [`ConsumerConfig`] (concurrency,
//! prefetch, batching, shutdown, retention), [`SupervisorConfig`] and [`JobContext`] (leases,
//! heartbeats, cancellation), [`FenceStore`] (the statements every store runs), [`wire`] and
//! [`Ledger`] (the stamp a worker sends downstream and how a receiver checks it).
//!
#![cfg_attr(
    feature = "sqs",
    doc = "[sqs-retrofit]: sqs::SqsRetrofit::process\n[sqs-source]: sqs::SqsSource\n[sqs-mod]: sqs"
)]
#![cfg_attr(
    not(feature = "sqs"),
    doc = "[sqs-retrofit]: https://docs.rs/brokerfence/latest/brokerfence/sqs/struct.SqsRetrofit.html#method.process\n\
           [sqs-source]: https://docs.rs/brokerfence/latest/brokerfence/sqs/struct.SqsSource.html\n\
           [sqs-mod]: https://docs.rs/brokerfence/latest/brokerfence/sqs/index.html"
)]
#![cfg_attr(
    any(feature = "redis", feature = "redis-tls"),
    doc = "[list-retrofit]: redis::ListRetrofit::process\n[list-requeue]: redis::ListRetrofit::requeue_popped\n\
           [stream-source]: redis::StreamSource\n[reliable-list]: redis::ReliableList\n[redis-mod]: redis"
)]
#![cfg_attr(
    not(any(feature = "redis", feature = "redis-tls")),
    doc = "[list-retrofit]: https://docs.rs/brokerfence/latest/brokerfence/redis/struct.ListRetrofit.html#method.process\n\
           [list-requeue]: https://docs.rs/brokerfence/latest/brokerfence/redis/struct.ListRetrofit.html#method.requeue_popped\n\
           [stream-source]: https://docs.rs/brokerfence/latest/brokerfence/redis/struct.StreamSource.html\n\
           [reliable-list]: https://docs.rs/brokerfence/latest/brokerfence/redis/struct.ReliableList.html\n\
           [redis-mod]: https://docs.rs/brokerfence/latest/brokerfence/redis/index.html"
)]
#![cfg_attr(
    feature = "http",
    doc = "[epoch-guard]: http::EpochGuard\n[atomic-guard]: http::atomic::AtomicEpochGuard\n[http-mod]: http"
)]
#![cfg_attr(
    not(feature = "http"),
    doc = "[epoch-guard]: https://docs.rs/brokerfence/latest/brokerfence/http/struct.EpochGuard.html\n\
           [atomic-guard]: https://docs.rs/brokerfence/latest/brokerfence/http/atomic/struct.AtomicEpochGuard.html\n\
           [http-mod]: https://docs.rs/brokerfence/latest/brokerfence/http/index.html"
)]
#![cfg_attr(feature = "otel", doc = "[otel-mod]: otel")]
#![cfg_attr(not(feature = "otel"), doc = "[otel-mod]: https://docs.rs/brokerfence/latest/brokerfence/otel/index.html")]
#![cfg_attr(feature = "tower", doc = "[tower-handler]: tower::handler")]
#![cfg_attr(
    not(feature = "tower"),
    doc = "[tower-handler]: https://docs.rs/brokerfence/latest/brokerfence/tower/fn.handler.html"
)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

pub mod guide;

#[doc(inline)]
pub use fence::{
    Backend, BoxError, Claim, ClaimedJob, Counter, DEFAULT_SCHEMA, DbTime, Distribution, FailOutcome, FenceError,
    FenceStore, FencedConnection, Heartbeat, IntoJobResult, JobContext, JobError, JobKey, JobRecord, JobResultExt,
    JobState, Lease, LeaseDuration, LeaseHook, LossReason, MAX_KEY_BYTES, MAX_NAME_BYTES, MIN_LEASE, Metrics,
    MetricsSnapshot, Outcome, Owner, QueueName, Result, RetryPolicy, SchemaName, Supervisor, SupervisorConfig, Wake,
    Wakeups,
};

#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
#[doc(inline)]
pub use fence::Json;

#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
#[doc(inline)]
pub use fence::{PgFence, PgTarget, PgTimeouts, Pooler};

#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
#[doc(inline)]
pub use fence::{ReclaimReport, SqliteDurability, SqliteFence};

#[doc(inline)]
pub use adapters::{
    CancellationToken, Consumer, ConsumerConfig, DeadLettered, Detail, Disposition, Handler, Incoming, Processed,
    Reason, ReceiveContext, Retrofit, Source, SourceError, TableQueue, shutdown_signal,
};

#[doc(inline)]
pub use fence::{admin, epoch, ledger, retention, wire};

#[cfg(feature = "otel")]
#[cfg_attr(docsrs, doc(cfg(feature = "otel")))]
#[doc(inline)]
pub use fence::otel;

/// The transactional outbox (PostgreSQL): rows written in the handler's own transaction with the
/// fenced completion ([`PgFence::outbox_in`]), and the relay that publishes them to a broker.
///
/// ```no_run
/// use brokerfence::outbox::{OutboxRelay, OutboxRow, RelayConfig};
/// ```
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod outbox {
    #[doc(inline)]
    pub use adapters::outbox::*;
    #[doc(inline)]
    pub use fence::outbox::*;
}

#[cfg(feature = "tower")]
#[cfg_attr(docsrs, doc(cfg(feature = "tower")))]
#[doc(inline)]
pub use adapters::tower;

#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
#[doc(inline)]
pub use adapters::http;
#[cfg(any(feature = "redis", feature = "redis-tls"))]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
#[doc(inline)]
pub use adapters::redis;
#[cfg(feature = "sqs")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqs")))]
#[doc(inline)]
pub use adapters::sqs;

/// The README's code, compiled as doctests (`cargo test --doc --features sqs,redis,http,tower,serde`; the default
/// backends on).
#[cfg(all(
    doctest,
    feature = "postgres",
    feature = "sqlite",
    feature = "sqs",
    feature = "redis",
    feature = "http",
    feature = "tower",
    feature = "serde"
))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
