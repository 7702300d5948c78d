//! The independent HTTP receiver: every call the workers make, with its fencing stamp, so that a
//! lower epoch accepted after a higher one is seen.

use super::*;

#[derive(Debug, Default)]
pub(crate) struct JobLog {
    pub(crate) accepted: Vec<i64>,
    pub(crate) max_accepted: i64,
    pub(crate) refused: u64,
}

/// An HTTP receiver that checks every call against the fence ledger and records it in its own
/// log, so the runner can check the ledger's answers independently.
pub(crate) struct Receiver {
    pub(crate) ledger: PgLedger,
    pub(crate) log: Mutex<HashMap<String, JobLog>>,
    pub(crate) locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    pub(crate) calls: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) stale_accepts: AtomicU64,
    pub(crate) errors: AtomicU64,
}

impl Receiver {
    pub(crate) fn lock_for(&self, job: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut locks = self.locks.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(locks.entry(job.to_owned()).or_default())
    }

    pub(crate) async fn call(&self, headers: &axum::http::HeaderMap) -> (axum::http::StatusCode, String) {
        use axum::http::StatusCode;
        self.calls.fetch_add(1, Ordering::Relaxed);
        let pairs = headers.iter().filter_map(|(k, v)| v.to_str().ok().map(|v| (k.as_str().to_owned(), v.to_owned())));
        let stamp = match FenceStamp::from_headers(pairs) {
            Ok(s) => s,
            Err(e) => return (StatusCode::BAD_REQUEST, e.to_json()),
        };
        let job = stamp.ledger_job();
        // One decision per job at a time, so the log's order is the ledger's order.
        let lock = self.lock_for(&job);
        let _held = lock.lock().await;
        let verdict = match self.ledger.accept(&job, stamp.epoch).await {
            Ok(v) => v,
            Err(e) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                return (StatusCode::SERVICE_UNAVAILABLE, e.to_string());
            }
        };
        let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        let entry = log.entry(stamp.job.clone()).or_default();
        match verdict {
            Verdict::Accepted { .. } => {
                if stamp.epoch < entry.max_accepted {
                    self.stale_accepts.fetch_add(1, Ordering::Relaxed);
                }
                entry.max_accepted = entry.max_accepted.max(stamp.epoch);
                entry.accepted.push(stamp.epoch);
                (StatusCode::OK, "applied".into())
            }
            Verdict::Stale { newest } => {
                entry.refused += 1;
                self.refused.fetch_add(1, Ordering::Relaxed);
                (StatusCode::CONFLICT, format!("stale epoch {} < {newest}", stamp.epoch))
            }
        }
    }
}

pub(crate) async fn start_receiver(receiver: Arc<Receiver>) -> Result<(String, tokio::task::JoinHandle<()>), String> {
    use axum::routing::post;
    let app = axum::Router::new().route(
        "/effect",
        post(move |headers: axum::http::HeaderMap| {
            let receiver = Arc::clone(&receiver);
            async move { receiver.call(&headers).await }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.map_err(|e| format!("bind receiver: {e}"))?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    let handle = tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("chaos receiver stopped: {e}");
        }
    });
    Ok((format!("http://{addr}/effect"), handle))
}
