//! Counters of what the fence did: claims, renewals, losses, fenced rejections, commits; and,
//! with the `metrics` feature, their export through the [`metrics`](https://docs.rs/metrics)
//! façade with latency histograms (see [`Metrics`] for the list of names).

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

#[cfg(feature = "metrics")]
#[path = "metrics_export.rs"]
mod export;

macro_rules! counters {
    ($($(#[$doc:meta])* $name:ident => $variant:ident),* $(,)?) => {
        /// One counter of [`Metrics`].
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum Counter {
            $($(#[$doc])* $variant,)*
        }

        const COUNTERS: usize = [$(Counter::$variant),*].len();

        /// Live counters, shared by a supervisor and the runtime around it (cheap atomics).
        ///
        /// ```
        /// use brokerfence::{Counter, Metrics};
        /// let m = Metrics::default();
        /// # m.add(Counter::Claims, 3); // what a supervisor does as it claims
        /// assert_eq!(m.snapshot().claims, 3);
        /// assert_eq!(m.get(Counter::Claims), 3);
        /// ```
        ///
        /// # Export (feature `metrics`)
        ///
        /// With the `metrics` feature every counter and the histograms below are also published
        /// through the [`metrics`](https://docs.rs/metrics/0.24) façade, to whatever recorder the
        /// application installed (for example `metrics-exporter-prometheus`). Without the feature
        /// nothing is exported, the histograms are not recorded and the `metrics` crate is
        /// not compiled. Every series carries the labels `queue` (the fence queue) and `source`
        /// (`table`, `sqs`, `redis_stream`, `redis_list`, `middleware`, or what a custom
        /// [`Source`](https://docs.rs/brokerfence/latest/brokerfence/trait.Source.html) reports;
        /// see [`Metrics::labelled`]). A [`Metrics::default`] has both labels empty.
        ///
        /// Install the recorder **before** the consumer (or supervisor) is built: the series
        /// handles are taken from the recorder installed when the labels are set
        /// ([`Metrics::labelled`]) or, for an unlabelled [`Metrics`], at its first use.
        ///
        /// | name | type | unit | meaning |
        /// |---|---|---|---|
        /// | `brokerfence_<counter>_total` | counter | events | one per [`Counter`], named after its [`MetricsSnapshot`] field: `brokerfence_claims_total`, `_busy_total`, `_duplicates_total`, `_renewals_total`, `_heartbeats_total`, `_lease_losses_total`, `_fenced_rejections_total`, `_completions_total`, `_own_commits_total`, `_commit_statements_total`, `_claim_statements_total`, `_failures_total`, `_dead_jobs_total`, `_dead_letters_total`, `_acks_total`, `_releases_total`, `_hook_timeouts_total`, `_hook_skips_total`. Of these, `_dead_jobs_total` counts jobs the database declared dead, and `_dead_letters_total` the messages actually moved to a dead-letter destination, once each: not a job declared dead on a queue with no dead-letter queue (nothing was sent), and not twice when a delete after the copy failed (the next try only deletes) |
        /// | `brokerfence_claim_duration_seconds` | histogram | seconds | one claim statement: the runtime's group claim of broker deliveries, the middleware's claim, or a source's receive that claimed (the table queue's `claim_next`; recorded when it returned jobs) |
        /// | `brokerfence_claim_statement_jobs` | histogram | jobs | deliveries (jobs) one claim statement above carried |
        /// | `brokerfence_heartbeat_duration_seconds` | histogram | seconds | one renewal statement of the supervisor's heartbeat (answered or failed; a statement cut by its bound counts the bound) |
        /// | `brokerfence_commit_duration_seconds` | histogram | seconds | one group-commit statement (`complete_batch`) |
        /// | `brokerfence_commit_statement_jobs` | histogram | jobs | completions one group-commit statement carried |
        /// | `brokerfence_handler_duration_seconds` | histogram | seconds | an attempt's handler, from its start to its return (ok, error or attempt timeout; with prefetching it includes the wait for a handler slot). A handler cancelled by a lease loss or shutdown is not recorded |
        /// | `brokerfence_lease_loss_to_cancel_seconds` | histogram | seconds | from the moment the worker learned that a lease was lost (a heartbeat's answer, or the worker-side deadline passing unconfirmed) to the moment the handler's future was dropped; extra label `reason` = `superseded` or `unconfirmed` |
        /// | `brokerfence_in_flight` | gauge | handlers | handlers running now (what [`Supervisor::in_flight`](crate::Supervisor::in_flight) counts) |
        ///
        /// ```
        /// use brokerfence::{Counter, Distribution, Metrics};
        /// // for `Supervisor::with_metrics`: each claim it counts is also exported as
        /// // `brokerfence_claims_total{queue="emails",source="table"}`
        /// let m = Metrics::labelled("emails", "table");
        /// # m.incr(Counter::Claims);
        /// # m.observe_duration(Distribution::ClaimDuration, std::time::Duration::from_millis(3));
        /// assert_eq!(m.get(Counter::Claims), 1);
        /// ```
        #[derive(Debug, Default)]
        pub struct Metrics {
            values: [AtomicU64; COUNTERS],
            #[cfg(feature = "metrics")]
            export: export::Export,
        }

        /// The exported name of each counter, in [`Counter`] order.
        #[cfg(feature = "metrics")]
        const COUNTER_NAMES: [&str; COUNTERS] = [$(concat!("brokerfence_", stringify!($name), "_total")),*];

        /// A point-in-time copy of [`Metrics`].
        #[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
        pub struct MetricsSnapshot {
            $($(#[$doc])* pub $name: u64,)*
        }

        impl Metrics {
            /// Adds `n` to a counter.
            #[doc(hidden)]
            pub fn add(&self, counter: Counter, n: u64) {
                self.values[counter as usize].fetch_add(n, Ordering::Relaxed);
                #[cfg(feature = "metrics")]
                self.export.counter(counter as usize, n);
            }

            /// Adds one to a counter.
            #[doc(hidden)]
            pub fn incr(&self, counter: Counter) {
                self.add(counter, 1);
            }

            /// Reads one counter.
            pub fn get(&self, counter: Counter) -> u64 {
                self.values[counter as usize].load(Ordering::Relaxed)
            }

            /// Copies every counter.
            pub fn snapshot(&self) -> MetricsSnapshot {
                MetricsSnapshot { $($name: self.get(Counter::$variant),)* }
            }
        }

        impl fmt::Display for MetricsSnapshot {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                let parts: [(&str, u64); COUNTERS] = [$((stringify!($name), self.$name)),*];
                for (i, (name, value)) in parts.iter().enumerate() {
                    if i > 0 {
                        f.write_str(" ")?;
                    }
                    write!(f, "{name}={value}")?;
                }
                Ok(())
            }
        }
    };
}

counters!(
    /// Jobs claimed (new epochs handed out).
    claims => Claims,
    /// Claims refused because another owner held a live lease.
    busy => Busy,
    /// Deliveries of jobs already completed or dead (duplicates).
    duplicates => Duplicates,
    /// Lease renewals the database confirmed.
    renewals => Renewals,
    /// Heartbeat statements sent (one per worker per tick).
    heartbeats => Heartbeats,
    /// Leases found lost (superseded, or unconfirmable before expiry); handler cancelled.
    lease_losses => LeaseLosses,
    /// Writes refused by the compare-and-set (a superseded owner's commit, fail or checkpoint).
    fenced_rejections => FencedRejections,
    /// Results committed (by the runtime's group commit or in the handler's own transaction).
    completions => Completions,
    /// Of [`completions`](MetricsSnapshot::completions), those the handler committed in its own
    /// transaction with [`JobContext::complete_in`](crate::JobContext::complete_in).
    own_commits => OwnCommits,
    /// Group-commit statements sent (each carries one or more completions).
    commit_statements => CommitStatements,
    /// Group-claim statements the consumer runtime sent for broker deliveries (each claims one
    /// or more; a table queue claims in its own receive and counts none).
    claim_statements => ClaimStatements,
    /// Failed attempts recorded (retrying).
    failures => Failures,
    /// Jobs the database declared dead under this worker's lease (attempts used up, or a
    /// permanent error), whether or not a dead-letter copy could be sent.
    dead_jobs => DeadJobs,
    /// Messages moved to a dead-letter destination (an SQS dead-letter queue, a Redis dead-letter
    /// stream; a table queue's dead row is its own, counted when the job is declared dead), for a
    /// dead job or a delivery with no job key: once per message, by the move that completed it
    /// (copy sent, delivery removed; a copy whose removal failed counts when a later try removes
    /// it). A move that failed (no dead-letter queue, a refused call) counts nothing, nor does a
    /// redelivery of a message moved before.
    dead_letters => DeadLetters,
    /// Broker acknowledgements sent after a committed result.
    acks => Acks,
    /// Leases given back (shutdown).
    releases => Releases,
    /// Broker hook calls ([`LeaseHook`](crate::LeaseHook)) cut by their timeout; the database
    /// lease stands, only the broker hint was missed.
    hook_timeouts => HookTimeouts,
    /// Leases left out of a hook's `confirmed` call because, when the call went out, their attempt
    /// had ended or their worker-side deadline had passed (a stale lease is never extended).
    hook_skips => HookSkips,
);

/// A histogram the `metrics` feature exports (see [`Metrics`] for the names and units). Without
/// the feature, nothing records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Distribution {
    /// `brokerfence_claim_duration_seconds`: one claim statement.
    ClaimDuration,
    /// `brokerfence_claim_statement_jobs`: jobs one claim statement carried.
    ClaimStatementJobs,
    /// `brokerfence_heartbeat_duration_seconds`: one heartbeat (renewal) statement.
    HeartbeatDuration,
    /// `brokerfence_commit_duration_seconds`: one group-commit statement.
    CommitDuration,
    /// `brokerfence_commit_statement_jobs`: completions one group-commit statement carried.
    CommitStatementJobs,
    /// `brokerfence_handler_duration_seconds`: a handler's run, to its return.
    HandlerDuration,
}

/// Why a running handler was cancelled, for `brokerfence_lease_loss_to_cancel_seconds`.
#[cfg(feature = "metrics")]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LossKind {
    Superseded,
    Unconfirmed,
}

impl Metrics {
    /// Counters whose export (feature `metrics`) carries the labels `queue` and `source`; the
    /// consumer runtime and the middleware build theirs with this. Without the feature it is
    /// [`Metrics::default`].
    ///
    /// ```
    /// let m = brokerfence::Metrics::labelled("emails", "table");
    /// assert_eq!(m.snapshot().claims, 0);
    /// ```
    #[must_use]
    pub fn labelled(queue: &str, source: &str) -> Self {
        #[cfg(feature = "metrics")]
        {
            Self { values: Default::default(), export: export::Export::labelled(queue, source) }
        }
        #[cfg(not(feature = "metrics"))]
        {
            let _ = (queue, source);
            Self::default()
        }
    }

    /// Records one value of a histogram (seconds for the durations, a count for the
    /// `…_statement_jobs`). Does nothing without the `metrics` feature.
    ///
    /// ```
    /// use brokerfence::{Distribution, Metrics};
    /// Metrics::default().observe(Distribution::ClaimStatementJobs, 12.0);
    /// ```
    #[doc(hidden)]
    pub fn observe(&self, distribution: Distribution, value: f64) {
        #[cfg(feature = "metrics")]
        self.export.histogram(distribution, value);
        #[cfg(not(feature = "metrics"))]
        let _ = (distribution, value);
    }

    /// [`observe`](Self::observe) of a duration, in seconds.
    ///
    /// ```
    /// use brokerfence::{Distribution, Metrics};
    /// let started = std::time::Instant::now();
    /// Metrics::default().observe_duration(Distribution::HandlerDuration, started.elapsed());
    /// ```
    #[doc(hidden)]
    pub fn observe_duration(&self, distribution: Distribution, elapsed: Duration) {
        self.observe(distribution, elapsed.as_secs_f64());
    }

    /// `brokerfence_lease_loss_to_cancel_seconds`.
    #[cfg(feature = "metrics")]
    pub(crate) fn loss_to_cancel(&self, kind: LossKind, elapsed: Duration) {
        self.export.loss_to_cancel(kind, elapsed.as_secs_f64());
    }

    /// `brokerfence_in_flight` up (`true`) or down by one.
    pub(crate) fn in_flight(&self, up: bool) {
        #[cfg(feature = "metrics")]
        self.export.in_flight(up);
        #[cfg(not(feature = "metrics"))]
        let _ = up;
    }
}
