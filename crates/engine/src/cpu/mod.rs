//! The CPU backend.
//!
//! `Precision::Reference` computes in f32 on dequantized weights: the correctness path that
//! `smoe score` uses and that tests compare with transformers. Work is spread over rayon's pool
//! when an op is big enough to be worth it.

mod attention;
mod compressed;
mod cores;
mod fast;
mod kv_rows;
mod matmul;
pub mod pool;
mod sparse;

use crate::backend::{
    check, check_rows, AttnParams, Backend, CompressWindows, CompressedParams, DeltaNetParams, IndexQueries, KvShape, MatJob, SeqQueries,
    WeightRef,
};
use crate::routing::{RouteScratch, RouterRule};
use kv_rows::KvRows;
use smoe_quant::{Format, QMatrix};
use std::sync::Arc;

pub use cores::default_threads;

/// An output buffer shared by pool tasks that write disjoint parts of it (output rows of a
/// product, (token, head) rows of attention), so that no task needs a lock or a copy.
pub(crate) struct DisjointOut {
    ptr: *mut f32,
    len: usize,
}
// SAFETY: tasks write disjoint index sets (each caller partitions the output), and the buffer
// stays mutably borrowed by the caller for as long as the tasks run.
unsafe impl Sync for DisjointOut {}
impl DisjointOut {
    fn new(out: &mut [f32]) -> DisjointOut {
        DisjointOut { ptr: out.as_mut_ptr(), len: out.len() }
    }

    /// Over memory not yet initialised (a vector's spare capacity), written only through
    /// [`write_from`](Self::write_from).
    fn new_uninit(out: &mut [std::mem::MaybeUninit<f32>]) -> DisjointOut {
        DisjointOut { ptr: out.as_mut_ptr().cast(), len: out.len() }
    }

    /// Copies `src` to `start..`, which no other task touches.
    ///
    /// # Safety
    /// No other task may touch `start..start + src.len()` meanwhile.
    unsafe fn write_from(&self, start: usize, src: &[f32]) {
        assert!(start + src.len() <= self.len);
        // SAFETY: in bounds (checked), exclusive by the caller's guarantee; `src` is a shared
        // borrow of other memory, so the two cannot overlap. No reference to the (possibly
        // uninitialised) destination is made.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(start), src.len()) }
    }

    /// Writes element `i`, which no other task writes.
    fn write(&self, i: usize, v: f32) {
        assert!(i < self.len);
        // SAFETY: in bounds (checked); each index is written by exactly one task.
        unsafe { *self.ptr.add(i) = v }
    }

    /// `len` elements from `start`, for a task that alone writes them.
    ///
    /// # Safety
    /// No other task may touch `start..start + len` while the slice lives.
    #[allow(clippy::mut_from_ref)]
    unsafe fn range(&self, start: usize, len: usize) -> &mut [f32] {
        assert!(start + len <= self.len);
        // SAFETY: in bounds (checked); exclusive by the caller's guarantee.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

/// An activation buffer of the CPU backend: floats and the name of what they hold.
pub struct CpuBuf {
    name: &'static str,
    data: Vec<f32>,
}

impl std::ops::Deref for CpuBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.data
    }
}
impl std::ops::DerefMut for CpuBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.data
    }
}

impl crate::backend::Extent for CpuBuf {
    fn extent(&self) -> (&str, usize) {
        (self.name, self.data.len())
    }
}

/// How matrix products are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    /// f32 arithmetic on dequantized weights (`smoe score`'s correctness path).
    Reference,
    /// int8 activations and SIMD dot products on a persistent thread pool (production).
    Fast,
}

/// The CPU backend.
pub struct CpuBackend {
    precision: Precision,
    kernels: &'static smoe_kernels::Kernels,
    pool: std::sync::Arc<pool::Pool>,
    /// Addresses of the dense matrices [`Backend::prepare_dense`] interleaved (a backend
    /// belongs to one model, and this is reset at each preparation).
    interleaved: std::sync::Mutex<std::collections::HashSet<usize>>,
}

impl CpuBackend {
    /// A backend computing at `precision` with one thread per physical core
    /// ([`default_threads`]).
    pub fn new(precision: Precision) -> CpuBackend {
        CpuBackend::with_threads(precision, default_threads())
    }

    /// A backend computing at `precision` with `threads` compute threads.
    pub fn with_threads(precision: Precision, threads: usize) -> CpuBackend {
        CpuBackend {
            precision,
            kernels: smoe_kernels::best(),
            pool: std::sync::Arc::new(pool::Pool::new(threads)),
            interleaved: Default::default(),
        }
    }

    fn product(&self, w: &QMatrix<'_>, x: &[f32], n: usize, out: &mut [f32]) {
        match self.precision {
            Precision::Reference => matmul::matmul_ref(w, x, n, out),
            Precision::Fast => fast::matmul(self.kernels, &self.pool, w, x, n, out),
        }
    }
}

/// A matrix held by the CPU backend: a window of the shared dense region.
pub struct CpuMatrix {
    region: Arc<Vec<u8>>,
    offset: usize,
    len: usize,
    format: Format,
    rows: usize,
    cols: usize,
    layout: smoe_quant::Layout,
}

impl CpuMatrix {
    fn view(&self) -> QMatrix<'_> {
        QMatrix {
            format: self.format,
            rows: self.rows,
            cols: self.cols,
            data: &self.region[self.offset..self.offset + self.len],
            layout: self.layout,
        }
    }
}

/// One layer's cache: keys `[pos, heads, k_dim]`, values `[pos, heads, v_dim]`, from position
/// `base` on (0 unless the layer's shape lets old rows go, see [`KvShape::keep`]).
struct KvLayer {
    shape: KvShape,
    k: KvRows,
    v: KvRows,
    base: usize,
}

impl KvLayer {
    /// The row of position `pos`, which must not have been dropped.
    fn row(&self, pos: usize) -> usize {
        assert!(pos >= self.base, "KV cache: position {pos} was dropped (rows held from {})", self.base);
        pos - self.base
    }
}

/// Rows a layer with [`KvShape::keep`] may hold beyond it before the oldest are dropped (each
/// drop moves the kept rows, so it is done this many rows at a time). Bases stay multiples of
/// it: attention reads aligned blocks of [`attention::POSITIONS_PER_BLOCK`] positions (the
/// same for prefill and decode), so a block is held whole or dropped whole.
pub(crate) const DROP_SLACK: usize = attention::POSITIONS_PER_BLOCK;

/// The KV cache of one sequence.
pub struct CpuKvCache {
    layers: Vec<KvLayer>,
}

/// Elements below which a row-wise op stays on the calling thread (a pool dispatch costs a few
/// microseconds; decode's ops on one token's rows are far smaller than this).
const PAR_ELEMENTS: usize = 1 << 16;

impl CpuBackend {
    /// Runs `f(r0, r1)` over row ranges covering `0..rows` (`width` elements a row): on the pool
    /// in as many pieces as it has threads when the op is large (prefill's activations, expert
    /// rows), else at once on this thread. For ops whose rows are independent, so that the
    /// result is the same either way.
    fn rows_in_parallel(&self, rows: usize, width: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        let threads = self.pool.threads();
        if rows * width < PAR_ELEMENTS || threads == 1 || rows < 2 {
            return f(0, rows);
        }
        let per = rows.div_ceil(threads);
        self.pool.run(rows.div_ceil(per), &|i| f(i * per, ((i + 1) * per).min(rows)));
    }

