//! `retinue-mcp`: Retinue's retained subagents as Model Context Protocol
//! tools, so any MCP-capable agent host (Claude Code, Codex, goose, …) can
//! delegate work, follow the same subagent up tomorrow, and see what it cost.
//!
//! The server acts as **one parent session** that outlives it
//! ([`resolve_session`]: by default the project's, derived from the canonical
//! working directory and the profile). Its tools are `delegate_task` (the
//! hermes tool's arguments and result, over the typed delegate core),
//! `list_subagents`, `show_subagent`, `tombstone_subagent` and
//! `subagent_usage`, all scoped by the `delegate_task` authority rules: the
//! caller's identity is the server's session, never a tool argument, and a
//! foreign id answers exactly like a missing one.
//!
//! The MCP SDK (`rmcp`) and its async runtime (tokio) stay inside this crate:
//! the entry points [`serve_stdio`] and [`serve_http`] are synchronous, and
//! every blocking call (SQLite, child runs) runs on tokio's blocking pool, so
//! a delegation that takes minutes never blocks other requests. Logs go to
//! the `log` facade (the CLI sends them to stderr); stdout is the protocol.

mod approvals;
mod attach;
mod error;
mod framing;
mod server;
mod session;
mod tasks;
mod tools;

use std::net::SocketAddr;
use std::sync::Arc;

use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use retinue_delegate::Delegator;
use retinue_lineage::LineageAuthority;
use rmcp::ServiceExt;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use tokio_util::sync::CancellationToken;

pub use error::McpError;
pub use server::{RetinueServer, ServerOptions};
pub use session::{
    ParentSession, SESSION_SOURCE, SessionChoice, project_session_id, resolve_session,
};
pub use tools::{
    APPLY_CHANGES, CANCEL_SUBAGENT, DECIDE_APPROVAL, DEFAULT_WAIT_SECS, DELEGATE_TASK,
    DISCARD_CHANGES, LAST_ANSWER_MAX_CHARS, LIST_APPROVALS, LIST_SUBAGENTS, MAX_WAIT_SECS,
    SHOW_SUBAGENT, STEER_SUBAGENT, SUBAGENT_CHANGES, SUBAGENT_USAGE, TOMBSTONE_SUBAGENT, ToolSpec,
    WAIT_SUBAGENTS, tool_specs,
};

/// Why `delegate_task` cannot be offered (e.g. no model is configured): the
/// composition root's error, kept with its source chain.
pub type Unavailable = Arc<dyn std::error::Error + Send + Sync>;

/// The collaborators the server works through (the composition root wires
/// them).
#[derive(Clone)]
pub struct McpParts {
    /// The storage backend (registry, sessions, ledger, budgets).
    pub backend: retinue_core::Backend,
    /// `delegation.budget`: the lineage's spending cap (unlimited = none).
    pub budget: retinue_core::BudgetLimit,
    /// Follow-up authority: the rules `delegate_task` applies.
    pub authority: Arc<dyn LineageAuthority>,
    /// The `delegate_task` tool, or why it is unavailable (e.g. no model is
    /// configured): that text is `delegate_task`'s tool error, while the
    /// registry tools keep working.
    pub delegator: Result<Delegator, Unavailable>,
    /// The directory the children's tools work in.
    pub workspace: Option<std::path::PathBuf>,
    /// Why the server's directory cannot be a workspace (`/`, a system
    /// directory, the user's home): `delegate_task` then refuses the
    /// workspace-bound toolsets with this text.
    pub workspace_refused: Option<String>,
    /// The toolsets this session grants its children (narrowed per call by
    /// `delegate_task`'s `toolsets`).
    pub toolsets: Vec<String>,
    /// The process profile key (a unit of another profile is never addressed).
    pub profile: String,
}

impl std::fmt::Debug for McpParts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpParts").field("delegator", &self.delegator).finish_non_exhaustive()
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, McpError> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("retinue-mcp")
        .enable_all()
        .build()
        .map_err(McpError::Runtime)
}

