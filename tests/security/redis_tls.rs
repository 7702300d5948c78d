//! TLS to Redis (feature `redis-tls`, rustls on ring): a `rediss://` URL negotiates TLS, and a
//! server that does not speak TLS (the local test Redis) is refused at once with a typed error
//! instead of silently falling back to plain text.
#![cfg(feature = "redis-tls")]

use std::time::{Duration, Instant};

use brokerfence::redis::RedisConnections;

fn plain_redis_as_tls_url() -> String {
    let url = brokerfence_testkit::services::var("REDIS_URL")
        .expect("REDIS_URL is not set and localstack/.env is missing: run `localstack/up` first");
    assert!(url.starts_with("redis://"), "the test Redis is expected to be plain: {url}");
    url.replacen("redis://", "rediss://", 1)
}

#[tokio::test]
async fn rediss_to_a_plain_server_fails_fast_with_a_typed_error() {
    let url = plain_redis_as_tls_url();
    // The plain server answers, so the failure below is the TLS handshake, not a dead server.
    let plain = url.replacen("rediss://", "redis://", 1);
    RedisConnections::connect(&plain).await.expect("the plain Redis answers");

    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(30), RedisConnections::connect(&url))
        .await
        .expect("a TLS connect to a plain server must fail, not hang");
    let err = match result {
        Ok(_) => panic!("a TLS connection to a plain-text Redis must not succeed"),
        Err(e) => e,
    };
    let text = err.to_string();
    assert!(!text.is_empty());
    println!("rediss:// against plain Redis refused after {:?}: {text}", started.elapsed());
}
