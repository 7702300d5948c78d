//! The two-process zombie proof (issue 3), against PostgreSQL and SQLite.
//!
//! The zombie is a real second OS process (this test binary re-executed as
//! `examples/zombie_worker.rs`), frozen with SIGSTOP past its 3 s lease and resumed with SIGCONT.
//! Receiver: an axum server on 127.0.0.1:0 behind `adapters::http::EpochGuard`, recording every
//! call. PostgreSQL comes from `DATABASE_URL` (or `localstack/.env`): run `localstack/up` first.
//! Every scenario uses its own schema / SQLite file; independent scenarios run concurrently.
//!
//! Run with `cargo test --workspace --all-features proof -- --nocapture` to see the timelines and
//! the measured figures.
#![cfg(feature = "http")]

use std::time::{Duration, Instant};

use crate::zombie_support::*;
use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use brokerfence::JobState;
use brokerfence::http::{Stamp, stale_response};
use brokerfence::ledger::{PgLedger, Verdict};
use brokerfence::wire::FenceStamp;
use futures::future::join_all;

fn third_plus_one() -> Duration {
    lease().heartbeat_interval() + Duration::from_secs(1)
}

/// The issue's table, both rows, on both backends: the zombie's receiver call is refused (new
/// owner first) or accepted and then superseded (zombie first); its commit is refused (`Fenced`)
/// either way; the final state is epoch 2 with the new owner's result.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn both_orderings_end_with_epoch_2_and_the_new_owners_result() {
    let cases = [
        (Backend::Postgres, Order::NewOwnerFirst),
        (Backend::Postgres, Order::ZombieFirst),
        (Backend::Sqlite, Order::NewOwnerFirst),
        (Backend::Sqlite, Order::ZombieFirst),
    ];
    let runs = join_all(cases.map(|(b, o)| table_run(b, o, Switches::default()))).await;
    let mut table = String::from(
        "| backend | case | zombie's receiver call | zombie's commit | final state |\n|---|---|---|---|---|\n",
    );
    for ((backend, order), run) in cases.iter().zip(&runs) {
        println!("== {}\n{}", run.label, run.timeline);
        let ctx = format!("[{}]\n{}", run.label, run.timeline);
        assert_eq!((run.zombie_epoch, run.new_epoch), (1, 2), "{ctx}");
        assert!(
            run.stopped_for > lease().get() - lease().heartbeat_interval(),
            "zombie was stopped past its lease {ctx}"
        );

        // Receiver: every call, in arrival order.
        let expected = match order {
            Order::NewOwnerFirst => vec![(2, 200), (1, 409)],
            Order::ZombieFirst => vec![(1, 200), (2, 200)],
        };
        assert_eq!(run.receiver_calls, expected, "receiver calls (epoch, status) {ctx}");
        assert_eq!(run.newest, Some(2), "ledger keeps epoch 2 {ctx}");
        assert_eq!(run.effect, Some((2, format!("effect of {NEW_OWNER} at epoch 2"))), "receiver's effect {ctx}");

        // Zombie's commit: refused by the compare-and-set.
        assert!(run.zombie_outcome.starts_with("outcome=fenced"), "zombie commit: {} {ctx}", run.zombie_outcome);
        assert!(run.zombie_outcome.contains("current epoch 2"), "{ctx}");
        assert_eq!(run.zombie_metrics.get("fenced_rejections"), Some(&1), "{ctx}");
        assert_eq!(run.zombie_metrics.get("completions"), Some(&0), "{ctx}");

        // New owner: committed; final state.
        assert!(run.new_outcome.is_completed(), "new owner: {:?} {ctx}", run.new_outcome);
        assert_eq!(run.new_owner_status, 200, "{ctx}");
        assert_eq!(
            (run.new_metrics.completions, run.new_metrics.fenced_rejections, run.new_metrics.lease_losses),
            (1, 0, 0)
        );
        assert_eq!(run.job.state, JobState::Completed, "{ctx}");
        assert_eq!(run.job.epoch, 2, "{ctx}");
        assert_eq!(run.job.owner.as_deref(), Some(NEW_OWNER), "{ctx}");
        assert_eq!(run.job.result.as_deref(), Some(NEW_OWNER_RESULT.as_bytes()), "{ctx}");

        let call = match order {
            Order::NewOwnerFirst => "rejected (409)",
            Order::ZombieFirst => "accepted (200), then superseded by epoch 2",
        };
        table.push_str(&format!(
            "| {backend} | {order:?} | {call} | rejected (Fenced) | epoch {}, {:?}, {} |\n",
            run.job.epoch,
            String::from_utf8_lossy(run.job.result.as_deref().unwrap_or_default()),
            run.job.state
        ));
    }
    println!("{table}");
}

