//! The typed core's request and outcome, and their JSON forms.
//!
//! [`DelegateRequest::from_json`] is the parsing half of the JSON tool and
//! [`DelegateOutcome::to_json`] its rendering half; between them sits
//! [`crate::Delegator::delegate`].

use retinue_core::{BudgetLimit, BudgetStatus, Role};
use serde_json::{Value, json};

use crate::args::{FollowUp, TaskSpec, parse_follow_up, parse_tasks};
use crate::error::DelegateError;
use crate::results::{ChildReport, seconds};
use crate::texts;

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
}

/// One `delegate_task` call.
#[derive(Debug, Clone, PartialEq)]
pub enum DelegateRequest {
    /// Start new children.
    Spawn(SpawnRequest),
    /// Steer a running child or resume a retained one.
    FollowUp(FollowUp),
}

impl DelegateRequest {
    /// Parses the tool's JSON arguments (a non-object reads as `{}`).
    pub fn from_json(args: &Value) -> Result<DelegateRequest, DelegateError> {
        let empty = json!({});
        let args = if args.is_object() { args } else { &empty };
        if let Some(fu) = parse_follow_up(args) {
            return fu.map(DelegateRequest::FollowUp);
        }
        let tasks = parse_tasks(args, usize::MAX)?;
        let budget = crate::budget::parse_call_budget(args)?;
        let toolsets = match args.get("toolsets") {
            None | Some(Value::Null) => None,
            Some(Value::Array(items)) => Some(
                items
                    .iter()
                    .map(|i| i.as_str().map(|s| s.trim().to_owned()))
                    .collect::<Option<Vec<_>>>()
                    .ok_or_else(|| {
                        DelegateError::InvalidArguments(
                            "toolsets must be an array of toolset names".to_owned(),
                        )
                    })?,
            ),
            Some(_) => {
                return Err(DelegateError::InvalidArguments(
                    "toolsets must be an array of toolset names".to_owned(),
                ));
            }
        };
        Ok(DelegateRequest::Spawn(SpawnRequest {
            budget,
            toolsets,
            tasks,
            role: args.get("role").and_then(Value::as_str).map_or(Role::Leaf, Role::parse),
            background: args.get("background").and_then(Value::as_bool).unwrap_or(false),
        }))
    }
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
    /// The tool's JSON result.
    pub fn to_json(&self) -> Value {
        match self {
            DelegateOutcome::Completed(unit) => {
                let mut out = unit.body();
                if let Some(note) = &unit.note {
                    out["note"] = json!(note);
                }
                if let Some(budget) = &unit.budget {
                    out["budget"] = retinue_usage::budget_json(budget);
                }
                if let Some(e) = &unit.ledger_error {
                    out["ledger_error"] = json!(e);
                }
                out
            }
            DelegateOutcome::Dispatched(d) => json!({
                "status": "dispatched",
                "mode": "background",
                "count": d.goals.len(),
                "delegation_id": d.delegation_id,
                "goals": d.goals,
                "children": d.children.iter().map(|c| json!({
                    "subagent_id": c.subagent_id,
                    "session_id": c.session_id,
                    "model": c.model,
                    "goal": c.goal,
                })).collect::<Vec<_>>(),
                "note": if d.queued {
                    texts::BACKGROUND_QUEUED_NOTE
                } else {
                    texts::BACKGROUND_NOTE
                },
                "queued": d.queued,
            }),
            DelegateOutcome::Steered { child_id } => json!({
                "status": "queued",
                "mode": "follow_up",
                "child_id": child_id,
                "receipt": texts::STEER_RECEIPT,
            }),
            DelegateOutcome::FollowedUp(f) => {
                let mut out = json!({
                    "mode": "follow_up",
                    "child_id": f.child_id,
                    "child_session_id": f.child_session_id,
                    "delegation_id": f.delegation_id,
                    "results": [f.result.to_json()],
                    "total_duration_seconds": seconds(f.total_duration_seconds),
                    "note": if f.budget.is_some() {
                        texts::RESUME_NOTE_CHARGED
                    } else {
                        texts::RESUME_NOTE
                    },
                });
                if let Some(budget) = &f.budget {
                    out["budget"] = retinue_usage::budget_json(budget);
                }
                if let Some(e) = &f.ledger_error {
                    out["ledger_error"] = json!(e);
                }
                out
            }
        }
    }

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
