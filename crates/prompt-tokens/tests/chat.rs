//! Chat rendering and tokenization on trained models: every template family
//! with every tokenizer kind; the cached segment path against whole-text
//! tokenization (proptest), warm against cold.

mod common;

use common::{NOW, model_dir, options, tokenizer};
use prompt_tokens::testing::TestTokenizerKind;
use prompt_tokens::{ChatRequest, CompletionRequest, PromptTokenizer, SegmentMode, TemplateFamily};
use proptest::prelude::*;
use serde_json::{Value, json};

fn request(messages: Value) -> ChatRequest {
    ChatRequest::new(&messages).expect("request")
}

#[test]
fn segment_mode_is_chosen_by_tokenizer_shape() {
    for family in TemplateFamily::ALL {
        for kind in TestTokenizerKind::ALL {
            let t = tokenizer(family, kind);
            let mode = t.segment_mode().expect("hf").clone();
            match kind {
                TestTokenizerKind::MetaspaceFirst => {
                    assert!(
                        matches!(mode, SegmentMode::Whole(ref r) if r.contains("Metaspace")),
                        "{mode:?}"
                    )
                }
                _ => assert_eq!(mode, SegmentMode::Segments, "{family:?} {kind:?}"),
            }
            assert!(
                t.describe().starts_with("tokens (tokenizer.json "),
                "{}",
                t.describe()
            );
        }
    }
}

#[test]
fn llama3_renders_date_header_tools_and_generation_prompt() {
    let t = tokenizer(TemplateFamily::Llama3, TestTokenizerKind::ByteLevelRegex);
    let body = json!({
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        ],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
    });
    let text = t
        .chat_text(&ChatRequest::from_value(&body).unwrap())
        .unwrap();
    assert!(text.starts_with("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"));
    assert!(text.contains("Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n"));
    assert!(text.contains("\"name\": \"get_weather\""), "{text}");
    assert!(text.contains("<|start_header_id|>user<|end_header_id|>\n\nWeather?<|eot_id|>"));
    assert!(text.ends_with("<|start_header_id|>assistant<|end_header_id|>\n\n"));
    let no_prompt =
        request(json!([{"role": "user", "content": "x"}])).with_add_generation_prompt(false);
    assert!(t.chat_text(&no_prompt).unwrap().ends_with("x<|eot_id|>"));
}

#[test]
fn chat_tokens_start_with_bos_once_and_special_tokens_are_single_ids() {
    let dir = model_dir(TemplateFamily::Llama3, TestTokenizerKind::ByteLevelRegex);
    let t = PromptTokenizer::from_path_with(&dir, None, options()).unwrap();
    let raw = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let bos = raw.token_to_id("<|begin_of_text|>").unwrap();
    let eot = raw.token_to_id("<|eot_id|>").unwrap();
    let ids = t
        .chat_tokens(&request(
            json!([{"role": "user", "content": "hello <|eot_id|> there"}]),
        ))
        .unwrap();
    assert_eq!(ids[0], bos);
    assert_eq!(
        ids.iter().filter(|&&i| i == bos).count(),
        1,
        "chat adds no second BOS"
    );
    // Text that spells a special token is that token, as in the engine.
    assert_eq!(ids.iter().filter(|&&i| i == eot).count(), 3);
    let decoded = raw.decode(&ids, false).unwrap();
    assert!(decoded.contains("hello <|eot_id|> there"), "{decoded}");
}

#[test]
fn chatml_content_parts_null_content_and_tool_calls() {
    let t = tokenizer(TemplateFamily::ChatMl, TestTokenizerKind::Gpt2);
    let body = json!({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": null, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "content": "42"},
    ]});
    let text = t
        .chat_text(&ChatRequest::from_value(&body).unwrap())
        .unwrap();
    assert_eq!(
        text,
        "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"x\": 1}}\n</tool_call><|im_end|>\n<|im_start|>tool\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    );
}

