//! The liveness check: "eventually (under fairness, once pauses stop) every job is completed or
//! dead".
//!
//! stateright's `eventually` only looks at paths that end (its own notes call it incomplete on
//! cycles, and this model has cycles: [`Action::Tick`] is always enabled).
//! So this module explores the same [`Model`] graph itself and checks the branching form: from
//! every reachable state, a state where every job is completed or dead is reachable. On a finite
//! graph that is exactly "every run that is strongly fair to every step reaches such a state":
//! such a run ends in a set of states closed under the steps, and a done state is reachable from
//! each of them. The bounded pauses, errors and releases are the environment's: once spent, they
//! are over, which is the issue's "once pauses stop".

use std::collections::HashMap;
use std::collections::VecDeque;

use stateright::Model;

use crate::{Action, ProtocolModel, State};

/// What [`check`] found.
#[derive(Debug)]
pub struct Liveness {
    /// Reachable states.
    pub states: usize,
    /// Steps between them.
    pub edges: usize,
    /// A path from the initial state to a state from which no done state is reachable.
    pub stuck: Option<Vec<Action>>,
}

/// Explores every reachable state of `model` and checks that a done state is reachable from each.
///
/// ```
/// use brokerfence_model::{Bounds, ProtocolModel, Source, liveness};
/// let model = ProtocolModel::new(Source::Table, 2);
/// let model = model.with_bounds(Bounds { errors: 0, releases: 0, ..model.bounds });
/// let live = liveness::check(&model);
/// assert!(live.stuck.is_none(), "{:?}", live.stuck);
/// ```
pub fn check(model: &ProtocolModel) -> Liveness {
    // States by fingerprint (as stateright keeps them), each state stored once.
    let mut ids: HashMap<u64, u32> = HashMap::new();
    let mut states: Vec<State> = Vec::new();
    let mut parent: Vec<Option<(u32, Action)>> = Vec::new();
    let mut rev: Vec<Vec<u32>> = Vec::new();
    let mut queue = VecDeque::new();
    let mut edges = 0usize;
    for s in model.init_states() {
        let id = states.len() as u32;
        ids.insert(fingerprint(&s), id);
        states.push(s);
        parent.push(None);
        rev.push(Vec::new());
        queue.push_back(id);
    }
    let mut actions = Vec::new();
    while let Some(id) = queue.pop_front() {
        let s = states[id as usize].clone();
        model.actions(&s, &mut actions);
        for a in actions.drain(..) {
            let Some(next) = model.next_state(&s, a) else { continue };
            edges += 1;
            let fp = fingerprint(&next);
            let nid = match ids.get(&fp) {
                Some(&n) => n,
                None => {
                    let n = states.len() as u32;
                    ids.insert(fp, n);
                    states.push(next);
                    parent.push(Some((id, a)));
                    rev.push(Vec::new());
                    queue.push_back(n);
                    n
                }
            };
            rev[nid as usize].push(id);
        }
    }
    // Backwards from the done states.
    let mut good = vec![false; states.len()];
    let mut back: VecDeque<u32> = VecDeque::new();
    for (i, s) in states.iter().enumerate() {
        if model.all_done(s) {
            good[i] = true;
            back.push_back(i as u32);
        }
    }
    while let Some(id) = back.pop_front() {
        for &p in &rev[id as usize] {
            if !good[p as usize] {
                good[p as usize] = true;
                back.push_back(p);
            }
        }
    }
    let stuck = good.iter().position(|g| !g).map(|i| {
        let mut path = Vec::new();
        let mut at = i as u32;
        while let Some((p, a)) = parent[at as usize] {
            path.push(a);
            at = p;
        }
        path.reverse();
        path
    });
    Liveness { states: states.len(), edges, stuck }
}

fn fingerprint(s: &State) -> u64 {
    use std::hash::{BuildHasher, BuildHasherDefault};
    BuildHasherDefault::<std::collections::hash_map::DefaultHasher>::default().hash_one(s)
}
