/*!
The expert store: how the engine gets a routed expert's weights.

The engine asks for the experts one layer needs ([`ExpertSource::with_experts`]) and computes
with each as it becomes available. [`ResidentExperts`] holds every blob in memory; the streaming
store reads them from the vault into a bounded cache. Both hand out the same [`ExpertView`], so
the engine's math does not depend on where the bytes came from.

This crate owns fetching, caching and the I/O; it does not dequantize or compute.
*/
#![deny(missing_docs)]

mod resident;

pub use resident::ResidentExperts;

use smoe_quant::QMatrix;
use smoe_vault::{PartEntry, Vault};

/// Errors while fetching experts. Messages name the layer and expert.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Reading a blob failed.
    #[error("reading expert {expert} of layer {layer}: {source}")]
    Read {
        /// Decoder layer.
        layer: usize,
        /// Expert index.
        expert: usize,
        /// The cause.
        source: smoe_vault::VaultError,
    },
    /// A blob's checksum did not match; it was not used.
    #[error("expert {expert} of layer {layer} failed its checksum; not computed on")]
    Checksum {
        /// Decoder layer.
        layer: usize,
        /// Expert index.
        expert: usize,
    },
    /// Asking for an expert that does not exist.
    #[error("no expert {expert} in layer {layer}")]
    NoSuchExpert {
        /// Decoder layer.
        layer: usize,
        /// Expert index.
        expert: usize,
    },
    /// Configuration problems (cache too small, bad sizes).
    #[error("{0}")]
    Config(String),
}

/// The three matrices of one routed expert.
#[derive(Clone, Copy, Debug)]
pub struct ExpertView<'a> {
    /// `[intermediate, hidden]`.
    pub gate: QMatrix<'a>,
    /// `[intermediate, hidden]`.
    pub up: QMatrix<'a>,
    /// `[hidden, intermediate]`.
    pub down: QMatrix<'a>,
}

/// Where each part sits inside a blob (the same for every expert of a vault).
#[derive(Clone, Debug)]
pub struct BlobLayout {
    /// Gate, up and down.
    pub parts: [PartEntry; 3],
    /// Bytes per blob.
    pub blob_size: usize,
}

impl BlobLayout {
    /// The layout of a vault's blobs.
    pub fn of(vault: &Vault) -> BlobLayout {
        let x = &vault.manifest().experts;
        // The reader validated three parts named gate, up, down.
        BlobLayout {
            parts: [x.parts[0].clone(), x.parts[1].clone(), x.parts[2].clone()],
            blob_size: x.blob_size as usize,
        }
    }

    /// Views a blob's bytes as an expert.
    pub fn view<'a>(&self, blob: &'a [u8]) -> ExpertView<'a> {
        let m = |p: &PartEntry| QMatrix {
            format: p.format,
            rows: p.shape[0],
            cols: p.shape[1],
            data: &blob[p.offset as usize..(p.offset + p.len) as usize],
        };
        ExpertView {
            gate: m(&self.parts[0]),
            up: m(&self.parts[1]),
            down: m(&self.parts[2]),
        }
    }
}

/// Counters every store keeps. `hits + misses` is the number of expert uses.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StoreStats {
    /// Uses served from memory.
    pub hits: u64,
    /// Uses that needed a read.
    pub misses: u64,
    /// Bytes read from the vault.
    pub bytes_read: u64,
    /// Seconds the caller waited for reads.
    pub wait_seconds: f64,
}

/// A source of expert weights.
pub trait ExpertSource: Send + Sync {
    /// The layout of every blob.
    fn layout(&self) -> &BlobLayout;

    /// Calls `f(i, view)` once for each `experts[i]` of decoder layer `layer`, as soon as its
    /// weights are in memory (resident ones first, then in completion order). The view is only
    /// valid during the call: the slot is pinned for exactly that long.
    fn with_experts(
        &self,
        layer: usize,
        experts: &[u32],
        f: &mut dyn FnMut(usize, ExpertView<'_>),
    ) -> Result<(), StoreError>;

    /// Counters since creation.
    fn stats(&self) -> StoreStats;
}
