//! The one wire convention for carrying a fencing token downstream.
//!
//! A worker that calls another service on behalf of a job sends the job's identity and its epoch
//! with every call; the receiver checks the epoch against its [ledger](crate::ledger) and refuses
//! an older one. The same four names serve as HTTP header names and as message-attribute names
//! (SQS message attributes of type `String`, Redis stream fields, Kafka headers):
//!
//! | name          | value                                   | required |
//! |---------------|-----------------------------------------|----------|
//! | `Fence-Queue` | the queue of the job (encoded)          | yes      |
//! | `Fence-Job`   | the job key (encoded)                   | yes      |
//! | `Fence-Epoch` | the epoch, a decimal integer `>= 1`     | yes      |
//! | `Fence-Owner` | the worker that holds the lease (encoded)| no (logs; lets the ledger tell a retry from a repeated token) |
//!
//! Values are *encoded* so that any key fits in an HTTP header: every byte outside the visible
//! ASCII range (`!`..=`~`), and `%` itself, is written as `%XX` (uppercase hex of the UTF-8 byte).
//! A key made of visible ASCII without `%` is sent as it is. Decoding is strict about `%`
//! escapes and lenient about anything else, so a hand-written `curl -H 'Fence-Job: order-7'` works.
//!
//! HTTP header names are matched without regard to case; message-attribute names should be sent
//! exactly as spelled here.
//!
//! ```
//! use brokerfence::wire::FenceStamp;
//! let stamp = FenceStamp::new("orders", "order 7", 2).with_owner("worker-a");
//! let headers = stamp.to_headers();
//! assert_eq!(headers[1], ("Fence-Job", "order%207".to_string()));
//! let back = FenceStamp::from_headers(headers.iter().map(|(k, v)| (*k, v.as_str()))).unwrap();
//! assert_eq!(back, stamp);
//! ```

use std::fmt;

use crate::lease::Lease;
use crate::ledger::{Ledger, Verdict};

/// Name of the queue header / attribute.
pub const QUEUE: &str = "Fence-Queue";
/// Name of the job-key header / attribute.
pub const JOB: &str = "Fence-Job";
/// Name of the epoch header / attribute.
pub const EPOCH: &str = "Fence-Epoch";
/// Name of the owner header / attribute (informational).
pub const OWNER: &str = "Fence-Owner";
/// All four names, in the order [`FenceStamp::to_headers`] emits them.
///
/// ```
/// assert_eq!(brokerfence::wire::NAMES, ["Fence-Queue", "Fence-Job", "Fence-Epoch", "Fence-Owner"]);
/// ```
pub const NAMES: [&str; 4] = [QUEUE, JOB, EPOCH, OWNER];

/// The fencing token of one call: which job, which epoch, sent by whom.
///
/// ```
/// use brokerfence::wire::FenceStamp;
/// let stamp = FenceStamp::new("mail", "msg-1", 3);
/// assert_eq!(stamp.to_string(), "mail/msg-1@3");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FenceStamp {
    /// The queue of the job.
    pub queue: String,
    /// The job key.
    pub job: String,
    /// The epoch (fencing token) of the attempt making the call.
    pub epoch: i64,
    /// The worker holding the lease, if the sender says (for logs only; never checked).
    pub owner: Option<String>,
}

/// Why a stamp could not be read from headers or attributes.
///
/// ```
/// use brokerfence::wire::{FenceStamp, StampError};
/// let err = FenceStamp::from_headers([("Fence-Queue", "q"), ("Fence-Epoch", "1")]).unwrap_err();
/// assert_eq!(err, StampError::Missing { name: "Fence-Job" });
/// let err = FenceStamp::from_headers([("Fence-Queue", "q"), ("Fence-Job", "k"), ("Fence-Epoch", "0")]).unwrap_err();
/// assert_eq!(err.name(), "Fence-Epoch");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum StampError {
    /// A required header or attribute is absent (or empty).
    #[error("missing {name}")]
    Missing {
        /// Which one.
        name: &'static str,
    },
    /// A header or attribute is present but cannot be read.
    #[error("malformed {name}: {reason}")]
    Malformed {
        /// Which one.
        name: &'static str,
        /// Why.
        reason: String,
    },
    /// A header or attribute was given twice with different values.
    #[error("{name} given twice with different values")]
    Conflicting {
        /// Which one.
        name: &'static str,
    },
}

