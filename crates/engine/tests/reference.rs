//! The engine against Hugging Face transformers on every fixture family, with BF16 vaults:
//! logits in prefill and step-by-step decode, routing (expert sets and weights), greedy tokens.
//! And quantized vaults against a reference run on their dequantized weights.

mod common;
use common::*;
use smoe_convert::ExpertFormats;
use smoe_engine::{score, Backend, Logits, NoObserver, ScoreMode};
use smoe_quant::Format;

const ENGINE_FIXTURES: [&str; 5] = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "qwen3_moe_yarn"];
const GLM_DEEPSEEK_FIXTURES: [&str; 3] = ["glm4_moe", "deepseek_v3", "deepseek_v3_yarn"];

fn ids(t: &Tensor) -> Vec<u32> {
    t.i32().iter().map(|&x| x as u32).collect()
}

fn check_fixture(name: &str) {
    check_vault(name, Format::BF16.into(), Format::BF16);
}

/// The fixture's vault with `experts` and `dense` formats against transformers' reference.
fn check_vault(name: &str, experts: ExpertFormats, dense: Format) {
    let model = load(&vault(name, experts, dense));
    let r = read_safetensors(&fixture(name).join("reference.safetensors"));
    let (vocab, k) = (model.arch().vocab_size, model.arch().moe.top_k);
    for tag in ["chat", "long"] {
        let input = ids(&r[&format!("{tag}.input_ids")]);
        let expect = r[&format!("{tag}.logits")].f32();
        for mode in [ScoreMode::Prefill, ScoreMode::Decode] {
            let out = score(&model, &input, mode, 64, false).unwrap();
            let e = rel_err(&out.logits, expect);
            eprintln!("{name} {tag} {mode:?}: logits rel err {e:.2e}");
            assert!(e < 1e-4, "{name} {tag} {mode:?}: logits rel err {e:.2e}");
            // Routing, layer by layer: same expert sets except at near-ties, same weights.
            let mut near_ties = 0;
            for (layer, routes) in &out.routes {
                let key = format!("{tag}.route.model.layers.{layer}.mlp");
                let (re, rw) = (r[&format!("{key}.experts")].i32(), r[&format!("{key}.weights")].f32());
                let e_count = routes.choice.len() / input.len();
                for t in 0..input.len() {
                    let mut mine: Vec<(i32, f32)> = (0..k).map(|s| (routes.experts[t * k + s], routes.weights[t * k + s])).collect();
                    let mut theirs: Vec<(i32, f32)> = (0..k).map(|s| (re[t * k + s], rw[t * k + s])).collect();
                    mine.sort_by_key(|x| x.0);
                    theirs.sort_by_key(|x| x.0);
                    if mine.iter().map(|x| x.0).ne(theirs.iter().map(|x| x.0)) {
                        let mut c = routes.choice[t * e_count..(t + 1) * e_count].to_vec();
                        c.sort_by(|a, b| b.partial_cmp(a).unwrap());
                        assert!(
                            (c[k - 1] - c[k]).abs() < 1e-5,
                            "{name} {tag} {mode:?} layer {layer} pos {t}: experts {mine:?} vs {theirs:?}"
                        );
                        near_ties += 1;
                        continue;
                    }
                    for (a, b) in mine.iter().zip(&theirs) {
                        assert!((a.1 - b.1).abs() < 1e-4, "{name} {tag} layer {layer} pos {t}: weights {mine:?} vs {theirs:?}");
                    }
                }
            }
            assert!(near_ties <= 2, "{name}: {near_ties} near-tie routing differences");
        }
    }
    // Greedy continuation, teacher-forced on the reference tokens so one near-tie cannot cascade:
    // every step whose reference margin exceeds 1e-3 picks the reference token.
    let chat = ids(&r["chat.input_ids"]);
    let (tokens, margins, full) = (ids(&r["greedy.tokens"]), r["greedy.margins"].f32(), r["greedy.full_logits"].f32());
    let mut st = model.new_state(16);
    let mut logits = model.forward(&mut st, &chat, Logits::Last, &mut NoObserver).unwrap().to_vec();
    for (i, &tok) in tokens.iter().enumerate() {
        let pos = chat.len() - 1 + i;
        let e = rel_err(&logits, &full[pos * vocab..(pos + 1) * vocab]);
        assert!(e < 1e-4, "{name} greedy step {i}: rel err {e:.2e}");
        let argmax = logits.iter().enumerate().fold(0, |b, (j, &x)| if x > logits[b] { j } else { b }) as u32;
        if margins[i] > 1e-3 {
            assert_eq!(argmax, tok, "{name} greedy step {i} (margin {})", margins[i]);
        }
        logits = model.forward(&mut st, &[tok], Logits::Last, &mut NoObserver).unwrap().to_vec();
    }
}

