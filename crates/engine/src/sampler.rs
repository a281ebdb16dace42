//! Turning logits into the next token.
//!
//! Order, as Hugging Face's logits processors apply it: repetition penalty (over the whole
//! context), presence and frequency penalties (over generated tokens, as OpenAI defines them),
//! temperature, top-k, top-p, min-p, then a draw from the remaining distribution. Temperature 0
//! is greedy. A seed makes a run reproducible; without one a seed is drawn and reported.
//!
//! [`SamplingRequest`] is what a front end asks for (flags, request fields), each setting
//! optional; [`SamplingRequest::resolve`] fills in the model's generation_config.json defaults.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use smoe_vault::GenerationDefaults;

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

impl SamplingParams {
    /// The model's defaults from generation_config.json: its temperature, top-p, top-k and min-p
    /// when it asks for sampling (`do_sample`, or a temperature without `do_sample`), greedy
    /// otherwise; its repetition penalty either way.
    pub fn from_defaults(d: &GenerationDefaults) -> SamplingParams {
        let mut p = SamplingParams::default();
        if d.do_sample.unwrap_or(d.temperature.is_some()) {
            p.temperature = d.temperature.unwrap_or(1.0) as f32;
            p.top_p = d.top_p.unwrap_or(1.0) as f32;
            p.top_k = d.top_k.unwrap_or(0) as usize;
            p.min_p = d.min_p.unwrap_or(0.0) as f32;
        }
        p.repetition_penalty = d.repetition_penalty.unwrap_or(1.0) as f32;
        p
    }
}

/// Sampling settings as a caller asks for them (command-line flags, API request fields): each
/// one given overrides the model's default, see [`resolve`](Self::resolve).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingRequest {
    /// Temperature (0: greedy).
    pub temperature: Option<f32>,
    /// Top-k (0: off).
    pub top_k: Option<usize>,
    /// Top-p (1: off).
    pub top_p: Option<f32>,
    /// Min-p (0: off).
    pub min_p: Option<f32>,
    /// Repetition penalty (1: off).
    pub repetition_penalty: Option<f32>,
    /// Presence penalty (0: off; no model default).
    pub presence_penalty: Option<f32>,
    /// Frequency penalty (0: off; no model default).
    pub frequency_penalty: Option<f32>,
    /// Seed (none: drawn).
    pub seed: Option<u64>,
}

impl SamplingRequest {
    /// The settings to sample with: what was asked, the rest from the model's `defaults`
    /// ([`SamplingParams::from_defaults`]). Values are not checked here;
    /// [`SamplingParams::validate`] does that.
    pub fn resolve(&self, defaults: &GenerationDefaults) -> SamplingParams {
        let d = SamplingParams::from_defaults(defaults);
        SamplingParams {
            temperature: self.temperature.unwrap_or(d.temperature),
            top_k: self.top_k.unwrap_or(d.top_k),
            top_p: self.top_p.unwrap_or(d.top_p),
            min_p: self.min_p.unwrap_or(d.min_p),
            repetition_penalty: self.repetition_penalty.unwrap_or(d.repetition_penalty),
            presence_penalty: self.presence_penalty.unwrap_or(d.presence_penalty),
            frequency_penalty: self.frequency_penalty.unwrap_or(d.frequency_penalty),
            seed: self.seed.or(d.seed),
        }
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
    fn requests_resolve_against_the_model_defaults() {
        let sampling = GenerationDefaults {
            do_sample: Some(true),
            temperature: Some(0.6),
            top_p: Some(0.95),
            top_k: Some(20),
            repetition_penalty: Some(1.1),
            ..Default::default()
        };
        let d = SamplingParams::from_defaults(&sampling);
        assert_eq!(
            d,
            SamplingParams { temperature: 0.6, top_p: 0.95, top_k: 20, min_p: 0.0, repetition_penalty: 1.1, ..Default::default() }
        );
        // Nothing asked: the defaults; each field asked overrides its default only.
        assert_eq!(SamplingRequest::default().resolve(&sampling), d);
        let r =
            SamplingRequest { temperature: Some(0.0), top_k: Some(0), presence_penalty: Some(0.5), seed: Some(9), ..Default::default() };
        assert_eq!(r.resolve(&sampling), SamplingParams { temperature: 0.0, top_k: 0, presence_penalty: 0.5, seed: Some(9), ..d.clone() });
        let all = SamplingRequest {
            temperature: Some(1.5),
            top_k: Some(5),
            top_p: Some(0.5),
            min_p: Some(0.1),
            repetition_penalty: Some(1.3),
            presence_penalty: Some(-1.0),
            frequency_penalty: Some(1.0),
            seed: Some(1),
        };
        assert_eq!(
            all.resolve(&sampling),
            SamplingParams {
                temperature: 1.5,
                top_k: 5,
                top_p: 0.5,
                min_p: 0.1,
                repetition_penalty: 1.3,
                presence_penalty: -1.0,
                frequency_penalty: 1.0,
                seed: Some(1)
            }
        );
        // A model that does not ask for sampling is greedy, but keeps its repetition penalty; a
        // temperature alone asks for sampling.
        let greedy =
            GenerationDefaults { do_sample: Some(false), temperature: Some(0.7), repetition_penalty: Some(1.05), ..Default::default() };
        assert_eq!(SamplingParams::from_defaults(&greedy), SamplingParams { repetition_penalty: 1.05, ..Default::default() });
        let warm = GenerationDefaults { temperature: Some(0.7), ..Default::default() };
        assert_eq!(SamplingParams::from_defaults(&warm), SamplingParams { temperature: 0.7, ..Default::default() });
        assert_eq!(SamplingRequest { top_p: Some(0.9), ..Default::default() }.resolve(&GenerationDefaults::default()).top_p, 0.9);
        assert_eq!(SamplingParams::from_defaults(&GenerationDefaults::default()), SamplingParams::default());
    }

    #[test]
    fn invalid_settings_are_rejected() {
        assert!(SamplingParams { temperature: -1.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams { top_p: 0.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams { presence_penalty: 3.0, ..Default::default() }.validate().is_err());
        assert!(SamplingParams::default().validate().is_ok());
    }
}
