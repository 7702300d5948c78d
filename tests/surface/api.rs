//! The public API of `brokerfence`, rendered from rustdoc's JSON and compared with
//! `tests/surface/public-api.txt`: every path a user can name, its kind, and the signature of
//! every function and method (trait impls by name). A change to the surface changes the listing,
//! so it shows in review. Re-bless after an intended change:
//! `BROKERFENCE_BLESS=1 cargo test --workspace --all-features surface`.
//!
//! rustdoc's JSON output needs `-Z unstable-options`; the stable toolchain accepts it with
//! `RUSTC_BOOTSTRAP=1`. That variable is given to rustdoc only (through a small wrapper in the
//! target directory): proc-macro2's build script reads it, so set for the whole build it would
//! rebuild every proc macro and their dependents here and again at the next ordinary build.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

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
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut cmd = Command::new(cargo);
    // What cargo set for this test process describes the test, not a build: left in, build
    // scripts that watch some of these names would run again (see testkit/src/programs.rs).
    for (key, _) in std::env::vars_os() {
        let Some(key) = key.to_str() else { continue };
        let set_by_cargo = ["CARGO_PKG_", "CARGO_MANIFEST_", "CARGO_BIN_EXE_"].iter().any(|p| key.starts_with(p))
            || ["CARGO_CRATE_NAME", "CARGO_BIN_NAME", "CARGO_PRIMARY_PACKAGE", "CARGO_TARGET_TMPDIR", "OUT_DIR"]
                .contains(&key);
        if set_by_cargo {
            cmd.env_remove(key);
        }
    }
    if let Ok(rustdoc) = std::env::var("RUSTDOC") {
        cmd.env("SURFACE_RUSTDOC", rustdoc);
    }
    cmd.current_dir(root)
        .env("RUSTDOC", &wrapper)
        .env("RUSTDOCFLAGS", "-Z unstable-options --output-format json")
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
        let mut out = Walk { api: self, lines: BTreeSet::new(), seen: BTreeMap::new() };
        let root = self.crates["brokerfence"].json["root"].to_string();
        out.module(&("brokerfence".to_owned(), root), "brokerfence");
        let twice = out.seen.iter().filter(|(_, paths)| paths.len() > 1).map(|(_, paths)| paths.join(" = ")).collect();
        (out.lines.into_iter().collect(), twice)
    }
}

struct Walk<'a> {
    api: &'a Api,
    lines: BTreeSet<String>,
    seen: BTreeMap<Loc, Vec<String>>,
}

impl Walk<'_> {
    fn module(&mut self, loc: &Loc, prefix: &str) {
        let module = self.api.item(loc);
        for id in module["inner"]["module"]["items"].as_array().into_iter().flatten() {
            let child = (loc.0.clone(), id.to_string());
            let item = self.api.item(&child);
            if let Some(u) = item["inner"].get("use") {
                let name = u["name"].as_str().unwrap_or("?");
                match self.api.resolve(&loc.0, &u["id"]) {
                    Ok(target) if u["is_glob"] == true => self.module(&target, prefix),
                    Ok(target) => self.item(&target, &format!("{prefix}::{name}")),
                    Err(outside) => {
                        self.lines.insert(format!("pub use {prefix}::{name} = {outside}"));
                    }
                }
            } else if let Some(name) = item["name"].as_str() {
                self.item(&child, &format!("{prefix}::{name}"));
            }
        }
    }

    fn item(&mut self, loc: &Loc, path: &str) {
        self.seen.entry(loc.clone()).or_default().push(path.to_owned());
        let item = self.api.item(loc);
        let ty = Ty { api: self.api, krate: &loc.0 };
        let non_exhaustive = if item["attrs"].as_array().into_iter().flatten().any(|a| a == "non_exhaustive") {
            "#[non_exhaustive] "
        } else {
            ""
        };
        let (kind, inner) = item["inner"].as_object().and_then(|o| o.iter().next()).expect("an item kind");
        match kind.as_str() {
            "module" => {
                self.lines.insert(format!("pub mod {path}"));
                self.module(loc, path);
            }
            "struct" => {
                let generics = ty.generics(&inner["generics"]);
                self.lines.insert(format!("{non_exhaustive}pub struct {path}{generics}"));
                let kind = &inner["kind"];
                let fields = kind["plain"]["fields"].as_array().or_else(|| kind["tuple"].as_array());
                for (i, f) in fields.into_iter().flatten().enumerate() {
                    if f.is_null() {
                        continue;
                    }
                    let field = self.api.item(&(loc.0.clone(), f.to_string()));
                    let name = field["name"].as_str().map_or_else(|| i.to_string(), str::to_owned);
                    self.lines.insert(format!("pub {path}::{name}: {}", ty.ty(&field["inner"]["struct_field"])));
                }
                self.impls(loc, inner, path);
            }
            "enum" => {
                let generics = ty.generics(&inner["generics"]);
                self.lines.insert(format!("{non_exhaustive}pub enum {path}{generics}"));
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
                    self.lines.insert(format!("{variant_ne}pub {path}::{name}{shape}"));
                }
                self.impls(loc, inner, path);
            }
            "trait" => {
                let generics = ty.generics(&inner["generics"]);
                let bounds = ty.bounds(&inner["bounds"]);
                let bounds = if bounds.is_empty() { String::new() } else { format!(": {bounds}") };
                self.lines.insert(format!("pub trait {path}{generics}{bounds}"));
                for m in inner["items"].as_array().into_iter().flatten() {
                    let member = self.api.item(&(loc.0.clone(), m.to_string()));
                    self.member(&ty, member, path);
                }
            }
            "function" => {
                self.lines.insert(format!("pub {}", ty.function(path, inner)));
            }
            "constant" => {
                self.lines.insert(format!("pub const {path}: {}", ty.ty(&inner["type"])));
            }
            "static" => {
                self.lines.insert(format!("pub static {path}: {}", ty.ty(&inner["type"])));
            }
            "type_alias" => {
                let generics = ty.generics(&inner["generics"]);
                self.lines.insert(format!("pub type {path}{generics} = {}", ty.ty(&inner["type"])));
            }
            "macro" | "proc_macro" => {
                self.lines.insert(format!("pub macro {path}!"));
            }
            other => {
                self.lines.insert(format!("pub {other} {path}"));
            }
        }
    }

    /// Inherent methods and constants in full; trait impls by name; auto-trait and blanket impls
    /// left out.
    fn impls(&mut self, loc: &Loc, inner: &Value, path: &str) {
        let ty = Ty { api: self.api, krate: &loc.0 };
        for id in inner["impls"].as_array().into_iter().flatten() {
            let imp = &self.api.item(&(loc.0.clone(), id.to_string()))["inner"]["impl"];
            if imp["is_synthetic"] == true || !imp["blanket_impl"].is_null() {
                continue;
            }
            if imp["trait"].is_null() {
                for m in imp["items"].as_array().into_iter().flatten() {
                    let member = self.api.item(&(loc.0.clone(), m.to_string()));
                    if member["visibility"] == "public" {
                        self.member(&ty, member, path);
                    }
                }
            } else {
                let neg = if imp["is_negative"] == true { "!" } else { "" };
                self.lines.insert(format!("impl {neg}{} for {path}", ty.path(&imp["trait"])));
            }
        }
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
        self.lines.insert(line);
    }
}

