//! Throughput in paired rounds (`--topology single|cluster`): each round runs the plain consumers,
//! then the fenced ones, on fresh streams of the same size; the figure is the median of the
//! rounds' fenced/plain ratios, so that drift on the machine falls on both sides.
//!
//! On a cluster (a private one: 3 primaries, no replicas, `brokerfence_testkit::redis_topology`)
//! there is one stream per primary: its name carries a hash tag chosen so that the streams land
//! on different primaries (`{bench-<run>-<i>}:r<round>:<side>`), and each stream has its own
//! consumer with its own connections (`redis+cluster://` seed URL), as separate workers would.

use std::sync::Arc;
use std::time::Duration;

use brokerfence::redis::client;
use brokerfence::redis::{RedisConnections, key_slot};
use brokerfence::{FenceStore, PgFence};
use brokerfence_testkit::redis_topology::RedisCluster;
use futures::future::try_join_all;

use super::bench::{Args, Topology, fenced, plain, produce};
use crate::counters::{Counting, loadavg, median};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Where the streams go: a URL, and one hash-tag name per stream.
struct Place {
    url: String,
    /// The stream names' stems: one per stream (per primary on a cluster).
    stems: Vec<String>,
    /// Which server each stream is on, in words.
    on: Vec<String>,
    cluster: Option<RedisCluster>,
}

impl Place {
    /// The stream of stem `i` in `round` for `side` (`plain` or `fenced`).
    fn stream(&self, i: usize, round: usize, side: &str) -> String {
        if self.cluster.is_some() {
            format!("{{{}}}:r{round}:{side}", self.stems[i])
        } else {
            format!("{}-r{round}-{side}", self.stems[i])
        }
    }
}

/// A private cluster of 3 primaries, and one stem per primary whose slot it serves.
async fn cluster_place(tag: &str) -> Result<Place, BoxError> {
    let what = "start a Redis Cluster of 3 primaries (needs redis-server and redis-cli: `bash localstack/up`)";
    let cluster = crate::chaos::failover::caught(what, RedisCluster::start(3, 0)).await?;
    let ranges = cluster.slots().await;
    let mut primaries: Vec<u16> = ranges.iter().map(|r| r.primary).collect();
    primaries.sort_unstable();
    primaries.dedup();
    let (mut stems, mut on) = (Vec::new(), Vec::new());
    for port in primaries {
        let stem = (0..10_000)
            .map(|i| format!("bench-{tag}-{i}"))
            .find(|stem| {
                let slot = key_slot(stem.as_bytes());
                ranges.iter().any(|r| r.primary == port && (r.start..=r.end).contains(&slot))
            })
            .ok_or_else(|| format!("no hash tag found for the primary on port {port}"))?;
        on.push(format!("slot {} on port {port}", key_slot(stem.as_bytes())));
        stems.push(stem);
    }
    Ok(Place { url: cluster.seed_url(), stems, on, cluster: Some(cluster) })
}

pub(super) async fn run(a: &Args, pg: &PgFence, tag: &str) -> Result<(), BoxError> {
    let place = match a.topology {
        Topology::Cluster => cluster_place(tag).await?,
        _ => Place { url: a.redis_url.clone()?, stems: vec![format!("bench-{tag}")], on: Vec::new(), cluster: None },
    };
    let result = rounds(a, pg, &place).await;
    let mut conn = RedisConnections::connect(&place.url).await?.commands();
    for round in 0..a.rounds {
        for i in 0..place.stems.len() {
            for side in ["plain", "fenced"] {
                let _: Result<i64, _> =
                    client::cmd("DEL").arg(place.stream(i, round, side)).query_async(&mut conn).await;
            }
        }
    }
    if let Some(cluster) = place.cluster {
        // The nodes' drops wait until each is gone: off the runtime's worker threads.
        tokio::task::spawn_blocking(move || drop(cluster)).await?;
    }
    result
}

