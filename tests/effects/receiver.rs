//! The atomic receiver (issue 13, "Atomic receiver"): `AtomicEpochGuard` takes the ledger row of
//! (scope, job) inside the transaction the handler writes its effect in, and commits both together.
//! Against it, the check-only `EpochGuard`, whose check-then-act lets a zombie's effect land last.
//!
//! The race, in every test that has one: epoch 1's request reaches the handler first (ledger
//! accepted), whose effect then takes 500 ms (a sleep inside the transaction, after the ledger
//! lock, before the write); epoch 2's request is sent while epoch 1 sleeps. Epoch 1's handler then
//! goes on as soon as epoch 2 has either answered or is seen waiting on a lock of the ledger table
//! (`pg_stat_activity`), never earlier: so both orders are deterministic, not a matter of timing.
//! The effect is a plain last-writer-wins upsert (not idempotent, not epoch-aware): exactly the
//! kind of effect the check-only guard cannot protect.
//!
//! Real PostgreSQL (`localstack/up`), one fresh schema per test.
#![cfg(feature = "http")]

use brokerfence_testkit::store as common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::post;
use brokerfence::http::atomic::{AtomicEpochGuard, DEFAULT_HANDLER_TIMEOUT, EffectTx, EffectTxError};
use brokerfence::http::{AcceptedStamp, EpochGuard};
use brokerfence::ledger::{Ledger, PgLedger};
use brokerfence::wire::FenceStamp;
use brokerfence::{FenceStore, PgFence, PgTimeouts};
use sqlx::AssertSqlSafe;
use tokio::sync::Notify;

const SCOPE: &str = "receiver";
const QUEUE: &str = "orders";
/// How long epoch 1's effect takes (inside its transaction, after the ledger lock).
const SLOW: Duration = Duration::from_millis(500);
/// Upper bound of any wait in a test (a failing test fails, it does not hang).
const CAP: Duration = Duration::from_secs(10);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Guard {
    Atomic,
    CheckOnly,
}

/// What the receiver's handlers share with the test.
struct Shared {
    fence: PgFence,
    /// The epoch whose handler is slow (sleeps `SLOW`, then waits for the other request).
    slow_epoch: Option<i64>,
    /// Signalled when the slow handler has started (its ledger row is held, atomic guard).
    entered: Notify,
    /// Set by the test once the other epoch's request has answered.
    other_answered: AtomicBool,
    /// Whether the slow handler goes on when it sees the other request waiting on a ledger lock
    /// (else only once the other request has answered).
    release_when_other_waits: AtomicBool,
    /// Whether the slow handler saw the other request waiting on a ledger lock.
    saw_other_waiting: AtomicBool,
    /// Whether the effect handlers sleep a random 0..20 ms inside the transaction.
    jitter: AtomicBool,
    /// Handler runs (any route).
    runs: AtomicUsize,
    log: Mutex<Vec<String>>,
    started: Instant,
}

impl Shared {
    fn note(&self, what: String) {
        let line = format!("{:>5} ms  {what}", self.started.elapsed().as_millis());
        self.log.lock().expect("log").push(line);
    }

    fn timeline(&self) -> String {
        self.log.lock().expect("log").join("\n")
    }

    fn schema(&self) -> &str {
        self.fence.get_schema().as_str()
    }

    async fn jitter(&self) {
        if self.jitter.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(rand::random_range(0..20))).await;
        }
    }

    fn append(&self) -> String {
        format!("INSERT INTO {}.effects_log (job, epoch) VALUES ($1, $2)", self.schema())
    }

    /// The slow part of the effect: `SLOW`, then until the other request has answered or waits on
    /// a lock of the ledger table (bounded by `CAP`).
    async fn slow_part(&self, epoch: i64) {
        if self.slow_epoch != Some(epoch) {
            return;
        }
        self.entered.notify_one();
        self.note(format!("epoch {epoch}: handler entered, effect sleeps {} ms", SLOW.as_millis()));
        tokio::time::sleep(SLOW).await;
        let deadline = Instant::now() + CAP;
        while Instant::now() < deadline {
            if self.other_answered.load(Ordering::SeqCst) {
                self.note(format!("epoch {epoch}: the other request has answered; writing the effect"));
                return;
            }
            if self.release_when_other_waits.load(Ordering::SeqCst) && self.waiting_on_ledger().await {
                self.saw_other_waiting.store(true, Ordering::SeqCst);
                self.note(format!("epoch {epoch}: the other request waits on the ledger row; writing the effect"));
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.note(format!("epoch {epoch}: gave up waiting for the other request"));
    }

    /// Whether some backend waits on a lock while running a statement on this schema's ledger.
    async fn waiting_on_ledger(&self) -> bool {
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND wait_event_type = 'Lock' AND query LIKE $1",
        )
        .bind(format!("%{}.ledger%", self.schema()))
        .fetch_one(self.fence.pool())
        .await
        .expect("pg_stat_activity");
        n > 0
    }

    fn upsert(&self) -> String {
        format!(
            "INSERT INTO {}.effects (job, epoch, body) VALUES ($1, $2, $3) \
             ON CONFLICT (job) DO UPDATE SET epoch = EXCLUDED.epoch, body = EXCLUDED.body",
            self.schema()
        )
    }
}

