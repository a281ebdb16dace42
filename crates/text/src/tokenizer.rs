//! tokenizer.json through the `tokenizers` crate.

use std::collections::HashMap;
use std::sync::Arc;

/// Tokenizer errors.
#[derive(Debug, thiserror::Error)]
#[error("tokenizer: {0}")]
pub struct TokenizerError(pub String);

/// A loaded tokenizer. Cheap to clone.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
}

/// Refuses the BPE merges that the `tokenizers` crate (0.23) would index out of bounds or slice
/// mid-character while building its merge table (`models/bpe/model.rs`: it copies each merged
/// pair into a buffer as long as the longest vocabulary token and strips the
/// continuing-subword prefix from the second part by byte count, unchecked). Found by the
/// `tokenizer` fuzz target: a merge whose result is longer than every token panicked. A merge
/// the crate itself reports (a part or the result missing from the vocabulary, a malformed
/// entry) is left to it.
fn check_bpe_merges(v: &serde_json::Value) -> Result<(), TokenizerError> {
    let Some(model) = v.get("model") else { return Ok(()) };
    if model.get("type").and_then(|t| t.as_str()).is_some_and(|t| t != "BPE") {
        return Ok(());
    }
    let (Some(vocab), Some(merges)) = (model.get("vocab").and_then(|x| x.as_object()), model.get("merges").and_then(|x| x.as_array()))
    else {
        return Ok(());
    };
    let prefix = model.get("continuing_subword_prefix").and_then(|p| p.as_str()).unwrap_or("");
    let longest = vocab.keys().map(String::len).max().unwrap_or(0);
    for (i, m) in merges.iter().enumerate() {
        let (a, b) = match m {
            serde_json::Value::String(s) => match s.split_once(' ') {
                Some(pair) => pair,
                None => continue,
            },
            serde_json::Value::Array(p) if p.len() == 2 => match (p[0].as_str(), p[1].as_str()) {
                (Some(a), Some(b)) => (a, b),
                _ => continue,
            },
            _ => continue,
        };
        let Some(rest) = b.strip_prefix(prefix) else {
            return Err(TokenizerError(format!(
                "BPE merge {i} (`{a}` `{b}`): the second part lacks the continuing-subword prefix `{prefix}`"
            )));
        };
        if a.len() + rest.len() > longest {
            return Err(TokenizerError(format!("BPE merge {i} (`{a}` `{b}`) makes a token longer than any in the vocabulary")));
        }
    }
    Ok(())
}

