//! 512-bit bodies of the VNNI many-token kernels: two tiles (16 tokens) per register, so that
//! each broadcast weight dword feeds 64 products instead of 32. Zen 4 executes a 512-bit
//! `vpdpbusd` as two 256-bit halves, so the arithmetic rate is the same; what halves is the
//! loads and scale work per product, which bound the 256-bit kernels. The tile layout stays
//! the 8-token one ([`crate::gemm`]): the two tiles' dwords are joined in a register. Each
//! function handles whole pairs of tiles and returns how many tiles it did; the 256-bit
//! bodies finish an odd last tile.

use super::gemm::{store, Q4kRows, Unpacked};
use super::gemm_k23::{check_k23, i16_scale};
use crate::gemm::{ActTile, TILE};
use std::arch::x86_64::*;

/// The same 8 lanes of two tiles, `at` floats/ints apart, as one 16-lane register.
///
/// # Safety
/// `p` and `p + at` must be valid for 32 bytes each.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn pair(p: *const i32, at: usize) -> __m512i {
    // SAFETY: as the caller guarantees.
    unsafe {
        let lo = _mm256_loadu_si256(p as *const __m256i);
        let hi = _mm256_loadu_si256(p.add(at) as *const __m256i);
        _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
    }
}

/// Four weight bytes at `p` broadcast to all 16 lanes.
///
/// # Safety
/// `p` must be valid for 4 bytes.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn bcast(p: *const u8) -> __m512i {
    // SAFETY: as the caller guarantees.
    _mm512_set1_epi32(unsafe { (p as *const i32).read_unaligned() })
}

/// Stores 16 lanes as tiles `g` and `g + 1`.
#[target_feature(enable = "avx512f")]
#[inline]
fn store2(out: &mut [f32], g: usize, n: usize, v: __m512) {
    store(out, g, n, _mm512_castps512_ps256(v));
    store(out, g + 1, n, _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))));
}

/// `R` Q8_0 rows (unpacked, biased by +128) × whole pairs of tiles; see the module notes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
pub(super) fn q8_0_pairs<const R: usize>(u: &[Unpacked], tile: &ActTile<'_>, out: &mut [f32]) -> usize {
    let (blocks, dwords, n) = (tile.cols / 32, tile.cols / 4, tile.n);
    let pairs = tile.tiles() / 2;
    assert!(u.len() >= R && u[..R].iter().all(|u| u.q.len() >= tile.cols && u.d.len() >= blocks) && out.len() >= R * n);
    assert!(tile.qs.len() >= tile.tiles() * dwords * TILE * 4);
    assert!(tile.sums.len() >= tile.tiles() * blocks * TILE && tile.d.len() >= tile.tiles() * blocks * TILE);
    let tile_ints = dwords * TILE;
    for gp in 0..pairs {
        let g = 2 * gp;
        let qs = tile.qs[g * dwords * TILE * 4..].as_ptr() as *const i32;
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..blocks {
            let mut p = [_mm512_setzero_si512(); R];
            for k in 0..8 {
                // SAFETY: dword 8b + k < dwords of tile g (at `qs`) and of tile g + 1
                // (`tile_ints` further), 8 i32 each; g + 1 < tiles, and `qs` holds every tile's
                // dwords (second assert).
                let y = unsafe { pair(qs.add((8 * b + k) * TILE), tile_ints) };
                for r in 0..R {
                    // SAFETY: weight bytes 32b + 4k..32b + 4k + 4 lie below cols <= u[r].q.len()
                    // (first assert).
                    p[r] = _mm512_dpbusd_epi32(p[r], unsafe { bcast(u[r].q.as_ptr().add(32 * b + 4 * k)) }, y);
                }
            }
            let (row, at) = ((g * blocks + b) * TILE, blocks * TILE);
            // SAFETY: `sums` and `d` hold TILE values per (tile, block), asserted above.
            let (sums, da) =
                unsafe { (pair(tile.sums.as_ptr().add(row), at), _mm512_castsi512_ps(pair(tile.d.as_ptr().add(row) as *const i32, at))) };
            let bias = _mm512_slli_epi32::<7>(sums);
            for r in 0..R {
                let v = _mm512_cvtepi32_ps(_mm512_sub_epi32(p[r], bias));
                acc[r] = _mm512_fmadd_ps(v, _mm512_mul_ps(_mm512_set1_ps(u[r].d[b]), da), acc[r]);
            }
        }
        for (r, a) in acc.into_iter().enumerate() {
            store2(&mut out[r * n..(r + 1) * n], g, n, a);
        }
    }
    2 * pairs
}

