//! The read-only open of a `state.db`: `SQLITE_OPEN_READ_ONLY` (an
//! immutable snapshot where a read-only directory leaves no other way), and
//! the connection-local view that answers as if the file were adopted, so a
//! read command never writes a hermes file and answers as it will after
//! the first write.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rusqlite::{Connection, OpenFlags, OptionalExtension};

use crate::conn::{Adopt, RECONCILE, column_names, set_connection_pragmas};
use crate::error::SqlResult;
use retinue_core::Synchronous;

/// The URI of a read-only open of `path` (`immutable` for a WAL file whose
/// directory forbids the `-shm` companion).
fn ro_uri(path: &Path, immutable: bool) -> String {
    let text = path.to_string_lossy();
    let mut uri = String::from("file:");
    for b in text.bytes() {
        match b {
            b'%' | b'?' | b'#' => uri.push_str(&format!("%{b:02X}")),
            _ => uri.push(char::from(b)),
        }
    }
    uri.push_str(if immutable { "?mode=ro&immutable=1" } else { "?mode=ro" });
    uri
}

/// A read-only connection: `SQLITE_OPEN_READ_ONLY`, no journal switch, and
/// the connection-local (TEMP, in memory) view that answers as if the file
/// were adopted. Nothing is written to the file.
pub(crate) fn connect_read_only(
    path: &Path,
    busy: Duration,
    adopt: Adopt,
) -> SqlResult<Connection> {
    let flags = OpenFlags::SQLITE_OPEN_READ_ONLY
        | OpenFlags::SQLITE_OPEN_NO_MUTEX
        | OpenFlags::SQLITE_OPEN_URI;
    let non_utf8 = path.to_str().is_none();
    let mut conn = Connection::open_with_flags(ro_uri(path, false), flags)?;
    let probe = |c: &Connection| {
        c.query_row("SELECT count(*) FROM main.sqlite_master", [], |r| r.get::<_, i64>(0))
    };
    if let Err(e) = probe(&conn) {
        // A WAL file in a read-only directory or mount (a backup snapshot,
        // another user's home): without a `-shm` companion SQLite cannot
        // share memory (CANTOPEN), or would have to write to recover the
        // WAL (READONLY); nobody can write it either, so read it immutable.
        // READONLY only without a `-wal` file: a live writer's uncheckpointed
        // pages would make an immutable read torn, not merely stale.
        let code = e.sqlite_error_code();
        let wal = Path::new(&format!("{}-wal", path.display())).exists();
        let fallback = match code {
            Some(rusqlite::ErrorCode::CannotOpen) => true,
            Some(rusqlite::ErrorCode::ReadOnly) => !wal,
            _ => false,
        };
        if fallback && !non_utf8 {
            conn = Connection::open_with_flags(ro_uri(path, true), flags)?;
            probe(&conn)?;
            log::warn!(
                "{} is read as an immutable snapshot (its directory is read-only, so the WAL \
                 cannot be shared): changes a live writer has not checkpointed are not seen",
                path.display()
            );
        } else {
            return Err(e.into());
        }
    }
    set_connection_pragmas(&mut conn, busy, Arc::default(), Synchronous::Full, true)?;
    read_view(&conn, adopt)?;
    Ok(conn)
}

const V1: &str = include_str!("../migrations/V1__retinue_base.sql");
const V13: &str = include_str!("../migrations/V13__retinue_approvals.sql");

/// The `CREATE TABLE` statement of `table` in migration `sql`, made TEMP.
fn table_ddl(sql: &str, table: &str) -> Option<String> {
    let head = format!("CREATE TABLE IF NOT EXISTS {table} (");
    // Comments first (they may hold a `;`), then statements.
    let code: String = sql
        .lines()
        .map(|l| l.split_once("--").map_or(l, |(code, _)| code))
        .collect::<Vec<_>>()
        .join("\n");
    code.split(';')
        .map(str::trim)
        .find(|stmt| stmt.starts_with(&head))
        .map(|stmt| stmt.trim().replacen("CREATE TABLE IF NOT EXISTS", "CREATE TEMP TABLE", 1))
}

fn trigger_exists(conn: &Connection, name: &str) -> SqlResult<bool> {
    Ok(conn
        .query_row(
            "SELECT 1 FROM main.sqlite_master WHERE type = 'trigger' AND name = ?1",
            [name],
            |_| Ok(()),
        )
        .optional()?
        .is_some())
}

