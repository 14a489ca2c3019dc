//! The spawn flow (semantics §6.4): durable unit first, then the children, then
//! finalize, completion, delivery and the history pruner.

use retinue_core::EndReason;
use retinue_core::{CompletionEvent, UnitState};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use retinue_core::{
    ChildManifest, ChildStatus, Completion, DeliveryFilter, ExitReason, Message, NewSession, Role,
    Spend, UnitDraft, current_owner, truncate_chars,
};
use retinue_usage::{ChildRun, FinalizeContext, FinalizeEntry, ParentCost, Tokens};
use serde_json::json;

use crate::budget;
use crate::error::DelegateError;
use crate::live::LiveChild;
use crate::request::{DelegateOutcome, Dispatch, DispatchedChild, SpawnRequest, UnitReport};
use crate::results::{ChildReport, SessionSink, status_of};
use opentelemetry::Context;

use crate::telemetry;
use crate::{Inner, ParentContext, texts};
use retinue_core::run::{self, CancelReason, CancelToken, ChildHandle, ChildOutcome, ChildSpec};

/// The role a child gets: `orchestrator` only where hermes allows one
/// (`orchestrator_enabled`, and the child's depth below `max_spawn_depth`).
pub(crate) fn effective_role(
    wanted: Role,
    config: &retinue_config::OrchestratorPolicy,
    parent: &ParentContext,
) -> Role {
    if wanted == Role::Orchestrator
        && config.orchestrator_enabled
        && parent.depth.saturating_add(1) < config.max_spawn_depth
    {
        Role::Orchestrator
    } else {
        Role::Leaf
    }
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

/// How long a stopped child's thread gets to hand back its partial outcome.
const STOP_GRACE: Duration = Duration::from_secs(10);

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-text panic".to_owned())
}

/// The child's own deadline (`child_timeout_seconds`; 0, a non-finite or an
/// unrepresentably large value means none).
pub(crate) fn child_timeout(seconds: f64) -> Option<Duration> {
    (seconds > 0.0).then(|| Duration::try_from_secs_f64(seconds).ok()).flatten()
}

