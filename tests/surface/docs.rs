//! The texts a user reads first stay short and in step with the code: the README fits on a few
//! screens, ARCHITECTURE.md is a map with a glossary, and every guide in `docs/` is part of the
//! crate's documentation (`brokerfence::guide`), so its code compiles as doctests.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap_or(Path::new("..")).to_path_buf()
}

fn read(name: &str) -> String {
    std::fs::read_to_string(root().join(name)).unwrap_or_else(|e| panic!("read {name}: {e}"))
}

/// Lines that cite an issue number (`#31`, `issue 17`) or a file outside the repository.
fn history_lines(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| {
            let cites_issue = l.match_indices('#').any(|(i, _)| {
                let before = l[..i].chars().last();
                let after = l[i + 1..].chars().next();
                after.is_some_and(|c| c.is_ascii_digit()) && !before.is_some_and(|c| c == '&' || c.is_alphanumeric())
            }) || l.to_lowercase().contains("issue ");
            cites_issue || l.contains("../shared") || l.contains("/work/")
        })
        .map(str::to_owned)
        .collect()
}

#[test]
fn surface_readme_fits_on_a_few_screens() {
    let readme = read("README.md");
    let lines = readme.lines().count();
    assert!(lines <= 400, "README.md has {lines} lines, over 400: move detail into a guide in docs/");
    let history = history_lines(&readme);
    assert!(history.is_empty(), "README.md cites issues or files outside the repository:\n{}", history.join("\n"));
}

#[test]
fn surface_architecture_is_a_map_with_a_glossary() {
    let map = read("ARCHITECTURE.md");
    let lines = map.lines().count();
    assert!(lines <= 200, "ARCHITECTURE.md has {lines} lines, over 200");
    assert!(map.contains("## Glossary"), "ARCHITECTURE.md has no glossary");
    let history = history_lines(&map);
    assert!(
        history.is_empty(),
        "ARCHITECTURE.md cites issues or files outside the repository:\n{}",
        history.join("\n")
    );
}

#[test]
fn surface_every_guide_is_in_the_crate_docs() {
    let guide_rs = read("src/guide.rs");
    let mut guides: Vec<String> = std::fs::read_dir(root().join("docs"))
        .expect("read docs/")
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.ends_with(".md"))
        .collect();
    guides.sort();
    assert!(!guides.is_empty(), "docs/ holds no guide");
    let missing: Vec<&String> =
        guides.iter().filter(|g| !guide_rs.contains(&format!("include_str!(\"../docs/{g}\")"))).collect();
    assert!(
        missing.is_empty(),
        "guides not included by src/guide.rs (their code would not compile as doctests): {missing:?}"
    );
}

#[test]
fn surface_history_check_sees_issue_numbers() {
    assert_eq!(history_lines("fixed in #31\nsee ../shared/DESIGN.md\n&#8203; and C# 10\nkept").len(), 2);
}
