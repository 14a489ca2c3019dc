//! Follow-up authority (semantics §5.1) and its denials (semantics §5.3).

use std::collections::HashMap;

use retinue_core::{RetainedChild, SessionGraph};

use crate::root::{RootError, root};

/// Why the lineage check denied (for logs only; never in tool output).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LineageCause {
    /// The requester is none or blank.
    NoRequester,
    /// The spawner (`parent_session_id`) has no root.
    OwnerRoot(RootError),
    /// The requester has no root.
    RequesterRoot(RootError),
    /// Both have roots, and they differ.
    DifferentRoots,
}

/// A refused follow-up. [`Denial::message`] (and `Display`) give the
/// contractual texts of semantics §5.3.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Denial {
    /// The entry belongs to another profile.
    #[error("follow_up rejected: retained subagent belongs to profile '{owner}', not '{current}'.")]
    Profile {
        /// The entry's `owner_profile`.
        owner: String,
        /// The current process profile.
        current: String,
    },
    /// The requester is the child's own session.
    #[error("follow_up rejected: a subagent cannot follow up on itself.")]
    SelfFollowUp,
    /// The requester is not of the spawner's session lineage.
    #[error(
        "follow_up rejected: only the session lineage that spawned this subagent may message it \
         (compression-rotation continuations included; branches, siblings, and foreign sessions \
         are not owners)."
    )]
    Lineage {
        /// Why (logs only).
        cause: LineageCause,
    },
}

impl Denial {
    /// The fixed text of semantics §5.3 (the cause never appears in it).
    pub fn message(&self) -> String {
        self.to_string()
    }
}

/// Roots computed during one call, so a listing walks each lineage once.
/// Never kept across calls.
#[derive(Default)]
pub(crate) struct RootMemo {
    roots: HashMap<String, Result<String, RootError>>,
}

impl RootMemo {
    /// Computes the roots of `ids` not yet known from one batched read of
    /// their neighbourhoods, when the graph can (else nothing: each is then
    /// walked on its own when asked for).
    pub(crate) fn prefetch(&mut self, graph: &dyn SessionGraph, ids: &[&str]) {
        let mut todo: Vec<&str> = Vec::new();
        for id in ids {
            let id = id.trim();
            if !id.is_empty() && !self.roots.contains_key(id) && !todo.contains(&id) {
                todo.push(id);
            }
        }
        if todo.len() < 2 {
            return;
        }
        if let Some(answers) = crate::root::roots_of(graph, &todo) {
            for (id, answer) in todo.into_iter().zip(answers) {
                self.roots.insert(id.to_owned(), answer);
            }
        }
    }

    pub(crate) fn root(&mut self, graph: &dyn SessionGraph, id: &str) -> Result<String, RootError> {
        self.roots.entry(id.trim().to_owned()).or_insert_with(|| root(graph, id)).clone()
    }
}

/// The profile check (semantics §5.1 step 1): denied iff the entry lies
/// outside the current profile's [`retinue_core::Scope`] (both profiles
/// non-empty and different).
pub fn check_profile(entry: &RetainedChild, current_profile: &str) -> Result<(), Denial> {
    let owner = entry.owner_profile.as_str();
    if !retinue_core::Scope::of(current_profile).admits(Some(owner)) {
        return Err(Denial::Profile {
            owner: owner.to_owned(),
            current: current_profile.to_owned(),
        });
    }
    Ok(())
}

/// Whether `requester` (trimmed, non-empty) is the entry's own non-empty
/// child session (semantics §5.1 step 2).
pub fn is_self(entry: &RetainedChild, requester: Option<&str>) -> bool {
    let requester = requester.map(str::trim).unwrap_or_default();
    !requester.is_empty()
        && !entry.child_session_id.is_empty()
        && requester == entry.child_session_id
}

/// May `requester` address `entry`? Spec §5.1, first failure wins:
/// profile, then self, then lineage (both roots exist and are equal).
/// Roots are computed now, from `graph`; a storage error denies.
pub fn check_follow_up_authority(
    graph: &dyn SessionGraph,
    entry: &RetainedChild,
    requester: Option<&str>,
    current_profile: &str,
) -> Result<(), Denial> {
    check_with(graph, entry, requester, current_profile, &mut RootMemo::default())
}

pub(crate) fn check_with(
    graph: &dyn SessionGraph,
    entry: &RetainedChild,
    requester: Option<&str>,
    current_profile: &str,
    memo: &mut RootMemo,
) -> Result<(), Denial> {
    check_profile(entry, current_profile)?;
    if is_self(entry, requester) {
        return Err(Denial::SelfFollowUp);
    }
    let deny = |cause| Err(Denial::Lineage { cause });
    let Some(requester) = requester.map(str::trim).filter(|r| !r.is_empty()) else {
        return deny(LineageCause::NoRequester);
    };
    // Both walks from one read when the graph can batch them.
    memo.prefetch(graph, &[&entry.parent_session_id, requester]);
    let owner_root = match memo.root(graph, &entry.parent_session_id) {
        Ok(r) => r,
        Err(e) => return deny(LineageCause::OwnerRoot(e)),
    };
    let requester_root = match memo.root(graph, requester) {
        Ok(r) => r,
        Err(e) => return deny(LineageCause::RequesterRoot(e)),
    };
    if owner_root != requester_root {
        return deny(LineageCause::DifferentRoots);
    }
    Ok(())
}