/// Resolves on Ctrl-C (SIGINT) or, on Unix, SIGTERM: how a host or a
/// service manager stops the server.
async fn terminated() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(e) => {
                log::warn!("cannot watch SIGTERM: {e}");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Stops the runtime: running delegations are cancelled first (their
/// children stop and report what they did), then background units finish.
fn shut_down(server: &RetinueServer, rt: tokio::runtime::Runtime) {
    server.cancel_running();
    rt.shutdown_timeout(std::time::Duration::from_secs(15));
    server.wait_background();
}

/// The loopback authorities (`host:port`) of a server bound to `bound`.
fn loopback_authorities(bound: SocketAddr) -> Vec<String> {
    let p = bound.port();
    vec![format!("127.0.0.1:{p}"), format!("localhost:{p}"), format!("[::1]:{p}")]
}

/// Serves MCP over stdin/stdout until the client closes stdin (or the
/// process gets Ctrl-C or SIGTERM). Blocks the calling thread.
pub fn serve_stdio(server: RetinueServer) -> Result<(), McpError> {
    let rt = runtime()?;
    let handler = server.clone();
    let result = rt.block_on(async move {
        // Lines the SDK would drop in silence are answered with JSON-RPC errors.
        let (input, output, writer) = framing::spawn(tokio::io::stdin(), tokio::io::stdout());
        let running =
            handler.serve((input, output)).await.map_err(|e| McpError::Transport(e.to_string()))?;
        let stop = running.cancellation_token();
        let quit = tokio::select! {
            quit = running.waiting() => {
                quit.map(|_| ()).map_err(|e| McpError::Transport(e.to_string()))
            }
            () = terminated() => {
                stop.cancel();
                Ok(())
            }
        };
        // The SDK is done: its last answers (and the framing's) still reach
        // stdout before the runtime stops.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), writer).await;
        quit
    });
    shut_down(&server, rt);
    result
}

/// Stops a [`serve_http`] server from another thread.
#[derive(Debug, Clone, Default)]
pub struct McpShutdown(CancellationToken);

impl McpShutdown {
    /// A handle that has not fired.
    pub fn new() -> McpShutdown {
        McpShutdown::default()
    }

    /// Stops the server: the listener closes, running calls are cancelled.
    pub fn stop(&self) {
        self.0.cancel();
    }
}

/// Serves MCP over streamable HTTP at `http://{addr}/` until `shutdown`
/// fires or the process gets Ctrl-C or SIGTERM. Only loopback addresses are accepted.
/// Blocks the calling thread; `on_listening` gets the bound address (port 0
/// picks a free one).
pub fn serve_http(
    server: RetinueServer,
    addr: SocketAddr,
    shutdown: &McpShutdown,
    on_listening: impl FnOnce(SocketAddr),
) -> Result<(), McpError> {
    if !addr.ip().is_loopback() {
        return Err(McpError::NotLoopback(addr));
    }
    let rt = runtime()?;
    let stop = shutdown.0.clone();
    let handler = server.clone();
    let result = rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| McpError::Bind { addr, source })?;
        let bound = listener.local_addr().map_err(|source| McpError::Bind { addr, source })?;
        on_listening(bound);
        let config = StreamableHttpServerConfig::default()
            .with_cancellation_token(stop.child_token())
            // Only this server's own loopback names, with its port (DNS
            // rebinding reaches nothing); an `Origin`, when present, must be
            // a loopback page of this same port (the transport's MUST).
            .with_allowed_hosts(loopback_authorities(bound))
            .with_allowed_origins(
                loopback_authorities(bound).into_iter().map(|a| format!("http://{a}")),
            )
            .enforce_origin_validation();
        let service = TowerToHyperService::new(StreamableHttpService::new(
            move || Ok(handler.clone()),
            Arc::new(LocalSessionManager::default()),
            config,
        ));
        loop {
            let stream = tokio::select! {
                () = stop.cancelled() => break,
                () = terminated() => break,
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => stream,
                    Err(e) => {
                        log::warn!("accepting an MCP connection failed: {e}");
                        continue;
                    }
                },
            };
            let service = service.clone();
            let stop = stop.clone();
            tokio::spawn(async move {
                let conn = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service);
                tokio::pin!(conn);
                tokio::select! {
                    done = conn.as_mut() => {
                        if let Err(e) = done {
                            log::debug!("MCP HTTP connection ended: {e}");
                        }
                    }
                    () = stop.cancelled() => conn.as_mut().graceful_shutdown(),
                }
            });
        }
        stop.cancel();
        Ok(())
    });
    shut_down(&server, rt);
    result
}
