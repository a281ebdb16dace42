//! GGUF files as smoe models: the metadata mapped to the architecture description, the
//! tensors mapped to canonical names with llama.cpp's converter changes undone, and quantized
//! blocks kept bit for bit — either copied into a vault (`smoe shatter FILE.gguf`) or read in
//! place (`smoe run FILE.gguf`).

use super::names::{expert_tensor, invert, llama_qk_permutation, tensor_name};
use super::{vocab, Gguf, TensorInfo, Value};
use crate::{FormatError, Progress};
use serde_json::{json, Map, Value as Json};
use smoe_quant::Format;
pub use smoe_vault::StackedPart;
use smoe_vault::{names, Architecture, DenseEntry, Family, GenerationDefaults, Manifest, TextAssets};
use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// How a canonical dense tensor is made from GGUF tensors.
#[derive(Clone, Debug)]
enum Source {
    /// The bytes of one tensor.
    Copy(usize),
    /// One tensor's rows in another order: destination row `r` is source row `rows[r]` (q and
    /// k of the `llama` architecture, which llama.cpp's converter permuted for its RoPE).
    Rows { tensor: usize, rows: Vec<usize> },
    /// DeepSeek's `kv_b_proj`, rebuilt from llama.cpp's split `attn_k_b` (per head, W_uk
    /// transposed) and `attn_v_b` (W_uv).
    KvB { k: usize, v: usize },
    /// An integer tensor (ggml I32) held as F32: DeepSeek-V4's hash-routing table.
    Ints(usize),
    /// A tensor that must stay exact (a router's, a hyper-connection's mixing) stored in a
    /// lower-precision type, dequantized to F32 as a vault holds it.
    Exact(usize),
    /// `ln(-v)` of an F32 vector: `A_log` from llama.cpp's `ssm_a` (which holds `-exp(A_log)`).
    LogNeg(usize),
}

/// ggml's type id of 32-bit integers.
const GGML_I32: u32 = 26;

/// One dense tensor of the model.
#[derive(Clone, Debug)]
pub struct DenseSpec {
    /// Canonical name.
    pub name: String,
    /// Storage format (the GGUF's own, except a rebuilt `kv_b` of a quantized file: F32).
    pub format: Format,
    /// Shape `[rows, cols]` or `[n]`.
    pub shape: Vec<usize>,
    source: Source,
}

impl DenseSpec {
    /// Bytes in its vault layout.
    pub fn bytes(&self) -> u64 {
        let cols = *self.shape.last().unwrap_or(&1);
        let rows: usize = self.shape[..self.shape.len().saturating_sub(1)].iter().product::<usize>().max(1);
        self.format.row_bytes(cols).map_or(0, |r| (r * rows) as u64)
    }
}

/// A GGUF opened as a model.
pub struct GgufModel {
    /// The parsed file(s).
    pub gguf: Gguf,
    /// The architecture read from the metadata.
    pub arch: Architecture,
    /// A config.json equivalent of the metadata (kept as the vault's source config).
    pub config: Json,
    /// Tokenizer (rebuilt from `tokenizer.ggml.*`) and chat template.
    pub text: TextAssets,
    /// eos/bos ids and sampling defaults.
    pub generation: GenerationDefaults,
    /// Dense tensors in canonical order.
    pub dense: Vec<DenseSpec>,
    /// Per MoE layer: gate, up, down.
    pub experts: Vec<[StackedPart; 3]>,
    /// What the import changed or ignored.
    pub notes: Vec<String>,
}

fn meta_u(g: &Gguf, k: &str) -> Option<usize> {
    g.get(k).and_then(Value::as_u64).map(|v| v as usize)
}

/// A number from the metadata. GGUF stores config values such as `1e-6` as f32; the shortest
/// decimal that rounds to that f32 gives back the config's value exactly.
fn meta_f(g: &Gguf, k: &str) -> Option<f64> {
    match g.get(k)? {
        Value::F32(x) => format!("{x}").parse().ok(),
        v => v.as_f64(),
    }
}

