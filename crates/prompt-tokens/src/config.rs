//! Reading a model directory: `tokenizer.json`, `tokenizer_config.json` and
//! an optional chat template file.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::error::{Error, Result};
use crate::template::SpecialTokens;

/// What `tokenizer_config.json` says that matters for prompts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TokenizerConfig {
    /// The chat template: the string form, or the entry named `"default"` of
    /// the list-of-named-templates form.
    pub chat_template: Option<String>,
    /// `bos_token`, `eos_token`, `unk_token`, `pad_token` (a string or an
    /// object with `content`).
    pub special: SpecialTokens,
    /// `add_bos_token`, when given.
    pub add_bos_token: Option<bool>,
    /// `add_eos_token`, when given.
    pub add_eos_token: Option<bool>,
}

impl TokenizerConfig {
    /// Parses the JSON text of a `tokenizer_config.json`; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let invalid = |reason: String| Error::InvalidConfig {
            path: path.to_owned(),
            reason,
        };
        let json: Value = serde_json::from_str(text).map_err(|e| invalid(e.to_string()))?;
        let Value::Object(map) = json else {
            return Err(invalid("not a JSON object".into()));
        };
        let chat_template = match map.get("chat_template") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(Value::Array(list)) => {
                let mut default = None;
                for entry in list {
                    let name = entry.get("name").and_then(Value::as_str);
                    let template = entry.get("template").and_then(Value::as_str);
                    match (name, template) {
                        (Some("default"), Some(t)) => default = Some(t.to_owned()),
                        (Some(_), Some(_)) => {}
                        _ => {
                            return Err(invalid(
                                "chat_template list entries need string `name` and `template`"
                                    .into(),
                            ));
                        }
                    }
                }
                if default.is_none() {
                    return Err(invalid(
                        "chat_template is a list without a template named \"default\"".into(),
                    ));
                }
                default
            }
            Some(_) => return Err(invalid("chat_template must be a string or a list".into())),
        };
        let token = |name: &str| -> Result<Option<String>> {
            match map.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(Value::Object(o)) => match o.get("content") {
                    Some(Value::String(s)) => Ok(Some(s.clone())),
                    _ => Err(invalid(format!(
                        "{name}: object without a string `content`"
                    ))),
                },
                Some(_) => Err(invalid(format!("{name} must be a string or an object"))),
            }
        };
        let flag = |name: &str| -> Result<Option<bool>> {
            match map.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::Bool(b)) => Ok(Some(*b)),
                Some(_) => Err(invalid(format!("{name} must be a boolean"))),
            }
        };
        Ok(Self {
            chat_template,
            special: SpecialTokens {
                bos: token("bos_token")?,
                eos: token("eos_token")?,
                unk: token("unk_token")?,
                pad: token("pad_token")?,
            },
            add_bos_token: flag("add_bos_token")?,
            add_eos_token: flag("add_eos_token")?,
        })
    }
}

/// The files of a model found at a `--tokenizer-path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ModelFiles {
    pub(crate) tokenizer_json: PathBuf,
    pub(crate) config: TokenizerConfig,
    /// Where the chat template came from (for `describe`).
    pub(crate) template_origin: Option<PathBuf>,
}

pub(crate) fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            Error::MissingFile {
                path: path.to_owned(),
            }
        } else {
            Error::Io {
                path: path.to_owned(),
                source,
            }
        }
    })
}

/// A directory (with `tokenizer.json`, and optionally `tokenizer_config.json`
/// and `chat_template.jinja`) or a `tokenizer.json` file; then the override.
pub(crate) fn locate(path: &Path, chat_template_override: Option<&Path>) -> Result<ModelFiles> {
    let mut files = if path.is_dir() {
        let tokenizer_json = path.join("tokenizer.json");
        if !tokenizer_json.is_file() {
            return Err(Error::MissingFile {
                path: tokenizer_json,
            });
        }
        let config_path = path.join("tokenizer_config.json");
        let (config, mut template_origin) = if config_path.is_file() {
            let config = TokenizerConfig::parse(&read_text(&config_path)?, &config_path)?;
            let origin = config.chat_template.as_ref().map(|_| config_path.clone());
            (config, origin)
        } else {
            (TokenizerConfig::default(), None)
        };
        let mut config = config;
        // Newer checkpoints keep the template in its own file.
        let jinja = path.join("chat_template.jinja");
        if config.chat_template.is_none() && jinja.is_file() {
            config.chat_template = Some(read_text(&jinja)?);
            template_origin = Some(jinja);
        }
        ModelFiles {
            tokenizer_json,
            config,
            template_origin,
        }
    } else if path.is_file() {
        ModelFiles {
            tokenizer_json: path.to_owned(),
            config: TokenizerConfig::default(),
            template_origin: None,
        }
    } else {
        return Err(Error::MissingFile {
            path: path.to_owned(),
        });
    };
    if let Some(file) = chat_template_override {
        files.config.chat_template = Some(read_text(file)?);
        files.template_origin = Some(file.to_owned());
    }
    Ok(files)
}
