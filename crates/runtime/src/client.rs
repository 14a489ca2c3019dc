//! One model call over HTTP: request, retries, response and SSE parsing.

use std::io::{BufRead, BufReader};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use retinue_core::run::{CancelToken, RunTokens};
use serde_json::Value;

use crate::error::scrub;
use crate::{ChatError, RuntimeConfig};

/// Largest non-streamed response body read.
const MAX_BODY: u64 = 64 * 1024 * 1024;

/// One tool call of an assistant message.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct ToolCall {
    pub(crate) id: String,
    pub(crate) name: String,
    pub(crate) arguments: String,
}

/// A model call's answer.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Completion {
    pub(crate) content: Option<String>,
    pub(crate) tool_calls: Vec<ToolCall>,
    pub(crate) finish_reason: Option<String>,
    pub(crate) tokens: RunTokens,
    /// The provider-reported cost (`usage.cost`).
    pub(crate) cost: Option<f64>,
    /// Whether the provider reported usage at all.
    pub(crate) usage_reported: bool,
}

/// How a call ended.
#[derive(Debug)]
pub(crate) enum CallOutcome {
    /// An answer.
    Done(Completion),
    /// The cancel token fired (explicit cancel or deadline).
    Stopped,
    /// An error that retrying did not (or could not) cure.
    Failed(ChatError),
}

/// One attempt's failure.
enum Attempt {
    Retry { why: String, retry_after: Option<Duration> },
    Fatal(ChatError),
    Stopped,
}

/// What one request needs (owned: each attempt runs on a thread of its
/// own, so a cancel never waits for a blocked socket).
#[derive(Clone)]
pub(crate) struct Call {
    pub(crate) agent: ureq::Agent,
    pub(crate) config: std::sync::Arc<RuntimeConfig>,
    pub(crate) base_url: String,
    pub(crate) model: String,
    pub(crate) body: std::sync::Arc<str>,
    pub(crate) stream: bool,
    pub(crate) cancel: CancelToken,
}

/// How often a waiting call looks at its cancel token.
const CANCEL_POLL: Duration = Duration::from_millis(50);

/// Attempts in flight on the `blocking` pool (whose default limit is 500).
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// Most attempts on the pool at once; more get threads of their own.
const POOLED_MAX: usize = 256;

/// One attempt counted in [`IN_FLIGHT`] until dropped (also on a panic).
struct InFlight;

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How long a caller yields before it sleeps on the answer: a call to a
/// local server answers within it, and waking a sleeping thread costs more
/// than the call (`examples/runtime.rs` in retinue-bench).
const SPIN: Duration = Duration::from_micros(300);

impl Call {
    /// `{base_url}/chat/completions`, the path joined before any query
    /// (`…/v1?api_key=K` → `…/v1/chat/completions?api_key=K`).
    fn url(&self) -> String {
        // The userinfo is never sent (ureq would turn it into Basic auth).
        let (stripped, _) = retinue_core::strip_userinfo(&self.base_url);
        let (base, query) = match stripped.split_once('?') {
            Some((base, query)) => (base, Some(query)),
            None => (stripped.as_str(), None),
        };
        let mut url = format!("{}/chat/completions", base.trim_end_matches('/'));
        if let Some(query) = query {
            url.push('?');
            url.push_str(query);
        }
        url
    }

    fn key(&self) -> Option<&str> {
        self.config.api_key.expose()
    }

    /// The URL called, as messages and logs may show it.
    fn shown_url(&self) -> String {
        retinue_core::redact_endpoint(&self.url())
    }

    /// `text` with the key and the endpoint's secrets (userinfo, query
    /// values) removed.
    fn clean(&self, text: &str) -> String {
        let mut out = scrub(text, self.key());
        for raw in [self.base_url.clone(), self.url()] {
            if !raw.is_empty() && out.contains(&raw) {
                out = out.replace(&raw, &retinue_core::redact_endpoint(&raw));
            }
        }
        if let Some((_, query)) = self.base_url.split_once('?') {
            for value in query.split('&').filter_map(|kv| kv.split_once('=').map(|(_, v)| v)) {
                if value.len() >= 4 {
                    out = out.replace(value, "***");
                }
            }
        }
        out
    }

