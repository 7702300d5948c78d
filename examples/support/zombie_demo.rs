//! The zombie demo's stage (`zombie.rs`): where it keeps its state (SQLite, or PostgreSQL from
//! `DATABASE_URL`), the timeline clock, the payments service standing in for an HTTP receiver (the
//! same `Fence-*` headers and ledger check as the `adapters::http` middleware, in process) and
//! the in-process network to it, and the printing. Included by `zombie.rs` with
//! `#[path = "support/zombie_demo.rs"] mod demo;`.

use std::collections::HashMap;
use std::error::Error;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use brokerfence::ledger::{Ledger, PgLedger, SqliteLedger, Verdict};
use brokerfence::wire::{self, FenceStamp};
use brokerfence::{FenceStore, JobKey, JobRecord, MetricsSnapshot, Outcome, PgFence, SchemaName, SqliteFence};

pub type BoxError = Box<dyn Error + Send + Sync>;

/// Where the demo keeps its state.
#[derive(Debug, Clone)]
pub enum Db {
    Postgres { url: String, schema: SchemaName },
    Sqlite { path: std::path::PathBuf },
}

impl Db {
    /// Only the environment decides: a fresh machine with nothing installed runs on SQLite.
    pub fn from_env() -> Result<Db, BoxError> {
        Ok(match std::env::var("DATABASE_URL") {
            Ok(url) if url.starts_with("postgres") => {
                let schema = SchemaName::new(format!("zombie_demo_{:08x}", random_u32()))?;
                println!("brokerfence zombie demo on PostgreSQL ({url}, schema {})", schema.as_str());
                Db::Postgres { url, schema }
            }
            _ => {
                let path = std::env::temp_dir().join(format!("brokerfence-zombie-demo-{}.db", std::process::id()));
                println!(
                    "brokerfence zombie demo on SQLite ({}); set DATABASE_URL=postgres://… to use PostgreSQL",
                    path.display()
                );
                Db::Sqlite { path }
            }
        })
    }

    /// Drops the demo's schema (PostgreSQL) or removes its database files (SQLite).
    pub async fn remove(&self) -> Result<(), BoxError> {
        match self {
            Db::Postgres { schema, url } => {
                let fence = PgFence::connect(url).await?;
                sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA IF EXISTS {} CASCADE", schema.as_str())))
                    .execute(fence.pool())
                    .await?;
            }
            Db::Sqlite { path } => {
                for ext in ["", "-wal", "-shm"] {
                    let _ = std::fs::remove_file(format!("{}{ext}", path.display()));
                }
            }
        }
        Ok(())
    }

    pub async fn open(&self) -> Result<(Arc<dyn FenceStore>, Ledger), BoxError> {
        Ok(match self {
            Db::Postgres { url, schema } => {
                let fence = PgFence::connect(url).await?.schema(schema.clone());
                fence.migrate().await?;
                let ledger = Ledger::Pg(PgLedger::new(&fence, "payments-service"));
                (Arc::new(fence), ledger)
            }
            Db::Sqlite { path } => {
                let fence = SqliteFence::open(&format!("sqlite:{}", path.display())).await?;
                fence.migrate().await?;
                let ledger = Ledger::Sqlite(SqliteLedger::new(&fence, "payments-service"));
                (Arc::new(fence), ledger)
            }
        })
    }
}

/// Prints one timeline line.
#[derive(Clone, Copy)]
pub struct Clock(pub Instant);

impl Clock {
    pub fn say(&self, who: &str, what: impl std::fmt::Display) {
        println!("  [{:>5.2}s] {who:<9} {what}", self.0.elapsed().as_secs_f64());
    }
}

/// The downstream receiver: charges a customer once per job, newest epoch wins.
pub struct Payments {
    pub ledger: Ledger,
    pub clock: Mutex<Clock>,
    /// The charge on record per job: (epoch, description).
    pub charges: Mutex<HashMap<String, (i64, String)>>,
}

impl Payments {
    pub fn new(ledger: Ledger) -> Self {
        Payments { ledger, clock: Mutex::new(Clock(Instant::now())), charges: Mutex::new(HashMap::new()) }
    }

