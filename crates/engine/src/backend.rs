//! The backend boundary: every numeric operation of the forward pass, on buffers the backend
//! owns.
//!
//! The decoder is generic over [`Backend`] and never touches activation memory directly: it
//! allocates buffers, calls ops (passing their small host inputs as arguments: token ids, RoPE
//! cos/sin, mixing weights, row lists), and downloads only what the host must see: router
//! logits (routing runs on the host, unless the backend keeps the layer's experts: then
//! [`Backend::route`] and [`Backend::kept_experts`] run there and nothing is read back),
//! Qwen2-MoE's shared-expert gate (one value per token; its sigmoid is taken on the host) and
//! the final logits. A GPU backend can hold the dense
//! weights, activations and the KV cache in device memory behind the same calls.
//! Routed experts arrive as host [`QMatrix`] views of the expert store's cache slots, in the
//! jobs of [`Backend::matmul_many`] ([`WeightRef::Expert`], with the slot's handle); a backend that wants experts in its
//! own memory (a GPU's) copies or caches them from there.
//!
//! [`crate::conformance`] checks every op of a backend against a plain f32 implementation.

use crate::routing::RouterRule;
use smoe_quant::{Format, QMatrix};
use smoe_store::{ExpertView, SlotHandle};
use std::sync::Arc;

/// Shape of one layer's KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// Key/value heads.
    pub heads: usize,
    /// Key dimensions per head.
    pub k_dim: usize,
    /// Value dimensions per head.
    pub v_dim: usize,
    /// Values are the first `v_dim` dimensions of each key row (multi-head latent attention
    /// caches one latent per position for both).
    pub values_in_keys: bool,
    /// Only the `keep` positions before a call's first one are ever read again (DeepSeek-V4's
    /// sliding window and raw compressor rows, gpt-oss's sliding layers, with a margin for
    /// truncation): a backend may drop older rows. `None`: every position is kept.
    pub keep: Option<usize>,
    /// Rows stored as IEEE half floats, rounded to nearest even as they are stored, and read
    /// back exactly as f32: half the memory, and attention computes as it would over an f32
    /// cache holding the rounded values. Set only where [`Backend::kv_f16`] says the backend
    /// can, for layers written by `kv_store` and read by attention alone.
    pub f16: bool,
}

/// One sequence of a batched attention call ([`Backend::attention_batch`]): its KV cache, its
/// rows `row..row + n` of the step (queries in, outputs out), the position of its first query.
pub struct SeqQueries<'a, C> {
    /// The sequence's own KV cache.
    pub cache: &'a C,
    /// Its first row in the step's query and output buffers.
    pub row: usize,
    /// Its queries (tokens) in this step, at least one.
    pub n: usize,
    /// The position of its first query.
    pub pos0: usize,
}

/// One sequence's rows in [`Backend::qk_rope_store_batch`]: its KV cache, its rows `row..row +
/// n` of the step, the position of its first.
pub struct SeqStore<'a, C> {
    /// The sequence's own KV cache.
    pub cache: &'a mut C,
    /// Its first row in the step.
    pub row: usize,
    /// Its rows (tokens) in this step, at least one.
    pub n: usize,
    /// The position of its first token.
    pub pos0: usize,
}

/// Parameters of one attention call.
#[derive(Clone, Copy, Debug)]
pub struct AttnParams<'a> {
    /// Query heads.
    pub q_heads: usize,
    /// Softmax scale applied to q·k.
    pub scale: f32,
    /// A sliding window of `w` positions: the query at position `p` sees `p + 1 - w..=p`
    /// (gpt-oss's sliding layers). `None`: every position before it.
    pub window: Option<usize>,
    /// One logit per query head that joins that head's softmax denominator and contributes no
    /// value ("attention sinks", gpt-oss). `None`: a plain softmax.
    pub sinks: Option<&'a [f32]>,
    /// DeepSeek Sparse Attention: the positions each query attends to, as
    /// [`Backend::index_select`] chose them. `None`: every position it sees.
    pub selected: Option<Selection<'a>>,
}

/// The positions each query of an attention call attends to: row `t` of `positions` holds
/// `per_query` ascending positions for query `t`, any unused entries `u32::MAX` at its end.
#[derive(Clone, Copy, Debug)]
pub struct Selection<'a> {
    /// `[n, per_query]` positions.
    pub positions: &'a [u32],
    /// Entries per query.
    pub per_query: usize,
}

impl Selection<'_> {
    /// The positions query `t` attends to.
    pub fn of(&self, t: usize) -> impl Iterator<Item = usize> + Clone + '_ {
        self.positions[t * self.per_query..][..self.per_query].iter().take_while(|&&p| p != u32::MAX).map(|&p| p as usize)
    }
}

/// The queries of one [`Backend::index_select`] call: rows `row0..row0 + n` of its query and
/// weight buffers, at positions `pos0..pos0 + n`, each `heads` indexer heads, keeping `top`
/// positions each.
#[derive(Clone, Copy, Debug)]
pub struct IndexQueries {
    /// First row of the queries and weights.
    pub row0: usize,
    /// Queries.
    pub n: usize,
    /// Position of the first query.
    pub pos0: usize,
    /// Indexer heads.
    pub heads: usize,
    /// Positions kept per query.
    pub top: usize,
    /// Positions per cached key: 1 for GLM-5 (a key per position); DeepSeek-V4's indexer keys
    /// are compressed entries, one per `rate` positions, and the query at `p` sees the
    /// `(p + 1) / rate` entries whose windows have closed.
    pub rate: usize,
}

impl IndexQueries {
    /// Keys the query at position `p` sees.
    pub fn seen(&self, p: usize) -> usize {
        (p + 1) / self.rate.max(1)
    }

    /// Fails, with the message every backend gives, unless the queries (`heads × k_dim` a row),
    /// the weights (`heads` a row) and `out` (`[n, top]`) hold what the call reads and writes.
    pub fn check(&self, q: &impl Extent, weights: &impl Extent, k_dim: usize, out: &[u32]) {
        let hd = self.heads * k_dim;
        check_rows("index_select queries", q, self.row0, self.n, hd, 0, hd);
        check_rows("index_select weights", weights, self.row0, self.n, self.heads, 0, self.heads);
        assert!(out.len() >= self.n * self.top, "index_select: {} outputs for {} queries of {}", out.len(), self.n, self.top);
    }
}

/// Positions an indexer selection keeps for each query: `top` per query, ascending, `u32::MAX`
/// after a query's last. A query that sees `seen ≤ top` keys keeps all of them; beyond, the
/// `top` best `scores[j]` (`j < seen`), the lower position first among equal scores. [`Backend::index_select`]'s rule, shared by the backends.
pub fn select_top(scores: &[f32], seen: usize, top: usize, order: &mut Vec<u32>, out: &mut [u32]) {
    out.fill(u32::MAX);
    if seen <= top {
        for (o, j) in out.iter_mut().zip(0..seen as u32) {
            *o = j;
        }
        return;
    }
    order.clear();
    order.extend(0..seen as u32);
    let better = |a: &u32, b: &u32| scores[*b as usize].total_cmp(&scores[*a as usize]).then(a.cmp(b));
    order.select_nth_unstable_by(top - 1, better);
    let kept = &mut order[..top];
    kept.sort_unstable();
    out[..top].copy_from_slice(kept);
}

