//! Block formats with eight rows interleaved: an in-memory layout (never written to a file) that
//! lets a SIMD dot product keep one row per lane, so block scales apply as vectors and no
//! per-row reduction is needed (ggml repacks Q4_K similarly for its CPU backend).
//!
//! A matrix of `rows` (a multiple of 8) rows becomes `rows / 8` groups, each the same bytes as
//! its eight rows, in the same place. Group `g` holds, per block `b` in order, the eight rows'
//! block `b`: each field of the block in turn ([`fields`]), as `[unit][row][unit bytes]` — a
//! field read in units of 2 bytes (an f16 scale) becomes `[row][2]`, one of 4-byte units (the
//! quants) `[dword][row][4]`, so one 32-byte load holds the same dword of all eight rows.
//!
//! - Q4_K, 1152 bytes: `d[8]`, `dmin[8]` (f16), the twelve packed scale bytes as
//!   `[byte j][row]`, the quants as `[dword k < 32][row][4]` (in each byte the low nibble belongs
//!   to group `2c` and the high nibble to `2c + 1`, `c = k / 8`, as in Q4_K).
//! - Q8_0, 272 bytes per 32 columns: `d[8]`, the quants as `[dword k < 8][row][4]`.
//! - Q2_K, 672 bytes: `d[8]`, `dmin[8]`, the sixteen scale/min bytes as `[pair p < 8][row][2]`
//!   (groups `2p` and `2p + 1` of a row side by side), the quants as `[dword k < 16][row][4]`.
//! - Q3_K, 880 bytes: `d[8]`, the twelve packed scale bytes as `[byte j][row]`, the high bits
//!   as `[dword k < 8][row][4]`, the low bits as `[dword k < 16][row][4]`.

use crate::Format;

/// Rows per interleaved group.
pub const ROWS: usize = 8;
/// Bytes of one Q4_K super-block of a group.
pub const GROUP_BLOCK: usize = ROWS * 144;
/// Bytes of one Q8_0 block of a group.
pub const Q8_GROUP_BLOCK: usize = ROWS * 34;
/// Bytes of one Q2_K super-block of a group.
pub const Q2_GROUP_BLOCK: usize = ROWS * 84;
/// Bytes of one Q3_K super-block of a group.
pub const Q3_GROUP_BLOCK: usize = ROWS * 110;

/// A block's fields in their interleaved order: `(offset in the block, bytes, unit bytes)`.
/// `None` for formats that are never interleaved.
pub fn fields(format: Format) -> Option<&'static [(usize, usize, usize)]> {
    Some(match format {
        // BlockQ4K: d, dmin, scales[12], qs[128].
        Format::Q4_K => &[(0, 2, 2), (2, 2, 2), (4, 12, 1), (16, 128, 4)],
        // BlockQ8_0: d, qs[32].
        Format::Q8_0 => &[(0, 2, 2), (2, 32, 4)],
        // BlockQ2K: scales[16], qs[64], d, dmin.
        Format::Q2_K => &[(80, 2, 2), (82, 2, 2), (0, 16, 2), (16, 64, 4)],
        // BlockQ3K: hmask[32], qs[64], scales[12], d.
        Format::Q3_K => &[(108, 2, 2), (96, 12, 1), (0, 32, 4), (32, 64, 4)],
        _ => return None,
    })
}

/// Whether a `format` matrix of `rows x cols` can be interleaved.
pub fn supported(format: Format, rows: usize, cols: usize) -> bool {
    fields(format).is_some() && rows.is_multiple_of(ROWS) && cols.is_multiple_of(format.block_elems()) && cols > 0
}

/// Interleaves the `format` rows in `src` (`rows x cols`, row layout) into `dst` (same size).
pub fn interleave(format: Format, src: &[u8], rows: usize, cols: usize, dst: &mut [u8]) {
    interleave_with(format, src, rows, cols, dst, simd_here())
}

