//! Replays paths of the model against the real `PgFence` (all guards on): every store step of the
//! path (`claim_next`, `claim_batch`, `heartbeat`, `complete`, `fail`, `release`) becomes the real
//! call, and the real answer and the job row after it must equal the model's.
//!
//! Time: a model tick is ten seconds of the database clock. The database clock cannot be moved,
//! so a `Tick` moves the job's stored times instead (`lease_until` and `run_at` ten seconds back,
//! in this test's own schema): every statement compares those with `clock_timestamp()` only, so
//! that is the same as ten seconds passing for this job. Leases are 35 s (3 ticks and a half: a
//! lease with 0 ticks left on the model's clock has 5 s left on the real one) and the backoff
//! 5 s (due after one tick), so the real time a replay takes (milliseconds per step) never
//! crosses a boundary the model's tick does not; each path asserts it stays under 4 s between
//! two ticks.
//!
//! Paths: the counterexamples of the negative controls (the real store must refuse the step the
//! broken model allowed: its answer is the correct model's, taken in the broken model's state)
//! and random walks of the correct model (seeded).

use std::time::{Duration, Instant};

use brokerfence_model::{Action, Answer, Bounds, Guards, JobState, ProtocolModel, Row, SAFETY, Source};
use fence::{
    Claim, FailOutcome, FenceStore, JobKey, Lease, LeaseDuration, Owner, PgFence, QueueName, RetryPolicy, SchemaName,
};
use rand::{Rng, SeedableRng};
use sqlx::AssertSqlSafe;

/// Real time allowed between two ticks of a replay (the half-tick margin is 5 s).
const MAX_DRIFT: Duration = Duration::from_secs(4);

fn lease() -> LeaseDuration {
    LeaseDuration::new(Duration::from_secs(35)).expect("lease of 35 s")
}

fn policy(model: &ProtocolModel) -> RetryPolicy {
    RetryPolicy {
        max_attempts: i64::from(model.bounds.max_attempts),
        base_backoff: Duration::from_secs(5),
        max_backoff: Duration::from_secs(5),
    }
}

async fn store(model: &ProtocolModel) -> PgFence {
    let url = brokerfence_testkit::services::var("DATABASE_URL")
        .expect("DATABASE_URL is not set and localstack/.env has none: run `localstack/up` first");
    let schema = SchemaName::new(format!("t_{:016x}", rand::random::<u64>())).expect("schema name");
    let fence = PgFence::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to PostgreSQL at {url}: {e}"))
        .schema(schema)
        .max_claims(i64::from(model.bounds.max_claims));
    fence.migrate().await.expect("migrate");
    fence
}

/// One replay: a queue of its own on `fence`, the real lease of each worker.
struct Replay<'a> {
    fence: &'a PgFence,
    model: ProtocolModel,
    queue: QueueName,
    key: JobKey,
    owners: Vec<Owner>,
    leases: Vec<Option<Lease>>,
    last_tick: Instant,
}

