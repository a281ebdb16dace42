//! The 32-element block formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
//!
//! Encoders mirror ggml's `quantize_row_*_ref` (including its truncating casts), decoders
//! mirror `dequantize_row_*`.

use crate::blocks::{
    e4m3_times_512, e8m0_to_f32_half, BlockFp8, BlockMxfp4, BlockMxfp8, BlockQ4_0, BlockQ4_1, BlockQ5_0, BlockQ5_1, BlockQ8_0,
    KVALUES_MXFP4, QK, QK_FP8,
};
use crate::half::F16Bytes;

/// The value of largest magnitude, with its sign.
fn signed_absmax(x: &[f32]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter().fold((f32::MAX, -f32::MAX), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

pub(crate) fn quantize_q8_0(x: &[f32], y: &mut [BlockQ8_0]) {
    for (b, x) in y.iter_mut().zip(x.chunks_exact(QK)) {
        let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = F16Bytes::from_f32(d);
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = (v * id).round() as i8;
        }
    }
}

pub(crate) fn dequantize_q8_0(x: &[BlockQ8_0], y: &mut [f32]) {
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for (o, &q) in y.iter_mut().zip(&b.qs) {
            *o = q as f32 * d;
        }
    }
}

pub(crate) fn quantize_q4_0(x: &[f32], y: &mut [BlockQ4_0]) {
    for (b, x) in y.iter_mut().zip(x.chunks_exact(QK)) {
        let d = signed_absmax(x) / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = F16Bytes::from_f32(d);
        for j in 0..QK / 2 {
            // ggml truncates toward zero after adding 8.5, i.e. rounds half up.
            let q0 = ((x[j] * id + 8.5) as i8).min(15) as u8;
            let q1 = ((x[j + QK / 2] * id + 8.5) as i8).min(15) as u8;
            b.qs[j] = q0 | (q1 << 4);
        }
    }
}

pub(crate) fn dequantize_q4_0(x: &[BlockQ4_0], y: &mut [f32]) {
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        for j in 0..QK / 2 {
            y[j] = ((b.qs[j] & 0x0f) as i32 - 8) as f32 * d;
            y[j + QK / 2] = ((b.qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

/// ggml's `quantize_row_mxfp4_ref`: the shared exponent `floor(log2(amax)) − 2` (so that the
/// largest magnitude lands in e2m1's top binade), each value the code nearest to it (the first
/// of equals).
pub(crate) fn quantize_mxfp4(x: &[f32], y: &mut [BlockMxfp4]) {
    for (b, x) in y.iter_mut().zip(x.chunks_exact(QK)) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        // `as u8` saturates: exponents below the range become 0, as ggml's cast wraps only for
        // magnitudes no checkpoint holds.
        b.e = if amax > 0.0 { (amax.log2().floor() - 2.0 + 127.0) as u8 } else { 0 };
        let d = e8m0_to_f32_half(b.e);
        let best = |v: f32| {
            let mut best = (0u8, (KVALUES_MXFP4[0] as f32 * d - v).abs());
            for (i, &k) in KVALUES_MXFP4.iter().enumerate().skip(1) {
                let err = (k as f32 * d - v).abs();
                if err < best.1 {
                    best = (i as u8, err);
                }
            }
            best.0
        };
        for j in 0..QK / 2 {
            b.qs[j] = best(x[j]) | (best(x[j + QK / 2]) << 4);
        }
    }
}

pub(crate) fn dequantize_mxfp4(x: &[BlockMxfp4], y: &mut [f32]) {
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let d = e8m0_to_f32_half(b.e);
        for j in 0..QK / 2 {
            y[j] = KVALUES_MXFP4[(b.qs[j] & 0x0f) as usize] as f32 * d;
            y[j + QK / 2] = KVALUES_MXFP4[(b.qs[j] >> 4) as usize] as f32 * d;
        }
    }
}

/// `2^(e − 127)`, the e8m0 scale (exact; subnormal for `e` 0).
fn e8m0(e: u8) -> f32 {
    e8m0_to_f32_half(e) * 2.0
}

/// The float8 e4m3 code nearest `x` (ties to the even code), saturating at ±448.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a >= 448.0 {
        return sign | 0x7e;
    }
    // The subnormal binade (and zero): steps of 2^−9.
    if a < 2f32.powi(-6) {
        let m = crate::nearest_int(a * 512.0) as u8;
        // m == 8 is the smallest normal, code 0x08: the same bits.
        return sign | m;
    }
    let k = a.log2().floor() as i32;
    let k = if 2f32.powi(k) > a {
        k - 1
    } else if 2f32.powi(k + 1) <= a {
        k + 1
    } else {
        k
    };
    let mut m = crate::nearest_int((a / 2f32.powi(k) - 1.0) * 8.0);
    let mut e = k + 7;
    if m == 8 {
        m = 0;
        e += 1;
    }
    if e > 15 || (e == 15 && m > 6) {
        return sign | 0x7e;
    }
    sign | ((e as u8) << 3) | m as u8
}

/// The value of a float8 e4m3 code (NaN for 0x7f and 0xff).
pub fn e4m3_to_f32(q: u8) -> f32 {
    if q & 0x7f == 0x7f {
        return f32::NAN;
    }
    e4m3_times_512(q) as f32 / 512.0
}

