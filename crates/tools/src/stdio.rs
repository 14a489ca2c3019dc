//! A stdio transport for MCP servers whose messages are bounded: each line
//! the server writes is held until its newline, up to [`MAX_LINE_BYTES`];
//! a longer one is dropped as it streams (never held whole) and, when it
//! answers a request, replaced by a JSON-RPC error for that request's id
//! (`too large: N MB, limit M MB`). The call fails at once and the
//! connection stays usable — rmcp's own line reader would drop such a line
//! silently (the call then hung until its timeout) or close the transport.
//!
//! The id is found by a small streaming scanner of the line's top-level
//! JSON object (the id may come after the result, as the TypeScript SDK
//! writes it); a line without one (a notification) is dropped with a log.

use std::borrow::Cow;

use rmcp_client::RoleClient;
use rmcp_client::service::{RxJsonRpcMessage, TxJsonRpcMessage};
use rmcp_client::transport::Transport;
use rmcp_client::transport::async_rw::AsyncRwTransport;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, DuplexStream};
use tokio::process::{Child, ChildStdin, ChildStdout};

/// The longest message read from a stdio MCP server (8 MB, as over HTTP).
pub(crate) const MAX_LINE_BYTES: usize = 8_000_000;

/// The longest request id kept by the scanner.
const MAX_ID_BYTES: usize = 256;

/// A spawned MCP server's stdio, its lines bounded; the server is killed
/// when the transport is dropped.
pub(crate) struct BoundedChildStdio {
    inner: AsyncRwTransport<RoleClient, DuplexStream, ChildStdin>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl BoundedChildStdio {
    /// Takes `child`'s stdin and stdout (both piped) and starts the
    /// bounded reader (on the current tokio runtime). `None`: a pipe is
    /// missing.
    pub(crate) fn new(mut child: Child, limit: usize) -> Option<BoundedChildStdio> {
        let stdout = child.stdout.take()?;
        let stdin = child.stdin.take()?;
        let (ours, theirs) = tokio::io::duplex(256 << 10);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            tokio::select! {
                () = bound_lines(stdout, ours, limit) => {}
                _ = stopped => {}
            }
            // The server goes with its transport (or when it closed its stdout).
            let _ = child.start_kill();
            let _ = child.wait().await;
        });
        Some(BoundedChildStdio { inner: AsyncRwTransport::new_client(theirs, stdin), _stop: stop })
    }
}

impl Transport<RoleClient> for BoundedChildStdio {
    type Error = std::io::Error;

    fn name() -> Cow<'static, str> {
        "bounded-child-stdio".into()
    }

    fn send(
        &mut self,
        item: TxJsonRpcMessage<RoleClient>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send + 'static {
        self.inner.send(item)
    }

    fn receive(&mut self) -> impl Future<Output = Option<RxJsonRpcMessage<RoleClient>>> + Send {
        self.inner.receive()
    }

    fn close(&mut self) -> impl Future<Output = Result<(), Self::Error>> + Send {
        self.inner.close()
    }
}

/// Copies `from`'s lines to `to`, each whole; a line over `limit` becomes
/// [`too_large`] for its id (or nothing).
async fn bound_lines(from: ChildStdout, mut to: DuplexStream, limit: usize) {
    let mut reader = BufReader::with_capacity(64 << 10, from);
    let mut line: Vec<u8> = Vec::new();
    // Over the limit: the scanner and the bytes seen.
    let mut over: Option<(IdScan, usize)> = None;
    loop {
        let buf = match reader.fill_buf().await {
            Ok(b) if !b.is_empty() => b,
            _ => break,
        };
        let (chunk, newline) = match buf.iter().position(|b| *b == b'\n') {
            Some(i) => (&buf[..=i], true),
            None => (buf, false),
        };
        let used = chunk.len();
        let body = if newline { &chunk[..used - 1] } else { chunk };
        match &mut over {
            Some((scan, seen)) => {
                scan.feed(body);
                *seen += body.len();
            }
            None if line.len() + body.len() > limit => {
                let mut scan = IdScan::default();
                scan.feed(&line);
                scan.feed(body);
                over = Some((scan, line.len() + body.len()));
                line = Vec::new();
            }
            None => line.extend_from_slice(body),
        }
        reader.consume(used);
        if !newline {
            continue;
        }
        let out = match over.take() {
            Some((scan, seen)) => match scan.id() {
                Some(id) => too_large(&id, seen, limit),
                None => {
                    log::warn!(
                        "an MCP server's message of {seen} bytes was dropped: over the limit of \
                         {limit} bytes, and it answers no request"
                    );
                    continue;
                }
            },
            None => {
                let mut l = std::mem::take(&mut line);
                l.push(b'\n');
                l
            }
        };
        if to.write_all(&out).await.is_err() {
            return;
        }
    }
    let _ = to.shutdown().await;
}

/// The error answer to request `id` whose response was `seen` bytes.
fn too_large(id: &str, seen: usize, limit: usize) -> Vec<u8> {
    let mb = |b: usize| (b + 500_000) / 1_000_000;
    let message = format!("too large: {} MB, limit {} MB", mb(seen), limit / 1_000_000);
    let line = format!(
        "{{\"jsonrpc\":\"2.0\",\"id\":{id},\"error\":{{\"code\":-32603,\"message\":{}}}}}\n",
        serde_json::Value::String(message)
    );
    line.into_bytes()
}

