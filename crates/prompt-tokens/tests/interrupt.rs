//! [`Interrupt`]: the ids are unchanged under one that never fires; a
//! cancel from another thread stops a long conversation's tokenization at
//! the next segment; the size and time budgets stop it before any work.

use prompt_tokens::testing::{TestTokenizerKind, write_model_dir};
use prompt_tokens::{
    ChatRequest, CompletionRequest, Error, Interrupt, PromptTokenizer, TemplateFamily,
    TokenizerOptions,
};
use std::time::Duration;

fn tokenizer(name: &str, cache_bytes: usize) -> PromptTokenizer {
    let dir = std::env::temp_dir().join(format!("interrupt-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    write_model_dir(
        &dir,
        TemplateFamily::ChatMl,
        TestTokenizerKind::ByteLevelRegex,
    )
    .unwrap();
    let options = TokenizerOptions {
        cache_bytes,
        ..TokenizerOptions::default()
    };
    let tokenizer = PromptTokenizer::from_path_with(&dir, None, options).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    tokenizer
}

/// `messages` messages of about 4 KB each, all different.
fn conversation(messages: usize) -> ChatRequest {
    let messages: Vec<serde_json::Value> = (0..messages)
        .map(|i| {
            let content = format!("message {i}: the tide turns at the harbour wall. ").repeat(80);
            let role = if i % 2 == 0 { "user" } else { "assistant" };
            serde_json::json!({"role": role, "content": content})
        })
        .collect();
    ChatRequest::from_value(&serde_json::json!({"messages": messages})).unwrap()
}

#[test]
fn an_interrupt_that_never_fires_changes_nothing() {
    let tokenizer = tokenizer("same", 0);
    let request = conversation(6);
    let interrupt = Interrupt::new()
        .with_time_limit(Duration::from_secs(600))
        .with_max_text_bytes(1 << 20);
    assert_eq!(
        tokenizer.chat_tokens_until(&request, &interrupt).unwrap(),
        tokenizer.chat_tokens(&request).unwrap()
    );
    let completion = CompletionRequest::from_json(br#"{"prompt": "the tide turns"}"#).unwrap();
    assert_eq!(
        tokenizer
            .completion_tokens_until(&completion, &interrupt)
            .unwrap(),
        tokenizer.completion_tokens(&completion).unwrap()
    );
}

#[test]
fn a_cancel_from_another_thread_stops_at_the_next_segment() {
    let tokenizer = tokenizer("cancel", 0);
    let messages = 400;
    let request = conversation(messages);
    let interrupt = Interrupt::new();
    let result = std::thread::scope(|scope| {
        let work = scope.spawn(|| tokenizer.chat_tokens_until(&request, &interrupt));
        // Each message's text is a segment the (disabled) cache misses.
        while tokenizer.cache_stats().misses < 4 {
            assert!(!work.is_finished(), "finished before it could be cancelled");
            std::thread::sleep(Duration::from_millis(1));
        }
        interrupt.cancel();
        work.join().unwrap()
    });
    assert!(matches!(result, Err(Error::Cancelled)), "{result:?}");
    let misses = tokenizer.cache_stats().misses;
    assert!(
        misses < messages as u64 / 4,
        "{misses} segments tokenized of about {}",
        2 * messages
    );
}

#[test]
fn the_budgets_stop_the_work_before_it_starts() {
    let tokenizer = tokenizer("budget", 0);
    let request = conversation(4);
    let sized = Interrupt::new().with_max_text_bytes(1024);
    let err = tokenizer.chat_tokens_until(&request, &sized).unwrap_err();
    assert!(
        err.to_string()
            .contains("more than the tokenizing budget of 1024"),
        "{err}"
    );
    assert_eq!(tokenizer.cache_stats().misses, 0, "nothing tokenized");
    let completion =
        CompletionRequest::from_json(br#"{"prompt": "a prompt longer than eight bytes"}"#).unwrap();
    let small = Interrupt::new().with_max_text_bytes(8);
    assert!(matches!(
        tokenizer.completion_tokens_until(&completion, &small),
        Err(Error::OverBudget(_))
    ));
    let timed = Interrupt::new().with_time_limit(Duration::ZERO);
    let err = tokenizer.chat_tokens_until(&request, &timed).unwrap_err();
    assert!(matches!(err, Error::OverBudget(_)), "{err}");
    assert_eq!(tokenizer.cache_stats().misses, 0, "nothing tokenized");
}
