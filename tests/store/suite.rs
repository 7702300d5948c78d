//! The shared store suite: every test is written once, generic over the backend, and run against a
//! real PostgreSQL (a fresh schema per test) and a real SQLite file (a fresh file per test).
//!
//! PostgreSQL comes from `DATABASE_URL` or `localstack/.env`; without it the PostgreSQL tests fail
//! and say to run `localstack/up`.

use brokerfence_testkit::store as common;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use brokerfence::ledger::Verdict;
use brokerfence::{
    Claim, DbTime, FailOutcome, FenceError, FenceStore, JobKey, JobRecord, JobState, Lease, LeaseDuration,
    MAX_KEY_BYTES, MAX_NAME_BYTES, MIN_LEASE, Owner, PgFence, QueueName, RetryPolicy, SchemaName,
};
use common::{TestStore, key, lease};
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};

/// Every generic test, instantiated once per backend.
macro_rules! suite {
    ($backend:ident: $store:ty; $($name:ident),* $(,)?) => {
        mod $backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name::<$store>().await
                }
            )*
        }
    };
}

macro_rules! all_tests {
    ($backend:ident: $store:ty) => {
        suite!($backend: $store;
            migrate_is_idempotent,
            migrate_from_four_tasks_at_once,
            claim_outcomes,
            claim_batch_mixed_states_in_input_order,
            racing_batch_claims_agree_on_one_winner,
            enqueue_is_idempotent,
            claim_next_hands_out_due_jobs,
            claim_next_respects_backoff_and_release,
            heartbeat_renews_and_reports_lost,
            heartbeats_and_batch_claims_do_not_deadlock,
            writes_under_a_live_lease,
            fail_retries_then_buries,
            release_keeps_the_epoch,
            complete_in_commits_with_business_rows,
            complete_batch_commits_each_lease_or_fences_it,
            lease_expiry_and_takeover,
            leases_come_from_the_database_clock,
            odd_keys_and_payloads_round_trip,
            ledger_newest_wins,
            ledger_concurrent_accepts,
            eight_claimers_table_queue,
            eight_claimers_broker_deliveries,
        );
    };
}

all_tests!(pg: brokerfence::PgFence);
all_tests!(sqlite: brokerfence::SqliteFence);

// ---------------------------------------------------------------------------------------------
// helpers

async fn fresh<S: TestStore>() -> S {
    let s = S::unmigrated().await;
    s.migrate().await.expect("migrate");
    s
}

fn queue() -> QueueName {
    QueueName::new(common::unique("q")).unwrap()
}

fn owner(name: &str) -> Owner {
    Owner::unique(name)
}

#[track_caller]
fn claimed(c: Claim) -> Lease {
    match c {
        Claim::Claimed(l) => l,
        other => panic!("expected Claimed, got {other:?}"),
    }
}

#[track_caller]
fn assert_fenced<T: std::fmt::Debug>(
    r: brokerfence::Result<T>,
    lease: &Lease,
    current_epoch: i64,
    current_owner: Option<&Owner>,
) {
    match r {
        Err(FenceError::Fenced { key, epoch, current_epoch: ce, current_owner: co }) => {
            assert_eq!(key, lease.key.as_str(), "Fenced.key");
            assert_eq!(epoch, lease.epoch, "Fenced.epoch");
            assert_eq!(ce, current_epoch, "Fenced.current_epoch for {key}");
            assert_eq!(co.as_deref(), current_owner.map(Owner::as_str), "Fenced.current_owner for {key}");
        }
        other => panic!("expected Fenced for {} epoch {}, got {other:?}", lease.key, lease.epoch),
    }
}

async fn job<S: FenceStore>(s: &S, q: &QueueName, k: &JobKey) -> JobRecord {
    s.job(q, k).await.unwrap().unwrap_or_else(|| panic!("job {k} missing"))
}

fn ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap()
}

/// `at` lies within [before + d, after + d] (database-clock milliseconds).
#[track_caller]
fn assert_within(at: DbTime, before: DbTime, after: DbTime, d: Duration, what: &str) {
    let (lo, hi) = (before.0 + ms(d), after.0 + ms(d));
    assert!(lo <= at.0 && at.0 <= hi, "{what}: {at} is not within [{lo}, {hi}] (db now + {d:?})");
}

fn policy(max_attempts: i64, base: Duration) -> RetryPolicy {
    RetryPolicy { max_attempts, base_backoff: base, max_backoff: Duration::from_secs(3600) }
}

/// Long enough for a 3 s lease to lapse on the database clock.
const LAPSE: Duration = Duration::from_millis(3_200);

// ---------------------------------------------------------------------------------------------
// input validation (no database)

#[test]
fn schema_names_are_validated() {
    let long = "a".repeat(64);
    for bad in ["x; DROP TABLE y", "a\"b", "Upper", "", long.as_str(), "pg_x", "1abc", "a-b", "a b", "ä", "a.b"] {
        match SchemaName::new(bad) {
            Err(FenceError::InvalidSchema { name, reason }) => {
                assert_eq!(name, bad);
                assert!(!reason.is_empty());
            }
            other => panic!("schema {bad:?} should be InvalidSchema, got {other:?}"),
        }
    }
    let max = "a".repeat(63);
    for good in ["a", "_x", "brokerfence", "t_0123abc", max.as_str()] {
        assert_eq!(SchemaName::new(good).unwrap().as_str(), good);
    }
}

#[test]
fn bad_keys_and_names_are_typed_errors() {
    #[track_caller]
    fn invalid<T: std::fmt::Debug>(r: brokerfence::Result<T>, expected_what: &str) {
        match r {
            Err(FenceError::InvalidInput { what, .. }) => assert_eq!(what, expected_what),
            other => panic!("expected InvalidInput({expected_what}), got {other:?}"),
        }
    }
    invalid(JobKey::new(""), "key");
    invalid(JobKey::new("x".repeat(MAX_KEY_BYTES + 1)), "key");
    invalid(JobKey::new("x".repeat((1 << 20) + 1)), "key");
    invalid(JobKey::new("a\0b"), "key");
    invalid(JobKey::new("\0"), "key");
    invalid(JobKey::from_bytes(b"\xff\xfe"), "key");
    invalid(JobKey::from_bytes(b"ok\xc3"), "key");
    invalid(JobKey::from_bytes(b"a\0"), "key");
    invalid(JobKey::from_bytes(b""), "key");
    invalid(QueueName::new(""), "queue");
    invalid(QueueName::new("q\0"), "queue");
    invalid(QueueName::new("q".repeat(MAX_NAME_BYTES + 1)), "queue");
    invalid(Owner::new(""), "owner");
    invalid(Owner::new("w\0"), "owner");
    invalid(Owner::from_bytes(b"\x80"), "owner");
    assert_eq!(JobKey::new("k".repeat(MAX_KEY_BYTES)).unwrap().as_str().len(), MAX_KEY_BYTES);
    assert_eq!(JobKey::from_bytes("ключ 🦀".as_bytes()).unwrap().as_str(), "ключ 🦀");
    assert!(Owner::unique("a\0b").as_str().starts_with("ab-"));
}

#[test]
fn leases_shorter_than_three_seconds_are_refused() {
    for short in [Duration::ZERO, Duration::from_secs(1), Duration::from_secs(2), Duration::from_millis(2_999)] {
        match LeaseDuration::new(short) {
            Err(FenceError::LeaseTooShort { lease, min }) => {
                assert_eq!(lease, short);
                assert_eq!(min, MIN_LEASE);
            }
            other => panic!("lease {short:?} should be LeaseTooShort, got {other:?}"),
        }
    }
    assert!(matches!(LeaseDuration::from_secs(2), Err(FenceError::LeaseTooShort { .. })));
    assert_eq!(LeaseDuration::from_secs(3).unwrap().get(), MIN_LEASE);
    assert_eq!(LeaseDuration::from_secs(3).unwrap().heartbeat_interval(), Duration::from_secs(1));
    assert!(matches!(LeaseDuration::from_secs(86_401), Err(FenceError::InvalidInput { what: "lease", .. })));
}

// ---------------------------------------------------------------------------------------------
// migrations

async fn assert_migrated<S: TestStore>(s: &S) {
    let tables = s.tables().await;
    assert_eq!(tables.len(), S::TABLES.len(), "exactly the fence tables, once: {tables:?}");
    for suffix in S::TABLES {
        assert_eq!(tables.iter().filter(|t| t.ends_with(suffix)).count(), 1, "{suffix} in {tables:?}");
    }
    assert_eq!(s.migration_rows().await, S::MIGRATIONS, "one row per applied migration");
}

async fn migrate_is_idempotent<S: TestStore>() {
    let s = S::unmigrated().await;
    s.migrate().await.expect("first migrate");
    assert_migrated(&s).await;
    s.migrate().await.expect("second migrate");
    s.migrate().await.expect("third migrate");
    assert_migrated(&s).await;
    let q = queue();
    assert!(s.enqueue(&q, &key("after-migrate"), b"x").await.unwrap());
}

async fn migrate_from_four_tasks_at_once<S: TestStore>() {
    let first = S::unmigrated().await;
    let barrier = Arc::new(tokio::sync::Barrier::new(4));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let s = first.reopen().await; // its own pool: like four processes starting together
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            s.migrate().await
        }));
    }
    for t in tasks {
        t.await.unwrap().expect("concurrent migrate succeeds");
    }
    assert_migrated(&first).await;
    let q = queue();
    let l = claimed(first.claim(&q, &key("k"), &owner("w"), lease(10)).await.unwrap());
    assert_eq!(l.epoch, 1);
}

// ---------------------------------------------------------------------------------------------
// claims

