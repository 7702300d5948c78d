//! The one argument parser of the harness programs: the flags they share, as `clap` argument
//! groups each program flattens into its own options, and the parsing itself (one help layout,
//! one way to report a bad command line, per-program defaults shown in `--help`).
//!
//! - [`Common`] (every program): `--database-url`, `--concurrency`;
//! - [`Load`] (chaos, bench, bench_sqs, bench_redis): `--batch`, `--work-ms`;
//! - [`Rounds`] (bench, bench_sqs): `--rounds`, `--claim-window-ms`, `--commit-window-ms`;
//! - [`Redis`] (bench, bench_redis, soak): `--redis-url`.
//!
//! A program's own default for a shared flag is given to [`parse_from`] (so that `--help` shows
//! it); a flag without one is `None` when not given, and the program decides.

use std::time::Duration;

/// The help layout of every harness program (and of the examples): usage first, then the flags.
pub const HELP_TEMPLATE: &str = "usage: {usage}\n\n{about-with-newline}\n{all-args}{after-help}";

/// A count of at least one (0 is read as 1).
pub fn at_least_one(v: &str) -> Result<usize, String> {
    v.parse::<usize>().map(|n| n.max(1)).map_err(|e| format!("{v:?}: {e}"))
}

/// Parses `args` (the program name first) into `A`, with `defaults` (argument id, value) set on
/// the shared flags first. Help and usage errors come back as the `clap::Error` to print.
pub fn parse_from<A: clap::Parser>(
    args: impl IntoIterator<Item = String>,
    defaults: &[(&'static str, &'static str)],
) -> Result<A, clap::Error> {
    let mut command = A::command();
    for (id, value) in defaults {
        command = command.mut_arg(*id, |a| a.default_value(*value));
    }
    let mut matches = command.try_get_matches_from(args)?;
    A::from_arg_matches_mut(&mut matches)
}

/// [`parse_from`] of this process's command line.
pub fn parse<A: clap::Parser>(defaults: &[(&'static str, &'static str)]) -> Result<A, clap::Error> {
    parse_from(std::env::args(), defaults)
}

/// Prints clap's answer (help on stdout, a usage error on stderr) and returns its exit code.
pub fn report(e: &clap::Error) -> i32 {
    let _ = e.print();
    e.exit_code()
}

/// What every harness program takes: where PostgreSQL is, and how many jobs run at once.
#[derive(Debug, Clone, clap::Args)]
pub struct Common {
    /// PostgreSQL URL [default: DATABASE_URL, else localstack/.env]
    #[arg(long, value_name = "URL")]
    pub database_url: Option<String>,
    /// Jobs at once (per worker)
    #[arg(long, value_name = "C", value_parser = at_least_one)]
    pub concurrency: Option<usize>,
}

impl Common {
    /// `--database-url`, else `DATABASE_URL` from the environment or `localstack/.env`.
    pub fn database_url(&self) -> Result<String, String> {
        service_url(self.database_url.as_deref(), "DATABASE_URL")
    }
}

/// The work of the consumers: how many deliveries one claim (or read) takes, and how long each
/// job works.
#[derive(Debug, Clone, clap::Args)]
pub struct Load {
    /// Deliveries per claim (or read)
    #[arg(long, value_name = "B", value_parser = at_least_one)]
    pub batch: Option<usize>,
    /// Milliseconds of work per job
    #[arg(long = "work-ms", value_name = "MS")]
    pub work_ms: Option<u64>,
}

impl Load {
    /// `--work-ms` as a duration (`default_ms` when not given).
    pub fn work(&self, default_ms: u64) -> Duration {
        Duration::from_millis(self.work_ms.unwrap_or(default_ms))
    }
}

/// Repeated measurements: how many paired rounds, and the grouping windows of the fenced side.
#[derive(Debug, Clone, clap::Args)]
pub struct Rounds {
    /// Rounds per figure
    #[arg(long, value_name = "N", value_parser = at_least_one)]
    pub rounds: Option<usize>,
    /// Milliseconds the consumers group claims for [default: 5]
    #[arg(long = "claim-window-ms", value_name = "MS")]
    pub claim_window_ms: Option<u64>,
    /// Milliseconds the supervisors group commits for [default: 5]
    #[arg(long = "commit-window-ms", value_name = "MS")]
    pub commit_window_ms: Option<u64>,
}

impl Rounds {
    /// The consumers' claim window (brokerfence's default when not given).
    pub fn claim_window(&self) -> Duration {
        self.claim_window_ms.map_or(adapters::DEFAULT_CLAIM_WINDOW, Duration::from_millis)
    }
    /// The supervisors' commit window (brokerfence's default when not given).
    pub fn commit_window(&self) -> Duration {
        self.commit_window_ms.map_or(fence::DEFAULT_COMMIT_WINDOW, Duration::from_millis)
    }
}

/// Where Redis is (the programs that read a Redis stream).
#[derive(Debug, Clone, clap::Args)]
pub struct Redis {
    /// Redis URL [default: REDIS_URL, else localstack/.env]
    #[arg(long, value_name = "URL")]
    pub redis_url: Option<String>,
}

impl Redis {
    /// `--redis-url`, else `REDIS_URL` from the environment or `localstack/.env`.
    pub fn redis_url(&self) -> Result<String, String> {
        service_url(self.redis_url.as_deref(), "REDIS_URL")
    }
    /// [`Redis::redis_url`], `None` when there is none anywhere.
    pub fn redis_url_if_any(&self) -> Option<String> {
        self.redis_url.clone().or_else(|| brokerfence_testkit::services::var("REDIS_URL"))
    }
}

fn service_url(given: Option<&str>, var: &str) -> Result<String, String> {
    match given {
        Some(url) => Ok(url.to_owned()),
        None => brokerfence_testkit::services::var(var)
            .ok_or_else(|| format!("{var} is not set and localstack/.env has none: run `bash localstack/up` first")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, clap::Parser)]
    #[command(name = "probe", help_template = HELP_TEMPLATE)]
    struct Probe {
        #[command(flatten)]
        common: Common,
        #[command(flatten)]
        load: Load,
    }

    fn parse(args: &[&str]) -> Result<Probe, clap::Error> {
        parse_from(std::iter::once("probe").chain(args.iter().copied()).map(str::to_owned), &[("concurrency", "32")])
    }

    /// Issue #19: one parser for the harness programs; a program's default for a shared flag is
    /// applied, shown in `--help`, and given way to by the flag.
    #[test]
    fn layout_shared_flags_take_the_program_defaults() {
        let p = parse(&[]).expect("no flags");
        assert_eq!(p.common.concurrency, Some(32));
        assert_eq!(p.load.batch, None);
        assert_eq!(p.load.work(5), Duration::from_millis(5));
        let p = parse(&["--concurrency", "0", "--work-ms", "7", "--database-url", "postgres://x"]).expect("flags");
        assert_eq!(p.common.concurrency, Some(1), "at least one");
        assert_eq!(p.load.work(5), Duration::from_millis(7));
        assert_eq!(p.common.database_url().as_deref(), Ok("postgres://x"));
        let help = parse(&["--help"]).expect_err("help").to_string();
        assert!(help.starts_with("usage: probe"), "{help}");
        assert!(help.contains("--concurrency <C>") && help.contains("[default: 32]"), "{help}");
        let e = parse(&["--no-such-flag"]).expect_err("unknown flag");
        assert_eq!(e.exit_code(), 2);
    }
}
