//! Hugging Face checkpoint conventions: config.json → [`Architecture`], canonical tensor names →
//! checkpoint tensor names, and the tokenizer / generation files.

use crate::FormatError;
use serde_json::Value;
use smoe_vault::{
    names, Architecture, CompressedAttention, Compression, ExpertAct, Family, GenerationDefaults, HyperConnections, LayerKind,
    LinearAttention, Mla, Moe, QkNorm, Rope, RopeScaling, Router, SharedExperts, SparseAttention, TextAssets,
};
use std::path::Path;

/// Reads a JSON file.
pub fn read_json(path: &Path) -> Result<Value, FormatError> {
    let text = std::fs::read_to_string(path).map_err(|e| FormatError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| FormatError::BadInput(format!("{}: {e}", path.display())))
}

struct Cfg<'a>(&'a Value);

impl Cfg<'_> {
    fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }
    fn usize(&self, k: &str) -> Result<usize, FormatError> {
        self.opt_usize(k)?.ok_or_else(|| FormatError::BadInput(format!("config.json: missing {k}")))
    }
    fn opt_usize(&self, k: &str) -> Result<Option<usize>, FormatError> {
        match self.get(k) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| FormatError::BadInput(format!("config.json: {k} is not a non-negative integer"))),
        }
    }
    fn f64_or(&self, k: &str, d: f64) -> Result<f64, FormatError> {
        match self.get(k) {
            None => Ok(d),
            Some(v) => v.as_f64().ok_or_else(|| FormatError::BadInput(format!("config.json: {k} is not a number"))),
        }
    }
    fn bool_or(&self, k: &str, d: bool) -> Result<bool, FormatError> {
        match self.get(k) {
            None => Ok(d),
            Some(v) => v.as_bool().ok_or_else(|| FormatError::BadInput(format!("config.json: {k} is not a boolean"))),
        }
    }
}

