//! The MCP server: [`RetinueServer`] implements rmcp's `ServerHandler` over
//! the typed delegate core and the scoped registry tools. Every tool body is
//! blocking (SQLite, child runs), so it runs on tokio's blocking pool and the
//! protocol task stays free for other requests, progress and cancellation.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use retinue_delegate::{
    CancelToken, Collector, DelegateOutcome, DelegateRequest, Delegator, ParentContext,
};
#[expect(deprecated)]
// LoggingLevel, LoggingMessageNotificationParam: see `announce_when_done`
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, CancelTaskParams, ContentBlock,
    CreateTaskResult, Implementation, ListToolsResult, LoggingLevel,
    LoggingMessageNotificationParam, PaginatedRequestParams, ProgressNotificationParam,
    ProgressToken, ServerCapabilities, ServerConfig, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData as RpcError, Peer, RoleServer, ServerHandler};
use serde_json::{Map, Value};

use crate::McpParts;
use crate::tools::{self, Scoped, ToolError, ToolSpec, text_result};

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
    /// Background units: look up, wait, steer, cancel, the inbox.
    collector: Collector,
    /// The cancel tokens of background units this server started: a server
    /// that stops stops them (they end `interrupted`, their results wait in
    /// the registry), instead of outliving its host.
    background: Mutex<HashMap<String, CancelToken>>,
    /// The least severe `notifications/message` the client wants
    /// (`logging/setLevel`; [`level_rank`]): everything until it says.
    log_level: std::sync::atomic::AtomicU8,
    /// Asks the host's user about approval requests (elicitation).
    prompter: Option<Arc<crate::approvals::McpPrompter>>,
}

