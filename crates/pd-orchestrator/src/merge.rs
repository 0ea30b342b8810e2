//! Merging the prefill response into a non-streaming decode response.
//!
//! The client asked one question and must see one coherent answer:
//!
//! - **Usage.** The decode engine counts the transferred KV as cached prompt
//!   tokens, so its `prompt_tokens_details.cached_tokens` would report a cold
//!   request as a full cache hit. Prompt accounting (`prompt_tokens`,
//!   `prompt_tokens_details`) comes from the prefill engine, which actually
//!   processed the prompt; completion accounting stays the decode engine's
//!   (the prefill's forced one-token output is never reported);
//!   `total_tokens` is recomputed. Each count is reported once.
//! - **Prompt logprobs.** Only the prefill engine ran the prompt through the
//!   model, so `prompt_logprobs` (top level for chat completions, per choice
//!   for completions) come from the prefill response. For completions with
//!   `echo` and `logprobs`, the per-token arrays (`tokens`,
//!   `token_logprobs`, `top_logprobs`, `text_offset`) get the prompt's
//!   entries prepended, and the decode entries' `text_offset`s are shifted
//!   by the prompt's text length in characters (the offset the prefill
//!   engine gave its own first generated token).
//!
//! All edits are in place on the parsed decode response; nothing is merged
//! when the shapes do not match, and nothing here panics on any JSON.

use serde_json::{Map, Value};

/// What [`merge_non_streaming`] changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MergeReport {
    /// Usage was rewritten from the prefill's prompt accounting.
    pub usage: bool,
    /// Prompt logprobs were merged into at least one place.
    pub logprobs: bool,
}

/// Merges usage and prompt logprobs of `prefill` into `decode`, in place.
pub fn merge_non_streaming(prefill: &Value, decode: &mut Value) -> MergeReport {
    MergeReport {
        usage: merge_usage(prefill, decode),
        logprobs: merge_prompt_logprobs(prefill, decode),
    }
}

/// Takes prompt accounting from `prefill` and completion accounting from
/// `decode`. Returns whether `decode` changed.
pub fn merge_usage(prefill: &Value, decode: &mut Value) -> bool {
    let Some(prefill_usage) = prefill.get("usage").and_then(Value::as_object) else {
        return false;
    };
    let Some(prompt_tokens) = prefill_usage.get("prompt_tokens").and_then(Value::as_u64) else {
        return false;
    };
    let Some(usage) = decode.get_mut("usage").and_then(Value::as_object_mut) else {
        return false;
    };
    usage.insert("prompt_tokens".to_owned(), Value::from(prompt_tokens));
    match prefill_usage
        .get("prompt_tokens_details")
        .filter(|d| d.is_object())
    {
        Some(details) => {
            usage.insert("prompt_tokens_details".to_owned(), details.clone());
        }
        None => {
            // The prefill did not say what was cached; the decode's number
            // counts the KV transfer, so report nothing rather than a lie.
            if let Some(details) = usage
                .get_mut("prompt_tokens_details")
                .and_then(Value::as_object_mut)
            {
                details.remove("cached_tokens");
            }
        }
    }
    if let Some(completion) = usage.get("completion_tokens").and_then(Value::as_u64)
        && let Some(total) = prompt_tokens.checked_add(completion)
    {
        usage.insert("total_tokens".to_owned(), Value::from(total));
    }
    true
}

/// Merges the prefill's prompt logprobs into `decode` (chat: top level;
/// completions: per choice, plus the echo arrays). Returns whether `decode`
/// changed.
pub fn merge_prompt_logprobs(prefill: &Value, decode: &mut Value) -> bool {
    let mut merged = false;
    if let (Some(prompt), Some(decode_obj)) = (
        prefill.get("prompt_logprobs").filter(|v| !v.is_null()),
        decode.as_object_mut(),
    ) && decode_obj.get("prompt_logprobs").is_none_or(Value::is_null)
    {
        decode_obj.insert("prompt_logprobs".to_owned(), prompt.clone());
        merged = true;
    }
    let Some(prefill_choices) = prefill.get("choices").and_then(Value::as_array) else {
        return merged;
    };
    let Some(decode_choices) = decode.get_mut("choices").and_then(Value::as_array_mut) else {
        return merged;
    };
    for (position, choice) in decode_choices.iter_mut().enumerate() {
        let Some(choice) = choice.as_object_mut() else {
            continue;
        };
        let Some(source) = matching_choice(prefill_choices, choice, position) else {
            continue;
        };
        merged |= merge_choice(source, choice);
    }
    merged
}