    /// Runs `f(t, segment)` for each of `n` rows' segments `x[t * stride + off..][..width]`,
    /// in parallel as [`rows_in_parallel`](Self::rows_in_parallel) decides when the segments
    /// cannot overlap (`width <= stride`): prefill's per-head norms and rotations over a chunk's
    /// projections had run on the caller while the other threads waited.
    fn each_segment(&self, x: &mut [f32], n: usize, stride: usize, off: usize, width: usize, f: &(dyn Fn(usize, &mut [f32]) + Sync)) {
        if width > stride {
            return (0..n).for_each(|t| f(t, &mut x[t * stride + off..][..width]));
        }
        let sink = DisjointOut::new(x);
        self.rows_in_parallel(n, width, &|t0, t1| {
            for t in t0..t1 {
                // SAFETY: segments of different rows are disjoint (width <= stride), and row t
                // belongs to the one task that holds t0..t1.
                f(t, unsafe { sink.range(t * stride + off, width) });
            }
        });
    }

    /// Rows `at..at + n` of `width` floats in `cache` become `row(0..n)`, and rows after them
    /// are dropped (as a `resize` and copies would leave it). A prefill chunk's rows are
    /// written on the pool: they are the cache's first touch of fresh pages, whose faults
    /// (about 0.6 ms a 256-token chunk and layer, on one Zen 4 core) then run in parallel too.
    fn store_rows<'a>(&self, cache: &mut KvRows, at: usize, n: usize, width: usize, row: &(dyn Fn(usize) -> &'a [f32] + Sync)) {
        let cache = match cache {
            KvRows::F32(v) => v,
            KvRows::F16(v) => {
                // Half floats are rounded as they go in (rows past `at + n` dropped, a gap
                // before `at` zeros, as below); a step's rows convert in no time next to the
                // products that made them.
                v.resize((at + n) * width, 0);
                for (t, dst) in v[at * width..].chunks_exact_mut(width.max(1)).enumerate() {
                    let src = row(t);
                    assert_eq!(src.len(), width, "kv_store: a row of {} values for {width}", src.len());
                    self.kernels.f32_to_f16(src, dst);
                }
                return;
            }
        };
        if cache.len() < at * width {
            cache.resize(at * width, 0.0);
        }
        cache.truncate(at * width);
        cache.reserve(n * width);
        let spare = &mut cache.spare_capacity_mut()[..n * width];
        let sink = DisjointOut::new_uninit(spare);
        self.rows_in_parallel(n, width, &|t0, t1| {
            for t in t0..t1 {
                let src = row(t);
                assert_eq!(src.len(), width, "kv_store: a row of {} values for {width}", src.len());
                // SAFETY: row t of the spare capacity belongs to the one task that holds t0..t1.
                unsafe { sink.write_from(t * width, src) };
            }
        });
        // SAFETY: every element of the `n * width` after `at * width` was written above (each
        // row by its task; a panicking task would have unwound out of `rows_in_parallel`).
        unsafe { cache.set_len((at + n) * width) };
    }

    /// `out[t, :] += Σ_s weights[t × k + s] · src[row(t × k + s), :]`, slots in order, tokens
    /// split over the pool when large: [`Backend::add_weighted_slots`] and
    /// [`Backend::add_weighted_rows`] with the same sums in the same order.
    #[allow(clippy::too_many_arguments)]
    fn mix_slots(
        &self,
        src: &[f32],
        dim: usize,
        n: usize,
        k: usize,
        weights: &[f32],
        row: &(dyn Fn(usize) -> usize + Sync),
        out: &mut CpuBuf,
    ) {
        check("add_weighted_slots", out, n, dim);
        let sink = DisjointOut::new(&mut out[..n * dim]);
        self.rows_in_parallel(n, k * dim, &|t0, t1| {
            for t in t0..t1 {
                // SAFETY: output row t is written by the one task that holds t0..t1.
                let o = unsafe { sink.range(t * dim, dim) };
                for s in 0..k {
                    let w = weights[t * k + s];
                    let r = row(t * k + s);
                    for (a, &b) in o.iter_mut().zip(&src[r * dim..(r + 1) * dim]) {
                        *a += w * b;
                    }
                }
            }
        });
    }
}

impl Backend for CpuBackend {
    type Buf = CpuBuf;
    type Matrix = CpuMatrix;
    type Vector = Vec<f32>;
    type KvCache = CpuKvCache;

    fn describe(&self) -> String {
        match self.precision {
            Precision::Reference => format!("cpu reference f32 ({} rayon threads)", rayon::current_num_threads()),
            Precision::Fast => format!("cpu {} int8 ({} threads)", self.kernels.isa, self.pool.threads()),
        }
    }

    fn attends_selected(&self) -> bool {
        true
    }

    fn attends_compressed(&self) -> bool {
        true
    }

    fn runs_linear_attention(&self) -> bool {
        true
    }

    fn interleaved_expert_formats(&self) -> Vec<Format> {
        let fast = self.precision == Precision::Fast;
        [Format::Q4_K, Format::Q8_0, Format::Q2_K, Format::Q3_K].into_iter().filter(|&f| fast && self.kernels.has_group8(f)).collect()
    }

    fn prepare_dense(&self, region: &mut [u8], products: &[(usize, Format, usize, usize)]) {
        let mut laid = self.interleaved.lock().unwrap_or_else(|e| e.into_inner());
        laid.clear();
        // `SMOE_INTERLEAVE_DENSE=off` keeps the file's row layout (to measure the difference).
        if std::env::var("SMOE_INTERLEAVE_DENSE").is_ok_and(|v| v == "off") {
            return;
        }
        let mut scratch = Vec::new();
        // Q8_0 only (dense Q4_K matrices are rare), where its group kernel exists.
        if self.precision != Precision::Fast || !self.kernels.has_group8(Format::Q8_0) {
            return;
        }
        for &(offset, format, rows, cols) in products {
            if format != Format::Q8_0 || !smoe_quant::interleave::supported(format, rows, cols) {
                continue;
            }
            let len = format.row_bytes(cols).expect("validated by the vault reader") * rows;
            smoe_quant::interleave::interleave_in_place(format, &mut region[offset..offset + len], rows, cols, &mut scratch);
            // Keyed by address: the region's heap buffer stays where it is when it is shared.
            laid.insert(region.as_ptr() as usize + offset);
        }
    }

