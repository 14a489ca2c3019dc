//! The spawn flow (spec §6.4): durable unit first, then the children, then
//! finalize, completion, delivery and the history pruner.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use retinue_store::{
    ChildManifest, Completion, DeliveryFilter, Message, NewSession, UnitDraft, current_owner,
    truncate_chars,
};
use retinue_usage::{ChildRun, FinalizeContext, FinalizeEntry, ParentCost, Tokens};
use serde_json::{Value, json};

use crate::args::TaskSpec;
use crate::live::LiveChild;
use crate::results::{ChildResult, SessionSink, status_of};
use crate::runtime::{ChildOutcome, ChildSpec, RunInput};
use crate::{Inner, ParentContext, error, texts};

/// Toolsets a child never inherits.
const BLOCKED_TOOLSETS: &[&str] = &["clarify", "memory", "send_message", "cronjob", "kanban"];

pub(crate) fn random_hex(bytes: usize) -> String {
    let mut buf = vec![0u8; bytes];
    if getrandom::fill(&mut buf).is_err() {
        // Fall back to time-derived bytes; ids only need to be unique, not secret.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        for (i, b) in buf.iter_mut().enumerate() {
            *b = u8::try_from((nanos >> ((i % 16) * 8)) & 0xff).unwrap_or(0);
        }
    }
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

fn system_prompt(goal: &str) -> String {
    format!(
        "You are a focused subagent working for a parent agent. Complete this task and reply \
         with a concise summary of what you did and found.\n\nTask: {goal}"
    )
}

pub(crate) fn user_turn(goal: &str, context: Option<&str>) -> String {
    match context {
        Some(c) => format!("{goal}\n\nContext: {c}"),
        None => goal.to_owned(),
    }
}

fn child_toolsets(parent: &ParentContext, role: &str, inherit_mcp: bool) -> Vec<String> {
    parent
        .toolsets
        .iter()
        .filter(|t| !BLOCKED_TOOLSETS.contains(&t.as_str()))
        .filter(|t| role == "orchestrator" || t.as_str() != "delegate_task")
        .filter(|t| inherit_mcp || !t.starts_with("mcp"))
        .cloned()
        .collect()
}

/// Runs one built child to a result; used by spawns and follow-ups.
pub(crate) fn execute(
    inner: &Arc<Inner>,
    spec: &ChildSpec,
    input: RunInput,
    steerable: bool,
    owner: Option<String>,
) -> ChildResult {
    let started = Instant::now();
    let parts = &inner.parts;
    let session_id = spec.resume_session_id.clone().unwrap_or_else(|| spec.session_id.clone());
    let mut result = ChildResult {
        task_index: spec.task_index,
        model: spec.model.clone(),
        child_session_id: session_id.clone(),
        subagent_id: spec.subagent_id.clone(),
        ..ChildResult::default()
    };
    let handle = match parts.runtime.build(spec) {
        Ok(h) => h,
        Err(e) => {
            result.status = "error".to_owned();
            result.exit_reason = "error".to_owned();
            result.error = Some(format!("Failed to build subagent: {e}"));
            let _ = parts.sessions.end_session(&session_id, "error");
            return result;
        }
    };
    inner.live.insert(LiveChild {
        handle: handle.clone(),
        owner_session_id: owner,
        owner_profile: parts.profile.clone(),
        accepting_steer: steerable,
    });
    let timeout = (parts.config.child_timeout_seconds > 0.0)
        .then(|| Duration::from_secs_f64(parts.config.child_timeout_seconds));
    let (tx, rx) = mpsc::channel();
    let runtime = Arc::clone(&parts.runtime);
    let closed = Arc::new(AtomicBool::new(false));
    let sink = SessionSink {
        sessions: Arc::clone(&parts.sessions),
        session_id: session_id.clone(),
        closed: Arc::clone(&closed),
    };
    let run_handle = handle.clone();
    let spawned = std::thread::Builder::new().name(format!("child-{}", handle.subagent_id)).spawn(
        move || {
            let outcome = runtime.run(&run_handle, &input, &sink);
            let _ = tx.send(outcome);
        },
    );
    let outcome = match spawned {
        Err(e) => ChildOutcome {
            exit_reason: "error".to_owned(),
            error: Some(format!("could not start the child: {e}")),
            ..ChildOutcome::default()
        },
        Ok(_) => {
            let received = match timeout {
                Some(t) => {
                    rx.recv_timeout(t).map_err(|e| matches!(e, mpsc::RecvTimeoutError::Timeout))
                }
                None => rx.recv().map_err(|_| false),
            };
            match received {
                Ok(o) => o,
                Err(true) => ChildOutcome {
                    exit_reason: "timeout".to_owned(),
                    error: Some(format!(
                        "Subagent timed out after {:.0} seconds.",
                        timeout.map_or(0.0, |t| t.as_secs_f64())
                    )),
                    ..ChildOutcome::default()
                },
                Err(false) => ChildOutcome {
                    exit_reason: "error".to_owned(),
                    error: Some("the child runtime stopped without an outcome".to_owned()),
                    ..ChildOutcome::default()
                },
            }
        }
    };
    // Whatever the child's thread still does, its transcript is closed now.
    closed.store(true, Ordering::SeqCst);
    inner.live.close_steering(&handle.subagent_id);
    let status = status_of(&outcome);
    let exit_reason = if outcome.exit_reason.is_empty() {
        status.to_owned()
    } else {
        outcome.exit_reason.clone()
    };
    if let Err(e) = parts.sessions.end_session(&session_id, &exit_reason) {
        log::warn!("could not end child session {session_id}: {e}");
    }
    inner.live.remove(&handle.subagent_id);
    let max = parts.config.max_summary_chars;
    let summary = outcome.final_response.clone();
    result.summary_truncated = max > 0 && summary.as_ref().is_some_and(|s| s.chars().count() > max);
    result.summary = summary.map(|s| if max > 0 { truncate_chars(&s, max) } else { s });
    result.status = status.to_owned();
    result.exit_reason = exit_reason;
    result.api_calls = outcome.api_calls;
    result.tokens = Tokens { input: outcome.input_tokens, output: outcome.output_tokens };
    result.cost_usd = if outcome.cost_usd.is_finite() { outcome.cost_usd.max(0.0) } else { 0.0 };
    result.error = outcome.error;
    result.missed_steer = outcome.missed_steers;
    result.duration_seconds = started.elapsed().as_secs_f64();
    result
}

