//! Canonical tensor names and the tensor set an architecture implies.
//!
//! A vault names its tensors independently of the checkpoint they came from; converters map
//! source names onto these, and the engine loads by these. The expected set is derived from the
//! [`Architecture`] alone, so a converter can report missing and unexpected tensors and a reader
//! can reject a manifest that does not match its own architecture.

use crate::arch::{Architecture, Compression, LayerKind, QkNorm, Router};

/// Shape and role of one dense tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// Canonical name.
    pub name: String,
    /// `[rows, cols]` for matrices (rows = outputs), `[n]` for vectors.
    pub shape: Vec<usize>,
    /// Whether the tensor must stay exact (F32): norms, biases and routers. Routing must be
    /// computed from the true scores, so router weights are never quantized.
    pub keep_f32: bool,
}

impl TensorSpec {
    fn matrix(name: String, rows: usize, cols: usize) -> Self {
        TensorSpec { name, shape: vec![rows, cols], keep_f32: false }
    }
    fn exact_matrix(name: String, rows: usize, cols: usize) -> Self {
        TensorSpec { name, shape: vec![rows, cols], keep_f32: true }
    }
    fn vector(name: String, n: usize) -> Self {
        TensorSpec { name, shape: vec![n], keep_f32: true }
    }
}

/// Name of a tensor of layer `layer`.
pub fn layer(layer: usize, what: &str) -> String {
    format!("layers.{layer}.{what}")
}

/// The three matrices of a routed expert, in blob order.
pub const EXPERT_PARTS: [&str; 3] = ["gate", "up", "down"];

/// Shapes of the expert parts `[gate, up, down]`.
pub fn expert_part_shapes(arch: &Architecture) -> [[usize; 2]; 3] {
    let (h, i) = (arch.hidden_size, arch.moe.intermediate_size);
    [[i, h], [i, h], [h, i]]
}

/// Every dense tensor an architecture needs, in a stable order.
pub fn dense_tensors(arch: &Architecture) -> Vec<TensorSpec> {
    let h = arch.hidden_size;
    let mut v = vec![TensorSpec::matrix("embed".into(), arch.vocab_size, h)];
    for l in 0..arch.num_layers {
        v.push(TensorSpec::vector(layer(l, "attn_norm"), h));
        if let Some(hc) = &arch.hyper_connections {
            // The mixing weights decide how the residual streams combine: exact, as routers.
            let (n, mixes) = (hc.mult, (2 + hc.mult) * hc.mult);
            for block in ["attn", "ffn"] {
                v.push(TensorSpec::exact_matrix(layer(l, &format!("hc_{block}_fn")), mixes, n * h));
                v.push(TensorSpec::vector(layer(l, &format!("hc_{block}_base")), mixes));
                v.push(TensorSpec::vector(layer(l, &format!("hc_{block}_scale")), 3));
            }
        }
        attention_tensors(arch, l, &mut v);
        v.push(TensorSpec::vector(layer(l, "ffn_norm"), h));
        match arch.layers[l] {
            LayerKind::Dense => mlp_tensors(&mut v, l, "mlp", h, arch.dense_intermediate_size),
            LayerKind::Moe => {
                let e = arch.moe.num_experts;
                v.push(TensorSpec::exact_matrix(layer(l, "moe.router"), e, h));
                let hashed = arch.moe.hash_routed(l);
                match arch.moe.router {
                    Router::SigmoidGrouped { correction_bias: true, .. } => v.push(TensorSpec::vector(layer(l, "moe.router_bias"), e)),
                    Router::SqrtSoftplus { correction_bias: true } if !hashed => v.push(TensorSpec::vector(layer(l, "moe.router_bias"), e)),
                    _ => {}
                }
                if hashed {
                    // Token id -> experts, as f32 (exact below 2^24).
                    v.push(TensorSpec::exact_matrix(layer(l, "moe.tid2eid"), arch.vocab_size, arch.moe.top_k));
                }
                if arch.moe.router_logit_bias {
                    v.push(TensorSpec::vector(layer(l, "moe.router_logit_bias"), e));
                }
                if arch.moe.expert_bias {
                    let i = arch.moe.intermediate_size;
                    v.push(TensorSpec::exact_matrix(layer(l, "moe.expert_gate_bias"), e, i));
                    v.push(TensorSpec::exact_matrix(layer(l, "moe.expert_up_bias"), e, i));
                    v.push(TensorSpec::exact_matrix(layer(l, "moe.expert_down_bias"), e, h));
                }
                if let Some(s) = &arch.moe.shared_experts {
                    mlp_tensors(&mut v, l, "moe.shared", h, s.intermediate_size);
                    if s.sigmoid_gate {
                        v.push(TensorSpec::exact_matrix(layer(l, "moe.shared_gate"), 1, h));
                    }
                }
            }
        }
    }
    if let Some(hc) = &arch.hyper_connections {
        v.push(TensorSpec::exact_matrix("hc_head_fn".into(), hc.mult, hc.mult * h));
        v.push(TensorSpec::vector("hc_head_base".into(), hc.mult));
        v.push(TensorSpec::vector("hc_head_scale".into(), 1));
    }
    v.push(TensorSpec::vector("final_norm".into(), h));
    if !arch.tie_word_embeddings {
        v.push(TensorSpec::matrix("lm_head".into(), arch.vocab_size, h));
    }
    v
}

