//! The K-quants: 256-element super-blocks with quantized per-group scales.
//!
//! Encoders mirror ggml's `quantize_row_q*_K_ref`; decoders mirror `dequantize_row_q*_K`.

mod search;

use crate::blocks::{BlockQ2K, BlockQ3K, BlockQ4K, BlockQ5K, BlockQ6K, QK_K};
use crate::half::F16Bytes;
use crate::nearest_int;
use search::{make_q3_quants, make_qkx2_quants, make_qx_quants, Qkx2, GROUP_MAX_EPS};

/// Unpacks the 6-bit scale and min of group `j` from Q4_K/Q5_K's 12 scale bytes.
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// Packs eight 6-bit scales and mins into Q4_K/Q5_K's 12 scale bytes.
fn pack_scale_min_k4(ls: &[u8; 8], lm: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..8 {
        if j < 4 {
            s[j] = ls[j];
            s[j + 4] = lm[j];
        } else {
            s[j + 4] = (ls[j] & 0x0f) | ((lm[j] & 0x0f) << 4);
            s[j - 4] |= (ls[j] >> 4) << 6;
            s[j] |= (lm[j] >> 4) << 6;
        }
    }
    s
}

/// Shared by Q4_K and Q5_K: per 32-group asymmetric search, 6-bit scales/mins, final quants.
fn quantize_k4_groups(x: &[f32], nmax: i32, search: &Qkx2, l: &mut [u8; QK_K]) -> (f32, f32, [u8; 12]) {
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    let mut weights = [0f32; 32];
    let mut laux = [0u8; 32];
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..8 {
        let g = &x[32 * j..32 * j + 32];
        let mut sum_x2 = 0.0f32;
        for &v in g {
            sum_x2 += v * v;
        }
        let av_x = (sum_x2 / 32.0).sqrt();
        for (w, &v) in weights.iter_mut().zip(g) {
            *w = av_x + v.abs();
        }
        let (s, m) = make_qkx2_quants(g, &weights, search, &mut l[32 * j..32 * j + 32], &mut laux);
        scales[j] = s;
        mins[j] = m;
        max_scale = max_scale.max(s);
        max_min = max_min.max(m);
    }
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut ls = [0u8; 8];
    let mut lm = [0u8; 8];
    for j in 0..8 {
        ls[j] = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        lm[j] = (nearest_int(inv_min * mins[j]) as u8).min(63);
    }
    let packed = pack_scale_min_k4(&ls, &lm);
    let d = F16Bytes::from_f32(max_scale / 63.0).to_f32();
    let dmin = F16Bytes::from_f32(max_min / 63.0).to_f32();
    for j in 0..8 {
        let (sc, m) = scale_min_k4(j, &packed);
        let dj = d * sc as f32;
        if dj == 0.0 {
            continue;
        }
        let dm = dmin * m as f32;
        for ii in 0..32 {
            l[32 * j + ii] = nearest_int((x[32 * j + ii] + dm) / dj).clamp(0, nmax) as u8;
        }
    }
    (max_scale / 63.0, max_min / 63.0, packed)
}

pub(crate) fn quantize_q4_k(x: &[f32], y: &mut [BlockQ4K]) {
    let search = Qkx2 { nmax: 15, rmin: -1.0, rdelta: 0.1, nstep: 20, use_mad: false };
    let mut l = [0u8; QK_K];
    for (b, x) in y.iter_mut().zip(x.chunks_exact(QK_K)) {
        let (d, dmin, scales) = quantize_k4_groups(x, 15, &search, &mut l);
        b.d = F16Bytes::from_f32(d);
        b.dmin = F16Bytes::from_f32(dmin);
        b.scales = scales;
        for (chunk, q) in b.qs.chunks_exact_mut(32).enumerate() {
            let base = chunk * 64;
            for i in 0..32 {
                q[i] = l[base + i] | (l[base + i + 32] << 4);
            }
        }
    }
}

