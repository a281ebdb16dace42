//! x86 many-token kernels (see [`crate::gemm`]): weight rows, unpacked once, against tiles of
//! 8 interleaved tokens. Each format has one body generic in the number of rows `R` (1 for
//! [`crate::gemm::GemmRow`], [`ROWS`] for [`crate::gemm::GemmRows`]): every tile dword is loaded
//! once and feeds all `R` rows.

use super::{f16x8, k4_scales};
use crate::gemm::{ActTile, ROWS, TILE};
use smoe_quant::blocks::{BlockQ4K, BlockQ8_0};
use smoe_quant::interleave::{GROUP_BLOCK, ROWS as GROUP};
use std::arch::x86_64::*;
use std::cell::RefCell;

thread_local! {
    /// The unpacked weight rows (one, or [`ROWS`]): quants, per-block f32 scales and (Q4_K)
    /// integer scales and mins. An interleaved group unpacks into the first, all its rows
    /// interleaved as they lie ([`Q4kRows`]).
    static UNPACKED: RefCell<[Unpacked; ROWS]> = RefCell::new(Default::default());
}

/// `R` Q4_K rows as the bodies read them, their values interleaved `K` ways: `K` = 1 for
/// rows unpacked one by one ([`unpack_q4_k`]), [`GROUP`] for an interleaved group unpacked as
/// it lies ([`unpack_q4_k_group`]), which spares taking the group apart. Row `r`'s quant
/// dword `i` (weights `4i..4i + 4`) is at `q[r][4K·i]`, its group `j`'s scale and min at
/// `sc[r][K·j]` and `mins[r][K·j]`, its super-block `s`'s `d` and `dmin` at `d[r][K·s]` and
/// `dmin[r][K·s]`.
pub(super) struct Q4kRows<'a, const R: usize, const K: usize> {
    q: [&'a [u8]; R],
    sc: [&'a [i32]; R],
    mins: [&'a [i32]; R],
    d: [&'a [f32]; R],
    dmin: [&'a [f32]; R],
}

impl<const R: usize, const K: usize> Q4kRows<'_, R, K> {
    /// Whether every row holds `sbs` super-blocks.
    pub(super) fn holds(&self, sbs: usize) -> bool {
        let has = |len: usize, n: usize| (n - 1) * K < len;
        sbs == 0
            || (0..R).all(|r| {
                (64 * sbs - 1) * 4 * K + 4 <= self.q[r].len()
                    && has(self.sc[r].len(), 8 * sbs)
                    && has(self.mins[r].len(), 8 * sbs)
                    && has(self.d[r].len(), sbs)
                    && has(self.dmin[r].len(), sbs)
            })
    }

    /// Row `r`'s quant dword `i`.
    ///
    /// # Safety
    /// `i` must be below `64 * sbs` for an `sbs` that [`Q4kRows::holds`] accepted.
    #[inline(always)]
    pub(super) unsafe fn quant(&self, r: usize, i: usize) -> *const u8 {
        // SAFETY: in bounds, as the caller guarantees.
        unsafe { self.q[r].as_ptr().add(4 * K * i) }
    }

    /// Row `r`'s scale and min of group `j`.
    #[inline(always)]
    pub(super) fn scale_min(&self, r: usize, j: usize) -> (i32, i32) {
        (self.sc[r][K * j], self.mins[r][K * j])
    }

    /// Row `r`'s `d` and `dmin` of super-block `s`.
    #[inline(always)]
    pub(super) fn d_dmin(&self, r: usize, s: usize) -> (f32, f32) {
        (self.d[r][K * s], self.dmin[r][K * s])
    }
}

#[derive(Default)]
pub(super) struct Unpacked {
    pub(super) q: Vec<u8>,
    pub(super) d: Vec<f32>,
    pub(super) dmin: Vec<f32>,
    pub(super) sc: Vec<i32>,
    pub(super) mins: Vec<i32>,
}

impl Unpacked {
    /// Ready for a row of `sbs` super-blocks of 256: room for its quants, the per-block and
    /// per-group lists emptied for the unpacker to fill.
    pub(super) fn start_k(&mut self, sbs: usize) {
        self.q.resize(256 * sbs, 0);
        self.d.clear();
        self.dmin.clear();
        self.sc.clear();
        self.mins.clear();
    }
}

/// Four bytes at `p` as one i32, broadcast to all 8 lanes.
///
/// # Safety
/// `p` must be valid for 4 bytes.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn bcast(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 4 readable bytes.
    _mm256_set1_epi32(unsafe { (p as *const i32).read_unaligned() })
}

/// 32 bytes at `p`.
///
/// # Safety
/// `p` must be valid for 32 bytes.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn load(p: *const i8) -> __m256i {
    // SAFETY: the caller guarantees 32 readable bytes.
    unsafe { _mm256_loadu_si256(p as *const __m256i) }
}

pub(super) fn store(out: &mut [f32], g: usize, n: usize, v: __m256) {
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

/// `R` Q8_0 rows × tokens: `out[r * n + t]`. `dot4(p, w, a)` adds one weight dword's products
/// with the 8 tokens' dwords at `a` to `p`; with `vnni` the weights were biased by +128 and the
/// bias is removed through the tokens' quant sums.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q8_0_body<const R: usize>(
    u: &[Unpacked],
    first: usize,
    tile: &ActTile<'_>,
    out: &mut [f32],
    dot4: impl Fn(__m256i, *const u8, *const i8) -> __m256i,
    vnni: bool,
) {
    let (blocks, dwords, n) = (tile.cols / 32, tile.cols / 4, tile.n);
    assert!(u.len() >= R && u[..R].iter().all(|u| u.q.len() >= tile.cols) && out.len() >= R * n);
    assert!(tile.qs.len() >= tile.tiles() * dwords * TILE * 4);
    assert!(tile.sums.len() >= tile.tiles() * blocks * TILE && tile.d.len() >= tile.tiles() * blocks * TILE);
    for g in first..tile.tiles() {
        let qs = tile.qs[g * dwords * TILE * 4..].as_ptr();
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..blocks {
            let mut p = [_mm256_setzero_si256(); R];
            for k in 0..8 {
                // SAFETY: tile `g`'s dwords start at `qs` and hold dwords * 32 bytes (second
                // assert, g < tiles); dword 8b + k ends at (8b + k) * 32 + 32 <= dwords * 32.
                let y = unsafe { qs.add((8 * b + k) * TILE * 4) };
                for r in 0..R {
                    // SAFETY: weight dword 32b + 4k ends at 32b + 4k + 4 <= cols <= u[r].q.len()
                    // (first assert).
                    p[r] = dot4(p[r], unsafe { u[r].q.as_ptr().add(32 * b + 4 * k) }, y);
                }
            }
            let row = (g * blocks + b) * TILE;
            // SAFETY: row + TILE <= tiles * blocks * TILE <= sums.len(), d.len() (third assert).
            let (sums, da) =
                unsafe { (_mm256_loadu_si256(tile.sums.as_ptr().add(row) as *const __m256i), _mm256_loadu_ps(tile.d.as_ptr().add(row))) };
            let bias = if vnni { _mm256_slli_epi32::<7>(sums) } else { _mm256_setzero_si256() };
            for r in 0..R {
                let v = _mm256_cvtepi32_ps(_mm256_sub_epi32(p[r], bias));
                acc[r] = _mm256_fmadd_ps(v, _mm256_mul_ps(_mm256_set1_ps(u[r].d[b]), da), acc[r]);
            }
        }
        for (r, a) in acc.into_iter().enumerate() {
            store(&mut out[r * n..(r + 1) * n], g, n, a);
        }
    }
}

/// `vpdpbusd` of a broadcast weight dword (biased to unsigned) with 8 tokens' dwords.
///
/// # Safety
/// `x` valid for 4 bytes, `y` for 32; the CPU must support AVX-512VL and AVX-512 VNNI.
#[target_feature(enable = "avx2,avx512f,avx512vl,avx512vnni")]
#[inline]
pub(super) unsafe fn dot4_vnni(p: __m256i, x: *const u8, y: *const i8) -> __m256i {
    // SAFETY: as the caller guarantees.
    unsafe { _mm256_dpbusd_epi32(p, bcast(x), load(y)) }
}

/// |w| × (a · sign w) through `maddubs`, summed into i32 lanes.
///
/// # Safety
/// `x` valid for 4 bytes, `y` for 32; the CPU must support AVX2.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn dot4_avx2(p: __m256i, x: *const u8, y: *const i8) -> __m256i {
    // SAFETY: as the caller guarantees.
    let (x, y) = unsafe { (bcast(x), load(y)) };
    _mm256_add_epi32(p, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(x, x), _mm256_sign_epi8(y, x)), _mm256_set1_epi16(1)))
}

