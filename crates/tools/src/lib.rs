//! `retinue-tools`: the toolsets Retinue's children get, with
//! hermes-agent 0.19's tool names, argument schemas and result shapes, so a
//! hermes parent's `toolsets` mean the same thing here.
//!
//! | toolset | tools |
//! |---|---|
//! | `read` (the default) | `read_file`, `search_files` |
//! | `file` | `read` + `write_file`, `patch` (mode `replace`) |
//! | `terminal` | `terminal`, sandboxed ([`sandbox`]) |
//! | `mcp-<server>` | the server's tools, as `mcp__<server>__<tool>` |
//! | `delegation` | `delegate_task` (orchestrator children only) |
//!
//! [`Toolbox`] is the [`ToolExecutor`] the CLI and the MCP server hand to
//! the runtime. Every path a tool touches is resolved beneath the child's
//! workspace ([`workspace::Workspace`]); model arguments are untrusted and
//! every failure is a [`ToolError`] the model reads.

pub mod approval;
pub mod args;
pub mod danger;
pub mod file;
pub mod mcp;
pub mod read;
pub mod sandbox;
mod stdio;
pub mod terminal;
pub mod workspace;

use std::sync::Arc;

use retinue_config::{ApprovalPolicy, McpServerConfig, TerminalConfig};
use retinue_core::run::{ChildHandle, GateAnswer, GatedCall, RunContext, ToolError, ToolExecutor};
use serde_json::{Value, json};

use crate::approval::{ApprovalVerdict, Approvals};
use crate::args::Args;
use crate::mcp::McpServers;
use crate::terminal::{Helper, Terminal};
use crate::workspace::{Protected, Workspace};

pub use retinue_core::run::toolsets::{DELEGATION, FILE, READ, TERMINAL};

/// What a [`Toolbox`] is built from.
#[derive(Debug, Clone, Default)]
pub struct ToolboxConfig {
    /// `delegation.terminal`.
    pub terminal: TerminalConfig,
    /// How the terminal's sandbox helper is started (`None`: commands run
    /// only with `sandbox: off`).
    pub sandbox_helper: Option<Helper>,
    /// The `mcp_servers:` section.
    pub mcp_servers: Vec<McpServerConfig>,
    /// What no child may reach (the home, the database).
    pub protected: Protected,
    /// `delegation.approvals`: which calls wait for a human.
    pub approvals: ApprovalPolicy,
}

/// The children's tools: every toolset, for each child only those it was
/// given.
pub struct Toolbox {
    terminal: Terminal,
    mcp: McpServers,
    protected: Protected,
    /// The compiled policy, or why it could not be compiled (then every
    /// call that would need approval is refused: fail closed).
    approvals: Result<Approvals, String>,
    workspaces: std::sync::Mutex<std::collections::HashMap<std::path::PathBuf, Workspace>>,
}

/// Workspaces kept open at once (a long-running server forgets them all
/// when more are used).
const MAX_OPEN_WORKSPACES: usize = 64;

impl std::fmt::Debug for Toolbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Toolbox").field("terminal", &self.terminal).field("mcp", &self.mcp).finish()
    }
}

fn function(schema: Value) -> Value {
    json!({"type": "function", "function": schema})
}

impl Toolbox {
    /// A toolbox (no MCP server is started yet).
    pub fn new(config: ToolboxConfig) -> Toolbox {
        Toolbox {
            terminal: Terminal::new(config.terminal, config.sandbox_helper),
            mcp: McpServers::new(config.mcp_servers),
            protected: config.protected,
            approvals: Approvals::new(&config.approvals).map_err(|e| e.to_string()),
            workspaces: Default::default(),
        }
    }

    /// The MCP toolsets (`mcp-<server>`), one per configured server.
    pub fn mcp_toolsets(&self) -> Vec<String> {
        self.mcp.toolsets()
    }

    /// Whether the terminal's sandbox can be set up (probed once).
    pub fn sandbox_status(&self) -> Result<String, ToolError> {
        self.terminal.sandbox_status()
    }

    /// The child's workspace, opened once per root and kept (its
    /// directory is pinned from then on).
    fn workspace(&self, child: &ChildHandle) -> Result<Workspace, ToolError> {
        let root = child.workspace.as_deref().ok_or_else(|| {
            ToolError::Refused("this child has no workspace, so it cannot use files".to_owned())
        })?;
        let mut open = self.workspaces.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        // A directory replaced since (a re-clone) is opened afresh.
        if let Some(ws) = open.get(root).filter(|ws| ws.is_current()) {
            return Ok(ws.clone());
        }
        let ws = Workspace::open_protected(root, &self.protected)?;
        if open.len() >= MAX_OPEN_WORKSPACES {
            open.clear();
        }
        open.insert(root.to_path_buf(), ws.clone());
        Ok(ws)
    }

