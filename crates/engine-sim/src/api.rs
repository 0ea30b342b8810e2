//! The OpenAI-compatible wire format: request parsing, the prompt,
//! JSON responses, SSE chunks and vLLM-style errors.
//!
//! Parsing is lenient where vLLM is (unknown fields are ignored, `null`
//! means absent) and strict where it is not (bad JSON, wrong types and
//! missing required fields are 400 errors naming the problem).
//!
//! The prompt comes from [`prompt_tokens`]: without a tokenizer, a chat is
//! rendered by the synthetic rule ([`prompt_tokens::synthetic_chat_text`],
//! `<|role|>\ncontent\n` per message, then `<|assistant|>\n`) and tokenized
//! later by `chars_per_token`; with a [`PromptTokenizer`]
//! ([`parse_request_with`]), a chat's ids are
//! [`PromptTokenizer::chat_tokens`] of the body and a completion's
//! [`PromptTokenizer::completion_tokens`], and a template or tokenizer
//! error is a 400 with its message, as vLLM answers.

use prompt_tokens::{ChatRequest, CompletionPrompt, CompletionRequest, PromptTokenizer};
use serde::Deserialize;
use serde_json::{Value, json};

/// Which endpoint a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Endpoint {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/completions`
    Completions,
}

/// A parsed generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationRequest {
    /// The endpoint.
    pub endpoint: Endpoint,
    /// The model named by the client, if any.
    pub model: Option<String>,
    /// The prompt: text (chat: after the synthetic template) to tokenize
    /// by the synthetic rule, or token ids (given by the client, or
    /// computed by the engine's tokenizer).
    pub prompt: Prompt,
    /// `max_tokens` (or `max_completion_tokens` for chat).
    pub max_tokens: Option<u32>,
    /// `stream`.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `stream_options.continuous_usage_stats`.
    pub continuous_usage: bool,
    /// `kv_transfer_params`, verbatim.
    pub kv_transfer_params: Option<Value>,
}

/// A prompt as text or as token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Prompt {
    /// Text, tokenized by the synthetic rule (`chars_per_token`).
    Text(String),
    /// Token ids, used as given.
    Tokens(Vec<u32>),
}

/// A client error, rendered as vLLM does.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct EngineApiError {
    /// HTTP status.
    pub status: u16,
    /// The error type name (`BadRequestError`, `NotFoundError`, ...).
    pub kind: &'static str,
    /// A message naming the problem.
    pub message: String,
}

impl EngineApiError {
    /// A 400 `BadRequestError`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        EngineApiError {
            status: 400,
            kind: "BadRequestError",
            message: message.into(),
        }
    }

    /// A 404 `NotFoundError`.
    pub fn not_found(message: impl Into<String>) -> Self {
        EngineApiError {
            status: 404,
            kind: "NotFoundError",
            message: message.into(),
        }
    }

    /// An error with any status; the type name follows the status class.
    pub fn with_status(status: u16, message: impl Into<String>) -> Self {
        let kind = match status {
            400 => "BadRequestError",
            404 => "NotFoundError",
            429 => "RateLimitError",
            503 => "ServiceUnavailableError",
            401..=403 | 405..=428 | 430..=499 => "InvalidRequestError",
            _ => "InternalServerError",
        };
        EngineApiError {
            status,
            kind,
            message: message.into(),
        }
    }

    /// The JSON body: `{"error": {"message", "type", "param", "code"}}`.
    pub fn to_json(&self) -> String {
        json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": null,
                "code": self.status,
            }
        })
        .to_string()
    }
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
    #[serde(default)]
    continuous_usage_stats: Option<bool>,
}

#[derive(Deserialize)]
struct ChatBody {
    #[serde(default)]
    model: Option<String>,
    /// Rendered by prompt-tokens, which checks its shape.
    messages: Value,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    kv_transfer_params: Option<Value>,
}

#[derive(Deserialize)]
struct CompletionBody {
    #[serde(default)]
    model: Option<String>,
    /// Read as a [`CompletionPrompt`] after the model check (vLLM answers
    /// an unknown model before it looks at the prompt).
    prompt: Value,
    #[serde(default)]
    max_tokens: Option<u32>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    kv_transfer_params: Option<Value>,
}

/// Parses a request body for `endpoint` with the synthetic tokenizer's
/// rendering: a chat's prompt is [`Prompt::Text`] (the synthetic
/// template), a completion's is its text or token ids as given.
pub fn parse_request(endpoint: Endpoint, body: &[u8]) -> Result<GenerationRequest, EngineApiError> {
    parse_request_with(endpoint, body, None, None)
}

