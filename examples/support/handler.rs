//! The handler's side: the receiver call with the fencing stamp, shutdown on signals, and the
//! periodic metrics line.

use super::*;

/// Prints `EVENT dropped` if the attempt is cancelled (its future dropped) before it returned.
struct DropWatch<'a> {
    lease: &'a Lease,
    returned: bool,
}

impl Drop for DropWatch<'_> {
    fn drop(&mut self) {
        if !self.returned {
            lease_event("dropped", self.lease, &[]);
        }
    }
}

/// What the handler of the consumer workers does after `handler_delay`.
#[derive(Clone)]
pub struct CallReceiver {
    /// The HTTP client.
    pub http: reqwest::Client,
    /// `--receiver-url`.
    pub receiver: Option<Arc<str>>,
    /// `--handler-delay`.
    pub delay: Duration,
    /// `--after-call-delay`.
    pub after_call: Duration,
}

impl CallReceiver {
    /// From the common flags.
    pub fn new(common: &Common) -> Self {
        Self {
            http: reqwest::Client::new(),
            receiver: common.receiver().as_deref().map(Arc::from),
            delay: common.handler_delay,
            after_call: common.after_call_delay,
        }
    }

    /// The handler: `claimed`, then calls the receiver with the job's fencing stamp (`calling`,
    /// `called`), and returns "owner@epoch" (`handled`) or the error (`failed`). A cancelled
    /// attempt prints `dropped`.
    pub async fn handle(self, ctx: JobContext) -> Result<Vec<u8>, JobError> {
        let lease = ctx.lease().clone();
        let mut watch = DropWatch { lease: &lease, returned: false };
        lease_event("claimed", &lease, &[("attempt", &lease.attempts)]);
        let result = self.call(&ctx, &lease).await;
        watch.returned = true;
        match &result {
            Ok(_) => lease_event("handled", &lease, &[]),
            Err(e) => lease_event("failed", &lease, &[("retry", &e.retry), ("error", &e.message)]),
        }
        result
    }

    async fn call(&self, ctx: &JobContext, lease: &Lease) -> Result<Vec<u8>, JobError> {
        tokio::time::sleep(self.delay).await;
        if let Some(url) = self.receiver.as_deref() {
            lease_event("calling", lease, &[]);
            let mut request = self.http.post(url).body(ctx.payload().to_vec());
            for (name, value) in ctx.stamp().to_headers() {
                request = request.header(name, value);
            }
            let response = request.send().await.map_err(|e| JobError::retry(format!("receiver unreachable: {e}")))?;
            let status = response.status().as_u16();
            lease_event("called", lease, &[("status", &status)]);
            match status {
                200..=299 => {}
                // The receiver has seen a newer epoch: this worker was superseded. The fenced
                // failure is refused by the database too; nothing is acknowledged.
                409 => return Err(JobError::retry(format!("receiver refused epoch {}: superseded", ctx.epoch()))),
                s => return Err(JobError::retry(format!("receiver answered {s}"))),
            }
        }
        tokio::time::sleep(self.after_call).await;
        Ok(format!("{}@{}", ctx.owner(), ctx.epoch()).into_bytes())
    }
}

/// A token cancelled on SIGTERM or SIGINT. Unlike `adapters::shutdown_signal`, the handlers are
/// in place when this returns, so a driver that waits for `EVENT ready` (printed after it) can
/// send SIGTERM at once without killing the process.
pub fn shutdown_on_signals() -> tokio_util::sync::CancellationToken {
    use tokio::signal::unix::{SignalKind, signal};
    let token = tokio_util::sync::CancellationToken::new();
    let (term, int) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt()));
    let fire = token.clone();
    tokio::spawn(async move {
        match (term, int) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            _ => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
        tracing::info!("shutdown signal received");
        fire.cancel();
    });
    token
}

/// Prints a `metrics` line whenever a counter changed (every 50 ms at most); abort it at the end.
pub fn spawn_metrics(metrics: Arc<fence::Metrics>) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut last = metrics.snapshot();
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let now = metrics.snapshot();
            if now != last {
                println!("EVENT metrics {now}");
                last = now;
            }
        }
    })
}
