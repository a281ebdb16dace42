//! GGUF files written by llama.cpp's own converter: imported into a vault and run in place,
//! both against transformers (bf16 files against the fixture's reference, q8_0 files against
//! transformers on exactly the Q8_0 round trip the converter applied). And the round trip
//! vault → `export-gguf` → import gives back identical tensors.

mod common;
use common::*;
use smoe_engine::{open_cpu, score, CacheSize, OpenOptions, Precision, ScoreMode};
use smoe_quant::Format;
use std::path::{Path, PathBuf};

/// llama.cpp's converter made a bf16 and a q8_0 file of each (glm4_moe and glm_moe_dsa with the
/// workarounds of `testdata/make_gguf_fixtures.py`; see the fixtures README).
const FAMILIES: [&str; 10] = [
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
];

fn gguf(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/gguf").join(name)
}

fn reference(family: &str, kind: &str) -> std::collections::HashMap<String, Tensor> {
    match kind {
        "bf16" => read_safetensors(&fixture(family).join("reference.safetensors")),
        _ => read_safetensors(&gguf(&format!("{family}.q8_0.reference.safetensors"))),
    }
}

fn engine(path: &Path, cache: CacheSize) -> smoe_engine::Engine<smoe_engine::CpuBackend> {
    let opts = OpenOptions { precision: Precision::Reference, cache, ..Default::default() };
    open_cpu(path, &opts).unwrap_or_else(|e| panic!("{}: {e}", path.display())).0
}

fn check(model: &smoe_engine::Model<smoe_engine::CpuBackend>, r: &std::collections::HashMap<String, Tensor>, what: &str) {
    // llama.cpp's converter writes OLMoE's RMS-norm epsilon as a constant 1e-5 (the real
    // OLMoE's value); this fixture's config says 1e-6, so its GGUF describes a slightly
    // different model, and the logits differ by a few 1e-4. Everything else is held to 1e-4.
    let tol = if model.arch().family == smoe_vault::Family::Olmoe {
        assert_eq!(model.arch().norm_eps, 1e-5, "the converter's constant");
        2e-3
    } else {
        1e-4
    };
    for tag in ["chat", "long"] {
        let input: Vec<u32> = r[&format!("{tag}.input_ids")].i32().iter().map(|&x| x as u32).collect();
        let expect = r[&format!("{tag}.logits")].f32();
        for mode in [ScoreMode::Prefill, ScoreMode::Decode] {
            let out = score(model, &input, mode, 64, false).unwrap();
            let e = rel_err(&out.logits, expect);
            assert!(e < tol, "{what} {tag} {mode:?}: logits rel err {e:.2e}");
        }
    }
}

#[test]
fn llama_cpp_ggufs_import_and_run_in_place() {
    let dir = tempfile::tempdir().unwrap();
    for family in FAMILIES {
        for kind in ["bf16", "q8_0"] {
            let file = gguf(&format!("{family}.{kind}.gguf"));
            // Every family's files are committed: a missing one fails, it is not skipped.
            assert!(
                file.exists(),
                "missing fixture {}: testdata/make_gguf_fixtures.py {family} makes it (testdata/README.fixtures.md)",
                file.display()
            );
            let r = reference(family, kind);
            // In place: experts read straight from the stacked tensors, through a small cache.
            let e = engine(&file, CacheSize::Experts(4));
            check(&e.model, &r, &format!("{family}.{kind} in place"));
            // Shattered: a vault with the same blocks.
            let out = dir.path().join(format!("{family}.{kind}.smoe"));
            smoe_convert::gguf::import::shatter_gguf(&file, &out, &smoe_formats::Silent).unwrap();
            smoe_vault::Vault::open(&out).unwrap().verify(&mut |_| {}).unwrap();
            let e = engine(&out, CacheSize::Resident);
            check(&e.model, &r, &format!("{family}.{kind} shattered"));
        }
    }
}

