//! llama.cpp's file types (`Q4_K_M`, `Q2_K`, ...): the format `llama-quantize` gives each
//! tensor, so that `shatter --mix` and `synth --mix` write the layout of the files people
//! download rather than one format for everything.
//!
//! A file type is a base format plus rules by the tensor's role, read from its GGUF name as
//! llama.cpp's quantizer reads it (`llama_tensor_get_type_impl` in llama-cpp-python 0.3.36's
//! `vendor/llama.cpp/src/llama-quant.cpp`): the output head gets Q6_K; Q4_K_M and Q5_K_M give
//! the value projections and the FFN down projections Q6_K in "more bits" layers (the first
//! and last eighth and every third between); models of exactly eight experts get Q8_0 keys
//! and values. The files llama.cpp's quantizer made from the `qwen3_moe_k` fixture
//! (`testdata/gguf-kquant`) are the check: the same format for every tensor.
//!
//! Where a chosen format does not fit a tensor's rows, the shatter's own fallback applies (it
//! notes each one), as llama.cpp falls back to a 32-wide format.

use crate::ExpertFormats;
use smoe_formats::gguf::names::{expert_tensor, tensor_name};
use smoe_quant::Format;
use smoe_vault::{names, Architecture};
use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::str::FromStr;

/// A llama.cpp file type whose per-tensor formats smoe reproduces.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlamaFileType {
    /// Q2_K base; Q3_K down projections and attention output; values Q4_K where four or more
    /// query heads share a key head, else Q3_K.
    Q2_K,
    /// Q3_K base; Q4_K down projections and attention output, Q5_K in the first sixteenth of
    /// the down projections and the first two value projections.
    Q3_K_M,
    /// Q4_K base; Q6_K values and down projections in half the layers.
    Q4_K_M,
    /// Q5_K base; Q6_K values and down projections in half the layers.
    Q5_K_M,
    /// Q6_K everywhere but eight-expert models' keys and values (Q8_0).
    Q6_K,
    /// Q8_0 everywhere.
    Q8_0,
}

const ALL: [(LlamaFileType, &str); 6] = [
    (LlamaFileType::Q2_K, "Q2_K"),
    (LlamaFileType::Q3_K_M, "Q3_K_M"),
    (LlamaFileType::Q4_K_M, "Q4_K_M"),
    (LlamaFileType::Q5_K_M, "Q5_K_M"),
    (LlamaFileType::Q6_K, "Q6_K"),
    (LlamaFileType::Q8_0, "Q8_0"),
];

/// A tensor's role as llama.cpp's quantizer tells it from the GGUF name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    TokenEmbd,
    Output,
    /// `attn_v`, and the fused `attn_qkv` (Qwen3-Next's linear attention), which llama.cpp
    /// counts among the value projections.
    AttnV,
    AttnK,
    AttnOutput,
    FfnDown,
    Other,
}

fn role(gguf_name: &str) -> Role {
    // The order of llama.cpp's `tensor_get_category`: `ffn_up` and `ffn_gate` before `ffn_down`.
    match gguf_name {
        "output.weight" => Role::Output,
        "token_embd.weight" => Role::TokenEmbd,
        n if n.contains("attn_qkv.weight") || n.contains("attn_v.weight") => Role::AttnV,
        n if n.contains("attn_k.weight") => Role::AttnK,
        n if n.contains("attn_output.weight") => Role::AttnOutput,
        n if n.contains("ffn_up") || n.contains("ffn_gate") => Role::Other,
        n if n.contains("ffn_down") => Role::FfnDown,
        _ => Role::Other,
    }
}

/// llama.cpp's `use_more_bits`: the first and last eighth of `n`, and every third between.
fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i as i64 - (n / 8) as i64).rem_euclid(3) == 2
}