/// The config.json that transformers would have for this GGUF, built from its metadata; the
/// architecture then comes from the same code that reads real config.json files.
fn config_from_metadata(g: &Gguf) -> Result<Json, FormatError> {
    let arch = g.get("general.architecture").and_then(Value::as_str).unwrap_or("<missing>").to_string();
    let key = |k: &str| format!("{arch}.{k}");
    let u = |k: &str| meta_u(g, &key(k));
    let f = |k: &str| meta_f(g, &key(k));
    let req = |k: &str| u(k).ok_or_else(|| FormatError::BadInput(format!("GGUF metadata has no {}", key(k))));
    let has = |name: &str| g.tensor(name).is_some();
    let experts = u("expert_count").unwrap_or(0);
    let model_type = match arch.as_str() {
        "qwen3moe" => "qwen3_moe",
        "qwen2moe" => "qwen2_moe",
        "llama" if experts > 0 => "mixtral",
        "olmoe" => "olmoe",
        "glm4moe" => "glm4_moe",
        "deepseek2" => "deepseek_v3",
        "glm-dsa" => "glm_moe_dsa",
        "minimax-m2" => "minimax_m2",
        "gpt-oss" => "gpt_oss",
        "deepseek4" => "deepseek_v4",
        "qwen3next" => "qwen3_next",
        "qwen35moe" => "qwen3_5_moe",
        "llama" => return Err(FormatError::Unsupported("a llama GGUF without experts is a dense model; smoe runs MoE models".into())),
        other => {
            return Err(FormatError::Unsupported(format!(
                "GGUF architecture '{other}' is not supported; supported: qwen3moe, qwen2moe, llama (Mixtral), olmoe, glm4moe, deepseek2, glm-dsa, minimax-m2, gpt-oss, deepseek4, qwen3next, qwen35moe"
            )))
        }
    };
    let nextn = u("nextn_predict_layers").unwrap_or(0);
    let layers =
        req("block_count")?.checked_sub(nextn).ok_or_else(|| FormatError::BadInput("block_count < nextn_predict_layers".into()))?;
    let hidden = req("embedding_length")?;
    let heads = req("attention.head_count")?;
    let embd = g.tensor("token_embd.weight").ok_or_else(|| FormatError::BadInput("no token_embd.weight".into()))?;
    let mut c = Map::new();
    c.insert("model_type".into(), model_type.into());
    c.insert("hidden_size".into(), hidden.into());
    c.insert("num_hidden_layers".into(), layers.into());
    c.insert("num_attention_heads".into(), heads.into());
    c.insert("num_key_value_heads".into(), u("attention.head_count_kv").unwrap_or(heads).into());
    c.insert("vocab_size".into(), u("vocab_size").unwrap_or(embd.rows()).into());
    c.insert("max_position_embeddings".into(), u("context_length").unwrap_or(4096).into());
    c.insert("rms_norm_eps".into(), f("attention.layer_norm_rms_epsilon").unwrap_or(1e-6).into());
    c.insert("rope_theta".into(), f("rope.freq_base").unwrap_or(10000.0).into());
    c.insert("tie_word_embeddings".into(), (!has("output.weight")).into());
    c.insert("num_experts_per_tok".into(), req("expert_used_count")?.into());
    let head_dim = u("attention.key_length").unwrap_or(hidden / heads.max(1));
    let mla = matches!(model_type, "deepseek_v3" | "glm_moe_dsa");
    if !mla {
        c.insert("head_dim".into(), head_dim.into());
        if let Some(rot) = u("rope.dimension_count").filter(|&r| r != head_dim && r > 0) {
            c.insert("partial_rotary_factor".into(), (rot as f64 / head_dim as f64).into());
        }
    }
    match g.get(&key("rope.scaling.type")).and_then(Value::as_str) {
        None | Some("none") => {}
        Some(kind) => {
            let mut s = Map::new();
            s.insert("rope_type".into(), kind.into());
            s.insert("factor".into(), f("rope.scaling.factor").unwrap_or(1.0).into());
            if let Some(o) = u("rope.scaling.original_context_length") {
                s.insert("original_max_position_embeddings".into(), o.into());
            }
            if let Some(b) = f("rope.scaling.yarn_beta_fast") {
                s.insert("beta_fast".into(), b.into());
            }
            if let Some(b) = f("rope.scaling.yarn_beta_slow") {
                s.insert("beta_slow".into(), b.into());
            }
            // llama.cpp keeps only 0.1 * mscale_all_dim; published DeepSeek configs set mscale to
            // the same value, which makes the rotary rescale exactly 1.
            if let Some(lm) = f("rope.scaling.yarn_log_multiplier") {
                let m = (lm / 0.1 * 1e6).round() / 1e6;
                s.insert("mscale".into(), m.into());
                s.insert("mscale_all_dim".into(), m.into());
            }
            c.insert("rope_scaling".into(), Json::Object(s));
        }
    }
    let expert_ff = u("expert_feed_forward_length").or(u("feed_forward_length"));
    // Which layers have routed experts, read from the tensors themselves.
    let moe_layer = |l: usize| has(&expert_tensor(l, "gate"));
    match model_type {
        "qwen3_moe" | "qwen2_moe" => {
            c.insert("num_experts".into(), experts.into());
            c.insert("moe_intermediate_size".into(), expert_ff.into());
            c.insert("intermediate_size".into(), u("feed_forward_length").unwrap_or(0).into());
            let mlp_only: Vec<usize> = (0..layers).filter(|&l| !moe_layer(l)).collect();
            c.insert("mlp_only_layers".into(), mlp_only.into());
            if model_type == "qwen3_moe" {
                // llama.cpp always renormalises Qwen3's top-k weights.
                c.insert("norm_topk_prob".into(), true.into());
                c.insert("attention_bias".into(), has("blk.0.attn_q.bias").into());
            } else {
                c.insert("norm_topk_prob".into(), false.into());
                c.insert("qkv_bias".into(), has("blk.0.attn_q.bias").into());
                c.insert("shared_expert_intermediate_size".into(), u("expert_shared_feed_forward_length").unwrap_or(0).into());
            }
        }
        "mixtral" => {
            c.insert("num_local_experts".into(), experts.into());
            c.insert("intermediate_size".into(), expert_ff.into());
        }
        "minimax_m2" => {
            // Sigmoid routing is the family's only kind (expert_gating_func 2); the rotated
            // dimensions came through rope.dimension_count above.
            c.insert("num_local_experts".into(), experts.into());
            c.insert("intermediate_size".into(), expert_ff.into());
            c.insert("use_qk_norm".into(), has("blk.0.attn_q_norm.weight").into());
            c.insert("use_routing_bias".into(), has("blk.0.exp_probs_b.bias").into());
        }
        "gpt_oss" => {
            // llama.cpp hard-codes the rest: even layers slide (transformers' default
            // layer_types), swiglu alpha 1.702 and limit 7.0, softmax over the top-k logits;
            // the published config's YaRN does not truncate its correction range.
            c.insert("num_local_experts".into(), experts.into());
            c.insert("intermediate_size".into(), expert_ff.into());
            c.insert("attention_bias".into(), has("blk.0.attn_q.bias").into());
            if let Some(w) = u("attention.sliding_window") {
                c.insert("sliding_window".into(), w.into());
            }
            if let Some(Json::Object(s)) = c.get_mut("rope_scaling") {
                s.insert("truncate".into(), false.into());
            }
        }
        "deepseek_v4" => deepseek_v4_config(g, &arch, layers, experts, expert_ff, &mut c)?,
        "qwen3_next" | "qwen3_5_moe" => {
            c.insert("num_experts".into(), experts.into());
            c.insert("moe_intermediate_size".into(), expert_ff.into());
            c.insert("intermediate_size".into(), u("feed_forward_length").unwrap_or(0).into());
            c.insert("shared_expert_intermediate_size".into(), u("expert_shared_feed_forward_length").unwrap_or(0).into());
            c.insert("norm_topk_prob".into(), true.into());
            let mlp_only: Vec<usize> = (0..layers).filter(|&l| !moe_layer(l)).collect();
            c.insert("mlp_only_layers".into(), mlp_only.into());
            let (groups, heads, inner) = (req("ssm.group_count")?, req("ssm.time_step_rank")?, req("ssm.inner_size")?);
            c.insert("linear_num_key_heads".into(), groups.into());
            c.insert("linear_num_value_heads".into(), heads.into());
            c.insert("linear_key_head_dim".into(), req("ssm.state_size")?.into());
            c.insert("linear_value_head_dim".into(), (inner / heads.max(1)).into());
            c.insert("linear_conv_kernel_dim".into(), req("ssm.conv_kernel")?.into());
            // The per-layer kinds: llama.cpp reads `recurrent_layers` first (its converter's
            // `full_attention_interval` can be a default that does not describe the model).
            let recurrent = match g.get(&key("attention.recurrent_layers")) {
                Some(Value::Array(a)) if a.len() == layers => a.iter().map(|v| v.as_bool()).collect::<Option<Vec<bool>>>(),
                Some(_) => None,
                None => {
                    let every = u("full_attention_interval").unwrap_or(4).max(1);
                    Some((0..layers).map(|l| (l + 1) % every != 0).collect())
                }
            }
            .ok_or_else(|| FormatError::BadInput(format!("{} is not one flag per layer", key("attention.recurrent_layers"))))?;
            let types: Vec<&str> = recurrent.iter().map(|&r| if r { "linear_attention" } else { "full_attention" }).collect();
            c.insert("layer_types".into(), types.into());
            // llama.cpp's qwen35moe converter numbers value heads across key heads.
            c.insert("smoe_tiled_value_heads".into(), (model_type == "qwen3_5_moe").into());
            // Its multimodal RoPE sections (a fourth, zero, entry added by llama.cpp's writer).
            if let Some(Value::Array(a)) = g.get(&key("rope.dimension_sections")) {
                let mut s: Vec<usize> = a.iter().filter_map(|v| v.as_u64().map(|x| x as usize)).collect();
                if s.len() == 4 && s[3] == 0 {
                    s.pop();
                }
                c.insert("mrope_section".into(), s.into());
            }
        }
        "olmoe" => {
            c.insert("num_experts".into(), experts.into());
            c.insert("intermediate_size".into(), expert_ff.into());
            c.insert("norm_topk_prob".into(), false.into());
            c.insert("attention_bias".into(), has("blk.0.attn_q.bias").into());
        }
        _ => {
            // glm4_moe, deepseek_v3 and glm_moe_dsa: grouped sigmoid routing.
            let gating = u("expert_gating_func");
            let sigmoid = match gating {
                Some(2) => true,
                Some(_) => false,
                // llama.cpp's glm-dsa defaults to sigmoid (its converter writes the key only when
                // the config names a scoring_func).
                None if model_type == "glm_moe_dsa" => true,
                // DeepSeek-V2 files predate the key and use softmax; V3 files carry a correction
                // bias, which only the sigmoid router has.
                None => (0..layers).any(|l| has(&format!("blk.{l}.exp_probs_b.bias"))),
            };
            if !sigmoid {
                return Err(FormatError::Unsupported(format!(
                    "{arch} with softmax expert gating (DeepSeek-V2 style) is not supported; smoe runs the sigmoid router of DeepSeek-V3 and GLM-4.5"
                )));
            }
            c.insert("n_routed_experts".into(), experts.into());
            c.insert("moe_intermediate_size".into(), expert_ff.into());
            c.insert("intermediate_size".into(), u("feed_forward_length").unwrap_or(0).into());
            c.insert("n_group".into(), u("expert_group_count").unwrap_or(1).into());
            c.insert("topk_group".into(), u("expert_group_used_count").unwrap_or(1).into());
            c.insert("routed_scaling_factor".into(), f("expert_weights_scale").unwrap_or(1.0).into());
            c.insert("norm_topk_prob".into(), g.get(&key("expert_weights_norm")).and_then(Value::as_bool).unwrap_or(true).into());
            c.insert("n_shared_experts".into(), u("expert_shared_count").unwrap_or(0).into());
            c.insert("first_k_dense_replace".into(), u("leading_dense_block_count").unwrap_or(0).into());
            if model_type == "glm4_moe" {
                c.insert("attention_bias".into(), has("blk.0.attn_q.bias").into());
                c.insert("use_qk_norm".into(), has("blk.0.attn_q_norm.weight").into());
            } else {
                let rope = req("rope.dimension_count")?;
                let (k, v) = match (u("attention.key_length_mla"), u("attention.value_length_mla")) {
                    (Some(k), Some(v)) => (k, v),
                    _ => (req("attention.key_length")?, req("attention.value_length")?),
                };
                let q_lora = u("attention.q_lora_rank").filter(|&r| r > 0);
                c.insert("q_lora_rank".into(), q_lora.map_or(Json::Null, Json::from));
                c.insert("kv_lora_rank".into(), req("attention.kv_lora_rank")?.into());
                c.insert("qk_nope_head_dim".into(), (k - rope).into());
                c.insert("qk_rope_head_dim".into(), rope.into());
                c.insert("v_head_dim".into(), v.into());
                // llama.cpp rotates adjacent pairs for both (its converter permutes nothing); the
                // architecture reader makes GLM-5 interleaved whatever this says.
                c.insert("rope_interleave".into(), true.into());
                if model_type == "glm_moe_dsa" {
                    c.insert("index_n_heads".into(), req("attention.indexer.head_count")?.into());
                    c.insert("index_head_dim".into(), req("attention.indexer.key_length")?.into());
                    c.insert("index_topk".into(), req("attention.indexer.top_k")?.into());
                    let context = u("context_length").unwrap_or(4096);
                    let full = indexer_types(g.get(&key("attention.indexer.types")), layers, context, &key("attention.indexer.types"))?;
                    let types: Vec<&str> = full.iter().map(|&f| if f { "full" } else { "shared" }).collect();
                    c.insert("indexer_types".into(), types.into());
                }
            }
        }
    }
    Ok(Json::Object(c))
}

