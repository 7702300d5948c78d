//! The public API of `brokerfence`, rendered from rustdoc's JSON and compared with
//! `tests/surface/public-api.txt`: every path a user can name, its kind, and the signature of
//! every function and method, and every trait impl under the type it is for, types and traits
//! written in full. Items under `#[doc(hidden)]` are listed too, marked so: absent from the docs,
//! yet a user can name them. A change to the surface changes the listing, so it shows in review.
//! Re-bless after an intended change:
//! `BROKERFENCE_BLESS=1 cargo test --workspace --all-features surface`.
//!
//! rustdoc's JSON output needs `-Z unstable-options`; the stable toolchain accepts it with
//! `RUSTC_BOOTSTRAP=1`. That variable is given to rustdoc only (through a small wrapper in the
//! target directory): proc-macro2's build script reads it, so set for the whole build it would
//! rebuild every proc macro and their dependents here and again at the next ordinary build.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use serde_json::Value;

mod ty;
use ty::Ty;

const LISTING: &str = "tests/surface/public-api.txt";
/// The crates whose items `brokerfence` re-exports (their JSON is read too).
const CRATES: [&str; 3] = ["brokerfence", "brokerfence_fence", "brokerfence_adapters"];

#[test]
fn surface_public_api_matches_the_listing() {
    // The workspace's root: this test's package is `tests/`.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ lies in the workspace");
    let doc_dir = rustdoc_json(root);
    let api = Api::load(&doc_dir);
    let (lines, twice) = api.render();
    assert!(twice.is_empty(), "items reachable at more than one public path (keep one):\n{}", twice.join("\n"));
    let rendered = lines.join("\n") + "\n";
    let listing = root.join(LISTING);
    if std::env::var_os("BROKERFENCE_BLESS").is_some() {
        std::fs::write(&listing, &rendered).unwrap_or_else(|e| panic!("cannot write {}: {e}", listing.display()));
        return;
    }
    let expected = std::fs::read_to_string(&listing).unwrap_or_default();
    if expected != rendered {
        let old: BTreeSet<&str> = expected.lines().collect();
        let new: BTreeSet<&str> = rendered.lines().collect();
        let mut diff = String::new();
        for line in old.difference(&new) {
            diff.push_str(&format!("- {line}\n"));
        }
        for line in new.difference(&old) {
            diff.push_str(&format!("+ {line}\n"));
        }
        panic!(
            "the public API differs from {LISTING} (- listed, + now):\n{diff}\nIf the change is intended, re-bless: \
             BROKERFENCE_BLESS=1 cargo test --workspace --all-features surface"
        );
    }
}

/// Runs `cargo doc` with JSON output and returns the directory of the JSON files.
///
/// The build shares the dependencies' check builds of `cargo clippy --workspace --all-targets
/// --all-features` (CI runs it first), so it compiles none of them: the same target directory
/// and profile (from the test binary's path), the whole workspace with every feature, and one
/// example, whose dev-dependencies make cargo resolve features as for `--all-targets` (a
/// library-only `cargo doc` resolves them without dev-dependencies, and then about 60
/// dependencies, aws-sdk-sqs and sqlx among them, would be checked again with other features).
fn rustdoc_json(root: &Path) -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    // <target>/<profile>/deps/<test binary>
    let target_dir = exe.ancestors().nth(3).expect("the test binary lies in <target>/<profile>/deps").to_path_buf();
    let wrapper = target_dir.join("surface-rustdoc");
    let script = "#!/bin/sh\nRUSTC_BOOTSTRAP=1 exec \"${SURFACE_RUSTDOC:-rustdoc}\" \"$@\"\n";
    if std::fs::read_to_string(&wrapper).ok().as_deref() != Some(script) {
        std::fs::write(&wrapper, script).expect("write the rustdoc wrapper");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).expect("chmod the wrapper");
    }
    // Without the variables cargo set for this test process (see `programs::cargo`).
    let mut cmd = brokerfence_testkit::programs::cargo();
    if let Ok(rustdoc) = std::env::var("RUSTDOC") {
        cmd.env("SURFACE_RUSTDOC", rustdoc);
    }
    cmd.current_dir(root)
        .env("RUSTDOC", &wrapper)
        .env("RUSTDOCFLAGS", "-Z unstable-options --output-format json --document-hidden-items")
        .args(["doc", "--workspace", "--lib", "--example", "zombie", "--no-deps", "--all-features", "--target-dir"])
        .arg(&target_dir);
    let shown = format!("{cmd:?}");
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {shown}: {e}"));
    assert!(out.status.success(), "{shown} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    target_dir.join("doc")
}