/// Unpacks `w`'s rows into the thread's buffers with `unpack` and runs `body` on them.
pub(super) fn with_unpacked<const R: usize, T>(
    w: [&[u8]; R],
    unpack: impl Fn(&[u8], &mut Unpacked) -> T,
    body: impl FnOnce(&[Unpacked], T),
) {
    UNPACKED.with(|u| {
        let u = &mut *u.borrow_mut();
        let mut last = None;
        for (r, w) in w.iter().enumerate() {
            last = Some(unpack(w, &mut u[r]));
        }
        body(&u[..R], last.expect("at least one row"));
    })
}

/// Q8_0 row × tokens with VNNI.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512VL and AVX-512 VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn q8_0_vnni(w: &[u8], tile: &ActTile<'_>, out: &mut [f32]) {
    with_unpacked(
        [w],
        |w, u| unpack_q8_0(w, true, u),
        // SAFETY: this function's caller guarantees every feature `q8_0_body` and `dot4_vnni`
        // need; `q8_0_body` calls `dot4` only with 4 readable weight bytes and 32 tile bytes.
        |u, ()| unsafe { q8_0_body::<1>(u, 0, tile, out, |p, x, y| dot4_vnni(p, x, y), true) },
    )
}

/// [`ROWS`] Q8_0 rows × tokens with VNNI.
///
/// # Safety
/// As [`q8_0_vnni`]; rows of equal length.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn q8_0_vnni_rows(w: [&[u8]; ROWS], tile: &ActTile<'_>, out: &mut [f32]) {
    with_unpacked(
        w,
        |w, u| unpack_q8_0(w, true, u),
        // SAFETY: as in `q8_0_vnni`; `q8_0_pairs` needs the same AVX-512 features, and checks
        // its own bounds.
        |u, ()| unsafe {
            let done = super::gemm512::q8_0_pairs::<ROWS>(u, tile, out);
            q8_0_body::<ROWS>(u, done, tile, out, |p, x, y| dot4_vnni(p, x, y), true)
        },
    )
}