    async fn handle(&self, headers: &[(&'static str, String)], body: &str) -> (u16, String) {
        let clock = *self.clock.lock().expect("clock");
        let stamp = match FenceStamp::from_headers(headers.iter().map(|(k, v)| (*k, v.as_str()))) {
            Ok(s) => s,
            Err(e) => return (400, e.to_json()),
        };
        match stamp.accept(&self.ledger).await {
            Ok(Verdict::Accepted { .. }) => {
                let mut charges = self.charges.lock().expect("charges");
                let before = charges.insert(stamp.ledger_job(), (stamp.epoch, body.to_owned()));
                match before {
                    Some((e, _)) if e < stamp.epoch => clock.say(
                        "payments",
                        format!("epoch {} accepted: replaces the charge of epoch {e} with {body:?}", stamp.epoch),
                    ),
                    _ => clock.say("payments", format!("epoch {} accepted: {body:?} on record", stamp.epoch)),
                }
                (200, "charged".into())
            }
            Ok(Verdict::Stale { newest }) => {
                clock.say(
                    "payments",
                    format!("epoch {} REFUSED (409): epoch {newest} was already accepted", stamp.epoch),
                );
                (409, wire::stale_epoch_json(&stamp, newest))
            }
            Ok(_) => {
                clock.say("payments", format!("epoch {} REFUSED (409): another owner holds it", stamp.epoch));
                (409, wire::epoch_conflict_json(&stamp))
            }
            Err(e) => (503, e.to_string()),
        }
    }
}

/// One request on the in-process "network" to the payments service.
pub struct Request {
    headers: Vec<(&'static str, String)>,
    body: String,
    reply: std::sync::mpsc::Sender<(u16, String)>,
}

#[derive(Clone)]
pub struct Network(tokio::sync::mpsc::UnboundedSender<Request>);

impl Network {
    /// Starts the payments service on the in-process network; it stops when every `Network`
    /// clone is dropped.
    pub fn serve(payments: Arc<Payments>) -> (Network, tokio::task::JoinHandle<()>) {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Request>();
        let server = tokio::spawn(async move {
            while let Some(req) = rx.recv().await {
                let answer = payments.handle(&req.headers, &req.body).await;
                let _ = req.reply.send(answer);
            }
        });
        (Network(tx), server)
    }

    /// A blocking call, as a handler doing synchronous I/O makes it: nothing can interrupt it.
    pub fn call_blocking(&self, stamp: &FenceStamp, body: &str) -> (u16, String) {
        let (reply, answer) = std::sync::mpsc::channel();
        let sent = self.0.send(Request { headers: stamp.to_headers(), body: body.to_owned(), reply });
        match sent {
            Ok(()) => answer.recv().unwrap_or((503, "payments service gone".into())),
            Err(_) => (503, "payments service gone".into()),
        }
    }

    /// The same call from async code.
    pub async fn call(&self, stamp: &FenceStamp, body: &str) -> (u16, String) {
        let net = self.clone();
        let (stamp, body) = (stamp.clone(), body.to_owned());
        tokio::task::spawn_blocking(move || net.call_blocking(&stamp, &body)).await.unwrap_or((503, "join".into()))
    }
}

/// One line for a supervisor's outcome.
pub fn describe(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Completed => "accepted: the job is completed with this result".into(),
        Outcome::Fenced(e) => format!("REFUSED (Fenced): {e}"),
        Outcome::LeaseLost { reason } => format!("cancelled before committing ({reason:?})"),
        other => format!("{other:?}"),
    }
}

/// A random number for the demo's schema name (std's randomly seeded hasher: no `rand` needed).
fn random_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u32(std::process::id());
    hasher.finish() as u32
}

/// Logs on stderr only with `RUST_LOG` set (`debug`, or per crate: `brokerfence_fence=debug,info`);
/// no colour codes unless stderr is a terminal, and never with `NO_COLOR` set.
pub fn init_logging() -> Result<(), BoxError> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    if let Ok(spec) = std::env::var("RUST_LOG") {
        let filter: tracing_subscriber::filter::Targets = spec.parse().map_err(|e| format!("RUST_LOG={spec}: {e}"))?;
        let colour = std::io::IsTerminal::is_terminal(&std::io::stderr())
            && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
        let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_ansi(colour);
        tracing_subscriber::registry().with(logs).with(filter).init();
    }
    Ok(())
}

/// Prints the job row, the payments service's record and both workers' counters after a case.
pub fn print_final_state(
    key: &JobKey,
    job: &JobRecord,
    newest: Option<i64>,
    charge: Option<&(i64, String)>,
    metrics: [(&str, MetricsSnapshot); 2],
) {
    let result = String::from_utf8_lossy(job.result.as_deref().unwrap_or_default());
    println!("  final state of {key}:");
    println!(
        "    job row    {}, epoch {}, owner {}, result {result:?}",
        job.state,
        job.epoch,
        job.owner.as_deref().unwrap_or("-")
    );
    println!(
        "    payments   newest epoch {}, charge on record: {}",
        newest.map_or("-".into(), |e| e.to_string()),
        charge.map_or("none".into(), |(e, d)| format!("{d:?} (epoch {e})"))
    );
    for (who, m) in metrics {
        println!(
            "    {who}   heartbeats={} lease_losses={} fenced_rejections={} completions={}",
            m.heartbeats, m.lease_losses, m.fenced_rejections, m.completions
        );
    }
}
