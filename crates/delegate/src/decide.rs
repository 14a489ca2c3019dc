//! Deciding approval requests (issue #37) from outside the child's run:
//! the CLI (`retinue approvals`, `approve`, `deny`), the MCP server and the
//! web view all go through [`Collector::approvals`] and
//! [`Collector::decide`], so one authority rule holds everywhere: the
//! child's parent lineage (exactly the follow-up rule) or the home's
//! operator decides; a request outside the decider's tenant or lineage is
//! answered exactly as a missing one.

use retinue_core::{
    ApprovalFilter, ApprovalRequest, ApprovalScope, ApprovalState, DecideOutcome, Decision, Scope,
};

use crate::{Collector, DelegateError, ParentContext};

/// Who decides.
#[derive(Debug, Clone, Copy)]
pub enum Decider<'a> {
    /// The home's operator (within the collector's profile), shown as
    /// `by` (`operator`, `web`, `mcp`).
    Operator {
        /// How the decision is recorded.
        by: &'a str,
    },
    /// A parent session: it may decide the requests of the children its
    /// compression lineage spawned (shown as `session:<id>`).
    Parent(&'a ParentContext),
}

/// A decision, as a decider gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ruling {
    /// Run the call (`always`: and every call like it for the rest of the
    /// child's unit and its follow-ups).
    Approve {
        /// Approve this call and its likes from now on.
        always: bool,
    },
    /// Refuse the call; the model reads the reason.
    Deny {
        /// Why (bounded when stored).
        reason: Option<String>,
    },
}

impl Collector {
    fn scope(&self) -> Scope {
        Scope::of(&self.profile)
    }

    /// Whether `decider` may see and decide `request`.
    fn may_decide(&self, request: &ApprovalRequest, decider: Decider<'_>) -> bool {
        match decider {
            Decider::Operator { .. } => true,
            Decider::Parent(parent) => self.unit(&request.subagent_id, parent).is_ok(),
        }
    }

    /// The approval requests `decider` may decide, newest first: pending
    /// ones, or (`all`) decided ones too.
    pub fn approvals(
        &self,
        decider: Decider<'_>,
        all: bool,
    ) -> Result<Vec<ApprovalRequest>, DelegateError> {
        let filter = ApprovalFilter {
            pending_only: !all,
            limit: 500,
            ..ApprovalFilter::pending(&self.scope())
        };
        let listed =
            self.backend.approvals.list_approvals(&filter).map_err(DelegateError::Registry)?;
        Ok(listed.into_iter().filter(|r| self.may_decide(r, decider)).collect())
    }

    /// The request `id`, when `decider` may see it.
    pub fn approval(
        &self,
        id: &str,
        decider: Decider<'_>,
    ) -> Result<ApprovalRequest, DelegateError> {
        let unknown = || DelegateError::UnknownApproval { id: id.trim().to_owned() };
        let found =
            self.backend.approvals.approval(id, &self.scope()).map_err(DelegateError::Registry)?;
        found.filter(|r| self.may_decide(r, decider)).ok_or_else(unknown)
    }

    /// Records `verdict` on the pending request `id`: the request as
    /// decided, [`DelegateError::AlreadyDecided`] when someone was first (or
    /// it expired), [`DelegateError::UnknownApproval`] for an id that is
    /// missing or not the decider's.
    pub fn decide(
        &self,
        id: &str,
        decider: Decider<'_>,
        verdict: &Ruling,
    ) -> Result<ApprovalRequest, DelegateError> {
        let request = self.approval(id, decider)?;
        let by = match decider {
            Decider::Operator { by } => by.to_owned(),
            Decider::Parent(p) => format!("session:{}", p.session_id.as_deref().unwrap_or("")),
        };
        let decision = match verdict {
            Ruling::Approve { always } => Decision::approve(
                by,
                if *always { ApprovalScope::Always } else { ApprovalScope::Once },
            ),
            Ruling::Deny { reason } => Decision::deny(by, reason.clone()),
        };
        let outcome = self
            .backend
            .approvals
            .decide_approval(&request.approval_id, &self.scope(), &decision)
            .map_err(DelegateError::Registry)?;
        match outcome {
            DecideOutcome::Decided(r) => Ok(r),
            DecideOutcome::AlreadyDecided(r) => Err(DelegateError::AlreadyDecided {
                id: r.approval_id.clone(),
                state: r.state.as_str(),
                decided_by: r.decided_by.clone().unwrap_or_else(|| "someone".to_owned()),
            }),
            DecideOutcome::Missing => {
                Err(DelegateError::UnknownApproval { id: id.trim().to_owned() })
            }
        }
    }
}

/// A request as every surface shows it (the JSON keys).
pub fn approval_json(r: &ApprovalRequest) -> serde_json::Value {
    serde_json::json!({
        "approval_id": r.approval_id,
        "delegation_id": r.delegation_id,
        "subagent_id": r.subagent_id,
        "tool": r.tool,
        "arguments": r.arguments,
        "reason": r.reason,
        "state": r.state.as_str(),
        "scope": r.scope.as_str(),
        "requested_at": r.requested_at,
        "decided_at": r.decided_at,
        "decided_by": r.decided_by,
        "decision_reason": r.decision_reason,
    })
}

/// Whether `r` still waits.
pub fn is_pending(r: &ApprovalRequest) -> bool {
    r.state == ApprovalState::Pending
}
