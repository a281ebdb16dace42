//! Per-op conformance of a [`Backend`]: every op against a plain f32 implementation written
//! here, on random inputs of awkward sizes (odd token counts, rows that are not whole groups,
//! strides wider than rows, offsets, row ranges), as llama.cpp's `test-backend-ops` checks each
//! of its backends against the CPU.
//!
//! A new backend passes this suite unchanged before it runs a model:
//! `check_backend(&my_backend, &Tolerance::INT8_ACTIVATIONS)` returns every mismatch with the op,
//! the case and the element. Weights are quantized here and compared against their dequantized
//! values, so the suite measures the backend's arithmetic, not the format's rounding.

use crate::backend::{
    AttnParams, Backend, CompressWindows, CompressedParams, ExpertPart, IndexQueries, KvShape, MatJob, QkvRows, RopeTables, Selection,
    SeqQueries, SeqStore, WeightRef,
};
use crate::routing::{RouteScratch, RouterRule};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use smoe_quant::{Format, QMatrix};
use smoe_store::{ExpertView, SlotHandle};
use smoe_vault::{Moe, Router};
use std::sync::Arc;

/// How far a backend may be from the f32 implementation, per kind of op.
#[derive(Clone, Copy, Debug)]
pub struct Tolerance {
    /// Matrix products: |got − want| ≤ `products` × Σ|w| × max|x| over the output's row.
    pub products: f32,
    /// Attention: |got − want| ≤ `attention` × max |value| over the cache.
    pub attention: f32,
    /// Element-wise ops (norms, activations, rope, copies): |got − want| ≤ `elementwise` ×
    /// max(1, |want|).
    pub elementwise: f32,
}

impl Tolerance {
    /// A backend computing in f32 throughout (only the order of sums may differ).
    pub const F32: Tolerance = Tolerance { products: 1e-5, attention: 1e-5, elementwise: 1e-5 };
    /// A backend that rounds activations to int8 blocks before its products (at most half a
    /// step of max|x| / 127 per element), f32 elsewhere.
    pub const INT8_ACTIVATIONS: Tolerance = Tolerance { products: 1e-2, attention: 1e-4, elementwise: 1e-5 };
}

/// Runs every op's cases on `b`; `Ok(cases)` or every mismatch found.
pub fn check_backend<B: Backend>(b: &B, tol: &Tolerance) -> Result<usize, Vec<String>> {
    let mut s = Suite { b, tol: *tol, rng: StdRng::seed_from_u64(0x5eed), failures: Vec::new(), cases: 0 };
    s.buffers();
    s.embed();
    s.matmul();
    s.matmul_many();
    s.matmul_t();
    s.norms();
    s.elementwise();
    s.rope();
    s.rows();
    s.attention();
    if b.attends_windows_and_sinks() {
        s.bounded_rows();
    }
    s.attention_inputs();
    if b.attends_selected() {
        s.sparse_attention();
    }
    s.hyper_connections();
    if b.attends_compressed() {
        s.compressed_attention();
    }
    if b.runs_linear_attention() {
        s.linear_attention();
    }
    s.normed_products();
    s.product_add_norm();
    s.routing();
    s.kept();
    s.kept_batch();
    if s.failures.is_empty() {
        Ok(s.cases)
    } else {
        Err(s.failures)
    }
}

/// Weight formats and a row length each accepts (K-quants need whole super-blocks of 256; an
/// odd number of MXFP4's 17-byte and MXFP8's 33-byte blocks puts every other row at an odd
/// address; FP8's 132-byte blocks of 128, three to a row, leave rows 4-byte aligned only).
const FORMATS: [(Format, usize); 16] = [
    (Format::F32, 40),
    (Format::F16, 72),
    (Format::BF16, 104),
    (Format::Q8_0, 96),
    (Format::Q4_0, 160),
    (Format::Q4_1, 64),
    (Format::Q5_0, 224),
    (Format::Q5_1, 32),
    (Format::Q2_K, 256),
    (Format::Q3_K, 768),
    (Format::Q4_K, 512),
    (Format::Q5_K, 256),
    (Format::Q6_K, 256),
    (Format::MXFP4, 96),
    (Format::MXFP8, 160),
    (Format::FP8, 384),
];

/// Token counts: one (decode), fewer than a tile (3, and 8: the most the GPU's few-token
/// mat-vec takes), a tile and a remainder, two tiles and one.
const TOKENS: [usize; 5] = [1, 3, 8, 9, 17];

struct Suite<'a, B: Backend> {
    b: &'a B,
    tol: Tolerance,
    rng: StdRng,
    failures: Vec<String>,
    cases: usize,
}

/// One product of a `matmul_many` case: resident weights (else host), row range, first input
/// row, tokens, first output row, first output column.
type Job = (bool, Option<(usize, usize)>, usize, usize, usize, usize);

/// A quantized matrix in a region at an offset, and its dequantized values.
struct Weights {
    region: Arc<Vec<u8>>,
    offset: usize,
    format: Format,
    rows: usize,
    cols: usize,
    values: Vec<f32>,
}

impl Weights {
    fn view(&self) -> QMatrix<'_> {
        let len = self.format.row_bytes(self.cols).expect("a valid row length") * self.rows;
        QMatrix::new(self.format, self.rows, self.cols, &self.region[self.offset..self.offset + len]).expect("a valid matrix")
    }
}

