//! `smoe synth`: random-weight checkpoints with the exact shapes of published MoE models.
//!
//! Real weights cannot be downloaded here, so speed is measured on checkpoints that have a real
//! model's config.json (all but `num_hidden_layers`, which `--layers` may cut), its tensor names
//! and shapes, sharded bf16 safetensors and a tokenizer. Values are drawn so that quantization
//! error and routing behave like a trained model's rather than degenerately:
//!
//! - matrices: N(0, 1/cols) (activations stay O(1) through every projection), with one value in
//!   256 multiplied by 8 — the outlier weights trained models have, which make block scales work;
//! - router matrices: N(0, 1/hidden), so router logits are O(1) and softmax/sigmoid scores
//!   spread over many experts instead of collapsing onto one. With `--router-spread s`, expert
//!   `e`'s row is further scaled by `exp(s·z_e)` (`z_e` a standard normal per layer and expert):
//!   at 0 every expert is equally likely; larger values make a few experts win most tokens,
//!   concentrating routing as trained models' popular experts do (top-k does not change with a
//!   common scale, so concentration needs unequal rows);
//! - norm weights 1 + N(0, 0.05²), biases and correction biases N(0, 0.02²), embeddings N(0, 0.05²).
//!
//! Generation is deterministic in `--seed` and streams tensor by tensor with bounded memory.

use crate::{ConvertError, Progress};
use rayon::prelude::*;
use serde_json::{json, Value};
use smoe_formats::hf::{self, hf_expert_names, hf_name};
use smoe_formats::FormatError;
use smoe_quant::Format;
use smoe_vault::names;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

/// Shapes `smoe synth` knows, with their published config.json.
pub fn shape_names() -> Vec<&'static str> {
    vec![
        "qwen3-30b-a3b",
        "qwen3-235b-a22b",
        "qwen2-57b-a14b",
        "mixtral-8x7b",
        "mixtral-8x22b",
        "olmoe-1b-7b",
        "glm-4.5-air",
        "glm-4.5",
        "deepseek-v3",
        "kimi-k2",
        "minimax-m2",
        "gpt-oss-20b",
        "gpt-oss-120b",
        "glm-5",
        "glm-5.2",
        "deepseek-v4-flash",
        "deepseek-v4-pro",
        "qwen3-next-80b-a3b",
        "qwen3.5-397b-a17b",
    ]
}

