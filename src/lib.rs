//! # brokerfence
//!
//! Makes message consumers safe against **zombie workers**: a worker that claimed a job, stalled
//! past its lease (a GC-like pause, a hung call, `SIGSTOP`) and woke up after another worker took
//! the job over finds its late work refused.
//!
//! Every claim of a job increments a monotonic **epoch** (a fencing token) in PostgreSQL or
//! SQLite, judged on the database clock. Heartbeats, checkpoints, completion and failure are
//! compare-and-set on (job, owner, epoch): zero rows matched means the worker was superseded, its
//! handler is cancelled at once and its result dropped ([`FenceError::Fenced`]). Broker adapters
//! map a delivery onto that epoch, so the broker's visibility timeout is only a hint: **the
//! database epoch decides which result commits**, and the broker is acknowledged only after that
//! commit. Downstream receivers keep the newest epoch per job ([`Ledger`]) and refuse older ones.
//!
//! ## Ways in
//!
//! Pick the one that matches what you have today. Each runs your handler under a lease that a
//! heartbeat renews every lease/3. A handler is a closure `|ctx| async move { … }` (no type
//! annotation needed) taking a [`JobContext`] and returning its result — anything
//! [`IntoJobResult`]: bytes, a `String`, a `&'static str`, `()`, or with the feature `serde` a
//! `Json(value)` — or a [`JobError`]. `?` works on any error
//! (`std::error::Error + Send + Sync + 'static`, and `anyhow::Error` with the feature `anyhow`):
//! the attempt fails and is retried, with the
//! error's whole chain as the job's last error; [`.fatal()`](JobResultExt::fatal) makes a failure
//! final (the job goes dead at once). The retrofits await the handler in place, so there it may be
//! any `FnOnce`, moving loop state in or borrowing locals; [`Consumer`] runs many at once, so its
//! handler is a [`Handler`] (`Fn + Clone + Send + Sync + 'static`). With the feature `tower`, a
//! tower `Service<JobContext>` stack is a handler too ([`tower::handler`][tower-handler]).
//!
//! | you have | use | feature |
//! |---|---|---|
//! | no broker: jobs in a database table | [`Consumer`] over a [`TableQueue`], on [`PgFence`] or [`SqliteFence`] | `postgres` / `sqlite` |
//! | your own receive loop, any broker | [`Retrofit::process`] per delivery; you ack when [`Processed::should_ack`] says so | — |
//! | your own SQS `ReceiveMessage` loop | [`SqsRetrofit::process`][sqs-retrofit] per message: it deletes the message itself | `sqs` |
//! | your own Redis `BRPOP` loop | [`ListRetrofit::process`][list-retrofit], then [`requeue_popped`][list-requeue] | `redis` |
//! | an SQS queue, a Redis stream or list, and no loop yet | [`Consumer`] over an [`SqsSource`][sqs-source], [`StreamSource`][stream-source] or [`ReliableList`][reliable-list] | `sqs` / `redis` |
//! | a handler that writes its own rows | [`JobContext::complete_in`]: your rows and the fenced completion in one transaction | `postgres` / `sqlite` |
//! | a downstream HTTP receiver | [`EpochGuard`][epoch-guard] / [`AtomicEpochGuard`][atomic-guard] on an axum router | `http` |
//!
//! ### A table queue
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
//!         shutdown_signal(), // or `run_until(handler, any_future)`
//!     )
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! [`SqliteFence::open`]`("sqlite:jobs.db")` is the embedded single-host store with the same API.
//!
//! ### Inside a loop you already own
//!
//! ```no_run
//! use brokerfence::{FenceStore, JobKey, JobResultExt, LeaseDuration, QueueName, Retrofit, SupervisorConfig};
//!
//! # async fn demo(store: std::sync::Arc<dyn FenceStore>) -> brokerfence::Result<()> {
//! let config = SupervisorConfig::new(LeaseDuration::from_secs(30)?);
//! let fence = Retrofit::new(store, QueueName::new("orders")?, config); // one per process
//! let mut handled = 0; // your loop's state: the handler may borrow it
//! // for each delivery your loop received:
//! let count = &mut handled;
//! let done = fence
//!     .process(&JobKey::new("msg-id")?, b"body".to_vec(), |ctx| async move {
//!         let body = std::str::from_utf8(ctx.payload()).fatal()?; // not UTF-8: dead, never retried
//!         std::fs::write("/tmp/last-order", body)?; // an io::Error: retried
//!         *count += 1;
//!         Ok(format!("handled at epoch {}", ctx.epoch()))
//!     })
//!     .await;
//! if done.should_ack() { /* delete / XACK / LREM the delivery */ }
//! # Ok(()) }
//! ```
//!
//! [`Processed::disposition`] says exactly what to tell the broker ([`Disposition`]): `Ack`,
//! `RetryLater`, `DeadLetter`, `Hold` (another worker holds a live lease), `Abandon`, or `Leave`
//! (lease lost or commit fenced: never touch the delivery with a stale handle).
//!
//! The SQS, Redis list and stream versions, with code, are in the repository's README and on
//! the pages of [`adapters::sqs`][sqs-mod] and [`adapters::redis`][redis-mod].
//!
//! ## Features
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `postgres` | yes | [`PgFence`], [`PgLedger`], the transactional outbox ([`PgFence::outbox_in`], [`adapters::outbox::OutboxRelay`]) |
//! | `sqlite` | yes | [`SqliteFence`], [`SqliteLedger`] (compiles the bundled SQLite from C) |
//! | `sqs` | | [`adapters::sqs`][sqs-mod]: source, retrofit and outbox publisher (aws-sdk-sqs, one rustls/*ring* HTTP stack) |
//! | `redis` | | [`adapters::redis`][redis-mod]: streams, lists, lease keys, outbox publisher |
//! | `redis-tls` | | `rediss://` URLs (rustls on *ring*, system roots) |
//! | `http` | | [`adapters::http`][http-mod]: the axum middleware that enforces the epoch on a receiver |
//! | `tls` | | TLS to PostgreSQL (rustls on *ring*, system roots): see [`PgFence::connect_with`] |
//! | `tower` | | [`tower::handler`][tower-handler]: a tower `Service<JobContext>` stack (timeout, concurrency limit, retry, tracing layers) as the handler |
//! | `serde` | | typed payloads and results: `ctx.json::<T>()` and the `Json(T)` result (serde_json) |
//! | `anyhow` | | `?` on `anyhow::Error` (and `.fatal()` on `anyhow::Result`) in a handler: `JobError::from_anyhow` |
//!
//! A PostgreSQL-only application depends on
//! `brokerfence = { version = "0.1", default-features = false, features = ["postgres"] }`, so
//! SQLite's C sources are not compiled.
//!
//! ## Paths
//!
//! Everything public of the two member crates is re-exported here, at the crate root
//! (`brokerfence::PgFence`, `brokerfence::Consumer`, `brokerfence::sqs::SqsRetrofit`), and
//! under the member's name ([`brokerfence::fence`](fence), the epoch authority: store, supervisor,
//! ledger, wire format; [`brokerfence::adapters`](adapters), the consumer runtime, the sources
//! and the retrofit middleware). Both paths name the same items. The outbox's rows are in
//! [`outbox`] (`brokerfence::fence::outbox`), its relay in `brokerfence::adapters::outbox`
//! (both PostgreSQL only). Depend on `brokerfence` only: the members are an implementation
//! detail that keeps the layering (adapters → fence) compiler-enforced.
//!
//! ## Where to read next
//!
//! - [`Consumer`] and [`ConsumerConfig`]: concurrency, prefetch, claim and ack batching,
//!   shutdown, retention.
//! - [`SupervisorConfig`] and [`JobContext`]: leases, heartbeats, cancellation, checkpoints.
//! - [`FenceStore`]: the statements every store runs; [`Retention`]: how long a key is
//!   remembered.
//! - [`wire`] and [`Ledger`]: the stamp a worker sends downstream and how a receiver checks it.
//! - The repository's README: side effects, retention, what happens at the edges (slow brokers,
//!   rolling deploys, destructive pops, dead letters) and the tests that show each rule;
//!   `docs/performance.md` for the measurements; `examples/` for workers to copy.
//!
#![cfg_attr(
    feature = "sqs",
    doc = "[sqs-retrofit]: sqs::SqsRetrofit::process\n[sqs-source]: sqs::SqsSource\n[sqs-mod]: adapters::sqs"
)]
#![cfg_attr(
    not(feature = "sqs"),
    doc = "[sqs-retrofit]: https://docs.rs/brokerfence/latest/brokerfence/sqs/struct.SqsRetrofit.html#method.process\n\
           [sqs-source]: https://docs.rs/brokerfence/latest/brokerfence/sqs/struct.SqsSource.html\n\
           [sqs-mod]: https://docs.rs/brokerfence/latest/brokerfence/adapters/sqs/index.html"
)]
#![cfg_attr(
    any(feature = "redis", feature = "redis-tls"),
    doc = "[list-retrofit]: redis::ListRetrofit::process\n[list-requeue]: redis::ListRetrofit::requeue_popped\n\
           [stream-source]: redis::StreamSource\n[reliable-list]: redis::ReliableList\n[redis-mod]: adapters::redis"
)]
#![cfg_attr(
    not(any(feature = "redis", feature = "redis-tls")),
    doc = "[list-retrofit]: https://docs.rs/brokerfence/latest/brokerfence/redis/struct.ListRetrofit.html#method.process\n\
           [list-requeue]: https://docs.rs/brokerfence/latest/brokerfence/redis/struct.ListRetrofit.html#method.requeue_popped\n\
           [stream-source]: https://docs.rs/brokerfence/latest/brokerfence/redis/struct.StreamSource.html\n\
           [reliable-list]: https://docs.rs/brokerfence/latest/brokerfence/redis/struct.ReliableList.html\n\
           [redis-mod]: https://docs.rs/brokerfence/latest/brokerfence/adapters/redis/index.html"
)]
#![cfg_attr(
    feature = "http",
    doc = "[epoch-guard]: http::EpochGuard\n[atomic-guard]: http::atomic::AtomicEpochGuard\n[http-mod]: adapters::http"
)]
#![cfg_attr(
    not(feature = "http"),
    doc = "[epoch-guard]: https://docs.rs/brokerfence/latest/brokerfence/http/struct.EpochGuard.html\n\
           [atomic-guard]: https://docs.rs/brokerfence/latest/brokerfence/http/struct.AtomicEpochGuard.html\n\
           [http-mod]: https://docs.rs/brokerfence/latest/brokerfence/adapters/http/index.html"
)]
#![cfg_attr(feature = "tower", doc = "[tower-handler]: tower::handler")]
#![cfg_attr(
    not(feature = "tower"),
    doc = "[tower-handler]: https://docs.rs/brokerfence/latest/brokerfence/tower/fn.handler.html"
)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

#[doc(inline)]
pub use fence::{
    Backend, BoxError, Claim, ClaimedJob, Counter, DEFAULT_SCHEMA, DbTime, Distribution, FailOutcome, FenceError,
    FenceStore, FencedConnection, Heartbeat, IntoJobResult, JobContext, JobError, JobKey, JobRecord, JobResultExt,
    JobState, Lease, LeaseDuration, LeaseHook, LossReason, MAX_KEY_BYTES, MAX_NAME_BYTES, MIN_LEASE, Metrics,
    MetricsSnapshot, Outcome, Owner, QueueName, Result, RetryPolicy, SchemaName, Supervisor, SupervisorConfig,
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
    ReceiveContext, Retrofit, Source, SourceError, TableQueue, shutdown_signal,
};

#[doc(inline)]
pub use fence::{admin, epoch, ledger, retention, wire};

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
