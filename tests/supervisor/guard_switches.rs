//! Each safety guard, switched off one at a time (feature `guard-switches`, test-only): the same
//! scenario that passes with every guard on must show the violation that guard prevents. If a
//! guard were removed from the code, its "guard on" half would fail — so the suite notices.
//!
//! | guard                                   | scenario                    | violation seen when off |
//! |-----------------------------------------|-----------------------------|-------------------------|
//! | epoch increment on claim                | table, new owner first      | both owners hold epoch 1; the zombie's late call is accepted |
//! | owner+epoch CAS on complete             | table, zombie first         | the zombie's result overwrites the new owner's |
//! | owner+epoch CAS on checkpoint/fail/release | stale lease after takeover | progress/state of the new owner's job changed |
//! | fenced heartbeat                        | late heartbeat              | the zombie's heartbeat extends the new owner's lease |
//! | cancel-on-loss                          | resumed zombie              | the zombie keeps calling the receiver after SIGCONT |
//! | receiver epoch check                    | table, new owner first      | the receiver accepts epoch 1 after epoch 2 |
//!
//! Two more guards (issue 13) have their switch tests next to their scenarios:
//! `effects_guard_switch_fenced_tx_rollback_off_lets_the_zombies_rows_commit` (a fenced
//! `complete_in` no longer stops the caller's transaction from committing, `tests/effects/own_tx.rs`)
//! and `effects_guard_receiver_ledger_lock` (the atomic receiver checks the ledger outside the
//! handler's transaction, and a slow older effect lands last, `tests/effects/receiver.rs`).
//!
//! Needs PostgreSQL (`localstack/up`); runs on SQLite too. Scenarios run concurrently.
#![cfg(feature = "http")]

use std::time::Duration;

use crate::zombie_support::*;
use brokerfence::{FenceError, JobKey, JobRecord, JobState, Owner, QueueName, RetryPolicy};
use fence::Guards;
use futures::future::join_all;

const BACKENDS: [Backend; 2] = [Backend::Postgres, Backend::Sqlite];

fn last_call(run: &TableRun) -> (i64, u16) {
    run.receiver_calls.last().copied().unwrap_or_default()
}

/// Guard: the claim increments the epoch (PostgreSQL and SQLite). With it off, the receiver's
/// ledger is switched to "an equal epoch is a retry, whoever sends it" as well: its owner check
/// would otherwise refuse the zombie's call as a conflict (`guard_ledger_owner_check`).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn guard_epoch_increment_on_claim() {
    let off = || Switches {
        zombie: vec!["no-epoch-increment"],
        new_owner: Guards::default().without_epoch_increment(),
        receiver: Guards::default().without_ledger_owner_check(),
    };
    let runs = join_all(BACKENDS.into_iter().flat_map(|b| {
        [table_run(b, Order::NewOwnerFirst, Switches::default()), table_run(b, Order::NewOwnerFirst, off())]
    }))
    .await;
    for pair in runs.chunks(2) {
        let (on, off) = (&pair[0], &pair[1]);
        println!(
            "epoch increment ON : epochs {} -> {}, receiver {:?}",
            on.zombie_epoch, on.new_epoch, on.receiver_calls
        );
        println!(
            "epoch increment OFF: epochs {} -> {}, receiver {:?}",
            off.zombie_epoch, off.new_epoch, off.receiver_calls
        );
        assert_eq!((on.zombie_epoch, on.new_epoch), (1, 2), "guard on\n{}", on.timeline);
        assert_eq!(last_call(on), (1, 409), "guard on: zombie's late call refused\n{}", on.timeline);
        // Violation: two owners under the same epoch, so the receiver cannot tell them apart.
        assert_eq!(
            (off.zombie_epoch, off.new_epoch),
            (1, 1),
            "guard off: the takeover reused the epoch\n{}",
            off.timeline
        );
        assert_eq!(last_call(off), (1, 200), "guard off: zombie's late call accepted\n{}", off.timeline);
    }
}

/// Guard: the receiver ledger refuses an equal epoch from another owner (PostgreSQL and
/// SQLite). The takeover reuses the zombie's epoch (the claim guard switched off, as a token
/// handed out twice by two promoted servers would): with the owner check the zombie's late call
/// is refused (409, `epoch_conflict`); without it, accepted as "the same attempt retrying".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn guard_ledger_owner_check() {
    let reused = |receiver: Guards| Switches {
        zombie: vec!["no-epoch-increment"],
        new_owner: Guards::default().without_epoch_increment(),
        receiver,
    };
    let runs = join_all(BACKENDS.into_iter().flat_map(|b| {
        [
            table_run(b, Order::NewOwnerFirst, reused(Guards::default())),
            table_run(b, Order::NewOwnerFirst, reused(Guards::default().without_ledger_owner_check())),
        ]
    }))
    .await;
    for pair in runs.chunks(2) {
        let (on, off) = (&pair[0], &pair[1]);
        println!("owner check ON : receiver {:?}", on.receiver_calls);
        println!("owner check OFF: receiver {:?}", off.receiver_calls);
        assert_eq!((on.zombie_epoch, on.new_epoch), (1, 1), "one epoch, two owners\n{}", on.timeline);
        assert_eq!(last_call(on), (1, 409), "guard on: the second owner of epoch 1 refused\n{}", on.timeline);
        assert_eq!(on.effect.as_ref().map(|(e, _)| *e), Some(1), "{}", on.timeline);
        assert_eq!(last_call(off), (1, 200), "guard off: the second owner of epoch 1 accepted\n{}", off.timeline);
    }
}

