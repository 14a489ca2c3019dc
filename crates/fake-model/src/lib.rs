//! `retinue-fake-model`: a fake OpenAI-compatible model server — `POST
//! …/chat/completions` on `127.0.0.1` at an ephemeral port, answering from a
//! script. Its own small crate (std and serde_json only), so the release
//! binary's `retinue demo` carries it without the rest of the test kit
//! (`retinue-testkit` re-exports it as `fake_model` for the tests).
//!
//! ```
//! use retinue_fake_model::{FakeModel, Reply, Usage};
//! let server = FakeModel::start();
//! server.push(Reply::tool_call("call_1", "read_file", serde_json::json!({"path": "a.txt"})));
//! server.push(Reply::text("done").with_usage(Usage::new(120, 8).cost(0.0004)));
//! let base_url = server.base_url(); // "http://127.0.0.1:PORT/v1"
//! # drop(base_url);
//! // … run the client; then assert what it sent:
//! assert!(server.requests().is_empty());
//! ```
//!
//! Each request takes the next scripted [`Reply`] from the queue, else the
//! default (`Reply::text("ok")` unless [`FakeModel::set_default`] changed it);
//! a handler set with [`FakeModel::set_handler`] may answer first. A text or
//! tool-call reply is streamed as server-sent events when the request asked
//! for `"stream": true` (as a real server does), with the usage in the last
//! chunk before `data: [DONE]`. Every request is recorded ([`RecordedRequest`]:
//! method, path, headers, raw and parsed body).
//!
//! Why std `TcpListener` and a small HTTP/1.1 reader rather than an HTTP
//! server crate: the script needs byte-level control a server framework hides
//! — dropping a connection after reading the request, answering with a
//! malformed body, flushing SSE chunks one by one with pauses between them —
//! and the fake only has to read what an HTTP client sends to it (a request
//! line, headers and a `Content-Length` body; anything else is refused with
//! 411/400). Connections are kept alive between requests, as client pools
//! expect. Dropping the [`FakeModel`] stops the listener, shuts every open
//! connection and wakes every scripted delay; its threads are plain threads,
//! so they never outlive the test process.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// Largest request head (request line and headers) the fake reads.
const MAX_HEAD: usize = 64 * 1024;
/// Largest request body the fake reads.
const MAX_BODY: usize = 32 * 1024 * 1024;
/// How long an idle kept-alive connection waits for its next request.
const IDLE: Duration = Duration::from_secs(30);

/// The usage block of a reply (`usage` in the response, or in the last
/// streamed chunk).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Usage {
    /// `prompt_tokens` (cached ones included).
    pub prompt_tokens: u64,
    /// `completion_tokens` (reasoning ones included).
    pub completion_tokens: u64,
    /// `prompt_tokens_details.cached_tokens`.
    pub cached_tokens: u64,
    /// `completion_tokens_details.reasoning_tokens`.
    pub reasoning_tokens: u64,
    /// A provider-reported cost in US dollars (`usage.cost`, as OpenRouter).
    pub cost: Option<f64>,
}

impl Usage {
    /// `prompt` and `completion` tokens, nothing cached, no reasoning, no cost.
    pub fn new(prompt: u64, completion: u64) -> Usage {
        Usage { prompt_tokens: prompt, completion_tokens: completion, ..Usage::default() }
    }

    /// With `cached` prompt tokens.
    #[must_use]
    pub fn cached(mut self, cached: u64) -> Usage {
        self.cached_tokens = cached;
        self
    }

    /// With `reasoning` completion tokens.
    #[must_use]
    pub fn reasoning(mut self, reasoning: u64) -> Usage {
        self.reasoning_tokens = reasoning;
        self
    }

    /// With a provider-reported cost.
    #[must_use]
    pub fn cost(mut self, usd: f64) -> Usage {
        self.cost = Some(usd);
        self
    }

    /// The JSON `usage` object.
    pub fn to_json(&self) -> Value {
        let mut v = json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
        });
        if let (Some(cost), Some(map)) = (self.cost, v.as_object_mut()) {
            map.insert("cost".to_owned(), json!(cost));
        }
        v
    }
}

/// One tool call of a scripted reply.
#[derive(Debug, Clone, PartialEq)]
pub struct FakeToolCall {
    /// The call id (`call_…`).
    pub id: String,
    /// The tool's name.
    pub name: String,
    /// The arguments, sent as JSON text (as the API does).
    pub arguments: String,
}

