//! `smoe bench`: prefill and decode throughput, time to first token, bytes read and cache hit
//! rate on a deterministic random prompt, as llama-bench measures (random tokens, no stopping).

use crate::backend::Backend;
use crate::cpu::pool::profile::{self, Counters as PoolCounters};
use crate::instrument::Summary;
use crate::{Engine, EngineError, Logits, NoObserver};
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
    /// Prefill chunk size (the CLI's default is [`Model::prefill_chunk`](crate::Model::prefill_chunk)).
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
    /// Bytes of KV cache the sequence holds at the end.
    pub kv_bytes: usize,
    /// Growth of the process's resident memory over the prefill and decode (Linux; `None`
    /// elsewhere): the KV cache and whatever else grows with the context.
    pub rss_growth_bytes: Option<i64>,
    /// The CPU pool's time during prefill and decode, with `SMOE_POOL_PROFILE` set.
    pub pool: Option<[PoolCounters; 2]>,
    /// The same per call site (see [`profile::Site`]), prefill then decode.
    pub pool_sites: Option<[Vec<profile::Site>; 2]>,
    /// Wall time of the decode loop, milliseconds (the instrument's step times leave out what
    /// happens between steps).
    pub decode_ms: f64,
}

/// The process's resident memory in bytes (`VmRSS` of Linux's `/proc/self/status`), if known.
pub fn resident_bytes() -> Option<i64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: i64 = status.lines().find_map(|l| l.strip_prefix("VmRSS:"))?.trim().strip_suffix("kB")?.trim().parse().ok()?;
    Some(kib * 1024)
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

/// Runs one prefill of `prompt_tokens`, then `gen_tokens - 1` decode steps. As llama-bench
/// does, each decode step feeds a random token rather than the model's own choice, so both
/// engines decode the same kind of input (and a random-weight model's habit of repeating a
/// few tokens does not decide which experts are used).
pub fn bench<B: Backend>(engine: &Engine<B>, opts: &BenchOptions) -> Result<BenchResult, EngineError> {
    let prompt = random_prompt(engine, opts.prompt_tokens, opts.seed);
    if prompt.is_empty() {
        return Err(EngineError::Input("--prompt-tokens must be at least 1".into()));
    }
    let inputs = random_prompt(engine, opts.gen_tokens.saturating_sub(1), opts.seed ^ 0x5eed_dec0de);
    let mut st = engine.model.new_state(opts.chunk);
    engine.model.reserve(&mut st, prompt.len() + inputs.len() + 1);
    st.enable_instrument();
    let rss0 = resident_bytes();
    let tier0 = engine.model.backend().device_tier();
    let pool0 = PoolCounters::read();
    let sites0 = profile::sites();
    let t0 = std::time::Instant::now();
    let logits = engine.model.forward(&mut st, &prompt, Logits::Last, &mut NoObserver)?;
    // The first token (greedy) is part of the time to first token.
    std::hint::black_box(logits.iter().enumerate().fold(0, |b, (i, &v)| if v > logits[b] { i } else { b }));
    let ttft = t0.elapsed().as_secs_f64();
    let tier1 = engine.model.backend().device_tier();
    let pool1 = PoolCounters::read();
    let sites1 = profile::sites();
    let t1 = std::time::Instant::now();
    for &id in &inputs {
        engine.model.forward(&mut st, &[id], Logits::Last, &mut NoObserver)?;
    }
    let decode_s = t1.elapsed().as_secs_f64();
    let tier2 = engine.model.backend().device_tier();
    let pool = profile::enabled().then(|| [pool1.since(&pool0), PoolCounters::read().since(&pool1)]);
    let pool_sites = profile::enabled().then(|| [profile::sites_since(&sites1, &sites0), profile::sites_since(&profile::sites(), &sites1)]);
    let rss_growth_bytes = rss0.zip(resident_bytes()).map(|(a, b)| b - a);
    let ins = st.instrument.as_ref().expect("enabled above");
    let prefill_steps = opts.prompt_tokens.div_ceil(opts.chunk);
    let (mut prefill, mut decode) = (ins.summary_range(0, prefill_steps), ins.summary(prefill_steps));
    if let (Some(a), Some(b), Some(c)) = (tier0, tier1, tier2) {
        prefill.device = Some(b.since(&a));
        decode.device = Some(c.since(&b));
    }
    let decoded = decode.tokens.max(1) as f64;
    Ok(BenchResult {
        prompt_tokens: opts.prompt_tokens,
        gen_tokens: opts.gen_tokens,
        prefill_tok_s: prompt.len() as f64 / ttft,
        decode_tok_s: if inputs.is_empty() { 0.0 } else { inputs.len() as f64 / decode_s },
        ttft_ms: ttft * 1e3,
        bytes_read_per_token: decode.bytes_read as f64 / decoded,
        hit_rate: decode.hit_rate(),
        prefill_hit_rate: prefill.hit_rate(),
        read_bytes_per_s: decode.read_bytes_per_s(),
        prefill,
        decode,
        kv_bytes: engine.model.backend().kv_bytes(st.kv()),
        rss_growth_bytes,
        pool,
        pool_sites,
        decode_ms: decode_s * 1e3,
    })
}

/// What `smoe bench --batch N` measures.
#[derive(Clone, Debug)]
pub struct BatchBenchOptions {
    /// Sequences decoded side by side.
    pub sequences: usize,
    /// Prompt length of each sequence.
    pub prompt_tokens: usize,
    /// Tokens generated per sequence after its prompt.
    pub gen_tokens: usize,
    /// Seed of the random prompts and inputs.
    pub seed: u64,
    /// Prefill chunk size.
    pub chunk: usize,
}

