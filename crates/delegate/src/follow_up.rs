//! The follow-up flow (semantics §6.3): steer a running child, or resume a
//! retained one on its own transcript. Budget-exempt.

use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use retinue_core::{
    BudgetLimit, Message, ResumeClaim, RetainedChild, Role, Spend, UnitState, UsageSwap,
};
use retinue_lineage::Resolution;

use crate::budget;
use crate::error::DelegateError;
use crate::request::FollowUp;
use crate::request::{DelegateOutcome, FollowUpReport};
use crate::results::ChildReport;
use crate::spawn::{execute, finalize, runs_of};
use crate::texts;
use crate::{Inner, ParentContext};
use retinue_core::run::{CancelToken, ChildSpec, RunInput};

/// Claim renewal period while a resume runs.
const RENEW_EVERY: Duration = Duration::from_secs(100);

fn requester(parent: &ParentContext) -> Option<&str> {
    parent.session_id.as_deref().map(str::trim).filter(|s| !s.is_empty())
}

/// Step 1: steer a running child the caller may address.
fn try_steer(
    inner: &Inner,
    fu: &FollowUp,
    parent: &ParentContext,
) -> Option<Result<DelegateOutcome, DelegateError>> {
    let target = fu.target.trim();
    let live = inner.live.find(target)?;
    if !live.accepting_steer {
        return None;
    }
    let owner = live.owner_session_id.as_deref().filter(|o| !o.trim().is_empty())?;
    let entry = RetainedChild {
        delegation_id: String::new(),
        parent_session_id: owner.to_owned(),
        owner_profile: live.owner_profile.clone(),
        state: UnitState::Running,
        retained_at: None,
        completed_at: None,
        child_index: 0,
        subagent_id: live.handle.subagent_id.clone(),
        child_session_id: live.handle.session_id.clone(),
        manifest: retinue_core::ChildManifest::default(),
    };
    if inner.parts.authority.check_follow_up_authority(&entry, requester(parent)).is_err() {
        return Some(Err(DelegateError::NotAddressable { target: fu.target.clone() }));
    }
    if !inner.parts.runtime.steer(&live.handle, &fu.text) {
        return None;
    }
    Some(Ok(DelegateOutcome::Steered { child_id: target.to_owned() }))
}

pub(crate) fn run(
    inner: &Arc<Inner>,
    fu: &FollowUp,
    parent: &ParentContext,
    cancel: &CancelToken,
) -> Result<DelegateOutcome, DelegateError> {
    if let Some(out) = try_steer(inner, fu, parent) {
        return out;
    }
    let parts = &inner.parts;
    let not_addressable = || DelegateError::NotAddressable { target: fu.target.clone() };
    let entry = match parts.authority.resolve_for(requester(parent), fu.target.trim()) {
        Resolution::Addressable(entry) => entry,
        Resolution::NotAddressable => return Err(not_addressable()),
        Resolution::SelfTarget => return Err(DelegateError::SelfTarget),
        Resolution::Tombstoned { entry, at, reason } => {
            return Err(DelegateError::Tombstoned {
                target: fu.target.clone(),
                at,
                reason: reason.as_str().to_owned(),
                child_session_id: entry.child_session_id,
            });
        }
    };
    if entry.child_session_id.trim().is_empty() {
        return Err(DelegateError::NoChildSession);
    }
    let token = match parts.backend.registry.claim_resume(&entry.delegation_id, entry.child_index) {
        Ok(ResumeClaim::Claimed { token }) => token,
        Ok(ResumeClaim::Busy { claimed_at, expires_at }) => {
            return Err(DelegateError::Busy { target: fu.target.clone(), claimed_at, expires_at });
        }
        Ok(ResumeClaim::Unavailable) => return Err(not_addressable()),
        Err(e) => {
            log::warn!("resume claim failed: {e}");
            return Err(not_addressable());
        }
    };
    let claim = ClaimGuard {
        registry: Arc::clone(&parts.backend.registry),
        delegation_id: entry.delegation_id.clone(),
        child_index: entry.child_index,
        token,
        held: true,
    };
    resume(inner, fu, parent, &entry, claim, cancel)
}

