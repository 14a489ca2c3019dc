//! Retention (semantics §3.5): per-child tombstones, TTL and cap pruning,
//! rehydration; the entry points of restart recovery and history pruning.

use rusqlite::{Connection, OptionalExtension, Transaction, params};

use crate::error::{Result, SqlResult};
use crate::registry::Retention;
use crate::registry::addressability::{list_in, resolve_in};
use crate::registry::backfill::backfill;
use crate::rows::{CHILD_RETAINED_AT, Limits, RawValue, live_profiles, live_profiles_cte};
use crate::store::Store;
use retinue_core::OwnerProbe;
use retinue_core::{PruneCount, RecoveryReport, TombstoneReason};

/// Whether a prune of `profile`'s units (every profile's, for the empty
/// operator profile) at `lim` has anything to write (one read statement).
pub(crate) fn prune_due(conn: &Connection, lim: Limits, profile: &str) -> SqlResult<bool> {
    if profile.is_empty() {
        return Ok(conn
            .prepare_cached(OPERATOR_DUE)?
            .query_row(params![lim.cutoff(), lim.max_retained], |r| r.get(0))?);
    }
    // The cap first (a unit ranked at `max_retained` in the profile exists);
    // when it is due, the scan over the profile's live units is skipped.
    const SQL: &str = concat!(
        "SELECT EXISTS (SELECT 1 ",
        "    FROM async_delegations u WHERE u.retained = 1 AND u.tombstoned_at IS NULL ",
        "    AND COALESCE(u.owner_profile, '') = ?3 ",
        "    ORDER BY u.retained_at DESC, u.delegation_id DESC LIMIT 1 OFFSET ?2) ",
        "OR EXISTS (SELECT 1 ",
        "    FROM async_delegations u WHERE u.retained = 1 AND u.tombstoned_at IS NULL ",
        "    AND COALESCE(u.owner_profile, '') = '' ",
        "    ORDER BY u.retained_at DESC, u.delegation_id DESC LIMIT 1 OFFSET ?2) ",
        "OR EXISTS (SELECT 1 FROM async_delegations u WHERE u.retained = 1 ",
        "  AND u.tombstoned_at IS NULL AND COALESCE(u.owner_profile, '') IN ('', ?3) AND (",
        "    NOT EXISTS (SELECT 1 FROM retinue_children c WHERE c.delegation_id = u.delegation_id ",
        "                AND c.tombstoned_at IS NULL) ",
        "    OR EXISTS (SELECT 1 FROM retinue_children c WHERE c.delegation_id = u.delegation_id ",
        "               AND c.tombstoned_at IS NULL AND (c.retained_at IS NULL OR c.retained_at < ?1))))"
    );
    Ok(conn
        .prepare_cached(SQL)?
        .query_row(params![lim.cutoff(), lim.max_retained, profile], |r| r.get(0))?)
}

/// [`prune_due`] for the operator (the empty profile): the cap of every
/// profile (a unit ranked at `max_retained` in its profile exists), then
/// the TTL over every live unit.
const OPERATOR_DUE: &str = concat!(
    live_profiles_cte!(),
    "SELECT EXISTS (SELECT 1 FROM p WHERE p.v IS NOT NULL AND EXISTS (SELECT 1 ",
    "    FROM async_delegations u WHERE u.retained = 1 AND u.tombstoned_at IS NULL ",
    "    AND COALESCE(u.owner_profile, '') = p.v ",
    "    ORDER BY u.retained_at DESC, u.delegation_id DESC LIMIT 1 OFFSET ?2)) ",
    "OR EXISTS (SELECT 1 FROM async_delegations u WHERE u.retained = 1 ",
    "  AND u.tombstoned_at IS NULL AND (",
    "    NOT EXISTS (SELECT 1 FROM retinue_children c WHERE c.delegation_id = u.delegation_id ",
    "                AND c.tombstoned_at IS NULL) ",
    "    OR EXISTS (SELECT 1 FROM retinue_children c WHERE c.delegation_id = u.delegation_id ",
    "               AND c.tombstoned_at IS NULL AND (c.retained_at IS NULL OR c.retained_at < ?1))))"
);