    /// Sends the request, retrying what may be retried.
    pub(crate) fn run(&self) -> CallOutcome {
        let policy = self.config.retry;
        let mut attempt: u32 = 0;
        loop {
            if self.cancel.is_cancelled() {
                return CallOutcome::Stopped;
            }
            attempt += 1;
            match self.attempt_interruptible() {
                Ok(c) => return CallOutcome::Done(c),
                Err(Attempt::Stopped) => return CallOutcome::Stopped,
                Err(Attempt::Fatal(e)) => return CallOutcome::Failed(e),
                Err(Attempt::Retry { why, retry_after }) => {
                    let why = self.clean(&why);
                    if attempt > policy.max_retries {
                        return CallOutcome::Failed(ChatError::Exhausted {
                            attempts: attempt,
                            last: why,
                        });
                    }
                    let pause = retry_after
                        .unwrap_or_else(|| backoff(policy.base_delay, attempt))
                        .min(policy.max_delay);
                    log::warn!(
                        "model call to {} failed ({why}); retry {attempt}/{} in {:?}",
                        self.shown_url(),
                        policy.max_retries,
                        pause
                    );
                    if self.cancel.sleep(pause) {
                        return CallOutcome::Stopped;
                    }
                }
            }
        }
    }

    /// One attempt on a thread of the `blocking` pool: a cancel (or the
    /// deadline) returns at once, within [`CANCEL_POLL`], even while the
    /// socket is blocked; the abandoned attempt ends by its own timeouts and
    /// nothing it gets is used. The pool keeps a finished call's thread for
    /// the next call (a new thread per call cost as much as the call to a
    /// local server), and grows with the calls in flight (to 500 by
    /// default, `BLOCKING_MAX_THREADS`).
    fn attempt_interruptible(&self) -> Result<Completion, Attempt> {
        let (tx, rx) = std::sync::mpsc::channel();
        let call = self.clone();
        let job = move || {
            let _ = tx.send(call.attempt());
        };
        // The pool while it has room: attempts abandoned by a cancel keep
        // their thread until their own timeouts, and a full pool would queue
        // new attempts behind them. Beyond `POOLED_MAX` in flight, a thread
        // of its own (as before the pool), else the attempt right here.
        if IN_FLIGHT.fetch_add(1, Ordering::SeqCst) < POOLED_MAX {
            let slot = InFlight;
            // Spawned eagerly; detached, it runs to its end unobserved.
            blocking::unblock(move || {
                let _slot = slot;
                job();
            })
            .detach();
        } else {
            drop(InFlight);
            let spawned = std::thread::Builder::new().name("model-call".to_owned()).spawn(job);
            if spawned.is_err() {
                return self.attempt();
            }
        }
        // A fast answer (a local server) is taken without going to sleep:
        // a short yielding wait first, then the blocking one.
        let spin_until = std::time::Instant::now() + SPIN;
        while std::time::Instant::now() < spin_until {
            match rx.try_recv() {
                Ok(result) => return result,
                Err(std::sync::mpsc::TryRecvError::Empty) => std::thread::yield_now(),
                Err(std::sync::mpsc::TryRecvError::Disconnected) => break,
            }
        }
        loop {
            match rx.recv_timeout(CANCEL_POLL) {
                Ok(result) => return result,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    if self.cancel.is_cancelled() {
                        return Err(Attempt::Stopped);
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(Attempt::Fatal(ChatError::Malformed(
                        "the model call ended without an answer".to_owned(),
                    )));
                }
            }
        }
    }

