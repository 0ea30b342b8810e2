//! prompt-tokens: see `prompt_tokens::fuzzing::tiktoken`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    prompt_tokens::fuzzing::tiktoken(data);
});
