//! AVX2 + FMA kernels.
//!
//! Integer products use `maddubs` (unsigned × signed bytes to i16 pairs), with the sign trick
//! for signed × signed (|w| times a·sign(w)), as ggml does; i16 pairs are widened with `madd`.

use super::{f16x8, k4_scales};
use crate::act::{Block256, Block32};
use smoe_quant::blocks::{BlockQ4K, BlockQ6K, BlockQ8_0};
use std::arch::x86_64::*;

/// Horizontal sum of 8 f32.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps::<1>(v);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Horizontal sum of 8 i32.
#[target_feature(enable = "avx2")]
pub(crate) fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// 32 signed × 32 signed bytes → 8 i32 partial sums.
#[target_feature(enable = "avx2")]
pub(crate) fn mul_sum_i8(x: __m256i, y: __m256i) -> __m256i {
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
}

/// f32 · f32.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_f32_f32(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let mut i = 0;
    while i + 16 <= n {
        // SAFETY: i + 16 <= n, so both 8-wide loads are in bounds.
        unsafe {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_loadu_ps(b.as_ptr().add(i)), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i + 8)), _mm256_loadu_ps(b.as_ptr().add(i + 8)), s1);
        }
        i += 16;
    }
    let mut s = hsum(_mm256_add_ps(s0, s1));
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
}

/// f32 weights (little-endian bytes) · f32.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_f32(w: &[u8], x: &[f32]) -> f32 {
    let n = (w.len() / 4).min(x.len());
    let mut s = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: 8 f32 (32 bytes) from byte 4i are in bounds of w; loadu has no alignment need.
        unsafe { s = _mm256_fmadd_ps(_mm256_loadu_ps(w.as_ptr().add(4 * i) as *const f32), _mm256_loadu_ps(x.as_ptr().add(i)), s) };
        i += 8;
    }
    let mut t = hsum(s);
    while i < n {
        t += f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]]) * x[i];
        i += 1;
    }
    t
}

/// bf16 weights · f32: widen by shifting the 16 bits into the top of each f32.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dot_bf16(w: &[u8], x: &[f32]) -> f32 {
    let n = (w.len() / 2).min(x.len());
    let mut s = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: 8 bf16 (16 bytes) from byte 2i and 8 f32 from i are in bounds.
        unsafe {
            let h = _mm_loadu_si128(w.as_ptr().add(2 * i) as *const __m128i);
            let f = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)));
            s = _mm256_fmadd_ps(f, _mm256_loadu_ps(x.as_ptr().add(i)), s);
        }
        i += 8;
    }
    let mut t = hsum(s);
    while i < n {
        t += smoe_quant::half::bf16_bits_to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])) * x[i];
        i += 1;
    }
    t
}

/// f16 weights · f32 (F16C conversion).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_f16(w: &[u8], x: &[f32]) -> f32 {
    let n = (w.len() / 2).min(x.len());
    let mut s = _mm256_setzero_ps();
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: 8 f16 (16 bytes) from byte 2i and 8 f32 from i are in bounds.
        unsafe {
            let h = _mm_loadu_si128(w.as_ptr().add(2 * i) as *const __m128i);
            s = _mm256_fmadd_ps(_mm256_cvtph_ps(h), _mm256_loadu_ps(x.as_ptr().add(i)), s);
        }
        i += 8;
    }
    let mut t = hsum(s);
    while i < n {
        t += smoe_quant::half::f16_bits_to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])) * x[i];
        i += 1;
    }
    t
}

/// `n` rows of `len` fp16 values, `stride` apart in `src`, to f32 rows of `len` in `dst`,
/// eight at a time with F16C (exact, as the scalar widening).
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn widen_f16(src: &[u16], n: usize, len: usize, stride: usize, dst: &mut [f32]) {
    assert!(n == 0 || ((n - 1) * stride + len <= src.len() && n * len <= dst.len()), "widen_f16: buffers too short");
    let full = len / 8 * 8;
    for r in 0..n {
        let (s, d) = (&src[r * stride..][..len], &mut dst[r * len..][..len]);
        for (d8, s8) in d[..full].chunks_exact_mut(8).zip(s.chunks_exact(8)) {
            // SAFETY: eight f32 into a chunk of eight.
            unsafe { _mm256_storeu_ps(d8.as_mut_ptr(), f16x8(s8.try_into().expect("chunks of eight"))) };
        }
        crate::scalar::widen_f16(&s[full..], 1, len - full, 0, &mut d[full..]);
    }
}

