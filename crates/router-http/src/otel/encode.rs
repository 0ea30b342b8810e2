//! The OTLP protobuf encoder: an `ExportTraceServiceRequest` written
//! straight from the router's span records ([`SpanRecord`]), with no
//! intermediate messages.
//!
//! # Why our own
//!
//! The SDK's conversion (`opentelemetry-proto`'s
//! `group_spans_by_resource_and_scope`) copies every attribute key and
//! string value into an owned `String`, builds a `Vec` per attribute list,
//! event and link, and prost then walks that tree twice (lengths, then
//! bytes). Measured on the router's spans, that was about 1.1 µs of the
//! export thread per span (docs/benchmarks.md, "Tracing"). Here the bytes
//! are written once, from borrowed data.
//!
//! # Back to front
//!
//! A protobuf message nested in another is preceded by its length, which
//! is known only once the message is written. Writing forward needs either
//! a sizing pass before each message (prost's way: `encoded_len` of every
//! child, at every level) or a scratch buffer per level that is copied
//! into its parent. This encoder writes the request from its last byte to
//! its first instead: fields in descending tag order, repeated elements
//! last to first, and each message's length and tag after (that is, in
//! front of) its content, when its length is known. Every byte is written
//! once and the varints are minimal, so the output is byte for byte what
//! prost encodes for the SDK's conversion of the same batch (a property
//! test checks it against `opentelemetry-proto`).
//!
//! # What it writes
//!
//! One `ResourceSpans` (the resource given to
//! [`TraceEncoder::set_resource`]) with one `ScopeSpans` (the scope given
//! to [`TraceEncoder::set_scope`]: a pipeline's spans are all in its scope)
//! holding the batch's spans in order: what the SDK's grouping makes of
//! spans of one scope.

use super::record::{AttributeValue, SpanRecord};
use opentelemetry::trace::{SpanKind, Status};
use opentelemetry::{Array, KeyValue, Value};
use std::time::{SystemTime, UNIX_EPOCH};

/// Protobuf wire types.
const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LEN: u32 = 2;
const FIXED32: u32 = 5;

/// Above this, the buffer is given back after a batch (the usual batch is
/// far smaller; a rare huge one should not pin its memory).
const KEEP_CAPACITY: usize = 4 * 1024 * 1024;

/// Field numbers of the OTLP messages (opentelemetry-proto's `.proto`
/// files, `opentelemetry/proto/{collector/trace,trace,common,resource}/v1`).
mod field {
    /// `ExportTraceServiceRequest.resource_spans`.
    pub(super) const REQUEST_RESOURCE_SPANS: u32 = 1;
    /// `ResourceSpans`.
    pub(super) const RS_RESOURCE: u32 = 1;
    pub(super) const RS_SCOPE_SPANS: u32 = 2;
    pub(super) const RS_SCHEMA_URL: u32 = 3;
    /// `Resource.attributes`.
    pub(super) const RESOURCE_ATTRIBUTES: u32 = 1;
    /// `ScopeSpans`.
    pub(super) const SS_SCOPE: u32 = 1;
    pub(super) const SS_SPANS: u32 = 2;
    pub(super) const SS_SCHEMA_URL: u32 = 3;
    /// `InstrumentationScope`.
    pub(super) const SCOPE_NAME: u32 = 1;
    pub(super) const SCOPE_VERSION: u32 = 2;
    pub(super) const SCOPE_ATTRIBUTES: u32 = 3;
    /// `Span`.
    pub(super) const SPAN_TRACE_ID: u32 = 1;
    pub(super) const SPAN_SPAN_ID: u32 = 2;
    pub(super) const SPAN_TRACE_STATE: u32 = 3;
    pub(super) const SPAN_PARENT_SPAN_ID: u32 = 4;
    pub(super) const SPAN_NAME: u32 = 5;
    pub(super) const SPAN_KIND: u32 = 6;
    pub(super) const SPAN_START: u32 = 7;
    pub(super) const SPAN_END: u32 = 8;
    pub(super) const SPAN_ATTRIBUTES: u32 = 9;
    pub(super) const SPAN_DROPPED_ATTRIBUTES: u32 = 10;
    pub(super) const SPAN_STATUS: u32 = 15;
    pub(super) const SPAN_FLAGS: u32 = 16;
    /// `Status`.
    pub(super) const STATUS_MESSAGE: u32 = 2;
    pub(super) const STATUS_CODE: u32 = 3;
    /// `KeyValue`.
    pub(super) const KV_KEY: u32 = 1;
    pub(super) const KV_VALUE: u32 = 2;
    /// `AnyValue`'s `value` one-of.
    pub(super) const ANY_STRING: u32 = 1;
    pub(super) const ANY_BOOL: u32 = 2;
    pub(super) const ANY_INT: u32 = 3;
    pub(super) const ANY_DOUBLE: u32 = 4;
    pub(super) const ANY_ARRAY: u32 = 5;
    /// `ArrayValue.values`.
    pub(super) const ARRAY_VALUES: u32 = 1;
}