/// After SIGCONT the zombie's handler is dropped within lease/3 + 1 s and makes no further call.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn resumed_zombie_is_cancelled_within_a_third_of_the_lease_and_never_calls_again() {
    let runs = join_all([cancel_run(Backend::Postgres, &[]), cancel_run(Backend::Sqlite, &[])]).await;
    for run in &runs {
        let ctx = format!("[{}]\n{}", run.label, run.transcript);
        let latency = run.cancel_latency.unwrap_or_else(|| panic!("handler was not cancelled {ctx}"));
        println!(
            "{}: handler cancelled {:.1} ms after SIGCONT (bound lease/3 + 1 s = {:?}); {}",
            run.label,
            latency.as_secs_f64() * 1000.0,
            third_plus_one(),
            run.zombie_outcome
        );
        assert!(latency < third_plus_one(), "cancel latency {latency:?} {ctx}");
        assert!(run.zombie_outcome.starts_with("outcome=lease_lost"), "{ctx}");
        assert_eq!(run.calls_after_resume, vec![], "receiver calls from epoch 1 after SIGCONT {ctx}");
        assert_eq!(run.attempts_after_resume, 0, "zombie started a call after SIGCONT {ctx}");
        assert_eq!(run.zombie_metrics.get("lease_losses"), Some(&1), "{ctx}");
        assert_eq!(run.zombie_metrics.get("completions"), Some(&0), "{ctx}");
        assert_eq!((run.job.state, run.job.epoch), (JobState::Completed, 2), "{ctx}");
        assert_eq!(run.job.result.as_deref(), Some(NEW_OWNER_RESULT.as_bytes()), "{ctx}");
    }
}

/// The zombie's heartbeat, sent after the takeover, is refused and leaves the new owner's lease
/// exactly as the new owner's claim set it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn heartbeat_after_takeover_never_extends_the_new_owners_lease() {
    let runs = join_all([heartbeat_run(Backend::Postgres, &[]), heartbeat_run(Backend::Sqlite, &[])]).await;
    for run in &runs {
        let ctx = format!("[{}]\n{}", run.label, run.transcript);
        println!(
            "{}: zombie's late heartbeat: {:?}; new owner's lease_until {} -> {}",
            run.label, run.zombie_heartbeat, run.new_lease_until, run.lease_until_after
        );
        assert_eq!(run.zombie_heartbeat, "heartbeat lost epoch=1", "{ctx}");
        assert_eq!(run.lease_until_after, run.new_lease_until, "new owner's lease moved {ctx}");
        assert_eq!((run.epoch_after, run.owner_after.as_deref()), (2, Some(NEW_OWNER)), "{ctx}");
        assert!(run.zombie_outcome.starts_with("outcome=fenced"), "{ctx}");
    }
}

struct CutRun {
    label: String,
    /// Cut to the handler being dropped.
    cancel_after_cut: Duration,
    /// Lease end minus the database clock when the test saw the cancellation (ms; > 0: before expiry).
    margin_ms: i64,
    outcome: String,
    calls_after_cancel: usize,
    transcript: String,
}

/// PostgreSQL: the worker reaches the database through a TCP proxy that the test shuts down.
async fn pg_connection_cut() -> CutRun {
    let label = "postgres connection cut".to_owned();
    let db = Db::new(Backend::Postgres).await;
    let proxy = Proxy::start(&db.url).await;
    let receiver = Receiver::start(db.admin.ledger("receiver")).await;
    let zombie = Zombie::spawn_url(&label, &db, &proxy.url, Some(&receiver.url), "calls:200:100", &[]);
    zombie.wait_for("heartbeat renewed epoch=1", Duration::from_secs(20)).await;
    let cut = proxy.cut();
    let run = observe_cut(label, &db, &zombie, &receiver, cut).await;
    db.cleanup().await;
    run
}