/// Maps a config.json onto the architecture description.
pub fn architecture_from_config(cfg: &Value) -> Result<Architecture, FormatError> {
    // Qwen3.5-MoE's checkpoints are multimodal: the decoder's settings are its `text_config`.
    let text;
    let cfg = match (cfg.get("model_type").and_then(|v| v.as_str()), cfg.get("text_config")) {
        (Some("qwen3_5_moe"), Some(t)) if t.is_object() => {
            text = {
                let mut t = t.clone();
                t["model_type"] = "qwen3_5_moe".into();
                t
            };
            &text
        }
        _ => cfg,
    };
    let c = Cfg(cfg);
    let model_type = c.get("model_type").and_then(|v| v.as_str()).unwrap_or("<missing>");
    let family = Family::from_model_type(model_type).ok_or_else(|| {
        let known: Vec<_> = Family::ALL.iter().map(|f| f.model_type()).collect();
        FormatError::Unsupported(format!("model_type '{model_type}' is not supported; supported: {}", known.join(", ")))
    })?;
    let act = c.get("hidden_act").and_then(|v| v.as_str()).unwrap_or("silu");
    if act != "silu" {
        return Err(FormatError::Unsupported(format!("hidden_act '{act}' (only silu)")));
    }
    let hidden = c.usize("hidden_size")?;
    let num_layers = c.usize("num_hidden_layers")?;
    if num_layers > smoe_vault::arch::MAX_LAYERS {
        // Checked before anything is sized per layer (a fuzzed config asked for 45 billion).
        return Err(FormatError::BadInput(format!(
            "config.json: num_hidden_layers {num_layers} (at most {})",
            smoe_vault::arch::MAX_LAYERS
        )));
    }
    let num_heads = c.usize("num_attention_heads")?;
    let num_kv_heads = c.opt_usize("num_key_value_heads")?.unwrap_or(num_heads);
    let head_dim = c.opt_usize("head_dim")?.unwrap_or(hidden / num_heads.max(1));
    // transformers 5 moves rope settings into `rope_parameters`; hub checkpoints keep them top-level.
    let rope_params = c.get("rope_parameters").cloned().unwrap_or(Value::Null);
    let rp = Cfg(&rope_params);
    let theta = match rp.get("rope_theta") {
        Some(v) => v.as_f64().ok_or_else(|| FormatError::BadInput("rope_parameters.rope_theta is not a number".into()))?,
        None => c.f64_or("rope_theta", 10000.0)?,
    };
    let partial = match rp.get("partial_rotary_factor") {
        Some(v) => v.as_f64().unwrap_or(1.0),
        None => c.f64_or("partial_rotary_factor", 1.0)?,
    };
    let scaling_src = if rope_params.is_object() { Some(&rope_params) } else { c.get("rope_scaling") };
    let scaling = rope_scaling(scaling_src, c.opt_usize("max_position_embeddings")?)?;

    let num_experts_key = match family {
        Family::Mixtral | Family::MinimaxM2 | Family::GptOss => "num_local_experts",
        Family::Glm4Moe | Family::DeepseekV3 | Family::GlmMoeDsa | Family::DeepseekV4 => "n_routed_experts",
        _ => "num_experts",
    };
    // transformers 5.2x saves every family's expert count as `num_local_experts` (its attribute
    // map), so a Qwen3-MoE checkpoint written by it lacks `num_experts`.
    let num_experts = match c.opt_usize(num_experts_key)? {
        Some(n) => n,
        None => {
            c.opt_usize("num_local_experts")?.ok_or_else(|| FormatError::BadInput(format!("config.json: missing {num_experts_key}")))?
        }
    };
    let top_k = c.usize("num_experts_per_tok")?;
    let mut moe = Moe {
        num_experts,
        top_k,
        intermediate_size: 0,
        router: Router::Softmax,
        norm_topk_prob: false,
        routed_scaling_factor: 1.0,
        shared_experts: None,
        router_logit_bias: false,
        expert_bias: false,
        expert_act: Default::default(),
        hash_layers: vec![],
    };
    let mut arch = Architecture {
        family,
        vocab_size: c.usize("vocab_size")?,
        hidden_size: hidden,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        max_position_embeddings: c.opt_usize("max_position_embeddings")?.unwrap_or(4096),
        norm_eps: c.f64_or("rms_norm_eps", 1e-6)?,
        rope: Rope {
            theta,
            rotary_dim: (head_dim as f64 * partial) as usize,
            partial_rotary_factor: partial,
            interleaved: false,
            scaling,
            sections: mrope_section(rp.get("mrope_section").or(c.get("mrope_section")))?,
        },
        qk_norm: QkNorm::None,
        qkv_bias: false,
        mla: None,
        dense_intermediate_size: c.opt_usize("intermediate_size")?.unwrap_or(0),
        moe: moe.clone(),
        layers: vec![LayerKind::Moe; num_layers],
        tie_word_embeddings: c.bool_or("tie_word_embeddings", false)?,
        attention_windows: vec![],
        attn_sinks: false,
        o_bias: false,
        sparse_attention: None,
        compressed_attention: None,
        hyper_connections: None,
        linear_attention: None,
        attn_output_gate: false,
    };
    match family {
        Family::Qwen3Moe | Family::Qwen2Moe => {
            moe.intermediate_size = c.usize("moe_intermediate_size")?;
            moe.norm_topk_prob = c.bool_or("norm_topk_prob", false)?;
            qwen_layer_kinds(&c, &mut arch, num_experts > 0)?;
            if family == Family::Qwen3Moe {
                arch.qk_norm = QkNorm::PerHead;
                arch.qkv_bias = c.bool_or("attention_bias", false)?;
            } else {
                arch.qkv_bias = c.bool_or("qkv_bias", true)?;
                let shared = c.opt_usize("shared_expert_intermediate_size")?.unwrap_or(0);
                if shared > 0 {
                    moe.shared_experts = Some(SharedExperts { intermediate_size: shared, sigmoid_gate: true });
                }
            }
        }
        Family::Mixtral => {
            moe.intermediate_size = c.usize("intermediate_size")?;
            moe.norm_topk_prob = true;
            arch.dense_intermediate_size = 0;
            if let Some(w) = c.opt_usize("sliding_window")? {
                if w < arch.max_position_embeddings {
                    return Err(FormatError::Unsupported(format!("mixtral sliding_window {w} (only full attention)")));
                }
            }
        }
        Family::Olmoe => {
            moe.intermediate_size = c.usize("intermediate_size")?;
            moe.norm_topk_prob = c.bool_or("norm_topk_prob", false)?;
            arch.dense_intermediate_size = 0;
            arch.qk_norm = QkNorm::WholeProjection;
            arch.qkv_bias = c.bool_or("attention_bias", false)?;
            if c.get("clip_qkv").is_some() {
                return Err(FormatError::Unsupported("olmoe clip_qkv".into()));
            }
        }
        // Every difference from the families above is a field already: GLM's routing, OLMoE's
        // q/k norms, partial rotary.
        Family::MinimaxM2 => {
            moe.intermediate_size = c.usize("intermediate_size")?;
            moe.norm_topk_prob = true;
            moe.router = Router::SigmoidGrouped { n_group: 1, topk_group: 1, correction_bias: c.bool_or("use_routing_bias", true)? };
            arch.dense_intermediate_size = 0;
            arch.qk_norm = match (c.bool_or("use_qk_norm", true)?, c.get("qk_norm_type").and_then(|v| v.as_str())) {
                (false, _) => QkNorm::None,
                (true, None | Some("per_layer")) => QkNorm::WholeProjection,
                (true, Some("per_head")) => QkNorm::PerHead,
                (true, Some(t)) => return Err(FormatError::Unsupported(format!("minimax_m2 qk_norm_type '{t}'"))),
            };
            if let Some(f) = c.get("scoring_func").and_then(|v| v.as_str()).filter(|&f| f != "sigmoid") {
                return Err(FormatError::Unsupported(format!("minimax_m2 scoring_func '{f}' (only sigmoid)")));
            }
            // The published config gives the rotated dimensions; transformers 5 turns them
            // into rope_parameters.partial_rotary_factor (read above).
            if let Some(r) = c.opt_usize("rotary_dim")? {
                arch.rope.rotary_dim = r;
                arch.rope.partial_rotary_factor = r as f64 / head_dim as f64;
            }
        }
        Family::Qwen3Next | Family::Qwen35Moe => qwen3_next(&c, &mut arch, &mut moe)?,
        Family::GptOss => gpt_oss(&c, &mut arch, &mut moe)?,
        Family::DeepseekV4 => deepseek_v4(&c, &mut arch, &mut moe)?,
        Family::Glm4Moe | Family::DeepseekV3 | Family::GlmMoeDsa => {
            moe.intermediate_size = c.usize("moe_intermediate_size")?;
            moe.norm_topk_prob = c.bool_or("norm_topk_prob", true)?;
            moe.routed_scaling_factor = c.f64_or("routed_scaling_factor", 1.0)?;
            moe.router = Router::SigmoidGrouped {
                n_group: c.opt_usize("n_group")?.unwrap_or(1),
                topk_group: c.opt_usize("topk_group")?.unwrap_or(1),
                correction_bias: true,
            };
            let n_shared = c.opt_usize("n_shared_experts")?.unwrap_or(0);
            if n_shared > 0 {
                moe.shared_experts = Some(SharedExperts { intermediate_size: moe.intermediate_size * n_shared, sigmoid_gate: false });
            }
            let first_dense = c.opt_usize("first_k_dense_replace")?.unwrap_or(0);
            let freq = c.opt_usize("moe_layer_freq")?.unwrap_or(1).max(1);
            for (l, kind) in arch.layers.iter_mut().enumerate() {
                *kind = if l >= first_dense && l % freq == 0 { LayerKind::Moe } else { LayerKind::Dense };
            }
            // transformers 5 writes GLM-5's layer kinds out (`mlp_layer_types`); they win.
            if let Some(types) = string_list(&c, "mlp_layer_types")? {
                arch.layers = per_layer(&types, num_layers, "mlp_layer_types", |t| match t {
                    "dense" => Some(LayerKind::Dense),
                    "sparse" => Some(LayerKind::Moe),
                    _ => None,
                })?;
            }
            if family == Family::Glm4Moe {
                arch.qkv_bias = c.bool_or("attention_bias", false)?;
                arch.qk_norm = if c.bool_or("use_qk_norm", false)? { QkNorm::PerHead } else { QkNorm::None };
            } else {
                for (k, want) in [("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")] {
                    if let Some(v) = c.get(k).and_then(|v| v.as_str()) {
                        if v != want {
                            return Err(FormatError::Unsupported(format!("deepseek {k} '{v}' (only '{want}', as DeepSeek-V3)")));
                        }
                    }
                }
                if c.bool_or("attention_bias", false)? {
                    return Err(FormatError::Unsupported(format!("{model_type} attention_bias")));
                }
                let mla = Mla {
                    q_lora_rank: c.opt_usize("q_lora_rank")?,
                    kv_lora_rank: c.usize("kv_lora_rank")?,
                    qk_nope_head_dim: c.usize("qk_nope_head_dim")?,
                    qk_rope_head_dim: c.usize("qk_rope_head_dim")?,
                    v_head_dim: c.usize("v_head_dim")?,
                };
                arch.head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim;
                arch.num_kv_heads = num_heads;
                arch.rope.rotary_dim = mla.qk_rope_head_dim;
                arch.rope.partial_rotary_factor = 1.0;
                // GLM-5 always rotates interleaved pairs (transformers has no switch for it).
                arch.rope.interleaved = family == Family::GlmMoeDsa || c.bool_or("rope_interleave", true)?;
                if family == Family::GlmMoeDsa {
                    if !c.bool_or("indexer_rope_interleave", true)? {
                        return Err(FormatError::Unsupported(
                            "glm_moe_dsa indexer_rope_interleave false (its indexer rotates interleaved pairs)".into(),
                        ));
                    }
                    arch.sparse_attention = Some(sparse_attention(&c, num_layers)?);
                }
                arch.mla = Some(mla);
            }
        }
    }
    arch.moe = moe;
    arch.validate().map_err(|e| FormatError::BadInput(format!("config.json: {e}")))?;
    Ok(arch)
}

