//! `--tokenizer-path`, `--chat-template` and the config file's
//! `[models."ID"]` tables: which models route on token ids, and a clear
//! error naming the flag for every bad path.

use affinity_router::cli::Settings;
use prompt_tokens::TemplateFamily;
use prompt_tokens::testing::{TestTokenizerKind, write_model_dir};
use std::path::Path;

fn settings(args: &[&str]) -> Result<Settings, affinity_router::cli::CliError> {
    Settings::from_args(std::iter::once("router").chain(args.iter().copied()))
}

fn model_dir(family: TemplateFamily) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_model_dir(dir.path(), family, TestTokenizerKind::ByteLevelRegex).unwrap();
    dir
}

const WORKER: [&str; 2] = ["--worker-urls", "http://127.0.0.1:9"];

fn with_worker<'a>(args: &[&'a str]) -> Vec<&'a str> {
    WORKER.iter().copied().chain(args.iter().copied()).collect()
}

#[test]
fn without_a_tokenizer_real_workers_route_on_text_and_simulated_ones_on_tokens() {
    let real = settings(&WORKER).unwrap();
    assert!(real.router.tokenizers.is_empty());
    assert_eq!(real.router.tokenizers.mode("m"), "text");
    // The demo's engines tokenize with engine-sim's synthetic rule; the
    // router computes the same ids.
    for simulated in [&["--sim-workers", "2"][..], &["--sim-pd", "1:1"]] {
        let s = settings(simulated).unwrap();
        let entry = s
            .router
            .tokenizers
            .for_model("sim-model")
            .expect("synthetic");
        assert!(entry.tokenizer().is_synthetic(), "{simulated:?}");
    }
}

#[test]
fn tokenizer_path_serves_every_model() {
    let dir = model_dir(TemplateFamily::Llama3);
    let path = dir.path().to_str().unwrap();
    let s = settings(&with_worker(&["--tokenizer-path", path])).unwrap();
    let entry = s.router.tokenizers.for_model("whatever").expect("default");
    assert!(!entry.tokenizer().is_synthetic());
    assert_eq!(s.router.tokenizers.mode("another"), "tokens");
    // A tokenizer.json file works as well as its directory.
    let file = dir.path().join("tokenizer.json");
    let s = settings(&with_worker(&["--tokenizer-path", file.to_str().unwrap()])).unwrap();
    assert_eq!(s.router.tokenizers.mode("m"), "tokens");
}

#[test]
fn bad_paths_and_templates_name_their_flag() {
    let dir = model_dir(TemplateFamily::ChatMl);
    let path = dir.path().to_str().unwrap();
    let broken = dir.path().join("broken.jinja");
    std::fs::write(&broken, "{% for m in messages %}{{ m.content }").unwrap();
    let broken = broken.to_str().unwrap();
    let unsupported = dir.path().join("unsupported.jinja");
    std::fs::write(
        &unsupported,
        "{% for m in messages %}\n{{ m.content | urlize }}\n{% endfor %}",
    )
    .unwrap();
    let unsupported = unsupported.to_str().unwrap();
    let missing_template = dir.path().join("missing.jinja");
    let missing_template = missing_template.to_str().unwrap();
    let cases: [(Vec<&str>, &str, &str); 6] = [
        // Refused at start, naming the file, the line and the construct.
        (
            with_worker(&["--tokenizer-path", path, "--chat-template", unsupported]),
            "--chat-template: ",
            "unsupported.jinja: chat template line 2: the filter `urlize`",
        ),
        (
            with_worker(&["--tokenizer-path", path, "--chat-template", broken]),
            "--chat-template: ",
            "broken.jinja",
        ),
        (
            with_worker(&["--tokenizer-path", "/nonexistent/model"]),
            "--tokenizer-path: ",
            "/nonexistent/model",
        ),
        (
            with_worker(&["--tokenizer-path", path, "--chat-template", broken]),
            "--chat-template: ",
            "syntax",
        ),
        (
            with_worker(&[
                "--tokenizer-path",
                path,
                "--chat-template",
                missing_template,
            ]),
            "--chat-template: ",
            "missing.jinja",
        ),
        (
            with_worker(&["--chat-template", broken]),
            "--chat-template: ",
            "needs --tokenizer-path",
        ),
    ];
    for (argv, prefix, words) in cases {
        let err = settings(&argv).expect_err(&format!("{argv:?}"));
        assert_eq!(err.exit_code(), 2);
        let message = err.to_string();
        assert!(message.starts_with(prefix), "{argv:?}: {message}");
        assert!(message.contains(words), "{argv:?}: {message}");
    }
}

fn config_file(dir: &Path, text: &str) -> String {
    let path = dir.join("router.toml");
    std::fs::write(&path, text).unwrap();
    path.to_str().unwrap().to_owned()
}

