//! Qwen3-Next checkpoints fuse projections that the vault keeps apart, and store their RMSNorm
//! weights as offsets from one. [`Qwen3NextParts`] presents such a checkpoint under the names
//! [`smoe_formats::hf::hf_name`] gives the vault's tensors, so `shatter` needs no branch of its
//! own:
//!
//! - `linear_attn.in_proj_qkvz` holds, for each key head `h` in turn, `[q_h | k_h | v | z]`
//!   where `v` and `z` are the `value_heads / key_heads` value heads that read key head `h`
//!   (transformers' `fix_query_key_value_ordering`). It is presented as `in_proj_qkv` (all q
//!   heads, all k heads, all v heads: the order the convolution's channels take) and
//!   `in_proj_z`; `in_proj_ba` (per key head `[b | a]` of its value heads) as `in_proj_b` and
//!   `in_proj_a`.
//! - `linear_attn.conv1d.weight` `[channels, 1, taps]` as `[channels, taps]`.
//! - `self_attn.q_proj` holds per head `[query | gate]` (`head_dim` each): presented as
//!   `q_proj` (the queries) and `q_gate_proj` (the output gate).
//! - Qwen3.5-MoE keeps each layer's experts fused: `mlp.experts.gate_up_proj` `[experts, 2 ×
//!   width, hidden]` (gate rows, then up rows) and `mlp.experts.down_proj` `[experts, hidden,
//!   width]`, rows = outputs. They are presented as the per-expert tensors
//!   (`mlp.experts.E.{gate,up,down}_proj.weight`) the converter reads for every family.
//! - The RMSNorms (`input_layernorm`, `post_attention_layernorm`, `model.norm`, `q_norm`,
//!   `k_norm`) compute `x̂ · (1 + w)`: presented with the one added, as the plain weights the
//!   vault holds. The linear attention's gated norm (`linear_attn.norm`) multiplies by `w`
//!   itself and is left as it is.

use crate::shatter::TensorProvider;
use crate::ConvertError;
use smoe_formats::FormatError;
use smoe_vault::Architecture;

/// A Qwen3-Next checkpoint seen through the vault's names (see the module documentation).
pub struct Qwen3NextParts<'a> {
    inner: &'a dyn TensorProvider,
    /// Key heads, value heads per key head, key and value head dimensions.
    key_heads: usize,
    group: usize,
    key_dim: usize,
    value_dim: usize,
    /// Query heads and their dimensions (full attention).
    heads: usize,
    head_dim: usize,
    /// Routed experts per layer.
    experts: usize,
}

/// A per-expert name's rows within a fused expert tensor: the tensor, its first row, how many.
struct ExpertRows {
    src: String,
    first: usize,
    rows: usize,
}

/// Which fused tensor a presented name reads, and how its rows map.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Split {
    Qkv,
    Z,
    B,
    A,
    Query,
    Gate,
}

const SPLITS: [(&str, &str, Split); 6] = [
    ("linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_qkvz.weight", Split::Qkv),
    ("linear_attn.in_proj_z.weight", "linear_attn.in_proj_qkvz.weight", Split::Z),
    ("linear_attn.in_proj_b.weight", "linear_attn.in_proj_ba.weight", Split::B),
    ("linear_attn.in_proj_a.weight", "linear_attn.in_proj_ba.weight", Split::A),
    ("self_attn.q_proj.weight", "self_attn.q_proj.weight", Split::Query),
    ("self_attn.q_gate_proj.weight", "self_attn.q_proj.weight", Split::Gate),
];

/// Norms stored as offsets from one (the final one is `model.norm` or, in Qwen3.5's multimodal
/// checkpoints, `model.language_model.norm`, which ends the same way).
const OFFSET_NORMS: [&str; 5] = [
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "model.norm.weight",
];