#[test]
fn qwen_mixtral_olmoe_match_transformers() {
    for name in ENGINE_FIXTURES {
        check_fixture(name);
    }
}

#[test]
fn glm_and_deepseek_match_transformers() {
    for name in GLM_DEEPSEEK_FIXTURES {
        check_fixture(name);
    }
}

/// Records DeepSeek Sparse Attention's choices: (layer, position) → positions.
#[derive(Default)]
struct Selections(std::collections::BTreeMap<(usize, usize), Vec<u32>>);

impl smoe_engine::Observer for Selections {
    fn wants_routes(&self) -> bool {
        false
    }
    fn selected(&mut self, layer: usize, pos: usize, positions: &[u32]) {
        self.0.insert((layer, pos), positions.to_vec());
    }
}

/// GLM-5 (`glm_moe_dsa`): latent attention with DeepSeek Sparse Attention. The fixture's
/// indexer keeps 32 positions, so both the 52-token chat prompt and the 300-token text attend
/// sparsely past position 32 (and densely before); layer 2 reuses layer 1's selection. Beyond
/// the logits, routing and greedy checks, every query's selected positions at every layer that
/// runs an indexer equal transformers', in one prefill and in chunks of 7 tokens.
#[test]
fn glm5_sparse_attention_matches_transformers() {
    let name = "glm_moe_dsa";
    check_fixture(name);
    let model = load(&vault(name, Format::BF16, Format::BF16));
    let top = model.arch().sparse_attention.as_ref().unwrap().top_k;
    let r = read_safetensors(&fixture(name).join("reference.safetensors"));
    for tag in ["chat", "long"] {
        let input = ids(&r[&format!("{tag}.input_ids")]);
        for chunk in [input.len(), 7] {
            let seen = run_selections(&model, &input, chunk);
            for layer in model.arch().indexer_layers() {
                let theirs = &r[&format!("{tag}.index.model.layers.{layer}.self_attn.indexer")];
                for p in top..input.len() {
                    assert_eq!(kept(&seen.0[&(layer, p)]), picks(theirs, p), "{tag} layer {layer} position {p} (chunks of {chunk})");
                }
            }
            assert_eq!(seen.0.len(), model.arch().indexer_layers().len() * (input.len() - top), "{tag}");
        }
    }
}

/// `model`'s indexer picks over `input`, run in chunks of `chunk` tokens.
fn run_selections(model: &smoe_engine::Model<smoe_engine::CpuBackend>, input: &[u32], chunk: usize) -> Selections {
    let mut seen = Selections::default();
    let mut st = model.new_state(chunk);
    for piece in input.chunks(chunk) {
        model.forward(&mut st, piece, Logits::Last, &mut seen).unwrap();
    }
    seen
}

/// A query's picks as the engine reports them, without the unused (`u32::MAX`) tail.
fn kept(row: &[u32]) -> Vec<u32> {
    row.iter().copied().filter(|&j| j != u32::MAX).collect()
}

/// Row `p` of a reference's indexer picks (`[positions, k]`; -1 where a query sees fewer than
/// `k`), ascending.
fn picks(t: &Tensor, p: usize) -> Vec<u32> {
    let k = t.shape()[1];
    let mut want: Vec<u32> = t.i32()[p * k..(p + 1) * k].iter().filter(|&&j| j >= 0).map(|&j| j as u32).collect();
    want.sort_unstable();
    want
}

/// GLM-5 as GLM-5-FP8 ships (DeepSeek-V3's layout): float8 e4m3 linear layers with a
/// `weight_scale_inv` per 128x128 block, read into an F32 vault (float8 times an arbitrary f32
/// scale is not a bf16 value) and checked against transformers in f32 on the weights the blocks
/// stand for: logits, routing and greedy tokens as for every fixture.
#[test]
fn glm5_fp8_checkpoint_matches_transformers() {
    check_vault("glm_moe_dsa_fp8", Format::F32.into(), Format::F32);
}

