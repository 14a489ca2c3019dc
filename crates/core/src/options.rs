//! How a backend is asked to store: durability settings it honours where
//! its engine has them (SQLite's journal and `synchronous` pragmas), and
//! the tenant key a home stands for.

use std::path::Path;

/// Journal mode of the database.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum JournalMode {
    /// Write-ahead log (default).
    #[default]
    Wal,
    /// Rollback journal.
    Delete,
}

/// Durability of a commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// One fsync per commit: a committed write survives power loss (default, as hermes).
    #[default]
    Full,
    /// WAL's faster mode: durable across process crashes; a power loss may roll back
    /// the last commits but never corrupts.
    Normal,
}

/// The default profile key: the canonical absolute path of the home, as hermes uses.
pub fn default_profile_key(home: &Path) -> String {
    std::fs::canonicalize(home)
        .unwrap_or_else(|_| std::path::absolute(home).unwrap_or_else(|_| home.to_path_buf()))
        .to_string_lossy()
        .into_owned()
}
