//! Usage rewriting inside a streaming (SSE) decode response.
//!
//! With `stream_options.include_usage` the decode engine ends its stream with
//! a usage event that counts the transferred KV as cached prompt tokens. The
//! same merge as for non-streaming responses ([`crate::merge::merge_usage`])
//! is applied to every `data:` event that carries a `usage` object, once the
//! prefill's usage is known.
//!
//! Cost: chunks are passed through untouched (no copy, no parse) unless they
//! contain `"usage"` or split an event; only events that mention `"usage"`
//! are parsed. A partial event is buffered up to a limit, past which the
//! buffer is passed through unrewritten rather than grown.

use bytes::{Bytes, BytesMut};
use serde_json::Value;

use crate::merge::merge_usage;

const USAGE_KEY: &[u8] = b"\"usage\"";

/// Rewrites the usage events of one SSE stream.
#[derive(Debug)]
pub(crate) struct UsageRewriter {
    /// `{"usage": {...}}` of the prefill response, once known.
    prefill: Option<Value>,
    pending: BytesMut,
    max_pending: usize,
}

impl UsageRewriter {
    pub(crate) fn new(max_pending: usize) -> Self {
        Self {
            prefill: None,
            pending: BytesMut::new(),
            max_pending,
        }
    }

    /// Records the prefill response's usage (ignored without one).
    pub(crate) fn set_prefill(&mut self, prefill_response: &Value) {
        if let Some(usage) = prefill_response.get("usage").filter(|u| u.is_object()) {
            let mut snapshot = serde_json::Map::with_capacity(1);
            snapshot.insert("usage".to_owned(), usage.clone());
            self.prefill = Some(Value::Object(snapshot));
        }
    }

    /// Feeds one chunk; returns what can be sent now (`None`: all buffered).
    pub(crate) fn push(&mut self, chunk: Bytes) -> Option<Bytes> {
        let untouched = self.pending.is_empty()
            && (self.prefill.is_none()
                || (ends_with_boundary(&chunk) && !contains(&chunk, USAGE_KEY)));
        if untouched {
            return Some(chunk);
        }
        self.pending.extend_from_slice(&chunk);
        self.flush_complete()
    }

    /// The buffered tail at end of stream.
    pub(crate) fn finish(&mut self) -> Option<Bytes> {
        if self.pending.is_empty() {
            return None;
        }
        let tail = self.pending.split().freeze();
        Some(self.rewrite(&tail).unwrap_or(tail))
    }

    fn flush_complete(&mut self) -> Option<Bytes> {
        let Some(end) = last_boundary(&self.pending) else {
            if self.pending.len() > self.max_pending {
                // A runaway event: stop buffering, pass it on as it is.
                return Some(self.pending.split().freeze());
            }
            return None;
        };
        let complete = self.pending.split_to(end).freeze();
        Some(self.rewrite(&complete).unwrap_or(complete))
    }

    /// Rewrites the usage events of complete `events`; `None` when nothing
    /// changed.
    fn rewrite(&self, events: &[u8]) -> Option<Bytes> {
        let prefill = self.prefill.as_ref()?;
        if !contains(events, USAGE_KEY) {
            return None;
        }
        let mut out = Vec::with_capacity(events.len() + 64);
        let mut changed = false;
        let mut rest = events;
        while !rest.is_empty() {
            let line_end = rest
                .iter()
                .position(|&b| b == b'\n')
                .map_or(rest.len(), |i| i + 1);
            let (line, after) = rest.split_at(line_end);
            rest = after;
            match rewrite_data_line(line, prefill) {
                Some(new_line) => {
                    out.extend_from_slice(&new_line);
                    changed = true;
                }
                None => out.extend_from_slice(line),
            }
        }
        changed.then(|| Bytes::from(out))
    }
}

