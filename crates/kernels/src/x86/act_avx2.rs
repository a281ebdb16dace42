//! Per-token work beside the products, with AVX2: quantizing activations to int8 blocks and
//! SwiGLU's `silu(gate) · up`. In decode these ran on the caller while the other threads
//! waited (one token is too little to split): about 1.5–2 ms a token, at any thread count,
//! on the 2-core EPYC and on the 16-core Sapphire Rapids host alike (#23), because the scalar
//! code did not vectorise (a saturating `as i8` per value, a libm `expf` per value).
//!
//! The quantizers give exactly the bits of [`crate::act`]'s scalar ones: the same scale, the
//! same multiply and the same round-to-nearest-even (the 1.5·2²³ add and subtract), and the
//! same saturation (to -128..127, as `as i8` saturates); a NaN quant is 0 in both.

use crate::act::{Block256, Block32};
use std::arch::x86_64::*;

/// The largest `|v|` of `n` vectors (NaN lanes ignored, as `f32::max` ignores them).
#[target_feature(enable = "avx2")]
#[inline]
fn amax(v: &[__m256]) -> f32 {
    let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
    let mut m = _mm256_setzero_ps();
    for &x in v {
        // `max_ps(a, b)` returns `b` when either is NaN: a NaN lane leaves `m` as it was.
        m = _mm256_max_ps(_mm256_and_ps(x, abs), m);
    }
    let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    _mm_cvtss_f32(_mm_max_ss(m2, _mm_movehdup_ps(m2)))
}

/// 32 values times `id`, rounded to nearest even and saturated to i8, in order.
#[target_feature(enable = "avx2")]
#[inline]
fn round_pack(v: [__m256; 4], id: f32) -> __m256i {
    const MAGIC: f32 = 12_582_912.0;
    let (id, magic) = (_mm256_set1_ps(id), _mm256_set1_ps(MAGIC));
    // Plain loops, not closures: a closure is not compiled with this function's features.
    let mut q = [_mm256_setzero_si256(); 4];
    for (q, &x) in q.iter_mut().zip(&v) {
        let t = _mm256_mul_ps(x, id);
        let r = _mm256_sub_ps(_mm256_add_ps(t, magic), magic);
        // Saturated as `as i8` saturates (an infinite product: a scale of 1/denormal), and a
        // NaN product (a NaN or infinite input) becomes 0, as `NaN as i8` does.
        let r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-128.0)), _mm256_set1_ps(127.0));
        let ordered = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_ORD_Q>(t, t));
        *q = _mm256_and_si256(_mm256_cvttps_epi32(r), ordered);
    }
    let lo = _mm256_packs_epi32(q[0], q[1]);
    let hi = _mm256_packs_epi32(q[2], q[3]);
    // packs works within 128-bit lanes: dwords come out as a0 b0 c0 d0 a1 b1 c1 d1.
    _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}

/// Sums of each run of 16 quants: `[Σ q[0..16], Σ q[16..32]]`.
#[target_feature(enable = "avx2")]
#[inline]
fn sums16(q: __m256i) -> [i32; 2] {
    let pairs = _mm256_maddubs_epi16(_mm256_set1_epi8(1), q);
    let quads = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    let s = _mm256_hadd_epi32(quads, quads);
    let s = _mm256_hadd_epi32(s, s);
    [_mm256_extract_epi32::<0>(s), _mm256_extract_epi32::<4>(s)]
}

/// The first `8 N` floats of `x` as `N` vectors.
#[target_feature(enable = "avx2")]
#[inline]
fn load<const N: usize>(x: &[f32]) -> [__m256; N] {
    let x = &x[..8 * N];
    let mut v = [_mm256_setzero_ps(); N];
    for (i, v) in v.iter_mut().enumerate() {
        // SAFETY: `x` holds 8N floats (sliced above): a load of eight at 8i < 8N.
        *v = unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * i)) };
    }
    v
}

