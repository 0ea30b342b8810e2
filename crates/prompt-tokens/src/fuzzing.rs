//! Fuzzing entry points. The cargo-fuzz target `prompt_tokens_render` and
//! the crate's tests call [`render`]; [`tiktoken`] is the entry point for
//! `.tiktoken` files (its tests run it on seeds); [`bpe`] holds the direct
//! `tokenizer.json` encoder to the `tokenizers` crate.

use std::sync::Arc;

use crate::request::ChatRequest;
use crate::template::{ChatTemplate, FixedClock, RenderLimits, SpecialTokens};
use crate::templates::TemplateFamily;
use crate::{Error, PromptTokenizer};

/// The limits the fuzz target renders under (small, so runs stay fast).
pub const FUZZ_LIMITS: RenderLimits = RenderLimits {
    max_template_bytes: 8 * 1024,
    fuel: 50_000,
    max_output_bytes: 64 * 1024,
};

/// The instant `strftime_now` says in fuzz renderings.
const FUZZ_CLOCK: i64 = 1_700_000_000;

/// Decodes `data` as `template source NUL request JSON` (lossy UTF-8) and
/// renders it under [`FUZZ_LIMITS`]; then renders the request with each of
/// the crate's templates and the synthetic tokenizer. Before the request
/// itself, each template renders the request's earlier turns (its
/// messages cut after each of the first ones), so that its render memo
/// holds states the request's rendering may resume from. Panics only if a
/// limit is not respected (an output over the cap) or if the direct
/// renderer or the memo disagrees with minijinja (a text, or `render`'s
/// result, differs from a rendering with the direct renderer off);
/// errors are expected.
pub fn render(data: &[u8]) {
    let (template, body) = match data.iter().position(|b| *b == 0) {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &b""[..]),
    };
    let template = String::from_utf8_lossy(template);
    let request = ChatRequest::from_json(body).or_else(|_| {
        // Not a request body: try it as the messages array alone.
        serde_json::from_slice::<serde_json::Value>(body)
            .map_err(|e| Error::InvalidRequest(e.to_string()))
            .and_then(|messages| ChatRequest::new(&messages))
    });
    let request = match request {
        Ok(request) => request,
        Err(_) => ChatRequest::new(&serde_json::json!([
            {"role": "system", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, "there", {"type": "text"}]},
        ]))
        .unwrap_or_else(|_| unreachable_request()),
    };
    let special = SpecialTokens {
        bos: Some("<s>".into()),
        eos: Some("</s>".into()),
        ..SpecialTokens::default()
    };
    let clock = Arc::new(FixedClock(FUZZ_CLOCK));
    let turns = earlier_turns(body);
    let mut sources: Vec<&str> = vec![&template];
    sources.extend(TemplateFamily::ALL.iter().map(|f| f.template()));
    for source in sources {
        match ChatTemplate::new(source, special.clone(), FUZZ_LIMITS, clock.clone()) {
            Ok(compiled) => {
                check_earlier_turns(source, &compiled, &turns, &special);
                let rendered = compiled.render(&request);
                if let Ok(text) = &rendered {
                    assert!(
                        text.len() <= FUZZ_LIMITS.max_output_bytes,
                        "rendered {} bytes over the cap",
                        text.len()
                    );
                }
                check_direct_rendering(source, &compiled, &rendered, &request, &special);
            }
            Err(Error::TemplateTooLarge { len, max }) => assert!(len > max),
            Err(_) => {}
        }
    }
    let synthetic = PromptTokenizer::synthetic(4);
    if let Ok(tokens) = synthetic.chat_tokens(&request) {
        let text = synthetic.chat_text(&request).unwrap_or_default();
        assert_eq!(tokens.len(), crate::synthetic_count(&text, 4));
    }
}

/// Most earlier turns rendered before a request (each a rendering of
/// every template, so the target stays fast).
const MAX_EARLIER_TURNS: usize = 6;

/// The request in `body` (a request object with a `messages` array) cut
/// after each of its first messages: the turns of the conversation that
/// led to it, shortest first. Empty when `body` is not such an object or
/// a cut is not a valid request.
fn earlier_turns(body: &[u8]) -> Vec<ChatRequest> {
    let Ok(serde_json::Value::Object(object)) = serde_json::from_slice::<serde_json::Value>(body)
    else {
        return Vec::new();
    };
    let Some(serde_json::Value::Array(messages)) = object.get("messages") else {
        return Vec::new();
    };
    (1..messages.len())
        .take(MAX_EARLIER_TURNS)
        .filter_map(|cut| {
            let mut turn = object.clone();
            turn.insert(
                "messages".into(),
                serde_json::Value::Array(messages[..cut].to_vec()),
            );
            let bytes = serde_json::to_vec(&serde_json::Value::Object(turn)).ok()?;
            ChatRequest::from_json(&bytes).ok()
        })
        .collect()
}

