//! Shared by the example workers (`sqs_worker`, `redis_worker`, `table_worker`, `zombie_worker`)
//! and producers: command-line flags (here), `EVENT` lines (`events.rs`, `source_events.rs`),
//! logging and the fence connection (`startup.rs`), the receiver call and signals
//! (`handler.rs`). Each example includes it with `#[path = "support/cli.rs"] mod common;` (a
//! file directly in `examples/` would be an example of its own) and finds everything as
//! `common::…`. The formats are documented in `examples/README.md`.
#![allow(dead_code)]

use std::fmt::Display;
use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use brokerfence::{
    self, Claim, ClaimedJob, DbTime, FailOutcome, FenceError, FenceStore, Heartbeat, JobContext, JobError, JobKey,
    JobRecord, Lease, LeaseDuration, Owner, PgFence, QueueName, RetryPolicy, SchemaName,
};
use brokerfence::{Incoming, ReceiveContext, Source, SourceError};

#[path = "events.rs"]
mod events;
#[path = "handler.rs"]
mod handler;
#[path = "otel.rs"]
pub mod otel;
#[path = "source_events.rs"]
mod source_events;
#[path = "startup.rs"]
mod startup;

// Each example uses a part of these.
#[allow(unused_imports)]
pub use events::*;
#[allow(unused_imports)]
pub use handler::*;
#[allow(unused_imports)]
pub use source_events::*;
#[allow(unused_imports)]
pub use startup::*;

// ----------------------------------------------------------------------------------------- flags

/// The help layout every example shares (clap): the usage line first, then what the program
/// does, then its flags. `--help` prints it on stdout and exits 0; a bad command line prints
/// clap's message on stderr and exits 2.
pub const HELP_TEMPLATE: &str = "usage: {usage}\n\n{about-with-newline}\n{all-args}{after-help}";

/// Parses `raw` (the arguments without the program name) as `prog`'s flags.
pub fn parse<A: clap::Parser>(prog: &str, raw: Vec<String>) -> Result<A, clap::Error> {
    A::try_parse_from(std::iter::once(prog.to_owned()).chain(raw))
}

/// A usage error found after parsing (a flag that is required unless an environment variable
/// is set, two flags that exclude each other), in clap's format: exit code 2.
pub fn usage_error<A: clap::CommandFactory>(message: impl Display) -> clap::Error {
    A::command().error(clap::error::ErrorKind::MissingRequiredArgument, message)
}

/// Prints a parse failure where it belongs (help on stdout, errors on stderr); its exit code
/// (0 for `--help`, 2 for a bad command line).
pub fn report_cli(e: &clap::Error) -> i32 {
    let _ = e.print();
    e.exit_code()
}

/// A duration in milliseconds (`--grace 500`).
pub fn millis(v: &str) -> Result<Duration, String> {
    v.parse::<u64>().map(Duration::from_millis).map_err(|e| format!("{v:?} is not a number of milliseconds: {e}"))
}

/// A count of at least one (0 is taken as 1).
pub fn at_least_one(v: &str) -> Result<usize, String> {
    v.parse::<usize>().map(|n| n.max(1)).map_err(|e| format!("{v:?}: {e}"))
}

/// A number of attempts of at least one (0 or less is taken as 1).
pub fn attempts(v: &str) -> Result<i64, String> {
    v.parse::<i64>().map(|n| n.max(1)).map_err(|e| format!("{v:?}: {e}"))
}

