//! The typed core's request and outcome: what [`crate::Delegator::delegate`]
//! takes and returns. Their JSON forms are the tool's ([`crate::tool`]).

use retinue_core::run::IsolationMode;
use retinue_core::{BudgetLimit, BudgetStatus, Role};
use serde_json::{Value, json};

use crate::error::DelegateError;
use crate::results::{ChildReport, seconds};
use crate::texts;

/// One task of a spawn.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TaskSpec {
    /// The goal (non-blank).
    pub goal: String,
    /// Extra context.
    pub context: Option<String>,
    /// Per-task role.
    pub role: Option<String>,
    /// Per-task isolation (`None`: the call's, else `delegation.isolation`).
    pub isolation: Option<IsolationMode>,
}

/// A follow-up request.
#[derive(Debug, Clone, PartialEq)]
pub struct FollowUp {
    /// The addressed id, as given.
    pub target: String,
    /// The message: trimmed goal, plus `\n\nContext: <context>`.
    pub text: String,
}

/// A malformed argument: [`DelegateError::InvalidArguments`] with hermes's text.
pub(crate) fn invalid(text: impl Into<String>) -> DelegateError {
    DelegateError::InvalidArguments(text.into())
}

impl FollowUp {
    /// A follow-up to `target` (non-blank) with `goal` (non-blank) and an
    /// optional `context`, checked in hermes's order with hermes's texts.
    pub fn new(
        target: &str,
        goal: Option<&str>,
        context: Option<&str>,
    ) -> Result<FollowUp, DelegateError> {
        if target.trim().is_empty() {
            return Err(invalid(texts::FOLLOW_UP_BLANK));
        }
        let clean = |s: Option<&str>| s.map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned);
        let Some(goal) = clean(goal) else {
            return Err(invalid(texts::FOLLOW_UP_NO_GOAL));
        };
        let text = match clean(context) {
            Some(ctx) => format!("{goal}\n\nContext: {ctx}"),
            None => goal,
        };
        Ok(FollowUp { target: target.to_owned(), text })
    }
}

/// A spawn of one or more children.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SpawnRequest {
    /// The tasks, one child each (at least one).
    pub tasks: Vec<TaskSpec>,
    /// The role asked for children whose task names none.
    pub role: Role,
    /// Run in the background (when the parent can receive detached results).
    pub background: bool,
    /// The call's own budget for its children (it can only narrow
    /// `delegation.budget`, never widen it).
    pub budget: BudgetLimit,
    /// The call's `toolsets`: narrows what the children get (`None`: what
    /// the parent and `delegation.toolsets` allow).
    pub toolsets: Option<Vec<String>>,
    /// The call's `isolation` (`None`: `delegation.isolation`).
    pub isolation: Option<IsolationMode>,
}

/// One `delegate_task` call.
#[derive(Debug, Clone, PartialEq)]
pub enum DelegateRequest {
    /// Start new children.
    Spawn(SpawnRequest),
    /// Steer a running child or resume a retained one.
    FollowUp(FollowUp),
}

/// A finished synchronous spawn.
#[derive(Debug, Clone, PartialEq, Default)]
#[non_exhaustive]
pub struct UnitReport {
    /// The unit's id.
    pub delegation_id: String,
    /// One entry per child, by task index.
    pub results: Vec<ChildReport>,
    /// Wall time of the whole unit.
    pub total_duration_seconds: f64,
    /// Notes (ran synchronously because …), joined by a space.
    pub note: Option<String>,
    /// The lineage budget after the run (`limit`, `spent`, `reserved`,
    /// `remaining`), when one is configured.
    pub budget: Option<BudgetStatus>,
    /// Set when the usage ledger could not be written: the spend is kept
    /// in the budget as spent, and the caller must report a failure.
    pub ledger_error: Option<String>,
}

/// A child started in the background.
#[derive(Debug, Clone, PartialEq, Default)]
#[non_exhaustive]
pub struct DispatchedChild {
    /// The subagent id.
    pub subagent_id: String,
    /// Its session.
    pub session_id: String,
    /// Its model.
    pub model: Option<String>,
    /// Its goal, clipped.
    pub goal: String,
}

/// A unit started in the background.
#[derive(Debug, Clone, PartialEq, Default)]
#[non_exhaustive]
pub struct Dispatch {
    /// The unit's id.
    pub delegation_id: String,
    /// The goals.
    pub goals: Vec<String>,
    /// The children.
    pub children: Vec<DispatchedChild>,
    /// Background capacity was full: the unit waits for a slot.
    pub queued: bool,
}

/// A finished follow-up on a retained child.
#[derive(Debug, Clone, PartialEq, Default)]
#[non_exhaustive]
pub struct FollowUpReport {
    /// The child's id (subagent id, or its session id when it has none).
    pub child_id: String,
    /// The session the follow-up ran on (the compression tip).
    pub child_session_id: String,
    /// The child's unit.
    pub delegation_id: String,
    /// The run.
    pub result: ChildReport,
    /// Wall time.
    pub total_duration_seconds: f64,
    /// The lineage budget after the run, when one is configured.
    pub budget: Option<BudgetStatus>,
    /// Set when the usage ledger could not be written (see [`UnitReport`]).
    pub ledger_error: Option<String>,
}

/// What a successful call did.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum DelegateOutcome {
    /// A synchronous spawn ran to completion.
    Completed(UnitReport),
    /// A background spawn was dispatched.
    Dispatched(Dispatch),
    /// A follow-up was queued into a running child.
    Steered {
        /// The id as given (trimmed).
        child_id: String,
    },
    /// A follow-up resumed a retained child.
    FollowedUp(Box<FollowUpReport>),
}

impl UnitReport {
    /// `{delegation_id, results, total_duration_seconds}` (no note).
    pub(crate) fn body(&self) -> Value {
        json!({
            "delegation_id": self.delegation_id,
            "results": self.results.iter().map(ChildReport::to_json).collect::<Vec<_>>(),
            "total_duration_seconds": seconds(self.total_duration_seconds),
        })
    }
}

impl DelegateOutcome {
    /// Why the usage ledger could not be written, if it could not (the
    /// caller must report a failure: the spend is kept as spent).
    pub fn ledger_error(&self) -> Option<&str> {
        match self {
            DelegateOutcome::Completed(u) => u.ledger_error.as_deref(),
            DelegateOutcome::FollowedUp(f) => f.ledger_error.as_deref(),
            DelegateOutcome::Dispatched(_) | DelegateOutcome::Steered { .. } => None,
        }
    }

    /// The note the tool's result carries (`note`), if any.
    pub fn note(&self) -> Option<&str> {
        match self {
            DelegateOutcome::Completed(u) => u.note.as_deref(),
            DelegateOutcome::Dispatched(_) => Some(texts::BACKGROUND_NOTE),
            DelegateOutcome::FollowedUp(f) => Some(if f.budget.is_some() {
                texts::RESUME_NOTE_CHARGED
            } else {
                texts::RESUME_NOTE
            }),
            DelegateOutcome::Steered { .. } => None,
        }
    }

    /// The child reports this outcome carries.
    pub fn results(&self) -> &[ChildReport] {
        match self {
            DelegateOutcome::Completed(u) => &u.results,
            DelegateOutcome::FollowedUp(f) => std::slice::from_ref(&f.result),
            DelegateOutcome::Dispatched(_) | DelegateOutcome::Steered { .. } => &[],
        }
    }
}