/// The effect behind the atomic guard: written in the request's transaction.
async fn atomic_effect(
    State(sh): State<Arc<Shared>>,
    AcceptedStamp { stamp, .. }: AcceptedStamp,
    tx: EffectTx,
    body: String,
) -> Result<&'static str, EffectTxError> {
    sh.runs.fetch_add(1, Ordering::SeqCst);
    sh.slow_part(stamp.epoch).await;
    let mut conn = tx.conn().await?;
    sqlx::query(AssertSqlSafe(sh.upsert()))
        .bind(stamp.ledger_job())
        .bind(stamp.epoch)
        .bind(body)
        .execute(&mut *conn)
        .await?;
    sh.jitter().await;
    sqlx::query(AssertSqlSafe(sh.append())).bind(stamp.ledger_job()).bind(stamp.epoch).execute(&mut *conn).await?;
    sh.note(format!("epoch {}: effect written (commit follows)", stamp.epoch));
    Ok("applied")
}

/// The effect behind the check-only guard: the same two statements, in a transaction of the
/// handler's own, after the guard's (autocommit) check.
async fn checked_effect(
    State(sh): State<Arc<Shared>>,
    AcceptedStamp { stamp, .. }: AcceptedStamp,
    body: String,
) -> Result<&'static str, StatusCode> {
    sh.runs.fetch_add(1, Ordering::SeqCst);
    sh.slow_part(stamp.epoch).await;
    let unavailable = |_| StatusCode::SERVICE_UNAVAILABLE;
    let mut tx = sh.fence.pool().begin().await.map_err(unavailable)?;
    sqlx::query(AssertSqlSafe(sh.upsert()))
        .bind(stamp.ledger_job())
        .bind(stamp.epoch)
        .bind(body)
        .execute(&mut *tx)
        .await
        .map_err(unavailable)?;
    sqlx::query(AssertSqlSafe(sh.append()))
        .bind(stamp.ledger_job())
        .bind(stamp.epoch)
        .execute(&mut *tx)
        .await
        .map_err(unavailable)?;
    tx.commit().await.map_err(unavailable)?;
    sh.note(format!("epoch {}: effect committed", stamp.epoch));
    Ok("applied")
}

/// Writes the effect, then refuses: 422.
async fn refusing_effect(
    State(sh): State<Arc<Shared>>,
    AcceptedStamp { stamp, .. }: AcceptedStamp,
    tx: EffectTx,
    body: String,
) -> Result<StatusCode, EffectTxError> {
    sh.runs.fetch_add(1, Ordering::SeqCst);
    let mut conn = tx.conn().await?;
    sqlx::query(AssertSqlSafe(sh.upsert()))
        .bind(stamp.ledger_job())
        .bind(stamp.epoch)
        .bind(body)
        .execute(&mut *conn)
        .await?;
    Ok(StatusCode::UNPROCESSABLE_ENTITY)
}

/// Writes the effect, then runs a failing statement, ignores the error and answers 200.
async fn sloppy_effect(
    State(sh): State<Arc<Shared>>,
    AcceptedStamp { stamp, .. }: AcceptedStamp,
    tx: EffectTx,
    body: String,
) -> Result<&'static str, EffectTxError> {
    sh.runs.fetch_add(1, Ordering::SeqCst);
    let mut conn = tx.conn().await?;
    sqlx::query(AssertSqlSafe(sh.upsert()))
        .bind(stamp.ledger_job())
        .bind(stamp.epoch)
        .bind(body)
        .execute(&mut *conn)
        .await?;
    let ignored = sqlx::query("SELECT 1 / 0").execute(&mut *conn).await;
    assert!(ignored.is_err(), "division by zero fails");
    Ok("applied (it says)")
}

