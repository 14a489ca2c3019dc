//! The embedder's tools: the seam is `retinue_core::run::ToolExecutor`.

use serde_json::Value;

/// The function names of `definitions`.
pub(crate) fn tool_names(definitions: &[Value]) -> Vec<String> {
    definitions
        .iter()
        .filter_map(|d| d["function"]["name"].as_str().or_else(|| d["name"].as_str()))
        .map(str::to_owned)
        .collect()
}
