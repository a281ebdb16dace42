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
    p: AttnParams<'_>,
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
    let first = p.first_seen(pos0 + t);
    SCORES.with(|sc| {
        let mut sc = sc.borrow_mut();
        sc.resize(len - first, 0.0);
        let mut max = f32::NEG_INFINITY;
        for (j, sj) in (first..).zip(sc.iter_mut()) {
            *sj = dotf(qv, &l.k[j * k_row + g * kd..][..kd]) * p.scale;
            max = max.max(*sj);
        }
        // A sink joins the denominator (and the maximum) but weighs no value.
        let sink = p.sinks.map(|s| s[h]);
        if let Some(s) = sink {
            max = max.max(s);
        }
        let mut sum = sink.map_or(0.0, |s| (s - max).exp());
        for sj in sc.iter_mut() {
            *sj = (*sj - max).exp();
            sum += *sj;
        }
        o.fill(0.0);
        for (j, &w) in (first..).zip(sc.iter()) {
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
pub(super) fn attention_ref(l: &KvLayer, q: &[f32], q_stride: usize, n: usize, pos0: usize, p: AttnParams<'_>, out: &mut [f32]) {
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

/// Tokens per task in prefill: the cached keys and values a task streams serve this many
/// queries of each head, instead of one.
const TOKENS_PER_TASK: usize = 8;

/// A task's buffers, reused across calls: its query rows, its scores (then probabilities)
/// position-major, and its unnormalised outputs.
#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    probs: Vec<f32>,
    out: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Positions whose scores a task holds at once (see [`attention_fast`]).
pub(super) const POSITIONS_PER_BLOCK: usize = 512;

/// Grouped-query attention on the persistent pool: each task takes up to [`TOKENS_PER_TASK`]
/// tokens, one KV head and up to [`HEADS_PER_TASK`] of its query heads, and streams that
/// head's cached keys and values once for all of them. Every (token, head) row gets exactly
/// the arithmetic it would get alone (later positions are masked out of its softmax and
/// enter its weighted sum with weight zero), so prefill and decode agree bit for bit.
///
/// Positions go by in blocks of `block` ([`POSITIONS_PER_BLOCK`] in production): a task holds one block's scores, and
/// each row carries its running maximum and sum across blocks (its output is rescaled when
/// the maximum grows), so a task's scratch does not grow with the context. Up to one block,
/// the arithmetic is that of one softmax over all positions.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_fast(
    l: &KvLayer,
    q: &[f32],
    q_stride: usize,
    n: usize,
    pos0: usize,
    p: AttnParams<'_>,
    out: &mut [f32],
    k: &smoe_kernels::Kernels,
    pool: &super::pool::Pool,
    block: usize,
) {
    let s = l.shape;
    let (kd, vd, kvh) = (s.k_dim, s.v_dim, s.heads);
    let group = p.q_heads / kvh;
    let chunk = group.min(HEADS_PER_TASK);
    let chunks_per_group = group.div_ceil(chunk);
    let blocks = n.div_ceil(TOKENS_PER_TASK);
    let k_row = kvh * kd;
    let (values, v_row, v_stride) = if s.values_in_keys { (&l.k, k_row, kd) } else { (&l.v, kvh * vd, vd) };
    let out = &mut out[..n * p.q_heads * vd];
    let sink = super::DisjointOut::new(out);
    pool.run(blocks * kvh * chunks_per_group, &|task| {
        let (b, rest) = (task / (kvh * chunks_per_group), task % (kvh * chunks_per_group));
        let (g, c) = (rest / chunks_per_group, rest % chunks_per_group);
        let h0 = g * group + c * chunk;
        let heads = chunk.min(g * group + group - h0);
        let (t0, t1) = (b * TOKENS_PER_TASK, ((b + 1) * TOKENS_PER_TASK).min(n));
        let rows = (t1 - t0) * heads;
        let len = pos0 + t1;
        SCRATCH.with(|sc| {
            let Scratch { q: qb, probs: pr, out: ob } = &mut *sc.borrow_mut();
            // The block's query rows, contiguous: row (t - t0) * heads + h.
            qb.clear();
            for t in t0..t1 {
                qb.extend_from_slice(&q[t * q_stride + h0 * kd..][..heads * kd]);
            }
            ob.clear();
            ob.resize(rows * vd, 0.0);
            const ROWS: usize = TOKENS_PER_TASK * HEADS_PER_TASK;
            let (mut max, mut sum, mut inv) = ([f32::NEG_INFINITY; ROWS], [0f32; ROWS], [0f32; ROWS]);
            // Blocks stay aligned to multiples of `block` whatever the window, so that a row's
            // arithmetic does not depend on the other rows of its task (prefill = decode).
            let start = p.first_seen(pos0 + t0) / block * block;
            for j0 in (start..len).step_by(block) {
                let nb = block.min(len - j0);
                // Scores, position-major: pr[j * rows + r] for positions j0 + j.
                pr.resize(nb * rows, 0.0);
                k.attn_scores(qb, kd, &l.k[j0 * k_row + g * kd..], k_row, nb, pr);
                // Softmax terms of each row over the positions it sees, a token's heads side
                // by side (scores are position-major: one row at a time would stride through
                // them).
                for tt in 0..t1 - t0 {
                    let seen = (pos0 + t0 + tt + 1).saturating_sub(j0).min(nb);
                    // Positions before the row's window are masked like those after it.
                    let from = p.first_seen(pos0 + t0 + tt).saturating_sub(j0).min(seen);
                    let rs = tt * heads..(tt + 1) * heads;
                    let mut block_max = [f32::NEG_INFINITY; ROWS];
                    for j in from..seen {
                        for (v, m) in pr[j * rows..][rs.clone()].iter_mut().zip(&mut block_max[rs.clone()]) {
                            *v *= p.scale;
                            *m = m.max(*v);
                        }
                    }
                    for r in rs.clone() {
                        if block_max[r] > max[r] {
                            // The row's terms so far were taken against a smaller maximum.
                            let f = (max[r] - block_max[r]).exp();
                            sum[r] *= f;
                            ob[r * vd..(r + 1) * vd].iter_mut().for_each(|o| *o *= f);
                            max[r] = block_max[r];
                        }
                    }
                    for j in 0..from {
                        pr[j * rows..][rs.clone()].fill(0.0);
                    }
                    for j in from..seen {
                        for ((v, m), s) in pr[j * rows..][rs.clone()].iter_mut().zip(&max[rs.clone()]).zip(&mut sum[rs.clone()]) {
                            *v = (*v - m).exp();
                            *s += *v;
                        }
                    }
                    for j in seen..nb {
                        pr[j * rows..][rs.clone()].fill(0.0);
                    }
                }
                k.attn_weighted_sum(ob, vd, &pr[..nb * rows], &values[j0 * v_row + g * v_stride..], v_row, nb);
            }
            if let Some(sinks) = p.sinks {
                // Each row's sink joins its denominator, rescaling what came before if it is
                // the new maximum (as one softmax over the scores and the sink would).
                for r in 0..rows {
                    let s = sinks[h0 + r % heads];
                    if s > max[r] {
                        let f = (max[r] - s).exp();
                        sum[r] *= f;
                        ob[r * vd..(r + 1) * vd].iter_mut().for_each(|o| *o *= f);
                        max[r] = s;
                    }
                    sum[r] += (s - max[r]).exp();
                }
            }
            for r in 0..rows {
                inv[r] = 1.0 / sum[r];
            }
            for t in t0..t1 {
                let r0 = (t - t0) * heads;
                // SAFETY: this task owns the output rows of query heads h0..h0 + heads of
                // tokens t0..t1; tasks cover disjoint (token, head) ranges and `out`
                // outlives `pool.run`.
                let o = unsafe { sink.range((t * p.q_heads + h0) * vd, heads * vd) };
                for (h, o) in o.chunks_exact_mut(vd).enumerate() {
                    for (d, &v) in o.iter_mut().zip(&ob[(r0 + h) * vd..(r0 + h + 1) * vd]) {
                        *d = v * inv[r0 + h];
                    }
                }
            }
        })
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::KvShape;

    fn layer(shape: KvShape, positions: usize) -> KvLayer {
        let v = |n: usize, seed: usize| (0..n).map(|i| (((i * 7919 + seed * 104729) % 1999) as f32 / 1999.0 - 0.5) * 3.0).collect();
        let kw = shape.heads * shape.k_dim;
        let vw = if shape.values_in_keys { 0 } else { shape.heads * shape.v_dim };
        KvLayer { shape, k: v(positions * kw, 1), v: v(positions * vw, 2) }
    }

    /// Attention in blocks of positions equals one softmax over all of them (to rounding), and
    /// prefill equals decode bit for bit at any block size, with and without sliding windows
    /// and sinks.
    #[test]
    fn blocks_of_positions_match_one_softmax() {
        let kernels = smoe_kernels::best();
        let pool = crate::cpu::pool::Pool::new(2);
        for (shape, q_heads) in [
            (KvShape { heads: 2, k_dim: 16, v_dim: 16, values_in_keys: false }, 6),
            (KvShape { heads: 1, k_dim: 24, v_dim: 16, values_in_keys: true }, 3),
        ] {
            let (n, pos0) = (19, 40);
            let l = layer(shape, pos0 + n);
            let q_stride = q_heads * shape.k_dim + 5;
            let q: Vec<f32> = (0..n * q_stride).map(|i| ((i * 31 % 97) as f32 - 48.0) / 40.0).collect();
            // gpt-oss's windows and sinks (large enough to win some maxima) go through the same
            // blocks.
            let sinks: Vec<f32> = (0..q_heads).map(|h| h as f32 * 1.5 - 2.0).collect();
            let variants = [(None, None), (Some(7), Some(&sinks[..])), (Some(45), None), (None, Some(&sinks[..]))];
            for (window, sinks) in variants {
                let p = AttnParams { q_heads, scale: 0.3, window, sinks };
                let width = n * q_heads * shape.v_dim;
                let mut exact = vec![0f32; width];
                attention_ref(&l, &q, q_stride, n, pos0, p, &mut exact);
                for block in [1, 3, 17, 64, 4096] {
                    let mut got = vec![0f32; width];
                    attention_fast(&l, &q, q_stride, n, pos0, p, &mut got, kernels, &pool, block);
                    let err = got.iter().zip(&exact).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(err < 1e-5, "block {block}: {err}");
                    // Token by token through the same cache: the same bits.
                    let mut one = vec![0f32; q_heads * shape.v_dim];
                    for t in 0..n {
                        attention_fast(&l, &q[t * q_stride..], q_stride, 1, pos0 + t, p, &mut one, kernels, &pool, block);
                        assert_eq!(one, got[t * one.len()..(t + 1) * one.len()], "block {block}, token {t}");
                    }
                }
            }
        }
    }
}
