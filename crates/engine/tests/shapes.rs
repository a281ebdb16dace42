//! Shape property test: random valid architectures of every family, each run through the
//! engine in every way a sequence can reach it (one prefill, prefill in several chunks, step
//! decode, prefix reuse), at both precisions, with no panic and the same logits.
//!
//! Each case is a random config.json in the hub layout (so the config reader is exercised too),
//! with head, rope, nope, value and latent widths drawn both below and above `hidden_size`,
//! q-lora on and off, dense layers first, shared experts, expert groups, tied embeddings and
//! default, linear and YaRN rope. Weights are random (`synth_vault_from_config`), in BF16 or
//! quantized where the widths allow. Cases are seeded: `SMOE_SHAPE_SEED=N` re-runs one case,
//! `SMOE_SHAPE_CASES=N` runs more; a failure prints its seed and config.

mod common;
use common::rel_err;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng};
use serde_json::{json, Value};
use smoe_convert::synth::{synth_vault_from_config, SynthOptions};
use smoe_convert::{ShatterOptions, Silent};
use smoe_engine::{CpuBackend, Logits, Model, Observer, Precision, ScoreMode};
use smoe_quant::Format;
use std::collections::BTreeMap;
use std::sync::Arc;

/// Seeded draws of shapes.
struct Rng(StdRng);
impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(StdRng::seed_from_u64(seed))
    }
    fn next(&mut self) -> u64 {
        self.0.random()
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: usize, hi: usize) -> usize {
        self.0.random_range(lo..=hi)
    }
    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.range(0, v.len() - 1)]
    }
    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
    /// An even width in `lo..=hi`.
    fn even(&mut self, lo: usize, hi: usize) -> usize {
        self.range(lo / 2, hi / 2) * 2
    }
}

const FAMILIES: [&str; 10] =
    ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3", "minimax_m2", "gpt_oss", "glm_moe_dsa", "qwen3_next"];

