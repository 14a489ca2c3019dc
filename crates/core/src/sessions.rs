//! The session-graph seams: sessions and transcripts (hermes's `sessions`
//! and `messages` tables) as the lineage rules and the runtime see them.

use serde_json::Value;

use crate::error::Result;
use crate::model::{Message, NewSession, SessionRow};
use crate::status::EndReason;

/// Most sessions any lineage walk visits (the root walk, the forward walk
/// and the compression-tip walk): a start 99 links below its root resolves,
/// 100 links do not (as hermes).
pub const MAX_HOPS: usize = 100;

/// Read access to the session graph: what lineage authority needs, nothing more.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait SessionGraph: Send + Sync {
    /// One session row.
    fn session(&self, id: &str) -> Result<Option<SessionRow>>;
    /// The sessions whose parent is `parent`, oldest first.
    fn child_sessions(&self, parent: &str) -> Result<Vec<SessionRow>>;

    /// Everything a root walk from `id` may read, in one round trip: the
    /// session, its ancestors (at most `max_hops` links, so cycles end) and
    /// every other child of each ancestor's parent. Rows carry the columns the
    /// lineage rules read (`id`, `source`, `model_config`, `parent_session_id`,
    /// `started_at`, `ended_at`, `end_reason`); may contain duplicates. `None`
    /// when the implementation cannot prefetch (callers then read row by row).
    fn neighbourhood(&self, id: &str, max_hops: usize) -> Result<Option<Vec<SessionRow>>> {
        let _ = (id, max_hops);
        Ok(None)
    }

    /// The union of the [`neighbourhood`](SessionGraph::neighbourhood)s of
    /// every id in `ids`, read on one snapshot, for a caller about to walk
    /// several roots at once (a scoped listing walks each listed spawner and
    /// the requester). `None` when the implementation cannot (the default):
    /// callers then walk each id on its own. Reads of different moments
    /// must never be combined here — a walk would follow rows of one state
    /// into rows of another.
    #[expect(clippy::needless_lifetimes)] // mockall needs the lifetime named
    fn neighbourhoods<'a>(
        &self,
        ids: &[&'a str],
        max_hops: usize,
    ) -> Result<Option<Vec<SessionRow>>> {
        let _ = (ids, max_hops);
        Ok(None)
    }
}

/// Sessions and transcripts: child sessions go only through this seam, so
/// resume works with any runtime.
pub trait SessionStore: SessionGraph {
    /// Creates a session.
    fn create_session(&self, session: &NewSession) -> Result<()>;
    /// Appends a message; returns its row id.
    fn append_message(&self, session_id: &str, message: &Message) -> Result<i64>;
    /// Ends a session; the first reason wins. `false` if already ended or missing.
    fn end_session(&self, id: &str, reason: &EndReason) -> Result<bool>;
    /// Clears a session's end so it can take another turn.
    fn reopen_session(&self, id: &str) -> Result<bool>;
    /// The active transcript in insertion order.
    fn conversation(&self, id: &str) -> Result<Vec<Message>>;
    /// The session a resume should continue: the deepest compression
    /// continuation of `id` that has messages, else `id` (semantics §6.3 step 5).
    fn compression_tip(&self, id: &str) -> Result<String>;
}

#[cfg(any(test, feature = "mocks"))]
mockall::mock! {
    /// A mock [`SessionStore`] (and [`SessionGraph`]).
    pub SessionStore {}
    impl SessionGraph for SessionStore {
        fn session(&self, id: &str) -> Result<Option<SessionRow>>;
        fn child_sessions(&self, parent: &str) -> Result<Vec<SessionRow>>;
        fn neighbourhood(&self, id: &str, max_hops: usize) -> Result<Option<Vec<SessionRow>>>;
    }
    impl SessionStore for SessionStore {
        fn create_session(&self, session: &NewSession) -> Result<()>;
        fn append_message(&self, session_id: &str, message: &Message) -> Result<i64>;
        fn end_session(&self, id: &str, reason: &EndReason) -> Result<bool>;
        fn reopen_session(&self, id: &str) -> Result<bool>;
        fn conversation(&self, id: &str) -> Result<Vec<Message>>;
        fn compression_tip(&self, id: &str) -> Result<String>;
    }
}

/// A session's compression lineage (semantics §5.2, §7.1), as the lineage crate
/// resolves it (`retinue_lineage::CompressionWalk`); the usage crate sums a
/// lineage's ledger over what it returns.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait LineageWalk: Send + Sync {
    /// The sessions from the lineage root forward through unique eligible
    /// compression continuations (root first, at most 100 hops), or `None`
    /// when the root cannot be proven (including a storage failure).
    fn lineage_sessions(&self, session: &str) -> Option<Vec<String>>;
}

/// What a message adds to `sessions.tool_call_count`, counted as hermes
/// counts it: the length of a `tool_calls` array, 1 for any other value, 0
/// for none (hermes's insights and prune filters read this column).
pub fn tool_call_delta(tool_calls: Option<&str>) -> i64 {
    match tool_calls.map(str::trim).filter(|t| !t.is_empty()) {
        None => 0,
        Some(text) => match serde_json::from_str::<Value>(text) {
            Ok(Value::Array(calls)) => i64::try_from(calls.len()).unwrap_or(i64::MAX),
            Ok(Value::Null) => 0,
            _ => 1,
        },
    }
}