/// The prefill choice for a decode choice: same `index`, else same position,
/// else the first (every choice of one request shares the prompt).
fn matching_choice<'a>(
    prefill_choices: &'a [Value],
    choice: &Map<String, Value>,
    position: usize,
) -> Option<&'a Map<String, Value>> {
    let by_index = choice
        .get("index")
        .and_then(Value::as_u64)
        .and_then(|index| {
            prefill_choices
                .iter()
                .find(|c| c.get("index").and_then(Value::as_u64) == Some(index))
        });
    by_index
        .or_else(|| prefill_choices.get(position))
        .or_else(|| prefill_choices.first())
        .and_then(Value::as_object)
}

fn merge_choice(source: &Map<String, Value>, choice: &mut Map<String, Value>) -> bool {
    let Some(prompt) = source.get("prompt_logprobs").and_then(Value::as_array) else {
        return false;
    };
    if choice.get("prompt_logprobs").is_some_and(|v| !v.is_null()) {
        // The decode engine computed them itself; its arrays already cover
        // the prompt.
        return false;
    }
    choice.insert("prompt_logprobs".to_owned(), Value::Array(prompt.clone()));
    let prompt_len = prompt.len();
    if let (Some(src), Some(dst)) = (
        source.get("logprobs").and_then(Value::as_object),
        choice.get_mut("logprobs").and_then(Value::as_object_mut),
    ) {
        for key in ["tokens", "token_logprobs", "top_logprobs"] {
            if let (Some(from), Some(into)) = (
                src.get(key).and_then(Value::as_array),
                dst.get_mut(key).and_then(Value::as_array_mut),
            ) {
                prepend(into, &from[..prompt_len.min(from.len())]);
            }
        }
        if let (Some(from), Some(into)) = (
            src.get("text_offset").and_then(Value::as_array),
            dst.get_mut("text_offset").and_then(Value::as_array_mut),
        ) {
            let shift = prompt_text_len(src, prompt_len);
            for offset in into.iter_mut() {
                if let Some(value) = offset.as_u64() {
                    *offset = Value::from(value.saturating_add(shift));
                }
            }
            prepend(into, &from[..prompt_len.min(from.len())]);
        }
    }
    true
}

fn prepend(into: &mut Vec<Value>, prefix: &[Value]) {
    into.splice(0..0, prefix.iter().cloned());
}