/// MiniMax-M2: no code of its own in the decoder, only its architecture description (GLM's
/// sigmoid routing with a correction bias, OLMoE's q/k norms over all heads, partial rotary).
#[test]
fn minimax_m2_matches_transformers() {
    check_fixture("minimax_m2");
}

/// gpt-oss: sliding-window and full layers, attention sinks, biases on every projection and
/// expert, the clamped SwiGLU over interleaved gate/up columns, softmax over the top-k of
/// biased router logits, YaRN.
/// Qwen3-Next: Gated DeltaNet layers (their recurrent state carried through prefill chunks and
/// step decode) between gated full attention layers, as transformers computes them.
#[test]
fn qwen3_next_matches_transformers() {
    check_fixture("qwen3_next");
}

/// Qwen3.5-MoE: the same decoder from its multimodal checkpoint (text_config, the
/// `model.language_model.` prefix, split projections, fused experts, a vision tower left out).
#[test]
fn qwen3_5_moe_matches_transformers() {
    check_fixture("qwen3_5_moe");
}

#[test]
fn gpt_oss_matches_transformers() {
    check_fixture("gpt_oss");
}

/// gpt-oss with its experts in the hub's MXFP4 blocks, against transformers on the experts
/// its own `convert_moe_packed_tensors` decodes.
#[test]
fn gpt_oss_mxfp4_matches_transformers() {
    check_fixture("gpt_oss_mxfp4");
}

/// The hub's MXFP4 blocks copied into an MXFP4 vault hold exactly the values transformers
/// decodes: the vault matches the reference itself, not only its own dequantized copy.
#[test]
fn gpt_oss_mxfp4_vault_matches_transformers() {
    let parts = smoe_vault::Vault::open(vault("gpt_oss_mxfp4", Format::MXFP4, Format::BF16)).unwrap().manifest().experts.parts.clone();
    assert!(parts.iter().all(|p| p.format == Format::MXFP4), "{parts:?}");
    check_vault("gpt_oss_mxfp4", Format::MXFP4.into(), Format::BF16);
}

/// gpt-oss's experts quantized by smoe (MXFP4, Q8_0, Q4_0) against f32 math on their
/// dequantized weights.
#[test]
fn quantized_gpt_oss_matches_its_dequantized_reference() {
    check_quantized("gpt_oss", &[(all(Format::MXFP4), Format::BF16), (all(Format::Q8_0), Format::Q8_0), (all(Format::Q4_0), Format::BF16)]);
}

#[test]
fn qwen3_moe_k_matches_transformers() {
    check_fixture("qwen3_moe_k");
}

/// Quantized vaults compute exactly what f32 math on their dequantized weights computes; their
/// distance from the bf16 reference is printed (reported in docs/quality.md, not asserted: on
/// these random tiny models near-tie routing flips under any weight change).
fn check_quantized(name: &str, configs: &[(ExpertFormats, Format)]) {
    let r = read_safetensors(&fixture(name).join("reference.safetensors"));
    let chat = ids(&r["chat.input_ids"]);
    let long = ids(&r["long.input_ids"]);
    for &(experts, dense) in configs {
        let q = vault(name, experts, dense);
        let model = load(&q);
        let reference = load(&dequantized_copy(&q));
        let parts = smoe_vault::Vault::open(&q).unwrap().manifest().experts.parts.clone();
        let used = ExpertFormats { gate: parts[0].format, up: parts[1].format, down: parts[2].format };
        for (tag, input) in [("chat", &chat), ("long", &long)] {
            let want = score(&reference, input, ScoreMode::Prefill, 64, false).unwrap().logits;
            for mode in [ScoreMode::Prefill, ScoreMode::Decode] {
                let got = score(&model, input, mode, 64, false).unwrap().logits;
                let e = rel_err(&got, &want);
                assert!(e < 1e-4, "{name} {experts}/{dense} {tag} {mode:?}: rel err {e:.2e} vs dequantized reference");
            }
            let (top1, kl, max_err) = distance(&want, r[&format!("{tag}.logits")].f32(), model.arch().vocab_size);
            println!("QUALITY|{name}|{experts}|{used}|{dense}|{tag}|{top1:.3}|{kl:.4}|{max_err:.3}");
        }
    }
}

