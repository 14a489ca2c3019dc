//! `retinue-fake-mcp`: a small MCP server on stdio (rmcp) for the tools
//! tests. Tools: `echo` (returns its `text`), `add` (sums `a` and `b`),
//! `fail` (an `isError` result), `crash` (the process exits mid-call),
//! `big` (`mb` megabytes of text) and `wipe` (annotated `destructiveHint:
//! true`; returns `wiped`).

use std::sync::Arc;

use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListToolsResult,
    PaginatedRequestParams, ServerCapabilities, ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt};
use serde_json::{Value, json};

struct Fake;

fn schema(v: Value) -> Arc<serde_json::Map<String, Value>> {
    Arc::new(v.as_object().cloned().unwrap_or_default())
}

fn tools() -> Vec<Tool> {
    vec![
        Tool::new(
            "echo",
            "Echo the text back",
            schema(
                json!({"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}),
            ),
        ),
        Tool::new(
            "add",
            "Add two numbers",
            schema(
                json!({"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}),
            ),
        ),
        Tool::new("fail", "Always fails", schema(json!({"type": "object"}))),
        Tool::new("crash", "Exits the server mid-call", schema(json!({"type": "object"}))),
        Tool::new(
            "big",
            "Returns `mb` megabytes of text",
            schema(json!({"type": "object", "properties": {"mb": {"type": "number"}}})),
        ),
        Tool::new("wipe", "Deletes everything (pretend)", schema(json!({"type": "object"})))
            .annotate(ToolAnnotations::default().destructive(true)),
    ]
}

impl ServerHandler for Fake {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(tools()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let args = request.arguments.unwrap_or_default();
        let result = match request.name.as_ref() {
            "echo" => CallToolResult::success(vec![ContentBlock::text(
                args.get("text").and_then(Value::as_str).unwrap_or_default().to_owned(),
            )]),
            "add" => {
                let n = |k: &str| args.get(k).and_then(Value::as_f64).unwrap_or(0.0);
                CallToolResult::success(vec![ContentBlock::text((n("a") + n("b")).to_string())])
            }
            "fail" => {
                CallToolResult::error(vec![ContentBlock::text("the fake tool failed".to_owned())])
            }
            "crash" => std::process::exit(3),
            "wipe" => CallToolResult::success(vec![ContentBlock::text("wiped".to_owned())]),
            "big" => {
                let mb = args.get("mb").and_then(Value::as_f64).unwrap_or(1.0).clamp(0.0, 100.0);
                let n = (mb * 1_000_000.0) as usize;
                CallToolResult::success(vec![ContentBlock::text("x".repeat(n))])
            }
            other => return Err(ErrorData::invalid_params(format!("no tool {other}"), None)),
        };
        Ok(CallToolResponse::Complete(result))
    }
}

fn main() {
    let Ok(rt) = tokio::runtime::Builder::new_current_thread().enable_all().build() else {
        std::process::exit(1);
    };
    rt.block_on(async {
        let Ok(running) = Fake.serve((tokio::io::stdin(), tokio::io::stdout())).await else {
            std::process::exit(1);
        };
        let _ = running.waiting().await;
    });
}
