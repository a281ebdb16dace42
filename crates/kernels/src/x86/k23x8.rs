//! Q2_K and Q3_K matrices interleaved by eight rows ([`smoe_quant::interleave`]) against one
//! token: eight rows per call, one row per 32-bit lane, as the Q4_K group kernel
//! ([`super::q4kx8`]). Each 16-element group's sum collects in its own accumulator (at most
//! 16·7·127 in magnitude, so an i16), two groups' sums are packed as i16 pairs and take their
//! two scales in one `madd`; the minimums (Q2_K) and the −4 of Q3_K's quants come off through
//! the activation's 16-element sums, also by pairs. Decode of a 235B-shape model spends half
//! its time in these products; the row kernels reduce every row and shuffle every group's
//! scale once per 32 weights and row.
//!
//! Each row's integer sum per super-block is the row kernel's exactly; the float accumulation
//! across super-blocks is per row instead of per lane, so results agree with the row kernels
//! to rounding (the same tolerance as the Q4_K group kernel's tests).

use crate::act::Block256;
use smoe_quant::interleave::{Q2_GROUP_BLOCK, Q3_GROUP_BLOCK};
use std::arch::x86_64::*;

/// `v` shifted right by `2j` bits in each 16-bit lane (`j` < 4, a caller's const parameter); a
/// byte's bits `2j, 2j + 1` land in its bits 0 and 1.
#[target_feature(enable = "avx2")]
#[inline]
fn shr2(v: __m256i, j: usize) -> __m256i {
    match j {
        0 => v,
        1 => _mm256_srli_epi16::<2>(v),
        2 => _mm256_srli_epi16::<4>(v),
        _ => _mm256_srli_epi16::<6>(v),
    }
}

/// `v` with each byte's bit `b` (`b` < 8, from a caller's const parameters) moved to bit 2, other bits
/// anywhere (callers mask with 4): shifts of at most 5 keep a byte's own bits in place.
#[target_feature(enable = "avx2")]
#[inline]
fn bit_to_2(v: __m256i, b: usize) -> __m256i {
    match b {
        0 => _mm256_slli_epi16::<2>(v),
        1 => _mm256_slli_epi16::<1>(v),
        2 => v,
        3 => _mm256_srli_epi16::<1>(v),
        4 => _mm256_srli_epi16::<2>(v),
        5 => _mm256_srli_epi16::<3>(v),
        6 => _mm256_srli_epi16::<4>(v),
        _ => _mm256_srli_epi16::<5>(v),
    }
}

/// Two groups' per-row sums (`lo`, `hi`: i32 per row, each within i16) as i16 pairs per row,
/// `lo` in the low half: ready for one `madd` against the pair's scales.
#[target_feature(enable = "avx2")]
#[inline]
fn pair(lo: __m256i, hi: __m256i) -> __m256i {
    _mm256_blend_epi16::<0xAA>(lo, _mm256_slli_epi32::<16>(hi))
}

/// The activation's 16-element sums of groups `2p` and `2p + 1` in every 32-bit lane.
#[target_feature(enable = "avx2")]
#[inline]
fn bsum_pair(a: &Block256, p: usize) -> __m256i {
    assert!(p < 8);
    // SAFETY: p < 8 (asserted), so the two i16 at 2p lie inside the 16 sums.
    unsafe { _mm256_set1_epi32((a.bsums.as_ptr().add(2 * p) as *const i32).read_unaligned()) }
}

/// Activation quants `at..at + 4` as one dword in every lane.
#[target_feature(enable = "avx2")]
#[inline]
fn act4(a: &Block256, at: usize) -> __m256i {
    assert!(at + 4 <= 256);
    // SAFETY: checked just above: four bytes inside the 256 quants.
    unsafe { _mm256_set1_epi32((a.qs.as_ptr().add(at) as *const i32).read_unaligned()) }
}

/// The 32 bytes at `p + at` (a load of eight rows' dwords).
///
/// # Safety
/// `p + at .. p + at + 32` must be readable, and the CPU must support AVX.
#[inline(always)]
unsafe fn load(p: *const u8, at: usize) -> __m256i {
    // SAFETY: the caller's.
    unsafe { _mm256_loadu_si256(p.add(at) as *const __m256i) }
}

