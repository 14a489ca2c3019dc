//! The `terminal` toolset: `terminal` runs `/bin/sh -c COMMAND` through
//! the sandbox helper ([`crate::sandbox`]) with a scrubbed environment, in
//! its own process group that is killed at the timeout and when the
//! command ends, with its output capped (head and tail kept).

use std::ffi::OsString;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use serde_json::{Value, json};

use crate::args::Args;
use crate::sandbox::{SETUP_FAILED, SETUP_PREFIX};
use crate::workspace::Workspace;
use retinue_config::TerminalConfig;
use retinue_core::run::ToolError;

/// Output kept from one command (hermes's 50,000; 40 % head, 60 % tail).
pub const MAX_OUTPUT_CHARS: usize = 50_000;
/// Bytes read from a command's output before the rest is only counted.
const READ_CAP_BYTES: usize = 8 << 20;
/// The only variables a command sees (besides HOME and TMPDIR, set to its
/// private temp dir).
const PASSED_ENV: &[&str] = &["LANG", "LC_ALL", "TZ"];
/// PATH inside the sandbox.
const SANDBOX_PATH: &str = "/usr/local/bin:/usr/bin:/bin:/usr/local/sbin:/usr/sbin:/sbin";

/// How the sandbox helper is started: a program and the arguments that
/// come before the helper's own (`retinue __sandbox`, or the
/// `retinue-sandbox` binary with none).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Helper {
    /// The program.
    pub program: PathBuf,
    /// Leading arguments.
    pub prefix: Vec<OsString>,
}

/// `terminal`'s schema (hermes-agent 0.19's `terminal`, foreground only).
pub fn terminal_schema(config: &TerminalConfig) -> Value {
    json!({
        "name": "terminal",
        "description": format!(
            "Run a shell command (/bin/sh -c) in the workspace and return its output and exit code. \
             The command runs in a sandbox: it can write only inside the workspace and its own \
             temporary HOME, {} and sees no credentials in its environment. Commands run in the \
             foreground only (no background, pty or watch options); the process group is killed \
             at the timeout and when the command ends.",
            if config.network { "may use the network," } else { "has no network access," }
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The command to execute"},
                "timeout": {"type": "integer", "description": format!("Max seconds to wait (default: {}, max: {}). Returns as soon as the command finishes.", config.timeout_seconds, config.max_timeout_seconds), "minimum": 1},
                "workdir": {"type": "string", "description": "Working directory for this command, inside the workspace (default: the workspace root)."}
            },
            "required": ["command"]
        }
    })
}

/// The terminal of one process: its helper, its configuration and the
/// cached answer to "can the sandbox be set up here?".
#[derive(Debug)]
pub struct Terminal {
    config: TerminalConfig,
    helper: Option<Helper>,
    probe: Mutex<Option<(Result<String, String>, std::time::Instant)>>,
    /// One command at a time per workspace (the read-only names' binds and
    /// sweep assume no other command of this process runs there).
    locks: Mutex<std::collections::HashMap<PathBuf, std::sync::Arc<Mutex<()>>>>,
}

/// How long a failed sandbox probe is trusted before it is tried again
/// (a long-running server may see the system change).
const PROBE_RETRY: Duration = Duration::from_secs(60);

impl Terminal {
    /// A terminal running commands through `helper` (`None`: no helper, so
    /// commands run only with `sandbox: off`).
    pub fn new(config: TerminalConfig, helper: Option<Helper>) -> Terminal {
        Terminal { config, helper, probe: Mutex::new(None), locks: Mutex::new(Default::default()) }
    }

    /// The configuration.
    pub fn config(&self) -> &TerminalConfig {
        &self.config
    }

    /// Whether the sandbox can be set up here: `Ok(what it enforces)`, or
    /// [`ToolError::Refused`] saying why not. Probed once per process.
    pub fn sandbox_status(&self) -> Result<String, ToolError> {
        self.probed().map_err(ToolError::Refused)
    }

    /// The cached probe: what the sandbox enforces, or why it cannot be set up.
    fn probed(&self) -> Result<String, String> {
        let mut cached = self.probe.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some((r, at)) = cached.as_ref()
            && (r.is_ok() || at.elapsed() < PROBE_RETRY)
        {
            return r.clone();
        }
        let r = self.run_probe();
        *cached = Some((r.clone(), std::time::Instant::now()));
        r
    }