    /// Whether `name` may run now under the approval policy: at once, after
    /// a human approved it through the run's gate, or never (the error the
    /// model reads).
    fn approve(
        &self,
        child: &ChildHandle,
        name: &str,
        arguments: &Value,
        ctx: &RunContext,
    ) -> Result<Option<String>, ToolError> {
        let verdict = match &self.approvals {
            Ok(a) => {
                let destructive =
                    name.starts_with("mcp__") && self.mcp.destructive(&child.toolsets, name);
                a.verdict(name, arguments, destructive)
            }
            Err(why) => ApprovalVerdict::Deny(format!("the approval policy is invalid: {why}")),
        };
        let reason = match verdict {
            ApprovalVerdict::Run => return Ok(None),
            ApprovalVerdict::Deny(why) => return Err(ToolError::Refused(why)),
            ApprovalVerdict::Ask(reason) => reason,
        };
        let Some(gate) = &ctx.approvals else {
            return Err(ToolError::Refused(format!(
                "this call needs a human's approval ({reason}) and nobody can approve it here"
            )));
        };
        let call = GatedCall {
            tool: name.to_owned(),
            arguments: approval::redact_arguments(arguments),
            // The classifier quotes the command: redacted alike.
            reason: approval::redact_text(&reason),
        };
        match gate.ask(child, &call, &ctx.cancel) {
            GateAnswer::Run(note) => Ok(Some(note)),
            GateAnswer::Refuse(text) => Err(ToolError::Refused(text)),
        }
    }

    fn has(child: &ChildHandle, toolset: &str) -> bool {
        child.toolsets.iter().any(|t| t == toolset)
    }

    /// The toolset a built-in tool belongs to (`read_file` is in `read`
    /// and in `file`).
    fn allowed(child: &ChildHandle, tool: &str) -> Option<bool> {
        Some(match tool {
            "read_file" | "search_files" => Self::has(child, READ) || Self::has(child, FILE),
            "write_file" | "patch" => Self::has(child, FILE),
            "terminal" => Self::has(child, TERMINAL),
            "delegate_task" => Self::has(child, DELEGATION),
            _ => return None,
        })
    }
}

impl ToolExecutor for Toolbox {
    fn definitions(&self, child: &ChildHandle) -> Vec<Value> {
        self.definitions_in(child, &RunContext::default())
    }

    /// The child's tools; `delegate_task` only when the run carries the
    /// delegation capability (an orchestrator child of a delegator).
    fn definitions_in(&self, child: &ChildHandle, ctx: &RunContext) -> Vec<Value> {
        let mut out = Vec::new();
        // Without a workspace the file and terminal tools could only refuse:
        // they are not offered.
        let files = child.workspace.is_some();
        if files && (Self::has(child, READ) || Self::has(child, FILE)) {
            out.push(function(read::read_file_schema()));
            out.push(function(read::search_files_schema()));
        }
        if files && Self::has(child, FILE) {
            out.push(function(file::write_file_schema()));
            out.push(function(file::patch_schema()));
        }
        if files && Self::has(child, TERMINAL) {
            out.push(function(terminal::terminal_schema(self.terminal.config())));
        }
        if Self::has(child, DELEGATION)
            && let Some(d) = &ctx.delegate
        {
            out.push(function(d.schema()));
        }
        out.extend(self.mcp.definitions(&child.toolsets));
        out
    }

    fn execute(
        &self,
        child: &ChildHandle,
        name: &str,
        arguments: &Value,
    ) -> Result<String, ToolError> {
        self.execute_in(child, name, arguments, &RunContext::default())
    }

    fn execute_in(
        &self,
        child: &ChildHandle,
        name: &str,
        arguments: &Value,
        ctx: &RunContext,
    ) -> Result<String, ToolError> {
        let args = Args::new(name, arguments);
        match Self::allowed(child, name) {
            Some(false) => {
                return Err(ToolError::Refused(format!(
                    "the tool `{name}` is not in this child's toolsets ({})",
                    child.toolsets.join(", ")
                )));
            }
            None if self.mcp.owns(&child.toolsets, name) => {
                let note = self.approve(child, name, arguments, ctx)?;
                return self.mcp.call(&child.toolsets, name, arguments).map(|o| noted(note, o));
            }
            None => return Err(ToolError::Unknown { name: name.to_owned() }),
            Some(true) => {}
        }
        let note = match name {
            "delegate_task" => None,
            _ => self.approve(child, name, arguments, ctx)?,
        };
        self.run_tool(child, name, &args, arguments, ctx).map(|o| noted(note, o))
    }
}

/// A call's output after the approval it waited for (`[approved by …]`
/// first), so the decision sits next to the call in the transcript.
fn noted(note: Option<String>, output: String) -> String {
    match note {
        Some(n) => format!("[{n}]\n{output}"),
        None => output,
    }
}

impl Toolbox {
    fn run_tool(
        &self,
        child: &ChildHandle,
        name: &str,
        args: &Args<'_>,
        arguments: &Value,
        ctx: &RunContext,
    ) -> Result<String, ToolError> {
        match name {
            // The grandchildren run under the child's own token (its
            // deadline, budget meter and stop).
            "delegate_task" => match &ctx.delegate {
                Some(d) => Ok(d.delegate_task(child, arguments, &ctx.cancel)),
                None => Err(ToolError::Refused(
                    "delegation is not available in this process".to_owned(),
                )),
            },
            _ => {
                let ws = self.workspace(child)?;
                match name {
                    "read_file" => read::read_file(&ws, args),
                    "search_files" => read::search_files(&ws, args),
                    "write_file" => file::write_file(&ws, args),
                    "patch" => file::patch(&ws, args),
                    "terminal" => self.terminal.run(&ws, args, &ctx.cancel),
                    _ => Err(ToolError::Unknown { name: name.to_owned() }),
                }
            }
        }
    }
}

/// A toolbox shared by a runtime and the delegator it serves.
pub type SharedToolbox = Arc<Toolbox>;
