//! # brokerfence-testkit — support for brokerfence's own tests and examples
//!
//! Not published, and not part of `brokerfence`'s API:
//! - [`services`]: where PostgreSQL, Redis and SQS are (the environment, else `localstack/.env`);
//! - [`localstack`]: the testcontainers fallback that starts LocalStack when no SQS endpoint is
//!   configured and a Docker engine answers (feature `docker`).
#![warn(missing_docs)]

pub mod localstack;
pub mod services;
