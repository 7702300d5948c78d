//! End to end: the consumer runtime over the table queue, on PostgreSQL and SQLite.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use brokerfence::TableQueue;
use brokerfence::{
    Claim, FenceStore, JobContext, JobError, JobKey, JobState, LeaseDuration, Owner, PgFence, QueueName, SchemaName,
    SqliteFence, SupervisorConfig,
};
use brokerfence::{Consumer, ConsumerConfig, Disposition, Retrofit};
use tokio_util::sync::CancellationToken;

fn unique(prefix: &str) -> String {
    format!("{prefix}_{:016x}", rand::random::<u64>())
}

async fn pg() -> Arc<dyn FenceStore> {
    let url = brokerfence_testkit::services::var("DATABASE_URL")
        .expect("DATABASE_URL is not set and localstack/.env is missing: run `localstack/up` first");
    let store = PgFence::connect(&url)
        .await
        .expect("connect to PostgreSQL (run `localstack/up`)")
        .schema(SchemaName::new(unique("tq")).expect("schema"));
    store.migrate().await.expect("migrate");
    Arc::new(store)
}

async fn sqlite() -> Arc<dyn FenceStore> {
    let path = std::env::temp_dir().join(format!("{}.db", unique("tq")));
    let store = SqliteFence::open(&format!("sqlite:{}", path.display())).await.expect("open sqlite");
    store.migrate().await.expect("migrate");
    Arc::new(store)
}

fn config(lease: u64) -> ConsumerConfig {
    ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(lease).expect("lease")))
        .concurrency(8)
        .batch(16)
        .grace(Duration::from_secs(5))
}

/// Three consumers drain 300 jobs; each job runs to completion exactly once, and every
/// payload reaches its handler intact.
async fn drains_exactly_once(store: Arc<dyn FenceStore>) {
    drain(store, None).await;
}

/// The same with prefetching: claimed jobs wait for a handler slot under heartbeated leases.
async fn drains_exactly_once_with_prefetch(store: Arc<dyn FenceStore>) {
    drain(store, Some(8)).await;
}

async fn drain(store: Arc<dyn FenceStore>, prefetch: Option<usize>) {
    let queue = QueueName::new("drain").expect("queue");
    let jobs: Vec<(JobKey, Vec<u8>)> = (0..300)
        .map(|i| (JobKey::new(format!("job-{i}")).expect("key"), format!("payload-{i}").into_bytes()))
        .collect();
    assert_eq!(store.enqueue_many(&queue, &jobs).await.expect("enqueue"), 300);

    let seen: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let stop = CancellationToken::new();
    let mut runs = Vec::new();
    for _ in 0..3 {
        let cfg = match prefetch {
            Some(n) => config(10).prefetch(n),
            None => config(10),
        };
        let consumer = Consumer::new(TableQueue::new(store.clone(), queue.clone()), store.clone(), cfg);
        let seen = seen.clone();
        let stop = stop.clone();
        runs.push(tokio::spawn(async move {
            let handler = move |ctx: JobContext| {
                let seen = seen.clone();
                async move {
                    let expected = format!("payload-{}", &ctx.key().as_str()[4..]);
                    assert_eq!(ctx.payload(), expected.as_bytes());
                    *seen.lock().expect("lock").entry(ctx.key().as_str().to_owned()).or_default() += 1;
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    Ok(ctx.payload().to_vec())
                }
            };
            consumer.run(handler, stop).await.expect("consumer");
            consumer.metrics().snapshot()
        }));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let done = seen.lock().expect("lock").len();
        if done >= 300 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "jobs not drained in time");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    let mut completions = 0;
    for r in runs {
        let m = r.await.expect("join");
        completions += m.completions;
        assert_eq!(m.fenced_rejections, 0);
        assert_eq!(m.lease_losses, 0);
    }
    assert_eq!(completions, 300);
    let seen = seen.lock().expect("lock").clone();
    assert!(
        seen.values().all(|n| *n == 1),
        "a job ran twice: {:?}",
        seen.iter().filter(|(_, n)| **n != 1).collect::<Vec<_>>()
    );
    for (key, payload) in &jobs {
        let row = store.job(&queue, key).await.expect("job").expect("row");
        assert_eq!(row.state, JobState::Completed);
        assert_eq!(row.epoch, 1);
        assert_eq!(row.result.as_deref(), Some(payload.as_slice()));
    }
}

