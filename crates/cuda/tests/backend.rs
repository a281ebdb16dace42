//! The CUDA backend against the CPU and against transformers: the per-op conformance suite,
//! every fixture family's logits (prefill and step decode), and a streamed run through a VRAM
//! expert tier of two experts against a fully cached one. Without a usable GPU (CI has none)
//! each test says why and passes without running; on the GPU machine:
//! `cargo test --release -p smoe-cuda`.

#[path = "../../engine/tests/common/mod.rs"]
mod common;

use common::*;
use smoe_cuda::{CudaBackend, CudaOptions, MissMode};
use smoe_engine::conformance::{check_backend, Tolerance};
use smoe_engine::{score, Model, Precision, ScoreMode};
use smoe_quant::Format;
use smoe_store::{ExpertStore, ResidentExperts, StoreOptions};
use std::sync::Arc;

fn backend(opts: &CudaOptions) -> Option<CudaBackend> {
    match smoe_cuda::probe() {
        Err(why) => {
            eprintln!("skipped: no usable GPU ({why})");
            None
        }
        Ok(_) => Some(CudaBackend::open(0, opts).expect("a GPU the driver reports opens and compiles the kernels")),
    }
}

/// The kernels compile for the architectures smoe meets (Ampere, Ada, Hopper, Blackwell) wherever
/// NVRTC loads, GPU or not: `LD_LIBRARY_PATH` at the `nvidia-cuda-nvrtc` wheel's `lib` checks
/// them on a machine without one.
#[test]
fn kernels_compile_for_every_architecture() {
    if !smoe_cuda::nvrtc_present() {
        eprintln!("skipped: NVRTC not found");
        return;
    }
    // The five compiles run at once (NVRTC compiles separate programs concurrently): one at a
    // time they outgrew the device run's per-suite limit on a slower host.
    let archs = [(8, 0), (8, 6), (8, 9), (9, 0), (12, 0)];
    let compiled: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = archs.iter().map(|&cc| s.spawn(move || smoe_cuda::compile_ptx(cc))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut hopper = String::new();
    for (cc, ptx) in archs.into_iter().zip(compiled) {
        let ptx = ptx.unwrap_or_else(|e| panic!("sm_{}{}: {e}", cc.0, cc.1));
        if cc == (9, 0) {
            hopper = ptx.to_src();
        }
        for name in [
            "mv_q4_k",
            "mm_q6_k",
            "embed_bf16",
            "mt_q8_0",
            "attention",
            "attention_mma",
            "mmq_q4_k",
            "mvqn_q8_0",
            "mvqm_q4_k",
            "move_rows4",
            "rope",
            "rms_norm",
        ] {
            assert!(ptx.to_src().contains(name), "sm_{}{}: no kernel {name}", cc.0, cc.1);
        }
    }
    // Backends opening at once share one compile (or the disk cache's copy): the same PTX,
    // loaded once in the process whoever asked first. A disk cache written by another NVRTC
    // release (a device call carries one made by the PyPI wheel) differs in its text, so the
    // kernels are compared by their entry points.
    let texts: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4).map(|_| s.spawn(|| smoe_cuda::compile_kernels((9, 0)).unwrap().to_src())).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let entries = |ptx: &str| -> Vec<String> {
        ptx.lines().filter_map(|l| l.split(".entry ").nth(1)).map(|e| e.trim_end_matches('(').to_string()).collect()
    };
    assert!(texts.iter().all(|t| *t == texts[0]), "backends opening at once got different PTX");
    assert_eq!(entries(&texts[0]), entries(&hopper), "compile_kernels gave other kernels than compile_ptx");
    assert!(entries(&hopper).len() > 100, "{} kernels", entries(&hopper).len());
    let loads = smoe_cuda::kernel_loads((9, 0));
    assert_eq!(loads, 1, "four backends opening at once loaded the kernels {loads} times");
}

const REFERENCE: CudaOptions = CudaOptions {
    expert_bytes: None,
    misses: MissMode::Auto,
    miss_precision: None,
    precision: Some(Precision::Reference),
    no_keep: false,
    graphs: false,
    simt_prefill: false,
    batch_attention: None,
    kept_tokens: None,
    kept_tiles_from: None,
    kept_tile_tokens: None,
    kept_tile_run: None,
    kept_split: None,
    prefetch: None,
    fused_route: None,
    fused_norm: None,
    few_mma: None,
    few_mma_warps: None,
};

#[test]
fn every_op_matches_the_f32_reference() {
    let Some(b) = backend(&REFERENCE) else { return };
    let cases = check_backend(&b, &Tolerance::F32).unwrap_or_else(|f| panic!("{} mismatches:\n{}", f.len(), f.join("\n")));
    eprintln!("{cases} cases passed on {}", smoe_engine::Backend::describe(&b));
}

/// The default (fast) precision: one-token Q8_0, Q4_K and Q6_K products on int8 activations pass at
/// the tolerance of the CPU's int8 path, every other op as in f32.
#[test]
fn every_op_matches_on_int8_activations() {
    // With a batched step's sequences in one launch (the default; the suite's batched cases:
    // each sequence's rows and cache to the bit of its own) and sequence by sequence.
    // The third: the kept experts' batched case pair by pair instead of on tiles; the fourth,
    // the same with the down products of every step mixed a warp per row and two slots
    // (`mvkq_mix_split`; by default one-token steps only), at the suite's eight slots a token
    // (the fixtures have two), one token's router and routing in one launch, and its output
    // product, residual add and norm in one (both opt-in).
    let pairs = CudaOptions { kept_tiles_from: Some(0), ..Default::default() };
    let split = CudaOptions { kept_split: Some(true), fused_route: Some(true), fused_norm: Some(true), ..pairs };
    for opts in [CudaOptions::default(), CudaOptions { batch_attention: Some(false), ..Default::default() }, pairs, split] {
        let Some(b) = backend(&opts) else { return };
        let cases = check_backend(&b, &Tolerance::INT8_ACTIVATIONS).unwrap_or_else(|f| panic!("{} mismatches:\n{}", f.len(), f.join("\n")));
        eprintln!("{cases} cases passed on {}", smoe_engine::Backend::describe(&b));
    }
}

