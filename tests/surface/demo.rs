//! The demo stays light: `cargo run --example zombie` on a fresh checkout compiles the root
//! package, its dependencies with the default features and its dev-dependencies (every example
//! of a package builds them all), and nothing else. The other programs live in the
//! `brokerfence-examples` member and the tests in `brokerfence-tests`, so their dependencies
//! stay out of the demo's build.

use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// The most crates the demo's first build may compile.
const MAX_DEMO_CRATES: usize = 150;

/// The packages in the output of `cargo tree --prefix none --format {p}`: one `name version`
/// each, duplicates and cargo's marks (`(*)`, `(proc-macro)`, the path) dropped.
fn packages(tree: &str) -> BTreeSet<String> {
    tree.lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            Some(format!("{} {}", words.next()?, words.next()?))
        })
        .collect()
}

/// The packages the demo's first build compiles: the root package with its default features,
/// its normal, build and dev-dependencies, for the host.
fn demo_packages() -> BTreeSet<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new(".."));
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(root)
        .args(["tree", "-p", "brokerfence", "-e", "normal,build,dev", "--prefix", "none", "--format", "{p}"])
        .output()
        .expect("run cargo tree");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "cargo tree failed: {stderr}");
    packages(&String::from_utf8_lossy(&out.stdout))
}

#[test]
fn surface_demo_builds_at_most_150_crates() {
    let demo = demo_packages();
    println!("cargo run --example zombie compiles {} crates (at most {MAX_DEMO_CRATES})", demo.len());
    assert!(demo.iter().any(|p| p.starts_with("brokerfence v")), "the root package is missing: {demo:?}");
    assert!(
        demo.len() <= MAX_DEMO_CRATES,
        "the zombie demo compiles {} crates, over {MAX_DEMO_CRATES}; keep heavy dependencies out of the root \
         package's dev-dependencies (the programs that need them belong to examples/Cargo.toml):\n{}",
        demo.len(),
        demo.iter().cloned().collect::<Vec<_>>().join("\n")
    );
    // The README states the count: it must be the one measured here.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new(".."));
    let readme = std::fs::read_to_string(root.join("README.md")).expect("read README.md");
    let stated = format!("first build compiles {} crates", demo.len());
    assert!(
        readme.split_whitespace().collect::<Vec<_>>().join(" ").contains(&stated),
        "README.md must say \"The demo's {stated}\" (the count this test measures)"
    );
}

/// The count itself: each package once, whatever cargo marks it with.
#[test]
fn surface_demo_count_takes_each_package_once() {
    let tree = "brokerfence v0.1.0 (/repo)\ntokio v1.0.0\ntokio v1.0.0 (*)\nserde_derive v1.0.0 (proc-macro)\n\n";
    let found = packages(tree);
    assert_eq!(found.len(), 3, "{found:?}");
    assert!(found.contains("tokio v1.0.0"), "{found:?}");
}