/// A held resume claim, released when dropped unless the follow-up's
/// finish released it: on every path (an error, a panic) exactly once.
struct ClaimGuard {
    registry: Arc<dyn retinue_core::Registry>,
    delegation_id: String,
    child_index: u32,
    token: String,
    held: bool,
}

impl ClaimGuard {
    /// The finish released the claim (with the unit's refresh).
    fn finished(mut self) {
        self.held = false;
    }
}

impl Drop for ClaimGuard {
    fn drop(&mut self) {
        if !self.held {
            return;
        }
        if let Err(e) =
            self.registry.release_resume(&self.delegation_id, self.child_index, &self.token)
        {
            log::warn!("could not release the resume claim of {}: {e}", self.delegation_id);
        }
    }
}

/// The workspace a resumed child works in: the one it was spawned in
/// (which must still exist, and lie within the requesting parent's own
/// workspace: a stored path is untrusted), else the parent's.
fn restored_workspace(
    fu: &FollowUp,
    recorded: Option<&str>,
    parent: &ParentContext,
) -> Result<Option<std::path::PathBuf>, DelegateError> {
    let Some(recorded) = recorded.filter(|w| !w.is_empty()) else {
        return Ok(parent.workspace.clone());
    };
    let gone = || DelegateError::WorkspaceGone {
        target: fu.target.clone(),
        workspace: recorded.to_owned(),
    };
    let Ok(real) = std::fs::canonicalize(recorded) else { return Err(gone()) };
    if !real.is_dir() {
        return Err(gone());
    }
    let Some(mine) = parent.workspace.as_deref() else { return Ok(None) };
    let mine = std::fs::canonicalize(mine).unwrap_or_else(|_| mine.to_path_buf());
    if real.starts_with(&mine) {
        Ok(Some(real))
    } else {
        Err(DelegateError::WorkspaceOutside {
            target: fu.target.clone(),
            workspace: recorded.to_owned(),
            parent_workspace: mine.to_string_lossy().into_owned(),
        })
    }
}

/// The transcript a resume continues: the compression tip of the child's
/// session, its turns (system prompts aside) and its system prompt.
struct Transcript {
    tip: String,
    history: Vec<Message>,
    system_prompt: Option<String>,
}

fn transcript_error(session: &str, e: retinue_core::Error) -> DelegateError {
    DelegateError::Transcript { session_id: session.to_owned(), message: e.to_string() }
}

/// A resume: load the transcript → check its size → reserve → plan the
/// child → open its next turn → run (the claim renewed meanwhile) →
/// finalize. The claim and the reservation are guards: an early return
/// or a panic gives them back.
fn resume(
    inner: &Arc<Inner>,
    fu: &FollowUp,
    parent: &ParentContext,
    entry: &RetainedChild,
    claim: ClaimGuard,
    cancel: &CancelToken,
) -> Result<DelegateOutcome, DelegateError> {
    let started = Instant::now();
    let transcript = load_transcript(inner, entry)?;
    let estimate = resume_size(inner, fu, &transcript)?;
    // A follow-up draws on the budget its child was spawned under (stored
    // when the child was created), else on the requester's.
    let root = match requester(parent) {
        Some(p) => budget::budget_root(inner, p, Some(&entry.child_session_id)),
        None => Err("no parent session".to_owned()),
    };
    let held = budget::reserve(
        inner,
        requester(parent),
        &root,
        BudgetLimit::default(),
        Spend { cost_usd: budget::MIN_COST_USD, tokens: estimate },
        Some(&entry.delegation_id),
    )?;
    let metered = held.as_ref().map_or_else(|| cancel.clone(), |h| h.token(cancel));
    let (spec, dropped) = resumed_spec(inner, fu, parent, entry, &transcript.tip)?;
    open_turn(inner, fu, &transcript.tip)?;
    let Transcript { tip, history, system_prompt } = transcript;
    let input = RunInput { user_message: fu.text.clone(), history, system_prompt };
    // The follow-up's span links to the call that spawned the child.
    let linked = inner
        .parts
        .backend
        .controls
        .unit_view(&entry.delegation_id)
        .ok()
        .flatten()
        .and_then(|u| u.traceparent);
    let call =
        crate::telemetry::call_span(parent.trace_parent.as_deref(), linked.as_deref(), "follow_up");
    crate::telemetry::set_unit(&call, &entry.delegation_id);
    let mut result = run_renewing(inner, &claim, &spec, input, parent, &metered, &call);
    let failed = (result.status != retinue_core::ChildStatus::Completed)
        .then(|| result.exit_reason.as_str().to_owned());
    crate::telemetry::end_call(&call, failed.as_deref());
    result.toolsets_dropped = dropped;
    crate::isolated::record(inner, &mut result);
    let results = [result];
    let ledger_ok = finalize(inner, parent, &entry.delegation_id, &claim.token, &results);
    finish(inner, entry, claim, &results);
    let [result] = results;
    let budget = held.and_then(|h| h.settle(ledger_ok));
    Ok(DelegateOutcome::FollowedUp(Box::new(FollowUpReport {
        budget,
        ledger_error: (!ledger_ok).then(|| texts::LEDGER_FAILED.to_owned()),
        child_id: entry.child_id().to_owned(),
        child_session_id: tip,
        delegation_id: entry.delegation_id.clone(),
        result,
        total_duration_seconds: started.elapsed().as_secs_f64(),
    })))
}

