//! Shared fixtures: a store in a temp home, hostile values written with raw
//! SQL, and the "DB unchanged" dump.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use proptest::prelude::*;
use retinue_config::DelegationConfig;
use retinue_core::ManualClock;
use retinue_store::{Store, StoreOptions};
use rusqlite::types::Value as Sql;

pub(crate) const T0: f64 = 1_800_000_000.0;

/// A 10 MB string.
pub(crate) fn huge() -> String {
    let mut s = String::with_capacity(10 * 1024 * 1024);
    while s.len() < 10 * 1024 * 1024 {
        s.push_str("[{\"subagent_id\": \"sa-0-00000000\", \"goal\": \"ab\u{e9}\u{1f600}\"}, ");
    }
    s
}

/// A value to store in a column, as hermes (or an attacker) might.
#[derive(Debug, Clone)]
pub(crate) enum Hostile {
    Null,
    Int(i64),
    Real(f64),
    Text(String),
    Blob(Vec<u8>),
    /// TEXT whose bytes are not UTF-8 (stored with `CAST(? AS TEXT)`).
    BadText(Vec<u8>),
}

impl Hostile {
    /// `(sql expression, parameter)` writing this value.
    pub(crate) fn bind(&self) -> (&'static str, Sql) {
        match self {
            Hostile::Null => ("?1", Sql::Null),
            Hostile::Int(i) => ("?1", Sql::Integer(*i)),
            Hostile::Real(f) => ("?1", Sql::Real(*f)),
            Hostile::Text(s) => ("?1", Sql::Text(s.clone())),
            Hostile::Blob(b) => ("?1", Sql::Blob(b.clone())),
            Hostile::BadText(b) => ("CAST(?1 AS TEXT)", Sql::Blob(b.clone())),
        }
    }

    /// The text a tolerant reader sees (`None` for non-text or non-UTF-8).
    pub(crate) fn as_text(&self) -> Option<&str> {
        match self {
            Hostile::Text(s) => Some(s),
            _ => None,
        }
    }
}

/// JSON-ish and SQL-ish texts an attacker would try.
pub(crate) const NASTY_TEXTS: &[&str] = &[
    "",
    " ",
    "{bad",
    "[1,null]",
    "{}",
    "[]",
    "null",
    "[{\"subagent_id\": 5, \"session_id\": [1], \"goal\": {\"x\": 1}}]",
    "[{\"subagent_id\": \"sa-0-aaaaaaaa\", \"session_id\": \"s\\u0000x\"}]",
    "[{\"subagent_id\": \"x\u{0}y\", \"session_id\": \"child-sess-1\"}]",
    "'; DROP TABLE async_delegations; --",
    "\") OR 1=1 --",
    "[{\"session_id\": \"' OR '1'='1\"}]",
    "{\"cost_usd\": \"NaN\", \"tokens\": {\"input\": \"1e999\", \"output\": -5}}",
    "{\"cost_usd\": 1e308, \"tokens\": {\"input\": 1e308}}",
    "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]",
    "\u{feff}[]",
    "\u{0}",
];

fn json_leaf() -> impl Strategy<Value = serde_json::Value> {
    prop_oneof![
        Just(serde_json::Value::Null),
        any::<bool>().prop_map(serde_json::Value::from),
        any::<i64>().prop_map(serde_json::Value::from),
        any::<f64>().prop_map(serde_json::Value::from),
        ".{0,12}".prop_map(serde_json::Value::from),
        prop::sample::select(vec![
            "goal",
            "tasks",
            "follow_up",
            "sa-0-abc12345",
            "child-sess-1",
            "x\u{0}y",
            "' OR 1=1",
            "_branched_from",
            "_delegate_from",
            "",
            "  ",
        ])
        .prop_map(serde_json::Value::from),
    ]
}