/// Runs the child on its own thread until it returns, panics, or is stopped
/// (deadline or `cancel`); a stopped child gets [`STOP_GRACE`] to return the
/// usage it spent, and its transcript is closed either way.
fn run_child(
    inner: &Arc<Inner>,
    handle: &ChildHandle,
    input: run::RunInput,
    session_id: &str,
    cancel: &CancelToken,
    span: &Context,
) -> ChildOutcome {
    let parts = &inner.parts;
    let (tx, rx) = mpsc::channel();
    // The runtime's spans (model calls, tools) nest under the child's.
    let span = span.clone();
    let runtime = Arc::clone(&parts.runtime);
    let closed = Arc::new(AtomicBool::new(false));
    let sink = SessionSink {
        sessions: Arc::clone(&parts.backend.sessions),
        session_id: session_id.to_owned(),
        closed: Arc::clone(&closed),
    };
    let run_handle = handle.clone();
    let ctx = crate::nested::run_context(inner, handle, cancel);
    let spawned = std::thread::Builder::new().name(format!("child-{}", handle.subagent_id)).spawn(
        move || {
            let _attached = span.attach();
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                runtime.run(&run_handle, &input, &sink, &ctx)
            }));
            let _ = tx.send(run.unwrap_or_else(|payload| {
                ChildOutcome::failed(
                    ExitReason::Error,
                    format!("the child runtime panicked: {}", panic_text(payload.as_ref())),
                )
            }));
        },
    );
    let thread = match spawned {
        Ok(t) => t,
        Err(e) => {
            return ChildOutcome::failed(
                ExitReason::Error,
                format!("could not start the child: {e}"),
            );
        }
    };
    // Wait for the outcome, waking for an explicit cancel or the deadline.
    let mut outcome = None;
    while outcome.is_none() && !cancel.is_cancelled() {
        let wait = cancel.remaining().unwrap_or(POLL).min(POLL);
        match rx.recv_timeout(wait) {
            Ok(o) => outcome = Some(o),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let stopped = outcome.is_none().then(|| cancel.reason()).flatten();
    if outcome.is_none() && stopped.is_some() {
        outcome = rx.recv_timeout(STOP_GRACE).ok();
    }
    // Whatever the child's thread still does, its transcript is closed now.
    closed.store(true, Ordering::SeqCst);
    let returned = outcome.is_some();
    if returned {
        let _ = thread.join();
    } else {
        log::warn!(
            "child {} did not stop within {STOP_GRACE:?} of being told to; its thread is abandoned",
            handle.subagent_id
        );
    }
    let mut outcome = outcome.unwrap_or_else(|| {
        ChildOutcome::failed(ExitReason::Error, "the child runtime stopped without an outcome")
    });
    // A run that stopped early (or never came back) is reported with the
    // token's reason; one that finished its answer just in time keeps it.
    let stopped_early =
        !returned || matches!(outcome.exit_reason, ExitReason::Interrupted | ExitReason::Timeout);
    let stopped = if stopped_early { stopped.or_else(|| cancel.reason()) } else { None };
    match stopped {
        Some(CancelReason::Timeout) => {
            outcome.exit_reason = ExitReason::Timeout;
            outcome.error = Some(texts::timed_out(parts.config.child_timeout_seconds));
        }
        Some(CancelReason::Cancelled) => {
            outcome.exit_reason = ExitReason::Interrupted;
            outcome.error.get_or_insert_with(|| texts::CANCELLED.to_owned());
        }
        Some(CancelReason::Requested) => {
            outcome.exit_reason = ExitReason::Cancelled;
            outcome.error = Some(texts::CANCEL_REQUESTED.to_owned());
        }
        Some(CancelReason::Budget) => {
            outcome.exit_reason = ExitReason::Budget;
            outcome.error = Some(texts::BUDGET_SPENT.to_owned());
        }
        None => {}
    }
    outcome
}

/// The core's own metering of a finished run: usage the runtime reported
/// beyond what its call permits charged is charged now (a runtime that
/// never asked for permits is still metered), and the run is billed at
/// least what its permits charged (a runtime cannot report less).
fn charge_run(token: &CancelToken, outcome: &mut ChildOutcome) {
    let metered = token.metered();
    if !outcome.cost_usd.is_finite() || outcome.cost_usd < 0.0 {
        outcome.cost_usd = 0.0;
    }
    let reported = outcome.tokens.input.saturating_add(outcome.tokens.output);
    let extra = Spend {
        cost_usd: (outcome.cost_usd - metered.cost_usd).max(0.0),
        tokens: reported.saturating_sub(metered.tokens),
    };
    if let Some(meter) = token.budget().filter(|_| extra.tokens > 0 || extra.cost_usd > 0.0) {
        meter.charge_after(extra);
    }
    if metered.tokens > reported {
        outcome.tokens.input = outcome.tokens.input.saturating_add(metered.tokens - reported);
    }
    if metered.cost_usd > outcome.cost_usd {
        outcome.cost_usd = metered.cost_usd;
    }
}

/// How often a waiting parent looks at its cancel token.
const POLL: Duration = Duration::from_millis(50);

/// Runs one built child to a result; used by spawns and follow-ups.
pub(crate) fn execute(
    inner: &Arc<Inner>,
    spec: &ChildSpec,
    input: run::RunInput,
    steerable: bool,
    owner: Option<String>,
    cancel: &CancelToken,
    call: &Context,
) -> ChildReport {
    let session_id = spec.resume_session_id.clone().unwrap_or_else(|| spec.session_id.clone());
    let span = telemetry::child_span(call, spec, &session_id);
    let (report, cached) = execute_in(inner, spec, input, steerable, owner, cancel, &span);
    telemetry::end_child(&span, &report, cached);
    report
}

/// A child's run in its span's context; also returns its cached input
/// tokens (for the span).
fn execute_in(
    inner: &Arc<Inner>,
    spec: &ChildSpec,
    input: run::RunInput,
    steerable: bool,
    owner: Option<String>,
    cancel: &CancelToken,
    span: &Context,
) -> (ChildReport, u64) {
    let started = Instant::now();
    let parts = &inner.parts;
    let session_id = spec.resume_session_id.clone().unwrap_or_else(|| spec.session_id.clone());
    let mut result = ChildReport {
        task_index: spec.task_index,
        model: spec.model.clone(),
        child_session_id: session_id.clone(),
        subagent_id: spec.subagent_id.clone(),
        toolsets: spec.toolsets.clone(),
        ..ChildReport::default()
    };
    let handle = match parts.runtime.build(spec) {
        Ok(h) => h,
        Err(e) => {
            result.status = ChildStatus::Error;
            result.exit_reason = ExitReason::Error;
            result.error = Some(format!("Failed to build subagent: {e}"));
            let _ = parts.backend.sessions.end_session(&session_id, &EndReason::Error);
            return (result, 0);
        }
    };
    inner.live.insert(LiveChild {
        handle: handle.clone(),
        owner_session_id: owner,
        owner_profile: parts.profile.clone(),
        accepting_steer: steerable,
    });
    let token = cancel.child(child_timeout(parts.config.child_timeout_seconds));
    let resumed_up_to = input.history.iter().map(|m| m.id).max().unwrap_or(0);
    let mut outcome = run_child(inner, &handle, input, &session_id, &token, span);
    charge_run(&token, &mut outcome);
    inner.live.close_steering(&handle.subagent_id);
    let status = status_of(&outcome);
    if let Err(e) =
        parts.backend.sessions.end_session(&session_id, &EndReason::from(&outcome.exit_reason))
    {
        log::warn!("could not end child session {session_id}: {e}");
    }
    inner.live.remove(&handle.subagent_id);
    let max = parts.config.max_summary_chars;
    let summary = outcome.final_response.clone();
    result.summary_truncated = max > 0 && summary.as_ref().is_some_and(|s| s.chars().count() > max);
    result.summary = summary.map(|s| if max > 0 { truncate_chars(&s, max) } else { s });
    result.status = status;
    result.exit_reason = outcome.exit_reason;
    result.api_calls = outcome.api_calls;
    result.tokens = Tokens { input: outcome.tokens.input, output: outcome.tokens.output };
    result.cost_usd = if outcome.cost_usd.is_finite() { outcome.cost_usd.max(0.0) } else { 0.0 };
    result.error = outcome.error;
    result.missed_steer = outcome.missed_steers;
    // What the runtime really used (an override, the config of the day).
    if let Some(model) = outcome.model.filter(|m| !m.trim().is_empty()) {
        result.model = Some(model);
    }
    result.endpoint = outcome.endpoint.filter(|e| !e.trim().is_empty());
    result.duration_seconds = started.elapsed().as_secs_f64();
    result.receipts =
        crate::results::receipts_of_run(&*parts.backend.sessions, &result, resumed_up_to);
    (result, outcome.tokens.cached_input)
}

/// Bills results to the parent (semantics §7.2) under the per-process finalize
/// lock; `false` when the ledger rows could not be written.
pub(crate) fn finalize(
    inner: &Inner,
    parent: &ParentContext,
    delegation_id: &str,
    run: &str,
    results: &[ChildReport],
) -> bool {
    let parts = &inner.parts;
    let _guard = inner.finalize_lock.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let parent_id = parent.session_id.as_deref().unwrap_or_default();
    let mut cost = if parent_id.is_empty() {
        ParentCost::default()
    } else {
        ParentCost::load(&*parts.backend.ledger, parent_id).unwrap_or_default()
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
    retinue_usage::finalize_child_results(&*parts.backend.ledger, &ctx, &entries, &mut cost)
        .ledger_ok
}

pub(crate) fn runs_of(results: &[ChildReport]) -> Vec<ChildRun> {
    results
        .iter()
        .map(|r| ChildRun {
            subagent_id: r.subagent_id.clone(),
            child_session_id: r.child_session_id.clone(),
            usage: r.usage(),
        })
        .collect()
}

pub(crate) struct Planned {
    pub(crate) spec: ChildSpec,
    input: run::RunInput,
    dropped: Vec<crate::toolsets::DroppedToolset>,
    /// Runs in a worktree of its own.
    isolated: bool,
}

/// The handles of the planned children, for the mailbox's watch.
fn handles(planned: &[Planned]) -> Vec<ChildHandle> {
    planned.iter().map(|p| ChildHandle::of(&p.spec)).collect()
}

/// One of the `max_concurrent_children` background slots, given back when
/// dropped: on every path (an early return, a failed thread spawn, a panic
/// in the unit's thread) exactly once.
struct BackgroundSlot(Arc<Inner>);

impl BackgroundSlot {
    /// Takes a free slot, if any.
    fn take(inner: &Arc<Inner>) -> Option<BackgroundSlot> {
        let max = inner.parts.config.max_concurrent_children.max(1);
        inner
            .background_slots
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| (n < max).then_some(n + 1))
            .ok()
            .map(|_| BackgroundSlot(Arc::clone(inner)))
    }

    /// Waits for a free slot (a queued unit), or until `cancel` fires
    /// (`None`: the unit is cancelled while queued).
    fn wait(inner: &Arc<Inner>, cancel: &CancelToken) -> Option<BackgroundSlot> {
        let mut freed =
            inner.slot_freed.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            if let Some(slot) = BackgroundSlot::take(inner) {
                return Some(slot);
            }
            if cancel.is_cancelled() {
                return None;
            }
            freed = inner
                .slot_freed
                .1
                .wait_timeout(freed, std::time::Duration::from_millis(100))
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .0;
        }
    }
}