/// A random valid config.json of `family`. Widths are drawn around `hidden` so that every
/// product is sometimes wider and sometimes narrower than the residual stream.
fn random_config(family: &str, r: &mut Rng) -> Value {
    let hidden = r.pick(&[16, 24, 32, 40, 64]);
    let layers = r.range(1, 3);
    let heads = r.range(1, 8);
    let kv_heads = {
        let divisors: Vec<usize> = (1..=heads).filter(|&d| heads.is_multiple_of(d)).collect();
        r.pick(&divisors)
    };
    let head_dim: usize = r.pick(&[4, 8, 12, 16, 24, 32]);
    let experts = r.range(2, 12);
    let top_k = r.range(1, experts.min(4));
    let rope_scaling = match r.range(0, 2) {
        0 => Value::Null,
        1 => json!({"type": "linear", "factor": r.pick(&[2.0, 4.0])}),
        // A short original context, so that the prompt runs past it.
        _ => json!({"type": "yarn", "factor": r.pick(&[2.0, 4.0, 8.0]), "original_max_position_embeddings": r.pick(&[8, 16, 32]),
                    "beta_fast": 32.0, "beta_slow": 1.0}),
    };
    let mut c = json!({
        "model_type": family, "hidden_act": "silu", "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "vocab_size": r.range(1024, 1100), "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": r.pick(&[10000.0, 1000000.0]), "rope_scaling": rope_scaling,
        "num_experts_per_tok": top_k, "tie_word_embeddings": r.coin(), "bos_token_id": 1, "eos_token_id": 2,
    });
    let inter = |r: &mut Rng| r.range(4, 96);
    match family {
        "qwen3_moe" | "qwen2_moe" => {
            c["num_experts"] = experts.into();
            c["moe_intermediate_size"] = inter(r).into();
            c["intermediate_size"] = inter(r).into();
            c["norm_topk_prob"] = r.coin().into();
            // Some layers dense: by step, or listed.
            if layers > 1 && r.coin() {
                c["decoder_sparse_step"] = 2.into();
            } else if r.coin() {
                c["mlp_only_layers"] = json!([0]);
            }
            if family == "qwen2_moe" {
                c["qkv_bias"] = true.into();
                if r.coin() {
                    c["shared_expert_intermediate_size"] = inter(r).into();
                }
            } else {
                c["attention_bias"] = r.coin().into();
            }
        }
        "qwen3_next" => {
            c["num_experts"] = experts.into();
            c["moe_intermediate_size"] = inter(r).into();
            c["intermediate_size"] = inter(r).into();
            c["norm_topk_prob"] = r.coin().into();
            if r.coin() {
                c["shared_expert_intermediate_size"] = inter(r).into();
            }
            c["partial_rotary_factor"] = (if head_dim.is_multiple_of(8) { 0.25 } else { 0.5 }).into();
            // Gated DeltaNet layers at random among full ones, value heads a multiple of keys.
            let key_heads = r.range(1, 3);
            c["linear_num_key_heads"] = key_heads.into();
            c["linear_num_value_heads"] = (key_heads * r.range(1, 3)).into();
            c["linear_key_head_dim"] = r.pick(&[4, 8, 12, 16]).into();
            c["linear_value_head_dim"] = r.pick(&[4, 8, 12]).into();
            c["linear_conv_kernel_dim"] = r.range(2, 4).into();
            c["layer_types"] = (0..layers).map(|_| if r.coin() { "linear_attention" } else { "full_attention" }).collect::<Vec<_>>().into();
        }
        "mixtral" => {
            c["num_local_experts"] = experts.into();
            c["intermediate_size"] = inter(r).into();
        }
        "minimax_m2" => {
            c["num_local_experts"] = experts.into();
            c["intermediate_size"] = inter(r).into();
            // Rotary over an even part of the head, q/k norms over all heads.
            c["rotary_dim"] = r.even(2, head_dim).into();
            c["use_qk_norm"] = r.coin().into();
        }
        "gpt_oss" => {
            c["num_local_experts"] = experts.into();
            c["intermediate_size"] = inter(r).into();
            // Windows shorter than the prompt, on a random set of layers; a clamp that bites.
            c["sliding_window"] = r.range(1, 16).into();
            c["layer_types"] =
                (0..layers).map(|_| if r.coin() { "sliding_attention" } else { "full_attention" }).collect::<Vec<_>>().into();
            c["attention_bias"] = r.coin().into();
            c["swiglu_limit"] = r.pick(&[0.5, 7.0]).into();
        }
        "olmoe" => {
            c["num_experts"] = experts.into();
            c["intermediate_size"] = inter(r).into();
            c["norm_topk_prob"] = r.coin().into();
        }
        "glm4_moe" | "deepseek_v3" | "glm_moe_dsa" => {
            // Groups of at least two experts, enough of them kept to fill the top-k.
            let per = r.range(2, 4);
            let n_group = r.range(1, 4);
            let topk_group = r.range(top_k.div_ceil(per).clamp(1, n_group), n_group);
            c["n_routed_experts"] = (per * n_group).into();
            c["num_experts_per_tok"] = top_k.min(per * n_group).into();
            c["n_group"] = n_group.into();
            c["topk_group"] = topk_group.into();
            c["moe_intermediate_size"] = inter(r).into();
            c["intermediate_size"] = inter(r).into();
            c["n_shared_experts"] = r.range(0, 2).into();
            c["first_k_dense_replace"] = r.range(0, layers - 1).into();
            c["routed_scaling_factor"] = r.pick(&[1.0, 2.5]).into();
            c["norm_topk_prob"] = r.coin().into();
            if family == "glm4_moe" {
                c["attention_bias"] = r.coin().into();
                c["use_qk_norm"] = r.coin().into();
                // Partial rotary: half of a head that is a multiple of four.
                c["head_dim"] = (r.range(1, 8) * 4).into();
                c["partial_rotary_factor"] = 0.5.into();
            } else {
                c["q_lora_rank"] = if r.coin() || family == "glm_moe_dsa" { Value::from(r.range(4, 96)) } else { Value::Null };
                c["kv_lora_rank"] = r.range(4, 96).into();
                c["qk_nope_head_dim"] = r.range(2, 48).into();
                c["qk_rope_head_dim"] = r.even(2, 24).into();
                c["v_head_dim"] = r.range(2, 48).into();
                c["num_key_value_heads"] = heads.into();
                c["rope_interleave"] = r.coin().into();
                if family == "glm_moe_dsa" {
                    // Few kept positions, so the prompt (12 to 48 tokens) attends sparsely; the
                    // first layer indexes, the others at random.
                    c["index_topk"] = r.range(1, 16).into();
                    c["index_n_heads"] = r.range(1, 8).into();
                    c["index_head_dim"] = (c["qk_rope_head_dim"].as_u64().unwrap() as usize + r.even(0, 16)).into();
                    c["indexer_types"] = (0..layers).map(|l| if l == 0 || r.coin() { "full" } else { "shared" }).collect::<Vec<_>>().into();
                }
                if let Some(s) = c["rope_scaling"].as_object_mut() {
                    if s["type"] == "yarn" {
                        s.insert("mscale".into(), 1.0.into());
                        s.insert("mscale_all_dim".into(), r.pick(&[0.0, 1.0]).into());
                    }
                }
            }
        }
        _ => unreachable!(),
    }
    c
}