/// Q8_0 and Q4_K products of a few tokens on int8 tensor cores (`mvqm`, mvqm.cu) give each token
/// the bits of its one-token product (`mvq`), as the few-token mat-vec (`mvqn`) does: with 4 and
/// 8 warps a block, rows of 17 to 256 tasks (mvq's one warp a row and four; rows of 256 fit a
/// block's shared memory on some GPUs), row counts off the 16-row tiles, 2 to 8 tokens and steps
/// of 10, 13 and 64 (launches of eight and the rest: a 2-token job rides in 10's launch), and rows
/// too short (16 tasks or fewer: mvqn's half-warp rows) or too long for a block's shared memory
/// (mvqn's). A launch whose jobs have fewer than `mvqm_min_tokens` (Q4_K: 4) stays on mvqn. The
/// fixtures' rows are too short for it. Q6_K, which has no mvqm, holds mvqn to the same bits
/// (rows of a warp, of four warps, and of half a warp).
#[test]
fn few_token_products_on_tensor_cores_keep_each_tokens_bits() {
    use smoe_engine::Backend;
    let Some(mvqn) = backend(&CudaOptions { few_mma: Some(false), ..Default::default() }) else { return };
    let mma: Vec<_> =
        [4, 8].map(|w| (backend(&CudaOptions { few_mma: Some(true), few_mma_warps: Some(w), ..Default::default() }).unwrap(), w)).into();
    let mut seed = 0x9e3779b97f4a7c15u64;
    let mut random = |len: usize| -> Vec<f32> {
        (0..len)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                ((seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0
            })
            .collect()
    };
    // Q8_0 1056: rows of 33 groups, not 16-byte aligned (staged 2 bytes at a time); 16384: more
    // than a block's shared memory holds (mvqn takes it). Q4_K 1024: 16 pairs (mvqn's half warps).
    let shapes = [
        (Format::Q8_0, [(300, 2048), (70, 4096), (40, 1056), (24, 544), (33, 8192), (16, 640), (17, 16384)].as_slice()),
        (Format::Q4_K, [(300, 2048), (70, 4096), (24, 1280), (33, 8192), (16, 1024), (17, 16384)].as_slice()),
        (Format::Q6_K, [(300, 2048), (33, 8192), (16, 1024)].as_slice()),
    ];
    for (format, sizes) in shapes {
        for &(rows, cols) in sizes {
            let mut q = vec![0u8; rows * format.row_bytes(cols).unwrap()];
            smoe_quant::quantize(format, &random(rows * cols), &mut q).unwrap();
            let region = Arc::new(q);
            let kernels =
                mma.iter().map(|(b, w)| (b, format!("tensor cores, {w} warps"), true)).chain([(&mvqn, "mvqn".to_string(), false)]);
            for (b, what, on) in kernels {
                let launches = b.few_mma_launches();
                let m = b.matrix(&region, 0, format, rows, cols);
                for n in [2, 3, 5, 8, 10, 13, 64] {
                    let before = b.few_mma_launches();
                    let x = random(n * cols);
                    let mut xb = b.buf("x", n * cols);
                    b.upload(&mut xb, &x);
                    let mut out = b.buf("out", n * rows);
                    b.matmul(&m, None, &xb, n, &mut out);
                    let mut many = vec![0f32; n * rows];
                    b.download(&out, 0, &mut many);
                    // Q4_K's products of 2 and 3 tokens measured slower on tensor cores; Q6_K
                    // has no mvqm.
                    if format == Format::Q4_K && n < 4 || format == Format::Q6_K {
                        assert_eq!(b.few_mma_launches(), before, "{what}, {format:?} {rows} x {cols}: mvqm took {n} tokens");
                    }
                    for t in 0..n {
                        let mut x1 = b.buf("x", cols);
                        b.upload(&mut x1, &x[t * cols..(t + 1) * cols]);
                        let mut o1 = b.buf("out", rows);
                        b.matmul(&m, None, &x1, 1, &mut o1);
                        let mut one = vec![0f32; rows];
                        b.download(&o1, 0, &mut one);
                        let got = &many[t * rows..(t + 1) * rows];
                        let first = (0..rows).find(|&r| got[r].to_bits() != one[r].to_bits());
                        assert!(
                            first.is_none(),
                            "{what}, {format:?} {rows} x {cols}, token {t} of {n}: row {} is {} in the step, {} alone",
                            first.unwrap(),
                            got[first.unwrap()],
                            one[first.unwrap()]
                        );
                    }
                }
                // Rows of more than 16 tasks and up to 2,048 values (52 KB staged at most) fit
                // every int8-tensor-core GPU's shared memory: mvqm took them there; 16,384 (279 KB
                // and more) fit none: mvqn took them. Between, it depends on the GPU.
                let took = b.few_mma_launches() > launches;
                let tasks = if format == Format::Q8_0 { cols / 32 } else { cols / 64 };
                if cols <= 2048 {
                    assert_eq!(
                        took,
                        b.int8_tiles() && on && tasks > 16 && format != Format::Q6_K,
                        "{what}, {format:?} {rows} x {cols}: mvqm launched: {took}"
                    );
                } else if cols == 16384 {
                    assert!(!took, "{what}, {format:?} {rows} x {cols}: mvqm launched for rows its shared memory cannot hold");
                }
            }
        }
    }
    // Where the GPU has int8 tensor cores, the few tokens' products went to mvqm.
    for (b, w) in &mma {
        assert_eq!(b.few_mma_launches() > 0, b.int8_tiles(), "{} launches of mvqm ({w} warps)", b.few_mma_launches());
        eprintln!("{} launches on tensor cores ({w} warps), each token with its one-token bits", b.few_mma_launches());
    }
    assert_eq!(mvqn.few_mma_launches(), 0);
}

fn gpu_model(name: &str, opts: &CudaOptions) -> Option<Model<CudaBackend>> {
    let (experts, dense) = match name {
        // gpt-oss as the hub publishes it keeps its experts in MXFP4.
        "gpt_oss_mxfp4" => (Format::MXFP4, Format::BF16),
        // FP8 blocks times their f32 scales are not all bf16 values: f32, as on the CPU.
        "glm_moe_dsa_fp8" => (Format::F32, Format::F32),
        // DeepSeek-V4 as the hub publishes it: MXFP4 experts, FP8 dense weights (MXFP8 here).
        "deepseek_v4_fp4" => (Format::MXFP4, Format::MXFP8),
        _ => (Format::BF16, Format::BF16),
    };
    resident_model(name, experts, dense, opts)
}

/// Fixture `name` with `experts` and `dense` weights on a GPU backend opened with `opts`, every
/// expert resident; None where there is no GPU.
fn resident_model(name: &str, experts: Format, dense: Format, opts: &CudaOptions) -> Option<Model<CudaBackend>> {
    let b = backend(opts)?;
    let v = smoe_vault::Vault::open(vault(name, experts, dense)).unwrap();
    let ex = Arc::new(ResidentExperts::load(&v).unwrap());
    Some(Model::load(&v, b, ex).unwrap())
}

fn ids(t: &Tensor) -> Vec<u32> {
    t.i32().iter().map(|&x| x as u32).collect()
}

/// Every fixture family opens on the GPU (DeepSeek-V4's compressed attention, hyper-connections
/// and sqrt-softplus router included): nothing the CPU runs is refused, in any weight format the
/// CPU reads, as the checkpoints are published (gpt-oss's MXFP4 experts, DeepSeek-V4's MXFP4
/// experts and MXFP8 dense weights) too. `backend_lacks` is what refuses a family a backend
/// lacks, and what `--device auto` asks before choosing the GPU.
#[test]
fn every_family_and_format_opens_on_the_gpu() {
    let Some(b) = backend(&CudaOptions::default()) else { return };
    for f in smoe_quant::ALL_FORMATS {
        assert!(smoe_engine::Backend::decodes(&b, f), "{f} has no CUDA kernels");
    }
    for name in FAMILIES {
        let sizes = smoe_engine::model_sizes(&vault(name, Format::BF16, Format::BF16)).unwrap();
        assert_eq!(smoe_engine::backend_lacks(&sizes.arch, &sizes.formats, &b), None, "{name}");
    }
    for (name, experts, dense) in [("gpt_oss_mxfp4", Format::MXFP4, Format::BF16), ("deepseek_v4_fp4", Format::MXFP4, Format::MXFP8)] {
        let sizes = smoe_engine::model_sizes(&vault(name, experts, dense)).unwrap();
        assert_eq!(smoe_engine::backend_lacks(&sizes.arch, &sizes.formats, &b), None, "{name} as published");
    }
}

/// The fixture families run on the GPU below (the K-quant fixture `qwen3_moe_k` is not: its
/// formats are in the conformance suite).
const FAMILIES: [&str; 17] = [
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "qwen3_moe_yarn",
    "glm4_moe",
    "deepseek_v3",
    "deepseek_v3_yarn",
    "glm_moe_dsa",
    "gpt_oss",
    "gpt_oss_mxfp4",
    "minimax_m2",
    "glm_moe_dsa_fp8",
    "qwen3_next",
    "qwen3_5_moe",
    "deepseek_v4",
    "deepseek_v4_fp4",
];

/// Every fixture family the GPU runs ([`FAMILIES`]) within 1e-3 (relative to the largest
/// logit) of transformers in prefill and in step decode, and step decode equal to prefill up to
/// summation order.
#[test]
fn every_fixture_family_matches_transformers_on_the_gpu() {
    for name in FAMILIES {
        let Some(model) = gpu_model(name, &CudaOptions::default()) else { return };
        let r = read_safetensors(&fixture(name).join("reference.safetensors"));
        for tag in ["chat", "long"] {
            let input = ids(&r[&format!("{tag}.input_ids")]);
            let expect = r[&format!("{tag}.logits")].f32();
            let prefill = score(&model, &input, ScoreMode::Prefill, 64, false).unwrap();
            let decode = score(&model, &input, ScoreMode::Decode, 64, false).unwrap();
            let (ep, ed) = (rel_err(&prefill.logits, expect), rel_err(&decode.logits, expect));
            eprintln!("{name} {tag}: prefill {ep:.2e}, decode {ed:.2e} from transformers");
            assert!(ep < 1e-3 && ed < 1e-3, "{name} {tag}: prefill {ep:.2e}, decode {ed:.2e}");
            let same = rel_err(&decode.logits, &prefill.logits);
            assert!(same < 1e-4, "{name} {tag}: decode differs from prefill by {same:.2e}");
        }
    }
}

