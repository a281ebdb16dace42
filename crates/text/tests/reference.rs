//! Tokenizer, chat template and detokenizer against what transformers produced for each
//! fixture (reference.json).

use serde_json::Value;
use smoe_text::{ChatTemplate, Detokenizer, Tokenizer};
use std::path::{Path, PathBuf};

fn fixtures() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/hf");
    let mut v: Vec<PathBuf> = std::fs::read_dir(root).unwrap().map(|e| e.unwrap().path()).collect();
    v.sort();
    assert!(v.len() >= 9);
    v
}

fn load(dir: &Path) -> (Tokenizer, ChatTemplate, Value) {
    let tok = Tokenizer::from_json(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap()).unwrap();
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap()).unwrap();
    let tmpl = ChatTemplate::new(cfg["chat_template"].as_str().unwrap(), None, cfg["eos_token"].as_str()).unwrap();
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap()).unwrap();
    (tok, tmpl, reference)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn chat_templates_render_byte_identical_with_identical_ids() {
    for dir in fixtures() {
        let (tok, tmpl, reference) = load(&dir);
        for (name, case) in reference["chat_templates"].as_object().unwrap() {
            let messages = case["messages"].as_array().unwrap();
            let kwargs = case["kwargs"].as_object().unwrap();
            let tools = kwargs.get("tools").and_then(|t| t.as_array()).map(|t| t.as_slice());
            let mut extra = kwargs.clone();
            extra.remove("tools");
            let text = tmpl.render(messages, tools, true, &extra).unwrap();
            assert_eq!(text, case["text"].as_str().unwrap(), "{} {name}", dir.display());
            assert_eq!(tok.encode(&text).unwrap(), ids(&case["ids"]), "{} {name}", dir.display());
        }
    }
}

#[test]
fn tokenize_samples_match_ids_and_decoded_text() {
    for dir in fixtures() {
        let (tok, _, reference) = load(&dir);
        for s in reference["tokenize"].as_array().unwrap() {
            let text = s["text"].as_str().unwrap();
            let expect = ids(&s["ids"]);
            assert_eq!(tok.encode(text).unwrap(), expect, "{text:?}");
            assert_eq!(tok.decode(&expect, false), s["decoded"].as_str().unwrap(), "{text:?}");
        }
    }
}

#[test]
fn streaming_detokenizer_reassembles_text_and_never_splits_characters() {
    let (tok, _, reference) = load(&fixtures()[0]);
    for s in reference["tokenize"].as_array().unwrap() {
        let expect = ids(&s["ids"]);
        let mut d = Detokenizer::new(tok.clone(), false);
        let mut text = String::new();
        for &id in &expect {
            let piece = d.push(id);
            assert!(!piece.contains('\u{FFFD}'), "broken UTF-8 emitted for {:?}", s["text"]);
            text.push_str(&piece);
        }
        text.push_str(&d.flush());
        assert_eq!(text, s["decoded"].as_str().unwrap());
    }
}

#[test]
fn ids_without_a_token_are_skipped() {
    let (tok, _, reference) = load(&fixtures()[0]);
    assert!(tok.vocab_size() < 1024, "the fixtures' vocab is smaller than the model's");
    assert_eq!(tok.token(1019), None);
    let hello = ids(&reference["tokenize"][0]["ids"]);
    let mut with_gaps = vec![1019];
    with_gaps.extend(&hello);
    with_gaps.push(1023);
    assert_eq!(tok.decode(&with_gaps, false), "Hello, world!");
    let mut d = Detokenizer::new(tok.clone(), false);
    let mut text: String = with_gaps.iter().map(|&i| d.push(i)).collect();
    text.push_str(&d.flush());
    assert_eq!(text, "Hello, world!");
}
