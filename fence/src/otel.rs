//! OpenTelemetry across the broker (feature `otel`): the W3C trace context a producer writes next
//! to a job, and the attempt spans that continue it.
//!
//! A producer writes [`TRACEPARENT`] and [`TRACESTATE`] beside the job: a column of the jobs table
//! (`enqueue`, `enqueue_in`), an SQS message attribute, a Redis stream field. The consumer reads
//! them back as an [`Origin`] and runs the attempt inside it ([`scope`]): the `attempt` span of
//! the supervisor is then a **child** of the producer's span for the job's first attempt and
//! **linked** to it for every later one (the OpenTelemetry messaging conventions' `process`
//! span). The span carries `messaging.system`, `messaging.destination.name`,
//! `messaging.message.id`, `brokerfence.epoch`, `brokerfence.owner`, `brokerfence.attempt` and
//! `brokerfence.outcome` (`committed`, `fenced`, `lease_lost`, `failed`, `dead`, `released`,
//! `error`); a fenced commit also carries `brokerfence.fenced_by.epoch` and
//! `brokerfence.fenced_by.owner`, the attempt that superseded it. A delivery of a job already
//! committed is an `attempt` span of its own with the outcome `duplicate` ([`duplicate`]).
//!
//! The spans are `tracing` spans: install `tracing_opentelemetry`'s layer (with the tracer of
//! your OpenTelemetry SDK) in your subscriber. Without that layer nothing is written: a producer
//! finds no current context and writes no field.
//!
//! A malformed `traceparent` is ignored with a warning: the job runs as if it had none.
//!
//! ```
//! use brokerfence::otel::TraceContext;
//! let tc = TraceContext::parse("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01", Some("congo=t61rcWkgMzE"))?;
//! assert_eq!(tc.traceparent(), "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
//! assert!(TraceContext::parse("00-00000000000000000000000000000000-b7ad6b7169203331-01", None).is_err());
//! # Ok::<(), brokerfence::otel::TraceContextError>(())
//! ```

use std::future::Future;

use opentelemetry::trace::{SpanContext, SpanId, Status, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::{FenceError, JobKey, Lease, Outcome, QueueName};

/// The W3C header (and attribute, field, column) that carries the trace and parent span.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C header of vendor-specific trace state, sent only with a [`TRACEPARENT`].
pub const TRACESTATE: &str = "tracestate";

/// The longest `tracestate` kept (the W3C limit is 32 members; 512 bytes is what propagators
/// must at least pass on). A longer one is dropped, the `traceparent` kept.
const MAX_TRACESTATE: usize = 512;

/// A W3C trace context: a validated `traceparent` and its optional `tracestate`.
///
/// ```
/// use brokerfence::otel::TraceContext;
/// // Outside any span of an OpenTelemetry layer there is nothing to carry.
/// assert_eq!(TraceContext::current(), None);
/// let tc = TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None)?;
/// assert_eq!(tc.to_headers(), vec![("traceparent", tc.traceparent().to_string())]);
/// # Ok::<(), brokerfence::otel::TraceContextError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TraceContext {
    traceparent: String,
    tracestate: Option<String>,
}

/// Why a `traceparent` cannot be used.
///
/// ```
/// let err = brokerfence::otel::TraceContext::parse("nonsense", None).unwrap_err();
/// assert!(err.to_string().contains("traceparent"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TraceContextError {
    /// Not `version-traceid-spanid-flags` in lower-case hex, or an all-zero id.
    #[error("malformed traceparent {value:?}: {reason}")]
    Malformed {
        /// The value as found (at most 64 characters of it).
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
}

impl TraceContext {
    /// The context of the current `tracing` span (through `tracing_opentelemetry`), else the
    /// current OpenTelemetry context; `None` when neither is a valid, recorded span.
    ///
    /// ```
    /// assert!(brokerfence::otel::TraceContext::current().is_none());
    /// ```
    pub fn current() -> Option<Self> {
        let span = tracing::Span::current();
        let cx = if span.is_disabled() { opentelemetry::Context::current() } else { span.context() };
        let found = Self::from_span_context(cx.span().span_context());
        found.or_else(|| Self::from_span_context(opentelemetry::Context::current().span().span_context()))
    }

