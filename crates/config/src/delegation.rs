//! The `delegation:` section: the children's model and its key, limits,
//! retention, toolsets, the terminal, prices and the budget.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use secrecy::{ExposeSecret, SecretString};
use serde_yaml_ng::Value;

use retinue_core::{BudgetLimit, RetentionPolicy};

use crate::LoadedConfig;
use crate::reader::Reader;

/// An API key: a [`secrecy::SecretString`] that has no `Display`, prints
/// as `[redacted]` in `Debug`, is never serialised, and is zeroed on drop.
/// Read it only at the moment it is sent ([`ApiKey::expose`]).
#[derive(Clone, Default)]
pub struct ApiKey(Option<SecretString>);

impl ApiKey {
    /// A key; an empty text is no key.
    pub fn new(key: impl Into<String>) -> ApiKey {
        let key: String = key.into();
        if key.is_empty() { ApiKey(None) } else { ApiKey(Some(SecretString::from(key))) }
    }

    /// Whether no key is set.
    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    /// The key's text, for the one place that sends it; `None` when unset.
    pub fn expose(&self) -> Option<&str> {
        self.0.as_ref().map(ExposeSecret::expose_secret)
    }
}

impl PartialEq for ApiKey {
    fn eq(&self, other: &ApiKey) -> bool {
        self.expose() == other.expose()
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.is_empty() { "[none]" } else { "[redacted]" })
    }
}

/// One model's price (`delegation.pricing.MODEL`), in US dollars per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ModelPrice {
    /// Prompt tokens not served from the cache.
    pub input_per_mtok: f64,
    /// Completion tokens (reasoning included).
    pub output_per_mtok: f64,
    /// Cached prompt tokens; `None` bills them at `input_per_mtok`.
    pub cached_input_per_mtok: Option<f64>,
}

/// The `delegation:` section, every key with its default (semantics §8).
///
/// `Debug` never prints the API key (it shows whether one is set).
#[derive(Clone, PartialEq)]
pub struct DelegationConfig {
    /// Child model; empty = inherit the parent's.
    pub model: String,
    /// Child provider; empty = inherit.
    pub provider: String,
    /// Child base URL; empty = inherit.
    pub base_url: String,
    /// Child API key; never logged or stored.
    pub api_key: ApiKey,
    /// The environment variable holding the API key when `api_key` is empty;
    /// empty = `OPENAI_API_KEY`.
    pub api_key_env: String,
    /// Whether children stream model responses (server-sent events).
    pub stream: bool,
    /// `max_completion_tokens`: the most completion tokens one model call
    /// may produce under a budget (its reservation's ceiling, sent as the
    /// call's bound); 0 = only what the budget leaves.
    pub max_completion_tokens: u64,
    /// `allow_insecure_http`: send the API key over plain `http://` to a
    /// host that is not loopback (refused by default).
    pub allow_insecure_http: bool,
    /// Prices per model (`delegation.pricing: {MODEL: {input_per_mtok,
    /// output_per_mtok, cached_input_per_mtok}}`), used when the provider
    /// reports no cost.
    pub pricing: BTreeMap<String, ModelPrice>,
    /// `chat_completions`, `codex_responses`, `anthropic_messages` or empty.
    pub api_mode: String,
    /// `completion_limit_field`: the request field that bounds a model
    /// call's completion — `max_completion_tokens` (OpenAI's current name)
    /// or `max_tokens` (older OpenAI-compatible servers); empty: the
    /// provider's default.
    pub completion_limit_field: String,
    /// Reasoning effort; empty = inherit, `"off"` when YAML says `false`.
    pub reasoning_effort: String,
    /// Whether children keep the parent's MCP toolsets.
    pub inherit_mcp_toolsets: bool,
    /// Iteration budget of a child.
    pub max_iterations: u32,
    /// Summary budget in characters; 0 = off.
    pub max_summary_chars: usize,
    /// Per-child wall-clock timeout; 0 = none, else at least 30.
    pub child_timeout_seconds: f64,
    /// Children run in parallel per batch, and background slots per process.
    pub max_concurrent_children: usize,
    /// Maximum delegation depth.
    pub max_spawn_depth: u32,
    /// `isolation`: `none` (children share the workspace) or `worktree`
    /// (a git worktree each).
    pub isolation: retinue_core::run::IsolationMode,
    /// Whether the `orchestrator` role is allowed.
    pub orchestrator_enabled: bool,
    /// hermes's `subagent_auto_approve`: `true` makes approvals' default
    /// mode `allow`.
    pub subagent_auto_approve: bool,
    /// `delegation.approvals`: which calls wait for a human.
    pub approvals: crate::ApprovalPolicy,
    /// Retained units kept addressable (floor 1).
    pub max_retained: u32,
    /// Hours a retained child stays addressable (floor 1.0).
    pub retained_ttl_hours: f64,
    /// `delegation.budget: {max_cost_usd, max_tokens}`: the spending cap of a
    /// whole compression lineage, children and follow-ups included
    /// (absent = unlimited).
    pub budget: BudgetLimit,
    /// `delegation.max_resume_tokens`: a follow-up whose resume would send
    /// more input tokens is refused; 0 = off.
    pub max_resume_tokens: u64,
    /// `delegation.toolsets`: the toolsets a child may get (`read`, `file`,
    /// `terminal`, `mcp-<server>`, `delegation`); a call can only narrow them.
    pub toolsets: Vec<String>,
    /// `delegation.terminal`: the `terminal` toolset's sandbox.
    pub terminal: TerminalConfig,
    /// `delegation.max_tool_output_chars`: the most tool output one run may
    /// feed back to its model, all calls together; later results are cut.
    pub max_tool_output_chars: usize,
}