/// Live units of profile `?4` ranked beyond the cap: after the unit at the
/// boundary (`?2` its `retained_at`, `?3` its id) in `retained_at DESC,
/// delegation_id DESC` order (NULL times last). `u` is the unit.
const BEYOND_CAP: &str = "u.retained = 1 AND u.tombstoned_at IS NULL \
     AND COALESCE(u.owner_profile, '') = ?4 AND CASE WHEN ?2 IS NULL \
     THEN u.retained_at IS NULL AND u.delegation_id < ?3 \
     ELSE u.retained_at IS NULL OR u.retained_at < ?2 \
       OR (u.retained_at = ?2 AND u.delegation_id < ?3) END";

/// Writes the unit-level tombstones of the units `pred` selects (a
/// predicate on `u`, bound to `params`, whose `?1` is the time): their
/// `retinue_unit_tombstones` rows, the count of children they cover, and
/// the units' `tombstoned_at` (as hermes writes it). Returns (units, children).
fn tombstone_units(
    tx: &Transaction<'_>,
    pred: &str,
    params: &[&dyn rusqlite::ToSql],
    ttl_seconds: f64,
) -> SqlResult<(usize, usize)> {
    // `?1` is the time; the TTL goes last.
    let ttl_param = params.len() + 1;
    let mut with_ttl: Vec<&dyn rusqlite::ToSql> = params.to_vec();
    with_ttl.push(&ttl_seconds);
    // `OR REPLACE` / `OR FAIL`: no statement journal (a failure fails the
    // whole transaction, which the caller then rolls back), and a unit
    // tombstoned again (another writer cleared its tombstone) replaces its row.
    tx.prepare_cached(&format!(
        "INSERT OR REPLACE INTO retinue_unit_tombstones (delegation_id, tombstoned_at, \
         ttl_seconds) SELECT u.delegation_id, ?1, ?{ttl_param} FROM async_delegations u \
         WHERE {pred}"
    ))?
    .execute(with_ttl.as_slice())?;
    let children: i64 = tx
        .prepare_cached(&format!(
            "SELECT count(*) FROM async_delegations u JOIN retinue_children c \
             ON c.delegation_id = u.delegation_id \
             WHERE {pred} AND c.tombstoned_at IS NULL"
        ))?
        .query_row(params, |r| r.get(0))?;
    let units = tx
        .prepare_cached(&format!(
            "UPDATE OR FAIL async_delegations AS u SET tombstoned_at = ?1, updated_at = ?1 \
             WHERE {pred}"
        ))?
        .execute(params)?;
    Ok((units, usize::try_from(children).unwrap_or(usize::MAX)))
}

/// TTL then cap pruning of `profile`'s units — a process prunes only its
/// own tenant, with its own limits (issue #22); the empty profile is the
/// operator of a single-user home (hermes's view), who prunes every
/// profile, each ranked among its own — inside the caller's transaction
/// (semantics §3.5). A
/// unit tombstoned here covers its children (one `retinue_unit_tombstones`
/// row per unit, none per child; readers report each child's reason and
/// time exactly as a per-child write stored them); children that expire in
/// a unit that stays live get their own `ttl` row.
pub(crate) fn prune_in(tx: &Transaction<'_>, lim: Limits, profile: &str) -> SqlResult<PruneCount> {
    let t = lim.now;
    let ttl_seconds = lim.ttl_seconds();
    let mut count = PruneCount::default();
    if !tx
        .prepare_cached(TTL_DUE)?
        .query_row(params![lim.cutoff(), profile], |r| r.get::<_, bool>(0))?
    {
        return cap_in(tx, lim, profile, count);
    }
    // TTL, whole units: live units left without a live child (every child
    // tombstoned or past its TTL, or none at all).
    let (units, children) = tombstone_units(
        tx,
        "u.retained = 1 AND u.tombstoned_at IS NULL AND (?3 = '' OR COALESCE(u.owner_profile, '') IN ('', ?3)) \
           AND NOT EXISTS (SELECT 1 FROM \
           retinue_children c WHERE c.delegation_id = u.delegation_id \
           AND c.tombstoned_at IS NULL AND c.retained_at >= ?2)",
        &[&t, &lim.cutoff(), &profile],
        ttl_seconds,
    )?;
    count.units += units;
    count.children += children;
    // TTL, single children of units that stay live: their own row.
    count.children += tx
        .prepare_cached(
            // The time is the child's expiry (as lookups reported it), never later than now.
            "UPDATE retinue_children SET tombstone_reason = 'ttl', \
               tombstoned_at = MIN(?1, COALESCE(retained_at + ?3, ?1)) \
             WHERE delegation_id IN (SELECT delegation_id FROM async_delegations \
                                     WHERE retained = 1 AND tombstoned_at IS NULL \
                                       AND (?4 = '' OR COALESCE(owner_profile, '') IN ('', ?4))) \
               AND tombstoned_at IS NULL AND (retained_at IS NULL OR retained_at < ?2)",
        )?
        .execute(params![t, lim.cutoff(), ttl_seconds, profile])?;
    cap_in(tx, lim, profile, count)
}