/// Length in characters of the prompt text in the prefill's echo arrays:
/// the offset of the prefill's first generated token when present, else the
/// last prompt token's offset plus its length.
fn prompt_text_len(logprobs: &Map<String, Value>, prompt_len: usize) -> u64 {
    let offsets = logprobs.get("text_offset").and_then(Value::as_array);
    if let Some(first_generated) = offsets
        .and_then(|o| o.get(prompt_len))
        .and_then(Value::as_u64)
    {
        return first_generated;
    }
    let Some(last) = prompt_len.checked_sub(1) else {
        return 0;
    };
    let last_offset = offsets
        .and_then(|o| o.get(last))
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let last_token_chars = logprobs
        .get("tokens")
        .and_then(Value::as_array)
        .and_then(|t| t.get(last))
        .and_then(Value::as_str)
        .map_or(0, |t| t.chars().count() as u64);
    last_offset.saturating_add(last_token_chars)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn usage_takes_prompt_side_from_prefill_and_completion_side_from_decode() {
        let prefill = json!({"usage": {"prompt_tokens": 186, "completion_tokens": 1, "total_tokens": 187,
                                      "prompt_tokens_details": {"cached_tokens": 64}}});
        let mut decode = json!({"usage": {"prompt_tokens": 186, "completion_tokens": 8, "total_tokens": 194,
                                          "prompt_tokens_details": {"cached_tokens": 186}}});
        assert!(merge_usage(&prefill, &mut decode));
        assert_eq!(
            decode["usage"],
            json!({"prompt_tokens": 186, "completion_tokens": 8, "total_tokens": 194,
                   "prompt_tokens_details": {"cached_tokens": 64}})
        );
    }

    #[test]
    fn usage_drops_decode_cache_claim_when_prefill_reports_none() {
        let prefill =
            json!({"usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}});
        let mut decode = json!({"usage": {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                                          "prompt_tokens_details": {"cached_tokens": 10, "audio_tokens": 0}}});
        assert!(merge_usage(&prefill, &mut decode));
        assert_eq!(
            decode["usage"],
            json!({"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                   "prompt_tokens_details": {"audio_tokens": 0}})
        );
    }

    #[test]
    fn usage_untouched_without_both_sides() {
        let mut decode = json!({"usage": {"prompt_tokens": 3}});
        let before = decode.clone();
        assert!(!merge_usage(&json!({}), &mut decode));
        assert!(!merge_usage(
            &json!({"usage": {"prompt_tokens": "x"}}),
            &mut decode
        ));
        assert_eq!(decode, before);
        let mut no_usage = json!({"choices": []});
        assert!(!merge_usage(
            &json!({"usage": {"prompt_tokens": 1}}),
            &mut no_usage
        ));
        assert_eq!(no_usage, json!({"choices": []}));
    }

    #[test]
    fn chat_prompt_logprobs_copied_to_top_level() {
        let prefill =
            json!({"prompt_logprobs": [null, {"5": {"logprob": -1.0}}], "choices": [{"index": 0}]});
        let mut decode = json!({"choices": [{"index": 0, "message": {"content": "hi"}}], "prompt_logprobs": null});
        assert!(merge_prompt_logprobs(&prefill, &mut decode));
        assert_eq!(decode["prompt_logprobs"], prefill["prompt_logprobs"]);
        assert_eq!(
            decode["choices"][0],
            json!({"index": 0, "message": {"content": "hi"}})
        );
    }

    #[test]
    fn completions_echo_arrays_merged_with_char_offsets() {
        // Prompt "héllo wörld" = tokens "héllo", " wörld" (11 chars, 13 bytes);
        // the prefill generated "!" at offset 11.
        let prefill = json!({"choices": [{"index": 0, "text": "héllo wörld!",
            "prompt_logprobs": [null, {"9": {"logprob": -0.5}}],
            "logprobs": {"tokens": ["héllo", " wörld", "!"], "token_logprobs": [null, -0.5, -0.1],
                         "top_logprobs": [null, {" wörld": -0.5}, {"!": -0.1}], "text_offset": [0, 5, 11]}}]});
        let mut decode = json!({"choices": [{"index": 0, "text": "héllo wörld! ok",
            "logprobs": {"tokens": ["!", " ok"], "token_logprobs": [-0.1, -0.2],
                         "top_logprobs": [{"!": -0.1}, {" ok": -0.2}], "text_offset": [0, 1]}}]});
        assert!(merge_prompt_logprobs(&prefill, &mut decode));
        let lp = &decode["choices"][0]["logprobs"];
        assert_eq!(lp["tokens"], json!(["héllo", " wörld", "!", " ok"]));
        assert_eq!(lp["token_logprobs"], json!([null, -0.5, -0.1, -0.2]));
        assert_eq!(
            lp["top_logprobs"],
            json!([null, {" wörld": -0.5}, {"!": -0.1}, {" ok": -0.2}])
        );
        assert_eq!(lp["text_offset"], json!([0, 5, 11, 12]));
        assert_eq!(
            decode["choices"][0]["prompt_logprobs"],
            prefill["choices"][0]["prompt_logprobs"]
        );
    }

    #[test]
    fn offset_shift_falls_back_to_last_prompt_token_length() {
        let prefill = json!({"choices": [{"prompt_logprobs": [null, {}],
            "logprobs": {"tokens": ["ab", "çd"], "text_offset": [0, 2]}}]});
        let mut decode = json!({"choices": [{"logprobs": {"tokens": ["x"], "text_offset": [0]}}]});
        assert!(merge_prompt_logprobs(&prefill, &mut decode));
        assert_eq!(
            decode["choices"][0]["logprobs"]["text_offset"],
            json!([0, 2, 4])
        );
    }

    #[test]
    fn decode_with_own_prompt_logprobs_is_left_alone() {
        let prefill =
            json!({"choices": [{"prompt_logprobs": [null], "logprobs": {"tokens": ["a", "b"]}}]});
        let mut decode =
            json!({"choices": [{"prompt_logprobs": [null], "logprobs": {"tokens": ["a", "c"]}}]});
        let before = decode.clone();
        assert!(!merge_prompt_logprobs(&prefill, &mut decode));
        assert_eq!(decode, before);
    }

    #[test]
    fn n_choices_share_the_prompt() {
        let prefill = json!({"choices": [{"index": 0, "prompt_logprobs": [null, {}]}]});
        let mut decode = json!({"choices": [{"index": 0}, {"index": 1}]});
        assert!(merge_prompt_logprobs(&prefill, &mut decode));
        assert_eq!(decode["choices"][1]["prompt_logprobs"], json!([null, {}]));
    }
}
