//! The retained-subagent registry (spec §3): units, their per-child rows,
//! retention, tombstones, pruning and lookups.
//!
//! Reads evaluate the addressability predicate of spec §3.1 through indexes
//! and never write; every write is one `BEGIN IMMEDIATE` transaction that
//! starts with the incremental backfill of hermes-retained units.

use rusqlite::{Connection, OptionalExtension, Row, Transaction, params};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::model::{
    ChildManifest, Completion, Lookup, PruneCount, RetainedChild, TombstoneReason, Unaddressable,
    UnitDraft, children_json, parse_children_json,
};
use crate::recovery::OwnerProbe;
use crate::{DeliveryClaim, DeliveryFilter, RecoveryReport, ResumeClaim, Store, UsageSwap};

/// Lease of a resume or delivery claim, in seconds.
pub const LEASE_SECS: f64 = 300.0;

/// The registry seam: everything the delegate layer and the CLI do with units.
///
/// Every method is one transaction. Lookups are unscoped; the lineage crate
/// adds the owner scope on top.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait Registry: Send + Sync {
    /// Writes a new `running` unit with its manifest and child sessions; returns its id.
    fn insert_unit(&self, draft: &UnitDraft) -> Result<String>;
    /// Records a unit's children manifest; `false` if the unit is missing.
    fn record_dispatched_children(&self, id: &str, children: &[ChildManifest]) -> Result<bool>;
    /// Retains a unit (never a tombstoned one) and prunes; `false` if nothing changed.
    #[allow(clippy::needless_lifetimes)] // mockall needs the named lifetime
    fn retain_completed_delegation<'a>(&self, id: &str, usage: Option<&'a Value>) -> Result<bool>;
    /// Records a terminal result; retains iff the status is exactly `completed`.
    fn persist_completion(&self, completion: &Completion) -> Result<bool>;
    /// Every addressable child, newest unit first, then by child index.
    fn list_retained_children(&self) -> Result<Vec<RetainedChild>>;
    /// The addressable child for a subagent, session or delegation id.
    fn find_retained_child(&self, id: &str) -> Result<Option<RetainedChild>>;
    /// The unscoped status of an id.
    fn lookup(&self, id: &str) -> Result<Lookup>;
    /// Tombstones an untombstoned child of a retained, untombstoned unit (for a
    /// delegation id: all of them), reason as given; `false` if none changed.
    fn tombstone_retained_child(&self, id: &str, reason: &TombstoneReason) -> Result<bool>;
    /// TTL and cap pruning; explicit limits are floored at 1 and 0.
    fn prune_retained_children(
        &self,
        max_retained: Option<u32>,
        ttl_hours: Option<f64>,
    ) -> Result<PruneCount>;
    /// Prunes with the configured limits and counts addressable children.
    fn rehydrate_retained_children(&self) -> Result<usize>;
    /// Restart recovery (spec §3.8).
    fn recover_abandoned_delegations(&self, probe: &dyn OwnerProbe) -> RecoveryReport;
    /// Claims the oldest deliverable completion.
    fn claim_delivery(&self, filter: &DeliveryFilter) -> Result<Option<DeliveryClaim>>;
    /// Acknowledges a claimed delivery; `false` if the lease was lost.
    fn ack_delivery(&self, id: &str, token: &str) -> Result<bool>;
    /// Takes the single-use resume claim of one child.
    fn claim_resume(&self, id: &str, child_index: u32) -> Result<ResumeClaim>;
    /// Renews a held resume claim; `false` if it is no longer ours.
    fn renew_resume(&self, id: &str, child_index: u32, token: &str) -> Result<bool>;
    /// Releases a held resume claim; `false` if it is no longer ours.
    fn release_resume(&self, id: &str, child_index: u32, token: &str) -> Result<bool>;
    /// After a follow-up: refresh `retained_at` (never un-tombstoning), swap
    /// the unit's `usage_json` if given, and release the claim — one
    /// transaction. A swap whose `expected` no longer matches fails with
    /// [`Error::Stale`] and changes nothing (re-read, re-merge, retry).
    #[allow(clippy::needless_lifetimes)]
    fn finish_follow_up<'a>(
        &self,
        id: &str,
        child_index: u32,
        token: &str,
        usage: Option<&'a UsageSwap>,
    ) -> Result<bool>;
    /// The unit's `usage_json` (malformed = `None`).
    fn unit_usage(&self, id: &str) -> Result<Option<Value>>;
    /// Deletes old non-retained history (spec §3.6); returns the rows deleted.
    fn prune_history(&self) -> Result<usize>;
}

