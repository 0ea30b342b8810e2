//! [`PromptTokenizer`]: one model's requests to prompt token ids.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::cache::{CacheStats, SegmentCache, SegmentUse};
use crate::config::{self, TokenizerConfig};
use crate::error::{Error, Result};
use crate::hf::{HfTokenizer, SegmentMode, TextEncoder};
use crate::interrupt::Interrupt;
use crate::messages::ContentFormat;
use crate::prefix::PrefixMemoStats;
use crate::request::{ChatRequest, CompletionPrompt, CompletionRequest};
use crate::synthetic;
use crate::template::{ChatTemplate, Clock, RenderLimits, SystemClock};

/// How a [`PromptTokenizer`] is built: cache size, render limits, clock.
#[derive(Debug, Clone)]
pub struct TokenizerOptions {
    /// Segment cache budget in bytes (text + ids + overhead). Default 64 MiB.
    pub cache_bytes: usize,
    /// Segment cache shards (lock stripes). Default 16.
    pub cache_shards: usize,
    /// Bounds on the chat template and each rendering.
    pub limits: RenderLimits,
    /// The clock behind `strftime_now`. Default [`SystemClock`].
    pub clock: Arc<dyn Clock>,
    /// How the chat template expects message content; `None` (the
    /// default) detects it from the template as vLLM's `auto` does
    /// ([`ContentFormat::detect`]). Set it when the engine runs with
    /// `--chat-template-content-format string|openai`.
    pub content_format: Option<ContentFormat>,
    /// Whether a `tokenizer.json` is encoded by the crate's own byte-level
    /// BPE encoder where it gives the same ids as `tokenizers` (see
    /// [`TextEncoder`]). Default true; false keeps the `tokenizers`
    /// pipeline, for comparisons (a tiktoken vocabulary always uses its
    /// own encoder).
    pub direct_encoder: bool,
    /// The bound, in bytes, of the chat template's render memo: the
    /// states of earlier renderings' message loops, so a conversation's
    /// next turn renders only its new messages (see
    /// [`ChatTemplate::with_render_memo`]). Default
    /// [`DEFAULT_RENDER_MEMO_BYTES`](crate::DEFAULT_RENDER_MEMO_BYTES)
    /// (32 MiB); 0 turns it off.
    pub render_memo_bytes: usize,
    /// The bound, in bytes, of the prefix memo: earlier renderings and
    /// their ids, so that a conversation's next turn takes the ids of the
    /// text it shares with the previous one instead of cutting and
    /// looking up every segment again (exact: see
    /// [`PromptTokenizer::prefix_memo_stats`]). Default
    /// [`DEFAULT_PREFIX_MEMO_BYTES`](crate::DEFAULT_PREFIX_MEMO_BYTES)
    /// (16 MiB); 0 turns it off.
    pub prefix_memo_bytes: usize,
}

impl Default for TokenizerOptions {
    fn default() -> Self {
        Self {
            cache_bytes: 64 * 1024 * 1024,
            cache_shards: 16,
            limits: RenderLimits::default(),
            clock: Arc::new(SystemClock),
            content_format: None,
            direct_encoder: true,
            render_memo_bytes: crate::DEFAULT_RENDER_MEMO_BYTES,
            prefix_memo_bytes: crate::DEFAULT_PREFIX_MEMO_BYTES,
        }
    }
}

#[derive(Debug)]
enum Backend {
    Hf {
        tokenizer: Box<HfTokenizer>,
        add_bos: Option<u32>,
        add_eos: Option<u32>,
        explicit_flags: bool,
    },
    Synthetic {
        chars_per_token: usize,
    },
}

/// Turns one model's chat and completion requests into the token ids its
/// engine will compute.
///
/// One per model; `Send + Sync`, share it in an `Arc`. All methods take
/// `&self` and may be called from many threads at once.
#[derive(Debug)]
pub struct PromptTokenizer {
    backend: Backend,
    template: Option<ChatTemplate>,
    template_origin: Option<PathBuf>,
}

