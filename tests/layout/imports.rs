//! The module layout of the library crates: inside every module directory of `fence/src` and
//! `adapters/src` (supervisor, postgres, sqs, redis, runtime, …), sibling modules import one
//! another one way only, so each file can be read after the files it uses and no two files must
//! be read together.
//!
//! The check reads the source text: a file of module `x` in directory `D` uses its sibling `y`
//! when it names `super::y` (from the right depth: `super::super::y` one directory further down),
//! `crate::<D>::y`, or `y` inside a `use super::{…}` / `use crate::<D>::{…}` group. Comment lines
//! are ignored. The crate roots (`adapters/src` itself, where `source` and `runtime` use each
//! other by design: the `Source` trait names the runtime's `ReceiveContext`) are not checked.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use brokerfence_testkit::tree::rust_files;

/// Sibling module → the sibling modules it uses.
type Graph = BTreeMap<String, BTreeSet<String>>;

/// The sources of a library crate of the workspace (`fence`, `adapters`).
fn crate_src(krate: &str) -> PathBuf {
    crate::workspace_root().join(krate).join("src")
}

/// Every module directory below the crate root (relative paths such as `sqs`, `redis/list`).
fn module_dirs(root: &Path) -> Vec<PathBuf> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
        let mut subdirs: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
            .map(|e| e.expect("directory entry").path())
            .filter(|p| p.is_dir())
            .collect();
        subdirs.sort();
        for sub in subdirs {
            out.push(sub.strip_prefix(root).expect("below the root").to_path_buf());
            walk(root, &sub, out);
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out
}

