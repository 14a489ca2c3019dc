//! What the pages show, read from the seams: the tree of parent sessions
//! (a compression continuation under its root), their units, the units'
//! children and, under an orchestrator child, the units it spawned; cost
//! per child rolled up per unit, per session and per lineage, with the
//! lineage's budget; a child's transcript. Pure reads: nothing is written.

use std::collections::{BTreeMap, HashMap, HashSet};

use retinue_core::{
    ApprovalFilter, ApprovalRequest, BudgetLimit, BudgetStatus, Message, Scope, UnitChild,
    UnitState, UnitView, UsageSoFar, UsageTotals,
};
use retinue_usage::fold_usage;

use crate::{WebError, WebParts};

/// How many units the tree reads at most (newest first).
pub const MAX_UNITS: usize = 500;
/// How deep orchestrators nest in the tree.
const MAX_NESTING: usize = 8;

/// A child's state as the tree shows it.
#[derive(Debug, Clone, PartialEq)]
pub enum ChildState {
    /// Its unit is still running.
    Running,
    /// Retained: addressable for this many more seconds.
    Retained {
        /// Seconds left of its TTL.
        left_secs: f64,
    },
    /// Retained, but its TTL has passed (a prune will tombstone it).
    Expired,
    /// Tombstoned.
    Tombstoned {
        /// When.
        at: f64,
        /// Why.
        reason: String,
    },
    /// Its unit's owner died; recovery could not tell how it ended.
    Unknown,
    /// Finished without being retained (failed, interrupted, error).
    Finished(UnitState),
}

impl ChildState {
    /// A short CSS class for the badge.
    pub fn class(&self) -> &'static str {
        match self {
            ChildState::Running => "running",
            ChildState::Retained { .. } => "retained",
            ChildState::Expired => "expired",
            ChildState::Tombstoned { .. } => "tombstoned",
            ChildState::Unknown => "unknown",
            ChildState::Finished(_) => "finished",
        }
    }
}

/// One child in the tree.
#[derive(Debug, Clone, PartialEq)]
pub struct ChildNode {
    /// The stored child.
    pub child: UnitChild,
    /// Its state now.
    pub state: ChildState,
    /// What its runs cost (ledger rows billed for its session).
    pub cost: UsageTotals,
    /// While it runs: its usage so far.
    pub so_far: Option<UsageSoFar>,
    /// The units it spawned (an orchestrator).
    pub nested: Vec<UnitNode>,
}

/// One unit in the tree.
#[derive(Debug, Clone, PartialEq)]
pub struct UnitNode {
    /// The stored unit.
    pub unit: UnitView,
    /// Seconds from dispatch to completion (or to now).
    pub elapsed_secs: f64,
    /// Its children.
    pub children: Vec<ChildNode>,
    /// Its children's cost, summed (with nested units').
    pub cost: UsageTotals,
}

/// One parent session of a lineage.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionNode {
    /// The session id.
    pub id: String,
    /// Whether it continues the root (a compression continuation).
    pub continuation: bool,
    /// Its units, newest first.
    pub units: Vec<UnitNode>,
    /// Their cost, summed.
    pub cost: UsageTotals,
}

/// A compression lineage: the root session and its continuations.
#[derive(Debug, Clone, PartialEq)]
pub struct LineageNode {
    /// The lineage root.
    pub root: String,
    /// The sessions that delegated, the root first.
    pub sessions: Vec<SessionNode>,
    /// Everything the lineage's children cost.
    pub cost: UsageTotals,
    /// The lineage's budget, when one is configured.
    pub budget: Option<BudgetStatus>,
}

/// The whole tree.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Tree {
    /// Approval requests waiting for a human, newest first.
    pub approvals: Vec<ApprovalRequest>,
    /// Lineages, the most recently active first.
    pub lineages: Vec<LineageNode>,
    /// Units running now (anywhere in the tree).
    pub running: usize,
    /// Units shown.
    pub units: usize,
}

fn add(a: UsageTotals, b: UsageTotals) -> UsageTotals {
    a.plus(b)
}

fn child_state(unit: &UnitView, c: &UnitChild, ttl_secs: f64, now: f64) -> ChildState {
    if let Some(at) = c.tombstoned_at.or(unit.tombstoned_at) {
        let reason = c.tombstone_reason.clone().unwrap_or_else(|| "unit tombstoned".to_owned());
        return ChildState::Tombstoned { at, reason };
    }
    match unit.state {
        UnitState::Pending | UnitState::Running | UnitState::Finalizing => ChildState::Running,
        UnitState::Unknown => ChildState::Unknown,
        _ => match c.retained_at {
            Some(at) if at + ttl_secs > now => {
                ChildState::Retained { left_secs: at + ttl_secs - now }
            }
            Some(_) => ChildState::Expired,
            None => ChildState::Finished(unit.state.clone()),
        },
    }
}

