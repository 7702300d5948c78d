//! Batched deletes and visibility changes: at most ten entries per call, distinct entry ids (SQS
//! fails the whole call otherwise), calls for several chunks in parallel, and per-entry failures
//! retried when SQS says they were its fault, reported otherwise.

use std::time::Duration;

use aws_sdk_sqs::Client;
use aws_sdk_sqs::types::{
    BatchResultErrorEntry, ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry,
};

use super::config::MAX_BATCH;
use super::error::{SqsError, classify, is_transient_code};

/// One entry: the message id (for dedup and logs), the receipt handle, and for visibility changes
/// the new timeout in seconds.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) message_id: String,
    pub(crate) handle: String,
    pub(crate) visibility: i32,
}

/// Retries of entries that failed on the server side.
const ENTRY_RETRIES: u32 = 3;

#[derive(Debug, Clone, Copy)]
enum Op {
    Delete,
    ChangeVisibility,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Delete => "DeleteMessageBatch",
            Op::ChangeVisibility => "ChangeMessageVisibilityBatch",
        }
    }
}

/// Deletes the messages (one entry per message id; later entries of the same id win). Returns the
/// message ids SQS refused for good (the caller's fault: an expired handle, a message gone).
pub(crate) async fn delete(
    client: &Client,
    queue_url: &str,
    entries: Vec<Entry>,
    resolve: Resolve<'_>,
) -> Result<Vec<String>, SqsError> {
    run(client, queue_url, Op::Delete, entries, resolve).await
}

/// Before each retry of an entry: the handle to use now (the newest, still ours), or `None` to
/// drop the entry (its handle may be stale).
pub(crate) type Resolve<'a> = &'a (dyn Fn(&str) -> Option<String> + Sync);

/// Sets the visibility timeout of each message (one entry per message id; later entries win).
/// Returns the message ids SQS refused for good.
pub(crate) async fn change_visibility(
    client: &Client,
    queue_url: &str,
    entries: Vec<Entry>,
    resolve: Resolve<'_>,
) -> Result<Vec<String>, SqsError> {
    run(client, queue_url, Op::ChangeVisibility, entries, resolve).await
}

fn distinct(entries: Vec<Entry>) -> Vec<Entry> {
    let mut out: Vec<Entry> = Vec::with_capacity(entries.len());
    for e in entries {
        match out.iter_mut().find(|o| o.message_id == e.message_id) {
            Some(o) => *o = e,
            None => out.push(e),
        }
    }
    out
}

async fn run(
    client: &Client,
    queue_url: &str,
    op: Op,
    entries: Vec<Entry>,
    resolve: Resolve<'_>,
) -> Result<Vec<String>, SqsError> {
    let entries = distinct(entries);
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    let chunks: Vec<Vec<Entry>> = entries.chunks(MAX_BATCH).map(<[Entry]>::to_vec).collect();
    let results = futures::future::join_all(chunks.into_iter().map(|c| chunk(client, queue_url, op, c, resolve))).await;
    let mut reported = Vec::new();
    let mut refused = Vec::new();
    let mut transient = false;
    let mut first_call_error = None;
    for r in results {
        match r {
            Ok(failed) => {
                for (message_id, f) in failed {
                    refused.push(message_id);
                    transient |= !f.sender_fault() || is_transient_code(f.code());
                    reported.push(format!("{} {}", f.code(), f.message().unwrap_or("")));
                }
            }
            Err(e) => {
                first_call_error.get_or_insert(e);
            }
        }
    }
    if let Some(e) = first_call_error {
        return Err(e);
    }
    if reported.is_empty() {
        return Ok(refused);
    }
    let summary = reported.join("; ");
    if transient {
        Err(SqsError::BatchEntries { operation: op.name(), failed: reported.len(), summary, transient })
    } else {
        // The caller's fault (a receipt handle that expired, a message already gone): retrying
        // cannot help. The fence keeps the truth; a redelivery is settled again.
        tracing::warn!(operation = op.name(), failed = reported.len(), %summary, "batch entries refused by SQS");
        Ok(refused)
    }
}

