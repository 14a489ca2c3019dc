//! `retinue-config`: the `delegation:`, `database:` and `mcp_servers:`
//! sections of `<HERMES_HOME>/config.yaml`, with hermes's defaults and floors.
//!
//! Configuration is its own concern, above the backends: a backend is
//! opened with a [`RetentionPolicy`](retinue_core::RetentionPolicy) and durability options, never with the
//! whole configuration, and the API key is an [`ApiKey`] (a secret type with
//! no `Display`, redacted `Debug`, never serialised).
//!
//! A missing file or section, bad YAML, or a mistyped key never fails: the
//! affected keys take their defaults and a warning naming the file and key is
//! recorded in [`LoadedConfig::warnings`] (the caller reports them, once).

mod approvals;
mod database;
mod delegation;
mod home;
mod mcp;
mod policy;
mod reader;

use std::path::Path;

use serde_yaml_ng::Value;

pub use approvals::{ApprovalAction, ApprovalPolicy, ApprovalRule};
pub use database::DatabaseConfig;
pub use delegation::{ApiKey, DelegationConfig, ModelPrice, TerminalConfig};
pub use home::{hermes_home, try_hermes_home, user_home};
pub use mcp::McpServerConfig;
pub use policy::OrchestratorPolicy;

/// The configuration as loaded, with the warnings loading produced.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LoadedConfig {
    /// The `delegation:` section.
    pub delegation: DelegationConfig,
    /// The `database:` section.
    pub database: DatabaseConfig,
    /// The `mcp_servers:` section, by name.
    pub mcp_servers: Vec<McpServerConfig>,
    /// Human-readable warnings (file and key named).
    pub warnings: Vec<String>,
    /// Settings that cannot be used safely (an invalid budget): each names
    /// the file, the key and the value. The setting is kept in a form that
    /// refuses (never "no limit"); a command that may spend refuses to run
    /// while any is present.
    pub errors: Vec<String>,
}

impl LoadedConfig {
    /// Loads `<home>/config.yaml`; never fails.
    pub fn load(home: &Path) -> LoadedConfig {
        let path = home.join("config.yaml");
        match std::fs::read_to_string(&path) {
            Ok(text) => LoadedConfig::from_yaml(&text, &path),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => LoadedConfig::default(),
            Err(e) => {
                let mut c = LoadedConfig::default();
                c.warn(format!("{}: cannot read ({e}); using defaults", path.display()));
                c
            }
        }
    }

    /// Parses YAML text; `origin` names the file in warnings.
    pub fn from_yaml(text: &str, origin: &Path) -> LoadedConfig {
        let mut c = LoadedConfig::default();
        let root: Value = match serde_yaml_ng::from_str(text) {
            Ok(v) => v,
            Err(e) => {
                c.warn(format!("{}: malformed YAML ({e}); using defaults", origin.display()));
                return c;
            }
        };
        if let Some(section) = root.get("delegation") {
            c.read_delegation(section, origin);
        }
        if let Some(section) = root.get("database") {
            c.read_database(section, origin);
        }
        if let Some(section) = root.get("mcp_servers") {
            c.read_mcp_servers(section, origin);
        }
        c
    }

    /// Records a warning; the caller reports [`LoadedConfig::warnings`]
    /// (once: loading never prints them itself).
    pub(crate) fn warn(&mut self, msg: String) {
        self.warnings.push(msg);
    }
}

#[cfg(test)]
mod tests;
