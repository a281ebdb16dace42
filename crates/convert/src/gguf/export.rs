//! `smoe export-gguf`: a vault as a GGUF file llama.cpp loads, with the vault's quantized blocks
//! copied bit for bit, so both engines compute on identical numbers.

use super::{TensorDecl, Writer};
use crate::{ConvertError, Progress};
use rayon::prelude::*;
use smoe_formats::gguf::names::{arch_name, expert_tensor, llama_qk_permutation, tensor_name};
use smoe_formats::gguf::vocab::gguf_tokenizer;
use smoe_formats::gguf::Value;
use smoe_formats::FormatError;
use smoe_quant::Format;
use smoe_vault::{names, Architecture, ExpertAct, Family, LayerKind, LinearAttention, QkNorm, RopeScaling, Router, Vault};
use std::path::Path;

/// llama.cpp's `general.file_type` for a vault whose experts are `f`.
fn file_type(f: Format) -> u32 {
    match f {
        Format::F32 => 0,
        Format::F16 => 1,
        Format::Q4_0 => 2,
        Format::Q4_1 => 3,
        Format::Q8_0 => 7,
        Format::Q5_0 => 8,
        Format::Q5_1 => 9,
        Format::Q2_K => 10,
        Format::Q3_K => 12,
        Format::Q4_K => 15,
        Format::Q5_K => 17,
        Format::Q6_K => 18,
        Format::BF16 => 32,
        // LLAMA_FTYPE_MOSTLY_MXFP4_MOE: MXFP4 experts, the rest as they are.
        Format::MXFP4 => 38,
        // Not a ggml type: `export_with` refuses vaults holding it before this is asked.
        Format::MXFP8 | Format::FP8 => unreachable!("{f} has no GGUF file type"),
    }
}

