//! Many-token kernels for Q2_K and Q3_K (see [`crate::gemm`]): the low-bit experts of the
//! 235B-class runs, which had no many-token kernel before. Each weight row is unpacked once
//! into bytes, then every broadcast weight dword multiplies 8 tokens at once, as for Q8_0 and
//! Q4_K.
//!
//! - Q2_K: each 2-bit quant is stored times its group's 4-bit scale (0..45, still a byte), so
//!   a super-block's products sum in one accumulator with no per-group scaling; the mins come
//!   off through the tokens' sums per 16 ([`ActTile::sums`]' i16 pairs, one `madd` per two
//!   groups).
//! - Q3_K: quants as `low + 4·high` (0..7); each group of 16 is scaled by its signed 6-bit
//!   scale, and the −4 offset comes off through the same sums (times 4 × the scale).
//!
//! Every sum is exact in i32 (and exact as f32: below 2²⁴), so these agree with the one-token
//! kernels to float rounding of the per-block scales.

use super::avx2_more::srl;
use super::gemm::{acc_avx2, bcast, dot4_vnni, load, store, transpose8x8, with_unpacked, Unpacked};
use crate::gemm::{ActTile, ROWS, TILE};
use bytemuck::Zeroable;
use smoe_quant::blocks::{BlockQ2K, BlockQ3K};
use smoe_quant::interleave::{Q2_GROUP_BLOCK, Q3_GROUP_BLOCK};
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::mem::offset_of;

/// Unpacks a Q2_K row: each quant times its group's scale, one byte per weight in element
/// order; per super-block `d` and `dmin`, and in `mins` the group mins two to an i32 (the
/// even group's in the low half), as the tiles hold the tokens' sums.
#[target_feature(enable = "avx2,f16c")]
fn unpack_q2_k(w: &[u8], u: &mut Unpacked) -> usize {
    let wb: &[BlockQ2K] = bytemuck::cast_slice(w);
    u.start_k(wb.len());
    for (i, b) in wb.iter().enumerate() {
        unpack_q2_k_block(b, i, u);
    }
    wb.len()
}

/// Super-block `i` of a Q2_K row into `u` (see [`unpack_q2_k`]).
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn unpack_q2_k_block(b: &BlockQ2K, i: usize, u: &mut Unpacked) {
    let (one, two, three) = (_mm256_set1_epi8(1), _mm256_set1_epi8(2), _mm256_set1_epi8(3));
    assert!(u.q.len() >= 256 * (i + 1));
    for h in 0..2 {
        // SAFETY: qs holds 64 bytes, 32 per half.
        let q = unsafe { _mm256_loadu_si256(b.qs.as_ptr().add(32 * h) as *const __m256i) };
        for j in 0..4 {
            // Elements 128h + 32j + l come from bit pair j of byte l: groups 8h + 2j (l < 16,
            // the low 128-bit lane) and 8h + 2j + 1.
            let x = _mm256_and_si256(srl(q, 2 * j as i32), three);
            let g = 8 * h + 2 * j;
            let s = _mm256_setr_m128i(_mm_set1_epi8((b.scales[g] & 15) as i8), _mm_set1_epi8((b.scales[g + 1] & 15) as i8));
            // x · s for x in 0..3 without a byte multiply: s where bit 0 is set, plus 2s
            // where bit 1 is.
            let b0 = _mm256_cmpeq_epi8(_mm256_and_si256(x, one), one);
            let b1 = _mm256_cmpeq_epi8(_mm256_and_si256(x, two), two);
            let v = _mm256_add_epi8(_mm256_and_si256(b0, s), _mm256_and_si256(b1, _mm256_add_epi8(s, s)));
            // SAFETY: 32 bytes out at 256i + 128h + 32j + 32 <= 256(i + 1) <= q.len() (asserted).
            unsafe { _mm256_storeu_si256(u.q.as_mut_ptr().add(256 * i + 128 * h + 32 * j) as *mut __m256i, v) };
        }
    }
    u.d.push(b.d.to_f32());
    u.dmin.push(b.dmin.to_f32());
    u.mins.extend((0..8).map(|j| (b.scales[2 * j] >> 4) as i32 | (((b.scales[2 * j + 1] >> 4) as i32) << 16)));
}

