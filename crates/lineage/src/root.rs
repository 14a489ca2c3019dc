//! The lineage root (semantics §5.2): the per-hop check and the walk back
//! through proven compression continuations.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use retinue_core::{MAX_HOPS, SessionGraph, SessionRow};
use serde_json::Value;

// `MAX_HOPS` is the most sessions a walk checks; a start 99 links below its
// root resolves, 100 links do not (as hermes).

/// Why a session has no lineage root. Any error means "no root": the
/// authority check fails closed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RootError {
    /// The session id is empty or blank.
    #[error("no session id")]
    NoSession,
    /// The walk came back to a session it had already visited.
    #[error("the parent chain has a cycle")]
    Cycle,
    /// The start session (or a session reached by the walk) has no row.
    #[error("session has no row")]
    MissingSession,
    /// `source` is `delegate`, `subagent` or `tool`.
    #[error("session source is delegate, subagent or tool")]
    ForbiddenSource,
    /// `model_config` cannot be parsed or is not a JSON object.
    #[error("model_config is unparsable or not a JSON object")]
    BadModelConfig,
    /// `model_config` has the key `_branched_from`.
    #[error("session is a branch (_branched_from)")]
    Branch,
    /// `model_config` has the key `_delegate_from`.
    #[error("session is a delegate child (_delegate_from)")]
    DelegateChild,
    /// The parent named by a session has no row.
    #[error("parent session has no row")]
    MissingParent,
    /// The parent has not ended.
    #[error("parent session has not ended")]
    ParentNotEnded,
    /// The parent ended for a reason other than exactly `compression`.
    #[error("parent session did not end with compression")]
    ParentNotCompression,
    /// The parent's eligible children are not exactly this session.
    #[error("parent session has no single compression continuation")]
    AmbiguousContinuation,
    /// 100 sessions were checked without reaching a root.
    #[error("no root within {MAX_HOPS} sessions")]
    HopLimit,
    /// The session graph could not be read (the store's error, kept as the
    /// source; shared so the answer stays cheap to clone).
    #[error("session graph unreadable: {0}")]
    Storage(#[source] Arc<retinue_core::Error>),
}

impl PartialEq for RootError {
    /// Variant by variant; two storage failures are equal when they read
    /// the same (the store's error has no equality of its own).
    fn eq(&self, other: &RootError) -> bool {
        match (self, other) {
            (RootError::Storage(a), RootError::Storage(b)) => a.to_string() == b.to_string(),
            (a, b) => std::mem::discriminant(a) == std::mem::discriminant(b),
        }
    }
}

impl Eq for RootError {}

impl From<retinue_core::Error> for RootError {
    fn from(e: retinue_core::Error) -> Self {
        RootError::Storage(Arc::new(e))
    }
}

/// The per-hop check of semantics §5.2 on raw column values.
///
/// Fails when `lowercase(trim(source))` is `delegate`, `subagent` or `tool`
/// ([`RootError::ForbiddenSource`]); when `model_config` (NULL or blank =
/// `{}`) cannot be parsed or is not an object ([`RootError::BadModelConfig`]);
/// when it has the key `_branched_from` ([`RootError::Branch`]) or
/// `_delegate_from` ([`RootError::DelegateChild`]) — key presence counts,
/// even with a null value.
pub fn check_hop(source: &str, model_config: Option<&str>) -> Result<(), RootError> {
    // ASCII case folding equals Unicode lowercasing here: no non-ASCII
    // character lowercases into the letters of these three words.
    let source = source.trim();
    if ["delegate", "subagent", "tool"].iter().any(|w| source.eq_ignore_ascii_case(w)) {
        return Err(RootError::ForbiddenSource);
    }
    let Some(text) = model_config.map(str::trim).filter(|t| !t.is_empty()) else {
        return Ok(());
    };
    let Ok(Value::Object(map)) = serde_json::from_str::<Value>(text) else {
        return Err(RootError::BadModelConfig);
    };
    if map.contains_key("_branched_from") {
        return Err(RootError::Branch);
    }
    if map.contains_key("_delegate_from") {
        return Err(RootError::DelegateChild);
    }
    Ok(())
}

/// [`check_hop`] on a session row.
pub fn check_row(row: &SessionRow) -> Result<(), RootError> {
    check_hop(&row.source, row.model_config.as_deref())
}

/// The lineage root of `session_id` (semantics §5.2): walks parents back through
/// proven compression continuations only, failing closed on every doubt.
/// Computed from the graph on every call, never stale: the graph may answer
/// a neighbourhood it has already read only while provably nothing changed
/// since (semantics §0; the store validates by `PRAGMA data_version`).
pub fn root(graph: &dyn SessionGraph, session_id: &str) -> Result<String, RootError> {
    let mut chain = lineage_chain(graph, session_id)?;
    chain.pop().ok_or(RootError::NoSession)
}

/// The sessions the root walk visits: `session_id` (trimmed) first, its
/// lineage root last. Same rules and errors as [`root`].
pub fn lineage_chain(graph: &dyn SessionGraph, session_id: &str) -> Result<Vec<String>, RootError> {
    let start = session_id.trim();
    if start.is_empty() {
        return Err(RootError::NoSession);
    }
    // One round trip when the graph can prefetch; the walk is the same.
    match graph.neighbourhood(start, MAX_HOPS + 1)? {
        Some(rows) => walk(&Snapshot::new(rows), start),
        None => walk(&Live(graph), start),
    }
}

