//! A unit's lifecycle (semantics §3.2–§3.4): insert with its manifest and child
//! sessions, record dispatched children, persist the completion, retain.

use rusqlite::{Transaction, params};
use serde_json::Value;

use crate::error::{Result, SqlResult};
use crate::registry::UnitLifecycle;
use crate::registry::backfill::backfill;
use crate::registry::retention::prune_in;
use crate::rows::Limits;
use crate::store::Store;
use retinue_core::{ChildManifest, Completion, UnitDraft, children_json, truncate_chars};

fn retain_in(
    tx: &Transaction<'_>,
    id: &str,
    usage: Option<&Value>,
    lim: Limits,
    profile: &str,
) -> SqlResult<bool> {
    let now = lim.now;
    // Retinue's own write of the unit clock (V9's guard): its children's
    // clocks are set below, live ones only.
    tx.prepare_cached("INSERT OR IGNORE INTO retinue_clock_guard (held) VALUES (1)")?.execute([])?;
    let changed = match usage {
        Some(u) => tx
            .prepare_cached(
                "UPDATE async_delegations SET retained = 1, retained_at = ?1, updated_at = ?1, \
                 usage_json = ?2 WHERE delegation_id = ?3 AND tombstoned_at IS NULL",
            )?
            .execute(params![now, u.to_string(), id])?,
        None => tx
            .prepare_cached(
                "UPDATE async_delegations SET retained = 1, retained_at = ?1, updated_at = ?1 \
                 WHERE delegation_id = ?2 AND tombstoned_at IS NULL",
            )?
            .execute(params![now, id])?,
    };
    tx.prepare_cached("DELETE FROM retinue_clock_guard")?.execute([])?;
    if changed == 0 {
        return Ok(false);
    }
    backfill(tx, None)?;
    // Live children only: one past its TTL (not yet pruned) is not revived.
    tx.prepare_cached(
        "UPDATE retinue_children SET retained_at = ?1 WHERE delegation_id = ?2 \
         AND tombstoned_at IS NULL AND (retained_at IS NULL OR retained_at >= ?3)",
    )?
    .execute(params![now, id, lim.cutoff()])?;
    // The retaining process prunes its own tenant only (issue #22).
    prune_in(tx, lim, profile)?;
    Ok(true)
}

fn upsert_children(tx: &Transaction<'_>, id: &str, children: &[ChildManifest]) -> SqlResult<()> {
    let mut stmt = tx.prepare_cached(
        "INSERT INTO retinue_children (delegation_id, child_index, subagent_id, \
         child_session_id, model, provider, goal, manifest_json) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8) \
         ON CONFLICT(delegation_id, child_index) DO UPDATE SET subagent_id = excluded.subagent_id, \
           child_session_id = excluded.child_session_id, model = excluded.model, \
           provider = excluded.provider, goal = excluded.goal, \
           manifest_json = excluded.manifest_json",
    )?;
    for (i, child) in children.iter().enumerate() {
        stmt.execute(params![
            id,
            i64::try_from(i).unwrap_or(i64::MAX),
            child.subagent_id,
            child.session_id,
            child.model,
            child.provider,
            child.goal.as_deref().map(|g| truncate_chars(g, 200)),
            child.to_json().to_string(),
        ])?;
    }
    Ok(())
}

fn lone_child_session(children: &[ChildManifest]) -> Option<String> {
    match children {
        [only] => Some(only.session_id.clone()),
        _ => None,
    }
}

impl Store {
    /// Inserts the unit under `id`; `false` (nothing written) if the id is taken.
    fn insert_unit_in(&self, tx: &Transaction<'_>, draft: &UnitDraft, id: &str) -> SqlResult<bool> {
        let taken = tx
            .prepare_cached("SELECT 1 FROM async_delegations WHERE delegation_id = ?1")?
            .exists([id])?;
        if taken {
            return Ok(false);
        }
        let now = self.clock.now();
        let is_batch = draft.children.len() != 1;
        tx.prepare_cached(
            "INSERT INTO async_delegations (delegation_id, origin_session, origin_ui_session_id, \
             parent_session_id, state, dispatched_at, updated_at, delivery_state, \
             delivery_attempts, owner_pid, owner_started_at, task_json, origin_session_id, \
             child_session_id, children_json, owner_profile) \
             VALUES (?1, ?2, ?3, ?4, 'running', ?5, ?5, 'pending', 0, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
        )?
        .execute(params![
            id,
            draft.origin_session,
            draft.origin_ui_session_id,
            draft.parent_session_id,
            now,
            draft.owner_pid,
            draft.owner_started_at,
            draft.task.to_string(),
            draft.origin_session_id,
            if is_batch { None } else { lone_child_session(&draft.children) },
            children_json(&draft.children),
            draft.owner_profile,
        ])?;
        upsert_children(tx, id, &draft.children)?;
        for session in &draft.child_sessions {
            crate::sessions::insert_session(tx, session, now)?;
        }
        Ok(true)
    }
}

impl UnitLifecycle for Store {
    fn insert_unit(&self, draft: &UnitDraft) -> Result<String> {
        retinue_core::insert_with_unit_id(|id| {
            self.pool.write("inserting a unit", |tx| self.insert_unit_in(tx, draft, id))
        })
    }

    fn record_dispatched_children(&self, id: &str, children: &[ChildManifest]) -> Result<bool> {
        if id.trim().is_empty() {
            return Ok(false);
        }
        let now = self.clock.now();
        let profile = self.profile.clone();
        self.pool.write("recording dispatched children", |tx| {
            backfill(tx, None)?;
            let is_batch = children.len() > 1;
            let lone = if is_batch {
                None
            } else {
                Some(lone_child_session(children).unwrap_or_default())
            };
            let changed = tx
                .prepare_cached(
                    "UPDATE async_delegations SET children_json = ?1, child_session_id = ?2, \
                     owner_profile = ?3, updated_at = ?4 WHERE delegation_id = ?5",
                )?
                .execute(params![children_json(children), lone, profile, now, id])?;
            if changed == 0 {
                return Ok(false);
            }
            upsert_children(tx, id, children)?;
            Ok(true)
        })
    }

    #[expect(clippy::needless_lifetimes)]
    fn retain_completed_delegation<'a>(&self, id: &str, usage: Option<&'a Value>) -> Result<bool> {
        let lim = self.limits();
        self.pool.write("retaining a unit", |tx| retain_in(tx, id, usage, lim, &self.profile))
    }

    fn persist_completion(&self, c: &Completion) -> Result<bool> {
        let lim = self.limits();
        let now = lim.now;
        let plan = c.plan(now);
        self.pool.write("persisting a completion", |tx| {
            backfill(tx, None)?;
            let changed = tx
                .prepare_cached(
                    "UPDATE async_delegations SET state = ?1, completed_at = ?2, updated_at = ?2, \
                     event_json = ?3, result_json = ?4, usage_json = COALESCE(?5, usage_json), \
                     delivery_state = ?6, delivered_at = ?7 WHERE delegation_id = ?8",
                )?
                .execute(params![
                    plan.state.as_str(),
                    now,
                    c.event.to_json().to_string(),
                    c.result.to_string(),
                    c.usage.as_ref().map(Value::to_string),
                    plan.delivery_state,
                    plan.delivered_at,
                    c.delegation_id,
                ])?;
            if changed == 0 {
                return Ok(false);
            }
            if plan.retains {
                retain_in(tx, &c.delegation_id, None, lim, &self.profile)?;
            }
            Ok(true)
        })
    }
}
