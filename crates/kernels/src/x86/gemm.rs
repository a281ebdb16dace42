//! x86 many-token kernels (see [`crate::gemm`]): a weight row, unpacked once, against tiles of
//! 8 interleaved tokens.

use super::{f16x8, k4_scales};
use crate::gemm::{ActTile, ROWS, TILE};
use smoe_quant::blocks::{BlockQ4K, BlockQ8_0};
use std::arch::x86_64::*;
use std::cell::RefCell;

thread_local! {
    /// The unpacked weight row, its per-block f32 scales and (Q4_K) integer scales and mins.
    static ROW: RefCell<Unpacked> = RefCell::new(Unpacked::default());
}

#[derive(Default)]
struct Unpacked {
    q: Vec<u8>,
    d: Vec<f32>,
    dmin: Vec<f32>,
    sc: Vec<i32>,
    mins: Vec<i32>,
}

/// Four bytes at `p` as one i32, broadcast to all 8 lanes.
///
/// # Safety
/// `p` must be valid for 4 bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn bcast(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 4 readable bytes.
    _mm256_set1_epi32(unsafe { (p as *const i32).read_unaligned() })
}

/// 32 bytes at `p`.
///
/// # Safety
/// `p` must be valid for 32 bytes.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn load(p: *const i8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

fn store(out: &mut [f32], g: usize, n: usize, v: __m256) {
    let mut a = [0f32; 8];
    // SAFETY: 8-element array; `store` is only called from functions that enabled AVX.
    unsafe { _mm256_storeu_ps(a.as_mut_ptr(), v) };
    let m = TILE.min(n - g * TILE);
    out[g * TILE..g * TILE + m].copy_from_slice(&a[..m]);
}

/// Unpacks a Q8_0 row: quants (optionally biased by +128) and scales as f32.
#[target_feature(enable = "avx2,f16c")]
fn unpack_q8_0(w: &[u8], bias: bool, u: &mut Unpacked) {
    let wb: &[BlockQ8_0] = bytemuck::cast_slice(w);
    u.q.resize(32 * wb.len(), 0);
    u.d.resize(wb.len().div_ceil(8) * 8, 0.0);
    let flip = _mm256_set1_epi8(if bias { -128 } else { 0 });
    for (i, chunk) in wb.chunks(8).enumerate() {
        let mut h = [0u16; 8];
        for (j, b) in chunk.iter().enumerate() {
            h[j] = u16::from_le_bytes(b.d.0);
            // SAFETY: 32 quants in, 32 bytes out at 32 * (8i + j) < q.len().
            unsafe {
                let v = _mm256_xor_si256(_mm256_loadu_si256(b.qs.as_ptr() as *const __m256i), flip);
                _mm256_storeu_si256(u.q.as_mut_ptr().add(32 * (8 * i + j)) as *mut __m256i, v);
            }
        }
        // SAFETY: d has room for 8 floats at 8i (rounded up above).
        unsafe { _mm256_storeu_ps(u.d.as_mut_ptr().add(8 * i), f16x8(&h)) };
    }
}

/// Q8_0 row × tokens. `vnni`: `vpdpbusd` on the +128-biased weights, the bias removed through
/// the tokens' quant sums; otherwise |w| × (a · sign w) through `maddubs`.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q8_0_body(u: &Unpacked, tile: &ActTile, out: &mut [f32], dot4: impl Fn(__m256i, *const u8, *const i8) -> __m256i, vnni: bool) {
    let blocks = tile.cols / 32;
    let dwords = tile.cols / 4;
    assert!(u.q.len() >= tile.cols && tile.qs.len() >= tile.tiles() * dwords * TILE * 4);
    for g in 0..tile.tiles() {
        let qs = tile.qs[g * dwords * TILE * 4..].as_ptr();
        let mut acc = _mm256_setzero_ps();
        for b in 0..blocks {
            let mut p = _mm256_setzero_si256();
            for k in 0..8 {
                // SAFETY: weights 32b + 4k + 4 <= cols <= q.len(); tile offset (8b + k) * 32 + 32
                // <= dwords * 32 (asserted above).
                p = dot4(p, unsafe { u.q.as_ptr().add(32 * b + 4 * k) }, unsafe { qs.add((8 * b + k) * TILE * 4) });
            }
            let row = (g * blocks + b) * TILE;
            // SAFETY: `sums` and `d` hold TILE values per (tile, block).
            let (sums, da) =
                unsafe { (_mm256_loadu_si256(tile.sums.as_ptr().add(row) as *const __m256i), _mm256_loadu_ps(tile.d.as_ptr().add(row))) };
            if vnni {
                p = _mm256_sub_epi32(p, _mm256_slli_epi32::<7>(sums));
            }
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(_mm256_set1_ps(u.d[b]), da), acc);
        }
        store(out, g, tile.n, acc);
    }
}