/// Unpacks a Q3_K row: quants as `low + 4·high` (0..7), one byte per weight in element order;
/// per super-block `d`; per group its signed scale in `sc`, and in `mins` four times the
/// scales two to an i32 (the even group's in the low half, as i16), for the −4 offset.
#[target_feature(enable = "avx2,f16c")]
fn unpack_q3_k(w: &[u8], u: &mut Unpacked) -> usize {
    let wb: &[BlockQ3K] = bytemuck::cast_slice(w);
    u.start_k(wb.len());
    for (i, b) in wb.iter().enumerate() {
        unpack_q3_k_block(b, i, u);
    }
    wb.len()
}

/// Super-block `i` of a Q3_K row into `u` (see [`unpack_q3_k`]).
#[target_feature(enable = "avx2,f16c")]
#[inline]
fn unpack_q3_k_block(b: &BlockQ3K, i: usize, u: &mut Unpacked) {
    let (three, four) = (_mm256_set1_epi8(3), _mm256_set1_epi8(4));
    assert!(u.q.len() >= 256 * (i + 1));
    // SAFETY: hmask holds 32 bytes.
    let hm = unsafe { _mm256_loadu_si256(b.hmask.as_ptr() as *const __m256i) };
    for h in 0..2 {
        // SAFETY: qs holds 64 bytes, 32 per half.
        let q = unsafe { _mm256_loadu_si256(b.qs.as_ptr().add(32 * h) as *const __m256i) };
        for j in 0..4 {
            // Element 128h + 32j + l: bit pair j of qs byte l, high bit 4h + j of hmask byte l.
            let low = _mm256_and_si256(srl(q, 2 * j as i32), three);
            let bit = _mm256_set1_epi8(1 << (4 * h + j));
            let high = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), bit);
            let v = _mm256_add_epi8(low, _mm256_and_si256(high, four));
            // SAFETY: 32 bytes out at 256i + 128h + 32j + 32 <= 256(i + 1) <= q.len() (asserted).
            unsafe { _mm256_storeu_si256(u.q.as_mut_ptr().add(256 * i + 128 * h + 32 * j) as *mut __m256i, v) };
        }
    }
    u.d.push(b.d.to_f32());
    let sc = smoe_quant::unpack_q3_scales(&b.scales);
    u.sc.extend(sc.iter().map(|&s| s as i32));
    let four_s = |g: usize| (4 * sc[g] as i32) as u16 as i32;
    u.mins.extend((0..8).map(|j| four_s(2 * j) | (four_s(2 * j + 1) << 16)));
}

/// `count` dwords of eight rows interleaved at `src` (`[dword][row][4]`, as
/// [`smoe_quant::interleave`] lays out quants) to each row's bytes: row `r`'s `4 · count` bytes
/// to `dst + r · stride`. 8 × 8 transposes in registers.
///
/// # Safety
/// The CPU must support AVX2; `src` must be readable for `32 · count` bytes, each row's
/// destination writable for `4 · count`; `count` a multiple of 8.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn rows_of_dwords(src: *const u8, count: usize, dst: *mut u8, stride: usize) {
    for c in 0..count / 8 {
        let mut r = [_mm256_setzero_ps(); 8];
        for (k, r) in r.iter_mut().enumerate() {
            // SAFETY: 32 bytes at 32(8c + k) < 32 · count, as the caller guarantees.
            *r = unsafe { _mm256_loadu_ps(src.add(32 * (8 * c + k)) as *const f32) };
        }
        for (row, v) in transpose8x8(&r).iter().enumerate() {
            // SAFETY: 32 bytes at 32c < 4 · count of row `row`'s destination.
            unsafe { _mm256_storeu_ps(dst.add(row * stride + 32 * c) as *mut f32, *v) };
        }
    }
}

