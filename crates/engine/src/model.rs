//! The model: weights loaded from a vault onto a backend, laid out as the architecture
//! description says. Families differ only through the enums below, chosen once at load.

use crate::backend::{Backend, KvShape};
use crate::rope::{yarn_mscale, RopeTable};
use crate::routing::RouterRule;
use crate::EngineError;
use smoe_quant::Format;
use smoe_store::ExpertSource;
use smoe_vault::{names, Architecture, DenseEntry, LayerKind, QkNorm, RopeScaling, Vault};
use std::collections::HashMap;
use std::sync::Arc;

/// Standard multi-head attention with grouped key/value heads.
pub(crate) struct StandardAttention<B: Backend> {
    pub q: B::Matrix,
    pub k: B::Matrix,
    pub v: B::Matrix,
    pub o: B::Matrix,
    /// q, k, v biases (Qwen2-MoE, GLM-4.5).
    pub bias: Option<[B::Vector; 3]>,
    /// q and k norms (Qwen3: per head; OLMoE: whole projection).
    pub qk_norm: Option<(QkNorm, B::Vector, B::Vector)>,
    /// The output projection's bias (gpt-oss).
    pub o_bias: Option<B::Vector>,
    /// One sink logit per query head, on the host: attention takes them as a slice (gpt-oss).
    pub sinks: Option<Vec<f32>>,
    /// This layer's sliding window, if it has one (gpt-oss's sliding layers).
    pub window: Option<usize>,
    /// The output gate's projection (Qwen3-Next): the attention output is multiplied by its
    /// sigmoid.
    pub gate: Option<B::Matrix>,
}

/// Gated DeltaNet linear attention (Qwen3-Next), see [`smoe_vault::LinearAttention`].
pub(crate) struct LinearAttn<B: Backend> {
    pub qkv: B::Matrix,
    pub z: B::Matrix,
    pub b: B::Matrix,
    pub a: B::Matrix,
    pub out: B::Matrix,
    /// `[channels, taps]`.
    pub conv: B::Vector,
    /// `-exp(A_log)` per value head.
    pub neg_a: B::Vector,
    pub dt_bias: B::Vector,
    /// The gated RMSNorm's weights, `[value_dim]`.
    pub norm: B::Vector,
    /// Which of a sequence's recurrent states this layer carries (its rank among the linear
    /// layers).
    pub slot: usize,
}

/// Multi-head latent attention (DeepSeek-V3), decoded in absorbed form.
pub(crate) struct LatentAttention<B: Backend> {
    /// Query path: `q_a`, its norm and `q_b`, or a plain `q`.
    pub q_a: Option<(B::Matrix, B::Vector)>,
    pub q_b: B::Matrix,
    pub kv_a: B::Matrix,
    pub kv_a_norm: B::Vector,
    /// Per head: `qk_nope` rows of W_uk then `v_head` rows of W_uv.
    pub kv_b: B::Matrix,
    pub o: B::Matrix,
    /// DeepSeek Sparse Attention: this layer's own indexer ("full" layers), or `None`, where the
    /// layer attends densely or reuses the selection of the full layer before it.
    pub indexer: Option<Indexer<B>>,
}

/// A DSA lightning indexer (GLM-5), see [`smoe_vault::SparseAttention`].
pub(crate) struct Indexer<B: Backend> {
    /// `[heads × head_dim, q_lora_rank]`, on the normalised query latent.
    pub q: B::Matrix,
    /// `[head_dim, hidden]`, then a LayerNorm with `k_norm` (weights, biases).
    pub k: B::Matrix,
    pub k_norm: (B::Vector, B::Vector),
    /// `[heads, hidden]`: each head's weight for a token.
    pub weights: B::Matrix,
    /// The KV cache layer its keys go into (after the decoder layers', see [`kv_shapes`]).
    pub cache_layer: usize,
}

/// One of DeepSeek-V4's compressors (the attention's or its indexer's), see
/// [`smoe_vault::CompressedAttention`]: projections of the layer input into per-position
/// `[kv | gate]` rows, cached, from which each closed window's entry is pooled.
pub(crate) struct Compressor<B: Backend> {
    pub kv: B::Matrix,
    pub gate: B::Matrix,
    /// `[rate, c × dim]`: added to the gates.
    pub bias: B::Vector,
    /// `[dim]`: the entries' RMSNorm.
    pub norm: B::Vector,
    pub dim: usize,
    pub rate: usize,
    pub overlap: bool,
    /// The cache layer of raw rows (`2 × c × dim` per position).
    pub raw_layer: usize,
    /// The cache layer of entries (`dim` per window).
    pub entry_layer: usize,
}

/// DeepSeek-V4's lightning indexer of a compressed sparse attention layer: queries from the
/// normalised query latent, per-head weights from the layer input, keys from its compressor.
pub(crate) struct CompressedIndexer<B: Backend> {
    pub q: B::Matrix,
    pub weights: B::Matrix,
    pub compressor: Compressor<B>,
}

/// DeepSeek-V4's attention of one layer.
pub(crate) struct CompressedAttn<B: Backend> {
    pub q_a: B::Matrix,
    pub q_a_norm: B::Vector,
    pub q_b: B::Matrix,
    pub kv: B::Matrix,
    pub kv_norm: B::Vector,
    pub o_a: B::Matrix,
    pub o_b: B::Matrix,
    pub sinks: Vec<f32>,
    /// The compressor of a CSA or HCA layer.
    pub compressor: Option<Compressor<B>>,
    /// The indexer of a CSA layer.
    pub indexer: Option<CompressedIndexer<B>>,
}

pub(crate) enum Attention<B: Backend> {
    Standard(StandardAttention<B>),
    Linear(LinearAttn<B>),
    Latent(LatentAttention<B>),
    Compressed(CompressedAttn<B>),
}

