//! Background delegation over MCP (issue #26): the MCP Tasks extension
//! (`io.modelcontextprotocol/tasks`, SEP-2663) answered from the registry,
//! and the tools for hosts without it (`wait_subagents`, `steer_subagent`,
//! `cancel_subagent`).
//!
//! A task is a delegation unit: its id is the delegation id and its state is
//! the unit's, read from the registry on every `tasks/get` — so a restarted
//! server answers for a task started before the restart, and a unit whose
//! server died is recovered as `unknown` and reported `failed`. A task
//! belongs to its session: another session's task id answers exactly as an
//! unknown one.

use std::time::Duration;

use retinue_core::{ControlOutcome, UnitState, UnitView, iso8601};
use retinue_delegate::{
    CancelToken, Collector, Decider, DelegateError, ParentContext, Ruling, approval_json,
    change_set_json,
};
use rmcp::ErrorData as RpcError;
use rmcp::model::{DetailedTask, GetTaskResult, JsonObject, Task, TaskPayload, TaskStatus};
use serde_json::{Map, Value, json};

use crate::tools::{self, DEFAULT_WAIT_SECS, MAX_WAIT_SECS};

/// How often a client should poll `tasks/get`, in milliseconds.
const POLL_INTERVAL_MS: u64 = 1_000;

/// The wall clock, through core's [`retinue_core::Clock`].
fn now() -> f64 {
    retinue_core::Clock::now(&retinue_core::SystemClock)
}

/// A task just created, before the registry is read again.
pub(crate) fn working(id: &str) -> Task {
    let at = iso8601(now());
    let mut task = Task::new(id, TaskStatus::Working, at.clone(), at);
    task.poll_interval_ms = Some(POLL_INTERVAL_MS);
    task
}

fn object(v: Value) -> JsonObject {
    match v {
        Value::Object(m) => m,
        other => {
            let mut m = Map::new();
            m.insert("value".to_owned(), other);
            m
        }
    }
}

/// Whether a finished unit was stopped by its parent (`tasks/cancel`,
/// `cancel_subagent`, `retinue cancel`).
fn cancelled(view: &UnitView) -> bool {
    view.result
        .as_ref()
        .and_then(|r| r["results"].as_array())
        .is_some_and(|rs| rs.iter().any(|r| r["exit_reason"] == "cancelled"))
}

/// The unit as a task: `working` while it runs; `cancelled` when its parent
/// stopped it; `failed` when its server died (`unknown`); else `completed`
/// with the `tools/call` result the call would have returned.
pub(crate) fn detailed(view: &UnitView) -> DetailedTask {
    let created = iso8601(view.dispatched_at);
    let updated = iso8601(view.completed_at.unwrap_or_else(now));
    let mut task = Task::new(view.delegation_id.clone(), TaskStatus::Working, created, updated);
    task.poll_interval_ms = Some(POLL_INTERVAL_MS);
    let payload = if !view.is_finished() {
        task.status_message = Some(format!("{} subagent(s) working", view.children.len()));
        TaskPayload::Working
    } else if view.state == UnitState::Unknown {
        task.status_message = Some("the server running it stopped".to_owned());
        TaskPayload::Failed {
            error: object(json!({
                "code": -32603,
                "message": "The server running this delegation stopped before it finished; \
                            recovery marked the unit `unknown`. Its children's transcripts are \
                            kept; follow up a child with delegate_task(follow_up=…) to resume it.",
                "data": {"delegation_id": view.delegation_id, "state": "unknown"},
            })),
        }
    } else if cancelled(view) {
        TaskPayload::Cancelled
    } else {
        let body =
            view.result.clone().unwrap_or_else(|| json!({"delegation_id": view.delegation_id}));
        let result = tools::text_result(&body);
        TaskPayload::Completed {
            result: object(serde_json::to_value(result).unwrap_or(Value::Null)),
        }
    };
    DetailedTask::new(task, payload)
}

fn unknown_task(id: &str) -> RpcError {
    RpcError::invalid_params(format!("unknown task '{}'", id.trim()), None)
}

