//! Scoped lookups (semantics §5.5): the registry as one requester may see it.
//! Unscoped store functions remain for the operator CLI.

use retinue_core::{
    Lookup, RegistryRead, RetainedChild, SessionGraph, TombstoneReason, Unaddressable,
};

use crate::authority::{Denial, RootMemo, check_profile, check_with, is_self};

/// What a requester may learn about an id (the tool path of semantics §6.3).
#[derive(Debug, Clone, PartialEq)]
pub enum Resolution {
    /// Addressable and authorised.
    Addressable(RetainedChild),
    /// Authorised, but tombstoned (or due to be): when and why.
    Tombstoned {
        /// The entry.
        entry: RetainedChild,
        /// When.
        at: f64,
        /// Why.
        reason: TombstoneReason,
    },
    /// The requester is the child itself.
    SelfTarget,
    /// Unknown, never retained, foreign profile, failed lineage, or a storage
    /// error: indistinguishable on purpose.
    NotAddressable,
}

/// The addressable entries `requester` may address (semantics §5.1), in the
/// registry's order. Each root is computed once per call. A registry read
/// error is returned; a session-graph error denies the entries it concerns.
pub fn list_for(
    registry: &dyn RegistryRead,
    graph: &dyn SessionGraph,
    requester: Option<&str>,
    current_profile: &str,
) -> retinue_core::Result<Vec<RetainedChild>> {
    let mut memo = RootMemo::default();
    let entries = registry.list_retained_children()?;
    // Every root this listing may need, read in one batch: the requester's
    // and each spawner of an entry that passes the profile and self checks.
    if let Some(req) = requester.map(str::trim).filter(|r| !r.is_empty()) {
        let mut ids: Vec<&str> = vec![req];
        ids.extend(
            entries
                .iter()
                .filter(|e| check_profile(e, current_profile).is_ok() && !is_self(e, requester))
                .map(|e| e.parent_session_id.as_str()),
        );
        memo.prefetch(graph, &ids);
    }
    Ok(entries
        .into_iter()
        .filter(|e| check_with(graph, e, requester, current_profile, &mut memo).is_ok())
        .collect())
}

/// The addressable entry for `id` if `requester` may address it; `None` for
/// foreign and missing alike. A registry read error is returned.
pub fn find_for(
    registry: &dyn RegistryRead,
    graph: &dyn SessionGraph,
    requester: Option<&str>,
    id: &str,
    current_profile: &str,
) -> retinue_core::Result<Option<RetainedChild>> {
    let mut memo = RootMemo::default();
    Ok(registry
        .find_retained_child(id)?
        .filter(|e| check_with(graph, e, requester, current_profile, &mut memo).is_ok()))
}

/// Resolves `id` for `requester` (semantics §5.5): the tombstone's time and reason
/// are told only after authority passes; a registry error is
/// [`Resolution::NotAddressable`] (fail closed).
pub fn resolve_for(
    registry: &dyn RegistryRead,
    graph: &dyn SessionGraph,
    requester: Option<&str>,
    id: &str,
    current_profile: &str,
) -> Resolution {
    let lookup = match registry.lookup(id) {
        Ok(lookup) => lookup,
        Err(e) => {
            log::warn!("resolve_for({id:?}): registry lookup failed, denying: {e}");
            return Resolution::NotAddressable;
        }
    };
    let (entry, status) = match lookup {
        Lookup::Unknown => return Resolution::NotAddressable,
        Lookup::Addressable(entry) => (entry, None),
        Lookup::NotAddressable(entry, status) => (entry, Some(status)),
    };
    let mut memo = RootMemo::default();
    match check_with(graph, &entry, requester, current_profile, &mut memo) {
        Err(Denial::SelfFollowUp) => Resolution::SelfTarget,
        Err(denial) => {
            log::debug!("resolve_for({id:?}): {denial:?}");
            Resolution::NotAddressable
        }
        Ok(()) => match status {
            None => Resolution::Addressable(entry),
            Some(Unaddressable::Tombstoned { at, reason, .. }) => {
                Resolution::Tombstoned { entry, at, reason }
            }
            Some(Unaddressable::NeverRetained) => Resolution::NotAddressable,
        },
    }
}
