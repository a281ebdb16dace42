//! Every fixture checkpoint shatters; the manifest matches config.json field by field; BF16
//! keeps the checkpoint's bits; quantized formats stay within their documented error bounds;
//! bad checkpoints fail with clear messages and never leave a vault behind.

use serde_json::Value;
use smoe_convert::{shatter, ShatterOptions, Silent};
use smoe_formats::{hf, safetensors::Checkpoint};
use smoe_quant::Format;
use smoe_vault::{names, ExpertAct, LayerKind, QkNorm, RopeScaling, Router, Vault};
use std::path::{Path, PathBuf};

const FIXTURES: [&str; 13] = [
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "glm4_moe",
    "deepseek_v3",
    "deepseek_v3_yarn",
    "qwen3_moe_k",
    "qwen3_moe_yarn",
    "minimax_m2",
    "gpt_oss",
    "gpt_oss_mxfp4",
    "glm_moe_dsa",
];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/hf").join(name)
}

fn bf16_opts() -> ShatterOptions {
    ShatterOptions { experts: Format::BF16.into(), dense: Format::BF16, threads: Some(2), ..Default::default() }
}

fn shatter_to(name: &str, opts: &ShatterOptions, dir: &Path) -> Vault {
    let out = dir.join(format!("{name}.smoe"));
    shatter(&fixture(name), &out, opts, &Silent).unwrap_or_else(|e| panic!("{name}: {e}"));
    Vault::open(&out).unwrap()
}

fn cfg_usize(c: &Value, k: &str) -> usize {
    c[k].as_u64().unwrap_or_else(|| panic!("config {k}")) as usize
}