#[test]
fn models_tables_give_each_model_its_tokenizer() {
    let llama = model_dir(TemplateFamily::Llama3);
    let mistral = model_dir(TemplateFamily::Mistral);
    let config = config_file(
        llama.path(),
        &format!(
            "worker-urls = [\"http://127.0.0.1:9\"]\n\
             [models.\"meta-llama/Llama-3.1-8B-Instruct\"]\n\
             tokenizer_path = {:?}\n\
             [models.mistral]\n\
             tokenizer-path = {:?}\n",
            llama.path(),
            mistral.path()
        ),
    );
    let s = settings(&["--config", &config]).unwrap();
    let tokenizers = &s.router.tokenizers;
    assert_eq!(
        tokenizers.mode("meta-llama/Llama-3.1-8B-Instruct"),
        "tokens"
    );
    assert_eq!(tokenizers.mode("mistral"), "tokens");
    assert_eq!(
        tokenizers.mode("other"),
        "text",
        "no default without --tokenizer-path"
    );
    let models: Vec<&str> = tokenizers.entries().map(|(model, _)| model).collect();
    assert_eq!(models, ["meta-llama/Llama-3.1-8B-Instruct", "mistral"]);

    // A bad table names the model and the problem.
    for (table, words) in [
        (
            "[models.m]\ntokenizer_path = \"/nonexistent\"\n",
            "[models.\"m\"]",
        ),
        ("[models.m]\ntokenizer = \"x\"\n", "unknown field"),
        ("[models.m]\nchat_template = \"x\"\n", "tokenizer_path"),
    ] {
        let config = config_file(mistral.path(), table);
        let message = settings(&["--config", &config]).unwrap_err().to_string();
        assert!(message.starts_with("--config: "), "{message}");
        assert!(message.contains(words), "{table}: {message}");
    }
}

#[test]
fn the_content_format_flag_and_tables_reach_the_template() {
    let dir = model_dir(TemplateFamily::ChatMl);
    let path = dir.path().to_str().unwrap();
    let request = prompt_tokens::ChatRequest::from_json(
        br#"{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#,
    )
    .unwrap();
    let tokens_with = |argv: &[&str]| {
        let s = settings(&with_worker(argv)).unwrap();
        let tokenizer = s
            .router
            .tokenizers
            .for_model("m")
            .unwrap()
            .tokenizer()
            .clone();
        (
            tokenizer.describe(),
            tokenizer.chat_tokens(&request).unwrap(),
        )
    };
    // ChatML prints `message.content`: detected as string content.
    let (auto, auto_ids) = tokens_with(&["--tokenizer-path", path]);
    assert!(auto.contains("(string content)"), "{auto}");
    let (string, string_ids) = tokens_with(&[
        "--tokenizer-path",
        path,
        "--chat-template-content-format",
        "string",
    ]);
    assert!(string.contains("(string content)"), "{string}");
    assert_eq!(string_ids, auto_ids);
    // Forced to openai, the template prints the parts list: other ids.
    let (openai, openai_ids) = tokens_with(&[
        "--tokenizer-path",
        path,
        "--chat-template-content-format",
        "openai",
    ]);
    assert!(openai.contains("(openai content)"), "{openai}");
    assert_ne!(openai_ids, auto_ids);

    // A table's own setting wins over the flag.
    let config = config_file(
        dir.path(),
        &format!(
            "worker-urls = [\"http://127.0.0.1:9\"]\n\
             chat-template-content-format = \"openai\"\n\
             [models.m]\n\
             tokenizer_path = {path:?}\n\
             chat_template_content_format = \"string\"\n\
             [models.n]\n\
             tokenizer_path = {path:?}\n"
        ),
    );
    let s = settings(&["--config", &config]).unwrap();
    let describe = |model: &str| {
        s.router
            .tokenizers
            .for_model(model)
            .unwrap()
            .tokenizer()
            .describe()
    };
    assert!(
        describe("m").contains("(string content)"),
        "{}",
        describe("m")
    );
    assert!(
        describe("n").contains("(openai content)"),
        "{}",
        describe("n")
    );

    // Bad values and a flag with no template to apply to are refused by name.
    let err = settings(&with_worker(&[
        "--tokenizer-path",
        path,
        "--chat-template-content-format",
        "json",
    ]))
    .unwrap_err();
    assert_eq!(err.exit_code(), 2);
    assert!(err.to_string().contains("json"), "{err}");
    let err = settings(&with_worker(&["--chat-template-content-format", "openai"])).unwrap_err();
    assert_eq!(err.exit_code(), 2);
    assert!(
        err.to_string()
            .starts_with("--chat-template-content-format: needs --tokenizer-path"),
        "{err}"
    );
    let config = config_file(
        dir.path(),
        &format!("[models.m]\ntokenizer_path = {path:?}\nchat_template_content_format = \"x\"\n"),
    );
    let message = settings(&["--config", &config]).unwrap_err().to_string();
    assert!(message.starts_with("--config: "), "{message}");
    assert!(
        message.contains("chat_template_content_format"),
        "{message}"
    );
}
