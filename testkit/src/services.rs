//! Where the services are: the standard environment variables, falling back to the
//! `localstack/.env` file that `localstack/up` writes.
//!
//! For brokerfence's own tests and examples only (this crate is not published): the file is
//! looked for from the current directory upwards, then from this crate's directory in the
//! checkout it was compiled from — right for tests, which run from the checkout.
//!
//! ```no_run
//! let url = brokerfence_testkit::services::var("DATABASE_URL");
//! println!("{url:?}");
//! ```

use std::path::{Path, PathBuf};

/// The variables `localstack/up` writes.
pub const VARS: &[&str] =
    &["DATABASE_URL", "REDIS_URL", "AWS_ENDPOINT_URL_SQS", "AWS_REGION", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"];

/// The value of `name`: from the process environment if set and not empty, else from
/// `localstack/.env` (found from the current directory upwards, else from this crate's directory
/// in the checkout upwards).
pub fn var(name: &str) -> Option<String> {
    if let Ok(v) = std::env::var(name)
        && !v.is_empty()
    {
        return Some(v);
    }
    let file = dotenv_path()?;
    let text = std::fs::read_to_string(file).ok()?;
    parse(&text).into_iter().find(|(k, _)| k == name).map(|(_, v)| v)
}

/// Copies every variable of `localstack/.env` that is not already set into the process
/// environment (so SDKs that read the environment themselves see it). Call it at start-up,
/// before spawning threads.
pub fn load_dotenv() {
    let Some(file) = dotenv_path() else { return };
    let Ok(text) = std::fs::read_to_string(file) else { return };
    for (k, v) in parse(&text) {
        if std::env::var_os(&k).is_none() {
            // SAFETY: documented to be called at start-up, before other threads exist.
            unsafe { std::env::set_var(k, v) };
        }
    }
}

fn parse(text: &str) -> Vec<(String, String)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.strip_prefix("export ").unwrap_or(l).split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().trim_matches('"').trim_matches('\'').to_owned()))
        .collect()
}

/// The `localstack/.env` file, if one exists.
pub fn dotenv_path() -> Option<PathBuf> {
    let mut starts = vec![PathBuf::from(env!("CARGO_MANIFEST_DIR"))];
    if let Ok(cwd) = std::env::current_dir() {
        starts.insert(0, cwd);
    }
    starts
        .iter()
        .find_map(|start| start.ancestors().map(|d: &Path| d.join("localstack").join(".env")).find(|p| p.is_file()))
}