    fn run_probe(&self) -> Result<String, String> {
        let Some(helper) = &self.helper else {
            return Err("no sandbox helper is configured".to_owned());
        };
        let tmp = tempfile::tempdir().map_err(|e| format!("no temp dir: {e}"))?;
        let mut cmd = Command::new(&helper.program);
        cmd.args(&helper.prefix)
            .arg("--workspace")
            .arg(tmp.path())
            .arg("--probe")
            .env_clear()
            .stdin(Stdio::null());
        if self.config.network {
            cmd.arg("--network");
        }
        let probe = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start the sandbox helper: {e}"))?;
        let pid = probe.id();
        let out = probe.wait_with_output().map_err(|e| format!("the sandbox helper: {e}"))?;
        crate::sandbox::remove_process_cgroups(pid);
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            let err = String::from_utf8_lossy(&out.stderr);
            Err(err.trim().trim_start_matches(SETUP_PREFIX).to_owned())
        }
    }

    /// `terminal`.
    pub fn run(
        &self,
        ws: &Workspace,
        args: &Args<'_>,
        cancel: &retinue_core::run::CancelToken,
    ) -> Result<String, ToolError> {
        let command = args.required_str("command")?;
        if command.trim().is_empty() {
            return Err(ToolError::InvalidArguments("terminal: `command` is empty".to_owned()));
        }
        if args.boolean("background", false)? {
            return Err(ToolError::InvalidArguments(
                "terminal: background commands are not supported for subagents; run it in the \
                 foreground with a timeout"
                    .to_owned(),
            ));
        }
        let timeout = args.uint("timeout", self.config.timeout_seconds)?;
        if timeout > self.config.max_timeout_seconds {
            return Err(ToolError::InvalidArguments(format!(
                "terminal: timeout {timeout} is above the maximum of {} seconds",
                self.config.max_timeout_seconds
            )));
        }
        let timeout = Duration::from_secs(timeout.max(1));
        let lock = {
            let mut locks = self.locks.lock().unwrap_or_else(PoisonError::into_inner);
            if locks.len() > 256 {
                locks.retain(|_, l| std::sync::Arc::strong_count(l) > 1);
            }
            locks.entry(ws.root().to_path_buf()).or_default().clone()
        };
        // Waiting for another command there: bounded by this call's timeout
        // and its child's stop.
        let waiting = Instant::now();
        let _one_at_a_time = loop {
            match lock.try_lock() {
                Ok(g) => break g,
                Err(std::sync::TryLockError::Poisoned(p)) => break p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {
                    if cancel.is_cancelled() {
                        return Err(ToolError::Failed(
                            "terminal: the child was stopped before its command started".to_owned(),
                        ));
                    }
                    if waiting.elapsed() >= timeout {
                        return Err(ToolError::Failed(format!(
                            "terminal: another command is running in this workspace; none ran \
                             (waited {} s)",
                            timeout.as_secs()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        };
        ws.hidden_intact()?;
        // A read-only name that is a symbolic link cannot be bound read-only.
        for name in crate::workspace::READ_ONLY_NAMES {
            let at = ws.root().join(name);
            if std::fs::symlink_metadata(&at).is_ok_and(|m| m.file_type().is_symlink()) {
                return Err(ToolError::Refused(format!(
                    "`{name}` at the top of the workspace is a symbolic link, so the terminal \
                     cannot keep it read-only; commands are refused in this workspace"
                )));
            }
        }
        let workdir = ws.inside(args.str_or("workdir", ".")?)?;
        // Beneath the root with no symlink on the way (and not hidden).
        ws.check(&workdir)?;
        let cwd = ws.root().join(workdir.rel());
        if !cwd.is_dir() {
            return Err(ToolError::Failed(format!(
                "terminal: workdir `{}` is not a directory in the workspace",
                workdir.shown()
            )));
        }
        let sandboxed = match self.probed() {
            Ok(_) => true,
            Err(why) if self.config.sandbox => {
                return Err(ToolError::Refused(format!(
                    "the terminal sandbox cannot be set up here ({why}); commands are refused. \
                     The operator may set `delegation.terminal.sandbox: off` to run them \
                     unconfined"
                )));
            }
            Err(_) => false,
        };
        // Sandboxed: HOME is the private tmpfs the helper mounts on /tmp.
        // Unsandboxed: a temp dir of its own, removed afterwards.
        let home = if sandboxed {
            None
        } else {
            Some(
                tempfile::Builder::new()
                    .prefix("retinue-term-")
                    .tempdir()
                    .map_err(|e| ToolError::Failed(format!("terminal: no temp dir: {e}")))?,
            )
        };
        let home_dir =
            home.as_ref().map_or_else(|| PathBuf::from("/tmp"), |h| h.path().to_path_buf());
        let mut cmd = match (&self.helper, sandboxed) {
            (Some(helper), true) => {
                let mut c = Command::new(&helper.program);
                c.args(&helper.prefix).arg("--workspace").arg(ws.root());
                if self.config.network {
                    c.arg("--network");
                }
                for p in ws.hidden() {
                    c.arg("--hide").arg(p);
                }
                for p in ws.read_only_present() {
                    c.arg("--read-only").arg(p);
                }
                c.arg("--").arg(command);
                c
            }
            _ => {
                let mut c = Command::new("/bin/sh");
                // `--`: a command that starts with `-` is a command, not an option.
                c.arg("-c").arg("--").arg(command);
                c
            }
        };
        cmd.current_dir(&cwd).env_clear();
        for key in PASSED_ENV {
            if let Some(v) = std::env::var_os(key) {
                cmd.env(key, v);
            }
        }
        cmd.env("PATH", SANDBOX_PATH)
            .env("TERM", "dumb")
            .env("HOME", &home_dir)
            .env("TMPDIR", &home_dir)
            .process_group(0)
            .stdin(Stdio::null());
        let (reader, writer) =
            std::io::pipe().map_err(|e| ToolError::Failed(format!("terminal: pipe: {e}")))?;
        // Sandboxed, the helper's stderr is its setup channel (the command's
        // stderr goes to the output pipe, see the helper); unconfined, the
        // shell's stderr is the output.
        let (control, control_writer) =
            std::io::pipe().map_err(|e| ToolError::Failed(format!("terminal: pipe: {e}")))?;
        if sandboxed {
            cmd.stdout(writer).stderr(control_writer);
        } else {
            let writer2 = writer
                .try_clone()
                .map_err(|e| ToolError::Failed(format!("terminal: pipe: {e}")))?;
            drop(control_writer);
            cmd.stdout(writer).stderr(writer2);
        }
        // The readers start before the command: no error path after its start
        // can leave it running unswept.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("terminal-output".into())
            .spawn(move || {
                let _ = tx.send(read_capped(reader));
            })
            .map_err(|e| ToolError::Failed(format!("terminal: {e}")))?;
        let (ctl_tx, ctl_rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("terminal-setup".into())
            .spawn(move || {
                let mut text = String::new();
                let _ = control.take(64 << 10).read_to_string(&mut text);
                let _ = ctl_tx.send(text);
            })
            .map_err(|e| ToolError::Failed(format!("terminal: {e}")))?;
        // Read-only names the command might create where none was (the
        // sandbox can bind only what exists): removed after it, below.
        let absent: Vec<PathBuf> = if sandboxed {
            let present = ws.read_only_present();
            crate::workspace::READ_ONLY_NAMES
                .iter()
                .map(|n| ws.root().join(n))
                .filter(|p| !present.contains(p))
                .collect()
        } else {
            Vec::new()
        };
        let mut child = cmd
            .spawn()
            .map_err(|e| ToolError::Failed(format!("terminal: cannot start the command: {e}")))?;
        // The pipe's write ends now live only in the command's group.
        drop(cmd);
        let group = Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
        let started = Instant::now();
        let mut timed_out = false;
        // Wait for the leader to exit without reaping it, so its process
        // group id cannot be reused before the group is killed.
        use nix::sys::wait::{Id, WaitPidFlag, WaitStatus, waitid};
        // The sandbox's PID namespace, to count what the command started
        // (RLIMIT_NPROC does not bind root; this watch does).
        let helper_pid = child.id();
        // The namespace is held open while it is used, so its number cannot
        // pass to another namespace (whose processes would then be killed).
        let mut pid_ns: Option<(PathBuf, std::fs::File)> = None;
        if sandboxed {
            // The helper unshares at once: its namespace is known before the
            // command can do anything, so it can be killed whatever it does.
            for _ in 0..50 {
                pid_ns = hold_namespace(helper_pid);
                let exited = !matches!(
                    waitid(
                        Id::Pid(group),
                        WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT
                    ),
                    Ok(WaitStatus::StillAlive)
                );
                if pid_ns.is_some() || exited {
                    break;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        let mut last_count = Instant::now();
        let mut too_many = false;
        let mut stopped = false;
        loop {
            let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
            match waitid(Id::Pid(group), flags) {
                Ok(WaitStatus::StillAlive) => {}
                Ok(_) | Err(_) => break,
            }
            if started.elapsed() >= timeout {
                timed_out = true;
                break;
            }
            if cancel.is_cancelled() {
                stopped = true;
                break;
            }
            if sandboxed && last_count.elapsed() >= PROCESS_WATCH {
                last_count = Instant::now();
                if pid_ns.is_none() {
                    pid_ns = hold_namespace(helper_pid);
                }
                if let Some((ns, _)) = &pid_ns
                    && processes_in(ns) > MAX_PROCESSES
                {
                    too_many = true;
                    break;
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // Whatever the command left running in its group goes too, and —
        // sandboxed — everything in its cgroup and its PID namespace (a
        // shell that left the group with `setsid` would outlive the call).
        let _ = killpg(group, Signal::SIGKILL);
        let status = child.wait().ok();
        if sandboxed {
            crate::sandbox::kill_process_cgroups(helper_pid);
            if let Some((ns, _held)) = &pid_ns {
                kill_namespace(ns);
            }
        }
        // The helper's pids cgroup (empty now) goes too.
        crate::sandbox::remove_process_cgroups(helper_pid);
        // Nothing of the command runs any more: what it made at read-only
        // names goes, whatever the outcome.
        let removed = remove_created(&absent);
        let setup = ctl_rx.recv_timeout(Duration::from_secs(5)).unwrap_or_default();
        let (bytes, total) = rx.recv_timeout(Duration::from_secs(5)).unwrap_or_else(|_| {
            (b"[output unavailable: a process outside the group kept it open]".to_vec(), 0)
        });
        let code = status.and_then(|s| s.code()).unwrap_or(-1);
        let text = String::from_utf8_lossy(&bytes);
        if sandboxed && code == SETUP_FAILED && setup.starts_with(SETUP_PREFIX) {
            return Err(ToolError::Refused(format!(
                "the terminal sandbox could not be set up: {}",
                setup.trim().trim_start_matches(SETUP_PREFIX)
            )));
        }
        let mut output = cap_output(&strip_ansi(&text));
        if sandboxed && code != 0 && !setup.trim().is_empty() {
            output.push_str(&format!("\n[sandbox helper: {}]", cap_output(setup.trim())));
        }
        if total > bytes.len() {
            output.push_str(&format!(
                "\n\n[output cut: the command wrote {total} bytes; the first {} were read]",
                bytes.len()
            ));
        }
        let mut out = json!({"output": output.trim(), "exit_code": if timed_out { 124 } else { code }, "error": null});
        if !removed.is_empty() {
            out["warning"] = json!(format!(
                "removed what the command created at read-only names ({}): files there make \
                 code run later outside the sandbox",
                removed.join(", ")
            ));
        }
        if timed_out {
            out["error"] = json!(format!(
                "the command timed out after {} s; its process group was killed",
                timeout.as_secs()
            ));
        }
        if stopped {
            out["exit_code"] = json!(137);
            out["error"] = json!("the child was stopped; the command was killed");
        }
        if too_many {
            out["exit_code"] = json!(137);
            out["error"] = json!(format!(
                "the command started more than {MAX_PROCESSES} processes and was killed"
            ));
        }
        if !sandboxed {
            out["warning"] = json!("ran without a sandbox (delegation.terminal.sandbox: off)");
        }
        Ok(out.to_string())
    }
}

/// Removes each of `paths` that exists now (a file, a link or a whole
/// directory, links never followed); returns their names.
fn remove_created(paths: &[PathBuf]) -> Vec<String> {
    let mut out = Vec::new();
    for p in paths {
        let Ok(meta) = std::fs::symlink_metadata(p) else { continue };
        let gone = if meta.is_dir() { std::fs::remove_dir_all(p) } else { std::fs::remove_file(p) };
        if gone.is_ok() {
            out.push(p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default());
        }
    }
    out
}

/// The most processes one sandboxed command may have at once (the watch's
/// bound, where no cgroup or rlimit holds it).
pub const MAX_PROCESSES: usize = crate::sandbox::MAX_PROCESSES as usize;
/// How often the processes of a running command are counted.
const PROCESS_WATCH: Duration = Duration::from_millis(20);

/// The PID namespace the helper `pid` starts its command in.
fn namespace_of(pid: u32) -> Option<PathBuf> {
    let link = std::fs::read_link(format!("/proc/{pid}/ns/pid_for_children")).ok()?;
    let own = std::fs::read_link("/proc/self/ns/pid").ok()?;
    // Not yet unshared: nothing to count.
    (link != own).then_some(link)
}

/// The PID namespace the helper `pid` starts its command in, held open
/// (its link text and an open handle on it).
fn hold_namespace(pid: u32) -> Option<(PathBuf, std::fs::File)> {
    let link = namespace_of(pid)?;
    let file = std::fs::File::open(format!("/proc/{pid}/ns/pid_for_children")).ok()?;
    // The same namespace as the link named (the helper may have gone).
    let again = std::fs::read_link(format!("/proc/{pid}/ns/pid_for_children")).ok()?;
    (again == link).then_some((link, file))
}

/// Kills every process living in the PID namespace `ns` (its init first:
/// the kernel then kills the rest) and waits a moment for them to go.
fn kill_namespace(ns: &std::path::Path) {
    for _ in 0..100 {
        let Ok(dir) = std::fs::read_dir("/proc") else { return };
        let pids: Vec<i32> = dir
            .flatten()
            .filter(|e| std::fs::read_link(e.path().join("ns/pid")).is_ok_and(|l| l == ns))
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
            .collect();
        if pids.is_empty() {
            return;
        }
        for p in pids {
            let _ = nix::sys::signal::kill(Pid::from_raw(p), Signal::SIGKILL);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Processes living in the PID namespace `ns`.
fn processes_in(ns: &std::path::Path) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc") else { return 0 };
    dir.flatten()
        .filter(|e| e.file_name().as_encoded_bytes().iter().all(u8::is_ascii_digit))
        .filter(|e| std::fs::read_link(e.path().join("ns/pid")).is_ok_and(|l| l == ns))
        .count()
}

/// Reads a command's output: the first [`READ_CAP_BYTES`] kept, the rest
/// counted and dropped (so a `yes` cannot fill memory).
fn read_capped(mut r: impl Read) -> (Vec<u8>, usize) {
    let mut kept = Vec::new();
    let mut total = 0usize;
    let mut buf = [0u8; 64 << 10];
    loop {
        match r.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                total = total.saturating_add(n);
                let room = READ_CAP_BYTES.saturating_sub(kept.len());
                kept.extend_from_slice(&buf[..n.min(room)]);
            }
        }
    }
    (kept, total)
}

/// hermes's cap: 40 % head and 60 % tail of [`MAX_OUTPUT_CHARS`], with a note.
pub fn cap_output(output: &str) -> String {
    let len = output.chars().count();
    if len <= MAX_OUTPUT_CHARS {
        return output.to_owned();
    }
    let head = MAX_OUTPUT_CHARS * 2 / 5;
    let tail = MAX_OUTPUT_CHARS - head;
    let omitted = len - head - tail;
    let h: String = output.chars().take(head).collect();
    let t: String = output.chars().skip(len - tail).collect();
    format!("{h}\n\n... [OUTPUT TRUNCATED - {omitted} chars omitted out of {len} total] ...\n\n{t}")
}

/// Drops ANSI escape sequences (CSI and OSC), so the model never copies them.
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\u{1b}' {
            out.push(c);
            continue;
        }
        match chars.peek() {
            Some('[') => {
                chars.next();
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            Some(']') => {
                chars.next();
                while let Some(c) = chars.next() {
                    if c == '\u{7}' {
                        break;
                    }
                    if c == '\u{1b}' && chars.peek() == Some(&'\\') {
                        chars.next();
                        break;
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// The helper binary of this crate next to the running test or program
/// (`retinue-sandbox`), when it exists.
pub fn sibling_helper(name: &str) -> Option<Helper> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [dir.join(name), dir.parent().map(|p| p.join(name)).unwrap_or_default()]
        .into_iter()
        .find(|p| p.is_file())
        .map(|program| Helper { program, prefix: Vec::new() })
}
