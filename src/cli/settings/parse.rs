//! Steps 1 and 2: clap's parse of the command line, then the `--config`
//! file filling what the command line left out. Each error here names the
//! key or table at fault, since a bad file would otherwise be reported as a
//! bad setting somewhere else.

use super::CliError;
use crate::cli::args::{Args, ContentFormatName};
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches};
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::OsString;

/// The flags after parsing and after merging the `--config` file, with the
/// set of settings given explicitly (on the command line or in the file).
#[derive(Debug, Clone)]
pub struct Parsed {
    /// The settings.
    pub args: Args,
    /// Ids (field names) of the settings given explicitly.
    pub explicit: BTreeSet<String>,
    /// The config file's `[models."ID"]` tables: a tokenizer per model.
    pub models: BTreeMap<String, ModelTokenizer>,
    /// The config file's `[workers."URL"]` tables: per-worker settings.
    pub workers: BTreeMap<String, WorkerSettings>,
}

/// One `[workers."URL"]` table of a `--config` file: where that worker
/// publishes its KV events, when not at `--kv-events-port` /
/// `--kv-events-replay-port` of its host. Each key is one endpoint (rank
/// 0's, data-parallel rank r at its port + r) or a list, one per rank in
/// rank order; `--kv-event-source`, `--pd-kv-events` and
/// `--kv-event-replay-source` replace the key they correspond to.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerSettings {
    /// The publisher(s), e.g. `tcp://10.0.0.5:6000`.
    #[serde(alias = "kv-events-endpoint", deserialize_with = "one_or_many")]
    pub kv_events_endpoint: Vec<String>,
    /// The replay socket(s) (none: no replay).
    #[serde(
        default,
        alias = "kv-events-replay-endpoint",
        deserialize_with = "one_or_many"
    )]
    pub kv_events_replay_endpoint: Vec<String>,
}

/// A string, or a list of strings.
fn one_or_many<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Vec<String>, D::Error> {
    struct OneOrMany;
    impl<'de> serde::de::Visitor<'de> for OneOrMany {
        type Value = Vec<String>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("an endpoint \"tcp://HOST:PORT\" or a list of them, one per rank")
        }

        fn visit_str<E: serde::de::Error>(self, value: &str) -> Result<Self::Value, E> {
            Ok(vec![value.to_owned()])
        }

        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut all = Vec::new();
            while let Some(one) = seq.next_element::<String>()? {
                all.push(one);
            }
            Ok(all)
        }
    }
    deserializer.deserialize_any(OneOrMany)
}

/// One `[models."ID"]` table of a `--config` file: the tokenizer requests
/// naming that model route with.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelTokenizer {
    /// As `--tokenizer-path`: a model directory or a tokenizer.json file.
    #[serde(alias = "tokenizer-path")]
    pub tokenizer_path: String,
    /// As `--chat-template`.
    #[serde(default, alias = "chat-template")]
    pub chat_template: Option<String>,
    /// As `--chat-template-content-format`; unset: the command line's.
    #[serde(default, alias = "chat-template-content-format")]
    pub chat_template_content_format: Option<ContentFormatName>,
}

impl Parsed {
    /// Whether the setting `id` was given explicitly.
    pub fn is_explicit(&self, id: &str) -> bool {
        self.explicit.contains(id)
    }
}

/// Parses `argv` (program name first) and merges the `--config` file.
pub fn parse_from<I, T>(argv: I) -> Result<Parsed, CliError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let matches = Args::command().try_get_matches_from(argv)?;
    let args = Args::from_arg_matches(&matches)?;
    let explicit: BTreeSet<String> = matches
        .ids()
        .filter(|id| {
            matches!(
                matches.value_source(id.as_str()),
                Some(ValueSource::CommandLine | ValueSource::EnvVariable)
            )
        })
        .map(|id| id.as_str().to_owned())
        .collect();
    let mut parsed = Parsed {
        args,
        explicit,
        models: BTreeMap::new(),
        workers: BTreeMap::new(),
    };
    if let Some(path) = parsed.args.config.clone() {
        let text = std::fs::read_to_string(&path)
            .map_err(|err| CliError::invalid("config", format!("cannot read {path}: {err}")))?;
        merge_file(&mut parsed, &text)
            .map_err(|message| CliError::invalid("config", format!("{path}: {message}")))?;
    }
    Ok(parsed)
}

