//! [`UnitLifecycle`] on PostgreSQL: insert, manifest, completion, retain.

use retinue_core::{
    ChildManifest, Completion, Result, UnitDraft, UnitLifecycle, children_json, truncate_chars,
};
use serde_json::Value;
use std::sync::atomic::Ordering;

use crate::pool::{Mode, PgResult, Tx};
use crate::registry::backfill::backfill;
use crate::registry::retain::{Done, retain_in, retain_one};
use crate::sessions::{SessionArrays, chained, insert_sessions, sessions_from_arrays};
use crate::store::PgStore;

/// A unit's children as parallel arrays: the parameters of [`children_from_arrays`].
struct ChildArrays<'a> {
    index: Vec<i64>,
    subagent: Vec<&'a str>,
    session: Vec<&'a str>,
    model: Vec<Option<&'a str>>,
    provider: Vec<Option<&'a str>>,
    goal: Vec<Option<String>>,
    manifest: Vec<String>,
}

impl<'a> ChildArrays<'a> {
    fn of(children: &'a [ChildManifest]) -> ChildArrays<'a> {
        ChildArrays {
            index: (0..children.len()).map(|i| i64::try_from(i).unwrap_or(i64::MAX)).collect(),
            subagent: children.iter().map(|c| c.subagent_id.as_str()).collect(),
            session: children.iter().map(|c| c.session_id.as_str()).collect(),
            model: children.iter().map(|c| c.model.as_deref()).collect(),
            provider: children.iter().map(|c| c.provider.as_deref()).collect(),
            goal: children
                .iter()
                .map(|c| c.goal.as_deref().map(|g| truncate_chars(g, 200)))
                .collect(),
            manifest: children.iter().map(|c| c.to_json().to_string()).collect(),
        }
    }

    /// The seven parameters, in [`children_from_arrays`]' order.
    fn params(&self) -> [&(dyn postgres::types::ToSql + Sync); 7] {
        [
            &self.index,
            &self.subagent,
            &self.session,
            &self.model,
            &self.provider,
            &self.goal,
            &self.manifest,
        ]
    }
}

/// The upsert of [`ChildArrays`] bound as `$first` … `$first+6`, for the
/// unit `unit` (an SQL expression) with `from` (extra `FROM` items ending in
/// a comma) before the arrays.
fn children_from_arrays(first: usize, unit: &str, from: &str) -> String {
    let p: Vec<String> = (first..first + 7).map(|i| format!("${i}")).collect();
    format!(
        "INSERT INTO retinue_children (delegation_id, child_index, subagent_id, \
         child_session_id, model, provider, goal, manifest_json) \
         SELECT {unit}, n.* FROM {from}unnest({}::bigint[], {}::text[], {}::text[], {}::text[], \
           {}::text[], {}::text[], {}::text[]) AS n \
         ON CONFLICT (delegation_id, child_index) DO UPDATE SET \
           subagent_id = EXCLUDED.subagent_id, child_session_id = EXCLUDED.child_session_id, \
           model = EXCLUDED.model, provider = EXCLUDED.provider, goal = EXCLUDED.goal, \
           manifest_json = EXCLUDED.manifest_json",
        p[0], p[1], p[2], p[3], p[4], p[5], p[6]
    )
}

fn upsert_children(tx: &mut Tx<'_>, id: &str, children: &[ChildManifest]) -> PgResult<()> {
    if children.is_empty() {
        return Ok(());
    }
    // Every child in one statement (one round trip), as parallel arrays.
    let arrays = ChildArrays::of(children);
    let mut params: Vec<&(dyn postgres::types::ToSql + Sync)> = vec![&id];
    params.extend(arrays.params());
    tx.execute(&children_from_arrays(2, "$1", ""), &params)?;
    Ok(())
}

fn lone_child_session(children: &[ChildManifest]) -> Option<String> {
    match children {
        [only] => Some(only.session_id.clone()),
        _ => None,
    }
}

/// The unit row's columns and values (`$1` … `$13`) of a dispatch.
const UNIT_INSERT: &str = "INSERT INTO async_delegations (delegation_id, origin_session, \
     origin_ui_session_id, parent_session_id, state, dispatched_at, updated_at, delivery_state, \
     delivery_attempts, owner_pid, owner_started_at, task_json, origin_session_id, \
     child_session_id, children_json, owner_profile, owner_worker) \
     VALUES ($1, $2, $3, $4, 'running', $5, $5, 'pending', 0, $6, $7, $8, $9, $10, $11, \
     $12, $13) ON CONFLICT (delegation_id) DO NOTHING";

impl PgStore {
    /// Inserts the unit `id` of `draft` with its children and sessions in
    /// one statement (one round trip, `SERIALIZABLE` in autocommit); `false`
    /// when the id is taken (nothing is written). Sessions naming each
    /// other as parents are inserted by [`PgStore::insert_unit_in`] instead.
    fn insert_unit_one(
        &self,
        tx: &mut Tx<'_>,
        draft: &UnitDraft,
        id: &str,
        now: f64,
    ) -> PgResult<bool> {
        let row = UnitRow::of(draft, id, now, &self.worker_id);
        let children = ChildArrays::of(&draft.children);
        let sessions = SessionArrays::of(&draft.child_sessions, now)?;
        let mut params = row.params().to_vec();
        params.extend(children.params());
        params.extend(sessions.params());
        // The CTEs see one snapshot and write disjoint tables; the children
        // and sessions are inserted only with the unit (`FROM u`).
        let sql = format!(
            "WITH u AS ({UNIT_INSERT} RETURNING delegation_id), \
             c AS ({}), s AS ({}) SELECT count(*) FROM u",
            children_from_arrays(14, "u.delegation_id", "u, "),
            sessions_from_arrays(21, "u, ")
        );
        let inserted: i64 = tx.query_one(&sql, &params)?.try_get(0)?;
        Ok(inserted > 0)
    }

