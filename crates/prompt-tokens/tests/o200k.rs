//! The real `o200k_base` vocabulary (199,998 ranks, as the `tiktoken-rs`
//! crate embeds it: no download) loaded through `PromptTokenizer::from_tiktoken`,
//! its ids checked against `tiktoken-rs`'s own encoder — tiktoken's
//! algorithm and OpenAI's published ranks — on texts chosen for the o200k
//! split's corners (contractions, numbers, whitespace runs, scripts without
//! case, marks, emoji) and on long pieces; and the same vocabulary as a
//! `tokenizer.json` through the `tokenizers` crate.

use std::sync::OnceLock;

use prompt_tokens::tiktoken::{O200K_FIRST_SPECIAL_ID, format_ranks, tokenizer_json};
use prompt_tokens::{ChatRequest, PromptTokenizer, TokenizerConfig, TokenizerOptions, templates};
use proptest::prelude::*;
use tiktoken_rs::CoreBPE;

struct O200k {
    /// tiktoken-rs's `o200k_harmony`: `o200k_base` plus gpt-oss's specials.
    reference: CoreBPE,
    text: String,
    tokenizer: PromptTokenizer,
}

fn o200k() -> &'static O200k {
    static O200K: OnceLock<O200k> = OnceLock::new();
    O200K.get_or_init(|| {
        let reference = tiktoken_rs::o200k_harmony().expect("tiktoken-rs o200k");
        let text = format_ranks(
            (0..O200K_FIRST_SPECIAL_ID).map(|r| (reference.decode_bytes(&[r]).expect("rank"), r)),
        );
        let config = TokenizerConfig {
            chat_template: Some(templates::HARMONY.to_owned()),
            ..TokenizerConfig::default()
        };
        let tokenizer = PromptTokenizer::from_tiktoken(&text, config, TokenizerOptions::default())
            .expect("o200k loads");
        O200k {
            reference,
            text,
            tokenizer,
        }
    })
}

/// Texts at the corners of the o200k pattern and of byte-pair merging.
fn corner_texts() -> Vec<String> {
    let mut texts: Vec<String> = [
        "Hello, world!",
        "The router sends each request to the worker that already holds its prompt.",
        "I'm sure you're right; he'll say they'd've known. WE'RE DON'T Can'T it's",
        "'s 't 're 've 'm 'll 'd",
        "Numbers: 1 12 123 1234 12345 1234567890 3.14159 -0.5 1e10 ٣٤٥ ½ ²",
        "trailing spaces   \n\n\n   leading\t\ttabs\r\nwindows\r\n\r\nlines   ",
        "    indented\n        code\n",
        "   ",
        "\n",
        " \n \n ",
        "fn main() { let x: Vec<u32> = vec![1, 2, 3]; println!(\"{x:?}\"); }",
        r#"{"model": "gpt-oss-20b", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16}"#,
        "<div class=\"a\">&nbsp;&amp;</div> // comment /* block */ #!/bin/sh",
        "Grüße aus München, ça va très bien. Ærøskøbing. İstanbul. ΑΒΓ αβγ",
        "日本語のテキストと漢字、かな。中文文本。한국어 텍스트",
        "Привет, мир! Здравствуйте. مرحبا بالعالم. שלום עולם. नमस्ते दुनिया",
        "e\u{301}le\u{300}ve cafe\u{301} n\u{303}",
        "emoji: 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨✨✨",
        "ALLCAPS CamelCaseWord mixedCASEword lowerUPPER XMLHttpRequest",
        "under_score kebab-case dot.separated path/to/file.rs C:\\Windows\\",
        "$100.00, 50% off!!! ??? ... --- === *** ~~~",
        "\u{0}\u{1}\u{7f} control \u{200b}zero width\u{feff}",
        // Found by the random test against broken variants: equal-rank
        // ties (leftmost first), and a whitespace run before a contraction.
        "vvvba",
        " \t's",
        "",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    // Long pieces: past the short-piece limit, merged with the heap.
    texts.push("a".repeat(1000));
    texts.push("ab".repeat(700));
    texts.push("=".repeat(333));
    texts.push(" ".repeat(500) + "x");
    texts.push("\u{1F600}".repeat(200));
    texts.push("zqxjkvw".repeat(40));
    texts.push("Donaudampfschifffahrtsgesellschaftskapitänswitwe".repeat(6));
    texts.push("0123456789".repeat(50));
    texts
}

#[test]
fn o200k_ids_equal_tiktokens_on_corner_texts() {
    let o200k = o200k();
    for text in corner_texts() {
        let ours = o200k.tokenizer.text_tokens(&text, false).expect("tokens");
        let reference = o200k.reference.encode_ordinary(&text);
        assert_eq!(ours, reference, "text {text:?}");
        // With special tokens requested nothing changes: no post-processor.
        assert_eq!(
            o200k.tokenizer.text_tokens(&text, true).expect("tokens"),
            ours
        );
    }
}

#[test]
fn o200k_ids_are_the_same_from_every_thread_at_once() {
    // Each thread takes its own search cache of the split; the first one
    // to use the tokenizer and the others take different paths to it.
    let o200k = o200k();
    let texts = corner_texts();
    let expected: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| o200k.reference.encode_ordinary(t))
        .collect();
    std::thread::scope(|scope| {
        for _ in 0..3 {
            scope.spawn(|| {
                for _ in 0..3 {
                    for (text, want) in texts.iter().zip(&expected) {
                        let ours = o200k.tokenizer.text_tokens(text, false).expect("tokens");
                        assert_eq!(&ours, want, "text {text:?}");
                    }
                }
            });
        }
    });
}