impl FakeToolCall {
    /// A call of `name` with `arguments` (serialized to JSON text).
    pub fn new(id: &str, name: &str, arguments: &Value) -> FakeToolCall {
        FakeToolCall { id: id.to_owned(), name: name.to_owned(), arguments: arguments.to_string() }
    }
}

/// What a reply does.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplyKind {
    /// An assistant message, with optional text and tool calls.
    Message {
        /// Text content.
        content: Option<String>,
        /// Tool calls (none: a final answer).
        tool_calls: Vec<FakeToolCall>,
    },
    /// An HTTP error status with an OpenAI-style error body.
    Status {
        /// The status code.
        status: u16,
        /// `error.message`.
        message: String,
        /// A `Retry-After` header value.
        retry_after: Option<String>,
    },
    /// Status 200 with this body verbatim (e.g. malformed JSON).
    Raw {
        /// The body.
        body: String,
    },
    /// Read the request, then close the connection without answering.
    Drop,
    /// A redirect (`status` 301…308) to `location`.
    Redirect {
        /// The status code.
        status: u16,
        /// The `Location` header.
        location: String,
    },
}

/// One scripted answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Reply {
    /// What to answer.
    pub kind: ReplyKind,
    /// The usage block (messages only; `None`: no `usage` key).
    pub usage: Option<Usage>,
    /// A usage block sent exactly as given, overriding `usage`: the lying
    /// provider's modes (`1000.0`, `1e30`, `"1000"`, negative counts, …).
    pub usage_json: Option<Value>,
    /// Wait this long before answering (wakes early when the server drops).
    pub delay: Duration,
    /// Pause between streamed chunks.
    pub chunk_delay: Duration,
    /// `finish_reason` override (default `stop`, or `tool_calls`).
    pub finish_reason: Option<String>,
}

impl Reply {
    fn of(kind: ReplyKind) -> Reply {
        Reply {
            kind,
            usage: None,
            usage_json: None,
            delay: Duration::ZERO,
            chunk_delay: Duration::ZERO,
            finish_reason: None,
        }
    }

    /// A final text answer.
    pub fn text(content: &str) -> Reply {
        Reply::of(ReplyKind::Message { content: Some(content.to_owned()), tool_calls: Vec::new() })
    }

    /// One tool call of `name` with `arguments`.
    pub fn tool_call(id: &str, name: &str, arguments: Value) -> Reply {
        Reply::tool_calls(vec![FakeToolCall::new(id, name, &arguments)])
    }

    /// Several tool calls in one assistant message.
    pub fn tool_calls(calls: Vec<FakeToolCall>) -> Reply {
        Reply::of(ReplyKind::Message { content: None, tool_calls: calls })
    }

    /// An HTTP error `status` with `message` as the OpenAI-style `error.message`.
    pub fn status(status: u16, message: &str) -> Reply {
        Reply::of(ReplyKind::Status { status, message: message.to_owned(), retry_after: None })
    }

    /// 429 with `Retry-After: secs`.
    pub fn rate_limited(retry_after_secs: u64) -> Reply {
        Reply::of(ReplyKind::Status {
            status: 429,
            message: "Rate limit reached".to_owned(),
            retry_after: Some(retry_after_secs.to_string()),
        })
    }

    /// A redirect: `status` (301…308) with `Location: location`.
    pub fn redirect(status: u16, location: &str) -> Reply {
        Reply::of(ReplyKind::Redirect { status, location: location.to_owned() })
    }

    /// A 5xx (or any) server error.
    pub fn server_error(status: u16) -> Reply {
        Reply::status(status, "The server had an error while processing your request")
    }

    /// 401 with OpenAI's wording.
    pub fn unauthorized() -> Reply {
        Reply::status(401, "Incorrect API key provided")
    }

    /// Status 200 with a body that is not JSON.
    pub fn malformed() -> Reply {
        Reply::raw("{\"id\": \"chatcmpl-x\", \"choices\": [ {not json")
    }

    /// Status 200 with `body` verbatim.
    pub fn raw(body: &str) -> Reply {
        Reply::of(ReplyKind::Raw { body: body.to_owned() })
    }

    /// Close the connection without answering.
    pub fn drop_connection() -> Reply {
        Reply::of(ReplyKind::Drop)
    }

    /// With this `usage` value sent verbatim (a lying or broken provider).
    #[must_use]
    pub fn with_usage_json(mut self, usage: Value) -> Reply {
        self.usage_json = Some(usage);
        self
    }

