//! Issue #19 ("a codebase that reads like its architecture"): no library source file is longer
//! than [`MAX_LINES`] lines, so that each file holds one job of its module and a reader finds a
//! part by the file named for it.
//!
//! `layout_no_library_file_over_600_lines` covers every library tree ([`SOURCE_DIRS`]);
//! `layout_fence_files_within_600_lines` covers `fence/src` alone. `examples/` holds only what
//! teaches, each file readable in one sitting ([`MAX_EXAMPLE_LINES`]:
//! `layout_examples_at_most_300_lines`); the harness programs live in the `bench/` member
//! (`layout_harness_lives_in_bench_member`).

use std::path::Path;

use brokerfence_testkit::tree::rust_files;

/// The longest a library source file may be, in lines.
const MAX_LINES: usize = 600;

/// The longest a file under `examples/` may be, in lines (support files included).
const MAX_EXAMPLE_LINES: usize = 300;

/// The harness programs: binaries of the `brokerfence-bench` member, none of them in `examples/`.
const HARNESS_PROGRAMS: &[&str] = &["chaos", "bench", "bench_sqs", "bench_redis", "soak"];

/// The library source trees the rule covers, relative to the workspace root (each walked with
/// its subdirectories, so `src` includes `src/bin`; `bench/src` holds the harness programs).
const SOURCE_DIRS: &[&str] = &["fence/src", "adapters/src", "src", "testkit/src", "model/src", "bench/src"];

/// The files under `root`/`dirs` longer than `max` lines, with their lengths, and how many files
/// were looked at.
fn offenders(root: &Path, dirs: &[&str], max: usize) -> (Vec<(String, usize)>, usize) {
    let mut files = Vec::new();
    for dir in dirs {
        files.extend(rust_files(&root.join(dir)));
    }
    let mut over = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
        let lines = text.lines().count();
        if lines > max {
            let shown = file.strip_prefix(root).unwrap_or(file).display().to_string();
            over.push((shown, lines));
        }
    }
    (over, files.len())
}

/// Fails with the list of the files in `dirs` (under the workspace root) over [`MAX_LINES`].
fn assert_within_limit(dirs: &[&str]) {
    assert_files_within(dirs, MAX_LINES, "library files", "split each by the job its parts do");
}

/// Fails with the list of the files in `dirs` (under the workspace root) over `max` lines.
fn assert_files_within(dirs: &[&str], max: usize, what: &str, advice: &str) {
    let root = crate::workspace_root();
    let (over, scanned) = offenders(root, dirs, max);
    assert!(scanned > 0, "no .rs files found under {dirs:?}");
    let list: Vec<String> = over.iter().map(|(file, lines)| format!("  {file}: {lines} lines")).collect();
    assert!(over.is_empty(), "{} of {scanned} {what} are over {max} lines; {advice}:\n{}", over.len(), list.join("\n"));
}

/// The harness programs found in the examples tree `dir`: a file `NAME.rs` or a folder `NAME/`
/// (at any depth) for a NAME of [`HARNESS_PROGRAMS`].
fn harness_in_examples(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()));
        for entry in entries {
            let path = entry.unwrap_or_else(|e| panic!("cannot read an entry of {}: {e}", dir.display())).path();
            let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or_default();
            let is_rust = path.extension().is_some_and(|ext| ext == "rs");
            if HARNESS_PROGRAMS.contains(&stem) && (path.is_dir() || is_rust) {
                found.push(path.display().to_string());
            }
            if path.is_dir() {
                stack.push(path);
            }
        }
    }
    found.sort();
    found
}

#[test]
fn layout_no_library_file_over_600_lines() {
    assert_within_limit(SOURCE_DIRS);
}

#[test]
fn layout_fence_files_within_600_lines() {
    assert_within_limit(&["fence/src"]);
}

/// The check itself: a file one line over the limit, in a subdirectory, is reported with its
/// length; one at the limit and a file that is not Rust are not.
#[test]
fn layout_check_reports_a_file_over_the_limit() {
    let root = std::env::temp_dir().join(format!("brokerfence-layout-{}", std::process::id()));
    let nested = root.join("lib/src/nested");
    std::fs::create_dir_all(&nested).unwrap();
    std::fs::write(root.join("lib/src/at_limit.rs"), "//\n".repeat(MAX_LINES)).unwrap();
    std::fs::write(nested.join("over.rs"), "//\n".repeat(MAX_LINES + 1)).unwrap();
    std::fs::write(nested.join("notes.md"), "x\n".repeat(MAX_LINES + 1)).unwrap();
    let (over, scanned) = offenders(&root, &["lib/src"], MAX_LINES);
    std::fs::remove_dir_all(&root).unwrap();
    assert_eq!(scanned, 2);
    let expected = Path::new("lib/src/nested/over.rs").display().to_string();
    assert_eq!(over, vec![(expected, MAX_LINES + 1)]);
}

