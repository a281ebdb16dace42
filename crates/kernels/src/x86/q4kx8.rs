//! Q4_K matrices interleaved by eight rows ([`smoe_quant::interleave`]) against one to three
//! tokens: eight rows per call, one row per 32-bit lane. Group scales and minimums then apply as
//! vectors of eight rows, and there is no per-row reduction; ggml's repacked Q4_K kernels work
//! the same way. In cache this is ~2.2x the row kernel; decode, which streams weights from
//! DRAM, gains what the memory system allows.

use crate::act::Block256;
use smoe_quant::interleave::GROUP_BLOCK;
use std::arch::x86_64::*;

/// One group of eight interleaved rows (`blocks` super-blocks) against `T` tokens' activations
/// `a`: `out[t][r]` for the group's row `r` and token `t`, each token's arithmetic the same
/// whatever `T` is. `acc(p, w, a)` adds the products of 32 weight bytes (eight
/// rows' dwords, unsigned) with one activation dword broadcast, as i32 per row.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn body<const T: usize>(w: &[u8], a: [&[Block256]; T], out: [&mut [f32; 8]; T], acc: impl Fn(__m256i, __m256i, __m256i) -> __m256i) {
    let blocks = a.iter().fold(w.len() / GROUP_BLOCK, |n, a| n.min(a.len()));
    let m4 = _mm256_set1_epi8(0x0f);
    let m30 = _mm256_set1_epi8(0x30);
    let m63 = _mm256_set1_epi8(63);
    let (mut total, mut totalm) = ([_mm256_setzero_ps(); T], [_mm256_setzero_ps(); T]);
    let pf = super::prefetch();
    for b in 0..blocks {
        let g = &w[b * GROUP_BLOCK..(b + 1) * GROUP_BLOCK];
        let p = g.as_ptr();
        super::prefetch_ahead(p, pf, GROUP_BLOCK);
        // Each token's block `b` (b < blocks <= every a[t].len()), indexed once per block.
        let ab: [&Block256; T] = std::array::from_fn(|t| &a[t][b]);
        // SAFETY: every offset below lies inside the 1152-byte group block `g` (asserted by
        // its slicing) and the activation block (256 quants).
        unsafe {
            // The eight rows' scales and mins, `[scale or min i][row]`, unpacked as in Q4_K:
            // for i < 4 the low six bits of bytes i and i + 4; above, a nibble of byte i + 4
            // with the top bits of bytes i - 4 and i.
            let y0 = _mm256_loadu_si256(p.add(32) as *const __m256i);
            let y1 = _mm256_loadu_si256(p.add(64) as *const __m256i);
            let y2 = _mm256_loadu_si256(p.add(96) as *const __m256i);
            let mut sc = [0u8; 64];
            let mut mn = [0u8; 64];
            _mm256_storeu_si256(sc.as_mut_ptr() as *mut __m256i, _mm256_and_si256(y0, m63));
            _mm256_storeu_si256(
                sc.as_mut_ptr().add(32) as *mut __m256i,
                _mm256_or_si256(_mm256_and_si256(y2, m4), _mm256_and_si256(_mm256_srli_epi16::<2>(y0), m30)),
            );
            _mm256_storeu_si256(mn.as_mut_ptr() as *mut __m256i, _mm256_and_si256(y1, m63));
            _mm256_storeu_si256(
                mn.as_mut_ptr().add(32) as *mut __m256i,
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(y2), m4), _mm256_and_si256(_mm256_srli_epi16::<2>(y1), m30)),
            );
            let q = p.add(128);
            let (mut sumi, mut mins) = ([_mm256_setzero_si256(); T], [_mm256_setzero_si256(); T]);
            for c in 0..4 {
                // The weights are loaded and unpacked once for every token; each token's sums
                // are then exactly what it gets alone.
                let (mut plo, mut phi) = ([_mm256_setzero_si256(); T], [_mm256_setzero_si256(); T]);
                for k in 0..8 {
                    let v = _mm256_loadu_si256(q.add((c * 8 + k) * 32) as *const __m256i);
                    let lo = _mm256_and_si256(v, m4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                    for (t, ab) in ab.iter().enumerate() {
                        let aq = ab.qs.as_ptr() as *const u8;
                        plo[t] = acc(plo[t], lo, _mm256_set1_epi32((aq.add(64 * c + 4 * k) as *const i32).read_unaligned()));
                        phi[t] = acc(phi[t], hi, _mm256_set1_epi32((aq.add(64 * c + 32 + 4 * k) as *const i32).read_unaligned()));
                    }
                }
                let lanes = |t: &[u8; 64], i: usize| _mm256_cvtepu8_epi32(_mm_loadl_epi64(t.as_ptr().add(8 * i) as *const __m128i));
                let (sc0, sc1) = (lanes(&sc, 2 * c), lanes(&sc, 2 * c + 1));
                let (mn0, mn1) = (lanes(&mn, 2 * c), lanes(&mn, 2 * c + 1));
                for (t, ab) in ab.iter().enumerate() {
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_add_epi32(_mm256_mullo_epi32(plo[t], sc0), _mm256_mullo_epi32(phi[t], sc1)));
                    // Minimums against the activation sums of the two groups of 32.
                    let s0 = ab.bsums[4 * c] as i32 + ab.bsums[4 * c + 1] as i32;
                    let s1 = ab.bsums[4 * c + 2] as i32 + ab.bsums[4 * c + 3] as i32;
                    mins[t] = _mm256_add_epi32(
                        mins[t],
                        _mm256_add_epi32(_mm256_mullo_epi32(mn0, _mm256_set1_epi32(s0)), _mm256_mullo_epi32(mn1, _mm256_set1_epi32(s1))),
                    );
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i));
            for (t, ab) in ab.iter().enumerate() {
                let ad = _mm256_set1_ps(ab.d);
                total[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[t]), _mm256_mul_ps(d, ad), total[t]);
                totalm[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins[t]), _mm256_mul_ps(dmin, ad), totalm[t]);
            }
        }
    }
    for (t, o) in out.into_iter().enumerate() {
        // SAFETY: 8 floats into an 8-float array.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), _mm256_sub_ps(total[t], totalm[t])) };
    }
}