/// llama.cpp's own Q4_K_M and Q2_K files of qwen3_moe_k (testdata/gguf-kquant, written by
/// `llama-quantize`: Q2_K to Q8_0 by tensor, Q4_K_M's down projections Q4_K in one layer and
/// Q6_K in the other) run in place on the GPU, prefill on the int8 tiles and step decode on
/// the int8 mat-vecs: as close to llama.cpp's logits on the same file as the CPU's own run
/// must be (`llama_cpp_k_quants_import_and_match_llama_cpp`: within a tenth of either's
/// distance from bf16).
#[test]
fn llama_cpp_mixed_files_run_in_place_on_the_gpu() {
    if smoe_cuda::probe().is_err() {
        eprintln!("skipped: no usable GPU");
        return;
    }
    let (dir, ids, reference, vocab) = kquant_case();
    for f in ["Q4_K_M", "Q2_K"] {
        let Some(b) = backend(&CudaOptions::default()) else { return };
        let llama = kquant_llama_logits(&dir, f);
        let opts = smoe_engine::OpenOptions { cache: smoe_engine::CacheSize::Resident, ..Default::default() };
        let gpu = smoe_engine::open(&dir.join(format!("qwen3_moe_k.{f}.gguf")), &opts, b).unwrap().0;
        let llama_bf16 = distance(&llama, &reference, vocab).1;
        for mode in [ScoreMode::Prefill, ScoreMode::Decode] {
            let ours = score(&gpu.model, &ids, mode, 64, false).unwrap().logits;
            let (agree, kl, rel) = distance(&ours, &llama, vocab);
            eprintln!(
                "{f} {mode:?} on the GPU: KL(llama.cpp‖smoe) {kl:.6} (KL(bf16‖llama.cpp) {llama_bf16:.5}), top-1 agreement {agree:.3}, rel err {rel:.4}"
            );
            assert!(kl <= 0.1 * llama_bf16, "{f} {mode:?}: smoe on the GPU vs llama.cpp {kl} is not far tighter than {llama_bf16}");
        }
    }
}

/// Step decode as generation runs it (no observer): each token's logits.
fn decode_quietly<B: smoe_engine::Backend>(model: &Model<B>, ids: &[u32]) -> Vec<f32> {
    let mut st = model.new_state(1);
    let mut out = Vec::new();
    for &t in ids {
        out.extend_from_slice(model.forward(&mut st, &[t], smoe_engine::Logits::Last, &mut smoe_engine::NoObserver).unwrap());
    }
    out
}

/// With every expert in VRAM the model keeps them by layer and decode routes on the GPU (no
/// wait for the host per layer): softmax, grouped-sigmoid and sqrt-softplus routers (DeepSeek-V4,
/// whose hash-routed layers route on the host), shared experts with and
/// without a gate, MLA. Logits within 1e-3 of transformers and within 1e-5 of the host's
/// routing (the same products; only exp may round differently); how many tokens came out
/// bit-identical is reported.
#[test]
fn experts_kept_in_vram_route_on_the_gpu_as_the_host_does() {
    for name in ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3", "deepseek_v4"] {
        let Some(kept) = gpu_model(name, &CudaOptions::default()) else { return };
        let host = gpu_model(name, &CudaOptions { no_keep: true, ..Default::default() }).unwrap();
        let moe_layers = kept.arch().layers.iter().filter(|l| **l == smoe_vault::LayerKind::Moe).count();
        assert_eq!(kept.kept_layers(), moe_layers, "{name}: every MoE layer kept");
        assert_eq!(host.kept_layers(), 0);
        let r = read_safetensors(&fixture(name).join("reference.safetensors"));
        for tag in ["chat", "long"] {
            let input = ids(&r[&format!("{tag}.input_ids")]);
            let (a, b) = (decode_quietly(&kept, &input), decode_quietly(&host, &input));
            let vocab = kept.arch().vocab_size;
            let same = a.chunks(vocab).zip(b.chunks(vocab)).filter(|(x, y)| x == y).count();
            let (ek, eh) = (rel_err(&a, r[&format!("{tag}.logits")].f32()), rel_err(&a, &b));
            eprintln!(
                "{name} {tag}: routed on the GPU {ek:.2e} from transformers, {eh:.2e} from host routing, {same} of {} tokens identical",
                input.len()
            );
            assert!(ek < 1e-3 && eh < 1e-5, "{name} {tag}: {ek:.2e} from transformers, {eh:.2e} from host routing");
        }
        eprintln!("{}", smoe_engine::Backend::describe(kept.backend()));
    }
    // Q4_K experts and Q8_0 dense weights: the int8-activation kernels, kept and named by job.
    // qwen3_moe's 64-wide expert rows do not fit Q4_K's 256-wide blocks (its experts fall back
    // to Q5_0 and f32 products); qwen3_moe_k's 256-wide rows keep Q4_K, so the kept experts run
    // on int8 activations too. Then Q4_K_M's Q6_K: qwen3_moe_k's down projections and every
    // dense matrix (all 256 wide or more) in Q6_K, gate and up in Q4_K.
    let q4_k_m: smoe_convert::ExpertFormats = "Q4_K,down=Q6_K".parse().unwrap();
    for (name, experts, dense) in [
        ("qwen3_moe", Format::Q4_K.into(), Format::Q8_0),
        ("qwen3_moe_k", Format::Q4_K.into(), Format::Q8_0),
        ("qwen3_moe_k", q4_k_m, Format::Q6_K),
    ] {
        let v = smoe_vault::Vault::open(vault(name, experts, dense)).unwrap();
        let open = |opts: &CudaOptions| Model::load(&v, backend(opts).unwrap(), Arc::new(ResidentExperts::load(&v).unwrap())).unwrap();
        let (kept, host) = (open(&CudaOptions::default()), open(&CudaOptions { no_keep: true, ..Default::default() }));
        let r = read_safetensors(&fixture(name).join("reference.safetensors"));
        let input = ids(&r["chat.input_ids"]);
        let (a, b) = (decode_quietly(&kept, &input), decode_quietly(&host, &input));
        let (ek, eh) = (rel_err(&a, r["chat.logits"].f32()), rel_err(&a, &b));
        eprintln!(
            "{name} {experts}/{dense} on int8 activations: {ek:.2e} from transformers (quantized weights), {eh:.2e} from host routing"
        );
        assert!(eh < 1e-5, "{name}: int8 kept experts moved the logits by {eh:.2e}");
        // Prefill on the int8 tiles, whose inputs are the int8 rows the norms, the gather of the
        // experts' rows and SiLU leave. Step decode quantizes the same rows the same way, but its
        // floats come from other kernels (attention above all), and a value a rounding away from a
        // step of its group's int8 grid moves a whole step: on the H200, 7.27e-3 (qwen3_moe), the
        // same with the f32 prefill attention, against the int8 path's 1.8e-1 from transformers. A
        // wrong tile (a scale, a row, a group) moves the logits by order one.
        let prefill = score(&kept, &input, ScoreMode::Prefill, 64, false).unwrap();
        let same = rel_err(&a, &prefill.logits);
        eprintln!("{name} {experts}/{dense}: prefill on the int8 tiles {same:.2e} from step decode");
        assert!(
            same < 2e-2 && same < ek / 10.0,
            "{name}: int8 prefill differs from step decode by {same:.2e} ({ek:.2e} from transformers)"
        );
    }
}

/// Eight sequences' batched steps of fixture `name` (one- to three-token prompts, then a decode
/// token each) give the same logits on `a` and `b`, bit for bit; `what` names the difference
/// between the two in a failure.
fn assert_same_batched_steps(a: &Model<CudaBackend>, b: &Model<CudaBackend>, name: &str, what: &str) {
    let (ra, rb) = (batched_record(a, name, (8, 1, 3, 60), 16, None), batched_record(b, name, (8, 1, 3, 60), 16, None));
    for (i, (sa, sb)) in ra.iter().zip(&rb).enumerate() {
        for (step, ((_, la), (_, lb))) in sa.iter().zip(sb).enumerate() {
            assert!(la == lb, "{name}: sequence {i} step {step}: {what} moved the logits by {:.2e}", rel_err(la, lb));
        }
    }
}

