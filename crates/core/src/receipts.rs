//! Receipts: what a child actually did, read from its transcript.
//!
//! One rule for every surface (the tool's result, `children show`, `wait`,
//! the MCP results, the web view): the assistant turns' tool calls are
//! matched with their results by call id. A call counts as performed when
//! its result is not an error object (`{"error": …}`), so a denied or
//! refused write is never listed as written. Nothing here trusts what the
//! child *says* it did: only the calls and what the tools answered.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::Serialize;
use serde_json::Value;

use crate::model::{Message, truncate_chars};

/// A terminal command the child ran, with its exit code (`None`: the call
/// was refused or failed before the command ran).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CommandReceipt {
    /// The command text (clipped to [`COMMAND_MAX_CHARS`]).
    pub command: String,
    /// Its exit code.
    pub exit_code: Option<i64>,
}

/// One file of an isolated child's change set, for the receipts line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChangedFile {
    /// Path relative to the repository.
    pub path: String,
    /// Lines added (`None` for a binary file).
    pub added: Option<u64>,
    /// Lines removed (`None` for a binary file).
    pub removed: Option<u64>,
}

/// A run's token counts in receipts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct RunTokenCount {
    /// Prompt tokens.
    pub input: u64,
    /// Completion tokens.
    pub output: u64,
}

/// What a child did, as its transcript shows it.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct Receipts {
    /// Tool calls made (performed or not).
    pub tool_calls: u64,
    /// Calls per tool name.
    pub by_tool: BTreeMap<String, u64>,
    /// Calls whose result was an error (refused, denied, failed).
    pub failed_calls: u64,
    /// Paths `read_file` read successfully.
    pub files_read: Vec<String>,
    /// Paths `write_file` and `patch` wrote successfully.
    pub files_written: Vec<String>,
    /// Terminal commands and their exit codes, in order.
    pub commands: Vec<CommandReceipt>,
    /// MCP tools called (`mcp__<server>__<tool>`), each once.
    pub mcp_tools: Vec<String>,
    /// Model turns (assistant messages).
    pub iterations: u64,
    /// Input and output tokens of the run, when the caller knows them
    /// (`{"input", "output"}`, as a result's `tokens`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<RunTokenCount>,
    /// Wall time of the run in seconds, when the caller knows it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_seconds: Option<f64>,
    /// An isolated child's change set (files and line counts).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub changed: Vec<ChangedFile>,
}

/// The longest command text a receipt keeps.
pub const COMMAND_MAX_CHARS: usize = 200;
/// The most paths, commands or MCP tools a receipt lists (the counts stay exact).
pub const LIST_MAX: usize = 200;

fn call_parts(call: &Value) -> Option<(&str, &str, Value)> {
    let id = call.get("id").and_then(Value::as_str).unwrap_or_default();
    let function = call.get("function")?;
    let name = function.get("name").and_then(Value::as_str)?;
    // Arguments are a JSON string on the wire; a model may send an object.
    let args = match function.get("arguments") {
        Some(Value::String(s)) => serde_json::from_str(s).unwrap_or(Value::Null),
        Some(other) => other.clone(),
        None => Value::Null,
    };
    Some((id, name, args))
}

fn push_bounded(list: &mut Vec<String>, seen: &mut BTreeSet<String>, item: &str) {
    if list.len() < LIST_MAX && seen.insert(item.to_owned()) {
        list.push(item.to_owned());
    }
}