impl Drop for BackgroundSlot {
    fn drop(&mut self) {
        self.0.background_slots.fetch_sub(1, Ordering::SeqCst);
        let _held = self.0.slot_freed.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        self.0.slot_freed.1.notify_all();
    }
}

/// What a spawn will do, decided before anything is written.
struct Plan {
    /// The children, ids drawn, specs and opening turns built.
    planned: Vec<Planned>,
    /// The parent's session, if it has one.
    parent_id: Option<String>,
    /// The unit's model.
    model: Option<String>,
    /// Runs in the background.
    background: bool,
    /// The background slot it holds (`None` in the background: queued
    /// until one frees).
    slot: Option<BackgroundSlot>,
    /// Notes for the result (ran synchronously because …).
    notes: Vec<&'static str>,
}

/// A spawn: plan → reserve → persist → run (here, or on a background
/// thread) → finalize. Each step returns early on failure; the guards
/// (the background slot, the budget reservation) give back what was taken
/// on every path.
pub(crate) fn run(
    inner: &Arc<Inner>,
    request: &SpawnRequest,
    parent: &ParentContext,
    cancel: &CancelToken,
) -> Result<DelegateOutcome, DelegateError> {
    let mode = if request.background { "background" } else { "sync" };
    let call = telemetry::call_span(parent.trace_parent.as_deref(), None, mode);
    let out = run_in(inner, request, parent, cancel, &call);
    match &out {
        // A dispatched unit's thread ends the span when its children end.
        Ok(DelegateOutcome::Dispatched(_)) => {}
        Ok(_) => telemetry::end_call(&call, None),
        Err(e) => telemetry::end_call(&call, Some(e.kind().as_str())),
    }
    out
}

