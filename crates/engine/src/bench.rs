//! `smoe bench`: prefill and decode throughput, time to first token, bytes read and cache hit
//! rate on a deterministic random prompt, as llama-bench measures (random tokens, no stopping).

use crate::backend::Backend;
use crate::instrument::Summary;
use crate::{Engine, EngineError, GenOptions, NoObserver, SamplingParams};
use rand::{Rng, SeedableRng};

/// What to measure.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Tokens generated after the prompt.
    pub gen_tokens: usize,
    /// Seed of the random prompt.
    pub seed: u64,
    /// Prefill chunk size.
    pub chunk: usize,
}

/// One benchmark's numbers.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BenchResult {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens.
    pub gen_tokens: usize,
    /// Prompt tokens per second.
    pub prefill_tok_s: f64,
    /// Generated tokens per second after the first.
    pub decode_tok_s: f64,
    /// Milliseconds from start to the first generated token.
    pub ttft_ms: f64,
    /// Expert bytes read per decoded token.
    pub bytes_read_per_token: f64,
    /// Expert cache hit rate while decoding.
    pub hit_rate: f64,
    /// Expert cache hit rate during prefill.
    pub prefill_hit_rate: f64,
    /// Achieved read bandwidth while reads were outstanding (bytes/s), decode phase.
    pub read_bytes_per_s: f64,
    /// Prefill phase breakdown.
    pub prefill: Summary,
    /// Decode phase breakdown.
    pub decode: Summary,
}

/// A deterministic prompt of ordinary (non-special) token ids.
pub fn random_prompt<B: Backend>(engine: &Engine<B>, n: usize, seed: u64) -> Vec<u32> {
    let vocab = engine.tokenizer.vocab_size().min(engine.model.arch().vocab_size) as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let id = rng.random_range(0..vocab);
        if engine.tokenizer.token(id).is_some() && !engine.tokenizer.is_special(id) {
            out.push(id);
        }
    }
    out
}

/// Runs one prefill of `prompt_tokens` and greedy decoding of `gen_tokens`.
pub fn bench<B: Backend>(engine: &Engine<B>, opts: &BenchOptions) -> Result<BenchResult, EngineError> {
    let prompt = random_prompt(engine, opts.prompt_tokens, opts.seed);
    let gen = GenOptions {
        max_tokens: opts.gen_tokens,
        sampling: SamplingParams::default(),
        stop: vec![],
        stop_ids: Some(vec![]),
        ctx: opts.prompt_tokens + opts.gen_tokens + 1,
        keep_prompt_logits: false,
    };
    let mut st = engine.model.new_state(opts.chunk);
    st.enable_instrument();
    let store0 = engine.model.experts().stats();
    let g = engine.generate(&mut st, &prompt, &gen, &mut NoObserver, &mut |_, _| true)?;
    let store = engine.model.experts().stats().since(&store0);
    let ins = st.instrument.as_ref().expect("enabled above");
    let prefill_steps = opts.prompt_tokens.div_ceil(opts.chunk);
    let (prefill, decode) = (ins.summary_range(0, prefill_steps), ins.summary(prefill_steps));
    let decoded = decode.tokens.max(1) as f64;
    let _ = store;
    Ok(BenchResult {
        prompt_tokens: opts.prompt_tokens,
        gen_tokens: g.tokens.len(),
        prefill_tok_s: g.stats.prefill_tok_s(),
        decode_tok_s: g.stats.decode_tok_s(),
        ttft_ms: g.stats.ttft_seconds * 1e3,
        bytes_read_per_token: decode.bytes_read as f64 / decoded,
        hit_rate: decode.hit_rate(),
        prefill_hit_rate: prefill.hit_rate(),
        read_bytes_per_s: decode.read_bytes_per_s(),
        prefill,
        decode,
    })
}
