//! `smoe score` and `smoe run`.

use anyhow::{bail, Context, Result};
use smoe_engine::{
    open_cpu, score, CpuBackend, Engine, FinishReason, GenOptions, NoObserver, OpenOptions,
    Precision, SamplingParams, ScoreMode,
};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Parses token ids: comma- or whitespace-separated integers, or a JSON array.
pub fn parse_ids(text: &str) -> Result<Vec<u32>> {
    let t = text.trim();
    if t.starts_with('[') {
        return serde_json::from_str(t)
            .context("ids: expected a JSON array of non-negative integers");
    }
    t.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>()
                .with_context(|| format!("ids: '{s}' is not a token id"))
        })
        .collect()
}

pub struct ScoreArgs {
    pub vault: PathBuf,
    pub ids: Option<String>,
    pub ids_file: Option<PathBuf>,
    pub out: PathBuf,
    pub decode: bool,
    pub fast: bool,
    pub cache_mb: Option<u64>,
}

pub fn run_score(a: ScoreArgs) -> Result<()> {
    let ids = match (&a.ids, &a.ids_file) {
        (Some(s), None) => parse_ids(s)?,
        (None, Some(f)) => parse_ids(
            &std::fs::read_to_string(f).with_context(|| format!("read {}", f.display()))?,
        )?,
        _ => bail!("give exactly one of --ids and --ids-file"),
    };
    if ids.is_empty() {
        bail!("no token ids to score");
    }
    if a.fast {
        bail!("--fast needs the production kernels, which this build does not have yet");
    }
    let _ = a.cache_mb;
    let engine = open_cpu(
        &a.vault,
        &OpenOptions {
            precision: Precision::Reference,
        },
    )
    .with_context(|| format!("open {}", a.vault.display()))?;
    let mode = if a.decode {
        ScoreMode::Decode
    } else {
        ScoreMode::Prefill
    };
    let t0 = std::time::Instant::now();
    let out = score(&engine.model, &ids, mode, 256)?;
    out.write_safetensors(&a.out)
        .with_context(|| format!("write {}", a.out.display()))?;
    eprintln!(
        "scored {} tokens ({mode:?}) in {:.2} s -> {}",
        ids.len(),
        t0.elapsed().as_secs_f64(),
        a.out.display()
    );
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
    /// Context limit in tokens (default: the model's max_position_embeddings).
    #[arg(long)]
    pub ctx: Option<usize>,
}

impl GenArgs {
    pub fn options(&self, engine: &Engine<CpuBackend>) -> GenOptions {
        let mut s: SamplingParams = engine.default_sampling();
        if let Some(t) = self.temperature {
            s.temperature = t;
        }
        if let Some(v) = self.top_p {
            s.top_p = v;
        }
        if let Some(v) = self.top_k {
            s.top_k = v;
        }
        if let Some(v) = self.min_p {
            s.min_p = v;
        }
        if let Some(v) = self.repetition_penalty {
            s.repetition_penalty = v;
        }
        s.presence_penalty = self.presence_penalty;
        s.frequency_penalty = self.frequency_penalty;
        s.seed = self.seed;
        GenOptions {
            max_tokens: self.max_tokens,
            sampling: s,
            stop: self.stop.clone(),
            stop_ids: None,
            ctx: self
                .ctx
                .unwrap_or(engine.model.arch().max_position_embeddings),
        }
    }
}

pub struct RunArgs {
    pub vault: PathBuf,
    pub prompt: String,
    pub raw: bool,
    pub system: Option<String>,
    pub think: Option<bool>,
    pub json: bool,
    pub gen: GenArgs,
}

/// Builds the prompt ids: the chat template around `prompt` unless `raw`.
pub fn prompt_ids(
    engine: &Engine<CpuBackend>,
    prompt: &str,
    raw: bool,
    system: Option<&str>,
    think: Option<bool>,
) -> Result<Vec<u32>> {
    if raw || engine.template.is_none() {
        return Ok(engine.encode(prompt)?);
    }
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(serde_json::json!({"role": "system", "content": s}));
    }
    messages.push(serde_json::json!({"role": "user", "content": prompt}));
    let mut kwargs = serde_json::Map::new();
    if let Some(t) = think {
        kwargs.insert("enable_thinking".into(), t.into());
    }
    Ok(engine.encode(&engine.render_chat(&messages, None, &kwargs)?)?)
}

pub fn run_run(a: RunArgs) -> Result<()> {
    let engine = open_cpu(&a.vault, &OpenOptions::default())
        .with_context(|| format!("open {}", a.vault.display()))?;
    generate_and_report(
        &engine,
        &a.prompt,
        a.raw,
        a.system.as_deref(),
        a.think,
        a.json,
        &a.gen,
    )
}

pub fn generate_and_report(
    engine: &Engine<CpuBackend>,
    prompt: &str,
    raw: bool,
    system: Option<&str>,
    think: Option<bool>,
    json: bool,
    gen: &GenArgs,
) -> Result<()> {
    let ids = prompt_ids(engine, prompt, raw, system, think)?;
    let opts = gen.options(engine);
    let mut stdout = std::io::stdout().lock();
    let mut on_token = |_id: u32, text: &str| {
        if !json {
            // A closed pipe (`smoe run ... | head`) ends generation quietly.
            if stdout
                .write_all(text.as_bytes())
                .and_then(|_| stdout.flush())
                .is_err()
            {
                return false;
            }
        }
        true
    };
    let mut st = engine.model.new_state(256);
    let g = engine.generate(&mut st, &ids, &opts, &mut NoObserver, &mut on_token)?;
    let s = &g.stats;
    if json {
        let v = serde_json::json!({
            "text": g.text,
            "tokens": g.tokens,
            "finish_reason": g.finish,
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "ttft_ms": s.ttft_seconds * 1e3,
            "prefill_tok_s": s.prefill_tok_s(),
            "decode_tok_s": s.decode_tok_s(),
            "seed": s.seed,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!();
        let why = match g.finish {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        };
        eprintln!(
            "[prompt {} tok, generated {} tok ({why}), ttft {:.0} ms, prefill {:.1} tok/s, decode {:.1} tok/s, seed {}]",
            s.prompt_tokens,
            s.generated_tokens,
            s.ttft_seconds * 1e3,
            s.prefill_tok_s(),
            s.decode_tok_s(),
            s.seed
        );
    }
    Ok(())
}

pub fn exists(p: &Path) -> Result<()> {
    if !p.exists() {
        bail!("{} does not exist", p.display());
    }
    Ok(())
}