/// One call for up to ten entries, then retries of the entries SQS failed on its side. Returns the
/// entries that still failed, with their message ids.
async fn chunk(
    client: &Client,
    queue_url: &str,
    op: Op,
    entries: Vec<Entry>,
    resolve: Resolve<'_>,
) -> Result<Vec<(String, BatchResultErrorEntry)>, SqsError> {
    let mut pending: Vec<(String, Entry)> =
        entries.into_iter().enumerate().map(|(i, e)| (format!("e{i}"), e)).collect();
    let mut attempt = 0;
    // Pauses before retries 1, 2, 3: at most 200, 400, 800 ms; jitter (between half the step and
    // the step) keeps the workers that SQS throttled together from retrying together.
    let mut pauses = {
        use backon::BackoffBuilder as _;
        backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(100))
            .with_factor(2.0)
            .with_jitter()
            .with_max_times(ENTRY_RETRIES as usize)
            .build()
    };
    loop {
        let failed = call(client, queue_url, op, &pending).await?;
        let (retry, fatal): (Vec<_>, Vec<_>) =
            failed.into_iter().partition(|f| !f.sender_fault() || is_transient_code(f.code()));
        if retry.is_empty() || attempt >= ENTRY_RETRIES {
            let mut out = fatal;
            out.extend(retry);
            let ids = out
                .into_iter()
                .map(|f| {
                    let mid = pending.iter().find(|(id, _)| id == f.id()).map(|(_, e)| e.message_id.clone());
                    (mid.unwrap_or_default(), f)
                })
                .collect();
            return Ok(ids);
        }
        for f in &fatal {
            tracing::debug!(operation = op.name(), code = f.code(), "batch entry refused");
        }
        attempt += 1;
        tokio::time::sleep(pauses.next().unwrap_or(Duration::from_millis(800))).await;
        pending.retain(|(id, _)| retry.iter().any(|f| f.id() == id));
        // The newest handle of each message, and only while it is still ours.
        pending = pending
            .into_iter()
            .filter_map(|(id, mut e)| {
                e.handle = resolve(&e.message_id)?;
                Some((id, e))
            })
            .collect();
        if pending.is_empty() {
            return Ok(Vec::new());
        }
        tracing::debug!(operation = op.name(), retrying = pending.len(), attempt, "retrying failed batch entries");
    }
}

async fn call(
    client: &Client,
    queue_url: &str,
    op: Op,
    pending: &[(String, Entry)],
) -> Result<Vec<BatchResultErrorEntry>, SqsError> {
    match op {
        Op::Delete => {
            let entries = pending
                .iter()
                .map(|(id, e)| DeleteMessageBatchRequestEntry::builder().id(id).receipt_handle(&e.handle).build())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| SqsError::Service { operation: op.name(), code: None, message: e.to_string() })?;
            let out = client
                .delete_message_batch()
                .queue_url(queue_url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(|e| classify(op.name(), e))?;
            Ok(out.failed().to_vec())
        }
        Op::ChangeVisibility => {
            let entries = pending
                .iter()
                .map(|(id, e)| {
                    ChangeMessageVisibilityBatchRequestEntry::builder()
                        .id(id)
                        .receipt_handle(&e.handle)
                        .visibility_timeout(e.visibility)
                        .build()
                })
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| SqsError::Service { operation: op.name(), code: None, message: e.to_string() })?;
            let out = client
                .change_message_visibility_batch()
                .queue_url(queue_url)
                .set_entries(Some(entries))
                .send()
                .await
                .map_err(|e| classify(op.name(), e))?;
            Ok(out.failed().to_vec())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(id: &str, h: &str) -> Entry {
        Entry { message_id: id.into(), handle: h.into(), visibility: 0 }
    }

    #[test]
    fn one_entry_per_message_newest_last() {
        let out = distinct(vec![e("a", "1"), e("b", "1"), e("a", "2")]);
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].handle, "2");
    }
}
