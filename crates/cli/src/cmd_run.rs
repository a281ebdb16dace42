//! `smoe score` and `smoe run`, and the flags they share.

use crate::device::OnEngine;
use anyhow::{bail, Context, Result};
use smoe_engine::instrument::Instrument;
use smoe_engine::{
    open_cpu, score_and_continue, Backend, CacheSize, CpuBackend, Engine, FinishReason, GenOptions, NoObserver, OpenOptions, OpenReport,
    Precision, SamplingRequest, ScoreMode,
};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Parses token ids: comma- or whitespace-separated integers, or a JSON array.
pub fn parse_ids(text: &str) -> Result<Vec<u32>> {
    let t = text.trim();
    if t.starts_with('[') {
        return serde_json::from_str(t).context("ids: expected a JSON array of non-negative integers");
    }
    t.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<u32>().with_context(|| format!("ids: '{s}' is not a token id")))
        .collect()
}

pub fn exists(p: &Path) -> Result<()> {
    if !p.exists() {
        bail!("{} does not exist", p.display());
    }
    Ok(())
}

/// How to open a model: shared by every command that runs one.
#[derive(clap::Args, Clone, Debug)]
pub struct ModelArgs {
    /// Expert cache: `auto` (from free memory and cgroup limits), `resident` (all experts read at
    /// start), a size (`8GiB`, `500MiB`) or a number of experts.
    #[arg(long, default_value = "auto")]
    pub cache: CacheSize,
    /// Expert cache size as a number of experts (overrides --cache).
    #[arg(long)]
    pub cache_experts: Option<usize>,
    /// Eviction policy: reuse-distance (default) or lru.
    #[arg(long, default_value = "reuse-distance")]
    pub policy: smoe_store::policy::PolicyKind,
    /// How the KV cache stores keys and values: `f16` (half the memory, rounded to nearest
    /// even as llama.cpp's default cache is; CPU only), `f32` (exact), or `auto` (f16 with the
    /// CPU's production kernels, for every family but DeepSeek-V4; f32 on the GPU and with
    /// the reference arithmetic).
    #[arg(long, default_value = "auto")]
    pub kv_type: smoe_engine::KvType,
    /// Read ahead the experts the next layer's router predicts from the current hidden state.
    #[arg(long, default_value = "off", value_parser = ["off", "lookahead"])]
    pub prefetch: String,
    /// Skip checksum verification of expert blobs as they are read.
    #[arg(long)]
    pub no_verify: bool,
    /// Expert reads in flight at most: a number, or `auto` to measure which depth reads
    /// fastest on this disk (tried among 1, 2, 4, ... 32 while running).
    #[arg(long, default_value = "auto")]
    pub queue_depth: smoe_store::depth::QueueDepth,
    /// Print per-token timing, bytes read, hit rate and expert reuse.
    #[arg(long)]
    pub instrument: bool,
    /// Compute threads (default: one per physical core this process may use).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Where the model runs: `cpu`, `cuda` (`cuda:N` for GPU N), or `auto` (a GPU when one is
    /// usable, else the CPU; the startup line says which).
    #[arg(long, default_value = "auto")]
    pub device: crate::device::Device,
    /// VRAM for routed experts on a GPU: `auto` (what is free after the dense weights), a size
    /// (`20GiB`) or a number of experts. Experts beyond it stay in host memory and are copied
    /// up as they are used.
    #[arg(long)]
    pub gpu_cache: Option<CacheSize>,
    /// On a GPU whose expert tier is full, where a decode step's missing experts are computed:
    /// `copy` (up to VRAM, evicting others), `cpu` (by the CPU on the host copy, while the GPU
    /// runs the others) or `auto` (whichever has measured faster on this machine).
    #[arg(long, default_value = "auto")]
    pub gpu_misses: smoe_cuda::MissMode,
    /// A Jinja chat template file used instead of the one the model ships (every model, for
    /// `serve`): a missing or broken template, or another variant of it.
    #[arg(long, value_name = "FILE", value_parser = read_chat_template)]
    pub chat_template: Option<String>,
}

/// Reads a `--chat-template` file when the arguments are parsed, so that a bad path is an
/// argument error before any model is opened.
fn read_chat_template(path: &str) -> Result<String, String> {
    let src = std::fs::read_to_string(path).map_err(|e| format!("cannot read the chat template {path}: {e}"))?;
    smoe_text::ChatTemplate::new(&src, None, None).map_err(|e| format!("{path} is not a usable chat template: {e}"))?;
    Ok(src)
}

