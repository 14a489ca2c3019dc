//! The tool's JSON forms: the request read from `delegate_task`'s
//! arguments, the outcome written as its result.

use retinue_core::Role;
use serde_json::{Value, json};

use super::args::{parse_call_budget, parse_follow_up, parse_isolation, parse_tasks};
use crate::error::DelegateError;
use crate::request::{DelegateOutcome, DelegateRequest, SpawnRequest};
use crate::results::seconds;
use crate::texts;

impl DelegateRequest {
    /// Parses the tool's JSON arguments (a non-object reads as `{}`).
    pub fn from_json(args: &Value) -> Result<DelegateRequest, DelegateError> {
        let empty = json!({});
        let args = if args.is_object() { args } else { &empty };
        if let Some(fu) = parse_follow_up(args) {
            return fu.map(DelegateRequest::FollowUp);
        }
        let tasks = parse_tasks(args, usize::MAX)?;
        let budget = parse_call_budget(args)?;
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
            isolation: parse_isolation(args.get("isolation"))?,
            tasks,
            role: args.get("role").and_then(Value::as_str).map_or(Role::Leaf, Role::parse),
            background: args.get("background").and_then(Value::as_bool).unwrap_or(false),
        }))
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
}