impl Tokenizer {
    /// Parses a tokenizer.json.
    ///
    /// The `tokenizers` crate (0.23) panics on some malformed files instead of returning an
    /// error: a syntax error inside the `decoder` section reaches an `expect("Helper")` in
    /// `decoders/mod.rs` (found by the `tokenizer` fuzz target). A file that vaults and GGUFs
    /// carry from strangers must not bring the process down: the text is checked to be JSON
    /// first (which that section's fallback variant then always accepts), and a panic while
    /// parsing is still caught and becomes this error.
    pub fn from_json(json: &str) -> Result<Tokenizer, TokenizerError> {
        let value: serde_json::Value =
            serde_json::from_str(json).map_err(|e| TokenizerError(format!("tokenizer.json is not JSON: {e}")))?;
        check_bpe_merges(&value)?;
        let parsed = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(json.as_bytes()));
        let inner = match parsed {
            Ok(r) => r.map_err(|e| TokenizerError(e.to_string()))?,
            Err(p) => {
                let why = p.downcast_ref::<String>().map(String::as_str).or_else(|| p.downcast_ref::<&str>().copied()).unwrap_or("");
                return Err(TokenizerError(format!("malformed tokenizer.json (the parser gave up: {why})")));
            }
        };
        Ok(Tokenizer { inner: Arc::new(inner) })
    }

    /// Token ids of `text`. Added and special tokens written in the text (such as
    /// `<|im_start|>`) become their ids; no BOS/EOS is added (chat templates write their own).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        let enc = self.inner.encode(text, false).map_err(|e| TokenizerError(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`. Ids without a token are skipped, as Hugging Face's `decode` does.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let known: Vec<u32> = ids.iter().copied().filter(|&i| self.inner.id_to_token(i).is_some()).collect();
        self.inner.decode(&known, skip_special).unwrap_or_default()
    }

    /// The id of a token string, if it exists.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The string of a token id, if it exists.
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of tokens, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Whether `id` is a special added token (such as `<|im_end|>`).
    pub fn is_special(&self, id: u32) -> bool {
        self.inner.get_added_tokens_decoder().get(&id).is_some_and(|t| t.special)
    }

    /// The bytes each token id stands for (empty for ids with no token), as constrained
    /// output needs them: byte-level BPE (GPT-2, Qwen, Llama 3) maps its alphabet back to
    /// bytes; SentencePiece-style vocabularies turn `▁` into a space and `<0xNN>` into a byte.
    /// Added tokens, special or not (`<|im_end|>`, but also `<tool_call>` and `<think>`, which
    /// some vocabularies leave non-special), start with llguidance's marker byte 0xFF: control
    /// tokens, never text a grammar matches (a `<tool_call>` token inside a JSON string would
    /// split the call when the reply is parsed). They are also returned by content, for
    /// grammars that name them.
    pub fn token_bytes(&self) -> Result<TokenBytes, TokenizerError> {
        let decoder = serde_json::to_value(self.inner.get_decoder()).unwrap_or_default();
        let parts: Vec<&serde_json::Value> = match decoder["decoders"].as_array() {
            Some(list) => list.iter().collect(),
            None => vec![&decoder],
        };
        let has = |t: &str| parts.iter().any(|d| d["type"] == t);
        let space = parts
            .iter()
            .find_map(|d| match d["type"].as_str() {
                Some("Replace") if d["content"] == " " => d["pattern"]["String"].as_str().map(str::to_string),
                Some("Metaspace") => d["replacement"].as_str().map(str::to_string),
                _ => None,
            })
            .unwrap_or_else(|| "\u{2581}".to_string());
        let byte_level = has("ByteLevel");
        if !byte_level && !has("ByteFallback") && !has("Metaspace") {
            return Err(TokenizerError(format!("constrained output does not support this tokenizer's decoder ({decoder})")));
        }
        let alphabet = byte_level_alphabet();
        let added = self.inner.get_added_tokens_decoder();
        let vocab = self.inner.get_vocab(true);
        let n = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        let mut words = vec![Vec::new(); n];
        let mut specials = HashMap::new();
        for (text, &id) in &vocab {
            let bytes = match added.get(&id) {
                Some(t) => {
                    specials.insert(t.content.clone(), id);
                    [&[0xFF][..], t.content.as_bytes()].concat()
                }
                None if byte_level => text
                    .chars()
                    .map(|c| alphabet.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .ok_or_else(|| TokenizerError(format!("token {id} ({text:?}) is not in the byte-level alphabet")))?,
                None => match text.strip_prefix("<0x").and_then(|h| h.strip_suffix('>')).filter(|h| h.len() == 2) {
                    Some(hex) => {
                        vec![u8::from_str_radix(hex, 16).map_err(|_| TokenizerError(format!("token {id} ({text:?}) is not a byte")))?]
                    }
                    None => text.replace(space.as_str(), " ").into_bytes(),
                },
            };
            words[id as usize] = bytes;
        }
        Ok(TokenBytes { words, specials })
    }
}

/// What each token id spells ([`Tokenizer::token_bytes`]).
pub struct TokenBytes {
    /// The bytes of each id (empty for ids with no token); added tokens start with 0xFF.
    pub words: Vec<Vec<u8>>,
    /// The added tokens by content.
    pub specials: HashMap<String, u32>,
}