/// The Qwen families' layer kinds: MoE every `decoder_sparse_step` layers (with `experts`),
/// except the `mlp_only_layers`.
fn qwen_layer_kinds(c: &Cfg<'_>, arch: &mut Architecture, experts: bool) -> Result<(), FormatError> {
    let step = c.opt_usize("decoder_sparse_step")?.unwrap_or(1).max(1);
    let mlp_only: Vec<usize> = c
        .get("mlp_only_layers")
        .and_then(|v| v.as_array())
        .map(|a| a.iter().filter_map(|x| x.as_u64().map(|x| x as usize)).collect())
        .unwrap_or_default();
    for (l, kind) in arch.layers.iter_mut().enumerate() {
        let sparse = !mlp_only.contains(&l) && experts && (l + 1) % step == 0;
        *kind = if sparse { LayerKind::Moe } else { LayerKind::Dense };
    }
    Ok(())
}

/// Qwen3-Next and Qwen3.5-MoE: Qwen2-MoE's experts (softmax top-k, a shared expert behind a sigmoid gate),
/// Gated DeltaNet layers between full attention layers whose output is gated, q/k norms per
/// head. Its RMSNorms scale by `1 + w` (the checkpoint's weights are offsets from one); the
/// converter adds the one, so the vault holds plain norm weights.
fn qwen3_next(c: &Cfg<'_>, arch: &mut Architecture, moe: &mut Moe) -> Result<(), FormatError> {
    let layers = arch.num_layers;
    moe.intermediate_size = c.usize("moe_intermediate_size")?;
    // Qwen3.5 always renormalises the top-k (its config has no switch).
    moe.norm_topk_prob = arch.family == Family::Qwen35Moe || c.bool_or("norm_topk_prob", true)?;
    let shared = c.opt_usize("shared_expert_intermediate_size")?.unwrap_or(0);
    if shared > 0 {
        moe.shared_experts = Some(SharedExperts { intermediate_size: shared, sigmoid_gate: true });
    }
    qwen_layer_kinds(c, arch, true)?;
    arch.qk_norm = QkNorm::PerHead;
    arch.qkv_bias = c.bool_or("attention_bias", false)?;
    arch.attn_output_gate = true;
    // transformers writes `layer_types`; the hub's configs give the interval of full layers.
    let linear = match string_list(c, "layer_types")? {
        Some(types) => per_layer(&types, layers, "layer_types", |t| match t {
            "linear_attention" => Some(true),
            "full_attention" => Some(false),
            _ => None,
        })?,
        None => {
            let every = c.opt_usize("full_attention_interval")?.unwrap_or(4).max(1);
            (0..layers).map(|l| (l + 1) % every != 0).collect()
        }
    };
    arch.linear_attention = Some(LinearAttention {
        layers: linear,
        key_heads: c.usize("linear_num_key_heads")?,
        value_heads: c.usize("linear_num_value_heads")?,
        key_dim: c.usize("linear_key_head_dim")?,
        value_dim: c.usize("linear_value_head_dim")?,
        conv_kernel: c.opt_usize("linear_conv_kernel_dim")?.unwrap_or(4),
        // smoe's own key, written by its GGUF reader for llama.cpp's qwen35moe files.
        tiled_value_heads: c.bool_or("smoe_tiled_value_heads", false)?,
    });
    Ok(())
}

/// `rope_parameters.mrope_section` (Qwen3.5; smoe's GGUF reader writes it top-level), empty
/// when absent.
fn mrope_section(v: Option<&Value>) -> Result<Vec<usize>, FormatError> {
    match v {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_u64().map(|x| x as usize))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| FormatError::BadInput("rope_parameters.mrope_section is not a list of counts".into())),
        Some(_) => Err(FormatError::BadInput("rope_parameters.mrope_section is not a list".into())),
    }
}

fn string_list(c: &Cfg<'_>, key: &str) -> Result<Option<Vec<String>>, FormatError> {
    match c.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_array()
            .and_then(|a| a.iter().map(|t| t.as_str().map(str::to_string)).collect::<Option<Vec<_>>>())
            .map(Some)
            .ok_or_else(|| FormatError::BadInput(format!("config.json: {key} is not a list of strings"))),
    }
}

fn per_layer<T>(types: &[String], layers: usize, key: &str, f: impl Fn(&str) -> Option<T>) -> Result<Vec<T>, FormatError> {
    if types.len() != layers {
        return Err(FormatError::BadInput(format!("config.json: {} {key} for {layers} layers", types.len())));
    }
    types.iter().map(|t| f(t).ok_or_else(|| FormatError::Unsupported(format!("config.json: {key} entry '{t}'")))).collect()
}