impl<B: Backend> Suite<'_, B> {
    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.rng.random_range(-1.0f32..1.0)).collect()
    }

    /// A buffer of `len` floats holding `data` from its start (the rest zero).
    fn buf(&self, len: usize, data: &[f32]) -> B::Buf {
        let mut buf = self.b.buf("conformance", len);
        self.b.upload(&mut buf, data);
        buf
    }

    fn read(&self, buf: &B::Buf, len: usize) -> Vec<f32> {
        let mut out = vec![0.0; len];
        self.b.download(buf, 0, &mut out);
        out
    }

    /// `rows × cols` random weights in `format`, 64 bytes into a region (as dense tensors lie
    /// in a vault).
    fn weights(&mut self, format: Format, rows: usize, cols: usize) -> Weights {
        let rb = format.row_bytes(cols).expect("a valid row length");
        let src = self.values(rows * cols);
        let offset = 64;
        let mut region = vec![0u8; offset + rows * rb];
        for (d, s) in region[offset..].chunks_mut(rb).zip(src.chunks(cols)) {
            smoe_quant::quantize(format, s, d).expect("quantize");
        }
        let mut values = vec![0.0; rows * cols];
        smoe_quant::dequantize(format, &region[offset..], &mut values).expect("dequantize");
        Weights { region: Arc::new(region), offset, format, rows, cols, values }
    }

    fn matrix(&self, w: &Weights) -> B::Matrix {
        self.b.matrix(&w.region, w.offset, w.format, w.rows, w.cols)
    }

    /// Compares `got` with `want` element by element; `bound(i)` is element `i`'s tolerance.
    fn compare(&mut self, op: &str, case: &str, got: &[f32], want: &[f32], bound: impl Fn(usize) -> f32) {
        self.cases += 1;
        let bad: Vec<String> = (0..want.len())
            .filter(|&i| {
                // Written so that a NaN fails.
                let within = (got[i] - want[i]).abs() <= bound(i);
                !within
            })
            .take(3)
            .map(|i| format!("element {i}: got {} want {} (tolerance {})", got[i], want[i], bound(i)))
            .collect();
        if !bad.is_empty() {
            self.failures.push(format!("{op} ({case}): {}", bad.join("; ")));
        }
    }

    fn compare_elementwise(&mut self, op: &str, case: &str, got: &[f32], want: &[f32]) {
        let tol = self.tol.elementwise;
        self.compare(op, case, got, want, |i| tol * want[i].abs().max(1.0));
    }

    /// `x[t] · w[r]` for rows `r0..r0 + m` and `n` tokens of `x` (rows `x_stride` apart), with
    /// each output's product tolerance.
    fn products(&self, w: &Weights, r0: usize, m: usize, x: &[f32], x_stride: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
        let (mut want, mut bound) = (Vec::with_capacity(n * m), Vec::with_capacity(n * m));
        for t in 0..n {
            let xr = &x[t * x_stride..][..w.cols];
            let xmax = xr.iter().fold(0f32, |a, v| a.max(v.abs()));
            for r in r0..r0 + m {
                let wr = &w.values[r * w.cols..(r + 1) * w.cols];
                want.push(wr.iter().zip(xr).map(|(a, b)| (*a as f64) * (*b as f64)).sum::<f64>() as f32);
                bound.push(self.tol.products * wr.iter().map(|v| v.abs()).sum::<f32>() * xmax + 1e-6);
            }
        }
        (want, bound)
    }

    fn buffers(&mut self) {
        let data = self.values(37);
        let buf = self.buf(50, &data);
        let mut part = vec![0.0; 20];
        self.b.download(&buf, 11, &mut part);
        self.compare("upload/download", "37 floats, read back from 11", &part, &data[11..31], |_| 0.0);
    }

    fn embed(&mut self) {
        for (f, cols) in FORMATS {
            let w = self.weights(f, 11, cols);
            let table = self.matrix(&w);
            let ids = [10u32, 0, 3, 3, 7];
            let mut out = self.buf(ids.len() * cols, &[]);
            self.b.embed(&table, &ids, &mut out);
            let want: Vec<f32> = ids.iter().flat_map(|&i| w.values[i as usize * cols..(i as usize + 1) * cols].to_vec()).collect();
            let got = self.read(&out, want.len());
            self.compare("embed", &format!("{f}, rows 10 0 3 3 7"), &got, &want, |_| 0.0);
        }
    }

    fn matmul(&mut self) {
        for (f, cols) in FORMATS {
            for rows in [1usize, 13, 40] {
                self.matmul_shape(f, rows, cols, &TOKENS, (rows / 3, rows - rows / 3));
            }
        }
        // Prefill-sized products: several tiles of rows and of tokens (a GPU's 64 × 64), with
        // remainders of each, more groups of 32 than one step of a tile takes and an odd count;
        // and a router's shape, few tiles of long rows (a GPU splits them over the columns),
        // ending in part of a group.
        for (f, cols) in [(Format::Q4_K, 768usize), (Format::Q6_K, 768), (Format::Q8_0, 288), (Format::F32, 72), (Format::F32, 1000)] {
            self.matmul_shape(f, 130, cols, &[70], (5, 125));
        }
        // Long rows of the formats a GPU multiplies on int8 activations: more tasks than half a
        // warp's 16 (a warp a row: 2,304), and 128 or more (warps sharing a row: 8,192).
        for f in [Format::Q8_0, Format::Q4_K, Format::Q6_K] {
            for cols in [2304, 8192] {
                self.matmul_shape(f, 13, cols, &[1, 3], (2, 9));
            }
        }
    }

    /// `rows × cols` weights of format `f` against each token count: all rows, then `range`
    /// (first row, count; starting off a group boundary).
    fn matmul_shape(&mut self, f: Format, rows: usize, cols: usize, tokens: &[usize], range: (usize, usize)) {
        let w = self.weights(f, rows, cols);
        let m = self.matrix(&w);
        for &n in tokens {
            let x = self.values(n * cols);
            let xb = self.buf(n * cols, &x);
            for range in [None, Some(range)] {
                let (r0, count) = range.unwrap_or((0, rows));
                let mut out = self.buf(n * count, &[]);
                self.b.matmul(&m, range, &xb, n, &mut out);
                let (want, bound) = self.products(&w, r0, count, &x, cols, n);
                let got = self.read(&out, want.len());
                self.compare("matmul", &format!("{f}, {rows}x{cols}, rows {range:?}, {n} tokens"), &got, &want, |i| bound[i]);
            }
        }
    }

    /// A batch as the forward pass makes one for a layer's experts: resident and host
    /// matrices, row ranges, inputs shared by several jobs, outputs side by side in wide rows.
    fn matmul_many(&mut self) {
        for (f, cols) in FORMATS {
            let (x_stride, out_stride) = (cols + 24, 3 * 40 + 8);
            let resident = self.weights(f, 40, cols);
            let host = self.weights(f, 21, cols);
            let rm = self.matrix(&resident);
            let tokens = 30;
            let x = self.values(tokens * x_stride);
            let xb = self.buf(tokens * x_stride, &x);
            let plan: [Job; 5] = [
                (true, None, 0, 9, 0, 0),
                (false, None, 0, 9, 0, 40), // the same input as the first job
                (true, Some((8, 17)), 9, 1, 9, 0),
                (false, None, 10, 17, 10, 61), // a group with a remainder tile
                (true, Some((3, 29)), 27, 3, 27, 90),
            ];
            let jobs: Vec<MatJob<'_, B::Matrix>> = plan
                .iter()
                .map(|&(res, range, x_row, n, out_row, out_col)| MatJob {
                    w: if res { WeightRef::Resident(&rm, range) } else { WeightRef::Expert(host.view(), SlotHandle { slot: 7, load: 3 }) },
                    x_row,
                    n,
                    out_row,
                    out_col,
                })
                .collect();
            let mut out = self.buf(tokens * out_stride, &[]);
            self.b.matmul_many(&jobs, &xb, x_stride, &mut out, out_stride);
            let got = self.read(&out, tokens * out_stride);
            for (ji, &(res, range, x_row, n, out_row, out_col)) in plan.iter().enumerate() {
                let w = if res { &resident } else { &host };
                let (r0, m) = range.unwrap_or((0, w.rows));
                let (want, bound) = self.products(w, r0, m, &x[x_row * x_stride..], x_stride, n);
                let got: Vec<f32> = (0..n).flat_map(|t| got[(out_row + t) * out_stride + out_col..][..m].to_vec()).collect();
                self.compare("matmul_many", &format!("{f}, job {ji}"), &got, &want, |i| bound[i]);
            }
        }
    }

    fn matmul_t(&mut self) {
        for (f, cols) in [(Format::F32, 40usize), (Format::BF16, 64), (Format::Q8_0, 64)] {
            let w = self.weights(f, 24, cols);
            let m = self.matrix(&w);
            let (r0, rows, x_stride, x_off, n) = (5, 13, 31, 7, 9);
            let x = self.values(n * x_stride);
            let xb = self.buf(n * x_stride, &x);
            let mut out = self.buf(n * cols, &[]);
            self.b.matmul_t(&m, r0, rows, &xb, x_stride, x_off, n, &mut out);
            let mut want = vec![0.0; n * cols];
            let mut bound = vec![0.0; n * cols];
            for t in 0..n {
                for c in 0..cols {
                    let (mut s, mut l1) = (0f64, 0f32);
                    for r in 0..rows {
                        let (a, b) = (w.values[(r0 + r) * cols + c], x[t * x_stride + x_off + r]);
                        s += a as f64 * b as f64;
                        l1 += (a * b).abs();
                    }
                    want[t * cols + c] = s as f32;
                    bound[t * cols + c] = self.tol.elementwise * l1.max(1.0);
                }
            }
            let got = self.read(&out, n * cols);
            self.compare("matmul_t", &format!("{f}, rows {r0}..{}", r0 + rows), &got, &want, |i| bound[i]);
        }
    }

    fn norms(&mut self) {
        let (n, dim, eps) = (5, 72, 1e-6);
        let x = self.values(n * dim);
        let g = self.values(dim);
        let w = self.b.vector(&g);
        let rms = |v: &[f32]| 1.0 / ((v.iter().map(|a| (*a as f64).powi(2)).sum::<f64>() / v.len() as f64) as f32 + eps).sqrt();
        let xb = self.buf(n * dim, &x);
        let mut out = self.buf(n * dim, &[]);
        self.b.rms_norm(&xb, n, dim, &w, eps, &mut out);
        let want: Vec<f32> = x.chunks(dim).flat_map(|r| r.iter().zip(&g).map(|(v, g)| g * v * rms(r)).collect::<Vec<_>>()).collect();
        let got = self.read(&out, n * dim);
        self.compare_elementwise("rms_norm", "5 rows of 72", &got, &want);
        // Strided: segments of 24 at offset 10 of rows of 50 (per-head norms).
        let (stride, off, seg) = (50, 10, 24);
        let x = self.values(n * stride);
        let g = self.values(seg);
        let w = self.b.vector(&g);
        let mut xb = self.buf(n * stride, &x);
        self.b.rms_norm_strided(&mut xb, n, stride, off, seg, &w, eps);
        let mut want = x.clone();
        for t in 0..n {
            let r = &x[t * stride + off..][..seg];
            for i in 0..seg {
                want[t * stride + off + i] = g[i] * r[i] * rms(r);
            }
        }
        let got = self.read(&xb, n * stride);
        self.compare_elementwise("rms_norm_strided", "segments of 24 at 10 in rows of 50", &got, &want);
        // Heads: three segments of 12 end to end from offset 7 of rows of 50.
        let (heads, dim, off) = (3, 12, 7);
        let g = self.values(dim);
        let w = self.b.vector(&g);
        let mut xb = self.buf(n * stride, &x);
        self.b.rms_norm_heads(&mut xb, n, stride, off, heads, dim, &w, eps);
        let mut want = x.clone();
        for t in 0..n {
            for h in 0..heads {
                let at = t * stride + off + h * dim;
                let r = &x[at..at + dim];
                for i in 0..dim {
                    want[at + i] = g[i] * r[i] * rms(r);
                }
            }
        }
        let got = self.read(&xb, n * stride);
        self.compare_elementwise("rms_norm_heads", "3 heads of 12 at 7 in rows of 50", &got, &want);
        // The residual add and the next norm.
        let (n, dim) = (3, 72);
        let (x, y, g) = (self.values(n * dim), self.values(n * dim), self.values(dim));
        let w = self.b.vector(&g);
        let (mut xb, yb, mut out) = (self.buf(n * dim, &x), self.buf(n * dim, &y), self.buf(n * dim, &[]));
        self.b.add_rms_norm(&mut xb, &yb, n, dim, &w, eps, &mut out);
        let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        let want: Vec<f32> = sum.chunks(dim).flat_map(|r| r.iter().zip(&g).map(|(v, g)| g * v * rms(r)).collect::<Vec<_>>()).collect();
        let (got_sum, got) = (self.read(&xb, n * dim), self.read(&out, n * dim));
        self.compare_elementwise("add_rms_norm", "3 rows of 72, the sum", &got_sum, &sum);
        self.compare_elementwise("add_rms_norm", "3 rows of 72, normed", &got, &want);
    }

    /// Products whose input an op wrote just before (a norm, attention), as the decoder runs
    /// them: a backend may hand the product its input in another form (int8, quantized by the
    /// op that wrote it), and a later write must not leave a stale one behind.
    fn normed_products(&mut self) {
        let (dim, eps) = (256, 1e-6);
        let g = self.values(dim);
        let w = self.b.vector(&g);
        for f in [Format::Q8_0, Format::Q4_K, Format::F32] {
            let wt = self.weights(f, 24, dim);
            let m = self.matrix(&wt);
            for n in [1usize, 3] {
                let (x, y) = (self.values(n * dim), self.values(n * dim));
                let (mut xb, yb) = (self.buf(n * dim, &x), self.buf(n * dim, &y));
                let mut h = self.buf(n * dim, &[]);
                for step in ["after rms_norm", "after add_rms_norm", "after a later write"] {
                    match step {
                        "after rms_norm" => self.b.rms_norm(&xb, n, dim, &w, eps, &mut h),
                        "after add_rms_norm" => self.b.add_rms_norm(&mut xb, &yb, n, dim, &w, eps, &mut h),
                        _ => self.b.add(&mut h, &yb, n * dim),
                    }
                    let hv = self.read(&h, n * dim);
                    let mut out = self.buf(n * 24, &[]);
                    self.b.matmul(&m, None, &h, n, &mut out);
                    let (want, bound) = self.products(&wt, 0, 24, &hv, dim, n);
                    let got = self.read(&out, want.len());
                    self.compare("matmul", &format!("{f}, {n} tokens {step}"), &got, &want, |i| bound[i]);
                }
            }
        }
    }

    /// A sublayer's output projection with the residual add and next norm in one op
    /// ([`Backend::matmul_add_rms_norm`]) leaves the product, the residual and the normed rows of
    /// the two ops to the bit, and the next product reads the normed rows as it would after
    /// [`Backend::add_rms_norm`]: one token (a backend's fused decode case: a few rows normed
    /// by a few blocks' worth of threads, and more rows than a block's threads) and three;
    /// the projection's input uploaded, or left by a norm (which may hand on an int8 copy).
    fn product_add_norm(&mut self) {
        let (cols, eps) = (256, 1e-6);
        let g = self.values(cols);
        let in_norm = self.b.vector(&g);
        for f in [Format::Q8_0, Format::Q4_K, Format::F32] {
            for (n, dim) in [(1, 96), (1, 1088), (3, 96)] {
                let wt = self.weights(f, dim, cols);
                let proj = self.matrix(&wt);
                // Q8_0 rows of any multiple of 32 (Q4_K's are of 256).
                let next = self.weights(Format::Q8_0, 24, dim);
                let next = self.matrix(&next);
                let (a, x, gn) = (self.values(n * cols), self.values(n * dim), self.values(dim));
                let w = self.b.vector(&gn);
                for from in ["uploaded", "normed"] {
                    let mut input = self.buf(n * cols, &a);
                    if from == "normed" {
                        let raw = self.buf(n * cols, &a);
                        self.b.rms_norm(&raw, n, cols, &in_norm, eps, &mut input);
                    }
                    let mut got = Vec::new();
                    for fused in [true, false] {
                        let (mut y, mut xb, mut out) = (self.buf(n * dim, &[]), self.buf(n * dim, &x), self.buf(n * dim, &[]));
                        if fused {
                            self.b.matmul_add_rms_norm(&proj, &input, n, dim, &mut y, &mut xb, &w, eps, &mut out);
                        } else {
                            self.b.matmul(&proj, None, &input, n, &mut y);
                            self.b.add_rms_norm(&mut xb, &y, n, dim, &w, eps, &mut out);
                        }
                        let mut after = self.buf(n * 24, &[]);
                        self.b.matmul(&next, None, &out, n, &mut after);
                        let mut v = self.read(&y, n * dim);
                        v.extend(self.read(&xb, n * dim));
                        v.extend(self.read(&out, n * dim));
                        v.extend(self.read(&after, n * 24));
                        got.push(v);
                    }
                    let what = format!("{f}, {n} tokens onto {dim} rows, input {from}: product, residual, normed, next product");
                    self.compare("matmul_add_rms_norm", &what, &got[0], &got[1], |_| 0.0);
                }
            }
        }
    }

    fn elementwise(&mut self) {
        let silu = |a: f32| a / (1.0 + (-a).exp());
        let (n, stride, off) = (7, 45, 5);
        let x = self.values(n * stride);
        let bias = self.values(33);
        let bv = self.b.vector(&bias);
        let mut xb = self.buf(n * stride, &x);
        self.b.add_bias(&mut xb, n, stride, off, &bv);
        let mut want = x.clone();
        for t in 0..n {
            for (i, b) in bias.iter().enumerate() {
                want[t * stride + off + i] += b;
            }
        }
        let got = self.read(&xb, n * stride);
        self.compare_elementwise("add_bias", "33 at 5 in rows of 45", &got, &want);

        let len = 101;
        let (a, c) = (self.values(len + 9), self.values(len + 9));
        let (mut ab, cb) = (self.buf(len + 9, &a), self.buf(len + 9, &c));
        self.b.add(&mut ab, &cb, len);
        let want: Vec<f32> = (0..len + 9).map(|i| if i < len { a[i] + c[i] } else { a[i] }).collect();
        let got = self.read(&ab, len + 9);
        self.compare_elementwise("add", "first 101 of 110", &got, &want);

        let mut ab = self.buf(len + 9, &a);
        self.b.silu_mul(&mut ab, &cb, len);
        let want: Vec<f32> = (0..len + 9).map(|i| if i < len { silu(a[i]) * c[i] } else { a[i] }).collect();
        let got = self.read(&ab, len + 9);
        self.compare_elementwise("silu_mul", "first 101 of 110", &got, &want);

        let (rows, stride, w, row0, count) = (9, 70, 31, 2, 5);
        let x = self.values(rows * stride);
        let mut xb = self.buf(rows * stride, &x);
        self.b.silu_mul_halves(&mut xb, row0, count, stride, w);
        let mut want = x.clone();
        for r in row0..row0 + count {
            for i in 0..w {
                want[r * stride + i] = silu(x[r * stride + i]) * x[r * stride + w + i];
            }
        }
        let got = self.read(&xb, rows * stride);
        self.compare_elementwise("silu_mul_halves", "rows 2..7, halves of 31 in rows of 70", &got, &want);

        // Values past the clamp bound on both sides, so that both clamps are exercised.
        let (alpha, limit) = (1.702f32, 0.6f32);
        let x: Vec<f32> = self.values(rows * stride).iter().map(|v| v * 3.0).collect();
        let mut xb = self.buf(rows * stride, &x);
        self.b.swiglu_clamped_halves(&mut xb, row0, count, stride, w, alpha, limit);
        let mut want = x.clone();
        for r in row0..row0 + count {
            for i in 0..w {
                let g = x[r * stride + i].min(limit);
                let u = x[r * stride + w + i].clamp(-limit, limit);
                want[r * stride + i] = g / (1.0 + (-alpha * g).exp()) * (u + 1.0);
            }
        }
        let got = self.read(&xb, rows * stride);
        self.compare_elementwise("swiglu_clamped_halves", "rows 2..7, halves of 31 in rows of 70", &got, &want);

        let (n, dim) = (6, 37);
        let x = self.values(n * dim);
        let s = self.values(n);
        let mut xb = self.buf(n * dim, &x);
        self.b.scale_rows(&mut xb, dim, &s);
        let want: Vec<f32> = x.iter().enumerate().map(|(i, v)| v * s[i / dim]).collect();
        let got = self.read(&xb, n * dim);
        self.compare_elementwise("scale_rows", "6 rows of 37", &got, &want);
    }

    fn rope(&mut self) {
        for interleaved in [false, true] {
            let (n, stride, off, heads, head_stride, half) = (5, 200, 6, 3, 50, 12);
            let x = self.values(n * stride);
            let angles: Vec<f32> = self.values(n * half).iter().map(|a| a * 3.0).collect();
            let (cos, sin): (Vec<f32>, Vec<f32>) = angles.iter().map(|a| (a.cos(), a.sin())).unzip();
            let mut xb = self.buf(n * stride, &x);
            self.b.rope(&mut xb, n, stride, off, heads, head_stride, &cos, &sin, interleaved);
            let mut want = x.clone();
            for t in 0..n {
                for h in 0..heads {
                    let base = t * stride + off + h * head_stride;
                    for i in 0..half {
                        let (ia, ib) = if interleaved { (base + 2 * i, base + 2 * i + 1) } else { (base + i, base + i + half) };
                        let (c, s) = (cos[t * half + i], sin[t * half + i]);
                        want[ia] = x[ia] * c - x[ib] * s;
                        want[ib] = x[ib] * c + x[ia] * s;
                    }
                }
            }
            let got = self.read(&xb, n * stride);
            self.compare_elementwise("rope", &format!("interleaved {interleaved}, 3 heads of 24 rotated dims"), &got, &want);
        }
    }

    fn rows(&mut self) {
        let (n, src_stride, src_off, dst_stride, dst_off, width) = (6, 40, 3, 57, 11, 29);
        let src = self.values(n * src_stride);
        let dst0 = self.values(n * dst_stride);
        let sb = self.buf(n * src_stride, &src);
        let mut db = self.buf(n * dst_stride, &dst0);
        self.b.copy_strided(&sb, src_stride, src_off, &mut db, dst_stride, dst_off, width, n);
        let mut want = dst0.clone();
        for t in 0..n {
            want[t * dst_stride + dst_off..][..width].copy_from_slice(&src[t * src_stride + src_off..][..width]);
        }
        let got = self.read(&db, n * dst_stride);
        self.compare("copy_strided", "29 of rows 40 at 3 into rows 57 at 11", &got, &want, |_| 0.0);

        let dim = 13;
        let src = self.values(10 * dim);
        let sb = self.buf(10 * dim, &src);
        let rows = [9usize, 0, 4, 4, 7];
        let mut db = self.buf(rows.len() * dim, &[]);
        self.b.gather_rows(&sb, dim, &rows, &mut db);
        let want: Vec<f32> = rows.iter().flat_map(|&r| src[r * dim..(r + 1) * dim].to_vec()).collect();
        let got = self.read(&db, want.len());
        self.compare("gather_rows", "rows 9 0 4 4 7", &got, &want, |_| 0.0);

        let rows = [8usize, 1, 5];
        let src = self.values(rows.len() * dim);
        let dst0 = self.values(10 * dim);
        let sb = self.buf(rows.len() * dim, &src);
        let mut db = self.buf(10 * dim, &dst0);
        self.b.scatter_rows(&sb, dim, &rows, &mut db);
        let mut want = dst0.clone();
        for (i, &r) in rows.iter().enumerate() {
            want[r * dim..(r + 1) * dim].copy_from_slice(&src[i * dim..(i + 1) * dim]);
        }
        let got = self.read(&db, 10 * dim);
        self.compare("scatter_rows", "rows 8 1 5", &got, &want, |_| 0.0);

        let (n, k, dim) = (5, 3, 21);
        let src = self.values(n * k * dim);
        let weights = self.values(n * k);
        let out0 = self.values(n * dim);
        let sb = self.buf(n * k * dim, &src);
        let mut ob = self.buf(n * dim, &out0);
        self.b.add_weighted_slots(&sb, dim, n, k, &weights, &mut ob);
        let mut want = out0.clone();
        for t in 0..n {
            for s in 0..k {
                for i in 0..dim {
                    want[t * dim + i] += weights[t * k + s] * src[(t * k + s) * dim + i];
                }
            }
        }
        let got = self.read(&ob, n * dim);
        self.compare_elementwise("add_weighted_slots", "5 tokens, 3 slots of 21", &got, &want);
    }

    /// Grouped-query attention with separate values, and one latent head whose values are
    /// the keys' first dims (MLA), filled in two stores; queries after a prefix, and a context
    /// longer than the fast path's blocks of positions.
    /// Routing where the logits lie against [`RouterRule::route`] on the host: softmax with and
    /// without renormalisation, and sigmoid scores with a correction bias over groups (with
    /// groups of one expert, and a scaling), written at an offset into a wider buffer. The ids
    /// must be equal; the weights within the elementwise tolerance.
    fn routing(&mut self) {
        let rules = [
            ("softmax, renormalised", 60, 4, Router::Softmax, true, 1.0),
            ("softmax", 33, 7, Router::Softmax, false, 1.0),
            ("sigmoid, 8 groups, best 3", 64, 6, Router::SigmoidGrouped { n_group: 8, topk_group: 3, correction_bias: true }, true, 2.5),
            ("sigmoid, groups of one", 16, 2, Router::SigmoidGrouped { n_group: 16, topk_group: 4, correction_bias: true }, false, 1.0),
            ("sqrt-softplus, renormalised", 48, 6, Router::SqrtSoftplus { correction_bias: true }, true, 1.5),
        ];
        for (case, e, k, router, norm, scaling) in rules {
            let moe = Moe {
                num_experts: e,
                top_k: k,
                intermediate_size: 1,
                router: router.clone(),
                norm_topk_prob: norm,
                routed_scaling_factor: scaling,
                shared_experts: None,
                router_logit_bias: false,
                expert_bias: false,
                expert_act: Default::default(),
                hash_layers: vec![],
            };
            let rule = RouterRule::new(&moe);
            let n = 5;
            // Sqrt-softplus is linear above 20: logits on both sides of it.
            let spread = if matches!(router, Router::SqrtSoftplus { .. }) { 25.0 } else { 4.0 };
            let logits: Vec<f32> = self.values(n * e).iter().map(|v| spread * v).collect();
            let bias_host = matches!(router, Router::SigmoidGrouped { .. } | Router::SqrtSoftplus { .. }).then(|| self.values(e));
            let bias = bias_host.as_ref().map(|b| self.b.vector(b));
            let lb = self.buf(n * e, &logits);
            let at = 3;
            let mut routes = self.buf(at + n * 2 * k + 2, &[]);
            self.b.route(&rule, &lb, bias.as_ref(), n, &mut routes, at);
            let got = self.read(&routes, at + n * 2 * k);
            let mut want = vec![0f32; n * 2 * k];
            rule.route_rows(&logits, bias_host.as_deref(), n, &mut want, &mut RouteScratch::default());
            let ids = |v: &[f32]| -> Vec<f32> { v.chunks(2 * k).flat_map(|r| r[..k].to_vec()).collect() };
            let weights = |v: &[f32]| -> Vec<f32> { v.chunks(2 * k).flat_map(|r| r[k..].to_vec()).collect() };
            self.compare("route", &format!("{case}: experts"), &ids(&got[at..]), &ids(&want), |_| 0.0);
            self.compare_elementwise("route", &format!("{case}: weights"), &weights(&got[at..]), &weights(&want));
            // The router's product and its routing in one op leave what the two ops leave, to
            // the bit: one token (a backend's fused decode case) and three, f32 router rows.
            let cols = 72;
            let w = self.weights(Format::F32, e, cols);
            let router_matrix = self.matrix(&w);
            for t in [1, 3] {
                let x = self.values(t * cols);
                let xb = self.buf(t * cols, &x);
                let (mut l1, mut l2) = (self.buf(t * e, &[]), self.buf(t * e, &[]));
                let (mut r1, mut r2) = (self.buf(at + t * 2 * k, &[]), self.buf(at + t * 2 * k, &[]));
                self.b.router_and_route(&router_matrix, &xb, t, &mut l1, &rule, bias.as_ref(), &mut r1, at);
                self.b.matmul(&router_matrix, None, &xb, t, &mut l2);
                self.b.route(&rule, &l2, bias.as_ref(), t, &mut r2, at);
                let what = format!("{case}: {t} tokens, logits then routes");
                let (mut a, mut b) = (self.read(&l1, t * e), self.read(&l2, t * e));
                a.extend(self.read(&r1, at + t * 2 * k).split_off(at));
                b.extend(self.read(&r2, at + t * 2 * k).split_off(at));
                self.compare("router_and_route", &what, &a, &b, |_| 0.0);
            }
        }
    }

    /// Experts kept by the backend (only where [`Backend::keep_room`] offers room): kept from
    /// two batches, run by [`Backend::kept_experts`] for routes at an offset, and named in
    /// [`Backend::matmul_many`] jobs ([`WeightRef::Kept`]), against SwiGLU in f32 on the
    /// dequantized weights. Gate and up in different formats, as a mix has them.
    fn kept(&mut self) {
        if self.b.keep_room() == 0 {
            return;
        }
        let (e, k, n, hidden, width) = (5usize, 2usize, 3usize, 256usize, 96usize);
        let layer = 2;
        let mats: Vec<[Weights; 3]> = (0..e)
            .map(|_| {
                [
                    self.weights(Format::Q4_K, width, hidden),
                    self.weights(Format::Q5_K, width, hidden),
                    self.weights(Format::Q8_0, hidden, width),
                ]
            })
            .collect();
        let views = expert_views(&mats);
        let kept = self.b.keep_experts(layer, e, &views[..2]) & self.b.keep_experts(layer, e, &views[2..]);
        self.cases += 1;
        if !kept {
            self.failures.push("keep_experts: five small experts not kept despite room".into());
            return;
        }
        let h = self.values(n * hidden);
        let hb = self.buf(n * hidden, &h);
        // Token t's slots: experts (t + 4) % 5 and t, with weights.
        let at = 5;
        let mut routes_host = vec![0f32; at + n * 2 * k];
        for t in 0..n {
            let r = &mut routes_host[at + t * 2 * k..][..2 * k];
            r.copy_from_slice(&[((t + 4) % e) as f32, t as f32, 0.75, -0.5]);
        }
        let routes = self.buf(routes_host.len(), &routes_host);
        let x0 = self.values(n * hidden);
        // Plain SwiGLU, then DeepSeek-V4's clipped SiLU (a bound the gate and up products cross).
        let mut want_gu = Vec::new();
        for limit in [None, Some(2.0f32)] {
            let mut x = self.buf(n * hidden, &x0);
            let mut gu = self.buf(n * k * 2 * width, &[]);
            let mut slots = self.buf(n * k * hidden, &[]);
            self.b.kept_experts(layer, &routes, at, k, &hb, n, &mut gu, &mut slots, &mut x, limit);
            let got = self.read(&x, n * hidden);
            let (want, bound, gu_want) = kept_reference(&mats, &h, &routes_host[at..], (n, k, hidden, width), &x0, limit, &self.tol);
            want_gu = gu_want;
            let case = match limit {
                None => "Q4_K gate, Q5_K up, Q8_0 down; 3 tokens of 2 slots".to_string(),
                Some(l) => format!("the same, SiLU clipped at {l}"),
            };
            self.compare("kept_experts", &case, &got, &want, |i| bound[i]);
        }
        // The same through matmul_many jobs naming kept experts: pair p = t k + s on its own rows.
        let mut jobs = Vec::new();
        for t in 0..n {
            for s in 0..k {
                let (p, expert) = (t * k + s, routes_host[at + t * 2 * k + s] as u32);
                jobs.push(MatJob { w: WeightRef::Kept { layer, expert, part: ExpertPart::Gate }, x_row: t, n: 1, out_row: p, out_col: 0 });
                jobs.push(MatJob {
                    w: WeightRef::Kept { layer, expert, part: ExpertPart::Up },
                    x_row: t,
                    n: 1,
                    out_row: p,
                    out_col: width,
                });
            }
        }
        let mut gu2 = self.buf(n * k * 2 * width, &[]);
        self.b.matmul_many(&jobs, &hb, hidden, &mut gu2, 2 * width);
        let gu_got = self.read(&gu2, n * k * 2 * width);
        let gub: Vec<f32> = (0..n * k * 2 * width)
            .map(|i| {
                let (p, c) = (i / (2 * width), i % (2 * width));
                let (t, m) = (p / k, if c < width { 0 } else { 1 });
                let ex = routes_host[at + t * 2 * k + p % k] as usize;
                let row = c % width;
                let wv = &mats[ex][m].values[row * hidden..(row + 1) * hidden];
                let xmax = h[t * hidden..(t + 1) * hidden].iter().fold(0f32, |a, v| a.max(v.abs()));
                self.tol.products * wv.iter().map(|v| v.abs()).sum::<f32>() * xmax + 1e-6
            })
            .collect();
        self.compare("matmul_many", "kept experts by id", &gu_got, &want_gu, |i| gub[i]);
    }

    /// A batched step through kept experts at the shapes a backend's batched kernels take:
    /// gate and up in one format, rows of 512 (two steps of eight groups for int8 tiles), 16
    /// experts, 8 slots, one token (a decode step's eight slots), 40 tokens (320 pairs; expert
    /// 0 in every token's first slot, so one expert has 40 pairs and the rest some 19 each),
    /// then 600 (a prefill chunk's size:
    /// expert 0 with 600 pairs, more than a tile block lists at once), the input as a norm
    /// leaves it (where a backend keeps an int8 copy beside the rows, its products read that),
    /// against SwiGLU in f32 on the dequantized weights. Q4_K gate and up with Q8_0 down, all
    /// Q8_0, and Q4_K gate and up with Q6_K down.
    fn kept_batch(&mut self) {
        if self.b.keep_room() == 0 {
            return;
        }
        let (e, k, hidden, width) = (16usize, 8usize, 512usize, 512usize);
        // The third: Q4_K_M's mix, whose down projections are Q6_K in half the layers.
        for (layer, gate_up, down) in [(3, Format::Q4_K, Format::Q8_0), (4, Format::Q8_0, Format::Q8_0), (5, Format::Q4_K, Format::Q6_K)] {
            let mats: Vec<[Weights; 3]> = (0..e)
                .map(|_| [self.weights(gate_up, width, hidden), self.weights(gate_up, width, hidden), self.weights(down, hidden, width)])
                .collect();
            let views = expert_views(&mats);
            self.cases += 1;
            if !self.b.keep_experts(layer, e, &views) {
                self.failures.push(format!("keep_experts: {e} experts of 512-wide rows not kept despite room"));
                return;
            }
            for n in [1usize, 40, 600] {
                let (raw, ones) = (self.values(n * hidden), vec![1f32; hidden]);
                let (rb, w) = (self.buf(n * hidden, &raw), self.b.vector(&ones));
                let mut hb = self.buf(n * hidden, &[]);
                self.b.rms_norm(&rb, n, hidden, &w, 1e-6, &mut hb);
                let h = self.read(&hb, n * hidden);
                // Slot 0: expert 0; slots 1..8: seven distinct others, shifting with the token.
                let mut routes_host = vec![0f32; n * 2 * k];
                for t in 0..n {
                    let r = &mut routes_host[t * 2 * k..][..2 * k];
                    for s in 0..k {
                        r[s] = if s == 0 { 0.0 } else { (1 + (3 * t + 2 * s) % 15) as f32 };
                        r[k + s] = 0.05 + 0.1 * s as f32;
                    }
                }
                let routes = self.buf(routes_host.len(), &routes_host);
                let x0 = self.values(n * hidden);
                let mut x = self.buf(n * hidden, &x0);
                let mut gu = self.buf(n * k * 2 * width, &[]);
                let mut slots = self.buf(n * k * hidden, &[]);
                self.b.kept_experts(layer, &routes, 0, k, &hb, n, &mut gu, &mut slots, &mut x, None);
                let got = self.read(&x, n * hidden);
                let (want, bound, _) = kept_reference(&mats, &h, &routes_host, (n, k, hidden, width), &x0, None, &self.tol);
                self.compare(
                    "kept_experts",
                    &format!("{gate_up} gate and up, {down} down, rows of 512; {n} tokens of 8 slots on 16 experts"),
                    &got,
                    &want,
                    |i| bound[i],
                );
                if n <= 40 {
                    self.kept_then_norm(layer, &routes, k, n, (hidden, width), &rb, &w);
                }
            }
        }
    }

    /// [`Backend::kept_experts_norm`] against [`Backend::kept_experts`] then
    /// [`Backend::rms_norm`], to the bit: the residual, the normed rows, and a product that
    /// reads them after (as the next layer's first does); the experts' input as a norm leaves
    /// it from `raw` (with `in_norm`).
    #[allow(clippy::too_many_arguments)]
    fn kept_then_norm(
        &mut self,
        layer: usize,
        routes: &B::Buf,
        k: usize,
        n: usize,
        dims: (usize, usize),
        raw: &B::Buf,
        in_norm: &B::Vector,
    ) {
        let (hidden, width) = dims;
        let (x0, g) = (self.values(n * hidden), self.values(hidden));
        let next_norm = self.b.vector(&g);
        let next = self.weights(Format::Q8_0, 24, hidden);
        let next = self.matrix(&next);
        let mut got = Vec::new();
        for fused in [true, false] {
            let mut h = self.buf(n * hidden, &[]);
            self.b.rms_norm(raw, n, hidden, in_norm, 1e-6, &mut h);
            let mut x = self.buf(n * hidden, &x0);
            let (mut gu, mut slots) = (self.buf(n * k * 2 * width, &[]), self.buf(n * k * hidden, &[]));
            if fused {
                self.b.kept_experts_norm(layer, routes, 0, k, &mut h, n, &mut gu, &mut slots, &mut x, None, hidden, &next_norm, 1e-5);
            } else {
                self.b.kept_experts(layer, routes, 0, k, &h, n, &mut gu, &mut slots, &mut x, None);
                self.b.rms_norm(&x, n, hidden, &next_norm, 1e-5, &mut h);
            }
            let mut after = self.buf(n * 24, &[]);
            self.b.matmul(&next, None, &h, n, &mut after);
            let mut v = self.read(&x, n * hidden);
            v.extend(self.read(&h, n * hidden));
            v.extend(self.read(&after, n * 24));
            got.push(v);
        }
        let case = format!("{n} tokens of {k} slots, rows of {hidden}: residual, normed, next product");
        self.compare("kept_experts_norm", &case, &got[0], &got[1], |_| 0.0);
    }

    fn attention(&mut self) {
        let cases = [
            ("GQA 6 query heads on 2", KvShape { heads: 2, k_dim: 24, v_dim: 16, values_in_keys: false, keep: None, f16: false }, 6, 12, 5),
            (
                "MLA 5 query heads on 1 latent",
                KvShape { heads: 1, k_dim: 40, v_dim: 32, values_in_keys: true, keep: None, f16: false },
                5,
                12,
                5,
            ),
            (
                "GQA over 700 positions",
                KvShape { heads: 2, k_dim: 32, v_dim: 32, values_in_keys: false, keep: None, f16: false },
                4,
                700,
                3,
            ),
            (
                "GQA, one query after 300 positions",
                KvShape { heads: 2, k_dim: 64, v_dim: 64, values_in_keys: false, keep: None, f16: false },
                4,
                301,
                1,
            ),
            (
                "GQA, 45 queries after 30 positions",
                KvShape { heads: 2, k_dim: 40, v_dim: 24, values_in_keys: false, keep: None, f16: false },
                6,
                75,
                45,
            ),
            (
                "GQA, 70 queries from the start",
                KvShape { heads: 1, k_dim: 128, v_dim: 128, values_in_keys: false, keep: None, f16: false },
                3,
                70,
                70,
            ),
            // Prefill kernels' tiles: several query tiles after a prefix, and a latent head
            // whose values are its keys' first columns.
            (
                "GQA, 150 queries after 100 positions",
                KvShape { heads: 2, k_dim: 64, v_dim: 64, values_in_keys: false, keep: None, f16: false },
                8,
                250,
                150,
            ),
            (
                "MLA, 20 queries after 20 positions",
                KvShape { heads: 1, k_dim: 40, v_dim: 32, values_in_keys: true, keep: None, f16: false },
                5,
                40,
                20,
            ),
            // Heads of 128 (CUDA's own instance) whose query tiles' keys are split over blocks.
            (
                "GQA, 200 queries of 128 after 150 positions",
                KvShape { heads: 1, k_dim: 128, v_dim: 128, values_in_keys: false, keep: None, f16: false },
                2,
                350,
                200,
            ),
        ];
        // gpt-oss: sliding windows and per-head sinks, alone and together.
        let windowed = [
            (
                "GQA, window 64 over 700 positions, sinks",
                KvShape { heads: 2, k_dim: 32, v_dim: 32, values_in_keys: false, keep: None, f16: false },
                4,
                700,
                3,
                Some(64),
                true,
            ),
            (
                "GQA, 45 queries in a window of 7",
                KvShape { heads: 2, k_dim: 40, v_dim: 24, values_in_keys: false, keep: None, f16: false },
                6,
                75,
                45,
                Some(7),
                false,
            ),
            (
                "GQA, 70 queries from the start, sinks",
                KvShape { heads: 1, k_dim: 64, v_dim: 64, values_in_keys: false, keep: None, f16: false },
                3,
                70,
                70,
                None,
                true,
            ),
        ];
        let windowed = if self.b.attends_windows_and_sinks() { &windowed[..] } else { &[] };
        let all = cases.into_iter().map(|(w, s, q, p, n)| (w, s, q, p, n, None, false)).chain(windowed.iter().copied());
        // Each case again with f16 rows where the backend stores them: the outputs are those of
        // attention over the values rounded to f16 (within the same bound), and a copy and a
        // batch give the bits alone.
        let halves: &[bool] = if self.b.kv_f16() { &[false, true] } else { &[false] };
        let all: Vec<_> = all.flat_map(|c| halves.iter().map(move |&h| (c, h))).collect();
        for ((what, shape, q_heads, positions, n, window, with_sinks), f16) in all {
            let shape = KvShape { f16, ..shape };
            let what = &if f16 { format!("{what}, f16 rows") } else { what.to_string() }[..];
            let (kw, vw) = (shape.heads * shape.k_dim, shape.heads * shape.v_dim);
            let keys = self.values(positions * kw);
            let values = self.values(positions * vw);
            let round = |v: &[f32]| -> Vec<f32> {
                v.iter().map(|&x| if f16 { smoe_quant::half::f16_bits_to_f32(smoe_quant::half::f32_to_f16_bits(x)) } else { x }).collect()
            };
            // What the cache holds, for the reference below.
            let (held_keys, held_values) = (round(&keys), round(&values));
            let mut cache =
                self.b.kv_cache(&[KvShape { heads: 1, k_dim: 8, v_dim: 8, values_in_keys: false, keep: None, f16: false }, shape]);
            self.b.kv_reserve(&mut cache, positions);
            self.cases += 1;
            if self.b.kv_capacity(&cache) < positions {
                self.failures.push(format!("kv_reserve ({what}): capacity {} after reserving {positions}", self.b.kv_capacity(&cache)));
            }
            // Keys in rows of kw + 5 at offset 2, values in rows of vw + 3 at offset 1; stored
            // as a prefix and then the rest, as prefill chunks do.
            let (k_stride, v_stride) = (kw + 5, vw + 3);
            let first = positions - n;
            for (p0, count) in [(0, first), (first, n)] {
                let mut kb = vec![0.0; count * k_stride];
                let mut vb = vec![0.0; count * v_stride];
                for t in 0..count {
                    kb[t * k_stride + 2..][..kw].copy_from_slice(&keys[(p0 + t) * kw..][..kw]);
                    vb[t * v_stride + 1..][..vw].copy_from_slice(&values[(p0 + t) * vw..][..vw]);
                }
                let (kbuf, vbuf) = (self.buf(kb.len(), &kb), self.buf(vb.len().max(1), &vb));
                let v = (!shape.values_in_keys).then_some((&vbuf, v_stride, 1));
                self.b.kv_store(&mut cache, 1, p0, count, &kbuf, k_stride, 2, v);
            }
            let q_stride = q_heads * shape.k_dim + 7;
            let q = self.values(n * q_stride);
            let qb = self.buf(n * q_stride, &q);
            let scale = 1.0 / (shape.k_dim as f32).sqrt();
            let mut out = self.buf(n * q_heads * shape.v_dim, &[]);
            // Sinks around the scores' size, so that some win the maximum and some do not.
            let sinks: Vec<f32> = if with_sinks { self.values(q_heads).iter().map(|v| v * 4.0).collect() } else { vec![] };
            let params = AttnParams { q_heads, scale, window, sinks: with_sinks.then_some(&sinks[..]), selected: None };
            self.b.attention(&cache, 1, &qb, q_stride, n, first, params, &mut out);
            let group = q_heads / shape.heads;
            let mut want = Vec::new();
            for t in 0..n {
                for h in 0..q_heads {
                    let kv = h / group;
                    let qr = &q[t * q_stride + h * shape.k_dim..][..shape.k_dim];
                    let key = |p: usize| &held_keys[p * kw + kv * shape.k_dim..][..shape.k_dim];
                    let value = |p: usize| -> &[f32] {
                        if shape.values_in_keys {
                            &key(p)[..shape.v_dim]
                        } else {
                            &held_values[p * vw + kv * shape.v_dim..][..shape.v_dim]
                        }
                    };
                    let visible = first + t + 1;
                    let lo = params.first_seen(first + t);
                    let scores: Vec<f64> = (lo..visible)
                        .map(|p| qr.iter().zip(key(p)).map(|(a, b)| (*a as f64) * (*b as f64)).sum::<f64>() * scale as f64)
                        .collect();
                    let sink = sinks.get(h).map(|&s| s as f64);
                    let max = scores.iter().cloned().chain(sink).fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let sum: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |s| (s - max).exp());
                    for d in 0..shape.v_dim {
                        want.push((lo..visible).map(|p| e[p - lo] / sum * value(p)[d] as f64).sum::<f64>() as f32);
                    }
                }
            }
            let vmax = if shape.values_in_keys { &keys } else { &values }.iter().fold(0f32, |a, v| a.max(v.abs()));
            let got = self.read(&out, want.len());
            let tol = self.tol.attention * vmax;
            self.compare("attention", what, &got, &want, |_| tol);
            // A copy of the cache's positions (a new sequence from a shared prefix) attends
            // the same, to the bit.
            // (Every layer of a sequence holds its positions: layer 0's too.)
            let zeros = self.buf(positions * 8, &[]);
            self.b.kv_store(&mut cache, 0, 0, positions, &zeros, 8, 0, Some((&zeros, 8, 0)));
            let mut copy =
                self.b.kv_cache(&[KvShape { heads: 1, k_dim: 8, v_dim: 8, values_in_keys: false, keep: None, f16: false }, shape]);
            if self.b.kv_copy(&cache, &mut copy, positions) {
                let mut out = self.buf(n * q_heads * shape.v_dim, &[]);
                self.b.attention(&copy, 1, &qb, q_stride, n, first, params, &mut out);
                let again = self.read(&out, want.len());
                self.compare("kv_copy", what, &again, &got, |_| 0.0);
            }
            // Where the backend batches sequences: these queries and, after them, the last one
            // again as a decode token of its own, in one call; each gets the bits it gets alone.
            if self.b.batches_attention(&params) {
                let last = q[(n - 1) * q_stride..n * q_stride].to_vec();
                let lb = self.buf(q_stride, &last);
                let mut one = self.buf(q_heads * shape.v_dim, &[]);
                self.b.attention(&cache, 1, &lb, q_stride, 1, positions - 1, params, &mut one);
                let alone: Vec<f32> = got.iter().copied().chain(self.read(&one, q_heads * shape.v_dim)).collect();
                let both: Vec<f32> = q.iter().chain(&last).copied().collect();
                let bb = self.buf(both.len(), &both);
                let mut out = self.buf((n + 1) * q_heads * shape.v_dim, &[]);
                let seqs =
                    [SeqQueries { cache: &cache, row: 0, n, pos0: first }, SeqQueries { cache: &cache, row: n, n: 1, pos0: positions - 1 }];
                self.b.attention_batch(1, &seqs, &bb, q_stride, params, &mut out);
                let got = self.read(&out, alone.len());
                self.compare("attention_batch", what, &got, &alone, |_| 0.0);
            }
        }
    }

    /// A bounded layer ([`KvShape::keep`]: gpt-oss's sliding layers, DeepSeek-V4's rows),
    /// stored in steps of awkward sizes past several drops of old rows, each step's queries
    /// attending their window with sinks: the outputs of a layer that keeps every row, to the
    /// bit, from fewer bytes.
    fn bounded_rows(&mut self) {
        let (keep, window, q_heads, positions) = (20, 12, 4, 700);
        let full = KvShape { heads: 2, k_dim: 16, v_dim: 16, values_in_keys: false, keep: None, f16: false };
        let (kw, qw) = (full.heads * full.k_dim, q_heads * full.k_dim);
        let (keys, values) = (self.values(positions * kw), self.values(positions * kw));
        let (mut all, mut some) = (self.b.kv_cache(&[full]), self.b.kv_cache(&[KvShape { keep: Some(keep), ..full }]));
        let sinks = self.values(q_heads);
        let params = AttnParams { q_heads, scale: 0.25, window: Some(window), sinks: Some(&sinks), selected: None };
        let (mut p0, mut steps) = (0, [37, 1, 1, 90, 5, 128, 1, 200, 3].iter().cycle());
        while p0 < positions {
            let n = (*steps.next().expect("a cycle")).min(positions - p0);
            let (kb, vb) = (self.buf(n * kw, &keys[p0 * kw..][..n * kw]), self.buf(n * kw, &values[p0 * kw..][..n * kw]));
            let q = self.values(n * qw);
            let qb = self.buf(n * qw, &q);
            let mut outs = Vec::new();
            for cache in [&mut all, &mut some] {
                self.b.kv_store(cache, 0, p0, n, &kb, kw, 0, Some((&vb, kw, 0)));
                let mut out = self.buf(n * qw, &[]);
                self.b.attention(cache, 0, &qb, qw, n, p0, params, &mut out);
                outs.push(self.read(&out, n * qw));
            }
            self.compare("kv_store, bounded rows", &format!("{n} positions from {p0}, keep {keep}"), &outs[1], &outs[0], |_| 0.0);
            p0 += n;
        }
        let (a, b) = (self.b.kv_bytes(&all), self.b.kv_bytes(&some));
        self.cases += 1;
        if b >= a / 2 {
            self.failures.push(format!("kv_store, bounded rows: {b} bytes held for {positions} positions, {a} keeping every row"));
        }
    }

    /// DeepSeek Sparse Attention's ops: the indexer key's LayerNorm, the indexer's selection
    /// (checked as a valid top-k of f64 scores: the positions it keeps score at least as well as
    /// those it drops, up to rounding) and attention over selected positions.
    /// DeepSeek-V4's stream ops and clipped SwiGLU against [`crate::hyper`]'s plain loops.
    fn hyper_connections(&mut self) {
        let (n, m, d) = (5, 4, 24);
        let (x, y) = (self.values(n * m * d), self.values(n * d));
        let (pre, post, comb) = (self.values(n * m), self.values(n * m), self.values(n * m * m));
        let mut out = self.buf(n * d, &vec![0.0; n * d]);
        self.b.hc_collapse(&self.buf(x.len(), &x), n, m, d, &pre, &mut out);
        let mut want = vec![0f32; n * d];
        crate::hyper::collapse(&x, n, m, d, &pre, &mut want);
        let got = self.read(&out, n * d);
        self.compare_elementwise("hc_collapse", "5 rows of 4 streams of 24", &got, &want);
        let mut xb = self.buf(x.len(), &x);
        self.b.hc_expand(&mut xb, &self.buf(y.len(), &y), n, m, d, &post, &comb);
        let mut want = x.clone();
        crate::hyper::expand(&mut want, &y, n, m, d, &post, &comb);
        let got = self.read(&xb, x.len());
        self.compare_elementwise("hc_expand", "5 rows of 4 streams of 24", &got, &want);
        // Values up to 3 in magnitude against a limit of 1: most are clipped.
        let (g, u): (Vec<f32>, Vec<f32>) =
            (self.values(60).iter().map(|v| 3.0 * v).collect(), self.values(60).iter().map(|v| 3.0 * v).collect());
        let mut gb = self.buf(60, &g);
        self.b.silu_mul_clamped(&mut gb, &self.buf(60, &u), 60, 1.0);
        let want: Vec<f32> = g.iter().zip(&u).map(|(&a, &b)| crate::hyper::clamped_silu(a, b, 1.0)).collect();
        let got = self.read(&gb, 60);
        self.compare_elementwise("silu_mul_clamped", "60 values, limit 1", &got, &want);
        let (rows, stride, w) = (4, 20, 8);
        let xs: Vec<f32> = self.values(rows * stride).iter().map(|v| 3.0 * v).collect();
        let mut xb = self.buf(xs.len(), &xs);
        self.b.silu_clamped_halves(&mut xb, 1, 3, stride, w, 1.0);
        let mut want = xs.clone();
        for r in 1..rows {
            for c in 0..w {
                want[r * stride + c] = crate::hyper::clamped_silu(xs[r * stride + c], xs[r * stride + w + c], 1.0);
            }
        }
        let got = self.read(&xb, xs.len());
        self.compare_elementwise("silu_clamped_halves", "rows 1..4 of 20, halves of 8", &got, &want);
    }

    /// Gated DeltaNet (Qwen3-Next) against the host's head-by-head run: a 9-token prompt at
    /// rows 2.. of a step, then three decode steps continuing its state, with two key heads
    /// serving six value heads; and the gated attention output.
    fn linear_attention(&mut self) {
        let (kh, vh, kd, vd, taps) = (2, 6, 16, 8, 4);
        let (conv, neg_a, dt, norm) = (self.values((2 * kh * kd + vh * vd) * taps), self.values(vh), self.values(vh), self.values(vd));
        let neg_a: Vec<f32> = neg_a.iter().map(|v| -v.abs() - 0.1).collect();
        let p: crate::backend::DeltaNetParams<'_> = crate::backend::DeltaNetParams {
            key_heads: kh,
            value_heads: vh,
            tiled: false,
            key_dim: kd,
            value_dim: vd,
            taps,
            conv: &conv,
            neg_a: &neg_a,
            dt_bias: &dt,
            norm: &norm,
            eps: 1e-6,
        };
        let stride = p.stride();
        let (rows, vw, sf) = (14, vh * vd, p.state_floats());
        let x = self.values(rows * stride);
        let xb = self.buf(x.len(), &x);
        let mut state = self.buf(sf, &vec![7.0; sf]);
        let mut out = self.buf(rows * vw, &vec![0.0; rows * vw]);
        let vectors = [&conv, &neg_a, &dt, &norm].map(|v| self.b.vector(v));
        let on_backend = p.with(&vectors[0], &vectors[1], &vectors[2], &vectors[3]);
        self.b.gated_delta_net(on_backend, &xb, 2, 9, &mut state, true, &mut out);
        for t in 11..rows {
            self.b.gated_delta_net(on_backend, &xb, t, 1, &mut state, false, &mut out);
        }
        let (mut want_state, mut want) = (vec![0f32; sf], vec![0f32; rows * vw]);
        crate::delta::gated_delta_net(&p, &x[2 * stride..], 9, &mut want_state, true, &mut want[2 * vw..]);
        for t in 11..rows {
            crate::delta::gated_delta_net(&p, &x[t * stride..], 1, &mut want_state, false, &mut want[t * vw..]);
        }
        let got = self.read(&out, rows * vw);
        self.compare_elementwise(
            "gated_delta_net",
            "9 prompt tokens at row 2, 3 decode steps, 2 key heads for 6",
            &got[2 * vw..],
            &want[2 * vw..],
        );
        let got = self.read(&state, sf);
        self.compare_elementwise("gated_delta_net state", "after 12 tokens", &got, &want_state);
        // The gated output: rows of 10 against gates at offset 3 of rows of 16.
        let (n, w, gs) = (4, 10, 16);
        let (a, g) = (self.values(n * w), self.values(n * gs));
        let mut ab = self.buf(a.len(), &a);
        self.b.sigmoid_gate(&mut ab, n, w, &self.buf(g.len(), &g), gs, 3);
        let want: Vec<f32> = (0..n * w).map(|i| a[i] / (1.0 + (-g[(i / w) * gs + 3 + i % w]).exp())).collect();
        let got = self.read(&ab, n * w);
        self.compare_elementwise("sigmoid_gate", "4 rows of 10, gates at 3 of 16", &got, &want);
    }

    /// DeepSeek-V4's attention over a sliding window and compressed entries (stored directly,
    /// as the compressor would), every entry or a selection, with sinks; keys are values. The
    /// reference is a plain f64 softmax over the same rows.
    fn compressed_attention(&mut self) {
        // (what, positions, queries at the end, heads, dim, window, rate, selected)
        let cases = [
            ("decode after 300, window 16, every entry of rate 8", 300, 1, 4, 32, 16, 8, false),
            ("12 queries, window 5, selected entries of rate 4", 60, 12, 3, 16, 5, 4, true),
            ("prefill from 0, window 40 beyond the positions", 20, 20, 2, 16, 40, 4, false),
        ];
        for (what, positions, n, heads, dim, window, rate, selected) in cases {
            let shape = KvShape { heads: 1, k_dim: dim, v_dim: dim, values_in_keys: true, keep: None, f16: false };
            let entries_n = positions / rate;
            let (keys, entries) = (self.values(positions * dim), self.values(entries_n.max(1) * dim));
            let mut cache = self.b.kv_cache(&[shape, KvShape { v_dim: 0, ..shape }]);
            self.b.kv_store(&mut cache, 0, 0, positions, &self.buf(keys.len(), &keys), dim, 0, None);
            self.b.kv_store(&mut cache, 1, 0, entries_n.max(1), &self.buf(entries.len(), &entries), dim, 0, None);
            let q = self.values(n * heads * dim);
            let sinks = self.values(heads);
            let pos0 = positions - n;
            // Every other visible entry, for the selected case.
            let top = entries_n.max(1);
            let mut sel = vec![u32::MAX; n * top];
            for t in 0..n {
                let seen = (pos0 + t + 1) / rate;
                for (slot, j) in (0..seen).step_by(2).enumerate() {
                    sel[t * top + slot] = j as u32;
                }
            }
            let p = CompressedParams {
                q_heads: heads,
                scale: 1.0 / (dim as f32).sqrt(),
                window,
                sinks: &sinks,
                entries: Some((1, rate)),
                selected: selected.then_some(Selection { positions: &sel, per_query: top }),
            };
            let mut out = self.buf(n * heads * dim, &vec![0.0; n * heads * dim]);
            self.b.attention_compressed(&cache, 0, &self.buf(q.len(), &q), n, pos0, p, &mut out);
            let got = self.read(&out, n * heads * dim);
            let mut want = vec![0f32; n * heads * dim];
            for t in 0..n {
                let pos = pos0 + t;
                let mut rows: Vec<&[f32]> = ((pos + 1).saturating_sub(window)..=pos).map(|j| &keys[j * dim..][..dim]).collect();
                let seen = (pos + 1) / rate;
                let picked: Vec<usize> = if selected { (0..seen).step_by(2).collect() } else { (0..seen).collect() };
                rows.extend(picked.iter().map(|&j| &entries[j * dim..][..dim]));
                let row = heads * dim;
                attention_with_sinks(&q[t * row..][..row], heads, dim, &rows, &sinks, &mut want[t * row..][..row]);
            }
            let tol = self.tol.attention;
            self.compare("attention_compressed", what, &got, &want, |_| tol);
        }
        self.compressor();
    }

    /// DeepSeek-V4's compressor: closed windows pooled into entries in two calls (the second
    /// starting where the first stopped, reading the previous window where windows overlap),
    /// then read back through [`Backend::attention_compressed`] (a window of one position and
    /// every entry), against [`compressed_entry`] and the plain attention over them.
    fn compressor(&mut self) {
        // (what, overlap, rate, dim, windows in the first call, windows)
        let cases = [("overlapping windows of 4, entries of 24", true, 4, 24, 2, 5), ("windows of 8, entries of 20", false, 8, 20, 1, 3)];
        for (what, overlap, rate, dim, split, count) in cases {
            let cw = if overlap { 2 * dim } else { dim };
            // Two positions more, in a window still open.
            let positions = count * rate + 2;
            let raw: Vec<f32> = self.values(positions * 2 * cw).iter().map(|v| 3.0 * v).collect();
            let bias = self.values(rate * cw);
            let norm: Vec<f32> = self.values(dim).iter().map(|v| 1.0 + 0.2 * v).collect();
            let half = 3;
            let angles = self.values(count * half);
            let (cs, sn): (Vec<f32>, Vec<f32>) = angles.iter().map(|a| ((3.0 * a).cos(), (3.0 * a).sin())).unzip();
            let keys = self.values(positions * dim);
            let row = |w: usize| KvShape { heads: 1, k_dim: w, v_dim: 0, values_in_keys: true, keep: None, f16: false };
            let mut cache = self.b.kv_cache(&[KvShape { v_dim: dim, ..row(dim) }, row(2 * cw), row(dim)]);
            self.b.kv_store(&mut cache, 0, 0, positions, &self.buf(keys.len(), &keys), dim, 0, None);
            self.b.kv_store(&mut cache, 1, 0, positions, &self.buf(raw.len(), &raw), 2 * cw, 0, None);
            let (bv, nv) = (self.b.vector(&bias), self.b.vector(&norm));
            for (first, n) in [(0, split), (split, count - split)] {
                let rope = RopeTables { cos: &cs[first * half..][..n * half], sin: &sn[first * half..][..n * half], interleaved: true };
                let c = CompressWindows {
                    raw_layer: 1,
                    entry_layer: 2,
                    first,
                    count: n,
                    rate,
                    dim,
                    overlap,
                    bias: &bv,
                    norm: &nv,
                    eps: 1e-6,
                    rope,
                };
                self.b.compress_windows(&mut cache, c);
            }
            let heads = 2;
            let (q, sinks) = (self.values(heads * dim), self.values(heads));
            let pos = positions - 1;
            let p = CompressedParams {
                q_heads: heads,
                scale: 1.0 / (dim as f32).sqrt(),
                window: 1,
                sinks: &sinks,
                entries: Some((2, rate)),
                selected: None,
            };
            let mut out = self.buf(heads * dim, &[]);
            self.b.attention_compressed(&cache, 0, &self.buf(q.len(), &q), 1, pos, p, &mut out);
            let got = self.read(&out, heads * dim);
            let entries: Vec<Vec<f32>> = (0..count)
                .map(|w| compressed_entry(&raw, w, rate, dim, overlap, &bias, &norm, &cs[w * half..][..half], &sn[w * half..][..half]))
                .collect();
            let mut rows: Vec<&[f32]> = vec![&keys[pos * dim..][..dim]];
            rows.extend(entries.iter().map(|e| &e[..]));
            let mut want = vec![0f32; heads * dim];
            attention_with_sinks(&q, heads, dim, &rows, &sinks, &mut want);
            let largest = rows.iter().flat_map(|r| r.iter()).fold(0f32, |m, v| m.max(v.abs()));
            let tol = self.tol.attention * largest.max(1.0);
            self.compare("compress_windows", what, &got, &want, |_| tol);
        }
    }

    fn sparse_attention(&mut self) {
        // LayerNorm: segments of 24 at offset 10 of rows of 50.
        let (n, stride, off, dim, eps) = (5, 50, 10, 24, 1e-6f32);
        let (x, g, bias) = (self.values(n * stride), self.values(dim), self.values(dim));
        let (w, bv) = (self.b.vector(&g), self.b.vector(&bias));
        let mut xb = self.buf(n * stride, &x);
        self.b.layer_norm_strided(&mut xb, n, stride, off, dim, &w, &bv, eps);
        let mut want = x.clone();
        for t in 0..n {
            let r = &x[t * stride + off..][..dim];
            let mean = r.iter().map(|&v| v as f64).sum::<f64>() / dim as f64;
            let var = r.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / dim as f64;
            for i in 0..dim {
                want[t * stride + off + i] = ((r[i] as f64 - mean) / (var + eps as f64).sqrt() * g[i] as f64 + bias[i] as f64) as f32;
            }
        }
        let got = self.read(&xb, n * stride);
        self.compare_elementwise("layer_norm_strided", "segments of 24 at 10 in rows of 50", &got, &want);

        // Selection: (what, positions, queries at the end, first row, heads, dim, top, positions
        // per key). DeepSeek-V4's keys are compressed entries, one per `rate` positions.
        let cases = [
            ("decode, one query after 1100 positions", 1100, 1, 0, 4, 16, 64, 1),
            ("5 queries after 295 positions, from row 2", 300, 5, 2, 3, 32, 40, 1),
            ("40 queries from the start, 16 kept", 40, 40, 0, 2, 8, 16, 1),
            ("30 queries from the start, a key per 4 positions, 5 kept", 30, 30, 1, 2, 16, 5, 4),
        ];
        let index_keys = KvShape { heads: 1, k_dim: 0, v_dim: 0, values_in_keys: true, keep: None, f16: false };
        for (what, positions, n, row0, heads, dim, top, rate) in cases {
            if rate > 1 && !self.b.attends_compressed() {
                continue;
            }
            let shape = KvShape { k_dim: dim, ..index_keys };
            let key_count = positions / rate;
            let keys = self.values(key_count * dim);
            let mut cache = self.b.kv_cache(&[shape]);
            self.b.kv_store(&mut cache, 0, 0, key_count, &self.buf(keys.len(), &keys), dim, 0, None);
            let rows = row0 + n;
            let (q, wts) = (self.values(rows * heads * dim), self.values(rows * heads));
            let (qb, wb) = (self.buf(q.len(), &q), self.buf(wts.len(), &wts));
            let mut out = vec![0u32; n * top];
            let pos0 = positions - n;
            self.b.index_select(&cache, 0, &qb, &wb, IndexQueries { row0, n, pos0, heads, top, rate }, &mut out);
            self.cases += 1;
            for t in 0..n {
                let p = pos0 + t;
                let score = |j: usize| -> f64 {
                    (0..heads)
                        .map(|h| {
                            let qh = &q[((row0 + t) * heads + h) * dim..][..dim];
                            let d: f64 = qh.iter().zip(&keys[j * dim..][..dim]).map(|(a, b)| *a as f64 * *b as f64).sum();
                            wts[(row0 + t) * heads + h] as f64 * d.max(0.0)
                        })
                        .sum()
                };
                let row = &out[t * top..][..top];
                let kept: Vec<usize> = row.iter().take_while(|&&j| j != u32::MAX).map(|&j| j as usize).collect();
                let seen = (p + 1) / rate;
                let expect_len = top.min(seen);
                let ascending = kept.windows(2).all(|w| w[0] < w[1]);
                let valid = kept.len() == expect_len && ascending && kept.iter().all(|&j| j < seen);
                let worst_kept = kept.iter().map(|&j| score(j)).fold(f64::MAX, f64::min);
                let best_dropped = (0..seen).filter(|j| !kept.contains(j)).map(score).fold(f64::MIN, f64::max);
                let scale = (0..heads).map(|h| wts[(row0 + t) * heads + h].abs() as f64).sum::<f64>() * dim as f64;
                if !valid || best_dropped > worst_kept + 1e-5 * scale {
                    self.failures.push(format!(
                        "index_select ({what}): query {t} at {p} kept {} positions (ascending {ascending}), worst kept {worst_kept:.6}, best dropped {best_dropped:.6}",
                        kept.len()
                    ));
                    break;
                }
            }
        }

        // Attention over selected positions: MLA's shape (values in the keys), four queries at
        // the end of 200 positions, each keeping its own 24 of them (one keeps only 5).
        let (shape, q_heads, positions, n, per) =
            (KvShape { heads: 1, k_dim: 40, v_dim: 32, values_in_keys: true, keep: None, f16: false }, 5, 200, 4, 24);
        let keys = self.values(positions * shape.k_dim);
        let mut cache = self.b.kv_cache(&[shape]);
        self.b.kv_store(&mut cache, 0, 0, positions, &self.buf(keys.len(), &keys), shape.k_dim, 0, None);
        let mut sel = vec![u32::MAX; n * per];
        for t in 0..n {
            let mut picks: Vec<u32> = (0..=(positions - n + t) as u32).filter(|_| self.rng.random_range(0..5) == 0).collect();
            picks.truncate(if t == 2 { 5 } else { per });
            sel[t * per..][..picks.len()].copy_from_slice(&picks);
        }
        let q = self.values(n * q_heads * shape.k_dim);
        let qb = self.buf(q.len(), &q);
        let scale = 0.2;
        let selection = Selection { positions: &sel, per_query: per };
        let params = AttnParams { q_heads, scale, window: None, sinks: None, selected: Some(selection) };
        let mut out = self.buf(n * q_heads * shape.v_dim, &[]);
        self.b.attention(&cache, 0, &qb, q_heads * shape.k_dim, n, positions - n, params, &mut out);
        let mut want = Vec::new();
        for t in 0..n {
            let js: Vec<usize> = selection.of(t).collect();
            for h in 0..q_heads {
                let qr = &q[(t * q_heads + h) * shape.k_dim..][..shape.k_dim];
                let key = |p: usize| &keys[p * shape.k_dim..][..shape.k_dim];
                let sc: Vec<f64> =
                    js.iter().map(|&p| qr.iter().zip(key(p)).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64).collect();
                let max = sc.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = sc.iter().map(|s| (s - max).exp()).collect();
                let sum: f64 = e.iter().sum();
                for d in 0..shape.v_dim {
                    want.push(js.iter().zip(&e).map(|(&p, w)| w / sum * key(p)[d] as f64).sum::<f64>() as f32);
                }
            }
        }
        let got = self.read(&out, want.len());
        let tol = self.tol.attention * keys.iter().fold(0f32, |a, v| a.max(v.abs()));
        self.compare("attention", "selected positions (sparse attention)", &got, &want, |_| tol);
    }

    /// `qk_rope_store`: q and k heads normed and rotated in place, keys and values stored. The
    /// stored rows are checked through attention against a cache filled by `kv_store` with the
    /// expected rows.
    fn attention_inputs(&mut self) {
        let eps = 1e-6;
        // (case, q heads, kv heads, head dim, rotated pairs, norms, interleaved)
        let cases = [
            ("4 on 2 heads of 32, per-head norms", 4, 2, 32, 16, true, false),
            ("6 on 3 heads of 24, partial rotary, no norms", 6, 3, 24, 8, false, false),
            ("4 on 1 head of 64, interleaved, per-head norms", 4, 1, 64, 32, true, true),
        ];
        for (what, qh, kvh, hd, half, normed, interleaved) in cases {
            let (n, pos0) = (3, 5);
            let stride = (qh + 2 * kvh) * hd + 4;
            let x = self.values(n * stride);
            let (gq, gk) = (self.values(hd), self.values(hd));
            let (wq, wk) = (self.b.vector(&gq), self.b.vector(&gk));
            let angles: Vec<f32> = self.values(n * half).iter().map(|a| a * 3.0).collect();
            let (cos, sin): (Vec<f32>, Vec<f32>) = angles.iter().map(|a| (a.cos(), a.sin())).unzip();
            // The expected rows.
            let mut want = x.clone();
            let rms = |v: &[f32]| 1.0 / ((v.iter().map(|a| (*a as f64).powi(2)).sum::<f64>() / v.len() as f64) as f32 + eps).sqrt();
            for t in 0..n {
                for h in 0..qh + kvh {
                    let at = t * stride + h * hd;
                    let mut v = x[at..at + hd].to_vec();
                    if normed {
                        let (r, g) = (rms(&v), if h < qh { &gq } else { &gk });
                        v = v.iter().zip(g).map(|(a, g)| g * a * r).collect();
                    }
                    let mut o = v.clone();
                    for p in 0..half {
                        let (ia, ib) = if interleaved { (2 * p, 2 * p + 1) } else { (p, p + half) };
                        let (c, s) = (cos[t * half + p], sin[t * half + p]);
                        o[ia] = v[ia] * c - v[ib] * s;
                        o[ib] = v[ib] * c + v[ia] * s;
                    }
                    want[at..at + hd].copy_from_slice(&o);
                }
            }
            let shape = KvShape { heads: kvh, k_dim: hd, v_dim: hd, values_in_keys: false, keep: None, f16: false };
            // Positions 0..pos0 hold the same random rows in both caches.
            let prefix = self.values(pos0 * stride);
            let mut caches = Vec::new();
            for _ in 0..2 {
                let mut cache = self.b.kv_cache(&[shape]);
                let pb = self.buf(prefix.len(), &prefix);
                self.b.kv_store(&mut cache, 0, 0, pos0, &pb, stride, qh * hd, Some((&pb, stride, (qh + kvh) * hd)));
                caches.push(cache);
            }
            let mut xb = self.buf(n * stride, &x);
            let rows = QkvRows { stride, q_heads: qh, kv_heads: kvh, head_dim: hd };
            let norm = normed.then_some((&wq, &wk, eps));
            let rope = RopeTables { cos: &cos, sin: &sin, interleaved };
            self.b.qk_rope_store(&mut xb, n, rows, norm, rope, &mut caches[0], 0, pos0);
            let got = self.read(&xb, n * stride);
            self.compare_elementwise("qk_rope_store", &format!("{what}: rows"), &got, &want);
            let wb = self.buf(want.len(), &want);
            self.b.kv_store(&mut caches[1], 0, pos0, n, &wb, stride, qh * hd, Some((&wb, stride, (qh + kvh) * hd)));
            let mut outs = Vec::new();
            for cache in &caches {
                let mut out = self.buf(n * qh * hd, &[]);
                self.b.attention(
                    cache,
                    0,
                    &wb,
                    stride,
                    n,
                    pos0,
                    AttnParams { q_heads: qh, scale: 0.2, window: None, sinks: None, selected: None },
                    &mut out,
                );
                outs.push(self.read(&out, n * qh * hd));
            }
            let tol = self.tol.attention * 4.0;
            self.compare("qk_rope_store", &format!("{what}: stored keys and values, through attention"), &outs[0], &outs[1], |_| tol);
            // The same rows as two sequences of one step (row 0; rows 1 and 2), each over its
            // own cache: every row, and each cache (read through attention), as alone, to the bit.
            let mut caches = Vec::new();
            for _ in 0..4 {
                let mut cache = self.b.kv_cache(&[shape]);
                let pb = self.buf(prefix.len(), &prefix);
                self.b.kv_store(&mut cache, 0, 0, pos0, &pb, stride, qh * hd, Some((&pb, stride, (qh + kvh) * hd)));
                caches.push(cache);
            }
            let (batched, alone) = caches.split_at_mut(2);
            let mut xb = self.buf(n * stride, &x);
            let [c0, c1] = batched else { unreachable!() };
            let mut seqs = [SeqStore { cache: c0, row: 0, n: 1, pos0 }, SeqStore { cache: c1, row: 1, n: 2, pos0 }];
            self.b.qk_rope_store_batch(&mut xb, n, rows, norm, rope, &mut seqs, 0);
            let got = self.read(&xb, n * stride);
            let mut each = Vec::new();
            let mut outs = Vec::new();
            for (i, (r0, m)) in [(0, 1), (1, 2)].into_iter().enumerate() {
                let mut ab = self.buf(m * stride, &x[r0 * stride..(r0 + m) * stride]);
                let span = r0 * half..(r0 + m) * half;
                let rope = RopeTables { cos: &cos[span.clone()], sin: &sin[span], interleaved };
                self.b.qk_rope_store(&mut ab, m, rows, norm, rope, &mut alone[i], 0, pos0);
                each.extend(self.read(&ab, m * stride));
                for cache in [&batched[i], &alone[i]] {
                    let mut out = self.buf(m * qh * hd, &[]);
                    let params = AttnParams { q_heads: qh, scale: 0.2, window: None, sinks: None, selected: None };
                    self.b.attention(cache, 0, &ab, stride, m, pos0, params, &mut out);
                    outs.push(self.read(&out, m * qh * hd));
                }
            }
            self.compare("qk_rope_store_batch", &format!("{what}: rows"), &got, &each, |_| 0.0);
            let (batched_outs, alone_outs): (Vec<f32>, Vec<f32>) =
                (outs[0].iter().chain(&outs[2]).copied().collect(), outs[1].iter().chain(&outs[3]).copied().collect());
            self.compare("qk_rope_store_batch", &format!("{what}: each cache, through attention"), &batched_outs, &alone_outs, |_| 0.0);
        }
    }
}