    fn attempt(&self) -> Result<Completion, Attempt> {
        let mut timeout = self.config.request_timeout;
        if let Some(left) = self.cancel.remaining() {
            if left.is_zero() {
                return Err(Attempt::Stopped);
            }
            timeout = timeout.min(left);
        }
        let url = self.url();
        let mut req = self
            .agent
            .post(&url)
            .header("content-type", "application/json")
            .header("accept", if self.stream { "text/event-stream" } else { "application/json" });
        if let Some(key) = self.key() {
            req = req.header("authorization", format!("Bearer {key}"));
        }
        let sent = req.config().timeout_global(Some(timeout)).build().send(&*self.body);
        let response = match sent {
            Ok(r) => r,
            Err(e) => return Err(self.transport(&e)),
        };
        let status = response.status().as_u16();
        let location = response
            .headers()
            .get("location")
            .and_then(|v| v.to_str().ok())
            .map(retinue_core::redact_endpoint);
        let retry_after = response
            .headers()
            .get("retry-after")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
            .map(Duration::from_secs_f64);
        let is_sse = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("text/event-stream"));
        let mut body = response.into_body();
        if status == 200 && is_sse {
            return self.read_stream(body.into_reader());
        }
        let text = match body.with_config().limit(MAX_BODY).read_to_string() {
            Ok(t) => t,
            Err(e) => return Err(self.transport(&e)),
        };
        if status == 200 {
            let v: Value = serde_json::from_str(&text).map_err(|e| {
                Attempt::Fatal(ChatError::Malformed(format!("the body is not JSON ({e})")))
            })?;
            return parse_completion(&v).map_err(|e| {
                // A provider's own text may echo the endpoint's secrets.
                let e: ChatError = e.into();
                Attempt::Fatal(match e {
                    ChatError::Malformed(t) => ChatError::Malformed(self.clean(&t)),
                    ChatError::Usage(t) => ChatError::Usage(self.clean(&t)),
                    other => other,
                })
            });
        }
        let message = self.clean(&provider_message(&text));
        Err(match status {
            301..=308 => Attempt::Fatal(ChatError::Redirected {
                status,
                url: self.shown_url(),
                location: self.clean(&location.unwrap_or_default()),
            }),
            401 | 403 => Attempt::Fatal(ChatError::KeyRejected {
                status,
                base_url: retinue_core::redact_endpoint(&self.base_url),
                origin: self.config.api_key_origin.clone(),
            }),
            404 => Attempt::Fatal(ChatError::NotFound {
                url: retinue_core::redact_endpoint(&url),
                model: self.model.to_owned(),
                message,
            }),
            400 => Attempt::Fatal(ChatError::BadRequest { message }),
            408 | 409 | 429 | 500..=599 => {
                Attempt::Retry { why: format!("HTTP {status}: {message}"), retry_after }
            }
            _ => Attempt::Fatal(ChatError::Status { status, message }),
        })
    }

    fn transport(&self, e: &ureq::Error) -> Attempt {
        if self.cancel.is_cancelled() {
            return Attempt::Stopped;
        }
        let text = self.clean(&e.to_string());
        match e {
            ureq::Error::Timeout(_) => {
                Attempt::Retry { why: format!("request timed out ({text})"), retry_after: None }
            }
            ureq::Error::Io(_)
            | ureq::Error::ConnectionFailed
            | ureq::Error::Protocol(_)
            | ureq::Error::BodyStalled => {
                Attempt::Retry { why: format!("connection error: {text}"), retry_after: None }
            }
            ureq::Error::BadUri(_) | ureq::Error::HostNotFound | ureq::Error::Http(_) => {
                Attempt::Fatal(ChatError::Unreachable { url: self.shown_url(), message: text })
            }
            _ => Attempt::Fatal(ChatError::Malformed(text)),
        }
    }

    /// Reads an SSE stream, assembling the message; checks cancellation
    /// between lines.
    fn read_stream(&self, reader: impl std::io::Read) -> Result<Completion, Attempt> {
        let mut lines = BufReader::new(reader);
        let mut acc = StreamAcc::default();
        let mut line = String::new();
        loop {
            if self.cancel.is_cancelled() {
                return Err(Attempt::Stopped);
            }
            line.clear();
            match lines.read_line(&mut line) {
                Ok(0) => {
                    return Err(Attempt::Retry {
                        why: "the stream ended before `data: [DONE]`".to_owned(),
                        retry_after: None,
                    });
                }
                Ok(_) => {}
                Err(e) => {
                    if self.cancel.is_cancelled() {
                        return Err(Attempt::Stopped);
                    }
                    return Err(Attempt::Retry {
                        why: format!("stream interrupted: {}", scrub(&e.to_string(), self.key())),
                        retry_after: None,
                    });
                }
            }
            let Some(data) = line.trim_end().strip_prefix("data:") else { continue };
            let data = data.trim_start();
            if data == "[DONE]" {
                return Ok(acc.finish());
            }
            let chunk: Value = serde_json::from_str(data).map_err(|e| {
                Attempt::Fatal(ChatError::Malformed(format!("a stream chunk is not JSON ({e})")))
            })?;
            acc.add(&chunk, self.key()).map_err(Attempt::Fatal)?;
        }
    }
}

