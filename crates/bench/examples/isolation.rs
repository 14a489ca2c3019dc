//! The isolation benchmark (issue #38): `cargo run --release -p
//! retinue-bench --example isolation [-- --quick]`.
//!
//! * Worktree creation for a repository of 10,000 files (`--quick`: 1,000)
//!   through `GitWorktrees::prepare` (locate, the uncommitted-changes
//!   commit, `git worktree add --lock -b`, the record) against the limit: a
//!   bare `git worktree add -b` of the same commit. Goal ≤ 1.5×. `--files N`
//!   measures another size (the 100,000-file repository).
//! * Receipts of a 200-turn transcript with 100 tool calls, read from a
//!   SQLite store (`conversation` + `Receipts::of`) against reading the
//!   transcript alone. Goal ≤ 1 ms.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use retinue_core::run::{Isolation, Owner};
use retinue_core::{Message, NewSession, Receipts, SessionStore, SystemClock};
use retinue_store::{Store, StoreOptions};
use serde_json::json;

fn median_p90(mut samples: Vec<f64>) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    let pick = |q: f64| {
        samples.get(((samples.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0)
    };
    (pick(0.5), pick(0.9))
}

fn row(op: &str, ours: (f64, f64), limit: (f64, f64), unit: &str) {
    println!(
        "| {op} | {:.1} / {:.1} {unit} | {:.1} / {:.1} {unit} | {:.2}× |",
        ours.0,
        ours.1,
        limit.0,
        limit.1,
        ours.0 / limit.0.max(1e-9)
    );
}

fn git(dir: &Path, args: &[&str]) -> Result<(), String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(["-c", "user.name=b", "-c", "user.email=b@b", "-c", "commit.gpgSign=false"])
        .args(args)
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("git {args:?}: {}", String::from_utf8_lossy(&out.stderr)))
    }
}

/// A repository of `files` files in 100 directories, one commit.
fn repository(dir: &Path, files: usize) -> Result<(), String> {
    for i in 0..files {
        let sub = dir.join(format!("d{:03}", i % 100));
        std::fs::create_dir_all(&sub).map_err(|e| e.to_string())?;
        std::fs::write(sub.join(format!("f{i}.txt")), format!("file {i}\n"))
            .map_err(|e| e.to_string())?;
    }
    git(dir, &["init", "-q", "-b", "main"])?;
    git(dir, &["add", "-A"])?;
    git(dir, &["commit", "-q", "-m", "init"])
}

fn worktrees(files: usize, iters: usize) -> Result<(), String> {
    let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
    let repo = tmp.path().join("repo");
    std::fs::create_dir_all(&repo).map_err(|e| e.to_string())?;
    let started = Instant::now();
    repository(&repo, files)?;
    eprintln!("built a {files}-file repository in {:.1}s", started.elapsed().as_secs_f64());
    let wt = retinue_worktree::GitWorktrees::new(tmp.path().join("home/retinue/worktrees"));
    let (mut ours, mut bare) = (Vec::new(), Vec::new());
    for i in 0..iters {
        // Alternate, so neither side is always first to a warm cache.
        let owner = Owner { subagent_id: format!("sa-{i}-bench"), ..Owner::default() };
        let t = Instant::now();
        wt.prepare(&repo, &owner).map_err(|e| e.to_string())?;
        ours.push(t.elapsed().as_secs_f64() * 1e3);
        let dir = tmp.path().join(format!("bare-{i}"));
        let t = Instant::now();
        git(
            &repo,
            &[
                "worktree",
                "add",
                "--quiet",
                "-b",
                &format!("bare/{i}"),
                &dir.to_string_lossy(),
                "HEAD",
            ],
        )?;
        bare.push(t.elapsed().as_secs_f64() * 1e3);
    }
    row(
        &format!("worktree creation, {files} files (prepare vs `git worktree add`)"),
        median_p90(ours),
        median_p90(bare),
        "ms",
    );
    Ok(())
}

fn receipts(iters: usize) -> Result<(), String> {
    let tmp = tempfile::tempdir().map_err(|e| e.to_string())?;
    let options = StoreOptions::default().with_clock(Arc::new(SystemClock));
    let store = Store::open(tmp.path().join("state.db"), options).map_err(|e| e.to_string())?;
    store
        .create_session(&NewSession {
            id: "child".into(),
            source: "delegate".into(),
            ..NewSession::default()
        })
        .map_err(|e| e.to_string())?;
    // 200 turns: 100 assistant turns with a tool call each, 100 results.
    for i in 0..100 {
        let (name, args) = match i % 4 {
            0 => ("read_file", json!({"path": format!("src/m{i}.rs")})),
            1 => ("write_file", json!({"path": format!("src/m{i}.rs"), "content": "x"})),
            2 => ("terminal", json!({"command": "cargo test"})),
            _ => ("search_files", json!({"pattern": "fn main"})),
        };
        let call = json!([{"id": format!("c{i}"), "type": "function", "function": {"name": name, "arguments": args.to_string()}}]);
        let assistant = Message {
            role: "assistant".into(),
            tool_calls: Some(call.to_string()),
            ..Message::default()
        };
        let result = Message {
            role: "tool".into(),
            tool_call_id: Some(format!("c{i}")),
            content: Some(json!({"output": "ok ".repeat(100), "exit_code": 0}).to_string()),
            ..Message::default()
        };
        for m in [assistant, result] {
            store.append_message("child", &m).map_err(|e| e.to_string())?;
        }
    }
    let (mut ours, mut read) = (Vec::new(), Vec::new());
    for _ in 0..iters {
        let t = Instant::now();
        let messages = store.conversation("child").map_err(|e| e.to_string())?;
        read.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        let messages2 = store.conversation("child").map_err(|e| e.to_string())?;
        let r = Receipts::of(&messages2);
        ours.push(t.elapsed().as_secs_f64() * 1e6);
        if r.tool_calls != 100 || messages.len() != 200 {
            return Err(format!(
                "receipts counted {} calls of {} rows",
                r.tool_calls,
                messages.len()
            ));
        }
    }
    row(
        "receipts of 200 turns / 100 tool calls (read + rule vs read)",
        median_p90(ours),
        median_p90(read),
        "µs",
    );
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    // `--files N`: another repository size (the 100,000-file case).
    let files = args
        .iter()
        .position(|a| a == "--files")
        .and_then(|i| args.get(i + 1))
        .and_then(|n| n.parse().ok())
        .unwrap_or(if quick { 1_000 } else { 10_000 });
    println!("| operation | ours median / p90 | limit median / p90 | ratio |");
    println!("|---|---:|---:|---:|");
    let result = worktrees(files, if quick { 3 } else { 9 })
        .and_then(|()| receipts(if quick { 20 } else { 200 }));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("isolation bench failed: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
