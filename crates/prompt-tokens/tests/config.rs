//! Loading models: directory and file forms, tokenizer_config.json's
//! variants, overrides, and the typed errors for what is missing or wrong.

mod common;

use std::path::Path;

use common::{model_dir, options};
use prompt_tokens::testing::{TestTokenizerKind, train_tokenizer_json};
use prompt_tokens::{
    ChatRequest, CompletionRequest, Error, PromptTokenizer, TemplateFamily, TokenizerConfig,
};
use serde_json::json;

fn user(text: &str) -> ChatRequest {
    ChatRequest::new(&json!([{"role": "user", "content": text}])).unwrap()
}

fn dir_with(config: serde_json::Value) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let json = train_tokenizer_json(
        TestTokenizerKind::ByteLevelRegex,
        TemplateFamily::ChatMl.special_tokens(),
        None,
    )
    .unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), json).unwrap();
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
    dir
}

#[test]
fn bos_and_eos_in_string_and_object_forms() {
    let config = TokenizerConfig::parse(
        r#"{"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": false}, "pad_token": null,
            "add_bos_token": true}"#,
        Path::new("x/tokenizer_config.json"),
    )
    .unwrap();
    assert_eq!(config.special.bos.as_deref(), Some("<s>"));
    assert_eq!(config.special.eos.as_deref(), Some("</s>"));
    assert_eq!(config.special.pad, None);
    assert_eq!(config.add_bos_token, Some(true));
    assert_eq!(config.add_eos_token, None);
    let bad = TokenizerConfig::parse(r#"{"bos_token": 3}"#, Path::new("cfg.json")).unwrap_err();
    assert!(matches!(bad, Error::InvalidConfig { ref path, .. } if path == Path::new("cfg.json")));
    assert!(bad.to_string().contains("cfg.json"));
}

#[test]
fn list_of_named_templates_picks_default() {
    let dir = dir_with(json!({"chat_template": [
        {"name": "tool_use", "template": "TOOLS"},
        {"name": "default", "template": "{{ messages[0].content }}!"}]}));
    let t = PromptTokenizer::from_path_with(dir.path(), None, options()).unwrap();
    assert_eq!(t.chat_text(&user("hey")).unwrap(), "hey!");
    let missing = TokenizerConfig::parse(
        r#"{"chat_template": [{"name": "rag", "template": "x"}]}"#,
        Path::new("c.json"),
    );
    assert!(matches!(missing, Err(Error::InvalidConfig { .. })));
}

#[test]
fn override_replaces_the_template_and_file_form_loads() {
    let dir = model_dir(TemplateFamily::ChatMl, TestTokenizerKind::ByteLevelRegex);
    let over = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(over.path(), "[{{ messages | length }}]").unwrap();
    let t = PromptTokenizer::from_path_with(&dir, Some(over.path()), options()).unwrap();
    assert_eq!(t.chat_text(&user("a")).unwrap(), "[1]");
    assert!(t.describe().contains(&over.path().display().to_string()));

    // tokenizer.json alone: tokenizes, but chat needs a template.
    let file = dir.join("tokenizer.json");
    let bare = PromptTokenizer::from_path_with(&file, None, options()).unwrap();
    assert!(!bare.text_tokens("hello", false).unwrap().is_empty());
    match bare.chat_tokens(&user("a")) {
        Err(Error::NoChatTemplate(path)) => assert_eq!(path, file),
        other => panic!("expected NoChatTemplate, got {other:?}"),
    }
    let with_override =
        PromptTokenizer::from_path_with(&file, Some(over.path()), options()).unwrap();
    assert_eq!(with_override.chat_text(&user("a")).unwrap(), "[1]");
}

#[test]
fn chat_template_jinja_file_is_read_when_config_has_none() {
    let dir = dir_with(json!({"eos_token": "<|im_end|>"}));
    std::fs::write(dir.path().join("chat_template.jinja"), "{{ eos_token }}").unwrap();
    let t = PromptTokenizer::from_path_with(dir.path(), None, options()).unwrap();
    assert_eq!(t.chat_text(&user("x")).unwrap(), "<|im_end|>");
}

#[test]
fn missing_files_are_typed_errors_naming_the_path() {
    let empty = tempfile::tempdir().unwrap();
    match PromptTokenizer::from_path(empty.path(), None) {
        Err(Error::MissingFile { path }) => assert_eq!(path, empty.path().join("tokenizer.json")),
        other => panic!("{other:?}"),
    }
    let nowhere = empty.path().join("nope");
    match PromptTokenizer::from_path(&nowhere, None) {
        Err(Error::MissingFile { path }) => assert_eq!(path, nowhere),
        other => panic!("{other:?}"),
    }
    let dir = model_dir(TemplateFamily::ChatMl, TestTokenizerKind::Gpt2);
    let missing_override = empty.path().join("t.jinja");
    match PromptTokenizer::from_path(&dir, Some(&missing_override)) {
        Err(Error::MissingFile { path }) => assert_eq!(path, missing_override),
        other => panic!("{other:?}"),
    }
    std::fs::write(empty.path().join("tokenizer.json"), "{not json").unwrap();
    match PromptTokenizer::from_path(empty.path(), None) {
        Err(Error::InvalidTokenizer { path, .. }) => {
            assert_eq!(path, empty.path().join("tokenizer.json"))
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn completions_text_and_token_prompts() {
    let dir = model_dir(TemplateFamily::Llama3, TestTokenizerKind::ByteLevelRegex);
    let t = PromptTokenizer::from_path_with(&dir, None, options()).unwrap();
    let raw = tokenizers::Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let bos = raw.token_to_id("<|begin_of_text|>").unwrap();
    let text = CompletionRequest::from_json(br#"{"prompt": "The router sends"}"#).unwrap();
    let ids = t.completion_tokens(&text).unwrap();
    assert_eq!(
        ids[0], bos,
        "vLLM adds special tokens to text prompts by default"
    );
    assert_eq!(
        &ids[1..],
        &t.text_tokens("The router sends", false).unwrap()[..]
    );
    let raw_ids = raw
        .encode("The router sends", true)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(ids, raw_ids);
    let no_special = CompletionRequest::from_json(
        br#"{"prompt": "The router sends", "add_special_tokens": false}"#,
    )
    .unwrap();
    assert_eq!(t.completion_tokens(&no_special).unwrap(), &ids[1..]);
    let tokens = CompletionRequest::from_json(br#"{"prompt": [[7, 8, 9]]}"#).unwrap();
    assert_eq!(t.completion_tokens(&tokens).unwrap(), vec![7, 8, 9]);
}

#[test]
fn add_bos_token_flag_in_config_decides_completion_special_tokens() {
    // The tokenizer.json post-processor adds nothing here (trained with no
    // BOS); tokenizer_config.json's add_bos_token asks for one.
    let dir = dir_with(json!({"bos_token": "<|endoftext|>", "add_bos_token": true}));
    let t = PromptTokenizer::from_path_with(dir.path(), None, options()).unwrap();
    let raw = tokenizers::Tokenizer::from_file(dir.path().join("tokenizer.json")).unwrap();
    let bos = raw.token_to_id("<|endoftext|>").unwrap();
    let ids = t
        .completion_tokens(&CompletionRequest::text("hi there"))
        .unwrap();
    assert_eq!(ids[0], bos);
    assert_eq!(&ids[1..], &t.text_tokens("hi there", false).unwrap()[..]);
}
