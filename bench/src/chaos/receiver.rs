//! The independent HTTP receiver: every call the workers make, with its fencing stamp, so that a
//! lower epoch accepted after a higher one is seen, and so is a (job, epoch) that came from two
//! owners (a fencing token handed out twice).

use super::*;

use brokerfence::epoch::timeline_of;

#[derive(Debug, Default)]
pub(crate) struct JobLog {
    pub(crate) accepted: Vec<i64>,
    pub(crate) max_accepted: i64,
    pub(crate) refused: u64,
    /// The owners that called with each epoch (accepted or refused): one claim has one owner.
    pub(crate) owners: BTreeMap<i64, HashSet<String>>,
    /// The PostgreSQL timelines of the epochs of every call (see `brokerfence::epoch`).
    pub(crate) timelines: HashSet<u32>,
}

/// An HTTP receiver that checks every call against the fence ledger and records it in its own
/// log, so the runner can check the ledger's answers independently.
pub(crate) struct Receiver {
    pub(crate) ledger: PgLedger,
    pub(crate) log: Mutex<HashMap<String, JobLog>>,
    pub(crate) locks: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    pub(crate) calls: AtomicU64,
    pub(crate) refused: AtomicU64,
    /// Calls refused because another owner already called with the same epoch.
    pub(crate) conflicts: AtomicU64,
    pub(crate) stale_accepts: AtomicU64,
    pub(crate) errors: AtomicU64,
    /// When (ms since the Unix epoch) the first call of a timeline above 1 was accepted; 0: none.
    pub(crate) first_promoted_accept_ms: AtomicU64,
}

impl Receiver {
    pub(crate) fn new(ledger: PgLedger) -> Self {
        Self {
            ledger,
            log: Mutex::default(),
            locks: Mutex::default(),
            calls: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            conflicts: AtomicU64::new(0),
            stale_accepts: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            first_promoted_accept_ms: AtomicU64::new(0),
        }
    }

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
        // Whatever the ledger says: the token was handed out to this owner.
        {
            let mut log = self.log.lock().unwrap_or_else(|p| p.into_inner());
            let entry = log.entry(stamp.job.clone()).or_default();
            entry.timelines.insert(timeline_of(stamp.epoch));
            if let Some(owner) = &stamp.owner {
                entry.owners.entry(stamp.epoch).or_default().insert(owner.clone());
            }
        }
        // One decision per job at a time, so the log's order is the ledger's order.
        let lock = self.lock_for(&job);
        let _held = lock.lock().await;
        let verdict = match &stamp.owner {
            Some(owner) => self.ledger.accept_by(&job, stamp.epoch, owner).await,
            None => self.ledger.accept(&job, stamp.epoch).await,
        };
        let verdict = match verdict {
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
                if timeline_of(stamp.epoch) > 1 {
                    let _ = self.first_promoted_accept_ms.compare_exchange(
                        0,
                        now_ms(),
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    );
                }
                (StatusCode::OK, "applied".into())
            }
            Verdict::Stale { newest } => {
                entry.refused += 1;
                self.refused.fetch_add(1, Ordering::Relaxed);
                (StatusCode::CONFLICT, format!("stale epoch {} < {newest}", stamp.epoch))
            }
            Verdict::Conflict { newest } => {
                entry.refused += 1;
                self.conflicts.fetch_add(1, Ordering::Relaxed);
                (StatusCode::CONFLICT, format!("epoch {newest} held by another owner"))
            }
            other => {
                entry.refused += 1;
                (StatusCode::CONFLICT, format!("refused: {other:?}"))
            }
        }
    }

    /// (job, epoch) pairs that came from more than one owner.
    pub(crate) fn tokens_handed_out_twice(&self) -> Vec<(String, i64, Vec<String>)> {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        let mut out: Vec<(String, i64, Vec<String>)> = Vec::new();
        for (job, entry) in log.iter() {
            for (epoch, owners) in &entry.owners {
                if owners.len() > 1 {
                    let mut owners: Vec<String> = owners.iter().cloned().collect();
                    owners.sort();
                    out.push((job.clone(), *epoch, owners));
                }
            }
        }
        out.sort();
        out
    }

    /// Jobs whose calls span timeline 1 and a later one: work done on the primary that failed
    /// over (and lost with it, or superseded) and done again on the promoted one.
    pub(crate) fn jobs_rerun_after_failover(&self) -> usize {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        log.values().filter(|e| e.timelines.contains(&1) && e.timelines.iter().any(|t| *t > 1)).count()
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