/// The decoder layer of a GGUF name `blk.N.…`.
fn layer_of(gguf_name: &str) -> Option<usize> {
    gguf_name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

impl LlamaFileType {
    /// The format of every tensor no rule names.
    pub fn base(self) -> Format {
        match self {
            LlamaFileType::Q2_K => Format::Q2_K,
            LlamaFileType::Q3_K_M => Format::Q3_K,
            LlamaFileType::Q4_K_M => Format::Q4_K,
            LlamaFileType::Q5_K_M => Format::Q5_K,
            LlamaFileType::Q6_K => Format::Q6_K,
            LlamaFileType::Q8_0 => Format::Q8_0,
        }
    }

    /// GGUF's `general.file_type` (llama.cpp's `LLAMA_FTYPE_MOSTLY_*`).
    pub fn gguf_file_type(self) -> u32 {
        match self {
            LlamaFileType::Q2_K => 10,
            LlamaFileType::Q3_K_M => 12,
            LlamaFileType::Q4_K_M => 15,
            LlamaFileType::Q5_K_M => 17,
            LlamaFileType::Q6_K => 18,
            LlamaFileType::Q8_0 => 7,
        }
    }

    /// The format of a matrix by role. `index` and `count`: for values, the tensor's place
    /// among the model's value projections; for down projections, its layer and the model's
    /// layers. `experts`: routed experts per MoE layer; `gqa`: query heads per key head.
    fn format(self, role: Role, index: usize, count: usize, experts: usize, gqa: usize) -> Format {
        use LlamaFileType as T;
        let eight = experts == 8;
        match role {
            Role::Output if self == T::Q8_0 => Format::Q8_0,
            Role::Output => Format::Q6_K,
            Role::AttnV if eight => Format::Q8_0,
            Role::AttnV => match self {
                T::Q2_K if gqa >= 4 => Format::Q4_K,
                T::Q2_K => Format::Q3_K,
                T::Q3_K_M if index < 2 => Format::Q5_K,
                T::Q3_K_M => Format::Q4_K,
                T::Q4_K_M | T::Q5_K_M if use_more_bits(index, count) => Format::Q6_K,
                _ => self.base(),
            },
            Role::AttnK if eight => Format::Q8_0,
            Role::AttnOutput if eight && matches!(self, T::Q2_K | T::Q3_K_M | T::Q4_K_M) => Format::Q5_K,
            Role::AttnOutput if !eight && self == T::Q2_K => Format::Q3_K,
            Role::AttnOutput if !eight && self == T::Q3_K_M => Format::Q4_K,
            Role::FfnDown => match self {
                T::Q2_K => Format::Q3_K,
                T::Q3_K_M if index < count / 16 => Format::Q5_K,
                T::Q3_K_M => Format::Q4_K,
                T::Q4_K_M | T::Q5_K_M if use_more_bits(index, count) => Format::Q6_K,
                _ => self.base(),
            },
            _ => self.base(),
        }
    }

    /// Every matrix's format for `arch`: dense matrices by canonical name (norms, biases and
    /// routers are not listed: they stay F32), routed experts by MoE layer.
    pub fn plan(self, arch: &Architecture) -> MixPlan {
        let (experts, gqa) = (arch.moe.num_experts, arch.num_heads / arch.num_kv_heads.max(1));
        let matrices: Vec<(String, Option<String>)> = names::dense_tensors(arch)
            .into_iter()
            .filter(|s| !s.keep_f32 && s.shape.len() == 2)
            .map(|s| {
                let g = tensor_name(arch.family, &s.name);
                (s.name, g)
            })
            .collect();
        // llama.cpp counts value projections by tensor in file order; a fused tensor (two
        // canonical parts under one GGUF name) counts once.
        let mut values: Vec<&str> = Vec::new();
        for g in matrices.iter().filter_map(|(_, g)| g.as_deref()) {
            if role(g) == Role::AttnV && values.last() != Some(&g) {
                values.push(g);
            }
        }
        let layers = arch.num_layers;
        let format_of = |g: &str| match role(g) {
            Role::AttnV => self.format(Role::AttnV, values.iter().position(|v| *v == g).unwrap_or(0), values.len(), experts, gqa),
            Role::FfnDown => self.format(Role::FfnDown, layer_of(g).unwrap_or(0), layers, experts, gqa),
            r => self.format(r, 0, 0, experts, gqa),
        };
        let dense = matrices.iter().map(|(c, g)| (c.clone(), g.as_deref().map_or(self.base(), format_of))).collect();
        let moe = arch
            .moe_layers()
            .into_iter()
            .map(|l| {
                let [gate, up, down] = names::EXPERT_PARTS.map(|p| format_of(&expert_tensor(l, p)));
                (l, ExpertFormats { gate, up, down })
            })
            .collect();
        MixPlan { dense, experts: moe }
    }
}

/// The formats a file type gives one model's matrices ([`LlamaFileType::plan`]).
#[derive(Clone, Debug)]
pub struct MixPlan {
    dense: HashMap<String, Format>,
    experts: BTreeMap<usize, ExpertFormats>,
}

impl MixPlan {
    /// The format of dense matrix `canonical`; `None` for tensors that stay F32.
    pub fn dense(&self, canonical: &str) -> Option<Format> {
        self.dense.get(canonical).copied()
    }

    /// The formats of the routed experts of decoder layer `layer`.
    pub fn experts(&self, layer: usize) -> Option<ExpertFormats> {
        self.experts.get(&layer).copied()
    }
}

impl fmt::Display for LlamaFileType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(ALL.iter().find(|(t, _)| t == self).map_or("?", |(_, n)| n))
    }
}

