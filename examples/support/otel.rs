//! `--otlp-endpoint URL` (feature `otel`): the spans of a worker or producer exported by OTLP
//! over HTTP (protobuf, `URL/v1/traces`), batched on the exporter's own thread, flushed at exit.
//! The flag's parser records the endpoint ([`otlp_endpoint`]), so that logging, set up before
//! the runtime starts, can add the OpenTelemetry layer ([`layer`]).

use std::sync::OnceLock;

static ENDPOINT: OnceLock<String> = OnceLock::new();

/// The `--otlp-endpoint` value parser: `http://HOST:PORT` (the collector's OTLP/HTTP port,
/// usually 4318) or the full `…/v1/traces` URL; remembered for [`layer`].
pub fn otlp_endpoint(v: &str) -> Result<String, String> {
    if !(v.starts_with("http://") || v.starts_with("https://")) {
        return Err(format!("{v:?}: expected http://HOST:PORT (OTLP over HTTP)"));
    }
    let url = if v.trim_end_matches('/').ends_with("/v1/traces") {
        v.to_owned()
    } else {
        format!("{}/v1/traces", v.trim_end_matches('/'))
    };
    let _ = ENDPOINT.set(url.clone());
    Ok(url)
}

/// Refuses `--otlp-endpoint` in a build without the `otel` feature (exit 2).
pub fn check() -> Result<(), super::StartError> {
    if ENDPOINT.get().is_some() && !cfg!(feature = "otel") {
        return Err(super::StartError::Refused(
            "--otlp-endpoint needs the `otel` feature (cargo run -p brokerfence-examples --features otel --example …)"
                .into(),
        ));
    }
    Ok(())
}

#[cfg(feature = "otel")]
mod enabled {
    use std::sync::OnceLock;

    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
    use opentelemetry_sdk::trace::SdkTracerProvider;

    static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

    /// OTLP/HTTP through reqwest 0.12's blocking client: the batch exporter calls it from its
    /// own thread, outside any async runtime.
    #[derive(Debug)]
    struct Blocking(reqwest::blocking::Client);

    #[async_trait::async_trait]
    impl opentelemetry_http::HttpClient for Blocking {
        async fn send_bytes(
            &self,
            request: http::Request<bytes::Bytes>,
        ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
            let (parts, body) = request.into_parts();
            let mut req = self.0.request(parts.method, parts.uri.to_string()).body(body.to_vec());
            for (k, v) in &parts.headers {
                req = req.header(k, v);
            }
            let resp = req.send()?;
            let status = resp.status();
            let bytes = resp.bytes()?;
            Ok(http::Response::builder().status(status).body(bytes)?)
        }
    }

    /// The OpenTelemetry layer exporting to the endpoint, when `--otlp-endpoint` was given.
    pub fn layer<S>(service: &str) -> Option<impl tracing_subscriber::Layer<S>>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        let endpoint = super::ENDPOINT.get()?;
        let client = match reqwest::blocking::Client::builder().timeout(std::time::Duration::from_secs(10)).build() {
            Ok(c) => c,
            Err(e) => {
                eprintln!("--otlp-endpoint: no HTTP client ({e}); spans not exported");
                return None;
            }
        };
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(Blocking(client))
            .with_endpoint(endpoint.clone())
            .with_timeout(std::time::Duration::from_secs(10))
            .build();
        let exporter = match exporter {
            Ok(e) => e,
            Err(e) => {
                eprintln!("--otlp-endpoint {endpoint}: {e}; spans not exported");
                return None;
            }
        };
        let resource = opentelemetry_sdk::Resource::builder().with_service_name(service.to_owned()).build();
        let provider = SdkTracerProvider::builder().with_batch_exporter(exporter).with_resource(resource).build();
        let tracer = provider.tracer("brokerfence-examples");
        let _ = PROVIDER.set(provider);
        // The layer brokerfence recommends (no context activation, location, thread or poll
        // timing): less per job than the layer's defaults in most paired runs (docs/performance.md).
        Some(brokerfence::otel::layer(tracer))
    }

    /// Flushes and stops the exporter (at exit).
    pub fn shutdown() {
        if let Some(p) = PROVIDER.get() {
            let _ = p.shutdown();
        }
    }
}

#[cfg(feature = "otel")]
pub use enabled::{layer, shutdown};

/// No layer without the feature.
#[cfg(not(feature = "otel"))]
pub fn layer(_service: &str) -> Option<tracing_subscriber::layer::Identity> {
    None
}

/// Nothing to flush without the feature.
#[cfg(not(feature = "otel"))]
pub fn shutdown() {}

/// The W3C trace context of `span` as (name, value) pairs: `traceparent` (and `tracestate`) to
/// send with a message; none without the feature or without `--otlp-endpoint`.
pub fn trace_fields(span: &tracing::Span) -> Vec<(&'static str, String)> {
    #[cfg(feature = "otel")]
    if let Some(tc) = span.in_scope(brokerfence::otel::TraceContext::current) {
        return tc.to_headers();
    }
    let _ = span;
    Vec::new()
}