/// `delegation.terminal`: how a child's `terminal` commands run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TerminalConfig {
    /// `network: true` lets commands reach the network (off by default).
    pub network: bool,
    /// `sandbox: off` runs commands without Landlock and namespaces where
    /// the sandbox cannot be set up (the default refuses the toolset then).
    pub sandbox: bool,
    /// `timeout`: a command's default timeout in seconds (180); a call may
    /// ask for less or more, up to `max_timeout`.
    pub timeout_seconds: u64,
    /// `max_timeout`: the most a call may ask for (600).
    pub max_timeout_seconds: u64,
}

impl Default for TerminalConfig {
    fn default() -> Self {
        TerminalConfig {
            network: false,
            sandbox: true,
            timeout_seconds: 180,
            max_timeout_seconds: 600,
        }
    }
}

impl DelegationConfig {
    /// `base_url` as records keep it (redacted, `None` when unset): never a
    /// credential in a column, never an address a run would call.
    pub fn recorded_endpoint(&self) -> Option<String> {
        Some(self.base_url.trim()).filter(|u| !u.is_empty()).map(retinue_core::redact_endpoint)
    }

    /// The retention policy a backend is opened with.
    pub fn retention(&self) -> RetentionPolicy {
        RetentionPolicy { max_retained: self.max_retained, ttl_hours: self.retained_ttl_hours }
    }
}

impl Default for DelegationConfig {
    fn default() -> Self {
        DelegationConfig {
            model: String::new(),
            provider: String::new(),
            base_url: String::new(),
            api_key: ApiKey::default(),
            api_key_env: String::new(),
            stream: false,
            allow_insecure_http: false,
            max_completion_tokens: 16_384,
            pricing: BTreeMap::new(),
            api_mode: String::new(),
            completion_limit_field: String::new(),
            reasoning_effort: String::new(),
            inherit_mcp_toolsets: true,
            max_iterations: 50,
            max_summary_chars: 24_000,
            child_timeout_seconds: 0.0,
            max_concurrent_children: 3,
            max_spawn_depth: 1,
            isolation: retinue_core::run::IsolationMode::None,
            orchestrator_enabled: true,
            subagent_auto_approve: false,
            approvals: crate::ApprovalPolicy::default(),
            max_retained: 10,
            retained_ttl_hours: 72.0,
            budget: BudgetLimit::default(),
            max_resume_tokens: 0,
            toolsets: vec!["read".to_owned()],
            terminal: TerminalConfig::default(),
            max_tool_output_chars: 400_000,
        }
    }
}

