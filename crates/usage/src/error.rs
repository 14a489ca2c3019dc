//! The usage crate's one error enum.

/// Everything that can go wrong while billing usage.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The ledger's storage failed.
    #[error("usage ledger storage failed")]
    Store(#[from] retinue_core::Error),
}

/// The usage crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
