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
        serde_json::from_str::<serde::de::IgnoredAny>(json).map_err(|e| TokenizerError(format!("tokenizer.json is not JSON: {e}")))?;
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
}