/// Unpacks the eight rows of an interleaved Q2_K group (see [`smoe_quant::interleave`]) into
/// `u[0..8]`, as [`unpack_q2_k`] unpacks a row: each super-block's rows are gathered in L1
/// and unpacked at once, so the weights are read from memory once, by the unpacking. (The
/// portable [`smoe_quant::interleave::rows_of_group`] on one super-block gives the same bytes
/// but cost 3-5% of prefill(512) on the 12-layer 235B cut: 66.0 / 67.2 against 69.4 / 69.3
/// tok/s.)
#[target_feature(enable = "avx2,f16c")]
fn unpack_q2_k_group(w: &[u8], u: &mut [Unpacked]) -> usize {
    let sbs = w.len() / Q2_GROUP_BLOCK;
    assert!(u.len() >= 8 && w.len() == sbs * Q2_GROUP_BLOCK, "unpack_q2_k_group: bad group");
    u.iter_mut().take(8).for_each(|u| u.start_k(sbs));
    let mut blocks = [BlockQ2K::zeroed(); 8];
    for (i, g) in w.chunks_exact(Q2_GROUP_BLOCK).enumerate() {
        let out = blocks.as_mut_ptr() as *mut u8;
        // SAFETY: the group block's quants are 16 dwords of eight rows at 160..672; each row's
        // `qs` takes 64 bytes of its 84-byte block.
        unsafe { rows_of_dwords(g.as_ptr().add(160), 16, out.add(offset_of!(BlockQ2K, qs)), 84) };
        for (r, b) in blocks.iter_mut().enumerate() {
            b.d.0.copy_from_slice(&g[2 * r..2 * r + 2]);
            b.dmin.0.copy_from_slice(&g[16 + 2 * r..16 + 2 * r + 2]);
            for p in 0..8 {
                b.scales[2 * p..2 * p + 2].copy_from_slice(&g[32 + 16 * p + 2 * r..][..2]);
            }
        }
        for (b, u) in blocks.iter().zip(u.iter_mut()) {
            unpack_q2_k_block(b, i, u);
        }
    }
    sbs
}

/// [`unpack_q2_k_group`] for Q3_K.
#[target_feature(enable = "avx2,f16c")]
fn unpack_q3_k_group(w: &[u8], u: &mut [Unpacked]) -> usize {
    let sbs = w.len() / Q3_GROUP_BLOCK;
    assert!(u.len() >= 8 && w.len() == sbs * Q3_GROUP_BLOCK, "unpack_q3_k_group: bad group");
    u.iter_mut().take(8).for_each(|u| u.start_k(sbs));
    let mut blocks = [BlockQ3K::zeroed(); 8];
    for (i, g) in w.chunks_exact(Q3_GROUP_BLOCK).enumerate() {
        let out = blocks.as_mut_ptr() as *mut u8;
        // SAFETY: the high bits are 8 dwords of eight rows at 112..368, the low bits 16 at
        // 368..880; each row's `hmask` takes 32 bytes of its 110-byte block, its `qs` 64.
        unsafe {
            rows_of_dwords(g.as_ptr().add(112), 8, out.add(offset_of!(BlockQ3K, hmask)), 110);
            rows_of_dwords(g.as_ptr().add(368), 16, out.add(offset_of!(BlockQ3K, qs)), 110);
        }
        for (r, b) in blocks.iter_mut().enumerate() {
            b.d.0.copy_from_slice(&g[2 * r..2 * r + 2]);
            for j in 0..12 {
                b.scales[j] = g[16 + 8 * j + r];
            }
        }
        for (b, u) in blocks.iter().zip(u.iter_mut()) {
            unpack_q3_k_block(b, i, u);
        }
    }
    sbs
}

