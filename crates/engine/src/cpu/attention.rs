//! Causal attention over the KV cache: for each query (token, head), scores against every
//! cached key of its kv head, softmax, weighted sum of values.

use super::kv_rows::KvRows;
use super::matmul::dot;
use super::KvLayer;
use crate::backend::AttnParams;
use rayon::prelude::*;
use std::cell::RefCell;

thread_local! {
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The reference path's current f16 key and value rows, widened to f32 (the fast path's
    /// kernels widen as they load).
    static WIDE: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

/// One query's attention into `o` (`v_dim` long): over the positions [`AttnParams::selected`]
/// lists for it, or else every position it sees.
#[allow(clippy::too_many_arguments)]
fn one(
    l: &KvLayer,
    q: &[f32],
    q_stride: usize,
    n_qh: usize,
    pos0: usize,
    p: AttnParams<'_>,
    i: usize,
    o: &mut [f32],
    dotf: &dyn Fn(&[f32], &[f32]) -> f32,
) {
    let t = i / n_qh;
    match p.selected {
        Some(sel) => one_over(l, q, q_stride, n_qh, p, i, o, dotf, sel.of(t)),
        None => one_over(l, q, q_stride, n_qh, p, i, o, dotf, p.first_seen(pos0 + t)..pos0 + t + 1),
    }
}

#[allow(clippy::too_many_arguments)]
fn one_over(
    l: &KvLayer,
    q: &[f32],
    q_stride: usize,
    n_qh: usize,
    p: AttnParams<'_>,
    i: usize,
    o: &mut [f32],
    dotf: &dyn Fn(&[f32], &[f32]) -> f32,
    positions: impl Iterator<Item = usize> + Clone,
) {
    let s = l.shape;
    let (kd, vd) = (s.k_dim, s.v_dim);
    let group = p.q_heads / s.heads;
    let k_row = s.heads * kd;
    let (values, v_row, v_stride) = if s.values_in_keys { (&l.k, k_row, kd) } else { (&l.v, s.heads * vd, vd) };
    let (t, h) = (i / n_qh, i % n_qh);
    let g = h / group;
    let qv = &q[t * q_stride + h * kd..][..kd];
    let widen = smoe_kernels::best();
    SCORES.with(|sc| {
        let mut sc = sc.borrow_mut();
        let mut wide = WIDE.with(|w| std::mem::take(&mut *w.borrow_mut()));
        sc.clear();
        let mut max = f32::NEG_INFINITY;
        for j in positions.clone() {
            let j = l.row(j);
            let (key, _) = l.k.rows(j * k_row + g * kd, 1, kd, k_row, &mut wide.0, widen);
            let sj = dotf(qv, &key[..kd]) * p.scale;
            max = max.max(sj);
            sc.push(sj);
        }
        // A sink joins the denominator (and the maximum) but weighs no value.
        let sink = p.sinks.map(|s| s[h]);
        if let Some(s) = sink {
            max = max.max(s);
        }
        let mut sum = sink.map_or(0.0, |s| (s - max).exp());
        for sj in sc.iter_mut() {
            *sj = (*sj - max).exp();
            sum += *sj;
        }
        o.fill(0.0);
        for (j, &w) in positions.zip(sc.iter()) {
            let (v, _) = values.rows(l.row(j) * v_row + g * v_stride, 1, vd, v_row, &mut wide.1, widen);
            for (a, &b) in o.iter_mut().zip(&v[..vd]) {
                *a += w * b;
            }
        }
        WIDE.with(|w| *w.borrow_mut() = wide);
        let inv = 1.0 / sum;
        for a in o.iter_mut() {
            *a *= inv;
        }
    })
}

/// Reference attention (rayon over queries when large).
pub(super) fn attention_ref(l: &KvLayer, q: &[f32], q_stride: usize, n: usize, pos0: usize, p: AttnParams<'_>, out: &mut [f32]) {
    let vd = l.shape.v_dim;
    let out = &mut out[..n * p.q_heads * vd];
    let job = |(i, o): (usize, &mut [f32])| one(l, q, q_stride, p.q_heads, pos0, p, i, o, &dot);
    if n * p.q_heads * (pos0 + n) * l.shape.k_dim < 1 << 16 {
        out.chunks_mut(vd).enumerate().for_each(job);
    } else {
        out.par_chunks_mut(vd).enumerate().for_each(job);
    }
}

/// Positions of one block (see [`attention_fast`]): small enough that one decode token's
/// blocks spread over the pool, large enough that merging them costs little (two `exp` and a
/// row rescale per block against 128 positions' weighted sums).
pub(super) const POSITIONS_PER_BLOCK: usize = 128;

/// Query heads per task: one KV head's query heads, split so that MLA's single KV head (and
/// 128 query heads) still spreads over the pool.
const HEADS_PER_TASK: usize = 16;

/// Tokens per task in prefill: the cached keys and values a task streams serve this many
/// queries of each head, instead of one.
const TOKENS_PER_TASK: usize = 8;

/// Rows (token, head) a task holds at most.
const ROWS: usize = TOKENS_PER_TASK * HEADS_PER_TASK;

/// A task's buffers, reused across calls: its query rows, one block's scores (then
/// probabilities) position-major, that block's unnormalised outputs, and the running outputs.
#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    probs: Vec<f32>,
    part: Vec<f32>,
    out: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
    /// Decode's per-block partial results, (outputs, maxima, sums) of every task.
    static PARTS: RefCell<(Vec<f32>, Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

/// Which rows a task computes: tokens `t0..t1` (of the call), query heads `h0..h0 + heads` of
/// KV head `g`, `rows = (t1 - t0) * heads`, row `(t - t0) * heads + h`.
#[derive(Clone, Copy)]
struct Rows {
    t0: usize,
    t1: usize,
    g: usize,
    h0: usize,
    heads: usize,
    rows: usize,
}

/// The layout of one sequence's attention, shared by its tasks: its queries start at `q`, its
/// outputs at float `out0` of the call's output.
struct Call<'a> {
    l: &'a KvLayer,
    k: &'a smoe_kernels::Kernels,
    p: AttnParams<'a>,
    q: &'a [f32],
    q_stride: usize,
    pos0: usize,
    out0: usize,
    block: usize,
    group: usize,
    chunk: usize,
    chunks_per_group: usize,
    values: &'a KvRows,
    v_row: usize,
    v_stride: usize,
}

impl<'a> Call<'a> {
    /// Sequence `seq`'s layout in a call over `q` (rows `q_stride` apart).
    fn new(seq: &SeqRows<'a>, q: &'a [f32], q_stride: usize, p: AttnParams<'a>, k: &'a smoe_kernels::Kernels, block: usize) -> Self {
        let (l, s) = (seq.l, seq.l.shape);
        let group = p.q_heads / s.heads;
        let chunk = group.min(HEADS_PER_TASK);
        let (values, v_row, v_stride) =
            if s.values_in_keys { (&l.k, s.heads * s.k_dim, s.k_dim) } else { (&l.v, s.heads * s.v_dim, s.v_dim) };
        Call {
            l,
            k,
            p,
            q: &q[seq.row * q_stride..],
            q_stride,
            pos0: seq.pos0,
            out0: seq.row * p.q_heads * s.v_dim,
            block,
            group,
            chunk,
            chunks_per_group: group.div_ceil(chunk),
            values,
            v_row,
            v_stride,
        }
    }

    /// Task `i`'s rows when tasks go (token block, KV head, head chunk) in that order.
    fn rows(&self, i: usize, n: usize) -> Rows {
        let kvh = self.l.shape.heads;
        let (b, rest) = (i / (kvh * self.chunks_per_group), i % (kvh * self.chunks_per_group));
        let (g, c) = (rest / self.chunks_per_group, rest % self.chunks_per_group);
        let h0 = g * self.group + c * self.chunk;
        let heads = self.chunk.min(g * self.group + self.group - h0);
        let (t0, t1) = (b * TOKENS_PER_TASK, ((b + 1) * TOKENS_PER_TASK).min(n));
        Rows { t0, t1, g, h0, heads, rows: (t1 - t0) * heads }
    }

    /// The first block every row of `r` may see: blocks stay aligned to multiples of `block`
    /// whatever the window, so that a row's arithmetic does not depend on the other rows of
    /// its task (prefill = decode).
    fn first_block(&self, r: Rows) -> usize {
        self.p.first_seen(self.pos0 + r.t0) / self.block
    }

    /// Blocks up to the last position the rows see.
    fn end_block(&self, r: Rows) -> usize {
        (self.pos0 + r.t1).div_ceil(self.block)
    }

    /// `r`'s query rows, contiguous.
    fn gather_queries(&self, r: Rows, qb: &mut Vec<f32>) {
        let kd = self.l.shape.k_dim;
        qb.clear();
        for t in r.t0..r.t1 {
            qb.extend_from_slice(&self.q[t * self.q_stride + r.h0 * kd..][..r.heads * kd]);
        }
    }

    /// Block `bi`'s softmax terms for rows `r` on their own: each row's maximum `m` over the
    /// positions of the block it sees, `exp(score - m)` for those (zero for the others), their
    /// sum `s`, and the weighted sum of values `o` (`rows × v_dim`). A row that sees none of
    /// the block gets `m = -inf`, `s = 0`, `o = 0`. Depends only on the row and the block, not
    /// on the other rows of the task.
    #[allow(clippy::too_many_arguments)]
    fn block_terms(&self, r: Rows, bi: usize, qb: &[f32], pr: &mut Vec<f32>, o: &mut [f32], m: &mut [f32], s: &mut [f32]) {
        let sh = self.l.shape;
        let (kd, vd, rows, heads) = (sh.k_dim, sh.v_dim, r.rows, r.heads);
        let k_row = sh.heads * kd;
        let j0 = bi * self.block;
        let nb = self.block.min(self.pos0 + r.t1 - j0);
        // Scores, position-major: pr[j * rows + r] for positions j0 + j.
        pr.resize(nb * rows, 0.0);
        // Rows before the cache's base were dropped: bases are block-aligned, so a block is
        // held whole or not at all (`KvLayer::row` stops a read of a dropped one).
        let at = self.l.row(j0);
        // f16 rows go to kernels that widen them as they load them: the bits of f32 rows
        // holding the widened values, from half the bytes.
        let (key0, value0) = (at * k_row + r.g * kd, at * self.v_row + r.g * self.v_stride);
        match (&self.l.k, self.values) {
            (KvRows::F32(keys), KvRows::F32(values)) => {
                smoe_kernels::prefetch_rows(&values[value0..], self.v_row, nb, sh.v_dim);
                self.k.attn_scores(qb, kd, &keys[key0..], k_row, nb, pr);
            }
            (KvRows::F16(keys), _) => self.k.attn_scores_f16(qb, kd, &keys[key0..], k_row, nb, pr),
            _ => unreachable!("a layer's keys and values are of one kind"),
        }
        m[..rows].fill(f32::NEG_INFINITY);
        s[..rows].fill(0.0);
        // The positions each token sees, `from..seen` of the block (positions before the
        // row's window are masked like those after it).
        let ntok = r.t1 - r.t0;
        let span = |tt: usize| {
            let pos = self.pos0 + r.t0 + tt;
            let seen = (pos + 1).saturating_sub(j0).min(nb);
            (self.p.first_seen(pos).saturating_sub(j0).min(seen), seen)
        };
        // Positions every token of the task sees (all of a block behind the diagonal) go by
        // for all rows at once, `rows` side by side; the others a token's heads at a time.
        // A row still takes its positions in order, with the same arithmetic either way (the
        // maximum does not depend on order; the sum goes `from..seen` ascending), so its terms
        // do not depend on the other rows of the task.
        let (all_from, all_seen) = (0..ntok).map(span).fold((0, nb), |(f, e), (tf, te)| (f.max(tf), e.min(te)));
        let shared = if all_from < all_seen { all_from..all_seen } else { nb..nb };
        // A token's own positions before the shared ones, or after them.
        let own =
            |(from, seen): (usize, usize), before: bool| if before { from..seen.min(shared.start) } else { from.max(shared.end)..seen };
        let scale = self.p.scale;
        let scaled_max = |v: &mut [f32], m: &mut [f32]| {
            for (v, mx) in v.iter_mut().zip(m) {
                *v *= scale;
                *mx = mx.max(*v);
            }
        };
        for tt in 0..ntok {
            let rs = tt * heads..(tt + 1) * heads;
            for j in own(span(tt), true).chain(own(span(tt), false)) {
                scaled_max(&mut pr[j * rows..][rs.clone()], &mut m[rs.clone()]);
            }
        }
        for j in shared.clone() {
            scaled_max(&mut pr[j * rows..][..rows], &mut m[..rows]);
        }
        // Terms in position order: each token's own positions before the shared ones, then
        // the shared ones for all rows, then each token's own after them.
        let own_terms = |pr: &mut [f32], m: &[f32], s: &mut [f32], before: bool| {
            for tt in 0..ntok {
                let rs = tt * heads..(tt + 1) * heads;
                for j in own(span(tt), before) {
                    self.k.softmax_terms(&mut pr[j * rows..][rs.clone()], &m[rs.clone()], &mut s[rs.clone()]);
                }
            }
        };
        own_terms(pr, m, s, true);
        for j in shared.clone() {
            self.k.softmax_terms(&mut pr[j * rows..][..rows], &m[..rows], &mut s[..rows]);
        }
        own_terms(pr, m, s, false);
        for tt in 0..ntok {
            let (from, seen) = span(tt);
            let rs = tt * heads..(tt + 1) * heads;
            for j in (0..from).chain(seen..nb) {
                pr[j * rows..][rs.clone()].fill(0.0);
            }
        }
        let o = &mut o[..rows * vd];
        o.fill(0.0);
        match self.values {
            KvRows::F32(values) => self.k.attn_weighted_sum(o, vd, &pr[..nb * rows], &values[value0..], self.v_row, nb),
            KvRows::F16(values) => self.k.attn_weighted_sum_f16(o, vd, &pr[..nb * rows], &values[value0..], self.v_row, nb),
        }
    }

    /// Ends rows `r`: each row's sink (gpt-oss) joins its denominator, then the outputs are
    /// divided by it into `out`'s rows.
    fn finish(&self, r: Rows, o: &mut [f32], m: &mut [f32], s: &mut [f32], out: &super::DisjointOut) {
        let vd = self.l.shape.v_dim;
        if let Some(sinks) = self.p.sinks {
            for i in 0..r.rows {
                // The sink as one more block of one position, whose output is zero.
                let sink = sinks[r.h0 + i % r.heads];
                merge(&mut m[i], &mut s[i], &mut o[i * vd..(i + 1) * vd], sink, 1.0, None);
            }
        }
        for t in r.t0..r.t1 {
            let r0 = (t - r.t0) * r.heads;
            // SAFETY: this task owns the output rows of query heads h0..h0 + heads of tokens
            // t0..t1; tasks cover disjoint (token, head) ranges and `out` outlives the call.
            let dst = unsafe { out.range(self.out0 + (t * self.p.q_heads + r.h0) * vd, r.heads * vd) };
            for (h, d) in dst.chunks_exact_mut(vd).enumerate() {
                let inv = 1.0 / s[r0 + h];
                for (d, &v) in d.iter_mut().zip(&o[(r0 + h) * vd..(r0 + h + 1) * vd]) {
                    *d = v * inv;
                }
            }
        }
    }
}

/// Folds one block's terms of a row (`mb`, `sb`, `ob`: see [`Call::block_terms`]; `ob` None
/// for zeros) into the row's running maximum `m`, sum `s` and outputs `o`, both sides rescaled
/// to the larger maximum. Blocks fold in position order in prefill and in decode alike, so the
/// two give the same bits.
fn merge(m: &mut f32, s: &mut f32, o: &mut [f32], mb: f32, sb: f32, ob: Option<&[f32]>) {
    if mb == f32::NEG_INFINITY {
        return; // the row sees none of this block
    }
    if *m == f32::NEG_INFINITY {
        // The first block the row sees: its terms as they are (a single block is one softmax).
        *m = mb;
        *s = sb;
        match ob {
            Some(ob) => o.copy_from_slice(ob),
            None => o.fill(0.0),
        }
        return;
    }
    let mx = m.max(mb);
    let (fa, fb) = ((*m - mx).exp(), (mb - mx).exp());
    *s = *s * fa + sb * fb;
    match ob {
        Some(ob) => o.iter_mut().zip(ob).for_each(|(x, &y)| *x = *x * fa + y * fb),
        None => o.iter_mut().for_each(|x| *x *= fa),
    }
    *m = mx;
}

/// One sequence of a batched call ([`attention_fast_batch`]): its layer of the KV cache, the
/// step's rows `row..row + n` (its queries, and its outputs), the position of its first query.
pub(super) struct SeqRows<'a> {
    pub l: &'a KvLayer,
    pub row: usize,
    pub n: usize,
    pub pos0: usize,
}