    /// [`PgStore::insert_unit_one`] as three statements of one transaction
    /// (sessions that name each other as parents are linked in order).
    fn insert_unit_in(
        &self,
        tx: &mut Tx<'_>,
        draft: &UnitDraft,
        id: &str,
        now: f64,
    ) -> PgResult<bool> {
        let row = UnitRow::of(draft, id, now, &self.worker_id);
        // A taken id inserts nothing (the caller draws another).
        if tx.execute(UNIT_INSERT, &row.params())? == 0 {
            return Ok(false);
        }
        upsert_children(tx, id, &draft.children)?;
        insert_sessions(tx, &draft.child_sessions, now)?;
        Ok(true)
    }
}

/// A dispatch's unit row: the parameters of [`UNIT_INSERT`].
struct UnitRow<'a> {
    draft: &'a UnitDraft,
    id: &'a str,
    now: f64,
    worker: &'a str,
    task: String,
    children_json: String,
    lone: Option<String>,
}

impl<'a> UnitRow<'a> {
    fn of(draft: &'a UnitDraft, id: &'a str, now: f64, worker: &'a str) -> UnitRow<'a> {
        let is_batch = draft.children.len() != 1;
        UnitRow {
            draft,
            id,
            now,
            worker,
            task: draft.task.to_string(),
            children_json: children_json(&draft.children),
            lone: if is_batch { None } else { lone_child_session(&draft.children) },
        }
    }

    /// `$1` … `$13` of [`UNIT_INSERT`].
    fn params(&self) -> [&(dyn postgres::types::ToSql + Sync); 13] {
        let d = self.draft;
        [
            &self.id,
            &d.origin_session,
            &d.origin_ui_session_id,
            &d.parent_session_id,
            &self.now,
            &d.owner_pid,
            &d.owner_started_at,
            &self.task,
            &d.origin_session_id,
            &self.lone,
            &self.children_json,
            &d.owner_profile,
            &self.worker,
        ]
    }
}

impl UnitLifecycle for PgStore {
    fn insert_unit(&self, draft: &UnitDraft) -> Result<String> {
        retinue_core::insert_with_unit_id(|id| {
            let now = self.clock.now();
            if chained(&draft.child_sessions) {
                self.pool.tx("inserting a unit", Mode::Write, |tx| {
                    self.insert_unit_in(tx, draft, id, now)
                })
            } else {
                // One statement whose every rule is a constraint (the id's
                // key, the children's and sessions' keys and references):
                // nothing for serializability to add, and under it the
                // unique checks' index-page predicate locks made
                // concurrent dispatches fail to serialize with each other
                // (half of them at 4 × 8, issue #41).
                self.pool.tx("inserting a unit", Mode::WriteCommitted, |tx| {
                    self.insert_unit_one(tx, draft, id, now)
                })
            }
        })
    }