impl ModelArgs {
    /// Defaults, with the cache set to `cache`.
    pub fn with_cache(cache: CacheSize) -> ModelArgs {
        ModelArgs {
            cache,
            cache_experts: None,
            policy: smoe_store::policy::PolicyKind::ReuseDistance,
            kv_type: smoe_engine::KvType::Auto,
            prefetch: "off".into(),
            no_verify: false,
            queue_depth: smoe_store::depth::QueueDepth::AUTO,
            instrument: false,
            threads: None,
            device: crate::device::Device::Cpu,
            gpu_cache: None,
            gpu_misses: smoe_cuda::MissMode::Auto,
            chat_template: None,
        }
    }

    pub fn options(&self, precision: Precision, ctx: Option<usize>) -> OpenOptions {
        OpenOptions {
            precision,
            cache: self.cache_experts.map(CacheSize::Experts).unwrap_or(self.cache),
            policy: self.policy,
            verify: !self.no_verify,
            queue_depth: self.queue_depth,
            threads: self.threads,
            ctx,
            chat_template: self.chat_template.clone(),
            kv_type: self.kv_type,
        }
    }

    /// Opens the model on the CPU and reports the cache size chosen (on stderr).
    pub fn open_cpu(&self, vault: &Path, precision: Precision, ctx: Option<usize>) -> Result<Engine<CpuBackend>> {
        exists(vault)?;
        let (mut engine, report) = open_cpu(vault, &self.options(precision, ctx)).with_context(|| format!("open {}", vault.display()))?;
        engine.model.set_lookahead(self.prefetch == "lookahead");
        eprintln!("{report}");
        Ok(engine)
    }

    /// Opens the model on the `--device` backend (saying which, and the cache chosen, on
    /// stderr) and hands it to `then`.
    pub fn open_on<W: OnEngine>(&self, vault: &Path, precision: Precision, ctx: Option<usize>, then: W) -> Result<W::Out> {
        exists(vault)?;
        let (mut chosen, mut line) =
            self.device.choose(&crate::device::cuda_options(self.gpu_cache, self.gpu_misses, Some(vault), precision)?)?;
        // `auto` runs a model the GPU backend cannot (DeepSeek-V4 for now) on the CPU.
        if let (crate::device::Device::Auto, crate::device::Chosen::Cuda(b)) = (&self.device, &chosen) {
            let sizes = smoe_engine::model_sizes(vault).with_context(|| format!("open {}", vault.display()))?;
            if let Some(why) = smoe_engine::backend_lacks(&sizes.arch, &sizes.formats, &**b) {
                (chosen, line) = (crate::device::Chosen::Cpu, format!("device: cpu ({why})"));
            }
        }
        eprintln!("{line}");
        crate::device::open_on(chosen, vault, &self.options(precision, ctx), self.prefetch == "lookahead", then)
    }
}

pub struct ScoreArgs {
    pub vault: PathBuf,
    pub ids: Option<String>,
    pub ids_file: Option<PathBuf>,
    pub out: PathBuf,
    pub decode: bool,
    pub fast: bool,
    pub cache_mb: Option<u64>,
    pub greedy: usize,
    pub model: ModelArgs,
}

pub fn run_score(a: ScoreArgs) -> Result<()> {
    let ids = match (&a.ids, &a.ids_file) {
        (Some(s), None) => parse_ids(s)?,
        (None, Some(f)) => parse_ids(&std::fs::read_to_string(f).with_context(|| format!("read {}", f.display()))?)?,
        _ => bail!("give exactly one of --ids and --ids-file"),
    };
    if ids.is_empty() {
        bail!("no token ids to score");
    }
    let mut model = a.model.clone();
    if let Some(mb) = a.cache_mb {
        model.cache = CacheSize::Bytes(mb << 20);
    }
    let precision = if a.fast { Precision::Fast } else { Precision::Reference };
    model.open_on(&a.vault.clone(), precision, Some(ids.len() + a.greedy), Score { a, ids })
}

struct Score {
    a: ScoreArgs,
    ids: Vec<u32>,
}

impl OnEngine for Score {
    type Out = ();
    fn run<B: Backend + 'static>(self, engine: Engine<B>, _: OpenReport) -> Result<()> {
        score_on(&self.a, &self.ids, &engine)
    }
}

