//! The handler a consumer runs for each job.

use std::future::Future;
use std::pin::Pin;

use fence::{JobContext, JobError};

/// A boxed handler future.
pub type HandlerFuture = Pin<Box<dyn Future<Output = Result<Vec<u8>, JobError>> + Send + 'static>>;

/// Something that handles one job: usually a closure `|ctx: JobContext| async move { … }`
/// returning the result bytes to commit, or a [`JobError`].
///
/// ```
/// use brokerfence::Handler;
/// fn assert_handler<H: Handler>(_: H) {}
/// assert_handler(|ctx: brokerfence::JobContext| async move { Ok::<_, brokerfence::JobError>(ctx.payload().to_vec()) });
/// ```
pub trait Handler: Clone + Send + Sync + 'static {
    /// Handles one job.
    fn call(&self, ctx: JobContext) -> HandlerFuture;
}

impl<F, Fut> Handler for F
where
    F: Fn(JobContext) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<Vec<u8>, JobError>> + Send + 'static,
{
    fn call(&self, ctx: JobContext) -> HandlerFuture {
        Box::pin((self)(ctx))
    }
}