/// Parses a request body for `endpoint`. With a `tokenizer`, the prompt is
/// always [`Prompt::Tokens`]: [`PromptTokenizer::chat_tokens`] of a chat
/// body (its template, `tools`, `chat_template_kwargs`, ...) or
/// [`PromptTokenizer::completion_tokens`] of a completion's; a rendering
/// or tokenization error is a 400 carrying prompt-tokens' message.
///
/// With a `served_model`, a request naming another model is a 404 ("The
/// model `x` does not exist.") before its prompt is computed: vLLM checks
/// the model before it renders, so a bad prompt for an unknown model is
/// reported as the unknown model. Without either this is
/// [`parse_request`].
pub fn parse_request_with(
    endpoint: Endpoint,
    body: &[u8],
    tokenizer: Option<&PromptTokenizer>,
    served_model: Option<&str>,
) -> Result<GenerationRequest, EngineApiError> {
    let check_model = |model: &Option<String>| match (model, served_model) {
        (Some(model), Some(served)) if model != served => Err(EngineApiError::not_found(format!(
            "The model `{model}` does not exist."
        ))),
        _ => Ok(()),
    };
    let bytes = body;
    // Syntax first, so malformed JSON gets its own clear message.
    let value: Value = serde_json::from_slice(bytes)
        .map_err(|e| EngineApiError::bad_request(format!("Invalid JSON in request body: {e}")))?;
    if !value.is_object() {
        return Err(EngineApiError::bad_request(
            "The request body must be a JSON object",
        ));
    }
    let invalid =
        |e: serde_json::Error| EngineApiError::bad_request(format!("Invalid request: {e}"));
    match endpoint {
        Endpoint::Chat => {
            let body: ChatBody = serde_json::from_value(value).map_err(invalid)?;
            check_model(&body.model)?;
            let prompt = match tokenizer {
                None => Prompt::Text(
                    prompt_tokens::synthetic_chat_text(&body.messages).map_err(prompt_error)?,
                ),
                // From the bytes: the template sees the client's key order.
                Some(tokenizer) => Prompt::Tokens(
                    ChatRequest::from_json(bytes)
                        .and_then(|request| tokenizer.chat_tokens(&request))
                        .map_err(prompt_error)?,
                ),
            };
            let options = body.stream_options;
            Ok(GenerationRequest {
                endpoint,
                model: body.model,
                prompt,
                max_tokens: body.max_completion_tokens.or(body.max_tokens),
                stream: body.stream.unwrap_or(false),
                include_usage: options.as_ref().and_then(|o| o.include_usage) == Some(true),
                continuous_usage: options.and_then(|o| o.continuous_usage_stats) == Some(true),
                kv_transfer_params: body.kv_transfer_params.filter(|v| !v.is_null()),
            })
        }
        Endpoint::Completions => {
            let body: CompletionBody = serde_json::from_value(value).map_err(invalid)?;
            check_model(&body.model)?;
            // prompt-tokens' reading, so the router and this engine accept
            // the same prompts (one text or one id list, or a batch of one).
            let prompt = match CompletionPrompt::deserialize(body.prompt).map_err(invalid)? {
                CompletionPrompt::Text(text) => Prompt::Text(text),
                CompletionPrompt::Tokens(tokens) => Prompt::Tokens(tokens),
            };
            let prompt = match tokenizer {
                None => prompt,
                Some(tokenizer) => Prompt::Tokens(
                    CompletionRequest::from_json(bytes)
                        .and_then(|request| tokenizer.completion_tokens(&request))
                        .map_err(prompt_error)?,
                ),
            };
            let options = body.stream_options;
            Ok(GenerationRequest {
                endpoint,
                model: body.model,
                prompt,
                max_tokens: body.max_tokens,
                stream: body.stream.unwrap_or(false),
                include_usage: options.as_ref().and_then(|o| o.include_usage) == Some(true),
                continuous_usage: options.and_then(|o| o.continuous_usage_stats) == Some(true),
                kv_transfer_params: body.kv_transfer_params.filter(|v| !v.is_null()),
            })
        }
    }
}

/// A prompt-tokens error as the 400 vLLM answers for a prompt it cannot
/// build (the message names the problem: the template's exception, an
/// invalid message, ...).
fn prompt_error(error: prompt_tokens::Error) -> EngineApiError {
    EngineApiError::bad_request(error.to_string())
}

/// Usage numbers of one response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Output tokens so far.
    pub completion_tokens: u32,
    /// Prompt tokens from the prefix cache or a KV transfer.
    pub cached_tokens: usize,
}

impl Usage {
    /// The `usage` object.
    pub fn to_json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens as usize,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// Identity shared by every chunk of one response.
#[derive(Debug, Clone)]
pub struct ResponseMeta {
    /// `chatcmpl-...` or `cmpl-...`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// The served model name.
    pub model: String,
    /// The endpoint.
    pub endpoint: Endpoint,
}

impl ResponseMeta {
    /// The response id prefix for an endpoint.
    pub fn id_prefix(endpoint: Endpoint) -> &'static str {
        match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completions => "cmpl",
        }
    }
}