/// Guard: owner+epoch compare-and-set on complete (two processes, PostgreSQL and SQLite).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn guard_commit_cas_on_complete() {
    let off = || Switches { zombie: vec!["no-commit-cas"], ..Switches::default() };
    let runs = join_all(BACKENDS.into_iter().flat_map(|b| {
        [table_run(b, Order::ZombieFirst, Switches::default()), table_run(b, Order::ZombieFirst, off())]
    }))
    .await;
    for pair in runs.chunks(2) {
        let (on, off) = (&pair[0], &pair[1]);
        let result = |r: &TableRun| String::from_utf8_lossy(r.job.result.as_deref().unwrap_or_default()).into_owned();
        println!("commit CAS ON : zombie {}, final result {:?}", on.zombie_outcome, result(on));
        println!("commit CAS OFF: zombie {}, final result {:?}", off.zombie_outcome, result(off));
        assert!(on.zombie_outcome.starts_with("outcome=fenced"), "guard on\n{}", on.timeline);
        assert_eq!(result(on), NEW_OWNER_RESULT);
        // Violation: the superseded owner's commit goes through and overwrites the new owner's result.
        assert_eq!(off.zombie_outcome, "outcome=completed", "guard off\n{}", off.timeline);
        assert_eq!(result(off), "result of zombie", "guard off\n{}", off.timeline);
    }
}

/// A superseded lease's checkpoint, fail and release, right after a takeover.
async fn stale_writes(backend: Backend, guards: Guards) -> (Vec<(&'static str, bool)>, JobRecord, JobRecord) {
    let db = Db::new(backend).await;
    let zombie_store = db.fence(guards).await.store();
    let new_store = db.admin.store();
    let (q, k) = (QueueName::new(QUEUE).expect("queue"), JobKey::new(KEY).expect("key"));
    let old = zombie_store.claim(&q, &k, &Owner::new("zombie").expect("owner"), lease()).await.expect("claim");
    let old = old.lease().cloned().expect("claimed");
    // No heartbeat: the lease simply runs out, as it would for a stopped process.
    take_over(&new_store, &Owner::new(NEW_OWNER).expect("owner"), Duration::from_secs(10)).await;
    let before = db.job().await;
    let fenced = |r: Result<(), FenceError>| match r {
        Ok(()) => true,
        Err(e) if e.is_fenced() => false,
        Err(e) => panic!("unexpected error {e}"),
    };
    let ops = vec![
        ("checkpoint", fenced(zombie_store.checkpoint(&old, b"zombie progress").await)),
        ("fail", fenced(zombie_store.fail(&old, "zombie failure", true, &RetryPolicy::default()).await.map(drop))),
        ("release", fenced(zombie_store.release(&old).await)),
    ];
    let after = db.job().await;
    db.cleanup().await;
    (ops, before, after)
}

/// Guard: owner+epoch compare-and-set on checkpoint, fail and release (PostgreSQL and SQLite).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn guard_commit_cas_on_checkpoint_fail_release() {
    let off = Guards::default().without_commit_cas();
    let runs =
        join_all(BACKENDS.into_iter().flat_map(|b| [stale_writes(b, Guards::default()), stale_writes(b, off)])).await;
    for pair in runs.chunks(2) {
        let ((on_ops, on_before, on_after), (off_ops, _, off_after)) = (&pair[0], &pair[1]);
        println!(
            "commit CAS ON : stale writes accepted {on_ops:?}; job after: {:?} epoch {}",
            on_after.state, on_after.epoch
        );
        println!(
            "commit CAS OFF: stale writes accepted {off_ops:?}; job after: {:?} epoch {}",
            off_after.state, off_after.epoch
        );
        assert!(on_ops.iter().all(|(_, accepted)| !accepted), "guard on: {on_ops:?}");
        assert_eq!(on_after, on_before, "guard on: nothing written");
        assert_eq!((on_after.state, on_after.progress.as_deref()), (JobState::Running, None));
        // Violation: every stale write lands on the new owner's job.
        assert!(off_ops.iter().all(|(_, accepted)| *accepted), "guard off: {off_ops:?}");
        assert_eq!(off_after.progress.as_deref(), Some(&b"zombie progress"[..]));
        assert_eq!(off_after.last_error.as_deref(), Some("zombie failure"));
        assert_eq!(off_after.state, JobState::Pending, "the new owner's running job was failed, then released");
    }
}