/// Q8_0 row × tokens with AVX2.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q8_0_avx2(w: &[u8], tile: &ActTile<'_>, out: &mut [f32]) {
    with_unpacked(
        [w],
        |w, u| unpack_q8_0(w, false, u),
        // SAFETY: this function's caller guarantees AVX2, FMA and F16C; `q8_0_body` calls
        // `dot4` only with 4 readable weight bytes and 32 tile bytes.
        |u, ()| unsafe { q8_0_body::<1>(u, 0, tile, out, |p, x, y| dot4_avx2(p, x, y), false) },
    )
}

/// Unpacks a Q4_K row: nibbles to bytes in element order; per super-block d and dmin, and the
/// eight group scales and mins.
#[target_feature(enable = "avx2,f16c")]
fn unpack_q4_k(w: &[u8], u: &mut Unpacked) -> usize {
    let wb: &[BlockQ4K] = bytemuck::cast_slice(w);
    u.start_k(wb.len());
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

/// `R` rows unpacked one by one.
fn row_view<const R: usize>(u: &[Unpacked]) -> Q4kRows<'_, R, 1> {
    Q4kRows {
        q: std::array::from_fn(|r| u[r].q.as_slice()),
        sc: std::array::from_fn(|r| u[r].sc.as_slice()),
        mins: std::array::from_fn(|r| u[r].mins.as_slice()),
        d: std::array::from_fn(|r| u[r].d.as_slice()),
        dmin: std::array::from_fn(|r| u[r].dmin.as_slice()),
    }
}

