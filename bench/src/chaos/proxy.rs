//! A TCP proxy on 127.0.0.1 between the chaos workers and their broker (LocalStack or the run's
//! private redis-server) that can be switched to stall: while stalled it forwards no byte in
//! either direction (it keeps reading nothing and writing nothing, so every call in flight and
//! every new one hangs with its connection open), and when the stall ends it forwards everything
//! it held. The broker itself is never touched: LocalStack is shared with other programs, and
//! the shared Redis on 6379 is never used by the chaos run.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Bytes read from one side before they are written to the other (one buffer per direction and
/// connection: the proxy holds at most this much per direction while stalled).
const CHUNK: usize = 16 * 1024;

/// How long the proxy waits for the broker to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Counters of a [`StallProxy`].
#[derive(Debug, Default)]
pub struct ProxyStats {
    /// Connections accepted from the workers.
    pub connections: AtomicU64,
    /// Bytes forwarded (both directions).
    pub bytes: AtomicU64,
}

/// The proxy. Dropping it stops it and closes every connection through it.
pub struct StallProxy {
    addr: SocketAddr,
    stall: watch::Sender<Option<Instant>>,
    stats: Arc<ProxyStats>,
    stop: CancellationToken,
}

impl StallProxy {
    /// Listens on a free port of 127.0.0.1 and forwards every connection to `upstream`
    /// (a `host:port` on this machine).
    pub async fn start(upstream: String) -> Result<Self, String> {
        let listener = TcpListener::bind("127.0.0.1:0").await.map_err(|e| format!("proxy bind: {e}"))?;
        let addr = listener.local_addr().map_err(|e| format!("proxy address: {e}"))?;
        let (stall, stall_rx) = watch::channel(None);
        let stats = Arc::new(ProxyStats::default());
        let stop = CancellationToken::new();
        tokio::spawn(accept_loop(listener, upstream, stall_rx, Arc::clone(&stats), stop.clone()));
        Ok(Self { addr, stall, stats, stop })
    }

    /// The address the workers connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Holds every byte, both directions, on every connection (open or new) for `d` from now.
    pub fn stall_for(&self, d: Duration) {
        self.stall.send_replace(Some(Instant::now() + d));
    }

    /// Ends a stall now.
    pub fn resume(&self) {
        self.stall.send_replace(None);
    }

    /// The counters.
    pub fn stats(&self) -> &ProxyStats {
        &self.stats
    }
}

impl Drop for StallProxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: String,
    stall: watch::Receiver<Option<Instant>>,
    stats: Arc<ProxyStats>,
    stop: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            a = listener.accept() => a,
        };
        let Ok((client, _)) = accepted else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        stats.connections.fetch_add(1, Ordering::Relaxed);
        let (upstream, stall, stats, stop) = (upstream.clone(), stall.clone(), Arc::clone(&stats), stop.clone());
        tokio::spawn(async move {
            let server = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&upstream)).await {
                Ok(Ok(s)) => s,
                // The broker is down (a restart): the client sees its connection close.
                _ => return,
            };
            let _ = client.set_nodelay(true);
            let _ = server.set_nodelay(true);
            let (client_r, client_w) = client.into_split();
            let (server_r, server_w) = server.into_split();
            let up = pump(client_r, server_w, stall.clone(), Arc::clone(&stats), stop.clone());
            let down = pump(server_r, client_w, stall, stats, stop);
            tokio::join!(up, down);
        });
    }
}

/// Copies one direction until either side closes, holding every chunk while stalled.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut stall: watch::Receiver<Option<Instant>>,
    stats: Arc<ProxyStats>,
    stop: CancellationToken,
) {
    let mut buf = vec![0u8; CHUNK];
    loop {
        if !unstalled(&mut stall, &stop).await {
            return;
        }
        let n = tokio::select! {
            _ = stop.cancelled() => return,
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            },
        };
        // A stall that began while this read waited holds what it read.
        if !unstalled(&mut stall, &stop).await {
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
        stats.bytes.fetch_add(n as u64, Ordering::Relaxed);
    }
    let _ = to.shutdown().await;
}

/// Waits until no stall is in force; false when the proxy stops.
async fn unstalled(stall: &mut watch::Receiver<Option<Instant>>, stop: &CancellationToken) -> bool {
    loop {
        let until = *stall.borrow_and_update();
        match until {
            Some(t) if t > Instant::now() => {
                tokio::select! {
                    _ = stop.cancelled() => return false,
                    _ = tokio::time::sleep_until(t) => {}
                    changed = stall.changed() => if changed.is_err() { return false },
                }
            }
            _ => return !stop.is_cancelled(),
        }
    }
}
