//! Following a master watched by Sentinel.
//!
//! One task per [`RedisConnections`](super::RedisConnections) asks every sentinel where the
//! master is (`SENTINEL GET-MASTER-ADDR-BY-NAME`), takes the address most of those that answered
//! give, checks that the server there says `ROLE` = master, and publishes it. It asks every
//! [`sentinel_poll`](super::RedisTimeouts::sentinel_poll) (default 1 s) and at once after a call
//! failed in a way that may mean the master moved (a killed master refuses connections, a demoted
//! one answers `READONLY`), at most every 100 ms. Each
//! [`SentinelConn`] reconnects when the published master changes, so after a failover the workers
//! follow the new master within one poll and one connect, without a restart.
//!
//! Which master a write reached never decides anything: a write the old master took and lost in
//! the failover is a lost hint, and the database epoch still decides which result commits.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use ::redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use ::redis::{AsyncConnectionConfig, Client, Cmd, Pipeline, RedisFuture, Value};
use tokio::sync::{Mutex, Notify, watch};

use super::error::RedisError;
use super::timeouts::{RedisTimeouts, bounded, bounded_op};
use super::url::SentinelTarget;

/// The master the sentinels agree on, numbered so that connections notice a change.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Master {
    generation: u64,
    addr: String,
}

/// What every connection to one Sentinel master shares.
struct Shared {
    target: SentinelTarget,
    master: watch::Receiver<Master>,
    poke: Arc<Notify>,
}

/// An auto-reconnecting connection to the current master.
#[derive(Clone)]
pub(crate) struct SentinelConn {
    shared: Arc<Shared>,
    config: ConnectionManagerConfig,
    connect: Duration,
    cached: Arc<Mutex<Option<(u64, ConnectionManager)>>>,
}

impl SentinelConn {
    /// Finds the master, starts the task that follows it, and opens the command connection
    /// (`response` timeout) and the blocking one (none).
    pub async fn open(target: SentinelTarget, timeouts: RedisTimeouts) -> Result<(Self, Self), RedisError> {
        let unreachable = |e: RedisError| RedisError::Unreachable { addr: target.describe(), source: Box::new(e) };
        let mut asker = Asker::new(target.clone(), timeouts);
        let addr = asker.find().await.map_err(unreachable)?;
        let (tx, rx) = watch::channel(Master { generation: 1, addr });
        let poke = Arc::new(Notify::new());
        tokio::spawn(follow(asker, tx, Arc::clone(&poke), timeouts.get_sentinel_poll()));
        let shared = Arc::new(Shared { target: target.clone(), master: rx, poke });
        let base = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeouts.get_connect()))
            .set_max_delay(Duration::from_secs(1))
            .set_number_of_retries(2);
        let connect = timeouts.get_connect().saturating_mul(2).saturating_add(timeouts.get_response());
        let make = |config: ConnectionManagerConfig| SentinelConn {
            shared: Arc::clone(&shared),
            config,
            connect,
            cached: Arc::new(Mutex::new(None)),
        };
        let commands = make(base.clone().set_response_timeout(Some(timeouts.get_response())));
        let blocking = make(base.set_response_timeout(None));
        commands.current().await.map_err(|e| unreachable(RedisError::Command { command: "connect", source: e }))?;
        Ok((commands, blocking))
    }

    /// The connection to the master published now, opened again when it changed.
    async fn current(&self) -> ::redis::RedisResult<ConnectionManager> {
        let mut cached = self.cached.lock().await;
        // Read under the lock: a call that waited for it must not go back to an older master
        // than the one the call before it connected to.
        let master = self.shared.master.borrow().clone();
        if let Some((generation, conn)) = cached.as_ref()
            && *generation >= master.generation
        {
            return Ok(conn.clone());
        }
        let client = Client::open(self.shared.target.master_url(&master.addr))?;
        let conn = tokio::time::timeout(self.connect, client.get_connection_manager_with_config(self.config.clone()))
            .await
            .map_err(|_| {
                std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("no connection to the master at {} within {:?}", master.addr, self.connect),
                )
            })??;
        *cached = Some((master.generation, conn.clone()));
        Ok(conn)
    }

    /// Asks the sentinels at once when `e` may mean the master moved: the connection failed or
    /// timed out, or the server is no master any more (`READONLY`, `MASTERDOWN`, `LOADING`). A
    /// script's own error, `NOGROUP` and the like ask nothing.
    fn failed(&self, e: &::redis::RedisError) {
        let moved = e.is_io_error()
            || e.is_connection_dropped()
            || e.is_connection_refusal()
            || e.is_timeout()
            || matches!(e.code(), Some("READONLY" | "MASTERDOWN" | "LOADING"));
        if moved {
            self.shared.poke.notify_one();
        }
    }

    pub fn get_db(&self) -> i64 {
        self.shared.target.db
    }

    pub fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        Box::pin(async move {
            let out = match self.current().await {
                Ok(mut conn) => conn.req_packed_command(cmd).await,
                Err(e) => Err(e),
            };
            if let Err(e) = &out {
                self.failed(e);
            }
            out
        })
    }

    pub fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let out = match self.current().await {
                Ok(mut conn) => conn.req_packed_commands(pipeline, offset, count).await,
                Err(e) => Err(e),
            };
            if let Err(e) = &out {
                self.failed(e);
            }
            out
        })
    }
}

