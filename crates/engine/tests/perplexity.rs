//! `smoe perplexity` on the bundled trained model: the held-out texts of `testdata/traces`
//! (Python the model did not train on, in its own tokenizer) are predicted far better than
//! chance, and the windowed figure is exactly the mean of per-token NLLs from `score`.

mod common;

use common::load;
use smoe_convert::{shatter, ShatterOptions, Silent};
use smoe_engine::perplexity::perplexity;
use smoe_engine::{score, ScoreMode};
use smoe_quant::Format;
use std::path::Path;

#[test]
fn the_trained_model_predicts_held_out_text_and_windows_score_their_second_half() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let dir = tempfile::tempdir().unwrap();
    let vault = dir.path().join("stdlib.smoe");
    let opts = ShatterOptions { experts: Format::BF16.into(), dense: Format::BF16, threads: Some(2), ..Default::default() };
    shatter(&root.join("models/stdlib-moe"), &vault, &opts, &Silent).unwrap();
    let model = load(&vault);
    let trace = smoe_formats::trace::read(&root.join("testdata/traces/trained_moe_48x6.safetensors")).unwrap();
    let ids = &trace.input_ids.unwrap()[..2 * 1024 + 100];
    let ctx = 256;
    let p = perplexity(&model, ids, ctx, |_, _| {}).unwrap();
    // 8 whole windows; the trailing 100 tokens are left out; 127 predictions per window.
    assert_eq!((p.windows, p.scored), (8, 8 * 127));
    // Chance is ln(1024) = 6.93 nats; over all 8 texts at ctx 1024 the model scores 2.89
    // (docs/quality.md).
    assert!(p.mean_nll < 4.0, "mean NLL {}", p.mean_nll);
    // The same figure from `score`'s logits, window by window.
    let vocab = model.arch().vocab_size;
    let mut sum = 0f64;
    for w in 0..8 {
        let win = &ids[w * ctx..(w + 1) * ctx];
        let logits = score(&model, win, ScoreMode::Prefill, 64, false).unwrap().logits;
        for t in ctx / 2..ctx - 1 {
            let row = &logits[t * vocab..(t + 1) * vocab];
            let z: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
            sum += z.ln() - row[win[t + 1] as usize] as f64;
        }
    }
    let mean = sum / p.scored as f64;
    assert!((mean - p.mean_nll).abs() < 1e-3, "{mean} vs {}", p.mean_nll);
    assert!(perplexity(&model, &ids[..100], ctx, |_, _| {}).unwrap_err().to_string().contains("do not fill one window"));
}
