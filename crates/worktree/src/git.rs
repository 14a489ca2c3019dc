//! Running the `git` CLI: a clean environment (no `GIT_DIR` and friends
//! from the caller, no hooks, no pager, no prompts, no signing), typed
//! errors with what git said.

use std::ffi::OsStr;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

use retinue_core::run::IsolationError;

/// Variables that would point git somewhere else than the repository
/// named on the command line.
const CLEARED: &[&str] = &[
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_INDEX_FILE",
    "GIT_OBJECT_DIRECTORY",
    "GIT_ALTERNATE_OBJECT_DIRECTORIES",
    "GIT_COMMON_DIR",
    "GIT_NAMESPACE",
    "GIT_CEILING_DIRECTORIES",
    "GIT_CONFIG_PARAMETERS",
    "GIT_CONFIG_COUNT",
];

/// One git invocation.
pub(crate) struct Git {
    cmd: Command,
    what: String,
    input: Option<Vec<u8>>,
}

/// What a git command printed and how it exited.
pub(crate) struct Output {
    pub(crate) stdout: Vec<u8>,
    pub(crate) code: Option<i32>,
}

impl Output {
    /// Stdout as text, trimmed.
    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.stdout).trim().to_owned()
    }
}

impl Git {
    /// `git -C dir ARGS…`.
    pub(crate) fn at(dir: &Path) -> Git {
        let mut cmd = Command::new("git");
        for v in CLEARED {
            cmd.env_remove(v);
        }
        cmd.env("GIT_TERMINAL_PROMPT", "0")
            .env("GIT_PAGER", "cat")
            .env("LC_ALL", "C")
            .env("GIT_AUTHOR_NAME", "retinue")
            .env("GIT_AUTHOR_EMAIL", "retinue@localhost")
            .env("GIT_COMMITTER_NAME", "retinue")
            .env("GIT_COMMITTER_EMAIL", "retinue@localhost")
            .arg("-C")
            .arg(dir)
            .args(["-c", "core.hooksPath=/dev/null", "-c", "commit.gpgSign=false"])
            .args(["-c", "core.quotePath=false", "-c", "advice.detachedHead=false"])
            // Never start a program the repository's files could name.
            .args(["-c", "core.fsmonitor=false", "-c", "diff.ignoreSubmodules=all"])
            .args(["-c", "submodule.recurse=false", "-c", "status.submoduleSummary=false"]);
        Git { cmd, what: String::new(), input: None }
    }

    /// Adds arguments (the first non-option one names the operation).
    pub(crate) fn args<I, S>(mut self, args: I) -> Git
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        for a in args {
            if self.what.is_empty() {
                let s = a.as_ref().to_string_lossy();
                if !s.starts_with('-') {
                    self.what = s.into_owned();
                }
            }
            self.cmd.arg(a);
        }
        self
    }

    /// Sets an environment variable.
    pub(crate) fn env(mut self, key: &str, value: impl AsRef<OsStr>) -> Git {
        self.cmd.env(key, value);
        self
    }

    /// Feeds `input` on stdin.
    pub(crate) fn stdin(mut self, input: Vec<u8>) -> Git {
        self.input = Some(input);
        self
    }

    /// Runs; any exit status is returned (the caller decides).
    pub(crate) fn run_any(mut self) -> Result<(Output, String), IsolationError> {
        let io = |e: std::io::Error| IsolationError::Git {
            operation: self.what.clone(),
            message: format!("could not run git: {e}"),
        };
        self.cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        self.cmd.stdin(if self.input.is_some() { Stdio::piped() } else { Stdio::null() });
        let mut child = self.cmd.spawn().map_err(io)?;
        if let (Some(input), Some(mut pipe)) = (self.input.take(), child.stdin.take()) {
            // A writer thread: git may fill stdout before reading all input.
            let writer = std::thread::spawn(move || pipe.write_all(&input));
            let out = child.wait_with_output().map_err(io)?;
            let _ = writer.join();
            return Ok(finish(out));
        }
        let out = child.wait_with_output().map_err(io)?;
        Ok(finish(out))
    }

    /// Runs and requires exit 0.
    pub(crate) fn run(self) -> Result<Output, IsolationError> {
        let what = self.what.clone();
        let (out, err) = self.run_any()?;
        if out.code == Some(0) {
            Ok(out)
        } else {
            Err(IsolationError::Git { operation: what, message: clip(&err) })
        }
    }
}

fn finish(out: std::process::Output) -> (Output, String) {
    let err = String::from_utf8_lossy(&out.stderr).trim().to_owned();
    (Output { stdout: out.stdout, code: out.status.code() }, err)
}

/// What git said, bounded.
pub(crate) fn clip(text: &str) -> String {
    retinue_core::truncate_chars(text, 1000)
}
