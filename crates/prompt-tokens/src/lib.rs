//! # prompt-tokens
//!
//! Turns an OpenAI-style request into the prompt token ids an inference
//! engine (vLLM and alike) computes for it, cheaply enough to route on:
//! cache-aware routing can then match the *token blocks* an engine caches
//! instead of characters of the message texts.
//!
//! * **Chat templates** ([`ChatTemplate`]): the model's Hugging Face Jinja
//!   `chat_template` on minijinja, with transformers' globals
//!   (`raise_exception`, `strftime_now`, Python-style `tojson`, Python
//!   string/dict methods) and hard limits (template size, fuel, output
//!   size). Four templates written for this crate ship in [`templates`].
//!   Renderings go first through a **direct renderer** that walks the
//!   template's syntax tree (minijinja's own parser) over the request's
//!   values without minijinja's virtual machine, two to three times
//!   cheaper; whatever it does not handle exactly as minijinja does
//!   (a rare construct, an error, a limit) it declines and minijinja
//!   renders, so text and errors are minijinja's either way (see
//!   [`DirectRendering`]; differential tests and the fuzz target hold the
//!   two equal). A **render memo** keeps the state the template's loop
//!   over the messages reached, so a conversation's next turn renders
//!   only its new messages, byte for byte as a full rendering
//!   ([`ChatTemplate::with_render_memo`]). Messages read through a
//!   [`MessageMemo`] are the same objects turn after turn, and each
//!   template keeps what vLLM's message preparation made of them by that
//!   identity, so only new messages are prepared.
//! * **Tokenization** of a `tokenizer.json` or a tiktoken-format
//!   vocabulary ([`tiktoken`]: `*.tiktoken`, o200k pre-tokenization, the
//!   gpt-oss harmony special tokens), or engine-sim's [`synthetic`] rule
//!   (`chars_per_token` characters per token). See "Encoders" below.
//! * **A segment cache** ([`SegmentCache`]): a rendered chat is cut at the
//!   tokenizer's added tokens and each piece's ids are cached, so a
//!   multi-turn request tokenizes only its new messages — with exactly the
//!   ids of tokenizing the whole rendering (tokenizers where that would
//!   not hold are detected and tokenized whole; see [`SegmentMode`]). With
//!   a tiktoken vocabulary, pieces of up to 16 bytes are encoded directly:
//!   cheaper than a lookup. A **prefix memo** goes further for a long
//!   conversation: its next rendering takes the ids of the text it shares
//!   with the previous one, up to an added token the difference cannot
//!   have moved, and is cut and looked up only after it
//!   ([`PromptTokenizer::prefix_memo_stats`]).
//!
//! # vLLM's rules, and where they come from
//!
//! Checked in vLLM's source (`vllm/entrypoints/openai/chat_completion/protocol.py`,
//! `ChatCompletionRequest`; `vllm/entrypoints/openai/completion/protocol.py`,
//! `CompletionRequest`):
//!
//! * chat: the template is rendered with `add_generation_prompt` (default
//!   `true`), `continue_final_message` (default `false`), `tools`,
//!   `documents` and `chat_template_kwargs`, then tokenized with
//!   `add_special_tokens` **false** by default ("the chat template takes
//!   care of adding the special tokens");
//! * completions: a text prompt is tokenized with `add_special_tokens`
//!   **true** by default; a prompt of token ids is used as given.
//!
//! [`PromptTokenizer::chat_tokens`] and
//! [`PromptTokenizer::completion_tokens`] follow these defaults and honour
//! the request's own `add_special_tokens`.
//!
//! # Example
//!
//! ```
//! use prompt_tokens::{ChatRequest, CompletionRequest, PromptTokenizer};
//!
//! // engine-sim's synthetic tokenizer: 4 characters per token.
//! let tokenizer = PromptTokenizer::synthetic(4);
//! let body = br#"{"model": "m", "messages": [
//!     {"role": "system", "content": "You are terse."},
//!     {"role": "user", "content": "Hi!"}
//! ]}"#;
//! let request = ChatRequest::from_json(body)?;
//! let text = tokenizer.chat_text(&request)?;
//! assert_eq!(text, "<|system|>\nYou are terse.\n<|user|>\nHi!\n<|assistant|>\n");
//! let ids = tokenizer.chat_tokens(&request)?;
//! assert_eq!(ids.len(), text.chars().count().div_ceil(4)); // 53 chars
//! assert_eq!(ids, prompt_tokens::synthetic_tokenize(&text, 4));
//!
//! // Token-id prompts are used as given.
//! let completion = CompletionRequest::from_json(br#"{"prompt": [1, 2, 3]}"#)?;
//! assert_eq!(tokenizer.completion_tokens(&completion)?, vec![1, 2, 3]);
//! # Ok::<(), prompt_tokens::Error>(())
//! ```
//!
//! A real model: `PromptTokenizer::from_path(Path::new("/models/qwen"), None)`
//! reads `tokenizer.json` and `tokenizer_config.json` (template, BOS/EOS)
//! from the directory; [`testing::write_model_dir`] builds such a
//! directory for tests. `from_path` also takes a `*.tiktoken` file, with
//! the chat template as the override.
//!
//! # Cost
//!
//! A warm multi-turn request (a 7 KB system prompt, ten turns, one new
//! message) costs about 230k instructions from body bytes to ids: the JSON
//! parse and the template rendering (about a third each) and cache lookups
//! for every segment but the new one. `examples/warm_path.rs` runs it in a loop
//! for profiling; the README has the measurements.
//!
//! # Encoders
//!
//! The text between special tokens is encoded by the crate's own
//! encoders where they give exactly the ids of the `tokenizers` crate
//! ([`TextEncoder::Direct`]): tiktoken's algorithm on a tiktoken
//! vocabulary's ranks, and byte-level BPE on a `tokenizer.json`'s merges
//! for the shape Llama 3, Qwen 2.5 / 3, DeepSeek V3 and Mistral's Tekken
//! publish (isolated regex splits, byte-level mapping, no normalizer or
//! NFC): `tokenizers`' own merge order run on bytes, its split patterns on
//! `regex-automata` with their one look-ahead branch decided by hand. A
//! file of any other shape (SentencePiece-style `▁` normalizers, WordPiece,
//! dropout, …) stays on the `tokenizers` pipeline (pure Rust:
//! `fancy-regex`, no oniguruma), and [`PromptTokenizer::text_encoder`]
//! says why; so does non-ASCII text under NFC, segment by segment.
//! A text encoded with special tokens (a completion's prompt) takes the
//! direct encoder too when the post-processor only puts fixed tokens
//! around it (Llama's BOS template, Mistral's `<s>`), checked at load.
//! [`TokenizerOptions::direct_encoder`] turns the direct encoder off.
//! Property tests compare it with `tokenizers` on random text, and the
//! template corpus with Python's `tokenizers` on real models.
//!
//! # Concurrency
//!
//! [`PromptTokenizer`] is `Send + Sync`; share one per model in an `Arc`.
//! Rendering holds no lock; the segment cache and the prefix memo are
//! sharded, each shard a `parking_lot::Mutex` held only for one map
//! operation, never while tokenizing or comparing texts.
//!
//! # Known differences from Python Jinja
//!
//! Constants, lists and dicts print as Python's `str()` prints them, and
//! `map`, `select`, jinja2's other generator filters and `reverse` return
//! one-shot iterators that `tojson`, `length` and `last` refuse, as in
//! Python.
//! Undefined-value rules differ in corner cases and a generator's items
//! are computed when its filter runs (the crate README lists the
//! differences); `x | safe + y` HTML-escapes `y` as markupsafe does (a
//! load-time rewrite of such `+`, module `markup`). The
//! common template idioms (string methods, `tojson`, `loop`, `namespace`,
//! slicing, `is string` / `is mapping` tests) behave alike.

