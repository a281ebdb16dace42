//! Causal attention over the KV cache: for each query (token, head), scores against every
//! cached key of its kv head, softmax, weighted sum of values.

use super::matmul::dot;
use super::KvLayer;
use crate::backend::AttnParams;
use rayon::prelude::*;
use std::cell::RefCell;

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// One query's attention into `o` (`v_dim` long).
fn one(l: &KvLayer, q: &[f32], n_qh: usize, pos0: usize, p: AttnParams, i: usize, o: &mut [f32], dotf: &dyn Fn(&[f32], &[f32]) -> f32) {
    let s = l.shape;
    let (kd, vd) = (s.k_dim, s.v_dim);
    let group = p.q_heads / s.heads;
    let k_row = s.heads * kd;
    let (values, v_row, v_stride) = if s.values_in_keys { (&l.k, k_row, kd) } else { (&l.v, s.heads * vd, vd) };
    let (t, h) = (i / n_qh, i % n_qh);
    let g = h / group;
    let qv = &q[t * p.q_heads * kd + h * kd..][..kd];
    let len = pos0 + t + 1;
    SCORES.with(|sc| {
        let mut sc = sc.borrow_mut();
        sc.resize(len, 0.0);
        let mut max = f32::NEG_INFINITY;
        for (j, sj) in sc.iter_mut().enumerate() {
            *sj = dotf(qv, &l.k[j * k_row + g * kd..][..kd]) * p.scale;
            max = max.max(*sj);
        }
        let mut sum = 0f32;
        for sj in sc.iter_mut() {
            *sj = (*sj - max).exp();
            sum += *sj;
        }
        o.fill(0.0);
        for (j, &w) in sc.iter().enumerate() {
            let v = &values[j * v_row + g * v_stride..][..vd];
            for (a, &b) in o.iter_mut().zip(v) {
                *a += w * b;
            }
        }
        let inv = 1.0 / sum;
        for a in o.iter_mut() {
            *a *= inv;
        }
    })
}

/// Reference attention (rayon over queries when large).
pub(super) fn attention_ref(l: &KvLayer, q: &[f32], n: usize, pos0: usize, p: AttnParams, out: &mut [f32]) {
    let vd = l.shape.v_dim;
    let out = &mut out[..n * p.q_heads * vd];
    let job = |(i, o): (usize, &mut [f32])| one(l, q, p.q_heads, pos0, p, i, o, &dot);
    if n * p.q_heads * (pos0 + n) * l.shape.k_dim < 1 << 16 {
        out.chunks_mut(vd).enumerate().for_each(job);
    } else {
        out.par_chunks_mut(vd).enumerate().for_each(job);
    }
}

/// Attention with SIMD dot products on the persistent pool, one task per few queries.
pub(super) fn attention_fast(
    l: &KvLayer,
    q: &[f32],
    n: usize,
    pos0: usize,
    p: AttnParams,
    out: &mut [f32],
    k: &smoe_kernels::Kernels,
    pool: &super::pool::Pool,
) {
    let vd = l.shape.v_dim;
    let queries = n * p.q_heads;
    let out = &mut out[..queries * vd];
    let per_task = queries.div_ceil(4 * pool.threads()).max(1);
    let sink = SendPtr(out.as_mut_ptr());
    let dotf = |a: &[f32], b: &[f32]| k.dot_f32(a, b);
    pool.run(queries.div_ceil(per_task), &|task| {
        for i in task * per_task..((task + 1) * per_task).min(queries) {
            // SAFETY: query i owns out[i * vd..(i + 1) * vd]; tasks take disjoint query ranges,
            // and `out` outlives `pool.run`.
            let o = unsafe { std::slice::from_raw_parts_mut(sink.get().add(i * vd), vd) };
            one(l, q, p.q_heads, pos0, p, i, o, &dotf);
        }
    });
}

/// A raw output pointer shared by pool tasks that write disjoint ranges.
struct SendPtr(*mut f32);
// SAFETY: used only for disjoint writes while the owning slice is borrowed by the caller.
unsafe impl Sync for SendPtr {}
impl SendPtr {
    fn get(&self) -> *mut f32 {
        self.0
    }
}
