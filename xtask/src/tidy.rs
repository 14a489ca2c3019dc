//! Tidy checks: source hygiene, the crate boundary table of ARCHITECTURE.md,
//! and the store seams (`seams.rs`: no SQL type in a public signature, no
//! import cycle between store modules).
//! Also compiled as a `#[test]`, so `cargo test` enforces them.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

/// Workspace crates each crate may depend on (normal dependencies): core on
/// the ground floor, the two backends side by side on it, config above them
/// (never below), lineage and usage on core only.
const ALLOWED: &[(&str, &[&str])] = &[
    ("retinue-core", &[]),
    ("retinue-config", &["retinue-core"]),
    ("retinue-store", &["retinue-core"]),
    ("retinue-store-pg", &["retinue-core"]),
    ("retinue-fake-model", &[]),
    ("retinue-testkit", &["retinue-core", "retinue-config", "retinue-store", "retinue-fake-model"]),
    ("retinue-lineage", &["retinue-core"]),
    ("retinue-usage", &["retinue-core"]),
    ("retinue-delegate", &["retinue-core", "retinue-config", "retinue-lineage", "retinue-usage"]),
    // The run seams are core's (`core::run`): the runtime and the tools
    // never reach the orchestrator; nested delegation is a capability a run
    // carries (`RunContext::delegate`).
    ("retinue-runtime", &["retinue-core", "retinue-config"]),
    ("retinue-tools", &["retinue-core", "retinue-config"]),
    ("retinue-mcp", &["retinue-core", "retinue-lineage", "retinue-usage", "retinue-delegate"]),
    // The web view reads the seams only: no delegation, no runtime, no engine.
    ("retinue-web", &["retinue-core", "retinue-lineage", "retinue-usage"]),
    // OpenTelemetry's SDK and exporter, for the binary to install (core:
    // the one URL redaction, for the export warning).
    ("retinue-trace", &["retinue-core"]),
    // Worktrees over the git CLI, behind core's `Isolation` seam.
    ("retinue-worktree", &["retinue-core"]),
    (
        "retinue-cli",
        &[
            "retinue-core",
            "retinue-config",
            "retinue-store",
            "retinue-lineage",
            "retinue-usage",
            "retinue-delegate",
            "retinue-runtime",
            "retinue-mcp",
            "retinue-web",
            "retinue-trace",
            "retinue-tools",
            "retinue-store-pg",
            "retinue-fake-model",
            "retinue-worktree",
        ],
    ),
    // The bench is a harness: it shares testkit's workload with the PostgreSQL bench.
    (
        "retinue-bench",
        &[
            "retinue-core",
            "retinue-config",
            "retinue-store",
            "retinue-lineage",
            "retinue-usage",
            "retinue-testkit",
        ],
    ),
    (
        "retinue-torture",
        &[
            "retinue-core",
            "retinue-config",
            "retinue-store",
            "retinue-store-pg",
            "retinue-lineage",
            "retinue-usage",
            "retinue-delegate",
        ],
    ),
    (
        "retinue-interop",
        &["retinue-core", "retinue-config", "retinue-store", "retinue-lineage", "retinue-usage"],
    ),
    ("xtask", &[]),
];

/// Crates allowed to depend on rusqlite: only `store`, plus test support.
const SQLITE_CRATES: &[&str] =
    &["retinue-store", "retinue-testkit", "retinue-bench", "retinue-torture", "retinue-interop"];

/// Crates allowed to depend on refinery: the two backends, plus test support.
const MIGRATION_CRATES: &[&str] = &[
    "retinue-store",
    "retinue-store-pg",
    "retinue-testkit",
    "retinue-bench",
    "retinue-torture",
    "retinue-interop",
];

/// Crates allowed to read YAML: only `config`.
const YAML_CRATES: &[&str] = &["retinue-config"];

/// Crates allowed to depend on the PostgreSQL client: only `store-pg`.
const PG_CRATES: &[&str] = &["retinue-store-pg"];

/// Runs every check; the error lists every violation.
pub(crate) fn run(root: &Path) -> Result<(), String> {
    let mut problems = Vec::new();
    check_sources(root, &mut problems);
    check_manifests(root, &mut problems);
    check_graph(root, &mut problems);
    check_engine_free(root, &mut problems);
    crate::seams::check(root, &mut problems);
    crate::docs::check(root, &mut problems);
    crate::sizes::check(root, &mut problems);
    check_type_names(root, &mut problems);
    if let Err(e) = crate::bench::check_docs(root) {
        problems.push(e);
    }
    if problems.is_empty() {
        eprintln!("tidy: ok");
        Ok(())
    } else {
        Err(format!("tidy found {} problem(s):\n  {}", problems.len(), problems.join("\n  ")))
    }
}

