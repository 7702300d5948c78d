//! Issue #30 (see main.rs for the items of this module): the retrofits and the requeue of broker
//! jobs, against the real PostgreSQL, SQLite, Redis (the shared one, and private `redis-server`s
//! a test kills and starts again) and SQS (LocalStack) of `localstack/up`.
//!
//! - 3: nothing popped is lost while Redis comes back ([`ListRetrofit`]'s holding area);
//! - 9 (Redis part): a list dead letter is added once; `dead requeue` refuses jobs claimed from a
//!   broker (library and CLI) unless asked to requeue them;
//! - 11: the retrofits check the schema on first use and stop the loop with its message;
//! - 12: a panicking handler is a failed attempt with its message, in both retrofits and in the
//!   consumer (there is no stream retrofit: streams run under the `Consumer`).

use std::sync::Arc;
use std::time::Duration;

use brokerfence::TableQueue;
use brokerfence::admin::{Admin, AdminError, Requeue};
use brokerfence::redis::client;
use brokerfence::redis::{ItemKey, ListRetrofit, RedisError, ReliableList};
use brokerfence::sqs::{SqsConfig, SqsRetrofit, SqsSource};
use brokerfence::{
    Claim, FenceError, FenceStore, JobContext, JobError, JobKey, JobState, Outcome, Owner, QueueName, RetryPolicy,
    SupervisorConfig,
};
use brokerfence::{DeadLettered, Detail, Disposition, Incoming, Processed, ReceiveContext, Source};
use brokerfence_testkit::redis::{Env, PrivateRedis, consumer_config, spawn_consumer};
use brokerfence_testkit::sqs::{TestQueue, dyn_store, receive_raw, send, sqs};
use brokerfence_testkit::store::{self, key, lease, unique};
use brokerfence_testkit::wait::wait_for;

fn queue(name: &str) -> QueueName {
    QueueName::new(name).expect("queue name")
}

/// The items of `list`, oldest last (as `LRANGE 0 -1` answers).
async fn lrange(env: &Env, list: &str) -> Vec<String> {
    let items: Vec<Vec<u8>> =
        client::cmd("LRANGE").arg(list).arg(0).arg(-1).query_async(&mut env.conn()).await.expect("LRANGE");
    items.into_iter().map(|i| String::from_utf8_lossy(&i).into_owned()).collect()
}

async fn lpush(env: &Env, list: &str, item: &str) {
    let _: i64 = client::cmd("LPUSH").arg(list).arg(item).query_async(&mut env.conn()).await.expect("LPUSH");
}

async fn rpop(env: &Env, list: &str) -> Vec<u8> {
    let item: Option<Vec<u8>> = client::cmd("RPOP").arg(list).query_async(&mut env.conn()).await.expect("RPOP");
    item.expect("an item to pop")
}

fn list_fence(env: &Env, store: Arc<dyn FenceStore>, list: &str, config: SupervisorConfig) -> ListRetrofit {
    ListRetrofit::new(store, queue(list), config, &env.redis, list, ItemKey::Split(b'|')).expect("retrofit")
}

/// A handler that panics with `message` (its result type named: nothing else says it).
async fn panics(_ctx: JobContext, message: &'static str) -> Result<Vec<u8>, JobError> {
    if !message.is_empty() {
        panic!("{message}");
    }
    Ok(Vec::new())
}

// ------------------------------------------------------------------------------------------------
// 3. A popped list item can vanish
// ------------------------------------------------------------------------------------------------

