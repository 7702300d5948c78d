//! Issue 16, "Handler API": the retrofits written as a user's plain consumer loop.
//!
//! Each test is the loop a user already has, with the fence put around the handler: a closure
//! that moves loop state in (`FnOnce`), one that borrows a local, `|ctx| async move` with no
//! annotation, `?` on `std::io::Error`, `serde_json` and `sqlx` errors, `String`/`&str` results.
//! They compile (that is half the point) and run against the real services, asserting the
//! committed results: the table `Retrofit` on PostgreSQL, `ListRetrofit` on Redis, `SqsRetrofit`
//! on LocalStack (skipped, with the reason printed, when no SQS endpoint is configured and no
//! Docker engine answers).
//!
//! Also: `.fatal()` makes a job dead on its first failure while a plain `?` error is retried;
//! typed payloads and results (feature `serde`); a tower stack as the handler (feature `tower`);
//! `Consumer::run` stopped by a plain future through its `CancellationToken`.
//!
//! Run: `cargo test --workspace --all-features retrofit_loops` (services from `localstack/up`).

#[cfg(feature = "sqs")]
use brokerfence_testkit::sqs as sqs_support;
use brokerfence_testkit::store as common;

use std::sync::Arc;
use std::time::Duration;

use brokerfence::{
    FenceStore, JobError, JobKey, JobResultExt, JobState, Outcome, QueueName, Retrofit, RetryPolicy, SupervisorConfig,
};
use common::{lease, unique};

/// A file the handlers read (`?` on `std::io::Error`), with the given text.
fn greeting_file(text: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(unique("brokerfence-ergonomics"));
    std::fs::write(&path, text).expect("write the test's file");
    path
}

/// The committed result of `key`, as text.
async fn committed(store: &dyn FenceStore, queue: &QueueName, key: &str) -> Option<String> {
    let job = store.job(queue, &JobKey::new(key).expect("key")).await.expect("read the job")?;
    assert_eq!(job.state, JobState::Completed, "{key}: {job:?}");
    job.result.map(|r| String::from_utf8(r).expect("utf-8 result"))
}

/// The user's handler body, shared by the three loops: reads a file (`io::Error`), parses the
/// payload as JSON (`serde_json::Error`), asks PostgreSQL (`sqlx::Error`), all with `?`.
async fn work(path: &std::path::Path, pool: &sqlx::PgPool, payload: &[u8]) -> Result<String, JobError> {
    let greeting = std::fs::read_to_string(path)?;
    let order: serde_json::Value = serde_json::from_slice(payload)?;
    let qty = order["qty"].as_i64().ok_or_else(|| JobError::fatal("no qty"))?;
    let doubled: i64 = sqlx::query_scalar("SELECT $1::bigint * 2").bind(qty).fetch_one(pool).await?;
    Ok(format!("{greeting} x{doubled}"))
}