#[test]
fn manifest_matches_config_field_by_field() {
    let dir = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let v = shatter_to(name, &bf16_opts(), dir.path());
        let c: Value = serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap();
        let a = v.architecture();
        assert_eq!(a.family.model_type(), c["model_type"].as_str().unwrap(), "{name}");
        assert_eq!(a.hidden_size, cfg_usize(&c, "hidden_size"), "{name}");
        assert_eq!(a.num_layers, cfg_usize(&c, "num_hidden_layers"), "{name}");
        assert_eq!(a.num_heads, cfg_usize(&c, "num_attention_heads"), "{name}");
        assert_eq!(a.num_kv_heads, cfg_usize(&c, "num_key_value_heads"), "{name}");
        assert_eq!(a.vocab_size, cfg_usize(&c, "vocab_size"), "{name}");
        assert_eq!(a.max_position_embeddings, cfg_usize(&c, "max_position_embeddings"), "{name}");
        assert_eq!(a.norm_eps, c["rms_norm_eps"].as_f64().unwrap(), "{name}");
        assert_eq!(a.tie_word_embeddings, c["tie_word_embeddings"].as_bool().unwrap(), "{name}");
        assert_eq!(a.moe.top_k, cfg_usize(&c, "num_experts_per_tok"), "{name}");
        let theta = c.get("rope_theta").and_then(|t| t.as_f64()).or_else(|| c["rope_parameters"]["rope_theta"].as_f64()).unwrap();
        assert_eq!(a.rope.theta, theta, "{name}");
        match c.get("rope_scaling").filter(|s| !s.is_null()) {
            None => assert_eq!(a.rope.scaling, RopeScaling::None, "{name}"),
            Some(s) => match &a.rope.scaling {
                RopeScaling::Yarn { factor, original_max_position_embeddings, mscale_all_dim, .. } => {
                    assert_eq!(*factor, s["factor"].as_f64().unwrap());
                    assert_eq!(*original_max_position_embeddings, s["original_max_position_embeddings"].as_u64().unwrap() as usize);
                    assert_eq!(*mscale_all_dim, s.get("mscale_all_dim").and_then(|x| x.as_f64()));
                }
                other => panic!("{name}: {other:?}"),
            },
        }
        let family_experts = match name {
            "mixtral" | "minimax_m2" | "gpt_oss" | "gpt_oss_mxfp4" => cfg_usize(&c, "num_local_experts"),
            "glm4_moe" | "deepseek_v3" | "deepseek_v3_yarn" | "glm_moe_dsa" => cfg_usize(&c, "n_routed_experts"),
            _ => cfg_usize(&c, "num_experts"),
        };
        assert_eq!(a.moe.num_experts, family_experts, "{name}");
        let expert_size = match name {
            "mixtral" | "olmoe" | "minimax_m2" | "gpt_oss" | "gpt_oss_mxfp4" => cfg_usize(&c, "intermediate_size"),
            _ => cfg_usize(&c, "moe_intermediate_size"),
        };
        assert_eq!(a.moe.intermediate_size, expert_size, "{name}");
        if let Some(n) = c.get("norm_topk_prob").and_then(|x| x.as_bool()) {
            assert_eq!(a.moe.norm_topk_prob, n, "{name}");
        }
        match name {
            "qwen3_moe" | "qwen3_moe_k" | "qwen3_moe_yarn" => {
                assert_eq!(a.qk_norm, QkNorm::PerHead);
                assert_eq!(a.head_dim, cfg_usize(&c, "head_dim"));
                assert!(!a.qkv_bias && a.moe.shared_experts.is_none());
                assert_eq!(a.moe.router, Router::Softmax);
            }
            "qwen2_moe" => {
                assert!(a.qkv_bias);
                assert_eq!(a.qk_norm, QkNorm::None);
                let s = a.moe.shared_experts.as_ref().unwrap();
                assert_eq!(s.intermediate_size, cfg_usize(&c, "shared_expert_intermediate_size"));
                assert!(s.sigmoid_gate);
            }
            "mixtral" => assert!(a.moe.norm_topk_prob && a.qk_norm == QkNorm::None && !a.qkv_bias),
            "olmoe" => assert_eq!(a.qk_norm, QkNorm::WholeProjection),
            "minimax_m2" => {
                assert_eq!(a.qk_norm, QkNorm::WholeProjection);
                assert_eq!(a.rope.rotary_dim, cfg_usize(&c, "rotary_dim"));
                assert!(a.moe.norm_topk_prob && !a.qkv_bias && a.moe.shared_experts.is_none());
                assert_eq!(a.moe.router, Router::SigmoidGrouped { n_group: 1, topk_group: 1, correction_bias: true });
            }
            "gpt_oss" | "gpt_oss_mxfp4" => {
                assert!(a.qkv_bias && a.o_bias && a.attn_sinks && a.moe.norm_topk_prob);
                assert!(a.moe.router_logit_bias && a.moe.expert_bias && a.moe.router == Router::Softmax);
                assert_eq!(a.moe.expert_act, ExpertAct::ClampedSwiglu { alpha: 1.702, limit: c["swiglu_limit"].as_f64().unwrap() });
                let w = cfg_usize(&c, "sliding_window");
                let types = c["layer_types"].as_array().unwrap();
                let want: Vec<Option<usize>> = types.iter().map(|t| (t == "sliding_attention").then_some(w)).collect();
                assert_eq!(a.attention_windows, want, "{name}");
                assert!(matches!(a.rope.scaling, RopeScaling::Yarn { truncate: false, .. }), "{name}");
            }
            "glm4_moe" => {
                assert_eq!(a.rope.partial_rotary_factor, c["partial_rotary_factor"].as_f64().unwrap());
                assert_eq!(a.rope.rotary_dim, cfg_usize(&c, "head_dim") / 2);
                assert!(a.qkv_bias);
                assert_eq!(a.qk_norm, QkNorm::PerHead);
            }
            _ => {}
        }
        if c.get("n_group").is_some() {
            assert_eq!(
                a.moe.router,
                Router::SigmoidGrouped {
                    n_group: cfg_usize(&c, "n_group"),
                    topk_group: cfg_usize(&c, "topk_group"),
                    correction_bias: true
                }
            );
            assert_eq!(a.moe.routed_scaling_factor, c["routed_scaling_factor"].as_f64().unwrap());
            let s = a.moe.shared_experts.as_ref().unwrap();
            assert_eq!(s.intermediate_size, expert_size * cfg_usize(&c, "n_shared_experts"));
            let k = cfg_usize(&c, "first_k_dense_replace");
            for (l, kind) in a.layers.iter().enumerate() {
                assert_eq!(*kind == LayerKind::Dense, l < k, "{name} layer {l}");
            }
            assert_eq!(a.dense_intermediate_size, cfg_usize(&c, "intermediate_size"));
        } else {
            assert!(a.layers.iter().all(|k| *k == LayerKind::Moe), "{name}");
        }
        if name == "glm_moe_dsa" {
            let sa = a.sparse_attention.as_ref().unwrap();
            assert_eq!(
                (sa.top_k, sa.heads, sa.head_dim),
                (cfg_usize(&c, "index_topk"), cfg_usize(&c, "index_n_heads"), cfg_usize(&c, "index_head_dim"))
            );
            let types: Vec<bool> = c["indexer_types"].as_array().unwrap().iter().map(|t| t == "full").collect();
            assert_eq!(sa.indexer, types);
            let dense: Vec<bool> = c["mlp_layer_types"].as_array().unwrap().iter().map(|t| t == "dense").collect();
            assert_eq!(a.layers.iter().map(|k| *k == LayerKind::Dense).collect::<Vec<_>>(), dense);
        } else {
            assert!(a.sparse_attention.is_none(), "{name}");
        }
        if name.starts_with("deepseek") || name == "glm_moe_dsa" {
            let m = a.mla.as_ref().unwrap();
            assert_eq!(m.q_lora_rank, Some(cfg_usize(&c, "q_lora_rank")));
            assert_eq!(m.kv_lora_rank, cfg_usize(&c, "kv_lora_rank"));
            assert_eq!(m.qk_nope_head_dim, cfg_usize(&c, "qk_nope_head_dim"));
            assert_eq!(m.qk_rope_head_dim, cfg_usize(&c, "qk_rope_head_dim"));
            assert_eq!(m.v_head_dim, cfg_usize(&c, "v_head_dim"));
            assert!(a.rope.interleaved);
        }
        // Text assets and generation defaults come along.
        let m = v.manifest();
        assert!(m.text.chat_template.as_deref().unwrap().contains("<|im_start|>"));
        assert_eq!(m.generation.eos_token_ids, vec![1002, 1000]);
        assert_eq!(m.generation.top_k, Some(20));
        assert_eq!(m.source_config, c);
    }
}