/// GLM-5's DeepSeek Sparse Attention settings. Which layers run their own indexer comes, as in
/// transformers, from `indexer_types`, else `index_topk_pattern` ("F"/"S" per layer), else
/// `index_topk_freq` and `index_skip_topk_offset` (layer `i` is full when
/// `max(i - offset + 1, 0)` is a multiple of the frequency; the defaults 1 and 2 make every
/// layer full).
fn sparse_attention(c: &Cfg<'_>, layers: usize) -> Result<SparseAttention, FormatError> {
    let full = |t: &str| match t {
        "full" | "F" => Some(true),
        "shared" | "S" => Some(false),
        _ => None,
    };
    // The pattern is a string ("FFS...") or a list of "full"/"shared".
    let pattern = match c.get("index_topk_pattern") {
        Some(Value::String(p)) => Some(p.chars().map(String::from).collect::<Vec<_>>()),
        _ => string_list(c, "index_topk_pattern")?,
    };
    let indexer = if let Some(types) = string_list(c, "indexer_types")? {
        per_layer(&types, layers, "indexer_types", full)?
    } else if let Some(p) = pattern {
        per_layer(&p, layers, "index_topk_pattern", full)?
    } else {
        let freq = c.opt_usize("index_topk_freq")?.unwrap_or(1).max(1);
        let offset = c.opt_usize("index_skip_topk_offset")?.unwrap_or(2);
        (0..layers).map(|i| (i + 1).saturating_sub(offset).is_multiple_of(freq)).collect()
    };
    Ok(SparseAttention {
        top_k: c.opt_usize("index_topk")?.unwrap_or(2048),
        heads: c.opt_usize("index_n_heads")?.unwrap_or(32),
        head_dim: c.opt_usize("index_head_dim")?.unwrap_or(128),
        indexer,
    })
}