/// Entry `w` as transformers' compressors build it, written out plainly in f64 (the reference
/// of [`Backend::compress_windows`], RMSNorm epsilon 1e-6): from `raw`'s `[kv | gate]` rows
/// (`2 × c × dim` a position), the window's `[2 × rate, dim]` slots (the previous window's
/// first halves, -inf gates at window 0, then this window's second halves; or just the window
/// without overlap), a softmax over slots per channel, the weighted sum, RMSNorm with `norm`,
/// RoPE on the last `2 × cs.len()` dimensions.
#[allow(clippy::too_many_arguments)]
pub fn compressed_entry(
    raw: &[f32],
    w: usize,
    rate: usize,
    dim: usize,
    overlap: bool,
    bias: &[f32],
    norm: &[f32],
    cs: &[f32],
    sn: &[f32],
) -> Vec<f32> {
    let cw = if overlap { 2 * dim } else { dim };
    let row = |p: usize| &raw[p * 2 * cw..][..2 * cw];
    let mut slots: Vec<(Vec<f64>, Vec<f64>)> = Vec::new(); // (kv, gate) per slot
    if overlap {
        for i in 0..rate {
            if w == 0 {
                slots.push((vec![0.0; dim], vec![f64::NEG_INFINITY; dim]));
            } else {
                let r = row((w - 1) * rate + i);
                slots.push(((0..dim).map(|c| r[c] as f64).collect(), (0..dim).map(|c| (r[cw + c] + bias[i * cw + c]) as f64).collect()));
            }
        }
    }
    let off = if overlap { dim } else { 0 };
    for i in 0..rate {
        let r = row(w * rate + i);
        slots.push((
            (0..dim).map(|c| r[off + c] as f64).collect(),
            (0..dim).map(|c| (r[cw + off + c] + bias[i * cw + off + c]) as f64).collect(),
        ));
    }
    let mut e: Vec<f64> = (0..dim)
        .map(|c| {
            let max = slots.iter().fold(f64::NEG_INFINITY, |m, s| m.max(s.1[c]));
            let den: f64 = slots.iter().map(|s| (s.1[c] - max).exp()).sum();
            slots.iter().map(|s| (s.1[c] - max).exp() * s.0[c]).sum::<f64>() / den
        })
        .collect();
    let rms = (e.iter().map(|v| v * v).sum::<f64>() / dim as f64 + 1e-6).sqrt();
    for (v, &g) in e.iter_mut().zip(norm) {
        *v = *v / rms * g as f64;
    }
    let half = cs.len();
    for i in 0..half {
        let (a, b) = (e[dim - 2 * half + 2 * i], e[dim - 2 * half + 2 * i + 1]);
        e[dim - 2 * half + 2 * i] = a * cs[i] as f64 - b * sn[i] as f64;
        e[dim - 2 * half + 2 * i + 1] = b * cs[i] as f64 + a * sn[i] as f64;
    }
    e.into_iter().map(|v| v as f32).collect()
}