/// The published config.json of a shape (Kimi-K2 is DeepSeek-V3's architecture with 384
/// experts, 64 heads, one dense layer and a 163840-token vocabulary).
pub fn shape_config(name: &str) -> Result<Value, ConvertError> {
    let qwen3 = |hidden: usize, layers: usize, heads: usize, inter: usize, moe_inter: usize| {
        json!({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": false,
            "bos_token_id": 151643, "eos_token_id": 151645, "decoder_sparse_step": 1, "head_dim": 128,
            "hidden_act": "silu", "hidden_size": hidden, "initializer_range": 0.02, "intermediate_size": inter,
            "max_position_embeddings": 40960, "max_window_layers": layers, "mlp_only_layers": [],
            "moe_intermediate_size": moe_inter, "norm_topk_prob": true, "num_attention_heads": heads,
            "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": layers, "num_key_value_heads": 4,
            "output_router_logits": false, "rms_norm_eps": 1e-6, "rope_scaling": null, "rope_theta": 1000000.0,
            "router_aux_loss_coef": 0.001, "sliding_window": null, "tie_word_embeddings": false,
            "torch_dtype": "bfloat16", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
        })
    };
    Ok(match name {
        "qwen3-30b-a3b" => qwen3(2048, 48, 32, 6144, 768),
        "qwen3-235b-a22b" => qwen3(4096, 94, 64, 12288, 1536),
        "glm-4.5-air" => json!({
            "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": true,
            "attention_dropout": 0.0, "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338],
            "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096, "partial_rotary_factor": 0.5,
            "initializer_range": 0.02, "intermediate_size": 10944, "max_position_embeddings": 131072,
            "num_attention_heads": 96, "num_hidden_layers": 46, "moe_intermediate_size": 1408,
            "n_routed_experts": 128, "n_shared_experts": 1, "n_group": 1, "topk_group": 1,
            "norm_topk_prob": true, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
            "num_key_value_heads": 8, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-5,
            "rope_scaling": null, "rope_theta": 1000000, "routed_scaling_factor": 1.0,
            "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true, "use_qk_norm": false,
            "vocab_size": 151552
        }),
        "glm-4.5" => {
            let mut c = shape_config("glm-4.5-air")?;
            for (k, v) in [
                ("hidden_size", 5120),
                ("num_hidden_layers", 92),
                ("intermediate_size", 12288),
                ("moe_intermediate_size", 1536),
                ("n_routed_experts", 160),
                ("first_k_dense_replace", 3),
            ] {
                c[k] = v.into();
            }
            c["use_qk_norm"] = true.into();
            c["routed_scaling_factor"] = 2.5.into();
            c
        }
        "mixtral-8x7b" => json!({
            "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "attention_dropout": 0.0,
            "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
            "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 32768,
            "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
            "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": false,
            "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02,
            "sliding_window": null, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            "use_cache": true, "vocab_size": 32000
        }),
        "qwen2-57b-a14b" => json!({
            "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "attention_dropout": 0.0,
            "bos_token_id": 151643, "eos_token_id": 151643, "decoder_sparse_step": 1, "hidden_act": "silu",
            "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 32768,
            "max_window_layers": 28, "moe_intermediate_size": 2560, "norm_topk_prob": false, "num_attention_heads": 28,
            "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 28, "num_key_value_heads": 4,
            "output_router_logits": false, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 20480, "sliding_window": 65536, "tie_word_embeddings": false,
            "torch_dtype": "bfloat16", "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
        }),
        "mixtral-8x22b" => {
            let mut c = shape_config("mixtral-8x7b")?;
            for (k, v) in [
                ("hidden_size", 6144),
                ("intermediate_size", 16384),
                ("max_position_embeddings", 65536),
                ("num_attention_heads", 48),
                ("num_hidden_layers", 56),
                ("vocab_size", 32768),
            ] {
                c[k] = v.into();
            }
            c
        }
        // Qwen/Qwen3-Next-80B-A3B-Instruct's config.json.
        "qwen3-next-80b-a3b" => json!({
            "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "attention_bias": false,
            "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645,
            "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
            "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
            "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
            "moe_intermediate_size": 512, "norm_topk_prob": true, "num_attention_heads": 16, "num_experts": 512,
            "num_experts_per_tok": 10, "num_hidden_layers": 48, "num_key_value_heads": 2,
            "output_router_logits": false, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
            "rope_scaling": null, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": 512, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
        }),
        // Qwen/Qwen3.5-397B-A17B's text_config, written flat (the decoder alone: synth makes no
        // vision tower); token ids are the synth tokenizer's (Qwen3's), not Qwen3.5's.
        "qwen3.5-397b-a17b" => json!({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
            "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 4096,
            "initializer_range": 0.02, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128,
            "linear_num_key_heads": 16, "linear_num_value_heads": 64, "linear_value_head_dim": 128,
            "max_position_embeddings": 262144, "moe_intermediate_size": 1024, "num_attention_heads": 32,
            "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 60, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-6, "rope_parameters": {"rope_theta": 10000000, "partial_rotary_factor": 0.25,
            "rope_type": "default"}, "shared_expert_intermediate_size": 1024, "tie_word_embeddings": false,
            "torch_dtype": "bfloat16", "use_cache": true, "vocab_size": 248320
        }),
        "minimax-m2" => json!({
            "architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "attention_dropout": 0.0,
            "bos_token_id": 200034, "eos_token_id": 200020, "head_dim": 128, "hidden_act": "silu",
            "hidden_size": 3072, "initializer_range": 0.02, "intermediate_size": 1536,
            "max_position_embeddings": 196608, "num_attention_heads": 48, "num_experts_per_tok": 8,
            "num_hidden_layers": 62, "num_key_value_heads": 8, "num_local_experts": 256,
            "qk_norm_type": "per_layer", "rms_norm_eps": 1e-6, "rope_theta": 5000000, "rotary_dim": 64,
            "router_aux_loss_coef": 0.001, "scoring_func": "sigmoid", "tie_word_embeddings": false,
            "torch_dtype": "bfloat16", "use_cache": true, "use_qk_norm": true, "use_routing_bias": true,
            "vocab_size": 200064
        }),
        // The published configs (without their `quantization_config`: synth writes the experts
        // per expert, in bf16, where the hub keeps them fused in MXFP4).
        "gpt-oss-20b" | "gpt-oss-120b" => {
            let (layers, experts) = if name == "gpt-oss-20b" { (24, 32) } else { (36, 128) };
            let types: Vec<&str> = (0..layers).map(|l| if l % 2 == 0 { "sliding_attention" } else { "full_attention" }).collect();
            json!({
                "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": true,
                "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
                "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096,
                "initializer_range": 0.02, "intermediate_size": 2880, "layer_types": types,
                "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
                "num_hidden_layers": layers, "num_key_value_heads": 8, "num_local_experts": experts,
                "output_router_logits": false, "pad_token_id": 199999, "rms_norm_eps": 1e-5,
                "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                 "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false},
                "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
                "tie_word_embeddings": false, "torch_dtype": "bfloat16", "use_cache": true, "vocab_size": 201088
            })
        }
        "olmoe-1b-7b" => json!({
            "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "attention_bias": false,
            "attention_dropout": 0.0, "bos_token_id": null, "eos_token_id": 50279, "pad_token_id": 1,
            "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 1024,
            "max_position_embeddings": 4096, "norm_topk_prob": false, "num_attention_heads": 16,
            "num_experts": 64, "num_experts_per_tok": 8, "num_hidden_layers": 16, "num_key_value_heads": 16,
            "output_router_logits": false, "rms_norm_eps": 1e-5, "rope_scaling": null, "rope_theta": 10000.0,
            "router_aux_loss_coef": 0.01, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
            "use_cache": true, "vocab_size": 50304
        }),
        "kimi-k2" => {
            let mut c = shape_config("deepseek-v3")?;
            for (k, v) in [
                ("n_routed_experts", 384),
                ("num_attention_heads", 64),
                ("num_key_value_heads", 64),
                ("first_k_dense_replace", 1),
                ("n_group", 1),
                ("topk_group", 1),
                ("vocab_size", 163840),
                ("bos_token_id", 163584),
                ("eos_token_id", 163585),
                ("max_position_embeddings", 131072),
            ] {
                c[k] = v.into();
            }
            c["routed_scaling_factor"] = 2.827.into();
            c["rope_theta"] = 50000.0.into();
            c["rope_scaling"]["factor"] = 32.0.into();
            c
        }
        // GLM-5 and GLM-5.1 (one shape): every layer runs its indexer. GLM-5.2 indexes layers 0,
        // 1, 2 and every fourth after (its `index_topk_freq` 4 and `index_skip_topk_offset` 3,
        // which transformers expands into the `indexer_types` its hub config also lists).
        "glm-5" => json!({
            "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "attention_bias": false,
            "eos_token_id": [154820, 154827, 154829], "pad_token_id": 154820, "first_k_dense_replace": 3,
            "hidden_act": "silu", "hidden_size": 6144, "index_head_dim": 128, "index_n_heads": 32, "index_topk": 2048,
            "indexer_rope_interleave": true, "initializer_range": 0.02, "intermediate_size": 12288,
            "kv_lora_rank": 512, "max_position_embeddings": 202752, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
            "n_group": 1, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true,
            "num_attention_heads": 64, "num_experts_per_tok": 8, "num_hidden_layers": 78, "num_key_value_heads": 64,
            "num_nextn_predict_layers": 1, "q_lora_rank": 2048, "qk_head_dim": 256, "qk_nope_head_dim": 192,
            "qk_rope_head_dim": 64, "rms_norm_eps": 1e-5, "rope_interleave": true,
            "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}, "routed_scaling_factor": 2.5,
            "scoring_func": "sigmoid", "tie_word_embeddings": false, "topk_group": 1, "topk_method": "noaux_tc",
            "torch_dtype": "bfloat16", "v_head_dim": 256, "vocab_size": 154880
        }),
        "glm-5.2" => {
            let mut c = shape_config("glm-5")?;
            c["max_position_embeddings"] = 1048576.into();
            c["rope_parameters"]["rope_theta"] = 8000000.into();
            c["index_topk_freq"] = 4.into();
            c["index_skip_topk_offset"] = 3.into();
            c
        }
        // DeepSeek-V4-Pro as its hub config gives it (1.6T, 49B active): 61 layers, two
        // heavily compressed then CSA and HCA alternating (transformers' default schedule), 384
        // experts, the first three hash-routed. V4-Flash (284B, 13B active) is transformers'
        // default configuration; its layers follow the same schedule here.
        "deepseek-v4-pro" => json!({
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "bos_token_id": 0, "eos_token_id": 1,
            "vocab_size": 129280, "hidden_size": 7168, "moe_intermediate_size": 3072, "num_hidden_layers": 61,
            "num_attention_heads": 128, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1536,
            "num_experts_per_tok": 6, "n_routed_experts": 384, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
            "norm_topk_prob": true, "routed_scaling_factor": 2.5, "max_position_embeddings": 1048576, "rope_theta": 10000,
            "compress_rope_theta": 160000, "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                                                            "beta_fast": 32, "beta_slow": 1},
            "compress_ratios": (0..62).map(|l| if l < 2 || l % 2 == 0 { 128 } else { 4 }).collect::<Vec<_>>(),
            "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "num_hash_layers": 3, "swiglu_limit": 10.0,
            "sliding_window": 128, "o_groups": 16, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128,
            "index_topk": 1024, "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6, "hidden_act": "silu",
            "tie_word_embeddings": false, "torch_dtype": "bfloat16"
        }),
        "deepseek-v4-flash" => {
            let mut c = shape_config("deepseek-v4-pro")?;
            for (k, v) in [
                ("hidden_size", json!(4096)),
                ("moe_intermediate_size", json!(2048)),
                ("num_hidden_layers", json!(43)),
                ("num_attention_heads", json!(64)),
                ("q_lora_rank", json!(1024)),
                ("n_routed_experts", json!(256)),
                ("routed_scaling_factor", json!(1.5)),
                ("o_groups", json!(8)),
                ("index_topk", json!(512)),
                ("compress_ratios", json!((0..44).map(|l| if l < 2 || l % 2 == 0 { 128 } else { 4 }).collect::<Vec<_>>())),
            ] {
                c[k] = v;
            }
            c
        }
        "deepseek-v3" => json!({
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": false,
            "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
            "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
            "max_position_embeddings": 163840, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
            "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true,
            "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
            "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-6,
            "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096, "type": "yarn"},
            "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": false,
            "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128, "vocab_size": 129280
        }),
        other => return Err(FormatError::BadInput(format!("unknown shape '{other}'; known: {}", shape_names().join(", "))).into()),
    })
}

