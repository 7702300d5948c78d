//! Dead-lettering: the queue's dead-letter queue (configured or read from its RedrivePolicy), and
//! the explicit move of a message there with its reason.

use aws_sdk_sqs::types::{MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName};

use std::time::Duration;

use fence::RetryPolicy;

use super::config::{ReceiveCountCheck, visibility_secs};
use super::delivery::{Settled, SqsDelivery};
use super::error::{SqsError, bounded, classify};
use super::source::SqsSource;
use super::state::Redrive;
use crate::source::DeadLettered;

/// Message attribute carrying the reason on a message moved to the dead-letter queue.
pub const REASON_ATTRIBUTE: &str = "Fence-Dead-Letter-Reason";
/// Message attribute carrying the original MessageId on a message moved to the dead-letter queue.
pub const SOURCE_MESSAGE_ID_ATTRIBUTE: &str = "Fence-Source-Message-Id";
/// Longest reason written to [`REASON_ATTRIBUTE`], in bytes.
const MAX_REASON_BYTES: usize = 1024;
/// SQS allows at most ten message attributes per message.
const MAX_ATTRIBUTES: usize = 10;
/// Tries of the delete that follows a dead-letter copy.
const DELETE_TRIES: u32 = 3;
/// The pause before the second try of that delete; it doubles before each further try.
const FIRST_DELETE_PAUSE: Duration = Duration::from_millis(200);
/// All the pauses between those tries (200 ms + 400 ms).
const DELETE_PAUSES: Duration = Duration::from_millis(600);

/// Receives the retry policy needs: one per attempt, plus one more for each 12 h a backoff lasts
/// beyond the first (a retry's visibility is clamped to 12 h, so SQS hands the message out again,
/// counting a receive, before the backoff ends). Returns (receives for the attempts, with
/// `headroom` added).
pub(crate) fn receives_needed(retry: &RetryPolicy, headroom: u32) -> (u32, u32) {
    let attempts = retry.max_attempts.clamp(1, i64::from(u32::MAX / 2));
    let max_visibility = super::config::MAX_VISIBILITY.as_secs();
    let mut receives: u64 = 0;
    for a in 1..=attempts {
        receives += 1;
        if a < attempts {
            let wait = retry.backoff(a).as_secs();
            receives += wait.div_ceil(max_visibility).saturating_sub(1);
        }
    }
    let receives = u32::try_from(receives).unwrap_or(u32::MAX);
    (receives, receives.saturating_add(headroom))
}

impl SqsSource {
    /// The dead-letter queue URL: configured, or read once from the queue's RedrivePolicy.
    ///
    /// ```no_run
    /// # async fn demo(source: brokerfence::sqs::SqsSource) -> Result<(), brokerfence::sqs::SqsError> {
    /// println!("{:?}", source.dead_letter_queue_url().await?);
    /// # Ok(()) }
    /// ```
    pub async fn dead_letter_queue_url(&self) -> Result<Option<String>, SqsError> {
        self.inner.dead_letter_url.get_or_try_init(|| self.discover_dead_letter_queue()).await.cloned()
    }

    /// The queue's RedrivePolicy, read once.
    pub(crate) async fn redrive(&self) -> Result<Redrive, SqsError> {
        self.inner.redrive.get_or_try_init(|| self.read_redrive()).await.cloned()
    }

