//! The registry roles on PostgreSQL: [`RegistryRead`], [`UnitLifecycle`],
//! [`Retention`] and [`Claims`], with the SQLite backend's semantics (spec
//! §3), except that the retention limits (TTL, cap) apply per profile.
//!
//! Every write is one `SERIALIZABLE` transaction (retried on 40001/40P01 by
//! the pool), so prune, cap and claims are safe under concurrent workers on
//! any number of hosts; claims also take row locks (`FOR UPDATE`, `SKIP
//! LOCKED` for deliveries) so that workers contend on rows, not on aborts.
//! Reads are one `REPEATABLE READ` snapshot.

use retinue_core::{
    ChildManifest, Claims, Completion, DeliveryClaim, DeliveryFilter, Error, LEASE_SECS, Lookup,
    MAX_DELIVERY_ATTEMPTS, OwnerProbe, ProcessState, PruneCount, RecoveryReport, RegistryRead,
    Result, ResumeClaim, RetainedChild, Retention, TombstoneReason, Unaddressable, UnitDraft,
    UnitLifecycle, UsageSwap, abandoned_event, child_status, children_json, parse_children_json,
    parse_json_opt, truncate_chars,
};
use serde_json::Value;
use std::sync::atomic::Ordering;

use crate::pool::{Fail, Mode, Params, PgResult, Tx, count, int, random_hex, u32_of};
use crate::rows::{CHILD_COLS, CHILD_RETAINED_AT, ChildRow, PROFILE, PROFILE_U, read_child_row_at};
use crate::sessions::{SessionArrays, chained, insert_sessions, sessions_from_arrays};
use crate::store::{Limits, PgStore, SERVER_NOW};

// ---------------------------------------------------------------- reads

/// Whether a unit counts towards its profile's cap: `{a}` is a live retained
/// unit (the partial index's rows) with a live child within the TTL ($2).
const CAP_LIVE_CHILD: &str = "EXISTS (SELECT 1 FROM retinue_children k \
     WHERE k.delegation_id = a.delegation_id AND k.tombstoned_at IS NULL \
     AND COALESCE(k.retained_at, a.retained_at) >= $2)";

/// A candidate row: how it matched (0 subagent id, 1 child session, 2
/// delegation id), its cap rank when otherwise live, and the row.
type Candidate = (u8, Option<i64>, ChildRow);

/// The candidates for an id (subagent id, child session id or unit id), each
/// with its cap rank when it is otherwise live: the number of live units of
/// its profile ranked strictly above it, counted up to `max_retained` ($3).
/// One statement, so one snapshot, in autocommit (no `BEGIN`/`COMMIT`).
///
/// The rank is 0 (within the cap, whatever it is exactly) when the profile
/// has no more live units than the cap (`retinue_profile_live`, one row);
/// else the index entries above are counted first (index-only, through
/// `retinue_idx_async_cap_rank`, a superset of the live units above): when
/// fewer than the cap, the exact count (which also reads each unit's
/// children for the TTL) cannot reach it either and is skipped.
fn candidates(tx: &mut Tx<'_>, id: &str, lim: Limits) -> PgResult<Vec<Candidate>> {
    let same = "a.retained = 1 AND a.tombstoned_at IS NULL \
         AND COALESCE(a.owner_profile, '') = COALESCE(u.owner_profile, '')";
    let above = "a.retained_at >= u.retained_at \
         AND (a.retained_at > u.retained_at OR a.delegation_id > u.delegation_id)";
    let above_null = "(a.retained_at IS NOT NULL OR a.delegation_id > u.delegation_id)";
    let sql = format!(
        "SELECT (CASE WHEN c.subagent_id = $1 THEN 0 WHEN c.child_session_id = $1 THEN 1 \
         ELSE 2 END)::BIGINT, \
         CASE WHEN c.tombstoned_at IS NOT NULL OR u.tombstoned_at IS NOT NULL \
                OR u.retained IS DISTINCT FROM 1 \
                OR ({CHILD_RETAINED_AT} >= $2) IS NOT TRUE THEN NULL \
              WHEN COALESCE((SELECT sum(n.units)::BIGINT FROM retinue_profile_live n \
                WHERE n.profile = COALESCE(u.owner_profile, '')), $3::bigint + 1) <= $3::bigint THEN 0 \
              WHEN u.retained_at IS NULL THEN (SELECT count(*) FROM (SELECT 1 \
                FROM async_delegations a WHERE {same} AND {above_null} AND {CAP_LIVE_CHILD} \
                LIMIT $3) t) \
              WHEN (SELECT count(*) FROM (SELECT 1 FROM async_delegations a \
                WHERE {same} AND {above} LIMIT $3) s) < $3 THEN 0 \
              ELSE (SELECT count(*) FROM (SELECT 1 FROM async_delegations a \
                WHERE {same} AND {above} AND {CAP_LIVE_CHILD} LIMIT $3) t) END, \
         {CHILD_COLS} FROM retinue_children c \
         JOIN async_delegations u ON u.delegation_id = c.delegation_id \
         WHERE c.subagent_id = $1 OR c.child_session_id = $1 OR c.delegation_id = $1"
    );
    let mut out = Vec::new();
    for r in tx.query(&sql, &[&id, &lim.cutoff(), &int(lim.max_retained)])? {
        let kind: i64 = r.try_get(0)?;
        let rank: Option<i64> = r.try_get(1)?;
        out.push((u8::try_from(kind).unwrap_or(u8::MAX), rank, read_child_row_at(&r, 2)?));
    }
    Ok(out)
}

/// Status without the cap rank: the store's shared rule.
fn live_status(row: &ChildRow, lim: Limits) -> Option<Unaddressable> {
    child_status(&row.facts(), lim)
}

