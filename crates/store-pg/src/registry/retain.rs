//! Retaining a completed unit: the one-statement retain under the tenant's cap
//! (READ COMMITTED, exact through the live-count triggers), and ranking and
//! pruning only over it, a TTL due, or every 64th retain.

use retinue_core::Result;
use serde_json::Value;
use std::sync::atomic::Ordering;

use crate::pool::{Mode, PgResult, Tx, int};
use crate::registry::backfill::backfill;
use crate::registry::retention::{prune_in, recount};
use crate::rows::PROFILE;
use crate::store::{Limits, PgStore};

pub(crate) fn retain_in(
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
pub(crate) fn retain_one(
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
pub(crate) struct Serial {
    /// The unit was retained.
    pub(crate) changed: bool,
    /// Its tenant is at its cap now: its next retain will prune.
    pub(crate) at_cap: bool,
}

/// What a completion writes besides the retain (see [`retain_fast`]).
pub(crate) struct Done<'a> {
    pub(crate) state: &'a str,
    pub(crate) event: String,
    pub(crate) result: String,
    pub(crate) delivery: &'a str,
    pub(crate) delivered_at: Option<f64>,
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

impl PgStore {
    /// [`retain_fast`] in its own statement: `Some(changed)` when it
    /// retained (or found nothing to retain); `None` when the serialized
    /// path must run, noting a due prune for the next retains.
    pub(crate) fn retain_fast(
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
    pub(crate) fn try_fast(&self) -> bool {
        let n = self.retains.fetch_add(1, Ordering::Relaxed);
        !self.prune_hint.load(Ordering::Relaxed) && n % VERIFY_EVERY != VERIFY_EVERY - 1
    }
}

/// Every this many retains of a store, one takes the ranking path, which
/// repairs the tenant's count.
const VERIFY_EVERY: u64 = 64;
