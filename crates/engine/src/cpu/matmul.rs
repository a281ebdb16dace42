//! Reference matrix products: f32 arithmetic on dequantized rows.

use rayon::prelude::*;
use smoe_quant::QMatrix;
use std::cell::RefCell;

thread_local! {
    /// One dequantized row per thread, reused across calls.
    static ROW: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Work (multiply-adds) below which an op stays on the calling thread.
const PAR_THRESHOLD: usize = 1 << 16;

pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight independent partial sums: better rounding than one running sum, and vectorisable.
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        for j in 0..8 {
            acc[j] += a[8 * i + j] * b[8 * i + j];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// `out[t, r] = w[r, :] · x[t, :]` for `t < n`.
pub(crate) fn matmul_ref(w: &QMatrix<'_>, x: &[f32], n: usize, out: &mut [f32]) {
    let (m, k) = (w.rows, w.cols);
    assert!(x.len() >= n * k && out.len() >= n * m, "matmul buffers too small");
    let rows_per_task = if m * k * n < PAR_THRESHOLD { m } else { (m / (4 * rayon::current_num_threads())).max(1) };
    let sink = super::DisjointOut::new(&mut out[..n * m]);
    let task = |r0: usize| {
        ROW.with(|row| {
            let mut row = row.borrow_mut();
            row.resize(k, 0.0);
            for r in r0..(r0 + rows_per_task).min(m) {
                w.dequantize_row(r, &mut row);
                for t in 0..n {
                    sink.write(t * m + r, dot(&row, &x[t * k..(t + 1) * k]));
                }
            }
        })
    };
    if rows_per_task >= m {
        task(0);
    } else {
        (0..m).into_par_iter().step_by(rows_per_task).for_each(task);
    }
}

/// `out[t, c] = Σ_r w[r, c] · x[t * x_stride + x_off + r]`.
pub(crate) fn matmul_t_ref(w: &QMatrix<'_>, x: &[f32], x_stride: usize, x_off: usize, n: usize, out: &mut [f32]) {
    let (m, k) = (w.rows, w.cols);
    out[..n * k].fill(0.0);
    ROW.with(|row| {
        let mut row = row.borrow_mut();
        row.resize(k, 0.0);
        for r in 0..m {
            w.dequantize_row(r, &mut row);
            for t in 0..n {
                let a = x[t * x_stride + x_off + r];
                for (o, &v) in out[t * k..(t + 1) * k].iter_mut().zip(row.iter()) {
                    *o += a * v;
                }
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use smoe_quant::Format;

    #[test]
    fn parallel_and_serial_products_agree() {
        let (m, k, n) = (300, 64, 5);
        let w: Vec<f32> = (0..m * k).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0).collect();
        let mut bytes = vec![0u8; m * k * 4];
        smoe_quant::quantize(Format::F32, &w, &mut bytes).unwrap();
        let q = QMatrix::new(Format::F32, m, k, &bytes).unwrap();
        let x: Vec<f32> = (0..n * k).map(|i| ((i * 13 % 29) as f32 - 14.0) / 7.0).collect();
        let mut out = vec![0f32; n * m];
        matmul_ref(&q, &x, n, &mut out);
        for t in 0..n {
            for r in 0..m {
                let e: f64 = (0..k).map(|c| w[r * k + c] as f64 * x[t * k + c] as f64).sum();
                assert!((out[t * m + r] as f64 - e).abs() < 1e-4, "{t} {r}");
            }
        }
        let mut out_t = vec![0f32; n * k];
        matmul_t_ref(&q, &out, m, 0, n, &mut out_t);
        for t in 0..n {
            for c in 0..k {
                let e: f64 = (0..m).map(|r| w[r * k + c] as f64 * out[t * m + r] as f64).sum();
                assert!((out_t[t * k + c] as f64 - e).abs() < 1e-2 * e.abs().max(1.0), "{t} {c}");
            }
        }
    }
}
