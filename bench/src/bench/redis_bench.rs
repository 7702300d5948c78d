//! Redis Streams: fenced against a plain XREADGROUP/XACK consumer.

use super::*;
use brokerfence::Retrofit;
use brokerfence::redis::client as redis;
use brokerfence::redis::{RedisConnections, StreamSource};
use redis::aio::MultiplexedConnection;
use redis::streams::StreamReadReply;

struct PlainStream {
    read: tokio::sync::Mutex<MultiplexedConnection>,
    write: MultiplexedConnection,
    stream: String,
}

impl PlainBroker for PlainStream {
    type Handle = String;
    async fn receive(&self, max: usize) -> Result<Vec<String>, String> {
        let mut conn = self.read.lock().await;
        let reply: Option<StreamReadReply> = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg("plain")
            .arg("c1")
            .arg("COUNT")
            .arg(max)
            .arg("BLOCK")
            .arg(100)
            .arg("STREAMS")
            .arg(&self.stream)
            .arg(">")
            .query_async(&mut *conn)
            .await
            .map_err(|e| e.to_string())?;
        Ok(reply
            .map(|r| r.keys.into_iter().flat_map(|k| k.ids.into_iter().map(|i| i.id)).collect())
            .unwrap_or_default())
    }
    async fn ack(&self, ids: Vec<String>) -> Result<usize, String> {
        let mut conn = self.write.clone();
        let n: usize = redis::cmd("XACK")
            .arg(&self.stream)
            .arg("plain")
            .arg(&ids)
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        Ok(n)
    }
}

async fn stream(conn: &mut MultiplexedConnection, n: usize) -> Result<String, String> {
    let stream = format!("bench-{:08x}", rand::random::<u32>());
    for start in (0..n).step_by(1000) {
        let mut pipe = redis::pipe();
        for i in start..(start + 1000).min(n) {
            pipe.cmd("XADD").arg(&stream).arg("*").arg("body").arg(format!("job {i}")).ignore();
        }
        pipe.query_async::<()>(conn).await.map_err(|e| e.to_string())?;
    }
    Ok(stream)
}

pub async fn run(o: &Opts, pg: &table::Pg) -> Result<(), String> {
    println!("\n[redis streams] (reads of up to {0}, concurrency {0})", o.broker_concurrency);
    let Some(url) = o.redis_url.clone() else {
        println!("  skipped: REDIS_URL is not set; run `bash localstack/up`");
        return Ok(());
    };
    let client = redis::Client::open(url.as_str()).map_err(|e| e.to_string())?;
    let mut conn = match tokio::time::timeout(Duration::from_secs(5), client.get_multiplexed_async_connection()).await {
        Ok(Ok(c)) => c,
        _ => {
            println!(
                "  skipped: Redis does not answer at {}; run `bash localstack/up`",
                url.split('@').next_back().unwrap_or("")
            );
            return Ok(());
        }
    };
    let n = if o.quick { 3000 } else { 20_000 };
    let counting = Counting::new(Arc::new(pg.fence.clone()));
    let mut streams = Vec::new();

    // Streams read any number at once: both sides take up to the concurrency per read.
    let batch = o.broker_concurrency;
    let conns = RedisConnections::connect(&url).await.map_err(|e| e.to_string())?;
    let (mut plain, mut fenced, mut per_msg, mut breakdown) = (None::<Rate>, None::<Rate>, 0.0, String::new());
    for _ in 0..o.rounds {
        let s = stream(&mut conn, n).await?;
        streams.push(s.clone());
        let _: () = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&s)
            .arg("plain")
            .arg("0")
            .query_async(&mut conn)
            .await
            .map_err(|e| e.to_string())?;
        let plain_broker = Arc::new(PlainStream {
            read: tokio::sync::Mutex::new(client.get_multiplexed_async_connection().await.map_err(|e| e.to_string())?),
            write: conn.clone(),
            stream: s,
        });
        let p = PlainLoop { concurrency: o.broker_concurrency, batch, work: o.work }.run(plain_broker, n).await?;
        plain = Some(plain.filter(|b| b.per_sec() >= p.per_sec()).unwrap_or(p));
        let s = stream(&mut conn, n).await?;
        streams.push(s.clone());
        let source =
            StreamSource::new(conns.clone(), QueueName::new(s.clone()).map_err(|e| e.to_string())?, s, "bench")
                .map_err(|e| e.to_string())?
                .block(Duration::from_millis(100));
        let (f, per, br) = fenced_run(o, source, batch, &counting, n).await?;
        if fenced.is_none_or(|b| f.per_sec() > b.per_sec()) {
            (fenced, per_msg, breakdown) = (Some(f), per, br);
        }
    }
    let (Some(plain), Some(fenced)) = (plain, fenced) else { return Err("no rounds".into()) };

    // Sequential latency: XREADGROUP one, handle, XACK; fenced adds claim + supervised run + commit.
    let m = if o.quick { 100 } else { 1000 };
    let s = stream(&mut conn, 2 * m).await?;
    streams.push(s.clone());
    let _: () = redis::cmd("XGROUP")
        .arg("CREATE")
        .arg(&s)
        .arg("plain")
        .arg("0")
        .query_async(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    let seq = PlainStream {
        read: tokio::sync::Mutex::new(client.get_multiplexed_async_connection().await.map_err(|e| e.to_string())?),
        write: conn.clone(),
        stream: s.clone(),
    };
    let mut p = plain_latencies(&seq, m).await?;
    let store: Arc<dyn FenceStore> = Arc::new(pg.fence.clone());
    let lease = LeaseDuration::from_secs(30).map_err(|e| e.to_string())?;
    let fence =
        Retrofit::new(store, QueueName::new(s.clone()).map_err(|e| e.to_string())?, SupervisorConfig::new(lease));
    let mut f = Vec::new();
    while f.len() < m {
        let t = Instant::now();
        let ids = seq.receive(1).await?;
        let Some(id) = ids.first() else { continue };
        let key = JobKey::new(id.clone()).map_err(|e| e.to_string())?;
        let done = fence.process(&key, Vec::new(), |_ctx: JobContext| async { Ok(b"ok".to_vec()) }).await;
        if !done.should_ack() {
            return Err(format!("retrofit: {done:?}"));
        }
        seq.ack(ids).await?;
        f.push(t.elapsed());
    }
    p.sort();
    f.sort();
    print_broker_figures(plain, fenced, per_msg, &breakdown, (&f, &p));

    let samples = if o.quick { 5 } else { 12 };
    let s = stream(&mut conn, samples).await?;
    streams.push(s.clone());
    let source = StreamSource::new(conns, QueueName::new(s.clone()).map_err(|e| e.to_string())?, s, "cancel")
        .map_err(|e| e.to_string())?
        .block(Duration::from_millis(100));
    print_cancellation(&consumer_cancellation(source, &pg.fence, samples).await?);
    for s in streams {
        let dead = brokerfence::redis::sibling_key(&s, ":dead");
        let _: Result<(), _> = redis::cmd("DEL").arg(&s).arg(&dead).query_async(&mut conn).await;
    }
    Ok(())
}