impl PromptTokenizer {
    /// Loads a model from `path` — a directory holding `tokenizer.json` and
    /// (optionally) `tokenizer_config.json` / `chat_template.jinja`, a
    /// `tokenizer.json` file, or a tiktoken vocabulary file `*.tiktoken`
    /// (gpt-oss's `o200k_base.tiktoken`: o200k pre-tokenization and the
    /// harmony special tokens, see [`tiktoken`](crate::tiktoken)) — with
    /// `chat_template_override` (a Jinja file) replacing the model's
    /// template when given. Default options.
    pub fn from_path(path: &Path, chat_template_override: Option<&Path>) -> Result<Self> {
        Self::from_path_with(path, chat_template_override, TokenizerOptions::default())
    }

    /// [`from_path`](Self::from_path) with explicit options.
    pub fn from_path_with(
        path: &Path,
        chat_template_override: Option<&Path>,
        options: TokenizerOptions,
    ) -> Result<Self> {
        let files = config::locate(path, chat_template_override)?;
        let cache = SegmentCache::new(options.cache_bytes, options.cache_shards);
        let tokenizer =
            HfTokenizer::from_file(&files.tokenizer_json, cache, options.direct_encoder)?;
        Self::assemble(tokenizer, files.config, files.template_origin, options)
    }

    /// Builds a model from `tokenizer.json` bytes and a parsed
    /// `tokenizer_config.json` (whose `chat_template`, if any, is used).
    pub fn from_parts(
        tokenizer_json: &[u8],
        config: TokenizerConfig,
        options: TokenizerOptions,
    ) -> Result<Self> {
        let cache = SegmentCache::new(options.cache_bytes, options.cache_shards);
        let tokenizer = HfTokenizer::from_bytes(
            tokenizer_json,
            Path::new("<memory>"),
            cache,
            options.direct_encoder,
        )?;
        Self::assemble(tokenizer, config, None, options)
    }

    /// Builds a model from the text of a tiktoken vocabulary (the content
    /// of an `o200k_base.tiktoken` file, see [`tiktoken`](crate::tiktoken))
    /// and a `tokenizer_config.json`'s settings — typically
    /// `chat_template` set to [`templates::HARMONY`](crate::templates::HARMONY)
    /// or the model's own. For vocabularies that are embedded or built in
    /// memory rather than read from a file.
    pub fn from_tiktoken(
        tiktoken_text: &str,
        config: TokenizerConfig,
        options: TokenizerOptions,
    ) -> Result<Self> {
        let cache = SegmentCache::new(options.cache_bytes, options.cache_shards);
        let tokenizer =
            HfTokenizer::from_tiktoken(tiktoken_text, Path::new("<memory>.tiktoken"), cache)?;
        Self::assemble(tokenizer, config, None, options)
    }

    fn assemble(
        mut tokenizer: HfTokenizer,
        config: TokenizerConfig,
        template_origin: Option<PathBuf>,
        options: TokenizerOptions,
    ) -> Result<Self> {
        let template = match &config.chat_template {
            Some(source) => Some(
                ChatTemplate::new(
                    source,
                    config.special.clone(),
                    options.limits,
                    Arc::clone(&options.clock),
                )?
                .with_render_memo(options.render_memo_bytes),
            ),
            None => None,
        };
        let template = match (template, options.content_format) {
            (Some(template), Some(format)) => Some(template.with_content_format(format)),
            (template, _) => template,
        };
        let id_of = |token: &Option<String>| token.as_deref().and_then(|t| tokenizer.token_id(t));
        let add_bos = if config.add_bos_token == Some(true) {
            id_of(&config.special.bos)
        } else {
            None
        };
        let add_eos = if config.add_eos_token == Some(true) {
            id_of(&config.special.eos)
        } else {
            None
        };
        let explicit_flags = config.add_bos_token.is_some() || config.add_eos_token.is_some();
        tokenizer.prefix = crate::prefix::PrefixMemo::new(options.prefix_memo_bytes);
        Ok(Self {
            backend: Backend::Hf {
                tokenizer: Box::new(tokenizer),
                add_bos,
                add_eos,
                explicit_flags,
            },
            template,
            template_origin,
        })
    }

    /// engine-sim's synthetic tokenizer and chat rendering
    /// (see [`synthetic`](crate::synthetic)); ids equal engine-sim's bit for bit.
    pub fn synthetic(chars_per_token: usize) -> Self {
        Self {
            backend: Backend::Synthetic {
                chars_per_token: chars_per_token.max(1),
            },
            template: None,
            template_origin: None,
        }
    }

