#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| smoe_fuzzing::anthropic_request(data));