fn metadata(v: &Vault) -> Result<Vec<(String, Value)>, ConvertError> {
    let a = v.architecture();
    let m = v.manifest();
    if a.compressed_attention.is_some() || a.hyper_connections.is_some() {
        return Err(ConvertError::Format(smoe_formats::FormatError::Unsupported(format!(
            "{} has no GGUF layout yet (llama.cpp's converter does not write it), so there is nothing to match",
            a.family.model_type()
        ))));
    }
    let arch = arch_name(a.family);
    let mut kv: Vec<(String, Value)> = Vec::new();
    let mut put = |k: &str, val: Value| {
        kv.push((if k.starts_with("general.") || k.starts_with("tokenizer.") { k.to_string() } else { format!("{arch}.{k}") }, val))
    };
    let u = |x: usize| Value::U32(x as u32);
    put("general.architecture", Value::Str(arch.into()));
    put("general.type", Value::Str("model".into()));
    put("general.name", Value::Str(v.path().file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default()));
    put("general.file_type", Value::U32(file_type(m.experts.parts[0].format)));
    put("general.quantization_version", Value::U32(2));
    put("block_count", u(a.num_layers));
    put("context_length", u(a.max_position_embeddings));
    put("embedding_length", u(a.hidden_size));
    let ff = if a.dense_intermediate_size > 0 { a.dense_intermediate_size } else { a.moe.intermediate_size };
    put("feed_forward_length", u(ff));
    put("attention.head_count", u(a.num_heads));
    put("attention.layer_norm_rms_epsilon", Value::F32(a.norm_eps as f32));
    put("rope.freq_base", Value::F32(a.rope.theta as f32));
    put("rope.dimension_count", u(a.rope.rotary_dim));
    put("expert_count", u(a.moe.num_experts));
    put("expert_used_count", u(a.moe.top_k));
    put("expert_feed_forward_length", u(a.moe.intermediate_size));
    put("vocab_size", u(a.vocab_size));
    match &a.mla {
        Some(mla) => {
            put("attention.head_count_kv", u(1));
            put("attention.key_length", u(mla.kv_lora_rank + mla.qk_rope_head_dim));
            put("attention.value_length", u(mla.kv_lora_rank));
            put("attention.key_length_mla", u(mla.qk_nope_head_dim + mla.qk_rope_head_dim));
            put("attention.value_length_mla", u(mla.v_head_dim));
            if let Some(r) = mla.q_lora_rank {
                put("attention.q_lora_rank", u(r));
            }
            put("attention.kv_lora_rank", u(mla.kv_lora_rank));
            // GLM-5's indexer, as llama.cpp's glm-dsa reads it (`types`: true = "full").
            if let Some(s) = &a.sparse_attention {
                put("attention.indexer.head_count", u(s.heads));
                put("attention.indexer.key_length", u(s.head_dim));
                put("attention.indexer.top_k", u(s.top_k));
                put("attention.indexer.types", Value::Array(s.indexer.iter().map(|&f| Value::Bool(f)).collect()));
            }
        }
        None => {
            put("attention.head_count_kv", u(a.num_kv_heads));
            put("attention.key_length", u(a.head_dim));
            put("attention.value_length", u(a.head_dim));
        }
    }
    if let Some(la) = &a.linear_attention {
        // llama.cpp's qwen3next: its converter's names for the Gated DeltaNet's sizes.
        put("ssm.conv_kernel", u(la.conv_kernel));
        put("ssm.state_size", u(la.key_dim));
        put("ssm.group_count", u(la.key_heads));
        put("ssm.time_step_rank", u(la.value_heads));
        put("ssm.inner_size", u(la.value_heads * la.value_dim));
        put("attention.recurrent_layers", Value::Array(la.layers.iter().map(|&l| Value::Bool(l)).collect()));
        // Also the interval, where the layers follow one (the converter writes both).
        let every = la.layers.iter().position(|l| !l).map_or(0, |f| f + 1);
        if every > 0 && la.layers.iter().enumerate().all(|(l, &lin)| lin == ((l + 1) % every != 0)) {
            put("full_attention_interval", u(every));
        }
    }
    if a.family == Family::Qwen35Moe {
        // llama.cpp's qwen35moe requires the sections (four, the last for its own use); a vault
        // without them gets the upstream split of the rotated pairs (11/11/10 of 32).
        let mut sec = a.rope.sections.clone();
        if sec.is_empty() {
            let pairs = a.rope.rotary_dim / 2;
            let third = pairs.div_ceil(3);
            sec = vec![third, third, pairs.saturating_sub(2 * third)];
        }
        sec.resize(4, 0);
        put("rope.dimension_sections", Value::Array(sec.into_iter().map(|x| Value::I32(x as i32)).collect()));
    }
    if let Some(w) = a.attention_windows.iter().flatten().next().filter(|_| a.family == Family::GptOss) {
        // gpt-oss: llama.cpp slides every other layer, from the first (`check_supported`).
        put("attention.sliding_window", u(*w));
    }
    if let Some(s) = &a.moe.shared_experts {
        if s.sigmoid_gate {
            put("expert_shared_feed_forward_length", u(s.intermediate_size));
        } else {
            put("expert_shared_count", u(s.intermediate_size / a.moe.intermediate_size));
        }
    }
    if let Router::SigmoidGrouped { n_group, topk_group, .. } = a.moe.router {
        put("leading_dense_block_count", u(a.layers.iter().take_while(|k| **k == LayerKind::Dense).count()));
        put("expert_group_count", u(n_group));
        put("expert_group_used_count", u(topk_group));
        put("expert_weights_scale", Value::F32(a.moe.routed_scaling_factor as f32));
        put("expert_weights_norm", Value::Bool(a.moe.norm_topk_prob));
        put("expert_gating_func", Value::U32(2));
        if a.family == Family::Glm4Moe {
            put("nextn_predict_layers", u(0));
        }
    }
    match &a.rope.scaling {
        RopeScaling::None => {}
        RopeScaling::Linear { factor } => {
            put("rope.scaling.type", Value::Str("linear".into()));
            put("rope.scaling.factor", Value::F32(*factor as f32));
        }
        RopeScaling::Yarn { factor, original_max_position_embeddings, beta_fast, beta_slow, mscale_all_dim, .. } => {
            put("rope.scaling.type", Value::Str("yarn".into()));
            put("rope.scaling.factor", Value::F32(*factor as f32));
            put("rope.scaling.original_context_length", u(*original_max_position_embeddings));
            put("rope.scaling.yarn_beta_fast", Value::F32(*beta_fast as f32));
            put("rope.scaling.yarn_beta_slow", Value::F32(*beta_slow as f32));
            if let Some(ma) = mscale_all_dim {
                put("rope.scaling.yarn_log_multiplier", Value::F32((0.1 * ma) as f32));
            }
        }
    }
    let g = &m.generation;
    if let Some(t) = g.temperature {
        put("general.sampling.temp", Value::F32(t as f32));
    }
    if let Some(t) = g.top_p {
        put("general.sampling.top_p", Value::F32(t as f32));
    }
    if let Some(t) = g.top_k {
        put("general.sampling.top_k", Value::I32(t as i32));
    }
    for (k, v) in gguf_tokenizer(&m.text.tokenizer_json, a.vocab_size)? {
        put(&k, v);
    }
    let tok: serde_json::Value = serde_json::from_str(&m.text.tokenizer_json).unwrap_or_default();
    let id_of = |s: &Option<String>| {
        s.as_ref().and_then(|s| tok["added_tokens"].as_array()?.iter().find(|t| t["content"] == s.as_str())?["id"].as_u64())
    };
    if let Some(e) = g.eos_token_ids.first().map(|&e| e as u64).or_else(|| id_of(&m.text.eos_token)) {
        put("tokenizer.ggml.eos_token_id", Value::U32(e as u32));
    }
    if let Some(b) = g.bos_token_id.map(|b| b as u64).or_else(|| id_of(&m.text.bos_token)) {
        put("tokenizer.ggml.bos_token_id", Value::U32(b as u32));
    }
    if let Some(p) = id_of(&m.text.pad_token) {
        put("tokenizer.ggml.padding_token_id", Value::U32(p as u32));
    }
    if let Some(t) = &m.text.chat_template {
        put("tokenizer.chat_template", Value::Str(t.clone()));
    }
    Ok(kv)
}

