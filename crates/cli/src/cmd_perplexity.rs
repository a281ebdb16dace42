//! `smoe perplexity`: how well a model predicts a text (llama.cpp's method; see
//! `smoe_engine::perplexity`).

use crate::cmd_run::{parse_ids, ModelArgs};
use crate::device::OnEngine;
use anyhow::{bail, Context, Result};
use smoe_engine::{Backend, Engine, OpenReport, Precision};
use std::path::PathBuf;

/// What `smoe perplexity` was asked.
pub struct PerplexityArgs {
    pub vault: PathBuf,
    /// A text file, tokenized raw (no template, no special tokens added).
    pub text: Option<PathBuf>,
    /// Or token ids.
    pub ids_file: Option<PathBuf>,
    pub ctx: usize,
    pub fast: bool,
    pub json: bool,
    pub model: ModelArgs,
}

enum Source {
    Text(String),
    Ids(Vec<u32>),
}

struct Job {
    source: Source,
    ctx: usize,
    json: bool,
    what: String,
}

pub fn run(a: PerplexityArgs) -> Result<()> {
    let (source, what) = match (&a.text, &a.ids_file) {
        (Some(t), None) => {
            (Source::Text(std::fs::read_to_string(t).with_context(|| format!("read {}", t.display()))?), t.display().to_string())
        }
        (None, Some(f)) if f.extension().is_some_and(|e| e == "safetensors") => {
            let t = smoe_formats::trace::read(f)?;
            let ids = t.input_ids.with_context(|| format!("{}: no `input_ids` tensor", f.display()))?;
            (Source::Ids(ids), f.display().to_string())
        }
        (None, Some(f)) => (
            Source::Ids(parse_ids(&std::fs::read_to_string(f).with_context(|| format!("read {}", f.display()))?)?),
            f.display().to_string(),
        ),
        _ => bail!("give exactly one of --text and --ids-file"),
    };
    let precision = if a.fast { Precision::Fast } else { Precision::Reference };
    a.model.open_on(&a.vault, precision, Some(a.ctx), Job { source, ctx: a.ctx, json: a.json, what })
}

impl OnEngine for Job {
    type Out = ();
    fn run<B: Backend + 'static>(self, engine: Engine<B>, _: OpenReport) -> Result<()> {
        let ids = match self.source {
            Source::Ids(ids) => ids,
            Source::Text(t) => engine.tokenizer.encode(&t)?,
        };
        let t0 = std::time::Instant::now();
        let json = self.json;
        let p = smoe_engine::perplexity::perplexity(&engine.model, &ids, self.ctx, |done, of| {
            if !json {
                eprint!("\rwindow {done}/{of}");
            }
        });
        if !json {
            // End the progress line, whether the windows all ran or one failed.
            eprintln!();
        }
        let p = p?;
        if json {
            let mut v = serde_json::to_value(&p)?;
            v["input"] = self.what.into();
            v["tokens"] = ids.len().into();
            v["seconds"] = t0.elapsed().as_secs_f64().into();
            println!("{v}");
        } else {
            println!(
                "perplexity {:.4} (mean NLL {:.4} ± {:.4} nats/token) over {} predictions in {} windows of {} ({} tokens of {}), {:.1} s",
                p.perplexity,
                p.mean_nll,
                p.nll_stderr,
                p.scored,
                p.windows,
                p.ctx,
                ids.len(),
                self.what,
                t0.elapsed().as_secs_f64()
            );
        }
        Ok(())
    }
}
