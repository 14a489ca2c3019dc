//! Adoption of hermes-retained units (rows hermes wrote as `retained` without
//! Retinue's child rows), run by every retaining write.

use retinue_core::{TombstoneReason, parse_children_json};

use crate::pool::{Params, PgResult, Tx, count};

/// Child rows for `retained=1` units that have none (units copied from a
/// hermes file), as the SQLite backend's backfill.
pub(crate) fn backfill(tx: &mut Tx<'_>) -> PgResult<usize> {
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