/// One type per name across the library crates' public APIs: a `pub`
/// struct, enum, trait or type alias named like another crate's is a
/// problem (`Error` in two crates reads as one type in a `use` list).
fn check_type_names(root: &Path, problems: &mut Vec<String>) {
    let mut seen: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    let Ok(entries) = fs::read_dir(root.join("crates")) else { return };
    let mut dirs: Vec<PathBuf> = entries.flatten().map(|e| e.path()).collect();
    dirs.sort();
    for dir in dirs {
        let krate = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        // The binary crate has no public API.
        if krate == "cli" {
            continue;
        }
        let mut files = Vec::new();
        walk(&dir.join("src"), &mut files);
        let mut names = std::collections::BTreeSet::new();
        for file in files.iter().filter(|f| f.extension().is_some_and(|e| e == "rs")) {
            let Ok(text) = fs::read_to_string(file) else { continue };
            for line in crate::sizes::library_part(&text).lines() {
                let line = line.trim_start();
                for kind in ["pub struct ", "pub enum ", "pub trait ", "pub type "] {
                    if let Some(rest) = line.strip_prefix(kind) {
                        let name: String =
                            rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                        if !name.is_empty() {
                            names.insert(name);
                        }
                    }
                }
            }
        }
        for name in names {
            seen.entry(name).or_default().push(krate.clone());
        }
    }
    for (name, crates) in seen.into_iter().filter(|(_, c)| c.len() > 1) {
        problems
            .push(format!("`{name}` is a public type of {}: one type per name", crates.join(", ")));
    }
}

/// What each crate's whole normal dependency tree must not contain
/// (`cargo tree -e normal`, features resolved as for that crate alone): an
/// embedder takes core + lineage with no SQL engine, and the PostgreSQL
/// backend never links SQLite.
const ENGINE_FREE: &[(&str, &[&str])] = &[
    ("retinue-core", &["rusqlite", "libsqlite3-sys", "postgres", "refinery", "serde_yaml_ng"]),
    ("retinue-lineage", &["rusqlite", "libsqlite3-sys", "postgres", "refinery", "serde_yaml_ng"]),
    ("retinue-usage", &["rusqlite", "libsqlite3-sys", "postgres", "refinery", "serde_yaml_ng"]),
    ("retinue-store-pg", &["rusqlite", "libsqlite3-sys", "serde_yaml_ng"]),
    ("retinue-store", &["postgres", "tokio-postgres", "serde_yaml_ng"]),
    ("retinue-web", &["rusqlite", "libsqlite3-sys", "postgres", "refinery", "serde_yaml_ng"]),
    ("retinue-worktree", &["rusqlite", "libsqlite3-sys", "postgres", "refinery", "serde_yaml_ng"]),
];

fn check_engine_free(root: &Path, problems: &mut Vec<String>) {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    for (krate, banned) in ENGINE_FREE {
        let out = Command::new(&cargo)
            .current_dir(root)
            .args(["tree", "--quiet", "--offline", "-e", "normal", "--prefix", "none"])
            .args(["--format", "{p}", "-p", krate])
            .output();
        let text = match out {
            Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).into_owned(),
            Ok(o) => {
                problems.push(format!(
                    "cargo tree -p {krate}: {}",
                    String::from_utf8_lossy(&o.stderr).trim()
                ));
                continue;
            }
            Err(e) => {
                problems.push(format!("cargo tree -p {krate}: {e}"));
                continue;
            }
        };
        for line in text.lines() {
            let name = line.split_whitespace().next().unwrap_or_default();
            if banned.contains(&name) {
                problems.push(format!("{krate}'s dependency tree contains {name}"));
            }
        }
    }
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if name == "target" || name == ".git" {
            continue;
        }
        if path.is_dir() {
            walk(&path, out);
        } else {
            out.push(path);
        }
    }
}

fn is_test_path(path: &Path) -> bool {
    path.components().any(|c| c.as_os_str() == "tests" || c.as_os_str() == "benches")
        || path.file_name().is_some_and(|n| n == "tests.rs")
}