fn run_in(
    inner: &Arc<Inner>,
    request: &SpawnRequest,
    parent: &ParentContext,
    cancel: &CancelToken,
    call: &Context,
) -> Result<DelegateOutcome, DelegateError> {
    let plan = plan(inner, request, parent)?;
    let held = reserve(inner, request, &plan)?;
    let cancel = held.as_ref().map_or_else(|| cancel.clone(), |h| h.token(cancel));
    let delegation_id = persist(inner, request, &plan, telemetry::traceparent_of(call))?;
    telemetry::set_unit(call, &delegation_id);
    let Plan { planned, background, slot, notes, .. } = plan;
    if background {
        return dispatch(inner, request, parent, delegation_id, planned, slot, held, cancel, call);
    }
    let started = Instant::now();
    let watch = crate::background::Watch::start(inner, &delegation_id, handles(&planned), &cancel);
    let results = watch.finish(run_children(inner, &delegation_id, planned, parent, &cancel, call));
    let mut unit = complete(inner, parent, &delegation_id, results, started, false);
    let ledger_ok = unit.ledger_error.is_none();
    unit.budget = held.and_then(|h| h.settle(ledger_ok));
    if !notes.is_empty() {
        unit.note = Some(notes.join(" "));
    }
    Ok(DelegateOutcome::Completed(unit))
}

