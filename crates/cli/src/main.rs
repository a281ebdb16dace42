//! The `smoe` command: parses arguments and hands each subcommand to the library crates.

mod cmd_run;
mod cmd_vault;
mod progress;

use anyhow::Result;
use clap::{Parser, Subcommand};
use smoe_quant::Format;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "smoe", version, about = "Run Mixture-of-Experts models larger than memory, streaming experts from SSD")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Convert a Hugging Face checkpoint directory into a vault.
    Shatter {
        /// Checkpoint directory (config.json, *.safetensors, tokenizer.json).
        input: PathBuf,
        /// Output vault.
        #[arg(short, long)]
        out: PathBuf,
        /// Format of the routed experts.
        #[arg(long, default_value = "Q4_K")]
        experts: Format,
        /// Format of the dense matrices (norms, biases and routers always stay F32).
        #[arg(long, default_value = "Q8_0")]
        dense: Format,
        /// Quantization threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
    },
    /// Write a random-weight checkpoint with the exact shapes of a published model.
    Synth {
        /// qwen3-30b-a3b, qwen3-235b-a22b, glm-4.5-air, mixtral-8x7b or deepseek-v3.
        #[arg(long)]
        shape: String,
        /// Output directory.
        #[arg(short, long)]
        out: PathBuf,
        /// Keep only the first N decoder layers.
        #[arg(long)]
        layers: Option<usize>,
        /// Seed of every value.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Largest shard in GiB.
        #[arg(long, default_value_t = 2.0)]
        shard_gib: f64,
        /// tokenizer.json to ship with the checkpoint (default: a small byte-level BPE).
        #[arg(long)]
        tokenizer: Option<PathBuf>,
    },
    /// Describe a vault: architecture, formats, sizes.
    Inspect {
        vault: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Check every checksum in a vault; exits non-zero naming the first bad tensor or blob.
    Verify { vault: PathBuf },
    /// Logits and routing of a token sequence, written as safetensors (the correctness tool).
    Score {
        vault: PathBuf,
        /// Token ids, comma-separated.
        #[arg(long)]
        ids: Option<String>,
        /// File of token ids (comma/whitespace separated, or a JSON array).
        #[arg(long)]
        ids_file: Option<PathBuf>,
        /// Output safetensors file.
        #[arg(long)]
        out: PathBuf,
        /// Feed the ids one at a time through the KV cache instead of one prefill.
        #[arg(long)]
        decode: bool,
        /// Use the production kernels (int8 activations) instead of f32 reference math.
        #[arg(long)]
        fast: bool,
        /// Expert cache size in MiB (default: automatic).
        #[arg(long)]
        cache_mb: Option<u64>,
        #[command(flatten)]
        model: cmd_run::ModelArgs,
    },
    /// Generate text from a prompt, streamed to stdout.
    Run {
        vault: PathBuf,
        /// The prompt (the user message, unless --raw).
        #[arg(short, long)]
        prompt: String,
        /// Feed the prompt as is, without the chat template.
        #[arg(long)]
        raw: bool,
        /// System message.
        #[arg(long)]
        system: Option<String>,
        /// Disable thinking (enable_thinking=false in the template).
        #[arg(long)]
        no_think: bool,
        /// Print one JSON object with the text and statistics instead of streaming.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        gen: cmd_run::GenArgs,
        #[command(flatten)]
        model: cmd_run::ModelArgs,
    },
    /// Shatter the bundled demo model and generate Python from it.
    Demo {
        /// Checkpoint to use instead of the bundled one.
        #[arg(long)]
        model: Option<PathBuf>,
        /// Prompt (raw text; the demo model was trained on Python source).
        #[arg(short, long, default_value = "def parse_header(line):\n")]
        prompt: String,
    },
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("SMOE_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Shatter { input, out, experts, dense, threads } => {
            cmd_vault::run_shatter(&input, &out, experts, dense, threads).map(|_| ())
        }
        Command::Synth { shape, out, layers, seed, shard_gib, tokenizer } => {
            let tokenizer_json = match tokenizer {
                Some(p) => Some(std::fs::read_to_string(&p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?),
                None => None,
            };
            let opts =
                smoe_convert::synth::SynthOptions { layers, seed, shard_bytes: (shard_gib * (1u64 << 30) as f64) as u64, tokenizer_json };
            let r = smoe_convert::synth::synth(&shape, &out, &opts, &progress::CliProgress::new())?;
            eprintln!("wrote {} ({} tensors, {} shards, {})", out.display(), r.tensors, r.shards, cmd_vault::fmt_bytes(r.bytes));
            Ok(())
        }
        Command::Inspect { vault, json } => cmd_vault::run_inspect(&vault, json),
        Command::Verify { vault } => cmd_vault::run_verify(&vault),
        Command::Score { vault, ids, ids_file, out, decode, fast, cache_mb, model } => {
            cmd_run::run_score(cmd_run::ScoreArgs { vault, ids, ids_file, out, decode, fast, cache_mb, model })
        }
        Command::Run { vault, prompt, raw, system, no_think, json, gen, model } => {
            cmd_run::run_run(cmd_run::RunArgs { vault, model, prompt, raw, system, think: no_think.then_some(false), json, gen })
        }
        Command::Demo { model, prompt } => demo(model, &prompt),
    }
}

/// The bundled demo checkpoint, found relative to the source tree the binary was built from.
fn bundled_model() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models/stdlib-moe"))
}

fn demo(model: Option<PathBuf>, prompt: &str) -> Result<()> {
    let model = model.unwrap_or_else(bundled_model);
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target/smoe-demo"));
    std::fs::create_dir_all(&dir)?;
    let vault = dir.join("stdlib-moe.smoe");
    cmd_vault::run_shatter(&model, &vault, Format::Q4_K, Format::Q8_0, None)?;
    println!();
    cmd_vault::run_inspect(&vault, false)?;
    println!();
    // The default prompt is written with a literal "\n" so it survives shells; make it a newline.
    let prompt = prompt.replace("\\n", "\n");
    // A deliberately small cache (a quarter of the experts) so the demo streams from disk.
    let experts = smoe_vault::Vault::open(&vault)?.manifest().experts.layers.len() * 32;
    let engine = cmd_run::ModelArgs::with_cache(smoe_engine::CacheSize::Experts(experts / 4)).open(
        &vault,
        smoe_engine::Precision::Reference,
        None,
    )?;
    let gen = cmd_run::GenArgs { temperature: Some(0.7), top_p: Some(0.95), ..cmd_run::GenArgs::new(160) };
    print!("{prompt}");
    let p = cmd_run::Prompt { text: &prompt, raw: true, system: None, think: None };
    cmd_run::generate_and_report(&engine, &p, false, &gen, false)?;
    let st = engine.model.experts().stats();
    println!(
        "streamed experts: {} uses, hit rate {:.2}, {} read from the vault",
        st.hits + st.misses,
        st.hit_rate(),
        cmd_vault::fmt_bytes(st.bytes_read)
    );
    Ok(())
}