impl<'a> Qwen3NextParts<'a> {
    /// Wraps `inner` for a Qwen3-Next `arch`.
    pub fn new(inner: &'a dyn TensorProvider, arch: &Architecture) -> Result<Qwen3NextParts<'a>, ConvertError> {
        let la = arch.linear_attention.as_ref().ok_or_else(|| FormatError::BadInput("qwen3_next without linear attention".into()))?;
        Ok(Qwen3NextParts {
            inner,
            key_heads: la.key_heads,
            group: la.value_heads / la.key_heads,
            key_dim: la.key_dim,
            value_dim: la.value_dim,
            heads: arch.num_heads,
            head_dim: arch.head_dim,
            experts: arch.moe.num_experts,
        })
    }

    /// Where a per-expert name `...mlp.experts.E.{gate,up,down}_proj.weight` lies in its layer's
    /// fused tensors, if the checkpoint fuses them.
    fn expert_rows(&self, name: &str) -> Option<ExpertRows> {
        let (prefix, rest) = name.split_at(name.find("mlp.experts.")? + "mlp.experts.".len());
        let (e, part) = rest.split_once('.')?;
        let e: usize = e.parse().ok().filter(|&e| e < self.experts)?;
        let (fused, half) = match part {
            "gate_proj.weight" => ("gate_up_proj", Some(0)),
            "up_proj.weight" => ("gate_up_proj", Some(1)),
            "down_proj.weight" => ("down_proj", None),
            _ => return None,
        };
        let src = format!("{prefix}{fused}");
        let shape = self.inner.shape(&src)?;
        let [experts, outs, _] = shape[..] else { return None };
        if experts != self.experts {
            return None;
        }
        Some(match half {
            Some(h) => ExpertRows { src, first: e * outs + h * outs / 2, rows: outs / 2 },
            None => ExpertRows { src, first: e * outs, rows: outs },
        })
    }

    /// Whether `name` is a fused expert tensor (presented per expert instead).
    fn is_fused_experts(name: &str) -> bool {
        name.ends_with("mlp.experts.gate_up_proj") || name.ends_with("mlp.experts.down_proj")
    }

    /// The fused tensor behind a presented name, the split, and the layer prefix.
    fn split(&self, name: &str) -> Option<(String, Split)> {
        SPLITS.iter().find_map(|&(shown, fused, split)| {
            let prefix = name.strip_suffix(shown)?;
            let src = format!("{prefix}{fused}");
            // A checkpoint already split (no fused tensor) is read as it is.
            let query = matches!(split, Split::Query | Split::Gate);
            (self.inner.shape(&src).is_some() && (!query || self.fused_query(&src))).then_some((src, split))
        })
    }

    /// Whether a `q_proj` holds the gate beside the queries (twice the query rows).
    fn fused_query(&self, q: &str) -> bool {
        self.inner.shape(q).is_some_and(|s| s.first() == Some(&(2 * self.heads * self.head_dim)))
    }

    /// Rows of a split part.
    fn rows_of(&self, split: Split) -> usize {
        let (kh, g, kd, vd) = (self.key_heads, self.group, self.key_dim, self.value_dim);
        match split {
            Split::Qkv => 2 * kh * kd + kh * g * vd,
            Split::Z => kh * g * vd,
            Split::B | Split::A => kh * g,
            Split::Query | Split::Gate => self.heads * self.head_dim,
        }
    }

    /// The fused tensor's row behind row `r` of a split part.
    fn source_row(&self, split: Split, r: usize) -> usize {
        let (kh, g, kd, vd) = (self.key_heads, self.group, self.key_dim, self.value_dim);
        // One key head's block of in_proj_qkvz: q, k, then its group's v and z.
        let block = 2 * kd + 2 * g * vd;
        match split {
            Split::Qkv if r < kh * kd => (r / kd) * block + r % kd,
            Split::Qkv if r < 2 * kh * kd => {
                let r = r - kh * kd;
                (r / kd) * block + kd + r % kd
            }
            Split::Qkv => {
                let r = r - 2 * kh * kd;
                (r / (g * vd)) * block + 2 * kd + r % (g * vd)
            }
            Split::Z => (r / (g * vd)) * block + 2 * kd + g * vd + r % (g * vd),
            Split::B => (r / g) * 2 * g + r % g,
            Split::A => (r / g) * 2 * g + g + r % g,
            Split::Query => (r / self.head_dim) * 2 * self.head_dim + r % self.head_dim,
            Split::Gate => (r / self.head_dim) * 2 * self.head_dim + self.head_dim + r % self.head_dim,
        }
    }

    fn is_offset_norm(name: &str) -> bool {
        OFFSET_NORMS.iter().any(|n| name.ends_with(n)) && !name.contains("linear_attn")
    }
}

impl TensorProvider for Qwen3NextParts<'_> {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        if let Some(x) = self.expert_rows(name) {
            return Some(vec![x.rows, *self.inner.shape(&x.src)?.last()?]);
        }
        if Self::is_fused_experts(name) {
            return None;
        }
        if let Some((src, split)) = self.split(name) {
            let cols = *self.inner.shape(&src)?.last()?;
            return Some(vec![self.rows_of(split), cols]);
        }
        let shape = self.inner.shape(name)?;
        // conv1d: [channels, 1, taps] as [channels, taps].
        if name.ends_with("linear_attn.conv1d.weight") && shape.len() == 3 && shape[1] == 1 {
            return Some(vec![shape[0], shape[2]]);
        }
        Some(shape)
    }

    fn names(&self) -> Vec<String> {
        let mut v = Vec::new();
        for n in self.inner.names() {
            if Self::is_fused_experts(&n) {
                let prefix = &n[..n.rfind("mlp.experts.").expect("suffix matched") + "mlp.experts.".len()];
                let parts: &[&str] = if n.ends_with("gate_up_proj") { &["gate", "up"] } else { &["down"] };
                for e in 0..self.experts {
                    v.extend(parts.iter().map(|p| format!("{prefix}{e}.{p}_proj.weight")));
                }
                continue;
            }
            let fused: Vec<_> = SPLITS.iter().filter(|(_, f, _)| n.ends_with(f)).collect();
            if fused.is_empty() {
                v.push(n);
                continue;
            }
            let prefix = n.strip_suffix(fused[0].1).expect("suffix matched").to_string();
            let shown: Vec<String> = fused.iter().map(|(s, _, _)| format!("{prefix}{s}")).filter(|s| self.split(s).is_some()).collect();
            if shown.is_empty() {
                v.push(n);
            } else {
                v.extend(shown);
            }
        }
        v
    }

    fn read_rows(&self, name: &str, start: usize, n: usize, out: &mut [f32]) -> Result<(), ConvertError> {
        if let Some(x) = self.expert_rows(name) {
            if start + n > x.rows {
                return Err(FormatError::Internal(format!("{name}: rows {start}..{} of {}", start + n, x.rows)).into());
            }
            return self.inner.read_rows(&x.src, x.first + start, n, out);
        }
        if let Some((src, split)) = self.split(name) {
            let cols = self.inner.shape(&src).and_then(|s| s.last().copied()).ok_or_else(|| ConvertError::Missing(vec![src.clone()]))?;
            if start + n > self.rows_of(split) || out.len() != n * cols {
                return Err(FormatError::Internal(format!("{name}: rows {start}..{} of {}", start + n, self.rows_of(split))).into());
            }
            for (i, row) in out.chunks_exact_mut(cols).enumerate() {
                self.inner.read_rows(&src, self.source_row(split, start + i), 1, row)?;
            }
            return Ok(());
        }
        self.inner.read_rows(name, start, n, out)?;
        if Self::is_offset_norm(name) {
            out.iter_mut().for_each(|v| *v += 1.0);
        }
        Ok(())
    }

    fn read_quantized(
        &self,
        name: &str,
        format: smoe_quant::Format,
        start: usize,
        n: usize,
        dst: &mut [u8],
    ) -> Option<Result<(), ConvertError>> {
        // Only what is read as it is (a synthetic source's expert blocks); parts and norms are
        // made from values.
        if self.split(name).is_some() || self.expert_rows(name).is_some() || Self::is_offset_norm(name) {
            return None;
        }
        self.inner.read_quantized(name, format, start, n, dst)
    }

    fn native_format(&self, name: &str) -> Option<smoe_quant::Format> {
        if self.split(name).is_some() || self.expert_rows(name).is_some() || Self::is_offset_norm(name) {
            return None;
        }
        self.inner.native_format(name)
    }

    fn source_bytes(&self, name: &str) -> u64 {
        if let Some(x) = self.expert_rows(name) {
            let rows = self.inner.shape(&x.src).map_or(1, |s| s[..s.len() - 1].iter().product::<usize>().max(1));
            return self.inner.source_bytes(&x.src) * x.rows as u64 / rows as u64;
        }
        match self.split(name) {
            // Each part counts its share of the fused tensor.
            Some((src, split)) => {
                let rows = self.inner.shape(&src).map_or(1, |s| s[..s.len() - 1].iter().product::<usize>().max(1));
                self.inner.source_bytes(&src) * self.rows_of(split) as u64 / rows as u64
            }
            None => self.inner.source_bytes(name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row of the fused tensors is presented exactly once.
    #[test]
    fn splits_cover_the_fused_rows_once() {
        let p = Qwen3NextParts {
            inner: &smoe_formats::safetensors::Checkpoint { dir: Default::default(), tensors: Default::default() },
            key_heads: 2,
            group: 3,
            key_dim: 4,
            value_dim: 5,
            heads: 3,
            head_dim: 6,
            experts: 0,
        };
        for parts in [[Split::Qkv, Split::Z].as_slice(), &[Split::B, Split::A], &[Split::Query, Split::Gate]] {
            let mut seen: Vec<usize> =
                parts.iter().flat_map(|&s| (0..p.rows_of(s)).map(move |r| (s, r))).map(|(s, r)| p.source_row(s, r)).collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..seen.len()).collect::<Vec<_>>(), "{parts:?}");
        }
        // The second key head's first query row, and its group's first value and gate rows.
        let block = 2 * 4 + 2 * 3 * 5;
        assert_eq!(p.source_row(Split::Qkv, 4), block);
        assert_eq!(p.source_row(Split::Qkv, 2 * 2 * 4 + 3 * 5), block + 8);
        assert_eq!(p.source_row(Split::Z, 3 * 5), block + 8 + 15);
    }
}