/// Item 3 ("A popped list item can vanish"): two items popped with `RPOP` — one whose attempt
/// failed (a retry, pushed back after its backoff) and one to give back at once (a release) —
/// are handed to `requeue_popped` while Redis is down, and Redis comes back empty (a restart
/// without persistence) within the lease. Both must be back on the list, once each, and the
/// caller's `?` must not have been handed an error that drops them.
///
/// Guard: the retrofit's holding area (`adapters/src/redis/list/holding.rs`), which keeps each
/// item and sends it again with backoff until Redis takes it. Without it (one `LPUSH` per item,
/// from a spawned task for the retry) the immediate push-back failed with an error and the
/// delayed one was logged and dropped: "timed out after 6s waiting for both popped items back on
/// the list" (the list empty; the immediate push-back had answered `Err(… LPUSH … broken pipe)`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item3_popped_items_survive_a_redis_restart() {
    let mut redis = PrivateRedis::start().await;
    let env = Env::on(&redis.url()).await;
    let list = env.name("popped");
    let policy = RetryPolicy { base_backoff: Duration::from_millis(800), ..RetryPolicy::default() };
    let config = SupervisorConfig::new(lease(6)).retry(policy);
    let fence = list_fence(&env, env.store(), &list, config).command_timeout(Duration::from_millis(300));
    lpush(&env, &list, "retry-1|x").await;
    lpush(&env, &list, "release-1|y").await;
    let retry_item = rpop(&env, &list).await;
    let release_item = rpop(&env, &list).await;

    let failed = fence
        .process(&retry_item, |_ctx: JobContext| async move { Err::<(), _>(JobError::retry("downstream said 503")) })
        .await;
    assert!(matches!(failed.disposition, Disposition::RetryLater(_)), "{failed:?}");
    // A release (the worker shutting down before it ran the item): give it back at once.
    let released = Processed::new(Disposition::Abandon, Detail::Ran(Outcome::Released));

    redis.kill().await;
    let answered =
        (fence.requeue_popped(&release_item, &released).await, fence.requeue_popped(&retry_item, &failed).await);
    let held_while_down = fence.held();
    // Redis stays down past the retry's backoff, so its delayed push-back fails too.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    redis.restart().await;

    let back = wait_for("both popped items back on the list", Duration::from_secs(6), || {
        let (env, list) = (&env, list.clone());
        async move {
            let items = lrange(env, &list).await;
            (items.len() >= 2).then_some(items)
        }
    })
    .await;
    let mut back = back;
    back.sort();
    assert_eq!(back, ["release-1|y", "retry-1|x"], "each item back once");
    assert!(
        answered.0.is_ok() && answered.1.is_ok(),
        "a Redis error must not reach the caller's `?` (it would leave the loop with the item): {answered:?}"
    );
    assert_eq!(held_while_down, 2, "both items were held while Redis was down");
    fence.flush(Duration::from_secs(2)).await.expect("nothing left held");
    assert_eq!(fence.held(), 0);
    env.cleanup().await;
}

// ------------------------------------------------------------------------------------------------
// 9. Dead letters sent twice; `dead requeue` of broker jobs
// ------------------------------------------------------------------------------------------------

/// Item 9, Redis part ("Dead letters counted or sent twice"): a reliable-list item dead-lettered
/// twice (a second delivery of the same item, a retried settle) is added to the dead-letter
/// stream once. Guard: `LIST_DEAD` adds the entry only when its `LREM` removed the item from the
/// processing list. Without it: "the dead-letter stream holds 2 entries".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item9_a_list_item_is_dead_lettered_once() {
    let env = Env::new().await;
    let list = env.name("dead-once");
    let source = ReliableList::new(env.redis.clone(), queue(&list), list.as_str(), ItemKey::Split(b'|'))
        .expect("source")
        .block(Duration::from_millis(50));
    lpush(&env, &list, "k-1|body").await;
    let ctx = ReceiveContext {
        owner: Owner::new("dead-once").expect("owner"),
        lease: lease(5),
        shutdown: Default::default(),
    };
    let mut got = source.receive(10, &ctx).await.expect("receive");
    let delivery = match got.pop() {
        Some(Incoming::Unclaimed { delivery, .. }) => delivery,
        other => panic!("expected the item, got {other:?}"),
    };
    // `dead_letters` counts what a call added: the first moves the item, the second finds it gone.
    let first = source.dead_letter_once(delivery.clone(), "job is dead").await.expect("dead-letter");
    let again = source.dead_letter_once(delivery, "job is dead").await.expect("dead-letter again");
    assert_eq!((first, again), (DeadLettered::Moved, DeadLettered::AlreadyMoved));
    let entries: i64 =
        client::cmd("XLEN").arg(source.get_dead_letter_stream()).query_async(&mut env.conn()).await.expect("XLEN");
    assert_eq!(entries, 1, "the dead-letter stream holds {entries} entries for one item");
    let processing: i64 =
        client::cmd("LLEN").arg(source.get_processing()).query_async(&mut env.conn()).await.expect("LLEN");
    assert_eq!(processing, 0);
    env.cleanup().await;
}

