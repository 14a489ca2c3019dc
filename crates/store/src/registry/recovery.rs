//! Restart recovery (semantics §3.8): abandoned units of dead owners become
//! `unknown`; retained units are never touched; rehydration always runs.

use rusqlite::params;
use serde_json::Value;

use crate::error::{Result, SqlResult};
use crate::registry::Retention;
use crate::rows::json_column;
use crate::store::Store;
use retinue_core::{OwnerProbe, ProcessState};
use retinue_core::{RecoveryReport, abandoned_event};

fn classify(store: &Store, probe: &dyn OwnerProbe) -> Result<usize> {
    let now = store.clock.now();
    store.pool.write("classifying abandoned units", |tx| -> SqlResult<usize> {
        type Row = (String, Option<i64>, Option<i64>, (Value, Value));
        let rows: Vec<Row> = {
            let mut stmt = tx.prepare_cached(
                "SELECT delegation_id, owner_pid, owner_started_at, origin_session, \
                 origin_ui_session_id, origin_session_id, parent_session_id, task_json \
                 FROM async_delegations WHERE state IN ('running', 'finalizing') \
                 AND retained IS NULL",
            )?;
            let mapped = stmt.query_map([], |r| {
                let id: String = r.get(0)?;
                let (event, result) = abandoned_event(
                    &id,
                    [r.get(3)?, r.get(4)?, r.get(5)?],
                    r.get(6)?,
                    json_column(r, 7)?.as_deref(),
                );
                Ok((id, r.get(1)?, r.get(2)?, (event, result)))
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
        for (id, (event, result)) in &dead {
            stmt.execute(params![now, event.to_string(), result.to_string(), id])?;
        }
        Ok(dead.len())
    })
}

pub(crate) fn recover(store: &Store, probe: &dyn OwnerProbe) -> RecoveryReport {
    RecoveryReport::default().run(|| classify(store, probe), || store.rehydrate_retained_children())
}
