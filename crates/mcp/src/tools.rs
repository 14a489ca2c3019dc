//! The tools: names, JSON Schemas and descriptions written for a model, and
//! the synchronous bodies of the registry tools (`list_subagents`,
//! `show_subagent`, `tombstone_subagent`, `subagent_usage`). Every lookup is
//! scoped to the server's session lineage through the `delegate_task`
//! authority rules; a foreign id answers exactly like a missing one.

use std::collections::BTreeMap;

use retinue_core::{RetainedChild, TombstoneReason, UsageTotals, iso8601, truncate_chars};
use retinue_delegate::texts;
use retinue_lineage::{CompressionWalk, Resolution};
use retinue_usage::{fold_usage, load_child_usage_attributions, load_lineage_usage_totals};
use serde_json::{Map, Value, json};

use crate::McpParts;

/// `delegate_task`.
pub const DELEGATE_TASK: &str = "delegate_task";
/// `list_subagents`.
pub const LIST_SUBAGENTS: &str = "list_subagents";
/// `show_subagent`.
pub const SHOW_SUBAGENT: &str = "show_subagent";
/// `tombstone_subagent`.
pub const TOMBSTONE_SUBAGENT: &str = "tombstone_subagent";
/// `subagent_usage`.
pub const SUBAGENT_USAGE: &str = "subagent_usage";
/// `wait_subagents`.
pub const WAIT_SUBAGENTS: &str = "wait_subagents";
/// `steer_subagent`.
pub const STEER_SUBAGENT: &str = "steer_subagent";
/// `cancel_subagent`.
pub const CANCEL_SUBAGENT: &str = "cancel_subagent";
/// `list_approvals`.
pub const LIST_APPROVALS: &str = "list_approvals";
/// `decide_approval`.
pub const DECIDE_APPROVAL: &str = "decide_approval";
/// The tools whose bodies block (`tasks::run_tool` on a blocking thread).
pub(crate) const BLOCKING: &[&str] = &[
    WAIT_SUBAGENTS,
    STEER_SUBAGENT,
    CANCEL_SUBAGENT,
    LIST_APPROVALS,
    DECIDE_APPROVAL,
    SUBAGENT_CHANGES,
    APPLY_CHANGES,
    DISCARD_CHANGES,
];
/// `subagent_changes`.
pub const SUBAGENT_CHANGES: &str = "subagent_changes";
/// `apply_changes`.
pub const APPLY_CHANGES: &str = "apply_changes";
/// `discard_changes`.
pub const DISCARD_CHANGES: &str = "discard_changes";

/// The longest `wait_subagents` may block, in seconds (below the usual
/// host tool timeouts; wait again for longer).
pub const MAX_WAIT_SECS: f64 = 300.0;
/// `wait_subagents`' default timeout, in seconds.
pub const DEFAULT_WAIT_SECS: f64 = 30.0;

/// How many characters of a child's last answer `show_subagent` returns.
pub const LAST_ANSWER_MAX_CHARS: usize = 4000;

/// `delegate_task`'s description: hermes's, and how retention works here.
fn delegate_description(base: &str) -> String {
    format!(
        "{base} Each subagent works on its own transcript and returns a summary. Completed \
         subagents are retained: later — in this conversation, a later one, or after a \
         restart — send one a follow-up with `follow_up` set to its subagent_id and `goal` as \
         the message; it resumes with its whole context. Pass `goal` (and optional `context`) \
         for one task, or `tasks` for several in parallel. Returns the delegation_id and, per \
         task, status, subagent_id, child_session_id, summary and token usage."
    )
}

/// `list_approvals` and `decide_approval` (issue #37).
fn approval_specs() -> Vec<ToolSpec> {
    vec![
        ToolSpec {
            name: LIST_APPROVALS,
            description: "Risky calls of this session's subagents waiting for a human's \
                          decision (a recursive delete, a force push, a destructive MCP tool, \
                          or what config.yaml's delegation.approvals asks about): each with its \
                          approval_id, the tool, its arguments and why it needs approval. \
                          all=true lists decided ones too. Ask the user, then call \
                          decide_approval; never decide on the user's behalf."
                .to_owned(),
            input_schema: object(json!({
                "type": "object",
                "properties": {
                    "all": {"type": "boolean", "description": "Decided and expired requests too."}
                }
            })),
        },
        ToolSpec {
            name: DECIDE_APPROVAL,
            description: "Record the user's decision on a pending approval request: \
                          approve=true runs the subagent's call (always=true: and the same call \
                          of that subagent from now on), approve=false refuses it and the \
                          subagent reads the reason. A request already decided elsewhere is \
                          reported with code already_decided."
                .to_owned(),
            input_schema: object(json!({
                "type": "object",
                "properties": {
                    "approval_id": {"type": "string", "description": "From list_approvals."},
                    "approve": {"type": "boolean"},
                    "always": {"type": "boolean", "description": "Approve this call and its likes for the rest of the subagent's work."},
                    "reason": {"type": "string", "description": "Why (a denial's reason is what the subagent reads)."}
                },
                "required": ["approval_id", "approve"]
            })),
        },
    ]
}