impl StampError {
    /// The header or attribute name concerned.
    ///
    /// ```
    /// let err = brokerfence::wire::StampError::Missing { name: brokerfence::wire::EPOCH };
    /// assert_eq!(err.name(), "Fence-Epoch");
    /// ```
    pub fn name(&self) -> &'static str {
        match self {
            StampError::Missing { name } | StampError::Malformed { name, .. } | StampError::Conflicting { name } => {
                name
            }
        }
    }

    /// A JSON body describing the error, for a `400 Bad Request`.
    ///
    /// ```
    /// let err = brokerfence::wire::StampError::Missing { name: "Fence-Job" };
    /// assert_eq!(
    ///     err.to_json(),
    ///     r#"{"error":"missing_stamp","header":"Fence-Job","message":"missing Fence-Job"}"#
    /// );
    /// ```
    pub fn to_json(&self) -> String {
        let kind = match self {
            StampError::Missing { .. } => "missing_stamp",
            StampError::Malformed { .. } | StampError::Conflicting { .. } => "malformed_stamp",
        };
        format!(
            r#"{{"error":"{kind}","header":{},"message":{}}}"#,
            json_string(self.name()),
            json_string(&self.to_string())
        )
    }
}

impl FenceStamp {
    /// A stamp without an owner.
    ///
    /// ```
    /// let s = brokerfence::wire::FenceStamp::new("q", "k", 1);
    /// assert_eq!(s.owner, None);
    /// ```
    pub fn new(queue: impl Into<String>, job: impl Into<String>, epoch: i64) -> Self {
        Self { queue: queue.into(), job: job.into(), epoch, owner: None }
    }

    /// Adds the sender's owner id.
    ///
    /// ```
    /// let s = brokerfence::wire::FenceStamp::new("q", "k", 1).with_owner("w1");
    /// assert_eq!(s.owner.as_deref(), Some("w1"));
    /// ```
    pub fn with_owner(mut self, owner: impl Into<String>) -> Self {
        self.owner = Some(owner.into());
        self
    }

    /// The (name, encoded value) pairs to send: queue, job, epoch, and the owner when known; with
    /// the feature `otel`, also the current span's `traceparent` (and `tracestate`), so the
    /// receiver continues the trace. Use them as HTTP headers or as message attributes.
    ///
    /// ```
    /// let pairs = brokerfence::wire::FenceStamp::new("q", "100%", 4).to_headers();
    /// assert_eq!(pairs, vec![
    ///     ("Fence-Queue", "q".to_string()),
    ///     ("Fence-Job", "100%25".to_string()),
    ///     ("Fence-Epoch", "4".to_string()),
    /// ]);
    /// ```
    pub fn to_headers(&self) -> Vec<(&'static str, String)> {
        let out = self.stamp_headers();
        // Feature `otel`: the current span's W3C context next to the stamp (inside an attempt,
        // the attempt's span), so the receiver continues the trace.
        #[cfg(feature = "otel")]
        let out = {
            let mut out = out;
            out.extend(crate::otel::TraceContext::current().iter().flat_map(crate::otel::TraceContext::to_headers));
            out
        };
        out
    }

    /// The stamp's own pairs (queue, job, epoch, owner when known), without a trace context.
    pub(crate) fn stamp_headers(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::with_capacity(6);
        out.push((QUEUE, encode(&self.queue)));
        out.push((JOB, encode(&self.job)));
        out.push((EPOCH, self.epoch.to_string()));
        if let Some(owner) = &self.owner {
            out.push((OWNER, encode(owner)));
        }
        out
    }

