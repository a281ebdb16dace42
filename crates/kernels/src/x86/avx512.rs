//! AVX-512 kernels with VNNI (`vpdpbusd`: four u8 × i8 products summed into each i32 lane).
//!
//! Weights that are unsigned in storage (Q4_K nibbles, Q6_K's biased 6-bit quants) go straight
//! into the unsigned operand; signed Q8_0 weights are biased by +128 and the bias is removed
//! through the activation sums.

use super::f16x8;
use crate::act::{Block256, Block32};
use smoe_quant::blocks::{BlockQ6K, BlockQ8_0};
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

/// Q8_0 weights, one block per 256-bit `vpdpbusd` (AVX-512VL). Scales are converted eight
/// blocks at a time, off the accumulation chains.
///
/// # Safety
/// The CPU must support AVX-512F/BW/VL, AVX-512 VNNI, AVX2, FMA and F16C.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,f16c,fma")]
pub unsafe fn dot_q8_0(w: &[u8], a: &[Block32]) -> f32 {
    let wb: &[BlockQ8_0] = bytemuck::cast_slice(w);
    let n = wb.len().min(a.len());
    let bias = _mm256_set1_epi8(-128);
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut corr = _mm256_setzero_ps();
    let mut i = 0;
    while i < n {
        let m = (n - i).min(8);
        let (mut hd, mut ad, mut sums) = ([0u16; 8], [0f32; 8], [0f32; 8]);
        for ahead in [1024usize, 1088, 1152, 1216, 1280] {
            _mm_prefetch::<_MM_HINT_T0>((wb.as_ptr() as *const i8).wrapping_add(34 * i + ahead));
        }
        for j in 0..m {
            hd[j] = u16::from_le_bytes(wb[i + j].d.0);
            ad[j] = a[i + j].d;
            sums[j] = a[i + j].isum as f32;
        }
        // SAFETY: 8-element arrays.
        let d8 = unsafe { _mm256_mul_ps(f16x8(&hd), _mm256_loadu_ps(ad.as_ptr())) };
        // SAFETY: as above.
        corr = _mm256_fmadd_ps(d8, unsafe { _mm256_loadu_ps(sums.as_ptr()) }, corr);
        let mut d = [0f32; 8];
        // SAFETY: 8-element array.
        unsafe { _mm256_storeu_ps(d.as_mut_ptr(), d8) };
        for j in 0..m {
            let (b, a) = (&wb[i + j], &a[i + j]);
            // SAFETY: each block holds 32 quants; unaligned loads.
            let (x, y) =
                unsafe { (_mm256_loadu_si256(b.qs.as_ptr() as *const __m256i), _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i)) };
            // (w + 128) · a as u8 × i8; the bias is removed through Σa (`corr`).
            let p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_xor_si256(x, bias), y);
            acc[j % 4] = _mm256_fmadd_ps(_mm256_set1_ps(d[j]), _mm256_cvtepi32_ps(p), acc[j % 4]);
        }
        i += m;
    }
    let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
    let v = _mm256_fnmadd_ps(_mm256_set1_ps(128.0), corr, v);
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Q6_K weights, four 16-element groups per `vpdpbusd`.
///
/// # Safety
/// The CPU must support AVX-512F, AVX-512BW and AVX-512 VNNI.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,f16c")]
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
        let d = _mm256_cvtss_f32(f16x8(&[u16::from_le_bytes(b.d.0), 0, 0, 0, 0, 0, 0, 0]));
        acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(1, _mm512_set1_ps(d * a.d * total as f32)));
    }
    _mm512_reduce_add_ps(acc)
}
