//! The surface a caller touches when something happens: the errors of `Consumer::run` and of a
//! source keep the broker's typed error as their `source()`, and the three retrofits (table,
//! SQS, Redis list) answer one `Processed` that says the same words for the same outcome.
//!
//! Run: `cargo test --workspace --all-features surface` (services from `localstack/up`).

use std::error::Error as _;
use std::sync::Arc;
use std::time::Duration;

use brokerfence::{
    CancellationToken, Consumer, ConsumerConfig, Disposition, FenceError, FenceStore, JobContext, JobError, JobKey,
    Processed, QueueName, Reason, Retrofit, SourceError, SupervisorConfig, TableQueue,
};
use brokerfence_testkit::store::{self, lease, unique};

/// What a test compares across the retrofits: the reason, its words, whether to ack.
fn said(done: &Processed) -> (Reason, String, bool) {
    (done.reason(), done.reason().to_string(), done.should_ack())
}

/// A handler that commits its payload.
async fn commit(ctx: JobContext) -> Result<Vec<u8>, JobError> {
    Ok(ctx.payload().to_vec())
}

/// A handler whose attempt fails and is retried.
async fn fail(_ctx: JobContext) -> Result<Vec<u8>, JobError> {
    Err(JobError::retry("downstream said 503"))
}

/// The cause of a source error, as the broker's typed error `E`.
fn cause<E: std::error::Error + 'static>(e: &SourceError) -> Option<&E> {
    e.source().and_then(|c| c.downcast_ref::<E>())
}

/// A consumer of the table queue on a schema that was never migrated ends at once with
/// `SourceError::Fatal`, whose source is the fence's typed `FenceError::SchemaTooOld`; its
/// message still says what to do in words.
#[tokio::test]
async fn surface_consumer_error_carries_the_typed_fence_error() {
    let pg = store::pg_unmigrated().await;
    let store: Arc<dyn FenceStore> = Arc::new(pg.clone());
    let source = TableQueue::new(Arc::clone(&store), QueueName::new(unique("surface")).expect("queue"));
    let consumer = Consumer::new(source, store, ConsumerConfig::new(SupervisorConfig::new(lease(3))));
    let run = tokio::time::timeout(Duration::from_secs(20), consumer.run(commit, CancellationToken::new()))
        .await
        .expect("a consumer on an unmigrated schema ends at once");
    let err = run.expect_err("refused");
    assert!(matches!(err, SourceError::Fatal(_)), "{err:?}");
    assert!(matches!(cause::<FenceError>(&err), Some(FenceError::SchemaTooOld { found: 0, .. })), "{err:?}");
    assert!(err.to_string().contains("FenceStore::migrate"), "{err}");
    store::drop_schema(&pg).await;
}

#[cfg(feature = "sqs")]
mod sqs {
    use super::*;
    use brokerfence::sqs::{SqsConfig, SqsError, SqsRetrofit, SqsSource};
    use brokerfence_testkit::sqs::{TestQueue, aws, dyn_store, receive_raw, send, sqs};

    /// A consumer over an SQS queue that does not exist ends with `SourceError::Fatal`, and the
    /// caller gets the typed `SqsError::QueueNotFound` (URL, endpoint, region) from its source.
    #[tokio::test]
    async fn surface_consumer_error_carries_the_typed_sqs_error() {
        let client = sqs().await;
        let url = format!("{}/000000000000/{}", aws().endpoint.trim_end_matches('/'), unique("surface-missing"));
        let pg = store::pg().await;
        let source = SqsSource::new(client, SqsConfig::new(&url).expect("config"));
        let consumer = Consumer::new(source, dyn_store(&pg), ConsumerConfig::new(SupervisorConfig::new(lease(3))));
        let run = tokio::time::timeout(Duration::from_secs(30), consumer.run(commit, CancellationToken::new()))
            .await
            .expect("a consumer of a missing queue ends");
        let err = run.expect_err("the queue does not exist");
        assert!(matches!(err, SourceError::Fatal(_)), "{err:?}");
        match cause::<SqsError>(&err) {
            Some(SqsError::QueueNotFound { queue_url, .. }) => assert_eq!(queue_url, &url),
            other => panic!("expected SqsError::QueueNotFound as the source, got {other:?} ({err})"),
        }
        assert!(err.to_string().contains("does not exist") && err.to_string().contains("SqsConfig::new"), "{err}");
        store::drop_schema(&pg).await;
    }

    /// The SQS retrofit's answers for: a committed message, the same message again (a
    /// duplicate), a failed attempt.
    pub(super) async fn outcomes() -> Vec<Processed> {
        let client = sqs().await;
        let q = TestQueue::new(&client, "surface", 30).await;
        let pg = store::pg().await;
        let fence = SqsRetrofit::new(
            dyn_store(&pg),
            SqsSource::new(client.clone(), SqsConfig::new(&q.url).expect("config")),
            SupervisorConfig::new(lease(5)),
        );
        send(&client, &q.url, "one").await;
        send(&client, &q.url, "two").await;
        let mut messages = Vec::new();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while messages.len() < 2 && tokio::time::Instant::now() < deadline {
            messages.extend(receive_raw(&client, &q.url, 1).await);
        }
        assert_eq!(messages.len(), 2, "both messages received");
        let committed = fence.process(&messages[0], commit).await;
        let duplicate = fence.process(&messages[0], commit).await;
        let failed = fence.process(&messages[1], fail).await;
        q.delete(&client).await;
        store::drop_schema(&pg).await;
        vec![committed, duplicate, failed]
    }
}

#[cfg(feature = "redis")]
mod redis {
    use super::*;
    use brokerfence::redis::{ItemKey, ListRetrofit, RedisError, StreamSource};
    use brokerfence::{Owner, ReceiveContext, Source};
    use brokerfence_testkit::redis::{Env, PrivateRedis};

