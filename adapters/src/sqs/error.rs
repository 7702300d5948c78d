//! Typed errors of the SQS adapter, and the one place that decides which SQS failures are worth
//! retrying.

use aws_sdk_sqs::config::http::HttpResponse;
use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};

use crate::source::SourceError;

/// What went wrong talking to SQS.
///
/// ```
/// use brokerfence::sqs::SqsError;
/// let e = SqsError::Transient { operation: "ReceiveMessage", code: Some("ThrottlingException".into()), message: "slow down".into() };
/// assert!(e.is_transient());
/// assert_eq!(e.code(), Some("ThrottlingException"));
/// ```
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SqsError {
    /// The queue URL cannot be used (it names no queue).
    #[error("invalid queue URL {url:?}: {reason}")]
    InvalidQueueUrl {
        /// The URL given.
        url: String,
        /// Why it was rejected.
        reason: String,
    },
    /// Throttling, a dropped connection, a timeout or a server-side error: worth retrying.
    #[error("SQS {operation} failed transiently ({}): {message}", code.as_deref().unwrap_or("no code"))]
    Transient {
        /// The SQS operation.
        operation: &'static str,
        /// The error code SQS answered with, if any.
        code: Option<String>,
        /// The full error text.
        message: String,
    },
    /// A request SQS refused for good (missing queue, permissions, bad parameter).
    #[error("SQS {operation} failed ({}): {message}", code.as_deref().unwrap_or("no code"))]
    Service {
        /// The SQS operation.
        operation: &'static str,
        /// The error code SQS answered with, if any.
        code: Option<String>,
        /// The full error text.
        message: String,
    },
    /// Entries of a batch call still failed after the retries (their messages come back and are
    /// deduplicated by the fence).
    #[error("SQS {operation}: {failed} entries failed: {summary}")]
    BatchEntries {
        /// The SQS batch operation.
        operation: &'static str,
        /// How many entries failed.
        failed: usize,
        /// Codes and messages of the failures.
        summary: String,
        /// Whether any failure was on the server side (worth retrying).
        transient: bool,
    },
    /// A message to dead-letter, but the queue has no dead-letter queue (no RedrivePolicy and none
    /// configured). The message stays in the queue, hidden for a while, and comes back; a message
    /// without a job key is not deduplicated by the fence, so it keeps coming back until a
    /// dead-letter queue is set.
    #[error(
        "queue {queue} has no dead-letter queue, so message {message_id} ({reason}) stays in the queue and \
         comes back after {hidden_secs} s; set a RedrivePolicy with a deadLetterTargetArn on the queue, or \
         SqsConfig::dead_letter(DeadLetterTarget::Queue(url))"
    )]
    NoDeadLetterQueue {
        /// The queue URL.
        queue: String,
        /// The message.
        message_id: String,
        /// Why it was to be dead-lettered.
        reason: String,
        /// How long it is hidden before it comes back.
        hidden_secs: i32,
    },
    /// An SQS call did not answer in time (the SDK's timeouts, or the bound the source keeps on
    /// calls made for a lease). Transient: the message comes back and the fence deduplicates it.
    #[error("SQS {operation} timed out{}: {message}", after.map(|d| format!(" after {d:?}")).unwrap_or_default())]
    Timeout {
        /// The SQS operation.
        operation: &'static str,
        /// The bound that ran out, when the source set it.
        after: Option<std::time::Duration>,
        /// The full error text.
        message: String,
    },
    /// The queue's RedrivePolicy moves a message to its dead-letter queue after fewer receives
    /// than the retry policy needs: SQS would dead-letter jobs the database still retries.
    #[error(
        "queue {queue}: RedrivePolicy maxReceiveCount is {max_receive_count}, but the retry policy needs {needed} \
         receives ({attempts} for max_attempts = {max_attempts} with its backoffs, plus {headroom} for holds and \
         takeovers): SQS would dead-letter jobs the database still retries; raise maxReceiveCount to at least \
         {needed}, or lower max_attempts"
    )]
    MaxReceiveCountTooLow {
        /// The queue URL.
        queue: String,
        /// The queue's maxReceiveCount.
        max_receive_count: u32,
        /// The least maxReceiveCount that fits.
        needed: u32,
        /// Receives the attempts take.
        attempts: u32,
        /// The retry policy's max_attempts.
        max_attempts: i64,
        /// Receives allowed for holds and takeovers.
        headroom: u32,
    },
    /// The receipt handle this process holds for the message may be stale (the visibility set
    /// with it ran out, so another receiver may hold a newer one): the call was not made.
    /// Transient: the message comes back, and its redelivery is settled.
    #[error("SQS {operation} not sent for message {message_id}: its receipt handle may be stale (visibility ran out)")]
    HandleNotOurs {
        /// The SQS operation not sent.
        operation: &'static str,
        /// The message.
        message_id: String,
    },
    /// The queue does not exist (in this region, at this endpoint, for these credentials):
    /// found by [`SqsSource::check`](super::SqsSource::check) before the first receive.
    ///
    /// ```
    /// use brokerfence::sqs::SqsError;
    /// let e = SqsError::QueueNotFound {
    ///     queue_url: "http://127.0.0.1:4566/000000000000/orders".into(),
    ///     endpoint: "http://127.0.0.1:4566".into(),
    ///     region: "us-east-1".into(),
    /// };
    /// assert_eq!(
    ///     e.to_string(),
    ///     "SQS queue http://127.0.0.1:4566/000000000000/orders does not exist (endpoint http://127.0.0.1:4566, \
    ///      region us-east-1); check the queue URL (SqsConfig::new), the region and the endpoint"
    /// );
    /// assert!(!e.is_transient());
    /// ```
    #[error(
        "SQS queue {queue_url} does not exist (endpoint {endpoint}, region {region}); check the queue URL \
         (SqsConfig::new), the region and the endpoint"
    )]
    QueueNotFound {
        /// The queue URL.
        queue_url: String,
        /// The SQS endpoint the client sends to (`AWS_ENDPOINT_URL_SQS` / `AWS_ENDPOINT_URL`, or
        /// "the AWS default").
        endpoint: String,
        /// The client's region.
        region: String,
    },
    /// SQS did not answer (connection refused, a name that does not resolve, timeouts) in any of
    /// the attempts [`SqsSource::check`](super::SqsSource::check) made.
    ///
    /// ```
    /// use brokerfence::sqs::SqsError;
    /// let e = SqsError::Unreachable {
    ///     endpoint: "http://127.0.0.1:1".into(),
    ///     queue_url: "http://127.0.0.1:1/000000000000/orders".into(),
    ///     attempts: 3,
    ///     cause: "connection refused (os error 111)".into(),
    /// };
    /// assert!(e.to_string().starts_with("cannot reach SQS at http://127.0.0.1:1 (queue http://127.0.0.1:1/000000000000/orders) after 3 attempts: connection refused"));
    /// ```
    #[error(
        "cannot reach SQS at {endpoint} (queue {queue_url}) after {attempts} attempts: {cause}; check that the \
         endpoint is up, and AWS_ENDPOINT_URL_SQS (or AWS_ENDPOINT_URL) and AWS_REGION"
    )]
    Unreachable {
        /// The SQS endpoint.
        endpoint: String,
        /// The queue URL.
        queue_url: String,
        /// How many attempts were made.
        attempts: u32,
        /// The cause of the last one.
        cause: String,
    },
    /// A received message lacks a field SQS always sends (id or receipt handle).
    #[error("received message has no {what}")]
    Incomplete {
        /// The missing field.
        what: &'static str,
    },
}