    /// With this usage block.
    #[must_use]
    pub fn with_usage(mut self, usage: Usage) -> Reply {
        self.usage = Some(usage);
        self
    }

    /// With text content too (for a tool-call reply).
    #[must_use]
    pub fn with_content(mut self, text: &str) -> Reply {
        if let ReplyKind::Message { content, .. } = &mut self.kind {
            *content = Some(text.to_owned());
        }
        self
    }

    /// Answer after `delay`.
    #[must_use]
    pub fn delayed(mut self, delay: Duration) -> Reply {
        self.delay = delay;
        self
    }

    /// When streamed, pause `delay` between chunks.
    #[must_use]
    pub fn chunk_delay(mut self, delay: Duration) -> Reply {
        self.chunk_delay = delay;
        self
    }

    /// With this `finish_reason`.
    #[must_use]
    pub fn finish_reason(mut self, reason: &str) -> Reply {
        self.finish_reason = Some(reason.to_owned());
        self
    }
}

/// A request the fake received.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedRequest {
    /// `POST`, …
    pub method: String,
    /// The request target (`/v1/chat/completions`).
    pub path: String,
    /// Headers in order, names lower-cased.
    pub headers: Vec<(String, String)>,
    /// The body as text.
    pub raw_body: String,
    /// The body parsed as JSON (`Null` when it is not JSON).
    pub body: Value,
}

impl RecordedRequest {
    /// The first header named `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers.iter().find(|(n, _)| *n == name).map(|(_, v)| v.as_str())
    }

    /// The `messages` array of a chat request (empty if none).
    pub fn messages(&self) -> Vec<Value> {
        self.body["messages"].as_array().cloned().unwrap_or_default()
    }
}

/// Decides a reply from the request; `None` falls through to the script.
pub type Handler = Box<dyn Fn(&RecordedRequest) -> Option<Reply> + Send + Sync>;

#[derive(Default)]
struct Script {
    queue: VecDeque<Reply>,
    default: Option<Reply>,
    handler: Option<Arc<Handler>>,
    requests: Vec<RecordedRequest>,
    streams: Vec<TcpStream>,
}

struct Shared {
    script: Mutex<Script>,
    stopped: AtomicBool,
    stop_lock: Mutex<()>,
    stop_signal: Condvar,
}

impl Shared {
    fn script(&self) -> std::sync::MutexGuard<'_, Script> {
        self.script.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    /// Sleeps `d`, waking early when the server stops; `true` if stopped.
    fn pause(&self, d: Duration) -> bool {
        let until = Instant::now() + d;
        let mut guard = self.stop_lock.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if self.stopped() {
                return true;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            guard = match self.stop_signal.wait_timeout(guard, left) {
                Ok((g, _)) => g,
                Err(p) => p.into_inner().0,
            };
        }
    }
}

/// The running fake server; stops when dropped.
pub struct FakeModel {
    addr: SocketAddr,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for FakeModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeModel").field("addr", &self.addr).finish_non_exhaustive()
    }
}

impl FakeModel {
    /// Starts a server on `127.0.0.1:0`.
    ///
    /// # Panics
    /// If no local port can be bound (a broken test machine).
    pub fn start() -> FakeModel {
        let listener = TcpListener::bind("127.0.0.1:0").expect("fake model: bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("fake model: local address");
        let shared = Arc::new(Shared {
            script: Mutex::new(Script::default()),
            stopped: AtomicBool::new(false),
            stop_lock: Mutex::new(()),
            stop_signal: Condvar::new(),
        });
        let accepting = Arc::clone(&shared);
        let acceptor = std::thread::Builder::new()
            .name("fake-model-accept".into())
            .spawn(move || accept_loop(&listener, &accepting))
            .expect("fake model: spawn the accept thread");
        FakeModel { addr, shared, acceptor: Some(acceptor) }
    }

    /// The socket address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT/v1`, the `base_url` to configure.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// `http://127.0.0.1:PORT/v1/chat/completions`.
    pub fn chat_url(&self) -> String {
        format!("{}/chat/completions", self.base_url())
    }

    /// Queues a reply for the next request without one.
    pub fn push(&self, reply: Reply) -> &FakeModel {
        self.shared.script().queue.push_back(reply);
        self
    }

    /// Queues several replies in order.
    pub fn push_all(&self, replies: impl IntoIterator<Item = Reply>) -> &FakeModel {
        self.shared.script().queue.extend(replies);
        self
    }

    /// The reply used when the queue is empty.
    pub fn set_default(&self, reply: Reply) -> &FakeModel {
        self.shared.script().default = Some(reply);
        self
    }

    /// A handler consulted before the queue.
    pub fn set_handler(
        &self,
        handler: impl Fn(&RecordedRequest) -> Option<Reply> + Send + Sync + 'static,
    ) -> &FakeModel {
        self.shared.script().handler = Some(Arc::new(Box::new(handler)));
        self
    }

    /// Replies still queued.
    pub fn pending(&self) -> usize {
        self.shared.script().queue.len()
    }

    /// Every request received so far, in arrival order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.script().requests.clone()
    }

