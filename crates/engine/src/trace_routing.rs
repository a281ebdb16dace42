//! Routing replayed from a recorded trace, for I/O and cache benchmarks only.
//!
//! Random-weight models route without the temporal locality of trained ones (their hidden states
//! carry no meaning), so a benchmark of the expert store on them measures the wrong workload.
//! With a [`TraceRouting`] set, each MoE layer's experts are taken from a recorded trace of a
//! trained MoE instead of the router's choice; everything else (reads, cache, products, mixing
//! weights) runs as usual. The output is meaningless text, which is why only `smoe bench` offers
//! it and says so in every line it prints.
//!
//! Mapping a trace of `Lt` layers, `Et` experts and top-`kt` onto a model of `Lm` MoE layers,
//! `Em` experts and top-`km`: a model layer's `km` experts come from `B = ceil(km / kt)` trace
//! layer selections, block `b` taking the first `km / B` (or one more) of selection `b` and
//! spreading its ids over the `Em / B` experts of block `b` (`e -> b·W + e·W / Et`, distinct when
//! `W >= Et`; a collision moves to the next free id). Model layer `m`'s block `b` replays trace
//! layer `(m·B + b) mod Lt`; each further pass over the trace's layers starts a text later, so
//! that layers sharing a trace layer do not move in lockstep. Token `j` of a layer is position
//! `j mod positions` of text `j / positions` (plus that offset), wrapping around the trace.
//! Adjacent-token reuse and expert popularity, what the cache sees, carry over; correlations
//! between layers only approximately.

use crate::EngineError;
use smoe_formats::trace::RoutingTrace;
use smoe_vault::Architecture;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// A trace mapped onto one model's MoE layers. See the module documentation.
pub struct TraceRouting {
    trace: RoutingTrace,
    name: String,
    /// MoE ordinal of each decoder layer.
    ordinal: Vec<Option<usize>>,
    experts: usize,
    top_k: usize,
    /// The trace's expert count (its largest id plus one), counted once.
    trace_experts: usize,
    /// Tokens routed so far, per MoE layer (stream 0).
    next: Vec<AtomicUsize>,
    /// The same for the other streams (sequences of a batch), by (MoE layer, stream).
    streams: Mutex<HashMap<(usize, usize), usize>>,
}

impl TraceRouting {
    /// Maps `trace` (called `name` in reports) onto `arch`'s MoE layers.
    pub fn new(trace: RoutingTrace, name: &str, arch: &Architecture) -> Result<TraceRouting, EngineError> {
        let moe = arch.moe_layers();
        if moe.is_empty() {
            return Err(EngineError::Model("a routing trace needs a model with MoE layers".into()));
        }
        let mut ordinal = vec![None; arch.num_layers];
        for (m, &l) in moe.iter().enumerate() {
            ordinal[l] = Some(m);
        }
        let mut r = TraceRouting::for_shape(trace, name, moe.len(), arch.moe.num_experts, arch.moe.top_k)?;
        r.ordinal = ordinal;
        Ok(r)
    }

    /// `trace` mapped onto `layers` MoE layers of `experts` experts, top-`top_k`, with no
    /// model: decoder layer `m` is MoE layer `m` (for replaying a shape's routing through the
    /// cache policies without opening a model, as `smoe replay --shape` does).
    pub fn for_shape(trace: RoutingTrace, name: &str, layers: usize, experts: usize, top_k: usize) -> Result<TraceRouting, EngineError> {
        if top_k > experts || top_k == 0 || layers == 0 {
            return Err(EngineError::Model(format!("top-{top_k} of {experts} experts on {layers} MoE layers")));
        }
        let next = (0..layers).map(|_| AtomicUsize::new(0)).collect();
        let trace_experts = trace.num_experts().max(1);
        let ordinal = (0..layers).map(Some).collect();
        Ok(TraceRouting { trace, name: name.to_string(), ordinal, experts, top_k, trace_experts, next, streams: Mutex::default() })
    }

    /// One line for reports: which trace, and onto what.
    pub fn describe(&self) -> String {
        let [texts, pos, layers, k] = self.trace.shape;
        format!(
            "routing replayed from trace {} ({texts} texts x {pos} tokens, {layers} layers of {} experts, top-{k}) onto {} MoE layers of {} experts, top-{}",
            self.name,
            self.trace_experts,
            self.next.len(),
            self.experts,
            self.top_k
        )
    }

    /// Replaces one token's experts at decoder layer `layer` with the trace's next ones (in
    /// place: `ids` holds the model's top-k). A layer without MoE is left alone.
    pub fn replace(&self, layer: usize, ids: &mut [u32]) {
        self.replace_in(layer, 0, ids);
    }

    /// [`replace`](Self::replace) for one of several sequences decoded together: stream `s`
    /// has its own count of tokens and starts `s` texts into the trace, so that the sequences
    /// of a batch replay different texts, as different users' requests would route, rather
    /// than taking turns at one.
    pub fn replace_in(&self, layer: usize, stream: usize, ids: &mut [u32]) {
        let Some(m) = self.ordinal.get(layer).copied().flatten() else { return };
        let token = if stream == 0 {
            self.next[m].fetch_add(1, Ordering::Relaxed)
        } else {
            let mut counts = self.streams.lock().unwrap_or_else(|e| e.into_inner());
            let c = counts.entry((m, stream)).or_default();
            *c += 1;
            *c - 1
        };
        self.fill(m, self.stream_token(stream, token), ids);
    }

