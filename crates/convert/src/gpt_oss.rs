//! gpt-oss checkpoints keep each layer's routed experts fused, and the published ones keep them
//! in MXFP4. [`FusedExperts`] presents such a checkpoint as the per-expert tensors the converter
//! reads for every family (`model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`, rows =
//! outputs), so `shatter` needs no gpt-oss branch of its own.
//!
//! Two layouts are read:
//! - transformers' (and the bf16 re-uploads'): `experts.gate_up_proj` `[E, hidden, 2 × width]`
//!   and `experts.down_proj` `[E, width, hidden]`, inputs first (the products are `x @ W`);
//! - the hub's MXFP4: `experts.{gate_up,down}_proj_blocks` `[E, outputs, inputs / 32, 16]` (two
//!   e2m1 values a byte, element `2j` in the low nibble of byte `j`) and `_scales` `[E, outputs,
//!   inputs / 32]` (e8m0: the block's scale is `2^(s - 127)`), as transformers'
//!   `convert_moe_packed_tensors` decodes them. Their rows copy into the vault's MXFP4 blocks as
//!   they are ([`TensorProvider::read_quantized`]); any other expert format dequantizes them.
//!
//! In both, gate and up columns interleave (`gate_up[..., 0::2]` is the gate, `1::2` the up):
//! gate row `r` is fused row `2r`, up row `r` is `2r + 1`. `experts.gate_up_proj_bias` interleaves
//! the same way and is presented as `experts.gate_proj_bias` and `experts.up_proj_bias`.

use crate::shatter::TensorProvider;
use crate::ConvertError;
use smoe_formats::safetensors::Checkpoint;
use smoe_formats::FormatError;
use smoe_quant::Format;
use smoe_vault::Architecture;

/// The experts' format of a checkpoint that ships them quantized in a format smoe keeps as it
/// is: MXFP4 for gpt-oss's published checkpoints (`quantization_config.quant_method: mxfp4`).
/// `smoe shatter` uses it when no `--experts` is given, so their blocks are copied, not
/// re-quantized.
pub fn native_expert_format(config: &serde_json::Value) -> Option<Format> {
    let method = config.get("quantization_config")?.get("quant_method")?.as_str()?;
    (method == "mxfp4").then_some(Format::MXFP4)
}

/// A gpt-oss checkpoint seen through per-expert tensor names (see the module documentation).
pub struct FusedExperts<'a> {
    inner: &'a Checkpoint,
    experts: usize,
    hidden: usize,
    width: usize,
    mxfp4: bool,
}

/// Which fused tensor a per-expert name reads, and which of its rows.
struct Part {
    layer: usize,
    expert: usize,
    /// `gate_up_proj` or `down_proj`.
    fused: &'static str,
    /// Rows of the part (outputs) and their length (inputs).
    rows: usize,
    cols: usize,
    /// Fused output row of the part's row `r`: `stride * r + first`.
    stride: usize,
    first: usize,
}