/// One [`Backend::attention_compressed`] call (DeepSeek-V4): the sliding window and what lies
/// beyond it.
#[derive(Clone, Copy, Debug)]
pub struct CompressedParams<'a> {
    /// Query heads, each attending with the one shared key=value row.
    pub q_heads: usize,
    /// Softmax scale applied to q·k.
    pub scale: f32,
    /// Positions of the sliding window, the query's own included.
    pub window: usize,
    /// One sink logit per query head.
    pub sinks: &'a [f32],
    /// The cache layer of compressed entries and the positions per entry; `None` for a layer
    /// that only slides.
    pub entries: Option<(usize, usize)>,
    /// The entries each query attends to (compressed sparse attention's indexer); `None`:
    /// every entry whose window has closed.
    pub selected: Option<Selection<'a>>,
}

/// One compression of closed windows (DeepSeek-V4's compressor), see
/// [`Backend::compress_windows`]. `bias` and `norm` are `V`s: host slices for the host code, a
/// backend's resident vectors through [`Backend::compress_windows`] (loaded once with the model,
/// not copied with every call: a rate-128 compressor's bias is 64 K floats).
pub struct CompressWindows<'a, V: ?Sized = [f32]> {
    /// The cache layer of per-position `[kv | gate]` rows (each `c × dim`, `c` 2 when
    /// overlapping).
    pub raw_layer: usize,
    /// The cache layer of entries (one `dim` row per window).
    pub entry_layer: usize,
    /// The first window to compress and how many.
    pub first: usize,
    /// Windows to compress.
    pub count: usize,
    /// Positions per window.
    pub rate: usize,
    /// Entry width.
    pub dim: usize,
    /// Each entry pools its window's second halves with the previous window's first halves.
    pub overlap: bool,
    /// `[rate, c × dim]`: added to the gate of the window's `i`-th position.
    pub bias: &'a V,
    /// `[dim]`: the RMSNorm of each entry.
    pub norm: &'a V,
    /// RMSNorm epsilon.
    pub eps: f32,
    /// Per window, the RoPE tables at its first position (interleaved pairs), rotating the last
    /// `2 × cos.len() / count` dimensions of the entry.
    pub rope: RopeTables<'a>,
}

// By hand: derived, they would ask `V: Clone`, which a slice is not.
impl<V: ?Sized> Clone for CompressWindows<'_, V> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<V: ?Sized> Copy for CompressWindows<'_, V> {}

impl<V: ?Sized> CompressWindows<'_, V> {
    /// The same compression with its bias and norm held as `W`s.
    pub fn with<'b, W: ?Sized>(&self, bias: &'b W, norm: &'b W) -> CompressWindows<'b, W>
    where
        Self: 'b,
    {
        let CompressWindows { raw_layer, entry_layer, first, count, rate, dim, overlap, eps, rope, .. } = *self;
        CompressWindows { raw_layer, entry_layer, first, count, rate, dim, overlap, bias, norm, eps, rope }
    }
}

impl AttnParams<'_> {
    /// The first position the query at position `p` sees.
    pub fn first_seen(&self, p: usize) -> usize {
        self.window.map_or(0, |w| (p + 1).saturating_sub(w))
    }
}

/// One Gated DeltaNet layer's parameters (Qwen3-Next, see [`smoe_vault::LinearAttention`]),
/// for [`Backend::gated_delta_net`]. Its input rows hold `[q | k | v]` (`channels` values, before
/// the convolution), then `z` (`value_heads × value_dim`), then `b` and `a` (`value_heads`
/// each), `stride` floats a row. The four parameter vectors are `V`s: host slices for the
/// host code (`crate::delta`), a backend's resident vectors through [`Backend::gated_delta_net`]
/// (loaded once with the model, not copied with every call).
pub struct DeltaNetParams<'a, V: ?Sized = [f32]> {
    /// Key (and query) heads.
    pub key_heads: usize,
    /// Value heads; value head `j` reads key head `j / (value_heads / key_heads)`, or `j %
    /// key_heads` where `tiled`.
    pub value_heads: usize,
    /// Value heads numbered across key heads (see [`smoe_vault::LinearAttention::tiled_value_heads`]).
    pub tiled: bool,
    /// Dimensions of a key head.
    pub key_dim: usize,
    /// Dimensions of a value head.
    pub value_dim: usize,
    /// Taps of the causal convolution.
    pub taps: usize,
    /// `[channels, taps]`: the convolution's weights, the last tap on the current token.
    pub conv: &'a V,
    /// `-exp(A_log)` per value head.
    pub neg_a: &'a V,
    /// `dt_bias` per value head.
    pub dt_bias: &'a V,
    /// `[value_dim]`: the gated RMSNorm's weights.
    pub norm: &'a V,
    /// The gated RMSNorm's epsilon.
    pub eps: f32,
}

// By hand: derived, they would ask `V: Clone`, which a slice is not.
impl<V: ?Sized> Clone for DeltaNetParams<'_, V> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<V: ?Sized> Copy for DeltaNetParams<'_, V> {}

impl<V: ?Sized> DeltaNetParams<'_, V> {
    /// The same layer with its parameter vectors held as `W`s (`conv`, `neg_a`, `dt_bias`,
    /// `norm`, in that order).
    pub fn with<'b, W: ?Sized>(&self, conv: &'b W, neg_a: &'b W, dt_bias: &'b W, norm: &'b W) -> DeltaNetParams<'b, W> {
        DeltaNetParams {
            key_heads: self.key_heads,
            value_heads: self.value_heads,
            tiled: self.tiled,
            key_dim: self.key_dim,
            value_dim: self.value_dim,
            taps: self.taps,
            conv,
            neg_a,
            dt_bias,
            norm,
            eps: self.eps,
        }
    }

    /// Channels of `[q | k | v]`.
    pub fn channels(&self) -> usize {
        2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
    }
    /// Floats per input row: `[q | k | v | z | b | a]`.
    pub fn stride(&self) -> usize {
        self.channels() + self.value_heads * self.value_dim + 2 * self.value_heads
    }
    /// Floats of one sequence's state for the layer: the last `taps - 1` inputs of every
    /// channel, oldest first, then each value head's `key_dim × value_dim` matrix.
    pub fn state_floats(&self) -> usize {
        (self.taps - 1) * self.channels() + self.value_heads * self.key_dim * self.value_dim
    }
}

