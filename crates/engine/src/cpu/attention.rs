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
fn one(
    l: &KvLayer,
    q: &[f32],
    q_stride: usize,
    n_qh: usize,
    pos0: usize,
    p: AttnParams,
    i: usize,
    o: &mut [f32],
    dotf: &dyn Fn(&[f32], &[f32]) -> f32,
) {
    let s = l.shape;
    let (kd, vd) = (s.k_dim, s.v_dim);
    let group = p.q_heads / s.heads;
    let k_row = s.heads * kd;
    let (values, v_row, v_stride) = if s.values_in_keys { (&l.k, k_row, kd) } else { (&l.v, s.heads * vd, vd) };
    let (t, h) = (i / n_qh, i % n_qh);
    let g = h / group;
    let qv = &q[t * q_stride + h * kd..][..kd];
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
pub(super) fn attention_ref(l: &KvLayer, q: &[f32], q_stride: usize, n: usize, pos0: usize, p: AttnParams, out: &mut [f32]) {
    let vd = l.shape.v_dim;
    let out = &mut out[..n * p.q_heads * vd];
    let job = |(i, o): (usize, &mut [f32])| one(l, q, q_stride, p.q_heads, pos0, p, i, o, &dot);
    if n * p.q_heads * (pos0 + n) * l.shape.k_dim < 1 << 16 {
        out.chunks_mut(vd).enumerate().for_each(job);
    } else {
        out.par_chunks_mut(vd).enumerate().for_each(job);
    }
}

/// Query heads per task: one KV head's query heads, split so that MLA's single KV head (and
/// 128 query heads) still spreads over the pool.
const HEADS_PER_TASK: usize = 16;

thread_local! {
    static PROBS: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Grouped-query attention on the persistent pool: each task takes one token, one KV head and
/// up to [`HEADS_PER_TASK`] of its query heads, and streams that head's cached keys and values
/// once for all of them.
pub(super) fn attention_fast(
    l: &KvLayer,
    q: &[f32],
    q_stride: usize,
    n: usize,
    pos0: usize,
    p: AttnParams,
    out: &mut [f32],
    k: &smoe_kernels::Kernels,
    pool: &super::pool::Pool,
) {
    let s = l.shape;
    let (kd, vd, kvh) = (s.k_dim, s.v_dim, s.heads);
    let group = p.q_heads / kvh;
    let chunk = group.min(HEADS_PER_TASK);
    let chunks_per_group = group.div_ceil(chunk);
    let k_row = kvh * kd;
    let (values, v_row, v_stride) = if s.values_in_keys { (&l.k, k_row, kd) } else { (&l.v, kvh * vd, vd) };
    let out = &mut out[..n * p.q_heads * vd];
    let sink = SendPtr(out.as_mut_ptr());
    pool.run(n * kvh * chunks_per_group, &|task| {
        let (t, rest) = (task / (kvh * chunks_per_group), task % (kvh * chunks_per_group));
        let (g, c) = (rest / chunks_per_group, rest % chunks_per_group);
        let h0 = g * group + c * chunk;
        let heads = chunk.min(g * group + group - h0);
        let len = pos0 + t + 1;
        let qs = &q[t * q_stride + h0 * kd..][..heads * kd];
        // SAFETY: this task owns the output rows of query heads h0..h0 + heads of token t;
        // tasks cover disjoint (t, head) ranges and `out` outlives `pool.run`.
        let o = unsafe { std::slice::from_raw_parts_mut(sink.get().add((t * p.q_heads + h0) * vd), heads * vd) };
        PROBS.with(|pr| {
            let mut pr = pr.borrow_mut();
            pr.resize(len * heads, 0.0);
            // Scores, position-major: pr[j * heads + h].
            for j in 0..len {
                k.multi_dot(qs, &l.k[j * k_row + g * kd..][..kd], &mut pr[j * heads..(j + 1) * heads]);
            }
            let mut max = [f32::NEG_INFINITY; HEADS_PER_TASK];
            for j in 0..len {
                for h in 0..heads {
                    let v = pr[j * heads + h] * p.scale;
                    pr[j * heads + h] = v;
                    max[h] = max[h].max(v);
                }
            }
            let mut sum = [0f32; HEADS_PER_TASK];
            for j in 0..len {
                for h in 0..heads {
                    let e = (pr[j * heads + h] - max[h]).exp();
                    pr[j * heads + h] = e;
                    sum[h] += e;
                }
            }
            o.fill(0.0);
            for j in 0..len {
                k.multi_axpy(o, &pr[j * heads..(j + 1) * heads], &values[j * v_row + g * v_stride..][..vd]);
            }
            for h in 0..heads {
                let inv = 1.0 / sum[h];
                for v in &mut o[h * vd..(h + 1) * vd] {
                    *v *= inv;
                }
            }
        })
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
