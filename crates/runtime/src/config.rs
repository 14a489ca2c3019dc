//! The runtime's configuration.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use retinue_config::{ApiKey, DelegationConfig, ModelPrice};

use crate::ChatError;

/// The `api_mode` values this runtime implements (empty means the first).
pub const SUPPORTED_API_MODES: &[&str] = &["chat_completions"];

/// The environment variable read for the API key when neither
/// `delegation.api_key` nor `delegation.api_key_env` is set.
pub const DEFAULT_KEY_ENV: &str = "OPENAI_API_KEY";

/// How failed model calls are retried (429, 5xx, timeouts, dropped connections).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Retries after the first attempt (0: no retry).
    pub max_retries: u32,
    /// The first backoff; doubled at each retry, with jitter.
    pub base_delay: Duration,
    /// The longest pause, `Retry-After` included.
    pub max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> RetryPolicy {
        RetryPolicy {
            max_retries: 4,
            base_delay: Duration::from_millis(500),
            max_delay: Duration::from_secs(30),
        }
    }
}

/// Everything the runtime needs to call the model.
///
/// `Debug` never prints the API key.
#[derive(Clone, PartialEq)]
pub struct RuntimeConfig {
    /// The API root, e.g. `https://api.openai.com/v1` (the runtime posts to
    /// `{base_url}/chat/completions`).
    pub base_url: String,
    /// The model.
    pub model: String,
    /// The bearer token (a secret: never printed, never serialised); empty
    /// sends no `Authorization` header (local servers).
    pub api_key: ApiKey,
    /// Where the key came from, for error texts (`delegation.api_key`,
    /// `environment variable OPENAI_API_KEY`, …).
    pub api_key_origin: String,
    /// `chat_completions` or empty; anything else is refused.
    pub api_mode: String,
    /// Stream responses (server-sent events).
    pub stream: bool,
    /// Model calls per run (a child's `max_iterations` overrides it when set).
    pub max_iterations: u32,
    /// Prices per model, used when the provider reports no cost.
    pub pricing: BTreeMap<String, ModelPrice>,
    /// Retries.
    pub retry: RetryPolicy,
    /// The longest one HTTP request may take (further bounded by the
    /// child's deadline).
    pub request_timeout: Duration,
    /// The request field bounding a call's completion under a budget:
    /// `max_completion_tokens` (default) or `max_tokens`.
    pub completion_limit_field: String,
    /// Send the key over plain `http://` to a non-loopback host
    /// (`delegation.allow_insecure_http`; refused by default).
    pub allow_insecure_http: bool,
    /// The most completion tokens one call may produce under a budget
    /// (`delegation.max_completion_tokens`; 0 = only what the budget leaves).
    pub completion_ceiling: u64,
    /// A model that overrides every child's (`--model`): otherwise a
    /// child's own model (a follow-up's stored one), else `model`.
    pub model_override: Option<String>,
    /// The longest wait for a TCP (and TLS) connection.
    pub connect_timeout: Duration,
    /// The longest wait for the first byte of an answer.
    pub first_byte_timeout: Duration,
    /// The most tool output one run feeds back to its model, all calls
    /// together (`delegation.max_tool_output_chars`); later results are cut
    /// to a note.
    pub max_tool_output_chars: usize,
    /// How many tool calls of one answer run at once.
    pub max_parallel_tools: usize,
}

impl fmt::Debug for RuntimeConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RuntimeConfig")
            .field("base_url", &retinue_core::redact_endpoint(&self.base_url))
            .field("model", &self.model)
            .field("api_key", &self.api_key)
            .field("api_key_origin", &self.api_key_origin)
            .field("api_mode", &self.api_mode)
            .field("stream", &self.stream)
            .field("max_iterations", &self.max_iterations)
            .field("pricing", &self.pricing)
            .field("retry", &self.retry)
            .field("request_timeout", &self.request_timeout)
            .field("completion_limit_field", &self.completion_limit_field)
            .field("allow_insecure_http", &self.allow_insecure_http)
            .field("model_override", &self.model_override)
            .field("completion_ceiling", &self.completion_ceiling)
            .field("connect_timeout", &self.connect_timeout)
            .field("first_byte_timeout", &self.first_byte_timeout)
            .field("max_tool_output_chars", &self.max_tool_output_chars)
            .field("max_parallel_tools", &self.max_parallel_tools)
            .finish()
    }
}

