//! The sources, seen from the runner: setup, each worker's arguments, the job kinds (poison,
//! flaky, slow) and the dead letters.

use super::*;

/// What a job is made to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Ok,
    Poison,
    Flaky,
    /// Waits past the lease in its handler (cancellably): lives on heartbeats.
    Slow,
}

pub(crate) fn job_kinds(c: &ChaosConfig) -> Vec<(String, Kind)> {
    (0..c.jobs)
        .map(|i| {
            let kind = if c.poison_every > 0 && i % c.poison_every == c.poison_every / 2 {
                Kind::Poison
            } else if c.flaky_every > 0 && i % c.flaky_every == 1 {
                Kind::Flaky
            } else if c.slow_every > 0 && i % c.slow_every == c.slow_every - 1 {
                Kind::Slow
            } else {
                Kind::Ok
            };
            (format!("job-{i:06}"), kind)
        })
        .collect()
}

pub(crate) fn payload_of(kind: Kind) -> &'static [u8] {
    match kind {
        Kind::Ok => b"{\"op\":\"apply\"}",
        Kind::Flaky => b"{\"op\":\"flaky\"}",
        Kind::Slow => b"{\"op\":\"slow\"}",
        // Not valid UTF-8 and not JSON: the handler cannot decode it.
        Kind::Poison => b"\xff\xfe{poison",
    }
}

/// Broker-side state of a run (queues, a private Redis server).
pub(crate) enum Broker {
    Table,
    #[cfg(feature = "sqs")]
    Sqs(sqs_chaos::SqsBroker),
    #[cfg(feature = "redis")]
    Redis(redis_chaos::RedisBroker),
}

impl Broker {
    pub(crate) async fn setup(
        c: &ChaosConfig,
        store: &PgFence,
        queue: &QueueName,
        jobs: &[(String, Kind)],
    ) -> Result<Self, String> {
        match c.source {
            SourceKind::Table => {
                let items: Vec<(brokerfence::JobKey, Vec<u8>)> = jobs
                    .iter()
                    .map(|(k, kind)| Ok((brokerfence::JobKey::new(k.clone())?, payload_of(*kind).to_vec())))
                    .collect::<Result<_, brokerfence::FenceError>>()
                    .map_err(|e| e.to_string())?;
                for chunk in items.chunks(1000) {
                    store.enqueue_many(queue, chunk).await.map_err(|e| format!("enqueue: {e}"))?;
                }
                Ok(Broker::Table)
            }
            #[cfg(feature = "sqs")]
            SourceKind::Sqs => Ok(Broker::Sqs(sqs_chaos::SqsBroker::setup(c, queue, jobs).await?)),
            #[cfg(not(feature = "sqs"))]
            SourceKind::Sqs => Err("the sqs source needs the `sqs` feature (--features sqs)".into()),
            #[cfg(feature = "redis")]
            SourceKind::Redis => Ok(Broker::Redis(redis_chaos::RedisBroker::setup(c, queue, jobs).await?)),
            #[cfg(not(feature = "redis"))]
            SourceKind::Redis => Err("the redis source needs the `redis` feature (--features redis)".into()),
        }
    }

    /// The broker's `host:port` on this machine, for a stall proxy in front of it; `None` when
    /// there is no broker (the table queue) or it is not a plain address here.
    pub(crate) fn upstream(&self) -> Option<String> {
        match self {
            Broker::Table => None,
            #[cfg(feature = "sqs")]
            Broker::Sqs(_) => sqs_chaos::endpoint_host_port(),
            #[cfg(feature = "redis")]
            Broker::Redis(b) => b.port().map(|p| format!("127.0.0.1:{p}")),
        }
    }

    /// The Redis Cluster of the run and the stream's key, when the Redis source runs on one.
    #[cfg(feature = "redis")]
    pub(crate) fn redis_cluster(&self) -> Option<(Arc<brokerfence_testkit::redis_topology::RedisCluster>, String)> {
        match self {
            Broker::Redis(b) => b.cluster().map(|c| (Arc::clone(c), b.stream().to_owned())),
            _ => None,
        }
    }

    /// Starts the `redis-failover` of the stream's primary in a task of its own (see
    /// `redis_failover.rs`); `None` when the run has no cluster.
    pub(crate) fn start_redis_failover(
        &self,
        alone: Duration,
        log: FaultLog,
    ) -> Option<tokio::task::JoinHandle<Result<RedisFailoverFigures, String>>> {
        let _ = (alone, &log);
        #[cfg(feature = "redis")]
        if let Some((cluster, stream)) = self.redis_cluster() {
            return Some(redis_failover::fail_over(cluster, stream, alone, log));
        }
        None
    }

