//! Incremental detokenization.
//!
//! Byte-level BPE tokens can end in the middle of a UTF-8 character, and the text of a token can
//! depend on its neighbours (leading-space handling, merges of byte fallbacks). So text is
//! produced by decoding a short window of ids and emitting only what extends the previous
//! decode of the same window, holding back while the tail is an incomplete character (decoded
//! as U+FFFD).

use crate::Tokenizer;

/// Streams text for a growing list of token ids.
pub struct Detokenizer {
    tokenizer: Tokenizer,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    skip_special: bool,
}

impl Detokenizer {
    /// A detokenizer for a new stream. `skip_special` drops special tokens from the text.
    pub fn new(tokenizer: Tokenizer, skip_special: bool) -> Detokenizer {
        Detokenizer { tokenizer, ids: Vec::new(), prefix_offset: 0, read_offset: 0, skip_special }
    }

    /// Adds one id; returns the new text it completes (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        self.ids.push(id);
        let prefix = self.tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special);
        let full = self.tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special);
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.is_char_boundary(prefix.len()) {
            let out = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            out
        } else {
            String::new()
        }
    }

    /// Text still held back (an incomplete character at the end of the stream), as the
    /// tokenizer renders it.
    pub fn flush(&mut self) -> String {
        let prefix = self.tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special);
        let full = self.tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special);
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        if full.len() > prefix.len() && full.is_char_boundary(prefix.len()) {
            full[prefix.len()..].to_string()
        } else {
            String::new()
        }
    }

    /// All ids pushed so far.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }
}