#[test]
fn bf16_round_trip_is_bit_exact() {
    let dir = tempfile::tempdir().unwrap();
    for name in FIXTURES {
        let v = shatter_to(name, &bf16_opts(), dir.path());
        let ckpt = Checkpoint::open(&fixture(name)).unwrap();
        let a = v.architecture().clone();
        if a.family == smoe_vault::Family::GptOss {
            gpt_oss_values_kept(name, &v, &ckpt);
            continue;
        }
        for spec in names::dense_tensors(&a) {
            let src = &ckpt.tensors[&hf::hf_name(a.family, &spec.name)];
            let bytes = v.read_dense(&spec.name).unwrap();
            let expect = src.read_f32().unwrap();
            let entry = v.dense(&spec.name).unwrap();
            let mut got = vec![0f32; expect.len()];
            smoe_quant::dequantize(entry.format, &bytes, &mut got).unwrap();
            assert_eq!(got, expect, "{name} {}", spec.name);
        }
        let mut blob = vec![0u8; v.manifest().experts.blob_size as usize];
        for l in a.moe_layers() {
            for e in 0..a.moe.num_experts {
                v.read_blob(l, e, &mut blob).unwrap();
                for (part, src_name) in v.manifest().experts.parts.iter().zip(hf::hf_expert_names(a.family, l, e)) {
                    assert_eq!(part.format, Format::BF16);
                    let src = &ckpt.tensors[&src_name];
                    // The blob holds the checkpoint's bf16 bytes unchanged.
                    let mut raw = vec![0u8; src.len as usize];
                    use std::os::unix::fs::FileExt;
                    let f = std::fs::File::open(
                        fixture(name).join(
                            serde_json::from_str::<Value>(
                                &std::fs::read_to_string(fixture(name).join("model.safetensors.index.json")).unwrap(),
                            )
                            .unwrap()["weight_map"][&src_name]
                                .as_str()
                                .unwrap(),
                        ),
                    )
                    .unwrap();
                    f.read_exact_at(&mut raw, src.offset).unwrap();
                    assert_eq!(&blob[part.offset as usize..(part.offset + part.len) as usize], &raw[..], "{name} {src_name}");
                }
            }
        }
        v.verify(&mut |_| {}).unwrap();
    }
}

