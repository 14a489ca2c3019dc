//! MCP servers as toolsets (`mcp-<server>`), configured in hermes's
//! `mcp_servers:` format and reached through rmcp's client (stdio child
//! processes and streamable HTTP). Each server is started lazily, at most
//! one connection per server per process, shared by concurrent children.
//! A server that cannot start or that dies leaves its tools unavailable:
//! a call gets a tool result saying so, never a failed delegation. The
//! tokio runtime stays inside this module.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use rmcp_client::model::{CallToolRequestParams, Tool};
use rmcp_client::service::RunningService;
use rmcp_client::{RoleClient, ServiceExt};
use serde_json::{Value, json};

use retinue_config::McpServerConfig;
use retinue_core::run::ToolError;

/// The prefix of an MCP tool's name (`mcp__<server>__<tool>`).
pub const TOOL_PREFIX: &str = "mcp__";
/// The longest function name providers accept.
const MAX_NAME: usize = 64;
/// How long a server gets to start and list its tools.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a failed server stays failed before a call tries it again.
const RETRY_AFTER: Duration = Duration::from_secs(30);
/// The most characters one MCP result keeps.
const MAX_RESULT_CHARS: usize = 100_000;
/// The only variables a stdio server inherits (plus its own `env`).
const PASSED_ENV: &[&str] = &["PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "USER"];

/// `[A-Za-z0-9_]` only (hermes's and Claude Code's convention).
pub fn sanitize(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).collect()
}

/// A connected client.
type Client = Arc<RunningService<RoleClient, ()>>;

enum State {
    NotStarted,
    Running { service: Client, tools: Vec<Tool> },
    Failed { why: String, at: Instant },
}

struct Server {
    config: McpServerConfig,
    state: Mutex<State>,
}

/// The configured MCP servers of one process.
pub struct McpServers {
    runtime: Option<tokio::runtime::Runtime>,
    servers: Vec<Server>,
}

impl std::fmt::Debug for McpServers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpServers")
            .field("servers", &self.servers.iter().map(|s| &s.config.name).collect::<Vec<_>>())
            .finish()
    }
}

impl McpServers {
    /// The servers of `configs` (none is started yet).
    pub fn new(configs: Vec<McpServerConfig>) -> McpServers {
        let runtime = if configs.is_empty() {
            None
        } else {
            // reqwest's rustls needs a process-wide provider (ring, as ureq's).
            let _ = rustls::crypto::ring::default_provider().install_default();
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("retinue-mcp-client")
                .enable_all()
                .build()
                .map_err(|e| log::warn!("MCP servers disabled: no async runtime ({e})"))
                .ok()
        };
        McpServers {
            runtime,
            servers: configs
                .into_iter()
                .map(|config| Server { config, state: Mutex::new(State::NotStarted) })
                .collect(),
        }
    }

    /// The toolset names (`mcp-<server>`), one per configured server.
    pub fn toolsets(&self) -> Vec<String> {
        self.servers.iter().map(|s| format!("mcp-{}", s.config.name)).collect()
    }

    fn server(&self, toolset: &str) -> Option<&Server> {
        let name = toolset.strip_prefix("mcp-")?;
        self.servers.iter().find(|s| s.config.name == name)
    }

    /// Starts the server if needed; its tools, or why it is unavailable.
    fn ensure(&self, server: &Server) -> Result<(Client, Vec<Tool>), String> {
        let Some(rt) = &self.runtime else { return Err("no async runtime".to_owned()) };
        let mut state = server.state.lock().unwrap_or_else(PoisonError::into_inner);
        match &*state {
            State::Running { service, tools } if !service.is_closed() => {
                return Ok((Arc::clone(service), tools.clone()));
            }
            State::Running { .. } => {
                *state = State::Failed { why: "the server stopped".to_owned(), at: Instant::now() };
                return Err("the server stopped".to_owned());
            }
            State::Failed { why, at } if at.elapsed() < RETRY_AFTER => return Err(why.clone()),
            _ => {}
        }
        let started = rt.block_on(async {
            tokio::time::timeout(START_TIMEOUT, start(&server.config)).await.unwrap_or_else(|_| {
                Err(format!("did not start within {} s", START_TIMEOUT.as_secs()))
            })
        });
        match started {
            Ok((service, tools)) => {
                let tools: Vec<Tool> = tools
                    .into_iter()
                    .filter(|t| {
                        let n = t.name.as_ref();
                        server.config.include.as_ref().is_none_or(|inc| inc.iter().any(|i| i == n))
                            && !server.config.exclude.iter().any(|e| e == n)
                    })
                    .collect();
                let service = Arc::new(service);
                *state = State::Running { service: Arc::clone(&service), tools: tools.clone() };
                Ok((service, tools))
            }
            Err(why) => {
                log::warn!("MCP server `{}` is unavailable: {why}", server.config.name);
                *state = State::Failed { why: why.clone(), at: Instant::now() };
                Err(why)
            }
        }
    }