/// Whether a `model_config` text carries a lineage marker key
/// (`_branched_from`, `_delegate_from`), or is unreadable (which counts as
/// marked: fail closed).
pub fn has_lineage_marker(model_config: Option<&str>) -> bool {
    match model_config.map(str::trim).filter(|s| !s.is_empty()) {
        None => false,
        Some(text) => match serde_json::from_str::<Value>(text) {
            Ok(Value::Object(m)) => {
                m.contains_key("_branched_from") || m.contains_key("_delegate_from")
            }
            _ => true,
        },
    }
}

/// The session a resume continues (semantics §6.3 step 5): from `start`,
/// follow compression continuations (at most [`MAX_HOPS`]) and answer the
/// deepest one that has messages, else `id`. A continuation is a child of a
/// session that ended with `compression`, without a lineage marker, not a
/// `tool` session, not visited yet; among several, one that also ended with
/// `compression` first, then a live one, then the latest started (then the
/// greatest id). Both backends run this one walk; `children` and
/// `has_messages` read their storage.
pub fn compression_tip_walk<E>(
    id: &str,
    start: Option<SessionRow>,
    mut children: impl FnMut(&str) -> std::result::Result<Vec<SessionRow>, E>,
    mut has_messages: impl FnMut(&str) -> std::result::Result<bool, E>,
) -> std::result::Result<String, E> {
    let mut best = id.to_owned();
    let Some(mut current) = start else { return Ok(best) };
    let mut visited = vec![current.id.clone()];
    for _ in 0..MAX_HOPS {
        if current.end_reason.as_deref() != Some("compression") {
            break;
        }
        let rank = |s: &SessionRow| match (s.ended_at, s.end_reason.as_deref()) {
            (Some(_), Some("compression")) => 2,
            (None, _) => 1,
            _ => 0,
        };
        let next = children(&current.id)?
            .into_iter()
            .filter(|c| {
                !has_lineage_marker(c.model_config.as_deref())
                    && !c.source.trim().eq_ignore_ascii_case("tool")
                    && !visited.contains(&c.id)
            })
            .max_by(|a, b| {
                rank(a)
                    .cmp(&rank(b))
                    .then(a.started_at.total_cmp(&b.started_at))
                    .then(a.id.cmp(&b.id))
            });
        let Some(next) = next else { break };
        visited.push(next.id.clone());
        if has_messages(&next.id)? {
            best.clone_from(&next.id);
        }
        current = next;
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(id: &str, parent: Option<&str>, end: Option<&str>, started: f64) -> SessionRow {
        SessionRow {
            id: id.into(),
            source: "cli".into(),
            parent_session_id: parent.map(str::to_owned),
            started_at: started,
            ended_at: end.map(|_| started + 1.0),
            end_reason: end.map(str::to_owned),
            ..SessionRow::default()
        }
    }

    /// R (compressed) → {A (branch marker), B (compressed, empty) → C (live,
    /// has messages)}, and a tool session T: the tip is C, never A or T.
    #[test]
    fn the_tip_is_the_deepest_eligible_continuation_with_messages() {
        let mut branch = row("A", Some("R"), None, 5.0);
        branch.model_config = Some(r#"{"_branched_from": "R"}"#.into());
        let mut tool = row("T", Some("R"), Some("compression"), 9.0);
        tool.source = "tool".into();
        let rows = [
            row("R", None, Some("compression"), 1.0),
            branch,
            tool,
            row("B", Some("R"), Some("compression"), 2.0),
            row("C", Some("B"), None, 3.0),
        ];
        let children = |p: &str| -> std::result::Result<Vec<SessionRow>, ()> {
            Ok(rows.iter().filter(|r| r.parent_session_id.as_deref() == Some(p)).cloned().collect())
        };
        let tip = compression_tip_walk("R", Some(rows[0].clone()), children, |s| Ok(s == "C"));
        assert_eq!(tip, Ok("C".to_owned()));
        // Nothing has messages: the start itself.
        let tip = compression_tip_walk("R", Some(rows[0].clone()), children, |_| Ok(false));
        assert_eq!(tip, Ok("R".to_owned()));
        // An unreadable marker counts as marked (fail closed).
        assert!(has_lineage_marker(Some("{not json")));
        assert!(!has_lineage_marker(Some("  ")));
        assert_eq!(tool_call_delta(Some(r#"[{"id": 1}, {"id": 2}]"#)), 2);
        assert_eq!(tool_call_delta(Some("garbage")), 1);
        assert_eq!(tool_call_delta(Some("null")), 0);
    }

    #[test]
    fn an_abandoned_units_task_never_overrides_its_status() {
        let (event, result) = crate::abandoned_event(
            "deleg_1",
            [Some("o".into()), None, None],
            Some("P".into()),
            Some(r#"{"status": "completed", "goal": "g", "delegation_id": "forged"}"#),
        );
        assert_eq!(event["status"], "unknown");
        assert_eq!(event["delegation_id"], "deleg_1");
        assert_eq!(event["goal"], "g");
        assert_eq!(event["origin_ui_session_id"], "");
        assert_eq!(result["error"], crate::ABANDONED_ERROR);
    }
}
