//! Tidy checks of the store's seams: no rusqlite/refinery type in a public
//! signature (outside the harness crates), and no import cycle between the
//! modules of `crates/store/src`. Textual on purpose: cheap, no parser
//! dependency, and strict enough for code written in this repository's style.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Crates whose public items may mention rusqlite/refinery (test harnesses).
const HARNESSES: &[&str] = &["testkit", "bench", "torture", "interop"];

/// The SQL crates no public signature may name.
const SQL_PATHS: &[&str] = &["rusqlite::", "refinery::", "postgres::", "refinery_pg::"];

/// Runs both checks.
pub(crate) fn check(root: &Path, problems: &mut Vec<String>) {
    check_public_sql_types(root, problems);
    check_store_cycles(root, problems);
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    let mut entries: Vec<_> = entries.flatten().map(|e| e.path()).collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rs_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Library code: before an inline `#[cfg(test)] mod … {`, comment lines blanked.
fn code_of(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let end = lines
        .windows(2)
        .position(|w| {
            w[0].trim() == "#[cfg(test)]"
                && w[1].trim_start().starts_with("mod ")
                && w[1].trim_end().ends_with('{')
        })
        .unwrap_or(lines.len());
    lines[..end]
        .iter()
        .map(|l| {
            let t = l.trim_start();
            if t.starts_with("//") { "" } else { l.split(" //").next().unwrap_or("") }
        })
        .collect::<Vec<_>>()
        .join("\n")
}

// ---------------------------------------------------------------------------
// (a) rusqlite/refinery types in public signatures

fn check_public_sql_types(root: &Path, problems: &mut Vec<String>) {
    let Ok(entries) = fs::read_dir(root.join("crates")) else { return };
    let mut crates: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    crates.sort();
    for dir in crates {
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if HARNESSES.contains(&name.as_str()) {
            continue;
        }
        let mut files = Vec::new();
        rs_files(&dir.join("src"), &mut files);
        let texts: Vec<(PathBuf, String)> = files
            .into_iter()
            .filter(|p| p.file_name().is_none_or(|n| n != "tests.rs"))
            .filter_map(|p| fs::read_to_string(&p).ok().map(|t| (p, code_of(&t))))
            .collect();
        let all: String = texts.iter().map(|(_, t)| t.as_str()).collect::<Vec<_>>().join("\n");
        for (path, code) in &texts {
            let rel = path.strip_prefix(root).unwrap_or(path).display().to_string();
            for (line, what) in public_sql_mentions(code, &all) {
                problems.push(format!("{rel}:{line}: {what} in a public signature"));
            }
        }
    }
}

/// Names a file imports from rusqlite/refinery (`use rusqlite::{Row, Connection}`).
fn imported_sql_names(code: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for stmt in use_statements(code) {
        if let Some(rest) = SQL_PATHS.iter().find_map(|p| stmt.strip_prefix(p)) {
            for path in expand_use(rest) {
                let last = path.rsplit("::").next().unwrap_or("");
                let last = last.split(" as ").last().unwrap_or(last).trim();
                if !last.is_empty() && last != "self" && last != "*" {
                    names.insert(last.to_owned());
                }
            }
        }
    }
    names
}

fn has_word(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + word.len()..].chars().next();
        let ident = |c: Option<char>| c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        !ident(before) && !ident(after) && !text[..at].ends_with("::")
    })
}

/// `(line, offending text)` for every `pub` item (not `pub(crate)`/`pub(super)`)
/// or public trait impl whose signature names a rusqlite/refinery type.
/// `all` is the crate's whole code, to tell whether an impl's type is public.
fn public_sql_mentions(code: &str, all: &str) -> Vec<(usize, String)> {
    let imported = imported_sql_names(code);
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let t = line.trim_start();
        let is_pub = t.starts_with("pub ") && !t.starts_with("pub use ");
        let is_impl = t.starts_with("impl");
        if !is_pub && !is_impl {
            continue;
        }
        // The signature: up to the first `{` or `;` (a few lines at most).
        let mut sig = String::new();
        for l in lines.iter().skip(i).take(12) {
            let cut = l.find(['{', ';']).map_or(*l, |at| &l[..at]);
            sig.push_str(cut);
            sig.push(' ');
            if cut.len() != l.len() {
                break;
            }
        }
        let direct = SQL_PATHS.iter().find(|p| sig.contains(*p)).map(|p| p.to_string());
        let via_import = imported.iter().find(|n| has_word(&sig, n)).cloned();
        let Some(what) = direct.or(via_import) else { continue };
        if is_impl {
            // A trait impl is public when the implementing type is.
            let Some(ty) = sig.split(" for ").nth(1) else { continue };
            let ty: String =
                ty.trim().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
            let public = ["pub struct ", "pub enum ", "pub trait ", "pub type "]
                .iter()
                .any(|k| all.lines().any(|l| l.trim_start().starts_with(&format!("{k}{ty}"))));
            if !public {
                continue;
            }
        }
        out.push((i + 1, format!("`{}`", what.trim_end_matches("::"))));
    }
    out
}

