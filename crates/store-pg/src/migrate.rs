//! `retinue migrate --to postgres://…`: copies a hermes `state.db`'s
//! registry, sessions, transcripts and ledger into PostgreSQL.
//!
//! The SQLite file is opened read-only (hermes keeps using it). Rows are
//! copied by primary key with `ON CONFLICT DO NOTHING`, so a rerun copies
//! only what is new; then every source key is checked in the target (same
//! key, same owner row) and the ledger totals are compared. A column the
//! file lacks (older hermes) copies as NULL. This is the one place outside
//! `retinue-store` that reads SQLite, and it only reads.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use postgres::types::ToSql;
use retinue_store::{Error, Result};
use rusqlite::types::ValueRef;

use crate::pool::{Fail, Mode, PgResult, Tx};
use crate::store::PgStore;

/// A column's type in PostgreSQL.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ty {
    Text,
    Float,
    Int,
    Bytes,
}

/// One copied table: its columns and how many leading ones form the key.
struct Table {
    name: &'static str,
    cols: &'static [(&'static str, Ty)],
    key: usize,
}

use Ty::{Bytes, Float, Int, Text};

const TABLES: &[Table] = &[
    Table {
        name: "sessions",
        cols: &[
            ("id", Text),
            ("source", Text),
            ("model", Text),
            ("model_config", Text),
            ("started_at", Float),
            ("ended_at", Float),
            ("end_reason", Text),
            ("message_count", Int),
            ("tool_call_count", Int),
            ("profile_name", Text),
            ("estimated_cost_usd", Float),
            ("cost_status", Text),
            ("cost_source", Text),
            ("system_prompt", Text),
        ],
        key: 1,
    },
    Table {
        name: "messages",
        cols: &[
            ("id", Int),
            ("session_id", Text),
            ("role", Text),
            ("content", Bytes),
            ("timestamp", Float),
            ("active", Int),
            ("tool_call_id", Text),
            ("tool_calls", Text),
            ("tool_name", Text),
            ("token_count", Int),
            ("finish_reason", Text),
        ],
        key: 2,
    },
    Table {
        name: "async_delegations",
        cols: &[
            ("delegation_id", Text),
            ("origin_session", Text),
            ("origin_ui_session_id", Text),
            ("parent_session_id", Text),
            ("state", Text),
            ("dispatched_at", Float),
            ("completed_at", Float),
            ("updated_at", Float),
            ("event_json", Text),
            ("result_json", Text),
            ("delivery_state", Text),
            ("delivery_attempts", Int),
            ("delivered_at", Float),
            ("owner_pid", Int),
            ("owner_started_at", Int),
            ("task_json", Text),
            ("delivery_claim", Text),
            ("delivery_claimed_at", Float),
            ("origin_session_id", Text),
            ("child_session_id", Text),
            ("children_json", Text),
            ("retained", Int),
            ("retained_at", Float),
            ("tombstoned_at", Float),
            ("owner_profile", Text),
            ("usage_json", Text),
        ],
        key: 1,
    },
    Table {
        name: "retinue_children",
        cols: &[
            ("delegation_id", Text),
            ("child_index", Int),
            ("subagent_id", Text),
            ("child_session_id", Text),
            ("model", Text),
            ("provider", Text),
            ("goal", Text),
            ("manifest_json", Text),
            ("retained_at", Float),
            ("tombstoned_at", Float),
            ("tombstone_reason", Text),
            ("resume_claim", Text),
            ("resume_claimed_at", Float),
            ("tombstone_note", Text),
        ],
        key: 2,
    },
    Table {
        name: "delegation_child_usage",
        cols: &[
            ("id", Int),
            ("parent_session_id", Text),
            ("parent_turn_id", Text),
            ("child_session_id", Text),
            ("usage_json", Text),
            ("aggregate_json", Text),
            ("created_at", Float),
        ],
        key: 2,
    },
    Table {
        name: "retinue_usage_keys",
        cols: &[("attribution_key", Text), ("usage_id", Int), ("created_at", Float)],
        key: 1,
    },
    Table {
        name: "retinue_usage_totals",
        cols: &[
            ("parent_session_id", Text),
            ("cost_usd", Float),
            ("input_tokens", Float),
            ("output_tokens", Float),
            ("covered_id", Int),
        ],
        key: 1,
    },
];

/// What one migration copied and verified.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MigrationReport {
    /// Per table: (rows in the source, rows newly copied).
    pub tables: BTreeMap<String, (usize, usize)>,
    /// Session parent links dropped because the parent row does not exist.
    pub dangling_parents: usize,
    /// Sum of the ledger's maintained cost totals (source = target, verified).
    pub ledger_cost_usd: f64,
    /// The source's host-path profile key (hermes's: the canonical path of
    /// the state.db's home) whose units were re-keyed to this store's
    /// explicit profile, and how many units carried it (`None`: no re-key,
    /// this store has no profile).
    pub rekeyed: Option<(String, usize)>,
}