/// SQLite: another process-level connection takes the write lock, so every heartbeat blocks.
async fn sqlite_database_locked() -> CutRun {
    use sqlx::Connection;
    let label = "sqlite database locked".to_owned();
    let db = Db::new(Backend::Sqlite).await;
    let receiver = Receiver::start(db.admin.ledger("receiver")).await;
    let zombie = Zombie::spawn(&label, &db, Some(&receiver.url), "calls:200:100", &[]);
    zombie.wait_for("heartbeat renewed epoch=1", Duration::from_secs(20)).await;
    let mut locker = sqlx::SqliteConnection::connect(&db.url).await.expect("open sqlite");
    sqlx::query("BEGIN IMMEDIATE").execute(&mut locker).await.expect("take the write lock");
    let cut = Instant::now();
    let run = observe_cut(label, &db, &zombie, &receiver, cut).await;
    sqlx::query("ROLLBACK").execute(&mut locker).await.expect("release the write lock");
    drop(locker);
    db.cleanup().await;
    run
}

async fn observe_cut(label: String, db: &Db, zombie: &Zombie, receiver: &Receiver, cut: Instant) -> CutRun {
    let (dropped_at, dropped) = zombie.wait_for_after("handler-dropped", Some(cut), Duration::from_secs(10)).await;
    // The database clock right after the test saw the cancellation, and the lease end it holds.
    let now = db.admin.store().db_now().await.expect("db clock").0;
    let lease_until = db.job().await.lease_until.expect("still running: nobody took over").0;
    let (_, outcome) = zombie.wait_for("outcome=", Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(field(&dropped, "finished"), Some("false"), "[{label}] handler ran to its end\n{}", zombie.transcript());
    CutRun {
        cancel_after_cut: dropped_at.duration_since(cut),
        margin_ms: lease_until - now,
        outcome,
        calls_after_cancel: receiver.calls().iter().filter(|c| c.at > dropped_at).count(),
        transcript: zombie.transcript(),
        label,
    }
}

/// A worker whose database is cut off mid-job cancels its handler before its lease could have
/// expired (judged on the database clock), and makes no call after that.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn worker_cut_off_from_its_database_cancels_before_its_lease_expires() {
    let (pg, sqlite) = tokio::join!(pg_connection_cut(), sqlite_database_locked());
    for run in [pg, sqlite] {
        println!(
            "{}: handler cancelled {:.0} ms after the cut, {} ms before the lease expired on the database clock; {}",
            run.label,
            run.cancel_after_cut.as_secs_f64() * 1000.0,
            run.margin_ms,
            run.outcome
        );
        let ctx = format!("[{}]\n{}", run.label, run.transcript);
        assert!(run.margin_ms > 0, "cancelled {} ms AFTER the lease expired {ctx}", -run.margin_ms);
        assert!(run.cancel_after_cut < lease().get(), "{ctx}");
        assert_eq!(run.outcome, "outcome=lease_lost reason=Unconfirmed", "{ctx}");
        assert_eq!(run.calls_after_cancel, 0, "receiver calls after the cancellation {ctx}");
    }
}