fn check_sources(root: &Path, problems: &mut Vec<String>) {
    let mut files = Vec::new();
    walk(&root.join("crates"), &mut files);
    walk(&root.join("xtask"), &mut files);
    for path in &files {
        let rel = path.strip_prefix(root).unwrap_or(path).display().to_string();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if name.ends_with(".snap.new") || name.ends_with(".pending-snap") {
            problems.push(format!("{rel}: stray insta file"));
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let Ok(text) = fs::read_to_string(path) else {
            problems.push(format!("{rel}: unreadable"));
            continue;
        };
        if !text.starts_with("//!") && path.components().any(|c| c.as_os_str() == "src") {
            problems.push(format!("{rel}: does not start with a `//!` doc comment"));
        }
        for (i, line) in text.lines().enumerate() {
            if line.ends_with(' ') || line.ends_with('\t') {
                problems.push(format!("{rel}:{}: trailing whitespace", i + 1));
            }
            // `#[expect]` fails the lint run when it silences nothing; an
            // `#[allow]` can outlive its reason unnoticed.
            let code = line.trim_start();
            if code.starts_with("#[allow(") || code.starts_with("#![allow(") {
                problems.push(format!("{rel}:{}: `#[allow]`: use `#[expect]`", i + 1));
            }
        }
        if is_test_path(path) || rel.starts_with("xtask") {
            continue;
        }
        let lib = crate::sizes::library_part(&text);
        string_errors(&rel, &lib, problems);
        // The configuration is read once per process, by the command's
        // environment, and handed out from there.
        if lib.contains("LoadedConfig::load(")
            && rel.contains("/src/")
            && rel != "crates/cli/src/env.rs"
            && !rel.starts_with("crates/config/")
        {
            problems.push(format!(
                "{rel}: `LoadedConfig::load` outside crates/cli/src/env.rs (use `Env::config`)"
            ));
        }
        for (i, line) in lib.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            for banned in ["todo!(", "unimplemented!(", "dbg!(", ".unwrap()"] {
                if code.contains(banned) {
                    problems.push(format!("{rel}:{}: `{banned}` in library code", i + 1));
                }
            }
        }
    }
}

/// A public signature (a `pub fn` up to its body, or a `pub` field) whose
/// error type is a bare `String`: errors are typed (thiserror), so callers
/// can branch on them and keep their source chain.
fn string_errors(rel: &str, lib: &str, problems: &mut Vec<String>) {
    let lines: Vec<&str> = lib.lines().collect();
    let mut i = 0;
    while i < lines.len() {
        let trimmed = lines[i].trim_start();
        let public = trimmed.starts_with("pub ") && !trimmed.starts_with("pub use");
        if !public {
            i += 1;
            continue;
        }
        // The signature runs to its body or its end (a few lines at most).
        let function = trimmed.contains("fn ");
        let mut sig = String::new();
        let start = i;
        while i < lines.len() && i < start + 12 {
            let code = lines[i].split("//").next().unwrap_or("");
            sig.push_str(code);
            i += 1;
            if !function || code.contains('{') || code.trim_end().ends_with(';') {
                break;
            }
        }
        let compact: String = sig.chars().filter(|c| !c.is_whitespace()).collect();
        if has_string_error(&compact) {
            problems.push(format!(
                "{rel}:{}: `Result<_, String>` in a public signature (use a typed error)",
                start + 1
            ));
        }
    }
}

/// Whether a whitespace-free signature names `Result<T, String>` (the
/// second generic argument of a `Result`, at its own nesting level).
fn has_string_error(compact: &str) -> bool {
    let mut rest = compact;
    while let Some(at) = rest.find("Result<") {
        let args = &rest[at + "Result<".len()..];
        let (mut depth, mut comma, mut end) = (0usize, None, None);
        for (i, c) in args.char_indices() {
            match c {
                '<' | '(' | '[' => depth += 1,
                '>' | ')' | ']' if depth == 0 => {
                    end = Some(i);
                    break;
                }
                '>' | ')' | ']' => depth -= 1,
                ',' if depth == 0 => comma = Some(i),
                _ => {}
            }
        }
        if let (Some(c), Some(e)) = (comma, end)
            && args[c + 1..e] == *"String"
        {
            return true;
        }
        rest = args;
    }
    false
}

fn check_manifests(root: &Path, problems: &mut Vec<String>) {
    let Ok(entries) = fs::read_dir(root.join("crates")) else {
        problems.push("crates/: unreadable".to_owned());
        return;
    };
    let mut manifests: Vec<PathBuf> =
        entries.flatten().map(|e| e.path().join("Cargo.toml")).collect();
    manifests.push(root.join("xtask/Cargo.toml"));
    for manifest in manifests {
        let rel = manifest.strip_prefix(root).unwrap_or(&manifest).display().to_string();
        let Ok(text) = fs::read_to_string(&manifest) else {
            problems.push(format!("{rel}: missing"));
            continue;
        };
        if !text.contains("[lints]") || !text.contains("workspace = true") {
            problems.push(format!("{rel}: must inherit `[lints] workspace = true`"));
        }
        let mut section = String::new();
        for line in text.lines() {
            let line = line.trim();
            if line.starts_with('[') {
                section = line.to_owned();
                continue;
            }
            let deps = section.contains("dependencies");
            // A crate's own features in its tests: a path-only self-dependency.
            let own = line.contains("path = \".\"");
            if deps && !own && (line.contains("path =") || line.contains("version =")) {
                problems.push(format!("{rel}: `{line}`: use `workspace = true`"));
            }
            if section == "[dependencies]"
                && line.starts_with("mockall")
                && !line.contains("optional = true")
            {
                problems.push(format!("{rel}: mockall must be optional or a dev-dependency"));
            }
        }
    }
}