/// A value in transit, already in its PostgreSQL type.
#[derive(Debug)]
enum Val {
    Text(Option<String>),
    Float(Option<f64>),
    Int(Option<i64>),
    Bytes(Option<Vec<u8>>),
}

impl Val {
    fn sql(&self) -> &(dyn ToSql + Sync) {
        match self {
            Val::Text(v) => v,
            Val::Float(v) => v,
            Val::Int(v) => v,
            Val::Bytes(v) => v,
        }
    }

    fn key_text(&self) -> String {
        match self {
            Val::Text(v) => v.clone().unwrap_or_default(),
            Val::Float(v) => v.map(|f| f.to_string()).unwrap_or_default(),
            Val::Int(v) => v.map(|i| i.to_string()).unwrap_or_default(),
            Val::Bytes(_) => String::new(),
        }
    }
}

/// Converts a SQLite value to the column's PostgreSQL type (SQLite is
/// loosely typed: numbers may sit in text columns and the reverse).
fn convert(v: ValueRef<'_>, ty: Ty) -> Val {
    let text = |b: &[u8]| String::from_utf8_lossy(b).replace('\0', "");
    match (ty, v) {
        (Ty::Text, ValueRef::Null) => Val::Text(None),
        (Ty::Text, ValueRef::Integer(i)) => Val::Text(Some(i.to_string())),
        (Ty::Text, ValueRef::Real(f)) => Val::Text(Some(f.to_string())),
        (Ty::Text, ValueRef::Text(b) | ValueRef::Blob(b)) => Val::Text(Some(text(b))),
        (Ty::Float, ValueRef::Integer(i)) => Val::Float(Some(i as f64)),
        (Ty::Float, ValueRef::Real(f)) => Val::Float(Some(f)),
        (Ty::Float, ValueRef::Text(b)) => Val::Float(text(b).trim().parse().ok()),
        (Ty::Float, _) => Val::Float(None),
        (Ty::Int, ValueRef::Integer(i)) => Val::Int(Some(i)),
        #[allow(clippy::cast_possible_truncation)]
        (Ty::Int, ValueRef::Real(f)) => Val::Int(f.is_finite().then_some(f as i64)),
        (Ty::Int, ValueRef::Text(b)) => Val::Int(text(b).trim().parse().ok()),
        (Ty::Int, _) => Val::Int(None),
        (Ty::Bytes, ValueRef::Null) => Val::Bytes(None),
        (Ty::Bytes, ValueRef::Integer(i)) => Val::Bytes(Some(i.to_string().into_bytes())),
        (Ty::Bytes, ValueRef::Real(f)) => Val::Bytes(Some(f.to_string().into_bytes())),
        (Ty::Bytes, ValueRef::Text(b) | ValueRef::Blob(b)) => Val::Bytes(Some(b.to_vec())),
    }
}

fn sqlite_err(operation: &'static str) -> impl Fn(rusqlite::Error) -> Error {
    move |e| Error::Database { operation, source: Box::new(e) }
}

/// Reads every row of `table` (columns the file lacks read as NULL), in key order.
fn read_table(conn: &rusqlite::Connection, table: &Table) -> Result<Vec<Vec<Val>>> {
    let exists: bool = conn
        .query_row(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?1)",
            [table.name],
            |r| r.get(0),
        )
        .map_err(sqlite_err("reading the source schema"))?;
    if !exists {
        return Ok(Vec::new());
    }
    let present: BTreeSet<String> = {
        let mut stmt = conn
            .prepare("SELECT name FROM pragma_table_info(?1)")
            .map_err(sqlite_err("reading the source schema"))?;
        stmt.query_map([table.name], |r| r.get::<_, String>(0))
            .map_err(sqlite_err("reading the source schema"))?
            .collect::<rusqlite::Result<_>>()
            .map_err(sqlite_err("reading the source schema"))?
    };
    // Column names come from the fixed list above, never from input.
    let select: Vec<String> = table
        .cols
        .iter()
        .map(|(c, _)| if present.contains(*c) { format!("\"{c}\"") } else { "NULL".to_owned() })
        .collect();
    let order: Vec<String> = (1..=table.key).map(|i| i.to_string()).collect();
    let sql =
        format!("SELECT {} FROM {} ORDER BY {}", select.join(", "), table.name, order.join(", "));
    let mut stmt = conn.prepare(&sql).map_err(sqlite_err("reading the source"))?;
    let mut rows = stmt.query([]).map_err(sqlite_err("reading the source"))?;
    let mut out = Vec::new();
    while let Some(r) = rows.next().map_err(sqlite_err("reading the source"))? {
        let mut row = Vec::with_capacity(table.cols.len());
        for (i, (_, ty)) in table.cols.iter().enumerate() {
            row.push(convert(r.get_ref(i).map_err(sqlite_err("reading the source"))?, *ty));
        }
        out.push(row);
    }
    Ok(out)
}

