//! NEON kernels for the formats GGUF imports bring (Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q5_K)
//! and gpt-oss's MXFP4 experts.
//! Each unpacks its quants to signed bytes in registers and reuses [`mla16`]; every product
//! pair fits an i16 (|q| ≤ 31, |a| ≤ 127).

use super::neon::mla16;
use crate::act::{Block256, Block32};
use smoe_quant::blocks::{BlockMxfp4, BlockMxfp8, BlockQ2K, BlockQ3K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1};
use smoe_quant::{scale_min_k4, unpack_q3_scales};
use std::arch::aarch64::*;

/// The 32 quants of a 4-bit block as two signed 16-byte halves (elements 0..16, 16..32).
#[inline(always)]
fn nibbles(qs: &[u8; 16]) -> (int8x16_t, int8x16_t) {
    // SAFETY: one 16-byte load from a 16-byte array; the rest is register-only.
    unsafe {
        let q = vld1q_u8(qs.as_ptr());
        (vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(0x0f))), vreinterpretq_s8_u8(vshrq_n_u8::<4>(q)))
    }
}

/// The fifth bit of a Q5 block's 32 quants, as 0 or 16 per byte (elements 0..16, 16..32).
#[inline(always)]
fn fifth_bits(qh: [u8; 4]) -> (int8x16_t, int8x16_t) {
    const LO: [u8; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1];
    const HI: [u8; 16] = [2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3];
    const BIT: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    // SAFETY: 16-byte loads of 16-byte constants; the rest is register-only.
    unsafe {
        let h = vreinterpretq_u8_u32(vdupq_n_u32(u32::from_le_bytes(qh)));
        let (bit, sixteen) = (vld1q_u8(BIT.as_ptr()), vdupq_n_u8(16));
        let lo = vandq_u8(vtstq_u8(vqtbl1q_u8(h, vld1q_u8(LO.as_ptr())), bit), sixteen);
        let hi = vandq_u8(vtstq_u8(vqtbl1q_u8(h, vld1q_u8(HI.as_ptr())), bit), sixteen);
        (vreinterpretq_s8_u8(lo), vreinterpretq_s8_u8(hi))
    }
}

/// Σ q·a over one 32-block given its two unpacked halves.
#[inline(always)]
fn dot32(lo: int8x16_t, hi: int8x16_t, a: &Block32) -> i32 {
    // SAFETY: two 16-byte loads from the 32 activation quants.
    unsafe {
        let acc = mla16(vdupq_n_s32(0), lo, vld1q_s8(a.qs.as_ptr()));
        vaddvq_s32(mla16(acc, hi, vld1q_s8(a.qs.as_ptr().add(16))))
    }
}

/// Q4_0 weights (value = (q − 8)·d).
pub fn dot_q4_0(w: &[u8], a: &[Block32]) -> f32 {
    let wb: &[BlockQ4_0] = bytemuck::cast_slice(w);
    let mut s = 0f32;
    for (b, a) in wb.iter().zip(a) {
        let (lo, hi) = nibbles(&b.qs);
        // SAFETY: register-only arithmetic.
        let (lo, hi) = unsafe { (vsubq_s8(lo, vdupq_n_s8(8)), vsubq_s8(hi, vdupq_n_s8(8))) };
        s += b.d.to_f32() * a.d * dot32(lo, hi, a) as f32;
    }
    s
}

