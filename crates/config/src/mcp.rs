//! The top-level `mcp_servers:` section (hermes's format).

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use serde_yaml_ng::Value;

use crate::LoadedConfig;

/// One entry of the top-level `mcp_servers:` section (hermes's format):
/// a stdio server (`command`, `args`, `env`, `cwd`) or a streamable-HTTP
/// one (`url`, `headers`).
///
/// `Debug` never prints `env` or `headers` values (they hold credentials).
#[derive(Clone, PartialEq, Default)]
pub struct McpServerConfig {
    /// The server's name (the mapping key).
    pub name: String,
    /// The program of a stdio server.
    pub command: Option<String>,
    /// Its arguments.
    pub args: Vec<String>,
    /// Extra environment for a stdio server.
    pub env: BTreeMap<String, String>,
    /// Working directory of a stdio server.
    pub cwd: Option<String>,
    /// The endpoint of a streamable-HTTP server.
    pub url: Option<String>,
    /// HTTP headers (e.g. `Authorization`).
    pub headers: BTreeMap<String, String>,
    /// Seconds a tool call may take (hermes's `timeout`; default 120).
    pub timeout_seconds: f64,
    /// `tools.include`: only these tools (absent = all).
    pub include: Option<Vec<String>>,
    /// `tools.exclude`: never these tools.
    pub exclude: Vec<String>,
}

impl fmt::Debug for McpServerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("McpServerConfig")
            .field("name", &self.name)
            .field("command", &self.command)
            .field("args", &self.args)
            .field("env", &self.env.keys().collect::<Vec<_>>())
            .field("cwd", &self.cwd)
            .field("url", &self.url.as_deref().map(retinue_core::redact_endpoint))
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("timeout_seconds", &self.timeout_seconds)
            .field("include", &self.include)
            .field("exclude", &self.exclude)
            .finish()
    }
}

impl LoadedConfig {
    pub(crate) fn read_mcp_servers(&mut self, v: &Value, origin: &Path) {
        if v.is_null() {
            return;
        }
        let Some(servers) = v.as_mapping() else {
            self.warn(format!("{}: `mcp_servers` is not a mapping; ignored", origin.display()));
            return;
        };
        for (name, entry) in servers {
            let Some(name) = name.as_str().map(str::trim).filter(|n| !n.is_empty()) else {
                self.warn(format!(
                    "{}: an mcp_servers key is not a name; skipped",
                    origin.display()
                ));
                continue;
            };
            match mcp_server(name, entry) {
                Ok(Some(server)) => self.mcp_servers.push(server),
                Ok(None) => {}
                Err(why) => self.warn(format!(
                    "{}: mcp_servers.{name}: {why}; the server is skipped",
                    origin.display()
                )),
            }
        }
    }
}

/// One `mcp_servers` entry; `Ok(None)` for `enabled: false`.
fn mcp_server(name: &str, v: &Value) -> Result<Option<McpServerConfig>, String> {
    if !v.is_mapping() {
        return Err("not a mapping".to_owned());
    }
    if v.get("enabled").and_then(Value::as_bool) == Some(false) {
        return Ok(None);
    }
    let text = |key: &str| -> Result<Option<String>, String> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.trim().to_owned()).filter(|s| !s.is_empty())),
            Some(_) => Err(format!("`{key}` must be a string")),
        }
    };
    let list = |v: Option<&Value>, key: &str| -> Result<Option<Vec<String>>, String> {
        match v {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Sequence(items)) => items
                .iter()
                .map(|i| match i {
                    Value::String(s) => Ok(s.clone()),
                    Value::Number(n) => Ok(n.to_string()),
                    _ => Err(format!("`{key}` must be a list of strings")),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(_) => Err(format!("`{key}` must be a list of strings")),
        }
    };
    let map = |key: &str| -> Result<BTreeMap<String, String>, String> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(BTreeMap::new()),
            Some(Value::Mapping(m)) => m
                .iter()
                .map(|(k, val)| {
                    let k = k.as_str().ok_or_else(|| format!("`{key}` keys must be strings"))?;
                    let val = match val {
                        Value::String(s) => s.clone(),
                        Value::Number(n) => n.to_string(),
                        Value::Bool(b) => b.to_string(),
                        _ => return Err(format!("`{key}.{k}` must be a string")),
                    };
                    Ok((k.to_owned(), val))
                })
                .collect(),
            Some(_) => Err(format!("`{key}` must be a mapping")),
        }
    };
    let command = text("command")?;
    let url = text("url")?;
    if command.is_some() == url.is_some() {
        return Err("needs exactly one of `command` (stdio) or `url` (HTTP)".to_owned());
    }
    let timeout_seconds = match v.get("timeout") {
        None | Some(Value::Null) => 120.0,
        Some(Value::Number(n)) => match n.as_f64() {
            Some(f) if f.is_finite() && f > 0.0 => f.min(3600.0),
            _ => return Err("`timeout` must be a positive number of seconds".to_owned()),
        },
        Some(_) => return Err("`timeout` must be a positive number of seconds".to_owned()),
    };
    let tools = v.get("tools").filter(|t| !t.is_null());
    if tools.is_some_and(|t| !t.is_mapping()) {
        return Err("`tools` must be a mapping {include, exclude}".to_owned());
    }
    Ok(Some(McpServerConfig {
        name: name.to_owned(),
        command,
        args: list(v.get("args"), "args")?.unwrap_or_default(),
        env: map("env")?,
        cwd: text("cwd")?,
        url,
        headers: map("headers")?,
        timeout_seconds,
        include: list(tools.and_then(|t| t.get("include")), "tools.include")?,
        exclude: list(tools.and_then(|t| t.get("exclude")), "tools.exclude")?.unwrap_or_default(),
    }))
}
