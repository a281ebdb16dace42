//! Turning logits into the next token.
//!
//! Order, as Hugging Face's logits processors apply it: repetition penalty (over the whole
//! context), presence and frequency penalties (over generated tokens, as OpenAI defines them),
//! temperature, top-k, top-p, min-p, then a draw from the remaining distribution. Temperature 0
//! is greedy. A seed makes a run reproducible; without one a seed is drawn and reported.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling settings.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 for greedy.
    pub temperature: f32,
    /// Keep the k most likely tokens (0: off).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p (1: off).
    pub top_p: f32,
    /// Drop tokens below `min_p` times the top probability (0: off).
    pub min_p: f32,
    /// Divide positive / multiply negative logits of tokens already in the context (1: off).
    pub repetition_penalty: f32,
    /// Subtract from tokens generated at least once (0: off).
    pub presence_penalty: f32,
    /// Subtract per occurrence among generated tokens (0: off).
    pub frequency_penalty: f32,
    /// Random seed (None: drawn from the OS, see [`Sampler::seed`]).
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Rejects values with no meaning (negative temperature, top-p outside (0, 1], ...).
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!("temperature must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return Err(format!("repetition_penalty must be > 0, got {}", self.repetition_penalty));
        }
        for (n, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{n} must be in [-2, 2], got {v}"));
            }
        }
        Ok(())
    }
}

/// A sampler with its random state and scratch space.
pub struct Sampler {
    params: SamplingParams,
    seed: u64,
    rng: StdRng,
    candidates: Vec<(f32, u32)>,
    counts: std::collections::HashMap<u32, u32>,
    /// `seen[t] == stamp` marks tokens already penalised this step (no per-step allocation).
    seen: Vec<u32>,
    stamp: u32,
}

impl Sampler {
    /// A sampler for `params`.
    pub fn new(params: SamplingParams) -> Sampler {
        let seed = params.seed.unwrap_or_else(|| rand::rng().random());
        Sampler {
            rng: StdRng::seed_from_u64(seed),
            seed,
            params,
            candidates: Vec::new(),
            counts: Default::default(),
            seen: Vec::new(),
            stamp: 0,
        }
    }

    /// The seed in use (reproduces this run when passed back).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// The settings.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token. `context` is every token so far (prompt and generated);
    /// `generated` is how many of its last tokens were generated. `logits` is modified.
    pub fn sample(&mut self, logits: &mut [f32], context: &[u32], generated: usize) -> u32 {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            self.seen.resize(logits.len(), 0);
            self.stamp = self.stamp.wrapping_add(1).max(1);
            for &t in context {
                if let (Some(l), Some(s)) = (logits.get_mut(t as usize), self.seen.get_mut(t as usize)) {
                    if *s != self.stamp {
                        *s = self.stamp;
                        *l = if *l > 0.0 { *l / p.repetition_penalty } else { *l * p.repetition_penalty };
                    }
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            self.counts.clear();
            for &t in &context[context.len() - generated.min(context.len())..] {
                *self.counts.entry(t).or_default() += 1;
            }
            for (&t, &c) in &self.counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
        }
        if p.temperature == 0.0 {
            return argmax(logits);
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(logits.iter().enumerate().filter(|(_, l)| l.is_finite()).map(|(i, &l)| (l / p.temperature, i as u32)));
        if c.is_empty() {
            return argmax(logits);
        }
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, |a, b| b.0.total_cmp(&a.0));
            c.truncate(p.top_k);
        }
        c.sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        // Softmax over the survivors, in place.
        let max = c[0].0;
        let mut sum = 0f64;
        for x in c.iter_mut() {
            x.0 = (x.0 - max).exp();
            sum += x.0 as f64;
        }
        for x in c.iter_mut() {
            x.0 = (x.0 as f64 / sum) as f32;
        }
        if p.top_p < 1.0 {
            let mut acc = 0f32;
            let keep = c.iter().position(|x| {
                acc += x.0;
                acc >= p.top_p
            });
            c.truncate(keep.map_or(c.len(), |i| i + 1));
        }
        if p.min_p > 0.0 {
            let floor = c[0].0 * p.min_p;
            c.retain(|x| x.0 >= floor);
        }
        let total: f32 = c.iter().map(|x| x.0).sum();
        let mut r = self.rng.random::<f32>() * total;
        for x in c.iter() {
            r -= x.0;
            if r <= 0.0 {
                return x.1;
            }
        }
        c.last().unwrap().1
    }
}

/// Index of the largest value (the first, on ties).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams { temperature: 1.0, seed: Some(7), ..Default::default() };
        f(&mut p);
        p
    }

    #[test]
    fn greedy_and_penalties() {
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&mut [0.1, 3.0, 2.0], &[], 0), 1);
        // Repetition penalty 4 turns 3.0 into 0.75 for a token already in the context.
        let mut s = Sampler::new(SamplingParams { repetition_penalty: 4.0, ..Default::default() });
        assert_eq!(s.sample(&mut [0.1, 3.0, 2.0], &[1], 0), 2);
        // Frequency penalty counts generated occurrences only.
        let mut s = Sampler::new(SamplingParams { frequency_penalty: 0.6, ..Default::default() });
        assert_eq!(s.sample(&mut [0.0, 3.0, 2.0], &[1, 1, 5], 1), 1);
        assert_eq!(s.sample(&mut [0.0, 3.0, 2.0], &[5, 1, 1], 2), 2);
    }

    #[test]
    fn top_k_top_p_min_p_restrict_the_draw() {
        let logits = [1.0f32, 2.0, 3.0, 4.0, 5.0];
        for (p, allowed) in [
            (params(|p| p.top_k = 2), vec![3u32, 4]),
            (params(|p| p.top_p = 0.6), vec![4]),
            (params(|p| p.top_p = 0.85), vec![3, 4]),
            (params(|p| p.top_p = 0.9), vec![2, 3, 4]),
            (params(|p| p.min_p = 0.3), vec![3, 4]),
        ] {
            let mut s = Sampler::new(p.clone());
            for _ in 0..200 {
                let t = s.sample(&mut logits.clone(), &[], 0);
                assert!(allowed.contains(&t), "{p:?} drew {t}");
            }
        }
    }

    #[test]
    fn seeded_draws_repeat_and_follow_the_distribution() {
        let logits = [0.0f32, (2.0f32).ln(), (3.0f32).ln()];
        let draw = |seed| {
            let mut s = Sampler::new(params(|p| p.seed = Some(seed)));
            (0..3000).map(|_| s.sample(&mut logits.clone(), &[], 0)).collect::<Vec<_>>()
        };
        assert_eq!(draw(11), draw(11));
        assert_ne!(draw(11), draw(12));
        let d = draw(3);
        let share = |t| d.iter().filter(|&&x| x == t).count() as f64 / d.len() as f64;
        for (t, want) in [(0, 1.0 / 6.0), (1, 2.0 / 6.0), (2, 3.0 / 6.0)] {
            assert!((share(t) - want).abs() < 0.03, "token {t}: {} vs {want}", share(t));
        }
    }

    #[test]
    fn invalid_settings_are_rejected() {
        assert!(SamplingParams { temperature: -1.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams { top_p: 0.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams { presence_penalty: 3.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams::default().validate().is_ok());
    }
}
