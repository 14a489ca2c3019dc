//! `cargo xtask`: everything CI does, runnable locally.
//!
//! `cargo xtask ci` runs fmt --check, clippy (all targets, `-D warnings`),
//! the test suite (nextest when installed, else `cargo test`, then doctests),
//! the hermes-agent interop suite, the `retinue mcp` end-to-end test with the
//! Python MCP SDK, rustdoc with warnings denied, `tidy`, and
//! a `--quick` smoke run of the benchmark (no timing asserted).

mod bench;
mod docs;
mod interop;
mod mcp_e2e;
mod mcp_inspector;
mod pg;
mod reliability;
mod seams;
mod sizes;
mod tidy;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

const HELP: &str = "\
cargo xtask <task>

tasks:
  ci      fmt, lint, test, interop, mcp-e2e, doc, tidy, package and a bench smoke run, fail-fast
          (what CI runs)
  fmt     cargo fmt --all -- --check
  lint    cargo clippy --workspace --all-targets --all-features -- -D warnings
  test    the whole test suite (nextest where installed, else cargo test) and doctests, the
          PostgreSQL tests against RETINUE_PG_URL or a throwaway cluster started here
          (`test -p CRATE …`: cargo test with those arguments only)
  pg-start  start a throwaway PostgreSQL cluster in target/pg-cluster, print its export line
          (--minutes N: stops by itself after N minutes, default 120)
  pg-stop   stop it
  doc     cargo doc --workspace --no-deps with warnings denied, then the shell completions and
          the man page into target/dist/
  tidy    source hygiene and crate-boundary checks
  package `cargo package` (with its verify build) of every publishable crate, in dependency order
  sizes   the shipped files and functions over tidy's size limits (xtask/src/sizes.allow's lines)
  interop share a state.db with the published Python hermes-agent (downloads its wheel)
  mcp-e2e `retinue mcp` driven by the official Python MCP SDK (pip-installs `mcp` into target/)
  reliability  kill -9, contention and lineage-oracle harnesses (--full: release, full size;
               --backend pg: the PostgreSQL contention and killed-host harness)
  bench   the registry benchmark on SQLite and PostgreSQL (a throwaway cluster), writing
          docs/benchmarks.json and its block in docs/benchmarks.md; the throughput example
          (three runs per shape) into docs/throughput.json and its block; then the child
          runtime's and the tools' (--throughput: the throughput section alone; --quick: a smoke run, its report in target/bench/ checked against
          docs/'s shape; --render: the block again from docs/benchmarks.json; --only/--n: a
          partial SQLite run, no report; --backend pg [--scale]
          [--explain FILE]: the PostgreSQL rows alone)
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
        .env("RUSTDOCFLAGS", "-D warnings"))?;
    dist()
}

/// The shell completions and the man page, generated by the binary itself
/// into `target/dist/` (what a package ships next to `retinue`).
fn dist() -> Result<(), String> {
    run(cargo().args(["build", "--locked", "-p", "retinue-cli"]))?;
    let target = root().join("target");
    let bin = target.join("debug").join("retinue");
    let out = target.join("dist");
    std::fs::create_dir_all(out.join("completions"))
        .and_then(|()| std::fs::create_dir_all(out.join("man")))
        .map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    let jobs: [(&[&str], PathBuf); 6] = [
        (&["completions", "bash"], out.join("completions/retinue.bash")),
        (&["completions", "zsh"], out.join("completions/_retinue")),
        (&["completions", "fish"], out.join("completions/retinue.fish")),
        (&["completions", "elvish"], out.join("completions/retinue.elv")),
        (&["completions", "powershell"], out.join("completions/_retinue.ps1")),
        (&["man"], out.join("man/retinue.1")),
    ];
    for (args, path) in jobs {
        let o = Command::new(&bin)
            .args(args)
            .output()
            .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
        if !o.status.success() || o.stdout.len() < 200 {
            return Err(format!("`retinue {}` produced no usable output", args.join(" ")));
        }
        std::fs::write(&path, &o.stdout).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let version = Command::new(&bin).arg("--version").output().map_err(|e| e.to_string())?;
    let version = String::from_utf8_lossy(&version.stdout).trim().to_owned();
    // In a git checkout (as CI is), the version must name the commit.
    let in_git = Command::new("git")
        .args(["rev-parse", "--verify", "HEAD"])
        .current_dir(root())
        .output()
        .is_ok_and(|o| o.status.success());
    if in_git && (!version.contains('(') || version.contains("(unknown")) {
        return Err(format!("`retinue --version` names no commit: {version}"));
    }
    eprintln!("xtask: {version}; completions and man page in {}", out.display());
    Ok(())
}

/// The harness crates: never published (`publish = false`), so not packaged.
const HARNESSES: &[&str] =
    &["retinue-bench", "retinue-torture", "retinue-testkit", "retinue-interop", "xtask"];

/// Packages every publishable crate as a registry would receive it, each
/// built from its own tarball against the others' (cargo orders them), so
/// a manifest that names a file outside its crate, an unversioned
/// dependency or a dependency on a harness fails here, before a release.
fn package() -> Result<(), String> {
    let mut cmd = cargo();
    cmd.args(["package", "--workspace", "--locked", "--allow-dirty"]);
    for harness in HARNESSES {
        cmd.args(["--exclude", harness]);
    }
    run(&mut cmd)
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
            .and_then(|()| package())
            // A smoke run of the benchmark (small N): it must build and run; no timing is asserted.
            .and_then(|()| bench::bench(&["--quick".to_owned()])),
        Some("fmt") => fmt(),
        Some("lint") => lint(),
        Some("test") => test(&args[1..]),
        Some("doc") => doc(),
        Some("tidy") => tidy::run(&root()),
        Some("package") => package(),
        // The lines of xtask/src/sizes.allow as the code stands.
        Some("sizes") => {
            for item in sizes::measure(&root()) {
                println!("{} {}", item.lines, item.key);
            }
            Ok(())
        }
        Some("interop") => interop::run(&root()),
        Some("mcp-e2e") => mcp_e2e::run(&root()),
        Some("bench") => bench::bench(&args[1..]),
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