    /// One line for `/workers`-style output: the mode and its source.
    pub fn describe(&self) -> String {
        match &self.backend {
            Backend::Synthetic { chars_per_token } => {
                format!("synthetic ({chars_per_token} chars per token, engine-sim chat rendering)")
            }
            Backend::Hf { tokenizer, .. } => {
                let template = match (&self.template, &self.template_origin) {
                    (None, _) => "no chat template".to_owned(),
                    (Some(t), Some(origin)) => format!(
                        "chat template {} ({} content)",
                        origin.display(),
                        t.content_format().as_str()
                    ),
                    (Some(t), None) => format!(
                        "chat template from config ({} content)",
                        t.content_format().as_str()
                    ),
                };
                let mode = match tokenizer.mode() {
                    SegmentMode::Segments => "segment cache".to_owned(),
                    SegmentMode::Whole(reason) => format!("whole-text ({reason})"),
                };
                let encoder = match tokenizer.encoder() {
                    TextEncoder::Direct => "direct encoder".to_owned(),
                    TextEncoder::Tokenizers(reason) => format!("tokenizers encoder: {reason}"),
                };
                format!(
                    "tokens ({} {}, vocab {}, {template}, {mode}, {encoder})",
                    tokenizer.format_name(),
                    tokenizer.path.display(),
                    tokenizer.vocab_size()
                )
            }
        }
    }

    /// Whether this is the synthetic tokenizer.
    pub fn is_synthetic(&self) -> bool {
        matches!(self.backend, Backend::Synthetic { .. })
    }

    /// How chat renderings are tokenized (`None` for the synthetic tokenizer).
    pub fn segment_mode(&self) -> Option<&SegmentMode> {
        match &self.backend {
            Backend::Hf { tokenizer, .. } => Some(tokenizer.mode()),
            Backend::Synthetic { .. } => None,
        }
    }

    /// Which code encodes text between special tokens (`None` for the
    /// synthetic tokenizer).
    pub fn text_encoder(&self) -> Option<&TextEncoder> {
        match &self.backend {
            Backend::Hf { tokenizer, .. } => Some(tokenizer.encoder()),
            Backend::Synthetic { .. } => None,
        }
    }

    /// The prefix memo's counters (all zero for the synthetic tokenizer).
    ///
    /// A chat rendering of at least 1 KB is looked up there: the earlier
    /// rendering that shares the most of its beginning gives the ids up to
    /// the last added token at least the longest added token's length
    /// before the first differing byte. The cutting at added tokens and the
    /// segments before such a token depend on nothing after it, so the ids
    /// are those the segment cache would give (the module docs of
    /// `prefix.rs` give the argument; `tests/prefix.rs` checks it).
    pub fn prefix_memo_stats(&self) -> PrefixMemoStats {
        match &self.backend {
            Backend::Hf { tokenizer, .. } => tokenizer.prefix.stats(),
            Backend::Synthetic { .. } => PrefixMemoStats::default(),
        }
    }

    /// The segment cache's counters (all zero for the synthetic tokenizer).
    pub fn cache_stats(&self) -> CacheStats {
        match &self.backend {
            Backend::Hf { tokenizer, .. } => tokenizer.cache.stats(),
            Backend::Synthetic { .. } => CacheStats::default(),
        }
    }

    /// The prompt text the engine renders for `request`.
    pub fn chat_text(&self, request: &ChatRequest) -> Result<String> {
        self.chat_text_until(request, None)
    }

    fn chat_text_until(
        &self,
        request: &ChatRequest,
        interrupt: Option<&Interrupt>,
    ) -> Result<String> {
        match &self.backend {
            Backend::Synthetic { .. } => synthetic::render_value(&request.messages.0),
            Backend::Hf { tokenizer, .. } => match &self.template {
                Some(template) => template.render_until(request, interrupt),
                None => Err(Error::NoChatTemplate(tokenizer.path.clone())),
            },
        }
    }

    /// The prompt token ids of a chat request: the rendering tokenized
    /// without added special tokens (the template writes BOS itself), as
    /// vLLM does unless the request sets `add_special_tokens: true`.
    /// Uses the segment cache where the tokenizer allows (see
    /// [`SegmentMode`]); the ids are those of tokenizing the whole rendering.
    pub fn chat_tokens(&self, request: &ChatRequest) -> Result<Vec<u32>> {
        self.chat_tokens_checked(request, None)
    }