fn mlp_tensors(v: &mut Vec<TensorSpec>, l: usize, prefix: &str, h: usize, i: usize) {
    v.push(TensorSpec::matrix(layer(l, &format!("{prefix}.gate")), i, h));
    v.push(TensorSpec::matrix(layer(l, &format!("{prefix}.up")), i, h));
    v.push(TensorSpec::matrix(layer(l, &format!("{prefix}.down")), h, i));
}

/// DeepSeek-V4's attention tensors of layer `l` (see [`crate::CompressedAttention`]).
fn compressed_attention_tensors(arch: &Architecture, l: usize, v: &mut Vec<TensorSpec>) {
    let c = arch.compressed_attention.as_ref().expect("compressed attention");
    let (h, nh, hd, r) = (arch.hidden_size, arch.num_heads, arch.head_dim, c.q_lora_rank);
    v.push(TensorSpec::matrix(layer(l, "attn.q_a"), r, h));
    v.push(TensorSpec::vector(layer(l, "attn.q_a_norm"), r));
    v.push(TensorSpec::matrix(layer(l, "attn.q_b"), nh * hd, r));
    v.push(TensorSpec::matrix(layer(l, "attn.kv"), hd, h));
    v.push(TensorSpec::vector(layer(l, "attn.kv_norm"), hd));
    v.push(TensorSpec::matrix(layer(l, "attn.o_a"), c.o_groups * c.o_lora_rank, nh * hd / c.o_groups));
    v.push(TensorSpec::matrix(layer(l, "attn.o_b"), h, c.o_groups * c.o_lora_rank));
    v.push(TensorSpec::vector(layer(l, "attn.sinks"), nh));
    let kind = c.compression[l];
    if kind == Compression::None {
        return;
    }
    let compressor = |v: &mut Vec<TensorSpec>, prefix: &str, dim: usize| {
        let width = if kind.overlaps() { 2 * dim } else { dim };
        v.push(TensorSpec::matrix(layer(l, &format!("{prefix}_kv")), width, h));
        v.push(TensorSpec::matrix(layer(l, &format!("{prefix}_gate")), width, h));
        v.push(TensorSpec::exact_matrix(layer(l, &format!("{prefix}_bias")), kind.rate(), width));
        v.push(TensorSpec::vector(layer(l, &format!("{prefix}_norm")), dim));
    };
    compressor(v, "attn.cmp", hd);
    if kind.overlaps() {
        v.push(TensorSpec::matrix(layer(l, "attn.idx_q"), c.index_heads * c.index_head_dim, r));
        v.push(TensorSpec::exact_matrix(layer(l, "attn.idx_weights"), c.index_heads, h));
        compressor(v, "attn.idx_cmp", c.index_head_dim);
    }
}