/// A streaming scan of one JSON object for its top-level `"id"` value (a
/// number or a string, kept as its JSON text).
#[derive(Debug, Default)]
struct IdScan {
    depth: u32,
    in_string: bool,
    escaped: bool,
    /// At depth 1, the next string is a key.
    want_key: bool,
    /// The key being read (bounded), and whether one is being read.
    key: Vec<u8>,
    reading_key: bool,
    /// The last key read was `id`, its value not seen yet.
    id_next: bool,
    /// The id's JSON text being read.
    value: Option<Vec<u8>>,
    found: Option<Vec<u8>>,
    /// A top-level `method` key: a request or notification of the server,
    /// never an answer to ours.
    method: bool,
}

impl IdScan {
    fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.byte(b);
        }
    }

    fn keep(buf: &mut Vec<u8>, b: u8) {
        if buf.len() < MAX_ID_BYTES {
            buf.push(b);
        }
    }

    fn byte(&mut self, b: u8) {
        if self.in_string {
            if let Some(v) = &mut self.value {
                Self::keep(v, b);
            } else if self.reading_key {
                Self::keep(&mut self.key, b);
            }
            if self.escaped {
                self.escaped = false;
            } else if b == b'\\' {
                self.escaped = true;
            } else if b == b'"' {
                self.in_string = false;
                if self.reading_key {
                    self.key.pop();
                    self.reading_key = false;
                    // The key as JSON decodes it (`"\u0069d"` is `id`).
                    let mut raw = Vec::with_capacity(self.key.len() + 2);
                    raw.push(b'"');
                    raw.extend_from_slice(&self.key);
                    raw.push(b'"');
                    if let Ok(key) = serde_json::from_slice::<String>(&raw) {
                        self.key = key.into_bytes();
                    }
                    if self.key == b"method" {
                        self.method = true;
                    }
                } else if self.value.is_some() {
                    self.finish();
                }
            }
            return;
        }
        // A number value ends at anything that is not part of one.
        if self.value.is_some() && !(b.is_ascii_digit() || b"+-.eE".contains(&b)) {
            self.finish();
        }
        match b {
            b'"' => {
                self.in_string = true;
                if self.depth == 1 && self.want_key {
                    self.reading_key = true;
                    self.key.clear();
                } else if self.depth == 1 && self.id_next {
                    self.id_next = false;
                    self.value = Some(vec![b'"']);
                }
            }
            b'{' | b'[' => {
                self.depth += 1;
                self.id_next = false;
                self.want_key = self.depth == 1 && b == b'{';
            }
            b'}' | b']' => self.depth = self.depth.saturating_sub(1),
            b':' if self.depth == 1 => {
                self.want_key = false;
                self.id_next = self.key == b"id";
            }
            b',' if self.depth == 1 => {
                self.want_key = true;
                self.id_next = false;
            }
            b'0'..=b'9' | b'-' if self.depth == 1 && self.id_next => {
                self.id_next = false;
                self.value = Some(vec![b]);
            }
            _ => {
                if let Some(v) = &mut self.value {
                    Self::keep(v, b);
                }
            }
        }
    }

    fn finish(&mut self) {
        // The last `id` wins, as a JSON parser reads duplicate keys.
        if let Some(v) = self.value.take() {
            self.found = Some(v);
        }
    }

    /// The id's JSON text, if it is a valid number or string and the
    /// message answers a request (it has no `method`).
    fn id(mut self) -> Option<String> {
        self.finish();
        if self.method {
            return None;
        }
        let text = String::from_utf8(self.found?).ok()?;
        match serde_json::from_str::<serde_json::Value>(&text).ok()? {
            serde_json::Value::Number(_) | serde_json::Value::String(_) => Some(text),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::IdScan;

    fn id_of(text: &str) -> Option<String> {
        let mut s = IdScan::default();
        // In pieces, as it streams.
        for part in text.as_bytes().chunks(3) {
            s.feed(part);
        }
        s.id()
    }

    #[test]
    fn the_top_level_id_is_found_wherever_it_is() {
        assert_eq!(id_of(r#"{"jsonrpc":"2.0","id":7,"result":{"x":1}}"#).as_deref(), Some("7"));
        assert_eq!(
            id_of(r#"{"result":{"id":99,"content":[{"id":"no"}]},"jsonrpc":"2.0","id":"req-1"}"#)
                .as_deref(),
            Some("\"req-1\"")
        );
        assert_eq!(id_of(r#"{"result":"a \"id\": 5","id":12}"#).as_deref(), Some("12"));
        assert_eq!(id_of(r#"{"id" : -3 }"#).as_deref(), Some("-3"));
        assert_eq!(id_of(r#"{"method":"notifications/message","params":{"id":1}}"#), None);
        assert_eq!(id_of(r#"{"id":null}"#), None);
        assert_eq!(id_of(r#"{"id":"a\"b"}"#).as_deref(), Some(r#""a\"b""#));
        // A server's own request carries a method: never taken for an answer.
        assert_eq!(id_of(r#"{"jsonrpc":"2.0","id":0,"method":"sampling/createMessage"}"#), None);
        assert_eq!(id_of(r#"{"\u0069d":4,"result":{}}"#).as_deref(), Some("4"));
        assert_eq!(id_of(r#"{"id":1,"result":{},"id":2}"#).as_deref(), Some("2"));
    }
}