/// `tasks/get`: the unit's state from the registry. A unit still marked
/// running by a process that is gone is recovered first (`unknown`). A
/// completed result read here is delivered: it is not attached to a later
/// tool result again.
pub(crate) fn get(
    collector: &Collector,
    parent: &ParentContext,
    id: &str,
) -> Result<GetTaskResult, RpcError> {
    let mut view = collector.unit(id, parent).map_err(|_| unknown_task(id))?;
    let ours = view.owner_pid == Some(i64::from(std::process::id()));
    if !view.is_finished() && !ours {
        collector.recover_dead_workers();
        view = collector.unit(id, parent).map_err(|_| unknown_task(id))?;
    }
    if view.is_finished() && !view.is_delivered() {
        collector.mark_delivered(&view.delegation_id);
    }
    Ok(GetTaskResult::new(detailed(&view)))
}

/// `tasks/cancel`: stops the unit's children (exit reason `cancelled`); the
/// next `tasks/get` says `cancelled`. A finished task is refused.
pub(crate) fn cancel(
    collector: &Collector,
    parent: &ParentContext,
    id: &str,
) -> Result<(), RpcError> {
    match collector.cancel_unit(id, parent) {
        Ok(r) if r.outcome == ControlOutcome::Delivered => Ok(()),
        Ok(_) => Err(RpcError::internal_error(
            format!(
                "no worker took the cancel of task '{}' within 10 s; its worker may be gone \
                 (the next tasks/get recovers it)",
                id.trim()
            ),
            None,
        )),
        Err(DelegateError::NotAddressable { .. }) => Err(unknown_task(id)),
        Err(e) => Err(RpcError::invalid_params(e.to_string(), None)),
    }
}

fn failure(e: &DelegateError) -> (String, Value) {
    let mut v = json!({ "error": e.to_string(), "code": e.kind().as_str() });
    if let DelegateError::Isolation(retinue_core::run::IsolationError::Conflict { files, .. }) = e {
        v["files"] = json!(files);
    }
    (e.to_string(), v)
}

fn usage(message: &str) -> (String, Value) {
    (message.to_owned(), json!({ "error": message, "code": "usage" }))
}

fn string_arg<'a>(args: &'a Map<String, Value>, key: &str) -> Result<&'a str, (String, Value)> {
    match args.get(key) {
        Some(Value::String(s)) if !s.trim().is_empty() => Ok(s.as_str()),
        _ => Err(usage(&format!("'{key}' must be a non-empty string."))),
    }
}

/// Whether the request (as JSON) is of a unit or child among `ids`.
fn awaited(request: &Value, ids: &[String]) -> bool {
    ["delegation_id", "subagent_id"]
        .iter()
        .any(|k| request[*k].as_str().is_some_and(|v| ids.iter().any(|id| id.trim() == v)))
}

/// The pending approval requests of `parent`'s subagents, as JSON (`None`:
/// the registry could not be read).
pub(crate) fn pending_approvals(
    collector: &Collector,
    parent: &ParentContext,
) -> Option<Vec<Value>> {
    collector
        .approvals(Decider::Parent(parent), false)
        .ok()
        .map(|list| list.iter().map(approval_json).collect())
}

/// `wait_subagents`: waits for the units `ids`, ending early (as a peek,
/// nothing consumed) when one of them waits for the user's approval.
fn wait_tool(
    collector: &Collector,
    parent: &ParentContext,
    args: &Map<String, Value>,
    cancel: &CancelToken,
) -> Result<Value, (String, Value)> {
    let ids: Vec<String> = match args.get("ids") {
        Some(Value::Array(items)) if !items.is_empty() => items
            .iter()
            .map(|v| v.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| usage("'ids' must be an array of id strings."))?,
        Some(Value::String(one)) => vec![one.clone()],
        _ => return Err(usage("'ids' must be a non-empty array of ids.")),
    };
    let secs = match args.get("timeout_seconds") {
        None | Some(Value::Null) => DEFAULT_WAIT_SECS,
        Some(v) => match v.as_f64() {
            Some(s) if s.is_finite() && (0.0..=MAX_WAIT_SECS).contains(&s) => s,
            _ => {
                return Err(usage(&format!(
                    "'timeout_seconds' must be a number from 0 to {MAX_WAIT_SECS}."
                )));
            }
        },
    };
    let timeout = Duration::try_from_secs_f64(secs).unwrap_or(Duration::ZERO);
    // A unit waiting for the host's user must not keep the host
    // waiting for the unit: a pending approval ends the wait (as a
    // peek: nothing is consumed) and is reported.
    let done = std::sync::atomic::AtomicBool::new(false);
    let waited = std::thread::scope(|s| {
        s.spawn(|| {
            while !done.load(std::sync::atomic::Ordering::SeqCst) && !cancel.is_cancelled() {
                if pending_approvals(collector, parent)
                    .is_some_and(|p| p.iter().any(|a| awaited(a, &ids)))
                {
                    cancel.cancel();
                    break;
                }
                std::thread::sleep(Duration::from_millis(retinue_core::CONTROL_POLL_MS));
            }
        });
        let waited = collector.wait(&ids, parent, timeout, false, cancel);
        done.store(true, std::sync::atomic::Ordering::SeqCst);
        waited
    });
    let mut out = waited.map(|r| r.to_json()).map_err(|e| failure(&e))?;
    let waiting: Vec<Value> = pending_approvals(collector, parent)
        .unwrap_or_default()
        .into_iter()
        .filter(|a| awaited(a, &ids))
        .collect();
    if !waiting.is_empty() {
        out["approval_required"] = Value::Array(waiting);
    }
    Ok(out)
}