/// MXFP4 weights: each 4-bit code looked up in the e2m1 table (doubled to integers, |v| ≤ 12),
/// times half the block's e8m0 scale; the same per-block arithmetic as the scalar kernel.
pub fn dot_mxfp4(w: &[u8], a: &[Block32]) -> f32 {
    let wb: &[BlockMxfp4] = bytemuck::cast_slice(w);
    // SAFETY: one 16-byte load of the 16-entry table.
    let table = unsafe { vld1q_s8(smoe_quant::KVALUES_MXFP4.as_ptr()) };
    let mut s = 0f32;
    for (b, a) in wb.iter().zip(a) {
        let (lo, hi) = nibbles(&b.qs);
        // SAFETY: register-only table lookups (indices < 16).
        let (lo, hi) = unsafe { (vqtbl1q_s8(table, vreinterpretq_u8_s8(lo)), vqtbl1q_s8(table, vreinterpretq_u8_s8(hi))) };
        s += smoe_quant::e8m0_to_f32_half(b.e) * a.d * dot32(lo, hi, a) as f32;
    }
    s
}

/// MXFP8 weights: the e4m3 codes widened to 32-bit lanes four at a time and turned into
/// their values times 512 (`m` below the normal range, `(8 + m) << (E − 1)` above), signed,
/// multiplied with the widened int8 activations and summed per block in i32, as the scalar
/// kernel; then the block's e8m0 scale times 2^−9.
pub fn dot_mxfp8(w: &[u8], a: &[Block32]) -> f32 {
    let wb: &[BlockMxfp8] = bytemuck::cast_slice(w);
    let mut s = 0f32;
    for (b, a) in wb.iter().zip(a) {
        s += smoe_quant::e8m0_to_f32_half(b.e) * (1.0 / 256.0) * a.d * e4m3_isum(&b.qs, a) as f32;
    }
    s
}

/// FP8 weights: each 32 codes against their activation block summed exactly as in
/// [`dot_mxfp8`], the four sums weighted by their activation scales, times the block's f32
/// scale and 2^−9 (as the scalar kernel, in the same order).
pub fn dot_fp8(w: &[u8], a: &[Block32]) -> f32 {
    crate::scalar::fp8_blocks(w, a, e4m3_isum)
}

/// 32 e4m3 codes times 512 against one int8 activation block, summed exactly in i32: the codes
/// widened to 32-bit lanes four at a time and turned into their values times 512 (`m` below
/// the normal range, `(8 + m) << (E − 1)` above), signed, multiplied with the widened
/// activations.
fn e4m3_isum(qs: &[u8; 32], a: &Block32) -> i32 {
    // SAFETY: 16-byte loads at offsets 0 and 16 of 32-byte arrays; the rest is register
    // arithmetic.
    unsafe {
        let mut acc = vdupq_n_s32(0);
        for c in 0..2 {
            let q = vld1q_u8(qs.as_ptr().add(16 * c));
            let x = vld1q_s8(a.qs.as_ptr().add(16 * c));
            let (q16, x16) = ([vmovl_u8(vget_low_u8(q)), vmovl_u8(vget_high_u8(q))], [vmovl_s8(vget_low_s8(x)), vmovl_s8(vget_high_s8(x))]);
            for h in 0..2 {
                let quads = [
                    (vmovl_u16(vget_low_u16(q16[h])), vmovl_s16(vget_low_s16(x16[h]))),
                    (vmovl_u16(vget_high_u16(q16[h])), vmovl_s16(vget_high_s16(x16[h]))),
                ];
                for (qq, xx) in quads {
                    let qi = vreinterpretq_s32_u32(qq);
                    let e = vandq_s32(vshrq_n_s32::<3>(qi), vdupq_n_s32(15));
                    let m = vandq_s32(qi, vdupq_n_s32(7));
                    // A shift by −1 (e = 0) shifts right; those lanes take `m` below.
                    let normal = vshlq_s32(vaddq_s32(m, vdupq_n_s32(8)), vsubq_s32(e, vdupq_n_s32(1)));
                    let mag = vbslq_s32(vceqq_s32(e, vdupq_n_s32(0)), m, normal);
                    let v = vbslq_s32(vcgtq_s32(qi, vdupq_n_s32(127)), vnegq_s32(mag), mag);
                    acc = vmlaq_s32(acc, v, xx);
                }
            }
        }
        vaddvq_s32(acc)
    }
}