/// Writes the effect, then moves its connection guard into a task that outlives the handler.
async fn leaking_effect(
    State(sh): State<Arc<Shared>>,
    AcceptedStamp { stamp, .. }: AcceptedStamp,
    tx: EffectTx,
    body: String,
) -> Result<&'static str, EffectTxError> {
    sh.runs.fetch_add(1, Ordering::SeqCst);
    let mut conn = tx.conn().await?;
    sqlx::query(AssertSqlSafe(sh.upsert()))
        .bind(stamp.ledger_job())
        .bind(stamp.epoch)
        .bind(body)
        .execute(&mut *conn)
        .await?;
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        drop(conn);
    });
    Ok("applied (it says)")
}

struct Receiver {
    base: String,
    shared: Arc<Shared>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Receiver {
    fn url(&self, route: &str) -> String {
        format!("{}{route}", self.base)
    }

    /// (epoch, body) of the job's effect row.
    async fn effect(&self, job: &str) -> Option<(i64, String)> {
        let stamp = FenceStamp::new(QUEUE, job, 1);
        sqlx::query_as(AssertSqlSafe(format!(
            "SELECT epoch, body FROM {}.effects WHERE job = $1",
            self.shared.schema()
        )))
        .bind(stamp.ledger_job())
        .fetch_optional(self.shared.fence.pool())
        .await
        .expect("read effect")
    }

    async fn newest(&self, job: &str) -> Option<i64> {
        let ledger = PgLedger::new(&self.shared.fence, SCOPE);
        ledger.newest(&FenceStamp::new(QUEUE, job, 1).ledger_job()).await.expect("ledger newest")
    }

    fn runs(&self) -> usize {
        self.shared.runs.load(Ordering::SeqCst)
    }
}

/// A receiver on `fence` (migrated, on a fresh schema, with its guards) and a fresh effects table.
async fn serve(guard: Guard, fence: PgFence, slow_epoch: Option<i64>) -> Receiver {
    serve_with(guard, fence, slow_epoch, DEFAULT_HANDLER_TIMEOUT).await
}

/// [`serve`] with another handler time limit for the atomic guard.
async fn serve_with(guard: Guard, fence: PgFence, slow_epoch: Option<i64>, handler_timeout: Duration) -> Receiver {
    let s = fence.get_schema().as_str().to_owned();
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {s}.effects (job text PRIMARY KEY, epoch bigint NOT NULL, body text NOT NULL)"
    )))
    .execute(fence.pool())
    .await
    .expect("effects table");
    sqlx::query(AssertSqlSafe(format!(
        "CREATE TABLE {s}.effects_log (seq bigserial PRIMARY KEY, job text NOT NULL, epoch bigint NOT NULL)"
    )))
    .execute(fence.pool())
    .await
    .expect("effects log table");
    let ledger = PgLedger::new(&fence, SCOPE);
    let shared = Arc::new(Shared {
        fence,
        slow_epoch,
        entered: Notify::new(),
        other_answered: AtomicBool::new(false),
        saw_other_waiting: AtomicBool::new(false),
        release_when_other_waits: AtomicBool::new(true),
        jitter: AtomicBool::new(false),
        runs: AtomicUsize::new(0),
        log: Mutex::default(),
        started: Instant::now(),
    });
    let app = match guard {
        Guard::Atomic => Router::new()
            .route("/effect", post(atomic_effect))
            .route("/refuse", post(refusing_effect))
            .route("/sloppy", post(sloppy_effect))
            .route("/leak", post(leaking_effect))
            .layer(AtomicEpochGuard::new(ledger).handler_timeout(handler_timeout).layer()),
        Guard::CheckOnly => {
            Router::new().route("/effect", post(checked_effect)).layer(EpochGuard::new(Ledger::Pg(ledger)).layer())
        }
    }
    .with_state(Arc::clone(&shared));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind receiver");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Receiver { base, shared, task }
}