fn attention_tensors(arch: &Architecture, l: usize, v: &mut Vec<TensorSpec>) {
    let h = arch.hidden_size;
    let nh = arch.num_heads;
    if arch.compressed_attention.is_some() {
        return compressed_attention_tensors(arch, l, v);
    }
    if let Some(la) = arch.linear_attention.as_ref().filter(|_| arch.is_linear(l)) {
        let (vw, c) = (la.value_heads * la.value_dim, la.conv_channels());
        v.push(TensorSpec::matrix(layer(l, "lin.qkv"), c, h));
        v.push(TensorSpec::matrix(layer(l, "lin.z"), vw, h));
        // β and the decay set how much of the state each token keeps: exact, as routers.
        v.push(TensorSpec::exact_matrix(layer(l, "lin.b"), la.value_heads, h));
        v.push(TensorSpec::exact_matrix(layer(l, "lin.a"), la.value_heads, h));
        v.push(TensorSpec::exact_matrix(layer(l, "lin.conv"), c, la.conv_kernel));
        v.push(TensorSpec::vector(layer(l, "lin.dt_bias"), la.value_heads));
        v.push(TensorSpec::vector(layer(l, "lin.a_log"), la.value_heads));
        v.push(TensorSpec::vector(layer(l, "lin.norm"), la.value_dim));
        v.push(TensorSpec::matrix(layer(l, "lin.out"), h, vw));
        return;
    }
    if let Some(m) = &arch.mla {
        let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
        match m.q_lora_rank {
            Some(r) => {
                v.push(TensorSpec::matrix(layer(l, "attn.q_a"), r, h));
                v.push(TensorSpec::vector(layer(l, "attn.q_a_norm"), r));
                v.push(TensorSpec::matrix(layer(l, "attn.q_b"), nh * qk, r));
            }
            None => v.push(TensorSpec::matrix(layer(l, "attn.q"), nh * qk, h)),
        }
        v.push(TensorSpec::matrix(layer(l, "attn.kv_a"), m.kv_lora_rank + m.qk_rope_head_dim, h));
        v.push(TensorSpec::vector(layer(l, "attn.kv_a_norm"), m.kv_lora_rank));
        v.push(TensorSpec::matrix(layer(l, "attn.kv_b"), nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank));
        v.push(TensorSpec::matrix(layer(l, "attn.o"), h, nh * m.v_head_dim));
        if let (Some(s), Some(r)) = (&arch.sparse_attention, m.q_lora_rank) {
            if s.indexer[l] {
                v.push(TensorSpec::matrix(layer(l, "attn.idx_q"), s.heads * s.head_dim, r));
                v.push(TensorSpec::matrix(layer(l, "attn.idx_k"), s.head_dim, h));
                v.push(TensorSpec::vector(layer(l, "attn.idx_k_norm"), s.head_dim));
                v.push(TensorSpec::vector(layer(l, "attn.idx_k_norm_bias"), s.head_dim));
                // The per-head weights decide the selection as the router decides routing: exact.
                v.push(TensorSpec::exact_matrix(layer(l, "attn.idx_weights"), s.heads, h));
            }
        }
        return;
    }
    let (q, kv) = (nh * arch.head_dim, arch.num_kv_heads * arch.head_dim);
    v.push(TensorSpec::matrix(layer(l, "attn.q"), q, h));
    v.push(TensorSpec::matrix(layer(l, "attn.k"), kv, h));
    v.push(TensorSpec::matrix(layer(l, "attn.v"), kv, h));
    v.push(TensorSpec::matrix(layer(l, "attn.o"), h, q));
    if arch.attn_output_gate {
        v.push(TensorSpec::matrix(layer(l, "attn.q_gate"), q, h));
    }
    if arch.qkv_bias {
        v.push(TensorSpec::vector(layer(l, "attn.q_bias"), q));
        v.push(TensorSpec::vector(layer(l, "attn.k_bias"), kv));
        v.push(TensorSpec::vector(layer(l, "attn.v_bias"), kv));
    }
    if arch.o_bias {
        v.push(TensorSpec::vector(layer(l, "attn.o_bias"), h));
    }
    if arch.attn_sinks {
        v.push(TensorSpec::vector(layer(l, "attn.sinks"), nh));
    }
    match arch.qk_norm {
        QkNorm::None => {}
        QkNorm::PerHead => {
            v.push(TensorSpec::vector(layer(l, "attn.q_norm"), arch.head_dim));
            v.push(TensorSpec::vector(layer(l, "attn.k_norm"), arch.head_dim));
        }
        QkNorm::WholeProjection => {
            v.push(TensorSpec::vector(layer(l, "attn.q_norm"), q));
            v.push(TensorSpec::vector(layer(l, "attn.k_norm"), kv));
        }
    }
}
