//! The architecture description: everything the forward pass needs, read from config.json at
//! conversion time and stored in the vault's manifest, so the engine never sees a config.json.
//!
//! One generic decoder is driven by this struct. Each difference between model families is a
//! named field (`qk_norm`, `qkv_bias`, `router`, `shared_experts`, `mla`, ...) rather than a
//! family check in the forward pass; `family` is kept for reporting and for tokenizer/template
//! conventions only.

use serde::{Deserialize, Serialize};

/// The model families smoe can convert and run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B).
    Qwen3Moe,
    /// Qwen2-MoE / Qwen1.5-MoE.
    Qwen2Moe,
    /// Mixtral.
    Mixtral,
    /// OLMoE.
    Olmoe,
    /// GLM-4.5 / GLM-4.6 MoE.
    Glm4Moe,
    /// DeepSeek-V3 / R1.
    DeepseekV3,
    /// MiniMax-M2.
    MinimaxM2,
    /// OpenAI gpt-oss (gpt-oss-20b, gpt-oss-120b).
    GptOss,
    /// GLM-5 (`glm_moe_dsa`): DeepSeek-V3's latent attention and routing with DeepSeek Sparse
    /// Attention.
    GlmMoeDsa,
    /// DeepSeek-V4 (Flash, Pro): compressed attentions, hyper-connections, hash routing.
    DeepseekV4,
    /// Qwen3-Next (`qwen3_next`): Gated DeltaNet linear attention between gated full
    /// attention layers, a gated shared expert.
    Qwen3Next,
    /// Qwen3.5-MoE (`qwen3_5_moe`, Qwen3.5-397B-A17B): Qwen3-Next's decoder in a multimodal
    /// checkpoint (its text model is read; the vision tower is not).
    Qwen35Moe,
}

impl Family {
    /// The Hugging Face `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Family::Qwen3Moe => "qwen3_moe",
            Family::Qwen2Moe => "qwen2_moe",
            Family::Mixtral => "mixtral",
            Family::Olmoe => "olmoe",
            Family::Glm4Moe => "glm4_moe",
            Family::DeepseekV3 => "deepseek_v3",
            Family::MinimaxM2 => "minimax_m2",
            Family::GptOss => "gpt_oss",
            Family::GlmMoeDsa => "glm_moe_dsa",
            Family::DeepseekV4 => "deepseek_v4",
            Family::Qwen3Next => "qwen3_next",
            Family::Qwen35Moe => "qwen3_5_moe",
        }
    }

    /// All supported families.
    pub const ALL: [Family; 12] = [
        Family::Qwen3Moe,
        Family::Qwen2Moe,
        Family::Mixtral,
        Family::Olmoe,
        Family::Glm4Moe,
        Family::DeepseekV3,
        Family::MinimaxM2,
        Family::GptOss,
        Family::GlmMoeDsa,
        Family::DeepseekV4,
        Family::Qwen3Next,
        Family::Qwen35Moe,
    ];

    /// The family with this `model_type`.
    pub fn from_model_type(s: &str) -> Option<Family> {
        Family::ALL.into_iter().find(|f| f.model_type() == s)
    }
}

/// How queries and keys are normalised before RoPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QkNorm {
    /// No normalisation.
    None,
    /// RMSNorm over each head's `head_dim` values (Qwen3, GLM-4.5 with `use_qk_norm`).
    PerHead,
    /// RMSNorm over the whole projection, all heads at once (OLMoE, MiniMax-M2).
    WholeProjection,
}

/// RoPE frequency scaling.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RopeScaling {
    /// Plain RoPE.
    None,
    /// Positions divided by `factor`.
    Linear {
        /// Divisor of the positions.
        factor: f64,
    },
    /// YaRN (Peng et al. 2023), as transformers' `_compute_yarn_parameters`.
    Yarn {
        /// Context extension factor.
        factor: f64,
        /// Context length the model was pretrained with.
        original_max_position_embeddings: usize,
        /// High-frequency boundary, in rotations.
        beta_fast: f64,
        /// Low-frequency boundary, in rotations.
        beta_slow: f64,
        /// DeepSeek's `mscale`, if given.
        mscale: Option<f64>,
        /// DeepSeek's `mscale_all_dim`, if given; also scales the softmax (MLA).
        mscale_all_dim: Option<f64>,
        /// Explicit cos/sin scaling, if given.
        attention_factor: Option<f64>,
        /// Whether the correction range is rounded outwards to integers.
        truncate: bool,
    },
}

