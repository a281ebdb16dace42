//! The forward pass: one loop over layers for any family, any number of tokens.
//!
//! Prefill and decode are the same code: `n` new tokens at positions `pos..pos + n` (decode is
//! `n = 1`). Long inputs run in chunks of at most the state's chunk size
//! ([`Model::prefill_chunk`] for the engine's own sequences), so the buffers stay bounded.
//!
//! A layer is attention then a feed-forward block; an MoE block is four steps, each a function
//! below: [`route_tokens`](Model::route_tokens) (router logits and each token's experts, shared
//! with the lookahead prefetch), [`ExpertGroups::group`] (the (token, slot) pairs grouped by
//! expert), [`routed_experts`](Model::routed_experts) (the chosen experts' products, batch by
//! batch as the store hands them over, mixed back in slot order) and
//! [`shared_experts`](Model::shared_experts).
//!
//! Memory: the activation buffers ([`Buffers`], one chunk's worth, made with the state) and the
//! host-side tables ([`HostScratch`], grown to the largest chunk seen) live in [`State`] and are
//! reused, as are the returned logits. What still allocates on every forward call, decode
//! included:
//! - here, the job list of each batch of experts the store hands over (one small `Vec` per
//!   batch): the jobs borrow the batch's expert views, which live only during the store's
//!   callback, so the list cannot be kept in the state;
//! - below the decoder, the expert store's lists for each layer's request and the backend's
//!   lists per dispatch (the CPU backend collects the weight views of each `matmul_many`);
//! - the KV cache, as positions are stored, unless [`Model::reserve`] made room first
//!   (generation, scoring and the benchmark do);
//! - with instrumentation on, one [`StepRecord`] per call.

use crate::backend::{
    AttnParams, Backend, CompressWindows, CompressedParams, ExpertPart, IndexQueries, MatJob, QkvRows, RopeTables, Selection, SeqQueries,
    SeqStore, WeightRef,
};
use crate::instrument::{Instrument, StepRecord};
use crate::model::{
    Attention, CompressedAttn, Compressor, ExpertBias, FeedForward, HyperMix, Indexer, LatentAttention, Layer, LinearAttn, Mlp, Model,
    MoeBlock, StandardAttention,
};
use crate::routing::RouteScratch;
use crate::widths::Widths;
use crate::EngineError;
use smoe_store::ExpertBatch;
use smoe_vault::ExpertAct;
use std::sync::Mutex;
use std::time::Instant;

/// Tokens per prefill chunk on the CPU ([`Backend::prefill_chunk`]'s default; the model's
/// chunk, [`Model::prefill_chunk`], is at least [`STREAMING_PREFILL_CHUNK`] when its experts
/// stream): a longer input runs through the layers this many tokens at a time, which bounds
/// the activation buffers a [`State`] holds.
pub const PREFILL_CHUNK: usize = 256;

/// The shortest prefill chunk of a model whose expert cache is smaller than its routed experts
/// ([`Model::prefill_chunk`]). Every chunk needs most of each layer's experts again, and a
/// cache that cannot hold them reads them again: longer chunks read fewer bytes per prompt
/// token. A 2,048-token prompt on a 12-layer cut of the Qwen3-235B-A22B shape with a quarter
/// of its experts cached read 3.3 MiB per token in chunks of 1,024 against 6.0 MiB in chunks
/// of 256 (1,049 against 1,867 expert reads; docs/benchmarks.md). On that cut a 1,024-token
/// chunk grew the process by 0.57 GB more than a 256-token one (measured), inside the reserve
/// the cache's automatic size leaves free.
pub const STREAMING_PREFILL_CHUNK: usize = 1024;

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
    /// Whether [`Self::route`] is wanted: when it is, every MoE layer is routed on the host
    /// (a backend that keeps a layer's experts routes them itself and the host never sees
    /// the choice scores).
    fn wants_routes(&self) -> bool {
        true
    }
    /// DeepSeek Sparse Attention's choice at a layer that runs its own indexer: the positions
    /// the query at position `pos` attends to, ascending (only for queries that see more
    /// positions than the indexer keeps).
    fn selected(&mut self, _layer: usize, _pos: usize, _positions: &[u32]) {}
}

/// An observer that watches nothing.
pub struct NoObserver;
impl Observer for NoObserver {
    fn wants_routes(&self) -> bool {
        false
    }
}

/// Activation buffers on the backend, each `chunk` rows as wide as [`Widths`] says (`n ≤ chunk`
/// rows in use in a call; `k` is the router's `top_k`). A buffer that a family does not use has
/// width 0.
pub(crate) struct Buffers<B: Backend> {
    /// `[n, hidden]`: the residual stream. Token embeddings, then each layer adds its attention
    /// and feed-forward outputs.
    x: B::Buf,
    /// `[n, hidden]`: `x` normed, the input of attention, of the feed-forward block and (after the
    /// final norm) of the LM head.
    h: B::Buf,
    /// Queries. GQA: `[n, (heads + 2 × kv_heads) × head_dim]`, each row `[q | k | v]` from one
    /// dispatch (biases, norms and RoPE applied in place). MLA: `[n, heads × (kv_lora_rank +
    /// qk_rope)]`, the absorbed queries.
    q: B::Buf,
    /// MLA only: `[n, q_lora_rank]`, the `q_a` projection; then `[n, heads × v_head_dim]`, the
    /// expanded values, input of the output projection.
    k: B::Buf,
    /// MLA only: `[n, kv_lora_rank + qk_rope]`, the row the KV cache stores per position (normed
    /// latent, rotated shared key).
    v: B::Buf,
    /// Attention output. GQA: `[n, heads × head_dim]`. MLA: `[n, heads × kv_lora_rank]`, the
    /// attended latents.
    att: B::Buf,
    /// Scratch. MLA: `[n, heads × (qk_nope + qk_rope)]`, the `q_b` projection, then
    /// `[n, v_head_dim]`, one head's expanded values. Also `[1, hidden]`, the last token's row of
    /// `h` before the LM head, and `[n, 1]`, the shared-expert gate's logits.
    tmp: B::Buf,
    /// MLA only: `[n, kv_lora_rank]`, one head's absorbed query, then one head's attended latent.
    tmp2: B::Buf,
    /// `[n, mlp width]`: the gate product of a dense MLP or shared expert, then SiLU(gate) · up.
    g: B::Buf,
    /// `[n, mlp width]`: the up product of a dense MLP or shared expert.
    u: B::Buf,
    /// `[n, hidden]`: what is added into `x`: attention's output projection, a dense MLP's or
    /// the shared experts' down projection.
    d: B::Buf,
    /// `[n × k, hidden]`: each (token, slot) pair's row of `h`, grouped by expert (see
    /// [`ExpertGroups`]). The lookahead also puts its `[n, hidden]` normed rows here.
    xe: B::Buf,
    /// `[n × k, 2 × moe width]`: `[gate | up]` per (token, slot) pair in expert order, then
    /// SiLU(gate) · up in each row's gate half.
    gu: B::Buf,
    /// `[n × k, hidden]`: the down products per (token, slot) pair, in expert order.
    dd: B::Buf,
    /// `[n × k, hidden]`: the same rows back in slot order (row `token × k + slot`).
    slots: B::Buf,
    /// `[n, experts]`: router logits (downloaded into [`Routes::logits`]).
    router: B::Buf,
    /// `[layers, n, 2k]`: where a layer's experts are kept by the backend, the routes it chose
    /// ([`Backend::route`]), read back after the chunk when the instrument is on. Empty when no
    /// layer is kept.
    routes: B::Buf,
    /// `[n, vocab]` for [`Logits::All`], `[1, vocab]` for [`Logits::Last`], `[sequences, vocab]`
    /// in a batch: the LM head's output.
    logits: B::Buf,
    /// DSA only (GLM-5): `[n, index heads × index head_dim]`, the indexer's queries.
    idx_q: B::Buf,
    /// DSA only: `[n, index head_dim]`, the indexer's keys (normed, rotated, then cached).
    idx_k: B::Buf,
    /// DSA only: `[n, index heads]`, each indexer head's weight for the token.
    idx_w: B::Buf,
    /// DeepSeek-V4 only: `[n, mult × hidden]`, the hyper-connection streams (the residual; `x`
    /// then holds a block's collapsed input, or the MoE block's output).
    hc: B::Buf,
    /// DeepSeek-V4 only: `[n, mult × hidden]`, the streams RMS-normed, input of the mixing
    /// projections.
    hcn: B::Buf,
    /// DeepSeek-V4 only: `[n, (2 + mult) × mult]`, a mixing projection's output.
    mix: B::Buf,
    /// DeepSeek-V4 only: `[n, 2 × c × dim]`, a compressor's `[kv | gate]` rows.
    raw: B::Buf,
    /// DeepSeek-V4 only: `[n, o_groups × o_lora_rank]`, the grouped output projection.
    grp: B::Buf,
    /// Batches only (width 0 in a sequence's own buffers): `[n, q width]`, one sequence's rows of
    /// `q` moved to row 0, because attention reads its queries from row 0 (see
    /// [`Model::attend`]).
    seg_q: B::Buf,
    /// Batches only: `[n, att width]`, that sequence's attention output before it goes back to
    /// its rows of `att`.
    seg_att: B::Buf,
}

/// One chunk's routing, on the host (`n` tokens, `k` experts each).
#[derive(Default)]
struct Routes {
    /// `[n, experts]`: router logits; or, routed on the backend
    /// (`route_on_backend`), its `[n, 2k]` ids and weights.
    logits: Vec<f32>,
    /// `[n, k]`: each token's experts, best first (slot `s` of token `t` is `t × k + s`).
    ids: Vec<u32>,
    /// `[n, k]`: their mixing weights.
    weights: Vec<f32>,
    /// `[n, experts]`: the scores each token's experts were chosen on (see
    /// [`RouteScratch::choice`]).
    choices: Vec<f32>,
}

/// One piece of a chunk's routing, filled by one task: its tokens' ids, weights and choice
/// scores (see [`Routes`]).
type RoutePiece<'a> = Mutex<(&'a mut [u32], &'a mut [f32], &'a mut [f32])>;

/// A chunk's (token, slot) pairs grouped by expert (a counting sort on the expert id), so that
/// each expert runs once over all its rows. Row `i` of `xe`, `gu` and `dd` is pair `order[i]`.
#[derive(Default)]
struct ExpertGroups {
    /// `[experts + 1]`: expert `e`'s rows are `starts[e]..starts[e + 1]`.
    starts: Vec<usize>,
    /// `[experts + 1]`: the next free row of each expert while `order` fills.
    fill: Vec<usize>,
    /// `[n × k]`: the slot (`token × k + s`) of each row; token order within an expert.
    order: Vec<usize>,
    /// `[n × k]`: the row of each slot (the inverse of `order`).
    row_of: Vec<usize>,
    /// `[n × k]`: the token of each row, the row of `h` it gathers.
    tokens: Vec<usize>,
    /// The experts with at least one row, ascending: what the store is asked for.
    needed: Vec<u32>,
}

