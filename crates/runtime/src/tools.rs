//! The embedder's tools.

use retinue_delegate::{CancelToken, ChildHandle};
use serde_json::Value;

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

    /// [`ToolExecutor::execute`] within the child's run: `cancel` is the
    /// run's token (its deadline, its budget, a stop), which a long tool
    /// (a command, a nested delegation) should obey. The runtime calls this;
    /// by default it ignores the token.
    fn execute_with_cancel(
        &self,
        child: &ChildHandle,
        name: &str,
        arguments: &Value,
        cancel: &CancelToken,
    ) -> Result<String, ToolError> {
        let _ = cancel;
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

/// The function names of `definitions`.
pub(crate) fn tool_names(definitions: &[Value]) -> Vec<String> {
    definitions
        .iter()
        .filter_map(|d| d["function"]["name"].as_str().or_else(|| d["name"].as_str()))
        .map(str::to_owned)
        .collect()
}
