//! Handlers as [tower](https://docs.rs/tower) services (feature `tower`).
//!
//! [`handler`] turns any `Service<JobContext>` into a [`Handler`], so the layers of the tower
//! ecosystem wrap a fenced handler as they wrap an HTTP one: `TimeoutLayer`,
//! `ConcurrencyLimitLayer`, retry, tracing. The service's response is the job's result
//! ([`IntoJobResult`]: bytes, a `String`, `()`, …); its error is anything that converts into a
//! `BoxError`, which is what layers answer (a `Timeout`'s `Elapsed`, your own error, a
//! [`JobError`], whose retry flag survives the trip through the box).
//!
//! The result of the service still commits only through the fence: a layer's timeout is a
//! failed attempt (retried, or dead past the retry policy), and a lost lease still cancels the
//! whole stack.
//!
//! ```no_run
//! # async fn demo(consumer: brokerfence::Consumer<brokerfence::TableQueue>) -> Result<(), brokerfence::SourceError> {
//! use std::time::Duration;
//! use brokerfence::{JobContext, JobError};
//! use tower::ServiceBuilder;
//!
//! let service = ServiceBuilder::new()
//!     .concurrency_limit(8)
//!     .timeout(Duration::from_secs(5)) // an attempt past 5 s fails (and is retried)
//!     .service_fn(|ctx: JobContext| async move {
//!         Ok::<_, JobError>(format!("handled at epoch {}", ctx.epoch()))
//!     });
//! consumer.run(brokerfence::tower::handler(service), brokerfence::shutdown_signal()).await?;
//! # Ok(()) }
//! ```

use std::future::poll_fn;
use std::sync::{Arc, Mutex};

use ::tower::Service;
use fence::{BoxError, IntoJobResult, JobContext, JobError};

use crate::handler::Handler;

/// A [`Handler`] that calls `service` for every job: a clone of it per job (as tower services
/// are shared), ready first. Works with [`Consumer::run`](crate::Consumer::run) and every
/// retrofit's `process`.
///
/// ```no_run
/// # async fn demo(fence: brokerfence::Retrofit) -> brokerfence::Result<()> {
/// use brokerfence::{JobContext, JobError, JobKey};
/// let service = tower::service_fn(|ctx: JobContext| async move { Ok::<_, JobError>(ctx.payload().to_vec()) });
/// let handler = brokerfence::tower::handler(service);
/// let done = fence.process(&JobKey::new("msg-1")?, b"body".to_vec(), handler.clone()).await;
/// assert!(done.should_ack());
/// # Ok(()) }
/// ```
pub fn handler<S>(service: S) -> impl Handler
where
    S: Service<JobContext> + Clone + Send + 'static,
    S::Response: IntoJobResult,
    S::Error: Into<BoxError>,
    S::Future: Send + 'static,
{
    // Shared by every clone of the handler; each job takes a clone of the service.
    let service = Arc::new(Mutex::new(service));
    move |ctx: JobContext| {
        let mut service = service.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone();
        async move {
            poll_fn(|cx| service.poll_ready(cx)).await.map_err(|e| JobError::from_boxed(e.into()))?;
            service.call(ctx).await.map_err(|e| JobError::from_boxed(e.into()))
        }
    }
}
