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
        for (w, j) in jobs {
            let key = (j.x_row, j.n, w.cols, smoe_kernels::act_kind(w.format));
            let idx = match keys.iter().position(|k| *k == key) {
                Some(i) => i,
                None => {
                    keys.push(key);
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
                    if j.n >= 4 && k.has_gemm(w.format) {
                        acts[i].build_tile(&mut tiles[i], j.n);
                    }
                    i
                }
            };
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
