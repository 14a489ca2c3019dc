//! `retinue-lineage`: decides who may address a retained subagent.
//!
//! Its one job is Retinue's authority model (semantics §5): a requester may message
//! a retained child only if it shares the spawner's *lineage root* — reached
//! by walking parents back through proven compression continuations only,
//! failing closed on every doubt — and only within the same profile, and never
//! the child itself. The rules are pure functions over the store's
//! [`SessionGraph`] and [`RegistryRead`] seams: no SQL, no IO of their own, no
//! caching across calls.
//!
//! * [`root`], [`lineage_chain`], [`check_hop`]: semantics §5.2.
//! * [`lineage_sessions`] / [`CompressionWalk`]: the lineage forward from its
//!   root, the one walk the usage ledger totals over (semantics §7.1).
//! * [`check_follow_up_authority`] → [`Denial`]: semantics §5.1 and §5.3.
//! * [`list_for`], [`find_for`], [`resolve_for`] → [`Resolution`]: semantics §5.5.
//! * [`LineageAuthority`] / [`Authority`]: the same behind one object-safe
//!   trait (mocked as `MockLineageAuthority` under the `mocks` feature).
//!
//! It needs `retinue-core` only — no SQL engine: an embedder with its own
//! session storage implements [`SessionGraph`] and asks for a root.
//!
//! ```
//! use retinue_core::{Result, SessionGraph, SessionRow};
//!
//! /// Sessions kept in memory by the embedder.
//! struct Sessions(Vec<SessionRow>);
//!
//! impl SessionGraph for Sessions {
//!     fn session(&self, id: &str) -> Result<Option<SessionRow>> {
//!         Ok(self.0.iter().find(|s| s.id == id).cloned())
//!     }
//!     fn child_sessions(&self, parent: &str) -> Result<Vec<SessionRow>> {
//!         Ok(self.0.iter().filter(|s| s.parent_session_id.as_deref() == Some(parent)).cloned().collect())
//!     }
//! }
//!
//! let row = |id: &str, parent: Option<&str>, end: Option<&str>| SessionRow {
//!     id: id.into(),
//!     source: "cli".into(),
//!     parent_session_id: parent.map(str::to_owned),
//!     ended_at: end.map(|_| 2.0),
//!     end_reason: end.map(str::to_owned),
//!     ..SessionRow::default()
//! };
//! // A parent compressed into a continuation: the continuation's root is the parent.
//! let graph = Sessions(vec![row("P", None, Some("compression")), row("C", Some("P"), None)]);
//! assert_eq!(retinue_lineage::root(&graph, "C").ok().as_deref(), Some("P"));
//! ```

mod authority;
mod root;
mod scope;
mod walk;

use std::sync::Arc;

use retinue_core::{RegistryRead, RetainedChild, SessionGraph};

pub use authority::{Denial, LineageCause, check_follow_up_authority, check_profile, is_self};
pub use retinue_core::MAX_HOPS;
pub use root::{RootError, check_hop, check_row, lineage_chain, root};
pub use scope::{Resolution, find_for, list_for, resolve_for};
pub use walk::{CompressionWalk, lineage_sessions};

/// The authority rules bound to one registry, session graph and profile.
///
/// The named lifetimes are for `mockall`, which cannot mock elided ones inside `Option`.
#[expect(clippy::needless_lifetimes)]
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait LineageAuthority: Send + Sync {
    /// The lineage root of a session ([`root`]).
    fn root(&self, session_id: &str) -> Result<String, RootError>;
    /// The sessions of the session's compression lineage, root first ([`lineage_sessions`]).
    fn lineage_sessions(&self, session_id: &str) -> Result<Vec<String>, RootError>;
    /// May `requester` address `entry`? ([`check_follow_up_authority`]).
    fn check_follow_up_authority<'a>(
        &self,
        entry: &RetainedChild,
        requester: Option<&'a str>,
    ) -> Result<(), Denial>;
    /// The addressable entries `requester` may address ([`list_for`]).
    fn list_for<'a>(&self, requester: Option<&'a str>) -> retinue_core::Result<Vec<RetainedChild>>;
    /// The entry for `id` if `requester` may address it ([`find_for`]).
    fn find_for<'a>(
        &self,
        requester: Option<&'a str>,
        id: &str,
    ) -> retinue_core::Result<Option<RetainedChild>>;
    /// Resolves `id` for `requester` on the tool path ([`resolve_for`]).
    fn resolve_for<'a>(&self, requester: Option<&'a str>, id: &str) -> Resolution;
}

/// [`LineageAuthority`] over shared store seams (a `Store` serves as both).
#[derive(Clone)]
pub struct Authority {
    registry: Arc<dyn RegistryRead>,
    graph: Arc<dyn SessionGraph>,
    profile: String,
}

impl std::fmt::Debug for Authority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authority").field("profile", &self.profile).finish_non_exhaustive()
    }
}

impl Authority {
    /// The rules over `registry` and `graph` for the current process profile
    /// `profile` (`''` = none).
    pub fn new(
        registry: Arc<dyn RegistryRead>,
        graph: Arc<dyn SessionGraph>,
        profile: impl Into<String>,
    ) -> Authority {
        Authority { registry, graph, profile: profile.into() }
    }

    /// The current profile.
    pub fn profile(&self) -> &str {
        &self.profile
    }
}

impl LineageAuthority for Authority {
    fn root(&self, session_id: &str) -> Result<String, RootError> {
        root(self.graph.as_ref(), session_id)
    }

    fn lineage_sessions(&self, session_id: &str) -> Result<Vec<String>, RootError> {
        lineage_sessions(self.graph.as_ref(), session_id)
    }

    fn check_follow_up_authority(
        &self,
        entry: &RetainedChild,
        requester: Option<&str>,
    ) -> Result<(), Denial> {
        check_follow_up_authority(self.graph.as_ref(), entry, requester, &self.profile)
    }

    fn list_for(&self, requester: Option<&str>) -> retinue_core::Result<Vec<RetainedChild>> {
        list_for(self.registry.as_ref(), self.graph.as_ref(), requester, &self.profile)
    }

    fn find_for(
        &self,
        requester: Option<&str>,
        id: &str,
    ) -> retinue_core::Result<Option<RetainedChild>> {
        find_for(self.registry.as_ref(), self.graph.as_ref(), requester, id, &self.profile)
    }

    fn resolve_for(&self, requester: Option<&str>, id: &str) -> Resolution {
        resolve_for(self.registry.as_ref(), self.graph.as_ref(), requester, id, &self.profile)
    }
}

#[cfg(test)]
mod tests;