/// `SpanFlags`: the parent's remoteness is known, and whether it is remote.
const FLAGS_HAS_IS_REMOTE: u32 = 0x100;
const FLAGS_IS_REMOTE: u32 = 0x200;

/// Spans encoded by [`TraceEncoder::encode_spans`], each as the
/// `ScopeSpans.spans` field (tag, length, `Span` message) an export
/// request holds it in, in order: what the router's request path hands to
/// the export thread, which puts the batch's into one request
/// ([`TraceEncoder::encode_encoded`]).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EncodedSpans {
    bytes: Vec<u8>,
    spans: usize,
    /// The records they were encoded from, for the unit tests' exporters
    /// (which check what the request path ended, not its bytes: the
    /// encoder's own tests check those against prost's).
    #[cfg(test)]
    pub(super) records: Vec<SpanRecord>,
}

impl EncodedSpans {
    /// How many spans.
    pub fn len(&self) -> usize {
        self.spans
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.spans == 0
    }

    /// Their bytes (the fields, back to back).
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// Encodes batches of finished spans ([`SpanRecord`]) as OTLP
/// `ExportTraceServiceRequest` messages (protobuf), byte for byte as
/// prost encodes the SDK's conversion of the same spans
/// ([`SpanRecord::to_span_data`]), without building its messages.
///
/// The message is written back to front in one pass (each nested
/// message's length goes in front of its content once that is written),
/// from the spans' borrowed attributes: no per-attribute `String`, no
/// sizing pass. A batch is one `ResourceSpans` (the resource of
/// [`set_resource`](Self::set_resource)) with one `ScopeSpans` (the scope
/// of [`set_scope`](Self::set_scope)) holding the spans in batch order.
///
/// Keep one and reuse it: its buffer stays allocated from one batch to
/// the next.
///
/// ```
/// # use router_http::otel::TraceEncoder;
/// let mut encoder = TraceEncoder::new();
/// encoder.set_resource(
///     &opentelemetry_sdk::Resource::builder_empty()
///         .with_service_name("my-router")
///         .build(),
/// );
/// encoder.set_scope(&opentelemetry::InstrumentationScope::builder("my-router").build());
/// let message: &[u8] = encoder.encode(&[]);
/// // One ResourceSpans with the resource and no spans.
/// assert!(!message.is_empty());
/// ```
#[derive(Debug, Default)]
pub struct TraceEncoder {
    /// The output, written back to front: the message is `buf[start..]`.
    buf: Vec<u8>,
    start: usize,
    /// The `Resource` message's content, encoded once per resource.
    resource: Vec<u8>,
    /// `ResourceSpans.schema_url`.
    resource_schema_url: String,
    /// The `InstrumentationScope` message's content, encoded once.
    scope: Vec<u8>,
    /// `ScopeSpans.schema_url`.
    scope_schema_url: String,
}

impl TraceEncoder {
    /// An encoder with an empty resource (no attributes, no schema URL)
    /// and an empty scope (no name).
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the resource every later batch is exported with.
    pub fn set_resource(&mut self, resource: &opentelemetry_sdk::Resource) {
        // Encoded once here with the same writer, then kept as bytes.
        self.reset();
        for (key, value) in resource.iter().collect::<Vec<_>>().into_iter().rev() {
            let end = self.written();
            self.any_value(field::KV_VALUE, value);
            self.string(field::KV_KEY, key.as_str());
            self.close(field::RESOURCE_ATTRIBUTES, end);
        }
        self.resource.clear();
        self.resource.extend_from_slice(&self.buf[self.start..]);
        self.resource_schema_url = resource.schema_url().unwrap_or_default().to_owned();
        self.reset();
    }