/// Rotary position embedding parameters.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rope {
    /// Base of the frequencies.
    pub theta: f64,
    /// Number of leading dimensions of each head that rotate (`head_dim * partial_rotary_factor`,
    /// or `qk_rope_head_dim` for MLA).
    pub rotary_dim: usize,
    /// The fraction of the head that rotates, as given in config.json.
    pub partial_rotary_factor: f64,
    /// Rotate adjacent pairs (2i, 2i+1) instead of halves (i, i + d/2). DeepSeek's
    /// `rope_interleave`.
    pub interleaved: bool,
    /// Frequency scaling.
    pub scaling: RopeScaling,
    /// Qwen3.5's multimodal RoPE sections (`mrope_section`: rotated pairs per temporal, height
    /// and width position). A text's three positions are equal, so the sections change no
    /// number here; they are kept so `export-gguf` can write them (llama.cpp's qwen35moe needs
    /// `rope.dimension_sections`). Empty for every other family.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sections: Vec<usize>,
}

/// Multi-head latent attention (DeepSeek-V2/V3).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mla {
    /// Rank of the query compression (`None`: a plain `q_proj`).
    pub q_lora_rank: Option<usize>,
    /// Rank of the compressed key/value latent.
    pub kv_lora_rank: usize,
    /// Per-head query/key dimensions without position.
    pub qk_nope_head_dim: usize,
    /// Per-head query/key dimensions with RoPE (the key part is shared by all heads).
    pub qk_rope_head_dim: usize,
    /// Per-head value dimensions.
    pub v_head_dim: usize,
}

/// DeepSeek Sparse Attention (GLM-5; DeepSeek-V3.2's DSA): a "lightning indexer" scores every
/// visible position for each query, and the query attends (with the layer's latent attention)
/// only to its `top_k` best; a query that sees `top_k` positions or fewer attends to all of them.
///
/// The indexer of layer `l` (tensors `attn.idx_q` `[heads × head_dim, q_lora_rank]` on the
/// normalised query latent, `attn.idx_k` `[head_dim, hidden]` followed by a LayerNorm
/// `attn.idx_k_norm`/`attn.idx_k_norm_bias`, `attn.idx_weights` `[heads, hidden]`) rotates the
/// first `qk_rope_head_dim` dimensions of its query heads and key (pairs interleaved) and
/// scores position `j` as `Σ_h w_h · relu(q_h · k_j) / sqrt(head_dim · heads)`. Its keys are cached
/// beside the latent KV, one `head_dim` row per position.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SparseAttention {
    /// Positions each query attends to (`index_topk`).
    pub top_k: usize,
    /// Indexer query heads (`index_n_heads`).
    pub heads: usize,
    /// Indexer head dimension (`index_head_dim`).
    pub head_dim: usize,
    /// Per layer: `true` where the layer runs its own indexer ("full"), `false` where it reuses
    /// the selection of the nearest full layer before it ("shared", GLM-5's `indexer_types`).
    pub indexer: Vec<bool>,
}

/// What a DeepSeek-V4 layer's attention sees beyond its sliding window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Compression {
    /// The sliding window only ("sliding_attention").
    None,
    /// Compressed sparse attention ("compressed_sparse_attention", CSA): every `rate`
    /// positions close a window whose entry pools it with the window before (overlapping
    /// windows of `2 × rate`), and a lightning indexer picks each query's `top_k` entries.
    Sparse {
        /// Positions per compressed entry (4).
        rate: usize,
    },
    /// Heavily compressed attention ("heavily_compressed_attention", HCA): one entry per
    /// `rate` positions, no overlap, every entry attended.
    Heavy {
        /// Positions per compressed entry (128).
        rate: usize,
    },
}

impl Compression {
    /// Positions per compressed entry (0: no compression).
    pub fn rate(self) -> usize {
        match self {
            Compression::None => 0,
            Compression::Sparse { rate } | Compression::Heavy { rate } => rate,
        }
    }
    /// Whether an entry pools two windows (CSA): its compressor projects `2 × head_dim`.
    pub fn overlaps(self) -> bool {
        matches!(self, Compression::Sparse { .. })
    }
}

