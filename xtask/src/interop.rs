//! `cargo xtask interop`: Retinue and the published Python hermes-agent share one `state.db`.
//!
//! 1. Downloads the pinned hermes-agent wheel from PyPI into
//!    `target/interop/wheel` (once) and unpacks it (standard-library `zipfile`).
//! 2. Runs `crates/interop/driver/hermes_driver.py write`: hermes' own
//!    `SessionDB` and delegation module write a realistic database.
//! 3. Builds the `retinue` binary when the CLI crate exists, then runs
//!    `cargo test -p retinue-interop --test interop -- --include-ignored`
//!    with `RETINUE_INTEROP_DB` (and `RETINUE_INTEROP_BIN`) set.
//! 4. Runs the driver's `verify`: hermes reopens what Retinue wrote.
//!
//! `RETINUE_INTEROP_HERMES_VERSION` tries another release than the pinned
//! [`HERMES_VERSION`]; `PYTHON` names the interpreter (default `python3`).
//!
//! Python runs with `-S` (no site-packages), so hermes' `SessionDB` is proven
//! to need nothing but the standard library, and `-B` (no bytecode files).

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::{cargo, run as exec};

/// The hermes-agent release the interop suite is pinned to.
pub(crate) const HERMES_VERSION: &str = "0.19.0";

/// Overrides [`HERMES_VERSION`] to try another release.
const VERSION_ENV: &str = "RETINUE_INTEROP_HERMES_VERSION";

fn hermes_version() -> String {
    std::env::var(VERSION_ENV)
        .ok()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| HERMES_VERSION.to_owned())
}

pub(crate) fn target_dir(root: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => root.join(dir),
        _ => root.join("target"),
    }
}

fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned())
}

/// The downloaded wheel of `version` in `dir`, if any.
fn find_wheel(dir: &Path, version: &str) -> Option<PathBuf> {
    let prefix = format!("hermes_agent-{version}-");
    fs::read_dir(dir).ok()?.flatten().map(|e| e.path()).find(|p| {
        p.file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".whl"))
    })
}

/// The wheel, downloaded once.
fn ensure_wheel(base: &Path, version: &str) -> Result<PathBuf, String> {
    let dir = base.join("wheel");
    if let Some(wheel) = find_wheel(&dir, version) {
        eprintln!("interop: using {}", wheel.display());
        return Ok(wheel);
    }
    fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let spec = format!("hermes-agent=={version}");
    let status = Command::new(python())
        .args(["-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d"])
        .arg(&dir)
        .arg(&spec)
        .status()
        .map_err(|e| {
            format!("cannot run `{} -m pip`: {e} (is Python 3 with pip installed?)", python())
        })?;
    match find_wheel(&dir, version) {
        Some(wheel) if status.success() => Ok(wheel),
        _ => Err(format!(
            "could not download {spec} from PyPI ({status}); the interop suite needs network \
             access once, or the wheel placed in {}",
            dir.display()
        )),
    }
}

/// The unpacked wheel, unpacked once.
fn ensure_unpacked(base: &Path, wheel: &Path, version: &str) -> Result<PathBuf, String> {
    let dir = base.join(format!("hermes-agent-{version}"));
    let marker = dir.join("hermes_state.py");
    if marker.is_file() {
        return Ok(dir);
    }
    if dir.exists() {
        fs::remove_dir_all(&dir).map_err(|e| format!("cannot clean {}: {e}", dir.display()))?;
    }
    exec(Command::new(python()).args(["-m", "zipfile", "-e"]).arg(wheel).arg(&dir))?;
    if !marker.is_file() {
        return Err(format!("{} has no hermes_state.py", wheel.display()));
    }
    Ok(dir)
}

fn driver(root: &Path, site: &Path, phase: &str, db: &Path) -> Result<(), String> {
    let home = db.parent().unwrap_or(db);
    exec(
        Command::new(python())
            .args(["-S", "-B"])
            .arg(root.join("crates/interop/driver/hermes_driver.py"))
            .arg(phase)
            .arg(db)
            .env("PYTHONPATH", site)
            .env("HERMES_HOME", home)
            .env("PYTHONDONTWRITEBYTECODE", "1"),
    )
    .map_err(|e| format!("hermes driver `{phase}`: {e}"))
}

/// The `retinue` binary, when the CLI crate is part of the workspace.
fn retinue_bin(root: &Path) -> Result<Option<PathBuf>, String> {
    if !root.join("crates/cli/Cargo.toml").is_file() {
        eprintln!("interop: no crates/cli; the `retinue lineage` comparison is skipped");
        return Ok(None);
    }
    crate::build_workspace("dev")?;
    let bin = crate::built("dev", "retinue", false);
    if bin.is_file() {
        Ok(Some(bin))
    } else {
        Err(format!("the workspace build produced no {}", bin.display()))
    }
}

pub(crate) fn run(root: &Path) -> Result<(), String> {
    let target = target_dir(root);
    let base = target.join("interop");
    let version = hermes_version();
    let wheel = ensure_wheel(&base, &version)?;
    let site = ensure_unpacked(&base, &wheel, &version)?;
    let run_dir = base.join("run");
    if run_dir.exists() {
        fs::remove_dir_all(&run_dir)
            .map_err(|e| format!("cannot clean {}: {e}", run_dir.display()))?;
    }
    let db = run_dir.join("hermes-home").join("state.db");
    driver(root, &site, "write", &db)?;
    // A home where hermes's async_delegation module wrote before any SessionDB.
    let early = run_dir.join("early-home").join("state.db");
    driver(root, &site, "early-write", &early)?;
    let bin = retinue_bin(root)?;
    let mut test = cargo();
    test.args([
        "test",
        "--workspace",
        "--all-features",
        "--test",
        "interop",
        "--locked",
        "--",
        "--include-ignored",
        "--nocapture",
    ])
    .env("RETINUE_INTEROP_DB", &db)
    .env("RETINUE_INTEROP_EARLY_DB", &early)
    .env("INSTA_UPDATE", "no");
    match &bin {
        Some(bin) => test.env("RETINUE_INTEROP_BIN", bin),
        None => test.env_remove("RETINUE_INTEROP_BIN"),
    };
    exec(&mut test)?;
    driver(root, &site, "verify", &db)?;
    driver(root, &site, "early-verify", &early)?;
    eprintln!("interop: ok with hermes-agent {version}");
    Ok(())
}
