//! The forward pass: one loop over layers for any family, any number of tokens.
//!
//! Prefill and decode are the same code: `n` new tokens at positions `pos..pos + n` (decode is
//! `n = 1`). Long inputs run in chunks so buffers stay bounded. Every buffer lives in [`State`]
//! and is reused: no allocation per token once a sequence has warmed up.

use crate::backend::{AttnParams, Backend, MatJob, WeightRef};
use crate::instrument::Instrument;
use crate::model::{Attention, FeedForward, LatentAttention, Layer, Mlp, Model, MoeBlock, StandardAttention};
use crate::routing::RouteScratch;
use crate::widths::Widths;
use crate::EngineError;
use smoe_store::ExpertView;
use std::time::Instant;

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

/// Which logits a forward call returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// Only the last position's (generation).
    Last,
    /// Every position's (scoring).
    All,
}

/// Sees what the forward pass does. All methods default to nothing.
pub trait Observer {
    /// Routing of one token at one MoE layer: chosen experts, their mixing weights, and the
    /// scores the choice was made on (for every expert).
    fn route(&mut self, _layer: usize, _pos: usize, _experts: &[u32], _weights: &[f32], _choice: &[f32]) {}
}

/// An observer that watches nothing.
pub struct NoObserver;
impl Observer for NoObserver {}

/// Activation buffers for up to `chunk` tokens, as wide as [`Widths`] says.
struct Buffers<B: Backend> {
    x: B::Buf,
    h: B::Buf,
    q: B::Buf,
    k: B::Buf,
    v: B::Buf,
    att: B::Buf,
    tmp: B::Buf,
    tmp2: B::Buf,
    g: B::Buf,
    u: B::Buf,
    d: B::Buf,
    xe: B::Buf,
    gu: B::Buf,
    dd: B::Buf,
    slots: B::Buf,
    router: B::Buf,
    logits: B::Buf,
}

/// Host-side scratch.
#[derive(Default)]
struct HostScratch {
    cos: Vec<f32>,
    sin: Vec<f32>,
    router: Vec<f32>,
    ids: Vec<u32>,
    weights: Vec<f32>,
    route: RouteScratch,
    needed: Vec<u32>,
    starts: Vec<usize>,
    fill: Vec<usize>,
    order: Vec<usize>,
    tokens: Vec<usize>,
    gate: Vec<f32>,
}

/// One sequence: its KV cache, position and scratch. Reset by dropping back to position 0.
pub struct State<B: Backend> {
    kv: B::KvCache,
    pos: usize,
    chunk: usize,
    buf: Buffers<B>,
    host: HostScratch,
    /// Logits of the last forward call.
    logits: Vec<f32>,
    /// Per-step measurements, when enabled.
    pub instrument: Option<Instrument>,
}

impl<B: Backend> State<B> {
    /// Tokens in the cache.
    pub fn pos(&self) -> usize {
        self.pos
    }
    /// Forgets everything after the first `pos` tokens (prefix reuse keeps the rest).
    pub fn truncate(&mut self, pos: usize) {
        self.pos = self.pos.min(pos);
    }
    /// The KV cache.
    pub fn kv(&self) -> &B::KvCache {
        &self.kv
    }
    /// Starts recording per-step measurements (see [`Instrument`]).
    pub fn enable_instrument(&mut self) {
        self.instrument.get_or_insert_with(Instrument::default);
    }
}

impl<B: Backend> Model<B> {
    /// A fresh sequence that runs prefill in chunks of up to `chunk` tokens.
    pub fn new_state(&self, chunk: usize) -> State<B> {
        let c = chunk.max(1);
        let be = &self.backend;
        let w = Widths::of(&self.arch, self.router.top_k());
        let mk = |name: &'static str, width: usize| be.buf(name, c * width);
        State {
            kv: be.kv_cache(&self.kv_shapes()),
            pos: 0,
            chunk: c,
            buf: Buffers {
                x: mk("x", w.x),
                h: mk("h", w.h),
                q: mk("q", w.q),
                k: mk("k", w.k),
                v: mk("v", w.v),
                att: mk("att", w.att),
                tmp: mk("tmp", w.tmp),
                tmp2: mk("tmp2", w.tmp2),
                g: mk("g", w.g),
                u: mk("u", w.u),
                d: mk("d", w.d),
                xe: mk("xe", w.xe),
                gu: mk("gu", w.gu),
                dd: mk("dd", w.dd),
                slots: mk("slots", w.slots),
                router: mk("router", w.router),
                logits: mk("logits", w.logits),
            },
            host: HostScratch::default(),
            logits: Vec::new(),
            instrument: None,
        }
    }