/// Groups `8H + 2J` and `8H + 2J + 1` of eight Q2_K rows (group block `g`): their sums
/// times their scales added to `sm[0]`, their minimums times the activation's group sums to
/// `sm[1]`. Generic in the half `H` and bit pair `J`, so that every shift is a constant
/// whether or not the compiler unrolls the caller.
#[target_feature(enable = "avx2")]
#[inline]
fn q2_pair<const H: usize, const J: usize>(
    g: &[u8; Q2_GROUP_BLOCK],
    ab: &Block256,
    acc: &impl Fn(__m256i, __m256i, __m256i) -> __m256i,
    sm: &mut [__m256i; 2],
) {
    let (m3, p) = (_mm256_set1_epi8(3), g.as_ptr());
    // Dword k = 8H + kk of each row's quants holds, at bits 2J, elements 128H + 32J + 4kk +
    // 0..3: group 8H + 2J for kk < 4, the next for kk ≥ 4.
    let (mut s0, mut s1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
    for kk in 0..4 {
        // SAFETY: the quants start 160 bytes into the 672-byte group block `g` and hold 16
        // dwords of eight rows (8H + kk + 4 < 16, as H < 2 and kk < 4).
        let (v0, v1) = unsafe { (load(p, 160 + (8 * H + kk) * 32), load(p, 160 + (8 * H + kk + 4) * 32)) };
        s0 = acc(s0, _mm256_and_si256(shr2(v0, J), m3), act4(ab, 128 * H + 32 * J + 4 * kk));
        s1 = acc(s1, _mm256_and_si256(shr2(v1, J), m3), act4(ab, 128 * H + 32 * J + 4 * kk + 16));
    }
    let pr = 4 * H + J;
    // Scale (low nibble) and min (high) of groups 2pr, 2pr + 1, per row.
    // SAFETY: the scale pairs lie at 32..160 of the group block `g`, 16 bytes each (pr < 8).
    let sc = _mm256_cvtepu8_epi16(unsafe { _mm_loadu_si128(p.add(32 + 16 * pr) as *const __m128i) });
    sm[0] = _mm256_add_epi32(sm[0], _mm256_madd_epi16(pair(s0, s1), _mm256_and_si256(sc, _mm256_set1_epi16(15))));
    sm[1] = _mm256_add_epi32(sm[1], _mm256_madd_epi16(_mm256_srli_epi16::<4>(sc), bsum_pair(ab, pr)));
}

/// Eight interleaved Q2_K rows against one token. `acc(p, x, y)` adds the products of 32
/// unsigned weight bytes (eight rows' dwords) with one activation dword broadcast, as i32 per
/// row.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q2_body(w: &[u8], a: &[Block256], out: &mut [f32; 8], acc: impl Fn(__m256i, __m256i, __m256i) -> __m256i) {
    let (mut total, mut totalm) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let pf = super::prefetch();
    for (g, ab) in w.chunks_exact(Q2_GROUP_BLOCK).zip(a) {
        let g: &[u8; Q2_GROUP_BLOCK] = g.try_into().expect("a whole group block");
        let p = g.as_ptr();
        super::prefetch_ahead(p, pf, Q2_GROUP_BLOCK);
        let mut sm = [_mm256_setzero_si256(); 2];
        q2_pair::<0, 0>(g, ab, &acc, &mut sm);
        q2_pair::<0, 1>(g, ab, &acc, &mut sm);
        q2_pair::<0, 2>(g, ab, &acc, &mut sm);
        q2_pair::<0, 3>(g, ab, &acc, &mut sm);
        q2_pair::<1, 0>(g, ab, &acc, &mut sm);
        q2_pair::<1, 1>(g, ab, &acc, &mut sm);
        q2_pair::<1, 2>(g, ab, &acc, &mut sm);
        q2_pair::<1, 3>(g, ab, &acc, &mut sm);
        let [sumi, mins] = sm;
        // SAFETY: d[8] and dmin[8] are the group block's first 32 bytes.
        let (d, dmin) = unsafe {
            (_mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)), _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i)))
        };
        let ad = _mm256_set1_ps(ab.d);
        total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(d, ad), total);
        totalm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, ad), totalm);
    }
    // SAFETY: 8 floats into an 8-float array.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), _mm256_sub_ps(total, totalm)) };
}