/// Step 1: where it runs, the children's roles, toolsets, ids and opening
/// turns. Writes nothing.
fn plan(
    inner: &Arc<Inner>,
    request: &SpawnRequest,
    parent: &ParentContext,
) -> Result<Plan, DelegateError> {
    let config = &inner.parts.config;
    let mut notes: Vec<&'static str> = Vec::new();
    let mut slot = None;
    let background = request.background && parent.can_receive_detached;
    if request.background && !parent.can_receive_detached {
        notes.push(texts::NO_DETACHED);
    } else if background {
        // Full capacity queues the unit (its thread waits for a slot).
        slot = BackgroundSlot::take(inner);
    }
    let parent_id = parent.session_id.clone().filter(|s| !s.trim().is_empty());
    let model =
        Some(config.model.clone()).filter(|m| !m.is_empty()).or_else(|| parent.model.clone());
    let provider =
        Some(config.provider.clone()).filter(|p| !p.is_empty()).or_else(|| parent.provider.clone());
    let non_empty = |s: &str| Some(s.to_owned()).filter(|s| !s.is_empty());
    let isolated = crate::isolated::plan(inner, request, parent)?;
    let mut planned = Vec::with_capacity(request.tasks.len());
    for (i, task) in request.tasks.iter().enumerate() {
        let wanted = task.role.as_deref().map_or_else(|| request.role.clone(), Role::parse);
        let role = effective_role(wanted, config, parent);
        let grant = crate::toolsets::grant(
            &config.toolsets,
            parent,
            request.toolsets.as_deref(),
            &role,
            config.inherit_mcp_toolsets,
        );
        let taken = |sa: &str, sess: &str| {
            planned.iter().any(|p: &Planned| {
                p.spec.subagent_id == sa || p.spec.session_id == sess || p.spec.session_id == sa
            })
        };
        let (subagent_id, session_id) = crate::ids::fresh_ids(inner, i, taken)?;
        let workspace = match isolated[i] {
            true => Some(crate::isolated::workspace_of(inner, parent, &subagent_id)?),
            false => parent.workspace.clone(),
        };
        let spec = ChildSpec {
            subagent_id,
            session_id,
            task_index: i,
            goal: task.goal.clone(),
            context: task.context.clone(),
            role,
            model: model.clone(),
            provider: provider.clone(),
            api_mode: non_empty(&config.api_mode),
            toolsets: grant.granted,
            workspace,
            depth: parent.depth + 1,
            max_iterations: config.max_iterations,
            resume_session_id: None,
        };
        let input = run::RunInput {
            user_message: user_turn(&task.goal, task.context.as_deref()),
            history: Vec::new(),
            system_prompt: Some(system_prompt(&task.goal)),
        };
        planned.push(Planned { spec, input, dropped: grant.dropped, isolated: isolated[i] });
    }
    Ok(Plan { planned, parent_id, model, background, slot, notes })
}

/// Step 2: under a budget, reserve before anything is written or started;
/// the children join the budget's tree before they exist, so their own
/// spawns and follow-ups draw on it.
fn reserve(
    inner: &Arc<Inner>,
    request: &SpawnRequest,
    plan: &Plan,
) -> Result<Option<budget::Held>, DelegateError> {
    let minimum = Spend {
        cost_usd: budget::MIN_COST_USD,
        tokens: plan
            .planned
            .iter()
            .map(|p| {
                budget::tokens_of(p.input.system_prompt.as_deref().unwrap_or_default())
                    + budget::tokens_of(&p.input.user_message)
            })
            .fold(0, u64::saturating_add),
    };
    let payer = plan.parent_id.as_deref();
    let root = match payer {
        Some(p) => budget::budget_root(inner, p, None),
        None => Err("no parent session".to_owned()),
    };
    let members: Vec<String> = plan.planned.iter().map(|p| p.spec.session_id.clone()).collect();
    let held = budget::reserve(inner, payer, &root, request.budget, minimum, None)?;
    match (&held, &root) {
        // Under a budget a failure to join refuses (the guard releases).
        (Some(h), _) => budget::join(inner, h.root(), &members)?,
        (None, Ok(root)) => {
            if let Err(e) = budget::join(inner, root, &members) {
                log::warn!("could not record the budget root of new children: {e}");
            }
        }
        (None, Err(_)) => {}
    }
    Ok(held)
}

