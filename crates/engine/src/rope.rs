//! Rotary position embedding tables, computed as transformers computes them (frequencies and
//! angles in f32, YaRN's ramp and attention factor from `_compute_yarn_parameters`).

use smoe_vault::{Architecture, Rope, RopeScaling};

/// Frequencies and scaling of one model's RoPE.
#[derive(Clone, Debug)]
pub struct RopeTable {
    inv_freq: Vec<f32>,
    /// Multiplies cos and sin (YaRN's attention factor; 1 otherwise).
    pub attention_factor: f32,
    /// Rotated dimensions per head.
    pub rotary_dim: usize,
    /// Adjacent-pair rotation.
    pub interleaved: bool,
}

/// YaRN's magnitude correction, `0.1 * m * ln(scale) + 1`.
pub fn yarn_mscale(scale: f64, m: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * m * scale.ln() + 1.0
    }
}

impl RopeTable {
    /// The table for `arch`.
    pub fn new(arch: &Architecture) -> RopeTable {
        RopeTable::of(&arch.rope)
    }

    /// The table of one set of RoPE parameters (DeepSeek-V4 has two).
    pub fn of(r: &Rope) -> RopeTable {
        let dim = r.rotary_dim;
        let base = r.theta as f32;
        let pos_freqs: Vec<f32> = (0..dim).step_by(2).map(|i| base.powf(i as f32 / dim as f32)).collect();
        let (inv_freq, attention_factor) = match &r.scaling {
            RopeScaling::None => (pos_freqs.iter().map(|p| 1.0 / p).collect(), 1.0),
            RopeScaling::Linear { factor } => (pos_freqs.iter().map(|p| 1.0 / p / *factor as f32).collect(), 1.0),
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate,
            } => {
                let af = attention_factor.unwrap_or_else(|| match (mscale, mscale_all_dim) {
                    (Some(m), Some(ma)) if *m != 0.0 && *ma != 0.0 => yarn_mscale(*factor, *m) / yarn_mscale(*factor, *ma),
                    _ => yarn_mscale(*factor, 1.0),
                });
                let orig = *original_max_position_embeddings as f64;
                let correction_dim = |rot: f64| dim as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * (r.theta).ln());
                let (mut low, mut high) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0) as f32;
                let mut high = high.min(dim as f64 - 1.0) as f32;
                if low == high {
                    high += 0.001;
                }
                let inv: Vec<f32> = pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        let interp = 1.0 / (*factor as f32 * p);
                        let extra = 1.0 / p;
                        interp * (1.0 - extrapolation) + extra * extrapolation
                    })
                    .collect();
                (inv, af as f32)
            }
        };
        RopeTable { inv_freq, attention_factor, rotary_dim: dim, interleaved: r.interleaved }
    }

    /// Fills `cos`/`sin` with `rotary_dim / 2` values for each of `positions` (a step's rows:
    /// consecutive for one sequence, each sequence's own in a batch).
    pub fn fill(&self, positions: &[usize], cos: &mut Vec<f32>, sin: &mut Vec<f32>) {
        let half = self.inv_freq.len();
        let n = positions.len();
        cos.resize(n * half, 0.0);
        sin.resize(n * half, 0.0);
        for (t, &pos) in positions.iter().enumerate() {
            let p = pos as f32;
            for (i, &f) in self.inv_freq.iter().enumerate() {
                let angle = p * f;
                cos[t * half + i] = angle.cos() * self.attention_factor;
                sin[t * half + i] = angle.sin() * self.attention_factor;
            }
        }
    }

    /// Cosines (and sines) per position: `rotary_dim / 2`.
    pub fn half(&self) -> usize {
        self.inv_freq.len()
    }
}
