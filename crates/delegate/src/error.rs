//! The delegate crate's one error enum.
//!
//! Each variant's `Display` is the contractual wire text the JSON tool puts
//! under `"error"` (semantics §6.2–6.5); callers that need a decision (an exit
//! code, an MCP error kind) match on the variant or on [`DelegateError::kind`].

use crate::texts;

/// What a `delegate_task` call can fail with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DelegateError {
    /// The call carried no parent agent context.
    #[error("{}", texts::NO_PARENT)]
    NoParent,
    /// The arguments are malformed; the text says which rule they broke.
    #[error("{0}")]
    InvalidArguments(String),
    /// Spawning is paused.
    #[error("{}", texts::PAUSED)]
    Paused,
    /// The parent is already at the spawn depth limit.
    #[error("{}", texts::depth_limit(*depth, *max))]
    DepthExceeded {
        /// The parent's depth.
        depth: u32,
        /// `delegation.max_spawn_depth`.
        max: u32,
    },
    /// The target does not exist or the caller may not address it
    /// (byte-identical on purpose: foreign ≡ missing).
    #[error("{}", texts::not_addressable(target))]
    NotAddressable {
        /// The id as given.
        target: String,
    },
    /// A child addressed itself.
    #[error("{}", retinue_lineage::Denial::SelfFollowUp.message())]
    SelfTarget,
    /// The caller may address the child, but it was tombstoned.
    #[error("{}", texts::tombstoned(target, *at, reason, child_session_id))]
    Tombstoned {
        /// The id as given.
        target: String,
        /// When.
        at: f64,
        /// Why (`manual`, `ttl`, `cap`, `external`, …).
        reason: String,
        /// Its kept transcript.
        child_session_id: String,
    },
    /// Another follow-up holds the child's resume claim.
    #[error("{}", texts::busy(target, *claimed_at, *expires_at))]
    Busy {
        /// The id as given.
        target: String,
        /// When the claim was taken.
        claimed_at: f64,
        /// When its lease ends.
        expires_at: f64,
    },
    /// The retained child has no session to resume.
    #[error("{}", texts::NO_CHILD_SESSION)]
    NoChildSession,
    /// The workspace the child worked in no longer exists, so its tools
    /// cannot be restored.
    #[error(
        "Cannot resume {target}: its workspace {workspace} is gone (the child's tools work only \
         there); spawn a new child instead"
    )]
    WorkspaceGone {
        /// The id as given.
        target: String,
        /// The recorded workspace.
        workspace: String,
    },
    /// The child's recorded workspace is not inside the requesting
    /// parent's workspace.
    #[error(
        "Cannot resume {target} here: its workspace {workspace} is not inside this parent's \
         workspace {parent_workspace}; resume it from its own workspace"
    )]
    WorkspaceOutside {
        /// The id as given.
        target: String,
        /// The recorded workspace.
        workspace: String,
        /// The parent's workspace.
        parent_workspace: String,
    },
    /// The child's transcript could not be read or written.
    #[error("{}", texts::transcript_error(session_id, message))]
    Transcript {
        /// The session.
        session_id: String,
        /// What went wrong.
        message: String,
    },
    /// The child's transcript is empty: nothing to resume.
    #[error("{}", texts::transcript_empty(session_id))]
    EmptyTranscript {
        /// The session.
        session_id: String,
    },
    /// The budget cannot cover the call (or cannot be enforced); nothing ran.
    #[error("{message}")]
    Budget {
        /// What was spent, reserved, the limit and what remains.
        message: String,
    },
    /// Resuming the child would send more input tokens than
    /// `delegation.max_resume_tokens` allows; nothing ran.
    #[error("{}", texts::resume_too_large(target, *estimate, *max))]
    ResumeTooLarge {
        /// The id as given.
        target: String,
        /// The estimated input tokens of the resume.
        estimate: u64,
        /// `delegation.max_resume_tokens`.
        max: u64,
    },
    /// The unit could not be recorded; no child was started.
    #[error("{}", texts::PERSIST_FAILED)]
    Storage(#[source] retinue_core::Error),
    /// The budget store failed while reserving or joining a budget: nothing
    /// was started or spent.
    #[error("Budget check failed while {operation} ({source}); no child was started.")]
    BudgetStore {
        /// What was being done (`reserving the budget`, …).
        operation: &'static str,
        /// The store's error.
        #[source]
        source: retinue_core::Error,
    },
    /// A thread or another runtime resource could not be had.
    #[error("{0}")]
    Runtime(String),
    /// The unit has finished: there is nothing to cancel (or steer).
    #[error("Delegation '{target}' has already finished ({state}); there is nothing to {action}.")]
    Finished {
        /// The id as given.
        target: String,
        /// The unit's state.
        state: String,
        /// `cancel` or `steer`.
        action: &'static str,
    },
    /// A steer names a unit of several children, not one child.
    #[error("Delegation '{target}' has {children} children; steer one of them by its subagent id.")]
    WhichChild {
        /// The id as given.
        target: String,
        /// How many children the unit has.
        children: usize,
    },
    /// The registry could not be read.
    #[error("Could not read the registry: {0}")]
    Registry(#[source] retinue_core::Error),
    /// No approval request of that id exists for this caller (foreign ≡
    /// missing).
    #[error("No approval request '{}' is known to this caller.", texts::shown_id(id))]
    UnknownApproval {
        /// The id as given.
        id: String,
    },
    /// A worktree or change-set operation failed (isolation `worktree`).
    #[error("{0}")]
    Isolation(retinue_core::run::IsolationError),
    /// The approval request was decided (or expired) before this decision.
    #[error("Approval '{id}' was already decided: {state} by {decided_by}.")]
    AlreadyDecided {
        /// The request's id.
        id: String,
        /// Its state (`approved`, `denied`, `expired`).
        state: &'static str,
        /// Who decided it.
        decided_by: String,
    },
}

/// The class of a [`DelegateError`], for exit codes and protocol errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DelegateErrorKind {
    /// Bad arguments (or no parent context).
    Usage,
    /// Not allowed to address the target (foreign, missing, self).
    Denied,
    /// A limit refuses the call (spawn depth, paused spawning, budget,
    /// resume size).
    Limit,
    /// Known, but gone (tombstoned).
    NotFound,
    /// Retry later.
    Busy,
    /// Someone decided the approval request (or the change set) first.
    AlreadyDecided,
    /// Applying a change set conflicts with the parent's workspace.
    Conflict,
    /// Anything else.
    Failed,
}

