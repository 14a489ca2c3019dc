//! The registry's one error enum, shared by every backend.
//!
//! Every variant that wraps a database error says which operation failed
//! (`operation`) and keeps the underlying error as an opaque `#[source]`;
//! each backend classifies its engine's errors by *code* (SQLite's result
//! codes, PostgreSQL's SQLSTATE), never by message text. No engine type is
//! part of this API.

use std::path::PathBuf;

/// The opaque underlying cause of a storage error (its `Display` and
/// `source()` chain are kept; its type is not part of the API).
pub type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in a registry backend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// There is no database file at this path (nothing was created).
    #[error("no state.db at {path}")]
    Missing {
        /// The missing file.
        path: PathBuf,
    },
    /// The path names something that is not a regular file (a directory,
    /// FIFO, socket or device); it was not opened.
    #[error("{path} is a {what}, not a database file")]
    NotAFile {
        /// The path.
        path: PathBuf,
        /// What it is: `directory`, `FIFO`, `socket`, `character device`, …
        what: &'static str,
    },
    /// A SQLite file that is neither hermes' (no `sessions` table) nor
    /// Retinue's (no `retinue_*` tables); it was left untouched.
    #[error(
        "{path} is a SQLite database but not a hermes or Retinue state.db \
         (no sessions table, no retinue tables); left unmodified"
    )]
    Foreign {
        /// The refused file.
        path: PathBuf,
    },
    /// The file exists but is not a SQLite database; it was left untouched.
    #[error("{path} is not a SQLite database (left unmodified)")]
    NotADatabase {
        /// The refused file.
        path: PathBuf,
    },
    /// The database is corrupt or truncated.
    #[error("database is corrupt or truncated")]
    Corrupt {
        /// What the store was doing.
        operation: &'static str,
        /// The underlying error.
        #[source]
        source: Source,
    },
    /// One row could not be read where the read cannot go on without it
    /// (e.g. a `sessions` row with an unreadable id met by a lineage walk:
    /// authority fails closed instead of guessing). The file is not changed.
    #[error(
        "malformed row: {table} rowid {rowid} has an unreadable {column} (not UTF-8 text); \
         the read cannot go on safely without it"
    )]
    MalformedRow {
        /// The table.
        table: &'static str,
        /// The row's `rowid`.
        rowid: i64,
        /// The unreadable column.
        column: &'static str,
    },
    /// The schema history holds migrations this binary does not know.
    #[error("database schema version {found} is newer than this binary supports ({supported})")]
    SchemaTooNew {
        /// Highest applied version in the file.
        found: i64,
        /// Highest version this binary embeds.
        supported: i64,
    },
    /// A write could not take the lock within the busy timeout (SQLite), or
    /// kept conflicting with concurrent transactions (PostgreSQL: no busy
    /// timeout, `timeout_ms` 0).
    #[error("{}", busy_message(*waited_ms, *timeout_ms))]
    Busy {
        /// What the store was doing.
        operation: &'static str,
        /// How long the operation actually waited, in milliseconds.
        waited_ms: u64,
        /// The configured busy timeout, in milliseconds.
        timeout_ms: u64,
        /// The underlying error.
        #[source]
        source: Source,
    },
    /// The database or its directory is read-only.
    #[error("database is read-only")]
    ReadOnly {
        /// What the store was doing.
        operation: &'static str,
        /// The underlying error.
        #[source]
        source: Source,
    },
    /// The disk is full.
    #[error("disk is full")]
    DiskFull {
        /// What the store was doing.
        operation: &'static str,
        /// The underlying error.
        #[source]
        source: Source,
    },
    /// A constraint was violated (duplicate id and the like).
    #[error("write conflicts with existing data while {operation}")]
    Conflict {
        /// What the store was doing.
        operation: &'static str,
        /// The underlying error.
        #[source]
        source: Source,
    },
    /// A migration failed; nothing of it was applied.
    #[error("schema migration failed")]
    Migration {
        /// The underlying error.
        #[source]
        source: Source,
    },
    /// The state directory could not be created or read.
    #[error("cannot prepare state directory {path}")]
    Io {
        /// The directory or file involved.
        path: PathBuf,
        /// The underlying IO error.
        #[source]
        source: std::io::Error,
    },
    /// A caller passed an invalid argument.
    #[error("invalid input: {0}")]
    Invalid(String),
    /// A referenced row does not exist.
    #[error("{what} `{id}` not found")]
    NotFound {
        /// The kind of row.
        what: &'static str,
        /// The id looked up.
        id: String,
    },
    /// A compare-and-swap found the value changed since it was read.
    #[error("{what} changed since it was read; re-read and retry")]
    Stale {
        /// What changed.
        what: &'static str,
    },
    /// The secure random source failed.
    #[error("secure random source failed: {0}")]
    Random(String),
    /// Any other database error.
    #[error("database error while {operation}")]
    Database {
        /// What the store was doing.
        operation: &'static str,
        /// The underlying error.
        #[source]
        source: Source,
    },
}