/// A child's TTL clock: its own `retained_at`, else (rows recorded before another
/// writer retained the unit) the unit's.
const CHILD_RETAINED_AT: &str =
    "COALESCE(c.retained_at, CASE WHEN u.retained = 1 THEN u.retained_at END)";

const CHILD_COLS: &str = "c.delegation_id, c.child_index, c.subagent_id, c.child_session_id, \
     c.manifest_json, COALESCE(c.retained_at, CASE WHEN u.retained = 1 THEN u.retained_at END), \
     c.tombstoned_at, c.tombstone_reason, \
     u.parent_session_id, u.owner_profile, u.state, u.completed_at, u.retained, \
     u.retained_at, u.tombstoned_at";

/// A child row joined with its unit.
struct ChildRow {
    /// The entry, its `manifest` not yet parsed (see [`ChildRow::into_entry`]).
    entry: RetainedChild,
    manifest_json: Option<String>,
    child_tombstoned_at: Option<f64>,
    child_tombstone_reason: Option<String>,
    unit_retained: bool,
    unit_retained_at: Option<f64>,
    unit_tombstoned_at: Option<f64>,
}

impl ChildRow {
    /// The entry with its manifest parsed (only for rows that are returned).
    fn into_entry(self) -> RetainedChild {
        let mut entry = self.entry;
        entry.manifest =
            self.manifest_json.as_deref().and_then(ChildManifest::parse).unwrap_or_default();
        entry
    }
}

fn read_child_row(r: &Row<'_>) -> rusqlite::Result<ChildRow> {
    read_child_row_at(r, 0)
}

/// Reads the [`CHILD_COLS`] columns starting at column `o`.
fn read_child_row_at(r: &Row<'_>, o: usize) -> rusqlite::Result<ChildRow> {
    let manifest_json = crate::model::json_column(r, o + 4)?;

    let index: i64 = r.get(o + 1)?;
    let retained: Option<i64> = r.get(o + 12)?;
    Ok(ChildRow {
        entry: RetainedChild {
            delegation_id: r.get(o)?,
            child_index: u32::try_from(index).unwrap_or(u32::MAX),
            subagent_id: r.get::<_, Option<String>>(o + 2)?.unwrap_or_default(),
            child_session_id: r.get::<_, Option<String>>(o + 3)?.unwrap_or_default(),
            retained_at: r.get(o + 5)?,
            parent_session_id: r.get::<_, Option<String>>(o + 8)?.unwrap_or_default(),
            owner_profile: r.get::<_, Option<String>>(o + 9)?.unwrap_or_default(),
            state: r.get::<_, Option<String>>(o + 10)?.unwrap_or_default(),
            completed_at: r.get(o + 11)?,
            manifest: ChildManifest::default(),
        },
        manifest_json,
        child_tombstoned_at: r.get(o + 6)?,
        child_tombstone_reason: r.get(o + 7)?,
        unit_retained: retained == Some(1),
        unit_retained_at: r.get(o + 13)?,
        unit_tombstoned_at: r.get(o + 14)?,
    })
}

/// Limits in force for one evaluation.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    pub(crate) now: f64,
    pub(crate) max_retained: u32,
    pub(crate) ttl_hours: f64,
}