    async fn read_redrive(&self) -> Result<Redrive, SqsError> {
        let call = async {
            self.inner
                .client
                .get_queue_attributes()
                .queue_url(&self.inner.config.queue_url)
                .attribute_names(QueueAttributeName::RedrivePolicy)
                .send()
                .await
                .map_err(|e| classify("GetQueueAttributes", e))
        };
        let attrs = bounded("GetQueueAttributes", self.inner.config.call_timeout, call)
            .await
            .map_err(|e| self.name_missing_queue(e))?;
        let Some(policy) = attrs.attributes().and_then(|a| a.get(&QueueAttributeName::RedrivePolicy)) else {
            return Ok(Redrive::default());
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(policy) else {
            tracing::warn!(%policy, "cannot read the queue's RedrivePolicy");
            return Ok(Redrive::default());
        };
        let dead_letter_arn = v.get("deadLetterTargetArn").and_then(|a| a.as_str()).map(str::to_owned);
        // SQS writes it as a number; LocalStack and some tools as a string.
        let max_receive_count = v.get("maxReceiveCount").and_then(|m| {
            m.as_u64().and_then(|n| u32::try_from(n).ok()).or_else(|| m.as_str().and_then(|s| s.trim().parse().ok()))
        });
        Ok(Redrive { dead_letter_arn, max_receive_count })
    }

    /// Checks the queue's RedrivePolicy `maxReceiveCount` against what `retry` needs.
    ///
    /// SQS counts *every* receive of a message, and moves it to the dead-letter queue after
    /// `maxReceiveCount` of them, whatever the database says. Besides one receive per attempt,
    /// a job costs a receive for every `Hold` (it was received while another worker held it),
    /// every takeover (a holder stalled and its visibility ran out), and every 12 h of a retry
    /// backoff beyond the first (a retry's visibility is clamped to 12 h). So the rule is
    ///
    /// `maxReceiveCount ≥ receives for max_attempts (with backoffs) + headroom`
    ///
    /// with the headroom from [`SqsConfig::receive_headroom`](super::SqsConfig::receive_headroom)
    /// (default 3). Below it, SQS dead-letters jobs the database still retries. Returns the
    /// queue's `maxReceiveCount` (`None`: no RedrivePolicy, nothing to check), or
    /// [`SqsError::MaxReceiveCountTooLow`] naming the numbers and the fix.
    ///
    /// ```no_run
    /// # async fn demo(source: brokerfence::sqs::SqsSource) -> Result<(), brokerfence::sqs::SqsError> {
    /// source.check_max_receive_count(&brokerfence::RetryPolicy::default()).await?;
    /// # Ok(()) }
    /// ```
    pub async fn check_max_receive_count(&self, retry: &RetryPolicy) -> Result<Option<u32>, SqsError> {
        let Some(max_receive_count) = self.redrive().await?.max_receive_count else { return Ok(None) };
        let headroom = self.inner.config.receive_headroom;
        let (attempts, needed) = receives_needed(retry, headroom);
        if max_receive_count < needed {
            return Err(SqsError::MaxReceiveCountTooLow {
                queue: self.inner.config.queue_url.clone(),
                max_receive_count,
                needed,
                attempts,
                max_attempts: retry.max_attempts,
                headroom,
            });
        }
        Ok(Some(max_receive_count))
    }

    /// The check of [`SqsConfig::check_receive_count`](super::SqsConfig::check_receive_count), once,
    /// at the first receive.
    pub(crate) async fn receive_count_checked(&self) -> Result<(), SqsError> {
        let mode = self.inner.config.receive_check;
        if mode == ReceiveCountCheck::Off {
            return Ok(());
        }
        self.inner
            .receive_checked
            .get_or_try_init(|| async {
                match self.check_max_receive_count(&self.inner.config.retry).await {
                    Ok(_) => Ok(()),
                    Err(e @ SqsError::MaxReceiveCountTooLow { .. }) if mode == ReceiveCountCheck::Warn => {
                        tracing::warn!(error = %e, "RedrivePolicy maxReceiveCount too low for the retry policy");
                        Ok(())
                    }
                    // Warn mode never stops a consumer: a queue policy it may not read (no
                    // sqs:GetQueueAttributes) or a broker hiccup only costs the check.
                    Err(e) if mode == ReceiveCountCheck::Warn => {
                        tracing::warn!(error = %e, "could not read the queue's RedrivePolicy; maxReceiveCount not checked");
                        Ok(())
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "refusing to consume");
                        Err(e)
                    }
                }
            })
            .await
            .copied()
    }

    async fn discover_dead_letter_queue(&self) -> Result<Option<String>, SqsError> {
        let Some(arn) = self.redrive().await?.dead_letter_arn else {
            return Ok(None);
        };
        // arn:aws:sqs:<region>:<account>:<name>
        let parts: Vec<&str> = arn.split(':').collect();
        let (Some(account), Some(name)) = (parts.get(4), parts.get(5)) else {
            tracing::warn!(%arn, "cannot read the dead-letter queue ARN");
            return Ok(None);
        };
        let call = async {
            self.inner
                .client
                .get_queue_url()
                .queue_name(*name)
                .queue_owner_aws_account_id(*account)
                .send()
                .await
                .map_err(|e| classify("GetQueueUrl", e))
        };
        let url = bounded("GetQueueUrl", self.inner.config.call_timeout, call).await?;
        Ok(url.queue_url().map(str::to_owned))
    }

