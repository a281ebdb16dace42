//! How many expert reads to keep in flight, chosen by measurement.
//!
//! The best depth depends on the device. NVMe drives need many reads in flight to reach their
//! bandwidth; some virtual disks deliver more to one reader walking forward through a layer's
//! experts in offset order than to many readers at once (this project's CI machine: 1.9-2.0
//! GB/s at depth 1 against 1.4-1.6 GB/s at depth 32, the same decode). With
//! [`QueueDepth::Auto`] the store measures each depth on a window of real reads, keeps the
//! fastest, and now and then re-measures its neighbours, so a change in the device's behaviour
//! is followed.

use std::collections::VecDeque;
use std::fmt;
use std::str::FromStr;

/// Reads in flight at most: a fixed number, or chosen by measurement up to a maximum.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueDepth {
    /// Exactly this many (at least 1).
    Fixed(usize),
    /// Measured among 1, 2, 4, … up to `max`.
    Auto {
        /// The largest depth tried (the I/O engine is built for it).
        max: usize,
    },
}

impl QueueDepth {
    /// `auto` with the default maximum of 32.
    pub const AUTO: QueueDepth = QueueDepth::Auto { max: 32 };

    /// The largest depth this setting can use.
    pub fn max(self) -> usize {
        match self {
            QueueDepth::Fixed(n) => n.max(1),
            QueueDepth::Auto { max } => max.max(1),
        }
    }
}

impl Default for QueueDepth {
    fn default() -> Self {
        QueueDepth::AUTO
    }
}

impl FromStr for QueueDepth {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("auto") {
            return Ok(QueueDepth::AUTO);
        }
        match s.parse::<usize>() {
            Ok(n) if n >= 1 => Ok(QueueDepth::Fixed(n)),
            _ => Err(format!("queue depth must be `auto` or a whole number of at least 1, not `{s}`")),
        }
    }
}

impl fmt::Display for QueueDepth {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            QueueDepth::Fixed(n) => write!(f, "{n}"),
            QueueDepth::Auto { max } => write!(f, "auto (up to {max})"),
        }
    }
}

/// Reads per measurement window: long enough to smooth a single slow read, short enough that
/// trying a poor depth costs little (about 0.1 s of reads of 1.5 MB experts).
const WINDOW_READS: u64 = 96;
/// Windows at the best depth between re-measurements of its neighbours.
const EXPLOIT_WINDOWS: usize = 8;

/// Picks the depth from measured bandwidth (see the module notes); with one choice (a fixed
/// depth) it never moves.
#[derive(Clone, Debug)]
pub struct DepthTuner {
    choices: Vec<usize>,
    /// Smoothed bytes per busy second at each choice, once measured.
    rate: Vec<Option<f64>>,
    current: usize,
    plan: VecDeque<usize>,
    window: (u64, u64, f64),
    /// The best choice last announced (see [`DepthTuner::announcement`]).
    announced: Option<usize>,
}

impl DepthTuner {
    /// A tuner for `depth`.
    pub fn new(depth: QueueDepth) -> DepthTuner {
        let choices = match depth {
            QueueDepth::Fixed(n) => vec![n.max(1)],
            QueueDepth::Auto { max } => {
                let mut c: Vec<usize> = std::iter::successors(Some(1usize), |&d| Some(d * 2)).take_while(|&d| d < max.max(1)).collect();
                c.push(max.max(1));
                c
            }
        };
        let n = choices.len();
        // First sweep every depth once, shallowest first.
        DepthTuner { choices, rate: vec![None; n], current: 0, plan: (1..n).collect(), window: (0, 0, 0.0), announced: None }
    }

    /// The depth to use now.
    pub fn depth(&self) -> usize {
        self.choices[self.current]
    }

    /// Records `reads` reads of `bytes` that kept the device busy for `secs`; returns the
    /// depth to use from now on.
    pub fn record(&mut self, reads: u64, bytes: u64, secs: f64) -> usize {
        if self.choices.len() == 1 || reads == 0 {
            return self.depth();
        }
        self.window.0 += reads;
        self.window.1 += bytes;
        self.window.2 += secs;
        if self.window.0 < WINDOW_READS {
            return self.depth();
        }
        let (_, bytes, secs) = std::mem::take(&mut self.window);
        if secs > 0.0 {
            let r = bytes as f64 / secs;
            let slot = &mut self.rate[self.current];
            *slot = Some(slot.map_or(r, |old| 0.5 * old + 0.5 * r));
        }
        if self.plan.is_empty() {
            let best = self.best();
            self.plan.extend(std::iter::repeat_n(best, EXPLOIT_WINDOWS));
            if best > 0 {
                self.plan.push_back(best - 1);
            }
            if best + 1 < self.choices.len() {
                self.plan.push_back(best + 1);
            }
        }
        self.current = self.plan.pop_front().expect("planned above");
        self.depth()
    }

