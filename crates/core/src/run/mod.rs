//! The run seams: what the orchestrator (`retinue-delegate`) and a child
//! runtime (`retinue-runtime`, a scripted double) say to each other, and
//! what a runtime says to the tools (`retinue-tools`).
//!
//! - [`ChildRuntime`] builds, runs and steers one child from a [`ChildSpec`]
//!   to a [`ChildOutcome`], writing through a [`TranscriptSink`].
//! - [`RunContext`] travels with each run: its [`CancelToken`] (deadline,
//!   stop, budget) and, for an orchestrator child, the [`Delegate`]
//!   capability its `delegate_task` calls go through — handed down per run,
//!   so no runtime or toolbox holds a reference back to the orchestrator.
//! - [`BudgetMeter`] / [`CallPermit`]: the leave a runtime asks for before
//!   each model call (the money rules live here, the stores only store).
//! - [`ToolExecutor`] runs a child's tool calls; [`CompletionSink`] receives
//!   background completions.
//! - [`Isolation`]: a git worktree per child and its change set.

use std::path::PathBuf;
use std::sync::Arc;

use serde_json::Value;

use crate::CompletionEvent;
use crate::{ExitReason, Message, Role};

mod cancel;
mod isolation;
mod meter;

pub use cancel::{CancelReason, CancelToken, PauseGuard};
#[cfg(any(test, feature = "mocks"))]
pub use isolation::MockIsolation;
pub use isolation::{
    ChangeSet, ChangeState, FileChange, Isolation, IsolationError, IsolationMode, Owner,
};
pub use meter::{BudgetMeter, CallPermit, CallPlan, CallRefusal, CallUsage, MeterStore};

/// The toolset names a child is built with (hermes's names).
pub mod toolsets {
    /// The read-only subset of hermes's `file` toolset (Retinue's default).
    pub const READ: &str = "read";
    /// hermes's `file` toolset (read, write, patch, search).
    pub const FILE: &str = "file";
    /// hermes's `terminal` toolset.
    pub const TERMINAL: &str = "terminal";
    /// hermes's `delegation` toolset (`delegate_task`), for orchestrators only.
    pub const DELEGATION: &str = "delegation";
    /// The prefix of an MCP server's toolset (`mcp-<server>`, hermes's name).
    pub const MCP_PREFIX: &str = "mcp-";
    /// The built-in tools' names (hermes's); an MCP server's tools are
    /// `mcp__<server>__<tool>`.
    pub const TOOL_NAMES: &[&str] =
        &["read_file", "search_files", "write_file", "patch", "terminal", "delegate_task"];
}

/// Everything a runtime needs to build one child.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChildSpec {
    /// `sa-<index>-<8hex>`.
    pub subagent_id: String,
    /// The child's session id (for a resume: the session it continues).
    pub session_id: String,
    /// Task index in its unit.
    pub task_index: usize,
    /// The goal.
    pub goal: String,
    /// Extra context.
    pub context: Option<String>,
    /// `leaf` or `orchestrator` (as a spawn here may grant it).
    pub role: Role,
    /// Model.
    pub model: Option<String>,
    /// Provider.
    pub provider: Option<String>,
    /// API mode.
    pub api_mode: Option<String>,
    /// Toolsets the child may use (hermes's names: `read`, `file`,
    /// `terminal`, `mcp-<server>`, `delegation`).
    pub toolsets: Vec<String>,
    /// The directory every tool of the child works in (`None`: the child
    /// gets no workspace, so no file or terminal tool works).
    pub workspace: Option<PathBuf>,
    /// The child's delegation depth (1 for a child of a top-level parent).
    pub depth: u32,
    /// Iteration budget.
    pub max_iterations: u32,
    /// Set when the child resumes an existing session.
    pub resume_session_id: Option<String>,
}

/// A built child, as the runtime identifies it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChildHandle {
    /// The subagent id.
    pub subagent_id: String,
    /// The session the child writes to.
    pub session_id: String,
    /// The toolsets the child was built with.
    pub toolsets: Vec<String>,
    /// The child's workspace.
    pub workspace: Option<PathBuf>,
    /// The child's delegation depth.
    pub depth: u32,
}

impl ChildHandle {
    /// The handle of a child built from `spec`: it writes to the session it
    /// resumes, else its own, and keeps the spec's toolsets, workspace and
    /// depth for the tools it runs.
    pub fn of(spec: &ChildSpec) -> ChildHandle {
        ChildHandle {
            subagent_id: spec.subagent_id.clone(),
            session_id: spec.resume_session_id.clone().unwrap_or_else(|| spec.session_id.clone()),
            toolsets: spec.toolsets.clone(),
            workspace: spec.workspace.clone(),
            depth: spec.depth,
        }
    }
}

/// One run's input.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RunInput {
    /// The new user turn.
    pub user_message: String,
    /// The persisted dialogue (no `system` rows) for a resume; empty for a spawn.
    pub history: Vec<Message>,
    /// The system prompt, passed once.
    pub system_prompt: Option<String>,
}