/// A failing handler is retried with backoff, then goes dead after max attempts; a fatal
/// error goes dead at once. The loop keeps running throughout.
async fn failures_retry_then_die(store: Arc<dyn FenceStore>) {
    let queue = QueueName::new("failing").expect("queue");
    store.enqueue(&queue, &JobKey::new("flaky").expect("key"), b"x").await.expect("enqueue");
    store.enqueue(&queue, &JobKey::new("poison").expect("key"), b"not json").await.expect("enqueue");
    store.enqueue(&queue, &JobKey::new("fine").expect("key"), b"ok").await.expect("enqueue");
    let retry = brokerfence::RetryPolicy {
        max_attempts: 3,
        base_backoff: Duration::from_millis(50),
        max_backoff: Duration::from_millis(200),
    };
    let cfg = ConsumerConfig::new(SupervisorConfig::new(LeaseDuration::from_secs(5).expect("lease")).retry(retry))
        .grace(Duration::from_secs(2));
    let consumer = Consumer::new(
        TableQueue::new(store.clone(), queue.clone()).idle_wait(Duration::from_millis(20)),
        store.clone(),
        cfg,
    );
    let stop = CancellationToken::new();
    let run = {
        let stop = stop.clone();
        async move {
            consumer
                .run(
                    |ctx: JobContext| async move {
                        match ctx.key().as_str() {
                            "flaky" => Err(JobError::retry("upstream 503")),
                            "poison" => Err(JobError::fatal("malformed payload: expected JSON")),
                            _ => Ok(b"done".to_vec()),
                        }
                    },
                    stop,
                )
                .await
                .expect("run");
            consumer.metrics().snapshot()
        }
    };
    let handle = tokio::spawn(run);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let flaky = store.job(&queue, &JobKey::new("flaky").expect("key")).await.expect("job").expect("row");
        if flaky.state == JobState::Dead {
            assert_eq!(flaky.attempts, 3);
            assert_eq!(flaky.last_error.as_deref(), Some("failed 3 times (max_attempts = 3): upstream 503"));
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "flaky job never died: {flaky:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop.cancel();
    let m = handle.await.expect("join");
    let poison = store.job(&queue, &JobKey::new("poison").expect("key")).await.expect("job").expect("row");
    assert_eq!(poison.state, JobState::Dead);
    assert_eq!(poison.attempts, 1);
    let fine = store.job(&queue, &JobKey::new("fine").expect("key")).await.expect("job").expect("row");
    assert_eq!(fine.state, JobState::Completed);
    assert_eq!(m.failures, 2);
    assert_eq!(m.dead_letters, 2);
    assert_eq!(m.completions, 1);
}

/// Shutdown with a job still running past the grace period releases its lease: the job is
/// pending again without an attempt spent, and its next claim gets a higher epoch.
async fn shutdown_releases(store: Arc<dyn FenceStore>) {
    let queue = QueueName::new("slow").expect("queue");
    let key = JobKey::new("slow-1").expect("key");
    store.enqueue(&queue, &key, b"x").await.expect("enqueue");
    let consumer = Consumer::new(
        TableQueue::new(store.clone(), queue.clone()).idle_wait(Duration::from_millis(20)),
        store.clone(),
        config(10).grace(Duration::from_millis(300)),
    );
    let stop = CancellationToken::new();
    let started = Arc::new(tokio::sync::Notify::new());
    let run = {
        let stop = stop.clone();
        let started = started.clone();
        tokio::spawn(async move {
            consumer
                .run(
                    move |_ctx: JobContext| {
                        let started = started.clone();
                        async move {
                            started.notify_one();
                            tokio::time::sleep(Duration::from_secs(60)).await;
                            Ok(Vec::new())
                        }
                    },
                    stop,
                )
                .await
                .expect("run");
            consumer.metrics().snapshot()
        })
    };
    tokio::time::timeout(Duration::from_secs(10), started.notified()).await.expect("job started");
    stop.cancel();
    let m = tokio::time::timeout(Duration::from_secs(10), run).await.expect("shutdown in time").expect("join");
    assert_eq!(m.releases, 1);
    let row = store.job(&queue, &key).await.expect("job").expect("row");
    assert_eq!(row.state, JobState::Pending);
    assert_eq!(row.attempts, 0);
    assert_eq!(row.epoch, 1);
    let again = store
        .claim_next(&queue, &Owner::unique("next"), LeaseDuration::from_secs(5).expect("lease"), 1)
        .await
        .expect("claim");
    assert_eq!(again[0].lease.epoch, 2);
}

/// The retrofit middleware inside a loop the user owns: first delivery runs and says ack; a
/// redelivery of the same key is a duplicate (ack without running); a delivery of a key another
/// owner holds says hold.
async fn retrofit_dispositions(store: Arc<dyn FenceStore>) {
    let queue = QueueName::new("retrofit").expect("queue");
    let fence =
        Retrofit::new(store.clone(), queue.clone(), SupervisorConfig::new(LeaseDuration::from_secs(5).expect("lease")));
    let key = JobKey::new("msg-1").expect("key");
    let ran = Arc::new(Mutex::new(0));
    let handler = {
        let ran = ran.clone();
        move |ctx: JobContext| {
            let ran = ran.clone();
            async move {
                *ran.lock().expect("lock") += 1;
                Ok(format!("epoch {}", ctx.epoch()).into_bytes())
            }
        }
    };
    let first = fence.process(&key, b"body".to_vec(), handler.clone()).await;
    assert!(first.should_ack(), "{first:?}");
    let dup = fence.process(&key, b"body".to_vec(), handler.clone()).await;
    assert!(dup.should_ack());
    assert_eq!(*ran.lock().expect("lock"), 1, "a duplicate delivery ran the handler");

    let held = JobKey::new("msg-2").expect("key");
    let other = Owner::unique("other");
    let claim = store.claim(&queue, &held, &other, LeaseDuration::from_secs(30).expect("lease")).await.expect("claim");
    assert!(matches!(claim, Claim::Claimed(_)));
    let busy = fence.process(&held, b"body".to_vec(), handler).await;
    assert!(matches!(busy.disposition, Disposition::Hold(ttl) if ttl > Duration::from_secs(20)), "{busy:?}");
    assert_eq!(*ran.lock().expect("lock"), 1);
}

macro_rules! both {
    ($($name:ident),*) => {
        mod on_postgres {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(pg().await).await })*
        }
        mod on_sqlite {
            use super::*;
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() { super::$name(sqlite().await).await })*
        }
    };
}

both!(
    drains_exactly_once,
    drains_exactly_once_with_prefetch,
    failures_retry_then_die,
    shutdown_releases,
    retrofit_dispositions
);
