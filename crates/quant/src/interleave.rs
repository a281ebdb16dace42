//! Q4_K and Q8_0 with eight rows interleaved: an in-memory layout (never written to a file)
//! that lets a SIMD dot product keep one row per lane, so block scales apply as vectors and no
//! per-row reduction is needed (ggml repacks Q4_K similarly for its CPU backend).
//!
//! A matrix of `rows` (a multiple of 8) Q4_K rows becomes `rows / 8` groups, each the same
//! bytes as its eight rows. Group `g` holds, per super-block `b` in order, 1152 bytes:
//! `d[8]` (f16, one per row), `dmin[8]` (f16), the packed scale bytes as `[byte j < 12][row]`,
//! then the quants as `[pair c < 4][dword k < 8][row][4 bytes]` — in each byte the low nibble
//! belongs to group `2c` and the high nibble to group `2c + 1`, as in Q4_K.
//!
//! A Q8_0 group holds, per block `b` of 32 columns, 272 bytes: `d[8]` (f16, one per row), then
//! the quants as `[dword k < 8][row][4 bytes]`.

use crate::blocks::BlockQ4K;
use crate::Format;

/// Rows per interleaved group.
pub const ROWS: usize = 8;
/// Bytes of one super-block of a group.
pub const GROUP_BLOCK: usize = ROWS * 144;

/// Bytes of one Q8_0 block of a group.
pub const Q8_GROUP_BLOCK: usize = ROWS * 34;

/// Whether a `format` matrix of `rows x cols` can be interleaved.
pub fn supported(format: Format, rows: usize, cols: usize) -> bool {
    let block = match format {
        Format::Q4_K => 256,
        Format::Q8_0 => 32,
        _ => return false,
    };
    rows.is_multiple_of(ROWS) && cols.is_multiple_of(block) && cols > 0
}

/// Interleaves the `format` rows in `src` (`rows x cols`, row layout) into `dst` (same size).
pub fn interleave(format: Format, src: &[u8], rows: usize, cols: usize, dst: &mut [u8]) {
    match format {
        Format::Q8_0 => interleave_q8_0(src, rows, cols, dst),
        _ => interleave_q4_k(src, rows, cols, dst),
    }
}

/// Row `r` of an interleaved `format` matrix (`cols` long) in the ordinary row layout.
pub fn row(format: Format, data: &[u8], cols: usize, r: usize, out: &mut [u8]) {
    match format {
        Format::Q8_0 => row_q8_0(data, cols, r, out),
        _ => row_q4_k(data, cols, r, out),
    }
}

/// Interleaves the Q8_0 rows in `src` (`rows x cols`, row layout) into `dst` (same size).
pub fn interleave_q8_0(src: &[u8], rows: usize, cols: usize, dst: &mut [u8]) {
    let (blocks, rb) = (cols / 32, cols / 32 * 34);
    assert!(supported(Format::Q8_0, rows, cols) && src.len() == rows * rb && dst.len() == src.len(), "interleave: bad shape");
    for (g, out) in dst.chunks_exact_mut(ROWS * rb).enumerate() {
        for b in 0..blocks {
            let o = &mut out[b * Q8_GROUP_BLOCK..(b + 1) * Q8_GROUP_BLOCK];
            for r in 0..ROWS {
                let blk = &src[(g * ROWS + r) * rb + b * 34..][..34];
                o[2 * r..2 * r + 2].copy_from_slice(&blk[..2]);
                for k in 0..8 {
                    o[16 + 32 * k + 4 * r..][..4].copy_from_slice(&blk[2 + 4 * k..6 + 4 * k]);
                }
            }
        }
    }
}

/// Row `r` of an interleaved Q8_0 matrix (`cols` long) in the row layout, into `out`
/// (`cols / 32 * 34` bytes).
pub fn row_q8_0(data: &[u8], cols: usize, r: usize, out: &mut [u8]) {
    let (blocks, rb) = (cols / 32, cols / 32 * 34);
    assert!(out.len() == rb && data.len() >= (r / ROWS + 1) * ROWS * rb, "row_q8_0: bad shape");
    let (g, i) = (r / ROWS, r % ROWS);
    for b in 0..blocks {
        let o = &data[g * ROWS * rb + b * Q8_GROUP_BLOCK..][..Q8_GROUP_BLOCK];
        let blk = &mut out[b * 34..(b + 1) * 34];
        blk[..2].copy_from_slice(&o[2 * i..2 * i + 2]);
        for k in 0..8 {
            blk[2 + 4 * k..6 + 4 * k].copy_from_slice(&o[16 + 32 * k + 4 * i..][..4]);
        }
    }
}