impl<'a> FusedExperts<'a> {
    /// Wraps `inner`, checking that its fused expert tensors have the shapes `arch` implies.
    pub fn new(inner: &'a Checkpoint, arch: &Architecture) -> Result<FusedExperts<'a>, ConvertError> {
        let (experts, hidden, width) = (arch.moe.num_experts, arch.hidden_size, arch.moe.intermediate_size);
        let Some(&l) = arch.moe_layers().first() else {
            return Err(FormatError::BadInput("gpt-oss checkpoint without MoE layers".into()).into());
        };
        let mxfp4 = inner.tensors.contains_key(&format!("model.layers.{l}.mlp.experts.gate_up_proj_blocks"));
        let me = FusedExperts { inner, experts, hidden, width, mxfp4 };
        for l in arch.moe_layers() {
            for (fused, outs, ins) in [("gate_up_proj", 2 * width, hidden), ("down_proj", hidden, width)] {
                let want: Vec<Vec<usize>> = if mxfp4 {
                    if !ins.is_multiple_of(32) {
                        return Err(FormatError::BadInput(format!("MXFP4 experts with rows of {ins}, not a multiple of 32")).into());
                    }
                    vec![vec![experts, outs, ins / 32, 16], vec![experts, outs, ins / 32]]
                } else {
                    vec![vec![experts, ins, outs]]
                };
                let names = me.sources(l, fused);
                for (name, want) in names.iter().zip(want) {
                    let found = inner.tensors.get(name).map(|t| t.shape.clone());
                    match found {
                        None => return Err(ConvertError::Missing(vec![name.clone()])),
                        Some(f) if f != want => return Err(ConvertError::Shape { tensor: name.clone(), found: f, expected: want }),
                        Some(_) => {}
                    }
                    // Blocks and scales are bytes, copied as they are; anything else would be
                    // read as the wrong numbers.
                    let dtype = inner.tensors[name].dtype;
                    if mxfp4 && dtype != smoe_formats::safetensors::DType::U8 {
                        return Err(
                            FormatError::BadInput(format!("{name} is {dtype:?}, not U8 (MXFP4 blocks and scales are bytes)")).into()
                        );
                    }
                    if !mxfp4 && dtype == smoe_formats::safetensors::DType::U8 {
                        return Err(FormatError::BadInput(format!("{name} is U8: fused experts without their _blocks/_scales")).into());
                    }
                }
            }
        }
        Ok(me)
    }

    /// Whether `ckpt` keeps its experts fused (a checkpoint written per expert, as `smoe synth`
    /// does, is read as it is).
    pub fn applies(ckpt: &Checkpoint) -> bool {
        ckpt.tensors.keys().any(|n| Self::is_fused(n))
    }

    /// The checkpoint tensors holding layer `l`'s fused `gate_up_proj` or `down_proj`.
    fn sources(&self, l: usize, fused: &str) -> Vec<String> {
        let p = format!("model.layers.{l}.mlp.experts.{fused}");
        if self.mxfp4 {
            vec![format!("{p}_blocks"), format!("{p}_scales")]
        } else {
            vec![p]
        }
    }

    /// Whether `name` is a fused expert tensor (replaced by the per-expert names), or the fused
    /// gate/up bias (replaced by its two halves).
    fn is_fused(name: &str) -> bool {
        name.contains(".mlp.experts.") && (!name.ends_with("_bias") || name.ends_with("gate_up_proj_bias")) && !name.ends_with(".weight")
    }

    /// The fused bias behind a virtual `experts.{gate,up}_proj_bias`, and which columns (0: even,
    /// 1: odd) it takes.
    fn bias_half(name: &str) -> Option<(String, usize)> {
        if let Some(p) = name.strip_suffix("mlp.experts.gate_proj_bias") {
            return Some((format!("{p}mlp.experts.gate_up_proj_bias"), 0));
        }
        name.strip_suffix("mlp.experts.up_proj_bias").map(|p| (format!("{p}mlp.experts.gate_up_proj_bias"), 1))
    }

    /// Parses a per-expert name `model.layers.L.mlp.experts.E.{gate,up,down}_proj.weight`.
    fn part(&self, name: &str) -> Option<Part> {
        let rest = name.strip_prefix("model.layers.")?;
        let (layer, rest) = rest.split_once(".mlp.experts.")?;
        let (expert, rest) = rest.split_once('.')?;
        let (layer, expert) = (layer.parse().ok()?, expert.parse().ok()?);
        if expert >= self.experts {
            return None;
        }
        let (h, w) = (self.hidden, self.width);
        Some(match rest {
            "gate_proj.weight" => Part { layer, expert, fused: "gate_up_proj", rows: w, cols: h, stride: 2, first: 0 },
            "up_proj.weight" => Part { layer, expert, fused: "gate_up_proj", rows: w, cols: h, stride: 2, first: 1 },
            "down_proj.weight" => Part { layer, expert, fused: "down_proj", rows: h, cols: w, stride: 1, first: 0 },
            _ => return None,
        })
    }

    fn tensor(&self, name: &str) -> Result<&smoe_formats::safetensors::TensorInfo, ConvertError> {
        self.inner.tensors.get(name).ok_or_else(|| ConvertError::Missing(vec![name.to_string()]))
    }

    /// Rows `start..start + n` of a part as f32.
    fn read_part(&self, p: &Part, start: usize, n: usize, out: &mut [f32]) -> Result<(), ConvertError> {
        if start + n > p.rows || out.len() != n * p.cols {
            return Err(FormatError::Internal(format!("rows {start}..{} of an expert part of {} rows", start + n, p.rows)).into());
        }
        let names = self.sources(p.layer, p.fused);
        if self.mxfp4 {
            let mut q = vec![0u8; n * p.cols / 32 * BLOCK_BYTES];
            self.read_blocks(p, start, n, &mut q)?;
            return smoe_quant::dequantize(Format::MXFP4, &q, out).map_err(|e| FormatError::Internal(e.to_string()).into());
        }
        // transformers' layout: the expert's [inputs, outputs] matrix, read whole and taken
        // apart by columns (one expert at a time, so memory stays bounded; the hub's MXFP4
        // layout above is read row by row).
        let t = self.tensor(&names[0])?;
        let outs = t.cols();
        let mut m = vec![0f32; p.cols * outs];
        t.read_rows_f32(p.expert * p.cols, p.cols, &mut Vec::new(), &mut m)?;
        for (i, row) in out.chunks_exact_mut(p.cols).enumerate() {
            let src = p.stride * (start + i) + p.first;
            for (c, v) in row.iter_mut().enumerate() {
                *v = m[c * outs + src];
            }
        }
        Ok(())
    }

    /// Rows `start..start + n` of a part of an MXFP4 checkpoint as ggml's `block_mxfp4`s (the
    /// e8m0 scale byte, then sixteen bytes: element `j` in the low nibble of byte `j`, element
    /// `j + 16` in the high one).
    fn read_blocks(&self, p: &Part, start: usize, n: usize, dst: &mut [u8]) -> Result<(), ConvertError> {
        let names = self.sources(p.layer, p.fused);
        let (blocks, scales) = (self.tensor(&names[0])?, self.tensor(&names[1])?);
        let per_row = p.cols / 32;
        let fused_rows = if p.fused == "gate_up_proj" { 2 * self.width } else { self.hidden };
        let (mut qs, mut sc) = (vec![0u8; per_row * 16], vec![0u8; per_row]);
        for (i, out) in dst.chunks_exact_mut(per_row * BLOCK_BYTES).take(n).enumerate() {
            let row = p.expert * fused_rows + p.stride * (start + i) + p.first;
            blocks.read_rows_raw(row * per_row, per_row, &mut qs)?;
            scales.read_rows_raw(row, 1, &mut sc)?;
            for ((o, hub), &s) in out.chunks_exact_mut(BLOCK_BYTES).zip(qs.chunks_exact(16)).zip(&sc) {
                o[0] = s;
                repack_hub_block(hub.try_into().expect("16 bytes"), (&mut o[1..]).try_into().expect("16 bytes"));
            }
        }
        Ok(())
    }
}

/// Bytes of one ggml `block_mxfp4`: a scale byte and sixteen bytes of nibbles.
pub(crate) const BLOCK_BYTES: usize = std::mem::size_of::<smoe_quant::blocks::BlockMxfp4>();

/// The hub's sixteen bytes (element `2j` low, `2j + 1` high in byte `j`) as ggml's (element `j`
/// low, `j + 16` high).
pub fn repack_hub_block(hub: &[u8; 16], ggml: &mut [u8; 16]) {
    let code = |e: usize| (hub[e / 2] >> (4 * (e % 2))) & 0x0f;
    for (j, g) in ggml.iter_mut().enumerate() {
        *g = code(j) | (code(j + 16) << 4);
    }
}

impl TensorProvider for FusedExperts<'_> {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        match self.part(name) {
            Some(p) => Some(vec![p.rows, p.cols]),
            None if Self::is_fused(name) => None,
            None => match Self::bias_half(name) {
                Some((fused, _)) => self.inner.shape(&fused).map(|s| vec![s[0], s[1] / 2]),
                None => self.inner.shape(name),
            },
        }
    }
    fn names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.inner.names().into_iter().filter(|n| !Self::is_fused(n)).collect();
        let mut layers: Vec<usize> = self
            .inner
            .tensors
            .keys()
            .filter(|n| Self::is_fused(n))
            .filter_map(|n| n.strip_prefix("model.layers.")?.split('.').next()?.parse().ok())
            .collect();
        layers.sort_unstable();
        layers.dedup();
        for l in layers {
            for e in 0..self.experts {
                for part in ["gate", "up", "down"] {
                    v.push(format!("model.layers.{l}.mlp.experts.{e}.{part}_proj.weight"));
                }
            }
            if self.inner.tensors.contains_key(&format!("model.layers.{l}.mlp.experts.gate_up_proj_bias")) {
                for part in ["gate", "up"] {
                    v.push(format!("model.layers.{l}.mlp.experts.{part}_proj_bias"));
                }
            }
        }
        v
    }
    fn read_rows(&self, name: &str, start: usize, n: usize, out: &mut [f32]) -> Result<(), ConvertError> {
        if let Some(p) = self.part(name) {
            return self.read_part(&p, start, n, out);
        }
        let Some((fused, half)) = Self::bias_half(name) else {
            return self.inner.read_rows(name, start, n, out);
        };
        // Interleaved [g0, u0, g1, u1, ...]: the gate takes the even columns, the up the odd.
        let w = self.width;
        if out.len() != n * w {
            return Err(FormatError::Internal(format!("{name}: {} values for {n} rows of {w}", out.len())).into());
        }
        let mut both = vec![0f32; n * 2 * w];
        self.inner.read_rows(&fused, start, n, &mut both)?;
        for (o, b) in out.iter_mut().zip(both.iter().skip(half).step_by(2)) {
            *o = *b;
        }
        Ok(())
    }
    fn read_quantized(&self, name: &str, format: Format, start: usize, n: usize, dst: &mut [u8]) -> Option<Result<(), ConvertError>> {
        // The hub's blocks go into an MXFP4 vault as they are; any other format re-encodes
        // the decoded values.
        let p = self.part(name)?;
        if !self.mxfp4 || format != Format::MXFP4 {
            return None;
        }
        if dst.len() != n * p.cols / 32 * BLOCK_BYTES {
            return Some(Err(FormatError::Internal(format!("{name}: {} bytes for {n} MXFP4 rows", dst.len())).into()));
        }
        Some(self.read_blocks(&p, start, n, dst))
    }
    fn source_bytes(&self, name: &str) -> u64 {
        if let Some((fused, _)) = Self::bias_half(name) {
            return self.inner.source_bytes(&fused) / 2;
        }
        match self.part(name) {
            Some(p) => {
                let total: u64 = self.sources(p.layer, p.fused).iter().map(|s| self.inner.source_bytes(s)).sum();
                total * p.rows as u64 / (self.experts * if p.fused == "gate_up_proj" { 2 * self.width } else { self.hidden }) as u64
            }
            None => self.inner.source_bytes(name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Element `e` of a hub block (code `e / 2` here, so that elements `j` and `j + 16`
    /// differ) lands in ggml's place: the low nibble of byte `j` for `j < 16`, else the high
    /// nibble of byte `j - 16`.
    #[test]
    fn hub_blocks_repack_to_ggml_order() {
        let code = |e: usize| (e / 2) as u8;
        let hub: [u8; 16] = std::array::from_fn(|j| code(2 * j) | (code(2 * j + 1) << 4));
        let mut g = [0u8; 16];
        repack_hub_block(&hub, &mut g);
        for j in 0..16 {
            assert_eq!(g[j] & 0x0f, code(j), "element {j}");
            assert_eq!(g[j] >> 4, code(j + 16), "element {}", j + 16);
        }
    }
}