    fn is_redis_cluster(&self) -> bool {
        match self {
            #[cfg(feature = "redis")]
            Broker::Redis(b) => b.cluster().is_some(),
            _ => false,
        }
    }

    /// Why fault `kind` does not apply to this run (`None`: it does).
    pub(crate) fn not_applicable(&self, c: &ChaosConfig, kind: FaultKind) -> Option<String> {
        let cluster = self.is_redis_cluster();
        let why = match kind {
            FaultKind::RedisRestart if cluster => {
                "redis-restart: the cluster's nodes keep nothing on disk, so a restarted primary would come back \
                 empty (redis-failover replaces a primary instead)"
            }
            FaultKind::RedisRestart if !self.can_restart_server() => {
                "redis-restart: only the Redis source runs a private server that can be restarted"
            }
            FaultKind::BrokerStall if cluster => {
                "broker-stall: the TCP proxy cannot sit in front of a Redis Cluster (its clients connect to the \
                 addresses the nodes announce, not to one address)"
            }
            FaultKind::BrokerStall if self.upstream().is_none() => match c.source {
                SourceKind::Table => {
                    "broker-stall: the table queue has no broker (its receive is a PostgreSQL statement: pg-lock \
                     and pg-pause stall that path)"
                }
                _ => "broker-stall: the broker endpoint is not a plain address on 127.0.0.1",
            },
            FaultKind::PgFailover if c.source != SourceKind::Table => {
                "pg-failover: the table queue only (its jobs, claims and commits all live in the database that \
                 fails over; an SQS or Redis source keeps its deliveries in the broker, which the failover does \
                 not touch)"
            }
            FaultKind::RedisFailover if !cluster => {
                "redis-failover: the Redis source on a Redis Cluster only (`--source redis --redis-topology \
                 cluster`)"
            }
            _ => return None,
        };
        Some(why.to_owned())
    }

    /// The workers' arguments; with `proxy`, they reach the broker through it.
    pub(crate) fn worker_args(&self, proxy: Option<std::net::SocketAddr>) -> Vec<String> {
        let _ = proxy;
        match self {
            Broker::Table => Vec::new(),
            #[cfg(feature = "sqs")]
            Broker::Sqs(b) => b.worker_args(),
            #[cfg(feature = "redis")]
            Broker::Redis(b) => b.worker_args(proxy.map(|a| format!("redis://{a}"))),
        }
    }

    /// Environment the workers need (the AWS settings for SQS; with `proxy`, its endpoint).
    pub(crate) fn worker_env(&self, proxy: Option<std::net::SocketAddr>) -> Vec<(String, String)> {
        let _ = proxy;
        match self {
            #[cfg(feature = "sqs")]
            Broker::Sqs(_) => {
                let mut env = sqs_chaos::aws_env();
                if let Some(addr) = proxy {
                    env.retain(|(k, _)| k != "AWS_ENDPOINT_URL_SQS");
                    env.push(("AWS_ENDPOINT_URL_SQS".into(), format!("http://{addr}")));
                }
                env
            }
            _ => Vec::new(),
        }
    }

    pub(crate) fn can_restart_server(&self) -> bool {
        match self {
            #[cfg(feature = "redis")]
            Broker::Redis(b) => b.port().is_some(),
            _ => false,
        }
    }

    pub(crate) async fn restart_server(&mut self) -> Result<(), String> {
        match self {
            #[cfg(feature = "redis")]
            Broker::Redis(b) => b.restart().await,
            _ => Ok(()),
        }
    }

    /// Poison deliveries found in the broker's dead-letter place, when it has one.
    pub(crate) async fn dead_letters(&self, poison: &HashSet<String>) -> Result<Option<usize>, String> {
        if poison.is_empty() {
            return Ok(None);
        }
        match self {
            Broker::Table => {
                let _ = poison;
                Ok(None)
            }
            #[cfg(feature = "sqs")]
            Broker::Sqs(b) => b.dead_letters(poison).await.map(Some),
            #[cfg(feature = "redis")]
            Broker::Redis(b) => b.dead_letters(poison).await.map(Some),
        }
    }

    /// Deliveries the broker still holds unacknowledged (pending or not yet delivered); `None`
    /// when it cannot tell (the table queue, SQS).
    pub(crate) async fn unsettled(&self) -> Result<Option<u64>, String> {
        match self {
            #[cfg(feature = "redis")]
            Broker::Redis(b) => b.unsettled().await.map(Some),
            _ => Ok(None),
        }
    }

    pub(crate) async fn cleanup(self) {
        match self {
            Broker::Table => {}
            #[cfg(feature = "sqs")]
            Broker::Sqs(b) => b.cleanup().await,
            #[cfg(feature = "redis")]
            Broker::Redis(b) => b.cleanup().await,
        }
    }
}