fn score_on<B: Backend>(a: &ScoreArgs, ids: &[u32], engine: &Engine<B>) -> Result<()> {
    let mode = if a.decode { ScoreMode::Decode } else { ScoreMode::Prefill };
    let t0 = std::time::Instant::now();
    let out = score_and_continue(&engine.model, ids, mode, engine.model.prefill_chunk(), a.model.instrument, a.greedy)?;
    out.write_safetensors(&a.out).with_context(|| format!("write {}", a.out.display()))?;
    eprintln!("scored {} tokens ({mode:?}) in {:.2} s -> {}", ids.len(), t0.elapsed().as_secs_f64(), a.out.display());
    if let Some(s) = &out.instrument {
        eprintln!("{s}");
    }
    Ok(())
}

/// Generation flags shared by `run`, `chat` and `demo`.
#[derive(clap::Args, Clone, Debug)]
pub struct GenArgs {
    /// Most tokens to generate.
    #[arg(long, default_value_t = 512)]
    pub max_tokens: usize,
    /// Sampling temperature (0: greedy). Default: the model's generation_config.json.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Nucleus sampling threshold.
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Keep only the k most likely tokens.
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Drop tokens below this fraction of the top probability.
    #[arg(long)]
    pub min_p: Option<f32>,
    /// Penalise tokens already in the context (1: off).
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    /// OpenAI-style presence penalty.
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// OpenAI-style frequency penalty.
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Random seed (reproducible runs).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop at this string (repeatable).
    #[arg(long)]
    pub stop: Vec<String>,
    /// Context limit in tokens (default: the model's max_position_embeddings, capped so a full KV
    /// cache takes at most an eighth of available memory).
    #[arg(long)]
    pub ctx: Option<usize>,
    /// Hold the reply to JSON matching this JSON schema (inline, or `@FILE`); `{}` for any JSON
    /// (llama.cpp's `--json-schema`). After the reasoning, for a reply that opens in `<think>`.
    #[arg(long, value_name = "SCHEMA", value_parser = read_json_schema)]
    pub json_schema: Option<serde_json::Value>,
}

/// A `--json-schema` value: inline JSON or `@FILE`. `{}` means any JSON value.
fn read_json_schema(arg: &str) -> Result<serde_json::Value, String> {
    let text = match arg.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?,
        None => arg.to_string(),
    };
    match serde_json::from_str(&text).map_err(|e| format!("the schema is not JSON: {e}"))? {
        v @ (serde_json::Value::Object(_) | serde_json::Value::Bool(true)) => Ok(v),
        v => Err(format!("a JSON schema is an object, got {v}")),
    }
}

impl GenArgs {
    /// Defaults: 512 tokens, the model's sampling defaults.
    pub fn new(max_tokens: usize) -> GenArgs {
        GenArgs {
            max_tokens,
            temperature: None,
            top_p: None,
            top_k: None,
            min_p: None,
            repetition_penalty: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            stop: vec![],
            ctx: None,
            json_schema: None,
        }
    }

    /// The sampling flags; those not given take the model's defaults.
    pub fn sampling(&self) -> SamplingRequest {
        SamplingRequest {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            presence_penalty: Some(self.presence_penalty),
            frequency_penalty: Some(self.frequency_penalty),
            seed: self.seed,
        }
    }

    pub fn options<B: Backend>(&self, engine: &Engine<B>) -> GenOptions {
        GenOptions {
            stop: self.stop.clone(),
            grammar: self.json_schema.clone().map(smoe_text::OutputGrammar::Json),
            ..GenOptions::new(self.max_tokens, engine.sampling(&self.sampling()), self.ctx.unwrap_or(engine.ctx))
        }
    }
}

/// What `run` (and `demo`) generate.
pub struct Prompt<'a> {
    pub text: &'a str,
    pub raw: bool,
    pub system: Option<&'a str>,
    pub think: Option<bool>,
}

pub struct RunArgs {
    pub vault: PathBuf,
    pub model: ModelArgs,
    pub prompt: String,
    pub raw: bool,
    pub system: Option<String>,
    pub think: Option<bool>,
    pub json: bool,
    pub gen: GenArgs,
}

/// Builds the prompt ids: the chat template around the text unless `raw`.
pub fn prompt_text<B: Backend>(engine: &Engine<B>, p: &Prompt) -> Result<String> {
    if p.raw || engine.template.is_none() {
        return Ok(p.text.to_string());
    }
    let mut messages = Vec::new();
    if let Some(s) = p.system {
        messages.push(serde_json::json!({"role": "system", "content": s}));
    }
    messages.push(serde_json::json!({"role": "user", "content": p.text}));
    let mut kwargs = serde_json::Map::new();
    if let Some(t) = p.think {
        kwargs.insert("enable_thinking".into(), t.into());
    }
    Ok(engine.render_chat(&messages, None, &kwargs)?)
}

