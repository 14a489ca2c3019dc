//! Addressability (semantics §3.1): lookups and lists evaluated through indexes,
//! with the TTL and cap limits applied at read time (a child a prune at that
//! instant would tombstone is never returned). Reads only.

use rusqlite::{Connection, OptionalExtension, params};
use serde_json::Value;

use crate::error::{Result, SqlResult};
use crate::registry::RegistryRead;
use crate::rows::{
    CHILD_COLS, CHILD_RETAINED_AT, Limits, json_column, live_profiles, read_child_row,
    read_child_row_at, text_column,
};
use crate::store::Store;
use retinue_core::ChildRow;
use retinue_core::child_status;
use retinue_core::{Lookup, RetainedChild, TombstoneReason, Unaddressable, parse_json_opt};

/// Every child row matching `id` as a subagent id (kind 0), a child session
/// id (1) or a delegation id (2): one statement, a multi-index OR.
fn candidates(conn: &Connection, id: &str) -> SqlResult<Vec<(u8, ChildRow)>> {
    const SQL: &str = concat!(
        "SELECT CASE WHEN c.subagent_id = ?1 THEN 0 WHEN c.child_session_id = ?1 THEN 1 ELSE 2 END, ",
        "c.delegation_id, c.child_index, c.subagent_id, c.child_session_id, c.manifest_json, ",
        "COALESCE(c.retained_at, CASE WHEN u.retained = 1 THEN u.retained_at END), c.tombstoned_at, ",
        "c.tombstone_reason, u.parent_session_id, u.owner_profile, u.state, u.completed_at, u.retained, ",
        "u.retained_at, u.tombstoned_at, c.rowid, ut.tombstoned_at, ut.ttl_seconds, c.tombstone_note ",
        "FROM retinue_children c JOIN async_delegations u ON u.delegation_id = c.delegation_id ",
        "LEFT JOIN retinue_unit_tombstones ut ON ut.delegation_id = c.delegation_id ",
        "WHERE c.subagent_id = ?1 OR c.child_session_id = ?1 OR c.delegation_id = ?1"
    );
    let mut stmt = conn.prepare_cached(SQL)?;
    let rows = stmt.query_map([id], |r| {
        let kind: i64 = r.get(0)?;
        let mut row = read_child_row_at(r, 1)?;
        row.tombstone_note = text_column(r, 19)?;
        Ok((u8::try_from(kind).unwrap_or(u8::MAX), row))
    })?;
    let rows = rows.collect::<rusqlite::Result<Vec<_>>>()?;
    Ok(rows
        .into_iter()
        .filter(|(_, row)| {
            if row.malformed {
                log::warn!(
                    "retinue_children rowid {} is malformed (unreadable id or profile); skipped",
                    row.rowid.unwrap_or_default()
                );
            }
            !row.malformed
        })
        .collect())
}

/// Number of live units of the same profile ranked strictly above a unit
/// (the cap applies per profile), capped at `max`.
fn rank_of(conn: &Connection, id: &str, retained_at: Option<f64>, lim: Limits) -> SqlResult<u32> {
    let mut stmt = conn.prepare_cached(
        "SELECT count(*) FROM (SELECT 1 FROM async_delegations u \
         WHERE u.retained = 1 AND u.tombstoned_at IS NULL \
           AND COALESCE(u.owner_profile, '') = (SELECT COALESCE(owner_profile, '') \
               FROM async_delegations WHERE delegation_id = ?2) \
           AND (u.retained_at > ?1 OR (u.retained_at IS ?1 AND u.delegation_id > ?2) \
                OR (?1 IS NULL AND u.retained_at IS NOT NULL)) \
           AND EXISTS (SELECT 1 FROM retinue_children c WHERE c.delegation_id = u.delegation_id \
                       AND c.tombstoned_at IS NULL \
                       AND COALESCE(c.retained_at, u.retained_at) >= ?3) \
         LIMIT ?4)",
    )?;
    let n: i64 =
        stmt.query_row(params![retained_at, id, lim.cutoff(), lim.max_retained], |r| r.get(0))?;
    Ok(u32::try_from(n).unwrap_or(u32::MAX))
}

/// Status without the cap rank (the shared rule of [`child_status`]).
fn live_status(row: &ChildRow, lim: Limits) -> Option<Unaddressable> {
    child_status(&row.facts(), lim)
}

/// The resolved row of a lookup: how `id` matched it (0 subagent id, 1 child
/// session, 2 delegation id), its status (`None`: addressable) and the row.
pub(crate) type Resolved = (u8, Option<Unaddressable>, ChildRow);

pub(crate) fn lookup_in(conn: &Connection, id: &str, lim: Limits) -> SqlResult<Lookup> {
    Ok(match resolve_in(conn, id, lim)? {
        None => Lookup::Unknown,
        Some((_, None, row)) => Lookup::Addressable(row.into_entry()),
        Some((_, Some(status), row)) => Lookup::NotAddressable(row.into_entry(), status),
    })
}

