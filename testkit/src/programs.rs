//! The workspace's programs a test runs, built by the test itself: the example workers (the
//! `brokerfence-examples` member, `examples/Cargo.toml`) and the CLI binary `brokerfence` (the
//! root package's `[[bin]]`).
//!
//! A test never relies on what an earlier build left in `target/`: cargo keeps the program a
//! test needs fresh in `deps/`, but the copy at `target/<profile>/examples/<name>` belongs to
//! whichever build put it there last, and it can be missing (seen: "example redis_worker not
//! built" after other builds). So [`example`] and [`bin`] run `cargo build --example NAME` (or
//! `--bin NAME`) `--message-format=json` once per test process and program, and take the
//! `executable` path cargo reports; cargo puts that copy back when it is missing. With
//! everything fresh that is a fraction of a second.
//!
//! The build matches the test binary's own, so that cargo finds its units fresh: the same
//! target directory and profile (from the test binary's path), and the same packages and
//! features as the documented test command — `--workspace --all-features` when this crate was
//! built with every feature of the workspace (its `docker` feature is on only then), else the
//! tests package, the examples package (for an example) or the root package (for the CLI) with
//! `--all-features`. A test run with fewer features builds the programs with all of them the
//! first time (slower once, never a program missing a feature a test asks for).
//!
//! Features are where a second build of the workspace crates would come from: a build of a
//! binary alone has no dev units, so the members' dev-dependencies turn no features on in it,
//! while they do in `cargo test`. The tests and examples packages therefore list their
//! dependencies as normal ones, with the features the members' dev-dependencies turn on, so both
//! resolutions agree and the CLI's build reuses the test build's crates.
//!
//! Builds in one process are serialized (one cargo at a time; cargo itself locks the target
//! directory against other processes).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

/// A kind of program cargo builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    /// An `[[example]]` of the examples package (`examples/Cargo.toml`).
    Example,
    /// A `[[bin]]` of the root package: the CLI `brokerfence`.
    Bin,
}

impl Kind {
    fn flag(self) -> &'static str {
        match self {
            Kind::Example => "--example",
            Kind::Bin => "--bin",
        }
    }

    /// The package that has programs of this kind.
    fn package(self) -> &'static str {
        match self {
            Kind::Example => "brokerfence-examples",
            Kind::Bin => "brokerfence",
        }
    }

    /// The target kind in cargo's JSON messages.
    fn target_kind(self) -> &'static str {
        match self {
            Kind::Example => "example",
            Kind::Bin => "bin",
        }
    }
}

/// The example `name`, built (or found fresh) for this test process; cached after the first
/// call. Panics, with cargo's message, when it cannot be built.
pub fn example(name: &str) -> PathBuf {
    cached(Kind::Example, name)
}

/// The binary `name` of the root package (the CLI, `brokerfence`, feature `cli`), built (or
/// found fresh) for this test process; cached after the first call. Panics, with cargo's
/// message, when it cannot be built.
pub fn bin(name: &str) -> PathBuf {
    cached(Kind::Bin, name)
}

fn cached(kind: Kind, name: &str) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<(Kind, String), PathBuf>>> = OnceLock::new();
    let built = BUILT.get_or_init(Mutex::default);
    let mut built = built.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    // The lock is held across the build: two tests asking for programs wait for one cargo.
    if let Some(path) = built.get(&(kind, name.to_owned())).filter(|p| p.is_file()) {
        return path.clone();
    }
    let path = build(kind, name).unwrap_or_else(|e| panic!("{e}"));
    built.insert((kind, name.to_owned()), path.clone());
    path
}

