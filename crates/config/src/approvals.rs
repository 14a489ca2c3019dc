//! `delegation.approvals`: which of a child's tool calls wait for a human
//! (issue #37). Rules are checked first, in order, the first match winning;
//! a call no rule matches needs approval when the built-in classification
//! says so (a risky terminal command, an MCP tool annotated
//! `destructiveHint: true`), and then gets [`ApprovalPolicy::mode`].
//!
//! ```yaml
//! delegation:
//!   subagent_auto_approve: false   # hermes's key: true = approvals.mode allow
//!   approvals:
//!     mode: ask                    # ask | allow | deny
//!     timeout_s: 600               # an unanswered request is denied (expired)
//!     rules:
//!       - {tool: terminal, command: "git status*", decision: allow}
//!       - {tool: write_file, path: "docs/**", decision: allow}
//!       - {tool: "mcp__github__*", decision: ask}
//! ```
//!
//! A rule with an invalid glob, an unknown tool or decision is an error of
//! the loaded configuration (a command that runs children refuses to start,
//! naming the key), never a rule silently dropped.

use globset::Glob;
use retinue_core::run::toolsets::TOOL_NAMES;
use serde_yaml_ng::Value;

use crate::reader::Reader;

/// What a call that needs approval gets, and what a rule decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ApprovalAction {
    /// Wait for a human's decision (the default).
    #[default]
    Ask,
    /// Run it.
    Allow,
    /// Refuse it (the model reads the refusal).
    Deny,
}

impl ApprovalAction {
    /// Reads `ask`, `allow` or `deny`.
    pub fn parse(text: &str) -> Option<ApprovalAction> {
        match text.trim() {
            "ask" => Some(ApprovalAction::Ask),
            "allow" => Some(ApprovalAction::Allow),
            "deny" => Some(ApprovalAction::Deny),
            _ => None,
        }
    }

    /// The configuration's word for it.
    pub fn as_str(self) -> &'static str {
        match self {
            ApprovalAction::Ask => "ask",
            ApprovalAction::Allow => "allow",
            ApprovalAction::Deny => "deny",
        }
    }
}

/// One `approvals.rules` entry: globs over the tool's name and, where
/// given, its `command` (terminal) or `path` (file tools) argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApprovalRule {
    /// A glob over the tool's name (`terminal`, `mcp__github__*`).
    pub tool: String,
    /// A glob over a terminal call's `command` (`*` crosses `/`).
    pub command: Option<String>,
    /// A glob over a file call's `path`, relative to the workspace (`*`
    /// stays within one directory, `**` crosses them).
    pub path: Option<String>,
    /// What a matching call gets.
    pub decision: ApprovalAction,
}

/// The `delegation.approvals` section.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApprovalPolicy {
    /// What a call that needs approval gets when no rule decides it
    /// (`subagent_auto_approve: true` makes the default `allow`).
    pub mode: ApprovalAction,
    /// Seconds an unanswered request waits before it is denied (`expired`).
    pub timeout_s: u64,
    /// The rules, first match wins.
    pub rules: Vec<ApprovalRule>,
    /// Whether an agent definition's `permissionMode: bypassPermissions`
    /// may switch approvals off (refused otherwise).
    pub allow_bypass: bool,
}

impl Default for ApprovalPolicy {
    fn default() -> Self {
        ApprovalPolicy {
            mode: ApprovalAction::Ask,
            timeout_s: 600,
            rules: Vec::new(),
            allow_bypass: false,
        }
    }
}

