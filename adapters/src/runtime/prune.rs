//! The consumer's background pruner (see [`ConsumerConfig::retention`](super::ConsumerConfig::retention)).

use std::sync::Arc;
use std::time::Duration;

use fence::FenceStore;
use tokio_util::sync::CancellationToken;

/// The longest one background prune run may take (each of its statements has its own, shorter,
/// limit): a run cut short rolls back only its current batch; the next run carries on.
const PRUNE_RUN_TIMEOUT: Duration = Duration::from_secs(600);

/// The consumer's background pruner (see [`ConsumerConfig::retention`]): a run now, then one
/// every interval, until `stop` fires (a run in progress then is dropped: its open batch rolls
/// back).
pub(super) async fn prune_loop(
    store: Arc<dyn FenceStore>,
    retention: fence::retention::Retention,
    stop: CancellationToken,
) {
    use tracing::Instrument;
    let span = tracing::info_span!("consumer.pruner", backend = store.backend().name());
    async move {
        loop {
            let run = tokio::time::timeout(PRUNE_RUN_TIMEOUT, store.prune(&retention));
            let outcome = tokio::select! {
                _ = stop.cancelled() => return,
                outcome = run => outcome,
            };
            match outcome {
                Ok(Ok(report)) => tracing::debug!(?report, "background prune run"),
                Ok(Err(fence::FenceError::Unsupported(what))) => {
                    tracing::warn!(what, "the store cannot prune; background pruner stopped");
                    return;
                }
                Ok(Err(e)) => tracing::warn!(error = %e, "background prune run failed; next run at the next interval"),
                Err(_) => tracing::warn!(timeout = ?PRUNE_RUN_TIMEOUT, "background prune run timed out"),
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(retention.get_every()) => {}
            }
        }
    }
    .instrument(span)
    .await
}