/// Unpacks an interleaved group of [`GROUP`] Q4_K rows (see [`smoe_quant::interleave`]) as it
/// lies: every 32-byte run of the group's nibbles (one dword of each row) splits into two
/// runs of bytes, and the scale bytes (`[byte][row]`) unpack for all eight rows at once, eight
/// bytes to a `u64`. Returns the super-blocks per row.
#[target_feature(enable = "avx2,f16c")]
pub(super) fn unpack_q4_k_group(w: &[u8], g: &mut Unpacked) -> usize {
    assert!(w.len().is_multiple_of(GROUP_BLOCK), "unpack_q4_k_group: not whole super-blocks");
    let sbs = w.len() / GROUP_BLOCK;
    g.q.resize(GROUP * 256 * sbs, 0);
    g.sc.resize(GROUP * 8 * sbs, 0);
    g.mins.resize(GROUP * 8 * sbs, 0);
    g.d.resize(GROUP * sbs, 0.0);
    g.dmin.resize(GROUP * sbs, 0.0);
    let mask = _mm256_set1_epi8(0x0f);
    // Eight bytes (one per row) widened into eight i32 at `out`.
    let widen = |out: &mut [i32], v: u64| {
        assert!(out.len() >= 8);
        // SAFETY: 8 i32 out, asserted.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(v as i64))) }
    };
    for (b, src) in w.chunks_exact(GROUP_BLOCK).enumerate() {
        let halves = |at: usize| -> [u16; 8] { std::array::from_fn(|r| u16::from_le_bytes([src[at + 2 * r], src[at + 2 * r + 1]])) };
        // SAFETY: 8 floats out at 8b + 8 <= d.len() = dmin.len() (resized above).
        unsafe {
            _mm256_storeu_ps(g.d.as_mut_ptr().add(GROUP * b), f16x8(&halves(0)));
            _mm256_storeu_ps(g.dmin.as_mut_ptr().add(GROUP * b), f16x8(&halves(16)));
        }
        // `k4_scales` with a row per byte: scales and mins 0..4 are the low six bits of bytes
        // 0..4 and 4..8; scales and mins 4..8 take their low four bits from the low and high
        // nibbles of byte 8 + i and their top two from the top of bytes i and 4 + i.
        let by = |j: usize| u64::from_le_bytes(src[32 + 8 * j..40 + 8 * j].try_into().expect("eight bytes"));
        const M6: u64 = 0x3f3f_3f3f_3f3f_3f3f;
        const M4: u64 = 0x0f0f_0f0f_0f0f_0f0f;
        const M2: u64 = 0x0303_0303_0303_0303;
        let at = |j: usize| (8 * b + j) * GROUP;
        for i in 0..4 {
            let (s, m, hi) = (by(i), by(4 + i), by(8 + i));
            widen(&mut g.sc[at(i)..], s & M6);
            widen(&mut g.mins[at(i)..], m & M6);
            widen(&mut g.sc[at(4 + i)..], (hi & M4) | (((s >> 6) & M2) << 4));
            widen(&mut g.mins[at(4 + i)..], ((hi >> 4) & M4) | (((m >> 6) & M2) << 4));
        }
        // Pair c, dword k holds (for every row) weights 64c + 4k.. in its low nibbles and
        // 64c + 32 + 4k.. in its high ones: dwords 16c + k and 16c + 8 + k of the super-block.
        for ck in 0..32 {
            let (c, k) = (ck / 8, ck % 8);
            let (lo, hi) = (64 * b + 16 * c + k, 64 * b + 16 * c + 8 + k);
            // SAFETY: 32 bytes in at 128 + 32ck + 32 <= GROUP_BLOCK; 32 bytes out at 32 * lo
            // and 32 * hi, both below 32 * 64 * sbs = q.len().
            unsafe {
                let v = _mm256_loadu_si256(src.as_ptr().add(128 + 32 * ck) as *const __m256i);
                _mm256_storeu_si256(g.q.as_mut_ptr().add(32 * lo) as *mut __m256i, _mm256_and_si256(v, mask));
                _mm256_storeu_si256(g.q.as_mut_ptr().add(32 * hi) as *mut __m256i, _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask));
            }
        }
    }
    sbs
}

