//! Unit tests of configuration loading.

use super::*;
use retinue_core::{JournalMode, Synchronous};

fn load(text: &str) -> LoadedConfig {
    LoadedConfig::from_yaml(text, Path::new("/h/config.yaml"))
}

#[test]
fn config_defaults_include_retention_knobs() {
    let d = DelegationConfig::default();
    assert_eq!(d.max_retained, 10);
    assert!((d.retained_ttl_hours - 72.0).abs() < f64::EPSILON);
    assert_eq!(d.max_concurrent_children, 3);
    assert_eq!(d.max_spawn_depth, 1);
    assert_eq!(d.max_iterations, 50);
    assert_eq!(d.max_summary_chars, 24_000);
    assert!(d.orchestrator_enabled && d.inherit_mcp_toolsets && !d.subagent_auto_approve);
}

#[test]
fn missing_section_is_defaults_without_warning() {
    let c = load("other: 1\n");
    assert_eq!(c.delegation, DelegationConfig::default());
    assert!(c.warnings.is_empty());
}

#[test]
fn values_floors_and_mistyped_keys() {
    let c = load(
        "delegation:\n  max_retained: 0\n  retained_ttl_hours: 0.5\n  max_spawn_depth: 3\n  \
         child_timeout_seconds: 5\n  max_iterations: lots\n  reasoning_effort: false\n  unknown_key: 1\n",
    );
    assert_eq!(c.delegation.max_retained, 1);
    assert!((c.delegation.retained_ttl_hours - 1.0).abs() < f64::EPSILON);
    assert_eq!(c.delegation.max_spawn_depth, 3);
    assert!((c.delegation.child_timeout_seconds - 30.0).abs() < f64::EPSILON);
    assert_eq!(c.delegation.max_iterations, 50);
    assert_eq!(c.delegation.reasoning_effort, "off");
    assert_eq!(c.warnings.len(), 1, "{:?}", c.warnings);
    assert!(c.warnings[0].contains("/h/config.yaml") && c.warnings[0].contains("max_iterations"));
}

#[test]
fn malformed_yaml_warns_and_defaults() {
    let c = load("delegation: [unclosed\n");
    assert_eq!(c.delegation, DelegationConfig::default());
    assert_eq!(c.warnings.len(), 1);
    assert!(c.warnings[0].contains("malformed YAML"));
}

#[test]
fn database_section() {
    let c = load("database:\n  journal_mode: delete\n  synchronous: NORMAL\n");
    assert_eq!(c.database.journal_mode, JournalMode::Delete);
    assert_eq!(c.database.synchronous, Synchronous::Normal);
    assert_eq!(c.database.busy_timeout_seconds, None);
    let busy = load("database:\n  busy_timeout_seconds: 0.25\n");
    assert_eq!(busy.database.busy_timeout_seconds, Some(0.25));
    assert!(busy.warnings.is_empty());
    for bad in ["-1", "nope", "7200", ".nan"] {
        let c = load(&format!("database:\n  busy_timeout_seconds: {bad}\n"));
        assert_eq!(c.database.busy_timeout_seconds, None, "{bad}");
        assert!(c.warnings.iter().any(|w| w.contains("busy_timeout_seconds")), "{bad}");
    }
    let bad = load("database:\n  journal_mode: 3\n");
    assert_eq!(bad.database.journal_mode, JournalMode::Wal);
    assert_eq!(bad.warnings.len(), 1);
}

#[test]
fn deprecated_and_large_concurrency_warn() {
    let c = load("delegation:\n  max_async_children: 2\n  max_concurrent_children: 12\n");
    assert_eq!(c.delegation.max_concurrent_children, 12);
    assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
}

