//! `retinue-web`: `retinue serve`, a web view of the subagent tree, read
//! only but for the approval buttons (`--read-only`: none).
//!
//! It shows, from the same registry the other commands use (SQLite or
//! PostgreSQL, opened read-only by the caller): parent sessions with their
//! compression continuations under the lineage root; their delegation units
//! and children, and the units an orchestrator child spawned under it; each
//! child's state (running, retained with its TTL left, tombstoned with the
//! reason, unknown), model, toolsets and elapsed time; cost per child
//! rolled up per unit, session and lineage, with the lineage's budget as a
//! bar; and a child's transcript (turns, tool calls with their arguments and
//! results, collapsed when long, steering messages and follow-ups).
//!
//! Pages are rendered on the server with maud (checked at compile time,
//! escaped by default: every shown value is untrusted model output), with a
//! little vanilla JavaScript that polls a cheap change marker
//! ([`retinue_core::Controls::change_marker`]) and reloads the page's
//! fragment when it moves. Nothing comes from a CDN; a strict
//! Content-Security-Policy forbids anything inline. The tokio runtime and
//! the HTTP stack (hyper) stay inside this crate: [`serve`] is blocking.

mod decide;
mod http;
mod model;
mod pages;
mod site;

use std::net::SocketAddr;
use std::sync::Arc;

use crate::tokio_util_shim::StopSignal as ShutdownInner;
use retinue_core::{Backend, BudgetLimit, RetentionPolicy};

pub use model::{
    ChildNode, ChildPage, ChildState, LineageNode, MAX_UNITS, SessionNode, Tree, UnitNode,
    child_page, tree,
};
pub use site::{CSP, CSP_WRITABLE, MAX_FORM_BYTES};

/// What the view reads.
#[derive(Clone)]
pub struct WebParts {
    /// The storage backend (read-only is enough).
    pub backend: Backend,
    /// `delegation.budget`: shown as a bar per lineage when set.
    pub budget: BudgetLimit,
    /// Retention limits (for the TTL left).
    pub retention: RetentionPolicy,
    /// The profile whose units are shown.
    pub profile: String,
    /// Show every profile's units (team mode's operator view).
    pub all_profiles: bool,
    /// Whether the approve/deny buttons work (the backend must be
    /// writable); `false` is `serve --read-only`.
    pub writable: bool,
    /// Without a token (loopback): the key that a browser presents once
    /// (`?approve=KEY`, then a cookie) to decide; `None` decides nothing
    /// there. With a token, the token is the key.
    pub approve_key: Option<String>,
    /// The home's worktrees: an isolated child's page shows its change set
    /// and diff (`None`: no change sets shown).
    pub isolation: Option<std::sync::Arc<dyn retinue_core::run::Isolation>>,
}

impl std::fmt::Debug for WebParts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebParts").field("profile", &self.profile).finish_non_exhaustive()
    }
}

/// The crate's errors.
#[derive(Debug, thiserror::Error)]
pub enum WebError {
    /// The registry could not be read.
    #[error("{0}")]
    Read(String),
    /// The address could not be bound, or the runtime not started.
    #[error("cannot serve on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The async runtime could not start.
    #[error("cannot start the server runtime: {0}")]
    Runtime(#[source] std::io::Error),
    /// A `--host-name` that is not a host name.
    #[error("{0}")]
    HostName(String),
}

/// Stops a running [`serve`] from another thread.
#[derive(Debug, Clone, Default)]
pub struct WebShutdown(ShutdownInner);

impl WebShutdown {
    /// A handle that has not fired.
    pub fn new() -> WebShutdown {
        WebShutdown::default()
    }

    /// Asks the server to stop (idempotent).
    pub fn stop(&self) {
        self.0.stop();
    }
}

mod tokio_util_shim {
    //! A tiny one-shot stop signal over `tokio::sync::watch`.
    use tokio::sync::watch;

    #[derive(Debug, Clone)]
    pub(crate) struct StopSignal {
        tx: std::sync::Arc<watch::Sender<bool>>,
    }

    impl Default for StopSignal {
        fn default() -> Self {
            StopSignal { tx: std::sync::Arc::new(watch::channel(false).0) }
        }
    }

    impl StopSignal {
        pub(crate) fn stop(&self) {
            self.tx.send_replace(true);
        }

        pub(crate) async fn stopped(&self) {
            let mut rx = self.tx.subscribe();
            while !*rx.borrow_and_update() {
                if rx.changed().await.is_err() {
                    return;
                }
            }
        }
    }
}

/// A bound, not yet serving, view: [`Bound::addr`] is the address to print
/// (port 0 picks a free one).
pub struct Bound {
    listener: std::net::TcpListener,
    addr: SocketAddr,
}

impl std::fmt::Debug for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bound").field("addr", &self.addr).finish()
    }
}