    /// Sets the instrumentation scope every later batch's spans are in.
    pub fn set_scope(&mut self, scope: &opentelemetry::InstrumentationScope) {
        self.reset();
        let attributes: Vec<&KeyValue> = scope.attributes().collect();
        self.attributes(field::SCOPE_ATTRIBUTES, attributes.iter().copied());
        self.string(field::SCOPE_VERSION, scope.version().unwrap_or_default());
        self.string(field::SCOPE_NAME, scope.name());
        self.scope.clear();
        self.scope.extend_from_slice(&self.buf[self.start..]);
        self.scope_schema_url = scope.schema_url().unwrap_or_default().to_owned();
        self.reset();
    }

    /// The `ExportTraceServiceRequest` of `batch`, valid until the next
    /// call.
    pub fn encode(&mut self, batch: &[SpanRecord]) -> &[u8] {
        self.encode_message(!batch.is_empty(), |encoder| encoder.spans(batch));
        &self.buf[self.start..]
    }

    /// The `ExportTraceServiceRequest` of `batch`'s spans encoded earlier
    /// ([`encode_spans`](Self::encode_spans), maybe by another encoder),
    /// in order: the same bytes as [`encode`](Self::encode) of their
    /// records, with each span's encoding copied rather than made. Valid
    /// until the next call.
    pub fn encode_encoded(&mut self, batch: &[EncodedSpans]) -> &[u8] {
        self.encode_message(!batch.is_empty(), |encoder| encoder.encoded(batch));
        &self.buf[self.start..]
    }

    /// The `ExportTraceServiceRequest` of `batch` in one gRPC message frame
    /// (not compressed, 32-bit big-endian length), or `None` when the
    /// message exceeds that length. Valid until the next call.
    pub fn encode_grpc_frame(&mut self, batch: &[SpanRecord]) -> Option<&[u8]> {
        self.encode_message(!batch.is_empty(), |encoder| encoder.spans(batch));
        self.grpc_frame()
    }

    /// [`encode_encoded`](Self::encode_encoded) in one gRPC message frame,
    /// as [`encode_grpc_frame`](Self::encode_grpc_frame) frames it.
    pub fn encode_grpc_frame_encoded(&mut self, batch: &[EncodedSpans]) -> Option<&[u8]> {
        self.encode_message(!batch.is_empty(), |encoder| encoder.encoded(batch));
        self.grpc_frame()
    }

    /// `spans`, each as the `ScopeSpans.spans` field an export request
    /// holds it in, for [`encode_encoded`](Self::encode_encoded) to put
    /// into a request later. Where spans end on one thread and are
    /// exported on another, encoding them where they ended keeps their
    /// records (and every allocation in them) on that thread: one buffer
    /// crosses instead.
    pub fn encode_spans(&mut self, spans: &[SpanRecord]) -> EncodedSpans {
        self.reset();
        self.spans(spans);
        let encoded = EncodedSpans {
            bytes: self.buf[self.start..].to_vec(),
            spans: spans.len(),
            #[cfg(test)]
            records: spans.to_vec(),
        };
        self.reset();
        encoded
    }

    /// Frames the message written as one gRPC message.
    fn grpc_frame(&mut self) -> Option<&[u8]> {
        let length = u32::try_from(self.written()).ok()?;
        self.raw(&length.to_be_bytes());
        self.byte(0);
        Some(&self.buf[self.start..])
    }

    /// Writes `batch` as `ScopeSpans.spans` fields, last to first.
    fn spans(&mut self, batch: &[SpanRecord]) {
        for span in batch.iter().rev() {
            let span_end = self.written();
            self.span(span);
            self.close(field::SS_SPANS, span_end);
        }
    }

    /// Writes the spans of `batch`, encoded earlier, last to first.
    fn encoded(&mut self, batch: &[EncodedSpans]) {
        for spans in batch.iter().rev() {
            self.raw(&spans.bytes);
        }
    }

    /// The request around the spans `write_spans` writes (`has_spans`:
    /// whether there are any).
    fn encode_message(&mut self, has_spans: bool, write_spans: impl FnOnce(&mut Self)) {
        self.reset();
        let request_end = self.written();
        let schema_url = std::mem::take(&mut self.resource_schema_url);
        self.string(field::RS_SCHEMA_URL, &schema_url);
        self.resource_schema_url = schema_url;
        // No spans, no ScopeSpans (as the SDK's grouping).
        if has_spans {
            let scope_end = self.written();
            let schema_url = std::mem::take(&mut self.scope_schema_url);
            self.string(field::SS_SCHEMA_URL, &schema_url);
            self.scope_schema_url = schema_url;
            write_spans(self);
            let end = self.written();
            let scope = std::mem::take(&mut self.scope);
            self.raw(&scope);
            self.scope = scope;
            self.close(field::SS_SCOPE, end);
            self.close(field::RS_SCOPE_SPANS, scope_end);
        }
        let end = self.written();
        let resource = std::mem::take(&mut self.resource);
        self.raw(&resource);
        self.resource = resource;
        self.close(field::RS_RESOURCE, end);
        self.close(field::REQUEST_RESOURCE_SPANS, request_end);
    }