async fn rounds(a: &Args, pg: &PgFence, place: &Place) -> Result<(), BoxError> {
    let k = place.stems.len();
    let share = |i: usize| a.messages / k + usize::from(i < a.messages % k);
    println!(
        "bench_redis ({}): {} messages per run over {k} stream(s), a consumer each (concurrency {}, reads of {}, \
         fenced prefetch {}), work {} ms, lease {} s, {} paired round(s); load average {}",
        if place.cluster.is_some() { "Redis Cluster, 3 primaries" } else { "one server" },
        a.messages,
        a.concurrency,
        a.batch,
        a.prefetch.map_or("none".to_owned(), |n| n.to_string()),
        a.work.as_millis(),
        a.lease,
        a.rounds,
        loadavg()
    );
    for (i, on) in place.on.iter().enumerate() {
        println!("  stream {}: {on}", place.stream(i, 0, "…"));
    }
    let store = Counting::new(Arc::new(pg.clone()));
    let mut conn = RedisConnections::connect(&place.url).await?.commands();
    let (mut plains, mut fenceds, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..a.rounds {
        // One set of connections per consumer, made before the clock starts.
        let mut conns = Vec::with_capacity(k);
        for i in 0..k {
            produce(&mut conn, &place.stream(i, round, "plain"), share(i)).await?;
            conns.push(RedisConnections::connect(&place.url).await?);
        }
        let runs = (0..k).map(|i| {
            let (conns, stream) = (&conns[i], place.stream(i, round, "plain"));
            async move { plain(conns, &stream, share(i), a).await }
        });
        let t_plain = try_join_all(runs).await?.into_iter().max().unwrap_or_default();

        let mut conns = Vec::with_capacity(k);
        for i in 0..k {
            produce(&mut conn, &place.stream(i, round, "fenced"), share(i)).await?;
            conns.push(RedisConnections::connect(&place.url).await?);
        }
        let runs = (0..k).map(|i| {
            let (conns, stream) = (&conns[i], place.stream(i, round, "fenced"));
            let queue = format!("{}-r{round}", place.stems[i]);
            let store: Arc<dyn FenceStore> = Arc::clone(&store) as Arc<dyn FenceStore>;
            async move { fenced(conns, store, (&queue, &stream), share(i), a).await }
        });
        let t_fenced = try_join_all(runs).await?.into_iter().max().unwrap_or_default();

        let rate = |t: Duration| a.messages as f64 / t.as_secs_f64().max(1e-9);
        let (p, f) = (rate(t_plain), rate(t_fenced));
        println!(
            "  round {}: plain {p:>7.0} msg/s ({:.2} s), fenced {f:>7.0} msg/s ({:.2} s), fenced/plain {:.3}",
            round + 1,
            t_plain.as_secs_f64(),
            t_fenced.as_secs_f64(),
            f / p
        );
        plains.push(p);
        fenceds.push(f);
        ratios.push(f / p);
    }
    let n = (a.messages * a.rounds) as f64;
    println!("  plain  XREADGROUP/XACK, median: {:>9.0} msg/s", median(plains));
    println!("  fenced (PostgreSQL), median:    {:>9.0} msg/s", median(fenceds));
    println!("  fenced/plain, median of rounds: {:>9.3} (rounds: {})", median(ratios.clone()), fmt(&ratios));
    let claims = store.get("claim") + store.get("claim_batch") + store.get("claim_next");
    let completes = store.get("complete") + store.get("complete_batch");
    println!(
        "  DB statements/message:          {:>9.3} (claim batches {claims}, completes {completes}, heartbeats {}, other {})",
        store.total() as f64 / n,
        store.get("heartbeat"),
        ["enqueue", "checkpoint", "fail", "release"].iter().map(|m| store.get(m)).sum::<u64>()
    );
    println!(
        "  DB round trip:                  claim batch {:.2} ms avg ({:.1} jobs), group commit {:.2} ms avg ({:.1} jobs)",
        store.mean_ms("claim_batch"),
        n / claims.max(1) as f64,
        store.mean_ms("complete_batch"),
        n / completes.max(1) as f64,
    );
    println!("  load average at the end: {}", loadavg());
    Ok(())
}

fn fmt(v: &[f64]) -> String {
    v.iter().map(|r| format!("{r:.3}")).collect::<Vec<_>>().join(", ")
}
