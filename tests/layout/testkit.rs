//! Issue #19 ("one test-support crate"): the code the tests share lives in the workspace crate
//! `testkit/` (`brokerfence_testkit::{store, wait, receiver, sqs, redis, zombie, …}`), not in
//! support modules under `tests/` that each test binary compiles again. `tests/` keeps only the
//! zombie worker's entry point ([`THIN`]), which must be compiled into the test binary that
//! re-executes itself as the worker, and it stays thin.
//!
//! `layout_tests_support_lives_in_testkit` checks the tree; `layout_testkit_check_reports_support_modules`
//! shows the check fails on a tree that has a support module.

use std::path::{Path, PathBuf};

use brokerfence_testkit::tree::rust_files;

/// The support files `tests/` may keep, relative to it, and the most lines each may have.
const THIN: &[(&str, usize)] = &[("zombie_support/mod.rs", 40)];

/// Every `.rs` file in a subdirectory of `tests` that is not a test binary, relative to `tests`,
/// in a stable order. A subdirectory with a `main.rs` is one test binary of several files (a
/// `[[test]]` of `tests/Cargo.toml`, e.g. `tests/store/`): its modules are that binary's tests,
/// compiled once, not support shared by others.
fn support_files(tests: &Path) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(tests)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", tests.display()))
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .filter(|path| path.is_dir() && !path.join("main.rs").is_file())
        .collect();
    dirs.sort();
    let files = dirs.iter().flat_map(|dir| rust_files(dir));
    files.map(|f| f.strip_prefix(tests).map(Path::to_path_buf).unwrap_or(f)).collect()
}

/// What breaks the rule under `tests`: a support file that is not in `thin`, or one of `thin`
/// over its line limit; each with a reason.
fn offenders(tests: &Path, thin: &[(&str, usize)]) -> Vec<String> {
    let mut out = Vec::new();
    for file in support_files(tests) {
        let shown = file.display().to_string().replace('\\', "/");
        match thin.iter().find(|(allowed, _)| *allowed == shown) {
            None => out.push(format!("tests/{shown}: a support module in tests/; move it into testkit/")),
            Some((_, max)) => {
                let text = std::fs::read_to_string(tests.join(&file))
                    .unwrap_or_else(|e| panic!("cannot read tests/{shown}: {e}"));
                let lines = text.lines().count();
                if lines > *max {
                    out.push(format!("tests/{shown}: {lines} lines, over {max}; move the machinery into testkit/"));
                }
            }
        }
    }
    out
}

#[test]
fn layout_tests_support_lives_in_testkit() {
    let tests = crate::workspace_root().join("tests");
    let found = offenders(&tests, THIN);
    assert!(found.is_empty(), "test support outside testkit/:\n  {}", found.join("\n  "));
    // The thin entry is there (a renamed one would leave THIN naming nothing).
    for (file, _) in THIN {
        assert!(tests.join(file).is_file(), "tests/{file} is gone: update THIN");
    }
}

/// The check itself: a support module (`common/mod.rs`, nested or not) is reported, a thin file
/// over its limit is reported, one at its limit and a file that is not Rust are not.
#[test]
fn layout_testkit_check_reports_support_modules() {
    let tests = std::env::temp_dir().join(format!("brokerfence-layout-testkit-{}", std::process::id()));
    std::fs::create_dir_all(tests.join("common/nested")).unwrap();
    std::fs::create_dir_all(tests.join("entry")).unwrap();
    std::fs::write(tests.join("a_test.rs"), "mod common;\n").unwrap();
    std::fs::write(tests.join("common/mod.rs"), "pub fn pg() {}\n").unwrap();
    std::fs::write(tests.join("common/nested/helpers.rs"), "pub fn unique() {}\n").unwrap();
    std::fs::write(tests.join("common/notes.md"), "x\n").unwrap();
    std::fs::write(tests.join("entry/mod.rs"), "//\n".repeat(3)).unwrap();
    // A test binary of several files is not support.
    std::fs::create_dir_all(tests.join("several")).unwrap();
    std::fs::write(tests.join("several/main.rs"), "mod part;\n").unwrap();
    std::fs::write(tests.join("several/part.rs"), "#[test]\nfn t() {}\n").unwrap();
    let at_limit = offenders(&tests, &[("entry/mod.rs", 3)]);
    let over = offenders(&tests, &[("entry/mod.rs", 2)]);
    std::fs::remove_dir_all(&tests).unwrap();
    assert_eq!(
        at_limit,
        vec![
            "tests/common/mod.rs: a support module in tests/; move it into testkit/".to_owned(),
            "tests/common/nested/helpers.rs: a support module in tests/; move it into testkit/".to_owned(),
        ]
    );
    assert_eq!(over.len(), 3, "{over:?}");
    assert_eq!(over[2], "tests/entry/mod.rs: 3 lines, over 2; move the machinery into testkit/");
}
