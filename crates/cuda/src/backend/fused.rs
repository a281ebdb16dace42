//! The fused ops of the decode path (kernels in fused.cu): the residual add with the next norm,
//! the attention inputs (per-head norms, RoPE, the KV store) in one launch, int8 copies left by
//! the ops that write a product's input, and the rotary tables kept on the device.

use super::{
    cfg_elems, mvq_block_rows, norm_threads, CudaBackend, CudaBuf, CudaKvCache, CudaMatrix, CudaVector, Job, Jobs, KvShape, MAX_JOBS,
    MV_TOKENS,
};
use crate::buf::{dptr, QuantRows};
use crate::launch::Launch;
use cudarc::driver::LaunchConfig;
use smoe_engine::backend::{check, check_rows, qk_rope_store_composed, QkvRows, RopeTables};
use std::sync::atomic::Ordering;

/// The rotary tables of the token being decoded, on the device: every layer rotates with the
/// same ones, so they are copied up once per chunk, not once per layer.
#[derive(Default)]
pub(super) struct RopeOnDevice {
    /// What was staged: cosines, then sines.
    host: Vec<f32>,
    /// Their staged copy's device address, and the staging epoch it lasts.
    at: Option<(u64, u64)>,
}

impl CudaBackend {
    /// Room for the int8 copy that an op writing rows `0..rows` of `cols` into `out` leaves
    /// beside them, when products will read those rows on int8 activations (whole groups of
    /// 32; a few rows for the one-token mat-vec, many for the int8 tiles): its address and row
    /// stride, or `(0, 0)`: none.
    pub(super) fn quant_out(&self, out: &mut CudaBuf, rows: usize, cols: usize) -> (u64, i32) {
        let read_as_int8 = if rows > MV_TOKENS { self.int8_tiles } else { self.int8 };
        if !read_as_int8 || !cols.is_multiple_of(32) || self.faulted() {
            return (0, 0);
        }
        self.int8_copy(out, rows, cols, cols).map_or((0, 0), |q| (q.ptr, q.stride as i32))
    }

    /// Room in `buf` for the int8 copy of its rows `0..rows` (the first `cols` floats of rows
    /// `src_stride` apart), which the op about to be queued writes (call it after `at_mut`).
    pub(super) fn int8_copy(&self, buf: &mut CudaBuf, rows: usize, cols: usize, src_stride: usize) -> Option<QuantRows> {
        if !buf.quant_fits(rows, cols) {
            self.settle(); // an allocation: not in a step's graph
        }
        self.ok("quantizing outputs", buf.quantize_into(&self.stream, rows, cols, src_stride))
    }

    /// `cos` then `sin` on the device, staged (page-locked, so that a step's graph records the
    /// copy; see [`crate::graph`]) when they changed: every layer of a chunk rotates with the
    /// same tables. A staged copy lasts while the staging ring is not reused (its epoch).
    pub(super) fn rope_tables(&self, cos: &[f32], sin: &[f32]) -> Option<u64> {
        let mut r = self.rope.lock().expect("rope tables lock");
        let epoch = self.staging.lock().expect("staging lock").epoch();
        let same = r.host.len() == cos.len() + sin.len() && r.host[..cos.len()] == *cos && r.host[cos.len()..] == *sin;
        if let (true, Some((at, e))) = (same, r.at) {
            if e == epoch {
                return Some(at);
            }
        }
        r.host.clear();
        r.host.extend_from_slice(cos);
        r.host.extend_from_slice(sin);
        let at = self.stage_f32("rope tables", &[cos, sin])?;
        // Staging may have started a new epoch to make room: the copy belongs to that one.
        let epoch = self.staging.lock().expect("staging lock").epoch();
        r.at = Some((at, epoch));
        Some(at)
    }