/// Token counts of one run, summed over its model calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RunTokens {
    /// Prompt (input) tokens, cached ones included.
    pub input: u64,
    /// Completion (output) tokens, reasoning ones included.
    pub output: u64,
    /// Prompt tokens served from the provider's cache.
    pub cached_input: u64,
    /// Completion tokens spent on reasoning.
    pub reasoning: u64,
}

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChildOutcome {
    /// The child's final answer.
    pub final_response: Option<String>,
    /// Why the run stopped.
    pub exit_reason: ExitReason,
    /// Model API calls made.
    pub api_calls: u64,
    /// Tokens used (partial runs report what they used so far).
    pub tokens: RunTokens,
    /// Cost in US dollars.
    pub cost_usd: f64,
    /// Error text, if the run failed.
    pub error: Option<String>,
    /// Steering messages the runtime accepted but never folded into the run
    /// (they arrived after its last iteration); reported as `missed_steer`.
    pub missed_steers: Vec<String>,
    /// The model the run used, when the runtime chose it (it may differ
    /// from the child's recorded one: an override, the config of the day).
    pub model: Option<String>,
    /// The endpoint the run called (redacted), when the runtime reports it.
    pub endpoint: Option<String>,
}

impl ChildOutcome {
    /// An outcome that ended with `reason` and `error`, having done nothing.
    pub fn failed(reason: ExitReason, error: impl Into<String>) -> ChildOutcome {
        ChildOutcome { exit_reason: reason, error: Some(error.into()), ..ChildOutcome::default() }
    }
}

/// Why a transcript write was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SinkError {
    /// The run was stopped (timeout or cancellation); its transcript is closed.
    #[error("transcript of {session_id} is closed (the run was stopped)")]
    Closed {
        /// The child's session.
        session_id: String,
    },
    /// The store could not write the message.
    #[error("could not append to {session_id}: {message}")]
    Storage {
        /// The child's session.
        session_id: String,
        /// What the store said.
        message: String,
    },
}

/// Why a runtime could not build or run a child.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RuntimeError {
    /// The child's configuration cannot work (no model, unsupported
    /// `api_mode`, missing key, …); the text says what to fix.
    #[error("{0}")]
    Config(String),
    /// Any other failure to build the child.
    #[error("{0}")]
    Build(String),
}

/// Where a running child writes its transcript.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait TranscriptSink: Send + Sync {
    /// Appends one message to the child's session.
    fn append(&self, message: &Message) -> Result<(), SinkError>;
}

/// A child runtime: builds, runs and steers children.
///
/// `run` must watch `ctx.cancel`: once [`CancelToken::is_cancelled`] is true
/// (explicit cancellation or the child's deadline), it stops as soon as it
/// can — aborting an in-flight model call where possible — and returns an
/// outcome that reports the usage spent so far, so the partial run is billed.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait ChildRuntime: Send + Sync {
    /// Builds a child (on `spec.resume_session_id` when resuming).
    fn build(&self, spec: &ChildSpec) -> Result<ChildHandle, RuntimeError>;
    /// Runs the child to an outcome, writing its output through `sink`,
    /// under `ctx` (its cancel token; its delegation capability, for the
    /// tools it hands to [`ToolExecutor::execute_in`]).
    fn run(
        &self,
        child: &ChildHandle,
        input: &RunInput,
        sink: &dyn TranscriptSink,
        ctx: &RunContext,
    ) -> ChildOutcome;
    /// Queues a message for a running child; `false` if refused.
    fn steer(&self, child: &ChildHandle, message: &str) -> bool;
}

/// Nested delegation, as a capability: an orchestrator child's
/// `delegate_task` calls go through it. The orchestrator hands it to each
/// run in its [`RunContext`]; nothing keeps it beyond the run.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait Delegate: Send + Sync {
    /// The `delegate_task` function definition (`{"name", "description",
    /// "parameters"}`) offered to an orchestrator child.
    fn schema(&self) -> Value;
    /// Runs one `delegate_task` call of `child` with the model's
    /// `arguments`, its grandchildren under `cancel`; the text the model
    /// reads (a JSON result, then each grandchild's receipts line, or
    /// `{"error": …}`).
    fn delegate_task(&self, child: &ChildHandle, arguments: &Value, cancel: &CancelToken)
    -> String;
}

/// A call that needs a human's approval before it runs.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GatedCall {
    /// The tool.
    pub tool: String,
    /// Its arguments, secrets redacted.
    pub arguments: Value,
    /// Why it needs approval (the classifier's or the rule's words).
    pub reason: String,
}

/// What became of a [`GatedCall`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateAnswer {
    /// Approved: run it. The note (`approved by <who> (<id>)`) is put
    /// before the call's output, so the decision sits next to the call in
    /// the child's transcript.
    Run(String),
    /// Not approved: the text the model reads instead of the call's output
    /// (`denied by <who>: <reason>`, `approval expired after N s`).
    Refuse(String),
}