impl fmt::Debug for DelegationConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DelegationConfig")
            .field("model", &self.model)
            .field("provider", &self.provider)
            .field("base_url", &retinue_core::redact_endpoint(&self.base_url))
            .field("api_key", &self.api_key)
            .field("api_key_env", &self.api_key_env)
            .field("stream", &self.stream)
            .field("allow_insecure_http", &self.allow_insecure_http)
            .field("max_completion_tokens", &self.max_completion_tokens)
            .field("pricing", &self.pricing)
            .field("api_mode", &self.api_mode)
            .field("completion_limit_field", &self.completion_limit_field)
            .field("reasoning_effort", &self.reasoning_effort)
            .field("inherit_mcp_toolsets", &self.inherit_mcp_toolsets)
            .field("max_iterations", &self.max_iterations)
            .field("max_summary_chars", &self.max_summary_chars)
            .field("child_timeout_seconds", &self.child_timeout_seconds)
            .field("max_concurrent_children", &self.max_concurrent_children)
            .field("max_spawn_depth", &self.max_spawn_depth)
            .field("isolation", &self.isolation)
            .field("orchestrator_enabled", &self.orchestrator_enabled)
            .field("subagent_auto_approve", &self.subagent_auto_approve)
            .field("approvals", &self.approvals)
            .field("max_retained", &self.max_retained)
            .field("retained_ttl_hours", &self.retained_ttl_hours)
            .field("budget", &self.budget)
            .field("max_resume_tokens", &self.max_resume_tokens)
            .field("toolsets", &self.toolsets)
            .field("terminal", &self.terminal)
            .field("max_tool_output_chars", &self.max_tool_output_chars)
            .finish()
    }
}

impl LoadedConfig {
    pub(crate) fn read_delegation(&mut self, v: &Value, origin: &Path) {
        if v.is_null() {
            return;
        }
        if !v.is_mapping() {
            self.warn(format!(
                "{}: `delegation` is not a mapping; using defaults",
                origin.display()
            ));
            return;
        }
        let mut r = Reader { v, origin, warnings: Vec::new(), errors: Vec::new() };
        let d = &mut self.delegation;
        read_model(&mut r, d, v);
        r.boolean("inherit_mcp_toolsets", &mut d.inherit_mcp_toolsets);
        r.uint("max_iterations", &mut d.max_iterations);
        r.usize("max_summary_chars", &mut d.max_summary_chars);
        r.float("child_timeout_seconds", &mut d.child_timeout_seconds);
        if d.child_timeout_seconds < 0.0 {
            r.bad("child_timeout_seconds");
            d.child_timeout_seconds = 0.0;
        } else if d.child_timeout_seconds > 0.0 {
            d.child_timeout_seconds = d.child_timeout_seconds.max(30.0);
        }
        let explicit_children = v.get("max_concurrent_children").is_some();
        r.usize("max_concurrent_children", &mut d.max_concurrent_children);
        if !explicit_children && let Ok(env) = std::env::var("DELEGATION_MAX_CONCURRENT_CHILDREN") {
            match env.trim().parse::<usize>() {
                Ok(n) => d.max_concurrent_children = n,
                Err(_) => r.warnings.push(
                    "DELEGATION_MAX_CONCURRENT_CHILDREN is not an integer; ignored".to_owned(),
                ),
            }
        }
        d.max_concurrent_children = d.max_concurrent_children.max(1);
        if d.max_concurrent_children > 10 {
            r.warnings.push(format!(
                "{}: delegation.max_concurrent_children = {} is above 10",
                origin.display(),
                d.max_concurrent_children
            ));
        }
        r.uint("max_spawn_depth", &mut d.max_spawn_depth);
        d.max_spawn_depth = d.max_spawn_depth.max(1);
        let mut isolation = String::new();
        r.string("isolation", &mut isolation);
        if !isolation.is_empty() {
            match retinue_core::run::IsolationMode::parse(&isolation) {
                Some(mode) => d.isolation = mode,
                None => r.errors.push(format!(
                    "{}: delegation.isolation must be `none` or `worktree`, not `{isolation}`",
                    origin.display()
                )),
            }
        }
        r.boolean("orchestrator_enabled", &mut d.orchestrator_enabled);
        r.boolean("subagent_auto_approve", &mut d.subagent_auto_approve);
        r.approvals(d.subagent_auto_approve, &mut d.approvals);
        r.uint("max_retained", &mut d.max_retained);
        d.max_retained = d.max_retained.max(1);
        r.float("retained_ttl_hours", &mut d.retained_ttl_hours);
        d.retained_ttl_hours = d.retained_ttl_hours.max(1.0);
        r.toolsets(&mut d.toolsets);
        r.terminal(&mut d.terminal);
        r.usize("max_tool_output_chars", &mut d.max_tool_output_chars);
        if v.get("max_async_children").is_some() {
            r.warnings.push(format!(
                "{}: delegation.max_async_children is deprecated; use max_concurrent_children",
                origin.display()
            ));
        }
        let warnings = r.warnings;
        self.errors.extend(r.errors);
        for w in warnings {
            self.warn(w);
        }
    }
}

