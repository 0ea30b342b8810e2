//! The direct byte-level BPE encoder against the `tokenizers` crate, on
//! `tokenizer.json` files of the shapes real models publish.
//!
//! The vocabulary is the first 30,000 ranks of OpenAI's `o200k_base` (as
//! the `tiktoken-rs` crate embeds it; a prefix of a tiktoken vocabulary is
//! one, every token's parts having lower ranks), written as a
//! `tokenizer.json` by `tiktoken::tokenizer_json`: every way of splitting
//! each token into two tokens is a merge, so the merge list holds many
//! ways to one token, the case where `tokenizers`' merge order matters.
//! Each variant then takes the pre-tokenizer, normalizer, model options
//! and added tokens of one family, and `tokenizers` itself, loading the
//! same JSON, is the reference.

use std::sync::OnceLock;

use prompt_tokens::tiktoken::{format_ranks, tokenizer_json};
use prompt_tokens::{PromptTokenizer, TextEncoder, TokenizerConfig, TokenizerOptions};
use proptest::prelude::*;
use serde_json::{Value, json};

/// Llama 3's split (Qwen's is the same with single digits).
const LLAMA3_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// DeepSeek V3's third split (after digits and CJK runs).
const DEEPSEEK_PATTERN: &str = r"[!\x22#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The 30,000-rank vocabulary as `tokenizer.json` (o200k split, byte-level
/// BPE with `ignore_merges`, gpt-oss's special tokens as added tokens).
fn base() -> &'static Value {
    static BASE: OnceLock<Value> = OnceLock::new();
    BASE.get_or_init(|| {
        let reference = tiktoken_rs::o200k_base().expect("tiktoken-rs o200k");
        let ranks =
            format_ranks((0..30_000u32).map(|r| (reference.decode_bytes(&[r]).expect("rank"), r)));
        serde_json::from_str(&tokenizer_json(&ranks).expect("tokenizer.json")).unwrap()
    })
}

fn split(pattern: &str) -> Value {
    json!({"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false})
}

fn byte_level(use_regex: bool) -> Value {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex})
}

/// One family's shape on the base vocabulary.
struct Variant {
    name: &'static str,
    /// Ours, on the direct encoder.
    ours: PromptTokenizer,
    /// `tokenizers` on the same JSON.
    reference: tokenizers::Tokenizer,
}