/// GPT-2's byte-level alphabet, reversed: the printable bytes stand for themselves, the rest
/// were shifted to U+0100 and up, in byte order.
fn byte_level_alphabet() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 0x100u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (b as char, b)
            } else {
                next += 1;
                (char::from_u32(next - 1).expect("below the surrogates"), b)
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The inputs on which the `tokenizers` crate panicked (kept by the fuzz campaign) are
    /// errors here.
    #[test]
    fn malformed_files_that_panicked_the_parser_are_errors() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/tokenizer");
        for name in ["tokenizers-decoder-panic", "tokenizers-decoder-syntax-error"] {
            let bytes = std::fs::read(dir.join(name)).unwrap();
            let text = String::from_utf8_lossy(&bytes);
            assert!(Tokenizer::from_json(&text).is_err(), "{name}");
        }
    }

    /// BPE merges the `tokenizers` crate would index out of bounds or cut mid-character are
    /// refused before it sees them, with a message (not caught as a panic).
    #[test]
    fn bpe_merges_that_would_panic_the_crate_are_refused() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/tokenizer");
        let found = String::from_utf8_lossy(&std::fs::read(dir.join("bpe-merge-longer-than-vocab")).unwrap()).into_owned();
        let e = Tokenizer::from_json(&found).err().expect("refused").to_string();
        assert!(e.contains("longer than any in the vocabulary"), "{e}");
        let bpe = |prefix: &str, merges: &str| {
            format!(
                r###"{{"model":{{"type":"BPE","continuing_subword_prefix":"{prefix}","vocab":{{"a":0,"b":1,"ab":2,"##b":3,"é":4}},"merges":{merges}}}}}"###
            )
        };
        assert!(Tokenizer::from_json(&bpe("", r#"["a b"]"#)).is_ok());
        let e = Tokenizer::from_json(&bpe("", r#"["ab ab"]"#)).err().expect("refused").to_string();
        assert!(e.contains("longer than any"), "{e}");
        let e = Tokenizer::from_json(&bpe("##", r#"[["a","é"]]"#)).err().expect("refused").to_string();
        assert!(e.contains("lacks the continuing-subword prefix"), "{e}");
    }

    /// Each token's bytes, concatenated over an encoding, give back the text: byte-level BPE
    /// (every fixture) and a SentencePiece-style vocabulary with byte fallback.
    #[test]
    fn token_bytes_spell_the_text() {
        let tok = Tokenizer::from_json(include_str!("../../../testdata/hf/qwen3_moe/tokenizer.json")).unwrap();
        let TokenBytes { words, specials } = tok.token_bytes().unwrap();
        let text = "def f(x):\n    return {\"é\": x}  # ünïcode, 中文";
        let spelled: Vec<u8> = tok.encode(text).unwrap().iter().flat_map(|&id| words[id as usize].clone()).collect();
        assert_eq!(String::from_utf8(spelled).unwrap(), text);
        let end = tok.token_id("<|im_end|>").unwrap();
        assert_eq!(specials.get("<|im_end|>"), Some(&end));
        assert_eq!(words[end as usize], b"\xff<|im_end|>");

        let spm = r#"{"version": "1.0", "added_tokens": [{"id": 0, "content": "<s>", "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null, "pre_tokenizer": null, "post_processor": null,
            "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"}]},
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true,
                "vocab": {"<s>": 0, "<0x0A>": 1, "▁hi": 2, "h": 3, "i": 4, "▁": 5}, "merges": []}}"#;
        let TokenBytes { words, specials } = Tokenizer::from_json(spm).unwrap().token_bytes().unwrap();
        assert_eq!(words, vec![b"\xff<s>".to_vec(), b"\n".to_vec(), b" hi".to_vec(), b"h".to_vec(), b"i".to_vec(), b" ".to_vec()]);
        assert_eq!(specials.len(), 1);
        let mut wordpiece: serde_json::Value = serde_json::from_str(spm).unwrap();
        wordpiece["decoder"] = serde_json::json!({"type": "WordPiece", "prefix": "##", "cleanup": true});
        let e = Tokenizer::from_json(&wordpiece.to_string()).unwrap().token_bytes().err().expect("refused");
        assert!(e.to_string().contains("does not support this tokenizer's decoder"), "{e}");
    }
}
