//! Spans of a delegation, after the OpenTelemetry semantic conventions for
//! generative AI, version [`SEMCONV_VERSION`] (status: development; the
//! attribute names are in [`attr`], since the `opentelemetry-semantic-conventions`
//! crate no longer carries the GenAI ones), through the OpenTelemetry API only:
//! nothing is recorded until a provider is installed (`retinue-trace`).
//!
//! - `execute_tool delegate_task`: one per `delegate_task` call (a spawn or
//!   a follow-up), the child of the caller's context (`TRACEPARENT`, an MCP
//!   request's `_meta.traceparent`). Its context is stored on the unit
//!   (`task_json.traceparent`), so a follow-up days later links to it.
//! - `invoke_agent subagent`: one per child run, under the call's span, with
//!   the subagent id, the child session (the conversation) and its usage.
//! - The runtime adds `chat {model}` per model call and `execute_tool
//!   {tool}` per tool call under the child's span (its thread runs with the
//!   child's context attached).

use opentelemetry::trace::{
    Link, SpanContext, SpanId, SpanKind, Status, TraceContextExt, TraceFlags, TraceId, TraceState,
    Tracer,
};
use opentelemetry::{Context, KeyValue, global};

use self::attr as semconv;

use crate::results::ChildReport;
use retinue_core::run::ChildSpec;

pub use retinue_core::semconv::{SEMCONV_VERSION, TRACER, attr};

/// The span context a W3C `traceparent` names (`00-<trace>-<span>-<flags>`),
/// as a remote parent; `None` for anything malformed or all-zero.
pub fn remote_context(traceparent: &str) -> Option<SpanContext> {
    let mut parts = traceparent.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() || version != "00" || trace.len() != 32 || span.len() != 16 {
        return None;
    }
    let trace_id = TraceId::from_hex(trace).ok()?;
    let span_id = SpanId::from_hex(span).ok()?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    if trace_id == TraceId::INVALID || span_id == SpanId::INVALID {
        return None;
    }
    Some(SpanContext::new(trace_id, span_id, TraceFlags::new(flags), true, TraceState::default()))
}

/// The W3C `traceparent` of a span context (`None` when it is invalid, as
/// every span is while tracing is off).
pub fn traceparent(cx: &SpanContext) -> Option<String> {
    cx.is_valid()
        .then(|| format!("00-{}-{}-{:02x}", cx.trace_id(), cx.span_id(), cx.trace_flags().to_u8()))
}

/// The `execute_tool delegate_task` span of one call, started under the
/// caller's context (`traceparent`), linked to `linked` (the unit a
/// follow-up resumes). Returns the context to run the call in.
pub(crate) fn call_span(traceparent: Option<&str>, linked: Option<&str>, mode: &str) -> Context {
    // Without a caller's context, the current one: an orchestrator child's
    // own delegate_task runs on its thread, under its invoke_agent span.
    let parent = match traceparent.and_then(remote_context) {
        Some(remote) => Context::new().with_remote_span_context(remote),
        None => Context::current(),
    };
    let tracer = global::tracer(TRACER);
    let links: Vec<Link> =
        linked.and_then(remote_context).map(|sc| vec![Link::with_context(sc)]).unwrap_or_default();
    let span = tracer
        .span_builder("execute_tool delegate_task")
        .with_kind(SpanKind::Internal)
        .with_links(links)
        .with_attributes(vec![
            KeyValue::new(semconv::GEN_AI_OPERATION_NAME, "execute_tool"),
            KeyValue::new(semconv::GEN_AI_TOOL_NAME, "delegate_task"),
            KeyValue::new(semconv::GEN_AI_TOOL_TYPE, "function"),
            KeyValue::new("retinue.delegation.mode", mode.to_owned()),
        ])
        .start_with_context(&tracer, &parent);
    parent.with_span(span)
}

/// The context's span's `traceparent`, to store on the unit.
pub(crate) fn traceparent_of(cx: &Context) -> Option<String> {
    traceparent(&cx.span().span_context().clone())
}

/// Notes the unit id on the call's span.
pub(crate) fn set_unit(cx: &Context, delegation_id: &str) {
    cx.span().set_attribute(KeyValue::new("retinue.delegation.id", delegation_id.to_owned()));
}

/// Ends the call's span, with `error` as its `error.type` when it failed.
pub(crate) fn end_call(cx: &Context, error: Option<&str>) {
    let span = cx.span();
    if let Some(kind) = error {
        span.set_attribute(KeyValue::new(semconv::ERROR_TYPE, kind.to_owned()));
        span.set_status(Status::error(kind.to_owned()));
    }
    span.end();
}

/// The `invoke_agent subagent` span of one child run, under `parent`.
pub(crate) fn child_span(parent: &Context, spec: &ChildSpec, session_id: &str) -> Context {
    let tracer = global::tracer(TRACER);
    let mut attributes = vec![
        KeyValue::new(semconv::GEN_AI_OPERATION_NAME, "invoke_agent"),
        KeyValue::new(
            semconv::GEN_AI_PROVIDER_NAME,
            spec.provider
                .clone()
                .filter(|p| !p.trim().is_empty())
                .unwrap_or_else(|| "openai".into()),
        ),
        KeyValue::new(semconv::GEN_AI_AGENT_ID, spec.subagent_id.clone()),
        KeyValue::new(semconv::GEN_AI_AGENT_NAME, format!("subagent ({})", spec.role.as_str())),
        KeyValue::new(semconv::GEN_AI_CONVERSATION_ID, session_id.to_owned()),
    ];
    if let Some(model) = &spec.model {
        attributes.push(KeyValue::new(semconv::GEN_AI_REQUEST_MODEL, model.clone()));
    }
    let span = tracer
        .span_builder("invoke_agent subagent")
        .with_kind(SpanKind::Internal)
        .with_attributes(attributes)
        .start_with_context(&tracer, parent);
    parent.with_span(span)
}

fn count(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// Ends a child's span with its usage (and `error.type` when it did not
/// complete).
pub(crate) fn end_child(cx: &Context, report: &ChildReport, cached_input: u64) {
    let span = cx.span();
    span.set_attribute(KeyValue::new(
        semconv::GEN_AI_USAGE_INPUT_TOKENS,
        count(report.tokens.input),
    ));
    span.set_attribute(KeyValue::new(
        semconv::GEN_AI_USAGE_OUTPUT_TOKENS,
        count(report.tokens.output),
    ));
    if cached_input > 0 {
        span.set_attribute(KeyValue::new(
            semconv::GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS,
            count(cached_input),
        ));
    }
    if let Some(model) = &report.model {
        span.set_attribute(KeyValue::new(semconv::GEN_AI_RESPONSE_MODEL, model.clone()));
    }
    if report.status != retinue_core::ChildStatus::Completed {
        let kind = report.exit_reason.as_str().to_owned();
        span.set_attribute(KeyValue::new(semconv::ERROR_TYPE, kind.clone()));
        span.set_status(Status::error(report.error.clone().unwrap_or(kind)));
    }
    span.end();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_round_trip_and_junk_is_refused() {
        let tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let sc = remote_context(tp).expect("valid");
        assert!(sc.is_remote() && sc.is_sampled());
        assert_eq!(traceparent(&sc).as_deref(), Some(tp));
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-zz",
        ] {
            assert!(remote_context(bad).is_none(), "{bad}");
        }
        assert_eq!(traceparent(&SpanContext::empty_context()), None);
    }
}
