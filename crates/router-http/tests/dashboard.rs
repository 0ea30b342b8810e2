//! The Grafana dashboard (`deploy/grafana/affinity-router.json`) queries
//! only metric families the router exports: a router with every optional
//! family turned on (`kv_aware` on the engines' KV events, routing on token
//! ids through the tokenizer pool, the engine load poll) serves a few
//! requests, its `/metrics` is scraped over HTTP, and so is a P/D router's
//! (the `router_pd_*` families exist only in P/D mode); every metric name
//! in every PromQL expression of the dashboard (panels and variables) must
//! be a family of the scrape of the router that has it. The same requests show the
//! decision counters and the match-rate histogram moving under `kv_aware`.
//! The `router_trace_*` families exist only with the `otel` feature (its
//! trace pipeline's metrics source): built with it, the `kv_aware` router
//! carries that source and they are checked like the others; without it,
//! they are left out.
#![cfg(all(feature = "kv-events", feature = "tokens"))]

mod common;

use common::{Fixture, call};
use engine_sim::{EngineConfig, EngineHandle, Role, ServeOptions, TransferRegistry};
use http::StatusCode;
use lb_policies::PolicyConfig;
use prompt_tokens::PromptTokenizer;
use router_http::tokens::Tokenizers;
use router_http::{PdConfig, PdConnector, PdWorkerConfig, RouterConfig};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

/// The dashboard, read from the repository at run time.
fn dashboard() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/grafana/affinity-router.json"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|err| panic!("{path}: {err}"));
    serde_json::from_str(&text).unwrap_or_else(|err| panic!("{path} is not JSON: {err}"))
}

/// PromQL words that are not metric names when they are not followed by
/// `(`: aggregation operators (`sum by (x) (...)`), set and comparison
/// keywords, and the special float values.
const KEYWORDS: &[&str] = &[
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "atan2",
    "inf",
    "nan",
];

/// Words followed by a list of label names in parentheses.
const LABEL_LISTS: &[&str] = &[
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
];

/// The metric names a PromQL expression reads, in order: identifiers
/// outside label matchers (`{...}`), ranges (`[...]`), strings and label
/// lists (`by (...)`), that are neither functions (followed by `(`) nor
/// keywords. Suffixes such as `_bucket` are kept.
fn metric_names(expr: &str) -> Vec<String> {
    let chars: Vec<char> = expr.chars().collect();
    let mut names = Vec::new();
    let mut i = 0;
    // Skips from an opening `open` to just past its matching `close`,
    // stepping over quoted strings.
    let skip_group = |mut i: usize, open: char, close: char| -> usize {
        let mut depth = 0usize;
        while i < chars.len() {
            match chars[i] {
                '"' | '\'' | '`' => i = skip_string(&chars, i),
                c if c == open => {
                    depth += 1;
                    i += 1;
                }
                c if c == close => {
                    depth -= 1;
                    i += 1;
                    if depth == 0 {
                        return i;
                    }
                }
                _ => i += 1,
            }
        }
        panic!("unbalanced {open}{close} in {expr:?}");
    };
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = skip_string(&chars, i);
        } else if c == '{' {
            i = skip_group(i, '{', '}');
        } else if c == '[' {
            i = skip_group(i, '[', ']');
        } else if c.is_ascii_digit() || c == '.' {
            // Numbers and durations (`0.99`, `1e3`, `5m`).
            while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                i += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == ':')
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            let mut next = i;
            while next < chars.len() && chars[next].is_whitespace() {
                next += 1;
            }
            let called = chars.get(next) == Some(&'(');
            if LABEL_LISTS.contains(&word.as_str()) {
                if called {
                    i = skip_group(next, '(', ')');
                }
            } else if !called && !KEYWORDS.contains(&word.to_ascii_lowercase().as_str()) {
                names.push(word);
            }
        } else {
            i += 1;
        }
    }
    names
}

/// The index just past the string literal that starts at `i`.
fn skip_string(chars: &[char], i: usize) -> usize {
    let quote = chars[i];
    let mut j = i + 1;
    while j < chars.len() {
        match chars[j] {
            '\\' if quote != '`' => j += 2,
            c if c == quote => return j + 1,
            _ => j += 1,
        }
    }
    panic!(
        "unterminated string in {:?}",
        chars.iter().collect::<String>()
    );
}

#[test]
fn metric_names_skip_functions_matchers_ranges_and_label_lists() {
    let names = |expr| metric_names(expr);
    assert_eq!(
        names(
            "histogram_quantile(0.99, sum by (le, route) \
             (rate(router_request_header_seconds_bucket{job=~\"$job\",route!=\"a{b}\"}[$__rate_interval])))"
        ),
        ["router_request_header_seconds_bucket"]
    );
    assert_eq!(
        names(
            "sum without(url) (a_total) / on (model) group_left(pool) b > bool 0.5 or c offset 5m"
        ),
        ["a_total", "b", "c"]
    );
    assert_eq!(
        names("label_values(router_in_flight_requests, job)"),
        ["router_in_flight_requests", "job"]
    );
    assert_eq!(names("sum(rate(x[5m:1m])) > Inf"), ["x"]);
}

