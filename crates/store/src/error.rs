//! The store's one error enum.

use std::path::PathBuf;

/// Everything that can go wrong in the store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The file exists but is not a SQLite database; it was left untouched.
    #[error("{path} is not a SQLite database (left unmodified)")]
    NotADatabase {
        /// The refused file.
        path: PathBuf,
    },
    /// The database is corrupt or truncated.
    #[error("database is corrupt or truncated")]
    Corrupt(#[source] rusqlite::Error),
    /// The schema history holds migrations this binary does not know.
    #[error("database schema version {found} is newer than this binary supports ({supported})")]
    SchemaTooNew {
        /// Highest applied version in the file.
        found: i64,
        /// Highest version this binary embeds.
        supported: i64,
    },
    /// A write could not take the lock within the busy timeout.
    #[error("database is busy (another writer held the lock past the busy timeout)")]
    Busy(#[source] rusqlite::Error),
    /// The database or its directory is read-only.
    #[error("database is read-only")]
    ReadOnly(#[source] rusqlite::Error),
    /// The disk is full.
    #[error("disk is full")]
    DiskFull(#[source] rusqlite::Error),
    /// A constraint was violated (duplicate id and the like).
    #[error("write conflicts with existing data")]
    Conflict(#[source] rusqlite::Error),
    /// A migration failed; nothing of it was applied.
    #[error("schema migration failed")]
    Migration(#[source] refinery::Error),
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
    /// Any other SQLite error.
    #[error("sqlite error")]
    Sqlite(#[source] rusqlite::Error),
}

impl From<rusqlite::Error> for Error {
    fn from(e: rusqlite::Error) -> Self {
        use rusqlite::ErrorCode;
        match e.sqlite_error_code() {
            Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => Error::Busy(e),
            Some(ErrorCode::ConstraintViolation) => Error::Conflict(e),
            Some(ErrorCode::NotADatabase | ErrorCode::DatabaseCorrupt) => Error::Corrupt(e),
            Some(ErrorCode::ReadOnly) => Error::ReadOnly(e),
            Some(ErrorCode::DiskFull) => Error::DiskFull(e),
            _ => Error::Sqlite(e),
        }
    }
}

impl From<refinery::Error> for Error {
    fn from(e: refinery::Error) -> Self {
        Error::Migration(e)
    }
}

impl Error {
    /// Whether retrying the operation later may succeed.
    pub fn is_busy(&self) -> bool {
        matches!(self, Error::Busy(_))
    }
}

/// The store's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