/// Qwen3-Next and Qwen3.5-MoE as llama.cpp's converter writes them (bf16 only: see the
/// fixtures README): its fused `attn_q` (query and gate per head) and qwen3next's `ssm_ba`
/// taken apart, `ssm_a` (`-exp(A_log)`) turned back into `A_log`, the layer kinds from
/// `recurrent_layers` (qwen3_next's file says `full_attention_interval` 4, which is wrong for
/// it), and qwen35moe's value heads numbered across key heads; in place and shattered, against
/// transformers.
#[test]
fn llama_cpp_qwen3_next_and_qwen3_5_ggufs_import_and_run_in_place() {
    let dir = tempfile::tempdir().unwrap();
    for family in ["qwen3_next", "qwen3_5_moe"] {
        let file = gguf(&format!("{family}.bf16.gguf"));
        let r = reference(family, "bf16");
        let e = engine(&file, CacheSize::Experts(4));
        let la = e.model.arch().linear_attention.clone().unwrap();
        assert_eq!(la.layers, [true, false, true, false], "{family}");
        assert_eq!(la.tiled_value_heads, family == "qwen3_5_moe");
        check(&e.model, &r, &format!("{family}.bf16 in place"));
        let out = dir.path().join(format!("{family}.smoe"));
        smoe_convert::gguf::import::shatter_gguf(&file, &out, &smoe_formats::Silent).unwrap();
        check(&engine(&out, CacheSize::Resident).model, &r, &format!("{family}.bf16 shattered"));
    }
}

/// gpt-oss as llama.cpp's converter writes the hub's MXFP4 checkpoint (`--outtype bf16`: the
/// experts' MXFP4 blocks repacked to ggml's nibble order, the rest bf16): in place and
/// shattered against transformers, and its expert blocks byte for byte those smoe's own
/// converter copies from the hub's `*_blocks`/`*_scales`.
#[test]
fn llama_cpp_gpt_oss_mxfp4_gguf_imports_and_runs_in_place() {
    let file = gguf("gpt_oss_mxfp4.bf16.gguf");
    let r = reference("gpt_oss_mxfp4", "bf16");
    check(&engine(&file, CacheSize::Experts(4)).model, &r, "gpt_oss_mxfp4.bf16 in place");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("gpt_oss.smoe");
    smoe_convert::gguf::import::shatter_gguf(&file, &out, &smoe_formats::Silent).unwrap();
    check(&engine(&out, CacheSize::Resident).model, &r, "gpt_oss_mxfp4.bf16 shattered");
    // The weight formats a backend is asked about before a load (`backend_lacks`): the experts'
    // MXFP4 as stored, each format once; the CPU reads them all.
    for path in [&file, &out] {
        let sizes = smoe_engine::model_sizes(path).unwrap();
        let f = &sizes.formats;
        assert!(f.contains(&Format::MXFP4) && f.contains(&Format::F32), "{f:?}");
        assert!(f.windows(2).all(|w| w[0] != w[1]), "{f:?}");
        assert_eq!(smoe_engine::backend_lacks(&sizes.arch, f, &smoe_engine::CpuBackend::new(Precision::Reference)), None);
    }
    let (from_gguf, from_hub) =
        (smoe_vault::Vault::open(&out).unwrap(), smoe_vault::Vault::open(vault("gpt_oss_mxfp4", Format::MXFP4, Format::BF16)).unwrap());
    let parts = &from_gguf.manifest().experts.parts;
    assert!(parts.iter().all(|p| p.format == Format::MXFP4), "{parts:?}");
    let a = from_gguf.architecture();
    let blob = |v: &smoe_vault::Vault, l: usize, e: usize| {
        let mut b = vec![0u8; v.manifest().experts.blob_size as usize];
        v.read_blob(l, e, &mut b).unwrap();
        v.manifest().experts.parts.iter().map(|p| b[p.offset as usize..(p.offset + p.len) as usize].to_vec()).collect::<Vec<_>>()
    };
    for l in a.moe_layers() {
        for e in 0..a.moe.num_experts {
            assert_eq!(blob(&from_gguf, l, e), blob(&from_hub, l, e), "layer {l} expert {e}");
        }
    }
}