/// `base * 2^(attempt-1)`, times a jitter factor in [0.5, 1.0).
fn backoff(base: Duration, attempt: u32) -> Duration {
    let exp = base.saturating_mul(1u32 << attempt.saturating_sub(1).min(16));
    let r = getrandom::u32().unwrap_or(0);
    let factor = 0.5 + f64::from(r) / (f64::from(u32::MAX) * 2.0);
    exp.mul_f64(factor)
}

/// The provider's `error.message`, or the body (shortened).
fn provider_message(body: &str) -> String {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let msg = parsed.as_ref().and_then(|v| {
        v["error"]["message"]
            .as_str()
            .or_else(|| v["error"].as_str())
            .or_else(|| v["message"].as_str())
            .map(str::to_owned)
    });
    msg.unwrap_or_else(|| {
        let t = body.trim();
        if t.chars().count() > 300 {
            t.chars().take(300).collect::<String>() + "…"
        } else {
            t.to_owned()
        }
    })
}

/// Most tokens one model call can really use: beyond every real context
/// window (the largest are about 10 million tokens), so a larger count is a
/// lie or a bug, never a bill.
pub(crate) const MAX_CALL_TOKENS: u64 = 100_000_000;

/// Most dollars one model call can really cost.
pub(crate) const MAX_CALL_USD: f64 = 10_000.0;

/// One token count of a `usage` object: absent or null is 0; an integer or
/// a whole-number float (`1000.0`, common behind proxies) counts; anything
/// else (negative, fractional, NaN, a string, beyond [`MAX_CALL_TOKENS`]) is
/// an error naming the field.
fn count(usage: &Value, path: &[&str]) -> Result<u64, String> {
    let mut v = usage;
    for key in path {
        v = &v[*key];
    }
    let name = path.join(".");
    let n = match v {
        Value::Null => return Ok(0),
        Value::Number(n) => match n.as_u64() {
            Some(u) => Some(u),
            None => n.as_f64().filter(|f| f.is_finite() && *f >= 0.0 && f.fract() == 0.0).map(
                // Bounded below by the check that follows.
                |f| if f > MAX_CALL_TOKENS as f64 { u64::MAX } else { f as u64 },
            ),
        },
        _ => None,
    };
    match n {
        Some(n) if n <= MAX_CALL_TOKENS => Ok(n),
        Some(_) => Err(format!("`usage.{name}` is {v}, beyond any real context window")),
        None => Err(format!("`usage.{name}` is {v}, not a whole number of tokens")),
    }
}

