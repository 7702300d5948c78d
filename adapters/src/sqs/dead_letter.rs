//! Dead-lettering: the queue's dead-letter queue (configured or read from its RedrivePolicy), and
//! the explicit move of a message there with its reason.

use aws_sdk_sqs::types::{MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName};

use super::delivery::{Settled, SqsDelivery};
use super::error::{SqsError, classify};
use super::source::SqsSource;

/// Message attribute carrying the reason on a message moved to the dead-letter queue.
pub const REASON_ATTRIBUTE: &str = "Fence-Dead-Letter-Reason";
/// Message attribute carrying the original MessageId on a message moved to the dead-letter queue.
pub const SOURCE_MESSAGE_ID_ATTRIBUTE: &str = "Fence-Source-Message-Id";
/// Longest reason written to [`REASON_ATTRIBUTE`], in bytes.
const MAX_REASON_BYTES: usize = 1024;
/// SQS allows at most ten message attributes per message.
const MAX_ATTRIBUTES: usize = 10;

impl SqsSource {
    /// The dead-letter queue URL: configured, or read once from the queue's RedrivePolicy.
    ///
    /// ```no_run
    /// # async fn demo(source: adapters::sqs::SqsSource) -> Result<(), adapters::sqs::SqsError> {
    /// println!("{:?}", source.dead_letter_queue_url().await?);
    /// # Ok(()) }
    /// ```
    pub async fn dead_letter_queue_url(&self) -> Result<Option<String>, SqsError> {
        self.inner.dead_letter_url.get_or_try_init(|| self.discover_dead_letter_queue()).await.cloned()
    }

    async fn discover_dead_letter_queue(&self) -> Result<Option<String>, SqsError> {
        let attrs = self
            .inner
            .client
            .get_queue_attributes()
            .queue_url(&self.inner.config.queue_url)
            .attribute_names(QueueAttributeName::RedrivePolicy)
            .send()
            .await
            .map_err(|e| classify("GetQueueAttributes", e))?;
        let Some(policy) = attrs.attributes().and_then(|a| a.get(&QueueAttributeName::RedrivePolicy)) else {
            return Ok(None);
        };
        let arn = serde_json::from_str::<serde_json::Value>(policy)
            .ok()
            .and_then(|v| v.get("deadLetterTargetArn").and_then(|a| a.as_str()).map(str::to_owned));
        let Some(arn) = arn else {
            tracing::warn!(%policy, "RedrivePolicy names no deadLetterTargetArn");
            return Ok(None);
        };
        // arn:aws:sqs:<region>:<account>:<name>
        let parts: Vec<&str> = arn.split(':').collect();
        let (Some(account), Some(name)) = (parts.get(4), parts.get(5)) else {
            tracing::warn!(%arn, "cannot read the dead-letter queue ARN");
            return Ok(None);
        };
        let url = self
            .inner
            .client
            .get_queue_url()
            .queue_name(*name)
            .queue_owner_aws_account_id(*account)
            .send()
            .await
            .map_err(|e| classify("GetQueueUrl", e))?;
        Ok(url.queue_url().map(str::to_owned))
    }

    /// Moves the message to the dead-letter queue with `reason` (attribute
    /// [`REASON_ATTRIBUTE`], the original id in [`SOURCE_MESSAGE_ID_ATTRIBUTE`]), then deletes it.
    ///
    /// ```no_run
    /// # async fn demo(source: adapters::sqs::SqsSource, d: adapters::sqs::SqsDelivery) -> Result<(), adapters::sqs::SqsError> {
    /// source.move_to_dead_letter(&d, "body is not JSON").await?;
    /// # Ok(()) }
    /// ```
    pub async fn move_to_dead_letter(&self, d: &SqsDelivery, reason: &str) -> Result<(), SqsError> {
        let Some(dlq) = self.dead_letter_queue_url().await? else {
            d.mark(Settled::Kept);
            return Err(SqsError::NoDeadLetterQueue { queue: self.inner.config.queue_url.clone() });
        };
        let m = d.message();
        let ours = [
            (REASON_ATTRIBUTE, truncate(reason, MAX_REASON_BYTES)),
            (SOURCE_MESSAGE_ID_ATTRIBUTE, d.0.message_id.clone()),
        ];
        let mut send = self.inner.client.send_message().queue_url(&dlq).message_body(m.body().unwrap_or(" "));
        let mut room = MAX_ATTRIBUTES - ours.len();
        if let Some(attrs) = m.message_attributes() {
            let mut names: Vec<&String> = attrs.keys().filter(|k| !ours.iter().any(|(n, _)| n == k)).collect();
            names.sort();
            for name in names {
                if room == 0 {
                    tracing::warn!(attribute = %name, "dead-letter copy drops an attribute (SQS allows ten)");
                    continue;
                }
                if let Some(v) = attrs.get(name) {
                    send = send.message_attributes(name, v.clone());
                    room -= 1;
                }
            }
        }
        for (name, value) in ours {
            let v = MessageAttributeValue::builder()
                .data_type("String")
                .string_value(value)
                .build()
                .map_err(|e| SqsError::Service { operation: "SendMessage", code: None, message: e.to_string() })?;
            send = send.message_attributes(name, v);
        }
        if super::config::is_fifo_url(&dlq) {
            let group = d.group().unwrap_or("dead-letter").to_owned();
            let dedup = m
                .attributes()
                .and_then(|a| a.get(&MessageSystemAttributeName::MessageDeduplicationId))
                .cloned()
                .unwrap_or_else(|| d.0.message_id.clone());
            send = send.message_group_id(group).message_deduplication_id(dedup);
        }
        send.send().await.map_err(|e| classify("SendMessage", e))?;
        d.mark(Settled::Removed);
        self.inner
            .client
            .delete_message()
            .queue_url(&self.inner.config.queue_url)
            .receipt_handle(self.inner.registry.newest_handle(d))
            .send()
            .await
            .map_err(|e| classify("DeleteMessage", e))?;
        tracing::info!(message_id = %d.0.message_id, %reason, dead_letter_queue = %dlq, "message dead-lettered");
        Ok(())
    }
}

fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_owned();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}
