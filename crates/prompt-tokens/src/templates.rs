//! Chat templates written for this crate from the public descriptions of
//! four prompt formats, with the special tokens each one needs.
//!
//! They are HF-style Jinja (the same globals as a `tokenizer_config.json`
//! template) and serve tests, the simulator and docs; a real model's own
//! template is what production uses.

/// ChatML, Qwen-style: `<|im_start|>role\n…<|im_end|>\n`, tools as JSON lines.
pub const CHATML: &str = include_str!("../templates/chatml.jinja");
/// Llama 3: `<|begin_of_text|><|start_header_id|>role<|end_header_id|>\n\n…<|eot_id|>`,
/// a system turn with "Cutting Knowledge Date" and `strftime_now` "Today Date".
pub const LLAMA3: &str = include_str!("../templates/llama3.jinja");
/// Mistral instruct: `<s>[INST] … [/INST] …</s>`, alternation enforced by
/// `raise_exception`, tools in `[AVAILABLE_TOOLS]`.
pub const MISTRAL: &str = include_str!("../templates/mistral.jinja");
/// gpt-oss harmony: `<|start|>role<|message|>…<|end|>`, channels, a system
/// message with "Current date:", a developer message with tools.
pub const HARMONY: &str = include_str!("../templates/harmony.jinja");

/// A prompt format: its template and the tokens a tokenizer for it must
/// treat as special.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TemplateFamily {
    /// [`CHATML`].
    ChatMl,
    /// [`LLAMA3`].
    Llama3,
    /// [`MISTRAL`].
    Mistral,
    /// [`HARMONY`].
    Harmony,
}

impl TemplateFamily {
    /// All families.
    pub const ALL: [TemplateFamily; 4] = [Self::ChatMl, Self::Llama3, Self::Mistral, Self::Harmony];

    /// The Jinja source.
    pub fn template(self) -> &'static str {
        match self {
            Self::ChatMl => CHATML,
            Self::Llama3 => LLAMA3,
            Self::Mistral => MISTRAL,
            Self::Harmony => HARMONY,
        }
    }

    /// A short name (`chatml`, `llama3`, `mistral`, `harmony`).
    pub fn name(self) -> &'static str {
        match self {
            Self::ChatMl => "chatml",
            Self::Llama3 => "llama3",
            Self::Mistral => "mistral",
            Self::Harmony => "harmony",
        }
    }

    /// `bos_token` the template prints, if the format has one.
    pub fn bos_token(self) -> Option<&'static str> {
        match self {
            Self::ChatMl | Self::Harmony => None,
            Self::Llama3 => Some("<|begin_of_text|>"),
            Self::Mistral => Some("<s>"),
        }
    }

    /// `eos_token` of the format.
    pub fn eos_token(self) -> &'static str {
        match self {
            Self::ChatMl => "<|im_end|>",
            Self::Llama3 => "<|eot_id|>",
            Self::Mistral => "</s>",
            Self::Harmony => "<|return|>",
        }
    }

    /// Every special token the format's rendering contains.
    pub fn special_tokens(self) -> &'static [&'static str] {
        match self {
            Self::ChatMl => &["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            Self::Llama3 => &[
                "<|begin_of_text|>",
                "<|end_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
                "<|eom_id|>",
                "<|python_tag|>",
            ],
            Self::Mistral => &[
                "<unk>",
                "<s>",
                "</s>",
                "[INST]",
                "[/INST]",
                "[AVAILABLE_TOOLS]",
                "[/AVAILABLE_TOOLS]",
                "[TOOL_CALLS]",
                "[TOOL_RESULTS]",
                "[/TOOL_RESULTS]",
            ],
            Self::Harmony => &[
                "<|startoftext|>",
                "<|endoftext|>",
                "<|start|>",
                "<|message|>",
                "<|end|>",
                "<|channel|>",
                "<|constrain|>",
                "<|call|>",
                "<|return|>",
            ],
        }
    }
}