/// gpt-oss's experts are fused (and maybe MXFP4): every tensor of a BF16 vault holds the values
/// the per-expert view of the checkpoint reads (gate/up de-interleaved, transposed to rows of
/// outputs, MXFP4 decoded — exact in bf16).
fn gpt_oss_values_kept(name: &str, v: &Vault, ckpt: &Checkpoint) {
    use smoe_convert::TensorProvider;
    let a = v.architecture();
    let src = smoe_convert::gpt_oss::FusedExperts::new(ckpt, a).unwrap();
    let read = |n: &str, rows: usize, cols: usize| {
        let mut out = vec![0f32; rows * cols];
        src.read_rows(n, 0, rows, &mut out).unwrap();
        out
    };
    for spec in names::dense_tensors(a) {
        let (cols, rows) = (*spec.shape.last().unwrap(), spec.shape[..spec.shape.len() - 1].iter().product::<usize>().max(1));
        let entry = v.dense(&spec.name).unwrap();
        let mut got = vec![0f32; rows * cols];
        smoe_quant::dequantize(entry.format, &v.read_dense(&spec.name).unwrap(), &mut got).unwrap();
        assert_eq!(got, read(&hf::hf_name(a.family, &spec.name), rows, cols), "{name} {}", spec.name);
    }
    let mut blob = vec![0u8; v.manifest().experts.blob_size as usize];
    let shapes = names::expert_part_shapes(a);
    for l in a.moe_layers() {
        for e in 0..a.moe.num_experts {
            v.read_blob(l, e, &mut blob).unwrap();
            for ((part, src_name), [rows, cols]) in v.manifest().experts.parts.iter().zip(hf::hf_expert_names(a.family, l, e)).zip(shapes) {
                let mut got = vec![0f32; rows * cols];
                smoe_quant::dequantize(part.format, &blob[part.offset as usize..(part.offset + part.len) as usize], &mut got).unwrap();
                assert_eq!(got, read(&src_name, rows, cols), "{name} {src_name}");
            }
        }
    }
    v.verify(&mut |_| {}).unwrap();
}

/// Relative RMS error of every expert matrix after a round trip through `format`.
fn expert_error(name: &str, format: Format, dir: &Path) -> (f64, Format) {
    let opts = ShatterOptions { experts: format.into(), dense: Format::Q8_0, threads: Some(2), ..Default::default() };
    let v = shatter_to(name, &opts, dir);
    let ckpt = Checkpoint::open(&fixture(name)).unwrap();
    let a = v.architecture().clone();
    let mut blob = vec![0u8; v.manifest().experts.blob_size as usize];
    let (mut err, mut norm) = (0f64, 0f64);
    let mut used = Format::F32;
    for l in a.moe_layers() {
        for e in 0..a.moe.num_experts {
            v.read_blob(l, e, &mut blob).unwrap();
            for (part, src) in v.manifest().experts.parts.iter().zip(hf::hf_expert_names(a.family, l, e)) {
                used = part.format;
                let x = ckpt.tensors[&src].read_f32().unwrap();
                let mut y = vec![0f32; x.len()];
                smoe_quant::dequantize(part.format, &blob[part.offset as usize..(part.offset + part.len) as usize], &mut y).unwrap();
                for (a, b) in x.iter().zip(&y) {
                    err += ((a - b) as f64).powi(2);
                    norm += (*a as f64).powi(2);
                }
            }
        }
    }
    ((err / norm).sqrt(), used)
}

#[test]
fn quantized_experts_within_documented_bounds() {
    let dir = tempfile::tempdir().unwrap();
    // qwen3_moe_k has 256-wide rows, so K-quants are used as asked; bounds from docs/quantization.md.
    for (format, bound) in [(Format::Q8_0, 0.01), (Format::Q6_K, 0.03), (Format::Q4_K, 0.10)] {
        let (e, used) = expert_error("qwen3_moe_k", format, dir.path());
        assert_eq!(used, format);
        assert!(e < bound, "{format}: {e}");
    }
    // 64-wide rows cannot hold Q4_K: it falls back to Q5_0, and says so.
    let (e, used) = expert_error("qwen3_moe", Format::Q4_K, dir.path());
    assert_eq!(used, Format::Q5_0);
    assert!(e < 0.07, "{e}");
    let v = Vault::open(dir.path().join("qwen3_moe.smoe")).unwrap();
    assert!(
        v.manifest().notes.iter().any(|n| n.contains("Q4_K does not fit rows of 64") && n.contains("Q5_0")),
        "{:?}",
        v.manifest().notes
    );
}

