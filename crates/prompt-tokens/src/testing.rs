//! Test models without a model hub: train a small BPE `tokenizer.json` at
//! test time and write a model directory around it.
//!
//! Public (and documented) so that other crates' tests — the router's,
//! engine-sim's — can build the same models: add `prompt-tokens` as a
//! dev-dependency and call [`write_model_dir`]. It costs no extra
//! dependency (the trainer is part of `tokenizers`) and a few tens of
//! milliseconds per model.

use std::path::Path;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::metaspace::Metaspace as MetaspaceDecoder;
use tokenizers::models::TrainerWrapper;
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::normalizers::{
    NormalizerWrapper, Prepend, Replace, Sequence as NormalizerSequence,
};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::PostProcessorWrapper;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, ModelWrapper, SplitDelimiterBehavior, TokenizerBuilder};

use crate::error::{Error, Result};
use crate::templates::TemplateFamily;

/// The kinds of tokenizer pipelines the helper trains. They cover the
/// shapes real chat models ship.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TestTokenizerKind {
    /// Llama 3 / GPT-4 style: a regex `Split` then byte-level BPE without a
    /// prefix space.
    ByteLevelRegex,
    /// GPT-2 style: `ByteLevel` with its own regex and `add_prefix_space`.
    Gpt2,
    /// SentencePiece style, new form: `Metaspace` with `prepend_scheme:
    /// "first"` (position-dependent: the segment cache falls back to
    /// whole-text tokenization).
    MetaspaceFirst,
    /// SentencePiece style, legacy form: a `Prepend("▁")` + `Replace(" ",
    /// "▁")` normalizer and no pre-tokenizer.
    PrependNormalizer,
}

impl TestTokenizerKind {
    /// All kinds.
    pub const ALL: [TestTokenizerKind; 4] = [
        Self::ByteLevelRegex,
        Self::Gpt2,
        Self::MetaspaceFirst,
        Self::PrependNormalizer,
    ];
}

