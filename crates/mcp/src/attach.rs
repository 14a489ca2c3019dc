//! What goes out with a tool result beyond its own answer: background
//! results delivered since the last call (`delivered`) and approval
//! requests waiting for the host's user (`approval_required`): under that
//! key in the structured content, and as a text block for hosts that read
//! only text.

use rmcp::model::{CallToolResult, ContentBlock};
use serde_json::{Map, Value};

/// The text before delivered background results.
pub(crate) const DELIVERED: &str =
    "Background delegations finished since the last call (delivered once):";

/// The text before pending approval requests.
pub(crate) const APPROVAL_REQUIRED: &str = "Subagents are waiting for the user's approval of a \
     risky call. Ask the user, then call decide_approval (approval_id, approve, always, reason):";

/// Attaches `values` to `result` under `key` (nothing when empty).
pub(crate) fn attach(result: &mut CallToolResult, key: &str, intro: &str, values: Vec<Value>) {
    if values.is_empty() {
        return;
    }
    let text = serde_json::to_string_pretty(&values).unwrap_or_default();
    result.content.push(ContentBlock::text(format!("{intro}\n{text}")));
    match &mut result.structured_content {
        Some(Value::Object(map)) => {
            map.insert(key.to_owned(), Value::Array(values));
        }
        other => {
            let previous = other.take();
            let mut map = Map::new();
            if let Some(previous) = previous {
                map.insert("result".to_owned(), previous);
            }
            map.insert(key.to_owned(), Value::Array(values));
            *other = Some(Value::Object(map));
        }
    }
}