    /// Makes room in `st`'s KV cache for `positions` positions in all (see
    /// [`Backend::kv_reserve`]): callers that know how long a sequence may get say so once.
    pub fn reserve(&self, st: &mut State<B>, positions: usize) {
        self.backend.kv_reserve(&mut st.kv, positions);
    }

    /// Runs `tokens` through the model after the state's current position and returns the
    /// requested logits (`[vocab]` for [`Logits::Last`], `[n, vocab]` for [`Logits::All`]).
    pub fn forward<'s>(
        &self,
        st: &'s mut State<B>,
        tokens: &[u32],
        want: Logits,
        obs: &mut dyn Observer,
    ) -> Result<&'s [f32], EngineError> {
        let vocab = self.arch.vocab_size;
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::Input(format!("token id {bad} is outside the vocabulary of {vocab}")));
        }
        if tokens.is_empty() {
            return Err(EngineError::Input("no tokens to run".into()));
        }
        st.logits.clear();
        if want == Logits::All {
            st.logits.reserve(tokens.len() * vocab);
        }
        for chunk in tokens.chunks(st.chunk) {
            self.forward_chunk(st, chunk, want, obs)?;
        }
        Ok(&st.logits)
    }

    fn forward_chunk(&self, st: &mut State<B>, tokens: &[u32], want: Logits, obs: &mut dyn Observer) -> Result<(), EngineError> {
        let be = &self.backend;
        let (n, hd) = (tokens.len(), self.arch.hidden_size);
        let pos = st.pos;
        let t0 = Instant::now();
        if let Some(ins) = st.instrument.as_mut() {
            ins.begin(n, self.experts.stats());
        }
        be.embed(&self.embed, tokens, &mut st.buf.x);
        self.rope.fill(pos, n, &mut st.host.cos, &mut st.host.sin);
        for (li, layer) in self.layers.iter().enumerate() {
            self.layer(li, layer, st, n, pos, obs)?;
        }
        let b = &mut st.buf;
        be.rms_norm(&b.x, n, hd, &self.final_norm, self.eps, &mut b.h);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        let vocab = self.arch.vocab_size;
        match want {
            Logits::All => {
                be.matmul(head, None, &b.h, n, &mut b.logits);
                let start = st.logits.len();
                st.logits.resize(start + n * vocab, 0.0);
                be.download(&b.logits, 0, &mut st.logits[start..]);
            }
            Logits::Last => {
                be.copy_strided(&b.h, hd, (n - 1) * hd, &mut b.tmp, hd, 0, hd, 1);
                be.matmul(head, None, &b.tmp, 1, &mut b.logits);
                st.logits.resize(vocab, 0.0);
                be.download(&b.logits, 0, &mut st.logits);
            }
        }
        st.pos += n;
        if let Some(ins) = st.instrument.as_mut() {
            ins.end(ms(t0), self.experts.stats());
        }
        Ok(())
    }

    fn layer(
        &self,
        li: usize,
        layer: &Layer<B>,
        st: &mut State<B>,
        n: usize,
        pos: usize,
        obs: &mut dyn Observer,
    ) -> Result<(), EngineError> {
        let be = &self.backend;
        let hd = self.arch.hidden_size;
        let t = Instant::now();
        be.rms_norm(&st.buf.x, n, hd, &layer.attn_norm, self.eps, &mut st.buf.h);
        match &layer.attn {
            Attention::Standard(a) => self.standard_attention(li, a, st, n, pos),
            Attention::Latent(a) => self.latent_attention(li, a, st, n, pos),
        }
        let b = &mut st.buf;
        be.add(&mut b.x, &b.d, n * hd);
        if let Some(ins) = st.instrument.as_mut() {
            ins.current.attention_ms += ms(t);
        }
        if self.lookahead {
            self.lookahead_prefetch(li, st, n);
        }
        let b = &mut st.buf;
        be.rms_norm(&b.x, n, hd, &layer.ffn_norm, self.eps, &mut b.h);
        match &layer.ffn {
            FeedForward::Dense(m) => {
                let t = Instant::now();
                self.mlp(m, st, n);
                be.add(&mut st.buf.x, &st.buf.d, n * hd);
                if let Some(ins) = st.instrument.as_mut() {
                    ins.current.expert_ms += ms(t);
                }
            }
            FeedForward::Moe(m) => self.moe(li, m, st, n, pos, obs)?,
        }
        Ok(())
    }

    /// Predicts the next MoE layer's experts by applying its router to the current hidden state
    /// (after this layer's attention) and asks the store to start reading them.
    fn lookahead_prefetch(&self, li: usize, st: &mut State<B>, n: usize) {
        let Some(next) = self.layers.get(li + 1) else { return };
        let FeedForward::Moe(m) = &next.ffn else { return };
        let (be, hd, e_count, k) = (&self.backend, self.arch.hidden_size, self.arch.moe.num_experts, self.router.top_k());
        let (b, hs) = (&mut st.buf, &mut st.host);
        be.rms_norm(&b.x, n, hd, &next.ffn_norm, self.eps, &mut b.xe);
        be.matmul(&m.router, None, &b.xe, n, &mut b.router);
        hs.router.resize(n * e_count, 0.0);
        be.download(&b.router, 0, &mut hs.router);
        hs.needed.clear();
        hs.ids.resize(n * k, 0);
        hs.weights.resize(n * k, 0.0);
        for t in 0..n {
            let (ids, w) = (&mut hs.ids[t * k..(t + 1) * k], &mut hs.weights[t * k..(t + 1) * k]);
            self.router.route(&hs.router[t * e_count..(t + 1) * e_count], m.router_bias.as_deref(), ids, w, &mut hs.route);
            for &e in ids.iter() {
                if !hs.needed.contains(&e) {
                    hs.needed.push(e);
                }
            }
        }
        self.experts.prefetch(li + 1, &hs.needed);
    }

    /// GQA attention; leaves the projected output in `d`. q, k and v come from one dispatch into
    /// one row per token, `[q | k | v]`.
    fn standard_attention(&self, li: usize, a: &StandardAttention<B>, st: &mut State<B>, n: usize, pos: usize) {
        let (be, ar) = (&self.backend, &self.arch);
        let b = &mut st.buf;
        let (nh, nkv, hdim) = (ar.num_heads, ar.num_kv_heads, ar.head_dim);
        let (qw, kvw) = (nh * hdim, nkv * hdim);
        let w = qw + 2 * kvw;
        let jobs = [
            MatJob { w: WeightRef::Resident(&a.q, None), x_row: 0, n, out_row: 0, out_col: 0 },
            MatJob { w: WeightRef::Resident(&a.k, None), x_row: 0, n, out_row: 0, out_col: qw },
            MatJob { w: WeightRef::Resident(&a.v, None), x_row: 0, n, out_row: 0, out_col: qw + kvw },
        ];
        be.matmul_many(&jobs, &b.h, ar.hidden_size, &mut b.q, w);
        if let Some([qb, kb, vb]) = &a.bias {
            be.add_bias(&mut b.q, n, w, 0, qb);
            be.add_bias(&mut b.q, n, w, qw, kb);
            be.add_bias(&mut b.q, n, w, qw + kvw, vb);
        }
        match &a.qk_norm {
            Some((smoe_vault::QkNorm::PerHead, qn, kn)) => {
                for h in 0..nh {
                    be.rms_norm_strided(&mut b.q, n, w, h * hdim, hdim, qn, self.eps);
                }
                for h in 0..nkv {
                    be.rms_norm_strided(&mut b.q, n, w, qw + h * hdim, hdim, kn, self.eps);
                }
            }
            Some((_, qn, kn)) => {
                be.rms_norm_strided(&mut b.q, n, w, 0, qw, qn, self.eps);
                be.rms_norm_strided(&mut b.q, n, w, qw, kvw, kn, self.eps);
            }
            None => {}
        }
        let (cos, sin, il) = (&st.host.cos, &st.host.sin, self.rope.interleaved);
        be.rope(&mut b.q, n, w, 0, nh, hdim, cos, sin, il);
        be.rope(&mut b.q, n, w, qw, nkv, hdim, cos, sin, il);
        be.kv_store(&mut st.kv, li, pos, n, &b.q, w, qw, Some((&b.q, w, qw + kvw)));
        be.attention(&st.kv, li, &b.q, w, n, pos, AttnParams { q_heads: nh, scale: self.attn_scale }, &mut b.att);
        be.matmul(&a.o, None, &b.att, n, &mut b.d);
    }

    /// Absorbed multi-head latent attention; leaves the projected output in `d`.
    fn latent_attention(&self, li: usize, a: &LatentAttention<B>, st: &mut State<B>, n: usize, pos: usize) {
        let (be, ar) = (&self.backend, &self.arch);
        let m = ar.mla.as_ref().expect("latent attention without MLA dims");
        let b = &mut st.buf;
        let nh = ar.num_heads;
        let (nope, rope, rank, vdim) = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim);
        let (qk, lat) = (nope + rope, rank + rope);
        // Queries: [n, heads, nope + rope].
        match &a.q_a {
            Some((q_a, q_norm)) => {
                let r = m.q_lora_rank.unwrap();
                be.matmul(q_a, None, &b.h, n, &mut b.k);
                be.rms_norm_strided(&mut b.k, n, r, 0, r, q_norm, self.eps);
                be.matmul(&a.q_b, None, &b.k, n, &mut b.tmp);
            }
            None => be.matmul(&a.q_b, None, &b.h, n, &mut b.tmp),
        }
        // The cached row per position: normalised latent, then the rotated shared key.
        be.matmul(&a.kv_a, None, &b.h, n, &mut b.v);
        be.rms_norm_strided(&mut b.v, n, lat, 0, rank, &a.kv_a_norm, self.eps);
        let (cos, sin, il) = (&st.host.cos, &st.host.sin, self.rope.interleaved);
        be.rope(&mut b.v, n, lat, rank, 1, 0, cos, sin, il);
        be.kv_store(&mut st.kv, li, pos, n, &b.v, lat, 0, None);
        be.rope(&mut b.tmp, n, nh * qk, nope, nh, qk, cos, sin, il);
        // Absorb W_uk into the queries: q_eff[h] = [W_uk[h]ᵀ q_nope[h] | q_rope[h]].
        for h in 0..nh {
            be.matmul_t(&a.kv_b, h * (nope + vdim), nope, &b.tmp, nh * qk, h * qk, n, &mut b.tmp2);
            be.copy_strided(&b.tmp2, rank, 0, &mut b.q, nh * lat, h * lat, rank, n);
            be.copy_strided(&b.tmp, nh * qk, h * qk + nope, &mut b.q, nh * lat, h * lat + rank, rope, n);
        }
        be.attention(&st.kv, li, &b.q, nh * lat, n, pos, AttnParams { q_heads: nh, scale: self.attn_scale }, &mut b.att);
        // Expand each head's attended latent through W_uv[h].
        for h in 0..nh {
            be.copy_strided(&b.att, nh * rank, h * rank, &mut b.tmp2, rank, 0, rank, n);
            be.matmul(&a.kv_b, Some((h * (nope + vdim) + nope, vdim)), &b.tmp2, n, &mut b.tmp);
            be.copy_strided(&b.tmp, vdim, 0, &mut b.k, nh * vdim, h * vdim, vdim, n);
        }
        be.matmul(&a.o, None, &b.k, n, &mut b.d);
    }

    /// SwiGLU MLP of `h` into `d`.
    fn mlp(&self, m: &Mlp<B>, st: &mut State<B>, n: usize) {
        let be = &self.backend;
        let b = &mut st.buf;
        be.matmul(&m.gate, None, &b.h, n, &mut b.g);
        be.matmul(&m.up, None, &b.h, n, &mut b.u);
        be.silu_mul(&mut b.g, &b.u, n * m.width);
        be.matmul(&m.down, None, &b.g, n, &mut b.d);
    }

    /// Routed experts (plus shared experts) of `h`, added into `x`.
    fn moe(&self, li: usize, m: &MoeBlock<B>, st: &mut State<B>, n: usize, pos: usize, obs: &mut dyn Observer) -> Result<(), EngineError> {
        let (be, ar) = (&self.backend, &self.arch);
        let (hd, e_count, k) = (ar.hidden_size, ar.moe.num_experts, self.router.top_k());
        let width = ar.moe.intermediate_size;
        let t_route = Instant::now();
        let (b, hs) = (&mut st.buf, &mut st.host);
        be.matmul(&m.router, None, &b.h, n, &mut b.router);
        hs.router.resize(n * e_count, 0.0);
        be.download(&b.router, 0, &mut hs.router);
        hs.ids.resize(n * k, 0);
        hs.weights.resize(n * k, 0.0);
        for t in 0..n {
            let (ids, w) = (&mut hs.ids[t * k..(t + 1) * k], &mut hs.weights[t * k..(t + 1) * k]);
            self.router.route(&hs.router[t * e_count..(t + 1) * e_count], m.router_bias.as_deref(), ids, w, &mut hs.route);
            obs.route(li, pos + t, ids, w, &hs.route.choice);
            if let Some(ins) = st.instrument.as_mut() {
                ins.route(li, ids);
            }
        }
        if let Some(ins) = st.instrument.as_mut() {
            ins.current.routing_ms += ms(t_route);
        }
        let t_experts = Instant::now();
        // Group (token, slot) pairs by expert: `order[starts[j]..starts[j + 1]]` are the slots of
        // `needed[j]`, in token order.
        hs.starts.clear();
        hs.starts.resize(e_count + 1, 0);
        for &e in &hs.ids {
            hs.starts[e as usize + 1] += 1;
        }
        for e in 0..e_count {
            hs.starts[e + 1] += hs.starts[e];
        }
        hs.order.resize(n * k, 0);
        hs.fill.clear();
        hs.fill.extend_from_slice(&hs.starts);
        for (slot, &e) in hs.ids.iter().enumerate() {
            hs.order[hs.fill[e as usize]] = slot;
            hs.fill[e as usize] += 1;
        }
        hs.needed.clear();
        hs.needed.extend((0..e_count as u32).filter(|&e| hs.starts[e as usize + 1] > hs.starts[e as usize]));
        // Every (token, slot) pair's input row, in expert order: expert e's rows are
        // `starts[e]..starts[e + 1]` of `xe`, and of `gu` and `dd` after it.
        hs.tokens.clear();
        hs.tokens.extend(hs.order.iter().map(|s| s / k));
        be.gather_rows(&b.h, hd, &hs.tokens, &mut b.xe);
        let (starts, needed) = (&hs.starts, &hs.needed);
        let mut compute = |batch: &[(usize, ExpertView<'_>)]| {
            // One dispatch for every gate and up product of the batch ([gate | up] per row of
            // `gu`), one for every down product.
            let mut jobs = Vec::with_capacity(2 * batch.len());
            for (j, ex) in batch {
                let e = needed[*j] as usize;
                let (r0, rows) = (starts[e], starts[e + 1] - starts[e]);
                jobs.push(MatJob { w: WeightRef::Host(ex.gate), x_row: r0, n: rows, out_row: r0, out_col: 0 });
                jobs.push(MatJob { w: WeightRef::Host(ex.up), x_row: r0, n: rows, out_row: r0, out_col: width });
            }
            be.matmul_many(&jobs, &b.xe, hd, &mut b.gu, 2 * width);
            jobs.clear();
            for (j, ex) in batch {
                let e = needed[*j] as usize;
                let (r0, rows) = (starts[e], starts[e + 1] - starts[e]);
                be.silu_mul_halves(&mut b.gu, r0, rows, 2 * width, width);
                jobs.push(MatJob { w: WeightRef::Host(ex.down), x_row: r0, n: rows, out_row: r0, out_col: 0 });
            }
            be.matmul_many(&jobs, &b.gu, 2 * width, &mut b.dd, hd);
        };
        self.experts.with_experts(li, needed, &mut compute)?;
        be.scatter_rows(&b.dd, hd, &hs.order, &mut b.slots);
        // Sum in slot order, whatever order the experts arrived in: bit-identical results
        // whether experts were resident or streamed.
        be.add_weighted_slots(&b.slots, hd, n, k, &hs.weights, &mut b.x);
        if let Some(shared) = &m.shared {
            self.mlp(shared, st, n);
            let (b, hs) = (&mut st.buf, &mut st.host);
            if let Some(g) = &m.shared_gate {
                be.matmul(g, None, &b.h, n, &mut b.tmp);
                hs.gate.resize(n, 0.0);
                be.download(&b.tmp, 0, &mut hs.gate);
                for v in hs.gate.iter_mut() {
                    *v = 1.0 / (1.0 + (-*v).exp());
                }
                be.scale_rows(&mut b.d, hd, &hs.gate);
            }
            be.add(&mut b.x, &b.d, n * hd);
        }
        if let Some(ins) = st.instrument.as_mut() {
            ins.current.expert_ms += ms(t_experts);
        }
        Ok(())
    }
}