/// Step 3: the unit, its manifest and its child sessions, in one write.
fn persist(
    inner: &Arc<Inner>,
    request: &SpawnRequest,
    plan: &Plan,
    traceparent: Option<String>,
) -> Result<String, DelegateError> {
    let parts = &inner.parts;
    let tasks = &request.tasks;
    let (parent_id, model, planned) = (&plan.parent_id, &plan.model, &plan.planned);
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
            "role": request.role,
            "model": model,
            "is_batch": tasks.len() > 1,
            "mode": if plan.background { "background" } else { "sync" },
            // The call's span: a follow-up links to it (semantics §11).
            "traceparent": traceparent,
        }),
        owner_profile: parts.profile.clone(),
        children: planned
            .iter()
            .map(|p| ChildManifest {
                subagent_id: p.spec.subagent_id.clone(),
                session_id: p.spec.session_id.clone(),
                model: p.spec.model.clone(),
                provider: p.spec.provider.clone(),
                // Informational: a run calls the runtime's own endpoint.
                base_url: parts.config.recorded_endpoint.clone(),
                api_mode: p.spec.api_mode.clone(),
                toolsets: Some(p.spec.toolsets.clone()),
                role: Some(p.spec.role.as_str().to_owned()),
                goal: Some(p.spec.goal.clone()),
                workspace: p.spec.workspace.as_ref().map(|w| w.to_string_lossy().into_owned()),
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
    parts.backend.registry.insert_unit(&draft).map_err(|e| {
        log::error!("could not persist a delegation: {e}");
        DelegateError::Storage(e)
    })
}

/// Steps 4 and 5 on a background thread that owns the slot and the
/// reservation. When the thread cannot start, the unit is finalised as
/// failed here (never left `running`) and both guards give back what they
/// hold.
#[expect(clippy::too_many_arguments)] // the unit's parts, moved into its thread
fn dispatch(
    inner: &Arc<Inner>,
    request: &SpawnRequest,
    parent: &ParentContext,
    delegation_id: String,
    planned: Vec<Planned>,
    slot: Option<BackgroundSlot>,
    held: Option<budget::Held>,
    cancel: CancelToken,
    call: &Context,
) -> Result<DelegateOutcome, DelegateError> {
    let call = call.clone();
    let dispatch = Dispatch {
        queued: slot.is_none(),
        delegation_id: delegation_id.clone(),
        goals: request.tasks.iter().map(|t| t.goal.clone()).collect(),
        children: planned
            .iter()
            .map(|p| DispatchedChild {
                subagent_id: p.spec.subagent_id.clone(),
                session_id: p.spec.session_id.clone(),
                model: p.spec.model.clone(),
                goal: truncate_chars(&p.spec.goal, texts::GOAL_PREVIEW_CHARS),
            })
            .collect(),
    };
    let not_started: Vec<ChildReport> = planned
        .iter()
        .map(|p| ChildReport {
            task_index: p.spec.task_index,
            status: ChildStatus::Error,
            exit_reason: ExitReason::Error,
            model: p.spec.model.clone(),
            child_session_id: p.spec.session_id.clone(),
            subagent_id: p.spec.subagent_id.clone(),
            ..ChildReport::default()
        })
        .collect();
    let worker = Arc::clone(inner);
    let parent_owned = parent.clone();
    let id = delegation_id.clone();
    let if_it_panics = not_started.clone();
    let body = move || {
        let started = Instant::now();
        let finished = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let watch = crate::background::Watch::start(&worker, &id, handles(&planned), &cancel);
            let slot = slot.or_else(|| BackgroundSlot::wait(&worker, &cancel));
            let results = if slot.is_some() {
                run_children(&worker, &id, planned, &parent_owned, &cancel, &call)
            } else {
                cancelled_while_queued(&planned, &cancel)
            };
            let results = watch.finish(results);
            let ledger_ok = complete(&worker, &parent_owned, &id, results, started, true)
                .ledger_error
                .is_none();
            drop(slot);
            telemetry::end_call(&call, None);
            ledger_ok
        }));
        match finished {
            Ok(ledger_ok) => {
                if let Some(h) = held {
                    h.settle(ledger_ok);
                }
            }
            Err(payload) => {
                // The reservation's guard keeps what ran as spent.
                let why = format!("the unit's thread panicked: {}", panic_text(payload.as_ref()));
                log::error!("background unit {id}: {why}");
                abandon(&worker, &parent_owned, &id, if_it_panics, &why);
            }
        }
    };
    match crate::spawn_thread(inner, format!("unit-{delegation_id}"), Box::new(body)) {
        Ok(h) => {
            inner
                .background_threads
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(h);
            Ok(DelegateOutcome::Dispatched(dispatch))
        }
        Err(e) => {
            let why = format!("could not start the background unit: {e}");
            abandon(inner, parent, &delegation_id, not_started, &why);
            Err(DelegateError::Runtime(why))
        }
    }
}

