//! The W3C trace context as SQS message attributes (feature `otel`).
//!
//! SQS takes at most [`MAX_MESSAGE_ATTRIBUTES`] (10) attributes per message. The context never
//! pushes out an attribute of yours: when a message already has 10, it is sent without the
//! context (a warning says so); with 9, `traceparent` is added and `tracestate` left out.

use aws_sdk_sqs::operation::send_message::builders::SendMessageFluentBuilder;
use aws_sdk_sqs::types::MessageAttributeValue;
use aws_sdk_sqs::types::builders::SendMessageBatchRequestEntryBuilder;
use fence::otel::{Origin, TRACEPARENT, TRACESTATE, TraceContext};

use super::SqsDelivery;

/// The most message attributes SQS accepts on one message.
pub const MAX_MESSAGE_ATTRIBUTES: usize = 10;

/// The attributes that carry `trace`, as many as fit beside `existing` attributes.
fn attributes(trace: &TraceContext, existing: usize) -> Vec<(&'static str, MessageAttributeValue)> {
    let room = MAX_MESSAGE_ATTRIBUTES.saturating_sub(existing);
    let mut out = Vec::with_capacity(2);
    for (name, value) in trace.to_headers().into_iter().take(room) {
        if let Ok(v) = MessageAttributeValue::builder().data_type("String").string_value(value).build() {
            out.push((name, v));
        }
    }
    if out.is_empty() {
        tracing::warn!(
            attributes = existing,
            "SQS message already has {MAX_MESSAGE_ATTRIBUTES} attributes: sent without its trace context"
        );
    } else if out.len() < trace.to_headers().len() {
        tracing::debug!(attributes = existing, "SQS message attribute limit: tracestate left out");
    }
    out
}

/// Adds the current span's trace context to a `SendMessage` call as the attributes
/// `traceparent` (and `tracestate`), without pushing out any attribute already set; outside a
/// traced span the call is unchanged.
///
/// ```no_run
/// # async fn demo(client: brokerfence::sqs::aws_sdk_sqs::Client) -> Result<(), Box<dyn std::error::Error>> {
/// let send = client.send_message().queue_url("http://127.0.0.1:4566/000000000000/orders").message_body("o-1");
/// brokerfence::sqs::traced(send).send().await?;
/// # Ok(()) }
/// ```
pub fn traced(send: SendMessageFluentBuilder) -> SendMessageFluentBuilder {
    let Some(trace) = TraceContext::current() else { return send };
    let existing = send.get_message_attributes().as_ref().map_or(0, |a| a.len());
    attributes(&trace, existing).into_iter().fold(send, |send, (name, v)| send.message_attributes(name, v))
}

/// [`traced`] for one entry of a `SendMessageBatch` call.
///
/// ```
/// use brokerfence::sqs::aws_sdk_sqs::types::SendMessageBatchRequestEntry;
/// let entry = brokerfence::sqs::traced_entry(SendMessageBatchRequestEntry::builder().id("1").message_body("b"));
/// assert!(entry.get_message_attributes().is_none()); // outside a traced span: unchanged
/// ```
pub fn traced_entry(entry: SendMessageBatchRequestEntryBuilder) -> SendMessageBatchRequestEntryBuilder {
    let Some(trace) = TraceContext::current() else { return entry };
    with_trace(entry, &trace)
}

/// Adds `trace` to a batch entry as far as the attribute limit allows.
pub(crate) fn with_trace(
    entry: SendMessageBatchRequestEntryBuilder,
    trace: &TraceContext,
) -> SendMessageBatchRequestEntryBuilder {
    let existing = entry.get_message_attributes().as_ref().map_or(0, |a| a.len());
    attributes(trace, existing).into_iter().fold(entry, |entry, (name, v)| entry.message_attributes(name, v))
}

/// The origin of a received message: its trace context attributes and its message id.
pub(crate) fn origin(delivery: &SqsDelivery) -> Origin {
    let attrs = delivery.0.message.message_attributes();
    let value = |name: &str| {
        attrs.and_then(|a| a.iter().find(|(k, _)| k.eq_ignore_ascii_case(name))).and_then(|(_, v)| v.string_value())
    };
    let source = "SQS message attribute";
    Origin::new(TraceContext::read(value(TRACEPARENT), value(TRACESTATE), source)).message_id(delivery.message_id())
}
