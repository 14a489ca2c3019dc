//! [`ChatRuntime`]: the run loop.

use std::collections::HashMap;
use std::fmt;
use std::ops::ControlFlow;
use std::sync::{Arc, Mutex, PoisonError};

use retinue_core::run::{
    CallPermit, CallPlan, CallUsage, CancelReason, CancelToken, ChildHandle, ChildOutcome,
    ChildRuntime, ChildSpec, RunContext, RunInput, RunTokens, RuntimeError, TranscriptSink,
};
use retinue_core::{ExitReason, Message};
use serde_json::{Value, json};

use crate::client::{Call, CallOutcome, Completion, ToolCall};
use crate::config::check_api_mode;
use crate::error::scrub;
use crate::tools::tool_names;
use crate::{ChatError, RuntimeConfig, ToolExecutor};

/// hermes's marker for structured (JSON) message content.
const JSON_CONTENT: &str = "\u{0}json:";

/// Model or tool output as stored text: a leading structured-content marker
/// loses its NUL, so untrusted output can never pass for hermes's
/// structured content (in Retinue's replay or in hermes's own reader).
fn as_text(s: String) -> String {
    match s.strip_prefix('\u{0}') {
        Some(rest) if s.starts_with(JSON_CONTENT) => rest.to_owned(),
        _ => s,
    }
}

/// What the runtime keeps per built child.
#[derive(Debug, Clone)]
struct Child {
    base_url: String,
    model: String,
    /// `gen_ai.provider.name` of its spans (`delegation.provider`, else
    /// `openai`: the protocol spoken).
    provider: String,
    max_iterations: u32,
    steers: Vec<String>,
    /// Accepting steers (built, not finished).
    open: bool,
}

/// A [`ChildRuntime`] over an OpenAI-compatible Chat Completions endpoint.
///
/// One value serves many children at once (each `run` on its caller's
/// thread; HTTP connections are pooled but never shared by two in-flight
/// calls).
pub struct ChatRuntime {
    config: RuntimeConfig,
    agent: ureq::Agent,
    tools: Arc<dyn ToolExecutor>,
    /// The configuration, shared with each call's thread.
    shared_config: Arc<RuntimeConfig>,
    children: Mutex<HashMap<String, Child>>,
    /// Models already warned about having no price (warned once each).
    unpriced: Mutex<std::collections::HashSet<String>>,
}

impl fmt::Debug for ChatRuntime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatRuntime").field("config", &self.config).finish_non_exhaustive()
    }
}

