//! prompt-tokens: see `prompt_tokens::fuzzing::render`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    prompt_tokens::fuzzing::render(data);
});