/// Reads a `usage` object: the token counts and the provider's cost;
/// unusable values are an error (see [`count`]).
pub(crate) fn parse_usage(usage: &Value) -> Result<(RunTokens, Option<f64>), String> {
    if !usage.is_object() {
        return Err(format!("`usage` is {usage}, not an object"));
    }
    let tokens = RunTokens {
        input: count(usage, &["prompt_tokens"])?,
        output: count(usage, &["completion_tokens"])?,
        cached_input: count(usage, &["prompt_tokens_details", "cached_tokens"])?,
        reasoning: count(usage, &["completion_tokens_details", "reasoning_tokens"])?,
    };
    let cost = match &usage["cost"] {
        Value::Null => None,
        Value::Number(n) => match n.as_f64() {
            Some(c) if c.is_finite() && (0.0..=MAX_CALL_USD).contains(&c) => Some(c),
            _ => return Err(format!("`usage.cost` is {n}, not a believable dollar amount")),
        },
        other => return Err(format!("`usage.cost` is {other}, not a number")),
    };
    Ok((tokens, cost))
}

/// Why a response could not be read.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ParseError {
    /// Not a Chat Completions answer.
    Shape(String),
    /// Its usage cannot be believed.
    Usage(String),
}

impl From<&str> for ParseError {
    fn from(s: &str) -> ParseError {
        ParseError::Shape(s.to_owned())
    }
}

impl From<String> for ParseError {
    fn from(s: String) -> ParseError {
        ParseError::Shape(s)
    }
}

impl From<ParseError> for ChatError {
    fn from(e: ParseError) -> ChatError {
        match e {
            ParseError::Shape(s) => ChatError::Malformed(s),
            ParseError::Usage(s) => ChatError::Usage(s),
        }
    }
}

/// Reads a non-streamed Chat Completions response.
pub(crate) fn parse_completion(v: &Value) -> Result<Completion, ParseError> {
    if let Some(err) = v.get("error").filter(|e| !e.is_null()) {
        let msg = err["message"].as_str().unwrap_or("unknown error");
        return Err(format!("the provider answered with an error: {msg}").into());
    }
    let choice = v["choices"].get(0).ok_or("no `choices[0]` in the response")?;
    let message =
        choice.get("message").filter(|m| m.is_object()).ok_or("no `message` in `choices[0]`")?;
    let content = match &message["content"] {
        Value::Null => None,
        Value::String(s) => Some(s.clone()),
        other => Some(other.to_string()),
    };
    let mut tool_calls = Vec::new();
    if let Some(calls) = message["tool_calls"].as_array() {
        for c in calls {
            let name =
                c["function"]["name"].as_str().ok_or("a tool call has no `function.name`")?;
            let arguments = match &c["function"]["arguments"] {
                Value::String(s) => s.clone(),
                Value::Null => String::new(),
                other => other.to_string(),
            };
            tool_calls.push(ToolCall {
                id: c["id"].as_str().unwrap_or_default().to_owned(),
                name: name.to_owned(),
                arguments,
            });
        }
    }
    let usage_reported = !v["usage"].is_null();
    let (tokens, cost) = if usage_reported {
        parse_usage(&v["usage"]).map_err(ParseError::Usage)?
    } else {
        (RunTokens::default(), None)
    };
    Ok(Completion {
        content,
        tool_calls,
        finish_reason: choice["finish_reason"].as_str().map(str::to_owned),
        tokens,
        cost,
        usage_reported,
    })
}

/// Assembles streamed deltas.
#[derive(Default)]
struct StreamAcc {
    content: Option<String>,
    calls: Vec<ToolCall>,
    finish_reason: Option<String>,
    tokens: RunTokens,
    cost: Option<f64>,
    usage_reported: bool,
}