struct Builder<'a> {
    parts: &'a WebParts,
    by_parent: HashMap<String, Vec<UnitView>>,
    /// Per child session, what its ledger rows cost (keyed by parent).
    costs: HashMap<String, UsageTotals>,
    now: f64,
}

impl Builder<'_> {
    fn cost_of_parent(&mut self, parent: &str) -> Result<(), WebError> {
        let rows =
            retinue_usage::load_child_usage_attributions(&*self.parts.backend.ledger, parent)
                .map_err(|e| WebError::Read(e.to_string()))?;
        for r in rows {
            let entry = self.costs.entry(r.child_session_id.clone()).or_default();
            *entry = add(*entry, fold_usage(&r.usage));
        }
        Ok(())
    }

    fn unit_node(&mut self, unit: UnitView, depth: usize) -> Result<UnitNode, WebError> {
        let ttl = self.parts.retention.ttl_hours * 3600.0;
        let mut children = Vec::with_capacity(unit.children.len());
        let mut cost = UsageTotals::default();
        for c in &unit.children {
            let nested = if depth < MAX_NESTING {
                let spawned = self.by_parent.remove(&c.child_session_id).unwrap_or_default();
                spawned
                    .into_iter()
                    .map(|u| self.unit_node(u, depth + 1))
                    .collect::<Result<Vec<_>, _>>()?
            } else {
                Vec::new()
            };
            let own = self.costs.get(&c.child_session_id).copied().unwrap_or_default();
            let nested_cost = nested.iter().fold(UsageTotals::default(), |a, n| add(a, n.cost));
            cost = add(cost, add(own, nested_cost));
            let state = child_state(&unit, c, ttl, self.now);
            let so_far = (state == ChildState::Running).then(|| {
                UsageSoFar::of(
                    &self
                        .parts
                        .backend
                        .sessions
                        .conversation(&c.child_session_id)
                        .unwrap_or_default(),
                )
            });
            children.push(ChildNode { state, child: c.clone(), cost: own, so_far, nested });
        }
        let end = unit.completed_at.unwrap_or(self.now);
        Ok(UnitNode { elapsed_secs: (end - unit.dispatched_at).max(0.0), children, cost, unit })
    }
}

/// The tree as it stands now.
pub fn tree(parts: &WebParts, now: f64) -> Result<Tree, WebError> {
    let backend = &parts.backend;
    // The view shows its own profile's units and the unprofiled ones (the
    // empty profile: only those) unless `--all-profiles`.
    let profile = (!parts.all_profiles).then_some(parts.profile.as_str());
    let units = backend
        .controls
        .list_units(profile, MAX_UNITS)
        .map_err(|e| WebError::Read(e.to_string()))?;
    let count = units.len();
    let running = units.iter().filter(|u| !u.is_finished()).count();
    let child_sessions: HashSet<String> =
        units.iter().flat_map(|u| u.children.iter().map(|c| c.child_session_id.clone())).collect();
    let mut by_parent: HashMap<String, Vec<UnitView>> = HashMap::new();
    let mut order: Vec<String> = Vec::new();
    for u in units {
        let parent = u.parent_session_id.clone().unwrap_or_default();
        if !by_parent.contains_key(&parent) {
            order.push(parent.clone());
        }
        by_parent.entry(parent).or_default().push(u);
    }
    let mut b = Builder { parts, by_parent, costs: HashMap::new(), now };
    // Every paying session's ledger rows first: a child's follow-ups may be
    // billed to a continuation of the session that spawned it.
    let payers: Vec<String> = b.by_parent.keys().filter(|p| !p.is_empty()).cloned().collect();
    for p in &payers {
        b.cost_of_parent(p)?;
    }
    // Lineages of the top-level parents (not themselves a shown child).
    let mut lineages: BTreeMap<usize, LineageNode> = BTreeMap::new();
    let mut slot_of_root: HashMap<String, usize> = HashMap::new();
    for parent in order.into_iter().filter(|p| !child_sessions.contains(p)) {
        let Some(units) = b.by_parent.remove(&parent) else { continue };
        let root = if parent.is_empty() {
            parent.clone()
        } else {
            retinue_lineage::root(&*backend.graph, &parent).unwrap_or_else(|_| parent.clone())
        };
        let nodes = units.into_iter().map(|u| b.unit_node(u, 0)).collect::<Result<Vec<_>, _>>()?;
        let cost = nodes.iter().fold(UsageTotals::default(), |a, n| add(a, n.cost));
        let session = SessionNode { continuation: parent != root, id: parent, units: nodes, cost };
        let next = slot_of_root.len();
        let slot = *slot_of_root.entry(root.clone()).or_insert(next);
        let lineage = lineages.entry(slot).or_insert_with(|| LineageNode {
            root: root.clone(),
            sessions: Vec::new(),
            cost: UsageTotals::default(),
            budget: None,
        });
        lineage.cost = add(lineage.cost, session.cost);
        lineage.sessions.push(session);
    }
    let mut out: Vec<LineageNode> = lineages.into_values().collect();
    for l in &mut out {
        // The root first, then its continuations in the walk's order.
        l.sessions.sort_by_key(|s| s.continuation);
        if parts.budget != BudgetLimit::default() && !l.root.is_empty() {
            let members: Vec<String> = l.sessions.iter().map(|s| s.id.clone()).collect();
            l.budget = backend.budgets.budget_status(&l.root, &members, parts.budget).ok();
        }
    }
    Ok(Tree { approvals: requests(parts, true)?, lineages: out, running, units: count })
}