    /// Parses a `traceparent` (and its `tracestate`): version `00` or a later one (its first four
    /// fields are read), non-zero ids, lower-case hex. A `tracestate` that OpenTelemetry cannot
    /// read, or longer than 512 bytes, is dropped; the `traceparent` is kept.
    ///
    /// ```
    /// let tc = brokerfence::otel::TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00", Some("a=1"))?;
    /// assert_eq!(tc.tracestate(), Some("a=1"));
    /// # Ok::<(), brokerfence::otel::TraceContextError>(())
    /// ```
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Result<Self, TraceContextError> {
        let value = traceparent.trim();
        let bad = |reason| TraceContextError::Malformed { value: value.chars().take(64).collect(), reason };
        // Read off a broker: bounded before anything else is done with it.
        if value.len() > 256 {
            return Err(bad("longer than 256 bytes"));
        }
        let parts: Vec<&str> = value.split('-').collect();
        let [version, trace, span, flags, rest @ ..] = parts.as_slice() else {
            return Err(bad("expected version-traceid-spanid-flags"));
        };
        let hex =
            |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !hex(version, 2) || *version == "ff" {
            return Err(bad("version is not two hex digits (or is ff)"));
        }
        if *version == "00" && !rest.is_empty() {
            return Err(bad("version 00 has exactly four fields"));
        }
        if !hex(trace, 32) || trace.bytes().all(|b| b == b'0') {
            return Err(bad("trace id is not 32 hex digits, or all zero"));
        }
        if !hex(span, 16) || span.bytes().all(|b| b == b'0') {
            return Err(bad("parent id is not 16 hex digits, or all zero"));
        }
        if !hex(flags, 2) {
            return Err(bad("flags are not two hex digits"));
        }
        let tracestate = tracestate.map(str::trim).filter(|s| usable_tracestate(s)).map(str::to_owned);
        Ok(Self { traceparent: format!("00-{trace}-{span}-{flags}"), tracestate })
    }

    /// [`parse`](Self::parse) for a value read off a delivery: a malformed one is logged as a
    /// warning (naming `source`, where it was found) and ignored; an absent one is `None`.
    ///
    /// ```
    /// use brokerfence::otel::TraceContext;
    /// assert_eq!(TraceContext::read(Some("00-zz"), None, "my queue"), None);
    /// assert_eq!(TraceContext::read(None, Some("a=1"), "my queue"), None);
    /// ```
    pub fn read(traceparent: Option<&str>, tracestate: Option<&str>, source: &str) -> Option<Self> {
        let traceparent = traceparent.filter(|s| !s.trim().is_empty())?;
        match Self::parse(traceparent, tracestate) {
            Ok(tc) => Some(tc),
            Err(e) => {
                tracing::warn!(source, error = %e, "ignored a malformed trace context: the job runs without its producer's trace");
                None
            }
        }
    }

