//! The crate-private bridge from SQLite and refinery errors to
//! [`retinue_core::Error`]: classified by SQLite *error code*, never by
//! message text, with the failed operation named. No rusqlite or refinery
//! type leaves this crate.

use retinue_core::Source;
pub(crate) use retinue_core::{Error, Result};

retinue_core::backend_fail!(Sql(rusqlite::Error), classify);

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

    use retinue_core::{Error, ErrorKind};

    use super::{Fail, is_retryable};

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