/// Whether the TTL has anything to write (`?1`: the cutoff, `?2`: the
/// profile): a live unit without a live child, or with a child past its TTL.
const TTL_DUE: &str = concat!(
    "SELECT EXISTS (SELECT 1 FROM async_delegations u WHERE u.retained = 1 ",
    "  AND u.tombstoned_at IS NULL AND (?2 = '' OR COALESCE(u.owner_profile, '') IN ('', ?2)) AND (",
    "    NOT EXISTS (SELECT 1 FROM retinue_children c WHERE c.delegation_id = u.delegation_id ",
    "                AND c.tombstoned_at IS NULL AND c.retained_at >= ?1) ",
    "    OR EXISTS (SELECT 1 FROM retinue_children c WHERE c.delegation_id = u.delegation_id ",
    "               AND c.tombstoned_at IS NULL AND (c.retained_at IS NULL OR c.retained_at < ?1))))"
);

/// The cap step of [`prune_in`]: `profile`'s live units (every profile's,
/// for the operator) ranked at or beyond `max_retained` among that
/// profile's, after the last one kept. A profile within its cap costs one
/// bounded index range.
fn cap_in(
    tx: &Transaction<'_>,
    lim: Limits,
    profile: &str,
    mut count: PruneCount,
) -> SqlResult<PruneCount> {
    let (t, ttl_seconds) = (lim.now, lim.ttl_seconds());
    // A tenant's process prunes its own profile and the unprofiled units
    // (hermes's, before profiles existed: every tenant's to read), each
    // ranked among its own.
    let profiles = if profile.is_empty() {
        live_profiles(tx)?
    } else {
        vec![RawValue::Text(profile.as_bytes().to_vec()), RawValue::Text(Vec::new())]
    };
    for profile in profiles {
        // Read and bound back as stored (a hostile row's id may not be text).
        let boundary: Option<(RawValue, RawValue)> = tx
            .prepare_cached(
                "SELECT u.retained_at, u.delegation_id FROM async_delegations u \
                 WHERE u.retained = 1 AND u.tombstoned_at IS NULL \
                   AND COALESCE(u.owner_profile, '') = ?2 \
                 ORDER BY u.retained_at DESC, u.delegation_id DESC LIMIT 1 OFFSET ?1",
            )?
            .query_row(params![i64::from(lim.max_retained) - 1, profile], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .optional()?;
        if let Some((at, id)) = boundary {
            let (units, children) =
                tombstone_units(tx, BEYOND_CAP, &[&t, &at, &id, &profile], ttl_seconds)?;
            count.units += units;
            count.children += children;
        }
    }
    Ok(count)
}

/// Tombstones the row `id` resolves to (lookup order), if addressable.
fn tombstone_in(
    tx: &Transaction<'_>,
    id: &str,
    note: Option<&str>,
    lim: Limits,
) -> SqlResult<bool> {
    let Some((kind, None, row)) = resolve_in(tx, id, lim)? else {
        return Ok(false);
    };
    let t = lim.now;
    let unit = row.entry.delegation_id.as_str();
    let changed = if kind == 2 {
        // A delegation id: that unit's live children only.
        tx.prepare_cached(
            &format!(
                "UPDATE retinue_children SET tombstoned_at = ?1, tombstone_reason = 'manual', \
             tombstone_note = ?2 WHERE delegation_id = ?3 AND tombstoned_at IS NULL \
             AND (SELECT {CHILD_RETAINED_AT} FROM async_delegations u \
                  WHERE u.delegation_id = retinue_children.delegation_id) >= ?4"
            )
            .replace("c.retained_at", "retinue_children.retained_at"),
        )?
        .execute(params![t, note, unit, lim.cutoff()])?
    } else {
        tx.prepare_cached(
            "UPDATE retinue_children SET tombstoned_at = ?1, tombstone_reason = 'manual', \
             tombstone_note = ?2 WHERE delegation_id = ?3 AND child_index = ?4 \
             AND tombstoned_at IS NULL",
        )?
        .execute(params![t, note, unit, row.entry.child_index])?
    };
    // No live child left: the unit is tombstoned; children already past their
    // TTL keep `ttl` and their expiry time (as lookups reported them).
    let any_live: bool = tx
        .prepare_cached(&format!(
            "SELECT EXISTS (SELECT 1 FROM retinue_children c JOIN async_delegations u \
             ON u.delegation_id = c.delegation_id WHERE c.delegation_id = ?1 \
             AND c.tombstoned_at IS NULL AND {CHILD_RETAINED_AT} >= ?2)"
        ))?
        .query_row(params![unit, lim.cutoff()], |r| r.get(0))?;
    if !any_live {
        tx.prepare_cached(
            "UPDATE retinue_children SET tombstone_reason = 'ttl', tombstoned_at = \
             MIN(?1, COALESCE(COALESCE(retained_at, (SELECT u.retained_at FROM async_delegations u \
               WHERE u.delegation_id = retinue_children.delegation_id)) + ?3, ?1)) \
             WHERE delegation_id = ?2 AND tombstoned_at IS NULL",
        )?
        .execute(params![t, unit, lim.ttl_seconds()])?;
        tx.prepare_cached(
            "UPDATE async_delegations SET tombstoned_at = ?1, updated_at = ?1 \
             WHERE delegation_id = ?2 AND tombstoned_at IS NULL",
        )?
        .execute(params![t, unit])?;
    }
    Ok(changed > 0)
}

impl Retention for Store {
    fn tombstone_retained_child(&self, id: &str, reason: &TombstoneReason) -> Result<bool> {
        let id = id.trim();
        if id.is_empty() {
            return Ok(false);
        }
        let note = reason.note();
        let lim = self.limits();
        self.pool.write("tombstoning a retained child", |tx| {
            backfill(tx, None)?;
            tombstone_in(tx, id, note.as_deref(), lim)
        })
    }

    fn prune_retained_children(
        &self,
        max_retained: Option<u32>,
        ttl_hours: Option<f64>,
    ) -> Result<PruneCount> {
        let lim = self.limits().with_overrides(max_retained, ttl_hours)?;
        let profile = self.profile.as_str();
        // Nothing due (the common case): no write transaction at all.
        if !self
            .pool
            .query("checking whether a prune is due", |conn| prune_due(conn, lim, profile))?
        {
            return Ok(PruneCount::default());
        }
        self.pool.write("pruning retained children", |tx| {
            backfill(tx, None)?;
            prune_in(tx, lim, profile)
        })
    }

    fn rehydrate_retained_children(&self) -> Result<usize> {
        let lim = self.limits();
        let n = self.pool.write("rehydrating retained children", |tx| {
            backfill(tx, None)?;
            prune_in(tx, lim, &self.profile)?;
            Ok(list_in(tx, lim)?.len())
        })?;
        log::info!("rehydrated {n} addressable retained children");
        Ok(n)
    }

    fn recover_abandoned_delegations(&self, probe: &dyn OwnerProbe) -> RecoveryReport {
        super::recovery::recover(self, probe)
    }

    fn prune_history(&self) -> Result<usize> {
        super::history::prune(self)
    }
}
