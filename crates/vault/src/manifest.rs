//! The manifest: architecture, text assets, generation defaults and the tensor directory,
//! stored as UTF-8 JSON so that it is self-describing and inspectable with any JSON tool.

use crate::arch::Architecture;
use serde::{Deserialize, Serialize};

/// Bytes of a dense tensor of `shape` (rows of its last dimension) in `format`, or `None`
/// where the shape is not a whole number of the format's blocks per row or the size does not
/// fit in 64 bits: the writer refuses such a tensor and the reader such a manifest, so that no
/// later product of dimensions can wrap.
pub fn dense_len(format: smoe_quant::Format, shape: &[usize]) -> Option<u64> {
    let cols = *shape.last().unwrap_or(&0);
    let rows = shape[..shape.len().saturating_sub(1)].iter().try_fold(1usize, |a, &d| a.checked_mul(d))?.max(1);
    let row = format.row_bytes(cols).ok()?;
    u64::try_from(row.checked_mul(rows)?).ok()
}
use smoe_quant::Format;

/// Features a reader must understand to use the vault. Empty in format 1.0; a future minor
/// version that changes meaning (not just adds fields) lists its feature here, and readers that
/// do not know it refuse the file.
pub const KNOWN_FEATURES: &[&str] = &[LAYER_EXPERT_PARTS, LAYER_BLOB_SIZES];

/// Feature: some MoE layers list their own expert parts ([`ExpertLayer::parts`]), as a GGUF
/// imported from a mixed quantization (Q4_K_M keeps some layers' `down` in Q6_K) needs.
pub const LAYER_EXPERT_PARTS: &str = "layer-expert-parts";

/// Feature: some MoE layers' blobs are smaller than [`ExpertIndex::blob_size`]
/// ([`ExpertLayer::blob_size`]), so a mixed quantization's smaller layers carry no padding
/// (Q4_K_M's Q4_K layers would otherwise be padded to the Q6_K layers' size: 6.6% of the
/// region, read by every streamed miss). Each layer's blobs still lie back to back, layer
/// after layer.
pub const LAYER_BLOB_SIZES: &str = "layer-blob-sizes";

/// Everything in the vault besides the raw tensor bytes.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// Tool and version that wrote the vault.
    pub created_by: String,
    /// Features required to read this vault (see [`KNOWN_FEATURES`]).
    #[serde(default)]
    pub required_features: Vec<String>,
    /// The model's architecture.
    pub architecture: Architecture,
    /// The source config.json, verbatim, for reference.
    pub source_config: serde_json::Value,
    /// Tokenizer and chat template.
    pub text: TextAssets,
    /// Generation defaults from generation_config.json.
    pub generation: GenerationDefaults,
    /// Dense tensors, in file order.
    pub dense: Vec<DenseEntry>,
    /// Routed experts.
    pub experts: ExpertIndex,
    /// Conversion notes, such as formats that fell back because rows did not fit.
    #[serde(default)]
    pub notes: Vec<String>,
}

/// Tokenizer files and chat template.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct TextAssets {
    /// The tokenizer.json file, verbatim.
    pub tokenizer_json: String,
    /// The Jinja chat template, if the checkpoint has one.
    pub chat_template: Option<String>,
    /// `bos_token` from tokenizer_config.json.
    pub bos_token: Option<String>,
    /// `eos_token` from tokenizer_config.json.
    pub eos_token: Option<String>,
    /// `pad_token` from tokenizer_config.json.
    pub pad_token: Option<String>,
    /// Whether prompts start with the BOS token (`add_bos_token`).
    #[serde(default)]
    pub add_bos_token: bool,
}

/// Sampling and stopping defaults from generation_config.json.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
pub struct GenerationDefaults {
    /// Beginning-of-sequence id.
    pub bos_token_id: Option<u32>,
    /// Ids that end generation.
    pub eos_token_ids: Vec<u32>,
    /// Whether the model card asks for sampling.
    pub do_sample: Option<bool>,
    /// Default temperature.
    pub temperature: Option<f64>,
    /// Default nucleus threshold.
    pub top_p: Option<f64>,
    /// Default top-k.
    pub top_k: Option<u32>,
    /// Default min-p.
    pub min_p: Option<f64>,
    /// Default repetition penalty.
    pub repetition_penalty: Option<f64>,
}

/// One dense tensor.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct DenseEntry {
    /// Canonical name (see [`crate::names`]).
    pub name: String,
    /// Storage format.
    #[serde(with = "format_name")]
    pub format: Format,
    /// `[rows, cols]` or `[n]`.
    pub shape: Vec<usize>,
    /// Offset from the start of the dense region.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// xxh3-64 of the bytes.
    pub checksum: u64,
    /// Name in the source checkpoint.
    #[serde(default)]
    pub source: String,
}

/// One matrix inside every expert blob.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PartEntry {
    /// `gate`, `up` or `down`.
    pub name: String,
    /// Storage format.
    #[serde(with = "format_name")]
    pub format: Format,
    /// `[rows, cols]`.
    pub shape: [usize; 2],
    /// Offset within the blob.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
}

/// Checksums of one MoE layer's blobs.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ExpertLayer {
    /// Decoder layer index.
    pub layer: usize,
    /// xxh3-64 of each expert's whole blob (padding included), by expert index.
    pub checksums: Vec<u64>,
    /// This layer's parts, where they differ from [`ExpertIndex::parts`] (feature
    /// [`LAYER_EXPERT_PARTS`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parts: Option<Vec<PartEntry>>,
    /// This layer's blob size, where it is smaller than [`ExpertIndex::blob_size`] (feature
    /// [`LAYER_BLOB_SIZES`]); a multiple of the alignment.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub blob_size: Option<u64>,
}

/// The expert region's directory. The region holds each listed layer's blobs back to back, layer
/// after layer: blob `e` of the `i`-th listed layer starts at `experts_offset + Σ_{j<i}
/// num_experts × size(j) + e × size(i)`, where `size(i)` is the layer's own
/// [`ExpertLayer::blob_size`] or else [`ExpertIndex::blob_size`] (without per-layer sizes:
/// `experts_offset + (i × num_experts + e) × blob_size`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct ExpertIndex {
    /// Bytes of the largest blob (of every blob, unless a layer gives its own size), a multiple
    /// of the alignment: a buffer this large holds any expert.
    pub blob_size: u64,
    /// The matrices inside each blob (the same for every expert of a layer; a layer may
    /// override them, see [`ExpertLayer::parts`]).
    pub parts: Vec<PartEntry>,
    /// MoE layers in order.
    pub layers: Vec<ExpertLayer>,
}

impl ExpertIndex {
    /// The parts of decoder layer `layer`'s blobs: its own where it lists them, else the
    /// common ones.
    pub fn layer_parts(&self, layer: usize) -> &[PartEntry] {
        self.layers.iter().find(|l| l.layer == layer).and_then(|l| l.parts.as_deref()).unwrap_or(&self.parts)
    }

    /// Bytes of each blob of the `i`-th listed layer.
    pub fn layer_blob_size(&self, i: usize) -> u64 {
        self.layers.get(i).and_then(|l| l.blob_size).unwrap_or(self.blob_size)
    }
}

mod format_name {
    use serde::{Deserialize, Deserializer, Serializer};
    use smoe_quant::Format;

    pub fn serialize<S: Serializer>(f: &Format, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(f.name())
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Format, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}
