//! The sequences of a batched step in one launch each: attention's inputs (`qk_rope_store_seqs`)
//! and attention itself (`attention_seqs`), each sequence over its own KV cache. Run one after
//! another, 16 sequences' decode tokens cost four launches each per layer (two row copies, the
//! fused store, attention): on the H200 a 16-sequence step of the 30B shape spent most of its
//! 31 ms launching them. A launch's table holds [`MAX_SEQS`] sequences; more go in launches of
//! that many (before, they went one by one: on an H100, 128 sequences decoded at 890–983 tok/s
//! against 64's 2,337).

use super::fused::{check_qkv, fuses};
use super::{attention_tiles, CudaBackend, CudaBuf, CudaKvCache, CudaVector, MV_TOKENS};
use crate::launch::Launch;
use cudarc::driver::{DeviceRepr, LaunchConfig};
use smoe_engine::backend::{check_rows, qk_rope_store_batch_composed, AttnParams, QkvRows, RopeTables, SeqQueries, SeqStore};

/// Most sequences in one launch: the table is a kernel parameter (`MAX_SEQS` in kernels.cu).
const MAX_SEQS: usize = 64;

/// One sequence as the kernels read it (`struct SeqKv` in kernels.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct SeqKv {
    k: u64,
    v: u64,
    pos0: i32,
    row: i32,
    n: i32,
    first: i32,
    split: i32,
    splits: i32,
}

/// A step's sequences (`struct SeqKvs` in kernels.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct SeqKvs {
    count: i32,
    max_splits: i32,
    s: [SeqKv; MAX_SEQS],
}

// SAFETY: plain old data with the C layout of `struct SeqKvs` in kernels.cu (two i32, then 64
// entries of two u64 and six i32: 8 + 64 × 40 bytes, 8-aligned), copied by value into the
// kernel's parameters.
unsafe impl DeviceRepr for SeqKvs {}

impl SeqKvs {
    fn new() -> Self {
        SeqKvs { count: 0, max_splits: 1, s: [SeqKv::default(); MAX_SEQS] }
    }
}

/// Whether `rows` (first row, rows) of a step's sequences are what the kernels take: ascending
/// rows that follow one another from 0 (a launch finds a row's sequence by walking its table).
/// More than [`MAX_SEQS`] sequences go as launches of [`MAX_SEQS`] each.
fn rows_follow(rows: impl Iterator<Item = (usize, usize)>) -> bool {
    let mut next = 0;
    for (row, n) in rows {
        if row != next || n == 0 {
            return false;
        }
        next = row + n;
    }
    true
}

/// The first row and the rows of a launch's sequences (`rows_follow` holds).
fn span<T>(group: &[T], row_n: impl Fn(&T) -> (usize, usize)) -> (i32, usize) {
    (row_n(&group[0]).0 as i32, group.iter().map(|s| row_n(s).1).sum())
}

