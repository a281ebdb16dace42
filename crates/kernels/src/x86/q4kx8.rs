//! Q4_K with eight rows interleaved (experiment): lanes are rows, so group scales apply as
//! vectors and no per-row reduction is needed.
//!
//! Layout of one super-block of eight rows (1152 bytes, the size of eight Q4_K blocks):
//! `d[8]` f16, `dmin[8]` f16, the packed scale bytes `[byte j < 12][row]`, then the quants
//! `[pair c < 4][dword k < 8][row][4 bytes]` (low nibbles group 2c, high nibbles group 2c+1).

use crate::act::Block256;
use smoe_quant::blocks::BlockQ4K;
use std::arch::x86_64::*;

/// Bytes of one interleaved super-block of eight rows.
pub const GROUP_BLOCK: usize = 8 * 144;

/// Interleaves eight Q4_K rows of `blocks` super-blocks each into `out`.
pub fn repack(rows: [&[u8]; 8], blocks: usize, out: &mut [u8]) {
    assert!(out.len() >= blocks * GROUP_BLOCK);
    for b in 0..blocks {
        let o = &mut out[b * GROUP_BLOCK..(b + 1) * GROUP_BLOCK];
        for (r, row) in rows.iter().enumerate() {
            let blk: &BlockQ4K = bytemuck::from_bytes(&row[b * 144..(b + 1) * 144]);
            o[2 * r..2 * r + 2].copy_from_slice(&blk.d.0);
            o[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&blk.dmin.0);
            for j in 0..12 {
                o[32 + 8 * j + r] = blk.scales[j];
            }
            for c in 0..4 {
                for k in 0..8 {
                    let at = 128 + ((c * 8 + k) * 8 + r) * 4;
                    o[at..at + 4].copy_from_slice(&blk.qs[32 * c + 4 * k..32 * c + 4 * k + 4]);
                }
            }
        }
    }
}

/// Eight interleaved rows (`blocks` super-blocks) against one activation row: `out[r]`.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512VL and AVX-512 VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn dot8_vnni(w: &[u8], a: &[Block256], out: &mut [f32; 8]) {
    let blocks = (w.len() / GROUP_BLOCK).min(a.len());
    let m4 = _mm256_set1_epi8(0x0f);
    let m30 = _mm256_set1_epi8(0x30);
    let (mut acc, mut accm) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for b in 0..blocks {
        let g = &w[b * GROUP_BLOCK..(b + 1) * GROUP_BLOCK];
        let ab = &a[b];
        let p = g.as_ptr();
        _mm_prefetch::<_MM_HINT_T0>((p as *const i8).wrapping_add(2 * GROUP_BLOCK));
        _mm_prefetch::<_MM_HINT_T0>((p as *const i8).wrapping_add(2 * GROUP_BLOCK + 576));
        // SAFETY: all offsets below are inside the 1152-byte group block `g` and the
        // activation block (256 quants, 16 sums).
        unsafe {
            // Scales and mins of all eight rows: [scale or min i][row] bytes.
            let y0 = _mm256_loadu_si256(p.add(32) as *const __m256i);
            let y1 = _mm256_loadu_si256(p.add(64) as *const __m256i);
            let y2 = _mm256_loadu_si256(p.add(96) as *const __m256i);
            let mut sc = [0u8; 64];
            let mut mn = [0u8; 64];
            let s_lo = _mm256_and_si256(y0, _mm256_set1_epi8(63));
            let s_hi = _mm256_or_si256(_mm256_and_si256(y2, m4), _mm256_and_si256(_mm256_srli_epi16::<2>(y0), m30));
            let m_lo = _mm256_and_si256(y1, _mm256_set1_epi8(63));
            let m_hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(y2), m4), _mm256_and_si256(_mm256_srli_epi16::<2>(y1), m30));
            _mm256_storeu_si256(sc.as_mut_ptr() as *mut __m256i, s_lo);
            _mm256_storeu_si256(sc.as_mut_ptr().add(32) as *mut __m256i, s_hi);
            _mm256_storeu_si256(mn.as_mut_ptr() as *mut __m256i, m_lo);
            _mm256_storeu_si256(mn.as_mut_ptr().add(32) as *mut __m256i, m_hi);
            let q = p.add(128);
            let aq = ab.qs.as_ptr() as *const u8;
            let mut sumi = _mm256_setzero_si256();
            let mut mins = _mm256_setzero_si256();
            for c in 0..4 {
                let (mut plo, mut phi) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                for k in 0..8 {
                    let v = _mm256_loadu_si256(q.add((c * 8 + k) * 32) as *const __m256i);
                    let lo = _mm256_and_si256(v, m4);
                    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                    let alo = _mm256_set1_epi32((aq.add(64 * c + 4 * k) as *const i32).read_unaligned());
                    let ahi = _mm256_set1_epi32((aq.add(64 * c + 32 + 4 * k) as *const i32).read_unaligned());
                    plo = _mm256_dpbusd_epi32(plo, lo, alo);
                    phi = _mm256_dpbusd_epi32(phi, hi, ahi);
                }
                let s0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(sc.as_ptr().add(8 * (2 * c)) as *const __m128i));
                let s1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(sc.as_ptr().add(8 * (2 * c + 1)) as *const __m128i));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_mullo_epi32(plo, s0), _mm256_mullo_epi32(phi, s1)));
                let m0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(mn.as_ptr().add(8 * (2 * c)) as *const __m128i));
                let m1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(mn.as_ptr().add(8 * (2 * c + 1)) as *const __m128i));
                let b0 = ab.bsums[4 * c] as i32 + ab.bsums[4 * c + 1] as i32;
                let b1 = ab.bsums[4 * c + 2] as i32 + ab.bsums[4 * c + 3] as i32;
                mins = _mm256_add_epi32(
                    mins,
                    _mm256_add_epi32(_mm256_mullo_epi32(m0, _mm256_set1_epi32(b0)), _mm256_mullo_epi32(m1, _mm256_set1_epi32(b1))),
                );
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
            let dmin = _mm256_cvtph_ps(_mm_loadu_si128(p.add(16) as *const __m128i));
            let ad = _mm256_set1_ps(ab.d);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(d, ad), acc);
            accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(dmin, ad), accm);
        }
    }
    // SAFETY: 8 floats into an 8-float array.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), _mm256_sub_ps(acc, accm)) };
}