/// Asserts what both bodies read: `R` rows of `sbs` super-blocks, outputs for every token,
/// and a tile of as many super-blocks.
pub(super) fn check_k23<const R: usize>(u: &[Unpacked], sbs: usize, tile: &ActTile<'_>, out: &[f32], scales: bool) {
    let (dwords, runs) = (tile.cols / 4, tile.cols / 32);
    // Equal lengths: `d` is laid out per super-block of the tile's rows.
    assert!(tile.block == 256 && 8 * sbs == runs && out.len() >= R * tile.n, "Q2_K/Q3_K tile and rows differ");
    assert!(u.len() >= R);
    for u in &u[..R] {
        assert!(u.q.len() >= 256 * sbs && u.d.len() >= sbs && u.mins.len() >= 8 * sbs);
        assert!(if scales { u.sc.len() >= 16 * sbs } else { u.dmin.len() >= sbs });
    }
    assert!(tile.qs.len() >= tile.tiles() * dwords * TILE * 4);
    assert!(tile.sums.len() >= tile.tiles() * runs * TILE && tile.d.len() >= tile.tiles() * sbs * TILE);
}

/// Per row, Σ over super-block `s`'s sixteen groups of the row's `mins` term (i16 pairs) times
/// the tokens' group sums of tile `g` (i16 pairs): Q2_K's mins, Q3_K's −4 offsets.
#[target_feature(enable = "avx2")]
#[inline]
fn group_terms<const R: usize>(u: &[Unpacked], tile: &ActTile<'_>, g: usize, s: usize) -> [__m256i; R] {
    let runs = tile.cols / 32;
    let mut acc = [_mm256_setzero_si256(); R];
    for j in 0..8 {
        let at = (g * runs + 8 * s + j) * TILE;
        assert!(at + TILE <= tile.sums.len(), "group sums out of range");
        // SAFETY: TILE i32 at `at`, asserted in range.
        let gs = unsafe { _mm256_loadu_si256(tile.sums.as_ptr().add(at) as *const __m256i) };
        for r in 0..R {
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(gs, _mm256_set1_epi32(u[r].mins[8 * s + j])));
        }
    }
    acc
}

/// `R` Q2_K rows (unpacked) × the tiles from `first` on: `out[r * n + t]`. `acc(p, w, a)`
/// adds one weight dword's products with the 8 tokens' dwords at `a` to the i32 lanes `p`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q2_k_body<const R: usize>(
    u: &[Unpacked],
    sbs: usize,
    first: usize,
    tile: &ActTile<'_>,
    out: &mut [f32],
    acc: impl Fn(__m256i, *const u8, *const i8) -> __m256i,
) {
    check_k23::<R>(u, sbs, tile, out, false);
    let (dwords, n) = (tile.cols / 4, tile.n);
    for g in first..tile.tiles() {
        let qs = tile.qs[g * dwords * TILE * 4..].as_ptr();
        let (mut total, mut totalm) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
        for s in 0..sbs {
            // Two accumulators per row: consecutive products do not wait on each other.
            let (mut p0, mut p1) = ([_mm256_setzero_si256(); R], [_mm256_setzero_si256(); R]);
            for k in (0..64).step_by(2) {
                // SAFETY: dwords 64s + k + 1 < 64 * sbs <= 8 * runs = dwords of tile g, which
                // `qs` holds (`check_k23`); weight bytes 256s + 4k + 8 <= u[r].q.len() (`check_k23`).
                unsafe {
                    let (y0, y1) = (qs.add((64 * s + k) * TILE * 4), qs.add((64 * s + k + 1) * TILE * 4));
                    for r in 0..R {
                        let w = u[r].q.as_ptr().add(256 * s + 4 * k);
                        p0[r] = acc(p0[r], w, y0);
                        p1[r] = acc(p1[r], w.add(4), y1);
                    }
                }
            }
            let mins = group_terms::<R>(u, tile, g, s);
            // SAFETY: s < sbs, so TILE values end within tiles * sbs * TILE <= d.len() (`check_k23`).
            let da = unsafe { _mm256_loadu_ps(tile.d.as_ptr().add((g * sbs + s) * TILE)) };
            for r in 0..R {
                let p = _mm256_add_epi32(p0[r], p1[r]);
                total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(_mm256_set1_ps(u[r].d[s]), da), total[r]);
                totalm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins[r]), _mm256_mul_ps(_mm256_set1_ps(u[r].dmin[s]), da), totalm[r]);
            }
        }
        for r in 0..R {
            store(&mut out[r * n..(r + 1) * n], g, n, _mm256_sub_ps(total[r], totalm[r]));
        }
    }
}

