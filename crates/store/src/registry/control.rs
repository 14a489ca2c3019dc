//! [`Controls`] on SQLite: unit views for waiters and listings, and the
//! control mailbox (`retinue_unit_controls`, migration V11).

use rusqlite::{Connection, OptionalExtension, params};
use serde_json::Value;

use crate::error::{Result, SqlResult};
use crate::rows::json_column;
use crate::store::Store;
use retinue_core::{
    Control, ControlKind, ControlOutcome, Controls, UnitChild, UnitState, UnitView, manifest_facts,
    parse_json_opt,
};

const UNIT_COLUMNS: &str = "u.delegation_id, u.parent_session_id, u.owner_profile, u.state, \
     u.dispatched_at, u.completed_at, u.delivery_state, u.result_json, u.owner_pid, u.task_json, \
     u.tombstoned_at";

fn unit_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<UnitView> {
    let result: Option<String> = json_column(r, 7)?;
    let task: Option<String> = json_column(r, 9)?;
    let (mode, traceparent) = match parse_json_opt(task.as_deref()) {
        Some(Value::Object(t)) => (
            t.get("mode").and_then(Value::as_str).map(str::to_owned),
            t.get("traceparent").and_then(Value::as_str).map(str::to_owned),
        ),
        _ => (None, None),
    };
    Ok(UnitView {
        delegation_id: r.get(0)?,
        parent_session_id: r.get(1)?,
        owner_profile: r.get(2)?,
        state: UnitState::parse(&r.get::<_, String>(3)?),
        dispatched_at: r.get::<_, Option<f64>>(4)?.unwrap_or(0.0),
        completed_at: r.get(5)?,
        delivery_state: r.get::<_, Option<String>>(6)?.unwrap_or_default(),
        result: parse_json_opt(result.as_deref()),
        owner_pid: r.get(8)?,
        mode,
        traceparent,
        children: Vec::new(),
        tombstoned_at: r.get(10)?,
    })
}

fn children_of(conn: &Connection, unit: &mut UnitView) -> SqlResult<()> {
    let mut stmt = conn.prepare_cached(
        "SELECT child_index, subagent_id, child_session_id, goal, model, retained_at, \
         tombstoned_at, tombstone_reason, manifest_json FROM retinue_children \
         WHERE delegation_id = ?1 ORDER BY child_index",
    )?;
    unit.children = stmt
        .query_map(params![unit.delegation_id], |r| {
            let manifest: Option<String> = json_column(r, 8)?;
            let (toolsets, role) = manifest_facts(manifest.as_deref());
            Ok(UnitChild {
                child_index: r.get(0)?,
                subagent_id: r.get(1)?,
                child_session_id: r.get(2)?,
                goal: r.get(3)?,
                model: r.get(4)?,
                retained_at: r.get(5)?,
                tombstoned_at: r.get(6)?,
                tombstone_reason: r.get(7)?,
                toolsets,
                role,
            })
        })?
        .collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(())
}

fn view(conn: &Connection, id: &str) -> SqlResult<Option<UnitView>> {
    let sql = format!(
        "SELECT {UNIT_COLUMNS} FROM async_delegations u WHERE u.delegation_id = ?1 \
         UNION ALL SELECT {UNIT_COLUMNS} FROM async_delegations u \
           JOIN retinue_children c ON c.delegation_id = u.delegation_id \
         WHERE (c.subagent_id = ?1 OR c.child_session_id = ?1) AND c.subagent_id <> '' \
         LIMIT 1"
    );
    let unit = conn.prepare_cached(&sql)?.query_row(params![id], unit_row).optional()?;
    match unit {
        Some(mut u) => {
            children_of(conn, &mut u)?;
            Ok(Some(u))
        }
        None => Ok(None),
    }
}

impl Controls for Store {
    fn unit_view(&self, id: &str) -> Result<Option<UnitView>> {
        self.pool.read("reading a unit", |conn| view(conn, id))
    }

    fn running_units(&self, profile: Option<&str>) -> Result<Vec<UnitView>> {
        self.pool.read("listing running units", |conn| {
            let sql = format!(
                "SELECT {UNIT_COLUMNS} FROM async_delegations u \
                 WHERE u.state IN ('pending', 'running', 'finalizing') \
                   AND (?1 IS NULL OR COALESCE(u.owner_profile, '') IN ('', ?1)) \
                 ORDER BY u.dispatched_at DESC, u.delegation_id"
            );
            let mut units = conn
                .prepare_cached(&sql)?
                .query_map(params![profile], unit_row)?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            for u in &mut units {
                children_of(conn, u)?;
            }
            Ok(units)
        })
    }