/// One query's attention (`heads` heads of `dim` in `q`, scale `1/sqrt(dim)`) over `rows`
/// (keys equal to values) in f64, each head's softmax with its sink: DeepSeek-V4's.
fn attention_with_sinks(q: &[f32], heads: usize, dim: usize, rows: &[&[f32]], sinks: &[f32], out: &mut [f32]) {
    for h in 0..heads {
        let qh = &q[h * dim..][..dim];
        let scores: Vec<f64> =
            rows.iter().map(|r| qh.iter().zip(*r).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() / (dim as f64).sqrt()).collect();
        let max = scores.iter().fold(sinks[h] as f64, |a, &b| a.max(b));
        let den: f64 = scores.iter().map(|s| (s - max).exp()).sum::<f64>() + (sinks[h] as f64 - max).exp();
        for c in 0..dim {
            let v: f64 = scores.iter().zip(rows).map(|(s, r)| (s - max).exp() * r[c] as f64).sum();
            out[h * dim + c] = (v / den) as f32;
        }
    }
}

/// Expert `i`'s gate, up and down as the store would hand them over (slot `i`).
fn expert_views(mats: &[[Weights; 3]]) -> Vec<(u32, ExpertView<'_>)> {
    mats.iter()
        .enumerate()
        .map(|(i, [g, u, d])| {
            (i as u32, ExpertView { slot: SlotHandle { slot: i as u32, load: 1 }, gate: g.view(), up: u.view(), down: d.view() })
        })
        .collect()
}

