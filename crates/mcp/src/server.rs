//! The MCP server: [`RetinueServer`] implements rmcp's `ServerHandler` over
//! the typed delegate core and the scoped registry tools. Every tool body is
//! blocking (SQLite, child runs), so it runs on tokio's blocking pool and the
//! protocol task stays free for other requests, progress and cancellation.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use retinue_delegate::{CancelToken, DelegateRequest, ParentContext};
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListToolsResult, PaginatedRequestParams, ProgressNotificationParam, ProgressToken,
    ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as McpError, RoleServer, ServerHandler};
use serde_json::{Map, Value};

use crate::McpParts;
use crate::tools::{self, Scoped, ToolError, ToolSpec};

/// Tunables of a running server.
#[derive(Debug, Clone, PartialEq)]
pub struct ServerOptions {
    /// How often a running `delegate_task` reports progress (when the client
    /// sent a progress token).
    pub progress_interval: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions { progress_interval: Duration::from_secs(5) }
    }
}

struct Shared {
    parts: McpParts,
    session: String,
    project: Option<String>,
    options: ServerOptions,
    specs: Vec<ToolSpec>,
    /// The cancel tokens of the running `delegate_task` calls, so a server
    /// that stops cancels its children instead of waiting for them.
    running: Mutex<HashMap<u64, CancelToken>>,
    next_call: AtomicU64,
}

/// The MCP server acting as one parent session. Cheap to clone (the HTTP
/// transport makes one per client session; all act as the same parent).
#[derive(Clone)]
pub struct RetinueServer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for RetinueServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetinueServer")
            .field("session", &self.shared.session)
            .finish_non_exhaustive()
    }
}

/// Removes a running call's token when the call ends, however it ends.
struct RunningGuard<'a> {
    shared: &'a Shared,
    key: u64,
}

impl Drop for RunningGuard<'_> {
    fn drop(&mut self) {
        self.shared.running.lock().unwrap_or_else(PoisonError::into_inner).remove(&self.key);
    }
}

fn text_result(value: &Value) -> CallToolResult {
    let text = serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string());
    let mut result = CallToolResult::success(vec![ContentBlock::text(text)]);
    result.structured_content = Some(value.clone());
    result
}

fn error_result(message: &str) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(message.to_owned())])
}

/// A `delegate_task` error: its text (hermes's wire text) for the model,
/// and `{"error", "code"}` with the error's kind for the host to branch on.
fn delegate_error_result(e: &retinue_delegate::DelegateError) -> CallToolResult {
    let mut result = error_result(&e.to_string());
    result.structured_content =
        Some(serde_json::json!({ "error": e.to_string(), "code": e.kind().as_str() }));
    result
}

impl RetinueServer {
    /// A server acting as parent session `session` (see
    /// [`crate::resolve_session`]); `project` is the directory it belongs to,
    /// if any, for the instructions.
    pub fn new(
        parts: McpParts,
        session: impl Into<String>,
        project: Option<String>,
        options: ServerOptions,
    ) -> RetinueServer {
        let schema = match &parts.delegator {
            Ok(d) => d.schema(),
            Err(_) => retinue_delegate::delegate_task_schema(&Default::default()),
        };
        let specs = tools::tool_specs(&schema);
        RetinueServer {
            shared: Arc::new(Shared {
                parts,
                session: session.into(),
                project,
                options,
                specs,
                running: Mutex::new(HashMap::new()),
                next_call: AtomicU64::new(0),
            }),
        }
    }

    /// The parent session this server acts as.
    pub fn session_id(&self) -> &str {
        &self.shared.session
    }

    /// The instructions sent to the client at initialization.
    pub fn instructions(&self) -> String {
        let s = &self.shared;
        let whose = match &s.project {
            Some(dir) => format!("the project session of {dir}"),
            None => "a named session".to_owned(),
        };
        format!(
            "Retinue: durable, retained subagents. This server acts as parent session `{}` \
             ({whose}); the session outlives the server, so subagents delegated today can be \
             followed up tomorrow, after a restart. Use delegate_task to hand work to \
             subagents; keep the subagent_id it returns. To ask that same subagent again \
             (it keeps its whole context), call delegate_task with follow_up=<subagent_id> and \
             goal=<your message>. list_subagents shows which subagents this session can still \
             address, show_subagent one subagent's status and last answer, subagent_usage what \
             they cost, tombstone_subagent retires one. Only this session's own subagents can \
             be addressed.",
            s.session
        )
    }

    /// Cancels every running `delegate_task` call (their children stop and
    /// report what they did). The transports call it when they stop.
    pub fn cancel_running(&self) {
        let running = self.shared.running.lock().unwrap_or_else(PoisonError::into_inner);
        for token in running.values() {
            token.cancel();
        }
    }

    /// Waits for background delegations started by this server.
    pub fn wait_background(&self) {
        if let Ok(d) = &self.shared.parts.delegator {
            d.wait_background();
        }
    }