/// How a dense tensor becomes GGUF tensors.
enum Plan {
    /// Bytes as they are.
    Copy { canonical: String },
    /// Rows reordered (q/k of the `llama` architecture).
    Permute { canonical: String, src_rows: Vec<usize> },
    /// DeepSeek's kv_b: per head, W_uk transposed into `attn_k_b`, or W_uv into `attn_v_b`.
    KvB { canonical: String, key: bool },
    /// Two tensors of one format and row length fused by rows, `block` rows of the first then
    /// `block` of the second, in turn (Qwen3-Next's `attn_q`: each head's query then its gate;
    /// `ssm_ba`: each key head's `b`s then its `a`s).
    Interleave { canonicals: [String; 2], block: usize },
    /// `-exp(v)` of an F32 vector (Qwen3-Next's `ssm_a` from `A_log`), element `i` from
    /// `src[i]`.
    NegExp { canonical: String, src: Vec<usize> },
    /// Each row's columns moved in groups of `group` columns, group `i` from group `src[i]`
    /// (Qwen3.5's `ssm_out`, whose inputs are the value heads).
    PermuteColumns { canonical: String, src: Vec<usize>, group: usize },
}

/// What [`export`] wrote.
#[derive(Clone, Debug)]
pub struct ExportReport {
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of the file.
    pub bytes: u64,
}

/// Qwen3-Next: the tensor fused after `name` in llama.cpp's layout, and the rows each takes in
/// turn (`attn.q` with `attn.q_gate` per head; `lin.b` with `lin.a` per key head).
fn fused_with(a: &Architecture, name: &str) -> Option<(String, usize)> {
    let layer = name.strip_suffix("attn.q").or_else(|| name.strip_suffix("lin.b"))?;
    if !matches!(a.family, Family::Qwen3Next | Family::Qwen35Moe) {
        return None;
    }
    if name.ends_with("attn.q") {
        return a.attn_output_gate.then(|| (format!("{layer}attn.q_gate"), a.head_dim));
    }
    // Qwen3.5's are separate tensors (`ssm_beta`, `ssm_alpha`).
    if a.family == Family::Qwen35Moe {
        return None;
    }
    let la = a.linear_attention.as_ref()?;
    Some((format!("{layer}lin.a"), la.value_heads / la.key_heads))
}