impl RuntimeConfig {
    /// A configuration for `model` at `base_url`: no key, no streaming, 50
    /// iterations, no prices, default retries, 10-minute request timeout.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> RuntimeConfig {
        RuntimeConfig {
            base_url: base_url.into(),
            model: model.into(),
            api_key: ApiKey::default(),
            api_key_origin: "nowhere (no key configured)".to_owned(),
            api_mode: String::new(),
            stream: false,
            max_iterations: 50,
            pricing: BTreeMap::new(),
            retry: RetryPolicy::default(),
            request_timeout: Duration::from_secs(600),
            completion_limit_field: "max_completion_tokens".to_owned(),
            allow_insecure_http: false,
            completion_ceiling: 16_384,
            model_override: None,
            connect_timeout: Duration::from_secs(10),
            first_byte_timeout: Duration::from_secs(120),
            max_tool_output_chars: 400_000,
            max_parallel_tools: 4,
        }
    }

    /// With `key` as the API key (origin: set by the embedder).
    #[must_use]
    pub fn with_api_key(mut self, key: impl Into<String>) -> RuntimeConfig {
        self.api_key = ApiKey::new(key);
        self.api_key_origin = "the embedder's configuration".to_owned();
        self
    }

    /// From `config.yaml`'s `delegation:` section, reading the process
    /// environment for the key (see [`RuntimeConfig::from_delegation_with_env`]).
    pub fn from_delegation(d: &DelegationConfig) -> Result<RuntimeConfig, ChatError> {
        RuntimeConfig::from_delegation_with_env(d, &|name| std::env::var(name).ok())
    }

    /// From the `delegation:` section: `base_url` (or the provider's known
    /// endpoint for `openai`, `openrouter`, `ollama`), `model`, `api_mode`,
    /// `stream`, `max_iterations`, `pricing`; the key from
    /// `delegation.api_key`, else the variable named by
    /// `delegation.api_key_env`, else `OPENAI_API_KEY` (looked up with `env`).
    /// An empty model or endpoint is allowed here (a child may name them);
    /// building a child without them fails with a text naming the keys.
    pub fn from_delegation_with_env(
        d: &DelegationConfig,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<RuntimeConfig, ChatError> {
        check_api_mode(&d.api_mode)?;
        let base_url = if d.base_url.is_empty() {
            provider_base_url(&d.provider).unwrap_or_default().to_owned()
        } else {
            d.base_url.clone()
        };
        let mut c = RuntimeConfig::new(base_url, d.model.clone());
        c.api_mode = d.api_mode.clone();
        c.stream = d.stream;
        c.allow_insecure_http = d.allow_insecure_http;
        c.completion_ceiling = d.max_completion_tokens;
        c.max_tool_output_chars = d.max_tool_output_chars;
        if d.max_iterations > 0 {
            c.max_iterations = d.max_iterations;
        }
        c.pricing = d.pricing.clone();
        c.completion_limit_field = if !d.completion_limit_field.is_empty() {
            d.completion_limit_field.clone()
        } else if d.provider.trim().eq_ignore_ascii_case("ollama") {
            // Ollama's OpenAI-compatible endpoint reads `max_tokens`.
            "max_tokens".to_owned()
        } else {
            "max_completion_tokens".to_owned()
        };
        if !d.api_key.is_empty() {
            c.api_key = d.api_key.clone();
            c.api_key_origin = "`delegation.api_key` in config.yaml".to_owned();
        } else {
            let var = if d.api_key_env.is_empty() { DEFAULT_KEY_ENV } else { &d.api_key_env };
            match env(var).map(|k| k.trim().to_owned()).filter(|k| !k.is_empty()) {
                Some(key) => {
                    c.api_key = ApiKey::new(key);
                    c.api_key_origin = format!("the environment variable `{var}`");
                }
                None => {
                    c.api_key_origin =
                        format!("nowhere (`delegation.api_key` is empty and `{var}` is not set)");
                }
            }
        }
        Ok(c)
    }

    /// Checks what can be checked before a call: the `api_mode`, and that
    /// the key never goes over plain HTTP to a host that is not loopback
    /// (unless `allow_insecure_http`), nor is missing for a provider that
    /// needs one.
    pub fn check(&self) -> Result<(), ChatError> {
        check_api_mode(&self.api_mode)?;
        let (url, _) = retinue_core::strip_userinfo(&self.base_url);
        let shown = retinue_core::redact_endpoint(&self.base_url);
        if !self.api_key.is_empty() && !self.allow_insecure_http && insecure(&url) {
            return Err(ChatError::Config(format!(
                "refusing to send the API key over plain HTTP to {shown} (not a loopback \
                 address): use https://, or set `delegation.allow_insecure_http: true` in \
                 config.yaml if this network is trusted"
            )));
        }
        if self.api_key.is_empty() && needs_key(&url) {
            return Err(ChatError::Config(format!(
                "{shown} needs an API key and none is configured (the key came from {}): set \
                 `delegation.api_key`, or `delegation.api_key_env` naming the environment \
                 variable that holds it (default `OPENAI_API_KEY`)",
                self.api_key_origin
            )));
        }
        Ok(())
    }
}

