/*!
The smoe vault: one self-describing, checksummed file per model.

A vault holds everything needed to run a model: a fixed header, a dense region (embeddings,
attention, norms, routers, shared experts, LM head), an expert region with one aligned blob per
(layer, expert) so that one read fetches one expert, and a JSON manifest with the
[`Architecture`], tokenizer, chat template, generation defaults and the tensor directory. The
byte layout is specified in `docs/vault-format.md`.

This crate owns the format only: writing ([`VaultWriter`]), opening and validating ([`Vault`]),
and checksums. It does not convert checkpoints (`smoe-convert`), cache experts (`smoe-store`) or
compute anything (`smoe-engine`).
*/
#![deny(missing_docs)]

pub mod arch;
pub mod header;
pub mod hugepages;
pub mod manifest;
pub mod names;
mod reader;
mod stacked;
mod writer;

pub use arch::{
    Architecture, CompressedAttention, Compression, ExpertAct, Family, HyperConnections, LayerKind, LinearAttention, Mla, Moe, QkNorm,
    Rope, RopeScaling, Router, SharedExperts, SparseAttention,
};
pub use header::Header;
pub use manifest::{DenseEntry, ExpertIndex, ExpertLayer, GenerationDefaults, Manifest, PartEntry, TextAssets};
pub use reader::{BlobLocation, Vault};
pub use smoe_quant::Format;
pub use stacked::StackedPart;
pub use writer::{layout_blob, remove_stale_temps, sync_parent, temp_path, VaultWriter};

use std::path::Path;

/// Everything that can go wrong reading or writing a vault.
#[derive(Debug, thiserror::Error)]
pub enum VaultError {
    /// An operating-system error on a file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// The file does not start with the vault magic.
    #[error("not a smoe vault (magic {found:02x?}, expected \"SMOEVLT\\0\")")]
    BadMagic {
        /// The first eight bytes found.
        found: [u8; 8],
    },
    /// A major version this build cannot read.
    #[error("vault format version {major}.{minor} is not supported (this build reads 1.x)")]
    UnsupportedVersion {
        /// Major version found.
        major: u16,
        /// Minor version found.
        minor: u16,
    },
    /// A feature flag this build does not know.
    #[error("vault requires feature '{0}', which this build does not support")]
    UnsupportedFeature(String),
    /// The file is shorter than its header says.
    #[error("truncated {what}: need {need} bytes, file has {have}")]
    Truncated {
        /// What was being read.
        what: String,
        /// Bytes needed.
        need: u64,
        /// Bytes present.
        have: u64,
    },
    /// A read ran past the end of the file.
    #[error("truncated vault: {path} ends before the data its manifest indexes")]
    ShortRead {
        /// The file.
        path: String,
    },
    /// A checksum did not match.
    #[error("checksum mismatch in {what}")]
    Checksum {
        /// The header, the manifest, a dense tensor or an expert blob, by name.
        what: String,
    },
    /// An (layer, expert) pair that is not in the vault.
    #[error("no expert {expert} in layer {layer}")]
    NoSuchExpert {
        /// Layer asked for.
        layer: usize,
        /// Expert asked for.
        expert: usize,
    },
    /// Inconsistent contents.
    #[error("corrupt vault: {0}")]
    Corrupt(String),
    /// API misuse (a bug in the caller).
    #[error("vault API misuse: {0}")]
    Usage(&'static str),
}

impl VaultError {
    /// Wraps an I/O error with the file it happened on; a short read becomes [`VaultError::ShortRead`].
    pub fn io(path: &Path, source: std::io::Error) -> VaultError {
        if source.kind() == std::io::ErrorKind::UnexpectedEof {
            return VaultError::ShortRead { path: path.display().to_string() };
        }
        VaultError::Io { path: path.display().to_string(), source }
    }
}

#[cfg(test)]
mod tests;