/// Q4_1 weights (value = q·d + m).
pub fn dot_q4_1(w: &[u8], a: &[Block32]) -> f32 {
    let wb: &[BlockQ4_1] = bytemuck::cast_slice(w);
    let mut s = 0f32;
    for (b, a) in wb.iter().zip(a) {
        let (lo, hi) = nibbles(&b.qs);
        s += b.d.to_f32() * a.d * dot32(lo, hi, a) as f32 + b.m.to_f32() * a.s;
    }
    s
}

/// Q5_0 weights (value = (q − 16)·d).
pub fn dot_q5_0(w: &[u8], a: &[Block32]) -> f32 {
    let wb: &[BlockQ5_0] = bytemuck::cast_slice(w);
    let mut s = 0f32;
    for (b, a) in wb.iter().zip(a) {
        let ((lo, hi), (hlo, hhi)) = (nibbles(&b.qs), fifth_bits(b.qh));
        // SAFETY: register-only arithmetic.
        let (lo, hi) = unsafe {
            let sixteen = vdupq_n_s8(16);
            (vsubq_s8(vorrq_s8(lo, hlo), sixteen), vsubq_s8(vorrq_s8(hi, hhi), sixteen))
        };
        s += b.d.to_f32() * a.d * dot32(lo, hi, a) as f32;
    }
    s
}

/// Q5_1 weights (value = q·d + m).
pub fn dot_q5_1(w: &[u8], a: &[Block32]) -> f32 {
    let wb: &[BlockQ5_1] = bytemuck::cast_slice(w);
    let mut s = 0f32;
    for (b, a) in wb.iter().zip(a) {
        let ((lo, hi), (hlo, hhi)) = (nibbles(&b.qs), fifth_bits(b.qh));
        // SAFETY: register-only arithmetic.
        let (lo, hi) = unsafe { (vorrq_s8(lo, hlo), vorrq_s8(hi, hhi)) };
        s += b.d.to_f32() * a.d * dot32(lo, hi, a) as f32 + b.m.to_f32() * a.s;
    }
    s
}

/// Σ q·a over 16 quants against activations `a.qs[at..at + 16]`.
#[inline(always)]
fn dot16(q: int8x16_t, a: &Block256, at: usize) -> i32 {
    assert!(at + 16 <= a.qs.len());
    // SAFETY: the assert keeps the 16-byte load inside the activation quants.
    unsafe { vaddvq_s32(mla16(vdupq_n_s32(0), q, vld1q_s8(a.qs.as_ptr().add(at)))) }
}

/// Q5_K weights: `d·sc·q − dmin·m` per group of 32, q = low nibble | fifth bit from `qh`.
pub fn dot_q5_k(w: &[u8], a: &[Block256]) -> f32 {
    let wb: &[BlockQ5K] = bytemuck::cast_slice(w);
    let mut total = 0f32;
    for (b, a) in wb.iter().zip(a) {
        let (mut sumi, mut summ) = (0i32, 0i32);
        for g in 0..8 {
            summ += scale_min_k4(g, &b.scales).1 as i32 * (a.bsums[2 * g] as i32 + a.bsums[2 * g + 1] as i32);
        }
        for c in 0..4 {
            let (s_lo, s_hi) = (scale_min_k4(2 * c, &b.scales).0 as i32, scale_min_k4(2 * c + 1, &b.scales).0 as i32);
            let (mut lo, mut hi) = (0, 0);
            for half in 0..2 {
                // SAFETY: 16-byte loads at 32c + 16·half (< 128) of qs and 16·half (< 32) of qh.
                let (ql, qh) = unsafe {
                    let q = vld1q_u8(b.qs.as_ptr().add(32 * c + 16 * half));
                    let h = vld1q_u8(b.qh.as_ptr().add(16 * half));
                    let sixteen = vdupq_n_u8(16);
                    let bit_lo = vandq_u8(vtstq_u8(h, vdupq_n_u8(1 << (2 * c))), sixteen);
                    let bit_hi = vandq_u8(vtstq_u8(h, vdupq_n_u8(2 << (2 * c))), sixteen);
                    (
                        vreinterpretq_s8_u8(vorrq_u8(vandq_u8(q, vdupq_n_u8(0x0f)), bit_lo)),
                        vreinterpretq_s8_u8(vorrq_u8(vshrq_n_u8::<4>(q), bit_hi)),
                    )
                };
                lo += dot16(ql, a, 64 * c + 16 * half);
                hi += dot16(qh, a, 64 * c + 32 + 16 * half);
            }
            sumi += s_lo * lo + s_hi * hi;
        }
        total += a.d * (b.d.to_f32() * sumi as f32 - b.dmin.to_f32() * summ as f32);
    }
    total
}