impl ExpertGroups {
    /// Groups the slots of `ids` (`[n, k]` expert ids, of `experts` experts).
    fn group(&mut self, ids: &[u32], experts: usize, k: usize) {
        self.starts.clear();
        self.starts.resize(experts + 1, 0);
        for &e in ids {
            self.starts[e as usize + 1] += 1;
        }
        for e in 0..experts {
            self.starts[e + 1] += self.starts[e];
        }
        self.order.resize(ids.len(), 0);
        self.row_of.resize(ids.len(), 0);
        self.fill.clear();
        self.fill.extend_from_slice(&self.starts);
        for (slot, &e) in ids.iter().enumerate() {
            self.order[self.fill[e as usize]] = slot;
            self.row_of[slot] = self.fill[e as usize];
            self.fill[e as usize] += 1;
        }
        let starts = &self.starts;
        self.needed.clear();
        self.needed.extend((0..experts as u32).filter(|&e| starts[e as usize + 1] > starts[e as usize]));
        self.tokens.clear();
        self.tokens.extend(self.order.iter().map(|s| s / k));
    }

    /// The rows `(first, count)` of `needed[j]`.
    fn rows(&self, j: usize) -> (usize, usize) {
        let e = self.needed[j] as usize;
        (self.starts[e], self.starts[e + 1] - self.starts[e])
    }

    /// The first row of `xe` that `needed[j]`'s gate and up products read (`k` slots a token):
    /// its own rows, or, for an expert with one row, the row of that token's first slot, so that
    /// every expert a token reaches alone names the same input and `matmul_many` quantizes it
    /// once (in a batched step most experts get one token; the copies had been found by
    /// comparing their bits).
    fn input_row(&self, j: usize, k: usize) -> usize {
        let (r0, rows) = self.rows(j);
        if rows == 1 {
            self.row_of[self.tokens[r0] * k]
        } else {
            r0
        }
    }
}

/// Host-side scratch (`n` tokens of a chunk).
#[derive(Default)]
pub(crate) struct HostScratch {
    /// `[n, rotary_dim / 2]`: RoPE cosines for the chunk's positions.
    cos: Vec<f32>,
    /// `[n, rotary_dim / 2]`: RoPE sines.
    sin: Vec<f32>,
    /// The latest routing (an MoE block's, or the lookahead's).
    routes: Routes,
    /// The current MoE block's pairs grouped by expert.
    groups: ExpertGroups,
    /// The lookahead's predicted experts for the next MoE layer, in the order tokens first chose
    /// them.
    predicted: Vec<u32>,
    /// `[n]`: the shared-expert gate, sigmoid(`shared_gate` · h).
    gate: Vec<f32>,
    /// `[n]`: each row's position in its own sequence.
    positions: Vec<usize>,
    /// `[n]`: each row's sequence's routing-trace stream ([`State::set_trace_stream`]).
    streams: Vec<usize>,
    /// A batch's last row of each sequence (the rows the LM head runs on).
    last_rows: Vec<usize>,
    /// DSA (GLM-5): per sequence of the step, the positions its queries attend to, `[n, top_k]`
    /// as [`Backend::index_select`] wrote them, from the latest layer that ran an indexer;
    /// empty where every query sees `top_k` positions or fewer (dense attention).
    selection: Vec<Vec<u32>>,
    /// `[n]`: the DSA indexer's weight scale, one per row (what [`Backend::scale_rows`] takes).
    index_scale: Vec<f32>,
    /// `[n]`: the step's token ids (DeepSeek-V4's hash routing reads them).
    tokens: Vec<u32>,
    /// DeepSeek-V4: the negated sines (turning the attention output back), and the compressed
    /// layers' RoPE tables at the rows' positions (`ccos`, `csin`, `ncsin`).
    nsin: Vec<f32>,
    ccos: Vec<f32>,
    csin: Vec<f32>,
    ncsin: Vec<f32>,
    /// DeepSeek-V4: the compressed RoPE at the first position of each window being compressed.
    wcos: Vec<f32>,
    wsin: Vec<f32>,
    /// DeepSeek-V4: the windows' first positions.
    wpos: Vec<usize>,
    /// DeepSeek-V4: a hyper-connection mixing projection, downloaded, and the weights from it.
    mixes: Vec<f32>,
    pre: Vec<f32>,
    post: Vec<f32>,
    comb: Vec<f32>,
    /// `[n]` zeros (clearing `x` before an MoE block accumulates into it).
    zeros: Vec<f32>,
}

/// The memory a forward step works in: activation buffers of `chunk` rows and host scratch. A
/// [`State`] has its own (for its own sequence); a [`Batch`](crate::Batch) has one for all
/// the sequences of its steps.
pub(crate) struct Work<B: Backend> {
    /// Most rows (tokens) of one step.
    pub(crate) chunk: usize,
    buf: Buffers<B>,
    host: HostScratch,
}

/// One sequence's part of a step: rows `row..row + n` of the step's buffers are its new tokens,
/// at positions `pos..pos + n`, their keys and values going into `kv`.
pub(crate) struct Seg<'k, B: Backend> {
    pub(crate) kv: &'k mut B::KvCache,
    /// Its Gated DeltaNet layers' states, by [`LinearAttn::slot`](crate::model::LinearAttn).
    pub(crate) rec: &'k mut [B::Buf],
    pub(crate) pos: usize,
    /// Its routing-trace stream (benchmarks only).
    pub(crate) stream: usize,
    pub(crate) row: usize,
    pub(crate) n: usize,
}

/// What one forward step runs on: the working memory, the instrument and the sequences whose
/// tokens are its rows. Everything but attention treats the rows alike, whichever sequence
/// they belong to; attention runs per sequence, over its own KV cache.
pub(crate) struct Step<'a, 'k, B: Backend> {
    buf: &'a mut Buffers<B>,
    host: &'a mut HostScratch,
    instrument: &'a mut Option<Instrument>,
    segs: &'a mut [Seg<'k, B>],
    /// The most tokens one sequence brings to the step (see [`Backend::kept_takes`]).
    run: usize,
    /// Whether the layer before already normed the residual into `h` with the input norm of
    /// what comes next (the next layer's, or the final norm; see [`Backend::kept_experts_norm`]).
    normed_ahead: bool,
}

impl<B: Backend> Work<B> {
    /// The buffers and host scratch, for a [`Step`].
    pub(crate) fn parts(&mut self) -> (&mut Buffers<B>, &mut HostScratch) {
        (&mut self.buf, &mut self.host)
    }
}

impl<'a, 'k, B: Backend> Step<'a, 'k, B> {
    /// A step over `segs`, whose rows lie in `buf` and `host`.
    pub(crate) fn new(
        buf: &'a mut Buffers<B>,
        host: &'a mut HostScratch,
        instrument: &'a mut Option<Instrument>,
        segs: &'a mut [Seg<'k, B>],
    ) -> Self {
        let run = segs.iter().map(|g| g.n).max().unwrap_or(0);
        Step { buf, host, instrument, segs, run, normed_ahead: false }
    }

    /// Adds the milliseconds since `t` to one timer of the current step, when instrumenting.
    fn charge(&mut self, t: Instant, timer: fn(&mut StepRecord) -> &mut f64) {
        if let Some(ins) = self.instrument.as_mut() {
            *timer(&mut ins.current) += ms(t);
        }
    }
}

/// One sequence: its KV cache, position and scratch. Reset by dropping back to position 0.
pub struct State<B: Backend> {
    /// Keys and values of positions `0..pos`, every layer.
    pub(crate) kv: B::KvCache,
    /// Gated DeltaNet layers' states after position `pos - 1` (Qwen3-Next; see
    /// [`Backend::gated_delta_net`]), one per linear layer.
    pub(crate) recurrent: Vec<B::Buf>,
    /// The recurrent states as the latest multi-token step (a prompt's prefill) left them, and
    /// the position they hold: where [`truncate`](Self::truncate) can go back to without
    /// starting over (a chat's next turn resumes after the previous prompt).
    pub(crate) checkpoint: Option<(usize, Vec<B::Buf>)>,
    /// The recurrent states at a position the caller marked ([`Model::keep_state_at`]): where
    /// a prefix other prompts share ends (a system prompt and its tools), so that other
    /// conversations can start there. Unlike `checkpoint`, going back to it copies it and keeps
    /// it; it is dropped only when the sequence goes back before it.
    pub(crate) pinned: Option<(usize, Vec<B::Buf>)>,
    /// The marked position: the step that ends there saves `pinned`.
    pub(crate) pin: Option<usize>,
    /// Set by [`truncate`](Self::truncate) going back to `pinned`: the next step copies it into
    /// `recurrent` before it runs (truncating has no backend to copy with).
    pub(crate) restore_pinned: bool,
    /// Tokens in the cache.
    pub(crate) pos: usize,
    /// How far back the cache can be truncated and continued (DeepSeek-V4 drops older rows,
    /// [`Model::set_kv_rewind`]); `None`: any distance.
    pub(crate) rewind: Option<usize>,
    /// Which stream of a routing trace it replays ([`Self::set_trace_stream`]).
    pub(crate) stream: usize,
    /// Buffers for this sequence's own forward calls (`work.chunk` rows; unused when it runs in a
    /// [`Batch`](crate::Batch)).
    work: Work<B>,
    /// Logits of the last forward call: `[vocab]` ([`Logits::Last`]) or `[tokens, vocab]`
    /// ([`Logits::All`]).
    logits: Vec<f32>,
    /// Per-step measurements, when enabled.
    pub instrument: Option<Instrument>,
}

impl<B: Backend> State<B> {
    /// Tokens in the cache.
    pub fn pos(&self) -> usize {
        self.pos
    }
    /// Most tokens one forward chunk runs (a prefill of `t` tokens is `t.div_ceil(chunk)`
    /// forward steps).
    pub fn chunk(&self) -> usize {
        self.work.chunk
    }
    /// Forgets everything after the first `pos` tokens (prefix reuse keeps the rest).
    ///
    /// Where the model drops old rows ([`Model::set_kv_rewind`]), going back further than it
    /// keeps starts the sequence over: [`pos`](Self::pos) is then 0 and the whole prefix runs
    /// again. A model with recurrent states (Qwen3-Next) goes back to where its latest prefill
    /// ended if the kept prefix reaches that far, else to 0. Callers continue from `pos()`, not
    /// from what they asked for.
    pub fn truncate(&mut self, pos: usize) {
        let p = self.truncate_point(pos);
        if !self.recurrent.is_empty() && p < self.pos {
            // A recurrent state holds the sequence at its last position only: back to the
            // latest checkpoint (swapped in) or the pinned one (copied at the next step) if the
            // kept prefix covers it, else start over.
            self.restore_pinned = false;
            if let Some((_, mut saved)) = self.checkpoint.take().filter(|&(c, _)| c == p && c > 0) {
                std::mem::swap(&mut self.recurrent, &mut saved);
            } else if p > 0 && self.pinned.as_ref().is_some_and(|(c, _)| *c == p) {
                self.restore_pinned = true;
            }
            if self.pinned.as_ref().is_some_and(|(c, _)| *c > p) {
                self.pinned = None;
            }
            if self.pin.is_some_and(|m| m < p) {
                self.pin = None;
            }
        }
        self.pos = p;
    }