/// The child's transcript at its compression tip; an empty one cannot be
/// resumed.
fn load_transcript(inner: &Inner, entry: &RetainedChild) -> Result<Transcript, DelegateError> {
    let sessions = &inner.parts.backend.sessions;
    let tip = sessions
        .compression_tip(&entry.child_session_id)
        .map_err(|e| transcript_error(&entry.child_session_id, e))?;
    let turns = sessions.conversation(&tip).map_err(|e| transcript_error(&tip, e))?;
    let mut system_prompt = None;
    let history: Vec<Message> = turns
        .into_iter()
        .filter(|m| {
            if m.role == "system" {
                if system_prompt.is_none() {
                    system_prompt.clone_from(&m.content);
                }
                false
            } else {
                true
            }
        })
        .collect();
    if history.is_empty() {
        return Err(DelegateError::EmptyTranscript { session_id: tip });
    }
    if system_prompt.is_none() {
        system_prompt = sessions.session(&tip).ok().flatten().and_then(|s| s.system_prompt);
    }
    Ok(Transcript { tip, history, system_prompt })
}

/// The resume-cost guard (`max_resume_tokens`), before any model call:
/// the estimate of what resuming sends.
fn resume_size(inner: &Inner, fu: &FollowUp, t: &Transcript) -> Result<u64, DelegateError> {
    let max = inner.parts.config.max_resume_tokens;
    let estimate = budget::resume_estimate(&t.history, &fu.text)
        .saturating_add(budget::tokens_of(t.system_prompt.as_deref().unwrap_or_default()));
    if max > 0 && estimate > max {
        return Err(DelegateError::ResumeTooLarge { target: fu.target.clone(), estimate, max });
    }
    Ok(estimate)
}