const fn all(f: Format) -> ExpertFormats {
    ExpertFormats::all(f)
}

const QUANT_CONFIGS: [(ExpertFormats, Format); 7] = [
    (all(Format::BF16), Format::Q8_0),
    (all(Format::Q8_0), Format::BF16),
    (all(Format::Q6_K), Format::BF16),
    (all(Format::Q4_K), Format::BF16),
    (all(Format::Q8_0), Format::Q8_0),
    (all(Format::Q6_K), Format::Q8_0),
    (all(Format::Q4_K), Format::Q8_0),
];

/// Low-bit experts and llama.cpp-style mixes (gate/up below down), on the fixture whose rows
/// hold K-quants.
const LOW_BIT_CONFIGS: [(ExpertFormats, Format); 4] = [
    (all(Format::Q3_K), Format::BF16),
    (all(Format::Q2_K), Format::BF16),
    (ExpertFormats { gate: Format::Q3_K, up: Format::Q3_K, down: Format::Q4_K }, Format::BF16),
    (ExpertFormats { gate: Format::Q2_K, up: Format::Q2_K, down: Format::Q3_K }, Format::BF16),
];

#[test]
fn low_bit_expert_mixes_match_their_dequantized_reference() {
    // The fixture's rows hold K-quants, so each matrix is stored as asked (no fallback).
    for (experts, dense) in LOW_BIT_CONFIGS {
        let parts = smoe_vault::Vault::open(vault("qwen3_moe_k", experts, dense)).unwrap().manifest().experts.parts.clone();
        let names: Vec<&str> = parts.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["gate", "up", "down"]);
        assert_eq!(ExpertFormats { gate: parts[0].format, up: parts[1].format, down: parts[2].format }, experts);
    }
    check_quantized("qwen3_moe_k", &LOW_BIT_CONFIGS);
}

/// FP8 experts (each row's 128-value blocks of e4m3 codes with an f32 scale, the form of the
/// block-scaled FP8 checkpoints) in a whole model: on the fixture whose rows hold 128-wide blocks
/// the experts are stored as asked, and prefill and step decode match the model on their
/// dequantized weights.
#[test]
fn fp8_experts_match_their_dequantized_reference() {
    let parts = smoe_vault::Vault::open(vault("qwen3_moe_k", all(Format::FP8), Format::BF16)).unwrap().manifest().experts.parts.clone();
    assert!(parts.iter().all(|p| p.format == Format::FP8), "{parts:?}");
    check_quantized("qwen3_moe_k", &[(all(Format::FP8), Format::BF16)]);
}

#[test]
fn quantized_vaults_match_their_dequantized_reference() {
    for name in ENGINE_FIXTURES {
        check_quantized(name, &QUANT_CONFIGS);
    }
}

#[test]
fn quantized_glm_deepseek_match_their_dequantized_reference() {
    for name in GLM_DEEPSEEK_FIXTURES.into_iter().chain(["glm_moe_dsa"]) {
        check_quantized(name, &QUANT_CONFIGS);
    }
}

#[test]
fn k_quants_on_256_wide_rows_match_their_dequantized_reference() {
    check_quantized("qwen3_moe_k", &QUANT_CONFIGS);
}