/// One crate's rustdoc JSON.
struct Krate {
    json: Value,
    /// Defining path → item id, for the items of this crate.
    by_path: HashMap<Vec<String>, String>,
}

struct Api {
    crates: BTreeMap<String, Krate>,
}

/// Where an item lives: the crate and its id there.
type Loc = (String, String);

impl Api {
    fn load(dir: &Path) -> Self {
        let mut crates = BTreeMap::new();
        for name in CRATES {
            let path = dir.join(format!("{name}.json"));
            let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
            let json: Value = serde_json::from_str(&text).expect("rustdoc JSON");
            let mut by_path = HashMap::new();
            for (id, p) in json["paths"].as_object().expect("paths") {
                if p["crate_id"] == 0 {
                    let path = p["path"].as_array().expect("path").iter().map(|s| s.as_str().unwrap_or("").to_owned());
                    by_path.insert(path.collect(), id.clone());
                }
            }
            crates.insert(name.to_owned(), Krate { json, by_path });
        }
        Self { crates }
    }

    fn item(&self, loc: &Loc) -> &Value {
        &self.crates[&loc.0].json["index"][&loc.1]
    }

    /// The item `id` of crate `krate` points at: local, in another of the three crates, or
    /// outside them (`Err` with its path).
    fn resolve(&self, krate: &str, id: &Value) -> Result<Loc, String> {
        let id = id.as_u64().map(|n| n.to_string()).ok_or("no id")?;
        let json = &self.crates[krate].json;
        if json["index"].get(&id).is_some() {
            return Ok((krate.to_owned(), id));
        }
        let p = &json["paths"][&id];
        let path: Vec<String> =
            p["path"].as_array().ok_or("unknown id")?.iter().map(|s| s.as_str().unwrap_or("").to_owned()).collect();
        let crate_name = json["external_crates"][p["crate_id"].to_string()]["name"].as_str().unwrap_or("?");
        match self.crates.get(crate_name).and_then(|k| k.by_path.get(&path)) {
            Some(id) => Ok((crate_name.to_owned(), id.clone())),
            None => Err(path.join("::")),
        }
    }

    /// The listing, and the items reachable at more than one path.
    fn render(&self) -> (Vec<String>, Vec<String>) {
        let mut out =
            Walk { api: self, lines: BTreeSet::new(), seen: BTreeMap::new(), impls: BTreeSet::new(), hidden: false };
        let root = self.crates["brokerfence"].json["root"].to_string();
        out.module(&("brokerfence".to_owned(), root), "brokerfence");
        for imp in std::mem::take(&mut out.impls) {
            if let Some(line) = out.trait_impl(&imp) {
                out.lines.insert(line);
            }
        }
        let twice = out.seen.iter().filter(|(_, paths)| paths.len() > 1).map(|(_, paths)| paths.join(" = ")).collect();
        (out.lines.into_iter().collect(), twice)
    }
}

/// Whether an item carries `#[doc(hidden)]`: absent from the rendered docs, yet callable.
fn is_hidden(item: &Value) -> bool {
    item["attrs"].as_array().into_iter().flatten().any(|a| a["other"] == "#[doc(hidden)]")
}

struct Walk<'a> {
    api: &'a Api,
    lines: BTreeSet<String>,
    seen: BTreeMap<Loc, Vec<String>>,
    /// Trait impls met on the way, rendered once each after the walk (under their real type).
    impls: BTreeSet<Loc>,
    /// Inside a `#[doc(hidden)]` item or re-export: every line is marked.
    hidden: bool,
}