    /// One `Span`'s content, fields in descending order (the record has
    /// no events or links: their fields are empty, and left out).
    fn span(&mut self, span: &SpanRecord) {
        let mut flags = u32::from(span.trace_flags) | FLAGS_HAS_IS_REMOTE;
        if span.parent_is_remote {
            flags |= FLAGS_IS_REMOTE;
        }
        self.fixed32(field::SPAN_FLAGS, flags);
        // Status is always present (an empty message when unset).
        let end = self.written();
        let (code, message) = match &span.status {
            Status::Unset => (0, ""),
            Status::Ok => (1, ""),
            Status::Error { description } => (2, description.as_ref()),
        };
        self.uint(field::STATUS_CODE, code);
        self.string(field::STATUS_MESSAGE, message);
        self.close(field::SPAN_STATUS, end);
        self.uint(
            field::SPAN_DROPPED_ATTRIBUTES,
            span.dropped_attributes.into(),
        );
        for attribute in span.attributes.iter().rev() {
            // One mark for both: the value's message, then the key, make
            // the `KeyValue`.
            let end = self.written();
            match &attribute.value {
                AttributeValue::String(text) => self.one_of_string(text),
                AttributeValue::Shared(text) => self.one_of_string(text),
                AttributeValue::I64(value) => self.one_of_int(*value),
                AttributeValue::F64(value) => self.one_of_double(*value),
                AttributeValue::Bool(value) => self.one_of_bool(*value),
            }
            self.close(field::KV_VALUE, end);
            self.string(field::KV_KEY, attribute.key);
            self.close(field::SPAN_ATTRIBUTES, end);
        }
        self.fixed64(field::SPAN_END, unix_nanos(span.end));
        self.fixed64(field::SPAN_START, unix_nanos(span.start));
        self.uint(field::SPAN_KIND, kind(&span.kind));
        self.string(field::SPAN_NAME, &span.name);
        if span.parent_span_id != [0; 8] {
            self.id(field::SPAN_PARENT_SPAN_ID, span.parent_span_id);
        }
        self.string(
            field::SPAN_TRACE_STATE,
            span.trace_state.as_deref().unwrap_or_default(),
        );
        self.id(field::SPAN_SPAN_ID, span.span_id);
        self.id(field::SPAN_TRACE_ID, span.trace_id);
    }

    /// Repeated `KeyValue`s as field `number`, in their order.
    fn attributes<'a, I>(&mut self, number: u32, attributes: I)
    where
        I: DoubleEndedIterator<Item = &'a KeyValue>,
    {
        for attribute in attributes.rev() {
            let end = self.written();
            self.any_value(field::KV_VALUE, &attribute.value);
            self.string(field::KV_KEY, attribute.key.as_str());
            self.close(number, end);
        }
    }

    /// An `AnyValue` message as field `number`.
    fn any_value(&mut self, number: u32, value: &Value) {
        let end = self.written();
        match value {
            // One-of members are written even when zero or empty.
            Value::Bool(value) => self.one_of_bool(*value),
            Value::I64(value) => self.one_of_int(*value),
            Value::F64(value) => self.one_of_double(*value),
            Value::String(value) => self.one_of_string(value.as_str()),
            Value::Array(array) => {
                let array_end = self.written();
                match array {
                    Array::Bool(values) => {
                        for &value in values.iter().rev() {
                            let end = self.written();
                            self.one_of_bool(value);
                            self.close(field::ARRAY_VALUES, end);
                        }
                    }
                    Array::I64(values) => {
                        for &value in values.iter().rev() {
                            let end = self.written();
                            self.one_of_int(value);
                            self.close(field::ARRAY_VALUES, end);
                        }
                    }
                    Array::F64(values) => {
                        for &value in values.iter().rev() {
                            let end = self.written();
                            self.one_of_double(value);
                            self.close(field::ARRAY_VALUES, end);
                        }
                    }
                    Array::String(values) => {
                        for value in values.iter().rev() {
                            let end = self.written();
                            self.one_of_string(value.as_str());
                            self.close(field::ARRAY_VALUES, end);
                        }
                    }
                    // A kind of array this encoder does not know (the API
                    // may add some): its text, rather than a panic.
                    other => {
                        let end = self.written();
                        self.one_of_string(&other.to_string());
                        self.close(field::ARRAY_VALUES, end);
                    }
                }
                self.close(field::ANY_ARRAY, array_end);
            }
            // A kind of value this encoder does not know: its text.
            other => self.one_of_string(&other.to_string()),
        }
        self.close(number, end);
    }