/// Rows of `[q | k | v]` as [`Backend::qk_rope_store`] takes them: each row holds `q_heads`
/// query heads, then `kv_heads` key heads, then `kv_heads` value heads, each `head_dim` wide.
#[derive(Clone, Copy, Debug)]
pub struct QkvRows {
    /// Floats from one row to the next.
    pub stride: usize,
    /// Query heads.
    pub q_heads: usize,
    /// Key (and value) heads.
    pub kv_heads: usize,
    /// Dimensions per head.
    pub head_dim: usize,
}

/// Rotary tables of a chunk: `rotary_dim / 2` cosines and sines per token, as
/// [`Backend::rope`] takes them.
#[derive(Clone, Copy, Debug)]
pub struct RopeTables<'a> {
    /// Cosines, token after token.
    pub cos: &'a [f32],
    /// Sines, token after token.
    pub sin: &'a [f32],
    /// Pairs `(2p, 2p + 1)` instead of `(p, p + rotary_dim / 2)`.
    pub interleaved: bool,
}

/// [`Backend::qk_rope_store`] as the ops it fuses: per-head norms, RoPE, the KV store (its
/// default, and what a backend that fuses it falls back to where its kernel does not apply).
#[allow(clippy::too_many_arguments)]
pub fn qk_rope_store_composed<B: Backend>(
    be: &B,
    qkv: &mut B::Buf,
    n: usize,
    rows: QkvRows,
    norm: Option<(&B::Vector, &B::Vector, f32)>,
    rope: RopeTables<'_>,
    cache: &mut B::KvCache,
    layer: usize,
    pos0: usize,
) {
    norm_rope_rows(be, qkv, n, rows, norm, rope);
    let QkvRows { stride, q_heads, kv_heads, head_dim } = rows;
    let (qw, kvw) = (q_heads * head_dim, kv_heads * head_dim);
    be.kv_store(cache, layer, pos0, n, qkv, stride, qw, Some((qkv, stride, qw + kvw)));
}

/// The per-head norms and RoPE of `n` rows of `[q | k | v]`: what [`qk_rope_store_composed`]
/// and [`qk_rope_store_batch_composed`] do before storing.
fn norm_rope_rows<B: Backend>(
    be: &B,
    qkv: &mut B::Buf,
    n: usize,
    rows: QkvRows,
    norm: Option<(&B::Vector, &B::Vector, f32)>,
    rope: RopeTables<'_>,
) {
    let QkvRows { stride, q_heads, kv_heads, head_dim } = rows;
    if let Some((qn, kn, eps)) = norm {
        be.rms_norm_heads(qkv, n, stride, 0, q_heads, head_dim, qn, eps);
        be.rms_norm_heads(qkv, n, stride, q_heads * head_dim, kv_heads, head_dim, kn, eps);
    }
    // Keys follow the queries head after head in each row: one rotation for both.
    be.rope(qkv, n, stride, 0, q_heads + kv_heads, head_dim, rope.cos, rope.sin, rope.interleaved);
}

/// [`Backend::qk_rope_store_batch`] as the ops it fuses: the per-head norms and RoPE of every
/// row at once (row by row ops: each row gets its bits alone), then each sequence's keys and
/// values into its own cache (its default, and what a backend that fuses it falls back to).
pub fn qk_rope_store_batch_composed<B: Backend>(
    be: &B,
    qkv: &mut B::Buf,
    n: usize,
    rows: QkvRows,
    norm: Option<(&B::Vector, &B::Vector, f32)>,
    rope: RopeTables<'_>,
    seqs: &mut [SeqStore<'_, B::KvCache>],
    layer: usize,
) {
    norm_rope_rows(be, qkv, n, rows, norm, rope);
    let QkvRows { stride, q_heads, kv_heads, head_dim } = rows;
    let (qw, kvw) = (q_heads * head_dim, kv_heads * head_dim);
    for s in seqs.iter_mut() {
        let at = s.row * stride + qw;
        be.kv_store(s.cache, layer, s.pos0, s.n, qkv, stride, at, Some((qkv, stride, at + kvw)));
    }
}

/// The weight of one product in [`Backend::matmul_many`].
pub enum WeightRef<'a, M> {
    /// A resident matrix, optionally a row range `(first, count)` of it.
    Resident(&'a M, Option<(usize, usize)>),
    /// A routed expert's matrix in the expert store's cache slot `slot`: its bytes in host
    /// memory, and which slot and load of it they are. A backend that keeps experts in its own
    /// memory keys its copies by the handle and copies again only when its `load` changes.
    Expert(QMatrix<'a>, SlotHandle),
    /// A routed expert's matrix that the backend keeps itself ([`Backend::keep_experts`]):
    /// part `part` of expert `expert` of decoder layer `layer`.
    Kept {
        /// The decoder layer.
        layer: usize,
        /// The expert's id in its layer.
        expert: u32,
        /// Which of its matrices.
        part: ExpertPart,
    },
}

// Copy whatever `M` is: the variants hold a reference, a view and small ids.
impl<M> Clone for WeightRef<'_, M> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<M> Copy for WeightRef<'_, M> {}

/// One of a routed expert's three matrices.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertPart {
    /// `[intermediate, hidden]`.
    Gate,
    /// `[intermediate, hidden]`.
    Up,
    /// `[hidden, intermediate]`.
    Down,
}

/// One product of a batch: input rows `x_row..x_row + n` (their first `cols` values) times the
/// weight, into output rows `out_row..out_row + n` starting at column `out_col`.
pub struct MatJob<'a, M> {
    /// The weight.
    pub w: WeightRef<'a, M>,
    /// First input row.
    pub x_row: usize,
    /// Rows (tokens).
    pub n: usize,
    /// First output row.
    pub out_row: usize,
    /// First output column.
    pub out_col: usize,
}

/// What an op's bounds check needs of a buffer: its name (for the message) and its length in
/// floats.
pub trait Extent {
    /// `(name, length in floats)`.
    fn extent(&self) -> (&str, usize);
}

/// Fails with the op, the buffer and the extents unless rows `row0..row0 + n` of `buf`, each
/// `width` floats from offset `off` in rows of `stride`, lie inside it. Every backend checks its
/// ops with this, so their messages agree.
#[track_caller]
pub fn check_rows(op: &str, buf: &impl Extent, row0: usize, n: usize, stride: usize, off: usize, width: usize) {
    if n == 0 || width == 0 {
        return;
    }
    let (name, len) = buf.extent();
    let need = (row0 + n - 1) * stride + off + width;
    assert!(
        need <= len,
        "{op}: buffer `{name}` holds {len} floats, but rows {row0}..{} of {width} floats (stride {stride}, offset {off}) reach {need}",
        row0 + n,
    );
}

/// [`check_rows`] for `n` packed rows of `width` from the start.
#[track_caller]
pub fn check(op: &str, buf: &impl Extent, n: usize, width: usize) {
    check_rows(op, buf, 0, n, width, 0, width);
}

