//! Owner liveness: whether the process that dispatched a unit still runs
//! (used by restart recovery, semantics §3.8).

/// What a liveness probe says about a process id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessState {
    /// Running, with its start-time fingerprint when known.
    Alive {
        /// hermes's fingerprint (Linux stat field 22).
        started_at: Option<i64>,
    },
    /// No such process.
    Dead,
}

/// Probes whether a unit's owner process still runs.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait OwnerProbe: Send + Sync {
    /// `None` when liveness cannot be probed on this platform.
    fn probe(&self, pid: i64) -> Option<ProcessState>;
}

/// The `/proc` probe (Linux); elsewhere it reports "cannot probe".
#[derive(Debug, Default, Clone, Copy)]
pub struct ProcProbe;

/// Field 22 (`starttime`) of `/proc/<pid>/stat`.
fn proc_start_time(pid: i64) -> std::io::Result<Option<i64>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    // `rest` starts at field 3, so field 22 is index 19.
    Ok(rest.split_whitespace().nth(19).and_then(|f| f.parse().ok()))
}

impl OwnerProbe for ProcProbe {
    fn probe(&self, pid: i64) -> Option<ProcessState> {
        if !std::path::Path::new("/proc/self/stat").exists() {
            return None;
        }
        if pid <= 0 {
            return Some(ProcessState::Dead);
        }
        match proc_start_time(pid) {
            Ok(started_at) => Some(ProcessState::Alive { started_at }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Some(ProcessState::Dead),
            Err(_) => None,
        }
    }
}

/// This process's id and fingerprint, for `owner_pid`/`owner_started_at`.
pub fn current_owner() -> (i64, Option<i64>) {
    let pid = i64::from(std::process::id());
    (pid, proc_start_time(pid).ok().flatten())
}
