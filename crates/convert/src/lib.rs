/*!
Conversion into smoe vaults.

[`shatter`] turns a Hugging Face checkpoint directory (config.json, sharded safetensors,
tokenizer files) into one vault, streaming tensor by tensor with bounded memory. The
[`hf`] module holds every Hugging Face convention (config keys, tensor names); the
[`safetensors`] module reads checkpoint files.

This crate owns conversion only: the vault format is `smoe-vault`'s and the block encoders are
`smoe-quant`'s.
*/
#![deny(missing_docs)]

pub mod gguf;
pub mod hf;
pub mod safetensors;
mod shatter;
pub mod synth;

pub use shatter::{quantize_rows, shatter, shatter_from, ShatterOptions, ShatterReport, SourceAssets, TensorProvider};

use std::path::Path;

/// Progress of a long conversion, in source bytes.
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

/// Conversion errors. Messages name the tensor or file involved.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
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
    /// Tensors the architecture needs that the checkpoint lacks.
    #[error("checkpoint is missing {} tensor(s): {}", .0.len(), list(.0))]
    Missing(Vec<String>),
    /// Tensors the checkpoint has that the architecture does not explain.
    #[error("checkpoint has {} unexpected tensor(s): {}", .0.len(), list(.0))]
    Unexpected(Vec<String>),
    /// A tensor whose shape does not match the config.
    #[error("tensor {tensor} has shape {found:?}, config.json implies {expected:?}")]
    Shape {
        /// The tensor.
        tensor: String,
        /// Its shape.
        found: Vec<usize>,
        /// The shape the config implies.
        expected: Vec<usize>,
    },
    /// NaN or infinity in a weight.
    #[error("tensor {tensor} holds a non-finite value at element {index}")]
    NonFinite {
        /// The tensor.
        tensor: String,
        /// Flat element index.
        index: u64,
    },
    /// Writing the vault failed.
    #[error(transparent)]
    Vault(#[from] smoe_vault::VaultError),
    /// A failure injected by a test.
    #[error("injected failure (test hook)")]
    Injected,
    /// A bug.
    #[error("internal error: {0}")]
    Internal(String),
}

impl ConvertError {
    /// Wraps an I/O error with its file.
    pub fn io(path: &Path, source: std::io::Error) -> ConvertError {
        ConvertError::Io { path: path.display().to_string(), source }
    }
}

fn list(v: &[String]) -> String {
    if v.len() > 12 {
        format!("{}, ... ({} more)", v[..12].join(", "), v.len() - 12)
    } else {
        v.join(", ")
    }
}
