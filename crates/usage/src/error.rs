//! The usage crate's one error enum.

/// Everything that can go wrong while billing usage.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum UsageError {
    /// The ledger's storage failed.
    #[error("usage ledger storage failed")]
    Store(#[from] retinue_core::Error),
}

/// The usage crate's result type.
pub type UsageResult<T, E = UsageError> = std::result::Result<T, E>;
