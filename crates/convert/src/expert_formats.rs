//! The formats of the routed experts' three matrices: one for all, or a per-matrix mix.
//!
//! Low-bit files mix formats the way llama.cpp's do: the down projection, whose errors reach the
//! residual stream directly, keeps a bit more than gate and up. Two presets follow llama.cpp's
//! choice for the experts of its `Q2_K` and `Q3_K_M` files (llama.cpp varies some layers further;
//! these apply one choice to every layer):
//!
//! - `Q2_K_MIX`: gate and up Q2_K, down Q3_K (≈2.9 bits per weight);
//! - `Q3_K_MIX`: gate and up Q3_K, down Q4_K (≈3.8 bits per weight).
//!
//! Any mix can be spelled out: `gate=Q2_K,up=Q2_K,down=Q4_K`, or a default with overrides,
//! `Q3_K,down=Q5_K`.

use smoe_quant::Format;
use std::fmt;
use std::str::FromStr;

/// Formats of an expert's gate, up and down matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertFormats {
    /// Gate projection.
    pub gate: Format,
    /// Up projection.
    pub up: Format,
    /// Down projection.
    pub down: Format,
}

/// Presets by name (see the module documentation).
const PRESETS: [(&str, Format, Format); 2] = [("Q2_K_MIX", Format::Q2_K, Format::Q3_K), ("Q3_K_MIX", Format::Q3_K, Format::Q4_K)];

impl ExpertFormats {
    /// One format for all three.
    pub const fn all(f: Format) -> ExpertFormats {
        ExpertFormats { gate: f, up: f, down: f }
    }

    /// The format of part `name` (`gate`, `up` or `down`; anything else gets gate's).
    pub fn of(&self, name: &str) -> Format {
        match name {
            "up" => self.up,
            "down" => self.down,
            _ => self.gate,
        }
    }

    /// The single format, if all three share one.
    pub fn uniform(&self) -> Option<Format> {
        (self.gate == self.up && self.up == self.down).then_some(self.gate)
    }
}

impl From<Format> for ExpertFormats {
    fn from(f: Format) -> Self {
        ExpertFormats::all(f)
    }
}

impl fmt::Display for ExpertFormats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(u) = self.uniform() {
            return write!(f, "{u}");
        }
        if let Some((name, _, _)) = PRESETS.iter().find(|(_, gu, d)| self.gate == *gu && self.up == *gu && self.down == *d) {
            return f.write_str(name);
        }
        write!(f, "gate={},up={},down={}", self.gate, self.up, self.down)
    }
}

impl FromStr for ExpertFormats {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if let Some((_, gu, d)) = PRESETS.iter().find(|(name, _, _)| name.eq_ignore_ascii_case(s)) {
            return Ok(ExpertFormats { gate: *gu, up: *gu, down: *d });
        }
        let fmt = |v: &str| v.trim().parse::<Format>().map_err(|e| e.to_string());
        let mut out: Option<ExpertFormats> = None;
        let mut set = [None::<Format>; 3];
        for item in s.split(',') {
            match item.split_once('=') {
                None if out.is_none() && set.iter().all(Option::is_none) => out = Some(ExpertFormats::all(fmt(item)?)),
                None => return Err(format!("'{s}': a default format comes first, then part=FORMAT overrides")),
                Some((part, v)) => {
                    let i = match part.trim() {
                        "gate" => 0,
                        "up" => 1,
                        "down" => 2,
                        p => return Err(format!("'{s}': unknown expert part '{p}' (gate, up, down)")),
                    };
                    if set[i].replace(fmt(v)?).is_some() {
                        return Err(format!("'{s}': {} given twice", part.trim()));
                    }
                }
            }
        }
        let base = match out {
            Some(b) => b,
            None if set.iter().all(Option::is_some) => ExpertFormats::all(set[0].unwrap()),
            None => {
                return Err(format!(
                "'{s}': give a format (Q4_K), a preset (Q2_K_MIX, Q3_K_MIX), a default with overrides (Q3_K,down=Q4_K) or all three parts"
            ))
            }
        };
        Ok(ExpertFormats { gate: set[0].unwrap_or(base.gate), up: set[1].unwrap_or(base.up), down: set[2].unwrap_or(base.down) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_formats_presets_and_mixes_and_prints_them_back() {
        let p = |s: &str| s.parse::<ExpertFormats>();
        assert_eq!(p("Q4_K").unwrap(), ExpertFormats::all(Format::Q4_K));
        assert_eq!(p("q2_k_mix").unwrap(), ExpertFormats { gate: Format::Q2_K, up: Format::Q2_K, down: Format::Q3_K });
        assert_eq!(p("Q3_K,down=Q5_K").unwrap(), ExpertFormats { gate: Format::Q3_K, up: Format::Q3_K, down: Format::Q5_K });
        let all3 = p("gate=Q2_K,up=Q3_K,down=Q4_K").unwrap();
        assert_eq!(all3, ExpertFormats { gate: Format::Q2_K, up: Format::Q3_K, down: Format::Q4_K });
        for s in ["Q4_K", "Q2_K_MIX", "Q3_K_MIX", "gate=Q2_K,up=Q3_K,down=Q4_K"] {
            assert_eq!(p(s).unwrap().to_string(), s);
            assert_eq!(p(&p(s).unwrap().to_string()).unwrap(), p(s).unwrap());
        }
        for (bad, want) in [
            ("Q9_K", "unknown tensor format"),
            ("down=Q4_K", "give a format"),
            ("Q4_K,side=Q4_K", "unknown expert part"),
            ("Q4_K,down=Q4_K,down=Q5_K", "twice"),
            ("down=Q4_K,Q4_K", "comes first"),
        ] {
            let e = p(bad).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
    }
}