/// DeepSeek-V4 as the hub's config.json spells it (`compress_ratios` per layer,
/// `num_hash_layers`, `qk_rope_head_dim`, `rope_theta` and `compress_rope_theta` with a
/// `rope_scaling` for the compressed layers) or as transformers writes it back (`layer_types`
/// with `compress_rates`, `mlp_layer_types`, `partial_rotary_factor`, `rope_parameters` keyed
/// `main` and `compress`). Sliding layers rotate with the plain `rope_theta`; compressed layers
/// with `compress_rope_theta` and the scaling, whose YaRN never scales cos/sin (transformers
/// forces `attention_factor` 1, as DeepSeek's reference does).
fn deepseek_v4(c: &Cfg<'_>, arch: &mut Architecture, moe: &mut Moe) -> Result<(), FormatError> {
    let layers = arch.num_layers;
    moe.intermediate_size = c.usize("moe_intermediate_size")?;
    moe.norm_topk_prob = true;
    moe.routed_scaling_factor = c.f64_or("routed_scaling_factor", 1.5)?;
    match c.get("scoring_func").and_then(|v| v.as_str()).unwrap_or("sqrtsoftplus") {
        "sqrtsoftplus" => moe.router = Router::SqrtSoftplus { correction_bias: true },
        other => return Err(FormatError::Unsupported(format!("deepseek_v4 scoring_func '{other}' (only sqrtsoftplus)"))),
    }
    let n_shared = c.opt_usize("n_shared_experts")?.unwrap_or(1);
    if n_shared > 0 {
        moe.shared_experts = Some(SharedExperts { intermediate_size: moe.intermediate_size * n_shared, sigmoid_gate: false });
    }
    moe.expert_act = ExpertAct::ClampedSilu { limit: c.f64_or("swiglu_limit", 10.0)? };
    moe.hash_layers = match string_list(c, "mlp_layer_types")? {
        Some(types) => per_layer(&types, layers, "mlp_layer_types", |t| match t {
            "hash_moe" => Some(true),
            "moe" => Some(false),
            _ => None,
        })?,
        None => {
            let n = c.opt_usize("num_hash_layers")?.unwrap_or(3);
            (0..layers).map(|l| l < n).collect()
        }
    };
    arch.dense_intermediate_size = 0;
    arch.layers = vec![LayerKind::Moe; layers];
    if c.bool_or("attention_bias", false)? {
        return Err(FormatError::Unsupported("deepseek_v4 attention_bias".into()));
    }
    // Compression per layer.
    let rates = c.get("compress_rates");
    let rate_of = |kind: &str, default: usize| -> Result<usize, FormatError> {
        match rates.and_then(|r| r.get(kind)) {
            Some(v) => v.as_u64().map(|x| x as usize).ok_or_else(|| FormatError::BadInput(format!("config.json: compress_rates.{kind}"))),
            None => {
                Ok(c.opt_usize(if kind.starts_with("compressed") { "compress_rate_csa" } else { "compress_rate_hca" })?.unwrap_or(default))
            }
        }
    };
    let (csa, hca) = (rate_of("compressed_sparse_attention", 4)?, rate_of("heavily_compressed_attention", 128)?);
    let compression = if let Some(types) = string_list(c, "layer_types")? {
        per_layer(&types, layers, "layer_types", |t| match t {
            "sliding_attention" => Some(Compression::None),
            "compressed_sparse_attention" => Some(Compression::Sparse { rate: csa }),
            "heavily_compressed_attention" => Some(Compression::Heavy { rate: hca }),
            _ => None,
        })?
    } else if let Some(list) = c.get("compress_ratios").and_then(|v| v.as_array()) {
        // The hub's per-layer ratios: 0 slides only, 4 is CSA, 128 HCA (transformers' mapping).
        let kinds = list
            .iter()
            .map(|r| match r.as_u64() {
                Some(0) => Ok(Compression::None),
                Some(4) => Ok(Compression::Sparse { rate: csa }),
                Some(128) => Ok(Compression::Heavy { rate: hca }),
                _ => Err(FormatError::Unsupported(format!("deepseek_v4 compress ratio {r} (only 0, 4, 128)"))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        if kinds.len() < layers {
            return Err(FormatError::BadInput(format!("config.json: {} compress_ratios for {layers} layers", kinds.len())));
        }
        // The hub lists the multi-token-prediction layer's too.
        kinds[..layers].to_vec()
    } else {
        // transformers' default: two HCA layers, then CSA and HCA alternating.
        (0..layers)
            .map(|l| if l >= 2 && l % 2 == 1 { Compression::Sparse { rate: csa } } else { Compression::Heavy { rate: hca } })
            .collect()
    };
    // RoPE: rotated dims from `qk_rope_head_dim` (hub) or the partial factor (transformers).
    let head_dim = arch.head_dim;
    let rp = c.get("rope_parameters").cloned().unwrap_or(Value::Null);
    let (main, compress) = match (rp.get("main"), rp.get("compress")) {
        (Some(m), Some(cmp)) => (m.clone(), cmp.clone()),
        _ => {
            let mut m = serde_json::json!({"rope_theta": c.f64_or("rope_theta", 10000.0)?});
            let mut cmp = c.get("rope_scaling").filter(|v| v.is_object()).cloned().unwrap_or(serde_json::json!({}));
            if rp.is_object() {
                // transformers' flat form before it nests: the scaling keys with the main theta.
                cmp = rp.clone();
                m["rope_theta"] = rp.get("rope_theta").cloned().unwrap_or(m["rope_theta"].clone());
            }
            cmp["rope_theta"] = serde_json::json!(c.f64_or("compress_rope_theta", 160000.0)?);
            (m, cmp)
        }
    };
    let rotary = match c.opt_usize("qk_rope_head_dim")? {
        Some(r) => r,
        None => {
            let f = Cfg(&main).f64_or("partial_rotary_factor", c.f64_or("partial_rotary_factor", 64.0 / 512.0)?)?;
            (head_dim as f64 * f).round() as usize
        }
    };
    let rope = |v: &Value| -> Result<Rope, FormatError> {
        let theta = Cfg(v).f64_or("rope_theta", 10000.0)?;
        let mut scaling = rope_scaling(Some(v), c.opt_usize("max_position_embeddings")?)?;
        if let RopeScaling::Yarn { attention_factor, .. } = &mut scaling {
            attention_factor.get_or_insert(1.0);
        }
        Ok(Rope {
            theta,
            rotary_dim: rotary,
            partial_rotary_factor: rotary as f64 / head_dim as f64,
            interleaved: true,
            scaling,
            sections: Vec::new(),
        })
    };
    arch.rope = rope(&main)?;
    arch.compressed_attention = Some(CompressedAttention {
        q_lora_rank: c.usize("q_lora_rank")?,
        o_groups: c.opt_usize("o_groups")?.unwrap_or(8),
        o_lora_rank: c.opt_usize("o_lora_rank")?.unwrap_or(1024),
        window: c.opt_usize("sliding_window")?.unwrap_or(128),
        compression,
        index_heads: c.opt_usize("index_n_heads")?.unwrap_or(64),
        index_head_dim: c.opt_usize("index_head_dim")?.unwrap_or(128),
        index_top_k: c.opt_usize("index_topk")?.unwrap_or(512),
        compress_rope: rope(&compress)?,
    });
    arch.hyper_connections = Some(HyperConnections {
        mult: c.opt_usize("hc_mult")?.unwrap_or(4),
        sinkhorn_iters: c.opt_usize("hc_sinkhorn_iters")?.unwrap_or(20),
        eps: c.f64_or("hc_eps", 1e-6)?,
    });
    Ok(())
}

/// gpt-oss: softmax over the top-k of biased router logits (a softmax over all experts,
/// renormalised over the chosen: the same weights), biased experts with the clamped SwiGLU,
/// biases on all four attention projections, a sink per head, and sliding-window layers as
/// `layer_types` lists them (transformers' default: even layers slide).
fn gpt_oss(c: &Cfg<'_>, arch: &mut Architecture, moe: &mut Moe) -> Result<(), FormatError> {
    moe.intermediate_size = c.usize("intermediate_size")?;
    moe.norm_topk_prob = true;
    moe.router_logit_bias = true;
    moe.expert_bias = true;
    moe.expert_act = ExpertAct::ClampedSwiglu { alpha: c.f64_or("swiglu_alpha", 1.702)?, limit: c.f64_or("swiglu_limit", 7.0)? };
    arch.dense_intermediate_size = 0;
    let bias = c.bool_or("attention_bias", true)?;
    arch.qkv_bias = bias;
    arch.o_bias = bias;
    arch.attn_sinks = true;
    let window = c.opt_usize("sliding_window")?;
    let types: Vec<String> = match c.get("layer_types") {
        None => (0..arch.num_layers).map(|l| if l % 2 == 0 { "sliding_attention" } else { "full_attention" }.to_string()).collect(),
        Some(v) => v
            .as_array()
            .and_then(|a| a.iter().map(|t| t.as_str().map(str::to_string)).collect::<Option<Vec<_>>>())
            .ok_or_else(|| FormatError::BadInput("config.json: layer_types is not a list of strings".into()))?,
    };
    if types.len() != arch.num_layers {
        return Err(FormatError::BadInput(format!("config.json: {} layer_types for {} layers", types.len(), arch.num_layers)));
    }
    arch.attention_windows = types
        .iter()
        .map(|t| match (t.as_str(), window) {
            ("full_attention", _) => Ok(None),
            ("sliding_attention", Some(w)) => Ok(Some(w)),
            ("sliding_attention", None) => {
                Err(FormatError::BadInput("config.json: sliding_attention layers without sliding_window".into()))
            }
            (other, _) => Err(FormatError::Unsupported(format!("gpt_oss layer type '{other}' (only sliding_attention, full_attention)"))),
        })
        .collect::<Result<_, _>>()?;
    Ok(())
}

fn rope_scaling(v: Option<&Value>, max_pos: Option<usize>) -> Result<RopeScaling, FormatError> {
    let Some(v) = v.filter(|v| v.is_object()) else {
        return Ok(RopeScaling::None);
    };
    let c = Cfg(v);
    let kind = c.get("rope_type").or_else(|| c.get("type")).and_then(|t| t.as_str()).unwrap_or("default");
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor: c.f64_or("factor", 1.0)? }),
        "yarn" => {
            let orig = c.opt_usize("original_max_position_embeddings")?.or(max_pos).ok_or_else(|| {
                FormatError::BadInput("yarn rope scaling without original_max_position_embeddings".into())
            })?;
            Ok(RopeScaling::Yarn {
                factor: c.f64_or("factor", 1.0)?,
                original_max_position_embeddings: orig,
                beta_fast: c.f64_or("beta_fast", 32.0)?,
                beta_slow: c.f64_or("beta_slow", 1.0)?,
                mscale: c.get("mscale").and_then(|x| x.as_f64()),
                mscale_all_dim: c.get("mscale_all_dim").and_then(|x| x.as_f64()),
                attention_factor: c.get("attention_factor").and_then(|x| x.as_f64()),
                truncate: c.bool_or("truncate", true)?,
            })
        }
        other => Err(FormatError::Unsupported(format!(
            "rope scaling type '{other}' is not implemented (supported: default, linear, yarn); refusing rather than running with wrong positions"
        ))),
    }
}