/// `R` Q4_K rows (unpacked) × whole pairs of tiles; see the module notes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
pub(super) fn q4_k_pairs<const R: usize, const K: usize>(v: &Q4kRows<'_, R, K>, sbs: usize, tile: &ActTile<'_>, out: &mut [f32]) -> usize {
    let (dwords, groups, n) = (tile.cols / 4, tile.cols / 32, tile.n);
    let pairs = tile.tiles() / 2;
    assert!(v.holds(sbs) && out.len() >= R * n && groups >= 8 * sbs);
    assert!(tile.qs.len() >= tile.tiles() * dwords * TILE * 4);
    assert!(tile.sums.len() >= tile.tiles() * groups * TILE && tile.d.len() >= tile.tiles() * sbs * TILE);
    let tile_ints = dwords * TILE;
    for gp in 0..pairs {
        let g = 2 * gp;
        let qs = tile.qs[g * dwords * TILE * 4..].as_ptr() as *const i32;
        let (mut total, mut totalm) = ([_mm512_setzero_ps(); R], [_mm512_setzero_ps(); R]);
        for s in 0..sbs {
            let (mut sumi, mut mins) = ([_mm512_setzero_si512(); R], [_mm512_setzero_si512(); R]);
            for j in 0..8 {
                let e = 256 * s + 32 * j;
                let mut p = [_mm512_setzero_si512(); R];
                for k in 0..8 {
                    // SAFETY: dword e / 4 + k < 64 * sbs <= 8 * groups = dwords (first assert),
                    // of tile g (at `qs`) and tile g + 1 (`tile_ints` further), 8 i32 each;
                    // g + 1 < tiles, and `qs` holds every tile's dwords (second assert).
                    let y = unsafe { pair(qs.add((e / 4 + k) * TILE), tile_ints) };
                    for r in 0..R {
                        // SAFETY: dword e / 4 + k < 64 * sbs, and `v.holds(sbs)` (first assert).
                        p[r] = _mm512_dpbusd_epi32(p[r], unsafe { bcast(v.quant(r, e / 4 + k)) }, y);
                    }
                }
                // SAFETY: `sums` holds TILE values per (tile, group), asserted above.
                let gs = unsafe { pair(tile.sums.as_ptr().add((g * groups + 8 * s + j) * TILE), groups * TILE) };
                for r in 0..R {
                    let (sc, m) = v.scale_min(r, 8 * s + j);
                    sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(p[r], _mm512_set1_epi32(sc)));
                    // The two 16-element sums (i16 pairs in `gs`) times the min, added.
                    mins[r] = _mm512_add_epi32(mins[r], _mm512_madd_epi16(gs, _mm512_set1_epi16(m as i16)));
                }
            }
            // SAFETY: `d` holds TILE values per (tile, super-block), asserted above.
            let da = _mm512_castsi512_ps(unsafe { pair(tile.d.as_ptr().add((g * sbs + s) * TILE) as *const i32, sbs * TILE) });
            for r in 0..R {
                let (d, dmin) = v.d_dmin(r, s);
                total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[r]), _mm512_mul_ps(_mm512_set1_ps(d), da), total[r]);
                totalm[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins[r]), _mm512_mul_ps(_mm512_set1_ps(dmin), da), totalm[r]);
            }
        }
        for r in 0..R {
            store2(&mut out[r * n..(r + 1) * n], g, n, _mm512_sub_ps(total[r], totalm[r]));
        }
    }
    2 * pairs
}

/// [`super::gemm_k23`]'s group terms (Q2_K's mins, Q3_K's offsets) for tiles `g` and `g + 1`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
fn group_terms<const R: usize>(u: &[Unpacked], tile: &ActTile<'_>, g: usize, s: usize) -> [__m512i; R] {
    let runs = tile.cols / 32;
    let mut acc = [_mm512_setzero_si512(); R];
    for j in 0..8 {
        let at = (g * runs + 8 * s + j) * TILE;
        assert!(at + runs * TILE + TILE <= tile.sums.len(), "group sums out of range");
        // SAFETY: TILE i32 at `at` and at `at + runs * TILE` (tile g + 1), asserted in range.
        let gs = unsafe { pair(tile.sums.as_ptr().add(at), runs * TILE) };
        for r in 0..R {
            acc[r] = _mm512_add_epi32(acc[r], _mm512_madd_epi16(gs, _mm512_set1_epi32(u[r].mins[8 * s + j])));
        }
    }
    acc
}