/// One hyper-connection mixing (DeepSeek-V4): the projection of the normed streams and, on the
/// host, its base and scales.
pub(crate) struct HyperMix<B: Backend> {
    pub proj: B::Matrix,
    pub base: Vec<f32>,
    pub scale: Vec<f32>,
}

/// A SwiGLU MLP.
pub(crate) struct Mlp<B: Backend> {
    pub gate: B::Matrix,
    pub up: B::Matrix,
    pub down: B::Matrix,
    pub width: usize,
}

pub(crate) struct MoeBlock<B: Backend> {
    pub router: B::Matrix,
    /// DeepSeek-V4's hash routing: each token id's experts (`[vocab, top_k]`), on the host.
    pub tid2eid: Option<Vec<u32>>,
    /// `e_score_correction_bias`, on the host: routing happens there...
    pub router_bias: Option<Vec<f32>>,
    /// ...or on the backend, for layers whose experts it keeps ([`Backend::route`]).
    pub router_bias_kept: Option<B::Vector>,
    pub shared: Option<Mlp<B>>,
    /// Qwen2-MoE's `shared_expert_gate`, `[1, hidden]`.
    pub shared_gate: Option<B::Matrix>,
    /// A bias added to the router's logits before routing (gpt-oss's `router.bias`).
    pub router_logit_bias: Option<B::Vector>,
    /// Per-expert biases of the routed experts (gpt-oss).
    pub expert_bias: Option<ExpertBias<B>>,
}

/// The routed experts' biases, one vector per expert: resident beside the dense weights (a
/// few kilobytes per expert), so the store's blobs keep their three matrices.
pub(crate) struct ExpertBias<B: Backend> {
    /// `[gate | up]` biases, `2 × moe width`, as the rows of `gu` lie.
    pub gate_up: Vec<B::Vector>,
    /// Down biases, `hidden`.
    pub down: Vec<B::Vector>,
}

pub(crate) enum FeedForward<B: Backend> {
    Dense(Mlp<B>),
    Moe(MoeBlock<B>),
}

pub(crate) struct Layer<B: Backend> {
    /// DeepSeek-V4's hyper-connection mixings before attention and before the feed-forward
    /// block.
    pub hc: Option<[HyperMix<B>; 2]>,
    pub attn_norm: B::Vector,
    pub attn: Attention<B>,
    pub ffn_norm: B::Vector,
    pub ffn: FeedForward<B>,
}

/// A model ready to run: dense weights on the backend, experts behind an [`ExpertSource`].
pub struct Model<B: Backend> {
    pub(crate) arch: Architecture,
    pub(crate) backend: B,
    pub(crate) embed: B::Matrix,
    pub(crate) layers: Vec<Layer<B>>,
    pub(crate) final_norm: B::Vector,
    pub(crate) lm_head: Option<B::Matrix>,
    pub(crate) experts: Arc<dyn ExpertSource>,
    pub(crate) rope: RopeTable,
    /// DeepSeek-V4's RoPE of compressed layers.
    pub(crate) compress_rope: Option<RopeTable>,
    /// DeepSeek-V4's final collapse of the hyper-connection streams.
    pub(crate) hc_head: Option<HyperMix<B>>,
    /// Ones for the unweighted RMSNorms (DeepSeek-V4's per-head query norm, `head_dim`, and
    /// the hyper-connections' norm of the streams, `mult × hidden`).
    pub(crate) ones_head: Option<B::Vector>,
    pub(crate) ones_streams: Option<B::Vector>,
    pub(crate) router: RouterRule,
    pub(crate) eps: f32,
    pub(crate) attn_scale: f32,
    pub(crate) dense_bytes: u64,
    /// Bytes of the embedding table (read one row per token, unless it doubles as the LM head).
    pub(crate) embed_bytes: u64,
    pub(crate) lookahead: bool,
    /// See [`Model::set_kv_rewind`].
    pub(crate) kv_rewind: usize,
    /// See [`Model::set_kv_type`].
    pub(crate) kv_type: KvType,
    /// Per decoder layer: the backend keeps its routed experts ([`Backend::keep_experts`]), so
    /// they are routed and run there, not fetched from the store.
    pub(crate) kept: Vec<bool>,
    /// Routing replayed from a trace instead of the router's choice (benchmarks only).
    pub(crate) routing_trace: Option<crate::trace_routing::TraceRouting>,
}

struct Loader<'a, B: Backend> {
    entries: HashMap<&'a str, &'a DenseEntry>,
    region: Arc<Vec<u8>>,
    backend: &'a B,
}