/// A split set written by llama.cpp's own `llama-gguf-split` (testdata/gguf-split: the
/// qwen3_moe Q8_0 fixture in parts of at most 16 tensors, so experts, attention and the
/// embedding land in different files): opened by its first part, in place and shattered, it
/// matches transformers as the single file does, and gives the single file's logits exactly.
#[test]
fn llama_cpp_split_sets_import_and_run_in_place() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/gguf-split");
    let first = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().ends_with("-00001-of-00004.gguf"))
        .expect("the first part");
    let r = reference("qwen3_moe", "q8_0");
    let whole = engine(&gguf("qwen3_moe.q8_0.gguf"), CacheSize::Resident);
    let split = engine(&first, CacheSize::Experts(4));
    check(&split.model, &r, "split set in place");
    let ids: Vec<u32> = r["long.input_ids"].i32().iter().map(|&x| x as u32).collect();
    let a = score(&whole.model, &ids, ScoreMode::Prefill, 64, false).unwrap().logits;
    let b = score(&split.model, &ids, ScoreMode::Prefill, 64, false).unwrap().logits;
    assert_eq!(a, b, "a split set computes exactly what the single file does");
    let out = tempfile::tempdir().unwrap();
    let vault = out.path().join("split.smoe");
    smoe_convert::gguf::import::shatter_gguf(&first, &vault, &smoe_formats::Silent).unwrap();
    check(&engine(&vault, CacheSize::Resident).model, &r, "split set shattered");
    // A missing part is named.
    let lonely = out.path().join("m-00001-of-00004.gguf");
    std::fs::copy(&first, &lonely).unwrap();
    let e = open_cpu(&lonely, &OpenOptions::default()).err().expect("refused").to_string();
    assert!(e.contains("m-00002-of-00004.gguf"), "{e}");
}

/// A GGUF file's metadata, as the writer takes it.
type Meta = Vec<(String, smoe_formats::gguf::Value)>;

/// A copy of the GGUF `src` at `dst` with its metadata changed by `edit` (tensors as they are).
fn with_metadata(src: &Path, dst: &Path, edit: impl FnOnce(&mut Meta)) {
    use std::os::unix::fs::FileExt;
    let g = smoe_formats::gguf::Gguf::open(src).unwrap();
    let mut meta: Vec<_> = g.meta.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    edit(&mut meta);
    let decls: Vec<_> = g.tensors.iter().map(|t| (t.name.clone(), t.dims.clone(), t.ggml_type, t.len().unwrap())).collect();
    let w = smoe_convert::gguf::Writer::create(dst, &meta, &decls).unwrap();
    let f = std::fs::File::open(src).unwrap();
    for (i, d) in decls.iter().enumerate() {
        let mut b = vec![0u8; d.3 as usize];
        f.read_exact_at(&mut b, g.tensors[i].offset).unwrap();
        w.write_at(i, 0, &b).unwrap();
    }
    w.finish().unwrap();
}

