//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong loading a model's tokenizer, rendering a chat
/// template or tokenizing a prompt. Input never panics: it ends here.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A file the configuration needs does not exist.
    #[error("{path}: no such file")]
    MissingFile {
        /// The path that was looked for.
        path: PathBuf,
    },
    /// A file exists but could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer_config.json` is not the JSON this crate understands.
    #[error("{path}: invalid tokenizer config: {reason}")]
    InvalidConfig {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// `tokenizer.json` (or a tokenizer built in memory) could not be loaded.
    #[error("{path}: invalid tokenizer: {reason}")]
    InvalidTokenizer {
        /// The file, or `<memory>`.
        path: PathBuf,
        /// The tokenizers crate's message.
        reason: String,
    },
    /// Chat was asked of a model that has no chat template (none in
    /// `tokenizer_config.json` and no override given).
    #[error("no chat template: {0} has none and no --chat-template override was given")]
    NoChatTemplate(PathBuf),
    /// The chat template source is larger than [`RenderLimits::max_template_bytes`](crate::RenderLimits).
    #[error("chat template is {len} bytes, more than the limit of {max}")]
    TemplateTooLarge {
        /// The template's size in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The chat template does not compile.
    #[error("chat template syntax error: {0}")]
    TemplateSyntax(String),
    /// The template uses a construct the renderer does not have (a filter,
    /// test, method or function unknown to it, or Python's `%` string
    /// formatting): refused when the template is loaded, not on the
    /// requests that reach that line.
    #[error("chat template line {line}: {construct} is not supported by the router's renderer")]
    TemplateUnsupported {
        /// The line of the template (1-based) where it is first used.
        line: usize,
        /// What is used, e.g. "the filter `foo`".
        construct: String,
    },
    /// The template called `raise_exception(message)`: the request is one
    /// the model's template refuses (for example roles that do not alternate).
    #[error("chat template raised an exception: {0}")]
    TemplateRaised(String),
    /// Rendering used up its fuel (bounded work, [`RenderLimits::fuel`](crate::RenderLimits)).
    #[error("chat template rendering exceeded its work limit (fuel)")]
    FuelExhausted,
    /// The rendered prompt grew past [`RenderLimits::max_output_bytes`](crate::RenderLimits).
    #[error("rendered prompt exceeds the limit of {max} bytes")]
    OutputTooLarge {
        /// The limit.
        max: usize,
    },
    /// Any other template rendering error (undefined function, type error,
    /// recursion limit, ...).
    #[error("chat template rendering failed: {0}")]
    Render(String),
    /// The request is not one this crate can turn into a prompt (messages
    /// not a list, a message without a role, several prompts at once, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The request is valid but its prompt is not one this crate can
    /// compute (multimodal content: the engine's prompt holds the model
    /// processor's placeholders).
    #[error("unsupported request: {0}")]
    Unsupported(String),
    /// The tokenizer failed on a text.
    #[error("tokenization failed: {0}")]
    Tokenize(String),
    /// The computation was cancelled ([`Interrupt::cancel`](crate::Interrupt::cancel)):
    /// nobody waits for its result any more.
    #[error("computing the token ids was cancelled")]
    Cancelled,
    /// The request needs more work than its [`Interrupt`](crate::Interrupt)
    /// allows (prompt size or time); the message says which.
    #[error("over the tokenizing budget: {0}")]
    OverBudget(String),
}

/// The crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
