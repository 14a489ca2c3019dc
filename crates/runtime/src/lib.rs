//! `retinue-runtime`: a [`ChildRuntime`](retinue_core::run::ChildRuntime) over an
//! OpenAI-compatible **Chat Completions** API (`POST {base_url}/chat/completions`),
//! so children can run on OpenAI, OpenRouter, vLLM, llama.cpp's server, Ollama
//! or LM Studio.
//!
//! * [`RuntimeConfig`] — endpoint, model, API key (never printed), streaming,
//!   iteration budget, price table, [`RetryPolicy`], request timeout; built by
//!   hand or from `config.yaml`'s `delegation:` section
//!   ([`RuntimeConfig::from_delegation`]).
//! * [`ChatRuntime`] — the runtime. A run sends the system prompt, the
//!   persisted dialogue in order (tool calls and tool results included) and
//!   the new user turn; then loops: model call → assistant message → tool
//!   calls run through the embedder's [`ToolExecutor`] → tool results → next
//!   call, until a final answer, `max_iterations`, cancellation/deadline, or an
//!   unrecoverable API error. Every assistant message, tool call and tool
//!   result is appended to the transcript as it happens; steering messages are
//!   folded in as user turns between iterations.
//! * Usage: prompt, completion, cached and reasoning tokens summed over the
//!   run's calls; cost is the provider's `usage.cost` when reported, else the
//!   price table, else 0 with a warning — never a guess.
//! * Failures: 429, 5xx, timeouts and connection errors are retried with
//!   exponential backoff and jitter (honouring `Retry-After`), bounded by the
//!   retry count and the child's deadline; 401/403, 404 and 400 end the run
//!   with a text saying what to fix. The API key never appears in an error,
//!   a log line or the transcript.
//!
//! The HTTP client is `ureq` 3 (blocking, rustls): the seams are synchronous,
//! each child runs on its own thread, and no async runtime is needed. No
//! `ureq` type appears in this crate's public API.
//!
//! ```no_run
//! use std::sync::Arc;
//! use retinue_runtime::{ChatRuntime, NoTools, RuntimeConfig};
//! let config = RuntimeConfig::new("http://127.0.0.1:11434/v1", "llama3.2");
//! let runtime = ChatRuntime::new(config, Arc::new(NoTools))?;
//! # Ok::<(), retinue_runtime::ChatError>(())
//! ```

mod client;
mod config;
mod error;
mod resolve;
mod runtime;
mod spans;
mod tools;

pub use config::{DEFAULT_KEY_ENV, RetryPolicy, RuntimeConfig, SUPPORTED_API_MODES};
pub use error::ChatError;
pub use retinue_config::ModelPrice;
#[cfg(any(test, feature = "mocks"))]
pub use retinue_core::run::MockToolExecutor;
pub use retinue_core::run::{NoTools, ToolError, ToolExecutor};
pub use runtime::ChatRuntime;
