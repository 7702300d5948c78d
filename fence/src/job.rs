//! What a handler returns: its result ([`IntoJobResult`]) or a [`JobError`], and how ordinary
//! errors become one (`?`, [`JobResultExt::fatal`]).

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;

/// The error type of boxed errors (`Box<dyn Error + Send + Sync>`, tower's `BoxError`).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A failure a handler reports: retried (with backoff) or final.
///
/// `?` turns any error that implements [`std::error::Error`]` + Send + Sync + 'static` (and, with
/// the feature `anyhow`, an `anyhow::Error`: see [`from_anyhow`](Self::from_anyhow)) into a
/// retryable `JobError` whose message is the error's whole chain (`"a: b: c"`); say that a failure
/// is final with [`.fatal()`](JobResultExt::fatal) on a `Result`, [`no_retry`](Self::no_retry) on a
/// `JobError`, or build one with [`JobError::fatal`].
///
/// Like `anyhow::Error`, `JobError` itself does not implement `std::error::Error` (that is what
/// lets every error convert into it); it converts into `Box<dyn Error + Send + Sync>` for code
/// that wants one, and keeps the error it was made from ([`source`](Self::source)).
///
/// ```
/// use brokerfence::{JobError, JobResultExt};
/// fn read(path: &str) -> Result<Vec<u8>, JobError> {
///     Ok(std::fs::read(path)?) // an io::Error: retried
/// }
/// fn parse(bytes: &[u8]) -> Result<u32, JobError> {
///     let text = std::str::from_utf8(bytes).fatal()?; // malformed input: never retried
///     Ok(text.trim().parse::<u32>().fatal()?)
/// }
/// let e = read("/nonexistent/brokerfence").unwrap_err();
/// assert!(e.retry);
/// assert!(e.message.contains("No such file"), "{e}");
/// let e = parse(b"seven").unwrap_err();
/// assert!(!e.retry);
/// assert_eq!(e.to_string(), "invalid digit found in string");
/// let e = brokerfence::JobError::retry("upstream 503");
/// assert!(e.retry);
/// let e = brokerfence::JobError::fatal("malformed order");
/// assert!(!e.retry);
/// ```
#[derive(Clone)]
pub struct JobError {
    /// What went wrong (stored as the job's last_error).
    pub message: String,
    /// Whether another attempt may succeed.
    pub retry: bool,
    source: Option<Arc<dyn std::error::Error + Send + Sync + 'static>>,
}

impl JobError {
    /// A failure worth retrying.
    pub fn retry(message: impl ToString) -> Self {
        Self { message: message.to_string(), retry: true, source: None }
    }

    /// A final failure: the job goes dead.
    pub fn fatal(message: impl ToString) -> Self {
        Self { message: message.to_string(), retry: false, source: None }
    }

    /// A retryable failure from an error, its message the error's whole chain (`"a: b: c"`); the
    /// error stays available through [`source`](Self::source). What `?` does.
    ///
    /// ```
    /// #[derive(Debug)]
    /// struct Outer(std::io::Error);
    /// impl std::fmt::Display for Outer {
    ///     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { f.write_str("loading the template") }
    /// }
    /// impl std::error::Error for Outer {
    ///     fn source(&self) -> Option<&(dyn std::error::Error + 'static)> { Some(&self.0) }
    /// }
    /// let e = brokerfence::JobError::from_error(Outer(std::io::Error::other("disk full")));
    /// assert_eq!(e.message, "loading the template: disk full");
    /// assert!(e.retry);
    /// assert!(e.source().is_some_and(|s| s.is::<Outer>()));
    /// ```
    pub fn from_error<E: std::error::Error + Send + Sync + 'static>(error: E) -> Self {
        Self { message: chain(&error), retry: true, source: Some(Arc::new(error)) }
    }

    /// A retryable failure from a boxed error (tower's `BoxError`, what layers such as
    /// `Timeout` answer). A `JobError` that was boxed (see the `From` impls) comes back as it
    /// was, its retry flag included.
    ///
    /// ```
    /// use brokerfence::{BoxError, JobError};
    /// let boxed: BoxError = JobError::fatal("bad input").into();
    /// let back = JobError::from_boxed(boxed);
    /// assert!(!back.retry);
    /// assert_eq!(back.message, "bad input");
    /// let boxed: BoxError = "request timed out".into();
    /// assert!(JobError::from_boxed(boxed).retry);
    /// ```
    pub fn from_boxed(error: BoxError) -> Self {
        match error.downcast::<Boxed>() {
            Ok(boxed) => boxed.0,
            Err(error) => Self { message: chain(&*error), retry: true, source: Some(Arc::from(error)) },
        }
    }

    /// A retryable failure from an `anyhow::Error` (feature `anyhow`), its message the whole
    /// context chain (`"a: b: c"`); the error it was made from stays available through
    /// [`source`](Self::source). What `?` on an `anyhow::Error` does. A `JobError` that went into
    /// an `anyhow::Error` through [`anyhow::Error::from_boxed`] comes back whole.
    ///
    /// With the feature on, a plain `?` on any other error takes this path too: anyhow captures
    /// a backtrace when `RUST_BACKTRACE` or `RUST_LIB_BACKTRACE` asks for one (and the
    /// conversion drops it).
    ///
    /// ```
    /// use anyhow::Context as _;
    /// use brokerfence::{JobError, JobResultExt};
    /// fn load(path: &str) -> anyhow::Result<String> {
    ///     std::fs::read_to_string(path).with_context(|| format!("loading the template {path}"))
    /// }
    /// fn handle(path: &str) -> Result<String, JobError> {
    ///     let template = load(path)?; // an anyhow::Error: retried
    ///     Ok(template)
    /// }
    /// let e = handle("/nonexistent/brokerfence").unwrap_err();
    /// assert!(e.retry);
    /// assert!(e.message.starts_with("loading the template /nonexistent/brokerfence: No such file"), "{e}");
    /// let e = load("/nonexistent/brokerfence").fatal().unwrap_err(); // final
    /// assert!(!e.retry);
    /// ```
    #[cfg(feature = "anyhow")]
    #[cfg_attr(docsrs, doc(cfg(feature = "anyhow")))]
    pub fn from_anyhow(error: anyhow::Error) -> Self {
        // The box holds the error anyhow was made from (or its context/message wrapper).
        Self::from_boxed(error.into())
    }

    /// The same failure, final: the job goes dead instead of being retried.
    ///
    /// ```
    /// let e = brokerfence::JobError::retry("quota exhausted for good").no_retry();
    /// assert!(!e.retry);
    /// ```
    pub fn no_retry(mut self) -> Self {
        self.retry = false;
        self
    }

    /// The error this failure was made from, if any (`?`, [`from_error`](Self::from_error),
    /// [`from_boxed`](Self::from_boxed)).
    pub fn source(&self) -> Option<&(dyn std::error::Error + Send + Sync + 'static)> {
        self.source.as_deref()
    }
}