/// The host of `url` (no userinfo), lower-cased, without brackets.
fn host_of(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    let host = if let Some(v6) = authority.strip_prefix('[') {
        v6.split(']').next().unwrap_or_default()
    } else {
        authority.rsplit_once(':').map_or(authority, |(h, _)| h)
    };
    host.to_ascii_lowercase()
}

/// Whether `host` is a loopback name or address.
pub(crate) fn is_loopback(host: &str) -> bool {
    host == "localhost"
        || host.ends_with(".localhost")
        || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// Plain `http://` to a host that is not loopback.
fn insecure(url: &str) -> bool {
    url.trim().get(..7).is_some_and(|s| s.eq_ignore_ascii_case("http://"))
        && !is_loopback(&host_of(url))
}

/// The hosted providers that answer every request without a key with 401.
fn needs_key(url: &str) -> bool {
    matches!(host_of(url).as_str(), "api.openai.com" | "openrouter.ai")
}

/// The known endpoint of a provider name.
fn provider_base_url(provider: &str) -> Option<&'static str> {
    match provider.trim().to_ascii_lowercase().as_str() {
        "openai" => Some("https://api.openai.com/v1"),
        "openrouter" => Some("https://openrouter.ai/api/v1"),
        "ollama" => Some("http://127.0.0.1:11434/v1"),
        _ => None,
    }
}

