//! DeepSeek-V4 on the GPU (kernels in compressed.cu): the compressor (a block per closed window:
//! the softmax pooling of each channel, the entry's RMSNorm and rotation), the attention of each
//! query and head over its sliding window and the entries it sees, read in place from the cache
//! (no gathered copy: one launch for every query of a call), the hyper-connections' collapse and
//! expansion, and the clipped SwiGLU. The compressor's bias and norm are vectors in VRAM, loaded
//! with the model; the small per-call inputs (window RoPE, sinks, selections, stream weights) go
//! through the staging ring.

use super::{cfg_elems, norm_threads, CudaBackend, CudaBuf, CudaKvCache, CudaVector};
use crate::buf::dptr;
use crate::launch::Launch;
use cudarc::driver::LaunchConfig;
use smoe_engine::backend::{check, CompressWindows, CompressedParams};

/// Widest head `attention_compressed` holds (CA_LANE_DIMS × 32 in compressed.cu).
const MAX_HEAD_DIM: usize = 512;
/// Most hyper-connection streams `hc_expand` mixes (HC_MAX_STREAMS in compressed.cu, the
/// architecture's bound).
const MAX_STREAMS: usize = smoe_vault::HyperConnections::MAX_STREAMS;

impl CudaBackend {
    pub(super) fn compress(&self, cache: &mut CudaKvCache, c: CompressWindows<'_, CudaVector>) {
        let CompressWindows { raw_layer, entry_layer, first, count, rate, dim, overlap, bias, norm, eps, rope } = c;
        if self.faulted() || count == 0 {
            return;
        }
        let cw = if overlap { 2 * dim } else { dim };
        assert_ne!(raw_layer, entry_layer, "compress_windows: raw rows and entries in one layer");
        let raw = &cache.layers[raw_layer];
        assert_eq!(raw.k_width(), 2 * cw, "compress_windows: raw rows of {} for entries of {dim}", raw.k_width());
        let earliest = if overlap { first.saturating_sub(1) * rate } else { first * rate };
        assert!(
            raw.base <= earliest && raw.len >= (first + count) * rate,
            "compress_windows: windows {first}..{} of a raw cache holding positions {}..{}",
            first + count,
            raw.base,
            raw.len
        );
        assert!(bias.len >= rate * cw && norm.len >= dim, "compress_windows: {} biases, {} norm weights", bias.len, norm.len);
        let entries = &cache.layers[entry_layer];
        assert_eq!(entries.k_width(), dim, "compress_windows: entries of {dim} into a layer of {}", entries.k_width());
        let half = rope.cos.len() / count;
        assert!(2 * half <= dim && rope.sin.len() >= count * half, "compress_windows: {half} rotated pairs of {dim}");
        let Some(tables) = self.stage_f32("compress_windows rope", &[&rope.cos[..count * half], &rope.sin[..count * half]]) else {
            return;
        };
        assert!(raw.k.is_some(), "compress_windows: raw rows stored before compression");
        let rp = raw.keys(&self.stream);
        let Some((ep, _)) = self.kv_room(cache, entry_layer, first, count) else { return };
        let (bp, np) = (dptr(&bias.data, &self.stream), dptr(&norm.data, &self.stream));
        let sp = tables + (4 * count * half) as u64;
        let (f, r, d, o, h) = (first as i32, rate as i32, dim as i32, overlap as i32, half as i32);
        let mut a = Launch::new(&self.k.compress_windows);
        a.arg(&rp).arg(&ep).arg(&f).arg(&r).arg(&d).arg(&o).arg(&bp).arg(&np).arg(&eps).arg(&tables).arg(&sp).arg(&h);
        let cfg = LaunchConfig { grid_dim: (count as u32, 1, 1), block_dim: (norm_threads(dim), 1, 1), shared_mem_bytes: (4 * dim) as u32 };
        self.launch(a, cfg, "compress_windows");
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend_compressed(
        &self,
        cache: &CudaKvCache,
        layer: usize,
        q: &CudaBuf,
        n: usize,
        pos0: usize,
        p: CompressedParams<'_>,
        out: &mut CudaBuf,
    ) {
        if self.faulted() || n == 0 {
            return;
        }
        let window = &cache.layers[layer];
        let d = window.shape.k_dim;
        check("attention_compressed queries", q, n, p.q_heads * d);
        check("attention_compressed", out, n, p.q_heads * d);
        assert!(
            window.shape.heads == 1 && window.len >= pos0 + n,
            "attention_compressed: layer {layer} lacks positions up to {}",
            pos0 + n
        );
        let first = (pos0 + 1).saturating_sub(p.window);
        assert!(first >= window.base, "attention_compressed: position {first} was dropped (held from {})", window.base);
        assert!(p.sinks.len() >= p.q_heads, "attention_compressed: {} sinks for {} heads", p.sinks.len(), p.q_heads);
        if d > MAX_HEAD_DIM {
            self.record("attention_compressed", format!("heads of {d} dimensions (at most {MAX_HEAD_DIM} on CUDA)"));
            return;
        }
        let (ep, rate) = match p.entries {
            Some((el, rate)) => {
                let l = &cache.layers[el];
                let seen = (pos0 + n) / rate;
                assert!(l.k_width() == d && l.len >= seen, "attention_compressed: {seen} entries seen, {} held", l.len);
                (l.keys(&self.stream), rate)
            }
            None => (0, 0),
        };
        let (sel, top) = match p.selected {
            Some(s) => {
                let lists = &s.positions[..n * s.per_query];
                let held = p.entries.map_or(0, |(el, _)| cache.layers[el].len);
                if let Some(&bad) = lists.iter().find(|&&j| j != u32::MAX && j as usize >= held) {
                    self.record("attention_compressed", format!("selected entry {bad} but {held} held"));
                    return;
                }
                let Some(ptr) = self.stage("compressed attention selection", 4 * lists.len(), |dst| {
                    for (d, v) in dst.chunks_exact_mut(4).zip(lists) {
                        d.copy_from_slice(&v.to_ne_bytes());
                    }
                }) else {
                    return;
                };
                (ptr, s.per_query)
            }
            None => (0, 0),
        };
        let Some(sinks) = self.stage_f32("attention sinks", &[&p.sinks[..p.q_heads]]) else { return };
        assert!(window.k.is_some(), "attention_compressed: keys stored before attention");
        let wp = window.keys(&self.stream);
        let (qp, op) = (q.at(&self.stream), out.at_mut(&self.stream));
        let (d_i, h_i, p0, w_i, r_i, top_i) = (d as i32, p.q_heads as i32, pos0 as i32, p.window as i32, rate as i32, top as i32);
        let mut a = Launch::new(&self.k.attention_compressed);
        a.arg(&wp).arg(&ep).arg(&d_i).arg(&qp).arg(&h_i).arg(&p0).arg(&w_i).arg(&r_i).arg(&sel).arg(&top_i);
        a.arg(&sinks).arg(&p.scale).arg(&op);
        let cfg = LaunchConfig { grid_dim: (n as u32, p.q_heads as u32, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 };
        self.launch(a, cfg, "attention_compressed");
    }

    pub(super) fn collapse_streams(&self, x: &CudaBuf, n: usize, mult: usize, dim: usize, pre: &[f32], out: &mut CudaBuf) {
        if self.faulted() || n == 0 {
            return;
        }
        check("hc_collapse streams", x, n, mult * dim);
        check("hc_collapse", out, n, dim);
        assert!(pre.len() >= n * mult, "hc_collapse: {} weights for {n} rows of {mult}", pre.len());
        let Some(pp) = self.stage_f32("hc_collapse", &[&pre[..n * mult]]) else { return };
        let (xp, op) = (x.at(&self.stream), out.at_mut(&self.stream));
        let (n_i, m_i, d_i) = (n as i32, mult as i32, dim as i32);
        let mut a = Launch::new(&self.k.hc_collapse);
        a.arg(&xp).arg(&n_i).arg(&m_i).arg(&d_i).arg(&pp).arg(&op);
        self.launch(a, cfg_elems(n * dim), "hc_collapse");
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn expand_streams(&self, x: &mut CudaBuf, y: &CudaBuf, n: usize, mult: usize, dim: usize, post: &[f32], comb: &[f32]) {
        if self.faulted() || n == 0 {
            return;
        }
        check("hc_expand streams", x, n, mult * dim);
        check("hc_expand", y, n, dim);
        assert!(mult <= MAX_STREAMS, "hc_expand: {mult} streams (at most {MAX_STREAMS})");
        assert!(post.len() >= n * mult && comb.len() >= n * mult * mult, "hc_expand: {} and {} weights", post.len(), comb.len());
        let Some(pp) = self.stage_f32("hc_expand", &[&post[..n * mult], &comb[..n * mult * mult]]) else { return };
        let cp = pp + (4 * n * mult) as u64;
        let (xp, yp) = (x.at_mut(&self.stream), y.at(&self.stream));
        let (n_i, m_i, d_i) = (n as i32, mult as i32, dim as i32);
        let mut a = Launch::new(&self.k.hc_expand);
        a.arg(&xp).arg(&yp).arg(&n_i).arg(&m_i).arg(&d_i).arg(&pp).arg(&cp);
        self.launch(a, cfg_elems(n * dim), "hc_expand");
    }

    /// The clipped SwiGLU of `rows` rows of `w` gates at `g` + `g_off` (`gs` floats apart) with
    /// the up values at device address `up` (`us` apart), callers having checked both.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn clamped_silu_rows(
        &self,
        g: &mut CudaBuf,
        g_off: usize,
        gs: usize,
        up: u64,
        us: usize,
        rows: usize,
        w: usize,
        limit: f32,
    ) {
        if self.faulted() || rows == 0 || w == 0 {
            return;
        }
        let gp = g.at_mut(&self.stream) + (4 * g_off) as u64;
        let (gs_i, us_i, r_i, w_i) = (gs as i32, us as i32, rows as i32, w as i32);
        let mut a = Launch::new(&self.k.silu_clamped);
        a.arg(&gp).arg(&gs_i).arg(&up).arg(&us_i).arg(&r_i).arg(&w_i).arg(&limit);
        self.launch(a, cfg_elems(rows * w), "silu_clamped");
    }
}