impl Walk<'_> {
    /// Adds a line, marked `#[doc(hidden)]` when it or an item around it is hidden.
    fn push(&mut self, hidden: bool, line: String) {
        let mark = if hidden || self.hidden { "#[doc(hidden)] " } else { "" };
        self.lines.insert(format!("{mark}{line}"));
    }

    fn module(&mut self, loc: &Loc, prefix: &str) {
        let module = self.api.item(loc);
        for id in module["inner"]["module"]["items"].as_array().into_iter().flatten() {
            let child = (loc.0.clone(), id.to_string());
            let item = self.api.item(&child);
            let outer = self.hidden;
            self.hidden |= is_hidden(item);
            if let Some(u) = item["inner"].get("use") {
                let name = u["name"].as_str().unwrap_or("?");
                match self.api.resolve(&loc.0, &u["id"]) {
                    Ok(target) if u["is_glob"] == true => self.module(&target, prefix),
                    Ok(target) => self.item(&target, &format!("{prefix}::{name}")),
                    Err(outside) => self.push(false, format!("pub use {prefix}::{name} = {outside}")),
                }
            } else if let Some(name) = item["name"].as_str() {
                self.item(&child, &format!("{prefix}::{name}"));
            }
            self.hidden = outer;
        }
    }

    fn item(&mut self, loc: &Loc, path: &str) {
        self.seen.entry(loc.clone()).or_default().push(path.to_owned());
        let item = self.api.item(loc);
        let outer = self.hidden;
        self.hidden |= is_hidden(item);
        self.item_lines(loc, item, path);
        self.hidden = outer;
    }

    fn item_lines(&mut self, loc: &Loc, item: &Value, path: &str) {
        let ty = Ty { api: self.api, krate: &loc.0, names: None };
        let non_exhaustive = if item["attrs"].as_array().into_iter().flatten().any(|a| a == "non_exhaustive") {
            "#[non_exhaustive] "
        } else {
            ""
        };
        let (kind, inner) = item["inner"].as_object().and_then(|o| o.iter().next()).expect("an item kind");
        match kind.as_str() {
            "module" => {
                self.push(false, format!("pub mod {path}"));
                self.module(loc, path);
            }
            "struct" => {
                let generics = ty.generics(&inner["generics"]);
                self.push(false, format!("{non_exhaustive}pub struct {path}{generics}"));
                let kind = &inner["kind"];
                let fields = kind["plain"]["fields"].as_array().or_else(|| kind["tuple"].as_array());
                for (i, f) in fields.into_iter().flatten().enumerate() {
                    if f.is_null() {
                        continue;
                    }
                    let field = self.api.item(&(loc.0.clone(), f.to_string()));
                    let name = field["name"].as_str().map_or_else(|| i.to_string(), str::to_owned);
                    self.push(
                        is_hidden(field),
                        format!("pub {path}::{name}: {}", ty.ty(&field["inner"]["struct_field"])),
                    );
                }
                self.impls(loc, inner, path);
            }
            "enum" => {
                let generics = ty.generics(&inner["generics"]);
                self.push(false, format!("{non_exhaustive}pub enum {path}{generics}"));
                for v in inner["variants"].as_array().into_iter().flatten() {
                    let variant = self.api.item(&(loc.0.clone(), v.to_string()));
                    let name = variant["name"].as_str().unwrap_or("?");
                    let kind = &variant["inner"]["variant"]["kind"];
                    let field = |id: &Value| self.api.item(&(loc.0.clone(), id.to_string())).clone();
                    let shape = if let Some(fields) = kind["tuple"].as_array() {
                        let tys: Vec<String> =
                            fields
                                .iter()
                                .map(|f| {
                                    if f.is_null() { "_".to_owned() } else { ty.ty(&field(f)["inner"]["struct_field"]) }
                                })
                                .collect();
                        format!("({})", tys.join(", "))
                    } else if let Some(fields) = kind["struct"]["fields"].as_array() {
                        let tys: Vec<String> = fields
                            .iter()
                            .map(|f| {
                                let f = field(f);
                                format!("{}: {}", f["name"].as_str().unwrap_or("?"), ty.ty(&f["inner"]["struct_field"]))
                            })
                            .collect();
                        let more = if kind["struct"]["has_stripped_fields"] == true { ", .." } else { "" };
                        format!(" {{ {}{more} }}", tys.join(", "))
                    } else {
                        String::new()
                    };
                    let variant_ne = if variant["attrs"].as_array().into_iter().flatten().any(|a| a == "non_exhaustive")
                    {
                        "#[non_exhaustive] "
                    } else {
                        ""
                    };
                    self.push(is_hidden(variant), format!("{variant_ne}pub {path}::{name}{shape}"));
                }
                self.impls(loc, inner, path);
            }
            "trait" => {
                let generics = ty.generics(&inner["generics"]);
                let bounds = ty.bounds(&inner["bounds"]);
                let bounds = if bounds.is_empty() { String::new() } else { format!(": {bounds}") };
                self.push(false, format!("pub trait {path}{generics}{bounds}"));
                for m in inner["items"].as_array().into_iter().flatten() {
                    let member = self.api.item(&(loc.0.clone(), m.to_string()));
                    self.member(&ty, member, path);
                }
                for id in inner["implementations"].as_array().into_iter().flatten() {
                    self.trait_impl_met(&(loc.0.clone(), id.to_string()));
                }
            }
            "function" => {
                self.push(false, format!("pub {}", ty.function(path, inner)));
            }
            "constant" => {
                self.push(false, format!("pub const {path}: {}", ty.ty(&inner["type"])));
            }
            "static" => {
                self.push(false, format!("pub static {path}: {}", ty.ty(&inner["type"])));
            }
            "type_alias" => {
                let generics = ty.generics(&inner["generics"]);
                self.push(false, format!("pub type {path}{generics} = {}", ty.ty(&inner["type"])));
            }
            "macro" | "proc_macro" => {
                self.push(false, format!("pub macro {path}!"));
            }
            other => {
                self.push(false, format!("pub {other} {path}"));
            }
        }
    }

    /// Inherent methods and constants in full; trait impls kept for [`Walk::trait_impl`].
    /// rustdoc lists under a type the impls that name it anywhere (`From<&Lease>` for another
    /// type under `Lease`): inherent members count only under the impl's own `for` type.
    fn impls(&mut self, loc: &Loc, inner: &Value, path: &str) {
        let ty = Ty { api: self.api, krate: &loc.0, names: None };
        for id in inner["impls"].as_array().into_iter().flatten() {
            let imp_loc = (loc.0.clone(), id.to_string());
            let imp = &self.api.item(&imp_loc)["inner"]["impl"];
            if !imp["trait"].is_null() {
                self.trait_impl_met(&imp_loc);
                continue;
            }
            if self.api.resolve(&loc.0, &imp["for"]["resolved_path"]["id"]).as_ref() != Ok(loc) {
                continue;
            }
            for m in imp["items"].as_array().into_iter().flatten() {
                let member = self.api.item(&(loc.0.clone(), m.to_string()));
                if member["visibility"] == "public" {
                    self.member(&ty, member, path);
                }
            }
        }
    }

    /// Keeps a trait impl for the listing; auto-trait and blanket impls are left out, and so are
    /// the hidden ones a derive adds (`TrivialClone` beside `Clone`: a trait no user can name).
    fn trait_impl_met(&mut self, loc: &Loc) {
        let item = self.api.item(loc);
        let imp = &item["inner"]["impl"];
        let derived = item["attrs"].as_array().into_iter().flatten().any(|a| a == "automatically_derived");
        if imp["is_synthetic"] != true && imp["blanket_impl"].is_null() && !(derived && is_hidden(item)) {
            self.impls.insert(loc.clone());
        }
    }

    /// `impl<…> Trait<…> for Type where …`, every type and trait in full; `None` when the impl is
    /// for a type of ours that no public path names.
    fn trait_impl(&self, loc: &Loc) -> Option<String> {
        let item = self.api.item(loc);
        let imp = &item["inner"]["impl"];
        let for_id = &imp["for"]["resolved_path"]["id"];
        if let Ok(target) = self.api.resolve(&loc.0, for_id)
            && !self.seen.contains_key(&target)
        {
            return None;
        }
        let ty = Ty { api: self.api, krate: &loc.0, names: Some(&self.seen) };
        let neg = if imp["is_negative"] == true { "!" } else { "" };
        let mark = if is_hidden(item) { "#[doc(hidden)] " } else { "" };
        Some(format!(
            "{mark}impl{} {neg}{} for {}{}",
            ty.generics(&imp["generics"]),
            ty.path(&imp["trait"]),
            ty.ty(&imp["for"]),
            ty.where_clause(&imp["generics"])
        ))
    }

    fn member(&mut self, ty: &Ty, member: &Value, path: &str) {
        let name = member["name"].as_str().unwrap_or("?");
        let full = format!("{path}::{name}");
        let inner = &member["inner"];
        let line = if let Some(f) = inner.get("function") {
            format!("pub {}", ty.function(&full, f))
        } else if let Some(c) = inner.get("assoc_const") {
            format!("pub const {full}: {}", ty.ty(&c["type"]))
        } else if let Some(t) = inner.get("assoc_type") {
            let bounds = ty.bounds(&t["bounds"]);
            if bounds.is_empty() { format!("pub type {full}") } else { format!("pub type {full}: {bounds}") }
        } else {
            format!("pub {full}")
        };
        self.push(is_hidden(member), line);
    }
}