fn load(path: &std::path::Path, precision: Precision) -> Model<CpuBackend> {
    let v = smoe_vault::Vault::open(path).unwrap();
    let ex = Arc::new(smoe_store::ResidentExperts::load(&v).unwrap());
    Model::load(&v, CpuBackend::with_threads(precision, 2), ex).unwrap()
}

/// How closely two runs of the same model must agree, over rows (positions) of logits, each
/// row's error relative to its largest logit.
#[derive(Clone, Copy)]
struct Tolerance {
    /// Bound on every row.
    max: f64,
    /// Bound on the median row.
    median: f64,
}

/// Per-row relative errors of `a` against `b`, sorted.
fn row_errors(a: &[f32], b: &[f32], vocab: usize) -> Vec<f64> {
    let mut e: Vec<f64> = a.chunks_exact(vocab).zip(b.chunks_exact(vocab)).map(|(x, y)| rel_err(x, y)).collect();
    e.sort_by(|x, y| x.total_cmp(y));
    e
}

fn assert_within(errors: &[f64], tol: Tolerance, what: &str) {
    let (median, max) = (errors[errors.len() / 2], errors[errors.len() - 1]);
    assert!(max <= tol.max && median <= tol.median, "{what}: row errors median {median:.2e}, max {max:.2e}");
}

/// Records each token's chosen experts at each MoE layer, and the positions sparse attention
/// keeps for it at each layer that runs an indexer (keyed `usize::MAX - layer`): both are
/// discrete choices that a near-tie can decide either way.
#[derive(Default, PartialEq)]
struct Routes(BTreeMap<(usize, usize), Vec<u32>>);
impl Observer for Routes {
    fn route(&mut self, layer: usize, pos: usize, experts: &[u32], _: &[f32], _: &[f32]) {
        let mut e = experts.to_vec();
        e.sort_unstable();
        self.0.insert((layer, pos), e);
    }
    fn selected(&mut self, layer: usize, pos: usize, positions: &[u32]) {
        self.0.insert((usize::MAX - layer, pos), positions.to_vec());
    }
}

