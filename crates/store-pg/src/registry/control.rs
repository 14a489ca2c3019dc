//! [`Controls`] on PostgreSQL: unit views and the control mailbox
//! (`retinue_unit_controls`, migration V8), as on SQLite. Taking is one
//! `UPDATE … RETURNING` in a `SERIALIZABLE` transaction, so each control is
//! taken exactly once across hosts.

use postgres::Row;
use retinue_core::{
    Control, ControlKind, ControlOutcome, Controls, Result, UnitChild, UnitState, UnitView,
    manifest_facts, parse_json_opt,
};
use serde_json::Value;

use crate::pool::{Mode, PgResult, Tx, u32_of};
use crate::store::PgStore;

const UNIT_COLUMNS: &str = "u.delegation_id, u.parent_session_id, u.owner_profile, u.state, \
     u.dispatched_at, u.completed_at, u.delivery_state, u.result_json, u.owner_pid, u.task_json, \
     u.tombstoned_at";

fn unit_row(r: &Row) -> UnitView {
    let result: Option<String> = r.get(7);
    let task: Option<String> = r.get(9);
    let (mode, traceparent) = match parse_json_opt(task.as_deref()) {
        Some(Value::Object(t)) => (
            t.get("mode").and_then(Value::as_str).map(str::to_owned),
            t.get("traceparent").and_then(Value::as_str).map(str::to_owned),
        ),
        _ => (None, None),
    };
    UnitView {
        delegation_id: r.get(0),
        parent_session_id: r.get(1),
        owner_profile: r.get(2),
        state: UnitState::parse(&r.get::<_, String>(3)),
        dispatched_at: r.get(4),
        completed_at: r.get(5),
        delivery_state: r.get(6),
        result: parse_json_opt(result.as_deref()),
        owner_pid: r.get(8),
        mode,
        traceparent,
        children: Vec::new(),
        tombstoned_at: r.get(10),
    }
}

fn children_of(tx: &mut Tx<'_>, unit: &mut UnitView) -> PgResult<()> {
    let rows = tx.query(
        "SELECT child_index, subagent_id, child_session_id, goal, model, retained_at, \
         tombstoned_at, tombstone_reason, manifest_json FROM retinue_children \
         WHERE delegation_id = $1 ORDER BY child_index",
        &[&unit.delegation_id],
    )?;
    unit.children = rows
        .iter()
        .map(|r| {
            let manifest: Option<String> = r.get(8);
            let (toolsets, role) = manifest_facts(manifest.as_deref());
            UnitChild {
                child_index: u32_of(r.get(0)),
                subagent_id: r.get(1),
                child_session_id: r.get(2),
                goal: r.get(3),
                model: r.get(4),
                retained_at: r.get(5),
                tombstoned_at: r.get(6),
                tombstone_reason: r.get(7),
                toolsets,
                role,
            }
        })
        .collect();
    Ok(())
}

impl Controls for PgStore {
    fn unit_view(&self, id: &str) -> Result<Option<UnitView>> {
        self.pool.tx("reading a unit", Mode::Read, |tx| {
            let sql = format!(
                "(SELECT {UNIT_COLUMNS} FROM async_delegations u WHERE u.delegation_id = $1) \
                 UNION ALL (SELECT {UNIT_COLUMNS} FROM async_delegations u \
                   JOIN retinue_children c ON c.delegation_id = u.delegation_id \
                 WHERE (c.subagent_id = $1 OR c.child_session_id = $1) AND c.subagent_id <> '') \
                 LIMIT 1"
            );
            let Some(row) = tx.query_opt(sql.as_str(), &[&id])? else { return Ok(None) };
            let mut unit = unit_row(&row);
            children_of(tx, &mut unit)?;
            Ok(Some(unit))
        })
    }