/// Unpacks an interleaved group into the thread's buffers and runs `body` on each half of it
/// ([`ROWS`] rows, and where their outputs go) with the super-blocks per row.
fn with_group(w: &[u8], out: &mut [f32], n: usize, body: impl Fn(&Q4kRows<'_, ROWS, GROUP>, usize, &mut [f32])) {
    const _: () = assert!(GROUP == 2 * ROWS);
    assert!(out.len() >= GROUP * n, "group output too short");
    UNPACKED.with(|cell| {
        let g = &mut cell.borrow_mut()[0];
        // SAFETY: every x86 table that calls this has AVX2 and F16C.
        let sbs = unsafe { unpack_q4_k_group(w, g) };
        for (h, out) in out[..GROUP * n].chunks_exact_mut(ROWS * n).enumerate() {
            let at = |r: usize| ROWS * h + r;
            let view = Q4kRows {
                q: std::array::from_fn(|r| &g.q[4 * at(r)..]),
                sc: std::array::from_fn(|r| &g.sc[at(r)..]),
                mins: std::array::from_fn(|r| &g.mins[at(r)..]),
                d: std::array::from_fn(|r| &g.d[at(r)..]),
                dmin: std::array::from_fn(|r| &g.dmin[at(r)..]),
            };
            body(&view, sbs, out);
        }
    })
}

/// `R` Q4_K rows × tokens: `out[r * n + t]`. Per group of 32, `acc(p, w, a)` adds one weight
/// dword's products with the 8 tokens' dwords at `a` to `p`, and `scale(p, sc)` turns the
/// group's eight accumulations into i32 lanes times the group scale; the minimums use the
/// tokens' sums per group.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
fn q4_k_body<const R: usize, const K: usize>(
    v: &Q4kRows<'_, R, K>,
    sbs: usize,
    first: usize,
    tile: &ActTile<'_>,
    out: &mut [f32],
    acc: impl Fn(__m256i, *const u8, *const i8) -> __m256i,
    scale: impl Fn(__m256i, i32) -> __m256i,
) {
    let (dwords, groups, n) = (tile.cols / 4, tile.cols / 32, tile.n);
    assert!(v.holds(sbs) && out.len() >= R * n && groups >= 8 * sbs);
    assert!(tile.qs.len() >= tile.tiles() * dwords * TILE * 4);
    assert!(tile.sums.len() >= tile.tiles() * groups * TILE && tile.d.len() >= tile.tiles() * sbs * TILE);
    for g in first..tile.tiles() {
        let qs = tile.qs[g * dwords * TILE * 4..].as_ptr();
        let (mut total, mut totalm) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
        for s in 0..sbs {
            let (mut sumi, mut mins) = ([_mm256_setzero_si256(); R], [_mm256_setzero_si256(); R]);
            for j in 0..8 {
                let e = 256 * s + 32 * j;
                let mut p = [_mm256_setzero_si256(); R];
                for k in 0..8 {
                    // SAFETY: tile `g`'s dwords start at `qs` and hold dwords * 32 bytes (second
                    // assert, g < tiles); dword e / 4 + k < 64 * sbs <= 8 * groups = dwords
                    // (first assert).
                    let y = unsafe { qs.add((e / 4 + k) * TILE * 4) };
                    for r in 0..R {
                        // SAFETY: dword e / 4 + k < 64 * sbs, and `v.holds(sbs)` (asserted).
                        p[r] = acc(p[r], unsafe { v.quant(r, e / 4 + k) }, y);
                    }
                }
                // SAFETY: group 8s + j < groups, so TILE values end within
                // tiles * groups * TILE <= sums.len() (third assert).
                let gs = unsafe { _mm256_loadu_si256(tile.sums.as_ptr().add((g * groups + 8 * s + j) * TILE) as *const __m256i) };
                for r in 0..R {
                    let (sc, m) = v.scale_min(r, 8 * s + j);
                    sumi[r] = _mm256_add_epi32(sumi[r], scale(p[r], sc));
                    // The two 16-element sums (i16 pairs in `gs`) times the min, added.
                    mins[r] = _mm256_add_epi32(mins[r], _mm256_madd_epi16(gs, _mm256_set1_epi16(m as i16)));
                }
            }
            // SAFETY: s < sbs, so TILE values end within tiles * sbs * TILE <= d.len() (third
            // assert).
            let da = unsafe { _mm256_loadu_ps(tile.d.as_ptr().add((g * sbs + s) * TILE)) };
            for r in 0..R {
                let (d, dmin) = v.d_dmin(r, s);
                total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_mul_ps(_mm256_set1_ps(d), da), total[r]);
                totalm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mins[r]), _mm256_mul_ps(_mm256_set1_ps(dmin), da), totalm[r]);
            }
        }
        for r in 0..R {
            store(&mut out[r * n..(r + 1) * n], g, n, _mm256_sub_ps(total[r], totalm[r]));
        }
    }
}

