//! A panicking handler is a failed attempt. The panic is caught where the handler is called and
//! polled, and becomes a retried [`JobError`] carrying the panic's message, so the attempt is
//! finished through the fenced failure like any other error: the job's `last_error` says what
//! happened, its retry policy applies, and the loop that ran it (a retrofit's, a consumer's task)
//! goes on. Uncaught, a panic unwound through a retrofit into the caller's loop and ended the
//! process, and the job stayed `running` with no error until its lease ran out.

use std::any::Any;
use std::future::Future;
use std::panic::AssertUnwindSafe;

use fence::{JobContext, JobError};
use futures::FutureExt;

/// Calls `handler` with `ctx` and awaits it; a panic, in the call or in any poll of its future,
/// answers `Err(JobError::retry("handler panicked: <message>"))`.
///
/// Unwind safety is asserted: the handler's state is dropped with its future, and the only
/// state it shares with the fence (the attempt's slot) is behind locks and atomics that a panic
/// cannot leave half-written.
pub(crate) async fn run_caught<F, Fut, R>(handler: F, ctx: JobContext) -> Result<R, JobError>
where
    F: FnOnce(JobContext) -> Fut,
    Fut: Future<Output = Result<R, JobError>>,
{
    let (key, epoch) = (ctx.key().clone(), ctx.epoch());
    let answered = match std::panic::catch_unwind(AssertUnwindSafe(move || handler(ctx))) {
        Ok(future) => AssertUnwindSafe(future).catch_unwind().await,
        Err(payload) => Err(payload),
    };
    answered.unwrap_or_else(|payload| {
        let message = panic_message(payload.as_ref());
        tracing::error!(%key, epoch, panic = %message, "handler panicked: the attempt fails and is retried by policy");
        Err(JobError::retry(format!("handler panicked: {message}")))
    })
}

/// The text of a panic (`panic!("…")` carries a `&str` or a `String`).
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&'static str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a text message".to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::panic_message;

    #[test]
    fn the_message_of_a_panic_is_its_text() {
        let caught = std::panic::catch_unwind(|| panic!("boom {}", 7)).expect_err("panicked");
        assert_eq!(panic_message(caught.as_ref()), "boom 7");
        let caught = std::panic::catch_unwind(|| panic!("plain")).expect_err("panicked");
        assert_eq!(panic_message(caught.as_ref()), "plain");
        let caught = std::panic::catch_unwind(|| std::panic::panic_any(3_u8)).expect_err("panicked");
        assert_eq!(panic_message(caught.as_ref()), "a panic without a text message");
    }
}