async fn claim_outcomes<S: TestStore>() {
    let s = fresh::<S>().await;
    let q = queue();
    let (a, b) = (owner("a"), owner("b"));

    // New key: claimed at epoch 1.
    let k = key("k1");
    let l = claimed(s.claim(&q, &k, &a, lease(30)).await.unwrap());
    assert_eq!((l.epoch, l.attempts, &l.owner, &l.key, &l.queue), (1, 1, &a, &k, &q));
    assert!(l.ttl > Duration::from_secs(29) && l.ttl <= Duration::from_secs(30), "ttl {:?}", l.ttl);
    let rec = job(&s, &q, &k).await;
    assert_eq!(
        (rec.state, rec.epoch, rec.owner.as_deref(), rec.lease_until),
        (JobState::Running, 1, Some(a.as_str()), Some(l.lease_until))
    );

    // Live lease: Busy, for another owner and for the holder itself (a claim never renews).
    for who in [&b, &a] {
        match s.claim(&q, &k, who, lease(30)).await.unwrap() {
            Claim::Busy { owner, epoch, lease_until, ttl } => {
                assert_eq!(owner.as_deref(), Some(a.as_str()));
                assert_eq!(epoch, 1);
                assert_eq!(lease_until, l.lease_until);
                assert!(ttl > Duration::ZERO && ttl <= Duration::from_secs(30), "ttl {ttl:?}");
            }
            other => panic!("expected Busy, got {other:?}"),
        }
    }
    assert_eq!(job(&s, &q, &k).await, rec, "a Busy claim writes nothing");

    // Completed: Done.
    s.complete(&l, b"result").await.unwrap();
    assert_eq!(s.claim(&q, &k, &b, lease(30)).await.unwrap(), Claim::Done { epoch: 1 });
    let rec = job(&s, &q, &k).await;
    assert_eq!((rec.state, rec.epoch, rec.result.as_deref()), (JobState::Completed, 1, Some(&b"result"[..])));

    // Failed without retry: Dead.
    let k2 = key("k2");
    let l2 = claimed(s.claim(&q, &k2, &a, lease(30)).await.unwrap());
    assert_eq!(s.fail(&l2, "poison", false, &RetryPolicy::default()).await.unwrap(), FailOutcome::Dead);
    assert_eq!(s.claim(&q, &k2, &b, lease(30)).await.unwrap(), Claim::Dead { epoch: 1 });

    // Failed with a backoff in the future: Backoff.
    let k3 = key("k3");
    let l3 = claimed(s.claim(&q, &k3, &a, lease(30)).await.unwrap());
    let out = s.fail(&l3, "later", true, &policy(5, Duration::from_secs(60))).await.unwrap();
    assert_eq!(out, FailOutcome::Retry { retry_in: Duration::from_secs(60) });
    match s.claim(&q, &k3, &b, lease(30)).await.unwrap() {
        Claim::Backoff { epoch, retry_in } => {
            assert_eq!(epoch, 1);
            assert!(retry_in > Duration::from_secs(58) && retry_in <= Duration::from_secs(60), "{retry_in:?}");
        }
        other => panic!("expected Backoff, got {other:?}"),
    }

    // Failed with the backoff passed: claimable, next epoch, attempts counted.
    let k4 = key("k4");
    let l4 = claimed(s.claim(&q, &k4, &a, lease(30)).await.unwrap());
    s.fail(&l4, "again", true, &policy(5, Duration::ZERO)).await.unwrap();
    let l4b = claimed(s.claim(&q, &k4, &b, lease(30)).await.unwrap());
    assert_eq!((l4b.epoch, l4b.attempts, &l4b.owner), (2, 2, &b));

    // The same key in another queue is another job.
    let q2 = queue();
    assert_eq!(claimed(s.claim(&q2, &k, &b, lease(30)).await.unwrap()).epoch, 1);
}

async fn claim_batch_mixed_states_in_input_order<S: TestStore>() {
    let s = fresh::<S>().await;
    let q = queue();
    let (x, y) = (owner("x"), owner("y"));
    let ks = |p: &str, n: usize| (0..n).map(|i| key(&format!("{p}{i}"))).collect::<Vec<_>>();
    let (new, pending, busy, done, dead, backoff, due) =
        (ks("new", 10), ks("pending", 8), ks("busy", 6), ks("done", 6), ks("dead", 4), ks("backoff", 4), ks("due", 4));
    for k in &pending {
        assert!(s.enqueue(&q, k, b"p").await.unwrap());
    }
    for k in &busy {
        claimed(s.claim(&q, k, &x, lease(60)).await.unwrap());
    }
    for k in &done {
        let l = claimed(s.claim(&q, k, &x, lease(60)).await.unwrap());
        s.complete(&l, b"done").await.unwrap();
    }
    for k in &dead {
        let l = claimed(s.claim(&q, k, &x, lease(60)).await.unwrap());
        s.fail(&l, "dead", false, &RetryPolicy::default()).await.unwrap();
    }
    for k in &backoff {
        let l = claimed(s.claim(&q, k, &x, lease(60)).await.unwrap());
        s.fail(&l, "wait", true, &policy(5, Duration::from_secs(120))).await.unwrap();
    }
    for k in &due {
        let l = claimed(s.claim(&q, k, &x, lease(60)).await.unwrap());
        s.fail(&l, "retry now", true, &policy(5, Duration::ZERO)).await.unwrap();
    }
    let mut input: Vec<JobKey> =
        [&new, &pending, &busy, &done, &dead, &backoff, &due].into_iter().flatten().cloned().collect();
    assert_eq!(input.len(), 42);
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let dups: Vec<JobKey> = input.choose_multiple(&mut rng, 8).cloned().collect();
    input.extend(dups);
    input.shuffle(&mut rng);
    assert_eq!(input.len(), 50);

    let out = s.claim_batch(&q, &input, &y, lease(30)).await.unwrap();
    assert_eq!(out.len(), input.len());
    let class = |k: &JobKey| k.as_str().trim_end_matches(|c: char| c.is_ascii_digit()).to_owned();
    let mut first: HashMap<&str, &Claim> = HashMap::new();
    for (k, c) in input.iter().zip(&out) {
        match (class(k).as_str(), c) {
            ("new" | "pending", Claim::Claimed(l)) => assert_eq!((l.epoch, l.attempts), (1, 1), "{k}"),
            ("due", Claim::Claimed(l)) => assert_eq!((l.epoch, l.attempts), (2, 2), "{k}"),
            ("busy", Claim::Busy { owner, epoch: 1, ttl, .. }) => {
                assert_eq!(owner.as_deref(), Some(x.as_str()));
                assert!(*ttl > Duration::from_secs(50));
            }
            ("done", Claim::Done { epoch: 1 }) | ("dead", Claim::Dead { epoch: 1 }) => {}
            ("backoff", Claim::Backoff { epoch: 1, retry_in }) => assert!(*retry_in > Duration::from_secs(100)),
            (class, other) => panic!("{k} ({class}): unexpected outcome {other:?}"),
        }
        if let Claim::Claimed(l) = c {
            assert_eq!((&l.key, &l.owner, &l.queue), (k, &y, &q), "the lease is for the key at this position");
        }
        // A key given twice gets the same outcome twice: one claim, not two.
        if let Some(prev) = first.insert(k.as_str(), c) {
            assert_eq!(prev, c, "duplicate {k} got a different outcome");
        }
    }
    for k in new.iter().chain(&pending).chain(&due) {
        let r = job(&s, &q, k).await;
        assert_eq!((r.state, r.owner.as_deref()), (JobState::Running, Some(y.as_str())), "{k}");
    }
    for k in &busy {
        assert_eq!(job(&s, &q, k).await.owner.as_deref(), Some(x.as_str()), "{k} still held by x");
    }
    assert!(s.claim_batch(&q, &[], &y, lease(30)).await.unwrap().is_empty());
}

/// Eight consumers get the same deliveries at the same moment (pending rows and new keys): each
/// key is claimed by exactly one of them, and every other one is told Busy with the winner's owner
/// and epoch, never a stale answer or an error.
async fn racing_batch_claims_agree_on_one_winner<S: TestStore>() {
    let s = fresh::<S>().await;
    let q = queue();
    let keys: Vec<JobKey> = (0..300).map(|i| key(&format!("race{i:03}"))).collect();
    let pending: Vec<(JobKey, Vec<u8>)> = keys[..200].iter().map(|k| (k.clone(), b"p".to_vec())).collect();
    s.enqueue_many(&q, &pending).await.unwrap();
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let mut tasks = Vec::new();
    for i in 0..8u64 {
        let (store, q, barrier, mut keys) = (s.reopen().await, q.clone(), barrier.clone(), keys.clone());
        tasks.push(tokio::spawn(async move {
            keys.shuffle(&mut rand::rngs::StdRng::seed_from_u64(i));
            let me = Owner::unique(&format!("racer{i}"));
            barrier.wait().await;
            let mut out = Vec::new();
            for chunk in keys.chunks(25) {
                let claims = store.claim_batch(&q, chunk, &me, lease(60)).await.expect("claim_batch under contention");
                out.extend(chunk.iter().cloned().zip(claims));
            }
            (me, out)
        }));
    }
    let mut winners: HashMap<JobKey, Owner> = HashMap::new();
    let mut busy: Vec<(JobKey, Option<String>, i64)> = Vec::new();
    for t in tasks {
        let (me, out) = t.await.unwrap();
        for (k, c) in out {
            match c {
                Claim::Claimed(l) => {
                    assert_eq!(l.epoch, 1, "{k}");
                    let prev = winners.insert(k.clone(), me.clone());
                    assert!(prev.is_none(), "{k} claimed by {prev:?} and {me}");
                }
                Claim::Busy { owner, epoch, .. } => busy.push((k, owner, epoch)),
                other => panic!("{k}: unexpected {other:?}"),
            }
        }
    }
    assert_eq!(winners.len(), keys.len(), "every key has one winner");
    assert_eq!(busy.len(), keys.len() * 7);
    for (k, owner, epoch) in busy {
        assert_eq!((owner.as_deref(), epoch), (Some(winners[&k].as_str()), 1), "{k}: Busy names the winner");
    }
}

// ---------------------------------------------------------------------------------------------
// table queue

async fn enqueue_is_idempotent<S: TestStore>() {
    let s = fresh::<S>().await;
    let q = queue();
    let k = key("e1");
    assert!(s.enqueue(&q, &k, b"one").await.unwrap(), "first enqueue inserts");
    assert!(!s.enqueue(&q, &k, b"other").await.unwrap(), "second enqueue does not");
    let r = job(&s, &q, &k).await;
    assert_eq!((r.state, r.epoch, r.attempts, r.owner.as_deref()), (JobState::Pending, 0, 0, None));
    assert_eq!(r.payload.as_deref(), Some(&b"one"[..]), "the first payload is kept");

    let jobs: Vec<(JobKey, Vec<u8>)> = (0..10).map(|i| (key(&format!("m{i}")), format!("p{i}").into_bytes())).collect();
    assert_eq!(s.enqueue_many(&q, &jobs).await.unwrap(), 10);
    assert_eq!(s.enqueue_many(&q, &jobs).await.unwrap(), 0);
    let mut mixed: Vec<(JobKey, Vec<u8>)> = jobs[..5].to_vec();
    mixed.extend((10..15).map(|i| (key(&format!("m{i}")), format!("p{i}").into_bytes())));
    mixed.push((key("m14"), b"dup in batch".to_vec()));
    assert_eq!(s.enqueue_many(&q, &mixed).await.unwrap(), 5, "5 new keys, 5 existing, one repeated");
    assert_eq!(s.enqueue_many(&q, &[]).await.unwrap(), 0);
    assert_eq!(job(&s, &q, &key("m3")).await.payload.as_deref(), Some(&b"p3"[..]));
    assert_eq!(job(&s, &q, &key("m14")).await.payload.as_deref(), Some(&b"p14"[..]));
    // A claimed or completed job is not re-enqueued.
    let l = claimed(s.claim(&q, &key("m0"), &owner("w"), lease(10)).await.unwrap());
    assert!(!s.enqueue(&q, &key("m0"), b"again").await.unwrap());
    s.complete(&l, b"r").await.unwrap();
    assert!(!s.enqueue(&q, &key("m0"), b"again").await.unwrap());
    assert_eq!(job(&s, &q, &key("m0")).await.state, JobState::Completed);
}

