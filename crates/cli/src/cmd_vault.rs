//! `smoe shatter`, `smoe inspect`, `smoe verify`.

use crate::progress::CliProgress;
use anyhow::{Context, Result};
use smoe_convert::{shatter, ShatterOptions, ShatterReport};
use smoe_quant::Format;
use smoe_vault::{Router, Vault};
use std::collections::BTreeMap;
use std::path::Path;

pub fn fmt_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

pub fn run_shatter(
    input: &Path,
    out: &Path,
    experts: Option<smoe_convert::ExpertFormats>,
    dense: Format,
    threads: Option<usize>,
    mix: Option<smoe_convert::LlamaFileType>,
) -> Result<ShatterReport> {
    let experts = experts.unwrap_or_else(|| {
        // A checkpoint's own expert format where smoe keeps it as it is (gpt-oss's MXFP4).
        let native =
            smoe_formats::hf::read_json(&input.join("config.json")).ok().and_then(|c| smoe_convert::gpt_oss::native_expert_format(&c));
        native.unwrap_or(Format::Q4_K).into()
    });
    let opts = ShatterOptions {
        experts,
        dense,
        threads,
        zero_experts: false,
        fail_after_blobs: std::env::var("SMOE_TEST_FAIL_AFTER_BLOBS").ok().and_then(|v| v.parse().ok()),
        mix,
    };
    let is_gguf = input.is_file() && smoe_engine::is_gguf(input);
    if is_gguf && mix.is_some() {
        anyhow::bail!("--mix applies to checkpoints: a GGUF's blocks are copied in its own formats");
    }
    let report = if is_gguf {
        // A GGUF's blocks are copied as they are: its own formats, never re-quantized.
        eprintln!("shattering GGUF {} -> {} (quantized blocks copied as they are)", input.display(), out.display());
        smoe_convert::gguf::import::shatter_gguf(input, out, &CliProgress::new()).with_context(|| format!("shatter {}", input.display()))?
    } else {
        match mix {
            Some(m) => eprintln!("shattering {} -> {} (llama.cpp's {m} mix)", input.display(), out.display()),
            None => eprintln!("shattering {} -> {} (experts {experts}, dense {dense})", input.display(), out.display()),
        }
        shatter(input, out, &opts, &CliProgress::new()).with_context(|| format!("shatter {}", input.display()))?
    };
    eprintln!(
        "wrote {} in {:.1} s: dense {}, experts {} ({} per blob)",
        out.display(),
        report.seconds,
        fmt_bytes(report.dense_bytes),
        fmt_bytes(report.expert_bytes),
        fmt_bytes(report.blob_size)
    );
    Ok(report)
}

/// Everything `inspect` reports, as JSON.
pub fn inspect_json(v: &Vault) -> serde_json::Value {
    let m = v.manifest();
    let h = v.header();
    let mut dense_formats: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for d in &m.dense {
        let e = dense_formats.entry(d.format.name().to_string()).or_default();
        e.0 += 1;
        e.1 += d.len;
    }
    // Layers with parts or blob sizes of their own (a mixed quantization such as Q4_K_M), by layer.
    let (mut layer_formats, mut layer_blobs) = (serde_json::Map::new(), serde_json::Map::new());
    for l in &m.experts.layers {
        if let Some(ps) = &l.parts {
            let formats: serde_json::Map<_, _> = ps.iter().map(|p| (p.name.clone(), p.format.name().into())).collect();
            layer_formats.insert(l.layer.to_string(), formats.into());
        }
        if let Some(b) = l.blob_size {
            layer_blobs.insert(l.layer.to_string(), b.into());
        }
    }
    serde_json::json!({
        "path": v.path().display().to_string(),
        "format_version": format!("{}.{}", h.major, h.minor),
        "created_by": m.created_by,
        "architecture": m.architecture,
        "dense_formats": dense_formats.iter().map(|(k, (n, b))| (k.clone(), serde_json::json!({"tensors": n, "bytes": b}))).collect::<serde_json::Map<_, _>>(),
        "expert_parts": m.experts.parts.iter().map(|p| serde_json::json!({"name": p.name, "format": p.format.name(), "shape": p.shape, "bytes": p.len})).collect::<Vec<_>>(),
        "layer_expert_formats": layer_formats,
        "dense_bytes": h.dense_len,
        "expert_bytes": h.experts_len,
        "expert_blob_bytes": m.experts.blob_size,
        "layer_expert_blob_bytes": layer_blobs,
        "expert_count": m.experts.layers.len() * m.architecture.moe.num_experts,
        "total_bytes": h.file_len,
        "alignment": h.alignment,
        "generation": m.generation,
        "has_chat_template": m.text.chat_template.is_some(),
        "notes": m.notes,
    })
}

