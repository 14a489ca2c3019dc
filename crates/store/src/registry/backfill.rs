//! Adoption of hermes-retained units (semantics §2.6 step 4): child rows for
//! `retained=1` units that have none. Run at open and by every write.

use rusqlite::{Connection, params};

use crate::error::SqlResult;
use crate::rows::json_column;
use retinue_core::{TombstoneReason, parse_children_json};

/// Backfills child rows of `retained=1` units that have none (semantics §2.6 step 4).
/// Writes cover untombstoned units; `tombstoned_since` (used at open and by
/// the read view of a read-only connection) also covers units another writer
/// tombstoned at or after that time, so their tombstone is reported
/// (`external`). Both are index range scans.
pub(crate) fn backfill(tx: &Connection, tombstoned_since: Option<f64>) -> SqlResult<usize> {
    const SQL: &str = "SELECT delegation_id, children_json, child_session_id, retained_at, tombstoned_at \
         FROM async_delegations u WHERE retained = 1 AND tombstoned_at IS NULL AND NOT EXISTS \
         (SELECT 1 FROM retinue_children c WHERE c.delegation_id = u.delegation_id) \
         UNION ALL \
         SELECT delegation_id, children_json, child_session_id, retained_at, tombstoned_at \
         FROM async_delegations u WHERE retained = 1 AND tombstoned_at >= ?1 AND NOT EXISTS \
         (SELECT 1 FROM retinue_children c WHERE c.delegation_id = u.delegation_id)";
    type UnitRow = (String, Option<String>, Option<String>, Option<f64>, Option<f64>);
    let units: Vec<UnitRow> = {
        let mut stmt = tx.prepare_cached(SQL)?;
        let rows = stmt.query_map([tombstoned_since], |r| {
            // hermes-written values: unreadable text reads as absent (§2.7).
            let cj = json_column(r, 1)?;
            let csid = json_column(r, 2)?;
            Ok((r.get(0)?, cj, csid, r.get(3)?, r.get(4)?))
        })?;
        rows.collect::<rusqlite::Result<_>>()?
    };
    tx.prepare_cached(
        "UPDATE retinue_children SET retained_at = (SELECT u.retained_at FROM async_delegations u \
           WHERE u.delegation_id = retinue_children.delegation_id) \
         WHERE delegation_id IN (SELECT delegation_id FROM async_delegations \
                                 WHERE retained = 1 AND tombstoned_at IS NULL) \
           AND retained_at IS NULL AND tombstoned_at IS NULL",
    )?
    .execute([])?;
    let mut inserted = 0;
    let mut insert = tx.prepare_cached(
        "INSERT OR IGNORE INTO retinue_children (delegation_id, child_index, subagent_id, \
         child_session_id, model, provider, goal, manifest_json, retained_at, tombstoned_at, \
         tombstone_reason) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
    )?;
    for (id, cj, csid, retained_at, tombstoned_at) in units {
        let children = parse_children_json(cj.as_deref(), csid.as_deref());
        for (i, child) in children.iter().enumerate() {
            inserted += insert.execute(params![
                id,
                i64::try_from(i).unwrap_or(i64::MAX),
                child.subagent_id,
                child.session_id,
                child.model,
                child.provider,
                child.goal,
                child.to_json().to_string(),
                retained_at,
                tombstoned_at,
                tombstoned_at.map(|_| TombstoneReason::External.as_str()),
            ])?;
        }
    }
    Ok(inserted)
}