/// A deterministic, fast generator (SplitMix64) for one chunk of one tensor.
pub(crate) struct Rng(u64);
impl Rng {
    pub(crate) fn new(seed: u64, tensor: u64, chunk: u64) -> Rng {
        Rng(seed ^ tensor.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ chunk.wrapping_mul(0xC2B2_AE3D_27D4_EB4F))
    }
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn unit(&mut self) -> f32 {
        ((self.next() >> 40) as f32 + 0.5) / (1u64 << 24) as f32
    }
    /// Two standard normals (Box-Muller).
    fn normal2(&mut self) -> (f32, f32) {
        let (u, v) = (self.unit(), self.unit());
        let r = (-2.0 * u.ln()).sqrt();
        let a = std::f32::consts::TAU * v;
        (r * a.cos(), r * a.sin())
    }
}

#[derive(Clone, Copy)]
enum Init {
    Matrix {
        cols: usize,
    },
    Router {
        hidden: usize,
        cols: usize,
        spread: f32,
    },
    Norm,
    Small(f32),
    /// Expert ids, `top_k` distinct ones per row of `experts` (DeepSeek-V4's `tid2eid`).
    ExpertIds {
        experts: usize,
        top_k: usize,
    },
}

struct Planned {
    name: String,
    shape: Vec<usize>,
    init: Init,
}

fn plan(cfg: &Value, router_spread: f32) -> Result<Vec<Planned>, ConvertError> {
    let arch = hf::architecture_from_config(cfg)?;
    let mut v = Vec::new();
    for spec in names::dense_tensors(&arch) {
        let init = if spec.name.ends_with("moe.tid2eid") {
            Init::ExpertIds { experts: arch.moe.num_experts, top_k: arch.moe.top_k }
        } else if spec.name.ends_with("moe.router") {
            Init::Router { hidden: arch.hidden_size, cols: spec.shape[1], spread: router_spread }
        } else if spec.name.ends_with("norm")
            && matches!(arch.family, smoe_vault::Family::Qwen3Next | smoe_vault::Family::Qwen35Moe)
            && !spec.name.ends_with("lin.norm")
        {
            // Qwen3-Next stores its RMSNorm weights as offsets from one.
            Init::Small(0.05)
        } else if spec.name.ends_with("norm") {
            Init::Norm
        } else if spec.shape.len() == 1 {
            Init::Small(0.02)
        } else if spec.name == "embed" {
            Init::Small(0.05)
        } else {
            Init::Matrix { cols: spec.shape[1] }
        };
        // Qwen2-MoE's shared_expert_gate is stored as [1, hidden].
        v.push(Planned { name: hf_name(arch.family, &spec.name), shape: spec.shape.clone(), init });
    }
    let shapes = names::expert_part_shapes(&arch);
    for l in arch.moe_layers() {
        for e in 0..arch.moe.num_experts {
            for (n, s) in hf_expert_names(arch.family, l, e).into_iter().zip(shapes) {
                v.push(Planned { name: n, shape: s.to_vec(), init: Init::Matrix { cols: s[1] } });
            }
        }
    }
    Ok(v)
}