fn busy_message(waited_ms: u64, timeout_ms: u64) -> String {
    let waited = waited_ms as f64 / 1000.0;
    if timeout_ms == 0 {
        format!("database is busy: waited {waited:.1} s retrying transactions that conflicted")
    } else {
        let timeout = timeout_ms as f64 / 1000.0;
        format!(
            "database is busy: waited {waited:.1} s for another writer's lock (busy timeout \
             {timeout:.1} s)"
        )
    }
}

/// The class of an [`Error`], for callers that branch on it (exit codes,
/// retries) without matching every variant's fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Not a SQLite database, or not a hermes/Retinue one.
    NotADatabase,
    /// No database file at the path.
    Missing,
    /// The path is a directory, FIFO, socket or device.
    NotAFile,
    /// Corrupt or truncated.
    Corrupt,
    /// One row is unreadable where a read must fail.
    MalformedRow,
    /// Written by a newer binary.
    SchemaTooNew,
    /// The lock was held past the busy timeout.
    Busy,
    /// Read-only file or directory.
    ReadOnly,
    /// Disk full.
    DiskFull,
    /// A constraint was violated.
    Conflict,
    /// A migration failed.
    Migration,
    /// File-system error.
    Io,
    /// Invalid argument.
    Invalid,
    /// Missing row.
    NotFound,
    /// Lost compare-and-swap.
    Stale,
    /// Random source failure.
    Random,
    /// Any other database error.
    Other,
}

impl Error {
    /// The class of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::NotADatabase { .. } | Error::Foreign { .. } => ErrorKind::NotADatabase,
            Error::Missing { .. } => ErrorKind::Missing,
            Error::NotAFile { .. } => ErrorKind::NotAFile,
            Error::Corrupt { .. } => ErrorKind::Corrupt,
            Error::MalformedRow { .. } => ErrorKind::MalformedRow,
            Error::SchemaTooNew { .. } => ErrorKind::SchemaTooNew,
            Error::Busy { .. } => ErrorKind::Busy,
            Error::ReadOnly { .. } => ErrorKind::ReadOnly,
            Error::DiskFull { .. } => ErrorKind::DiskFull,
            Error::Conflict { .. } => ErrorKind::Conflict,
            Error::Migration { .. } => ErrorKind::Migration,
            Error::Io { .. } => ErrorKind::Io,
            Error::Invalid(_) => ErrorKind::Invalid,
            Error::NotFound { .. } => ErrorKind::NotFound,
            Error::Stale { .. } => ErrorKind::Stale,
            Error::Random(_) => ErrorKind::Random,
            Error::Database { .. } => ErrorKind::Other,
        }
    }

    /// Whether retrying the operation later may succeed.
    pub fn is_busy(&self) -> bool {
        self.kind() == ErrorKind::Busy
    }

    /// The operation that failed, when the error came from the database.
    pub fn operation(&self) -> Option<&'static str> {
        match self {
            Error::Corrupt { operation, .. }
            | Error::Busy { operation, .. }
            | Error::ReadOnly { operation, .. }
            | Error::DiskFull { operation, .. }
            | Error::Conflict { operation, .. }
            | Error::Database { operation, .. } => Some(operation),
            _ => None,
        }
    }
}

/// The registry's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Declares a storage backend's crate-private `Fail`: what goes wrong inside
/// an operation before its context is attached, an engine error not yet
/// classified or an already classified [`Error`]; `?` converts both, and
/// `Fail::during(operation)` gives the public error (the engine's through
/// `$classify(operation, e)`, which reads codes, never message text). Both
/// backends declare theirs with it, so the two cannot drift.
#[doc(hidden)]
#[macro_export]
macro_rules! backend_fail {
    ($variant:ident($engine:ty), $classify:path) => {
        /// A failure inside an operation, before its context is attached.
        #[derive(Debug)]
        pub(crate) enum Fail {
            /// An engine error, not yet classified.
            $variant($engine),
            /// A domain error.
            Store($crate::Error),
        }

        impl From<$engine> for Fail {
            fn from(e: $engine) -> Self {
                Fail::$variant(e)
            }
        }

        impl From<$crate::Error> for Fail {
            fn from(e: $crate::Error) -> Self {
                Fail::Store(e)
            }
        }

        impl Fail {
            /// The public error, naming `operation` when the engine failed.
            pub(crate) fn during(self, operation: &'static str) -> $crate::Error {
                match self {
                    Fail::$variant(e) => $classify(operation, e),
                    Fail::Store(e) => e,
                }
            }
        }
    };
}

#[cfg(test)]
mod tests {
    use super::busy_message;

    #[test]
    fn busy_messages_name_the_wait_and_what_was_waited_for() {
        assert_eq!(
            busy_message(1_250, 300),
            "database is busy: waited 1.2 s for another writer's lock (busy timeout 0.3 s)"
        );
        // PostgreSQL has no busy timeout: the wait was spent retrying conflicts.
        let pg = busy_message(2_000, 0);
        assert_eq!(pg, "database is busy: waited 2.0 s retrying transactions that conflicted");
    }
}