fn stamp(job: &str, epoch: i64) -> FenceStamp {
    FenceStamp::new(QUEUE, job, epoch).with_owner(format!("worker-{epoch}"))
}

/// POSTs with the stamp's headers; (status, body).
async fn post_stamped(url: &str, stamp: &FenceStamp, body: &str) -> (u16, String) {
    let (status, _, body) = post_stamped_full(url, stamp, body).await;
    (status, body)
}

/// POSTs with the stamp's headers; (status, Retry-After, body).
async fn post_stamped_full(url: &str, stamp: &FenceStamp, body: &str) -> (u16, Option<String>, String) {
    let mut request = reqwest::Client::new().post(url).body(body.to_owned()).timeout(CAP);
    for (name, value) in stamp.to_headers() {
        request = request.header(name, value);
    }
    let response = request.send().await.expect("receiver reachable");
    let status = response.status().as_u16();
    let retry_after = response.headers().get("retry-after").and_then(|v| v.to_str().ok()).map(str::to_owned);
    (status, retry_after, response.text().await.unwrap_or_default())
}

/// What one race run saw.
struct Race {
    /// (status, when answered) of epoch 1's and epoch 2's requests.
    first: (u16, Duration),
    second: (u16, Duration),
    effect: Option<(i64, String)>,
    newest: Option<i64>,
    saw_second_waiting: bool,
    timeline: String,
}

/// The race: `first_epoch`'s request reaches its (slow) handler first; `second_epoch`'s is sent
/// while that handler sleeps.
async fn race(rx: &Receiver, job: &str, first_epoch: i64, second_epoch: i64) -> Race {
    let sh = &rx.shared;
    let t0 = Instant::now();
    let url = rx.url("/effect");
    let first = {
        let (url, s) = (url.clone(), stamp(job, first_epoch));
        let body = format!("epoch {first_epoch}");
        tokio::spawn(async move {
            let answer = post_stamped(&url, &s, &body).await;
            (answer.0, t0.elapsed())
        })
    };
    tokio::time::timeout(CAP, sh.entered.notified()).await.expect("slow handler entered");
    sh.note(format!("epoch {second_epoch}: request sent"));
    let (status, _) = post_stamped(&url, &stamp(job, second_epoch), &format!("epoch {second_epoch}")).await;
    let second = (status, t0.elapsed());
    sh.note(format!("epoch {second_epoch}: answered {status}"));
    sh.other_answered.store(true, Ordering::SeqCst);
    let first = tokio::time::timeout(CAP, first).await.expect("first request answers").expect("task");
    sh.note(format!("epoch {first_epoch}: answered {}", first.0));
    Race {
        first,
        second,
        effect: rx.effect(job).await,
        newest: rx.newest(job).await,
        saw_second_waiting: sh.saw_other_waiting.load(Ordering::SeqCst),
        timeline: sh.timeline(),
    }
}

/// Guard: the atomic receiver's ledger lock (`receiver_ledger_lock`). Defect covered: a zombie
/// (epoch 1) accepted first whose slow effect would land after epoch 2's. With the atomic layer,
/// epoch 2 waits on the ledger row until epoch 1 committed, then overwrites: the final state is
/// epoch 2's effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_receiver_slow_epoch1_then_epoch2_final_state_is_epoch2() {
    let rx = serve(Guard::Atomic, common::pg().await, Some(1)).await;
    let job = common::unique("slow-1");
    let run = race(&rx, &job, 1, 2).await;
    println!("{}", run.timeline);
    assert_eq!(run.second.0, 200, "epoch 2 applied\n{}", run.timeline);
    assert!(run.saw_second_waiting, "epoch 2 waited on the ledger row held by epoch 1\n{}", run.timeline);
    // Epoch 1 either committed before epoch 2 took the row, or got 409 with nothing applied. Here
    // it held the row first and epoch 2 was seen waiting on it, so epoch 1 committed first (the
    // two answers may reach the client in either order, so their arrival times prove nothing).
    assert!(matches!(run.first.0, 200 | 409), "epoch 1 answered {}\n{}", run.first.0, run.timeline);
    assert!(
        run.second.1 >= SLOW,
        "epoch 2 answered after epoch 1's {SLOW:?} effect: {:?}\n{}",
        run.second.1,
        run.timeline
    );
    assert_eq!(run.effect, Some((2, "epoch 2".to_owned())), "final state is epoch 2's effect\n{}", run.timeline);
    assert_eq!(run.newest, Some(2));
}