fn check_graph(root: &Path, problems: &mut Vec<String>) {
    let output = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(root)
        .output();
    let meta: Value = match output {
        Ok(o) if o.status.success() => match serde_json::from_slice(&o.stdout) {
            Ok(v) => v,
            Err(e) => {
                problems.push(format!("cargo metadata: unreadable output: {e}"));
                return;
            }
        },
        Ok(o) => {
            problems.push(format!("cargo metadata failed: {}", String::from_utf8_lossy(&o.stderr)));
            return;
        }
        Err(e) => {
            problems.push(format!("cargo metadata: {e}"));
            return;
        }
    };
    let packages = meta["packages"].as_array().cloned().unwrap_or_default();
    for pkg in &packages {
        let name = pkg["name"].as_str().unwrap_or_default();
        let Some((_, allowed)) = ALLOWED.iter().find(|(n, _)| *n == name) else {
            problems.push(format!("{name}: not in the crate boundary table (xtask/src/tidy.rs)"));
            continue;
        };
        for dep in pkg["dependencies"].as_array().into_iter().flatten() {
            let dep_name = dep["name"].as_str().unwrap_or_default();
            let normal = dep["kind"].is_null();
            if dep_name.starts_with("retinue-") && normal && !allowed.contains(&dep_name) {
                problems.push(format!("{name} may not depend on {dep_name}"));
            }
            // The release binary never carries the test kit (its demo takes
            // the fake model server's own crate); the bench (a harness,
            // never shipped) shares testkit's workload.
            if dep_name == "retinue-testkit" && normal && name != "retinue-bench" {
                problems.push(format!("{name}: retinue-testkit may only be a dev-dependency"));
            }
            if dep_name == "rusqlite" && normal && !SQLITE_CRATES.contains(&name) {
                problems.push(format!("{name}: only retinue-store may depend on {dep_name}"));
            }
            if dep_name == "refinery" && normal && !MIGRATION_CRATES.contains(&name) {
                problems.push(format!(
                    "{name}: only retinue-store and retinue-store-pg may depend on {dep_name}"
                ));
            }
            if dep_name.starts_with("serde_yaml") && normal && !YAML_CRATES.contains(&name) {
                problems.push(format!("{name}: only retinue-config may depend on {dep_name}"));
            }
            if (dep_name == "postgres" || dep_name == "tokio-postgres")
                && normal
                && !PG_CRATES.contains(&name)
            {
                problems.push(format!("{name}: only retinue-store-pg may depend on {dep_name}"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn tidy() {
        let root = super::super::root();
        if let Err(e) = super::run(&root) {
            panic!("{e}");
        }
    }

    #[test]
    fn string_errors_are_found_at_their_own_nesting_level() {
        use super::has_string_error;
        assert!(has_string_error("pubfnf()->Result<Vec<u8>,String>{"));
        assert!(has_string_error("pubx:Option<Result<Delegator,String>>,"));
        assert!(!has_string_error("pubfnf()->Result<BTreeMap<String,String>>{"));
        assert!(!has_string_error("pubfnf()->Result<String,Error>{"));
        assert!(!has_string_error("pubfnf()->Result<(String,String),Error>{"));
        let mut problems = Vec::new();
        super::string_errors(
            "x.rs",
            "pub fn parse(\n    a: &str,\n) -> Result<u8, String> {\n}\n",
            &mut problems,
        );
        assert_eq!(problems.len(), 1, "{problems:?}");
    }

    #[test]
    fn library_part_stops_at_cfg_test() {
        assert_eq!(crate::sizes::library_part("a\n#[cfg(test)]\nb"), "a\n");
        assert_eq!(crate::sizes::library_part("a"), "a\n");
        // A test module in the middle: the code after it is library code again.
        let text = "a\n#[cfg(test)]\nmod t {\n    x\n}\nb\n#[cfg(test)]\nuse y;\nc\n";
        assert_eq!(crate::sizes::library_part(text), "a\nb\nc\n");
    }
}
