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
        // Attention's writes differ by kind; unused buffers of a kind get width 0.
        let attn = match &a.mla {
            Some(m) => {
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
            None => {
                let (q, kv) = (a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim);
                Attn {
                    q: widest(&[q + 2 * kv]), // [q | k | v] from one dispatch
                    k: 0,
                    v: 0,
                    att: widest(&[q]), // attention output, every head
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
            idx_q: a.sparse_attention.as_ref().map_or(0, |s| s.heads * s.head_dim),
            idx_k: a.sparse_attention.as_ref().map_or(0, |s| s.head_dim),
            idx_w: a.sparse_attention.as_ref().map_or(0, |s| s.heads),
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