/// Checks one model: chunked prefill, step decode and prefix reuse against one whole-prompt
/// prefill; returns that prefill's logits and routing. Runs whose routing differs from the whole prefill's
/// (a near-tie decided the other way) are held to `flipped` instead of `tol`.
fn check_model(m: &Model<CpuBackend>, ids: &[u32], chunk: usize, tol: Tolerance, flipped: Tolerance, what: &str) -> (Vec<f32>, Routes) {
    let (t, vocab) = (ids.len(), m.arch().vocab_size);
    let mut routes = Routes::default();
    let whole = m.forward(&mut m.new_state(t), ids, Logits::All, &mut routes).unwrap().to_vec();
    assert!(whole.iter().all(|x| x.is_finite()), "{what}: non-finite logits");
    let check = |got: &[f32], from: usize, seen: &Routes, how: String| {
        let same = seen.0.iter().all(|(key, e)| routes.0.get(key) == Some(e));
        let errors = row_errors(got, &whole[from * vocab..], vocab);
        assert_within(&errors, if same { tol } else { flipped }, &format!("{what}: {how} (same routing: {same})"));
    };
    let mut seen = Routes::default();
    let chunked = m.forward(&mut m.new_state(chunk), ids, Logits::All, &mut seen).unwrap().to_vec();
    check(&chunked, 0, &seen, format!("prefill in chunks of {chunk}"));
    // `Last` over several chunks: only the last chunk runs the LM head, on its last row.
    let mut seen = Routes::default();
    let last = m.forward(&mut m.new_state(chunk), ids, Logits::Last, &mut seen).unwrap().to_vec();
    assert_eq!(last.len(), vocab, "{what}: Last over chunks of {chunk} returned {} logits", last.len());
    check(&last, t - 1, &seen, format!("last logits over chunks of {chunk}"));
    // Step decode: one token at a time through the cache.
    let (mut st, mut seen) = (m.new_state(chunk), Routes::default());
    let mut decoded = Vec::with_capacity(whole.len());
    for &id in ids {
        decoded.extend_from_slice(m.forward(&mut st, &[id], Logits::Last, &mut seen).unwrap());
    }
    check(&decoded, 0, &seen, "step decode".into());
    // Prefix reuse: run past the split, forget back to it, continue with the rest.
    let split = t / 3 + 1;
    let (mut st, mut seen) = (m.new_state(chunk), Routes::default());
    m.forward(&mut st, &ids[..(2 * t / 3).max(split + 1)], Logits::Last, &mut seen).unwrap();
    st.truncate(split);
    seen.0.retain(|&(_, pos), _| pos < split);
    // A model that cannot go back that far (recurrent states) starts over or from a checkpoint.
    let at = st.pos();
    if at < split {
        m.forward(&mut st, &ids[at..split], Logits::Last, &mut seen).unwrap();
    }
    let resumed = m.forward(&mut st, &ids[split..], Logits::All, &mut seen).unwrap().to_vec();
    check(&resumed, split, &seen, format!("prefix reuse from {split}"));
    (whole, routes)
}

fn run_case(seed: u64) {
    let mut r = Rng::new(seed);
    let family = r.pick(&FAMILIES);
    let cfg = random_config(family, &mut r);
    let (experts, dense) = r.pick(&[(Format::BF16, Format::BF16), (Format::Q8_0, Format::Q8_0), (Format::Q4_K, Format::Q8_0)]);
    let t = r.range(12, 48);
    let chunk = r.range(2, t - 1);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.smoe");
    let synth = SynthOptions { layers: None, seed, shard_bytes: 1 << 30, tokenizer_json: None, random_blocks: false, router_spread: 0.0 };
    let shatter = ShatterOptions { experts: experts.into(), dense, threads: Some(1), ..Default::default() };
    let what = format!("seed {seed} ({family}, {experts}/{dense}, {t} tokens, chunk {chunk}) config {cfg}");
    synth_vault_from_config(cfg.clone(), &path, &synth, &shatter, &Silent).unwrap_or_else(|e| panic!("{what}: synth: {e}"));
    let reference = load(&path, Precision::Reference);
    let vocab = reference.arch().vocab_size as u64;
    let ids: Vec<u32> = (0..t).map(|_| (r.next() % vocab) as u32).collect();
    // The f32 reference path: every row of every way of running agrees.
    let tight = Tolerance { max: 1e-4, median: 1e-4 };
    let (exact, exact_routes) = check_model(&reference, &ids, chunk, tight, tight, &format!("{what} [reference]"));
    // The production path quantizes activations to int8, and its many-token (n >= 4) and
    // one-token kernels differ in rounding: with the same routing, rows stay within 1e-2 (seed
    // 1592590740, qwen3_moe Q8_0 with chunks of 2, measured a median row of 5e-3 between the
    // two kernels, every one-token run bit-identical to the others); a router near-tie decided
    // the other way moves later rows through attention (over 1500 cases: worst row 2e-2).
    // Against the reference it is within activation-rounding noise (median row up to 7e-2
    // over 240 cases) when both route alike; a wrong offset or width would be O(1).
    let fast = load(&path, Precision::Fast);
    let flipped = Tolerance { max: 0.25, median: 2e-2 };
    let same = Tolerance { max: 0.05, median: 1e-2 };
    let (fast_logits, fast_routes) = check_model(&fast, &ids, chunk, same, flipped, &format!("{what} [fast]"));
    if fast_routes == exact_routes {
        let errors = row_errors(&fast_logits, &exact, vocab as usize);
        assert_within(&errors, Tolerance { max: f64::INFINITY, median: 0.15 }, &format!("{what}: fast against reference"));
    }
}

