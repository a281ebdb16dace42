//! How wide each activation buffer of the forward pass must be, derived in one place from what
//! the forward pass writes into it.
//!
//! Every buffer holds `chunk` token rows of the width given here. Each width is the largest of
//! the writes listed beside it, one named term per write, so a family that writes a new width
//! into a buffer adds a term here and nowhere else. A width that was too small once crashed
//! DeepSeek-V3 on long prompts: its `heads × v_head_dim` (16384) is larger than `hidden_size`
//! (7168), and the expanded values went into a buffer sized for the hidden state.

use smoe_vault::{Architecture, LayerKind};

/// Floats per token row of each activation buffer (see the module documentation). Each field
/// is named after its buffer in the forward pass's `Buffers`, whose documentation gives the
/// buffer's shape and what it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Widths {
    pub x: usize,
    pub h: usize,
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub att: usize,
    pub tmp: usize,
    pub tmp2: usize,
    pub g: usize,
    pub u: usize,
    pub d: usize,
    pub xe: usize,
    pub gu: usize,
    pub dd: usize,
    pub slots: usize,
    pub router: usize,
    pub logits: usize,
    pub idx_q: usize,
    pub idx_k: usize,
    pub idx_w: usize,
    pub hc: usize,
    pub hcn: usize,
    pub mix: usize,
    pub raw: usize,
    pub grp: usize,
}

/// The largest of a buffer's writes (0 if it has none).
fn widest(writes: &[usize]) -> usize {
    writes.iter().copied().max().unwrap_or(0)
}

impl Widths {
    /// Widths for `arch` routing `top_k` experts per token.
    pub fn of(a: &Architecture, top_k: usize) -> Widths {
        let hidden = a.hidden_size;
        let any_dense = a.layers.contains(&LayerKind::Dense);
        let dense_mlp = if any_dense { a.dense_intermediate_size } else { 0 };
        let shared_mlp = a.moe.shared_experts.as_ref().map_or(0, |s| s.intermediate_size);
        let v4 = Widths::deepseek_v4(a);
        // Attention's writes differ by kind; unused buffers of a kind get width 0.
        let attn = match (&a.mla, &a.compressed_attention) {
            (_, Some(c)) => {
                let (q, hd) = (a.num_heads * a.head_dim, a.head_dim);
                Attn {
                    q: widest(&[q]),                // q_b output: every head
                    k: widest(&[c.q_lora_rank]),    // q_a output: the normalised query latent
                    v: widest(&[hd]),               // the shared key=value row
                    att: widest(&[q]),              // attention output, every head
                    tmp: widest(&[q / c.o_groups]), // one output group's heads
                    tmp2: widest(&[c.o_lora_rank]), // one group's projection
                }
            }
            (Some(m), None) => {
                let (nh, rank, vdim) = (a.num_heads, m.kv_lora_rank, m.v_head_dim);
                let (qk, lat) = (m.qk_nope_head_dim + m.qk_rope_head_dim, rank + m.qk_rope_head_dim);
                Attn {
                    q: widest(&[nh * lat]),                              // absorbed queries, every head
                    k: widest(&[m.q_lora_rank.unwrap_or(0), nh * vdim]), // q_a output; expanded values
                    v: widest(&[lat]),                                   // kv_a output: the cached row
                    att: widest(&[nh * rank]),                           // attended latents
                    tmp: widest(&[nh * qk, vdim]),                       // q_b output; one head's values
                    tmp2: widest(&[rank]),                               // one head's absorbed query / latent
                }
            }
            (None, None) => {
                let (q, kv) = (a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim);
                let gate = if a.attn_output_gate { q } else { 0 };
                // Gated DeltaNet: [q | k | v | z | b | a] in, one row of value heads out.
                let (lin_in, lin_out) = a.linear_attention.as_ref().map_or((0, 0), |la| {
                    let vw = la.value_heads * la.value_dim;
                    (la.conv_channels() + vw + 2 * la.value_heads, vw)
                });
                Attn {
                    q: widest(&[q + 2 * kv + gate, lin_in]), // [q | k | v (| gate)] from one dispatch; linear layers' inputs
                    k: 0,
                    v: 0,
                    att: widest(&[q, lin_out]), // attention output, every head; linear layers' outputs
                    tmp: 0,
                    tmp2: 0,
                }
            }
        };
        Widths {
            x: hidden,
            h: hidden,
            q: attn.q,
            k: attn.k,
            v: attn.v,
            att: attn.att,
            // Also: the last token's normed row before the LM head; the shared-expert gate (1).
            tmp: widest(&[attn.tmp, hidden, 1]),
            tmp2: attn.tmp2,
            g: widest(&[dense_mlp, shared_mlp]),
            u: widest(&[dense_mlp, shared_mlp]),
            // Attention output projection; dense MLP and shared expert down projections.
            d: hidden,
            // One row per (token, routed slot): gathered inputs; also the lookahead's normed rows.
            xe: widest(&[top_k * hidden, hidden]),
            gu: top_k * 2 * a.moe.intermediate_size, // [gate | up] per (token, slot)
            dd: top_k * hidden,                      // down products per (token, slot)
            slots: top_k * hidden,                   // the same, back in slot order
            router: a.moe.num_experts,
            logits: a.vocab_size,
            // The DSA indexer's queries, key and head weights (GLM-5 only).
            idx_q: a.sparse_attention.as_ref().map_or(v4.idx_q, |s| s.heads * s.head_dim),
            idx_k: a.sparse_attention.as_ref().map_or(0, |s| s.head_dim),
            idx_w: a.sparse_attention.as_ref().map_or(v4.idx_w, |s| s.heads),
            ..v4
        }
    }

    /// DeepSeek-V4's buffers: the hyper-connection streams (and their normed copy), the mixing
    /// projections, a compressor's raw `[kv | gate]` rows, the grouped output projection; the
    /// indexer's queries and weights. Zero for every other family.
    fn deepseek_v4(a: &Architecture) -> Widths {
        let streams = a.hyper_connections.as_ref().map_or(0, |h| h.mult * a.hidden_size);
        let mix = a.hyper_connections.as_ref().map_or(0, |h| (2 + h.mult) * h.mult);
        let (mut raw, mut grp, mut idx_q, mut idx_w) = (0, 0, 0, 0);
        if let Some(c) = &a.compressed_attention {
            // [kv | gate], each two entries wide when windows overlap.
            raw = widest(&[4 * a.head_dim, 4 * c.index_head_dim]);
            grp = c.o_groups * c.o_lora_rank;
            idx_q = c.index_heads * c.index_head_dim;
            idx_w = c.index_heads;
        }
        Widths {
            x: 0,
            h: 0,
            q: 0,
            k: 0,
            v: 0,
            att: 0,
            tmp: 0,
            tmp2: 0,
            g: 0,
            u: 0,
            d: 0,
            xe: 0,
            gu: 0,
            dd: 0,
            slots: 0,
            router: 0,
            logits: 0,
            idx_q,
            idx_k: 0,
            idx_w,
            hc: streams,
            hcn: streams,
            mix,
            raw,
            grp,
        }
    }
}

/// What attention writes, per buffer.
struct Attn {
    q: usize,
    k: usize,
    v: usize,
    att: usize,
    tmp: usize,
    tmp2: usize,
}