/// The message of an error and of every source below it, joined with `": "`. A source whose
/// message its parent already ends with (a `Display` that prints its source) is not repeated.
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut message = error.to_string();
    let mut next = error.source();
    while let Some(source) = next {
        let part = source.to_string();
        if !part.is_empty() && !message.ends_with(&part) {
            message.push_str(": ");
            message.push_str(&part);
        }
        next = source.source();
    }
    message
}

impl fmt::Display for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl fmt::Debug for JobError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JobError")
            .field("message", &self.message)
            .field("retry", &self.retry)
            .field("source", &self.source)
            .finish()
    }
}

/// Equal when message and retry flag are (the source is not compared).
impl PartialEq for JobError {
    fn eq(&self, other: &Self) -> bool {
        self.message == other.message && self.retry == other.retry
    }
}

impl Eq for JobError {}

/// `?` on any error (see [`JobError`]).
#[cfg(not(feature = "anyhow"))]
impl<E: std::error::Error + Send + Sync + 'static> From<E> for JobError {
    fn from(error: E) -> Self {
        Self::from_error(error)
    }
}

/// `?` on any error, and on `anyhow::Error` (feature `anyhow`).
///
/// `impl From<anyhow::Error>` next to the impl for every `std::error::Error` would not compile
/// (anyhow may one day implement `std::error::Error`, so the two could overlap); everything
/// that converts into an `anyhow::Error` is exactly every such error plus `anyhow::Error`
/// itself, so this one impl covers both.
#[cfg(feature = "anyhow")]
impl<E: Into<anyhow::Error>> From<E> for JobError {
    fn from(error: E) -> Self {
        Self::from_anyhow(error.into())
    }
}

/// A `JobError` inside a `Box<dyn Error>`: [`JobError::from_boxed`] takes it back out whole.
#[derive(Debug)]
struct Boxed(JobError);

impl fmt::Display for Boxed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.message)
    }
}

impl std::error::Error for Boxed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match &self.0.source {
            Some(s) => Some(&**s),
            None => None,
        }
    }
}

impl From<JobError> for Box<dyn std::error::Error + Send + Sync + 'static> {
    fn from(error: JobError) -> Self {
        Box::new(Boxed(error))
    }
}

impl From<JobError> for Box<dyn std::error::Error + Send + 'static> {
    fn from(error: JobError) -> Self {
        Box::new(Boxed(error))
    }
}

impl From<JobError> for Box<dyn std::error::Error + 'static> {
    fn from(error: JobError) -> Self {
        Box::new(Boxed(error))
    }
}

/// `.fatal()` on any `Result` whose error converts into a [`JobError`]: the failure is final (the
/// job goes dead on this attempt) instead of retried.
///
/// ```
/// use brokerfence::{JobError, JobResultExt};
/// fn order_id(payload: &[u8]) -> Result<u64, JobError> {
///     let text = std::str::from_utf8(payload).fatal()?;
///     text.parse::<u64>().fatal()
/// }
/// assert_eq!(order_id(b"42"), Ok(42));
/// assert!(!order_id(b"forty-two").unwrap_err().retry);
/// ```
pub trait JobResultExt<T> {
    /// The error, if any, as a final [`JobError`] (never retried).
    fn fatal(self) -> Result<T, JobError>;
}

