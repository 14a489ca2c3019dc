//! Parsing `delegate_task` arguments into a request, in hermes's check order.

use retinue_core::BudgetLimit;
use retinue_core::run::IsolationMode;
use serde_json::Value;

use crate::error::DelegateError;
use crate::request::{FollowUp, TaskSpec, invalid};
use crate::texts;

fn non_blank(v: Option<&Value>) -> Option<String> {
    v.and_then(Value::as_str).map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned)
}

/// Reads an `isolation` value: absent or null is `None`; otherwise
/// `"worktree"` or `"none"`.
pub(crate) fn parse_isolation(v: Option<&Value>) -> Result<Option<IsolationMode>, DelegateError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => IsolationMode::parse(s).map(Some).ok_or_else(|| {
            invalid(format!("isolation must be \"worktree\" or \"none\", not {s:?}"))
        }),
        Some(_) => Err(invalid("isolation must be \"worktree\" or \"none\"")),
    }
}

/// Reads the `follow_up` part: `None` when absent or null.
pub fn parse_follow_up(args: &Value) -> Option<Result<FollowUp, DelegateError>> {
    let raw = args.get("follow_up").filter(|v| !v.is_null())?;
    let Some(target) = raw.as_str() else {
        return Some(Err(invalid(texts::FOLLOW_UP_NOT_STRING)));
    };
    let text = |k: &str| args.get(k).and_then(Value::as_str);
    Some(FollowUp::new(target, text("goal"), text("context")))
}

impl TaskSpec {
    /// The tasks of a spawn: the items of `tasks` (each an object with a
    /// non-blank `goal`, optional `context` and `role`) when there are any,
    /// else one task of `goal` and `context`; at most `max`. Checked in
    /// hermes's order with hermes's texts.
    pub fn list(
        tasks: Option<&[Value]>,
        goal: Option<&str>,
        context: Option<&str>,
        max: usize,
    ) -> Result<Vec<TaskSpec>, DelegateError> {
        let clean = |s: Option<&str>| s.map(str::trim).filter(|s| !s.is_empty()).map(str::to_owned);
        let specs = match tasks {
            Some(items) if !items.is_empty() => {
                let mut specs = Vec::with_capacity(items.len());
                for (i, item) in items.iter().enumerate() {
                    let Some(obj) = item.as_object() else {
                        return Err(invalid(texts::task_not_object(i)));
                    };
                    let Some(goal) = non_blank(obj.get("goal")) else {
                        return Err(invalid(texts::task_missing_goal(i)));
                    };
                    specs.push(TaskSpec {
                        goal,
                        context: non_blank(obj.get("context")),
                        role: non_blank(obj.get("role")),
                        isolation: parse_isolation(obj.get("isolation"))?,
                    });
                }
                specs
            }
            _ => match clean(goal) {
                Some(goal) => {
                    vec![TaskSpec { goal, context: clean(context), ..TaskSpec::default() }]
                }
                None => return Err(invalid(texts::NO_GOAL_OR_TASKS)),
            },
        };
        if specs.len() > max {
            return Err(invalid(texts::too_many_tasks(specs.len(), max)));
        }
        Ok(specs)
    }
}

/// Reads the tasks of a spawn; `max` is `max_concurrent_children`.
pub fn parse_tasks(args: &Value, max: usize) -> Result<Vec<TaskSpec>, DelegateError> {
    let tasks = match args.get("tasks") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(Value::Array(items)) => Some(items),
            _ => return Err(invalid(texts::TASKS_NOT_ARRAY)),
        },
        Some(Value::Array(items)) => Some(items.clone()),
        Some(_) => return Err(invalid(texts::TASKS_NOT_ARRAY)),
    };
    let text = |k: &str| args.get(k).and_then(Value::as_str);
    TaskSpec::list(tasks.as_deref(), text("goal"), text("context"), max)
}