    /// The tool definitions of the servers named by `toolsets`, at most
    /// [`MAX_TOOLS`] of them and [`MAX_SCHEMA_BYTES`] of JSON in all (every
    /// model call carries them): the rest are left out, with a warning
    /// naming them.
    pub fn definitions(&self, toolsets: &[String]) -> Vec<Value> {
        let all = self.all_definitions(toolsets);
        let (kept, dropped) = cap_definitions(all);
        if !dropped.is_empty() {
            let shown: Vec<&str> = dropped.iter().take(20).map(String::as_str).collect();
            let more = dropped.len().saturating_sub(shown.len());
            log::warn!(
                "{} MCP tool(s) left out for this child: the list is capped at {MAX_TOOLS} tools \
                 and {MAX_SCHEMA_BYTES} bytes of schema; dropped: {}{}",
                dropped.len(),
                shown.join(", "),
                if more > 0 { format!(" (and {more} more)") } else { String::new() }
            );
        }
        kept
    }

    fn all_definitions(&self, toolsets: &[String]) -> Vec<Value> {
        let mut out = Vec::new();
        let mut seen = std::collections::HashSet::new();
        for t in toolsets {
            let Some(server) = self.server(t) else { continue };
            let Ok((_, tools)) = self.ensure(server) else { continue };
            let prefix = format!("{TOOL_PREFIX}{}__", sanitize(&server.config.name));
            for tool in tools {
                let name = format!("{prefix}{}", sanitize(&tool.name));
                // Providers refuse a request whose tool names repeat or run
                // past 64 characters: such a tool is left out (the first of
                // a clash is kept, and a call finds it the same way).
                if name.len() > MAX_NAME || !seen.insert(name.clone()) {
                    log::warn!(
                        "MCP tool `{}` of server `{}` is left out: its name `{name}` is a \
                         duplicate or longer than {MAX_NAME} characters",
                        tool.name,
                        server.config.name
                    );
                    continue;
                }
                out.push(json!({
                    "type": "function",
                    "function": {
                        "name": name,
                        "description": tool.description.as_deref().unwrap_or_default(),
                        "parameters": Value::Object((*tool.input_schema).clone()),
                    }
                }));
            }
        }
        out
    }

    /// Whether `name` is an MCP tool name of one of `toolsets`.
    pub fn owns(&self, toolsets: &[String], name: &str) -> bool {
        name.starts_with(TOOL_PREFIX)
            && toolsets
                .iter()
                .filter_map(|t| self.server(t))
                .any(|s| name.starts_with(&format!("{TOOL_PREFIX}{}__", sanitize(&s.config.name))))
    }

    /// Whether the MCP tool `name` of `toolsets` is annotated
    /// `destructiveHint: true` by its server (an unknown or unavailable
    /// tool is not: its call fails anyway).
    pub fn destructive(&self, toolsets: &[String], name: &str) -> bool {
        toolsets.iter().filter_map(|t| self.server(t)).any(|server| {
            let prefix = format!("{TOOL_PREFIX}{}__", sanitize(&server.config.name));
            let Some(wanted) = name.strip_prefix(&prefix) else { return false };
            self.ensure(server).is_ok_and(|(_, tools)| {
                tools.iter().find(|t| sanitize(&t.name) == wanted).is_some_and(|t| {
                    t.annotations.as_ref().and_then(|a| a.destructive_hint) == Some(true)
                })
            })
        })
    }

