//! The bounded check of the protocol model (issue #17): the correct model per source kind, and
//! one negative control per guard (the guard off: the checker must find a counterexample).
//!
//! `cargo test --workspace --all-features model` runs them.

use brokerfence_model::{Action, Bounds, Guards, ProtocolModel, SAFETY, Source, liveness};

/// Threads of the breadth-first search (CI has 2 cores).
const THREADS: usize = 2;

fn correct(source: Source, workers: u8) {
    let model = ProtocolModel::new(source, workers);
    let report = model.check_safety(THREADS);
    println!(
        "model {source:?}, {workers} workers, {:?}: {} distinct states ({} generated), depth {}, {:.1} s",
        model.bounds,
        report.unique_states,
        report.states,
        report.max_depth,
        report.elapsed.as_secs_f64()
    );
    if let Some((name, path)) = report.counterexamples.iter().next() {
        let states = model.states_along(path).unwrap_or_default();
        panic!(
            "counterexample to \"{name}\" in the correct model ({} steps):\n{}\nlast state: {:#?}",
            path.len(),
            steps(path),
            states.last()
        );
    }
    assert!(report.unique_states > 10_000, "the bound explores a real space: {}", report.unique_states);
    let started = std::time::Instant::now();
    let live = liveness::check(&model);
    println!(
        "model {source:?} liveness: {} states, {} steps, {:.1} s",
        live.states,
        live.edges,
        started.elapsed().as_secs_f64()
    );
    assert_eq!(live.states, report.unique_states, "both explorations see the same states");
    if let Some(path) = live.stuck {
        let states = model.states_along(&path).unwrap_or_default();
        panic!(
            "a state from which no run completes or buries the job ({} steps):\n{}\nstate: {:#?}",
            path.len(),
            steps(&path),
            states.last()
        );
    }
}

fn steps(path: &[Action]) -> String {
    path.iter().enumerate().map(|(i, a)| format!("  {:2}. {a}\n", i + 1)).collect()
}

#[test]
fn model_check_table_queue() {
    correct(Source::Table, 2);
}

#[test]
fn model_check_sqs() {
    correct(Source::Sqs, 2);
}

#[test]
fn model_check_redis_stream() {
    correct(Source::RedisStream, 2);
}

/// Three workers (table queue; no handler errors or releases, to stay within CI's time).
#[test]
fn model_check_three_workers() {
    let model = ProtocolModel::new(Source::Table, 3).with_bounds(Bounds {
        workers: 3,
        errors: 0,
        releases: 0,
        ..Bounds::default()
    });
    let report = model.check_safety(THREADS);
    println!(
        "model Table, 3 workers, {:?}: {} distinct states, depth {}, {:.1} s",
        model.bounds,
        report.unique_states,
        report.max_depth,
        report.elapsed.as_secs_f64()
    );
    assert!(report.counterexamples.is_empty(), "{:?}", report.counterexamples);
}

/// A negative control: with `guards`, the check must find a counterexample to `property`.
fn negative(source: Source, guards: Guards, property: &'static str) -> Vec<Action> {
    assert!(SAFETY.contains(&property));
    let model = ProtocolModel::new(source, 2).guards(guards);
    let report = model.check_safety(THREADS);
    let Some(path) = report.counterexamples.get(property) else {
        panic!(
            "guard off ({guards:?}) but no counterexample to \"{property}\" in {} states; found: {:?}",
            report.unique_states,
            report.counterexamples.keys().collect::<Vec<_>>()
        );
    };
    println!(
        "{source:?} with {guards:?}: \"{property}\" fails after {} steps ({} states explored):\n{}",
        path.len(),
        report.unique_states,
        steps(path)
    );
    // The path is a path of the broken model, and the same steps do not break the correct one.
    assert!(model.states_along(path).is_some());
    path.clone()
}

#[test]
fn model_negative_claim_without_epoch_increment() {
    negative(Source::Table, Guards { epoch_increment: false, ..Guards::default() }, SAFETY[1]);
}

#[test]
fn model_negative_commit_without_cas() {
    negative(Source::Table, Guards { commit_cas: false, ..Guards::default() }, SAFETY[0]);
}

#[test]
fn model_negative_unfenced_heartbeat() {
    negative(Source::Table, Guards { heartbeat_cas: false, ..Guards::default() }, SAFETY[3]);
}

#[test]
fn model_negative_no_cancel_on_loss() {
    negative(Source::Table, Guards { cancel_on_loss: false, ..Guards::default() }, SAFETY[3]);
}

#[test]
fn model_negative_receiver_without_ledger() {
    negative(Source::Table, Guards { receiver_ledger: false, ..Guards::default() }, SAFETY[1]);
}

#[test]
fn model_negative_sqs_delete_before_commit() {
    negative(Source::Sqs, Guards { ack_after_commit: false, ..Guards::default() }, SAFETY[2]);
}

#[test]
fn model_negative_redis_xack_before_commit() {
    negative(Source::RedisStream, Guards { ack_after_commit: false, ..Guards::default() }, SAFETY[2]);
}

/// LocalStack accepts stale receipt handles; the model covers real SQS (newest handle only) too.
#[test]
fn model_check_sqs_newest_handle_only() {
    let model = ProtocolModel::new(Source::Sqs, 2);
    let model = model.with_bounds(Bounds { stale_handles: false, ..model.bounds });
    let report = model.check_safety(THREADS);
    println!(
        "model Sqs (newest handle only): {} distinct states, {:.1} s",
        report.unique_states,
        report.elapsed.as_secs_f64()
    );
    assert!(report.counterexamples.is_empty(), "{:?}", report.counterexamples);
}

/// Larger bounds than CI's (two pauses, four claims):
/// `cargo test -p brokerfence-model --test model_check model_check_deep -- --ignored --nocapture`.
/// Minutes, and gigabytes of memory for the liveness pass.
#[test]
#[ignore = "minutes: run by hand (see the doc comment)"]
fn model_check_deep() {
    for (source, effects) in [(Source::Table, true), (Source::Sqs, false), (Source::RedisStream, false)] {
        let model = ProtocolModel::new(source, 2);
        let model = model.with_bounds(Bounds { pauses: 2, max_claims: 4, effects, ..model.bounds });
        let report = model.check_safety(THREADS);
        println!(
            "deep {source:?} {:?}: {} distinct states, depth {}, {:.1} s",
            model.bounds,
            report.unique_states,
            report.max_depth,
            report.elapsed.as_secs_f64()
        );
        assert!(report.counterexamples.is_empty(), "{:?}", report.counterexamples);
    }
}
