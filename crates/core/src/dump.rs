//! Copying a registry between backends (`retinue migrate`): the neutral
//! shape of rows in transit, so the PostgreSQL backend can import what the
//! SQLite backend reads without either crate knowing the other's engine.

use std::path::Path;

use crate::error::Result;

/// The type a column is copied as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CellType {
    /// Text (invalid UTF-8 is replaced, NUL bytes dropped).
    Text,
    /// A 64-bit float.
    Float,
    /// A 64-bit integer.
    Int,
    /// Raw bytes.
    Bytes,
}

/// One copied table: its columns and how many leading ones form its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableSpec {
    /// The table's name (hermes's, in both backends).
    pub name: &'static str,
    /// The columns, in order, with the type each is copied as.
    pub cols: &'static [(&'static str, CellType)],
    /// How many leading columns form the key (rows are read in key order).
    pub key: usize,
}

/// One value in transit, already in its column's [`CellType`]; `None` is NULL.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    /// A text value.
    Text(Option<String>),
    /// A float value.
    Float(Option<f64>),
    /// An integer value.
    Int(Option<i64>),
    /// A bytes value.
    Bytes(Option<Vec<u8>>),
}

impl Cell {
    /// The value as key text (`""` for NULL and for bytes).
    pub fn key_text(&self) -> String {
        match self {
            Cell::Text(v) => v.clone().unwrap_or_default(),
            Cell::Float(v) => v.map(|f| f.to_string()).unwrap_or_default(),
            Cell::Int(v) => v.map(|i| i.to_string()).unwrap_or_default(),
            Cell::Bytes(_) => String::new(),
        }
    }
}

/// One consistent read of a registry file.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct StateDump {
    /// Per requested table (same order): its rows in key order, each with
    /// one cell per requested column (a column the file lacks reads NULL).
    pub tables: Vec<Vec<Vec<Cell>>>,
    /// Every session's `(id, parent_session_id)` link that is set.
    pub parents: Vec<(String, String)>,
}

/// Reads a registry file for copying (implemented by the SQLite backend).
pub trait StateReader {
    /// Reads `tables` of the file at `source` in one snapshot, read-only.
    fn read_state(&self, source: &Path, tables: &[TableSpec]) -> Result<StateDump>;
}