impl<T, E: Into<JobError>> JobResultExt<T> for Result<T, E> {
    fn fatal(self) -> Result<T, JobError> {
        self.map_err(|e| e.into().no_retry())
    }
}

/// What a handler may return as its result: the bytes stored as the job's result.
///
/// `Vec<u8>`, `String`, `&'static str`, `&'static [u8]` (and byte-string literals, `b"done"`),
/// `Box<[u8]>`, `Arc<[u8]>`, `Cow<'static, [u8]>`/`Cow<'static, str>`, and `()` (an empty
/// result); with the feature `serde`, [`Json`] for a typed result stored as JSON.
///
/// ```
/// use brokerfence::IntoJobResult;
/// assert_eq!("done".into_job_result(), Ok(b"done".to_vec()));
/// assert_eq!(String::from("done").into_job_result(), Ok(b"done".to_vec()));
/// assert_eq!(b"done".into_job_result(), Ok(b"done".to_vec()));
/// assert_eq!(().into_job_result(), Ok(Vec::new()));
/// ```
pub trait IntoJobResult {
    /// The bytes to commit, or why the result cannot be stored.
    fn into_job_result(self) -> Result<Vec<u8>, JobError>;
}

impl IntoJobResult for Vec<u8> {
    fn into_job_result(self) -> Result<Vec<u8>, JobError> {
        Ok(self)
    }
}

impl IntoJobResult for String {
    fn into_job_result(self) -> Result<Vec<u8>, JobError> {
        Ok(self.into_bytes())
    }
}

impl IntoJobResult for &'static str {
    fn into_job_result(self) -> Result<Vec<u8>, JobError> {
        Ok(self.as_bytes().to_vec())
    }
}

impl IntoJobResult for &'static [u8] {
    fn into_job_result(self) -> Result<Vec<u8>, JobError> {
        Ok(self.to_vec())
    }
}

impl<const N: usize> IntoJobResult for &'static [u8; N] {
    fn into_job_result(self) -> Result<Vec<u8>, JobError> {
        Ok(self.to_vec())
    }
}

impl IntoJobResult for Box<[u8]> {
    fn into_job_result(self) -> Result<Vec<u8>, JobError> {
        Ok(self.into_vec())
    }
}

impl IntoJobResult for Arc<[u8]> {
    fn into_job_result(self) -> Result<Vec<u8>, JobError> {
        Ok(self.to_vec())
    }
}

impl IntoJobResult for Cow<'static, [u8]> {
    fn into_job_result(self) -> Result<Vec<u8>, JobError> {
        Ok(self.into_owned())
    }
}

impl IntoJobResult for Cow<'static, str> {
    fn into_job_result(self) -> Result<Vec<u8>, JobError> {
        Ok(self.into_owned().into_bytes())
    }
}

impl IntoJobResult for () {
    fn into_job_result(self) -> Result<Vec<u8>, JobError> {
        Ok(Vec::new())
    }
}

/// A typed result, stored as JSON (feature `serde`). A value that cannot be serialized is a
/// final failure (serializing it again would fail again).
///
/// ```
/// use brokerfence::{IntoJobResult, Json};
/// #[derive(serde::Serialize)]
/// struct Sent { id: u32 }
/// assert_eq!(Json(Sent { id: 7 }).into_job_result(), Ok(br#"{"id":7}"#.to_vec()));
/// ```
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Json<T>(pub T);

#[cfg(feature = "serde")]
impl<T: serde::Serialize> IntoJobResult for Json<T> {
    fn into_job_result(self) -> Result<Vec<u8>, JobError> {
        serde_json::to_vec(&self.0).map_err(|e| JobError::from_error(e).no_retry())
    }
}

#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
impl crate::JobContext {
    /// The payload, deserialized from JSON (feature `serde`). A payload that does not
    /// deserialize is a final failure: it is the same payload on every attempt.
    ///
    /// ```no_run
    /// # async fn demo(fence: brokerfence::Retrofit) -> brokerfence::Result<()> {
    /// use brokerfence::{JobKey, Json};
    /// #[derive(serde::Deserialize)]
    /// struct Order { id: u64, qty: u32 }
    /// #[derive(serde::Serialize)]
    /// struct Receipt { id: u64, total: u32 }
    /// let body = br#"{"id":7,"qty":3}"#.to_vec();
    /// fence.process(&JobKey::new("order-7")?, body, |ctx| async move {
    ///     let order: Order = ctx.json()?;
    ///     Ok(Json(Receipt { id: order.id, total: order.qty * 10 }))
    /// }).await;
    /// # Ok(()) }
    /// ```
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, JobError> {
        serde_json::from_slice(self.payload()).map_err(|e| JobError::from_error(e).no_retry())
    }
}
