//! The tools benchmark: `cargo run --release -p retinue-bench --example
//! tools [-- --quick]`.
//!
//! * `read_file` of a 10 KB file through the `Toolbox` (workspace checks,
//!   `openat2` beneath the root, line numbering, the JSON result) against
//!   the limit: a bare `std::fs::read` of the same file with the same
//!   `N|line` formatting. Goal ≤ 2×.
//! * A sandboxed `terminal` running `true` (the helper: namespaces, private
//!   mounts, Landlock, then `/bin/sh -c true` as PID 1) against a bare
//!   `Command::new("true")` spawn: the sandbox's cost, stated. Nothing is
//!   asserted.

use std::path::PathBuf;
use std::time::Instant;

use retinue_config::TerminalConfig;
use retinue_delegate::ChildHandle;
use retinue_runtime::ToolExecutor;
use retinue_tools::terminal::Helper;
use retinue_tools::{Toolbox, ToolboxConfig};
use serde_json::json;

const SANDBOX: &str = "__sandbox";

fn median_p90(mut samples: Vec<f64>) -> (f64, f64) {
    samples.sort_by(f64::total_cmp);
    let pick = |q: f64| {
        samples.get(((samples.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0)
    };
    (pick(0.5), pick(0.9))
}

fn time(iters: usize, mut f: impl FnMut()) -> (f64, f64) {
    let samples = (0..iters)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    median_p90(samples)
}

fn row(op: &str, ours: (f64, f64), limit: (f64, f64)) {
    println!(
        "| {op} | {:.1} / {:.1} µs | {:.1} / {:.1} µs | {:.2}× |",
        ours.0,
        ours.1,
        limit.0,
        limit.1,
        ours.0 / limit.0.max(1e-9)
    );
}

fn main() {
    let mut args = std::env::args_os().skip(1);
    // This example is its own sandbox helper (as `retinue __sandbox`).
    if args.next().is_some_and(|a| a == SANDBOX) {
        std::process::exit(retinue_tools::sandbox::helper_main(args.collect()));
    }
    let quick = std::env::args().any(|a| a == "--quick");
    let (reads, spawns) = if quick { (200, 10) } else { (5_000, 200) };
    let ws = tempfile::tempdir().expect("workspace");
    let text: String = (0..200).map(|i| format!("line {i:>4}: {}\n", "x".repeat(40))).collect();
    assert!(text.len() >= 10_000);
    std::fs::write(ws.path().join("ten-kb.txt"), &text).expect("file");
    let helper =
        Helper { program: std::env::current_exe().expect("exe"), prefix: vec![SANDBOX.into()] };
    let toolbox = Toolbox::new(ToolboxConfig {
        terminal: TerminalConfig::default(),
        sandbox_helper: Some(helper),
        mcp_servers: Vec::new(),
        protected: Default::default(),
        approvals: Default::default(),
    });
    let child = ChildHandle {
        subagent_id: "sa-0-bench".into(),
        session_id: "bench".into(),
        toolsets: vec!["file".into(), "terminal".into()],
        workspace: Some(PathBuf::from(ws.path())),
        depth: 1,
    };
    println!("| operation | ours (median / p90) | limit (median / p90) | ratio |");
    println!("|---|---|---|---|");
    let args = json!({"path": "ten-kb.txt"});
    let ours = time(reads, || {
        let out = toolbox.execute(&child, "read_file", &args).expect("read_file");
        std::hint::black_box(out);
    });
    let path = ws.path().join("ten-kb.txt");
    let limit = time(reads, || {
        let bytes = std::fs::read(&path).expect("read");
        let text = String::from_utf8_lossy(&bytes);
        let numbered: Vec<String> =
            text.lines().enumerate().map(|(i, l)| format!("{}|{l}", i + 1)).collect();
        std::hint::black_box(numbered.join("\n"));
    });
    row("read_file, 10 KB file (limit: std::fs::read + N|line)", ours, limit);
    match toolbox.sandbox_status() {
        Ok(status) => {
            let cmd = json!({"command": "true"});
            let ours = time(spawns, || {
                let out = toolbox.execute(&child, "terminal", &cmd).expect("terminal");
                std::hint::black_box(out);
            });
            let limit = time(spawns, || {
                let s = std::process::Command::new("true").status().expect("true");
                std::hint::black_box(s);
            });
            row("terminal `true`, sandboxed (limit: bare spawn of `true`)", ours, limit);
            println!("\nsandbox: {status}");
        }
        Err(why) => println!("\nterminal: the sandbox cannot be set up here ({why}); no row"),
    }
}