/// The severity rank of a logging level (debug 0 … emergency 7).
#[expect(deprecated)] // logging: see `announce_when_done`
fn level_rank(level: LoggingLevel) -> u8 {
    match level {
        LoggingLevel::Debug => 0,
        LoggingLevel::Info => 1,
        LoggingLevel::Notice => 2,
        LoggingLevel::Warning => 3,
        LoggingLevel::Error => 4,
        LoggingLevel::Critical => 5,
        LoggingLevel::Alert => 6,
        LoggingLevel::Emergency => 7,
    }
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
        let collector = parts.delegator.as_ref().map_or_else(
            |_| Collector::new(parts.backend.clone(), parts.authority.clone(), &parts.profile),
            Delegator::collector, // with its worktrees (change sets)
        );
        let prompter = parts.delegator.as_ref().ok().map(|d| {
            let p = Arc::new(crate::approvals::McpPrompter::default());
            d.set_approval_prompter(p.clone());
            p
        });
        RetinueServer {
            shared: Arc::new(Shared {
                parts,
                session: session.into(),
                project,
                options,
                specs,
                running: Mutex::new(HashMap::new()),
                next_call: AtomicU64::new(0),
                collector,
                background: Mutex::new(HashMap::new()),
                log_level: std::sync::atomic::AtomicU8::new(0),
                prompter,
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
             they cost, tombstone_subagent retires one. For long work pass background=true: \
             delegate_task returns the ids at once and the subagents keep working; collect \
             their results with wait_subagents (each result is delivered once, or attached to \
             a later tool result), and reach a running one with steer_subagent or \
             cancel_subagent. Only this session's own subagents can be addressed.",
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
        let background = self.shared.background.lock().unwrap_or_else(PoisonError::into_inner);
        for token in background.values() {
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

    /// The parent every call acts as: this server's session, which can
    /// receive detached (background) results.
    fn parent(&self) -> ParentContext {
        ParentContext {
            session_id: Some(self.shared.session.clone()),
            toolsets: self.shared.parts.toolsets.clone(),
            workspace: self.shared.parts.workspace.clone(),
            can_receive_detached: true,
            ..ParentContext::default()
        }
    }

    /// `delegate_task`. `as_task`: the client asked for an MCP task, so a
    /// spawn runs in the background and the call returns its handle (the
    /// task id is the delegation id; its state lives in the registry).
    async fn delegate_task(
        &self,
        args: Map<String, Value>,
        progress: Option<ProgressToken>,
        context: &RequestContext<RoleServer>,
        as_task: bool,
    ) -> CallToolResponse {
        let delegator = match &self.shared.parts.delegator {
            Ok(d) => d.clone(),
            Err(why) => return error_result(&why.to_string()).into(),
        };
        if let Some(why) = &self.shared.parts.workspace_refused
            && wants_workspace(&args)
        {
            return error_result(&format!(
                "{why}. The file and terminal toolsets (read, file, terminal) need a project \
                 directory: start `retinue mcp` with the host's `cwd` set to the project, or pass \
                 `--workspace DIR`; toolsets without a workspace (mcp-*) still work when named \
                 in `toolsets`"
            ))
            .into();
        }
        let request = match DelegateRequest::from_json(&Value::Object(args)) {
            Ok(r) => r,
            Err(e) => return delegate_error_result(&e).into(),
        };
        let children = match &request {
            DelegateRequest::Spawn(s) => s.tasks.len(),
            DelegateRequest::FollowUp(_) => 1,
        };
        let mut request = request;
        if as_task {
            match &mut request {
                DelegateRequest::Spawn(spawn) => spawn.background = true,
                DelegateRequest::FollowUp(_) => {}
            }
        }
        // The host's trace, from the request's `_meta.traceparent` (SEP-414).
        let trace_parent = context.meta.get_traceparent().map(str::to_owned);
        let parent = ParentContext { trace_parent, ..self.parent() };
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
            Ok(Ok(DelegateOutcome::Dispatched(d))) => {
                // Forgotten when the unit finishes (`announce_when_done`).
                self.shared
                    .background
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(d.delegation_id.clone(), cancel.clone());
                self.announce_when_done(&d.delegation_id, context.peer.clone());
                if as_task {
                    let view =
                        Collector::unit(&self.shared.collector, &d.delegation_id, &self.parent());
                    let task = match view {
                        Ok(v) => crate::tasks::detailed(&v).task,
                        Err(_) => crate::tasks::working(&d.delegation_id),
                    };
                    return CallToolResponse::Task(CreateTaskResult::new(task));
                }
                text_result(&DelegateOutcome::Dispatched(d).to_json()).into()
            }
            Ok(Ok(outcome)) => {
                let mut result = text_result(&outcome.to_json());
                // The ledger could not be written: the results stand, but
                // the call failed (its spend is kept in the budget).
                if outcome.ledger_error().is_some() {
                    result.is_error = Some(true);
                }
                result.into()
            }
            Ok(Err(e)) => delegate_error_result(&e).into(),
            Err(e) => {
                log::error!("delegate_task failed: {e}");
                error_result("internal error: the delegation did not finish").into()
            }
        }
    }

    /// Sends a `notifications/message` to the client when the background
    /// unit `id` finishes (its result waits for `wait_subagents` or the next
    /// tool result). Stops with the server's connection.
    ///
    /// `notifications/message` is deprecated by SEP-2577, but it is what
    /// today's hosts show (the Python SDK's logging callback, Claude Code's
    /// log): kept until hosts read task status notifications.
    #[expect(deprecated)]
    fn announce_when_done(&self, id: &str, peer: Peer<RoleServer>) {
        let (collector, parent, id) = (self.shared.collector.clone(), self.parent(), id.to_owned());
        let shared = self.shared.clone();
        let poll = Duration::from_millis(retinue_core::CONTROL_POLL_MS * 5);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(poll).await;
                let (c, p, i) = (collector.clone(), parent.clone(), id.clone());
                let view = tokio::task::spawn_blocking(move || c.unit(&i, &p)).await;
                let Ok(Ok(view)) = view else { return };
                if !view.is_finished() {
                    continue;
                }
                shared.background.lock().unwrap_or_else(PoisonError::into_inner).remove(&id);
                let data = serde_json::json!({
                    "type": "subagent_finished",
                    "delegation_id": view.delegation_id,
                    "state": view.state.as_str(),
                    "note": "Collect the result with wait_subagents; otherwise it is attached \
                             to this session's next tool result.",
                });
                if level_rank(LoggingLevel::Notice) < shared.log_level.load(Ordering::Relaxed) {
                    // Below the level the client set: not sent.
                    return;
                }
                let mut note = LoggingMessageNotificationParam::new(LoggingLevel::Notice, data);
                note.logger = Some("retinue".to_owned());
                if let Err(e) = peer.notify_logging_message(note).await {
                    log::debug!("completion notification not sent: {e}");
                }
                return;
            }
        });
    }

    /// `wait_subagents`, `steer_subagent`, `cancel_subagent`: blocking
    /// registry work on tokio's blocking pool; a client cancel stops a wait.
    async fn background_tool(
        &self,
        name: &str,
        args: Map<String, Value>,
        context: &RequestContext<RoleServer>,
    ) -> CallToolResult {
        let (collector, parent, name) =
            (self.shared.collector.clone(), self.parent(), name.to_owned());
        let cancel = CancelToken::new();
        let stop = cancel.clone();
        let ct = context.ct.clone();
        let watcher = tokio::spawn(async move {
            ct.cancelled().await;
            stop.cancel();
        });
        let joined = tokio::task::spawn_blocking(move || {
            crate::tasks::run_tool(&collector, &parent, &name, &args, &cancel)
        })
        .await;
        watcher.abort();
        match joined {
            Ok(Ok(value)) => text_result(&value),
            Ok(Err((message, value))) => {
                let mut result = error_result(&message);
                result.structured_content = Some(value);
                result
            }
            Err(e) => {
                log::error!("a tool call failed: {e}");
                error_result("internal error: the tool call did not finish")
            }
        }
    }

    /// Background results of this session not delivered yet, claimed now
    /// (not acknowledged: see [`RetinueServer::ack_inbox`]).
    async fn claim_inbox(&self) -> Vec<(retinue_delegate::WaitEntry, String)> {
        let (collector, parent) = (self.shared.collector.clone(), self.parent());
        tokio::task::spawn_blocking(move || collector.claim_inbox(&parent))
            .await
            .unwrap_or_default()
    }

    /// Acknowledges claimed results as the answer that carries them goes
    /// out; a cancelled call's claims are left to lapse (redelivered later).
    async fn ack_inbox(
        &self,
        claimed: Vec<(retinue_delegate::WaitEntry, String)>,
        cancelled: bool,
    ) -> Vec<Value> {
        if claimed.is_empty() || cancelled {
            return Vec::new();
        }
        let collector = self.shared.collector.clone();
        tokio::task::spawn_blocking(move || {
            let now = retinue_core::Clock::now(&retinue_core::SystemClock);
            collector.ack_inbox(claimed).iter().map(|e| e.to_json(now)).collect()
        })
        .await
        .unwrap_or_default()
    }
}