fn copy_fixture(name: &str, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn bad_checkpoints_fail_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.smoe");
    // Unsupported architecture.
    let ck = dir.path().join("llama");
    copy_fixture("qwen3_moe", &ck);
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(ck.join("config.json")).unwrap()).unwrap();
    c["model_type"] = "llama".into();
    std::fs::write(ck.join("config.json"), c.to_string()).unwrap();
    let e = shatter(&ck, &out, &bf16_opts(), &Silent).unwrap_err().to_string();
    assert!(e.contains("'llama' is not supported") && e.contains("qwen3_moe") && e.contains("deepseek_v3"), "{e}");
    // Unsupported rope scaling is refused, not ignored.
    c["model_type"] = "qwen3_moe".into();
    c["rope_scaling"] = serde_json::json!({"rope_type": "longrope", "factor": 4.0});
    std::fs::write(ck.join("config.json"), c.to_string()).unwrap();
    let e = shatter(&ck, &out, &bf16_opts(), &Silent).unwrap_err().to_string();
    assert!(e.contains("longrope"), "{e}");
    // gpt-oss: layer types that do not fit the layers, or slide without a window, and fused
    // MXFP4 experts of another shape than the config says.
    let ck = dir.path().join("gpt_oss");
    copy_fixture("gpt_oss_mxfp4", &ck);
    let good: Value = serde_json::from_str(&std::fs::read_to_string(ck.join("config.json")).unwrap()).unwrap();
    for (change, want) in [
        (serde_json::json!({"layer_types": ["full_attention"]}), "1 layer_types for 4 layers"),
        (
            serde_json::json!({"layer_types": ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]}),
            "chunked_attention",
        ),
        (serde_json::json!({"sliding_window": null}), "without sliding_window"),
        (serde_json::json!({"intermediate_size": 64}), "gate_up_proj_blocks"),
    ] {
        let mut c = good.clone();
        for (k, v) in change.as_object().unwrap() {
            c[k] = v.clone();
        }
        std::fs::write(ck.join("config.json"), c.to_string()).unwrap();
        let e = shatter(&ck, &out, &bf16_opts(), &Silent).unwrap_err().to_string();
        assert!(e.contains(want), "{change}: {e}");
    }
    // Missing tensors are listed: drop a shard.
    let ck = dir.path().join("missing");
    copy_fixture("qwen3_moe", &ck);
    std::fs::remove_file(ck.join("model-00003-of-00008.safetensors")).unwrap();
    let idx: Value = serde_json::from_str(&std::fs::read_to_string(ck.join("model.safetensors.index.json")).unwrap()).unwrap();
    let mut map = idx["weight_map"].as_object().unwrap().clone();
    let lost: Vec<String> =
        map.iter().filter(|(_, f)| f.as_str() == Some("model-00003-of-00008.safetensors")).map(|(k, _)| k.clone()).collect();
    map.retain(|_, f| f.as_str() != Some("model-00003-of-00008.safetensors"));
    std::fs::write(ck.join("model.safetensors.index.json"), serde_json::json!({"weight_map": map}).to_string()).unwrap();
    let e = shatter(&ck, &out, &bf16_opts(), &Silent).unwrap_err().to_string();
    assert!(e.contains("missing") && e.contains(&lost[0]), "{e}");
    // Unexpected tensors are listed: claim fewer experts than the checkpoint has.
    let ck = dir.path().join("extra");
    copy_fixture("qwen3_moe", &ck);
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(ck.join("config.json")).unwrap()).unwrap();
    c["num_experts"] = 4.into();
    std::fs::write(ck.join("config.json"), c.to_string()).unwrap();
    let e = shatter(&ck, &out, &bf16_opts(), &Silent).unwrap_err().to_string();
    assert!(e.contains("unexpected") && e.contains("mlp.experts.7"), "{e}");
    // Shape mismatch.
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(fixture("qwen3_moe").join("config.json")).unwrap()).unwrap();
    c["moe_intermediate_size"] = 48.into();
    std::fs::write(ck.join("config.json"), c.to_string()).unwrap();
    let e = shatter(&ck, &out, &bf16_opts(), &Silent).unwrap_err().to_string();
    assert!(e.contains("has shape") && e.contains("48"), "{e}");
    // Truncated shard.
    let ck = dir.path().join("trunc");
    copy_fixture("qwen3_moe", &ck);
    let p = ck.join("model-00002-of-00008.safetensors");
    let b = std::fs::read(&p).unwrap();
    std::fs::write(&p, &b[..b.len() / 2]).unwrap();
    let e = shatter(&ck, &out, &bf16_opts(), &Silent).unwrap_err().to_string();
    assert!(e.contains("model-00002-of-00008.safetensors"), "{e}");
    assert!(!out.exists());
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains(".smoe"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn interrupted_conversion_leaves_no_vault() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.smoe");
    let opts = ShatterOptions { fail_after_blobs: Some(5), ..bf16_opts() };
    let e = shatter(&fixture("qwen3_moe"), &out, &opts, &Silent).unwrap_err();
    assert!(e.to_string().contains("injected"));
    assert!(!out.exists());
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "temporary file left behind");
}

