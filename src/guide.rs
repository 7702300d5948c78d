//! Guides: how to use brokerfence, topic by topic, with code that compiles.
//!
//! Each module below holds one guide of the repository's `docs/` directory, so the guides read the
//! same here and on the repository, and their code is compiled as doctests. The modules hold no
//! items.
//!
//! | guide | what it covers |
//! |---|---|
//! | [`handlers`] | results and errors, `FnOnce` handlers in your loop, `Consumer` handlers, serde, tower |
//! | [`sqs`] | `SqsRetrofit`, `SqsSource`, job keys, dead letters and `maxReceiveCount`, timeouts |
//! | [`redis`] | streams, `ListRetrofit` in a `BRPOP` loop, `ReliableList`, item keys |
//! | [`side_effects`] | the handler-owned commit, transactional enqueue, receivers, the outbox |
//! | [`edges`] | slow brokers and databases, rolling deploys, nothing lost, dead letters, FIFO, chaos |
//! | [`operations`] | retention, metrics, the CLI, pointing at services, production PostgreSQL and Redis |
//! | [`tracing`] | OpenTelemetry (feature `otel`): one trace from the producer through the broker to each attempt and receiver |
//! | [`model`] | what is model-checked, each guard and its test |
//! | [`performance`] | every figure with the command that reproduces it |

// The guides' code needs the backends and the brokers: under `cargo test --doc` a guide's text is
// attached (and its code compiled) only when the features that code uses are on (`--all-features`
// turns them all on). Every other build attaches every guide, so the API reference shows them all.

#[cfg_attr(not(doctest), doc = include_str!("../docs/handlers.md"))]
#[cfg_attr(all(doctest, feature = "postgres", feature = "serde"), doc = include_str!("../docs/handlers.md"))]
pub mod handlers {}

#[cfg_attr(not(doctest), doc = include_str!("../docs/sqs.md"))]
#[cfg_attr(all(doctest, feature = "postgres", feature = "sqs"), doc = include_str!("../docs/sqs.md"))]
pub mod sqs {}

#[cfg_attr(not(doctest), doc = include_str!("../docs/redis.md"))]
#[cfg_attr(all(doctest, feature = "postgres", feature = "redis"), doc = include_str!("../docs/redis.md"))]
pub mod redis {}

#[cfg_attr(not(doctest), doc = include_str!("../docs/side-effects.md"))]
#[cfg_attr(
    all(doctest, feature = "postgres", feature = "sqs", feature = "redis"),
    doc = include_str!("../docs/side-effects.md")
)]
pub mod side_effects {}

#[doc = include_str!("../docs/edges.md")]
pub mod edges {}

#[cfg_attr(not(doctest), doc = include_str!("../docs/operations.md"))]
#[cfg_attr(all(doctest, feature = "postgres"), doc = include_str!("../docs/operations.md"))]
pub mod operations {}

#[cfg_attr(not(doctest), doc = include_str!("../docs/tracing.md"))]
#[cfg_attr(all(doctest, feature = "postgres", feature = "sqs", feature = "otel"), doc = include_str!("../docs/tracing.md"))]
pub mod tracing {}

#[doc = include_str!("../docs/model.md")]
pub mod model {}

#[doc = include_str!("../docs/performance.md")]
pub mod performance {}
