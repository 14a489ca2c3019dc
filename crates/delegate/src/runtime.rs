//! The seams to the outside world: the child runtime (a real LLM client or a
//! scripted fake), the transcript sink and the completion sink.

use retinue_store::Message;
use serde_json::Value;

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
    /// `leaf` or `orchestrator`.
    pub role: String,
    /// Model.
    pub model: Option<String>,
    /// Provider.
    pub provider: Option<String>,
    /// Provider base URL.
    pub base_url: Option<String>,
    /// API mode.
    pub api_mode: Option<String>,
    /// Toolsets the child may use.
    pub toolsets: Vec<String>,
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

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChildOutcome {
    /// The child's final answer.
    pub final_response: Option<String>,
    /// `completed`, `interrupted`, `max_iterations`, `timeout` or `error`.
    pub exit_reason: String,
    /// Model API calls made.
    pub api_calls: u64,
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Completion tokens.
    pub output_tokens: u64,
    /// Cost in US dollars.
    pub cost_usd: f64,
    /// Error text, if the run failed.
    pub error: Option<String>,
    /// Whether the run was interrupted.
    pub interrupted: bool,
    /// Steering messages the runtime accepted but never folded into the run
    /// (they arrived after its last iteration); reported as `missed_steer`.
    pub missed_steers: Vec<String>,
}

/// Where a running child writes its transcript.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait TranscriptSink: Send + Sync {
    /// Appends one message to the child's session.
    fn append(&self, message: &Message) -> Result<(), String>;
}

/// A child runtime: builds, runs and steers children.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait ChildRuntime: Send + Sync {
    /// Builds a child (on `spec.resume_session_id` when resuming).
    fn build(&self, spec: &ChildSpec) -> Result<ChildHandle, String>;
    /// Runs the child to an outcome, writing its output through `sink`.
    fn run(&self, child: &ChildHandle, input: &RunInput, sink: &dyn TranscriptSink)
    -> ChildOutcome;
    /// Queues a message for a running child; `false` if refused.
    fn steer(&self, child: &ChildHandle, message: &str) -> bool;
}

/// Receives background completions; idempotent per `delegation_id`.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait CompletionSink: Send + Sync {
    /// Delivers one completion event; `true` once accepted (also for a repeat).
    fn deliver(&self, event: &Value) -> bool;
}