    /// Reads the context from (name, value) pairs such as request headers or message
    /// attributes; names match without regard to ASCII case. Malformed: a warning and `None`.
    ///
    /// ```
    /// let tc = brokerfence::otel::TraceContext::from_headers([
    ///     ("Fence-Epoch", "3"),
    ///     ("Traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
    /// ]);
    /// assert!(tc.is_some());
    /// ```
    pub fn from_headers<I, K, V>(pairs: I) -> Option<Self>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let (mut parent, mut state) = (None, None);
        for (k, v) in pairs {
            if k.as_ref().eq_ignore_ascii_case(TRACEPARENT) {
                parent = Some(v.as_ref().to_owned());
            } else if k.as_ref().eq_ignore_ascii_case(TRACESTATE) {
                state = Some(v.as_ref().to_owned());
            }
        }
        Self::read(parent.as_deref(), state.as_deref(), "headers")
    }

    /// The `traceparent` value, normalised to version `00`.
    pub fn traceparent(&self) -> &str {
        &self.traceparent
    }

    /// The `tracestate` value, if any.
    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }

    /// `traceparent` and, if there is one, `tracestate`, as (header name, value) pairs.
    ///
    /// ```
    /// let tc = brokerfence::otel::TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", Some("a=1"))?;
    /// assert_eq!(tc.to_headers().len(), 2);
    /// # Ok::<(), brokerfence::otel::TraceContextError>(())
    /// ```
    pub fn to_headers(&self) -> Vec<(&'static str, String)> {
        let mut out = vec![(TRACEPARENT, self.traceparent.clone())];
        if let Some(state) = &self.tracestate {
            out.push((TRACESTATE, state.clone()));
        }
        out
    }

    /// The remote span this context names, for a link or a parent.
    ///
    /// ```
    /// let tc = brokerfence::otel::TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None)?;
    /// assert!(tc.span_context().is_remote());
    /// # Ok::<(), brokerfence::otel::TraceContextError>(())
    /// ```
    pub fn span_context(&self) -> SpanContext {
        let mut parts = self.traceparent.split('-').skip(1);
        let trace = parts.next().and_then(|s| TraceId::from_hex(s).ok()).unwrap_or(TraceId::INVALID);
        let span = parts.next().and_then(|s| SpanId::from_hex(s).ok()).unwrap_or(SpanId::INVALID);
        let flags = parts.next().and_then(|s| u8::from_str_radix(s, 16).ok()).unwrap_or(0);
        let state = self.tracestate.as_deref().and_then(|s| s.parse().ok()).unwrap_or_default();
        SpanContext::new(trace, span, TraceFlags::new(flags & 0x01), true, state)
    }

    /// An OpenTelemetry context whose (remote) parent is this one: `span.set_parent(tc.context())`.
    ///
    /// ```
    /// use opentelemetry::trace::TraceContextExt;
    /// let tc = brokerfence::otel::TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None)?;
    /// assert!(tc.context().has_active_span());
    /// # Ok::<(), brokerfence::otel::TraceContextError>(())
    /// ```
    pub fn context(&self) -> opentelemetry::Context {
        opentelemetry::Context::new().with_remote_span_context(self.span_context())
    }

    /// Makes this context the parent of `span` (a span not yet entered): how a receiver
    /// continues the sender's trace. Without an OpenTelemetry layer it does nothing.
    ///
    /// ```
    /// let tc = brokerfence::otel::TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", None)?;
    /// let span = tracing::info_span!("receive");
    /// tc.parent_of(&span);
    /// # Ok::<(), brokerfence::otel::TraceContextError>(())
    /// ```
    pub fn parent_of(&self, span: &tracing::Span) {
        if span.is_disabled() {
            return;
        }
        if let Err(e) = span.set_parent(self.context()) {
            tracing::debug!(error = %e, "could not continue a trace context");
        }
    }

    fn from_span_context(sc: &SpanContext) -> Option<Self> {
        if !sc.is_valid() {
            return None;
        }
        let header = sc.trace_state().header();
        Some(Self {
            traceparent: format!("00-{}-{}-{:02x}", sc.trace_id(), sc.span_id(), sc.trace_flags().to_u8() & 0x01),
            tracestate: usable_tracestate(&header).then_some(header),
        })
    }
}

/// Whether a `tracestate` may be kept and passed on: not empty, at most [`MAX_TRACESTATE`]
/// bytes, printable ASCII only (W3C: a header value of visible characters and spaces; a control
/// character, NUL or non-ASCII byte would make a downstream header or a `text` column refuse it),
/// and readable by OpenTelemetry.
fn usable_tracestate(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_TRACESTATE
        && s.bytes().all(|b| (0x20..=0x7e).contains(&b))
        && s.parse::<TraceState>().is_ok()
}

/// Where a delivery came from: the producer's trace context and the broker's id of the message.
/// The consumer runtime builds one per delivery; run an attempt inside it with [`scope`].
///
/// ```
/// use brokerfence::otel::{Origin, TraceContext};
/// let origin = Origin::new(TraceContext::current()).message_id("1-0");
/// assert_eq!(origin.get_message_id(), Some("1-0"));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Origin {
    trace: Option<TraceContext>,
    message_id: Option<String>,
}

impl Origin {
    /// An origin with the producer's context (if it sent one).
    pub fn new(trace: Option<TraceContext>) -> Self {
        Self { trace, message_id: None }
    }

    /// The broker's id of the message (`messaging.message.id`).
    pub fn message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// The producer's context.
    pub fn get_trace(&self) -> Option<&TraceContext> {
        self.trace.as_ref()
    }

    /// The broker's id of the message.
    pub fn get_message_id(&self) -> Option<&str> {
        self.message_id.as_deref()
    }
}

tokio::task_local! {
    static ORIGIN: Origin;
}

/// The origin of the [`scope`] this task runs in (none outside one).
///
/// ```
/// assert_eq!(brokerfence::otel::current_origin(), brokerfence::otel::Origin::default());
/// ```
pub fn current_origin() -> Origin {
    ORIGIN.try_with(Origin::clone).unwrap_or_default()
}

