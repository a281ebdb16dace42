//! NEON kernels (every aarch64 CPU has NEON). Integer products widen with `vmull_s8` and
//! accumulate pairwise into i32 with `vpadalq_s16`; each i16 holds at most two products, which
//! never overflows for the ranges involved (|q| ≤ 63 × |a| ≤ 127, twice, < 2¹⁵).

use crate::act::{Block256, Block32};
use smoe_quant::blocks::{BlockQ4K, BlockQ6K, BlockQ8_0};
use std::arch::aarch64::*;

/// Σ x·y over 16 signed bytes, added into an i32x4 accumulator.
#[inline(always)]
pub(crate) fn mla16(acc: int32x4_t, x: int8x16_t, y: int8x16_t) -> int32x4_t {
    // SAFETY: NEON is part of the aarch64 baseline; these are register-only operations.
    unsafe {
        let p = vmull_s8(vget_low_s8(x), vget_low_s8(y));
        let p = vmlal_s8(p, vget_high_s8(x), vget_high_s8(y));
        vpadalq_s16(acc, p)
    }
}

/// f32 · f32.
pub fn dot_f32_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut i = 0;
    // SAFETY: every load reads 4 floats at i with i + 4 <= n; NEON is baseline on aarch64.
    let mut s = unsafe {
        let (mut s0, mut s1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
        while i + 8 <= n {
            s0 = vfmaq_f32(s0, vld1q_f32(a.as_ptr().add(i)), vld1q_f32(b.as_ptr().add(i)));
            s1 = vfmaq_f32(s1, vld1q_f32(a.as_ptr().add(i + 4)), vld1q_f32(b.as_ptr().add(i + 4)));
            i += 8;
        }
        vaddvq_f32(vaddq_f32(s0, s1))
    };
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
}

/// Q8_0 weights.
pub fn dot_q8_0(w: &[u8], a: &[Block32]) -> f32 {
    let wb: &[BlockQ8_0] = bytemuck::cast_slice(w);
    let mut s = 0f32;
    for (b, a) in wb.iter().zip(a) {
        // SAFETY: each block holds 32 quants (two 16-byte loads each side).
        let v = unsafe {
            let acc = mla16(vdupq_n_s32(0), vld1q_s8(b.qs.as_ptr()), vld1q_s8(a.qs.as_ptr()));
            let acc = mla16(acc, vld1q_s8(b.qs.as_ptr().add(16)), vld1q_s8(a.qs.as_ptr().add(16)));
            vaddvq_s32(acc)
        };
        s += b.d.to_f32() * a.d * v as f32;
    }
    s
}

/// Q4_K weights.
pub fn dot_q4_k(w: &[u8], a: &[Block256]) -> f32 {
    let wb: &[BlockQ4K] = bytemuck::cast_slice(w);
    let mut total = 0f32;
    for (b, a) in wb.iter().zip(a) {
        let mut sumi = 0i32;
        let mut mins = 0i32;
        for c in 0..4 {
            let (s_lo, m_lo) = smoe_quant::scale_min_k4(2 * c, &b.scales);
            let (s_hi, m_hi) = smoe_quant::scale_min_k4(2 * c + 1, &b.scales);
            mins += m_lo as i32 * (a.bsums[4 * c] as i32 + a.bsums[4 * c + 1] as i32);
            mins += m_hi as i32 * (a.bsums[4 * c + 2] as i32 + a.bsums[4 * c + 3] as i32);
            // SAFETY: 32 bytes of nibbles at 32c (< 128) and 64 activations at 64c (< 256).
            let (lo, hi) = unsafe {
                let m = vdupq_n_u8(0x0f);
                let (q0, q1) = (vld1q_u8(b.qs.as_ptr().add(32 * c)), vld1q_u8(b.qs.as_ptr().add(32 * c + 16)));
                let y = a.qs.as_ptr().add(64 * c);
                let lo = mla16(vdupq_n_s32(0), vreinterpretq_s8_u8(vandq_u8(q0, m)), vld1q_s8(y));
                let lo = mla16(lo, vreinterpretq_s8_u8(vandq_u8(q1, m)), vld1q_s8(y.add(16)));
                let hi = mla16(vdupq_n_s32(0), vreinterpretq_s8_u8(vshrq_n_u8::<4>(q0)), vld1q_s8(y.add(32)));
                let hi = mla16(hi, vreinterpretq_s8_u8(vshrq_n_u8::<4>(q1)), vld1q_s8(y.add(48)));
                (vaddvq_s32(lo), vaddvq_s32(hi))
            };
            sumi += s_lo as i32 * lo + s_hi as i32 * hi;
        }
        total += a.d * (b.d.to_f32() * sumi as f32 - b.dmin.to_f32() * mins as f32);
    }
    total
}