/// Runs cargo for the program now (no cache; serialized with every other build of this
/// process) and returns the executable it reports.
pub fn build(kind: Kind, name: &str) -> Result<PathBuf, String> {
    static CARGO: Mutex<()> = Mutex::new(());
    let _one_at_a_time = CARGO.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let exe = std::env::current_exe().map_err(|e| format!("the test binary's path: {e}"))?;
    // <target>/<profile>/deps/<test binary>
    let profile_dir = exe.parent().and_then(Path::parent).ok_or("the test binary lies in no target/<profile>/deps")?;
    let target_dir = profile_dir.parent().ok_or("the test binary lies in no target directory")?;
    let mut cmd = cargo();
    cmd.current_dir(workspace_root()).arg("build");
    if cfg!(feature = "docker") {
        cmd.arg("--workspace");
    } else {
        cmd.args(["-p", "brokerfence-tests", "-p", kind.package()]);
    }
    cmd.args(["--all-features", kind.flag(), name, "--message-format=json-render-diagnostics"]);
    cmd.arg("--target-dir").arg(target_dir);
    match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => {}
        Some("release") => {
            cmd.arg("--release");
        }
        Some(other) => {
            cmd.args(["--profile", other]);
        }
    }
    let shown = format!("{cmd:?}");
    let out = cmd.stderr(std::process::Stdio::piped()).output().map_err(|e| format!("cannot run {shown}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{shown} exited with {}; the build could not make {name}:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let path = executable(&stdout, kind, name)
        .ok_or_else(|| format!("{shown} reported no executable for {name} (is it a {} target?)", kind.target_kind()))?;
    if !path.is_file() {
        return Err(format!("{shown} reported {}, which does not exist", path.display()));
    }
    Ok(path)
}

/// The workspace root (this crate's parent directory).
/// A `cargo` command (the one running the tests, else the one on `PATH`) for a build started from
/// a test, without the variables cargo set for the test process. Those describe the test, not
/// the shell the build came from; build scripts depend on some of them (ring:
/// `rerun-if-env-changed` on `CARGO_PKG_NAME`, …), so left in, the build saw other values than
/// `cargo test` did and ran them again, rebuilding ring, rustls and sqlx here and once more at the
/// next `cargo test`.
pub fn cargo() -> std::process::Command {
    let mut cmd = std::process::Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    for (key, _) in std::env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        let set_by_cargo = ["CARGO_PKG_", "CARGO_MANIFEST_", "CARGO_BIN_EXE_"].iter().any(|p| key.starts_with(p))
            || ["CARGO_CRATE_NAME", "CARGO_BIN_NAME", "CARGO_PRIMARY_PACKAGE", "CARGO_TARGET_TMPDIR", "OUT_DIR"]
                .contains(&key);
        if set_by_cargo {
            cmd.env_remove(key);
        }
    }
    cmd
}

fn workspace_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new(".."))
}

/// The `executable` of the `compiler-artifact` message for the target `name` of `kind`, from
/// cargo's JSON messages (one object a line).
fn executable(messages: &str, kind: Kind, name: &str) -> Option<PathBuf> {
    messages.lines().find_map(|line| {
        let m: serde_json::Value = serde_json::from_str(line).ok()?;
        let target = m.get("target")?;
        let ours = m.get("reason")?.as_str()? == "compiler-artifact"
            && target.get("name")?.as_str()? == name
            && target.get("kind")?.as_array()?.iter().any(|k| k.as_str() == Some(kind.target_kind()));
        ours.then(|| m.get("executable")?.as_str().map(PathBuf::from))?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_executable_of_the_named_target() {
        let messages = concat!(
            r#"{"reason":"compiler-artifact","target":{"kind":["lib"],"name":"table_worker"},"executable":null}"#,
            "\n",
            r#"{"reason":"compiler-artifact","target":{"kind":["example"],"name":"table_worker"},"executable":"/t/debug/examples/table_worker","fresh":true}"#,
            "\n",
            r#"{"reason":"build-finished","success":true}"#,
        );
        assert_eq!(
            executable(messages, Kind::Example, "table_worker"),
            Some(PathBuf::from("/t/debug/examples/table_worker"))
        );
        assert_eq!(executable(messages, Kind::Bin, "table_worker"), None);
        assert_eq!(executable(messages, Kind::Example, "table_produce"), None);
    }
}