/// A dead job claimed from a broker (no payload: `claim`, as SQS and Redis sources do) and a dead
/// table-queue job (enqueued with its payload, then claimed), in `q`.
async fn seed_dead(store: &dyn FenceStore, q: &QueueName) {
    let me = Owner::new("worker-a").expect("owner");
    assert!(store.enqueue(q, &key("table-1"), b"payload").await.expect("enqueue"));
    for k in ["table-1", "broker-1"] {
        let Claim::Claimed(l) = store.claim(q, &key(k), &me, lease(30)).await.expect("claim") else {
            panic!("claim {k}")
        };
        store.fail(&l, "poison", false, &RetryPolicy::default()).await.expect("fail to dead");
    }
}

async fn requeue_refusal_case(store: &dyn FenceStore) {
    let q = queue(&unique("dead"));
    seed_dead(store, &q).await;
    let admin = Admin::new(store).expect("admin");
    let state = |k: &'static str| {
        let q = q.clone();
        async move { store.job(&q, &key(k)).await.expect("read").expect("row") }
    };

    for which in [Requeue::Keys(vec![key("table-1"), key("broker-1")]), Requeue::AllDead] {
        match admin.requeue_dead(&q, which.clone()).await {
            Err(AdminError::BrokerJobs { keys, count, .. }) => {
                assert_eq!((keys, count), (vec![key("broker-1")], 1), "{which:?}");
            }
            other => panic!("{which:?}: a requeue of a broker job must be refused, got {other:?}"),
        }
        for k in ["table-1", "broker-1"] {
            assert_eq!(state(k).await.state, JobState::Dead, "{which:?}: a refused requeue changes nothing ({k})");
        }
    }
    let err = admin.requeue_dead(&q, Requeue::AllDead).await.expect_err("refused");
    let text = err.to_string();
    for want in ["claimed from a broker (broker-1)", "Re-send their messages", "--broker-jobs"] {
        assert!(text.contains(want), "{text:?} should say {want:?}");
    }

    // The table job alone is requeued; the broker job when the operator says they re-send it.
    let report = admin.requeue_dead(&q, Requeue::Keys(vec![key("table-1")])).await.expect("table job");
    assert_eq!(report.requeued.len(), 1, "{report:?}");
    let report = admin.broker_jobs(true).requeue_dead(&q, Requeue::AllDead).await.expect("asked for");
    assert_eq!(report.requeued.iter().map(|r| r.key.as_str()).collect::<Vec<_>>(), ["broker-1"]);
    let row = state("broker-1").await;
    assert_eq!((row.state, row.epoch), (JobState::Pending, 2));
}

/// Item 9 ("`dead requeue` … requeues that never run"), library, PostgreSQL: `requeue_dead` of a
/// job claimed from a broker made its row pending with no broker message, so it never ran. Guard:
/// `Admin::requeue_dead` checks for rows without a payload and refuses with
/// `AdminError::BrokerJobs` (what happened and what to do), changing nothing, unless
/// `broker_jobs(true)`. Without it: "a requeue of a broker job must be refused, got
/// Ok(RequeueReport { requeued: [… table-1 …, … broker-1 …] … })".
#[tokio::test]
async fn hardening_item9_dead_requeue_refuses_broker_jobs_pg() {
    let pg = store::pg().await;
    requeue_refusal_case(&pg).await;
    store::drop_schema(&pg).await;
}

