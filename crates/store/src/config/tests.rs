//! Unit tests of configuration loading.

use super::*;

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
