//! `cargo xtask mcp-e2e`: `retinue mcp` driven by two independent clients,
//! the official Python MCP SDK, then the MCP Inspector CLI (the TypeScript
//! SDK; [`crate::mcp_inspector`]).
//!
//! 1. Creates a venv under `target/mcp-e2e/venv` (once) and installs the
//!    pinned `mcp` release from PyPI into it.
//! 2. Builds `retinue` and testkit's `fake_model` example, starts the fake
//!    model (127.0.0.1, ephemeral port; it prints its base URL) and writes a
//!    `config.yaml` pointing the children at it into a fresh home.
//! 3. Runs `crates/mcp/e2e/mcp_e2e.py`, which spawns `retinue mcp` over stdio
//!    in two project directories and runs the story; its transcript is kept
//!    in `target/mcp-e2e/transcript.txt`.
//!
//! `PYTHON` names the interpreter that creates the venv (default `python3`).

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use crate::run as exec;

/// The `mcp` release the end-to-end test is pinned to.
pub(crate) const MCP_VERSION: &str = "2.3.0";

/// Kills the fake model server when the task ends, however it ends.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn venv_python(venv: &Path) -> std::path::PathBuf {
    if cfg!(windows) { venv.join("Scripts/python.exe") } else { venv.join("bin/python") }
}

/// The venv with `mcp` installed, created once.
fn ensure_venv(base: &Path) -> Result<std::path::PathBuf, String> {
    let venv = base.join("venv");
    let python = venv_python(&venv);
    let marker = venv.join(format!(".mcp-{MCP_VERSION}"));
    if marker.is_file() && python.is_file() {
        return Ok(python);
    }
    let host = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
    exec(Command::new(&host).args(["-m", "venv"]).arg(&venv))?;
    exec(
        Command::new(&python)
            .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"])
            .arg(format!("mcp=={MCP_VERSION}")),
    )
    .map_err(|e| format!("installing mcp=={MCP_VERSION} from PyPI: {e}"))?;
    fs::write(&marker, "").map_err(|e| format!("cannot write {}: {e}", marker.display()))?;
    Ok(python)
}

pub(crate) fn run(root: &Path) -> Result<(), String> {
    let target = crate::interop::target_dir(root);
    let base = target.join("mcp-e2e");
    fs::create_dir_all(&base).map_err(|e| format!("cannot create {}: {e}", base.display()))?;
    let python = ensure_venv(&base)?;
    crate::build_workspace("dev")?;
    let retinue = crate::built("dev", "retinue", false);
    let fake = crate::built("dev", "fake_model", true);

    let run_dir = base.join("run");
    if run_dir.exists() {
        fs::remove_dir_all(&run_dir)
            .map_err(|e| format!("cannot clean {}: {e}", run_dir.display()))?;
    }
    let home = run_dir.join("home");
    let (a, b) = (run_dir.join("project-a"), run_dir.join("project-b"));
    let c = run_dir.join("project-c");
    for dir in [&home, &a, &b, &c] {
        fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }

    let mut model = Killed(
        Command::new(&fake)
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", fake.display()))?,
    );
    let stdout = model.0.stdout.take().ok_or("the fake model has no stdout")?;
    let mut url = String::new();
    BufReader::new(stdout)
        .read_line(&mut url)
        .map_err(|e| format!("reading the fake model's base URL: {e}"))?;
    let url = url.trim();
    if !url.starts_with("http://127.0.0.1:") {
        return Err(format!("the fake model printed no base URL (got {url:?})"));
    }
    // A child's MCP toolset: a server on the official Python SDK (FastMCP).
    let echo = root.join("crates/mcp/e2e/echo_server.py");
    let config = format!(
        "delegation:\n  model: fake-model\n  base_url: {url}\n  toolsets: [read, file]\n\
         \x20 approvals: {{timeout_s: 60}}\n\
         mcp_servers:\n  pyecho:\n    command: {}\n    args: [{}]\n    timeout: 30\n",
        python.display(),
        echo.display()
    );
    fs::write(home.join("config.yaml"), config).map_err(|e| format!("writing config.yaml: {e}"))?;

    let output = Command::new(&python)
        .arg(root.join("crates/mcp/e2e/mcp_e2e.py"))
        .arg(&retinue)
        .arg(&home)
        .arg(&a)
        .arg(&b)
        .arg(&c)
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("cannot run the Python MCP client: {e}"))?;
    let transcript = String::from_utf8_lossy(&output.stdout);
    eprint!("{transcript}");
    let path = base.join("transcript.txt");
    fs::write(&path, transcript.as_bytes())
        .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    if !output.status.success() {
        return Err(format!("the Python MCP client failed ({})", output.status));
    }
    eprintln!("mcp-e2e: ok with mcp {MCP_VERSION} (transcript in {})", path.display());
    // The second independent client, on the TypeScript SDK (its own project:
    // its own session).
    let d = run_dir.join("project-inspector");
    fs::create_dir_all(&d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
    let result = crate::mcp_inspector::run(&base, &retinue, &home, &d);
    drop(model);
    result
}