/// DeepSeek-V4's config.json keys (the hub's spellings) from llama.cpp's `deepseek4` metadata.
fn deepseek_v4_config(
    g: &Gguf,
    arch: &str,
    layers: usize,
    experts: usize,
    expert_ff: Option<usize>,
    c: &mut Map<String, Json>,
) -> Result<(), FormatError> {
    let key = |k: &str| format!("{arch}.{k}");
    let u = |k: &str| meta_u(g, &key(k));
    let f = |k: &str| meta_f(g, &key(k));
    let req = |k: &str| u(k).ok_or_else(|| FormatError::BadInput(format!("GGUF metadata has no {}", key(k))));
    // llama.cpp's gating kinds: 1 softmax, 2 sigmoid, 3 softmax weights, 4 sqrt(softplus).
    match u("expert_gating_func") {
        Some(4) | None => {}
        Some(other) => return Err(FormatError::Unsupported(format!("{arch} expert_gating_func {other} (only 4, sqrt-softplus)"))),
    }
    c.insert("n_routed_experts".into(), experts.into());
    c.insert("moe_intermediate_size".into(), expert_ff.into());
    c.insert("n_shared_experts".into(), u("expert_shared_count").unwrap_or(1).into());
    c.insert("routed_scaling_factor".into(), f("expert_weights_scale").unwrap_or(1.0).into());
    c.insert("scoring_func".into(), "sqrtsoftplus".into());
    c.insert("qk_rope_head_dim".into(), req("rope.dimension_count")?.into());
    c.insert("q_lora_rank".into(), req("attention.q_lora_rank")?.into());
    c.insert("sliding_window".into(), req("attention.sliding_window")?.into());
    c.insert("index_n_heads".into(), req("attention.indexer.head_count")?.into());
    c.insert("index_head_dim".into(), req("attention.indexer.key_length")?.into());
    c.insert("index_topk".into(), req("attention.indexer.top_k")?.into());
    c.insert("o_groups".into(), req("attention.output_group_count")?.into());
    c.insert("o_lora_rank".into(), req("attention.output_lora_rank")?.into());
    c.insert("compress_rope_theta".into(), f("attention.compress_rope_freq_base").unwrap_or(160000.0).into());
    c.insert("hc_mult".into(), req("hyper_connection.count")?.into());
    c.insert("hc_sinkhorn_iters".into(), req("hyper_connection.sinkhorn_iterations")?.into());
    c.insert("hc_eps".into(), f("hyper_connection.epsilon").unwrap_or(1e-6).into());
    c.insert("num_hash_layers".into(), u("hash_layer_count").unwrap_or(0).into());
    let ratios = match g.get(&key("attention.compress_ratios")) {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_u64().ok_or_else(|| FormatError::BadInput(format!("{}: {v:?}", key("attention.compress_ratios")))))
            .collect::<Result<Vec<_>, _>>()?,
        _ => return Err(FormatError::BadInput(format!("GGUF metadata has no {}", key("attention.compress_ratios")))),
    };
    if ratios.len() < layers {
        return Err(FormatError::BadInput(format!("{} lists {} layers of {layers}", key("attention.compress_ratios"), ratios.len())));
    }
    c.insert("compress_ratios".into(), ratios.into());
    // One clamp for every layer, routed and shared alike, is all the family has.
    let clamps: Vec<f64> = match g.get(&key("swiglu_clamp_exp")) {
        Some(Value::Array(a)) => a.iter().filter_map(|v| v.as_f64()).collect(),
        _ => vec![],
    };
    let limit = clamps.first().copied().unwrap_or(10.0);
    if clamps.iter().any(|&x| x != limit) {
        return Err(FormatError::Unsupported(format!("{arch}: per-layer SwiGLU clamps {clamps:?} (one limit for all layers only)")));
    }
    c.insert("swiglu_limit".into(), limit.into());
    // The generic path wrote the YaRN of the compressed layers as `rope_scaling`; V4's main RoPE
    // is plain (`rope_theta`), as its config.json says.
    c.remove("partial_rotary_factor");
    Ok(())
}

