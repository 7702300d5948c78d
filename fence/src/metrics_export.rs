//! The `metrics` feature: [`Metrics`](super::Metrics) published through the `metrics` façade.
//! Handles are taken once per [`Metrics`](super::Metrics) (its labels are fixed), so recording is
//! an atomic add on the recorder's side and allocates nothing.

use std::sync::OnceLock;

use super::{COUNTER_NAMES, COUNTERS, Distribution, LossKind};

/// The labels and, once taken, the recorder's handles.
#[derive(Default)]
pub(super) struct Export {
    /// `(queue, source)`; `None`: both empty.
    labels: Option<(String, String)>,
    handles: OnceLock<Handles>,
}

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (queue, source) = self.labels.as_ref().map_or(("", ""), |(q, s)| (q.as_str(), s.as_str()));
        f.debug_struct("Export").field("queue", &queue).field("source", &source).finish()
    }
}

struct Handles {
    counters: [metrics::Counter; COUNTERS],
    /// In [`Distribution`] order.
    histograms: [metrics::Histogram; 6],
    /// `superseded`, `unconfirmed`.
    loss_to_cancel: [metrics::Histogram; 2],
    in_flight: metrics::Gauge,
}

/// Exported names of the [`Distribution`]s, in their order.
const HISTOGRAM_NAMES: [&str; 6] = [
    "brokerfence_claim_duration_seconds",
    "brokerfence_claim_statement_jobs",
    "brokerfence_heartbeat_duration_seconds",
    "brokerfence_commit_duration_seconds",
    "brokerfence_commit_statement_jobs",
    "brokerfence_handler_duration_seconds",
];

fn index(d: Distribution) -> usize {
    match d {
        Distribution::ClaimDuration => 0,
        Distribution::ClaimStatementJobs => 1,
        Distribution::HeartbeatDuration => 2,
        Distribution::CommitDuration => 3,
        Distribution::CommitStatementJobs => 4,
        Distribution::HandlerDuration => 5,
    }
}

static DESCRIBED: OnceLock<()> = OnceLock::new();

/// Units and help texts, once per process (a recorder installed later misses them; the
/// series still work).
fn describe() {
    DESCRIBED.get_or_init(|| {
        use metrics::Unit;
        for name in COUNTER_NAMES {
            metrics::describe_counter!(name, Unit::Count, "brokerfence fence counter (see brokerfence::Counter)");
        }
        let help = [
            "Claim statement latency",
            "Jobs per claim statement",
            "Heartbeat (lease renewal) statement latency",
            "Group-commit statement latency",
            "Completions per group-commit statement",
            "Handler run time, start to return",
        ];
        for (name, help) in HISTOGRAM_NAMES.into_iter().zip(help) {
            let unit = if name.ends_with("_seconds") { Unit::Seconds } else { Unit::Count };
            metrics::describe_histogram!(name, unit, help);
        }
        metrics::describe_histogram!(
            "brokerfence_lease_loss_to_cancel_seconds",
            Unit::Seconds,
            "From a lease loss found by the worker to the handler's cancellation"
        );
        metrics::describe_gauge!("brokerfence_in_flight", Unit::Count, "Handlers running now");
    });
}

impl Export {
    pub(super) fn labelled(queue: &str, source: &str) -> Self {
        let export = Self { labels: Some((queue.to_owned(), source.to_owned())), handles: OnceLock::new() };
        // Registered now: every series shows (at zero) from the start.
        export.handles();
        export
    }

    fn handles(&self) -> &Handles {
        self.handles.get_or_init(|| {
            describe();
            let (queue, source) = self.labels.clone().unwrap_or_default();
            let labels = [("queue", queue), ("source", source)];
            let counters = COUNTER_NAMES.map(|name| metrics::counter!(name, &labels[..]));
            let histograms = HISTOGRAM_NAMES.map(|name| metrics::histogram!(name, &labels[..]));
            let loss_to_cancel = ["superseded", "unconfirmed"].map(|reason| {
                let [q, s] = labels.clone();
                metrics::histogram!("brokerfence_lease_loss_to_cancel_seconds", &[q, s, ("reason", reason.to_owned())])
            });
            let in_flight = metrics::gauge!("brokerfence_in_flight", &labels[..]);
            Handles { counters, histograms, loss_to_cancel, in_flight }
        })
    }

    pub(super) fn counter(&self, i: usize, n: u64) {
        self.handles().counters[i].increment(n);
    }

    pub(super) fn histogram(&self, d: Distribution, value: f64) {
        self.handles().histograms[index(d)].record(value);
    }

    pub(super) fn loss_to_cancel(&self, kind: LossKind, secs: f64) {
        let i = match kind {
            LossKind::Superseded => 0,
            LossKind::Unconfirmed => 1,
        };
        self.handles().loss_to_cancel[i].record(secs);
    }

    pub(super) fn in_flight(&self, up: bool) {
        let gauge = &self.handles().in_flight;
        if up { gauge.increment(1.0) } else { gauge.decrement(1.0) }
    }
}
