//! The real-template corpus: every chat template a model publishes that the
//! corpus holds, rendered with every conversation of
//! `tests/corpus/conversations.json` (hand-written) and of the corpus
//! directory's `generated-conversations.json` (composed from the same
//! shapes by `tests/corpus/generate_conversations.py` with a fixed seed),
//! compared byte for byte with what
//! Python's reference renderer produced for the same pair (a refusal on
//! one side must be a refusal on the other).
//!
//! The corpus and the reference renders are not in the repository: the
//! templates ship under their models' licenses. `scripts/template-corpus`
//! downloads them (llama.cpp's collection, as the `llama-cpp-python` sdist
//! on PyPI carries it), renders the reference in a venv it creates and
//! runs this test with `TEMPLATE_CORPUS` pointing at the result; without
//! the variable the test is ignored. `tests/corpus/README.md` says more.
//!
//! `tests/corpus/known-differences.txt` lists the cases that still differ,
//! one `template/conversation` per line: the test fails when any other case
//! differs, and when a listed case agrees (take it off the list).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use prompt_tokens::{
    ChatRequest, ChatTemplate, FixedClock, PromptTokenizer, RenderLimits, SpecialTokens,
    TextEncoder, TokenizerOptions,
};
use serde_json::Value;

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every conversation, hand-written and generated, as the request body a
/// client sends (`render_corpus.py`'s `request_body`: the messages, tools
/// and documents as written, both flags spelled out), by name.
fn conversations(dir: &Path) -> Vec<(String, String)> {
    let fixed =
        read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/conversations.json"));
    let generated = read(&dir.join("generated-conversations.json"));
    let mut all = Vec::new();
    for text in [fixed, generated] {
        // `preserve_order` (the workspace's serde_json) keeps each object's
        // keys as written: an argument object's order reaches `tojson`.
        let list: Vec<serde_json::Map<String, Value>> = serde_json::from_str(&text).unwrap();
        for conversation in list {
            let name = conversation["name"].as_str().expect("a name").to_owned();
            let mut body = serde_json::Map::new();
            for key in ["messages", "tools", "documents"] {
                if let Some(value) = conversation.get(key) {
                    body.insert(key.to_owned(), value.clone());
                }
            }
            for flag in ["add_generation_prompt", "continue_final_message"] {
                let value = conversation.get(flag).cloned();
                body.insert(flag.to_owned(), value.unwrap_or(Value::Bool(false)));
            }
            all.push((name, Value::Object(body).to_string()));
        }
    }
    let names: BTreeSet<&str> = all.iter().map(|(name, _)| name.as_str()).collect();
    assert_eq!(names.len(), all.len(), "conversation names repeat");
    assert!(all.len() > 24, "no generated conversations");
    all
}

fn special_tokens(reference: &Value) -> SpecialTokens {
    let token = |name: &str| {
        reference["special_tokens"][name]
            .as_str()
            .map(str::to_owned)
    };
    SpecialTokens {
        bos: token("bos_token"),
        eos: token("eos_token"),
        unk: token("unk_token"),
        pad: token("pad_token"),
    }
}

/// How one case came out on our side against the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Outcome {
    Equal,
    TextDiffers,
    WeRefuse,
    WeRender,
    TemplateRefused,
}

/// The corpus directory, its reference renders, the known differences and
/// the requests.
struct Corpus {
    dir: PathBuf,
    reference: Value,
    known: BTreeSet<String>,
    requests: BTreeMap<String, ChatRequest>,
}