fn variant(name: &'static str, edit: impl FnOnce(&mut Value)) -> Variant {
    let mut json = base().clone();
    edit(&mut json);
    let text = json.to_string();
    let ours = PromptTokenizer::from_parts(
        text.as_bytes(),
        TokenizerConfig::default(),
        TokenizerOptions::default(),
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(
        ours.text_encoder(),
        Some(&TextEncoder::Direct),
        "{name} is not on the direct encoder"
    );
    let reference = tokenizers::Tokenizer::from_bytes(text.as_bytes()).expect("tokenizers loads");
    Variant {
        name,
        ours,
        reference,
    }
}

fn variants() -> &'static [Variant] {
    static VARIANTS: OnceLock<Vec<Variant>> = OnceLock::new();
    VARIANTS.get_or_init(|| {
        vec![
            // gpt-oss / o200k: Mistral's Tekken split is the same kind.
            variant("o200k", |_| {}),
            // Llama 3, with its post-processor: a BOS before every text
            // when special tokens are asked for (completions).
            variant("llama3", |json| {
                json["pre_tokenizer"] =
                    json!({"type": "Sequence", "pretokenizers": [split(LLAMA3_PATTERN), byte_level(false)]});
                let bos = json!({"SpecialToken": {"id": "<|startoftext|>", "type_id": 0}});
                let a = json!({"Sequence": {"id": "A", "type_id": 0}});
                let b = json!({"Sequence": {"id": "B", "type_id": 1}});
                json["post_processor"] = json!({"type": "Sequence", "processors": [
                    {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
                    {"type": "TemplateProcessing", "single": [bos, a], "pair": [bos, a, bos, b],
                     "special_tokens": {"<|startoftext|>": {"id": "<|startoftext|>", "ids": [30000], "tokens": ["<|startoftext|>"]}}},
                ]});
            }),
            // Qwen: NFC, single digits, and every piece merged even when it
            // is a token.
            variant("qwen", |json| {
                json["normalizer"] = json!({"type": "NFC"});
                json["model"]["ignore_merges"] = json!(false);
                json["pre_tokenizer"] =
                    json!({"type": "Sequence", "pretokenizers": [split(QWEN_PATTERN), byte_level(false)]});
            }),
            // DeepSeek V3: three splits in a row, an empty normalizer
            // sequence, and added tokens that are matched after
            // normalization (inside the pieces between the others).
            variant("deepseek", |json| {
                json["normalizer"] = json!({"type": "Sequence", "normalizers": []});
                json["pre_tokenizer"] = json!({"type": "Sequence", "pretokenizers": [
                    split(r"\p{N}{1,3}"),
                    split("[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+"),
                    split(DEEPSEEK_PATTERN),
                    byte_level(false),
                ]});
                let added = json["added_tokens"].as_array_mut().unwrap();
                for (id, content) in [(40_000, "<｜User｜>"), (40_001, "<｜tool▁sep｜>"), (40_002, "<tool>")] {
                    added.push(json!({
                        "id": id, "content": content, "single_word": false, "lstrip": false,
                        "rstrip": false, "normalized": true, "special": false
                    }));
                }
            }),
            // GPT-2's own shape: the split inside ByteLevel.
            variant("gpt2", |json| {
                json["pre_tokenizer"] = byte_level(true);
            }),
        ]
    })
}

fn assert_same_ids(text: &str) -> Result<(), TestCaseError> {
    for variant in variants() {
        for special in [false, true] {
            let ours = variant.ours.text_tokens(text, special).expect("tokens");
            let reference = variant
                .reference
                .encode_fast(text, special)
                .expect("reference tokens");
            prop_assert_eq!(
                &ours,
                &reference.get_ids().to_vec(),
                "{} (special tokens {}) on {:?}",
                variant.name,
                special,
                text
            );
        }
    }
    Ok(())
}

#[test]
fn the_llama_post_processor_puts_its_bos_first() {
    let llama = variants().iter().find(|v| v.name == "llama3").unwrap();
    let ids = llama.ours.text_tokens("Hello", true).unwrap();
    assert_eq!(ids[0], 30_000);
    assert_eq!(&ids[1..], llama.ours.text_tokens("Hello", false).unwrap());
}

#[test]
fn corner_texts_give_the_ids_of_tokenizers() {
    let texts = [
        "Hello, world! I'm sure you're right; WE'RE DON'T it's",
        "Numbers: 1 12 123 1234 12345 3.14159 -0.5 1e10 ٣٤٥ ½ ²",
        "trailing spaces   \n\n\n   leading\t\ttabs\r\nwindows\r\n\r\nlines   ",
        "    indented\n        code\n",
        "   ",
        " ",
        "\n",
        " \n \n ",
        "a  b   c    d\u{3000}\u{3000}e\u{a0}\u{a0}f",
        "fn main() { let x: Vec<u32> = vec![1, 2, 3]; }",
        r#"{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}"#,
        "Grüße aus München, ça va très bien. İstanbul. ΑΒΓ αβγ",
        "日本語のテキストと漢字、かな。中文文本123。한국어",
        "e\u{301}le\u{300}ve cafe\u{301} n\u{303} \u{212b}",
        "emoji: 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
        "<｜User｜>hi<｜tool▁sep｜>x<tool>y<tool",
        "\u{0}\u{1}\u{7f} control \u{200b}zero width\u{feff}",
        "'s 'S 'ſ 'K",
        "",
    ];
    for text in texts {
        assert_same_ids(text).unwrap();
    }
    assert_same_ids(&"ab".repeat(700)).unwrap();
    assert_same_ids(&(" ".repeat(300) + "x")).unwrap();
    assert_same_ids(&"0123456789".repeat(50)).unwrap();
}

#[test]
fn non_ascii_text_under_nfc_gives_the_ids_of_tokenizers_too() {
    // The direct encoder declines it and `tokenizers` encodes it: the ids
    // of a composed and a decomposed "é" are the same either way.
    let qwen = variants().iter().find(|v| v.name == "qwen").unwrap();
    let composed = qwen.ours.text_tokens("caf\u{e9}", false).unwrap();
    let decomposed = qwen.ours.text_tokens("cafe\u{301}", false).unwrap();
    assert_eq!(composed, decomposed);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_texts_give_the_ids_of_tokenizers(
        text in "([a-zA-Z]{1,12}|[0-9]{1,6}|[ \t\n\r]{1,4}|[\u{a0}\u{2000}\u{3000}]{1,2}|'(s|t|re|ve|m|ll|d|S|T|RE)|[.,;:!?(){}\\[\\]\"'/\\\\<>=+*#@$%&|~^_-]{1,3}|[à-ÿ]{1,4}|[\u{370}-\u{3ff}]{1,4}|[\u{4e00}-\u{4e80}]{1,3}|[\u{3040}-\u{30ff}]{1,3}|[\u{300}-\u{36f}]|[\u{1F300}-\u{1F64F}]|<｜User｜>|<tool>|\\PC){0,40}"
    ) {
        assert_same_ids(&text)?;
    }
}

#[test]
fn the_fuzz_entry_point_runs_on_seeds() {
    for seed in [
        &b""[..],
        b"the thing is   in the caf\xc3\xa9 123456",
        b"\xff\xfe broken utf-8 \x80",
        b"  \n\n  12 \xe4\xb8\xad\xe6\x96\x87 e\xcc\x81 it's",
    ] {
        prompt_tokens::fuzzing::bpe(seed);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// Arbitrary bytes through the fuzz entry point (a small vocabulary in
    /// four shapes): what the fuzz target does, bounded, on every run.
    #[test]
    fn arbitrary_bytes_give_the_ids_of_tokenizers(data in proptest::collection::vec(any::<u8>(), 0..200)) {
        prompt_tokens::fuzzing::bpe(&data);
    }
}