/// Item 9, library, SQLite: the same refusal on the other backend.
#[tokio::test]
async fn hardening_item9_dead_requeue_refuses_broker_jobs_sqlite() {
    requeue_refusal_case(&store::sqlite().await).await;
}

/// Item 9, the CLI: `brokerfence dead requeue` of a broker job exits 1 with the refusal's
/// message and changes nothing; `--broker-jobs` requeues it. Guard: the same check, and the
/// CLI's flag. Without it: "exit code 0 … a broker job must be refused".
#[cfg(feature = "cli")]
#[tokio::test]
async fn hardening_item9_cli_dead_requeue_refuses_broker_jobs() {
    let pg = store::pg().await;
    let q = queue(&unique("cli-dead"));
    seed_dead(&pg, &q).await;
    let run = |extra: &'static [&'static str]| {
        let (schema, q) = (pg.get_schema().as_str().to_owned(), q.as_str().to_owned());
        async move {
            let mut cmd = tokio::process::Command::new(brokerfence_testkit::programs::bin("brokerfence"));
            cmd.args([
                "--database-url",
                &store::database_url(),
                "--schema",
                &schema,
                "dead",
                "requeue",
                &q,
                "broker-1",
            ])
            .args(extra)
            .env_remove("DATABASE_URL")
            .kill_on_drop(true);
            let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
                .await
                .expect("the CLI ended within 60 s")
                .expect("run the CLI");
            (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
        }
    };
    let (code, stderr) = run(&[]).await;
    assert_eq!(code, Some(1), "exit code {code:?} (stderr {stderr:?}): a broker job must be refused");
    assert!(stderr.contains("claimed from a broker (broker-1)") && stderr.contains("--broker-jobs"), "{stderr}");
    assert_eq!(pg.job(&q, &key("broker-1")).await.expect("read").expect("row").state, JobState::Dead);
    let (code, stderr) = run(&["--broker-jobs"]).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(pg.job(&q, &key("broker-1")).await.expect("read").expect("row").state, JobState::Pending);
    store::drop_schema(&pg).await;
}

// ------------------------------------------------------------------------------------------------
// 11. Retrofits on an unmigrated schema
// ------------------------------------------------------------------------------------------------

fn too_old(e: Option<&FenceError>) -> bool {
    matches!(e, Some(FenceError::SchemaTooOld { found: 0, .. }))
        && e.is_some_and(|e| e.to_string().contains("run migrations"))
}

/// Item 11 ("Retrofits on an unmigrated schema fail silently"), SQS: on a schema that was never
/// migrated `SqsRetrofit` answered Leave with nothing logged and hid every message for its
/// visibility timeout. Guard: the retrofit's schema check on first use (`Retrofit::process`),
/// which claims nothing, gives the message back at once and answers `refused()` with the
/// `check_schema` message. Without it: "disposition Leave … refused() None", and the messages
/// stayed hidden for the 30 s visibility.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item11_sqs_retrofit_refuses_an_unmigrated_schema() {
    let client = sqs().await;
    let q = TestQueue::new(&client, "schema", 30).await;
    let unmigrated = store::pg_unmigrated().await;
    let fence = SqsRetrofit::new(
        dyn_store(&unmigrated),
        SqsSource::new(client.clone(), SqsConfig::new(&q.url).expect("config")),
        SupervisorConfig::new(lease(5)),
    );
    let checked = fence.check_schema().await;
    assert!(too_old(checked.as_ref().err()), "check_schema: {checked:?}");
    for i in 0..3 {
        send(&client, &q.url, &format!("m{i}")).await;
    }
    let mut seen = 0;
    while seen < 3 {
        for m in receive_raw(&client, &q.url, 2).await {
            seen += 1;
            let done = fence.process(&m, |_ctx: JobContext| async move { Ok(()) }).await;
            assert!(
                done.disposition == Disposition::Abandon && too_old(done.refused()),
                "disposition {:?}, refused() {:?}: the schema must be refused with its message",
                done.disposition,
                done.refused()
            );
            assert!(done.broker_error.is_none(), "{:?}", done.broker_error);
        }
    }
    // Given back at once, for a worker on a migrated schema (not hidden for the 30 s visibility).
    let again = wait_for("the refused messages visible again", Duration::from_secs(8), || {
        let (client, url) = (&client, q.url.clone());
        async move { Some(receive_raw(client, &url, 1).await.len()).filter(|n| *n > 0) }
    })
    .await;
    assert!(again > 0);
    q.delete(&client).await;
}