/// The resumed child's spec. Its tools come back as they were: its
/// toolsets (still within today's grant: a stored manifest is untrusted,
/// and never widens it; a child hermes recorded without any gets the
/// parent's grant) and its workspace. The stored role is untrusted too: an
/// orchestrator only where a spawn here could make one.
fn resumed_spec(
    inner: &Inner,
    fu: &FollowUp,
    parent: &ParentContext,
    entry: &RetainedChild,
    tip: &str,
) -> Result<(ChildSpec, Vec<crate::toolsets::DroppedToolset>), DelegateError> {
    let config = &inner.parts.config;
    let m = &entry.manifest;
    let pick = |v: &Option<String>, fallback: &str| {
        v.clone()
            .filter(|s| !s.is_empty())
            .or_else(|| Some(fallback.to_owned()).filter(|s| !s.is_empty()))
    };
    let role = crate::spawn::effective_role(
        m.role.as_deref().map_or(Role::Leaf, Role::parse),
        config,
        parent,
    );
    // An isolated child resumes in its worktree, on top of its changes; one
    // whose worktree record is gone is refused by the recorded path check.
    let workspace = match crate::isolated::reopen(inner, &entry.subagent_id)? {
        Some(worktree) => Some(worktree),
        None => restored_workspace(fu, m.workspace.as_deref(), parent)?,
    };
    let grant = crate::toolsets::grant(
        &config.toolsets,
        parent,
        m.toolsets.as_deref(),
        &role,
        config.inherit_mcp_toolsets,
    );
    let spec = ChildSpec {
        subagent_id: entry.subagent_id.clone(),
        session_id: entry.child_session_id.clone(),
        task_index: usize::try_from(entry.child_index).unwrap_or(0),
        goal: fu.text.clone(),
        context: None,
        role,
        model: pick(&m.model, &config.model),
        provider: pick(&m.provider, &config.provider),
        api_mode: pick(&m.api_mode, &config.api_mode),
        toolsets: grant.granted,
        workspace,
        depth: parent.depth.saturating_add(1),
        max_iterations: config.max_iterations,
        resume_session_id: Some(tip.to_owned()),
    };
    Ok((spec, grant.dropped))
}

/// Reopens the tip session and writes the follow-up as its next user turn.
fn open_turn(inner: &Inner, fu: &FollowUp, tip: &str) -> Result<(), DelegateError> {
    let sessions = &inner.parts.backend.sessions;
    sessions
        .reopen_session(tip)
        .and_then(|_| {
            let user = Message {
                role: "user".to_owned(),
                content: Some(fu.text.clone()),
                ..Message::default()
            };
            sessions.append_message(tip, &user)
        })
        .map(|_| ())
        .map_err(|e| transcript_error(tip, e))
}

/// Runs the resumed child, renewing its claim on a side thread meanwhile.
fn run_renewing(
    inner: &Arc<Inner>,
    claim: &ClaimGuard,
    spec: &ChildSpec,
    input: RunInput,
    parent: &ParentContext,
    metered: &CancelToken,
    call: &opentelemetry::Context,
) -> ChildReport {
    let (stop_tx, stop_rx) = mpsc::channel::<()>();
    let registry = Arc::clone(&claim.registry);
    let (id, index, tok) = (claim.delegation_id.clone(), claim.child_index, claim.token.clone());
    let renewer = std::thread::spawn(move || {
        while let Err(mpsc::RecvTimeoutError::Timeout) = stop_rx.recv_timeout(RENEW_EVERY) {
            if !matches!(registry.renew_resume(&id, index, &tok), Ok(true)) {
                log::warn!("resume claim of {id}:{index} could not be renewed");
            }
        }
    });
    let result = execute(inner, spec, input, false, parent.session_id.clone(), metered, call);
    drop(stop_tx);
    let _ = renewer.join();
    result
}

/// Adds the run to the unit's usage by compare-and-swap (so a concurrent
/// follow-up on a sibling never loses its run), refreshes the unit's
/// retention and releases the claim, in one write; on failure the claim's
/// guard releases it.
fn finish(inner: &Inner, entry: &RetainedChild, claim: ClaimGuard, results: &[ChildReport]) {
    let registry = &inner.parts.backend.registry;
    let runs = runs_of(results);
    let mut finished = Err(retinue_core::Error::Stale { what: "the unit's usage_json" });
    for _ in 0..8 {
        let existing = match registry.unit_usage(&entry.delegation_id) {
            Ok(v) => v,
            Err(e) => {
                finished = Err(e);
                break;
            }
        };
        let swap = UsageSwap {
            new: retinue_usage::merge_unit_usage(existing.as_ref(), &runs),
            expected: existing,
        };
        finished = registry.finish_follow_up(
            &entry.delegation_id,
            entry.child_index,
            &claim.token,
            Some(&swap),
        );
        if !matches!(finished, Err(retinue_core::Error::Stale { .. })) {
            break;
        }
    }
    match finished {
        Ok(_) => claim.finished(),
        Err(e) => log::warn!("could not refresh {} after a follow-up: {e}", entry.delegation_id),
    }
}