impl DelegateErrorKind {
    /// The kind as a stable machine-readable code (`usage`, `denied`,
    /// `limit`, `not_found`, `busy`, `already_decided`, `conflict`, `failed`), as the MCP
    /// server reports it.
    pub fn as_str(self) -> &'static str {
        match self {
            DelegateErrorKind::Usage => "usage",
            DelegateErrorKind::Denied => "denied",
            DelegateErrorKind::Limit => "limit",
            DelegateErrorKind::NotFound => "not_found",
            DelegateErrorKind::Busy => "busy",
            DelegateErrorKind::AlreadyDecided => "already_decided",
            DelegateErrorKind::Conflict => "conflict",
            DelegateErrorKind::Failed => "failed",
        }
    }
}

impl DelegateError {
    /// The class of this error.
    pub fn kind(&self) -> DelegateErrorKind {
        match self {
            DelegateError::NoParent | DelegateError::InvalidArguments(_) => {
                DelegateErrorKind::Usage
            }
            DelegateError::NotAddressable { .. }
            | DelegateError::SelfTarget
            | DelegateError::WorkspaceOutside { .. } => DelegateErrorKind::Denied,
            DelegateError::DepthExceeded { .. }
            | DelegateError::Paused
            | DelegateError::Budget { .. }
            | DelegateError::ResumeTooLarge { .. } => DelegateErrorKind::Limit,
            DelegateError::Tombstoned { .. } | DelegateError::WorkspaceGone { .. } => {
                DelegateErrorKind::NotFound
            }
            DelegateError::Busy { .. } => DelegateErrorKind::Busy,
            DelegateError::NoChildSession
            | DelegateError::Transcript { .. }
            | DelegateError::EmptyTranscript { .. }
            | DelegateError::Storage(_)
            | DelegateError::BudgetStore { .. }
            | DelegateError::Registry(_)
            | DelegateError::Runtime(_) => DelegateErrorKind::Failed,
            DelegateError::Finished { .. } => DelegateErrorKind::Limit,
            DelegateError::WhichChild { .. } => DelegateErrorKind::Usage,
            DelegateError::UnknownApproval { .. } => DelegateErrorKind::NotFound,
            DelegateError::AlreadyDecided { .. } => DelegateErrorKind::AlreadyDecided,
            DelegateError::Isolation(e) => isolation_kind(e),
        }
    }
}

/// The class of an isolation error.
fn isolation_kind(e: &retinue_core::run::IsolationError) -> DelegateErrorKind {
    use retinue_core::run::IsolationError as E;
    match e {
        E::NotARepository { .. } | E::NoCommit { .. } | E::NothingToApply { .. } => {
            DelegateErrorKind::Usage
        }
        E::Unknown { .. } | E::Gone { .. } => DelegateErrorKind::NotFound,
        E::AlreadyApplied { .. } | E::Discarded { .. } => DelegateErrorKind::AlreadyDecided,
        E::Conflict { .. } => DelegateErrorKind::Conflict,
        _ => DelegateErrorKind::Failed,
    }
}