/// Whether the moves may use this CPU's SIMD transposes (AVX2).
fn simd_here() -> bool {
    #[cfg(target_arch = "x86_64")]
    return simd::avx2();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// [`interleave`], with the SIMD transposes or without (`simd`: the tests compare the two).
fn interleave_with(format: Format, src: &[u8], rows: usize, cols: usize, dst: &mut [u8], simd: bool) {
    let f = fields(format).filter(|_| supported(format, rows, cols));
    let (Some(f), Ok(rb)) = (f, format.row_bytes(cols)) else { panic!("interleave: {format} {rows}x{cols} cannot be interleaved") };
    let bb = format.block_bytes();
    assert!(src.len() == rows * rb && dst.len() == src.len(), "interleave: bad shape");
    for (src, out) in src.chunks_exact(ROWS * rb).zip(dst.chunks_exact_mut(ROWS * rb)) {
        let rows: [&[u8]; ROWS] = std::array::from_fn(|r| &src[r * rb..(r + 1) * rb]);
        for (b, o) in out.chunks_exact_mut(ROWS * bb).enumerate() {
            let mut base = 0;
            for &(at, len, unit) in f {
                let field = &mut o[base..base + ROWS * len];
                // Fixed-size moves: this runs on every expert read from disk.
                match unit {
                    4 => to_units::<4>(field, &rows, b * bb + at, simd),
                    2 => to_units::<2>(field, &rows, b * bb + at, simd),
                    _ => to_units::<1>(field, &rows, b * bb + at, simd),
                }
                base += ROWS * len;
            }
        }
    }
}

/// One field of eight rows, `rows[r][off..]`, into `field` as `[unit][row][U bytes]`.
#[inline]
fn to_units<const U: usize>(field: &mut [u8], rows: &[&[u8]; ROWS], off: usize, simd: bool) {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = simd;
    #[cfg(target_arch = "x86_64")]
    if simd {
        let len = field.len() / ROWS;
        // The quants (dwords), Q2_K's scale pairs and the twelve packed scale bytes of Q4_K
        // and Q3_K: transposed in registers, eight rows at once.
        let row = |r: usize, at: usize, n: usize| &rows[r][off + at..][..n];
        match (U, len) {
            (4, _) if len.is_multiple_of(32) => {
                for c in 0..len / 32 {
                    simd::transpose_dwords(std::array::from_fn(|r| row(r, 32 * c, 32)), &mut field[256 * c..256 * (c + 1)]);
                }
                return;
            }
            (2, 16) => return simd::transpose_words(std::array::from_fn(|r| row(r, 0, 16)), field),
            (1, 12) => return simd::transpose_bytes12(std::array::from_fn(|r| row(r, 0, 12)), field),
            _ => {}
        }
    }
    for (i, u) in field.chunks_exact_mut(U * ROWS).enumerate() {
        for (w, row) in u.chunks_exact_mut(U).zip(rows) {
            w.copy_from_slice(&row[off + i * U..off + i * U + U]);
        }
    }
}

/// The inverse of [`to_units`]: `field` (`[unit][row][U bytes]`) out to `rows[r][off..]`.
#[inline]
fn from_units<const U: usize>(field: &[u8], rows: &mut [&mut [u8]; ROWS], off: usize, simd: bool) {
    #[cfg(not(target_arch = "x86_64"))]
    let _ = simd;
    #[cfg(target_arch = "x86_64")]
    if U == 4 && simd && field.len().is_multiple_of(256) {
        // Eight dwords of eight rows at a time, transposed in registers, as in `to_units`.
        for (c, chunk) in field.chunks_exact(256).enumerate() {
            let mut out = [0u8; 256];
            simd::transpose_dwords(std::array::from_fn(|i| &chunk[32 * i..32 * (i + 1)]), &mut out);
            for (row, o) in rows.iter_mut().zip(out.chunks_exact(32)) {
                row[off + 32 * c..][..32].copy_from_slice(o);
            }
        }
        return;
    }
    for (i, u) in field.chunks_exact(U * ROWS).enumerate() {
        for (w, row) in u.chunks_exact(U).zip(rows.iter_mut()) {
            row[off + i * U..off + i * U + U].copy_from_slice(w);
        }
    }
}

/// Row `r` of an interleaved `format` matrix (`cols` long) in the ordinary row layout, into
/// `out` (one row's bytes).
pub fn row(format: Format, data: &[u8], cols: usize, r: usize, out: &mut [u8]) {
    let (Some(f), Ok(rb)) = (fields(format), format.row_bytes(cols)) else {
        panic!("row: {format} of {cols} columns is never interleaved")
    };
    let bb = format.block_bytes();
    assert!(out.len() == rb && data.len() >= (r / ROWS + 1) * ROWS * rb, "row: bad shape");
    let (g, i) = (r / ROWS, r % ROWS);
    let group = &data[g * ROWS * rb..(g + 1) * ROWS * rb];
    for (o, blk) in group.chunks_exact(ROWS * bb).zip(out.chunks_exact_mut(bb)) {
        let mut base = 0;
        for &(at, len, unit) in f {
            let field = &o[base..base + ROWS * len];
            for (j, u) in field.chunks_exact(unit * ROWS).enumerate() {
                blk[at + j * unit..at + (j + 1) * unit].copy_from_slice(&u[i * unit..(i + 1) * unit]);
            }
            base += ROWS * len;
        }
    }
}

/// The eight rows of one interleaved `format` group (`cols` long) in the row layout, into
/// `out` (eight rows' bytes): [`row`] for the whole group at once, in fixed-size moves and
/// transposes, for products that take an interleaved matrix's rows apart (prefill's tiled
/// kernels on interleaved Q8_0, once per group and call).
pub fn rows_of_group(format: Format, group: &[u8], cols: usize, out: &mut [u8]) {
    rows_of_group_with(format, group, cols, out, simd_here())
}

/// [`rows_of_group`], with the SIMD transposes or without.
fn rows_of_group_with(format: Format, group: &[u8], cols: usize, out: &mut [u8], simd: bool) {
    let (Some(f), Ok(rb)) = (fields(format), format.row_bytes(cols)) else {
        panic!("rows_of_group: {format} of {cols} columns is never interleaved")
    };
    let bb = format.block_bytes();
    assert!(out.len() == ROWS * rb && group.len() >= ROWS * rb, "rows_of_group: bad shape");
    let mut each = out.chunks_exact_mut(rb);
    let mut rows: [&mut [u8]; ROWS] = std::array::from_fn(|_| each.next().expect("eight rows"));
    for (b, o) in group[..ROWS * rb].chunks_exact(ROWS * bb).enumerate() {
        let mut base = 0;
        for &(at, len, unit) in f {
            let field = &o[base..base + ROWS * len];
            match unit {
                4 => from_units::<4>(field, &mut rows, b * bb + at, simd),
                2 => from_units::<2>(field, &mut rows, b * bb + at, simd),
                _ => from_units::<1>(field, &mut rows, b * bb + at, simd),
            }
            base += ROWS * len;
        }
    }
}

/// Interleaves a `format` matrix in place, one group of eight rows at a time through `scratch`
/// (a group occupies exactly its rows' bytes): an expert read from disk is interleaved while
/// each group is in cache, not by copying the whole matrix aside first.
pub fn interleave_in_place(format: Format, data: &mut [u8], rows: usize, cols: usize, scratch: &mut Vec<u8>) {
    let rb = format.row_bytes(cols).unwrap_or(0);
    assert!(supported(format, rows, cols) && data.len() == rows * rb, "interleave_in_place: bad shape");
    for group in data.chunks_exact_mut(ROWS * rb) {
        scratch.clear();
        scratch.extend_from_slice(group);
        interleave(format, scratch, ROWS, cols, group);
    }
}

/// The transposes that move fields in and out of the interleaved layout, eight rows at once
/// (on every expert interleaved as it loads, and prefill's taking groups apart; moved a unit
/// at a time that ran at ~9 GB/s a core): safe wrappers on slices, which assert AVX2 and the
/// lengths, around `unsafe` cores on pointers.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// Whether this CPU has AVX2 (detected once by the standard library, then a load).
    #[inline]
    pub fn avx2() -> bool {
        std::arch::is_x86_feature_detected!("avx2")
    }

    /// `out[16k..16k + 16]` = 16-bit word `k` of each of the eight `src` rows (16 bytes
    /// each), row `r` in word `r`: an 8 × 8 transpose of words (Q2_K's scale pairs).
    #[inline]
    pub fn transpose_words(src: [&[u8]; 8], out: &mut [u8]) {
        assert!(avx2() && out.len() == 128 && src.iter().all(|s| s.len() == 16), "transpose_words: no AVX2 or bad shape");
        // SAFETY: AVX2 and the lengths asserted above.
        unsafe { words(src.map(|s| s.as_ptr()), out.as_mut_ptr()) }
    }

    /// [`transpose_words`] on pointers.
    ///
    /// # Safety
    /// AVX2; each `src[r]` readable for 16 bytes, `out` writable for 128.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn words(src: [*const u8; 8], out: *mut u8) {
        let mut a = [_mm_setzero_si128(); 8];
        for (a, s) in a.iter_mut().zip(src) {
            // SAFETY: 16 bytes from `s`, as the caller guarantees.
            *a = unsafe { _mm_loadu_si128(s as *const __m128i) };
        }
        // t[i]: words 0..4 (.0) and 4..8 (.1) of rows 2i and 2i + 1, alternating.
        let mut t = [(_mm_setzero_si128(), _mm_setzero_si128()); 4];
        for (i, t) in t.iter_mut().enumerate() {
            *t = (_mm_unpacklo_epi16(a[2 * i], a[2 * i + 1]), _mm_unpackhi_epi16(a[2 * i], a[2 * i + 1]));
        }
        // u[q][j]: words 2j (low half) and 2j + 1 (high) of rows 4q..4q + 4.
        let mut u = [[_mm_setzero_si128(); 4]; 2];
        for (q, u) in u.iter_mut().enumerate() {
            let ((l0, h0), (l1, h1)) = (t[2 * q], t[2 * q + 1]);
            *u = [_mm_unpacklo_epi32(l0, l1), _mm_unpackhi_epi32(l0, l1), _mm_unpacklo_epi32(h0, h1), _mm_unpackhi_epi32(h0, h1)];
        }
        let p = out as *mut __m128i;
        for j in 0..4 {
            // SAFETY: stores 2j and 2j + 1 < 8 of 16 bytes into the 128 at `out`.
            unsafe {
                _mm_storeu_si128(p.add(2 * j), _mm_unpacklo_epi64(u[0][j], u[1][j]));
                _mm_storeu_si128(p.add(2 * j + 1), _mm_unpackhi_epi64(u[0][j], u[1][j]));
            }
        }
    }

    /// `out[8j..8j + 8]` = byte `j` of each of the eight `src` rows (12 bytes each): the
    /// twelve packed scale bytes of Q4_K and Q3_K as `[byte][row]`.
    #[inline]
    pub fn transpose_bytes12(src: [&[u8]; 8], out: &mut [u8]) {
        assert!(avx2() && out.len() == 96 && src.iter().all(|s| s.len() == 12), "transpose_bytes12: no AVX2 or bad shape");
        // SAFETY: AVX2 and the lengths asserted above.
        unsafe { bytes12(src.map(|s| s.as_ptr()), out.as_mut_ptr()) }
    }

    /// [`transpose_bytes12`] on pointers.
    ///
    /// # Safety
    /// AVX2; each `src[r]` readable for 12 bytes (no more are read), `out` writable for 96.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn bytes12(src: [*const u8; 8], out: *mut u8) {
        let mut a = [_mm_setzero_si128(); 8];
        for (a, s) in a.iter_mut().zip(src) {
            // SAFETY: bytes 0..8 and 8..12 of `s`, as the caller guarantees.
            *a = unsafe {
                _mm_unpacklo_epi64(_mm_loadl_epi64(s as *const __m128i), _mm_cvtsi32_si128((s.add(8) as *const i32).read_unaligned()))
            };
        }
        // Bytes of row pairs, then words of pairs of pairs: u[q][m] holds bytes 4m..4m + 4 of
        // rows 4q..4q + 4, each byte's four rows as one dword.
        let mut t = [(_mm_setzero_si128(), _mm_setzero_si128()); 4];
        for (i, t) in t.iter_mut().enumerate() {
            *t = (_mm_unpacklo_epi8(a[2 * i], a[2 * i + 1]), _mm_unpackhi_epi8(a[2 * i], a[2 * i + 1]));
        }
        let mut u = [[_mm_setzero_si128(); 3]; 2];
        for (q, u) in u.iter_mut().enumerate() {
            let ((l0, h0), (l1, h1)) = (t[2 * q], t[2 * q + 1]);
            *u = [_mm_unpacklo_epi16(l0, l1), _mm_unpackhi_epi16(l0, l1), _mm_unpacklo_epi16(h0, h1)];
        }
        let p = out as *mut __m128i;
        for m in 0..3 {
            // SAFETY: stores 2m and 2m + 1 < 6 of 16 bytes into the 96 at `out`.
            unsafe {
                _mm_storeu_si128(p.add(2 * m), _mm_unpacklo_epi32(u[0][m], u[1][m]));
                _mm_storeu_si128(p.add(2 * m + 1), _mm_unpackhi_epi32(u[0][m], u[1][m]));
            }
        }
    }

    /// `out[32k..32k + 32]` = dword `k` of each of the eight `src` rows (32 bytes each), row
    /// `r` in dword `r`: an 8 × 8 transpose of dwords.
    #[inline]
    pub fn transpose_dwords(src: [&[u8]; 8], out: &mut [u8]) {
        assert!(avx2() && out.len() == 256 && src.iter().all(|s| s.len() == 32), "transpose_dwords: no AVX2 or bad shape");
        // SAFETY: AVX2 and the lengths asserted above.
        unsafe { dwords(src.map(|s| s.as_ptr()), out.as_mut_ptr()) }
    }

    /// [`transpose_dwords`] on pointers.
    ///
    /// # Safety
    /// AVX2; each `src[r]` readable for 32 bytes, `out` writable for 256.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn dwords(src: [*const u8; 8], out: *mut u8) {
        // Plain loops where intrinsics need AVX2: a closure is not compiled with this
        // function's target features, so they would be calls.
        let mut r = [_mm256_setzero_si256(); 8];
        for (r, s) in r.iter_mut().zip(src) {
            // SAFETY: 32 bytes from `s`, as the caller guarantees.
            *r = unsafe { _mm256_loadu_si256(s as *const __m256i) };
        }
        // Pairs of rows interleaved by dword, then by quadword, then halves swapped across.
        let mut t = [_mm256_setzero_si256(); 8];
        for i in 0..4 {
            t[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm256_setzero_si256(); 8];
        for q in 0..2 {
            for h in 0..2 {
                let (a, b) = (t[4 * q + h], t[4 * q + h + 2]);
                u[4 * q + 2 * h] = _mm256_unpacklo_epi64(a, b);
                u[4 * q + 2 * h + 1] = _mm256_unpackhi_epi64(a, b);
            }
        }
        // u[j] (j < 4) holds dwords j and j + 4 of rows 0..4; u[4 + j] the same of rows 4..8.
        let p = out as *mut __m256i;
        for j in 0..4 {
            // SAFETY: stores j and j + 4 < 8 of 32 bytes into the 256 at `out`.
            unsafe {
                _mm256_storeu_si256(p.add(j), _mm256_permute2x128_si256::<0x20>(u[j], u[4 + j]));
                _mm256_storeu_si256(p.add(j + 4), _mm256_permute2x128_si256::<0x31>(u[j], u[4 + j]));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Interleaves `rows x cols` of `format` made of arbitrary bytes; checks that the bytes are
    /// a permutation, that every row comes back, and that in place gives the same bytes.
    fn round_trip(format: Format, rows: usize, cols: usize) -> Vec<u8> {
        let rb = format.row_bytes(cols).unwrap();
        let src: Vec<u8> = (0..rows * rb).map(|i| (i * 131 % 251) as u8).collect();
        let mut x = vec![0u8; src.len()];
        interleave(format, &src, rows, cols, &mut x);
        let (mut a, mut b) = (src.clone(), x.clone());
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b, "{format}");
        let mut out = vec![0u8; rb];
        for r in 0..rows {
            row(format, &x, cols, r, &mut out);
            assert_eq!(out, src[r * rb..(r + 1) * rb], "{format} row {r}");
        }
        let mut group = vec![0u8; ROWS * rb];
        // The portable moves, and the SIMD ones where this CPU has them.
        for simd in [false, simd_here()] {
            let mut y = vec![0u8; src.len()];
            interleave_with(format, &src, rows, cols, &mut y, simd);
            assert_eq!(y, x, "{format}: simd {simd}");
            for g in 0..rows / ROWS {
                rows_of_group_with(format, &x[g * ROWS * rb..], cols, &mut group, simd);
                assert_eq!(group, src[g * ROWS * rb..(g + 1) * ROWS * rb], "{format} group {g}, simd {simd}");
            }
        }
        let mut y = src.clone();
        interleave_in_place(format, &mut y, rows, cols, &mut Vec::new());
        assert_eq!(y, x, "{format} in place");
        x
    }

    #[test]
    fn every_row_comes_back_and_the_bytes_are_a_permutation() {
        for (f, cols) in [(Format::Q4_K, 768), (Format::Q8_0, 96), (Format::Q2_K, 512), (Format::Q3_K, 768)] {
            round_trip(f, 16, cols);
        }
        assert!(!supported(Format::Q4_K, 12, 256) && !supported(Format::Q5_K, 8, 256) && supported(Format::Q4_K, 8, 512));
        assert!(supported(Format::Q8_0, 8, 64) && !supported(Format::Q8_0, 8, 48) && !supported(Format::Q8_0, 4, 64));
        assert!(supported(Format::Q2_K, 8, 256) && supported(Format::Q3_K, 16, 512) && !supported(Format::Q3_K, 8, 128));
    }

    /// The layouts the kernels read, byte for byte: each field where the module documentation
    /// puts it, for the first super-block of group 0.
    #[test]
    fn the_fields_lie_where_the_kernels_read_them() {
        let x = round_trip(Format::Q4_K, 8, 256);
        let src: Vec<u8> = (0..8 * 144).map(|i| (i * 131 % 251) as u8).collect();
        let b = |r: usize, i: usize| src[r * 144 + i];
        for r in 0..8 {
            assert_eq!(x[2 * r..2 * r + 2], [b(r, 0), b(r, 1)]);
            assert_eq!(x[16 + 2 * r], b(r, 2));
            assert_eq!(x[32 + 8 * 11 + r], b(r, 4 + 11));
            assert_eq!(x[128 + (31 * 8 + r) * 4 + 3], b(r, 16 + 127));
        }
        let x = round_trip(Format::Q2_K, 8, 256);
        let src: Vec<u8> = (0..8 * 84).map(|i| (i * 131 % 251) as u8).collect();
        let b = |r: usize, i: usize| src[r * 84 + i];
        for r in 0..8 {
            assert_eq!(x[2 * r..2 * r + 2], [b(r, 80), b(r, 81)]);
            assert_eq!(x[16 + 2 * r..16 + 2 * r + 2], [b(r, 82), b(r, 83)]);
            assert_eq!(x[32 + (7 * 8 + r) * 2..][..2], [b(r, 14), b(r, 15)]);
            assert_eq!(x[160 + (15 * 8 + r) * 4..][..4], [b(r, 76), b(r, 77), b(r, 78), b(r, 79)]);
        }
        let x = round_trip(Format::Q3_K, 8, 256);
        let src: Vec<u8> = (0..8 * 110).map(|i| (i * 131 % 251) as u8).collect();
        let b = |r: usize, i: usize| src[r * 110 + i];
        for r in 0..8 {
            assert_eq!(x[2 * r..2 * r + 2], [b(r, 108), b(r, 109)]);
            assert_eq!(x[16 + 8 * 11 + r], b(r, 96 + 11));
            assert_eq!(x[112 + (7 * 8 + r) * 4], b(r, 28));
            assert_eq!(x[368 + (15 * 8 + r) * 4 + 3], b(r, 32 + 63));
        }
    }
}