impl SqsError {
    /// True when the same call may succeed later.
    pub fn is_transient(&self) -> bool {
        match self {
            SqsError::Transient { .. }
            | SqsError::Timeout { .. }
            | SqsError::HandleNotOurs { .. }
            | SqsError::Unreachable { .. } => true,
            SqsError::BatchEntries { transient, .. } => *transient,
            _ => false,
        }
    }

    /// The SQS error code, when SQS answered with one.
    pub fn code(&self) -> Option<&str> {
        match self {
            SqsError::Transient { code, .. } | SqsError::Service { code, .. } => code.as_deref(),
            _ => None,
        }
    }
}

impl From<SqsError> for SourceError {
    fn from(e: SqsError) -> Self {
        if e.is_transient() { SourceError::Transient(Box::new(e)) } else { SourceError::Fatal(Box::new(e)) }
    }
}

/// Error codes SQS uses for throttling and server-side trouble (they also arrive untyped, so
/// match on the code).
const TRANSIENT_CODES: &[&str] = &[
    "ThrottlingException",
    "Throttling",
    "RequestThrottled",
    "AWS.SimpleQueueService.RequestThrottled",
    "OverLimit",
    "KmsThrottled",
    "ServiceUnavailable",
    "AWS.SimpleQueueService.ServiceUnavailable",
    "InternalError",
    "InternalFailure",
    "RequestTimeout",
    "RequestTimeoutException",
    "SlowDown",
];

/// Runs one SQS call bounded by `limit`: past it, [`SqsError::Timeout`].
pub(crate) async fn bounded<T>(
    operation: &'static str,
    limit: std::time::Duration,
    call: impl std::future::Future<Output = Result<T, SqsError>>,
) -> Result<T, SqsError> {
    match tokio::time::timeout(limit, call).await {
        Ok(r) => r,
        Err(_) => Err(SqsError::Timeout {
            operation,
            after: Some(limit),
            message: "no answer within the bound the source keeps on this call".into(),
        }),
    }
}

