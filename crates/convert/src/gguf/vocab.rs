//! Tokenizers between GGUF metadata (`tokenizer.ggml.*`) and Hugging Face tokenizer.json.
//!
//! GGUF stores a byte-level BPE tokenizer as parallel arrays (token strings, token types,
//! merges) plus the name of a pre-tokenizer (`tokenizer.ggml.pre`). A tokenizer.json is rebuilt
//! from those with the pre-tokenizer that name stands for (the regexes llama.cpp uses for it),
//! and written back the other way for `smoe export-gguf`.

use super::Value;
use crate::ConvertError;
use serde_json::{json, Value as Json};
use std::collections::BTreeMap;

/// GGUF token types.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;

const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const LLAMA3_REGEX: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const DEEPSEEK3_REGEXES: [&str; 3] = [
    r"\p{N}{1,3}",
    "[一-龥\u{3040}-ゟ゠-ヿ]+",
    r"[!\x22#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];
const DEEPSEEK_LLM_REGEXES: [&str; 6] = [
    "[\r\n]",
    "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ίῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
    "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
    "\\s+$",
    "[一-龥ࠀ-一가-퟿]+",
    "\\p{N}+",
];

fn split(regex: &str) -> Json {
    json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false})
}

fn byte_level(use_regex: bool) -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": use_regex})
}

/// The normalizer and pre-tokenizer a `tokenizer.ggml.pre` name stands for.
pub fn pre_tokenizer(pre: &str) -> Result<(Json, Json), ConvertError> {
    let seq = |mut v: Vec<Json>| {
        v.push(byte_level(false));
        json!({"type": "Sequence", "pretokenizers": v})
    };
    Ok(match pre {
        "qwen2" | "qwen" | "stablelm2" => (json!({"type": "NFC"}), seq(vec![split(QWEN2_REGEX)])),
        "llama-bpe" | "llama3" | "llama-v3" => (Json::Null, seq(vec![split(LLAMA3_REGEX)])),
        "gpt-2" | "gpt2" | "default" | "olmo" | "mpt" => (Json::Null, byte_level(true)),
        "deepseek-v3" | "deepseek3-llm" => (Json::Null, seq(DEEPSEEK3_REGEXES.iter().map(|r| split(r)).collect())),
        "deepseek-llm" => (Json::Null, seq(DEEPSEEK_LLM_REGEXES.iter().map(|r| split(r)).collect())),
        other => {
            return Err(ConvertError::Unsupported(format!(
                "tokenizer pre-tokenizer '{other}' (supported: qwen2, llama-bpe, gpt-2, deepseek-v3, deepseek-llm)"
            )))
        }
    })
}

fn strings(v: Option<&Value>, what: &str) -> Result<Vec<String>, ConvertError> {
    v.and_then(|v| v.as_array())
        .ok_or_else(|| ConvertError::BadInput(format!("GGUF has no {what}")))?
        .iter()
        .map(|s| s.as_str().map(str::to_string).ok_or_else(|| ConvertError::BadInput(format!("{what}: not a string"))))
        .collect()
}

/// Rebuilds a tokenizer.json from GGUF metadata.
pub fn tokenizer_json(meta: &BTreeMap<String, Value>) -> Result<String, ConvertError> {
    let model = meta.get("tokenizer.ggml.model").and_then(|v| v.as_str()).unwrap_or("?");
    if model != "gpt2" {
        return Err(ConvertError::Unsupported(format!("tokenizer model '{model}' (only byte-level BPE, 'gpt2')")));
    }
    let tokens = strings(meta.get("tokenizer.ggml.tokens"), "tokenizer.ggml.tokens")?;
    let merges = strings(meta.get("tokenizer.ggml.merges"), "tokenizer.ggml.merges")?;
    let types: Vec<i32> = match meta.get("tokenizer.ggml.token_type").and_then(|v| v.as_array()) {
        Some(a) => a.iter().map(|t| t.as_f64().unwrap_or(1.0) as i32).collect(),
        None => vec![NORMAL; tokens.len()],
    };
    let pre = meta.get("tokenizer.ggml.pre").and_then(|v| v.as_str()).unwrap_or("default");
    let (normalizer, pre_tok) = pre_tokenizer(pre)?;
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        match types.get(id).copied().unwrap_or(NORMAL) {
            CONTROL | USER_DEFINED => added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": types[id] == CONTROL,
            })),
            UNUSED => {}
            _ => {
                vocab.insert(tok.clone(), json!(id));
            }
        }
    }
    let t = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tok,
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    });
    Ok(serde_json::to_string(&t).unwrap())
}