/// Runs `attempt` (a [`Supervisor::run`](crate::Supervisor::run) or
/// [`run_claimed_at`](crate::Supervisor::run_claimed_at)) with `origin`: its `attempt` span
/// becomes a child of the producer's span (first attempt) or links to it (later attempts). The
/// consumer runtime and the retrofits do this themselves.
///
/// ```no_run
/// # async fn demo(sup: brokerfence::Supervisor, lease: brokerfence::Lease, tc: Option<brokerfence::otel::TraceContext>) {
/// let origin = brokerfence::otel::Origin::new(tc).message_id("m-1");
/// let outcome = brokerfence::otel::scope(origin, sup.run(lease, b"x".to_vec(), None, |ctx| async move {
///     Ok(ctx.payload().to_vec())
/// })).await;
/// # }
/// ```
pub async fn scope<F: Future>(origin: Origin, attempt: F) -> F::Output {
    ORIGIN.scope(origin, attempt).await
}

/// `tracing_opentelemetry`'s layer for `tracer`, set up as brokerfence recommends for a
/// consumer: every span keeps its parent, links, attributes, events and status, without work
/// done per span or per poll that a job's trace seldom needs:
///
/// - no **context activation**: the OpenTelemetry context is not attached to the thread on every
///   poll of a span. brokerfence reads a span's context from the current `tracing` span itself
///   ([`TraceContext::current`], the stamps, the outbox), so its traces are whole. Limits: code
///   inside a handler that reads `opentelemetry::Context::current()` directly (an
///   OpenTelemetry-only HTTP client's propagator) does not see the attempt (give it
///   `Span::current().context()`); and inside a span that a per-layer filter keeps from this
///   layer (a `debug_span!` with this layer filtered at info), there is no context to find, so a
///   stamp, an enqueue or an outbox row written there carries none (filter this layer globally,
///   or keep such code out of those spans). `.with_context_activation(true)` lifts both;
/// - no `code.*` and `thread.*` attributes, and no `busy_ns`/`idle_ns` timing of every poll.
///
/// On a 2-core machine this layer took about 5 % of the table queue's rate where the layer's
/// defaults took about 7 % (medians of paired runs; less than the defaults in 4 of 5 pairs;
/// docs/performance.md, "OpenTelemetry"). Any `OpenTelemetryLayer` works with brokerfence; this
/// one is a starting point that can be changed with the layer's own `with_*` methods. Its type is
/// `tracing-opentelemetry`'s (0.34): a new major version of that crate is a new one of this.
///
/// ```
/// use opentelemetry::trace::TracerProvider as _;
/// use tracing_subscriber::layer::SubscriberExt;
/// let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
/// let subscriber = tracing_subscriber::registry().with(brokerfence::otel::layer(provider.tracer("my-worker")));
/// tracing::subscriber::with_default(subscriber, || tracing::info!("traced"));
/// ```
pub fn layer<S, T>(tracer: T) -> tracing_opentelemetry::OpenTelemetryLayer<S, T>
where
    S: tracing::Subscriber + for<'span> tracing_subscriber::registry::LookupSpan<'span>,
    T: opentelemetry::trace::Tracer + 'static,
    T::Span: Send + Sync,
{
    tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_context_activation(false)
        .with_location(false)
        .with_threads(false)
        .with_tracked_inactivity(false)
}

/// The attempt's span was just created: parent or link, and the brokerfence attributes.
pub(crate) fn attempt_started(span: &tracing::Span, lease: &Lease) {
    if span.is_disabled() {
        return;
    }
    if ORIGIN.try_with(|origin| started(span, lease, origin)).is_err() {
        started(span, lease, &Origin::default());
    }
}

fn started(span: &tracing::Span, lease: &Lease, origin: &Origin) {
    if let Some(trace) = &origin.trace {
        if lease.attempts <= 1 {
            trace.parent_of(span);
        } else {
            span.add_link(trace.span_context());
        }
    }
    span.set_attribute("messaging.operation.name", "process");
    let id = origin.message_id.as_deref().unwrap_or(lease.key.as_str());
    span.set_attribute("messaging.message.id", id.to_owned());
    span.set_attribute("brokerfence.epoch", lease.epoch);
    span.set_attribute("brokerfence.owner", lease.owner.as_str().to_owned());
    span.set_attribute("brokerfence.attempt", lease.attempts);
}

/// The attempt's outcome, as `brokerfence.outcome` (and the superseding epoch when fenced).
pub(crate) fn attempt_finished(span: &tracing::Span, outcome: &Outcome) {
    if span.is_disabled() {
        return;
    }
    let name = outcome_name(outcome);
    span.set_attribute("brokerfence.outcome", name);
    match outcome {
        Outcome::Completed | Outcome::Released => {}
        Outcome::Fenced(FenceError::Fenced { current_epoch, current_owner, .. }) => {
            span.set_attribute("brokerfence.fenced_by.epoch", *current_epoch);
            if let Some(owner) = current_owner {
                span.set_attribute("brokerfence.fenced_by.owner", owner.clone());
            }
            span.set_status(Status::error(format!("fenced: superseded by epoch {current_epoch}")));
        }
        _ => span.set_status(Status::error(name)),
    }
}