impl ChatRuntime {
    /// A runtime calling the endpoint of `config`, running tools through `tools`.
    ///
    /// Fails with [`ChatError::Config`] for an unsupported `api_mode`.
    pub fn new(
        config: RuntimeConfig,
        tools: Arc<dyn ToolExecutor>,
    ) -> Result<ChatRuntime, ChatError> {
        config.check()?;
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            // A redirect of the POST is an error, never followed elsewhere.
            .max_redirects(0)
            .timeout_connect(Some(config.connect_timeout))
            .timeout_recv_response(Some(config.first_byte_timeout))
            .max_idle_connections(256)
            .max_idle_connections_per_host(256)
            .build();
        // ureq's parts with one change: an IP-literal endpoint is not looked up.
        let agent = ureq::Agent::with_parts(
            agent,
            ureq::unversioned::transport::DefaultConnector::new(),
            crate::resolve::LiteralFirst::default(),
        );
        Ok(ChatRuntime {
            shared_config: Arc::new(config.clone()),
            config,
            agent,
            tools,
            children: Mutex::new(HashMap::new()),
            unpriced: Mutex::new(std::collections::HashSet::new()),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RuntimeConfig {
        &self.config
    }

    /// Children built and not yet finished (a finished child is forgotten,
    /// so a long-running server keeps no entry per child).
    pub fn live_children(&self) -> usize {
        self.children().len()
    }

    fn children(&self) -> std::sync::MutexGuard<'_, HashMap<String, Child>> {
        self.children.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The child's settings; a handle never built gets the configuration's.
    fn child_settings(&self, child: &ChildHandle) -> Child {
        self.children().get(&child.subagent_id).cloned().unwrap_or_else(|| Child {
            base_url: self.config.base_url.clone(),
            model: self.config.model.clone(),
            provider: "openai".to_owned(),
            max_iterations: self.config.max_iterations,
            steers: Vec::new(),
            open: true,
        })
    }

    fn take_steers(&self, child: &ChildHandle) -> Vec<String> {
        self.children()
            .get_mut(&child.subagent_id)
            .map(|c| std::mem::take(&mut c.steers))
            .unwrap_or_default()
    }

    /// Closes the child to steering and forgets it (a long-running server
    /// keeps no entry per finished child); returns what was still queued.
    fn close(&self, child: &ChildHandle) -> Vec<String> {
        self.children().remove(&child.subagent_id).map(|c| c.steers).unwrap_or_default()
    }

    /// What sending `tokens` prompt tokens costs at the price table (0 when
    /// the model has no price: the budget then meters it by tokens only).
    fn prompt_cost(&self, model: &str, tokens: u64) -> f64 {
        self.config.pricing.get(model).map_or(0.0, |p| tokens as f64 * p.input_per_mtok / 1e6)
    }

    fn cost_of(&self, model: &str, c: &Completion) -> f64 {
        if let Some(cost) = c.cost {
            return cost;
        }
        let t = &c.tokens;
        if t.input == 0 && t.output == 0 {
            return 0.0;
        }
        match self.config.pricing.get(model) {
            Some(p) => {
                let cached = t.cached_input.min(t.input);
                let fresh = t.input - cached;
                let cached_price = p.cached_input_per_mtok.unwrap_or(p.input_per_mtok);
                (fresh as f64 * p.input_per_mtok
                    + cached as f64 * cached_price
                    + t.output as f64 * p.output_per_mtok)
                    / 1e6
            }
            None => {
                let first = self
                    .unpriced
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(model.to_owned());
                if first {
                    log::warn!(
                        "no price for model `{model}` and the provider reported no cost; billing \
                         0 (set `delegation.pricing.{model}` in config.yaml)"
                    );
                }
                0.0
            }
        }
    }
}

/// A transcript row as the Chat Completions API wants it. Only the rows
/// hermes itself writes as structured (user and system turns) are decoded
/// from its marker; model output and tool output are always text.
fn to_wire(m: &Message) -> Option<Value> {
    let structured = matches!(m.role.as_str(), "user" | "system");
    let content = m.content.as_deref().map(|c| match c.strip_prefix(JSON_CONTENT) {
        Some(json) if structured => {
            serde_json::from_str(json).unwrap_or_else(|_| Value::String(c.to_owned()))
        }
        _ => Value::String(c.to_owned()),
    });
    match m.role.as_str() {
        "assistant" => {
            let mut v = json!({"role": "assistant", "content": content});
            if let Some(calls) = m
                .tool_calls
                .as_deref()
                .and_then(|t| serde_json::from_str::<Value>(t).ok())
                .filter(|c| c.as_array().is_some_and(|a| !a.is_empty()))
            {
                v["tool_calls"] = calls;
            }
            Some(v)
        }
        "tool" => Some(json!({
            "role": "tool",
            "tool_call_id": m.tool_call_id.clone().unwrap_or_default(),
            "content": content.unwrap_or(Value::String(String::new())),
        })),
        "user" | "system" => Some(
            json!({"role": m.role, "content": content.unwrap_or(Value::String(String::new()))}),
        ),
        _ => None,
    }
}

/// A stored transcript as a request every OpenAI-compatible server
/// accepts: each assistant row's tool calls followed at once by their
/// results, in the calls' order. A call whose result was never written (a
/// run stopped mid-tools) gets a stated placeholder; a result whose call is
/// not right before it (an orphan, or a duplicate) is dropped.
pub(crate) fn wire_history(history: &[Message]) -> Vec<Value> {
    let mut out: Vec<Value> = Vec::new();
    let rows: Vec<&Message> = history.iter().filter(|m| m.role != "system").collect();
    let mut i = 0;
    while i < rows.len() {
        let m = rows[i];
        i += 1;
        if m.role == "tool" {
            // Results are only taken right after their call (below).
            continue;
        }
        let Some(wire) = to_wire(m) else { continue };
        let ids: Vec<String> = wire
            .get("tool_calls")
            .and_then(Value::as_array)
            .map(|calls| calls.iter().filter_map(|c| c["id"].as_str().map(str::to_owned)).collect())
            .unwrap_or_default();
        out.push(wire);
        if ids.is_empty() {
            continue;
        }
        let mut results: HashMap<String, Value> = HashMap::new();
        while i < rows.len() && rows[i].role == "tool" {
            if let Some(r) = to_wire(rows[i])
                && let Some(id) = rows[i].tool_call_id.as_deref()
                && ids.iter().any(|c| c == id)
            {
                results.entry(id.to_owned()).or_insert(r);
            }
            i += 1;
        }
        for id in ids {
            out.push(results.remove(&id).unwrap_or_else(|| {
                json!({
                    "role": "tool",
                    "tool_call_id": id,
                    "content": "{\"error\": \"no result: the run stopped before this tool call finished\"}",
                })
            }));
        }
    }
    out
}

/// The longest tool call id kept as the model gave it (providers' ids run
/// to 43 characters: DeepSeek's `call_0_<uuid>`, vLLM's `chatcmpl-tool-…`).
const MAX_CALL_ID: usize = 64;

/// The tool call ids `history` already holds.
fn known_call_ids(history: &[Message]) -> std::collections::HashSet<String> {
    let mut out = std::collections::HashSet::new();
    for m in history {
        out.extend(m.tool_call_id.clone());
        if let Some(calls) = m.tool_calls.as_deref()
            && let Ok(Value::Array(calls)) = serde_json::from_str::<Value>(calls)
        {
            out.extend(calls.iter().filter_map(|c| c["id"].as_str().map(str::to_owned)));
        }
    }
    out
}

/// Gives every call a unique id: a model's empty, over-long (64+), control
/// character or repeated id (within the answer or with the history) is
/// replaced by `rNNNNNNNN` (nine alphanumerics, which every provider takes,
/// Mistral's exact-nine rule included), so each call's result is stored
/// and replayed under its own id. Well-formed ids (Kimi's
/// `functions.name:0` too) are kept.
fn unique_call_ids(
    calls: &mut [crate::client::ToolCall],
    seen: &mut std::collections::HashSet<String>,
) {
    for c in calls {
        let well_formed = !c.id.is_empty()
            && c.id.len() <= MAX_CALL_ID
            && c.id.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.:".contains(&b));
        if well_formed && seen.insert(c.id.clone()) {
            continue;
        }
        let mut n = seen.len();
        c.id = loop {
            let id = format!("r{:08}", n % 100_000_000);
            if seen.insert(id.clone()) {
                break id;
            }
            n += 1;
        };
    }
}

fn add(total: &mut RunTokens, t: &RunTokens) {
    total.input = total.input.saturating_add(t.input);
    total.output = total.output.saturating_add(t.output);
    total.cached_input = total.cached_input.saturating_add(t.cached_input);
    total.reasoning = total.reasoning.saturating_add(t.reasoning);
}

fn stopped_reason(cancel: &CancelToken) -> ExitReason {
    match cancel.reason() {
        Some(CancelReason::Timeout) => ExitReason::Timeout,
        Some(CancelReason::Budget) => ExitReason::Budget,
        _ => ExitReason::Interrupted,
    }
}

/// A rough token count of a request body (4 characters a token): what the
/// next call will at least send, for the budget check before it.
fn estimated_tokens(body: &str) -> u64 {
    u64::try_from(body.chars().count() / 4).unwrap_or(u64::MAX)
}

/// The running state of one run.
struct Run<'a> {
    rt: &'a ChatRuntime,
    child: &'a ChildHandle,
    settings: Child,
    sink: &'a dyn TranscriptSink,
    ctx: &'a RunContext,
    outcome: ChildOutcome,
    /// Characters of tool output fed back so far.
    tool_chars: usize,
}

impl Run<'_> {
    fn append(&self, m: &Message) -> Result<(), ExitReason> {
        self.sink.append(m).map_err(|e| match e {
            retinue_core::run::SinkError::Closed { .. } => stopped_reason(&self.ctx.cancel),
            retinue_core::run::SinkError::Storage { .. } => ExitReason::Error,
        })
    }

    /// Bills a call whose usage is unknown what its permit held (prompt
    /// plus bounded completion): never 0.
    fn bill_hold(&mut self, permit: CallPermit) {
        let hold = permit.hold();
        self.outcome.tokens.input = self.outcome.tokens.input.saturating_add(hold.tokens);
        if hold.cost_usd.is_finite() && hold.cost_usd > 0.0 {
            self.outcome.cost_usd += hold.cost_usd;
        }
        drop(permit);
    }

    fn fail(&mut self, reason: ExitReason, error: Option<String>) {
        self.outcome.exit_reason = reason;
        self.outcome.error = error.map(|e| scrub(&e, self.rt.config.api_key.expose()));
    }

    fn stop(&mut self) {
        let reason = stopped_reason(&self.ctx.cancel);
        let text = match reason {
            ExitReason::Timeout => "the child's deadline passed",
            ExitReason::Budget => "the budget allowance is spent",
            _ => "the run was cancelled",
        };
        self.fail(reason, Some(text.to_owned()));
    }

    fn sink_failed(&mut self, reason: ExitReason) {
        if reason == ExitReason::Error {
            self.fail(
                reason,
                Some(ChatError::Transcript("the store refused a message".into()).to_string()),
            );
        } else {
            self.stop();
        }
    }

    /// The run loop: steer → model call → the answer recorded → its tool
    /// calls run and recorded, until a final answer, a stop, the iteration
    /// limit, the budget or a failure ends it. Each step is a method that
    /// either goes on or has already recorded why the run ended.
    fn go(&mut self, input: &RunInput) {
        let definitions = self.rt.tools.definitions_in(self.child, self.ctx);
        let names = tool_names(&definitions);
        let mut messages = opening_messages(input);
        let max = self.settings.max_iterations.max(1);
        let mut calls: u32 = 0;
        let mut call_ids = known_call_ids(&input.history);
        loop {
            if self.fold_steers(&mut messages).is_break() {
                return;
            }
            if self.ctx.cancel.is_cancelled() {
                return self.stop();
            }
            if calls >= max {
                return self.fail(
                    ExitReason::MaxIterations,
                    Some(format!("stopped after {calls} model calls (max_iterations = {max})")),
                );
            }
            calls += 1;
            let ControlFlow::Continue(mut completion) = self.call_model(&messages, &definitions)
            else {
                return;
            };
            // Before anything is stored or run: every call its own id, and
            // the provider sees the same ids in the history it is sent.
            unique_call_ids(&mut completion.tool_calls, &mut call_ids);
            if self.record_answer(&completion, &mut messages).is_break() {
                return;
            }
            if completion.tool_calls.is_empty() {
                self.outcome.final_response = completion.content.filter(|c| !c.trim().is_empty());
                self.outcome.exit_reason = ExitReason::Completed;
                if self.outcome.final_response.is_none() {
                    self.outcome.error = Some("the model gave an empty final answer".into());
                }
                return;
            }
            if self.answer_tools(&completion.tool_calls, &names, &mut messages).is_break() {
                return;
            }
        }
    }

    /// Steering messages that arrived since the last call become user
    /// turns (recorded, then sent).
    fn fold_steers(&mut self, messages: &mut Vec<Value>) -> ControlFlow<()> {
        for steer in self.rt.take_steers(self.child) {
            let m =
                Message { role: "user".into(), content: Some(steer.clone()), ..Message::default() };
            if let Err(reason) = self.append(&m) {
                self.sink_failed(reason);
                return ControlFlow::Break(());
            }
            messages.push(json!({"role": "user", "content": steer}));
        }
        ControlFlow::Continue(())
    }

    /// One model call: the request built, leave taken from the core (under
    /// a budget its prompt and bounded completion are reserved first, and
    /// the bound is sent so the provider cannot overrun it), the call made
    /// and billed. `Break` when the run ended (stopped, refused, failed).
    fn call_model(
        &mut self,
        messages: &[Value],
        definitions: &[Value],
    ) -> ControlFlow<(), Completion> {
        let rt = self.rt;
        let mut body = json!({
            "model": self.settings.model,
            "messages": messages,
        });
        if !definitions.is_empty() {
            body["tools"] = Value::Array(definitions.to_vec());
        }
        if rt.config.stream {
            body["stream"] = Value::Bool(true);
            body["stream_options"] = json!({"include_usage": true});
        }
        let prompt = estimated_tokens(&body.to_string());
        let plan = CallPlan {
            prompt_tokens: prompt,
            prompt_cost_usd: rt.prompt_cost(&self.settings.model, prompt),
            // The ceiling of one call's completion under a budget: the
            // reservation holds no more than this per call, so concurrent
            // runs share what is left.
            max_completion_tokens: (rt.config.completion_ceiling > 0)
                .then_some(rt.config.completion_ceiling),
            usd_per_completion_token: rt
                .config
                .pricing
                .get(&self.settings.model)
                .map(|p| p.output_per_mtok / 1e6),
        };
        let permit = match self.ctx.cancel.begin_call(plan) {
            Ok(p) => p,
            Err(why) => {
                self.fail(
                    ExitReason::Budget,
                    Some(format!("the next model call would cross the budget: {why}")),
                );
                return ControlFlow::Break(());
            }
        };
        if let Some(bound) = permit.max_completion_tokens() {
            body[rt.config.completion_limit_field.as_str()] = json!(bound);
        }
        let text = body.to_string();
        let call = Call {
            agent: rt.agent.clone(),
            config: Arc::clone(&rt.shared_config),
            base_url: self.settings.base_url.clone(),
            model: self.settings.model.clone(),
            body: Arc::from(text.as_str()),
            stream: rt.config.stream,
            cancel: self.ctx.cancel.clone(),
        };
        let span = crate::spans::chat(&self.settings.model, &self.settings.provider);
        let outcome = call.run();
        match &outcome {
            CallOutcome::Done(c) => crate::spans::chat_done(&span, c),
            CallOutcome::Stopped => {
                crate::spans::failed(&span, "cancelled", "the call was stopped")
            }
            CallOutcome::Failed(e) => crate::spans::failed(&span, "provider_error", &e.to_string()),
        }
        let mut completion = match outcome {
            CallOutcome::Done(c) => c,
            CallOutcome::Stopped => {
                // Cut off mid-call: the provider may have spent it all.
                self.bill_hold(permit);
                self.stop();
                return ControlFlow::Break(());
            }
            CallOutcome::Failed(
                e @ (ChatError::Usage(_) | ChatError::Malformed(_) | ChatError::Exhausted { .. }),
            ) => {
                // Usage nobody can believe, an answer that cannot be read,
                // or retries that never got one (each attempt may have been
                // billed): what the call held is billed.
                self.outcome.api_calls += 1;
                self.bill_hold(permit);
                self.fail(ExitReason::Error, Some(e.to_string()));
                return ControlFlow::Break(());
            }
            CallOutcome::Failed(e) => {
                // The provider refused the call: nothing generated.
                permit.finish(CallUsage::default());
                self.fail(ExitReason::Error, Some(e.to_string()));
                return ControlFlow::Break(());
            }
        };
        self.outcome.api_calls += 1;
        if !completion.usage_reported {
            // No usage at all: billed by estimate (never 0).
            completion.tokens.input = prompt;
            completion.tokens.output = estimated_tokens(
                &(completion.content.clone().unwrap_or_default()
                    + &completion
                        .tool_calls
                        .iter()
                        .map(|c| c.name.clone() + &c.arguments)
                        .collect::<String>()),
            );
            log::warn!(
                "the provider reported no usage for a call to model `{}`; billing an estimate \
                 of {} tokens",
                self.settings.model,
                completion.tokens.input.saturating_add(completion.tokens.output)
            );
        }
        add(&mut self.outcome.tokens, &completion.tokens);
        let cost = rt.cost_of(&self.settings.model, &completion);
        self.outcome.cost_usd += cost;
        permit.finish(CallUsage {
            tokens: completion.tokens.input.saturating_add(completion.tokens.output),
            cost_usd: cost,
        });
        ControlFlow::Continue(completion)
    }

    /// The answer as the child's next assistant turn (recorded, then sent
    /// back with the next call).
    fn record_answer(
        &mut self,
        completion: &Completion,
        messages: &mut Vec<Value>,
    ) -> ControlFlow<()> {
        let wire_calls: Vec<Value> = completion
            .tool_calls
            .iter()
            .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
            .collect();
        let assistant = Message {
            role: "assistant".into(),
            content: completion.content.clone().map(as_text),
            tool_calls: (!wire_calls.is_empty())
                .then(|| Value::Array(wire_calls.clone()).to_string()),
            finish_reason: completion.finish_reason.clone(),
            // The turn's own size (its completion tokens), as hermes records
            // it: a running child's usage so far is read from these.
            token_count: i64::try_from(completion.tokens.output).ok(),
            ..Message::default()
        };
        if let Err(reason) = self.append(&assistant) {
            self.sink_failed(reason);
            return ControlFlow::Break(());
        }
        let mut wire = json!({"role": "assistant", "content": completion.content});
        if !wire_calls.is_empty() {
            wire["tool_calls"] = Value::Array(wire_calls);
        }
        messages.push(wire);
        ControlFlow::Continue(())
    }

    /// Runs an answer's tool calls and records their results. Stopped or
    /// not, every call gets a result (a stopped child's are "not run"), so
    /// the transcript stays valid.
    fn answer_tools(
        &mut self,
        calls: &[ToolCall],
        names: &[String],
        messages: &mut Vec<Value>,
    ) -> ControlFlow<()> {
        let outputs = self.run_tools(calls, names);
        for (call, output) in calls.iter().zip(outputs) {
            let output = self.within_output_cap(as_text(output));
            let result = Message {
                role: "tool".into(),
                content: Some(output.clone()),
                tool_call_id: Some(call.id.clone()),
                tool_name: Some(call.name.clone()),
                ..Message::default()
            };
            if let Err(reason) = self.append(&result) {
                self.sink_failed(reason);
                return ControlFlow::Break(());
            }
            messages.push(json!({"role": "tool", "tool_call_id": call.id, "content": output}));
        }
        ControlFlow::Continue(())
    }

    /// Runs the tool calls of one answer, a few at a time (bounded by
    /// `max_parallel_tools`); the outputs keep the calls' order.
    fn run_tools(&self, calls: &[crate::client::ToolCall], names: &[String]) -> Vec<String> {
        let rt = self.rt;
        let child = self.child;
        let ctx = self.ctx;
        // Tool calls may run on threads: their spans take the child's
        // context explicitly.
        let parent = opentelemetry::Context::current();
        let one_call = |call: &crate::client::ToolCall| -> String {
            if !names.contains(&call.name) {
                let available = if names.is_empty() { "none".to_owned() } else { names.join(", ") };
                return tool_error(&format!(
                    "unknown tool `{}`; available tools: {available}",
                    call.name
                ));
            }
            let args = if call.arguments.trim().is_empty() {
                Ok(json!({}))
            } else {
                serde_json::from_str::<Value>(&call.arguments)
            };
            match args {
                Err(e) => tool_error(&format!("the arguments are not valid JSON ({e})")),
                Ok(args) if !args.is_object() => tool_error("the arguments must be a JSON object"),
                Ok(args) => match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    rt.tools.execute_in(child, &call.name, &args, ctx)
                })) {
                    Ok(Ok(out)) => out,
                    Ok(Err(e)) => tool_error(&e.to_string()),
                    Err(_) => tool_error(&format!("the tool `{}` failed unexpectedly", call.name)),
                },
            }
        };
        let one = |call: &crate::client::ToolCall| -> String {
            let span = crate::spans::tool(&parent, &call.name, &call.id);
            // Current on this (possibly pooled) thread: a nested
            // delegate_task nests under the tool call.
            let _attached = span.clone().attach();
            let out = one_call(call);
            crate::spans::tool_done(&span, &out);
            out
        };
        let width = rt.config.max_parallel_tools.max(1);
        let (run, skipped) = calls.split_at(calls.len().min(MAX_TOOL_CALLS_PER_ANSWER));
        let mut out = Vec::with_capacity(calls.len());
        for chunk in run.chunks(width) {
            if self.ctx.cancel.is_cancelled() {
                // Stopped: the rest are answered, not run (the transcript
                // keeps a result for every call).
                out.extend(chunk.iter().map(|_| tool_error("not run: the child was stopped")));
                continue;
            }
            if chunk.len() == 1 {
                out.push(one(&chunk[0]));
                continue;
            }
            let done: Vec<String> = std::thread::scope(|scope| {
                // A thread that cannot be started runs its call here instead.
                let handles: Vec<_> = chunk
                    .iter()
                    .map(|c| {
                        std::thread::Builder::new()
                            .name("tool-call".into())
                            .spawn_scoped(scope, || one(c))
                            .map_err(|_| one(c))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| match h {
                        Ok(h) => h.join().unwrap_or_else(|_| tool_error("the tool call failed")),
                        Err(done) => done,
                    })
                    .collect()
            });
            out.extend(done);
        }
        out.extend(skipped.iter().map(|_| {
            tool_error(&format!(
                "not run: an answer may make at most {MAX_TOOL_CALLS_PER_ANSWER} tool calls"
            ))
        }));
        out
    }

    /// Cuts `output` to what is left of the run's tool-output allowance.
    fn within_output_cap(&mut self, output: String) -> String {
        let cap = self.rt.config.max_tool_output_chars;
        if cap == 0 {
            // 0: no cap.
            return output;
        }
        let left = cap.saturating_sub(self.tool_chars);
        let len = output.chars().count();
        if len <= left {
            self.tool_chars += len;
            return output;
        }
        self.tool_chars = cap;
        let kept: String = output.chars().take(left).collect();
        format!(
            "{kept}\n\n[tool output cut: this run has used its allowance of {cap} characters of \
             tool output (delegation.max_tool_output_chars); {} characters were dropped — finish \
             with what you have]",
            len - left
        )
    }
}