/// GLM-5 from llama.cpp's glm-dsa file: the architecture is exactly the one read from the
/// checkpoint's config.json (indexer heads, width, top-k and the full/shared layers from
/// `glm-dsa.attention.indexer.types`); without that key llama.cpp's own rule applies (the
/// formats crate's unit tests check the rule itself); a missing or malformed indexer key, or an
/// indexer the layer types call for and the file lacks, is an error naming it, not a panic.
#[test]
fn llama_cpp_glm_dsa_gguf_reads_glm5s_architecture() {
    use smoe_formats::gguf::{GgufModel, Value};
    let hf = smoe_formats::hf::architecture_from_config(&smoe_formats::hf::read_json(&fixture("glm_moe_dsa").join("config.json")).unwrap())
        .unwrap();
    assert_eq!(hf.sparse_attention.as_ref().unwrap().indexer, [true, true, false, true]);
    for kind in ["bf16", "q8_0"] {
        let m = GgufModel::open(&gguf(&format!("glm_moe_dsa.{kind}.gguf"))).unwrap();
        assert_eq!(m.arch, hf, "{kind}");
        assert!(m.notes.is_empty(), "{kind}: every tensor used: {:?}", m.notes);
    }
    let dir = tempfile::tempdir().unwrap();
    let src = gguf("glm_moe_dsa.bf16.gguf");
    let types = "glm-dsa.attention.indexer.types";
    let edited = |name: &str, edit: &dyn Fn(&mut Meta)| {
        let p = dir.path().join(name);
        with_metadata(&src, &p, |m| edit(m));
        GgufModel::open(&p).map(|m| m.arch.sparse_attention.unwrap().indexer)
    };
    let set_types = |v: Value| move |m: &mut Meta| m.iter_mut().filter(|(k, _)| k == types).for_each(|(_, x)| *x = v.clone());
    // Integers, as llama.cpp's loader also takes them.
    let ints = edited("int-types.gguf", &set_types(Value::Array([1u8, 1, 0, 1].map(Value::U8).to_vec())));
    assert_eq!(ints.unwrap(), [true, true, false, true]);
    // No types: llama.cpp's rule makes layer 2 full both for GLM-5/5.1 (under 1M positions,
    // every layer) and for GLM-5.2 (1M: layers 0, 1, 2, 6, ...), and this file has no indexer
    // there, which is named.
    let no_types = |m: &mut Meta| m.retain(|(k, _)| k != types);
    let e = edited("no-types.gguf", &no_types).unwrap_err().to_string();
    assert!(e.contains("blk.2.indexer.attn_q_b.weight"), "{e}");
    let e = edited("no-types-1m.gguf", &|m| {
        no_types(m);
        m.iter_mut().filter(|(k, _)| k == "glm-dsa.context_length").for_each(|(_, v)| *v = Value::U32(1 << 20));
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("blk.2.indexer.attn_q_b.weight"), "{e}");
    let refused = |name: &str, edit: &dyn Fn(&mut Meta), expect: &str| {
        let e = edited(name, edit).err().unwrap_or_else(|| panic!("{name} must be refused")).to_string();
        assert!(e.contains(expect), "{name}: {e}");
    };
    refused("no-heads.gguf", &|m| m.retain(|(k, _)| k != "glm-dsa.attention.indexer.head_count"), "glm-dsa.attention.indexer.head_count");
    refused("short-types.gguf", &set_types(Value::Array(vec![Value::Bool(true); 3])), "3 entries for 4 layers");
    refused("first-shared.gguf", &set_types(Value::Array(vec![Value::Bool(false); 4])), "the first layer shares");
}

#[test]
fn export_then_import_gives_identical_tensors() {
    let dir = tempfile::tempdir().unwrap();
    for (family, experts) in [
        ("qwen3_moe_k", Format::Q4_K),
        ("mixtral", Format::Q8_0),
        ("deepseek_v3", Format::Q8_0),
        ("glm4_moe", Format::Q8_0),
        ("glm_moe_dsa", Format::Q8_0),
    ] {
        let src = vault(family, experts, Format::Q8_0);
        let g = dir.path().join(format!("{family}.gguf"));
        smoe_convert::gguf::export::export(&src, &g, &smoe_formats::Silent).unwrap();
        let back = dir.path().join(format!("{family}.back.smoe"));
        smoe_convert::gguf::import::shatter_gguf(&g, &back, &smoe_formats::Silent).unwrap();
        let (a, b) = (smoe_vault::Vault::open(&src).unwrap(), smoe_vault::Vault::open(&back).unwrap());
        assert_eq!(a.architecture(), b.architecture(), "{family}: architecture");
        for d in &a.manifest().dense {
            let e = b.dense(&d.name).unwrap_or_else(|| panic!("{family}: {} missing", d.name));
            assert_eq!((d.format, &d.shape), (e.format, &e.shape), "{family}: {}", d.name);
            assert!(a.read_dense(&d.name).unwrap() == b.read_dense(&d.name).unwrap(), "{family}: {} differs", d.name);
        }
        let arch = a.architecture();
        let mut x = vec![0u8; a.manifest().experts.blob_size as usize];
        let mut y = vec![0u8; b.manifest().experts.blob_size as usize];
        for l in arch.moe_layers() {
            for e in 0..arch.moe.num_experts {
                a.read_blob(l, e, &mut x).unwrap();
                b.read_blob(l, e, &mut y).unwrap();
                assert!(x == y, "{family}: layer {l} expert {e} blob differs");
            }
        }
    }
}

/// Qwen3-Next exported for llama.cpp (`attn_q` and `ssm_ba` fused back, `ssm_a` as
/// `-exp(A_log)`, `recurrent_layers`) imports back to the same tensors (`A_log` through exp
/// and log: within a few ulps) and, from a BF16 vault, runs in place as transformers does.
#[test]
fn qwen3_next_exports_for_llama_cpp_and_imports_back() {
    let dir = tempfile::tempdir().unwrap();
    for (experts, dense) in [(Format::Q8_0, Format::Q8_0), (Format::BF16, Format::BF16)] {
        let src = vault("qwen3_next", experts, dense);
        let g = dir.path().join(format!("qwen3_next.{dense}.gguf"));
        smoe_convert::gguf::export::export(&src, &g, &smoe_formats::Silent).unwrap();
        let back = dir.path().join(format!("qwen3_next.{dense}.back.smoe"));
        smoe_convert::gguf::import::shatter_gguf(&g, &back, &smoe_formats::Silent).unwrap();
        let (a, b) = (smoe_vault::Vault::open(&src).unwrap(), smoe_vault::Vault::open(&back).unwrap());
        assert_eq!(a.architecture(), b.architecture());
        for d in &a.manifest().dense {
            let e = b.dense(&d.name).unwrap_or_else(|| panic!("{} missing", d.name));
            assert_eq!((d.format, &d.shape), (e.format, &e.shape), "{}", d.name);
            let (x, y) = (a.read_dense(&d.name).unwrap(), b.read_dense(&d.name).unwrap());
            if d.name.ends_with("lin.a_log") {
                let f = |b: &[u8]| b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect::<Vec<_>>();
                for (p, q) in f(&x).iter().zip(f(&y)) {
                    assert!((p - q).abs() <= 4.0 * f32::EPSILON * p.abs().max(1.0), "{}: {p} vs {q}", d.name);
                }
            } else {
                assert!(x == y, "{} differs", d.name);
            }
        }
        if dense == Format::BF16 {
            check(&engine(&g, CacheSize::Experts(4)).model, &reference("qwen3_next", "bf16"), "qwen3_next exported, in place");
        }
    }
}

/// gpt-oss (MXFP4 experts, as the hub ships them) and Qwen3.5 (value heads reordered into
/// llama.cpp's tiled order on the way out) exported for llama.cpp run in place with the vault's
/// logits: the same blocks, the heads only renumbered (Qwen3.5's output projection then sums
/// its inputs in another order, hence a tolerance, not bits).
#[test]
fn gpt_oss_and_qwen3_5_export_and_run_as_their_vaults() {
    let dir = tempfile::tempdir().unwrap();
    // The fixture's 16-wide value heads are narrower than a Q8_0 block, which a column reorder
    // cannot split: Qwen3.5's dense part stays 16-bit here (at the real 128 it can be Q8_0).
    for (family, experts, dense) in [("gpt_oss_mxfp4", Format::MXFP4, Format::Q8_0), ("qwen3_5_moe", Format::Q8_0, Format::BF16)] {
        let src = vault(family, experts, dense);
        let g = dir.path().join(format!("{family}.gguf"));
        smoe_convert::gguf::export::export(&src, &g, &smoe_formats::Silent).unwrap();
        let (a, b) = (engine(&src, CacheSize::Resident), engine(&g, CacheSize::Experts(4)));
        let ids = input_ids(family, "long");
        for mode in [ScoreMode::Prefill, ScoreMode::Decode] {
            let x = score(&a.model, &ids, mode, 64, false).unwrap();
            let y = score(&b.model, &ids, mode, 64, false).unwrap();
            let e = rel_err(&y.logits, &x.logits);
            assert!(e < 1e-5, "{family} {mode:?}: exported logits rel err {e:.2e}");
        }
    }
    // A column reorder that would split blocks is refused with the reason, nothing written.
    let src = vault("qwen3_5_moe", Format::Q8_0, Format::Q8_0);
    let g = dir.path().join("q8.gguf");
    let e = smoe_convert::gguf::export::export(&src, &g, &smoe_formats::Silent).unwrap_err().to_string();
    assert!(e.contains("lin.out") && e.contains("straddle"), "{e}");
    assert!(!g.exists() && std::fs::read_dir(dir.path()).unwrap().all(|f| !f.unwrap().file_name().to_string_lossy().starts_with("q8")));
}

#[test]
fn bad_ggufs_are_refused_clearly() {
    let dir = tempfile::tempdir().unwrap();
    // Truncated.
    let src = std::fs::read(gguf("qwen3_moe.q8_0.gguf")).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &src[..src.len() / 2]).unwrap();
    let err = smoe_formats::gguf::GgufModel::open(&cut).err().expect("a truncated GGUF must fail").to_string();
    assert!(err.contains("past the end"), "{err}");
    // An unsupported tensor type is named with its tensor.
    let mut bad = src.clone();
    let name = b"blk.0.ffn_gate_exps.weight";
    let at = bad.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    // After the name: n_dims (u32), dims (3 x u64), then the type (u32).
    let ty = at + 4 + 3 * 8;
    bad[ty..ty + 4].copy_from_slice(&23u32.to_le_bytes()); // IQ4_XS
    let p = dir.path().join("iq.gguf");
    std::fs::write(&p, &bad).unwrap();
    let err = match smoe_formats::gguf::GgufModel::open(&p) {
        Ok(_) => panic!("IQ4_XS must be refused"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("blk.0.ffn_gate_exps.weight") && err.contains("IQ4_XS"), "{err}");
}

/// Mean over rows of KL(p ‖ q) of the softmaxes of two `[rows, vocab]` logit sets.
fn mean_kl(p: &[f32], q: &[f32], vocab: usize) -> f64 {
    let logp = |x: &[f32]| {
        let m = x.iter().fold(f32::MIN, |a, &b| a.max(b)) as f64;
        let z = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
        x.iter().map(|&v| v as f64 - m - z).collect::<Vec<f64>>()
    };
    let rows = p.len() / vocab;
    (0..rows)
        .map(|r| {
            let (a, b) = (logp(&p[r * vocab..(r + 1) * vocab]), logp(&q[r * vocab..(r + 1) * vocab]));
            a.iter().zip(&b).map(|(x, y)| x.exp() * (x - y)).sum::<f64>()
        })
        .sum::<f64>()
        / rows as f64
}

/// Q4_K_M and Q2_K files made by llama.cpp's own quantizer (from the bf16 weights of the
/// qwen3_moe_k fixture, exported by smoe) import and run; their distance from smoe's bf16 run
/// is the distance llama.cpp itself shows on the same file, and smoe and llama.cpp agree with
/// each other far more closely than either with bf16 (docs/gguf.md derives the bounds).
#[test]
fn llama_cpp_k_quants_import_and_match_llama_cpp() {
    let (dir, ids, reference, vocab) = kquant_case();
    for f in ["Q4_K_M", "Q2_K"] {
        let llama = kquant_llama_logits(&dir, f);
        let file = dir.join(format!("qwen3_moe_k.{f}.gguf"));
        for precision in [Precision::Reference, Precision::Fast] {
            let opts = OpenOptions { precision, cache: CacheSize::Resident, ..Default::default() };
            let e = open_cpu(&file, &opts).unwrap().0;
            let ours = score(&e.model, &ids, ScoreMode::Prefill, 64, false).unwrap().logits;
            let (ours_bf16, llama_bf16, ours_llama) =
                (mean_kl(&reference, &ours, vocab), mean_kl(&reference, &llama, vocab), mean_kl(&llama, &ours, vocab));
            eprintln!("{f} {precision:?}: KL(bf16‖smoe) {ours_bf16:.5}, KL(bf16‖llama.cpp) {llama_bf16:.5}, KL(llama.cpp‖smoe) {ours_llama:.6}, rel err vs llama.cpp {:.4}", rel_err(&ours, &llama));
            assert!(
                (ours_bf16 - llama_bf16).abs() <= 0.1 * llama_bf16,
                "{f} {precision:?}: distance from bf16 {ours_bf16} vs llama.cpp's {llama_bf16}"
            );
            assert!(
                ours_llama <= 0.1 * llama_bf16,
                "{f} {precision:?}: smoe vs llama.cpp {ours_llama} is not far tighter than {llama_bf16}"
            );
        }
    }
}

/// A mixed file's experts differ in size from layer to layer (llama.cpp's Q4_K_M: Q6_K down
/// projections in one of qwen3_moe_k's two layers): the bytes one expert of every layer
/// holds are the sum of the file's own expert tensors over their experts, streamed or
/// resident, in place or shattered (where every blob is padded to the largest layer's).
#[test]
fn a_mixed_files_expert_bytes_are_its_layers_own() {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/gguf-kquant/qwen3_moe_k.Q4_K_M.gguf");
    let g = smoe_formats::gguf::Gguf::open(&file).unwrap();
    let n = 8;
    let want: u64 = g.tensors.iter().filter(|t| t.name.contains("_exps.weight")).map(|t| t.len().unwrap() / n).sum();
    let down = |l: usize| g.tensor(&format!("blk.{l}.ffn_down_exps.weight")).unwrap().format().unwrap();
    assert_eq!((down(0), down(1)), (Format::Q4_K, Format::Q6_K));
    let dir = tempfile::tempdir().unwrap();
    let vault = dir.path().join("q4km.smoe");
    smoe_convert::gguf::import::shatter_gguf(&file, &vault, &smoe_formats::Silent).unwrap();
    for path in [file.as_path(), vault.as_path()] {
        for cache in [CacheSize::Resident, CacheSize::Experts(4)] {
            let opts = OpenOptions { precision: Precision::Reference, cache, ..Default::default() };
            let report = open_cpu(path, &opts).unwrap().1;
            assert_eq!(report.expert_bytes_all_layers, want, "{} {cache:?}", path.display());
        }
    }
}

/// DeepSeek-V4 as llama.cpp's converter writes deepseek-ai's checkpoint (`deepseek4`): its FP4
/// experts repacked as MXFP4 blocks, its FP8 layers dequantized and requantized to Q8_0, the
/// hash tables as I32, the rest as stored. In place and shattered against transformers on the
/// same weights (`make_gguf_fixtures.py deepseek_v4_fp4`: the Q8_0 round trips checked equal to
/// the file's data), and its expert blocks byte for byte those smoe takes from the checkpoint.
#[test]
fn llama_cpp_deepseek_v4_gguf_imports_and_runs_in_place() {
    let file = gguf("deepseek_v4_fp4.bf16.gguf");
    let r = read_safetensors(&gguf("deepseek_v4_fp4.bf16.reference.safetensors"));
    check(&engine(&file, CacheSize::Experts(4)).model, &r, "deepseek_v4_fp4.bf16 in place");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("deepseek_v4.smoe");
    smoe_convert::gguf::import::shatter_gguf(&file, &out, &smoe_formats::Silent).unwrap();
    check(&engine(&out, CacheSize::Resident).model, &r, "deepseek_v4_fp4.bf16 shattered");
    let (from_gguf, from_hub) =
        (smoe_vault::Vault::open(&out).unwrap(), smoe_vault::Vault::open(vault("deepseek_v4_fp4", Format::MXFP4, Format::BF16)).unwrap());
    assert_eq!(from_gguf.architecture(), from_hub.architecture());
    let blob = |v: &smoe_vault::Vault, l: usize, e: usize| {
        let mut b = vec![0u8; v.manifest().experts.blob_size as usize];
        v.read_blob(l, e, &mut b).unwrap();
        b
    };
    let a = from_gguf.architecture();
    for l in a.moe_layers() {
        for e in 0..a.moe.num_experts {
            assert_eq!(blob(&from_gguf, l, e), blob(&from_hub, l, e), "layer {l} expert {e}");
        }
    }
}