/// Which of `layers` decoder layers run their own DSA indexer (GLM-5), from
/// `glm-dsa.attention.indexer.types` (one bool per decoder layer, `true` = "full"; llama.cpp also
/// takes integers, or one value for every layer). Files without the key get llama.cpp's rule
/// for them: a context below 1M (GLM-5, GLM-5.1) means every layer is full; otherwise GLM-5.2's
/// schedule, full at layers 0, 1, 2, 6, 10, ..., 74 of its 78 and shared elsewhere.
fn indexer_types(v: Option<&Value>, layers: usize, context: usize, key: &str) -> Result<Vec<bool>, FormatError> {
    let flag = |v: &Value| v.as_bool().or_else(|| v.as_u64().map(|x| x != 0));
    let bad = |what: String| FormatError::BadInput(format!("GGUF metadata {key} {what}"));
    match v {
        None if context < 1 << 20 => Ok(vec![true; layers]),
        None => Ok((0..layers).map(|l| l < 2 || (l < 78 && (l - 2).is_multiple_of(4))).collect()),
        Some(Value::Array(a)) => {
            if a.len() != layers {
                return Err(bad(format!("has {} entries for {layers} layers", a.len())));
            }
            a.iter().map(|x| flag(x).ok_or_else(|| bad(format!("has a {x:?} entry, not a bool")))).collect()
        }
        Some(x) => flag(x).map(|f| vec![f; layers]).ok_or_else(|| bad(format!("is {x:?}, not a bool array"))),
    }
}

