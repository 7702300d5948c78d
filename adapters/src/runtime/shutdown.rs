//! [`shutdown_signal`]: a cancellation token that fires on SIGTERM or Ctrl-C.

use tokio_util::sync::CancellationToken;

/// A token that fires on SIGTERM or Ctrl-C: pass it to [`Consumer::run`](super::Consumer::run).
///
/// ```no_run
/// # async fn demo() {
/// let stop = brokerfence::shutdown_signal();
/// stop.cancelled().await;
/// # }
/// ```
pub fn shutdown_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let fire = token.clone();
    tokio::spawn(async move {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            match signal(SignalKind::terminate()) {
                Ok(mut term) => {
                    tokio::select! {
                        _ = term.recv() => {}
                        _ = tokio::signal::ctrl_c() => {}
                    }
                }
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
        tracing::info!("shutdown signal received");
        fire.cancel();
    });
    token
}
