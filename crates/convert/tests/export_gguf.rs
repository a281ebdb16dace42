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
        let opts = ShatterOptions {
            experts: experts_of(name).into(),
            dense: Format::BF16,
            threads: Some(2),
            zero_experts: false,
            fail_after_blobs: None,
        };
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
