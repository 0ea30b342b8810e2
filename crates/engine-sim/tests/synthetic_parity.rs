//! prompt-tokens' synthetic tokenizer (what the router computes) against
//! engine-sim's request path (what the engine computes): the chat rendering
//! through engine-sim's public request parsing and the token ids, bit for
//! bit. engine-sim's rule is prompt-tokens' own; this checks that the two
//! request paths (the router's `PromptTokenizer::chat_tokens`, the engine's
//! `parse_request`) agree. (Moved here from prompt-tokens: a dev-dependency
//! on engine-sim there would be a packaging cycle.)

use engine_sim::api::{Endpoint, Prompt, parse_request};
use prompt_tokens::{ChatRequest, CompletionRequest, PromptTokenizer};
use proptest::prelude::*;
use serde_json::{Value, json};

fn engine_prompt(endpoint: Endpoint, body: &Value) -> Option<Prompt> {
    parse_request(endpoint, body.to_string().as_bytes())
        .ok()
        .map(|r| r.prompt)
}

fn message() -> impl Strategy<Value = Value> {
    let text = "\\PC{0,40}";
    let content = prop_oneof![
        text.prop_map(Value::from),
        Just(Value::Null),
        prop::collection::vec(
            prop_oneof![
                text.prop_map(|t| json!({"type": "text", "text": t})),
                text.prop_map(Value::from),
                Just(json!({"type": "text"})),
            ],
            0..4
        )
        .prop_map(Value::Array),
    ];
    ("[a-z]{1,9}", content).prop_map(|(role, content)| json!({"role": role, "content": content}))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn chat_ids_equal_engine_sims(messages in prop::collection::vec(message(), 0..6), cpt in 1usize..9) {
        let body = json!({"model": "m", "messages": messages});
        let t = PromptTokenizer::synthetic(cpt);
        let request = ChatRequest::from_value(&body).unwrap();
        let Some(Prompt::Text(engine_text)) = engine_prompt(Endpoint::Chat, &body) else {
            // engine-sim refuses an empty conversation; so do we.
            prop_assert!(messages.is_empty(), "engine-sim refused {}", body);
            prop_assert!(t.chat_tokens(&request).is_err());
            return Ok(());
        };
        prop_assert_eq!(t.chat_text(&request).unwrap(), engine_text.clone());
        prop_assert_eq!(t.chat_tokens(&request).unwrap(), engine_sim::tokens::tokenize(&engine_text, cpt));
    }

    #[test]
    fn text_ids_equal_engine_sims(text in "\\PC{0,200}", cpt in 0usize..9) {
        prop_assert_eq!(prompt_tokens::synthetic_tokenize(&text, cpt), engine_sim::tokens::tokenize(&text, cpt));
        prop_assert_eq!(prompt_tokens::synthetic_count(&text, cpt), engine_sim::tokens::count_tokens(&text, cpt));
    }
}

#[test]
fn requests_engine_sim_refuses_are_refused() {
    let t = PromptTokenizer::synthetic(4);
    for body in [
        json!({"messages": [{"content": "no role"}]}),
        json!({"messages": [{"role": "user", "content": 7}]}),
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}),
        json!({"messages": "not a list"}),
        json!({"messages": []}),
    ] {
        assert!(
            engine_prompt(Endpoint::Chat, &body).is_none(),
            "engine-sim accepted {body}"
        );
        let ours = ChatRequest::from_value(&body).and_then(|r| t.chat_tokens(&r));
        assert!(ours.is_err(), "accepted {body}");
    }
}

#[test]
fn completion_prompts_match_engine_sim() {
    let t = PromptTokenizer::synthetic(3);
    for body in [
        json!({"prompt": "hello world, once more"}),
        json!({"prompt": ["only one"]}),
        json!({"prompt": [5, 6, 7]}),
        json!({"prompt": [[9, 8]]}),
    ] {
        let ours = t
            .completion_tokens(&CompletionRequest::from_json(body.to_string().as_bytes()).unwrap())
            .unwrap();
        let expected = match engine_prompt(Endpoint::Completions, &body).unwrap() {
            Prompt::Text(text) => engine_sim::tokens::tokenize(&text, 3),
            Prompt::Tokens(ids) => ids,
            other => panic!("unexpected prompt {other:?}"),
        };
        assert_eq!(ours, expected, "{body}");
    }
    // A batch of several prompts is refused by both, with the same reason.
    for body in [json!({"prompt": ["a", "b"]}), json!({"prompt": [[1], [2]]})] {
        let batched = CompletionRequest::from_json(body.to_string().as_bytes());
        assert!(
            matches!(&batched, Err(prompt_tokens::Error::InvalidRequest(m)) if m.contains("one prompt per request")),
            "{body}: {batched:?}"
        );
        let refused = parse_request(Endpoint::Completions, body.to_string().as_bytes())
            .expect_err("engine-sim refuses a batch");
        assert_eq!(refused.status, 400, "{body}");
        assert!(
            refused.message.contains("one prompt per request"),
            "{body}: {}",
            refused.message
        );
    }
    assert_eq!(
        t.describe(),
        "synthetic (3 chars per token, engine-sim chat rendering)"
    );
    assert_eq!(t.cache_stats(), prompt_tokens::CacheStats::default());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Long texts, ASCII (the byte path) and any Unicode (the char path),
    /// so several four-token groups and every remainder length are hit.
    #[test]
    fn long_ascii_and_unicode_texts_equal_engine_sims(
        text in prop_oneof!["[ -~\n]{0,300}", "\\PC{0,300}"],
        cpt in 1usize..12,
    ) {
        let ids = prompt_tokens::synthetic_tokenize(&text, cpt);
        prop_assert_eq!(ids.len(), prompt_tokens::synthetic_count(&text, cpt));
        prop_assert_eq!(ids, engine_sim::tokens::tokenize(&text, cpt));
        let mut appended = vec![7];
        prompt_tokens::synthetic_tokenize_into(&text, cpt, &mut appended);
        prop_assert_eq!(appended[0], 7);
        prop_assert_eq!(&appended[1..], &engine_sim::tokens::tokenize(&text, cpt)[..]);
    }
}