/// Bytes of one interleaved Q8_0 block of eight rows: `d[8]` f16, then quants biased by +128
/// `[dword k < 8][row][4 bytes]`.
pub const Q8_GROUP_BLOCK: usize = 8 * 34;

/// Interleaves eight Q8_0 rows of `blocks` blocks into `out`, quants biased to unsigned.
pub fn repack_q8_0(rows: [&[u8]; 8], blocks: usize, out: &mut [u8]) {
    assert!(out.len() >= blocks * Q8_GROUP_BLOCK);
    for b in 0..blocks {
        let o = &mut out[b * Q8_GROUP_BLOCK..(b + 1) * Q8_GROUP_BLOCK];
        for (r, row) in rows.iter().enumerate() {
            let blk = &row[b * 34..(b + 1) * 34];
            o[2 * r..2 * r + 2].copy_from_slice(&blk[..2]);
            for k in 0..8 {
                for i in 0..4 {
                    o[16 + (k * 8 + r) * 4 + i] = blk[2 + 4 * k + i] ^ 0x80;
                }
            }
        }
    }
}

/// Eight interleaved Q8_0 rows against one activation row: `out[r]`.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512VL and AVX-512 VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn dot8_q8_0_vnni(w: &[u8], a: &[crate::act::Block32], out: &mut [f32; 8]) {
    let blocks = (w.len() / Q8_GROUP_BLOCK).min(a.len());
    let (mut acc, mut corr) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for b in 0..blocks {
        let p = w[b * Q8_GROUP_BLOCK..(b + 1) * Q8_GROUP_BLOCK].as_ptr();
        _mm_prefetch::<_MM_HINT_T0>((p as *const i8).wrapping_add(4 * Q8_GROUP_BLOCK));
        let ab = &a[b];
        let aq = ab.qs.as_ptr() as *const u8;
        // SAFETY: offsets inside the 272-byte group block and the 32-quant activation block.
        unsafe {
            // Two chains: eight dependent vpdpbusd would bound the block by their latency.
            let mut s = [_mm256_setzero_si256(); 2];
            for k in 0..8 {
                let v = _mm256_loadu_si256(p.add(16 + 32 * k) as *const __m256i);
                s[k % 2] = _mm256_dpbusd_epi32(s[k % 2], v, _mm256_set1_epi32((aq.add(4 * k) as *const i32).read_unaligned()));
            }
            let s = _mm256_add_epi32(s[0], s[1]);
            let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(ab.d)), acc);
            corr = _mm256_fmadd_ps(d, _mm256_set1_ps(ab.s), corr);
        }
    }
    // SAFETY: 8 floats into an 8-float array.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), _mm256_fnmadd_ps(_mm256_set1_ps(128.0), corr, acc)) };
}
