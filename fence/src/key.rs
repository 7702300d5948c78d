//! Validated names: job keys, queue names and owner ids.
//!
//! Each is a UTF-8 string with no NUL byte (PostgreSQL `text` cannot hold one) and a bounded length,
//! so that every value that passes round-trips byte for byte through both backends.

use std::fmt;
use std::sync::Arc;

use crate::error::{FenceError, Result};

/// Longest job key accepted, in bytes. Long enough for any broker message id or a content hash,
/// short enough to stay inside a B-tree index entry.
pub const MAX_KEY_BYTES: usize = 1024;
/// Longest queue name or owner id accepted, in bytes.
pub const MAX_NAME_BYTES: usize = 256;

fn check(what: &'static str, value: &str, max: usize) -> Result<()> {
    if value.is_empty() {
        return Err(FenceError::invalid(what, "must not be empty"));
    }
    if value.len() > max {
        return Err(FenceError::invalid(what, format!("{} bytes is over the limit of {max}", value.len())));
    }
    if value.contains('\0') {
        return Err(FenceError::invalid(what, "must not contain a NUL byte"));
    }
    Ok(())
}

fn from_utf8<'a>(what: &'static str, bytes: &'a [u8]) -> Result<&'a str> {
    match std::str::from_utf8(bytes) {
        Ok(s) => Ok(s),
        Err(e) => Err(FenceError::invalid(what, format!("not valid UTF-8 ({e})"))),
    }
}

/// The `last_error` of a job row whose key [`JobKey`] refuses, made dead by the claim that found
/// it (issue #30): such a row was written around the fence (by SQL, or before the rules
/// tightened) and cannot be handed to a handler, while its companions in the claim can.
pub(crate) fn unusable_key(error: &FenceError) -> String {
    format!("not a valid job key ({error}): made dead when claimed, as no handler can be given it")
}