impl<B: Backend> Loader<'_, B> {
    fn entry(&self, name: &str) -> Result<&DenseEntry, EngineError> {
        self.entries.get(name).copied().ok_or_else(|| EngineError::Model(format!("the model has no tensor {name}")))
    }
    fn matrix(&self, name: &str) -> Result<B::Matrix, EngineError> {
        let e = self.entry(name)?;
        let (rows, cols) = match e.shape[..] {
            [r, c] => (r, c),
            [c] => (1, c),
            _ => return Err(EngineError::Model(format!("{name} is not a matrix"))),
        };
        Ok(self.backend.matrix(&self.region, e.offset as usize, e.format, rows, cols))
    }
    fn f32s(&self, name: &str) -> Result<Vec<f32>, EngineError> {
        let e = self.entry(name)?;
        let n: usize = e.shape.iter().product();
        let mut out = vec![0f32; n];
        smoe_quant::dequantize(e.format, &self.region[e.offset as usize..(e.offset + e.len) as usize], &mut out)
            .map_err(|err| EngineError::Model(format!("{name}: {err}")))?;
        Ok(out)
    }
    fn vector(&self, name: &str) -> Result<B::Vector, EngineError> {
        Ok(self.backend.vector(&self.f32s(name)?))
    }
    /// `[rows, cols]` tensors side by side, one vector per row: row `r` of each, in order.
    fn row_vectors(&self, names: &[String], rows: usize, cols: usize) -> Result<Vec<B::Vector>, EngineError> {
        let all = names.iter().map(|n| self.f32s(n)).collect::<Result<Vec<_>, _>>()?;
        if let Some((n, t)) = names.iter().zip(&all).find(|(_, t)| t.len() != rows * cols) {
            return Err(EngineError::Model(format!("{n} holds {} values, not {rows} x {cols}", t.len())));
        }
        Ok((0..rows)
            .map(|r| {
                let row: Vec<f32> = all.iter().flat_map(|t| &t[r * cols..(r + 1) * cols]).copied().collect();
                self.backend.vector(&row)
            })
            .collect())
    }
    /// A table of expert ids stored as f32 (DeepSeek-V4's `tid2eid`), each checked to name one
    /// of `experts` experts.
    fn expert_table(&self, name: &str, experts: usize) -> Result<Vec<u32>, EngineError> {
        self.f32s(name)?
            .into_iter()
            .map(|v| {
                if v >= 0.0 && v.fract() == 0.0 && (v as usize) < experts {
                    Ok(v as u32)
                } else {
                    Err(EngineError::Model(format!("{name} names expert {v} of {experts}")))
                }
            })
            .collect()
    }
    fn mlp(&self, l: usize, prefix: &str, width: usize) -> Result<Mlp<B>, EngineError> {
        let n = |p: &str| names::layer(l, &format!("{prefix}.{p}"));
        Ok(Mlp { gate: self.matrix(&n("gate"))?, up: self.matrix(&n("up"))?, down: self.matrix(&n("down"))?, width })
    }
}

impl<B: Backend> Model<B> {
    /// Loads the dense region of `vault` onto `backend` (verifying every tensor's checksum);
    /// routed experts come from `experts`.
    pub fn load(vault: &Vault, backend: B, experts: Arc<dyn ExpertSource>) -> Result<Model<B>, EngineError> {
        let region = vault.read_dense_region()?;
        Model::load_parts(vault.architecture(), &vault.manifest().dense, region, backend, experts)
    }