/// `Retrofit` (any broker) in a plain loop over received deliveries.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ergonomics_table_retrofit_in_a_plain_loop_pg() {
    let fence = common::pg().await;
    let pool = fence.pool().clone();
    let queue = QueueName::new(unique("ergo-retro")).expect("queue");
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    let retrofit = Retrofit::new(store.clone(), queue.clone(), SupervisorConfig::new(lease(10)));
    let path = greeting_file("hello");
    let received: Vec<(String, Vec<u8>)> =
        (1..=3).map(|i| (format!("order-{i}"), format!(r#"{{"qty":{i}}}"#).into_bytes())).collect();

    let mut handled: Vec<String> = Vec::new(); // loop state the handler borrows
    let mut acked = 0;
    for (id, body) in received {
        let key = JobKey::new(id.as_str()).expect("key");
        let handled = &mut handled;
        let (path, pool) = (&path, &pool);
        // `id` is moved into the handler (a FnOnce); `handled`, `path` and `pool` are borrowed.
        let done = retrofit
            .process(&key, body, |ctx| async move {
                let text = work(path, pool, ctx.payload()).await?;
                handled.push(id);
                Ok(format!("{text} at epoch {}", ctx.epoch()))
            })
            .await;
        if done.should_ack() {
            acked += 1;
        }
    }
    assert_eq!(acked, 3);
    assert_eq!(handled, ["order-1", "order-2", "order-3"]);
    for i in 1..=3 {
        let result = committed(&*store, &queue, &format!("order-{i}")).await;
        assert_eq!(result.as_deref(), Some(format!("hello x{} at epoch 1", 2 * i).as_str()));
    }
    // A `&'static str`, `()` and bytes commit as well.
    let k = JobKey::new("unit").expect("key");
    assert!(retrofit.process(&k, Vec::new(), |_| async { Ok(()) }).await.should_ack());
    assert_eq!(committed(&*store, &queue, "unit").await.as_deref(), Some(""));
    let k = JobKey::new("str").expect("key");
    assert!(retrofit.process(&k, Vec::new(), |_| async { Ok("done") }).await.should_ack());
    assert_eq!(committed(&*store, &queue, "str").await.as_deref(), Some("done"));
    let _ = std::fs::remove_file(path);
}

/// `.fatal()`: the job is dead on its first failure; a plain `?` error is retried (failed, then
/// claimable again once its backoff ran out), with the error's whole chain as its last error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ergonomics_fatal_is_dead_at_once_and_a_plain_error_is_retried_pg() {
    let fence = common::pg().await;
    let queue = QueueName::new(unique("ergo-fatal")).expect("queue");
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    let retry = RetryPolicy {
        max_attempts: 5,
        base_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(200),
    };
    let retrofit = Retrofit::new(store.clone(), queue.clone(), SupervisorConfig::new(lease(10)).retry(retry));
    let pool = fence.pool().clone();

    // A plain `?` on a sqlx error: retried.
    let retried = JobKey::new("retried").expect("key");
    let mut runs = 0;
    let mut last = None;
    for _ in 0..20 {
        let pool = &pool;
        let runs = &mut runs;
        let done = retrofit
            .process(&retried, Vec::new(), |_ctx| async move {
                *runs += 1;
                if *runs == 1 {
                    sqlx::query("SELECT * FROM no_such_table_for_ergonomics").execute(pool).await?;
                }
                Ok("second time lucky")
            })
            .await;
        if let brokerfence::Detail::Ran(Outcome::Failed { error, .. }) = &done.detail {
            assert!(error.contains("no_such_table_for_ergonomics"), "the chain is kept: {error}");
            let job = store.job(&queue, &retried).await.expect("job").expect("row");
            assert_eq!((job.state, job.failures), (JobState::Failed, 1), "{job:?}");
            assert_eq!(job.last_error.as_deref(), Some(error.as_str()));
        }
        let ok = done.should_ack();
        last = Some(done);
        if ok {
            break;
        }
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    assert_eq!(runs, 2, "failed once, then ran again: {last:?}");
    assert_eq!(committed(&*store, &queue, "retried").await.as_deref(), Some("second time lucky"));

    // `.fatal()` on an io::Error: dead on the first failure, never run again.
    let poison = JobKey::new("poison").expect("key");
    let mut poison_runs = 0;
    let poison_runs_ref = &mut poison_runs;
    let done = retrofit
        .process(&poison, b"not json".to_vec(), |ctx| async move {
            *poison_runs_ref += 1;
            let _: serde_json::Value = serde_json::from_slice(ctx.payload()).fatal()?;
            Ok("unreachable")
        })
        .await;
    assert!(matches!(&done.detail, brokerfence::Detail::Ran(Outcome::Dead { .. })), "{done:?}");
    let job = store.job(&queue, &poison).await.expect("job").expect("row");
    assert_eq!((job.state, job.failures), (JobState::Dead, 1), "{job:?}");
    assert!(job.last_error.as_deref().is_some_and(|e| e.contains("expected ident")), "{job:?}");
    let again = retrofit.process(&poison, Vec::new(), |_| async { Ok("ran again") }).await;
    assert!(matches!(again.detail, brokerfence::Detail::NotClaimed(_)), "a dead job is not claimed: {again:?}");
    assert_eq!(poison_runs, 1);

    // `JobError::fatal` and `.no_retry()` alike.
    let k = JobKey::new("no-retry").expect("key");
    let done = retrofit
        .process(&k, Vec::new(), |_| async { Err::<(), _>(JobError::from(std::io::Error::other("gone")).no_retry()) })
        .await;
    assert!(matches!(&done.detail, brokerfence::Detail::Ran(Outcome::Dead { error }) if error == "gone"), "{done:?}");
}

/// `ListRetrofit` in a user's `BRPOP` loop, built from the project's `RedisConnections` (the
/// blocking pop on `redis.blocking()`, the fence's calls on the command connection).
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ergonomics_list_retrofit_in_a_brpop_loop_pg() {
    use brokerfence::redis::{ItemKey, ListRetrofit, RedisConnections, client};
    let fence = common::pg().await;
    let pool = fence.pool().clone();
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    let url = brokerfence_testkit::services::var("REDIS_URL").unwrap_or_else(|| "redis://127.0.0.1:6379".into());
    let redis = RedisConnections::connect(&url).await.expect("connect to Redis (run `localstack/up`)");
    let list = unique("ergo-list");
    let queue = QueueName::new(list.as_str()).expect("queue");
    let config = SupervisorConfig::new(lease(10));
    let fence_list =
        ListRetrofit::new(store.clone(), queue.clone(), config, &redis, list.as_str(), ItemKey::Split(b'|'))
            .expect("retrofit");
    let mut producer = redis.commands();
    for i in 1..=3 {
        let _: i64 = client::cmd("LPUSH")
            .arg(&list)
            .arg(format!(r#"item-{i}|{{"qty":{i}}}"#))
            .query_async(&mut producer)
            .await
            .expect("LPUSH");
    }
    let path = greeting_file("hi");

    // The user's loop: BRPOP with a block longer than the 2 s response timeout of the command
    // connection, on the blocking one, bounded as the README says.
    let mut conn = redis.blocking();
    let block = Duration::from_secs(3);
    let mut popped_count = 0;
    let mut handled = Vec::new();
    while popped_count < 3 {
        let mut brpop = client::cmd("BRPOP");
        brpop.arg(&list).arg(block.as_secs());
        let read = brpop.query_async::<Option<(String, Vec<u8>)>>(&mut conn);
        let popped = tokio::time::timeout(redis.get_timeouts().blocking(block), read).await.expect("BRPOP bounded");
        let Some((_, item)) = popped.expect("BRPOP") else { panic!("the list ran dry") };
        popped_count += 1;
        let seq = popped_count; // loop state moved in
        let (handled, path, pool) = (&mut handled, &path, &pool);
        let done = fence_list
            .process(&item, |ctx| async move {
                let text = work(path, pool, ctx.payload()).await?;
                handled.push(seq);
                Ok(format!("{text} #{seq} by {}", ctx.owner()))
            })
            .await;
        fence_list.requeue_popped(&item, &done).await.expect("requeue_popped");
        assert!(done.should_ack(), "{done:?}");
    }
    assert_eq!(handled, [1, 2, 3]);
    let owner = fence_list.retrofit().supervisor().owner().to_string();
    for i in 1..=3 {
        let result = committed(&*store, &queue, &format!("item-{i}")).await;
        assert_eq!(result, Some(format!("hi x{} #{i} by {owner}", 2 * i)));
    }
    // An empty pop that outlasts the command connection's 2 s response timeout is not an error.
    let mut brpop = client::cmd("BRPOP");
    brpop.arg(&list).arg(block.as_secs());
    let read = brpop.query_async::<Option<(String, Vec<u8>)>>(&mut conn);
    let empty = tokio::time::timeout(redis.get_timeouts().blocking(block), read).await.expect("bounded");
    assert!(matches!(empty, Ok(None)), "{empty:?}");
    let _ = std::fs::remove_file(path);
}

/// `SqsRetrofit` in a user's `ReceiveMessage` loop (LocalStack).
#[cfg(feature = "sqs")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ergonomics_sqs_retrofit_in_a_receive_loop_pg() {
    use brokerfence::sqs::{KeyStrategy, SqsConfig, SqsRetrofit, SqsSource};
    let configured = brokerfence_testkit::services::var("AWS_ENDPOINT_URL_SQS").is_some()
        || brokerfence_testkit::services::var("AWS_ENDPOINT_URL").is_some();
    if !configured && !brokerfence_testkit::localstack::docker_answers() {
        eprintln!(
            "SKIPPED ergonomics_sqs_retrofit_in_a_receive_loop_pg: no SQS endpoint (AWS_ENDPOINT_URL_SQS unset, \
             no localstack/.env) and no Docker engine for LocalStack; run `localstack/up` to include it"
        );
        return;
    }
    let client = sqs_support::sqs().await;
    let fence = common::pg().await;
    let pool = fence.pool().clone();
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    let q = sqs_support::TestQueue::new(&client, "ergo", 30).await;
    let source =
        SqsSource::new(client.clone(), SqsConfig::new(&q.url).expect("url").key(KeyStrategy::body_field("id")));
    let retrofit = SqsRetrofit::new(store.clone(), source, SupervisorConfig::new(lease(10)));
    for i in 1..=3 {
        sqs_support::send(&client, &q.url, &format!(r#"{{"id":"msg-{i}","qty":{i}}}"#)).await;
    }
    let path = greeting_file("hey");
    let mut handled = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while handled.len() < 3 {
        assert!(tokio::time::Instant::now() < deadline, "handled only {handled:?}");
        let out = client
            .receive_message()
            .queue_url(&q.url)
            .max_number_of_messages(10)
            .wait_time_seconds(1)
            .visibility_timeout(30)
            .send()
            .await
            .expect("receive");
        for message in out.messages() {
            let id = message.message_id().unwrap_or_default().to_owned(); // moved in
            let (handled, path, pool) = (&mut handled, &path, &pool);
            let done = retrofit
                .process(message, |ctx| async move {
                    let text = work(path, pool, ctx.payload()).await?;
                    handled.push(id);
                    Ok(format!("{text} for {}", ctx.key()))
                })
                .await;
            assert!(done.reason() == brokerfence::Reason::Committed && done.broker_error.is_none(), "{done:?}");
        }
    }
    assert_eq!(sqs_support::depth(&client, &q.url).await, 0, "every message deleted");
    let queue = q.fence_queue();
    for i in 1..=3 {
        let result = committed(&*store, &queue, &format!("msg-{i}")).await;
        assert_eq!(result, Some(format!("hey x{} for msg-{i}", 2 * i)));
    }
    q.delete(&client).await;
    let _ = std::fs::remove_file(path);
}

/// Typed payloads and results (feature `serde`): `ctx.json::<T>()` and `Json(T)`; a payload that
/// does not deserialize is dead on its first attempt.
#[cfg(feature = "serde")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ergonomics_serde_typed_payload_and_result_sqlite() {
    use brokerfence::Json;
    #[derive(serde::Deserialize)]
    struct Order {
        id: u64,
        qty: u32,
    }
    #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    struct Receipt {
        id: u64,
        total: u32,
    }
    let fence = common::sqlite().await;
    let store: Arc<dyn FenceStore> = Arc::new(fence);
    let queue = QueueName::new("typed").expect("queue");
    let retrofit = Retrofit::new(store.clone(), queue.clone(), SupervisorConfig::new(lease(10)));
    let handler = |ctx: brokerfence::JobContext| async move {
        let order: Order = ctx.json()?;
        Ok(Json(Receipt { id: order.id, total: order.qty * 10 }))
    };
    let k = JobKey::new("order-7").expect("key");
    assert!(retrofit.process(&k, br#"{"id":7,"qty":3}"#.to_vec(), handler).await.should_ack());
    let stored = committed(&*store, &queue, "order-7").await.expect("result");
    assert_eq!(serde_json::from_str::<Receipt>(&stored).expect("json"), Receipt { id: 7, total: 30 });

    let k = JobKey::new("order-bad").expect("key");
    let done = retrofit.process(&k, br#"{"id":"seven"}"#.to_vec(), handler).await;
    assert!(
        matches!(&done.detail, brokerfence::Detail::Ran(Outcome::Dead { error }) if error.contains("invalid type")),
        "{done:?}"
    );
}

/// A tower stack as the handler (feature `tower`): a job past the `TimeoutLayer` is a retried
/// failure ("request timed out"); a fatal `JobError` keeps its flag through the boxed error.
#[cfg(feature = "tower")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ergonomics_tower_stack_as_the_handler_sqlite() {
    use brokerfence::JobContext;
    let fence = common::sqlite().await;
    let store: Arc<dyn FenceStore> = Arc::new(fence);
    let queue = QueueName::new("towered").expect("queue");
    let retrofit = Retrofit::new(store.clone(), queue.clone(), SupervisorConfig::new(lease(10)));
    let service =
        tower::ServiceBuilder::new().timeout(Duration::from_millis(200)).service_fn(|ctx: JobContext| async move {
            match ctx.payload() {
                b"slow" => tokio::time::sleep(Duration::from_secs(2)).await,
                b"poison" => return Err(JobError::fatal("poison")),
                _ => {}
            }
            Ok::<_, JobError>(format!("done {}", ctx.key()))
        });
    let handler = brokerfence::tower::handler(service);
    let k = JobKey::new("fast").expect("key");
    assert!(retrofit.process(&k, b"fast".to_vec(), handler.clone()).await.should_ack());
    assert_eq!(committed(&*store, &queue, "fast").await.as_deref(), Some("done fast"));
    let k = JobKey::new("slow").expect("key");
    let done = retrofit.process(&k, b"slow".to_vec(), handler.clone()).await;
    assert!(
        matches!(&done.detail, brokerfence::Detail::Ran(Outcome::Failed { error, .. }) if error == "request timed out"),
        "{done:?}"
    );
    let k = JobKey::new("poison").expect("key");
    let done = retrofit.process(&k, b"poison".to_vec(), handler).await;
    assert!(matches!(&done.detail, brokerfence::Detail::Ran(Outcome::Dead { error }) if error == "poison"), "{done:?}");
}

/// `Consumer::run` stops on a plain future (a oneshot) through a token it cancels; the handler is
/// an unannotated `|ctx| async move` returning a `String`; `brokerfence::CancellationToken` works
/// with `run`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ergonomics_consumer_runs_until_a_plain_future_sqlite() {
    use brokerfence::{CancellationToken, Consumer, ConsumerConfig, TableQueue};
    let fence = common::sqlite().await;
    let queue = QueueName::new("until").expect("queue");
    for i in 0..3 {
        fence.enqueue(&queue, &JobKey::new(format!("j{i}")).expect("key"), b"x").await.expect("enqueue");
    }
    let store: Arc<dyn FenceStore> = Arc::new(fence.clone());
    let config = ConsumerConfig::new(SupervisorConfig::new(lease(10))).grace(Duration::from_millis(200));
    let consumer = Consumer::new(TableQueue::new(store.clone(), queue.clone()), store.clone(), config);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let metrics = consumer.metrics();
    let watcher = tokio::spawn(async move {
        brokerfence_testkit::wait::wait_for_completions(&metrics, 3, Duration::from_secs(20)).await;
        let _ = stop.send(());
    });
    let until = CancellationToken::new();
    let fire = until.clone();
    tokio::spawn(async move {
        let _ = stopped.await;
        fire.cancel();
    });
    let run = consumer.run(|ctx| async move { Ok(format!("{} done", ctx.key())) }, until);
    tokio::time::timeout(Duration::from_secs(30), run).await.expect("stops on the future").expect("run");
    watcher.await.expect("watcher");
    for i in 0..3 {
        assert_eq!(committed(&*store, &queue, &format!("j{i}")).await, Some(format!("j{i} done")));
    }
    // The re-exported token, cancelled before the run.
    let token = CancellationToken::new();
    token.cancel();
    let old_path = brokerfence::TableQueue::new(store.clone(), queue);
    let consumer = Consumer::new(old_path, store, ConsumerConfig::new(SupervisorConfig::new(lease(10))));
    tokio::time::timeout(Duration::from_secs(30), consumer.run(|_| async { Ok(()) }, token))
        .await
        .expect("stops on the token")
        .expect("run");
}
