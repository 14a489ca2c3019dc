//! `cargo xtask`: everything CI does, runnable locally.
//!
//! `cargo xtask ci` runs fmt --check, clippy (all targets, `-D warnings`),
//! the test suite (nextest when installed, else `cargo test`, then doctests),
//! the hermes-agent interop suite, the `retinue mcp` end-to-end test with the
//! Python MCP SDK, rustdoc with warnings denied, `tidy`, and
//! a `--quick` smoke run of the benchmark (no timing asserted).

mod interop;
mod mcp_e2e;
mod pg;
mod reliability;
mod seams;
mod tidy;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

const HELP: &str = "\
cargo xtask <task>

tasks:
  ci      fmt, lint, test, interop, mcp-e2e, doc, tidy and a bench smoke run, fail-fast (what CI runs)
  fmt     cargo fmt --all -- --check
  lint    cargo clippy --workspace --all-targets --all-features -- -D warnings
  test    the whole test suite (nextest where installed, else cargo test) and doctests, the
          PostgreSQL tests against RETINUE_PG_URL or a throwaway cluster started here
          (`test -p CRATE …`: cargo test with those arguments only)
  pg-start  start a throwaway PostgreSQL cluster in target/pg-cluster, print its export line
          (--minutes N: stops by itself after N minutes, default 120)
  pg-stop   stop it
  doc     cargo doc --workspace --no-deps with warnings denied
  tidy    source hygiene and crate-boundary checks
  interop share a state.db with the published Python hermes-agent (downloads its wheel)
  mcp-e2e `retinue mcp` driven by the official Python MCP SDK (pip-installs `mcp` into target/)
  reliability  kill -9, contention and lineage-oracle harnesses (--full: release, full size;
               --backend pg: the PostgreSQL contention and killed-host harness)
  bench   the registry benchmark, then the child runtime's (pass --quick for a smoke run,
          --json FILE to save the registry figures; --backend pg: the PostgreSQL rows)
";

fn root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().map_or(manifest.clone(), Path::to_path_buf)
}

fn run(cmd: &mut Command) -> Result<(), String> {
    eprintln!("$ {cmd:?}");
    let status =
        cmd.current_dir(root()).status().map_err(|e| format!("cannot run {cmd:?}: {e}"))?;
    if status.success() { Ok(()) } else { Err(format!("{cmd:?} failed with {status}")) }
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned()))
}

fn fmt() -> Result<(), String> {
    run(cargo().args(["fmt", "--all", "--", "--check"]))
}

fn lint() -> Result<(), String> {
    run(cargo().args([
        "clippy",
        "--workspace",
        "--all-targets",
        "--all-features",
        "--locked",
        "--",
        "-D",
        "warnings",
    ]))
}

fn has_nextest() -> bool {
    cargo().args(["nextest", "--version"]).output().map(|o| o.status.success()).unwrap_or(false)
}

fn test(args: &[String]) -> Result<(), String> {
    // The PostgreSQL tests run against RETINUE_PG_URL or a throwaway cluster
    // (stopped when `_cluster` drops, on error too); RETINUE_REQUIRE_PG makes
    // them fail rather than skip if the URL were somehow missing.
    let (url, _cluster) = pg::for_tests(&root())?;
    let with_pg = |mut cmd: Command| {
        cmd.env(pg::URL_VAR, &url).env("RETINUE_REQUIRE_PG", "1");
        cmd
    };
    // `cargo xtask test -p CRATE …`: only those packages (local use).
    if !args.is_empty() {
        return run(with_pg(cargo()).arg("test").args(args).env("INSTA_UPDATE", "no"));
    }
    if has_nextest() {
        run(with_pg(cargo())
            .args(["nextest", "run", "--workspace", "--all-features", "--locked", "--no-fail-fast"])
            .env("INSTA_UPDATE", "no"))?;
        run(with_pg(cargo()).args(["test", "--doc", "--workspace", "--all-features", "--locked"]))
    } else {
        run(with_pg(cargo())
            .args(["test", "--workspace", "--all-features", "--locked", "--no-fail-fast"])
            .env("INSTA_UPDATE", "no"))
    }
}

fn doc() -> Result<(), String> {
    run(cargo()
        .args(["doc", "--workspace", "--no-deps", "--all-features", "--locked"])
        .env("RUSTDOCFLAGS", "-D warnings"))
}

fn bench(args: &[String]) -> Result<(), String> {
    // `--backend pg`: the PostgreSQL rows, against RETINUE_PG_URL or a throwaway cluster.
    if let Some(at) = args.windows(2).position(|w| w[0] == "--backend" && w[1] == "pg") {
        let rest: Vec<&String> = args
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != at && *i != at + 1)
            .map(|(_, a)| a)
            .collect();
        let (url, _cluster) = pg::for_tests(&root())?;
        return run(cargo()
            .args(["run", "--release", "--locked", "-p", "retinue-store-pg", "--example", "bench"])
            .arg("--")
            .args(rest)
            .env(pg::URL_VAR, &url));
    }
    let mut cmd = cargo();
    cmd.args(["run", "--release", "--locked", "-p", "retinue-bench", "--"]).args(args);
    run(&mut cmd)?;
    // The child runtime against the fake model server: overhead per model
    // call next to a bare HTTP request, and 32 children at once.
    let quick: Vec<&String> = args.iter().filter(|a| *a == "--quick").collect();
    let mut runtime = cargo();
    runtime
        .args(["run", "--release", "--locked", "-p", "retinue-bench", "--example", "runtime", "--"])
        .args(quick.clone());
    run(&mut runtime)?;
    // The children's tools: read_file against a bare read, the sandboxed
    // terminal against a bare spawn.
    let mut tools = cargo();
    tools
        .args(["run", "--release", "--locked", "-p", "retinue-bench", "--example", "tools", "--"])
        .args(quick);
    run(&mut tools)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => fmt()
            .and_then(|()| lint())
            .and_then(|()| test(&[]))
            .and_then(|()| interop::run(&root()))
            .and_then(|()| mcp_e2e::run(&root()))
            .and_then(|()| doc())
            .and_then(|()| tidy::run(&root()))
            // A smoke run of the benchmark (small N): it must build and run; no timing is asserted.
            .and_then(|()| bench(&["--quick".to_owned()])),
        Some("fmt") => fmt(),
        Some("lint") => lint(),
        Some("test") => test(&args[1..]),
        Some("doc") => doc(),
        Some("tidy") => tidy::run(&root()),
        Some("interop") => interop::run(&root()),
        Some("mcp-e2e") => mcp_e2e::run(&root()),
        Some("bench") => bench(&args[1..]),
        Some("pg-start") => pg::pg_start(&root(), &args[1..]),
        Some("pg-stop") => pg::pg_stop(&root()),
        Some("reliability") => reliability::run(&root(), &args[1..]),
        None | Some("-h" | "--help" | "help") => {
            eprint!("{HELP}");
            Ok(())
        }
        Some(other) => Err(format!("unknown task `{other}`\n\n{HELP}")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