impl Receipts {
    /// The receipts of `messages` (a transcript, or the part of one a run
    /// appended).
    pub fn of(messages: &[Message]) -> Receipts {
        let results: HashMap<&str, Option<Value>> = messages
            .iter()
            .filter(|m| m.role == "tool")
            .filter_map(|m| {
                let id = m.tool_call_id.as_deref()?;
                Some((id, m.content.as_deref().and_then(|c| serde_json::from_str(c).ok())))
            })
            .collect();
        let mut r = Receipts::default();
        let (mut read, mut written, mut mcp) = (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
        for m in messages.iter().filter(|m| m.role == "assistant") {
            r.iterations += 1;
            let Some(calls) = m.tool_calls.as_deref() else { continue };
            let Ok(Value::Array(calls)) = serde_json::from_str::<Value>(calls) else { continue };
            for call in &calls {
                let Some((id, name, args)) = call_parts(call) else { continue };
                r.tool_calls += 1;
                *r.by_tool.entry(name.to_owned()).or_default() += 1;
                let result = results.get(id).cloned().flatten();
                let failed =
                    result.as_ref().and_then(|v| v.get("error")).is_some_and(|e| !e.is_null());
                if failed || !results.contains_key(id) {
                    r.failed_calls += 1;
                }
                let path = args.get("path").and_then(Value::as_str);
                let ran = !failed && results.contains_key(id);
                match name {
                    "read_file" if ran => {
                        if let Some(p) = path {
                            push_bounded(&mut r.files_read, &mut read, p);
                        }
                    }
                    "write_file" | "patch" if ran => {
                        if let Some(p) = path {
                            push_bounded(&mut r.files_written, &mut written, p);
                        }
                    }
                    "terminal" if r.commands.len() < LIST_MAX => {
                        let command = args.get("command").and_then(Value::as_str).unwrap_or("");
                        // A command that timed out or was killed has an
                        // exit code and an error: it ran (and failed).
                        let exit_code = result
                            .as_ref()
                            .and_then(|v| v.get("exit_code"))
                            .and_then(Value::as_i64);
                        r.commands.push(CommandReceipt {
                            command: truncate_chars(command, COMMAND_MAX_CHARS),
                            exit_code,
                        });
                    }
                    n if n.starts_with("mcp__") => push_bounded(&mut r.mcp_tools, &mut mcp, n),
                    _ => {}
                }
            }
        }
        r
    }

    /// The same receipts with the run's tokens and duration.
    pub fn with_run(mut self, input: u64, output: u64, duration_seconds: f64) -> Receipts {
        self.tokens = Some(RunTokenCount { input, output });
        self.duration_seconds = Some((duration_seconds * 100.0).round() / 100.0);
        self
    }

    /// The one line a parent model reads after a child's result, e.g.
    /// `receipts: 4 tool calls (read_file ×3, terminal ×1: "cargo test" exit 101); changed: src/lib.rs (+3 −1)`.
    pub fn line(&self) -> String {
        let mut out = if self.tool_calls == 0 {
            "receipts: no tool calls".to_owned()
        } else {
            let plural = if self.tool_calls == 1 { "" } else { "s" };
            let tools: Vec<String> = self
                .by_tool
                .iter()
                .map(|(name, n)| {
                    let mut t = format!("{name} ×{n}");
                    if name == "terminal" {
                        let shown: Vec<String> = self
                            .commands
                            .iter()
                            .take(3)
                            .map(|c| {
                                let cmd = truncate_chars(&c.command, 60);
                                match c.exit_code {
                                    Some(code) => format!("{cmd:?} exit {code}"),
                                    None => format!("{cmd:?} not run"),
                                }
                            })
                            .collect();
                        if !shown.is_empty() {
                            t.push_str(": ");
                            t.push_str(&shown.join(", "));
                        }
                        if self.commands.len() > 3 {
                            t.push_str(", …");
                        }
                    }
                    t
                })
                .collect();
            format!("receipts: {} tool call{plural} ({})", self.tool_calls, tools.join(", "))
        };
        if self.failed_calls > 0 {
            out.push_str(&format!("; {} failed", self.failed_calls));
        }
        let list = |paths: Vec<String>| {
            let more = paths.len().saturating_sub(5);
            let mut s = paths.into_iter().take(5).collect::<Vec<_>>().join(", ");
            if more > 0 {
                s.push_str(&format!(" and {more} more"));
            }
            s
        };
        if !self.changed.is_empty() {
            let files = self
                .changed
                .iter()
                .map(|f| match (f.added, f.removed) {
                    (Some(a), Some(r)) => format!("{} (+{a} −{r})", f.path),
                    _ => format!("{} (binary)", f.path),
                })
                .collect();
            out.push_str(&format!("; changed: {}", list(files)));
        } else if !self.files_written.is_empty() {
            out.push_str(&format!("; wrote: {}", list(self.files_written.clone())));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn assistant(calls: &[(&str, &str, Value)]) -> Message {
        let calls: Vec<Value> = calls
            .iter()
            .map(|(id, name, args)| {
                json!({"id": id, "type": "function", "function": {"name": name, "arguments": args.to_string()}})
            })
            .collect();
        Message {
            role: "assistant".into(),
            tool_calls: (!calls.is_empty()).then(|| Value::Array(calls).to_string()),
            ..Message::default()
        }
    }

    fn tool(id: &str, content: Value) -> Message {
        Message {
            role: "tool".into(),
            tool_call_id: Some(id.into()),
            content: Some(content.to_string()),
            ..Message::default()
        }
    }

    #[test]
    fn a_child_that_only_answers_has_no_tool_calls() {
        let r =
            Receipts::of(&[Message { role: "user".into(), ..Message::default() }, assistant(&[])]);
        assert_eq!(r.tool_calls, 0);
        assert_eq!(r.iterations, 1);
        assert_eq!(r.line(), "receipts: no tool calls");
    }

    #[test]
    fn calls_are_matched_with_their_results() {
        let r = Receipts::of(&[
            assistant(&[
                ("c1", "read_file", json!({"path": "src/lib.rs"})),
                ("c2", "read_file", json!({"path": "src/lib.rs"})),
                ("c3", "write_file", json!({"path": "denied.rs", "content": ""})),
            ]),
            tool("c1", json!({"content": "x"})),
            tool("c2", json!({"content": "x"})),
            tool("c3", json!({"error": "denied by the operator"})),
            assistant(&[
                ("c4", "terminal", json!({"command": "cargo test"})),
                ("c5", "patch", json!({"path": "src/a.rs"})),
                ("c6", "mcp__gh__issues", json!({})),
            ]),
            tool("c4", json!({"output": "boom", "exit_code": 101})),
            tool("c5", json!({"diff": "…"})),
            tool("c6", json!("text")),
            assistant(&[]),
        ]);
        assert_eq!(r.tool_calls, 6);
        assert_eq!(r.iterations, 3);
        assert_eq!(r.failed_calls, 1);
        assert_eq!(r.files_read, vec!["src/lib.rs"]);
        assert_eq!(r.files_written, vec!["src/a.rs"], "a denied write is not a write");
        assert_eq!(
            r.commands,
            vec![CommandReceipt { command: "cargo test".into(), exit_code: Some(101) }]
        );
        assert_eq!(r.mcp_tools, vec!["mcp__gh__issues"]);
        assert_eq!(
            r.line(),
            "receipts: 6 tool calls (mcp__gh__issues ×1, patch ×1, read_file ×2, terminal ×1: \
             \"cargo test\" exit 101, write_file ×1); 1 failed; wrote: src/a.rs"
        );
    }

    #[test]
    fn a_command_that_timed_out_ran_and_failed() {
        let r = Receipts::of(&[
            assistant(&[("c1", "terminal", json!({"command": "sleep 999"}))]),
            tool("c1", json!({"output": "", "exit_code": 124, "error": "timed out after 60 s"})),
        ]);
        assert_eq!(r.failed_calls, 1);
        assert_eq!(r.commands[0].exit_code, Some(124));
        assert!(r.line().contains("\"sleep 999\" exit 124"), "{}", r.line());
    }

    #[test]
    fn a_call_without_a_result_did_not_run() {
        let r = Receipts::of(&[assistant(&[("c1", "terminal", json!({"command": "rm -rf /"}))])]);
        assert_eq!(r.failed_calls, 1);
        assert_eq!(r.commands[0].exit_code, None);
        assert!(r.line().contains("\"rm -rf /\" not run"), "{}", r.line());
    }

    #[test]
    fn garbage_tool_calls_are_skipped_not_fatal() {
        let mut m = assistant(&[]);
        m.tool_calls = Some("not json".into());
        let mut n = assistant(&[]);
        n.tool_calls = Some(
            json!([{"id": "x"}, {"function": {"name": "read_file", "arguments": "{"}}]).to_string(),
        );
        let r = Receipts::of(&[m, n]);
        assert_eq!(r.tool_calls, 1);
        assert!(r.files_read.is_empty());
    }

    #[test]
    fn the_change_set_replaces_the_written_list() {
        let mut r = Receipts::of(&[
            assistant(&[("c1", "write_file", json!({"path": "src/lib.rs"}))]),
            tool("c1", json!({"bytes_written": 3})),
        ]);
        r.changed = vec![
            ChangedFile { path: "src/lib.rs".into(), added: Some(3), removed: Some(1) },
            ChangedFile { path: "logo.png".into(), added: None, removed: None },
        ];
        assert_eq!(
            r.line(),
            "receipts: 1 tool call (write_file ×1); changed: src/lib.rs (+3 −1), logo.png (binary)"
        );
    }
}
