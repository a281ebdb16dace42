//! Q8_0 matrices interleaved by eight rows ([`smoe_quant::interleave`]) against one token:
//! eight rows per call, one row per 32-bit lane. The row kernel spends most of its work on
//! per-block reductions and on gathering the block scales of one row; here `vpdpbusd` leaves
//! each row's block sum in its own lane after eight steps, the eight rows' scales load as one
//! vector, and one activation dword is broadcast per step for all eight rows. AVX2 has no
//! `vpdpbusd`: its kernels take the row kernel's sign trick (|w| as u8 × a·sign(w) as i8
//! through `maddubs`, pairs summed by `madd`) on the same layout, so that AVX2 machines, too,
//! give a token the same bits alone, four at a time, and in a batch.

use crate::act::Block32;
use smoe_quant::interleave::Q8_GROUP_BLOCK;
use std::arch::x86_64::*;

/// One group of eight interleaved Q8_0 rows against `T` tokens' activations: `out[t][r]` for
/// the group's row `r` and token `t`. The weights load once per block for all tokens; each
/// token's arithmetic is the same whatever `T` is, so one token alone, four at a time in
/// prefill, and a token in a batch get the same bits.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
fn tokens<const T: usize>(w: &[u8], a: [&[Block32]; T], out: [&mut [f32; 8]; T]) {
    let blocks = a.iter().fold(w.len() / Q8_GROUP_BLOCK, |n, a| n.min(a.len()));
    let bias = _mm256_set1_epi8(-128);
    let (mut acc, mut corr) = ([_mm256_setzero_ps(); T], [_mm256_setzero_ps(); T]);
    let pf = if T > 1 { super::prefetch_many() } else { super::prefetch() };
    for b in 0..blocks {
        let p = w[b * Q8_GROUP_BLOCK..(b + 1) * Q8_GROUP_BLOCK].as_ptr();
        super::prefetch_ahead(p, pf, Q8_GROUP_BLOCK);
        // SAFETY: every offset lies inside the 272-byte group block (its slicing checks the
        // length) and, for the activations, inside block `b` < `blocks` of each token.
        unsafe {
            // (w + 128) as u8 × a as i8; the bias comes off through `corr` (d·Σa).
            let mut wk = [_mm256_setzero_si256(); 8];
            for (k, wk) in wk.iter_mut().enumerate() {
                *wk = _mm256_xor_si256(_mm256_loadu_si256(p.add(16 + 32 * k) as *const __m256i), bias);
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
            for t in 0..T {
                let ab = &a[t][b];
                let q = ab.qs.as_ptr() as *const u8;
                // Four running sums, so that consecutive `vpdpbusd` do not wait on each other.
                let mut s = [_mm256_setzero_si256(); 4];
                for (k, &wk) in wk.iter().enumerate() {
                    let ak = _mm256_set1_epi32((q.add(4 * k) as *const i32).read_unaligned());
                    s[k % 4] = _mm256_dpbusd_epi32(s[k % 4], wk, ak);
                }
                let sum = _mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3]));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, _mm256_set1_ps(ab.d)), acc[t]);
                corr[t] = _mm256_fmadd_ps(dw, _mm256_set1_ps(ab.s), corr[t]);
            }
        }
    }
    for (t, o) in out.into_iter().enumerate() {
        let v = _mm256_fnmadd_ps(_mm256_set1_ps(128.0), corr[t], acc[t]);
        // SAFETY: eight floats into an eight-float array.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), v) };
    }
}

/// One group of eight interleaved Q8_0 rows against activations `a`: `out[r]` for the group's
/// row `r`.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C and AVX-512 VNNI with VL.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn dot8_vnni(w: &[u8], a: &[Block32], out: &mut [f32; 8]) {
    tokens::<1>(w, [a], [out]);
}

/// [`dot8_vnni`] for four tokens at once (the same bits per token).
///
/// # Safety
/// As for [`dot8_vnni`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub unsafe fn dot8x4_vnni(w: &[u8], a: [&[Block32]; 4], out: [&mut [f32; 8]; 4]) {
    tokens::<4>(w, a, out);
}

/// [`tokens`] with AVX2 only: per dword step, `maddubs` of the rows' magnitudes (|w| ≤ 128 as
/// u8, taken once per block for all tokens) against the activations carrying the weights'
/// signs (|a| ≤ 127: a pair sums to at most 2 · 128 · 127 = 32,512, inside i16), then `madd`
/// to one i32 per row. Exact integer sums, so no bias correction.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn tokens_avx2<const T: usize>(w: &[u8], a: [&[Block32]; T], out: [&mut [f32; 8]; T]) {
    let blocks = a.iter().fold(w.len() / Q8_GROUP_BLOCK, |n, a| n.min(a.len()));
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); T];
    let pf = if T > 1 { super::prefetch_many() } else { super::prefetch() };
    for b in 0..blocks {
        let p = w[b * Q8_GROUP_BLOCK..(b + 1) * Q8_GROUP_BLOCK].as_ptr();
        super::prefetch_ahead(p, pf, Q8_GROUP_BLOCK);
        // SAFETY: every offset lies inside the 272-byte group block (its slicing checks the
        // length) and, for the activations, inside block `b` < `blocks` of each token.
        unsafe {
            let (mut wk, mut mag) = ([_mm256_setzero_si256(); 8], [_mm256_setzero_si256(); 8]);
            for k in 0..8 {
                wk[k] = _mm256_loadu_si256(p.add(16 + 32 * k) as *const __m256i);
                mag[k] = _mm256_sign_epi8(wk[k], wk[k]);
            }
            let dw = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
            for t in 0..T {
                let ab = &a[t][b];
                let q = ab.qs.as_ptr() as *const u8;
                // Two running sums, so that consecutive adds do not wait on each other.
                let mut s = [_mm256_setzero_si256(); 2];
                for k in 0..8 {
                    let ak = _mm256_set1_epi32((q.add(4 * k) as *const i32).read_unaligned());
                    let pairs = _mm256_maddubs_epi16(mag[k], _mm256_sign_epi8(ak, wk[k]));
                    s[k % 2] = _mm256_add_epi32(s[k % 2], _mm256_madd_epi16(pairs, ones));
                }
                let sum = _mm256_add_epi32(s[0], s[1]);
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(dw, _mm256_set1_ps(ab.d)), acc[t]);
            }
        }
    }
    for (t, o) in out.into_iter().enumerate() {
        // SAFETY: eight floats into an eight-float array.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), acc[t]) };
    }
}

/// [`dot8_vnni`] with AVX2 only.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot8_avx2(w: &[u8], a: &[Block32], out: &mut [f32; 8]) {
    tokens_avx2::<1>(w, [a], [out]);
}

/// [`dot8_avx2`] for four tokens at once (the same bits per token).
///
/// # Safety
/// As for [`dot8_avx2`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot8x4_avx2(w: &[u8], a: [&[Block32]; 4], out: [&mut [f32; 8]; 4]) {
    tokens_avx2::<4>(w, a, out);
}
