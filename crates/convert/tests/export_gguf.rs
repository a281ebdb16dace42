//! `smoe export-gguf` against llama.cpp's own converter: exporting a BF16 vault of each fixture
//! gives the tensors, shapes, types and bytes of `testdata/gguf/<family>.bf16.gguf` (written by
//! convert_hf_to_gguf.py), and the architecture metadata llama.cpp reads.

use smoe_convert::gguf::export::export;
use smoe_convert::{shatter, ShatterOptions, Silent};
use smoe_formats::gguf::Gguf;
use smoe_quant::Format;
use std::os::unix::fs::FileExt;
use std::path::Path;

fn root() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata")
}

fn bytes(g: &Gguf, name: &str) -> Vec<u8> {
    let t = g.tensor(name).unwrap();
    let mut b = vec![0u8; t.len().unwrap() as usize];
    std::fs::File::open(&g.paths[t.file]).unwrap().read_exact_at(&mut b, t.offset).unwrap();
    b
}

#[test]
fn bf16_export_matches_llama_cpp_converter() {
    let dir = tempfile::tempdir().unwrap();
    // gpt-oss's hub MXFP4 experts stay MXFP4 in the converter's file, as in the vault; Qwen3.5's
    // value heads are reordered into llama.cpp's tiled order, and its `ssm_a` is `-exp(A_log)`
    // computed by torch (compared within an ulp below).
    let experts_of = |name: &str| if name == "gpt_oss_mxfp4" { Format::MXFP4 } else { Format::BF16 };
    for name in [
        "qwen3_moe",
        "qwen3_moe_yarn",
        "qwen2_moe",
        "mixtral",
        "olmoe",
        "glm4_moe",
        "deepseek_v3",
        "deepseek_v3_yarn",
        "minimax_m2",
        "glm_moe_dsa",
        "gpt_oss_mxfp4",
        "qwen3_5_moe",
    ] {
        let vault = dir.path().join(format!("{name}.smoe"));
        let opts = ShatterOptions { experts: experts_of(name).into(), dense: Format::BF16, threads: Some(2), ..Default::default() };
        shatter(&root().join("hf").join(name), &vault, &opts, &Silent).unwrap();
        let out = dir.path().join(format!("{name}.gguf"));
        export(&vault, &out, &Silent).unwrap();
        let ours = Gguf::open(&out).unwrap();
        let theirs = Gguf::open(&root().join("gguf").join(format!("{name}.bf16.gguf"))).unwrap();
        assert_eq!(ours.tensors.len(), theirs.tensors.len(), "{name}");
        for t in &theirs.tensors {
            let o = ours.tensor(&t.name).unwrap_or_else(|| panic!("{name}: {} missing", t.name));
            let (x, mut y) = (bytes(&ours, &t.name), bytes(&theirs, &t.name));
            // The vault keeps the Gated DeltaNet's beta and alpha projections exact (they feed
            // a sigmoid and a decay); the converter wrote them BF16. Same numbers, wider type.
            let exact = t.name.ends_with("ssm_alpha.weight") || t.name.ends_with("ssm_beta.weight");
            if exact && t.ggml_type == Format::BF16.ggml_id() {
                y = y.chunks_exact(2).flat_map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16).to_le_bytes()).collect();
                assert_eq!((&o.dims, o.ggml_type), (&t.dims, Format::F32.ggml_id()), "{name} {}", t.name);
            } else {
                assert_eq!((&o.dims, o.ggml_type), (&t.dims, t.ggml_type), "{name} {}", t.name);
            }
            if t.name.ends_with("ssm_a") {
                let f = |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
                for (p, q) in f(&x).into_iter().zip(f(&y)) {
                    assert!((p - q).abs() <= f32::EPSILON * q.abs(), "{name}: {} {p} vs {q}", t.name);
                }
            } else {
                assert!(x == y, "{name}: {} differs", t.name);
            }
        }
        for (k, v) in &theirs.meta {
            let skip = k.starts_with("general.name") || k.starts_with("general.size_label") || k.ends_with("layer_norm_rms_epsilon");
            if !skip {
                assert_eq!(ours.get(k), Some(v), "{name}: metadata {k}");
            }
        }
    }
}

/// `--mix` writes the file llama.cpp's own quantizer writes. testdata/gguf-kquant holds
/// `llama-quantize`'s Q4_K_M and Q2_K files of the qwen3_moe_k fixture (made from the same
/// bf16 weights): shattered with the mix and exported, every tensor has llama.cpp's type and
/// shape, and, since smoe's block encoders are ggml's reference ones (crates/quant's golden
/// test), the same bytes. Q4_K_M's down projections differ between the two layers (Q4_K, then
/// Q6_K), so the vault lists per-layer parts; `synth --gguf` with the mix gives the same types.
#[test]
fn mixes_write_the_files_llama_cpps_quantizer_writes() {
    use smoe_convert::LlamaFileType;
    let dir = tempfile::tempdir().unwrap();
    for (mix, mixed_layers) in [(LlamaFileType::Q4_K_M, true), (LlamaFileType::Q2_K, false)] {
        let theirs = Gguf::open(&root().join("gguf-kquant").join(format!("qwen3_moe_k.{mix}.gguf"))).unwrap();
        let vault = dir.path().join(format!("{mix}.smoe"));
        let opts = ShatterOptions { mix: Some(mix), threads: Some(2), ..Default::default() };
        shatter(&root().join("hf/qwen3_moe_k"), &vault, &opts, &Silent).unwrap();
        let features = smoe_vault::Vault::open(&vault).unwrap().manifest().required_features.clone();
        assert_eq!(features.iter().any(|f| f == smoe_vault::manifest::LAYER_EXPERT_PARTS), mixed_layers, "{mix}: {features:?}");
        let out = dir.path().join(format!("{mix}.gguf"));
        export(&vault, &out, &Silent).unwrap();
        let ours = Gguf::open(&out).unwrap();
        assert_eq!(ours.get("general.file_type"), theirs.get("general.file_type"), "{mix}");
        assert_eq!(ours.tensors.len(), theirs.tensors.len(), "{mix}");
        for t in &theirs.tensors {
            let o = ours.tensor(&t.name).unwrap_or_else(|| panic!("{mix}: {} missing", t.name));
            let what = format!("{mix} {}: ours {} {:?}", t.name, smoe_formats::gguf::ggml_type_name(o.ggml_type), o.dims);
            assert_eq!(
                (&o.dims, o.ggml_type),
                (&t.dims, t.ggml_type),
                "{what}, llama.cpp's {}",
                smoe_formats::gguf::ggml_type_name(t.ggml_type)
            );
            assert!(bytes(&ours, &t.name) == bytes(&theirs, &t.name), "{what}: other bytes");
        }
        // Straight to GGUF, random blocks: the same types.
        let cfg: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(root().join("hf/qwen3_moe_k/config.json")).unwrap()).unwrap();
        let synth_opts = smoe_convert::synth::SynthOptions {
            layers: None,
            seed: 1,
            shard_bytes: 1 << 30,
            tokenizer_json: None,
            random_blocks: true,
            router_spread: 0.0,
        };
        let straight = dir.path().join(format!("{mix}.synth.gguf"));
        smoe_convert::synth::synth_gguf_from_config(cfg, &straight, &synth_opts, &opts, &Silent).unwrap();
        let s = Gguf::open(&straight).unwrap();
        for t in &theirs.tensors {
            let o = s.tensor(&t.name).unwrap_or_else(|| panic!("synth {mix}: {} missing", t.name));
            assert_eq!(o.ggml_type, t.ggml_type, "synth {mix} {}", t.name);
        }
    }
}
