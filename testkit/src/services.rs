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
    read(&dotenv_path()?, name)
}

/// The value of `name` in the dotenv file `file` (a line that does not parse is skipped).
fn read(file: &Path, name: &str) -> Option<String> {
    dotenvy::from_path_iter(file).ok()?.filter_map(Result::ok).find(|(k, _)| k == name).map(|(_, v)| v)
}

/// Copies every variable of `localstack/.env` that is not already set into the process
/// environment (so SDKs that read the environment themselves see it), with `dotenvy` (quotes,
/// `export ` prefixes and comments as in a shell). Call it at start-up, before spawning threads.
pub fn load_dotenv() {
    let Some(file) = dotenv_path() else { return };
    // dotenvy never overrides a variable that is already set (`from_path_override` would).
    if let Err(e) = dotenvy::from_path(&file) {
        eprintln!("warning: {}: {e}", file.display());
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// What `localstack/up` writes, and what people add by hand: `export `, quotes, comments.
    #[test]
    fn ergonomics_dotenv_reads_export_quotes_and_comments() {
        let file = std::env::temp_dir().join(format!("brokerfence-testkit-{}.env", std::process::id()));
        std::fs::write(
            &file,
            "# written by localstack/up\nexport DATABASE_URL=\"postgres://u@h:5432/test\"\nREDIS_URL='redis://h:6379'\n\
             AWS_REGION=us-east-1 # the default\n",
        )
        .expect("write the dotenv file");
        assert_eq!(read(&file, "DATABASE_URL").as_deref(), Some("postgres://u@h:5432/test"));
        assert_eq!(read(&file, "REDIS_URL").as_deref(), Some("redis://h:6379"));
        assert_eq!(read(&file, "AWS_REGION").as_deref(), Some("us-east-1"));
        assert_eq!(read(&file, "MISSING"), None);
        let _ = std::fs::remove_file(&file);
    }
}