fn corpus() -> Corpus {
    let dir = PathBuf::from(std::env::var("TEMPLATE_CORPUS").expect("TEMPLATE_CORPUS is set"));
    let reference: Value = serde_json::from_str(&read(&dir.join("expected.json"))).unwrap();
    let known =
        read(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/known-differences.txt"))
            .lines()
            .map(str::trim)
            .filter(|line| !line.is_empty() && !line.starts_with('#'))
            .map(str::to_owned)
            .collect();
    let requests = conversations(&dir)
        .into_iter()
        .map(|(name, body)| {
            // The reference's body for the same name must be this one: the
            // Python side read the same files (a stale expected.json, or a
            // generated file rewritten since, fails here).
            let want: Value = serde_json::from_str(
                reference["requests"][name.as_str()]
                    .as_str()
                    .unwrap_or_else(|| panic!("{name}: not in the reference")),
            )
            .unwrap();
            // Compared as text, re-serialized alike: key order counts too.
            assert_eq!(
                body,
                want.to_string(),
                "{name}: the reference rendered another request"
            );
            let request =
                ChatRequest::from_json(body.as_bytes()).unwrap_or_else(|e| panic!("{name}: {e}"));
            (name, request)
        })
        .collect::<BTreeMap<_, _>>();
    assert_eq!(
        requests.len(),
        reference["requests"].as_object().expect("requests").len(),
        "the reference rendered conversations this side does not have"
    );
    Corpus {
        dir,
        reference,
        known,
        requests,
    }
}

#[test]
#[ignore = "needs the corpus: run scripts/template-corpus"]
fn every_real_template_renders_as_the_reference_renders_it() {
    let Corpus {
        dir,
        reference,
        known,
        requests,
    } = corpus();
    let tokens = special_tokens(&reference);
    let mut templates: Vec<PathBuf> = std::fs::read_dir(dir.join("templates"))
        .expect("templates")
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "jinja"))
        .collect();
    templates.sort();
    assert!(templates.len() >= 60, "{} templates", templates.len());

    let mut outcomes: BTreeMap<Outcome, usize> = BTreeMap::new();
    let (mut direct_answered, mut direct_renders, mut direct_disagree) = (0, 0, Vec::new());
    // `TEMPLATE_CORPUS_SHOW=template/conversation[,...]` prints both sides.
    let show: Vec<String> = std::env::var("TEMPLATE_CORPUS_SHOW")
        .map(|v| v.split(',').map(str::to_owned).collect())
        .unwrap_or_default();
    // `TEMPLATE_CORPUS_DIRECT=1` prints, per template, how many renders
    // the direct renderer answered and why it declined the others (the
    // most frequent reasons first): what to teach it next.
    let breakdown = std::env::var_os("TEMPLATE_CORPUS_DIRECT").is_some();
    let mut unexpected = Vec::new();
    let mut now_agreeing = Vec::new();
    for path in &templates {
        let (mut answered, mut renders) = (0, 0);
        let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        let compiled = ChatTemplate::new(
            &read(path),
            tokens.clone(),
            RenderLimits::default(),
            Arc::new(FixedClock(0)),
        );
        for (name, request) in &requests {
            let case = format!("{stem}/{name}");
            let want = &reference["cases"][case.as_str()];
            assert!(want.is_object(), "{case}: no reference render");
            let want_text = want.get("text").and_then(Value::as_str);
            if show.contains(&case)
                && let Err(error) = &compiled
            {
                eprintln!("== {case}: the template is refused: {error}");
            }
            let outcome = match (&compiled, want_text) {
                (Err(_), None) => Outcome::Equal,
                (Err(_), Some(_)) => Outcome::TemplateRefused,
                (Ok(template), _) => {
                    let ours = template.render(request);
                    if show.contains(&case) {
                        eprintln!("== {case}\n-- ours:\n{ours:?}\n-- reference:\n{want}");
                        if let (Ok(text), Some(want)) = (&ours, want_text) {
                            let at = text
                                .bytes()
                                .zip(want.bytes())
                                .take_while(|(a, b)| a == b)
                                .count();
                            let from = text.floor_char_boundary(at.saturating_sub(80));
                            eprintln!(
                                "-- first difference at byte {at}:\n   ours {:?}\n   want {:?}",
                                &text[from..text.ceil_char_boundary((at + 80).min(text.len()))],
                                &want[want.floor_char_boundary(from)
                                    ..want.ceil_char_boundary((at + 80).min(want.len()))],
                            );
                        }
                    }
                    renders += 1;
                    if breakdown && let Some(reason) = template.direct_decline_reason(request) {
                        *reasons.entry(reason).or_default() += 1;
                    }
                    if let Some(direct) = template.render_direct(request) {
                        answered += 1;
                        direct_answered += 1;
                        if ours.as_deref().ok() != Some(direct.as_str()) {
                            direct_disagree.push(case.clone());
                        }
                    }
                    direct_renders += 1;
                    match (ours, want_text) {
                        (Ok(text), Some(want)) if text == want => Outcome::Equal,
                        (Ok(_), Some(_)) => Outcome::TextDiffers,
                        (Err(_), None) => Outcome::Equal,
                        (Err(_), Some(_)) => Outcome::WeRefuse,
                        (Ok(_), None) => Outcome::WeRender,
                    }
                }
            };
            *outcomes.entry(outcome).or_default() += 1;
            match (outcome == Outcome::Equal, known.contains(&case)) {
                (false, false) => unexpected.push(format!("{case}: {outcome:?}")),
                (true, true) => now_agreeing.push(case),
                _ => {}
            }
        }
        if breakdown {
            let mut reasons: Vec<_> = reasons.into_iter().collect();
            reasons.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            eprintln!("direct {stem}: {answered} of {renders}");
            for (reason, count) in reasons.iter().take(4) {
                eprintln!("    {count:3} {reason}");
            }
        }
    }
    let cases = templates.len() * requests.len();
    let differences = cases - outcomes.get(&Outcome::Equal).copied().unwrap_or(0);
    eprintln!(
        "corpus: {} templates, {cases} cases, {differences} differences {outcomes:?}; \
         direct renderer answered {direct_answered} of {direct_renders} renders, {} disagreeing with minijinja",
        templates.len(),
        direct_disagree.len(),
    );
    assert!(
        direct_disagree.is_empty(),
        "the direct renderer disagrees: {direct_disagree:?}"
    );
    assert_known(&unexpected, &now_agreeing);
}