/// Values are generated in chunks of this many, each from its own seed, so any range of a
/// tensor can be produced independently (and in parallel).
const CHUNK: usize = 1 << 16;

/// Chunk `c` of tensor `idx`, as bf16-rounded f32 values (`out` is at most `CHUNK` long).
fn gen_chunk(t: &Planned, idx: u64, seed: u64, c: usize, out: &mut [f32]) {
    let mut rng = Rng::new(seed, idx, c as u64);
    let mut pending: Option<f32> = None;
    for (i, o) in out.iter_mut().enumerate() {
        let g = pending.take().unwrap_or_else(|| {
            let (a, b) = rng.normal2();
            pending = Some(b);
            a
        });
        let v = match t.init {
            Init::Matrix { cols } => {
                let outlier = if rng.next() & 255 == 0 { 8.0 } else { 1.0 };
                g * outlier / (cols as f32).sqrt()
            }
            Init::Router { hidden, cols, spread } => {
                let row = (c * CHUNK + i) / cols;
                g * router_row_scale(seed, idx, row, spread) / (hidden as f32).sqrt()
            }
            Init::Norm => 1.0 + 0.05 * g,
            Init::Small(s) => s * g,
            Init::ExpertIds { experts, top_k } => {
                // Row r's ids: a per-row offset plus the slot times a stride, so distinct.
                let (row, slot) = ((c * CHUNK + i) / top_k, (c * CHUNK + i) % top_k);
                ((row.wrapping_mul(2_654_435_761) % experts + slot * (experts / top_k).max(1)) % experts) as f32
            }
        };
        *o = smoe_quant::half::bf16_bits_to_f32(smoe_quant::half::f32_to_bf16_bits(v));
    }
}

/// The `--router-spread` factor of router row `row` of tensor `idx`: `exp(spread·z)`, `z` a
/// standard normal drawn from its own stream (so a row's scale does not depend on the chunking).
fn router_row_scale(seed: u64, idx: u64, row: usize, spread: f32) -> f32 {
    if spread == 0.0 {
        return 1.0;
    }
    let (z, _) = Rng::new(seed ^ 0x726F_7574_6572, idx, row as u64).normal2();
    (spread * z).exp()
}

/// Elements `[start, start + out.len())` of tensor `idx`.
fn gen_range(t: &Planned, idx: u64, seed: u64, start: usize, out: &mut [f32]) {
    let first = start / CHUNK;
    let last = (start + out.len()).div_ceil(CHUNK);
    let total: usize = t.shape.iter().product();
    let pieces: Vec<(usize, Vec<f32>)> = (first..last)
        .into_par_iter()
        .map(|c| {
            let len = CHUNK.min(total - c * CHUNK);
            let mut v = vec![0f32; len];
            gen_chunk(t, idx, seed, c, &mut v);
            (c, v)
        })
        .collect();
    for (c, v) in pieces {
        let (c0, c1) = (c * CHUNK, c * CHUNK + v.len());
        let (a, b) = (c0.max(start), c1.min(start + out.len()));
        out[a - start..b - start].copy_from_slice(&v[a - c0..b - c0]);
    }
}

fn fill(t: &Planned, idx: u64, seed: u64, out: &mut [u8]) {
    out.par_chunks_mut(CHUNK * 2).enumerate().for_each(|(c, bytes)| {
        let mut v = vec![0f32; bytes.len() / 2];
        gen_chunk(t, idx, seed, c, &mut v);
        for (b, x) in bytes.chunks_exact_mut(2).zip(&v) {
            b.copy_from_slice(&smoe_quant::half::f32_to_bf16_bits(*x).to_le_bytes());
        }
    });
}

/// A synthetic checkpoint as a tensor source, for converting straight into a vault without
/// writing safetensors first.
pub struct SynthProvider {
    tensors: Vec<Planned>,
    index: std::collections::HashMap<String, usize>,
    seed: u64,
    /// Write quantized tensors as random blocks (see [`crate::random_blocks`]).
    random_blocks: bool,
}

impl SynthProvider {
    /// The tensors `cfg` implies, with `opts`' seed, router spread and block mode.
    fn new(cfg: &Value, opts: &SynthOptions) -> Result<SynthProvider, ConvertError> {
        let tensors = plan(cfg, opts.router_spread)?;
        let index = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(SynthProvider { tensors, index, seed: opts.seed, random_blocks: opts.random_blocks })
    }
}

impl crate::TensorProvider for SynthProvider {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.index.get(name).map(|&i| self.tensors[i].shape.clone())
    }
    fn names(&self) -> Vec<String> {
        self.tensors.iter().map(|t| t.name.clone()).collect()
    }
    fn read_rows(&self, name: &str, start: usize, n: usize, out: &mut [f32]) -> Result<(), ConvertError> {
        let &i = self.index.get(name).ok_or_else(|| ConvertError::Missing(vec![name.to_string()]))?;
        let cols = *self.tensors[i].shape.last().unwrap();
        gen_range(&self.tensors[i], i as u64, self.seed, start * cols, &mut out[..n * cols]);
        Ok(())
    }
    fn source_bytes(&self, name: &str) -> u64 {
        self.shape(name).map_or(0, |s| s.iter().product::<usize>() as u64 * 2)
    }
    fn read_quantized(&self, name: &str, format: Format, start: usize, n: usize, dst: &mut [u8]) -> Option<Result<(), ConvertError>> {
        if !self.random_blocks || !crate::random_blocks::supported(format) {
            return None;
        }
        let &i = self.index.get(name)?;
        let t = &self.tensors[i];
        let cols = *t.shape.last()?;
        let sigma = match t.init {
            Init::Matrix { cols } => 1.0 / (cols as f32).sqrt(),
            Init::Router { hidden, .. } => 1.0 / (hidden as f32).sqrt(),
            Init::Small(s) => s,
            Init::Norm | Init::ExpertIds { .. } => return None,
        };
        crate::random_blocks::fill_rows(format, cols, sigma, self.seed, i as u64, start, &mut dst[..n * format.row_bytes(cols).ok()?]);
        Some(Ok(()))
    }
}