/// MXFP8: the smallest e8m0 scale that brings the block's largest magnitude within e4m3's 448,
/// each value the nearest code.
pub(crate) fn quantize_mxfp8(x: &[f32], y: &mut [BlockMxfp8]) {
    for (b, x) in y.iter_mut().zip(x.chunks_exact(QK)) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        b.e = if amax > 0.0 { ((amax / 448.0).log2().ceil() + 127.0).clamp(0.0, 254.0) as u8 } else { 0 };
        // A scale rounded up by log2's last bit could still leave amax above 448: step down
        // only if the value fits one binade lower.
        if b.e > 0 && amax / e8m0(b.e - 1) <= 448.0 {
            b.e -= 1;
        }
        let inv = 1.0 / e8m0(b.e);
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = f32_to_e4m3(v * inv);
        }
    }
}

pub(crate) fn dequantize_mxfp8(x: &[BlockMxfp8], y: &mut [f32]) {
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let d = e8m0(b.e);
        for (o, &q) in y.iter_mut().zip(&b.qs) {
            *o = e4m3_to_f32(q) * d;
        }
    }
}

/// FP8: the scale that brings the block's largest magnitude to e4m3's 448 (any f32, as the
/// checkpoints' `weight_scale_inv`), each value the nearest code.
pub(crate) fn quantize_fp8(x: &[f32], y: &mut [BlockFp8]) {
    for (b, x) in y.iter_mut().zip(x.chunks_exact(QK_FP8)) {
        let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        // Not below the smallest normal f32: 1 / d must stay finite (else 0 · inf is NaN).
        let d = if amax > 0.0 { (amax / 448.0).max(f32::MIN_POSITIVE) } else { 0.0 };
        b.d = d.to_le_bytes();
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        for (q, &v) in b.qs.iter_mut().zip(x) {
            *q = f32_to_e4m3(v * inv);
        }
    }
}

pub(crate) fn dequantize_fp8(x: &[BlockFp8], y: &mut [f32]) {
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK_FP8)) {
        let d = b.scale();
        for (o, &q) in y.iter_mut().zip(&b.qs) {
            *o = e4m3_to_f32(q) * d;
        }
    }
}

pub(crate) fn quantize_q4_1(x: &[f32], y: &mut [BlockQ4_1]) {
    for (b, x) in y.iter_mut().zip(x.chunks_exact(QK)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = F16Bytes::from_f32(d);
        b.m = F16Bytes::from_f32(min);
        for j in 0..QK / 2 {
            let q0 = (((x[j] - min) * id + 0.5) as i8).min(15) as u8;
            let q1 = (((x[j + QK / 2] - min) * id + 0.5) as i8).min(15) as u8;
            b.qs[j] = q0 | (q1 << 4);
        }
    }
}

pub(crate) fn dequantize_q4_1(x: &[BlockQ4_1], y: &mut [f32]) {
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let (d, m) = (b.d.to_f32(), b.m.to_f32());
        for j in 0..QK / 2 {
            y[j] = (b.qs[j] & 0x0f) as f32 * d + m;
            y[j + QK / 2] = (b.qs[j] >> 4) as f32 * d + m;
        }
    }
}

pub(crate) fn quantize_q5_0(x: &[f32], y: &mut [BlockQ5_0]) {
    for (b, x) in y.iter_mut().zip(x.chunks_exact(QK)) {
        let d = signed_absmax(x) / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = F16Bytes::from_f32(d);
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            let q0 = ((x[j] * id + 16.5) as i8).min(31) as u8;
            let q1 = ((x[j + QK / 2] * id + 16.5) as i8).min(31) as u8;
            b.qs[j] = (q0 & 0x0f) | ((q1 & 0x0f) << 4);
            qh |= (((q0 & 0x10) >> 4) as u32) << j;
            qh |= (((q1 & 0x10) >> 4) as u32) << (j + QK / 2);
        }
        b.qh = qh.to_le_bytes();
    }
}

pub(crate) fn dequantize_q5_0(x: &[BlockQ5_0], y: &mut [f32]) {
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let d = b.d.to_f32();
        let qh = u32::from_le_bytes(b.qh);
        for j in 0..QK / 2 {
            let h0 = (((qh >> j) << 4) & 0x10) as u8;
            let h1 = ((qh >> (j + 12)) & 0x10) as u8;
            y[j] = (((b.qs[j] & 0x0f) | h0) as i32 - 16) as f32 * d;
            y[j + QK / 2] = (((b.qs[j] >> 4) | h1) as i32 - 16) as f32 * d;
        }
    }
}

pub(crate) fn quantize_q5_1(x: &[f32], y: &mut [BlockQ5_1]) {
    for (b, x) in y.iter_mut().zip(x.chunks_exact(QK)) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = F16Bytes::from_f32(d);
        b.m = F16Bytes::from_f32(min);
        let mut qh = 0u32;
        for j in 0..QK / 2 {
            let q0 = ((x[j] - min) * id + 0.5) as u8;
            let q1 = ((x[j + QK / 2] - min) * id + 0.5) as u8;
            b.qs[j] = (q0 & 0x0f) | ((q1 & 0x0f) << 4);
            qh |= (((q0 & 0x10) >> 4) as u32) << j;
            qh |= (((q1 & 0x10) >> 4) as u32) << (j + QK / 2);
        }
        b.qh = qh.to_le_bytes();
    }
}

pub(crate) fn dequantize_q5_1(x: &[BlockQ5_1], y: &mut [f32]) {
    for (b, y) in x.iter().zip(y.chunks_exact_mut(QK)) {
        let (d, m) = (b.d.to_f32(), b.m.to_f32());
        let qh = u32::from_le_bytes(b.qh);
        for j in 0..QK / 2 {
            let h0 = (((qh >> j) << 4) & 0x10) as u8;
            let h1 = ((qh >> (j + 12)) & 0x10) as u8;
            y[j] = ((b.qs[j] & 0x0f) | h0) as f32 * d + m;
            y[j + QK / 2] = ((b.qs[j] >> 4) | h1) as f32 * d + m;
        }
    }
}