// ---------------------------------------------------------------------------
// (b) import cycles between the store's modules

/// The module path of a file under `src` (`registry/mod.rs` → `registry`);
/// `None` for the crate root.
fn module_of(rel: &Path) -> Option<String> {
    let mut parts: Vec<String> =
        rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    let file = parts.pop()?;
    let stem = file.strip_suffix(".rs")?.to_owned();
    if parts.is_empty() && (stem == "lib" || stem == "main") {
        return None;
    }
    if stem != "mod" {
        parts.push(stem);
    }
    Some(parts.join("::"))
}

/// Every complete `use` statement, whitespace collapsed, without `use `/`;`.
fn use_statements(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("use ") {
        let before = rest[..at].chars().next_back();
        let starts = before.is_none_or(|c| c.is_whitespace() || c == ';' || c == '{');
        rest = &rest[at + 4..];
        if !starts {
            continue;
        }
        let Some(end) = rest.find(';') else { break };
        out.push(rest[..end].split_whitespace().collect::<Vec<_>>().join(" "));
        rest = &rest[end..];
    }
    out
}

/// Expands a use tree (`a::{b, c::{d, e}}`) into its paths.
fn expand_use(tree: &str) -> Vec<String> {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else { return vec![tree.to_owned()] };
    let prefix = &tree[..open];
    let inner = tree[open + 1..].strip_suffix('}').unwrap_or(&tree[open + 1..]);
    let mut items = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                items.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    items.push(&inner[start..]);
    items
        .into_iter()
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .flat_map(|item| expand_use(item).into_iter().map(move |p| format!("{prefix}{p}")))
        .collect()
}

/// Crate-relative paths a file refers to: `crate::a::b` and `super::x`
/// (resolved against `module`), from `use` trees and inline paths.
fn references(code: &str, module: &str) -> Vec<String> {
    let mut paths = Vec::new();
    for stmt in use_statements(code) {
        let stmt = stmt.strip_prefix("pub(crate) ").unwrap_or(&stmt).to_owned();
        paths.extend(expand_use(&stmt));
    }
    for key in ["crate::", "super::"] {
        for (at, _) in code.match_indices(key) {
            let before = code[..at].chars().next_back();
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                continue;
            }
            let path: String = code[at..]
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                .collect();
            paths.push(path);
        }
    }
    let parent = module.rsplit_once("::").map_or("", |(p, _)| p);
    paths
        .into_iter()
        .filter_map(|p| {
            if let Some(rest) = p.strip_prefix("crate::") {
                return Some(rest.to_owned());
            }
            p.strip_prefix("super::").map(|rest| {
                if parent.is_empty() { rest.to_owned() } else { format!("{parent}::{rest}") }
            })
        })
        .collect()
}

fn check_store_cycles(root: &Path, problems: &mut Vec<String>) {
    let Ok(entries) = fs::read_dir(root.join("crates")) else { return };
    let mut dirs: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    dirs.push(root.join("xtask"));
    dirs.sort();
    for dir in dirs {
        let store = dir.ends_with("crates/store");
        check_crate_cycles(root, &dir.join("src"), store, problems);
    }
}

/// No import cycle between the modules of one crate (every crate); for the
/// store, also no module reaching a sibling through a root re-export.
fn check_crate_cycles(root: &Path, src: &Path, root_reexports: bool, problems: &mut Vec<String>) {
    let mut files = Vec::new();
    rs_files(src, &mut files);
    let mut texts = BTreeMap::new();
    for path in &files {
        let rel = path.strip_prefix(src).unwrap_or(path);
        if rel.file_name().is_some_and(|n| n == "tests.rs") || rel.starts_with("bin") {
            continue;
        }
        if let (Some(module), Ok(text)) = (module_of(rel), fs::read_to_string(path)) {
            texts.insert(module, code_of(&text));
        }
    }
    let shown = src.strip_prefix(root).unwrap_or(src).display().to_string();
    let modules: BTreeSet<String> = texts.keys().cloned().collect();
    let (graph, root_refs) = module_graph(&texts, &modules);
    if root_reexports {
        for (module, item) in root_refs {
            problems.push(format!(
                "{shown}: `{module}` uses `crate::{item}` (a root re-export); \
                 name the defining module instead"
            ));
        }
    }
    if let Some(cycle) = find_cycle(&graph) {
        problems.push(format!("{shown}: import cycle {}", cycle.join(" -> ")));
    }
}