#![warn(missing_docs)]

mod added;
mod bpe;
mod cache;
mod clock_text;
mod config;
mod direct;
mod error;
pub mod fuzzing;
mod generators;
mod hf;
mod interrupt;
mod markup;
mod message_memo;
pub mod messages;
mod o200k_split;
mod prefix;
mod pyfilters;
mod pyrepr;
mod request;
mod rewrite;
mod support;
pub mod synthetic;
mod template;
pub mod templates;
pub mod testing;
pub mod tiktoken;
mod tojson;
mod tokenizer;

pub use cache::{CacheStats, ENTRY_OVERHEAD_BYTES, SegmentCache, SegmentUse};
pub use clock_text::strftime;
pub use config::TokenizerConfig;
pub use direct::{DEFAULT_RENDER_MEMO_BYTES, RenderMemoStats};
pub use error::{Error, Result};
pub use hf::{SegmentMode, TextEncoder};
pub use interrupt::Interrupt;
pub use message_memo::{DEFAULT_MESSAGE_MEMO_BYTES, MIN_BODY_BYTES, MessageMemo, MessageMemoStats};
pub use messages::ContentFormat;
pub use prefix::{DEFAULT_PREFIX_MEMO_BYTES, PrefixMemoStats};
pub use request::{
    ChatFields, ChatRequest, CompletionPrompt, CompletionRequest, Conversation, TextPieces,
};
pub use synthetic::{
    synthetic_chat_text, synthetic_count, synthetic_tokenize, synthetic_tokenize_into,
};
pub use template::{
    ChatTemplate, Clock, DirectRendering, FixedClock, RenderLimits, SpecialTokens, SystemClock,
};
pub use templates::TemplateFamily;
pub use tokenizer::{PromptTokenizer, TokenizerOptions};

#[cfg(test)]
mod send_sync {
    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn shared_types_are_send_and_sync() {
        assert_send_sync::<super::PromptTokenizer>();
        assert_send_sync::<super::SegmentCache>();
        assert_send_sync::<super::ChatTemplate>();
    }
}