/// `R` Q3_K rows (unpacked) × the tiles from `first` on: `out[r * n + t]`. Per group of 16,
/// `acc` adds one weight dword's products to `p` and `scale(p, s)` turns the group's four into
/// i32 lanes times its scale.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q3_k_body<const R: usize>(
    u: &[Unpacked],
    sbs: usize,
    first: usize,
    tile: &ActTile<'_>,
    out: &mut [f32],
    acc: impl Fn(__m256i, *const u8, *const i8) -> __m256i,
    scale: impl Fn(__m256i, i32) -> __m256i,
) {
    check_k23::<R>(u, sbs, tile, out, true);
    let (dwords, n) = (tile.cols / 4, tile.n);
    for g in first..tile.tiles() {
        let qs = tile.qs[g * dwords * TILE * 4..].as_ptr();
        let mut total = [_mm256_setzero_ps(); R];
        for s in 0..sbs {
            let mut sumi = [_mm256_setzero_si256(); R];
            for grp in 0..16 {
                let mut p = [_mm256_setzero_si256(); R];
                for k in 0..4 {
                    let e = 256 * s + 16 * grp + 4 * k;
                    // SAFETY: dword e / 4 < 64 * sbs <= dwords of tile g, which `qs` holds;
                    // weight bytes e + 4 <= 256 * sbs <= u[r].q.len() (`check_k23`).
                    unsafe {
                        let y = qs.add(e / 4 * TILE * 4);
                        for r in 0..R {
                            p[r] = acc(p[r], u[r].q.as_ptr().add(e), y);
                        }
                    }
                }
                for r in 0..R {
                    sumi[r] = _mm256_add_epi32(sumi[r], scale(p[r], u[r].sc[16 * s + grp]));
                }
            }
            let offsets = group_terms::<R>(u, tile, g, s);
            for r in 0..R {
                sumi[r] = _mm256_sub_epi32(sumi[r], offsets[r]);
            }
            // SAFETY: as in `q2_k_body`.
            let da = unsafe { _mm256_loadu_ps(tile.d.as_ptr().add((g * sbs + s) * TILE)) };
            for r in 0..R {
                total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_mul_ps(_mm256_set1_ps(u[r].d[s]), da), total[r]);
            }
        }
        for r in 0..R {
            store(&mut out[r * n..(r + 1) * n], g, n, total[r]);
        }
    }
}

/// AVX2 products of unsigned weight bytes (at most 45) with the tokens' signed ones, widened
/// to i32 at once (two `maddubs` pairs of Q2_K's could overflow i16 when summed further).
///
/// # Safety
/// `x` valid for 4 bytes, `y` for 32; the CPU must support AVX2.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn acc32_avx2(p: __m256i, x: *const u8, y: *const i8) -> __m256i {
    // SAFETY: as the caller guarantees.
    let (x, y) = unsafe { (bcast(x), load(y)) };
    _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1)))
}

thread_local! {
    /// An interleaved group's eight rows unpacked ([`unpack_q2_k_group`]).
    static GROUP_UNPACKED: RefCell<[Unpacked; 8]> = RefCell::new(Default::default());
}