    /// Loads dense tensors described by `dense` from `region` (a vault's dense region, or one
    /// assembled from a GGUF) onto `backend`.
    pub fn load_parts(
        arch: &Architecture,
        dense: &[DenseEntry],
        region: Vec<u8>,
        backend: B,
        experts: Arc<dyn ExpertSource>,
    ) -> Result<Model<B>, EngineError> {
        let arch = arch.clone();
        let formats: Vec<Format> = dense.iter().map(|d| d.format).collect();
        if let Some(why) = backend_lacks(&arch, &formats, &backend) {
            return Err(EngineError::Model(format!("{why}; run it on the CPU (--device cpu)")));
        }
        if let Some(d) = dense.iter().find(|d| d.offset.checked_add(d.len).is_none_or(|end| end > region.len() as u64)) {
            return Err(EngineError::Model(format!("tensor {} lies outside the dense data", d.name)));
        }
        let mut region = region;
        backend.prepare_dense(&mut region, &product_matrices(&arch, dense));
        let region = Arc::new(region);
        let ld = Loader { entries: dense.iter().map(|d| (d.name.as_str(), d)).collect(), region: region.clone(), backend: &backend };
        let mut layers = Vec::with_capacity(arch.num_layers);
        let compressed_caches = compressed_cache_layers(&arch);
        for l in 0..arch.num_layers {
            let t = |w: &str| names::layer(l, w);
            let hc = match &arch.hyper_connections {
                Some(_) => {
                    let mix = |b: &str| -> Result<HyperMix<B>, EngineError> {
                        Ok(HyperMix {
                            proj: ld.matrix(&t(&format!("hc_{b}_fn")))?,
                            base: ld.f32s(&t(&format!("hc_{b}_base")))?,
                            scale: ld.f32s(&t(&format!("hc_{b}_scale")))?,
                        })
                    };
                    Some([mix("attn")?, mix("ffn")?])
                }
                None => None,
            };
            let attn = if let Some(ca) = &arch.compressed_attention {
                let kind = ca.compression[l];
                let caches = compressed_caches.get(&l);
                let compressor = |prefix: &str, dim: usize, raw_layer: usize, entry_layer: usize| -> Result<Compressor<B>, EngineError> {
                    Ok(Compressor {
                        kv: ld.matrix(&t(&format!("{prefix}_kv")))?,
                        gate: ld.matrix(&t(&format!("{prefix}_gate")))?,
                        bias: ld.vector(&t(&format!("{prefix}_bias")))?,
                        norm: ld.vector(&t(&format!("{prefix}_norm")))?,
                        dim,
                        rate: kind.rate(),
                        overlap: kind.overlaps(),
                        raw_layer,
                        entry_layer,
                    })
                };
                Attention::Compressed(CompressedAttn {
                    q_a: ld.matrix(&t("attn.q_a"))?,
                    q_a_norm: ld.vector(&t("attn.q_a_norm"))?,
                    q_b: ld.matrix(&t("attn.q_b"))?,
                    kv: ld.matrix(&t("attn.kv"))?,
                    kv_norm: ld.vector(&t("attn.kv_norm"))?,
                    o_a: ld.matrix(&t("attn.o_a"))?,
                    o_b: ld.matrix(&t("attn.o_b"))?,
                    sinks: ld.f32s(&t("attn.sinks"))?,
                    compressor: match caches {
                        Some(c) => Some(compressor("attn.cmp", arch.head_dim, c[0], c[1])?),
                        None => None,
                    },
                    indexer: match caches {
                        Some(c) if kind.overlaps() => Some(CompressedIndexer {
                            q: ld.matrix(&t("attn.idx_q"))?,
                            weights: ld.matrix(&t("attn.idx_weights"))?,
                            compressor: compressor("attn.idx_cmp", ca.index_head_dim, c[2], c[3])?,
                        }),
                        _ => None,
                    },
                })
            } else if arch.is_linear(l) {
                let slot = (0..l).filter(|&i| arch.is_linear(i)).count();
                Attention::Linear(LinearAttn {
                    qkv: ld.matrix(&t("lin.qkv"))?,
                    z: ld.matrix(&t("lin.z"))?,
                    b: ld.matrix(&t("lin.b"))?,
                    a: ld.matrix(&t("lin.a"))?,
                    out: ld.matrix(&t("lin.out"))?,
                    conv: ld.vector(&t("lin.conv"))?,
                    neg_a: ld.backend.vector(&ld.f32s(&t("lin.a_log"))?.into_iter().map(|v| -v.exp()).collect::<Vec<_>>()),
                    dt_bias: ld.vector(&t("lin.dt_bias"))?,
                    norm: ld.vector(&t("lin.norm"))?,
                    slot,
                })
            } else {
                match &arch.mla {
                    Some(m) => Attention::Latent(LatentAttention {
                        q_a: match m.q_lora_rank {
                            Some(_) => Some((ld.matrix(&t("attn.q_a"))?, ld.vector(&t("attn.q_a_norm"))?)),
                            None => None,
                        },
                        q_b: ld.matrix(&t(if m.q_lora_rank.is_some() { "attn.q_b" } else { "attn.q" }))?,
                        kv_a: ld.matrix(&t("attn.kv_a"))?,
                        kv_a_norm: ld.vector(&t("attn.kv_a_norm"))?,
                        kv_b: ld.matrix(&t("attn.kv_b"))?,
                        o: ld.matrix(&t("attn.o"))?,
                        indexer: match arch.indexer_layers().iter().position(|&i| i == l) {
                            Some(j) => Some(Indexer {
                                q: ld.matrix(&t("attn.idx_q"))?,
                                k: ld.matrix(&t("attn.idx_k"))?,
                                k_norm: (ld.vector(&t("attn.idx_k_norm"))?, ld.vector(&t("attn.idx_k_norm_bias"))?),
                                weights: ld.matrix(&t("attn.idx_weights"))?,
                                cache_layer: arch.num_layers + j,
                            }),
                            None => None,
                        },
                    }),
                    None => Attention::Standard(StandardAttention {
                        q: ld.matrix(&t("attn.q"))?,
                        k: ld.matrix(&t("attn.k"))?,
                        v: ld.matrix(&t("attn.v"))?,
                        o: ld.matrix(&t("attn.o"))?,
                        bias: if arch.qkv_bias {
                            Some([ld.vector(&t("attn.q_bias"))?, ld.vector(&t("attn.k_bias"))?, ld.vector(&t("attn.v_bias"))?])
                        } else {
                            None
                        },
                        qk_norm: match arch.qk_norm {
                            QkNorm::None => None,
                            kind => Some((kind, ld.vector(&t("attn.q_norm"))?, ld.vector(&t("attn.k_norm"))?)),
                        },
                        o_bias: if arch.o_bias { Some(ld.vector(&t("attn.o_bias"))?) } else { None },
                        sinks: if arch.attn_sinks { Some(ld.f32s(&t("attn.sinks"))?) } else { None },
                        window: arch.attention_window(l),
                        gate: if arch.attn_output_gate { Some(ld.matrix(&t("attn.q_gate"))?) } else { None },
                    }),
                }
            };
            let ffn = match arch.layers[l] {
                LayerKind::Dense => FeedForward::Dense(ld.mlp(l, "mlp", arch.dense_intermediate_size)?),
                LayerKind::Moe => FeedForward::Moe(MoeBlock {
                    router: ld.matrix(&t("moe.router"))?,
                    tid2eid: if arch.moe.hash_routed(l) { Some(ld.expert_table(&t("moe.tid2eid"), arch.moe.num_experts)?) } else { None },
                    router_bias: if ld.entries.contains_key(t("moe.router_bias").as_str()) {
                        Some(ld.f32s(&t("moe.router_bias"))?)
                    } else {
                        None
                    },
                    router_bias_kept: if ld.entries.contains_key(t("moe.router_bias").as_str()) && backend.keep_room() > 0 {
                        Some(ld.vector(&t("moe.router_bias"))?)
                    } else {
                        None
                    },
                    shared: match &arch.moe.shared_experts {
                        Some(s) => Some(ld.mlp(l, "moe.shared", s.intermediate_size)?),
                        None => None,
                    },
                    shared_gate: match &arch.moe.shared_experts {
                        Some(s) if s.sigmoid_gate => Some(ld.matrix(&t("moe.shared_gate"))?),
                        _ => None,
                    },
                    router_logit_bias: if arch.moe.router_logit_bias { Some(ld.vector(&t("moe.router_logit_bias"))?) } else { None },
                    expert_bias: if arch.moe.expert_bias {
                        let (e, i) = (arch.moe.num_experts, arch.moe.intermediate_size);
                        Some(ExpertBias {
                            gate_up: ld.row_vectors(&[t("moe.expert_gate_bias"), t("moe.expert_up_bias")], e, i)?,
                            down: ld.row_vectors(&[t("moe.expert_down_bias")], e, arch.hidden_size)?,
                        })
                    } else {
                        None
                    },
                }),
            };
            layers.push(Layer { hc, attn_norm: ld.vector(&t("attn_norm"))?, attn, ffn_norm: ld.vector(&t("ffn_norm"))?, ffn });
        }
        let attn_scale = match &arch.mla {
            Some(m) => {
                let mut s = 1.0 / ((m.qk_nope_head_dim + m.qk_rope_head_dim) as f64).sqrt();
                // DeepSeek's YaRN also sharpens the softmax by mscale(factor, mscale_all_dim)².
                if let RopeScaling::Yarn { factor, mscale_all_dim: Some(ma), .. } = arch.rope.scaling {
                    if ma != 0.0 {
                        let m = yarn_mscale(factor, ma);
                        s *= m * m;
                    }
                }
                s as f32
            }
            None => 1.0 / (arch.head_dim as f32).sqrt(),
        };
        let hc_head = match &arch.hyper_connections {
            Some(_) => Some(HyperMix { proj: ld.matrix("hc_head_fn")?, base: ld.f32s("hc_head_base")?, scale: ld.f32s("hc_head_scale")? }),
            None => None,
        };
        let ones_head = arch.compressed_attention.as_ref().map(|_| backend.vector(&vec![1.0; arch.head_dim]));
        let ones_streams = arch.hyper_connections.as_ref().map(|h| backend.vector(&vec![1.0; h.mult * arch.hidden_size]));
        let (embed, final_norm) = (ld.matrix("embed")?, ld.vector("final_norm")?);
        let lm_head = if arch.tie_word_embeddings { None } else { Some(ld.matrix("lm_head")?) };
        if let Some(fault) = backend.fault() {
            return Err(EngineError::Backend(format!("loading {} MiB of dense weights: {fault}", region.len() >> 20)));
        }
        // Sound because the model owns the source and drops `backend` (declared first) before it.
        backend.use_host_memory(&experts.host_memory());
        if backend.locks_host_memory() {
            experts.host_memory_locked();
        }
        let kept = keep_all_experts(&backend, experts.as_ref(), &arch)?;
        Ok(Model {
            kept,
            embed,
            final_norm,
            lm_head,
            rope: RopeTable::new(&arch),
            compress_rope: arch.compressed_attention.as_ref().map(|c| RopeTable::of(&c.compress_rope)),
            hc_head,
            ones_head,
            ones_streams,
            router: RouterRule::new(&arch.moe),
            eps: arch.norm_eps as f32,
            attn_scale,
            dense_bytes: region.len() as u64,
            embed_bytes: ld.entry("embed")?.len,
            lookahead: false,
            kv_rewind: DEFAULT_KV_REWIND,
            kv_type: KvType::F32,
            routing_trace: None,
            layers,
            experts,
            backend,
            arch,
        })
    }

