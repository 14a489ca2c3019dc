//! The tool's contractual wire texts (semantics §6.2–6.5).

/// No parent context.
pub const NO_PARENT: &str = "delegate_task requires a parent agent context.";
/// `follow_up` not a string.
pub const FOLLOW_UP_NOT_STRING: &str =
    "follow_up must be a string (a subagent_id, child session_id or delegation_id).";
/// Blank `follow_up`.
pub const FOLLOW_UP_BLANK: &str = "follow_up must name a subagent; got an empty value.";
/// Follow-up without a goal.
pub const FOLLOW_UP_NO_GOAL: &str =
    "follow_up requires 'goal' (the message to deliver to the child).";
/// Spawning paused.
pub const PAUSED: &str = "Delegation spawning is paused; clear the pause before retrying.";
/// `tasks` not an array.
pub const TASKS_NOT_ARRAY: &str = "tasks must be a JSON array of task objects.";
/// Neither goal nor tasks.
pub const NO_GOAL_OR_TASKS: &str = "Provide either 'goal' (single task) or 'tasks' (batch).";
/// Unit could not be written.
pub const PERSIST_FAILED: &str = "Failed to persist delegation; no child was started.";
/// Parent cannot receive detached results.
pub const NO_DETACHED: &str = "This parent cannot receive detached results; ran synchronously.";
/// Retained record without a child session.
pub const NO_CHILD_SESSION: &str =
    "Retained record has no child session id; cannot resume the child's transcript.";
/// Steer receipt.
pub const STEER_RECEIPT: &str = "Message queued for the running subagent; it folds in at the child's next iteration boundary (the current tool call is never cut).";
/// Resume note.
pub const RESUME_NOTE: &str = "Follow-up ran as the retained child's next user turn on its own persisted session (budget-exempt: no spawn depth or concurrency consumed).";
/// [`RESUME_NOTE`] when a delegation budget was charged (it is not exempt
/// from that: only from spawn depth and concurrency).
pub const RESUME_NOTE_CHARGED: &str = "Follow-up ran as the retained child's next user turn on its own persisted session (no spawn depth or concurrency consumed; its usage was charged to the delegation budget).";
/// Background note.
pub const BACKGROUND_NOTE: &str = "Children run in the background; their results are delivered to this session when they finish. Address a child later with follow_up=<subagent_id>.";

/// Depth limit reached.
pub fn depth_limit(depth: u32, max: u32) -> String {
    format!(
        "Delegation depth limit reached (depth={depth}, max_spawn_depth={max}). Raise delegation.max_spawn_depth to allow deeper nesting."
    )
}

/// Task `i` not an object with a goal.
pub fn task_not_object(i: usize) -> String {
    format!("Task {i} must be an object with a 'goal'.")
}

/// Task `i` without a goal.
pub fn task_missing_goal(i: usize) -> String {
    format!("Task {i} is missing a 'goal'.")
}

/// Too many tasks.
pub fn too_many_tasks(n: usize, max: usize) -> String {
    format!("Too many tasks: {n} exceeds delegation.max_concurrent_children ({max}).")
}

/// How many characters of an id the texts echo.
pub const SHOWN_ID_CHARS: usize = 128;

/// The trimmed target, at most [`SHOWN_ID_CHARS`] characters.
pub fn shown_id(id: &str) -> String {
    retinue_core::truncate_chars(id.trim(), SHOWN_ID_CHARS)
}

/// Missing and foreign targets: byte-identical.
pub fn not_addressable(id: &str) -> String {
    format!(
        "follow_up target '{}' is not a running subagent or a retained completed child that this session lineage may message. Address a subagent_id, child session_id or delegation_id returned in this conversation or its compression continuations.",
        shown_id(id)
    )
}

/// An authorised caller addressing a tombstoned child.
pub fn tombstoned(id: &str, at: f64, reason: &str, session: &str) -> String {
    format!(
        "follow_up target '{}' was tombstoned at {} (reason: {reason}) and can no longer receive follow-ups. Its transcript is kept (session {session}).",
        shown_id(id),
        retinue_core::iso8601(at)
    )
}

/// Another follow-up holds the resume claim.
pub fn busy(id: &str, claimed_at: f64, expires_at: f64) -> String {
    format!(
        "follow_up target '{}' is busy: another follow-up is already resuming this child (claimed {}, lease until {}). Retry when it finishes.",
        shown_id(id),
        retinue_core::iso8601(claimed_at),
        retinue_core::iso8601(expires_at)
    )
}

/// Transcript could not be read.
pub fn transcript_error(sid: &str, error: &str) -> String {
    format!("Could not load the retained child's transcript ({sid}): {error}")
}

/// Transcript is empty.
pub fn transcript_empty(sid: &str) -> String {
    format!("Retained child transcript ({sid}) is empty; nothing to resume.")
}

/// A child's deadline passed.
pub fn timed_out(seconds: f64) -> String {
    format!("Subagent timed out after {seconds:.0} seconds.")
}