    fn matrix(&self, region: &Arc<Vec<u8>>, offset: usize, format: Format, rows: usize, cols: usize) -> CpuMatrix {
        let len = format.row_bytes(cols).expect("validated by the vault reader") * rows;
        let interleaved = self.interleaved.lock().unwrap_or_else(|e| e.into_inner()).contains(&(region.as_ptr() as usize + offset));
        let layout = if interleaved { smoe_quant::Layout::Interleaved8 } else { smoe_quant::Layout::Rows };
        CpuMatrix { region: region.clone(), offset, len, format, rows, cols, layout }
    }
    fn vector(&self, v: &[f32]) -> Vec<f32> {
        v.to_vec()
    }
    fn buf(&self, name: &'static str, len: usize) -> CpuBuf {
        CpuBuf { name, data: vec![0.0; len] }
    }
    fn kv_cache(&self, layers: &[KvShape]) -> CpuKvCache {
        CpuKvCache {
            layers: layers.iter().map(|&shape| KvLayer { shape, k: KvRows::new(shape.f16), v: KvRows::new(shape.f16), base: 0 }).collect(),
        }
    }
    fn kv_f16(&self) -> bool {
        true
    }
    fn kv_f16_by_default(&self) -> bool {
        // The reference arithmetic is the path held to transformers: f32 unless asked.
        self.precision == Precision::Fast
    }
    fn kv_reserve(&self, cache: &mut CpuKvCache, positions: usize) {
        for l in &mut cache.layers {
            let positions = l.shape.keep.map_or(positions, |k| positions.min(k + DROP_SLACK));
            let kw = l.shape.heads * l.shape.k_dim;
            l.k.reserve_exact((positions * kw).saturating_sub(l.k.len()));
            if !l.shape.values_in_keys {
                let vw = l.shape.heads * l.shape.v_dim;
                l.v.reserve_exact((positions * vw).saturating_sub(l.v.len()));
            }
        }
    }
    fn kv_shrink(&self, cache: &mut CpuKvCache, positions: usize) {
        for l in &mut cache.layers {
            let at = positions.saturating_sub(l.base);
            l.k.truncate(at * l.shape.heads * l.shape.k_dim);
            l.v.truncate(at * l.shape.heads * l.shape.v_dim);
            l.k.shrink_to_fit();
            l.v.shrink_to_fit();
        }
    }
    fn kv_capacity(&self, cache: &CpuKvCache) -> usize {
        // A layer that drops old rows never runs out of room.
        cache
            .layers
            .iter()
            .filter(|l| l.shape.keep.is_none())
            .map(|l| l.k.capacity() / (l.shape.heads * l.shape.k_dim).max(1))
            .min()
            .unwrap_or(usize::MAX)
    }
    fn kv_bytes(&self, cache: &CpuKvCache) -> usize {
        cache.layers.iter().map(|l| l.k.bytes() + l.v.bytes()).sum()
    }

    fn upload(&self, dst: &mut CpuBuf, src: &[f32]) {
        check("upload", dst, 1, src.len());
        dst[..src.len()].copy_from_slice(src);
    }
    fn download(&self, src: &CpuBuf, offset: usize, dst: &mut [f32]) {
        check_rows("download", src, 0, 1, 0, offset, dst.len());
        dst.copy_from_slice(&src[offset..offset + dst.len()]);
    }

