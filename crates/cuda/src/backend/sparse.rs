//! DeepSeek Sparse Attention (GLM-5) on the GPU (kernels in sparse.cu): the indexer key's
//! LayerNorm, the indexer's scores (also DeepSeek-V4's, over compressed keys) (on the device; the top-k on the host, by the rule every
//! backend shares, `smoe_engine::backend::select_top`), and attention over each query's kept
//! positions, gathered into a scratch cache so that the dense decode kernel runs over them.

use super::{norm_threads, CudaBackend, CudaBuf, CudaKvCache, CudaVector};
use crate::buf::dptr;
use crate::launch::Launch;
use cudarc::driver::LaunchConfig;
use smoe_engine::backend::{check_rows, select_top, AttnParams, IndexQueries};

/// Threads of a block of `index_scores`: positions scored per block.
const SCORE_THREADS: usize = 128;

impl CudaBackend {
    /// The scratch of sparse attention (scores, gathered rows), at least `floats` long.
    fn sparse_scratch(&self, floats: usize) -> Option<u64> {
        self.float_scratch(&self.sparse_part, floats, "sparse attention scratch")
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_norm_rows(
        &self,
        x: &mut CudaBuf,
        n: usize,
        stride: usize,
        off: usize,
        dim: usize,
        w: &CudaVector,
        b: &CudaVector,
        eps: f32,
    ) {
        if self.faulted() || n == 0 {
            return;
        }
        check_rows("layer_norm_strided", x, 0, n, stride, off, dim);
        assert!(w.len >= dim && b.len >= dim, "layer_norm_strided: {} weights, {} biases for rows of {dim}", w.len, b.len);
        let (xp, wp, bp) = (x.at_mut(&self.stream), dptr(&w.data, &self.stream), dptr(&b.data, &self.stream));
        let (s, o, d) = (stride as i32, off as i32, dim as i32);
        let mut a = Launch::new(&self.k.layer_norm);
        a.arg(&xp).arg(&s).arg(&o).arg(&d).arg(&wp).arg(&bp).arg(&eps);
        self.launch(
            a,
            LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (norm_threads(dim), 1, 1), shared_mem_bytes: 0 },
            "layer_norm",
        );
    }

