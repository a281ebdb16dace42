//! Eviction policies for the expert cache.
//!
//! A policy sees every layer visit (which experts a layer used) and, when slots must be freed,
//! ranks the resident, unpinned experts. Two are provided:
//!
//! - [`Lru`]: least recently used.
//! - [`ReuseDistance`]: evicts the expert whose *expected time to next use* is longest — an
//!   online estimate of Belady's rule. Layers are visited in a fixed cycle, so an expert of a
//!   layer `d` layers ahead can next be used in `d` steps at the earliest, and one that is used
//!   with probability `p` per visit is expected back after `d + L(1/p - 1)` steps. `p` blends a
//!   slow exponential average of how often the expert is chosen with whether the previous token
//!   chose it (adjacent tokens reuse experts). Replayed on the routing of a trained MoE
//!   (`tests/policy_replay.rs`), it closes much of the gap between LRU and Belady's optimum;
//!   it is the default.

/// A (MoE layer ordinal, expert) pair. Layers are numbered among MoE layers only, so they are
/// dense `0..L`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Key {
    /// MoE layer ordinal.
    pub layer: u32,
    /// Expert index.
    pub expert: u32,
}

/// An eviction policy. See the module documentation.
pub trait EvictionPolicy: Send {
    /// Short name for reports.
    fn name(&self) -> &'static str;
    /// Layer `layer` is being computed with `experts`.
    fn touch(&mut self, layer: u32, experts: &[u32]);
    /// Picks `n` victims among `candidates` (resident, unpinned), best first, into `out`.
    /// `now` is the layer being computed.
    fn victims(&mut self, now: u32, candidates: &[(usize, Key)], n: usize, out: &mut Vec<usize>);
}

/// Which policy to use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyKind {
    /// Least recently used.
    Lru,
    /// Expected reuse distance (the default).
    ReuseDistance,
}

impl std::str::FromStr for PolicyKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lru" => Ok(PolicyKind::Lru),
            "reuse" | "reuse-distance" => Ok(PolicyKind::ReuseDistance),
            _ => Err(format!("unknown cache policy '{s}' (lru, reuse-distance)")),
        }
    }
}

impl PolicyKind {
    /// A policy for `layers` MoE layers of `experts` experts each.
    pub fn build(self, layers: usize, experts: usize) -> Box<dyn EvictionPolicy> {
        match self {
            PolicyKind::Lru => Box::new(Lru::new(layers, experts)),
            PolicyKind::ReuseDistance => Box::new(ReuseDistance::new(layers, experts)),
        }
    }
}

/// Picks the `n` candidates with the largest `score`, best first.
fn pick_largest(candidates: &[(usize, Key)], n: usize, score: impl Fn(Key) -> f32, out: &mut Vec<usize>) {
    out.clear();
    if n == 0 {
        return;
    }
    let mut scored: Vec<(f32, usize)> = candidates.iter().map(|&(s, k)| (score(k), s)).collect();
    let n = n.min(scored.len());
    if n < scored.len() {
        scored.select_nth_unstable_by(n - 1, |a, b| b.0.total_cmp(&a.0));
        scored.truncate(n);
    }
    scored.sort_by(|a, b| b.0.total_cmp(&a.0));
    out.extend(scored.iter().map(|&(_, s)| s));
}

/// Least recently used.
pub struct Lru {
    experts: usize,
    tick: u64,
    last: Vec<u64>,
}

impl Lru {
    /// For `layers` x `experts` keys.
    pub fn new(layers: usize, experts: usize) -> Lru {
        Lru { experts, tick: 0, last: vec![0; layers * experts] }
    }
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn touch(&mut self, layer: u32, experts: &[u32]) {
        for &e in experts {
            self.tick += 1;
            self.last[layer as usize * self.experts + e as usize] = self.tick;
        }
    }
    fn victims(&mut self, _now: u32, candidates: &[(usize, Key)], n: usize, out: &mut Vec<usize>) {
        let (last, ex) = (&self.last, self.experts);
        pick_largest(candidates, n, |k| -(last[k.layer as usize * ex + k.expert as usize] as f32), out);
    }
}

