//! Issue #19 ("a codebase that reads like its architecture"): no library source file is longer
//! than [`MAX_LINES`] lines, so that each file holds one job of its module and a reader finds a
//! part by the file named for it.
//!
//! `layout_no_library_file_over_600_lines` covers every library tree ([`SOURCE_DIRS`]);
//! `layout_fence_files_within_600_lines` covers `fence/src` alone.

use std::path::{Path, PathBuf};

/// The longest a library source file may be, in lines.
const MAX_LINES: usize = 600;

/// The library source trees the rule covers, relative to the workspace root (each walked with
/// its subdirectories, so `src` includes `src/bin`).
const SOURCE_DIRS: &[&str] = &["fence/src", "adapters/src", "src", "testkit/src", "model/src"];

/// Every `.rs` file under `dir`, in a stable order.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|entry| entry.unwrap_or_else(|e| panic!("cannot read an entry of {}: {e}", dir.display())).path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|ext| ext == "rs") {
            out.push(path);
        }
    }
}

/// The files under `root`/`dirs` longer than `max` lines, with their lengths, and how many files
/// were looked at.
fn offenders(root: &Path, dirs: &[&str], max: usize) -> (Vec<(String, usize)>, usize) {
    let mut files = Vec::new();
    for dir in dirs {
        rust_files(&root.join(dir), &mut files);
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
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (over, scanned) = offenders(root, dirs, MAX_LINES);
    assert!(scanned > 0, "no .rs files found under {dirs:?}");
    let list: Vec<String> = over.iter().map(|(file, lines)| format!("  {file}: {lines} lines")).collect();
    assert!(
        over.is_empty(),
        "{} of {scanned} library files are over {MAX_LINES} lines; split each by the job its parts do:\n{}",
        over.len(),
        list.join("\n")
    );
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