/// Fills every setting of `parsed` not given on the command line from the
/// TOML `text`. A file key counts as given explicitly when its value
/// differs from the default.
fn merge_file(parsed: &mut Parsed, text: &str) -> Result<(), String> {
    let file: toml::Table = text
        .parse()
        .map_err(|err: toml::de::Error| err.to_string())?;
    let known = crate::cli::args::flag_ids();
    let mut merged = toml::Table::try_from(&parsed.args).map_err(|err| err.to_string())?;
    for (key, value) in file {
        let id = key.replace('-', "_");
        if id == "models" {
            parsed.models = tables_of("models", value)?;
            continue;
        }
        if id == "workers" {
            parsed.workers = tables_of("workers", value)?;
            continue;
        }
        if id == "config" || !known.contains(&id) {
            return Err(format!("unknown setting `{key}`"));
        }
        if parsed.explicit.contains(&id) {
            continue;
        }
        // A key that only restates the default (a dumped configuration
        // does) selects nothing: it neither switches modes nor counts as a
        // P/D or ignored flag.
        if merged.get(&id) != Some(&value) {
            parsed.explicit.insert(id.clone());
        }
        merged.insert(id, value);
    }
    let config = parsed.args.config.take();
    let mut args: Args = match toml::Value::Table(merged.clone()).try_into() {
        Ok(args) => args,
        Err(err) => return Err(name_the_bad_key(&parsed.args, &merged, &err)),
    };
    args.config = config;
    parsed.args = args;
    Ok(())
}

/// Reads a `[section."ID"]` group of tables, each on its own so that an
/// error names the table and, where one key alone is at fault, the key.
fn tables_of<T: serde::de::DeserializeOwned>(
    section: &str,
    value: toml::Value,
) -> Result<BTreeMap<String, T>, String> {
    let toml::Value::Table(tables) = value else {
        return Err(format!("[{section}]: expected tables, one per ID"));
    };
    let mut read = BTreeMap::new();
    for (id, table) in tables {
        match table.clone().try_into::<T>() {
            Ok(entry) => {
                read.insert(id, entry);
            }
            Err(err) => {
                let fault = the_faulty_key::<T>(&table).unwrap_or_else(|| err.message().to_owned());
                return Err(format!("[{section}.{id:?}]: {fault}"));
            }
        }
    }
    Ok(read)
}

/// The first key of `table` whose value alone fails to deserialize as a
/// `T`, with the reason; a missing required key is not such a fault.
fn the_faulty_key<T: serde::de::DeserializeOwned>(table: &toml::Value) -> Option<String> {
    let toml::Value::Table(table) = table else {
        return None;
    };
    table.iter().find_map(|(key, value)| {
        let single = toml::Table::from_iter([(key.clone(), value.clone())]);
        let err = toml::Value::Table(single).try_into::<T>().err()?;
        let message = err.message();
        (!message.starts_with("missing field")).then(|| format!("`{key}`: {message}"))
    })
}

/// Finds which key of a merged table fails to deserialize, for a message
/// that names it.
fn name_the_bad_key(defaults: &Args, merged: &toml::Table, err: &toml::de::Error) -> String {
    let base = toml::Table::try_from(defaults).unwrap_or_default();
    for (key, value) in merged {
        if base.get(key) == Some(value) {
            continue;
        }
        let mut single = base.clone();
        single.insert(key.clone(), value.clone());
        if let Err(err) = toml::Value::Table(single).try_into::<Args>() {
            return format!("setting `{key}`: {}", err.message());
        }
    }
    err.message().to_owned()
}

/// Renders `args` as a `--config` file.
pub fn to_toml(args: &Args) -> String {
    toml::to_string(args).unwrap_or_default()
}
