//! The command's one error enum and its exit codes.

use std::error::Error as _;

/// Exit code: success.
pub(crate) const EXIT_OK: u8 = 0;
/// Exit code: any other error.
pub(crate) const EXIT_FAILED: u8 = 1;
/// Exit code: bad usage (clap's own errors exit with it too).
pub(crate) const EXIT_USAGE: u8 = 2;
/// Exit code: the decision was a denial.
pub(crate) const EXIT_DENIED: u8 = 3;
/// Exit code: the id or session is not found (or not addressable).
pub(crate) const EXIT_NOT_FOUND: u8 = 4;
/// Exit code: `retinue wait` timed out with units still running.
pub(crate) const EXIT_TIMEOUT: u8 = 5;

/// Everything a command can fail with.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CliError {
    /// The arguments make no sense together.
    #[error("{0}")]
    Usage(String),
    /// The id or session does not exist, or is not addressable.
    #[error("{0}")]
    NotFound(String),
    /// Anything else, already phrased.
    #[error("{0}")]
    Failed(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] retinue_core::Error),
    /// The usage ledger failed.
    #[error(transparent)]
    Ledger(#[from] retinue_usage::UsageError),
    /// Writing the output or the demo home failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

impl CliError {
    /// The process exit code for this error.
    pub(crate) fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) => EXIT_USAGE,
            CliError::NotFound(_) => EXIT_NOT_FOUND,
            CliError::Store(e) if e.kind() == retinue_core::ErrorKind::Missing => EXIT_NOT_FOUND,
            CliError::Failed(_) | CliError::Store(_) | CliError::Ledger(_) | CliError::Io(_) => {
                EXIT_FAILED
            }
        }
    }

    /// The kind of failure, as `--json` reports it under `"code"`.
    pub(crate) fn kind(&self) -> &'static str {
        use retinue_core::ErrorKind as K;
        match self {
            CliError::Usage(_) => "usage",
            CliError::NotFound(_) => "not_found",
            CliError::Failed(_) => "internal",
            CliError::Io(_) => "io",
            CliError::Store(e) | CliError::Ledger(retinue_usage::UsageError::Store(e)) => {
                match e.kind() {
                    K::Missing => "not_found",
                    K::Busy => "busy",
                    K::Corrupt | K::NotADatabase | K::MalformedRow => "corrupt",
                    K::ReadOnly => "read_only",
                    K::Io | K::DiskFull | K::NotAFile => "io",
                    _ => "internal",
                }
            }
            CliError::Ledger(_) => "internal",
        }
    }

    /// The message with its causes, `outer: inner: …`.
    pub(crate) fn report(&self) -> String {
        let mut text = self.to_string();
        let mut source = self.source();
        // `transparent` variants share their Display with their source: skip repeats.
        while let Some(cause) = source {
            let part = cause.to_string();
            if !text.ends_with(&part) {
                text.push_str(": ");
                text.push_str(&part);
            }
            source = cause.source();
        }
        text
    }
}

/// The exit code for a `delegate_task` error: by variant class, never by text.
pub(crate) fn delegate_error_code(e: &retinue_delegate::DelegateError) -> u8 {
    match e.kind() {
        retinue_delegate::DelegateErrorKind::Usage => EXIT_USAGE,
        retinue_delegate::DelegateErrorKind::Denied => EXIT_DENIED,
        retinue_delegate::DelegateErrorKind::NotFound => EXIT_NOT_FOUND,
        _ => EXIT_FAILED,
    }
}

/// `bytes` secure random bytes as hex ([`retinue_core::random_hex`]); a
/// failing random source fails the command.
pub(crate) fn random_hex(bytes: usize) -> Result<String> {
    retinue_core::random_hex(bytes)
        .map_err(|e| CliError::Failed(format!("secure random source failed: {e}")))
}

/// The command's result type.
pub(crate) type Result<T, E = CliError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use retinue_delegate::DelegateError;

    #[test]
    fn delegate_errors_map_to_contract_codes() {
        let foreign = DelegateError::NotAddressable { target: "x".into() };
        assert_eq!(delegate_error_code(&foreign), EXIT_DENIED);
        assert_eq!(delegate_error_code(&DelegateError::SelfTarget), EXIT_DENIED);
        let gone = DelegateError::Tombstoned {
            target: "x".into(),
            at: 0.0,
            reason: "manual".into(),
            child_session_id: "s".into(),
        };
        assert_eq!(delegate_error_code(&gone), EXIT_NOT_FOUND);
        let bad = DelegateError::InvalidArguments(retinue_delegate::texts::TASKS_NOT_ARRAY.into());
        assert_eq!(delegate_error_code(&bad), EXIT_USAGE);
        let busy = DelegateError::Busy { target: "x".into(), claimed_at: 0.0, expires_at: 1.0 };
        assert_eq!(delegate_error_code(&busy), EXIT_FAILED);
        assert_eq!(delegate_error_code(&DelegateError::Paused), EXIT_FAILED);
        assert_eq!(delegate_error_code(&DelegateError::DepthExceeded { depth: 1, max: 1 }), 1);
    }
}