    fn running_units(&self, profile: Option<&str>) -> Result<Vec<UnitView>> {
        self.pool.tx("listing running units", Mode::Read, |tx| {
            let sql = format!(
                "SELECT {UNIT_COLUMNS} FROM async_delegations u \
                 WHERE u.state IN ('pending', 'running', 'finalizing') \
                   AND ($1::TEXT IS NULL OR COALESCE(u.owner_profile, '') IN ('', $1)) \
                 ORDER BY u.dispatched_at DESC, u.delegation_id"
            );
            let rows = tx.query(sql.as_str(), &[&profile])?;
            let mut units: Vec<UnitView> = rows.iter().map(unit_row).collect();
            for u in &mut units {
                children_of(tx, u)?;
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
        self.pool.tx("posting a control", Mode::Write, |tx| {
            let row = tx.query_one(
                "INSERT INTO retinue_unit_controls \
                 (delegation_id, subagent_id, kind, message, created_at) \
                 VALUES ($1, $2, $3, $4, $5) RETURNING control_id",
                &[&delegation_id, &subagent_id, &kind.as_str(), &message, &now],
            )?;
            Ok(row.get(0))
        })
    }

    fn take_controls(&self, delegation_id: &str) -> Result<Vec<Control>> {
        // Every running unit polls; most polls find nothing: one read-only
        // statement first, the serializable write only when there is work.
        let any = self.pool.tx("looking for controls", Mode::ReadOne, |tx| {
            let row = tx.query_one(
                "SELECT EXISTS (SELECT 1 FROM retinue_unit_controls \
                 WHERE delegation_id = $1 AND outcome = 'pending')",
                &[&delegation_id],
            )?;
            Ok(row.get::<_, bool>(0))
        })?;
        if !any {
            return Ok(Vec::new());
        }
        let now = self.clock.now();
        self.pool.tx("taking controls", Mode::Write, |tx| {
            let rows = tx.query(
                "UPDATE retinue_unit_controls SET outcome = 'taken', taken_at = $1 \
                 WHERE delegation_id = $2 AND outcome = 'pending' \
                 RETURNING control_id, delegation_id, subagent_id, kind, message",
                &[&now, &delegation_id],
            )?;
            let mut taken: Vec<Control> = rows
                .iter()
                .filter_map(|r| {
                    Some(Control {
                        id: r.get(0),
                        delegation_id: r.get(1),
                        subagent_id: r.get(2),
                        kind: ControlKind::parse(&r.get::<_, String>(3))?,
                        message: r.get(4),
                    })
                })
                .collect();
            taken.sort_by_key(|c| c.id);
            Ok(taken)
        })
    }

    fn settle_control(&self, id: i64, outcome: ControlOutcome) -> Result<bool> {
        let now = self.clock.now();
        self.pool.tx("settling a control", Mode::Write, |tx| {
            let n = tx.execute(
                "UPDATE retinue_unit_controls SET outcome = $1, \
                 taken_at = COALESCE(taken_at, $2) \
                 WHERE control_id = $3 AND ((outcome = 'pending' AND $1 <> 'pending') \
                   OR (outcome = 'taken' AND $1 IN ('delivered', 'missed')))",
                &[&outcome.as_str(), &now, &id],
            )?;
            Ok(n > 0)
        })
    }

    fn list_units(&self, profile: Option<&str>, limit: usize) -> Result<Vec<UnitView>> {
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        self.pool.tx("listing units", Mode::Read, |tx| {
            let sql = format!(
                "SELECT {UNIT_COLUMNS} FROM async_delegations u \
                 WHERE ($1::TEXT IS NULL OR COALESCE(u.owner_profile, '') IN ('', $1)) \
                 ORDER BY u.dispatched_at DESC, u.delegation_id LIMIT $2"
            );
            let rows = tx.query(sql.as_str(), &[&profile, &limit])?;
            let mut units: Vec<UnitView> = rows.iter().map(unit_row).collect();
            for u in &mut units {
                children_of(tx, u)?;
            }
            Ok(units)
        })
    }

    fn change_marker(&self) -> Result<String> {
        // The sequence's last value and the newest message (V10): O(1); no
        // stored clock is read, so a planted NaN cannot freeze it.
        self.pool.tx("reading the change marker", Mode::ReadOne, |tx| {
            let r = tx.query_one(
                "SELECT (SELECT last_value FROM retinue_change_clock), \
                 (SELECT COALESCE(max(id), 0) FROM messages)",
                &[],
            )?;
            let (tick, messages): (i64, i64) = (r.get(0), r.get(1));
            Ok(format!("{tick}-{messages}"))
        })
    }

    fn control_outcome(&self, id: i64) -> Result<Option<ControlOutcome>> {
        self.pool.tx("reading a control", Mode::ReadOne, |tx| {
            let row = tx.query_opt(
                "SELECT outcome FROM retinue_unit_controls WHERE control_id = $1",
                &[&id],
            )?;
            Ok(row.map(|r| ControlOutcome::parse(Some(r.get::<_, String>(0).as_str()))))
        })
    }
}