/// [`q4_k_body`] with AVX2 products ([`acc_avx2`]; the scale through `madd`).
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn body_avx2<const R: usize, const K: usize>(v: &Q4kRows<'_, R, K>, sbs: usize, first: usize, tile: &ActTile<'_>, out: &mut [f32]) {
    // SAFETY: `q4_k_body` calls `acc` only with 4 readable weight bytes at `x` and 32 tile
    // bytes at `y`; AVX2 is guaranteed by this function's caller.
    let acc = |p, x, y| unsafe { acc_avx2(p, x, y) };
    q4_k_body::<R, K>(v, sbs, first, tile, out, acc, |p, sc| _mm256_madd_epi16(p, _mm256_set1_epi16(sc as i16)))
}

/// [`q4_k_body`] with VNNI products ([`dot4_vnni`]; the scale as an i32 multiply).
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512VL and AVX-512 VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
#[inline]
unsafe fn body_vnni<const R: usize, const K: usize>(v: &Q4kRows<'_, R, K>, sbs: usize, first: usize, tile: &ActTile<'_>, out: &mut [f32]) {
    // SAFETY: `q4_k_body` calls `acc` only with 4 readable weight bytes at `x` and 32 tile
    // bytes at `y`; AVX-512VL and VNNI are guaranteed by this function's caller.
    let acc = |p, x, y| unsafe { dot4_vnni(p, x, y) };
    q4_k_body::<R, K>(v, sbs, first, tile, out, acc, |p, sc| _mm256_mullo_epi32(p, _mm256_set1_epi32(sc)))
}