/// Guard: the ledger check of the atomic receiver, both orders where epoch 2 comes first.
/// Defect covered: a zombie's call after the new owner's. Sequential: epoch 1 gets 409 and its
/// handler never runs. Concurrent (epoch 2's slow effect holds the row when epoch 1 arrives):
/// epoch 1 waits, then sees epoch 2 committed and gets 409.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_receiver_epoch2_first_then_epoch1_is_409_effect_unchanged() {
    // Sequential.
    let rx = serve(Guard::Atomic, common::pg().await, None).await;
    let job = common::unique("e2-first");
    let url = rx.url("/effect");
    assert_eq!(post_stamped(&url, &stamp(&job, 2), "epoch 2").await.0, 200);
    let (status, body) = post_stamped(&url, &stamp(&job, 1), "epoch 1").await;
    assert_eq!(status, 409, "{body}");
    assert!(body.contains("\"newest\":2"), "{body}");
    assert_eq!(rx.runs(), 1, "epoch 1's handler did not run");
    assert_eq!(rx.effect(&job).await, Some((2, "epoch 2".to_owned())));
    assert_eq!(rx.newest(&job).await, Some(2));

    // Concurrent: epoch 2 holds the row while its effect sleeps; epoch 1 arrives meanwhile.
    let rx = serve(Guard::Atomic, common::pg().await, Some(2)).await;
    let job = common::unique("e2-holds");
    let run = race(&rx, &job, 2, 1).await;
    println!("{}", run.timeline);
    assert_eq!(run.first.0, 200, "epoch 2 applied\n{}", run.timeline);
    assert_eq!(run.second.0, 409, "epoch 1 refused after waiting\n{}", run.timeline);
    assert!(run.saw_second_waiting, "epoch 1 waited on the row\n{}", run.timeline);
    assert_eq!(rx.runs(), 1, "epoch 1's handler did not run\n{}", run.timeline);
    assert_eq!(run.effect, Some((2, "epoch 2".to_owned())), "{}", run.timeline);
    assert_eq!(run.newest, Some(2));
}

/// Why the atomic layer exists. Defect shown (not a guard of this crate): the check-only
/// `EpochGuard` is check-then-act, so the slow epoch-1 effect, accepted first, lands after epoch
/// 2's and the receiver ends with the zombie's effect although its ledger says epoch 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_check_only_guard_lets_slow_epoch1_land_last() {
    let rx = serve(Guard::CheckOnly, common::pg().await, Some(1)).await;
    let job = common::unique("check-only");
    let run = race(&rx, &job, 1, 2).await;
    println!("{}", run.timeline);
    assert_eq!((run.first.0, run.second.0), (200, 200), "both accepted\n{}", run.timeline);
    assert!(!run.saw_second_waiting, "nothing made epoch 2 wait\n{}", run.timeline);
    assert!(run.second.1 < run.first.1, "epoch 2 answered first\n{}", run.timeline);
    // The violation: the final state is the zombie's effect, while the ledger says epoch 2.
    assert_eq!(run.effect, Some((1, "epoch 1".to_owned())), "{}", run.timeline);
    assert_eq!(run.newest, Some(2));
}

/// Guard switch: `receiver_ledger_lock`. Off, the atomic layer accepts the epoch in autocommit
/// before the effect's transaction (check-then-act) and the slow epoch-1 effect lands last: the
/// violation. On, the same scenario ends with epoch 2's effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_guard_receiver_ledger_lock() {
    use fence::Guards;
    let on = serve(Guard::Atomic, common::pg().await, Some(1)).await;
    let off_fence = common::pg().await.guards(Guards::default().without_receiver_ledger_lock());
    let off = serve(Guard::Atomic, off_fence, Some(1)).await;
    let job = common::unique("switch");
    let (run_on, run_off) = tokio::join!(race(&on, &job, 1, 2), race(&off, &job, 1, 2));
    println!("ledger lock ON:\n{}\nledger lock OFF:\n{}", run_on.timeline, run_off.timeline);
    assert_eq!(run_on.effect, Some((2, "epoch 2".to_owned())), "guard on\n{}", run_on.timeline);
    assert!(run_on.saw_second_waiting, "guard on: epoch 2 waited\n{}", run_on.timeline);
    // Violation: epoch 2 is not held back, and the zombie's effect is the final state.
    assert_eq!((run_off.first.0, run_off.second.0), (200, 200), "guard off\n{}", run_off.timeline);
    assert!(!run_off.saw_second_waiting, "guard off: nothing made epoch 2 wait\n{}", run_off.timeline);
    assert_eq!(run_off.effect, Some((1, "epoch 1".to_owned())), "guard off\n{}", run_off.timeline);
    assert_eq!(run_off.newest, Some(2), "guard off: the ledger says epoch 2\n{}", run_off.timeline);
}