    /// MoE layers whose routed experts the backend keeps itself (routed there, never asked
    /// of the store).
    pub fn kept_layers(&self) -> usize {
        self.kept.iter().filter(|&&k| k).count()
    }

    /// The architecture.
    pub fn arch(&self) -> &Architecture {
        &self.arch
    }
    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }
    /// The expert source.
    pub fn experts(&self) -> &Arc<dyn ExpertSource> {
        &self.experts
    }
    /// Turns lookahead prefetch on: after each layer's attention, the next MoE layer's router is
    /// applied to the current hidden state and its predicted experts are read ahead.
    pub fn set_lookahead(&mut self, on: bool) {
        self.lookahead = on;
    }
    /// Replaces the router's choice of experts with a recorded trace's, for I/O and cache
    /// benchmarks on random-weight models (see [`TraceRouting`](crate::trace_routing::TraceRouting));
    /// the text produced is meaningless. `None` restores exact routing.
    pub fn set_routing_trace(&mut self, trace: Option<crate::trace_routing::TraceRouting>) {
        self.routing_trace = trace;
    }
    /// The routing trace in use, if any.
    pub fn routing_trace(&self) -> Option<&crate::trace_routing::TraceRouting> {
        self.routing_trace.as_ref()
    }
    /// Bytes of dense weights held.
    pub fn dense_bytes(&self) -> u64 {
        self.dense_bytes
    }

    /// Dense bytes one decoded token reads: every dense tensor but the embedding table (one
    /// row of it), unless the embedding doubles as the LM head.
    pub fn dense_bytes_per_token(&self) -> u64 {
        if self.arch.tie_word_embeddings {
            self.dense_bytes
        } else {
            self.dense_bytes - self.embed_bytes + self.embed_bytes / self.arch.vocab_size.max(1) as u64
        }
    }

    /// The shape of each layer's KV cache.
    pub fn kv_shapes(&self) -> Vec<KvShape> {
        let mut shapes = kv_shapes_rewinding(&self.arch, self.kv_rewind);
        mark_kv_type(&self.arch, self.kv_type, &mut shapes);
        shapes
    }

    /// Stores the KV cache's rows as `t` (f32 by default; f16 halves the cache at a rounding
    /// of about 1e-3 relative per value, as llama.cpp's default `-ctk f16 -ctv f16` does;
    /// [`KvType::Auto`] takes f16 where it can).
    /// Applies to states made after the call. Refused on a backend that keeps f32 only (the
    /// GPU's) and for DeepSeek-V4, whose compressed caches are built from the rows in f32.
    pub fn set_kv_type(&mut self, t: KvType) -> Result<(), String> {
        let t = t.resolve(&self.arch, &self.backend);
        if let Some(why) = kv_type_refusal(&self.arch, t, self.backend.kv_f16()) {
            return Err(why);
        }
        self.kv_type = t;
        Ok(())
    }

    /// What [`set_kv_type`](Self::set_kv_type) set ([`KvType::Auto`] made definite).
    pub fn kv_type(&self) -> KvType {
        self.kv_type
    }

    /// DeepSeek-V4, and gpt-oss's sliding layers: how many positions a sequence can go back
    /// (truncation, prefix copies) and continue from its cache; going back further starts it
    /// over. Sliding and raw rows are kept this far back beyond what attention reads, older ones
    /// dropped: memory against the cost of re-running a prefix. Applies to states made after the
    /// call.
    pub fn set_kv_rewind(&mut self, positions: usize) {
        self.kv_rewind = positions;
    }

    /// What [`set_kv_rewind`](Self::set_kv_rewind) set, where the model drops old rows.
    pub fn kv_rewind(&self) -> Option<usize> {
        if self.arch.linear_attention.is_some() {
            // A recurrent state holds the sequence up to its last token only.
            return Some(0);
        }
        let windowed = self.arch.attention_windows.iter().any(Option::is_some);
        (self.arch.compressed_attention.is_some() || windowed).then_some(self.kv_rewind)
    }

    /// Gated DeltaNet layers' parameters, by the slot of their state in a sequence (see
    /// [`LinearAttn::slot`]); empty for a model without them.
    pub(crate) fn linear_layers(&self) -> Vec<&LinearAttn<B>> {
        self.layers
            .iter()
            .filter_map(|l| match &l.attn {
                Attention::Linear(a) => Some(a),
                _ => None,
            })
            .collect()
    }

    /// Floats of one Gated DeltaNet layer's state per sequence (0 without them).
    pub(crate) fn recurrent_floats(&self) -> usize {
        self.arch.linear_attention.as_ref().map_or(0, |la| la.state_floats())
    }

    /// The parameters [`Backend::gated_delta_net`] takes for `a`.
    pub(crate) fn delta_params<'m>(&'m self, a: &'m LinearAttn<B>) -> crate::backend::DeltaNetParams<'m, B::Vector> {
        let la = self.arch.linear_attention.as_ref().expect("a linear layer without linear attention");
        crate::backend::DeltaNetParams {
            key_heads: la.key_heads,
            value_heads: la.value_heads,
            tiled: la.tiled_value_heads,
            key_dim: la.key_dim,
            value_dim: la.value_dim,
            taps: la.conv_kernel,
            conv: &a.conv,
            neg_a: &a.neg_a,
            dt_bias: &a.dt_bias,
            norm: &a.norm,
            eps: self.eps,
        }
    }
}