/// Q6_K weights.
pub fn dot_q6_k(w: &[u8], a: &[Block256]) -> f32 {
    let wb: &[BlockQ6K] = bytemuck::cast_slice(w);
    let mut total = 0f32;
    for (b, a) in wb.iter().zip(a) {
        let mut sumi = 0i32;
        let mut offset = 0i32;
        for g in 0..16 {
            offset += b.scales[g] as i32 * a.bsums[g] as i32;
        }
        for h in 0..2 {
            for half16 in 0..2 {
                // SAFETY: offsets stay within ql (128), qh (64) and the activations (256).
                unsafe {
                    let o = 16 * half16;
                    let m4 = vdupq_n_u8(0x0f);
                    let m2 = vdupq_n_u8(0x03);
                    let ql0 = vld1q_u8(b.ql.as_ptr().add(64 * h + o));
                    let ql1 = vld1q_u8(b.ql.as_ptr().add(64 * h + 32 + o));
                    let qh = vld1q_u8(b.qh.as_ptr().add(32 * h + o));
                    let q = [
                        vorrq_u8(vandq_u8(ql0, m4), vshlq_n_u8::<4>(vandq_u8(qh, m2))),
                        vorrq_u8(vandq_u8(ql1, m4), vshlq_n_u8::<4>(vandq_u8(vshrq_n_u8::<2>(qh), m2))),
                        vorrq_u8(vshrq_n_u8::<4>(ql0), vshlq_n_u8::<4>(vandq_u8(vshrq_n_u8::<4>(qh), m2))),
                        vorrq_u8(vshrq_n_u8::<4>(ql1), vshlq_n_u8::<4>(vshrq_n_u8::<6>(qh))),
                    ];
                    for (j, q) in q.into_iter().enumerate() {
                        let e = 128 * h + 32 * j + o;
                        let v = mla16(vdupq_n_s32(0), vreinterpretq_s8_u8(q), vld1q_s8(a.qs.as_ptr().add(e)));
                        sumi += b.scales[e / 16] as i32 * vaddvq_s32(v);
                    }
                }
            }
        }
        total += a.d * b.d.to_f32() * (sumi - 32 * offset) as f32;
    }
    total
}

/// f32 weights (as little-endian bytes).
pub fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    let n = (w.len() / 4).min(x.len());
    let mut i = 0;
    // SAFETY: each load reads 4 floats (16 bytes) at i with i + 4 <= n; unaligned loads are fine.
    let mut s = unsafe {
        let mut acc = vdupq_n_f32(0.0);
        while i + 4 <= n {
            acc = vfmaq_f32(acc, vld1q_f32(w.as_ptr().add(4 * i) as *const f32), vld1q_f32(x.as_ptr().add(i)));
            i += 4;
        }
        vaddvq_f32(acc)
    };
    for j in i..n {
        s += f32::from_le_bytes([w[4 * j], w[4 * j + 1], w[4 * j + 2], w[4 * j + 3]]) * x[j];
    }
    s
}

/// Weights stored as 16-bit values (bf16, f16): eight at a time, each half of a 16-byte load
/// widened by `widen`, the tail by `scalar`.
#[inline(always)]
fn dot_16bit(w: &[u8], x: &[f32], widen: impl Fn(uint16x4_t) -> float32x4_t, scalar: impl Fn(u16) -> f32) -> f32 {
    let n = (w.len() / 2).min(x.len());
    let mut i = 0;
    // SAFETY: each load reads 8 values (16 bytes) and 8 floats at i with i + 8 <= n.
    let mut s = unsafe {
        let (mut s0, mut s1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
        while i + 8 <= n {
            let h = vld1q_u16(w.as_ptr().add(2 * i) as *const u16);
            s0 = vfmaq_f32(s0, widen(vget_low_u16(h)), vld1q_f32(x.as_ptr().add(i)));
            s1 = vfmaq_f32(s1, widen(vget_high_u16(h)), vld1q_f32(x.as_ptr().add(i + 4)));
            i += 8;
        }
        vaddvq_f32(vaddq_f32(s0, s1))
    };
    for j in i..n {
        s += scalar(u16::from_le_bytes([w[2 * j], w[2 * j + 1]])) * x[j];
    }
    s
}

/// bf16 weights: widening a bf16 is a 16-bit left shift of its bits.
pub fn dot_bf16(w: &[u8], x: &[f32]) -> f32 {
    // SAFETY: a shift and a reinterpretation of a register, touching no memory; NEON is
    // baseline on aarch64.
    dot_16bit(w, x, |h| unsafe { vreinterpretq_f32_u32(vshll_n_u16::<16>(h)) }, smoe_quant::half::bf16_bits_to_f32)
}

/// Four f16 (as bits) widened to f32 with integer operations: the exponent is rebased by
/// multiplying by 2¹¹², which is exact for normal and subnormal halves; infinities and NaNs
/// get an all-ones exponent; the sign is copied.
#[inline(always)]
fn f16x4_to_f32(h: uint16x4_t) -> float32x4_t {
    // SAFETY: register-only operations; NEON is baseline on aarch64.
    unsafe {
        let w = vmovl_u16(h);
        let magnitude = vshlq_n_u32::<13>(vandq_u32(w, vdupq_n_u32(0x7fff)));
        let sign = vshlq_n_u32::<16>(vandq_u32(w, vdupq_n_u32(0x8000)));
        let scaled = vmulq_f32(vreinterpretq_f32_u32(magnitude), vdupq_n_f32(f32::from_bits(0x7780_0000))); // 2^112
        let special = vceqq_u32(vandq_u32(w, vdupq_n_u32(0x7c00)), vdupq_n_u32(0x7c00));
        let infnan = vorrq_u32(magnitude, vdupq_n_u32(0x7000_0000));
        let bits = vbslq_u32(special, infnan, vreinterpretq_u32_f32(scaled));
        vreinterpretq_f32_u32(vorrq_u32(bits, sign))
    }
}

/// f16 weights.
pub fn dot_f16(w: &[u8], x: &[f32]) -> f32 {
    dot_16bit(w, x, f16x4_to_f32, smoe_quant::half::f16_bits_to_f32)
}

#[cfg(test)]
mod tests {
    /// Every one of the 65536 halves widens exactly as the scalar conversion does (NaNs as NaNs).
    #[test]
    fn f16_widening_is_exact() {
        for h in 0..=u16::MAX {
            let want = smoe_quant::half::f16_bits_to_f32(h);
            // SAFETY: register-only operations on a lane-filled vector.
            let got = unsafe { std::arch::aarch64::vgetq_lane_f32::<0>(super::f16x4_to_f32(std::arch::aarch64::vdup_n_u16(h))) };
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{h:#06x}: {got} vs {want}");
        }
    }
}
