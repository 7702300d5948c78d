//! The testcontainers fallback (LocalStack in Docker when no SQS endpoint is configured).
//!
//! It needs a Docker engine, which this project's own machines do not have: there the test SKIPS
//! and prints why, on the test run's own stderr (past the harness' capture, so the reason shows in
//! a plain `cargo test`). With an engine, it must start LocalStack and
//! the endpoint must answer, or the test fails. The other services are not optional: their tests
//! keep failing loudly when PostgreSQL, Redis or SQS are missing.

use std::io::Write;

use brokerfence_testkit::localstack::{self, FallbackError};

/// Says why the test skips, where a plain `cargo test` shows it: `println!` would be captured.
fn skipped(reason: &str) {
    let _ = writeln!(std::io::stderr(), "SKIPPED onboarding_localstack_fallback: {reason}");
}

#[test]
fn onboarding_localstack_fallback_starts_or_skips_without_docker() {
    if !localstack::docker_answers() {
        skipped(
            "no Docker engine answers (DOCKER_HOST or /var/run/docker.sock), so the testcontainers \
             fallback cannot run here",
        );
        // Without an engine the fallback must say so rather than hang or panic.
        match localstack::start() {
            Err(FallbackError::NoDocker | FallbackError::NotBuilt) => {}
            other => panic!("without Docker the fallback answered {other:?}"),
        }
        return;
    }
    if !cfg!(feature = "docker") {
        skipped("brokerfence-testkit built without feature `docker`");
        assert!(matches!(localstack::start(), Err(FallbackError::NotBuilt)));
        return;
    }
    let endpoint = match localstack::start() {
        Ok(endpoint) => endpoint,
        Err(e) => panic!("a Docker engine answers, but the LocalStack fallback failed: {e}"),
    };
    assert!(localstack::answers(&endpoint), "LocalStack started at {endpoint} but does not answer");
    assert_eq!(localstack::start().ok().as_deref(), Some(endpoint.as_str()), "a second start must reuse the container");
}