pub(crate) fn dequantize_q4_k(x: &[BlockQ4K], y: &mut [f32]) {
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        for (chunk, (q, y)) in b.qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
            let (sc1, m1) = scale_min_k4(2 * chunk, &b.scales);
            let (sc2, m2) = scale_min_k4(2 * chunk + 1, &b.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            for l in 0..32 {
                y[l] = d1 * (q[l] & 0x0f) as f32 - m1;
                y[l + 32] = d2 * (q[l] >> 4) as f32 - m2;
            }
        }
    }
}

pub(crate) fn quantize_q5_k(x: &[f32], y: &mut [BlockQ5K]) {
    let search = Qkx2 { nmax: 31, rmin: -0.5, rdelta: 0.1, nstep: 15, use_mad: false };
    let mut l = [0u8; QK_K];
    for (b, x) in y.iter_mut().zip(x.chunks_exact(QK_K)) {
        let (d, dmin, scales) = quantize_k4_groups(x, 31, &search, &mut l);
        b.d = F16Bytes::from_f32(d);
        b.dmin = F16Bytes::from_f32(dmin);
        b.scales = scales;
        b.qh = [0; QK_K / 8];
        let (mut m1, mut m2) = (1u8, 2u8);
        for (chunk, ql) in b.qs.chunks_exact_mut(32).enumerate() {
            let n = chunk * 64;
            for j in 0..32 {
                let mut l1 = l[n + j];
                if l1 > 15 {
                    l1 -= 16;
                    b.qh[j] |= m1;
                }
                let mut l2 = l[n + j + 32];
                if l2 > 15 {
                    l2 -= 16;
                    b.qh[j] |= m2;
                }
                ql[j] = l1 | (l2 << 4);
            }
            m1 <<= 2;
            m2 <<= 2;
        }
    }
}

pub(crate) fn dequantize_q5_k(x: &[BlockQ5K], y: &mut [f32]) {
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        let (mut u1, mut u2) = (1u8, 2u8);
        for (chunk, (ql, y)) in b.qs.chunks_exact(32).zip(y.chunks_exact_mut(64)).enumerate() {
            let (sc1, m1) = scale_min_k4(2 * chunk, &b.scales);
            let (sc2, m2) = scale_min_k4(2 * chunk + 1, &b.scales);
            let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
            for l in 0..32 {
                let h1 = if b.qh[l] & u1 != 0 { 16 } else { 0 };
                let h2 = if b.qh[l] & u2 != 0 { 16 } else { 0 };
                y[l] = d1 * ((ql[l] & 0x0f) + h1) as f32 - m1;
                y[l + 32] = d2 * ((ql[l] >> 4) + h2) as f32 - m2;
            }
            u1 <<= 2;
            u2 <<= 2;
        }
    }
}

pub(crate) fn quantize_q6_k(x: &[f32], y: &mut [BlockQ6K]) {
    let mut l = [0i8; QK_K];
    let mut scales = [0f32; QK_K / 16];
    for (b, x) in y.iter_mut().zip(x.chunks_exact(QK_K)) {
        let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
        for ib in 0..QK_K / 16 {
            let s = make_qx_quants(&x[16 * ib..16 * ib + 16], 32, &mut l[16 * ib..16 * ib + 16]);
            scales[ib] = s;
            if s.abs() > max_abs_scale {
                max_abs_scale = s.abs();
                max_scale = s;
            }
        }
        if max_abs_scale < GROUP_MAX_EPS {
            *b = bytemuck::Zeroable::zeroed();
            continue;
        }
        let iscale = -128.0 / max_scale;
        b.d = F16Bytes::from_f32(1.0 / iscale);
        for ib in 0..QK_K / 16 {
            b.scales[ib] = nearest_int(iscale * scales[ib]).min(127) as i8;
        }
        let d_all = b.d.to_f32();
        for j in 0..QK_K / 16 {
            let d = d_all * b.scales[j] as f32;
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                l[16 * j + ii] = (nearest_int(x[16 * j + ii] / d).clamp(-32, 31) + 32) as i8;
            }
        }
        for half in 0..2 {
            let (j, ql, qh) = (half * 128, &mut b.ql[half * 64..], &mut b.qh[half * 32..]);
            for i in 0..32 {
                let q = |k: usize| l[j + i + 32 * k] as u8;
                ql[i] = (q(0) & 0x0f) | ((q(2) & 0x0f) << 4);
                ql[i + 32] = (q(1) & 0x0f) | ((q(3) & 0x0f) << 4);
                qh[i] = (q(0) >> 4) | ((q(1) >> 4) << 2) | ((q(2) >> 4) << 4) | ((q(3) >> 4) << 6);
            }
        }
    }
}