/// Rewrites one `data: {json}` line carrying a usage object.
fn rewrite_data_line(line: &[u8], prefill: &Value) -> Option<Vec<u8>> {
    let payload = line.strip_prefix(b"data:")?;
    let (content, ending): (&[u8], &[u8]) = if let Some(c) = payload.strip_suffix(b"\r\n") {
        (c, b"\r\n")
    } else if let Some(c) = payload.strip_suffix(b"\n") {
        (c, b"\n")
    } else {
        (payload, b"")
    };
    let json = content.strip_prefix(b" ").unwrap_or(content);
    if !contains(json, USAGE_KEY) {
        return None;
    }
    let mut value: Value = serde_json::from_slice(json).ok()?;
    if !value.get("usage").is_some_and(Value::is_object) || !merge_usage(prefill, &mut value) {
        return None;
    }
    let mut out = Vec::with_capacity(line.len() + 16);
    out.extend_from_slice(b"data: ");
    serde_json::to_writer(&mut out, &value).ok()?;
    out.extend_from_slice(ending);
    Some(out)
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// Whether `buf` ends right after an empty line.
fn ends_with_boundary(buf: &[u8]) -> bool {
    buf.ends_with(b"\n\n") || buf.ends_with(b"\n\r\n")
}

/// The end (exclusive) of the last complete event in `buf`.
fn last_boundary(buf: &[u8]) -> Option<usize> {
    (1..buf.len()).rev().find_map(|i| {
        let blank = buf[i] == b'\n'
            && (buf[i - 1] == b'\n' || (i >= 2 && buf[i - 1] == b'\r' && buf[i - 2] == b'\n'));
        blank.then_some(i + 1)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn rewriter() -> UsageRewriter {
        let mut r = UsageRewriter::new(1 << 16);
        r.set_prefill(&json!({"usage": {"prompt_tokens": 7, "completion_tokens": 1,
            "prompt_tokens_details": {"cached_tokens": 3}}, "kv_transfer_params": {"big": [1, 2, 3]}}));
        r
    }

    fn run(r: &mut UsageRewriter, chunks: &[&str]) -> String {
        let mut out = Vec::new();
        for chunk in chunks {
            if let Some(b) = r.push(Bytes::from((*chunk).to_owned())) {
                out.extend_from_slice(&b);
            }
        }
        if let Some(b) = r.finish() {
            out.extend_from_slice(&b);
        }
        String::from_utf8(out).unwrap()
    }

    const USAGE_EVENT: &str = "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":5,\"total_tokens\":12,\"prompt_tokens_details\":{\"cached_tokens\":7}}}\n\n";

    #[test]
    fn token_events_pass_through_without_copy_and_usage_event_is_rewritten() {
        let mut r = rewriter();
        let token = Bytes::from_static(b"data: {\"choices\":[{\"text\":\"a\"}]}\n\n");
        let passed = r.push(token.clone()).unwrap();
        assert_eq!(passed.as_ptr(), token.as_ptr(), "fast path copies nothing");
        let out = run(&mut r, &[USAGE_EVENT, "data: [DONE]\n\n"]);
        let (usage_line, rest) = out.split_once("\n\n").unwrap();
        assert_eq!(rest, "data: [DONE]\n\n");
        let usage: Value =
            serde_json::from_str(usage_line.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(
            usage,
            json!({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
                "prompt_tokens_details": {"cached_tokens": 3}}})
        );
    }

    #[test]
    fn events_split_across_chunks_are_reassembled() {
        let whole = format!(
            "data: {{\"choices\":[{{\"text\":\"a\"}}]}}\r\n\r\n{USAGE_EVENT}data: [DONE]\n\n"
        );
        for split in [1, 5, 17, 40, whole.len() - 3] {
            let (a, b) = whole.split_at(split);
            let out = run(&mut rewriter(), &[a, b]);
            assert!(
                out.contains("\"cached_tokens\":3"),
                "split at {split}: {out}"
            );
            assert!(!out.contains("\"cached_tokens\":7"));
            assert!(out.starts_with("data: {\"choices\":[{\"text\":\"a\"}]}\r\n\r\n"));
            assert!(out.ends_with("data: [DONE]\n\n"));
        }
    }

    #[test]
    fn without_prefill_usage_the_stream_is_untouched() {
        let mut r = UsageRewriter::new(1 << 16);
        r.set_prefill(&json!({"id": "no usage"}));
        assert_eq!(run(&mut r, &[USAGE_EVENT]), USAGE_EVENT);
    }

    #[test]
    fn runaway_events_are_passed_on_unbuffered() {
        let mut r = UsageRewriter::new(8);
        let out = run(&mut r, &["data: {\"usage\": 1234567890", "more"]);
        assert_eq!(out, "data: {\"usage\": 1234567890more");
    }

    #[test]
    fn malformed_usage_lines_are_kept() {
        let mut r = rewriter();
        let input = "data: {\"usage\": [1]}\n\ndata: {\"usage\": \n\n: comment \"usage\"\n\n";
        assert_eq!(run(&mut r, &[input]), input);
    }
}