/// AVX2 accumulation of unsigned weight bytes for a scale group: `maddubs` products summed in
/// i16, then one `madd` that applies the group's scale. Q4_K: eight per group, at most
/// 8·2·15·127 < 2¹⁵; Q3_K (`gemm_k23`): four, at most 4·2·7·127.
///
/// # Safety
/// `x` valid for 4 bytes, `y` for 32; the CPU must support AVX2.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) unsafe fn acc_avx2(p: __m256i, x: *const u8, y: *const i8) -> __m256i {
    // SAFETY: the caller guarantees 4 readable bytes at `x` and 32 at `y`, and AVX2.
    let (x, y) = unsafe { (bcast(x), load(y)) };
    _mm256_add_epi16(p, _mm256_maddubs_epi16(x, y))
}

/// Q4_K row × tokens with AVX2.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4_k_avx2(w: &[u8], tile: &ActTile<'_>, out: &mut [f32]) {
    // SAFETY: this function's caller guarantees AVX2, FMA and F16C, all `body_avx2` needs.
    with_unpacked([w], |w, u| unpack_q4_k(w, u), |u, sbs| unsafe { body_avx2::<1, 1>(&row_view(u), sbs, 0, tile, out) })
}

/// [`ROWS`] Q4_K rows × tokens with AVX2.
///
/// # Safety
/// As [`q4_k_avx2`]; rows of equal length.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4_k_avx2_rows(w: [&[u8]; ROWS], tile: &ActTile<'_>, out: &mut [f32]) {
    // SAFETY: as in `q4_k_avx2`.
    with_unpacked(w, |w, u| unpack_q4_k(w, u), |u, sbs| unsafe { body_avx2::<ROWS, 1>(&row_view(u), sbs, 0, tile, out) })
}

/// Q4_K row × tokens with VNNI: `vpdpbusd` per dword, then the group scale.
///
/// # Safety
/// The CPU must support AVX2, FMA, F16C, AVX-512VL and AVX-512 VNNI.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn q4_k_vnni(w: &[u8], tile: &ActTile<'_>, out: &mut [f32]) {
    // SAFETY: this function's caller guarantees every feature `body_vnni` needs.
    with_unpacked([w], |w, u| unpack_q4_k(w, u), |u, sbs| unsafe { body_vnni::<1, 1>(&row_view(u), sbs, 0, tile, out) })
}

/// [`ROWS`] Q4_K rows × tokens with VNNI.
///
/// # Safety
/// As [`q4_k_vnni`]; rows of equal length.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn q4_k_vnni_rows(w: [&[u8]; ROWS], tile: &ActTile<'_>, out: &mut [f32]) {
    with_unpacked(
        w,
        |w, u| unpack_q4_k(w, u),
        // SAFETY: as in `q4_k_vnni`; `q4_k_pairs` needs the same AVX-512 features and checks
        // its own bounds.
        |u, sbs| unsafe {
            let v = row_view(u);
            let done = super::gemm512::q4_k_pairs::<ROWS, 1>(&v, sbs, tile, out);
            body_vnni::<ROWS, 1>(&v, sbs, done, tile, out)
        },
    )
}

/// An interleaved group of [`GROUP`] Q4_K rows × tokens with AVX2: `out[r * n + t]`.
///
/// # Safety
/// As [`q4_k_avx2`]; `w` is whole super-blocks of a group of `tile.cols`.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4_k_avx2_group(w: &[u8], tile: &ActTile<'_>, out: &mut [f32]) {
    assert_eq!(w.len(), GROUP_BLOCK * tile.cols / 256, "q4_k_avx2_group: group and tile differ");
    // SAFETY: as in `q4_k_avx2`.
    with_group(w, out, tile.n, |v, sbs, out| unsafe { body_avx2::<ROWS, GROUP>(v, sbs, 0, tile, out) })
}