/// The roots of several sessions from one read of their neighbourhoods
/// ([`SessionGraph::neighbourhoods`]): `None` when the graph cannot
/// prefetch them or the read failed (callers then walk each on its own,
/// which reports the storage error per session). Each answer is exactly
/// what [`root`] would give on a graph holding the same rows: a walk reads
/// only its own start's ancestors and their parents' children, which the
/// union holds whole.
pub(crate) fn roots_of(graph: &dyn SessionGraph, ids: &[&str]) -> Option<Vec<RootAnswer>> {
    let starts: Vec<&str> = ids.iter().map(|id| id.trim()).collect();
    let rows = match graph.neighbourhoods(&starts, MAX_HOPS + 1) {
        Ok(Some(rows)) => rows,
        Ok(None) => return None,
        Err(e) => {
            log::debug!("batched neighbourhood read failed, walking one by one: {e}");
            return None;
        }
    };
    let snapshot = Snapshot::new(rows);
    Some(
        starts
            .iter()
            .map(|start| {
                if start.is_empty() {
                    return Err(RootError::NoSession);
                }
                let mut chain = walk(&snapshot, start)?;
                chain.pop().ok_or(RootError::NoSession)
            })
            .collect(),
    )
}

/// One session's root, or why it has none.
pub(crate) type RootAnswer = Result<String, RootError>;

/// An in-memory copy of the rows a walk may read (from
/// [`SessionGraph::neighbourhood`]); rows it lacks read as missing, exactly
/// as the store would answer for them.
struct Snapshot {
    rows: HashMap<String, SessionRow>,
    children: HashMap<String, Vec<String>>,
}

impl Snapshot {
    fn new(list: Vec<SessionRow>) -> Snapshot {
        let mut rows = HashMap::with_capacity(list.len());
        let mut children: HashMap<String, Vec<String>> = HashMap::with_capacity(list.len());
        for row in list {
            if rows.contains_key(&row.id) {
                continue;
            }
            if let Some(parent) = &row.parent_session_id {
                children.entry(parent.clone()).or_default().push(row.id.clone());
            }
            rows.insert(row.id.clone(), row);
        }
        Snapshot { rows, children }
    }
}

/// What the walk reads: rows by id and a parent's children. Borrowed from a
/// [`Snapshot`], owned when read live from a [`SessionGraph`].
trait Rows {
    fn row(&self, id: &str) -> Result<Option<Cow<'_, SessionRow>>, RootError>;
    fn children(&self, parent: &str) -> Result<Vec<Cow<'_, SessionRow>>, RootError>;
}

impl Rows for Snapshot {
    fn row(&self, id: &str) -> Result<Option<Cow<'_, SessionRow>>, RootError> {
        Ok(self.rows.get(id).map(Cow::Borrowed))
    }

    fn children(&self, parent: &str) -> Result<Vec<Cow<'_, SessionRow>>, RootError> {
        Ok(self
            .children
            .get(parent)
            .map(|ids| ids.iter().filter_map(|id| self.rows.get(id)).map(Cow::Borrowed).collect())
            .unwrap_or_default())
    }
}

/// Row-by-row reads from a graph that cannot prefetch.
struct Live<'a>(&'a dyn SessionGraph);

impl Rows for Live<'_> {
    fn row(&self, id: &str) -> Result<Option<Cow<'_, SessionRow>>, RootError> {
        Ok(self.0.session(id)?.map(Cow::Owned))
    }

    fn children(&self, parent: &str) -> Result<Vec<Cow<'_, SessionRow>>, RootError> {
        Ok(self.0.child_sessions(parent)?.into_iter().map(Cow::Owned).collect())
    }
}

fn walk(graph: &dyn Rows, start: &str) -> Result<Vec<String>, RootError> {
    let mut current = start.to_owned();
    let mut visited: HashSet<String> = HashSet::new();
    let mut chain = Vec::new();
    loop {
        // Step 2: a session seen before closes a cycle.
        if !visited.insert(current.clone()) {
            return Err(RootError::Cycle);
        }
        // Step 3: the row exists and passes the per-hop check.
        let row = graph.row(&current)?.ok_or(RootError::MissingSession)?;
        check_row(&row)?;
        chain.push(current);
        // Step 4: no parent → this is the root.
        let parent_id = match row.parent_session_id.as_deref() {
            Some(p) if !p.trim().is_empty() => p.to_owned(),
            _ => return Ok(chain),
        };
        // Step 5: the parent ended with exactly `compression`.
        let parent = graph.row(&parent_id)?.ok_or(RootError::MissingParent)?;
        if parent.ended_at.is_none() {
            return Err(RootError::ParentNotEnded);
        }
        if parent.end_reason.as_deref() != Some("compression") {
            return Err(RootError::ParentNotCompression);
        }
        // Step 6: the parent's eligible children are exactly {current}.
        let children = graph.children(&parent_id)?;
        let mut eligible =
            children.iter().filter(|c| check_row(c).is_ok()).take(2).map(|c| c.id.as_str());
        let only = match (eligible.next(), eligible.next()) {
            (Some(only), None) => Some(only),
            _ => None,
        };
        if only != Some(row.id.as_str()) {
            return Err(RootError::AmbiguousContinuation);
        }
        // Step 7: the hop limit.
        if chain.len() >= MAX_HOPS {
            return Err(RootError::HopLimit);
        }
        current = parent_id;
    }
}