    fn record_dispatched_children(&self, id: &str, children: &[ChildManifest]) -> Result<bool> {
        if id.trim().is_empty() {
            return Ok(false);
        }
        let now = self.clock.now();
        self.pool.tx("recording dispatched children", Mode::Write, |tx| {
            backfill(tx)?;
            let lone = if children.len() > 1 {
                None
            } else {
                Some(lone_child_session(children).unwrap_or_default())
            };
            // A live unit that changes profile moves its count (the triggers).
            let updated = tx.execute(
                "UPDATE async_delegations SET children_json = $1, child_session_id = $2, \
                 owner_profile = $3, updated_at = $4 WHERE delegation_id = $5",
                &[&children_json(children), &lone, &self.profile, &now, &id],
            )?;
            if updated == 0 {
                return Ok(false);
            }
            upsert_children(tx, id, children)?;
            Ok(true)
        })
    }

    #[expect(clippy::needless_lifetimes)]
    fn retain_completed_delegation<'a>(&self, id: &str, usage: Option<&'a Value>) -> Result<bool> {
        let lim = self.limits();
        let text = usage.map(Value::to_string);
        if self.try_fast()
            && let Some(changed) =
                self.retain_fast("retaining a unit", id, text.as_deref(), None, lim)?
        {
            return Ok(changed);
        }
        let one = self.pool.tx_queued(
            "retaining a unit",
            Mode::WriteOne,
            Some(self.prune_queue),
            |tx| retain_one(tx, id, text.as_deref(), lim, &self.profile),
        )?;
        match one {
            Some(serial) => {
                self.prune_hint.store(serial.at_cap, Ordering::Relaxed);
                Ok(serial.changed)
            }
            None => {
                self.pool.tx_queued("retaining a unit", Mode::Write, Some(self.prune_queue), |tx| {
                    retain_in(tx, id, usage, lim, &self.profile)
                })
            }
        }
    }

    fn persist_completion(&self, c: &Completion) -> Result<bool> {
        let lim = self.limits();
        let now = lim.now;
        let plan = c.plan(now);
        let (status, delivery, delivered_at) =
            (plan.state.as_str(), plan.delivery_state, plan.delivered_at);
        let usage = c.usage.as_ref().map(Value::to_string);
        if plan.retains && self.try_fast() {
            // The completion and the retain in one statement that ranks
            // nothing, when no prune is due.
            let done = Done {
                state: status,
                event: c.event.to_json().to_string(),
                result: c.result.to_string(),
                delivery,
                delivered_at,
            };
            let (id, usage) = (&c.delegation_id, usage.as_deref());
            let op = "persisting a completion";
            if let Some(changed) = self.retain_fast(op, id, usage, Some(&done), lim)? {
                return Ok(changed);
            }
        }
        // Only a retaining completion prunes (and adopts, in `retain_in`):
        // only it queues on the tenant's hot spot; the others are one
        // statement.
        let (mode, queue) = if plan.retains {
            (Mode::Write, Some(self.prune_queue))
        } else {
            (Mode::WriteOne, None)
        };
        self.pool.tx_queued("persisting a completion", mode, queue, |tx| {
            let changed = tx.execute(
                "UPDATE async_delegations SET state = $1, completed_at = $2, updated_at = $2, \
                 event_json = $3, result_json = $4, usage_json = COALESCE($5, usage_json), \
                 delivery_state = $6, delivered_at = $7 WHERE delegation_id = $8",
                &[
                    &status,
                    &now,
                    &c.event.to_json().to_string(),
                    &c.result.to_string(),
                    &usage,
                    &delivery,
                    &delivered_at,
                    &c.delegation_id,
                ],
            )?;
            if changed == 0 {
                return Ok(false);
            }
            if plan.retains {
                match retain_one(tx, &c.delegation_id, None, lim, &self.profile)? {
                    Some(serial) => self.prune_hint.store(serial.at_cap, Ordering::Relaxed),
                    None => {
                        retain_in(tx, &c.delegation_id, None, lim, &self.profile)?;
                    }
                }
            }
            Ok(true)
        })
    }
}