    /// Moves the message to the dead-letter queue with `reason` (attribute
    /// [`REASON_ATTRIBUTE`], the original id in [`SOURCE_MESSAGE_ID_ATTRIBUTE`]), then deletes it.
    ///
    /// The copy is sent once per message and source: the message is first hidden long enough for
    /// the copy and the delete (two [`SqsConfig::call_timeout`](super::SqsConfig::call_timeout)s
    /// and a second), a transient failure of the delete is retried, and when the delete fails for
    /// good the message comes back and its next move here only deletes it. Limit: another worker
    /// (another source) that receives it then sends a second copy, with the same
    /// [`SOURCE_MESSAGE_ID_ATTRIBUTE`] (and on a FIFO dead-letter queue the same deduplication
    /// id, which SQS drops within its five-minute window).
    ///
    /// ```no_run
    /// # async fn demo(source: brokerfence::sqs::SqsSource, d: brokerfence::sqs::SqsDelivery) -> Result<(), brokerfence::sqs::SqsError> {
    /// source.move_to_dead_letter(&d, "body is not JSON").await?;
    /// # Ok(()) }
    /// ```
    pub async fn move_to_dead_letter(&self, d: &SqsDelivery, reason: &str) -> Result<(), SqsError> {
        self.dead_letter_message(d, reason).await.map(|_| ())
    }

    /// [`move_to_dead_letter`](Self::move_to_dead_letter), saying whether this call sent the copy.
    pub(crate) async fn dead_letter_message(&self, d: &SqsDelivery, reason: &str) -> Result<DeadLettered, SqsError> {
        let Some(dlq) = self.dead_letter_queue_url().await? else {
            d.mark(Settled::Kept);
            // It stays in the queue: hide it for a while rather than see it every visibility
            // timeout (longer each time it comes back).
            let hidden_secs = no_dead_letter_hide_secs(d.receive_count());
            if let Err(e) = self.set_visibility(d, hidden_secs).await {
                tracing::debug!(error = %e, "could not hide a message that cannot be dead-lettered");
            }
            return Err(SqsError::NoDeadLetterQueue {
                queue: self.inner.config.queue_url.clone(),
                message_id: d.0.message_id.clone(),
                reason: truncate(reason, 200),
                hidden_secs,
            });
        };
        // The handle must still be ours before anything is copied: otherwise the copy could be
        // sent and the delete refused, or go to the message another receiver now holds.
        if self.inner.registry.usable_handle(&d.0.message_id).is_none() {
            return Err(SqsError::HandleNotOurs { operation: "SendMessage", message_id: d.0.message_id.clone() });
        }
        if let Some(removed) = self.copy_sent(&d.0.message_id) {
            // An earlier move sent the copy: delete only. It completes that move if its delete
            // had failed; else this is a redelivery of a message moved before.
            d.mark(Settled::Removed);
            self.delete_after_copy(d).await?;
            self.copied(&d.0.message_id, true);
            tracing::info!(message_id = %d.0.message_id, dead_letter_queue = %dlq, "message copied to the dead-letter queue before; now deleted");
            return Ok(if removed { DeadLettered::AlreadyMoved } else { DeadLettered::Moved });
        }
        // Hidden for the copy and every try of the delete after it (with their pauses), so the
        // delete does not find the handle run out (it would then come back, to any worker, and
        // be copied again).
        let limit = self.inner.config.call_timeout;
        self.set_visibility(d, visibility_secs(limit * (1 + DELETE_TRIES) + DELETE_PAUSES + Duration::from_secs(1)))
            .await?;
        let send = self.copy_request(d, &dlq, reason)?;
        bounded("SendMessage", limit, async { send.send().await.map_err(|e| classify("SendMessage", e)) }).await?;
        self.copied(&d.0.message_id, false);
        d.mark(Settled::Removed);
        self.delete_after_copy(d).await?;
        self.copied(&d.0.message_id, true);
        tracing::info!(message_id = %d.0.message_id, %reason, dead_letter_queue = %dlq, "message dead-lettered");
        Ok(DeadLettered::Moved)
    }

    /// Whether this source sent a copy of the message (`Some`), and whether its delete went
    /// through.
    fn copy_sent(&self, message_id: &str) -> Option<bool> {
        self.inner.sent_copies.lock().ok().and_then(|sent| sent.get(message_id))
    }

    fn copied(&self, message_id: &str, removed: bool) {
        if let Ok(mut sent) = self.inner.sent_copies.lock() {
            sent.insert(message_id, removed);
        }
    }