/// Interleaves the Q4_K rows in `src` (`rows x cols`, row layout) into `dst` (same size).
pub fn interleave_q4_k(src: &[u8], rows: usize, cols: usize, dst: &mut [u8]) {
    let (blocks, rb) = (cols / 256, cols / 256 * 144);
    assert!(supported(Format::Q4_K, rows, cols) && src.len() == rows * rb && dst.len() == src.len(), "interleave: bad shape");
    for (g, out) in dst.chunks_exact_mut(ROWS * rb).enumerate() {
        for b in 0..blocks {
            let o = &mut out[b * GROUP_BLOCK..(b + 1) * GROUP_BLOCK];
            for r in 0..ROWS {
                let at = (g * ROWS + r) * rb + b * 144;
                let blk: &BlockQ4K = bytemuck::from_bytes(&src[at..at + 144]);
                o[2 * r..2 * r + 2].copy_from_slice(&blk.d.0);
                o[16 + 2 * r..16 + 2 * r + 2].copy_from_slice(&blk.dmin.0);
                for j in 0..12 {
                    o[32 + ROWS * j + r] = blk.scales[j];
                }
                for ck in 0..32 {
                    let q = 128 + (ck * ROWS + r) * 4;
                    o[q..q + 4].copy_from_slice(&blk.qs[4 * ck..4 * ck + 4]);
                }
            }
        }
    }
}

/// Row `r` of an interleaved Q4_K matrix (`cols` long) in the ordinary row layout, into
/// `out` (`cols / 256 * 144` bytes).
pub fn row_q4_k(data: &[u8], cols: usize, r: usize, out: &mut [u8]) {
    let (blocks, rb) = (cols / 256, cols / 256 * 144);
    assert!(out.len() == rb && data.len() >= (r / ROWS + 1) * ROWS * rb, "row_q4_k: bad shape");
    let (g, i) = (r / ROWS, r % ROWS);
    for b in 0..blocks {
        let o = &data[g * ROWS * rb + b * GROUP_BLOCK..][..GROUP_BLOCK];
        let blk: &mut BlockQ4K = bytemuck::from_bytes_mut(&mut out[b * 144..(b + 1) * 144]);
        blk.d.0.copy_from_slice(&o[2 * i..2 * i + 2]);
        blk.dmin.0.copy_from_slice(&o[16 + 2 * i..16 + 2 * i + 2]);
        for j in 0..12 {
            blk.scales[j] = o[32 + ROWS * j + i];
        }
        for ck in 0..32 {
            let q = 128 + (ck * ROWS + i) * 4;
            blk.qs[4 * ck..4 * ck + 4].copy_from_slice(&o[q..q + 4]);
        }
    }
}

/// Interleaves a `format` matrix in place, through `scratch`.
pub fn interleave_in_place(format: Format, data: &mut [u8], rows: usize, cols: usize, scratch: &mut Vec<u8>) {
    scratch.clear();
    scratch.extend_from_slice(data);
    interleave(format, scratch, rows, cols, data);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_row_comes_back_and_the_bytes_are_a_permutation() {
        let (rows, cols) = (16, 768);
        let rb = cols / 256 * 144;
        let src: Vec<u8> = (0..rows * rb).map(|i| (i * 131 % 251) as u8).collect();
        let mut x = vec![0u8; src.len()];
        interleave_q4_k(&src, rows, cols, &mut x);
        let (mut a, mut b) = (src.clone(), x.clone());
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b);
        let mut row = vec![0u8; rb];
        for r in 0..rows {
            row_q4_k(&x, cols, r, &mut row);
            assert_eq!(row, src[r * rb..(r + 1) * rb], "row {r}");
        }
        let mut y = src.clone();
        interleave_in_place(Format::Q4_K, &mut y, rows, cols, &mut Vec::new());
        assert_eq!(y, x);
        assert!(!supported(Format::Q4_K, 12, 256) && !supported(Format::Q5_K, 8, 256) && supported(Format::Q4_K, 8, 512));
        assert!(supported(Format::Q8_0, 8, 64) && !supported(Format::Q8_0, 8, 48) && !supported(Format::Q8_0, 4, 64));
    }

    #[test]
    fn every_q8_0_row_comes_back_and_the_bytes_are_a_permutation() {
        let (rows, cols) = (16, 96);
        let rb = cols / 32 * 34;
        let src: Vec<u8> = (0..rows * rb).map(|i| (i * 131 % 251) as u8).collect();
        let mut x = vec![0u8; src.len()];
        interleave(Format::Q8_0, &src, rows, cols, &mut x);
        let (mut a, mut b) = (src.clone(), x.clone());
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b);
        let mut out = vec![0u8; rb];
        for r in 0..rows {
            row(Format::Q8_0, &x, cols, r, &mut out);
            assert_eq!(out, src[r * rb..(r + 1) * rb], "row {r}");
        }
    }
}