/// `R` Q2_K rows (unpacked as `gemm_k23` does) × whole pairs of tiles; see the module notes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
pub(super) fn q2_k_pairs<const R: usize>(u: &[Unpacked], sbs: usize, tile: &ActTile<'_>, out: &mut [f32]) -> usize {
    check_k23::<R>(u, sbs, tile, out, false);
    let (dwords, n) = (tile.cols / 4, tile.n);
    let (pairs, tile_ints) = (tile.tiles() / 2, dwords * TILE);
    for gp in 0..pairs {
        let g = 2 * gp;
        let qs = tile.qs[g * dwords * TILE * 4..].as_ptr() as *const i32;
        let (mut total, mut totalm) = ([_mm512_setzero_ps(); R], [_mm512_setzero_ps(); R]);
        for s in 0..sbs {
            let (mut p0, mut p1) = ([_mm512_setzero_si512(); R], [_mm512_setzero_si512(); R]);
            for k in (0..64).step_by(2) {
                // SAFETY: dwords 64s + k + 1 < 64 * sbs <= dwords of tiles g and g + 1 (8 i32
                // each, `tile_ints` apart), which `qs` holds (`check_k23`); weight bytes
                // 256s + 4k + 8 <= u[r].q.len() (`check_k23`).
                unsafe {
                    let y0 = pair(qs.add((64 * s + k) * TILE), tile_ints);
                    let y1 = pair(qs.add((64 * s + k + 1) * TILE), tile_ints);
                    for r in 0..R {
                        let w = u[r].q.as_ptr().add(256 * s + 4 * k);
                        p0[r] = _mm512_dpbusd_epi32(p0[r], bcast(w), y0);
                        p1[r] = _mm512_dpbusd_epi32(p1[r], bcast(w.add(4)), y1);
                    }
                }
            }
            let mins = group_terms::<R>(u, tile, g, s);
            // SAFETY: `d` holds TILE values per (tile, super-block), `check_k23`ed.
            let da = _mm512_castsi512_ps(unsafe { pair(tile.d.as_ptr().add((g * sbs + s) * TILE) as *const i32, sbs * TILE) });
            for r in 0..R {
                let p = _mm512_add_epi32(p0[r], p1[r]);
                total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(_mm512_set1_ps(u[r].d[s]), da), total[r]);
                totalm[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mins[r]), _mm512_mul_ps(_mm512_set1_ps(u[r].dmin[s]), da), totalm[r]);
            }
        }
        for r in 0..R {
            store2(&mut out[r * n..(r + 1) * n], g, n, _mm512_sub_ps(total[r], totalm[r]));
        }
    }
    2 * pairs
}

/// `R` Q3_K rows (unpacked as `gemm_k23` does) × whole pairs of tiles; see the module notes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma")]
#[inline]
pub(super) fn q3_k_pairs<const R: usize>(u: &[Unpacked], sbs: usize, tile: &ActTile<'_>, out: &mut [f32]) -> usize {
    check_k23::<R>(u, sbs, tile, out, true);
    let (dwords, n) = (tile.cols / 4, tile.n);
    let (pairs, tile_ints) = (tile.tiles() / 2, dwords * TILE);
    for gp in 0..pairs {
        let g = 2 * gp;
        let qs = tile.qs[g * dwords * TILE * 4..].as_ptr() as *const i32;
        let mut total = [_mm512_setzero_ps(); R];
        for s in 0..sbs {
            let mut sumi = [_mm512_setzero_si512(); R];
            for grp in 0..16 {
                let mut p = [_mm512_setzero_si512(); R];
                for k in 0..4 {
                    let e = 256 * s + 16 * grp + 4 * k;
                    // SAFETY: dword e / 4 < 64 * sbs <= dwords of tiles g and g + 1, which `qs`
                    // holds; weight bytes e + 4 <= u[r].q.len() (`check_k23`).
                    unsafe {
                        let y = pair(qs.add(e / 4 * TILE), tile_ints);
                        for r in 0..R {
                            p[r] = _mm512_dpbusd_epi32(p[r], bcast(u[r].q.as_ptr().add(e)), y);
                        }
                    }
                }
                for r in 0..R {
                    let sc = _mm512_set1_epi32(i16_scale(u[r].sc[16 * s + grp]));
                    sumi[r] = _mm512_add_epi32(sumi[r], _mm512_madd_epi16(p[r], sc));
                }
            }
            let offsets = group_terms::<R>(u, tile, g, s);
            for r in 0..R {
                sumi[r] = _mm512_sub_epi32(sumi[r], offsets[r]);
            }
            // SAFETY: as in `q2_k_pairs`.
            let da = _mm512_castsi512_ps(unsafe { pair(tile.d.as_ptr().add((g * sbs + s) * TILE) as *const i32, sbs * TILE) });
            for r in 0..R {
                total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[r]), _mm512_mul_ps(_mm512_set1_ps(u[r].d[s]), da), total[r]);
            }
        }
        for r in 0..R {
            store2(&mut out[r * n..(r + 1) * n], g, n, total[r]);
        }
    }
    2 * pairs
}
