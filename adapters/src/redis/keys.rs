//! Key naming. Every key this adapter derives from a stream or list key shares that key's cluster
//! slot (Redis Cluster hashes only the first non-empty `{…}` of a key), so a job's lease key, its
//! stream or list, the processing list and the dead-letter stream can all be touched by one script.

use fence::{JobKey, Owner, QueueName};

use super::error::RedisError;

/// The part of `key` that Redis Cluster hashes: the content of the first non-empty `{…}`, or the
/// whole key.
pub(crate) fn slot_part(key: &[u8]) -> &[u8] {
    if let Some(open) = key.iter().position(|&b| b == b'{') {
        let rest = &key[open + 1..];
        if let Some(len) = rest.iter().position(|&b| b == b'}')
            && len > 0
        {
            return &rest[..len];
        }
    }
    key
}

/// The Redis Cluster slot of `key` (CRC16/XMODEM of its hashed part, the content of the first non-empty `{…}` or the whole key, modulo 16,384), as
/// `CLUSTER KEYSLOT` computes it.
///
/// ```
/// use brokerfence::redis::key_slot;
/// assert_eq!(key_slot(b"foo"), 12182);
/// assert_eq!(key_slot(b"{orders}:dead"), key_slot(b"orders"));
/// ```
pub fn key_slot(key: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &b in slot_part(key) {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 { (crc << 1) ^ 0x1021 } else { crc << 1 };
        }
    }
    crc % 16384
}

/// Fails with [`RedisError::CrossSlot`] when one of `others` is not in the slot of `anchor`:
/// `what` (a source) would touch them in one script.
pub(crate) fn check_same_slot(what: &'static str, anchor: &str, others: &[&str]) -> Result<(), RedisError> {
    let first_slot = key_slot(anchor.as_bytes());
    for other in others {
        let second_slot = key_slot(other.as_bytes());
        if second_slot != first_slot {
            return Err(RedisError::CrossSlot {
                what,
                first: anchor.to_owned(),
                first_slot,
                second: (*other).to_owned(),
                second_slot,
            });
        }
    }
    Ok(())
}

/// A key named after `base` that lands in the same cluster slot: `base` + `suffix` when `base` has a
/// hash tag, else `{base}` + `suffix`. (A key without a tag but with a `}` cannot be wrapped; then the
/// result is `base` + `suffix`, which is fine on a single server; give such keys a tag on a cluster.)
///
/// ```
/// use brokerfence::redis::sibling_key;
/// assert_eq!(sibling_key("orders", ":dead"), "{orders}:dead");
/// assert_eq!(sibling_key("{app}:orders", ":dead"), "{app}:orders:dead");
/// ```
pub fn sibling_key(base: &str, suffix: &str) -> String {
    let tagged = slot_part(base.as_bytes()).len() != base.len();
    if tagged || base.contains('}') { format!("{base}{suffix}") } else { format!("{{{base}}}{suffix}") }
}

/// The lease key of job `key` of `queue`, in the slot of `anchor` (the stream or list key).
///
/// The queue name is length-prefixed so that no two (queue, key) pairs share a lease key.
///
/// ```
/// use brokerfence::redis::lease_key;
/// use brokerfence::{JobKey, QueueName};
/// let k = lease_key("orders", &QueueName::new("billing").unwrap(), &JobKey::new("1-0").unwrap());
/// assert_eq!(k, "{orders}:lease:7:billing:1-0");
/// ```
pub fn lease_key(anchor: &str, queue: &QueueName, key: &JobKey) -> String {
    sibling_key(anchor, &format!(":lease:{}:{}:{}", queue.as_str().len(), queue.as_str(), key.as_str()))
}

/// The value a holder stores in its lease key: `<owner>:<epoch>`. Epoch 0 is a reservation made
/// before the database claim (the reliable list); a claimed epoch is at least 1.
pub fn token(owner: &Owner, epoch: i64) -> String {
    format!("{}:{epoch}", owner.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_part_and_token() {
        assert_eq!(slot_part(b"orders"), b"orders");
        assert_eq!(slot_part(b"{app}:orders"), b"app");
        assert_eq!(slot_part(b"a{}b"), b"a{}b");
        let me = Owner::new("w1").unwrap();
        assert_eq!(token(&me, 3), "w1:3");
    }

    fn slot(key: &str) -> u16 {
        key_slot(key.as_bytes())
    }

    #[test]
    fn crc16_matches_the_redis_reference() {
        assert_eq!(key_slot(b"123456789"), 0x31C3); // CRC16/XMODEM("123456789"), below 16384
        assert_eq!(slot("foo"), 12182);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
    }

    #[test]
    fn derived_keys_share_the_anchor_slot() {
        let q = QueueName::new("q:{x}").unwrap();
        for anchor in ["orders", "{app}:orders", "a{b", "pre{tag}post", "plain:name:1"] {
            for job in ["1-0", "job}{with braces", "{evil}", "🦀"] {
                let k = lease_key(anchor, &q, &JobKey::new(job).unwrap());
                assert_eq!(slot(&k), slot(anchor), "{k} vs {anchor}");
            }
            assert_eq!(slot(&sibling_key(anchor, ":dead")), slot(anchor));
            assert_eq!(slot(&sibling_key(anchor, ":processing")), slot(anchor));
        }
    }

    #[test]
    fn lease_keys_are_unambiguous() {
        let a = lease_key("s", &QueueName::new("a:b").unwrap(), &JobKey::new("c").unwrap());
        let b = lease_key("s", &QueueName::new("a").unwrap(), &JobKey::new("b:c").unwrap());
        assert_ne!(a, b);
    }
}