/// The caller cancelled the call while the child ran.
pub const CANCELLED: &str = "Subagent was cancelled; its partial work is kept.";

/// How many characters of a goal a background dispatch echoes.
pub const GOAL_PREVIEW_CHARS: usize = 200;

/// The usage ledger could not be written after a run.
pub const LEDGER_FAILED: &str = "The usage ledger could not be written: this run's spend is kept in the lineage budget as spent (never given back as free) until `retinue recover` reconciles it; the totals shown may be incomplete.";

/// A child stopped because its budget allowance was spent.
pub const BUDGET_SPENT: &str = "Subagent stopped: its budget allowance is spent (delegation.budget); its partial work is kept and billed.";

/// A malformed `budget` argument.
pub const BAD_BUDGET: &str =
    "budget must be an object {\"max_cost_usd\": number >= 0, \"max_tokens\": integer >= 0}.";
/// The budget's root cannot be proven: refused rather than billed to a
/// budget of its own.
pub fn budget_root_unknown(payer: &str, why: &str) -> String {
    format!(
        "A delegation budget is configured, but the budget of session '{}' cannot be determined ({why}); refusing rather than spending outside the budget.",
        shown_id(payer)
    )
}

/// An invalid budget setting: refused, never treated as "no limit".
pub fn invalid_budget(why: &str) -> String {
    format!("Invalid delegation budget: {why}; refusing rather than spending without a limit.")
}

/// A budget needs a paying session.
pub const NO_BUDGET_PAYER: &str =
    "A delegation budget is configured, but this call has no parent session to bill; refusing.";

fn money_tokens(cost: Option<f64>, tokens: Option<u64>) -> String {
    match (cost, tokens) {
        (Some(c), Some(t)) => format!("${c:.4} and {t} tokens"),
        (Some(c), None) => format!("${c:.4}"),
        (None, Some(t)) => format!("{t} tokens"),
        (None, None) => "unlimited".to_owned(),
    }
}

/// A spawn or follow-up refused before any model call: it would exceed the budget.
pub fn budget_refused(
    root: &str,
    status: &retinue_core::BudgetStatus,
    needs: retinue_core::Spend,
) -> String {
    let (cost_left, tokens_left) = status.remaining();
    let limited = |cost: f64, tokens: u64| {
        money_tokens(
            status.limit.max_cost_usd.map(|_| cost),
            status.limit.max_tokens.map(|_| tokens),
        )
    };
    // Spend alone leaves too little: exceeded; else the rest is held.
    let (what, advice) = if status.exceeded_by(needs) {
        (
            "Budget exceeded",
            "Raise delegation.budget, pass a smaller budget, or wait for running children to finish.",
        )
    } else {
        (
            "Budget held by running delegations",
            "Wait for running children to finish (what they do not spend is given back), or raise delegation.budget.",
        )
    };
    format!(
        "{what} for the session lineage rooted at '{}': spent {}, reserved by running children {}, limit {}, remaining {}; this call needs at least {}. {advice}",
        shown_id(root),
        limited(status.spent.cost_usd, status.spent.tokens),
        limited(status.reserved.cost_usd, status.reserved.tokens),
        money_tokens(status.limit.max_cost_usd, status.limit.max_tokens),
        money_tokens(cost_left, tokens_left),
        limited(needs.cost_usd, needs.tokens),
    )
}

/// A follow-up whose resume would send too many input tokens.
pub fn resume_too_large(id: &str, estimate: u64, max: u64) -> String {
    format!(
        "follow_up target '{}' was not resumed: resuming it would send about {estimate} input tokens (its whole transcript), above delegation.max_resume_tokens ({max}). Start a fresh child instead and pass a summary of what it found as context.",
        shown_id(id)
    )
}

/// A background unit dispatched while every background slot was taken.
pub const BACKGROUND_QUEUED_NOTE: &str = "Background capacity (delegation.max_concurrent_children) \
    is full: the unit is queued and starts when a running unit finishes. Collect its result \
    with wait_subagents (or `retinue wait`); it is also delivered with a later tool result.";

/// The parent cancelled the unit (`retinue cancel`, `cancel_subagent`,
/// `tasks/cancel`).
pub const CANCEL_REQUESTED: &str =
    "Subagent was cancelled by its parent; its partial work is kept.";

/// A queued unit's deadline passed before a slot freed.
pub const QUEUED_TIMEOUT: &str = "Subagent timed out while queued for a background slot.";

/// A unit already holds `MAX_PENDING_PER_UNIT` pending approval requests.
pub const TOO_MANY_APPROVALS: &str =
    "denied: too many pending approvals (wait for the earlier requests to be decided)";

/// A call that needs approval in a child whose unit is gone or ended.
pub const APPROVAL_NO_UNIT: &str =
    "this call needs a human's approval, and this child's unit has ended: nobody can approve it";

/// The approval request could not be stored.
pub fn approval_unrecorded(error: &str) -> String {
    format!("this call needs a human's approval, and the request could not be recorded: {error}")
}