/// The call's `budget` argument: `{max_cost_usd, max_tokens}`, non-negative
/// numbers; anything else is an invalid argument.
pub(super) fn parse_call_budget(args: &Value) -> Result<BudgetLimit, DelegateError> {
    let Some(raw) = args.get("budget").filter(|v| !v.is_null()) else {
        return Ok(BudgetLimit::default());
    };
    let bad = || DelegateError::InvalidArguments(crate::texts::BAD_BUDGET.to_owned());
    let obj = raw.as_object().ok_or_else(bad)?;
    let mut limit = BudgetLimit::default();
    if let Some(v) = obj.get("max_cost_usd").filter(|v| !v.is_null()) {
        let f = v.as_f64().filter(|f| f.is_finite() && *f >= 0.0).ok_or_else(bad)?;
        limit.max_cost_usd = Some(f);
    }
    if let Some(v) = obj.get("max_tokens").filter(|v| !v.is_null()) {
        limit.max_tokens = Some(v.as_u64().ok_or_else(bad)?);
    }
    Ok(limit)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// `parse_tasks` with its error as the wire text.
    fn tasks(args: &Value, max: usize) -> Result<Vec<TaskSpec>, String> {
        parse_tasks(args, max).map_err(|e| e.to_string())
    }

    #[test]
    fn follow_up_validation_order() {
        assert!(parse_follow_up(&json!({"goal": "x"})).is_none());
        assert!(parse_follow_up(&json!({"follow_up": null})).is_none());
        let err = |v: Value| parse_follow_up(&v).and_then(Result::err).map(|e| e.to_string());
        assert_eq!(
            err(json!({"follow_up": 3, "goal": "x"})).as_deref(),
            Some(texts::FOLLOW_UP_NOT_STRING)
        );
        assert_eq!(
            err(json!({"follow_up": "", "goal": "x"})).as_deref(),
            Some(texts::FOLLOW_UP_BLANK)
        );
        assert_eq!(
            err(json!({"follow_up": " \t", "goal": "x"})).as_deref(),
            Some(texts::FOLLOW_UP_BLANK)
        );
        assert_eq!(
            err(json!({"follow_up": "sa", "context": "c"})).as_deref(),
            Some(texts::FOLLOW_UP_NO_GOAL)
        );
        assert_eq!(
            err(json!({"follow_up": "sa", "goal": "  "})).as_deref(),
            Some(texts::FOLLOW_UP_NO_GOAL)
        );
        let ok = parse_follow_up(&json!({"follow_up": "sa", "goal": " hi ", "context": "c"}))
            .map(|r| r.map_err(|e| e.to_string()));
        assert_eq!(ok, Some(Ok(FollowUp { target: "sa".into(), text: "hi\n\nContext: c".into() })));
    }

    #[test]
    fn task_validation() {
        assert_eq!(tasks(&json!({}), 3), Err(texts::NO_GOAL_OR_TASKS.to_owned()));
        assert_eq!(tasks(&json!({"tasks": "nope"}), 3), Err(texts::TASKS_NOT_ARRAY.to_owned()));
        assert_eq!(tasks(&json!({"tasks": 5}), 3), Err(texts::TASKS_NOT_ARRAY.to_owned()));
        assert_eq!(tasks(&json!({"tasks": [1]}), 3), Err(texts::task_not_object(0)));
        assert_eq!(
            tasks(&json!({"tasks": [{"goal": "a"}, {"context": "c"}]}), 3),
            Err(texts::task_missing_goal(1))
        );
        assert_eq!(
            tasks(&json!({"tasks": [{"goal": "a"}, {"goal": "b"}]}), 1),
            Err("Too many tasks: 2 exceeds delegation.max_concurrent_children (1).".to_owned())
        );
        let t = tasks(&json!({"tasks": "[{\"goal\": \"a\", \"role\": \"leaf\"}]"}), 3).expect("ok");
        assert_eq!(t[0].goal, "a");
        assert_eq!(t[0].role.as_deref(), Some("leaf"));
        let single = tasks(&json!({"goal": "g", "context": "c"}), 3).expect("ok");
        assert_eq!(
            single,
            vec![TaskSpec { goal: "g".into(), context: Some("c".into()), ..TaskSpec::default() }]
        );
    }

    #[test]
    fn call_budgets_are_validated() {
        assert_eq!(parse_call_budget(&json!({})).ok(), Some(BudgetLimit::default()));
        let ok = parse_call_budget(&json!({"budget": {"max_cost_usd": 0.5, "max_tokens": 10}}));
        assert_eq!(ok.ok(), Some(BudgetLimit { max_cost_usd: Some(0.5), max_tokens: Some(10) }));
        for bad in [
            json!({"budget": 3}),
            json!({"budget": {"max_cost_usd": -1}}),
            json!({"budget": {"max_tokens": 1.5}}),
        ] {
            assert!(matches!(parse_call_budget(&bad), Err(DelegateError::InvalidArguments(_))));
        }
    }
}
