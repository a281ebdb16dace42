//! DeepSeek Sparse Attention's indexer on the CPU: each query's scores over the cached indexer
//! keys, and the positions it keeps. The attention over those positions is
//! [`super::attention`]'s, driven by [`crate::backend::AttnParams::selected`].

use super::matmul::dot;
use super::{kv_rows::KvRows, KvLayer};
use crate::backend::{select_top, AttnParams, IndexQueries};
use rayon::prelude::*;
use std::cell::RefCell;

thread_local! {
    /// One query's scores, then the positions being ranked.
    static SCRATCH: RefCell<(Vec<f32>, Vec<u32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    /// One query's selected keys (and values), gathered.
    static GATHERED: RefCell<Option<KvLayer>> = const { RefCell::new(None) };
}

/// Attention over selected positions on the fast path: each query's positions are gathered
/// into a cache layer of their own, over which [`super::attention::attention_fast`] runs
/// densely, so that every query head reads each selected key once per block with the others of
/// its task (MLA's 64 or 128 heads share one latent), as in dense attention. Gathering costs a
/// copy of the kept rows per query, against their product with every head.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_selected(
    l: &KvLayer,
    q: &[f32],
    q_stride: usize,
    n: usize,
    p: AttnParams<'_>,
    out: &mut [f32],
    k: &smoe_kernels::Kernels,
    pool: &super::pool::Pool,
    block: usize,
) {
    let sel = p.selected.expect("attention_selected without a selection");
    let s = l.shape;
    let (kw, vw) = (s.heads * s.k_dim, s.heads * s.v_dim);
    let dense = AttnParams { selected: None, window: None, ..p };
    let row_out = p.q_heads * s.v_dim;
    GATHERED.with(|g| {
        let mut g = g.borrow_mut();
        let gl = g.get_or_insert_with(|| KvLayer { shape: s, k: KvRows::new(s.f16), v: KvRows::new(s.f16), base: 0 });
        gl.shape = s;
        for t in 0..n {
            // The selected rows as they are stored (f16 rows stay f16: attention widens them).
            gl.k.reset(s.f16);
            gl.v.reset(s.f16);
            for j in sel.of(t) {
                gl.k.push_from(&l.k, j * kw, kw);
                if !s.values_in_keys {
                    gl.v.push_from(&l.v, j * vw, vw);
                }
            }
            let kept = gl.k.len() / kw.max(1);
            let o = &mut out[t * row_out..][..row_out];
            if kept == 0 {
                o.fill(0.0);
                continue;
            }
            super::attention::attention_fast(gl, &q[t * q_stride..], q_stride, 1, kept - 1, dense, o, k, pool, block);
        }
    })
}

/// Positions scored per task when one query's scores are split over threads (decode).
const POSITIONS_PER_TASK: usize = 512;

/// Positions whose per-head products one kernel call computes (fast path).
const POSITIONS_PER_CALL: usize = 64;

/// `Σ_h w[h] · relu(q_h · k)` over `heads` heads of `k.len()` dimensions.
fn score(q: &[f32], w: &[f32], k: &[f32]) -> f32 {
    let d = k.len();
    w.iter().enumerate().map(|(h, &wh)| wh * dot(&q[h * d..][..d], k).max(0.0)).sum()
}

/// Scores of the consecutive keys `keys` (rows of `d`) into `out`: with `kernels`, every head's
/// products for [`POSITIONS_PER_CALL`] keys in one SIMD call (the attention kernels' scores),
/// then the ReLU and the weighted sum over heads; else [`score`] key by key.
fn score_keys(q: &[f32], w: &[f32], keys: &[f32], d: usize, kernels: Option<&smoe_kernels::Kernels>, out: &mut [f32]) {
    let heads = w.len();
    // The products of up to 64 heads (GLM-5 has 32) for a call's keys fit on the stack.
    let Some(kn) = kernels.filter(|_| heads <= 64) else {
        for (s, k) in out.iter_mut().zip(keys.chunks_exact(d)) {
            *s = score(q, w, k);
        }
        return;
    };
    let mut prods = [0f32; POSITIONS_PER_CALL * 64];
    let per = POSITIONS_PER_CALL;
    for (o, ks) in out.chunks_mut(per).zip(keys.chunks(per * d)) {
        let n = o.len();
        kn.attn_scores(q, d, ks, d, n, &mut prods[..n * heads]);
        for (s, p) in o.iter_mut().zip(prods.chunks_exact(heads)) {
            *s = p.iter().zip(w).map(|(&x, &wh)| wh * x.max(0.0)).sum();
        }
    }
}

/// [`crate::Backend::index_select`] over one cache layer: `q` rows are `heads × k_dim` floats,
/// `w` rows `heads`; `out` is `[n, top]`. `kernels`: the SIMD scores of the fast path (`None`:
/// the reference path's plain dot products).
pub(super) fn index_select(l: &KvLayer, q: &[f32], w: &[f32], at: IndexQueries, out: &mut [u32], kernels: Option<&smoe_kernels::Kernels>) {
    let IndexQueries { row0, n, pos0, heads, top, .. } = at;
    let d = l.shape.k_dim;
    let one = |t: usize, o: &mut [u32]| {
        let seen = at.seen(pos0 + t);
        let (qt, wt) = (&q[(row0 + t) * heads * d..][..heads * d], &w[(row0 + t) * heads..][..heads]);
        SCRATCH.with(|s| {
            let (scores, order) = &mut *s.borrow_mut();
            if seen <= top {
                // Every key it sees is kept: no scores needed.
                return select_top(&[], seen, top, order, o);
            }
            scores.clear();
            scores.resize(seen, 0.0);
            let keys = &l.k.f32s()[..seen * d];
            if n == 1 && seen >= 2 * POSITIONS_PER_TASK {
                scores
                    .par_chunks_mut(POSITIONS_PER_TASK)
                    .zip(keys.par_chunks(POSITIONS_PER_TASK * d))
                    .for_each(|(sc, ks)| score_keys(qt, wt, ks, d, kernels, sc));
            } else {
                score_keys(qt, wt, keys, d, kernels, scores);
            }
            select_top(scores, seen, top, order, o);
        })
    };
    let out = &mut out[..n * top];
    if n == 1 {
        one(0, out);
    } else {
        out.par_chunks_mut(top).enumerate().for_each(|(t, o)| one(t, o));
    }
}

/// LayerNorm of one segment in place, statistics accumulated in f64.
pub(super) fn layer_norm(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let len = x.len() as f64;
    let mean = x.iter().map(|&v| v as f64).sum::<f64>() / len;
    let var = x.iter().map(|&v| (v as f64 - mean) * (v as f64 - mean)).sum::<f64>() / len;
    let inv = 1.0 / (var as f32 + eps).sqrt();
    let mean = mean as f32;
    for ((v, &g), &bb) in x.iter_mut().zip(w).zip(b) {
        *v = (*v - mean) * inv * g + bb;
    }
}
