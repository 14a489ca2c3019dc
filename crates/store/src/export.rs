//! [`StateDbReader`]: the SQLite side of `retinue migrate`. It reads a
//! `state.db` read-only, in one snapshot, into the neutral rows of
//! [`retinue_core::StateDump`] for another backend to import.

use std::collections::BTreeSet;
use std::path::Path;

use retinue_core::{Cell, CellType, Result, StateDump, StateReader, TableSpec};
use rusqlite::types::ValueRef;

use crate::error::sql;

/// Reads a `state.db` for copying into another backend (never writes it).
#[derive(Debug, Default, Clone, Copy)]
pub struct StateDbReader;

impl StateReader for StateDbReader {
    fn read_state(&self, source: &Path, tables: &[TableSpec]) -> Result<StateDump> {
        let conn = rusqlite::Connection::open_with_flags(
            source,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(sql("opening the source state.db"))?;
        conn.busy_timeout(std::time::Duration::from_secs(10))
            .map_err(sql("opening the source state.db"))?;
        // One read snapshot of the whole file.
        conn.execute_batch("BEGIN").map_err(sql("reading the source"))?;
        let tables = tables.iter().map(|t| read_table(&conn, t)).collect::<Result<_>>()?;
        let parents = {
            let mut stmt = conn
                .prepare(
                    "SELECT id, parent_session_id FROM sessions WHERE parent_session_id IS NOT NULL",
                )
                .map_err(sql("reading the source"))?;
            stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                .map_err(sql("reading the source"))?
                .collect::<rusqlite::Result<_>>()
                .map_err(sql("reading the source"))?
        };
        Ok(StateDump { tables, parents })
    }
}

/// Converts a SQLite value to the column's PostgreSQL type (SQLite is
/// loosely typed: numbers may sit in text columns and the reverse).
fn convert(v: ValueRef<'_>, ty: CellType) -> Cell {
    let text = |b: &[u8]| String::from_utf8_lossy(b).replace('\0', "");
    match (ty, v) {
        (CellType::Text, ValueRef::Null) => Cell::Text(None),
        (CellType::Text, ValueRef::Integer(i)) => Cell::Text(Some(i.to_string())),
        (CellType::Text, ValueRef::Real(f)) => Cell::Text(Some(f.to_string())),
        (CellType::Text, ValueRef::Text(b) | ValueRef::Blob(b)) => Cell::Text(Some(text(b))),
        (CellType::Float, ValueRef::Integer(i)) => Cell::Float(Some(i as f64)),
        (CellType::Float, ValueRef::Real(f)) => Cell::Float(Some(f)),
        (CellType::Float, ValueRef::Text(b)) => Cell::Float(text(b).trim().parse().ok()),
        (CellType::Float, _) => Cell::Float(None),
        (CellType::Int, ValueRef::Integer(i)) => Cell::Int(Some(i)),
        (CellType::Int, ValueRef::Real(f)) => Cell::Int(f.is_finite().then_some(f as i64)),
        (CellType::Int, ValueRef::Text(b)) => Cell::Int(text(b).trim().parse().ok()),
        (CellType::Int, _) => Cell::Int(None),
        (CellType::Bytes, ValueRef::Null) => Cell::Bytes(None),
        (CellType::Bytes, ValueRef::Integer(i)) => Cell::Bytes(Some(i.to_string().into_bytes())),
        (CellType::Bytes, ValueRef::Real(f)) => Cell::Bytes(Some(f.to_string().into_bytes())),
        (CellType::Bytes, ValueRef::Text(b) | ValueRef::Blob(b)) => Cell::Bytes(Some(b.to_vec())),
    }
}

/// Reads every row of `table` (columns the file lacks read as NULL), in key order.
fn read_table(conn: &rusqlite::Connection, table: &TableSpec) -> Result<Vec<Vec<Cell>>> {
    let exists: bool = conn
        .query_row(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1)",
            [table.name],
            |r| r.get(0),
        )
        .map_err(sql("reading the source schema"))?;
    if !exists {
        return Ok(Vec::new());
    }
    let present: BTreeSet<String> = {
        let mut stmt = conn
            .prepare("SELECT name FROM pragma_table_info(?1)")
            .map_err(sql("reading the source schema"))?;
        stmt.query_map([table.name], |r| r.get::<_, String>(0))
            .map_err(sql("reading the source schema"))?
            .collect::<rusqlite::Result<_>>()
            .map_err(sql("reading the source schema"))?
    };
    // Column names come from the fixed list above, never from input.
    let select: Vec<String> = table
        .cols
        .iter()
        .map(|(c, _)| if present.contains(*c) { format!("\"{c}\"") } else { "NULL".to_owned() })
        .collect();
    let order: Vec<String> = (1..=table.key).map(|i| i.to_string()).collect();
    let query =
        format!("SELECT {} FROM {} ORDER BY {}", select.join(", "), table.name, order.join(", "));
    let mut stmt = conn.prepare(&query).map_err(sql("reading the source"))?;
    let mut rows = stmt.query([]).map_err(sql("reading the source"))?;
    let mut out = Vec::new();
    while let Some(r) = rows.next().map_err(sql("reading the source"))? {
        let mut row = Vec::with_capacity(table.cols.len());
        for (i, (_, ty)) in table.cols.iter().enumerate() {
            row.push(convert(r.get_ref(i).map_err(sql("reading the source"))?, *ty));
        }
        out.push(row);
    }
    Ok(out)
}
