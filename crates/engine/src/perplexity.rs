//! `smoe perplexity`: how well a model predicts a text, the usual yardstick of a quantization.
//!
//! As llama.cpp's `llama-perplexity` does: the tokens are cut into windows of `ctx`, each run
//! from an empty KV cache in one prefill; in each window the first half is context only and
//! every later position is scored (the negative log-likelihood of the token that follows it),
//! so every scored prediction has at least `ctx / 2` tokens before it. Perplexity is
//! `exp(mean NLL)`.

use crate::backend::Backend;
use crate::forward::Logits;
use crate::{EngineError, Model, NoObserver};

/// What [`perplexity`] measured.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Perplexity {
    /// `exp(mean_nll)`.
    pub perplexity: f64,
    /// Mean negative log-likelihood, nats per token.
    pub mean_nll: f64,
    /// Standard error of `mean_nll`.
    pub nll_stderr: f64,
    /// Predictions scored.
    pub scored: usize,
    /// Windows run.
    pub windows: usize,
    /// Window length.
    pub ctx: usize,
}

/// Perplexity of `ids` in windows of `ctx` tokens (see the module documentation); a trailing
/// piece shorter than a window is left out. `on_window(done, of)` reports progress.
pub fn perplexity<B: Backend>(
    model: &Model<B>,
    ids: &[u32],
    ctx: usize,
    mut on_window: impl FnMut(usize, usize),
) -> Result<Perplexity, EngineError> {
    if ctx < 4 {
        return Err(EngineError::Input(format!("a perplexity window of {ctx} tokens is too short (at least 4)")));
    }
    let windows = ids.len() / ctx;
    if windows == 0 {
        return Err(EngineError::Input(format!("{} tokens do not fill one window of {ctx}", ids.len())));
    }
    let vocab = model.arch().vocab_size;
    let mut st = model.new_state(model.prefill_chunk());
    model.reserve(&mut st, ctx);
    let (mut sum, mut sum_sq, mut n) = (0f64, 0f64, 0usize);
    for w in 0..windows {
        let win = &ids[w * ctx..(w + 1) * ctx];
        st.truncate(0);
        let logits = model.forward(&mut st, win, Logits::All, &mut NoObserver)?;
        for t in ctx / 2..ctx - 1 {
            let nll = nll(&logits[t * vocab..(t + 1) * vocab], win[t + 1] as usize);
            sum += nll;
            sum_sq += nll * nll;
            n += 1;
        }
        on_window(w + 1, windows);
    }
    let mean = sum / n as f64;
    let var = (sum_sq / n as f64 - mean * mean).max(0.0);
    Ok(Perplexity { perplexity: mean.exp(), mean_nll: mean, nll_stderr: (var / n as f64).sqrt(), scored: n, windows, ctx })
}

/// `-log softmax(logits)[target]`, in f64 with the maximum subtracted first.
fn nll(logits: &[f32], target: usize) -> f64 {
    let max = logits.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
    let z: f64 = logits.iter().map(|&x| (x as f64 - max).exp()).sum();
    (z.ln() + max) - logits[target] as f64
}

#[cfg(test)]
mod tests {
    use super::nll;

    #[test]
    fn nll_is_minus_log_softmax() {
        let l = [1.0f32, 2.0, 3.0];
        let z: f64 = l.iter().map(|&x| (x as f64).exp()).sum();
        assert!((nll(&l, 2) - (z.ln() - 3.0)).abs() < 1e-12);
        // Large logits do not overflow.
        assert!((nll(&[1000.0, 1000.0], 0) - std::f64::consts::LN_2).abs() < 1e-12);
    }
}
