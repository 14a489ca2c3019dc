//! The embedder's tools.

use retinue_delegate::ChildHandle;
use serde_json::Value;

/// A child's tools, supplied by the embedder.
///
/// Object-safe, synchronous and `Send + Sync`: one executor serves every
/// child, called from each child's own thread.
#[cfg_attr(any(test, feature = "mocks"), mockall::automock)]
pub trait ToolExecutor: Send + Sync {
    /// The tool definitions advertised to `child`'s model, in the Chat
    /// Completions form (`{"type": "function", "function": {"name", "description",
    /// "parameters": JSON schema}}`). Empty: no tools.
    fn definitions(&self, child: &ChildHandle) -> Vec<Value>;

    /// Runs tool `name` with `arguments` (the model's arguments, parsed JSON)
    /// for `child`; the output, or an error text, goes back to the model as
    /// the tool result.
    fn execute(&self, child: &ChildHandle, name: &str, arguments: &Value)
    -> Result<String, String>;
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
    ) -> Result<String, String> {
        Err(format!("unknown tool `{name}`"))
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