    /// Calls `name` (`mcp__<server>__<tool>`) for a child with `toolsets`.
    pub fn call(
        &self,
        toolsets: &[String],
        name: &str,
        arguments: &Value,
    ) -> Result<String, ToolError> {
        // The servers whose prefix the name carries, in the order the
        // definitions were built: the first that has the tool answers.
        let mut unavailable = None;
        let mut found = None;
        for server in toolsets.iter().filter_map(|t| self.server(t)) {
            let prefix = format!("{TOOL_PREFIX}{}__", sanitize(&server.config.name));
            let Some(wanted) = name.strip_prefix(&prefix) else { continue };
            match self.ensure(server) {
                Ok((service, tools)) => {
                    if let Some(tool) = tools.iter().find(|t| sanitize(&t.name) == wanted) {
                        found = Some((server, service, tool.clone()));
                        break;
                    }
                }
                Err(why) => {
                    unavailable.get_or_insert(format!(
                        "the MCP server `{}` is unavailable: {why}",
                        server.config.name
                    ));
                }
            }
        }
        let Some((server, service, tool)) = found else {
            return Err(match unavailable {
                Some(why) => ToolError::Failed(why),
                None => ToolError::Unknown { name: name.to_owned() },
            });
        };
        let server_name = &server.config.name;
        let Some(rt) = &self.runtime else {
            return Err(ToolError::Failed("MCP servers are unavailable".to_owned()));
        };
        let args = arguments.as_object().cloned().unwrap_or_default();
        let params = CallToolRequestParams::new(tool.name.to_string()).with_arguments(args);
        let timeout = Duration::from_secs_f64(server.config.timeout_seconds);
        let result =
            rt.block_on(async { tokio::time::timeout(timeout, service.call_tool(params)).await });
        let result = match result {
            Err(_) => {
                return Err(ToolError::Failed(format!(
                    "the MCP server `{server_name}` did not answer within {} s",
                    timeout.as_secs()
                )));
            }
            Ok(Err(e)) if e.to_string().contains("exceeded the maximum size") => {
                // An HTTP answer over the limit: this call fails, the
                // connection stays (rmcp read no more than the limit).
                return Err(ToolError::Failed(format!(
                    "the MCP server `{server_name}`: too large: over {} MB, limit {} MB",
                    MAX_RESPONSE_BYTES / 1_000_000,
                    MAX_RESPONSE_BYTES / 1_000_000
                )));
            }
            Ok(Err(e)) => {
                let gone = matches!(
                    e,
                    rmcp_client::service::ServiceError::TransportClosed
                        | rmcp_client::service::ServiceError::TransportSend(_)
                );
                if gone || service.is_closed() {
                    // Only this connection is marked dead (another thread
                    // may have restarted the server meanwhile).
                    let mut state = server.state.lock().unwrap_or_else(PoisonError::into_inner);
                    if matches!(&*state, State::Running { service: s, .. } if Arc::ptr_eq(s, &service))
                    {
                        *state =
                            State::Failed { why: format!("it stopped ({e})"), at: Instant::now() };
                    }
                    drop(state);
                    return Err(ToolError::Failed(scrub(
                        &format!("the MCP server `{server_name}` stopped during the call: {e}"),
                        server.config.url.as_deref(),
                    )));
                }
                return Err(ToolError::Failed(scrub(
                    &format!("the MCP server `{server_name}`: {e}"),
                    server.config.url.as_deref(),
                )));
            }
            Ok(Ok(r)) => r,
        };
        let mut parts: Vec<String> = Vec::new();
        for block in &result.content {
            let v = serde_json::to_value(block).unwrap_or(Value::Null);
            match v.get("type").and_then(Value::as_str) {
                Some("text") => parts.push(v["text"].as_str().unwrap_or_default().to_owned()),
                Some(other) => parts.push(format!("[{other} content omitted]")),
                None => {}
            }
        }
        if parts.is_empty()
            && let Some(s) = &result.structured_content
        {
            parts.push(s.to_string());
        }
        let mut text = parts.join("\n");
        if text.chars().count() > MAX_RESULT_CHARS {
            text = text.chars().take(MAX_RESULT_CHARS).collect::<String>()
                + "\n[result cut at 100000 characters]";
        }
        if result.is_error == Some(true) {
            return Err(ToolError::Failed(text));
        }
        Ok(text)
    }
}

impl Drop for McpServers {
    fn drop(&mut self) {
        if let Some(rt) = self.runtime.take() {
            // Never blocks (a drop inside another runtime must not).
            rt.shutdown_background();
        }
    }
}

/// `text` with the server's URL (and each of its query values) masked, as
/// every message shows it.
fn scrub(text: &str, url: Option<&str>) -> String {
    let Some(url) = url.map(str::trim).filter(|u| !u.is_empty()) else { return text.to_owned() };
    let mut out = text.replace(url, &retinue_core::redact_endpoint(url));
    if let Some((_, query)) = url.split_once('?') {
        for v in query.split('&').filter_map(|kv| kv.split_once('=').map(|(_, v)| v)) {
            if v.len() >= 4 {
                out = out.replace(v, "***");
            }
        }
    }
    out
}

