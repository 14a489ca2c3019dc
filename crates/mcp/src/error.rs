//! The crate's one error enum.

use std::net::SocketAddr;

/// What starting or running the MCP server can fail with. Tool failures are
/// never an `McpError`: they go back to the client as MCP tool errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum McpError {
    /// The async runtime could not be built.
    #[error("cannot start the MCP server's async runtime")]
    Runtime(#[source] std::io::Error),
    /// The MCP transport failed (handshake, closed stream, protocol error).
    #[error("the MCP transport failed: {0}")]
    Transport(String),
    /// The HTTP listener could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The requested address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `--http` named an address that is not loopback.
    #[error("refusing to listen on {0}: the MCP server binds loopback only (127.0.0.1 or [::1])")]
    NotLoopback(SocketAddr),
    /// `--session ID` named a session that does not exist.
    #[error(
        "no session '{0}' (omit --session to use this project's session, or pass --new-session)"
    )]
    NoSession(String),
    /// The working directory could not be resolved.
    #[error("cannot resolve the working directory")]
    WorkingDir(#[source] std::io::Error),
    /// The OS random source failed.
    #[error("secure random source failed: {0}")]
    Random(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] retinue_core::Error),
}
