//! AVX-512 kernels with VNNI (`vpdpbusd`: four u8 × i8 products summed into each i32 lane).
//!
//! Weights that are unsigned in storage (Q4_K nibbles, Q6_K's biased 6-bit quants) go straight
//! into the unsigned operand; signed Q8_0 weights are biased by +128 and the bias is removed
//! through the activation sums.

use crate::act::{Block256, Block32};
use smoe_quant::blocks::{BlockQ4K, BlockQ6K, BlockQ8_0};
use std::arch::x86_64::*;

/// Two 256-bit halves as one 512-bit register.
#[target_feature(enable = "avx512f")]
fn cat(lo: __m256i, hi: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// f32 · f32.
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe fn dot_f32_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (mut s0, mut s1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
    let mut i = 0;
    while i + 32 <= n {
        // SAFETY: i + 32 <= n, so both 16-wide loads are in bounds.
        unsafe {
            s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a.as_ptr().add(i)), _mm512_loadu_ps(b.as_ptr().add(i)), s0);
            s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a.as_ptr().add(i + 16)), _mm512_loadu_ps(b.as_ptr().add(i + 16)), s1);
        }
        i += 32;
    }
    if i + 16 <= n {
        // SAFETY: i + 16 <= n.
        unsafe { s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a.as_ptr().add(i)), _mm512_loadu_ps(b.as_ptr().add(i)), s0) };
        i += 16;
    }
    let mut s = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
}

/// Q8_0 weights, two blocks per 512-bit step.
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512BW and AVX-512 VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn dot_q8_0(w: &[u8], a: &[Block32]) -> f32 {
    let wb: &[BlockQ8_0] = bytemuck::cast_slice(w);
    let n = wb.len().min(a.len());
    let bias = _mm512_set1_epi8(-128);
    let mut acc = _mm512_setzero_ps();
    let mut corr = 0f32;
    let mut i = 0;
    while i + 2 <= n {
        let (b0, b1, a0, a1) = (&wb[i], &wb[i + 1], &a[i], &a[i + 1]);
        // SAFETY: each block holds 32 quants; unaligned loads.
        let (x, y) = unsafe {
            (
                cat(_mm256_loadu_si256(b0.qs.as_ptr() as *const __m256i), _mm256_loadu_si256(b1.qs.as_ptr() as *const __m256i)),
                cat(_mm256_loadu_si256(a0.qs.as_ptr() as *const __m256i), _mm256_loadu_si256(a1.qs.as_ptr() as *const __m256i)),
            )
        };
        // (w + 128) · a, as u8 × i8.
        let p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(x, bias), y);
        let (d0, d1) = (b0.d.to_f32() * a0.d, b1.d.to_f32() * a1.d);
        let d = _mm512_insertf32x8::<1>(_mm512_castps256_ps512(_mm256_set1_ps(d0)), _mm256_set1_ps(d1));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), d, acc);
        corr += 128.0 * (d0 * a0.isum as f32 + d1 * a1.isum as f32);
        i += 2;
    }
    let mut s = _mm512_reduce_add_ps(acc) - corr;
    if i < n {
        s += crate::scalar::dot_q8_0(bytemuck::cast_slice(&wb[i..]), &a[i..]);
    }
    s
}