impl Limits {
    fn cutoff(self) -> f64 {
        self.now - self.ttl_hours * 3600.0
    }
}

/// Backfills child rows of `retained=1` units that have none (spec §2.6 step 4).
/// Writes cover untombstoned units; `tombstoned_since` (used at open) also
/// covers units another writer tombstoned at or after that time, so their
/// tombstone can be reported. Both are index range scans.
pub(crate) fn backfill(tx: &Transaction<'_>, tombstoned_since: Option<f64>) -> Result<usize> {
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
            let cj = crate::model::json_column(r, 1)?;
            let csid = crate::model::json_column(r, 2)?;
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

/// Every child row matching `id` as a subagent id (kind 0), a child session
/// id (1) or a delegation id (2): one statement, a multi-index OR.
fn candidates(conn: &Connection, id: &str) -> Result<Vec<(u8, ChildRow)>> {
    const SQL: &str = concat!(
        "SELECT CASE WHEN c.subagent_id = ?1 THEN 0 WHEN c.child_session_id = ?1 THEN 1 ELSE 2 END, ",
        "c.delegation_id, c.child_index, c.subagent_id, c.child_session_id, c.manifest_json, ",
        "COALESCE(c.retained_at, CASE WHEN u.retained = 1 THEN u.retained_at END), c.tombstoned_at, ",
        "c.tombstone_reason, u.parent_session_id, u.owner_profile, u.state, u.completed_at, u.retained, ",
        "u.retained_at, u.tombstoned_at FROM retinue_children c ",
        "JOIN async_delegations u ON u.delegation_id = c.delegation_id ",
        "WHERE c.subagent_id = ?1 OR c.child_session_id = ?1 OR c.delegation_id = ?1"
    );
    let mut stmt = conn.prepare_cached(SQL)?;
    let rows = stmt.query_map([id], |r| {
        let kind: i64 = r.get(0)?;
        Ok((u8::try_from(kind).unwrap_or(u8::MAX), read_child_row_at(r, 1)?))
    })?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

/// Number of live units ranked strictly above a unit, capped at `max`.
fn rank_of(conn: &Connection, id: &str, retained_at: Option<f64>, lim: Limits) -> Result<u32> {
    let mut stmt = conn.prepare_cached(
        "SELECT count(*) FROM (SELECT 1 FROM async_delegations u \
         WHERE u.retained = 1 AND u.tombstoned_at IS NULL \
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

/// Status without the cap rank: `Some(status)` when not live, `None` when
/// live (the caller then checks the rank).
fn live_status(row: &ChildRow, lim: Limits) -> Option<Unaddressable> {
    if let Some(at) = row.child_tombstoned_at {
        let reason = TombstoneReason::parse(row.child_tombstone_reason.as_deref());
        return Some(Unaddressable::Tombstoned { at, reason });
    }
    if let Some(at) = row.unit_tombstoned_at {
        return Some(Unaddressable::Tombstoned { at, reason: TombstoneReason::External });
    }
    let Some(retained_at) = row.entry.retained_at.filter(|_| row.unit_retained) else {
        return Some(Unaddressable::NeverRetained);
    };
    if retained_at < lim.cutoff() {
        let at = retained_at + lim.ttl_hours * 3600.0;
        return Some(Unaddressable::Tombstoned { at, reason: TombstoneReason::Ttl });
    }
    None
}

pub(crate) fn lookup_in(conn: &Connection, id: &str, lim: Limits) -> Result<Lookup> {
    let id = id.trim();
    if id.is_empty() {
        return Ok(Lookup::Unknown);
    }
    let mut scored: Vec<(Option<Unaddressable>, u8, ChildRow)> = candidates(conn, id)?
        .into_iter()
        .map(|(kind, row)| (live_status(&row, lim), kind, row))
        .collect();
    let order = |a: &(Option<Unaddressable>, u8, ChildRow),
                 b: &(Option<Unaddressable>, u8, ChildRow)| {
        a.0.is_some()
            .cmp(&b.0.is_some())
            .then(a.1.cmp(&b.1))
            .then(
                b.2.unit_retained_at
                    .unwrap_or(f64::NEG_INFINITY)
                    .total_cmp(&a.2.unit_retained_at.unwrap_or(f64::NEG_INFINITY)),
            )
            .then(b.2.entry.delegation_id.cmp(&a.2.entry.delegation_id))
            .then(a.2.entry.child_index.cmp(&b.2.entry.child_index))
    };
    scored.sort_by(order);
    // The cap rank is read only for live candidates, best first, until one is within the cap.
    for item in scored.iter_mut().filter(|s| s.0.is_none()) {
        if rank_of(conn, &item.2.entry.delegation_id, item.2.unit_retained_at, lim)?
            < lim.max_retained
        {
            break;
        }
        item.0 = Some(Unaddressable::Tombstoned { at: lim.now, reason: TombstoneReason::Cap });
    }
    scored.sort_by(order);
    Ok(match scored.into_iter().next() {
        None => Lookup::Unknown,
        Some((None, _, row)) => Lookup::Addressable(row.into_entry()),
        Some((Some(status), _, row)) => Lookup::NotAddressable(row.into_entry(), status),
    })
}

pub(crate) fn list_in(tx: &Connection, lim: Limits) -> Result<Vec<RetainedChild>> {
    let sql = format!(
        "WITH top AS (SELECT u.delegation_id AS id, u.retained_at AS rat FROM async_delegations u \
           WHERE u.retained = 1 AND u.tombstoned_at IS NULL AND EXISTS (SELECT 1 FROM \
             retinue_children c WHERE c.delegation_id = u.delegation_id \
             AND c.tombstoned_at IS NULL AND COALESCE(c.retained_at, u.retained_at) >= ?1) \
           ORDER BY u.retained_at DESC, u.delegation_id DESC LIMIT ?2) \
         SELECT {CHILD_COLS} FROM top \
           JOIN retinue_children c ON c.delegation_id = top.id \
           JOIN async_delegations u ON u.delegation_id = top.id \
         WHERE c.tombstoned_at IS NULL AND {CHILD_RETAINED_AT} >= ?1 \
         ORDER BY top.rat DESC, top.id DESC, c.child_index"
    );
    let mut stmt = tx.prepare_cached(&sql)?;
    let rows = stmt.query_map(params![lim.cutoff(), lim.max_retained], read_child_row)?;
    Ok(rows.map(|r| r.map(ChildRow::into_entry)).collect::<rusqlite::Result<_>>()?)
}

/// TTL then cap pruning inside the caller's transaction (spec §3.5).
/// Whether a prune at `lim` has anything to write (one read statement).
fn prune_due(conn: &Connection, lim: Limits) -> Result<bool> {
    const SQL: &str = concat!(
        "SELECT EXISTS (SELECT 1 FROM async_delegations u WHERE u.retained = 1 ",
        "  AND u.tombstoned_at IS NULL AND (",
        "    NOT EXISTS (SELECT 1 FROM retinue_children c WHERE c.delegation_id = u.delegation_id ",
        "                AND c.tombstoned_at IS NULL) ",
        "    OR EXISTS (SELECT 1 FROM retinue_children c WHERE c.delegation_id = u.delegation_id ",
        "               AND c.tombstoned_at IS NULL AND (c.retained_at IS NULL OR c.retained_at < ?1)))) ",
        "OR (SELECT count(*) FROM (SELECT 1 FROM async_delegations WHERE retained = 1 ",
        "    AND tombstoned_at IS NULL LIMIT ?2 + 1)) > ?2"
    );
    Ok(conn
        .prepare_cached(SQL)?
        .query_row(params![lim.cutoff(), lim.max_retained], |r| r.get(0))?)
}

pub(crate) fn prune_in(tx: &Transaction<'_>, lim: Limits) -> Result<PruneCount> {
    let t = lim.now;
    let mut count = PruneCount::default();
    count.children += tx
        .prepare_cached(
            "UPDATE retinue_children SET tombstoned_at = ?1, tombstone_reason = 'ttl' \
             WHERE delegation_id IN (SELECT delegation_id FROM async_delegations \
                                     WHERE retained = 1 AND tombstoned_at IS NULL) \
               AND tombstoned_at IS NULL AND (retained_at IS NULL OR retained_at < ?2)",
        )?
        .execute(params![t, lim.cutoff()])?;
    count.units += tx
        .prepare_cached(
            "UPDATE async_delegations SET tombstoned_at = ?1, updated_at = ?1 \
             WHERE retained = 1 AND tombstoned_at IS NULL AND NOT EXISTS (SELECT 1 FROM \
               retinue_children c WHERE c.delegation_id = async_delegations.delegation_id \
               AND c.tombstoned_at IS NULL)",
        )?
        .execute([t])?;
    // Cap: live units ranked at or beyond `max_retained`, set-based.
    const OVER_CAP: &str = "SELECT delegation_id FROM async_delegations WHERE retained = 1 \
         AND tombstoned_at IS NULL ORDER BY retained_at DESC, delegation_id DESC LIMIT -1 OFFSET ?2";
    count.children += tx
        .prepare_cached(&format!(
            "UPDATE retinue_children SET tombstoned_at = ?1, tombstone_reason = 'cap' \
             WHERE tombstoned_at IS NULL AND delegation_id IN ({OVER_CAP})"
        ))?
        .execute(params![t, lim.max_retained])?;
    count.units += tx
        .prepare_cached(&format!(
            "UPDATE async_delegations SET tombstoned_at = ?1, updated_at = ?1 \
             WHERE delegation_id IN ({OVER_CAP})"
        ))?
        .execute(params![t, lim.max_retained])?;
    Ok(count)
}

fn retain_in(tx: &Transaction<'_>, id: &str, usage: Option<&Value>, lim: Limits) -> Result<bool> {
    let now = lim.now;
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
    prune_in(tx, lim)?;
    Ok(true)
}

fn upsert_children(tx: &Transaction<'_>, id: &str, children: &[ChildManifest]) -> Result<()> {
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
            child.goal.as_deref().map(|g| crate::model::truncate_chars(g, 200)),
            child.to_json().to_string(),
        ])?;
    }
    Ok(())
}

/// Whether a constraint error is the unit id's primary key (and not, say, a
/// child session id that already exists).
fn is_unit_id_conflict(e: &rusqlite::Error) -> bool {
    e.to_string().contains("async_delegations.delegation_id")
}

fn lone_child_session(children: &[ChildManifest]) -> Option<String> {
    match children {
        [only] => Some(only.session_id.clone()),
        _ => None,
    }
}

impl Store {
    pub(crate) fn limits(&self) -> Limits {
        let d = &self.config.delegation;
        Limits {
            now: self.clock.now(),
            max_retained: d.max_retained.max(1),
            ttl_hours: d.retained_ttl_hours.max(0.0),
        }
    }

    fn insert_unit_in(&self, tx: &Transaction<'_>, draft: &UnitDraft, id: &str) -> Result<()> {
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
        Ok(())
    }
}

impl Registry for Store {
    fn insert_unit(&self, draft: &UnitDraft) -> Result<String> {
        for _ in 0..8 {
            let id = format!("deleg_{}", crate::db::random_hex(4)?);
            // A plain INSERT: an id already taken fails the primary key, the
            // whole transaction rolls back, and a new id is drawn.
            match self.pool.write(|tx| self.insert_unit_in(tx, draft, &id)) {
                Ok(()) => return Ok(id),
                Err(Error::Conflict(e)) if is_unit_id_conflict(&e) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(Error::Invalid("could not allocate a unique delegation id".to_owned()))
    }

    fn record_dispatched_children(&self, id: &str, children: &[ChildManifest]) -> Result<bool> {
        if id.trim().is_empty() {
            return Ok(false);
        }
        let now = self.clock.now();
        let profile = self.profile.clone();
        self.pool.write(|tx| {
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

    #[allow(clippy::needless_lifetimes)]
    fn retain_completed_delegation<'a>(&self, id: &str, usage: Option<&'a Value>) -> Result<bool> {
        let lim = self.limits();
        self.pool.write(|tx| retain_in(tx, id, usage, lim))
    }

    fn persist_completion(&self, c: &Completion) -> Result<bool> {
        let lim = self.limits();
        let now = lim.now;
        let status = if c.status.trim().is_empty() { "completed" } else { c.status.as_str() };
        self.pool.write(|tx| {
            backfill(tx, None)?;
            let (delivery, delivered_at) =
                if c.background { ("pending", None) } else { ("delivered", Some(now)) };
            let changed = tx
                .prepare_cached(
                    "UPDATE async_delegations SET state = ?1, completed_at = ?2, updated_at = ?2, \
                     event_json = ?3, result_json = ?4, usage_json = COALESCE(?5, usage_json), \
                     delivery_state = ?6, delivered_at = ?7 WHERE delegation_id = ?8",
                )?
                .execute(params![
                    status,
                    now,
                    c.event.to_string(),
                    c.result.to_string(),
                    c.usage.as_ref().map(Value::to_string),
                    delivery,
                    delivered_at,
                    c.delegation_id,
                ])?;
            if changed == 0 {
                return Ok(false);
            }
            if status == "completed" {
                retain_in(tx, &c.delegation_id, None, lim)?;
            }
            Ok(true)
        })
    }

    fn list_retained_children(&self) -> Result<Vec<RetainedChild>> {
        let lim = self.limits();
        self.pool.query(|conn| list_in(conn, lim))
    }

    fn find_retained_child(&self, id: &str) -> Result<Option<RetainedChild>> {
        Ok(match self.lookup(id)? {
            Lookup::Addressable(entry) => Some(entry),
            _ => None,
        })
    }

    fn lookup(&self, id: &str) -> Result<Lookup> {
        let lim = self.limits();
        // Candidates and ranks come from one snapshot.
        self.pool.read(|tx| lookup_in(tx, id, lim))
    }

    fn tombstone_retained_child(&self, id: &str, reason: &TombstoneReason) -> Result<bool> {
        let id = id.trim();
        if id.is_empty() {
            return Ok(false);
        }
        let lim = self.limits();
        let t = lim.now;
        self.pool.write(|tx| {
            backfill(tx, None)?;
            // Ordered by preference: subagent, then session, then delegation id.
            let mut units: Vec<String> = Vec::new();
            let mut changed = 0;
            for column in ["subagent_id", "child_session_id", "delegation_id"] {
                let sql = format!(
                    "UPDATE retinue_children SET tombstoned_at = ?1, tombstone_reason = ?2 \
                     WHERE {column} = ?3 AND tombstoned_at IS NULL \
                     AND EXISTS (SELECT 1 FROM async_delegations u \
                       WHERE u.delegation_id = retinue_children.delegation_id \
                       AND u.retained = 1 AND u.tombstoned_at IS NULL) \
                     RETURNING delegation_id"
                );
                let mut stmt = tx.prepare_cached(&sql)?;
                let rows =
                    stmt.query_map(params![t, reason.as_str(), id], |r| r.get::<_, String>(0))?;
                for unit in rows {
                    let unit = unit?;
                    changed += 1;
                    if !units.contains(&unit) {
                        units.push(unit);
                    }
                }
                if changed > 0 {
                    break;
                }
            }
            for unit in &units {
                let any_live: bool = tx
                    .prepare_cached(
                        "SELECT 1 FROM retinue_children WHERE delegation_id = ?1 \
                         AND tombstoned_at IS NULL AND retained_at >= ?2",
                    )?
                    .exists(params![unit, lim.cutoff()])?;
                if !any_live {
                    tx.prepare_cached(
                        "UPDATE retinue_children SET tombstoned_at = ?1, tombstone_reason = 'ttl' \
                         WHERE delegation_id = ?2 AND tombstoned_at IS NULL",
                    )?
                    .execute(params![t, unit])?;
                    tx.prepare_cached(
                        "UPDATE async_delegations SET tombstoned_at = ?1, updated_at = ?1 \
                         WHERE delegation_id = ?2 AND tombstoned_at IS NULL",
                    )?
                    .execute(params![t, unit])?;
                }
            }
            Ok(changed > 0)
        })
    }

    fn prune_retained_children(
        &self,
        max_retained: Option<u32>,
        ttl_hours: Option<f64>,
    ) -> Result<PruneCount> {
        let mut lim = self.limits();
        if let Some(m) = max_retained {
            lim.max_retained = m.max(1);
        }
        if let Some(h) = ttl_hours {
            if !h.is_finite() {
                return Err(Error::Invalid(format!("ttl_hours must be finite, got {h}")));
            }
            lim.ttl_hours = h.max(0.0);
        }
        // Nothing due (the common case): no write transaction at all.
        if !self.pool.query(|conn| prune_due(conn, lim))? {
            return Ok(PruneCount::default());
        }
        self.pool.write(|tx| {
            backfill(tx, None)?;
            prune_in(tx, lim)
        })
    }

    fn rehydrate_retained_children(&self) -> Result<usize> {
        let lim = self.limits();
        let n = self.pool.write(|tx| {
            backfill(tx, None)?;
            prune_in(tx, lim)?;
            Ok(list_in(tx, lim)?.len())
        })?;
        log::info!("rehydrated {n} addressable retained children");
        Ok(n)
    }

    fn recover_abandoned_delegations(&self, probe: &dyn OwnerProbe) -> RecoveryReport {
        crate::recovery::recover(self, probe)
    }

    fn claim_delivery(&self, filter: &DeliveryFilter) -> Result<Option<DeliveryClaim>> {
        crate::delivery::claim(self, filter)
    }

    fn ack_delivery(&self, id: &str, token: &str) -> Result<bool> {
        crate::delivery::ack(self, id, token)
    }

    fn claim_resume(&self, id: &str, child_index: u32) -> Result<ResumeClaim> {
        let now = self.clock.now();
        self.pool.write(|tx| {
            type ClaimRow = (Option<f64>, Option<f64>, Option<String>, Option<f64>);
            let row: Option<ClaimRow> = tx
                .prepare_cached(
                    "SELECT c.tombstoned_at, u.tombstoned_at, c.resume_claim, c.resume_claimed_at \
                     FROM retinue_children c JOIN async_delegations u \
                       ON u.delegation_id = c.delegation_id \
                     WHERE c.delegation_id = ?1 AND c.child_index = ?2",
                )?
                .query_row(params![id, child_index], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
                })
                .optional()?;
            let Some((child_tomb, unit_tomb, claim, claimed_at)) = row else {
                return Ok(ResumeClaim::Unavailable);
            };
            if child_tomb.is_some() || unit_tomb.is_some() {
                return Ok(ResumeClaim::Unavailable);
            }
            if claim.is_some() {
                let at = claimed_at.unwrap_or(f64::NEG_INFINITY);
                if at + LEASE_SECS > now {
                    return Ok(ResumeClaim::Busy { claimed_at: at, expires_at: at + LEASE_SECS });
                }
            }
            let token = crate::db::random_hex(16)?;
            tx.prepare_cached(
                "UPDATE retinue_children SET resume_claim = ?1, resume_claimed_at = ?2 \
                 WHERE delegation_id = ?3 AND child_index = ?4",
            )?
            .execute(params![token, now, id, child_index])?;
            Ok(ResumeClaim::Claimed { token })
        })
    }

    fn renew_resume(&self, id: &str, child_index: u32, token: &str) -> Result<bool> {
        let now = self.clock.now();
        self.pool.write(|tx| {
            let n = tx
                .prepare_cached(
                    "UPDATE retinue_children SET resume_claimed_at = ?1 WHERE delegation_id = ?2 \
                     AND child_index = ?3 AND resume_claim = ?4",
                )?
                .execute(params![now, id, child_index, token])?;
            Ok(n > 0)
        })
    }

    fn release_resume(&self, id: &str, child_index: u32, token: &str) -> Result<bool> {
        self.pool.write(|tx| release_in(tx, id, child_index, token))
    }

    #[allow(clippy::needless_lifetimes)]
    fn finish_follow_up<'a>(
        &self,
        id: &str,
        child_index: u32,
        token: &str,
        usage: Option<&'a UsageSwap>,
    ) -> Result<bool> {
        let now = self.clock.now();
        self.pool.write(|tx| {
            // Nothing is written for a holder whose lease passed to someone else.
            let held = tx
                .prepare_cached(
                    "SELECT 1 FROM retinue_children WHERE delegation_id = ?1 \
                     AND child_index = ?2 AND resume_claim = ?3",
                )?
                .exists(params![id, child_index, token])?;
            if !held {
                return Ok(false);
            }
            if let Some(swap) = usage {
                let current: Option<Value> = tx
                    .prepare_cached(
                        "SELECT usage_json FROM async_delegations WHERE delegation_id = ?1",
                    )?
                    .query_row([id], |r| crate::model::json_column(r, 0))
                    .optional()?
                    .flatten()
                    .and_then(|text| serde_json::from_str(&text).ok());
                if current != swap.expected {
                    return Err(Error::Stale { what: "the unit's usage_json" });
                }
                tx.prepare_cached(
                    "UPDATE async_delegations SET usage_json = ?1, updated_at = ?2 \
                     WHERE delegation_id = ?3",
                )?
                .execute(params![swap.new.to_string(), now, id])?;
            }
            tx.prepare_cached(
                "UPDATE retinue_children SET retained_at = ?1 WHERE delegation_id = ?2 \
                 AND child_index = ?3 AND tombstoned_at IS NULL",
            )?
            .execute(params![now, id, child_index])?;
            tx.prepare_cached(
                "UPDATE async_delegations SET retained_at = ?1, updated_at = ?1 \
                 WHERE delegation_id = ?2 AND tombstoned_at IS NULL AND retained = 1",
            )?
            .execute(params![now, id])?;
            release_in(tx, id, child_index, token)
        })
    }

    fn unit_usage(&self, id: &str) -> Result<Option<Value>> {
        self.pool.read(|tx| {
            let raw: Option<Option<String>> = tx
                .prepare_cached(
                    "SELECT usage_json FROM async_delegations WHERE delegation_id = ?1",
                )?
                .query_row([id], |r| crate::model::json_column(r, 0))
                .optional()?;
            Ok(crate::model::parse_json_opt(raw.flatten().as_deref()))
        })
    }

    fn prune_history(&self) -> Result<usize> {
        crate::history::prune(self)
    }
}

fn release_in(tx: &Transaction<'_>, id: &str, child_index: u32, token: &str) -> Result<bool> {
    let n = tx
        .prepare_cached(
            "UPDATE retinue_children SET resume_claim = NULL, resume_claimed_at = NULL \
             WHERE delegation_id = ?1 AND child_index = ?2 AND resume_claim = ?3",
        )?
        .execute(params![id, child_index, token])?;
    Ok(n > 0)
}
