//! The production matrix products: activations quantized to int8 blocks once per call, SIMD
//! dot products (smoe-kernels), output rows split across the persistent pool.

use super::pool::Pool;
use smoe_kernels::{Kernels, QuantAct};
use smoe_quant::QMatrix;
use std::cell::RefCell;

thread_local! {
    /// The calling thread's quantized activations, reused across calls.
    static ACT: RefCell<QuantAct> = RefCell::new(QuantAct::default());
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
        let dot = |r0: usize| {
            for r in r0..(r0 + rpt).min(m) {
                let row = &w.data[r * rb..(r + 1) * rb];
                for t in 0..n {
                    sink.write(t * m + r, k.dot(w.format, row, act.row(t)));
                }
            }
        };
        let tasks = m.div_ceil(rpt);
        pool.run(tasks, &|i| dot(i * rpt));
    })
}