    /// A Redis source whose server is gone answers a `SourceError` whose source is the typed
    /// `RedisError`, as the consumer runtime gets it from `Source::receive`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn surface_source_error_carries_the_typed_redis_error() {
        let mut redis = PrivateRedis::start().await;
        let env = Env::on(&redis.url()).await;
        let source =
            StreamSource::new(env.redis.clone(), QueueName::new("surface").expect("queue"), env.name("s"), "g")
                .expect("source");
        redis.kill().await;
        let ctx = ReceiveContext {
            owner: Owner::new("surface").expect("owner"),
            lease: lease(3),
            shutdown: Default::default(),
        };
        let got = tokio::time::timeout(Duration::from_secs(20), source.receive(10, &ctx))
            .await
            .expect("a receive on a stopped Redis answers");
        let err = got.expect_err("Redis is gone");
        assert!(matches!(err, SourceError::Transient(_)), "a connection error is worth retrying: {err:?}");
        assert!(cause::<RedisError>(&err).is_some(), "the source is the typed RedisError: {err:?}");
        store::drop_schema(&env.store).await;
    }

    /// Guard for a defect the one-result change opened: `requeue_popped` takes any `Processed`
    /// now (not only the list retrofit's own answer), and it dropped every `Leave` as "a newer
    /// epoch holds the job". A `Leave` the database did not confirm — from `Retrofit::process`
    /// (a lease lost unconfirmed, a fenced commit) or `Processed::new` — may be the only copy of
    /// a popped item: it must go back to the list. Fails on the old `requeue_popped`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn surface_requeue_popped_puts_back_a_leave_the_database_did_not_confirm() {
        use brokerfence::redis::client::AsyncCommands;
        let env = Env::new().await;
        let list = env.name("surface-leave");
        let fence = ListRetrofit::new(
            env.store(),
            QueueName::new(list.clone()).expect("queue"),
            SupervisorConfig::new(lease(5)),
            &env.redis,
            list.as_str(),
            ItemKey::Split(b'|'),
        )
        .expect("retrofit");
        let unconfirmed = Processed::new(Disposition::Leave, brokerfence::Detail::Ran(brokerfence::Outcome::Released));
        fence.requeue_popped(b"only|copy", &unconfirmed).await.expect("requeue");
        fence.flush(Duration::from_secs(5)).await.expect("flush");
        let mut conn = env.conn();
        let items: Vec<Vec<u8>> = conn.lrange(&list, 0, -1).await.expect("LRANGE");
        assert_eq!(items, vec![b"only|copy".to_vec()], "the popped item was dropped");
        env.cleanup().await;
    }

    /// The list retrofit's answers for: a committed item, the same item again (a duplicate), a
    /// failed attempt.
    pub(super) async fn outcomes() -> Vec<Processed> {
        let env = Env::new().await;
        let list = env.name("surface");
        let queue = QueueName::new(list.clone()).expect("queue");
        let fence = ListRetrofit::new(
            env.store(),
            queue,
            SupervisorConfig::new(lease(5)),
            &env.redis,
            list.as_str(),
            ItemKey::Split(b'|'),
        )
        .expect("retrofit");
        let committed = fence.process(b"one|x", commit).await;
        let duplicate = fence.process(b"one|x", commit).await;
        let failed = fence.process(b"two|y", fail).await;
        store::drop_schema(&env.store).await;
        vec![committed, duplicate, failed]
    }
}

/// The table retrofit's answers for: a committed job, the same key again (a duplicate), a
/// failed attempt.
async fn table_outcomes() -> Vec<Processed> {
    let pg = store::pg().await;
    let fence = Retrofit::new(
        Arc::new(pg.clone()),
        QueueName::new(unique("surface")).expect("queue"),
        SupervisorConfig::new(lease(5)),
    );
    let (one, two) = (JobKey::new("one").expect("key"), JobKey::new("two").expect("key"));
    let committed = fence.process(&one, b"x".to_vec(), commit).await;
    let duplicate = fence.process(&one, b"x".to_vec(), commit).await;
    let failed = fence.process(&two, b"y".to_vec(), fail).await;
    store::drop_schema(&pg).await;
    vec![committed, duplicate, failed]
}

/// The table, SQS and Redis list retrofits answer the same type, `Processed`, and say the same
/// words for the same outcome: "committed" and "duplicate" (both acknowledged), "failed and
/// retried" (redelivered after the backoff).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn surface_three_retrofits_answer_one_result_in_the_same_words() {
    let want = [
        (Reason::Committed, "committed".to_owned(), true),
        (Reason::Duplicate, "duplicate".to_owned(), true),
        (Reason::Retried, "failed and retried".to_owned(), false),
    ];
    let mut answers: Vec<(&str, Vec<Processed>)> = vec![("table", table_outcomes().await)];
    #[cfg(feature = "sqs")]
    answers.push(("sqs", sqs::outcomes().await));
    #[cfg(feature = "redis")]
    answers.push(("redis list", redis::outcomes().await));
    for (which, done) in &answers {
        let got: Vec<_> = done.iter().map(said).collect();
        assert_eq!(got, want, "{which}: {done:#?}");
        assert_eq!(done[0].disposition, Disposition::Ack, "{which}: {:?}", done[0]);
        assert_eq!(done[1].disposition, Disposition::Ack, "{which}: {:?}", done[1]);
        assert!(matches!(done[2].disposition, Disposition::RetryLater(_)), "{which}: {:?}", done[2]);
        assert!(done[0].broker_error.is_none(), "{which}: {:?}", done[0]);
    }
    #[cfg(all(feature = "sqs", feature = "redis"))]
    assert_eq!(answers.len(), 3);
}
