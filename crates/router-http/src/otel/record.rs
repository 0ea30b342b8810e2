//! The record of a finished span: what the router's spans write when they
//! end and what [`TraceEncoder`] encodes, on the request's thread, before
//! the export queue carries the bytes.
//!
//! # Why not the SDK's `SpanData`
//!
//! The SDK's record has room for everything any instrumentation makes:
//! events, links, an instrumentation scope per span, attribute keys and
//! values of any kind. The router's spans have none of the first three,
//! and their attribute keys are all static names. A `SpanData` is 352
//! bytes, a quarter of them the scope cloned into every span (and
//! compared again, span by span, when a batch is grouped by scope); this
//! record is 160, the scope is the encoder's (one per pipeline), and an
//! attribute is a static key and a small value (40 bytes, against 56 for
//! the SDK's `KeyValue`). The
//! SDK's record of the same span is [`SpanRecord::to_span_data`], which
//! the encoder's tests use to check its bytes against the SDK's own
//! conversion encoded by prost.
//!
//! [`TraceEncoder`]: super::TraceEncoder

use opentelemetry::trace::{SpanKind, Status};
use std::borrow::Cow;
use std::sync::Arc;
use std::time::SystemTime;

/// One finished span: its identity, timing, attributes and status.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanRecord {
    /// The trace's id (big-endian bytes, as OTLP carries it).
    pub trace_id: [u8; 16],
    /// The span's id.
    pub span_id: [u8; 8],
    /// The parent span's id; all zeros for a root span.
    pub parent_span_id: [u8; 8],
    /// The W3C trace flags (bit 0: sampled).
    pub trace_flags: u8,
    /// Whether the parent is another process's (the client's
    /// `traceparent`).
    pub parent_is_remote: bool,
    /// The span's W3C `tracestate`, as its header's text; `None` when
    /// empty. Shared by a request's spans.
    pub trace_state: Option<Arc<str>>,
    /// Server, client or internal.
    pub kind: SpanKind,
    /// The span's name.
    pub name: Cow<'static, str>,
    /// When the span started.
    pub start: SystemTime,
    /// When it ended.
    pub end: SystemTime,
    /// Its attributes, in the order they were set.
    pub attributes: Vec<Attribute>,
    /// Attributes set past the span's limit, not kept.
    pub dropped_attributes: u32,
    /// Unset, ok or error (with a description).
    pub status: Status,
}

/// A span attribute: a static key (the router's are all names it knows
/// at compile time) and its value.
#[derive(Debug, Clone, PartialEq)]
pub struct Attribute {
    /// The attribute's name (`http.route`, `router.worker`, ...).
    pub key: &'static str,
    /// Its value.
    pub value: AttributeValue,
}

impl Attribute {
    /// `key` set to `value`.
    pub fn new(key: &'static str, value: impl Into<AttributeValue>) -> Self {
        Self {
            key,
            value: value.into(),
        }
    }
}

/// An attribute's value: the kinds the router's spans set.
#[derive(Debug, Clone, PartialEq)]
pub enum AttributeValue {
    /// Text, static (a known route, a reason) or owned (a URL, an error).
    String(Cow<'static, str>),
    /// Text shared with what it names (a worker's URL), not copied.
    Shared(Arc<str>),
    /// A signed integer.
    I64(i64),
    /// A floating-point number.
    F64(f64),
    /// A boolean.
    Bool(bool),
}

impl AttributeValue {
    /// The value as the SDK's [`opentelemetry::Value`].
    pub fn to_value(&self) -> opentelemetry::Value {
        use opentelemetry::Value;
        match self {
            Self::String(Cow::Borrowed(text)) => Value::from(*text),
            Self::String(Cow::Owned(text)) => Value::from(text.clone()),
            Self::Shared(text) => Value::String(Arc::clone(text).into()),
            Self::I64(value) => Value::I64(*value),
            Self::F64(value) => Value::F64(*value),
            Self::Bool(value) => Value::Bool(*value),
        }
    }
}

impl From<&'static str> for AttributeValue {
    fn from(text: &'static str) -> Self {
        Self::String(Cow::Borrowed(text))
    }
}

impl From<String> for AttributeValue {
    fn from(text: String) -> Self {
        Self::String(Cow::Owned(text))
    }
}

impl From<Cow<'static, str>> for AttributeValue {
    fn from(text: Cow<'static, str>) -> Self {
        Self::String(text)
    }
}

impl From<Arc<str>> for AttributeValue {
    fn from(text: Arc<str>) -> Self {
        Self::Shared(text)
    }
}

impl From<i64> for AttributeValue {
    fn from(value: i64) -> Self {
        Self::I64(value)
    }
}

impl From<f64> for AttributeValue {
    fn from(value: f64) -> Self {
        Self::F64(value)
    }
}

impl From<bool> for AttributeValue {
    fn from(value: bool) -> Self {
        Self::Bool(value)
    }
}

impl SpanRecord {
    /// The SDK's record of this span, in `scope` (the pipeline's): for an
    /// exporter of the SDK's, or to compare with the SDK's encoding.
    pub fn to_span_data(
        &self,
        scope: &opentelemetry::InstrumentationScope,
    ) -> opentelemetry_sdk::trace::SpanData {
        use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
        let trace_state = self
            .trace_state
            .as_deref()
            .and_then(|header| header.parse::<TraceState>().ok())
            .unwrap_or_default();
        opentelemetry_sdk::trace::SpanData {
            span_context: SpanContext::new(
                TraceId::from_bytes(self.trace_id),
                SpanId::from_bytes(self.span_id),
                TraceFlags::new(self.trace_flags),
                false,
                trace_state,
            ),
            parent_span_id: SpanId::from_bytes(self.parent_span_id),
            parent_span_is_remote: self.parent_is_remote,
            span_kind: self.kind.clone(),
            name: self.name.clone(),
            start_time: self.start,
            end_time: self.end,
            attributes: self
                .attributes
                .iter()
                .map(|attribute| {
                    opentelemetry::KeyValue::new(attribute.key, attribute.value.to_value())
                })
                .collect(),
            dropped_attributes_count: self.dropped_attributes,
            events: Default::default(),
            links: Default::default(),
            status: self.status.clone(),
            instrumentation_scope: scope.clone(),
        }
    }
}
