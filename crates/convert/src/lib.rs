/*!
Conversion into smoe vaults.

[`shatter`] turns a Hugging Face checkpoint directory (config.json, sharded safetensors,
tokenizer files) into one vault, streaming tensor by tensor with bounded memory;
[`gguf::import::shatter_gguf`] does the same for a GGUF file, and [`gguf::export`] writes a
vault back out as a GGUF. [`synth`] makes random-weight checkpoints of published shapes.

This crate writes only: reading model files (GGUF, config.json, safetensors) is
`smoe-formats`'s, the vault format `smoe-vault`'s and the block encoders `smoe-quant`'s.
*/
#![deny(missing_docs)]
// The published configs in `synth` are long `json!` literals.
#![recursion_limit = "256"]

pub mod deepseek_v4;
mod expert_formats;
pub mod gguf;
pub mod gpt_oss;
mod llama_mix;
pub mod qwen3_next;
pub mod random_blocks;
mod shatter;
pub mod synth;

pub use expert_formats::ExpertFormats;
pub use llama_mix::{LlamaFileType, MixPlan};
pub use shatter::{quantize_rows, shatter, shatter_from, ShatterOptions, ShatterReport, SourceAssets, TensorProvider};
pub use smoe_formats::{Progress, Silent};

/// Conversion errors. Messages name the tensor or file involved.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
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
    /// Reading the source failed, or it is malformed or unsupported (the variants of
    /// [`smoe_formats::FormatError`], which reading and writing share).
    #[error(transparent)]
    Format(#[from] smoe_formats::FormatError),
    /// Writing the vault failed.
    #[error(transparent)]
    Vault(#[from] smoe_vault::VaultError),
    /// A failure injected by a test.
    #[error("injected failure (test hook)")]
    Injected,
}

fn list(v: &[String]) -> String {
    if v.len() > 12 {
        format!("{}, ... ({} more)", v[..12].join(", "), v.len() - 12)
    } else {
        v.join(", ")
    }
}