/// Renders types, generics and signatures of one crate's JSON.
struct Ty<'a> {
    api: &'a Api,
    krate: &'a str,
}

impl Ty<'_> {
    fn function(&self, path: &str, f: &Value) -> String {
        let header = &f["header"];
        let mut s = String::new();
        for (flag, word) in [("is_const", "const "), ("is_async", "async "), ("is_unsafe", "unsafe ")] {
            if header[flag] == true {
                s.push_str(word);
            }
        }
        let inputs: Vec<String> = f["sig"]["inputs"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|pair| {
                let name = pair[0].as_str().unwrap_or("_");
                let t = self.ty(&pair[1]);
                match name {
                    "self" if t == "Self" => "self".to_owned(),
                    "self" if t == "&Self" => "&self".to_owned(),
                    "self" if t == "&mut Self" => "&mut self".to_owned(),
                    _ => format!("{name}: {t}"),
                }
            })
            .collect();
        let output = &f["sig"]["output"];
        let output = if output.is_null() { String::new() } else { format!(" -> {}", self.ty(output)) };
        let where_clause = self.where_clause(&f["generics"]);
        format!("{s}fn {path}{}({}){output}{where_clause}", self.generics(&f["generics"]), inputs.join(", "))
    }

    fn generics(&self, g: &Value) -> String {
        let params: Vec<String> = g["params"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|p| p["kind"]["type"]["is_synthetic"] != true)
            .map(|p| {
                let name = p["name"].as_str().unwrap_or("?").to_owned();
                let kind = &p["kind"];
                if let Some(t) = kind.get("type") {
                    let bounds = self.bounds(&t["bounds"]);
                    let default =
                        if t["default"].is_null() { String::new() } else { format!(" = {}", self.ty(&t["default"])) };
                    if bounds.is_empty() { format!("{name}{default}") } else { format!("{name}: {bounds}{default}") }
                } else if let Some(c) = kind.get("const") {
                    format!("const {name}: {}", self.ty(&c["type"]))
                } else {
                    name
                }
            })
            .collect();
        if params.is_empty() { String::new() } else { format!("<{}>", params.join(", ")) }
    }

    fn where_clause(&self, g: &Value) -> String {
        let preds: Vec<String> = g["where_predicates"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| {
                if let Some(b) = p.get("bound_predicate") {
                    format!("{}: {}", self.ty(&b["type"]), self.bounds(&b["bounds"]))
                } else if let Some(l) = p.get("lifetime_predicate") {
                    format!("{}: {}", l["lifetime"].as_str().unwrap_or("?"), l["outlives"])
                } else {
                    p.to_string()
                }
            })
            .collect();
        if preds.is_empty() { String::new() } else { format!(" where {}", preds.join(", ")) }
    }

    fn bounds(&self, bounds: &Value) -> String {
        let parts: Vec<String> = bounds
            .as_array()
            .into_iter()
            .flatten()
            .map(|b| {
                if let Some(t) = b.get("trait_bound") {
                    let modifier = if t["modifier"] == "maybe" { "?" } else { "" };
                    format!("{modifier}{}", self.path(&t["trait"]))
                } else if let Some(l) = b.get("outlives") {
                    l.as_str().unwrap_or("?").to_owned()
                } else {
                    b.to_string()
                }
            })
            .collect();
        parts.join(" + ")
    }

    /// A path to a type or trait: its name (the last segment of where it is defined) and its
    /// generic arguments.
    fn path(&self, p: &Value) -> String {
        let written = p["path"].as_str().unwrap_or("?");
        let name = self.api.crates[self.krate].json["paths"]
            .get(p["id"].to_string())
            .and_then(|d| d["path"].as_array())
            .and_then(|segments| segments.last())
            .and_then(Value::as_str)
            .unwrap_or_else(|| written.rsplit("::").next().unwrap_or(written));
        format!("{name}{}", self.args(&p["args"]))
    }

    fn args(&self, args: &Value) -> String {
        if args.is_null() {
            return String::new();
        }
        if let Some(a) = args.get("angle_bracketed") {
            let mut parts: Vec<String> = a["args"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|arg| {
                    if let Some(t) = arg.get("type") {
                        self.ty(t)
                    } else if let Some(l) = arg.get("lifetime") {
                        l.as_str().unwrap_or("?").to_owned()
                    } else if let Some(c) = arg.get("const") {
                        c["expr"].as_str().unwrap_or("?").to_owned()
                    } else {
                        "_".to_owned()
                    }
                })
                .collect();
            for c in a["constraints"].as_array().into_iter().flatten() {
                let name = c["name"].as_str().unwrap_or("?");
                if let Some(t) = c["binding"].get("equality").and_then(|e| e.get("type")) {
                    parts.push(format!("{name} = {}", self.ty(t)));
                } else if let Some(b) = c["binding"].get("constraint") {
                    parts.push(format!("{name}: {}", self.bounds(b)));
                }
            }
            if parts.is_empty() { String::new() } else { format!("<{}>", parts.join(", ")) }
        } else if let Some(p) = args.get("parenthesized") {
            let inputs: Vec<String> = p["inputs"].as_array().into_iter().flatten().map(|t| self.ty(t)).collect();
            let output = if p["output"].is_null() { String::new() } else { format!(" -> {}", self.ty(&p["output"])) };
            format!("({}){output}", inputs.join(", "))
        } else {
            "(..)".to_owned()
        }
    }

    fn ty(&self, t: &Value) -> String {
        let Some((kind, v)) = t.as_object().and_then(|o| o.iter().next()) else {
            return t.as_str().unwrap_or("_").to_owned();
        };
        match kind.as_str() {
            "resolved_path" => self.path(v),
            "dyn_trait" => {
                let traits: Vec<String> =
                    v["traits"].as_array().into_iter().flatten().map(|p| self.path(&p["trait"])).collect();
                let lifetime = v["lifetime"].as_str().map(|l| format!(" + {l}")).unwrap_or_default();
                format!("dyn {}{lifetime}", traits.join(" + "))
            }
            "generic" | "primitive" => v.as_str().unwrap_or("?").to_owned(),
            "tuple" => {
                let parts: Vec<String> = v.as_array().into_iter().flatten().map(|t| self.ty(t)).collect();
                format!("({})", parts.join(", "))
            }
            "slice" => format!("[{}]", self.ty(v)),
            "array" => format!("[{}; {}]", self.ty(&v["type"]), v["len"].as_str().unwrap_or("?")),
            "impl_trait" => format!("impl {}", self.bounds(v)),
            "infer" => "_".to_owned(),
            "raw_pointer" => {
                format!("*{} {}", if v["is_mutable"] == true { "mut" } else { "const" }, self.ty(&v["type"]))
            }
            "borrowed_ref" => {
                let lifetime = v["lifetime"].as_str().map(|l| format!("{l} ")).unwrap_or_default();
                let mutable = if v["is_mutable"] == true { "mut " } else { "" };
                format!("&{lifetime}{mutable}{}", self.ty(&v["type"]))
            }
            "qualified_path" => {
                let name = v["name"].as_str().unwrap_or("?");
                let self_ty = self.ty(&v["self_type"]);
                if v["trait"].is_null() {
                    format!("{self_ty}::{name}")
                } else {
                    format!("<{self_ty} as {}>::{name}", self.path(&v["trait"]))
                }
            }
            "function_pointer" => {
                let inputs: Vec<String> =
                    v["sig"]["inputs"].as_array().into_iter().flatten().map(|pair| self.ty(&pair[1])).collect();
                let output = if v["sig"]["output"].is_null() {
                    String::new()
                } else {
                    format!(" -> {}", self.ty(&v["sig"]["output"]))
                };
                format!("fn({}){output}", inputs.join(", "))
            }
            other => format!("<{other}>"),
        }
    }
}
