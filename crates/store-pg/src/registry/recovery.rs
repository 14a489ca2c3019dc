//! Restart recovery (semantics §3.8): units whose worker's lease lapsed end
//! `unknown`, their budget holds released.

use retinue_core::{OwnerProbe, ProcessState, Result, abandoned_event};
use serde_json::Value;

use crate::pool::Mode;
use crate::store::{PgStore, SERVER_NOW};

impl PgStore {
    /// Marks `unknown` the live, non-retained units whose owner is gone: a
    /// worker whose lease expired (or vanished), or — for units without a
    /// worker (copied from a state.db) — a process the probe reports dead.
    /// Only the caller's tenant's units (and unprofiled ones) are touched.
    pub(crate) fn classify(&self, probe: &dyn OwnerProbe) -> Result<usize> {
        let now = self.clock.now();
        self.pool.tx("classifying abandoned units", Mode::Write, |tx| {
            let rows = tx.query(
                &format!(
                    "SELECT u.delegation_id, u.owner_pid, u.owner_started_at, u.origin_session, \
                 u.origin_ui_session_id, u.origin_session_id, u.parent_session_id, u.task_json, \
                 u.owner_worker, w.lease_expires_at >= {SERVER_NOW} \
                 FROM async_delegations u LEFT JOIN retinue_workers w ON w.worker_id = u.owner_worker \
                 WHERE u.state IN ('running', 'finalizing') AND u.retained IS NULL \
                 AND ($1 = '' OR COALESCE(u.owner_profile, '') IN ('', $1)) \
                 FOR UPDATE OF u SKIP LOCKED"
                ),
                &[&self.profile],
            )?;
            let can_probe = probe.probe(i64::from(std::process::id())).is_some();
            let mut dead: Vec<(String, Value, Value)> = Vec::new();
            for r in rows {
                let id: String = r.try_get(0)?;
                let pid: Option<i64> = r.try_get(1)?;
                let started_at: Option<i64> = r.try_get(2)?;
                let worker: Option<String> = r.try_get(8)?;
                // Judged by the server: a lease not yet past on its clock.
                let leased: Option<bool> = r.try_get(9)?;
                let alive = match (worker, pid) {
                    (Some(_), _) => leased == Some(true),
                    (None, _) if !can_probe => continue,
                    (None, None) => false,
                    (None, Some(pid)) => match probe.probe(pid) {
                        None => continue,
                        Some(ProcessState::Dead) => false,
                        Some(ProcessState::Alive { started_at: fp }) => {
                            started_at.is_none() || started_at == fp
                        }
                    },
                };
                if alive {
                    continue;
                }
                let task: Option<String> = r.try_get(7)?;
                let (event, result) = abandoned_event(
                    &id,
                    [r.try_get(3)?, r.try_get(4)?, r.try_get(5)?],
                    r.try_get(6)?,
                    task.as_deref(),
                );
                dead.push((id, event, result));
            }
            for (id, event, result) in &dead {
                tx.execute(
                    "UPDATE async_delegations SET state = 'unknown', completed_at = $1, \
                     updated_at = $1, delivery_state = 'pending', event_json = $2, \
                     result_json = $3 WHERE delegation_id = $4 AND retained IS NULL",
                    &[&now, &event.to_string(), &result.to_string(), id],
                )?;
            }
            Ok(dead.len())
        })
    }
}