    /// The experts of stream `stream`'s `token`-th token at MoE layer `m` (the model's
    /// top-k long), as [`replace_in`](Self::replace_in) would give them.
    pub fn experts_of(&self, m: usize, stream: usize, token: usize) -> Vec<u32> {
        let mut ids = vec![0; self.top_k];
        self.fill(m, self.stream_token(stream, token), &mut ids);
        ids
    }

    /// Where stream `s`'s `token`-th token lies in the trace: `s` texts in, and streams past
    /// the trace's texts start part-way through theirs (half-way on the second pass over
    /// the texts, two thirds on the third, ...), so that no two of a batch replay the same
    /// tokens in lockstep.
    fn stream_token(&self, s: usize, token: usize) -> usize {
        let [texts, positions, _, _] = self.trace.shape;
        let pass = s / texts.max(1);
        let offset = positions * pass / (pass + 1);
        s * positions + offset + token
    }

    /// The experts of model MoE layer `m` at its `j`-th token.
    fn fill(&self, m: usize, j: usize, ids: &mut [u32]) {
        let [texts, positions, lt, kt] = self.trace.shape;
        let et = self.trace_experts;
        let (km, em) = (ids.len(), self.experts);
        let blocks = km.div_ceil(kt).min(em).max(1);
        let width = em / blocks;
        let mut n = 0;
        for b in 0..blocks {
            let take = km / blocks + usize::from(b < km % blocks);
            let slot = m * blocks + b;
            let text = (j / positions + slot / lt) % texts;
            let chosen = self.trace.experts_at(text, j % positions, slot % lt);
            for &e in &chosen[..take.min(kt)] {
                let mut id = (b * width + e as usize * width / et) % em;
                // Distinct ids: a collision (more trace experts than the block holds) moves on.
                while ids[..n].contains(&(id as u32)) {
                    id = (id + 1) % em;
                }
                ids[n] = id as u32;
                n += 1;
            }
        }
        // A trace with fewer experts per token than a block needs: the rest follow the last.
        while n < km {
            let mut id = (ids[n - 1] as usize + 1) % em;
            while ids[..n].contains(&(id as u32)) {
                id = (id + 1) % em;
            }
            ids[n] = id as u32;
            n += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace() -> RoutingTrace {
        smoe_formats::trace::bundled()
    }

    fn routing(layers: usize, experts: usize, k: usize) -> TraceRouting {
        let (trace, ordinal) = (trace(), (0..layers).map(Some).collect());
        let next = (0..layers).map(|_| AtomicUsize::new(0)).collect();
        TraceRouting {
            trace_experts: trace.num_experts(),
            trace,
            name: "t".into(),
            ordinal,
            experts,
            top_k: k,
            next,
            streams: Mutex::default(),
        }
    }

    #[test]
    fn ids_are_distinct_and_in_range_for_any_shape() {
        for (layers, experts, k) in [(48, 128, 8), (94, 128, 8), (4, 8, 2), (3, 60, 4), (2, 256, 8), (2, 16, 16)] {
            let r = routing(layers, experts, k);
            let mut ids = vec![0u32; k];
            for m in 0..layers {
                for j in [0, 1, 1023, 1024, 9000] {
                    r.fill(m, j, &mut ids);
                    let mut s = ids.clone();
                    s.sort();
                    s.dedup();
                    assert_eq!(s.len(), k, "{layers}x{experts} top-{k}: {ids:?}");
                    assert!(ids.iter().all(|&e| (e as usize) < experts));
                }
            }
        }
    }

    #[test]
    fn a_same_shaped_model_replays_the_trace_as_recorded() {
        let t = trace();
        let r = routing(6, 48, 6);
        let mut ids = vec![0u32; 6];
        for j in [0, 5, 1500] {
            for m in 0..6 {
                r.fill(m, j, &mut ids);
                assert_eq!(ids, t.experts_at(j / 1024, j % 1024, m));
            }
        }
    }

    /// Streams past the trace's texts do not replay another stream's tokens.
    #[test]
    fn streams_beyond_the_texts_start_elsewhere() {
        let r = routing(48, 128, 8);
        let texts = trace().shape[0];
        for s in 0..texts {
            for t in [0, 7, 100] {
                assert_ne!(r.experts_of(5, s, t), r.experts_of(5, s + texts, t), "stream {s} token {t}");
            }
        }
        assert_eq!(r.stream_token(0, 3), 3);
    }

    /// Stream 0 is the plain count; stream `s` counts its own tokens from text `s`.
    #[test]
    fn streams_replay_their_own_texts() {
        let (r, plain) = (routing(48, 128, 8), routing(48, 128, 8));
        let [_, positions, _, _] = trace().shape;
        let (mut got, mut want) = (vec![0u32; 8], vec![0u32; 8]);
        let layer = 3;
        for token in 0..3 {
            for s in [0usize, 2, 5] {
                r.replace_in(layer, s, &mut got);
                plain.fill(layer, s * positions + token, &mut want);
                assert_eq!(got, want, "stream {s} token {token}");
            }
        }
    }

    #[test]
    fn adjacent_token_reuse_carries_over() {
        // The trace's adjacent-token reuse (0.30; 0.125 if random) survives the mapping onto a
        // Qwen3-30B-A3B shape (0.0625 if random).
        let r = routing(48, 128, 8);
        let (mut a, mut b) = (vec![0u32; 8], vec![0u32; 8]);
        let (mut shared, mut total) = (0, 0);
        for m in 0..48 {
            for j in 0..200 {
                r.fill(m, j, &mut a);
                r.fill(m, j + 1, &mut b);
                shared += a.iter().filter(|e| b.contains(e)).count();
                total += 8;
            }
        }
        let reuse = shared as f64 / total as f64;
        assert!(reuse > 0.2, "{reuse}");
    }
}