async fn claim_next_hands_out_due_jobs<S: TestStore>() {
    let s = fresh::<S>().await;
    let q = queue();
    let (a, b, c) = (owner("a"), owner("b"), owner("c"));
    let mut want: HashMap<String, Vec<u8>> = HashMap::new();
    let jobs: Vec<(JobKey, Vec<u8>)> =
        (0..16u8).map(|i| (key(&format!("j{i}")), vec![i, 0, 0xff, b'\'', i.wrapping_mul(37)])).collect();
    for (k, p) in &jobs {
        want.insert(k.as_str().to_owned(), p.clone());
    }
    assert_eq!(s.enqueue_many(&q, &jobs).await.unwrap(), 16);
    assert!(s.enqueue(&queue(), &key("other-queue"), b"x").await.unwrap());

    assert!(s.claim_next(&q, &a, lease(30), 0).await.unwrap().is_empty(), "n = 0 claims nothing");
    let first = s.claim_next(&q, &a, lease(30), 3).await.unwrap();
    assert_eq!(first.len(), 3, "respects n");
    let second = s.claim_next(&q, &b, lease(30), 100).await.unwrap();
    assert_eq!(second.len(), 13, "the rest, skipping running ones");
    assert!(s.claim_next(&q, &c, lease(30), 100).await.unwrap().is_empty(), "running jobs are not handed out");
    let mut seen = HashSet::new();
    for (j, who) in first.iter().map(|j| (j, &a)).chain(second.iter().map(|j| (j, &b))) {
        assert!(seen.insert(j.lease.key.clone()), "{} handed out twice", j.lease.key);
        assert_eq!(&j.payload, &want[j.lease.key.as_str()], "payload byte for byte");
        assert_eq!((j.lease.epoch, j.lease.attempts, &j.lease.owner, &j.lease.queue), (1, 1, who, &q));
        assert_eq!(j.progress, None);
        assert!(j.lease.ttl > Duration::from_secs(29) && j.lease.ttl <= Duration::from_secs(30));
        let r = job(&s, &q, &j.lease.key).await;
        assert_eq!(
            (r.state, r.epoch, r.owner.as_deref(), r.lease_until),
            (JobState::Running, 1, Some(who.as_str()), Some(j.lease.lease_until))
        );
    }
    assert_eq!(seen.len(), 16);
    for j in &first {
        s.complete(&j.lease, b"ok").await.unwrap();
    }
    assert!(s.claim_next(&q, &c, lease(30), 100).await.unwrap().is_empty(), "completed jobs are not handed out");
}

async fn claim_next_respects_backoff_and_release<S: TestStore>() {
    let s = fresh::<S>().await;
    let q = queue();
    let (a, b) = (owner("a"), owner("b"));
    assert!(s.enqueue(&q, &key("later"), b"payload-later").await.unwrap());
    let got = s.claim_next(&q, &a, lease(30), 10).await.unwrap();
    assert_eq!(got.len(), 1);
    s.checkpoint(&got[0].lease, b"half").await.unwrap();
    s.fail(&got[0].lease, "not yet", true, &policy(5, Duration::from_secs(60))).await.unwrap();
    assert!(s.claim_next(&q, &b, lease(30), 10).await.unwrap().is_empty(), "a failed job waits for run_at");

    assert!(s.enqueue(&q, &key("now"), b"payload-now").await.unwrap());
    let got = s.claim_next(&q, &a, lease(30), 10).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].lease.key, key("now"));
    s.checkpoint(&got[0].lease, b"progress \0\xff").await.unwrap();
    s.fail(&got[0].lease, "retry at once", true, &policy(5, Duration::ZERO)).await.unwrap();
    let again = s.claim_next(&q, &b, lease(30), 10).await.unwrap();
    assert_eq!(again.len(), 1, "the due retry, not the one in backoff");
    let j = &again[0];
    assert_eq!((j.lease.key.as_str(), j.lease.epoch, j.lease.attempts), ("now", 2, 2));
    assert_eq!(j.payload, b"payload-now");
    assert_eq!(j.progress.as_deref(), Some(&b"progress \0\xff"[..]), "the last checkpoint comes back");

    // Released: handed out again at once, at the next epoch, without spending an attempt.
    s.release(&j.lease).await.unwrap();
    let again = s.claim_next(&q, &a, lease(30), 10).await.unwrap();
    assert_eq!(again.len(), 1);
    assert_eq!((again[0].lease.key.as_str(), again[0].lease.epoch, again[0].lease.attempts), ("now", 3, 2));
}

// ---------------------------------------------------------------------------------------------
// heartbeats and fenced writes

async fn heartbeat_renews_and_reports_lost<S: TestStore>() {
    let s = fresh::<S>().await;
    let q = queue();
    let (a, b) = (owner("a"), owner("b"));
    let l1 = claimed(s.claim(&q, &key("live1"), &a, lease(10)).await.unwrap());
    let l2 = claimed(s.claim(&q, &key("live2"), &a, lease(10)).await.unwrap());
    tokio::time::sleep(Duration::from_millis(30)).await;
    let before = s.db_now().await.unwrap();
    let hb = s.heartbeat(&[l1.clone(), l2.clone()], lease(20)).await.unwrap();
    let after = s.db_now().await.unwrap();
    assert!(hb.lost.is_empty(), "{hb:?}");
    assert_eq!(hb.renewed.len(), 2);
    for (r, old) in hb.renewed.iter().zip([&l1, &l2]) {
        assert_eq!((&r.key, r.epoch, &r.owner), (&old.key, old.epoch, &old.owner));
        assert!(r.lease_until > old.lease_until, "lease_until grows");
        assert_within(r.lease_until, before, after, Duration::from_secs(20), "renewed lease_until");
        assert!(r.ttl > Duration::from_secs(19) && r.ttl <= Duration::from_secs(20), "ttl {:?}", r.ttl);
        assert_eq!(job(&s, &q, &r.key).await.lease_until, Some(r.lease_until));
    }
    assert_eq!(s.heartbeat(&[], lease(10)).await.unwrap(), Default::default());

    // Completed, released, superseded (released and taken by b) and forged leases are lost.
    let done = claimed(s.claim(&q, &key("done"), &a, lease(10)).await.unwrap());
    s.complete(&done, b"r").await.unwrap();
    let released = claimed(s.claim(&q, &key("released"), &a, lease(10)).await.unwrap());
    s.release(&released).await.unwrap();
    let old = claimed(s.claim(&q, &key("taken"), &a, lease(10)).await.unwrap());
    s.release(&old).await.unwrap();
    let new = claimed(s.claim(&q, &key("taken"), &b, lease(10)).await.unwrap());
    assert_eq!(new.epoch, 2);
    let forged_owner = Lease { owner: b.clone(), ..l1.clone() };
    let forged_epoch = Lease { epoch: l1.epoch + 1, ..l1.clone() };
    let watched: Vec<JobKey> = ["done", "released", "taken"].into_iter().map(key).collect();
    let records: Vec<JobRecord> = futures::future::join_all(watched.iter().map(|k| job(&s, &q, k))).await;

    let mix = vec![done.clone(), l1.clone(), released.clone(), old.clone(), forged_owner.clone(), forged_epoch.clone()];
    let hb = s.heartbeat(&mix, lease(10)).await.unwrap();
    assert_eq!(hb.renewed.iter().map(|l| l.key.as_str()).collect::<Vec<_>>(), ["live1"]);
    assert_eq!(hb.lost, vec![done, released, old, forged_owner, forged_epoch], "lost, in input order");
    let after: Vec<JobRecord> = futures::future::join_all(watched.iter().map(|k| job(&s, &q, k))).await;
    assert_eq!(records, after, "a lost heartbeat writes nothing (the new owner's lease is untouched)");
}

/// One owner heartbeats its leases (in whatever order its registry yields them) while another
/// claims the same keys in batches (each delivery of a busy key locks its row): both must keep
/// working, without a deadlock between them.
async fn heartbeats_and_batch_claims_do_not_deadlock<S: TestStore>() {
    let s = fresh::<S>().await;
    let q = queue();
    let (a, b) = (owner("a"), owner("b"));
    let keys: Vec<JobKey> = (0..40).map(|i| key(&format!("d{i:02}"))).collect();
    let leases: Vec<Lease> = s.claim_batch(&q, &keys, &a, lease(60)).await.unwrap().into_iter().map(claimed).collect();
    let (s1, s2) = (s.reopen().await, s.reopen().await);
    let beats = tokio::spawn(async move {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut leases = leases;
        for _ in 0..60 {
            leases.shuffle(&mut rng);
            let hb = s1.heartbeat(&leases, lease(60)).await.expect("heartbeat");
            // A row a claim holds locked at that instant is skipped (held), never lost.
            assert!(hb.lost.is_empty(), "{hb:?}");
            assert_eq!(hb.renewed.len() + hb.held.len(), leases.len());
        }
    });
    let claims = tokio::spawn(async move {
        for _ in 0..60 {
            let out = s2.claim_batch(&q, &keys, &b, lease(60)).await.expect("claim_batch");
            assert!(out.iter().all(|c| matches!(c, Claim::Busy { epoch: 1, .. })));
        }
    });
    beats.await.unwrap();
    claims.await.unwrap();
}

async fn writes_under_a_live_lease<S: TestStore>() {
    let s = fresh::<S>().await;
    let q = queue();
    let a = owner("a");
    let k = key("w");
    let l = claimed(s.claim(&q, &k, &a, lease(30)).await.unwrap());
    s.checkpoint(&l, b"step 1").await.unwrap();
    s.checkpoint(&l, b"step 2 \0\xff").await.unwrap();
    let r = job(&s, &q, &k).await;
    assert_eq!((r.state, r.progress.as_deref()), (JobState::Running, Some(&b"step 2 \0\xff"[..])));
    s.complete(&l, b"result \0\xff").await.unwrap();
    let r = job(&s, &q, &k).await;
    assert_eq!((r.state, r.epoch, r.lease_until), (JobState::Completed, 1, None));
    assert_eq!(r.result.as_deref(), Some(&b"result \0\xff"[..]));

    // The same commit sent again (its answer lost to a failed connection): answered as
    // committed, nothing written.
    s.complete(&l, b"result \0\xff").await.unwrap();
    // After completion the lease is spent: every other write is Fenced and writes nothing.
    assert_fenced(s.complete(&l, b"twice").await, &l, 1, Some(&a));
    assert_fenced(s.checkpoint(&l, b"late").await, &l, 1, Some(&a));
    assert_fenced(s.fail(&l, "late", true, &RetryPolicy::default()).await, &l, 1, Some(&a));
    assert_fenced(s.release(&l).await, &l, 1, Some(&a));
    assert_eq!(job(&s, &q, &k).await, r);

    // A lease for a job that does not exist: current epoch 0, no owner.
    let ghost = Lease { key: key("ghost"), ..l.clone() };
    assert_fenced(s.complete(&ghost, b"x").await, &ghost, 0, None);
    assert!(s.job(&q, &key("ghost")).await.unwrap().is_none());
}