/// The most tool calls of one answer that run; the rest are answered
/// with an error.
const MAX_TOOL_CALLS_PER_ANSWER: usize = 64;

/// A tool error as hermes writes it: `{"error": TEXT}`.
fn tool_error(text: &str) -> String {
    json!({ "error": text }).to_string()
}

impl ChildRuntime for ChatRuntime {
    fn build(&self, spec: &ChildSpec) -> Result<ChildHandle, RuntimeError> {
        let pick = |child: &Option<String>, ours: &str| {
            child.as_deref().map(str::trim).filter(|s| !s.is_empty()).unwrap_or(ours).to_owned()
        };
        let api_mode = pick(&spec.api_mode, &self.config.api_mode);
        check_api_mode(&api_mode).map_err(|e| RuntimeError::Config(e.to_string()))?;
        // The model: the operator's override, else the child's own (a
        // follow-up's stored model), else the configured one.
        let model = match self.config.model_override.as_deref().map(str::trim) {
            Some(m) if !m.is_empty() => m.to_owned(),
            _ => pick(&spec.model, &self.config.model),
        };
        // The endpoint is always the configured one: a child spec carries
        // none, and a stored endpoint (read from a database another program
        // may write) is never contacted, so the key only ever goes where the
        // operator pointed it.
        let base_url = self.config.base_url.trim().to_owned();
        let mut missing = Vec::new();
        if model.is_empty() {
            missing.push("`delegation.model` (or --model)");
        }
        if base_url.is_empty() {
            missing.push("`delegation.base_url` (or --base-url, or a known `delegation.provider`)");
        }
        if !missing.is_empty() {
            return Err(RuntimeError::Config(format!(
                "no model endpoint configured: set {} in config.yaml",
                missing.join(" and ")
            )));
        }
        let max_iterations =
            if spec.max_iterations > 0 { spec.max_iterations } else { self.config.max_iterations };
        self.children().insert(
            spec.subagent_id.clone(),
            Child {
                base_url,
                model,
                provider: spec
                    .provider
                    .clone()
                    .filter(|p| !p.trim().is_empty())
                    .unwrap_or_else(|| "openai".to_owned()),
                max_iterations,
                steers: Vec::new(),
                open: true,
            },
        );
        Ok(ChildHandle::of(spec))
    }

