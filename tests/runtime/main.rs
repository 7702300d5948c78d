//! The consumer runtime and the retrofits: receive, group claim, settle and shutdown; bad input;
//! the table queue end to end and its throughput; the handler API and its errors; metrics.
//!
//! | module | what |
//! |---|---|
//! | [`edge_cases`] | cancellation-safe receives and claims at shutdown, bounded memory while a broker hangs, dead letters counted when they moved |
//! | [`table_queue`] | the consumer over the table queue, PostgreSQL and SQLite |
//! | [`bad_input`] | malformed, oversize and strange deliveries across sources |
//! | [`runtime`] | `attempt_timeout` starts with the handler |
//! | [`throughput`], [`throughput_cost`], [`throughput_cursor`], [`throughput_schema`] | `claim_next` in index order, the write cost per job, the claim cursor, HOT updates |
//! | [`retrofit_loops`] | the retrofits in a user's own loop |
//! | [`retrofits`] | nothing popped is lost, dead letters once, the schema check, a panicking handler |
//! | [`ergonomics`] | `anyhow` in handlers, errors that name the API, small errors |
//! | [`latency`] | wake-ups instead of polls: after the commit only, timers for retries, a killed listener, PgBouncer, SQLite, the idle cost |
//! | [`observability`] | counters and histograms through the `metrics` façade |
//! | [`otel`] | one OpenTelemetry trace from `enqueue` through a fenced zombie to the receiver; a malformed context; its cost |

// A module that needs more features than its line here says gates itself with `#![cfg(…)]`.
mod bad_input;
mod edge_cases;
mod ergonomics;
mod latency;
mod observability;
#[cfg(feature = "otel")]
mod otel;
mod retrofit_loops;
#[cfg(all(feature = "redis", feature = "sqs"))]
mod retrofits;
mod runtime;
mod table_queue;
mod throughput;
mod throughput_cost;
mod throughput_cursor;
mod throughput_schema;