/// Q8_0 row × tokens with VNNI.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512VL and AVX-512 VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn q8_0_vnni(w: &[u8], tile: &ActTile, out: &mut [f32]) {
    ROW.with(|u| {
        let u = &mut *u.borrow_mut();
        unpack_q8_0(w, true, u);
        // SAFETY (closure): q8_0_body passes pointers valid for 4 and 32 bytes.
        q8_0_body(u, tile, out, |p, x, y| unsafe { _mm256_dpbusd_epi32(p, bcast(x), load(y)) }, true);
    })
}

/// Q8_0 row × tokens with AVX2.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q8_0_avx2(w: &[u8], tile: &ActTile, out: &mut [f32]) {
    ROW.with(|u| {
        let u = &mut *u.borrow_mut();
        unpack_q8_0(w, false, u);
        let ones = _mm256_set1_epi16(1);
        q8_0_body(
            u,
            tile,
            out,
            // SAFETY (closure): q8_0_body passes pointers valid for 4 and 32 bytes.
            |p, x, y| unsafe {
                let (x, y) = (bcast(x), load(y));
                _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x)), ones))
            },
            false,
        );
    })
}

/// Unpacks a Q4_K row: nibbles to bytes in element order; per super-block d and dmin, and the
/// eight group scales and mins.
#[target_feature(enable = "avx2,f16c")]
fn unpack_q4_k(w: &[u8], u: &mut Unpacked) -> usize {
    let wb: &[BlockQ4K] = bytemuck::cast_slice(w);
    u.q.resize(256 * wb.len(), 0);
    u.d.clear();
    u.dmin.clear();
    u.sc.clear();
    u.mins.clear();
    let mask = _mm256_set1_epi8(0x0f);
    for (i, b) in wb.iter().enumerate() {
        for c in 0..4 {
            // SAFETY: 32 bytes of nibbles in; 64 bytes out at 256i + 64c < q.len().
            unsafe {
                let v = _mm256_loadu_si256(b.qs.as_ptr().add(32 * c) as *const __m256i);
                let o = u.q.as_mut_ptr().add(256 * i + 64 * c);
                _mm256_storeu_si256(o as *mut __m256i, _mm256_and_si256(v, mask));
                _mm256_storeu_si256(o.add(32) as *mut __m256i, _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask));
            }
        }
        let dd = f16x8(&[u16::from_le_bytes(b.d.0), u16::from_le_bytes(b.dmin.0), 0, 0, 0, 0, 0, 0]);
        let mut f = [0f32; 8];
        // SAFETY: 8-element array.
        unsafe { _mm256_storeu_ps(f.as_mut_ptr(), dd) };
        u.d.push(f[0]);
        u.dmin.push(f[1]);
        let sm = k4_scales(&b.scales);
        u.sc.extend(sm[..8].iter().map(|&x| x as i32));
        u.mins.extend(sm[8..].iter().map(|&x| x as i32));
    }
    wb.len()
}