async fn fail_retries_then_buries<S: TestStore>() {
    let s = fresh::<S>().await;
    let q = queue();
    let a = owner("a");

    let k = key("retry");
    let l = claimed(s.claim(&q, &k, &a, lease(30)).await.unwrap());
    let before = s.db_now().await.unwrap();
    let out = s.fail(&l, "boom '; DROP TABLE jobs; -- \0", true, &policy(5, Duration::from_secs(2))).await.unwrap();
    let after = s.db_now().await.unwrap();
    assert_eq!(out, FailOutcome::Retry { retry_in: Duration::from_secs(2) });
    let r = job(&s, &q, &k).await;
    assert_eq!((r.state, r.epoch, r.attempts, r.lease_until), (JobState::Failed, 1, 1, None));
    assert_within(r.run_at, before, after, Duration::from_secs(2), "run_at = now + backoff");
    assert_eq!(r.last_error.as_deref(), Some("boom '; DROP TABLE jobs; -- \u{FFFD}"));

    // Out of attempts: dead after max_attempts.
    let k = key("bury");
    let p = policy(3, Duration::ZERO);
    for attempt in 1..=3 {
        let l = claimed(s.claim(&q, &k, &a, lease(30)).await.unwrap());
        assert_eq!((l.epoch, l.attempts), (attempt, attempt));
        let out = s.fail(&l, &format!("attempt {attempt}"), true, &p).await.unwrap();
        if attempt < 3 {
            assert_eq!(out, FailOutcome::Retry { retry_in: Duration::ZERO });
            assert_eq!(job(&s, &q, &k).await.state, JobState::Failed);
        } else {
            assert_eq!(out, FailOutcome::Dead);
        }
    }
    let r = job(&s, &q, &k).await;
    assert_eq!(
        (r.state, r.epoch, r.attempts, r.last_error.as_deref()),
        (JobState::Dead, 3, 3, Some("failed 3 times (max_attempts = 3): attempt 3"))
    );
    assert_eq!(s.claim(&q, &k, &a, lease(30)).await.unwrap(), Claim::Dead { epoch: 3 });
    assert!(s.claim_next(&q, &a, lease(30), 10).await.unwrap().is_empty(), "dead jobs are not handed out");

    // retry = false: dead at once.
    let k = key("poison");
    let l = claimed(s.claim(&q, &k, &a, lease(30)).await.unwrap());
    assert_eq!(s.fail(&l, "poison", false, &policy(10, Duration::ZERO)).await.unwrap(), FailOutcome::Dead);
    assert_eq!(job(&s, &q, &k).await.state, JobState::Dead);
    assert_fenced(s.fail(&l, "again", true, &RetryPolicy::default()).await, &l, 1, Some(&a));
}

async fn release_keeps_the_epoch<S: TestStore>() {
    let s = fresh::<S>().await;
    let q = queue();
    let (a, b) = (owner("a"), owner("b"));
    let k = key("r");
    let l = claimed(s.claim(&q, &k, &a, lease(30)).await.unwrap());
    s.checkpoint(&l, b"cp").await.unwrap();
    s.release(&l).await.unwrap();
    let r = job(&s, &q, &k).await;
    assert_eq!((r.state, r.epoch, r.attempts, r.lease_until), (JobState::Pending, 1, 0, None));
    assert_eq!(r.progress.as_deref(), Some(&b"cp"[..]));
    let l2 = claimed(s.claim(&q, &k, &b, lease(30)).await.unwrap());
    assert_eq!((l2.epoch, l2.attempts), (2, 1), "epoch continues; the released attempt was not spent");
    let r = job(&s, &q, &k).await;
    assert_fenced(s.release(&l).await, &l, 2, Some(&b));
    assert_fenced(s.complete(&l, b"zombie").await, &l, 2, Some(&b));
    assert_eq!(job(&s, &q, &k).await, r, "the released holder writes nothing");
    s.complete(&l2, b"ok").await.unwrap();
}

async fn complete_in_commits_with_business_rows<S: TestStore>() {
    let s = fresh::<S>().await;
    let q = queue();
    let a = owner("a");
    let l = claimed(s.claim(&q, &key("tx"), &a, lease(30)).await.unwrap());
    s.complete_with_business_row(&l, "committed", b"tx-result").await.unwrap();
    assert_eq!(s.business_rows().await, ["committed"]);
    let r = job(&s, &q, &l.key).await;
    assert_eq!((r.state, r.result.as_deref()), (JobState::Completed, Some(&b"tx-result"[..])));

    // A fenced complete_in: the caller rolls back, and its business row goes with it.
    assert_fenced(s.complete_with_business_row(&l, "must-not-exist", b"again").await, &l, 1, Some(&a));
    assert_eq!(s.business_rows().await, ["committed"]);
    assert_eq!(job(&s, &q, &l.key).await, r);
}

// ---------------------------------------------------------------------------------------------
// lease expiry: every scenario that needs a lease to lapse, run concurrently (one 3.2 s wait)

async fn lease_expiry_and_takeover<S: TestStore>() {
    let s = fresh::<S>().await;
    let t0 = Instant::now();
    tokio::join!(
        expired_claim_is_taken_over(&s),
        superseded_writes_are_fenced(&s),
        claim_next_reclaims_expired(&s),
        heartbeats_keep_a_lease_alive(&s)
    );
    // Run one after another they would take at least 4 x 3.2 s.
    assert!(t0.elapsed() < Duration::from_secs(12), "expiry scenarios took {:?}", t0.elapsed());
}

async fn expired_claim_is_taken_over<S: TestStore>(s: &S) {
    let q = queue();
    let (a, b) = (owner("a"), owner("b"));
    let k = key("expire");
    let l = claimed(s.claim(&q, &k, &a, lease(3)).await.unwrap());
    assert!(matches!(s.claim(&q, &k, &b, lease(3)).await.unwrap(), Claim::Busy { epoch: 1, .. }));
    tokio::time::sleep(LAPSE).await;
    let before = s.db_now().await.unwrap();
    assert!(before > l.lease_until, "the lease lapsed on the database clock");
    let l2 = claimed(s.claim(&q, &k, &b, lease(10)).await.unwrap());
    assert_eq!((l2.epoch, l2.attempts, &l2.owner), (2, 2, &b));
    let r = job(s, &q, &k).await;
    assert_eq!((r.state, r.epoch, r.owner.as_deref(), r.attempts), (JobState::Running, 2, Some(b.as_str()), 2));
    assert_fenced(s.complete(&l, b"zombie").await, &l, 2, Some(&b));
}

async fn superseded_writes_are_fenced<S: TestStore>(s: &S) {
    let q = queue();
    let (a, b) = (owner("zombie"), owner("b"));
    let names = ["cp", "complete", "fail-retry", "fail-dead", "release", "heartbeat", "complete-in"];
    let keys: Vec<JobKey> = names.iter().map(|n| key(n)).collect();
    let old: Vec<Lease> = s.claim_batch(&q, &keys, &a, lease(3)).await.unwrap().into_iter().map(claimed).collect();
    s.checkpoint(&old[0], b"zombie progress 1").await.unwrap();
    tokio::time::sleep(LAPSE).await;
    let new: Vec<Lease> = s.claim_batch(&q, &keys, &b, lease(30)).await.unwrap().into_iter().map(claimed).collect();
    for l in &new {
        assert_eq!((l.epoch, l.attempts, &l.owner), (2, 2, &b));
    }
    s.checkpoint(&new[0], b"new owner's progress").await.unwrap();
    let before: Vec<JobRecord> = futures::future::join_all(keys.iter().map(|k| job(s, &q, k))).await;

    assert_fenced(s.checkpoint(&old[0], b"zombie progress 2").await, &old[0], 2, Some(&b));
    assert_fenced(s.complete(&old[1], b"zombie result").await, &old[1], 2, Some(&b));
    assert_fenced(s.fail(&old[2], "zombie", true, &policy(5, Duration::ZERO)).await, &old[2], 2, Some(&b));
    assert_fenced(s.fail(&old[3], "zombie", false, &RetryPolicy::default()).await, &old[3], 2, Some(&b));
    assert_fenced(s.release(&old[4]).await, &old[4], 2, Some(&b));
    let hb = s.heartbeat(&old[5..6], lease(60)).await.unwrap();
    assert!(hb.renewed.is_empty());
    assert_eq!(hb.lost, old[5..6]);
    assert_fenced(s.complete_with_business_row(&old[6], "zombie-row", b"zombie").await, &old[6], 2, Some(&b));

    let after: Vec<JobRecord> = futures::future::join_all(keys.iter().map(|k| job(s, &q, k))).await;
    assert_eq!(before, after, "a superseded owner changes nothing (state, epoch, lease_until, progress, result)");
    assert_eq!(after[0].progress.as_deref(), Some(&b"new owner's progress"[..]));
    assert!(!s.business_rows().await.contains(&"zombie-row".to_owned()), "the zombie's business row rolled back");

    // The new owner is unaffected.
    s.complete_with_business_row(&new[6], "new-owner-row", b"ok").await.unwrap();
    assert!(s.business_rows().await.contains(&"new-owner-row".to_owned()));
    for l in &new[..6] {
        s.complete(l, b"ok").await.unwrap();
    }
}

async fn claim_next_reclaims_expired<S: TestStore>(s: &S) {
    let q = queue();
    let (a, b) = (owner("a"), owner("b"));
    let jobs: Vec<(JobKey, Vec<u8>)> = (0..3u8).map(|i| (key(&format!("n{i}")), vec![i, 0, 0xff])).collect();
    s.enqueue_many(&q, &jobs).await.unwrap();
    let first = s.claim_next(&q, &a, lease(3), 10).await.unwrap();
    assert_eq!(first.len(), 3);
    s.checkpoint(&first[0].lease, b"before stall").await.unwrap();
    assert!(s.claim_next(&q, &b, lease(3), 10).await.unwrap().is_empty());
    tokio::time::sleep(LAPSE).await;
    let second = s.claim_next(&q, &b, lease(30), 10).await.unwrap();
    assert_eq!(second.len(), 3, "expired running jobs are handed out again");
    for j in &second {
        let i = usize::from(j.lease.key.as_str().as_bytes()[1] - b'0');
        assert_eq!((j.lease.epoch, j.lease.attempts, &j.lease.owner), (2, 2, &b));
        assert_eq!(j.payload, jobs[i].1);
        if j.lease.key == first[0].lease.key {
            assert_eq!(j.progress.as_deref(), Some(&b"before stall"[..]));
        }
    }
    for j in &first {
        assert_fenced(s.complete(&j.lease, b"zombie").await, &j.lease, 2, Some(&b));
    }
}

