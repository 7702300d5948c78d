//! A TCP proxy in front of PostgreSQL, so a test can cut a worker's database connections.

use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The proxy: [`start`](Self::start) it, give its [`url`](Self::url) to the worker, [`cut`](Self::cut).
pub struct Proxy {
    /// The database URL through the proxy.
    pub url: String,
    accept: tokio::task::JoinHandle<()>,
    conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Proxy {
    pub async fn start(db_url: &str) -> Proxy {
        let rest_at = db_url.find("://").map_or(0, |i| i + 3);
        let end = db_url[rest_at..].find(['/', '?']).map_or(db_url.len(), |i| rest_at + i);
        let host_at = db_url[rest_at..end].rfind('@').map_or(rest_at, |i| rest_at + i + 1);
        let hostport = &db_url[host_at..end];
        let upstream = if hostport.contains(':') { hostport.to_owned() } else { format!("{hostport}:5432") };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy addr");
        let conns: Arc<Mutex<Vec<tokio::task::JoinHandle<()>>>> = Arc::default();
        let tracked = Arc::clone(&conns);
        let accept = tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let upstream = upstream.clone();
                let pipe = tokio::spawn(async move {
                    if let Ok(mut outbound) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
                tracked.lock().expect("conns").push(pipe);
            }
        });
        Proxy { url: format!("{}{addr}{}", &db_url[..host_at], &db_url[end..]), accept, conns }
    }

    /// Closes the listener and every proxied connection: the database is gone for the worker.
    pub fn cut(&self) -> Instant {
        self.accept.abort();
        for pipe in self.conns.lock().expect("conns").drain(..) {
            pipe.abort();
        }
        Instant::now()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
    }
}
