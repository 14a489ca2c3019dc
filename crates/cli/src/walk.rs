//! The usage crate's [`LineageWalk`] over the lineage rules: a session's
//! compression lineage, root first, forward through unique continuations.

use retinue_lineage::{check_row, root};
use retinue_store::{MAX_HOPS, SessionGraph};
use retinue_usage::LineageWalk;

/// [`LineageWalk`] over a session graph: the proven root (spec §5.2), then
/// forward while the current session ended with `compression` and has
/// exactly one child passing the per-hop check (at most 100 hops).
pub(crate) struct ForwardWalk<'a> {
    /// The sessions.
    pub(crate) graph: &'a dyn SessionGraph,
}

impl LineageWalk for ForwardWalk<'_> {
    fn lineage_sessions(&self, session: &str) -> Option<Vec<String>> {
        let root = root(self.graph, session).ok()?;
        let mut out = vec![root.clone()];
        let mut current = root;
        while out.len() <= MAX_HOPS {
            let row = self.graph.session(&current).ok()??;
            if row.ended_at.is_none() || row.end_reason.as_deref() != Some("compression") {
                break;
            }
            let children = self.graph.child_sessions(&current).ok()?;
            let mut eligible = children.into_iter().filter(|c| check_row(c).is_ok());
            let (Some(next), None) = (eligible.next(), eligible.next()) else { break };
            if out.contains(&next.id) {
                break;
            }
            out.push(next.id.clone());
            current = next.id;
        }
        Some(out)
    }
}