/// The keys of the children's model endpoint: model, key, streaming,
/// limits, prices, budget, API mode.
fn read_model(r: &mut Reader<'_>, d: &mut DelegationConfig, v: &Value) {
    r.string("model", &mut d.model);
    r.string("provider", &mut d.provider);
    r.string("base_url", &mut d.base_url);
    let mut key = String::new();
    r.string("api_key", &mut key);
    d.api_key = ApiKey::new(key);
    r.string("api_key_env", &mut d.api_key_env);
    r.boolean("stream", &mut d.stream);
    r.boolean("allow_insecure_http", &mut d.allow_insecure_http);
    if let Some(n) = r.u64("max_completion_tokens") {
        d.max_completion_tokens = n;
    }
    r.pricing(&mut d.pricing);
    r.budget(&mut d.budget);
    if let Some(n) = r.u64("max_resume_tokens") {
        d.max_resume_tokens = n;
    }
    r.string("api_mode", &mut d.api_mode);
    if !d.api_mode.is_empty()
        && !matches!(
            d.api_mode.as_str(),
            "chat_completions" | "codex_responses" | "anthropic_messages"
        )
    {
        r.bad("api_mode");
        d.api_mode.clear();
    }
    r.string("completion_limit_field", &mut d.completion_limit_field);
    if !matches!(d.completion_limit_field.as_str(), "" | "max_completion_tokens" | "max_tokens") {
        r.bad("completion_limit_field");
        d.completion_limit_field.clear();
    }
    match v.get("reasoning_effort") {
        Some(Value::Bool(false)) => d.reasoning_effort = "off".to_owned(),
        _ => r.string("reasoning_effort", &mut d.reasoning_effort),
    }
}