type Scored = (Option<Unaddressable>, u8, ChildRow);

/// The core's resolution order (semantics §3.3) over scored candidates.
fn order(a: &Scored, b: &Scored) -> std::cmp::Ordering {
    fn key(s: &Scored) -> retinue_core::LookupKey<'_> {
        retinue_core::LookupKey {
            addressable: s.0.is_none(),
            kind: s.1,
            unit_retained_at: s.2.unit_retained_at,
            delegation_id: &s.2.entry.delegation_id,
            child_index: s.2.entry.child_index,
        }
    }
    retinue_core::lookup_order(&key(a), &key(b))
}

/// The one row `id` resolves to (semantics §3.3 order): how it matched (0
/// subagent id, 1 child session, 2 delegation id), its status (`None`:
/// addressable) and the row.
fn resolve_in(tx: &mut Tx<'_>, id: &str, lim: Limits) -> PgResult<Option<Scored>> {
    let id = id.trim();
    if id.is_empty() {
        return Ok(None);
    }
    let cap = i64::from(lim.max_retained);
    let found = candidates(tx, id, lim)?;
    let mut scored: Vec<Scored> = found
        .into_iter()
        .map(|(kind, rank, row)| {
            let status = live_status(&row, lim).or_else(|| {
                // Live but ranked at or beyond the cap of its profile.
                rank.filter(|r| *r >= cap).map(|_| Unaddressable::Tombstoned {
                    at: lim.now,
                    reason: TombstoneReason::Cap,
                    note: None,
                })
            });
            (status, kind, row)
        })
        .collect();
    scored.sort_by(order);
    Ok(scored.into_iter().next())
}

/// [`resolve_in`] for a write that takes exactly the row a lookup shows:
/// when the id matches no row, a unit copied from a hermes file without
/// child rows may be what it names, so the backfill adopts such units and,
/// if it wrote any child row, the id is resolved again. (A lookup does not
/// adopt: an id it resolves resolves the same here, without the backfill.)
fn resolve_adopting(tx: &mut Tx<'_>, id: &str, lim: Limits) -> PgResult<Option<Scored>> {
    if let Some(found) = resolve_in(tx, id, lim)? {
        return Ok(Some(found));
    }
    if backfill(tx)? == 0 {
        return Ok(None);
    }
    resolve_in(tx, id, lim)
}

fn lookup_in(tx: &mut Tx<'_>, id: &str, lim: Limits) -> PgResult<Lookup> {
    Ok(match resolve_in(tx, id, lim)? {
        None => Lookup::Unknown,
        Some((None, _, row)) => Lookup::Addressable(row.into_entry()),
        Some((Some(status), _, row)) => Lookup::NotAddressable(row.into_entry(), status),
    })
}

/// Every addressable child, in one statement: the live children within
/// the TTL joined with their live retained units; a unit counts towards
/// its profile's cap exactly when it has such a child, so `dense_rank` over
/// these rows is the unit's cap rank (no second pass over the units). Each
/// unit's children are one probe of `retinue_idx_children_live_unit` (the
/// lateral join keeps any plan from scanning every live child per unit).
pub(crate) fn list_in(tx: &mut Tx<'_>, lim: Limits) -> PgResult<Vec<RetainedChild>> {
    // Output columns 14, 1 and 2: the unit's `retained_at`, its id, the child index.
    let sql = format!(
        "SELECT * FROM (SELECT {CHILD_COLS}, dense_rank() OVER (PARTITION BY {PROFILE_U} \
             ORDER BY u.retained_at DESC NULLS LAST, u.delegation_id DESC) AS rn \
           FROM async_delegations u CROSS JOIN LATERAL (SELECT * FROM retinue_children c \
             WHERE c.delegation_id = u.delegation_id AND c.tombstoned_at IS NULL \
               AND COALESCE(c.retained_at, u.retained_at) >= $1 OFFSET 0) c \
           WHERE u.retained = 1 AND u.tombstoned_at IS NULL) t \
         WHERE rn <= $2 ORDER BY 14 DESC NULLS LAST, 1 DESC, 2"
    );
    let mut out = Vec::new();
    for r in tx.query(&sql, &[&lim.cutoff(), &int(lim.max_retained)])? {
        out.push(read_child_row_at(&r, 0)?.into_entry());
    }
    Ok(out)
}

impl RegistryRead for PgStore {
    fn list_retained_children(&self) -> Result<Vec<RetainedChild>> {
        let lim = self.limits();
        self.pool.tx("listing retained children", Mode::ReadOne, |tx| list_in(tx, lim))
    }

    fn find_retained_child(&self, id: &str) -> Result<Option<RetainedChild>> {
        Ok(match self.lookup(id)? {
            Lookup::Addressable(entry) => Some(entry),
            _ => None,
        })
    }

    fn lookup(&self, id: &str) -> Result<Lookup> {
        let lim = self.limits();
        self.pool.tx("looking up a retained child", Mode::ReadOne, |tx| lookup_in(tx, id, lim))
    }

    fn unit_usage(&self, id: &str) -> Result<Option<Value>> {
        self.pool.tx("reading a unit's usage", Mode::ReadOne, |tx| {
            let raw: Option<String> = match tx.query_opt(
                "SELECT usage_json FROM async_delegations WHERE delegation_id = $1",
                &[&id],
            )? {
                Some(r) => r.try_get(0)?,
                None => None,
            };
            Ok(parse_json_opt(raw.as_deref()))
        })
    }
}

// ---------------------------------------------------------------- backfill