/// The PostgreSQL type a [`Ty`] binds as.
fn pg_type(ty: Ty) -> &'static str {
    match ty {
        Ty::Text => "text",
        Ty::Float => "float8",
        Ty::Int => "bigint",
        Ty::Bytes => "bytea",
    }
}

/// Copies `table`'s rows; returns how many were new. A NULL where the target
/// column is `NOT NULL` with a default (hermes leaves `origin_session_id`
/// and others NULL; this schema says `NOT NULL DEFAULT ''`) takes that
/// default; a NULL where a value is required is refused, naming the row.
fn copy_rows(tx: &mut Tx<'_>, table: &Table, rows: &[Vec<Val>]) -> PgResult<usize> {
    // The target's defaults of its NOT NULL columns (catalog text of our own schema).
    let defaults: BTreeMap<String, String> = tx
        .query(
            "SELECT column_name::text, column_default::text FROM information_schema.columns \
             WHERE table_schema = current_schema() AND table_name = $1 \
             AND is_nullable = 'NO' AND column_default IS NOT NULL",
            &[&table.name],
        )?
        .iter()
        .map(|r| Ok((r.try_get(0)?, r.try_get(1)?)))
        .collect::<PgResult<_>>()?;
    let names: Vec<&str> = table.cols.iter().map(|(c, _)| *c).collect();
    let marks: Vec<String> = table
        .cols
        .iter()
        .enumerate()
        .map(|(i, (c, ty))| match defaults.get(*c) {
            Some(default) => format!("COALESCE(${}::{}, {default})", i + 1, pg_type(*ty)),
            None => format!("${}::{}", i + 1, pg_type(*ty)),
        })
        .collect();
    let sql = format!(
        "INSERT INTO {} ({}) VALUES ({}) ON CONFLICT DO NOTHING",
        table.name,
        names.join(", "),
        marks.join(", ")
    );
    let stmt = tx.prepare(&sql)?;
    let mut n = 0;
    for row in rows {
        let params: Vec<&(dyn ToSql + Sync)> = row.iter().map(Val::sql).collect();
        n += match tx.execute(&stmt, &params) {
            Ok(n) => n,
            Err(Fail::Pg(e))
                if e.code() == Some(&postgres::error::SqlState::NOT_NULL_VIOLATION) =>
            {
                let column = e.as_db_error().and_then(|d| d.column()).unwrap_or("?").to_owned();
                return Err(Fail::Store(Error::Invalid(format!(
                    "cannot copy {} row `{}`: its `{column}` is NULL (or unreadable) in the \
                     state.db, and PostgreSQL requires a value; nothing was copied",
                    table.name,
                    row.first().map(Val::key_text).unwrap_or_default()
                ))));
            }
            Err(e) => return Err(e),
        };
    }
    Ok(usize::try_from(n).unwrap_or(usize::MAX))
}

/// Every source key must be in the target, owned by the same row (for
/// tables keyed by an id: the same second column).
fn verify(tx: &mut Tx<'_>, table: &Table, rows: &[Vec<Val>]) -> PgResult<()> {
    let a = table.cols[0].0;
    let sql = if table.key == 2 {
        let b = table.cols[1].0;
        format!("SELECT count(*) FROM {} WHERE {a}::text = $1 AND {b}::text = $2", table.name)
    } else {
        format!("SELECT count(*) FROM {} WHERE {a}::text = $1", table.name)
    };
    let stmt = tx.prepare(&sql)?;
    for row in rows {
        let k1 = row[0].key_text();
        let found: i64 = if table.key == 2 {
            tx.query_one(&stmt, &[&k1, &row[1].key_text()])?.try_get(0)?
        } else {
            tx.query_one(&stmt, &[&k1])?.try_get(0)?
        };
        if found != 1 {
            return Err(Fail::Store(Error::Invalid(format!(
                "verification failed: {} row `{k1}` is missing or belongs to another row in the \
                 target (ids already used by another source?)",
                table.name
            ))));
        }
    }
    Ok(())
}

