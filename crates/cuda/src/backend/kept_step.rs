//! A step's kept experts (routed on the device, see `crate::kept`): gate, up and down for
//! every (token, slot) pair, mixed into the residual, and where a decoded token's mix can, the
//! next layer's input norm in the mix's last block ([`smoe_engine::Backend::kept_experts_norm`]).

use super::{
    check, check_rows, dptr, mix_split_rows, mvq_block_rows, norm_threads, CudaBackend, CudaBuf, CudaVector, Int8Kernels, KeptJobs,
};
use crate::launch::Launch;
use cudarc::driver::LaunchConfig;
use smoe_engine::Backend;
use std::sync::atomic::Ordering;

/// The next layer's input norm that a decoded token's split mix runs in its last block
/// (`mvkq_mix_split_norm` in kept.cu): the norm's weights and epsilon, where its output and
/// int8 copy go, and the threads of the norm's own launch (whose sums it reproduces).
#[derive(Clone, Copy)]
pub(super) struct MixTail {
    w: u64,
    eps: f32,
    out: u64,
    oq: u64,
    threads: i32,
}

impl CudaBackend {
    /// [`smoe_engine::Backend::kept_experts_norm`] with the norm in the mix's last block where
    /// it can (one token on the split mix, `h` left quantized by the norm before it, the option
    /// on: [`super::CudaOptions::fused_norm`]); false: the norm is still to run.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn kept_experts_and_norm(
        &self,
        layer: usize,
        routes: &CudaBuf,
        at: usize,
        k: usize,
        h: &mut CudaBuf,
        n: usize,
        gu: &mut CudaBuf,
        slots: &mut CudaBuf,
        x: &mut CudaBuf,
        limit: Option<f32>,
        dim: usize,
        w: &CudaVector,
        eps: f32,
    ) -> bool {
        // The norm writes `h` and its int8 copy where they lie: the gate and up products read
        // that copy (the norm before left it) first, and one stream orders the two.
        let q = h.quantized().filter(|q| n == 1 && q.cols == dim && q.rows >= 1);
        let tail = match q {
            Some(q) if self.fused_norm && w.len >= dim && !self.faulted() => {
                Some(MixTail { w: dptr(&w.data, &self.stream), eps, out: h.at(&self.stream), oq: q.ptr, threads: norm_threads(dim) as i32 })
            }
            _ => None,
        };
        let normed = self.kept_experts_with(layer, routes, at, k, h, n, gu, slots, x, limit, tail);
        if normed {
            // What the norm's own launch leaves: `h` written, its int8 copy valid (the same room).
            h.at_mut(&self.stream);
            let (oq, _) = self.quant_out(h, 1, dim);
            debug_assert_eq!(Some(oq), tail.map(|t| t.oq), "the norm's int8 copy moved");
        }
        normed
    }

    /// [`smoe_engine::Backend::kept_experts`], and with `tail`, the next norm where a decoded
    /// token's split mix runs it: true then.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn kept_experts_with(
        &self,
        layer: usize,
        routes: &CudaBuf,
        at: usize,
        k: usize,
        h: &CudaBuf,
        n: usize,
        gu: &mut CudaBuf,
        slots: &mut CudaBuf,
        x: &mut CudaBuf,
        limit: Option<f32>,
        tail: Option<MixTail>,
    ) -> bool {
        if self.faulted() || n == 0 {
            return false;
        }
        let kept = self.kept.lock().expect("kept experts lock");
        let Some(l) = kept.layer(layer) else {
            drop(kept);
            self.record("kept_experts", format!("layer {layer} is not kept"));
            return false;
        };
        let [gate, up, down] = &l.parts;
        let (hidden, width) = (gate.cols, gate.rows);
        check_rows("kept_experts routes", routes, 0, 1, 0, at, n * 2 * k);
        check("kept_experts input", h, n, hidden);
        check("kept_experts gate and up", gu, n * k, 2 * width);
        check("kept_experts down", slots, n * k, hidden);
        check("kept_experts", x, n, hidden);
        let rp = routes.at(&self.stream) + (at * 4) as u64;
        let pairs = (n * k) as u32;
        // The given parts (and their output columns) of every pair's expert, as the kernels
        // take them; inputs one row per token or, `per_pair`, per pair.
        let kept_jobs = |parts: &[(&crate::kept::KeptPart, usize)], per_pair: bool| {
            let p0 = parts[0].0;
            let mut kj = KeptJobs {
                row_bytes: p0.row_bytes as u64,
                rows: p0.rows as i32,
                cols: p0.cols as i32,
                k: k as i32,
                parts: parts.len() as i32,
                experts: l.experts as i32,
                x_per_pair: per_pair as i32,
                ..Default::default()
            };
            for (i, (p, col)) in parts.iter().enumerate() {
                kj.base[i] = dptr(&p.data, &self.stream);
                kj.expert_bytes[i] = p.bytes as u64;
                kj.out_col[i] = *col as i32;
            }
            kj
        };
        // One launch for the given parts of every pair's expert: inputs at `xp` (rows `xs`
        // apart), or already quantized at `xq`.
        let launch = |parts: &[(&crate::kept::KeptPart, usize)],
                      xp: u64,
                      xq: Option<(u64, usize)>,
                      xs: usize,
                      per_pair: bool,
                      op: u64,
                      os: usize| {
            let p0 = parts[0].0;
            let kj = kept_jobs(parts, per_pair);
            let (xs_i, os_i) = (xs as i32, os as i32);
            let fk = self.k.format(p0.format);
            // The kernel a one-token product of this format gets in `products`, so that a kept
            // expert's product has the same bits as the same product named by a job.
            if let (Some(Int8Kernels { mvkq, .. }), true) = (&fk.mvq, self.int8) {
                let rows = if per_pair { n * k } else { n };
                let Some((qx, qstride)) = xq.or_else(|| self.quantize(xp, xs, 0, rows, p0.cols)) else { return };
                let qs_i = qstride as i32;
                let mut a = Launch::new(mvkq);
                a.arg(&kj).arg(&rp).arg(&qx).arg(&qs_i).arg(&op).arg(&os_i);
                let grid = (p0.rows.div_ceil(mvq_block_rows(p0.format, p0.cols)) as u32, pairs * parts.len() as u32, 1);
                self.launch(a, LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: 0 }, "products, kept experts");
                return;
            }
            let mut a = Launch::new(&fk.mvk);
            a.arg(&kj).arg(&rp).arg(&xp).arg(&xs_i).arg(&op).arg(&os_i);
            let grid = (p0.rows.div_ceil(4) as u32, pairs * parts.len() as u32, 1);
            self.launch(a, LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: 0 }, "products, kept experts");
        };
        // `h` as the norm before left it quantized, where it did.
        let hq = h.quantized().filter(|q| q.cols == hidden && q.rows >= n).map(|q| (q.ptr, q.stride));
        let (hp, gp) = (h.at(&self.stream), gu.at_mut(&self.stream));
        // The fused kernels know plain SiLU only.
        if let Some(hq) = hq.filter(|_| self.kept_fused && limit.is_none()) {
            let kernels = |p: &crate::kept::KeptPart| self.k.format(p.format).mvq.as_ref().filter(|_| self.int8);
            if let (Some(gk), Some(dk), true) = (kernels(gate), kernels(down), gate.format == up.format && width % 32 == 0) {
                let (gj, dj) = (kept_jobs(&[(gate, 0), (up, width)], false), kept_jobs(&[(down, 0)], true));
                let dstride = crate::buf::quant_stride(width);
                let Some(dq) = self.scratch(n * k * dstride) else { return false };
                let (hs, gs, ds) = (hq.1 as i32, (2 * width) as i32, dstride as i32);
                if n >= self.kept_tiles_from && self.tiles_take(l, limit) {
                    // Each expert's rows once for all its pairs: a block per (rows, expert),
                    // blocks of experts no pair chose leave after reading the routes.
                    let (n_i, experts) = (n as i32, l.experts as u32);
                    let mut a = Launch::new(&gk.tiles.swiglu);
                    a.arg(&gj).arg(&rp).arg(&n_i).arg(&hq.0).arg(&hs).arg(&gp).arg(&gs).arg(&dq).arg(&ds);
                    let cfg = LaunchConfig { grid_dim: ((width / 32) as u32, experts, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
                    self.launch(a, cfg, "kept experts on tiles: gate, up, SiLU");
                    let sp = slots.at_mut(&self.stream);
                    let hidden_i = hidden as i32;
                    let mut a = Launch::new(&dk.tiles.down);
                    a.arg(&dj).arg(&rp).arg(&n_i).arg(&dq).arg(&ds).arg(&sp).arg(&hidden_i);
                    let cfg =
                        LaunchConfig { grid_dim: (hidden.div_ceil(64) as u32, experts, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
                    self.launch(a, cfg, "kept experts on tiles: down");
                    self.kept_tile_steps.fetch_add(1, Ordering::Relaxed);
                    drop(kept);
                    // The routes' weights follow each token's k ids.
                    self.mix_slots(slots, x, hidden, n, k, (rp, 2 * k, k));
                    return false;
                }
                // The pairs (tokens) on x where they go first (see `kept_pairs_first`).
                let (first, first_i) = (self.kept_pairs_first, self.kept_pairs_first as i32);
                let order = |rows: u32, pairs: u32| if first { (pairs, rows, 1) } else { (rows, pairs, 1) };
                // A one-token step's experts asked of L2 once the routes are known (kept.cu's
                // kept_prefetch): a larger step's would not fit.
                let prefetch = if self.prefetch && n == 1 { pairs as i32 } else { 0 };
                let (down_base, down_bytes) = (dptr(&down.data, &self.stream), down.bytes as u64);
                let mut a = Launch::new(&gk.swiglu);
                a.arg(&gj).arg(&rp).arg(&hq.0).arg(&hs).arg(&gp).arg(&gs).arg(&dq).arg(&ds).arg(&first_i);
                a.arg(&down_base).arg(&down_bytes).arg(&prefetch);
                let cfg = LaunchConfig { grid_dim: order((width / 32) as u32, pairs), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
                self.launch(a, cfg, "kept experts: gate, up, SiLU");
                if prefetch > 0 {
                    self.kept_prefetch_steps.fetch_add(1, Ordering::Relaxed);
                }
                let split = mix_split_rows(down.format, down.cols, k).filter(|_| self.kept_split.takes(n));
                drop(kept);
                let (xp, xs) = (x.at_mut(&self.stream), hidden as i32);
                if let (Some(t), Some(rows), 1) = (tail, split, n) {
                    // The split mix with the next norm in its last block (kept.cu).
                    let Some(ticket) = self.float_scratch(&self.ticket, 1, "last-block ticket") else { return false };
                    let mut a = Launch::new(&dk.mix_split_norm);
                    a.arg(&dj).arg(&rp).arg(&dq).arg(&ds).arg(&xp).arg(&t.w).arg(&t.out).arg(&t.eps).arg(&t.oq).arg(&t.threads);
                    a.arg(&ticket);
                    let cfg = LaunchConfig {
                        grid_dim: (hidden.div_ceil(rows) as u32, 1, 1),
                        block_dim: ((32 * rows * k.div_ceil(2)) as u32, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    self.launch(a, cfg, "kept experts: down, mixed, next norm");
                    self.kept_split_steps.fetch_add(1, Ordering::Relaxed);
                    self.mix_norm_steps.fetch_add(1, Ordering::Relaxed);
                    return true;
                }
                let mut a = Launch::new(if split.is_some() { &dk.mix_split } else { &dk.mix });
                a.arg(&dj).arg(&rp).arg(&dq).arg(&ds).arg(&xp).arg(&xs).arg(&first_i);
                // Split: `rows` rows of (k + 1) / 2 warps a block; else a warp a row (kept.cu's
                // mvq_mix), four a block.
                let (rows, threads) = split.map_or((4, 128), |rows| (rows, (32 * rows * k.div_ceil(2)) as u32));
                let cfg = LaunchConfig {
                    grid_dim: order(hidden.div_ceil(rows) as u32, n as u32),
                    block_dim: (threads, 1, 1),
                    shared_mem_bytes: 0,
                };
                self.launch(a, cfg, "kept experts: down, mixed");
                if split.is_some() {
                    self.kept_split_steps.fetch_add(1, Ordering::Relaxed);
                }
                return false;
            }
        }
        // Gate and up in one launch when they share a format (as they do but in odd mixes).
        if gate.format == up.format {
            launch(&[(gate, 0), (up, width)], hp, hq, hidden, false, gp, 2 * width);
        } else {
            launch(&[(gate, 0)], hp, hq, hidden, false, gp, 2 * width);
            launch(&[(up, width)], hp, hq, hidden, false, gp, 2 * width);
        }
        // SiLU(gate) · up, quantized on the way where the down products take int8; clipped
        // (DeepSeek-V4), then quantized by the down products' launch.
        let dq = match (self.int8 && self.k.format(down.format).mvq.is_some() && width % 32 == 0, self.faulted(), limit) {
            (_, _, Some(limit)) => {
                self.silu_clamped_halves(gu, 0, n * k, 2 * width, width, limit);
                None
            }
            (true, false, None) => self.silu_quantize(gu, n * k, width),
            _ => {
                self.silu_mul_halves(gu, 0, n * k, 2 * width, width);
                None
            }
        };
        launch(&[(down, 0)], gp, dq, 2 * width, true, slots.at_mut(&self.stream), hidden);
        drop(kept);
        self.mix_slots(slots, x, hidden, n, k, (rp, 2 * k, k));
        false
    }
}