/// Item 11, Redis list: `ListRetrofit` on a schema never migrated spun (6,569 pop / push-back
/// cycles in 5 s) and a loop killed meanwhile lost the item it held. Guard: the schema check on
/// first use, and `requeue_popped` answering `RedisError::Refused` (after the item is back) so
/// the documented loop's `?` ends it. Without it: "the loop did not end: N pop/push-back cycles
/// in 3 s".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item11_list_retrofit_refuses_an_unmigrated_schema() {
    let env = Env::new().await;
    let list = env.name("schema");
    let unmigrated = store::pg_unmigrated().await;
    let fence = list_fence(&env, Arc::new(unmigrated), &list, SupervisorConfig::new(lease(5)));
    lpush(&env, &list, "k-1|x").await;

    // The documented loop, cut off after 3 s if it never ends.
    let mut cycles = 0;
    let mut blocking = env.redis.blocking();
    let ended = tokio::time::timeout(Duration::from_secs(3), async {
        loop {
            let popped: Option<(String, Vec<u8>)> =
                client::cmd("BRPOP").arg(&list).arg(0.2).query_async(&mut blocking).await.expect("BRPOP");
            let Some((_, item)) = popped else { continue };
            cycles += 1;
            let done = fence.process(&item, |ctx: JobContext| async move { Ok(ctx.payload().to_vec()) }).await;
            fence.requeue_popped(&item, &done).await?;
        }
        #[allow(unreachable_code)]
        Ok::<(), RedisError>(())
    })
    .await;
    let err = match ended {
        Ok(Err(e)) => e,
        other => panic!("the loop did not end: {cycles} pop/push-back cycles in 3 s ({other:?})"),
    };
    assert_eq!(cycles, 1, "one pop, then the refusal");
    assert!(matches!(&err, RedisError::Refused(e) if too_old(Some(e))), "{err}");
    assert_eq!(lrange(&env, &list).await, ["k-1|x"], "the refused item is back on the list");
    env.cleanup().await;
}

// ------------------------------------------------------------------------------------------------
// 12. A panicking handler
// ------------------------------------------------------------------------------------------------

/// The row of a job whose handler panicked: failed, retried by policy, the panic as its error.
fn assert_panic_recorded(row: Option<brokerfence::JobRecord>, message: &str) {
    let row = row.expect("the job's row");
    assert_eq!(row.state, JobState::Failed, "a panic is a failed attempt, retried by policy: {row:?}");
    let error = row.last_error.unwrap_or_default();
    assert!(error.contains(&format!("handler panicked: {message}")), "last_error {error:?}");
}

