//! The runtime's spans (semantic conventions for generative AI, see
//! `retinue_core::semconv`): `chat {model}` per model call and
//! `execute_tool {tool}` per tool call, under the child's `invoke_agent`
//! span (the current context of the child's thread). OpenTelemetry API only:
//! no-ops until a provider is installed.

use opentelemetry::trace::{SpanKind, Status, TraceContextExt, Tracer};
use opentelemetry::{Context, KeyValue, global};
use retinue_core::semconv::{TRACER, attr};

use crate::client::Completion;

fn count(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Starts `chat {model}` under the current context.
pub(crate) fn chat(model: &str, provider: &str) -> Context {
    let parent = Context::current();
    let tracer = global::tracer(TRACER);
    let span = tracer
        .span_builder(format!("chat {model}"))
        .with_kind(SpanKind::Client)
        .with_attributes(vec![
            KeyValue::new(attr::GEN_AI_OPERATION_NAME, "chat"),
            KeyValue::new(attr::GEN_AI_PROVIDER_NAME, provider.to_owned()),
            KeyValue::new(attr::GEN_AI_REQUEST_MODEL, model.to_owned()),
        ])
        .start_with_context(&tracer, &parent);
    parent.with_span(span)
}

/// Ends a `chat` span with the call's usage and finish reason.
pub(crate) fn chat_done(cx: &Context, completion: &Completion) {
    let span = cx.span();
    span.set_attribute(KeyValue::new(
        attr::GEN_AI_USAGE_INPUT_TOKENS,
        count(completion.tokens.input),
    ));
    span.set_attribute(KeyValue::new(
        attr::GEN_AI_USAGE_OUTPUT_TOKENS,
        count(completion.tokens.output),
    ));
    if completion.tokens.cached_input > 0 {
        span.set_attribute(KeyValue::new(
            attr::GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
            count(completion.tokens.cached_input),
        ));
    }
    if let Some(reason) = &completion.finish_reason {
        span.set_attribute(KeyValue::new(
            attr::GEN_AI_RESPONSE_FINISH_REASONS,
            opentelemetry::Value::Array(
                vec![opentelemetry::StringValue::from(reason.clone())].into(),
            ),
        ));
    }
    span.end();
}

/// Ends a span as failed with `kind` as its `error.type`.
pub(crate) fn failed(cx: &Context, kind: &str, message: &str) {
    let span = cx.span();
    span.set_attribute(KeyValue::new(attr::ERROR_TYPE, kind.to_owned()));
    span.set_status(Status::error(message.to_owned()));
    span.end();
}

/// Starts `execute_tool {name}` under `parent`.
pub(crate) fn tool(parent: &Context, name: &str, call_id: &str) -> Context {
    let tracer = global::tracer(TRACER);
    let span = tracer
        .span_builder(format!("execute_tool {name}"))
        .with_kind(SpanKind::Internal)
        .with_attributes(vec![
            KeyValue::new(attr::GEN_AI_OPERATION_NAME, "execute_tool"),
            KeyValue::new(attr::GEN_AI_TOOL_NAME, name.to_owned()),
            KeyValue::new(attr::GEN_AI_TOOL_CALL_ID, call_id.to_owned()),
            KeyValue::new(attr::GEN_AI_TOOL_TYPE, "function"),
        ])
        .start_with_context(&tracer, parent);
    parent.with_span(span)
}

/// Ends a tool span; a result that is a tool error (`{"error": …}`) marks it.
pub(crate) fn tool_done(cx: &Context, output: &str) {
    if output.starts_with("{\"error\"") {
        failed(cx, "tool_error", "the tool call failed");
    } else {
        cx.span().end();
    }
}