/// The non-streaming response body.
pub fn full_response(
    meta: &ResponseMeta,
    text: &str,
    finish_reason: &str,
    usage: Usage,
    kv_transfer_params: Option<&Value>,
) -> Value {
    let choice = match meta.endpoint {
        Endpoint::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text, "tool_calls": []},
            "logprobs": null,
            "finish_reason": finish_reason,
            "stop_reason": null,
        }),
        Endpoint::Completions => json!({
            "index": 0,
            "text": text,
            "logprobs": null,
            "finish_reason": finish_reason,
            "stop_reason": null,
        }),
    };
    json!({
        "id": meta.id,
        "object": match meta.endpoint {
            Endpoint::Chat => "chat.completion",
            Endpoint::Completions => "text_completion",
        },
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": usage.to_json(),
        "kv_transfer_params": kv_transfer_params,
    })
}

/// One streamed chunk. `delta` is the new text; chat's first chunk also
/// carries `role`. `usage` is set only with `continuous_usage_stats`.
pub fn stream_chunk(
    meta: &ResponseMeta,
    delta: &str,
    first: bool,
    finish_reason: Option<&str>,
    usage: Option<Usage>,
) -> Value {
    let choice = match meta.endpoint {
        Endpoint::Chat => {
            let delta = if first {
                json!({"role": "assistant", "content": delta})
            } else {
                json!({"content": delta})
            };
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason})
        }
        Endpoint::Completions => json!({
            "index": 0, "text": delta, "logprobs": null,
            "finish_reason": finish_reason, "stop_reason": null,
        }),
    };
    let mut chunk = json!({
        "id": meta.id,
        "object": match meta.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        },
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
    });
    if let Some(usage) = usage {
        chunk["usage"] = usage.to_json();
    }
    chunk
}

/// The final usage-only chunk (`choices: []`) sent when
/// `stream_options.include_usage` is true.
pub fn usage_chunk(meta: &ResponseMeta, usage: Usage) -> Value {
    json!({
        "id": meta.id,
        "object": match meta.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        },
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage.to_json(),
    })
}

/// Frames a JSON value as one SSE event: `data: {json}\n\n`.
pub fn sse_event(value: &Value) -> bytes::Bytes {
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"data: ");
    // Serializing a Value into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut out, value);
    out.extend_from_slice(b"\n\n");
    out.into()
}

/// The stream terminator.
pub const SSE_DONE: &[u8] = b"data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_parses_with_unknown_fields_and_parts() {
        let body = br#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],
            "temperature":0.5,"stream":true,"stream_options":{"include_usage":true},"whatever":[1]}"#;
        let req = parse_request(Endpoint::Chat, body).expect("valid");
        assert_eq!(
            req.prompt,
            Prompt::Text("<|user|>\nhi\n<|assistant|>\n".into())
        );
        assert!(req.stream && req.include_usage);
    }

    #[test]
    fn errors_name_the_problem() {
        let e = parse_request(Endpoint::Chat, b"{not json").unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.message.contains("Invalid JSON"));
        let e = parse_request(Endpoint::Completions, br#"{"model":"m"}"#).unwrap_err();
        assert!(e.message.contains("prompt"), "{}", e.message);
        let v: Value = serde_json::from_str(&e.to_json()).expect("json");
        assert_eq!(v["error"]["code"], 400);
        assert_eq!(v["error"]["type"], "BadRequestError");
    }

    #[test]
    fn an_unknown_model_is_reported_before_a_bad_prompt() {
        let bad_part =
            br#"{"model":"other","messages":[{"role":"user","content":[{"type":"bogus"}]}]}"#;
        let e = parse_request_with(Endpoint::Chat, bad_part, None, Some("served")).unwrap_err();
        assert_eq!(e.status, 404, "{}", e.message);
        assert!(
            e.message.contains("`other` does not exist"),
            "{}",
            e.message
        );
        // The served model (or none named) gets to the prompt and its 400.
        for body in [
            br#"{"model":"served","messages":[{"role":"user","content":[{"type":"bogus"}]}]}"#
                .as_slice(),
            br#"{"messages":[{"role":"user","content":[{"type":"bogus"}]}]}"#,
        ] {
            let e = parse_request_with(Endpoint::Chat, body, None, Some("served")).unwrap_err();
            assert_eq!(e.status, 400, "{}", e.message);
            assert!(e.message.contains("bogus"), "{}", e.message);
        }
        let e = parse_request_with(
            Endpoint::Completions,
            br#"{"model":"other","prompt":["a","b"]}"#,
            None,
            Some("served"),
        )
        .unwrap_err();
        assert_eq!(e.status, 404, "{}", e.message);
    }
}
