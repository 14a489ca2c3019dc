//! Isolated children (issue #38): the orchestrator's side of core's
//! [`Isolation`] seam — which children get a worktree, preparing it before
//! the run, recording the change set after it, resuming in it — and the
//! parent-side commands (`changes`, `apply`, `discard`) behind the
//! follow-up authority rule.

use std::path::PathBuf;
use std::sync::Arc;

use retinue_core::run::{
    ChangeSet, ChangeState, ChildSpec, Isolation, IsolationError, IsolationMode, Owner,
};
use retinue_core::{
    ChildManifest, ChildStatus, EndReason, ExitReason, RetainedChild, Scope, UnitState,
};

use crate::results::ChildReport;
use crate::{Collector, Decider, DelegateError, Inner, ParentContext, SpawnRequest, TaskSpec};

/// The isolation a task runs under: its own, the call's, else the config's.
pub(crate) fn mode_of(inner: &Inner, request: &SpawnRequest, task: &TaskSpec) -> IsolationMode {
    task.isolation.or(request.isolation).unwrap_or(inner.parts.config.isolation)
}

/// Which tasks of `request` run isolated; an isolated spawn that cannot
/// work is refused here, before anything is written.
pub(crate) fn plan(
    inner: &Inner,
    request: &SpawnRequest,
    parent: &ParentContext,
) -> Result<Vec<bool>, DelegateError> {
    let isolated: Vec<bool> = request
        .tasks
        .iter()
        .map(|t| mode_of(inner, request, t) == IsolationMode::Worktree)
        .collect();
    if isolated.contains(&true) {
        check(inner, parent)?;
    }
    Ok(isolated)
}

fn check(inner: &Inner, parent: &ParentContext) -> Result<(), DelegateError> {
    let Some(isolation) = inner.isolation.get() else {
        return Err(DelegateError::Isolation(IsolationError::Io {
            operation: "isolation `worktree`".to_owned(),
            message: "this process has no worktree support (no home to keep worktrees in)"
                .to_owned(),
        }));
    };
    let Some(workspace) = parent.workspace.as_deref() else {
        return Err(DelegateError::Isolation(IsolationError::NotARepository {
            workspace: "(no workspace)".to_owned(),
        }));
    };
    isolation.check(workspace).map_err(DelegateError::Isolation)
}

/// Where an isolated child's workspace will be (its manifest records it).
pub(crate) fn workspace_of(
    inner: &Inner,
    parent: &ParentContext,
    subagent_id: &str,
) -> Result<PathBuf, DelegateError> {
    match (inner.isolation.get(), parent.workspace.as_deref()) {
        (Some(isolation), Some(workspace)) => {
            isolation.workspace_of(workspace, subagent_id).map_err(DelegateError::Isolation)
        }
        _ => check(inner, parent).map(|()| PathBuf::new()),
    }
}

/// `spec` in a worktree of its own, created now; when it cannot be, the
/// child's result: it never ran (its session ends as an error).
pub(crate) fn in_worktree(
    inner: &Inner,
    delegation_id: &str,
    parent: &ParentContext,
    spec: &ChildSpec,
) -> Result<ChildSpec, Box<ChildReport>> {
    let owner = Owner {
        subagent_id: spec.subagent_id.clone(),
        delegation_id: delegation_id.to_owned(),
        parent_session_id: parent.session_id.clone().unwrap_or_default(),
        owner_profile: inner.parts.profile.clone(),
    };
    let prepared = match (inner.isolation.get(), parent.workspace.as_deref()) {
        (Some(isolation), Some(workspace)) => isolation.prepare(workspace, &owner),
        _ => Err(IsolationError::NotARepository { workspace: "(no workspace)".to_owned() }),
    };
    let e = match prepared {
        Ok(workspace) => return Ok(ChildSpec { workspace: Some(workspace), ..spec.clone() }),
        Err(e) => e,
    };
    let session = &spec.session_id;
    if let Err(x) = inner.parts.backend.sessions.end_session(session, &EndReason::Error) {
        log::warn!("could not end child session {session}: {x}");
    }
    Err(Box::new(ChildReport {
        task_index: spec.task_index,
        status: ChildStatus::Error,
        exit_reason: ExitReason::Error,
        model: spec.model.clone(),
        child_session_id: session.clone(),
        subagent_id: spec.subagent_id.clone(),
        toolsets: spec.toolsets.clone(),
        error: Some(format!("could not create the child's worktree: {e}")),
        ..ChildReport::default()
    }))
}

/// The workspace of a child that resumes: its worktree when it has one.
pub(crate) fn reopen(inner: &Inner, subagent_id: &str) -> Result<Option<PathBuf>, DelegateError> {
    match inner.isolation.get() {
        Some(isolation) => isolation.reopen(subagent_id).map_err(DelegateError::Isolation),
        None => Ok(None),
    }
}

/// Records an isolated child's change set after a run, into its report
/// (and its receipts' `changed`).
pub(crate) fn record(inner: &Inner, report: &mut ChildReport) {
    let Some(isolation) = inner.isolation.get() else { return };
    match isolation.record(&report.subagent_id) {
        Ok(set) => {
            if let Some(r) = report.receipts.as_mut() {
                r.changed = set.files.iter().map(|f| f.changed()).collect();
            }
            report.changes = Some(set);
        }
        Err(IsolationError::Unknown { .. }) => {}
        Err(e) => {
            log::warn!("the change set of {} was not recorded: {e}", report.subagent_id);
            report.changes_error = Some(e.to_string());
        }
    }
}