/// The config of `shape` with `layers` decoder layers kept.
fn config_with_layers(shape: &str, layers: Option<usize>) -> Result<Value, ConvertError> {
    let mut cfg = shape_config(shape)?;
    if let Some(n) = layers {
        let full = cfg["num_hidden_layers"].as_u64().unwrap() as usize;
        if n == 0 || n > full {
            return Err(FormatError::BadInput(format!("--layers must be between 1 and {full}")).into());
        }
        cfg["num_hidden_layers"] = n.into();
        // A cut that would keep only the leading dense layers keeps one MoE layer instead:
        // `--layers 2` of DeepSeek-V3 (three dense layers first) is one dense and one MoE layer.
        if let Some(d) = cfg.get("first_k_dense_replace").and_then(|d| d.as_u64()) {
            cfg["first_k_dense_replace"] = d.min(n as u64 - 1).into();
        }
        if cfg.get("max_window_layers").is_some() {
            cfg["max_window_layers"] = n.into();
        }
        // One entry per layer (gpt-oss's sliding and full layers): the kept layers' entries.
        if let Some(types) = cfg.get_mut("layer_types").and_then(|t| t.as_array_mut()) {
            types.truncate(n);
        }
    }
    Ok(cfg)
}

/// Converts a synthetic checkpoint of `shape` straight into the vault `out`, with the same
/// values `synth` would write as safetensors (no bf16 copy on disk).
pub fn synth_vault(
    shape: &str,
    out: &Path,
    opts: &SynthOptions,
    shatter: &crate::ShatterOptions,
    progress: &dyn Progress,
) -> Result<crate::ShatterReport, ConvertError> {
    synth_vault_from_config(config_with_layers(shape, opts.layers)?, out, opts, shatter, progress)
}

/// Converts a synthetic checkpoint of any config.json (hub layout) straight into the vault
/// `out`: random weights of the shapes the config implies (`opts.layers` is not applied).
pub fn synth_vault_from_config(
    cfg: Value,
    out: &Path,
    opts: &SynthOptions,
    shatter: &crate::ShatterOptions,
    progress: &dyn Progress,
) -> Result<crate::ShatterReport, ConvertError> {
    let provider = SynthProvider::new(&cfg, opts)?;
    let tok = opts.tokenizer_json.clone().unwrap_or_else(|| FALLBACK_TOKENIZER.to_string());
    let text = smoe_vault::TextAssets {
        tokenizer_json: tok,
        chat_template: Some(QWEN3_TEMPLATE.to_string()),
        bos_token: None,
        eos_token: Some("<|im_end|>".into()),
        pad_token: Some("<|endoftext|>".into()),
        add_bos_token: false,
    };
    let generation = hf_generation(&cfg);
    let arch = hf::architecture_from_config(&cfg)?;
    let assets = crate::SourceAssets { config: cfg, text, generation };
    if matches!(arch.family, smoe_vault::Family::Qwen3Next | smoe_vault::Family::Qwen35Moe) {
        // As `shatter` reads a Qwen3-Next checkpoint: its norms are offsets from one.
        return crate::shatter_from(&crate::qwen3_next::Qwen3NextParts::new(&provider, &arch)?, assets, out, shatter, progress);
    }
    crate::shatter_from(&provider, assets, out, shatter, progress)
}

/// Writes a synthetic checkpoint of `shape` straight into the GGUF file `out`, in the formats
/// of `shatter` (with `opts.random_blocks`, at disk speed): the dense part goes through a
/// temporary vault beside `out` (its expert region a hole, no disk used), exported with the
/// experts made on the fly; the file holds the blocks `synth_vault` would write for the same
/// seed. Both smoe (in place) and llama.cpp read the result.
pub fn synth_gguf(
    shape: &str,
    out: &Path,
    opts: &SynthOptions,
    shatter: &crate::ShatterOptions,
    progress: &dyn Progress,
) -> Result<crate::gguf::export::ExportReport, ConvertError> {
    synth_gguf_from_config(config_with_layers(shape, opts.layers)?, out, opts, shatter, progress)
}

/// [`synth_gguf`] of any config.json (hub layout; `opts.layers` is not applied).
pub fn synth_gguf_from_config(
    cfg: Value,
    out: &Path,
    opts: &SynthOptions,
    shatter: &crate::ShatterOptions,
    progress: &dyn Progress,
) -> Result<crate::gguf::export::ExportReport, ConvertError> {
    let parent = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let tmp = tempfile::Builder::new().prefix(".smoe-synth-").tempdir_in(parent).map_err(|e| FormatError::io(parent, e))?;
    let vault = tmp.path().join("dense.smoe");
    let dense_only = crate::ShatterOptions { zero_experts: true, ..shatter.clone() };
    synth_vault_from_config(cfg.clone(), &vault, opts, &dense_only, progress)?;
    let provider = SynthProvider::new(&cfg, opts)?;
    let v = smoe_vault::Vault::open(&vault)?;
    let (family, index) = (v.architecture().family, v.manifest().experts.clone());
    drop(v);
    let make = |layer: usize, expert: usize, part: usize| {
        let p = &index.layer_parts(layer)[part];
        crate::shatter::expert_part(&provider, &hf_expert_names(family, layer, expert)[part], p.format, p.shape)
    };
    crate::gguf::export::export_with(&vault, out, progress, Some(&make))
}