/// Child rows for `retained=1` units that have none (units copied from a
/// hermes file), as the SQLite backend's backfill.
fn backfill(tx: &mut Tx<'_>) -> PgResult<usize> {
    // One statement: the TTL clock of live units' children that have none,
    // and the live units without any child row (their rows come from
    // `children_json`, below). The two touch different rows.
    let units = tx.query(
        "WITH clock AS (UPDATE retinue_children SET retained_at = (SELECT u.retained_at \
             FROM async_delegations u WHERE u.delegation_id = retinue_children.delegation_id) \
           WHERE delegation_id IN (SELECT delegation_id FROM async_delegations \
                                   WHERE retained = 1 AND tombstoned_at IS NULL) \
             AND retained_at IS NULL AND tombstoned_at IS NULL) \
         SELECT delegation_id, children_json, child_session_id, retained_at, tombstoned_at \
         FROM async_delegations u WHERE retained = 1 AND tombstoned_at IS NULL AND NOT EXISTS \
         (SELECT 1 FROM retinue_children c WHERE c.delegation_id = u.delegation_id)",
        &[],
    )?;
    let mut inserted = 0;
    for u in units {
        let id: String = u.try_get(0)?;
        let cj: Option<String> = u.try_get(1)?;
        let csid: Option<String> = u.try_get(2)?;
        let retained_at: Option<f64> = u.try_get(3)?;
        let tombstoned_at: Option<f64> = u.try_get(4)?;
        for (i, child) in parse_children_json(cj.as_deref(), csid.as_deref()).iter().enumerate() {
            let reason = tombstoned_at.map(|_| TombstoneReason::External.as_str().to_owned());
            let params: &Params<'_> = &[
                &id,
                &i64::try_from(i).unwrap_or(i64::MAX),
                &child.subagent_id,
                &child.session_id,
                &child.model,
                &child.provider,
                &child.goal,
                &child.to_json().to_string(),
                &retained_at,
                &tombstoned_at,
                &reason,
            ];
            inserted += count(tx.execute(
                "INSERT INTO retinue_children (delegation_id, child_index, subagent_id, \
                 child_session_id, model, provider, goal, manifest_json, retained_at, \
                 tombstoned_at, tombstone_reason) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT DO NOTHING",
                params,
            )?);
        }
    }
    Ok(inserted)
}

// ---------------------------------------------------------------- retention

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
        // The reason of an operator's tombstone is `manual`; any text is its note.
        let note = match reason {
            TombstoneReason::Manual => None,
            other => Some(other.as_str().to_owned()),
        };
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
            report.error = Some(format!("renewing the worker lease failed: {e}"));
        }
        match self.classify(probe) {
            Ok(n) => report.abandoned = n,
            Err(e) => report.error = Some(format!("classification failed: {e}")),
        }
        match self.rehydrate_retained_children() {
            Ok(n) => report.addressable = n,
            Err(e) => {
                let msg = format!("rehydration failed: {e}");
                report.error = Some(match report.error.take() {
                    Some(prev) => format!("{prev}; {msg}"),
                    None => msg,
                });
            }
        }
        report
    }

    fn prune_history(&self) -> Result<usize> {
        self.prune_history_in()
    }
}

// ---------------------------------------------------------------- recovery