/// eos/bos ids, the tokenizer's special strings and sampling defaults from the metadata.
fn text_and_generation(g: &Gguf) -> Result<(TextAssets, GenerationDefaults), FormatError> {
    let tokenizer_json = vocab::tokenizer_json(&g.meta)?;
    let tokens = g.get("tokenizer.ggml.tokens").and_then(Value::as_array).unwrap_or(&[]);
    let token = |id: Option<usize>| id.and_then(|i| tokens.get(i)).and_then(Value::as_str).map(str::to_string);
    let id = |k: &str| meta_u(g, k);
    let (bos, eos, pad) = (id("tokenizer.ggml.bos_token_id"), id("tokenizer.ggml.eos_token_id"), id("tokenizer.ggml.padding_token_id"));
    let mut eos_ids: Vec<u32> = eos.into_iter().map(|e| e as u32).collect();
    // End-of-turn and end-of-message tokens also end a reply.
    for k in ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"] {
        if let Some(e) = id(k).map(|e| e as u32).filter(|e| !eos_ids.contains(e)) {
            eos_ids.push(e);
        }
    }
    let text = TextAssets {
        tokenizer_json,
        chat_template: g.get("tokenizer.chat_template").and_then(Value::as_str).map(str::to_string),
        bos_token: token(bos),
        eos_token: token(eos),
        pad_token: token(pad),
        add_bos_token: g.get("tokenizer.ggml.add_bos_token").and_then(Value::as_bool).unwrap_or(false),
    };
    let gen = GenerationDefaults {
        bos_token_id: bos.map(|b| b as u32),
        eos_token_ids: eos_ids,
        do_sample: None,
        temperature: meta_f(g, "general.sampling.temp"),
        top_p: meta_f(g, "general.sampling.top_p"),
        top_k: meta_u(g, "general.sampling.top_k").map(|k| k as u32),
        min_p: meta_f(g, "general.sampling.min_p"),
        repetition_penalty: None,
    };
    Ok((text, gen))
}