/// An interleaved group of [`GROUP`] Q4_K rows × tokens with VNNI: `out[r * n + t]`.
///
/// # Safety
/// As [`q4_k_vnni`]; `w` is whole super-blocks of a group of `tile.cols`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
pub unsafe fn q4_k_vnni_group(w: &[u8], tile: &ActTile<'_>, out: &mut [f32]) {
    assert_eq!(w.len(), GROUP_BLOCK * tile.cols / 256, "q4_k_vnni_group: group and tile differ");
    // SAFETY: as in `q4_k_vnni_rows`.
    with_group(w, out, tile.n, |v, sbs, out| unsafe {
        let done = super::gemm512::q4_k_pairs::<ROWS, GROUP>(v, sbs, tile, out);
        body_vnni::<ROWS, GROUP>(v, sbs, done, tile, out)
    })
}

/// An 8 × 8 matrix of 32-bit values (`r[i]`: row `i`) transposed in registers: `out[k]` is
/// column `k`.
#[target_feature(enable = "avx2")]
#[inline]
pub(super) fn transpose8x8(r: &[__m256; 8]) -> [__m256; 8] {
    let mut t = [_mm256_setzero_ps(); 8];
    for k in 0..4 {
        let (a, b) = (r[2 * k], r[2 * k + 1]);
        t[2 * k] = _mm256_unpacklo_ps(a, b);
        t[2 * k + 1] = _mm256_unpackhi_ps(a, b);
    }
    // s[j] (j < 4): rows 0..4 of column j in its low half and of column j + 4 in its high
    // half; s[4 + j]: the same for rows 4..8.
    let mut s = [_mm256_setzero_ps(); 8];
    for q in 0..2 {
        for h in 0..2 {
            let (a, b) = (t[4 * q + h], t[4 * q + 2 + h]);
            s[4 * q + 2 * h] = _mm256_shuffle_ps::<0x44>(a, b);
            s[4 * q + 2 * h + 1] = _mm256_shuffle_ps::<0xEE>(a, b);
        }
    }
    let mut out = [_mm256_setzero_ps(); 8];
    for (k, o) in out.iter_mut().enumerate() {
        *o = if k < 4 { _mm256_permute2f128_ps::<0x20>(s[k], s[4 + k]) } else { _mm256_permute2f128_ps::<0x31>(s[k - 4], s[k]) };
    }
    out
}

/// AVX2 [`crate::gemm::Transpose8`]: 8 × 8 blocks transposed in registers.
///
/// # Safety
/// The CPU must support AVX2.
#[target_feature(enable = "avx2")]
pub unsafe fn transpose8(src: &[f32], m: usize, n: usize, t0: usize, out: &mut [&mut [f32]; 8]) {
    assert!(t0 + 8 <= n && src.len() >= m * n && out.iter().all(|o| o.len() >= m), "transpose8: bad shape");
    let full = m / 8 * 8;
    for i0 in (0..full).step_by(8) {
        // SAFETY: row i0 + k's tokens t0..t0 + 8 end at (i0 + k) * n + t0 + 8 <= m * n.
        // Plain loops, not `array::from_fn`: its closure is not compiled with this function's
        // target features, so the intrinsics inside it would be calls instead of instructions.
        let mut r = [_mm256_setzero_ps(); 8];
        for (k, r) in r.iter_mut().enumerate() {
            // SAFETY: row i0 + k's tokens t0..t0 + 8 end at (i0 + k) * n + t0 + 8 <= m * n.
            *r = unsafe { _mm256_loadu_ps(src.as_ptr().add((i0 + k) * n + t0)) };
        }
        let v = transpose8x8(&r);
        for (v, o) in v.iter().zip(out.iter_mut()) {
            // SAFETY: 8 floats at i0 < full <= m <= o.len().
            unsafe { _mm256_storeu_ps(o.as_mut_ptr().add(i0), *v) };
        }
    }
    for i in full..m {
        for (k, o) in out.iter_mut().enumerate() {
            o[i] = src[i * n + t0 + k];
        }
    }
}
