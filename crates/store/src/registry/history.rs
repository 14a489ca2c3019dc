//! The history pruner (spec §3.6): deletes old non-retained units only.

use rusqlite::params;

use crate::error::Result;
use crate::store::Store;

/// Delivered rows older than this are deleted.
pub const DELIVERED_MAX_AGE_SECS: f64 = 7.0 * 86_400.0;
/// Terminal rows kept.
pub const TERMINAL_KEEP: i64 = 50;
/// Pending rows kept.
pub const PENDING_KEEP: i64 = 1000;

pub(crate) fn prune(store: &Store) -> Result<usize> {
    let now = store.clock.now();
    store.pool.write("pruning history", |tx| {
        let terminal = "retained IS NULL AND state NOT IN ('running', 'finalizing')";
        let mut deleted = tx.execute(
            &format!(
                "DELETE FROM async_delegations WHERE {terminal} AND delivery_state = 'delivered' \
                 AND COALESCE(delivered_at, updated_at) < ?1"
            ),
            [now - DELIVERED_MAX_AGE_SECS],
        )?;
        deleted += tx.execute(
            &format!(
                "DELETE FROM async_delegations WHERE delegation_id IN (SELECT delegation_id \
                 FROM async_delegations WHERE {terminal} AND delivery_state != 'pending' \
                 ORDER BY (delivery_state = 'delivered') DESC, updated_at ASC \
                 LIMIT max(0, (SELECT count(*) FROM async_delegations WHERE {terminal} \
                               AND delivery_state != 'pending') - ?1))"
            ),
            params![TERMINAL_KEEP],
        )?;
        deleted += tx.execute(
            &format!(
                "DELETE FROM async_delegations WHERE delegation_id IN (SELECT delegation_id \
                 FROM async_delegations WHERE {terminal} AND delivery_state = 'pending' \
                 ORDER BY updated_at ASC LIMIT max(0, (SELECT count(*) FROM async_delegations \
                 WHERE {terminal} AND delivery_state = 'pending') - ?1))"
            ),
            params![PENDING_KEEP],
        )?;
        tx.execute(
            "DELETE FROM retinue_children WHERE NOT EXISTS (SELECT 1 FROM async_delegations u \
             WHERE u.delegation_id = retinue_children.delegation_id)",
            [],
        )?;
        Ok(deleted)
    })
}