/// The production path (`smoe score --fast`: int8 activations, SIMD kernels, the thread pool)
/// against the f32 reference path on the same vault, per fixture: top-1 agreement and mean KL,
/// printed for docs/quality.md. Near-tie routing on these random models means the two can
/// pick different experts, so agreement is reported; the assert only guards against a broken
/// kernel (a wrong kernel gives KL of order 1, these are of order 1e-3 and below).
#[test]
fn fast_path_against_reference_per_fixture() {
    let fast = |path: &std::path::Path| {
        let v = smoe_vault::Vault::open(path).unwrap();
        // As `smoe score --fast` opens it: Q4_K, Q2_K and Q3_K experts interleaved where the
        // kernels read them so.
        let backend = smoe_engine::CpuBackend::new(smoe_engine::Precision::Fast);
        let map = smoe_store::ExpertMap::of_vault(&v).unwrap().interleaved(&smoe_engine::Backend::interleaved_expert_formats(&backend));
        let ex = std::sync::Arc::new(smoe_store::ResidentExperts::load_map(map).unwrap());
        smoe_engine::Model::load(&v, backend, ex).unwrap()
    };
    let all = ENGINE_FIXTURES.iter().chain(&GLM_DEEPSEEK_FIXTURES).chain(&["qwen3_moe_k", "gpt_oss", "gpt_oss_mxfp4", "glm_moe_dsa"]);
    for &name in all {
        let r = read_safetensors(&fixture(name).join("reference.safetensors"));
        let input = ids(&r["long.input_ids"]);
        // The hub's MXFP4 experts run as they are, on the MXFP4 kernels.
        let configs: Vec<(ExpertFormats, Format)> = if name == "gpt_oss_mxfp4" {
            vec![(ExpertFormats::all(Format::MXFP4), Format::BF16), (ExpertFormats::all(Format::MXFP4), Format::Q8_0)]
        } else if name == "qwen3_moe_k" {
            // Its 256-wide rows hold K-quants: Q2_K and Q3_K experts too, interleaved for
            // their group kernels as Q4_K's are.
            let mix = ExpertFormats { gate: Format::Q2_K, up: Format::Q2_K, down: Format::Q3_K };
            vec![(ExpertFormats::all(Format::BF16), Format::BF16), (ExpertFormats::all(Format::Q4_K), Format::Q8_0), (mix, Format::Q8_0)]
        } else {
            vec![(ExpertFormats::all(Format::BF16), Format::BF16), (ExpertFormats::all(Format::Q4_K), Format::Q8_0)]
        };
        for (experts, dense) in configs {
            let path = vault(name, experts, dense);
            let (reference, production) = (load(&path), fast(&path));
            let vocab = reference.arch().vocab_size;
            for mode in [ScoreMode::Prefill, ScoreMode::Decode] {
                let want = score(&reference, &input, mode, 64, false).unwrap().logits;
                let got = score(&production, &input, mode, 64, false).unwrap().logits;
                let (top1, kl, max_err) = distance(&got, &want, vocab);
                println!("FAST|{name}|{experts}/{dense}|{mode:?}|{top1:.3}|{kl:.5}|{max_err:.1e}");
                assert!(kl < 0.05, "{name} {experts}/{dense} {mode:?}: fast path KL {kl} from the reference path");
            }
        }
    }
}

/// Positions past `original_max_position_embeddings` on the YaRN fixtures (the references of
/// `testdata/extend_yarn_references.py`), in one prefill and step by step after a prefill to the
/// first compared position.
#[test]
fn yarn_past_the_original_context_matches_transformers() {
    for name in ["qwen3_moe_yarn", "deepseek_v3_yarn"] {
        let model = load(&vault(name, Format::BF16, Format::BF16));
        let r = read_safetensors(&fixture(name).join("reference_past.safetensors"));
        let (input, expect) = (ids(&r["past.input_ids"]), r["past.logits"].f32());
        let first = r["past.first"].i32()[0] as usize;
        let orig = match model.arch().rope.scaling {
            smoe_vault::RopeScaling::Yarn { original_max_position_embeddings, .. } => original_max_position_embeddings,
            _ => panic!("{name} is not a YaRN fixture"),
        };
        assert!(first >= orig && input.len() > first, "{name}: positions {first}..{} are not past {orig}", input.len());
        let out = score(&model, &input, ScoreMode::Prefill, smoe_engine::PREFILL_CHUNK, false).unwrap();
        let vocab = model.arch().vocab_size;
        let e = rel_err(&out.logits[first * vocab..], expect);
        assert!(e < 1e-4, "{name} prefill past position {orig}: logits rel err {e:.2e}");
        let mut st = model.new_state(smoe_engine::PREFILL_CHUNK);
        model.forward(&mut st, &input[..first], Logits::Last, &mut NoObserver).unwrap();
        for (i, &tok) in input[first..].iter().enumerate() {
            let got = model.forward(&mut st, &[tok], Logits::Last, &mut NoObserver).unwrap();
            let e = rel_err(got, &expect[i * vocab..(i + 1) * vocab]);
            assert!(e < 1e-4, "{name} decode at position {}: logits rel err {e:.2e}", first + i);
        }
    }
}