/// What vLLM does to content parts before the template (see
/// `prompt_tokens::messages`): our templates print content as a string, so
/// text parts arrive joined by newlines (the `a\nb` above); parts of an
/// unknown type are a bad request, media parts a prompt only the engine
/// can build.
#[test]
fn unknown_and_media_parts_are_refused_by_name() {
    for family in TemplateFamily::ALL {
        let t = tokenizer(family, TestTokenizerKind::Gpt2);
        let bogus =
            json!({"messages": [{"role": "user", "content": [{"type": "bogus", "text": "x"}]}]});
        let error = t
            .chat_tokens(&ChatRequest::from_value(&bogus).unwrap())
            .unwrap_err();
        assert!(
            matches!(&error, prompt_tokens::Error::InvalidRequest(m) if m.contains("'bogus'")),
            "{family:?}: {error}"
        );
        let image = json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]});
        let error = t
            .chat_tokens(&ChatRequest::from_value(&image).unwrap())
            .unwrap_err();
        assert!(
            matches!(&error, prompt_tokens::Error::Unsupported(m) if m.contains("image_url")),
            "{family:?}: {error}"
        );
    }
}

#[test]
fn tools_keep_the_clients_key_order_in_tojson() {
    let t = tokenizer(TemplateFamily::ChatMl, TestTokenizerKind::ByteLevelRegex);
    let body = br#"{"messages":[{"role":"user","content":"hi"}],
        "tools":[{"type":"function","function":{"name":"zeta","description":"d","parameters":{"b":1,"a":[true,null,1.5]}}}]}"#;
    let text = t.chat_text(&ChatRequest::from_json(body).unwrap()).unwrap();
    assert!(
        text.contains(r#"{"type": "function", "function": {"name": "zeta", "description": "d", "parameters": {"b": 1, "a": [true, null, 1.5]}}}"#),
        "{text}"
    );
}

#[test]
fn harmony_has_current_date_channels_and_developer_tools() {
    let t = tokenizer(TemplateFamily::Harmony, TestTokenizerKind::ByteLevelRegex);
    let body = json!({"messages": [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Salut"},
        {"role": "user", "content": "Weather?"},
    ], "tools": [{"type": "function", "function": {"name": "w"}}],
       "chat_template_kwargs": {"reasoning_effort": "high"}});
    let text = t
        .chat_text(&ChatRequest::from_value(&body).unwrap())
        .unwrap();
    assert!(text.starts_with("<|start|>system<|message|>"));
    assert!(text.contains("Current date: 2024-07-26\n"));
    assert!(text.contains("Reasoning: high"));
    assert!(text.contains("<|start|>developer<|message|># Instructions\n\nAnswer in French."));
    assert!(text.contains("<|start|>assistant<|channel|>final<|message|>Salut<|end|>"));
    assert!(text.ends_with("<|start|>user<|message|>Weather?<|end|><|start|>assistant"));
}