/// Arbitrary JSON with the keys the readers look for.
pub(crate) fn json_value() -> impl Strategy<Value = serde_json::Value> {
    let keys = prop::sample::select(vec![
        "goal",
        "context",
        "tasks",
        "role",
        "background",
        "follow_up",
        "subagent_id",
        "session_id",
        "model",
        "provider",
        "toolsets",
        "cost_usd",
        "tokens",
        "input",
        "output",
        "_branched_from",
        "_delegate_from",
        "x",
    ]);
    json_leaf().prop_recursive(4, 48, 6, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
            prop::collection::vec((keys.clone(), inner), 0..6).prop_map(|kv| {
                serde_json::Value::Object(kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect())
            }),
        ]
    })
}

/// Any hostile column value (sizes kept small; 10 MB has its own tests).
pub(crate) fn hostile() -> impl Strategy<Value = Hostile> {
    prop_oneof![
        Just(Hostile::Null),
        any::<i64>().prop_map(Hostile::Int),
        any::<f64>().prop_map(Hostile::Real),
        prop::sample::select(NASTY_TEXTS).prop_map(|s| Hostile::Text(s.to_owned())),
        any::<String>().prop_map(Hostile::Text),
        json_value().prop_map(|v| Hostile::Text(v.to_string())),
        prop::collection::vec(any::<u8>(), 0..48).prop_map(Hostile::Blob),
        prop::collection::vec(any::<u8>(), 0..48).prop_map(|mut b| {
            b.push(0xff);
            Hostile::BadText(b)
        }),
    ]
}

/// A store in a temp home with a manual clock.
pub(crate) struct Fx {
    pub(crate) dir: tempfile::TempDir,
    pub(crate) clock: Arc<ManualClock>,
    pub(crate) store: Arc<Store>,
}

impl Fx {
    pub(crate) fn new() -> Fx {
        let dir = tempfile::tempdir().expect("tempdir");
        let clock = Arc::new(ManualClock::new(T0));
        let store = Arc::new(open(&dir.path().join("state.db"), &clock).expect("open"));
        Fx { dir, clock, store }
    }

    pub(crate) fn db(&self) -> PathBuf {
        self.dir.path().join("state.db")
    }

    pub(crate) fn raw(&self) -> rusqlite::Connection {
        let conn = rusqlite::Connection::open(self.db()).expect("raw open");
        conn.execute_batch("PRAGMA busy_timeout = 10000; PRAGMA foreign_keys = OFF;")
            .expect("raw pragmas");
        conn
    }

    pub(crate) fn dump(&self) -> String {
        dump(&self.db())
    }

    /// Writes `value` into `table.column` of the rows matching `filter`;
    /// `false` when a constraint refuses it (e.g. NULL in a NOT NULL column).
    pub(crate) fn poke(&self, table: &str, column: &str, filter: &str, value: &Hostile) -> bool {
        let (expr, param) = value.bind();
        let sql = format!("UPDATE {table} SET {column} = {expr} WHERE {filter}");
        match self.raw().execute(&sql, [param]) {
            Ok(n) => {
                assert!(n > 0, "poke matched nothing: {sql}");
                true
            }
            Err(e) if e.sqlite_error_code() == Some(rusqlite::ErrorCode::ConstraintViolation) => {
                false
            }
            Err(e) => panic!("poke {sql}: {e}"),
        }
    }

    pub(crate) fn reopen(&self) -> retinue_core::Result<Store> {
        open(&self.db(), &self.clock)
    }
}

pub(crate) fn open(path: &Path, clock: &Arc<ManualClock>) -> retinue_core::Result<Store> {
    let opts = StoreOptions::default()
        .with_clock(clock.clone())
        .with_retention(DelegationConfig::default().retention());
    Store::open(path, opts)
}

pub(crate) fn dump(path: &Path) -> String {
    retinue_torture::dump::dump(path).expect("dump")
}

/// Runs `op`; if it returns an error, the database must be unchanged.
pub(crate) fn refused_means_unchanged<T: std::fmt::Debug>(
    fx: &Fx,
    what: &str,
    op: impl FnOnce() -> retinue_core::Result<T>,
) -> Option<T> {
    let before = fx.dump();
    match op() {
        Ok(v) => Some(v),
        Err(e) => {
            assert_eq!(before, fx.dump(), "{what} failed ({e}) and changed the database");
            None
        }
    }
}
