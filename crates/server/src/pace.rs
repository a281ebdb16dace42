//! How many prompt tokens a batched step may take while other generations are streaming.
//!
//! A step runs a token of every decoding generation and then chunks of new prompts. Left at
//! the step's whole token budget, a prompt chunk makes that step as long as a prefill of
//! 256 tokens — seconds on a CPU with a large model — and every stream pauses that long (the
//! first load runs on the 48-layer 30B shape saw 3.6 s pauses at p99 with 16 clients). The
//! scheduler therefore learns what its steps cost and gives prompts only what fits in a
//! stall limit beside the streams (`--max-stall-ms`), as Sarathi-Serve sizes its chunks from a
//! latency target. With nobody streaming, prompts take the whole budget.

use std::time::Duration;

/// Prompt tokens a step takes at least while streams run, so that prompts always advance
/// (and their expert products keep a few tokens per expert).
pub const MIN_PROMPT_TOKENS: usize = 32;

/// The stall limit when `--max-stall-ms` is not given.
pub const DEFAULT_STALL: Duration = Duration::from_millis(1000);

/// What the model's batched steps cost, learned from the steps it ran (exponential
/// averages): a step of decode tokens only, and each prompt token added to a step.
#[derive(Clone, Debug, Default)]
pub struct Pace {
    decode_step: Option<f64>,
    per_prompt_token: Option<f64>,
}

impl Pace {
    /// Weight of the newest step in the averages.
    const NEW: f64 = 0.3;

    /// A step ran `decode` decode tokens and `prompt` prompt tokens in `secs`.
    pub fn observe(&mut self, decode: usize, prompt: usize, secs: f64) {
        let blend = |old: Option<f64>, new: f64| Some(old.map_or(new, |o| o + Self::NEW * (new - o)));
        if prompt == 0 {
            if decode > 0 {
                self.decode_step = blend(self.decode_step, secs);
            }
            return;
        }
        // The prompt tokens' share: what the step took beyond its decode tokens' usual cost.
        let beside = if decode > 0 { self.decode_step.unwrap_or(0.0) } else { 0.0 };
        let per = ((secs - beside) / prompt as f64).max(0.0);
        self.per_prompt_token = blend(self.per_prompt_token, per);
    }

    /// Prompt tokens a step may take, of `left` still free in its budget, beside `decoding`
    /// streaming generations, so that it lasts about `stall` at most. Never below
    /// [`MIN_PROMPT_TOKENS`] (nor above `left`). All of `left` when nobody streams; the
    /// minimum until a prompt token's cost is known (that step measures it).
    pub fn prompt_budget(&self, decoding: usize, left: usize, stall: Duration) -> usize {
        if decoding == 0 {
            return left;
        }
        let Some(per) = self.per_prompt_token.filter(|&p| p > 0.0) else {
            return left.min(MIN_PROMPT_TOKENS);
        };
        let room = stall.as_secs_f64() - self.decode_step.unwrap_or(0.0);
        let fits = if room > 0.0 { (room / per).floor().min(usize::MAX as f64) as usize } else { 0 };
        fits.max(MIN_PROMPT_TOKENS).min(left)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STALL: Duration = Duration::from_millis(1000);

    #[test]
    fn prompts_take_the_whole_budget_when_nobody_streams() {
        let mut p = Pace::default();
        assert_eq!(p.prompt_budget(0, 256, STALL), 256);
        p.observe(0, 256, 5.0);
        assert_eq!(p.prompt_budget(0, 256, STALL), 256);
    }

    #[test]
    fn beside_streams_prompts_take_what_fits_in_the_stall_limit() {
        let mut p = Pace::default();
        // Unknown cost: the minimum, which measures it.
        assert_eq!(p.prompt_budget(4, 252, STALL), MIN_PROMPT_TOKENS);
        p.observe(4, 0, 0.2); // a decode step of 0.2 s
        p.observe(4, 32, 0.2 + 32.0 * 0.01); // 10 ms a prompt token beside it
        assert_eq!(p.prompt_budget(4, 252, STALL), 80); // (1.0 - 0.2) / 0.01
        assert_eq!(p.prompt_budget(4, 50, STALL), 50);
        // A slow machine still advances prompts.
        p.observe(4, 0, 2.0);
        p.observe(4, 0, 2.0);
        assert!(p.decode_step.unwrap() > 1.0);
        assert_eq!(p.prompt_budget(4, 252, STALL), MIN_PROMPT_TOKENS);
        assert_eq!(p.prompt_budget(4, 10, STALL), 10);
    }

    #[test]
    fn the_averages_follow_the_newest_steps() {
        let mut p = Pace::default();
        p.observe(0, 100, 1.0);
        for _ in 0..20 {
            p.observe(0, 100, 2.0);
        }
        assert!((p.per_prompt_token.unwrap() - 0.02).abs() < 1e-4);
        // A step faster than its decode part alone counts as free prompt tokens, not negative.
        p.observe(8, 0, 1.0);
        p.observe(8, 10, 0.5);
        assert!(p.per_prompt_token.unwrap() >= 0.0);
    }
}