impl PgStore {
    /// Marks `unknown` the live, non-retained units whose owner is gone: a
    /// worker whose lease expired (or vanished), or — for units without a
    /// worker (copied from a state.db) — a process the probe reports dead.
    /// Only the caller's tenant's units (and unprofiled ones) are touched.
    fn classify(&self, probe: &dyn OwnerProbe) -> Result<usize> {
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

    fn prune_history_in(&self) -> Result<usize> {
        use retinue_core::{DELIVERED_MAX_AGE_SECS, PENDING_KEEP, TERMINAL_KEEP};
        const TERMINAL: &str = "retained IS NULL AND state NOT IN ('running', 'finalizing')";
        let old = self.clock.now() - DELIVERED_MAX_AGE_SECS;
        // The keeps are BIGINT parameters (`$2 + 1` alone would make them INT4).
        let due_sql = format!(
            "SELECT EXISTS (SELECT 1 FROM async_delegations WHERE {TERMINAL} \
               AND delivery_state = 'delivered' AND COALESCE(delivered_at, updated_at) < $1) \
             OR (SELECT count(*) FROM (SELECT 1 FROM async_delegations WHERE {TERMINAL} \
                 AND delivery_state != 'pending' LIMIT $2::bigint + 1) a) > $2::bigint \
             OR (SELECT count(*) FROM (SELECT 1 FROM async_delegations WHERE {TERMINAL} \
                 AND delivery_state = 'pending' LIMIT $3::bigint + 1) b) > $3::bigint"
        );
        let due = self.pool.tx("checking whether history is due", Mode::ReadOne, |tx| {
            Ok(tx
                .query_one(&due_sql, &[&old, &TERMINAL_KEEP, &PENDING_KEEP])?
                .try_get::<_, bool>(0)?)
        })?;
        if !due {
            return Ok(0);
        }
        let statements = [
            format!(
                "DELETE FROM async_delegations WHERE delegation_id IN (SELECT delegation_id \
                 FROM async_delegations WHERE {TERMINAL} AND delivery_state = 'delivered' \
                 AND COALESCE(delivered_at, updated_at) < $1) RETURNING delegation_id"
            ),
            format!(
                "DELETE FROM async_delegations WHERE delegation_id IN (SELECT delegation_id \
                 FROM async_delegations WHERE {TERMINAL} AND delivery_state != 'pending' \
                 ORDER BY (delivery_state = 'delivered') DESC, updated_at ASC \
                 LIMIT GREATEST(0, (SELECT count(*) FROM async_delegations WHERE {TERMINAL} \
                               AND delivery_state != 'pending') - $1)) RETURNING delegation_id"
            ),
            format!(
                "DELETE FROM async_delegations WHERE delegation_id IN (SELECT delegation_id \
                 FROM async_delegations WHERE {TERMINAL} AND delivery_state = 'pending' \
                 ORDER BY updated_at ASC LIMIT GREATEST(0, (SELECT count(*) FROM async_delegations \
                 WHERE {TERMINAL} AND delivery_state = 'pending') - $1)) RETURNING delegation_id"
            ),
        ];
        self.pool.tx("pruning history", Mode::Write, |tx| {
            let mut deleted: Vec<String> = Vec::new();
            let args: [&Params<'_>; 3] = [&[&old], &[&TERMINAL_KEEP], &[&PENDING_KEEP]];
            for (sql, p) in statements.iter().zip(args) {
                for r in tx.query(sql.as_str(), p)? {
                    deleted.push(r.try_get(0)?);
                }
            }
            if !deleted.is_empty() {
                tx.execute(
                    "DELETE FROM retinue_children WHERE delegation_id = ANY($1)",
                    &[&deleted],
                )?;
            }
            Ok(deleted.len())
        })
    }
}

// ---------------------------------------------------------------- lifecycle

fn retain_in(
    tx: &mut Tx<'_>,
    id: &str,
    usage: Option<&Value>,
    lim: Limits,
    profile: &str,
) -> PgResult<bool> {
    let now = lim.now;
    let usage = usage.map(Value::to_string);
    // One statement: the unit, its children's TTL clock, and whether this
    // unit or any live unit has no child rows at all (a unit copied from a
    // hermes file: only then does the backfill's insert run, after this
    // statement, so it sees this unit retained). Other live units' children
    // without a clock of their own are judged by their unit's (the prune,
    // as every read), so no retain scans them (they include every running
    // unit's children: a scan of them grew with the work in flight).
    let row = tx.query_one(
        &format!(
            "WITH u AS (UPDATE async_delegations SET retained = 1, retained_at = $1, \
               updated_at = $1, usage_json = COALESCE($2, usage_json) \
               WHERE delegation_id = $3 AND tombstoned_at IS NULL RETURNING {PROFILE} AS p), \
             c AS (UPDATE retinue_children SET retained_at = $1 WHERE delegation_id = $3 \
               AND tombstoned_at IS NULL AND (retained_at IS NULL OR retained_at >= $4) \
               AND EXISTS (SELECT 1 FROM u)) \
             SELECT (SELECT p FROM u), (EXISTS (SELECT 1 FROM u) AND NOT EXISTS (SELECT 1 \
               FROM retinue_children k WHERE k.delegation_id = $3)) \
               OR EXISTS (SELECT 1 FROM async_delegations v \
               WHERE v.retained = 1 AND v.tombstoned_at IS NULL AND NOT EXISTS \
               (SELECT 1 FROM retinue_children k WHERE k.delegation_id = v.delegation_id))"
        ),
        &[&now, &usage, &id, &lim.cutoff()],
    )?;
    let Some(unit_profile) = row.try_get::<_, Option<String>>(0)? else {
        return Ok(false);
    };
    if row.try_get::<_, bool>(1)? {
        backfill(tx)?;
    }
    prune_in(tx, lim, profile)?;
    if !profile.is_empty() && !unit_profile.is_empty() && unit_profile != profile {
        // The unit is another tenant's: its live count changed too.
        recount(tx, "")?;
    }
    Ok(true)
}

/// Whether a live retained unit has no child rows at all (the backfill's
/// work: a unit copied from a hermes file).
const ORPHAN_UNIT: &str = "EXISTS (SELECT 1 FROM async_delegations v \
     WHERE v.retained = 1 AND v.tombstoned_at IS NULL AND NOT EXISTS \
     (SELECT 1 FROM retinue_children k WHERE k.delegation_id = v.delegation_id))";

/// [`retain_in`] and the prune it runs, in one statement (one round trip:
/// `SERIALIZABLE` in autocommit, or one statement of the caller's
/// transaction), for the usual case; `None` (nothing written) when the
/// unit is another tenant's (its count is then recounted) or a unit needs
/// adopting first (a backfill): the caller runs [`retain_in`] instead.
///
/// `live` is the tenant's live units on the statement's snapshot with the
/// retained unit as it will be (retained now, keeping a child when one of
/// its live children is fresh); the prune is [`prune_in`]'s over it. The
/// retained unit's own rows are written once each: its row by `u` (its
/// tombstone too, when the prune takes it), its fresh children by `c` (the
/// clock, and the cap's tombstone), its expired children by `tc`; the
/// prune's other updates leave it out. Every update touches rows no other
/// one does.
///
/// The tenant's live count moves with the triggers of migration V11; the
/// statement also repairs it: where the sum of a profile's stripes differs
/// from its live units on the snapshot (a count edited by hand, rows
/// written with triggers off), stripe 0 takes the difference, and the
/// triggers then move it by what the statement changes.
fn retain_one(
    tx: &mut Tx<'_>,
    id: &str,
    usage: Option<&str>,
    lim: Limits,
    profile: &str,
) -> PgResult<Option<Serial>> {
    let tenant = |p: &str| format!("($4 = '' OR {p} IN ('', $4))");
    let sql = format!(
        "WITH g AS (SELECT NOT EXISTS (SELECT 1 FROM retinue_children k \
               WHERE k.delegation_id = $6) \
             OR {ORPHAN_UNIT} \
             OR EXISTS (SELECT 1 FROM async_delegations WHERE delegation_id = $6 \
               AND tombstoned_at IS NULL AND NOT {t_unit}) AS fallback), \
         x AS (SELECT delegation_id, (retained = 1) IS TRUE AS was_live FROM async_delegations \
           WHERE delegation_id = $6 AND tombstoned_at IS NULL AND NOT (SELECT fallback FROM g)), \
         live AS (SELECT delegation_id, {PROFILE} AS p, retained_at, EXISTS (SELECT 1 \
             FROM retinue_children k WHERE k.delegation_id = u.delegation_id \
             AND k.tombstoned_at IS NULL \
             AND COALESCE(k.retained_at, u.retained_at) >= $2) AS keeps \
           FROM async_delegations u WHERE retained = 1 AND tombstoned_at IS NULL \
             AND {t_unit} AND delegation_id <> $6 AND EXISTS (SELECT 1 FROM x) \
           UNION ALL \
           SELECT v.delegation_id, COALESCE(v.owner_profile, ''), $1::float8, EXISTS (SELECT 1 \
             FROM retinue_children k WHERE k.delegation_id = v.delegation_id \
             AND k.tombstoned_at IS NULL AND (k.retained_at IS NULL OR k.retained_at >= $2)) \
           FROM async_delegations v WHERE v.delegation_id IN (SELECT delegation_id FROM x)), \
         ranked AS (SELECT delegation_id, p, retained_at, row_number() OVER (PARTITION BY p \
             ORDER BY retained_at DESC NULLS LAST, delegation_id DESC) AS rn \
           FROM live WHERE keeps), \
         over AS (SELECT delegation_id, retained_at FROM ranked WHERE rn > $5), \
         gone AS (SELECT delegation_id FROM over UNION ALL \
           SELECT delegation_id FROM live WHERE NOT keeps), \
         u AS (UPDATE async_delegations SET retained = 1, retained_at = $1, updated_at = $1, \
             usage_json = COALESCE($7, usage_json), tombstoned_at = CASE WHEN \
               delegation_id IN (SELECT delegation_id FROM gone) THEN $1 END \
           WHERE delegation_id IN (SELECT delegation_id FROM x) RETURNING 1), \
         c AS (UPDATE retinue_children SET retained_at = $1, \
             tombstoned_at = CASE WHEN $6 IN (SELECT delegation_id FROM over) THEN $1 END, \
             tombstone_reason = CASE WHEN $6 IN (SELECT delegation_id FROM over) THEN 'cap' \
               ELSE tombstone_reason END \
           WHERE delegation_id IN (SELECT delegation_id FROM x) AND tombstoned_at IS NULL \
             AND (retained_at IS NULL OR retained_at >= $2) RETURNING 1), \
         tc AS (UPDATE retinue_children c SET tombstone_reason = 'ttl', \
             tombstoned_at = LEAST($1, COALESCE(COALESCE(c.retained_at, l.retained_at) + $3, $1)) \
           FROM live l WHERE l.delegation_id = c.delegation_id AND c.tombstoned_at IS NULL \
             AND (COALESCE(c.retained_at, l.retained_at) < $2) IS NOT FALSE RETURNING 1), \
         tu AS (UPDATE async_delegations SET tombstoned_at = $1, updated_at = $1 \
           WHERE delegation_id IN (SELECT delegation_id FROM live WHERE NOT keeps) \
             AND delegation_id <> $6 RETURNING 1), \
         cc AS (UPDATE retinue_children c SET tombstoned_at = $1, tombstone_reason = 'cap' \
           FROM over o WHERE o.delegation_id = c.delegation_id AND o.delegation_id <> $6 \
             AND c.tombstoned_at IS NULL AND COALESCE(c.retained_at, o.retained_at) >= $2 \
           RETURNING 1), \
         cu AS (UPDATE async_delegations SET tombstoned_at = $1, updated_at = $1 \
           WHERE delegation_id IN (SELECT delegation_id FROM over) AND delegation_id <> $6 \
           RETURNING 1), \
         n0 AS (SELECT p, count(*) FILTER (WHERE delegation_id <> $6) \
             + count(*) FILTER (WHERE delegation_id = $6 AND (SELECT was_live FROM x)) AS n \
           FROM live GROUP BY p), \
         fix AS (SELECT n0.p, n0.n - COALESCE((SELECT sum(l.units)::BIGINT FROM retinue_profile_live l \
             WHERE l.profile = n0.p), 0) AS diff FROM n0), \
         w AS (INSERT INTO retinue_profile_live AS l (profile, stripe, units) \
           SELECT p, 0, diff FROM fix WHERE diff <> 0 \
           ON CONFLICT (profile, stripe) DO UPDATE SET units = l.units + EXCLUDED.units) \
         SELECT (SELECT fallback FROM g), (SELECT count(*) FROM u), \
           COALESCE((SELECT max(n) FROM (SELECT count(*) FILTER (WHERE rn <= $5) AS n \
             FROM ranked GROUP BY p) q), 0) >= $5",
        t_unit = tenant(PROFILE),
    );
    let row = tx.query_one(
        &sql,
        &[
            &lim.now,
            &lim.cutoff(),
            &lim.ttl_seconds(),
            &profile,
            &int(lim.max_retained),
            &id,
            &usage,
        ],
    )?;
    if row.try_get::<_, bool>(0)? {
        return Ok(None);
    }
    Ok(Some(Serial { changed: row.try_get::<_, i64>(1)? > 0, at_cap: row.try_get(2)? }))
}

/// What [`retain_one`] did.
struct Serial {
    /// The unit was retained.
    changed: bool,
    /// Its tenant is at its cap now: its next retain will prune.
    at_cap: bool,
}

/// What a completion writes besides the retain (see [`retain_fast`]).
struct Done<'a> {
    state: &'a str,
    event: String,
    result: String,
    delivery: &'a str,
    delivered_at: Option<f64>,
}

/// What [`retain_fast`] did.
struct Fast {
    /// The unit was retained (it existed, live).
    changed: bool,
    /// Nothing was written: the tenant would be over its cap, or something
    /// of it is past its TTL, so the retain must prune ([`retain_one`]).
    due: bool,
}

/// A retain (with its completion, `done`) as one statement that ranks
/// nothing, in [`Mode::WriteCommitted`], when its tenant stays within its
/// cap and nothing of it is past its TTL: the statement reads the sum of
/// the tenant's count stripes (plus this unit) and the old ends of two
/// indexes, and writes the unit and its children's TTL clock only when no
/// prune is due; the server's triggers count the unit live on the writer's
/// stripe. Nothing of the tenant is locked but the unit's own rows and one
/// stripe, so retains of one tenant under its cap never queue behind each
/// other. Concurrent retains may together pass the cap: readers rank
/// exactly whenever the (exact) count is over it, and the next retain of
/// the tenant finds it due and prunes.
///
/// `None` (nothing written) when the unit is another tenant's, is
/// tombstoned, or needs adopting first (no child rows, or a live unit
/// without any: a backfill): the caller takes the serialized path.
fn retain_fast(
    tx: &mut Tx<'_>,
    id: &str,
    usage: Option<&str>,
    done: Option<&Done<'_>>,
    lim: Limits,
    profile: &str,
) -> PgResult<Option<Fast>> {
    let t_unit = format!("($4 = '' OR {PROFILE} IN ('', $4))");
    // The completion's columns, when there is one ($7–$11).
    let completion = if done.is_some() {
        "state = $7, completed_at = $1, event_json = $8, result_json = $9, \
         delivery_state = $10, delivered_at = $11, "
    } else {
        ""
    };
    let sql = format!(
        "WITH g AS (SELECT NOT EXISTS (SELECT 1 FROM retinue_children k \
               WHERE k.delegation_id = $3) \
             OR {ORPHAN_UNIT} \
             OR NOT EXISTS (SELECT 1 FROM async_delegations WHERE delegation_id = $3 \
               AND tombstoned_at IS NULL AND {t_unit}) AS fallback), \
         x AS (SELECT delegation_id, {PROFILE} AS p, (retained = 1) IS TRUE AS was_live \
           FROM async_delegations WHERE delegation_id = $3 AND NOT (SELECT fallback FROM g)), \
         d AS (SELECT COALESCE((SELECT sum(n.units)::BIGINT FROM retinue_profile_live n \
               WHERE n.profile = x.p), 0) AS counted, was_live FROM x), \
         due AS (SELECT counted < 0 OR counted + CASE WHEN was_live THEN 0 ELSE 1 END > $6 \
           OR (SELECT k.retained_at FROM retinue_children k \
             JOIN async_delegations v ON v.delegation_id = k.delegation_id \
             WHERE k.tombstoned_at IS NULL AND k.retained_at < $2 \
             AND v.retained = 1 AND v.tombstoned_at IS NULL AND ($4 = '' OR \
               COALESCE(v.owner_profile, '') IN ('', $4)) \
             ORDER BY k.retained_at LIMIT 1) IS NOT NULL \
           OR EXISTS (SELECT 1 FROM async_delegations v WHERE v.retained = 1 \
             AND v.tombstoned_at IS NULL AND (v.retained_at < $2 OR v.retained_at IS NULL) \
             AND ($4 = '' OR COALESCE(v.owner_profile, '') IN ('', $4))) AS due FROM d), \
         u AS (UPDATE async_delegations SET {completion}retained = 1, retained_at = $1, \
             updated_at = $1, usage_json = COALESCE($5, usage_json) \
           WHERE delegation_id IN (SELECT delegation_id FROM x) \
             AND (SELECT NOT due FROM due) RETURNING 1), \
         c AS (UPDATE retinue_children SET retained_at = $1 \
           WHERE delegation_id IN (SELECT delegation_id FROM x) AND tombstoned_at IS NULL \
             AND (retained_at IS NULL OR retained_at >= $2) \
             AND (SELECT NOT due FROM due) RETURNING 1) \
         SELECT (SELECT fallback FROM g), (SELECT count(*) FROM u), \
           COALESCE((SELECT due FROM due), true)"
    );
    let cap = int(lim.max_retained);
    let (now, cutoff) = (lim.now, lim.cutoff());
    let row = match done {
        Some(d) => tx.query_one(
            &sql,
            &[
                &now,
                &cutoff,
                &id,
                &profile,
                &usage,
                &cap,
                &d.state,
                &d.event,
                &d.result,
                &d.delivery,
                &d.delivered_at,
            ],
        )?,
        None => tx.query_one(&sql, &[&now, &cutoff, &id, &profile, &usage, &cap])?,
    };
    if row.try_get::<_, bool>(0)? {
        return Ok(None);
    }
    Ok(Some(Fast { changed: row.try_get::<_, i64>(1)? > 0, due: row.try_get(2)? }))
}

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
        for _ in 0..8 {
            let id = format!("deleg_{}", random_hex(4)?);
            let now = self.clock.now();
            let inserted = if chained(&draft.child_sessions) {
                self.pool.tx("inserting a unit", Mode::Write, |tx| {
                    self.insert_unit_in(tx, draft, &id, now)
                })?
            } else {
                // One statement whose every rule is a constraint (the id's
                // key, the children's and sessions' keys and references):
                // nothing for serializability to add, and under it the
                // unique checks' index-page predicate locks made
                // concurrent dispatches fail to serialize with each other
                // (half of them at 4 × 8, issue #41).
                self.pool.tx("inserting a unit", Mode::WriteCommitted, |tx| {
                    self.insert_unit_one(tx, draft, &id, now)
                })?
            };
            if inserted {
                return Ok(id);
            }
        }
        Err(Error::Invalid("could not allocate a unique delegation id".to_owned()))
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

impl PgStore {
    /// [`retain_fast`] in its own statement: `Some(changed)` when it
    /// retained (or found nothing to retain); `None` when the serialized
    /// path must run, noting a due prune for the next retains.
    fn retain_fast(
        &self,
        op: &'static str,
        id: &str,
        usage: Option<&str>,
        done: Option<&Done<'_>>,
        lim: Limits,
    ) -> Result<Option<bool>> {
        let fast = self.pool.tx(op, Mode::WriteCommitted, |tx| {
            retain_fast(tx, id, usage, done, lim, &self.profile)
        })?;
        Ok(match fast {
            Some(Fast { changed, due: false }) => Some(changed),
            Some(Fast { due: true, .. }) => {
                self.prune_hint.store(true, Ordering::Relaxed);
                None
            }
            None => None,
        })
    }