async fn heartbeats_keep_a_lease_alive<S: TestStore>(s: &S) {
    let q = queue();
    let (a, b) = (owner("a"), owner("b"));
    let mut l = claimed(s.claim(&q, &key("kept"), &a, lease(3)).await.unwrap());
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        let hb = s.heartbeat(std::slice::from_ref(&l), lease(3)).await.unwrap();
        assert_eq!(hb.renewed.len(), 1, "{hb:?}");
        l = hb.renewed[0].clone();
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    match s.claim(&q, &l.key, &b, lease(3)).await.unwrap() {
        Claim::Busy { owner, epoch: 1, .. } => assert_eq!(owner.as_deref(), Some(a.as_str())),
        other => panic!("a renewed lease is not taken over, got {other:?}"),
    }
    s.complete(&l, b"kept").await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// clock

async fn leases_come_from_the_database_clock<S: TestStore>() {
    let s = fresh::<S>().await;
    let q = queue();
    let (a, b) = (owner("a"), owner("b"));
    let before = s.db_now().await.unwrap();
    let l = claimed(s.claim(&q, &key("c"), &a, lease(30)).await.unwrap());
    let after = s.db_now().await.unwrap();
    assert_within(l.lease_until, before, after, Duration::from_secs(30), "claim lease_until");
    assert!(l.ttl <= Duration::from_secs(30) && l.ttl > Duration::from_secs(29));

    s.enqueue(&q, &key("n"), b"").await.unwrap();
    let before = s.db_now().await.unwrap();
    let j = s.claim_next(&q, &a, lease(40), 1).await.unwrap().remove(0);
    let after = s.db_now().await.unwrap();
    assert_within(j.lease.lease_until, before, after, Duration::from_secs(40), "claim_next lease_until");
    assert_eq!(j.payload, b"", "an empty payload stays empty");

    let before = s.db_now().await.unwrap();
    let hb = s.heartbeat(std::slice::from_ref(&l), lease(50)).await.unwrap();
    let after = s.db_now().await.unwrap();
    assert_within(hb.renewed[0].lease_until, before, after, Duration::from_secs(50), "heartbeat lease_until");

    match s.claim(&q, &key("c"), &b, lease(30)).await.unwrap() {
        Claim::Busy { lease_until, ttl, .. } => {
            let now = s.db_now().await.unwrap();
            assert_eq!(lease_until, hb.renewed[0].lease_until);
            let left = Duration::from_millis(u64::try_from(lease_until.0 - now.0).unwrap());
            // ttl was measured a moment before `now`; both are floored to milliseconds.
            assert!(
                ttl + Duration::from_millis(2) >= left && ttl <= left + Duration::from_millis(100),
                "busy ttl {ttl:?} vs {left:?}"
            );
        }
        other => panic!("expected Busy, got {other:?}"),
    }
    let before = s.db_now().await.unwrap();
    s.fail(&hb.renewed[0], "x", true, &policy(5, Duration::from_secs(7))).await.unwrap();
    let after = s.db_now().await.unwrap();
    assert_within(job(&s, &q, &key("c")).await.run_at, before, after, Duration::from_secs(7), "retry run_at");
}

// ---------------------------------------------------------------------------------------------
// bad input that must round-trip

fn odd_keys() -> Vec<JobKey> {
    [
        "'; DROP TABLE x; --",
        "$1",
        "?1",
        "\\",
        "\\\\'",
        "\"quoted\"",
        "it's",
        "🦀 emoji ✓",
        "]]",
        "[[x]] ]==]",
        "%_*?",
        "a\tb\nc\r",
        " leading space",
        "trailing space ",
        "\u{7f}\u{1}\u{1b}[0m",
        "{s}",
        "ünïcödé",
        "\u{feff}bom",
    ]
    .into_iter()
    .map(String::from)
    .chain(["k".repeat(MAX_KEY_BYTES), "é".repeat(MAX_KEY_BYTES / 2), format!("{}🦀", "x".repeat(MAX_KEY_BYTES - 4))])
    .map(|k| JobKey::new(k).unwrap())
    .collect()
}

fn odd_payloads() -> Vec<Vec<u8>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let mut big = vec![0u8; 1 << 20];
    rng.fill(&mut big[..]);
    big[0] = 0;
    big[1] = 0xff;
    vec![
        Vec::new(),
        vec![0],
        (0..=255u8).collect(),
        vec![0xff; 1000],
        b"\0\0\xff\xfe".to_vec(),
        b"'; DROP TABLE jobs; --".to_vec(),
        big,
    ]
}

async fn odd_keys_and_payloads_round_trip<S: TestStore>() {
    let s = fresh::<S>().await;
    let q = QueueName::new(format!("q'; DROP TABLE jobs; -- {}", common::unique("🦀"))).unwrap();
    let a = owner("a'\"; --");
    let keys = odd_keys();
    let payloads = odd_payloads();
    let jobs: Vec<(JobKey, Vec<u8>)> =
        keys.iter().enumerate().map(|(i, k)| (k.clone(), payloads[i % payloads.len()].clone())).collect();
    assert_eq!(s.enqueue_many(&q, &jobs).await.unwrap(), u64::try_from(jobs.len()).unwrap());
    let want: HashMap<&JobKey, &Vec<u8>> = jobs.iter().map(|(k, p)| (k, p)).collect();

    let got = s.claim_next(&q, &a, lease(30), 1000).await.unwrap();
    assert_eq!(got.len(), jobs.len());
    for j in &got {
        let p = want.get(&j.lease.key).unwrap_or_else(|| panic!("unknown key {:?} came back", j.lease.key));
        assert_eq!(&j.payload, *p, "payload of {:?} byte for byte", j.lease.key);
        let result: Vec<u8> = p.iter().rev().copied().chain([0, 0xff]).collect();
        s.complete(&j.lease, &result).await.unwrap();
        let r = job(&s, &q, &j.lease.key).await;
        assert_eq!(r.key.as_str().as_bytes(), j.lease.key.as_str().as_bytes());
        assert_eq!(r.payload.as_deref(), Some(&p[..]));
        assert_eq!(r.result, Some(result));
        assert_eq!(r.owner.as_deref(), Some(a.as_str()));
    }

    // The broker path: claim by key, checkpoint and fail with odd bytes.
    let q2 = QueueName::new("\\ ]] $1 ?1".to_owned() + &common::unique("")).unwrap();
    let out = s.claim_batch(&q2, &keys, &a, lease(30)).await.unwrap();
    for (k, c) in keys.iter().zip(out) {
        let l = claimed(c);
        assert_eq!(&l.key, k);
        s.checkpoint(&l, k.as_str().as_bytes()).await.unwrap();
        s.fail(&l, k.as_str(), false, &RetryPolicy::default()).await.unwrap();
        let r = job(&s, &q2, k).await;
        assert_eq!(r.progress.as_deref(), Some(k.as_str().as_bytes()));
        assert_eq!(r.last_error.as_deref(), Some(k.as_str()));
        assert_eq!(r.state, JobState::Dead);
    }
    // Keys differing only in case or trailing space are different jobs.
    for k in ["Case", "case", "case "] {
        assert!(s.enqueue(&q2, &key(k), k.as_bytes()).await.unwrap(), "{k:?} is a new job");
    }
}

// ---------------------------------------------------------------------------------------------
// ledger

async fn ledger_newest_wins<S: TestStore>() {
    let s = fresh::<S>().await;
    let l = s.ledger("receiver-a");
    assert_eq!(l.newest("j").await.unwrap(), None);
    assert_eq!(l.accept("j", 2).await.unwrap(), Verdict::Accepted { newest: 2 });
    assert_eq!(l.accept("j", 2).await.unwrap(), Verdict::Accepted { newest: 2 }, "equal = a retry");
    assert_eq!(l.accept("j", 5).await.unwrap(), Verdict::Accepted { newest: 5 });
    assert_eq!(l.accept("j", 3).await.unwrap(), Verdict::Stale { newest: 5 });
    assert_eq!(l.accept("j", 1).await.unwrap(), Verdict::Stale { newest: 5 });
    assert_eq!(l.newest("j").await.unwrap(), Some(5), "a refusal lowers nothing");
    assert_eq!(l.newest("other").await.unwrap(), None);
    assert_eq!(
        s.ledger("receiver-b").accept("j", 1).await.unwrap(),
        Verdict::Accepted { newest: 1 },
        "scopes are separate"
    );
    let odd = "'; DROP TABLE ledger; -- 🦀";
    assert_eq!(l.accept(odd, 9).await.unwrap(), Verdict::Accepted { newest: 9 });
    assert_eq!(l.newest(odd).await.unwrap(), Some(9));
    for (job, epoch) in [("j", 0), ("j", -1), ("", 1), ("a\0b", 1)] {
        assert!(
            matches!(l.accept(job, epoch).await, Err(FenceError::InvalidInput { .. })),
            "accept({job:?}, {epoch}) is InvalidInput"
        );
    }
    // The ledger's job id has room for a wire ledger id (escaped queue + '/' + key), no more.
    let longest = "x".repeat(brokerfence::ledger::MAX_LEDGER_JOB_BYTES);
    assert_eq!(l.accept(&longest, 1).await.unwrap(), Verdict::Accepted { newest: 1 });
    let long = "x".repeat(brokerfence::ledger::MAX_LEDGER_JOB_BYTES + 1);
    assert!(matches!(l.accept(&long, 1).await, Err(FenceError::InvalidInput { .. })));

    // accept_in: the verdict and the receiver's own rows commit or roll back together.
    assert_eq!(s.ledger_accept_in("receiver-a", "j", 6, "rolled-back-6", false).await, Verdict::Accepted { newest: 6 });
    assert_eq!(l.newest("j").await.unwrap(), Some(5), "rolled back with the transaction");
    assert_eq!(s.ledger_accept_in("receiver-a", "j", 7, "committed-7", true).await, Verdict::Accepted { newest: 7 });
    assert_eq!(s.ledger_accept_in("receiver-a", "j", 4, "stale-4", true).await, Verdict::Stale { newest: 7 });
    assert_eq!(l.newest("j").await.unwrap(), Some(7));
    assert_eq!(s.business_rows().await, ["committed-7"]);
}

async fn ledger_concurrent_accepts<S: TestStore>() {
    let s = fresh::<S>().await;
    let jobs = ["c1", "c2", "c3", "c4", "c5"];
    let barrier = Arc::new(tokio::sync::Barrier::new(jobs.len() * 20));
    let mut tasks = Vec::new();
    for job in jobs {
        for epoch in 1..=20i64 {
            let ledger = s.ledger("concurrent");
            let barrier = barrier.clone();
            tasks.push(tokio::spawn(async move {
                barrier.wait().await;
                (job, epoch, ledger.accept(job, epoch).await.unwrap())
            }));
        }
    }
    let mut accepted = 0;
    for t in tasks {
        let (job, epoch, verdict) = t.await.unwrap();
        match verdict {
            Verdict::Accepted { newest } => {
                assert_eq!(newest, epoch, "{job}: an accepted epoch is the newest");
                accepted += 1;
            }
            Verdict::Stale { newest } => assert!(newest > epoch, "{job}: epoch {epoch} refused with newest {newest}"),
            other => panic!("{job}: epoch {epoch} answered {other:?} (no owner was named)"),
        }
        if epoch == 20 {
            assert!(verdict.is_accepted(), "{job}: the highest epoch is always accepted");
        }
    }
    assert!(accepted >= jobs.len());
    for job in jobs {
        assert_eq!(s.ledger("concurrent").newest(job).await.unwrap(), Some(20), "{job}");
    }
}

// ---------------------------------------------------------------------------------------------
// 8 concurrent claimers over 2,000 jobs

const JOBS: usize = 2_000;
const CLAIMERS: usize = 8;
/// Claimers with an index at or above this stall (drop the lease) on some first attempts.
const FIRST_STALLER: usize = 6;

#[derive(Debug, Clone)]
enum Event {
    /// A claim the database granted: epoch, owner and the lease interval [start, until].
    Claimed { key: String, epoch: i64, owner: String, start: i64, until: i64 },
    /// A heartbeat the database confirmed: the lease now lasts until `until`.
    Renewed { key: String, epoch: i64, until: i64 },
    /// A completion the database accepted.
    Completed { key: String, epoch: i64, owner: String },
    /// A write the database refused.
    Fenced { key: String, epoch: i64 },
}

#[derive(Default)]
struct History {
    events: std::sync::Mutex<Vec<Event>>,
    zombies: std::sync::Mutex<Vec<Lease>>,
}

impl History {
    fn push(&self, e: Event) {
        self.events.lock().unwrap().push(e);
    }

