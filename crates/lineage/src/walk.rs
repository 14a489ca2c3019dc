//! The forward half of the one lineage walk: from a session's proven root
//! through its unique compression continuations (semantics §5.2, §7.1). The usage
//! crate sums a lineage's ledger over it ([`retinue_core::LineageWalk`]).

use retinue_core::LineageWalk;
use retinue_core::{MAX_HOPS, SessionGraph};

use crate::root::{RootError, check_row, root};

/// The sessions of `session`'s compression lineage, root first: the proven
/// root, then forward while the current session ended with `compression` and
/// has exactly one child passing the per-hop check (at most [`MAX_HOPS`]
/// hops; a cycle stops the walk).
pub fn lineage_sessions(graph: &dyn SessionGraph, session: &str) -> Result<Vec<String>, RootError> {
    let first = root(graph, session)?;
    let mut out = vec![first.clone()];
    let mut current = first;
    while out.len() <= MAX_HOPS {
        let Some(row) = graph.session(&current)? else { break };
        if row.ended_at.is_none() || row.end_reason.as_deref() != Some("compression") {
            break;
        }
        let children = graph.child_sessions(&current)?;
        let mut eligible = children.into_iter().filter(|c| check_row(c).is_ok());
        let (Some(next), None) = (eligible.next(), eligible.next()) else { break };
        if out.contains(&next.id) {
            break;
        }
        out.push(next.id.clone());
        current = next.id;
    }
    Ok(out)
}

/// [`LineageWalk`] over a session graph: what an embedder passes to
/// `retinue_usage::load_lineage_usage_totals` to total a whole lineage.
#[derive(Clone, Copy)]
pub struct CompressionWalk<'a> {
    graph: &'a dyn SessionGraph,
}

impl<'a> CompressionWalk<'a> {
    /// The walk over `graph`.
    pub fn new(graph: &'a dyn SessionGraph) -> CompressionWalk<'a> {
        CompressionWalk { graph }
    }
}

impl std::fmt::Debug for CompressionWalk<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompressionWalk").finish_non_exhaustive()
    }
}

impl LineageWalk for CompressionWalk<'_> {
    fn lineage_sessions(&self, session: &str) -> Option<Vec<String>> {
        lineage_sessions(self.graph, session).ok()
    }
}