pub(crate) fn dequantize_q6_k(x: &[BlockQ6K], y: &mut [f32]) {
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        for half in 0..2 {
            let (ql, qh) = (&b.ql[half * 64..], &b.qh[half * 32..]);
            let sc = &b.scales[half * 8..];
            let y = &mut y[half * 128..];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                y[l] = d * sc[is] as f32 * q1 as f32;
                y[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
                y[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
                y[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
            }
        }
    }
}

pub(crate) fn quantize_q2_k(x: &[f32], y: &mut [BlockQ2K]) {
    let search = Qkx2 { nmax: 3, rmin: -0.5, rdelta: 0.1, nstep: 15, use_mad: true };
    let mut l = [0u8; QK_K];
    let mut laux = [0u8; 16];
    let mut weights = [0f32; 16];
    let mut scales = [0f32; 16];
    let mut mins = [0f32; 16];
    for (b, x) in y.iter_mut().zip(x.chunks_exact(QK_K)) {
        let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
        for j in 0..16 {
            let g = &x[16 * j..16 * j + 16];
            for (w, &v) in weights.iter_mut().zip(g) {
                *w = v.abs();
            }
            let (s, m) = make_qkx2_quants(g, &weights, &search, &mut l[16 * j..16 * j + 16], &mut laux);
            scales[j] = s;
            mins[j] = m;
            max_scale = max_scale.max(s);
            max_min = max_min.max(m);
        }
        if max_scale > 0.0 {
            let iscale = 15.0 / max_scale;
            for j in 0..16 {
                b.scales[j] = nearest_int(iscale * scales[j]) as u8;
            }
            b.d = F16Bytes::from_f32(max_scale / 15.0);
        } else {
            b.scales = [0; 16];
            b.d = F16Bytes::from_f32(0.0);
        }
        if max_min > 0.0 {
            let iscale = 15.0 / max_min;
            for j in 0..16 {
                b.scales[j] |= (nearest_int(iscale * mins[j]) << 4) as u8;
            }
            b.dmin = F16Bytes::from_f32(max_min / 15.0);
        } else {
            b.dmin = F16Bytes::from_f32(0.0);
        }
        for j in 0..16 {
            let d = b.d.to_f32() * (b.scales[j] & 0x0f) as f32;
            if d == 0.0 {
                continue;
            }
            let dm = b.dmin.to_f32() * (b.scales[j] >> 4) as f32;
            for ii in 0..16 {
                l[16 * j + ii] = nearest_int((x[16 * j + ii] + dm) / d).clamp(0, 3) as u8;
            }
        }
        pack_2bit(&l, &mut b.qs);
    }
}

/// Q2_K/Q3_K pack four 2-bit values 32 apart into each byte, per 128 elements.
fn pack_2bit(l: &[u8; QK_K], qs: &mut [u8; QK_K / 4]) {
    for j in (0..QK_K).step_by(128) {
        for i in 0..32 {
            qs[j / 4 + i] = l[j + i] | (l[j + i + 32] << 2) | (l[j + i + 64] << 4) | (l[j + i + 96] << 6);
        }
    }
}

pub(crate) fn dequantize_q2_k(x: &[BlockQ2K], y: &mut [f32]) {
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let d = b.d.to_f32();
        let min = b.dmin.to_f32();
        let mut out = 0;
        let mut is = 0;
        for half in 0..2 {
            let q = &b.qs[half * 32..];
            for shift in [0u32, 2, 4, 6] {
                for off in [0usize, 16] {
                    let sc = b.scales[is];
                    is += 1;
                    let (dl, ml) = (d * (sc & 0x0f) as f32, min * (sc >> 4) as f32);
                    for l in 0..16 {
                        y[out] = dl * ((q[l + off] >> shift) & 3) as f32 - ml;
                        out += 1;
                    }
                }
            }
        }
    }
}