    fn run(
        &self,
        child: &ChildHandle,
        input: &RunInput,
        sink: &dyn TranscriptSink,
        ctx: &RunContext,
    ) -> ChildOutcome {
        let settings = self.child_settings(child);
        let (settings_model, settings_url) = (settings.model.clone(), settings.base_url.clone());
        let mut run = Run {
            rt: self,
            child,
            settings,
            sink,
            ctx,
            outcome: ChildOutcome::default(),
            tool_chars: 0,
        };
        run.go(input);
        let mut outcome = run.outcome;
        outcome.missed_steers = self.close(child);
        outcome.model = Some(settings_model);
        outcome.endpoint = Some(retinue_core::redact_endpoint(&settings_url));
        outcome
    }

    fn steer(&self, child: &ChildHandle, message: &str) -> bool {
        match self.children().get_mut(&child.subagent_id) {
            Some(c) if c.open => {
                c.steers.push(message.to_owned());
                true
            }
            _ => false,
        }
    }
}

/// A run's opening turns: the system prompt, the history (a resume's), the
/// user message.
fn opening_messages(input: &RunInput) -> Vec<Value> {
    let mut messages: Vec<Value> = Vec::new();
    if let Some(system) = input.system_prompt.as_deref().filter(|s| !s.is_empty()) {
        messages.push(json!({"role": "system", "content": system}));
    }
    messages.extend(wire_history(&input.history));
    messages.push(json!({"role": "user", "content": input.user_message}));
    messages
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: Some(content.into()), ..Message::default() }
    }

    fn call(ids: &[&str]) -> Message {
        let calls: Vec<Value> = ids
            .iter()
            .map(|id| json!({"id": id, "type": "function", "function": {"name": "read_file", "arguments": "{}"}}))
            .collect();
        Message {
            role: "assistant".into(),
            tool_calls: Some(Value::Array(calls).to_string()),
            ..Message::default()
        }
    }

    fn result(id: &str) -> Message {
        Message {
            tool_call_id: Some(id.into()),
            tool_name: Some("read_file".into()),
            ..m("tool", &format!("out {id}"))
        }
    }

    fn shape(v: &[Value]) -> Vec<String> {
        v.iter()
            .map(|w| match w["role"].as_str() {
                Some("tool") => format!("tool:{}", w["tool_call_id"].as_str().unwrap_or("?")),
                Some(r) => r.to_owned(),
                None => "?".into(),
            })
            .collect()
    }

    #[test]
    fn tool_rows_follow_their_call_in_order_and_gaps_are_filled() {
        let history = vec![
            m("system", "s"),
            m("user", "go"),
            call(&["a", "b"]),
            result("b"),
            result("a"),
            result("zzz"),
            m("user", "steer"),
            call(&["c"]),
            // the run stopped: c has no result
            m("user", "follow-up"),
            result("orphan"),
        ];
        let wire = wire_history(&history);
        assert_eq!(
            shape(&wire),
            ["user", "assistant", "tool:a", "tool:b", "user", "assistant", "tool:c", "user"]
        );
        assert!(wire[6]["content"].as_str().is_some_and(|c| c.contains("no result")));
        assert_eq!(wire[2]["content"], "out a");
    }
}
