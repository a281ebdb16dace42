//! The `smoe` command: parses arguments and hands each subcommand to the library crates.

mod cmd_vault;
mod progress;

use anyhow::Result;
use clap::{Parser, Subcommand};
use smoe_quant::Format;
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "smoe",
    version,
    about = "Run Mixture-of-Experts models larger than memory, streaming experts from SSD"
)]
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
    /// Describe a vault: architecture, formats, sizes.
    Inspect {
        vault: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Check every checksum in a vault; exits non-zero naming the first bad tensor or blob.
    Verify { vault: PathBuf },
    /// Shatter the bundled demo model and show what is inside.
    Demo {
        /// Checkpoint to use instead of the bundled one.
        #[arg(long)]
        model: Option<PathBuf>,
    },
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("SMOE_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run(Cli::parse()) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Shatter {
            input,
            out,
            experts,
            dense,
            threads,
        } => cmd_vault::run_shatter(&input, &out, experts, dense, threads).map(|_| ()),
        Command::Inspect { vault, json } => cmd_vault::run_inspect(&vault, json),
        Command::Verify { vault } => cmd_vault::run_verify(&vault),
        Command::Demo { model } => demo(model),
    }
}

/// The bundled demo checkpoint, found relative to the source tree the binary was built from.
fn bundled_model() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../models/stdlib-moe"
    ))
}

fn demo(model: Option<PathBuf>) -> Result<()> {
    let model = model.unwrap_or_else(bundled_model);
    let dir = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../target/smoe-demo"
    ));
    std::fs::create_dir_all(&dir)?;
    let vault = dir.join("stdlib-moe.smoe");
    cmd_vault::run_shatter(&model, &vault, Format::Q4_K, Format::Q8_0, None)?;
    println!();
    cmd_vault::run_inspect(&vault, false)?;
    cmd_vault::run_verify(&vault)
}