impl GgufModel {
    /// Opens `path` (the first file of a split set opens all of them) and maps everything,
    /// reading only metadata.
    pub fn open(path: &Path) -> Result<GgufModel, FormatError> {
        let gguf = Gguf::open(path)?;
        let config = config_from_metadata(&gguf)?;
        let arch = crate::hf::architecture_from_config(&config)?;
        let (text, generation) = text_and_generation(&gguf)?;
        let index: BTreeMap<&str, usize> = gguf.tensors.iter().enumerate().map(|(i, t)| (t.name.as_str(), i)).collect();
        let find = |name: &str| index.get(name).copied().ok_or_else(|| FormatError::BadInput(format!("GGUF has no tensor {name}")));
        let mut used = vec![false; gguf.tensors.len()];
        let mut dense = Vec::new();
        for spec in names::dense_tensors(&arch) {
            if spec.name.ends_with("attn.kv_b") {
                let layer = spec.name.split('.').nth(1).unwrap_or_default();
                if let Some(&old) = index.get(format!("blk.{layer}.attn_kv_b.weight").as_str()) {
                    used[old] = true;
                    dense.push(dense_spec(&gguf, &spec, Source::Copy(old))?);
                    continue;
                }
                let (k, v) = (find(&format!("blk.{layer}.attn_k_b.weight"))?, find(&format!("blk.{layer}.attn_v_b.weight"))?);
                used[k] = true;
                used[v] = true;
                let kf = gguf.tensors[k].format()?;
                let format = if matches!(kf, Format::F16 | Format::BF16 | Format::F32) && gguf.tensors[v].format()? == kf {
                    kf
                } else {
                    Format::F32
                };
                dense.push(DenseSpec { name: spec.name.clone(), format, shape: spec.shape.clone(), source: Source::KvB { k, v } });
                continue;
            }
            let name =
                tensor_name(arch.family, &spec.name).ok_or_else(|| FormatError::Internal(format!("no GGUF name for {}", spec.name)))?;
            let t = match index.get(name.as_str()) {
                Some(&t) => t,
                // A tied model has no output.weight; the engine then uses the embedding.
                None if spec.name == "lm_head" && arch.tie_word_embeddings => continue,
                None => return Err(FormatError::BadInput(format!("GGUF has no tensor {name} (for {})", spec.name))),
            };
            used[t] = true;
            let qk = arch.family == Family::Mixtral && (spec.name.ends_with("attn.q") || spec.name.ends_with("attn.k"));
            let source = if let Some(rows) = qwen3_next_rows(&arch, &spec.name) {
                Source::Rows { tensor: t, rows }
            } else if spec.name.ends_with("lin.a_log") {
                Source::LogNeg(t)
            } else if qk {
                let heads = if spec.name.ends_with("attn.q") { arch.num_heads } else { arch.num_kv_heads };
                Source::Rows { tensor: t, rows: invert(&llama_qk_permutation(heads, arch.head_dim)) }
            } else {
                Source::Copy(t)
            };
            dense.push(dense_spec(&gguf, &spec, source)?);
        }
        let shapes = names::expert_part_shapes(&arch);
        let mut experts = Vec::new();
        for l in arch.moe_layers() {
            let mut parts = Vec::new();
            for (p, shape) in names::EXPERT_PARTS.iter().zip(shapes) {
                let name = expert_tensor(l, p);
                let i = find(&name)?;
                used[i] = true;
                let t = &gguf.tensors[i];
                let want = [shape[1] as u64, shape[0] as u64, arch.moe.num_experts as u64];
                if t.dims != want {
                    return Err(FormatError::BadInput(format!("{name} has dims {:?}, expected {want:?}", t.dims)));
                }
                let format = t.format()?;
                let bytes = t.len()? / arch.moe.num_experts as u64;
                parts.push(StackedPart { file: t.file, offset: t.offset, bytes, format, rows: shape[0], cols: shape[1] });
            }
            experts.push([parts[0].clone(), parts[1].clone(), parts[2].clone()]);
        }
        let mut notes = Vec::new();
        let unused: Vec<&str> = gguf.tensors.iter().zip(&used).filter(|(_, u)| !**u).map(|(t, _)| t.name.as_str()).collect();
        if !unused.is_empty() {
            let shown =
                if unused.len() > 4 { format!("{} and {} more", unused[..4].join(", "), unused.len() - 4) } else { unused.join(", ") };
            notes.push(format!("GGUF tensors not used: {shown}"));
        }
        if let Some(t) = gguf.tensors.iter().zip(&used).find(|(t, u)| **u && t.ggml_type != GGML_I32 && t.format().is_err()) {
            t.0.format()?;
        }
        Ok(GgufModel { gguf, arch, config, text, generation, dense, experts, notes })
    }

    /// Bytes of one dense tensor in its vault layout.
    pub fn read_dense(&self, d: &DenseSpec) -> Result<Vec<u8>, FormatError> {
        match &d.source {
            Source::Copy(t) => self.read_tensor(&self.gguf.tensors[*t]),
            Source::Rows { tensor, rows } => {
                let t = &self.gguf.tensors[*tensor];
                let data = self.read_tensor(t)?;
                let rb = t.format()?.row_bytes(t.cols()).map_err(|e| FormatError::BadInput(format!("{}: {e}", t.name)))?;
                let mut out = vec![0u8; rows.len() * rb];
                for (dst, &src) in rows.iter().enumerate() {
                    out[dst * rb..(dst + 1) * rb].copy_from_slice(&data[src * rb..(src + 1) * rb]);
                }
                if d.format == t.format()? {
                    return Ok(out);
                }
                // Rows of a tensor that must stay exact, stored in a lower-precision type.
                let mut v = vec![0f32; rows.len() * t.cols()];
                smoe_quant::dequantize(t.format()?, &out, &mut v).map_err(|e| FormatError::BadInput(format!("{}: {e}", t.name)))?;
                Ok(v.iter().flat_map(|x| x.to_le_bytes()).collect())
            }
            Source::KvB { k, v } => self.rebuild_kv_b(d, *k, *v),
            Source::Exact(t) => {
                let t = &self.gguf.tensors[*t];
                let data = self.read_tensor(t)?;
                let mut out = vec![0f32; t.rows() * t.cols()];
                smoe_quant::dequantize(t.format()?, &data, &mut out).map_err(|e| FormatError::BadInput(format!("{}: {e}", t.name)))?;
                Ok(out.iter().flat_map(|v| v.to_le_bytes()).collect())
            }
            Source::LogNeg(t) => {
                let t = &self.gguf.tensors[*t];
                let data = self.read_tensor(t)?;
                let mut v = vec![0f32; t.rows() * t.cols()];
                smoe_quant::dequantize(t.format()?, &data, &mut v).map_err(|e| FormatError::BadInput(format!("{}: {e}", t.name)))?;
                if let Some(bad) = v.iter().find(|x| !(**x < 0.0 && x.is_finite())) {
                    return Err(FormatError::BadInput(format!("{} holds {bad}, not -exp(A_log) < 0", t.name)));
                }
                Ok(v.iter().flat_map(|x| (-x).ln().to_le_bytes()).collect())
            }
            Source::Ints(t) => {
                let t = &self.gguf.tensors[*t];
                let path = &self.gguf.paths[t.file];
                let mut data = vec![0u8; t.rows() * t.cols() * 4];
                File::open(path).and_then(|f| f.read_exact_at(&mut data, t.offset)).map_err(|e| FormatError::io(path, e))?;
                Ok(data.chunks_exact(4).flat_map(|c| (i32::from_le_bytes(c.try_into().unwrap()) as f32).to_le_bytes()).collect())
            }
        }
    }