#[test]
fn mistral_alternation_error_is_surfaced() {
    let t = tokenizer(TemplateFamily::Mistral, TestTokenizerKind::MetaspaceFirst);
    let err = t
        .chat_tokens(&request(json!([
            {"role": "user", "content": "a"}, {"role": "user", "content": "b"}])))
        .unwrap_err();
    match err {
        prompt_tokens::Error::TemplateRaised(msg) => assert!(msg.contains("alternate"), "{msg}"),
        other => panic!("expected TemplateRaised, got {other:?}"),
    }
    let ok = t
        .chat_text(&request(json!([
            {"role": "system", "content": "S"},
            {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"}])))
        .unwrap();
    assert_eq!(ok, "<s>[INST] a [/INST] b</s>[INST] S\n\nc [/INST]");
}

#[test]
fn continue_final_message_ends_at_the_final_text() {
    let t = tokenizer(TemplateFamily::ChatMl, TestTokenizerKind::ByteLevelRegex);
    let body = json!({"messages": [
        {"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}],
        "add_generation_prompt": false, "continue_final_message": true});
    let text = t
        .chat_text(&ChatRequest::from_value(&body).unwrap())
        .unwrap();
    assert!(text.ends_with("<|im_start|>assistant\n1, 2,"), "{text}");
    let both =
        json!({"messages": [{"role": "user", "content": "x"}], "continue_final_message": true});
    assert!(matches!(
        t.chat_text(&ChatRequest::from_value(&both).unwrap()),
        Err(prompt_tokens::Error::InvalidRequest(_))
    ));
}

#[test]
fn multi_turn_warm_request_hits_the_cache_and_matches_whole_text() {
    let t = tokenizer(TemplateFamily::ChatMl, TestTokenizerKind::ByteLevelRegex);
    let mut messages =
        vec![json!({"role": "system", "content": "You are a helpful assistant. ".repeat(50)})];
    let mut previous = None;
    for turn in 0..6 {
        messages.push(json!({"role": "user", "content": format!("question {turn}: what is {turn} + {turn}?")}));
        let req = request(Value::Array(messages.clone()));
        let before = t.cache_stats();
        let cached = t.chat_tokens(&req).unwrap();
        let after = t.cache_stats();
        assert_eq!(cached, t.chat_tokens_uncached(&req).unwrap(), "turn {turn}");
        if turn > 0 {
            // Only the new segments (the new user message, the assistant
            // reply before it, the generation header) can miss.
            assert!(
                after.misses - before.misses <= 4,
                "turn {turn}: {before:?} -> {after:?}"
            );
            assert!(after.hits > before.hits);
        }
        if let Some(prev) = &previous {
            let prev: &Vec<u32> = prev;
            // The previous prompt minus its generation prompt is a prefix.
            let shared = prev.iter().zip(&cached).take_while(|(a, b)| a == b).count();
            assert!(
                shared + 4 >= prev.len(),
                "turn {turn}: shared {shared} of {}",
                prev.len()
            );
        }
        messages.push(json!({"role": "assistant", "content": format!("It is {}.", turn * 2)}));
        previous = Some(cached);
    }
    let stats = t.cache_stats();
    assert!(stats.entries > 0 && stats.bytes > 0);
}

#[test]
fn add_special_tokens_on_a_chat_request_adds_bos_on_top() {
    let t = tokenizer(TemplateFamily::Llama3, TestTokenizerKind::ByteLevelRegex);
    let body = json!({"messages": [{"role": "user", "content": "x"}], "add_special_tokens": true});
    let req = ChatRequest::from_value(&body).unwrap();
    let ids = t.chat_tokens(&req).unwrap();
    assert_eq!(
        ids[0], ids[1],
        "BOS from the post-processor, then the template's"
    );
    let plain = t
        .chat_tokens(&request(json!([{"role": "user", "content": "x"}])))
        .unwrap();
    assert_eq!(&ids[1..], &plain[..]);
    let _ = NOW;
}

// ---- proptest: cached == whole, warm == cold ----

fn text_strategy() -> impl Strategy<Value = String> {
    let fragments = prop_oneof![
        "[a-zA-Z0-9 ,.!?'\n\t]{0,24}",
        "\\PC{0,12}",
        Just("<|im_start|>".to_owned()),
        Just("<|im_end|>".to_owned()),
        Just("<|eot_id|>".to_owned()),
        Just("<|start_header_id|>".to_owned()),
        Just("[INST]".to_owned()),
        Just("</s>".to_owned()),
        Just("<|start|>".to_owned()),
        Just("<|message|>".to_owned()),
        Just("<|im_".to_owned()),
        Just("|>".to_owned()),
        Just("  ".to_owned()),
        Just("\n\n".to_owned()),
        Just("▁".to_owned()),
        Just("🙂".to_owned()),
    ];
    prop::collection::vec(fragments, 0..6).prop_map(|parts| parts.concat())
}

fn content_strategy() -> impl Strategy<Value = Value> {
    prop_oneof![
        4 => text_strategy().prop_map(Value::from),
        1 => Just(Value::Null),
        2 => prop::collection::vec(
            prop_oneof![
                3 => text_strategy().prop_map(|t| json!({"type": "text", "text": t})),
                1 => text_strategy().prop_map(|t| json!({"type": "refusal", "refusal": t})),
                1 => text_strategy().prop_map(Value::from),
                1 => Just(json!({"type": "text"})),
            ],
            0..3,
        )
        .prop_map(Value::Array),
    ]
}

fn conversation_strategy() -> impl Strategy<Value = Vec<Value>> {
    (
        prop::option::of(text_strategy()),
        prop::collection::vec(content_strategy(), 1..7),
    )
        .prop_map(|(system, contents)| {
            let mut messages = Vec::new();
            if let Some(system) = system {
                messages.push(json!({"role": "system", "content": system}));
            }
            for (i, content) in contents.into_iter().enumerate() {
                let role = if i % 2 == 0 { "user" } else { "assistant" };
                messages.push(json!({"role": role, "content": content}));
            }
            messages
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn cached_segments_equal_whole_text_for_every_family_and_kind(
        conversation in conversation_strategy(),
    ) {
        for family in TemplateFamily::ALL {
            for kind in TestTokenizerKind::ALL {
                let t = tokenizer(family, kind);
                // Multi-turn growth: every prefix of the conversation, in order,
                // through one cache.
                for end in 1..=conversation.len() {
                    let req = request(Value::Array(conversation[..end].to_vec()));
                    let whole = match t.chat_tokens_uncached(&req) {
                        Ok(ids) => ids,
                        Err(prompt_tokens::Error::TemplateRaised(_)) => continue,
                        Err(e) => panic!("{family:?} {kind:?}: {e}"),
                    };
                    let cold = t.chat_tokens(&req).unwrap();
                    prop_assert_eq!(&cold, &whole, "{:?} {:?} cold", family, kind);
                    let warm = t.chat_tokens(&req).unwrap();
                    prop_assert_eq!(&warm, &whole, "{:?} {:?} warm", family, kind);
                }
            }
        }
    }
}

/// A template that loops over each message's content (Qwen2-VL's shape)
/// gets content as typed parts, as vLLM's detection gives it; an explicit
/// `string` format (vLLM's `--chat-template-content-format string`) gives
/// it one string.
#[test]
fn a_template_looping_over_content_gets_parts() {
    use prompt_tokens::{ChatTemplate, ContentFormat, FixedClock, RenderLimits, SpecialTokens};
    let source = "{% for message in messages %}<{{ message.role }}>\
        {% if message.content is string %}S:{{ message.content }}\
        {% else %}{% for part in message['content'] %}P:{{ part.type }}={{ part.text }};{% endfor %}{% endif %}\
        {% endfor %}";
    let template = ChatTemplate::new(
        source,
        SpecialTokens::default(),
        RenderLimits::default(),
        std::sync::Arc::new(FixedClock(NOW)),
    )
    .unwrap();
    assert_eq!(template.content_format(), ContentFormat::OpenAi);
    let req = request(json!([
        {"role": "user", "content": "hi"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, "b"]},
    ]));
    assert_eq!(
        template.render(&req).unwrap(),
        "<user>P:text=hi;<user>P:text=a;P:text=b;"
    );
    let template = template.with_content_format(ContentFormat::String);
    assert_eq!(template.render(&req).unwrap(), "<user>S:hi<user>S:a\nb");
}

/// A request read from a parsed value (the router's P/D path, one parse
/// for routing, tokens and legs) is the request read from the body's text:
/// the same rendering, keys in the client's order, the same ids.
#[test]
fn from_value_reads_the_request_from_json_reads() {
    let t = tokenizer(TemplateFamily::Llama3, TestTokenizerKind::ByteLevelRegex);
    let body = br#"{"model": "m", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": null, "tool_calls": [{"type": "function",
            "function": {"name": "get_weather", "arguments": {"zone": "b", "area": "a"}}}]}],
        "tools": [{"type": "function", "function": {"parameters": {"type": "object"}, "name": "get_weather"}}],
        "add_generation_prompt": true}"#;
    let value: Value = serde_json::from_slice(body).unwrap();
    let from_json = ChatRequest::from_json(body).unwrap();
    let from_value = ChatRequest::from_value(&value)
        .unwrap()
        .with_body_len(body.len());
    let text = t.chat_text(&from_value).unwrap();
    assert_eq!(text, t.chat_text(&from_json).unwrap());
    // serde_json's `preserve_order` (the workspace's): not sorted.
    assert!(
        text.contains(r#""parameters": {"zone": "b", "area": "a"}"#),
        "{text}"
    );
    assert_eq!(
        t.chat_tokens(&from_value).unwrap(),
        t.chat_tokens(&from_json).unwrap()
    );
    for prompt in [
        &br#"{"prompt": "abc"}"#[..],
        br#"{"prompt": [1, 2], "add_special_tokens": false}"#,
        br#"{"prompt": [[3, 4]]}"#,
        br#"{"prompt": ["a", "b"]}"#,
        br#"{"model": "m"}"#,
    ] {
        let value: Value = serde_json::from_slice(prompt).unwrap();
        assert_eq!(
            CompletionRequest::from_value(&value).ok(),
            CompletionRequest::from_json(prompt).ok(),
            "{}",
            String::from_utf8_lossy(prompt)
        );
    }
}