/// Counters of a backend's own expert tier (a GPU's VRAM copies of the host cache), for
/// `--instrument`: what crossed the bus and what it cost. Counters only grow; [`Self::since`]
/// gives a phase's share.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct DeviceTier {
    /// Expert matrices found in the tier.
    pub hits: u64,
    /// Expert matrices copied up.
    pub copies: u64,
    /// Bytes copied host → device.
    pub copied_bytes: u64,
    /// Seconds the copies took on the device's copy engine.
    pub copy_secs: f64,
    /// Seconds the host waited for copies.
    pub wait_secs: f64,
    /// Missed products computed by the host CPU instead.
    pub cpu_products: u64,
    /// Bytes of weights those read.
    pub cpu_bytes: u64,
    /// Bytes of experts in the tier now (not a counter).
    pub resident_bytes: u64,
    /// The tier's capacity in bytes (not a counter).
    pub capacity_bytes: u64,
    /// Device memory in use now, by everything (not a counter).
    pub device_used_bytes: u64,
}

impl DeviceTier {
    /// The counters accumulated since `before`, with this snapshot's sizes.
    pub fn since(&self, before: &DeviceTier) -> DeviceTier {
        DeviceTier {
            hits: self.hits - before.hits,
            copies: self.copies - before.copies,
            copied_bytes: self.copied_bytes - before.copied_bytes,
            copy_secs: self.copy_secs - before.copy_secs,
            wait_secs: self.wait_secs - before.wait_secs,
            cpu_products: self.cpu_products - before.cpu_products,
            cpu_bytes: self.cpu_bytes - before.cpu_bytes,
            ..*self
        }
    }
}

/// A numeric backend. See the module documentation.
///
/// Every op checks that the rows it reads and writes lie inside its buffers and, if not, fails
/// with a message naming the op, the buffer and the extents (never a bare slice panic): a
/// buffer too small for what the forward pass writes is a bug in the forward pass's
/// buffer widths (`widths.rs`), and the message says where.
pub trait Backend: Send + Sync {
    /// An f32 activation buffer.
    type Buf: Send;
    /// A weight matrix resident on the backend.
    type Matrix: Send + Sync;
    /// A resident f32 vector (norm weights, biases).
    type Vector: Send + Sync;
    /// The KV cache of all layers of one sequence.
    type KvCache: Send;

    /// Human-readable description (ISA, threads).
    fn describe(&self) -> String;
    /// The counters of an expert tier of the backend's own (`None`: it has none, as the CPU).
    fn device_tier(&self) -> Option<DeviceTier> {
        None
    }
    /// Whether [`Self::attention`] honours [`AttnParams::window`] and [`AttnParams::sinks`]
    /// (gpt-oss). A model that needs them is refused at load on a backend that answers `false`,
    /// and the conformance suite skips those cases there.
    fn attends_windows_and_sinks(&self) -> bool {
        true
    }
    /// Whether this backend's products read weights stored as `format` (every format unless it
    /// says otherwise). A model with weights it cannot read is refused at load, and
    /// `--device auto` runs it on the CPU instead.
    fn decodes(&self, _format: Format) -> bool {
        true
    }
    /// Whether the backend runs DeepSeek Sparse Attention: [`Self::layer_norm_strided`],
    /// [`Self::index_select`] and [`AttnParams::selected`] (GLM-5). A model that needs them is
    /// refused at load on a backend that answers `false`, and the conformance suite skips them.
    fn attends_selected(&self) -> bool {
        false
    }
    /// Whether the backend runs DeepSeek-V4's compressed attention:
    /// [`Self::compress_windows`], [`Self::attention_compressed`] and [`Self::index_select`]
    /// with a rate. A model that needs them is refused at load where it answers `false`.
    fn attends_compressed(&self) -> bool {
        false
    }
    /// Whether the backend runs Gated DeltaNet layers and gated attention outputs
    /// ([`Self::gated_delta_net`], [`Self::sigmoid_gate`]; Qwen3-Next). A model that needs them
    /// is refused at load where it answers `false`.
    fn runs_linear_attention(&self) -> bool {
        false
    }
    /// Most tokens a prefill step should run at once: [`PREFILL_CHUNK`](crate::PREFILL_CHUNK)
    /// (what keeps the CPU's working set in its caches) unless the backend fills wider steps
    /// better, as a GPU does.
    fn prefill_chunk(&self) -> usize {
        crate::PREFILL_CHUNK
    }
    /// The formats whose routed experts this backend's products read interleaved eight rows
    /// at a time ([`smoe_quant::Layout::Interleaved8`]): a store that holds every expert
    /// (resident, or a streaming cache as large as the experts) lays them out so as they load;
    /// a smaller streaming cache keeps rows (`open`'s `streamed_interleave`). None by default.
    fn interleaved_expert_formats(&self) -> Vec<Format> {
        Vec::new()
    }
    /// The first device error this backend met, if any (a GPU out of memory, a failed kernel
    /// launch). The ops cannot return errors, so a backend that can meet them keeps the first,
    /// makes later ops do nothing, and says so here; the engine checks after loading and after
    /// every forward call and fails with [`crate::EngineError::Backend`]. The CPU backend has
    /// none.
    fn fault(&self) -> Option<String> {
        None
    }

    /// The host memory routed experts will be read from (`(address, bytes)` ranges, from
    /// [`smoe_store::ExpertSource::host_memory`]), which stays allocated for as long as this
    /// backend is used: a [`crate::Model`] owns both and drops the backend first. A backend that
    /// copies experts to a device page-locks it, so that copies run at the bus's speed and
    /// asynchronously; the CPU backend reads it where it is and ignores this.
    fn use_host_memory(&self, _regions: &[(usize, usize)]) {}

    /// Whether [`Backend::use_host_memory`] page-locked the ranges: the expert source is then
    /// told ([`smoe_store::ExpertSource::host_memory_locked`]) never to give their pages back
    /// when its cache shrinks. False by default (the CPU backend reads them where they are).
    fn locks_host_memory(&self) -> bool {
        false
    }