/// True for an error code that says: try again later.
pub(crate) fn is_transient_code(code: &str) -> bool {
    TRANSIENT_CODES.contains(&code)
}

/// Error codes SQS answers for a queue that does not exist (JSON and query protocols).
pub(crate) fn is_missing_queue_code(code: &str) -> bool {
    matches!(code, "AWS.SimpleQueueService.NonExistentQueue" | "QueueDoesNotExist" | "NonExistentQueue")
}

/// The short cause of an SDK error, for one log line: the service's code and message, or the
/// innermost error of a failed dispatch ("connection refused (os error 111)") with its kind.
pub(crate) fn short_cause<E>(err: &SdkError<E, HttpResponse>) -> String
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    if let SdkError::ServiceError(_) = err {
        return sdk_error_text(err);
    }
    let kind = match err {
        SdkError::TimeoutError(_) => "timed out",
        SdkError::DispatchFailure(_) => "could not send the request",
        SdkError::ResponseError(_) => "unreadable response",
        SdkError::ConstructionFailure(_) => "could not build the request",
        _ => "failed",
    };
    let mut innermost: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(err);
    while let Some(next) = innermost.and_then(std::error::Error::source) {
        innermost = Some(next);
    }
    match innermost.map(ToString::to_string).filter(|s| !s.is_empty()) {
        Some(text) => {
            let mut chars = text.chars();
            let text: String = chars.next().map(|c| c.to_lowercase().chain(chars).collect()).unwrap_or(text);
            format!("{kind}: {text}")
        }
        None => kind.to_owned(),
    }
}

/// An error and its causes on one line, each message once, joined by ": " (the chain
/// `DisplayErrorContext` prints, without the `Debug` dump it appends: for an SDK service error
/// that dump holds the whole HTTP response, headers and body, some 2 KB).
///
/// ```
/// let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused (os error 111)");
/// assert_eq!(brokerfence::sqs::error_chain(&io), "Connection refused (os error 111)");
/// ```
pub fn error_chain(err: &(dyn std::error::Error + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut next = Some(err);
    while let Some(e) = next {
        let text = e.to_string();
        // A wrapper that repeats its source's text (or ends with it) adds nothing.
        if !text.is_empty() && !parts.last().is_some_and(|p| p.ends_with(&text)) {
            parts.push(text);
        }
        next = e.source();
    }
    parts.join(": ")
}

/// The text of an SDK error: for an answer of SQS its code, message and HTTP status; otherwise
/// the chain of causes ([`error_chain`]).
pub(crate) fn sdk_error_text<E>(err: &SdkError<E, HttpResponse>) -> String
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    if let SdkError::ServiceError(ctx) = err {
        let status = ctx.raw().status().as_u16();
        match (ctx.err().code(), ctx.err().message()) {
            (Some(code), Some(message)) => return format!("{code}: {message} (HTTP {status})"),
            (Some(code), None) => return format!("{code} (HTTP {status})"),
            _ => return format!("{} (HTTP {status})", error_chain(ctx.err())),
        }
    }
    error_chain(err)
}

/// Classifies an SDK error: throttling, 5xx, timeouts and connection failures are transient;
/// everything SQS refused on purpose is not.
pub(crate) fn classify<E>(operation: &'static str, err: SdkError<E, HttpResponse>) -> SqsError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let message = sdk_error_text(&err);
    match &err {
        SdkError::ServiceError(ctx) => {
            let code = ctx.err().code().map(str::to_owned);
            let status = ctx.raw().status().as_u16();
            let transient = status >= 500 || status == 429 || code.as_deref().is_some_and(is_transient_code);
            if transient {
                SqsError::Transient { operation, code, message }
            } else {
                SqsError::Service { operation, code, message }
            }
        }
        SdkError::ConstructionFailure(_) => SqsError::Service { operation, code: None, message },
        SdkError::TimeoutError(_) => SqsError::Timeout { operation, after: None, message },
        // Timeouts, dispatch (connection) failures, unreadable responses, and anything newer.
        _ => SqsError::Transient { operation, code: None, message },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_codes_map_to_transient_source_errors() {
        assert!(is_transient_code("ThrottlingException"));
        assert!(!is_transient_code("AWS.SimpleQueueService.NonExistentQueue"));
        let e: SourceError =
            SqsError::Transient { operation: "ReceiveMessage", code: None, message: "reset".into() }.into();
        assert!(matches!(e, SourceError::Transient(_)));
        let e: SourceError = SqsError::Service {
            operation: "ReceiveMessage",
            code: Some("AWS.SimpleQueueService.NonExistentQueue".into()),
            message: "gone".into(),
        }
        .into();
        assert!(matches!(e, SourceError::Fatal(_)));
    }
}