    #[inline]
    fn one_of_bool(&mut self, value: bool) {
        self.byte(u8::from(value));
        self.tag(field::ANY_BOOL, VARINT);
    }

    #[inline]
    fn one_of_int(&mut self, value: i64) {
        // int64: two's complement, as a 64-bit varint.
        self.varint(value as u64);
        self.tag(field::ANY_INT, VARINT);
    }

    #[inline]
    fn one_of_double(&mut self, value: f64) {
        self.array(value.to_le_bytes());
        self.tag(field::ANY_DOUBLE, FIXED64);
    }

    #[inline]
    fn one_of_string(&mut self, value: &str) {
        self.raw(value.as_bytes());
        self.varint(value.len() as u64);
        self.tag(field::ANY_STRING, LEN);
    }

    /// A string field, left out when empty (proto3).
    #[inline]
    fn string(&mut self, number: u32, value: &str) {
        self.bytes(number, value.as_bytes());
    }

    /// A bytes field, left out when empty (proto3).
    #[inline]
    fn bytes(&mut self, number: u32, value: &[u8]) {
        if value.is_empty() {
            return;
        }
        self.raw(value);
        self.varint(value.len() as u64);
        self.tag(number, LEN);
    }

    /// An id (a bytes field of fixed length, never empty here: a zero
    /// parent id is left out by the caller). The length is a constant, so
    /// the copy is a store or two, not a call.
    #[inline(always)]
    fn id<const N: usize>(&mut self, number: u32, value: [u8; N]) {
        const { assert!(N > 0 && N < 0x80) };
        self.array(value);
        self.byte(N as u8);
        self.tag(number, LEN);
    }

    /// A varint field (uint32, enum), left out when zero (proto3).
    #[inline]
    fn uint(&mut self, number: u32, value: u64) {
        if value != 0 {
            self.varint(value);
            self.tag(number, VARINT);
        }
    }

    /// A fixed64 field, left out when zero (proto3).
    #[inline]
    fn fixed64(&mut self, number: u32, value: u64) {
        if value != 0 {
            self.array(value.to_le_bytes());
            self.tag(number, FIXED64);
        }
    }

    /// A fixed32 field, left out when zero (proto3).
    #[inline]
    fn fixed32(&mut self, number: u32, value: u32) {
        if value != 0 {
            self.array(value.to_le_bytes());
            self.tag(number, FIXED32);
        }
    }

    /// Ends a nested message whose content was written since `end`
    /// (a [`written`](Self::written) mark): its length, then its tag.
    #[inline]
    fn close(&mut self, number: u32, end: usize) {
        let length = self.written() - end;
        self.varint(length as u64);
        self.tag(number, LEN);
    }

    #[inline(always)]
    fn tag(&mut self, number: u32, wire_type: u32) {
        self.varint(u64::from((number << 3) | wire_type));
    }

    /// Always inlined so that a constant (every tag here) folds to its one
    /// byte; the rare longer varint is a call.
    #[inline(always)]
    fn varint(&mut self, value: u64) {
        // Most varints here (tags, small lengths) are one byte.
        if value < 0x80 {
            self.byte(value as u8);
        } else {
            self.long_varint(value);
        }
    }

    #[inline(never)]
    fn long_varint(&mut self, value: u64) {
        let length = (64 - value.leading_zeros() as usize).div_ceil(7);
        if self.start < length {
            self.grow(length);
        }
        self.start -= length;
        let mut rest = value;
        for slot in &mut self.buf[self.start..self.start + length] {
            *slot = (rest as u8 & 0x7f) | 0x80;
            rest >>= 7;
        }
        // The last byte has no continuation bit.
        self.buf[self.start + length - 1] &= 0x7f;
    }