/// DeepSeek-V4's attention: one shared key=value head of `head_dim` per position (MQA), queries
/// through a low-rank `q_a`/`q_b` with an RMSNorm between and an unweighted RMSNorm per head,
/// RoPE (interleaved pairs) on each head's *last* `rotary_dim` dimensions, a sink logit per
/// head, a sliding window over the recent positions plus, per layer, compressed entries of the
/// past ([`Compression`]); the output's rotated part turned back by its own position, then a
/// grouped low-rank output projection (`o_groups` groups of heads each projected to
/// `o_lora_rank`, then one `o_b` to the hidden size).
///
/// Tensors of layer `l`: `attn.q_a` `[q_lora_rank, hidden]`, `attn.q_a_norm`, `attn.q_b`
/// `[heads × head_dim, q_lora_rank]`, `attn.kv` `[head_dim, hidden]`, `attn.kv_norm`,
/// `attn.o_a` `[o_groups × o_lora_rank, heads × head_dim / o_groups]`, `attn.o_b`, `attn.sinks`;
/// compressed layers add `attn.cmp_kv` and `attn.cmp_gate` (`[c × head_dim, hidden]`, `c` 2 when
/// overlapping), `attn.cmp_bias` `[rate, c × head_dim]` (exact) and `attn.cmp_norm`; CSA layers
/// add the indexer's `attn.idx_q` `[heads × head_dim, q_lora_rank]`, `attn.idx_weights`
/// `[heads, hidden]` (exact) and its own compressor `attn.idx_cmp_kv`, `attn.idx_cmp_gate`,
/// `attn.idx_cmp_bias`, `attn.idx_cmp_norm` at the indexer's head dimension.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CompressedAttention {
    /// Rank of the query compression.
    pub q_lora_rank: usize,
    /// Head groups of the output projection.
    pub o_groups: usize,
    /// Each group's projected width.
    pub o_lora_rank: usize,
    /// Positions of the sliding window, the query's own included.
    pub window: usize,
    /// Per layer, what it attends beyond the window.
    pub compression: Vec<Compression>,
    /// The lightning indexer of CSA layers: heads, head dimension, entries kept per query.
    pub index_heads: usize,
    /// Indexer head dimension.
    pub index_head_dim: usize,
    /// Compressed entries each CSA query attends to.
    pub index_top_k: usize,
    /// The RoPE of compressed layers (their attention, compressors and indexer); sliding layers
    /// use [`Architecture::rope`].
    pub compress_rope: Rope,
}

/// Manifold-constrained hyper-connections (DeepSeek-V4): the residual stream is `mult` streams
/// of `hidden` values. Before each attention and feed-forward block, a projection of the
/// RMS-normed streams (`fn` `[(2 + mult) × mult, mult × hidden]`, `base`, three `scale`s; all
/// exact) gives per token `pre` (sigmoid, how the streams collapse into the block's input),
/// `post` (2·sigmoid, how the block's output spreads back) and `comb` (a softmax made doubly
/// stochastic by `sinkhorn_iters` Sinkhorn steps, how the streams mix); after the last layer a
/// head (`hc_head_fn` `[mult, mult × hidden]`, `hc_head_base`, `hc_head_scale`) collapses them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HyperConnections {
    /// Streams.
    pub mult: usize,
    /// Sinkhorn-Knopp iterations.
    pub sinkhorn_iters: usize,
    /// Floor added to `pre` and `comb`, and to Sinkhorn's denominators.
    pub eps: f64,
}

impl HyperConnections {
    /// Most streams an architecture may have (DeepSeek-V4 has 4): the bound every backend's
    /// stream mixing holds a position's old values within.
    pub const MAX_STREAMS: usize = 16;
}