#[test]
#[ignore = "needs the corpus: run scripts/template-corpus"]
fn every_real_model_renders_and_tokenizes_as_the_reference() {
    let Corpus {
        dir,
        reference,
        known,
        requests,
    } = corpus();
    let models = reference["models"].as_object().expect("models");
    assert!(models.len() >= 8, "{} models", models.len());
    let chatml = dir.join("chatml.jinja");
    std::fs::write(&chatml, reference["chatml"].as_str().expect("chatml")).unwrap();
    let (mut cases, mut text_differs, mut ids_differ, mut refusals_differ) = (0, 0, 0, 0);
    let mut tokens = 0;
    let mut unexpected = Vec::new();
    let mut now_agreeing = Vec::new();
    let mut direct = Vec::new();
    for (model, expected) in models {
        let own = expected["own_template"].as_bool().expect("own_template");
        let options = TokenizerOptions {
            clock: Arc::new(FixedClock(0)),
            ..TokenizerOptions::default()
        };
        let tokenizer = PromptTokenizer::from_path_with(
            &dir.join("models").join(model),
            (!own).then_some(chatml.as_path()),
            options,
        )
        .unwrap_or_else(|e| panic!("{model}: {e}"));
        match tokenizer.text_encoder() {
            Some(TextEncoder::Direct) => direct.push(model.as_str()),
            other => eprintln!("{model}: {other:?}"),
        }
        for (name, request) in &requests {
            cases += 1;
            let case = format!("model:{model}/{name}");
            let want = &expected["cases"][name.as_str()];
            let text = tokenizer.chat_text(request);
            let agrees = match (&text, want.get("text").and_then(Value::as_str)) {
                (Ok(text), Some(want_text)) if text != want_text => {
                    text_differs += 1;
                    false
                }
                (Ok(_), Some(_)) => {
                    let ids = tokenizer
                        .chat_tokens(request)
                        .unwrap_or_else(|e| panic!("{case}: rendered, then {e}"));
                    let want_ids: Vec<u32> = serde_json::from_value(want["ids"].clone()).unwrap();
                    tokens += want_ids.len();
                    if ids != want_ids {
                        ids_differ += 1;
                    }
                    ids == want_ids
                }
                (Err(_), None) => true,
                _ => {
                    refusals_differ += 1;
                    false
                }
            };
            match (agrees, known.contains(&case)) {
                (false, false) => unexpected.push(case),
                (true, true) => now_agreeing.push(case),
                _ => {}
            }
        }
    }
    eprintln!(
        "models: {} models, {cases} cases, {tokens} tokens compared; {text_differs} texts, \
         {ids_differ} token sequences and {refusals_differ} refusals differ; \
         the direct encoder served {}",
        models.len(),
        direct.join(", ")
    );
    // The byte-level BPE families must take the direct encoder: a change
    // that declines them would pass the comparison above on `tokenizers`.
    for family in ["llama3_1", "qwen3", "deepseek_v3", "mistral_nemo"] {
        assert!(
            direct.contains(&family),
            "{family} is not on the direct encoder"
        );
    }
    assert_known(&unexpected, &now_agreeing);
}

/// Fails when a listed case now agrees (take it off the list) or a case
/// that is not listed differs.
fn assert_known(unexpected: &[String], now_agreeing: &[String]) {
    assert!(
        now_agreeing.is_empty(),
        "now agree with the reference, take them off known-differences.txt:\n{}",
        now_agreeing.join("\n")
    );
    assert!(
        unexpected.is_empty(),
        "{} cases differ that known-differences.txt does not list:\n{}",
        unexpected.len(),
        unexpected.join("\n")
    );
}