    /// Before the dense region is shared: the backend may lay out, in place, the matrices
    /// listed in `products` (`(offset, format, rows, cols)`: matrices the decoder only ever
    /// multiplies, never reads as rows or vectors) as its kernels read them best; [`Backend::matrix`]
    /// then makes matrices of them in that layout. The CPU interleaves Q8_0 matrices by eight
    /// rows where it has the kernel for it ([`smoe_quant::interleave`]); the default does
    /// nothing.
    fn prepare_dense(&self, _region: &mut [u8], _products: &[(usize, Format, usize, usize)]) {}
    /// Makes a matrix from `rows x cols` elements in `format` at `offset` in `region` (the
    /// vault's dense region, shared so the CPU backend needs no copy).
    fn matrix(&self, region: &Arc<Vec<u8>>, offset: usize, format: Format, rows: usize, cols: usize) -> Self::Matrix;
    /// Makes a vector.
    fn vector(&self, v: &[f32]) -> Self::Vector;
    /// Allocates a zeroed buffer of `len` floats; `name` says what it holds in the message of
    /// an op that would write or read past its end.
    fn buf(&self, name: &'static str, len: usize) -> Self::Buf;
    /// Allocates an empty KV cache for layers of the given shapes.
    fn kv_cache(&self, layers: &[KvShape]) -> Self::KvCache;
    /// Whether this backend stores layers marked [`KvShape::f16`] as half floats. A backend
    /// that does not (the default) is never given such a layer.
    fn kv_f16(&self) -> bool {
        false
    }
    /// Whether [`KvType::Auto`](crate::KvType::Auto) stores f16 here: where the backend can and
    /// its arithmetic is not the one held to a reference.
    fn kv_f16_by_default(&self) -> bool {
        self.kv_f16()
    }
    /// Makes room for `positions` positions in every layer, so that the cache never moves (is
    /// never copied) while a sequence fills it. Only address space is taken: memory is touched
    /// as positions are stored. (Measured: it did not change resident memory at 8k tokens on
    /// Linux, where glibc moves large blocks without copying; see docs/kv-cache.md.)
    fn kv_reserve(&self, cache: &mut Self::KvCache, positions: usize);
    /// Positions the cache has room for without growing.
    fn kv_capacity(&self, cache: &Self::KvCache) -> usize;
    /// Gives back the memory of positions from `positions` on and the room reserved beyond
    /// them: a session parked for prefix reuse then holds what [`kv_bytes`](Self::kv_bytes)
    /// counts, not what its last request reserved. (In a long-running server that reserved room
    /// does not stay untouched address space: glibc serves later blocks of that size from its
    /// heap, and the server's RSS grew past its session budget.) The default keeps it.
    fn kv_shrink(&self, _cache: &mut Self::KvCache, _positions: usize) {}
    /// Bytes the cache holds now.
    fn kv_bytes(&self, cache: &Self::KvCache) -> usize;
    /// Copies positions `0..positions` of every layer of `src` into `dst` (whose later positions
    /// are then unset): a new sequence starting from another's prefix without recomputing it
    /// (the server's prefix cache shared across sessions). Returns false where the backend
    /// cannot; the default.
    fn kv_copy(&self, _src: &Self::KvCache, _dst: &mut Self::KvCache, _positions: usize) -> bool {
        false
    }

    /// Copies host data into the start of a buffer.
    fn upload(&self, dst: &mut Self::Buf, src: &[f32]);
    /// Copies `dst.len()` floats from `offset` in a buffer to the host.
    fn download(&self, src: &Self::Buf, offset: usize, dst: &mut [f32]);

    /// Rows `ids` of an embedding table into `out[n, cols]`.
    fn embed(&self, table: &Self::Matrix, ids: &[u32], out: &mut Self::Buf);
    /// `out[t, r] = Σ_c w[r0 + r, c] · x[t, c]` for `t < n`, over rows `r0..r0 + m` of `w`
    /// (`rows = None`: all rows). `x` rows are `cols` long, `out` rows `m` long.
    fn matmul(&self, w: &Self::Matrix, rows: Option<(usize, usize)>, x: &Self::Buf, n: usize, out: &mut Self::Buf);
    /// Several products in one dispatch (the experts of a layer, say): rows of `x` are
    /// `x_stride` long, rows of `out` `out_stride` long. Inputs shared by several jobs are
    /// prepared once.
    fn matmul_many(&self, jobs: &[MatJob<'_, Self::Matrix>], x: &Self::Buf, x_stride: usize, out: &mut Self::Buf, out_stride: usize);
    /// Transposed product over a row range: `out[t, c] = Σ_r w[r0 + r, c] · x[t, x_off + r]`,
    /// `x` rows `x_stride` long, `out` rows `cols` long (MLA's absorbed key projection).
    fn matmul_t(&self, w: &Self::Matrix, r0: usize, m: usize, x: &Self::Buf, x_stride: usize, x_off: usize, n: usize, out: &mut Self::Buf);

    /// `out[i] = x[i] / rms(x[i]) * w` for each of `n` rows of `dim` (`out` may be `x`'s copy).
    fn rms_norm(&self, x: &Self::Buf, n: usize, dim: usize, w: &Self::Vector, eps: f32, out: &mut Self::Buf);
    /// In place over `n` segments of `dim` that start every `stride` floats, at offset `off`.
    fn rms_norm_strided(&self, x: &mut Self::Buf, n: usize, stride: usize, off: usize, dim: usize, w: &Self::Vector, eps: f32);
    /// [`Self::rms_norm_strided`] of `heads` vectors of `dim` lying end to end from `off` in
    /// each of `n` rows, all with the weights `w`: a batch's per-head q or k norms in one call.
    /// The default makes one call per head (one in all for a single row, whose heads are
    /// `dim` apart); a backend that pays per launch does it in one.
    #[allow(clippy::too_many_arguments)]
    fn rms_norm_heads(&self, x: &mut Self::Buf, n: usize, stride: usize, off: usize, heads: usize, dim: usize, w: &Self::Vector, eps: f32) {
        if n == 1 {
            return self.rms_norm_strided(x, heads, dim, off, dim, w, eps);
        }
        for h in 0..heads {
            self.rms_norm_strided(x, n, stride, off + h * dim, dim, w, eps);
        }
    }
    /// `x[i] += y[i]` over `n` rows of `dim`, then `out = rms_norm(x)` with `w`: a sublayer's
    /// residual add and the next norm, which a backend that pays per launch does in one.
    #[allow(clippy::too_many_arguments)]
    fn add_rms_norm(&self, x: &mut Self::Buf, y: &Self::Buf, n: usize, dim: usize, w: &Self::Vector, eps: f32, out: &mut Self::Buf) {
        self.add(x, y, n * dim);
        self.rms_norm(x, n, dim, w, eps, out);
    }
    /// A sublayer's output projection and what follows it: [`Self::matmul`] of all of `proj`
    /// over `n` rows of `input` into `y` (`[n, dim]`, `dim` the projection's rows), then
    /// [`Self::add_rms_norm`] of `y` into the residual `x` and the next norm (`w`) into `out`.
    /// A backend may do both in one pass (the CUDA backend adds and norms a decoded token's row
    /// in the product's last block: one launch, and one wait between kernels, fewer a layer);
    /// `y`, `x` and `out` must come out as the two ops leave them.
    #[allow(clippy::too_many_arguments)]
    fn matmul_add_rms_norm(
        &self,
        proj: &Self::Matrix,
        input: &Self::Buf,
        n: usize,
        dim: usize,
        y: &mut Self::Buf,
        x: &mut Self::Buf,
        w: &Self::Vector,
        eps: f32,
        out: &mut Self::Buf,
    ) {
        self.matmul(proj, None, input, n, y);
        self.add_rms_norm(x, y, n, dim, w, eps, out);
    }
    /// Standard attention's inputs made ready, in `n` rows of `[q | k | v]` (`rows`): each q
    /// and k head normalised by `norm` (query weights, key weights, epsilon; per head, where
    /// the model has such norms), q and k heads rotated by `rope`, and the keys and values
    /// stored for positions `pos0..pos0 + n` of `layer` — [`Self::rms_norm_heads`],
    /// [`Self::rope`] and [`Self::kv_store`], which a backend that pays per launch fuses.
    #[allow(clippy::too_many_arguments)]
    fn qk_rope_store(
        &self,
        qkv: &mut Self::Buf,
        n: usize,
        rows: QkvRows,
        norm: Option<(&Self::Vector, &Self::Vector, f32)>,
        rope: RopeTables<'_>,
        cache: &mut Self::KvCache,
        layer: usize,
        pos0: usize,
    ) where
        Self: Sized,
    {
        qk_rope_store_composed(self, qkv, n, rows, norm, rope, cache, layer, pos0);
    }
    /// [`Self::qk_rope_store`] of the sequences of a step at once: `n` rows in all, `rope` the
    /// tables of all of them, each sequence's keys and values into its own cache at `layer`;
    /// every row gets the bits it gets from `qk_rope_store` alone. Used with
    /// [`Self::attention_batch`].
    #[allow(clippy::too_many_arguments)]
    fn qk_rope_store_batch(
        &self,
        qkv: &mut Self::Buf,
        n: usize,
        rows: QkvRows,
        norm: Option<(&Self::Vector, &Self::Vector, f32)>,
        rope: RopeTables<'_>,
        seqs: &mut [SeqStore<'_, Self::KvCache>],
        layer: usize,
    ) where
        Self: Sized,
    {
        qk_rope_store_batch_composed(self, qkv, n, rows, norm, rope, seqs, layer);
    }
    /// LayerNorm in place over `n` segments of `dim` floats that start every `stride` floats at
    /// offset `off`: `(x - mean) / sqrt(var + eps) · w + b` (the DSA indexer's key norm). Only
    /// called where [`Self::attends_selected`].
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_strided(
        &self,
        _x: &mut Self::Buf,
        _n: usize,
        _stride: usize,
        _off: usize,
        _dim: usize,
        _w: &Self::Vector,
        _b: &Self::Vector,
        _eps: f32,
    ) {
        panic!("layer_norm_strided: this backend does not run sparse attention (attends_selected is false)");
    }
    /// DeepSeek Sparse Attention's selection for the queries `at` names: their rows of `q`
    /// (`heads` heads of the cache layer's `k_dim`, end to end) and of `weights` (`heads` per
    /// row) score every cached position `j ≤ p` of `layer` (one key of `k_dim` per position) as
    /// `Σ_h weights[h] · relu(q_h · k_j)`, and the positions [`select_top`] keeps go into `out`
    /// (`[n, top]`). Only called where [`Self::attends_selected`].
    fn index_select(
        &self,
        _cache: &Self::KvCache,
        _layer: usize,
        _q: &Self::Buf,
        _weights: &Self::Buf,
        _at: IndexQueries,
        _out: &mut [u32],
    ) {
        panic!("index_select: this backend does not run sparse attention (attends_selected is false)");
    }
    /// DeepSeek-V4's compressor over closed windows: for each window `w` of `c.first..c.first
    /// + c.count`, each channel of its entry is the softmax-weighted sum (over the window's
    /// positions, and with `overlap` the previous window's too) of the raw `kv` values, weighed
    /// by `gate + bias`; the entry is RMS-normed and its last dimensions rotated, then stored as
    /// row `w` of `c.entry_layer`. With overlap, position `i` of window `w` contributes its
    /// second-half channels to entry `w` and its first-half channels to entry `w + 1` (window 0
    /// has no predecessor). Only called where [`Self::attends_compressed`].
    fn compress_windows(&self, _cache: &mut Self::KvCache, _c: CompressWindows<'_, Self::Vector>) {
        panic!("compress_windows: this backend does not run compressed attention (attends_compressed is false)");
    }
    /// DeepSeek-V4's attention of `n` queries at positions `pos0..` (rows of `q`, `q_heads`
    /// heads of the layer's `k_dim`): each over its sliding window of `layer` and the
    /// compressed entries `p` names, one softmax with the head's sink, values equal to keys;
    /// `out` rows hold `q_heads × k_dim`. Only called where [`Self::attends_compressed`].
    #[allow(clippy::too_many_arguments)]
    fn attention_compressed(
        &self,
        _cache: &Self::KvCache,
        _layer: usize,
        _q: &Self::Buf,
        _n: usize,
        _pos0: usize,
        _p: CompressedParams<'_>,
        _out: &mut Self::Buf,
    ) {
        panic!("attention_compressed: this backend does not run compressed attention (attends_compressed is false)");
    }
    /// Gated DeltaNet over one sequence's tokens, rows `row0..row0 + n` of `x` (see
    /// [`DeltaNetParams`] for their layout), in order: the causal convolution with SiLU over
    /// `[q | k | v]` (continuing from the inputs `state` keeps), q and k heads L2-normalised and
    /// q scaled by `1/sqrt(key_dim)`, then per token and value head the decayed delta-rule
    /// update of its state and its output `Sᵀq`, RMS-normed with `p.norm` and multiplied by
    /// `silu(z)`, into the same rows of `out` (`value_heads × value_dim` wide). `state` (of
    /// [`DeltaNetParams::state_floats`]) carries the sequence from one call to the next;
    /// `fresh`: the sequence starts here (its state is taken as zeros, whatever it holds). Only
    /// called where [`Self::runs_linear_attention`].
    #[allow(clippy::too_many_arguments)]
    fn gated_delta_net(
        &self,
        _p: DeltaNetParams<'_, Self::Vector>,
        _x: &Self::Buf,
        _row0: usize,
        _n: usize,
        _state: &mut Self::Buf,
        _fresh: bool,
        _out: &mut Self::Buf,
    ) {
        panic!("gated_delta_net: this backend does not run linear attention (runs_linear_attention is false)");
    }
    /// `x[t, i] *= sigmoid(gate[t × gate_stride + gate_off + i])` for `i < width`, `n` rows of
    /// `x` `width` wide (Qwen3-Next's gated attention output). Only called where
    /// [`Self::runs_linear_attention`].
    fn sigmoid_gate(&self, _x: &mut Self::Buf, _n: usize, _width: usize, _gate: &Self::Buf, _gate_stride: usize, _gate_off: usize) {
        panic!("sigmoid_gate: this backend does not run linear attention (runs_linear_attention is false)");
    }
    /// Hyper-connections' collapse: `out[t] = Σ_j pre[t × mult + j] · x[t, j]` over the `mult`
    /// streams of `dim` of each of `n` rows of `x`. The default runs on the host.
    fn hc_collapse(&self, x: &Self::Buf, n: usize, mult: usize, dim: usize, pre: &[f32], out: &mut Self::Buf) {
        let mut xs = vec![0f32; n * mult * dim];
        self.download(x, 0, &mut xs);
        let mut o = vec![0f32; n * dim];
        crate::hyper::collapse(&xs, n, mult, dim, pre, &mut o);
        self.upload(out, &o);
    }
    /// Hyper-connections' expansion in place: `x[t, k] = post[t × mult + k] · y[t] + Σ_j
    /// comb[(t × mult + j) × mult + k] · x[t, j]`. The default runs on the host.
    #[allow(clippy::too_many_arguments)]
    fn hc_expand(&self, x: &mut Self::Buf, y: &Self::Buf, n: usize, mult: usize, dim: usize, post: &[f32], comb: &[f32]) {
        let mut xs = vec![0f32; n * mult * dim];
        let mut ys = vec![0f32; n * dim];
        self.download(x, 0, &mut xs);
        self.download(y, 0, &mut ys);
        crate::hyper::expand(&mut xs, &ys, n, mult, dim, post, comb);
        self.upload(x, &xs);
    }
    /// DeepSeek-V4's clipped SwiGLU: `g[i] = silu(min(g[i], limit)) · clamp(u[i], -limit,
    /// limit)` for the first `len` floats. The default runs on the host.
    fn silu_mul_clamped(&self, g: &mut Self::Buf, u: &Self::Buf, len: usize, limit: f32) {
        let (mut gs, mut us) = (vec![0f32; len], vec![0f32; len]);
        self.download(g, 0, &mut gs);
        self.download(u, 0, &mut us);
        for (a, &b) in gs.iter_mut().zip(&us) {
            *a = crate::hyper::clamped_silu(*a, b, limit);
        }
        self.upload(g, &gs);
    }
    /// [`Self::silu_mul_clamped`] within rows `row0..row0 + n` of `stride`, gate `x[0..w]`
    /// and up `x[w..2w]`. The default runs on the host.
    #[allow(clippy::too_many_arguments)]
    fn silu_clamped_halves(&self, x: &mut Self::Buf, row0: usize, n: usize, stride: usize, w: usize, limit: f32) {
        let mut xs = vec![0f32; (row0 + n) * stride];
        self.download(x, 0, &mut xs);
        for row in xs[row0 * stride..].chunks_exact_mut(stride) {
            let (g, u) = row.split_at_mut(w);
            for (a, &b) in g.iter_mut().zip(&u[..w]) {
                *a = crate::hyper::clamped_silu(*a, b, limit);
            }
        }
        self.upload(x, &xs);
    }
    /// `x[t * stride + off..][..b.len()] += b` for `n` rows.
    fn add_bias(&self, x: &mut Self::Buf, n: usize, stride: usize, off: usize, b: &Self::Vector);
    /// `x[i] += y[i]` for the first `len` floats.
    fn add(&self, x: &mut Self::Buf, y: &Self::Buf, len: usize);
    /// `g[i] = silu(g[i]) * u[i]` for the first `len` floats.
    fn silu_mul(&self, g: &mut Self::Buf, u: &Self::Buf, len: usize);
    /// Within rows `row0..row0 + n` of `stride`: `x[0..w] = silu(x[0..w]) * x[w..2w]`.
    fn silu_mul_halves(&self, x: &mut Self::Buf, row0: usize, n: usize, stride: usize, w: usize);
    /// gpt-oss's clamped SwiGLU within rows `row0..row0 + n` of `stride`: with `g = min(x[c],
    /// limit)` and `u = clamp(x[w + c], -limit, limit)`, `x[c] = g · sigmoid(alpha · g) · (u + 1)`
    /// for `c < w`.
    #[allow(clippy::too_many_arguments)]
    fn swiglu_clamped_halves(&self, x: &mut Self::Buf, row0: usize, n: usize, stride: usize, w: usize, alpha: f32, limit: f32);
    /// Rotates `heads` heads per token: head `h` of token `t` starts at
    /// `t * stride + off + h * head_stride`; `cos`/`sin` hold `rotary_dim / 2` values per token.
    fn rope(
        &self,
        x: &mut Self::Buf,
        n: usize,
        stride: usize,
        off: usize,
        heads: usize,
        head_stride: usize,
        cos: &[f32],
        sin: &[f32],
        interleaved: bool,
    );
    /// Copies `width` floats of each of `n` rows from `src` (row stride `src_stride`, offset
    /// `src_off`) to `dst` (row stride `dst_stride`, offset `dst_off`).
    fn copy_strided(
        &self,
        src: &Self::Buf,
        src_stride: usize,
        src_off: usize,
        dst: &mut Self::Buf,
        dst_stride: usize,
        dst_off: usize,
        width: usize,
        n: usize,
    );
    /// `dst[i, :] = src[rows[i], :]` for rows of `dim`.
    fn gather_rows(&self, src: &Self::Buf, dim: usize, rows: &[usize], dst: &mut Self::Buf);
    /// `dst[rows[i], :] = src[i, :]` for rows of `dim`.
    fn scatter_rows(&self, src: &Self::Buf, dim: usize, rows: &[usize], dst: &mut Self::Buf);
    /// `out[t, :] += Σ_s weights[t * k + s] · src[t * k + s, :]` for `n` tokens, in slot order.
    fn add_weighted_slots(&self, src: &Self::Buf, dim: usize, n: usize, k: usize, weights: &[f32], out: &mut Self::Buf);
    /// `x[t, :] *= s[t]`.
    fn scale_rows(&self, x: &mut Self::Buf, dim: usize, s: &[f32]);
    /// [`add_weighted_slots`](Self::add_weighted_slots) over rows of `src` where they lie:
    /// slot `t × k + s`'s row is `rows.0[t × k + s]`, and `rows.1` is the inverse (slot of each
    /// row). The default moves them to slot order in `slots` (`scatter_rows` by `rows.1`) and
    /// sums there; a backend may read them in place, with the same sums in the same order.
    #[allow(clippy::too_many_arguments)]
    fn add_weighted_rows(
        &self,
        src: &Self::Buf,
        dim: usize,
        n: usize,
        k: usize,
        weights: &[f32],
        rows: (&[usize], &[usize]),
        slots: &mut Self::Buf,
        out: &mut Self::Buf,
    ) {
        self.scatter_rows(src, dim, rows.1, slots);
        self.add_weighted_slots(slots, dim, n, k, weights, out);
    }
    /// Runs `f(i0, i1)` over ranges covering `0..n` of independent host-side items (a prefill
    /// chunk's tokens to route), each about `cost` row-op elements of work: spread over the
    /// host threads the backend keeps (the CPU's pool) when that pays, else at once here.
    fn host_ranges(&self, n: usize, _cost: usize, f: &(dyn Fn(usize, usize) + Sync)) {
        if n > 0 {
            f(0, n)
        }
    }

    /// Routes `n` tokens where their router logits lie: `logits` `[n, experts]` through
    /// `rule` (with `bias`, the router's correction bias, where the rule has one) into `routes`
    /// `[n, 2k]` from float `at` on: each token's `k` expert ids (as f32 values, exact below 2^24), best first, then
    /// their mixing weights, as [`RouterRule::route`] computes them on the host. A device
    /// backend routes without sending the logits to the host, so that the decoder need not
    /// wait for the device at every MoE layer (see [`Self::kept_experts`]).
    fn route(&self, rule: &RouterRule, logits: &Self::Buf, bias: Option<&Self::Vector>, n: usize, routes: &mut Self::Buf, at: usize);

    /// The router's logits and their routes: [`Self::matmul`] of all of `router` over `n` rows of
    /// `input` into `logits` (`[n, experts]`), then [`Self::route`] of them into `routes` from
    /// `at`. A backend may do both in one pass (the CUDA backend can route a decoded token in
    /// the router product's last block: one launch, and one wait between kernels, fewer a layer);
    /// `logits` and `routes` must come out as the two ops leave them.
    #[allow(clippy::too_many_arguments)]
    fn router_and_route(
        &self,
        router: &Self::Matrix,
        input: &Self::Buf,
        n: usize,
        logits: &mut Self::Buf,
        rule: &RouterRule,
        bias: Option<&Self::Vector>,
        routes: &mut Self::Buf,
        at: usize,
    ) {
        self.matmul(router, None, input, n, logits);
        self.route(rule, logits, bias, n, routes, at);
    }

    /// Bytes of routed experts this backend can keep in its own memory (see
    /// [`Self::keep_experts`]); 0 for a backend that computes on the store's views where they
    /// lie, as the CPU backend does.
    fn keep_room(&self) -> u64 {
        0
    }
    /// Offers copies of experts of decoder layer `layer` (whose MoE block has `experts`
    /// experts) to keep: `batch` pairs expert ids with their weights. Returns whether the
    /// backend kept them; once it has kept all of a layer's experts, the decoder runs that
    /// layer's routed experts with [`Self::kept_experts`] (or names them with
    /// [`WeightRef::Kept`]) and no longer asks the store. The default keeps nothing.
    fn keep_experts(&self, _layer: usize, _experts: usize, _batch: &[(u32, ExpertView<'_>)]) -> bool {
        false
    }
    /// The routed experts of a layer whose experts this backend keeps, for `n` tokens routed by
    /// [`Self::route`] into `routes` (`[n, 2k]` from float `at` on): for each (token, slot) pair, SwiGLU through
    /// the slot's expert of `h`'s row — `[gate | up]` into row `token × k + slot` of `gu`
    /// (`2 × moe width` wide), SiLU(gate) · up in its gate half, the down product into the same
    /// row of `slots` (`hidden` wide) — then each token's slots added into `x` with their mixing
    /// weights in slot order: what the decoder computes from the store's views, without
    /// the host seeing the routes. With `limit`, the activation is DeepSeek-V4's clipped SiLU
    /// ([`Self::silu_clamped_halves`]) instead. Only called after [`Self::keep_experts`] kept
    /// the layer.
    #[allow(clippy::too_many_arguments)]
    fn kept_experts(
        &self,
        _layer: usize,
        _routes: &Self::Buf,
        _at: usize,
        _k: usize,
        _h: &Self::Buf,
        _n: usize,
        _gu: &mut Self::Buf,
        _slots: &mut Self::Buf,
        _x: &mut Self::Buf,
        _limit: Option<f32>,
    ) {
        panic!("kept_experts: this backend keeps no experts (keep_experts returned false)");
    }
    /// [`Self::kept_experts`], then [`Self::rms_norm`] of the residual `x` it leaves (`n` rows
    /// of `dim`) with `w` into `h`: the next layer's input norm, where nothing else adds to the
    /// residual in between. `h` is the experts' input first and the norm's output after. A
    /// backend may run the norm in the experts' last launch (the CUDA backend does for a decoded
    /// token); `x` and `h` must come out as the two ops leave them.
    #[allow(clippy::too_many_arguments)]
    fn kept_experts_norm(
        &self,
        layer: usize,
        routes: &Self::Buf,
        at: usize,
        k: usize,
        h: &mut Self::Buf,
        n: usize,
        gu: &mut Self::Buf,
        slots: &mut Self::Buf,
        x: &mut Self::Buf,
        limit: Option<f32>,
        dim: usize,
        w: &Self::Vector,
        eps: f32,
    ) {
        self.kept_experts(layer, routes, at, k, h, n, gu, slots, x, limit);
        self.rms_norm(x, n, dim, w, eps, h);
    }
    /// Whether [`Self::kept_experts`] takes a step of `n` tokens in kept layer `layer` (whose
    /// experts' activation is clamped at `limit`, as `kept_experts` gets it), where no sequence
    /// brings more than `run` of them (a prompt's tokens tend to choose the same experts;
    /// sequences' decode tokens spread over them): for a few tokens its products on the device
    /// cost less than grouping the pairs by expert on the host (a wait for the device per
    /// layer); beyond, the decoder routes on the backend and groups on the host.
    fn kept_takes(&self, _layer: usize, _limit: Option<f32>, n: usize, _run: usize) -> bool {
        n <= 4
    }

    /// Stores `n` key (and value) rows for positions `pos0..pos0 + n` of `layer`.
    fn kv_store(
        &self,
        cache: &mut Self::KvCache,
        layer: usize,
        pos0: usize,
        n: usize,
        k: &Self::Buf,
        k_stride: usize,
        k_off: usize,
        v: Option<(&Self::Buf, usize, usize)>,
    );
    /// Causal attention of `n` queries at positions `pos0..` over cached positions
    /// `0..pos0 + n` (within `p.window`, with `p.sinks` in the denominators, only the positions
    /// of `p.selected` where given): `q` rows (every `q_stride` floats) start with `q_heads * k_dim` values,
    /// `out` rows hold `q_heads * v_dim`.
    fn attention(
        &self,
        cache: &Self::KvCache,
        layer: usize,
        q: &Self::Buf,
        q_stride: usize,
        n: usize,
        pos0: usize,
        p: AttnParams<'_>,
        out: &mut Self::Buf,
    );
    /// Whether [`Self::attention_batch`] takes several sequences with `p` at once. Without it
    /// the decoder runs [`Self::attention`] sequence by sequence.
    fn batches_attention(&self, _p: &AttnParams<'_>) -> bool {
        false
    }
    /// [`Self::attention`] of several sequences of a step in one call, each over its own cache
    /// at `layer`: sequence `s`'s queries are rows `s.row..s.row + s.n` of `q` (`q_stride`
    /// apart), its outputs the same rows of `out`; each sequence's outputs are the bits
    /// `attention` gives it alone. Only called where [`Self::batches_attention`].
    fn attention_batch(
        &self,
        _layer: usize,
        _seqs: &[SeqQueries<'_, Self::KvCache>],
        _q: &Self::Buf,
        _q_stride: usize,
        _p: AttnParams<'_>,
        _out: &mut Self::Buf,
    ) {
        unreachable!("attention_batch on a backend that does not batch attention")
    }
}