/// DeepSeek-V4 (`deepseek_v4`) from the hub layout: every attention kind (sliding only,
/// compressed sparse with the lightning indexer keeping 8 entries, heavily compressed),
/// hyper-connections, hash-routed then sqrt-softplus-routed layers, the clipped SwiGLU. Beyond
/// the logits, routing and greedy checks, the entries each CSA query attends to equal
/// transformers' picks, in one prefill and in chunks of 7 tokens (windows then close across
/// chunks).
#[test]
fn deepseek_v4_matches_transformers() {
    let name = "deepseek_v4";
    check_fixture(name);
    let model = load(&vault(name, Format::BF16, Format::BF16));
    let ca = model.arch().compressed_attention.clone().unwrap();
    let r = read_safetensors(&fixture(name).join("reference.safetensors"));
    let csa: Vec<usize> = (0..ca.compression.len()).filter(|&l| ca.compression[l].overlaps()).collect();
    for tag in ["chat", "long"] {
        let input = ids(&r[&format!("{tag}.input_ids")]);
        for chunk in [input.len(), 7] {
            let seen = run_selections(&model, &input, chunk);
            let mut queries = 0;
            for &layer in &csa {
                let rate = ca.compression[layer].rate();
                let theirs = &r[&format!("{tag}.index.model.layers.{layer}.self_attn.compressor.indexer")];
                // A query sees the entries of the windows closed by its position; before the
                // first closes there is nothing to pick.
                for p in (rate - 1)..input.len() {
                    assert_eq!(kept(&seen.0[&(layer, p)]), picks(theirs, p), "{tag} layer {layer} position {p} (chunks of {chunk})");
                }
                queries += input.len() - (rate - 1);
            }
            assert_eq!(seen.0.len(), queries, "{tag}: picks reported for queries that see no entry");
        }
    }
}

/// DeepSeek-V4 as deepseek-ai ships it: float8 e4m3 linear layers with a ue8m0 scale per
/// 128x128 block, FP4 routed experts (int8-packed e2m1, a ue8m0 scale per 32 columns). The
/// reference is transformers in float32 on the weights the codes stand for (which
/// transformers' own FP8/FP4 dequantization gives exactly). Read into an F32 vault, and into an
/// MXFP4 expert vault with bf16 dense weights, which hold those values exactly: the FP4 blocks
/// go in as they are, no detour through another format, and both match to the usual tolerance.
#[test]
fn deepseek_v4_fp8_fp4_checkpoint_matches_transformers() {
    check_vault("deepseek_v4_fp4", Format::F32.into(), Format::F32);
    check_vault("deepseek_v4_fp4", Format::MXFP4.into(), Format::BF16);
}

/// DeepSeek-V4 drops its sliding and raw rows beyond what attention reads plus the rewind
/// margin. With a margin of 8 positions (rows dropped a block of 128 at a time), the 300-token text in
/// chunks of 7 still matches transformers at every position; the cache ends up smaller than
/// one that keeps every row; truncating back within the margin continues from the cache (the
/// logits of the re-run tail equal the reference), further back starts over from 0 (and still
/// matches), and a prefix copy from further back than the margin is refused.
#[test]
fn deepseek_v4_drops_old_rows_and_still_matches() {
    let (full, dropped) = bounded_cache_matches("deepseek_v4");
    assert!(dropped * 2 < full, "{dropped} bytes with rows dropped, {full} with every row");
}

/// Runs fixture `name`'s 300-token text with a rewind margin of 8 against transformers: from
/// scratch, after a truncation 5 back (within the margin: continues), on a prefix copy, and
/// after a truncation 100 back (beyond it: starts over; a copy from there is refused). Returns
/// the KV bytes after the text with every row kept and with old rows dropped.
fn bounded_cache_matches(name: &str) -> (usize, usize) {
    let path = vault(name, Format::BF16, Format::BF16);
    let r = read_safetensors(&fixture(name).join("reference.safetensors"));
    let (input, expect) = (ids(&r["long.input_ids"]), r["long.logits"].f32());
    let kv_bytes = |model: &smoe_engine::Model<smoe_engine::CpuBackend>| {
        let mut st = model.new_state(7);
        model.forward(&mut st, &input, Logits::Last, &mut NoObserver).unwrap();
        model.backend().kv_bytes(st.kv())
    };
    let mut keep_all = load(&path);
    keep_all.set_kv_rewind(1 << 20);
    let mut model = load(&path);
    model.set_kv_rewind(8);
    let (full, dropped) = (kv_bytes(&keep_all), kv_bytes(&model));
    eprintln!("{name}: KV cache after 300 tokens: {dropped} bytes with old rows dropped, {full} with every row");
    let vocab = model.arch().vocab_size;
    let run = |st: &mut smoe_engine::State<_>, from: usize| {
        let logits = model.forward(st, &input[from..], Logits::All, &mut NoObserver).unwrap().to_vec();
        let e = rel_err(&logits, &expect[from * vocab..]);
        assert!(e < 1e-4, "{name} from {from}: logits rel err {e:.2e}");
    };
    let mut st = model.new_state(7);
    run(&mut st, 0);
    st.truncate(295);
    assert_eq!(st.pos(), 295, "5 back is within the margin");
    run(&mut st, 295);
    let mut copy = model.new_state(7);
    assert!(copy.copy_prefix(&model, &st, 296));
    run(&mut copy, 296);
    assert!(!copy.copy_prefix(&model, &st, 200), "100 back is beyond the margin");
    st.truncate(200);
    assert_eq!(st.pos(), 0, "100 back is beyond the margin: start over");
    run(&mut st, 0);
    (full, dropped)
}