    fn post_control(
        &self,
        delegation_id: &str,
        subagent_id: Option<&str>,
        kind: ControlKind,
        message: Option<&str>,
    ) -> Result<i64> {
        let now = self.clock.now();
        self.pool.write("posting a control", |tx| {
            tx.prepare_cached(
                "INSERT INTO retinue_unit_controls \
                 (delegation_id, subagent_id, kind, message, created_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5)",
            )?
            .execute(params![
                delegation_id,
                subagent_id,
                kind.as_str(),
                message,
                now
            ])?;
            Ok(tx.last_insert_rowid())
        })
    }

    fn take_controls(&self, delegation_id: &str) -> Result<Vec<Control>> {
        // Every running unit polls; most polls find nothing, and a read
        // never takes the write lock.
        let any = self.pool.query("looking for controls", |conn| {
            conn.prepare_cached(
                "SELECT EXISTS (SELECT 1 FROM retinue_unit_controls \
                 WHERE delegation_id = ?1 AND outcome = 'pending')",
            )?
            .query_row(params![delegation_id], |r| r.get::<_, bool>(0))
            .map_err(Into::into)
        })?;
        if !any {
            return Ok(Vec::new());
        }
        let now = self.clock.now();
        self.pool.write("taking controls", |tx| {
            let mut taken = tx
                .prepare_cached(
                    "UPDATE retinue_unit_controls SET outcome = 'taken', taken_at = ?1 \
                     WHERE delegation_id = ?2 AND outcome = 'pending' \
                     RETURNING control_id, delegation_id, subagent_id, kind, message",
                )?
                .query_map(params![now, delegation_id], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get::<_, String>(3)?, r.get(4)?))
                })?
                .collect::<rusqlite::Result<Vec<(i64, String, Option<String>, String, Option<String>)>>>(
                )?;
            taken.sort_by_key(|t| t.0);
            Ok(taken
                .into_iter()
                .filter_map(|(id, delegation_id, subagent_id, kind, message)| {
                    Some(Control {
                        id,
                        delegation_id,
                        subagent_id,
                        kind: ControlKind::parse(&kind)?,
                        message,
                    })
                })
                .collect())
        })
    }

    fn settle_control(&self, id: i64, outcome: ControlOutcome) -> Result<bool> {
        let now = self.clock.now();
        self.pool.write("settling a control", |tx| {
            // Only forward: pending → taken/delivered/missed, taken →
            // delivered/missed; a settled control never changes.
            let n = tx
                .prepare_cached(
                    "UPDATE retinue_unit_controls SET outcome = ?1, \
                     taken_at = COALESCE(taken_at, ?2) \
                     WHERE control_id = ?3 AND ((outcome = 'pending' AND ?1 <> 'pending') \
                       OR (outcome = 'taken' AND ?1 IN ('delivered', 'missed')))",
                )?
                .execute(params![outcome.as_str(), now, id])?;
            Ok(n > 0)
        })
    }

    fn list_units(&self, profile: Option<&str>, limit: usize) -> Result<Vec<UnitView>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.pool.read("listing units", |conn| {
            let sql = format!(
                "SELECT {UNIT_COLUMNS} FROM async_delegations u \
                 WHERE (?1 IS NULL OR COALESCE(u.owner_profile, '') IN ('', ?1)) \
                 ORDER BY u.dispatched_at DESC, u.delegation_id LIMIT ?2"
            );
            let mut units = conn
                .prepare_cached(&sql)?
                .query_map(params![profile, limit], unit_row)?
                .collect::<rusqlite::Result<Vec<_>>>()?;
            for u in &mut units {
                children_of(conn, u)?;
            }
            Ok(units)
        })
    }

    fn change_marker(&self) -> Result<String> {
        // Two one-row reads: O(1) in the number of units (V12's counter and
        // the newest message); no stored clock is read, so a planted
        // `updated_at` cannot break it.
        self.pool.query("reading the change marker", |conn| {
            let (tick, messages): (i64, i64) = conn
                .prepare_cached(
                    "SELECT (SELECT COALESCE(max(tick), 0) FROM retinue_change_clock), \
                     (SELECT COALESCE(max(id), 0) FROM messages)",
                )?
                .query_row([], |r| Ok((r.get(0)?, r.get(1)?)))?;
            Ok(format!("{tick}-{messages}"))
        })
    }

    fn control_outcome(&self, id: i64) -> Result<Option<ControlOutcome>> {
        self.pool.query("reading a control", |conn| {
            let row: Option<Option<String>> = conn
                .prepare_cached("SELECT outcome FROM retinue_unit_controls WHERE control_id = ?1")?
                .query_row(params![id], |r| r.get(0))
                .optional()?;
            Ok(row.map(|o| ControlOutcome::parse(o.as_deref())))
        })
    }
}
