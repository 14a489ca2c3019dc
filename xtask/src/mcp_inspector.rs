//! The second independent MCP client of `cargo xtask mcp-e2e`: the official
//! MCP Inspector CLI (`@modelcontextprotocol/inspector`, the TypeScript SDK),
//! installed from npm into `target/mcp-e2e/inspector` (once, pinned), run
//! against `retinue mcp` over stdio in both protocol eras:
//!
//! - `tools/list` (legacy and modern): `delegate_task` and the registry tools;
//! - `logging/setLevel` (legacy era: the Inspector sets it on a handshake-era
//!   connection; the 2026-07-28 era has no such method);
//! - `tools/call delegate_task`: in the modern era the child's answer comes
//!   back; in the legacy era the Inspector asks for an MCP task and gets its
//!   handle (the task id is the delegation id), which `retinue wait ID` —
//!   another process, no `--parent` on the operator's home — then collects.
//!
//! The Inspector 2.12 CLI does not offer `tasks/get` as a one-shot method
//! (it answers "Unsupported method"), so the task is followed through the
//! registry instead.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::run as exec;

/// The Inspector release the end-to-end test is pinned to.
pub(crate) const INSPECTOR_VERSION: &str = "2.12.0";

/// The Inspector's entry point, installed once under `base/inspector`.
fn ensure_inspector(base: &Path) -> Result<PathBuf, String> {
    let dir = base.join("inspector");
    let bin = dir.join("node_modules/.bin/mcp-inspector");
    let marker = dir.join(format!(".inspector-{INSPECTOR_VERSION}"));
    if marker.is_file() && bin.is_file() {
        return Ok(bin);
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    exec(
        Command::new("npm")
            .args(["install", "--no-audit", "--no-fund", "--loglevel=error", "--prefix"])
            .arg(&dir)
            .arg(format!("@modelcontextprotocol/inspector@{INSPECTOR_VERSION}")),
    )
    .map_err(|e| {
        format!("installing @modelcontextprotocol/inspector@{INSPECTOR_VERSION} from npm: {e}")
    })?;
    std::fs::write(&marker, "").map_err(|e| format!("cannot write {}: {e}", marker.display()))?;
    Ok(bin)
}

/// One Inspector CLI call: its JSON result (`{"result": …}`), or why not.
fn inspect(
    bin: &Path,
    retinue: &Path,
    home: &Path,
    project: &Path,
    era: &str,
    method: &[&str],
) -> Result<Value, String> {
    let out = Command::new(bin)
        .args(["--cli", "--format", "json", "--protocol-era", era, "--cwd"])
        .arg(project)
        .arg(retinue)
        .arg("--home")
        .arg(home)
        .arg("mcp")
        .arg("--method")
        .args(method)
        .output()
        .map_err(|e| format!("cannot run the MCP Inspector: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let v: Value = serde_json::from_str(stdout.trim()).map_err(|e| {
        format!(
            "the Inspector ({era}, {method:?}) printed no JSON ({e}): {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })?;
    if !out.status.success() || v.get("error").is_some() {
        return Err(format!("the Inspector ({era}, {method:?}) failed: {v}"));
    }
    eprintln!("mcp-e2e: inspector {era} {}: ok", method.first().copied().unwrap_or_default());
    Ok(v)
}

fn check(ok: bool, what: &str, got: &Value) -> Result<(), String> {
    if ok { Ok(()) } else { Err(format!("mcp-e2e (inspector): {what}: {got}")) }
}

/// Runs the Inspector's checks against `retinue` with `home` (a fake model
/// configured) in `project`.
pub(crate) fn run(base: &Path, retinue: &Path, home: &Path, project: &Path) -> Result<(), String> {
    let bin = ensure_inspector(base)?;
    for era in ["legacy", "modern"] {
        let listed = inspect(&bin, retinue, home, project, era, &["tools/list"])?;
        let names: Vec<&str> = listed["result"]["tools"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|t| t["name"].as_str())
            .collect();
        for want in ["delegate_task", "list_subagents", "show_subagent", "subagent_usage"] {
            check(names.contains(&want), &format!("{era}: tools/list lacks {want}"), &listed)?;
        }
        // The handshake era only (2026-07-28 removed `logging/setLevel`).
        if era == "legacy" {
            inspect(
                &bin,
                retinue,
                home,
                project,
                era,
                &["logging/setLevel", "--log-level", "warning"],
            )?;
        }
    }
    let modern = inspect(
        &bin,
        retinue,
        home,
        project,
        "modern",
        &["tools/call", "--tool-name", "delegate_task", "--tool-arg", "goal=Inspect the notes"],
    )?;
    let text = modern["result"]["content"][0]["text"].as_str().unwrap_or_default();
    let answer: Value = serde_json::from_str(text).unwrap_or(Value::Null);
    check(
        answer["results"][0]["status"] == "completed",
        "modern: delegate_task did not complete",
        &modern,
    )?;
    let legacy = inspect(
        &bin,
        retinue,
        home,
        project,
        "legacy",
        &["tools/call", "--tool-name", "delegate_task", "--tool-arg", "goal=Inspect as a task"],
    )?;
    let task = legacy["result"]["taskId"].as_str().unwrap_or_default().to_owned();
    check(task.starts_with("deleg_"), "legacy: no task handle", &legacy)?;
    // The task is the registry's unit: another process collects it.
    let out = Command::new(retinue)
        .arg("--home")
        .arg(home)
        .args(["--json", "wait", &task, "--timeout", "60"])
        .output()
        .map_err(|e| format!("cannot run retinue wait: {e}"))?;
    let waited: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    check(
        out.status.success() && waited["results"][0]["status"] == "delivered",
        "legacy: the task's unit was not delivered to `retinue wait`",
        &waited,
    )?;
    eprintln!("mcp-e2e: ok with the MCP Inspector {INSPECTOR_VERSION} (both protocol eras)");
    Ok(())
}
