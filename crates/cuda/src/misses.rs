//! Where a product runs whose routed expert is not in VRAM: copied up and multiplied on the
//! GPU (it then stays in the VRAM tier for later tokens), or multiplied by the CPU backend on
//! the host copy while the GPU runs the experts it has (as KTransformers and Fiddler do). On a
//! consumer card's PCIe link the CPU often wins for decode; over the H200's 55 GB/s the copy
//! usually does. [`MissPolicy`] decides per batch from rates measured on this machine.

use std::str::FromStr;

/// How VRAM misses are served (`--gpu-misses`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MissMode {
    /// By measured cost, per batch of misses.
    #[default]
    Auto,
    /// Always copy the weights up.
    Copy,
    /// Always compute on the CPU (once the VRAM tier is full).
    Cpu,
}

impl FromStr for MissMode {
    type Err = String;
    fn from_str(s: &str) -> Result<MissMode, String> {
        match s {
            "auto" => Ok(MissMode::Auto),
            "copy" => Ok(MissMode::Copy),
            "cpu" => Ok(MissMode::Cpu),
            _ => Err(format!("unknown miss mode {s:?}: auto, copy or cpu")),
        }
    }
}

/// Where one batch of misses goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    Copy,
    Cpu,
}

/// Weight of a new sample in the running rates.
const ALPHA: f64 = 0.25;
/// Every this many decisions in automatic mode, the route not taken is tried once, so that
/// its rate follows the machine (the CPU busy with other work, the bus shared).
const EXPLORE_EVERY: u64 = 64;

/// Measured rates of both routes, in weight bytes per second of the whole route (transfers,
/// waits and arithmetic), and the choice they imply.
#[derive(Debug)]
pub(crate) struct MissPolicy {
    mode: MissMode,
    copy_rate: Option<f64>,
    cpu_rate: Option<f64>,
    decisions: u64,
}

impl MissPolicy {
    pub(crate) fn new(mode: MissMode) -> MissPolicy {
        MissPolicy { mode, copy_rate: None, cpu_rate: None, decisions: 0 }
    }

    /// The route for a batch of misses; `room`: the VRAM tier can take them without evicting
    /// (a copy then also serves later tokens, so it is taken whatever the rates); `few`: each
    /// product has few tokens (decode). Many tokens (prefill) always copy: a copied matrix
    /// serves them all at the GPU's speed, while the CPU's time grows with each token.
    pub(crate) fn choose(&mut self, room: bool, few: bool) -> Route {
        if !few {
            return Route::Copy;
        }
        match self.mode {
            MissMode::Copy => return Route::Copy,
            MissMode::Cpu if room => return Route::Copy,
            MissMode::Cpu => return Route::Cpu,
            MissMode::Auto if room => return Route::Copy,
            MissMode::Auto => {}
        }
        self.decisions += 1;
        let (copy, cpu) = match (self.copy_rate, self.cpu_rate) {
            (_, None) => return Route::Cpu,
            (None, _) => return Route::Copy,
            (Some(a), Some(b)) => (a, b),
        };
        let best = if cpu > copy { Route::Cpu } else { Route::Copy };
        if self.decisions.is_multiple_of(EXPLORE_EVERY) {
            return if best == Route::Cpu { Route::Copy } else { Route::Cpu };
        }
        best
    }

    /// Adds a measurement: `bytes` of weights served by `route` in `secs`.
    pub(crate) fn record(&mut self, route: Route, bytes: u64, secs: f64) {
        if bytes == 0 || secs <= 0.0 {
            return;
        }
        let rate = bytes as f64 / secs;
        let slot = match route {
            Route::Copy => &mut self.copy_rate,
            Route::Cpu => &mut self.cpu_rate,
        };
        *slot = Some(slot.map_or(rate, |r| r + ALPHA * (rate - r)));
    }

    /// The measured rates (bytes per second), for the instrument.
    pub(crate) fn rates(&self) -> (Option<f64>, Option<f64>) {
        (self.copy_rate, self.cpu_rate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forced_modes_and_a_tier_with_room() {
        assert_eq!(MissPolicy::new(MissMode::Copy).choose(false, true), Route::Copy);
        assert_eq!(MissPolicy::new(MissMode::Cpu).choose(false, true), Route::Cpu);
        // Room in the tier: copying fills it for later tokens, in every mode.
        assert_eq!(MissPolicy::new(MissMode::Cpu).choose(true, true), Route::Copy);
        assert_eq!(MissPolicy::new(MissMode::Auto).choose(true, true), Route::Copy);
        // Prefill-sized batches copy whatever the mode.
        assert_eq!(MissPolicy::new(MissMode::Cpu).choose(false, false), Route::Copy);
        assert_eq!("cpu".parse::<MissMode>(), Ok(MissMode::Cpu));
        assert!("gpu".parse::<MissMode>().is_err());
    }

    #[test]
    fn auto_measures_both_routes_then_takes_the_faster_and_rechecks() {
        let mut p = MissPolicy::new(MissMode::Auto);
        assert_eq!(p.choose(false, true), Route::Cpu, "no CPU rate yet: measure it");
        p.record(Route::Cpu, 1 << 20, 1e-3); // ~1 GB/s
        assert_eq!(p.choose(false, true), Route::Copy, "no copy rate yet: measure it");
        p.record(Route::Copy, 1 << 20, 1e-4); // ~10 GB/s
        let picks: Vec<Route> = (0..2 * EXPLORE_EVERY).map(|_| p.choose(false, true)).collect();
        let cpu = picks.iter().filter(|&&r| r == Route::Cpu).count();
        assert_eq!(cpu, 2, "the slower route is retried once every {EXPLORE_EVERY} decisions");
        // The copy route slows down (a shared bus): the running rate follows, the choice flips.
        for _ in 0..20 {
            p.record(Route::Copy, 1 << 20, 1e-2);
        }
        assert_eq!(p.choose(false, true), Route::Cpu);
        assert!(p.rates().0.unwrap() < p.rates().1.unwrap());
    }
}