    pub(super) fn index_select_rows(
        &self,
        cache: &CudaKvCache,
        layer: usize,
        q: &CudaBuf,
        weights: &CudaBuf,
        at: IndexQueries,
        out: &mut [u32],
    ) {
        let IndexQueries { row0, n, pos0, heads, top, rate } = at;
        if self.faulted() || n == 0 {
            return;
        }
        // A key per position (GLM-5), or per `rate` positions (DeepSeek-V4's compressed keys).
        let rate = rate.max(1);
        let l = &cache.layers[layer];
        let d = l.shape.k_dim;
        at.check(q, weights, d, out);
        // The keys the last query sees; each query's row of scores holds that many.
        let total = at.seen(pos0 + n - 1);
        assert!(total <= l.len, "index_select: {total} keys seen but {} cached", l.len);
        if total == 0 {
            out[..n * top].fill(u32::MAX);
            return;
        }
        let shared = 4 * heads * (d + 1);
        if shared > 48 << 10 {
            self.record("index_select", format!("{heads} indexer heads of {d} exceed a block's shared memory"));
            return;
        }
        let Some(sp) = self.sparse_scratch(n * total) else { return };
        assert!(l.k.is_some() && l.base == 0, "index_select: every key stored before selection");
        let kp = l.keys(&self.stream);
        let qp = q.at(&self.stream) + (row0 * heads * d * 4) as u64;
        let wp = weights.at(&self.stream) + (row0 * heads * 4) as u64;
        let (di, hi, p0, ri, ti) = (d as i32, heads as i32, pos0 as i32, rate as i32, total as i32);
        let mut a = Launch::new(&self.k.index_scores);
        a.arg(&kp).arg(&di).arg(&qp).arg(&wp).arg(&hi).arg(&p0).arg(&ri).arg(&ti).arg(&sp);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, total.div_ceil(SCORE_THREADS) as u32, 1),
            block_dim: (SCORE_THREADS as u32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        self.launch(a, cfg, "index_scores");
        // The top-k on the host: one read of n x total scores.
        self.settle();
        let mut scores = vec![0f32; n * total];
        // SAFETY: the scratch holds at least n * total floats (sparse_scratch above) that the
        // launch just queued on this stream writes, and the stream is synchronized before
        // `scores` is read.
        let r = unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut scores[..], sp, self.stream.cu_stream()) };
        if self.ok("index_select scores", r).is_none() || self.ok("index_select scores", self.stream.synchronize()).is_none() {
            return;
        }
        let mut order = Vec::new();
        for (t, o) in out[..n * top].chunks_mut(top).enumerate() {
            let seen = at.seen(pos0 + t);
            select_top(&scores[t * total..][..seen], seen, top, &mut order, o);
        }
    }

    /// Attention of `n` queries (checked by the caller), each over its own selected positions:
    /// per query, its kept keys (and values) gathered into the scratch, then the decode kernel
    /// over them.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_selected(
        &self,
        cache: &CudaKvCache,
        layer: usize,
        q: &CudaBuf,
        q_stride: usize,
        n: usize,
        p: AttnParams<'_>,
        out: &mut CudaBuf,
    ) {
        let sel = p.selected.expect("attention_selected without a selection");
        let l = &cache.layers[layer];
        let s = l.shape;
        let (kw, vw) = (l.k_width(), l.v_width());
        let per = sel.per_query;
        let lists = &sel.positions[..n * per];
        if let Some(&bad) = lists.iter().find(|&&j| j != u32::MAX && j as usize >= l.len) {
            self.record("attention", format!("selected position {bad} but {} cached", l.len));
            return;
        }
        let row_floats = kw + if s.values_in_keys { 0 } else { vw };
        let Some(gp) = self.sparse_scratch(per * row_floats) else { return };
        let Some(lp) = self.stage("sparse attention positions", 4 * lists.len(), |dst| {
            for (d, v) in dst.chunks_exact_mut(4).zip(lists) {
                d.copy_from_slice(&v.to_ne_bytes());
            }
        }) else {
            return;
        };
        assert!(l.stored(), "attention: keys and values stored before attention");
        if let Some(&bad) = lists.iter().find(|&&j| j != u32::MAX && (j as usize) < l.base) {
            self.record("attention", format!("selected position {bad} was dropped (held from {})", l.base));
            return;
        }
        let kp = l.keys(&self.stream);
        let vp = if s.values_in_keys { kp } else { l.values(&self.stream) };
        let (qp, op) = (q.at(&self.stream), out.at_mut(&self.stream));
        let dense = AttnParams { selected: None, ..p };
        let gv = gp + (per * kw * 4) as u64;
        for t in 0..n {
            let kept = sel.of(t).count();
            if kept == 0 {
                continue;
            }
            let rows = lp + (t * per * 4) as u64;
            let gather = |src: u64, width: usize, dst: u64| {
                let (w, c) = (width as i32, kept as i32);
                let mut a = Launch::new(&self.k.gather_rows);
                a.arg(&src).arg(&w).arg(&rows).arg(&c).arg(&dst);
                self.launch(a, LaunchConfig { grid_dim: (kept as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 }, "gather_rows");
            };
            gather(kp, kw, gp);
            let (vsrc, v_row, v_head) = if s.values_in_keys {
                (gp, kw, s.k_dim)
            } else {
                gather(vp, vw, gv);
                (gv, vw, s.v_dim)
            };
            let qt = qp + (t * q_stride * 4) as u64;
            let ot = op + (t * p.q_heads * s.v_dim * 4) as u64;
            self.attention_decode(gp, vsrc, s, v_row, v_head, qt, q_stride, 1, kept - 1, dense, ot, (0, 0));
        }
    }
}