/// A batched benchmark's numbers.
#[derive(Clone, Debug, serde::Serialize)]
pub struct BatchBenchResult {
    /// Sequences decoded side by side.
    pub sequences: usize,
    /// Prompt tokens per sequence.
    pub prompt_tokens: usize,
    /// Generated tokens per sequence.
    pub gen_tokens: usize,
    /// Prompt tokens per second, all sequences (each prefilled in its own chunks).
    pub prefill_tok_s: f64,
    /// Decoded tokens per second, all sequences together (after each sequence's first).
    pub decode_tok_s: f64,
    /// Decoded tokens per second of one sequence: every sequence advances one token a step.
    pub per_sequence_tok_s: f64,
    /// Milliseconds per decode step (one token of every sequence).
    pub step_ms: f64,
    /// Expert bytes read per decoded token (each step's reads shared by its tokens).
    pub bytes_read_per_token: f64,
    /// Expert cache hit rate while decoding (one use per expert a step, however many tokens
    /// chose it).
    pub hit_rate: f64,
    /// Achieved read bandwidth while reads were outstanding (bytes/s), decode phase.
    pub read_bytes_per_s: f64,
    /// Prefill phase breakdown.
    pub prefill: Summary,
    /// Decode phase breakdown.
    pub decode: Summary,
    /// Bytes of KV cache all sequences hold at the end.
    pub kv_bytes: usize,
    /// The CPU pool's time during the decode steps, with `SMOE_POOL_PROFILE` set.
    pub pool: Option<PoolCounters>,
    /// The same per call site (see [`profile::Site`]).
    pub pool_sites: Option<Vec<profile::Site>>,
}

/// Prefills `sequences` random prompts (each in chunks of `chunk`, one sequence at a time),
/// then decodes them side by side in [`Model::forward_batch`](crate::Model::forward_batch)
/// steps of one token per sequence, `gen_tokens - 1` steps. Like [`bench`], each step feeds
/// random tokens, not the model's choices.
pub fn bench_batch<B: Backend>(engine: &Engine<B>, opts: &BatchBenchOptions) -> Result<BatchBenchResult, EngineError> {
    let (n, model) = (opts.sequences, &engine.model);
    if n == 0 || opts.prompt_tokens == 0 {
        return Err(EngineError::Input("--batch and --prompt-tokens must be at least 1".into()));
    }
    let chunk = opts.chunk.max(1);
    let prompts: Vec<Vec<u32>> = (0..n as u64).map(|i| random_prompt(engine, opts.prompt_tokens, opts.seed + i)).collect();
    let steps = opts.gen_tokens.saturating_sub(1);
    let inputs = random_prompt(engine, steps * n, opts.seed ^ 0x5eed_dec0de);
    let mut batch = model.new_batch(chunk.max(n));
    batch.enable_instrument();
    let mut states: Vec<crate::State<B>> = (0..n).map(|_| model.new_state(1)).collect();
    for (i, st) in states.iter_mut().enumerate() {
        model.reserve(st, opts.prompt_tokens + steps + 1);
        // With a routing trace, each sequence replays its own texts.
        st.set_trace_stream(i);
    }
    let t0 = std::time::Instant::now();
    for (st, prompt) in states.iter_mut().zip(&prompts) {
        for part in prompt.chunks(chunk) {
            model.forward_batch(&mut batch, &mut [crate::BatchItem { state: st, tokens: part }], &mut NoObserver)?;
        }
    }
    let prefill_s = t0.elapsed().as_secs_f64();
    let prefill_steps = batch.instrument.as_ref().map_or(0, |i| i.records.len());
    let (pool0, sites0) = (PoolCounters::read(), profile::sites());
    let t1 = std::time::Instant::now();
    for step in inputs.chunks(n) {
        let mut items: Vec<crate::BatchItem<'_, B>> =
            states.iter_mut().zip(step.chunks(1)).map(|(state, tokens)| crate::BatchItem { state, tokens }).collect();
        model.forward_batch(&mut batch, &mut items, &mut NoObserver)?;
    }
    let decode_s = t1.elapsed().as_secs_f64();
    let pool = profile::enabled().then(|| PoolCounters::read().since(&pool0));
    let pool_sites = profile::enabled().then(|| profile::sites_since(&profile::sites(), &sites0));
    let ins = batch.instrument.as_ref().expect("enabled above");
    let (prefill, decode) = (ins.summary_range(0, prefill_steps), ins.summary(prefill_steps));
    let decoded = (steps * n) as f64;
    Ok(BatchBenchResult {
        sequences: n,
        prompt_tokens: opts.prompt_tokens,
        gen_tokens: opts.gen_tokens,
        prefill_tok_s: (n * opts.prompt_tokens) as f64 / prefill_s,
        decode_tok_s: if steps == 0 { 0.0 } else { decoded / decode_s },
        per_sequence_tok_s: if steps == 0 { 0.0 } else { steps as f64 / decode_s },
        step_ms: if steps == 0 { 0.0 } else { decode_s * 1e3 / steps as f64 },
        bytes_read_per_token: decode.bytes_read as f64 / decoded.max(1.0),
        hit_rate: decode.hit_rate(),
        read_bytes_per_s: decode.read_bytes_per_s(),
        prefill,
        decode,
        kv_bytes: states.iter().map(|s| model.backend().kv_bytes(s.kv())).sum(),
        pool,
        pool_sites,
    })
}
