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
    let missing_template = dir.path().join("missing.jinja");
    let missing_template = missing_template.to_str().unwrap();
    let cases: [(Vec<&str>, &str, &str); 4] = [
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