/// The 2-bit field at `shift` of 16 bytes of `qs` starting at `at`.
#[inline(always)]
fn crumbs(qs: &[u8], at: usize, shift: usize) -> uint8x16_t {
    assert!(at + 16 <= qs.len());
    // SAFETY: the assert keeps the load in bounds; a variable shift goes through vshlq.
    unsafe { vandq_u8(vshlq_u8(vld1q_u8(qs.as_ptr().add(at)), vdupq_n_s8(-(shift as i8))), vdupq_n_u8(3)) }
}

/// Q2_K weights: `d·(sc & 15)·q − dmin·(sc >> 4)` per group of 16.
pub fn dot_q2_k(w: &[u8], a: &[Block256]) -> f32 {
    let wb: &[BlockQ2K] = bytemuck::cast_slice(w);
    let mut total = 0f32;
    for (b, a) in wb.iter().zip(a) {
        let (mut sumi, mut summ) = (0i32, 0i32);
        for g in 0..16 {
            summ += (b.scales[g] >> 4) as i32 * a.bsums[g] as i32;
        }
        for half in 0..2 {
            for j in 0..4 {
                for l16 in 0..2 {
                    let e = 128 * half + 32 * j + 16 * l16;
                    // SAFETY: register-only reinterpretation.
                    let q = unsafe { vreinterpretq_s8_u8(crumbs(&b.qs, 32 * half + 16 * l16, 2 * j)) };
                    sumi += (b.scales[e / 16] & 15) as i32 * dot16(q, a, e);
                }
            }
        }
        total += a.d * (b.d.to_f32() * sumi as f32 - b.dmin.to_f32() * summ as f32);
    }
    total
}

/// Q3_K weights: `d·sc·q` per group of 16, q = low 2 bits − 4 where the `hmask` bit is clear.
pub fn dot_q3_k(w: &[u8], a: &[Block256]) -> f32 {
    let wb: &[BlockQ3K] = bytemuck::cast_slice(w);
    let mut total = 0f32;
    for (b, a) in wb.iter().zip(a) {
        let sc = unpack_q3_scales(&b.scales);
        let mut sumi = 0i32;
        for half in 0..2 {
            for j in 0..4 {
                let m = 1u8 << (4 * half + j);
                for l16 in 0..2 {
                    let e = 128 * half + 32 * j + 16 * l16;
                    let low = crumbs(&b.qs, 32 * half + 16 * l16, 2 * j);
                    // SAFETY: a 16-byte load at 16·l16 (< 32) of hmask; register-only otherwise.
                    let q = unsafe {
                        let set = vtstq_u8(vld1q_u8(b.hmask.as_ptr().add(16 * l16)), vdupq_n_u8(m));
                        vsubq_s8(vreinterpretq_s8_u8(low), vreinterpretq_s8_u8(vbicq_u8(vdupq_n_u8(4), set)))
                    };
                    sumi += sc[e / 16] as i32 * dot16(q, a, e);
                }
            }
        }
        total += a.d * b.d.to_f32() * sumi as f32;
    }
    total
}