    /// How many requests arrived.
    pub fn request_count(&self) -> usize {
        self.shared.script().requests.len()
    }
}

impl Drop for FakeModel {
    fn drop(&mut self) {
        self.shared.stopped.store(true, Ordering::SeqCst);
        {
            let _guard = self.shared.stop_lock.lock().unwrap_or_else(PoisonError::into_inner);
            self.shared.stop_signal.notify_all();
        }
        // Wake the acceptor, then close every connection.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        for s in std::mem::take(&mut self.shared.script().streams) {
            let _ = s.shutdown(Shutdown::Both);
        }
        if let Some(t) = self.acceptor.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    for stream in listener.incoming() {
        if shared.stopped() {
            break;
        }
        let Ok(stream) = stream else { continue };
        if let Ok(clone) = stream.try_clone() {
            shared.script().streams.push(clone);
        }
        let conn = Arc::clone(shared);
        let _ = std::thread::Builder::new()
            .name("fake-model-conn".into())
            .spawn(move || serve_connection(stream, &conn));
    }
}

struct Head {
    method: String,
    path: String,
    headers: Vec<(String, String)>,
}

/// Reads one request; `None` at EOF, on a malformed request, or when stopped.
fn read_request(reader: &mut BufReader<TcpStream>, out: &mut TcpStream) -> Option<(Head, Vec<u8>)> {
    let mut line = String::new();
    let mut head_len = 0usize;
    // Request line (skip stray blank lines between requests).
    loop {
        line.clear();
        let n = reader.read_line(&mut line).ok()?;
        if n == 0 {
            return None;
        }
        head_len += n;
        if !line.trim().is_empty() {
            break;
        }
        if head_len > MAX_HEAD {
            return None;
        }
    }
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_owned();
    let path = parts.next()?.to_owned();
    let mut headers = Vec::new();
    loop {
        line.clear();
        let n = reader.read_line(&mut line).ok()?;
        head_len += n;
        if n == 0 || head_len > MAX_HEAD {
            return None;
        }
        let l = line.trim_end_matches(['\r', '\n']);
        if l.is_empty() {
            break;
        }
        let (name, value) = l.split_once(':')?;
        headers.push((name.trim().to_ascii_lowercase(), value.trim().to_owned()));
    }
    let head = Head { method, path, headers };
    let get = |n: &str| head.headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.as_str());
    if get("transfer-encoding").is_some() {
        let _ = write_response(
            out,
            411,
            "application/json",
            br#"{"error":{"message":"Content-Length required"}}"#,
            &[],
        );
        return None;
    }
    let len = match get("content-length").map(str::parse::<usize>) {
        None => 0,
        Some(Ok(n)) if n <= MAX_BODY => n,
        Some(_) => {
            let _ = write_response(
                out,
                400,
                "application/json",
                br#"{"error":{"message":"bad Content-Length"}}"#,
                &[],
            );
            return None;
        }
    };
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body).ok()?;
    Some((head, body))
}

fn write_response(
    out: &mut TcpStream,
    status: u16,
    content_type: &str,
    body: &[u8],
    extra: &[(&str, &str)],
) -> std::io::Result<()> {
    let mut head = format!(
        "HTTP/1.1 {status} {}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n",
        reason(status),
        body.len()
    );
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    let mut bytes = head.into_bytes();
    bytes.extend_from_slice(body);
    out.write_all(&bytes)?;
    out.flush()
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        411 => "Length Required",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        _ => "Status",
    }
}

