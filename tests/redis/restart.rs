//! Redis restarted mid-run, on a private `redis-server` of this test (restarting the shared one
//! would disturb everyone else). It runs without persistence, so the restart loses everything: the
//! stream, the group, the pending entries and every lease key. The database epoch does not care:
//! running jobs keep their leases and commit, the lease keys come back on the next confirmed
//! heartbeat, the group is created again, and the producer's re-sent entries are deduplicated by
//! the fence. Nothing is committed twice and nothing is lost.
#![cfg(feature = "redis")]

use brokerfence_testkit::redis as redis_support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use brokerfence::redis::{KeyFrom, StreamSource};
use brokerfence::{JobContext, JobError, QueueName};
use redis_support::*;
use tokio::sync::Semaphore;

const JOBS: usize = 30;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_restart_mid_run_loses_nothing_and_commits_nothing_twice() {
    let mut redis = PrivateRedis::start().await;
    let env = Env::on(&redis.url()).await;
    let stream = env.name("restart");
    let lease_pattern = format!("{{{stream}}}:lease:*");
    let mut conn = env.conn();
    for i in 0..JOBS {
        xadd_job(&mut conn, &stream, &format!("job-{i:02}"), "x").await;
    }
    let runs: Arc<Mutex<Vec<(String, i64)>>> = Arc::default();
    // Jobs 10..20 wait at a gate, so that they are certainly in flight across the restart.
    let gate = Arc::new(Semaphore::new(0));
    let handler = {
        let (runs, gate) = (Arc::clone(&runs), Arc::clone(&gate));
        move |ctx: JobContext| {
            let (runs, gate) = (Arc::clone(&runs), Arc::clone(&gate));
            async move {
                runs.lock().expect("runs").push((ctx.key().to_string(), ctx.epoch()));
                let n: usize = ctx.key().as_str().trim_start_matches("job-").parse().unwrap_or(0);
                if (10..20).contains(&n) {
                    let _pass = gate.acquire().await.map_err(JobError::retry)?;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
                Ok(format!("{}@{}", ctx.owner(), ctx.epoch()).into_bytes())
            }
        }
    };
    let source = |name: &str| {
        StreamSource::new(env.redis.clone(), QueueName::new(stream.as_str()).expect("q"), stream.as_str(), "g")
            .expect("source")
            .key_from(KeyFrom::Field("key".into()))
            .block(Duration::from_millis(200))
            .autoclaim_every(Duration::from_millis(200))
            .dead_letter_stream(format!("{{{stream}}}:dead-{name}"))
    };
    let a = spawn_consumer(source("a"), env.store(), "worker-a", consumer_config(3, 5), handler.clone());
    let b = spawn_consumer(source("b"), env.store(), "worker-b", consumer_config(3, 5), handler);

    // Mid-run: ten jobs committed, ten in flight with their lease keys set by a heartbeat.
    wait_for("a first round committed and lease keys set", Duration::from_secs(15), || {
        let done = a.snapshot().completions + b.snapshot().completions;
        let (env, pattern) = (&env, lease_pattern.clone());
        async move { (done == 10 && env.keys(&pattern).await.len() == 10).then_some(()) }
    })
    .await;
    redis.restart().await;
    assert!(env.keys(&lease_pattern).await.is_empty(), "the restart took every lease key");
    // The running jobs' next confirmed heartbeat brings their keys back.
    wait_for("lease keys restored from the database lease", Duration::from_secs(5), || {
        let (env, pattern) = (&env, lease_pattern.clone());
        async move { (env.keys(&pattern).await.len() == 10).then_some(()) }
    })
    .await;
    // An at-least-once producer sends again everything Redis lost.
    for i in 0..JOBS {
        xadd_job(&mut conn, &stream, &format!("job-{i:02}"), "x").await;
    }
    gate.add_permits(JOBS);
    wait_for("every job completed and every entry acknowledged", Duration::from_secs(40), || {
        let (env, stream) = (&env, stream.clone());
        async move {
            let jobs = env.jobs(&stream).await;
            let done = jobs.len() == JOBS && jobs.iter().all(|(_, s, _, _)| s == "completed");
            let mut c = env.conn();
            (done && pending_count(&mut c, &stream, "g").await == 0).then_some(())
        }
    })
    .await;
    let (sa, sb) = (a.shutdown(Duration::from_secs(10)).await, b.shutdown(Duration::from_secs(10)).await);

    assert_eq!(sa.completions + sb.completions, JOBS as u64, "each job committed exactly once: {sa} / {sb}");
    assert_eq!(sa.fenced_rejections + sb.fenced_rejections, 0, "{sa} / {sb}");
    let jobs = env.jobs(&stream).await;
    assert_eq!(jobs.len(), JOBS, "nothing lost");
    let runs = runs.lock().expect("runs").clone();
    let mut per_key: HashMap<&str, Vec<i64>> = HashMap::new();
    for (k, e) in &runs {
        per_key.entry(k.as_str()).or_default().push(*e);
    }
    for (key, state, epoch, result) in &jobs {
        assert_eq!(state, "completed");
        // The committed result names the epoch that committed it, and that attempt really ran.
        let committed = result.as_deref().and_then(|r| r.rsplit_once('@')).and_then(|(_, e)| e.parse::<i64>().ok());
        assert_eq!(committed, Some(*epoch), "{key}: {result:?}");
        assert!(
            per_key.get(key.as_str()).is_some_and(|e| e.contains(epoch)),
            "{key}: runs {:?}",
            per_key.get(key.as_str())
        );
    }
    assert!(sa.duplicates + sb.duplicates >= 10, "re-sent entries of committed jobs acked as duplicates: {sa} / {sb}");
    assert!(env.keys(&lease_pattern).await.is_empty(), "lease keys released at the end");
    env.cleanup().await;
}
