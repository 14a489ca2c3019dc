//! The session-graph seams: sessions and transcripts (hermes's `sessions`
//! and `messages` tables) as the lineage rules and the runtime see them.

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