/// Guard: the layer commits only on success. Defect covered: a refused effect (non-2xx) leaving
/// its rows or moving the ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_receiver_error_status_commits_nothing() {
    let rx = serve(Guard::Atomic, common::pg().await, None).await;
    let job = common::unique("refused");
    assert_eq!(post_stamped(&rx.url("/effect"), &stamp(&job, 1), "epoch 1").await.0, 200);
    let (status, _) = post_stamped(&rx.url("/refuse"), &stamp(&job, 2), "epoch 2").await;
    assert_eq!(status, 422, "the handler's own status is passed on");
    assert_eq!(rx.runs(), 2);
    assert_eq!(rx.effect(&job).await, Some((1, "epoch 1".to_owned())), "the refused effect rolled back");
    assert_eq!(rx.newest(&job).await, Some(1), "the ledger did not move");
    // Epoch 1 is still the newest, so its retry is accepted.
    assert_eq!(post_stamped(&rx.url("/effect"), &stamp(&job, 1), "epoch 1 again").await.0, 200);
    assert_eq!(rx.effect(&job).await, Some((1, "epoch 1 again".to_owned())));

    // On a job the ledger has never seen: no ledger row, no effect.
    let fresh = common::unique("refused-fresh");
    assert_eq!(post_stamped(&rx.url("/refuse"), &stamp(&fresh, 3), "epoch 3").await.0, 422);
    assert_eq!(rx.effect(&fresh).await, None);
    assert_eq!(rx.newest(&fresh).await, None);
}

/// Guard: the pre-commit check of the atomic layer. Defect covered: PostgreSQL turns the COMMIT of
/// a transaction with a failed statement into a silent ROLLBACK, so a handler that ignores the
/// error and answers 200 would report an effect that never happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_receiver_broken_transaction_is_503_not_success() {
    let rx = serve(Guard::Atomic, common::pg().await, None).await;
    let job = common::unique("sloppy");
    let (status, retry_after, body) = post_stamped_full(&rx.url("/sloppy"), &stamp(&job, 1), "epoch 1").await;
    assert_eq!((status, retry_after.as_deref()), (503, Some("1")), "{body}");
    assert!(body.contains("effect_not_committed"), "{body}");
    assert_eq!(rx.effect(&job).await, None);
    assert_eq!(rx.newest(&job).await, None);
}

/// Guard: the layer takes the transaction back when the handler returns. Defect covered: a
/// connection guard leaked into a spawned task committing (or being committed) after the answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_receiver_leaked_connection_guard_commits_nothing() {
    let rx = serve(Guard::Atomic, common::pg().await, None).await;
    let job = common::unique("leak");
    let (status, body) = post_stamped(&rx.url("/leak"), &stamp(&job, 1), "epoch 1").await;
    assert_eq!(status, 500, "{body}");
    assert!(body.contains("effect_leaked"), "{body}");
    // Once the leaked guard is dropped (300 ms), the transaction rolls back and the row is free.
    let (status, body) = post_stamped(&rx.url("/effect"), &stamp(&job, 2), "epoch 2").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(rx.effect(&job).await, Some((2, "epoch 2".to_owned())));
    assert_eq!(rx.newest(&job).await, Some(2));
}