/// SwiGLU of kept experts in f32 on the dequantized weights, for `n` tokens of `k` slots
/// (`routes`: per token k expert ids, then k weights), added into `x0`: the result, each
/// element's bound, and the gate and up products per pair (`[n k, 2 width]`).
fn kept_reference(
    mats: &[[Weights; 3]],
    h: &[f32],
    routes: &[f32],
    (n, k, hidden, width): (usize, usize, usize, usize),
    x0: &[f32],
    limit: Option<f32>,
    tol: &Tolerance,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mut want, mut bound, mut want_gu) = (x0.to_vec(), vec![0f32; n * hidden], vec![0f32; n * k * 2 * width]);
    let dot = |m: &Weights, row: usize, v: &[f32]| -> f64 {
        m.values[row * m.cols..(row + 1) * m.cols].iter().zip(v).map(|(a, b)| *a as f64 * *b as f64).sum()
    };
    for t in 0..n {
        let hr = &h[t * hidden..(t + 1) * hidden];
        for s in 0..k {
            let r = &routes[t * 2 * k..];
            let (ex, w) = (r[s] as usize, r[k + s]);
            let [g, u, d] = &mats[ex];
            let p = t * k + s;
            let act: Vec<f32> = (0..width)
                .map(|i| {
                    let (gv, uv) = (dot(g, i, hr) as f32, dot(u, i, hr) as f32);
                    want_gu[p * 2 * width + i] = gv;
                    want_gu[p * 2 * width + width + i] = uv;
                    match limit {
                        None => gv / (1.0 + (-gv).exp()) * uv,
                        Some(l) => crate::hyper::clamped_silu(gv, uv, l),
                    }
                })
                .collect();
            let amax = act.iter().fold(0f32, |a, v| a.max(v.abs()));
            for c in 0..hidden {
                want[t * hidden + c] += w * dot(d, c, &act) as f32;
                let l1: f32 = d.values[c * width..(c + 1) * width].iter().map(|v| v.abs()).sum();
                // The activations carry the gate/up products' rounding into the down product.
                bound[t * hidden + c] += w.abs() * (tol.products * 8.0 * l1 * amax.max(1.0)) + 1e-5;
            }
        }
    }
    (want, bound, want_gu)
}