/// [`widen_f16`], sixteen at a time (AVX-512's conversion).
///
/// # Safety
/// The CPU must support AVX-512F.
#[target_feature(enable = "avx512f")]
pub unsafe fn widen_f16_512(src: &[u16], n: usize, len: usize, stride: usize, dst: &mut [f32]) {
    assert!(n == 0 || ((n - 1) * stride + len <= src.len() && n * len <= dst.len()), "widen_f16: buffers too short");
    let full = len / 16 * 16;
    for r in 0..n {
        let (s, d) = (&src[r * stride..][..len], &mut dst[r * len..][..len]);
        for (d16, s16) in d[..full].chunks_exact_mut(16).zip(s.chunks_exact(16)) {
            // SAFETY: sixteen u16 (32 bytes) from a chunk of sixteen, sixteen f32 into one.
            unsafe { _mm512_storeu_ps(d16.as_mut_ptr(), _mm512_cvtph_ps(_mm256_loadu_si256(s16.as_ptr() as *const __m256i))) };
        }
        crate::scalar::widen_f16(&s[full..], 1, len - full, 0, &mut d[full..]);
    }
}

/// f32 to fp16 bits, eight at a time with F16C, rounding to nearest even (the scalar
/// narrowing's bits for every value but a NaN's payload).
///
/// # Safety
/// The CPU must support AVX2 and F16C.
#[target_feature(enable = "avx2,f16c")]
pub unsafe fn narrow_f16(src: &[f32], dst: &mut [u16]) {
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: 8 f32 and 8 u16 from i are in bounds.
        unsafe {
            let h = _mm256_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT }>(_mm256_loadu_ps(src.as_ptr().add(i)));
            _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
        }
        i += 8;
    }
    crate::scalar::narrow_f16(&src[i..n], &mut dst[i..n]);
}

/// Q8_0 weights; scales converted eight blocks at a time, off the accumulation chains.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q8_0(w: &[u8], a: &[Block32]) -> f32 {
    let wb: &[BlockQ8_0] = bytemuck::cast_slice(w);
    let n = wb.len().min(a.len());
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut i = 0;
    while i < n {
        let m = (n - i).min(8);
        let (mut hd, mut ad) = ([0u16; 8], [0f32; 8]);
        for j in 0..m {
            hd[j] = u16::from_le_bytes(wb[i + j].d.0);
            ad[j] = a[i + j].d;
        }
        let mut d = [0f32; 8];
        // SAFETY: 8-element arrays.
        unsafe { _mm256_storeu_ps(d.as_mut_ptr(), _mm256_mul_ps(f16x8(&hd), _mm256_loadu_ps(ad.as_ptr()))) };
        for j in 0..m {
            let (b, a) = (&wb[i + j], &a[i + j]);
            // SAFETY: each block holds exactly 32 quants; loadu has no alignment need.
            let (x, y) =
                unsafe { (_mm256_loadu_si256(b.qs.as_ptr() as *const __m256i), _mm256_loadu_si256(a.qs.as_ptr() as *const __m256i)) };
            let p = _mm256_cvtepi32_ps(mul_sum_i8(x, y));
            acc[j % 4] = _mm256_fmadd_ps(_mm256_set1_ps(d[j]), p, acc[j % 4]);
        }
        i += m;
    }
    hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])))
}

