//! `retinue-trace`: OpenTelemetry export for Retinue.
//!
//! The crates that make spans (`retinue-delegate`, `retinue-runtime`) use
//! only the `opentelemetry` API, which does nothing until a provider is
//! installed. This crate installs one — the SDK with a batch processor and
//! the OTLP/HTTP (protobuf) exporter on its blocking client — when, and only
//! when, `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`)
//! is set, named by `OTEL_SERVICE_NAME` (default `retinue`).
//!
//! A delegation never waits for the collector: spans go to a bounded queue
//! (spans beyond it are dropped), a background thread exports them, each
//! export times out after [`EXPORT_TIMEOUT`], and a failed export is counted,
//! never reported to the delegation. [`Tracing`] counts the spans that
//! ended, were exported and failed ([`TraceStats`]); after its drop flushes
//! what is queued (bounded by the same timeout), what is unaccounted for was
//! dropped from a full queue, and a warning says how many.
//!
//! Spans follow the OpenTelemetry semantic conventions for generative AI,
//! version [`SEMCONV_VERSION`] (status: development).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider, SpanData, SpanExporter,
};

/// The semantic-conventions version the span names and attributes follow.
pub const SEMCONV_VERSION: &str = "1.38.0";
/// How long one export (and the final flush) may take.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(2);
/// Spans the queue holds; more are dropped (and counted).
pub const QUEUE_SPANS: usize = 2048;

/// What the exporter did so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TraceStats {
    /// Spans that ended (handed to the queue).
    pub ended: u64,
    /// Spans the collector accepted.
    pub exported: u64,
    /// Spans whose export failed (collector down, timeout, refused).
    pub failed: u64,
}

impl TraceStats {
    /// Spans neither exported nor failed: still queued, or — after the
    /// final flush — dropped because the queue was full.
    pub fn unaccounted(&self) -> u64 {
        self.ended.saturating_sub(self.exported).saturating_sub(self.failed)
    }
}

#[derive(Debug, Default)]
struct Counters {
    ended: AtomicU64,
    exported: AtomicU64,
    failed: AtomicU64,
}

/// The batch processor, counting the spans handed to it.
#[derive(Debug)]
struct Counted {
    inner: BatchSpanProcessor,
    counters: Arc<Counters>,
}

impl opentelemetry_sdk::trace::SpanProcessor for Counted {
    fn on_start(&self, span: &mut opentelemetry_sdk::trace::Span, cx: &opentelemetry::Context) {
        self.inner.on_start(span, cx);
    }

    fn on_end(&self, span: SpanData) {
        self.counters.ended.fetch_add(1, Ordering::Relaxed);
        self.inner.on_end(span);
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// The OTLP exporter, counting what it exported and what it could not.
#[derive(Debug)]
struct Counting {
    inner: opentelemetry_otlp::SpanExporter,
    counters: Arc<Counters>,
}

impl SpanExporter for Counting {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let n = u64::try_from(batch.len()).unwrap_or(u64::MAX);
        let result = self.inner.export(batch).await;
        let counter = if result.is_ok() { &self.counters.exported } else { &self.counters.failed };
        counter.fetch_add(n, Ordering::Relaxed);
        result
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        self.inner.set_resource(resource);
    }
}

/// The installed tracing: flushes and shuts the provider down on drop.
#[derive(Debug)]
pub struct Tracing {
    provider: SdkTracerProvider,
    counters: Arc<Counters>,
    endpoint: String,
}

impl Tracing {
    /// What the exporter did so far.
    pub fn stats(&self) -> TraceStats {
        TraceStats {
            ended: self.counters.ended.load(Ordering::Relaxed),
            exported: self.counters.exported.load(Ordering::Relaxed),
            failed: self.counters.failed.load(Ordering::Relaxed),
        }
    }

    /// The collector's endpoint.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }
}

impl Drop for Tracing {
    fn drop(&mut self) {
        if let Err(e) = self.provider.force_flush() {
            log::debug!("trace flush: {e}");
        }
        if let Err(e) = self.provider.shutdown_with_timeout(EXPORT_TIMEOUT) {
            log::debug!("trace shutdown: {e}");
        }
        // Flushed and shut down: what is unaccounted for was dropped.
        let s = self.stats();
        if s.failed > 0 || s.unaccounted() > 0 {
            log::warn!(
                "{} span(s) could not be exported to {} and {} were dropped from a full \
                 queue ({} exported)",
                s.failed,
                retinue_core::redact_endpoint(&self.endpoint),
                s.unaccounted(),
                s.exported
            );
        }
    }
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|v| v.trim().to_owned()).filter(|v| !v.is_empty())
}

/// Installs the global tracer provider from the standard variables; `None`
/// (tracing off: every span is a no-op) when no endpoint is set or the
/// exporter cannot be built (said once on the log).
pub fn init_from_env() -> Option<Tracing> {
    let endpoint = env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .or_else(|| env("OTEL_EXPORTER_OTLP_ENDPOINT").map(|e| traces_url(&e)))?;
    let service = env("OTEL_SERVICE_NAME").unwrap_or_else(|| "retinue".to_owned());
    init(&endpoint, &service)
}

/// Installs the global tracer provider exporting to `endpoint` (the full
/// traces URL) as `service`; `None` when the exporter cannot be built.
pub fn init(endpoint: &str, service: &str) -> Option<Tracing> {
    let (endpoint, service) = (endpoint.to_owned(), service.to_owned());
    // An https collector needs a process-wide crypto provider (another
    // crate may have installed one already: that one stays).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let exporter = match opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(endpoint.clone())
        .with_timeout(EXPORT_TIMEOUT)
        .build()
    {
        Ok(e) => e,
        Err(e) => {
            let shown = retinue_core::redact_endpoint(&endpoint);
            let why = e.to_string().replace(&endpoint, &shown);
            log::warn!("tracing is off: the OTLP exporter for {shown} cannot be built: {why}");
            return None;
        }
    };
    let counters = Arc::new(Counters::default());
    let batch =
        BatchSpanProcessor::builder(Counting { inner: exporter, counters: counters.clone() })
            .with_batch_config(
                BatchConfigBuilder::default()
                    .with_max_queue_size(QUEUE_SPANS)
                    .with_scheduled_delay(Duration::from_millis(500))
                    .build(),
            )
            .build();
    let processor = Counted { inner: batch, counters: counters.clone() };
    let provider = SdkTracerProvider::builder()
        .with_span_processor(processor)
        .with_resource(opentelemetry_sdk::Resource::builder().with_service_name(service).build())
        .build();
    opentelemetry::global::set_tracer_provider(provider.clone());
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    Some(Tracing { provider, counters, endpoint })
}

/// `OTEL_EXPORTER_OTLP_ENDPOINT` is a base: traces go to `/v1/traces`
/// under it (the specification's rule for the HTTP exporter).
fn traces_url(base: &str) -> String {
    format!("{}/v1/traces", base.trim_end_matches('/'))
}

#[cfg(test)]
mod tests {
    use super::traces_url;

    #[test]
    fn the_base_endpoint_gets_the_traces_path() {
        assert_eq!(traces_url("http://127.0.0.1:4318"), "http://127.0.0.1:4318/v1/traces");
        assert_eq!(traces_url("http://h:4318/"), "http://h:4318/v1/traces");
    }
}