pub(crate) fn quantize_q3_k(x: &[f32], y: &mut [BlockQ3K]) {
    let mut l8 = [0i8; QK_K];
    let mut scales = [0f32; 16];
    for (b, x) in y.iter_mut().zip(x.chunks_exact(QK_K)) {
        let (mut max_scale, mut amax) = (0.0f32, 0.0f32);
        for j in 0..16 {
            scales[j] = make_q3_quants(&x[16 * j..16 * j + 16], 4, &mut l8[16 * j..16 * j + 16]);
            if scales[j].abs() > amax {
                amax = scales[j].abs();
                max_scale = scales[j];
            }
        }
        b.scales = [0; 12];
        if max_scale != 0.0 {
            let iscale = -32.0 / max_scale;
            for j in 0..16 {
                let lv = (nearest_int(iscale * scales[j]) as i8).clamp(-32, 31) + 32;
                let lv = lv as u8;
                if j < 8 {
                    b.scales[j] = lv & 0x0f;
                } else {
                    b.scales[j - 8] |= (lv & 0x0f) << 4;
                }
                b.scales[j % 4 + 8] |= (lv >> 4) << (2 * (j / 4));
            }
            b.d = F16Bytes::from_f32(1.0 / iscale);
        } else {
            b.d = F16Bytes::from_f32(0.0);
        }
        let sc = unpack_q3_scales(&b.scales);
        let d_all = b.d.to_f32();
        for j in 0..16 {
            let d = d_all * sc[j] as f32;
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                l8[16 * j + ii] = (nearest_int(x[16 * j + ii] / d).clamp(-4, 3) + 4) as i8;
            }
        }
        b.hmask = [0; QK_K / 8];
        let mut l = [0u8; QK_K];
        let (mut m, mut hm) = (0usize, 1u8);
        for j in 0..QK_K {
            let mut v = l8[j] as u8;
            if v > 3 {
                b.hmask[m] |= hm;
                v -= 4;
            }
            l[j] = v;
            m += 1;
            if m == QK_K / 8 {
                m = 0;
                hm <<= 1;
            }
        }
        pack_2bit(&l, &mut b.qs);
    }
}

/// Unpacks Q3_K's sixteen 6-bit scales (stored biased by 32) to signed values.
pub fn unpack_q3_scales(s: &[u8; 12]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (j, o) in out.iter_mut().enumerate() {
        let low = if j < 8 { s[j] & 0x0f } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        *o = ((low | (high << 4)) as i32 - 32) as i8;
    }
    out
}

pub(crate) fn dequantize_q3_k(x: &[BlockQ3K], y: &mut [f32]) {
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_K)) {
        let d_all = b.d.to_f32();
        let scales = unpack_q3_scales(&b.scales);
        let mut out = 0;
        let mut is = 0;
        let mut m = 1u8;
        for half in 0..2 {
            let q = &b.qs[half * 32..];
            for shift in [0u32, 2, 4, 6] {
                for off in [0usize, 16] {
                    let dl = d_all * scales[is] as f32;
                    is += 1;
                    for l in 0..16 {
                        let low = ((q[l + off] >> shift) & 3) as i32;
                        let high = if b.hmask[l + off] & m != 0 { 0 } else { 4 };
                        y[out] = dl * (low - high) as f32;
                        out += 1;
                    }
                }
                m <<= 1;
            }
        }
    }
}
