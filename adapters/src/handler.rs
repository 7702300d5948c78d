//! The handler a consumer runs for each job.

use std::future::Future;

use fence::{IntoJobResult, JobContext, JobError};

/// A handler the [`Consumer`](crate::Consumer) runs for every job: a closure
/// `|ctx| async move { … }` (no annotation needed) that may be called many times at once, so it
/// is `Fn + Clone + Send + Sync + 'static` and its future `Send + 'static`. It returns its result
/// ([`IntoJobResult`]: bytes, a `String`, `()`, a `Json` value) or a [`JobError`], into which `?`
/// turns any error.
///
/// The retrofits ([`Retrofit::process`](crate::Retrofit::process) and the SQS and Redis list
/// ones) await the handler in place and take any `FnOnce(JobContext) -> impl Future`, borrowing
/// closures included; every `Handler` is one of those too.
///
/// ```
/// use brokerfence::{Handler, JobContext, JobError};
/// fn assert_handler<H: Handler>(_: H) {}
/// assert_handler(|ctx| async move { Ok(ctx.payload().to_vec()) });
/// assert_handler(|ctx| async move { Ok(format!("epoch {}", ctx.epoch())) });
/// assert_handler(|_ctx| async move {
///     let _config = std::fs::read("/etc/hostname")?; // io::Error → a retried JobError
///     Ok(())
/// });
/// // A handler returned from a function: `impl Handler`.
/// fn echo() -> impl Handler {
///     |ctx: JobContext| async move { Ok::<_, JobError>(ctx.payload().to_vec()) }
/// }
/// assert_handler(echo());
/// ```
pub trait Handler: Fn(JobContext) -> <Self as Handler>::Future + Clone + Send + Sync + 'static {
    /// The future of one call (call the handler as a function: `handler(ctx)`).
    type Future: Future<Output = Result<Self::Response, JobError>> + Send + 'static;
    /// The result it commits.
    type Response: IntoJobResult;
}

impl<F, Fut, R> Handler for F
where
    F: Fn(JobContext) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<R, JobError>> + Send + 'static,
    R: IntoJobResult,
{
    type Future = Fut;
    type Response = R;
}
