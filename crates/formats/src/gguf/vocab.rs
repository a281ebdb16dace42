//! Tokenizers between GGUF metadata (`tokenizer.ggml.*`) and Hugging Face tokenizer.json.
//!
//! GGUF stores a byte-level BPE tokenizer as parallel arrays (token strings, token types,
//! merges) plus the name of a pre-tokenizer (`tokenizer.ggml.pre`). A tokenizer.json is rebuilt
//! from those with the pre-tokenizer that name stands for (the regexes llama.cpp uses for it),
//! and written back the other way for `smoe export-gguf`.

use super::Value;
use crate::FormatError;
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
/// GLM-4's: Llama 3's with the contractions spelled case by case.
const GLM4_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const DEEPSEEK3_REGEXES: [&str; 3] = [
    r"\p{N}{1,3}",
    "[一-龥\u{3040}-ゟ゠-ヿ]+",
    r"[!\x22#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
];
const DEEPSEEK_LLM_REGEXES: [&str; 6] = [
    "[\r\n]",
    "\\s?[A-Za-z\u{b5}\u{c0}-\u{d6}\u{d8}-\u{f6}\u{f8}-\u{1ba}\u{1bc}-\u{1bf}\u{1c4}-\u{293}\u{295}-\u{2af}\u{370}-\u{373}\u{376}\u{377}\u{37b}-\u{37d}\u{37f}\u{386}\u{388}-\u{38a}\u{38c}\u{38e}-\u{3a1}\u{3a3}-\u{3f5}\u{3f7}-\u{481}\u{48a}-\u{52f}\u{531}-\u{556}\u{10a0}-\u{10c5}\u{13a0}-\u{13f5}\u{13f8}-\u{13fd}\u{1c90}-\u{1cba}\u{1cbd}-\u{1cbf}\u{1d00}-\u{1d2b}\u{1d6b}-\u{1d77}\u{1d79}-\u{1d9a}\u{1e00}-\u{1f15}\u{1f18}-\u{1f1d}\u{1f20}-\u{1f45}\u{1f48}-\u{1f4d}\u{1f50}-\u{1f57}\u{1f59}\u{1f5b}\u{1f5d}\u{1f5f}-\u{1f7d}\u{1f80}-\u{1fb4}\u{1fb6}-\u{1fbc}\u{1fbe}\u{1fc2}-\u{1fc4}\u{1fc6}-\u{1fcc}\u{1fd0}-\u{1fd3}\u{1fd6}-\u{1fdb}\u{1fe0}-\u{1fec}\u{1ff2}-\u{1ff4}\u{1ff6}-\u{1ffc}\u{2102}\u{2107}\u{210a}-\u{2113}\u{2115}\u{2119}-\u{211d}\u{2124}\u{2126}\u{2128}\u{212a}-\u{212d}\u{212f}-\u{2134}\u{2139}\u{213c}-\u{213f}\u{2145}-\u{2149}\u{214e}\u{2183}\u{2184}\u{2c00}-\u{2c7b}\u{2c7e}-\u{2ce4}\u{2ceb}-\u{2cee}\u{2cf2}\u{2cf3}\u{a640}-\u{a66d}\u{a680}-\u{a69b}\u{a722}-\u{a76f}\u{a771}-\u{a787}\u{a78b}-\u{a78e}\u{ab70}-\u{abbf}\u{fb00}-\u{fb06}\u{fb13}-\u{fb17}\u{ff21}-\u{ff3a}\u{ff41}-\u{ff5a}\u{10400}-\u{1044f}\u{104b0}-\u{104d3}\u{104d8}-\u{104fb}\u{10c80}-\u{10cb2}\u{10cc0}-\u{10cf2}\u{118a0}-\u{118df}\u{1e900}-\u{1e943}]+",
    "\\s?[!-/:-~\u{ff01}-\u{ff0f}\u{ff1a}-\u{ff5e}\u{2018}-\u{201f}\u{3000}-\u{3002}]+",
    "\\s+$",
    "[\u{4e00}-\u{9fa5}\u{800}-\u{4e00}\u{ac00}-\u{d7ff}]+",
    "\\p{N}+",
];

fn split(regex: &str) -> Json {
    json!({"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false})
}

fn byte_level(use_regex: bool) -> Json {
    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": use_regex})
}

/// The normalizer and pre-tokenizer a `tokenizer.ggml.pre` name stands for.
pub fn pre_tokenizer(pre: &str) -> Result<(Json, Json), FormatError> {
    let seq = |mut v: Vec<Json>| {
        v.push(byte_level(false));
        json!({"type": "Sequence", "pretokenizers": v})
    };
    Ok(match pre {
        "qwen2" | "qwen" | "stablelm2" => (json!({"type": "NFC"}), seq(vec![split(QWEN2_REGEX)])),
        "llama-bpe" | "llama3" | "llama-v3" => (Json::Null, seq(vec![split(LLAMA3_REGEX)])),
        // GLM-4.5's tokenizer (llama.cpp's CHATGLM4 pre-tokenizer).
        "glm4" | "chatglm-bpe" => (Json::Null, seq(vec![split(GLM4_REGEX)])),
        "gpt-2" | "gpt2" | "default" | "olmo" | "mpt" => (Json::Null, byte_level(true)),
        "deepseek-v3" | "deepseek3-llm" => (Json::Null, seq(DEEPSEEK3_REGEXES.iter().map(|r| split(r)).collect())),
        "deepseek-llm" => (Json::Null, seq(DEEPSEEK_LLM_REGEXES.iter().map(|r| split(r)).collect())),
        other => {
            return Err(FormatError::Unsupported(format!(
                "tokenizer pre-tokenizer '{other}' (supported: qwen2, llama-bpe, glm4, gpt-2, deepseek-v3, deepseek-llm)"
            )))
        }
    })
}

fn strings(v: Option<&Value>, what: &str) -> Result<Vec<String>, FormatError> {
    v.and_then(|v| v.as_array())
        .ok_or_else(|| FormatError::BadInput(format!("GGUF has no {what}")))?
        .iter()
        .map(|s| s.as_str().map(str::to_string).ok_or_else(|| FormatError::BadInput(format!("{what}: not a string"))))
        .collect()
}

/// Whether a word found whole in the vocabulary is taken as one token before any merge, as
/// Llama 3's and GLM-4's tokenizer.json say (`ignore_merges`) and llama.cpp does for them.
fn ignore_merges(pre: &str) -> bool {
    matches!(pre, "llama-bpe" | "llama3" | "llama-v3" | "glm4" | "chatglm-bpe")
}

/// Rebuilds a tokenizer.json from GGUF metadata.
pub fn tokenizer_json(meta: &BTreeMap<String, Value>) -> Result<String, FormatError> {
    let model = meta.get("tokenizer.ggml.model").and_then(|v| v.as_str()).unwrap_or("?");
    if model != "gpt2" {
        return Err(FormatError::Unsupported(format!("tokenizer model '{model}' (only byte-level BPE, 'gpt2')")));
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
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": ignore_merges(pre),
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
pub fn gguf_tokenizer(tokenizer_json: &str, vocab_size: usize) -> Result<Vec<(String, Value)>, FormatError> {
    let tok: Json = serde_json::from_str(tokenizer_json).map_err(|e| FormatError::BadInput(format!("tokenizer.json: {e}")))?;
    if tok["model"]["type"] != "BPE" {
        return Err(FormatError::Unsupported("only BPE tokenizers can be exported to GGUF".into()));
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