/// Whether `name` is written by [`fused_with`]'s first tensor.
fn fused_second(a: &Architecture, name: &str) -> bool {
    match a.family {
        Family::Qwen3Next => name.ends_with("attn.q_gate") || name.ends_with("lin.a"),
        Family::Qwen35Moe => name.ends_with("attn.q_gate"),
        _ => false,
    }
}

/// Qwen3.5: llama.cpp's qwen35moe numbers the value heads across key heads ("tiled": value head
/// `r` of key head `g` at `r × key_heads + g`), where the hub groups them by key head
/// (`g × per + r`). For a vault in the hub's order, the source of each destination row of
/// `canonical` (`None`: nothing to move), and for `lin.out` the source of each `value_dim`
/// group of columns.
fn tiled_sources(a: &Architecture, canonical: &str) -> Option<Vec<usize>> {
    let la: &LinearAttention = a.linear_attention.as_ref()?;
    if a.family != Family::Qwen35Moe || la.tiled_value_heads || la.key_heads == la.value_heads {
        return None;
    }
    let (kh, vh) = (la.key_heads, la.value_heads);
    let per = vh / kh;
    let heads =
        |unit: usize| -> Vec<usize> { (0..vh).flat_map(|p| (0..unit).map(move |u| ((p % kh) * per + p / kh) * unit + u)).collect() };
    let what = canonical.rsplit_once(".lin.").map(|(_, w)| w)?;
    match what {
        // [q | k | v] rows (and the convolution's channels): only v's move.
        "qkv" | "conv" => {
            let qk = 2 * kh * la.key_dim;
            Some((0..qk).chain(heads(la.value_dim).into_iter().map(|r| qk + r)).collect())
        }
        "z" => Some(heads(la.value_dim)),
        "b" | "a" | "dt_bias" | "a_log" | "out" => Some(heads(1)),
        _ => None,
    }
}

fn check_supported(a: &Architecture) -> Result<(), ConvertError> {
    let bad = |m: &str| Err(FormatError::Unsupported(format!("{} cannot be exported for llama.cpp: {m}", a.family.model_type())).into());
    match a.family {
        Family::Qwen3Moe if !a.moe.norm_topk_prob => bad("llama.cpp's qwen3moe always renormalises top-k weights"),
        Family::Qwen2Moe | Family::Olmoe if a.moe.norm_topk_prob => {
            bad("llama.cpp does not renormalise top-k weights for this architecture")
        }
        Family::Olmoe if a.qk_norm != QkNorm::WholeProjection => bad("unexpected qk-norm"),
        Family::MinimaxM2 if a.qk_norm != QkNorm::WholeProjection || !a.moe.norm_topk_prob => {
            bad("llama.cpp's minimax-m2 assumes its published settings")
        }
        Family::GptOss => check_gpt_oss(a).map_or(Ok(()), |m| bad(&m)),
        Family::Qwen3Next if a.linear_attention.as_ref().is_some_and(|la| la.tiled_value_heads) => {
            bad("its value heads are numbered across key heads, which llama.cpp's qwen3next does not read")
        }
        _ => Ok(()),
    }
}

/// What llama.cpp's gpt-oss hard-codes and a gpt-oss vault must therefore match, or why not.
fn check_gpt_oss(a: &Architecture) -> Option<String> {
    let w = a.attention_windows.iter().flatten().next().copied();
    let alternate = (0..a.num_layers).all(|l| a.attention_window(l) == if l % 2 == 0 { w } else { None });
    if w.is_none() || !alternate {
        return Some("llama.cpp's gpt-oss slides every other layer from the first, with one window".into());
    }
    if !matches!(a.moe.expert_act, ExpertAct::ClampedSwiglu { alpha, limit } if alpha == 1.702 && limit == 7.0) {
        return Some("llama.cpp's gpt-oss fixes the clamped SwiGLU at alpha 1.702, limit 7".into());
    }
    if !(a.attn_sinks && a.o_bias && a.qkv_bias && a.moe.expert_bias && a.moe.router_logit_bias && a.moe.norm_topk_prob) {
        return Some("llama.cpp's gpt-oss needs sinks, every bias and the softmax over the top-k logits".into());
    }
    if matches!(a.rope.scaling, RopeScaling::Yarn { truncate: true, .. }) {
        return Some("llama.cpp's YaRN does not truncate the correction range as this config asks".into());
    }
    None
}