/// Every PromQL expression of the dashboard, with where it is: each
/// panel's targets (rows' nested panels included) and each query variable.
fn expressions(dashboard: &Value) -> Vec<(String, String)> {
    fn walk(panels: &Value, out: &mut Vec<(String, String)>) {
        for panel in panels.as_array().into_iter().flatten() {
            let title = panel["title"].as_str().unwrap_or("?");
            for target in panel["targets"].as_array().into_iter().flatten() {
                let expr = target["expr"]
                    .as_str()
                    .unwrap_or_else(|| panic!("panel {title:?}: a target without expr"));
                out.push((format!("panel {title:?}"), expr.to_owned()));
            }
            walk(&panel["panels"], out);
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    for variable in dashboard["templating"]["list"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if variable["type"] == "query" {
            let query = match &variable["query"] {
                Value::String(query) => query.as_str(),
                query => query["query"].as_str().unwrap_or(""),
            };
            out.push((format!("variable {}", variable["name"]), query.to_owned()));
        }
    }
    out
}

/// The Grafana 10 shape the import needs: a schema version Grafana 10
/// writes, a Prometheus data source variable that every panel and target
/// uses, unique panel ids, and a query in every non-row panel.
#[test]
fn the_dashboard_is_grafana_10_with_a_prometheus_datasource_variable() {
    let dashboard = dashboard();
    assert!(dashboard["schemaVersion"].as_u64().unwrap() >= 38);
    assert_eq!(dashboard["uid"], "affinity-router");
    let variables = dashboard["templating"]["list"].as_array().unwrap();
    assert!(
        variables.iter().any(|v| v["type"] == "datasource"
            && v["name"] == "datasource"
            && v["query"] == "prometheus"),
        "no Prometheus data source variable"
    );
    let mut ids = BTreeSet::new();
    let mut queried = 0;
    let mut stack: Vec<&Value> = dashboard["panels"].as_array().unwrap().iter().collect();
    while let Some(panel) = stack.pop() {
        let title = panel["title"].as_str().unwrap();
        assert!(
            ids.insert(panel["id"].as_u64().unwrap()),
            "panel id repeats: {title:?}"
        );
        if panel["type"] == "row" {
            stack.extend(panel["panels"].as_array().unwrap());
            continue;
        }
        assert_eq!(panel["datasource"]["uid"], "${datasource}", "{title:?}");
        let targets = panel["targets"].as_array().unwrap();
        assert!(!targets.is_empty(), "{title:?} queries nothing");
        for target in targets {
            assert_eq!(target["datasource"]["uid"], "${datasource}", "{title:?}");
        }
        queried += 1;
    }
    assert!(queried >= 20, "{queried} panels");
}

/// Adds the families of a scrape to `families`: name and `# TYPE`.
fn add_families(families: &mut BTreeMap<String, String>, text: &str) {
    for rest in text.lines().filter_map(|line| line.strip_prefix("# TYPE ")) {
        let (name, kind) = rest.split_once(' ').expect("# TYPE name type");
        families.insert(name.to_owned(), kind.to_owned());
    }
}

/// Whether the scrape has a family `name` reads: a counter or gauge by its
/// name, a histogram by its `_bucket`, `_sum` or `_count` series.
fn exported(families: &BTreeMap<String, String>, name: &str) -> bool {
    if let Some(kind) = families.get(name) {
        return kind != "histogram";
    }
    ["_bucket", "_sum", "_count"].iter().any(|suffix| {
        name.strip_suffix(suffix)
            .is_some_and(|base| families.get(base).is_some_and(|kind| kind == "histogram"))
    })
}

/// Scrapes `/metrics` of the router at `addr`.
async fn scrape(addr: std::net::SocketAddr) -> String {
    let (status, _, body) = call(addr, "GET", "/metrics", &[], "").await;
    assert_eq!(status, StatusCode::OK);
    String::from_utf8(body.to_vec()).unwrap()
}

/// Serves one chat through a P/D router (NIXL, one prefill and one decode
/// engine-sim engine sharing a transfer registry) and returns its
/// `/metrics`.
async fn pd_scrape() -> String {
    let registry = TransferRegistry::new();
    let (kv, mode) = fleet_sim::for_deployment(PdConnector::Nixl).unwrap();
    let mut engines = Vec::new();
    for (role, id) in [(Role::Prefill, "prefill-0"), (Role::Decode, "decode-0")] {
        let config = EngineConfig {
            role,
            kv_connector: kv,
            moriio_mode: mode,
            engine_id: Some(id.to_owned()),
            ..EngineConfig::instant()
        };
        let options = ServeOptions {
            registry: Some(registry.clone()),
            ..ServeOptions::default()
        };
        engines.push(engine_sim::spawn(config, options).await.unwrap());
    }
    let mut pd = PdConfig::new(PdConnector::Nixl);
    pd.prefill = vec![PdWorkerConfig::new(engines[0].url())];
    pd.decode = vec![PdWorkerConfig::new(engines[1].url())];
    let config = RouterConfig {
        pd: Some(pd),
        ..RouterConfig::default()
    };
    let fixture = Fixture::start_with_urls(config, engines, &[]).await;
    let (status, _, body) = call(
        fixture.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        common::chat_body("one P/D request", false),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let text = scrape(fixture.addr).await;
    assert_eq!(sum_of(&text, "router_pd_requests_total", ""), 1.0, "{text}");
    fixture.shutdown().await;
    text
}

/// The sum of the samples of `family` whose labels contain `matcher`.
fn sum_of(text: &str, family: &str, matcher: &str) -> f64 {
    text.lines()
        .filter(|line| {
            line.strip_prefix(family)
                .is_some_and(|rest| rest.starts_with(['{', ' ']))
                && line.contains(matcher)
        })
        .map(|line| line.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum()
}

/// Session `session`'s chat: a long system prompt of its own and a question.
fn chat(session: usize) -> String {
    serde_json::json!({
        "model": "sim-model",
        "messages": [
            {"role": "system", "content": format!("Session {session}: you keep ship {session}'s log. ").repeat(12)},
            {"role": "user", "content": "Next entry?"},
        ],
        "max_tokens": 2,
    })
    .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_queries_is_in_metrics() {
    let engines = common::kv_engines(EngineConfig::default(), 2).await;
    let urls: Vec<String> = engines.iter().map(EngineHandle::url).collect();
    let chars_per_token = engine_sim::ModelConfig::default().chars_per_token;
    // A trace pipeline, not installed as a layer (no span is built or
    // exported): its counters are on /metrics all the same.
    #[cfg(feature = "otel")]
    let tracing = router_http::otel::Tracing::start(
        &router_http::otel::ExportConfig::default(),
        tokio::runtime::Handle::current(),
    )
    .unwrap();
    let config = RouterConfig {
        policy: PolicyConfig::named("kv_aware"),
        tokenizers: Tokenizers::default()
            .with_default(Arc::new(PromptTokenizer::synthetic(chars_per_token))),
        kv_events: common::kv_events_config(&engines),
        #[cfg(feature = "otel")]
        metrics_sources: vec![tracing.metrics_source()],
        ..RouterConfig::default()
    };
    let fixture = Fixture::start_with_urls(config, engines, &urls).await;
    let background = fixture.router.spawn_background();
    // Each session twice: the second turn finds the first's blocks once the
    // engine's events arrive.
    for session in [0, 1, 0, 1] {
        let (status, _, body) = call(
            fixture.addr,
            "POST",
            "/v1/chat/completions",
            &[],
            chat(session),
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let text = scrape(fixture.addr).await;
    drop(background);
    fixture.shutdown().await;
    #[cfg(feature = "otel")]
    tokio::task::spawn_blocking(move || drop(tracing))
        .await
        .unwrap();
    // The router_pd_* families are checked against the P/D router, every
    // other family against the kv_aware one.
    let mut families = BTreeMap::new();
    add_families(&mut families, &text);
    let mut pd_families = BTreeMap::new();
    add_families(&mut pd_families, &pd_scrape().await);

    let mut missing = Vec::new();
    let mut used = BTreeSet::new();
    for (place, expr) in expressions(&dashboard()) {
        for name in metric_names(&expr) {
            // A variable's `label_values(metric, label)`: its label.
            if place.starts_with("variable") && name == "job" {
                continue;
            }
            if cfg!(not(feature = "otel")) && name.starts_with("router_trace_") {
                continue;
            }
            let scraped = if name.starts_with("router_pd_") {
                &pd_families
            } else {
                &families
            };
            if !exported(scraped, &name) {
                missing.push(format!("{place}: {name} (in {expr})"));
            }
            used.insert(name);
        }
    }
    assert!(
        missing.is_empty(),
        "the dashboard queries metrics /metrics does not export:\n{}\n\nexported families: \
         {:?}\nP/D: {:?}",
        missing.join("\n"),
        families.keys().collect::<Vec<_>>(),
        pd_families.keys().collect::<Vec<_>>()
    );
    assert!(used.len() >= 40, "{} metric names: {used:?}", used.len());

    // The requests moved kv_aware's decision counters and the match rate.
    let decisions = sum_of(
        &text,
        "router_policy_decisions_total",
        "policy=\"kv_aware\"",
    );
    assert_eq!(decisions, 4.0, "{text}");
    assert_eq!(
        sum_of(&text, "router_cache_match_rate_count", ""),
        4.0,
        "{text}"
    );
}