    /// The choice with the highest measured rate (the shallowest on ties or before any).
    fn best(&self) -> usize {
        let mut best = 0;
        for (i, r) in self.rate.iter().enumerate() {
            if r.unwrap_or(0.0) > self.rate[best].unwrap_or(0.0) {
                best = i;
            }
        }
        best
    }

    /// After the first sweep, and whenever the best depth changes: a line saying so (for the
    /// log); `None` otherwise.
    pub fn announcement(&mut self) -> Option<String> {
        let rates: Option<Vec<f64>> = self.rate.iter().copied().collect();
        let rates = rates.filter(|_| self.choices.len() > 1)?;
        let best = self.best();
        if self.announced == Some(best) {
            return None;
        }
        self.announced = Some(best);
        let each: Vec<String> = self.choices.iter().zip(&rates).map(|(d, r)| format!("{d}: {:.2}", r / 1e9)).collect();
        Some(format!("expert reads: {} in flight reads fastest (GB/s while busy at depth {})", self.choices[best], each.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device whose bandwidth peaks at one depth: the tuner sweeps, settles there, and
    /// keeps re-checking only the neighbours.
    fn settle(peak: usize) -> Vec<usize> {
        let mut t = DepthTuner::new(QueueDepth::AUTO);
        let gbps = |d: usize| 2.0 - 0.1 * ((d as f64).log2() - (peak as f64).log2()).abs();
        let mut used = Vec::new();
        for _ in 0..400 {
            let d = t.depth();
            used.push(d);
            // One wave: 8 reads of 1.5 MB at the device's rate for this depth.
            let bytes = 8 * 1_500_000u64;
            t.record(8, bytes, bytes as f64 / (gbps(d) * 1e9));
        }
        used
    }

    #[test]
    fn auto_settles_on_the_fastest_depth_and_rechecks_neighbours() {
        for peak in [1usize, 4, 32] {
            let used = settle(peak);
            // Windows of 96 reads are 12 waves of 8: the first sweep tries every depth in turn.
            let sweep: Vec<usize> = (0..6).map(|i| used[12 * i]).collect();
            assert_eq!(sweep, [1, 2, 4, 8, 16, 32], "peak {peak}");
            let late = &used[used.len() / 2..];
            let at_peak = late.iter().filter(|&&d| d == peak).count();
            assert!(at_peak * 10 >= late.len() * 7, "peak {peak}: {at_peak} of {} waves at the peak", late.len());
            assert!(late.iter().all(|&d| d == peak || d == peak * 2 || d * 2 == peak), "peak {peak}: only neighbours re-checked");
        }
        // The choice is announced once the sweep is done, and not again while it holds.
        let mut t = DepthTuner::new(QueueDepth::Auto { max: 2 });
        assert_eq!(t.announcement(), None);
        for _ in 0..2 * WINDOW_READS {
            t.record(1, 1 << 20, if t.depth() == 2 { 1e-4 } else { 1e-3 });
        }
        assert!(t.announcement().is_some_and(|l| l.starts_with("expert reads: 2 in flight")));
        assert_eq!(t.announcement(), None);
    }

    #[test]
    fn fixed_never_moves_and_parsing() {
        let mut t = DepthTuner::new(QueueDepth::Fixed(3));
        for _ in 0..100 {
            assert_eq!(t.record(8, 1 << 20, 0.001), 3);
        }
        assert_eq!("auto".parse::<QueueDepth>(), Ok(QueueDepth::AUTO));
        assert_eq!(" 8".parse::<QueueDepth>(), Ok(QueueDepth::Fixed(8)));
        assert!("0".parse::<QueueDepth>().is_err() && "deep".parse::<QueueDepth>().is_err());
        assert_eq!(DepthTuner::new(QueueDepth::Auto { max: 12 }).choices, vec![1, 2, 4, 8, 12]);
    }
}
