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
  package `cargo package` of every publishable crate, then the tarballs built as one workspace
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

/// Builds every binary and example of the workspace in `profile` with the
/// test build's feature resolution (`--workspace --all-features`), so that
/// after `cargo xtask test` nothing is compiled again: a `-p CRATE` build
/// resolves its dependencies' features for that crate alone and rebuilt a
/// dozen of them (minutes of CI) for the interop, MCP and bench steps.
fn build_workspace(profile: &str) -> Result<(), String> {
    run(cargo().args([
        "build",
        "--workspace",
        "--all-features",
        "--locked",
        "--bins",
        "--examples",
        "--profile",
        profile,
    ]))
}

/// The path of a binary (`example: false`) or an example that
/// [`build_workspace`] built in `profile`.
fn built(profile: &str, name: &str, example: bool) -> PathBuf {
    let dir = if profile == "dev" { "debug" } else { profile };
    let mut path = interop::target_dir(&root()).join(dir);
    if example {
        path.push("examples");
    }
    path.join(format!("{name}{}", std::env::consts::EXE_SUFFIX))
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
    build_workspace("dev")?;
    let target = root().join("target");
    let bin = built("dev", "retinue", false);
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

/// Packages every publishable crate as a registry would receive it, then
/// builds the tarballs, each against the others' tarballs, so a manifest
/// that names a file outside its crate, an unversioned dependency or a
/// dependency on a harness fails here, before a release.
///
/// The build is ours, not `cargo package`'s verify step: that one builds
/// each crate as a workspace of its own, resolving every dependency's
/// features anew per crate (tokio, serde and rustls compiled three times
/// over: 9–10 of CI's minutes), and it takes a second run's sibling crates
/// from the first run's unpacked copies. Here the unpacked tarballs are one
/// workspace (`[patch.crates-io]` points each name at its tarball) built
/// with the test build's features into the same target directory, so only
/// the packaged crates themselves are compiled.
fn package() -> Result<(), String> {
    let target = interop::target_dir(&root());
    let packages = target.join("package");
    // Tarballs of an earlier run (another version, a crate since renamed)
    // would be built too: only this run's are.
    if let Ok(entries) = std::fs::read_dir(&packages) {
        for entry in entries.flatten() {
            if entry.file_name().to_string_lossy().ends_with(".crate") {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
    let mut cmd = cargo();
    cmd.args(["package", "--workspace", "--locked", "--allow-dirty", "--no-verify"]);
    for harness in HARNESSES {
        cmd.args(["--exclude", harness]);
    }
    run(&mut cmd)?;
    let verify = packages.join("verify");
    if verify.exists() {
        std::fs::remove_dir_all(&verify).map_err(|e| format!("{}: {e}", verify.display()))?;
    }
    std::fs::create_dir_all(&verify).map_err(|e| format!("{}: {e}", verify.display()))?;
    let mut members = Vec::new();
    let mut patches = String::new();
    let entries =
        std::fs::read_dir(&packages).map_err(|e| format!("{}: {e}", packages.display()))?;
    for entry in entries.flatten() {
        let file = entry.file_name().to_string_lossy().into_owned();
        let Some(unpacked) = file.strip_suffix(".crate") else { continue };
        run(Command::new("tar").arg("-xzf").arg(entry.path()).arg("-C").arg(&verify))?;
        let name = package_name(&verify.join(unpacked).join("Cargo.toml"))?;
        patches.push_str(&format!("{name} = {{ path = \"{unpacked}\" }}\n"));
        members.push(format!("\"{unpacked}\""));
    }
    if members.is_empty() {
        return Err(format!("`cargo package` left no .crate file in {}", packages.display()));
    }
    members.sort();
    let manifest = format!(
        "[workspace]\nresolver = \"3\"\nmembers = [{}]\n\n[patch.crates-io]\n{patches}",
        members.join(", ")
    );
    std::fs::write(verify.join("Cargo.toml"), manifest).map_err(|e| e.to_string())?;
    std::fs::copy(root().join("Cargo.lock"), verify.join("Cargo.lock"))
        .map_err(|e| format!("copying Cargo.lock: {e}"))?;
    eprintln!("xtask: building the {} packaged crates from their tarballs", members.len());
    // The root's `.cargo/config.toml` (the dev profile) named explicitly:
    // with CARGO_TARGET_DIR elsewhere it is not above `verify`.
    let status = cargo()
        .arg("--config")
        .arg(root().join(".cargo").join("config.toml"))
        .args(["build", "--workspace", "--all-features", "--offline"])
        .env("CARGO_TARGET_DIR", &target)
        .current_dir(&verify)
        .status()
        .map_err(|e| format!("cannot run cargo build: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("the packaged crates do not build from their tarballs ({status})"))
    }
}

/// The `[package]` name of a manifest (`name-version` cannot be split at
/// a dash: names and pre-release versions both hold them).
fn package_name(manifest: &Path) -> Result<String, String> {
    let text =
        std::fs::read_to_string(manifest).map_err(|e| format!("{}: {e}", manifest.display()))?;
    let mut in_package = false;
    for line in text.lines().map(str::trim) {
        if line.starts_with('[') {
            in_package = line == "[package]";
        } else if in_package
            && let Some(value) = line.strip_prefix("name").map(str::trim_start)
            && let Some(value) = value.strip_prefix('=')
        {
            return Ok(value.trim().trim_matches('"').to_owned());
        }
    }
    Err(format!("{}: no [package] name", manifest.display()))
}

/// One step of `cargo xtask ci`.
type Step<'a> = (&'a str, &'a dyn Fn() -> Result<(), String>);

/// What CI runs, fail-fast, each step's time printed (and a summary at the end).
fn ci() -> Result<(), String> {
    let root = root();
    let steps: [Step<'_>; 9] = [
        ("fmt", &fmt),
        ("lint", &lint),
        ("test", &|| test(&[])),
        ("interop", &|| interop::run(&root)),
        ("mcp-e2e", &|| mcp_e2e::run(&root)),
        ("doc", &doc),
        ("tidy", &|| tidy::run(&root)),
        ("package", &package),
        // A smoke run of the benchmark (small N): it must build and run; no timing is asserted.
        ("bench --quick", &|| bench::bench(&["--quick".to_owned()])),
    ];
    let mut times = Vec::new();
    for (name, step) in steps {
        let start = std::time::Instant::now();
        let result = step();
        times.push(format!("{name} {:.0}s", start.elapsed().as_secs_f64()));
        eprintln!("xtask: step {}", times.join(", "));
        result?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("ci") => ci(),
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
