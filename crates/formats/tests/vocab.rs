//! The tokenizer rebuilt from GGUF metadata against llama.cpp's own tokenizer tests: every
//! `.inp` string of the real qwen2, llama-bpe, deepseek-llm and gpt-2 vocabularies must give
//! exactly the `.out` ids.

use smoe_formats::gguf::{vocab, Gguf};
use std::path::Path;

fn cases(name: &str) -> Vec<(String, Vec<u32>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/vocab");
    let inp = std::fs::read_to_string(dir.join(format!("{name}.inp"))).unwrap();
    let out = std::fs::read_to_string(dir.join(format!("{name}.out"))).unwrap();
    // As llama.cpp's test-tokenizer-0 reads them.
    let sep = "\n__ggml_vocab_test__\n";
    let mut inputs = Vec::new();
    let mut pos = 0;
    while pos < inp.len() {
        match inp[pos..].find(sep) {
            Some(n) => {
                inputs.push(inp[pos..pos + n].to_string());
                pos += n + sep.len();
            }
            None => {
                inputs.push(inp[pos..].to_string());
                break;
            }
        }
    }
    let outputs: Vec<Vec<u32>> = out.lines().map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect()).collect();
    assert_eq!(inputs.len(), outputs.len(), "{name}: inputs and outputs");
    inputs.into_iter().zip(outputs).collect()
}

#[test]
fn rebuilt_tokenizers_match_llama_cpp() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/vocab");
    for v in ["qwen2", "llama-bpe", "deepseek-llm", "gpt-2"] {
        let name = format!("ggml-vocab-{v}.gguf");
        let g = Gguf::open(&dir.join(&name)).unwrap();
        let json = vocab::tokenizer_json(&g.meta).unwrap_or_else(|e| panic!("{v}: {e}"));
        let tok = smoe_text::Tokenizer::from_json(&json).unwrap_or_else(|e| panic!("{v}: {e}"));
        let mut bad = Vec::new();
        let all = cases(&name);
        for (text, want) in &all {
            let got = tok.encode(text).unwrap();
            if &got != want {
                bad.push(format!("{text:?}: got {got:?}, want {want:?}"));
            }
        }
        assert!(bad.is_empty(), "{v}: {} of {} strings differ:\n{}", bad.len(), all.len(), bad.join("\n"));
    }
}
