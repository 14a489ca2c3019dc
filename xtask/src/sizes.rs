//! Size limits of the shipped crates: no source file over 600 lines of
//! library code (its tests and module docs aside), no function over 100 lines. What was over a limit when the
//! rule came in is listed in `sizes.allow` next to this file with its
//! length then; an entry may not grow, and one that is back under the limit
//! (or gone) must be removed, so the list only shrinks.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

/// The crates a user runs or links (harnesses are not held to the limits).
const SHIPPED: &[&str] = &[
    "core",
    "config",
    "store",
    "store-pg",
    "lineage",
    "usage",
    "delegate",
    "runtime",
    "tools",
    "mcp",
    "web",
    "trace",
    "cli",
    "fake-model",
];

/// The longest a shipped source file's library part may be, in lines.
pub(crate) const FILE_LIMIT: usize = 600;
/// The longest a shipped function may be, in lines.
pub(crate) const FUNCTION_LIMIT: usize = 100;

/// One measured item: `path` (and `fn name` for a function) and its length.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Item {
    /// `crates/x/src/y.rs` or `crates/x/src/y.rs::name`.
    pub(crate) key: String,
    /// Lines.
    pub(crate) lines: usize,
}

/// Runs the check against `xtask/src/sizes.allow`.
pub(crate) fn check(root: &Path, problems: &mut Vec<String>) {
    let allow_path = root.join("xtask/src/sizes.allow");
    let allow: BTreeMap<String, usize> = fs::read_to_string(&allow_path)
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .filter_map(|l| {
            let (len, key) = l.trim().split_once(' ')?;
            Some((key.trim().to_owned(), len.parse().ok()?))
        })
        .collect();
    let over = measure(root);
    let found: BTreeMap<&str, usize> = over.iter().map(|i| (i.key.as_str(), i.lines)).collect();
    for item in &over {
        let limit = if item.key.contains(".rs::") { FUNCTION_LIMIT } else { FILE_LIMIT };
        match allow.get(&item.key) {
            None => problems.push(format!(
                "{}: {} lines (limit {limit}): split it",
                item.key, item.lines
            )),
            Some(max) if item.lines > *max => problems.push(format!(
                "{}: {} lines, more than the {max} xtask/src/sizes.allow grants (it may only shrink)",
                item.key, item.lines
            )),
            Some(_) => {}
        }
    }
    for key in allow.keys() {
        if !found.contains_key(key.as_str()) {
            problems.push(format!(
                "xtask/src/sizes.allow: `{key}` is under its limit now (or gone): remove the line"
            ));
        }
    }
}

/// Every shipped file and function over its limit.
pub(crate) fn measure(root: &Path) -> Vec<Item> {
    let mut out = Vec::new();
    for name in SHIPPED {
        let mut files = Vec::new();
        rs_files(&root.join("crates").join(name).join("src"), &mut files);
        for file in files {
            if file.file_name().is_some_and(|n| n == "tests.rs") {
                continue;
            }
            let Ok(text) = fs::read_to_string(&file) else { continue };
            let rel = file.strip_prefix(root).unwrap_or(&file).display().to_string();
            let lib = library_part(&text);
            // Module docs (`//!`) are prose, not code.
            let lines = lib.lines().filter(|l| !l.trim_start().starts_with("//!")).count();
            if lines > FILE_LIMIT {
                out.push(Item { key: rel.clone(), lines });
            }
            // Functions of one name in one file (two `run` methods) are
            // told apart by their order: `name`, `name#2`, …
            let mut seen = BTreeMap::<String, usize>::new();
            for (name, lines) in functions(&lib) {
                let n = seen.entry(name.clone()).or_default();
                *n += 1;
                if lines > FUNCTION_LIMIT {
                    let key = if *n == 1 { name } else { format!("{name}#{n}") };
                    out.push(Item { key: format!("{rel}::{key}"), lines });
                }
            }
        }
    }
    out.sort();
    out
}

/// Library code of a file: the file without its `#[cfg(test)]` items (a
/// test module up to its closing brace, or a one-line item such as a
/// test-only `use`), wherever they stand.
pub(crate) fn library_part(text: &str) -> String {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < lines.len() {
        if lines[i].trim() != "#[cfg(test)]" {
            out.push_str(lines[i]);
            out.push('\n');
            i += 1;
            continue;
        }
        let Some(item) = lines.get(i + 1) else { break };
        let indent = &item[..item.len() - item.trim_start().len()];
        i += 2;
        if item.trim_end().ends_with('{') {
            let close = format!("{indent}}}");
            while i < lines.len() && lines[i].trim_end() != close {
                i += 1;
            }
            i += 1;
        }
    }
    out
}

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            rs_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Each function with a body in rustfmt-formatted `code`, with its length
/// in lines: from its `fn` line to the `}` at the same indentation.
pub(crate) fn functions(code: &str) -> Vec<(String, usize)> {
    let lines: Vec<&str> = code.lines().collect();
    let mut out = Vec::new();
    for (start, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        let Some(name) = fn_name(trimmed) else { continue };
        let indent = &line[..line.len() - trimmed.len()];
        // The signature ends at the first line ending `{` (a body) or `;` (none).
        let Some(open) = (start..lines.len()).find(|&i| {
            let l = lines[i].trim_end();
            l.ends_with('{') || l.ends_with(';') || l.ends_with('}')
        }) else {
            continue;
        };
        if !lines[open].trim_end().ends_with('{') {
            continue;
        }
        let close = format!("{indent}}}");
        if let Some(end) = (open + 1..lines.len()).find(|&i| lines[i].trim_end() == close) {
            out.push((name, end - start + 1));
        }
    }
    out
}

/// The name of the function `line` (trimmed) declares, if it declares one.
fn fn_name(line: &str) -> Option<String> {
    let mut rest = line;
    for prefix in
        ["pub(crate) ", "pub(super) ", "pub ", "const ", "async ", "unsafe ", "extern \"C\" "]
    {
        rest = rest.strip_prefix(prefix).unwrap_or(rest);
    }
    let rest = rest.strip_prefix("fn ")?;
    let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
    (!name.is_empty()).then_some(name)
}

#[cfg(test)]
mod tests {
    use super::functions;

    #[test]
    fn functions_are_measured_from_fn_to_their_closing_brace() {
        let code = "fn a() {\n    1;\n}\n\nimpl X {\n    pub(crate) fn b(\n        x: u8,\n    ) -> u8 {\n        if x {\n        }\n        x\n    }\n    fn c(&self);\n}\n";
        assert_eq!(functions(code), [("a".to_owned(), 3), ("b".to_owned(), 7)]);
    }
}