/// Finalises a unit whose run was abandoned (its thread could not start, or
/// panicked): every child reported as an error with `why`, the unit `error`,
/// its completion recorded — never left `running`. No ledger row is
/// written (the budget's guard keeps whatever ran as spent).
fn abandon(
    inner: &Arc<Inner>,
    parent: &ParentContext,
    delegation_id: &str,
    reports: Vec<ChildReport>,
    why: &str,
) {
    let results: Vec<ChildReport> =
        reports.into_iter().map(|r| ChildReport { error: Some(why.to_owned()), ..r }).collect();
    let entries: Vec<serde_json::Value> = results.iter().map(ChildReport::to_json).collect();
    let completion = Completion {
        delegation_id: delegation_id.to_owned(),
        status: UnitState::Error,
        event: CompletionEvent::new(
            delegation_id,
            parent.session_id.as_deref(),
            UnitState::Error,
            entries.clone(),
        ),
        result: json!({ "delegation_id": delegation_id, "results": entries, "error": why }),
        usage: None,
        background: false,
    };
    if let Err(e) = inner.parts.backend.registry.persist_completion(&completion) {
        log::error!("could not record the abandoned unit {delegation_id}: {e}");
    }
}

/// The reports of a unit cancelled before a slot freed: nothing ran.
fn cancelled_while_queued(planned: &[Planned], cancel: &CancelToken) -> Vec<ChildReport> {
    let (exit_reason, error) = match cancel.reason() {
        Some(CancelReason::Requested) => (ExitReason::Cancelled, texts::CANCEL_REQUESTED),
        Some(CancelReason::Timeout) => (ExitReason::Timeout, texts::QUEUED_TIMEOUT),
        _ => (ExitReason::Interrupted, texts::CANCELLED),
    };
    planned
        .iter()
        .map(|p| ChildReport {
            task_index: p.spec.task_index,
            status: if exit_reason == ExitReason::Timeout {
                ChildStatus::Timeout
            } else {
                ChildStatus::Interrupted
            },
            exit_reason: exit_reason.clone(),
            model: p.spec.model.clone(),
            child_session_id: p.spec.session_id.clone(),
            subagent_id: p.spec.subagent_id.clone(),
            error: Some(error.to_owned()),
            ..ChildReport::default()
        })
        .collect()
}