/// DeepSeek-V4's hub name of a canonical dense tensor (deepseek-ai's own layout: no `model.`
/// prefix, `attn`/`ffn`, `wq_a`, `wkv`, `compressor.ape`, `hc_attn_fn`, ...).
fn deepseek_v4_name(canonical: &str) -> String {
    let top = match canonical {
        "embed" => "embed.weight",
        "final_norm" => "norm.weight",
        "lm_head" => "head.weight",
        "hc_head_fn" | "hc_head_base" | "hc_head_scale" => canonical,
        _ => "",
    };
    if !top.is_empty() {
        return top.into();
    }
    let rest = canonical.strip_prefix("layers.").expect("canonical layer tensor");
    let (layer, what) = rest.split_once('.').expect("layer index");
    let mapped = match what {
        "attn_norm" | "ffn_norm" => format!("{what}.weight"),
        w if w.starts_with("hc_") => w.to_string(),
        "attn.q_a" => "attn.wq_a.weight".into(),
        "attn.q_a_norm" => "attn.q_norm.weight".into(),
        "attn.q_b" => "attn.wq_b.weight".into(),
        "attn.kv" => "attn.wkv.weight".into(),
        "attn.kv_norm" => "attn.kv_norm.weight".into(),
        "attn.o_a" => "attn.wo_a.weight".into(),
        "attn.o_b" => "attn.wo_b.weight".into(),
        "attn.sinks" => "attn.attn_sink".into(),
        "attn.idx_q" => "attn.indexer.wq_b.weight".into(),
        "attn.idx_weights" => "attn.indexer.weights_proj.weight".into(),
        "moe.router" => "ffn.gate.weight".into(),
        "moe.router_bias" => "ffn.gate.bias".into(),
        "moe.tid2eid" => "ffn.gate.tid2eid".into(),
        "moe.shared.gate" => "ffn.shared_experts.w1.weight".into(),
        "moe.shared.up" => "ffn.shared_experts.w3.weight".into(),
        "moe.shared.down" => "ffn.shared_experts.w2.weight".into(),
        w => {
            let (owner, part) = if let Some(p) = w.strip_prefix("attn.idx_cmp_") {
                ("attn.indexer.compressor", p)
            } else if let Some(p) = w.strip_prefix("attn.cmp_") {
                ("attn.compressor", p)
            } else {
                panic!("unmapped canonical tensor {canonical}")
            };
            match part {
                "kv" => format!("{owner}.wkv.weight"),
                "gate" => format!("{owner}.wgate.weight"),
                "bias" => format!("{owner}.ape"),
                "norm" => format!("{owner}.norm.weight"),
                _ => panic!("unmapped canonical tensor {canonical}"),
            }
        }
    };
    format!("layers.{layer}.{mapped}")
}

/// The checkpoint name of a canonical dense tensor.
pub fn hf_name(family: Family, canonical: &str) -> String {
    if family == Family::DeepseekV4 {
        return deepseek_v4_name(canonical);
    }
    // Qwen3.5-MoE's decoder lies under its multimodal model's `language_model`.
    let model = if family == Family::Qwen35Moe { "model.language_model" } else { "model" };
    let simple = match canonical {
        "embed" => return format!("{model}.embed_tokens.weight"),
        "final_norm" => return format!("{model}.norm.weight"),
        "lm_head" => return "lm_head.weight".into(),
        s => s,
    };
    let rest = simple.strip_prefix("layers.").expect("canonical layer tensor");
    let (layer, what) = rest.split_once('.').expect("layer index");
    let moe_block = if matches!(family, Family::Mixtral | Family::MinimaxM2) { "block_sparse_moe" } else { "mlp" };
    let shared =
        if matches!(family, Family::Qwen2Moe | Family::Qwen3Next | Family::Qwen35Moe) { "shared_expert" } else { "shared_experts" };
    let mapped = match what {
        "attn_norm" => "input_layernorm.weight".to_string(),
        "ffn_norm" => "post_attention_layernorm.weight".to_string(),
        "attn.q_a" => "self_attn.q_a_proj.weight".into(),
        "attn.q_a_norm" => "self_attn.q_a_layernorm.weight".into(),
        "attn.q_b" => "self_attn.q_b_proj.weight".into(),
        "attn.kv_a" => "self_attn.kv_a_proj_with_mqa.weight".into(),
        "attn.kv_a_norm" => "self_attn.kv_a_layernorm.weight".into(),
        "attn.kv_b" => "self_attn.kv_b_proj.weight".into(),
        "attn.q_norm" => "self_attn.q_norm.weight".into(),
        "attn.k_norm" => "self_attn.k_norm.weight".into(),
        "moe.router" if family == Family::GptOss => "mlp.router.weight".into(),
        "moe.router_logit_bias" => "mlp.router.bias".into(),
        "attn.sinks" => "self_attn.sinks".into(),
        // Qwen3-Next's Gated DeltaNet, under the names `smoe_convert`'s provider gives the
        // parts of its fused projections.
        "lin.qkv" => "linear_attn.in_proj_qkv.weight".into(),
        "lin.z" => "linear_attn.in_proj_z.weight".into(),
        "lin.b" => "linear_attn.in_proj_b.weight".into(),
        "lin.a" => "linear_attn.in_proj_a.weight".into(),
        "lin.conv" => "linear_attn.conv1d.weight".into(),
        "lin.dt_bias" => "linear_attn.dt_bias".into(),
        "lin.a_log" => "linear_attn.A_log".into(),
        "lin.norm" => "linear_attn.norm.weight".into(),
        "lin.out" => "linear_attn.out_proj.weight".into(),
        "attn.idx_q" => "self_attn.indexer.wq_b.weight".into(),
        "attn.idx_k" => "self_attn.indexer.wk.weight".into(),
        "attn.idx_k_norm" => "self_attn.indexer.k_norm.weight".into(),
        "attn.idx_k_norm_bias" => "self_attn.indexer.k_norm.bias".into(),
        "attn.idx_weights" => "self_attn.indexer.weights_proj.weight".into(),
        // gpt-oss's expert biases; gate and up are the even and odd columns of
        // `gate_up_proj_bias`, named apart by `smoe_convert`'s gpt-oss provider.
        "moe.expert_gate_bias" => "mlp.experts.gate_proj_bias".into(),
        "moe.expert_up_bias" => "mlp.experts.up_proj_bias".into(),
        "moe.expert_down_bias" => "mlp.experts.down_proj_bias".into(),
        "moe.router" => format!("{moe_block}.gate.weight"),
        // MiniMax-M2 keeps its routing bias on the block, not on the gate.
        "moe.router_bias" if family == Family::MinimaxM2 => format!("{moe_block}.e_score_correction_bias"),
        "moe.router_bias" => format!("{moe_block}.gate.e_score_correction_bias"),
        "moe.shared_gate" => "mlp.shared_expert_gate.weight".into(),
        w => {
            if let Some(p) = w.strip_prefix("attn.") {
                match p.split_once('_') {
                    Some((x, "bias")) => format!("self_attn.{x}_proj.bias"),
                    _ => format!("self_attn.{p}_proj.weight"),
                }
            } else if let Some(p) = w.strip_prefix("mlp.") {
                format!("mlp.{p}_proj.weight")
            } else if let Some(p) = w.strip_prefix("moe.shared.") {
                format!("mlp.{shared}.{p}_proj.weight")
            } else {
                panic!("unmapped canonical tensor {canonical}")
            }
        }
    };
    format!("{model}.layers.{layer}.{mapped}")
}