pub fn run_run(a: RunArgs) -> Result<()> {
    let (model, vault, ctx) = (a.model.clone(), a.vault.clone(), a.gen.ctx);
    model.open_on(&vault, Precision::Fast, ctx, a)
}

impl OnEngine for RunArgs {
    type Out = ();
    fn run<B: Backend + 'static>(self, engine: Engine<B>, _: OpenReport) -> Result<()> {
        let p = Prompt { text: &self.prompt, raw: self.raw, system: self.system.as_deref(), think: self.think };
        generate_and_report(&engine, &p, self.json, &self.gen, self.model.instrument)
    }
}

/// Prints every step of an instrument and its summaries.
pub fn print_instrument(i: &Instrument, prefill_steps: usize) {
    for (n, r) in i.records.iter().enumerate() {
        eprintln!(
            "step {n:4} ({} tok): {:.2} ms = attn {:.2} + route {:.2} + experts {:.2} + io {:.2} + sample {:.2} + other {:.2}; read {:.1} KiB, hits {}/{}, reuse {}",
            r.tokens,
            r.total_ms,
            r.attention_ms,
            r.routing_ms,
            r.expert_ms,
            r.io_wait_ms,
            r.sampling_ms,
            r.other_ms,
            r.bytes_read as f64 / 1024.0,
            r.hits,
            r.hits + r.misses,
            r.adjacent_reuse.map_or("-".into(), |a| format!("{a:.2}"))
        );
    }
    print_summaries(i, prefill_steps);
}

/// Prints an instrument's prefill and decode summaries.
pub fn print_summaries(i: &Instrument, prefill_steps: usize) {
    eprintln!("prefill: {}", i.summary_range(0, prefill_steps));
    eprintln!("decode:  {}", i.summary(prefill_steps));
}

pub fn generate_and_report<B: Backend>(engine: &Engine<B>, p: &Prompt, json: bool, gen: &GenArgs, instrument: bool) -> Result<()> {
    let text = prompt_text(engine, p)?;
    let ids = engine.encode(&text)?;
    let mut opts = gen.options(engine);
    if opts.grammar.is_some() {
        opts.grammar_after = smoe_text::grammar_starts_after(&text, engine.call_syntax()).map(str::to_string);
    }
    let mut stdout = std::io::stdout().lock();
    let mut on_token = |_id: u32, text: &str| {
        if !json {
            // A closed pipe (`smoe run ... | head`) ends generation quietly.
            if stdout.write_all(text.as_bytes()).and_then(|_| stdout.flush()).is_err() {
                return false;
            }
        }
        true
    };
    let mut st = engine.model.new_state(engine.model.prefill_chunk());
    if instrument {
        st.enable_instrument();
    }
    let store_before = engine.model.experts().stats();
    let g = engine.generate(&mut st, &ids, &opts, &mut NoObserver, &mut on_token)?;
    let s = &g.stats;
    let store = engine.model.experts().stats().since(&store_before);
    let prefill_steps = s.prefilled_tokens.div_ceil(st.chunk());
    if json {
        let ins = st.instrument.as_ref().map(
            |i| serde_json::json!({"prefill": i.summary_range(0, prefill_steps), "decode": i.summary(prefill_steps), "steps": i.records}),
        );
        let v = serde_json::json!({
            "text": g.text,
            "tokens": g.tokens,
            "prompt_ids": ids,
            "finish_reason": g.finish,
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "ttft_ms": s.ttft_seconds * 1e3,
            "prefill_tok_s": s.prefill_tok_s(),
            "decode_tok_s": s.decode_tok_s(),
            "seed": s.seed,
            "hit_rate": store.hit_rate(),
            "bytes_read": store.bytes_read,
            "instrument": ins,
            "backend": engine.model.backend().describe(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!();
    let why = match g.finish {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "cancelled",
    };
    eprintln!(
        "[prompt {} tok, generated {} tok ({why}), ttft {:.0} ms, prefill {:.1} tok/s, decode {:.1} tok/s, expert hit rate {:.2}, seed {}]",
        s.prompt_tokens,
        s.generated_tokens,
        s.ttft_seconds * 1e3,
        s.prefill_tok_s(),
        s.decode_tok_s(),
        store.hit_rate(),
        s.seed
    );
    if let Some(i) = &st.instrument {
        print_instrument(i, prefill_steps);
        // The backend in words; on a GPU, with its VRAM expert tier's counters.
        eprintln!("backend: {}", engine.model.backend().describe());
    }
    Ok(())
}
