//! The topology's own tests: replication and promotion, a synchronous commit held by a cut link,
//! the relay's controls, PgBouncer in transaction mode.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::{PgBouncer, PgPair, PgServer, Relay, Replication};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_topology_async_pair_replicates_and_promotes() {
    let t0 = Instant::now();
    let pair = PgPair::start(Replication::Async).await;
    eprintln!("async pair up in {:?}", t0.elapsed());
    let (primary, standby) = (&pair.primary, &pair.standby);
    primary.psql("postgres", "CREATE TABLE jobs (id int PRIMARY KEY); INSERT INTO jobs VALUES (1)").await;
    pair.wait_caught_up().await;
    assert_eq!(standby.psql("postgres", "SELECT id FROM jobs ORDER BY id").await, "1");
    assert!(standby.is_in_recovery().await);
    let write = standby.try_psql("postgres", "INSERT INTO jobs VALUES (9)").await;
    assert!(write.as_ref().is_err_and(|e| e.contains("read-only")), "a write on the standby: {write:?}");
    assert_eq!(primary.timeline().await, 1);
    assert_eq!(standby.timeline().await, 1);

    pair.link.partition();
    primary.psql("postgres", "INSERT INTO jobs VALUES (2)").await;
    assert_eq!(primary.psql("postgres", "SELECT id FROM jobs ORDER BY id").await, "1\n2");
    primary.kill().await;
    let t1 = Instant::now();
    standby.promote().await;
    eprintln!("promoted in {:?}", t1.elapsed());
    assert!(!standby.is_in_recovery().await);
    assert_eq!(standby.psql("postgres", "SELECT id FROM jobs ORDER BY id").await, "1", "row 2 never left the primary");
    assert_eq!(standby.timeline().await, 2);
    standby.psql("postgres", "INSERT INTO jobs VALUES (3)").await;
    assert_eq!(standby.psql("postgres", "SELECT id FROM jobs ORDER BY id").await, "1\n3");
    eprintln!("pg_topology_async_pair_replicates_and_promotes: {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_topology_sync_pair_blocks_commits_while_cut() {
    let t0 = Instant::now();
    let pair = PgPair::start(Replication::Sync).await;
    eprintln!("sync pair up in {:?}", t0.elapsed());
    let primary = &pair.primary;
    primary.psql("postgres", "CREATE TABLE jobs (id int)").await;

    pair.link.partition();
    let insert = primary.psql("postgres", "INSERT INTO jobs VALUES (1)");
    tokio::pin!(insert);
    let held = tokio::time::timeout(Duration::from_secs(2), &mut insert).await;
    assert!(held.is_err(), "the commit returned while replication was cut: {held:?}");
    let waiting = "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'";
    assert_eq!(primary.psql("postgres", waiting).await, "1", "the INSERT waits for the standby");

    let t1 = Instant::now();
    pair.link.heal();
    tokio::time::timeout(Duration::from_secs(30), insert).await.expect("the commit completes once the link heals");
    eprintln!("commit released {:?} after heal", t1.elapsed());
    pair.wait_streaming().await;
    assert_eq!(pair.standby.psql("postgres", "SELECT count(*) FROM jobs").await, "1");
    eprintln!("pg_topology_sync_pair_blocks_commits_while_cut: {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_topology_relay_repoints_and_cuts() {
    let t0 = Instant::now();
    let a = tagged_echo("A").await;
    let b = tagged_echo("B").await;
    let relay = Relay::start(a).await;

    let mut old = TcpStream::connect(relay.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut old, "x").await, "A:x");
    relay.point_to(b);
    assert_eq!(relay.target(), b);
    let mut new = TcpStream::connect(relay.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut new, "y").await, "B:y", "a new connection goes to B");
    assert_eq!(roundtrip(&mut old, "z").await, "A:z", "the old one still reaches A");

    relay.drop_connections();
    assert_closed(&mut old, "old connection after drop_connections").await;
    assert_closed(&mut new, "new connection after drop_connections").await;

    relay.refuse();
    let mut refused = TcpStream::connect(relay.addr()).await.unwrap();
    assert_closed(&mut refused, "a connection while refusing").await;
    relay.heal();
    let mut healed = TcpStream::connect(relay.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut healed, "w").await, "B:w");

    relay.partition();
    healed.write_all(b"p").await.unwrap();
    assert_silent(&mut healed, "an established connection while partitioned").await;
    let mut hung = TcpStream::connect(relay.addr()).await.unwrap();
    hung.write_all(b"q").await.unwrap();
    assert_silent(&mut hung, "a new connection while partitioned").await;
    relay.heal();
    assert_closed(&mut healed, "a frozen connection after heal").await;
    assert_closed(&mut hung, "a hung connection after heal").await;
    let mut after = TcpStream::connect(relay.addr()).await.unwrap();
    assert_eq!(roundtrip(&mut after, "v").await, "B:v");
    eprintln!("pg_topology_relay_repoints_and_cuts: {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_topology_pgbouncer_transaction_mode() {
    let t0 = Instant::now();
    let server = PgServer::new_primary().await;
    eprintln!("server up in {:?}", t0.elapsed());
    let bouncer = PgBouncer::start(server.addr(), "transaction", "extra_float_digits", &["postgres"]).await;
    eprintln!("PgBouncer up in {:?}", t0.elapsed());
    assert_eq!(bouncer.psql("postgres", "postgres", "SELECT 1").await, "1");
    // sqlx sends extra_float_digits at startup: PgBouncer must let it pass.
    let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&bouncer.url("postgres", "postgres"))
        .await
        .unwrap_or_else(|e| panic!("sqlx through PgBouncer: {e}\n{}", bouncer.log()));
    sqlx::raw_sql("SELECT 1").execute(&mut conn).await.expect("a simple query through PgBouncer");
    sqlx::Connection::close(conn).await.expect("close");
    let pools = bouncer.admin("SHOW POOLS").await;
    assert!(pools.lines().any(|l| l.starts_with("postgres|postgres|")), "SHOW POOLS: {pools}");
    assert!(pools.contains("transaction"), "SHOW POOLS shows the pool mode: {pools}");
    eprintln!("pg_topology_pgbouncer_transaction_mode: {:?}", t0.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_topology_drop_leaves_no_process_and_no_dir() {
    let pair = PgPair::start(Replication::SyncRemoteApply).await;
    let bouncer = PgBouncer::start(pair.link.addr(), "session", "", &["postgres"]).await;
    assert_eq!(bouncer.psql("postgres", "postgres", "SELECT 2").await, "2");
    let root = pair.primary.data_dir().parent().and_then(|d| d.parent()).expect("the topology's dir").to_owned();
    let bouncer_root = bouncer.log_path().parent().and_then(|d| d.parent()).expect("PgBouncer's dir").to_owned();
    assert!(!processes_under(&root).is_empty() && !processes_under(&bouncer_root).is_empty());
    drop(bouncer);
    drop(pair);
    for dir in [&root, &bouncer_root] {
        assert!(processes_under(dir).is_empty(), "left running: {:?}", processes_under(dir));
        assert!(!dir.exists(), "{} left behind", dir.display());
    }
}

/// The processes whose command line names a path under `dir`.
fn processes_under(dir: &std::path::Path) -> Vec<String> {
    let marker = dir.display().to_string();
    let procs = std::fs::read_dir("/proc").unwrap().flatten();
    procs
        .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
        .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
        .filter(|c| c.contains(&marker))
        .collect()
}

/// A TCP server that answers every chunk it reads with `<tag>:<chunk>`.
async fn tagged_echo(tag: &'static str) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 1024];
                while let Ok(n @ 1..) = stream.read(&mut buf).await {
                    let reply = [format!("{tag}:").as_bytes(), &buf[..n]].concat();
                    if stream.write_all(&reply).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

/// Sends `msg` and reads the answer (at most 5 s).
async fn roundtrip(stream: &mut TcpStream, msg: &str) -> String {
    stream.write_all(msg.as_bytes()).await.unwrap();
    let mut buf = [0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
        .await
        .expect("an answer within 5 s")
        .expect("read the answer");
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// The peer closes `stream` within 5 s (EOF or reset).
async fn assert_closed(stream: &mut TcpStream, what: &str) {
    let mut buf = [0u8; 64];
    match tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf)).await {
        Ok(Ok(0) | Err(_)) => {}
        Ok(Ok(n)) => panic!("{what}: got {n} bytes instead of a close"),
        Err(_) => panic!("{what}: still open after 5 s"),
    }
}

/// Nothing arrives on `stream` for 500 ms (and it stays open).
async fn assert_silent(stream: &mut TcpStream, what: &str) {
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(Duration::from_millis(500), stream.read(&mut buf)).await;
    assert!(read.is_err(), "{what}: expected silence, got {read:?}");
}