/// The checkpoint names of expert `e`'s `[gate, up, down]` in decoder layer `layer`.
pub fn hf_expert_names(family: Family, layer: usize, e: usize) -> [String; 3] {
    if family == Family::DeepseekV4 {
        let p = format!("layers.{layer}.ffn.experts.{e}");
        return [format!("{p}.w1.weight"), format!("{p}.w3.weight"), format!("{p}.w2.weight")];
    }
    if matches!(family, Family::Mixtral | Family::MinimaxM2) {
        let p = format!("model.layers.{layer}.block_sparse_moe.experts.{e}");
        return [format!("{p}.w1.weight"), format!("{p}.w3.weight"), format!("{p}.w2.weight")];
    }
    let model = if family == Family::Qwen35Moe { "model.language_model" } else { "model" };
    let p = format!("{model}.layers.{layer}.mlp.experts.{e}");
    names::EXPERT_PARTS.map(|part| format!("{p}.{part}_proj.weight"))
}

/// Tensors a checkpoint may carry that smoe deliberately does not convert: rotary caches and
/// multi-token-prediction layers (decoder layers past `num_layers`).
pub fn is_ignored(name: &str, arch: &Architecture) -> bool {
    if name.ends_with("rotary_emb.inv_freq") || name.ends_with("_scale_inv") {
        return true;
    }
    // DeepSeek-V4: its multi-token-prediction module (`mtp.*`); the vision variants' encoder
    // (`aligner.*`, `image_*`) and their hash layers' image-token bias (`ffn.gate.bias_vl`);
    // and the `ffn.gate.bias` a hash-routed layer carries but never uses (its experts come from
    // the token id; llama.cpp's converter drops it too). Its FP8/FP4 `.scale`s are read with
    // their weights (`smoe_convert`), not ignored.
    // Qwen3.5-MoE: the vision tower and the multi-token-prediction layer.
    if arch.family == Family::Qwen35Moe && (name.starts_with("model.visual.") || name.starts_with("mtp.")) {
        return true;
    }
    let v4 = arch.family == Family::DeepseekV4;
    if v4 && (name.starts_with("mtp.") || name.starts_with("aligner.") || name.starts_with("image_") || name.ends_with(".gate.bias_vl")) {
        return true;
    }
    let layers = name.strip_prefix("model.layers.").or_else(|| name.strip_prefix("model.language_model.layers."));
    if let Some(rest) = layers.or_else(|| name.strip_prefix("layers.").filter(|_| v4)) {
        if let Some(Ok(l)) = rest.split('.').next().map(str::parse::<usize>) {
            if v4 && l < arch.num_layers && arch.moe.hash_routed(l) && rest.ends_with(".ffn.gate.bias") {
                return true;
            }
            return l >= arch.num_layers;
        }
    }
    false
}

/// Tokenizer, chat template and special tokens from the checkpoint directory.
pub fn text_assets(dir: &Path) -> Result<TextAssets, FormatError> {
    let tok_path = dir.join("tokenizer.json");
    let tokenizer_json = std::fs::read_to_string(&tok_path)
        .map_err(|e| FormatError::BadInput(format!("{}: {e} (a tokenizer.json is required)", tok_path.display())))?;
    serde_json::from_str::<Value>(&tokenizer_json).map_err(|e| FormatError::BadInput(format!("{}: {e}", tok_path.display())))?;
    let cfg_path = dir.join("tokenizer_config.json");
    let cfg = if cfg_path.exists() { read_json(&cfg_path)? } else { Value::Null };
    let token = |k: &str| match cfg.get(k) {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Object(o)) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
        _ => None,
    };
    let jinja = dir.join("chat_template.jinja");
    let chat_template = if jinja.exists() {
        Some(std::fs::read_to_string(&jinja).map_err(|e| FormatError::io(&jinja, e))?)
    } else {
        match cfg.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // Older format: a list of named templates; "default" is the chat one.
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .or(list.first())
                .and_then(|t| t.get("template").and_then(|s| s.as_str()).map(str::to_string)),
            _ => None,
        }
    };
    Ok(TextAssets {
        tokenizer_json,
        chat_template,
        bos_token: token("bos_token"),
        eos_token: token("eos_token"),
        pad_token: token("pad_token"),
        add_bos_token: cfg.get("add_bos_token").and_then(|b| b.as_bool()).unwrap_or(false),
    })
}

fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect(),
        _ => vec![],
    }
}

