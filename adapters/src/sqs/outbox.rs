//! The outbox relay's SQS publisher: `SendMessageBatch`, the fence stamp as message attributes.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{MessageAttributeValue, SendMessageBatchRequestEntry};
use fence::outbox::OutboxRow;

use super::config::is_fifo_url;
use super::error::{SqsError, bounded, classify};
use crate::builder::setters;
use crate::outbox::{OUTBOX_ID, PublishError, Published, Publisher};

/// Publishes outbox rows to SQS queues, ten per `SendMessageBatch`.
///
/// Each row's destination names a queue through [`route`](Self::route). The message body is the
/// row's payload, which must be UTF-8 text SQS accepts (a row whose payload is not stays unsent,
/// with [`PublishError::Encode`]); its attributes are the fence stamp (`Fence-Queue`, `Fence-Job`,
/// `Fence-Epoch`, `Fence-Owner`, type `String`, see [`brokerfence::wire`](fence::wire)) and [`OUTBOX_ID`]. On a FIFO
/// queue the message group is the job key and the deduplication id the outbox row id with the
/// epoch and job, so a relay's re-send within five minutes is dropped by SQS. Only entries SQS lists as successful
/// count as accepted; every call is bounded by the call timeout (default 10 s).
///
/// ```no_run
/// # async fn demo(fence: brokerfence::PgFence) {
/// use std::sync::Arc;
/// use brokerfence::outbox::{OutboxRelay, RelayConfig};
/// use brokerfence::sqs::{SqsPublisher};
/// let sqs = SqsPublisher::new(brokerfence::sqs::client(brokerfence::sqs::aws_config::from_env(), brokerfence::sqs::SqsTimeouts::default()).await)
///     .route("billing", "http://127.0.0.1:4566/000000000000/billing");
/// let relay = OutboxRelay::new(fence, RelayConfig::default()).publisher(Arc::new(sqs));
/// # let _ = relay; }
/// ```
#[derive(Debug, Clone)]
pub struct SqsPublisher {
    client: Client,
    routes: HashMap<String, String>,
    call_timeout: Duration,
}

impl SqsPublisher {
    /// A publisher with no routes.
    pub fn new(client: Client) -> Self {
        Self { client, routes: HashMap::new(), call_timeout: Duration::from_secs(10) }
    }

    /// Sends rows of `destination` to the queue at `queue_url`.
    pub fn route(mut self, destination: impl Into<String>, queue_url: impl Into<String>) -> Self {
        self.routes.insert(destination.into(), queue_url.into());
        self
    }

    setters! {
        /// Bound of each `SendMessageBatch` call (default 10 s).
        pub fn call_timeout(timeout: Duration) { call_timeout = timeout.max(Duration::from_millis(1)) }
    }

    fn entry(row: &OutboxRow, fifo: bool) -> Result<SendMessageBatchRequestEntry, PublishError> {
        let body = std::str::from_utf8(&row.payload)
            .map_err(|e| PublishError::Encode(format!("payload is not UTF-8 ({e}); SQS bodies are text")))?;
        if body.is_empty() {
            return Err(PublishError::Encode("empty payload; SQS needs a body".into()));
        }
        let attr = |v: String| {
            MessageAttributeValue::builder()
                .data_type("String")
                .string_value(v)
                .build()
                .map_err(|e| PublishError::Encode(e.to_string()))
        };
        let mut entry = SendMessageBatchRequestEntry::builder().id(row.id.to_string()).message_body(body);
        for (name, value) in row.to_headers() {
            entry = entry.message_attributes(name, attr(value)?);
        }
        entry = entry.message_attributes(OUTBOX_ID, attr(row.id.to_string())?);
        if fifo {
            let group: String = fence::wire::encode(&row.key).chars().take(128).collect();
            // Row id, epoch and job: two outboxes (schemas) sharing a FIFO queue would need
            // equal ids, epochs and keys to collide within SQS's five-minute window.
            let dedup: String = format!("{}-{}-{}", row.id, row.epoch, fence::wire::encode(&row.stamp().ledger_job()))
                .chars()
                .take(128)
                .collect();
            entry = entry.message_group_id(group).message_deduplication_id(dedup);
        }
        entry.build().map_err(|e| PublishError::Encode(e.to_string()))
    }

    async fn send(&self, url: &str, rows: &[&OutboxRow]) -> Published {
        let mut out = Published::default();
        let fifo = is_fifo_url(url);
        let mut entries = Vec::with_capacity(rows.len());
        for row in rows {
            match Self::entry(row, fifo) {
                Ok(e) => entries.push(e),
                Err(e) => out.failed.push((row.id, e)),
            }
        }
        if entries.is_empty() {
            return out;
        }
        let sent: Vec<String> = entries.iter().map(|e| e.id().to_owned()).collect();
        let call = async {
            self.client
                .send_message_batch()
                .queue_url(url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(|e| classify("SendMessageBatch", e))
        };
        match bounded("SendMessageBatch", self.call_timeout, call).await {
            Ok(answer) => {
                for ok in answer.successful() {
                    if let Ok(id) = ok.id().parse::<i64>() {
                        out.accepted.push(id);
                    }
                }
                for bad in answer.failed() {
                    if let Ok(id) = bad.id().parse::<i64>() {
                        let why = format!("{}: {}", bad.code(), bad.message().unwrap_or(""));
                        out.failed.push((id, PublishError::Broker(why)));
                    }
                }
            }
            Err(e) => {
                let why = match &e {
                    SqsError::Timeout { after: Some(after), .. } => PublishError::Timeout(*after),
                    other => PublishError::Broker(other.to_string()),
                };
                for id in sent {
                    if let Ok(id) = id.parse::<i64>() {
                        out.failed.push((id, why.clone()));
                    }
                }
            }
        }
        out
    }
}

#[async_trait]
impl Publisher for SqsPublisher {
    fn serves(&self, destination: &str) -> bool {
        self.routes.contains_key(destination)
    }

    async fn publish(&self, rows: &[OutboxRow]) -> Result<Published, PublishError> {
        let mut by_url: Vec<(&str, Vec<&OutboxRow>)> = Vec::new();
        let mut out = Published::default();
        for row in rows {
            let Some(url) = self.routes.get(&row.destination) else {
                out.failed.push((row.id, PublishError::NoRoute(row.destination.clone())));
                continue;
            };
            match by_url.iter_mut().find(|(u, _)| *u == url.as_str()) {
                Some((_, v)) => v.push(row),
                None => by_url.push((url.as_str(), vec![row])),
            }
        }
        // The batches in parallel: each is bounded on its own.
        let calls =
            by_url.iter().flat_map(|(url, rows)| rows.chunks(super::config::MAX_BATCH).map(|c| self.send(url, c)));
        for answer in futures::future::join_all(calls).await {
            out.accepted.extend(answer.accepted);
            out.failed.extend(answer.failed);
        }
        Ok(out)
    }
}
