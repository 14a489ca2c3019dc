//! [`Retention`] on PostgreSQL: tombstones, TTL and per-profile cap pruning,
//! rehydration, and the live count the triggers keep per tenant.

use retinue_core::{OwnerProbe, PruneCount, RecoveryReport, Result, Retention, TombstoneReason};

use crate::pool::{Mode, PgResult, Tx, int};
use crate::registry::addressability::{list_in, resolve_adopting};
use crate::registry::backfill::backfill;
use crate::rows::{CHILD_RETAINED_AT, PROFILE};
use crate::store::{Limits, PgStore};

/// Whether a prune would change anything, in one read-only statement that
/// looks only where something can be due: children past the TTL (the old
/// end of `retinue_idx_children_ttl`, and live children without a TTL clock)
/// and profiles with more live units than the cap (`retinue_profile_live`,
/// one row per profile).
///
/// A live retained unit without any live child is not looked for (that
/// would read every live unit): no write of this backend leaves one behind —
/// tombstoning a unit's last live child tombstones the unit, and retaining
/// or completing a unit prunes in the same transaction, as does `retinue
/// migrate` after copying a state.db.
fn prune_due(tx: &mut Tx<'_>, lim: Limits, profile: &str) -> PgResult<bool> {
    // Two range reads of the TTL index, each in index order, so that the
    // generic plan of the prepared statement (the cutoff unknown) keeps
    // reading the index from its old end instead of scanning the table.
    // (A scalar subquery, because EXISTS drops the ORDER BY … LIMIT.)
    let sql = "SELECT (SELECT c.retained_at FROM retinue_children c \
             JOIN async_delegations u ON u.delegation_id = c.delegation_id \
             WHERE c.tombstoned_at IS NULL AND c.retained_at < $1 \
             AND u.retained = 1 AND u.tombstoned_at IS NULL \
             AND ($3 = '' OR COALESCE(u.owner_profile, '') IN ('', $3)) \
             ORDER BY c.retained_at LIMIT 1) IS NOT NULL \
         OR EXISTS (SELECT 1 FROM retinue_children c \
             JOIN async_delegations u ON u.delegation_id = c.delegation_id \
             WHERE c.tombstoned_at IS NULL AND c.retained_at IS NULL \
             AND u.retained = 1 AND u.tombstoned_at IS NULL \
             AND ($3 = '' OR COALESCE(u.owner_profile, '') IN ('', $3))) \
         OR EXISTS (SELECT 1 FROM retinue_profile_live WHERE ($3 = '' OR profile IN ('', $3)) \
             GROUP BY profile HAVING sum(units)::BIGINT > $2)";
    Ok(tx.query_one(sql, &[&lim.cutoff(), &int(lim.max_retained), &profile])?.try_get(0)?)
}

/// What a prune's write transaction does: adopt (child rows for retained
/// units that have none), then prune.
pub(crate) fn adopt_and_prune(tx: &mut Tx<'_>, lim: Limits, profile: &str) -> PgResult<PruneCount> {
    backfill(tx)?;
    let n = prune_in(tx, lim, profile)?;
    // What was copied may be any tenant's: the prune counts only its own
    // profile, and a count too low would let a reader skip the exact rank.
    recount(tx, "")?;
    Ok(n)
}

/// Recounts `retinue_profile_live` exactly, in the caller's transaction,
/// for `profile`'s tenant (its own and the unprofiled units; every profile
/// for the empty profile): each profile's count on stripe 0, its other
/// stripes to 0 (the triggers of migration V11 keep the sum exact between
/// recounts; this repairs a count edited by hand or written with triggers
/// off). Rows already right are not written.
pub(crate) fn recount(tx: &mut Tx<'_>, profile: &str) -> PgResult<()> {
    let sql = format!(
        "WITH c AS (SELECT {PROFILE} AS p, count(*) AS n FROM async_delegations \
           WHERE retained = 1 AND tombstoned_at IS NULL AND ($1 = '' OR {PROFILE} IN ('', $1)) \
           GROUP BY 1), \
         z AS (UPDATE retinue_profile_live SET units = 0 WHERE units <> 0 \
           AND ($1 = '' OR profile IN ('', $1)) \
           AND NOT (stripe = 0 AND profile IN (SELECT p FROM c))) \
         INSERT INTO retinue_profile_live (profile, stripe, units) SELECT p, 0, n FROM c \
         ON CONFLICT (profile, stripe) DO UPDATE SET units = EXCLUDED.units \
         WHERE retinue_profile_live.units <> EXCLUDED.units"
    );
    tx.execute(&sql, &[&profile])?;
    Ok(())
}