/// [`crate::act::quantize_32`] with AVX2 (the same bits).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn quantize_32(x: &[f32], out: &mut [Block32]) {
    for (b, x) in out.iter_mut().zip(x.chunks_exact(32)) {
        let v = load::<4>(x);
        let d = amax(&v) / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let q = round_pack(v, id);
        // SAFETY: 32 bytes into the 32-byte quant array.
        unsafe { _mm256_storeu_si256(b.qs.as_mut_ptr() as *mut __m256i, q) };
        let [s0, s1] = sums16(q);
        let sum = s0 + s1;
        b.d = d;
        b.s = d * sum as f32;
        b.isum = sum;
    }
}

/// [`crate::act::quantize_256`] with AVX2 (the same bits).
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn quantize_256(x: &[f32], out: &mut [Block256]) {
    for (b, x) in out.iter_mut().zip(x.chunks_exact(256)) {
        let v = load::<32>(x);
        let d = amax(&v) / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        for g in 0..8 {
            let q = round_pack([v[4 * g], v[4 * g + 1], v[4 * g + 2], v[4 * g + 3]], id);
            // SAFETY: bytes 32g..32g + 32 of the 256-byte quant array (g < 8).
            unsafe { _mm256_storeu_si256(b.qs.as_mut_ptr().add(32 * g) as *mut __m256i, q) };
            let [s0, s1] = sums16(q);
            // |sum| <= 16 · 128: it fits an i16, as in the scalar sum.
            b.bsums[2 * g] = s0 as i16;
            b.bsums[2 * g + 1] = s1 as i16;
        }
        b.d = d;
    }
}

/// `exp(x)` for any `x`, eight at a time: [`super::attn_tiles`]' softmax exponential (within
/// 2 ulp) up to 88, where `2^127` is the largest power its exponent bits hold: in (88, 88.72]
/// it stays at `exp(88)` (up to 2× low; SwiGLU's outputs there are ~1e-37), infinity beyond
/// `ln(f32::MAX)`, 0 below -87.3 and for NaN (the softmax's clamp drops it; `silu_mul` still
/// gives NaN for NaN through its numerator).
#[target_feature(enable = "avx2,fma")]
#[inline]
fn exp8_any(x: __m256) -> __m256 {
    let clamped = _mm256_min_ps(_mm256_set1_ps(88.0), x);
    let e = super::attn_tiles::exp8(clamped);
    let over = _mm256_cmp_ps::<_CMP_GT_OQ>(x, _mm256_set1_ps(88.722_84));
    _mm256_blendv_ps(e, _mm256_set1_ps(f32::INFINITY), over)
}

/// `g[i] = g[i] / (1 + exp(-g[i])) · u[i]` (SwiGLU's `silu(gate) · up`), eight at a time,
/// the rest through the same arithmetic one by one.
///
/// # Safety
/// The CPU must support AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn silu_mul(g: &mut [f32], u: &[f32]) {
    let n = g.len().min(u.len());
    let full = n / 8 * 8;
    for i in (0..full).step_by(8) {
        // SAFETY: i + 8 <= full <= the length of both slices.
        unsafe {
            let r = silu8(_mm256_loadu_ps(g.as_ptr().add(i)), _mm256_loadu_ps(u.as_ptr().add(i)));
            _mm256_storeu_ps(g.as_mut_ptr().add(i), r);
        }
    }
    for i in full..n {
        let (mut a, mut b) = ([0f32; 8], [0f32; 8]);
        (a[0], b[0]) = (g[i], u[i]);
        // SAFETY: eight floats in and out of local arrays.
        unsafe { _mm256_storeu_ps(a.as_mut_ptr(), silu8(_mm256_loadu_ps(a.as_ptr()), _mm256_loadu_ps(b.as_ptr()))) };
        g[i] = a[0];
    }
}

/// `a / (1 + exp(-a)) · b`, lane by lane.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn silu8(a: __m256, b: __m256) -> __m256 {
    let e = exp8_any(_mm256_xor_ps(a, _mm256_set1_ps(-0.0)));
    _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0), e)), b)
}
