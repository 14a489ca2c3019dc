//! The limit: minimal hand-written prepared SQL returning the same answer
//! on the same file, on one raw connection.

use std::path::Path;

use rusqlite::{Connection, params};

pub(crate) struct Limits {
    conn: Connection,
}

impl Limits {
    pub(crate) fn open(path: &Path) -> rusqlite::Result<Limits> {
        Limits::open_with(path, "full")
    }

    pub(crate) fn open_with(path: &Path, sync: &str) -> rusqlite::Result<Limits> {
        let conn = Connection::open(path)?;
        conn.busy_timeout(std::time::Duration::from_secs(10))?;
        conn.pragma_update(None, "synchronous", if sync == "full" { "FULL" } else { "NORMAL" })?;
        conn.set_prepared_statement_cache_capacity(64);
        conn.set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)?;
        Ok(Limits { conn })
    }

    pub(crate) fn open_limit(&self, path: &Path) {
        if let Ok(c) = Connection::open(path) {
            let _ = c.busy_timeout(std::time::Duration::from_secs(10));
            let _ = c.pragma_update(None, "foreign_keys", true);
            let _ = c.query_row("SELECT count(*) FROM sqlite_master", [], |r| r.get::<_, i64>(0));
        }
    }

    pub(crate) fn find(&self, column: &str, id: &str, cutoff: f64) {
        let sql = format!(
            "SELECT c.delegation_id, c.child_index, c.subagent_id, c.child_session_id, c.manifest_json, \
             c.retained_at, u.parent_session_id, u.owner_profile, u.state, u.completed_at \
             FROM retinue_children c JOIN async_delegations u ON u.delegation_id = c.delegation_id \
             WHERE c.{column} = ?1 AND c.tombstoned_at IS NULL AND u.retained = 1 \
             AND u.tombstoned_at IS NULL AND c.retained_at >= ?2 ORDER BY u.retained_at DESC LIMIT 1"
        );
        if let Ok(mut stmt) = self.conn.prepare_cached(&sql) {
            let _ = stmt.query_row(params![id, cutoff], |r| r.get::<_, String>(0));
        }
    }

    pub(crate) fn list(&self, cutoff: f64) {
        if let Ok(mut stmt) = self.conn.prepare_cached(
            "SELECT c.delegation_id, c.child_index, c.subagent_id, c.child_session_id, c.manifest_json, \
             c.retained_at, u.parent_session_id, u.owner_profile, u.state, u.completed_at \
             FROM (SELECT delegation_id, retained_at FROM async_delegations WHERE retained = 1 \
                   AND tombstoned_at IS NULL ORDER BY retained_at DESC, delegation_id DESC LIMIT 10) top \
             JOIN retinue_children c ON c.delegation_id = top.delegation_id \
             JOIN async_delegations u ON u.delegation_id = top.delegation_id \
             WHERE c.tombstoned_at IS NULL AND c.retained_at >= ?1 \
             ORDER BY top.retained_at DESC, top.delegation_id DESC, c.child_index",
        ) && let Ok(rows) = stmt.query_map([cutoff], |r| r.get::<_, String>(0))
        {
            let _ = rows.count();
        }
    }

    pub(crate) fn chain(&self, session: &str) {
        if let Ok(mut stmt) = self.conn.prepare_cached(
            "WITH RECURSIVE up(id, parent, source, n) AS ( \
               SELECT id, parent_session_id, source, 0 FROM sessions WHERE id = ?1 \
               UNION ALL SELECT s.id, s.parent_session_id, s.source, up.n + 1 FROM sessions s \
               JOIN up ON s.id = up.parent WHERE up.n < 100) \
             SELECT id, source FROM up",
        ) && let Ok(rows) = stmt.query_map([session], |r| r.get::<_, String>(0))
        {
            let _ = rows.count();
        }
    }

    pub(crate) fn totals(&self, parent: &str) {
        if let Ok(mut stmt) = self.conn.prepare_cached(
            "SELECT cost_usd, input_tokens, output_tokens FROM retinue_usage_totals WHERE parent_session_id = ?1",
        ) {
            let _ = stmt.query_row([parent], |r| r.get::<_, f64>(0));
        }
    }

    pub(crate) fn prune_noop(&self, cutoff: f64) {
        if let Ok(mut stmt) = self.conn.prepare_cached(
            "SELECT EXISTS (SELECT 1 FROM retinue_children c WHERE c.delegation_id IN \
             (SELECT delegation_id FROM async_delegations WHERE retained = 1 AND tombstoned_at IS NULL) \
             AND c.tombstoned_at IS NULL AND c.retained_at < ?1)",
        ) {
            let _ = stmt.query_row([cutoff], |r| r.get::<_, i64>(0));
        }
    }

    fn tx<F: FnOnce(&Connection) -> rusqlite::Result<()>>(&self, f: F) {
        let run = || -> rusqlite::Result<()> {
            self.conn.execute_batch("BEGIN IMMEDIATE")?;
            match f(&self.conn) {
                Ok(()) => self.conn.execute_batch("COMMIT"),
                Err(e) => {
                    let _ = self.conn.execute_batch("ROLLBACK");
                    Err(e)
                }
            }
        };
        if let Err(e) = run() {
            eprintln!("limit transaction failed: {e}");
        }
    }

    /// One bare transaction writing a retained unit with two children and their sessions.
    pub(crate) fn write_unit(&self, tag: &str, now: f64) {
        self.tx(|c| {
            c.prepare_cached(
                "INSERT INTO async_delegations (delegation_id, origin_session, parent_session_id, state, \
                 dispatched_at, updated_at, task_json, children_json, retained, retained_at, owner_profile) \
                 VALUES (?1, 'p-1', 'p-1', 'completed', ?2, ?2, '{}', '[]', 1, ?2, '')",
            )?
            .execute(params![format!("deleg_{tag}"), now])?;
            for k in 0..2 {
                c.prepare_cached(
                    "INSERT INTO retinue_children (delegation_id, child_index, subagent_id, child_session_id, \
                     manifest_json, retained_at) VALUES (?1, ?2, ?3, ?4, '{}', ?5)",
                )?
                .execute(params![format!("deleg_{tag}"), k, format!("sa-{k}-{tag}"), format!("cs-{tag}-{k}"), now])?;
                c.prepare_cached(
                    "INSERT INTO sessions (id, source, model_config, parent_session_id, started_at) \
                     VALUES (?1, 'delegate', '{}', 'p-1', ?2)",
                )?
                .execute(params![format!("cs-{tag}-{k}"), now])?;
            }
            Ok(())
        });
    }

    /// Two bare transactions, as the real flow needs (dispatch before the
    /// children run, retain after): the unit with its manifest and sessions,
    /// then the retain.
    pub(crate) fn write_unit_two_commits(&self, tag: &str, now: f64) {
        self.tx(|c| {
            c.prepare_cached(
                "INSERT INTO async_delegations (delegation_id, origin_session, parent_session_id, state, \
                 dispatched_at, updated_at, task_json, children_json, owner_profile) \
                 VALUES (?1, 'p-1', 'p-1', 'running', ?2, ?2, '{}', '[]', '')",
            )?
            .execute(params![format!("deleg_{tag}"), now])?;
            for k in 0..2 {
                c.prepare_cached(
                    "INSERT INTO retinue_children (delegation_id, child_index, subagent_id, child_session_id, \
                     manifest_json) VALUES (?1, ?2, ?3, ?4, '{}')",
                )?
                .execute(params![format!("deleg_{tag}"), k, format!("sa-{k}-{tag}"), format!("cs-{tag}-{k}")])?;
                c.prepare_cached(
                    "INSERT INTO sessions (id, source, model_config, parent_session_id, started_at) \
                     VALUES (?1, 'delegate', '{}', 'p-1', ?2)",
                )?
                .execute(params![format!("cs-{tag}-{k}"), now])?;
            }
            Ok(())
        });
        self.tx(|c| {
            c.prepare_cached(
                "UPDATE async_delegations SET retained = 1, retained_at = ?2, updated_at = ?2 WHERE delegation_id = ?1",
            )?
            .execute(params![format!("deleg_{tag}"), now])?;
            c.prepare_cached("UPDATE retinue_children SET retained_at = ?2 WHERE delegation_id = ?1")?
                .execute(params![format!("deleg_{tag}"), now])?;
            Ok(())
        });
    }

    /// The cap collapse to `keep` units as two bare set-based UPDATEs in one transaction.
    pub(crate) fn collapse(&self, keep: usize, now: f64) {
        const OVER: &str = "SELECT delegation_id FROM async_delegations WHERE retained = 1 \
             AND tombstoned_at IS NULL ORDER BY retained_at DESC, delegation_id DESC LIMIT -1 OFFSET ?2";
        self.tx(|c| {
            c.execute(
                &format!(
                    "UPDATE retinue_children SET tombstoned_at = ?1, tombstone_reason = 'cap' \
                     WHERE tombstoned_at IS NULL AND delegation_id IN ({OVER})"
                ),
                params![now, keep as i64],
            )?;
            c.execute(
                &format!("UPDATE async_delegations SET tombstoned_at = ?1, updated_at = ?1 WHERE delegation_id IN ({OVER})"),
                params![now, keep as i64],
            )?;
            Ok(())
        });
    }

    /// The floor of any collapse that keeps hermes compatibility: the unit
    /// rows' `tombstoned_at` (and `updated_at`) alone, one bare UPDATE in one
    /// transaction, no child row and no reason written.
    pub(crate) fn collapse_units_only(&self, keep: usize, now: f64) {
        self.tx(|c| {
            c.execute(
                "UPDATE async_delegations SET tombstoned_at = ?1, updated_at = ?1 WHERE delegation_id IN \
                 (SELECT delegation_id FROM async_delegations WHERE retained = 1 AND tombstoned_at IS NULL \
                  ORDER BY retained_at DESC, delegation_id DESC LIMIT -1 OFFSET ?2)",
                params![now, keep as i64],
            )?;
            Ok(())
        });
    }

    /// Moves a unit's retention `secs` into the past (unit and children).
    pub(crate) fn age(&self, delegation_id: &str, secs: f64) {
        self.tx(|c| {
            c.prepare_cached(
                "UPDATE async_delegations SET retained_at = retained_at - ?2 WHERE delegation_id = ?1",
            )?
            .execute(params![delegation_id, secs])?;
            c.prepare_cached(
                "UPDATE retinue_children SET retained_at = retained_at - ?2 WHERE delegation_id = ?1",
            )?
            .execute(params![delegation_id, secs])?;
            Ok(())
        });
    }

    /// Retains a unit the way another writer would: the flag and time, no prune.
    pub(crate) fn retain_raw(&self, delegation_id: &str, now: f64) {
        self.tx(|c| {
            c.prepare_cached(
                "UPDATE async_delegations SET retained = 1, retained_at = ?2, updated_at = ?2 WHERE delegation_id = ?1",
            )?
            .execute(params![delegation_id, now])?;
            Ok(())
        });
    }

    /// One bare transaction: a ledger row, its key and the totals.
    pub(crate) fn record(&self, label: &str, i: usize) {
        self.tx(|c| {
            c.prepare_cached(
                "INSERT INTO delegation_child_usage (parent_session_id, child_session_id, usage_json, created_at) \
                 VALUES (?1, ?2, '{\"cost_usd\":0.01}', 0)",
            )?
            .execute(params![format!("lim-{label}"), format!("c{i}")])?;
            let id = c.last_insert_rowid();
            c.prepare_cached("INSERT INTO retinue_usage_keys (attribution_key, usage_id, created_at) VALUES (?1, ?2, 0)")?
                .execute(params![format!("lim:{label}:{i}"), id])?;
            c.prepare_cached(
                "INSERT INTO retinue_usage_totals (parent_session_id, cost_usd, covered_id) VALUES (?1, 0.01, ?2) \
                 ON CONFLICT(parent_session_id) DO UPDATE SET cost_usd = cost_usd + 0.01, covered_id = ?2",
            )?
            .execute(params![format!("lim-{label}"), id])?;
            Ok(())
        });
    }

    /// One bare transaction tombstoning one child written by `write_unit`.
    pub(crate) fn tombstone(&self, subagent_id: &str, now: f64) {
        self.tx(|c| {
            c.prepare_cached(
                "UPDATE retinue_children SET tombstoned_at = ?1, tombstone_reason = 'manual' \
                 WHERE subagent_id = ?2 AND tombstoned_at IS NULL",
            )?
            .execute(params![now, subagent_id])?;
            Ok(())
        });
    }
}