impl Bound {
    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

/// Binds `addr` (the caller has checked it is loopback, or that remote
/// access is allowed with a token).
pub fn bind(addr: SocketAddr) -> Result<Bound, WebError> {
    let listener =
        std::net::TcpListener::bind(addr).map_err(|source| WebError::Bind { addr, source })?;
    listener.set_nonblocking(true).map_err(|source| WebError::Bind { addr, source })?;
    let addr = listener.local_addr().map_err(|source| WebError::Bind { addr, source })?;
    Ok(Bound { listener, addr })
}

/// Serves the view on `bound` until `shutdown` fires (blocking). With a
/// `token`, every request must present it.
pub fn serve(
    bound: Bound,
    parts: WebParts,
    token: Option<String>,
    shutdown: &WebShutdown,
) -> Result<(), WebError> {
    serve_as(bound, parts, token, &[], shutdown)
}

/// The `Host` values a view bound to `addr` answers: its IP and port
/// (`[v6]:port`), `localhost:port` on loopback, and each of `names` (host
/// names checked by [`host_name`]) with the port — lowercase.
pub fn accepted_hosts(addr: std::net::SocketAddr, names: &[String]) -> Vec<String> {
    let port = addr.port();
    let mut out = Vec::new();
    if !addr.ip().is_unspecified() {
        out.push(match addr.ip() {
            std::net::IpAddr::V4(ip) => format!("{ip}:{port}"),
            std::net::IpAddr::V6(ip) => format!("[{ip}]:{port}"),
        });
    }
    if addr.ip().is_loopback() {
        out.push(format!("localhost:{port}"));
    }
    for n in names {
        let n = n.trim().to_ascii_lowercase();
        out.push(format!("{n}:{port}"));
        if port == 80 {
            out.push(n);
        }
    }
    out
}

/// Checks a `--host-name`: a DNS name or an IP literal, with no port, no
/// wildcard, no scheme and no trailing dot.
pub fn host_name(name: &str) -> Result<String, WebError> {
    let n = name.trim().to_ascii_lowercase();
    if n.parse::<std::net::Ipv4Addr>().is_ok() {
        return Ok(n);
    }
    if let Some(v6) = n.strip_prefix('[').and_then(|r| r.strip_suffix(']'))
        && v6.parse::<std::net::Ipv6Addr>().is_ok()
    {
        return Ok(n);
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    };
    if n.len() > 253 || n.is_empty() || !n.split('.').all(label_ok) {
        return Err(WebError::HostName(format!(
            "`{}` is not a host name (letters, digits, `-` and `.`; no port, wildcard, scheme or \
             trailing dot; an IPv6 literal in brackets)",
            name.escape_debug()
        )));
    }
    Ok(n)
}

/// [`serve`], answering the `Host` values of the bound address and of
/// `host_names` ([`accepted_hosts`]) — every other request is 403 before
/// anything is read.
pub fn serve_as(
    bound: Bound,
    parts: WebParts,
    token: Option<String>,
    host_names: &[String],
    shutdown: &WebShutdown,
) -> Result<(), WebError> {
    let hosts = accepted_hosts(bound.addr, host_names);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("retinue-web")
        .build()
        .map_err(WebError::Runtime)?;
    let (writable, approve_key) = (parts.writable, parts.approve_key.clone());
    let site = Arc::new(site::Site {
        parts,
        token,
        hosts,
        writable,
        approve_key,
        csrf: Default::default(),
    });
    let addr = bound.addr;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(bound.listener)
            .map_err(|source| WebError::Bind { addr, source })?;
        loop {
            tokio::select! {
                () = shutdown.0.stopped() => break,
                accepted = listener.accept() => {
                    let (stream, _peer) = match accepted {
                        Ok(a) => a,
                        Err(e) => {
                            log::warn!("accept failed: {e}");
                            continue;
                        }
                    };
                    let site = site.clone();
                    tokio::spawn(async move {
                        let io = hyper_util::rt::TokioIo::new(stream);
                        let service = hyper::service::service_fn(move |req| {
                            let site = site.clone();
                            async move {
                                Ok::<_, std::convert::Infallible>(http::handle(site, req).await)
                            }
                        });
                        if let Err(e) = hyper::server::conn::http1::Builder::new()
                            .serve_connection(io, service)
                            .await
                        {
                            log::debug!("connection ended: {e}");
                        }
                    });
                }
            }
        }
        Ok(())
    })
}