fn seeds() -> Vec<u64> {
    if let Ok(s) = std::env::var("SMOE_SHAPE_SEED") {
        return vec![s.parse().expect("SMOE_SHAPE_SEED is a number")];
    }
    let n = std::env::var("SMOE_SHAPE_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(240);
    (0..n).map(|i| 0x5EED_0000 + i).collect()
}

#[test]
fn random_shapes_of_every_family_agree_across_paths() {
    let seeds = seeds();
    let mut by_family = std::collections::BTreeMap::<&str, usize>::new();
    for &seed in &seeds {
        by_family.entry(Rng::new(seed).pick(&FAMILIES)).and_modify(|n| *n += 1).or_insert(1);
        if let Err(e) = std::panic::catch_unwind(|| run_case(seed)) {
            let msg = e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()));
            panic!("shape case failed; re-run with SMOE_SHAPE_SEED={seed}: {}", msg.unwrap_or_default());
        }
    }
    // Every family drawn, each several times.
    assert!(seeds.len() < 60 || (by_family.len() == FAMILIES.len() && by_family.values().all(|&n| n >= 5)), "{by_family:?}");
    eprintln!("{} shape cases: {by_family:?}", seeds.len());
}

/// The DeepSeek-V3 crash: its `heads × v_head_dim` (128 × 128 = 16384) is larger than
/// `hidden_size` (7168), and a full 256-token chunk of expanded values overran a buffer sized for
/// the hidden state. Here at the real per-head dims and the real ratios of width to hidden
/// (2 heads, hidden 112 = 7168 / 64, ranks / 64), a 300-token prompt through `score` (as
/// `smoe score` runs it) in prefill and in decode, from the vault and from its GGUF export.
#[test]
fn deepseek_v3_ratios_score_300_tokens_from_vault_and_gguf() {
    let cfg = json!({
        "model_type": "deepseek_v3", "hidden_act": "silu", "hidden_size": 112, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false, "bos_token_id": 0, "eos_token_id": 1,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 64, "type": "yarn"},
        "first_k_dense_replace": 1, "intermediate_size": 288, "moe_intermediate_size": 32, "n_routed_experts": 16,
        "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "n_shared_experts": 1, "norm_topk_prob": true,
        "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "q_lora_rank": 24, "kv_lora_rank": 8, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128
    });
    let dir = tempfile::tempdir().unwrap();
    let (vault, gguf) = (dir.path().join("ds.smoe"), dir.path().join("ds.gguf"));
    let synth =
        SynthOptions { layers: None, seed: 3, shard_bytes: 1 << 30, tokenizer_json: None, random_blocks: false, router_spread: 0.0 };
    let shatter = ShatterOptions { experts: Format::BF16.into(), dense: Format::BF16, threads: Some(2), ..Default::default() };
    synth_vault_from_config(cfg, &vault, &synth, &shatter, &Silent).unwrap();
    smoe_convert::gguf::export::export(&vault, &gguf, &Silent).unwrap();
    let ids: Vec<u32> = (0..300u32).map(|i| (i * 7919 + 13) % 1024).collect();
    let open = |path: &std::path::Path, precision| {
        let opts = smoe_engine::OpenOptions { precision, cache: smoe_engine::CacheSize::Resident, ..Default::default() };
        smoe_engine::open_cpu(path, &opts).unwrap().0
    };
    let m = open(&vault, Precision::Reference);
    let a = m.model.arch();
    assert!(a.num_heads * a.mla.as_ref().unwrap().v_head_dim > a.hidden_size, "the case must be wider than hidden");
    let prefill = smoe_engine::score(&m.model, &ids, ScoreMode::Prefill, smoe_engine::PREFILL_CHUNK, false).unwrap();
    let decode = smoe_engine::score(&m.model, &ids, ScoreMode::Decode, smoe_engine::PREFILL_CHUNK, false).unwrap();
    assert!(rel_err(&decode.logits, &prefill.logits) < 1e-4);
    let from_gguf =
        smoe_engine::score(&open(&gguf, Precision::Reference).model, &ids, ScoreMode::Prefill, smoe_engine::PREFILL_CHUNK, false).unwrap();
    assert!(rel_err(&from_gguf.logits, &prefill.logits) < 1e-5);
    for path in [&vault, &gguf] {
        let fast =
            smoe_engine::score(&open(path, Precision::Fast).model, &ids, ScoreMode::Prefill, smoe_engine::PREFILL_CHUNK, false).unwrap();
        assert!(fast.logits.iter().all(|x| x.is_finite()));
    }
}

