//! The benchmark workload's shape, shared by the SQLite bench
//! (`crates/bench`) and the PostgreSQL bench (`crates/store-pg/examples/bench`)
//! so both measure the same rows on the same data: the ids of unit `i` and
//! its children, its parent, its child count, and the draft of a fresh
//! two-child unit the write rows insert.

use retinue_core::{ChildManifest, NewSession, UnitDraft};
use serde_json::json;

/// Children of unit `i`: 1–3.
pub fn children_of(i: usize) -> usize {
    i % 3 + 1
}

/// The delegation id of unit `i`.
pub fn unit_id(i: usize) -> String {
    format!("deleg_{i:08x}")
}

/// The subagent id of child `k` of unit `i`.
pub fn subagent_id(i: usize, k: usize) -> String {
    format!("sa-{k}-{i:08x}")
}

/// The child session id of child `k` of unit `i`.
pub fn child_session(i: usize, k: usize) -> String {
    format!("cs-{i:08x}-{k}")
}

/// The parent session of unit `i` (64 parents).
pub fn parent_of(i: usize) -> String {
    format!("p-{}", i % 64)
}

/// A fresh unit of two children (`sa-{k}-{tag}`, `cs-{tag}-{k}`) spawned by
/// `parent`, with their child sessions marked as delegate children.
pub fn draft(tag: &str, parent: &str) -> UnitDraft {
    let children: Vec<ChildManifest> = (0..2)
        .map(|k| ChildManifest {
            subagent_id: format!("sa-{k}-{tag}"),
            session_id: format!("cs-{tag}-{k}"),
            model: Some("bench/model".into()),
            goal: Some("a benchmark goal".into()),
            ..ChildManifest::default()
        })
        .collect();
    UnitDraft {
        origin_session: parent.into(),
        parent_session_id: Some(parent.into()),
        task: json!({"goal": "a benchmark goal", "is_batch": true}),
        child_sessions: children
            .iter()
            .map(|c| NewSession {
                id: c.session_id.clone(),
                source: "delegate".into(),
                parent_session_id: Some(parent.into()),
                model_config: Some(json!({"_delegate_from": parent})),
                ..NewSession::default()
            })
            .collect(),
        children,
        ..UnitDraft::default()
    }
}