    /// Whether a retain tries the statement that ranks nothing first
    /// ([`retain_fast`]): not while the tenant was at its cap at the last
    /// retain (then every retain prunes, and [`retain_one`] does both in
    /// one round trip), and not on every [`VERIFY_EVERY`]th retain, which
    /// ranks the tenant and repairs its count (a count is never trusted
    /// for long: one edited by hand or written with triggers off).
    fn try_fast(&self) -> bool {
        let n = self.retains.fetch_add(1, Ordering::Relaxed);
        !self.prune_hint.load(Ordering::Relaxed) && n % VERIFY_EVERY != VERIFY_EVERY - 1
    }
}

/// Every this many retains of a store, one takes the ranking path, which
/// repairs the tenant's count.
const VERIFY_EVERY: u64 = 64;

// ---------------------------------------------------------------- claims

fn release_in(tx: &mut Tx<'_>, id: &str, child_index: u32, token: &str) -> PgResult<bool> {
    let n = tx.execute(
        "UPDATE retinue_children SET resume_claim = NULL, resume_claimed_at = NULL \
         WHERE delegation_id = $1 AND child_index = $2 AND resume_claim = $3",
        &[&id, &int(child_index), &token],
    )?;
    Ok(n > 0)
}

impl Claims for PgStore {
    fn claim_delivery(&self, filter: &DeliveryFilter) -> Result<Option<DeliveryClaim>> {
        let now = self.clock.now();
        self.pool.tx("claiming a delivery", Mode::Write, |tx| {
            // Rows whose event is not JSON are never offered (SQLite: `json_valid`).
            let mut unreadable: Vec<String> = Vec::new();
            loop {
                let row = tx.query_opt(
                    &format!(
                        "SELECT delegation_id, delivery_attempts, event_json \
                     FROM async_delegations \
                     WHERE delivery_state = 'pending' AND state NOT IN ('running', 'finalizing') \
                       AND event_json IS NOT NULL \
                       AND (delivery_claim IS NULL OR delivery_claimed_at IS NULL \
                            OR delivery_claimed_at + $1 <= {SERVER_NOW} \
                            OR delivery_claimed_at > {SERVER_NOW} + $1) \
                       AND ($2::text IS NULL OR origin_session = $2) \
                       AND ($3::text IS NULL OR parent_session_id = $3) \
                       AND ($4::text IS NULL OR delegation_id = $4) \
                       AND NOT (delegation_id = ANY($5)) \
                     ORDER BY completed_at NULLS FIRST, delegation_id LIMIT 1 \
                     FOR UPDATE SKIP LOCKED"
                    ),
                    &[
                        &LEASE_SECS,
                        &filter.origin_session,
                        &filter.parent_session_id,
                        &filter.delegation_id,
                        &unreadable,
                    ],
                )?;
                let Some(row) = row else { return Ok(None) };
                let id: String = row.try_get(0)?;
                let attempts: i64 = row.try_get(1)?;
                let text: Option<String> = row.try_get(2)?;
                let Some(event) =
                    text.as_deref().and_then(|s| serde_json::from_str::<Value>(s).ok())
                else {
                    unreadable.push(id);
                    continue;
                };
                if attempts < MAX_DELIVERY_ATTEMPTS {
                    let token = random_hex(16)?;
                    tx.execute(
                        &format!(
                            "UPDATE async_delegations SET delivery_claim = $1, \
                             delivery_claimed_at = {SERVER_NOW}, \
                             delivery_attempts = delivery_attempts + 1, \
                             updated_at = $2 WHERE delegation_id = $3"
                        ),
                        &[&token, &now, &id],
                    )?;
                    let attempt = u32_of(attempts + 1);
                    let event = retinue_core::CompletionEvent::from_stored(&id, event);
                    return Ok(Some(DeliveryClaim { delegation_id: id, token, attempt, event }));
                }
                tx.execute(
                    "UPDATE async_delegations SET delivery_state = 'dropped', updated_at = $1 \
                     WHERE delegation_id = $2",
                    &[&now, &id],
                )?;
            }
        })
    }