/// The kept experts' down products mixed with a warp per row and two slots (`mvkq_mix_split`,
/// one-token steps by default) give the bits of a warp per row (`mvkq_mix`): one sequence's
/// step decode, and eight sequences in steps of their one- to three-token prompts and then of
/// a decode token each, with Q4_K and with Q8_0 experts. The fixture routes two slots a token: one warp a row (the
/// suite's eight-slot case, `every_op_matches_on_int8_activations`, takes four).
#[test]
fn split_mix_gives_the_row_mix_bits() {
    for experts in [Format::Q4_K, Format::Q8_0] {
        let name = "qwen3_moe_k";
        let open =
            |split: bool| resident_model(name, experts, Format::Q8_0, &CudaOptions { kept_split: Some(split), ..Default::default() });
        let (Some(split), Some(rows)) = (open(true), open(false)) else { return };
        assert!(split.kept_layers() > 0, "{name} {experts:?}: no experts kept");
        let r = read_safetensors(&fixture(name).join("reference.safetensors"));
        let input = ids(&r["chat.input_ids"]);
        let (a, b) = (decode_quietly(&split, &input), decode_quietly(&rows, &input));
        assert!(a == b, "{name} {experts:?}: the split mix moved one sequence's logits by {:.2e}", rel_err(&a, &b));
        assert_same_batched_steps(&split, &rows, name, &format!("the split mix ({experts:?} experts)"));
        // Both kernels ran: the comparison is not of one path with itself.
        let (split_steps, rows_steps) = (split.backend().kept_split_steps(), rows.backend().kept_split_steps());
        assert!(split_steps > 0 && rows_steps == 0, "{name} {experts:?}: split mix steps {split_steps} and {rows_steps}");
    }
}

/// Weights asked of L2 ahead of their products (`CudaOptions::prefetch`, on by default from
/// compute 9.0) leave every logit as it was, bit for bit: one sequence's decode (its one-token
/// steps prefetch their kept experts and attention's cache rows too) and eight sequences'
/// batched steps.
#[test]
fn prefetch_keeps_the_bits() {
    let name = "qwen3_moe_k";
    let open =
        |prefetch: bool| resident_model(name, Format::Q4_K, Format::Q8_0, &CudaOptions { prefetch: Some(prefetch), ..Default::default() });
    let (Some(on), Some(off)) = (open(true), open(false)) else { return };
    let r = read_safetensors(&fixture(name).join("reference.safetensors"));
    // The long text's context passes 32 positions: attention's splits prefetch their own.
    for text in ["chat", "long"] {
        let input = ids(&r[&format!("{text}.input_ids")]);
        let (a, b) = (decode_quietly(&on, &input), decode_quietly(&off, &input));
        assert!(a == b, "{name} {text}: prefetching moved one sequence's logits by {:.2e}", rel_err(&a, &b));
    }
    assert_same_batched_steps(&on, &off, name, "prefetching");
    // Below compute 9.0 there is nothing to prefetch with; above, the kept experts' prefetch ran.
    let described = smoe_engine::Backend::describe(on.backend());
    if described.contains("asked of L2") {
        let (p_on, p_off) = (on.backend().kept_prefetch_steps(), off.backend().kept_prefetch_steps());
        assert!(p_on > 0 && p_off == 0, "{name}: kept experts prefetched in {p_on} and {p_off} steps");
    }
}

/// A decoded token's router product and routing in one launch (`mvs_f32_route`, opt-in) give
/// the logits of the two kernels, bit for bit: one sequence's decode, and eight sequences'
/// steps (one-token steps fused, larger ones not), with a softmax router (qwen3_moe) and a
/// grouped sigmoid one with a correction bias (deepseek_v3).
#[test]
fn fused_router_and_route_give_the_two_kernels_bits() {
    for name in ["qwen3_moe", "deepseek_v3"] {
        let open = |fused: bool| gpu_model(name, &CudaOptions { fused_route: Some(fused), ..Default::default() });
        let (Some(on), Some(off)) = (open(true), open(false)) else { return };
        let r = read_safetensors(&fixture(name).join("reference.safetensors"));
        let input = ids(&r["chat.input_ids"]);
        let (a, b) = (decode_quietly(&on, &input), decode_quietly(&off, &input));
        assert!(a == b, "{name}: the fused router moved one sequence's logits by {:.2e}", rel_err(&a, &b));
        assert_same_batched_steps(&on, &off, name, "the fused router");
        let (f_on, f_off) = (on.backend().fused_route_steps(), off.backend().fused_route_steps());
        assert!(f_on > 0 && f_off == 0, "{name}: fused router launches {f_on} and {f_off}");
    }
}

/// A decoded token's norms in the launch before them (`CudaOptions::fused_norm`, opt-in: the
/// attention output product with the residual add and next norm, `mvq_add_norm`, and the kept
/// experts' split mix with the next layer's input norm, `mvkq_mix_split_norm`) give the logits
/// of the separate kernels, bit for bit: one sequence's decode (a short and a long text) and
/// eight sequences' steps (one-token steps fused, larger ones not), with Q4_K and with Q8_0
/// experts (the output products are Q8_0, as in the benchmarks' vaults).
#[test]
fn fused_norms_give_the_two_kernels_bits() {
    for experts in [Format::Q4_K, Format::Q8_0] {
        let name = "qwen3_moe_k";
        let open =
            |fused: bool| resident_model(name, experts, Format::Q8_0, &CudaOptions { fused_norm: Some(fused), ..Default::default() });
        let (Some(on), Some(off)) = (open(true), open(false)) else { return };
        let r = read_safetensors(&fixture(name).join("reference.safetensors"));
        for text in ["chat", "long"] {
            let input = ids(&r[&format!("{text}.input_ids")]);
            let (a, b) = (decode_quietly(&on, &input), decode_quietly(&off, &input));
            assert!(a == b, "{name} {experts:?} {text}: the fused norms moved one sequence's logits by {:.2e}", rel_err(&a, &b));
        }
        assert_same_batched_steps(&on, &off, name, &format!("the fused norms ({experts:?} experts)"));
        // Both kinds ran, and only where asked: the comparison is not of one path with itself.
        let (p_on, p_off) = (on.backend().fused_norm_steps(), off.backend().fused_norm_steps());
        let (m_on, m_off) = (on.backend().mix_norm_steps(), off.backend().mix_norm_steps());
        assert!(p_on > 0 && p_off == 0 && m_on > 0 && m_off == 0, "{name} {experts:?}: fused norms {p_on}/{p_off}, mixes {m_on}/{m_off}");
    }
}

/// Decoded tokens recorded and launched as CUDA graphs give the logits of the same kernels
/// launched one by one, bit for bit: kept experts (a whole token in one graph) and the host's
/// routing (a graph up to each layer's download), on int8 and f32 products, across the
/// attention splits of a 300-token context.
#[test]
fn decode_as_cuda_graphs_matches_kernel_by_kernel() {
    let graphs_on = CudaOptions { graphs: true, ..Default::default() };
    for (name, formats) in [("qwen3_moe", (Format::Q4_K, Format::Q8_0)), ("deepseek_v3", (Format::BF16, Format::BF16))] {
        let Some(probe) = backend(&CudaOptions::default()) else { return };
        drop(probe);
        let v = smoe_vault::Vault::open(vault(name, formats.0, formats.1)).unwrap();
        let open = |opts: &CudaOptions| Model::load(&v, backend(opts).unwrap(), Arc::new(ResidentExperts::load(&v).unwrap())).unwrap();
        let r = read_safetensors(&fixture(name).join("reference.safetensors"));
        let input = ids(&r["long.input_ids"]);
        for keep in [true, false] {
            let (on, off) =
                (open(&CudaOptions { no_keep: !keep, ..graphs_on.clone() }), open(&CudaOptions { no_keep: !keep, ..Default::default() }));
            let (a, b) = (decode_quietly(&on, &input), decode_quietly(&off, &input));
            let described = smoe_engine::Backend::describe(on.backend());
            eprintln!("{name} kept {keep}: {described}");
            assert!(described.contains("CUDA graphs (") && !described.contains("(0 launched"), "{name}: no graphs ran: {described}");
            assert!(a == b, "{name} kept {keep}: graphs moved the logits by {:.2e}", rel_err(&a, &b));
        }
    }
}