/// Bills results to the parent (spec §7.2) under the per-process finalize lock.
pub(crate) fn finalize(
    inner: &Inner,
    parent: &ParentContext,
    delegation_id: &str,
    run: &str,
    results: &[ChildResult],
) {
    let parts = &inner.parts;
    let _guard = inner.finalize_lock.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let parent_id = parent.session_id.as_deref().unwrap_or_default();
    let mut cost = if parent_id.is_empty() {
        ParentCost::default()
    } else {
        ParentCost::load(&*parts.ledger, parent_id).unwrap_or_default()
    };
    let entries: Vec<FinalizeEntry> = results
        .iter()
        .map(|r| FinalizeEntry {
            task_index: r.task_index,
            child_session_id: r.child_session_id.clone(),
            usage: r.usage(),
        })
        .collect();
    let ctx = FinalizeContext {
        parent_session_id: parent_id,
        turn_id: parent.turn_id.as_deref().unwrap_or_default(),
        delegation_id,
        run,
    };
    retinue_usage::finalize_child_results(&*parts.ledger, &ctx, &entries, &mut cost);
}

pub(crate) fn unit_status(results: &[ChildResult]) -> &'static str {
    if results.iter().any(|r| r.status == "completed") {
        "completed"
    } else if results.iter().any(|r| r.status == "interrupted") {
        "interrupted"
    } else if results.iter().any(|r| r.status == "error") {
        "error"
    } else {
        "failed"
    }
}

pub(crate) fn runs_of(results: &[ChildResult]) -> Vec<ChildRun> {
    results
        .iter()
        .map(|r| ChildRun {
            subagent_id: r.subagent_id.clone(),
            child_session_id: r.child_session_id.clone(),
            usage: r.usage(),
        })
        .collect()
}

struct Planned {
    spec: ChildSpec,
    input: RunInput,
}