/// DeepSeek-V4's config.json in the hub's spellings, field by field: per-layer compression
/// from `compress_ratios`, hash routing from `num_hash_layers`, the rotated dims from
/// `qk_rope_head_dim`, the compressed layers' YaRN from `rope_scaling` (the sliding layers'
/// RoPE stays plain), and every dense tensor bit for bit, the I64 hash table included.
#[test]
fn deepseek_v4_manifest_matches_config_and_tensors() {
    use smoe_vault::Compression;
    let dir = tempfile::tempdir().unwrap();
    let name = "deepseek_v4";
    let v = shatter_to(name, &bf16_opts(), dir.path());
    let c: Value = serde_json::from_str(&std::fs::read_to_string(fixture(name).join("config.json")).unwrap()).unwrap();
    let a = v.architecture();
    let ca = a.compressed_attention.as_ref().unwrap();
    let kinds: Vec<Compression> = c["compress_ratios"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| match r.as_u64().unwrap() {
            0 => Compression::None,
            4 => Compression::Sparse { rate: 4 },
            _ => Compression::Heavy { rate: 128 },
        })
        .collect();
    assert_eq!(ca.compression, kinds);
    let hashed = cfg_usize(&c, "num_hash_layers");
    assert_eq!(a.moe.hash_layers, (0..a.num_layers).map(|l| l < hashed).collect::<Vec<_>>());
    assert_eq!((ca.window, ca.o_groups, ca.o_lora_rank, ca.q_lora_rank), (16, 2, 16, 32));
    assert_eq!((ca.index_heads, ca.index_head_dim, ca.index_top_k), (8, 16, 8));
    assert_eq!((a.rope.rotary_dim, ca.compress_rope.rotary_dim), (8, 8));
    assert_eq!((a.rope.theta, ca.compress_rope.theta), (10000.0, 160000.0));
    assert_eq!(a.rope.scaling, RopeScaling::None);
    match &ca.compress_rope.scaling {
        RopeScaling::Yarn { factor, original_max_position_embeddings, attention_factor, .. } => {
            assert_eq!((*factor, *original_max_position_embeddings, *attention_factor), (4.0, 64, Some(1.0)));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(a.hyper_connections.as_ref().unwrap().mult, 4);
    assert_eq!(a.moe.router, Router::SqrtSoftplus { correction_bias: true });
    assert_eq!(a.moe.expert_act, ExpertAct::ClampedSilu { limit: 1.0 });
    let ckpt = Checkpoint::open(&fixture(name)).unwrap();
    for spec in names::dense_tensors(a) {
        let expect = ckpt.tensors[&hf::hf_name(a.family, &spec.name)].read_f32().unwrap();
        let entry = v.dense(&spec.name).unwrap();
        let mut got = vec![0f32; expect.len()];
        smoe_quant::dequantize(entry.format, &v.read_dense(&spec.name).unwrap(), &mut got).unwrap();
        assert_eq!(got, expect, "{}", spec.name);
    }
}