/// What `backend` lacks to run `arch` with weights stored as `formats`, said as the error a
/// load fails with (`None`: nothing). `--device auto` asks before opening, to run such a model
/// on the CPU instead of failing.
pub fn backend_lacks<B: Backend>(arch: &Architecture, formats: &[Format], backend: &B) -> Option<String> {
    let lacks = |what: &str| {
        // The backend's name without its details ("cuda:0 NVIDIA H200", "cpu avx512-vnni int8").
        let name = backend.describe().split(" (").next().unwrap_or_default().to_string();
        Some(format!("{} uses {what}, which the {name} backend does not implement yet", arch.family.model_type()))
    };
    if let Some(f) = formats.iter().find(|f| !backend.decodes(**f)) {
        return lacks(&format!("{f} weights"));
    }
    if (arch.attn_sinks || !arch.attention_windows.is_empty()) && !backend.attends_windows_and_sinks() {
        return lacks("attention sinks and sliding windows");
    }
    if arch.sparse_attention.is_some() && !backend.attends_selected() {
        return lacks("DeepSeek Sparse Attention");
    }
    if arch.compressed_attention.is_some() && !backend.attends_compressed() {
        return lacks("DeepSeek-V4's compressed attention");
    }
    if (arch.linear_attention.is_some() || arch.attn_output_gate) && !backend.runs_linear_attention() {
        return lacks("Gated DeltaNet linear attention");
    }
    None
}

/// The shape of each layer's KV cache for `arch`: GQA caches `num_kv_heads` keys and values;
/// MLA caches one normalised latent plus one shared rope key per position, and reads values
/// from the latent (the absorbed form). After the decoder layers' come the DSA indexers' key
/// caches (one `index_head_dim` key per position for each layer that runs its own indexer), so
/// that whatever handles a sequence's cache (prefix copies, truncation, sizes) handles them too.
pub fn kv_shapes(arch: &Architecture) -> Vec<KvShape> {
    kv_shapes_rewinding(arch, DEFAULT_KV_REWIND)
}

/// How the KV cache stores its rows ([`Model::set_kv_type`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvType {
    /// 4 bytes a value: exactly what attention computed.
    #[default]
    F32,
    /// 2 bytes a value, rounded to nearest even (IEEE half).
    F16,
    /// f16 where the backend and the model take it and the backend's arithmetic is not held
    /// to a reference ([`Backend::kv_f16_by_default`]: the CPU's production kernels, every
    /// family but DeepSeek-V4), else f32. The CLI's default.
    Auto,
}

/// Marks the layers of `shapes` that `t` stores as f16: with [`KvType::F16`], the decoder's
/// own layers (keys and values, or MLA's latents); the layers after them (the lightning
/// indexer's keys, DeepSeek-V4's compressed caches) are read by other ops and stay f32.
fn mark_kv_type(arch: &Architecture, t: KvType, shapes: &mut [KvShape]) {
    if t == KvType::F16 && arch.compressed_attention.is_none() {
        for s in shapes.iter_mut().take(arch.num_layers).filter(|s| s.heads > 0) {
            s.f16 = true;
        }
    }
}

/// Why a model of `arch` cannot store its KV cache as `t` on a backend that can (`backend_f16`)
/// or cannot store f16 rows; `None` if it can.
pub fn kv_type_refusal(arch: &Architecture, t: KvType, backend_f16: bool) -> Option<String> {
    match t {
        KvType::F32 | KvType::Auto => None,
        KvType::F16 if !backend_f16 => Some("--kv-type f16: this backend keeps its KV cache in f32 (the CPU backend stores f16)".into()),
        KvType::F16 if arch.compressed_attention.is_some() => {
            Some("--kv-type f16: DeepSeek-V4's compressed attention builds its caches from f32 rows; use --kv-type f32".into())
        }
        KvType::F16 => None,
    }
}