pub(crate) fn run(
    inner: &Arc<Inner>,
    args: &Value,
    tasks: Vec<TaskSpec>,
    parent: &ParentContext,
) -> Value {
    let parts = &inner.parts;
    let config = &parts.config;
    let top_role = args.get("role").and_then(Value::as_str).unwrap_or("leaf");
    let mut notes: Vec<&str> = Vec::new();
    let mut background = args.get("background").and_then(Value::as_bool).unwrap_or(false);
    if background && !parent.can_receive_detached {
        background = false;
        notes.push(texts::NO_DETACHED);
    }
    let mut took_slot = false;
    if background {
        let max = config.max_concurrent_children;
        let slot = inner
            .background_slots
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < max).then_some(n + 1));
        if slot.is_ok() {
            took_slot = true;
        } else {
            background = false;
            notes.push(texts::CAPACITY_FULL);
        }
    }
    let parent_id = parent.session_id.clone().filter(|s| !s.trim().is_empty());
    let model =
        Some(config.model.clone()).filter(|m| !m.is_empty()).or_else(|| parent.model.clone());
    let provider =
        Some(config.provider.clone()).filter(|p| !p.is_empty()).or_else(|| parent.provider.clone());
    let non_empty = |s: &str| Some(s.to_owned()).filter(|s| !s.is_empty());
    let mut planned = Vec::with_capacity(tasks.len());
    for (i, task) in tasks.iter().enumerate() {
        let wanted = task.role.as_deref().unwrap_or(top_role);
        let role = if wanted == "orchestrator"
            && config.orchestrator_enabled
            && parent.depth + 1 < config.max_spawn_depth
        {
            "orchestrator"
        } else {
            "leaf"
        };
        let spec = ChildSpec {
            subagent_id: format!("sa-{i}-{}", random_hex(4)),
            session_id: format!("sess_{}", random_hex(8)),
            task_index: i,
            goal: task.goal.clone(),
            context: task.context.clone(),
            role: role.to_owned(),
            model: model.clone(),
            provider: provider.clone(),
            base_url: non_empty(&config.base_url),
            api_mode: non_empty(&config.api_mode),
            toolsets: child_toolsets(parent, role, config.inherit_mcp_toolsets),
            max_iterations: config.max_iterations,
            resume_session_id: None,
        };
        let input = RunInput {
            user_message: user_turn(&task.goal, task.context.as_deref()),
            history: Vec::new(),
            system_prompt: Some(system_prompt(&task.goal)),
        };
        planned.push(Planned { spec, input });
    }
    let (pid, fingerprint) = current_owner();
    let draft = UnitDraft {
        origin_session: parent_id.clone().unwrap_or_default(),
        origin_session_id: parent_id.clone().unwrap_or_default(),
        parent_session_id: parent_id.clone(),
        owner_pid: Some(pid),
        owner_started_at: fingerprint,
        task: json!({
            "goals": tasks.iter().map(|t| t.goal.clone()).collect::<Vec<_>>(),
            "goal": tasks.first().map(|t| t.goal.clone()),
            "context": tasks.first().and_then(|t| t.context.clone()),
            "role": top_role,
            "model": model,
            "is_batch": tasks.len() > 1,
            "mode": if background { "background" } else { "sync" },
        }),
        owner_profile: parts.profile.clone(),
        children: planned
            .iter()
            .map(|p| ChildManifest {
                subagent_id: p.spec.subagent_id.clone(),
                session_id: p.spec.session_id.clone(),
                model: p.spec.model.clone(),
                provider: p.spec.provider.clone(),
                base_url: p.spec.base_url.clone(),
                api_mode: p.spec.api_mode.clone(),
                toolsets: Some(p.spec.toolsets.clone()),
                role: Some(p.spec.role.clone()),
                goal: Some(p.spec.goal.clone()),
            })
            .collect(),
        child_sessions: planned
            .iter()
            .map(|p| NewSession {
                id: p.spec.session_id.clone(),
                source: "delegate".to_owned(),
                model: p.spec.model.clone(),
                model_config: Some(json!({"_delegate_from": parent_id.clone()})),
                parent_session_id: parent_id.clone(),
                profile_name: Some(parts.profile.clone()).filter(|p| !p.is_empty()),
                started_at: None,
            })
            .collect(),
        ..UnitDraft::default()
    };
    let delegation_id = match parts.registry.insert_unit(&draft) {
        Ok(id) => id,
        Err(e) => {
            log::error!("could not persist a delegation: {e}");
            if took_slot {
                inner.background_slots.fetch_sub(1, Ordering::SeqCst);
            }
            return error(texts::PERSIST_FAILED);
        }
    };
    if background {
        let children: Vec<Value> = planned
            .iter()
            .map(|p| {
                json!({
                    "subagent_id": p.spec.subagent_id,
                    "session_id": p.spec.session_id,
                    "model": p.spec.model,
                    "goal": truncate_chars(&p.spec.goal, 200),
                })
            })
            .collect();
        let goals: Vec<String> = tasks.iter().map(|t| t.goal.clone()).collect();
        let worker = Arc::clone(inner);
        let parent_owned = parent.clone();
        let id = delegation_id.clone();
        let handle = std::thread::Builder::new().name(format!("unit-{id}")).spawn(move || {
            let started = Instant::now();
            let results = run_children(&worker, planned, &parent_owned);
            complete(&worker, &parent_owned, &id, &results, started, true);
            worker.background_slots.fetch_sub(1, Ordering::SeqCst);
        });
        match handle {
            Ok(h) => inner
                .background_threads
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(h),
            Err(e) => {
                inner.background_slots.fetch_sub(1, Ordering::SeqCst);
                return error(format!("could not start the background unit: {e}"));
            }
        }
        return json!({
            "status": "dispatched",
            "mode": "background",
            "count": goals.len(),
            "delegation_id": delegation_id,
            "goals": goals,
            "children": children,
            "note": texts::BACKGROUND_NOTE,
        });
    }
    let started = Instant::now();
    let results = run_children(inner, planned, parent);
    let mut out = complete(inner, parent, &delegation_id, &results, started, false);
    if !notes.is_empty() {
        out["note"] = json!(notes.join(" "));
    }
    out
}