/// The receiver's HTTP contract: 400 for a missing or malformed stamp (naming the header), 409
/// with job/epoch/newest for a stale epoch, equal epochs pass (a retry), the handler sees the
/// accepted stamp; and `accept_in` inside the receiver's own transaction (PostgreSQL).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn receiver_contract() {
    for backend in [Backend::Postgres, Backend::Sqlite] {
        let db = Db::new(backend).await;
        let receiver = Receiver::start(db.admin.ledger("contract")).await;
        let client = reqwest::Client::new();

        let r = client.post(&receiver.url).body("x").send().await.expect("send");
        assert_eq!(r.status(), 400);
        let body = r.text().await.expect("body");
        assert!(body.contains(r#""error":"missing_stamp""#) && body.contains("Fence-Queue"), "{body}");

        let r = client
            .post(&receiver.url)
            .header("Fence-Queue", QUEUE)
            .header("Fence-Job", KEY)
            .header("Fence-Epoch", "two")
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 400);
        assert!(r.text().await.expect("body").contains(r#""header":"Fence-Epoch""#));

        let r = client
            .post(&receiver.url)
            .header("Fence-Queue", QUEUE)
            .header("Fence-Job", axum::http::HeaderValue::from_bytes(b"caf\xe9").expect("obs-text"))
            .header("Fence-Epoch", "1")
            .send()
            .await
            .expect("send");
        assert_eq!(r.status(), 400, "raw non-ASCII must be encoded");

        let stamp = |epoch| FenceStamp::new(QUEUE, KEY, epoch).with_owner("w");
        let (status, body) = post_stamped(&receiver.url, &stamp(2), "two".into()).await;
        assert_eq!((status, body.as_str()), (200, "applied payments/order-7@2"));
        let (status, _) = post_stamped(&receiver.url, &stamp(2), "two again".into()).await;
        assert_eq!(status, 200, "an equal epoch is the same owner retrying");
        let (status, body) = post_stamped(&receiver.url, &stamp(1), "one".into()).await;
        assert_eq!(status, 409);
        for part in
            [r#""error":"stale_epoch""#, r#""job":"order-7""#, r#""epoch":1"#, r#""newest":2"#, r#""queue":"payments""#]
        {
            assert!(body.contains(part), "409 body lacks {part}: {body}");
        }
        assert_eq!(receiver.effect(), Some((2, "two again".into())));
        assert_eq!(receiver.newest().await, Some(2));
        // Same key on another queue: its own epochs.
        let (status, _) = post_stamped(&receiver.url, &FenceStamp::new("other", KEY, 1), "o".into()).await;
        assert_eq!(status, 200);

        if let AnyFence::Pg(fence) = &db.admin {
            accept_in_transaction(fence).await;
        }
        db.cleanup().await;
    }
}

#[derive(Clone)]
struct TxApp {
    fence: brokerfence::PgFence,
    ledger: PgLedger,
}

/// The recommended shape when the effect is a database write: ledger check and effect in one
/// transaction.
async fn charge(State(app): State<TxApp>, Stamp(stamp): Stamp, body: String) -> Response {
    let table = format!("{}.charges", app.fence.get_schema().as_str());
    let Ok(mut tx) = app.fence.pool().begin().await else {
        return axum::http::StatusCode::SERVICE_UNAVAILABLE.into_response();
    };
    match app.ledger.accept_in(&mut tx, &stamp.ledger_job(), stamp.epoch).await {
        Ok(Verdict::Accepted { .. }) => {}
        Ok(Verdict::Stale { newest }) => return stale_response(&stamp, newest),
        Ok(_) => return brokerfence::http::conflict_response(&stamp),
        Err(e) => return (axum::http::StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
    }
    if body == "boom" {
        // The effect fails after the ledger accepted: dropping the transaction undoes both.
        return (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "effect failed").into_response();
    }
    let inserted =
        sqlx::query(sqlx::AssertSqlSafe(format!("INSERT INTO {table} (job, epoch, body) VALUES ($1, $2, $3)")))
            .bind(&stamp.job)
            .bind(stamp.epoch)
            .bind(&body)
            .execute(&mut *tx)
            .await;
    match (inserted, tx.commit().await) {
        (Ok(_), Ok(())) => "charged".into_response(),
        _ => axum::http::StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

async fn accept_in_transaction(fence: &brokerfence::PgFence) {
    let table = format!("{}.charges", fence.get_schema().as_str());
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE TABLE {table} (job text, epoch bigint, body text)")))
        .execute(fence.pool())
        .await
        .expect("create charges");
    let app = TxApp { fence: fence.clone(), ledger: PgLedger::new(fence, "charges") };
    let router = Router::new().route("/charge", post(charge)).with_state(app);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}/charge", listener.local_addr().expect("addr"));
    let server = tokio::spawn(async move { axum::serve(listener, router).await });

    let stamp = |epoch| FenceStamp::new(QUEUE, KEY, epoch);
    let (status, _) = post_stamped(&url, &stamp(3), "boom".into()).await;
    assert_eq!(status, 500);
    // The failed effect's transaction also rolled the ledger back: epoch 1 is still acceptable.
    let (status, _) = post_stamped(&url, &stamp(1), "one".into()).await;
    assert_eq!(status, 200, "epoch 3 must not have been kept without its effect");
    let (status, _) = post_stamped(&url, &stamp(2), "two".into()).await;
    assert_eq!(status, 200);
    let (status, body) = post_stamped(&url, &stamp(1), "late one".into()).await;
    assert_eq!(status, 409, "{body}");
    let rows: Vec<(i64, String)> =
        sqlx::query_as(sqlx::AssertSqlSafe(format!("SELECT epoch, body FROM {table} ORDER BY epoch")))
            .fetch_all(fence.pool())
            .await
            .expect("read charges");
    assert_eq!(rows, vec![(1, "one".to_owned()), (2, "two".to_owned())]);
    server.abort();
}