    /// [`chat_tokens`](Self::chat_tokens) under `interrupt`: it stops at
    /// the first checkpoint after a [`cancel`](Interrupt::cancel) or past
    /// its time limit, and tokenizes nothing when the rendering is larger
    /// than its text budget (see [`Interrupt`] for where it checks).
    pub fn chat_tokens_until(
        &self,
        request: &ChatRequest,
        interrupt: &Interrupt,
    ) -> Result<Vec<u32>> {
        self.chat_tokens_checked(request, Some(interrupt))
    }

    fn chat_tokens_checked(
        &self,
        request: &ChatRequest,
        interrupt: Option<&Interrupt>,
    ) -> Result<Vec<u32>> {
        self.chat_tokens_with_use(request, interrupt)
            .map(|(ids, _)| ids)
    }

    /// [`chat_tokens`](Self::chat_tokens) (under `interrupt` when given),
    /// with how the segment cache served this rendering: for a host that
    /// reports it per request (a trace span). The cache's totals are in
    /// [`cache_stats`](Self::cache_stats).
    pub fn chat_tokens_with_use(
        &self,
        request: &ChatRequest,
        interrupt: Option<&Interrupt>,
    ) -> Result<(Vec<u32>, SegmentUse)> {
        let text = self.chat_text_until(request, interrupt)?;
        crate::interrupt::check_text(interrupt, text.len())?;
        let mut uses = SegmentUse::default();
        let ids = match &self.backend {
            Backend::Synthetic { chars_per_token } => {
                synthetic::synthetic_tokenize(&text, *chars_per_token)
            }
            Backend::Hf { .. } if request.add_special_tokens => self.text_tokens(&text, true)?,
            Backend::Hf { tokenizer, .. } => tokenizer.encode_chat(text, interrupt, &mut uses)?,
        };
        Ok((ids, uses))
    }

    /// [`chat_tokens`](Self::chat_tokens) without the segment cache: the
    /// whole rendering in one tokenizer call. The reference the cached path
    /// is tested against.
    pub fn chat_tokens_uncached(&self, request: &ChatRequest) -> Result<Vec<u32>> {
        let text = self.chat_text(request)?;
        self.text_tokens(&text, request.add_special_tokens)
    }

    /// The prompt token ids of a completion request: token-id prompts as
    /// given, text prompts tokenized with special tokens unless the request
    /// says `add_special_tokens: false`.
    pub fn completion_tokens(&self, request: &CompletionRequest) -> Result<Vec<u32>> {
        match &request.prompt {
            CompletionPrompt::Tokens(ids) => Ok(ids.clone()),
            CompletionPrompt::Text(text) => self.text_tokens(text, request.add_special_tokens),
        }
    }

    /// [`completion_tokens`](Self::completion_tokens) under `interrupt`: a
    /// text prompt larger than its text budget, or one reached after a
    /// cancel or past the time limit, is not tokenized.
    pub fn completion_tokens_until(
        &self,
        request: &CompletionRequest,
        interrupt: &Interrupt,
    ) -> Result<Vec<u32>> {
        match &request.prompt {
            CompletionPrompt::Tokens(ids) => Ok(ids.clone()),
            CompletionPrompt::Text(text) => {
                interrupt.check_text(text.len())?;
                self.text_tokens(text, request.add_special_tokens)
            }
        }
    }

    /// Tokenizes `text` whole. With `add_special_tokens`, the special tokens
    /// are those of `tokenizer_config.json`'s `add_bos_token` /
    /// `add_eos_token` when it gives either (as transformers rebuilds the
    /// post-processor from them), else the `tokenizer.json` post-processor's.
    /// The synthetic tokenizer has no special tokens.
    pub fn text_tokens(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        match &self.backend {
            Backend::Synthetic { chars_per_token } => {
                Ok(synthetic::synthetic_tokenize(text, *chars_per_token))
            }
            Backend::Hf {
                tokenizer,
                add_bos,
                add_eos,
                explicit_flags,
            } => {
                if !add_special_tokens || !*explicit_flags {
                    return tokenizer.encode_whole(text, add_special_tokens);
                }
                let body = tokenizer.encode_whole(text, false)?;
                let mut ids = Vec::with_capacity(body.len() + 2);
                ids.extend(*add_bos);
                ids.extend(body);
                ids.extend(*add_eos);
                Ok(ids)
            }
        }
    }
}