impl StreamAcc {
    fn add(&mut self, chunk: &Value, key: Option<&str>) -> Result<(), ChatError> {
        if let Some(err) = chunk.get("error").filter(|e| !e.is_null()) {
            let msg = err["message"].as_str().unwrap_or("unknown error");
            return Err(ChatError::Malformed(format!(
                "the provider sent an error mid-stream: {}",
                scrub(msg, key)
            )));
        }
        if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
            let (t, c) = parse_usage(usage).map_err(ChatError::Usage)?;
            self.tokens = t;
            self.cost = c;
            self.usage_reported = true;
        }
        let Some(choice) = chunk["choices"].get(0) else { return Ok(()) };
        if let Some(reason) = choice["finish_reason"].as_str() {
            self.finish_reason = Some(reason.to_owned());
        }
        let delta = &choice["delta"];
        if let Some(text) = delta["content"].as_str() {
            self.content.get_or_insert_with(String::new).push_str(text);
        }
        for d in delta["tool_calls"].as_array().into_iter().flatten() {
            let index = d["index"]
                .as_u64()
                .and_then(|i| usize::try_from(i).ok())
                .unwrap_or(self.calls.len());
            if index > self.calls.len() + 128 {
                return Err(ChatError::Malformed(format!("tool call index {index} out of range")));
            }
            while self.calls.len() <= index {
                self.calls.push(ToolCall::default());
            }
            let call = &mut self.calls[index];
            if let Some(id) = d["id"].as_str() {
                call.id = id.to_owned();
            }
            if let Some(name) = d["function"]["name"].as_str() {
                call.name.push_str(name);
            }
            if let Some(args) = d["function"]["arguments"].as_str() {
                call.arguments.push_str(args);
            }
        }
        Ok(())
    }

    fn finish(self) -> Completion {
        Completion {
            content: self.content.filter(|c| !c.is_empty()),
            tool_calls: self.calls.into_iter().filter(|c| !c.name.is_empty()).collect(),
            finish_reason: self.finish_reason,
            tokens: self.tokens,
            cost: self.cost,
            usage_reported: self.usage_reported,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn malformed_shapes_are_errors_not_panics() {
        for v in [
            json!({}),
            json!({"choices": []}),
            json!({"choices": [{"message": 3}]}),
            json!({"choices": [{"message": {"tool_calls": [{"function": {}}]}}]}),
            json!({"error": {"message": "x"}}),
        ] {
            assert!(parse_completion(&v).is_err(), "{v}");
        }
    }

    #[test]
    fn usage_counts_whole_floats_and_refuses_what_cannot_be_billed() {
        let ok = parse_usage(&json!({"prompt_tokens": 1000.0, "completion_tokens": 20}));
        assert_eq!(ok.map(|(t, _)| (t.input, t.output)), Ok((1000, 20)));
        let cost = parse_usage(&json!({"prompt_tokens": 1, "cost": 0.25}));
        assert_eq!(cost.map(|(_, c)| c), Ok(Some(0.25)));
        for bad in [
            json!({"prompt_tokens": -1}),
            json!({"prompt_tokens": 1.5}),
            json!({"prompt_tokens": 1e30}),
            json!({"prompt_tokens": "1000"}),
            json!({"completion_tokens": true}),
            json!({"prompt_tokens": 100_000_001_u64}),
            json!({"prompt_tokens_details": {"cached_tokens": -3}}),
            json!({"prompt_tokens": 1, "cost": -0.5}),
            json!({"prompt_tokens": 1, "cost": 1e9}),
            json!({"prompt_tokens": 1, "cost": "0.1"}),
            json!("usage"),
        ] {
            let e = parse_usage(&bad);
            assert!(e.is_err(), "{bad} was accepted: {e:?}");
        }
        // Inside a response, bad usage is a usage error (billed what was
        // held), a missing one is reported as missing.
        let v = json!({"choices": [{"message": {"content": "x"}}], "usage": {"prompt_tokens": -5}});
        assert!(matches!(parse_completion(&v), Err(ParseError::Usage(_))));
        let v = json!({"choices": [{"message": {"content": "x"}}]});
        assert_eq!(parse_completion(&v).map(|c| c.usage_reported), Ok(false));
    }

    #[test]
    fn backoff_doubles_with_jitter() {
        let b = Duration::from_millis(100);
        for attempt in 1..5 {
            let d = backoff(b, attempt);
            let full = b * (1 << (attempt - 1));
            assert!(d >= full / 2 && d <= full, "{d:?} vs {full:?}");
        }
    }

    #[test]
    fn provider_message_prefers_error_message() {
        assert_eq!(provider_message(r#"{"error":{"message":"too long"}}"#), "too long");
        assert_eq!(provider_message("plain"), "plain");
    }
}