/// Experts streamed through a host cache of top-k slots and a VRAM tier of two experts' bytes
/// give exactly the logits of every expert resident in both.
#[test]
fn a_two_expert_vram_tier_is_identical_to_a_full_one() {
    // The tier under test, not the experts kept by layer (routed on the GPU, see below).
    let Some(full) = backend(&CudaOptions { no_keep: true, ..Default::default() }) else { return };
    let name = "qwen3_moe";
    let path = vault(name, Format::Q4_K, Format::BF16);
    let v = smoe_vault::Vault::open(&path).unwrap();
    let slot = v.manifest().experts.blob_size;
    let small = backend(&CudaOptions { expert_bytes: Some(2 * slot), misses: MissMode::Copy, ..Default::default() }).unwrap();
    let store = Arc::new(ExpertStore::open(&v, &StoreOptions::with_slots(v.architecture().moe.top_k)).unwrap());
    let streamed = Model::load(&v, small, store).unwrap();
    let resident = Model::load(&v, full, Arc::new(ResidentExperts::load(&v).unwrap())).unwrap();
    let r = read_safetensors(&fixture(name).join("reference.safetensors"));
    for tag in ["chat", "long"] {
        let input = ids(&r[&format!("{tag}.input_ids")]);
        for mode in [ScoreMode::Prefill, ScoreMode::Decode] {
            let a = score(&resident, &input, mode, 64, false).unwrap();
            let b = score(&streamed, &input, mode, 64, false).unwrap();
            assert!(a.logits == b.logits, "{tag} {mode:?}: the small VRAM tier changed the logits");
        }
    }
    let (s, f) = (streamed.backend().expert_stats(), resident.backend().expert_stats());
    eprintln!("two-expert tier: {s:?}\nfull tier: {f:?}");
    assert!(s.misses > f.misses, "the small tier must have copied experts again");
    assert!(s.resident_bytes <= f.resident_bytes);
    // What `--instrument` reports: the same counters, and device memory in use.
    let d = smoe_engine::Backend::device_tier(streamed.backend()).expect("a GPU has a tier");
    assert_eq!((d.copies, d.copied_bytes, d.hits), (s.misses, s.uploaded_bytes, s.hits));
    assert!(d.copy_secs > 0.0 && d.device_used_bytes >= d.resident_bytes, "{d:?}");
}

/// Decode steps whose experts all miss VRAM (a tier with room for none), computed by the CPU
/// backend on the host copies while the GPU runs the rest: with the CPU's f32 reference path
/// the logits are the GPU's up to summation order (a wrong row, offset or width would be of
/// order 1); with the production int8-activation path, within its rounding (reported).
#[test]
fn misses_computed_on_the_cpu_match_the_gpu() {
    let Some(full) = backend(&CudaOptions { no_keep: true, ..REFERENCE }) else { return };
    let name = "qwen3_moe";
    let path = vault(name, Format::Q4_K, Format::BF16);
    let v = smoe_vault::Vault::open(&path).unwrap();
    let resident = Model::load(&v, full, Arc::new(ResidentExperts::load(&v).unwrap())).unwrap();
    let r = read_safetensors(&fixture(name).join("reference.safetensors"));
    for (precision, bound) in [(Precision::Reference, 1e-4), (Precision::Fast, f64::INFINITY)] {
        let opts = CudaOptions { expert_bytes: Some(1), misses: MissMode::Cpu, miss_precision: Some(precision), ..REFERENCE };
        let store = Arc::new(ExpertStore::open(&v, &StoreOptions::with_slots(v.architecture().moe.top_k)).unwrap());
        let hybrid = Model::load(&v, backend(&opts).unwrap(), store).unwrap();
        for tag in ["chat", "long"] {
            let input = ids(&r[&format!("{tag}.input_ids")]);
            let a = score(&resident, &input, ScoreMode::Decode, 64, false).unwrap();
            let b = score(&hybrid, &input, ScoreMode::Decode, 64, false).unwrap();
            let err = rel_err(&b.logits, &a.logits);
            eprintln!("{tag}, misses on the CPU ({precision:?}): {err:.2e} from the GPU's logits");
            assert!(err < bound, "{tag} ({precision:?}): misses on the CPU moved the logits by {err:.2e}");
        }
        let s = hybrid.backend().expert_stats();
        eprintln!("hybrid: {s}");
        assert!(s.cpu_products > 0, "decode misses must have run on the CPU");
    }
}

/// The CUDA-core prefill kernel (what GPUs before compute 8.0 run, and `SMOE_CUDA_PREFILL=simt`
/// selects) passes the suite too.
#[test]
fn every_op_matches_with_prefill_on_cuda_cores() {
    // An option, not the variable: the process's other tests open backends meanwhile.
    let Some(b) = backend(&CudaOptions { simt_prefill: true, ..REFERENCE }) else { return };
    let cases = check_backend(&b, &Tolerance::F32).unwrap_or_else(|f| panic!("{} mismatches:\n{}", f.len(), f.join("\n")));
    eprintln!("{cases} cases passed on {}", smoe_engine::Backend::describe(&b));
}

/// Batched steps on the GPU (`Model::forward_batch`): three sequences of different prompt
/// lengths prefilled together, then decoded side by side while the shortest leaves early;
/// each one's logits against the same steps run alone. A product's kernel depends on its token
/// count (1, 2–8, more), so the two agree within rounding, not bit for bit; the largest
/// difference is reported. With the fixtures' experts kept in VRAM, steps of up to
/// `kept_tokens` route on the GPU and larger ones group experts on the host: at 4, both run
/// here (attention sequence by sequence and in one launch); at the default, every step (the
/// 22-token prefill too) goes through the kept experts' own kernels.
#[test]
fn batched_steps_match_each_sequence_alone_on_the_gpu() {
    let per_sequence = CudaOptions { batch_attention: Some(false), kept_tokens: Some(4), ..Default::default() };
    let one_launch = CudaOptions { batch_attention: Some(true), kept_tokens: Some(4), ..Default::default() };
    for (name, opts) in ["qwen3_moe", "qwen2_moe", "deepseek_v3", "deepseek_v4"]
        .into_iter()
        .flat_map(|name| [(name, per_sequence.clone()), (name, one_launch.clone()), (name, CudaOptions::default())])
    {
        let Some(model) = gpu_model(name, &opts) else { return };
        let worst = batched_against_alone(&model, name);
        eprintln!(
            "{name}: batched vs alone on the GPU{}{}, largest relative logit error {worst:.2e} (kept layers: {})",
            if opts.batch_attention == Some(false) { " (attention sequence by sequence)" } else { " (attention in one launch)" },
            if opts.kept_tokens.is_none() { " (every step through the kept experts)" } else { "" },
            model.kept_layers()
        );
        assert!(worst < 1e-4, "{name}: batched logits differ from alone by {worst:.2e}");
    }
}

/// The same steps with Q4_K experts and Q8_0 dense weights (qwen3_moe_k: 256-wide rows, so the
/// experts are Q4_K as asked): the int8-activation kernels, several tokens' pairs on one
/// expert through the fused pair kernels and through the tiles (`kept_tiles.cu`), and the
/// host's grouping at `kept_tokens` 4. A batched step's floats come from other kernels than a
/// lone token's (the few-token mat-vec, batched attention, the tiles), and a value a rounding
/// away from its group's int8 step moves a whole step, so the bound is the int8 prefill test's:
/// within 2e-2 and a tenth of the path's own distance from transformers. A wrong pair (a slot,
/// a scale, a token's row) moves the logits by order one.
#[test]
fn batched_int8_steps_match_each_sequence_alone_on_the_gpu() {
    let per_sequence = CudaOptions { batch_attention: Some(false), kept_tokens: Some(4), ..Default::default() };
    let tiles = CudaOptions { kept_tiles_from: Some(1), ..Default::default() };
    let pairs = CudaOptions { kept_tiles_from: Some(0), ..Default::default() };
    int8_batched_within_bound(
        (Format::Q4_K.into(), Format::Q8_0),
        &[
            ("host grouping above 4 tokens", per_sequence, false),
            ("kept experts on tiles", tiles.clone(), true),
            ("kept experts pair by pair", pairs.clone(), false),
        ],
        |model| batched_against_alone(model, "qwen3_moe_k"),
    );
    // Q4_K_M's mix: Q6_K down projections (staged on the tiles 16 bits at a time: their rows
    // are only 2-byte aligned) and Q6_K dense weights.
    int8_batched_within_bound(
        ("Q4_K,down=Q6_K".parse().unwrap(), Format::Q6_K),
        &[("Q6_K down, kept experts on tiles", tiles, true), ("Q6_K down, pair by pair", pairs, false)],
        |model| batched_against_alone(model, "qwen3_moe_k"),
    );
}

