//! The `smoe` command: parses arguments and hands each subcommand to the library crates.

mod cmd_bench;
mod cmd_chat;
mod cmd_perplexity;
mod cmd_replay;
mod cmd_run;
mod cmd_vault;
mod device;
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
    /// Convert a Hugging Face checkpoint directory, or a GGUF file (split sets too), into a vault.
    Shatter {
        /// Checkpoint directory (config.json, *.safetensors, tokenizer.json), or a .gguf file
        /// (its quantized blocks are copied as they are; --experts/--dense do not apply).
        input: PathBuf,
        /// Output vault.
        #[arg(short, long)]
        out: PathBuf,
        /// Format of the routed experts: one format (Q4_K), a low-bit mix (Q2_K_MIX: gate/up
        /// Q2_K, down Q3_K; Q3_K_MIX: gate/up Q3_K, down Q4_K) or per matrix (Q3_K,down=Q5_K).
        /// Default: Q4_K, or MXFP4 for a checkpoint whose experts are MXFP4 (gpt-oss: its
        /// blocks are copied, not re-quantized).
        #[arg(long)]
        experts: Option<smoe_convert::ExpertFormats>,
        /// Format of the dense matrices (norms, biases and routers always stay F32).
        #[arg(long, default_value = "Q8_0")]
        dense: Format,
        /// Quantization threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        /// A llama.cpp file type (Q2_K, Q3_K_M, Q4_K_M, Q5_K_M, Q6_K, Q8_0): each matrix in
        /// the format llama.cpp's quantizer gives it (Q4_K_M: Q6_K output head, Q6_K values and
        /// down projections in half the layers), instead of --experts/--dense.
        #[arg(long, conflicts_with_all = ["experts", "dense"])]
        mix: Option<smoe_convert::LlamaFileType>,
    },
    /// Write a random-weight checkpoint with the exact shapes of a published model.
    Synth {
        /// qwen3-30b-a3b, qwen3-235b-a22b, qwen2-57b-a14b, mixtral-8x7b, mixtral-8x22b,
        /// olmoe-1b-7b, glm-4.5-air, glm-4.5, deepseek-v3, kimi-k2, minimax-m2, gpt-oss-20b,
        /// gpt-oss-120b, glm-5, glm-5.2, deepseek-v4-flash, deepseek-v4-pro, qwen3-next-80b-a3b or
        /// qwen3.5-397b-a17b.
        #[arg(long)]
        shape: String,
        /// Output directory (a Hugging Face checkpoint).
        #[arg(short, long, required_unless_present_any = ["vault", "gguf"])]
        out: Option<PathBuf>,
        /// Convert straight into this vault instead, without writing bf16 safetensors.
        #[arg(long, conflicts_with = "gguf")]
        vault: Option<PathBuf>,
        /// Write straight into this GGUF file instead (both smoe and llama.cpp read it), in the
        /// formats of --experts/--dense; with --random-blocks at disk speed.
        #[arg(long)]
        gguf: Option<PathBuf>,
        /// Expert formats of the vault (with --vault): as `shatter --experts`.
        #[arg(long, default_value = "Q4_K")]
        experts: smoe_convert::ExpertFormats,
        /// Dense format of the vault (with --vault).
        #[arg(long, default_value = "Q8_0")]
        dense: Format,
        /// With --vault or --gguf: the formats of a llama.cpp file type, as `shatter --mix`.
        #[arg(long, conflicts_with_all = ["experts", "dense"])]
        mix: Option<smoe_convert::LlamaFileType>,
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
        /// Build the tokenizer from a GGUF vocabulary file instead (e.g. llama.cpp's
        /// models/ggml-vocab-qwen2.gguf: the real Qwen2/Qwen3 vocabulary).
        #[arg(long, conflicts_with = "tokenizer")]
        vocab_gguf: Option<PathBuf>,
        /// With --vault or --gguf: write the quantized tensors as random valid blocks of realistic spread
        /// instead of quantizing generated values (disk speed: seconds, not minutes, per 10 GB).
        #[arg(long)]
        random_blocks: bool,
        /// Concentrate routing: scale expert e's router row by exp(s·z_e), z_e ~ N(0,1). 0 (the
        /// default): every expert equally likely; 1–2: a few experts take most tokens.
        #[arg(long, default_value_t = 0.0)]
        router_spread: f32,
    },
    /// Write a vault as a GGUF file for llama.cpp, with the same quantized blocks.
    ExportGguf {
        vault: PathBuf,
        /// Output GGUF file.
        #[arg(short, long)]
        out: PathBuf,
    },
    /// What this machine can compute on: the CPU's kernel tables and the NVIDIA GPUs (or why
    /// none is usable).
    Devices,
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
        /// After the ids, continue greedily this many tokens and write them as `greedy` [N] i32
        /// (compared with a peer engine's greedy decode).
        #[arg(long, default_value_t = 0)]
        greedy: usize,
        #[command(flatten)]
        model: cmd_run::ModelArgs,
    },
    /// Perplexity of a text (windows of --ctx tokens, the second half of each scored, as
    /// llama.cpp's llama-perplexity does): the yardstick of a quantization.
    Perplexity {
        vault: PathBuf,
        /// A text file, tokenized as is (no chat template).
        #[arg(long, conflicts_with = "ids_file")]
        text: Option<PathBuf>,
        /// Or a file of token ids (comma/whitespace separated, or a JSON array), or a
        /// safetensors file's `input_ids` (e.g. the held-out texts of testdata/traces).
        #[arg(long)]
        ids_file: Option<PathBuf>,
        /// Window length in tokens.
        #[arg(long, default_value_t = 512)]
        ctx: usize,
        /// Use the production kernels (int8 activations) instead of f32 reference math.
        #[arg(long)]
        fast: bool,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
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
    /// Talk to a model: an interactive chat that keeps the conversation's KV cache between turns.
    /// Reads one user turn per line when stdin is not a terminal.
    Chat {
        vault: PathBuf,
        /// System prompt.
        #[arg(long)]
        system: Option<String>,
        /// Start with thinking off (enable_thinking=false; /think on turns it back on).
        #[arg(long)]
        no_think: bool,
        /// When the conversation outgrows the context: drop the oldest turns (keeping the system
        /// prompt) or refuse the turn.
        #[arg(long, default_value = "drop-oldest", value_parser = ["drop-oldest", "refuse"])]
        overflow: String,
        /// f32 reference arithmetic instead of the fast kernels (for tests).
        #[arg(long, hide = true)]
        reference: bool,
        /// Append each turn's prompt ids, output and first logits to this JSONL file (for tests).
        #[arg(long, hide = true)]
        trace: Option<PathBuf>,
        #[command(flatten)]
        gen: cmd_run::GenArgs,
        #[command(flatten)]
        model: cmd_run::ModelArgs,
    },
    /// Serve every vault in a directory over an OpenAI- and Anthropic-compatible HTTP API.
    Serve {
        /// Directory of vaults; each is a model named by its file stem.
        #[arg(long)]
        models: PathBuf,
        /// Address to bind.
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// Port (0 picks a free one; the bound address is printed).
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// Require this key as `Authorization: Bearer KEY` or `x-api-key` (default: $SMOE_API_KEY).
        #[arg(long, env = "SMOE_API_KEY", hide_env_values = true)]
        api_key: Option<String>,
        /// Allow browser front ends from this origin (repeatable; `*` for any).
        #[arg(long)]
        cors_origin: Vec<String>,
        /// Requests waiting or running per model before 429.
        #[arg(long, default_value_t = 16)]
        max_queue: usize,
        /// Conversations kept per model for prefix reuse.
        #[arg(long, default_value_t = 8)]
        sessions: usize,
        /// Generations a model advances together in one batched step (continuous batching)
        /// [default: --max-queue, at most 256: every admitted request advances].
        #[arg(long)]
        max_batch: Option<usize>,
        /// Tokens one batched step runs, all generations together: a token of each decoding
        /// one, then chunks of new prompts [default: the model's prefill chunk: 256 on the CPU, at
        /// least 1024 when the expert cache is smaller than the experts].
        #[arg(long)]
        batch_tokens: Option<usize>,
        /// How long a step that reads new prompts may pause the streaming generations: beside
        /// them, prompts take only the tokens that fit (learned from the steps' measured cost;
        /// at least 32 a step). 0: no limit, prompts take all of --batch-tokens [default: 1000].
        #[arg(long, value_name = "MS")]
        max_stall_ms: Option<u64>,
        /// Context limit per model (default: each model's, capped by memory).
        #[arg(long)]
        ctx: Option<usize>,
        /// Tokens to generate for a chat request that does not set `max_tokens` (default: until
        /// the context is full or the model stops; Open WebUI sets none).
        #[arg(long)]
        max_tokens: Option<usize>,
        /// Largest request body in MiB.
        #[arg(long, default_value_t = 16)]
        body_limit_mib: usize,
        /// Memory all loaded models may use together (`12GiB`); least recently used models are
        /// unloaded to stay within it. Default: available memory less a reserve.
        #[arg(long)]
        memory: Option<smoe_engine::CacheSize>,
        /// Re-read the memory available (MemAvailable, or the headroom under a cgroup limit)
        /// every this many seconds, on the cgroup's pressure events, before each request and
        /// before the batched steps of a running one, and shrink the expert caches and session
        /// pools when what they may still grow by no longer fits (growing them back, up to their
        /// size at load, once it has for ten of these intervals); 0: never, the caches keep
        /// their size at load.
        #[arg(long, default_value_t = 2.0, value_name = "SECONDS")]
        memory_watch: f64,
        /// Memory the watch keeps free beyond what the caches may grow by, for the running
        /// requests' activations and KV.
        #[arg(long, default_value = "128MiB")]
        memory_headroom: smoe_engine::CacheSize,
        #[command(flatten)]
        model: cmd_run::ModelArgs,
    },
    /// Measure prefill and decode throughput, time to first token, bytes read and hit rate.
    Bench {
        vault: PathBuf,
        /// Prompt length (random tokens).
        #[arg(long, default_value_t = 512)]
        prompt_tokens: usize,
        /// Tokens to generate.
        #[arg(long, default_value_t = 128)]
        gen_tokens: usize,
        /// Prefill chunk size [default: the backend's: 256 tokens on the CPU, 512 on CUDA; at
        /// least 1024 when the expert cache is smaller than the model's experts].
        #[arg(long)]
        chunk: Option<usize>,
        /// Runs; the best is reported (after a short warm-up run when > 1), every run's figures too.
        #[arg(long, default_value_t = 1)]
        reps: usize,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Replace the router's choice with recorded routing (expert ids per token and layer,
        /// mapped onto this model's layers and experts), for I/O and cache benchmarks of
        /// random-weight models: a trace file as in testdata/traces, or no value for the
        /// bundled trace of a trained MoE. The text produced is meaningless; every line printed
        /// says so. Only `bench` has this.
        #[arg(long, value_name = "TRACE", num_args = 0..=1, default_missing_value = "bundled")]
        routing_trace: Option<String>,
        /// Decode this many sequences side by side in batched steps (each prefilled alone
        /// first, then one token of every sequence per step): aggregate and per-sequence
        /// tok/s, bytes read per generated token. Several sizes (`1,4,16`) run in turn on the
        /// one loaded model, interleaved in each of --reps rounds.
        #[arg(long, value_name = "N", value_delimiter = ',')]
        batch: Option<Vec<usize>>,
        #[command(flatten)]
        model: cmd_run::ModelArgs,
    },
    /// Replay a routing trace through the expert cache's eviction policies and Belady's optimum.
    Replay {
        /// A safetensors file with `experts` of shape [texts, positions, layers, top_k]
        /// (as in testdata/traces).
        trace: PathBuf,
        /// Cache size: a percentage of every (layer, expert) in the trace, or a number of slots.
        #[arg(long, default_value = "25%")]
        cache: String,
        /// Sequences decoded together (continuous batching): each step's layer visit is the
        /// union of their experts, each read once. Sequence `s` replays text `s mod texts`,
        /// starting half-way through it for the second pass over the texts, and so on.
        #[arg(long, default_value_t = 1)]
        batch: usize,
        /// Map the trace onto a model's MoE shape, `LAYERSxEXPERTSxTOPK` (e.g. 48x128x8 for
        /// Qwen3-30B-A3B), as `smoe bench --routing-trace` does; the cache size is then a share
        /// of that shape's experts.
        #[arg(long)]
        shape: Option<String>,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Measure this machine's memory read bandwidth (for the benchmark's physical limits).
    #[command(hide = true)]
    MemBandwidth {
        /// Threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        /// Buffer size in MiB.
        #[arg(long, default_value_t = 2048)]
        mib: usize,
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
    quiet_on_closed_stdout();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("SMOE_LOG").unwrap_or_else(|_| "warn,smoe_server=info".into()))
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// A reader that stops early (`smoe devices | head -1`) closes stdout; `println!` then panics
/// with a broken pipe. Like ripgrep, end quietly and successfully instead: the reader chose to
/// stop. Other panics keep the default report. Process-wide, so a server whose stdout is a
/// closed pipe also ends at its next print (its logs and progress go to stderr).
fn quiet_on_closed_stdout() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info.payload_as_str().unwrap_or("");
        if msg.starts_with("failed printing to stdout") && (msg.contains("Broken pipe") || msg.contains("(os error 32)")) {
            std::process::exit(0);
        }
        default(info)
    }));
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Shatter { input, out, experts, dense, threads, mix } => {
            cmd_vault::run_shatter(&input, &out, experts, dense, threads, mix).map(|_| ())
        }
        Command::Synth {
            shape,
            out,
            vault,
            gguf,
            experts,
            dense,
            mix,
            layers,
            seed,
            shard_gib,
            tokenizer,
            vocab_gguf,
            random_blocks,
            router_spread,
        } => {
            let tokenizer_json = match (tokenizer, vocab_gguf) {
                (Some(p), _) => Some(std::fs::read_to_string(&p).map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?),
                (None, Some(g)) => Some(smoe_formats::gguf::vocab::tokenizer_json(&smoe_formats::gguf::Gguf::open(&g)?.meta)?),
                (None, None) => None,
            };
            let opts = smoe_convert::synth::SynthOptions {
                layers,
                seed,
                shard_bytes: (shard_gib * (1u64 << 30) as f64) as u64,
                tokenizer_json,
                random_blocks,
                router_spread,
            };
            if let Some(g) = gguf {
                let sh = smoe_convert::ShatterOptions { experts, dense, mix, ..Default::default() };
                let t0 = std::time::Instant::now();
                let r = smoe_convert::synth::synth_gguf(&shape, &g, &opts, &sh, &progress::CliProgress::new())?;
                eprintln!(
                    "wrote {} ({} tensors, {}) in {:.1} s",
                    g.display(),
                    r.tensors,
                    cmd_vault::fmt_bytes(r.bytes),
                    t0.elapsed().as_secs_f64()
                );
                return Ok(());
            }
            if mix.is_some() && vault.is_none() {
                anyhow::bail!("--mix chooses the formats of a vault or GGUF: use it with --vault or --gguf");
            }
            if opts.random_blocks && vault.is_none() {
                anyhow::bail!("--random-blocks writes quantized blocks: use it with --vault or --gguf");
            }
            if let Some(v) = vault {
                let sh = smoe_convert::ShatterOptions { experts, dense, mix, ..Default::default() };
                let r = smoe_convert::synth::synth_vault(&shape, &v, &opts, &sh, &progress::CliProgress::new())?;
                eprintln!(
                    "wrote {} in {:.1} s: dense {}, experts {} ({} per blob)",
                    v.display(),
                    r.seconds,
                    cmd_vault::fmt_bytes(r.dense_bytes),
                    cmd_vault::fmt_bytes(r.expert_bytes),
                    cmd_vault::fmt_bytes(r.blob_size)
                );
                return Ok(());
            }
            let out = out.expect("clap requires --out without --vault");
            let r = smoe_convert::synth::synth(&shape, &out, &opts, &progress::CliProgress::new())?;
            eprintln!("wrote {} ({} tensors, {} shards, {})", out.display(), r.tensors, r.shards, cmd_vault::fmt_bytes(r.bytes));
            Ok(())
        }
        Command::ExportGguf { vault, out } => {
            cmd_run::exists(&vault)?;
            let t0 = std::time::Instant::now();
            let r = smoe_convert::gguf::export::export(&vault, &out, &progress::CliProgress::new())?;
            eprintln!(
                "wrote {} ({} tensors, {}) in {:.1} s",
                out.display(),
                r.tensors,
                cmd_vault::fmt_bytes(r.bytes),
                t0.elapsed().as_secs_f64()
            );
            Ok(())
        }
        Command::Devices => {
            let tables: Vec<&str> = smoe_kernels::available().iter().map(|k| k.isa).collect();
            let logical = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
            let threads = smoe_engine::default_threads();
            println!(
                "cpu: {logical} logical CPUs, {threads} compute threads by default (one per physical core where the topology is readable); kernel tables {} (using {})",
                tables.join(", "),
                smoe_kernels::best().isa
            );
            match smoe_cuda::probe() {
                Ok(gpus) => gpus.iter().for_each(|g| println!("{g}")),
                Err(why) => println!("cuda: none usable: {why}"),
            }
            Ok(())
        }
        Command::Inspect { vault, json } => cmd_vault::run_inspect(&vault, json),
        Command::Verify { vault } => cmd_vault::run_verify(&vault),
        Command::Score { vault, ids, ids_file, out, decode, fast, cache_mb, greedy, model } => {
            cmd_run::run_score(cmd_run::ScoreArgs { vault, ids, ids_file, out, decode, fast, cache_mb, greedy, model })
        }
        Command::Perplexity { vault, text, ids_file, ctx, fast, json, model } => {
            cmd_perplexity::run(cmd_perplexity::PerplexityArgs { vault, text, ids_file, ctx, fast, json, model })
        }
        Command::Run { vault, prompt, raw, system, no_think, json, gen, model } => {
            cmd_run::run_run(cmd_run::RunArgs { vault, model, prompt, raw, system, think: no_think.then_some(false), json, gen })
        }
        Command::Chat { vault, system, no_think, overflow, reference, trace, gen, model } => {
            let overflow = if overflow == "refuse" { smoe_engine::Overflow::Refuse } else { smoe_engine::Overflow::DropOldest };
            cmd_chat::run_chat(cmd_chat::ChatArgs { vault, system, no_think, overflow, reference, trace, gen, model })
        }
        Command::Serve {
            models,
            host,
            port,
            api_key,
            cors_origin,
            max_queue,
            sessions,
            max_batch,
            batch_tokens,
            max_stall_ms,
            ctx,
            max_tokens,
            body_limit_mib,
            memory,
            memory_watch,
            memory_headroom,
            model,
        } => {
            let ip: std::net::IpAddr = host.parse().map_err(|_| anyhow::anyhow!("--host: '{host}' is not an IP address"))?;
            let mut fleet = smoe_server::FleetConfig::new(models);
            fleet.cache = model.cache_experts.map(smoe_engine::CacheSize::Experts).unwrap_or(model.cache);
            fleet.ctx = ctx;
            fleet.max_queue = max_queue;
            fleet.max_sessions = sessions;
            fleet.max_batch = max_batch.unwrap_or_else(|| smoe_server::default_max_batch(max_queue));
            if fleet.max_batch == 0 || batch_tokens == Some(0) {
                anyhow::bail!("--max-batch and --batch-tokens must be at least 1");
            }
            fleet.step_tokens = batch_tokens;
            if let Some(ms) = max_stall_ms {
                fleet.max_stall = (ms > 0).then(|| std::time::Duration::from_millis(ms));
            }
            fleet.default_max_tokens = max_tokens;
            fleet.open = model.options(smoe_engine::Precision::Fast, ctx);
            // The device is chosen once at start; each model then opens its own backend on it.
            let gpu_opts = device::cuda_options(model.gpu_cache, model.gpu_misses, None, smoe_engine::Precision::Fast)?;
            match model.device.choose(&gpu_opts)? {
                (device::Chosen::Cpu, line) => eprintln!("{line}"),
                (device::Chosen::Cuda(b), line) => {
                    eprintln!("{line}");
                    let ordinal = b.device().ordinal;
                    drop(b);
                    let auto = model.device == device::Device::Auto;
                    fleet.opener = std::sync::Arc::new(device::CudaOpener { ordinal, opts: gpu_opts, line, auto });
                }
            }
            fleet.memory = match memory {
                None => None,
                Some(smoe_engine::CacheSize::Bytes(b)) => Some(b),
                Some(_) => anyhow::bail!("--memory takes a size such as 12GiB"),
            };
            if !(memory_watch.is_finite() && memory_watch >= 0.0) {
                anyhow::bail!("--memory-watch takes seconds (0: off)");
            }
            fleet.memory_watch = (memory_watch > 0.0).then(|| std::time::Duration::from_secs_f64(memory_watch.max(0.05)));
            fleet.memory_headroom = match memory_headroom {
                smoe_engine::CacheSize::Bytes(b) => b,
                _ => anyhow::bail!("--memory-headroom takes a size such as 256MiB"),
            };
            let cfg = smoe_server::ServerConfig {
                addr: std::net::SocketAddr::new(ip, port),
                api_key,
                cors_origins: cors_origin,
                body_limit: body_limit_mib << 20,
                fleet,
            };
            smoe_server::serve(cfg).map_err(anyhow::Error::msg)
        }
        Command::Bench { vault, prompt_tokens, gen_tokens, chunk, reps, json, routing_trace, batch, model } => {
            let t0 = std::time::Instant::now();
            let job = cmd_bench::BenchJob { prompt_tokens, gen_tokens, chunk, reps, json, routing_trace, batch, model, t0 };
            cmd_bench::run_bench(&vault, job)
        }
        Command::MemBandwidth { threads, mib } => cmd_bench::mem_bandwidth(threads, mib),
        Command::Replay { trace, cache, batch, shape, json } => cmd_replay::run(&trace, &cache, batch, shape.as_deref(), json),
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
    cmd_vault::run_shatter(&model, &vault, Some(Format::Q4_K.into()), Format::Q8_0, None, None)?;
    println!();
    cmd_vault::run_inspect(&vault, false)?;
    println!();
    // The default prompt is written with a literal "\n" so it survives shells; make it a newline.
    let prompt = prompt.replace("\\n", "\n");
    // A deliberately small cache (a quarter of the experts) so the demo streams from disk.
    let experts = smoe_vault::Vault::open(&vault)?.manifest().experts.layers.len() * 32;
    let engine = cmd_run::ModelArgs::with_cache(smoe_engine::CacheSize::Experts(experts / 4)).open_cpu(
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
