//! Shared helpers: trained models per (template family, tokenizer kind).

#![allow(dead_code, unreachable_pub)] // each test file uses a subset

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use prompt_tokens::testing::{TestTokenizerKind, write_model_dir};
use prompt_tokens::{FixedClock, PromptTokenizer, TemplateFamily, TokenizerOptions};

/// 2024-07-26 12:34:56 UTC.
pub const NOW: i64 = 1_721_997_296;

/// Default options with the fixed clock.
pub fn options() -> TokenizerOptions {
    TokenizerOptions {
        clock: Arc::new(FixedClock(NOW)),
        ..TokenizerOptions::default()
    }
}

type Key = (TemplateFamily, TestTokenizerKind);

struct Models {
    _root: tempfile::TempDir,
    dirs: HashMap<Key, PathBuf>,
}

static MODELS: OnceLock<Mutex<Models>> = OnceLock::new();

/// The directory of a trained model (trained once per test binary).
pub fn model_dir(family: TemplateFamily, kind: TestTokenizerKind) -> PathBuf {
    let models = MODELS.get_or_init(|| {
        Mutex::new(Models {
            _root: tempfile::tempdir().expect("temp dir"),
            dirs: HashMap::new(),
        })
    });
    let mut models = models.lock().expect("models lock");
    if let Some(dir) = models.dirs.get(&(family, kind)) {
        return dir.clone();
    }
    let dir = models
        ._root
        .path()
        .join(format!("{}-{kind:?}", family.name()));
    std::fs::create_dir_all(&dir).expect("model dir");
    write_model_dir(&dir, family, kind).expect("train model");
    models.dirs.insert((family, kind), dir.clone());
    dir
}

/// A fresh tokenizer (own cache) for a trained model.
pub fn tokenizer(family: TemplateFamily, kind: TestTokenizerKind) -> PromptTokenizer {
    PromptTokenizer::from_path_with(&model_dir(family, kind), None, options()).expect("load model")
}