/// Bytes a sequence's KV cache adds per token and holds whatever its length (see
/// [`kv_values_per_token`], [`kv_fixed_values`]) when stored as `t`.
pub fn kv_bytes(arch: &Architecture, t: KvType) -> (usize, usize) {
    // Sizing before a backend is chosen counts `Auto` as the CPU's production kernels store it.
    let t = if t == KvType::Auto && kv_type_refusal(arch, KvType::F16, true).is_none() { KvType::F16 } else { t };
    let mut shapes = kv_shapes(arch);
    mark_kv_type(arch, t, &mut shapes);
    let f32_bytes = (kv_values_per_token(arch) * 4, kv_fixed_values(arch) * 4);
    // Every value of a layer marked f16 takes two bytes less.
    let halved = |keep: bool| -> usize {
        let slack = crate::cpu::DROP_SLACK;
        shapes.iter().filter(|s| s.f16 && s.keep.is_some() == keep).map(|s| row_values(s) * s.keep.map_or(1, |k| k + slack) * 2).sum()
    };
    (f32_bytes.0 - halved(false), f32_bytes.1 - halved(true))
}

impl KvType {
    /// What `self` stores for a model of `arch` on `backend`: [`KvType::Auto`] made definite.
    pub fn resolve<B: Backend>(self, arch: &Architecture, backend: &B) -> KvType {
        match self {
            KvType::Auto if backend.kv_f16_by_default() && kv_type_refusal(arch, KvType::F16, backend.kv_f16()).is_none() => KvType::F16,
            KvType::Auto => KvType::F32,
            t => t,
        }
    }
}

impl std::fmt::Display for KvType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Auto => "auto",
        })
    }
}

impl std::str::FromStr for KvType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(KvType::F32),
            "f16" => Ok(KvType::F16),
            "auto" => Ok(KvType::Auto),
            _ => Err(format!("unknown KV cache type '{s}' (auto, f32, f16)")),
        }
    }
}

/// Positions a DeepSeek-V4 or gpt-oss sequence can go back by default (see
/// [`Model::set_kv_rewind`]): enough for a chat's regenerated reply or a client's edited last
/// message.
pub const DEFAULT_KV_REWIND: usize = 512;

/// [`kv_shapes`] with the bounded rows (DeepSeek-V4's, gpt-oss's sliding layers') kept `rewind`
/// positions beyond what attention reads.
pub fn kv_shapes_rewinding(arch: &Architecture, rewind: usize) -> Vec<KvShape> {
    if let Some(c) = &arch.compressed_attention {
        // The sliding branch keeps one shared key=value row per position, read `window - 1`
        // back; then each compressed layer's raw rows (read one window back, two when windows
        // overlap) and entries (and its indexer's), as `compressed_cache_layers` numbers them.
        let row = |w: usize, keep: Option<usize>| KvShape { heads: 1, k_dim: w, v_dim: 0, values_in_keys: true, keep, f16: false };
        let window = Some(c.window - 1 + rewind);
        let mut shapes =
            vec![
                KvShape { heads: 1, k_dim: arch.head_dim, v_dim: arch.head_dim, values_in_keys: true, keep: window, f16: false };
                arch.num_layers
            ];
        for kind in c.compression.iter().filter(|k| k.rate() > 0) {
            let c_of = |dim: usize| if kind.overlaps() { 2 * dim } else { dim };
            let raw = Some(if kind.overlaps() { 2 } else { 1 } * kind.rate() + rewind);
            shapes.extend([row(2 * c_of(arch.head_dim), raw), row(arch.head_dim, None)]);
            if kind.overlaps() {
                shapes.extend([row(2 * c_of(c.index_head_dim), raw), row(c.index_head_dim, None)]);
            }
        }
        return shapes;
    }
    let mut shapes: Vec<KvShape> = (0..arch.num_layers)
        .map(|l| match &arch.mla {
            // A Gated DeltaNet layer caches nothing per position: its state is fixed-size.
            None if arch.is_linear(l) => {
                KvShape { heads: 0, k_dim: arch.head_dim, v_dim: arch.head_dim, values_in_keys: false, keep: None, f16: false }
            }
            Some(m) => KvShape {
                heads: 1,
                k_dim: m.kv_lora_rank + m.qk_rope_head_dim,
                v_dim: m.kv_lora_rank,
                values_in_keys: true,
                keep: None,
                f16: false,
            },
            // A sliding-window layer (gpt-oss) reads `window - 1` rows back, kept with the rewind.
            None => KvShape {
                heads: arch.num_kv_heads,
                k_dim: arch.head_dim,
                v_dim: arch.head_dim,
                values_in_keys: false,
                keep: arch.attention_window(l).map(|w| w - 1 + rewind),
                f16: false,
            },
        })
        .collect();
    if let Some(s) = &arch.sparse_attention {
        let index_keys = KvShape { heads: 1, k_dim: s.head_dim, v_dim: 0, values_in_keys: true, keep: None, f16: false };
        shapes.extend(arch.indexer_layers().iter().map(|_| index_keys));
    }
    shapes
}

/// DeepSeek-V4: per compressed layer, its cache layers after the decoder's (see
/// [`kv_shapes`]): raw rows, entries, and for CSA layers the indexer's raw rows and entries.
pub(crate) fn compressed_cache_layers(arch: &Architecture) -> HashMap<usize, Vec<usize>> {
    let mut out = HashMap::new();
    let Some(c) = &arch.compressed_attention else { return out };
    let mut next = arch.num_layers;
    for (l, kind) in c.compression.iter().enumerate().filter(|(_, k)| k.rate() > 0) {
        let count = if kind.overlaps() { 4 } else { 2 };
        out.insert(l, (next..next + count).collect());
        next += count;
    }
    out
}