/// Eight interleaved Q3_K rows against one token (`acc` as for [`q2_body`]). A quant is
/// `low + 4·high − 4`; the products take `low + 4·high` (0..7) and the −4 comes off through
/// the activation's group sums, scaled by the same signed 6-bit scales.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q3_body(w: &[u8], a: &[Block256], out: &mut [f32; 8], acc: impl Fn(__m256i, __m256i, __m256i) -> __m256i) {
    let m15 = _mm256_set1_epi8(15);
    let mut total = _mm256_setzero_ps();
    let pf = super::prefetch();
    for (g, ab) in w.chunks_exact(Q3_GROUP_BLOCK).zip(a) {
        let g: &[u8; Q3_GROUP_BLOCK] = g.try_into().expect("a whole group block");
        let p = g.as_ptr();
        super::prefetch_ahead(p, pf, Q3_GROUP_BLOCK);
        // The sixteen scales of eight rows, `[scale i][row]` as i8: scale i's low four bits
        // are a nibble of packed byte i mod 8 (the high nibble from i = 8), its top two are
        // bits 2(i / 4) of byte 8 + i mod 4 (Q3_K's packing, for eight rows at once).
        // SAFETY: the packed bytes lie at 16..112 of the 880-byte group block, `[byte][row]`.
        let (y0, y1, y2) = unsafe { (load(p, 16), load(p, 48), load(p, 80)) };
        let mut scales = [0i8; 128];
        let sp = scales.as_mut_ptr() as *mut __m256i;
        // SAFETY: four stores of 32 bytes into the 128 of `scales`.
        unsafe {
            _mm256_storeu_si256(sp, q3_scale(_mm256_and_si256(y0, m15), y2));
            _mm256_storeu_si256(sp.add(1), q3_scale(_mm256_and_si256(y1, m15), _mm256_srli_epi16::<2>(y2)));
            _mm256_storeu_si256(sp.add(2), q3_scale(_mm256_and_si256(_mm256_srli_epi16::<4>(y0), m15), _mm256_srli_epi16::<4>(y2)));
            _mm256_storeu_si256(sp.add(3), q3_scale(_mm256_and_si256(_mm256_srli_epi16::<4>(y1), m15), _mm256_srli_epi16::<6>(y2)));
        }
        let mut sf = [_mm256_setzero_si256(); 2];
        q3_pair::<0, 0>(g, ab, &scales, &acc, &mut sf);
        q3_pair::<0, 1>(g, ab, &scales, &acc, &mut sf);
        q3_pair::<0, 2>(g, ab, &scales, &acc, &mut sf);
        q3_pair::<0, 3>(g, ab, &scales, &acc, &mut sf);
        q3_pair::<1, 0>(g, ab, &scales, &acc, &mut sf);
        q3_pair::<1, 1>(g, ab, &scales, &acc, &mut sf);
        q3_pair::<1, 2>(g, ab, &scales, &acc, &mut sf);
        q3_pair::<1, 3>(g, ab, &scales, &acc, &mut sf);
        let [mut sumi, fours] = sf;
        sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32::<2>(fours));
        // SAFETY: d[8] is the group block's first 16 bytes.
        let d = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) };
        total = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(d, _mm256_set1_ps(ab.d)), total);
    }
    // SAFETY: 8 floats into an 8-float array.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), total) };
}

/// Signed 6-bit scales from their low four bits (`lo`, in place) and their top two (bits 0
/// and 1 of each byte of `hi`), minus 32.
#[target_feature(enable = "avx2")]
#[inline]
fn q3_scale(lo: __m256i, hi: __m256i) -> __m256i {
    let top = _mm256_slli_epi16::<4>(_mm256_and_si256(hi, _mm256_set1_epi8(3)));
    _mm256_sub_epi8(_mm256_or_si256(lo, top), _mm256_set1_epi8(32))
}

