//! `cargo xtask reliability [--full] [--json FILE]`: runs the reliability
//! harnesses of `crates/torture` (kill -9, contention, lineage oracle) and
//! prints their figures.
//!
//! Without `--full` the sizes are CI's (the `retinue-torture` tests run the
//! same in `cargo xtask ci`): 20 kills, 4 processes × 8 threads × 200
//! operations, 20,000 oracle forests. `--full` builds `--release` and runs
//! 200 kills, 4 × 8 × 5,000 operations and 1,000,000 forests (20,000 of them
//! through a real store); `docs/reliability.md` records such a run.
//!
//! `--backend pg` runs the PostgreSQL harness instead (`retinue-torture`'s
//! `pg_contention` test with its `retinue-pg-worker` processes: 4 processes × 8 threads with their own pools, and a
//! host SIGKILLed mid-work), against `RETINUE_PG_URL` or a throwaway cluster;
//! with `--full` in a release build at the full size (`RETINUE_PG_FULL=1`).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;

struct Sizes {
    kills: u32,
    ops: u32,
    cases: u32,
    db_cases: u32,
}

const CI: Sizes = Sizes { kills: 20, ops: 200, cases: 20_000, db_cases: 300 };
const FULL: Sizes = Sizes { kills: 200, ops: 5_000, cases: 1_000_000, db_cases: 20_000 };

fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from)
}

/// Runs one harness; its figures are the JSON line it prints.
fn harness(exe: &Path, args: &[String]) -> Result<Value, String> {
    eprintln!("$ {} {}", exe.display(), args.join(" "));
    let out = Command::new(exe)
        .args(args)
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run {}: {e}", exe.display()))?;
    if !out.status.success() {
        return Err(format!("retinue-torture {} failed with {}", args[0], out.status));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line).map_err(|e| format!("unreadable figures `{line}`: {e}"))
}

fn fresh_dir(root: &Path, name: &str) -> Result<String, String> {
    let dir = target_dir(root).join("reliability").join(name);
    if dir.exists() {
        std::fs::remove_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(dir.display().to_string())
}

/// The PostgreSQL harness; its figures are the lines it prints (stderr).
fn run_pg(root: &Path, full: bool) -> Result<(), String> {
    let (url, _cluster) = crate::pg::for_tests(root)?;
    let mut cmd = crate::cargo();
    cmd.args(["test", "--locked", "-p", "retinue-torture", "--test", "it", "pg_contention"]);
    if full {
        cmd.arg("--release");
    }
    cmd.args(["--", "--test-threads=1", "--nocapture"])
        .env(crate::pg::URL_VAR, &url)
        .env("RETINUE_REQUIRE_PG", "1")
        .env("RETINUE_PG_FULL", if full { "1" } else { "0" });
    crate::run(&mut cmd)
}

pub(crate) fn run(root: &Path, args: &[String]) -> Result<(), String> {
    let full = args.iter().any(|a| a == "--full");
    if args.windows(2).any(|w| w[0] == "--backend" && w[1] == "pg") {
        return run_pg(root, full);
    }
    let json_out = args.iter().position(|a| a == "--json").and_then(|i| args.get(i + 1));
    let sizes = if full { FULL } else { CI };
    let profile = if full { "release" } else { "debug" };
    let mut build = crate::cargo();
    build.args(["build", "--locked", "-p", "retinue-torture"]);
    if full {
        build.arg("--release");
    }
    crate::run(&mut build)?;
    let exe = target_dir(root).join(profile).join("retinue-torture");
    let s = |v: u32| v.to_string();
    let figures = vec![
        harness(
            &exe,
            &[
                "crash".into(),
                "--kills".into(),
                s(sizes.kills),
                "--db-dir".into(),
                fresh_dir(root, "crash")?,
            ],
        )?,
        harness(
            &exe,
            &[
                "contention".into(),
                "--procs".into(),
                "4".into(),
                "--threads".into(),
                "8".into(),
                "--ops".into(),
                s(sizes.ops),
                "--db-dir".into(),
                fresh_dir(root, "contention")?,
            ],
        )?,
        harness(
            &exe,
            &[
                "oracle".into(),
                "--cases".into(),
                s(sizes.cases),
                "--db-cases".into(),
                s(sizes.db_cases),
            ],
        )?,
        harness(&exe, &["hostile".into(), "--db-dir".into(), fresh_dir(root, "hostile")?])?,
    ];
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    println!(
        "reliability ({}, {profile} build, {cores} cores):",
        if full { "full" } else { "CI size" }
    );
    for f in &figures {
        println!("  {f}");
    }
    if let Some(path) = json_out {
        let all = serde_json::json!({ "full": full, "cores": cores, "figures": figures });
        std::fs::write(path, format!("{all:#}\n")).map_err(|e| format!("{path}: {e}"))?;
    }
    Ok(())
}
