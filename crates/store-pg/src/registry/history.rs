//! The history pruner (semantics §3.6) on PostgreSQL.

use retinue_core::Result;

use crate::pool::{Mode, Params};
use crate::store::PgStore;

impl PgStore {
    pub(crate) fn prune_history_in(&self) -> Result<usize> {
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