/// Hostile variants of a conversation: the first or the last message's
/// content replaced by a value of another shape (a number past 64 bits,
/// null, a list of parts, an object, a boolean, padded and special-token
/// text), its role changed, or its content removed.
fn hostile_variants(body: &str) -> Vec<String> {
    let contents = [
        serde_json::json!(18446744073709551616u128 as f64),
        serde_json::json!(-9223372036854775808i64),
        Value::Null,
        serde_json::json!([{"type": "text", "text": " a "}, {"type": "text", "text": "b\n"}]),
        serde_json::json!({"content": "nested"}),
        serde_json::json!(true),
        serde_json::json!("  <|im_end|> é 🙂 </think>\n"),
        serde_json::json!(""),
    ];
    let original: Value = serde_json::from_str(body).expect("a body");
    let count = original["messages"].as_array().map_or(0, Vec::len);
    let mut out = Vec::new();
    for at in [0, count.saturating_sub(1)] {
        if count == 0 {
            break;
        }
        for content in &contents {
            let mut body = original.clone();
            body["messages"][at]["content"] = content.clone();
            out.push(body.to_string());
        }
        for role in ["tool", "developer", "assistant"] {
            let mut body = original.clone();
            body["messages"][at]["role"] = Value::from(role);
            out.push(body.to_string());
        }
        let mut body = original.clone();
        if let Some(message) = body["messages"][at].as_object_mut() {
            message.remove("content");
        }
        out.push(body.to_string());
    }
    out
}

/// The direct renderer on every real template, over hostile variants of
/// the hand-written conversations: whenever it answers, its text is
/// minijinja's (it may decline anything). Prints how often it answered.
#[test]
#[ignore = "needs the corpus: run scripts/template-corpus"]
fn the_direct_renderer_equals_minijinja_on_hostile_variants() {
    let dir = PathBuf::from(std::env::var("TEMPLATE_CORPUS").expect("TEMPLATE_CORPUS is set"));
    let reference: Value = serde_json::from_str(&read(&dir.join("expected.json"))).unwrap();
    let tokens = special_tokens(&reference);
    let fixed: Vec<serde_json::Map<String, Value>> = serde_json::from_str(&read(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/corpus/conversations.json"),
    ))
    .unwrap();
    let mut requests = Vec::new();
    for conversation in fixed {
        let mut body = serde_json::Map::new();
        for key in ["messages", "tools", "documents", "add_generation_prompt"] {
            if let Some(value) = conversation.get(key) {
                body.insert(key.to_owned(), value.clone());
            }
        }
        for variant in hostile_variants(&Value::Object(body).to_string()) {
            if let Ok(request) = ChatRequest::from_json(variant.as_bytes()) {
                requests.push((variant, request));
            }
        }
    }
    let mut templates: Vec<PathBuf> = std::fs::read_dir(dir.join("templates"))
        .expect("templates")
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "jinja"))
        .collect();
    templates.sort();
    let (mut answered, mut renders, mut disagree) = (0, 0, Vec::new());
    for path in &templates {
        let source = read(path);
        let compile = || {
            ChatTemplate::new(
                &source,
                tokens.clone(),
                RenderLimits::default(),
                Arc::new(FixedClock(0)),
            )
        };
        let (Ok(direct), Ok(reference)) = (compile(), compile()) else {
            continue;
        };
        let reference = reference.with_direct_rendering(false);
        for (body, request) in &requests {
            renders += 1;
            if let Some(text) = direct.render_direct(request) {
                answered += 1;
                if reference.render(request).ok().as_deref() != Some(text.as_str()) {
                    disagree.push(format!("{}: {body}", path.display()));
                }
            }
        }
    }
    eprintln!(
        "hostile variants: {} requests x {} templates; direct renderer answered {answered} of {renders}, {} disagreeing",
        requests.len(),
        templates.len(),
        disagree.len()
    );
    assert!(disagree.is_empty(), "{disagree:#?}");
}

/// The bodies of a conversation's turns as its client sends them, one per
/// prefix of its messages (two messages or more), the whole one last.
fn prefixes(body: &Value) -> Vec<Value> {
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    (2..=messages.len())
        .map(|m| {
            let mut turn = body.clone();
            turn["messages"] = Value::Array(messages[..m].to_vec());
            turn
        })
        .collect()
}