impl Reader<'_> {
    /// `approvals:` (after `subagent_auto_approve`, whose `true` is the
    /// default mode `allow`; an explicit `approvals.mode` wins).
    pub(crate) fn approvals(&mut self, auto_approve: bool, out: &mut ApprovalPolicy) {
        if auto_approve {
            out.mode = ApprovalAction::Allow;
        }
        let Some(section) = self.v.get("approvals").filter(|s| !s.is_null()) else { return };
        if !section.is_mapping() {
            self.invalid("approvals", section, "a mapping {mode, timeout_s, rules}");
            out.mode = ApprovalAction::Deny;
            return;
        }
        for key in section.as_mapping().into_iter().flat_map(|m| m.keys()) {
            let name = key.as_str().unwrap_or_default();
            if !matches!(name, "mode" | "timeout_s" | "rules" | "allow_bypass") {
                // A misspelt key (`rule:`) must not silently mean "no rules".
                self.invalid(
                    &format!("approvals.{name}"),
                    key,
                    "one of mode, timeout_s, rules, allow_bypass",
                );
            }
        }
        match section.get("mode") {
            None | Some(Value::Null) => {}
            Some(v) => match v.as_str().and_then(ApprovalAction::parse) {
                Some(mode) => out.mode = mode,
                None => {
                    self.invalid("approvals.mode", v, "ask, allow or deny");
                    out.mode = ApprovalAction::Deny;
                }
            },
        }
        match section.get("timeout_s") {
            None | Some(Value::Null) => {}
            Some(Value::Number(n)) if n.as_u64().is_some_and(|t| t > 0) => {
                out.timeout_s = n.as_u64().unwrap_or(out.timeout_s);
            }
            Some(v) => self.invalid("approvals.timeout_s", v, "a whole number of seconds > 0"),
        }
        match section.get("allow_bypass") {
            None | Some(Value::Null) => {}
            Some(Value::Bool(b)) => out.allow_bypass = *b,
            Some(v) => self.invalid("approvals.allow_bypass", v, "true or false"),
        }
        match section.get("rules") {
            None | Some(Value::Null) => {}
            Some(Value::Sequence(items)) => {
                for (i, item) in items.iter().enumerate() {
                    if let Some(rule) = self.rule(i, item) {
                        out.rules.push(rule);
                    }
                }
            }
            Some(v) => {
                self.invalid("approvals.rules", v, "a list of {tool, command|path, decision}")
            }
        }
    }

    /// One rule, or `None` (an error recorded, naming the key) when it is
    /// invalid.
    fn rule(&mut self, i: usize, item: &Value) -> Option<ApprovalRule> {
        let key = |k: &str| format!("approvals.rules[{i}].{k}");
        if !item.is_mapping() {
            self.invalid(&format!("approvals.rules[{i}]"), item, "a mapping {tool, decision}");
            return None;
        }
        let mut ok = true;
        let tool = match item.get("tool").and_then(Value::as_str).map(str::trim) {
            Some(t) if names_a_tool(t) => t.to_owned(),
            _ => {
                let shown_tool = item.get("tool").cloned().unwrap_or(Value::Null);
                self.invalid(
                    &key("tool"),
                    &shown_tool,
                    &format!(
                        "a glob naming a tool ({}) or mcp__SERVER__TOOL",
                        TOOL_NAMES.join(", ")
                    ),
                );
                ok = false;
                String::new()
            }
        };
        let mut glob = |k: &str, this: &mut Self| -> Option<String> {
            let v = item.get(k).filter(|v| !v.is_null())?;
            match v.as_str().map(str::trim) {
                Some(text) if !text.is_empty() && Glob::new(text).is_ok() => Some(text.to_owned()),
                _ => {
                    this.invalid(&key(k), v, "a valid glob");
                    ok = false;
                    None
                }
            }
        };
        let command = glob("command", self);
        let path = glob("path", self);
        let decision =
            match item.get("decision").and_then(Value::as_str).and_then(ApprovalAction::parse) {
                Some(d) => d,
                None => {
                    let v = item.get("decision").cloned().unwrap_or(Value::Null);
                    self.invalid(&key("decision"), &v, "ask, allow or deny");
                    ok = false;
                    ApprovalAction::Deny
                }
            };
        for unknown in item.as_mapping().into_iter().flat_map(|m| m.keys()) {
            let name = unknown.as_str().unwrap_or_default();
            if !matches!(name, "tool" | "command" | "path" | "decision") {
                // A misspelt `comand:` would make the rule match every call.
                self.invalid(&key(name), unknown, "one of tool, command, path, decision");
                ok = false;
            }
        }
        if ok && command.is_some() && !matches_any(&tool, &["terminal"]) {
            let v = item.get("command").cloned().unwrap_or(Value::Null);
            self.invalid(&key("command"), &v, "given only with a tool glob that names terminal");
            ok = false;
        }
        if ok && path.is_some() && !tool.starts_with("mcp__") && !matches_any(&tool, PATH_TOOLS) {
            let v = item.get("path").cloned().unwrap_or(Value::Null);
            self.invalid(&key("path"), &v, "given only with a file tool or an MCP tool");
            ok = false;
        }
        ok.then_some(ApprovalRule { tool, command, path, decision })
    }
}

/// The built-in tools that take a `path`.
const PATH_TOOLS: &[&str] = &["read_file", "search_files", "write_file", "patch"];