/// The most MCP tools offered to one child.
pub const MAX_TOOLS: usize = 128;
/// The most bytes of MCP tool definitions (JSON) offered to one child.
pub const MAX_SCHEMA_BYTES: usize = 512 << 10;

/// `defs` cut to [`MAX_TOOLS`] and [`MAX_SCHEMA_BYTES`], in order (a tool
/// too big to fit is skipped, a smaller later one may still fit); returns
/// the kept ones and the names of the dropped ones.
pub fn cap_definitions(defs: Vec<Value>) -> (Vec<Value>, Vec<String>) {
    let (mut kept, mut dropped, mut bytes) = (Vec::new(), Vec::new(), 0usize);
    for d in defs {
        let size = d.to_string().len();
        if kept.len() < MAX_TOOLS && bytes.saturating_add(size) <= MAX_SCHEMA_BYTES {
            bytes += size;
            kept.push(d);
        } else {
            dropped.push(d["function"]["name"].as_str().unwrap_or("?").to_owned());
        }
    }
    (kept, dropped)
}

/// The largest MCP response read (a JSON body or an SSE event of the
/// streamable HTTP transport; a stdio line, see `stdio`): a larger one
/// fails that call only.
pub const MAX_RESPONSE_BYTES: usize = crate::stdio::MAX_LINE_BYTES;

async fn start(
    config: &McpServerConfig,
) -> Result<(RunningService<RoleClient, ()>, Vec<Tool>), String> {
    start_unscrubbed(config).await.map_err(|e| scrub(&e, config.url.as_deref()))
}

async fn start_unscrubbed(
    config: &McpServerConfig,
) -> Result<(RunningService<RoleClient, ()>, Vec<Tool>), String> {
    let service = if let Some(command) = &config.command {
        let mut cmd = tokio::process::Command::new(command);
        cmd.args(&config.args).env_clear().kill_on_drop(true);
        for key in PASSED_ENV {
            if let Some(v) = std::env::var_os(key) {
                cmd.env(key, v);
            }
        }
        cmd.envs(&config.env);
        if let Some(cwd) = &config.cwd {
            cmd.current_dir(cwd);
        }
        cmd.stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null());
        let child = cmd.spawn().map_err(|e| format!("cannot start `{command}`: {e}"))?;
        // Its messages bounded: an over-long answer fails its call only.
        let transport = crate::stdio::BoundedChildStdio::new(child, crate::stdio::MAX_LINE_BYTES)
            .ok_or_else(|| format!("cannot start `{command}`: no stdio pipes"))?;
        ().serve(transport).await.map_err(|e| format!("initialization failed: {e}"))?
    } else if let Some(url) = &config.url {
        use rmcp_client::transport::StreamableHttpClientTransport;
        use rmcp_client::transport::streamable_http_client::StreamableHttpClientTransportConfig;
        let mut headers = HashMap::new();
        let mut auth = None;
        for (k, v) in &config.headers {
            // A bearer token goes through rmcp's auth header; any other
            // scheme is sent as it is.
            if k.eq_ignore_ascii_case("authorization")
                && let Some(token) = v.strip_prefix("Bearer ")
            {
                auth = Some(token.trim().to_owned());
                continue;
            }
            let name = http::HeaderName::from_bytes(k.as_bytes())
                .map_err(|e| format!("header `{k}`: {e}"))?;
            let value = http::HeaderValue::from_str(v)
                .map_err(|_| format!("header `{k}` has an invalid value"))?;
            headers.insert(name, value);
        }
        // Userinfo in the URL is never sent (it would go as Basic auth):
        // credentials belong in `headers`.
        let (url, had_userinfo) = retinue_core::strip_userinfo(url);
        if had_userinfo {
            log::warn!(
                "MCP server `{}`: the credentials in its URL {} are not sent; put them in \
                 `headers` (e.g. Authorization)",
                config.name,
                retinue_core::redact_endpoint(&url)
            );
        }
        let mut cfg = StreamableHttpClientTransportConfig::with_uri(url.as_str())
            .custom_headers(headers)
            .max_json_response_size(MAX_RESPONSE_BYTES)
            .max_sse_event_size(MAX_RESPONSE_BYTES);
        if let Some(a) = auth {
            cfg = cfg.auth_header(a);
        }
        let transport = StreamableHttpClientTransport::from_config(cfg);
        ().serve(transport).await.map_err(|e| format!("initialization failed: {e}"))?
    } else {
        return Err("neither `command` nor `url` is set".to_owned());
    };
    let tools = service.list_all_tools().await.map_err(|e| format!("tools/list failed: {e}"))?;
    Ok((service, tools))
}
