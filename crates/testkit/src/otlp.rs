//! A local OTLP/HTTP trace receiver for tests: listens on 127.0.0.1 (an
//! ephemeral port), accepts `POST /v1/traces` (protobuf), decodes each
//! request with `opentelemetry-proto` and keeps the spans; stops when
//! dropped. [`OtlpReceiver::dead_endpoint`] is an address nobody listens on.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;

/// One received span, flattened.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    /// Its name.
    pub name: String,
    /// Trace id, hex.
    pub trace_id: String,
    /// Span id, hex.
    pub span_id: String,
    /// Parent span id, hex (`""` for a root).
    pub parent_span_id: String,
    /// Attributes, as strings (ints and bools printed).
    pub attributes: Vec<(String, String)>,
    /// Links: (trace id, span id), hex.
    pub links: Vec<(String, String)>,
    /// The resource's `service.name`.
    pub service: String,
    /// Status code (0 unset, 1 ok, 2 error).
    pub status: i32,
    /// Events: name and attributes (as strings).
    pub events: Vec<(String, Vec<(String, String)>)>,
}

impl ReceivedSpan {
    /// The attribute `key`, if set.
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(v: Option<&opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        Some(AnyValue::ArrayValue(a)) => {
            a.values.iter().map(|v| text(Some(v))).collect::<Vec<_>>().join(",")
        }
        _ => String::new(),
    }
}

fn flatten(span: &Span, service: &str) -> ReceivedSpan {
    ReceivedSpan {
        name: span.name.clone(),
        trace_id: hex(&span.trace_id),
        span_id: hex(&span.span_id),
        parent_span_id: hex(&span.parent_span_id),
        attributes: span
            .attributes
            .iter()
            .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
            .collect(),
        links: span.links.iter().map(|l| (hex(&l.trace_id), hex(&l.span_id))).collect(),
        service: service.to_owned(),
        status: span.status.as_ref().map_or(0, |s| s.code),
        events: span
            .events
            .iter()
            .map(|e| {
                let attrs = e
                    .attributes
                    .iter()
                    .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
                    .collect();
                (e.name.clone(), attrs)
            })
            .collect(),
    }
}

/// The receiver; stops when dropped.
#[derive(Debug)]
pub struct OtlpReceiver {
    addr: std::net::SocketAddr,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    requests: Arc<Mutex<usize>>,
    stop: Arc<AtomicBool>,
}

impl OtlpReceiver {
    /// Starts listening on 127.0.0.1 (ephemeral port).
    pub fn start() -> OtlpReceiver {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the OTLP receiver");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("addr");
        let spans = Arc::new(Mutex::new(Vec::new()));
        let requests = Arc::new(Mutex::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (s, r, st) = (spans.clone(), requests.clone(), stop.clone());
        std::thread::spawn(move || {
            while !st.load(Ordering::SeqCst) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let (s, r) = (s.clone(), r.clone());
                        std::thread::spawn(move || serve(stream, &s, &r));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        OtlpReceiver { addr, spans, requests, stop }
    }

    /// `OTEL_EXPORTER_OTLP_ENDPOINT` for it (the base URL).
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// An endpoint nobody listens on (a port just bound and released).
    pub fn dead_endpoint() -> String {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        drop(l);
        format!("http://127.0.0.1:{port}")
    }

    /// The spans received so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Export requests received so far.
    pub fn requests(&self) -> usize {
        *self.requests.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits (up to 20 s) until `check` holds on the spans.
    pub fn wait_for(&self, check: impl Fn(&[ReceivedSpan]) -> bool) -> Vec<ReceivedSpan> {
        let started = Instant::now();
        loop {
            let spans = self.spans();
            if check(&spans) || started.elapsed() > Duration::from_secs(20) {
                return spans;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Answers the requests of one connection (keep-alive).
fn serve(stream: TcpStream, spans: &Mutex<Vec<ReceivedSpan>>, requests: &Mutex<usize>) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
    let Ok(mut writer) = stream.try_clone() else { return };
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut length = 0usize;
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 {
                return;
            }
            let header = header.trim_end();
            if header.is_empty() {
                break;
            }
            if let Some((k, v)) = header.split_once(':')
                && k.trim().eq_ignore_ascii_case("content-length")
            {
                length = v.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0u8; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        if line.starts_with("POST") && line.contains("/v1/traces") {
            *requests.lock().unwrap_or_else(PoisonError::into_inner) += 1;
            if let Ok(req) = ExportTraceServiceRequest::decode(body.as_slice()) {
                let mut out = spans.lock().unwrap_or_else(PoisonError::into_inner);
                for rs in &req.resource_spans {
                    let service = rs
                        .resource
                        .as_ref()
                        .and_then(|r| r.attributes.iter().find(|kv| kv.key == "service.name"))
                        .map(|kv| text(kv.value.as_ref()))
                        .unwrap_or_default();
                    for ss in &rs.scope_spans {
                        out.extend(ss.spans.iter().map(|s| flatten(s, &service)));
                    }
                }
            }
            let reply = "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
            if writer.write_all(reply.as_bytes()).is_err() {
                return;
            }
        } else {
            let reply = "HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n";
            if writer.write_all(reply.as_bytes()).is_err() {
                return;
            }
        }
    }
}
