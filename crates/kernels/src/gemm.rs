//! Many-token products for prefill: one weight row against a tile of 8 tokens at a time.
//!
//! Activations of 8 tokens are interleaved four bytes at a time — `[dword k][token t][4 bytes]`
//! — so that one weight dword, broadcast to every lane, multiplies all 8 tokens in a single
//! `vpdpbusd` (or `maddubs`). Weights stay in their stored layout (experts come straight from
//! disk into the cache); each row is unpacked once into a small buffer and reused for every
//! tile of tokens. Per-token block scales and sums are laid out as 8-lane vectors.

use crate::act::{Block256, Block32};

/// Tokens per tile (one 256-bit lane each).
pub const TILE: usize = 8;

/// A weight row against every token of an [`ActTile`]: `out[t] = w · a[t]`.
pub type GemmRow = unsafe fn(w: &[u8], tile: &ActTile<'_>, out: &mut [f32]);

/// Rows handled together by a [`GemmRows`] kernel.
pub const ROWS: usize = 4;

/// [`ROWS`] weight rows against every token: `out[r * n + t] = w[r] · a[t]`. Each activation
/// load then feeds [`ROWS`] products instead of one, which is what bounds the one-row kernel.
pub type GemmRows = unsafe fn(w: [&[u8]; ROWS], tile: &ActTile<'_>, out: &mut [f32]);

/// An interleaved group of eight weight rows (see [`smoe_quant::interleave`]) against every
/// token: `out[r * n + t] = w[r] · a[t]`, read from the group as it lies in memory.
pub type GemmGroup = unsafe fn(group: &[u8], tile: &ActTile<'_>, out: &mut [f32]);

/// A task's products `src[i * n + t]` (`m` rows, `n` tokens) for the eight tokens
/// `t0..t0 + 8` into their own rows: `out[t - t0][i]` (see [`crate::Kernels::scatter_tokens`]).
pub type Transpose8 = unsafe fn(src: &[f32], m: usize, n: usize, t0: usize, out: &mut [&mut [f32]; 8]);

/// Interleaved activations of `n` tokens (zero-padded to whole tiles), as the many-token
/// kernels read them. The buffers belong to whoever built the tile (an [`crate::ActArena`]).
#[derive(Clone, Copy)]
pub struct ActTile<'a> {
    /// Tokens.
    pub n: usize,
    /// Row length.
    pub cols: usize,
    /// Quants, `[tile][dword][token][4]`.
    pub qs: &'a [i8],
    /// Scale per tile, block (of 32 or 256) and token.
    pub d: &'a [f32],
    /// Sums of quants per tile, 32 elements and token (the whole row's runs of 32). Tiles of
    /// 32-element blocks hold each block's sum; tiles of 256-element super-blocks hold the sums
    /// of the run's two 16-element groups as two i16 (first in the low half), which the K-quant
    /// kernels need per 16 (Q2_K, Q3_K) and per 32 (Q4_K: one `madd` adds them).
    pub sums: &'a [i32],
    /// Block size of `d`.
    pub block: usize,
}

impl ActTile<'_> {
    /// Tiles.
    pub fn tiles(&self) -> usize {
        self.n.div_ceil(TILE)
    }
}

/// How many quants, scales and sums the tile of `n` tokens of `cols` with scale blocks of
/// `block` holds.
pub fn tile_len(n: usize, cols: usize, block: usize) -> (usize, usize, usize) {
    let tiles = n.div_ceil(TILE);
    (tiles * cols * TILE, tiles * (cols / block) * TILE, tiles * (cols / 32) * TILE)
}

/// Where a tile is built: `qs`, `d` and `sums` are exactly [`tile_len`] long.
pub(crate) struct TileMut<'a> {
    pub qs: &'a mut [i8],
    pub d: &'a mut [f32],
    pub sums: &'a mut [i32],
}

impl TileMut<'_> {
    /// Interleaves `n` tokens of 32-element blocks.
    pub fn build_32(&mut self, rows: &[Block32], n: usize, cols: usize) {
        self.fill(
            n,
            cols,
            32,
            |t, e| rows[t * cols / 32 + e / 32].qs[e % 32],
            |t, b| rows[t * cols / 32 + b].d,
            |t, b| rows[t * cols / 32 + b].isum,
        );
    }

    /// Interleaves `n` tokens of 256-element super-blocks.
    pub fn build_256(&mut self, rows: &[Block256], n: usize, cols: usize) {
        let per = cols / 256;
        self.fill(
            n,
            cols,
            256,
            |t, e| rows[t * per + e / 256].qs[e % 256],
            |t, b| rows[t * per + b].d,
            |t, g| {
                let b = &rows[t * per + g / 8];
                let j = g % 8;
                // Each sum of 16 quants lies within ±16·127: an i16 holds it.
                (b.bsums[2 * j] as u16 as i32) | ((b.bsums[2 * j + 1] as i32) << 16)
            },
        );
    }

    fn fill(
        &mut self,
        n: usize,
        cols: usize,
        block: usize,
        q: impl Fn(usize, usize) -> i8,
        d: impl Fn(usize, usize) -> f32,
        sums: impl Fn(usize, usize) -> i32,
    ) {
        assert_eq!((self.qs.len(), self.d.len(), self.sums.len()), tile_len(n, cols, block), "tile buffers");
        let dwords = cols / 4;
        // The lanes past `n` in the last tile are read (and their products dropped): zeros.
        self.qs.fill(0);
        self.d.fill(0.0);
        self.sums.fill(0);
        for t in 0..n {
            let (g, lane) = (t / TILE, t % TILE);
            let base = g * dwords * TILE * 4;
            for k in 0..dwords {
                for b in 0..4 {
                    self.qs[base + (k * TILE + lane) * 4 + b] = q(t, 4 * k + b);
                }
            }
            for b in 0..cols / block {
                self.d[(g * (cols / block) + b) * TILE + lane] = d(t, b);
            }
            for b in 0..cols / 32 {
                self.sums[(g * (cols / 32) + b) * TILE + lane] = sums(t, b);
            }
        }
    }
}
