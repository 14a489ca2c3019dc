//! A whole-database text dump (schema and every row of every table, in
//! rowid order), so a test can prove that a refused operation changed
//! nothing.

use std::fmt::Write as _;
use std::path::Path;

use rusqlite::types::ValueRef;
use rusqlite::{Connection, OpenFlags};

use crate::{Context, Outcome};

fn render(v: ValueRef<'_>) -> String {
    match v {
        ValueRef::Null => "NULL".to_owned(),
        ValueRef::Integer(i) => i.to_string(),
        ValueRef::Real(f) => format!("{f:?}"),
        ValueRef::Text(t) => format!("T{:?}", String::from_utf8_lossy(t)),
        ValueRef::Blob(b) => {
            format!("B{}", b.iter().map(|x| format!("{x:02x}")).collect::<String>())
        }
    }
}

/// Dumps the database at `path` (opened read-only) as text.
pub fn dump(path: &Path) -> Outcome<String> {
    let conn =
        Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY).ctx("dump: open")?;
    dump_conn(&conn)
}

/// Dumps the database behind `conn` as text.
pub fn dump_conn(conn: &Connection) -> Outcome<String> {
    let mut out = String::new();
    let mut stmt = conn
        .prepare(
            "SELECT type, name, COALESCE(sql, '') FROM sqlite_master \
             WHERE name NOT LIKE 'sqlite_%' ORDER BY type, name",
        )
        .ctx("dump: schema")?;
    let objects: Vec<(String, String, String)> = stmt
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .ctx("dump: schema")?
        .collect::<rusqlite::Result<_>>()
        .ctx("dump: schema")?;
    for (kind, name, sql) in &objects {
        let _ = writeln!(out, "-- {kind} {name}\n{sql}");
        if kind != "table" {
            continue;
        }
        let quoted = name.replace('"', "\"\"");
        let mut rows = conn
            .prepare(&format!("SELECT * FROM \"{quoted}\" ORDER BY rowid"))
            .or_else(|_| conn.prepare(&format!("SELECT * FROM \"{quoted}\"")))
            .ctx("dump: table")?;
        let n = rows.column_count();
        let mut cursor = rows.query([]).ctx("dump: rows")?;
        while let Some(row) = cursor.next().ctx("dump: row")? {
            let cells: Vec<String> =
                (0..n).map(|i| row.get_ref(i).map_or_else(|e| format!("<{e}>"), render)).collect();
            let _ = writeln!(out, "{}", cells.join("|"));
        }
    }
    Ok(out)
}
