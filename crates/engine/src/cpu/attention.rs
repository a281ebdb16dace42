//! Reference causal attention over the KV cache.

use super::matmul::dot;
use super::KvLayer;
use crate::backend::AttnParams;
use rayon::prelude::*;
use std::cell::RefCell;

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

pub(super) fn attention_ref(l: &KvLayer, q: &[f32], n: usize, pos0: usize, p: AttnParams, out: &mut [f32]) {
    let s = l.shape;
    let (kd, vd) = (s.k_dim, s.v_dim);
    let group = p.q_heads / s.heads;
    let k_row = s.heads * kd;
    let (values, v_row, v_off) = if s.values_in_keys { (&l.k, k_row, 0) } else { (&l.v, s.heads * vd, 0) };
    let job = |(i, o): (usize, &mut [f32])| {
        let (t, h) = (i / p.q_heads, i % p.q_heads);
        let g = h / group;
        let qv = &q[t * p.q_heads * kd + h * kd..][..kd];
        let len = pos0 + t + 1;
        SCORES.with(|sc| {
            let mut sc = sc.borrow_mut();
            sc.resize(len, 0.0);
            let mut max = f32::NEG_INFINITY;
            for (j, s) in sc.iter_mut().enumerate() {
                *s = dot(qv, &l.k[j * k_row + g * kd..][..kd]) * p.scale;
                max = max.max(*s);
            }
            let mut sum = 0f32;
            for s in sc.iter_mut() {
                *s = (*s - max).exp();
                sum += *s;
            }
            o.fill(0.0);
            for (j, &w) in sc.iter().enumerate() {
                let v = &values[j * v_row + v_off + g * if s.values_in_keys { kd } else { vd }..][..vd];
                for (a, &b) in o.iter_mut().zip(v) {
                    *a += w * b;
                }
            }
            for a in o.iter_mut() {
                *a /= sum;
            }
        })
    };
    let out = &mut out[..n * p.q_heads * vd];
    if n * p.q_heads * (pos0 + n) * kd < 1 << 16 {
        out.chunks_mut(vd).enumerate().for_each(job);
    } else {
        out.par_chunks_mut(vd).enumerate().for_each(job);
    }
}