fn run_children(
    inner: &Arc<Inner>,
    delegation_id: &str,
    planned: Vec<Planned>,
    parent: &ParentContext,
    cancel: &CancelToken,
    call: &Context,
) -> Vec<ChildReport> {
    let parts = &inner.parts;
    let workers = parts.config.max_concurrent_children.max(1).min(planned.len().max(1));
    let next = AtomicUsize::new(0);
    let mut results: Vec<ChildReport> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::SeqCst);
                        let Some(p) = planned.get(i) else { break };
                        done.push(run_one(inner, delegation_id, p, parent, cancel, call));
                    }
                    done
                })
            })
            .collect();
        // `execute` never panics (the runtime runs under catch_unwind), so a
        // worker's join error can only come from the store; such a worker's
        // children are reported below as errors, never dropped.
        handles.into_iter().flat_map(|h| h.join().unwrap_or_default()).collect()
    });
    for (i, p) in planned.iter().enumerate() {
        if !results.iter().any(|r| r.task_index == i) {
            results.push(ChildReport {
                task_index: i,
                status: ChildStatus::Error,
                exit_reason: ExitReason::Error,
                model: p.spec.model.clone(),
                child_session_id: p.spec.session_id.clone(),
                subagent_id: p.spec.subagent_id.clone(),
                error: Some("the child's worker thread panicked".to_owned()),
                ..ChildReport::default()
            });
        }
    }
    results.sort_by_key(|r| r.task_index);
    results
}

fn run_one(
    inner: &Arc<Inner>,
    delegation_id: &str,
    p: &Planned,
    parent: &ParentContext,
    cancel: &CancelToken,
    call: &Context,
) -> ChildReport {
    let sessions = &inner.parts.backend.sessions;
    for (role, text) in
        [("system", p.input.system_prompt.clone()), ("user", Some(p.input.user_message.clone()))]
    {
        let message = Message { role: role.to_owned(), content: text, ..Message::default() };
        if let Err(e) = sessions.append_message(&p.spec.session_id, &message) {
            log::warn!("could not write the opening turn of {}: {e}", p.spec.session_id);
        }
    }
    let spec = match p.isolated {
        true => match crate::isolated::in_worktree(inner, delegation_id, parent, &p.spec) {
            Ok(spec) => std::borrow::Cow::Owned(spec),
            Err(report) => return *report,
        },
        false => std::borrow::Cow::Borrowed(&p.spec),
    };
    let mut report =
        execute(inner, &spec, p.input.clone(), true, parent.session_id.clone(), cancel, call);
    report.toolsets_dropped = p.dropped.clone();
    if p.isolated {
        crate::isolated::record(inner, &mut report);
    }
    report
}

fn complete(
    inner: &Arc<Inner>,
    parent: &ParentContext,
    delegation_id: &str,
    results: Vec<ChildReport>,
    started: Instant,
    background: bool,
) -> UnitReport {
    let parts = &inner.parts;
    let ledger_ok = finalize(inner, parent, delegation_id, "spawn", &results);
    let status = ChildStatus::unit_state(results.iter().map(|r| &r.status));
    let usage = retinue_usage::merge_unit_usage(None, &runs_of(&results));
    let unit = UnitReport {
        delegation_id: delegation_id.to_owned(),
        results,
        total_duration_seconds: started.elapsed().as_secs_f64(),
        note: None,
        budget: None,
        ledger_error: (!ledger_ok).then(|| texts::LEDGER_FAILED.to_owned()),
    };
    let out = unit.body();
    let results = out["results"].as_array().cloned().unwrap_or_default();
    let event =
        CompletionEvent::new(delegation_id, parent.session_id.as_deref(), status.clone(), results);
    let completion = Completion {
        delegation_id: delegation_id.to_owned(),
        status: status.clone(),
        event,
        result: out,
        usage: Some(usage),
        background,
    };
    if let Err(e) = parts.backend.registry.persist_completion(&completion) {
        log::error!("could not persist the completion of {delegation_id}: {e}");
    }
    if background {
        deliver(inner, parent, delegation_id);
    }
    if let Err(e) = parts.backend.registry.prune_history() {
        log::warn!("history pruner failed: {e}");
    }
    crate::isolated::sweep(inner);
    unit
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
        match parts.backend.registry.claim_delivery(&filter) {
            Ok(Some(claim)) => {
                if sink.deliver(&claim.event) {
                    match parts.backend.registry.ack_delivery(&claim.delegation_id, &claim.token) {
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