fn serve_connection(stream: TcpStream, shared: &Arc<Shared>) {
    let _ = stream.set_read_timeout(Some(IDLE));
    let _ = stream.set_nodelay(true);
    let Ok(mut out) = stream.try_clone() else { return };
    let mut reader = BufReader::new(stream);
    while !shared.stopped() {
        let Some((head, body)) = read_request(&mut reader, &mut out) else { break };
        let raw_body = String::from_utf8_lossy(&body).into_owned();
        let recorded = RecordedRequest {
            method: head.method,
            path: head.path,
            headers: head.headers,
            body: serde_json::from_str(&raw_body).unwrap_or(Value::Null),
            raw_body,
        };
        let handler = shared.script().handler.clone();
        let from_handler = handler.and_then(|h| h(&recorded));
        let reply = {
            let mut script = shared.script();
            script.requests.push(recorded.clone());
            from_handler
                .or_else(|| script.queue.pop_front())
                .or_else(|| script.default.clone())
                .unwrap_or_else(|| Reply::text("ok"))
        };
        if !reply.delay.is_zero() && shared.pause(reply.delay) {
            break;
        }
        let route = recorded.path.split_once('?').map_or(recorded.path.as_str(), |(p, _)| p);
        if !route.ends_with("/chat/completions") || recorded.method != "POST" {
            let body = json!({"error": {"message": format!("no route for {} {}", recorded.method, recorded.path), "type": "invalid_request_error"}});
            if write_response(&mut out, 404, "application/json", body.to_string().as_bytes(), &[])
                .is_err()
            {
                break;
            }
            continue;
        }
        let close = recorded.header("connection").is_some_and(|c| c.eq_ignore_ascii_case("close"));
        let keep = answer(&mut out, &recorded, &reply, shared);
        if !keep || close {
            break;
        }
    }
    let _ = out.shutdown(Shutdown::Both);
}

/// Writes `reply`; `false` when the connection must close.
fn answer(out: &mut TcpStream, req: &RecordedRequest, reply: &Reply, shared: &Shared) -> bool {
    let model = req.body["model"].as_str().unwrap_or("fake-model").to_owned();
    match &reply.kind {
        ReplyKind::Drop => false,
        ReplyKind::Raw { body } => {
            write_response(out, 200, "application/json", body.as_bytes(), &[]).is_ok()
        }
        ReplyKind::Status { status, message, retry_after } => {
            let kind = match status {
                401 | 403 => "invalid_request_error",
                429 => "rate_limit_exceeded",
                400 | 404 => "invalid_request_error",
                _ => "server_error",
            };
            let body = json!({"error": {"message": message, "type": kind, "code": null}});
            let mut extra = Vec::new();
            if let Some(r) = retry_after {
                extra.push(("retry-after", r.as_str()));
            }
            write_response(out, *status, "application/json", body.to_string().as_bytes(), &extra)
                .is_ok()
        }
        ReplyKind::Redirect { status, location } => {
            write_response(out, *status, "text/plain", b"moved", &[("location", location.as_str())])
                .is_ok()
        }
        ReplyKind::Message { content, tool_calls } => {
            let finish = reply.finish_reason.clone().unwrap_or_else(|| {
                if tool_calls.is_empty() { "stop".into() } else { "tool_calls".into() }
            });
            if req.body["stream"].as_bool() == Some(true) {
                stream_message(out, &model, content.as_deref(), tool_calls, &finish, reply, shared)
            } else {
                let calls: Vec<Value> = tool_calls
                    .iter()
                    .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                    .collect();
                let mut message = json!({"role": "assistant", "content": content});
                if !calls.is_empty() {
                    message["tool_calls"] = Value::Array(calls);
                }
                let mut body = json!({
                    "id": "chatcmpl-fake",
                    "object": "chat.completion",
                    "created": 0,
                    "model": model,
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                });
                if let Some(u) =
                    reply.usage_json.clone().or_else(|| reply.usage.map(|u| u.to_json()))
                {
                    body["usage"] = u;
                }
                write_response(out, 200, "application/json", body.to_string().as_bytes(), &[])
                    .is_ok()
            }
        }
    }
}

fn chunk(model: &str, delta: Value, finish: Option<&str>) -> Value {
    json!({
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    })
}