/// Eight interleaved Q4_K rows against one token, with VNNI.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512VL and AVX-512 VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn dot8_vnni(w: &[u8], a: &[Block256], out: &mut [f32; 8]) {
    body(w, [a], [out], |p, x, y| _mm256_dpbusd_epi32(p, x, y))
}

/// [`dot8_vnni`] for two tokens at once (the same bits per token): a batch's experts chosen by
/// two or three tokens load and unpack their weights once.
///
/// # Safety
/// As for [`dot8_vnni`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn dot8x2_vnni(w: &[u8], a: [&[Block256]; 2], out: [&mut [f32; 8]; 2]) {
    body(w, a, out, |p, x, y| _mm256_dpbusd_epi32(p, x, y))
}

/// [`dot8_vnni`] for three tokens at once (the same bits per token).
///
/// # Safety
/// As for [`dot8_vnni`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn dot8x3_vnni(w: &[u8], a: [&[Block256]; 3], out: [&mut [f32; 8]; 3]) {
    body(w, a, out, |p, x, y| _mm256_dpbusd_epi32(p, x, y))
}

/// Eight interleaved Q4_K rows against one token, with AVX2: `maddubs` pairs (at most
/// 2·15·127, no saturation) widened by `madd`.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot8_avx2(w: &[u8], a: &[Block256], out: &mut [f32; 8]) {
    body(w, [a], [out], |p, x, y| _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1))))
}

/// [`dot8_avx2`] for two tokens at once (the same bits per token).
///
/// # Safety
/// As for [`dot8_avx2`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot8x2_avx2(w: &[u8], a: [&[Block256]; 2], out: [&mut [f32; 8]; 2]) {
    body(w, a, out, |p, x, y| _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1))))
}

/// [`dot8_avx2`] for three tokens at once (the same bits per token).
///
/// # Safety
/// As for [`dot8_avx2`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn dot8x3_avx2(w: &[u8], a: [&[Block256]; 3], out: [&mut [f32; 8]; 3]) {
    body(w, a, out, |p, x, y| _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1))))
}