/// For each (what, options, on tiles): qwen3_moe_k with experts and dense weights in `formats`
/// on the GPU, `worst` of its batched steps against each sequence alone, asserted within the
/// int8 batched bound (2e-2, and a tenth of the model's own distance from transformers on the
/// chat text), and whether any step's kept experts ran on the int8 tiles.
fn int8_batched_within_bound(
    formats: (smoe_convert::ExpertFormats, Format),
    cases: &[(&str, CudaOptions, bool)],
    worst: impl Fn(&Model<CudaBackend>) -> f64,
) {
    let Some(probe) = backend(&CudaOptions::default()) else { return };
    // GPUs without int8 tensor cores run the kept experts pair by pair.
    let tiles_here = probe.int8_tiles();
    drop(probe);
    let name = "qwen3_moe_k";
    let (experts, dense) = formats;
    let v = smoe_vault::Vault::open(vault(name, experts, dense)).unwrap();
    let r = read_safetensors(&fixture(name).join("reference.safetensors"));
    for (what, opts, on_tiles) in cases {
        let model = Model::load(&v, backend(opts).unwrap(), Arc::new(ResidentExperts::load(&v).unwrap())).unwrap();
        let ek = rel_err(&decode_quietly(&model, &ids(&r["chat.input_ids"])), r["chat.logits"].f32());
        let worst = worst(&model);
        eprintln!(
            "{name} {experts}/{dense}, {what}: batched vs alone on the GPU, largest relative logit error {worst:.2e} ({ek:.2e} from transformers)"
        );
        assert!(
            worst < 2e-2 && worst < ek / 10.0,
            "{what}: int8 batched logits differ from alone by {worst:.2e} ({ek:.2e} from transformers)"
        );
        let steps = model.backend().kept_tile_steps();
        assert_eq!(steps > 0, *on_tiles && tiles_here, "{what}: {steps} layer steps on int8 tiles");
    }
}

/// The kept experts on int8 tiles against the same experts pair by pair (`kept.cu`'s fused
/// kernels), Q4_K experts (qwen3_moe_k) and Q8_0 ones: one-token steps (one pair an expert) and
/// the 52-token chat text as one step through the kept experts (104 pairs on eight experts:
/// several tiles of eight tokens, and experts with more than a block's 16, taken in turns);
/// then the 300-token text as one step on the tiles against the host's grouping of it.
/// The tiles sum in mmq's order, so the two agree within the int8 path's rounding (the bound of
/// the int8 prefill test), and the tiles are as near to transformers (within 5%).
#[test]
fn kept_experts_on_tiles_match_pair_by_pair() {
    use smoe_engine::{Logits, NoObserver};
    let Some(probe) = backend(&CudaOptions::default()) else { return };
    if !probe.int8_tiles() {
        eprintln!("skipped: no int8 tensor cores on {}", probe.device().name);
        return;
    }
    drop(probe);
    let name = "qwen3_moe_k";
    let r = read_safetensors(&fixture(name).join("reference.safetensors"));
    let input = ids(&r["chat.input_ids"]);
    for experts in [Format::Q4_K, Format::Q8_0] {
        let v = smoe_vault::Vault::open(vault(name, experts, Format::Q8_0)).unwrap();
        let open = |from: usize| {
            let opts = CudaOptions { kept_tiles_from: Some(from), ..Default::default() };
            Model::load(&v, backend(&opts).unwrap(), Arc::new(ResidentExperts::load(&v).unwrap())).unwrap()
        };
        let (tiles, pairs) = (open(1), open(0));
        assert!(tiles.kept_layers() > 0, "{experts}: the experts are kept");
        let want = r["chat.logits"].f32();
        let one_step = |m: &Model<CudaBackend>| m.forward(&mut m.new_state(64), &input, Logits::All, &mut NoObserver).unwrap().to_vec();
        let (dt, dp) = (decode_quietly(&tiles, &input), decode_quietly(&pairs, &input));
        let (pt, pp) = (one_step(&tiles), one_step(&pairs));
        for (what, t, p) in [("step decode", &dt, &dp), ("the text in one step", &pt, &pp)] {
            let (et, ep, d) = (rel_err(t, want), rel_err(p, want), rel_err(t, p));
            eprintln!("{name} {experts} experts, {what}: tiles {d:.2e} from pair by pair; {et:.2e} and {ep:.2e} from transformers");
            assert!(
                d < 2e-2 && d < ep / 10.0,
                "{experts} {what}: the tiles differ from pair by pair by {d:.2e} ({ep:.2e} from transformers)"
            );
            assert!(et <= ep * 1.05, "{experts} {what}: the tiles {et:.2e} from transformers against pair by pair's {ep:.2e}");
        }
        assert!(pt != pp, "{experts}: the one-step text went through the tiles (its sums are mmq's, not the mat-vec's)");
        // The 300-token text as one step: on the tiles when they take steps that long
        // (`kept_tile_tokens`, and `kept_tile_run` for a prompt's run of tokens), else routed
        // on the GPU and grouped by expert on the host.
        let long = ids(&r["long.input_ids"]);
        let long_step = |tile_tokens: Option<usize>| {
            let opts =
                CudaOptions { kept_tiles_from: Some(1), kept_tile_tokens: tile_tokens, kept_tile_run: Some(512), ..Default::default() };
            let m = Model::load(&v, backend(&opts).unwrap(), Arc::new(ResidentExperts::load(&v).unwrap())).unwrap();
            let logits = m.forward(&mut m.new_state(512), &long, Logits::All, &mut NoObserver).unwrap().to_vec();
            (logits, m.backend().kept_tile_steps())
        };
        let ((lt, on_tiles), (lg, grouped_on_tiles)) = (long_step(Some(512)), long_step(None));
        // The tiles sum as the grouping does: only the count says which ran.
        assert!(on_tiles > 0 && grouped_on_tiles == 0, "{experts}: {on_tiles} and {grouped_on_tiles} layer steps on tiles");
        let want = r["long.logits"].f32();
        let (et, eg, d) = (rel_err(&lt, want), rel_err(&lg, want), rel_err(&lt, &lg));
        eprintln!("{name} {experts} experts, 300 tokens in one step: tiles {d:.2e} from the host's grouping; {et:.2e} and {eg:.2e} from transformers");
        assert!(d < 2e-2 && d < eg / 10.0, "{experts}: 300 tokens on the tiles differ from the host's grouping by {d:.2e} ({eg:.2e})");
        assert!(et <= eg * 1.05, "{experts}: 300 tokens on the tiles {et:.2e} from transformers against the grouping's {eg:.2e}");
    }
}

/// Three sequences of different prompt lengths prefilled in one step, then decoded side by side
/// while the shortest leaves early; the largest relative error of each step's logits against
/// the same steps run alone.
fn batched_against_alone(model: &Model<CudaBackend>, name: &str) -> f64 {
    use smoe_engine::{BatchItem, NoObserver};
    let long = input_ids(name, "long");
    let prompts = [long[..7].to_vec(), long[20..23].to_vec(), long[40..52].to_vec()];
    let decode = [long[100..106].to_vec(), long[110..116].to_vec(), long[120..122].to_vec()];
    let vocab = model.arch().vocab_size;
    let mut states: Vec<_> = (0..3).map(|_| model.new_state(1)).collect();
    let mut batch = model.new_batch(32);
    // What each sequence ran per step, and the logits it got.
    let mut record: Vec<Vec<(Vec<u32>, Vec<f32>)>> = vec![Vec::new(); 3];
    for step in 0..=decode[0].len() {
        let inputs: Vec<Option<Vec<u32>>> =
            (0..3).map(|i| if step == 0 { Some(prompts[i].clone()) } else { decode[i].get(step - 1).map(|&t| vec![t]) }).collect();
        let mut items: Vec<BatchItem<'_, _>> =
            states.iter_mut().zip(&inputs).filter_map(|(state, t)| t.as_deref().map(|tokens| BatchItem { state, tokens })).collect();
        let logits = model.forward_batch(&mut batch, &mut items, &mut NoObserver).unwrap().to_vec();
        for (j, i) in (0..3).filter(|&i| inputs[i].is_some()).enumerate() {
            record[i].push((inputs[i].clone().unwrap(), logits[j * vocab..(j + 1) * vocab].to_vec()));
        }
    }
    worst_against_alone(model, &record)
}

/// Each sequence's recorded steps (its tokens and the logits it got in the batch) run again
/// alone: the largest relative error of a step's logits against its own.
fn worst_against_alone(model: &Model<CudaBackend>, record: &[Vec<(Vec<u32>, Vec<f32>)>]) -> f64 {
    errors_against_alone(model, record).iter().flatten().fold(0f64, |a, &e| a.max(e))
}

/// Each sequence's recorded steps run again alone: each step's relative error against its own,
/// by sequence.
fn errors_against_alone(model: &Model<CudaBackend>, record: &[Vec<(Vec<u32>, Vec<f32>)>]) -> Vec<Vec<f64>> {
    use smoe_engine::{Logits, NoObserver};
    record
        .iter()
        .map(|steps| {
            let mut st = model.new_state(64);
            steps.iter().map(|(tokens, got)| rel_err(got, model.forward(&mut st, tokens, Logits::Last, &mut NoObserver).unwrap())).collect()
        })
        .collect()
}