/// Streams a message as SSE over chunked transfer encoding.
fn stream_message(
    out: &mut TcpStream,
    model: &str,
    content: Option<&str>,
    tool_calls: &[FakeToolCall],
    finish: &str,
    reply: &Reply,
    shared: &Shared,
) -> bool {
    let mut events = vec![chunk(model, json!({"role": "assistant", "content": ""}), None)];
    if let Some(text) = content {
        // A few pieces, split on char boundaries.
        let chars: Vec<char> = text.chars().collect();
        for piece in chars.chunks(chars.len().div_ceil(3).max(1)) {
            events.push(chunk(model, json!({"content": piece.iter().collect::<String>()}), None));
        }
    }
    for (i, c) in tool_calls.iter().enumerate() {
        events.push(chunk(
            model,
            json!({"tool_calls": [{"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}]}),
            None,
        ));
        let half =
            c.arguments.char_indices().nth(c.arguments.chars().count() / 2).map_or(0, |(b, _)| b);
        for part in [&c.arguments[..half], &c.arguments[half..]] {
            events.push(chunk(
                model,
                json!({"tool_calls": [{"index": i, "function": {"arguments": part}}]}),
                None,
            ));
        }
    }
    events.push(chunk(model, json!({}), Some(finish)));
    if let Some(u) = reply.usage_json.clone().or_else(|| reply.usage.map(|u| u.to_json())) {
        let mut last = json!({"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 0, "model": model, "choices": []});
        last["usage"] = u;
        events.push(last);
    }
    let head = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n";
    if out.write_all(head.as_bytes()).is_err() {
        return false;
    }
    let mut frames: Vec<String> = events.iter().map(|e| format!("data: {e}\n\n")).collect();
    frames.push("data: [DONE]\n\n".to_owned());
    for (i, frame) in frames.iter().enumerate() {
        if i > 0 && !reply.chunk_delay.is_zero() && shared.pause(reply.chunk_delay) {
            return false;
        }
        let bytes = format!("{:x}\r\n{frame}\r\n", frame.len());
        if out.write_all(bytes.as_bytes()).and_then(|()| out.flush()).is_err() {
            return false;
        }
    }
    out.write_all(b"0\r\n\r\n").and_then(|()| out.flush()).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn post(server: &FakeModel, body: &str) -> String {
        let mut s = TcpStream::connect(server.addr()).expect("connect");
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer k\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).expect("write");
        let mut text = String::new();
        let _ = s.read_to_string(&mut text);
        text
    }

    #[test]
    fn scripted_replies_in_order_then_default_and_requests_recorded() {
        let server = FakeModel::start();
        server.push(Reply::text("first").with_usage(Usage::new(3, 4).cost(0.5)));
        server.push(Reply::rate_limited(2));
        let a = post(&server, r#"{"model":"m","messages":[]}"#);
        assert!(
            a.starts_with("HTTP/1.1 200") && a.contains("\"first\"") && a.contains("\"cost\":0.5"),
            "{a}"
        );
        let b = post(&server, "{}");
        assert!(b.starts_with("HTTP/1.1 429") && b.contains("retry-after: 2"), "{b}");
        let c = post(&server, "not json");
        assert!(c.contains("\"ok\""), "{c}");
        let reqs = server.requests();
        assert_eq!(reqs.len(), 3);
        assert_eq!(reqs[0].body["model"], "m");
        assert_eq!(reqs[0].header("Authorization"), Some("Bearer k"));
        assert_eq!(reqs[2].body, Value::Null);
        assert_eq!(reqs[2].raw_body, "not json");
    }

    #[test]
    fn streams_sse_with_usage_and_done() {
        let server = FakeModel::start();
        server.push(Reply::text("hello world").with_usage(Usage::new(1, 2)));
        let a = post(&server, r#"{"model":"m","stream":true}"#);
        assert!(a.contains("text/event-stream") && a.contains("data: [DONE]"), "{a}");
        assert!(a.contains("\"prompt_tokens\":1"), "{a}");
    }

    #[test]
    fn drop_closes_without_answer_and_server_stops_on_drop() {
        let server = FakeModel::start();
        server.push(Reply::drop_connection());
        assert_eq!(post(&server, "{}"), "");
        server.push(Reply::text("slow").delayed(Duration::from_secs(30)));
        let addr = server.addr();
        let t = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).expect("connect");
            let _ = s.write_all(b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 0\r\n\r\n");
            let mut text = String::new();
            let _ = s.read_to_string(&mut text);
            text
        });
        while server.request_count() < 2 {
            std::thread::sleep(Duration::from_millis(5));
        }
        let started = Instant::now();
        drop(server);
        assert_eq!(t.join().expect("join"), "");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err());
    }
}
