//! Prints the size of the bounded check for given bounds:
//! `cargo run -p brokerfence-model --example model_bounds -- SOURCE WORKERS PAUSES ERRORS RELEASES MAX_CLAIMS`.
use brokerfence_model::{Bounds, ProtocolModel, Source};

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let n = |i: usize, d: u8| a.get(i).and_then(|s| s.parse().ok()).unwrap_or(d);
    let source = match a.first().map(String::as_str) {
        Some("sqs") => Source::Sqs,
        Some("redis") => Source::RedisStream,
        _ => Source::Table,
    };
    let bounds = Bounds {
        workers: n(1, 2),
        pauses: n(2, 1),
        errors: n(3, 1),
        releases: n(4, 1),
        max_claims: n(5, 3),
        lease: n(6, 3) as i8,
        effects: n(7, 1) == 1,
        ..Bounds::default()
    };
    let model = ProtocolModel::new(source, bounds.workers).with_bounds(bounds);
    let r = model.check_safety(2);
    println!(
        "{source:?} {bounds:?}: {} states, depth {}, {:.1} s, counterexamples {:?}",
        r.unique_states,
        r.max_depth,
        r.elapsed.as_secs_f64(),
        r.counterexamples.keys().collect::<Vec<_>>()
    );
}
