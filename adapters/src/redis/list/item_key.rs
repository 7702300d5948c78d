//! [`ItemKey`]: how a list item maps to a job key and a payload (lists carry no message id).

use std::sync::Arc;

use fence::JobKey;

type DecodeFn = dyn Fn(&[u8]) -> Result<(JobKey, Vec<u8>), String> + Send + Sync;

/// How a list item maps to a job key and a payload. Lists carry no message id, so the identity
/// must come from the item itself, and there is no default: [`ReliableList::new`](super::ReliableList::new) and
/// [`ListRetrofit::new`](super::ListRetrofit::new) ask for one, because each choice says something different about two
/// identical items.
///
/// The job key is what deduplicates: a second item with the key of a completed job is acknowledged
/// as a duplicate without running, for as long as the completed job's row is kept (the
/// deduplication window); once that row is pruned, the same key is a new job.
/// - [`ContentHash`](Self::ContentHash): identical items are **one** job. Right for items that are
///   idempotent commands ("recompute report 7"); wrong for events that may repeat ("+1 page view"):
///   the second one is dropped as a duplicate while the first is remembered.
/// - [`Split`](Self::Split) / [`Custom`](Self::Custom): the producer names the job (an order id,
///   a UUID per event): identical payloads under different keys are different jobs, and a
///   redelivery of the same item (a put-back after a crash) is recognised.
///
/// ```
/// use brokerfence::redis::ItemKey;
/// let (key, payload) = ItemKey::Split(b'|').decode(b"order-7|{\"qty\":2}").unwrap();
/// assert_eq!(key.as_str(), "order-7");
/// assert_eq!(payload, b"{\"qty\":2}");
/// let (key, payload) = ItemKey::ContentHash.decode(b"hello").unwrap();
/// assert_eq!(key.as_str(), "sha1:aaf4c61ddcc5e8a2dabede0f3b482cd9aea9434d");
/// assert_eq!(payload, b"hello");
/// assert!(ItemKey::Split(b'|').decode(b"no separator").is_err());
/// ```
#[derive(Clone)]
#[non_exhaustive]
pub enum ItemKey {
    /// `sha1:<hex>` of the whole item, which is also the payload: identical items are one job
    /// (within the deduplication window; see the type's docs).
    ContentHash,
    /// The bytes before the first separator are the key, the rest is the payload.
    Split(u8),
    /// Your own decoding: key and payload, or why the item cannot be used (it is dead-lettered).
    Custom(Arc<DecodeFn>),
}

impl std::fmt::Debug for ItemKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ItemKey::ContentHash => f.write_str("ContentHash"),
            ItemKey::Split(b) => f.debug_tuple("Split").field(&char::from(*b)).finish(),
            ItemKey::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}

fn content_key(item: &[u8]) -> String {
    format!("sha1:{}", sha1_smol::Sha1::from(item).digest())
}

impl ItemKey {
    /// The job key and payload of `item`, or why it cannot be decoded. An item in a trace
    /// envelope ([`traced_item`](crate::redis::traced_item)) is unwrapped first: the key and the
    /// payload come from the item alone.
    pub fn decode(&self, item: &[u8]) -> Result<(JobKey, Vec<u8>), String> {
        let item = super::envelope::open(item).item;
        match self {
            ItemKey::ContentHash => {
                let key = JobKey::new(content_key(item)).map_err(|e| e.to_string())?;
                Ok((key, item.to_vec()))
            }
            ItemKey::Split(sep) => {
                let at = item
                    .iter()
                    .position(|b| b == sep)
                    .ok_or_else(|| format!("item has no {:?} separator before its payload", char::from(*sep)))?;
                let key = JobKey::from_bytes(&item[..at]).map_err(|e| format!("item has no usable job key: {e}"))?;
                Ok((key, item[at + 1..].to_vec()))
            }
            ItemKey::Custom(f) => f(item),
        }
    }

    /// The job key used for `item`'s lease key: its own, or (undecodable) its content hash.
    pub(super) fn lease_job(&self, item: &[u8]) -> Option<JobKey> {
        match self.decode(item) {
            Ok((k, _)) => Some(k),
            Err(_) => JobKey::new(content_key(item)).ok(),
        }
    }
}