/// The read view of a read-only connection. Everything lives in the
/// connection's TEMP schema (in memory), which shadows `main` for
/// unqualified names:
/// * a table the file lacks (a hermes file Retinue never opened, or the
///   approval queue of an older Retinue's) is an empty TEMP table;
/// * units hermes retained that Retinue never adopted get their child rows
///   from `children_json` (the same backfill a write runs, into a TEMP copy
///   of `retinue_children`), hermes-tombstoned ones as `external`;
/// * maintained usage totals are trusted only when the file's invalidation
///   triggers exist; otherwise they are shadowed by an empty table and the
///   totals are folded from the ledger rows.
fn read_view(conn: &Connection, adopt: Adopt) -> SqlResult<()> {
    conn.pragma_update(None, "temp_store", "MEMORY")?;
    let main_exists = |t: &str| -> SqlResult<bool> {
        Ok(conn
            .query_row(
                "SELECT 1 FROM main.sqlite_master WHERE type = 'table' AND name = ?1",
                [t],
                |_| Ok(()),
            )
            .optional()?
            .is_some())
    };
    for (sql, table) in [
        (V1, "sessions"),
        (V1, "messages"),
        (V1, "async_delegations"),
        (V1, "delegation_child_usage"),
        (V1, "retinue_usage_keys"),
        (V13, "retinue_approvals"),
    ] {
        if !main_exists(table)?
            && let Some(ddl) = table_ddl(sql, table)
        {
            conn.execute_batch(&ddl)?;
        }
    }
    // A hermes table lacking columns the reconcile step would add reads
    // through a TEMP view that supplies them (their default, else NULL).
    for (table, columns) in RECONCILE {
        if !main_exists(table)? {
            continue;
        }
        let present = conn
            .prepare("SELECT name FROM pragma_table_info(?1, 'main')")?
            .query_map([table], |r| r.get::<_, String>(0))?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        let missing: Vec<String> = columns
            .iter()
            .filter(|(name, _)| !present.iter().any(|p| p.eq_ignore_ascii_case(name)))
            .map(|(name, decl)| {
                let default = decl.split_once("DEFAULT ").map_or("NULL", |(_, d)| d.trim());
                format!("{default} AS \"{name}\"")
            })
            .collect();
        if !missing.is_empty() {
            // Identifiers and defaults come from the constant table, never from input.
            // `rowid` is carried so reads that name a bad row by its rowid work.
            conn.execute_batch(&format!(
                "CREATE TEMP VIEW \"{table}\" AS SELECT *, rowid AS rowid, {} \
                 FROM main.\"{table}\"",
                missing.join(", ")
            ))?;
        }
    }
    // A file from before V5 has no unit-level tombstones: none covers a child.
    if !main_exists("retinue_unit_tombstones")? {
        conn.execute_batch(
            "CREATE TEMP TABLE retinue_unit_tombstones (delegation_id TEXT PRIMARY KEY, \
             tombstoned_at REAL NOT NULL, ttl_seconds REAL NOT NULL) WITHOUT ROWID",
        )?;
    }
    let totals_trusted =
        main_exists("retinue_usage_totals")? && trigger_exists(conn, "retinue_usage_totals_del")?;
    if !totals_trusted && let Some(ddl) = table_ddl(V1, "retinue_usage_totals") {
        conn.execute_batch(&ddl)?;
    }
    children_view(conn, adopt, main_exists("retinue_children")?)
}

/// The children as after adoption: units hermes retained that Retinue never
/// adopted get their rows from `children_json` in a TEMP copy of
/// `retinue_children` (`has_children`: the file has the table).
fn children_view(conn: &Connection, adopt: Adopt, has_children: bool) -> SqlResult<()> {
    // A file written before the tombstone note existed reads through a TEMP
    // copy that has the column (NULL), as after the write that would add it.
    let lacks_note = has_children
        && !conn
            .prepare("SELECT name FROM pragma_table_info('retinue_children', 'main')")?
            .query_map([], |r| r.get::<_, String>(0))?
            .collect::<rusqlite::Result<Vec<_>>>()?
            .iter()
            .any(|c| c.eq_ignore_ascii_case("tombstone_note"));
    let unadopted = !has_children
        || lacks_note
        || conn.query_row(
            "SELECT EXISTS (SELECT 1 FROM async_delegations u WHERE u.retained = 1 \
             AND NOT EXISTS (SELECT 1 FROM main.retinue_children c \
                             WHERE c.delegation_id = u.delegation_id))",
            [],
            |r| r.get::<_, bool>(0),
        )?;
    if !unadopted {
        return Ok(());
    }
    let ddl = table_ddl(V1, "retinue_children").unwrap_or_default();
    conn.execute_batch(&ddl)?;
    conn.execute_batch(
        "ALTER TABLE temp.retinue_children ADD COLUMN tombstone_note TEXT; \
         CREATE INDEX temp.retinue_tmp_children_subagent ON retinue_children(subagent_id); \
         CREATE INDEX temp.retinue_tmp_children_session ON retinue_children(child_session_id);",
    )?;
    if has_children {
        let present = column_names(conn, "retinue_children")?;
        let main_cols = conn
            .prepare("SELECT name FROM pragma_table_info('retinue_children', 'main')")?
            .query_map([], |r| r.get::<_, String>(0))?
            .collect::<rusqlite::Result<Vec<_>>>()?;
        let cols: Vec<String> = present
            .into_iter()
            .filter(|c| main_cols.iter().any(|m| m.eq_ignore_ascii_case(c)))
            .map(|c| format!("\"{}\"", c.replace('"', "\"\"")))
            .collect();
        let cols = cols.join(", ");
        // Column names come from the two schemas, never from input.
        conn.execute_batch(&format!(
            "INSERT INTO temp.retinue_children ({cols}) SELECT {cols} FROM main.retinue_children"
        ))?;
    }
    adopt(conn, Some(f64::NEG_INFINITY))?;
    Ok(())
}