/// Where a sequence's work sits in a batched call: its first task, its first fold (tasks that
/// merge a decode token's blocks; none unless `blocks > 0`), and its partial results' first
/// outputs and first (maximum, sum) pairs. `blocks > 0`: a decode token whose positions go by
/// in that many blocks on their own tasks; 0: each task folds its blocks itself.
#[derive(Clone, Copy, Default)]
struct Share {
    task0: usize,
    fold0: usize,
    part0: usize,
    pair0: usize,
    blocks: usize,
}

thread_local! {
    static SHARES: RefCell<Vec<Share>> = const { RefCell::new(Vec::new()) };
}

/// Grouped-query attention on the persistent pool, of one sequence: [`attention_fast_batch`]
/// of it alone.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_fast(
    l: &KvLayer,
    q: &[f32],
    q_stride: usize,
    n: usize,
    pos0: usize,
    p: AttnParams<'_>,
    out: &mut [f32],
    k: &smoe_kernels::Kernels,
    pool: &super::pool::Pool,
    block: usize,
) {
    attention_fast_batch(&[SeqRows { l, row: 0, n, pos0 }], q, q_stride, p, out, k, pool, block);
}

/// Grouped-query attention on the persistent pool, of the sequences of a step at once (each
/// over its own cache; one layer's, so one shape). A task takes up to [`TOKENS_PER_TASK`]
/// tokens of one sequence, one KV head and up to [`HEADS_PER_TASK`] of its query heads, and
/// streams that head's cached keys and values once for all of them. Every (token, head) row
/// gets exactly the arithmetic it would get alone (positions a row does not see get weight
/// zero), so prefill and decode agree bit for bit, and a sequence in a batch gets the bits it
/// gets alone.
///
/// Positions go by in aligned blocks of `block` ([`POSITIONS_PER_BLOCK`] in production). Each
/// block's softmax terms are computed on their own ([`Call::block_terms`]) and folded into the
/// row in position order ([`merge`]), so a task's scratch does not grow with the context, and
/// a decode token (too few rows to fill the pool) computes its blocks in parallel — one task
/// per (block, KV head, head chunk) — and folds them afterwards with the same arithmetic.
///
/// All sequences' tasks go to the pool in one run (and their folds in a second): one decode
/// token of Qwen3-30B-A3B is 4 tasks (its KV heads), too few for 16 threads, while a step of
/// 16 sequences run one after another kept the threads 20% busy over this op.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_fast_batch(
    seqs: &[SeqRows<'_>],
    q: &[f32],
    q_stride: usize,
    p: AttnParams<'_>,
    out: &mut [f32],
    k: &smoe_kernels::Kernels,
    pool: &super::pool::Pool,
    block: usize,
) {
    let Some(first) = seqs.first() else { return };
    let vd = first.l.shape.v_dim;
    let rows = seqs.iter().map(|s| s.row + s.n).max().unwrap_or(0);
    let sink = super::DisjointOut::new(&mut out[..rows * p.q_heads * vd]);
    SHARES.with(|shares| {
        let mut shares = shares.borrow_mut();
        shares.clear();
        let mut at = Share::default();
        for seq in seqs {
            let call = Call::new(seq, q, q_stride, p, k, block);
            let groups = seq.l.shape.heads * call.chunks_per_group;
            let tasks = seq.n.div_ceil(TOKENS_PER_TASK) * groups;
            let r0 = call.rows(0, seq.n);
            let blocks = call.end_block(r0) - call.first_block(r0);
            let split = tasks == groups && blocks > 1;
            let share = Share { blocks: if split { blocks } else { 0 }, ..at };
            shares.push(share);
            at.task0 += if split { groups * blocks } else { tasks };
            if split {
                at.fold0 += groups;
                at.part0 += groups * blocks * r0.rows * vd;
                at.pair0 += groups * blocks * r0.rows;
            }
        }
        let shares = &shares[..];
        // The sequence whose tasks (or folds) include `i`.
        let find = |i: usize, of: fn(&Share) -> usize| shares.partition_point(|s| of(s) <= i) - 1;
        PARTS.with(|parts| {
            let (po, pm, ps) = &mut *parts.borrow_mut();
            po.resize(at.part0, 0.0);
            pm.resize(at.pair0, 0.0);
            ps.resize(at.pair0, 0.0);
            let (o_out, m_out, s_out) = (super::DisjointOut::new(po), super::DisjointOut::new(pm), super::DisjointOut::new(ps));
            pool.run(at.task0, &|task| {
                let si = find(task, |s| s.task0);
                let (seq, share) = (&seqs[si], shares[si]);
                let call = Call::new(seq, q, q_stride, p, k, block);
                let local = task - share.task0;
                if let Some(gi) = local.checked_div(share.blocks) {
                    // One block of one row group of a decode token: its terms into its slot.
                    let b = local - gi * share.blocks;
                    let r = call.rows(gi, seq.n);
                    let stride = call.rows(0, seq.n).rows; // every group's but the last chunk's
                    let bi = call.first_block(r) + b;
                    SCRATCH.with(|sc| {
                        let Scratch { q: qb, probs: pr, .. } = &mut *sc.borrow_mut();
                        call.gather_queries(r, qb);
                        // SAFETY: slot `local` of the sequence's partial buffers is this task's
                        // alone (sequences' partial buffers do not overlap).
                        let (o, m, s) = unsafe {
                            (
                                o_out.range(share.part0 + local * stride * vd, r.rows * vd),
                                m_out.range(share.pair0 + local * stride, r.rows),
                                s_out.range(share.pair0 + local * stride, r.rows),
                            )
                        };
                        call.block_terms(r, bi, qb, pr, o, m, s);
                    });
                    return;
                }
                let r = call.rows(local, seq.n);
                SCRATCH.with(|sc| {
                    let Scratch { q: qb, probs: pr, part, out: ob } = &mut *sc.borrow_mut();
                    call.gather_queries(r, qb);
                    ob.clear();
                    ob.resize(r.rows * vd, 0.0);
                    part.resize(r.rows * vd, 0.0);
                    let (mut max, mut sum) = ([f32::NEG_INFINITY; ROWS], [0f32; ROWS]);
                    let (mut mb, mut sb) = ([0f32; ROWS], [0f32; ROWS]);
                    for bi in call.first_block(r)..call.end_block(r) {
                        call.block_terms(r, bi, qb, pr, part, &mut mb, &mut sb);
                        for i in 0..r.rows {
                            merge(&mut max[i], &mut sum[i], &mut ob[i * vd..(i + 1) * vd], mb[i], sb[i], Some(&part[i * vd..(i + 1) * vd]));
                        }
                    }
                    call.finish(r, ob, &mut max, &mut sum, &sink);
                })
            });
            if at.fold0 == 0 {
                return;
            }
            // Each decode token's blocks folded in order, one task per row group.
            let (po, pm, ps) = (&*po, &*pm, &*ps);
            pool.run(at.fold0, &|fold| {
                // (The last sequence whose folds start at or before `fold` is one with folds:
                // one without adds none, so the next starts where it does.)
                let si = find(fold, |s| s.fold0);
                let (seq, share) = (&seqs[si], shares[si]);
                let call = Call::new(seq, q, q_stride, p, k, block);
                let gi = fold - share.fold0;
                let r = call.rows(gi, seq.n);
                let stride = call.rows(0, seq.n).rows;
                SCRATCH.with(|sc| {
                    let Scratch { out: ob, .. } = &mut *sc.borrow_mut();
                    ob.clear();
                    ob.resize(r.rows * vd, 0.0);
                    let (mut max, mut sum) = ([f32::NEG_INFINITY; ROWS], [0f32; ROWS]);
                    for b in 0..share.blocks {
                        let slot = gi * share.blocks + b;
                        for i in 0..r.rows {
                            let pair = share.pair0 + slot * stride + i;
                            let part = &po[share.part0 + (slot * stride + i) * vd..][..vd];
                            merge(&mut max[i], &mut sum[i], &mut ob[i * vd..(i + 1) * vd], pm[pair], ps[pair], Some(part));
                        }
                    }
                    call.finish(r, ob, &mut max, &mut sum, &sink);
                })
            });
        })
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::KvShape;

    fn layer(shape: KvShape, positions: usize) -> KvLayer {
        let v =
            |n: usize, seed: usize| (0..n).map(|i| (((i * 7919 + seed * 104729) % 1999) as f32 / 1999.0 - 0.5) * 3.0).collect::<Vec<_>>();
        let kw = shape.heads * shape.k_dim;
        let vw = if shape.values_in_keys { 0 } else { shape.heads * shape.v_dim };
        KvLayer {
            shape,
            k: KvRows::from_f32(v(positions * kw, 1), shape.f16),
            v: KvRows::from_f32(v(positions * vw, 2), shape.f16),
            base: 0,
        }
    }

    /// Attention in blocks of positions equals one softmax over all of them (to rounding), and
    /// prefill equals decode bit for bit at any block size, with and without sliding windows
    /// and sinks, over f32 rows and over f16 ones (widened as the kernels load them).
    #[test]
    fn blocks_of_positions_match_one_softmax() {
        let kernels = smoe_kernels::best();
        let pool = crate::cpu::pool::Pool::new(2);
        let gqa = KvShape { heads: 2, k_dim: 16, v_dim: 16, values_in_keys: false, keep: None, f16: false };
        let mla = KvShape { heads: 1, k_dim: 24, v_dim: 16, values_in_keys: true, keep: None, f16: false };
        for (shape, q_heads) in [(gqa, 6), (mla, 3), (KvShape { f16: true, ..gqa }, 6), (KvShape { f16: true, ..mla }, 3)] {
            let (n, pos0) = (19, 40);
            let l = layer(shape, pos0 + n);
            let q_stride = q_heads * shape.k_dim + 5;
            let q: Vec<f32> = (0..n * q_stride).map(|i| ((i * 31 % 97) as f32 - 48.0) / 40.0).collect();
            // gpt-oss's windows and sinks (large enough to win some maxima) go through the same
            // blocks.
            let sinks: Vec<f32> = (0..q_heads).map(|h| h as f32 * 1.5 - 2.0).collect();
            let variants = [(None, None), (Some(7), Some(&sinks[..])), (Some(45), None), (None, Some(&sinks[..]))];
            for (window, sinks) in variants {
                let p = AttnParams { q_heads, scale: 0.3, window, sinks, selected: None };
                let width = n * q_heads * shape.v_dim;
                let mut exact = vec![0f32; width];
                attention_ref(&l, &q, q_stride, n, pos0, p, &mut exact);
                for block in [1, 3, 17, 64, 4096] {
                    let mut got = vec![0f32; width];
                    attention_fast(&l, &q, q_stride, n, pos0, p, &mut got, kernels, &pool, block);
                    let err = got.iter().zip(&exact).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                    assert!(err < 1e-5, "block {block}: {err}");
                    // Token by token through the same cache: the same bits.
                    let mut one = vec![0f32; q_heads * shape.v_dim];
                    for t in 0..n {
                        attention_fast(&l, &q[t * q_stride..], q_stride, 1, pos0 + t, p, &mut one, kernels, &pool, block);
                        assert_eq!(one, got[t * one.len()..(t + 1) * one.len()], "block {block}, token {t}");
                    }
                }
            }
        }
    }
    /// Several sequences in one call — decode tokens over short and long caches (whose blocks
    /// go on tasks of their own), prefill chunks, in any order of rows — give each sequence the
    /// bits of its call alone, with and without windows and sinks.
    #[test]
    fn a_batch_of_sequences_attends_as_each_alone() {
        let kernels = smoe_kernels::best();
        let pool = crate::cpu::pool::Pool::new(3);
        let shape = KvShape { heads: 2, k_dim: 16, v_dim: 16, values_in_keys: false, keep: None, f16: false };
        for shape in [shape, KvShape { f16: true, ..shape }] {
            let q_heads = 6;
            // (positions before, queries): decode after 300 (three blocks of 128), decode from the
            // start, a prefill chunk of 19 after 40, a chunk of 3 after 200, decode after 129.
            let seqs = [(300, 1), (0, 1), (40, 19), (200, 3), (129, 1)];
            let layers: Vec<KvLayer> = seqs.iter().enumerate().map(|(i, &(pos0, n))| layer(shape, pos0 + n + i)).collect();
            let n: usize = seqs.iter().map(|s| s.1).sum();
            let q_stride = q_heads * shape.k_dim + 3;
            let q: Vec<f32> = (0..n * q_stride).map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0).collect();
            let sinks: Vec<f32> = (0..q_heads).map(|h| h as f32 - 2.5).collect();
            let width = q_heads * shape.v_dim;
            for (window, sinks) in [(None, None), (Some(70), Some(&sinks[..]))] {
                let p = AttnParams { q_heads, scale: 0.25, window, sinks, selected: None };
                let mut rows = Vec::new();
                let mut row = 0;
                for (l, &(pos0, n)) in layers.iter().zip(&seqs) {
                    rows.push(SeqRows { l, row, n, pos0 });
                    row += n;
                }
                // The rows in another order than the sequences'.
                rows.reverse();
                let mut got = vec![0f32; n * width];
                attention_fast_batch(&rows, &q, q_stride, p, &mut got, kernels, &pool, POSITIONS_PER_BLOCK);
                for s in &rows {
                    let mut alone = vec![0f32; s.n * width];
                    attention_fast(s.l, &q[s.row * q_stride..], q_stride, s.n, s.pos0, p, &mut alone, kernels, &pool, POSITIONS_PER_BLOCK);
                    assert_eq!(alone, got[s.row * width..(s.row + s.n) * width], "window {window:?}: the sequence at row {}", s.row);
                }
            }
        }
    }
}

#[cfg(test)]
mod speed {
    use super::*;
    use crate::backend::KvShape;

    /// Qwen3-30B-A3B's attention: 4 KV heads of 128 for 32 query heads.
    const SHAPE: KvShape = KvShape { heads: 4, k_dim: 128, v_dim: 128, values_in_keys: false, keep: None, f16: false };

    /// `n` values of a fixed spread pattern.
    fn pattern(n: usize) -> Vec<f32> {
        (0..n).map(|i| ((i * 7919 % 1999) as f32 / 1999.0 - 0.5) * 3.0).collect()
    }

    /// A layer of `positions` pattern rows, stored as f16 when `SMOE_ATTN_KV=f16`.
    fn layer(positions: usize) -> KvLayer {
        let f16 = std::env::var("SMOE_ATTN_KV").is_ok_and(|v| v == "f16");
        let shape = KvShape { f16, ..SHAPE };
        let kw = SHAPE.heads * SHAPE.k_dim;
        KvLayer { shape, k: KvRows::from_f32(pattern(positions * kw), f16), v: KvRows::from_f32(pattern(positions * kw), f16), base: 0 }
    }

    /// Prefill attention's speed (Qwen3-30B-A3B's heads, a causal prompt of `SMOE_ATTN_TOKENS`
    /// tokens, 2,048 by default; `SMOE_ATTN_KV=f16` for f16 rows), in multiply-adds of the scores and weighted sums per second:
    /// `cargo test --release -p smoe-engine --lib -- --ignored --nocapture --exact
    /// cpu::attention::speed::prefill_attention_speed`.
    #[test]
    #[ignore]
    fn prefill_attention_speed() {
        let q_heads = 32;
        let n: usize = std::env::var("SMOE_ATTN_TOKENS").ok().and_then(|v| v.parse().ok()).unwrap_or(2048);
        let layer = layer(n);
        let q = pattern(n * q_heads * 128);
        let p = AttnParams { q_heads, scale: 0.088, window: None, sinks: None, selected: None };
        let mut out = vec![0f32; n * q_heads * 128];
        // Causal: row t sees t + 1 positions, a score and a weighted sum of 128 each.
        let macs = (q_heads * n * (n + 1) / 2 * 2 * 128) as f64;
        for threads in [1, 2] {
            let pool = crate::cpu::pool::Pool::new(threads);
            let mut best = f64::MAX;
            for _ in 0..3 {
                let t = std::time::Instant::now();
                attention_fast(&layer, &q, q_heads * 128, n, 0, p, &mut out, smoe_kernels::best(), &pool, POSITIONS_PER_BLOCK);
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!("{threads} threads, {n} tokens: {:.1} ms, {:.1} GMAC/s", best * 1e3, macs / best / 1e9);
        }
    }

    /// Decode attention's speed (Qwen3-30B-A3B's heads, `SMOE_ATTN_POSITIONS` positions, 1,536
    /// by default; `SMOE_ATTN_KV=f16` for f16 rows), for comparing versions on one machine: `cargo test --release -p smoe-engine --lib -- --ignored
    /// --nocapture --exact cpu::attention::speed::attention_speed` (`--exact`: a plain filter
    /// would run [`prefill_attention_speed`] beside it, on the same cores).
    #[test]
    #[ignore]
    fn attention_speed() {
        let positions: usize = std::env::var("SMOE_ATTN_POSITIONS").ok().and_then(|v| v.parse().ok()).unwrap_or(1536);
        let q_heads = 32;
        // Twelve layers' caches (80 MB at 1,536 positions in f32), visited in turn as decode
        // does: from memory, not cache.
        let layers: Vec<KvLayer> = (0..12).map(|_| layer(positions)).collect();
        let q = pattern(q_heads * 128);
        let p = AttnParams { q_heads, scale: 0.088, window: None, sinks: None, selected: None };
        let mut out = vec![0f32; q_heads * 128];
        // From memory (twelve caches in turn), then from cache (one cache again and again).
        for (threads, turn) in [(1, 12), (2, 12), (1, 1), (2, 1)] {
            let pool = crate::cpu::pool::Pool::new(threads);
            let reps = 100;
            // The best of five rounds after a warm-up (this machine's neighbours are noisy).
            let mut best = f64::MAX;
            for _ in 0..6 {
                let t = std::time::Instant::now();
                for i in 0..reps {
                    attention_fast(
                        &layers[i % turn],
                        &q,
                        q_heads * 128,
                        1,
                        positions - 1,
                        p,
                        &mut out,
                        smoe_kernels::best(),
                        &pool,
                        POSITIONS_PER_BLOCK,
                    );
                }
                best = best.min(t.elapsed().as_secs_f64());
            }
            let from = if turn == 1 { "cache" } else { "memory" };
            println!("{threads} threads, from {from}: {:.1} us per decode attention over {positions} positions", best / reps as f64 * 1e6);
        }
    }
}
