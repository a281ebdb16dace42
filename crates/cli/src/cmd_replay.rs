//! `smoe replay`: a recorded routing trace through the expert cache's eviction policies, against
//! Belady's offline optimum, at one cache size.

use anyhow::{bail, Result};
use smoe_store::policy::PolicyKind;
use smoe_store::replay::{belady, replay, Visit};
use std::path::Path;

/// The policies compared, by the names `--policy` takes; the store's default is marked.
const POLICIES: [(&str, PolicyKind); 2] = [("lru", PolicyKind::Lru), ("reuse-distance", PolicyKind::ReuseDistance)];
const DEFAULT: &str = "reuse-distance";

/// Slots from `--cache`: `25%` of every (layer, expert) of the trace, or a number of slots.
fn slots(cache: &str, total: usize) -> Result<usize> {
    let n = match cache.strip_suffix('%') {
        Some(p) => {
            let p: f64 = p.trim().parse().map_err(|_| anyhow::anyhow!("--cache {cache}: not a percentage"))?;
            if !(p > 0.0 && p <= 100.0) {
                bail!("--cache {cache}: a percentage must be in (0, 100]");
            }
            (total as f64 * p / 100.0).round() as usize
        }
        None => cache.parse().map_err(|_| anyhow::anyhow!("--cache {cache}: a number of slots or a percentage such as 25%"))?,
    };
    if n == 0 {
        bail!("--cache {cache}: no slots");
    }
    Ok(n)
}

pub fn run(trace: &Path, cache: &str, json: bool) -> Result<()> {
    let t = smoe_formats::trace::read(trace)?;
    let [texts, positions, layers, k] = t.shape;
    let experts = t.num_experts();
    let cap = slots(cache, layers * experts)?;
    // One cache for all layers, kept across texts, a layer's experts arriving together: as the
    // store sees them.
    let mut visits: Vec<Visit> = Vec::with_capacity(texts * positions * layers);
    for text in 0..texts {
        for pos in 0..positions {
            for l in 0..layers {
                visits.push((l as u32, t.experts_at(text, pos, l).to_vec()));
            }
        }
    }
    let rate = |(h, u): (u64, u64)| h as f64 / u.max(1) as f64;
    let best = rate(belady(cap, &visits));
    let rates: Vec<(&str, f64)> =
        POLICIES.iter().map(|&(name, kind)| (name, rate(replay(&mut *kind.build(layers, experts), cap, &visits)))).collect();
    if json {
        let policies: serde_json::Map<String, serde_json::Value> = rates.iter().map(|&(n, h)| (n.to_string(), h.into())).collect();
        println!("{}", serde_json::json!({"cache_slots": cap, "belady": best, "policies": policies, "default": DEFAULT}));
        return Ok(());
    }
    println!("trace: {texts} texts x {positions} positions, {layers} MoE layers of {experts} experts, top-{k}");
    println!("cache: {cap} slots ({:.1}% of {})", 100.0 * cap as f64 / (layers * experts) as f64, layers * experts);
    println!("  {:<16} {best:.3}", "belady");
    for (name, h) in rates {
        let mark = if name == DEFAULT { "  (the store's default)" } else { "" };
        println!("  {name:<16} {h:.3}  {:.2} of optimal{mark}", h / best.max(f64::MIN_POSITIVE));
    }
    Ok(())
}