/// More sequences in a step than a launch's table holds (64): 70 sequences with prompts of one
/// to three tokens, then three decode steps side by side, so that attention and its inputs go
/// as two launches (and the kept experts' steps of up to 70 tokens through the host's grouping
/// and through the kept experts at 80); each one's logits against the same steps run alone,
/// within the three-sequence test's bound.
#[test]
fn seventy_sequences_in_a_step_match_each_alone_on_the_gpu() {
    let name = "qwen3_moe";
    for kept_tokens in [None, Some(80)] {
        let Some(model) = gpu_model(name, &CudaOptions { kept_tokens, ..Default::default() }) else { return };
        let worst = seventy_against_alone(&model, name, 1, 100);
        eprintln!(
            "{name}: 70 sequences batched vs alone on the GPU (kept tokens {kept_tokens:?}), largest relative logit error {worst:.2e}"
        );
        assert!(worst < 1e-4, "{name}: 70 batched sequences differ from alone by {worst:.2e}");
    }
}

/// Seventy sequences again, each with a prompt of 30 to 35 tokens prefilled in one step (run
/// on the host's grouping: a prompt's tokens stay off the tiles), then three decode steps at 31
/// to 38 positions, where a row's attention splits (the split scratch serves both launches of
/// 64 and 6). Q4_K experts (qwen3_moe_k): the decode steps' 70 tokens on the kept tiles (no
/// sequence brings more than one), against the host's grouping for every step; within the int8
/// batched test's bound, except where the step routed the sequence's token differently from
/// alone at a near-tie (see [`seventy_on_tiles_against_alone`]).
#[test]
fn seventy_sequences_on_the_kept_tiles_match_each_alone_on_the_gpu() {
    let tiles = CudaOptions::default();
    let grouped = CudaOptions { kept_tokens: Some(4), ..Default::default() };
    int8_batched_within_bound(
        (Format::Q4_K.into(), Format::Q8_0),
        &[("70 sequences, decode steps on the kept tiles", tiles, true), ("70 sequences, every step grouped on the host", grouped, false)],
        seventy_on_tiles_against_alone,
    );
}

/// The largest error of [`seventy_sequences_on_the_kept_tiles_match_each_alone_on_the_gpu`]'s
/// steps against alone, leaving out (and printing) a decode step past the int8 bound only
/// where a layer routed its token apart from alone at a near-tie. The prompts' 2,275 tokens
/// prefill on the int8 tiles, each prompt alone (30 to 35 tokens) on the mat-vecs, so their
/// keys and values differ in the last bits; on an H100 that swapped one token's expert 7
/// (score 0.21118 alone) for expert 2 (0.21111) at one layer, and its logits moved by 3.4e-1.
/// The routes are recorded in a second run of the batch routed on the host (an observer
/// turns the kept paths off), so that run must give the step's logits within a tenth of its
/// error from the run under test; every expert swapped in must have scored within 0.5% of the
/// one it replaced alone, no score may have moved by more than 2% of the top one, the error
/// stays below 1, and at most two of the 280 steps go this way.
fn seventy_on_tiles_against_alone(model: &Model<CudaBackend>) -> f64 {
    let (name, schedule) = ("qwen3_moe_k", (70, 30, 6, 200));
    let record = batched_record(model, name, schedule, 1, None);
    let errors = errors_against_alone(model, &record);
    let steps = || errors.iter().enumerate().flat_map(|(i, e)| e.iter().enumerate().map(move |(s, &e)| (i, s, e)));
    let over: Vec<(usize, usize)> = steps().filter(|&(_, _, e)| e >= 2e-2).map(|(i, s, _)| (i, s)).collect();
    if !over.is_empty() {
        let mut routes = Vec::new();
        let routed_on_host = batched_record(model, name, schedule, 1, Some((&mut routes, 0)));
        for &(i, s) in &over {
            let flips = route_flips(model, &record[i][..=s], &routes[s], i);
            let apart = rel_err(&routed_on_host[i][s].1, &record[i][s].1);
            eprintln!(
                "  step {s} of sequence {i} at {:.2e} from alone ({apart:.2e} from the host-routed batch), routed apart at (layer, experts alone, gap, drift) {flips:?}",
                errors[i][s]
            );
            let near_ties = !flips.is_empty() && flips.iter().all(|f| f.2 < 5e-3 && f.3 < 2e-2);
            assert!(
                s > 0 && near_ties && apart < errors[i][s] / 10.0 && errors[i][s] < 1.0,
                "step {s} of sequence {i}: {:.2e} from alone, {apart:.2e} from the host-routed batch, routed apart at {flips:?}",
                errors[i][s]
            );
        }
        assert!(over.len() <= 2, "{} steps past the int8 bound: {over:?}", over.len());
    }
    steps().filter(|&(i, s, _)| !over.contains(&(i, s))).fold(0f64, |a, (_, _, e)| a.max(e))
}

/// The layers at which a decode step (the last of `steps`, one token) routed its token in a
/// batch (`batched`, the step's routes with the sequence in `row`) to other experts than alone:
/// (layer, the experts alone, the largest relative gap alone between an expert the batch
/// dropped and one it took instead, the largest move of any expert's score from alone to the
/// batch relative to the top score alone).
fn route_flips(
    model: &Model<CudaBackend>,
    steps: &[(Vec<u32>, Vec<f32>)],
    batched: &Routes,
    row: usize,
) -> Vec<(usize, Vec<u32>, f32, f32)> {
    let mut st = model.new_state(64);
    let mut alone = Routes::default();
    for (tokens, _) in steps {
        alone.0.clear();
        model.forward(&mut st, tokens, smoe_engine::Logits::Last, &mut alone).unwrap();
    }
    let sorted = |v: &[u32]| {
        let mut v = v.to_vec();
        v.sort();
        v
    };
    let mut flips = Vec::new();
    for (layer, experts, choice) in &alone.0 {
        let (_, got, got_choice) = batched.0.iter().filter(|r| r.0 == *layer).nth(row).expect("the step's route at this layer");
        if sorted(got) == sorted(experts) {
            continue;
        }
        let rel = |a: f32, b: f32| (a - b).abs() / a.abs().max(b.abs()).max(f32::MIN_POSITIVE);
        let added: Vec<u32> = got.iter().copied().filter(|e| !experts.contains(e)).collect();
        let gap = experts
            .iter()
            .filter(|e| !got.contains(e))
            .flat_map(|&d| added.iter().map(move |&a| rel(choice[d as usize], choice[a as usize])))
            .fold(0f32, f32::max);
        let top = choice.iter().fold(f32::MIN_POSITIVE, |m, c| m.max(c.abs()));
        let drift = choice.iter().zip(got_choice).fold(0f32, |m, (a, b)| m.max((a - b).abs() / top));
        flips.push((*layer, sorted(experts), gap, drift));
    }
    flips
}

/// Seventy sequences of the `long` text batched, sequence i with a prompt of `shortest + i % 3`
/// tokens from position i (`shortest` 1) or `shortest + i % 6`, then three decode tokens from
/// position `decode_at + i`; then each sequence's steps again alone: the largest relative error.
fn seventy_against_alone(model: &Model<CudaBackend>, name: &str, shortest: usize, decode_at: usize) -> f64 {
    let spread = if shortest == 1 { 3 } else { 6 };
    worst_against_alone(model, &batched_record(model, name, (70, shortest, spread, decode_at), 1, None))
}

/// Each MoE layer's choice for every token of the calls it watched, in call order: (layer,
/// chosen experts, the scores they were chosen on).
#[derive(Default)]
struct Routes(Vec<(usize, Vec<u32>, Vec<f32>)>);
impl smoe_engine::Observer for Routes {
    fn route(&mut self, layer: usize, _pos: usize, experts: &[u32], _weights: &[f32], choice: &[f32]) {
        self.0.push((layer, experts.to_vec(), choice.to_vec()));
    }
}