/// Gated DeltaNet linear attention (Qwen3-Next) on some layers, in place of full attention.
///
/// A linear layer projects the normed input into `[q | k | v]` (`lin.qkv`, `2 × key_heads ×
/// key_dim + value_heads × value_dim` channels, heads one after another), `z` (`lin.z`, one
/// `value_dim` gate per value head), and per value head `b` and `a` (`lin.b`, `lin.a`, exact).
/// The `[q | k | v]` channels pass a causal depthwise convolution over the last `conv_kernel`
/// positions (`lin.conv` `[channels, conv_kernel]`, exact) and SiLU; q and k heads are
/// L2-normalised, q scaled by `1/sqrt(key_dim)`, and value head `j` reads key head
/// `j / (value_heads / key_heads)`. Each value head keeps a `key_dim × value_dim` state `S`:
/// per token `S ← exp(g)·S`, then `S ← S + k ⊗ β(v − Sᵀk)`, output `Sᵀq`, with `β =
/// sigmoid(b)` and `g = −exp(A_log)·softplus(a + dt_bias)` (`lin.a_log`, `lin.dt_bias`, per value
/// head). The output heads are RMS-normed (`lin.norm` `[value_dim]`), multiplied by `silu(z)`,
/// and projected back (`lin.out`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LinearAttention {
    /// Per layer: whether it runs linear attention (`layer_types` "linear_attention").
    pub layers: Vec<bool>,
    /// Key (and query) heads.
    pub key_heads: usize,
    /// Value heads, a multiple of the key heads.
    pub value_heads: usize,
    /// Dimensions of a key head.
    pub key_dim: usize,
    /// Dimensions of a value head.
    pub value_dim: usize,
    /// Taps of the causal convolution.
    pub conv_kernel: usize,
    /// Value heads numbered across key heads (value head `i` reads key head `i % key_heads`, as
    /// llama.cpp's `qwen35moe` files order them) instead of grouped by key head (`i /
    /// (value_heads / key_heads)`, as the Hugging Face checkpoints do).
    #[serde(default, skip_serializing_if = "is_false")]
    pub tiled_value_heads: bool,
}

impl LinearAttention {
    /// Channels of `[q | k | v]`, the convolution's width.
    pub fn conv_channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
    /// Floats of one layer's state: the last `conv_kernel - 1` inputs of every channel, then
    /// every value head's `key_dim × value_dim` matrix.
    pub fn state_floats(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_channels() + self.value_heads * self.key_dim * self.value_dim
    }
}

/// How the router turns logits into expert choices and mixing weights.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Router {
    /// Softmax over all experts, top-k (Qwen, Mixtral, OLMoE).
    Softmax,
    /// Sigmoid scores; experts chosen on scores plus a learned correction bias, within the
    /// `topk_group` best of `n_group` groups (a group's score is the sum of its two best);
    /// mixing weights from the uncorrected scores (DeepSeek-V3, GLM-4.5).
    SigmoidGrouped {
        /// Number of expert groups.
        n_group: usize,
        /// Groups each token may choose from.
        topk_group: usize,
        /// Whether `e_score_correction_bias` exists.
        correction_bias: bool,
    },
    /// DeepSeek-V4: scores `sqrt(softplus(logit))`, experts chosen on scores plus the
    /// correction bias, mixing weights from the uncorrected scores. In hash-routed layers
    /// ([`Moe::hash_layers`]) the experts come from the token id instead.
    SqrtSoftplus {
        /// Whether `e_score_correction_bias` exists (in the learned layers).
        correction_bias: bool,
    },
}

/// Always-on experts that run beside the routed ones.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharedExperts {
    /// Intermediate size of the (merged) shared expert.
    pub intermediate_size: usize,
    /// Qwen2-MoE scales the shared expert by `sigmoid(shared_expert_gate · x)`.
    pub sigmoid_gate: bool,
}

/// The routed experts' activation between the gate/up and down products.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ExpertAct {
    /// `silu(gate) · up` (every family but gpt-oss).
    #[default]
    Silu,
    /// gpt-oss: `gate` clamped above at `limit`, `up` clamped to `[-limit, limit]`, then
    /// `gate · sigmoid(alpha · gate) · (up + 1)`.
    ClampedSwiglu {
        /// Slope inside the sigmoid (1.702).
        alpha: f64,
        /// Clamp bound (7.0).
        limit: f64,
    },
    /// DeepSeek-V4: `silu(min(gate, limit)) · clamp(up, -limit, limit)`, in the routed and the
    /// shared experts.
    ClampedSilu {
        /// Clamp bound (`swiglu_limit`, 10.0).
        limit: f64,
    },
}

