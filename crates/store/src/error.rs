//! The store's one error enum, and the crate-private bridge from SQLite
//! errors to it.
//!
//! Every variant that wraps a database error says which operation failed
//! (`operation`), keeps the underlying error as an opaque `#[source]`, and is
//! chosen by the SQLite *error code*, never by message text. No rusqlite or
//! refinery type is part of this module's public API.

use std::path::PathBuf;

/// The opaque underlying cause of a storage error (its `Display` and
/// `source()` chain are kept; its type is not part of the API).
pub type Source = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Everything that can go wrong in the store.
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

#[allow(clippy::cast_precision_loss)] // milliseconds, shown to a tenth of a second
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

/// The store's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A failure inside a store operation, before the operation's context is
/// attached: a raw SQLite error, or an already classified [`Error`].
/// Crate-private, so `?` works on rusqlite results without a public
/// `From<rusqlite::Error>`.
#[derive(Debug)]
pub(crate) enum Fail {
    /// A database error, not yet classified.
    Sql(rusqlite::Error),
    /// A domain error.
    Store(Error),
}

impl From<rusqlite::Error> for Fail {
    fn from(e: rusqlite::Error) -> Self {
        Fail::Sql(e)
    }
}

impl From<Error> for Fail {
    fn from(e: Error) -> Self {
        Fail::Store(e)
    }
}

impl Fail {
    /// The public error, naming `operation` when the failure came from SQLite.
    pub(crate) fn during(self, operation: &'static str) -> Error {
        match self {
            Fail::Sql(e) => classify(operation, e),
            Fail::Store(e) => e,
        }
    }
}

/// Result of the inside of a store operation.
pub(crate) type SqlResult<T> = std::result::Result<T, Fail>;

/// `.map_err(sql("doing x"))`: classifies a SQLite error by its code.
pub(crate) fn sql(operation: &'static str) -> impl FnOnce(rusqlite::Error) -> Error {
    move |e| classify(operation, e)
}

/// Classifies by SQLite error code, never by message text.
fn classify(operation: &'static str, e: rusqlite::Error) -> Error {
    use rusqlite::ErrorCode;
    let code = e.sqlite_error_code();
    let source: Source = Box::new(e);
    match code {
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => {
            Error::Busy { operation, waited_ms: 0, timeout_ms: 0, source }
        }
        Some(ErrorCode::ConstraintViolation) => Error::Conflict { operation, source },
        Some(ErrorCode::NotADatabase | ErrorCode::DatabaseCorrupt) => {
            Error::Corrupt { operation, source }
        }
        Some(ErrorCode::ReadOnly) => Error::ReadOnly { operation, source },
        Some(ErrorCode::DiskFull) => Error::DiskFull { operation, source },
        _ => Error::Database { operation, source },
    }
}

/// A migration failure: a busy/locked/constraint error underneath (another
/// process migrating at the same instant) is retryable, found by walking the
/// source chain to the SQLite error and reading its code.
pub(crate) fn migration(e: refinery::Error) -> Error {
    Error::Migration { source: Box::new(e) }
}

/// A migration that failed because the database was busy or locked is
/// reported as [`Error::Busy`] (its wait filled in by the caller); any other
/// error is returned as it is.
pub(crate) fn busy_migration(e: Error) -> Error {
    use rusqlite::ErrorCode;
    let Error::Migration { source } = e else { return e };
    let mut busy = false;
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
    while let Some(err) = cur {
        if let Some(code) =
            err.downcast_ref::<rusqlite::Error>().and_then(rusqlite::Error::sqlite_error_code)
        {
            busy = matches!(code, ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked);
            break;
        }
        cur = err.source();
    }
    if busy {
        Error::Busy { operation: "migrating the schema", waited_ms: 0, timeout_ms: 0, source }
    } else {
        Error::Migration { source }
    }
}

/// Whether an open step may be retried: busy, locked or a constraint race,
/// judged by the SQLite code of the error or of a migration's cause.
pub(crate) fn is_retryable(e: &Error) -> bool {
    use rusqlite::ErrorCode;
    match e {
        Error::Busy { .. } | Error::Conflict { .. } => true,
        Error::Migration { source } => {
            let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(source.as_ref());
            while let Some(err) = cur {
                if let Some(code) = err
                    .downcast_ref::<rusqlite::Error>()
                    .and_then(rusqlite::Error::sqlite_error_code)
                {
                    return matches!(
                        code,
                        ErrorCode::DatabaseBusy
                            | ErrorCode::DatabaseLocked
                            | ErrorCode::ConstraintViolation
                    );
                }
                cur = err.source();
            }
            false
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use rusqlite::ffi;

    use super::{Error, ErrorKind, Fail, busy_message, is_retryable};

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

    fn from_code(code: i32) -> Error {
        Fail::Sql(rusqlite::Error::SqliteFailure(ffi::Error::new(code), None))
            .during("testing the classification")
    }

    #[test]
    fn classified_by_code_with_the_operation() {
        for (code, kind) in [
            (ffi::SQLITE_BUSY, ErrorKind::Busy),
            (ffi::SQLITE_LOCKED, ErrorKind::Busy),
            (ffi::SQLITE_CONSTRAINT, ErrorKind::Conflict),
            (ffi::SQLITE_CORRUPT, ErrorKind::Corrupt),
            (ffi::SQLITE_NOTADB, ErrorKind::Corrupt),
            (ffi::SQLITE_READONLY, ErrorKind::ReadOnly),
            (ffi::SQLITE_FULL, ErrorKind::DiskFull),
            (ffi::SQLITE_IOERR, ErrorKind::Other),
        ] {
            let e = from_code(code);
            assert_eq!(e.kind(), kind, "{code}");
            assert_eq!(e.operation(), Some("testing the classification"));
            assert!(std::error::Error::source(&e).is_some(), "{code}: source kept");
        }
        assert_eq!(
            from_code(ffi::SQLITE_IOERR).to_string(),
            "database error while testing the classification"
        );
        assert!(is_retryable(&from_code(ffi::SQLITE_BUSY)));
        assert!(!is_retryable(&from_code(ffi::SQLITE_FULL)));
    }
}