    fn claimed(&self, l: &Lease, lease: LeaseDuration) {
        self.push(Event::Claimed {
            key: l.key.as_str().to_owned(),
            epoch: l.epoch,
            owner: l.owner.as_str().to_owned(),
            start: l.lease_until.0 - lease.as_millis_i64(),
            until: l.lease_until.0,
        });
    }
}

/// Heartbeats the leases it keeps, then completes them, recording what the database said.
async fn heartbeat_and_complete<S: FenceStore>(s: &S, h: &History, keep: Vec<Lease>, lease: LeaseDuration) -> usize {
    if keep.is_empty() {
        return 0;
    }
    let hb = s.heartbeat(&keep, lease).await.unwrap();
    for l in &hb.renewed {
        h.push(Event::Renewed { key: l.key.as_str().to_owned(), epoch: l.epoch, until: l.lease_until.0 });
    }
    let mut done = 0;
    for l in hb.renewed {
        let result = format!("{}:{}", l.owner, l.epoch);
        match s.complete(&l, result.as_bytes()).await {
            Ok(()) => {
                h.push(Event::Completed {
                    key: l.key.as_str().to_owned(),
                    epoch: l.epoch,
                    owner: l.owner.as_str().to_owned(),
                });
                done += 1;
            }
            Err(FenceError::Fenced { .. }) => h.push(Event::Fenced { key: l.key.as_str().to_owned(), epoch: l.epoch }),
            Err(e) => panic!("complete: {e}"),
        }
    }
    for l in hb.lost {
        h.push(Event::Fenced { key: l.key.as_str().to_owned(), epoch: l.epoch });
    }
    done
}

/// Should claimer `i` stall on this lease (walk away without completing or heartbeating)?
fn stalls(i: usize, l: &Lease, rng: &mut rand::rngs::StdRng) -> bool {
    i >= FIRST_STALLER && l.epoch == 1 && rng.random_bool(0.25)
}

/// Checks the recorded history: one owner per epoch, epochs 1..=n per key without gaps, a new
/// epoch starts only after every confirmed lease of the previous one ended (so no two owners ever
/// held a job at once), every job completed exactly once by the holder of its last epoch, and the
/// database agrees. Returns the number of takeovers.
async fn check_history<S: FenceStore>(s: &S, q: &QueueName, keys: &[JobKey], h: &History) -> usize {
    let events = h.events.lock().unwrap().clone();
    #[derive(Default)]
    struct PerKey {
        claims: BTreeMap<i64, (String, i64, i64)>,
        until: HashMap<i64, i64>,
        completed: Vec<(i64, String)>,
        fenced: Vec<i64>,
    }
    let mut per: HashMap<String, PerKey> = HashMap::new();
    for e in events {
        match e {
            Event::Claimed { key, epoch, owner, start, until } => {
                let p = per.entry(key.clone()).or_default();
                let prev = p.claims.insert(epoch, (owner.clone(), start, until));
                assert!(prev.is_none(), "{key}: epoch {epoch} granted twice ({prev:?} and {owner})");
                let u = p.until.entry(epoch).or_insert(until);
                *u = (*u).max(until);
            }
            Event::Renewed { key, epoch, until } => {
                let u = per.entry(key).or_default().until.entry(epoch).or_insert(until);
                *u = (*u).max(until);
            }
            Event::Completed { key, epoch, owner } => per.entry(key).or_default().completed.push((epoch, owner)),
            Event::Fenced { key, epoch } => per.entry(key).or_default().fenced.push(epoch),
        }
    }
    assert_eq!(per.len(), keys.len(), "every job was claimed");
    let mut takeovers = 0;
    for (key, p) in &per {
        let epochs: Vec<i64> = p.claims.keys().copied().collect();
        let last = *epochs.last().unwrap();
        assert_eq!(epochs, (1..=last).collect::<Vec<_>>(), "{key}: epochs strictly increase by one per claim");
        takeovers += usize::try_from(last - 1).unwrap();
        for e in 2..=last {
            let prev_until = p.until[&(e - 1)];
            let (_, start, _) = &p.claims[&e];
            assert!(
                prev_until <= *start,
                "{key}: epoch {e} started at {start} while epoch {} was confirmed until {prev_until}",
                e - 1
            );
        }
        assert_eq!(p.completed.len(), 1, "{key}: completed exactly once, got {:?}", p.completed);
        let (epoch, owner) = &p.completed[0];
        assert_eq!(*epoch, last, "{key}: completed by the newest epoch");
        assert_eq!(owner, &p.claims[&last].0, "{key}: completed by the holder of that epoch");
        for f in &p.fenced {
            assert!(*f < last, "{key}: epoch {f} was refused although it is the newest");
        }
    }
    // The database agrees with the history; zombies' late writes change nothing.
    for k in keys {
        let p = &per[k.as_str()];
        let (epoch, owner) = &p.completed[0];
        let r = job(s, q, k).await;
        assert_eq!((r.state, r.epoch), (JobState::Completed, *epoch), "{k}");
        assert_eq!(r.result, Some(format!("{owner}:{epoch}").into_bytes()), "{k}");
    }
    takeovers
}

/// Zombies (stalled holders) wake up after everything was completed: every write is refused.
async fn zombies_wake_up<S: FenceStore>(s: &S, h: &History) -> usize {
    let zombies = h.zombies.lock().unwrap().clone();
    let hb = s.heartbeat(&zombies, lease(3)).await.unwrap();
    assert!(hb.renewed.is_empty(), "a zombie's heartbeat was renewed: {:?}", hb.renewed);
    for z in &zombies {
        let err = s.complete(z, b"zombie").await.unwrap_err();
        match err {
            FenceError::Fenced { current_epoch, .. } => assert!(current_epoch > z.epoch, "{err}"),
            other => panic!("zombie complete: {other}"),
        }
        assert!(s.checkpoint(z, b"zombie").await.unwrap_err().is_fenced());
    }
    zombies.len()
}

