//! Restart recovery (spec §3.8): abandoned units of dead owners become
//! `unknown`; retained units are never touched; rehydration always runs.

use rusqlite::params;
use serde_json::{Map, Value, json};

use crate::error::Result;
use crate::{RecoveryReport, Registry, Store};

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

const UNKNOWN_ERROR: &str =
    "Delegation owner exited before recording a terminal result; outcome unknown.";

fn classify(store: &Store, probe: &dyn OwnerProbe) -> Result<usize> {
    let now = store.clock.now();
    store.pool.write(|tx| {
        type Row = (String, Option<i64>, Option<i64>, Value);
        let rows: Vec<Row> = {
            let mut stmt = tx.prepare_cached(
                "SELECT delegation_id, owner_pid, owner_started_at, origin_session, \
                 origin_ui_session_id, origin_session_id, parent_session_id, task_json \
                 FROM async_delegations WHERE state IN ('running', 'finalizing') \
                 AND retained IS NULL",
            )?;
            let mapped = stmt.query_map([], |r| {
                let id: String = r.get(0)?;
                let mut ev = Map::new();
                ev.insert("type".into(), json!("async_delegation"));
                ev.insert("delegation_id".into(), json!(id));
                for (i, key) in
                    [(3, "origin_session"), (4, "origin_ui_session_id"), (5, "origin_session_id")]
                {
                    ev.insert(
                        key.into(),
                        json!(r.get::<_, Option<String>>(i)?.unwrap_or_default()),
                    );
                }
                ev.insert("parent_session_id".into(), json!(r.get::<_, Option<String>>(6)?));
                let task =
                    crate::model::parse_json_opt(crate::model::json_column(r, 7)?.as_deref());
                if let Some(Value::Object(task)) = task {
                    for (k, v) in task {
                        ev.entry(k).or_insert(v);
                    }
                }
                ev.insert("status".into(), json!("unknown"));
                ev.insert("error".into(), json!(UNKNOWN_ERROR));
                Ok((id, r.get(1)?, r.get(2)?, Value::Object(ev)))
            })?;
            mapped.collect::<rusqlite::Result<_>>()?
        };
        // If liveness cannot be probed here (not even for this process), classify
        // nothing — not even rows without an owner pid.
        if probe.probe(i64::from(std::process::id())).is_none() {
            return Ok(0);
        }
        // Probe every owner first: if liveness cannot be probed, classify nothing.
        let mut dead = Vec::new();
        for (id, pid, started_at, event) in rows {
            let alive = match pid {
                None => false,
                Some(pid) => match probe.probe(pid) {
                    None => return Ok(0),
                    Some(ProcessState::Dead) => false,
                    Some(ProcessState::Alive { started_at: fp }) => {
                        started_at.is_none() || started_at == fp
                    }
                },
            };
            if !alive {
                dead.push((id, event));
            }
        }
        let mut stmt = tx.prepare_cached(
            "UPDATE async_delegations SET state = 'unknown', completed_at = ?1, updated_at = ?1, \
             delivery_state = 'pending', event_json = ?2, result_json = ?3 \
             WHERE delegation_id = ?4 AND retained IS NULL",
        )?;
        for (id, event) in &dead {
            let result = json!({"status": "unknown", "error": UNKNOWN_ERROR});
            stmt.execute(params![now, event.to_string(), result.to_string(), id])?;
        }
        Ok(dead.len())
    })
}

pub(crate) fn recover(store: &Store, probe: &dyn OwnerProbe) -> RecoveryReport {
    let mut report = RecoveryReport::default();
    match classify(store, probe) {
        Ok(n) => report.abandoned = n,
        Err(e) => report.error = Some(format!("classification failed: {e}")),
    }
    match store.rehydrate_retained_children() {
        Ok(n) => report.addressable = n,
        Err(e) => {
            let msg = format!("rehydration failed: {e}");
            report.error = Some(match report.error.take() {
                Some(prev) => format!("{prev}; {msg}"),
                None => msg,
            });
        }
    }
    report
}