    /// Where [`truncate`](Self::truncate)`(pos)` would leave the sequence, without doing it.
    pub fn truncate_point(&self, pos: usize) -> usize {
        let p = self.pos.min(pos);
        if !self.recurrent.is_empty() && p < self.pos {
            let at = |saved: &Option<(usize, Vec<B::Buf>)>| saved.as_ref().map(|(c, _)| *c).filter(|&c| c <= p);
            return at(&self.checkpoint).max(at(&self.pinned)).unwrap_or(0);
        }
        match self.rewind {
            Some(m) if self.pos - p > m => 0,
            _ => p,
        }
    }
    /// Before a step: the pinned recurrent states copied in, where [`truncate`](Self::truncate)
    /// went back to them.
    pub(crate) fn before_step(&mut self, be: &B, floats: usize) {
        if std::mem::take(&mut self.restore_pinned) {
            let (_, saved) = self.pinned.as_ref().expect("restore_pinned is set only with a pinned state");
            for (dst, src) in self.recurrent.iter_mut().zip(saved) {
                be.copy_strided(src, floats, 0, dst, floats, 0, floats, 1);
            }
        }
    }

    /// After a step of `n` tokens (its position already advanced): the recurrent states kept
    /// as the latest [`checkpoint`](Self::checkpoint) after a multi-token step (a prompt's
    /// prefill), and as the [`pinned`](Self::pinned) ones where the step ended at the mark.
    /// Nothing for a model without them.
    pub(crate) fn after_step(&mut self, be: &B, floats: usize, n: usize) {
        if self.recurrent.is_empty() {
            return;
        }
        if n > 1 {
            save(be, floats, &self.recurrent, &mut self.checkpoint, self.pos);
        }
        match self.pin {
            Some(m) if m == self.pos => save(be, floats, &self.recurrent, &mut self.pinned, m),
            // A step that ran past the mark (its caller did not stop there) keeps nothing.
            Some(m) if m < self.pos => {}
            _ => return,
        }
        self.pin = None;
    }
    /// Starts this state from positions `0..positions` of `other` (same model): their keys and
    /// values are copied, not recomputed. A model with recurrent states starts at the nearest
    /// point at or before `positions` where `other` holds them (its end, its pinned prefix, its
    /// latest checkpoint): [`pos`](Self::pos) says where. False where the backend cannot copy a
    /// KV cache, or `other` holds no such point but the start.
    pub fn copy_prefix(&mut self, model: &Model<B>, other: &State<B>, positions: usize) -> bool {
        let mut positions = positions.min(other.pos);
        let mut source = &other.recurrent;
        if !other.recurrent.is_empty() {
            let end = (!other.restore_pinned).then_some((other.pos, &other.recurrent));
            let saved = [&other.pinned, &other.checkpoint].into_iter().flatten().map(|(c, b)| (*c, b));
            match end.into_iter().chain(saved).filter(|&(c, _)| c > 0 && c <= positions).max_by_key(|&(c, _)| c) {
                Some((c, b)) => (positions, source) = (c, b),
                None => return false,
            }
        } else if other.rewind.is_some_and(|m| other.pos - positions > m) {
            // The rows before the prefix's end are no longer all there.
            return false;
        }
        if !model.backend().kv_copy(&other.kv, &mut self.kv, positions) {
            return false;
        }
        let len = model.recurrent_floats();
        for (dst, src) in self.recurrent.iter_mut().zip(source) {
            model.backend().copy_strided(src, len, 0, dst, len, 0, len, 1);
        }
        self.pos = positions;
        true
    }

    /// Bytes of recurrent state this sequence holds: the live states and the saved copies.
    pub fn recurrent_bytes(&self, floats: usize) -> usize {
        let copies = usize::from(self.checkpoint.is_some()) + usize::from(self.pinned.is_some());
        (1 + copies) * self.recurrent.len() * floats * 4
    }