/// Values cached per token, summed over layers, as this engine stores them. DeepSeek-V4 keeps
/// its sliding and raw rows for a bounded span only ([`kv_fixed_values`]): per token it adds
/// the compressed entries, a `1 / rate` share of a row each (rounded up per layer).
pub fn kv_values_per_token(arch: &Architecture) -> usize {
    if let Some(c) = &arch.compressed_attention {
        let mut v = 0;
        for kind in c.compression.iter().filter(|k| k.rate() > 0) {
            v += arch.head_dim.div_ceil(kind.rate());
            if kind.overlaps() {
                v += c.index_head_dim.div_ceil(kind.rate());
            }
        }
        return v;
    }
    // Layers that keep a bounded span (gpt-oss's sliding windows) are in `kv_fixed_values`.
    kv_shapes(arch).iter().filter(|s| s.keep.is_none()).map(row_values).sum()
}

/// Values one position adds to a cache layer of `shape`.
fn row_values(shape: &KvShape) -> usize {
    shape.heads * (shape.k_dim + if shape.values_in_keys { 0 } else { shape.v_dim })
}

/// Values a sequence's cache holds whatever its length, at most (the bounded rows of DeepSeek-V4
/// and of gpt-oss's sliding layers, with the default rewind and the CPU backend's slack;
/// Qwen3-Next's recurrent states): 0 for other families.
pub fn kv_fixed_values(arch: &Architecture) -> usize {
    let slack = crate::cpu::DROP_SLACK;
    let linear = arch.linear_attention.as_ref().map_or(0, |la| la.state_floats() * la.layers.iter().filter(|&&l| l).count());
    linear + kv_shapes(arch).iter().filter_map(|s| s.keep.map(|k| (k + slack) * row_values(s))).sum::<usize>()
}

/// Values per token of a naive cache: full keys and values for every query head.
pub fn naive_kv_values_per_token(arch: &Architecture) -> usize {
    let per_layer = match &arch.mla {
        Some(m) => arch.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim),
        None => arch.num_heads * 2 * arch.head_dim,
    };
    per_layer * arch.num_layers
}

/// Hands every routed expert to the backend when it has room to keep all of them (a GPU with
/// the whole model in VRAM), layer by layer from the store; returns which layers it kept. All
/// or nothing: a model that only partly fits runs through the store and the backend's own
/// expert cache, which follows the routing rather than a fixed split by layer.
fn keep_all_experts<B: Backend>(backend: &B, experts: &dyn ExpertSource, arch: &Architecture) -> Result<Vec<bool>, EngineError> {
    let mut kept = vec![false; arch.num_layers];
    let room = backend.keep_room();
    let moe: Vec<usize> = (0..arch.num_layers).filter(|&l| arch.layers[l] == LayerKind::Moe).collect();
    let (Some(&first), true) = (moe.first(), room > 0) else { return Ok(kept) };
    // A kept layer runs as `Backend::kept_experts`, which knows SwiGLU experts without biases,
    // their SiLU plain or clipped (DeepSeek-V4), not gpt-oss's.
    let act_kept = matches!(arch.moe.expert_act, smoe_vault::ExpertAct::Silu | smoe_vault::ExpertAct::ClampedSilu { .. });
    if arch.moe.expert_bias || arch.moe.router_logit_bias || !act_kept {
        return Ok(kept);
    }
    let count = arch.moe.num_experts;
    let mut one = 0u64;
    experts.with_experts(first, &[0], &mut |batch| {
        for (_, v) in batch {
            one = (v.gate.data.len() + v.up.data.len() + v.down.data.len()) as u64;
        }
    })?;
    if one * (count * moe.len()) as u64 > room {
        return Ok(kept);
    }
    let ids: Vec<u32> = (0..count as u32).collect();
    for &l in &moe {
        let mut ok = true;
        experts.with_experts(l, &ids, &mut |batch| {
            let pairs: Vec<(u32, smoe_store::ExpertView<'_>)> = batch.iter().map(|(i, v)| (ids[*i], *v)).collect();
            ok &= backend.keep_experts(l, count, &pairs);
        })?;
        if let Some(fault) = backend.fault() {
            return Err(EngineError::Backend(format!("keeping the routed experts of layer {l}: {fault}")));
        }
        kept[l] = ok;
    }
    Ok(kept)
}

/// The dense matrices the decoder only ever multiplies (attention projections of standard
/// attention, dense and shared-expert MLPs, an untied LM head), as `(offset, format, rows,
/// cols)`: those a backend may lay out its own way ([`Backend::prepare_dense`]). Tied
/// embeddings, routers, vectors and MLA's matrices (read row by row, or transposed) are not.
fn product_matrices(arch: &Architecture, dense: &[DenseEntry]) -> Vec<(usize, smoe_quant::Format, usize, usize)> {
    let mut names: Vec<String> = Vec::new();
    for l in 0..arch.num_layers {
        if arch.is_linear(l) {
            names.extend(["lin.qkv", "lin.z", "lin.out"].map(|w| names::layer(l, w)));
        } else if arch.mla.is_none() {
            names.extend(["attn.q", "attn.k", "attn.v", "attn.o", "attn.q_gate"].map(|w| names::layer(l, w)));
        }
        let prefix = match arch.layers[l] {
            LayerKind::Dense => Some("mlp"),
            LayerKind::Moe if arch.moe.shared_experts.is_some() => Some("moe.shared"),
            LayerKind::Moe => None,
        };
        if let Some(p) = prefix {
            names.extend(["gate", "up", "down"].map(|w| names::layer(l, &format!("{p}.{w}"))));
        }
    }
    if !arch.tie_word_embeddings {
        names.push("lm_head".to_string());
    }
    dense
        .iter()
        .filter(|d| names.contains(&d.name))
        .filter_map(|d| match d.shape[..] {
            [r, c] => Some((d.offset as usize, d.format, r, c)),
            _ => None,
        })
        .collect()
}
