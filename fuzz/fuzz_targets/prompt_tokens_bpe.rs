//! prompt-tokens: see `prompt_tokens::fuzzing::bpe`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    prompt_tokens::fuzzing::bpe(data);
});