/// Writes `vault` as a GGUF file at `out`.
pub fn export(vault: &Path, out: &Path, progress: &dyn Progress) -> Result<ExportReport, ConvertError> {
    export_with(vault, out, progress, None)
}

/// Makes one expert matrix's bytes: `(decoder layer, expert, part index)`, as long as the part.
pub type ExpertMaker<'a> = &'a (dyn Fn(usize, usize, usize) -> Result<Vec<u8>, ConvertError> + Sync);

/// [`export`], with the experts' bytes made by `experts` instead of read from the vault: `synth` writes a GGUF this way from a vault that holds only
/// the dense part.
pub fn export_with(vault: &Path, out: &Path, progress: &dyn Progress, experts: Option<ExpertMaker>) -> Result<ExportReport, ConvertError> {
    let v = Vault::open(vault)?;
    let a = v.architecture().clone();
    check_supported(&a)?;
    let x = &v.manifest().experts;
    let layer_formats = x.layers.iter().flat_map(|l| l.parts.iter().flatten()).map(|p| p.format);
    let formats = v.manifest().dense.iter().map(|d| d.format).chain(x.parts.iter().map(|p| p.format)).chain(layer_formats);
    if let Some(f) = formats.into_iter().find(|f| matches!(f, Format::MXFP8 | Format::FP8)) {
        return Err(FormatError::Unsupported(format!("the vault holds {f} tensors, which GGUF has no type for")).into());
    }
    let meta = metadata(&v)?;
    let mut decls: Vec<TensorDecl> = Vec::new();
    let mut plans: Vec<Plan> = Vec::new();
    for spec in names::dense_tensors(&a) {
        let e = v.dense(&spec.name).unwrap();
        let dims: Vec<u64> = e.shape.iter().rev().map(|&d| d as u64).collect();
        if spec.name.ends_with("attn.kv_b") {
            let mla = a.mla.as_ref().unwrap();
            let layer = spec.name.split('.').nth(1).unwrap();
            // Keep 16-bit formats as they are (exact); anything else becomes F32 (exact too).
            let f = if matches!(e.format, Format::F16 | Format::BF16 | Format::F32) { e.format } else { Format::F32 };
            let (r, nope, vd, h) = (mla.kv_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim, a.num_heads);
            decls.push((
                format!("blk.{layer}.attn_k_b.weight"),
                vec![nope as u64, r as u64, h as u64],
                f.ggml_id(),
                (f.row_bytes(nope).unwrap() * r * h) as u64,
            ));
            plans.push(Plan::KvB { canonical: spec.name.clone(), key: true });
            decls.push((
                format!("blk.{layer}.attn_v_b.weight"),
                vec![r as u64, vd as u64, h as u64],
                f.ggml_id(),
                (f.row_bytes(r).unwrap() * vd * h) as u64,
            ));
            plans.push(Plan::KvB { canonical: spec.name.clone(), key: false });
            continue;
        }
        if let Some((second, block)) = fused_with(&a, &spec.name) {
            // The first of a fused pair declares the pair; the second is written with it.
            let (e2, layer) = (v.dense(&second).unwrap(), spec.name.split('.').nth(1).unwrap());
            if e2.format != e.format || e2.shape[1] != e.shape[1] {
                return Err(FormatError::Unsupported(format!("{} and {second} differ in format or width", spec.name)).into());
            }
            let name = if spec.name.ends_with("attn.q") { "attn_q.weight" } else { "ssm_ba.weight" };
            let rows = (e.shape[0] + e2.shape[0]) as u64;
            decls.push((format!("blk.{layer}.{name}"), vec![e.shape[1] as u64, rows], e.format.ggml_id(), e.len + e2.len));
            plans.push(Plan::Interleave { canonicals: [spec.name.clone(), second], block });
            continue;
        }
        if fused_second(&a, &spec.name) {
            continue;
        }
        let name = tensor_name(a.family, &spec.name).ok_or_else(|| FormatError::Internal(format!("no GGUF name for {}", spec.name)))?;
        if spec.name.ends_with("lin.a_log") {
            if e.format != Format::F32 {
                return Err(FormatError::Internal(format!("{} is {}, not F32", spec.name, e.format)).into());
            }
            decls.push((name, dims, e.format.ggml_id(), e.len));
            let src = tiled_sources(&a, &spec.name).unwrap_or_else(|| (0..e.shape[0]).collect());
            plans.push(Plan::NegExp { canonical: spec.name.clone(), src });
            continue;
        }
        if let Some(src) = tiled_sources(&a, &spec.name) {
            decls.push((name, dims, e.format.ggml_id(), e.len));
            if spec.name.ends_with("lin.out") {
                let group = a.linear_attention.as_ref().unwrap().value_dim;
                if group % e.format.block_elems() != 0 {
                    return Err(FormatError::Unsupported(format!(
                        "{} is {}, whose {}-wide blocks straddle the {group}-wide value heads llama.cpp's qwen35moe reorders; shatter the dense part as Q8_0 or 16-bit",
                        spec.name,
                        e.format,
                        e.format.block_elems()
                    ))
                    .into());
                }
                plans.push(Plan::PermuteColumns { canonical: spec.name.clone(), src, group });
            } else {
                plans.push(Plan::Permute { canonical: spec.name.clone(), src_rows: src });
            }
            continue;
        }
        // GGUF stores Qwen2-MoE's shared gate as [hidden] x 1; our [1, hidden] is the same bytes.
        decls.push((name, dims, e.format.ggml_id(), e.len));
        let permute = a.family == Family::Mixtral && (spec.name.ends_with("attn.q") || spec.name.ends_with("attn.k"));
        if permute {
            let heads = if spec.name.ends_with("attn.q") { a.num_heads } else { a.num_kv_heads };
            plans.push(Plan::Permute { canonical: spec.name.clone(), src_rows: llama_qk_permutation(heads, a.head_dim) });
        } else {
            plans.push(Plan::Copy { canonical: spec.name.clone() });
        }
    }
    let n = a.moe.num_experts;
    let first_expert = decls.len();
    for &l in &a.moe_layers() {
        for p in x.layer_parts(l) {
            let dims = vec![p.shape[1] as u64, p.shape[0] as u64, n as u64];
            decls.push((expert_tensor(l, &p.name), dims, p.format.ggml_id(), p.len * n as u64));
        }
    }
    let total: u64 = decls.iter().map(|d| d.3).sum();
    progress.start(total);
    let w = Writer::create(out, &meta, &decls)?;
    for (i, plan) in plans.iter().enumerate() {
        match plan {
            Plan::Copy { canonical } => w.write_at(i, 0, &v.read_dense(canonical)?)?,
            Plan::Permute { canonical, src_rows } => {
                let bytes = v.read_dense(canonical)?;
                let rb = bytes.len() / src_rows.len();
                let mut outb = vec![0u8; bytes.len()];
                for (dst, &src) in src_rows.iter().enumerate() {
                    outb[dst * rb..(dst + 1) * rb].copy_from_slice(&bytes[src * rb..(src + 1) * rb]);
                }
                w.write_at(i, 0, &outb)?
            }
            Plan::Interleave { canonicals: [first, second], block } => {
                let (x, y) = (v.read_dense(first)?, v.read_dense(second)?);
                let e = v.dense(first).unwrap();
                let rb = x.len() / e.shape[0];
                let mut outb = Vec::with_capacity(x.len() + y.len());
                for (xs, ys) in x.chunks(block * rb).zip(y.chunks(block * rb)) {
                    outb.extend_from_slice(xs);
                    outb.extend_from_slice(ys);
                }
                w.write_at(i, 0, &outb)?
            }
            Plan::NegExp { canonical, src } => {
                let vals: Vec<f32> = v.read_dense(canonical)?.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
                let bytes: Vec<u8> = src.iter().flat_map(|&j| (-vals[j].exp()).to_le_bytes()).collect();
                w.write_at(i, 0, &bytes)?
            }
            Plan::PermuteColumns { canonical, src, group } => {
                let e = v.dense(canonical).unwrap();
                let bytes = v.read_dense(canonical)?;
                let gb = e.format.row_bytes(*group).map_err(|err| FormatError::Internal(err.to_string()))?;
                let mut outb = Vec::with_capacity(bytes.len());
                for row in bytes.chunks_exact(bytes.len() / e.shape[0]) {
                    for &g in src {
                        outb.extend_from_slice(&row[g * gb..(g + 1) * gb]);
                    }
                }
                w.write_at(i, 0, &outb)?
            }
            Plan::KvB { canonical, key } => {
                let e = v.dense(canonical).unwrap();
                let mla = a.mla.as_ref().unwrap();
                let (r, nope, vd, h) = (mla.kv_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim, a.num_heads);
                let mut f = vec![0f32; e.shape[0] * e.shape[1]];
                smoe_quant::dequantize(e.format, &v.read_dense(canonical)?, &mut f)
                    .map_err(|err| FormatError::Internal(err.to_string()))?;
                let out_fmt = Format::from_ggml_id(decls[i].2).unwrap();
                // kv_b rows: per head, `nope` rows of W_uk then `vd` rows of W_uv, each `r` long.
                let mut vals = Vec::with_capacity(if *key { h * r * nope } else { h * vd * r });
                for head in 0..h {
                    let base = head * (nope + vd);
                    if *key {
                        // attn_k_b[head] is W_uk[head] transposed: r rows of nope.
                        for c in 0..r {
                            for row in 0..nope {
                                vals.push(f[(base + row) * r + c]);
                            }
                        }
                    } else {
                        vals.extend_from_slice(&f[(base + nope) * r..(base + nope + vd) * r]);
                    }
                }
                let mut bytes = vec![0u8; decls[i].3 as usize];
                smoe_quant::quantize(out_fmt, &vals, &mut bytes).map_err(|err| FormatError::Internal(err.to_string()))?;
                w.write_at(i, 0, &bytes)?
            }
        }
        progress.advance(decls[i].3);
    }
    // Experts: a parallel batch at a time, each expert's parts (read from its blob, or made)
    // written into the stacked tensors.
    let parts_of = |l: usize, e: usize| -> Result<Vec<Vec<u8>>, ConvertError> {
        match experts {
            Some(make) => (0..x.layer_parts(l).len()).map(|pi| make(l, e, pi)).collect(),
            None => {
                let mut blob = vec![0u8; x.blob_size as usize];
                v.read_blob(l, e, &mut blob)?;
                Ok(x.layer_parts(l).iter().map(|p| blob[p.offset as usize..(p.offset + p.len) as usize].to_vec()).collect())
            }
        }
    };
    let batch = rayon::current_num_threads().max(1) * 2;
    for (li, &l) in a.moe_layers().iter().enumerate() {
        for first in (0..n).step_by(batch) {
            let made: Vec<_> = (first..(first + batch).min(n)).into_par_iter().map(|e| parts_of(l, e)).collect();
            for (e, parts) in (first..).zip(made) {
                for ((pi, p), bytes) in x.layer_parts(l).iter().enumerate().zip(parts?) {
                    if bytes.len() as u64 != p.len {
                        return Err(FormatError::Internal(format!(
                            "layer {l} expert {e} {}: {} bytes, not {}",
                            p.name,
                            bytes.len(),
                            p.len
                        ))
                        .into());
                    }
                    w.write_at(first_expert + li * names::EXPERT_PARTS.len() + pi, e as u64 * p.len, &bytes)?;
                    progress.advance(p.len);
                }
            }
        }
    }
    w.finish()?;
    progress.finish();
    Ok(ExportReport { tensors: decls.len(), bytes: std::fs::metadata(out).map(|m| m.len()).unwrap_or(0) })
}