    async fn registry_tool(&self, name: &str, args: Map<String, Value>) -> CallToolResult {
        let shared = self.shared.clone();
        let name = name.to_owned();
        let joined = tokio::task::spawn_blocking(move || {
            let scoped = Scoped { parts: &shared.parts, session: &shared.session };
            match name.as_str() {
                tools::LIST_SUBAGENTS => scoped.list(),
                tools::SHOW_SUBAGENT => scoped.show(&args),
                tools::TOMBSTONE_SUBAGENT => scoped.tombstone(&args),
                tools::SUBAGENT_USAGE => scoped.usage(),
                other => Err(ToolError(format!("unknown tool '{other}'"))),
            }
        })
        .await;
        match joined {
            Ok(Ok(value)) => text_result(&value),
            Ok(Err(e)) => error_result(&e.0),
            Err(e) => {
                log::error!("a tool call failed: {e}");
                error_result("internal error: the tool call did not finish")
            }
        }
    }

    async fn delegate_task(
        &self,
        args: Map<String, Value>,
        progress: Option<ProgressToken>,
        context: &RequestContext<RoleServer>,
    ) -> CallToolResult {
        let delegator = match &self.shared.parts.delegator {
            Ok(d) => d.clone(),
            Err(why) => return error_result(&why.to_string()),
        };
        let request = match DelegateRequest::from_json(&Value::Object(args)) {
            Ok(r) => r,
            Err(e) => return delegate_error_result(&e),
        };
        let children = match &request {
            DelegateRequest::Spawn(s) => s.tasks.len(),
            DelegateRequest::FollowUp(_) => 1,
        };
        let parent = ParentContext {
            session_id: Some(self.shared.session.clone()),
            toolsets: self.shared.parts.toolsets.clone(),
            workspace: self.shared.parts.workspace.clone(),
            ..ParentContext::default()
        };
        let cancel = CancelToken::new();
        let key = self.shared.next_call.fetch_add(1, Ordering::Relaxed);
        self.shared
            .running
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key, cancel.clone());
        let _guard = RunningGuard { shared: &self.shared, key };

        let run = {
            let cancel = cancel.clone();
            tokio::task::spawn_blocking(move || delegator.delegate(&request, &parent, &cancel))
        };
        tokio::pin!(run);
        let started = Instant::now();
        let mut ticker = tokio::time::interval(self.shared.options.progress_interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut step = 0u32;
        let mut cancelled = false;
        let joined = loop {
            tokio::select! {
                joined = &mut run => break joined,
                () = context.ct.cancelled(), if !cancelled => {
                    log::info!("delegate_task cancelled by the client; stopping its children");
                    cancel.cancel();
                    cancelled = true;
                }
                _ = ticker.tick() => {
                    let Some(token) = &progress else { continue };
                    let message = if step == 0 {
                        format!("{children} subagent(s) started")
                    } else {
                        format!(
                            "{children} subagent(s) working, {} s elapsed",
                            started.elapsed().as_secs()
                        )
                    };
                    let note = ProgressNotificationParam::new(token.clone(), f64::from(step))
                        .with_message(message);
                    if let Err(e) = context.peer.notify_progress(note).await {
                        log::debug!("progress notification not sent: {e}");
                    }
                    step += 1;
                }
            }
        };
        match joined {
            Ok(Ok(outcome)) => {
                let mut result = text_result(&outcome.to_json());
                // The ledger could not be written: the results stand, but
                // the call failed (its spend is kept in the budget).
                if outcome.ledger_error().is_some() {
                    result.is_error = Some(true);
                }
                result
            }
            Ok(Err(e)) => delegate_error_result(&e),
            Err(e) => {
                log::error!("delegate_task failed: {e}");
                error_result("internal error: the delegation did not finish")
            }
        }
    }
}

impl ServerHandler for RetinueServer {
    fn get_info(&self) -> ServerConfig {
        let mut implementation = Implementation::new("retinue", env!("CARGO_PKG_VERSION"));
        implementation.title = Some("Retinue: retained subagents".to_owned());
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(implementation)
            .with_instructions(self.instructions())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        let tools = self
            .shared
            .specs
            .iter()
            .map(|s| Tool::new(s.name, s.description.clone(), Arc::new(s.input_schema.clone())))
            .collect();
        Ok(ListToolsResult::with_all_items(tools))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        self.shared
            .specs
            .iter()
            .find(|s| s.name == name)
            .map(|s| Tool::new(s.name, s.description.clone(), Arc::new(s.input_schema.clone())))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        let progress = request
            .meta
            .as_ref()
            .and_then(|m| m.get_progress_token())
            .or_else(|| context.meta.get_progress_token());
        let args = request.arguments.unwrap_or_default();
        let name = request.name.as_ref();
        let result = match name {
            tools::DELEGATE_TASK => self.delegate_task(args, progress, &context).await,
            tools::LIST_SUBAGENTS
            | tools::SHOW_SUBAGENT
            | tools::TOMBSTONE_SUBAGENT
            | tools::SUBAGENT_USAGE => self.registry_tool(name, args).await,
            other => {
                return Err(McpError::invalid_params(format!("unknown tool '{other}'"), None));
            }
        };
        Ok(result.into())
    }
}