/// TTL then cap pruning of `profile`'s units only: a process prunes its
/// own tenant, with its own limits (issue #22). The empty profile (the
/// operator; team mode always names one) prunes every profile, each ranked
/// among its own.
///
/// One statement, bounded by the tenant's live units (at most the cap and
/// the one just retained, in steady state) and their children: the TTL's
/// children and the units it leaves without a live child, the cap's units
/// and children; then the tenant's live count, recounted (no other
/// tenant's).
pub(crate) fn prune_in(tx: &mut Tx<'_>, lim: Limits, profile: &str) -> PgResult<PruneCount> {
    let t = lim.now;
    // One statement on one snapshot. `live` is the tenant's live units, each
    // with whether a child of it stays within the TTL (`keeps`); the TTL
    // tombstones the other children (`ttl`, at their expiry) and the units
    // without such a child; the cap ranks the units that keep one and
    // tombstones, beyond `max_retained`, their children still within the
    // TTL (`cap`) and the units. The four
    // updates touch disjoint rows, exactly the rows the TTL pass and then
    // the cap pass would. A child without a TTL clock of its own (written
    // by another program) is judged by its unit's, as every read judges it.
    let sql = format!(
        "WITH live AS (SELECT delegation_id, {PROFILE} AS p, retained_at, EXISTS (SELECT 1 \
             FROM retinue_children k WHERE k.delegation_id = u.delegation_id \
             AND k.tombstoned_at IS NULL \
             AND COALESCE(k.retained_at, u.retained_at) >= $2) AS keeps \
           FROM async_delegations u WHERE retained = 1 AND tombstoned_at IS NULL \
             AND ($4 = '' OR {PROFILE} IN ('', $4))), \
         ranked AS (SELECT delegation_id, p, retained_at, row_number() OVER (PARTITION BY p \
             ORDER BY retained_at DESC NULLS LAST, delegation_id DESC) AS rn \
           FROM live WHERE keeps), \
         over AS (SELECT delegation_id, retained_at FROM ranked WHERE rn > $5), \
         tc AS (UPDATE retinue_children c SET tombstone_reason = 'ttl', \
             tombstoned_at = LEAST($1, COALESCE(COALESCE(c.retained_at, l.retained_at) + $3, $1)) \
           FROM live l WHERE l.delegation_id = c.delegation_id AND c.tombstoned_at IS NULL \
             AND (COALESCE(c.retained_at, l.retained_at) < $2) IS NOT FALSE RETURNING 1), \
         tu AS (UPDATE async_delegations SET tombstoned_at = $1, updated_at = $1 \
           WHERE delegation_id IN (SELECT delegation_id FROM live WHERE NOT keeps) RETURNING 1), \
         cc AS (UPDATE retinue_children c SET tombstoned_at = $1, tombstone_reason = 'cap' \
           FROM over o WHERE o.delegation_id = c.delegation_id AND c.tombstoned_at IS NULL \
             AND COALESCE(c.retained_at, o.retained_at) >= $2 RETURNING 1), \
         cu AS (UPDATE async_delegations SET tombstoned_at = $1, updated_at = $1 \
           WHERE delegation_id IN (SELECT delegation_id FROM over) RETURNING 1) \
         SELECT (SELECT count(*) FROM tc) + (SELECT count(*) FROM cc), \
           (SELECT count(*) FROM tu) + (SELECT count(*) FROM cu)"
    );
    let row = tx.query_one(
        &sql,
        &[&t, &lim.cutoff(), &lim.ttl_seconds(), &profile, &int(lim.max_retained)],
    )?;
    // The tombstones moved the count (the triggers); a prune also repairs
    // it, so a count is never trusted past the next prune.
    recount(tx, profile)?;
    Ok(PruneCount { children: count_of(row.try_get(0)?), units: count_of(row.try_get(1)?) })
}

/// A `count(*)` → `usize`.
fn count_of(n: i64) -> usize {
    usize::try_from(n).unwrap_or(0)
}

