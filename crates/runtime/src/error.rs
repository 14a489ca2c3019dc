//! The crate's error enum.

/// Why the runtime could not be configured or a model call failed.
///
/// No variant carries the API key: provider texts are scrubbed of it before
/// they are stored here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChatError {
    /// The configuration cannot work; the text says which key to set.
    #[error("{0}")]
    Config(String),
    /// The provider rejected the API key (401/403).
    #[error(
        "the API key was rejected (HTTP {status} from {base_url}); the key came from {origin}: \
         set `delegation.api_key`, or `delegation.api_key_env` naming the environment variable \
         that holds it (default `OPENAI_API_KEY`)"
    )]
    KeyRejected {
        /// 401 or 403.
        status: u16,
        /// The endpoint.
        base_url: String,
        /// Where the key came from (`delegation.api_key`, an env var, or nowhere).
        origin: String,
    },
    /// A 3xx answer to the POST: never followed (the body and the key must
    /// not go to another address); `base_url` should name the final one.
    #[error(
        "the endpoint {url} answered HTTP {status} (a redirect to {location}); redirects of a \
         model call are never followed: set `delegation.base_url` to the final address"
    )]
    Redirected {
        /// 301…308.
        status: u16,
        /// The URL called (redacted).
        url: String,
        /// Where it pointed (redacted; empty when not given).
        location: String,
    },
    /// 404: the model is unknown to the provider or `base_url` is wrong.
    #[error(
        "HTTP 404 from {url}: unknown model `{model}` or wrong base URL; check \
         `delegation.model` and `delegation.base_url` ({message})"
    )]
    NotFound {
        /// The URL called.
        url: String,
        /// The model asked for.
        model: String,
        /// The provider's message.
        message: String,
    },
    /// 400: the provider refused the request (e.g. the context is too long).
    #[error("the provider refused the request (HTTP 400): {message}")]
    BadRequest {
        /// The provider's message.
        message: String,
    },
    /// Another non-retryable HTTP status.
    #[error("HTTP {status} from the provider: {message}")]
    Status {
        /// The status.
        status: u16,
        /// The provider's message.
        message: String,
    },
    /// Retryable failures (429, 5xx, timeouts, dropped connections) outlasted
    /// the retry budget.
    #[error("model call failed after {attempts} attempt(s): {last}")]
    Exhausted {
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        last: String,
    },
    /// The endpoint cannot be reached at all (bad URL, unknown host).
    #[error("cannot reach {url}: {message}; check `delegation.base_url`")]
    Unreachable {
        /// The URL called.
        url: String,
        /// What failed.
        message: String,
    },
    /// A response that is not a valid Chat Completions answer.
    #[error("malformed response from the provider: {0}")]
    Malformed(String),
    /// The provider reported usage nobody can believe (negative, NaN,
    /// non-numeric, fractional or beyond any real context window): the call
    /// is billed what it held, never 0.
    #[error("the provider reported unusable usage: {0}")]
    Usage(String),
    /// The transcript refused a message.
    #[error("transcript write failed: {0}")]
    Transcript(String),
}

/// Replaces every occurrence of `secret` in `text` (no-op for an empty secret).
pub(crate) fn scrub(text: &str, secret: Option<&str>) -> String {
    match secret {
        Some(s) if s.len() >= 4 => text.replace(s, "[redacted]"),
        _ => text.to_owned(),
    }
}