/// The bodies of `wait_subagents`, `steer_subagent` and `cancel_subagent`
/// (blocking; `cancel` stops a wait when the client cancels the call).
pub(crate) fn run_tool(
    collector: &Collector,
    parent: &ParentContext,
    name: &str,
    args: &Map<String, Value>,
    cancel: &CancelToken,
) -> Result<Value, (String, Value)> {
    match name {
        tools::WAIT_SUBAGENTS => wait_tool(collector, parent, args, cancel),
        tools::STEER_SUBAGENT => {
            let id = string_arg(args, "id")?;
            let message = string_arg(args, "message")?;
            let report = collector.steer(id, message, parent).map_err(|e| failure(&e))?;
            let mut out = report.to_json();
            if report.outcome == ControlOutcome::Missed {
                out["note"] = json!(
                    "The subagent had already finished; the message was not delivered. \
                     Follow it up with delegate_task(follow_up=<subagent_id>, goal=<message>)."
                );
            }
            Ok(out)
        }
        tools::CANCEL_SUBAGENT => {
            let id = string_arg(args, "id")?;
            collector.cancel_unit(id, parent).map(|r| r.to_json()).map_err(|e| failure(&e))
        }
        tools::LIST_APPROVALS => {
            let all = args.get("all").and_then(Value::as_bool).unwrap_or(false);
            let listed =
                collector.approvals(Decider::Parent(parent), all).map_err(|e| failure(&e))?;
            Ok(json!({ "approvals": listed.iter().map(approval_json).collect::<Vec<_>>() }))
        }
        tools::DECIDE_APPROVAL => {
            let id = string_arg(args, "approval_id")?;
            let Some(approve) = args.get("approve").and_then(Value::as_bool) else {
                return Err(usage("'approve' must be true or false."));
            };
            let reason = args.get("reason").and_then(Value::as_str).map(str::to_owned);
            let verdict = if approve {
                Ruling::Approve {
                    always: args.get("always").and_then(Value::as_bool).unwrap_or(false),
                }
            } else {
                Ruling::Deny { reason }
            };
            collector
                .decide(id, Decider::Parent(parent), &verdict)
                .map(|r| approval_json(&r))
                .map_err(|e| failure(&e))
        }
        tools::SUBAGENT_CHANGES => {
            let flag = |k: &str| args.get(k).and_then(Value::as_bool).unwrap_or(false);
            let decider = Decider::Parent(parent);
            match args.get("id").and_then(Value::as_str).filter(|s| !s.trim().is_empty()) {
                Some(id) => collector
                    .change_set(id, decider, flag("diff"))
                    .map(|s| change_set_json(&s))
                    .map_err(|e| failure(&e)),
                None => collector
                    .change_sets(decider, flag("pending"))
                    .map(|sets| json!({"changes": sets.iter().map(change_set_json).collect::<Vec<_>>()}))
                    .map_err(|e| failure(&e)),
            }
        }
        tools::APPLY_CHANGES => {
            let id = string_arg(args, "id")?;
            collector
                .apply_changes(id, Decider::Parent(parent))
                .map(|s| change_set_json(&s))
                .map_err(|e| failure(&e))
        }
        tools::DISCARD_CHANGES => {
            let id = string_arg(args, "id")?;
            collector
                .discard_changes(id, Decider::Parent(parent))
                .map(|s| change_set_json(&s))
                .map_err(|e| failure(&e))
        }
        other => Err(usage(&format!("unknown tool '{other}'"))),
    }
}