/// A tool's advertised form: name, description, input schema (a JSON object).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    /// The tool name.
    pub name: &'static str,
    /// What it does, for a model.
    pub description: String,
    /// The JSON Schema of its arguments.
    pub input_schema: Map<String, Value>,
}

fn object(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

fn id_schema(what: &str) -> Map<String, Value> {
    object(json!({
        "type": "object",
        "properties": {
            "id": {
                "type": "string",
                "description": format!(
                    "{what}: a subagent_id (e.g. sa-0-1a2b3c4d), a child session id or a \
                     delegation_id, as returned by delegate_task or list_subagents."
                )
            }
        },
        "required": ["id"]
    }))
}

/// The eight tools, `delegate_task` first; `delegate_schema` is
/// `Delegator::schema()` (its `parameters` become the input schema).
pub fn tool_specs(delegate_schema: &Value) -> Vec<ToolSpec> {
    let base = delegate_schema.get("description").and_then(Value::as_str).unwrap_or_default();
    let delegate_description = delegate_description(base);
    let parameters = delegate_schema
        .get("parameters")
        .cloned()
        .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
    vec![
        ToolSpec {
            name: DELEGATE_TASK,
            description: delegate_description,
            input_schema: object(parameters),
        },
        ToolSpec {
            name: LIST_SUBAGENTS,
            description: "List the retained subagents this session may still follow up with \
                          delegate_task(follow_up=…), newest first: subagent_id, child session, \
                          delegation, goal, state, when retained. Children of other projects or \
                          sessions are never listed."
                .to_owned(),
            input_schema: object(json!({"type": "object", "properties": {}})),
        },
        ToolSpec {
            name: SHOW_SUBAGENT,
            description: "Show one of this session's subagents: its goal, status, whether it is \
                          still retained (can be followed up) or tombstoned (when and why), its \
                          last answer from its transcript, and what its runs cost."
                .to_owned(),
            input_schema: id_schema("The subagent to show"),
        },
        ToolSpec {
            name: TOMBSTONE_SUBAGENT,
            description: "De-register one of this session's retained subagents (a delegation_id: \
                          all of its live subagents) when it is no longer needed. It can no \
                          longer be followed up; its transcript and usage are kept."
                .to_owned(),
            input_schema: {
                let mut schema = id_schema("The subagent to tombstone");
                if let Some(Value::Object(props)) = schema.get_mut("properties") {
                    props.insert(
                        "reason".into(),
                        json!({"type": "string", "description": "A note on why, stored with the tombstone (its reason is always `manual`)."}),
                    );
                }
                schema
            },
        },
        ToolSpec {
            name: SUBAGENT_USAGE,
            description: "What this session's subagents cost: totals (USD, input and output \
                          tokens) over the session's whole lineage, and a per-subagent breakdown."
                .to_owned(),
            input_schema: object(json!({"type": "object", "properties": {}})),
        },
        ToolSpec {
            name: WAIT_SUBAGENTS,
            description: format!(
                "Wait for background delegations (delegate_task with background=true) to finish \
                 and collect their results. Each result is delivered exactly once: here, or \
                 attached to a later tool result of this session, never both. Returns, per id, \
                 `delivered` with the result, `running` when the timeout passed first (wait \
                 again), `already_delivered`, or `not_found`. Blocks at most timeout_seconds \
                 (default {DEFAULT_WAIT_SECS}, at most {MAX_WAIT_SECS})."
            ),
            input_schema: object(json!({
                "type": "object",
                "properties": {
                    "ids": {
                        "type": "array",
                        "items": {"type": "string"},
                        "minItems": 1,
                        "description": "delegation_ids (or subagent_ids) returned by delegate_task."
                    },
                    "timeout_seconds": {
                        "type": "number",
                        "minimum": 0,
                        "maximum": MAX_WAIT_SECS,
                        "description": "How long to wait at most."
                    }
                },
                "required": ["ids"]
            })),
        },
        ToolSpec {
            name: STEER_SUBAGENT,
            description: "Send a message to one of this session's subagents while it is still \
                          running (a background delegation): it reads the message before its \
                          next step. Returns `delivered`, or `missed_steer` when the subagent had \
                          already finished (follow it up with delegate_task(follow_up=…) instead)."
                .to_owned(),
            input_schema: {
                let mut schema = id_schema("The running subagent");
                if let Some(Value::Object(props)) = schema.get_mut("properties") {
                    props.insert(
                        "message".into(),
                        json!({"type": "string", "description": "What to tell it."}),
                    );
                }
                if let Some(Value::Array(req)) = schema.get_mut("required") {
                    req.push(json!("message"));
                }
                schema
            },
        },
        ToolSpec {
            name: CANCEL_SUBAGENT,
            description: "Stop one of this session's running background delegations (any of \
                          its ids): its subagents stop, report what they did (exit reason \
                          `cancelled`) and bill what they spent. A finished one is refused."
                .to_owned(),
            input_schema: id_schema("The running delegation or subagent"),
        },
    ]
    .into_iter()
    .chain(approval_specs())
    .chain(change_specs())
    .collect()
}

/// `subagent_changes`, `apply_changes` and `discard_changes` (issue #38).
fn change_specs() -> Vec<ToolSpec> {
    let id = |what: &str| {
        object(json!({
            "type": "object",
            "properties": {"id": {"type": "string", "description": format!("{what}: the subagent_id of a child spawned with isolation=worktree.")}},
            "required": ["id"]
        }))
    };
    vec![
        ToolSpec {
            name: SUBAGENT_CHANGES,
            description: "What an isolated subagent (delegate_task with isolation=worktree)                           changed in its own git worktree: files added, modified, deleted and                           renamed with a diffstat (diff=true: the unified diff), and whether                           the change set is pending, applied or discarded. Without id: every                           change set of this session's subagents (pending=true: only those                           neither applied nor discarded). Review before apply_changes."
                .to_owned(),
            input_schema: object(json!({
                "type": "object",
                "properties": {
                    "id": {"type": "string", "description": "A subagent_id (optional)."},
                    "diff": {"type": "boolean", "description": "Include the unified diff."},
                    "pending": {"type": "boolean", "description": "Only change sets not yet applied or discarded."}
                }
            })),
        },
        ToolSpec {
            name: APPLY_CHANGES,
            description: "Apply an isolated subagent's change set to this session's workspace                           with a three-way merge. On a conflict nothing is applied and the                           conflicting files are listed (code conflict); a change set applied                           before answers already_decided."
                .to_owned(),
            input_schema: id("The isolated subagent"),
        },
        ToolSpec {
            name: DISCARD_CHANGES,
            description: "Drop an isolated subagent's change set: its worktree and branch are                           removed and nothing reaches the workspace."
                .to_owned(),
            input_schema: id("The isolated subagent"),
        },
    ]
}

/// A tool failure: its text goes back as an MCP tool error (`isError`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ToolError(pub(crate) String);

impl std::fmt::Display for ToolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<retinue_core::Error> for ToolError {
    fn from(e: retinue_core::Error) -> Self {
        log::warn!("storage error in a tool call: {e}");
        ToolError(format!("storage error: {e}"))
    }
}

impl From<retinue_usage::UsageError> for ToolError {
    fn from(e: retinue_usage::UsageError) -> Self {
        log::warn!("usage ledger error in a tool call: {e}");
        ToolError(format!("usage ledger error: {e}"))
    }
}

/// The registry tools, scoped to one parent session.
pub(crate) struct Scoped<'a> {
    pub(crate) parts: &'a McpParts,
    pub(crate) session: &'a str,
}