/// Q4_K weights, two 32-element groups per `vpdpbusd`.
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512BW and AVX-512 VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn dot_q4_k(w: &[u8], a: &[Block256]) -> f32 {
    let wb: &[BlockQ4K] = bytemuck::cast_slice(w);
    let mask = _mm512_set1_epi8(0x0f);
    let mut acc = _mm512_setzero_ps();
    let mut acc_m = 0f32;
    for (b, a) in wb.iter().zip(a) {
        let mut sc = [0i32; 8];
        let mut mins = 0i32;
        for g in 0..8 {
            let (s, m) = smoe_quant::scale_min_k4(g, &b.scales);
            sc[g] = s as i32;
            mins += m as i32 * (a.bsums[2 * g] as i32 + a.bsums[2 * g + 1] as i32);
        }
        let mut sumi = _mm512_setzero_si512();
        for k in 0..2 {
            // 64 bytes of nibbles: low nibbles are groups 4k and 4k+2, high nibbles 4k+1 and 4k+3.
            // SAFETY: qs has 128 bytes (64 per k < 2); activations 256 (128 per k).
            unsafe {
                let q = _mm512_loadu_si512(b.qs.as_ptr().add(64 * k) as *const __m512i);
                let ap = a.qs.as_ptr().add(128 * k);
                let y_lo = cat(_mm256_loadu_si256(ap as *const __m256i), _mm256_loadu_si256(ap.add(64) as *const __m256i));
                let y_hi = cat(_mm256_loadu_si256(ap.add(32) as *const __m256i), _mm256_loadu_si256(ap.add(96) as *const __m256i));
                let lo = _mm512_and_si512(q, mask);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), mask);
                let p_lo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, y_lo);
                let p_hi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, y_hi);
                let s_lo = cat(_mm256_set1_epi32(sc[4 * k]), _mm256_set1_epi32(sc[4 * k + 2]));
                let s_hi = cat(_mm256_set1_epi32(sc[4 * k + 1]), _mm256_set1_epi32(sc[4 * k + 3]));
                sumi = _mm512_add_epi32(sumi, _mm512_add_epi32(_mm512_mullo_epi32(p_lo, s_lo), _mm512_mullo_epi32(p_hi, s_hi)));
            }
        }
        acc = _mm512_fmadd_ps(_mm512_set1_ps(b.d.to_f32() * a.d), _mm512_cvtepi32_ps(sumi), acc);
        acc_m += b.dmin.to_f32() * a.d * mins as f32;
    }
    _mm512_reduce_add_ps(acc) - acc_m
}

/// Q6_K weights, four 16-element groups per `vpdpbusd`.
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512BW and AVX-512 VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub unsafe fn dot_q6_k(w: &[u8], a: &[Block256]) -> f32 {
    let wb: &[BlockQ6K] = bytemuck::cast_slice(w);
    let m4 = _mm512_set1_epi8(0x0f);
    let m2 = _mm512_set1_epi8(0x03);
    let mut acc = _mm512_setzero_ps();
    for (b, a) in wb.iter().zip(a) {
        let mut offset = 0i32;
        for g in 0..16 {
            offset += b.scales[g] as i32 * a.bsums[g] as i32;
        }
        let mut sumi = _mm512_setzero_si512();
        for h in 0..2 {
            // SAFETY: ql has 128 bytes (64 per half), qh 64 (32 per half), activations 256.
            unsafe {
                let ql = _mm512_loadu_si512(b.ql.as_ptr().add(64 * h) as *const __m512i);
                let qh = _mm256_loadu_si256(b.qh.as_ptr().add(32 * h) as *const __m256i);
                // Elements 128h..+64: low nibbles of ql, high bits (qh >> 0, qh >> 2).
                let h01 = cat(qh, _mm256_srli_epi16::<2>(qh));
                let h23 = cat(_mm256_srli_epi16::<4>(qh), _mm256_srli_epi16::<6>(qh));
                let q0 = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_slli_epi16::<4>(_mm512_and_si512(h01, m2)));
                let q1 =
                    _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4), _mm512_slli_epi16::<4>(_mm512_and_si512(h23, m2)));
                for (m, q) in [q0, q1].into_iter().enumerate() {
                    let y = _mm512_loadu_si512(a.qs.as_ptr().add(128 * h + 64 * m) as *const __m512i);
                    let p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, y);
                    let g = 8 * h + 4 * m;
                    let s = _mm512_setr_epi32(
                        b.scales[g] as i32,
                        b.scales[g] as i32,
                        b.scales[g] as i32,
                        b.scales[g] as i32,
                        b.scales[g + 1] as i32,
                        b.scales[g + 1] as i32,
                        b.scales[g + 1] as i32,
                        b.scales[g + 1] as i32,
                        b.scales[g + 2] as i32,
                        b.scales[g + 2] as i32,
                        b.scales[g + 2] as i32,
                        b.scales[g + 2] as i32,
                        b.scales[g + 3] as i32,
                        b.scales[g + 3] as i32,
                        b.scales[g + 3] as i32,
                        b.scales[g + 3] as i32,
                    );
                    sumi = _mm512_add_epi32(sumi, _mm512_mullo_epi32(p, s));
                }
            }
        }
        let total = _mm512_reduce_add_epi32(sumi) - 32 * offset;
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(1, _mm512_set1_ps(b.d.to_f32() * a.d * total as f32)));
    }
    _mm512_reduce_add_ps(acc)
}