    #[inline(always)]
    fn byte(&mut self, byte: u8) {
        if self.start == 0 {
            self.grow(1);
        }
        self.start -= 1;
        self.buf[self.start] = byte;
    }

    /// Puts `bytes` in front of what is written.
    #[inline]
    fn raw(&mut self, bytes: &[u8]) {
        if self.start < bytes.len() {
            self.grow(bytes.len());
        }
        let start = self.start - bytes.len();
        self.buf[start..self.start].copy_from_slice(bytes);
        self.start = start;
    }

    /// Puts a fixed number of bytes in front of what is written: with the
    /// length a constant, the copy compiles to stores (a call to `memcpy`
    /// for each of a span's ids and times was a fifth of the encoding).
    #[inline(always)]
    fn array<const N: usize>(&mut self, bytes: [u8; N]) {
        if self.start < N {
            self.grow(N);
        }
        let start = self.start - N;
        self.buf[start..self.start].copy_from_slice(&bytes);
        self.start = start;
    }

    /// Bytes written so far (a mark that survives the buffer's growth).
    #[inline]
    fn written(&self) -> usize {
        self.buf.len() - self.start
    }

    /// Makes room for at least `more` bytes in front of the content,
    /// which moves to the end of a buffer at least twice as large.
    fn grow(&mut self, more: usize) {
        let written = self.written();
        let size = (self.buf.len() * 2).max(written + more).max(4096);
        let mut bigger = vec![0u8; size];
        bigger[size - written..].copy_from_slice(&self.buf[self.start..]);
        self.buf = bigger;
        self.start = size - written;
    }

    fn reset(&mut self) {
        if self.buf.len() > KEEP_CAPACITY {
            self.buf = Vec::new();
        }
        self.start = self.buf.len();
    }
}

/// Nanoseconds since the Unix epoch; 0 before it (as the SDK's conversion).
fn unix_nanos(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos() as u64)
}

/// `Span.SpanKind`'s number.
fn kind(kind: &SpanKind) -> u64 {
    match kind {
        SpanKind::Internal => 1,
        SpanKind::Server => 2,
        SpanKind::Client => 3,
        SpanKind::Producer => 4,
        SpanKind::Consumer => 5,
    }
}

#[cfg(test)]
mod tests {
    use super::{EncodedSpans, TraceEncoder};
    use crate::otel::record::{Attribute, AttributeValue, SpanRecord};
    use opentelemetry::trace::{SpanKind, Status, TraceState};
    use opentelemetry::{InstrumentationScope, KeyValue, Value};
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
    use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;
    use opentelemetry_sdk::Resource;
    use proptest::prelude::*;
    use proptest::strategy::ValueTree as _;
    use prost::Message as _;
    use std::borrow::Cow;
    use std::sync::Arc;
    use std::time::{Duration, SystemTime, UNIX_EPOCH};

    /// What the SDK's own exporters would send for the same spans: its
    /// conversion of their `SpanData`, encoded by prost.
    fn reference(
        batch: &[SpanRecord],
        resource: &Resource,
        scope: &InstrumentationScope,
    ) -> ExportTraceServiceRequest {
        let resource: ResourceAttributesWithSchema = resource.into();
        let spans = batch.iter().map(|span| span.to_span_data(scope)).collect();
        ExportTraceServiceRequest {
            resource_spans: group_spans_by_resource_and_scope(spans, &resource),
        }
    }

    fn text() -> impl Strategy<Value = String> {
        // Empty, ASCII, and any Unicode (multi-byte) text.
        prop_oneof![Just(String::new()), "[a-z.]{1,12}", "\\PC{0,40}"]
    }

    /// Keys are static: a few, the empty one and a multi-byte one among
    /// them.
    const KEYS: [&str; 5] = ["http.route", "router.worker", "", "ü.key", "k"];

    fn attribute_value() -> impl Strategy<Value = AttributeValue> {
        let double = any::<f64>().prop_filter("NaN is not equal to itself", |v| !v.is_nan());
        prop_oneof![
            any::<bool>().prop_map(AttributeValue::Bool),
            any::<i64>().prop_map(AttributeValue::I64),
            double.prop_map(AttributeValue::F64),
            text().prop_map(AttributeValue::from),
            Just(AttributeValue::from("static text")),
            text().prop_map(|text| AttributeValue::Shared(Arc::from(text))),
        ]
    }