fn run_children(
    inner: &Arc<Inner>,
    planned: Vec<Planned>,
    parent: &ParentContext,
) -> Vec<ChildResult> {
    let parts = &inner.parts;
    let workers = parts.config.max_concurrent_children.max(1).min(planned.len().max(1));
    let next = AtomicUsize::new(0);
    let planned: Vec<Planned> = planned;
    let mut results: Vec<ChildResult> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        let Some(p) = planned.get(i) else { break };
                        done.push(run_one(inner, p, parent));
                    }
                    done
                })
            })
            .collect();
        handles.into_iter().flat_map(|h| h.join().unwrap_or_default()).collect()
    });
    results.sort_by_key(|r| r.task_index);
    results
}

fn run_one(inner: &Arc<Inner>, p: &Planned, parent: &ParentContext) -> ChildResult {
    let sessions = &inner.parts.sessions;
    for (role, text) in
        [("system", p.input.system_prompt.clone()), ("user", Some(p.input.user_message.clone()))]
    {
        let message = Message { role: role.to_owned(), content: text, ..Message::default() };
        if let Err(e) = sessions.append_message(&p.spec.session_id, &message) {
            log::warn!("could not write the opening turn of {}: {e}", p.spec.session_id);
        }
    }
    execute(inner, &p.spec, p.input.clone(), true, parent.session_id.clone())
}

fn complete(
    inner: &Arc<Inner>,
    parent: &ParentContext,
    delegation_id: &str,
    results: &[ChildResult],
    started: Instant,
    background: bool,
) -> Value {
    let parts = &inner.parts;
    finalize(inner, parent, delegation_id, "spawn", results);
    let status = unit_status(results);
    let usage = retinue_usage::merge_unit_usage(None, &runs_of(results));
    let entries: Vec<Value> = results.iter().map(ChildResult::to_json).collect();
    let out = json!({
        "delegation_id": delegation_id,
        "results": entries,
        "total_duration_seconds": (started.elapsed().as_secs_f64() * 100.0).round() / 100.0,
    });
    let event = json!({
        "type": "async_delegation",
        "delegation_id": delegation_id,
        "parent_session_id": parent.session_id,
        "status": status,
        "results": out["results"],
    });
    let completion = Completion {
        delegation_id: delegation_id.to_owned(),
        status: status.to_owned(),
        event,
        result: out.clone(),
        usage: Some(usage),
        background,
    };
    if let Err(e) = parts.registry.persist_completion(&completion) {
        log::error!("could not persist the completion of {delegation_id}: {e}");
    }
    if background {
        deliver(inner, parent, delegation_id);
    }
    if let Err(e) = parts.registry.prune_history() {
        log::warn!("history pruner failed: {e}");
    }
    out
}

/// Hands pending completions of this parent to the sink, exactly once each.
fn deliver(inner: &Inner, parent: &ParentContext, delegation_id: &str) {
    let parts = &inner.parts;
    let Some(sink) = &parts.completions else { return };
    // This parent's pending completions; a parent without a session id gets
    // only this unit's (never everyone's).
    let filter = match parent.session_id.as_deref().map(str::trim).filter(|s| !s.is_empty()) {
        Some(p) => {
            DeliveryFilter { parent_session_id: Some(p.to_owned()), ..DeliveryFilter::default() }
        }
        None => DeliveryFilter {
            delegation_id: Some(delegation_id.to_owned()),
            ..DeliveryFilter::default()
        },
    };
    loop {
        match parts.registry.claim_delivery(&filter) {
            Ok(Some(claim)) => {
                if sink.deliver(&claim.event) {
                    match parts.registry.ack_delivery(&claim.delegation_id, &claim.token) {
                        Ok(true) => {}
                        Ok(false) => {
                            log::warn!("delivery lease of {} was lost", claim.delegation_id)
                        }
                        Err(e) => log::warn!("could not ack {}: {e}", claim.delegation_id),
                    }
                } else {
                    break;
                }
            }
            Ok(None) => break,
            Err(e) => {
                log::warn!("could not claim a delivery: {e}");
                break;
            }
        }
    }
}