fn hf_generation(cfg: &Value) -> smoe_vault::GenerationDefaults {
    let eos = match &cfg["eos_token_id"] {
        Value::Array(a) => a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect(),
        v => v.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
    };
    smoe_vault::GenerationDefaults {
        bos_token_id: cfg["bos_token_id"].as_u64().map(|x| x as u32),
        eos_token_ids: eos,
        do_sample: Some(true),
        temperature: Some(0.7),
        top_p: Some(0.8),
        top_k: Some(20),
        min_p: None,
        repetition_penalty: None,
    }
}

/// What [`synth`] wrote.
#[derive(Clone, Debug)]
pub struct SynthReport {
    /// Bytes of weights.
    pub bytes: u64,
    /// Shards written.
    pub shards: usize,
    /// Tensors written.
    pub tensors: usize,
}

/// Options of [`synth`].
#[derive(Clone, Debug)]
pub struct SynthOptions {
    /// Keep only the first N decoder layers.
    pub layers: Option<usize>,
    /// Seed of every value.
    pub seed: u64,
    /// Largest shard, in bytes.
    pub shard_bytes: u64,
    /// A tokenizer.json to ship (default: the small byte-level BPE of the test fixtures).
    pub tokenizer_json: Option<String>,
    /// Vaults only: write quantized tensors as random valid blocks of realistic spread, with no
    /// values generated or quantized (disk speed; the vault then has no bf16 checkpoint of the
    /// same seed behind it).
    pub random_blocks: bool,
    /// Concentration of routing: router rows scaled by `exp(spread·N(0,1))` per expert (0: all
    /// experts equally likely). See the module documentation.
    pub router_spread: f32,
}

const FALLBACK_TOKENIZER: &str = include_str!("../../../testdata/hf/qwen3_moe/tokenizer.json");
const QWEN3_TEMPLATE: &str = include_str!("../../../testdata/qwen3_chat_template.jinja");

/// Writes a checkpoint of shape `shape` into `out` (created if missing).
pub fn synth(shape: &str, out: &Path, opts: &SynthOptions, progress: &dyn Progress) -> Result<SynthReport, ConvertError> {
    checkpoint_from_config(config_with_layers(shape, opts.layers)?, out, opts, progress)
}