macro_rules! name_type {
    ($(#[$doc:meta])* $name:ident, $what:literal, $max:expr) => {
        $(#[$doc])*
        ///
        /// A clone shares the string (a reference count), so the leases and requests that carry
        /// it through an attempt do not copy it.
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Arc<str>);

        impl $name {
            /// Validates and wraps a string.
            pub fn new(value: impl Into<String>) -> Result<Self> {
                let value = value.into();
                check($what, &value, $max)?;
                Ok(Self(Arc::from(value)))
            }

            /// Validates raw bytes (for example a broker attribute): invalid UTF-8 is a typed error.
            pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
                Self::try_from(from_utf8($what, bytes)?)
            }

            /// The string.
            pub fn as_str(&self) -> &str {
                &self.0
            }

            /// The owned string (a copy: clones share one).
            pub fn into_string(self) -> String {
                self.0.as_ref().to_owned()
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<&str> for $name {
            type Error = FenceError;
            /// Validates and copies a string once (into the shared string, with no `String`
            /// between).
            fn try_from(value: &str) -> Result<Self> {
                check($what, value, $max)?;
                Ok(Self(Arc::from(value)))
            }
        }

        impl TryFrom<String> for $name {
            type Error = FenceError;
            fn try_from(value: String) -> Result<Self> {
                Self::new(value)
            }
        }
    };
}

name_type!(
    /// The identity of a job within its queue: a broker message id, a deduplication id, or a key of
    /// your choosing.
    ///
    /// ```
    /// use brokerfence::JobKey;
    /// assert!(JobKey::new("order-42").is_ok());
    /// assert!(JobKey::new("").is_err());
    /// assert!(JobKey::from_bytes(b"\xff\xfe").is_err());
    /// ```
    JobKey, "key", MAX_KEY_BYTES
);

name_type!(
    /// A queue name: the namespace a job key lives in (an SQS queue, a Redis stream, a table queue).
    ///
    /// ```
    /// use brokerfence::QueueName;
    /// let q = QueueName::new("emails").unwrap();
    /// assert_eq!(q.as_str(), "emails");
    /// ```
    QueueName, "queue", MAX_NAME_BYTES
);

name_type!(
    /// The identity of a worker holding leases. Make it unique per process (host, pid, random).
    ///
    /// ```
    /// use brokerfence::Owner;
    /// let me = Owner::unique("worker");
    /// assert!(me.as_str().starts_with("worker-"));
    /// ```
    Owner, "owner", MAX_NAME_BYTES
);

impl Owner {
    /// A fresh owner id: `prefix-<pid>-<nanos>-<counter>`, unique per call within a host. The
    /// prefix is shortened (at a character boundary, to at most 64 characters) so that the id
    /// never exceeds [`MAX_NAME_BYTES`].
    pub fn unique(prefix: &str) -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let suffix = format!("-{}-{nanos:x}-{n}", std::process::id());
        // The prefix is cut at a character boundary so that the whole id stays within
        // `MAX_NAME_BYTES` (the suffix is at most 64 bytes), as `Owner::new` requires.
        let room = MAX_NAME_BYTES.saturating_sub(suffix.len());
        let mut prefix: String = prefix.chars().filter(|c| *c != '\0').take(64).collect();
        let mut cut = prefix.len().min(room);
        while !prefix.is_char_boundary(cut) {
            cut -= 1;
        }
        prefix.truncate(cut);
        let prefix = if prefix.is_empty() { "owner".to_owned() } else { prefix };
        Self(Arc::from(format!("{prefix}{suffix}")))
    }
}

#[cfg(test)]
mod edges {
    use super::*;

    /// Issue #12 §5, first bullet: `Owner::unique` keeps the owner bound (`MAX_NAME_BYTES`)
    /// whatever the prefix — a long ASCII prefix and a prefix of 4-byte characters (64 of which
    /// alone fill 256 bytes) both give an owner that `Owner::new` accepts.
    #[test]
    fn edges_owner_unique_keeps_the_length_bound() {
        for prefix in ["w".repeat(300), "\u{1F600}".repeat(100), "é".repeat(200), String::new()] {
            let owner = Owner::unique(&prefix);
            assert!(
                owner.as_str().len() <= MAX_NAME_BYTES,
                "{} bytes from a prefix of {} bytes",
                owner.as_str().len(),
                prefix.len()
            );
            assert!(Owner::new(owner.as_str()).is_ok(), "{owner:?} does not validate");
        }
        // Short prefixes are kept whole, and two calls never collide.
        let (a, b) = (Owner::unique("worker"), Owner::unique("worker"));
        assert!(a.as_str().starts_with("worker-") && a != b);
    }
}

#[cfg(test)]
mod latency {
    use super::*;

    /// Issue #33, the consumer's CPU per job: a lease is cloned into the registry, the job's
    /// context, the commit request and the broker-handle tracking, and each clone of a `String`
    /// name was an allocation and a copy (with the stop's other changes, a drain went from 47 to
    /// 23 allocations per job). A clone must share the string. Fails with `String` inside.
    #[test]
    fn latency_a_clone_of_a_name_shares_its_string() {
        let key = JobKey::new("order-42").unwrap();
        let queue = QueueName::try_from("emails").unwrap();
        let owner = Owner::unique("worker");
        let same = |a: &str, b: &str| std::ptr::eq(a.as_ptr(), b.as_ptr());
        assert!(same(key.as_str(), key.clone().as_str()), "a key's clone copied it");
        assert!(same(queue.as_str(), queue.clone().as_str()), "a queue name's clone copied it");
        assert!(same(owner.as_str(), owner.clone().as_str()), "an owner's clone copied it");
        // Equality, order and hashing are the string's, as before.
        assert_eq!(JobKey::from_bytes(b"order-42").unwrap(), key);
        assert_eq!(key.clone().into_string(), "order-42");
        assert!(JobKey::new("a").unwrap() < JobKey::new("b").unwrap());
        let hash = |k: &JobKey| {
            use std::hash::{BuildHasher, RandomState};
            let s = RandomState::new();
            (s.hash_one(k), s.hash_one(k.as_str()))
        };
        let (of_key, of_str) = hash(&key);
        assert_eq!(of_key, of_str, "a name hashes as its string");
        // `try_from(&str)` validates as `new` does.
        assert!(JobKey::try_from("").is_err());
        assert!(JobKey::try_from("a\0b").is_err());
        assert!(JobKey::from_bytes(b"\xff").is_err());
    }
}