/// Asks the sentinels; keeps one connection per sentinel between asks.
struct Asker {
    target: SentinelTarget,
    timeouts: RedisTimeouts,
    sentinels: Vec<Option<MultiplexedConnection>>,
}

impl Asker {
    fn new(target: SentinelTarget, timeouts: RedisTimeouts) -> Self {
        let sentinels = vec![None; target.sentinels.len()];
        Self { target, timeouts, sentinels }
    }

    fn config(&self) -> AsyncConnectionConfig {
        AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeouts.get_connect()))
            .set_response_timeout(Some(self.timeouts.get_response()))
    }

    /// The address most answering sentinels give for the master, checked to be a master.
    async fn find(&mut self) -> Result<String, RedisError> {
        let addr = self.agreed().await?;
        self.check_role(&addr).await?;
        Ok(addr)
    }

    /// The address most answering sentinels give (no role check).
    async fn agreed(&mut self) -> Result<String, RedisError> {
        let limit = self.timeouts.get_connect().saturating_add(self.timeouts.get_response());
        let config = self.config();
        let asks = self.target.sentinels.iter().zip(self.sentinels.iter_mut()).map(|(addr, slot)| {
            let (url, config, master) = (self.target.sentinel_url(addr), config.clone(), self.target.master.clone());
            async move {
                let answer = bounded_op("SENTINEL GET-MASTER-ADDR-BY-NAME", limit, async {
                    if slot.is_none() {
                        let client = Client::open(url).map_err(RedisError::command("connect"))?;
                        let conn = client
                            .get_multiplexed_async_connection_with_config(&config)
                            .await
                            .map_err(RedisError::command("connect"))?;
                        *slot = Some(conn);
                    }
                    let Some(conn) = slot.as_mut() else { return Err(RedisError::reply("connect", "no connection")) };
                    let found: Option<(String, u16)> = ::redis::cmd("SENTINEL")
                        .arg("GET-MASTER-ADDR-BY-NAME")
                        .arg(&master)
                        .query_async(conn)
                        .await
                        .map_err(RedisError::command("SENTINEL GET-MASTER-ADDR-BY-NAME"))?;
                    Ok(found)
                })
                .await;
                if answer.is_err() {
                    *slot = None;
                }
                (addr.clone(), answer)
            }
        });
        let answers = futures::future::join_all(asks).await;
        let mut votes: HashMap<String, usize> = HashMap::new();
        let mut last_error = None;
        for (sentinel, answer) in answers {
            match answer {
                Ok(Some((host, port))) => *votes.entry(host_port(&host, port)).or_default() += 1,
                Ok(None) => {
                    last_error = Some(RedisError::Reply {
                        command: "SENTINEL GET-MASTER-ADDR-BY-NAME",
                        detail: format!("sentinel {sentinel} does not monitor a master named {:?}", self.target.master),
                    })
                }
                Err(e) => last_error = Some(e),
            }
        }
        let best = votes.into_iter().max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.cmp(&a.0)));
        match (best, last_error) {
            (Some((addr, _)), _) => Ok(addr),
            (None, Some(e)) => Err(e),
            (None, None) => Err(RedisError::Config("a Sentinel URL needs at least one sentinel".into())),
        }
    }

    /// Fails unless the server at `addr` says it is a master.
    async fn check_role(&self, addr: &str) -> Result<(), RedisError> {
        let limit = self.timeouts.get_connect().saturating_add(self.timeouts.get_response());
        let client = Client::open(self.target.master_url(addr)).map_err(RedisError::command("connect"))?;
        let mut conn =
            bounded("connect", limit, client.get_multiplexed_async_connection_with_config(&self.config())).await?;
        let role: Vec<Value> = bounded("ROLE", limit, ::redis::cmd("ROLE").query_async(&mut conn)).await?;
        match role.first() {
            Some(Value::BulkString(r)) if r.as_slice() == b"master" => Ok(()),
            other => {
                Err(RedisError::reply("ROLE", format!("the sentinels name {addr} as master, but it says {other:?}")))
            }
        }
    }
}

fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') { format!("[{host}]:{port}") } else { format!("{host}:{port}") }
}

/// The shortest time between two questions to the sentinels, however often calls fail.
const MIN_ASK_GAP: Duration = Duration::from_millis(100);

/// The task that follows the master until every connection is gone.
async fn follow(mut asker: Asker, tx: watch::Sender<Master>, poke: Arc<Notify>, poll: Duration) {
    let mut warned = false;
    loop {
        tokio::select! {
            () = tx.closed() => return,
            () = tokio::time::sleep(MIN_ASK_GAP) => {}
        }
        tokio::select! {
            () = tx.closed() => return,
            () = poke.notified() => {}
            () = tokio::time::sleep(poll) => {}
        }
        let current = tx.borrow().addr.clone();
        let found = match asker.agreed().await {
            Ok(addr) if addr == current => Ok(None),
            Ok(addr) => asker.check_role(&addr).await.map(|()| Some(addr)),
            Err(e) => Err(e),
        };
        match found {
            Ok(Some(addr)) => {
                tracing::warn!(from = %current, to = %addr, master = %asker.target.master, "Sentinel failover: following the new master");
                tx.send_modify(|m| {
                    m.generation += 1;
                    m.addr = addr;
                });
                warned = false;
            }
            Ok(None) => warned = false,
            Err(e) if !warned => {
                tracing::warn!(error = %e, master = %asker.target.master, "cannot ask the sentinels where the master is; asking again");
                warned = true;
            }
            Err(_) => {}
        }
    }
}