    /// With a routing trace set on the model (benchmarks only, see
    /// [`TraceRouting::replace_in`](crate::trace_routing::TraceRouting::replace_in)): which
    /// stream of it this sequence replays, so that the sequences of a batch route as different
    /// texts. 0 (the default) is the stream a lone sequence replays.
    pub fn set_trace_stream(&mut self, stream: usize) {
        self.stream = stream;
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

/// Copies `recurrent` into `slot` (made on first use), marked as holding position `pos`.
fn save<B: Backend>(be: &B, floats: usize, recurrent: &[B::Buf], slot: &mut Option<(usize, Vec<B::Buf>)>, pos: usize) {
    let (at, saved) = slot.get_or_insert_with(|| (0, recurrent.iter().map(|_| be.buf("recurrent checkpoint", floats)).collect()));
    for (dst, src) in saved.iter_mut().zip(recurrent) {
        be.copy_strided(src, floats, 0, dst, floats, 0, floats, 1);
    }
    *at = pos;
}

impl<B: Backend> Model<B> {
    /// Marks `pos` on `st`, a sequence of a model with recurrent states (nothing otherwise):
    /// the step that ends there keeps a copy of its states ([`State::truncate`] and
    /// [`State::copy_prefix`] can then resume there), at once if the sequence is there now. The
    /// caller makes a step end there (see [`Stepwise::keep_state_at`](crate::Stepwise::keep_state_at)).
    pub fn keep_state_at(&self, st: &mut State<B>, pos: usize) {
        if st.recurrent.is_empty() || pos == 0 || st.pinned.as_ref().is_some_and(|(c, _)| *c == pos) {
            return;
        }
        if st.pos == pos {
            st.before_step(&self.backend, self.recurrent_floats());
            save(&self.backend, self.recurrent_floats(), &st.recurrent, &mut st.pinned, pos);
        } else if pos > st.pos {
            st.pin = Some(pos);
        }
    }

    /// The prefill chunk: the backend's ([`Backend::prefill_chunk`]), or at least
    /// [`STREAMING_PREFILL_CHUNK`] when the expert cache cannot hold every routed expert.
    pub fn prefill_chunk(&self) -> usize {
        // Layers whose experts the backend keeps (in VRAM) never ask the store.
        let streamed_layers =
            self.layers.iter().zip(&self.kept).filter(|(l, &kept)| !kept && matches!(l.ffn, crate::model::FeedForward::Moe(_))).count();
        let routed = streamed_layers * self.arch.moe.num_experts;
        // The cache's current size (the memory watch may shrink it; a server reads this once).
        let streams = routed > 0 && self.experts.cache_capacity().is_some_and(|c| c.slots < routed);
        let chunk = self.backend.prefill_chunk();
        if streams {
            chunk.max(STREAMING_PREFILL_CHUNK)
        } else {
            chunk
        }
    }
    /// A fresh sequence that runs prefill in chunks of up to `chunk` tokens
    /// ([`prefill_chunk`](Self::prefill_chunk) unless there is a reason to differ). A sequence
    /// that only runs in [`Batch`](crate::Batch)es needs no buffers of its own: `chunk` 1.
    pub fn new_state(&self, chunk: usize) -> State<B> {
        State {
            kv: self.backend.kv_cache(&self.kv_shapes()),
            recurrent: (0..self.linear_layers().len()).map(|_| self.backend.buf("recurrent state", self.recurrent_floats())).collect(),
            checkpoint: None,
            pinned: None,
            pin: None,
            restore_pinned: false,
            pos: 0,
            rewind: self.kv_rewind(),
            stream: 0,
            work: self.work(chunk, false),
            logits: Vec::new(),
            instrument: None,
        }
    }

    /// Working memory for steps of up to `chunk` rows; `batch`: of several sequences (with the
    /// scratch that attention needs to take a sequence's rows apart).
    pub(crate) fn work(&self, chunk: usize, batch: bool) -> Work<B> {
        let c = chunk.max(1);
        let be = &self.backend;
        let w = Widths::of(&self.arch, self.router.top_k());
        let mk = |name: &'static str, width: usize| be.buf(name, c * width);
        Work {
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
                routes: mk("routes", if self.kept_layers() > 0 { self.arch.num_layers * 2 * self.router.top_k() } else { 0 }),
                logits: mk("logits", w.logits),
                idx_q: mk("idx_q", w.idx_q),
                idx_k: mk("idx_k", w.idx_k),
                idx_w: mk("idx_w", w.idx_w),
                hc: mk("hc", w.hc),
                hcn: mk("hcn", w.hcn),
                mix: mk("mix", w.mix),
                raw: mk("raw", w.raw),
                grp: mk("grp", w.grp),
                seg_q: mk("seg_q", if batch { w.q } else { 0 }),
                seg_att: mk("seg_att", if batch { w.att } else { 0 }),
            },
            host: HostScratch::default(),
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
        if want == Logits::All {
            st.logits.clear();
            st.logits.reserve(tokens.len() * vocab);
        }
        // (The last row's logits overwrite the vector in place: clearing it each decoded token
        // had cost a 600 KB memset before the copy, for a 152k vocabulary.)
        let chunks = tokens.len().div_ceil(st.work.chunk);
        for (i, chunk) in tokens.chunks(st.work.chunk).enumerate() {
            // Only the last chunk's last row is wanted for `Last`: earlier chunks skip the LM
            // head (a 152k-row product, 330 MB of Q8_0 for Qwen3-30B-A3B, once per chunk).
            let here = match want {
                Logits::Last if i + 1 < chunks => None,
                w => Some(w),
            };
            self.forward_chunk(st, chunk, here, obs)?;
        }
        if let Some(fault) = self.backend.fault() {
            return Err(EngineError::Backend(fault));
        }
        Ok(&st.logits)
    }

    fn forward_chunk(&self, st: &mut State<B>, tokens: &[u32], want: Option<Logits>, obs: &mut dyn Observer) -> Result<(), EngineError> {
        let be = &self.backend;
        let n = tokens.len();
        let t0 = Instant::now();
        if let Some(ins) = st.instrument.as_mut() {
            ins.begin(n, self.experts.stats());
        }
        st.before_step(be, self.recurrent_floats());
        let State { kv, recurrent, pos, stream, work, logits, instrument, .. } = st;
        let mut one = [Seg { kv, rec: recurrent, pos: *pos, stream: *stream, row: 0, n }];
        let mut s = Step::new(&mut work.buf, &mut work.host, instrument, &mut one);
        self.layers_of_step(&mut s, tokens, obs)?;
        match want {
            None => {}
            Some(Logits::All) => {
                let (b, vocab) = (&mut *s.buf, self.arch.vocab_size);
                be.matmul(self.lm_head.as_ref().unwrap_or(&self.embed), None, &b.h, n, &mut b.logits);
                let start = logits.len();
                logits.resize(start + n * vocab, 0.0);
                be.download(&b.logits, 0, &mut logits[start..]);
            }
            Some(Logits::Last) => self.last_logits(&mut s, logits),
        }
        st.pos += n;
        st.after_step(be, self.recurrent_floats(), n);
        if let Some(ins) = st.instrument.as_mut() {
            ins.end(ms(t0), self.experts.stats());
        }
        Ok(())
    }

    /// The step's tokens (its sequences' rows, one after another as `s.segs` says) through
    /// every layer and the final norm, into `h`. Each row gets its own sequence's position.
    pub(crate) fn layers_of_step(&self, s: &mut Step<'_, '_, B>, tokens: &[u32], obs: &mut dyn Observer) -> Result<(), EngineError> {
        let (be, n, hd) = (&self.backend, tokens.len(), self.arch.hidden_size);
        be.embed(&self.embed, tokens, &mut s.buf.x);
        let h = &mut *s.host;
        h.positions.clear();
        h.streams.clear();
        for seg in s.segs.iter() {
            h.positions.extend(seg.pos..seg.pos + seg.n);
            h.streams.extend(std::iter::repeat_n(seg.stream, seg.n));
        }
        self.rope.fill(&h.positions, &mut h.cos, &mut h.sin);
        h.tokens.clear();
        h.tokens.extend_from_slice(tokens);
        if let Some(cr) = &self.compress_rope {
            cr.fill(&h.positions, &mut h.ccos, &mut h.csin);
            h.nsin.clear();
            h.nsin.extend(h.sin.iter().map(|v| -v));
            h.ncsin.clear();
            h.ncsin.extend(h.csin.iter().map(|v| -v));
        }
        if let Some(hc) = &self.arch.hyper_connections {
            // Every stream starts as the token's embedding.
            let b = &mut *s.buf;
            for j in 0..hc.mult {
                be.copy_strided(&b.x, hd, 0, &mut b.hc, hc.mult * hd, j * hd, hd, n);
            }
        }
        let mut routed_kept = false;
        for (li, layer) in self.layers.iter().enumerate() {
            routed_kept |= self.layer(li, layer, s, n, obs)?;
        }
        if routed_kept && s.instrument.is_some() {
            self.instrument_kept_routes(s, n);
        }
        if let (Some(hc), Some(head)) = (&self.arch.hyper_connections, &self.hc_head) {
            // The streams collapse into one before the final norm.
            self.hc_project(head, s, n);
            let hs = &mut *s.host;
            crate::hyper::head_weights(&hs.mixes, n, hc.mult, &head.base, head.scale[0], hc.eps as f32, &mut hs.pre);
            be.hc_collapse(&s.buf.hc, n, hc.mult, hd, &hs.pre, &mut s.buf.x);
        }
        let b = &mut *s.buf;
        if !std::mem::take(&mut s.normed_ahead) {
            be.rms_norm(&b.x, n, hd, &self.final_norm, self.eps, &mut b.h);
        }
        Ok(())
    }

    /// The LM head over the last row of each of the step's sequences (`h` after
    /// [`layers_of_step`](Self::layers_of_step)), into `out` as `[sequences, vocab]`.
    pub(crate) fn last_logits(&self, s: &mut Step<'_, '_, B>, out: &mut Vec<f32>) {
        let (be, hd, vocab) = (&self.backend, self.arch.hidden_size, self.arch.vocab_size);
        let (b, h) = (&mut *s.buf, &mut *s.host);
        h.last_rows.clear();
        h.last_rows.extend(s.segs.iter().map(|seg| seg.row + seg.n - 1));
        be.gather_rows(&b.h, hd, &h.last_rows, &mut b.tmp);
        let head = self.lm_head.as_ref().unwrap_or(&self.embed);
        be.matmul(head, None, &b.tmp, h.last_rows.len(), &mut b.logits);
        out.resize(h.last_rows.len() * vocab, 0.0);
        be.download(&b.logits, 0, out);
    }

    /// The instrument's view of the routes chosen on the backend in this chunk's kept layers
    /// (read back once, after the last layer).
    fn instrument_kept_routes(&self, s: &mut Step<'_, '_, B>, n: usize) {
        let k = self.router.top_k();
        let mut host = vec![0f32; self.arch.num_layers * n * 2 * k];
        self.backend.download(&s.buf.routes, 0, &mut host);
        let Some(ins) = s.instrument.as_mut() else { return };
        let mut ids = vec![0u32; k];
        for (li, _) in self.kept.iter().enumerate().filter(|(_, &kept)| kept) {
            for t in 0..n {
                let row = &host[(li * n + t) * 2 * k..][..k];
                for (id, &v) in ids.iter_mut().zip(row) {
                    *id = v as u32;
                }
                ins.route(li, &ids);
            }
        }
    }

    /// One decoder layer: attention of `h = norm(x)` added into `x`, then (after the lookahead,
    /// when on) the feed-forward block of `h = norm(x)` added into `x`. Returns whether its
    /// experts were routed on the backend.
    fn layer(&self, li: usize, layer: &Layer<B>, s: &mut Step<'_, '_, B>, n: usize, obs: &mut dyn Observer) -> Result<bool, EngineError> {
        if layer.hc.is_some() {
            return self.hyper_layer(li, layer, s, n, obs);
        }
        let be = &self.backend;
        let hd = self.arch.hidden_size;
        let t = Instant::now();
        if !std::mem::take(&mut s.normed_ahead) {
            be.rms_norm(&s.buf.x, n, hd, &layer.attn_norm, self.eps, &mut s.buf.h);
        }
        // Standard attention's output projection goes with the residual add and the next norm
        // (one op, which a backend may run as one launch) where no bias sits between them.
        let mut projection = None;
        match &layer.attn {
            Attention::Standard(a) if a.o_bias.is_none() => {
                self.standard_attention_heads(li, a, s, n);
                projection = Some(&a.o);
            }
            Attention::Standard(a) => self.standard_attention(li, a, s, n),
            Attention::Linear(a) => self.linear_attention(a, s, n),
            Attention::Latent(a) => self.latent_attention(li, a, s, n, obs),
            Attention::Compressed(a) => self.compressed_attention(li, a, s, n, obs),
        }
        let b = &mut *s.buf;
        match projection {
            Some(o) => be.matmul_add_rms_norm(o, &b.att, n, hd, &mut b.d, &mut b.x, &layer.ffn_norm, self.eps, &mut b.h),
            None => be.add_rms_norm(&mut b.x, &b.d, n, hd, &layer.ffn_norm, self.eps, &mut b.h),
        }
        s.charge(t, |r| &mut r.attention_ms);
        if self.lookahead {
            self.lookahead_prefetch(li, s, n);
        }
        match &layer.ffn {
            FeedForward::Dense(m) => {
                let t = Instant::now();
                self.mlp(m, s, n);
                be.add(&mut s.buf.x, &s.buf.d, n * hd);
                s.charge(t, |r| &mut r.expert_ms);
            }
            FeedForward::Moe(m) => return self.moe(li, m, s, n, obs),
        }
        Ok(false)
    }

    /// A decoder layer over DeepSeek-V4's hyper-connection streams (`hc`): before each block the
    /// streams are mixed ([`hc_weights`](Self::hc_weights)) and collapsed into the block's input
    /// (in `x`, normed into `h`), after it the block's output spreads back over them
    /// ([`Backend::hc_expand`]). The MoE block accumulates its output into a cleared `x`.
    fn hyper_layer(
        &self,
        li: usize,
        layer: &Layer<B>,
        s: &mut Step<'_, '_, B>,
        n: usize,
        obs: &mut dyn Observer,
    ) -> Result<bool, EngineError> {
        let (be, hd) = (&self.backend, self.arch.hidden_size);
        let mult = self.arch.hyper_connections.as_ref().map_or(1, |h| h.mult);
        let [attn_mix, ffn_mix] = layer.hc.as_ref().expect("a hyper-connection layer without its mixings");
        let t = Instant::now();
        self.hc_weights(attn_mix, s, n);
        be.hc_collapse(&s.buf.hc, n, mult, hd, &s.host.pre, &mut s.buf.x);
        be.rms_norm(&s.buf.x, n, hd, &layer.attn_norm, self.eps, &mut s.buf.h);
        match &layer.attn {
            Attention::Standard(a) => self.standard_attention(li, a, s, n),
            Attention::Linear(a) => self.linear_attention(a, s, n),
            Attention::Latent(a) => self.latent_attention(li, a, s, n, obs),
            Attention::Compressed(a) => self.compressed_attention(li, a, s, n, obs),
        }
        be.hc_expand(&mut s.buf.hc, &s.buf.d, n, mult, hd, &s.host.post, &s.host.comb);
        self.hc_weights(ffn_mix, s, n);
        be.hc_collapse(&s.buf.hc, n, mult, hd, &s.host.pre, &mut s.buf.x);
        be.rms_norm(&s.buf.x, n, hd, &layer.ffn_norm, self.eps, &mut s.buf.h);
        s.charge(t, |r| &mut r.attention_ms);
        s.host.zeros.resize(n, 0.0);
        be.scale_rows(&mut s.buf.x, hd, &s.host.zeros);
        let kept = match &layer.ffn {
            FeedForward::Dense(m) => {
                let t = Instant::now();
                self.mlp(m, s, n);
                be.add(&mut s.buf.x, &s.buf.d, n * hd);
                s.charge(t, |r| &mut r.expert_ms);
                false
            }
            FeedForward::Moe(m) => self.moe(li, m, s, n, obs)?,
        };
        be.hc_expand(&mut s.buf.hc, &s.buf.x, n, mult, hd, &s.host.post, &s.host.comb);
        Ok(kept)
    }

    /// `mix`'s projection of the RMS-normed streams, on the host in `host.mixes`.
    fn hc_project(&self, mix: &HyperMix<B>, s: &mut Step<'_, '_, B>, n: usize) {
        let (be, hd) = (&self.backend, self.arch.hidden_size);
        let mult = self.arch.hyper_connections.as_ref().map_or(1, |h| h.mult);
        let ones = self.ones_streams.as_ref().expect("hyper-connections without their norm");
        let b = &mut *s.buf;
        be.rms_norm(&b.hc, n, mult * hd, ones, self.eps, &mut b.hcn);
        be.matmul(&mix.proj, None, &b.hcn, n, &mut b.mix);
        let width = mix.base.len();
        s.host.mixes.resize(n * width, 0.0);
        be.download(&b.mix, 0, &mut s.host.mixes);
    }

    /// One block's hyper-connection weights (`host.pre`, `host.post`, `host.comb`), see
    /// [`crate::hyper::block_weights`].
    fn hc_weights(&self, mix: &HyperMix<B>, s: &mut Step<'_, '_, B>, n: usize) {
        let hc = self.arch.hyper_connections.as_ref().expect("hyper-connections");
        self.hc_project(mix, s, n);
        let h = &mut *s.host;
        crate::hyper::block_weights(
            &h.mixes,
            n,
            hc.mult,
            &mix.base,
            &mix.scale,
            hc.sinkhorn_iters,
            hc.eps as f32,
            &mut h.pre,
            &mut h.post,
            &mut h.comb,
        );
    }

    /// DeepSeek-V4's attention of `h`; leaves the projected output in `d`. Queries from the
    /// normalised latent (`k`) through `q_b`, each head RMS-normed and its last dimensions
    /// rotated; the shared key=value row normed, rotated and cached; a compressed layer's
    /// compressor (and a CSA layer's indexer, which picks each query's entries) run; then the
    /// attention over window and entries, the output's rotation undone, and the grouped output
    /// projection.
    fn compressed_attention(&self, li: usize, a: &CompressedAttn<B>, s: &mut Step<'_, '_, B>, n: usize, obs: &mut dyn Observer) {
        let (be, ar) = (&self.backend, &self.arch);
        let ca = ar.compressed_attention.as_ref().expect("compressed attention without its description");
        let (nh, hd, r, rd) = (ar.num_heads, ar.head_dim, ca.q_lora_rank, ar.rope.rotary_dim);
        let compressed = ca.compression[li].rate() > 0;
        let b = &mut *s.buf;
        be.matmul(&a.q_a, None, &b.h, n, &mut b.k);
        be.rms_norm_strided(&mut b.k, n, r, 0, r, &a.q_a_norm, self.eps);
        be.matmul(&a.q_b, None, &b.k, n, &mut b.q);
        be.rms_norm_heads(&mut b.q, n, nh * hd, 0, nh, hd, self.ones_head.as_ref().expect("unweighted norm"), self.eps);
        let h = &*s.host;
        let (cos, sin) = if compressed { (&h.ccos, &h.csin) } else { (&h.cos, &h.sin) };
        be.rope(&mut b.q, n, nh * hd, hd - rd, nh, hd, cos, sin, true);
        be.matmul(&a.kv, None, &b.h, n, &mut b.v);
        be.rms_norm_strided(&mut b.v, n, hd, 0, hd, &a.kv_norm, self.eps);
        be.rope(&mut b.v, n, hd, hd - rd, 1, hd, cos, sin, true);
        for seg in s.segs.iter_mut() {
            be.kv_store(seg.kv, li, seg.pos, seg.n, &b.v, hd, seg.row * hd, None);
        }
        if let Some(c) = &a.compressor {
            self.compress(c, s, n);
        }
        if let Some(ix) = &a.indexer {
            self.compress(&ix.compressor, s, n);
            let (ih, id, top) = (ca.index_heads, ca.index_head_dim, ca.index_top_k);
            let (b, h) = (&mut *s.buf, &mut *s.host);
            be.matmul(&ix.q, None, &b.k, n, &mut b.idx_q);
            be.rope(&mut b.idx_q, n, ih * id, id - rd, ih, id, &h.ccos, &h.csin, true);
            be.matmul(&ix.weights, None, &b.h, n, &mut b.idx_w);
            // transformers scales the scores by 1/sqrt(head_dim) and the head weights by
            // 1/sqrt(heads); through the ReLU both are one positive factor on the weights.
            h.index_scale.clear();
            h.index_scale.resize(n, 1.0 / ((ih * id) as f32).sqrt());
            be.scale_rows(&mut b.idx_w, ih, &h.index_scale);
            h.selection.resize_with(s.segs.len(), Vec::new);
            let rate = ix.compressor.rate;
            for (seg, sel) in s.segs.iter_mut().zip(h.selection.iter_mut()) {
                sel.clear();
                sel.resize(seg.n * top, u32::MAX);
                let at = IndexQueries { row0: seg.row, n: seg.n, pos0: seg.pos, heads: ih, top, rate };
                be.index_select(seg.kv, ix.compressor.entry_layer, &b.idx_q, &b.idx_w, at, sel);
                for (t, row) in sel.chunks(top).enumerate().filter(|(t, _)| at.seen(seg.pos + t) > 0) {
                    obs.selected(li, seg.pos + t, row);
                }
            }
        }
        let (b, host) = (&mut *s.buf, &*s.host);
        let w = nh * hd;
        for (i, seg) in s.segs.iter_mut().enumerate() {
            let selected = match (&a.indexer, host.selection.get(i)) {
                (Some(_), Some(sel)) => Some(Selection { positions: sel, per_query: ca.index_top_k }),
                _ => None,
            };
            let p = CompressedParams {
                q_heads: nh,
                scale: self.attn_scale,
                window: ca.window,
                sinks: &a.sinks,
                entries: a.compressor.as_ref().map(|c| (c.entry_layer, c.rate)),
                selected,
            };
            let (n, pos) = (seg.n, seg.pos);
            self.attend(seg, b, w, w, |_, _| {}, |kv, q, out| be.attention_compressed(kv, li, q, n, pos, p, out));
        }
        // Keys are values, so the output carries the keys' rotation: turned back by the query's
        // own position.
        let nsin = if compressed { &host.ncsin } else { &host.nsin };
        let cos = if compressed { &host.ccos } else { &host.cos };
        be.rope(&mut b.att, n, w, hd - rd, nh, hd, cos, nsin, true);
        let (g, olr) = (ca.o_groups, ca.o_lora_rank);
        let gw = w / g;
        if n == 1 {
            // One token's attention row is its g groups' rows of gw one after another: the
            // grouped projection is one batch of g products, each on its own row, with no
            // copies (a decoded token's 3 g launches were a tenth of its launches).
            let jobs: Vec<MatJob<'_, B::Matrix>> = (0..g)
                .map(|grp| MatJob {
                    w: WeightRef::Resident(&a.o_a, Some((grp * olr, olr))),
                    x_row: grp,
                    n: 1,
                    out_row: 0,
                    out_col: grp * olr,
                })
                .collect();
            be.matmul_many(&jobs, &b.att, gw, &mut b.grp, g * olr);
        } else {
            for grp in 0..g {
                be.copy_strided(&b.att, w, grp * gw, &mut b.tmp, gw, 0, gw, n);
                be.matmul(&a.o_a, Some((grp * olr, olr)), &b.tmp, n, &mut b.tmp2);
                be.copy_strided(&b.tmp2, olr, 0, &mut b.grp, g * olr, grp * olr, olr, n);
            }
        }
        be.matmul(&a.o_b, None, &b.grp, n, &mut b.d);
    }

    /// One DeepSeek-V4 compressor over `h`: each sequence's `[kv | gate]` rows cached, and the
    /// windows its new positions close compressed into entries ([`Backend::compress_windows`],
    /// each entry rotated at its window's first position).
    fn compress(&self, c: &Compressor<B>, s: &mut Step<'_, '_, B>, n: usize) {
        let be = &self.backend;
        let width = if c.overlap { 2 * c.dim } else { c.dim };
        let jobs = [
            MatJob { w: WeightRef::Resident(&c.kv, None), x_row: 0, n, out_row: 0, out_col: 0 },
            MatJob { w: WeightRef::Resident(&c.gate, None), x_row: 0, n, out_row: 0, out_col: width },
        ];
        let (b, h) = (&mut *s.buf, &mut *s.host);
        be.matmul_many(&jobs, &b.h, self.arch.hidden_size, &mut b.raw, 2 * width);
        let rope = self.compress_rope.as_ref().expect("a compressor without its RoPE");
        for seg in s.segs.iter_mut() {
            be.kv_store(seg.kv, c.raw_layer, seg.pos, seg.n, &b.raw, 2 * width, seg.row * 2 * width, None);
            let (first, end) = (seg.pos / c.rate, (seg.pos + seg.n) / c.rate);
            if end == first {
                continue;
            }
            h.wpos.clear();
            h.wpos.extend((first..end).map(|w| w * c.rate));
            rope.fill(&h.wpos, &mut h.wcos, &mut h.wsin);
            let windows = CompressWindows {
                raw_layer: c.raw_layer,
                entry_layer: c.entry_layer,
                first,
                count: end - first,
                rate: c.rate,
                dim: c.dim,
                overlap: c.overlap,
                bias: &c.bias,
                norm: &c.norm,
                eps: self.eps,
                rope: RopeTables { cos: &h.wcos, sin: &h.wsin, interleaved: true },
            };
            be.compress_windows(seg.kv, windows);
        }
    }

    /// Predicts the next MoE layer's experts by routing the current hidden state (after this
    /// layer's attention, normed with the next layer's FFN norm into `xe`) through the next
    /// layer's router, and asks the store to start reading them, in the order the tokens first
    /// chose them.
    fn lookahead_prefetch(&self, li: usize, s: &mut Step<'_, '_, B>, n: usize) {
        let Some(next) = self.layers.get(li + 1) else { return };
        let FeedForward::Moe(m) = &next.ffn else { return };
        if self.kept[li + 1] {
            return;
        }
        let (b, hs) = (&mut *s.buf, &mut *s.host);
        self.backend.rms_norm(&b.x, n, self.arch.hidden_size, &next.ffn_norm, self.eps, &mut b.xe);
        let predicted = &mut hs.predicted;
        predicted.clear();
        self.route_tokens(m, &hs.tokens, None, &b.xe, &mut b.router, &mut hs.routes, n, |_, experts, _, _| {
            for &e in experts {
                if !predicted.contains(&e) {
                    predicted.push(e);
                }
            }
        });
        self.experts.prefetch(li + 1, predicted);
    }

    /// GQA attention; leaves the projected output in `d`.
    fn standard_attention(&self, li: usize, a: &StandardAttention<B>, s: &mut Step<'_, '_, B>, n: usize) {
        self.standard_attention_heads(li, a, s, n);
        let (be, b) = (&self.backend, &mut *s.buf);
        be.matmul(&a.o, None, &b.att, n, &mut b.d);
        if let Some(ob) = &a.o_bias {
            be.add_bias(&mut b.d, n, self.arch.hidden_size, 0, ob);
        }
    }

    /// GQA attention up to its output projection: the heads' outputs in `att`. q, k and v come
    /// from one dispatch into one row per token, `[q | k | v]`.
    fn standard_attention_heads(&self, li: usize, a: &StandardAttention<B>, s: &mut Step<'_, '_, B>, n: usize) {
        let (be, ar) = (&self.backend, &self.arch);
        let b = &mut *s.buf;
        let (nh, nkv, hdim) = (ar.num_heads, ar.num_kv_heads, ar.head_dim);
        let (qw, kvw) = (nh * hdim, nkv * hdim);
        // Qwen3-Next's output gate rides after [q | k | v] in the same rows.
        let w = qw + 2 * kvw + if a.gate.is_some() { qw } else { 0 };
        let jobs = [
            MatJob { w: WeightRef::Resident(&a.q, None), x_row: 0, n, out_row: 0, out_col: 0 },
            MatJob { w: WeightRef::Resident(&a.k, None), x_row: 0, n, out_row: 0, out_col: qw },
            MatJob { w: WeightRef::Resident(&a.v, None), x_row: 0, n, out_row: 0, out_col: qw + kvw },
            MatJob { w: WeightRef::Resident(a.gate.as_ref().unwrap_or(&a.q), None), x_row: 0, n, out_row: 0, out_col: qw + 2 * kvw },
        ];
        be.matmul_many(&jobs[..if a.gate.is_some() { 4 } else { 3 }], &b.h, ar.hidden_size, &mut b.q, w);
        if let Some([qb, kb, vb]) = &a.bias {
            be.add_bias(&mut b.q, n, w, 0, qb);
            be.add_bias(&mut b.q, n, w, qw, kb);
            be.add_bias(&mut b.q, n, w, qw + kvw, vb);
        }
        let per_head = match &a.qk_norm {
            Some((smoe_vault::QkNorm::PerHead, qn, kn)) => Some((qn, kn, self.eps)),
            Some((_, qn, kn)) => {
                be.rms_norm_strided(&mut b.q, n, w, 0, qw, qn, self.eps);
                be.rms_norm_strided(&mut b.q, n, w, qw, kvw, kn, self.eps);
                None
            }
            None => None,
        };
        let rows = QkvRows { stride: w, q_heads: nh, kv_heads: nkv, head_dim: hdim };
        let (half, host) = (self.rope.half(), &*s.host);
        let params = AttnParams { q_heads: nh, scale: self.attn_scale, window: a.window, sinks: a.sinks.as_deref(), selected: None };
        if s.segs.len() > 1 && be.batches_attention(&params) {
            // Every sequence's norms, RoPE and KV store, then its attention, in one call each.
            let rope = RopeTables { cos: &host.cos[..n * half], sin: &host.sin[..n * half], interleaved: self.rope.interleaved };
            // Collected into a temporary: its mutable borrows of the caches end with the call.
            let stores = s.segs.iter_mut().map(|seg| SeqStore { cache: &mut *seg.kv, row: seg.row, n: seg.n, pos0: seg.pos });
            be.qk_rope_store_batch(&mut b.q, n, rows, per_head, rope, &mut stores.collect::<Vec<_>>(), li);
            let seqs: Vec<SeqQueries<'_, B::KvCache>> =
                s.segs.iter().map(|seg| SeqQueries { cache: &*seg.kv, row: seg.row, n: seg.n, pos0: seg.pos }).collect();
            be.attention_batch(li, &seqs, &b.q, w, params, &mut b.att);
        } else {
            for seg in s.segs.iter_mut() {
                // This sequence's rows of the step's RoPE tables.
                let span = seg.row * half..(seg.row + seg.n) * half;
                let rope = RopeTables { cos: &host.cos[span.clone()], sin: &host.sin[span], interleaved: self.rope.interleaved };
                let (n, pos) = (seg.n, seg.pos);
                let prepare = |q: &mut B::Buf, kv: &mut B::KvCache| be.qk_rope_store(q, n, rows, per_head, rope, kv, li, pos);
                self.attend(seg, b, w, qw, prepare, |kv, q, out| be.attention(kv, li, q, w, n, pos, params, out));
            }
        }
        if a.gate.is_some() {
            be.sigmoid_gate(&mut b.att, n, qw, &b.q, w, qw + 2 * kvw);
        }
    }

    /// Gated DeltaNet (Qwen3-Next); leaves the projected output in `d`. The four input
    /// projections go into one row per token, `[q | k | v | z | b | a]`; each sequence of the
    /// step then runs the recurrence over its own rows and state.
    fn linear_attention(&self, a: &LinearAttn<B>, s: &mut Step<'_, '_, B>, n: usize) {
        let be = &self.backend;
        let p = self.delta_params(a);
        let (c, vw, vh) = (p.channels(), p.value_heads * p.value_dim, p.value_heads);
        let b = &mut *s.buf;
        let jobs = [
            MatJob { w: WeightRef::Resident(&a.qkv, None), x_row: 0, n, out_row: 0, out_col: 0 },
            MatJob { w: WeightRef::Resident(&a.z, None), x_row: 0, n, out_row: 0, out_col: c },
            MatJob { w: WeightRef::Resident(&a.b, None), x_row: 0, n, out_row: 0, out_col: c + vw },
            MatJob { w: WeightRef::Resident(&a.a, None), x_row: 0, n, out_row: 0, out_col: c + vw + vh },
        ];
        be.matmul_many(&jobs, &b.h, self.arch.hidden_size, &mut b.q, p.stride());
        for seg in s.segs.iter_mut() {
            be.gated_delta_net(p, &b.q, seg.row, seg.n, &mut seg.rec[a.slot], seg.pos == 0, &mut b.att);
        }
        be.matmul(&a.out, None, &b.att, n, &mut b.d);
    }

    /// Attention of one sequence of the step over its own KV cache: its queries are rows
    /// `seg.row..seg.row + seg.n` of `q` (`q_stride` apart), its output goes to the same rows
    /// of `att` (`att_w` wide). `prepare` runs first on the buffer the queries are read from
    /// (standard attention's norms, RoPE and KV store), then `run` (the attention op: cache,
    /// queries, output). The attention ops read queries from row 0 of a buffer and write from
    /// row 0, so a sequence after the first of a batch moves its rows to `seg_q` and its output
    /// back from `seg_att`: it then runs exactly the ops it runs alone, on the same values (a
    /// copy of a few rows per sequence and layer; the first sequence, and a sequence alone,
    /// copies nothing).
    fn attend(
        &self,
        seg: &mut Seg<'_, B>,
        b: &mut Buffers<B>,
        q_stride: usize,
        att_w: usize,
        prepare: impl FnOnce(&mut B::Buf, &mut B::KvCache),
        run: impl FnOnce(&B::KvCache, &B::Buf, &mut B::Buf),
    ) {
        let be = &self.backend;
        if seg.row == 0 {
            prepare(&mut b.q, seg.kv);
            run(seg.kv, &b.q, &mut b.att);
            return;
        }
        be.copy_strided(&b.q, q_stride, seg.row * q_stride, &mut b.seg_q, q_stride, 0, q_stride, seg.n);
        prepare(&mut b.seg_q, seg.kv);
        run(seg.kv, &b.seg_q, &mut b.seg_att);
        be.copy_strided(&b.seg_att, att_w, 0, &mut b.att, att_w, seg.row * att_w, att_w, seg.n);
    }

    /// Absorbed multi-head latent attention; leaves the projected output in `d`.
    fn latent_attention(&self, li: usize, a: &LatentAttention<B>, s: &mut Step<'_, '_, B>, n: usize, obs: &mut dyn Observer) {
        let (be, ar) = (&self.backend, &self.arch);
        let m = ar.mla.as_ref().expect("latent attention without MLA dims");
        let b = &mut *s.buf;
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
        let (cos, sin, il) = (&s.host.cos, &s.host.sin, self.rope.interleaved);
        be.rope(&mut b.v, n, lat, rank, 1, 0, cos, sin, il);
        for seg in s.segs.iter_mut() {
            be.kv_store(seg.kv, li, seg.pos, seg.n, &b.v, lat, seg.row * lat, None);
        }
        be.rope(&mut b.tmp, n, nh * qk, nope, nh, qk, cos, sin, il);
        // Absorb W_uk into the queries: q_eff[h] = [W_uk[h]ᵀ q_nope[h] | q_rope[h]].
        for h in 0..nh {
            be.matmul_t(&a.kv_b, h * (nope + vdim), nope, &b.tmp, nh * qk, h * qk, n, &mut b.tmp2);
            be.copy_strided(&b.tmp2, rank, 0, &mut b.q, nh * lat, h * lat, rank, n);
            be.copy_strided(&b.tmp, nh * qk, h * qk + nope, &mut b.q, nh * lat, h * lat + rank, rope, n);
        }
        if let Some(ix) = &a.indexer {
            self.index_select(li, ix, s, n, obs);
        }
        let (b, host) = (&mut *s.buf, &*s.host);
        let top = ar.sparse_attention.as_ref().map_or(0, |sa| sa.top_k);
        let dense = AttnParams { q_heads: nh, scale: self.attn_scale, window: None, sinks: None, selected: None };
        let selects = top > 0 && host.selection.iter().take(s.segs.len()).any(|sel| !sel.is_empty());
        if s.segs.len() > 1 && !selects && be.batches_attention(&dense) {
            // Every sequence's queries in one call (they share the parameters: no selection).
            let seqs: Vec<SeqQueries<'_, B::KvCache>> =
                s.segs.iter().map(|seg| SeqQueries { cache: &*seg.kv, row: seg.row, n: seg.n, pos0: seg.pos }).collect();
            be.attention_batch(li, &seqs, &b.q, nh * lat, dense, &mut b.att);
        } else {
            for (i, seg) in s.segs.iter_mut().enumerate() {
                let selected = match host.selection.get(i) {
                    Some(sel) if !sel.is_empty() && top > 0 => Some(Selection { positions: sel, per_query: top }),
                    _ => None,
                };
                let params = AttnParams { selected, ..dense };
                let (n, pos) = (seg.n, seg.pos);
                self.attend(seg, b, nh * lat, nh * rank, |_, _| {}, |kv, q, out| be.attention(kv, li, q, nh * lat, n, pos, params, out));
            }
        }
        // Expand each head's attended latent through W_uv[h].
        for h in 0..nh {
            be.copy_strided(&b.att, nh * rank, h * rank, &mut b.tmp2, rank, 0, rank, n);
            be.matmul(&a.kv_b, Some((h * (nope + vdim) + nope, vdim)), &b.tmp2, n, &mut b.tmp);
            be.copy_strided(&b.tmp, vdim, 0, &mut b.k, nh * vdim, h * vdim, vdim, n);
        }
        be.matmul(&a.o, None, &b.k, n, &mut b.d);
    }

    /// DeepSeek Sparse Attention's indexer (GLM-5): each sequence's indexer keys go into its
    /// cache, and the positions each of its queries attends to into `host.selection` (left
    /// empty, for dense attention, while no query sees more than `top_k` positions). Layers
    /// without their own indexer keep the latest selection. Reads the normalised query latent
    /// from `k` (the `q_a` path's output) and the normed input from `h`.
    fn index_select(&self, li: usize, ix: &Indexer<B>, s: &mut Step<'_, '_, B>, n: usize, obs: &mut dyn Observer) {
        let (be, ar) = (&self.backend, &self.arch);
        let sa = ar.sparse_attention.as_ref().expect("an indexer without sparse attention");
        let (heads, dim) = (sa.heads, sa.head_dim);
        // transformers scales the scores by 1/sqrt(head_dim) and the head weights by
        // 1/sqrt(heads); through the ReLU both are one positive factor on the weights.
        s.host.index_scale.clear();
        s.host.index_scale.resize(n, 1.0 / ((heads * dim) as f32).sqrt());
        let b = &mut *s.buf;
        be.matmul(&ix.k, None, &b.h, n, &mut b.idx_k);
        be.layer_norm_strided(&mut b.idx_k, n, dim, 0, dim, &ix.k_norm.0, &ix.k_norm.1, 1e-6);
        let (cos, sin) = (&s.host.cos, &s.host.sin);
        // Interleaved pairs over the first qk_rope_head_dim dimensions of the key and of every
        // query head (the same tables as the latent attention's).
        be.rope(&mut b.idx_k, n, dim, 0, 1, 0, cos, sin, true);
        let any_sparse = s.segs.iter().any(|seg| seg.pos + seg.n > sa.top_k);
        if any_sparse {
            be.matmul(&ix.q, None, &b.k, n, &mut b.idx_q);
            be.rope(&mut b.idx_q, n, heads * dim, 0, heads, dim, cos, sin, true);
            be.matmul(&ix.weights, None, &b.h, n, &mut b.idx_w);
            be.scale_rows(&mut b.idx_w, heads, &s.host.index_scale);
        }
        let host = &mut *s.host;
        host.selection.resize_with(s.segs.len(), Vec::new);
        for (seg, sel) in s.segs.iter_mut().zip(host.selection.iter_mut()) {
            be.kv_store(seg.kv, ix.cache_layer, seg.pos, seg.n, &b.idx_k, dim, seg.row * dim, None);
            sel.clear();
            if seg.pos + seg.n > sa.top_k {
                sel.resize(seg.n * sa.top_k, u32::MAX);
                let at = IndexQueries { row0: seg.row, n: seg.n, pos0: seg.pos, heads, top: sa.top_k, rate: 1 };
                be.index_select(seg.kv, ix.cache_layer, &b.idx_q, &b.idx_w, at, sel);
                for (t, row) in sel.chunks(sa.top_k).enumerate().filter(|(t, _)| seg.pos + t >= sa.top_k) {
                    obs.selected(li, seg.pos + t, row);
                }
            }
        }
    }

    /// SwiGLU MLP of `h` into `d`.
    fn mlp(&self, m: &Mlp<B>, s: &mut Step<'_, '_, B>, n: usize) {
        let be = &self.backend;
        let b = &mut *s.buf;
        be.matmul(&m.gate, None, &b.h, n, &mut b.g);
        be.matmul(&m.up, None, &b.h, n, &mut b.u);
        match self.arch.moe.expert_act {
            // DeepSeek-V4 clips its shared expert as its routed ones.
            ExpertAct::ClampedSilu { limit } => be.silu_mul_clamped(&mut b.g, &b.u, n * m.width, limit as f32),
            _ => be.silu_mul(&mut b.g, &b.u, n * m.width),
        }
        be.matmul(&m.down, None, &b.g, n, &mut b.d);
    }

    /// The MoE block of `h`, added into `x`: [`route_tokens`](Self::route_tokens), then the
    /// (token, slot) pairs [grouped by expert](ExpertGroups::group), the
    /// [routed experts](Self::routed_experts) and the [shared experts](Self::shared_experts).
    /// Routing counts as routing time, the rest as expert time. A few tokens of a layer whose
    /// experts the backend keeps go to [`kept_moe`](Self::kept_moe) instead; returns whether
    /// they did.
    fn moe(&self, li: usize, m: &MoeBlock<B>, s: &mut Step<'_, '_, B>, n: usize, obs: &mut dyn Observer) -> Result<bool, EngineError> {
        let t = Instant::now();
        let kept = self.kept[li] && m.tid2eid.is_none();
        if kept && self.backend.kept_takes(li, self.expert_limit(), n, s.run) && self.routing_trace.is_none() && !obs.wants_routes() {
            self.kept_moe(li, m, s, n);
            s.charge(t, |r| &mut r.expert_ms);
            return Ok(true);
        }
        if kept && self.routing_trace.is_none() && !obs.wants_routes() {
            self.route_on_backend(li, m, s, n);
        } else {
            let (ins, positions) = (&mut s.instrument, &s.host.positions);
            self.route_tokens(
                m,
                &s.host.tokens,
                Some((li, &s.host.streams)),
                &s.buf.h,
                &mut s.buf.router,
                &mut s.host.routes,
                n,
                |token, experts, weights, choice| {
                    obs.route(li, positions[token], experts, weights, choice);
                    if let Some(ins) = ins.as_mut() {
                        ins.route(li, experts);
                    }
                },
            );
        }
        s.charge(t, |r| &mut r.routing_ms);
        let t = Instant::now();
        s.host.groups.group(&s.host.routes.ids, self.arch.moe.num_experts, self.router.top_k());
        self.routed_experts(li, m, s, n)?;
        if let Some(shared) = &m.shared {
            self.shared_experts(shared, m.shared_gate.as_ref(), s, n);
        }
        s.charge(t, |r| &mut r.expert_ms);
        Ok(false)
    }

    /// Where the routed experts' activation is clamped (DeepSeek-V4's SiLU), as
    /// [`Backend::kept_experts`] takes it.
    fn expert_limit(&self) -> Option<f32> {
        match self.arch.moe.expert_act {
            ExpertAct::ClampedSilu { limit } => Some(limit as f32),
            _ => None,
        }
    }

    /// The MoE block of a layer whose experts the backend keeps, for a few tokens: router,
    /// routing and every (token, slot) product on the backend ([`Backend::route`],
    /// [`Backend::kept_experts`]), nothing read back: the decoder queues the next layer while
    /// the device runs this one.
    fn kept_moe(&self, li: usize, m: &MoeBlock<B>, s: &mut Step<'_, '_, B>, n: usize) {
        let (be, k) = (&self.backend, self.router.top_k());
        let b = &mut *s.buf;
        // This layer's routes, in its own rows of `routes` (see `instrument_kept_routes`).
        let at = li * n * 2 * k;
        self.router_and_route(m, &b.h, n, &mut b.router, &mut b.routes, at);
        let limit = self.expert_limit();
        // With no shared experts to add after them, the experts' op also runs the next norm.
        match (&m.shared, self.next_input_norm(li)) {
            (None, Some(w)) => {
                let hd = self.arch.hidden_size;
                be.kept_experts_norm(li, &b.routes, at, k, &mut b.h, n, &mut b.gu, &mut b.slots, &mut b.x, limit, hd, w, self.eps);
                s.normed_ahead = true;
            }
            (shared, _) => {
                be.kept_experts(li, &b.routes, at, k, &b.h, n, &mut b.gu, &mut b.slots, &mut b.x, limit);
                if let Some(shared) = shared {
                    self.shared_experts(shared, m.shared_gate.as_ref(), s, n);
                }
            }
        }
    }

    /// The norm the input of what follows layer `li` goes through first: the next layer's
    /// input norm, or after the last layer the final norm; None where something else comes
    /// first (hyper-connection streams: DeepSeek-V4).
    fn next_input_norm(&self, li: usize) -> Option<&B::Vector> {
        match self.layers.get(li + 1) {
            Some(next) => next.hc.is_none().then_some(&next.attn_norm),
            None => self.arch.hyper_connections.is_none().then_some(&self.final_norm),
        }
    }

    /// The routing of many tokens of a layer whose experts the backend keeps: router and
    /// [`Backend::route`] on the backend, only the chosen experts and weights (`[n, 2k]`)
    /// brought back for grouping. Routing on the host brought back every logit (`[n,
    /// experts]`) and then computed the softmax and top-k of each token while the device
    /// waited: a quarter of a 512-token prefill on the GPU. The backend's routes are the
    /// host's ([`Backend::route`]'s contract), so the groups are the same.
    fn route_on_backend(&self, li: usize, m: &MoeBlock<B>, s: &mut Step<'_, '_, B>, n: usize) {
        let (be, k) = (&self.backend, self.router.top_k());
        let (b, r) = (&mut *s.buf, &mut s.host.routes);
        let at = li * n * 2 * k;
        self.router_and_route(m, &b.h, n, &mut b.router, &mut b.routes, at);
        r.logits.resize(n * 2 * k, 0.0);
        be.download(&b.routes, at, &mut r.logits);
        r.ids.clear();
        r.weights.clear();
        for row in r.logits.chunks_exact(2 * k) {
            r.ids.extend(row[..k].iter().map(|&id| id as u32));
            r.weights.extend_from_slice(&row[k..]);
        }
        if let Some(ins) = s.instrument.as_mut() {
            for experts in r.ids.chunks_exact(k) {
                ins.route(li, experts);
            }
        }
    }

    /// [`Self::router_logits`] then [`Backend::route`] into `routes` from `at`, in one backend
    /// op ([`Backend::router_and_route`]) where the router has no logit bias to add between them.
    fn router_and_route(&self, m: &MoeBlock<B>, input: &B::Buf, n: usize, logits: &mut B::Buf, routes: &mut B::Buf, at: usize) {
        let bias = m.router_bias_kept.as_ref();
        if m.router_logit_bias.is_none() {
            return self.backend.router_and_route(&m.router, input, n, logits, &self.router, bias, routes, at);
        }
        self.router_logits(m, input, n, logits);
        self.backend.route(&self.router, logits, bias, n, routes, at);
    }

    /// `m`'s router over `n` rows of `input` into `logits` (`[n, experts]`), with the router's
    /// logit bias where it has one (gpt-oss).
    fn router_logits(&self, m: &MoeBlock<B>, input: &B::Buf, n: usize, logits: &mut B::Buf) {
        self.backend.matmul(&m.router, None, input, n, logits);
        if let Some(bias) = &m.router_logit_bias {
            self.backend.add_bias(logits, n, self.arch.moe.num_experts, 0, bias);
        }
    }

    /// Routing, shared by the MoE block and the lookahead: `m`'s router over `n` rows of `input`
    /// (`[n, hidden]`) into `logits` (`[n, experts]`), downloaded to the host, then each
    /// token's experts and mixing weights, chosen by the router rule, into `r.ids` and
    /// `r.weights`. `seen(token, experts, weights, choice)` sees each token as it is routed
    /// (`choice`: the scores the experts were chosen on, one per expert). With a routing trace
    /// set, the experts of decoder layer `layer` (the MoE block's own routing, not the
    /// lookahead's guess; with each row's trace stream) are the trace's.
    #[allow(clippy::too_many_arguments)]
    fn route_tokens(
        &self,
        m: &MoeBlock<B>,
        tokens: &[u32],
        layer: Option<(usize, &[usize])>,
        input: &B::Buf,
        logits: &mut B::Buf,
        r: &mut Routes,
        n: usize,
        mut seen: impl FnMut(usize, &[u32], &[f32], &[f32]),
    ) {
        let (be, e_count, k) = (&self.backend, self.arch.moe.num_experts, self.router.top_k());
        self.router_logits(m, input, n, logits);
        r.logits.resize(n * e_count, 0.0);
        be.download(logits, 0, &mut r.logits);
        r.ids.resize(n * k, 0);
        r.weights.resize(n * k, 0.0);
        r.choices.resize(n * e_count, 0.0);
        // Each token is routed on its own, so pieces of a chunk's tokens go to the backend's
        // host threads: a 256-token chunk routed on one thread had kept the others waiting 14
        // ms of a 590 ms prefill at 16 threads on the Intel host (#23).
        const TOKENS_PER_PIECE: usize = 16;
        let pieces: Vec<RoutePiece<'_>> = r
            .ids
            .chunks_mut(TOKENS_PER_PIECE * k)
            .zip(r.weights.chunks_mut(TOKENS_PER_PIECE * k))
            .zip(r.choices.chunks_mut(TOKENS_PER_PIECE * e_count))
            .map(|((ids, w), c)| Mutex::new((ids, w, c)))
            .collect();
        let all_logits = &r.logits;
        // About a softmax and a top-k over the experts per token, in row-op elements.
        be.host_ranges(pieces.len(), TOKENS_PER_PIECE * e_count * 8, &|p0, p1| {
            // The rule's buffers, kept by each thread that routes (no allocation per layer).
            thread_local!(static SCRATCH: std::cell::RefCell<RouteScratch> = Default::default());
            SCRATCH.with_borrow_mut(|scratch| {
                for (p, piece) in pieces.iter().enumerate().take(p1).skip(p0) {
                    let mut piece = piece.lock().unwrap_or_else(|e| e.into_inner());
                    let (ids, weights, choices) = &mut *piece;
                    for i in 0..ids.len() / k {
                        let t = p * TOKENS_PER_PIECE + i;
                        let (ids, w) = (&mut ids[i * k..(i + 1) * k], &mut weights[i * k..(i + 1) * k]);
                        self.route_token(m, tokens[t], &all_logits[t * e_count..(t + 1) * e_count], ids, w, scratch);
                        choices[i * e_count..(i + 1) * e_count].copy_from_slice(&scratch.choice);
                    }
                }
            })
        });
        drop(pieces);
        for t in 0..n {
            let (ids, w) = (&mut r.ids[t * k..(t + 1) * k], &r.weights[t * k..(t + 1) * k]);
            if let (Some(trace), Some((li, streams))) = (&self.routing_trace, layer) {
                trace.replace_in(li, streams[t], ids);
            }
            seen(t, ids, w, &r.choices[t * e_count..(t + 1) * e_count]);
        }
    }

    /// One token's experts (`ids`) and mixing weights (`w`) from its router `logits`, by the
    /// router rule, or from `m`'s hash table where it has one; the scores chosen on are left in
    /// `scratch.choice`.
    fn route_token(&self, m: &MoeBlock<B>, token: u32, logits: &[f32], ids: &mut [u32], w: &mut [f32], scratch: &mut RouteScratch) {
        match &m.tid2eid {
            // Hash routing: the token's experts from the table, weighed by their scores.
            Some(table) => {
                ids.copy_from_slice(&table[token as usize * ids.len()..][..ids.len()]);
                self.router.route_given(logits, ids, w, scratch);
            }
            None => self.router.route(logits, m.router_bias.as_deref(), ids, w, scratch),
        }
    }

    /// The routed experts of `h`, mixed into `x`. Each (token, slot) pair's row of `h` is
    /// gathered into `xe` in expert order; the store hands the needed experts over in batches as
    /// their weights are in memory, each batch runs over its rows into `dd`
    /// ([`expert_batch`](Self::expert_batch)); the rows go back to slot order in `slots`, and
    /// each token's slots are added into `x` with their mixing weights in slot order, whatever
    /// order the experts arrived in: bit-identical results whether experts were resident or
    /// streamed.
    fn routed_experts(&self, li: usize, m: &MoeBlock<B>, s: &mut Step<'_, '_, B>, n: usize) -> Result<(), EngineError> {
        let (be, hd, k) = (&self.backend, self.arch.hidden_size, self.router.top_k());
        let (b, hs) = (&mut *s.buf, &*s.host);
        let groups = &hs.groups;
        // A one-token step puts one row in each expert's group, the same row of `h` for all:
        // the products read it where it lies. Gathering it k times, then finding the copies
        // equal to quantize it once, had been part of decode's serial stretch before the
        // gate/up products (#23).
        let direct = n == 1;
        if !direct {
            be.gather_rows(&b.h, hd, &groups.tokens, &mut b.xe);
        }
        if self.kept[li] {
            // The backend has every expert of the layer: one batch, named by id.
            let kept = |j: usize, part| WeightRef::Kept { layer: li, expert: groups.needed[j], part };
            let all =
                (0..groups.needed.len()).map(|j| (j, [kept(j, ExpertPart::Gate), kept(j, ExpertPart::Up), kept(j, ExpertPart::Down)]));
            self.expert_batch(all, groups, m.expert_bias.as_ref(), direct, b);
        } else {
            self.experts.with_experts(li, &groups.needed, &mut |batch: &ExpertBatch<'_>| {
                let views = batch.iter().map(|(j, ex)| {
                    (*j, [WeightRef::Expert(ex.gate, ex.slot), WeightRef::Expert(ex.up, ex.slot), WeightRef::Expert(ex.down, ex.slot)])
                });
                self.expert_batch(views, groups, m.expert_bias.as_ref(), direct, b)
            })?;
        }
        be.add_weighted_rows(&b.dd, hd, n, k, &hs.routes.weights, (&groups.row_of, &groups.order), &mut b.slots, &mut b.x);
        Ok(())
    }

    /// One batch of experts (`(index into needed, [gate, up, down])`) over their rows of `xe`
    /// (`direct`: every group is one row, read from its token's row of `h` instead): one
    /// dispatch for every gate and up product (`[gate | up]` per row of `gu`), SiLU(gate) · up
    /// into each row's gate half, then one dispatch for every down product into `dd`.
    fn expert_batch<'w>(
        &self,
        batch: impl Iterator<Item = (usize, [WeightRef<'w, B::Matrix>; 3])> + Clone,
        groups: &ExpertGroups,
        bias: Option<&ExpertBias<B>>,
        direct: bool,
        b: &mut Buffers<B>,
    ) where
        B::Matrix: 'w,
    {
        let (be, hd, width, k) = (&self.backend, self.arch.hidden_size, self.arch.moe.intermediate_size, self.router.top_k());
        // The jobs borrow this batch's views, valid only during the store's callback: the list
        // is made here, once per batch (see the module documentation).
        let mut jobs = Vec::with_capacity(2 * batch.size_hint().0);
        for (j, [gate, up, _]) in batch.clone() {
            let (r0, rows) = groups.rows(j);
            let x_row = if direct { groups.tokens[r0] } else { groups.input_row(j, k) };
            jobs.push(MatJob { w: gate, x_row, n: rows, out_row: r0, out_col: 0 });
            jobs.push(MatJob { w: up, x_row, n: rows, out_row: r0, out_col: width });
        }
        be.matmul_many(&jobs, if direct { &b.h } else { &b.xe }, hd, &mut b.gu, 2 * width);
        jobs.clear();
        // Each expert's biases (gpt-oss) on its run of rows; `add_bias`'s offset reaches the
        // run's first row.
        let experts = batch.clone();
        let add_biases = |buf: &mut B::Buf, vecs: &[B::Vector], stride: usize| {
            for (j, _) in experts.clone() {
                let (r0, rows) = groups.rows(j);
                be.add_bias(buf, rows, stride, r0 * stride, &vecs[groups.needed[j] as usize]);
            }
        };
        if let Some(bias) = bias {
            add_biases(&mut b.gu, &bias.gate_up, 2 * width);
        }
        // The activation over the batch's rows: one call when they are one run of rows (every
        // expert of a layer at once, as a resident store hands them over), else one per expert.
        let act = |gu: &mut B::Buf, r0: usize, rows: usize| match self.arch.moe.expert_act {
            ExpertAct::Silu => be.silu_mul_halves(gu, r0, rows, 2 * width, width),
            ExpertAct::ClampedSwiglu { alpha, limit } => {
                be.swiglu_clamped_halves(gu, r0, rows, 2 * width, width, alpha as f32, limit as f32)
            }
            ExpertAct::ClampedSilu { limit } => be.silu_clamped_halves(gu, r0, rows, 2 * width, width, limit as f32),
        };
        let (lo, hi, total) =
            batch.clone().map(|(j, _)| groups.rows(j)).fold((usize::MAX, 0, 0), |(lo, hi, t), (r0, n)| (lo.min(r0), hi.max(r0 + n), t + n));
        if total > 0 && total == hi - lo {
            act(&mut b.gu, lo, total);
        } else {
            for (j, _) in batch.clone() {
                let (r0, rows) = groups.rows(j);
                act(&mut b.gu, r0, rows);
            }
        }
        for (j, [_, _, down]) in batch {
            let (r0, rows) = groups.rows(j);
            jobs.push(MatJob { w: down, x_row: r0, n: rows, out_row: r0, out_col: 0 });
        }
        be.matmul_many(&jobs, &b.gu, 2 * width, &mut b.dd, hd);
        if let Some(bias) = bias {
            add_biases(&mut b.dd, &bias.down, hd);
        }
    }

    /// The shared experts of `h`, added into `x`: one SwiGLU MLP into `d`, each token's row
    /// scaled by sigmoid(`gate` · h) where the model has a gate (Qwen2-MoE).
    fn shared_experts(&self, shared: &Mlp<B>, gate: Option<&B::Matrix>, s: &mut Step<'_, '_, B>, n: usize) {
        let (be, hd) = (&self.backend, self.arch.hidden_size);
        self.mlp(shared, s, n);
        let (b, hs) = (&mut *s.buf, &mut *s.host);
        if let Some(g) = gate {
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
}

#[cfg(test)]
mod tests {
    use super::ExpertGroups;

    /// Every expert's gate/up input row holds its own token, and the experts a token reaches
    /// alone all name one row (one quantization), whatever the other slots do.
    #[test]
    fn lone_rows_of_a_token_share_one_input_row() {
        // Three tokens, top-3 of 6 experts: expert 4 is token 0's alone, expert 5 token 1's
        // alone, experts 0 and 2 are shared, expert 3 is token 2's alone, expert 1 token 0's.
        let (k, ids) = (3, [0u32, 4, 1, 0, 5, 2, 2, 3, 0]);
        let mut g = ExpertGroups::default();
        g.group(&ids, 6, k);
        let mut lone_row_of_token = [None; 3];
        for j in 0..g.needed.len() {
            let (r0, rows) = g.rows(j);
            let x = g.input_row(j, k);
            if rows > 1 {
                assert_eq!(x, r0, "expert {} reads its own rows", g.needed[j]);
                continue;
            }
            let t = g.tokens[r0];
            assert_eq!(g.tokens[x], t, "expert {}'s input row holds its token", g.needed[j]);
            assert!(*lone_row_of_token[t].get_or_insert(x) == x, "token {t}'s lone experts name one row");
        }
        assert_eq!(lone_row_of_token, [Some(g.row_of[0]), Some(g.row_of[3]), Some(g.row_of[6])]);
    }
}