/// Tombstones exactly the row `id` resolves to (the child `show` shows),
/// if addressable: a delegation id takes that unit's live children. The
/// unit left without a live child is tombstoned; its children already past
/// their TTL keep `ttl` at their expiry (as lookups reported them).
fn tombstone_in(tx: &mut Tx<'_>, id: &str, note: Option<&str>, lim: Limits) -> PgResult<bool> {
    let Some((None, kind, row)) = resolve_adopting(tx, id, lim)? else {
        return Ok(false);
    };
    let (t, unit) = (lim.now, row.entry.delegation_id.as_str());
    // One statement: the manual tombstone (one child, or for a delegation
    // id every child within the TTL), then — when no child within the TTL
    // is left — the unit's other live children (`ttl`, at their expiry)
    // and the unit. The snapshot does not see `m`'s writes, so the rows it
    // took are left out of the rest by index; the updates are disjoint.
    let one: Option<i64> = (kind != 2).then(|| i64::from(row.entry.child_index));
    let sql = format!(
        "WITH m AS (UPDATE retinue_children c SET tombstoned_at = $1, \
             tombstone_reason = 'manual', tombstone_note = $2 FROM async_delegations u \
           WHERE u.delegation_id = c.delegation_id AND c.delegation_id = $3 \
             AND c.tombstoned_at IS NULL \
             AND ($5::BIGINT IS NULL AND {CHILD_RETAINED_AT} >= $4 OR c.child_index = $5) \
           RETURNING c.child_index), \
         left_live AS (SELECT EXISTS (SELECT 1 FROM retinue_children c \
             JOIN async_delegations u ON u.delegation_id = c.delegation_id \
           WHERE c.delegation_id = $3 AND c.tombstoned_at IS NULL \
             AND {CHILD_RETAINED_AT} >= $4 \
             AND c.child_index NOT IN (SELECT child_index FROM m)) AS yes), \
         ttl AS (UPDATE retinue_children c SET tombstone_reason = 'ttl', tombstoned_at = \
             LEAST($1, COALESCE(COALESCE(c.retained_at, u.retained_at) + $6, $1)) \
           FROM async_delegations u WHERE u.delegation_id = c.delegation_id \
             AND c.delegation_id = $3 AND c.tombstoned_at IS NULL \
             AND c.child_index NOT IN (SELECT child_index FROM m) \
             AND NOT (SELECT yes FROM left_live)), \
         gone AS (UPDATE async_delegations SET tombstoned_at = $1, updated_at = $1 \
           WHERE delegation_id = $3 AND tombstoned_at IS NULL \
             AND NOT (SELECT yes FROM left_live)) \
         SELECT count(*) FROM m"
    );
    let changed: i64 = tx
        .query_one(&sql, &[&t, &note, &unit, &lim.cutoff(), &one, &lim.ttl_seconds()])?
        .try_get(0)?;
    Ok(changed > 0)
}

impl Retention for PgStore {
    fn tombstone_retained_child(&self, id: &str, reason: &TombstoneReason) -> Result<bool> {
        let id = id.trim();
        if id.is_empty() {
            return Ok(false);
        }
        let note = reason.note();
        let lim = self.limits();
        self.pool.tx("tombstoning a retained child", Mode::Write, |tx| {
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
        if !self.pool.tx("checking whether a prune is due", Mode::ReadOne, |tx| {
            prune_due(tx, lim, profile)
        })? {
            return Ok(PruneCount::default());
        }
        self.pool.tx_queued(
            "pruning retained children",
            Mode::Write,
            Some(self.prune_queue),
            |tx| {
                backfill(tx)?;
                prune_in(tx, lim, profile)
            },
        )
    }

    fn rehydrate_retained_children(&self) -> Result<usize> {
        let lim = self.limits();
        let profile = self.profile.as_str();
        if self.pool.tx("checking whether a prune is due", Mode::ReadOne, |tx| {
            prune_due(tx, lim, profile)
        })? {
            self.pool.tx("rehydrating retained children", Mode::Write, |tx| {
                backfill(tx)?;
                prune_in(tx, lim, profile)
            })?;
        }
        let n =
            self.pool.tx("counting retained children", Mode::ReadOne, |tx| list_in(tx, lim))?.len();
        log::info!("rehydrated {n} addressable retained children");
        Ok(n)
    }

    fn recover_abandoned_delegations(&self, probe: &dyn OwnerProbe) -> RecoveryReport {
        let mut report = RecoveryReport::default();
        if let Err(e) = self.heartbeat() {
            report.failed("renewing the worker lease", &e);
        }
        report.run(|| self.classify(probe), || self.rehydrate_retained_children())
    }

    fn prune_history(&self) -> Result<usize> {
        self.prune_history_in()
    }
}