/// Q4_K row × tokens. Per group of 32: `group_dot` sums the 8 dwords' products for the 8 tokens
/// and applies the group scale; the minimums use the tokens' sums per group.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q4_k_body(u: &Unpacked, sbs: usize, tile: &ActTile, out: &mut [f32], group_dot: impl Fn(*const u8, *const i8, i32) -> __m256i) {
    let dwords = tile.cols / 4;
    let groups = tile.cols / 32;
    assert!(u.q.len() >= 256 * sbs && tile.qs.len() >= tile.tiles() * dwords * TILE * 4 && u.sc.len() >= 8 * sbs);
    for g in 0..tile.tiles() {
        let qs = tile.qs[g * dwords * TILE * 4..].as_ptr();
        let (mut acc, mut accm) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        for s in 0..sbs {
            let mut sumi = _mm256_setzero_si256();
            let mut mins = _mm256_setzero_si256();
            for j in 0..8 {
                let e = 256 * s + 32 * j;
                // SAFETY: weights e + 32 <= q.len(); tile offset (e / 4 + 8) * 32 <= dwords * 32.
                sumi = _mm256_add_epi32(
                    sumi,
                    group_dot(unsafe { u.q.as_ptr().add(e) }, unsafe { qs.add((e / 4) * TILE * 4) }, u.sc[8 * s + j]),
                );
                // SAFETY: `sums` holds TILE values per (tile, group).
                let gs = unsafe { _mm256_loadu_si256(tile.sums.as_ptr().add((g * groups + 8 * s + j) * TILE) as *const __m256i) };
                mins = _mm256_add_epi32(mins, _mm256_mullo_epi32(gs, _mm256_set1_epi32(u.mins[8 * s + j])));
            }
            // SAFETY: `d` holds TILE values per (tile, super-block).
            let da = unsafe { _mm256_loadu_ps(tile.d.as_ptr().add((g * sbs + s) * TILE)) };
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(_mm256_set1_ps(u.d[s]), da), acc);
            accm = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins), _mm256_mul_ps(_mm256_set1_ps(u.dmin[s]), da), accm);
        }
        store(out, g, tile.n, _mm256_sub_ps(acc, accm));
    }
}

/// Q4_K row × tokens with AVX2: eight `maddubs` summed in i16 (at most 8·2·15·127 < 2¹⁵), then
/// one `madd` that applies the group's scale.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4_k_avx2(w: &[u8], tile: &ActTile, out: &mut [f32]) {
    ROW.with(|u| {
        let u = &mut *u.borrow_mut();
        let sbs = unpack_q4_k(w, u);
        // SAFETY (closure): q4_k_body passes pointers valid for 32 weight bytes and 8 tile dwords.
        q4_k_body(u, sbs, tile, out, |x, y, sc| unsafe {
            let mut p16 = _mm256_setzero_si256();
            for k in 0..8 {
                p16 = _mm256_add_epi16(p16, _mm256_maddubs_epi16(bcast(x.add(4 * k)), load(y.add(k * TILE * 4))));
            }
            _mm256_madd_epi16(p16, _mm256_set1_epi16(sc as i16))
        });
    })
}

/// Q4_K row × tokens with VNNI: `vpdpbusd` per group, then the group scale.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512VL and AVX-512 VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn q4_k_vnni(w: &[u8], tile: &ActTile, out: &mut [f32]) {
    ROW.with(|u| {
        let u = &mut *u.borrow_mut();
        let sbs = unpack_q4_k(w, u);
        // SAFETY (closure): q4_k_body passes pointers valid for 32 weight bytes and 8 tile dwords.
        q4_k_body(u, sbs, tile, out, |x, y, sc| unsafe {
            let mut p = _mm256_setzero_si256();
            for k in 0..8 {
                p = _mm256_dpbusd_epi32(p, bcast(x.add(4 * k)), load(y.add(k * TILE * 4)));
            }
            _mm256_mullo_epi32(p, _mm256_set1_epi32(sc))
        });
    })
}

thread_local! {
    /// The unpacked rows of a [`ROWS`]-row kernel.
    static ROWS4: RefCell<[Unpacked; ROWS]> = RefCell::new(Default::default());
}

/// [`ROWS`] Q8_0 rows × tokens with VNNI: each tile dword is loaded once for all the rows.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512VL and AVX-512 VNNI; rows of equal length.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn q8_0_vnni_rows(w: [&[u8]; ROWS], tile: &ActTile, out: &mut [f32]) {
    ROWS4.with(|u| {
        let u = &mut *u.borrow_mut();
        for (r, w) in w.iter().enumerate() {
            unpack_q8_0(w, true, &mut u[r]);
        }
        let (blocks, dwords, n) = (tile.cols / 32, tile.cols / 4, tile.n);
        assert!(u.iter().all(|u| u.q.len() >= tile.cols) && tile.qs.len() >= tile.tiles() * dwords * TILE * 4 && out.len() >= ROWS * n);
        for g in 0..tile.tiles() {
            let qs = tile.qs[g * dwords * TILE * 4..].as_ptr();
            let mut acc = [_mm256_setzero_ps(); ROWS];
            for b in 0..blocks {
                let mut p = [_mm256_setzero_si256(); ROWS];
                for k in 0..8 {
                    // SAFETY: tile offset (8b + k) * 32 + 32 <= dwords * 32 (asserted above).
                    let y = unsafe { load(qs.add((8 * b + k) * TILE * 4)) };
                    for r in 0..ROWS {
                        // SAFETY: weights 32b + 4k + 4 <= cols <= q.len().
                        p[r] = _mm256_dpbusd_epi32(p[r], unsafe { bcast(u[r].q.as_ptr().add(32 * b + 4 * k)) }, y);
                    }
                }
                let row = (g * blocks + b) * TILE;
                // SAFETY: `sums` and `d` hold TILE values per (tile, block).
                let (sums, da) = unsafe {
                    (_mm256_loadu_si256(tile.sums.as_ptr().add(row) as *const __m256i), _mm256_loadu_ps(tile.d.as_ptr().add(row)))
                };
                let bias = _mm256_slli_epi32::<7>(sums);
                for r in 0..ROWS {
                    let v = _mm256_cvtepi32_ps(_mm256_sub_epi32(p[r], bias));
                    acc[r] = _mm256_fmadd_ps(v, _mm256_mul_ps(_mm256_set1_ps(u[r].d[b]), da), acc[r]);
                }
            }
            for (r, a) in acc.into_iter().enumerate() {
                store(&mut out[r * n..(r + 1) * n], g, n, a);
            }
        }
    })
}

