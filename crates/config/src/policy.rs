//! The orchestrator's policy: what the delegate core needs of `delegation:`
//! and nothing else. Configuration is read once per process and handed out
//! by consumer — this to the orchestrator, the endpoint and its key to the
//! runtime (its own `RuntimeConfig`), `terminal` to the toolbox, the MCP
//! servers to the tools, retention to the backend — so the orchestrator
//! cannot hold, log or forward a credential: it never has one.

use retinue_core::{BudgetLimit, RetentionPolicy};

use crate::DelegationConfig;

/// The delegate core's part of `delegation:` (see [`DelegationConfig`] for
/// each key's meaning and default). No API key, no endpoint to call: the
/// endpoint is here only as the manifest records it (redacted).
#[derive(Debug, Clone, PartialEq)]
pub struct OrchestratorPolicy {
    /// Child model recorded and asked for; empty = the parent's.
    pub model: String,
    /// Child provider; empty = the parent's.
    pub provider: String,
    /// The API mode recorded with each child; empty = the runtime's.
    pub api_mode: String,
    /// The endpoint as records keep it ([`DelegationConfig::recorded_endpoint`]).
    pub recorded_endpoint: Option<String>,
    /// Iteration budget of a child.
    pub max_iterations: u32,
    /// Summary budget in characters; 0 = off.
    pub max_summary_chars: usize,
    /// Per-child wall-clock timeout; 0 = none.
    pub child_timeout_seconds: f64,
    /// Children run in parallel per batch, and background slots per process.
    pub max_concurrent_children: usize,
    /// Maximum delegation depth.
    pub max_spawn_depth: u32,
    /// Whether the `orchestrator` role is allowed.
    pub orchestrator_enabled: bool,
    /// Retained units kept addressable.
    pub max_retained: u32,
    /// Hours a retained child stays addressable.
    pub retained_ttl_hours: f64,
    /// The spending cap of a whole subagent tree.
    pub budget: BudgetLimit,
    /// A follow-up whose resume would send more input tokens is refused; 0 = off.
    pub max_resume_tokens: u64,
    /// The toolsets a child may get; a call can only narrow them.
    pub toolsets: Vec<String>,
    /// Whether children keep the parent's MCP toolsets.
    pub inherit_mcp_toolsets: bool,
    /// `delegation.approvals.timeout_s`: how long a request waits for a
    /// human before it expires.
    pub approval_timeout_s: u64,
    /// `delegation.isolation`: the children's isolation when a call names none.
    pub isolation: retinue_core::run::IsolationMode,
}

impl OrchestratorPolicy {
    /// The retention policy its schema texts name.
    pub fn retention(&self) -> RetentionPolicy {
        RetentionPolicy { max_retained: self.max_retained, ttl_hours: self.retained_ttl_hours }
    }
}

impl From<&DelegationConfig> for OrchestratorPolicy {
    fn from(c: &DelegationConfig) -> Self {
        OrchestratorPolicy {
            model: c.model.clone(),
            provider: c.provider.clone(),
            api_mode: c.api_mode.clone(),
            recorded_endpoint: c.recorded_endpoint(),
            max_iterations: c.max_iterations,
            max_summary_chars: c.max_summary_chars,
            child_timeout_seconds: c.child_timeout_seconds,
            max_concurrent_children: c.max_concurrent_children,
            max_spawn_depth: c.max_spawn_depth,
            orchestrator_enabled: c.orchestrator_enabled,
            max_retained: c.max_retained,
            retained_ttl_hours: c.retained_ttl_hours,
            budget: c.budget,
            max_resume_tokens: c.max_resume_tokens,
            toolsets: c.toolsets.clone(),
            inherit_mcp_toolsets: c.inherit_mcp_toolsets,
            approval_timeout_s: c.approvals.timeout_s,
            isolation: c.isolation,
        }
    }
}

impl From<DelegationConfig> for OrchestratorPolicy {
    fn from(c: DelegationConfig) -> Self {
        OrchestratorPolicy::from(&c)
    }
}

impl Default for OrchestratorPolicy {
    fn default() -> Self {
        OrchestratorPolicy::from(&DelegationConfig::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ApiKey;

    #[test]
    fn the_policy_keeps_the_limits_and_drops_the_key_and_the_address_to_call() {
        let config = DelegationConfig {
            api_key: ApiKey::new("sk-secret"),
            base_url: "https://user:pw@models.example/v1?api_key=sk-secret".to_owned(),
            max_spawn_depth: 3,
            toolsets: vec!["read".to_owned()],
            ..DelegationConfig::default()
        };
        let policy = OrchestratorPolicy::from(&config);
        assert_eq!(policy.max_spawn_depth, 3);
        assert_eq!(policy.toolsets, ["read"]);
        let shown = format!("{policy:?}");
        assert!(!shown.contains("sk-secret") && !shown.contains("pw@"), "{shown}");
        assert_eq!(policy.recorded_endpoint, config.recorded_endpoint());
    }
}
