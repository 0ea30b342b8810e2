//! Renders the cases of `tests/reference/cases.json` and compares each,
//! byte for byte, with what Python's reference renderer (transformers'
//! `render_jinja_template` and jinja2, as vLLM calls them) produced for it,
//! recorded in `tests/reference/expected.json` by
//! `tests/reference/render_reference.py` (its docs say how to run it). A
//! case the reference refuses must be refused here too.
//!
//! Each case renders twice: through the direct renderer when it answers,
//! and through minijinja alone. [`KNOWN_DIFFERENCES`] names the cases that
//! still differ, and why.

use std::collections::BTreeMap;
use std::sync::Arc;

use prompt_tokens::{ChatRequest, ChatTemplate, FixedClock, RenderLimits, SpecialTokens};
use serde_json::Value;

/// Cases that still render differently, each for a reason written here;
/// the test fails when one of them starts to agree (take it off the list)
/// or when any other case differs.
const KNOWN_DIFFERENCES: &[(&str, &str)] = [
    (
        "sem_dictsort_items",
        "minijinja has no tuples: dictsort's items print as lists",
    ),
    ("sem_div_zero", "minijinja's 1/0 is inf; Python raises"),
    (
        "sem_percent_format",
        "minijinja has no '%' string formatting",
    ),
]
.as_slice();

fn load(name: &str) -> Value {
    let path = format!("{}/tests/reference/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

#[test]
fn every_case_renders_as_the_reference_renders_it() {
    let cases: BTreeMap<String, Value> = serde_json::from_value(load("cases.json")).unwrap();
    let expected = load("expected.json");
    assert!(cases.len() >= 26, "{} cases", cases.len());
    let mut differences = Vec::new();
    let mut known_agreeing = Vec::new();
    for (name, case) in &cases {
        let known = KNOWN_DIFFERENCES.iter().any(|(k, _)| k == name);
        let mut differed = false;
        let reference = &expected["cases"][name.as_str()];
        assert!(
            reference.is_object(),
            "{name}: no reference; run the generator"
        );
        // The generator passes both flags, false when the case leaves one
        // out (a request body must say it: vLLM's default for
        // add_generation_prompt is true).
        let mut body = serde_json::json!({ "messages": case["messages"] });
        for flag in ["add_generation_prompt", "continue_final_message"] {
            body[flag] = case.get(flag).cloned().unwrap_or(Value::Bool(false));
        }
        if let Some(tools) = case.get("tools") {
            body["tools"] = tools.clone();
        }
        let request = ChatRequest::from_value(&body).unwrap_or_else(|e| panic!("{name}: {e}"));
        let template = case["template"].as_str().expect("a template");
        for direct in [true, false] {
            let ours = ChatTemplate::new(
                template,
                SpecialTokens::default(),
                RenderLimits::default(),
                Arc::new(FixedClock(0)),
            )
            .and_then(|compiled| compiled.with_direct_rendering(direct).render(&request));
            let agree = match (&ours, reference.get("text").and_then(Value::as_str)) {
                (Ok(text), Some(want)) => text == want,
                (Err(_), None) => true,
                _ => false,
            };
            if !agree {
                differed = true;
                if !known {
                    differences.push(format!(
                        "{name} (direct {direct}): ours {ours:?}, reference {reference}"
                    ));
                }
            }
        }
        if known && !differed {
            known_agreeing.push(name.clone());
        }
    }
    eprintln!(
        "reference: {} cases, {} renders, {} unexpected differences, {} known",
        cases.len(),
        2 * cases.len(),
        differences.len(),
        KNOWN_DIFFERENCES.len()
    );
    assert!(
        known_agreeing.is_empty(),
        "now agree with the reference, take them off KNOWN_DIFFERENCES: {known_agreeing:?}"
    );
    assert!(
        differences.is_empty(),
        "{} of {} renders differ:\n{}",
        differences.len(),
        2 * cases.len(),
        differences.join("\n")
    );
}