macro_rules! kernels {
    ($(#[$doc:meta])* $one:ident, $rows:ident, $group:ident, $features:literal, $unpack:ident, $unpack_group:ident,
     |$u:ident, $sbs:ident, $tile:ident, $out:ident, $r:ident| $body:expr) => {
        $(#[$doc])*
        ///
        /// # Safety
        #[doc = concat!("The CPU must support ", $features, ".")]
        #[target_feature(enable = $features)]
        pub unsafe fn $one(w: &[u8], $tile: &ActTile<'_>, $out: &mut [f32]) {
            const $r: usize = 1;
            // SAFETY: this function's caller guarantees the features the body's kernels need.
            with_unpacked([w], |w, u| $unpack(w, u), |$u, $sbs| unsafe { $body })
        }

        $(#[$doc])*
        /// [`ROWS`] rows at once: each token dword loaded feeds them all.
        ///
        /// # Safety
        #[doc = concat!("The CPU must support ", $features, "; rows of equal length.")]
        #[target_feature(enable = $features)]
        pub unsafe fn $rows(w: [&[u8]; ROWS], $tile: &ActTile<'_>, $out: &mut [f32]) {
            const $r: usize = ROWS;
            // SAFETY: as above.
            with_unpacked(w, |w, u| $unpack(w, u), |$u, $sbs| unsafe { $body })
        }

        $(#[$doc])*
        /// The eight rows of an interleaved group ([`smoe_quant::interleave`]), unpacked
        /// from it as it lies, then [`ROWS`] at a time: the bits of the rows taken apart.
        ///
        /// # Safety
        #[doc = concat!("The CPU must support ", $features, ".")]
        #[target_feature(enable = $features)]
        pub unsafe fn $group(w: &[u8], $tile: &ActTile<'_>, out: &mut [f32]) {
            const $r: usize = ROWS;
            const _: () = assert!(2 * ROWS == 8);
            GROUP_UNPACKED.with(|u| {
                let u = &mut *u.borrow_mut();
                let $sbs = $unpack_group(w, u);
                let (lo, hi) = out.split_at_mut(ROWS * $tile.n);
                for (rows, $out) in [(&u[..ROWS], lo), (&u[ROWS..], &mut hi[..ROWS * $tile.n])] {
                    let $u = rows;
                    // SAFETY: as above.
                    unsafe { $body }
                }
            })
        }
    };
}

/// `p · s` for i32 lanes `p` that fit in i16 (a Q3_K group's sum: at most 16·7·127), as one
/// `madd` of each lane's low half with `s` (its high half, 0 or −1, meets a zero).
pub(super) fn i16_scale(s: i32) -> i32 {
    s as i16 as u16 as i32
}

kernels!(
    /// Q2_K rows × tokens with VNNI (`vpdpbusd` per weight dword; pairs of tiles in 512-bit
    /// registers, then a last odd tile).
    q2_k_vnni, q2_k_vnni_rows, q2_k_vnni_group, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", unpack_q2_k, unpack_q2_k_group,
    |u, sbs, tile, out, R| {
        let done = super::gemm512::q2_k_pairs::<R>(u, sbs, tile, out);
        q2_k_body::<R>(u, sbs, done, tile, out, |p, x, y| dot4_vnni(p, x, y))
    }
);
kernels!(
    /// Q2_K rows × tokens with AVX2.
    q2_k_avx2, q2_k_avx2_rows, q2_k_avx2_group, "avx2,fma,f16c", unpack_q2_k, unpack_q2_k_group,
    |u, sbs, tile, out, R| q2_k_body::<R>(u, sbs, 0, tile, out, |p, x, y| acc32_avx2(p, x, y))
);
kernels!(
    /// Q3_K rows × tokens with VNNI (`vpdpbusd` per weight dword, the scale through `madd`;
    /// pairs of tiles in 512-bit registers, then a last odd tile).
    q3_k_vnni, q3_k_vnni_rows, q3_k_vnni_group, "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni", unpack_q3_k, unpack_q3_k_group,
    |u, sbs, tile, out, R| {
        let done = super::gemm512::q3_k_pairs::<R>(u, sbs, tile, out);
        q3_k_body::<R>(u, sbs, done, tile, out, |p, x, y| dot4_vnni(p, x, y), |p, s| _mm256_madd_epi16(p, _mm256_set1_epi32(i16_scale(s))))
    }
);
kernels!(
    /// Q3_K rows × tokens with AVX2 (the scale through `madd`).
    q3_k_avx2, q3_k_avx2_rows, q3_k_avx2_group, "avx2,fma,f16c", unpack_q3_k, unpack_q3_k_group,
    |u, sbs, tile, out, R| q3_k_body::<R>(u, sbs, 0, tile, out, |p, x, y| acc_avx2(p, x, y), |p, s| _mm256_madd_epi16(p, _mm256_set1_epi16(s as i16)))
);