/// A prefill chunk's tokens are routed in pieces on the pool when there are enough of them
/// (here 128 experts and a 200-token chunk): the same experts and the same logits, bit for
/// bit, on one thread and on four, in prefill and in decode after it.
#[test]
fn many_experts_route_alike_on_one_thread_and_four() {
    let cfg = json!({
        "model_type": "qwen3_moe", "hidden_act": "silu", "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 1024,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "num_experts": 128,
        "num_experts_per_tok": 8, "moe_intermediate_size": 16, "intermediate_size": 64, "norm_topk_prob": true,
        "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2
    });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.smoe");
    let synth =
        SynthOptions { layers: None, seed: 11, shard_bytes: 1 << 30, tokenizer_json: None, random_blocks: false, router_spread: 0.0 };
    let shatter = ShatterOptions { experts: Format::Q8_0.into(), dense: Format::Q8_0, threads: Some(1), ..Default::default() };
    synth_vault_from_config(cfg, &path, &synth, &shatter, &Silent).unwrap();
    // 13 pieces of 16 tokens, each 16 × 128 × 8 row-op elements: 213K in all, past the
    // 65,536 from which the CPU backend spreads row work over its pool.
    let ids: Vec<u32> = (0..200u32).map(|i| (i * 7919 + 5) % 1024).collect();
    let run = |threads: usize| {
        let v = smoe_vault::Vault::open(&path).unwrap();
        let ex = Arc::new(smoe_store::ResidentExperts::load(&v).unwrap());
        let m = Model::load(&v, CpuBackend::with_threads(Precision::Fast, threads), ex).unwrap();
        let (mut st, mut routes) = (m.new_state(256), Routes::default());
        let mut logits = m.forward(&mut st, &ids, Logits::All, &mut routes).unwrap().to_vec();
        logits.extend_from_slice(m.forward(&mut st, &[7], Logits::Last, &mut routes).unwrap());
        (logits, routes)
    };
    let ((l1, r1), (l4, r4)) = (run(1), run(4));
    assert_eq!(r1.0.len(), 2 * 201, "every token routed at both layers");
    assert!(r1 == r4, "the same experts on one thread and four");
    assert_eq!(l1, l4);
}