    fn embed(&self, table: &CpuMatrix, ids: &[u32], out: &mut CpuBuf) {
        let v = table.view();
        check("embed", out, ids.len(), v.cols);
        for (t, &id) in ids.iter().enumerate() {
            v.dequantize_row(id as usize, &mut out[t * v.cols..(t + 1) * v.cols]);
        }
    }
    #[track_caller]
    fn matmul(&self, w: &CpuMatrix, rows: Option<(usize, usize)>, x: &CpuBuf, n: usize, out: &mut CpuBuf) {
        let _site = pool::profile::site(std::panic::Location::caller());
        let v = w.view();
        let v = match rows {
            Some((r0, m)) => v.slice_rows(r0, m),
            None => v,
        };
        check("matmul input", x, n, v.cols);
        check("matmul", out, n, v.rows);
        self.product(&v, x, n, out);
    }
    #[track_caller]
    fn matmul_many(&self, jobs: &[MatJob<'_, CpuMatrix>], x: &CpuBuf, x_stride: usize, out: &mut CpuBuf, out_stride: usize) {
        let _site = pool::profile::site(std::panic::Location::caller());
        let views: Vec<(QMatrix<'_>, &MatJob<'_, CpuMatrix>)> = jobs
            .iter()
            .map(|j| {
                let v = match &j.w {
                    WeightRef::Resident(m, None) => m.view(),
                    WeightRef::Resident(m, Some((r0, n))) => m.view().slice_rows(*r0, *n),
                    // The slot handle matters to a backend mirroring experts; the CPU reads them in place.
                    WeightRef::Expert(q, _) => *q,
                    WeightRef::Kept { .. } => panic!("matmul_many: the CPU backend keeps no experts"),
                };
                check_rows("matmul_many input", x, j.x_row, j.n, x_stride, 0, v.cols);
                check_rows("matmul_many", out, j.out_row, j.n, out_stride, j.out_col, v.rows);
                (v, j)
            })
            .collect();
        match self.precision {
            Precision::Fast => fast::matmul_many(self.kernels, &self.pool, &views, x, x_stride, out, out_stride),
            Precision::Reference => {
                let mut xin = Vec::new();
                let mut tmp = Vec::new();
                for (w, j) in &views {
                    xin.clear();
                    for t in 0..j.n {
                        xin.extend_from_slice(&x[(j.x_row + t) * x_stride..][..w.cols]);
                    }
                    tmp.resize(j.n * w.rows, 0.0);
                    matmul::matmul_ref(w, &xin, j.n, &mut tmp);
                    for t in 0..j.n {
                        out[(j.out_row + t) * out_stride + j.out_col..][..w.rows].copy_from_slice(&tmp[t * w.rows..(t + 1) * w.rows]);
                    }
                }
            }
        }
    }
    fn matmul_t(&self, w: &CpuMatrix, r0: usize, m: usize, x: &CpuBuf, x_stride: usize, x_off: usize, n: usize, out: &mut CpuBuf) {
        let v = w.view().slice_rows(r0, m);
        check_rows("matmul_t input", x, 0, n, x_stride, x_off, m);
        check("matmul_t", out, n, v.cols);
        matmul::matmul_t_ref(&v, x, x_stride, x_off, n, out);
    }

    #[track_caller]
    fn rms_norm(&self, x: &CpuBuf, n: usize, dim: usize, w: &Vec<f32>, eps: f32, out: &mut CpuBuf) {
        let _site = pool::profile::site(std::panic::Location::caller());
        check("rms_norm input", x, n, dim);
        check("rms_norm", out, n, dim);
        let sink = DisjointOut::new(&mut out[..n * dim]);
        self.rows_in_parallel(n, dim, &|r0, r1| {
            for t in r0..r1 {
                let src = &x[t * dim..(t + 1) * dim];
                let scale = rms_scale(src, eps);
                // SAFETY: row t is written by the one task that holds r0..r1.
                let o = unsafe { sink.range(t * dim, dim) };
                for ((o, &v), &g) in o.iter_mut().zip(src).zip(w) {
                    *o = g * (v * scale);
                }
            }
        });
    }
    #[track_caller]
    fn rms_norm_strided(&self, x: &mut CpuBuf, n: usize, stride: usize, off: usize, dim: usize, w: &Vec<f32>, eps: f32) {
        let _site = pool::profile::site(std::panic::Location::caller());
        check_rows("rms_norm_strided", x, 0, n, stride, off, dim);
        self.each_segment(x, n, stride, off, dim, &|_, seg| rms_norm_in_place(seg, w, eps));
    }
    /// Every head of a row in one segment, so that a prefill chunk's q and k norms split over
    /// the pool by rows: per head, each was `n` segments of `dim`, too small to leave the
    /// caller (a 256-token chunk's 32 query heads ran serially, 0.6 ms a layer on one Zen 4
    /// core). Each head's values get the same operations as alone.
    #[track_caller]
    fn rms_norm_heads(&self, x: &mut CpuBuf, n: usize, stride: usize, off: usize, heads: usize, dim: usize, w: &Vec<f32>, eps: f32) {
        let _site = pool::profile::site(std::panic::Location::caller());
        if n == 1 {
            return self.rms_norm_strided(x, heads, dim, off, dim, w, eps);
        }
        check_rows("rms_norm_heads", x, 0, n, stride, off, heads * dim);
        self.each_segment(x, n, stride, off, heads * dim, &|_, row| {
            row.chunks_exact_mut(dim).for_each(|seg| rms_norm_in_place(seg, w, eps))
        });
    }
    fn layer_norm_strided(&self, x: &mut CpuBuf, n: usize, stride: usize, off: usize, dim: usize, w: &Vec<f32>, b: &Vec<f32>, eps: f32) {
        check_rows("layer_norm_strided", x, 0, n, stride, off, dim);
        assert!(w.len() == dim && b.len() == dim, "layer_norm_strided: {} weights and {} biases for {dim} values", w.len(), b.len());
        for t in 0..n {
            sparse::layer_norm(&mut x[t * stride + off..][..dim], w, b, eps);
        }
    }
    fn index_select(&self, cache: &CpuKvCache, layer: usize, q: &CpuBuf, weights: &CpuBuf, at: IndexQueries, out: &mut [u32]) {
        let l = &cache.layers[layer];
        let (d, end) = (l.shape.k_dim, at.seen(at.pos0 + at.n.max(1) - 1));
        at.check(q, weights, d, out);
        assert!(l.k.len() >= end * d, "index_select: layer {layer} holds {} positions, not {end}", l.k.len() / d.max(1));
        let kernels = (self.precision == Precision::Fast).then_some(self.kernels);
        sparse::index_select(l, q, weights, at, out, kernels);
    }
    #[track_caller]
    fn gated_delta_net(
        &self,
        p: DeltaNetParams<'_, Vec<f32>>,
        x: &CpuBuf,
        row0: usize,
        n: usize,
        state: &mut CpuBuf,
        fresh: bool,
        out: &mut CpuBuf,
    ) {
        let _site = pool::profile::site(std::panic::Location::caller());
        let p = p.with(&p.conv[..], &p.neg_a[..], &p.dt_bias[..], &p.norm[..]);
        let vw = p.value_heads * p.value_dim;
        let stride = p.stride();
        check_rows("gated_delta_net", x, row0, n, stride, 0, stride);
        check_rows("gated_delta_net output", out, row0, n, vw, 0, vw);
        check("gated_delta_net state", state, 1, p.state_floats());
        assert!(
            p.conv.len() == p.channels() * p.taps
                && p.neg_a.len() == p.value_heads
                && p.dt_bias.len() == p.value_heads
                && p.norm.len() == p.value_dim,
            "gated_delta_net: parameters of the wrong lengths"
        );
        let (x, vd, mat) = (&x[row0 * stride..(row0 + n) * stride], p.value_dim, p.key_dim * p.value_dim);
        let st = &mut state[..p.state_floats()];
        let y = crate::delta::prepare(&p, x, n, st, fresh);
        let mats = DisjointOut::new(&mut st[(p.taps - 1) * p.channels()..]);
        let outs = DisjointOut::new(&mut out[row0 * vw..(row0 + n) * vw]);
        // Value heads are independent: one task each.
        self.pool.run(p.value_heads, &|j| {
            let mut o = vec![0f32; n * vd];
            // SAFETY: head j alone touches its state matrix.
            crate::delta::run_head(&p, &y, x, n, j, unsafe { mats.range(j * mat, mat) }, fresh, &mut o);
            for (t, row) in o.chunks_exact(vd).enumerate() {
                // SAFETY: head j alone writes its value_dim columns of each output row.
                unsafe { outs.range(t * vw + j * vd, vd) }.copy_from_slice(row);
            }
        });
    }
    fn sigmoid_gate(&self, x: &mut CpuBuf, n: usize, width: usize, gate: &CpuBuf, gate_stride: usize, gate_off: usize) {
        check("sigmoid_gate", x, n, width);
        check_rows("sigmoid_gate gate", gate, 0, n, gate_stride, gate_off, width);
        for (t, row) in x[..n * width].chunks_exact_mut(width).enumerate() {
            let g = &gate[t * gate_stride + gate_off..][..width];
            row.iter_mut().zip(g).for_each(|(a, &b)| *a /= 1.0 + (-b).exp());
        }
    }
    fn compress_windows(&self, cache: &mut CpuKvCache, c: CompressWindows<'_, Vec<f32>>) {
        compressed::compress_windows(&mut cache.layers, c.with(&c.bias[..], &c.norm[..]));
    }
    #[track_caller]
    fn attention_compressed(
        &self,
        cache: &CpuKvCache,
        layer: usize,
        q: &CpuBuf,
        n: usize,
        pos0: usize,
        p: CompressedParams<'_>,
        out: &mut CpuBuf,
    ) {
        let _site = pool::profile::site(std::panic::Location::caller());
        let d = cache.layers[layer].shape.k_dim;
        check("attention_compressed queries", q, n, p.q_heads * d);
        check("attention_compressed", out, n, p.q_heads * d);
        let l = &cache.layers[layer];
        assert!(l.base + l.k.len() / d.max(1) >= pos0 + n, "attention_compressed: layer {layer} lacks positions up to {}", pos0 + n);
        let attend = |gl: &KvLayer, q: &[f32], p: AttnParams<'_>, o: &mut [f32]| {
            let last = gl.k.len() / d - 1;
            match self.precision {
                Precision::Reference => attention::attention_ref(gl, q, q.len(), 1, last, p, o),
                Precision::Fast => {
                    attention::attention_fast(gl, q, q.len(), 1, last, p, o, self.kernels, &self.pool, attention::POSITIONS_PER_BLOCK)
                }
            }
        };
        compressed::attention_compressed(&cache.layers, layer, q, n, pos0, p, out, &attend);
    }
    fn hc_collapse(&self, x: &CpuBuf, n: usize, mult: usize, dim: usize, pre: &[f32], out: &mut CpuBuf) {
        check("hc_collapse streams", x, n, mult * dim);
        check("hc_collapse", out, n, dim);
        crate::hyper::collapse(x, n, mult, dim, pre, out);
    }
    fn hc_expand(&self, x: &mut CpuBuf, y: &CpuBuf, n: usize, mult: usize, dim: usize, post: &[f32], comb: &[f32]) {
        check("hc_expand streams", x, n, mult * dim);
        check("hc_expand", y, n, dim);
        crate::hyper::expand(x, y, n, mult, dim, post, comb);
    }
    fn silu_mul_clamped(&self, g: &mut CpuBuf, u: &CpuBuf, len: usize, limit: f32) {
        for (a, &b) in g[..len].iter_mut().zip(&u[..len]) {
            *a = crate::hyper::clamped_silu(*a, b, limit);
        }
    }
    fn silu_clamped_halves(&self, x: &mut CpuBuf, row0: usize, n: usize, stride: usize, w: usize, limit: f32) {
        check_rows("silu_clamped_halves", x, row0, n, stride, 0, 2 * w);
        for row in x[row0 * stride..(row0 + n) * stride].chunks_exact_mut(stride) {
            let (g, u) = row.split_at_mut(w);
            for (a, &b) in g.iter_mut().zip(&u[..w]) {
                *a = crate::hyper::clamped_silu(*a, b, limit);
            }
        }
    }
    fn add_bias(&self, x: &mut CpuBuf, n: usize, stride: usize, off: usize, b: &Vec<f32>) {
        check_rows("add_bias", x, 0, n, stride, off, b.len());
        for t in 0..n {
            for (v, &bb) in x[t * stride + off..][..b.len()].iter_mut().zip(b) {
                *v += bb;
            }
        }
    }
    #[track_caller]
    fn add(&self, x: &mut CpuBuf, y: &CpuBuf, len: usize) {
        let _site = pool::profile::site(std::panic::Location::caller());
        check("add", x, 1, len);
        check("add input", y, 1, len);
        // A prefill chunk's residual add, in pieces on the pool (elementwise: the same sums).
        const PIECE: usize = 4096;
        let sink = DisjointOut::new(&mut x[..len]);
        self.rows_in_parallel(len.div_ceil(PIECE), PIECE, &|p0, p1| {
            let (a, b) = (p0 * PIECE, (p1 * PIECE).min(len));
            // SAFETY: elements a..b belong to the one task that holds pieces p0..p1.
            for (a, &b) in unsafe { sink.range(a, b - a) }.iter_mut().zip(&y[a..b]) {
                *a += b;
            }
        });
    }
    fn silu_mul(&self, g: &mut CpuBuf, u: &CpuBuf, len: usize) {
        check("silu_mul", g, 1, len);
        check("silu_mul input", u, 1, len);
        self.kernels.silu_mul(&mut g[..len], &u[..len]);
    }
    #[track_caller]
    fn silu_mul_halves(&self, x: &mut CpuBuf, row0: usize, n: usize, stride: usize, w: usize) {
        let _site = pool::profile::site(std::panic::Location::caller());
        check_rows("silu_mul_halves", x, row0, n, stride, 0, 2 * w);
        let sink = DisjointOut::new(&mut x[row0 * stride..(row0 + n) * stride]);
        self.rows_in_parallel(n, w, &|r0, r1| {
            for r in r0..r1 {
                // SAFETY: row r is touched by the one task that holds r0..r1.
                let (g, u) = unsafe { sink.range(r * stride, 2 * w) }.split_at_mut(w);
                self.kernels.silu_mul(g, u);
            }
        });
    }
    #[track_caller]
    fn swiglu_clamped_halves(&self, x: &mut CpuBuf, row0: usize, n: usize, stride: usize, w: usize, alpha: f32, limit: f32) {
        let _site = pool::profile::site(std::panic::Location::caller());
        check_rows("swiglu_clamped_halves", x, row0, n, stride, 0, 2 * w);
        let sink = DisjointOut::new(&mut x[row0 * stride..(row0 + n) * stride]);
        self.rows_in_parallel(n, w, &|r0, r1| {
            for r in r0..r1 {
                // SAFETY: row r is touched by the one task that holds r0..r1.
                let (g, u) = unsafe { sink.range(r * stride, 2 * w) }.split_at_mut(w);
                for (a, &b) in g.iter_mut().zip(u.iter()) {
                    let (gc, uc) = (a.min(limit), b.clamp(-limit, limit));
                    *a = gc / (1.0 + (-alpha * gc).exp()) * (uc + 1.0);
                }
            }
        });
    }
    #[track_caller]
    fn rope(
        &self,
        x: &mut CpuBuf,
        n: usize,
        stride: usize,
        off: usize,
        heads: usize,
        head_stride: usize,
        cos: &[f32],
        sin: &[f32],
        interleaved: bool,
    ) {
        let _site = pool::profile::site(std::panic::Location::caller());
        let half = cos.len() / n.max(1);
        if heads == 0 {
            return;
        }
        let width = (heads - 1) * head_stride + 2 * half;
        check_rows("rope", x, 0, n, stride, off, width);
        self.each_segment(x, n, stride, off, width, &|t, row| {
            let (c, s) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
            for h in 0..heads {
                let head = &mut row[h * head_stride..h * head_stride + 2 * half];
                if interleaved {
                    rotate_pairs(head, c, s);
                    continue;
                }
                let (lo, hi) = head.split_at_mut(half);
                for i in 0..half {
                    let (a, b) = (lo[i], hi[i]);
                    lo[i] = a * c[i] - b * s[i];
                    hi[i] = b * c[i] + a * s[i];
                }
            }
        });
    }
    fn copy_strided(
        &self,
        src: &CpuBuf,
        src_stride: usize,
        src_off: usize,
        dst: &mut CpuBuf,
        dst_stride: usize,
        dst_off: usize,
        width: usize,
        n: usize,
    ) {
        check_rows("copy_strided input", src, 0, n, src_stride, src_off, width);
        check_rows("copy_strided", dst, 0, n, dst_stride, dst_off, width);
        for t in 0..n {
            dst[t * dst_stride + dst_off..t * dst_stride + dst_off + width]
                .copy_from_slice(&src[t * src_stride + src_off..t * src_stride + src_off + width]);
        }
    }
    #[track_caller]
    fn gather_rows(&self, src: &CpuBuf, dim: usize, rows: &[usize], dst: &mut CpuBuf) {
        let _site = pool::profile::site(std::panic::Location::caller());
        check("gather_rows", dst, rows.len(), dim);
        if let Some(&last) = rows.iter().max() {
            check("gather_rows input", src, last + 1, dim);
        }
        let sink = DisjointOut::new(&mut dst[..rows.len() * dim]);
        self.rows_in_parallel(rows.len(), dim, &|i0, i1| {
            for (i, &r) in (i0..i1).zip(&rows[i0..i1]) {
                // SAFETY: destination row i is written by the one task that holds i0..i1.
                unsafe { sink.range(i * dim, dim) }.copy_from_slice(&src[r * dim..(r + 1) * dim]);
            }
        });
    }
    #[track_caller]
    fn scatter_rows(&self, src: &CpuBuf, dim: usize, rows: &[usize], dst: &mut CpuBuf) {
        let _site = pool::profile::site(std::panic::Location::caller());
        check("scatter_rows input", src, rows.len(), dim);
        let Some(&last) = rows.iter().max() else { return };
        check("scatter_rows", dst, last + 1, dim);
        // Prefill's expert rows back to slot order (a chunk's tokens × top-k rows) had been the
        // largest copy left on the caller alone. On the pool only when no row is written twice
        // (the engine's orders are permutations), so that which write lands is never a race.
        let mut seen = vec![false; if rows.len() * dim >= PAR_ELEMENTS { last + 1 } else { 0 }];
        if !seen.is_empty() && rows.iter().all(|&r| !std::mem::replace(&mut seen[r], true)) {
            let sink = DisjointOut::new(&mut dst[..(last + 1) * dim]);
            self.rows_in_parallel(rows.len(), dim, &|i0, i1| {
                for (i, &r) in (i0..i1).zip(&rows[i0..i1]) {
                    // SAFETY: rows are distinct (checked above), so destination row r is
                    // written by the one task that holds source row i.
                    unsafe { sink.range(r * dim, dim) }.copy_from_slice(&src[i * dim..(i + 1) * dim]);
                }
            });
            return;
        }
        for (i, &r) in rows.iter().enumerate() {
            dst[r * dim..(r + 1) * dim].copy_from_slice(&src[i * dim..(i + 1) * dim]);
        }
    }
    #[track_caller]
    fn add_weighted_slots(&self, src: &CpuBuf, dim: usize, n: usize, k: usize, weights: &[f32], out: &mut CpuBuf) {
        let _site = pool::profile::site(std::panic::Location::caller());
        check("add_weighted_slots input", src, n * k, dim);
        self.mix_slots(src, dim, n, k, weights, &|slot| slot, out);
    }
    /// The slots' rows read where the experts left them: the copy back to slot order was, per
    /// decode layer, 8 rows on the caller alone, and per prefill chunk a pool job of its own.
    #[track_caller]
    fn add_weighted_rows(
        &self,
        src: &CpuBuf,
        dim: usize,
        n: usize,
        k: usize,
        weights: &[f32],
        rows: (&[usize], &[usize]),
        _slots: &mut CpuBuf,
        out: &mut CpuBuf,
    ) {
        let _site = pool::profile::site(std::panic::Location::caller());
        let rows = rows.0;
        assert_eq!(rows.len(), n * k, "add_weighted_rows: {} row indices for {n} tokens of {k} slots", rows.len());
        if let Some(&last) = rows.iter().max() {
            check("add_weighted_rows input", src, last + 1, dim);
        }
        self.mix_slots(src, dim, n, k, weights, &|slot| rows[slot], out);
    }
    #[track_caller]
    fn host_ranges(&self, n: usize, cost: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        let _site = pool::profile::site(std::panic::Location::caller());
        if n > 0 {
            self.rows_in_parallel(n, cost, f);
        }
    }
    fn route(&self, rule: &RouterRule, logits: &CpuBuf, bias: Option<&Vec<f32>>, n: usize, routes: &mut CpuBuf, at: usize) {
        let (e, k) = (rule.num_experts(), rule.top_k());
        check("route input", logits, n, e);
        check_rows("route", routes, 0, 1, 0, at, n * 2 * k);
        rule.route_rows(&logits[..n * e], bias.map(|b| &b[..]), n, &mut routes[at..at + n * 2 * k], &mut RouteScratch::default());
    }
    fn scale_rows(&self, x: &mut CpuBuf, dim: usize, s: &[f32]) {
        check("scale_rows", x, s.len(), dim);
        for (row, &f) in x.chunks_exact_mut(dim).zip(s) {
            for v in row {
                *v *= f;
            }
        }
    }