impl<'a> Replay<'a> {
    async fn new(fence: &'a PgFence, model: ProtocolModel, name: &str) -> Replay<'a> {
        let queue = QueueName::new(format!("{name}-{:08x}", rand::random::<u32>())).expect("queue");
        let key = JobKey::new("job").expect("key");
        if model.source == Source::Table {
            assert!(fence.enqueue(&queue, &key, b"payload").await.expect("enqueue"));
        }
        let owners = (0..model.bounds.workers).map(|w| Owner::new(format!("w{w}")).expect("owner")).collect();
        Replay {
            fence,
            model,
            queue,
            key,
            owners,
            leases: vec![None; usize::from(model.bounds.workers)],
            last_tick: Instant::now(),
        }
    }

    fn lease_of(&self, w: u8) -> &Lease {
        self.leases[usize::from(w)].as_ref().expect("the model gives this step to a worker holding a lease")
    }

    /// The real answer to store step `a` (None for a step that calls no store).
    async fn step(&mut self, a: Action) -> Option<Answer> {
        let f = self.fence;
        Some(match a {
            Action::Tick => {
                let s = f.get_schema().as_str();
                sqlx::query(AssertSqlSafe(format!(
                    "UPDATE {s}.jobs SET lease_until = lease_until - interval '10 seconds', \
                     run_at = run_at - interval '10 seconds' WHERE queue = $1"
                )))
                .bind(self.queue.as_str().to_owned())
                .execute(f.pool())
                .await
                .expect("move the job's times one tick back");
                assert!(self.last_tick.elapsed() < MAX_DRIFT, "replay too slow for its time mapping");
                self.last_tick = Instant::now();
                return None;
            }
            Action::ClaimNext(w) => {
                let mut got =
                    f.claim_next(&self.queue, &self.owners[usize::from(w)], lease(), 1).await.expect("claim_next");
                match got.pop() {
                    Some(job) => {
                        let epoch = job.lease.epoch;
                        self.leases[usize::from(w)] = Some(job.lease);
                        Answer::Claimed { epoch: epoch as u8 }
                    }
                    None => Answer::Nothing,
                }
            }
            Action::ClaimBatch(w) => {
                let claim =
                    f.claim(&self.queue, &self.key, &self.owners[usize::from(w)], lease()).await.expect("claim_batch");
                match claim {
                    Claim::Claimed(l) => {
                        let epoch = l.epoch as u8;
                        self.leases[usize::from(w)] = Some(l);
                        Answer::Claimed { epoch }
                    }
                    Claim::Busy { ttl, .. } => Answer::Busy { ttl: ttl.as_secs() as i8 },
                    Claim::Done { .. } => Answer::Done,
                    Claim::Dead { .. } => Answer::Dead,
                    Claim::Backoff { .. } => Answer::Backoff { retry_in: 1 },
                    other => panic!("a claim the model does not know: {other:?}"),
                }
            }
            Action::Heartbeat(w) => {
                let hb = f.heartbeat(std::slice::from_ref(self.lease_of(w)), lease()).await.expect("heartbeat");
                if hb.renewed.len() == 1 { Answer::Renewed } else { Answer::Lost }
            }
            Action::Complete(w) => match f.complete(self.lease_of(w), b"result").await {
                Ok(()) => Answer::Ok,
                Err(e) if e.is_fenced() => Answer::Fenced,
                Err(e) => panic!("complete: {e}"),
            },
            Action::Fail(w) => match f.fail(self.lease_of(w), "handler error", true, &policy(&self.model)).await {
                Ok(FailOutcome::Retry { .. }) => Answer::Retry { retry_in: self.model.bounds.backoff },
                Ok(FailOutcome::Dead) => Answer::Dead,
                Ok(other) => panic!("a fail outcome the model does not know: {other:?}"),
                Err(e) if e.is_fenced() => Answer::Fenced,
                Err(e) => panic!("fail: {e}"),
            },
            Action::Release(w) => match f.release(self.lease_of(w)).await {
                Ok(()) => Answer::Ok,
                Err(e) if e.is_fenced() => Answer::Fenced,
                Err(e) => panic!("release: {e}"),
            },
            _ => return None,
        })
    }

    /// The real row, in the model's terms (state, epoch, owner, attempts, failures).
    async fn row(&self) -> Option<(JobState, u8, Option<u8>, u8, u8)> {
        let job = self.fence.job(&self.queue, &self.key).await.expect("job")?;
        let state = match job.state {
            fence::JobState::Pending => JobState::Pending,
            fence::JobState::Running => JobState::Running,
            fence::JobState::Completed => JobState::Completed,
            fence::JobState::Failed => JobState::Failed,
            fence::JobState::Dead => JobState::Dead,
            other => panic!("a state the model does not know: {other:?}"),
        };
        let owner = job.owner.map(|o| self.owners.iter().position(|x| x.as_str() == o).expect("a known owner") as u8);
        Some((state, job.epoch as u8, owner, job.attempts as u8, job.failures as u8))
    }
}

fn model_row(r: Option<Row>) -> Option<(JobState, u8, Option<u8>, u8, u8)> {
    r.map(|r| (r.state, r.epoch, r.owner, r.attempts, r.failures))
}

/// Answers compared by kind and epoch (the time left of a Busy or Backoff answer is a hint).
fn same(model: Answer, real: Answer) -> bool {
    match (model, real) {
        (Answer::Busy { .. }, Answer::Busy { .. }) | (Answer::Backoff { .. }, Answer::Backoff { .. }) => true,
        // claim_next leaves a job it buried (max_claims) out of its answer.
        (Answer::Dead, Answer::Nothing) => true,
        (m, r) => m == r,
    }
}

/// Replays `path` of `broken` (a model with a guard off, or the correct one) against the real
/// store. Each store step's real answer must be the correct model's answer in the broken model's
/// state. Returns the step at which the broken model's answer differed (the real store refused
/// what the broken model allowed), where the replay stops; None when it never did.
async fn replay(
    fence: &PgFence,
    broken: ProtocolModel,
    path: &[Action],
    name: &str,
    tally: &mut std::collections::BTreeMap<String, usize>,
) -> Option<(usize, Action, Answer, Answer)> {
    let correct = broken.guards(Guards::default());
    let states = broken.states_along(path).expect("a path of the model");
    let mut r = Replay::new(fence, broken, name).await;
    let mut stores = 0;
    for (i, &a) in path.iter().enumerate() {
        let before = &states[i];
        let expected = correct.store_step(before, a);
        let allowed = broken.store_step(before, a);
        let real = r.step(a).await;
        match (expected, real) {
            (None, None) => {}
            (Some((row, want)), Some(got)) => {
                stores += 1;
                let kind = match got {
                    Answer::Claimed { epoch } if epoch > 1 => "Claimed (takeover or retry)".to_owned(),
                    other => format!("{other:?}").split([' ', '{']).next().unwrap_or_default().to_owned(),
                };
                *tally.entry(kind).or_default() += 1;
                assert!(same(want, got), "{name}: step {} {a}: the model answers {want:?}, PgFence {got:?}", i + 1);
                let real_row = r.row().await;
                assert_eq!(model_row(row), real_row, "{name}: step {} {a}: the row differs", i + 1);
                if let Some((_, broken_answer)) = allowed
                    && !same(broken_answer, want)
                {
                    return Some((i + 1, a, broken_answer, got));
                }
            }
            (e, g) => panic!("{name}: step {} {a}: model {e:?}, store {g:?}", i + 1),
        }
    }
    assert!(stores > 0 || path.is_empty(), "{name}: a path without a store step checks nothing");
    None
}

/// The negative controls' counterexamples: the real store refuses the step each store guard
/// protects, and replays the store part of the others (their guard is not the store's) exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_replay_negative_controls_against_pgfence() {
    let cases: [(&str, Source, Guards, &str, bool); 7] = [
        ("no-epoch-increment", Source::Table, Guards { epoch_increment: false, ..Guards::default() }, SAFETY[1], true),
        ("no-commit-cas", Source::Table, Guards { commit_cas: false, ..Guards::default() }, SAFETY[0], true),
        ("unfenced-heartbeat", Source::Table, Guards { heartbeat_cas: false, ..Guards::default() }, SAFETY[3], true),
        ("no-cancel-on-loss", Source::Table, Guards { cancel_on_loss: false, ..Guards::default() }, SAFETY[3], false),
        ("no-ledger", Source::Table, Guards { receiver_ledger: false, ..Guards::default() }, SAFETY[1], false),
        ("sqs-delete-first", Source::Sqs, Guards { ack_after_commit: false, ..Guards::default() }, SAFETY[2], false),
        ("xack-first", Source::RedisStream, Guards { ack_after_commit: false, ..Guards::default() }, SAFETY[2], false),
    ];
    let fence = store(&ProtocolModel::new(Source::Table, 2)).await;
    for (name, source, guards, property, store_guard) in cases {
        let broken = ProtocolModel::new(source, 2).guards(guards);
        let fence = fence.clone().max_claims(i64::from(broken.bounds.max_claims));
        let report = broken.check_safety(1);
        let path = report.counterexamples.get(property).unwrap_or_else(|| panic!("{name}: no counterexample"));
        let refused = replay(&fence, broken, path, name, &mut Default::default()).await;
        match refused {
            Some((i, a, allowed, real)) => {
                println!(
                    "{name}: PgFence refuses step {i} of {} ({a}): the broken model answers {allowed:?}, PgFence {real:?}",
                    path.len()
                );
                assert!(store_guard, "{name}: the store's answers differ, but this guard is not the store's");
            }
            None => {
                println!(
                    "{name}: the store part of the {}-step counterexample replays with the same answers",
                    path.len()
                );
                assert!(!store_guard, "{name}: the real store allowed every step the broken model allowed");
            }
        }
    }
}