/// [`ROWS`] Q4_K rows × tokens with VNNI: each tile dword is loaded once for all the rows.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512VL and AVX-512 VNNI; rows of equal length.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn q4_k_vnni_rows(w: [&[u8]; ROWS], tile: &ActTile, out: &mut [f32]) {
    ROWS4.with(|u| {
        let u = &mut *u.borrow_mut();
        let mut sbs = 0;
        for (r, w) in w.iter().enumerate() {
            sbs = unpack_q4_k(w, &mut u[r]);
        }
        let (dwords, groups, n) = (tile.cols / 4, tile.cols / 32, tile.n);
        assert!(
            u.iter().all(|u| u.q.len() >= 256 * sbs && u.sc.len() >= 8 * sbs)
                && tile.qs.len() >= tile.tiles() * dwords * TILE * 4
                && out.len() >= ROWS * n
        );
        for g in 0..tile.tiles() {
            let qs = tile.qs[g * dwords * TILE * 4..].as_ptr();
            let (mut acc, mut accm) = ([_mm256_setzero_ps(); ROWS], [_mm256_setzero_ps(); ROWS]);
            for s in 0..sbs {
                let (mut sumi, mut mins) = ([_mm256_setzero_si256(); ROWS], [_mm256_setzero_si256(); ROWS]);
                for j in 0..8 {
                    let e = 256 * s + 32 * j;
                    let mut p = [_mm256_setzero_si256(); ROWS];
                    for k in 0..8 {
                        // SAFETY: tile offset (e / 4 + k) * 32 + 32 <= dwords * 32 (asserted above).
                        let y = unsafe { load(qs.add((e / 4 + k) * TILE * 4)) };
                        for r in 0..ROWS {
                            // SAFETY: weights e + 4k + 4 <= 256 * sbs <= q.len().
                            p[r] = _mm256_dpbusd_epi32(p[r], unsafe { bcast(u[r].q.as_ptr().add(e + 4 * k)) }, y);
                        }
                    }
                    // SAFETY: `sums` holds TILE values per (tile, group).
                    let gs = unsafe { _mm256_loadu_si256(tile.sums.as_ptr().add((g * groups + 8 * s + j) * TILE) as *const __m256i) };
                    for r in 0..ROWS {
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_mullo_epi32(p[r], _mm256_set1_epi32(u[r].sc[8 * s + j])));
                        mins[r] = _mm256_add_epi32(mins[r], _mm256_mullo_epi32(gs, _mm256_set1_epi32(u[r].mins[8 * s + j])));
                    }
                }
                // SAFETY: `d` holds TILE values per (tile, super-block).
                let da = unsafe { _mm256_loadu_ps(tile.d.as_ptr().add((g * sbs + s) * TILE)) };
                for r in 0..ROWS {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_mul_ps(_mm256_set1_ps(u[r].d[s]), da), acc[r]);
                    accm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins[r]), _mm256_mul_ps(_mm256_set1_ps(u[r].dmin[s]), da), accm[r]);
                }
            }
            for r in 0..ROWS {
                store(&mut out[r * n..(r + 1) * n], g, n, _mm256_sub_ps(acc[r], accm[r]));
            }
        }
    })
}