/// Q4_K weights: per pair of groups, 32 bytes of nibbles against 64 activations, each group's
/// i16 products weighted by its 6-bit scale; minimums through the activation block sums.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q4_k(w: &[u8], a: &[Block256]) -> f32 {
    let wb: &[BlockQ4K] = bytemuck::cast_slice(w);
    let mask = _mm256_set1_epi8(0x0f);
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm_setzero_ps();
    let pf = super::prefetch();
    for (b, a) in wb.iter().zip(a) {
        super::prefetch_ahead(b as *const BlockQ4K as *const u8, pf, 144);
        let sm = k4_scales(&b.scales);
        // SAFETY: `sm` has 16 bytes (scales then mins); bsums has 16 i16.
        let (scales16, mins) = unsafe {
            let v = _mm_loadu_si128(sm.as_ptr() as *const __m128i);
            let bs = _mm256_loadu_si256(a.bsums.as_ptr() as *const __m256i);
            // Sum bsums in pairs: one sum per group of 32.
            let pairs = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256::<1>(bs));
            let mins16 = _mm_cvtepu8_epi16(_mm_srli_si128::<8>(v));
            (_mm256_cvtepu8_epi16(v), _mm_madd_epi16(mins16, pairs))
        };
        let mut sc = [0i16; 16];
        // SAFETY: 16 i16 into a 16-element array.
        unsafe { _mm256_storeu_si256(sc.as_mut_ptr() as *mut __m256i, scales16) };
        let mut sumi = _mm256_setzero_si256();
        for c in 0..4 {
            // SAFETY: qs holds 128 bytes (32 per chunk c < 4) and the activations 256 (64 per c).
            let (q, y0, y1) = unsafe {
                (
                    _mm256_loadu_si256(b.qs.as_ptr().add(32 * c) as *const __m256i),
                    _mm256_loadu_si256(a.qs.as_ptr().add(64 * c) as *const __m256i),
                    _mm256_loadu_si256(a.qs.as_ptr().add(64 * c + 32) as *const __m256i),
                )
            };
            let lo = _mm256_and_si256(q, mask);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), mask);
            let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, y0), _mm256_set1_epi16(sc[2 * c]));
            let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, y1), _mm256_set1_epi16(sc[2 * c + 1]));
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(p0, p1));
        }
        let dd = f16x8(&[u16::from_le_bytes(b.d.0), u16::from_le_bytes(b.dmin.0), 0, 0, 0, 0, 0, 0]);
        let dd = _mm_mul_ps(_mm256_castps256_ps128(dd), _mm_set1_ps(a.d));
        acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(dd), _mm256_cvtepi32_ps(sumi), acc);
        acc_m = _mm_fmadd_ps(_mm_permute_ps::<0b01_01_01_01>(dd), _mm_cvtepi32_ps(mins), acc_m);
    }
    let m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    let m = _mm_add_ss(m, _mm_movehdup_ps(m));
    hsum(acc) - _mm_cvtss_f32(m)
}

/// Q6_K weights: quants rebuilt from 4 + 2 bits, offset 32 removed through the activation sums.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot_q6_k(w: &[u8], a: &[Block256]) -> f32 {
    let wb: &[BlockQ6K] = bytemuck::cast_slice(w);
    let m4 = _mm256_set1_epi8(0x0f);
    let m2 = _mm256_set1_epi8(0x03);
    let mut acc = _mm256_setzero_ps();
    for (b, a) in wb.iter().zip(a) {
        let mut sumi = _mm256_setzero_si256();
        let mut offset = 0i32;
        for g in 0..16 {
            offset += b.scales[g] as i32 * a.bsums[g] as i32;
        }
        for h in 0..2 {
            // SAFETY: ql holds 128 bytes (64 per half), qh 64 (32 per half), activations 256.
            unsafe {
                let ql0 = _mm256_loadu_si256(b.ql.as_ptr().add(64 * h) as *const __m256i);
                let ql1 = _mm256_loadu_si256(b.ql.as_ptr().add(64 * h + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(b.qh.as_ptr().add(32 * h) as *const __m256i);
                let q = [
                    _mm256_or_si256(_mm256_and_si256(ql0, m4), _mm256_slli_epi16::<4>(_mm256_and_si256(qh, m2))),
                    _mm256_or_si256(_mm256_and_si256(ql1, m4), _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<2>(qh), m2))),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<4>(qh), m2)),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                        _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<6>(qh), m2)),
                    ),
                ];
                for (j, q) in q.into_iter().enumerate() {
                    let y = _mm256_loadu_si256(a.qs.as_ptr().add(128 * h + 32 * j) as *const __m256i);
                    let p = _mm256_maddubs_epi16(q, y);
                    // Two groups of 16 in this register: scales for the low and high 128 bits.
                    let g = 8 * h + 2 * j;
                    let s = _mm256_setr_m128i(_mm_set1_epi16(b.scales[g] as i16), _mm_set1_epi16(b.scales[g + 1] as i16));
                    sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, s));
                }
            }
        }
        // Quants are stored +32: subtract 32 · Σ scale · Σ activations per group.
        let total = hsum_i32(sumi) - 32 * offset;
        let d = _mm256_cvtss_f32(f16x8(&[u16::from_le_bytes(b.d.0), 0, 0, 0, 0, 0, 0, 0]));
        acc = _mm256_add_ps(acc, _mm256_setr_ps(d * a.d * total as f32, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0));
    }
    hsum(acc)
}
