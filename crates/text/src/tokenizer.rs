//! tokenizer.json through the `tokenizers` crate.

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
}