/// The Llama 3 / cl100k pre-tokenization pattern (needs look-ahead: this
/// also checks that the pure-Rust `fancy-regex` backend handles it).
pub const LLAMA3_SPLIT_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A small corpus the helper trains on (English prose, code, numbers,
/// a little non-Latin text).
pub const CORPUS: &str = "\
The router sends each request to the worker that already holds its prompt.
A cache hit saves the prefill: the engine skips the tokens it has seen before.
You are a helpful assistant. Answer briefly and cite your sources when you can.
What is the weather like in Paris today? It is sunny, 24 degrees, light wind.
def tokenize(text):\n    return [ord(c) for c in text]\n\nprint(tokenize(\"hello\"))
{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 -17 1e6.
Grüße aus München! Ça va très bien, merci. ¿Dónde está la biblioteca?
日本語のテキストも少し含めます。中文文本也在这里。Русский текст тоже есть.
Emoji: 🙂 🚀 ✨ and symbols: <> [] {} () | \\ / ~ ^ % $ # @ ! ? ; : , .
Tabs\tand\tnewlines\n\nmatter to tokenizers, and so do   runs of   spaces.
";

fn tokenizer_error(e: impl std::fmt::Display) -> Error {
    Error::InvalidTokenizer {
        path: "<trainer>".into(),
        reason: e.to_string(),
    }
}

use crate::tiktoken::Impl;

/// Trains a BPE tokenizer of `kind` on [`CORPUS`] with `special_tokens`
/// added as special tokens, and returns its `tokenizer.json` text. When
/// `bos` is given (and is one of the special tokens), the post-processor
/// adds it to sequences encoded with special tokens.
pub fn train_tokenizer_json(
    kind: TestTokenizerKind,
    special_tokens: &[&str],
    bos: Option<&str>,
) -> Result<String> {
    let (normalizer, pre_tokenizer, decoder): (
        Option<NormalizerWrapper>,
        Option<PreTokenizerWrapper>,
        Option<DecoderWrapper>,
    ) = match kind {
        TestTokenizerKind::ByteLevelRegex => {
            let split = Split::new(
                SplitPattern::Regex(LLAMA3_SPLIT_PATTERN.to_owned()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(tokenizer_error)?;
            let byte_level = ByteLevel::new(false, true, false);
            (
                None,
                Some(PreTokenizerWrapper::Sequence(PreSequence::new(vec![
                    PreTokenizerWrapper::Split(split),
                    PreTokenizerWrapper::ByteLevel(byte_level),
                ]))),
                Some(DecoderWrapper::ByteLevel(ByteLevelDecoder::default())),
            )
        }
        TestTokenizerKind::Gpt2 => (
            None,
            Some(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
                true, true, true,
            ))),
            Some(DecoderWrapper::ByteLevel(ByteLevelDecoder::default())),
        ),
        TestTokenizerKind::MetaspaceFirst => (
            None,
            Some(PreTokenizerWrapper::Metaspace(Metaspace::new(
                '▁',
                PrependScheme::First,
                true,
            ))),
            Some(DecoderWrapper::Metaspace(MetaspaceDecoder::new(
                '▁',
                PrependScheme::First,
                true,
            ))),
        ),
        TestTokenizerKind::PrependNormalizer => (
            Some(NormalizerWrapper::Sequence(NormalizerSequence::new(vec![
                NormalizerWrapper::Prepend(Prepend::new("▁".to_owned())),
                NormalizerWrapper::Replace(Replace::new(" ", "▁").map_err(tokenizer_error)?),
            ]))),
            None,
            None,
        ),
    };
    let byte_level = matches!(
        kind,
        TestTokenizerKind::ByteLevelRegex | TestTokenizerKind::Gpt2
    );
    // SentencePiece-style models need an unknown token for characters the
    // small corpus never showed; byte-level ones cover every byte.
    let mut model = BPE::default();
    let mut specials: Vec<AddedToken> = Vec::new();
    if !byte_level {
        model = BPE::builder()
            .unk_token("<unk>".to_owned())
            .build()
            .map_err(tokenizer_error)?;
        specials.push(AddedToken::from("<unk>", true));
    }
    specials.extend(
        special_tokens
            .iter()
            .filter(|t| **t != "<unk>" || byte_level)
            .map(|t| AddedToken::from(t.to_string(), true)),
    );
    let mut tokenizer: Impl = TokenizerBuilder::new()
        .with_model(ModelWrapper::BPE(model))
        .with_normalizer(normalizer)
        .with_pre_tokenizer(pre_tokenizer)
        .with_post_processor(None)
        .with_decoder(decoder)
        .build()
        .map_err(tokenizer_error)?;
    let mut builder = BpeTrainerBuilder::new()
        .vocab_size(600)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(specials);
    if byte_level {
        builder = builder.initial_alphabet(ByteLevel::alphabet().into_iter().collect());
    }
    let mut trainer = TrainerWrapper::BpeTrainer(builder.build());
    tokenizer
        .train(&mut trainer, CORPUS.lines().map(str::to_owned))
        .map_err(tokenizer_error)?;
    if let Some(bos) = bos
        && let Some(id) = tokenizer.token_to_id(bos)
    {
        let template = TemplateProcessing::builder()
            .try_single(format!("{bos} $A"))
            .map_err(tokenizer_error)?
            .special_tokens(vec![(bos.to_owned(), id)])
            .build()
            .map_err(tokenizer_error)?;
        tokenizer.with_post_processor(Some(PostProcessorWrapper::Template(template)));
    }
    tokenizer.to_string(false).map_err(tokenizer_error)
}

/// Writes a model directory for `family` into `dir`: a `tokenizer.json`
/// of `kind` trained with the family's special tokens, and a
/// `tokenizer_config.json` carrying the family's template, `bos_token`
/// (string form) and `eos_token` (object form).
pub fn write_model_dir(dir: &Path, family: TemplateFamily, kind: TestTokenizerKind) -> Result<()> {
    let json = train_tokenizer_json(kind, family.special_tokens(), family.bos_token())?;
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|source| Error::Io { path, source })
    };
    write("tokenizer.json", &json)?;
    let mut config = serde_json::json!({
        "chat_template": family.template(),
        "eos_token": {"content": family.eos_token(), "lstrip": false, "normalized": false,
                      "rstrip": false, "single_word": false, "__type": "AddedToken"},
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    });
    if let Some(bos) = family.bos_token() {
        config["bos_token"] = serde_json::Value::from(bos);
    }
    write(
        "tokenizer_config.json",
        &serde_json::to_string_pretty(&config).unwrap_or_default(),
    )
}