/// Whether the glob `pattern` matches any of `names`.
fn matches_any(pattern: &str, names: &[&str]) -> bool {
    Glob::new(pattern).is_ok_and(|g| {
        let m = g.compile_matcher();
        names.iter().any(|n| m.is_match(n))
    })
}

/// Whether a tool glob can match a built-in tool or an MCP tool.
fn names_a_tool(pattern: &str) -> bool {
    let Ok(glob) = Glob::new(pattern) else { return false };
    let matcher = glob.compile_matcher();
    pattern.starts_with("mcp__") || TOOL_NAMES.iter().any(|name| matcher.is_match(name))
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::{ApprovalAction, ApprovalRule};
    use crate::LoadedConfig;

    fn load(yaml: &str) -> LoadedConfig {
        LoadedConfig::from_yaml(yaml, Path::new("/home/me/.hermes/config.yaml"))
    }

    #[test]
    fn the_issue_s_example_reads_as_written() {
        let c = load(
            "delegation:\n  approvals:\n    mode: ask\n    timeout_s: 2\n    rules:\n\
             \x20     - {tool: terminal, command: \"git status*\", decision: allow}\n\
             \x20     - {tool: terminal, command: \"npm publish*\", decision: deny}\n\
             \x20     - {tool: write_file, path: \"docs/**\", decision: allow}\n\
             \x20     - {tool: \"mcp__github__*\", decision: ask}\n",
        );
        assert!(c.errors.is_empty() && c.warnings.is_empty(), "{c:?}");
        let a = &c.delegation.approvals;
        assert_eq!((a.mode, a.timeout_s, a.rules.len()), (ApprovalAction::Ask, 2, 4));
        assert_eq!(
            a.rules[2],
            ApprovalRule {
                tool: "write_file".into(),
                command: None,
                path: Some("docs/**".into()),
                decision: ApprovalAction::Allow,
            }
        );
    }

    #[test]
    fn hermes_s_auto_approve_is_mode_allow_and_an_explicit_mode_wins() {
        let auto = load("delegation:\n  subagent_auto_approve: true\n");
        assert_eq!(auto.delegation.approvals.mode, ApprovalAction::Allow);
        let both = load("delegation:\n  subagent_auto_approve: true\n  approvals: {mode: deny}\n");
        assert_eq!(both.delegation.approvals.mode, ApprovalAction::Deny);
        assert_eq!(load("").delegation.approvals.mode, ApprovalAction::Ask);
    }

    #[test]
    fn a_bad_rule_is_an_error_naming_its_key_and_never_a_dropped_rule() {
        let cases = [
            ("{tool: termnal, decision: allow}", "approvals.rules[0].tool"),
            ("{tool: terminal, command: \"a[\", decision: allow}", "approvals.rules[0].command"),
            ("{tool: write_file, path: \"{docs\", decision: allow}", "approvals.rules[0].path"),
            ("{tool: terminal, decision: maybe}", "approvals.rules[0].decision"),
            ("{tool: terminal}", "approvals.rules[0].decision"),
            ("terminal", "approvals.rules[0]"),
            (
                "{tool: terminal, comand: \"git status*\", decision: allow}",
                "approvals.rules[0].comand",
            ),
            ("{tool: write_file, command: \"x*\", decision: allow}", "approvals.rules[0].command"),
            ("{tool: terminal, path: \"docs/**\", decision: allow}", "approvals.rules[0].path"),
        ];
        for (rule, key) in cases {
            let c = load(&format!("delegation:\n  approvals:\n    rules:\n      - {rule}\n"));
            assert_eq!(c.errors.len(), 1, "{rule}: {:?}", c.errors);
            assert!(c.errors[0].contains(&format!("delegation.{key} =")), "{}", c.errors[0]);
            assert!(c.errors[0].contains("config.yaml"), "{}", c.errors[0]);
            assert!(c.delegation.approvals.rules.is_empty());
        }
        let typo = load(
            "delegation:\n  approvals:\n    rule:\n      - {tool: terminal, decision: allow}\n",
        );
        assert!(
            typo.errors.iter().any(|e| e.contains("delegation.approvals.rule =")),
            "{:?}",
            typo.errors
        );
        let bad_mode = load("delegation:\n  approvals: {mode: sometimes}\n");
        assert!(bad_mode.errors[0].contains("delegation.approvals.mode = \"sometimes\""));
        assert_eq!(bad_mode.delegation.approvals.mode, ApprovalAction::Deny);
    }
}