/// Generation defaults from generation_config.json, falling back on config.json for ids.
pub fn generation_defaults(dir: &Path, config: &Value) -> Result<GenerationDefaults, FormatError> {
    let p = dir.join("generation_config.json");
    let g = if p.exists() { read_json(&p)? } else { Value::Null };
    let mut eos = ids(g.get("eos_token_id"));
    if eos.is_empty() {
        eos = ids(config.get("eos_token_id"));
    }
    let f = |k: &str| g.get(k).and_then(|v| v.as_f64());
    Ok(GenerationDefaults {
        bos_token_id: ids(g.get("bos_token_id")).first().or(ids(config.get("bos_token_id")).first()).copied(),
        eos_token_ids: eos,
        do_sample: g.get("do_sample").and_then(|v| v.as_bool()),
        temperature: f("temperature"),
        top_p: f("top_p"),
        top_k: g.get("top_k").and_then(|v| v.as_u64()).map(|x| x as u32),
        min_p: f("min_p"),
        repetition_penalty: f("repetition_penalty"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// transformers 5.24 writes a Qwen3-MoE config with `num_local_experts` and no
    /// `num_experts`; both spellings give the same architecture, and neither is an error.
    #[test]
    fn qwen3_moe_expert_count_under_either_name() {
        let cfg = |key: &str| {
            serde_json::json!({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024, "moe_intermediate_size": 32, "intermediate_size": 96,
                "num_experts_per_tok": 2, key: 8})
        };
        let a = architecture_from_config(&cfg("num_experts")).unwrap();
        assert_eq!(a, architecture_from_config(&cfg("num_local_experts")).unwrap());
        assert_eq!(a.moe.num_experts, 8);
        let e = architecture_from_config(&cfg("experts")).unwrap_err().to_string();
        assert!(e.contains("missing num_experts"), "{e}");
    }

    /// A layer count no model has is refused before anything is sized per layer (the `config`
    /// fuzz target asked for 45 billion layers and hit its allocation limit).
    #[test]
    fn absurd_layer_counts_are_refused_before_allocation() {
        let mut c = serde_json::json!({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 45_555_555_555u64,
            "num_attention_heads": 4, "vocab_size": 1024, "moe_intermediate_size": 32, "num_experts_per_tok": 2, "num_experts": 8});
        let e = architecture_from_config(&c).unwrap_err().to_string();
        assert!(e.contains("num_hidden_layers 45555555555 (at most 4096)"), "{e}");
        c["num_hidden_layers"] = 4096.into();
        assert!(architecture_from_config(&c).is_ok());
        let found = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus/config/layers-45-billion");
        let v: Value = serde_json::from_slice(&std::fs::read(found).unwrap()).unwrap();
        assert!(architecture_from_config(&v).is_err());
    }

    /// GLM-5's indexer layers from `indexer_types`, from `index_topk_pattern` as a string or a
    /// list, and from `index_topk_freq`/`index_skip_topk_offset` as transformers derives them.
    #[test]
    fn glm5_indexer_layers_from_every_spelling() {
        let cfg = |extra: serde_json::Value| {
            let mut c = serde_json::json!({"model_type": "glm_moe_dsa", "hidden_size": 64, "num_hidden_layers": 8,
                "num_attention_heads": 4, "vocab_size": 1024, "moe_intermediate_size": 32, "intermediate_size": 96,
                "n_routed_experts": 8, "num_experts_per_tok": 2, "q_lora_rank": 32, "kv_lora_rank": 16,
                "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "index_head_dim": 16});
            c.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            architecture_from_config(&c).map(|a| a.sparse_attention.unwrap().indexer)
        };
        let want = vec![true, false, true, true, false, false, true, false];
        let names: Vec<&str> = want.iter().map(|&f| if f { "full" } else { "shared" }).collect();
        assert_eq!(cfg(serde_json::json!({"indexer_types": names})).unwrap(), want);
        assert_eq!(cfg(serde_json::json!({"index_topk_pattern": "FSFFSSFS"})).unwrap(), want);
        assert_eq!(cfg(serde_json::json!({"index_topk_pattern": names})).unwrap(), want);
        // GLM-5.2's schedule: layers 0, 1, 2, then every fourth.
        let sched = cfg(serde_json::json!({"index_topk_freq": 4, "index_skip_topk_offset": 3})).unwrap();
        assert_eq!(sched, vec![true, true, true, false, false, false, true, false]);
        // Every layer by default; a first layer that shares nothing, or a bad entry, is refused.
        assert!(cfg(serde_json::json!({})).unwrap().iter().all(|&f| f));
        assert!(cfg(serde_json::json!({"index_topk_pattern": "SFFFFFFF"})).is_err());
        assert!(cfg(serde_json::json!({"index_topk_pattern": "FXFFFFFF"})).is_err());
    }

    /// DeepSeek-V4 from the hub's spellings and from transformers' own give the same
    /// architecture; what the engine cannot run is refused with the setting named.
    #[test]
    fn deepseek_v4_configs_in_either_spelling_and_refusals() {
        let hub = serde_json::json!({"model_type": "deepseek_v4", "hidden_size": 64, "num_hidden_layers": 3,
            "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 1024, "moe_intermediate_size": 32,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16,
            "index_n_heads": 4, "index_head_dim": 16, "index_topk": 8, "sliding_window": 16, "qk_rope_head_dim": 8,
            "compress_ratios": [0, 4, 128, 4], "num_hash_layers": 1, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
            "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}});
        let a = architecture_from_config(&hub).unwrap();
        let mut tf = hub.clone();
        let o = tf.as_object_mut().unwrap();
        for k in ["compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_theta", "compress_rope_theta", "rope_scaling"] {
            o.remove(k);
        }
        o.insert(
            "layer_types".into(),
            serde_json::json!(["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]),
        );
        o.insert("mlp_layer_types".into(), serde_json::json!(["hash_moe", "moe", "moe"]));
        o.insert("partial_rotary_factor".into(), serde_json::json!(0.25));
        o.insert(
            "rope_parameters".into(),
            serde_json::json!({
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            "compress": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 160000.0,
                         "partial_rotary_factor": 0.25, "attention_factor": 1.0}}),
        );
        assert_eq!(architecture_from_config(&tf).unwrap(), a);
        let refused = |k: &str, v: serde_json::Value| {
            let mut c = hub.clone();
            c[k] = v;
            architecture_from_config(&c).unwrap_err().to_string()
        };
        assert!(refused("compress_ratios", serde_json::json!([0, 7, 4])).contains("compress ratio 7"));
        assert!(refused("compress_ratios", serde_json::json!([0, 4])).contains("2 compress_ratios for 3 layers"));
        assert!(refused("scoring_func", serde_json::json!("softmax")).contains("scoring_func 'softmax'"));
        assert!(refused("num_key_value_heads", serde_json::json!(2)).contains("one key/value head"));
        assert!(refused("o_groups", serde_json::json!(3)).contains("output groups"));
        // What a published checkpoint carries and the model does not use.
        for n in ["mtp.0.ffn.experts.0.w1.weight", "layers.0.ffn.gate.bias", "layers.1.ffn.gate.bias_vl", "aligner.proj.weight"] {
            assert!(is_ignored(n, &a), "{n}");
        }
        for n in ["layers.1.ffn.gate.bias", "layers.0.ffn.gate.weight", "layers.0.attn.wq_a.scale"] {
            assert!(!is_ignored(n, &a), "{n}");
        }
    }
}
