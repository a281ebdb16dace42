//! Small ops done by the last block of the launch before them (`last_to_arrive` in fused.cu),
//! for a decoded token: each one a wait for a launch less in every layer. Nsight Compute put a
//! decoded token's six small kernels at 40 µs a layer against 38 µs for its four products,
//! each waiting for the one before to finish and its ramp to start. The ops keep their bits:
//! the routing runs `route_token` as the `route` kernel does, the norms reduce as the norm
//! kernels' threads would (`rms_norm_row_as`).

use super::fused::{check_qkv, fuses};
use super::{check, dptr, mvq_block_rows, norm_threads, AddNorm, CudaBackend, CudaBuf, CudaKvCache, CudaMatrix, CudaVector, Job, Jobs};
use super::{RopeStore, MAX_JOBS};
use crate::launch::Launch;
use cudarc::driver::LaunchConfig;
use smoe_engine::backend::{MatJob, QkvRows, RopeTables, WeightRef};
use smoe_engine::routing::RouterRule;
use smoe_quant::Format;
use std::sync::atomic::Ordering;

impl CudaBackend {
    /// [`smoe_engine::Backend::router_route`] of one token through an f32 router in one launch
    /// (`mvs_f32_route`: `mvs_f32`'s blocks, the last routing); false: not this case, nothing
    /// launched.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn router_and_route(
        &self,
        rule: &RouterRule,
        router: &CudaMatrix,
        input: &CudaBuf,
        n: usize,
        logits: &mut CudaBuf,
        bias: Option<&CudaVector>,
        routes: &mut CudaBuf,
        at: usize,
    ) -> bool {
        // One token through an f32 router is `mvs_f32`'s case (see `products`).
        if !self.tail_ops.route || n != 1 || router.format != Format::F32 || router.rows != rule.num_experts() || self.faulted() {
            return false;
        }
        check("router input", input, 1, router.cols);
        check("router", logits, 1, router.rows);
        let ra = self.route_args(rule, bias, 1, routes, at);
        let Some(ticket) = self.float_scratch(&self.tail_tickets, 1, "tail op tickets") else { return true };
        let mut table = Jobs { count: 1, pad: 0, job: [Job::default(); MAX_JOBS] };
        table.job[0] = Self::job(dptr(&router.data, &self.stream), router.row_bytes, router.rows, router.cols, 0, 1, 0, 0);
        let (xp, lp) = (input.at(&self.stream), logits.at_mut(&self.stream));
        let (xs, os) = (router.cols as i32, router.rows as i32);
        let mut a = Launch::new(&self.k.mvs_f32_route);
        a.arg(&table).arg(&xp).arg(&xs).arg(&lp).arg(&os);
        ra.push(&mut a);
        a.arg(&ticket);
        // A block per row (see mvs_f32); the last one's first warp routes.
        let cfg = LaunchConfig { grid_dim: (router.rows as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: ra.shared(3) };
        self.launch(a, cfg, "router and route");
        self.tail_op_launches.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// [`smoe_engine::Backend::matmul_add_rms_norm`] of one token through a matrix the int8
    /// mat-vec takes, in one launch (`mvq_add_norm`: `mvq`'s blocks, the last adding `d` into
    /// the residual and normalising it as `add_rms_norm` does); false: not this case, nothing
    /// launched.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn product_add_norm(
        &self,
        w: &CudaMatrix,
        x: &CudaBuf,
        n: usize,
        d: &mut CudaBuf,
        resid: &mut CudaBuf,
        (dim, norm, eps): (usize, &CudaVector, f32),
        h: &mut CudaBuf,
    ) -> bool {
        let kernels = self.k.format(w.format).mvq.as_ref().filter(|_| self.int8);
        let Some(k) = kernels.filter(|_| self.tail_ops.add && n == 1 && w.rows == dim && w.cols.is_multiple_of(32) && !self.faulted())
        else {
            return false;
        };
        check("matmul input", x, 1, w.cols);
        check("matmul", d, 1, dim);
        check("add_rms_norm", resid, 1, dim);
        check("add_rms_norm output", h, 1, dim);
        assert!(norm.len >= dim, "add_rms_norm: {} weights for rows of {dim}", norm.len);
        // The input as the op that wrote it left it quantized (attention does), else quantized here.
        let left = x.quantized().filter(|q| q.cols == w.cols && q.src_stride == w.cols && q.rows >= 1).map(|q| (q.ptr, q.stride));
        let Some((qx, qs)) = left.or_else(|| self.quantize(x.at(&self.stream), w.cols, 0, 1, w.cols)) else { return true };
        let Some(ticket) = self.float_scratch(&self.tail_tickets, 1, "tail op tickets") else { return true };
        let mut table = Jobs { count: 1, pad: 0, job: [Job::default(); MAX_JOBS] };
        table.job[0] = Self::job(dptr(&w.data, &self.stream), w.row_bytes, w.rows, w.cols, 0, 1, 0, 0);
        let (dp, xp) = (d.at_mut(&self.stream), resid.at_mut(&self.stream));
        let out = h.at_mut(&self.stream);
        let (hq, _) = self.quant_out(h, 1, dim);
        let an = AddNorm {
            x: xp,
            w: dptr(&norm.data, &self.stream),
            out,
            q: hq,
            ticket,
            eps,
            dim: dim as i32,
            threads: norm_threads(dim) as i32,
        };
        let (qs_i, lo, os) = (qs as i32, 0i32, dim as i32);
        let mut a = Launch::new(&k.add_norm);
        a.arg(&table).arg(&qx).arg(&qs_i).arg(&lo).arg(&dp).arg(&os).arg(&an);
        let grid = (w.rows.div_ceil(mvq_block_rows(w.format, w.cols)) as u32, 1, 1);
        self.launch(
            a,
            LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: 0 },
            "products, int8 mat-vec with add and norm",
        );
        self.tail_op_launches.fetch_add(1, Ordering::Relaxed);
        true
    }

    /// [`smoe_engine::Backend::qkv_rope_store`] of one token whose q, k and v matrices (whole
    /// heads of rows, output columns at head boundaries) share a format the int8 mat-vec takes,
    /// where `qk_rope_store` fuses: one launch (`mvq_rope`: `mvq`'s blocks, the last of each
    /// head's doing qk_rope_store's work on it); false: not this case, nothing launched.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn products_rope_store(
        &self,
        jobs: &[MatJob<'_, CudaMatrix>],
        h: &CudaBuf,
        h_stride: usize,
        qkv: &mut CudaBuf,
        n: usize,
        rows: QkvRows,
        norm: Option<(&CudaVector, &CudaVector, f32)>,
        rope: RopeTables<'_>,
        cache: &mut CudaKvCache,
        layer: usize,
        pos0: usize,
    ) -> bool {
        let hd = rows.head_dim;
        let mats: Option<Vec<(&CudaMatrix, usize)>> = jobs
            .iter()
            .map(|j| match j.w {
                WeightRef::Resident(m, None) if j.x_row == 0 && j.n == 1 && j.out_row == 0 => Some((m, j.out_col)),
                _ => None,
            })
            .collect();
        let Some(mats) = mats.filter(|m| !m.is_empty() && self.tail_ops.rope && n == 1 && self.int8 && !self.faulted()) else {
            return false;
        };
        let (format, cols) = (mats[0].0.format, mats[0].0.cols);
        let Some(k) = self.k.format(format).mvq.as_ref() else { return false };
        let block_rows = mvq_block_rows(format, cols);
        let whole_heads = mats.iter().all(|(m, col)| m.format == format && m.cols == cols && m.rows % hd == 0 && col % hd == 0);
        let heads = rows.q_heads + 2 * rows.kv_heads;
        let covered = mats.iter().map(|(m, _)| m.rows).sum::<usize>() == heads * hd;
        let half = rope.cos.len();
        if !whole_heads || !covered || !hd.is_multiple_of(block_rows) || h_stride != cols || !fuses(cache.layers[layer].shape, rows, half) {
            return false;
        }
        check("matmul input", h, 1, cols);
        check_qkv(qkv, 1, rows, norm);
        let left = h.quantized().filter(|q| q.cols == cols && q.src_stride == cols && q.rows >= 1).map(|q| (q.ptr, q.stride));
        let Some((qx, qs)) = left.or_else(|| self.quantize(h.at(&self.stream), cols, 0, 1, cols)) else { return true };
        let Some((kc, vc)) = self.kv_room(cache, layer, pos0, 1) else { return true };
        let Some(args) = self.qkv_args(qkv, 1, rows, norm, rope) else { return true };
        let Some(tickets) = self.float_scratch(&self.tail_tickets, heads, "tail op tickets") else { return true };
        let mut table = Jobs { count: mats.len() as i32, pad: 0, job: [Job::default(); MAX_JOBS] };
        for (slot, (m, col)) in table.job.iter_mut().zip(&mats) {
            *slot = Self::job(dptr(&m.data, &self.stream), m.row_bytes, m.rows, m.cols, 0, 1, 0, *col);
        }
        let rs = RopeStore {
            qn: args.q_norm,
            kn: args.k_norm,
            cs: args.tables,
            kc,
            vc,
            tickets,
            eps: args.eps,
            q_heads: args.q_heads,
            kv_heads: args.kv_heads,
            hd: args.head_dim,
            half: args.half,
            interleaved: args.interleaved,
            pos: pos0 as i32,
            block_rows: block_rows as i32,
        };
        let (qs_i, lo, os) = (qs as i32, 0i32, rows.stride as i32);
        let mut a = Launch::new(&k.rope);
        a.arg(&table).arg(&qx).arg(&qs_i).arg(&lo).arg(&args.x).arg(&os).arg(&rs);
        let max_rows = mats.iter().map(|(m, _)| m.rows).max().unwrap_or(0);
        let grid = (max_rows.div_ceil(block_rows) as u32, mats.len() as u32, 1);
        self.launch(
            a,
            LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: 0 },
            "products, int8 mat-vec with RoPE and store",
        );
        self.tail_op_launches.fetch_add(1, Ordering::Relaxed);
        true
    }
}