impl CudaBackend {
    /// [`smoe_engine::Backend::qk_rope_store_batch`]: where the fused kernel applies ([`fuses`])
    /// and the rows follow one another, a launch for every [`MAX_SEQS`] sequences; else the
    /// composed ops.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fused_qk_rope_store_seqs(
        &self,
        qkv: &mut CudaBuf,
        n: usize,
        rows: QkvRows,
        norm: Option<(&CudaVector, &CudaVector, f32)>,
        rope: RopeTables<'_>,
        seqs: &mut [SeqStore<'_, CudaKvCache>],
        layer: usize,
    ) {
        if self.faulted() || n == 0 {
            return;
        }
        let fused = seqs.first().is_some_and(|s| fuses(s.cache.layers[layer].shape, rows, rope.cos.len() / n));
        if !fused || !rows_follow(seqs.iter().map(|s| (s.row, s.n))) {
            return qk_rope_store_batch_composed(self, qkv, n, rows, norm, rope, seqs, layer);
        }
        assert_eq!(seqs.iter().map(|s| s.n).sum::<usize>(), n, "qk_rope_store_batch: the sequences' rows are not the step's");
        check_qkv(qkv, n, rows, norm);
        let seqs_shape = seqs[0].cache.layers[layer].shape;
        let mut tables = Vec::with_capacity(seqs.len().div_ceil(MAX_SEQS));
        for group in seqs.chunks_mut(MAX_SEQS) {
            let mut table = SeqKvs::new();
            for (i, s) in group.iter_mut().enumerate() {
                assert_eq!(s.cache.layers[layer].shape, seqs_shape, "qk_rope_store_batch: one layer, one shape");
                let Some((kp, vp)) = self.kv_room(s.cache, layer, s.pos0, s.n) else { return };
                table.s[i] = SeqKv { k: kp, v: vp, pos0: s.pos0 as i32, row: s.row as i32, n: s.n as i32, ..Default::default() };
            }
            table.count = group.len() as i32;
            tables.push((span(group, |s| (s.row, s.n)), table));
        }
        let Some(args) = self.qkv_args(qkv, n, rows, norm, rope) else { return };
        for ((t0, group_rows), table) in &tables {
            let rows_i = *group_rows as i32;
            let mut a = Launch::new(&self.k.qk_rope_store_seqs);
            args.push(&mut a);
            a.arg(t0).arg(&rows_i).arg(table);
            self.launch_qkv(a, *group_rows, &args);
        }
    }