#[test]
fn o200k_gives_the_known_ids_of_a_few_words() {
    // Fixed points independent of any encoder: single tokens of o200k_base.
    let o200k = o200k();
    let ids = o200k
        .tokenizer
        .text_tokens("Hello world", false)
        .expect("tokens");
    assert_eq!(ids.len(), 2);
    let decoded: Vec<Vec<u8>> = ids
        .iter()
        .map(|&id| o200k.reference.decode_bytes(&[id]).expect("id"))
        .collect();
    assert_eq!(decoded, [b"Hello".to_vec(), b" world".to_vec()]);
    assert!(o200k.tokenizer.describe().contains("vocab 201088"));
}

#[test]
fn harmony_chats_equal_tiktokens_with_special_tokens() {
    let o200k = o200k();
    let body = r#"{"messages": [
        {"role": "system", "content": "You are terse. Answer in one line."},
        {"role": "user", "content": "What's 12345 * 6789?  Show   the steps.\n\n"},
        {"role": "assistant", "content": "83,810,205 — multiply, then add."},
        {"role": "user", "content": "Und auf Deutsch? 日本語でも。"}
    ]}"#;
    let request = ChatRequest::from_json(body.as_bytes()).expect("request");
    let text = o200k.tokenizer.chat_text(&request).expect("render");
    assert!(text.contains("<|start|>user<|message|>"));
    let reference = o200k.reference.encode_with_special_tokens(&text);
    // The segment cache (cold, then warm) and the whole-text path.
    assert_eq!(
        o200k.tokenizer.chat_tokens(&request).expect("tokens"),
        reference
    );
    assert_eq!(
        o200k.tokenizer.chat_tokens(&request).expect("tokens"),
        reference
    );
    assert_eq!(
        o200k
            .tokenizer
            .chat_tokens_uncached(&request)
            .expect("tokens"),
        reference
    );
    assert!(reference.contains(&200_006) && reference.contains(&200_008));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn o200k_ids_equal_tiktokens_on_random_text(
        text in "([a-zA-Z]{1,12}|[0-9]{1,6}|[ \t\n\r]{1,4}|'(s|t|re|ve|m|ll|d|S|T|RE)|[.,;:!?(){}\\[\\]\"'/\\\\<>=+*#@$%&|~^_-]{1,3}|[à-ÿ]{1,4}|[\u{370}-\u{3ff}]{1,4}|[\u{4e00}-\u{4e80}]{1,3}|[\u{300}-\u{36f}]|[\u{1F300}-\u{1F64F}]|\\PC){0,40}"
    ) {
        let o200k = o200k();
        let ours = o200k.tokenizer.text_tokens(&text, false).expect("tokens");
        prop_assert_eq!(ours, o200k.reference.encode_ordinary(&text));
    }
}

#[test]
fn o200k_as_tokenizer_json_gives_the_same_ids_through_tokenizers() {
    // The `tokenizers` pipeline of the same vocabulary (merges derived
    // from the ranks): the form `tokenizer_json` writes for other tools.
    let o200k = o200k();
    let json = tokenizer_json(&o200k.text).expect("tokenizer.json");
    let pipeline = PromptTokenizer::from_parts(
        json.as_bytes(),
        TokenizerConfig::default(),
        TokenizerOptions::default(),
    )
    .expect("tokenizer.json loads");
    for text in corner_texts() {
        let ids = pipeline.text_tokens(&text, false).expect("tokens");
        assert_eq!(ids, o200k.reference.encode_ordinary(&text), "text {text:?}");
    }
}