impl PgStore {
    /// Copies the `state.db` at `source` into this database (idempotent) and
    /// verifies the result; see the module documentation.
    pub fn import_state_db(&self, source: &Path) -> Result<MigrationReport> {
        let conn = rusqlite::Connection::open_with_flags(
            source,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .map_err(sqlite_err("opening the source state.db"))?;
        conn.busy_timeout(std::time::Duration::from_secs(10))
            .map_err(sqlite_err("opening the source state.db"))?;
        // One read snapshot of the whole file.
        conn.execute_batch("BEGIN").map_err(sqlite_err("reading the source"))?;
        let data: Vec<Vec<Vec<Val>>> =
            TABLES.iter().map(|t| read_table(&conn, t)).collect::<Result<_>>()?;
        let parents: Vec<(String, String)> = {
            let mut stmt = conn
                .prepare(
                    "SELECT id, parent_session_id FROM sessions WHERE parent_session_id IS NOT NULL",
                )
                .map_err(sqlite_err("reading the source"))?;
            stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
                .map_err(sqlite_err("reading the source"))?
                .collect::<rusqlite::Result<_>>()
                .map_err(sqlite_err("reading the source"))?
        };
        // Units keyed by the source home's path (hermes's profile key) join
        // this store's explicit tenant: in team mode a profile is never a
        // host's path. Other profiles (and the empty one) copy as they are.
        let mut data = data;
        let rekeyed = TABLES
            .iter()
            .position(|t| t.name == "async_delegations")
            .and_then(|i| self.rekey_home_profile(source, &TABLES[i], &mut data[i]));
        let source_totals: f64 = data[6]
            .iter()
            .map(|r| match r[1] {
                Val::Float(Some(f)) => f,
                _ => 0.0,
            })
            .sum();
        let mut tables = BTreeMap::new();
        let lim = self.limits();
        let dangling_parents = self.pool.tx("copying a state.db", Mode::Write, |tx| {
            tables.clear();
            for (table, rows) in TABLES.iter().zip(&data) {
                let copied = copy_rows(tx, table, rows)?;
                tables.insert(table.name.to_owned(), (rows.len(), copied));
            }
            // Parent links after every session exists; a parent that does not is not linked.
            let mut dangling = 0;
            for (id, parent) in &parents {
                let n = tx.execute(
                    "UPDATE sessions SET parent_session_id = $2 WHERE id = $1 \
                     AND parent_session_id IS NULL AND EXISTS (SELECT 1 FROM sessions WHERE id = $2)",
                    &[id, parent],
                )?;
                let linked = tx
                    .query_opt(
                        "SELECT 1 FROM sessions WHERE id = $1 AND parent_session_id = $2",
                        &[id, parent],
                    )?
                    .is_some();
                if n == 0 && !linked {
                    dangling += 1;
                }
            }
            for seq in ["messages", "delegation_child_usage"] {
                tx.execute(
                    &format!(
                        "SELECT setval(pg_get_serial_sequence('{seq}', 'id'), \
                         GREATEST((SELECT COALESCE(MAX(id), 0) FROM {seq}), 1))"
                    ),
                    &[],
                )?;
            }
            for (table, rows) in TABLES.iter().zip(&data) {
                verify(tx, table, rows)?;
            }
            // Adopt and prune what was copied, as any write of this backend
            // leaves it (child rows for retained units; no live unit without
            // a live child; the per-profile live counts exact).
            crate::registry::adopt_and_prune(tx, lim, &self.profile)?;
            Ok(dangling)
        })?;
        // Ledger totals: the target's totals of the source's parents equal the source's.
        let parents_of_totals: Vec<String> = data[6].iter().map(|r| r[0].key_text()).collect();
        let target_totals: f64 = self.pool.tx("verifying ledger totals", Mode::Read, |tx| {
            Ok(tx
                .query_one(
                    "SELECT COALESCE(SUM(cost_usd), 0)::float8 FROM retinue_usage_totals \
                     WHERE parent_session_id = ANY($1)",
                    &[&parents_of_totals],
                )?
                .try_get(0)?)
        })?;
        if (target_totals - source_totals).abs() > 1e-6 * source_totals.abs().max(1.0) {
            return Err(Error::Invalid(format!(
                "verification failed: ledger totals differ (source {source_totals}, target \
                 {target_totals})"
            )));
        }
        Ok(MigrationReport { tables, dangling_parents, ledger_cost_usd: source_totals, rekeyed })
    }

    /// Re-keys the `async_delegations` rows of `units` whose `owner_profile`
    /// is the profile key of `source`'s home to this store's profile.
    fn rekey_home_profile(
        &self,
        source: &Path,
        table: &Table,
        units: &mut [Vec<Val>],
    ) -> Option<(String, usize)> {
        if self.profile.trim().is_empty() {
            return None;
        }
        let home = source.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        let from = retinue_store::default_profile_key(home);
        let col = table.cols.iter().position(|(c, _)| *c == "owner_profile")?;
        let mut n = 0;
        for row in units.iter_mut() {
            if let Some(Val::Text(Some(p))) = row.get_mut(col)
                && *p == from
            {
                p.clone_from(&self.profile);
                n += 1;
            }
        }
        Some((from, n))
    }
}