    fn kv_copy(&self, src: &CpuKvCache, dst: &mut CpuKvCache, positions: usize) -> bool {
        for (d, s) in dst.layers.iter_mut().zip(&src.layers) {
            let (kw, vw) = (s.shape.heads * s.shape.k_dim, s.shape.heads * s.shape.v_dim);
            // A layer indexed by window (DeepSeek-V4's compressed entries) holds fewer rows than
            // positions; the entries past the prefix's closed windows are recomputed before use.
            // A layer that dropped old rows copies what it holds of the prefix.
            let rows = positions.saturating_sub(s.base).min(s.k.len() / kw.max(1));
            d.base = s.base.min(positions);
            d.k.copy_prefix(&s.k, rows * kw);
            d.v.clear();
            if !s.v.is_empty() {
                d.v.copy_prefix(&s.v, rows * vw);
            }
        }
        true
    }
    fn kv_store(
        &self,
        cache: &mut CpuKvCache,
        layer: usize,
        pos0: usize,
        n: usize,
        k: &CpuBuf,
        k_stride: usize,
        k_off: usize,
        v: Option<(&CpuBuf, usize, usize)>,
    ) {
        let l = &mut cache.layers[layer];
        let kw = l.shape.heads * l.shape.k_dim;
        let vw = l.shape.heads * l.shape.v_dim;
        check_rows("kv_store keys", k, 0, n, k_stride, k_off, kw);
        if pos0 < l.base {
            // Rows before `base` were dropped: the sequence starts over (the state only goes
            // back this far by going back to 0).
            l.k.clear();
            l.v.clear();
            l.base = pos0;
        }
        let at = pos0 - l.base;
        self.store_rows(&mut l.k, at, n, kw, &|t| &k[t * k_stride + k_off..][..kw]);
        if let Some((v, v_stride, v_off)) = v {
            check_rows("kv_store values", v, 0, n, v_stride, v_off, vw);
            self.store_rows(&mut l.v, at, n, vw, &|t| &v[t * v_stride + v_off..][..vw]);
        }
        if let Some(keep) = l.shape.keep {
            // Keep `keep` rows before this call's first position (its first query may read
            // that far back), from a block boundary, and every row it stored.
            let base = pos0.saturating_sub(keep) / DROP_SLACK * DROP_SLACK;
            if base >= l.base + DROP_SLACK {
                let drop = base - l.base;
                l.k.drop_front(drop * kw);
                if !l.v.is_empty() {
                    l.v.drop_front(drop * vw);
                }
                l.base = base;
            }
        }
    }
    #[track_caller]
    fn attention(
        &self,
        cache: &CpuKvCache,
        layer: usize,
        q: &CpuBuf,
        q_stride: usize,
        n: usize,
        pos0: usize,
        p: AttnParams<'_>,
        out: &mut CpuBuf,
    ) {
        let _site = pool::profile::site(std::panic::Location::caller());
        let l = &cache.layers[layer];
        check_rows("attention queries", q, 0, n, q_stride, 0, p.q_heads * l.shape.k_dim);
        check("attention", out, n, p.q_heads * l.shape.v_dim);
        match (self.precision, p.selected) {
            (Precision::Reference, Some(_)) => return attention::attention_ref(l, q, q_stride, n, pos0, p, out),
            (Precision::Fast, Some(_)) => {
                return sparse::attention_selected(l, q, q_stride, n, p, out, self.kernels, &self.pool, attention::POSITIONS_PER_BLOCK)
            }
            _ => {}
        }
        match self.precision {
            Precision::Reference => attention::attention_ref(l, q, q_stride, n, pos0, p, out),
            Precision::Fast => {
                attention::attention_fast(l, q, q_stride, n, pos0, p, out, self.kernels, &self.pool, attention::POSITIONS_PER_BLOCK)
            }
        }
    }
    /// The fast path's attention, dense (no selected positions).
    fn batches_attention(&self, p: &AttnParams<'_>) -> bool {
        self.precision == Precision::Fast && p.selected.is_none()
    }
    #[track_caller]
    fn attention_batch(
        &self,
        layer: usize,
        seqs: &[SeqQueries<'_, CpuKvCache>],
        q: &CpuBuf,
        q_stride: usize,
        p: AttnParams<'_>,
        out: &mut CpuBuf,
    ) {
        let _site = pool::profile::site(std::panic::Location::caller());
        assert!(self.batches_attention(&p), "attention_batch: the reference path, or selected positions");
        let rows: Vec<attention::SeqRows<'_>> = seqs
            .iter()
            .map(|s| {
                let l = &s.cache.layers[layer];
                check_rows("attention queries", q, s.row, s.n, q_stride, 0, p.q_heads * l.shape.k_dim);
                check_rows("attention", out, s.row, s.n, p.q_heads * l.shape.v_dim, 0, p.q_heads * l.shape.v_dim);
                attention::SeqRows { l, row: s.row, n: s.n, pos0: s.pos0 }
            })
            .collect();
        if let Some(s) = rows.iter().find(|s| s.l.shape != rows[0].l.shape || s.n == 0) {
            panic!("attention_batch: sequences of one layer with one shape and some queries each (row {}: {} queries)", s.row, s.n);
        }
        attention::attention_fast_batch(&rows, q, q_stride, p, out, self.kernels, &self.pool, attention::POSITIONS_PER_BLOCK);
    }
}

/// RoPE on adjacent pairs: `(x[2i], x[2i + 1])` rotated by the angle whose cosine and sine are
/// `cos[i]`, `sin[i]` (DeepSeek's interleaved layout; also the compressed entries').
fn rotate_pairs(x: &mut [f32], cos: &[f32], sin: &[f32]) {
    for (p, (&c, &s)) in x.chunks_exact_mut(2).zip(cos.iter().zip(sin)) {
        let (a, b) = (p[0], p[1]);
        p[0] = a * c - b * s;
        p[1] = b * c + a * s;
    }
}

/// `1 / sqrt(mean(x²) + eps)`, accumulated in f64.
/// `seg = w · seg · rms_scale(seg)`: one row (or head) normed where it lies.
fn rms_norm_in_place(seg: &mut [f32], w: &[f32], eps: f32) {
    let scale = rms_scale(seg, eps);
    for (v, &g) in seg.iter_mut().zip(w) {
        *v = g * (*v * scale);
    }
}

fn rms_scale(x: &[f32], eps: f32) -> f32 {
    // Eight running f64 sums, so that the adds vectorise (one chain of f64 adds per value was
    // a visible share of decode's serial time); f64 keeps the order's effect far below f32's.
    let mut acc = [0f64; 8];
    let chunks = x.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&v| (v as f64) * (v as f64)).sum();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += (v as f64) * (v as f64);
        }
    }
    let ss = acc.iter().sum::<f64>() + tail;
    1.0 / ((ss / x.len() as f64) as f32 + eps).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An op that would write past a buffer stops with the op, the buffer's name and the
    /// extents, not a bare slice-index panic.
    #[test]
    fn writes_past_a_buffer_name_the_op_and_the_buffer() {
        let be = CpuBackend::with_threads(Precision::Reference, 1);
        let src = be.buf("src", 4 * 16);
        let mut dst = be.buf("k", 4 * 12);
        let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| be.copy_strided(&src, 16, 0, &mut dst, 16, 0, 16, 4)))
            .expect_err("the write does not fit");
        let msg = err.downcast_ref::<String>().unwrap();
        assert!(msg.starts_with("copy_strided: buffer `k` holds 48 floats"), "{msg}");
        assert!(msg.contains("rows 0..4 of 16 floats (stride 16, offset 0) reach 64"), "{msg}");
        let mut out = be.buf("att", 10);
        let w = be.vector(&[1.0; 8]);
        let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| be.rms_norm(&src, 2, 8, &w, 1e-6, &mut out)))
            .expect_err("the write does not fit");
        assert!(err.downcast_ref::<String>().unwrap().starts_with("rms_norm: buffer `att` holds 10 floats"));
    }

    /// A reserved cache fills without moving, and a shrunk one keeps what it holds.
    #[test]
    fn f16_kv_rows_store_what_f32_rows_hold_rounded() {
        // A chunk, a chunk that rewrites its last rows, then one past a gap: an f16 layer holds
        // the f32 layer's values rounded to nearest even, zeros in the gap, in half the bytes.
        let be = CpuBackend::with_threads(Precision::Fast, 2);
        let shape = KvShape { heads: 2, k_dim: 8, v_dim: 8, values_in_keys: false, keep: None, f16: false };
        let (mut full, mut half) = (be.kv_cache(&[shape]), be.kv_cache(&[KvShape { f16: true, ..shape }]));
        let mut src = be.buf("src", 40 * 32);
        be.upload(&mut src, &(0..40 * 32).map(|i| (i as f32 * 0.173).sin() * 5.0).collect::<Vec<_>>());
        for cache in [&mut full, &mut half] {
            be.kv_store(cache, 0, 0, 30, &src, 32, 0, Some((&src, 32, 16)));
            be.kv_store(cache, 0, 25, 10, &src, 32, 8, Some((&src, 32, 24)));
            be.kv_store(cache, 0, 38, 2, &src, 32, 0, Some((&src, 32, 16)));
        }
        assert_eq!(be.kv_bytes(&half) * 2, be.kv_bytes(&full));
        let round = |x: f32| smoe_quant::half::f16_bits_to_f32(smoe_quant::half::f32_to_f16_bits(x));
        for (f, h) in [(&full.layers[0].k, &half.layers[0].k), (&full.layers[0].v, &half.layers[0].v)] {
            let mut buf = Vec::new();
            let (got, _) = h.rows(0, 1, h.len(), h.len(), &mut buf, be.kernels);
            let want: Vec<f32> = f.f32s().iter().map(|&x| round(x)).collect();
            assert_eq!(want.len(), 40 * 16);
            assert!(want[35 * 16..38 * 16].iter().all(|&x| x == 0.0), "the gap holds zeros");
            assert!(got.iter().zip(&want).all(|(g, w)| g.to_bits() == w.to_bits()));
        }
    }

    #[test]
    fn a_reserved_kv_cache_never_moves() {
        let be = CpuBackend::with_threads(Precision::Reference, 1);
        let shapes = [
            KvShape { heads: 2, k_dim: 8, v_dim: 8, values_in_keys: false, keep: None, f16: false },
            KvShape { heads: 1, k_dim: 12, v_dim: 8, values_in_keys: true, keep: None, f16: false },
        ];
        let mut cache = be.kv_cache(&shapes);
        be.kv_reserve(&mut cache, 1000);
        assert!(be.kv_capacity(&cache) >= 1000);
        let start: Vec<_> = cache.layers.iter().map(|l| (l.k.f32s().as_ptr(), l.v.f32s().as_ptr())).collect();
        let rows = be.buf("rows", 3 * 16);
        for pos in (0..999).step_by(3) {
            for layer in 0..2 {
                let v = (!shapes[layer].values_in_keys).then_some((&rows, 16, 0));
                be.kv_store(&mut cache, layer, pos, 3, &rows, 16, 0, v);
            }
        }
        let end: Vec<_> = cache.layers.iter().map(|l| (l.k.f32s().as_ptr(), l.v.f32s().as_ptr())).collect();
        assert_eq!(start, end);
        assert_eq!(be.kv_bytes(&cache), 999 * (2 * 8 * 2 + 12) * 4);
        // Shrunk to 500 positions (a parked session): the first 500 rows unchanged, the rest and
        // the reserved room given back.
        let first: Vec<Vec<f32>> = cache.layers.iter().map(|l| l.k.f32s()[..500 * l.shape.heads * l.shape.k_dim].to_vec()).collect();
        be.kv_shrink(&mut cache, 500);
        assert_eq!(be.kv_bytes(&cache), 500 * (2 * 8 * 2 + 12) * 4);
        assert!(be.kv_capacity(&cache) < 1000);
        for (l, f) in cache.layers.iter().zip(&first) {
            assert_eq!(l.k.f32s(), f);
        }
    }

    /// Row-wise ops large enough to go to the pool (prefill's expert rows) give what one
    /// thread gives, bit for bit.
    #[test]
    fn row_ops_on_the_pool_equal_one_thread() {
        let (one, four) = (CpuBackend::with_threads(Precision::Fast, 1), CpuBackend::with_threads(Precision::Fast, 4));
        let (rows, w, dim, k) = (300, 384, 256, 8);
        let v = |n: usize, seed: usize| (0..n).map(|i| (((i * 7919 + seed) % 2003) as f32 / 1001.0 - 1.0) * 3.0).collect::<Vec<f32>>();
        let run = |be: &CpuBackend| {
            let mut gu = be.buf("gu", rows * 2 * w);
            be.upload(&mut gu, &v(rows * 2 * w, 1));
            be.silu_mul_halves(&mut gu, 7, rows - 7, 2 * w, w);
            let mut sw = be.buf("sw", rows * 2 * w);
            be.upload(&mut sw, &v(rows * 2 * w, 2));
            be.swiglu_clamped_halves(&mut sw, 0, rows, 2 * w, w, 1.702, 7.0);
            let x = {
                let mut b = be.buf("x", rows * dim);
                be.upload(&mut b, &v(rows * dim, 3));
                b
            };
            let mut normed = be.buf("normed", rows * dim);
            be.rms_norm(&x, rows, dim, &v(dim, 4), 1e-6, &mut normed);
            let picks: Vec<usize> = (0..rows * k).map(|i| i * 37 % rows).collect();
            let mut gathered = be.buf("gathered", rows * k * dim);
            be.gather_rows(&x, dim, &picks, &mut gathered);
            let mut summed = be.buf("summed", rows * dim);
            be.upload(&mut summed, &v(rows * dim, 5));
            be.add_weighted_slots(&gathered, dim, rows, k, &v(rows * k, 6), &mut summed);
            // A permutation (the parallel path) and an order that writes rows twice (the last
            // write wins, as on one thread).
            let order: Vec<usize> = (0..rows * k).map(|i| i * 7 % (rows * k)).collect();
            let mut scattered = be.buf("scattered", rows * k * dim);
            be.scatter_rows(&gathered, dim, &order, &mut scattered);
            let twice: Vec<usize> = (0..rows * k).map(|i| i % 100).collect();
            let mut overwritten = be.buf("overwritten", 100 * dim);
            be.scatter_rows(&gathered, dim, &twice, &mut overwritten);
            assert_eq!(overwritten.data[..dim], gathered.data[(rows * k - 100) * dim..][..dim], "the last write of row 0 wins");
            // Per-head norms and rotations of a chunk's projections: rows of three heads' room.
            let mut qk = be.buf("qk", rows * 3 * dim);
            be.upload(&mut qk, &v(rows * 3 * dim, 7));
            be.rms_norm_strided(&mut qk, rows, 3 * dim, dim / 2, dim, &v(dim, 8), 1e-6);
            let (cos, sin) = (v(rows * 32, 9), v(rows * 32, 10));
            be.rope(&mut qk, rows, 3 * dim, 0, 4, 64, &cos, &sin, false);
            be.rope(&mut qk, rows, 3 * dim, dim, 2, 192, &cos, &sin, true);
            // The slots mixed where they lie, against moving them to slot order first.
            let inverse = {
                let mut r = vec![0; order.len()];
                for (i, &slot) in order.iter().enumerate() {
                    r[slot] = i;
                }
                r
            };
            let (mut in_place, mut moved, mut room) =
                (be.buf("in_place", rows * dim), be.buf("moved", rows * dim), be.buf("room", rows * k * dim));
            be.upload(&mut in_place, &v(rows * dim, 15));
            be.upload(&mut moved, &v(rows * dim, 15));
            be.add_weighted_rows(&gathered, dim, rows, k, &v(rows * k, 6), (&inverse, &order), &mut room, &mut in_place);
            be.scatter_rows(&gathered, dim, &order, &mut room);
            be.add_weighted_slots(&room, dim, rows, k, &v(rows * k, 6), &mut moved);
            assert_eq!(in_place.data, moved.data, "mixed in place = moved, then mixed");
            // Every head of a row normed at once, against each head alone.
            let mut heads = be.buf("heads", rows * 3 * dim);
            be.upload(&mut heads, &v(rows * 3 * dim, 11));
            let mut alone = be.buf("alone", rows * 3 * dim);
            be.upload(&mut alone, &heads.data);
            be.rms_norm_heads(&mut heads, rows, 3 * dim, 32, 4, 64, &v(64, 12), 1e-6);
            for h in 0..4 {
                be.rms_norm_strided(&mut alone, rows, 3 * dim, 32 + h * 64, 64, &v(64, 12), 1e-6);
            }
            assert_eq!(heads.data, alone.data, "all heads at once = each head alone");
            // The residual add, in pieces.
            let mut added = be.buf("added", rows * dim);
            be.upload(&mut added, &v(rows * dim, 13));
            be.add(&mut added, &x, rows * dim);
            let want: Vec<f32> = v(rows * dim, 13).iter().zip(&x.data).map(|(a, b)| a + b).collect();
            assert_eq!(added.data, want);
            // KV rows: a chunk, then a chunk that rewrites the last 50 rows and adds more.
            let mut kv = be.kv_cache(&[KvShape { heads: 2, k_dim: 128, v_dim: 128, values_in_keys: false, keep: None, f16: false }]);
            be.kv_reserve(&mut kv, 2 * rows);
            let mut src = be.buf("src", rows * 3 * dim);
            be.upload(&mut src, &v(rows * 3 * dim, 14));
            be.kv_store(&mut kv, 0, 0, rows, &src, 3 * dim, 0, Some((&src, 3 * dim, dim)));
            be.kv_store(&mut kv, 0, rows - 50, rows, &src, 3 * dim, dim, Some((&src, 3 * dim, 2 * dim)));
            let l = &kv.layers[0];
            assert_eq!(l.k.len(), (2 * rows - 50) * dim);
            for (pos, t, off) in [(0, 0, 0), (rows - 51, rows - 51, 0), (rows - 50, 0, dim), (2 * rows - 51, rows - 1, dim)] {
                assert_eq!(l.k.f32s()[pos * dim..][..dim], src.data[t * 3 * dim + off..][..dim], "key row {pos}");
                assert_eq!(l.v.f32s()[pos * dim..][..dim], src.data[t * 3 * dim + off + dim..][..dim], "value row {pos}");
            }
            let (keys, values) = (l.k.f32s().clone(), l.v.f32s().clone());
            let mut all: Vec<Vec<f32>> =
                [gu, sw, normed, gathered, summed, scattered, overwritten, qk, heads, added, in_place].map(|b| b.data).into();
            all.extend([keys, values]);
            all
        };
        assert!(rows * w >= PAR_ELEMENTS, "the test must reach the parallel path");
        assert!(rows * (192 + 64) >= PAR_ELEMENTS, "the interleaved rotation too");
        assert_eq!(run(&one), run(&four));
    }
}