/// Expected reuse distance. See the module documentation.
pub struct ReuseDistance {
    layers: usize,
    experts: usize,
    /// Exponential average of "chosen at this visit", per key.
    freq: Vec<f32>,
    /// Chosen at the most recent visit of its layer.
    last: Vec<bool>,
}

impl ReuseDistance {
    /// Weight of the newest visit in the frequency average (a memory of ~33 visits).
    pub const DECAY: f32 = 0.97;
    /// Probability floor, so never-seen experts rank as far but finite.
    pub const FLOOR: f32 = 0.005;

    /// For `layers` x `experts` keys.
    pub fn new(layers: usize, experts: usize) -> ReuseDistance {
        ReuseDistance { layers, experts, freq: vec![1.0 / experts as f32; layers * experts], last: vec![false; layers * experts] }
    }

    /// Estimated probability that `k` is chosen at its layer's next visit: half the long-run
    /// frequency, half a recency term (0.3 if the previous token chose it — the adjacent-token
    /// reuse of trained MoEs — else a little below its frequency).
    fn p_next(&self, i: usize) -> f32 {
        let f = self.freq[i];
        let recency = if self.last[i] { 0.3 } else { 0.8 * f };
        (0.5 * f + 0.5 * recency).clamp(Self::FLOOR, 1.0)
    }
}

impl EvictionPolicy for ReuseDistance {
    fn name(&self) -> &'static str {
        "reuse-distance"
    }
    fn touch(&mut self, layer: u32, experts: &[u32]) {
        let base = layer as usize * self.experts;
        for i in base..base + self.experts {
            self.freq[i] *= Self::DECAY;
            self.last[i] = false;
        }
        for &e in experts {
            let i = base + e as usize;
            self.freq[i] += 1.0 - Self::DECAY;
            self.last[i] = true;
        }
    }
    fn victims(&mut self, now: u32, candidates: &[(usize, Key)], n: usize, out: &mut Vec<usize>) {
        let l = self.layers as f32;
        pick_largest(
            candidates,
            n,
            |k| {
                let d = (k.layer as i64 - now as i64).rem_euclid(self.layers as i64);
                let d = if d == 0 { self.layers as f32 } else { d as f32 };
                d + l * (1.0 / self.p_next(k.layer as usize * self.experts + k.expert as usize) - 1.0)
            },
            out,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(v: &[(u32, u32)]) -> Vec<(usize, Key)> {
        v.iter().enumerate().map(|(i, &(layer, expert))| (i, Key { layer, expert })).collect()
    }

    #[test]
    fn lru_evicts_the_oldest() {
        let mut p = Lru::new(2, 4);
        p.touch(0, &[1, 2]);
        p.touch(1, &[3]);
        p.touch(0, &[1]);
        let mut out = vec![];
        p.victims(0, &keys(&[(0, 1), (0, 2), (1, 3)]), 2, &mut out);
        assert_eq!(out, vec![1, 2]);
    }

    #[test]
    fn reuse_distance_keeps_popular_and_soon_needed_experts() {
        let mut p = ReuseDistance::new(3, 8);
        for _ in 0..50 {
            p.touch(0, &[0, 1]);
            p.touch(1, &[0, 1]);
            p.touch(2, &[0, 1]);
        }
        p.touch(0, &[5, 1]);
        let mut out = vec![];
        // A rarely used expert goes before a popular one; among popular ones, the layer needed
        // soonest (layer 1, next after 0) stays.
        p.victims(0, &keys(&[(1, 0), (0, 5), (2, 0)]), 1, &mut out);
        assert_eq!(out, vec![1]);
        p.victims(0, &keys(&[(1, 0), (2, 0)]), 1, &mut out);
        assert_eq!(out, vec![1]);
    }
}