/// Guard: stamp parsing before anything else. Defect covered: a request without a valid stamp
/// reaching the handler or the ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_receiver_malformed_stamp_is_400_handler_not_run() {
    let rx = serve(Guard::Atomic, common::pg().await, None).await;
    let job = common::unique("bad");
    let good = stamp(&job, 1).to_headers();
    let cases: Vec<(&str, Vec<(&str, String)>)> = vec![
        ("no headers", vec![]),
        ("no epoch", good.iter().filter(|(n, _)| !n.eq_ignore_ascii_case("fence-epoch")).cloned().collect()),
        (
            "epoch abc",
            good.iter()
                .map(|(n, v)| (*n, if n.eq_ignore_ascii_case("fence-epoch") { "abc".into() } else { v.clone() }))
                .collect(),
        ),
        (
            "epoch 0",
            good.iter()
                .map(|(n, v)| (*n, if n.eq_ignore_ascii_case("fence-epoch") { "0".into() } else { v.clone() }))
                .collect(),
        ),
    ];
    for (what, headers) in cases {
        let mut request = reqwest::Client::new().post(rx.url("/effect")).body("x").timeout(CAP);
        for (name, value) in headers {
            request = request.header(name, value);
        }
        let response = request.send().await.expect("receiver reachable");
        let status = response.status().as_u16();
        let body = response.text().await.unwrap_or_default();
        assert_eq!(status, 400, "{what}: {body}");
        assert!(body.to_lowercase().contains("fence-"), "{what}: the body names the header: {body}");
    }
    assert_eq!(rx.runs(), 0, "the handler never ran");
    assert_eq!(rx.effect(&job).await, None);
    assert_eq!(rx.newest(&job).await, None);
}

/// Guard: the bound on how long a newer epoch waits for the ledger row (the pool's
/// `lock_timeout`). Defect covered: a call queueing without limit behind a slow effect. Epoch 2
/// gets 503 with Retry-After, nothing applied; epoch 1 commits; epoch 2's retry then wins.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_receiver_wait_past_lock_timeout_is_503_then_retry_wins() {
    let options: sqlx::postgres::PgConnectOptions = common::database_url().parse().expect("DATABASE_URL");
    let timeouts = PgTimeouts { lock: Duration::from_millis(200), ..PgTimeouts::default() };
    let fence =
        PgFence::connect_with_timeouts(options, timeouts).await.expect("connect").schema(common::unique_schema());
    fence.migrate().await.expect("migrate");
    let rx = serve(Guard::Atomic, fence, Some(1)).await;
    // Epoch 1 holds the row until epoch 2 has answered, however long that takes.
    rx.shared.release_when_other_waits.store(false, Ordering::SeqCst);
    let job = common::unique("lock-timeout");
    let run = race(&rx, &job, 1, 2).await;
    println!("{}", run.timeline);
    assert_eq!(run.second.0, 503, "epoch 2 gave up waiting for the row\n{}", run.timeline);
    assert_eq!(run.first.0, 200, "{}", run.timeline);
    assert_eq!(run.effect, Some((1, "epoch 1".to_owned())), "{}", run.timeline);
    assert_eq!(run.newest, Some(1), "epoch 2's refused call did not move the ledger");
    // The caller retries (Retry-After) and wins.
    assert_eq!(post_stamped(&rx.url("/effect"), &stamp(&job, 2), "epoch 2").await.0, 200);
    assert_eq!(rx.effect(&job).await, Some((2, "epoch 2".to_owned())));
    assert_eq!(rx.newest(&job).await, Some(2));
}

/// Guard: the handler time limit. Defect covered: a stuck handler holding the ledger row (and its
/// transaction) forever. The layer answers 503 and rolls back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_receiver_handler_past_its_time_limit_is_rolled_back() {
    let rx = serve_with(Guard::Atomic, common::pg().await, Some(1), Duration::from_millis(200)).await;
    let job = common::unique("slow-handler");
    let t0 = Instant::now();
    let (status, retry_after, body) = post_stamped_full(&rx.url("/effect"), &stamp(&job, 1), "epoch 1").await;
    assert_eq!((status, retry_after.as_deref()), (503, Some("1")), "{body}");
    assert!(body.contains("effect_timeout"), "{body}");
    // Left alone, the handler would run SLOW and then wait CAP (nobody answers or waits).
    assert!(t0.elapsed() < CAP / 2, "answered at the limit, not when the handler would have ended");
    assert_eq!(rx.effect(&job).await, None);
    assert_eq!(rx.newest(&job).await, None, "the ledger did not move");
    // The row is free at once: the next epoch is not kept waiting.
    rx.shared.other_answered.store(true, Ordering::SeqCst);
    assert_eq!(post_stamped(&rx.url("/effect"), &stamp(&job, 2), "epoch 2").await.0, 200);
    assert_eq!(rx.effect(&job).await, Some((2, "epoch 2".to_owned())));
}