impl ExpertAct {
    fn is_silu(&self) -> bool {
        *self == ExpertAct::Silu
    }
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The mixture-of-experts block.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Moe {
    /// Routed experts per MoE layer.
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Intermediate size of each routed expert.
    pub intermediate_size: usize,
    /// Router kind.
    pub router: Router,
    /// Renormalise the top-k weights to sum to one.
    pub norm_topk_prob: bool,
    /// Multiplier on the final mixing weights.
    pub routed_scaling_factor: f64,
    /// Shared experts, if any.
    pub shared_experts: Option<SharedExperts>,
    /// A learned bias added to the router's logits before the choice (gpt-oss's
    /// `router.bias`; tensor `moe.router_logit_bias`). Not DeepSeek's correction bias, which
    /// only steers the choice.
    #[serde(default, skip_serializing_if = "is_false")]
    pub router_logit_bias: bool,
    /// Per-expert biases on the gate, up and down products (gpt-oss; dense tensors
    /// `moe.expert_gate_bias` and `moe.expert_up_bias` `[experts, width]`,
    /// `moe.expert_down_bias` `[experts, hidden]`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub expert_bias: bool,
    /// The routed experts' activation.
    #[serde(default, skip_serializing_if = "ExpertAct::is_silu")]
    pub expert_act: ExpertAct,
    /// Per layer, whether its experts are chosen by token id (DeepSeek-V4's first layers,
    /// tensor `moe.tid2eid` `[vocab, top_k]`, exact) rather than by the router; empty when no
    /// layer is.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub hash_layers: Vec<bool>,
}

impl Moe {
    /// Whether layer `l`'s experts come from the token id.
    pub fn hash_routed(&self, l: usize) -> bool {
        self.hash_layers.get(l).copied().unwrap_or(false)
    }
}

/// What a decoder layer's feed-forward part is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayerKind {
    /// A dense SwiGLU MLP of `dense_intermediate_size`.
    Dense,
    /// A mixture-of-experts block.
    Moe,
}

/// The most decoder layers a model may have. The largest published MoEs have under 100; a
/// header or config.json claiming billions would otherwise size per-layer tables from it.
pub const MAX_LAYERS: usize = 4096;

/// Everything the forward pass needs to know about a model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Architecture {
    /// Model family (reporting and conventions only; the math is driven by the fields below).
    pub family: Family,
    /// Rows of the embedding and LM head.
    pub vocab_size: usize,
    /// Residual stream width.
    pub hidden_size: usize,
    /// Decoder layers (excluding multi-token-prediction layers, which are not converted).
    pub num_layers: usize,
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Per-head dimension of queries, keys and values (standard attention).
    pub head_dim: usize,
    /// Longest context the model supports.
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    pub norm_eps: f64,
    /// Rotary embedding.
    pub rope: Rope,
    /// Query/key normalisation.
    pub qk_norm: QkNorm,
    /// Biases on the q, k and v projections.
    pub qkv_bias: bool,
    /// Multi-head latent attention, if the model uses it instead of standard attention.
    pub mla: Option<Mla>,
    /// Intermediate size of dense MLP layers.
    pub dense_intermediate_size: usize,
    /// The MoE block.
    pub moe: Moe,
    /// Per-layer feed-forward kind.
    pub layers: Vec<LayerKind>,
    /// LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Per layer, the span of a sliding-window attention layer (a query sees itself and the
    /// `w - 1` positions before it) or `None` for full attention; empty when every layer
    /// attends fully (gpt-oss alternates the two).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attention_windows: Vec<Option<usize>>,
    /// A learned logit per query head that joins each softmax's denominator and takes no
    /// value ("attention sinks", gpt-oss; tensor `attn.sinks` `[heads]`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub attn_sinks: bool,
    /// A bias on the attention output projection (gpt-oss; tensor `attn.o_bias`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub o_bias: bool,
    /// DeepSeek Sparse Attention over the latent attention (GLM-5), if the model has it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sparse_attention: Option<SparseAttention>,
    /// DeepSeek-V4's attention, in place of standard or latent attention.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compressed_attention: Option<CompressedAttention>,
    /// DeepSeek-V4's widened residual stream.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hyper_connections: Option<HyperConnections>,
    /// Gated DeltaNet layers (Qwen3-Next), if the model has them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub linear_attention: Option<LinearAttention>,
    /// Standard attention's output is multiplied by `sigmoid(gate)`, the gate projected from the
    /// layer input per query dimension (Qwen3-Next; tensor `attn.q_gate` `[heads × head_dim,
    /// hidden]`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub attn_output_gate: bool,
}

impl Architecture {
    /// The sliding window of layer `l`, if it has one.
    pub fn attention_window(&self, l: usize) -> Option<usize> {
        self.attention_windows.get(l).copied().flatten()
    }

