//! The history pruner (semantics §3.6): deletes old non-retained units only.
//!
//! It runs after every spawn, so it must not cost O(history): every
//! statement reads the partial index `retinue_idx_async_history`
//! (migration V2), which holds only non-retained terminal units — a set this
//! pruner keeps at about [`TERMINAL_KEEP`] + [`PENDING_KEEP`] rows. A
//! read-only check runs first; the write lock is taken only when something
//! is due. Child rows are deleted by primary key for the units deleted here.

use rusqlite::{Connection, Transaction, params};

use crate::error::{Result, SqlResult};
use crate::store::Store;

use retinue_core::{DELIVERED_MAX_AGE_SECS, PENDING_KEEP, TERMINAL_KEEP};

/// The rows the pruner may delete; must match the V2 partial index's `WHERE`
/// term for term, so SQLite uses that index.
const TERMINAL: &str = "retained IS NULL AND state NOT IN ('running', 'finalizing')";

pub(crate) fn prune(store: &Store) -> Result<usize> {
    let now = store.clock.now();
    let old = now - DELIVERED_MAX_AGE_SECS;
    if !store.pool.query("checking whether history is due", |conn| due(conn, old))? {
        return Ok(0);
    }
    store.pool.write("pruning history", |tx| prune_in(tx, old))
}

/// Whether a prune would delete anything (bounded index reads).
fn due(conn: &Connection, old: f64) -> SqlResult<bool> {
    let sql = format!(
        "SELECT EXISTS (SELECT 1 FROM async_delegations WHERE {TERMINAL} \
           AND delivery_state = 'delivered' AND COALESCE(delivered_at, updated_at) < ?1) \
         OR (SELECT count(*) FROM (SELECT 1 FROM async_delegations WHERE {TERMINAL} \
             AND delivery_state != 'pending' LIMIT ?2 + 1)) > ?2 \
         OR (SELECT count(*) FROM (SELECT 1 FROM async_delegations WHERE {TERMINAL} \
             AND delivery_state = 'pending' LIMIT ?3 + 1)) > ?3"
    );
    Ok(conn
        .prepare_cached(&sql)?
        .query_row(params![old, TERMINAL_KEEP, PENDING_KEEP], |r| r.get(0))?)
}

fn prune_in(tx: &Transaction<'_>, old: f64) -> SqlResult<usize> {
    let mut deleted: Vec<String> = Vec::new();
    let mut run = |sql: String, p: &[&dyn rusqlite::ToSql]| -> SqlResult<()> {
        let mut stmt = tx.prepare_cached(&sql)?;
        let ids = stmt.query_map(p, |r| r.get::<_, String>(0))?;
        for id in ids {
            deleted.push(id?);
        }
        Ok(())
    };
    run(
        format!(
            "DELETE FROM async_delegations WHERE delegation_id IN (SELECT delegation_id \
             FROM async_delegations WHERE {TERMINAL} AND delivery_state = 'delivered' \
             AND COALESCE(delivered_at, updated_at) < ?1) RETURNING delegation_id"
        ),
        &[&old],
    )?;
    run(
        format!(
            "DELETE FROM async_delegations WHERE delegation_id IN (SELECT delegation_id \
             FROM async_delegations WHERE {TERMINAL} AND delivery_state != 'pending' \
             ORDER BY (delivery_state = 'delivered') DESC, updated_at ASC \
             LIMIT max(0, (SELECT count(*) FROM async_delegations WHERE {TERMINAL} \
                           AND delivery_state != 'pending') - ?1)) RETURNING delegation_id"
        ),
        &[&TERMINAL_KEEP],
    )?;
    run(
        format!(
            "DELETE FROM async_delegations WHERE delegation_id IN (SELECT delegation_id \
             FROM async_delegations WHERE {TERMINAL} AND delivery_state = 'pending' \
             ORDER BY updated_at ASC LIMIT max(0, (SELECT count(*) FROM async_delegations \
             WHERE {TERMINAL} AND delivery_state = 'pending') - ?1)) RETURNING delegation_id"
        ),
        &[&PENDING_KEEP],
    )?;
    // Child rows of the deleted units, by primary-key prefix (a terminal
    // non-retained unit normally has none; a rolled-back retain may leave some).
    let mut children =
        tx.prepare_cached("DELETE FROM retinue_children WHERE delegation_id = ?1")?;
    for id in &deleted {
        children.execute([id])?;
    }
    Ok(deleted.len())
}
