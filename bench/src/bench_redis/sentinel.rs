//! `--topology sentinel`: the time from a Sentinel failover to the first commit through the new
//! master, per round on a fresh private master, replica and three sentinels
//! (`brokerfence_testkit::redis_topology::RedisSentinels`: `down-after-milliseconds 1000`,
//! `failover-timeout 5000`, quorum 2).
//!
//! A fenced stream consumer reads the `redis+sentinel://` URL (the default `RedisTimeouts`: the
//! sentinels are asked where the master is every second, and at once after a failed call). A
//! producer on the same URL adds `--rate` entries a second, each by a script that answers the
//! entry's id and the port of the server that added it (`INFO server`). After 2–3 s of flow the
//! round forces a failover (`SENTINEL FAILOVER`) and measures, from that moment: when every
//! sentinel names the new master (which answers `ROLE` with `master`), when the producer first
//! added an entry on the new master, and when the first job of such an entry was committed (its
//! row's `updated_at`, the database clock on this host).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use brokerfence::Consumer;
use brokerfence::redis::client::Script;
use brokerfence::redis::{KeyFrom, RedisConnections, StreamSource};
use brokerfence::{FenceStore, JobContext, Owner, PgFence, QueueName};
use brokerfence_testkit::redis_topology::RedisSentinels;
use sqlx::AssertSqlSafe;
use tokio_util::sync::CancellationToken;

use super::bench::{Args, consumer_config};
use crate::chaos::failover::caught;
use crate::counters::{loadavg, median};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// How long jobs flow before the failover, at least (plus up to a second at random: the
/// connections ask the sentinels every second from their start, and a fixed wait would start
/// every failover at the same point of that cycle).
const WARM_UP: Duration = Duration::from_secs(2);

/// How long a round waits for the first commit through the new master.
const COMMIT_LIMIT: Duration = Duration::from_secs(30);

/// XADD, and the port of the server that ran it.
const ADD: &str = "local id = redis.call('XADD', KEYS[1], '*', 'key', ARGV[1], 'body', 'x') \
                   return {id, string.match(redis.call('INFO', 'server'), 'tcp_port:(%d+)')}";

/// One entry the producer added: its job key, the port of the server, when (ms since the epoch).
type Added = (String, u16, u64);

/// One round's figures, from the start of the failover.
struct Round {
    agreed: Duration,
    first_add: Duration,
    first_commit: Duration,
    old_after: usize,
}

pub(super) async fn run(a: &Args, pg: &PgFence, tag: &str) -> Result<(), BoxError> {
    println!(
        "bench_redis (Sentinel failover): {} rounds; {} entries/s added through the sentinel URL, one fenced consumer \
         (concurrency {}, reads of {}, work {} ms, lease {} s, sentinels asked every 1 s); load average {}",
        a.rounds,
        a.rate,
        a.concurrency,
        a.batch,
        a.work.as_millis(),
        a.lease,
        loadavg()
    );
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let (mut agreed, mut added, mut committed) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..a.rounds {
        let r = one(a, pg, tag, round).await?;
        println!(
            "  round {}: sentinels agree on the new master after {:.0} ms; first entry added to it {:.0} ms; first \
             commit of such a job {:.0} ms ({} entries went to the old master after the failover began)",
            round + 1,
            ms(r.agreed),
            ms(r.first_add),
            ms(r.first_commit),
            r.old_after
        );
        agreed.push(ms(r.agreed));
        added.push(ms(r.first_add));
        committed.push(ms(r.first_commit));
    }
    let line = |what: &str, v: &[f64]| {
        let all = v.iter().map(|x| format!("{x:.0}")).collect::<Vec<_>>().join(", ");
        println!("  failover → {what:<44} median {:>5.0} ms ({all})", median(v.to_vec()));
    };
    line("first commit through the new master:", &committed);
    line("first entry added to the new master:", &added);
    line("sentinels agree on it:", &agreed);
    println!("  load average at the end: {}", loadavg());
    Ok(())
}

fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