    fn ack_delivery(&self, id: &str, token: &str) -> Result<bool> {
        let now = self.clock.now();
        self.pool.tx("acknowledging a delivery", Mode::WriteOne, |tx| {
            let n = tx.execute(
                "UPDATE async_delegations SET delivery_state = 'delivered', delivered_at = $1, \
                 updated_at = $1 WHERE delegation_id = $2 AND delivery_claim = $3 \
                 AND delivery_state = 'pending'",
                &[&now, &id, &token],
            )?;
            Ok(n > 0)
        })
    }

    fn claim_resume(&self, id: &str, child_index: u32) -> Result<ResumeClaim> {
        let token = random_hex(16)?;
        // One statement (one round trip, `SERIALIZABLE` in autocommit): the
        // child's row as it was, and the claim taken when the child and its
        // unit are live and no unexpired claim holds it. A concurrent
        // writer of the row fails the statement (40001) and it runs again.
        // The lease is the server's (`SERVER_NOW`, read once), never a host's.
        // A lease that cannot be the server's (taken after now plus a lease,
        // NaN, infinite: a row another program planted) holds nothing.
        let sql = format!(
            "WITH t AS (SELECT {SERVER_NOW} AS now), \
           cur AS (SELECT c.tombstoned_at AS ct, u.tombstoned_at AS ut, \
               c.resume_claim AS claim, c.resume_claimed_at AS at \
             FROM retinue_children c JOIN async_delegations u \
               ON u.delegation_id = c.delegation_id \
             WHERE c.delegation_id = $1 AND c.child_index = $2), \
           upd AS (UPDATE retinue_children SET resume_claim = $3, \
               resume_claimed_at = (SELECT now FROM t) \
             WHERE delegation_id = $1 AND child_index = $2 AND tombstoned_at IS NULL \
               AND (resume_claim IS NULL OR COALESCE(resume_claimed_at, '-Infinity'::float8) \
                 + $4 <= (SELECT now FROM t) OR resume_claimed_at > (SELECT now FROM t) + $4) \
               AND EXISTS (SELECT 1 FROM cur WHERE ut IS NULL) RETURNING 1) \
         SELECT ct, ut, claim, at, EXISTS (SELECT 1 FROM upd) FROM cur"
        );
        self.pool.tx("claiming a resume", Mode::WriteOne, |tx| {
            let row = tx.query_opt(&sql, &[&id, &int(child_index), &token, &LEASE_SECS])?;
            let Some(row) = row else { return Ok(ResumeClaim::Unavailable) };
            if row.try_get::<_, bool>(4)? {
                return Ok(ResumeClaim::Claimed { token: token.clone() });
            }
            let child_tomb: Option<f64> = row.try_get(0)?;
            let unit_tomb: Option<f64> = row.try_get(1)?;
            let claim: Option<String> = row.try_get(2)?;
            let claimed_at: Option<f64> = row.try_get(3)?;
            Ok(match claim {
                Some(_) if child_tomb.is_none() && unit_tomb.is_none() => {
                    let at = claimed_at.unwrap_or(f64::NEG_INFINITY);
                    ResumeClaim::Busy { claimed_at: at, expires_at: at + LEASE_SECS }
                }
                // Tombstoned (or, failing closed, anything else not claimed).
                _ => ResumeClaim::Unavailable,
            })
        })
    }