fn totals_json(t: &UsageTotals) -> Value {
    json!({
        "cost_usd": t.cost_usd,
        "input_tokens": t.input_tokens,
        "output_tokens": t.output_tokens,
    })
}

fn when(t: Option<f64>) -> Value {
    t.map_or(Value::Null, |t| Value::String(iso8601(t)))
}

/// The short form of an entry a model needs.
fn entry_json(e: &RetainedChild) -> Value {
    json!({
        "subagent_id": e.child_id(),
        "child_session_id": e.child_session_id,
        "delegation_id": e.delegation_id,
        "parent_session_id": e.parent_session_id,
        "goal": e.manifest.goal,
        "model": e.manifest.model,
        "state": e.state.to_string(),
        "completed_at": when(e.completed_at),
        "retained_at": when(e.retained_at),
    })
}

/// One child's runs in the ledger.
#[derive(Default)]
struct ChildUsage {
    runs: u64,
    totals: UsageTotals,
    last_status: Option<String>,
}

impl Scoped<'_> {
    /// The argument `id`, trimmed and non-empty.
    fn id_arg(args: &Map<String, Value>) -> Result<String, ToolError> {
        match args.get("id").and_then(Value::as_str).map(str::trim) {
            Some(id) if !id.is_empty() => Ok(id.to_owned()),
            _ => Err(ToolError(
                "missing argument `id`: a subagent_id, child session id or delegation_id"
                    .to_owned(),
            )),
        }
    }

    /// The ids of this session's compression lineage (root first), and whether it resolved.
    fn lineage(&self) -> (Vec<String>, bool) {
        match retinue_lineage::lineage_sessions(self.parts.backend.sessions.as_ref(), self.session)
        {
            Ok(ids) if !ids.is_empty() => (ids, true),
            _ => (vec![self.session.to_owned()], false),
        }
    }

    /// Ledger rows billed to the lineage, folded per child session.
    fn usage_by_child(
        &self,
        sessions: &[String],
    ) -> Result<BTreeMap<String, ChildUsage>, ToolError> {
        let mut out: BTreeMap<String, ChildUsage> = BTreeMap::new();
        for s in sessions {
            for row in load_child_usage_attributions(self.parts.backend.ledger.as_ref(), s)? {
                let u = out.entry(row.child_session_id.clone()).or_default();
                u.runs += 1;
                u.totals = u.totals.plus(fold_usage(&row.usage));
                if let Some(status) = row.usage.get("status").and_then(Value::as_str) {
                    u.last_status = Some(status.to_owned());
                }
            }
        }
        Ok(out)
    }

    /// `list_subagents`.
    pub(crate) fn list(&self) -> Result<Value, ToolError> {
        let entries = self.parts.authority.list_for(Some(self.session))?;
        Ok(json!({
            "session_id": self.session,
            "subagents": entries.iter().map(entry_json).collect::<Vec<_>>(),
        }))
    }

    /// The child's last assistant answer from its transcript.
    fn last_answer(&self, child_session_id: &str) -> Option<String> {
        if child_session_id.is_empty() {
            return None;
        }
        let messages = match self.parts.backend.sessions.conversation(child_session_id) {
            Ok(m) => m,
            Err(e) => {
                log::warn!("reading the transcript of {child_session_id}: {e}");
                return None;
            }
        };
        messages
            .iter()
            .rev()
            .filter(|m| m.role == "assistant")
            .find_map(|m| m.content.as_deref().map(str::trim).filter(|c| !c.is_empty()))
            .map(|c| truncate_chars(c, LAST_ANSWER_MAX_CHARS))
    }

    /// `show_subagent`.
    pub(crate) fn show(&self, args: &Map<String, Value>) -> Result<Value, ToolError> {
        let id = Self::id_arg(args)?;
        let (entry, tombstone) = match self.parts.authority.resolve_for(Some(self.session), &id) {
            Resolution::Addressable(entry) => (entry, None),
            Resolution::Tombstoned { entry, at, reason } => (entry, Some((at, reason))),
            Resolution::SelfTarget | Resolution::NotAddressable => {
                return Err(ToolError(texts::not_addressable(&id)));
            }
        };
        let mut out = entry_json(&entry);
        let (sessions, _) = self.lineage();
        let usage = self.usage_by_child(&sessions)?;
        let mine = usage.get(&entry.child_session_id);
        let status =
            mine.and_then(|u| u.last_status.clone()).unwrap_or_else(|| entry.state.to_string());
        out["status"] = json!(status);
        out["retained"] = json!(tombstone.is_none());
        out["tombstoned"] = match &tombstone {
            None => Value::Null,
            Some((at, reason)) => json!({ "at": iso8601(*at), "reason": reason.as_str() }),
        };
        out["last_answer"] = json!(self.last_answer(&entry.child_session_id));
        out["usage"] = json!({
            "runs": mine.map_or(0, |u| u.runs),
            "totals": totals_json(&mine.map(|u| u.totals).unwrap_or_default()),
        });
        Ok(out)
    }

    /// `tombstone_subagent`.
    pub(crate) fn tombstone(&self, args: &Map<String, Value>) -> Result<Value, ToolError> {
        let id = Self::id_arg(args)?;
        let entry = match self.parts.authority.resolve_for(Some(self.session), &id) {
            Resolution::Addressable(entry) => entry,
            Resolution::Tombstoned { entry, at, reason } => {
                return Err(ToolError(texts::tombstoned(
                    &id,
                    at,
                    reason.as_str(),
                    &entry.child_session_id,
                )));
            }
            Resolution::SelfTarget | Resolution::NotAddressable => {
                return Err(ToolError(texts::not_addressable(&id)));
            }
        };
        let reason = match args.get("reason").and_then(Value::as_str).map(str::trim) {
            Some(r) if !r.is_empty() && r != "manual" => TombstoneReason::Other(r.to_owned()),
            _ => TombstoneReason::Manual,
        };
        if !self.parts.backend.registry.tombstone_retained_child(&id, &reason)? {
            // Pruned or tombstoned by someone else in between.
            return Err(ToolError(texts::not_addressable(&id)));
        }
        let whole_unit = id == entry.delegation_id;
        Ok(json!({
            "tombstoned": true,
            "id": id,
            "subagent_id": if whole_unit { Value::Null } else { json!(entry.child_id()) },
            "delegation_id": entry.delegation_id,
            "reason": TombstoneReason::Manual.as_str(),
            "tombstone_note": match &reason {
                TombstoneReason::Other(note) => Some(note.as_str()),
                _ => None,
            },
            "note": if whole_unit {
                "Every live subagent of this delegation was tombstoned; transcripts and usage are kept."
            } else {
                "The subagent can no longer be followed up; its transcript and usage are kept."
            },
        }))
    }

    /// `subagent_usage`.
    pub(crate) fn usage(&self) -> Result<Value, ToolError> {
        let walk = CompressionWalk::new(self.parts.backend.sessions.as_ref());
        let lineage =
            load_lineage_usage_totals(self.parts.backend.ledger.as_ref(), &walk, self.session)?;
        let by_child = self.usage_by_child(&lineage.sessions)?;
        let mut children = Vec::new();
        for (child_session_id, u) in &by_child {
            let (entry, addressable) =
                match self.parts.authority.resolve_for(Some(self.session), child_session_id) {
                    Resolution::Addressable(e) => (Some(e), true),
                    Resolution::Tombstoned { entry, .. } => (Some(entry), false),
                    _ => (None, false),
                };
            children.push(json!({
                "child_session_id": child_session_id,
                "subagent_id": entry.as_ref().map(|e| e.child_id().to_owned()),
                "goal": entry.as_ref().and_then(|e| e.manifest.goal.clone()),
                "retained": addressable,
                "runs": u.runs,
                "last_status": u.last_status,
                "totals": totals_json(&u.totals),
            }));
        }
        let mut out = json!({
            "session_id": self.session,
            "lineage_sessions": lineage.sessions,
            "lineage_resolved": lineage.lineage_resolved,
            "totals": totals_json(&lineage.totals),
            "children": children,
        });
        // The lineage budget (delegation.budget): limit, spent, reserved, remaining.
        if !self.parts.budget.is_unlimited() {
            let budgets = &self.parts.backend.budgets;
            let root = lineage.sessions.first().cloned().unwrap_or_else(|| self.session.to_owned());
            match budgets.budget_status(&root, &lineage.sessions, self.parts.budget) {
                Ok(status) => out["budget"] = retinue_usage::budget_json(&status),
                Err(e) => log::warn!("could not read the budget of {root}: {e}"),
            }
        }
        Ok(out)
    }
}

/// A tool's JSON answer as an MCP result: pretty text plus the same value
/// as structured content; a result with children's receipts gets them as
/// a second text block, one line per child (the calling model reads what
/// each child really did; the first block stays plain JSON for clients
/// that parse it).
pub(crate) fn text_result(value: &Value) -> rmcp::model::CallToolResult {
    let text = serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string());
    let mut blocks = vec![rmcp::model::ContentBlock::text(text)];
    let lines = retinue_delegate::receipt_lines(value);
    if !lines.is_empty() {
        blocks.push(rmcp::model::ContentBlock::text(lines.join("\n")));
    }
    let mut result = rmcp::model::CallToolResult::success(blocks);
    result.structured_content = Some(value.clone());
    result
}
