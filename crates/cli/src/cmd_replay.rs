//! `smoe replay`: a recorded routing trace through the expert cache's eviction policies, against
//! Belady's offline optimum, at one cache size.

use anyhow::{bail, Result};
use smoe_engine::trace_routing::TraceRouting;
use smoe_store::policy::PolicyKind;
use smoe_store::replay::{batched, belady, replay, Visit};
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

/// Stream `stream`'s visits for `tokens` tokens, every token's MoE layers in order.
fn stream(r: &TraceRouting, layers: usize, stream: usize, tokens: usize) -> Vec<Visit> {
    (0..tokens).flat_map(|t| (0..layers).map(move |m| (m as u32, r.experts_of(m, stream, t)))).collect()
}

/// `LAYERSxEXPERTSxTOPK`, e.g. `48x128x8`.
fn shape(s: &str) -> Result<[usize; 3]> {
    let v: Vec<usize> =
        s.split('x').map(str::parse).collect::<Result<_, _>>().map_err(|_| anyhow::anyhow!("--shape {s}: not LAYERSxEXPERTSxTOPK"))?;
    v.try_into().map_err(|_| anyhow::anyhow!("--shape {s}: not LAYERSxEXPERTSxTOPK (e.g. 48x128x8)"))
}

pub fn run(trace: &Path, cache: &str, batch: usize, model_shape: Option<&str>, json: bool) -> Result<()> {
    let t = smoe_formats::trace::read(trace)?;
    let [texts, positions, trace_layers, trace_k] = t.shape;
    let [layers, experts, k] = match model_shape {
        Some(s) => shape(s)?,
        None => [trace_layers, t.num_experts(), trace_k],
    };
    let cap = slots(cache, layers * experts)?;
    if batch == 0 {
        bail!("--batch 0: at least one sequence");
    }
    let name = trace.display().to_string();
    let r = TraceRouting::for_shape(t, &name, layers, experts, k)?;
    // One cache for all layers, kept across texts, a layer's experts arriving together: as the
    // store sees them. Alone, one sequence runs through every text; a batch of `batch`
    // sequences runs `positions` steps, each sequence on its own text as `smoe bench --batch
    // --routing-trace` routes them.
    let visits: Vec<Visit> = if batch == 1 {
        stream(&r, layers, 0, texts * positions)
    } else {
        batched(&(0..batch).map(|s| stream(&r, layers, s, positions)).collect::<Vec<_>>())
    };
    let widest = visits.iter().map(|(_, e)| e.len()).max().unwrap_or(0);
    if widest > cap {
        bail!("--cache {cache}: {cap} slots, fewer slots than the {widest} experts one layer of a step uses");
    }
    let tokens = if batch == 1 { texts * positions } else { batch * positions };
    let rate = |(h, u): (u64, u64)| h as f64 / u.max(1) as f64;
    // Expert reads per generated token: a batched step reads each missing expert once.
    let reads = |(h, u): (u64, u64)| (u - h) as f64 / tokens as f64;
    let best = belady(cap, &visits);
    let runs: Vec<(&str, (u64, u64))> =
        POLICIES.iter().map(|&(name, kind)| (name, replay(&mut *kind.build(layers, experts), cap, &visits))).collect();
    if json {
        let policies: serde_json::Map<String, serde_json::Value> = runs.iter().map(|&(n, r)| (n.to_string(), rate(r).into())).collect();
        let per_token: serde_json::Map<String, serde_json::Value> = runs.iter().map(|&(n, r)| (n.to_string(), reads(r).into())).collect();
        println!(
            "{}",
            serde_json::json!({"cache_slots": cap, "batch": batch, "belady": rate(best), "policies": policies, "default": DEFAULT,
                "reads_per_token": {"belady": reads(best), "policies": per_token}})
        );
        return Ok(());
    }
    println!("trace: {texts} texts x {positions} positions, {trace_layers} MoE layers, top-{trace_k}");
    if model_shape.is_some() {
        println!("mapped onto {layers} MoE layers of {experts} experts, top-{k} (as smoe bench --routing-trace maps it)");
    }
    if batch > 1 {
        println!("batch: {batch} sequences decoded together for {positions} steps; hit rates count each expert once per step");
    }
    println!("cache: {cap} slots ({:.1}% of {})", 100.0 * cap as f64 / (layers * experts) as f64, layers * experts);
    println!("  {:<16} {:.3}  expert reads per token {:.3}", "belady", rate(best), reads(best));
    for (name, r) in runs {
        let mark = if name == DEFAULT { "  (the store's default)" } else { "" };
        println!(
            "  {name:<16} {:.3}  {:.2} of optimal, expert reads per token {:.3}{mark}",
            rate(r),
            rate(r) / rate(best).max(f64::MIN_POSITIVE),
            reads(r)
        );
    }
    Ok(())
}