    fn renew_resume(&self, id: &str, child_index: u32, token: &str) -> Result<bool> {
        let sql = format!(
            "UPDATE retinue_children SET resume_claimed_at = {SERVER_NOW} \
             WHERE delegation_id = $1 AND child_index = $2 AND resume_claim = $3"
        );
        self.pool.tx("renewing a resume claim", Mode::WriteOne, |tx| {
            let n = tx.execute(&sql, &[&id, &int(child_index), &token])?;
            Ok(n > 0)
        })
    }

    fn release_resume(&self, id: &str, child_index: u32, token: &str) -> Result<bool> {
        self.pool.tx("releasing a resume claim", Mode::WriteOne, |tx| {
            release_in(tx, id, child_index, token)
        })
    }

    #[expect(clippy::needless_lifetimes)]
    fn finish_follow_up<'a>(
        &self,
        id: &str,
        child_index: u32,
        token: &str,
        usage: Option<&'a UsageSwap>,
    ) -> Result<bool> {
        let now = self.clock.now();
        self.pool.tx("finishing a follow-up", Mode::Write, |tx| {
            let held = tx
                .query_opt(
                    "SELECT 1 FROM retinue_children WHERE delegation_id = $1 \
                     AND child_index = $2 AND resume_claim = $3 FOR UPDATE",
                    &[&id, &int(child_index), &token],
                )?
                .is_some();
            if !held {
                return Ok(false);
            }
            if let Some(swap) = usage {
                let current: Option<Value> = match tx.query_opt(
                    "SELECT usage_json FROM async_delegations WHERE delegation_id = $1 FOR UPDATE",
                    &[&id],
                )? {
                    Some(r) => parse_json_opt(r.try_get::<_, Option<String>>(0)?.as_deref()),
                    None => None,
                };
                if current != swap.expected {
                    return Err(Fail::Store(Error::Stale { what: "the unit's usage_json" }));
                }
                tx.execute(
                    "UPDATE async_delegations SET usage_json = $1, updated_at = $2 \
                     WHERE delegation_id = $3",
                    &[&swap.new.to_string(), &now, &id],
                )?;
            }
            tx.execute(
                "UPDATE retinue_children SET retained_at = $1 WHERE delegation_id = $2 \
                 AND child_index = $3 AND tombstoned_at IS NULL",
                &[&now, &id, &int(child_index)],
            )?;
            tx.execute(
                "UPDATE async_delegations SET retained_at = $1, updated_at = $1 \
                 WHERE delegation_id = $2 AND tombstoned_at IS NULL AND retained = 1",
                &[&now, &id],
            )?;
            release_in(tx, id, child_index, token)
        })
    }
}
