//! The production matrix products: activations quantized to int8 blocks once per call, SIMD
//! dot products (smoe-kernels), output rows split across the persistent pool.

use super::pool::Pool;
use smoe_kernels::gemm::ActTile;
use smoe_kernels::{Kernels, QuantAct};
use smoe_quant::QMatrix;
use std::cell::RefCell;

thread_local! {
    /// Per-job quantized activations and tiles for `matmul_many`, reused across calls.
    static MANY: RefCell<(Vec<QuantAct>, Vec<ActTile>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
    /// The calling thread's quantized activations, reused across calls.
    static ACT: RefCell<QuantAct> = RefCell::new(QuantAct::default());
    /// The same activations interleaved for the many-token kernels.
    static TILE: RefCell<ActTile> = RefCell::new(ActTile::default());
    /// A task's outputs for one row over all tokens.
    static ROWOUT: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Output rows owned by one task: tasks own disjoint row ranges, so writes never overlap.
struct Out {
    ptr: *mut f32,
    len: usize,
}
// SAFETY: shared between pool tasks that write disjoint index sets (see `write`).
unsafe impl Sync for Out {}
impl Out {
    fn write(&self, i: usize, v: f32) {
        assert!(i < self.len);
        // SAFETY: in bounds (checked); each index is written by exactly one task because tasks
        // partition the output rows.
        unsafe { *self.ptr.add(i) = v }
    }
}

/// Rows per task: enough work per task to amortise scheduling, enough tasks to balance.
fn rows_per_task(m: usize, work_per_row: usize, threads: usize) -> usize {
    let min_rows = (16384 / work_per_row.max(1)).max(1);
    let balanced = m.div_ceil(4 * threads);
    balanced.max(min_rows).min(m.max(1))
}

/// `out[t, r] = w[r, :] · x[t, :]` for `t < n`.
pub(crate) fn matmul(k: &Kernels, pool: &Pool, w: &QMatrix<'_>, x: &[f32], n: usize, out: &mut [f32]) {
    let (m, cols) = (w.rows, w.cols);
    assert!(x.len() >= n * cols && out.len() >= n * m, "matmul buffers too small");
    ACT.with(|act| {
        let mut act = act.borrow_mut();
        act.quantize(w.format, x, n, cols);
        let act = &*act;
        let sink = Out { ptr: out.as_mut_ptr(), len: n * m };
        let rpt = rows_per_task(m, cols * n, pool.threads());
        let rb = w.row_bytes();
        let f = w.format;
        let row = |r: usize| &w.data[r * rb..(r + 1) * rb];
        if n >= 4 && k.has_gemm(f) {
            // Prefill: every row against tiles of 8 interleaved tokens.
            TILE.with(|tile| {
                let mut tile = tile.borrow_mut();
                act.build_tile(&mut tile, n);
                let tile = &*tile;
                pool.run(m.div_ceil(rpt), &|i| {
                    ROWOUT.with(|buf| {
                        let mut buf = buf.borrow_mut();
                        buf.resize(n, 0.0);
                        for r in i * rpt..((i + 1) * rpt).min(m) {
                            k.gemm_row(f, row(r), tile, &mut buf);
                            for (t, &v) in buf.iter().enumerate() {
                                sink.write(t * m + r, v);
                            }
                        }
                    })
                });
            });
            return;
        }
        pool.run(m.div_ceil(rpt), &|i| {
            for r in i * rpt..((i + 1) * rpt).min(m) {
                for t in 0..n {
                    sink.write(t * m + r, k.dot(f, row(r), act.row(t)));
                }
            }
        });
    })
}

/// Several products in one pool dispatch. Jobs reading the same input rows with the same
/// activation format share one quantization.
pub(crate) fn matmul_many<M: Sync>(
    k: &Kernels,
    pool: &Pool,
    jobs: &[(QMatrix<'_>, &crate::backend::MatJob<'_, M>)],
    x: &[f32],
    x_stride: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    MANY.with(|many| {
        let (acts, tiles, gather) = &mut *many.borrow_mut();
        // Which prepared input each job uses.
        let mut input_of = Vec::with_capacity(jobs.len());
        let mut keys: Vec<(usize, usize, usize, smoe_kernels::act::ActKind)> = Vec::new();
        // Whether each prepared input's tile is built: a job that shares an input with a
        // format that has no many-token kernel may still need it for its own.
        let mut tiled: Vec<bool> = Vec::new();
        for (w, j) in jobs {
            let key = (j.x_row, j.n, w.cols, smoe_kernels::act_kind(w.format));
            let idx = match keys.iter().position(|k| *k == key) {
                Some(i) => i,
                None => {
                    keys.push(key);
                    tiled.push(false);
                    let i = keys.len() - 1;
                    if acts.len() <= i {
                        acts.push(QuantAct::default());
                        tiles.push(ActTile::default());
                    }
                    gather.clear();
                    for t in 0..j.n {
                        gather.extend_from_slice(&x[(j.x_row + t) * x_stride..][..w.cols]);
                    }
                    acts[i].quantize(w.format, gather, j.n, w.cols);
                    i
                }
            };
            if j.n >= 4 && k.has_gemm(w.format) && !tiled[idx] {
                acts[idx].build_tile(&mut tiles[idx], j.n);
                tiled[idx] = true;
            }
            input_of.push(idx);
        }
        // Tasks: row chunks of every job.
        let threads = pool.threads();
        let total_work: usize = jobs.iter().map(|(w, j)| w.rows * w.cols * j.n).sum();
        let target = (total_work / (4 * threads)).max(16384);
        let mut tasks: Vec<(usize, usize, usize)> = Vec::new();
        for (ji, (w, j)) in jobs.iter().enumerate() {
            let rpt = (target / (w.cols * j.n).max(1)).clamp(1, w.rows.max(1));
            let mut r = 0;
            while r < w.rows {
                tasks.push((ji, r, (r + rpt).min(w.rows)));
                r += rpt;
            }
        }
        let sink = Out { ptr: out.as_mut_ptr(), len: out.len() };
        let (acts, tiles) = (&*acts, &*tiles);
        pool.run(tasks.len(), &|ti| {
            let (ji, r0, r1) = tasks[ti];
            let (w, j) = &jobs[ji];
            let (act, tile) = (&acts[input_of[ji]], &tiles[input_of[ji]]);
            let rb = w.row_bytes();
            let at = |t: usize, r: usize| (j.out_row + t) * out_stride + j.out_col + r;
            if j.n >= 4 && k.has_gemm(w.format) {
                ROWOUT.with(|buf| {
                    let mut buf = buf.borrow_mut();
                    buf.resize(j.n, 0.0);
                    for r in r0..r1 {
                        k.gemm_row(w.format, &w.data[r * rb..(r + 1) * rb], tile, &mut buf);
                        for (t, &v) in buf.iter().enumerate() {
                            sink.write(at(t, r), v);
                        }
                    }
                })
            } else {
                for r in r0..r1 {
                    let row = &w.data[r * rb..(r + 1) * rb];
                    for t in 0..j.n {
                        sink.write(at(t, r), k.dot(w.format, row, act.row(t)));
                    }
                }
            }
        });
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{MatJob, WeightRef};
    use smoe_quant::Format;

    /// Two products on one input, the first in a format without a many-token kernel and the
    /// second with one: each must compute exactly what it computes alone.
    #[test]
    fn jobs_sharing_an_input_each_take_their_own_kernel_path() {
        let (k, pool) = (smoe_kernels::best(), Pool::new(2));
        let (rows, cols, n) = (16, 512, 8);
        let x: Vec<f32> = (0..n * cols).map(|i| ((i * 31 % 97) as f32 - 48.0) / 17.0).collect();
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7 % 53) as f32 - 26.0) / 9.0).collect();
        let quant = |f: Format| {
            let rb = f.row_bytes(cols).unwrap();
            let mut b = vec![0u8; rb * rows];
            for (d, s) in b.chunks_mut(rb).zip(w.chunks(cols)) {
                smoe_quant::quantize(f, s, d).unwrap();
            }
            b
        };
        let (qa, qb) = (quant(Format::Q2_K), quant(Format::Q4_K));
        let a = QMatrix::new(Format::Q2_K, rows, cols, &qa).unwrap();
        let b = QMatrix::new(Format::Q4_K, rows, cols, &qb).unwrap();
        let (mut alone_a, mut alone_b) = (vec![0f32; n * rows], vec![0f32; n * rows]);
        matmul(k, &pool, &a, &x, n, &mut alone_a);
        matmul(k, &pool, &b, &x, n, &mut alone_b);
        let ja: MatJob<'_, ()> = MatJob { w: WeightRef::Host(a), x_row: 0, n, out_row: 0, out_col: 0 };
        let jb: MatJob<'_, ()> = MatJob { w: WeightRef::Host(b), x_row: 0, n, out_row: 0, out_col: rows };
        let mut out = vec![0f32; n * 2 * rows];
        matmul_many(k, &pool, &[(a, &ja), (b, &jb)], &x, cols, &mut out, 2 * rows);
        for t in 0..n {
            assert_eq!(&out[t * 2 * rows..t * 2 * rows + rows], &alone_a[t * rows..(t + 1) * rows], "Q2_K token {t}");
            assert_eq!(&out[t * 2 * rows + rows..(t + 1) * 2 * rows], &alone_b[t * rows..(t + 1) * rows], "Q4_K token {t}");
        }
    }
}
