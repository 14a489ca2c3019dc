//! `retinue-interop`: interop tests against the published Python hermes-agent.
//!
//! Retinue and hermes-agent share one `state.db`. This crate proves it against
//! the real program, not against our idea of its schema. It holds:
//!
//! * `driver/hermes_driver.py` — a Python driver that uses hermes' own
//!   `hermes_state.SessionDB` and `tools.async_delegation`: phase `write`
//!   builds a realistic database (a root session, its compression
//!   continuations, a branch, delegate children with transcripts, background
//!   delegation units) and records hermes' own answers ([`EXPECT_FILE`]);
//!   phase `verify` reopens the file with hermes after Retinue used it.
//! * `tests/interop.rs` — the Rust side, between the two phases: the in-place
//!   upgrade keeps every row and object, the lineage rules agree with hermes,
//!   a retained child hermes wrote is followed up on its own session, and a
//!   database Retinue creates is handed to hermes. It reports what it wrote
//!   ([`REPORT_FILE`], [`FRESH_REPORT_FILE`]) for `verify`.
//! * this library — what both sides share: file names, the driver's
//!   expectations ([`HermesExpect`]), and raw-SQLite inspection helpers that
//!   look at the file from outside the store ([`table_counts`],
//!   [`schema_objects`], [`columns`], [`integrity_check`], [`snapshot`]).
//!
//! `cargo xtask interop` runs it all (and `cargo xtask ci` runs that): it
//! downloads the pinned hermes-agent wheel into `target/interop`, puts it on
//! `PYTHONPATH`, runs the driver's `write`, then
//! `cargo test -p retinue-interop --test interop -- --include-ignored` with
//! [`DB_ENV`] pointing at the database, then the driver's `verify`. Without
//! [`DB_ENV`] the tests are ignored. See `docs/interop.md`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use rusqlite::{Connection, OpenFlags};
use serde::Deserialize;
use serde_json::Value;

/// The environment variable naming the hermes-written `state.db`.
pub const DB_ENV: &str = "RETINUE_INTEROP_DB";

/// The environment variable naming a built `retinue` binary (optional).
pub const BIN_ENV: &str = "RETINUE_INTEROP_BIN";

/// The driver's expectations, written next to the database by `write`.
pub const EXPECT_FILE: &str = "hermes-expect.json";

/// What the Rust tests wrote into the shared database, for `verify`.
pub const REPORT_FILE: &str = "retinue-report.json";

/// The database Retinue created from scratch, for `verify`.
pub const FRESH_REPORT_FILE: &str = "retinue-fresh.json";

/// Errors of the inspection helpers.
#[derive(Debug, thiserror::Error)]
pub enum InteropError {
    /// A file could not be read, written or copied.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// SQLite refused a query.
    #[error("{path}: {source}")]
    Sqlite {
        /// The database.
        path: PathBuf,
        /// The cause.
        source: rusqlite::Error,
    },
    /// A JSON file could not be parsed.
    #[error("{path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: serde_json::Error,
    },
}

/// The result of the inspection helpers.
pub type InteropResult<T> = std::result::Result<T, InteropError>;

/// One message as hermes' `get_messages` returned it.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct HermesMessage {
    /// Row id.
    pub id: i64,
    /// Role.
    pub role: String,
    /// Content as hermes decodes it (string, structured list, or null).
    pub content: Value,
}

/// One child of a hermes-written delegation unit.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct HermesChild {
    /// The subagent id hermes minted (`sa-<i>-<8hex>`).
    pub subagent_id: String,
    /// The child's session.
    pub session_id: String,
    /// The task goal.
    pub goal: String,
    /// The child's model.
    pub model: String,
}

/// A delegation unit hermes wrote with its own `tools.async_delegation`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ExpectedUnit {
    /// `deleg_<8hex>`.
    pub delegation_id: String,
    /// The spawner's session.
    pub parent_session_id: String,
    /// `state` after the run.
    pub state: String,
    /// `delivery_state` after the run.
    pub delivery_state: String,
    /// The children, in task order.
    pub children: Vec<HermesChild>,
}

