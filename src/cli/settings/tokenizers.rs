//! The tokenizers requests route with, loaded at start so that a bad path
//! or template stops the router naming the flag (or `[models."ID"]` table)
//! at fault, and the tokenizer pool's budget.

use super::parse::Parsed;
use super::{CliError, Mode};
use crate::cli::args::{Args, ContentFormatName};
use prompt_tokens::PromptTokenizer;
use router_http::tokens::{TokenizeConfig, Tokenizers};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The tokenizers of `--tokenizer-path` / `--chat-template` and the config
/// file's `[models."ID"]` tables, loaded now so that a bad path stops the
/// start with a message naming it. Simulated engines without a
/// `--tokenizer-path` get their own synthetic tokenizer, so the demo routes
/// on the same token ids its engines compute.
pub(super) fn tokenizers(parsed: &Parsed, mode: &Mode) -> Result<Tokenizers, CliError> {
    let a = &parsed.args;
    let load = |flag: &str, path: &str, template: Option<&str>, format: ContentFormatName| {
        let options = prompt_tokens::TokenizerOptions {
            content_format: format.format(),
            ..prompt_tokens::TokenizerOptions::default()
        };
        PromptTokenizer::from_path_with(Path::new(path), template.map(Path::new), options)
            .map(Arc::new)
            .map_err(|err| {
                // Name the file at fault: the template's problems are
                // --chat-template's.
                let template_at_fault = match (&err, template) {
                    (
                        prompt_tokens::Error::TemplateSyntax(_)
                        | prompt_tokens::Error::TemplateTooLarge { .. }
                        | prompt_tokens::Error::TemplateUnsupported { .. },
                        Some(_),
                    ) => true,
                    (
                        prompt_tokens::Error::MissingFile { path }
                        | prompt_tokens::Error::Io { path, .. },
                        Some(template),
                    ) => path == Path::new(template),
                    _ => false,
                };
                let flag = if template_at_fault && flag != "config" {
                    "chat_template"
                } else {
                    flag
                };
                // The template's own problems name the file it came from:
                // the --chat-template file, or the tokenizer's config.
                let template_error = matches!(
                    err,
                    prompt_tokens::Error::TemplateSyntax(_)
                        | prompt_tokens::Error::TemplateTooLarge { .. }
                        | prompt_tokens::Error::TemplateUnsupported { .. }
                );
                let message = match template {
                    Some(template) if template_at_fault => format!("{template}: {err}"),
                    None if template_error => format!("{path} (its chat template): {err}"),
                    _ => err.to_string(),
                };
                CliError::invalid(flag, message)
            })
    };
    if a.tokenizer_path.is_none()
        && parsed.models.is_empty()
        && a.chat_template_content_format != ContentFormatName::Auto
    {
        return Err(CliError::invalid(
            "chat_template_content_format",
            "needs --tokenizer-path or [models.\"ID\"] tables (the chat template it applies to)",
        ));
    }
    let mut tokenizers = Tokenizers::default();
    for (model, files) in &parsed.models {
        let tokenizer = load(
            "config",
            &files.tokenizer_path,
            files.chat_template.as_deref(),
            files
                .chat_template_content_format
                .unwrap_or(a.chat_template_content_format),
        )
        .map_err(|err| match err {
            CliError::Invalid { flag, message } => CliError::Invalid {
                flag,
                message: format!("[models.{model:?}]: {message}"),
            },
            other => other,
        })?;
        tokenizers = tokenizers.with_model(model.clone(), tokenizer);
    }
    match (&a.tokenizer_path, &a.chat_template) {
        (Some(path), template) => {
            let tokenizer = load(
                "tokenizer_path",
                path,
                template.as_deref(),
                a.chat_template_content_format,
            )?;
            tokenizers = tokenizers.with_default(tokenizer);
        }
        (None, Some(_)) => {
            return Err(CliError::invalid(
                "chat_template",
                "needs --tokenizer-path (the tokenizer the rendering is tokenized with)",
            ));
        }
        (None, None) if matches!(mode, Mode::Simulated { .. } | Mode::SimulatedPd { .. }) => {
            let chars_per_token = engine_sim::ModelConfig::default().chars_per_token;
            tokenizers =
                tokenizers.with_default(Arc::new(PromptTokenizer::synthetic(chars_per_token)));
        }
        (None, None) => {}
    }
    Ok(tokenizers)
}

/// The tokenizer pool and the budget of one prompt
/// (`--tokenizer-threads`, `--tokenize-*`), checked in `check_ranges`.
pub(super) fn tokenize_config(a: &Args) -> TokenizeConfig {
    let defaults = TokenizeConfig::default();
    TokenizeConfig {
        threads: a.tokenizer_threads.unwrap_or(defaults.threads),
        max_bytes: a.tokenize_max_bytes,
        max_time: Duration::from_secs_f64(a.tokenize_max_secs),
        inline_bytes: a.tokenize_inline_bytes,
    }
}
