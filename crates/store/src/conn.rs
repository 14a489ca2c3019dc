//! How a connection to the `state.db` is set up (the busy handler, the
//! statement cache, the pragmas) and the columns the reconcile step adds
//! to hermes's tables: shared by the read-write pool (`db`) and the
//! read-only view (`read_view`).

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use rusqlite::Connection;

use crate::error::SqlResult;
use crate::gate::busy_handler;
use retinue_core::Synchronous;

/// The registry's adoption of hermes-retained units, handed in by the store.
pub(crate) type Adopt = fn(&Connection, Option<f64>) -> SqlResult<usize>;
pub(crate) fn set_connection_pragmas(
    conn: &mut Connection,
    busy: Duration,
    probes: Arc<AtomicU64>,
    sync: Synchronous,
    read_only: bool,
) -> SqlResult<()> {
    // Short, growing waits instead of SQLite's sleeps of up to 100 ms (see
    // `crate::gate`), each counted in `probes`.
    conn.busy_handler(Some(busy_handler(busy, probes)))?;
    // Every statement of the store fits: no re-prepare on the hot paths.
    conn.set_prepared_statement_cache_capacity(256);
    // Query-planner stability: without it, SQLite 3.5x marks every `col = ?`
    // statement "re-prepare when the binding changes", and the statement
    // cache's clear-bindings on return then forces a full re-prepare on every
    // use (measured: 2-4x the cost of an indexed lookup).
    conn.set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)?;
    conn.pragma_update(None, "foreign_keys", true)?;
    if !read_only {
        let level = match sync {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        };
        conn.pragma_update(None, "synchronous", level)?;
    }
    Ok(())
}

/// Columns the reconcile step adds to existing hermes tables, with hermes's
/// declarations (semantics §2.6 step 2).
pub(crate) const RECONCILE: &[(&str, &[(&str, &str)])] = &[
    (
        "async_delegations",
        &[
            ("origin_session", "TEXT"),
            ("origin_ui_session_id", "TEXT NOT NULL DEFAULT ''"),
            ("parent_session_id", "TEXT"),
            ("state", "TEXT"),
            ("dispatched_at", "REAL"),
            ("completed_at", "REAL"),
            ("updated_at", "REAL"),
            ("event_json", "TEXT"),
            ("result_json", "TEXT"),
            ("delivery_state", "TEXT NOT NULL DEFAULT 'pending'"),
            ("delivery_attempts", "INTEGER NOT NULL DEFAULT 0"),
            ("delivered_at", "REAL"),
            ("owner_pid", "INTEGER"),
            ("owner_started_at", "INTEGER"),
            ("task_json", "TEXT"),
            ("delivery_claim", "TEXT"),
            ("delivery_claimed_at", "REAL"),
            ("origin_session_id", "TEXT"),
            ("child_session_id", "TEXT"),
            ("children_json", "TEXT"),
            ("retained", "INTEGER"),
            ("retained_at", "REAL"),
            ("tombstoned_at", "REAL"),
            ("owner_profile", "TEXT"),
            ("usage_json", "TEXT"),
        ],
    ),
    (
        "delegation_child_usage",
        &[
            ("parent_session_id", "TEXT"),
            ("parent_turn_id", "TEXT NOT NULL DEFAULT ''"),
            ("child_session_id", "TEXT NOT NULL DEFAULT ''"),
            ("usage_json", "TEXT"),
            ("aggregate_json", "TEXT"),
            ("created_at", "REAL"),
        ],
    ),
    (
        "sessions",
        &[
            ("source", "TEXT"),
            ("model", "TEXT"),
            ("model_config", "TEXT"),
            ("parent_session_id", "TEXT"),
            ("started_at", "REAL"),
            ("ended_at", "REAL"),
            ("end_reason", "TEXT"),
            ("message_count", "INTEGER DEFAULT 0"),
            ("tool_call_count", "INTEGER DEFAULT 0"),
            ("profile_name", "TEXT"),
            ("estimated_cost_usd", "REAL"),
            ("cost_status", "TEXT"),
            ("cost_source", "TEXT"),
        ],
    ),
    (
        "messages",
        &[
            ("session_id", "TEXT"),
            ("role", "TEXT"),
            ("content", "TEXT"),
            ("timestamp", "REAL"),
            ("active", "INTEGER NOT NULL DEFAULT 1"),
            ("tool_call_id", "TEXT"),
            ("tool_calls", "TEXT"),
            ("tool_name", "TEXT"),
            ("token_count", "INTEGER"),
            ("finish_reason", "TEXT"),
        ],
    ),
];

/// Columns added to Retinue's own tables after the migrations (a column
/// cannot be added idempotently in SQL, so it is reconciled like hermes').
pub(crate) const RECONCILE_AFTER: &[(&str, &[(&str, &str)])] = &[
    (
        "retinue_children",
        // An operator's free-text note on a tombstone; the reason stays `manual`.
        &[("tombstone_note", "TEXT")],
    ),
    (
        "retinue_budget_reservations",
        // When a reservation was kept as spent (issue #23: a failed ledger
        // write, an owner that died mid-run) rather than released.
        &[("kept_spent_at", "REAL")],
    ),
];

pub(crate) fn column_names(conn: &Connection, table: &str) -> SqlResult<Vec<String>> {
    let mut stmt = conn.prepare("SELECT name FROM pragma_table_info(?1)")?;
    let names = stmt.query_map([table], |r| r.get::<_, String>(0))?;
    Ok(names.collect::<rusqlite::Result<Vec<_>>>()?)
}