impl ServerHandler for RetinueServer {
    #[expect(deprecated)] // logging: see `announce_when_done`
    fn get_info(&self) -> ServerConfig {
        let mut implementation = Implementation::new("retinue", env!("CARGO_PKG_VERSION"));
        implementation.title = Some("Retinue: retained subagents".to_owned());
        ServerConfig::new(
            ServerCapabilities::builder().enable_logging().enable_tools().enable_tasks().build(),
        )
        .with_server_info(implementation)
        .with_instructions(self.instructions())
    }

    /// `logging/setLevel`: the capability is declared, so it is answered;
    /// the level filters the `notifications/message` this server sends.
    #[expect(deprecated)] // logging: see `announce_when_done`
    async fn set_level(
        &self,
        request: rmcp::model::SetLevelRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<(), RpcError> {
        self.shared.log_level.store(level_rank(request.level), Ordering::Relaxed);
        Ok(())
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, RpcError> {
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
    ) -> Result<CallToolResponse, RpcError> {
        let progress = request
            .meta
            .as_ref()
            .and_then(|m| m.get_progress_token())
            .or_else(|| context.meta.get_progress_token());
        let args = request.arguments.unwrap_or_default();
        let name = request.name.as_ref();
        if !self.shared.specs.iter().any(|s| s.name == name) {
            return Err(RpcError::invalid_params(format!("unknown tool '{name}'"), None));
        }
        if let Some(p) = &self.shared.prompter {
            p.set_peer(context.peer.clone());
        }
        // What finished since the last call goes out with this one — after
        // a wait (which delivers its own ids itself), before anything else
        // (so a unit this very call dispatches is never in it).
        let as_task = name == tools::DELEGATE_TASK
            && context.client_capabilities().is_some_and(|c| c.supports_tasks());
        // (A task handle carries no content, so nothing is taken for it.)
        let early = if name == tools::WAIT_SUBAGENTS || as_task {
            Vec::new()
        } else {
            self.claim_inbox().await
        };
        let response = match name {
            tools::DELEGATE_TASK => self.delegate_task(args, progress, &context, as_task).await,
            n if tools::BLOCKING.contains(&n) => {
                self.background_tool(name, args, &context).await.into()
            }
            _ => self.registry_tool(name, args).await.into(),
        };
        let late =
            if name == tools::WAIT_SUBAGENTS { self.claim_inbox().await } else { Vec::new() };
        let cancelled = context.ct.is_cancelled();
        Ok(match response {
            CallToolResponse::Complete(mut result) => {
                let delivered = self.ack_inbox([early, late].concat(), cancelled).await;
                crate::attach::attach(
                    &mut result,
                    "delivered",
                    crate::attach::DELIVERED,
                    delivered,
                );
                if !matches!(name, tools::LIST_APPROVALS | tools::WAIT_SUBAGENTS) {
                    let pending =
                        crate::approvals::pending(&self.shared.collector, self.parent()).await;
                    let intro = crate::attach::APPROVAL_REQUIRED;
                    crate::attach::attach(&mut result, "approval_required", intro, pending);
                }
                CallToolResponse::Complete(result)
            }
            other => other,
        })
    }

    async fn get_task(
        &self,
        request: rmcp::model::GetTaskParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<rmcp::model::GetTaskResult, RpcError> {
        let (collector, parent) = (self.shared.collector.clone(), self.parent());
        tokio::task::spawn_blocking(move || {
            crate::tasks::get(&collector, &parent, &request.task_id)
        })
        .await
        .map_err(|e| RpcError::internal_error(format!("tasks/get did not finish: {e}"), None))?
    }

    /// `tasks/update` (the tasks capability implies it): Retinue's tasks never
    /// ask for input, so there is nothing to answer — a clear error naming
    /// the task, never "method not found".
    async fn update_task(
        &self,
        request: rmcp::model::UpdateTaskParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<(), RpcError> {
        Err(RpcError::invalid_params(
            format!(
                "task {} is not waiting for input: Retinue's tasks never ask for it",
                request.task_id
            ),
            None,
        ))
    }

    async fn cancel_task(
        &self,
        request: CancelTaskParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<(), RpcError> {
        let (collector, parent) = (self.shared.collector.clone(), self.parent());
        tokio::task::spawn_blocking(move || {
            crate::tasks::cancel(&collector, &parent, &request.task_id)
        })
        .await
        .map_err(|e| RpcError::internal_error(format!("tasks/cancel did not finish: {e}"), None))?
    }
}

/// Whether a `delegate_task` call would give a child a workspace-bound
/// toolset: one that names none (the default is `read`), or names `read`,
/// `file` or `terminal` (at the top or in any task).
fn wants_workspace(args: &Map<String, Value>) -> bool {
    let bound =
        |v: Option<&Value>| match v {
            None | Some(Value::Null) => None,
            Some(Value::Array(items)) => Some(items.iter().any(|t| {
                t.as_str().is_some_and(|t| matches!(t.trim(), "read" | "file" | "terminal"))
            })),
            Some(_) => Some(true),
        };
    if args.get("follow_up").is_some_and(|v| !v.is_null()) {
        // A follow-up runs with the child's recorded toolsets.
        return false;
    }
    let top = bound(args.get("toolsets"));
    let tasks: Vec<Option<bool>> = match args.get("tasks") {
        Some(Value::Array(tasks)) => tasks.iter().map(|t| bound(t.get("toolsets"))).collect(),
        _ => Vec::new(),
    };
    if tasks.is_empty() {
        return top.unwrap_or(true);
    }
    tasks.iter().any(|t| t.or(top).unwrap_or(true))
}