/// The flags every consumer worker has (see `examples/README.md`); each worker flattens them
/// into its own (`#[command(flatten)] common: Common`).
#[derive(Debug, Clone, clap::Args)]
pub struct Common {
    /// PostgreSQL URL (else DATABASE_URL, else localstack/.env)
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
    /// Schema of the fence tables
    #[arg(long, value_name = "NAME")]
    pub schema: Option<String>,
    /// Owner id (also PostgreSQL's application_name); default: a unique one
    #[arg(long, value_name = "NAME")]
    pub owner: Option<String>,
    /// Lease length in seconds
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    pub lease: u64,
    /// Apply the schema migrations at start (else refuse a schema older than this build)
    #[arg(long)]
    pub migrate: bool,
    /// HTTP receiver each job calls with its fencing stamp (else RECEIVER_URL)
    #[arg(long, value_name = "URL")]
    pub receiver_url: Option<String>,
    /// Failed attempts before a job is dead [default: 5]
    #[arg(long, value_name = "N", value_parser = attempts)]
    pub max_attempts: Option<i64>,
    /// Jobs run at once
    #[arg(long, value_name = "N", default_value = "16", value_parser = at_least_one)]
    pub concurrency: usize,
    /// Milliseconds running jobs get to finish at shutdown
    #[arg(long, value_name = "MS", default_value = "30000", value_parser = millis)]
    pub grace: Duration,
    /// Milliseconds each handler waits before the receiver call
    #[arg(long, value_name = "MS", default_value = "0", value_parser = millis)]
    pub handler_delay: Duration,
    /// Milliseconds each handler waits after the receiver call
    #[arg(long, value_name = "MS", default_value = "0", value_parser = millis)]
    pub after_call_delay: Duration,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (port 0: any free port; needs the
    /// `metrics` feature)
    #[arg(long, value_name = "HOST:PORT")]
    pub metrics_addr: Option<String>,
    /// Export spans by OTLP over HTTP to http://HOST:PORT (a collector's port 4318; the path
    /// /v1/traces is added); needs the `otel` feature
    #[arg(long, value_name = "URL", value_parser = otel::otlp_endpoint)]
    pub otlp_endpoint: Option<String>,
}

impl Common {
    /// The owner: `--owner`, or a unique one from `prefix`.
    pub fn owner(&self, prefix: &str) -> Result<Owner, FenceError> {
        match &self.owner {
            Some(o) => Owner::new(o.clone()),
            None => Ok(Owner::unique(prefix)),
        }
    }

    /// The receiver: `--receiver-url`, else `RECEIVER_URL` (when not empty).
    pub fn receiver(&self) -> Option<String> {
        self.receiver_url.clone().or_else(|| std::env::var("RECEIVER_URL").ok().filter(|s| !s.is_empty()))
    }

    /// With `--metrics-addr`: installs the Prometheus recorder, listens, and prints
    /// `EVENT metrics_endpoint addr=HOST:PORT url=http://HOST:PORT/metrics` (the bound address:
    /// port 0 picks a free one). Call it before the consumer is built (the consumer takes its
    /// metric handles from the recorder installed then). Without the `metrics` feature the flag is
    /// refused (exit 2); an address that cannot be bound fails (exit 1).
    pub async fn serve_metrics(&self) -> Result<(), StartError> {
        let Some(addr) = self.metrics_addr.as_deref() else { return Ok(()) };
        if !cfg!(feature = "metrics") {
            return Err(StartError::Refused(
                "--metrics-addr needs the `metrics` feature (cargo run -p brokerfence-examples --features metrics --example …)".into(),
            ));
        }
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| StartError::Failed(format!("cannot listen on --metrics-addr {addr}: {e}")))?;
        let bound = listener.local_addr().map_err(|e| StartError::Failed(format!("--metrics-addr {addr}: {e}")))?;
        let handle = install_prometheus()?;
        let upkeep = handle.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(5)).await;
                upkeep.run_upkeep();
            }
        });
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let handle = handle.clone();
                async move { ([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], handle.render()) }
            }),
        );
        tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::error!(error = %e, "metrics endpoint stopped");
            }
        });
        let url = format!("http://{bound}/metrics");
        event("metrics_endpoint", &[("addr", &bound), ("url", &url)]);
        Ok(())
    }

    /// The retry policy: the default with `--max-attempts`.
    pub fn retry_policy(&self) -> RetryPolicy {
        let default = RetryPolicy::default();
        RetryPolicy { max_attempts: self.max_attempts.unwrap_or(default.max_attempts), ..default }
    }
}

/// A `DEST=TARGET` pair (`outbox_relay relay --sqs billing=URL`).
pub fn pair(v: &str) -> Result<(String, String), String> {
    match v.split_once('=') {
        Some((d, t)) if !d.is_empty() && !t.is_empty() => Ok((d.to_owned(), t.to_owned())),
        _ => Err(format!("{v:?}: expected DEST=TARGET")),
    }
}

/// A batch size of at least one (0 is read as 1).
pub fn batch_size(v: &str) -> Result<u32, String> {
    v.parse::<u32>().map(|n| n.max(1)).map_err(|e| format!("{v:?}: {e}"))
}