async fn eight_claimers_table_queue<S: TestStore>() {
    let s = fresh::<S>().await;
    let q = queue();
    let keys: Vec<JobKey> = (0..JOBS).map(|i| key(&format!("job-{i:05}"))).collect();
    let jobs: Vec<(JobKey, Vec<u8>)> = keys.iter().map(|k| (k.clone(), k.as_str().as_bytes().to_vec())).collect();
    assert_eq!(s.enqueue_many(&q, &jobs).await.unwrap(), JOBS as u64);
    let history = Arc::new(History::default());
    let completed = Arc::new(AtomicUsize::new(0));
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..CLAIMERS {
        let (store, q, h, completed) = (s.reopen().await, q.clone(), history.clone(), completed.clone());
        tasks.push(tokio::spawn(async move {
            let me = Owner::unique(&format!("claimer{i}"));
            let mut rng = rand::rngs::StdRng::seed_from_u64(i as u64);
            let lease = lease(3);
            while completed.load(Ordering::SeqCst) < JOBS {
                let got = store.claim_next(&q, &me, lease, 16).await.unwrap();
                if got.is_empty() {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                let mut keep = Vec::new();
                for j in got {
                    assert_eq!(j.payload, j.lease.key.as_str().as_bytes(), "payload of {}", j.lease.key);
                    h.claimed(&j.lease, lease);
                    if stalls(i, &j.lease, &mut rng) {
                        h.zombies.lock().unwrap().push(j.lease);
                    } else {
                        keep.push(j.lease);
                    }
                }
                let done = heartbeat_and_complete(&store, &h, keep, lease).await;
                completed.fetch_add(done, Ordering::SeqCst);
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let elapsed = t0.elapsed();
    let zombies = zombies_wake_up(&s, &history).await;
    let takeovers = check_history(&s, &q, &keys, &history).await;
    eprintln!(
        "{}: table queue, {JOBS} jobs, {CLAIMERS} claimers: {elapsed:?}, {takeovers} takeovers, {zombies} zombies",
        s.backend().name()
    );
    assert!(takeovers > 0 && zombies > 0, "stalled claimers caused takeovers");
    assert!(s.claim_next(&q, &owner("late"), lease(3), 100).await.unwrap().is_empty());
}

async fn eight_claimers_broker_deliveries<S: TestStore>() {
    let s = fresh::<S>().await;
    let q = queue();
    let keys: Vec<JobKey> = (0..JOBS).map(|i| key(&format!("msg-{i:05}"))).collect();
    let history = Arc::new(History::default());
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for i in 0..CLAIMERS {
        // Every claimer gets every key (duplicate deliveries), in its own order.
        let (store, q, h, mut todo) = (s.reopen().await, q.clone(), history.clone(), keys.clone());
        tasks.push(tokio::spawn(async move {
            let me = Owner::unique(&format!("consumer{i}"));
            let mut rng = rand::rngs::StdRng::seed_from_u64(100 + i as u64);
            let lease = lease(3);
            while !todo.is_empty() {
                todo.shuffle(&mut rng);
                let mut busy = Vec::new();
                for chunk in todo.chunks(10) {
                    let out = store.claim_batch(&q, chunk, &me, lease).await.unwrap();
                    let mut keep = Vec::new();
                    for (k, c) in chunk.iter().zip(out) {
                        match c {
                            Claim::Claimed(l) => {
                                h.claimed(&l, lease);
                                if stalls(i, &l, &mut rng) {
                                    h.zombies.lock().unwrap().push(l);
                                    busy.push(k.clone());
                                } else {
                                    keep.push(l);
                                }
                            }
                            Claim::Done { .. } => {}
                            Claim::Busy { .. } => busy.push(k.clone()),
                            other => panic!("{k}: unexpected {other:?}"),
                        }
                    }
                    heartbeat_and_complete(&store, &h, keep, lease).await;
                }
                if busy.len() == todo.len() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                todo = busy;
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let elapsed = t0.elapsed();
    let zombies = zombies_wake_up(&s, &history).await;
    let takeovers = check_history(&s, &q, &keys, &history).await;
    eprintln!(
        "{}: broker deliveries, {JOBS} keys x {CLAIMERS} consumers: {elapsed:?}, {takeovers} takeovers, {zombies} zombies",
        s.backend().name()
    );
    assert!(takeovers > 0 && zombies > 0, "stalled consumers caused takeovers");
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL only: one statement per batch claim, session time zone, a worker with a skewed clock

mod pg_only {
    use super::*;
    use sqlx::AssertSqlSafe;

    /// Guard: the fence's connections keep index plans ([`PgFence::pool_options`] runs
    /// `PG_SESSION_SETUP`). A connection keeps, after five runs, a generic plan of each prepared
    /// statement; made for the table as it was (here ten rows, freshly analyzed) it would make
    /// every lookup a sequential scan. The table then grows by 20,000 rows before the next
    /// `ANALYZE`, and one more round of every fence statement (batch and single claims,
    /// heartbeat, batch and single commits, checkpoint, fail, release, enqueue, `claim_next`, the
    /// ledger) must read about as many rows as it touches, not the table: with no setup, or with
    /// generic plans but no index-only settings, it read 1,006,059. And the plans must be kept,
    /// not made anew on every call (what the setup did before, at 0.27 ms of planning for a
    /// claim of ten keys).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn statements_read_rows_by_key_whatever_the_table_was_when_planned() {
        // One connection, so that one backend's plans and statistics are the ones measured.
        let pool = PgFence::pool_options().max_connections(1).connect(&common::database_url()).await.unwrap();
        let s = PgFence::new(pool).schema(common::unique_schema());
        s.migrate().await.unwrap();
        // No autovacuum ANALYZE may replace the plans midway (that would hide the fault).
        for table in ["jobs", "ledger"] {
            sqlx::query(AssertSqlSafe(format!(
                "ALTER TABLE {}.{table} SET (autovacuum_enabled = false)",
                s.get_schema().as_str()
            )))
            .execute(s.pool())
            .await
            .unwrap();
        }
        let ledger = brokerfence::ledger::PgLedger::new(&s, "planned");
        let (q, w) = (queue(), owner("w"));
        let retry = policy(5, Duration::from_secs(60));
        let round = |tag: String| {
            let (s, ledger, retry) = (&s, &ledger, &retry);
            let (q, w) = (&q, &w);
            async move {
                let keys: Vec<JobKey> = (0..10).map(|i| key(&format!("{tag}-{i}"))).collect();
                let leases: Vec<Lease> =
                    s.claim_batch(q, &keys, w, lease(30)).await.unwrap().into_iter().map(claimed).collect();
                let hb = s.heartbeat(&leases, lease(30)).await.unwrap();
                assert_eq!(hb.renewed.len(), 10);
                let items: Vec<(Lease, Vec<u8>)> = leases.into_iter().map(|l| (l, b"r".to_vec())).collect();
                assert!(s.complete_batch(&items).await.unwrap().iter().all(Result::is_ok));
                let single = claimed(s.claim(q, &key(&format!("{tag}-single")), w, lease(30)).await.unwrap());
                s.checkpoint(&single, b"half").await.unwrap();
                s.complete(&single, b"r").await.unwrap();
                let failing = claimed(s.claim(q, &key(&format!("{tag}-failing")), w, lease(30)).await.unwrap());
                s.fail(&failing, "boom", true, retry).await.unwrap();
                let given_back = claimed(s.claim(q, &key(&format!("{tag}-released")), w, lease(30)).await.unwrap());
                s.release(&given_back).await.unwrap();
                let tq = QueueName::new(format!("tq-{tag}")).unwrap();
                let queued: Vec<(JobKey, Vec<u8>)> =
                    (0..3).map(|i| (key(&format!("{tag}-tq{i}")), Vec::new())).collect();
                s.enqueue_many(&tq, &queued).await.unwrap();
                let next: Vec<(Lease, Vec<u8>)> = s
                    .claim_next(&tq, w, lease(30), 3)
                    .await
                    .unwrap()
                    .into_iter()
                    .map(|j| (j.lease, Vec::new()))
                    .collect();
                assert_eq!(next.len(), 3);
                assert!(s.complete_batch(&next).await.unwrap().iter().all(Result::is_ok));
                for job in [format!("{tag}-a"), format!("{tag}-b")] {
                    assert!(ledger.accept(&job, 2).await.unwrap().is_accepted());
                    assert!(!ledger.accept(&job, 1).await.unwrap().is_accepted());
                }
            }
        };
        round("first".into()).await;
        for table in ["jobs", "ledger"] {
            sqlx::query(AssertSqlSafe(format!("ANALYZE {}.{table}", s.get_schema().as_str())))
                .execute(s.pool())
                .await
                .unwrap();
        }
        for i in 0..6 {
            round(format!("warm{i}")).await;
        }
        let jobs: Vec<(JobKey, Vec<u8>)> = (0..20_000).map(|i| (key(&format!("bulk-{i}")), Vec::new())).collect();
        for chunk in jobs.chunks(5_000) {
            s.enqueue_many(&q, chunk).await.unwrap();
        }
        let before = common::jobs_rows_read(&s).await;
        round("after".into()).await;
        let read = common::jobs_rows_read(&s).await - before;
        assert!(read < 500, "one round of every statement read {read} rows of a 20,000-row table");
        // Every fence statement this connection ran more than five times (each ran 8 or more;
        // the migrations and the setup of this test ran once, the migration record's statements
        // once per migration, left out) runs a kept (generic) plan by now.
        let kept = |pool: sqlx::PgPool| {
            let schema = s.get_schema().as_str().to_owned();
            async move {
                sqlx::query_as::<_, (String, i64, i64)>(
                    "SELECT statement, generic_plans, custom_plans FROM pg_prepared_statements \
                     WHERE statement LIKE '%' || $1 || '.%' AND generic_plans + custom_plans > 5 \
                     AND statement NOT LIKE '%._migrations%'",
                )
                .bind(schema)
                .fetch_all(&pool)
                .await
                .unwrap()
            }
        };
        let mut plans = kept(s.pool().clone()).await;
        // claim, complete_batch, checkpoint, complete, fail, release, enqueue, claim_next, and
        // the ledger's accept and current epoch; the heartbeat runs on its own connection.
        assert_eq!(plans.len(), 10, "fence statements run more than five times: {plans:#?}");
        let heartbeat = kept(s.get_heartbeat_pool().clone()).await;
        assert_eq!(heartbeat.len(), 1, "the heartbeat on its own connection: {heartbeat:#?}");
        plans.extend(heartbeat);
        for (statement, generic, custom) in &plans {
            assert!(*generic > 0, "planned on every call ({custom} custom plans): {statement}");
        }
    }

    /// The collation of each key column of the fence tables, by table and column.
    async fn key_collations(s: &PgFence) -> Vec<(String, String, String)> {
        sqlx::query_as(
            "SELECT c.relname::text, a.attname::text, coalesce(l.collname::text, '') FROM pg_attribute a \
             JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace \
             LEFT JOIN pg_collation l ON l.oid = a.attcollation \
             WHERE n.nspname = $1 AND (c.relname, a.attname) IN (('jobs', 'queue'), ('jobs', 'key'), \
                 ('ledger', 'scope'), ('ledger', 'job')) ORDER BY 1, 2",
        )
        .bind(s.get_schema().as_str().to_owned())
        .fetch_all(s.pool())
        .await
        .unwrap()
    }

    /// Migration 2 on a schema made by migration 1 that holds jobs and ledger entries: the key
    /// columns compare bytes ("C") afterwards, every row and lease is still there, and the fence
    /// still fences. Guard: migration 2 itself (without it the columns keep the database's
    /// collation and the first assertion fails).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn migration_2_gives_an_existing_schema_byte_order_keys_and_keeps_its_rows() {
        let s = common::pg_unmigrated().await;
        s.migrate().await.unwrap();
        let sc = s.get_schema().as_str();
        // Back to what migration 1 alone left: the database's default collation, one row.
        for sql in [
            format!(
                "ALTER TABLE {sc}.jobs ALTER COLUMN queue TYPE text COLLATE \"default\", ALTER COLUMN key TYPE text COLLATE \"default\""
            ),
            format!(
                "ALTER TABLE {sc}.ledger ALTER COLUMN scope TYPE text COLLATE \"default\", ALTER COLUMN job TYPE text COLLATE \"default\""
            ),
            format!("DELETE FROM {sc}._migrations WHERE version = 2"),
        ] {
            sqlx::query(AssertSqlSafe(sql)).execute(s.pool()).await.unwrap();
        }
        assert!(key_collations(&s).await.iter().all(|(_, _, c)| c != "C"));
        let q = queue();
        let (a, b) = (key("upgrade-é-a"), key("upgrade-B"));
        assert!(s.enqueue(&q, &a, b"payload-a").await.unwrap());
        let old = claimed(s.claim(&q, &b, &owner("before"), lease(30)).await.unwrap());
        let ledger = s.ledger("upgrade");
        assert_eq!(ledger.accept("job-1", 7).await.unwrap(), Verdict::Accepted { newest: 7 });

        // A second process with its own pool runs the migration.
        let upgraded = s.reopen().await;
        upgraded.migrate().await.unwrap();
        assert_eq!(upgraded.migration_rows().await, <PgFence as TestStore>::MIGRATIONS);
        let collations = key_collations(&upgraded).await;
        assert_eq!(collations.len(), 4, "{collations:?}");
        assert!(collations.iter().all(|(_, _, c)| c == "C"), "{collations:?}");
        // The rows came through: the pending job is claimable with its payload, the lease taken
        // before the migration commits, and a superseded epoch is still fenced.
        let got = upgraded.claim_next(&q, &owner("after"), lease(30), 10).await.unwrap();
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!((got[0].lease.key.as_str(), got[0].payload.as_slice()), (a.as_str(), b"payload-a".as_slice()));
        upgraded.complete(&old, b"done").await.unwrap();
        assert!(upgraded.complete(&old, b"again").await.is_err_and(|e| e.is_fenced()));
        assert_eq!(job(&upgraded, &q, &b).await.result.as_deref(), Some(b"done".as_slice()));
        let ledger = upgraded.ledger("upgrade");
        assert_eq!(ledger.accept("job-1", 6).await.unwrap(), Verdict::Stale { newest: 7 });
        assert_eq!(ledger.accept("job-1", 7).await.unwrap(), Verdict::Accepted { newest: 7 });
    }

    /// Every row a batch claim touched carries the same transaction id: the claimed rows as
    /// their xmin (inserted or updated by it), the others as the locker in xmax. One statement
    /// in autocommit is one transaction, so the whole batch was one statement.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn claim_batch_is_one_transaction() {
        let s = common::pg().await;
        let q = queue();
        let x = owner("x");
        let held = claimed(s.claim(&q, &key("held"), &x, lease(60)).await.unwrap());
        let done = claimed(s.claim(&q, &key("done"), &x, lease(60)).await.unwrap());
        s.complete(&done, b"r").await.unwrap();
        s.enqueue(&q, &key("pending"), b"p").await.unwrap();
        let keys: Vec<JobKey> = ["new1", "held", "pending", "done", "new2", "new1"].into_iter().map(key).collect();
        let out = s.claim_batch(&q, &keys, &owner("y"), lease(30)).await.unwrap();
        assert!(matches!(out[1], Claim::Busy { epoch: 1, .. }));
        assert_eq!(out[3], Claim::Done { epoch: 1 });
        assert_eq!(out[0], out[5]);
        let rows: Vec<(String, String, String)> = sqlx::query_as(AssertSqlSafe(format!(
            "SELECT key, xmin::text, xmax::text FROM {}.jobs WHERE queue = $1",
            s.get_schema().as_str()
        )))
        .bind(q.as_str().to_owned())
        .fetch_all(s.pool())
        .await
        .unwrap();
        let by_key: HashMap<&str, (&str, &str)> =
            rows.iter().map(|(k, xmin, xmax)| (k.as_str(), (xmin.as_str(), xmax.as_str()))).collect();
        let xid = by_key["new1"].0;
        for k in ["new1", "new2", "pending"] {
            assert_eq!(by_key[k].0, xid, "{k} written by the claim's transaction");
        }
        for k in ["held", "done"] {
            assert_ne!(by_key[k].0, xid, "{k} not rewritten");
            assert_eq!(by_key[k].1, xid, "{k} locked by the claim's transaction");
        }
        assert_eq!(job(&s, &q, &key("held")).await.lease_until, Some(held.lease_until));
    }

    /// The session time zone and date style of the connection change nothing: all lease times are
    /// instants on the database clock.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn session_time_zone_changes_nothing() {
        let normal = common::pg().await;
        // sqlx pins TimeZone=UTC in the startup packet, so set the odd one after connecting.
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    sqlx::Executor::execute(&mut *conn, "SET TIME ZONE 'Pacific/Chatham'; SET DateStyle = 'SQL, DMY'")
                        .await?;
                    Ok(())
                })
            })
            .connect(&common::database_url())
            .await
            .unwrap();
        let tz: String = sqlx::query_scalar("SELECT current_setting('TimeZone')").fetch_one(&pool).await.unwrap();
        assert_eq!(tz, "Pacific/Chatham");
        let odd = PgFence::new(pool).schema(normal.get_schema().clone());
        let q = queue();
        let before = normal.db_now().await.unwrap();
        let l = claimed(odd.claim(&q, &key("tz"), &owner("a"), lease(30)).await.unwrap());
        let after = normal.db_now().await.unwrap();
        assert_within(l.lease_until, before, after, Duration::from_secs(30), "lease_until seen from an odd time zone");
        assert_eq!(normal.job(&q, &key("tz")).await.unwrap().unwrap().lease_until, Some(l.lease_until));
        let odd_now = odd.db_now().await.unwrap();
        let normal_now = normal.db_now().await.unwrap();
        assert!((odd_now.0 - normal_now.0).abs() < 1_000, "{odd_now} vs {normal_now}");
        assert!(matches!(normal.claim(&q, &key("tz"), &owner("b"), lease(30)).await.unwrap(), Claim::Busy { .. }));
    }

    fn field<'a>(m: &'a HashMap<String, String>, k: &str) -> &'a str {
        m.get(k).unwrap_or_else(|| panic!("child reported no {k}: {m:?}"))
    }

    fn num(m: &HashMap<String, String>, k: &str) -> i64 {
        field(m, k).parse().unwrap_or_else(|e| panic!("{k}: {e}"))
    }

    /// Runs `super::skew_child` in a child process whose wall clock is `offset` off (libfaketime).
    async fn run_skewed(
        offset: &str,
        mode: &str,
        schema: &SchemaName,
        q: &QueueName,
        k: &str,
        me: &Owner,
    ) -> HashMap<String, String> {
        let exe = std::env::current_exe().unwrap();
        let out = tokio::process::Command::new("faketime")
            .args(["-m", "-f", offset])
            .arg(&exe)
            .args(["suite::skew_child", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
            .env("DATABASE_URL", common::database_url())
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .env("BROKERFENCE_SKEW_MODE", mode)
            .env("BROKERFENCE_SKEW_SCHEMA", schema.as_str())
            .env("BROKERFENCE_SKEW_QUEUE", q.as_str())
            .env("BROKERFENCE_SKEW_KEY", k)
            .env("BROKERFENCE_SKEW_OWNER", me.as_str())
            .output()
            .await;
        let out = match out {
            Ok(out) => out,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
                "the clock-skew test needs libfaketime: `apt-get install -y faketime` (localstack/up installs it)"
            ),
            Err(e) => panic!("spawn faketime: {e}"),
        };
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "skewed child ({offset}, {mode}) failed:\n{stdout}\n{stderr}");
        let line = stdout
            .lines()
            .find_map(|l| l.split_once("SKEW ").map(|(_, r)| r))
            .unwrap_or_else(|| panic!("skewed child printed no result:\n{stdout}\n{stderr}"));
        line.split_whitespace().filter_map(|kv| kv.split_once('=')).map(|(k, v)| (k.to_owned(), v.to_owned())).collect()
    }

    /// A worker whose wall clock is hours off changes nothing: a worker 5 h behind claims and
    /// renews a 30 s lease that the database judges as 30 s from ITS now; a worker 5 h ahead finds
    /// that lease live (Busy), not expired. Had the fence used the worker's clock, the first lease
    /// would have lapsed 5 h ago (or the second worker would have seen it expired).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn clock_skewed_worker_changes_nothing() {
        let s = common::pg().await;
        let q = queue();
        let k = "skewed";
        let behind = owner("behind");
        let local_before = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
        let db_before = s.db_now().await.unwrap();
        let r = run_skewed("-5h", "claim", s.get_schema(), &q, k, &behind).await;
        let db_after = s.db_now().await.unwrap();
        let skew = num(&r, "local_ms") - i64::try_from(local_before.as_millis()).unwrap();
        assert!((skew + 5 * 3_600_000).abs() < 60_000, "the child's clock really was 5 h behind (skew {skew} ms)");
        assert_eq!(field(&r, "outcome"), "claimed");
        assert_eq!(num(&r, "epoch"), 1);
        assert_within(DbTime(num(&r, "lease_until")), db_before, db_after, SKEW_LEASE, "skewed claim");
        assert!((29_000..=30_000).contains(&num(&r, "ttl_ms")), "ttl {}", num(&r, "ttl_ms"));
        assert_within(DbTime(num(&r, "hb_until")), db_before, db_after, SKEW_LEASE, "skewed heartbeat");
        assert!(num(&r, "hb_until") > num(&r, "lease_until"), "the heartbeat renewed");
        let rec = s.job(&q, &key(k)).await.unwrap().unwrap();
        assert_eq!((rec.state, rec.epoch, rec.owner.as_deref()), (JobState::Running, 1, Some(behind.as_str())));
        assert_eq!(rec.lease_until, Some(DbTime(num(&r, "hb_until"))));

        let ahead = owner("ahead");
        let r = run_skewed("+5h", "contend", s.get_schema(), &q, k, &ahead).await;
        let skew = num(&r, "local_ms") - i64::try_from(local_before.as_millis()).unwrap();
        assert!((skew - 5 * 3_600_000).abs() < 60_000, "the child's clock really was 5 h ahead (skew {skew} ms)");
        assert_eq!(field(&r, "outcome"), "busy", "a worker 5 h ahead must not see the lease as expired");
        assert_eq!(field(&r, "holder"), behind.as_str());
        assert!((0..=30_000).contains(&num(&r, "ttl_ms")));
        let now = s.db_now().await.unwrap();
        assert!(now < rec.lease_until.unwrap(), "the contended claim ran while the lease was live");
        assert_eq!(s.job(&q, &key(k)).await.unwrap().unwrap(), rec, "the skewed worker changed nothing");
    }
}

/// The lease the clock-skewed child processes take.
const SKEW_LEASE: Duration = Duration::from_secs(30);

/// Helper process for `pg_only::clock_skewed_worker_changes_nothing`, which runs this test binary
/// under libfaketime with this test selected. Without its environment it does nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper process: run by pg_only::clock_skewed_worker_changes_nothing under faketime"]
async fn skew_child() {
    let Ok(mode) = std::env::var("BROKERFENCE_SKEW_MODE") else { return };
    let env = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} not set"));
    let s = common::pg_on(SchemaName::new(env("BROKERFENCE_SKEW_SCHEMA")).unwrap()).await;
    let q = QueueName::new(env("BROKERFENCE_SKEW_QUEUE")).unwrap();
    let k = key(&env("BROKERFENCE_SKEW_KEY"));
    let me = Owner::new(env("BROKERFENCE_SKEW_OWNER")).unwrap();
    let local_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis();
    let lease = LeaseDuration::new(SKEW_LEASE).unwrap();
    match (mode.as_str(), s.claim(&q, &k, &me, lease).await.unwrap()) {
        ("claim", Claim::Claimed(l)) => {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let hb = s.heartbeat(std::slice::from_ref(&l), lease).await.unwrap();
            let r = &hb.renewed[0];
            println!(
                "SKEW local_ms={local_ms} outcome=claimed epoch={} lease_until={} ttl_ms={} hb_until={}",
                l.epoch,
                l.lease_until.0,
                l.ttl.as_millis(),
                r.lease_until.0
            );
        }
        ("contend", Claim::Busy { owner, epoch, ttl, .. }) => println!(
            "SKEW local_ms={local_ms} outcome=busy epoch={epoch} ttl_ms={} holder={}",
            ttl.as_millis(),
            owner.unwrap_or_default()
        ),
        (_, other) => println!("SKEW local_ms={local_ms} outcome=unexpected detail={other:?}"),
    }
}