type Graph = BTreeMap<String, BTreeSet<String>>;

/// Edges `module -> module it refers to` (longest module prefix), and the
/// references that go through the crate root instead of a module.
fn module_graph(
    texts: &BTreeMap<String, String>,
    modules: &BTreeSet<String>,
) -> (Graph, Vec<(String, String)>) {
    let mut graph = Graph::new();
    let mut root_refs = Vec::new();
    for (module, code) in texts {
        let edges = graph.entry(module.clone()).or_default();
        for path in references(code, module) {
            let segments: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
            let target = (1..=segments.len())
                .rev()
                .map(|n| segments[..n].join("::"))
                .find(|prefix| modules.contains(prefix));
            match target {
                Some(t) if &t != module && !t.starts_with(&format!("{module}::")) => {
                    edges.insert(t);
                }
                Some(_) => {}
                None => {
                    if let Some(first) = segments.first() {
                        root_refs.push((module.clone(), (*first).to_owned()));
                    }
                }
            }
        }
    }
    root_refs.sort();
    root_refs.dedup();
    (graph, root_refs)
}

/// One cycle of `graph`, as the modules along it, if any.
fn find_cycle(graph: &Graph) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &Graph,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(node.to_owned(), 1);
        stack.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            match state.get(next.as_str()).copied().unwrap_or(0) {
                1 => {
                    let from = stack.iter().position(|n| n == next).unwrap_or(0);
                    let mut cycle = stack[from..].to_vec();
                    cycle.push(next.clone());
                    return Some(cycle);
                }
                0 => {
                    if let Some(c) = visit(next, graph, state, stack) {
                        return Some(c);
                    }
                }
                _ => {}
            }
        }
        stack.pop();
        state.insert(node.to_owned(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for node in graph.keys() {
        if state.get(node.as_str()).copied().unwrap_or(0) == 0 {
            let mut stack = Vec::new();
            if let Some(c) = visit(node, graph, &mut state, &mut stack) {
                return Some(c);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use super::{expand_use, find_cycle, module_graph, public_sql_mentions};

    #[test]
    fn flags_sql_types_in_public_signatures_only() {
        let code = "use rusqlite::{Connection, Row};\n\
                    pub fn a(c: &Connection) {}\n\
                    pub(crate) fn b(c: &Connection) {}\n\
                    fn c(r: &Row<'_>) {}\n\
                    pub struct S {\n    pub e: rusqlite::Error,\n}\n\
                    pub fn d(\n    x: u32,\n    r: &Row<'_>,\n) -> u32 {\n";
        let hits: Vec<usize> = public_sql_mentions(code, code).into_iter().map(|h| h.0).collect();
        assert_eq!(hits, vec![2, 6, 8]);
    }

    #[test]
    fn public_impls_count_private_ones_do_not() {
        let code = "pub enum Error {}\npub(crate) enum Fail {}\n\
                    impl From<rusqlite::Error> for Error {\n\
                    impl From<rusqlite::Error> for Fail {\n";
        let hits: Vec<usize> = public_sql_mentions(code, code).into_iter().map(|h| h.0).collect();
        assert_eq!(hits, vec![3]);
    }

    #[test]
    fn use_trees_expand() {
        assert_eq!(
            expand_use("crate::a::{b, c::{d, e}}"),
            vec!["crate::a::b", "crate::a::c::d", "crate::a::c::e"]
        );
    }

    #[test]
    fn cycles_are_found_through_use_and_super() {
        let texts: BTreeMap<String, String> = [
            ("db", "use crate::registry::claims::LEASE;"),
            ("registry", "pub(crate) mod claims;"),
            ("registry::claims", "use super::Claims;\nfn f() { crate::db::open(); }"),
        ]
        .into_iter()
        .map(|(m, c)| (m.to_owned(), c.to_owned()))
        .collect();
        let modules: BTreeSet<String> = texts.keys().cloned().collect();
        let (graph, root_refs) = module_graph(&texts, &modules);
        assert!(root_refs.is_empty());
        let cycle = find_cycle(&graph).unwrap_or_default();
        assert_eq!(cycle, vec!["db", "registry::claims", "db"]);
        let mut acyclic = texts.clone();
        acyclic.insert("db".into(), String::new());
        let (graph, _) = module_graph(&acyclic, &modules);
        assert_eq!(find_cycle(&graph), None);
    }

    #[test]
    fn root_reexports_are_reported() {
        let texts: BTreeMap<String, String> =
            [("a".to_owned(), "use crate::Store;".to_owned())].into_iter().collect();
        let modules: BTreeSet<String> = texts.keys().cloned().collect();
        assert_eq!(module_graph(&texts, &modules).1, vec![("a".to_owned(), "Store".to_owned())]);
    }
}