pub(crate) fn check_api_mode(mode: &str) -> Result<(), ChatError> {
    let mode = mode.trim();
    if mode.is_empty() || SUPPORTED_API_MODES.contains(&mode) {
        Ok(())
    } else {
        Err(ChatError::Config(format!(
            "api_mode `{mode}` is not supported by this runtime; supported: {} (or leave \
             `delegation.api_mode` empty)",
            SUPPORTED_API_MODES.join(", ")
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_provider_that_never_answers_is_bounded_by_default() {
        let c = RuntimeConfig::new("http://127.0.0.1:9/v1", "m");
        assert_eq!(c.connect_timeout, Duration::from_secs(10));
        assert_eq!(c.first_byte_timeout, Duration::from_secs(120));
    }

    #[test]
    fn the_key_never_goes_over_plain_http_to_another_host() {
        let c = |url: &str| RuntimeConfig::new(url, "m").with_api_key("sk-secret-1");
        for ok in [
            "https://api.example.com/v1",
            "http://127.0.0.1:8080/v1",
            "http://localhost:11434/v1",
            "http://[::1]:9/v1",
            "http://127.9.9.9/v1",
        ] {
            assert!(c(ok).check().is_ok(), "{ok}");
        }
        for bad in ["http://10.0.0.5:8000/v1", "http://models.internal/v1", "HTTP://example.com/v1"]
        {
            let e = c(bad).check().err().map(|e| e.to_string()).unwrap_or_default();
            assert!(e.contains("allow_insecure_http"), "{bad}: {e}");
        }
        let e = c("http://alice:PW@10.0.0.5/v1?api_key=K").check().err().map(|e| e.to_string());
        let e = e.unwrap_or_default();
        assert!(!e.contains("PW") && !e.contains("=K"), "{e}");
        let mut allowed = c("http://10.0.0.5:8000/v1");
        allowed.allow_insecure_http = true;
        assert!(allowed.check().is_ok());
        // No key: plain HTTP is fine, but a hosted provider needs one.
        assert!(RuntimeConfig::new("http://10.0.0.5/v1", "m").check().is_ok());
        let e = RuntimeConfig::new("https://api.openai.com/v1", "m").check();
        assert!(e.is_err_and(|e| e.to_string().contains("needs an API key")));
    }

    fn env(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| vars.iter().find(|(k, _)| *k == name).map(|(_, v)| (*v).to_owned())
    }

    #[test]
    fn key_comes_from_config_then_named_env_then_openai_env() {
        let mut d = DelegationConfig {
            model: "m".into(),
            base_url: "http://x/v1".into(),
            ..DelegationConfig::default()
        };
        let e = env(&[("OPENAI_API_KEY", "sk-default"), ("MINE", "sk-mine")]);
        let c = RuntimeConfig::from_delegation_with_env(&d, &e).expect("config");
        assert_eq!(c.api_key.expose(), Some("sk-default"));
        assert!(c.api_key_origin.contains("OPENAI_API_KEY"));
        d.api_key_env = "MINE".into();
        let c = RuntimeConfig::from_delegation_with_env(&d, &e).expect("config");
        assert_eq!(c.api_key.expose(), Some("sk-mine"));
        d.api_key = ApiKey::new("sk-config");
        let c = RuntimeConfig::from_delegation_with_env(&d, &e).expect("config");
        assert_eq!(c.api_key.expose(), Some("sk-config"));
        assert!(!format!("{c:?}").contains("sk-config"));
        d.api_key = ApiKey::default();
        d.api_key_env = "UNSET".into();
        let c = RuntimeConfig::from_delegation_with_env(&d, &e).expect("config");
        assert!(c.api_key.is_empty());
        assert!(c.api_key_origin.contains("UNSET"));
    }

    #[test]
    fn unsupported_api_mode_names_the_supported_ones() {
        let d = DelegationConfig {
            api_mode: "anthropic_messages".into(),
            ..DelegationConfig::default()
        };
        let err = RuntimeConfig::from_delegation_with_env(&d, &|_| None).err();
        let text = err.map(|e| e.to_string()).unwrap_or_default();
        assert!(text.contains("anthropic_messages") && text.contains("chat_completions"), "{text}");
    }

    #[test]
    fn provider_gives_a_default_endpoint_and_fields_carry_over() {
        let d = DelegationConfig {
            provider: "openrouter".into(),
            model: "x/y".into(),
            stream: true,
            max_iterations: 7,
            ..DelegationConfig::default()
        };
        let c = RuntimeConfig::from_delegation_with_env(&d, &|_| None).expect("config");
        assert_eq!(c.base_url, "https://openrouter.ai/api/v1");
        assert!(c.stream);
        assert_eq!(c.max_iterations, 7);
    }
}