    fn read_tensor(&self, t: &TensorInfo) -> Result<Vec<u8>, FormatError> {
        let path = &self.gguf.paths[t.file];
        let f = File::open(path).map_err(|e| FormatError::io(path, e))?;
        let mut buf = vec![0u8; t.len()? as usize];
        f.read_exact_at(&mut buf, t.offset).map_err(|e| FormatError::io(path, e))?;
        Ok(buf)
    }

    /// `kv_b_proj` rows per head: `qk_nope` rows of W_uk, then `v_head_dim` rows of W_uv, each
    /// `kv_lora_rank` wide. `attn_k_b` holds W_uk transposed per head (`[kv_lora_rank, qk_nope]`)
    /// and `attn_v_b` W_uv as it is. 16- and 32-bit elements move exactly; a quantized pair is
    /// dequantized to F32 (exact, larger).
    fn rebuild_kv_b(&self, d: &DenseSpec, k: usize, v: usize) -> Result<Vec<u8>, FormatError> {
        let mla = self.arch.mla.as_ref().ok_or_else(|| FormatError::Internal("kv_b without MLA".into()))?;
        let (h, r, nope, vd) = (self.arch.num_heads, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim);
        let (kt, vt) = (&self.gguf.tensors[k], &self.gguf.tensors[v]);
        if kt.dims != [nope as u64, r as u64, h as u64] || vt.dims != [r as u64, vd as u64, h as u64] {
            return Err(FormatError::BadInput(format!("attn_k_b {:?} / attn_v_b {:?} do not match the MLA ranks", kt.dims, vt.dims)));
        }
        let to_f32 = |t: &TensorInfo| -> Result<Vec<f32>, FormatError> {
            let raw = self.read_tensor(t)?;
            let mut out = vec![0f32; t.rows() * t.cols()];
            smoe_quant::dequantize(t.format()?, &raw, &mut out).map_err(|e| FormatError::BadInput(format!("{}: {e}", t.name)))?;
            Ok(out)
        };
        let width = d.format.row_bytes(1).unwrap_or(4);
        let (kb, vb) = if d.format == Format::F32 { (None, None) } else { (Some(self.read_tensor(kt)?), Some(self.read_tensor(vt)?)) };
        let (kf, vf) = if d.format == Format::F32 { (Some(to_f32(kt)?), Some(to_f32(vt)?)) } else { (None, None) };
        let mut out = vec![0u8; h * (nope + vd) * r * width];
        // Element (row, col) of the destination from element index `src` of a source.
        let mut put = |row: usize, col: usize, bytes: Option<&Vec<u8>>, floats: Option<&Vec<f32>>, src: usize| {
            let at = (row * r + col) * width;
            match (bytes, floats) {
                (Some(b), _) => out[at..at + width].copy_from_slice(&b[src * width..(src + 1) * width]),
                (_, Some(f)) => out[at..at + 4].copy_from_slice(&f[src].to_le_bytes()),
                _ => {}
            }
        };
        for head in 0..h {
            let base = head * (nope + vd);
            for i in 0..nope {
                for j in 0..r {
                    // attn_k_b[head][j][i]
                    put(base + i, j, kb.as_ref(), kf.as_ref(), (head * r + j) * nope + i);
                }
            }
            for i in 0..vd {
                for j in 0..r {
                    // attn_v_b[head][i][j]
                    put(base + nope + i, j, vb.as_ref(), vf.as_ref(), (head * vd + i) * r + j);
                }
            }
        }
        Ok(out)
    }

    /// The architecture's manifest for a vault or an in-place run (dense entries and experts
    /// filled in by the caller).
    pub fn manifest(&self) -> Manifest {
        let mut config = self.config.clone();
        config["_converted_from"] = json!("GGUF metadata (smoe)");
        Manifest {
            created_by: format!("smoe {}", env!("CARGO_PKG_VERSION")),
            required_features: vec![],
            architecture: self.arch.clone(),
            source_config: config,
            text: self.text.clone(),
            generation: self.generation.clone(),
            dense: vec![],
            experts: smoe_vault::ExpertIndex { blob_size: 0, parts: vec![], layers: vec![] },
            notes: self.notes.clone(),
        }
    }

    /// Every dense tensor read into one region, with its directory (for running in place).
    pub fn dense_region(&self, progress: &dyn Progress) -> Result<(Vec<DenseEntry>, Vec<u8>), FormatError> {
        let total: u64 = self.dense.iter().map(|d| d.bytes().div_ceil(64) * 64).sum();
        let mut region = Vec::with_capacity(total as usize);
        smoe_vault::hugepages::advise(region.as_ptr(), region.capacity());
        let mut entries = Vec::new();
        for d in &self.dense {
            let bytes = self.read_dense(d)?;
            // Keep every tensor 64-byte aligned, as in a vault.
            region.resize(region.len().div_ceil(64) * 64, 0);
            entries.push(DenseEntry {
                name: d.name.clone(),
                format: d.format,
                shape: d.shape.clone(),
                offset: region.len() as u64,
                len: bytes.len() as u64,
                // GGUF has no checksums; nothing verifies in-place tensors.
                checksum: 0,
                source: "gguf".into(),
            });
            progress.advance(bytes.len() as u64);
            region.extend_from_slice(&bytes);
        }
        Ok((entries, region))
    }
}