/// Variants of a whole conversation the memo must not be fooled by, each
/// rendered after its prefixes: an earlier message edited, the last one
/// replaced, the tools changed, the flags flipped.
fn memo_variants(body: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    let messages = body["messages"].as_array().cloned().unwrap_or_default();
    if messages.len() >= 2 {
        for at in [0, messages.len() / 2, messages.len() - 1] {
            let mut edited = body.clone();
            if let Some(Value::String(text)) = edited["messages"][at].get_mut("content") {
                text.push_str(" (edited)");
                out.push(edited);
            }
        }
    }
    let mut tools = body.clone();
    match tools.get("tools") {
        Some(Value::Array(list)) if !list.is_empty() => {
            tools.as_object_mut().expect("an object").remove("tools");
        }
        _ => {
            tools["tools"] = serde_json::json!([{"type": "function", "function": {
                "name": "lookup", "description": "Looks a word up.",
                "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}]);
        }
    }
    out.push(tools);
    for flag in ["add_generation_prompt", "continue_final_message"] {
        let mut flipped = body.clone();
        let on = flipped[flag].as_bool().unwrap_or(false);
        flipped[flag] = Value::Bool(!on);
        out.push(flipped);
    }
    out
}

#[test]
#[ignore = "needs the corpus: run scripts/template-corpus"]
fn the_render_memo_renders_every_turn_as_a_cold_rendering_does() {
    let dir = PathBuf::from(std::env::var("TEMPLATE_CORPUS").expect("TEMPLATE_CORPUS is set"));
    let reference: Value = serde_json::from_str(&read(&dir.join("expected.json"))).unwrap();
    let tokens = special_tokens(&reference);
    let bodies: Vec<(String, Value)> = conversations(&dir)
        .into_iter()
        .map(|(name, body)| (name, serde_json::from_str(&body).unwrap()))
        .collect();
    let mut templates: Vec<PathBuf> = std::fs::read_dir(dir.join("templates"))
        .expect("templates")
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "jinja"))
        .collect();
    templates.sort();
    let outcome = |template: &ChatTemplate, request: prompt_tokens::Result<ChatRequest>| {
        request.map_err(|e| e.to_string()).and_then(|request| {
            template
                .render(&request)
                .map_err(|e| format!("refused: {e}"))
        })
    };
    // The memo side reads each body as the router does, through one
    // message memo for the whole run: a turn's earlier messages come back
    // as the objects the turn before had (and the template's memo of
    // prepared messages serves them). Its bodies are padded past the
    // memo's threshold with a field the request ignores.
    let messages_memo = prompt_tokens::MessageMemo::default();
    let padding = ".".repeat(prompt_tokens::MIN_BODY_BYTES);
    let read_memo = |body: &Value| {
        let mut padded = body.clone();
        if let Some(object) = padded.as_object_mut() {
            object.insert("x_padding".into(), Value::String(padding.clone()));
        }
        ChatRequest::from_json_with(padded.to_string().as_bytes(), &messages_memo)
    };
    let read_cold = |body: &Value| ChatRequest::from_json(body.to_string().as_bytes());
    let (mut renders, mut differ, mut hit_templates) = (0, Vec::new(), Vec::new());
    let (mut lookups, mut hits) = (0, 0);
    for path in &templates {
        let source = read(path);
        let compile = || {
            ChatTemplate::new(
                &source,
                tokens.clone(),
                RenderLimits::default(),
                Arc::new(FixedClock(0)),
            )
        };
        let (Ok(memo), Ok(cold)) = (compile(), compile()) else {
            continue;
        };
        // The cold side renders everything from scratch (directly where
        // it can: the differential tests hold that equal to minijinja).
        let cold = cold.with_render_memo(0);
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        for (conversation, body) in &bodies {
            let turns = prefixes(body);
            for turn in turns.iter().chain(&memo_variants(body)) {
                renders += 1;
                let got = outcome(&memo, read_memo(turn));
                let want = outcome(&cold, read_cold(turn));
                if got != want {
                    differ.push(format!(
                        "{name}/{conversation}: {turn}\n  memo: {got:?}\n  cold: {want:?}"
                    ));
                }
            }
        }
        let stats = memo.render_memo_stats().unwrap_or_default();
        lookups += stats.lookups;
        hits += stats.hits;
        if stats.hits > 0 {
            hit_templates.push(format!("{name} ({} of {})", stats.hits, stats.lookups));
        }
    }
    let message_stats = messages_memo.stats();
    println!(
        "render memo: {renders} renders over {} templates, {} differences; {hits} of {lookups} \
         loop lookups resumed a stored state, on {} templates; {} of {} messages read from the \
         message memo:\n  {}",
        templates.len(),
        differ.len(),
        hit_templates.len(),
        message_stats.hits,
        message_stats.lookups,
        hit_templates.join("\n  ")
    );
    // The padded turns did go through the message memo.
    assert!(message_stats.hits > 0, "{message_stats:?}");
    assert!(differ.is_empty(), "{}", differ.join("\n"));
    assert!(hits > 0, "the memo never resumed a rendering");
}