    /// The `SendMessage` of the copy: body, the message's attributes (SQS allows ten) and ours.
    fn copy_request(
        &self,
        d: &SqsDelivery,
        dlq: &str,
        reason: &str,
    ) -> Result<aws_sdk_sqs::operation::send_message::builders::SendMessageFluentBuilder, SqsError> {
        let m = d.message();
        let ours = [
            (REASON_ATTRIBUTE, truncate(reason, MAX_REASON_BYTES)),
            (SOURCE_MESSAGE_ID_ATTRIBUTE, d.0.message_id.clone()),
        ];
        let mut send = self.inner.client.send_message().queue_url(dlq).message_body(m.body().unwrap_or(" "));
        let mut room = MAX_ATTRIBUTES - ours.len();
        if let Some(attrs) = m.message_attributes() {
            let mut names: Vec<&String> = attrs.keys().filter(|k| !ours.iter().any(|(n, _)| n == k)).collect();
            // The user's attributes first, then the trace context (`traceparent`, `tracestate`):
            // when there is no room for all, the trace context is what is left out.
            names.sort_by_key(|n| (is_trace_attribute(n), n.as_str()));
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
        if super::config::is_fifo_url(dlq) {
            // The same deduplication id for every copy of the message: SQS drops a repeat within
            // its five-minute window, whichever worker sends it.
            let group = d.group().unwrap_or("dead-letter").to_owned();
            let dedup = m
                .attributes()
                .and_then(|a| a.get(&MessageSystemAttributeName::MessageDeduplicationId))
                .cloned()
                .unwrap_or_else(|| d.0.message_id.clone());
            send = send.message_group_id(group).message_deduplication_id(dedup);
        }
        Ok(send)
    }

    /// The delete after a copy: transient failures retried (a failure here sends the message
    /// back, and another worker would copy it again), while the handle is ours.
    async fn delete_after_copy(&self, d: &SqsDelivery) -> Result<(), SqsError> {
        let mut pause = FIRST_DELETE_PAUSE;
        let mut tries = 1;
        loop {
            match self.delete_one(d).await {
                // A handle no longer ours stays so: no retry can succeed.
                Err(e @ SqsError::HandleNotOurs { .. }) => return Err(e),
                Err(e) if e.is_transient() && tries < DELETE_TRIES => {
                    tracing::debug!(error = %e, tries, "delete after the dead-letter copy failed; retrying");
                    tokio::time::sleep(pause).await;
                    pause *= 2;
                    tries += 1;
                }
                done => return done,
            }
        }
    }
}

/// How long a message that cannot be dead-lettered (no dead-letter queue) is hidden: a minute,
/// doubling with each receive, at most 12 h.
fn no_dead_letter_hide_secs(receive_count: u32) -> i32 {
    let doublings = receive_count.saturating_sub(1).min(10);
    let secs = 60u64 << doublings;
    i32::try_from(secs.min(super::config::MAX_VISIBILITY.as_secs())).unwrap_or(43_200)
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

/// Whether an attribute is the W3C trace context a producer adds (`traceparent`, `tracestate`).
fn is_trace_attribute(name: &str) -> bool {
    name.eq_ignore_ascii_case("traceparent") || name.eq_ignore_ascii_case("tracestate")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use fence::RetryPolicy;

    use super::receives_needed;

    /// Guards a review finding: the copy kept the message's attributes by name, so with eight
    /// of them plus the trace context, user attributes named after `tracestate` were dropped.
    #[test]
    fn otel_dead_letter_copies_drop_the_trace_context_before_user_attributes() {
        let mut names = vec!["zone", "traceparent", "alpha", "tracestate", "user-id"];
        names.sort_by_key(|n| (super::is_trace_attribute(n), *n));
        assert_eq!(names, ["alpha", "user-id", "zone", "traceparent", "tracestate"]);
    }

    #[test]
    fn receives_needed_counts_attempts_long_backoffs_and_headroom() {
        let policy = RetryPolicy {
            max_attempts: 5,
            base_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(300),
        };
        assert_eq!(receives_needed(&policy, 3), (5, 8));
        let day = Duration::from_secs(30 * 3600);
        let long = RetryPolicy { max_attempts: 2, base_backoff: day, max_backoff: day };
        assert_eq!(receives_needed(&long, 0), (4, 4)); // 2 attempts + 2 more for a 30 h wait
    }
}
