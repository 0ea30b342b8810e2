//! The request views: what of an OpenAI-style body decides the prompt.
//!
//! [`ChatRequest`] keeps `messages`, `tools`, `documents` and
//! `chat_template_kwargs` as template values built straight from the JSON,
//! **in the order the client wrote the keys** (a chat template that prints
//! `tools | tojson` or iterates `.items()` must see what the engine sees;
//! Python dicts keep insertion order). Parse it from the body bytes with
//! [`ChatRequest::from_json`] for that guarantee. [`ChatRequest::from_value`]
//! takes an already parsed [`serde_json::Value`]; its objects are in whatever
//! order `serde_json` kept (sorted keys unless `serde_json`'s
//! `preserve_order` feature is on), which matters only for templates that
//! print whole objects.

use minijinja::Value;
use serde::{Deserialize, Deserializer};

use crate::error::{Error, Result};

/// A JSON value as the template engine sees it (order-preserving).
#[derive(Debug, Clone, Default)]
pub(crate) struct TemplateValue(pub(crate) Value);

impl<'de> Deserialize<'de> for TemplateValue {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Value::deserialize(deserializer).map(TemplateValue)
    }
}

fn yes() -> bool {
    true
}

/// The parts of a `/v1/chat/completions` body that decide the prompt.
///
/// Unknown fields are ignored, so the whole request body deserializes into
/// it. Defaults follow vLLM's `ChatCompletionRequest`:
/// `add_generation_prompt = true`, `continue_final_message = false`,
/// `add_special_tokens = false`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub(crate) messages: TemplateValue,
    #[serde(default)]
    pub(crate) tools: Option<TemplateValue>,
    #[serde(default)]
    pub(crate) documents: Option<TemplateValue>,
    #[serde(default)]
    pub(crate) chat_template_kwargs: Option<TemplateValue>,
    #[serde(default = "yes")]
    pub(crate) add_generation_prompt: bool,
    #[serde(default)]
    pub(crate) continue_final_message: bool,
    #[serde(default)]
    pub(crate) add_special_tokens: bool,
}

impl ChatRequest {
    /// Parses a request body (the whole `/v1/chat/completions` JSON).
    pub fn from_json(body: &[u8]) -> Result<Self> {
        serde_json::from_slice(body).map_err(|e| Error::InvalidRequest(e.to_string()))
    }

    /// Reads a request body that is already parsed. Object keys come in
    /// `serde_json`'s order (see the module docs).
    pub fn from_value(body: &serde_json::Value) -> Result<Self> {
        Self::deserialize(body).map_err(|e| Error::InvalidRequest(e.to_string()))
    }

    /// A request with these messages (a JSON array of message objects) and
    /// every other field at its default.
    pub fn new(messages: &serde_json::Value) -> Result<Self> {
        let messages = TemplateValue::deserialize(messages)
            .map_err(|e| Error::InvalidRequest(e.to_string()))?;
        Ok(Self {
            messages,
            tools: None,
            documents: None,
            chat_template_kwargs: None,
            add_generation_prompt: true,
            continue_final_message: false,
            add_special_tokens: false,
        })
    }

    /// Sets `tools` (a JSON array of tool definitions).
    pub fn with_tools(mut self, tools: &serde_json::Value) -> Result<Self> {
        self.tools = Some(
            TemplateValue::deserialize(tools).map_err(|e| Error::InvalidRequest(e.to_string()))?,
        );
        Ok(self)
    }

    /// Sets `add_generation_prompt` (default `true`).
    pub fn with_add_generation_prompt(mut self, yes: bool) -> Self {
        self.add_generation_prompt = yes;
        self
    }

    /// The number of messages, when `messages` is a list.
    pub fn message_count(&self) -> Option<usize> {
        self.messages.0.len()
    }

    /// Whether the request asks for the generation prompt.
    pub fn add_generation_prompt(&self) -> bool {
        self.add_generation_prompt
    }
}

/// One prompt of a `/v1/completions` request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompletionPrompt {
    /// A text prompt: tokenized (with special tokens unless the request
    /// says `add_special_tokens: false`).
    Text(String),
    /// A prompt of token ids: used as given.
    Tokens(Vec<u32>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptField {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// The parts of a `/v1/completions` body that decide the prompt.
/// `add_special_tokens` defaults to `true`, as in vLLM's `CompletionRequest`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompletionRequest {
    /// The prompt.
    pub prompt: CompletionPrompt,
    /// Whether the tokenizer adds its special tokens (BOS) to a text prompt.
    pub add_special_tokens: bool,
}

impl<'de> Deserialize<'de> for CompletionRequest {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Body {
            prompt: PromptField,
            #[serde(default = "yes")]
            add_special_tokens: bool,
        }
        let body = Body::deserialize(deserializer)?;
        let prompt = match body.prompt {
            PromptField::Text(text) => CompletionPrompt::Text(text),
            PromptField::Tokens(tokens) => CompletionPrompt::Tokens(tokens),
            PromptField::Texts(mut texts) if texts.len() == 1 => {
                CompletionPrompt::Text(texts.pop().unwrap_or_default())
            }
            PromptField::TokenLists(mut lists) if lists.len() == 1 => {
                CompletionPrompt::Tokens(lists.pop().unwrap_or_default())
            }
            _ => {
                return Err(serde::de::Error::custom(
                    "one prompt per request: batched prompts have no single token sequence",
                ));
            }
        };
        Ok(Self {
            prompt,
            add_special_tokens: body.add_special_tokens,
        })
    }
}

impl CompletionRequest {
    /// Parses a request body (the whole `/v1/completions` JSON).
    pub fn from_json(body: &[u8]) -> Result<Self> {
        serde_json::from_slice(body).map_err(|e| Error::InvalidRequest(e.to_string()))
    }

    /// A text prompt with vLLM's default (`add_special_tokens = true`).
    pub fn text(prompt: impl Into<String>) -> Self {
        Self {
            prompt: CompletionPrompt::Text(prompt.into()),
            add_special_tokens: true,
        }
    }

    /// A token-id prompt.
    pub fn tokens(ids: Vec<u32>) -> Self {
        Self {
            prompt: CompletionPrompt::Tokens(ids),
            add_special_tokens: true,
        }
    }
}