/// gpt-oss's sliding layers (window 8 in the fixture) read `window - 1` rows back: with a
/// rewind margin of 8 their cache keeps that and drops older rows a block of 128 at a time
/// (full attention layers keep every row). The 300-token text still matches transformers from
/// a smaller cache; the fast path gives the same bits as a cache that keeps every
/// row, in prefill and in decode (whole blocks are dropped, so every row's arithmetic is the
/// same); truncation within and beyond the margin and prefix copies behave as DeepSeek-V4's.
#[test]
fn gpt_oss_sliding_layers_drop_old_rows_and_still_match() {
    let (full, dropped) = bounded_cache_matches("gpt_oss");
    // 2 of 4 layers slide: at most 15 + 128 + 7 of their 300 rows stay.
    assert!(dropped * 10 < full * 8, "{dropped} bytes with rows dropped, {full} with every row");
    let path = vault("gpt_oss", Format::BF16, Format::BF16);
    let r = read_safetensors(&fixture("gpt_oss").join("reference.safetensors"));
    let input = ids(&r["long.input_ids"]);

    // The fast path: bit for bit with every row kept, prefill in chunks of 64 and step decode.
    let fast = |rewind: usize| {
        let v = smoe_vault::Vault::open(&path).unwrap();
        let ex = std::sync::Arc::new(smoe_store::ResidentExperts::load(&v).unwrap());
        let mut m = smoe_engine::Model::load(&v, smoe_engine::CpuBackend::new(smoe_engine::Precision::Fast), ex).unwrap();
        m.set_kv_rewind(rewind);
        m
    };
    let (all_rows, some_rows) = (fast(1 << 20), fast(0));
    for chunk in [64, 1] {
        let logits = |m: &smoe_engine::Model<smoe_engine::CpuBackend>| {
            let mut st = m.new_state(chunk);
            let mut out = Vec::new();
            for piece in input.chunks(chunk) {
                out.extend_from_slice(m.forward(&mut st, piece, Logits::All, &mut NoObserver).unwrap());
            }
            (out, m.backend().kv_bytes(st.kv()))
        };
        let ((want, full), (got, dropped)) = (logits(&all_rows), logits(&some_rows));
        assert!(got == want, "chunks of {chunk}: logits differ when rows are dropped");
        assert!(dropped < full, "chunks of {chunk}: {dropped} bytes, {full} with every row");
    }
}

/// DeepSeek-V4's float8 layers held as published, in MXFP8 (each 32 e4m3 codes with their
/// block's e8m0 exponent, copied), its FP4 experts in MXFP4: the vault's weights are the
/// checkpoint's exactly (other dense layers stay bf16), so the reference holds to the usual
/// tolerance on the f32 path.
#[test]
fn deepseek_v4_in_mxfp8_and_mxfp4_as_published() {
    check_vault("deepseek_v4_fp4", Format::MXFP4.into(), Format::MXFP8);
    let v = smoe_vault::Vault::open(vault("deepseek_v4_fp4", Format::MXFP4, Format::MXFP8)).unwrap();
    assert_eq!(v.dense("layers.1.attn.q_b").unwrap().format, Format::MXFP8);
    assert_eq!(v.dense("layers.1.attn.cmp_kv").unwrap().format, Format::BF16);
}
