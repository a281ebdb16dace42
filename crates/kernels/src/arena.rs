//! Quantized activations and their interleaved tiles for a batch of products, in one set of
//! buffers.
//!
//! Prefill's expert products read one input per expert, of as many tokens as the router sent
//! it. Kept in a buffer per input, each buffer would grow to the largest group ever seen in its
//! place, so a long prompt keeps finding new maxima and the process keeps growing long after
//! its first chunk. Laid out end to end in one arena, the buffers are as large as the largest
//! batch (a chunk's tokens × top-k rows), which the first full chunk reaches.

use crate::act::{self, ActKind, Block256, Block32};
use crate::gemm::{tile_len, ActTile, TileMut, TILE};
use crate::{act_kind, ActRow};
use smoe_quant::Format;

/// Where one input lies in an [`ActArena`].
#[derive(Clone, Copy)]
struct Span {
    kind: ActKind,
    rows: usize,
    cols: usize,
    tiled: bool,
    /// Offset in the buffer of `kind` (values or blocks).
    act: usize,
    /// Offsets of its tile (when `tiled`).
    qs: usize,
    d: usize,
    sums: usize,
}

impl Span {
    /// Values or blocks of its quantized rows.
    fn act_len(&self) -> usize {
        match self.kind {
            ActKind::F32 => self.rows * self.cols,
            ActKind::Q8x32 => self.rows * self.cols / 32,
            ActKind::Q8x256 => self.rows * self.cols / 256,
        }
    }

    /// Lengths of its tile's quants, scales and sums.
    fn tile_len(&self) -> (usize, usize, usize) {
        match (self.tiled, self.kind) {
            (true, ActKind::Q8x32) => tile_len(self.rows, self.cols, 32),
            (true, ActKind::Q8x256) => tile_len(self.rows, self.cols, 256),
            _ => (0, 0, 0),
        }
    }
}

/// The inputs of a batch of products, each quantized for its weights' format and (where asked)
/// interleaved for the many-token kernels, in buffers reused from batch to batch.
#[derive(Default)]
pub struct ActArena {
    spans: Vec<Span>,
    f32: Vec<f32>,
    b32: Vec<Block32>,
    b256: Vec<Block256>,
    qs: Vec<i8>,
    d: Vec<f32>,
    sums: Vec<i32>,
}

impl ActArena {
    /// Lays out the next batch: inputs of `(weight format, rows, cols, tiled)`, `tiled` when a
    /// many-token kernel will read the input. The buffers only grow (to the largest batch).
    pub fn layout(&mut self, inputs: impl Iterator<Item = (Format, usize, usize, bool)>) {
        self.spans.clear();
        let mut next = [0usize; 3];
        let mut tile = (0usize, 0usize, 0usize);
        for (f, rows, cols, tiled) in inputs {
            let kind = act_kind(f);
            let slot = kind as usize;
            let tiled = tiled && kind != ActKind::F32;
            let s = Span { kind, rows, cols, tiled, act: next[slot], qs: tile.0, d: tile.1, sums: tile.2 };
            next[slot] += s.act_len();
            let (q, d, m) = s.tile_len();
            tile = (tile.0 + q, tile.1 + d, tile.2 + m);
            self.spans.push(s);
        }
        grow(&mut self.f32, next[ActKind::F32 as usize], 0.0);
        grow(&mut self.b32, next[ActKind::Q8x32 as usize], Block32::ZERO);
        grow(&mut self.b256, next[ActKind::Q8x256 as usize], Block256::ZERO);
        grow(&mut self.qs, tile.0, 0);
        grow(&mut self.d, tile.1, 0.0);
        grow(&mut self.sums, tile.2, 0);
    }

    /// Inputs laid out.
    pub fn len(&self) -> usize {
        self.spans.len()
    }

    /// Whether no input is laid out.
    pub fn is_empty(&self) -> bool {
        self.spans.is_empty()
    }

