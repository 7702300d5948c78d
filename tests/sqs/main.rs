//! The SQS source and retrofit against LocalStack: each test has its own queue(s) and PostgreSQL
//! schema.
//!
//! | module | what |
//! |---|---|
//! | [`e2e`] | worker processes of `examples/sqs_worker.rs`, FIFO queues, the retrofit, dead letters |
//! | [`edge_cases`] | bounded calls, the RedrivePolicy check, FIFO group order, stale receipt handles |
//! | [`otel`] | one OpenTelemetry trace from a producer through a fenced zombie to the receiver; a malformed context; the attribute limit |
//! | [`sqs`] | a dead letter sent once, FIFO order under a paused holder |

mod e2e;
mod edge_cases;
#[cfg(feature = "otel")]
mod otel;
#[cfg(feature = "sqs")]
mod sqs;