async fn one(a: &Args, pg: &PgFence, tag: &str, round: usize) -> Result<Round, BoxError> {
    let what = "start a master, a replica and 3 sentinels (needs redis-server: `bash localstack/up`)";
    let topology = Arc::new(caught(what, RedisSentinels::start()).await?);
    let url = topology.url();
    let stream = format!("bench-fo-{tag}-r{round}");
    let stop = CancellationToken::new();

    let source = StreamSource::new(RedisConnections::connect(&url).await?, QueueName::new(&stream)?, &stream, "g")?
        .key_from(KeyFrom::Field("key".into()))
        .block(Duration::from_millis(100));
    let config = consumer_config(a)?;
    let store: Arc<dyn FenceStore> = Arc::new(pg.clone());
    let consumer = Consumer::with_owner(source, store, Owner::new("bench")?, config);
    let work = a.work;
    let handler = move |_ctx: JobContext| async move {
        if !work.is_zero() {
            tokio::time::sleep(work).await;
        }
        Ok(Vec::new())
    };
    let token = stop.clone();
    let consuming = tokio::spawn(async move { consumer.run(handler, token).await });

    let added: Arc<Mutex<Vec<Added>>> = Arc::default();
    let mut conn = RedisConnections::connect(&url).await?.commands();
    let producing = tokio::spawn({
        let (added, stop, stream) = (Arc::clone(&added), stop.clone(), stream.clone());
        let every = Duration::from_secs(1) / u32::try_from(a.rate).unwrap_or(u32::MAX);
        async move {
            let script = Script::new(ADD);
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            for seq in 0u64.. {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let key = format!("fo-{seq}");
                let answer: Result<(String, u16), _> = script.key(&stream).arg(&key).invoke_async(&mut conn).await;
                if let Ok((_, port)) = answer {
                    added.lock().unwrap_or_else(|p| p.into_inner()).push((key, port, wall_ms()));
                }
            }
        }
    });

    tokio::time::sleep(WARM_UP + Duration::from_millis(rand::random_range(0..1000))).await;
    let t0 = (Instant::now(), wall_ms());
    let failing_over = Arc::clone(&topology);
    let agreed = caught("SENTINEL FAILOVER", async move { failing_over.failover().await }).await?;
    let reporting = Arc::clone(&topology);
    let new_port = caught("the new master", async move { reporting.current_master_port().await }).await?;
    let s = pg.get_schema().as_str();
    let first_commit_sql = format!(
        "SELECT floor(extract(epoch FROM min(updated_at)) * 1000)::bigint FROM {s}.jobs \
         WHERE queue = $1 AND state = 'completed' AND key = ANY($2)"
    );
    let first_commit = loop {
        let keys: Vec<String> = added
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, port, _)| *port == new_port)
            .map(|(k, ..)| k.clone())
            .collect();
        if !keys.is_empty() {
            let at: Option<i64> = sqlx::query_scalar(AssertSqlSafe(first_commit_sql.clone()))
                .bind(&stream)
                .bind(&keys)
                .fetch_one(pg.pool())
                .await?;
            if let Some(at) = at.and_then(|v| u64::try_from(v).ok()) {
                break Duration::from_millis(at.saturating_sub(t0.1));
            }
        }
        if t0.0.elapsed() > COMMIT_LIMIT {
            stop.cancel();
            return Err(format!("no job added to the new master was committed within {COMMIT_LIMIT:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    stop.cancel();
    producing.await?;
    consuming.await??;
    let added = added.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let first_add = added.iter().filter(|(_, port, _)| *port == new_port).map(|(.., at)| *at).min().unwrap_or(t0.1);
    let old_after = added.iter().filter(|(_, port, at)| *port != new_port && *at >= t0.1).count();
    // The servers' drops wait until each is gone: off the runtime's worker threads.
    tokio::task::spawn_blocking(move || drop(topology)).await?;
    Ok(Round { agreed, first_add: Duration::from_millis(first_add.saturating_sub(t0.1)), first_commit, old_after })
}