/// hermes' own lineage answers for one session (`None` where the hermes
/// release lacks the query).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct HermesLineage {
    /// `SessionDB.get_compression_tip`.
    pub compression_tip: Option<String>,
    /// `SessionDB.get_compression_lineage` (0.18+).
    pub compression_lineage: Option<Vec<String>>,
    /// `SessionDB.get_conversation_root` (0.19+; any parent link, for usage tagging).
    pub conversation_root: Option<String>,
    /// Names of the driver's sessions that `SessionDB._is_compression_ancestor`
    /// (0.17+) reports as compression ancestors of this one.
    pub compression_ancestors: Option<Vec<String>>,
}

/// Everything the driver's `write` phase recorded ([`EXPECT_FILE`]).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct HermesExpect {
    /// The hermes-agent version that wrote the file.
    pub hermes_version: String,
    /// hermes' `SCHEMA_VERSION`.
    pub schema_version: i64,
    /// The SQLite library version hermes ran on.
    pub sqlite_version: String,
    /// Session ids by role name (`root`, `c1`, `c2`, `branch`, `stranger`, `k1`…).
    pub sessions: BTreeMap<String, String>,
    /// Delegation units by name (`u1`, `u2`); empty for hermes releases
    /// without durable delegations (before 0.19).
    pub units: BTreeMap<String, ExpectedUnit>,
    /// hermes' lineage answers by session name.
    pub lineage: BTreeMap<String, HermesLineage>,
    /// hermes' transcripts by session name.
    pub transcripts: BTreeMap<String, Vec<HermesMessage>>,
    /// `sessions.message_count` by session name.
    pub message_counts: BTreeMap<String, i64>,
    /// Rows per table when hermes was done.
    pub row_counts: BTreeMap<String, i64>,
}

impl HermesExpect {
    /// Reads [`EXPECT_FILE`] next to `db`.
    pub fn load(db: &Path) -> InteropResult<HermesExpect> {
        let path = sibling(db, EXPECT_FILE);
        let text = std::fs::read_to_string(&path)
            .map_err(|source| InteropError::Io { path: path.clone(), source })?;
        serde_json::from_str(&text).map_err(|source| InteropError::Json { path, source })
    }

    /// The session id the driver recorded under `name`, if any.
    pub fn session(&self, name: &str) -> Option<&str> {
        self.sessions.get(name).map(String::as_str)
    }

    /// The driver's name of the session `id`, if it is one of its sessions.
    pub fn name_of(&self, id: &str) -> Option<&str> {
        self.sessions.iter().find(|(_, sid)| sid.as_str() == id).map(|(n, _)| n.as_str())
    }
}

/// `file` in the directory of `db`.
pub fn sibling(db: &Path, file: &str) -> PathBuf {
    db.parent().map_or_else(|| PathBuf::from(file), |dir| dir.join(file))
}

fn open_ro(path: &Path) -> InteropResult<Connection> {
    Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY)
        .map_err(|source| InteropError::Sqlite { path: path.to_path_buf(), source })
}

fn sql<T>(path: &Path, r: rusqlite::Result<T>) -> InteropResult<T> {
    r.map_err(|source| InteropError::Sqlite { path: path.to_path_buf(), source })
}

/// Rows per table (every table in `sqlite_master`, FTS shadow tables included).
pub fn table_counts(path: &Path) -> InteropResult<BTreeMap<String, i64>> {
    let conn = open_ro(path)?;
    let names: Vec<String> = sql(path, {
        conn.prepare(
            "SELECT name FROM sqlite_master WHERE type = 'table' \
             AND name NOT LIKE 'sqlite_%' ORDER BY name",
        )
        .and_then(|mut s| s.query_map([], |r| r.get(0))?.collect())
    })?;
    let mut counts = BTreeMap::new();
    for name in names {
        let quoted = name.replace('"', "\"\"");
        let n: i64 = sql(
            path,
            conn.query_row(&format!("SELECT count(*) FROM \"{quoted}\""), [], |r| r.get(0)),
        )?;
        counts.insert(name, n);
    }
    Ok(counts)
}

