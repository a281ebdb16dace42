/*!
Reading model files as smoe models.

[`gguf`] parses llama.cpp's GGUF files and maps them to the architecture description and
canonical tensor names ([`gguf::GgufModel`]: what `smoe run FILE.gguf` runs in place and what
`smoe shatter FILE.gguf` copies). [`hf`] holds every Hugging Face convention (config.json keys,
tensor names, tokenizer and generation files); [`safetensors`] reads checkpoint files.

This crate reads only. Writing (vaults from checkpoints, GGUF export, synthetic checkpoints) is
`smoe-convert`'s; the vault format is `smoe-vault`'s and the block formats `smoe-quant`'s.
*/
#![deny(missing_docs)]

pub mod gguf;
pub mod hf;
pub mod safetensors;
pub mod trace;

use std::path::Path;

/// Progress of a long read or conversion, in source bytes.
pub trait Progress: Sync {
    /// Total bytes to process.
    fn start(&self, total: u64);
    /// More bytes done.
    fn advance(&self, bytes: u64);
    /// Something the user should know (a format fallback, an ignored tensor).
    fn note(&self, msg: &str);
    /// Done.
    fn finish(&self);
}

/// A [`Progress`] that reports nothing.
pub struct Silent;

impl Progress for Silent {
    fn start(&self, _: u64) {}
    fn advance(&self, _: u64) {}
    fn note(&self, _: &str) {}
    fn finish(&self) {}
}

/// Errors reading a model file. Messages name the tensor or file involved.
#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    /// A file could not be read.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// Malformed input.
    #[error("{0}")]
    BadInput(String),
    /// A model, setting or dtype smoe does not support.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// NaN or infinity in a weight.
    #[error("tensor {tensor} holds a non-finite value at element {index}")]
    NonFinite {
        /// The tensor.
        tensor: String,
        /// Flat element index.
        index: u64,
    },
    /// A bug.
    #[error("internal error: {0}")]
    Internal(String),
}

impl FormatError {
    /// Wraps an I/O error with its file.
    pub fn io(path: &Path, source: std::io::Error) -> FormatError {
        FormatError::Io { path: path.display().to_string(), source }
    }
}