/// The files of directory `dir` (relative to `root`) by sibling module, each with how many
/// `super::` lead from it to `dir`: (module, depth, text).
fn siblings(root: &Path, dir: &Path) -> Vec<(String, usize, String)> {
    let files = rust_files(&root.join(dir));
    let mut out = Vec::new();
    for file in files {
        let rel = file.strip_prefix(root.join(dir)).expect("below the directory");
        let parts: Vec<String> = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
        let is_mod = parts.last().is_some_and(|p| p == "mod.rs");
        if parts.len() == 1 && is_mod {
            continue; // the directory's own module file: the parent, not a sibling
        }
        let module = parts[0].trim_end_matches(".rs").to_owned();
        let depth = parts.len() - usize::from(is_mod);
        let text = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
        out.push((module, depth, text));
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The first identifier of `s`.
fn ident(s: &str) -> &str {
    let end = s.find(|c: char| !is_ident(c)).unwrap_or(s.len());
    &s[..end]
}

/// The names a path reaches after `prefix` in `code`: `prefix::name` or each first segment of a
/// `prefix::{a, b::C, …}` group. A match preceded by `:` or an identifier character (a longer path,
/// such as `super::super::` when looking for `super::`) does not count.
fn names_after(code: &str, prefix: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut from = 0;
    while let Some(at) = code[from..].find(prefix) {
        let start = from + at;
        from = start + prefix.len();
        if code[..start].chars().next_back().is_some_and(|c| c == ':' || is_ident(c)) {
            continue;
        }
        let rest = &code[from..];
        if let Some(group) = rest.strip_prefix('{') {
            // Top-level items of the group, up to its closing brace.
            let mut depth = 0usize;
            let mut item_start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => item_start = true,
                    c if c.is_whitespace() => {}
                    _ if item_start && depth == 0 => {
                        names.insert(ident(&group[i..]).to_owned());
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            names.insert(ident(rest).to_owned());
        }
    }
    names
}

/// Which sibling modules each module of a directory uses. `files` are (module, depth, text) as
/// [`siblings`] gives them; `dir_path` is the directory's module path (`sqs`, `redis::list`).
fn import_graph(files: &[(String, usize, String)], dir_path: &str) -> Graph {
    let modules: BTreeSet<&str> = files.iter().map(|(m, _, _)| m.as_str()).collect();
    let mut graph = Graph::new();
    for (module, depth, text) in files {
        let code: String =
            text.lines().filter(|l| !l.trim_start().starts_with("//")).map(|l| format!("{l}\n")).collect();
        let mut used = names_after(&code, &"super::".repeat(*depth));
        used.extend(names_after(&code, &format!("crate::{dir_path}::")));
        let entry = graph.entry(module.clone()).or_default();
        for name in used {
            if name != *module && modules.contains(name.as_str()) {
                entry.insert(name);
            }
        }
    }
    graph
}

/// The import cycles of a graph: each set of two or more modules that all reach one another.
fn cycles(graph: &Graph) -> Vec<BTreeSet<String>> {
    let reach = |from: &str| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![from.to_owned()];
        while let Some(m) = todo.pop() {
            for next in graph.get(&m).into_iter().flatten() {
                if seen.insert(next.clone()) {
                    todo.push(next.clone());
                }
            }
        }
        seen
    };
    let reaches: BTreeMap<&String, BTreeSet<String>> = graph.keys().map(|m| (m, reach(m))).collect();
    let mut found: Vec<BTreeSet<String>> = Vec::new();
    for (m, r) in &reaches {
        let cycle: BTreeSet<String> = r
            .iter()
            .filter(|other| *other != *m && reaches.get(other).is_some_and(|back| back.contains(*m)))
            .cloned()
            .chain(std::iter::once((*m).clone()))
            .collect();
        if cycle.len() > 1 && !found.contains(&cycle) {
            found.push(cycle);
        }
    }
    found
}

/// The graph of one directory of a library crate (`sqs`, `redis/list` of `adapters`).
fn graph_of(krate: &str, dir: &str) -> Graph {
    let root = crate_src(krate);
    let files = siblings(&root, Path::new(dir));
    assert!(!files.is_empty(), "no modules found in {krate}/src/{dir}");
    import_graph(&files, &dir.replace('/', "::"))
}

/// The import cycles among the sibling modules of every module directory of `krate`, after
/// checking that the directories `expected` are among them.
fn cycles_of_crate(krate: &str, expected: &[&str]) -> Vec<String> {
    let root = crate_src(krate);
    let dirs = module_dirs(&root);
    for expected in expected {
        assert!(dirs.iter().any(|d| d == Path::new(expected)), "{krate}/src/{expected} not found: {dirs:?}");
    }
    let mut failures = Vec::new();
    for dir in &dirs {
        let dir = dir.to_string_lossy().replace('\\', "/");
        let graph = graph_of(krate, &dir);
        for cycle in cycles(&graph) {
            failures.push(format!("{krate}/src/{dir}: {cycle:?}"));
        }
    }
    failures
}

/// The SQS adapter's files: `receive` and `dead_letter` extend the source, and the source does not
/// import them back (their shared state lives in `state`).
#[test]
fn layout_sqs_receive_and_source_import_one_way() {
    let graph = graph_of("adapters", "sqs");
    let uses = |a: &str, b: &str| graph.get(a).is_some_and(|s| s.contains(b));
    // The check sees the imports that do exist: receive.rs and dead_letter.rs use source.rs.
    assert!(uses("receive", "source"), "receive.rs should use source.rs: {graph:?}");
    assert!(uses("dead_letter", "source"), "dead_letter.rs should use source.rs: {graph:?}");
    assert!(!uses("source", "receive"), "source.rs imports receive.rs: an import circle ({graph:?})");
    assert!(!uses("source", "dead_letter"), "source.rs imports dead_letter.rs: an import circle ({graph:?})");
    assert_eq!(cycles(&graph), Vec::<BTreeSet<String>>::new(), "import cycles among adapters/src/sqs: {graph:?}");
}

/// No two sibling modules of any directory of the adapters crate import each other, directly or
/// through others.
#[test]
fn layout_no_import_cycle_among_sibling_modules_of_adapters() {
    let failures = cycles_of_crate("adapters", &["sqs", "redis", "runtime"]);
    assert!(failures.is_empty(), "import cycles between sibling modules:\n{}", failures.join("\n"));
}

/// No two sibling modules of any directory of the fence crate import each other, directly or
/// through others.
#[test]
fn layout_no_import_cycle_among_sibling_modules_of_fence() {
    let failures = cycles_of_crate("fence", &["postgres", "sqlite", "supervisor", "admin"]);
    assert!(failures.is_empty(), "import cycles between sibling modules:\n{}", failures.join("\n"));
}

/// The check itself: it finds a planted cycle in every form of import it reads, and passes an
/// acyclic directory.
#[test]
fn layout_import_check_finds_planted_cycles() {
    let file = |m: &str, depth: usize, text: &str| (m.to_owned(), depth, text.to_owned());
    // super::x, and a group with a nested path.
    let direct = [
        file("a", 1, "use super::b::Thing;\n"),
        file("b", 1, "use super::{c::X, a::{Y, Z}};\n"),
        file("c", 1, "// use super::a; (a comment: not an import)\nfn f() {}\n"),
    ];
    let graph = import_graph(&direct, "sqs");
    assert_eq!(cycles(&graph), vec![BTreeSet::from(["a".to_owned(), "b".to_owned()])], "{graph:?}");
    // crate::<dir>:: paths, a directory module's child two levels down, and a longer circle.
    let indirect = [
        file("a", 1, "fn f() { crate::sqs::b::g(); }\n"),
        file("b", 2, "use super::super::c;\n"),
        file("c", 1, "use crate::sqs::{a};\n"),
    ];
    let graph = import_graph(&indirect, "sqs");
    assert_eq!(cycles(&graph), vec![BTreeSet::from(["a".to_owned(), "b".to_owned(), "c".to_owned()])], "{graph:?}");
    // One way only; `super::super::a` from depth 1 leaves the directory; `crate::other::a` is
    // another directory.
    let one_way = [file("a", 1, "use super::b;\n"), file("b", 1, "use super::super::a;\nuse crate::other::a::X;\n")];
    let graph = import_graph(&one_way, "sqs");
    assert!(cycles(&graph).is_empty(), "{graph:?}");
    assert!(graph["a"].contains("b") && graph["b"].is_empty(), "{graph:?}");
}