    fn attributes() -> impl Strategy<Value = Vec<Attribute>> {
        prop::collection::vec(
            (0..KEYS.len(), attribute_value()).prop_map(|(key, value)| Attribute {
                key: KEYS[key],
                value,
            }),
            0..6,
        )
    }

    /// Resource and scope attributes: the SDK's values, arrays included.
    fn sdk_attributes() -> impl Strategy<Value = Vec<KeyValue>> {
        use opentelemetry::{Array, StringValue};
        let value = prop_oneof![
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::I64),
            text().prop_map(|s| Value::String(s.into())),
            prop::collection::vec(any::<i64>(), 0..4).prop_map(|v| Value::Array(Array::I64(v))),
            prop::collection::vec(text(), 0..4).prop_map(|v| Value::Array(Array::String(
                v.into_iter().map(StringValue::from).collect()
            ))),
        ];
        prop::collection::vec(
            (text(), value).prop_map(|(key, value)| KeyValue::new(key, value)),
            0..4,
        )
    }

    fn time() -> impl Strategy<Value = SystemTime> {
        prop_oneof![
            Just(UNIX_EPOCH),
            // Before the epoch: exported as 0, as the SDK does.
            (1u64..1_000_000).prop_map(|ns| UNIX_EPOCH - Duration::from_nanos(ns)),
            any::<u64>().prop_map(|ns| UNIX_EPOCH + Duration::from_nanos(ns)),
        ]
    }

    fn trace_state() -> impl Strategy<Value = Option<Arc<str>>> {
        prop::collection::vec(("[a-z][a-z0-9_]{0,6}", "[a-zA-Z0-9 ]{0,8}[a-z]"), 0..3).prop_map(
            |pairs| {
                let header = TraceState::from_key_value(pairs)
                    .unwrap_or_default()
                    .header();
                (!header.is_empty()).then(|| Arc::from(header))
            },
        )
    }

    fn span() -> impl Strategy<Value = SpanRecord> {
        let kind = prop_oneof![
            Just(SpanKind::Internal),
            Just(SpanKind::Server),
            Just(SpanKind::Client),
            Just(SpanKind::Producer),
            Just(SpanKind::Consumer),
        ];
        let status = prop_oneof![
            Just(Status::Unset),
            Just(Status::Ok),
            text().prop_map(Status::error),
        ];
        (
            (
                any::<[u8; 16]>(),
                any::<[u8; 8]>(),
                prop_oneof![Just([0u8; 8]), any::<[u8; 8]>()],
                any::<u8>(),
                any::<bool>(),
                trace_state(),
            ),
            (kind, text(), time(), time()),
            (attributes(), prop_oneof![Just(0u32), any::<u32>()], status),
        )
            .prop_map(
                |(
                    (trace_id, span_id, parent_span_id, trace_flags, parent_is_remote, trace_state),
                    (kind, name, start, end),
                    (attributes, dropped_attributes, status),
                )| SpanRecord {
                    trace_id,
                    span_id,
                    parent_span_id,
                    trace_flags,
                    parent_is_remote,
                    trace_state,
                    kind,
                    name: Cow::Owned(name),
                    start,
                    end,
                    attributes,
                    dropped_attributes,
                    status,
                },
            )
    }

    fn resource() -> impl Strategy<Value = Resource> {
        (
            sdk_attributes(),
            prop::option::of("https://[a-z]{1,8}\\.io/[0-9.]{1,6}"),
        )
            .prop_map(|(attributes, schema)| match schema {
                Some(url) => Resource::builder_empty()
                    .with_schema_url(attributes, url)
                    .build(),
                None => Resource::builder_empty()
                    .with_attributes(attributes)
                    .build(),
            })
    }

    fn scope() -> impl Strategy<Value = InstrumentationScope> {
        (
            text(),
            prop::option::of(text()),
            prop::option::of("https://[a-z]{1,8}\\.io/[0-9.]{1,6}"),
            sdk_attributes(),
        )
            .prop_map(|(name, version, schema, attributes)| {
                let mut scope = InstrumentationScope::builder(name).with_attributes(attributes);
                if let Some(version) = version {
                    scope = scope.with_version(version);
                }
                if let Some(schema) = schema {
                    scope = scope.with_schema_url(schema);
                }
                scope.build()
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Our bytes are prost's encoding of the SDK's conversion of the
        /// same spans, and decode (with the OTLP definitions) to the same
        /// request.
        #[test]
        fn encodes_what_the_sdk_and_prost_encode(
            batch in prop::collection::vec(span(), 0..8),
            resource in resource(),
            scope in scope(),
        ) {
            let mut encoder = TraceEncoder::new();
            encoder.set_resource(&resource);
            encoder.set_scope(&scope);
            let expected = reference(&batch, &resource, &scope);
            let ours = encoder.encode(&batch).to_vec();
            let decoded = ExportTraceServiceRequest::decode(ours.as_slice())
                .expect("our bytes decode as an ExportTraceServiceRequest");
            prop_assert_eq!(&decoded, &expected);
            prop_assert_eq!(ours, expected.encode_to_vec());
            // The reused encoder's next batch is as a fresh one's.
            let again = encoder.encode(&batch).to_vec();
            prop_assert_eq!(again, expected.encode_to_vec());
        }

        /// Spans encoded in hand-overs (by another encoder, as the
        /// request path does) and put into one request make the bytes of
        /// the whole batch encoded at once, in a gRPC frame too.
        #[test]
        fn hand_overs_encoded_apart_make_the_batchs_request(
            hand_overs in prop::collection::vec(prop::collection::vec(span(), 1..4), 0..5),
            resource in resource(),
            scope in scope(),
        ) {
            let mut request_path = TraceEncoder::new();
            let encoded: Vec<EncodedSpans> = hand_overs
                .iter()
                .map(|spans| request_path.encode_spans(spans))
                .collect();
            for (spans, encoded) in hand_overs.iter().zip(&encoded) {
                prop_assert_eq!(encoded.len(), spans.len());
            }
            let batch: Vec<SpanRecord> = hand_overs.concat();
            let mut export = TraceEncoder::new();
            export.set_resource(&resource);
            export.set_scope(&scope);
            let expected = reference(&batch, &resource, &scope).encode_to_vec();
            prop_assert_eq!(export.encode_encoded(&encoded).to_vec(), expected.clone());
            let frame = export.encode_grpc_frame_encoded(&encoded).expect("a frame").to_vec();
            prop_assert_eq!(&frame[5..], expected.as_slice());
        }
    }

    #[test]
    fn a_grpc_frame_is_the_message_behind_its_flag_and_length() {
        let resource = Resource::builder_empty().with_service_name("svc").build();
        let scope = InstrumentationScope::builder("router-http").build();
        let mut encoder = TraceEncoder::new();
        encoder.set_resource(&resource);
        encoder.set_scope(&scope);
        let runner = &mut proptest::test_runner::TestRunner::deterministic();
        let batch: Vec<SpanRecord> = (0..20)
            .map(|_| span().new_tree(runner).expect("a span").current())
            .collect();
        let message = encoder.encode(&batch).to_vec();
        let frame = encoder.encode_grpc_frame(&batch).expect("a frame").to_vec();
        assert_eq!(frame[0], 0, "not compressed");
        assert_eq!(
            u32::from_be_bytes([frame[1], frame[2], frame[3], frame[4]]) as usize,
            message.len()
        );
        assert_eq!(&frame[5..], message.as_slice());
        assert_eq!(
            message,
            reference(&batch, &resource, &scope).encode_to_vec()
        );
    }

    #[test]
    fn a_batch_larger_than_the_first_buffer_grows_it() {
        // Far more than the first 4 KiB: the content moves as it grows.
        let resource = Resource::builder_empty().with_service_name("svc").build();
        let scope = InstrumentationScope::builder("router-http").build();
        let mut encoder = TraceEncoder::new();
        encoder.set_resource(&resource);
        encoder.set_scope(&scope);
        let long = "é".repeat(3000);
        let batch: Vec<SpanRecord> = (0..40u8)
            .map(|i| SpanRecord {
                trace_id: [i + 1; 16],
                span_id: [i + 1; 8],
                parent_span_id: [0; 8],
                trace_flags: 1,
                parent_is_remote: false,
                trace_state: None,
                kind: SpanKind::Server,
                name: Cow::Borrowed("POST /v1/chat/completions"),
                start: UNIX_EPOCH + Duration::from_secs(1_700_000_000),
                end: UNIX_EPOCH + Duration::from_secs(1_700_000_001),
                attributes: vec![Attribute::new("long", long.clone())],
                dropped_attributes: 0,
                status: Status::Unset,
            })
            .collect();
        let ours = encoder.encode(&batch).to_vec();
        assert!(ours.len() > 200_000);
        assert_eq!(ours, reference(&batch, &resource, &scope).encode_to_vec());
    }
}