fn checkpoint_from_config(cfg: Value, out: &Path, opts: &SynthOptions, progress: &dyn Progress) -> Result<SynthReport, ConvertError> {
    let tensors = plan(&cfg, opts.router_spread)?;
    std::fs::create_dir_all(out).map_err(|e| FormatError::io(out, e))?;
    // Shard plan: consecutive tensors up to `shard_bytes` each.
    let mut shards: Vec<Vec<usize>> = vec![vec![]];
    let mut size = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let b = t.shape.iter().product::<usize>() as u64 * 2;
        if size > 0 && size + b > opts.shard_bytes {
            shards.push(vec![]);
            size = 0;
        }
        shards.last_mut().unwrap().push(i);
        size += b;
    }
    let total: u64 = tensors.iter().map(|t| t.shape.iter().product::<usize>() as u64 * 2).sum();
    progress.start(total);
    let n_shards = shards.len();
    let mut weight_map = serde_json::Map::new();
    let mut buf = Vec::new();
    for (si, shard) in shards.iter().enumerate() {
        let fname = format!("model-{:05}-of-{:05}.safetensors", si + 1, n_shards);
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), json!({"format": "pt", "generator": "smoe synth"}));
        let mut off = 0u64;
        for &i in shard {
            let t = &tensors[i];
            let b = t.shape.iter().product::<usize>() as u64 * 2;
            header.insert(t.name.clone(), json!({"dtype": "BF16", "shape": t.shape, "data_offsets": [off, off + b]}));
            weight_map.insert(t.name.clone(), fname.clone().into());
            off += b;
        }
        let mut h = serde_json::to_vec(&header).unwrap();
        while !h.len().is_multiple_of(8) {
            h.push(b' ');
        }
        let path = out.join(&fname);
        let mut w = BufWriter::with_capacity(8 << 20, File::create(&path).map_err(|e| FormatError::io(&path, e))?);
        let io = |e| FormatError::io(&path, e);
        w.write_all(&(h.len() as u64).to_le_bytes()).map_err(io)?;
        w.write_all(&h).map_err(io)?;
        for &i in shard {
            let t = &tensors[i];
            buf.resize(t.shape.iter().product::<usize>() * 2, 0);
            fill(t, i as u64, opts.seed, &mut buf);
            w.write_all(&buf).map_err(io)?;
            progress.advance(buf.len() as u64);
        }
        w.flush().map_err(io)?;
    }
    let write = |name: &str, v: &Value| -> Result<(), ConvertError> {
        let p = out.join(name);
        Ok(std::fs::write(&p, serde_json::to_string_pretty(v).unwrap()).map_err(|e| FormatError::io(&p, e))?)
    };
    write("model.safetensors.index.json", &json!({"metadata": {"total_size": total}, "weight_map": weight_map}))?;
    write("config.json", &cfg)?;
    let eos = cfg["eos_token_id"].clone();
    write(
        "generation_config.json",
        &json!({"bos_token_id": cfg.get("bos_token_id"), "eos_token_id": eos, "do_sample": true, "temperature": 0.7, "top_p": 0.8, "top_k": 20}),
    )?;
    let tok = opts.tokenizer_json.as_deref().unwrap_or(FALLBACK_TOKENIZER);
    let p = out.join("tokenizer.json");
    std::fs::write(&p, tok).map_err(|e| FormatError::io(&p, e))?;
    write("tokenizer_config.json", &json!({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN3_TEMPLATE}))?;
    progress.finish();
    Ok(SynthReport { bytes: total, shards: n_shards, tensors: tensors.len() })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every shape holds its published parameter count (MTP layers, which are not converted,
    /// excluded): the configs are the published ones, not approximations.
    #[test]
    fn shapes_have_their_published_parameter_counts() {
        let published = [
            ("qwen3-30b-a3b", 30.5e9),
            ("qwen3-235b-a22b", 235.1e9),
            ("qwen2-57b-a14b", 57.4e9),
            ("mixtral-8x7b", 46.7e9),
            ("mixtral-8x22b", 140.6e9),
            ("olmoe-1b-7b", 6.9e9),
            ("glm-4.5-air", 106.9e9),
            ("glm-4.5", 352.8e9),
            ("deepseek-v3", 671.0e9),
            ("kimi-k2", 1026.4e9),
            ("minimax-m2", 228.7e9),
            // OpenAI's model card: 20.91B and 116.83B.
            ("gpt-oss-20b", 20.91e9),
            ("gpt-oss-120b", 116.83e9),
            // Z.ai: 744B. GLM-5.2 drops the indexers of the 57 layers that share a selection
            // (wq_b 4096 x 2048, wk 128 x 6144, weights_proj 32 x 6144, k_norm 2 x 128 each).
            ("glm-5", 744e9),
            ("glm-5.2", 743_911_218_432.0 - 57.0 * (4096.0 * 2048.0 + 128.0 * 6144.0 + 32.0 * 6144.0 + 256.0)),
            // DeepSeek: 284B and 1.6T. Pro's 1.6T counts its multi-token-prediction layer (one
            // more layer of 384 experts of 3 x 7168 x 3072, about 25.4B), not converted.
            ("deepseek-v4-flash", 284e9),
            ("deepseek-v4-pro", 1.6e12 - 384.0 * 3.0 * 7168.0 * 3072.0),
            ("qwen3-next-80b-a3b", 80e9),
            // Qwen: 397B, counting the vision encoder and the MTP layer, which are not converted.
            ("qwen3.5-397b-a17b", 397e9),
        ];
        assert_eq!(published.len(), shape_names().len());
        for (shape, want) in published {
            let n: usize = plan(&shape_config(shape).unwrap(), 0.0).unwrap().iter().map(|t| t.shape.iter().product::<usize>()).sum();
            let off = (n as f64 - want).abs() / want;
            println!("{shape}: {n} parameters ({:+.2}% of the published {want:e})", 100.0 * (n as f64 - want) / want);
            assert!(off < 0.01, "{shape}: {n} parameters, published {want:e}");
        }
    }

    /// `--layers` cuts every shape to a model its reader takes (per-layer lists cut with it).
    #[test]
    fn every_shape_cuts_to_two_layers() {
        for s in shape_names() {
            let cfg = config_with_layers(s, Some(2)).unwrap();
            let arch = hf::architecture_from_config(&cfg).unwrap_or_else(|e| panic!("{s}: {e}"));
            assert_eq!(arch.num_layers, 2, "{s}");
        }
    }

    #[test]
    fn every_shape_plans() {
        for s in shape_names() {
            let cfg = shape_config(s).unwrap();
            assert!(!plan(&cfg, 0.0).unwrap().is_empty(), "{s}");
        }
        let mut cfg = shape_config("qwen3-30b-a3b").unwrap();
        cfg["num_hidden_layers"] = 1.into();
        // embed, final norm, lm_head; 9 dense tensors per layer; 128 experts x 3.
        assert_eq!(plan(&cfg, 0.0).unwrap().len(), 3 + 9 + 128 * 3);
    }

    #[test]
    fn direct_vault_equals_safetensors_then_shatter() {
        let dir = tempfile::tempdir().unwrap();
        let opts =
            SynthOptions { layers: None, seed: 5, shard_bytes: 1 << 16, tokenizer_json: None, random_blocks: false, router_spread: 0.0 };
        let sh = crate::ShatterOptions {
            experts: smoe_quant::Format::Q4_K.into(),
            dense: smoe_quant::Format::Q8_0,
            threads: Some(2),
            ..Default::default()
        };
        // The fixtures' tiny GLM config keeps this quick and covers dense, MoE and shared experts.
        let cfg: Value = serde_json::from_str(
            &std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/hf/glm4_moe/config.json")).unwrap(),
        )
        .unwrap();
        checkpoint_from_config(cfg.clone(), &dir.path().join("ck"), &opts, &crate::Silent).unwrap();
        let a = dir.path().join("a.smoe");
        crate::shatter(&dir.path().join("ck"), &a, &sh, &crate::Silent).unwrap();
        let b = dir.path().join("b.smoe");
        synth_vault_from_config(cfg, &b, &opts, &sh, &crate::Silent).unwrap();
        let (va, vb) = (smoe_vault::Vault::open(&a).unwrap(), smoe_vault::Vault::open(&b).unwrap());
        for d in &va.manifest().dense {
            assert_eq!(vb.dense(&d.name).unwrap().checksum, d.checksum, "{}", d.name);
        }
        assert_eq!(va.manifest().experts, vb.manifest().experts);
    }

    /// `--random-blocks`: the same tensors and layout as the quantizing path, with blocks whose
    /// values have the spread the generated ones would (1/sqrt(cols)), and dense vectors (norms)
    /// generated as before.
    #[test]
    fn random_blocks_make_the_same_vault_layout_with_the_same_spread() {
        let dir = tempfile::tempdir().unwrap();
        let sh = crate::ShatterOptions { experts: Format::Q4_K.into(), dense: Format::Q8_0, threads: Some(2), ..Default::default() };
        let cfg: Value = serde_json::from_str(
            &std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/hf/glm4_moe/config.json")).unwrap(),
        )
        .unwrap();
        let opts = |random_blocks| SynthOptions {
            layers: None,
            seed: 5,
            shard_bytes: 1 << 16,
            tokenizer_json: None,
            random_blocks,
            router_spread: 0.0,
        };
        let (a, b) = (dir.path().join("a.smoe"), dir.path().join("b.smoe"));
        synth_vault_from_config(cfg.clone(), &a, &opts(false), &sh, &crate::Silent).unwrap();
        synth_vault_from_config(cfg, &b, &opts(true), &sh, &crate::Silent).unwrap();
        let (va, vb) = (smoe_vault::Vault::open(&a).unwrap(), smoe_vault::Vault::open(&b).unwrap());
        assert_eq!(va.manifest().experts.blob_size, vb.manifest().experts.blob_size);
        assert_eq!(va.manifest().experts.parts, vb.manifest().experts.parts);
        for d in &va.manifest().dense {
            let e = vb.dense(&d.name).unwrap();
            assert_eq!((e.format, &e.shape), (d.format, &d.shape), "{}", d.name);
            // Norms are not quantized: generated as before, so identical.
            if d.format == Format::F32 {
                assert_eq!(e.checksum, d.checksum, "{}", d.name);
            }
        }
        let spread = |v: &smoe_vault::Vault| {
            let part = &v.manifest().experts.parts[0];
            let mut blob = vec![0u8; v.manifest().experts.blob_size as usize];
            let layer = v.manifest().experts.layers[0].layer;
            v.read_blob(layer, 0, &mut blob).unwrap();
            let bytes = &blob[part.offset as usize..(part.offset + part.len) as usize];
            let mut x = vec![0f32; part.shape[0] * part.shape[1]];
            smoe_quant::dequantize(part.format, bytes, &mut x).unwrap();
            (x.iter().map(|x| x * x).sum::<f32>() / x.len() as f32).sqrt() * (part.shape[1] as f32).sqrt()
        };
        let (sa, sb) = (spread(&va), spread(&vb));
        assert!((sb / sa - 1.0).abs() < 0.2, "expert spread {sb} against {sa} from quantized values");
    }

    #[test]
    fn values_are_deterministic_and_scaled() {
        let t = Planned { name: "w".into(), shape: vec![64, 1024], init: Init::Matrix { cols: 1024 } };
        let (mut a, mut b) = (vec![0u8; 64 * 1024 * 2], vec![0u8; 64 * 1024 * 2]);
        fill(&t, 3, 9, &mut a);
        fill(&t, 3, 9, &mut b);
        assert_eq!(a, b);
        let v: Vec<f32> = a.chunks_exact(2).map(|c| smoe_quant::half::bf16_bits_to_f32(u16::from_le_bytes([c[0], c[1]]))).collect();
        let var = v.iter().map(|x| (x * x) as f64).sum::<f64>() / v.len() as f64;
        // 1/cols, inflated by the 1-in-256 outliers at 8x: (1 + 63/256) / 1024.
        assert!((var * 1024.0 - 1.246).abs() < 0.08, "{var}");
    }

    #[test]
    fn router_spread_concentrates_routing() {
        // Top-8 of 64 experts over random hidden states: at spread 0 the busiest expert takes
        // about its fair share (1/64 of choices, chosen by 1 token in 8); at spread 1.5 a few
        // experts take far more (measured: the busiest is chosen by 46% of tokens).
        let (experts, hidden, tokens, k) = (64, 256, 2000, 8);
        let busiest = |spread: f32| {
            let t = Planned { name: "r".into(), shape: vec![experts, hidden], init: Init::Router { hidden, cols: hidden, spread } };
            let mut w = vec![0f32; experts * hidden];
            gen_range(&t, 7, 1, 0, &mut w);
            let mut rng = Rng::new(99, 0, 0);
            let mut counts = vec![0usize; experts];
            for _ in 0..tokens {
                let x: Vec<f32> = (0..hidden).map(|_| rng.normal2().0).collect();
                let logits: Vec<f32> = w.chunks_exact(hidden).map(|r| r.iter().zip(&x).map(|(a, b)| a * b).sum()).collect();
                let mut idx: Vec<usize> = (0..experts).collect();
                idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
                for &e in &idx[..k] {
                    counts[e] += 1;
                }
            }
            *counts.iter().max().unwrap() as f64 / (tokens * k) as f64
        };
        let (flat, peaked) = (busiest(0.0), busiest(1.5));
        assert!(flat < 2.0 / 64.0, "{flat}");
        assert!(peaked > 3.0 / 64.0, "{peaked}");
    }

    #[test]
    fn gguf_straight_from_synth_equals_vault_then_export() {
        // Random blocks in a low-bit mix, written straight into GGUF, byte for byte the file that
        // synthesizing the vault and exporting it gives; the temporary vault is gone after.
        let dir = tempfile::tempdir().unwrap();
        let opts =
            SynthOptions { layers: None, seed: 3, shard_bytes: 1 << 20, tokenizer_json: None, random_blocks: true, router_spread: 1.0 };
        let sh = crate::ShatterOptions { experts: "Q2_K_MIX".parse().unwrap(), threads: Some(2), ..Default::default() };
        let cfg: Value = serde_json::from_str(
            &std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/hf/qwen3_moe_k/config.json")).unwrap(),
        )
        .unwrap();
        let direct = dir.path().join("direct").join("m.gguf");
        std::fs::create_dir_all(direct.parent().unwrap()).unwrap();
        synth_gguf_from_config(cfg.clone(), &direct, &opts, &sh, &crate::Silent).unwrap();
        assert_eq!(std::fs::read_dir(direct.parent().unwrap()).unwrap().count(), 1, "temporary vault left behind");
        // The temporary vault is called dense.smoe, which names the model in the metadata.
        let vault = dir.path().join("dense.smoe");
        synth_vault_from_config(cfg, &vault, &opts, &sh, &crate::Silent).unwrap();
        let parts = smoe_vault::Vault::open(&vault).unwrap().manifest().experts.parts.clone();
        let formats: Vec<Format> = parts.iter().map(|p| p.format).collect();
        assert_eq!(formats, [Format::Q2_K, Format::Q2_K, Format::Q3_K]);
        let via = dir.path().join("via.gguf");
        crate::gguf::export::export(&vault, &via, &crate::Silent).unwrap();
        assert!(std::fs::read(&direct).unwrap() == std::fs::read(&via).unwrap(), "the GGUF files differ");
    }
}
