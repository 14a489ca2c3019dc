//! [`RegistryRead`] on PostgreSQL: lookups and lists under the §3.1 predicate,
//! in one `REPEATABLE READ` snapshot.

use retinue_core::{
    Lookup, RegistryRead, Result, RetainedChild, TombstoneReason, Unaddressable, child_status,
    parse_json_opt,
};
use serde_json::Value;

use crate::pool::{Mode, PgResult, Tx, int};
use crate::registry::backfill::backfill;
use crate::rows::{CHILD_COLS, CHILD_RETAINED_AT, PROFILE_U, read_child_row_at};
use crate::store::{Limits, PgStore};
use retinue_core::ChildRow;

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
pub(crate) fn resolve_adopting(tx: &mut Tx<'_>, id: &str, lim: Limits) -> PgResult<Option<Scored>> {
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