/// Human approval, as a capability handed to each run by the orchestrator
/// (issue #37): a tool whose call needs approval asks through it and waits.
/// The wait holds no model call and no budget hold, and the run's deadline
/// is paused meanwhile ([`CancelToken::pause`]); a cancellation ends it.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait ApprovalGate: Send + Sync {
    /// Asks for `call` of `child` and waits for the decision.
    fn ask(&self, child: &ChildHandle, call: &GatedCall, cancel: &CancelToken) -> GateAnswer;
}

/// What travels with one run: its stop signal, for an orchestrator child
/// the delegation capability, and the approval gate. Cheap to clone.
#[derive(Clone, Default)]
pub struct RunContext {
    /// The run's deadline, stop and budget.
    pub cancel: CancelToken,
    /// Nested delegation (`None`: `delegate_task` is not available).
    pub delegate: Option<Arc<dyn Delegate>>,
    /// Where a call that needs approval asks (`None`: nobody can approve,
    /// so such a call is refused).
    pub approvals: Option<Arc<dyn ApprovalGate>>,
}

impl std::fmt::Debug for RunContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunContext")
            .field("cancel", &self.cancel)
            .field("delegate", &self.delegate.is_some())
            .field("approvals", &self.approvals.is_some())
            .finish()
    }
}

impl RunContext {
    /// A context with `cancel`, no delegation and no approval gate.
    pub fn new(cancel: CancelToken) -> RunContext {
        RunContext { cancel, delegate: None, approvals: None }
    }

    /// This context, with `gate` for the calls that need approval.
    #[must_use]
    pub fn with_approvals(mut self, gate: Arc<dyn ApprovalGate>) -> RunContext {
        self.approvals = Some(gate);
        self
    }

    /// This context, with `delegate` for the run's `delegate_task` calls.
    #[must_use]
    pub fn with_delegate(mut self, delegate: Arc<dyn Delegate>) -> RunContext {
        self.delegate = Some(delegate);
        self
    }
}

/// Receives background completions; idempotent per `delegation_id`.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait CompletionSink: Send + Sync {
    /// Delivers one completion event; `true` once accepted (also for a repeat).
    fn deliver(&self, event: &CompletionEvent) -> bool;
}

/// Why a tool call produced no output. The text goes back to the model as
/// the tool result (`{"error": TEXT}`, hermes's shape), so it says what to
/// change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolError {
    /// No tool of that name is offered to this child.
    #[error("unknown tool `{name}`")]
    Unknown {
        /// The name the model called.
        name: String,
    },
    /// The arguments are missing, of the wrong type or out of range.
    #[error("{0}")]
    InvalidArguments(String),
    /// The call is not allowed (a path outside the workspace, a toolset the
    /// child lacks, a sandbox that cannot be set up).
    #[error("{0}")]
    Refused(String),
    /// The tool ran and failed (a missing file, a dead MCP server, …).
    #[error("{0}")]
    Failed(String),
}

/// A child's tools, supplied by the embedder.
///
/// Object-safe, synchronous and `Send + Sync`: one executor serves every
/// child, called from each child's own thread (and, for the calls of one
/// answer, from a few threads at once).
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait ToolExecutor: Send + Sync {
    /// The tool definitions advertised to `child`'s model, in the Chat
    /// Completions form (`{"type": "function", "function": {"name", "description",
    /// "parameters": JSON schema}}`). Empty: no tools.
    fn definitions(&self, child: &ChildHandle) -> Vec<Value>;

    /// Runs tool `name` with `arguments` (the model's arguments, parsed JSON)
    /// for `child`; the output, or the error, goes back to the model as the
    /// tool result.
    fn execute(
        &self,
        child: &ChildHandle,
        name: &str,
        arguments: &Value,
    ) -> Result<String, ToolError>;

    /// [`ToolExecutor::definitions`] within a run: `ctx` says what the run
    /// may use beyond the child's toolsets (its delegation capability). The
    /// runtime calls this; by default it is `definitions`.
    fn definitions_in(&self, child: &ChildHandle, ctx: &RunContext) -> Vec<Value> {
        let _ = ctx;
        self.definitions(child)
    }

    /// [`ToolExecutor::execute`] within the child's run: `ctx.cancel` is the
    /// run's token (its deadline, its budget, a stop), which a long tool
    /// (a command, a nested delegation) should obey, and `ctx.delegate` the
    /// capability a `delegate_task` call goes through. The runtime calls
    /// this; by default it ignores both.
    fn execute_in(
        &self,
        child: &ChildHandle,
        name: &str,
        arguments: &Value,
        ctx: &RunContext,
    ) -> Result<String, ToolError> {
        let _ = ctx;
        self.execute(child, name, arguments)
    }
}

/// No tools: the model is offered none, and any call it makes anyway gets an
/// "unknown tool" result.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoTools;

impl ToolExecutor for NoTools {
    fn definitions(&self, _child: &ChildHandle) -> Vec<Value> {
        Vec::new()
    }

    fn execute(
        &self,
        _child: &ChildHandle,
        name: &str,
        _arguments: &Value,
    ) -> Result<String, ToolError> {
        Err(ToolError::Unknown { name: name.to_owned() })
    }
}