/// Renders each of `turns` with `compiled` (as shipped: direct renderer
/// and render memo on, the memo filling as a conversation's turns
/// arrive) and holds each to minijinja's rendering of it.
fn check_earlier_turns(
    source: &str,
    compiled: &ChatTemplate,
    turns: &[ChatRequest],
    special: &SpecialTokens,
) {
    if turns.is_empty() {
        return;
    }
    let reference = minijinja_reference(source, special);
    for turn in turns {
        let expected = reference.render(turn);
        if matches!(&expected, Err(Error::Render(m)) if m == crate::template::ENGINE_PANICKED) {
            continue;
        }
        let got = compiled.render(turn);
        assert!(
            same_result(&got, &expected),
            "an earlier turn rendered with the memo differs from minijinja's\n  template: {source:?}\n  render():  {got:?}\n  minijinja: {expected:?}"
        );
    }
}

/// Holds the direct renderer to minijinja's output: `compiled` is a
/// template as shipped (direct renderer first) and `rendered` its
/// rendering of `request`; the reference is the same template compiled
/// again with the direct renderer off. Panics when `render_direct`
/// answers with a text other than the reference's, or when `render`
/// (direct on) differs from the reference in its text or its error.
fn check_direct_rendering(
    source: &str,
    compiled: &ChatTemplate,
    rendered: &crate::Result<String>,
    request: &ChatRequest,
    special: &SpecialTokens,
) {
    let reference = minijinja_reference(source, special);
    let expected = reference.render(request);
    if matches!(&expected, Err(Error::Render(m)) if m == crate::template::ENGINE_PANICKED) {
        // minijinja panicked (a bug of its own, caught): no reference to
        // hold the direct renderer to.
        return;
    }
    if let Some(direct) = compiled.render_direct(request) {
        assert!(
            matches!(&expected, Ok(text) if *text == direct),
            "direct rendering differs from minijinja's\n  template: {source:?}\n  direct:    {direct:?}\n  minijinja: {expected:?}"
        );
    }
    assert!(
        same_result(rendered, &expected),
        "render() with the direct renderer differs from minijinja's\n  template: {source:?}\n  render():  {rendered:?}\n  minijinja: {expected:?}"
    );
}

/// `source` compiled again with the direct renderer off: minijinja's
/// rendering, the reference the direct renderer and the memo are held to.
fn minijinja_reference(source: &str, special: &SpecialTokens) -> ChatTemplate {
    let Ok(reference) = ChatTemplate::new(
        source,
        special.clone(),
        FUZZ_LIMITS,
        Arc::new(FixedClock(FUZZ_CLOCK)),
    ) else {
        panic!("the template compiled once and not twice: {source:?}");
    };
    reference.with_direct_rendering(false)
}

/// Whether two renderings agree: the same text, or errors of the same text.
fn same_result(a: &crate::Result<String>, b: &crate::Result<String>) -> bool {
    match (a, b) {
        (Ok(a), Ok(b)) => a == b,
        (Err(a), Err(b)) => a.to_string() == b.to_string(),
        _ => false,
    }
}

/// Loads `data` (lossy UTF-8) as a `.tiktoken` file and, when it loads,
/// tokenizes a text with special tokens in it, through both the `tokenizers`
/// pipeline and the direct encoder the crate uses. Panics only if a loaded
/// tokenizer gives an id outside its vocabulary; errors are expected.
pub fn tiktoken(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let Ok((tokenizer, _)) = crate::tiktoken::load(&text, true) else {
        return;
    };
    let vocab = tokenizer.get_vocab_size(true);
    let Ok(direct) = PromptTokenizer::from_tiktoken(
        &text,
        crate::TokenizerConfig::default(),
        crate::TokenizerOptions::default(),
    ) else {
        return;
    };
    let mut cut = text.len().min(256);
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    for sample in [&text[..cut], "<|start|>user<|message|>Hi 42!<|end|>"] {
        if let Ok(encoding) = tokenizer.encode_fast(sample, false) {
            assert!(
                encoding.get_ids().iter().all(|&id| (id as usize) < vocab),
                "an id outside the vocabulary"
            );
        }
        if let Ok(ids) = direct.text_tokens(sample, false) {
            assert!(
                ids.iter().all(|&id| (id as usize) < vocab),
                "an id outside the vocabulary (direct encoder)"
            );
        }
    }
}

