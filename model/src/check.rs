//! The bounded safety check ([`ProtocolModel::check_safety`]): the property names, the report,
//! and the path replay that cuts a counterexample at its first violating state.

use stateright::Model;

use crate::{Action, ProtocolModel, State};

/// The names of the four safety properties, in the order of [`Model::properties`].
pub const SAFETY: [&str; 4] = [
    "at most one committed result, by the current attempt",
    "the receiver never accepts a lower epoch (or an older attempt)",
    "no broker delete or ack before the job is committed or dead",
    "no handler runs past its lease on the database clock",
];

/// What a bounded safety check found.
#[derive(Debug)]
pub struct SafetyReport {
    /// Distinct states explored.
    pub unique_states: usize,
    /// States generated, repeats included.
    pub states: usize,
    /// Longest path explored.
    pub max_depth: usize,
    /// Wall time.
    pub elapsed: std::time::Duration,
    /// Counterexamples by property name: the shortest path of steps to a violation (BFS).
    pub counterexamples: std::collections::BTreeMap<&'static str, Vec<Action>>,
}

impl ProtocolModel {
    /// Checks the four safety properties on every state reachable within the bounds
    /// (breadth-first, `threads` threads). Stops at the first counterexample.
    ///
    /// ```
    /// use brokerfence_model::{Bounds, ProtocolModel, Source};
    /// let model = ProtocolModel::new(Source::Table, 2);
    /// let model = model.with_bounds(Bounds { errors: 0, releases: 0, ..model.bounds });
    /// let report = model.check_safety(1);
    /// assert!(report.counterexamples.is_empty());
    /// println!("{} states", report.unique_states);
    /// ```
    pub fn check_safety(self, threads: usize) -> SafetyReport {
        use stateright::Checker;
        let started = std::time::Instant::now();
        let checker =
            self.checker().threads(threads).finish_when(stateright::HasDiscoveries::AnyFailures).spawn_bfs().join();
        // Each path cut at the first state that breaks its property (a discovery's path can run
        // a step past it).
        let properties = self.properties();
        let counterexamples = checker
            .discoveries()
            .into_iter()
            .map(|(name, path)| {
                let mut path = path.into_actions();
                let holds = properties.iter().find(|p| p.name == name).map(|p| p.condition);
                if let (Some(holds), Some(states)) = (holds, self.states_along(&path))
                    && let Some(first) = states.iter().position(|s| !holds(&self, s))
                {
                    path.truncate(first);
                }
                (name, path)
            })
            .collect();
        SafetyReport {
            unique_states: checker.unique_state_count(),
            states: checker.state_count(),
            max_depth: checker.max_depth(),
            elapsed: started.elapsed(),
            counterexamples,
        }
    }

    /// The states along `path` from the initial state (None if a step is not enabled).
    ///
    /// ```
    /// use brokerfence_model::{Action, JobState, ProtocolModel, Source};
    /// let model = ProtocolModel::new(Source::Table, 2);
    /// let states = model.states_along(&[Action::ClaimNext(0), Action::HandlerOk(0), Action::Complete(0)]).unwrap();
    /// assert_eq!(states.last().unwrap().row.unwrap().state, JobState::Completed);
    /// assert!(model.states_along(&[Action::Complete(0)]).is_none()); // nothing to complete yet
    /// ```
    pub fn states_along(&self, path: &[Action]) -> Option<Vec<State>> {
        let mut out = self.init_states();
        out.truncate(1);
        for &a in path {
            let last = out.last()?;
            let mut enabled = Vec::new();
            self.actions(last, &mut enabled);
            if !enabled.contains(&a) {
                return None;
            }
            let next = self.next_state(last, a)?;
            out.push(next);
        }
        Some(out)
    }
}