    /// The layers that run their own DSA indexer, in order (empty without sparse attention).
    pub fn indexer_layers(&self) -> Vec<usize> {
        self.sparse_attention.as_ref().map_or(vec![], |s| (0..self.num_layers).filter(|&l| s.indexer[l]).collect())
    }

    /// Whether layer `l` runs Gated DeltaNet linear attention.
    pub fn is_linear(&self, l: usize) -> bool {
        self.linear_attention.as_ref().is_some_and(|la| la.layers.get(l).copied().unwrap_or(false))
    }

    /// Indices of the MoE layers, in order.
    pub fn moe_layers(&self) -> Vec<usize> {
        (0..self.num_layers).filter(|&l| self.layers[l] == LayerKind::Moe).collect()
    }

    /// Checks internal consistency; a vault whose architecture fails this is rejected.
    pub fn validate(&self) -> Result<(), String> {
        let pos = |v: usize, what: &str| {
            if v == 0 {
                Err(format!("{what} is zero"))
            } else {
                Ok(())
            }
        };
        pos(self.vocab_size, "vocab_size")?;
        pos(self.hidden_size, "hidden_size")?;
        pos(self.num_layers, "num_layers")?;
        if self.num_layers > MAX_LAYERS {
            return Err(format!("{} layers (at most {MAX_LAYERS})", self.num_layers));
        }
        pos(self.num_heads, "num_heads")?;
        pos(self.num_kv_heads, "num_kv_heads")?;
        pos(self.head_dim, "head_dim")?;
        pos(self.moe.num_experts, "num_experts")?;
        pos(self.moe.top_k, "top_k")?;
        pos(self.moe.intermediate_size, "moe intermediate_size")?;
        if self.layers.len() != self.num_layers {
            return Err(format!("{} layer kinds for {} layers", self.layers.len(), self.num_layers));
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(format!("{} heads not divisible by {} kv heads", self.num_heads, self.num_kv_heads));
        }
        if self.moe.top_k > self.moe.num_experts {
            return Err(format!("top_k {} > {} experts", self.moe.top_k, self.moe.num_experts));
        }
        if let Router::SigmoidGrouped { n_group, topk_group, .. } = self.moe.router {
            if n_group == 0 || !self.moe.num_experts.is_multiple_of(n_group) || topk_group == 0 || topk_group > n_group {
                return Err(format!("bad expert groups: n_group {n_group}, topk_group {topk_group}"));
            }
        }
        if !self.norm_eps.is_finite() || self.norm_eps <= 0.0 {
            return Err(format!("bad norm eps {}", self.norm_eps));
        }
        let head_for_rope = self.mla.as_ref().map_or(self.head_dim, |m| m.qk_rope_head_dim);
        if self.rope.rotary_dim == 0 || self.rope.rotary_dim > head_for_rope || !self.rope.rotary_dim.is_multiple_of(2) {
            return Err(format!("bad rotary dim {} for head dim {}", self.rope.rotary_dim, head_for_rope));
        }
        if !self.attention_windows.is_empty() && self.attention_windows.len() != self.num_layers {
            return Err(format!("{} attention windows for {} layers", self.attention_windows.len(), self.num_layers));
        }
        if self.attention_windows.contains(&Some(0)) {
            return Err("a sliding attention window of 0 positions".into());
        }
        if (self.attn_sinks || self.o_bias || !self.attention_windows.is_empty()) && self.mla.is_some() {
            return Err("attention sinks, output bias and sliding windows are only implemented for standard attention".into());
        }
        if let Some(s) = &self.sparse_attention {
            let Some(mla) = &self.mla else {
                return Err("sparse attention without latent attention".into());
            };
            if mla.q_lora_rank.is_none() {
                return Err("sparse attention's indexer needs a query latent (q_lora_rank)".into());
            }
            pos(s.top_k, "index_topk")?;
            pos(s.heads, "index_n_heads")?;
            if s.head_dim < mla.qk_rope_head_dim || !s.head_dim.is_multiple_of(2) {
                return Err(format!("index_head_dim {} below the {} rotated dimensions", s.head_dim, mla.qk_rope_head_dim));
            }
            if s.indexer.len() != self.num_layers {
                return Err(format!("{} indexer layer types for {} layers", s.indexer.len(), self.num_layers));
            }
            if s.indexer.first() != Some(&true) {
                return Err("the first layer shares an indexer selection no layer before it made".into());
            }
        }
        if let Some(c) = &self.compressed_attention {
            if self.mla.is_some() || self.sparse_attention.is_some() {
                return Err("compressed attention with latent or sparse attention".into());
            }
            if self.num_kv_heads != 1 {
                return Err(format!("compressed attention shares one key/value head, not {}", self.num_kv_heads));
            }
            pos(c.q_lora_rank, "q_lora_rank")?;
            pos(c.o_groups, "o_groups")?;
            pos(c.o_lora_rank, "o_lora_rank")?;
            pos(c.window, "sliding_window")?;
            if !self.num_heads.is_multiple_of(c.o_groups) {
                return Err(format!("{} heads in {} output groups", self.num_heads, c.o_groups));
            }
            if c.compression.len() != self.num_layers {
                return Err(format!("{} compression kinds for {} layers", c.compression.len(), self.num_layers));
            }
            if c.compression.iter().any(|k| *k != Compression::None && k.rate() == 0) {
                return Err("a compression rate of 0".into());
            }
            if c.compression.iter().any(|k| k.overlaps()) {
                pos(c.index_heads, "index_n_heads")?;
                pos(c.index_top_k, "index_topk")?;
                if c.index_head_dim < c.compress_rope.rotary_dim {
                    return Err(format!("index_head_dim {} below the {} rotated dimensions", c.index_head_dim, c.compress_rope.rotary_dim));
                }
            }
            let r = c.compress_rope.rotary_dim;
            if r == 0 || r > self.head_dim || !r.is_multiple_of(2) || r != self.rope.rotary_dim {
                return Err(format!("bad rotary dims {} / {} for head dim {}", self.rope.rotary_dim, r, self.head_dim));
            }
        }
        if let Some(h) = &self.hyper_connections {
            pos(h.mult, "hc_mult")?;
            if h.mult > HyperConnections::MAX_STREAMS {
                return Err(format!("hc_mult {} (at most {} streams)", h.mult, HyperConnections::MAX_STREAMS));
            }
            pos(h.sinkhorn_iters, "hc_sinkhorn_iters")?;
            if !h.eps.is_finite() || h.eps < 0.0 {
                return Err(format!("bad hc_eps {}", h.eps));
            }
        }
        if !self.moe.hash_layers.is_empty() && self.moe.hash_layers.len() != self.num_layers {
            return Err(format!("{} hash-routing flags for {} layers", self.moe.hash_layers.len(), self.num_layers));
        }
        if let ExpertAct::ClampedSilu { limit } = self.moe.expert_act {
            if !limit.is_finite() || limit <= 0.0 {
                return Err(format!("bad swiglu_limit {limit}"));
            }
        }
        if let ExpertAct::ClampedSwiglu { alpha, limit } = self.moe.expert_act {
            if !alpha.is_finite() || !limit.is_finite() || limit <= 0.0 {
                return Err(format!("bad clamped SwiGLU: alpha {alpha}, limit {limit}"));
            }
        }
        if let Some(la) = &self.linear_attention {
            if self.mla.is_some() || self.compressed_attention.is_some() || self.hyper_connections.is_some() {
                return Err("linear attention beside latent or compressed attention".into());
            }
            pos(la.key_heads, "linear_num_key_heads")?;
            pos(la.value_heads, "linear_num_value_heads")?;
            pos(la.key_dim, "linear_key_head_dim")?;
            pos(la.value_dim, "linear_value_head_dim")?;
            if !(2..=16).contains(&la.conv_kernel) {
                return Err(format!("linear_conv_kernel_dim {} (2 to 16)", la.conv_kernel));
            }
            if !la.value_heads.is_multiple_of(la.key_heads) {
                return Err(format!("{} linear value heads for {} key heads", la.value_heads, la.key_heads));
            }
            if la.layers.len() != self.num_layers {
                return Err(format!("{} linear-attention layer types for {} layers", la.layers.len(), self.num_layers));
            }
            if la.layers.iter().any(|&l| l) && !self.attention_windows.is_empty() {
                return Err("linear attention beside sliding windows".into());
            }
        }
        if self.layers.contains(&LayerKind::Dense) && self.dense_intermediate_size == 0 {
            return Err("dense layers without dense_intermediate_size".into());
        }
        Ok(())
    }
}
