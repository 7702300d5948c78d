//! The consumer runtime's side of the feature `otel`: the origin of a delivery (its producer's
//! trace context and message id) and the scope an attempt runs in. Without the feature every
//! function here is a no-op on `()`, so the runtime's code reads the same either way.

#[cfg(feature = "otel")]
pub(crate) use enabled::*;

#[cfg(not(feature = "otel"))]
pub(crate) use disabled::*;

#[cfg(feature = "otel")]
mod enabled {
    use crate::Source;
    use fence::{ClaimedJob, JobKey, QueueName};

    /// Where a delivery came from (see `fence::otel::Origin`).
    pub(crate) type Origin = fence::otel::Origin;

    /// The origin a source reads off a delivery.
    pub(crate) fn of_delivery<S: Source>(source: &S, delivery: &S::Delivery) -> Origin {
        source.origin(delivery)
    }

    /// The origin of a job the source claimed itself (the table queue): the context stored with
    /// the row unless the source read one off the delivery.
    pub(crate) fn of_job<S: Source>(source: &S, delivery: &S::Delivery, job: &ClaimedJob) -> Origin {
        let origin = source.origin(delivery);
        if origin.get_trace().is_some() {
            return origin;
        }
        let id = origin.get_message_id().map_or_else(|| job.lease.key.to_string(), str::to_owned);
        Origin::new(job.trace.clone()).message_id(id)
    }

    /// Runs an attempt inside its origin.
    pub(crate) async fn scope<F: Future>(origin: Origin, attempt: F) -> F::Output {
        fence::otel::scope(origin, attempt).await
    }

    /// A delivery of a job already committed (at `epoch`): a `duplicate` attempt span (see
    /// `fence::otel::duplicate`).
    pub(crate) fn duplicate(queue: &QueueName, key: &JobKey, epoch: i64, system: Option<&str>, origin: &Origin) {
        fence::otel::duplicate(queue, key, epoch, system, origin);
    }

    /// The origin of the scope the caller runs in (a retrofit inside `fence::otel::scope`).
    pub(crate) fn current_origin() -> Origin {
        fence::otel::current_origin()
    }

    /// A receiver's span, a child of the sender's context (its `traceparent` header).
    #[cfg(feature = "http")]
    pub(crate) fn receiver_span(headers: &axum::http::HeaderMap) -> tracing::Span {
        let span = tracing::info_span!(
            "fenced_receiver",
            otel.kind = "server",
            http.response.status_code = tracing::field::Empty
        );
        continue_from(&span, headers);
        span
    }

    /// The receiver's answer, on its span.
    #[cfg(feature = "http")]
    pub(crate) fn answered(span: &tracing::Span, status: u16) {
        span.record("http.response.status_code", status);
    }

    /// Makes the sender's context (its `traceparent` header) the parent of `span`.
    #[cfg(feature = "http")]
    pub(crate) fn continue_from(span: &tracing::Span, headers: &axum::http::HeaderMap) {
        let pairs = headers.iter().filter_map(|(k, v)| Some((k.as_str(), v.to_str().ok()?)));
        if let Some(tc) = fence::otel::TraceContext::from_headers(pairs) {
            tc.parent_of(span);
        }
    }
}

#[cfg(not(feature = "otel"))]
mod disabled {
    use crate::Source;
    use fence::{ClaimedJob, JobKey, QueueName};

    /// Nothing, without the feature.
    pub(crate) type Origin = ();

    pub(crate) fn of_delivery<S: Source>(_: &S, _: &S::Delivery) -> Origin {}

    pub(crate) fn of_job<S: Source>(_: &S, _: &S::Delivery, _: &ClaimedJob) -> Origin {}

    /// The attempt itself.
    pub(crate) fn scope<F: Future>(_: Origin, attempt: F) -> F {
        attempt
    }

    /// No span.
    pub(crate) fn duplicate(_: &QueueName, _: &JobKey, _: i64, _: Option<&str>, _: &Origin) {}

    pub(crate) fn current_origin() -> Origin {}

    /// No span.
    #[cfg(feature = "http")]
    pub(crate) fn receiver_span(_: &axum::http::HeaderMap) -> tracing::Span {
        tracing::Span::none()
    }

    #[cfg(all(feature = "http", feature = "postgres"))]
    pub(crate) fn continue_from(_: &tracing::Span, _: &axum::http::HeaderMap) {}

    #[cfg(feature = "http")]
    pub(crate) fn answered(_: &tracing::Span, _: u16) {}
}