pub fn run_inspect(path: &Path, json: bool) -> Result<()> {
    let v = Vault::open(path).with_context(|| format!("open {}", path.display()))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&inspect_json(&v))?);
        return Ok(());
    }
    let m = v.manifest();
    let a = &m.architecture;
    let h = v.header();
    println!("{}  (vault format {}.{}, {})", path.display(), h.major, h.minor, m.created_by);
    println!("family        {}", a.family.model_type());
    println!("layers        {} ({} MoE, {} dense)", a.num_layers, a.moe_layers().len(), a.num_layers - a.moe_layers().len());
    println!("hidden        {}   vocab {}", a.hidden_size, a.vocab_size);
    match &a.mla {
        Some(mla) => println!(
            "attention     MLA: {} heads, q rank {:?}, kv rank {}, nope {} + rope {}, v {}",
            a.num_heads, mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        ),
        None => println!(
            "attention     {} heads / {} kv heads x {}, qk-norm {:?}, qkv bias {}",
            a.num_heads, a.num_kv_heads, a.head_dim, a.qk_norm, a.qkv_bias
        ),
    }
    // gpt-oss's attention extras, where a model has them.
    let windows: Vec<String> = a.attention_windows.iter().map(|w| w.map_or("full".into(), |w| w.to_string())).collect();
    if a.attn_sinks || a.o_bias || !windows.is_empty() {
        let per_layer = if windows.is_empty() { String::new() } else { format!(", windows per layer [{}]", windows.join(" ")) };
        println!("              sinks {}, output bias {}{per_layer}", a.attn_sinks, a.o_bias);
    }
    // Qwen3-Next's Gated DeltaNet layers and gated full attention.
    if let Some(la) = &a.linear_attention {
        let linear: Vec<String> = (0..a.num_layers).filter(|&l| a.is_linear(l)).map(|l| l.to_string()).collect();
        println!(
            "linear attn   Gated DeltaNet in layers [{}]: {} key heads x {}, {} value heads x {}{}, conv {}; a {} KiB state per layer and sequence",
            linear.join(" "),
            la.key_heads,
            la.key_dim,
            la.value_heads,
            la.value_dim,
            if la.tiled_value_heads { " (numbered across key heads)" } else { "" },
            la.conv_kernel,
            la.state_floats() * 4 / 1024
        );
    }
    if a.attn_output_gate {
        println!("              full attention output gated (sigmoid)");
    }
    println!(
        "rope          theta {}, rotary dim {}{}, scaling {:?}",
        a.rope.theta,
        a.rope.rotary_dim,
        if a.rope.interleaved { " (interleaved)" } else { "" },
        a.rope.scaling
    );
    let router = match &a.moe.router {
        Router::Softmax => "softmax".to_string(),
        Router::SigmoidGrouped { n_group, topk_group, .. } => format!("sigmoid + correction bias, {topk_group} of {n_group} groups"),
        Router::SqrtSoftplus { .. } => {
            let hashed = a.moe.hash_layers.iter().filter(|&&h| h).count();
            format!("sqrt(softplus) + correction bias, {hashed} hash-routed layers")
        }
    };
    println!(
        "experts       {} x {} wide, top-{}, router {router}, renormalise {}, scale {}",
        a.moe.num_experts, a.moe.intermediate_size, a.moe.top_k, a.moe.norm_topk_prob, a.moe.routed_scaling_factor
    );
    if a.moe.router_logit_bias || a.moe.expert_bias || a.moe.expert_act != smoe_vault::ExpertAct::Silu {
        println!(
            "              router bias {}, expert biases {}, activation {:?}",
            a.moe.router_logit_bias, a.moe.expert_bias, a.moe.expert_act
        );
    }
    if let Some(s) = &a.moe.shared_experts {
        println!("shared expert {} wide{}", s.intermediate_size, if s.sigmoid_gate { ", sigmoid gate" } else { "" });
    }
    let parts: Vec<String> = m.experts.parts.iter().map(|p| format!("{} {}", p.name, p.format)).collect();
    let up_to = if m.experts.layers.iter().any(|l| l.blob_size.is_some()) { "up to " } else { "" };
    println!(
        "expert blobs  {} x {up_to}{} ({})",
        m.experts.layers.len() * a.moe.num_experts,
        fmt_bytes(m.experts.blob_size),
        parts.join(", ")
    );
    // A mixed quantization: the layers whose parts or blob sizes differ, grouped by both.
    let mut own: BTreeMap<(String, u64), Vec<usize>> = BTreeMap::new();
    for (i, l) in m.experts.layers.iter().enumerate() {
        if l.parts.is_some() || l.blob_size.is_some() {
            let formats = m.experts.layer_parts(l.layer).iter().map(|p| format!("{} {}", p.name, p.format)).collect::<Vec<_>>();
            own.entry((formats.join(", "), m.experts.layer_blob_size(i))).or_default().push(l.layer);
        }
    }
    for ((formats, size), layers) in &own {
        let list: Vec<String> = layers.iter().map(|l| l.to_string()).collect();
        println!("              layers [{}]: {formats} ({} per blob)", list.join(" "), fmt_bytes(*size));
    }
    let mut dense_formats: BTreeMap<Format, u64> = BTreeMap::new();
    for d in &m.dense {
        *dense_formats.entry(d.format).or_default() += d.len;
    }
    let df: Vec<String> = dense_formats.iter().map(|(f, b)| format!("{f} {}", fmt_bytes(*b))).collect();
    println!("dense         {} ({})", fmt_bytes(h.dense_len), df.join(", "));
    println!("expert region {}", fmt_bytes(h.experts_len));
    println!("total         {}", fmt_bytes(h.file_len));
    for n in &m.notes {
        println!("note          {n}");
    }
    Ok(())
}

pub fn run_verify(path: &Path) -> Result<()> {
    let v = Vault::open(path).with_context(|| format!("open {}", path.display()))?;
    let total = v.header().dense_len + v.header().experts_len;
    let t0 = std::time::Instant::now();
    v.verify(&mut |_| {}).with_context(|| format!("verify {}", path.display()))?;
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "ok: {} dense tensors and {} expert blobs verified ({} in {secs:.1} s)",
        v.manifest().dense.len(),
        v.manifest().experts.layers.len() * v.architecture().moe.num_experts,
        fmt_bytes(total)
    );
    Ok(())
}