/// Guard: the owner+epoch compare-and-set of the batched completion. In one statement, the
/// leases still held commit and the superseded ones are refused one by one, changing nothing.
async fn complete_batch_commits_each_lease_or_fences_it<S: TestStore>() {
    let s = fresh::<S>().await;
    let q = queue();
    let (a, b) = (owner("a"), owner("b"));
    let jobs: Vec<(JobKey, Vec<u8>)> = (0..10).map(|i| (key(&format!("k{i}")), vec![i as u8])).collect();
    s.enqueue_many(&q, &jobs).await.unwrap();
    let claimed = s.claim_next(&q, &a, lease(30), 10).await.unwrap();
    assert_eq!(claimed.len(), 10);
    // Three of A's jobs are handed back and taken by B (epoch 2): A's leases on them are stale.
    let stolen: Vec<&str> = vec!["k1", "k4", "k7"];
    for c in claimed.iter().filter(|c| stolen.contains(&c.lease.key.as_str())) {
        s.release(&c.lease).await.unwrap();
    }
    let by_b = s.claim_next(&q, &b, lease(30), 10).await.unwrap();
    assert_eq!(by_b.len(), 3);
    let items: Vec<(Lease, Vec<u8>)> = claimed.iter().map(|c| (c.lease.clone(), b"a-result".to_vec())).collect();
    let answers = s.complete_batch(&items).await.unwrap();
    assert_eq!(answers.len(), 10);
    for (c, answer) in claimed.iter().zip(&answers) {
        let row = s.job(&q, &c.lease.key).await.unwrap().unwrap();
        if stolen.contains(&c.lease.key.as_str()) {
            match answer {
                Err(FenceError::Fenced { epoch, current_epoch, current_owner, .. }) => {
                    assert_eq!((*epoch, *current_epoch), (1, 2));
                    assert_eq!(current_owner.as_deref(), Some(b.as_str()));
                }
                other => panic!("stale lease on {} was not fenced: {other:?}", c.lease.key),
            }
            assert_eq!(row.state, JobState::Running);
            assert_eq!(row.owner.as_deref(), Some(b.as_str()));
            assert_eq!(row.result, None);
        } else {
            assert!(answer.is_ok(), "{answer:?}");
            assert_eq!(row.state, JobState::Completed);
            assert_eq!(row.result.as_deref(), Some(&b"a-result"[..]));
        }
    }
    // The same lease and result sent again (twice in one batch): its own commit, answered as
    // committed (a commit is sent again when its answer was lost to a failover); the same lease
    // with another result is fenced, and nothing changes.
    let again = s.complete_batch(&[items[0].clone(), items[0].clone()]).await.unwrap();
    assert!(again.iter().all(Result::is_ok), "{again:?}");
    let other = (items[0].0.clone(), b"another result".to_vec());
    let refused = s.complete_batch(&[other.clone(), other]).await.unwrap();
    assert!(refused.iter().all(|r| matches!(r, Err(FenceError::Fenced { .. }))), "{refused:?}");
    let row = s.job(&items[0].0.queue, &items[0].0.key).await.unwrap().unwrap();
    assert_eq!(row.result.as_deref(), Some(&b"a-result"[..]));
}