/// Issue #19: every file in `examples/` (programs and their support files) is at most
/// [`MAX_EXAMPLE_LINES`] lines, so that each example reads in one sitting.
#[test]
fn layout_examples_at_most_300_lines() {
    assert_files_within(
        &["examples"],
        MAX_EXAMPLE_LINES,
        "example files",
        "move the plumbing that does not teach brokerfence into examples/support/",
    );
}

/// The check itself, at the examples' limit: a support file one line over is reported with its
/// length; one at the limit is not.
#[test]
fn layout_examples_check_reports_a_support_file_over_300_lines() {
    let root = std::env::temp_dir().join(format!("brokerfence-layout-examples-{}", std::process::id()));
    let support = root.join("examples/support");
    std::fs::create_dir_all(&support).unwrap();
    std::fs::write(root.join("examples/worker.rs"), "//\n".repeat(MAX_EXAMPLE_LINES)).unwrap();
    std::fs::write(support.join("plumbing.rs"), "//\n".repeat(MAX_EXAMPLE_LINES + 1)).unwrap();
    let (over, scanned) = offenders(&root, &["examples"], MAX_EXAMPLE_LINES);
    std::fs::remove_dir_all(&root).unwrap();
    assert_eq!(scanned, 2);
    let expected = Path::new("examples/support/plumbing.rs").display().to_string();
    assert_eq!(over, vec![(expected, MAX_EXAMPLE_LINES + 1)]);
}

/// Issue #19: the harness programs are binaries of the `bench/` member (`brokerfence-bench`),
/// not examples: none of them in `examples/`, each a `[[bin]]` of `bench/Cargo.toml` with its
/// file, and `bench` a workspace member.
#[test]
fn layout_harness_lives_in_bench_member() {
    let root = crate::workspace_root();
    let in_examples = harness_in_examples(&root.join("examples"));
    assert!(in_examples.is_empty(), "harness programs in examples/ (they belong in bench/): {in_examples:?}");
    let manifest = std::fs::read_to_string(root.join("bench/Cargo.toml")).expect("bench/Cargo.toml");
    assert!(manifest.contains("name = \"brokerfence-bench\""), "bench/Cargo.toml is not brokerfence-bench");
    assert!(manifest.contains("publish = false"), "brokerfence-bench must not be published");
    for name in HARNESS_PROGRAMS {
        let bin = format!("[[bin]]\nname = \"{name}\"\npath = \"src/bin/{name}.rs\"");
        assert!(manifest.contains(&bin), "bench/Cargo.toml has no [[bin]] {name} at src/bin/{name}.rs");
        assert!(root.join(format!("bench/src/bin/{name}.rs")).is_file(), "bench/src/bin/{name}.rs is missing");
    }
    let workspace = std::fs::read_to_string(root.join("Cargo.toml")).expect("Cargo.toml");
    let members = workspace.lines().find(|l| l.starts_with("members = ")).expect("workspace members");
    assert!(members.contains("\"bench\""), "bench/ is not a workspace member: {members}");
    assert!(!workspace.contains("name = \"bench"), "the root package still declares a harness example");
}

/// The check itself: a harness program in an examples tree (a file, or a folder of its modules,
/// at any depth) is found; a teaching example is not.
#[test]
fn layout_harness_check_finds_a_harness_program_in_examples() {
    let root = std::env::temp_dir().join(format!("brokerfence-layout-harness-{}", std::process::id()));
    std::fs::create_dir_all(root.join("examples/chaos")).unwrap();
    std::fs::create_dir_all(root.join("examples/support")).unwrap();
    std::fs::write(root.join("examples/sqs_worker.rs"), "fn main() {}\n").unwrap();
    std::fs::write(root.join("examples/support/soak.rs"), "fn main() {}\n").unwrap();
    std::fs::write(root.join("examples/chaos/faults.rs"), "\n").unwrap();
    std::fs::write(root.join("examples/bench.md"), "not Rust\n").unwrap();
    let found = harness_in_examples(&root.join("examples"));
    std::fs::remove_dir_all(&root).unwrap();
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found.iter().any(|f| f.ends_with("chaos")), "{found:?}");
    assert!(found.iter().any(|f| f.ends_with("soak.rs")), "{found:?}");
}