/// `sqlite_master` objects (`"<type> <name>"` → SQL text), internal ones excluded.
pub fn schema_objects(path: &Path) -> InteropResult<BTreeMap<String, String>> {
    let conn = open_ro(path)?;
    sql(path, {
        conn.prepare(
            "SELECT type || ' ' || name, COALESCE(sql, '') FROM sqlite_master \
             WHERE name NOT LIKE 'sqlite_%'",
        )
        .and_then(|mut s| s.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect())
    })
}

/// One column as `PRAGMA table_info` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Column {
    /// Name.
    pub name: String,
    /// Declared type.
    pub decl_type: String,
    /// `NOT NULL`.
    pub not_null: bool,
    /// Default expression text.
    pub default: Option<String>,
    /// Position in the primary key (0 = not part of it).
    pub pk: i64,
}

/// The columns of `table`, in order.
pub fn columns(path: &Path, table: &str) -> InteropResult<Vec<Column>> {
    let conn = open_ro(path)?;
    sql(path, {
        conn.prepare("SELECT name, type, \"notnull\", dflt_value, pk FROM pragma_table_info(?1)")
            .and_then(|mut s| {
                s.query_map([table], |r| {
                    Ok(Column {
                        name: r.get(0)?,
                        decl_type: r.get(1)?,
                        not_null: r.get::<_, i64>(2)? != 0,
                        default: r.get(3)?,
                        pk: r.get(4)?,
                    })
                })?
                .collect()
            })
    })
}

/// The lines of `PRAGMA integrity_check` (`["ok"]` when healthy).
pub fn integrity_check(path: &Path) -> InteropResult<Vec<String>> {
    let conn = open_ro(path)?;
    sql(path, {
        conn.prepare("PRAGMA integrity_check")
            .and_then(|mut s| s.query_map([], |r| r.get(0))?.collect())
    })
}

/// One integer from `query` (for spot checks such as `schema_version`).
pub fn query_i64(path: &Path, query: &str) -> InteropResult<i64> {
    let conn = open_ro(path)?;
    sql(path, conn.query_row(query, [], |r| r.get(0)))
}

/// One text from `query` (for spot checks such as `PRAGMA journal_mode`).
pub fn query_text(path: &Path, query: &str) -> InteropResult<String> {
    let conn = open_ro(path)?;
    sql(path, conn.query_row(query, [], |r| r.get(0)))
}

/// Copies the database `db` (with its `-wal` and `-shm` files) to
/// `dir/state.db`, replacing what was there; returns the copy's path.
pub fn snapshot(db: &Path, dir: &Path) -> InteropResult<PathBuf> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| InteropError::Io { path, source }
    };
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(io(dir))?;
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let target = dir.join("state.db");
    std::fs::copy(db, &target).map_err(io(db))?;
    for suffix in ["-wal", "-shm"] {
        let from = PathBuf::from(format!("{}{suffix}", db.display()));
        if from.exists() {
            let to = PathBuf::from(format!("{}{suffix}", target.display()));
            std::fs::copy(&from, &to).map_err(io(&from))?;
        }
    }
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn helpers_read_a_plain_sqlite_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("state.db");
        let conn = Connection::open(&db).expect("open");
        conn.execute_batch(
            "CREATE TABLE t (a TEXT NOT NULL DEFAULT 'x', b INTEGER PRIMARY KEY);
             CREATE INDEX t_a ON t(a);
             INSERT INTO t (a) VALUES ('one'), ('two');",
        )
        .expect("schema");
        drop(conn);
        assert_eq!(table_counts(&db).expect("counts"), BTreeMap::from([("t".to_owned(), 2)]));
        let objects = schema_objects(&db).expect("objects");
        assert!(objects.contains_key("table t") && objects.contains_key("index t_a"));
        let cols = columns(&db, "t").expect("columns");
        assert_eq!(cols[0].default.as_deref(), Some("'x'"));
        assert!(cols[0].not_null && cols[1].pk == 1);
        assert_eq!(integrity_check(&db).expect("check"), ["ok"]);
        assert_eq!(query_i64(&db, "SELECT count(*) FROM t").expect("n"), 2);
        let copy = snapshot(&db, &dir.path().join("snap")).expect("snapshot");
        assert_eq!(table_counts(&copy).expect("counts"), table_counts(&db).expect("counts"));
        assert_eq!(sibling(&db, EXPECT_FILE), dir.path().join(EXPECT_FILE));
    }
}