    pub(super) fn fused_add_rms_norm(
        &self,
        x: &mut CudaBuf,
        y: &CudaBuf,
        n: usize,
        dim: usize,
        w: &CudaVector,
        eps: f32,
        out: &mut CudaBuf,
    ) {
        if self.faulted() || n == 0 {
            return;
        }
        check("add_rms_norm", x, n, dim);
        check("add_rms_norm input", y, n, dim);
        check("add_rms_norm output", out, n, dim);
        assert!(w.len >= dim, "add_rms_norm: {} weights for rows of {dim}", w.len);
        let (xp, yp, wp) = (x.at_mut(&self.stream), y.at(&self.stream), super::dptr(&w.data, &self.stream));
        let op = out.at_mut(&self.stream);
        let (qx, qs) = self.quant_out(out, n, dim);
        let d = dim as i32;
        let mut a = Launch::new(&self.k.add_rms_norm);
        a.arg(&xp).arg(&yp).arg(&wp).arg(&op).arg(&d).arg(&eps).arg(&qx).arg(&qs);
        self.launch(
            a,
            LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (norm_threads(dim), 1, 1), shared_mem_bytes: 0 },
            "add_rms_norm",
        );
    }

    /// [`smoe_engine::Backend::matmul_add_rms_norm`] in one launch (`mvq_add_norm` in fused.cu)
    /// where it can: one token, a projection in a format with int8 mat-vecs onto `dim` rows, the
    /// option on ([`super::CudaOptions::fused_norm`]). False: nothing queued, the caller runs
    /// the two ops.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn product_add_norm(
        &self,
        proj: &CudaMatrix,
        input: &CudaBuf,
        n: usize,
        dim: usize,
        y: &mut CudaBuf,
        x: &mut CudaBuf,
        w: &CudaVector,
        eps: f32,
        out: &mut CudaBuf,
    ) -> bool {
        let Some(k) = self.k.format(proj.format).mvq.as_ref() else { return false };
        if !self.fused_norm || !self.int8 || n != 1 || proj.rows != dim || !proj.cols.is_multiple_of(32) || self.faulted() {
            return false;
        }
        check("matmul input", input, 1, proj.cols);
        check("matmul", y, 1, dim);
        check("add_rms_norm", x, 1, dim);
        check("add_rms_norm output", out, 1, dim);
        assert!(w.len >= dim, "add_rms_norm: {} weights for rows of {dim}", w.len);
        // The input's int8 copy where the op before left one (attention does), as `products`
        // takes it; else quantized here.
        let xp = input.at(&self.stream);
        let left = input.quantized().filter(|q| q.cols == proj.cols && q.src_stride == proj.cols && q.rows >= 1);
        let Some((qx, qstride)) = left.map(|q| (q.ptr, q.stride)).or_else(|| self.quantize(xp, proj.cols, 0, 1, proj.cols)) else {
            return true; // a fault, recorded: the two ops would queue nothing either
        };
        let Some(ticket) = self.float_scratch(&self.ticket, 1, "last-block ticket") else { return true };
        let mut table = Jobs { count: 1, prefetch: self.prefetch as i32, job: [Job::default(); MAX_JOBS] };
        table.job[0] = Self::job(dptr(&proj.data, &self.stream), proj.row_bytes, dim, proj.cols, 0, 1, 0, 0);
        let (yp, xr, wp) = (y.at_mut(&self.stream), x.at_mut(&self.stream), dptr(&w.data, &self.stream));
        let op = out.at_mut(&self.stream);
        let (oq, _) = self.quant_out(out, 1, dim);
        // The norm's own launch's threads: the last block sums as that many would.
        let (qs, threads) = (qstride as i32, norm_threads(dim) as i32);
        let mut a = Launch::new(&k.add_norm);
        a.arg(&table).arg(&qx).arg(&qs).arg(&yp).arg(&xr).arg(&wp).arg(&op).arg(&eps).arg(&oq).arg(&threads).arg(&ticket);
        // The blocks of `products`' one-token int8 mat-vec.
        let grid = dim.div_ceil(mvq_block_rows(proj.format, proj.cols)) as u32;
        self.launch(
            a,
            LaunchConfig { grid_dim: (grid, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 },
            "output product, add and norm",
        );
        self.fused_norm_steps.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// [`Backend::qk_rope_store`] in one launch where [`fuses`] says so; else the three ops.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fused_qk_rope_store(
        &self,
        qkv: &mut CudaBuf,
        n: usize,
        rows: QkvRows,
        norm: Option<(&CudaVector, &CudaVector, f32)>,
        rope: RopeTables<'_>,
        cache: &mut CudaKvCache,
        layer: usize,
        pos0: usize,
    ) {
        if self.faulted() || n == 0 {
            return;
        }
        if !fuses(cache.layers[layer].shape, rows, rope.cos.len() / n) {
            return qk_rope_store_composed(self, qkv, n, rows, norm, rope, cache, layer, pos0);
        }
        check_qkv(qkv, n, rows, norm);
        let Some((kp, vp)) = self.kv_room(cache, layer, pos0, n) else { return };
        let Some(args) = self.qkv_args(qkv, n, rows, norm, rope) else { return };
        let p0 = pos0 as i32;
        let mut a = Launch::new(&self.k.qk_rope_store);
        args.push(&mut a);
        a.arg(&kp).arg(&vp).arg(&p0);
        self.launch_qkv(a, n, &args);
    }

    /// The arguments both fused `qk_rope_store` kernels begin with: the rows, the norms and the
    /// rotary tables (staged), or None where staging failed (the fault is kept).
    pub(super) fn qkv_args(
        &self,
        qkv: &mut CudaBuf,
        n: usize,
        rows: QkvRows,
        norm: Option<(&CudaVector, &CudaVector, f32)>,
        rope: RopeTables<'_>,
    ) -> Option<QkvArgs> {
        let half = rope.cos.len() / n;
        let tables = self.rope_tables(&rope.cos[..n * half], &rope.sin[..n * half])?;
        let x = qkv.at_mut(&self.stream);
        let (q_norm, k_norm, eps) = match norm {
            Some((qn, kn, eps)) => (super::dptr(&qn.data, &self.stream), super::dptr(&kn.data, &self.stream), eps),
            None => (0, 0, 0.0),
        };
        let QkvRows { stride, q_heads, kv_heads, head_dim } = rows;
        Some(QkvArgs {
            x,
            stride: stride as i32,
            q_heads: q_heads as i32,
            kv_heads: kv_heads as i32,
            head_dim: head_dim as i32,
            q_norm,
            k_norm,
            eps,
            tables,
            n: n as i32,
            half: half as i32,
            interleaved: rope.interleaved as i32,
        })
    }

    /// Queues a fused `qk_rope_store` kernel over `rows` rows: a warp per (token, head), four a
    /// block.
    pub(super) fn launch_qkv(&self, a: Launch<'_>, rows: usize, args: &QkvArgs) {
        let blocks = rows * (args.q_heads + 2 * args.kv_heads) as usize;
        let cfg = LaunchConfig { grid_dim: (blocks.div_ceil(4) as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        self.launch(a, cfg, "qk_rope_store");
    }

    /// SiLU(gate) · up over rows `0..rows` of `gu` (`[gate | up]`, `width` each), quantized for
    /// the down products into the scratch: its address and row stride.
    pub(super) fn silu_quantize(&self, gu: &mut CudaBuf, rows: usize, width: usize) -> Option<(u64, usize)> {
        let stride = crate::buf::quant_stride(width);
        let qx = self.scratch(rows * stride)?;
        let gp = gu.at_mut(&self.stream);
        let (s, r, w, qs) = ((2 * width) as i32, rows as i32, width as i32, stride as i32);
        let mut a = Launch::new(&self.k.silu_quantize);
        a.arg(&gp).arg(&s).arg(&r).arg(&w).arg(&qx).arg(&qs);
        // A warp per group of 32.
        self.launch(a, cfg_elems(rows * width), "silu_quantize");
        Some((qx, stride))
    }
}

/// Whether the fused `qk_rope_store` kernels take a layer of `shape` for rows of `rows`
/// rotating `half` pairs a head: plain GQA (keys and values of `head_dim` per head, the
/// layer's heads those of the rows, none kept inside the keys), heads of at most 512 (a warp
/// holds one in registers) and the rotated part within the head.
pub(super) fn fuses(shape: KvShape, rows: QkvRows, half: usize) -> bool {
    let plain = shape.heads == rows.kv_heads && shape.k_dim == rows.head_dim && shape.v_dim == rows.head_dim && !shape.values_in_keys;
    plain && rows.head_dim <= 512 && 2 * half <= rows.head_dim
}

/// Panics, as [`check_rows`] does, unless `qkv` holds `n` rows of `rows` and the norms cover a head.
pub(super) fn check_qkv(qkv: &CudaBuf, n: usize, rows: QkvRows, norm: Option<(&CudaVector, &CudaVector, f32)>) {
    let QkvRows { stride, q_heads, kv_heads, head_dim } = rows;
    check_rows("qk_rope_store", qkv, 0, n, stride, 0, (q_heads + 2 * kv_heads) * head_dim);
    if let Some((qn, kn, _)) = norm {
        assert!(qn.len >= head_dim && kn.len >= head_dim, "qk_rope_store: norms of {} and {} for heads of {head_dim}", qn.len, kn.len);
    }
}

/// The parameters both fused `qk_rope_store` kernels begin with, in their order (fused.cu,
/// kernels.cu): the rows of `[q | k | v]` and their layout, the per-head norms (0: none), the
/// staged rotary tables, the tokens, the rotated pairs a head and whether they interleave.
pub(super) struct QkvArgs {
    x: u64,
    stride: i32,
    q_heads: i32,
    kv_heads: i32,
    head_dim: i32,
    q_norm: u64,
    k_norm: u64,
    eps: f32,
    tables: u64,
    n: i32,
    half: i32,
    interleaved: i32,
}

impl QkvArgs {
    /// Adds them to a launch, first; the kernel's own parameters follow.
    pub(super) fn push<'a>(&'a self, a: &mut Launch<'a>) {
        a.arg(&self.x).arg(&self.stride).arg(&self.q_heads).arg(&self.kv_heads).arg(&self.head_dim);
        a.arg(&self.q_norm).arg(&self.k_norm).arg(&self.eps).arg(&self.tables).arg(&self.n).arg(&self.half).arg(&self.interleaved);
    }
}