/// Item 12 ("A panicking handler kills the retrofit's process"), SQS: the handler's panic
/// unwound through `SqsRetrofit::process` into the caller's loop, and the job stayed running
/// with no `last_error`. Guard: `run_caught` (`adapters/src/caught.rs`) around the handler in
/// `Retrofit::process`. Without it: "process() let the handler's panic through: … kaboom-sqs".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item12_a_panic_in_the_sqs_retrofit_is_a_failed_attempt() {
    let client = sqs().await;
    let q = TestQueue::new(&client, "panic", 30).await;
    let pg = store::pg().await;
    let fence = SqsRetrofit::new(
        dyn_store(&pg),
        SqsSource::new(client.clone(), SqsConfig::new(&q.url).expect("config")),
        SupervisorConfig::new(lease(5)),
    );
    let id = send(&client, &q.url, "body").await;
    let message = wait_for("the message", Duration::from_secs(10), || {
        let (client, url) = (&client, q.url.clone());
        async move { receive_raw(client, &url, 1).await.pop() }
    })
    .await;
    let run = tokio::spawn({
        let fence = fence.clone();
        async move { fence.process(&message, |ctx| panics(ctx, "kaboom-sqs")).await }
    });
    let done = run.await.unwrap_or_else(|e| panic!("process() let the handler's panic through: {e}"));
    assert!(matches!(done.disposition, Disposition::RetryLater(_)), "{:?}", done.disposition);
    assert!(matches!(&done.detail, Detail::Ran(Outcome::Failed { .. })), "{:?}", done.detail);
    assert_panic_recorded(pg.job(&q.fence_queue(), &JobKey::new(id).expect("key")).await.expect("read"), "kaboom-sqs");
    q.delete(&client).await;
    store::drop_schema(&pg).await;
}

/// Item 12, Redis list: the same through `ListRetrofit::process`, and the popped item goes back
/// for the retry. Guard: `run_caught`. Without it: "process() let the handler's panic through:
/// … kaboom-list".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item12_a_panic_in_the_list_retrofit_is_a_failed_attempt() {
    let env = Env::new().await;
    let list = env.name("panic");
    let policy = RetryPolicy { base_backoff: Duration::from_millis(100), ..RetryPolicy::default() };
    let fence = list_fence(&env, env.store(), &list, SupervisorConfig::new(lease(5)).retry(policy));
    lpush(&env, &list, "k-1|x").await;
    let item = rpop(&env, &list).await;
    let run = tokio::spawn({
        let (fence, item) = (fence.clone(), item.clone());
        async move { fence.process(&item, |ctx| panics(ctx, "kaboom-list")).await }
    });
    let done = run.await.unwrap_or_else(|e| panic!("process() let the handler's panic through: {e}"));
    assert!(matches!(done.disposition, Disposition::RetryLater(_)), "{:?}", done.disposition);
    assert_panic_recorded(env.job(&list, "k-1").await, "kaboom-list");
    fence.requeue_popped(&item, &done).await.expect("requeue");
    fence.flush(Duration::from_secs(5)).await.expect("pushed back");
    assert_eq!(lrange(&env, &list).await, ["k-1|x"], "the item is back for its retry");
    env.cleanup().await;
}

/// Item 12, the `Consumer` (a table queue): the attempt's task died with the panic and the job
/// stayed `running`, no `last_error`, until its lease ran out. Guard: `run_caught` around the
/// handler in the consumer runtime (`adapters/src/runtime/claim.rs`). Without it: "timed out …
/// waiting for the panic recorded as a failed attempt".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hardening_item12_a_panic_in_the_consumer_is_a_failed_attempt() {
    let pg = store::pg().await;
    let q = queue(&unique("panic"));
    assert!(pg.enqueue(&q, &key("job-1"), b"x").await.expect("enqueue"));
    let source = TableQueue::new(dyn_store(&pg), q.clone()).idle_wait(Duration::from_millis(50));
    let running = spawn_consumer(source, dyn_store(&pg), "panicky", consumer_config(10, 1), |ctx: JobContext| {
        panics(ctx, "kaboom-consumer")
    });
    let row = wait_for("the panic recorded as a failed attempt", Duration::from_secs(5), || {
        let (pg, q) = (&pg, q.clone());
        async move { pg.job(&q, &key("job-1")).await.ok().flatten().filter(|r| r.last_error.is_some()) }
    })
    .await;
    assert_panic_recorded(Some(row), "kaboom-consumer");
    running.shutdown(Duration::from_secs(10)).await;
    store::drop_schema(&pg).await;
}