/// Records a delivery of a job already committed (a duplicate: the broker delivered it again, or
/// the producer sent it twice) as an `attempt` span that ends at once, with the attempt's
/// messaging attributes, `brokerfence.outcome = duplicate` and `brokerfence.epoch` the epoch
/// that committed the job. It links to the producer's span (the committed attempt was its
/// child). The consumer runtime and the retrofits record one when a claim answers
/// [`Claim::Done`](crate::Claim::Done); a loop of your own calls it likewise.
///
/// ```
/// use brokerfence::otel::{Origin, duplicate};
/// use brokerfence::{JobKey, QueueName};
/// # fn main() -> Result<(), brokerfence::FenceError> {
/// let origin = Origin::default().message_id("m-1");
/// duplicate(&QueueName::new("orders")?, &JobKey::new("order-7")?, 3, Some("aws_sqs"), &origin);
/// # Ok(()) }
/// ```
pub fn duplicate(queue: &QueueName, key: &JobKey, committed_epoch: i64, system: Option<&str>, origin: &Origin) {
    let span = tracing::info_span!(
        "attempt",
        queue = %queue,
        key = %key,
        epoch = committed_epoch,
        messaging.operation.type = "process",
        messaging.destination.name = %queue,
        messaging.system = system,
    );
    if span.is_disabled() {
        return;
    }
    if let Some(trace) = &origin.trace {
        span.add_link(trace.span_context());
    }
    span.set_attribute("messaging.operation.name", "process");
    span.set_attribute("messaging.message.id", origin.message_id.as_deref().unwrap_or(key.as_str()).to_owned());
    span.set_attribute("brokerfence.epoch", committed_epoch);
    span.set_attribute("brokerfence.outcome", "duplicate");
    span.in_scope(|| tracing::debug!("the job is already committed; the delivery is acknowledged"));
}

/// `brokerfence.outcome` of an attempt.
///
/// ```
/// assert_eq!(brokerfence::otel::outcome_name(&brokerfence::Outcome::Completed), "committed");
/// ```
pub fn outcome_name(outcome: &Outcome) -> &'static str {
    match outcome {
        Outcome::Completed => "committed",
        Outcome::Failed { .. } => "failed",
        Outcome::Dead { .. } => "dead",
        Outcome::LeaseLost { .. } => "lease_lost",
        Outcome::Fenced(_) => "fenced",
        Outcome::Released => "released",
        Outcome::StoreError(_) => "error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TP: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn otel_traceparent_parses_and_round_trips() {
        let tc = TraceContext::parse(TP, Some("rojo=00f067aa0ba902b7")).expect("valid");
        let sc = tc.span_context();
        assert!(sc.is_valid() && sc.is_remote() && sc.is_sampled());
        assert_eq!(TraceContext::from_span_context(&sc), Some(tc));
    }

    #[test]
    fn otel_malformed_traceparents_are_refused() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        ] {
            assert!(TraceContext::parse(bad, None).is_err(), "{bad:?} accepted");
            assert_eq!(TraceContext::read(Some(bad), None, "test"), None);
        }
        // A later version is read by its first four fields.
        assert!(TraceContext::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-xyz", None).is_ok());
        // A bad tracestate is dropped, the traceparent kept.
        let tc = TraceContext::parse(TP, Some("not a list entry")).expect("kept");
        assert_eq!(tc.tracestate(), None);
        // Guards a review finding: a tracestate with a control character, NUL or non-ASCII byte
        // was kept and passed on, and a downstream header or `text` column then refused it.
        for hostile in ["a=x\ny", "a=\0", "a=\u{e9}", "a=\r1", "a=\u{7f}"] {
            let tc = TraceContext::parse(TP, Some(hostile)).expect("the traceparent is kept");
            assert_eq!(tc.tracestate(), None, "{hostile:?} kept");
        }
        assert_eq!(TraceContext::parse(TP, Some("a=1,b=2")).expect("kept").tracestate(), Some("a=1,b=2"));
        // A huge value is refused before it is split.
        assert!(TraceContext::parse(&"-".repeat(100_000), None).is_err());
    }
}
