#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| smoe_fuzzing::output_grammar(data));