/// Qwen3-Next's tensors that llama.cpp keeps fused, as the source rows of the canonical one:
/// `attn.q` and `attn.q_gate` from `attn_q` (per head its query, then its gate), and in
/// qwen3next files `lin.b` and `lin.a` from `ssm_ba` (per key head the `b`s of its value heads,
/// then their `a`s).
fn qwen3_next_rows(arch: &Architecture, name: &str) -> Option<Vec<usize>> {
    let hd = arch.head_dim;
    if arch.attn_output_gate && (name.ends_with("attn.q") || name.ends_with("attn.q_gate")) {
        let half = usize::from(name.ends_with("attn.q_gate"));
        return Some((0..arch.num_heads * hd).map(|r| (r / hd) * 2 * hd + half * hd + r % hd).collect());
    }
    let la = arch.linear_attention.as_ref()?;
    if arch.family == Family::Qwen3Next && (name.ends_with("lin.b") || name.ends_with("lin.a")) {
        let (g, half) = (la.value_heads / la.key_heads, usize::from(name.ends_with("lin.a")));
        return Some((0..la.value_heads).map(|r| (r / g) * 2 * g + half * g + r % g).collect());
    }
    None
}

fn dense_spec(g: &Gguf, spec: &names::TensorSpec, source: Source) -> Result<DenseSpec, FormatError> {
    let t = match &source {
        Source::Copy(t) | Source::Rows { tensor: t, .. } | Source::Ints(t) | Source::Exact(t) | Source::LogNeg(t) => &g.tensors[*t],
        Source::KvB { .. } => unreachable!("kv_b is built separately"),
    };
    // Integer tables (DeepSeek-V4's tid2eid, I32) are held as F32, exact below 2^24.
    let source = match source {
        Source::Copy(i) if t.ggml_type == GGML_I32 => Source::Ints(i),
        Source::Copy(i) if spec.keep_f32 && spec.shape.len() == 2 && t.format()? != Format::F32 => Source::Exact(i),
        s => s,
    };
    let exact_rows = spec.keep_f32 && matches!(source, Source::Rows { .. }) && t.format()? != Format::F32;
    let format =
        if exact_rows || matches!(source, Source::Ints(_) | Source::Exact(_) | Source::LogNeg(_)) { Format::F32 } else { t.format()? };
    let elems: usize = spec.shape.iter().product();
    // A tensor taken apart by rows holds some of the source's rows.
    let rows = match &source {
        Source::Rows { rows, .. } => {
            if let Some(&bad) = rows.iter().find(|&&r| r >= t.rows()) {
                return Err(FormatError::BadInput(format!("{} has {} rows, not the {} {} reads", t.name, t.rows(), bad + 1, spec.name)));
            }
            rows.len()
        }
        _ => t.rows(),
    };
    if rows * t.cols() != elems || t.cols() != *spec.shape.last().unwrap_or(&0) {
        return Err(FormatError::BadInput(format!("{} has dims {:?}, expected {:?} for {}", t.name, t.dims, spec.shape, spec.name)));
    }
    if spec.keep_f32 && format != Format::F32 && spec.shape.len() == 1 {
        // Norms and biases are F32 in every llama.cpp file; anything else still runs (the loader
        // dequantizes), but say so.
        tracing::debug!("{} is {}", t.name, format.name());
    }
    Ok(DenseSpec { name: spec.name.clone(), format, shape: spec.shape.clone(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "glm-dsa.attention.indexer.types";

    #[test]
    fn glm5_indexer_types_follow_llama_cpps_defaults_without_the_key() {
        // GLM-5 and GLM-5.1 (202752 positions): every layer full.
        assert_eq!(indexer_types(None, 78, 202_752, KEY).unwrap(), vec![true; 78]);
        // GLM-5.2 (1M positions): full at 0, 1, 2, 6, ..., 74; 21 of 78. llama.cpp's table ends
        // at 78 layers, so any further ones share.
        let t = indexer_types(None, 80, 1 << 20, KEY).unwrap();
        assert_eq!(t[..8], [true, true, true, false, false, false, true, false]);
        assert_eq!(t[..78].iter().filter(|&&f| f).count(), 21);
        assert!(t[74] && !t[75] && !t[78] && !t[79]);
    }

    #[test]
    fn glm5_indexer_types_from_the_file_or_a_clear_error() {
        let a = |v: Vec<Value>| Value::Array(v);
        let bools = a(vec![Value::Bool(true), Value::Bool(false), Value::Bool(true)]);
        assert_eq!(indexer_types(Some(&bools), 3, 4096, KEY).unwrap(), [true, false, true]);
        // Integers as llama.cpp's loader takes them, and one value for every layer.
        assert_eq!(indexer_types(Some(&a(vec![Value::U8(1), Value::U8(0)])), 2, 4096, KEY).unwrap(), [true, false]);
        assert_eq!(indexer_types(Some(&Value::Bool(true)), 2, 4096, KEY).unwrap(), [true, true]);
        let err = |v: Value, layers| indexer_types(Some(&v), layers, 4096, KEY).unwrap_err().to_string();
        let e = err(bools.clone(), 4);
        assert!(e.contains(KEY) && e.contains("3 entries for 4 layers"), "{e}");
        let e = err(a(vec![Value::Str("full".into())]), 1);
        assert!(e.contains(KEY) && e.contains("not a bool"), "{e}");
        let e = err(Value::F32(1.0), 1);
        assert!(e.contains(KEY), "{e}");
    }
}