/// Guard: the atomic receiver's ledger lock, under load. Defect covered: any interleaving of
/// concurrent calls for one job letting an older epoch's effect land after a newer one's. Many
/// epochs at once, shuffled, each effect with a random delay inside its transaction: the applied
/// effects (an append-only log written in the same transaction, in lock order) are in epoch
/// order, exactly the calls answered 200 are in it, and the final state is the newest epoch's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_receiver_concurrent_epochs_apply_in_epoch_order() {
    let rx = serve(Guard::Atomic, common::pg().await, None).await;
    rx.shared.jitter.store(true, Ordering::SeqCst);
    for round in 0..3 {
        let job = common::unique(&format!("storm-{round}"));
        let mut epochs: Vec<i64> = (1..=12).chain([3, 7, 12]).collect();
        for i in (1..epochs.len()).rev() {
            epochs.swap(i, rand::random_range(0..=i));
        }
        // Mostly rising, overlapping: epoch e starts after 3e ms plus up to 15 ms of jitter.
        let calls = epochs.iter().map(|&e| {
            let (url, s) = (rx.url("/effect"), stamp(&job, e));
            let start = Duration::from_millis(3 * e as u64 + rand::random_range(0..15));
            async move {
                tokio::time::sleep(start).await;
                (e, post_stamped(&url, &s, &format!("epoch {e}")).await.0)
            }
        });
        let answers = futures::future::join_all(calls).await;
        let log: Vec<i64> = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT epoch FROM {}.effects_log WHERE job = $1 ORDER BY seq",
            rx.shared.schema()
        )))
        .bind(FenceStamp::new(QUEUE, &job, 1).ledger_job())
        .fetch_all(rx.shared.fence.pool())
        .await
        .expect("log");
        println!("round {round}: sent {epochs:?}; answers {answers:?}; applied in order {log:?}");
        assert!(answers.iter().all(|(_, st)| matches!(st, 200 | 409)), "{answers:?}");
        assert!(log.windows(2).all(|w| w[0] <= w[1]), "an older effect landed after a newer one: {log:?}");
        let mut ok: Vec<i64> = answers.iter().filter(|(_, st)| *st == 200).map(|(e, _)| *e).collect();
        ok.sort_unstable();
        let mut applied = log.clone();
        applied.sort_unstable();
        assert_eq!(ok, applied, "exactly the calls answered 200 were applied");
        assert_eq!(log.last(), Some(&12));
        assert_eq!(rx.effect(&job).await.map(|(e, _)| e), Some(12));
        assert_eq!(rx.newest(&job).await, Some(12));
    }
}

/// Figures for the README: sequential requests through each guard (one client, one job per
/// request, the same two-statement effect), interleaved rounds so that a busy machine slows both
/// alike. Not a safety test; it asserts only that every request succeeded.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn effects_receiver_latency_atomic_vs_check_only() {
    const ROUNDS: usize = 5;
    const N: usize = 100;
    let client = reqwest::Client::new();
    let send = |url: String, job: String| {
        let mut request = client.post(url).body("b");
        for (name, value) in stamp(&job, 1).to_headers() {
            request = request.header(name, value);
        }
        async move { assert!(request.send().await.expect("send").status().is_success()) }
    };
    let mut receivers = Vec::new();
    for guard in [Guard::CheckOnly, Guard::Atomic] {
        let rx = serve(guard, common::pg().await, None).await;
        for i in 0..20 {
            send(rx.url("/effect"), format!("warm-{i}")).await; // connections, prepared statements
        }
        receivers.push((guard, rx, Duration::ZERO));
    }
    for round in 0..ROUNDS {
        for (_, rx, total) in receivers.iter_mut() {
            let t0 = Instant::now();
            for i in 0..N {
                send(rx.url("/effect"), format!("job-{round}-{i}")).await;
            }
            *total += t0.elapsed();
        }
    }
    for (guard, _, total) in &receivers {
        let n = (ROUNDS * N) as f64;
        println!(
            "{guard:?}: {} sequential requests, {:.2} ms per request, {:.0} requests/s",
            ROUNDS * N,
            total.as_secs_f64() * 1000.0 / n,
            n / total.as_secs_f64()
        );
    }
}