/// The one row `id` resolves to (semantics §3.3 order), or `None`.
pub(crate) fn resolve_in(conn: &Connection, id: &str, lim: Limits) -> SqlResult<Option<Resolved>> {
    let id = id.trim();
    if id.is_empty() {
        return Ok(None);
    }
    let mut scored: Vec<(Option<Unaddressable>, u8, ChildRow)> = candidates(conn, id)?
        .into_iter()
        .map(|(kind, row)| (live_status(&row, lim), kind, row))
        .collect();
    // The core's resolution order (semantics §3.3).
    fn key(s: &(Option<Unaddressable>, u8, ChildRow)) -> retinue_core::LookupKey<'_> {
        retinue_core::LookupKey {
            addressable: s.0.is_none(),
            kind: s.1,
            unit_retained_at: s.2.unit_retained_at,
            delegation_id: &s.2.entry.delegation_id,
            child_index: s.2.entry.child_index,
        }
    }
    let order = |a: &(Option<Unaddressable>, u8, ChildRow),
                 b: &(Option<Unaddressable>, u8, ChildRow)| {
        retinue_core::lookup_order(&key(a), &key(b))
    };
    scored.sort_by(order);
    // The cap rank is read only for live candidates, best first, until one is within the cap.
    for item in scored.iter_mut().filter(|s| s.0.is_none()) {
        if rank_of(conn, &item.2.entry.delegation_id, item.2.unit_retained_at, lim)?
            < lim.max_retained
        {
            break;
        }
        item.0 = Some(Unaddressable::Tombstoned {
            at: lim.now,
            reason: TombstoneReason::Cap,
            note: None,
        });
    }
    scored.sort_by(order);
    Ok(scored.into_iter().next().map(|(status, kind, row)| (kind, status, row)))
}

/// The addressable children: each profile's newest `max_retained` live
/// units with a live child (the cap applies per profile), newest unit first
/// across profiles, children in index order.
pub(crate) fn list_in(tx: &Connection, lim: Limits) -> SqlResult<Vec<RetainedChild>> {
    // Listed units are live: no unit-level tombstone to read.
    let cols = CHILD_COLS.replace("ut.tombstoned_at, ut.ttl_seconds", "NULL, NULL");
    let sql = format!(
        "WITH top AS (SELECT u.delegation_id AS id, u.retained_at AS rat FROM async_delegations u \
           WHERE u.retained = 1 AND u.tombstoned_at IS NULL \
             AND COALESCE(u.owner_profile, '') = ?3 AND EXISTS (SELECT 1 FROM \
             retinue_children c WHERE c.delegation_id = u.delegation_id \
             AND c.tombstoned_at IS NULL AND COALESCE(c.retained_at, u.retained_at) >= ?1) \
           ORDER BY u.retained_at DESC, u.delegation_id DESC LIMIT ?2) \
         SELECT {cols} FROM top \
           JOIN retinue_children c ON c.delegation_id = top.id \
           JOIN async_delegations u ON u.delegation_id = top.id \
         WHERE c.tombstoned_at IS NULL AND {CHILD_RETAINED_AT} >= ?1 \
         ORDER BY top.rat DESC, top.id DESC, c.child_index"
    );
    let profiles = live_profiles(tx)?;
    let mut stmt = tx.prepare_cached(&sql)?;
    let mut rows = Vec::new();
    for profile in &profiles {
        let found =
            stmt.query_map(params![lim.cutoff(), lim.max_retained, profile], read_child_row)?;
        for row in found {
            rows.push(row?);
        }
    }
    if profiles.len() > 1 {
        // Each profile's rows are in order; merge them as one query's ORDER BY would.
        rows.sort_by(|a, b| {
            let at = |r: &ChildRow| r.unit_retained_at.unwrap_or(f64::NEG_INFINITY);
            at(b)
                .total_cmp(&at(a))
                .then_with(|| b.entry.delegation_id.cmp(&a.entry.delegation_id))
                .then_with(|| a.entry.child_index.cmp(&b.entry.child_index))
        });
    }
    // A malformed row (unreadable id) never hides the healthy ones.
    Ok(rows
        .into_iter()
        .filter(|row| {
            if row.malformed {
                log::warn!(
                    "retinue_children rowid {} is malformed (unreadable id or profile); skipped",
                    row.rowid.unwrap_or_default()
                );
            }
            !row.malformed
        })
        .map(ChildRow::into_entry)
        .collect())
}

impl RegistryRead for Store {
    fn list_retained_children(&self) -> Result<Vec<RetainedChild>> {
        let lim = self.limits();
        // A list this connection read while nothing has been committed
        // since, and still the answer at this cutoff, is answered again
        // (`ConnCache`); otherwise it is read now, on one snapshot.
        self.pool.cached("listing retained children", |conn, cache| {
            cache.validate(conn)?;
            if let Some(rows) = cache.list(lim.cutoff(), lim.max_retained) {
                return Ok(rows.clone());
            }
            conn.prepare_cached("BEGIN DEFERRED")?.execute([])?;
            let read = list_in(conn, lim);
            let end = conn.prepare_cached("COMMIT").and_then(|mut s| s.execute([]));
            let rows = read?;
            end?;
            cache.keep_list(lim.cutoff(), lim.max_retained, &rows);
            Ok(rows)
        })
    }

    fn lookup(&self, id: &str) -> Result<Lookup> {
        let lim = self.limits();
        // Candidates and ranks come from one snapshot.
        self.pool.read("looking up a retained child", |tx| lookup_in(tx, id, lim))
    }

    fn unit_usage(&self, id: &str) -> Result<Option<Value>> {
        self.pool.read("reading a unit's usage", |tx| {
            let raw: Option<Option<String>> = tx
                .prepare_cached(
                    "SELECT usage_json FROM async_delegations WHERE delegation_id = ?1",
                )?
                .query_row([id], |r| json_column(r, 0))
                .optional()?;
            Ok(parse_json_opt(raw.flatten().as_deref()))
        })
    }
}