/// A small byte-level BPE vocabulary as `tokenizer.json` text in each of
/// the shapes the direct encoder serves (see `tests/bpe.rs` for the same
/// shapes on a real vocabulary), loaded both ways once.
fn bpe_variants() -> &'static [(PromptTokenizer, tokenizers::Tokenizer)] {
    use std::sync::OnceLock;
    static VARIANTS: OnceLock<Vec<(PromptTokenizer, tokenizers::Tokenizer)>> = OnceLock::new();
    VARIANTS.get_or_init(|| {
        // Every byte, then tokens whose halves are earlier tokens: the
        // merge list `tokenizer_json` derives holds several ways to some.
        let mut ranks: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
        for word in [
            "th", "he", "the", " t", " the", "in", "ing", " a", "an", "nd", " and", "er", "re",
            "on", " o", " on", "at", "en", "es", " s", "is", " is", "it", " i", " it", "  ",
            "   ", "\n\n", "12", "123", "e\u{301}", "\u{e9}", "ca", "caf", "caf\u{e9}",
        ] {
            ranks.push(word.as_bytes().to_vec());
        }
        let text = crate::tiktoken::format_ranks(ranks.iter().zip(0u32..));
        let Ok(json) = crate::tiktoken::tokenizer_json(&text) else {
            return Vec::new();
        };
        let Ok(base) = serde_json::from_str::<serde_json::Value>(&json) else {
            return Vec::new();
        };
        let split = |pattern: &str| {
            serde_json::json!({"type": "Split", "pattern": {"Regex": pattern},
                "behavior": "Isolated", "invert": false})
        };
        let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
            "trim_offsets": true, "use_regex": false});
        let llama = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
        let mut shapes = vec![base.clone()];
        let mut llama_shape = base.clone();
        llama_shape["pre_tokenizer"] = serde_json::json!({"type": "Sequence",
            "pretokenizers": [split(llama), byte_level.clone()]});
        shapes.push(llama_shape.clone());
        let mut qwen = llama_shape;
        qwen["normalizer"] = serde_json::json!({"type": "NFC"});
        qwen["model"]["ignore_merges"] = serde_json::json!(false);
        shapes.push(qwen);
        let mut digits = base;
        digits["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
            split(r"\p{N}{1,3}"), split("[\u{4e00}-\u{9fa5}]+"), split(llama), byte_level]});
        shapes.push(digits);
        shapes
            .into_iter()
            .filter_map(|shape| {
                let text = shape.to_string();
                let ours = PromptTokenizer::from_parts(
                    text.as_bytes(),
                    crate::TokenizerConfig::default(),
                    crate::TokenizerOptions::default(),
                )
                .ok()?;
                let reference = tokenizers::Tokenizer::from_bytes(text.as_bytes()).ok()?;
                Some((ours, reference))
            })
            .collect()
    })
}

/// Encodes `data` (lossy UTF-8) with the direct byte-level BPE encoder and
/// with the `tokenizers` crate, a small vocabulary in four `tokenizer.json`
/// shapes, and panics if the ids differ (or if a shape stopped taking the
/// direct encoder).
pub fn bpe(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let variants = bpe_variants();
    assert_eq!(variants.len(), 4, "a fuzz vocabulary failed to load");
    for (ours, reference) in variants {
        assert_eq!(ours.text_encoder(), Some(&crate::TextEncoder::Direct));
        let (Ok(ids), Ok(expected)) = (
            ours.text_tokens(&text, false),
            reference.encode_fast(text.as_ref(), false),
        ) else {
            continue;
        };
        assert_eq!(
            ids,
            expected.get_ids(),
            "the direct encoder differs from tokenizers on {text:?}"
        );
    }
}

fn unreachable_request() -> ChatRequest {
    // `ChatRequest::new` of a literal array cannot fail; keep the fuzz
    // harness panic-free all the same.
    ChatRequest::from_json(br#"{"messages":[]}"#).unwrap_or_else(|_| {
        ChatRequest::new(&serde_json::Value::Array(Vec::new())).unwrap_or_else(|_| unreachable!())
    })
}