/// Guard: the heartbeat compares owner and epoch (PostgreSQL and SQLite).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn guard_fenced_heartbeat() {
    let runs =
        join_all(BACKENDS.into_iter().flat_map(|b| [heartbeat_run(b, &[]), heartbeat_run(b, &["no-heartbeat-cas"])]))
            .await;
    for pair in runs.chunks(2) {
        let (on, off) = (&pair[0], &pair[1]);
        println!(
            "fenced heartbeat ON : {:?}, lease_until {} -> {}",
            on.zombie_heartbeat, on.new_lease_until, on.lease_until_after
        );
        println!(
            "fenced heartbeat OFF: {:?}, lease_until {} -> {}",
            off.zombie_heartbeat, off.new_lease_until, off.lease_until_after
        );
        assert_eq!(on.zombie_heartbeat, "heartbeat lost epoch=1", "guard on\n{}", on.transcript);
        assert_eq!(on.lease_until_after, on.new_lease_until, "guard on\n{}", on.transcript);
        // Violation: the zombie believes it still holds the job and pushes the new owner's lease out.
        assert!(off.zombie_heartbeat.starts_with("heartbeat renewed epoch=1"), "guard off\n{}", off.transcript);
        assert!(
            off.lease_until_after >= off.new_lease_until + 500,
            "guard off: lease not extended\n{}",
            off.transcript
        );
    }
}

/// Guard: cancel-on-loss in the supervisor (PostgreSQL and SQLite).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn guard_cancel_on_loss() {
    let runs =
        join_all(BACKENDS.into_iter().flat_map(|b| [cancel_run(b, &[]), cancel_run(b, &["no-cancel-on-loss"])])).await;
    for pair in runs.chunks(2) {
        let (on, off) = (&pair[0], &pair[1]);
        println!(
            "cancel-on-loss ON : cancelled after {:?}, calls after SIGCONT {:?}",
            on.cancel_latency, on.calls_after_resume
        );
        println!(
            "cancel-on-loss OFF: cancelled after {:?}, calls after SIGCONT {:?}",
            off.cancel_latency, off.calls_after_resume
        );
        assert!(on.cancel_latency.is_some_and(|l| l < lease().heartbeat_interval() + Duration::from_secs(1)));
        assert!(on.calls_after_resume.is_empty(), "guard on\n{}", on.transcript);
        // Violation: the superseded handler runs on and keeps acting (the receiver refuses it — a
        // different guard — but the calls happen).
        assert_eq!(off.cancel_latency, None, "guard off: handler ran to its end\n{}", off.transcript);
        assert!(!off.calls_after_resume.is_empty(), "guard off\n{}", off.transcript);
        assert!(off.calls_after_resume.iter().all(|&(epoch, status)| (epoch, status) == (1, 409)));
        assert!(off.zombie_outcome.starts_with("outcome=fenced"), "guard off\n{}", off.transcript);
    }
}

/// Guard: the receiver's epoch check (`ledger.accept`) (PostgreSQL and SQLite).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn guard_receiver_epoch_check() {
    let off = || Switches { receiver: Guards::default().without_ledger_check(), ..Switches::default() };
    let runs = join_all(BACKENDS.into_iter().flat_map(|b| {
        [table_run(b, Order::NewOwnerFirst, Switches::default()), table_run(b, Order::NewOwnerFirst, off())]
    }))
    .await;
    for pair in runs.chunks(2) {
        let (on, off) = (&pair[0], &pair[1]);
        println!("receiver check ON : calls {:?}, newest {:?}, effect {:?}", on.receiver_calls, on.newest, on.effect);
        println!(
            "receiver check OFF: calls {:?}, newest {:?}, effect {:?}",
            off.receiver_calls, off.newest, off.effect
        );
        assert_eq!(on.receiver_calls, vec![(2, 200), (1, 409)], "guard on\n{}", on.timeline);
        assert_eq!(on.newest, Some(2));
        // Violation: the zombie's stale call is applied after the new owner's, and the ledger goes back.
        assert_eq!(off.receiver_calls, vec![(2, 200), (1, 200)], "guard off\n{}", off.timeline);
        assert_eq!(off.newest, Some(1));
        assert_eq!(off.effect.as_ref().map(|e| e.0), Some(1), "the zombie's effect overwrote epoch 2's");
    }
}

#[test]
fn guards_are_on_by_default() {
    let g = Guards::default();
    assert!(g.epoch_increment() && g.commit_cas() && g.heartbeat_cas() && g.ledger_check());
}