/// Removes the worktrees of this profile's children no longer retained
/// whose changes were applied, discarded or empty; pending ones are kept
/// (and listed by `changes --pending`). Another profile's are never
/// looked at: this process's registry view cannot say whether they are
/// retained.
pub(crate) fn sweep(inner: &Inner) {
    let Some(isolation) = inner.isolation.get() else { return };
    let Ok(sets) = isolation.list() else { return };
    let registry = &inner.parts.backend.registry;
    let mine = |s: &&ChangeSet| s.owner.owner_profile == inner.parts.profile;
    // Recorded (never a child still running its first run), not pending,
    // its unit finished (or pruned away) and the child no longer retained.
    let done = |s: &&ChangeSet| s.state != ChangeState::Pending && s.recorded_at.is_some();
    for set in sets.iter().filter(mine).filter(done) {
        let id = &set.owner.subagent_id;
        let finished = match inner.parts.backend.controls.unit_view(id) {
            Ok(Some(unit)) => unit.is_finished(),
            Ok(None) => true,
            Err(_) => false,
        };
        if finished && matches!(registry.find_retained_child(id), Ok(None)) {
            match isolation.forget(id) {
                Ok(true) => log::info!("the worktree of {id} (no longer retained) was removed"),
                Ok(false) => {}
                Err(e) => log::warn!("the worktree of {id} was not removed: {e}"),
            }
        }
    }
}

impl crate::Delegator {
    /// The collector over this delegator's registry, authority and worktrees.
    pub fn collector(&self) -> Collector {
        let parts = &self.inner.parts;
        let collector =
            Collector::new(parts.backend.clone(), parts.authority.clone(), &parts.profile);
        match self.inner.isolation.get() {
            Some(i) => collector.with_isolation(Arc::clone(i)),
            None => collector,
        }
    }
}

impl Collector {
    /// The same collector over `isolation`'s worktrees (`changes`,
    /// `apply`, `discard`).
    pub fn with_isolation(mut self, isolation: Arc<dyn Isolation>) -> Collector {
        self.isolation = Some(isolation);
        self
    }

    /// The collector's worktrees, or the error every command answers
    /// without them.
    fn isolation(&self) -> Result<&Arc<dyn Isolation>, DelegateError> {
        self.isolation.as_ref().ok_or_else(|| {
            DelegateError::Isolation(IsolationError::Io {
                operation: "change sets".to_owned(),
                message: "this process has no worktree support".to_owned(),
            })
        })
    }

    /// Whether `decider` may see and act on `set` (the follow-up rule:
    /// the spawning parent's compression lineage, same profile; or the
    /// operator within the collector's profile).
    fn may_change(&self, set: &ChangeSet, decider: Decider<'_>) -> bool {
        let owner = &set.owner;
        if !Scope::of(&self.profile).admits(Some(owner.owner_profile.as_str())) {
            return false;
        }
        match decider {
            Decider::Operator { .. } => true,
            Decider::Parent(parent) => {
                let entry = RetainedChild {
                    delegation_id: owner.delegation_id.clone(),
                    parent_session_id: owner.parent_session_id.clone(),
                    owner_profile: owner.owner_profile.clone(),
                    state: UnitState::Completed,
                    retained_at: None,
                    completed_at: None,
                    child_index: 0,
                    subagent_id: owner.subagent_id.clone(),
                    child_session_id: String::new(),
                    manifest: ChildManifest::default(),
                };
                let requester =
                    parent.session_id.as_deref().map(str::trim).filter(|s| !s.is_empty());
                self.authority.check_follow_up_authority(&entry, requester).is_ok()
            }
        }
    }

    /// The change set of `id` (a subagent id), when `decider` may see it;
    /// a foreign one is answered as a missing one.
    pub fn change_set(
        &self,
        id: &str,
        decider: Decider<'_>,
        diff: bool,
    ) -> Result<ChangeSet, DelegateError> {
        let missing = || {
            DelegateError::Isolation(IsolationError::Unknown { subagent_id: id.trim().to_owned() })
        };
        let set =
            self.isolation()?.change_set(id.trim(), diff).map_err(DelegateError::Isolation)?;
        set.filter(|s| self.may_change(s, decider)).ok_or_else(missing)
    }

    /// Every change set `decider` may see (`pending_only`: those neither
    /// applied nor discarded).
    pub fn change_sets(
        &self,
        decider: Decider<'_>,
        pending_only: bool,
    ) -> Result<Vec<ChangeSet>, DelegateError> {
        let sets = self.isolation()?.list().map_err(DelegateError::Isolation)?;
        Ok(sets
            .into_iter()
            .filter(|s| !pending_only || s.state == ChangeState::Pending)
            .filter(|s| self.may_change(s, decider))
            .collect())
    }

    /// Applies `id`'s change set to its parent's workspace.
    pub fn apply_changes(
        &self,
        id: &str,
        decider: Decider<'_>,
    ) -> Result<ChangeSet, DelegateError> {
        let set = self.change_set(id, decider, false)?;
        self.isolation()?.apply(&set.owner.subagent_id).map_err(DelegateError::Isolation)
    }

    /// Drops `id`'s change set and removes its worktree.
    pub fn discard_changes(
        &self,
        id: &str,
        decider: Decider<'_>,
    ) -> Result<ChangeSet, DelegateError> {
        let set = self.change_set(id, decider, false)?;
        self.isolation()?.discard(&set.owner.subagent_id).map_err(DelegateError::Isolation)
    }
}