/// The GGUF name of a tokenizer.json's pre-tokenizer, by its regexes.
fn pre_name(tok: &Json) -> &'static str {
    let text = tok["pre_tokenizer"].to_string();
    let has = |r: &str| text.contains(&serde_json::to_string(r).unwrap()[1..serde_json::to_string(r).unwrap().len() - 1]);
    if has(QWEN2_REGEX) {
        "qwen2"
    } else if has(LLAMA3_REGEX) {
        "llama-bpe"
    } else if has(DEEPSEEK3_REGEXES[2]) {
        "deepseek-v3"
    } else {
        "gpt-2"
    }
}

/// GGUF tokenizer metadata from a tokenizer.json, with `vocab_size` token slots (ids without a
/// token become `[PADn]`, unused, as llama.cpp's converter writes them).
pub fn gguf_tokenizer(tokenizer_json: &str, vocab_size: usize) -> Result<Vec<(String, Value)>, ConvertError> {
    let tok: Json = serde_json::from_str(tokenizer_json).map_err(|e| ConvertError::BadInput(format!("tokenizer.json: {e}")))?;
    if tok["model"]["type"] != "BPE" {
        return Err(ConvertError::Unsupported("only BPE tokenizers can be exported to GGUF".into()));
    }
    let n = vocab_size.max(1);
    let mut tokens: Vec<Option<String>> = vec![None; n];
    let mut types = vec![UNUSED; n];
    let mut put = |id: usize, s: &str, t: i32| {
        if id >= tokens.len() {
            tokens.resize(id + 1, None);
            types.resize(id + 1, UNUSED);
        }
        tokens[id] = Some(s.to_string());
        types[id] = t;
    };
    for (s, id) in tok["model"]["vocab"].as_object().into_iter().flatten() {
        put(id.as_u64().unwrap_or(0) as usize, s, NORMAL);
    }
    for a in tok["added_tokens"].as_array().into_iter().flatten() {
        let t = if a["special"].as_bool().unwrap_or(false) { CONTROL } else { USER_DEFINED };
        put(a["id"].as_u64().unwrap_or(0) as usize, a["content"].as_str().unwrap_or(""), t);
    }
    let tokens: Vec<Value> = tokens.into_iter().enumerate().map(|(i, t)| Value::Str(t.unwrap_or_else(|| format!("[PAD{i}]")))).collect();
    let merges: Vec<Value> = tok["model"]["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| match m {
            Json::String(s) => Value::Str(s.clone()),
            Json::Array(p) => Value::Str(format!("{} {}", p[0].as_str().unwrap_or(""), p[1].as_str().unwrap_or(""))),
            _ => Value::Str(String::new()),
        })
        .collect();
    Ok(vec![
        ("tokenizer.ggml.model".into(), Value::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::Str(pre_name(&tok).into())),
        ("tokenizer.ggml.tokens".into(), Value::Array(tokens)),
        ("tokenizer.ggml.token_type".into(), Value::Array(types.into_iter().map(Value::I32).collect())),
        ("tokenizer.ggml.merges".into(), Value::Array(merges)),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Gguf;
    use std::path::Path;

    #[test]
    fn fixture_vocab_round_trips_and_tokenizes_like_the_original() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata");
        let g = Gguf::open(&root.join("gguf/qwen3_moe.bf16.gguf")).unwrap();
        let rebuilt = tokenizer_json(&g.meta).unwrap();
        let original = std::fs::read_to_string(root.join("hf/qwen3_moe/tokenizer.json")).unwrap();
        let a = smoe_text::Tokenizer::from_json(&rebuilt).unwrap();
        let b = smoe_text::Tokenizer::from_json(&original).unwrap();
        let reference: Json = serde_json::from_str(&std::fs::read_to_string(root.join("hf/qwen3_moe/reference.json")).unwrap()).unwrap();
        for s in reference["tokenize"].as_array().unwrap() {
            let text = s["text"].as_str().unwrap();
            assert_eq!(a.encode(text).unwrap(), b.encode(text).unwrap(), "{text:?}");
        }
        for c in reference["chat_templates"].as_object().unwrap().values() {
            let text = c["text"].as_str().unwrap();
            assert_eq!(a.encode(text).unwrap(), b.encode(text).unwrap());
        }
        // And back: tokenizer.json -> GGUF arrays equal llama.cpp's own.
        let meta = gguf_tokenizer(&original, 1024).unwrap();
        for (k, v) in meta {
            assert_eq!(Some(&v), g.get(&k), "{k}");
        }
    }
}