    /// Reads a stamp from (name, value) pairs, e.g. all headers of a request or all attributes of
    /// a message. Names match without regard to ASCII case; other names are ignored; a name given
    /// twice must carry the same value both times.
    ///
    /// ```
    /// use brokerfence::wire::FenceStamp;
    /// let s = FenceStamp::from_headers([
    ///     ("content-type", "text/plain"),
    ///     ("fence-queue", "orders"),
    ///     ("fence-job", "order%2F7"),
    ///     ("fence-epoch", "12"),
    /// ]).unwrap();
    /// assert_eq!((s.job.as_str(), s.epoch), ("order/7", 12));
    /// ```
    pub fn from_headers<I, K, V>(pairs: I) -> Result<Self, StampError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut found: [Option<String>; 4] = Default::default();
        for (name, value) in pairs {
            let Some(i) = NAMES.iter().position(|n| n.eq_ignore_ascii_case(name.as_ref())) else { continue };
            let value = value.as_ref();
            match &found[i] {
                Some(seen) if seen != value => return Err(StampError::Conflicting { name: NAMES[i] }),
                Some(_) => {}
                None => found[i] = Some(value.to_owned()),
            }
        }
        let [queue, job, epoch, owner] = found;
        Self::from_parts(queue.as_deref(), job.as_deref(), epoch.as_deref(), owner.as_deref())
    }

    /// Reads a stamp through a lookup by name (e.g. a header map's `get`). The closure is called
    /// with each of the [`NAMES`].
    ///
    /// ```
    /// use std::collections::HashMap;
    /// let attrs: HashMap<&str, &str> =
    ///     [("Fence-Queue", "q"), ("Fence-Job", "k"), ("Fence-Epoch", "2")].into();
    /// let s = brokerfence::wire::FenceStamp::from_lookup(|name| attrs.get(name).copied()).unwrap();
    /// assert_eq!(s.epoch, 2);
    /// ```
    pub fn from_lookup<F, V>(mut lookup: F) -> Result<Self, StampError>
    where
        F: FnMut(&'static str) -> Option<V>,
        V: AsRef<str>,
    {
        let queue = lookup(QUEUE);
        let job = lookup(JOB);
        let epoch = lookup(EPOCH);
        let owner = lookup(OWNER);
        Self::from_parts(
            queue.as_ref().map(AsRef::as_ref),
            job.as_ref().map(AsRef::as_ref),
            epoch.as_ref().map(AsRef::as_ref),
            owner.as_ref().map(AsRef::as_ref),
        )
    }

    fn from_parts(
        queue: Option<&str>,
        job: Option<&str>,
        epoch: Option<&str>,
        owner: Option<&str>,
    ) -> Result<Self, StampError> {
        let required = |name: &'static str, v: Option<&str>| -> Result<String, StampError> {
            match v.map(str::trim) {
                None | Some("") => Err(StampError::Missing { name }),
                Some(v) => decode(v).map_err(|reason| StampError::Malformed { name, reason }),
            }
        };
        let queue = required(QUEUE, queue)?;
        let job = required(JOB, job)?;
        let epoch = parse_epoch(epoch)?;
        let owner = match owner.map(str::trim) {
            None | Some("") => None,
            Some(v) => Some(decode(v).map_err(|reason| StampError::Malformed { name: OWNER, reason })?),
        };
        Ok(Self { queue, job, epoch, owner })
    }

    /// The job name under which a receiver's ledger keeps this stamp's epoch: the queue and the
    /// key, so that equal keys of different queues never share an epoch. The queue part escapes
    /// `/` and `%`, so the first `/` always separates the two.
    ///
    /// ```
    /// let s = brokerfence::wire::FenceStamp::new("a/b", "c/d", 1);
    /// assert_eq!(s.ledger_job(), "a%2Fb/c/d");
    /// ```
    pub fn ledger_job(&self) -> String {
        let mut out = self.queue.replace('%', "%25").replace('/', "%2F");
        out.push('/');
        out.push_str(&self.job);
        out
    }

    /// Checks this stamp against a receiver's ledger: accepted when its epoch is not older than
    /// the newest seen for the job (and the ledger now keeps it), stale otherwise. A stamp that
    /// names its owner is refused as [`Verdict::Conflict`] when another owner holds the same
    /// epoch at the ledger (see [`crate::ledger`]).
    ///
    /// ```no_run
    /// # async fn demo(ledger: brokerfence::ledger::Ledger, stamp: brokerfence::wire::FenceStamp) -> brokerfence::Result<()> {
    /// if let brokerfence::ledger::Verdict::Stale { newest } = stamp.accept(&ledger).await? {
    ///     println!("refused: {}", brokerfence::wire::stale_epoch_json(&stamp, newest));
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn accept(&self, ledger: &Ledger) -> crate::Result<Verdict> {
        match &self.owner {
            Some(owner) => ledger.accept_by(&self.ledger_job(), self.epoch, owner).await,
            None => ledger.accept(&self.ledger_job(), self.epoch).await,
        }
    }
}

/// The stamp of a lease: its queue, key, epoch and owner.
///
/// ```no_run
/// # fn demo(lease: brokerfence::Lease) {
/// let stamp = brokerfence::wire::FenceStamp::from(&lease);
/// assert_eq!(stamp.epoch, lease.epoch);
/// # }
/// ```
impl From<&Lease> for FenceStamp {
    fn from(lease: &Lease) -> Self {
        Self {
            queue: lease.queue.as_str().to_owned(),
            job: lease.key.as_str().to_owned(),
            epoch: lease.epoch,
            owner: Some(lease.owner.as_str().to_owned()),
        }
    }
}

impl fmt::Display for FenceStamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}@{}", self.queue, self.job, self.epoch)
    }
}

