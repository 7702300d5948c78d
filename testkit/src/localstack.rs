//! LocalStack in Docker, for machines with a Docker engine but no SQS endpoint configured.
//!
//! The container is started with testcontainers (feature `docker`), once per process, and removed
//! when the process exits. Without the feature, [`start`] answers [`FallbackError::NotBuilt`].
//!
//! ```no_run
//! use brokerfence_testkit::localstack;
//! if localstack::docker_answers() {
//!     match localstack::start() {
//!         Ok(endpoint) => println!("SQS at {endpoint}"),
//!         Err(e) => eprintln!("no LocalStack: {e}"),
//!     }
//! }
//! ```

use std::time::Duration;

/// Why the fallback could not give an SQS endpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FallbackError {
    /// This build of the testkit has no testcontainers.
    #[error(
        "the LocalStack fallback is not compiled in: build brokerfence-testkit with feature `docker` \
         (`cargo test --workspace --all-features` does), or run `localstack/up`"
    )]
    NotBuilt,
    /// No Docker engine answers on `DOCKER_HOST` or `/var/run/docker.sock`.
    #[error("no Docker engine answers (DOCKER_HOST or /var/run/docker.sock); run `localstack/up` instead")]
    NoDocker,
    /// testcontainers could not start the container or read its port.
    #[error("could not start LocalStack with testcontainers: {0}. Run `localstack/up` instead")]
    Start(String),
    /// The container did not report its port in time.
    #[error("LocalStack (testcontainers) did not start within {0:?}. Run `localstack/up` instead")]
    Timeout(Duration),
}

/// How long [`start`] waits for the container (the image pull included).
pub const START_TIMEOUT: Duration = Duration::from_secs(300);

/// Whether something accepts a TCP connection at `endpoint` (`scheme://host:port/…` or
/// `host:port`) within two seconds.
pub fn answers(endpoint: &str) -> bool {
    use std::net::ToSocketAddrs;
    let host_port = endpoint.split("://").nth(1).unwrap_or(endpoint).split('/').next().unwrap_or("");
    host_port
        .to_socket_addrs()
        .ok()
        .into_iter()
        .flatten()
        .any(|a| std::net::TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok())
}

/// Whether a Docker engine answers: the unix socket of `DOCKER_HOST` (default
/// `/var/run/docker.sock`), or a `tcp://` `DOCKER_HOST`.
pub fn docker_answers() -> bool {
    #[cfg(unix)]
    {
        let sock = std::env::var("DOCKER_HOST")
            .ok()
            .and_then(|h| h.strip_prefix("unix://").map(str::to_owned))
            .unwrap_or_else(|| "/var/run/docker.sock".into());
        if std::os::unix::net::UnixStream::connect(&sock).is_ok() {
            return true;
        }
    }
    std::env::var("DOCKER_HOST").is_ok_and(|h| h.starts_with("tcp://") && answers(&h))
}

/// Starts LocalStack (SQS only) once per process and answers its endpoint (`http://host:port`);
/// later calls answer the same endpoint. The container is removed at process exit.
pub fn start() -> Result<String, FallbackError> {
    imp::start()
}

#[cfg(not(feature = "docker"))]
mod imp {
    use super::FallbackError;

    pub fn start() -> Result<String, FallbackError> {
        Err(FallbackError::NotBuilt)
    }
}

#[cfg(feature = "docker")]
mod imp {
    use std::sync::mpsc;
    use std::sync::{Mutex, OnceLock};
    use std::time::Duration;

    use testcontainers::runners::AsyncRunner;
    use testcontainers::{ContainerAsync, ImageExt};
    use testcontainers_modules::localstack::LocalStack;

    use super::{FallbackError, START_TIMEOUT};

    type Stop = (mpsc::Sender<()>, Mutex<mpsc::Receiver<()>>);
    static STOP: OnceLock<Stop> = OnceLock::new();
    static STARTED: Mutex<Option<String>> = Mutex::new(None);

    extern "C" fn remove_at_exit() {
        if let Some((stop, done)) = STOP.get() {
            let _ = stop.send(());
            if let Ok(done) = done.lock() {
                let _ = done.recv_timeout(Duration::from_secs(20));
            }
        }
    }

    pub fn start() -> Result<String, FallbackError> {
        let mut started = STARTED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(endpoint) = started.as_ref() {
            return Ok(endpoint.clone());
        }
        if !super::docker_answers() {
            return Err(FallbackError::NoDocker);
        }
        let endpoint = start_container()?;
        *started = Some(endpoint.clone());
        Ok(endpoint)
    }

    /// Starts the container on a thread of its own that keeps it until the process exits.
    fn start_container() -> Result<String, FallbackError> {
        let (ready_tx, ready_rx) = mpsc::channel::<Result<String, String>>();
        let (stop_tx, stop_rx) = mpsc::channel::<()>();
        let (done_tx, done_rx) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(e.to_string()));
                    return;
                }
            };
            rt.block_on(async move {
                let started: Result<ContainerAsync<LocalStack>, _> =
                    LocalStack::default().with_env_var("SERVICES", "sqs").start().await;
                let node = match started {
                    Ok(n) => n,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let endpoint = match (node.get_host().await, node.get_host_port_ipv4(4566).await) {
                    (Ok(h), Ok(p)) => format!("http://{h}:{p}"),
                    (Err(e), _) | (_, Err(e)) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(endpoint));
                let _ = tokio::task::spawn_blocking(move || stop_rx.recv()).await;
                let _ = node.rm().await;
                let _ = done_tx.send(());
            });
        });
        match ready_rx.recv_timeout(START_TIMEOUT) {
            Ok(Ok(endpoint)) => {
                let _ = STOP.set((stop_tx, Mutex::new(done_rx)));
                // SAFETY: registering a plain extern "C" function with no captured state.
                unsafe { libc::atexit(remove_at_exit) };
                Ok(endpoint)
            }
            Ok(Err(e)) => Err(FallbackError::Start(e)),
            Err(_) => Err(FallbackError::Timeout(START_TIMEOUT)),
        }
    }
}