    /// Each input's part of the buffers, to be filled (in parallel if wished) by
    /// [`ArenaPart::fill`]: inputs of more than `piece` rows cut into pieces of `piece` rows
    /// (rounded up to whole tiles, whose layout is tile-major: a piece that starts on a tile
    /// owns its tiles outright), so that one long input — prefill's attention input, a chunk of
    /// 256 tokens — is quantized by several threads, not by the caller alone.
    pub fn pieces(&mut self, piece: usize) -> Vec<ArenaPart<'_>> {
        let piece = piece.max(1).div_ceil(TILE).saturating_mul(TILE);
        let (mut f, mut b32, mut b256) = (&mut self.f32[..], &mut self.b32[..], &mut self.b256[..]);
        let (mut qs, mut d, mut sums) = (&mut self.qs[..], &mut self.d[..], &mut self.sums[..]);
        let mut parts = Vec::with_capacity(self.spans.len());
        for (input, whole) in self.spans.iter().enumerate() {
            let mut first = 0;
            // An empty input still gets its (empty) part, as `parts` always gave one per input.
            while first < whole.rows || (first == 0 && whole.rows == 0) {
                let s = Span { rows: piece.min(whole.rows - first), ..*whole };
                let n = s.act_len();
                let act = match s.kind {
                    ActKind::F32 => PartAct::F32(take(&mut f, n)),
                    ActKind::Q8x32 => PartAct::Q32(take(&mut b32, n)),
                    ActKind::Q8x256 => PartAct::Q256(take(&mut b256, n)),
                };
                let (nq, nd, ns) = s.tile_len();
                let tile = TileMut { qs: take(&mut qs, nq), d: take(&mut d, nd), sums: take(&mut sums, ns) };
                parts.push(ArenaPart { span: s, act, tile, input, first });
                first += s.rows.max(1);
            }
        }
        parts
    }

    /// Quantizes (and interleaves, if tiled) input `i`, row `t` being `row(t)`: one input
    /// filled without making the list [`parts`](Self::parts) allocates (decode's one-input
    /// products).
    pub fn fill<'x>(&mut self, i: usize, row: impl Fn(usize) -> &'x [f32]) {
        let s = self.spans[i];
        let n = s.act_len();
        let act = match s.kind {
            ActKind::F32 => PartAct::F32(&mut self.f32[s.act..s.act + n]),
            ActKind::Q8x32 => PartAct::Q32(&mut self.b32[s.act..s.act + n]),
            ActKind::Q8x256 => PartAct::Q256(&mut self.b256[s.act..s.act + n]),
        };
        let (nq, nd, ns) = s.tile_len();
        let tile = TileMut { qs: &mut self.qs[s.qs..s.qs + nq], d: &mut self.d[s.d..s.d + nd], sums: &mut self.sums[s.sums..s.sums + ns] };
        ArenaPart { span: s, act, tile, input: i, first: 0 }.fill(row);
    }

    /// Input `i`'s quantized rows.
    pub fn rows(&self, i: usize) -> QuantRows<'_> {
        let s = &self.spans[i];
        let r = s.act..s.act + s.act_len();
        let data = match s.kind {
            ActKind::F32 => ActRow::F32(&self.f32[r]),
            ActKind::Q8x32 => ActRow::Q32(&self.b32[r]),
            ActKind::Q8x256 => ActRow::Q256(&self.b256[r]),
        };
        QuantRows { cols: s.cols, data }
    }

    /// Input `i`'s tile; `None` unless it was laid out tiled (and quantized to int8).
    pub fn tile(&self, i: usize) -> Option<ActTile<'_>> {
        let s = &self.spans[i];
        let (nq, nd, ns) = s.tile_len();
        s.tiled.then(|| ActTile {
            n: s.rows,
            cols: s.cols,
            qs: &self.qs[s.qs..s.qs + nq],
            d: &self.d[s.d..s.d + nd],
            sums: &self.sums[s.sums..s.sums + ns],
            block: if s.kind == ActKind::Q8x32 { 32 } else { 256 },
        })
    }
}

/// Grows `v` to at least `len` (never shrinks: the arena keeps its largest batch's size).
fn grow<T: Clone>(v: &mut Vec<T>, len: usize, zero: T) {
    if v.len() < len {
        v.resize(len, zero);
    }
}

/// The first `n` items of `rest`, leaving the others in it.
fn take<'a, T>(rest: &mut &'a mut [T], n: usize) -> &'a mut [T] {
    let (head, tail) = std::mem::take(rest).split_at_mut(n);
    *rest = tail;
    head
}

/// One input's writable part of an [`ActArena`] (or a piece of its rows).
pub struct ArenaPart<'a> {
    span: Span,
    act: PartAct<'a>,
    tile: TileMut<'a>,
    input: usize,
    first: usize,
}

enum PartAct<'a> {
    F32(&'a mut [f32]),
    Q32(&'a mut [Block32]),
    Q256(&'a mut [Block256]),
}

impl ArenaPart<'_> {
    /// The input this part belongs to.
    pub fn input(&self) -> usize {
        self.input
    }

    /// Quantizes the part's rows of its input, input row `t` being `row(t)` (rows scattered
    /// through a larger buffer are read where they lie), and interleaves them if it is tiled.
    pub fn fill<'x>(&mut self, row: impl Fn(usize) -> &'x [f32]) {
        let Span { rows, cols, .. } = self.span;
        let first = self.first;
        let row = |t: usize| row(first + t);
        match &mut self.act {
            PartAct::F32(out) => {
                for (t, o) in out.chunks_exact_mut(cols.max(1)).enumerate() {
                    o.copy_from_slice(&row(t)[..cols]);
                }
            }
            PartAct::Q32(out) => {
                for (t, o) in out.chunks_exact_mut((cols / 32).max(1)).enumerate() {
                    act::quantize_32(&row(t)[..cols], o);
                }
                if self.span.tiled {
                    self.tile.build_32(out, rows, cols);
                }
            }
            PartAct::Q256(out) => {
                for (t, o) in out.chunks_exact_mut((cols / 256).max(1)).enumerate() {
                    act::quantize_256(&row(t)[..cols], o);
                }
                if self.span.tiled {
                    self.tile.build_256(out, rows, cols);
                }
            }
        }
    }
}