/// One child's page: where it sits, its transcript and its cost.
#[derive(Debug, Clone, PartialEq)]
pub struct ChildPage {
    /// Its unit.
    pub unit: UnitView,
    /// The child.
    pub child: ChildNode,
    /// Its transcript, oldest first.
    pub transcript: Vec<Message>,
    /// Its approval requests (pending and decided), newest first.
    pub approvals: Vec<ApprovalRequest>,
    /// An isolated child's change set, with its diff.
    pub changes: Option<retinue_core::run::ChangeSet>,
}

/// The scope the view reads and decides in: every profile with
/// `--all-profiles`, else its own and the unprofiled rows (the empty
/// profile: only those), as the tree's listing.
pub(crate) fn scope(parts: &WebParts) -> Scope {
    if parts.all_profiles {
        Scope::Operator
    } else {
        Scope::Tenant(parts.profile.trim().to_owned())
    }
}

/// The approval requests inside the view's scope, newest first: pending
/// ones (`pending_only`), or every one.
pub(crate) fn requests(
    parts: &WebParts,
    pending_only: bool,
) -> Result<Vec<ApprovalRequest>, WebError> {
    let s = scope(parts);
    let filter = ApprovalFilter {
        profile: match &s {
            Scope::Operator => None,
            Scope::Tenant(p) => Some(p.clone()),
        },
        pending_only,
        limit: 200,
        ..ApprovalFilter::default()
    };
    let listed = parts
        .backend
        .approvals
        .list_approvals(&filter)
        .map_err(|e| WebError::Read(e.to_string()))?;
    Ok(listed.into_iter().filter(|r| s.admits(r.owner_profile.as_deref())).collect())
}

/// Whether the view of `profile` shows a unit owned by `owner`: the same
/// rule as [`retinue_core::Scope`] for a tenant, and for the empty profile
/// only the unprofiled units (the tree's listing filters alike).
fn view_admits(profile: &str, owner: Option<&str>) -> bool {
    let owner = owner.map(str::trim).unwrap_or("");
    owner.is_empty() || owner == profile.trim()
}

/// The child whose subagent id or child session id is `id`, or `None`.
pub fn child_page(parts: &WebParts, id: &str, now: f64) -> Result<Option<ChildPage>, WebError> {
    let backend = &parts.backend;
    let Some(unit) = backend.controls.unit_view(id).map_err(|e| WebError::Read(e.to_string()))?
    else {
        return Ok(None);
    };
    if !parts.all_profiles && !view_admits(&parts.profile, unit.owner_profile.as_deref()) {
        return Ok(None);
    }
    let Some(c) = unit.children.iter().find(|c| c.subagent_id == id || c.child_session_id == id)
    else {
        return Ok(None);
    };
    let mut b = Builder { parts, by_parent: HashMap::new(), costs: HashMap::new(), now };
    if let Some(parent) = &unit.parent_session_id {
        // Its follow-ups may be billed to continuations of its parent.
        let payers = retinue_lineage::lineage_sessions(&*backend.graph, parent)
            .unwrap_or_else(|_| vec![parent.clone()]);
        for p in &payers {
            b.cost_of_parent(p)?;
        }
    }
    let ttl = parts.retention.ttl_hours * 3600.0;
    let transcript = backend
        .sessions
        .conversation(&c.child_session_id)
        .map_err(|e| WebError::Read(e.to_string()))?;
    let state = child_state(&unit, c, ttl, now);
    let child = ChildNode {
        so_far: (state == ChildState::Running).then(|| UsageSoFar::of(&transcript)),
        state,
        cost: b.costs.get(&c.child_session_id).copied().unwrap_or_default(),
        child: c.clone(),
        nested: Vec::new(),
    };
    let approvals = requests(parts, false)?
        .into_iter()
        .filter(|r| r.subagent_id == child.child.subagent_id)
        .collect();
    let changes = parts.isolation.as_ref().and_then(|i| {
        i.change_set(&child.child.subagent_id, true)
            .inspect_err(|e| log::warn!("change set of {} not read: {e}", child.child.subagent_id))
            .ok()
            .flatten()
    });
    Ok(Some(ChildPage { unit, child, transcript, approvals, changes }))
}
