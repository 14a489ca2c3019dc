//! The names of Retinue's spans and their attributes, in one table: the
//! OpenTelemetry semantic conventions for generative AI, version
//! [`SEMCONV_VERSION`] (the `opentelemetry-semantic-conventions` crate no
//! longer carries the GenAI ones). The delegate core and the runtime make
//! spans with these names through the OpenTelemetry API; `retinue-trace`
//! installs the provider.

/// The instrumentation scope's name.
pub const TRACER: &str = "retinue";

/// The semantic-conventions version the names and attributes follow.
pub const SEMCONV_VERSION: &str = "1.38.0";

/// The attribute names used (semantic conventions [`SEMCONV_VERSION`]).
pub mod attr {
    /// `gen_ai.operation.name`: `invoke_agent`, `chat`, `execute_tool`.
    pub const GEN_AI_OPERATION_NAME: &str = "gen_ai.operation.name";
    /// `gen_ai.provider.name`.
    pub const GEN_AI_PROVIDER_NAME: &str = "gen_ai.provider.name";
    /// `gen_ai.agent.id`: the subagent id.
    pub const GEN_AI_AGENT_ID: &str = "gen_ai.agent.id";
    /// `gen_ai.agent.name`.
    pub const GEN_AI_AGENT_NAME: &str = "gen_ai.agent.name";
    /// `gen_ai.conversation.id`: the child's session.
    pub const GEN_AI_CONVERSATION_ID: &str = "gen_ai.conversation.id";
    /// `gen_ai.request.model`.
    pub const GEN_AI_REQUEST_MODEL: &str = "gen_ai.request.model";
    /// `gen_ai.response.model`.
    pub const GEN_AI_RESPONSE_MODEL: &str = "gen_ai.response.model";
    /// `gen_ai.response.finish_reasons`.
    pub const GEN_AI_RESPONSE_FINISH_REASONS: &str = "gen_ai.response.finish_reasons";
    /// `gen_ai.usage.input_tokens`.
    pub const GEN_AI_USAGE_INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
    /// `gen_ai.usage.output_tokens`.
    pub const GEN_AI_USAGE_OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
    /// `gen_ai.usage.cache_read.input_tokens`.
    pub const GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS: &str = "gen_ai.usage.cache_read.input_tokens";
    /// `gen_ai.tool.name`.
    pub const GEN_AI_TOOL_NAME: &str = "gen_ai.tool.name";
    /// `gen_ai.tool.call.id`.
    pub const GEN_AI_TOOL_CALL_ID: &str = "gen_ai.tool.call.id";
    /// `gen_ai.tool.type`.
    pub const GEN_AI_TOOL_TYPE: &str = "gen_ai.tool.type";
    /// `error.type`.
    pub const ERROR_TYPE: &str = "error.type";
}