/// `count` sequences of the `long` text batched, sequence i with a prompt of `shortest + i %
/// spread` tokens from position i, then three decode tokens from position `decode_at + i`, each
/// state reserving `reserve` positions: what each ran per step and the logits it got.
fn batched_record(
    model: &Model<CudaBackend>,
    name: &str,
    (count, shortest, spread, decode_at): (usize, usize, usize, usize),
    reserve: usize,
    mut routes: Option<(&mut Vec<Routes>, usize)>,
) -> Vec<Vec<(Vec<u32>, Vec<f32>)>> {
    use smoe_engine::{BatchItem, NoObserver, Observer};
    let long = input_ids(name, "long");
    let prompts: Vec<Vec<u32>> = (0..count).map(|i| long[i..i + shortest + i % spread].to_vec()).collect();
    let decode: Vec<Vec<u32>> = (0..count).map(|i| long[decode_at + i..decode_at + 3 + i].to_vec()).collect();
    let vocab = model.arch().vocab_size;
    let mut states: Vec<_> = (0..count).map(|_| model.new_state(reserve)).collect();
    let mut batch = model.new_batch((shortest + spread) * count);
    let mut record: Vec<Vec<(Vec<u32>, Vec<f32>)>> = vec![Vec::new(); count];
    for step in 0..4 {
        let inputs: Vec<Vec<u32>> = (0..count).map(|i| if step == 0 { prompts[i].clone() } else { vec![decode[i][step - 1]] }).collect();
        // `routes` asks for the step's choices too (routing on the host), and rotates the
        // sequences' rows in the step by its second part: sequence i goes in row i - rotate.
        let rotate = routes.as_ref().map_or(0, |r| r.1 % count);
        let mut items: Vec<BatchItem<'_, _>> = states.iter_mut().zip(&inputs).map(|(state, tokens)| BatchItem { state, tokens }).collect();
        items.rotate_left(rotate);
        let mut watched = Routes::default();
        let obs: &mut dyn Observer = if routes.is_some() { &mut watched } else { &mut NoObserver };
        let logits = model.forward_batch(&mut batch, &mut items, obs).unwrap().to_vec();
        for i in 0..count {
            let row = (i + count - rotate) % count;
            record[i].push((inputs[i].clone(), logits[row * vocab..(row + 1) * vocab].to_vec()));
        }
        if let Some((r, _)) = routes.as_mut() {
            r.push(watched);
        }
    }
    record
}

/// DeepSeek-V4's sliding and raw rows and gpt-oss's sliding layers keep only what attention
/// reads (plus a rewind margin, 8 here) on the GPU too: step decode over the 300-token text
/// gives the logits of a cache that keeps every row, bit for bit, from a smaller cache;
/// truncation within the margin continues, beyond it starts over, and a prefix copy within it
/// continues as the original does.
#[test]
fn bounded_layers_drop_old_rows_on_the_gpu() {
    use smoe_engine::{Backend, Logits, NoObserver, State};
    for name in ["deepseek_v4", "gpt_oss"] {
        let Some(mut all) = gpu_model(name, &CudaOptions::default()) else { return };
        all.set_kv_rewind(1 << 20);
        let mut some = gpu_model(name, &CudaOptions::default()).unwrap();
        some.set_kv_rewind(8);
        let r = read_safetensors(&fixture(name).join("reference.safetensors"));
        let (input, expect) = (ids(&r["long.input_ids"]), r["long.logits"].f32());
        let vocab = some.arch().vocab_size;
        let step = |m: &Model<CudaBackend>, st: &mut State<CudaBackend>, from: usize| -> Vec<f32> {
            let mut out = Vec::new();
            for &t in &input[from..] {
                out.extend_from_slice(m.forward(st, &[t], Logits::Last, &mut NoObserver).unwrap());
            }
            out
        };
        let (mut full_st, mut st) = (all.new_state(1), some.new_state(1));
        let (a, b) = (step(&all, &mut full_st, 0), step(&some, &mut st, 0));
        let (full, dropped) = (all.backend().kv_bytes(full_st.kv()), some.backend().kv_bytes(st.kv()));
        let e = rel_err(&b, expect);
        eprintln!("{name}: KV cache after 300 tokens on the GPU: {dropped} bytes with old rows dropped, {full} with every row; {e:.2e} from transformers");
        assert!(a == b, "{name}: dropping rows moved the logits by {:.2e}", rel_err(&a, &b));
        assert!(e < 1e-3 && dropped < full, "{name}: {e:.2e} from transformers, {dropped} of {full} bytes");
        st.truncate(295);
        assert_eq!(st.pos(), 295, "{name}: 5 back is within the margin");
        assert!(step(&some, &mut st, 295) == a[295 * vocab..], "{name}: truncated within the margin");
        let mut copy = some.new_state(1);
        assert!(copy.copy_prefix(&some, &st, 296), "{name}: a prefix within the margin");
        assert!(step(&some, &mut copy, 296) == a[296 * vocab..], "{name}: continued from a prefix copy");
        assert!(!copy.copy_prefix(&some, &st, 200), "{name}: 100 back is beyond the margin");
        st.truncate(200);
        assert_eq!(st.pos(), 0, "{name}: 100 back is beyond the margin: start over");
    }
}

/// A diagnostic, not a check (run it by name with `--ignored` on the device): the schedule of
/// `seventy_sequences_on_the_kept_tiles_match_each_alone_on_the_gpu` with `COUNT` sequences,
/// prompts of `SHORTEST` to `SHORTEST + SPREAD - 1` tokens, decode from `DECODE_AT`, states
/// reserving `RESERVE` positions; prints each step's largest error against alone and every
/// (step, sequence) past 0.05. On an H100 (2026-12-06) that test failed at 3.38e-1: only the
/// first decode step after the prompts, only sequence 66 (COUNT 64: 1.2e-2; steps 2 and 3:
/// 1.3e-2), the same with the batched attention off, with the tiles off and with every step
/// grouped on the host, with the states' caches reserved up front, and with the decode steps'
/// dense products as mat-vecs (`SMOE_CUDA_DENSE_MV=128`). `ROUTES=1` routes on the host and
/// prints, for each decode step past 0.05, the layers whose choice differs from the sequence's
/// alone, with how near the tie was; `ROTATE=r` puts sequence i in row i - r. With them (H100,
/// 2026-12-06, twenty-third session): sequence 66's token chose experts 2 and 4 at layer 1
/// where alone it chose 4 and 7, and alone expert 7 had scored 0.21118 against expert 2's
/// 0.21111, in any row of the step: a near-tie, which the test now tells apart from a wrong result.
#[test]
#[ignore]
fn diag_seventy() {
    let env = |k: &str, d: usize| std::env::var(k).ok().and_then(|v| v.parse().ok()).unwrap_or(d);
    let (count, shortest, spread, decode_at) = (env("COUNT", 70), env("SHORTEST", 30), env("SPREAD", 6), env("DECODE_AT", 200));
    let name = "qwen3_moe_k";
    let Some(probe) = backend(&CudaOptions::default()) else { return };
    drop(probe);
    let v = smoe_vault::Vault::open(vault(name, Format::Q4_K, Format::Q8_0)).unwrap();
    let model = Model::load(&v, backend(&CudaOptions::default()).unwrap(), Arc::new(ResidentExperts::load(&v).unwrap())).unwrap();
    let (watch, rotate) = (env("ROUTES", 0) == 1, env("ROTATE", 0));
    let mut routes = Vec::new();
    let record =
        batched_record(&model, name, (count, shortest, spread, decode_at), env("RESERVE", 1), watch.then_some((&mut routes, rotate)));
    let errors = errors_against_alone(&model, &record);
    if watch {
        // Where a decode step went far from alone: the layers whose choice differs, with how
        // near the tie was alone.
        for (i, steps) in errors.iter().enumerate() {
            for (s, &e) in steps.iter().enumerate().skip(1).filter(|(_, &e)| e > 0.05) {
                let flips = route_flips(&model, &record[i][..=s], &routes[s], (i + count - rotate % count) % count);
                eprintln!("  step {s} sequence {i} ({e:.2e}): routed apart from alone at (layer, experts alone, gap, drift) {flips:?}");
            }
        }
    }
    let mut worst = [(0f64, 0usize); 4];
    for (i, steps) in errors.iter().enumerate() {
        for (s, &e) in steps.iter().enumerate() {
            if e > 0.05 {
                eprintln!("  step {s} sequence {i} ({} tokens): {e:.2e}", record[i][s].0.len());
            }
            if e > worst[s].0 {
                worst[s] = (e, i);
            }
        }
    }
    let worst: Vec<String> = worst.iter().map(|(e, i)| format!("{e:.2e} (sequence {i})")).collect();
    eprintln!("count {count} shortest {shortest} spread {spread}: worst per step {}", worst.join(", "));
}
