//! Types, generics and signatures, rendered from one crate's rustdoc JSON.

use std::collections::BTreeMap;

use serde_json::Value;

use super::{Api, Loc};

/// Renders types, generics and signatures of one crate's JSON.
pub(super) struct Ty<'a> {
    pub(super) api: &'a Api,
    pub(super) krate: &'a str,
    /// Where every public item of the three crates can be named, once the walk is done. With
    /// it, types and traits are written in full (`brokerfence::…` for ours, the defining path
    /// for others, the bare name for the standard library's); without it, by name.
    pub(super) names: Option<&'a BTreeMap<Loc, Vec<String>>>,
}

impl Ty<'_> {
    pub(super) fn function(&self, path: &str, f: &Value) -> String {
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
                    "self" if t.starts_with('&') && t.ends_with(" Self") => format!("{}self", &t[..t.len() - 4]),
                    _ => format!("{name}: {t}"),
                }
            })
            .collect();
        let output = &f["sig"]["output"];
        let output = if output.is_null() { String::new() } else { format!(" -> {}", self.ty(output)) };
        let where_clause = self.where_clause(&f["generics"]);
        format!("{s}fn {path}{}({}){output}{where_clause}", self.generics(&f["generics"]), inputs.join(", "))
    }

    pub(super) fn generics(&self, g: &Value) -> String {
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

    pub(super) fn where_clause(&self, g: &Value) -> String {
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

    pub(super) fn bounds(&self, bounds: &Value) -> String {
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

    /// A path to a type or trait and its generic arguments: by name (the last segment of where
    /// it is defined), or in full when `names` is given.
    pub(super) fn path(&self, p: &Value) -> String {
        let written = p["path"].as_str().unwrap_or("?");
        let defined: Option<Vec<&str>> = self.api.crates[self.krate].json["paths"]
            .get(p["id"].to_string())
            .and_then(|d| d["path"].as_array())
            .map(|segments| segments.iter().filter_map(Value::as_str).collect());
        let name = defined
            .as_ref()
            .and_then(|segments| segments.last().copied())
            .unwrap_or_else(|| written.rsplit("::").next().unwrap_or(written));
        let name = match (self.names, &defined) {
            (Some(names), Some(segments)) => match self.api.resolve(self.krate, &p["id"]) {
                Ok(loc) => {
                    names.get(&loc).and_then(|paths| paths.first()).cloned().unwrap_or_else(|| segments.join("::"))
                }
                Err(_) if ["core", "alloc", "std"].contains(&segments[0]) => name.to_owned(),
                Err(outside) => outside,
            },
            _ => name.to_owned(),
        };
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

    pub(super) fn ty(&self, t: &Value) -> String {
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