/// Quantized rows of one input.
#[derive(Clone, Copy)]
pub struct QuantRows<'a> {
    cols: usize,
    data: ActRow<'a>,
}

impl<'a> QuantRows<'a> {
    /// Row `r`.
    pub fn row(&self, r: usize) -> ActRow<'a> {
        let c = self.cols;
        match self.data {
            ActRow::F32(x) => ActRow::F32(&x[r * c..(r + 1) * c]),
            ActRow::Q32(x) => ActRow::Q32(&x[r * c / 32..(r + 1) * c / 32]),
            ActRow::Q256(x) => ActRow::Q256(&x[r * c / 256..(r + 1) * c / 256]),
        }
    }
}

/// The activations of one product, quantized and interleaved: an [`ActArena`] of one input.
#[derive(Default)]
pub struct QuantAct(ActArena);

impl QuantAct {
    /// Quantizes `rows` rows of `cols` from `x` for weights of format `f` (and interleaves
    /// them for the many-token kernels).
    pub fn quantize(&mut self, f: Format, x: &[f32], rows: usize, cols: usize) {
        self.0.layout(std::iter::once((f, rows, cols, true)));
        self.0.fill(0, |t| &x[t * cols..(t + 1) * cols]);
    }

    /// Row `r`.
    pub fn row(&self, r: usize) -> ActRow<'_> {
        self.0.rows(0).row(r)
    }

    /// The interleaved tile (for int8 activations).
    pub fn tile(&self) -> ActTile<'_> {
        self.0.tile(0).expect("a format with int8 activations")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Inputs laid out together read back exactly as each quantized alone, whatever the
    /// order and sizes of the batches before, and whether each input is filled whole or in
    /// pieces of rows (by different threads, in any order).
    #[test]
    fn inputs_in_one_arena_equal_each_alone() {
        let data = |n: usize, seed: usize| -> Vec<f32> { (0..n).map(|i| (((i + seed) * 7919 % 1999) as f32 - 999.0) / 500.0).collect() };
        let mut arena = ActArena::default();
        for (batch, (inputs, piece)) in [
            (vec![(Format::Q4_K, 19usize, 512usize, true), (Format::Q8_0, 3, 256, false), (Format::BF16, 2, 64, true)], usize::MAX),
            (vec![(Format::Q8_0, 9, 256, true), (Format::Q4_K, 1, 768, false), (Format::Q4_K, 40, 256, true)], usize::MAX),
            (vec![(Format::Q4_K, 19, 512, true), (Format::Q8_0, 0, 256, true), (Format::BF16, 17, 64, true)], 8),
            (vec![(Format::Q8_0, 41, 256, true), (Format::Q4_K, 9, 768, false), (Format::Q4_K, 40, 256, true)], 12),
        ]
        .into_iter()
        .enumerate()
        {
            let xs: Vec<Vec<f32>> = inputs.iter().enumerate().map(|(i, &(_, r, c, _))| data(r * c, 10 * batch + i)).collect();
            arena.layout(inputs.iter().copied());
            let mut parts = arena.pieces(piece);
            assert!(piece == usize::MAX || parts.len() > inputs.len(), "batch {batch}: inputs cut into pieces");
            for p in parts.iter_mut().rev() {
                let i = p.input();
                let (x, c) = (&xs[i], inputs[i].2);
                p.fill(|t| &x[t * c..(t + 1) * c]);
            }
            for (i, &(f, rows, cols, tiled)) in inputs.iter().enumerate() {
                let mut alone = QuantAct::default();
                alone.quantize(f, &xs[i], rows, cols);
                for t in 0..rows {
                    let same = match (arena.rows(i).row(t), alone.row(t)) {
                        (ActRow::F32(a), ActRow::F32(b)) => a == b,
                        (ActRow::Q32(a), ActRow::Q32(b)) => a.iter().zip(b).all(|(a, b)| a.qs == b.qs && a.d == b.d),
                        (ActRow::Q256(a), ActRow::Q256(b)) => {
                            a.iter().zip(b).all(|(a, b)| a.qs == b.qs && a.d == b.d && a.bsums == b.bsums)
                        }
                        _ => false,
                    };
                    assert!(same, "batch {batch} input {i} row {t}");
                }
                match (arena.tile(i), tiled && act_kind(f) != ActKind::F32) {
                    (Some(a), true) => {
                        let b = alone.tile();
                        assert!(a.n == b.n && a.qs == b.qs && a.d == b.d && a.sums == b.sums, "batch {batch} input {i} tile");
                    }
                    (None, false) => {}
                    (t, want) => panic!("batch {batch} input {i}: tile {} but wanted {want}", t.is_some()),
                }
            }
        }
    }
}