#[test]
fn runtime_keys_stream_api_key_env_and_pricing() {
    let c = load(
        "delegation:\n  stream: true\n  api_key_env: MY_KEY\n  api_key: sk-secret\n  pricing:\n    \
         gpt-x: {input_per_mtok: 2.5, output_per_mtok: 10, cached_input_per_mtok: 1.25}\n    \
         cheap: {input_per_mtok: 0.1, output_per_mtok: 0.2}\n    \
         broken: {input_per_mtok: -1, output_per_mtok: 1}\n    \
         words: free\n",
    );
    let d = &c.delegation;
    assert!(d.stream);
    assert_eq!(d.api_key_env, "MY_KEY");
    assert_eq!(
        d.pricing.get("gpt-x"),
        Some(&ModelPrice {
            input_per_mtok: 2.5,
            output_per_mtok: 10.0,
            cached_input_per_mtok: Some(1.25)
        })
    );
    assert_eq!(d.pricing.get("cheap").and_then(|p| p.cached_input_per_mtok), None);
    assert!(!d.pricing.contains_key("broken") && !d.pricing.contains_key("words"));
    assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
    assert!(c.warnings.iter().all(|w| w.contains("delegation.pricing.")));
    let shown = format!("{d:?}");
    assert!(!shown.contains("sk-secret") && shown.contains("[redacted]"), "{shown}");
}

#[test]
fn runtime_keys_default_off_and_mistyped_pricing_warns() {
    let d = DelegationConfig::default();
    assert!(!d.stream && d.api_key_env.is_empty() && d.pricing.is_empty());
    let c = load("delegation:\n  pricing: [1, 2]\n  stream: maybe\n");
    assert!(c.delegation.pricing.is_empty() && !c.delegation.stream);
    assert_eq!(c.warnings.len(), 2, "{:?}", c.warnings);
}

#[test]
fn budget_and_resume_guard() {
    let d = DelegationConfig::default();
    assert!(d.budget.is_unlimited() && d.max_resume_tokens == 0);
    let c = load(
        "delegation:\n  budget: {max_cost_usd: 2.5, max_tokens: 1000000}\n  max_resume_tokens: 50000\n",
    );
    assert_eq!(c.delegation.budget.max_cost_usd, Some(2.5));
    assert_eq!(c.delegation.budget.max_tokens, Some(1_000_000));
    assert_eq!(c.delegation.max_resume_tokens, 50_000);
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
    // Invalid budgets are errors naming key and value, and the limit kept
    // refuses (never "no limit").
    let bad = load("delegation:\n  budget: {max_cost_usd: lots, max_tokens: -3}\n");
    assert!(!bad.delegation.budget.is_unlimited());
    assert!(bad.delegation.budget.check().is_err());
    assert_eq!(bad.delegation.budget.max_tokens, Some(0));
    assert_eq!(bad.errors.len(), 2, "{:?}", bad.errors);
    assert!(
        bad.errors[0].contains("delegation.budget.max_cost_usd = \"lots\""),
        "{:?}",
        bad.errors
    );
    assert!(bad.errors[1].contains("delegation.budget.max_tokens = -3"), "{:?}", bad.errors);
}

#[test]
fn every_invalid_budget_setting_fails_closed() {
    for (yaml, key, value) in [
        ("max_cost_usd: -5", "max_cost_usd", "-5"),
        ("max_cost_usd: .nan", "max_cost_usd", "NaN"),
        ("max_cost_usd: .inf", "max_cost_usd", "inf"),
        ("max_cost_usd: \"5\"", "max_cost_usd", "\"5\""),
        ("max_tokens: -100", "max_tokens", "-100"),
        ("max_tokens: 1.5", "max_tokens", "1.5"),
        ("max_tokens: \"100\"", "max_tokens", "\"100\""),
    ] {
        let c = load(&format!("delegation:\n  budget: {{{yaml}}}\n"));
        assert_eq!(c.errors.len(), 1, "{yaml}: {:?}", c.errors);
        let e = &c.errors[0];
        assert!(e.contains(&format!("delegation.budget.{key} = ")), "{yaml}: {e}");
        assert!(e.to_lowercase().contains(&value.to_lowercase()), "{yaml}: {e}");
        let b = c.delegation.budget;
        assert!(b.check().is_err() || b.max_tokens == Some(0), "{yaml} left {b:?}");
    }
    let c = load("delegation:\n  budget: 5\n");
    assert_eq!(c.errors.len(), 1, "{:?}", c.errors);
    assert_eq!(c.delegation.budget.max_tokens, Some(0));
    // A valid budget and none at all are not errors.
    assert!(load("delegation:\n  budget: {max_tokens: 0}\n").errors.is_empty());
    assert!(load("delegation:\n  model: m\n").errors.is_empty());
}