impl FromStr for LlamaFileType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        ALL.iter().find(|(_, n)| n.eq_ignore_ascii_case(s.trim())).map(|(t, _)| *t).ok_or_else(|| {
            let names: Vec<&str> = ALL.iter().map(|(_, n)| *n).collect();
            format!("'{s}' is not a llama.cpp file type smoe reproduces ({})", names.join(", "))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `use_more_bits` as llama.cpp defines it, on the two shapes that matter most: half of
    /// Qwen3-30B-A3B's 48 layers and 47 of Qwen3-235B-A22B's 94 get the extra bits.
    #[test]
    fn more_bits_layers_are_llama_cpps() {
        let more = |n: usize| (0..n).filter(|&i| use_more_bits(i, n)).collect::<Vec<_>>();
        let want: Vec<usize> = (0..6).chain((8..42).step_by(3)).chain(42..48).collect();
        assert_eq!(more(48), want);
        assert_eq!(more(94).len(), 11 + 12 + (11..82).filter(|i| (i - 11) % 3 == 2).count());
        assert_eq!(more(2), vec![1], "two layers: n/8 = 0, so only the last is in its last eighth");
    }

    /// Qwen3-30B-A3B's 128 experts take the general rules (the eight-expert ones are checked
    /// against llama.cpp's own files in tests/export_gguf.rs).
    #[test]
    fn qwen3_30b_plans() {
        let cfg = crate::synth::shape_config("qwen3-30b-a3b").unwrap();
        let arch = smoe_formats::hf::architecture_from_config(&cfg).unwrap();
        let more = |l: usize| use_more_bits(l, 48);
        let q4km = LlamaFileType::Q4_K_M.plan(&arch);
        assert_eq!(q4km.dense("lm_head"), Some(Format::Q6_K));
        assert_eq!(q4km.dense("embed"), Some(Format::Q4_K));
        assert_eq!(q4km.dense("layers.0.moe.router"), None, "routers stay F32");
        for l in 0..48 {
            let six = if more(l) { Format::Q6_K } else { Format::Q4_K };
            assert_eq!(q4km.dense(&format!("layers.{l}.attn.v")), Some(six), "layer {l}");
            assert_eq!(q4km.experts(l), Some(ExpertFormats { gate: Format::Q4_K, up: Format::Q4_K, down: six }), "layer {l}");
            for t in ["attn.q", "attn.k", "attn.o"] {
                assert_eq!(q4km.dense(&format!("layers.{l}.{t}")), Some(Format::Q4_K), "layer {l} {t}");
            }
        }
        let q2k = LlamaFileType::Q2_K.plan(&arch);
        assert_eq!(q2k.dense("layers.7.attn.v"), Some(Format::Q4_K), "32 query heads on 4 key heads");
        assert_eq!(q2k.dense("layers.7.attn.o"), Some(Format::Q3_K));
        assert_eq!(q2k.experts(7), Some(ExpertFormats { gate: Format::Q2_K, up: Format::Q2_K, down: Format::Q3_K }));
        let q3km = LlamaFileType::Q3_K_M.plan(&arch);
        assert_eq!((q3km.dense("layers.1.attn.v"), q3km.dense("layers.2.attn.v")), (Some(Format::Q5_K), Some(Format::Q4_K)));
        assert_eq!((q3km.experts(2).unwrap().down, q3km.experts(3).unwrap().down), (Format::Q5_K, Format::Q4_K), "48/16 = 3");
    }

    #[test]
    fn names_parse_and_print() {
        for (t, n) in ALL {
            assert_eq!(n.parse::<LlamaFileType>().unwrap(), t);
            assert_eq!(n.to_lowercase().parse::<LlamaFileType>().unwrap(), t);
            assert_eq!(t.to_string(), n);
        }
        let e = "Q4_K_S".parse::<LlamaFileType>().unwrap_err();
        assert!(e.contains("Q4_K_M") && e.contains("Q4_K_S"), "{e}");
    }
}