/// The `delegation:` keys that are more than one value.
impl Reader<'_> {
    /// `budget: {max_cost_usd, max_tokens}`: a finite number `>= 0` of
    /// dollars, a whole number `>= 0` of tokens. Anything else is an error
    /// (never "no limit"): the measure is kept in a form that refuses every
    /// delegation (an invalid dollar limit; zero tokens).
    pub(crate) fn budget(&mut self, out: &mut BudgetLimit) {
        let Some(section) = self.v.get("budget") else { return };
        if section.is_null() {
            return;
        }
        if !section.is_mapping() {
            self.invalid("budget", section, "a mapping {max_cost_usd, max_tokens}");
            out.max_tokens = Some(0);
            return;
        }
        match section.get("max_cost_usd") {
            None | Some(Value::Null) => {}
            Some(Value::Number(n)) if n.as_f64().is_some_and(|f| f.is_finite() && f >= 0.0) => {
                out.max_cost_usd = n.as_f64();
            }
            Some(v) => {
                self.invalid("budget.max_cost_usd", v, "a finite number >= 0");
                out.max_cost_usd = Some(f64::NAN);
            }
        }
        match section.get("max_tokens") {
            None | Some(Value::Null) => {}
            Some(Value::Number(n)) if n.as_u64().is_some() => out.max_tokens = n.as_u64(),
            Some(v) => {
                self.invalid("budget.max_tokens", v, "a whole number >= 0");
                out.max_tokens = Some(0);
            }
        }
    }

    /// `toolsets: [NAME, ...]` (or one comma-separated string).
    pub(crate) fn toolsets(&mut self, out: &mut Vec<String>) {
        match self.v.get("toolsets") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => {
                *out = s
                    .split(',')
                    .map(str::trim)
                    .filter(|t| !t.is_empty())
                    .map(str::to_owned)
                    .collect();
            }
            Some(Value::Sequence(items)) => {
                let names: Option<Vec<String>> =
                    items.iter().map(|i| i.as_str().map(|s| s.trim().to_owned())).collect();
                match names {
                    Some(names) => *out = names.into_iter().filter(|t| !t.is_empty()).collect(),
                    None => self.bad("toolsets"),
                }
            }
            Some(_) => self.bad("toolsets"),
        }
    }

    /// `terminal: {network, sandbox, timeout, max_timeout}`. A `sandbox`
    /// that is neither on nor off is an error (never read as "off").
    pub(crate) fn terminal(&mut self, out: &mut TerminalConfig) {
        let Some(section) = self.v.get("terminal").filter(|s| !s.is_null()) else { return };
        if !section.is_mapping() {
            self.bad("terminal");
            return;
        }
        match section.get("network") {
            None | Some(Value::Null) => {}
            Some(Value::Bool(b)) => out.network = *b,
            Some(_) => self.bad("terminal.network"),
        }
        match section.get("sandbox") {
            None | Some(Value::Null) => {}
            Some(Value::Bool(b)) => out.sandbox = *b,
            Some(Value::String(s)) if matches!(s.trim(), "off" | "false" | "no") => {
                out.sandbox = false
            }
            Some(Value::String(s)) if matches!(s.trim(), "on" | "true" | "yes" | "required") => {
                out.sandbox = true;
            }
            Some(v) => {
                self.invalid("terminal.sandbox", v, "`on` or `off`");
                out.sandbox = true;
            }
        }
        for (key, field) in
            [("timeout", &mut out.timeout_seconds), ("max_timeout", &mut out.max_timeout_seconds)]
        {
            match section.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::Number(n)) if n.as_u64().is_some_and(|t| t > 0) => {
                    *field = n.as_u64().unwrap_or(*field);
                }
                Some(_) => self.bad(&format!("terminal.{key}")),
            }
        }
        out.max_timeout_seconds = out.max_timeout_seconds.clamp(1, 86_400);
        out.timeout_seconds = out.timeout_seconds.min(out.max_timeout_seconds);
    }

    /// `pricing: {MODEL: {input_per_mtok, output_per_mtok, cached_input_per_mtok}}`;
    /// a model whose entry is not a mapping of non-negative numbers is skipped
    /// with a warning (never priced by a guess).
    pub(crate) fn pricing(&mut self, out: &mut BTreeMap<String, ModelPrice>) {
        let Some(section) = self.v.get("pricing") else { return };
        if section.is_null() {
            return;
        }
        let Some(models) = section.as_mapping() else {
            self.bad("pricing");
            return;
        };
        for (model, entry) in models {
            let name = match model {
                Value::String(s) => s.trim().to_owned(),
                Value::Number(n) => n.to_string(),
                _ => {
                    self.bad("pricing");
                    continue;
                }
            };
            let number = |key: &str| -> Result<Option<f64>, ()> {
                match entry.get(key) {
                    None | Some(Value::Null) => Ok(None),
                    Some(Value::Number(n)) => match n.as_f64() {
                        Some(f) if f.is_finite() && f >= 0.0 => Ok(Some(f)),
                        _ => Err(()),
                    },
                    Some(_) => Err(()),
                }
            };
            let parsed = if entry.is_mapping() {
                match (
                    number("input_per_mtok"),
                    number("output_per_mtok"),
                    number("cached_input_per_mtok"),
                ) {
                    (Ok(Some(input)), Ok(Some(output)), Ok(cached)) => Some(ModelPrice {
                        input_per_mtok: input,
                        output_per_mtok: output,
                        cached_input_per_mtok: cached,
                    }),
                    _ => None,
                }
            } else {
                None
            };
            match parsed {
                Some(price) if !name.is_empty() => {
                    out.insert(name, price);
                }
                _ => self.warnings.push(format!(
                    "{}: delegation.pricing.{name} needs non-negative numbers input_per_mtok and \
                     output_per_mtok (cached_input_per_mtok optional); model left unpriced",
                    self.origin.display()
                )),
            }
        }
    }
}