/// Groups `8H + 2J` and `8H + 2J + 1` of eight Q3_K rows (group block `g`, its scales
/// unpacked as `[scale][row]`): their sums of `(low + 4·high)·y` times their scales added to
/// `sf[0]`, their scales times the activation's group sums (the −4's share) to `sf[1]`.
/// Generic in `H` and `J` as [`q2_pair`].
#[target_feature(enable = "avx2")]
#[inline]
fn q3_pair<const H: usize, const J: usize>(
    g: &[u8; Q3_GROUP_BLOCK],
    ab: &Block256,
    scales: &[i8; 128],
    acc: &impl Fn(__m256i, __m256i, __m256i) -> __m256i,
    sf: &mut [__m256i; 2],
) {
    let (m3, m4, p) = (_mm256_set1_epi8(3), _mm256_set1_epi8(4), g.as_ptr());
    // As in Q2_K; the high bit of element 128H + 32J + i is bit 4H + J of high-bit byte i, so
    // dword kk of the high bits goes with dword 8H + kk of the lows. The two groups' chains
    // alternate (measured: 22.5 against 19.2 GB/s a core with VNNI than one after the other).
    let mut s = [_mm256_setzero_si256(); 2];
    for kk in 0..4 {
        for (i, si) in s.iter_mut().enumerate() {
            let kk = kk + 4 * i;
            // SAFETY: the high bits lie at 112..368 of the 880-byte group block `g` (8 dwords
            // of eight rows), the low bits at 368..880 (16 dwords); kk < 8 and H < 2.
            let (v, hb) = unsafe { (load(p, 368 + (8 * H + kk) * 32), load(p, 112 + kk * 32)) };
            let x = _mm256_or_si256(_mm256_and_si256(shr2(v, J), m3), _mm256_and_si256(bit_to_2(hb, 4 * H + J), m4));
            *si = acc(*si, x, act4(ab, 128 * H + 32 * J + 4 * kk));
        }
    }
    let pr = 4 * H + J;
    // SAFETY: scales 2pr and 2pr + 1 are 8 bytes each inside `scales` (pr < 8).
    let sp = unsafe {
        let lo = _mm_loadl_epi64(scales.as_ptr().add(16 * pr) as *const __m128i);
        let hi = _mm_loadl_epi64(scales.as_ptr().add(16 * pr + 8) as *const __m128i);
        _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(lo, hi))
    };
    sf[0] = _mm256_add_epi32(sf[0], _mm256_madd_epi16(pair(s[0], s[1]), sp));
    sf[1] = _mm256_add_epi32(sf[1], _mm256_madd_epi16(sp, bsum_pair(ab, pr)));
}

/// `maddubs` pairs (at most 2·7·127, no saturation) widened by `madd` and added: AVX2's
/// stand-in for VNNI's `dpbusd`.
#[target_feature(enable = "avx2")]
#[inline]
fn acc32_avx2(p: __m256i, x: __m256i, y: __m256i) -> __m256i {
    _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1)))
}

/// Eight interleaved Q2_K rows against one token, with VNNI.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512VL and AVX-512 VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn q2_k_vnni(w: &[u8], a: &[Block256], out: &mut [f32; 8]) {
    q2_body(w, a, out, |p, x, y| _mm256_dpbusd_epi32(p, x, y))
}

/// Eight interleaved Q2_K rows against one token, with AVX2.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q2_k_avx2(w: &[u8], a: &[Block256], out: &mut [f32; 8]) {
    q2_body(w, a, out, |p, x, y| acc32_avx2(p, x, y))
}

/// Eight interleaved Q3_K rows against one token, with VNNI.
///
/// # Safety
/// As for [`q2_k_vnni`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn q3_k_vnni(w: &[u8], a: &[Block256], out: &mut [f32; 8]) {
    q3_body(w, a, out, |p, x, y| _mm256_dpbusd_epi32(p, x, y))
}

/// Eight interleaved Q3_K rows against one token, with AVX2.
///
/// # Safety
/// As for [`q2_k_avx2`].
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q3_k_avx2(w: &[u8], a: &[Block256], out: &mut [f32; 8]) {
    q3_body(w, a, out, |p, x, y| acc32_avx2(p, x, y))
}