fn parse_epoch(v: Option<&str>) -> Result<i64, StampError> {
    let v = match v.map(str::trim) {
        None | Some("") => return Err(StampError::Missing { name: EPOCH }),
        Some(v) => v,
    };
    let bad = |reason: String| StampError::Malformed { name: EPOCH, reason };
    if !v.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad(format!("{:?} is not a decimal integer", truncate(v))));
    }
    let epoch: i64 = v.parse().map_err(|_| bad(format!("{:?} is out of range", truncate(v))))?;
    if epoch < 1 {
        return Err(bad(format!("{epoch} is not a claimed epoch (must be >= 1)")));
    }
    Ok(epoch)
}

fn truncate(v: &str) -> &str {
    match v.char_indices().nth(40) {
        Some((i, _)) => &v[..i],
        None => v,
    }
}

/// Encodes a value for a header or attribute: bytes outside `!`..=`~`, and `%`, become `%XX`.
///
/// ```
/// assert_eq!(brokerfence::wire::encode("a b/ü%"), "a%20b/%C3%BC%25");
/// ```
pub fn encode(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    for b in value.bytes() {
        if (0x21..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Decodes an [`encode`]d value. `%` must start a two-digit hex escape; the result must be UTF-8
/// without NUL bytes. Other characters are taken as they are.
///
/// ```
/// assert_eq!(brokerfence::wire::decode("a%20b/%C3%BC%25").unwrap(), "a b/ü%");
/// assert!(brokerfence::wire::decode("100%").is_err());
/// assert!(brokerfence::wire::decode("%00").is_err());
/// assert!(brokerfence::wire::decode("%+A").is_err()); // a sign is no hex digit
/// ```
pub fn decode(value: &str) -> Result<String, String> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            // Exactly two hex digits: `from_str_radix` alone would also take a sign (`%+A`).
            let hex = bytes.get(i + 1..i + 3).filter(|h| h.iter().all(u8::is_ascii_hexdigit));
            let byte = hex.and_then(|h| std::str::from_utf8(h).ok()).and_then(|h| u8::from_str_radix(h, 16).ok());
            match byte {
                Some(b) => out.push(b),
                None => return Err(format!("bad %-escape at byte {i}")),
            }
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    if out.contains(&0) {
        return Err("contains a NUL byte".into());
    }
    String::from_utf8(out).map_err(|_| "not valid UTF-8 after decoding".into())
}

/// The JSON body of a `409 Conflict` for a stale epoch: names the job, the refused epoch and the
/// newest the receiver has accepted.
///
/// ```
/// let s = brokerfence::wire::FenceStamp::new("orders", "o-7", 1).with_owner("w1");
/// let body = brokerfence::wire::stale_epoch_json(&s, 2);
/// assert!(body.starts_with(r#"{"error":"stale_epoch","queue":"orders","job":"o-7","epoch":1,"newest":2,"owner":"w1""#));
/// ```
pub fn stale_epoch_json(stamp: &FenceStamp, newest: i64) -> String {
    format!(
        r#"{{"error":"stale_epoch","queue":{},"job":{},"epoch":{},"newest":{},"owner":{},"message":{}}}"#,
        json_string(&stamp.queue),
        json_string(&stamp.job),
        stamp.epoch,
        newest,
        stamp.owner.as_deref().map_or_else(|| "null".to_owned(), json_string),
        json_string(&stale_epoch_message(stamp, newest)),
    )
}

/// The JSON body of a `409 Conflict` for an epoch another owner already holds at the receiver
/// ([`Verdict::Conflict`]: a fencing token handed out twice).
///
/// ```
/// let s = brokerfence::wire::FenceStamp::new("orders", "o-7", 3).with_owner("w2");
/// let body = brokerfence::wire::epoch_conflict_json(&s);
/// assert!(body.starts_with(r#"{"error":"epoch_conflict","queue":"orders","job":"o-7","epoch":3,"owner":"w2""#));
/// ```
pub fn epoch_conflict_json(stamp: &FenceStamp) -> String {
    format!(
        r#"{{"error":"epoch_conflict","queue":{},"job":{},"epoch":{},"owner":{},"message":{}}}"#,
        json_string(&stamp.queue),
        json_string(&stamp.job),
        stamp.epoch,
        stamp.owner.as_deref().map_or_else(|| "null".to_owned(), json_string),
        json_string(&format!(
            "job {}/{}: epoch {} was already accepted from another owner (a fencing token handed out twice); \
             nothing was applied",
            stamp.queue, stamp.job, stamp.epoch
        )),
    )
}

/// The human sentence of a stale-epoch refusal.
///
/// ```
/// let s = brokerfence::wire::FenceStamp::new("orders", "o-7", 1);
/// assert_eq!(
///     brokerfence::wire::stale_epoch_message(&s, 2),
///     "job orders/o-7: epoch 1 is older than epoch 2 already accepted; the caller was superseded and nothing was applied"
/// );
/// ```
pub fn stale_epoch_message(stamp: &FenceStamp, newest: i64) -> String {
    format!(
        "job {}/{}: epoch {} is older than epoch {newest} already accepted; the caller was superseded and nothing was applied",
        stamp.queue, stamp.job, stamp.epoch
    )
}

/// A JSON string literal (with quotes) for `s`.
fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_awkward_values() {
        for job in ["plain", "with space", "ü/é", "100%", "a\r\nInjected: yes", "%41", "\u{1F600}", "tab\there"] {
            let stamp = FenceStamp::new("q ü", job, 9).with_owner("host:1 pid=2");
            let pairs = stamp.to_headers();
            for (_, v) in &pairs {
                assert!(v.bytes().all(|b| (0x21..=0x7e).contains(&b)), "{v:?} is not a safe header value");
            }
            let back = FenceStamp::from_headers(pairs.iter().map(|(k, v)| (*k, v.as_str()))).unwrap();
            assert_eq!(back, stamp);
        }
    }

    #[test]
    fn typed_errors() {
        let ok = [("Fence-Queue", "q"), ("Fence-Job", "k"), ("Fence-Epoch", "3")];
        assert!(FenceStamp::from_headers(ok).is_ok());
        for (drop, name) in [(0, QUEUE), (1, JOB), (2, EPOCH)] {
            let pairs: Vec<_> = ok.iter().enumerate().filter(|(i, _)| *i != drop).map(|(_, p)| *p).collect();
            assert_eq!(FenceStamp::from_headers(pairs), Err(StampError::Missing { name }));
        }
        for bad in ["-1", "0", "+1", "1.0", "x", "99999999999999999999", " 1 2"] {
            let err = FenceStamp::from_headers([("Fence-Queue", "q"), ("Fence-Job", "k"), ("Fence-Epoch", bad)]);
            assert!(matches!(err, Err(StampError::Malformed { name: EPOCH, .. })), "{bad}: {err:?}");
        }
        let err = FenceStamp::from_headers([("Fence-Queue", "q"), ("Fence-Job", "k%zz"), ("Fence-Epoch", "1")]);
        assert!(matches!(err, Err(StampError::Malformed { name: JOB, .. })));
        let err = FenceStamp::from_headers([
            ("Fence-Queue", "q"),
            ("Fence-Job", "k"),
            ("Fence-Epoch", "1"),
            ("FENCE-EPOCH", "2"),
        ]);
        assert_eq!(err, Err(StampError::Conflicting { name: EPOCH }));
        assert_eq!(
            FenceStamp::from_headers([("Fence-Queue", "q"), ("Fence-Job", ""), ("Fence-Epoch", "1")]),
            Err(StampError::Missing { name: JOB })
        );
    }

    #[test]
    fn ledger_job_is_injective_across_queues() {
        let a = FenceStamp::new("a/b", "c", 1).ledger_job();
        let b = FenceStamp::new("a", "b/c", 1).ledger_job();
        assert_ne!(a, b);
        assert_eq!(FenceStamp::new("ü/x", "k", 1).ledger_job(), "ü%2Fx/k");
        assert_eq!(FenceStamp::new("50%", "k", 1).ledger_job(), "50%25/k");
    }

    #[test]
    fn json_escapes() {
        let s = FenceStamp::new("q", "say \"hi\"\n", 1);
        let body = stale_epoch_json(&s, 5);
        assert!(body.contains(r#""job":"say \"hi\"\n""#), "{body}");
        assert!(body.contains(r#""owner":null"#));
    }
}

#[cfg(test)]
mod edges {
    use super::*;

    /// Issue #12 §5, second bullet: a `%`-escape is exactly two hex digits. `from_str_radix`
    /// accepts a leading sign, so `%+A` used to decode as `\n`; it must be refused like any other
    /// bad escape (and the strict decoder must still accept every real escape).
    #[test]
    fn edges_decode_refuses_a_signed_escape() {
        for bad in ["%+A", "a%+Ab", "%+0", "%-1", "%+f"] {
            assert!(decode(bad).is_err(), "{bad:?} decoded as {:?}", decode(bad));
        }
        assert_eq!(decode("%0A%0a%41%7E").as_deref(), Ok("\n\nA~"));
        assert_eq!(decode("%E2%82%AC").as_deref(), Ok("€"));
        for b in 1..=255u8 {
            let s = format!("%{b:02X}");
            if b < 0x80 {
                assert_eq!(decode(&s).map(String::into_bytes), Ok(vec![b]), "{s}");
            }
        }
    }
}