/// A random walk of the correct model: `len` steps, each chosen uniformly among the enabled ones.
fn random_path(model: &ProtocolModel, seed: u64, len: usize) -> Vec<Action> {
    use stateright::Model;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut s = model.init_states().remove(0);
    let mut path = Vec::new();
    let mut actions = Vec::new();
    while path.len() < len {
        model.actions(&s, &mut actions);
        let next: Vec<_> = actions.drain(..).filter_map(|a| model.next_state(&s, a).map(|n| (a, n))).collect();
        if next.is_empty() {
            break;
        }
        // A tick one step in four (leases run out and others take over), else any enabled step.
        let tick = next.iter().position(|(a, _)| *a == Action::Tick).filter(|_| rng.random_ratio(1, 4));
        let (a, n) = next[tick.unwrap_or_else(|| rng.random_range(0..next.len()))].clone();
        path.push(a);
        s = n;
    }
    path
}

async fn random_paths(source: Source, paths: u64, len: usize) {
    // A walk needs no small bound: more pauses make more zombies.
    let model = ProtocolModel::new(source, 2);
    let model = model.with_bounds(Bounds { pauses: 4, ..model.bounds });
    let fence = store(&model).await;
    let mut steps = 0;
    let mut tally = std::collections::BTreeMap::new();
    for seed in 0..paths {
        let path = random_path(&model, seed, len);
        steps += path.len();
        let name = format!("{source:?}-seed-{seed}");
        assert_eq!(replay(&fence, model, &path, &name, &mut tally).await, None);
    }
    println!(
        "{source:?}: {paths} random paths of the correct model ({steps} steps) replayed on PgFence with the same \
         answers and rows; store answers: {tally:?}"
    );
    // The walks reach the answers that matter: takeovers, refused writes, lost leases.
    let busy = if source == Source::Table { None } else { Some("Busy") }; // claim_next never answers Busy
    for kind in ["Claimed (takeover or retry)", "Renewed", "Ok"].into_iter().chain(busy) {
        assert!(tally.contains_key(kind), "{source:?}: no {kind} answer in {paths} random paths: {tally:?}");
    }
    let refused = tally.get("Fenced").unwrap_or(&0) + tally.get("Lost").unwrap_or(&0);
    assert!(refused > 0, "{source:?}: no superseded lease was refused in {paths} random paths: {tally:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_replay_random_paths_table_queue() {
    random_paths(Source::Table, 50, 50).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_replay_random_paths_sqs() {
    random_paths(Source::Sqs, 50, 50).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_replay_random_paths_redis_stream() {
    random_paths(Source::RedisStream, 50, 50).await;
}