    /// [`smoe_engine::Backend::attention_batch`]: where every sequence alone would take the
    /// decode kernel, a launch of it for every [`MAX_SEQS`] sequences (each row with the splits
    /// it has alone, so the same bits); else each sequence's own kernels on its rows.
    pub(super) fn attention_seqs(
        &self,
        layer: usize,
        seqs: &[SeqQueries<'_, CudaKvCache>],
        q: &CudaBuf,
        q_stride: usize,
        p: AttnParams<'_>,
        out: &mut CudaBuf,
    ) {
        if self.faulted() || seqs.is_empty() {
            return;
        }
        assert!(p.selected.is_none(), "attention_batch: selected positions go sequence by sequence");
        let shape = seqs[0].cache.layers[layer].shape;
        let width = p.q_heads * shape.v_dim;
        if let Some(sinks) = p.sinks {
            assert!(sinks.len() >= p.q_heads, "attention: {} sinks for {} query heads", sinks.len(), p.q_heads);
        }
        for s in seqs {
            let l = &s.cache.layers[layer];
            assert_eq!(l.shape, shape, "attention_batch: one layer, one shape");
            check_rows("attention queries", q, s.row, s.n, q_stride, 0, p.q_heads * shape.k_dim);
            check_rows("attention", out, s.row, s.n, width, 0, width);
            l.check_attention(s.n, s.pos0, &p);
        }
        let rows = seqs.iter().map(|s| s.row + s.n).max().unwrap_or(0);
        let (qp, op) = (q.at(&self.stream), out.at_mut(&self.stream));
        let decode = seqs.iter().all(|s| !attention_tiles(shape, s.n, &p) && s.n <= MV_TOKENS);
        if !decode || !rows_follow(seqs.iter().map(|s| (s.row, s.n))) {
            // Each sequence on its own rows (pointers moved to them), leaving no int8 copy: the
            // products after quantize their input themselves, to the same bits.
            for s in seqs {
                let (qr, or) = (qp + (s.row * q_stride * 4) as u64, op + (s.row * width * 4) as u64);
                self.attention_at(&s.cache.layers[layer], qr, q_stride, s.n, s.pos0, p, or, (0, 0));
            }
            return;
        }
        let (qx, qstride) = if shape.v_dim.is_multiple_of(32) { self.quant_out(out, rows, width) } else { (0, 0) };
        let tables: Vec<_> = seqs
            .chunks(MAX_SEQS)
            .map(|group| {
                let mut table = SeqKvs::new();
                for (i, s) in group.iter().enumerate() {
                    let l = &s.cache.layers[layer];
                    let kp = l.keys(&self.stream);
                    let vp = if shape.values_in_keys { kp } else { l.values(&self.stream) };
                    // The splits this sequence has alone (see attention_decode).
                    let (split, splits) = super::attention_splits(s.n, s.pos0, &p);
                    let first = p.first_seen(s.pos0);
                    table.s[i] = SeqKv {
                        k: kp,
                        v: vp,
                        pos0: s.pos0 as i32,
                        row: s.row as i32,
                        n: s.n as i32,
                        first: first as i32,
                        split: split as i32,
                        splits: splits as i32,
                    };
                    table.max_splits = table.max_splits.max(splits as i32);
                }
                table.count = group.len() as i32;
                (span(group, |s| (s.row, s.n)), table)
            })
            .collect();
        let max_splits = tables.iter().map(|(_, t)| t.max_splits as usize).max().unwrap_or(1);
        // One scratch for every launch: they run one after another on the stream, and each
        // leaves its tickets at 0.
        let most_rows = tables.iter().map(|((_, r), _)| *r).max().unwrap_or(0) * p.q_heads;
        let scratch = if max_splits > 1 {
            self.split_scratch(&self.attention_part, &self.attention_tickets, most_rows * max_splits * (shape.v_dim + 2), most_rows)
        } else {
            Some((0, 0))
        };
        let Some((pp, tp)) = scratch else { return };
        let sinks = match p.sinks {
            Some(s) => match self.stage_f32("attention sinks", &[s]) {
                Some(ptr) => ptr,
                None => return,
            },
            None => 0,
        };
        let l0 = &seqs[0].cache.layers[layer];
        let (v_row, v_head) = if shape.values_in_keys { (l0.k_width(), shape.k_dim) } else { (l0.v_width(), shape.v_dim) };
        let (heads, kd, vd, vr, vh) = (shape.heads as i32, shape.k_dim as i32, shape.v_dim as i32, v_row as i32, v_head as i32);
        let (qs, qh, window) = (q_stride as i32, p.q_heads as i32, p.window.unwrap_or(0) as i32);
        let threads = 128u32;
        let shared = ((shape.k_dim + threads as usize + shape.v_dim) * 4) as u32;
        for ((t0, group_rows), table) in &tables {
            let mut a = Launch::new(&self.k.attention_seqs);
            a.arg(&heads).arg(&kd).arg(&vd).arg(&vr).arg(&vh).arg(&qp).arg(&qs).arg(&qh).arg(&p.scale).arg(&op).arg(&qx).arg(&qstride);
            a.arg(&pp).arg(&tp).arg(&window).arg(&sinks).arg(t0).arg(table);
            let grid = ((group_rows * p.q_heads) as u32, table.max_splits as u32, 1);
            self.launch(a, LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: shared }, "attention");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rows the kernels walk: sequences whose rows follow one another from 0, any number
    /// of them (launches of `MAX_SEQS` each).
    #[test]
    fn the_kernels_take_rows_that_follow_one_another() {
        assert!(rows_follow([(0, 1), (1, 3), (4, 1)].into_iter()));
        assert!(!rows_follow([(0, 1), (2, 1)].into_iter()), "a gap");
        assert!(!rows_follow([(1, 1)].into_iter()), "not from 0");
        assert!(!rows_follow([(0, 2), (1, 1)].into_iter()), "overlapping");
        assert!(!rows_follow([(0, 0), (0, 1)].into_iter()), "an empty sequence");
        assert!(rows_follow((0..130).map(|i| (i, 1))), "three launches' tables");
        let seqs: Vec<(usize, usize)> = (0..130).map(|i| (2 * i, 2)).collect();
        let spans: Vec<_> = seqs.chunks(MAX_SEQS).map(|g| span(g, |s| *s)).collect();
        assert_eq!(spans, [(0, 128), (128, 128), (256, 4)]);
        assert_eq!(std::mem::size_of::<SeqKvs>(), 8 + 64 * 40, "the layout of struct SeqKvs in kernels.cu");
    }
}
