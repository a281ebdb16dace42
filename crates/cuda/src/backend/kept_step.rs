//! The routed experts of a kept layer in one step ([`Backend::kept_experts`]): pair by pair on
//! the fused kernels (kept.cu), on the int8 tiles (kept_tiles.cu) for a batched step, or through
//! the per-part launches; and the norm after them in the mix kernel's last blocks
//! ([`Backend::kept_experts_norm`]).

use super::{check, check_rows, dptr, mvq_block_rows, CudaBackend, CudaBuf, CudaVector, Int8Kernels, KeptJobs, RowNorm};
use crate::launch::Launch;
use cudarc::driver::LaunchConfig;
use smoe_engine::Backend;
use std::sync::atomic::Ordering;

impl CudaBackend {
    /// [`Backend::kept_experts`], and with `norm` the norm after it done by the mix kernel's
    /// last block of each token, where the fused kernels run: returns whether it was (else the
    /// caller runs the norm).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn kept_step(
        &self,
        layer: usize,
        (routes, at, k): (&CudaBuf, usize, usize),
        h: &CudaBuf,
        n: usize,
        gu: &mut CudaBuf,
        slots: &mut CudaBuf,
        x: &mut CudaBuf,
        limit: Option<f32>,
        norm: Option<RowNorm>,
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
                let mut a = Launch::new(&gk.swiglu);
                a.arg(&gj).arg(&rp).arg(&hq.0).arg(&hs).arg(&gp).arg(&gs).arg(&dq).arg(&ds).arg(&first_i);
                let cfg = LaunchConfig { grid_dim: order((width / 32) as u32, pairs), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
                self.launch(a, cfg, "kept experts: gate, up, SiLU");
                drop(kept);
                let (xp, xs) = (x.at_mut(&self.stream), hidden as i32);
                let mut a = Launch::new(&dk.mix);
                let rn = norm.unwrap_or_default();
                a.arg(&dj).arg(&rp).arg(&dq).arg(&ds).arg(&xp).arg(&xs).arg(&first_i).arg(&rn);
                // A warp a row (kept.cu's mvq_mix), four a block.
                let cfg =
                    LaunchConfig { grid_dim: order(hidden.div_ceil(4) as u32, n as u32), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
                self.launch(a, cfg, "kept experts: down, mixed");
                if norm.is_some() {
                    self.tail_op_launches.fetch_add(1, Ordering::Relaxed);
                }
                return norm.is_some();
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

    /// The norm `kept_step` may do after the mix: `h = x / rms(x) · w` over `n` rows of `dim`,
    /// with its int8 copy where `rms_norm` leaves one, when the tail ops are on and `h`'s int8
    /// copy (the experts' input) stays where it is (the copy is rewritten in place, after the
    /// products that read it). None: the caller's `rms_norm` does it.
    pub(super) fn tail_norm(&self, h: &mut CudaBuf, n: usize, dim: usize, w: &CudaVector, eps: f32) -> Option<RowNorm> {
        let in_place = h.quantized().is_some_and(|q| q.cols == dim && q.src_stride == dim && q.rows >= n) && h.quant_fits(n, dim);
        if !self.tail_ops.mix || !self.kept_fused || !in_place || self.faulted() || n == 0 {
            return None;
        }
        check("rms_norm", h, n, dim);
        assert!(w.len >= dim, "rms_norm: {} weights for rows of {dim}", w.len);
        let tickets = self.float_scratch(&self.tail_tickets, n, "tail op tickets")?;
        let out = h.at_mut(&self.stream);
        let (q, qs) = self.quant_out(h, n, dim);
        Some(RowNorm {
            w: dptr(&w.data, &self.stream),
            out,
            q,
            tickets,
            eps,
            os: dim as i32,
            qs,
            dim: dim as i32,
            threads: super::norm_threads(dim) as i32,
        })
    }
}
