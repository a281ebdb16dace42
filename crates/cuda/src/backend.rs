//! [`CudaBackend`]: the engine's [`Backend`] on one NVIDIA GPU.
//!
//! Dense weights are copied to VRAM once, in their block formats; activations, norms and the KV
//! cache live in VRAM; every op is a kernel on one stream, so ops are ordered without events and
//! the host waits only where the decoder downloads (router logits, final logits). Routed experts
//! arrive as host views of the expert store's slots and are mirrored in a VRAM cache keyed by
//! slot handle ([`crate::experts`]); a batch's missing experts are copied on a second stream
//! from page-locked host memory ([`crate::pinned`]) while the products of those already in VRAM
//! run, joined to the compute stream by events. Small host inputs of an op (row lists, mixing weights,
//! RoPE tables) go through a page-locked staging ring ([`crate::staging`]); batches of products pass their job table as a
//! kernel parameter.
//!
//! The trait's ops cannot fail, but a GPU can (out of memory, a failed launch): the first
//! error is kept, later ops do nothing, and [`Backend::fault`] reports it, which the engine
//! turns into an error after loading and after each forward call.

mod compressed;
mod delta;
mod fused;
mod kept_step;
mod seqs;
mod sparse;

pub use crate::buf::CudaBuf;
use crate::buf::{dptr, QuantRows};
use crate::experts::{ExpertCache, ExpertStats, HEADROOM};
use crate::kept::KeptExperts;
use crate::launch::Launch;
use crate::misses::{MissMode, MissPolicy, Route};
use crate::pinned::PinnedHost;
use crate::staging::Staging;
use crate::{compile_kernels, DeviceInfo};
use cudarc::driver::{sys, CudaContext, CudaEvent, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, DriverError, LaunchConfig};
use smoe_engine::backend::{
    check, check_rows, AttnParams, Backend, CompressWindows, CompressedParams, IndexQueries, KvShape, MatJob, QkvRows, RopeTables,
    SeqQueries, SeqStore, WeightRef,
};
use smoe_engine::routing::RouterRule;
use smoe_engine::{CpuBackend, Precision};
use smoe_quant::{Format, Layout, QMatrix};
use smoe_store::ExpertView;
use smoe_vault::Router;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Products per launch: the job table is a kernel parameter (4 KiB at most).
const MAX_JOBS: usize = 48;
/// Up to this many tokens a product is a mat-vec (a warp per row, the weights read once);
/// beyond, tiled.
const MV_TOKENS: usize = 8;
/// Most tokens of a step that go through the kept experts' kernels ([`crate::kept`]) pair by
/// pair, rather than grouped by expert on the host after a download of the routes (a wait per
/// layer); a layer whose kept experts run on int8 tiles takes up to [`KEPT_TILE_TOKENS`]. On an
/// H100, 48-layer Qwen3-30B-A3B shape, batched decode at 64 against 4 (pair by pair): 8
/// sequences 813 against 561 tok/s, 16: 1,187 against 800, 32: 1,427 against 1,063, 64: 1,521
/// against 1,433. Prefill chunks stay grouped on the host.
const KEPT_TOKENS: usize = 64;

/// Most tokens of a step that go through the kept experts of a layer whose experts run on int8
/// tiles ([`CudaBackend::tiles_take`]), rather than being grouped on the host, where no
/// sequence brings more than [`KEPT_TILE_RUN`] of them. On an H100, 48-layer Qwen3-30B-A3B
/// shape, batched decode with steps of up to 256 on the tiles against the host's grouping
/// above 64: 96 sequences 2,867–2,903 against 2,010–2,089 tok/s, 128: 3,265–3,281 against
/// 2,514, 192: 3,625–3,701 against 3,104–3,142, 256: 3,792–3,996 against 3,572–3,621.
const KEPT_TILE_TOKENS: usize = 256;

/// Most tokens one sequence may bring to a step whose kept experts go to the tiles beyond
/// [`KEPT_TOKENS`]. A prompt's tokens choose the same experts more than different sequences'
/// tokens do, and a block takes its expert's pairs 16 at a time, staging its rows again for
/// each turn: on an H100 a 256-token prompt prefilled at 4,797–4,821 tok/s on the tiles
/// against 6,897–7,311 grouped on the host, 128 tokens 4,037 against 4,910–4,944, 512 tokens
/// 5,048–5,066 against 9,084–9,176. Decode tokens (and the few-token steps of a draft or a
/// short prompt) are what the tiles win on.
const KEPT_TILE_RUN: usize = 8;

/// Fewest tokens of a step whose kept experts run on int8 tiles (`kept_tiles.cu`), each
/// expert's rows read once for all the pairs that chose it, rather than pair by pair. On an
/// H100, 48-layer Qwen3-30B-A3B shape, aggregate decode tok/s on tiles against pair by pair:
/// 8 sequences 732–745 against 829–831, 16: 1,167–1,187 against 1,235–1,243, 24: 1,449–1,450
/// against 1,403–1,407, 32: 1,690–1,718 against 1,526–1,554, 48: 2,009–2,030 against 1,597,
/// 64: 2,203–2,290 against 1,605–1,676.
const KEPT_TILES_FROM: usize = 24;

/// Rows a block of `mvkq_mix_split` takes for a down matrix of `format` whose rows are `cols`
/// wide and `k` slots a token: a warp per row and two slots, at most 8 warps a block (its
/// shared sums). None where the split kernel does not apply: rows of more than 16 of the int8
/// product's tasks, or more than 16 slots; `mvkq_mix` takes those.
fn mix_split_rows(format: Format, cols: usize, k: usize) -> Option<usize> {
    let tasks = mvq_tasks(format, cols);
    let warps = k.div_ceil(2);
    (tasks <= 16 && (1..=8).contains(&warps)).then(|| 8 / warps)
}

/// Which steps mix their kept experts' down products with `mvkq_mix_split`
/// ([`CudaOptions::kept_split`], `SMOE_CUDA_KEPT_WARPS`).
#[derive(Clone, Copy)]
enum MixSplit {
    Never,
    /// One-token steps (the default), where it measured 1-2% faster on an H100 and 2% on an
    /// H200 (with the prefetch); at 8 and 16 sequences it was 2-4% slower.
    OneToken,
    Always,
}

impl MixSplit {
    fn takes(self, tokens: usize) -> bool {
        match self {
            MixSplit::Never => false,
            MixSplit::OneToken => tokens == 1,
            MixSplit::Always => true,
        }
    }
}

/// Most tokens of a resident matrix's product that go as mat-vecs of [`MV_TOKENS`] each
/// (`SMOE_CUDA_DENSE_MV` says otherwise, up to [`DENSE_MV_MAX`]): see
/// [`CudaBackend::resident_jobs`].
const DENSE_MV_TOKENS: usize = 64;
/// The most tokens `SMOE_CUDA_DENSE_MV` may send to the mat-vecs: a step of up to that many
/// with every resident product giving each token its one-token bits, for measuring and for
/// telling the tiles' rounding from other differences between a batched step and its
/// sequences alone (`diag_seventy` in tests/backend.rs).
const DENSE_MV_MAX: usize = 256;
/// Dynamic shared memory of `mvqm` on rows of `cols` values in `format`: its 16 rows and eight
/// tokens' int8 inputs, each `mvqm_stage_stride` apart (mvqm.cu).
fn mvqm_stage_bytes(format: Format, cols: usize) -> usize {
    let stride = |bytes: usize| bytes.next_multiple_of(128) + 16;
    MVQM_ROWS * stride(format.row_bytes(cols).unwrap_or(usize::MAX / 64)) + MV_TOKENS * stride(cols)
}

/// Fewest tokens a launch's largest job must have for its products in `format` to take `mvqm`
/// rather than `mvqn` (a smaller job in the same launch rides along: 10 tokens go as jobs of 8
/// and 2, one launch, with the same bits either way). Q4_K's terms (two products and two rows'
/// scales a task, for all eight tokens of the tile however few are live) cost more than mvqn's
/// at 2 and 3 tokens: an H100 decoded 2 / 3 / 4 / 5 / 8 sequences of a
/// Q4_K-dense Qwen3-30B-A3B shape at 0.94 / 0.98 / 1.01 / 1.04 / 1.08 of mvqn's rate on mvqm
/// (means of three rounds), where Q8_0 gained from 2 (1.04 / 1.06 / 1.07 / 1.08 / 1.11;
/// 2026-12-07, docs/benchmarks.md).
fn mvqm_min_tokens(format: Format) -> usize {
    if format == Format::Q4_K {
        4
    } else {
        2
    }
}

/// Tasks of a row of `cols` values for the int8 mat-vecs (`mvq_tasks` in kernels.cu, the same
/// function): Q8_0 groups of 32, or Q4_K and Q6_K pairs of groups (64 values).
fn mvq_tasks(format: Format, cols: usize) -> usize {
    if format == Format::Q8_0 {
        cols / 32
    } else {
        cols / 64
    }
}

/// Rows per block of `mvqm` (MVQM_ROWS in mvqm.cu).
const MVQM_ROWS: usize = 16;

/// Rows per block of the int8 mat-vec of `cols` inputs in `format`: MVQ_WARPS × MVQ_ROWS in
/// kernels.cu, divided among the warps that share rows (`mvq_split` there, the same function).
fn mvq_block_rows(format: Format, cols: usize) -> usize {
    let split = if mvq_tasks(format, cols) >= 128 { 4 } else { 1 };
    4 * 2 / split
}

/// Whether attention of `n` queries over a layer of `shape` takes the tiled kernels (many
/// queries, heads up to 128, no windows or sinks: gpt-oss's go to the decode kernel, whose
/// row sees at most its window).
fn attention_tiles(shape: KvShape, n: usize, p: &AttnParams<'_>) -> bool {
    p.window.is_none() && p.sinks.is_none() && n > MV_TOKENS && shape.k_dim <= 128 && shape.v_dim <= 128
}

/// The decode attention kernel's split of the positions `n` queries from `pos0` see with `p`:
/// positions per split, and splits (flash-decoding; 1: unsplit, as many queries are).
fn attention_splits(n: usize, pos0: usize, p: &AttnParams<'_>) -> (usize, usize) {
    let span = pos0 + n - p.first_seen(pos0);
    let split = if span <= 1024 { 32 } else { 128 };
    let splits = if span > split && n <= MV_TOKENS { span.div_ceil(split) } else { 1 };
    (split, splits)
}

/// One product as the kernels read it (`struct Job` in kernels.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Job {
    w: u64,
    row_bytes: u64,
    rows: i32,
    cols: i32,
    x_row: i32,
    n: i32,
    out_row: i32,
    out_col: i32,
}

/// A product as [`CudaBackend::products`] takes it: its format and table entry, and whether,
/// of a few tokens, it goes with the int8 tiles (an expert's, in a chunk of more than
/// [`DENSE_MV_TOKENS`] tokens: there the tiles run anyway, and a few-token mat-vec launch of
/// its own cost a 512-token prefill 2–3% on an H100) or stays on the mat-vec (a resident
/// matrix's 8-token pieces, see [`CudaBackend::resident_jobs`], and batched decode steps,
/// whose 16 and 32 sequences ran 1–6% slower with them on the tiles). Decided by the chunk,
/// never by the cache: an expert's product has the same bits whether it was in VRAM or just
/// copied up.
#[derive(Clone, Copy)]
struct Product {
    format: Format,
    job: Job,
    few_on_tiles: bool,
}

/// A launch's job table (`struct Jobs` in kernels.cu).
#[repr(C)]
#[derive(Clone, Copy)]
struct Jobs {
    count: i32,
    /// Nonzero: each block asks L2 for its weight rows before it waits on the kernel before
    /// (kernels.cu's `mvq_prefetch`; [`CudaOptions::prefetch`]).
    prefetch: i32,
    job: [Job; MAX_JOBS],
}

// SAFETY: plain old data with the C layout of `struct Jobs` in kernels.cu (i32, i32, then 48
// jobs of two u64 and six i32: 40 bytes, 8-aligned), copied by value into the kernel's
// parameters.
unsafe impl DeviceRepr for Jobs {}

/// Products of kept experts as `mvk_*` reads them (`struct Kept` in kernels.cu).
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct KeptJobs {
    base: [u64; 2],
    expert_bytes: [u64; 2],
    row_bytes: u64,
    rows: i32,
    cols: i32,
    k: i32,
    parts: i32,
    experts: i32,
    x_per_pair: i32,
    out_col: [i32; 2],
}

// SAFETY: plain old data with the C layout of `struct Kept` in kernels.cu (five u64, then eight
// i32: 72 bytes, 8-aligned), copied by value into the kernel's parameters.
unsafe impl DeviceRepr for KeptJobs {}

/// Options of a CUDA backend.
#[derive(Clone, Debug, Default)]
pub struct CudaOptions {
    /// Bytes of VRAM for routed experts; `None`: what is free at the first expert product, less
    /// headroom for work buffers.
    pub expert_bytes: Option<u64>,
    /// Where products of experts missing from VRAM run once the tier is full.
    pub misses: MissMode,
    /// The precision of misses computed on the CPU (default: the fast int8-activation path;
    /// the f32 reference lets a test compare the two routes exactly).
    pub miss_precision: Option<Precision>,
    /// Fast (the default): one-token products of the formats with an int8 kernel (Q8_0, Q4_K,
    /// Q6_K) run on int8 activations with dp4a, as the CPU's fast path; Reference: every product in
    /// f32 (the conformance suite's exactness). `SMOE_CUDA_INT8=off` also turns int8 off.
    pub precision: Option<Precision>,
    /// Never keep experts by layer (routed on the GPU), even when all fit: every expert then
    /// goes through the slot-keyed tier and the host's routing. For comparing the two (also
    /// `SMOE_CUDA_KEEP=off`).
    pub no_keep: bool,
    /// Record decoded tokens as CUDA graphs (see [`crate::graph`]) instead of launching each
    /// kernel (also `SMOE_CUDA_GRAPHS=on`). Off by default: on the H200 the graphs decoded
    /// slower than the stream's overlapped launches (docs/benchmarks.md).
    pub graphs: bool,
    /// Prefill products and attention on CUDA cores even where there are tensor cores (what
    /// GPUs before compute 8.0 run; also `SMOE_CUDA_PREFILL=simt`). An option, not only the
    /// variable, so that a test can ask for it without changing what every other backend the
    /// process opens meanwhile reads: a test that set the variable around its own backend's
    /// opening made another test's two backends prefill with different kernels now and then.
    pub simt_prefill: bool,
    /// A batched step's sequences in one launch for attention and its inputs (also
    /// `SMOE_CUDA_BATCH_ATTENTION=on|off`): see `CudaBackend::batch_attention`; `None`: on.
    pub batch_attention: Option<bool>,
    /// Most tokens of a step that [`smoe_engine::Backend::kept_takes`] takes (also
    /// `SMOE_CUDA_KEPT_TOKENS`); `None`: 64.
    pub kept_tokens: Option<usize>,
    /// Steps of at least this many tokens run the kept experts on int8 tiles, each expert's
    /// rows read once for all the pairs that chose it, instead of pair by pair (also
    /// `SMOE_CUDA_KEPT_TILES_FROM`; 0: never); `None`: 24. Where the fused kept kernels run
    /// (Q8_0, Q4_K or Q6_K gate and up in one format, plain SiLU, int8 activations) and the GPU has
    /// int8 tensor cores, with Q8_0 and Q4_K rows of whole 16-byte pieces
    /// ([`smoe_engine::Backend::kept_takes`] decides which steps come here at all).
    pub kept_tiles_from: Option<usize>,
    /// Most tokens [`smoe_engine::Backend::kept_takes`] takes in a layer whose kept experts
    /// run on the tiles, for steps where no sequence brings more than [`Self::kept_tile_run`]
    /// tokens (also `SMOE_CUDA_KEPT_TILE_TOKENS`); `None`: 256, or [`Self::kept_tokens`] where
    /// that is given (so that a test's small `kept_tokens` sends every layer's larger steps to
    /// the host's grouping). Larger steps route on the GPU and group the pairs on the host.
    pub kept_tile_tokens: Option<usize>,
    /// Most tokens one sequence may bring to a step that [`Self::kept_tile_tokens`] applies to
    /// (also `SMOE_CUDA_KEPT_TILE_RUN`); `None`: 8. Prompts longer than that stay with
    /// [`Self::kept_tokens`]: their tokens choose the same experts, which the tiles take in
    /// turns.
    pub kept_tile_run: Option<usize>,
    /// The kept experts' down products mixed by `mvkq_mix_split` (a warp per row and two
    /// slots) in every step (`Some(true)`), in none (`Some(false)`: `mvkq_mix`, a warp per
    /// row), the same bits either way. `None`: `SMOE_CUDA_KEPT_WARPS` (`split`: every step,
    /// `rows`: none), else one-token steps, where it measured 1-2% faster (see kept.cu).
    pub kept_split: Option<bool>,
    /// Weights asked of L2 ahead of their products (`cp.async.bulk.prefetch`, compute 9.0 and
    /// up; kernels.cu's `prefetch_l2`): every int8 mat-vec block (`mvq`, `mvqn`) and f32
    /// mat-vec row of one to eight tokens (`mvs_f32`: the routers) its own rows while the
    /// kernel before it runs, the `attention` kernel (one to eight queries) the cache rows its
    /// blocks read, and a one-token step's kept SwiGLU all its experts' gate, up and down as
    /// soon as the routes are known. The same bits either way. `None`: on unless
    /// `SMOE_CUDA_PREFETCH=off`.
    pub prefetch: Option<bool>,
    /// A decoded token's router product and its routing in one launch (`mvs_f32_route`, see
    /// [`smoe_engine::Backend::router_and_route`]), meant to give the two kernels' bits.
    /// `None`: off unless `SMOE_CUDA_FUSED_ROUTE=on`. Its tests pass on an H100
    /// (`fused_router_and_route_give_the_two_kernels_bits`, the int8 suite's fourth pass), but
    /// one-token decode ran level with it (313.7–313.9 against 314.0–314.7 tok/s, 2026-12-07),
    /// so it stays opt-in.
    pub fused_route: Option<bool>,
    /// A decoded token's norms in the launch before them, meant to give the two kernels' bits:
    /// the attention output projection with the residual add and the next norm
    /// (`mvq_add_norm`, see [`smoe_engine::Backend::matmul_add_rms_norm`]), and the kept
    /// experts' split mix with the next layer's input norm (`mvkq_mix_split_norm`, see
    /// [`smoe_engine::Backend::kept_experts_norm`]). `None`: off unless
    /// `SMOE_CUDA_FUSED_NORM=on`. Its test passes on an H100
    /// (`fused_norms_give_the_two_kernels_bits`), but one-token decode ran 24% slower with it
    /// (239.8–241.0 against 314.0–314.7 tok/s, 2026-12-07): the one block that norms the row
    /// after all the others finish took longer than the norm's own launch. Opt-in, for the
    /// next attempt.
    pub fused_norm: Option<bool>,
    /// Q8_0 and Q4_K products of 2 to 8 tokens (a batched step's dense products) on int8 tensor
    /// cores (`mvqm_q8_0`, `mvqm_q4_k`, mvqm.cu), each token with the bits of its one-token
    /// product as `mvqn` gives them, for rows of more than 16 tasks (Q8_0 groups of 32, Q4_K
    /// pairs of 64 values; Q4_K from 4 tokens), where the GPU has int8 tensor cores and the
    /// block's 16 rows and inputs fit its shared memory. `None`: on, unless
    /// `SMOE_CUDA_FEW_MMA=off`. On an H100 it took an eight-sequence step of a Qwen3-30B-A3B
    /// shape from 1,022–1,040 to 1,130–1,164 tok/s with Q8_0 dense weights, and from 978–981
    /// to 1,098–1,101 with Q4_K (2026-12-07, docs/benchmarks.md).
    pub few_mma: Option<bool>,
    /// Warps a block of `mvqm` (4 or 8), which share its 16 rows' groups. `None`:
    /// `SMOE_CUDA_FEW_MMA_WARPS`, else 4 (8 was within 4% of it either way on an H100). Either
    /// gives each token its one-token bits.
    pub few_mma_warps: Option<u32>,
}

/// The one-token int8-activation kernels of a format (kernels.cu, kept.cu).
struct Int8Kernels {
    /// One-token products named by jobs.
    mvq: CudaFunction,
    /// Products of 2 to [`MV_TOKENS`] tokens named by jobs: the one-token product's
    /// arithmetic for each token, the weights read once for all of them.
    mvqn: CudaFunction,
    /// Products of kept experts, routed on the device.
    mvkq: CudaFunction,
    /// A one-token product with the residual add and norm after it (`mvq_add_norm`).
    add_norm: CudaFunction,
    /// Kept experts' gate and up with SiLU(gate) · up and its int8 copy (`mvkq_swiglu`).
    swiglu: CudaFunction,
    /// Kept experts' down products mixed into the residual (`mvkq_mix`: a warp a row).
    mix: CudaFunction,
    /// The same, a warp per row and two slots (`mvkq_mix_split`; see [`mix_split_rows`]).
    mix_split: CudaFunction,
    /// That of one token with the next layer's input norm after it (`mvkq_mix_split_norm`).
    mix_split_norm: CudaFunction,
    /// A batched step's kept experts on int8 tensor cores, each expert's rows read once for all
    /// of its pairs (`kept_tiles.cu`): gate and up with SiLU(gate) · up, then the down
    /// products, one output row per pair.
    tiles: KeptTileKernels,
}

/// The two launches of the kept experts on tiles (`kept_tiles.cu`).
struct KeptTileKernels {
    swiglu: CudaFunction,
    down: CudaFunction,
}

/// The kernels of one weight format.
struct FormatKernels {
    /// Mat-vec of one token (fewer registers, so more warps and loads in flight).
    mv1: CudaFunction,
    /// Mat-vec of up to [`MV_TOKENS`] tokens.
    mv: CudaFunction,
    /// Mat-vec of kept experts, routed on the device.
    mvk: CudaFunction,
    /// One-token products on int8 activations, for the formats that have them (Q8_0, Q4_K and
    /// Q6_K).
    mvq: Option<Int8Kernels>,
    /// Many-token products on int8 tensor cores (`mmq.cu`): Q8_0, Q4_K and Q6_K.
    mmq: Option<CudaFunction>,
    /// Products of 2 to [`MV_TOKENS`] tokens on int8 tensor cores with `mvqn`'s bits
    /// (`mvqm.cu`), 4 and 8 warps a block: Q8_0 and Q4_K.
    mvqm: Option<[CudaFunction; 2]>,
    mm: CudaFunction,
    mmt: CudaFunction,
    embed: CudaFunction,
    mt: CudaFunction,
}

struct Kernels {
    formats: Vec<(Format, FormatKernels)>,
    rms_norm: CudaFunction,
    rms_norm_heads: CudaFunction,
    add: CudaFunction,
    silu_mul: CudaFunction,
    silu_mul_halves: CudaFunction,
    swiglu_clamped_halves: CudaFunction,
    add_bias: CudaFunction,
    scale_rows: CudaFunction,
    copy_strided: CudaFunction,
    move_rows: CudaFunction,
    move_rows4: CudaFunction,
    add_weighted_slots: CudaFunction,
    rope: CudaFunction,
    attention: CudaFunction,
    route: CudaFunction,
    quantize_rows: CudaFunction,
    add_rms_norm: CudaFunction,
    qk_rope_store: CudaFunction,
    qk_rope_store_seqs: CudaFunction,
    attention_seqs: CudaFunction,
    silu_quantize: CudaFunction,
    mvs_f32: CudaFunction,
    mvs_f32_route: CudaFunction,
    attention_tiles: CudaFunction,
    attention_mma: CudaFunction,
    attention_mma_d128: CudaFunction,
    mmt_split_f32: CudaFunction,
    sum_slices: CudaFunction,
    layer_norm: CudaFunction,
    index_scores: CudaFunction,
    gather_rows: CudaFunction,
    delta_conv: CudaFunction,
    delta_l2norm: CudaFunction,
    delta_heads: CudaFunction,
    sigmoid_gate: CudaFunction,
    compress_windows: CudaFunction,
    attention_compressed: CudaFunction,
    hc_collapse: CudaFunction,
    hc_expand: CudaFunction,
    silu_clamped: CudaFunction,
}

/// The kernels' name for each weight format.
pub(crate) const FORMAT_NAMES: [(Format, &str); 16] = [
    (Format::F32, "f32"),
    (Format::F16, "f16"),
    (Format::BF16, "bf16"),
    (Format::Q4_0, "q4_0"),
    (Format::Q4_1, "q4_1"),
    (Format::Q5_0, "q5_0"),
    (Format::Q5_1, "q5_1"),
    (Format::Q8_0, "q8_0"),
    (Format::Q2_K, "q2_k"),
    (Format::Q3_K, "q3_k"),
    (Format::Q4_K, "q4_k"),
    (Format::Q5_K, "q5_k"),
    (Format::Q6_K, "q6_k"),
    (Format::MXFP4, "mxfp4"),
    (Format::MXFP8, "mxfp8"),
    (Format::FP8, "fp8"),
];

/// The formats with int8-activation kernels: the one-token family (`Int8Kernels`) and the
/// tensor-core tiles (`mmq`, the kept-expert tiles).
const INT8_FORMATS: [Format; 3] = [Format::Q8_0, Format::Q4_K, Format::Q6_K];

/// Whether the kernels decode `f` (every format the CPU path runs).
fn has_kernels(f: Format) -> bool {
    FORMAT_NAMES.iter().any(|(g, _)| *g == f)
}

impl Kernels {
    fn load(module: &Arc<CudaModule>) -> Result<Kernels, String> {
        let f = |name: &str| module.load_function(name).map_err(|e| format!("kernel {name}: {e}"));
        let formats = FORMAT_NAMES
            .iter()
            .map(|&(fmt, n)| {
                Ok((
                    fmt,
                    FormatKernels {
                        mv1: f(&format!("mv1_{n}"))?,
                        mv: f(&format!("mv_{n}"))?,
                        mvk: f(&format!("mvk_{n}"))?,
                        mvq: if INT8_FORMATS.contains(&fmt) {
                            Some(Int8Kernels {
                                mvq: f(&format!("mvq_{n}"))?,
                                mvqn: f(&format!("mvqn_{n}"))?,
                                mvkq: f(&format!("mvkq_{n}"))?,
                                add_norm: f(&format!("mvq_add_norm_{n}"))?,
                                swiglu: f(&format!("mvkq_swiglu_{n}"))?,
                                mix: f(&format!("mvkq_mix_{n}"))?,
                                mix_split: f(&format!("mvkq_mix_split_{n}"))?,
                                mix_split_norm: f(&format!("mvkq_mix_split_norm_{n}"))?,
                                tiles: KeptTileKernels {
                                    swiglu: f(&format!("kept_tiles_swiglu_{n}"))?,
                                    down: f(&format!("kept_tiles_down_{n}"))?,
                                },
                            })
                        } else {
                            None
                        },
                        mmq: if INT8_FORMATS.contains(&fmt) { Some(f(&format!("mmq_{n}"))?) } else { None },
                        mvqm: match fmt {
                            Format::Q8_0 | Format::Q4_K => Some([f(&format!("mvqm_{n}"))?, f(&format!("mvqm8_{n}"))?]),
                            _ => None,
                        },
                        mm: f(&format!("mm_{n}"))?,
                        mmt: f(&format!("mmt_{n}"))?,
                        embed: f(&format!("embed_{n}"))?,
                        mt: f(&format!("mt_{n}"))?,
                    },
                ))
            })
            .collect::<Result<Vec<_>, String>>()?;
        Ok(Kernels {
            formats,
            rms_norm: f("rms_norm")?,
            rms_norm_heads: f("rms_norm_heads")?,
            add: f("add")?,
            silu_mul: f("silu_mul")?,
            silu_mul_halves: f("silu_mul_halves")?,
            swiglu_clamped_halves: f("swiglu_clamped_halves")?,
            add_bias: f("add_bias")?,
            scale_rows: f("scale_rows")?,
            copy_strided: f("copy_strided")?,
            move_rows: f("move_rows")?,
            move_rows4: f("move_rows4")?,
            add_weighted_slots: f("add_weighted_slots")?,
            rope: f("rope")?,
            attention: f("attention")?,
            route: f("route")?,
            quantize_rows: f("quantize_rows")?,
            add_rms_norm: f("add_rms_norm")?,
            qk_rope_store: f("qk_rope_store")?,
            qk_rope_store_seqs: f("qk_rope_store_seqs")?,
            attention_seqs: f("attention_seqs")?,
            silu_quantize: f("silu_quantize")?,
            mvs_f32: f("mvs_f32")?,
            mvs_f32_route: f("mvs_f32_route")?,
            attention_tiles: f("attention_tiles")?,
            attention_mma: f("attention_mma")?,
            attention_mma_d128: f("attention_mma_d128")?,
            mmt_split_f32: f("mmt_split_f32")?,
            sum_slices: f("sum_slices")?,
            layer_norm: f("layer_norm")?,
            index_scores: f("index_scores")?,
            gather_rows: f("gather_rows")?,
            delta_conv: f("delta_conv")?,
            delta_l2norm: f("delta_l2norm")?,
            delta_heads: f("delta_heads")?,
            sigmoid_gate: f("sigmoid_gate")?,
            compress_windows: f("compress_windows")?,
            attention_compressed: f("attention_compressed")?,
            hc_collapse: f("hc_collapse")?,
            hc_expand: f("hc_expand")?,
            silu_clamped: f("silu_clamped")?,
        })
    }

    fn format(&self, fmt: Format) -> &FormatKernels {
        &self.formats.iter().find(|(f, _)| *f == fmt).expect("every Format has kernels (FORMAT_NAMES)").1
    }
}

/// A weight matrix in VRAM, in its block format.
pub struct CudaMatrix {
    data: CudaSlice<u8>,
    format: Format,
    rows: usize,
    cols: usize,
    row_bytes: usize,
}

/// An f32 vector in VRAM.
pub struct CudaVector {
    data: CudaSlice<f32>,
    len: usize,
}

/// Positions a layer with [`KvShape::keep`] drops at a time (at least): each drop moves the rows
/// it keeps to the buffer's start, so dropping in steps amortises the copies.
const KV_DROP_STEP: usize = 128;

struct KvLayer {
    shape: KvShape,
    k: Option<CudaSlice<f32>>,
    v: Option<CudaSlice<f32>>,
    /// Rows allocated.
    cap: usize,
    /// The first position held (rows before it dropped, see [`KvShape::keep`]): row `i` of
    /// the buffers holds position `base + i`.
    base: usize,
    /// Positions stored (`base..len` held).
    len: usize,
}

impl KvLayer {
    /// The positions `n` queries from `pos0` see with `p` are held, and stored.
    fn check_attention(&self, n: usize, pos0: usize, p: &AttnParams<'_>) {
        assert!(pos0 + n <= self.len, "attention: positions up to {} but {} cached", pos0 + n, self.len);
        assert!(p.first_seen(pos0) >= self.base, "attention: position {} was dropped (held from {})", p.first_seen(pos0), self.base);
        assert!(self.stored(), "attention: keys and values stored before attention");
    }
    fn k_width(&self) -> usize {
        self.shape.heads * self.shape.k_dim
    }
    fn v_width(&self) -> usize {
        if self.shape.values_in_keys {
            0
        } else {
            self.shape.heads * self.shape.v_dim
        }
    }
    /// Rows a bounded layer ([`KvShape::keep`]) ever holds in steps of up to KV_DROP_STEP
    /// tokens: `keep` before a step, up to KV_DROP_STEP more not yet dropped, the step's own
    /// (unbounded layers: any number).
    fn bounded_rows(&self) -> usize {
        self.shape.keep.map_or(usize::MAX, |k| k + 2 * KV_DROP_STEP)
    }
    /// Whether keys, and values where they are apart, have been stored (what attention reads).
    fn stored(&self) -> bool {
        self.k.is_some() && (self.shape.values_in_keys || self.v.is_some())
    }
    /// Rows held.
    fn held(&self) -> usize {
        self.len - self.base
    }
    /// The address of position 0's key row (0: none): the buffer's start less the dropped rows,
    /// so that position `p` lies at `+ 4 p × k_width` as if none were dropped. Below `base` it
    /// points before the buffer: the callers read held positions only (they check `base`).
    fn keys(&self, stream: &CudaStream) -> u64 {
        self.k.as_ref().map_or(0, |k| dptr(k, stream).wrapping_sub((4 * self.base * self.k_width()) as u64))
    }
    /// [`Self::keys`] for the values (0: none, or values in the keys).
    fn values(&self, stream: &CudaStream) -> u64 {
        self.v.as_ref().map_or(0, |v| dptr(v, stream).wrapping_sub((4 * self.base * self.v_width()) as u64))
    }
}

/// The KV cache of one sequence, in VRAM.
pub struct CudaKvCache {
    layers: Vec<KvLayer>,
}

/// The CUDA backend. See the module documentation.
pub struct CudaBackend {
    info: DeviceInfo,
    stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    k: Kernels,
    staging: Mutex<Staging>,
    experts: Mutex<ExpertCache>,
    /// Experts kept by layer, routed on the GPU (see [`crate::kept`]).
    kept: Mutex<KeptExperts>,
    /// `CudaOptions::no_keep` and `expert_bytes`: what `keep_room` may offer.
    no_keep: bool,
    expert_cap: Option<u64>,
    /// Expert copies host → VRAM: their own stream, so that they run beside the products
    /// that do not need them.
    copy_stream: Arc<CudaStream>,
    /// The host expert memory, page-locked.
    pinned: Mutex<PinnedHost>,
    /// Copy or CPU for VRAM misses, from measured rates.
    misses: Mutex<MissPolicy>,
    /// The CPU backend that computes misses on the host copy, made at first use.
    cpu: std::sync::OnceLock<CpuBackend>,
    miss_precision: Precision,
    /// `SMOE_CUDA_PROFILE=1`: every launch waited for and timed by kernel, printed at the end
    /// (launch plus run time, on a synchronized stream: for finding where time goes, not speed).
    /// `SMOE_CUDA_PROFILE=host`: nothing waited for; each launch's host time, and the time the
    /// host waits for the device in downloads (whether decode is bound by the GPU or by the
    /// host queueing its kernels).
    profile: Option<Mutex<std::collections::HashMap<&'static str, (u64, f64)>>>,
    profile_sync: bool,
    /// When the profile's first row was written: its wall time, printed beside the rows, shows
    /// how much of the run the host spent outside the profiled calls.
    profile_start: std::sync::OnceLock<std::time::Instant>,
    /// One-token products on int8 activations where the format has a kernel (`Precision::Fast`).
    int8: bool,
    /// Many-token products of those formats on int8 tensor cores (`mmq.cu`, and a batched
    /// step's kept experts, `kept_tiles.cu`); off (`SMOE_CUDA_PREFILL=tf32`), on 3xTF32 ones
    /// (and the kept experts pair by pair).
    int8_tiles: bool,
    /// A decoded token's kept experts in two launches (kept.cu) where the formats allow;
    /// `SMOE_CUDA_FUSED_KEPT=off`: the four of before.
    kept_fused: bool,
    /// Their quantized inputs (see `quantize_rows` in kernels.cu), reused launch after launch:
    /// one stream orders each product's reads before the next quantization.
    qscratch: Mutex<Option<CudaSlice<u8>>>,
    /// Split attention's partial results (see `merge_splits` in kernels.cu).
    attention_part: Mutex<Option<CudaSlice<f32>>>,
    /// Their tickets (see `split_scratch`).
    attention_tickets: Mutex<Option<CudaSlice<f32>>>,
    /// The ticket of the kernels whose last block finishes their work (`last_block` in
    /// fused.cu: `mvs_f32_route`, `mvq_add_norm`, `mvkq_mix_split_norm`). Each launch leaves it
    /// at 0, and none touches it before its wait on the kernel before: one serves them all.
    ticket: Mutex<Option<CudaSlice<f32>>>,
    /// A decoded token's router product and routing in one launch (`mvs_f32_route`, see
    /// [`Backend::router_and_route`]); [`CudaOptions::fused_route`], opt-in.
    fused_route: bool,
    /// Launches of `mvs_f32_route` ([`Self::fused_route_steps`]).
    fused_route_steps: AtomicUsize,
    /// A decoded token's output projection, residual add and norm in one launch
    /// (`mvq_add_norm`, see [`Backend::matmul_add_rms_norm`]); [`CudaOptions::fused_norm`].
    fused_norm: bool,
    /// Launches of `mvq_add_norm` ([`Self::fused_norm_steps`]).
    fused_norm_steps: AtomicUsize,
    /// Launches of `mvkq_mix_split_norm` ([`Self::mix_norm_steps`]).
    mix_norm_steps: AtomicUsize,
    /// [`CudaOptions::few_mma`], where the int8 tiles run (int8 tensor cores).
    few_mma: bool,
    /// [`CudaOptions::few_mma_warps`]: 4 or 8.
    few_mma_warps: u32,
    /// Dynamic shared memory a block may have (the device's opt-in limit, less what `mvqm`
    /// declares): a product whose rows need more goes to `mvqn`.
    stage_limit: usize,
    /// Launches of `mvqm` ([`Self::few_mma_launches`]).
    few_mma_launches: AtomicUsize,
    /// Sparse attention's scratch: the indexer's scores, a query's gathered keys and values.
    sparse_part: Mutex<Option<CudaSlice<f32>>>,
    /// Gated DeltaNet's convolved rows (see `backend/delta.rs`).
    delta_part: Mutex<Option<CudaSlice<f32>>>,
    /// Prefill attention's split runs (see `attention_mma` in attention.cu): their partial
    /// results and a ticket per query tile (see `split_scratch`).
    tile_part: Mutex<Option<CudaSlice<f32>>>,
    tile_tickets: Mutex<Option<CudaSlice<f32>>>,
    /// Keys per run of that split: 128 unless `SMOE_CUDA_ATTENTION_RUN` says (0: unsplit).
    attention_run: usize,
    /// Prefill attention on tensor cores (3xTF32), unless `SMOE_CUDA_ATTENTION=f32` (the f32
    /// tiles, for comparison).
    tensor_core_attention: bool,
    /// Split products' partial sums (see `mmt_split_f32` in kernels.cu).
    split_part: Mutex<Option<CudaSlice<f32>>>,
    /// The rotary tables of the chunk being run (see [`fused::RopeOnDevice`]).
    rope: Mutex<fused::RopeOnDevice>,
    /// Many-token products on tensor cores (compute 8.0+, unless `SMOE_CUDA_PREFILL=simt`).
    tensor_cores: bool,
    /// Kernels launched with programmatic dependent launch (compute 9.0+, unless
    /// `SMOE_CUDA_PDL=off`; see [`crate::launch`]).
    pdl: bool,
    /// Tokens of the chunk being run (set by `embed`, which starts each chunk). Only the
    /// launches of a few ([`MV_TOKENS`]) overlap: prefill's large kernels ran slower overlapped
    /// (1,459 against 1,674 tok/s for 512 tokens on the H200) while decode ran faster (224.9
    /// against 196.9 tok/s). In a chunk of more than [`DENSE_MV_TOKENS`] (a prefill's) experts'
    /// few-token products join the tiles (see [`Product`]).
    chunk_tokens: AtomicUsize,
    /// The GPU's multiprocessors.
    sms: usize,
    /// [`DENSE_MV_TOKENS`], or what `SMOE_CUDA_DENSE_MV` says up to [`DENSE_MV_MAX`] (8 or
    /// less: never).
    dense_mv_tokens: usize,
    /// Whether experts' few-token products join the tiles in a prefill's chunks (see
    /// [`Product`]); `SMOE_CUDA_FEW_MV_JOIN=off`: they stay on the mat-vec.
    few_mv_join: bool,
    /// Whether f32 products of two to [`MV_TOKENS`] tokens (a batched step's router) take the
    /// block-per-row `mvs_f32` as one token does, and up to `dense_mv_tokens` of a matrix of
    /// few rows as such products of eight tokens each ([`CudaBackend::resident_jobs`]): each
    /// token's router with its one-token bits. `SMOE_CUDA_F32_FEW=warps`: the warp-per-row
    /// mat-vec and the 3xTF32 tiles they took before, for comparing.
    f32_few_blocks: bool,
    /// [`CudaOptions::kept_tokens`].
    kept_tokens: usize,
    /// The fused kept-expert kernels' grid with the pairs (tokens) fastest, so that pairs
    /// sharing an expert read it together (`kept.cu`); `SMOE_CUDA_KEPT_ORDER=rows`: the rows
    /// fastest, as before.
    kept_pairs_first: bool,
    /// [`CudaOptions::kept_split`] with the environment read.
    kept_split: MixSplit,
    /// [`CudaOptions::prefetch`] with the environment read.
    prefetch: bool,
    /// Layers' one-token steps whose kept SwiGLU asked L2 for the step's experts
    /// ([`Self::kept_prefetch_steps`]).
    kept_prefetch_steps: AtomicUsize,
    /// Layers' steps whose kept experts' down products were mixed by `mvkq_mix_split`
    /// ([`Self::kept_split_steps`]).
    kept_split_steps: AtomicUsize,
    /// [`CudaOptions::kept_tiles_from`] (`usize::MAX`: never).
    kept_tiles_from: usize,
    /// [`CudaOptions::kept_tile_tokens`].
    kept_tile_tokens: usize,
    /// [`CudaOptions::kept_tile_run`].
    kept_tile_run: usize,
    /// Layers' steps whose kept experts ran on the int8 tiles ([`Self::kept_tile_steps`]).
    kept_tile_steps: AtomicUsize,
    /// A batched step's sequences in one launch for attention and its inputs ([`seqs`]); with
    /// `SMOE_CUDA_BATCH_ATTENTION=off`, sequence by sequence (four launches per sequence per
    /// layer). On an H100 one launch took 16 sequences from 490 to 835 tok/s.
    batch_attention: bool,
    faulted: AtomicBool,
    fault: Mutex<Option<String>>,
    /// One-token steps recorded and launched as CUDA graphs (see [`crate::graph`]):
    /// `CudaOptions::graphs`, never under the synchronizing profile.
    graphs: bool,
    graph: Mutex<crate::graph::StepGraph>,
}

/// Threads of a norm's block (one block a row): up to 1024, so that a decoded token's row of a
/// few thousand takes two or three passes, not eight (at 256 threads a norm with its int8 copy
/// took 12 µs, almost all of it one thread's chain of loads and shuffles).
fn norm_threads(dim: usize) -> u32 {
    dim.next_multiple_of(32).clamp(32, 1024) as u32
}

fn cfg_elems(n: usize) -> LaunchConfig {
    LaunchConfig { grid_dim: (n.div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}

impl CudaBackend {
    /// Opens GPU `ordinal`: compiles (or loads from the kernel cache) the kernels for its
    /// architecture. Fails with one line when there is no usable GPU.
    pub fn open(ordinal: usize, opts: &CudaOptions) -> Result<CudaBackend, String> {
        let info = crate::probe()?.into_iter().nth(ordinal).ok_or_else(|| format!("no GPU cuda:{ordinal}"))?;
        let ctx = CudaContext::new(ordinal).map_err(|e| format!("cuda:{ordinal}: {e}"))?;
        // SAFETY: everything this backend allocates is used on its compute stream, in order,
        // except the expert copies, which `matmul_many` orders with explicit events; cudarc's
        // per-buffer events are not needed (and would cost a record per use).
        unsafe { ctx.disable_event_tracking() };
        let ptx = compile_kernels(info.compute_capability)?;
        let module = ctx.load_module(ptx).map_err(|e| format!("loading the kernels: {e}"))?;
        let k = Kernels::load(&module)?;
        let stream = ctx.new_stream().map_err(|e| format!("cuda:{ordinal}: {e}"))?;
        let copy_stream = ctx.new_stream().map_err(|e| format!("cuda:{ordinal}: {e}"))?;
        let pinned = PinnedHost::new(ctx.clone());
        let experts = ExpertCache::new(opts.expert_bytes);
        let prefill = std::env::var("SMOE_CUDA_PREFILL");
        let tensor_cores = info.compute_capability.0 >= 8 && !opts.simt_prefill && prefill.as_deref() != Ok("simt");
        let int8 = opts.precision.unwrap_or(Precision::Fast) == Precision::Fast && std::env::var("SMOE_CUDA_INT8").as_deref() != Ok("off");
        let int8_tiles = int8 && tensor_cores && prefill.as_deref() != Ok("tf32");
        let pdl = info.compute_capability.0 >= 9 && std::env::var("SMOE_CUDA_PDL").as_deref() != Ok("off");
        // The kernels' prefetch is compiled for compute 9.0 and up only.
        let prefetch =
            info.compute_capability.0 >= 9 && opts.prefetch.unwrap_or_else(|| std::env::var("SMOE_CUDA_PREFETCH").as_deref() != Ok("off"));
        let sms =
            ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT).map_or(0, |n| n as usize);
        // `mvqm` asks for more than the 48 KiB a launch gets unasked (103 KiB for Q8_0 rows of
        // 4096): the device's opt-in limit less the most any of its kernels declares (`sums`).
        // Where either is unknown, `mvqm` is never chosen (a limit of 0).
        let mvqm: Vec<&CudaFunction> = [Format::Q8_0, Format::Q4_K].iter().filter_map(|&f| k.format(f).mvqm.as_ref()).flatten().collect();
        let declared = mvqm.iter().try_fold(0usize, |most, f| {
            let attr = cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES;
            // SAFETY: `f` is a function of a module this backend holds loaded (`k`), so its
            // handle is valid for the call; the call only reads the attribute.
            let n = unsafe { cudarc::driver::result::function::get_function_attribute(f.cu_function(), attr) }.ok()?;
            Some(most.max(n as usize))
        });
        let optin = ctx.attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN).ok();
        let stage_limit = match (optin, declared) {
            (Some(n), Some(d)) => (n as usize).saturating_sub(d),
            _ => 0,
        };
        for f in &mvqm {
            let max = cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            f.set_attribute(max, stage_limit as i32).map_err(|e| format!("cuda:{ordinal}: mvqm's shared memory: {e}"))?;
        }
        let kept_tokens = opts.kept_tokens.or_else(|| std::env::var("SMOE_CUDA_KEPT_TOKENS").ok().and_then(|v| v.parse().ok()));
        Ok(CudaBackend {
            info,
            stream,
            ctx,
            k,
            staging: Mutex::new(Staging::new()),
            experts: Mutex::new(experts),
            kept: Mutex::new(KeptExperts::default()),
            no_keep: opts.no_keep || std::env::var("SMOE_CUDA_KEEP").as_deref() == Ok("off"),
            expert_cap: opts.expert_bytes,
            copy_stream,
            pinned: Mutex::new(pinned),
            misses: Mutex::new(MissPolicy::new(opts.misses)),
            cpu: std::sync::OnceLock::new(),
            miss_precision: opts.miss_precision.unwrap_or(Precision::Fast),
            tensor_cores,
            qscratch: Mutex::new(None),
            rope: Mutex::new(Default::default()),
            attention_part: Mutex::new(None),
            attention_tickets: Mutex::new(None),
            ticket: Mutex::new(None),
            fused_route: opts.fused_route.unwrap_or_else(|| std::env::var("SMOE_CUDA_FUSED_ROUTE").as_deref() == Ok("on")),
            fused_route_steps: AtomicUsize::new(0),
            fused_norm: opts.fused_norm.unwrap_or_else(|| std::env::var("SMOE_CUDA_FUSED_NORM").as_deref() == Ok("on")),
            fused_norm_steps: AtomicUsize::new(0),
            mix_norm_steps: AtomicUsize::new(0),
            few_mma: int8_tiles && opts.few_mma.unwrap_or_else(|| std::env::var("SMOE_CUDA_FEW_MMA").as_deref() != Ok("off")),
            few_mma_launches: AtomicUsize::new(0),
            stage_limit,
            few_mma_warps: match opts.few_mma_warps.or_else(|| std::env::var("SMOE_CUDA_FEW_MMA_WARPS").ok()?.parse().ok()) {
                None => 4,
                Some(w @ (4 | 8)) => w,
                Some(w) => return Err(format!("mvqm takes 4 or 8 warps a block, not {w} (SMOE_CUDA_FEW_MMA_WARPS)")),
            },
            sparse_part: Mutex::new(None),
            delta_part: Mutex::new(None),
            tile_part: Mutex::new(None),
            tile_tickets: Mutex::new(None),
            attention_run: std::env::var("SMOE_CUDA_ATTENTION_RUN").ok().and_then(|r| r.parse().ok()).unwrap_or(128),
            split_part: Mutex::new(None),
            tensor_core_attention: tensor_cores && std::env::var("SMOE_CUDA_ATTENTION").as_deref() != Ok("f32"),
            int8,
            kept_fused: std::env::var("SMOE_CUDA_FUSED_KEPT").as_deref() != Ok("off"),
            int8_tiles,
            profile: std::env::var_os("SMOE_CUDA_PROFILE").map(|_| Mutex::new(Default::default())),
            profile_sync: std::env::var("SMOE_CUDA_PROFILE").as_deref() != Ok("host"),
            profile_start: std::sync::OnceLock::new(),
            pdl,
            chunk_tokens: AtomicUsize::new(1),
            sms,
            batch_attention: opts.batch_attention.unwrap_or_else(|| std::env::var("SMOE_CUDA_BATCH_ATTENTION").as_deref() != Ok("off")),
            dense_mv_tokens: std::env::var("SMOE_CUDA_DENSE_MV")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(DENSE_MV_TOKENS)
                .min(DENSE_MV_MAX),
            few_mv_join: std::env::var("SMOE_CUDA_FEW_MV_JOIN").as_deref() != Ok("off"),
            f32_few_blocks: std::env::var("SMOE_CUDA_F32_FEW").as_deref() != Ok("warps"),
            kept_tokens: kept_tokens.unwrap_or(KEPT_TOKENS),
            kept_pairs_first: std::env::var("SMOE_CUDA_KEPT_ORDER").as_deref() != Ok("rows"),
            kept_split: match (opts.kept_split, std::env::var("SMOE_CUDA_KEPT_WARPS").as_deref()) {
                (Some(true), _) | (None, Ok("split")) => MixSplit::Always,
                (Some(false), _) | (None, Ok("rows")) => MixSplit::Never,
                (None, _) => MixSplit::OneToken,
            },
            kept_split_steps: AtomicUsize::new(0),
            prefetch,
            kept_prefetch_steps: AtomicUsize::new(0),
            kept_tiles_from: match opts
                .kept_tiles_from
                .or_else(|| std::env::var("SMOE_CUDA_KEPT_TILES_FROM").ok().and_then(|v| v.parse().ok()))
                .unwrap_or(KEPT_TILES_FROM)
            {
                0 => usize::MAX,
                t => t,
            },
            kept_tile_tokens: opts
                .kept_tile_tokens
                .or_else(|| std::env::var("SMOE_CUDA_KEPT_TILE_TOKENS").ok().and_then(|v| v.parse().ok()))
                .or(kept_tokens)
                .unwrap_or(KEPT_TILE_TOKENS),
            kept_tile_run: opts
                .kept_tile_run
                .or_else(|| std::env::var("SMOE_CUDA_KEPT_TILE_RUN").ok().and_then(|v| v.parse().ok()))
                .unwrap_or(KEPT_TILE_RUN),
            kept_tile_steps: AtomicUsize::new(0),
            faulted: AtomicBool::new(false),
            fault: Mutex::new(None),
            graphs: (opts.graphs || std::env::var("SMOE_CUDA_GRAPHS").as_deref() == Ok("on"))
                && std::env::var("SMOE_CUDA_PROFILE").map_or(true, |p| p == "host"),
            graph: Mutex::new(crate::graph::StepGraph::new()),
        })
    }

    /// The GPU this backend runs on.
    pub fn device(&self) -> &DeviceInfo {
        &self.info
    }

    /// Whether products of Q8_0, Q4_K and Q6_K run on int8 tensor cores (compute 8.0 and later, int8
    /// activations on): prefill's tiles and a batched step's kept experts on tiles.
    pub fn int8_tiles(&self) -> bool {
        self.int8_tiles
    }

    /// How many layers' steps ran their kept experts on the int8 tiles (`kept_tiles.cu`): the
    /// tiles sum as the host's grouping does, so the logits alone cannot tell which ran.
    pub fn kept_tile_steps(&self) -> usize {
        self.kept_tile_steps.load(Ordering::Relaxed)
    }

    /// Layers' steps whose kept experts' down products were mixed a warp per row and two slots
    /// (`mvkq_mix_split`, see [`CudaOptions::kept_split`]) since the backend opened.
    pub fn kept_split_steps(&self) -> usize {
        self.kept_split_steps.load(Ordering::Relaxed)
    }

    /// Decoded tokens' router products routed in the same launch (`mvs_f32_route`, see
    /// [`Backend::router_and_route`]) since the backend opened.
    pub fn fused_route_steps(&self) -> usize {
        self.fused_route_steps.load(Ordering::Relaxed)
    }

    /// Decoded tokens' output projections added and normed in the same launch (`mvq_add_norm`,
    /// see [`Backend::matmul_add_rms_norm`]) since the backend opened.
    pub fn fused_norm_steps(&self) -> usize {
        self.fused_norm_steps.load(Ordering::Relaxed)
    }

    /// Launches of the few-token products on tensor cores (`mvqm`, see
    /// [`CudaOptions::few_mma`]) since the backend opened.
    pub fn few_mma_launches(&self) -> usize {
        self.few_mma_launches.load(Ordering::Relaxed)
    }

    /// Decoded tokens' kept experts mixed with the next layer's input norm in the same launch
    /// (`mvkq_mix_split_norm`, see [`Backend::kept_experts_norm`]) since the backend opened.
    pub fn mix_norm_steps(&self) -> usize {
        self.mix_norm_steps.load(Ordering::Relaxed)
    }

    /// Layers' one-token steps whose kept SwiGLU asked L2 for the step's experts (see
    /// [`CudaOptions::prefetch`]) since the backend opened.
    pub fn kept_prefetch_steps(&self) -> usize {
        self.kept_prefetch_steps.load(Ordering::Relaxed)
    }

    /// `route`'s parameters after its logits, checked: `n` tokens' routes into `routes` from `at`.
    fn route_args(&self, rule: &RouterRule, bias: Option<&CudaVector>, routes: &mut CudaBuf, at: usize, n: usize) -> RouteArgs {
        let (e, k) = (rule.num_experts(), rule.top_k());
        check_rows("route", routes, 0, 1, 0, at, n * 2 * k);
        let (sigmoid, n_group, topk_group) = match *rule.kind() {
            Router::Softmax => (0i32, 1i32, 1i32),
            Router::SigmoidGrouped { n_group, topk_group, .. } => (1, n_group as i32, topk_group as i32),
            Router::SqrtSoftplus { .. } => (2, 1, 1),
        };
        // The kernel scores one group per lane, and every expert must be choosable.
        assert!((1..=32).contains(&n_group) && k <= e, "route: {n_group} groups, top {k} of {e}");
        if let Some(b) = bias {
            assert!(b.len >= e, "route: {} biases for {e} experts", b.len);
        }
        RouteArgs {
            e: e as i32,
            bias: bias.map_or(0u64, |b| dptr(&b.data, &self.stream)),
            sigmoid,
            n_group,
            topk_group,
            k: k as i32,
            norm: rule.norm_topk_prob() as i32,
            scaling: rule.scaling(),
            routes: routes.at_mut(&self.stream) + (at * 4) as u64,
        }
    }

    /// Whether layer `l`'s kept experts run on the int8 tiles (`kept_tiles.cu`) in steps of
    /// [`CudaOptions::kept_tiles_from`] tokens and more: the fused kept kernels' case (Q8_0,
    /// Q4_K or Q6_K gate and up in one format, down in one of those too, plain SiLU), int8
    /// tensor cores, and Q8_0 and Q4_K rows of whole 16-byte pieces (their weights are staged
    /// 16 bytes at a time; Q6_K's 2 at a time).
    fn tiles_take(&self, l: &crate::kept::KeptLayer, limit: Option<f32>) -> bool {
        let [gate, up, down] = &l.parts;
        let int8 = |p: &crate::kept::KeptPart| self.int8 && self.k.format(p.format).mvq.is_some();
        self.int8_tiles
            && self.kept_fused
            && self.kept_tiles_from != usize::MAX
            && limit.is_none()
            && int8(gate)
            && int8(down)
            && gate.format == up.format
            && gate.rows.is_multiple_of(32)
            && l.parts.iter().all(|p| p.format == Format::Q6_K || p.row_bytes.is_multiple_of(16))
    }

    /// Counters of the VRAM expert cache.
    pub fn expert_stats(&self) -> ExpertStats {
        self.experts.lock().expect("expert cache lock").stats()
    }

    fn faulted(&self) -> bool {
        self.faulted.load(Ordering::Relaxed)
    }

    /// Ends the capture of a step (see [`crate::graph`]), launching what was recorded, before
    /// work that must not be recorded: a download, a synchronization, an allocation, a copy
    /// from pageable memory, the copy stream's traffic.
    fn settle(&self) {
        if !self.graphs {
            return;
        }
        let mut g = self.graph.lock().expect("graph lock");
        if g.capturing() {
            let r = g.end(&self.stream);
            drop(g);
            self.ok("launching a step's graph", r);
        }
    }

    /// Starts recording a one-token step (see [`crate::graph`]).
    fn begin_step_graph(&self) {
        if !self.graphs || self.faulted() {
            return;
        }
        let r = self.graph.lock().expect("graph lock").begin(&self.stream);
        self.ok("recording a step", r);
    }

    /// Keeps the first device error; ops after it do nothing.
    fn record(&self, op: &str, e: impl std::fmt::Display) {
        let mut f = self.fault.lock().expect("fault lock");
        if f.is_none() {
            *f = Some(format!("{} {op}: {e}", self.info.short()));
        }
        self.faulted.store(true, Ordering::Relaxed);
    }

    fn ok<T>(&self, op: &str, r: Result<T, DriverError>) -> Option<T> {
        r.map_err(|e| {
            // Out of memory says how much there was: a dense part too large for this GPU is
            // refused with the numbers.
            if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
                let (free, total) = self.ctx.mem_get_info().unwrap_or((0, 0));
                self.record(op, format!("{e} ({} MiB free of {} MiB)", free >> 20, total >> 20));
            } else {
                self.record(op, e);
            }
        })
        .ok()
    }

    fn launch(&self, mut args: Launch<'_>, cfg: LaunchConfig, op: &'static str) {
        if cfg.grid_dim.0 == 0 || cfg.grid_dim.1 == 0 || cfg.grid_dim.2 == 0 {
            return;
        }
        let t = self.profile.as_ref().map(|_| std::time::Instant::now());
        let overlap = self.pdl && self.chunk_tokens.load(Ordering::Relaxed) <= MV_TOKENS;
        // SAFETY: every caller pushes arguments matching its kernel's parameter list in
        // kernels.cu (64-bit device pointers for pointers, i32 for int, f32 for float, `Jobs`
        // by value), has checked on the host that the rows the kernel touches lie inside the
        // buffers behind those pointers, and each kernel guards its thread indices against the
        // extents it is given; every kernel there runs PDL_START before it reads anything an
        // earlier kernel wrote (before it, at most the kernel's parameters, prefetch hints for
        // L2, see `prefetch_l2`, and weights, which only copies write, and a copy before a
        // kernel is never overlapped: `mvqm` stages its rows there), so overlapping is safe.
        let r = unsafe { args.launch(&self.stream, cfg, overlap) };
        self.ok(op, r);
        if let Some(t) = t {
            if self.profile_sync {
                self.settle();
                let _ = self.stream.synchronize();
            }
            self.profiled(op, t);
        }
    }

    /// Adds the time since `t` to `op`'s row of the profile.
    fn profiled(&self, op: &'static str, t: std::time::Instant) {
        if let Some(p) = &self.profile {
            self.profile_start.get_or_init(|| t);
            let mut p = p.lock().expect("profile lock");
            let e = p.entry(op).or_insert((0, 0.0));
            e.0 += 1;
            e.1 += t.elapsed().as_secs_f64();
        }
    }

    /// An empty device slice: what a buffer of no elements, or one whose allocation failed
    /// (the fault is kept), holds.
    fn empty<T>(&self) -> CudaSlice<T> {
        self.stream.null().expect("an empty device slice needs no memory")
    }

    /// A copy of `values` in VRAM (empty when there are none, or after a fault).
    fn upload_new<T: DeviceRepr>(&self, op: &str, values: &[T]) -> CudaSlice<T> {
        self.settle();
        let data = if self.faulted() || values.is_empty() { None } else { self.ok(op, self.stream.clone_htod(values)) };
        data.unwrap_or_else(|| self.empty())
    }

    fn alloc_f32(&self, op: &str, len: usize) -> Option<CudaSlice<f32>> {
        self.settle();
        self.ok(op, self.stream.alloc_zeros::<f32>(len.max(1)))
    }

    /// Queues a copy of `len` bytes written by `fill` to the GPU (see [`Staging`]) and returns
    /// their device address, valid for the kernels queued next.
    fn stage(&self, op: &str, len: usize, fill: impl FnOnce(&mut [u8])) -> Option<u64> {
        let mut staging = self.staging.lock().expect("staging lock");
        if !staging.fits(len) {
            self.settle(); // the ring waits for the stream, or grows
        }
        let r = staging.stage(&self.stream, len, fill);
        self.ok(op, r)
    }

    /// [`Self::stage`] of f32 values, back to back.
    fn stage_f32(&self, op: &str, parts: &[&[f32]]) -> Option<u64> {
        let len = parts.iter().map(|p| 4 * p.len()).sum();
        self.stage(op, len, |dst| {
            for (d, v) in dst.chunks_exact_mut(4).zip(parts.iter().flat_map(|p| p.iter())) {
                d.copy_from_slice(&v.to_ne_bytes());
            }
        })
    }

    /// [`Self::stage`] of indices as the kernels' 32-bit ints.
    fn stage_i32(&self, op: &str, values: impl ExactSizeIterator<Item = usize>) -> Option<u64> {
        self.stage(op, 4 * values.len(), |dst| {
            for (d, v) in dst.chunks_exact_mut(4).zip(values) {
                d.copy_from_slice(&(v as i32).to_ne_bytes());
            }
        })
    }

    /// Runs products, one launch per format and kind (mat-vec or tiled) and per
    /// [`MAX_JOBS`]. `xq`: the int8 copy of the input's first rows, where the op that wrote
    /// them left one.
    fn products(&self, jobs: &mut [Product], x: u64, xq: Option<QuantRows>, xs: usize, out: u64, os: usize) {
        // Kind 0: one token (`mv1`), 1: a few (`mv`), 2: many (tiled). A job's kernel, and so its
        // rounding, depends on its own token count and on what [`Product`] says of its chunk,
        // never on the products it came with: the same product gives the same bits whether its
        // expert was in VRAM or just copied up. On int8 activations a few tokens take the int8
        // mat-vec (`mvqn`), which gives each token its one-token bits; without it, and with
        // int8 tiles, they go to the tiles (the f32 mat-vec of 2..8 tokens took 18 ms of a
        // 512-token prefill, the tiles a fraction).
        let int8_mv = |f: Format| self.int8 && self.k.format(f).mvq.is_some();
        let has_tiles = |f: Format| self.int8_tiles && self.k.format(f).mmq.is_some();
        let on_tiles = |p: &Product| has_tiles(p.format) && (!int8_mv(p.format) || p.few_on_tiles && self.few_mv_join);
        let tiles_from = |p: &Product| if on_tiles(p) { 2 } else { MV_TOKENS + 1 };
        let kind = |p: &Product| {
            if p.job.n == 1 {
                0u8
            } else if (p.job.n as usize) < tiles_from(p) {
                1
            } else {
                2
            }
        };
        // Int8 launches also by input width: an int8 launch quantizes its jobs' input rows
        // once, at one width.
        let key = |p: &Product| {
            let k = kind(p);
            (p.format, k, if k != 1 || int8_mv(p.format) { p.job.cols } else { 0 })
        };
        jobs.sort_by_key(key);
        // The int8 inputs of the current run of jobs with one key (several launches when more
        // than MAX_JOBS): quantized once for all of them, `(key, (qx, qstride, lo))`.
        type Key = (Format, u8, i32);
        let mut quantized: Option<(Key, (u64, usize, usize))> = None;
        let mut start = 0;
        while start < jobs.len() {
            let k0 = key(&jobs[start]);
            let mut end = start;
            while end < jobs.len() && end - start < MAX_JOBS && key(&jobs[end]) == k0 {
                end += 1;
            }
            let mut table = Jobs { count: (end - start) as i32, prefetch: self.prefetch as i32, job: [Job::default(); MAX_JOBS] };
            for (slot, j) in jobs[start..end].iter().enumerate() {
                table.job[slot] = j.job;
            }
            let batch = &table.job[..end - start];
            let max_rows = batch.iter().map(|j| j.rows as usize).max().unwrap_or(0);
            let max_n = batch.iter().map(|j| j.n as usize).max().unwrap_or(0);
            let fk = self.k.format(k0.0);
            let (xs_i, os_i) = (xs as i32, os as i32);
            // Int8 activations: the mat-vecs, and tiles on tensor cores. A few tokens' Q8_0 or
            // Q4_K rows of more than 16 tasks may take mvqm, with mvqn's bits (mvqn keeps the
            // shorter rows, which it takes half a warp each, and launches of Q4_K jobs of 2 or 3).
            let stage_bytes = mvqm_stage_bytes(k0.0, k0.2 as usize);
            let mvqm = fk
                .mvqm
                .as_ref()
                .filter(|_| k0.1 == 1 && self.few_mma && max_n >= mvqm_min_tokens(k0.0))
                .filter(|_| mvq_tasks(k0.0, k0.2 as usize) > 16 && stage_bytes <= self.stage_limit)
                .map(|m| &m[(self.few_mma_warps == 8) as usize]);
            let int8 = match k0.1 {
                0 if self.int8 => fk.mvq.as_ref().map(|i| &i.mvq),
                1 if mvqm.is_some() => mvqm,
                1 if self.int8 => fk.mvq.as_ref().map(|i| &i.mvqn),
                2 if self.int8_tiles => fk.mmq.as_ref(),
                _ => None,
            };
            if let Some(func) = int8 {
                let cols = k0.2 as usize;
                // The input rows of every job with this key, from this launch's on.
                let run_rows = || {
                    jobs[start..]
                        .iter()
                        .take_while(|j| key(j) == k0)
                        .fold((usize::MAX, 0), |(lo, hi), p| (lo.min(p.job.x_row as usize), hi.max((p.job.x_row + p.job.n) as usize)))
                };
                let (qx, qstride, lo) = match (quantized, xq) {
                    (Some((k, q)), _) if k == k0 => q,
                    (_, Some(q)) if q.cols == cols && q.src_stride == xs && q.rows >= run_rows().1 => (q.ptr, q.stride, 0),
                    _ => {
                        // Rows the op before left quantized need no launch of their own;
                        // else every row of the key's jobs, once.
                        let (lo, hi) = run_rows();
                        let Some((qx, qstride)) = self.quantize(x, xs, lo, hi - lo, cols) else { return };
                        (qx, qstride, lo)
                    }
                };
                quantized = Some((k0, (qx, qstride, lo)));
                let (qs_i, lo_i, os_i) = (qstride as i32, lo as i32, os as i32);
                let mut a = Launch::new(func);
                a.arg(&table).arg(&qx).arg(&qs_i).arg(&lo_i).arg(&out).arg(&os_i);
                let (grid, op) = if mvqm.is_some() {
                    self.few_mma_launches.fetch_add(1, Ordering::Relaxed);
                    ((max_rows.div_ceil(MVQM_ROWS) as u32, (end - start) as u32, 1), "products, int8 few tokens on tensor cores")
                } else if k0.1 < 2 {
                    let op = if k0.1 == 0 { "products, int8 mat-vec" } else { "products, int8 mat-vec of a few tokens" };
                    ((max_rows.div_ceil(mvq_block_rows(k0.0, cols)) as u32, (end - start) as u32, 1), op)
                } else {
                    ((max_rows.div_ceil(64) as u32, max_n.div_ceil(64) as u32, (end - start) as u32), "products, int8 tensor cores")
                };
                let (threads, shared) = if mvqm.is_some() { (32 * self.few_mma_warps, stage_bytes as u32) } else { (128, 0) };
                self.launch(a, LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: shared }, op);
                start = end;
                continue;
            }
            if k0.1 == 2 && k0.0 == Format::F32 && self.tensor_cores && self.split_f32(&table, batch, x, xs, out, os) {
                start = end;
                continue;
            }
            let (func, cfg) = if k0.1 == 2 {
                let grid = (max_rows.div_ceil(64) as u32, max_n.div_ceil(32) as u32, (end - start) as u32);
                if self.tensor_cores {
                    let grid = (grid.0, max_n.div_ceil(64) as u32, grid.2);
                    (&fk.mmt, LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: 0 })
                } else {
                    (&fk.mm, LaunchConfig { grid_dim: grid, block_dim: (256, 1, 1), shared_mem_bytes: 0 })
                }
            } else if k0.0 == Format::F32 && (k0.1 == 0 || self.f32_few_blocks) {
                // A block per row for one to eight tokens, each with its one-token bits (see
                // mvs_f32, which takes no more).
                debug_assert!(max_n <= MV_TOKENS, "mvs_f32 takes at most {MV_TOKENS} tokens, not {max_n}");
                let grid = (max_rows as u32, (end - start) as u32, 1);
                (&self.k.mvs_f32, LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: 0 })
            } else {
                // Four rows (warps) per block: MV_WARPS in kernels.cu.
                let grid = (max_rows.div_ceil(4) as u32, (end - start) as u32, 1);
                let func = if k0.1 == 0 { &fk.mv1 } else { &fk.mv };
                (func, LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: 0 })
            };
            let mut a = Launch::new(func);
            a.arg(&table).arg(&x).arg(&xs_i).arg(&out).arg(&os_i);
            let op = match (k0.1, self.tensor_cores) {
                (0 | 1, _) => "products, mat-vec",
                (_, true) => "products, tensor cores (3xTF32)",
                (_, false) => "products, tiled",
            };
            self.launch(a, cfg, op);
            start = end;
        }
    }

    /// Many-token f32 products (3xTF32) split over their columns when their tiles alone are
    /// too few to fill the GPU (a prefill chunk's router: 16 tiles), see `mmt_split_f32`;
    /// false: not worth it, nothing launched.
    fn split_f32(&self, table: &Jobs, batch: &[Job], x: u64, xs: usize, out: u64, os: usize) -> bool {
        // About two waves of an H200's 132 SMs.
        const BLOCKS: usize = 256;
        let tiles: usize = batch.iter().map(|j| (j.rows as usize).div_ceil(64) * (j.n as usize).div_ceil(64)).sum();
        let groups = batch.iter().map(|j| (j.cols as usize).div_ceil(32)).max().unwrap_or(0);
        if tiles == 0 || tiles * 2 > BLOCKS || groups < 8 {
            return false;
        }
        // Slices of an even number of groups (the kernel's step is two), at least four.
        let slices = BLOCKS.div_ceil(tiles).min(groups / 4);
        let slice_groups = groups.div_ceil(slices).next_multiple_of(2);
        let slices = groups.div_ceil(slice_groups);
        let plane = batch.iter().map(|j| (j.out_row + j.n) as usize).max().unwrap_or(0) * os;
        let Some(part) = self.float_scratch(&self.split_part, slices * plane, "split products scratch") else { return true };
        let max_rows = batch.iter().map(|j| j.rows as usize).max().unwrap_or(0);
        let max_n = batch.iter().map(|j| j.n as usize).max().unwrap_or(0);
        let (sl, sg, xs_i, pl, os_i) = (slices as i32, slice_groups as i32, xs as i32, plane as i32, os as i32);
        let mut a = Launch::new(&self.k.mmt_split_f32);
        a.arg(table).arg(&sl).arg(&sg).arg(&x).arg(&xs_i).arg(&part).arg(&pl).arg(&os_i);
        let grid = (max_rows.div_ceil(64) as u32, max_n.div_ceil(64) as u32, (batch.len() * slices) as u32);
        self.launch(a, LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: 0 }, "products, 3xTF32 split");
        let mut a = Launch::new(&self.k.sum_slices);
        a.arg(table).arg(&sl).arg(&part).arg(&pl).arg(&out).arg(&os_i);
        let per_job = batch.iter().map(|j| j.rows as usize * j.n as usize).max().unwrap_or(0);
        let grid = (per_job.div_ceil(256).min(1024) as u32, batch.len() as u32, 1);
        self.launch(a, LaunchConfig { grid_dim: grid, block_dim: (256, 1, 1), shared_mem_bytes: 0 }, "sum_slices");
        true
    }

    /// Quantizes rows `lo..lo + rows` of `x` (`cols` values each, rows `xs` apart) for the int8
    /// mat-vec; returns the scratch's address and its row stride in bytes.
    fn quantize(&self, x: u64, xs: usize, lo: usize, rows: usize, cols: usize) -> Option<(u64, usize)> {
        let qstride = crate::buf::quant_stride(cols);
        let qx = self.scratch(rows * qstride)?;
        let (xs_i, lo_i, rows_i, cols_i, qs_i) = (xs as i32, lo as i32, rows as i32, cols as i32, qstride as i32);
        let mut a = Launch::new(&self.k.quantize_rows);
        a.arg(&x).arg(&xs_i).arg(&lo_i).arg(&rows_i).arg(&cols_i).arg(&qx).arg(&qs_i);
        // A warp per group of 32, four per block.
        let groups = rows * (cols / 32);
        self.launch(
            a,
            LaunchConfig { grid_dim: (groups.div_ceil(4) as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 },
            "quantize",
        );
        Some((qx, qstride))
    }

    /// `out[t] += Σ_s w[t, s] · src[t k + s]` over `n` rows of `dim`, in slot order
    /// (`add_weighted_slots`): token t's k weights on the device at `weights.0 + 4 (t ·
    /// weights.1 + weights.2)` (staged from the host, or a route table's, after its ids).
    fn mix_slots(&self, src: &CudaBuf, out: &mut CudaBuf, dim: usize, n: usize, k: usize, weights: (u64, usize, usize)) {
        let (s, o) = (src.at(&self.stream), out.at_mut(&self.stream));
        let (d, n_i, k_i, ws, wo) = (dim as i32, n as i32, k as i32, weights.1 as i32, weights.2 as i32);
        let mut a = Launch::new(&self.k.add_weighted_slots);
        a.arg(&s).arg(&d).arg(&n_i).arg(&k_i).arg(&weights.0).arg(&ws).arg(&wo).arg(&o);
        self.launch(a, cfg_elems(n * dim), "add_weighted_slots");
    }

    /// The scratch for quantized inputs, at least `bytes` long: one stream orders each
    /// product's reads before the next write.
    fn scratch(&self, bytes: usize) -> Option<u64> {
        let mut scratch = self.qscratch.lock().expect("scratch lock");
        if scratch.as_ref().is_none_or(|s| s.len() < bytes) {
            self.settle();
            // The old buffer's frees are stream-ordered after the products that read it.
            *scratch = Some(self.ok("quantizing inputs", self.stream.alloc_zeros::<u8>((2 * bytes).max(1 << 16)))?);
        }
        Some(dptr(scratch.as_ref().expect("allocated above"), &self.stream))
    }

    /// A scratch of f32 values at least `floats` long, kept in `slot` and grown (zeroed) when
    /// short; one stream orders its uses, and the old buffer's frees come after them.
    pub(super) fn float_scratch(&self, slot: &Mutex<Option<CudaSlice<f32>>>, floats: usize, what: &str) -> Option<u64> {
        let mut part = slot.lock().expect("scratch lock");
        if part.as_ref().is_none_or(|p| p.len() < floats) {
            self.settle();
            *part = Some(self.ok(what, self.stream.alloc_zeros::<f32>((2 * floats).max(1 << 14)))?);
        }
        Some(dptr(part.as_ref().expect("allocated above"), &self.stream))
    }

    /// A split attention's scratch: `floats` of partial results in `part`, and `tickets` ints
    /// in `tickets`, a slot of their own that only ever holds tickets (each launch leaves its
    /// own at 0), so growing either never leaves old data where a ticket is read. The decode
    /// and the prefill kernels keep separate slots: a decode step recorded as a CUDA graph
    /// holds its scratch's address, which a prefill growing a shared slot would free.
    fn split_scratch(
        &self,
        part: &Mutex<Option<CudaSlice<f32>>>,
        tickets: &Mutex<Option<CudaSlice<f32>>>,
        floats: usize,
        count: usize,
    ) -> Option<(u64, u64)> {
        let p = self.float_scratch(part, floats, "attention scratch")?;
        Some((p, self.float_scratch(tickets, count, "attention tickets")?))
    }

    /// Computes `missing` expert products with the CPU backend on their host copies: reads
    /// their input rows back (on the copy stream, once `inputs` is reached, beside the products
    /// already queued), multiplies on the host, and queues the results into `out` through the
    /// staging ring, one strided copy per product.
    fn misses_on_cpu(
        &self,
        missing: &[(&MatJob<'_, CudaMatrix>, &QMatrix<'_>)],
        inputs: &CudaEvent,
        x: &CudaBuf,
        x_stride: usize,
        out: &mut CudaBuf,
        out_stride: usize,
    ) {
        let lo = missing.iter().map(|(j, _)| j.x_row).min().unwrap_or(0);
        let hi = missing.iter().map(|(j, _)| j.x_row + j.n).max().unwrap_or(0);
        let cols = missing.iter().map(|(_, q)| q.cols).max().unwrap_or(0);
        // Rows lo..hi of x, the last one only as far as the products read.
        let len = (hi - lo - 1) * x_stride + cols;
        self.settle();
        let cpu = self.cpu.get_or_init(|| CpuBackend::new(self.miss_precision));
        // Read straight into the CPU backend's buffer (it is a host slice).
        let mut xb = cpu.buf("expert inputs", len);
        let src = x.at(&self.stream) + (lo * x_stride * 4) as u64;
        if self.ok("expert inputs", self.copy_stream.wait(inputs)).is_none() {
            return;
        }
        // SAFETY: rows lo..hi of x at x_stride hold at least `len` floats (each job's rows were
        // checked against x's extent), and the copy completes before the synchronize returns.
        let r = unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut xb[..], src, self.copy_stream.cu_stream()) };
        if self.ok("expert inputs", r).is_none() || self.ok("expert inputs", self.copy_stream.synchronize()).is_none() {
            return;
        }
        // Results packed: product k in rows at[k].. of a buffer `width` wide.
        let width = missing.iter().map(|(_, q)| q.rows).max().unwrap_or(0);
        let mut at = Vec::with_capacity(missing.len());
        let mut rows = 0;
        for (j, _) in missing {
            at.push(rows);
            rows += j.n;
        }
        let cjobs: Vec<MatJob<'_, <CpuBackend as Backend>::Matrix>> = missing
            .iter()
            .zip(&at)
            .map(|((j, q), &r)| {
                let WeightRef::Expert(_, handle) = j.w else { unreachable!("only experts miss") };
                MatJob { w: WeightRef::Expert(**q, handle), x_row: j.x_row - lo, n: j.n, out_row: r, out_col: 0 }
            })
            .collect();
        let mut ob = cpu.buf("expert outputs", rows * width);
        cpu.matmul_many(&cjobs, &xb, x_stride, &mut ob, width);
        let Some(staged) = self.stage_f32("expert outputs", &[&ob]) else { return };
        let dst = out.at_mut(&self.stream);
        for ((j, q), &r) in missing.iter().zip(&at) {
            self.copy_rows(staged, width, r * width, dst, out_stride, j.out_row * out_stride + j.out_col, q.rows, j.n);
        }
    }

    /// Queues `copies` (device address, host bytes) on the copy stream after `after`, between
    /// two timing events, which it returns.
    fn upload_experts(&self, after: &CudaEvent, copies: &[(u64, &[u8])]) -> Option<(CudaEvent, CudaEvent)> {
        self.settle();
        let timed = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        self.ok("expert upload", self.copy_stream.wait(after))?;
        let start = self.ok("expert upload", self.copy_stream.record_event(timed))?;
        // SAFETY: each address is a VRAM buffer of at least its source's length that the
        // expert cache allocated for this copy and keeps (pinned for this call); the sources
        // stay valid until `matmul_many` returns, and it waits for the copy stream first.
        let r = unsafe { crate::copies::host_to_device(&self.copy_stream, copies) };
        self.ok("expert upload", r)?;
        let end = self.ok("expert upload", self.copy_stream.record_event(timed))?;
        Some((start, end))
    }

    /// A resident matrix's product as the launches take it: of more than [`MV_TOKENS`] and at
    /// most `dense_mv_tokens` tokens, on int8 activations, where its 64-row tiles are fewer than
    /// the GPU's multiprocessors, as mat-vecs of up to [`MV_TOKENS`] tokens each (every token
    /// with its one-token bits); else as it is. One column of tiles of a 2048-wide projection
    /// is latency-bound (a block per 64 rows walks the whole row); the mat-vecs read the
    /// matrix once per 8 tokens at the memory's rate. Experts' products are left to the
    /// tiles: a prefill's experts come many to a launch, which fills the GPU. An f32 matrix
    /// (a router) goes the same way to `mvs_f32` (see [`CudaBackend::f32_few_blocks`]): a
    /// 16-sequence step's router took 22.6 µs a layer on the 3xTF32 tiles and their sum.
    fn resident_jobs(&self, f: Format, j: Job, mut push: impl FnMut(Product)) {
        let n = j.n as usize;
        let few_tiles = (j.rows as usize).div_ceil(64) < self.sms;
        let mat_vecs = if f == Format::F32 { self.f32_few_blocks } else { self.k.format(f).mvq.is_some() };
        if n <= MV_TOKENS || n > self.dense_mv_tokens || !few_tiles || !self.int8 || !mat_vecs {
            return push(Product { format: f, job: j, few_on_tiles: false });
        }
        for t0 in (0..n).step_by(MV_TOKENS) {
            let c = MV_TOKENS.min(n - t0) as i32;
            let job = Job { x_row: j.x_row + t0 as i32, out_row: j.out_row + t0 as i32, n: c, ..j };
            push(Product { format: f, job, few_on_tiles: false });
        }
    }

    fn job(w: u64, row_bytes: usize, rows: usize, cols: usize, x_row: usize, n: usize, out_row: usize, out_col: usize) -> Job {
        Job {
            w,
            row_bytes: row_bytes as u64,
            rows: rows as i32,
            cols: cols as i32,
            x_row: x_row as i32,
            n: n as i32,
            out_row: out_row as i32,
            out_col: out_col as i32,
        }
    }

    /// Makes `l` hold at least `rows` rows, keeping those it holds.
    fn kv_grow(&self, l: &mut KvLayer, rows: usize) {
        if rows <= l.cap {
            return;
        }
        let (kw, vw, held) = (l.k_width(), l.v_width(), l.held());
        let cap = rows;
        let Some(mut k) = self.alloc_f32("kv cache", cap * kw) else { return };
        let mut v = None;
        if vw > 0 {
            let Some(nv) = self.alloc_f32("kv cache", cap * vw) else { return };
            v = Some(nv);
        }
        if held > 0 {
            if let Some(old) = &l.k {
                let r = self.stream.memcpy_dtod(&old.slice(..held * kw), &mut k.slice_mut(..held * kw));
                self.ok("kv cache", r);
            }
            if let (Some(old), Some(nv)) = (&l.v, v.as_mut()) {
                let r = self.stream.memcpy_dtod(&old.slice(..held * vw), &mut nv.slice_mut(..held * vw));
                self.ok("kv cache", r);
            }
        }
        l.k = Some(k);
        l.v = v;
        l.cap = cap;
    }

    /// Drops the rows of a bounded layer ([`KvShape::keep`]) that no call from `pos0` on reads:
    /// those more than `keep` positions before it, in steps of [`KV_DROP_STEP`] (the CPU
    /// drops by the same rule in blocks of its own). The rows kept move to the buffer's start
    /// in pieces no longer than the distance moved, so no piece overlaps its destination.
    fn kv_drop(&self, l: &mut KvLayer, pos0: usize) {
        let Some(keep) = l.shape.keep else { return };
        let base = pos0.saturating_sub(keep) / KV_DROP_STEP * KV_DROP_STEP;
        if base < l.base + KV_DROP_STEP {
            return;
        }
        let (drop, kept) = (base - l.base, l.len.min(pos0).saturating_sub(base));
        for (buf, width) in [(&l.k, l.k_width()), (&l.v, l.v_width())] {
            let Some(p) = buf.as_ref().filter(|_| width > 0).map(|b| dptr(b, &self.stream)) else { continue };
            let mut done = 0;
            while done < kept {
                let rows = drop.min(kept - done);
                self.copy_rows(p + (4 * (drop + done) * width) as u64, width, 0, p + (4 * done * width) as u64, width, 0, width, rows);
                done += rows;
            }
        }
        l.base = base;
        l.len = base + kept;
    }

    /// Makes room in `layer` of `cache` for positions up to `pos0 + n`, which it now holds
    /// (dropping what a bounded layer no longer needs); returns the addresses of position 0's
    /// key and value rows ([`KvLayer::keys`]; 0: none).
    fn kv_room(&self, cache: &mut CudaKvCache, layer: usize, pos0: usize, n: usize) -> Option<(u64, u64)> {
        let l = &mut cache.layers[layer];
        if pos0 < l.base {
            // Rows before `base` were dropped: the sequence starts over here.
            l.base = pos0;
            l.len = pos0;
        }
        self.kv_drop(l, pos0);
        let rows = pos0 + n - l.base;
        if rows > l.cap {
            // Doubling keeps an unreserved cache's copies amortised.
            let want = rows.max(2 * l.cap);
            self.kv_grow(l, want);
            if self.faulted() {
                return None;
            }
        }
        l.len = pos0 + n;
        Some((l.keys(&self.stream), l.values(&self.stream)))
    }

    #[allow(clippy::too_many_arguments)]
    fn copy_rows(&self, src: u64, ss: usize, so: usize, dst: u64, ds: usize, dof: usize, width: usize, n: usize) {
        let (ss, so, ds, dof, w, n_i) = (ss as i32, so as i32, ds as i32, dof as i32, width as i32, n as i32);
        let mut a = Launch::new(&self.k.copy_strided);
        a.arg(&src).arg(&ss).arg(&so).arg(&dst).arg(&ds).arg(&dof).arg(&w).arg(&n_i);
        self.launch(a, cfg_elems(n * width), "copy_strided");
    }

    fn move_rows(&self, src: &CudaBuf, dst: &mut CudaBuf, dim: usize, rows: &[usize], scatter: bool) {
        if rows.is_empty() {
            return;
        }
        let Some(ip) = self.stage_i32("move rows", rows.iter().copied()) else { return };
        let (s, d) = (src.at(&self.stream), dst.at_mut(&self.stream));
        if dim.is_multiple_of(4) {
            self.move_units16(s, d, dim / 4, ip, rows.len(), scatter, "move rows");
        } else {
            let (dim_i, count, sc) = (dim as i32, rows.len() as i32, scatter as i32);
            let mut a = Launch::new(&self.k.move_rows);
            a.arg(&s).arg(&d).arg(&dim_i).arg(&ip).arg(&count).arg(&sc);
            self.launch(a, cfg_elems(rows.len() * dim), "move rows");
        }
        // A gather of rows whose int8 copy the op that wrote them left: the copy's rows too, so
        // that the products reading the gathered rows need not quantize them again.
        let max_row = rows.iter().copied().max().unwrap_or(0);
        let Some(q) = src.quantized().filter(|q| !scatter && q.cols == dim && q.src_stride == dim && q.rows > max_row) else { return };
        let Some(dq) = self.int8_copy(dst, rows.len(), dim, dim) else { return };
        self.move_units16(q.ptr, dq.ptr, q.stride / 16, ip, rows.len(), false, "gather int8 rows");
    }

    /// `move_rows4`: rows of `units` 16-byte units (16-byte aligned), gathered from `rows` of
    /// `src` or scattered to them.
    #[allow(clippy::too_many_arguments)]
    fn move_units16(&self, src: u64, dst: u64, units: usize, ip: u64, count: usize, scatter: bool, what: &'static str) {
        let (u, c, sc) = (units as i32, count as i32, scatter as i32);
        let mut a = Launch::new(&self.k.move_rows4);
        a.arg(&src).arg(&dst).arg(&u).arg(&ip).arg(&c).arg(&sc);
        let grid = (units.div_ceil(128) as u32, count.min(65_535) as u32, 1);
        self.launch(a, LaunchConfig { grid_dim: grid, block_dim: (128, 1, 1), shared_mem_bytes: 0 }, what);
    }
}

impl Backend for CudaBackend {
    type Buf = CudaBuf;
    type Matrix = CudaMatrix;
    type Vector = CudaVector;
    type KvCache = CudaKvCache;

    /// 512: at 256 a chunk's dense products were a few hundred tiles, too few to fill the H200
    /// (prefill of 512 tokens 2,664 → 3,330 tok/s with the same kernels).
    fn prefill_chunk(&self) -> usize {
        512
    }

    /// The formats of [`FORMAT_NAMES`]: all of them.
    fn decodes(&self, format: Format) -> bool {
        has_kernels(format)
    }

    /// gpt-oss's sliding windows and sinks, in the one-block-per-row kernel (`attention`).
    fn attends_windows_and_sinks(&self) -> bool {
        true
    }

    /// DeepSeek Sparse Attention (GLM-5): `backend/sparse.rs`.
    fn attends_selected(&self) -> bool {
        true
    }

    /// DeepSeek-V4's compressed attention: `backend/compressed.rs`.
    fn attends_compressed(&self) -> bool {
        true
    }

    fn device_tier(&self) -> Option<smoe_engine::DeviceTier> {
        let e = self.expert_stats();
        // Experts kept by layer (all of them in VRAM) are a tier of their own size.
        let kept = self.kept.lock().expect("kept experts lock").bytes;
        let (free, total) = self.ctx.mem_get_info().unwrap_or((0, 0));
        Some(smoe_engine::DeviceTier {
            hits: e.hits,
            copies: e.misses,
            copied_bytes: e.uploaded_bytes,
            copy_secs: e.upload_secs,
            wait_secs: e.upload_wait_secs,
            cpu_products: e.cpu_products,
            cpu_bytes: e.cpu_bytes,
            resident_bytes: e.resident_bytes + kept,
            capacity_bytes: e.capacity_bytes + kept,
            device_used_bytes: (total - free) as u64,
        })
    }

    fn describe(&self) -> String {
        let prefill = match (self.tensor_cores, self.int8_tiles) {
            (true, true) => ", prefill on tensor cores (int8 for Q8_0, Q4_K and Q6_K, else 3xTF32)",
            (true, false) => ", prefill on tensor cores (3xTF32)",
            _ => "",
        };
        let mut d = format!("{}{prefill}", self.info);
        if self.int8 {
            d.push_str(", decode products of Q8_0, Q4_K and Q6_K on int8 activations (dp4a)");
        }
        if self.pdl {
            d.push_str(", decode kernels overlapped (programmatic dependent launch)");
        }
        if self.prefetch {
            d.push_str(", decode weights asked of L2 ahead of their products");
        }
        // Where the fused launches are on, and how many ran: the bench's line tells A from B.
        if self.fused_route {
            d.push_str(&format!(", decoded tokens routed in the router's launch ({} launches)", self.fused_route_steps()));
        }
        if self.fused_norm {
            let (products, mixes) = (self.fused_norm_steps(), self.mix_norm_steps());
            d.push_str(&format!(", norms in the launch before them ({products} output products, {mixes} mixes)"));
        }
        if self.graphs {
            let g = self.graph.lock().expect("graph lock");
            d.push_str(&format!(", decoded tokens as CUDA graphs ({} launched, {} built)", g.launched, g.instantiated));
        }
        let kept = self.kept.lock().expect("kept experts lock");
        let layers = (0..kept.layers.len()).filter(|&l| kept.layer(l).is_some()).count();
        if layers > 0 {
            d.push_str(&format!(
                "; the routed experts of {layers} layers kept in VRAM ({:.1} GiB), routed on the GPU",
                kept.bytes as f64 / (1u64 << 30) as f64
            ));
            let tiles = self.kept_tile_steps();
            if tiles > 0 {
                d.push_str(&format!(" ({tiles} layer steps on int8 tiles)"));
            }
        }
        drop(kept);
        let e = self.expert_stats();
        if e.hits + e.misses > 0 {
            d.push_str(&format!("; {e}"));
        }
        let p = self.pinned.lock().expect("pinned lock");
        if p.bytes > 0 {
            d.push_str(&format!("; {:.1} GiB of host expert memory page-locked in {:.2} s", p.bytes as f64 / (1u64 << 30) as f64, p.secs));
        }
        if let Some(why) = &p.refused {
            d.push_str(&format!("; {why}"));
        }
        let gbs = |r: Option<f64>| r.map_or("unmeasured".to_string(), |r| format!("{:.1} GB/s", r / 1e9));
        let (copy, cpu) = self.misses.lock().expect("miss policy lock").rates();
        if copy.is_some() || cpu.is_some() {
            d.push_str(&format!("; misses served at: copy {}, CPU {}", gbs(copy), gbs(cpu)));
        }
        d
    }

    fn use_host_memory(&self, regions: &[(usize, usize)]) {
        let mut p = self.pinned.lock().expect("pinned lock");
        p.register(regions);
        self.experts.lock().expect("expert cache lock").set_pinned(p.bytes);
    }

    /// Always, even where the driver refused a range: keeping an unlocked range's pages costs
    /// only memory, giving back a locked one's would corrupt the copies.
    fn locks_host_memory(&self) -> bool {
        true
    }

    fn fault(&self) -> Option<String> {
        if self.faulted() {
            self.fault.lock().expect("fault lock").clone()
        } else {
            None
        }
    }

    fn matrix(&self, region: &Arc<Vec<u8>>, offset: usize, format: Format, rows: usize, cols: usize) -> CudaMatrix {
        let row_bytes = format.row_bytes(cols).expect("validated by the vault reader");
        if !has_kernels(format) {
            // Later ops on it do nothing; `Model::load_parts` reports the fault.
            self.record("loading weights", format!("{format} weights have no CUDA kernels yet; use --device cpu"));
        }
        let data = self.upload_new("loading weights", &region[offset..offset + rows * row_bytes]);
        CudaMatrix { data, format, rows, cols, row_bytes }
    }
    fn vector(&self, v: &[f32]) -> CudaVector {
        CudaVector { data: self.upload_new("loading weights", v), len: v.len() }
    }
    fn buf(&self, name: &'static str, len: usize) -> CudaBuf {
        self.settle();
        let data = if self.faulted() || len == 0 { None } else { self.ok(name, self.stream.alloc_zeros::<f32>(len)) };
        CudaBuf::new(name, data.unwrap_or_else(|| self.empty()))
    }
    fn kv_cache(&self, layers: &[KvShape]) -> CudaKvCache {
        CudaKvCache { layers: layers.iter().map(|&shape| KvLayer { shape, k: None, v: None, cap: 0, base: 0, len: 0 }).collect() }
    }
    fn kv_reserve(&self, cache: &mut CudaKvCache, positions: usize) {
        for l in &mut cache.layers {
            self.kv_grow(l, positions.min(l.bounded_rows()));
        }
    }
    fn kv_capacity(&self, cache: &CudaKvCache) -> usize {
        // A bounded layer with its bounded rows allocated holds any length of steps of up to
        // KV_DROP_STEP tokens.
        cache.layers.iter().map(|l| if l.cap >= l.bounded_rows() { usize::MAX } else { l.base + l.cap }).min().unwrap_or(0)
    }
    fn kv_bytes(&self, cache: &CudaKvCache) -> usize {
        cache.layers.iter().map(|l| l.held() * (l.k_width() + l.v_width()) * 4).sum()
    }

    fn kv_copy(&self, src: &CudaKvCache, dst: &mut CudaKvCache, positions: usize) -> bool {
        self.settle();
        for (d, s) in dst.layers.iter_mut().zip(&src.layers) {
            // A layer indexed by window (DeepSeek-V4's compressed entries) holds fewer rows than
            // positions: what it holds of the prefix is copied, and the entries of windows the
            // prefix leaves open are recomputed before they are read. A layer that dropped old
            // rows copies what it holds of the prefix.
            let rows = positions.saturating_sub(s.base).min(s.held());
            self.kv_grow(d, rows);
            if self.faulted() {
                return false;
            }
            d.base = s.base.min(positions);
            d.len = d.base + rows;
            for (from, to, width) in [(&s.k, &mut d.k, s.k_width()), (&s.v, &mut d.v, s.v_width())] {
                if let (Some(from), Some(to), true) = (from, to.as_mut(), rows * width > 0) {
                    let r = self.stream.memcpy_dtod(&from.slice(..rows * width), &mut to.slice_mut(..rows * width));
                    self.ok("kv_copy", r);
                }
            }
        }
        !self.faulted()
    }
    fn upload(&self, dst: &mut CudaBuf, src: &[f32]) {
        self.settle();
        if self.faulted() || src.is_empty() {
            return;
        }
        check("upload", dst, 1, src.len());
        let r = self.stream.memcpy_htod(src, &mut dst.mem_mut().slice_mut(..src.len()));
        self.ok("upload", r);
    }
    fn download(&self, src: &CudaBuf, offset: usize, dst: &mut [f32]) {
        self.settle();
        if self.faulted() || dst.is_empty() {
            dst.fill(0.0);
            return;
        }
        check_rows("download", src, 0, 1, 0, offset, dst.len());
        let t = std::time::Instant::now();
        let r = self.stream.memcpy_dtoh(&src.mem().slice(offset..offset + dst.len()), dst);
        if self.ok("download", r).is_some() && self.ok("download", self.stream.synchronize()).is_some() {
            self.staging.lock().expect("staging lock").synchronized();
        }
        self.profiled("(host waits: download)", t);
    }

    fn embed(&self, table: &CudaMatrix, ids: &[u32], out: &mut CudaBuf) {
        if self.faulted() || ids.is_empty() {
            return;
        }
        check("embed", out, ids.len(), table.cols);
        self.chunk_tokens.store(ids.len(), Ordering::Relaxed);
        // A decoded token's step, up to its first download (the logits), as one graph.
        self.settle();
        if ids.len() == 1 {
            self.begin_step_graph();
        }
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= table.rows) {
            panic!("embed: token {bad} outside a table of {} rows", table.rows);
        }
        let Some(ip) = self.stage_i32("embed", ids.iter().map(|&i| i as usize)) else { return };
        let (t, o) = (dptr(&table.data, &self.stream), out.at_mut(&self.stream));
        let (rb, cols) = (table.row_bytes as u64, table.cols as i32);
        let mut a = Launch::new(&self.k.format(table.format).embed);
        a.arg(&t).arg(&rb).arg(&cols).arg(&ip).arg(&o);
        self.launch(a, LaunchConfig { grid_dim: (ids.len() as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: 0 }, "embed");
    }
    fn matmul(&self, w: &CudaMatrix, rows: Option<(usize, usize)>, x: &CudaBuf, n: usize, out: &mut CudaBuf) {
        if self.faulted() || n == 0 {
            return;
        }
        let (r0, m) = rows.unwrap_or((0, w.rows));
        assert!(r0 + m <= w.rows, "matmul: rows {r0}..{} of a {}-row matrix", r0 + m, w.rows);
        check("matmul input", x, n, w.cols);
        check("matmul", out, n, m);
        let wp = dptr(&w.data, &self.stream) + (r0 * w.row_bytes) as u64;
        let job = Self::job(wp, w.row_bytes, m, w.cols, 0, n, 0, 0);
        // One job, or mat-vecs of up to eight tokens for at most `dense_mv_tokens`
        // (≤ DENSE_MV_MAX) tokens: on the stack either way.
        let mut jobs = [Product { format: w.format, job, few_on_tiles: false }; DENSE_MV_MAX / MV_TOKENS];
        let mut count = 0;
        self.resident_jobs(w.format, job, |j| {
            jobs[count] = j;
            count += 1;
        });
        self.products(&mut jobs[..count], x.at(&self.stream), x.quantized(), w.cols, out.at_mut(&self.stream), m);
    }
    fn matmul_many(&self, jobs: &[MatJob<'_, CudaMatrix>], x: &CudaBuf, x_stride: usize, out: &mut CudaBuf, out_stride: usize) {
        if self.faulted() {
            return;
        }
        // Products whose weights are in VRAM already, and the expert products that miss.
        let mut ready = Vec::with_capacity(jobs.len());
        let few_on_tiles = self.chunk_tokens.load(Ordering::Relaxed) > DENSE_MV_TOKENS;
        let mut missing: Vec<(&MatJob<'_, CudaMatrix>, &QMatrix<'_>)> = Vec::new();
        let mut experts = self.experts.lock().expect("expert cache lock");
        experts.begin_call();
        for j in jobs {
            if j.n == 0 {
                continue;
            }
            let (fmt, wp, row_bytes, rows, cols) = match &j.w {
                WeightRef::Resident(m, range) => {
                    let (r0, rows) = range.unwrap_or((0, m.rows));
                    assert!(r0 + rows <= m.rows, "matmul_many: rows {r0}..{} of a {}-row matrix", r0 + rows, m.rows);
                    (m.format, dptr(&m.data, &self.stream) + (r0 * m.row_bytes) as u64, m.row_bytes, rows, m.cols)
                }
                WeightRef::Expert(q, handle) => {
                    if !has_kernels(q.format) {
                        self.record("matmul_many", format!("{} experts have no CUDA kernels yet; use --device cpu", q.format));
                        return;
                    }
                    if q.layout != Layout::Rows {
                        self.record("matmul_many", "an expert arrived interleaved; the CUDA backend reads rows as stored");
                        return;
                    }
                    check_rows("matmul_many input", x, j.x_row, j.n, x_stride, 0, q.cols);
                    check_rows("matmul_many", out, j.out_row, j.n, out_stride, j.out_col, q.rows);
                    let Some(ptr) = experts.lookup(&self.stream, *handle, q.data) else {
                        missing.push((j, q));
                        continue;
                    };
                    (q.format, ptr, q.format.row_bytes(q.cols).expect("a valid expert matrix"), q.rows, q.cols)
                }
                WeightRef::Kept { layer, expert, part } => {
                    let kept = self.kept.lock().expect("kept experts lock");
                    let Some(l) = kept.layer(*layer).filter(|l| (*expert as usize) < l.experts) else {
                        self.record("matmul_many", format!("expert {expert} of layer {layer} is not kept"));
                        return;
                    };
                    let p = l.part(*part);
                    (p.format, p.at(&self.stream, *expert), p.row_bytes, p.rows, p.cols)
                }
            };
            check_rows("matmul_many input", x, j.x_row, j.n, x_stride, 0, cols);
            check_rows("matmul_many", out, j.out_row, j.n, out_stride, j.out_col, rows);
            let job = Self::job(wp, row_bytes, rows, cols, j.x_row, j.n, j.out_row, j.out_col);
            match j.w {
                WeightRef::Resident(..) => self.resident_jobs(fmt, job, |j| ready.push(j)),
                _ => ready.push(Product { format: fmt, job, few_on_tiles }),
            }
        }
        let (xp, op) = (x.at(&self.stream), out.at_mut(&self.stream));
        if missing.is_empty() {
            drop(experts);
            self.products(&mut ready, xp, x.quantized(), x_stride, op, out_stride);
            return;
        }
        // The tier's copies and events are not recorded in a step's graph.
        self.settle();
        let miss_bytes: u64 = missing.iter().map(|(_, q)| q.data.len() as u64).sum();
        let room = match experts.room(&self.stream, miss_bytes) {
            Ok(r) => r,
            Err(e) => {
                self.record("expert upload", e);
                return;
            }
        };
        let few = missing.iter().all(|(j, _)| j.n <= MV_TOKENS);
        let route = self.misses.lock().expect("miss policy lock").choose(room, few);
        // Copies: buffers for the misses now (in the compute stream's order), products once
        // the copies land.
        let (mut waiting, mut copies) = (Vec::new(), Vec::<(u64, &[u8])>::new());
        if route == Route::Copy {
            for &(j, q) in &missing {
                let WeightRef::Expert(_, handle) = j.w else { unreachable!("only experts miss") };
                let (ptr, fresh) = match experts.device_copy(&self.stream, handle, q.data) {
                    Ok(p) => p,
                    Err(e) => {
                        self.record("expert upload", e);
                        return;
                    }
                };
                if fresh {
                    copies.push((ptr, q.data));
                }
                let row_bytes = q.format.row_bytes(q.cols).expect("a valid expert matrix");
                let job = Self::job(ptr, row_bytes, q.rows, q.cols, j.x_row, j.n, j.out_row, j.out_col);
                waiting.push(Product { format: q.format, job, few_on_tiles });
            }
        }
        drop(experts);
        // What the misses wait for: their buffers (copy route) or their inputs (CPU route),
        // not the products of the experts already in VRAM, which run meanwhile.
        let Some(before) = self.ok("expert upload", self.stream.record_event(None)) else { return };
        self.products(&mut ready, xp, x.quantized(), x_stride, op, out_stride);
        if route == Route::Cpu {
            let t = Instant::now();
            self.misses_on_cpu(&missing, &before, x, x_stride, out, out_stride);
            let secs = t.elapsed().as_secs_f64();
            self.misses.lock().expect("miss policy lock").record(Route::Cpu, miss_bytes, secs);
            self.experts.lock().expect("expert cache lock").computed_on_cpu(missing.len() as u64, miss_bytes, secs);
            return;
        }
        let t = Instant::now();
        let copied = self.upload_experts(&before, &copies);
        let wait = Instant::now();
        // The store reuses the host slots once this call returns: the copies must have read
        // them by then, whatever else failed.
        let synced = self.ok("expert upload", self.copy_stream.synchronize());
        let Some((start, end)) = copied.filter(|_| synced.is_some()) else { return };
        let gpu_secs = self.ok("expert upload", start.elapsed_ms(&end)).unwrap_or(0.0) as f64 / 1e3;
        self.experts.lock().expect("expert cache lock").copied(gpu_secs, wait.elapsed().as_secs_f64());
        // The route's cost as the CPU route's is measured: the host's time from queueing to
        // done, both overlapping the products already queued.
        let copied_bytes = copies.iter().map(|(_, b)| b.len() as u64).sum();
        self.misses.lock().expect("miss policy lock").record(Route::Copy, copied_bytes, t.elapsed().as_secs_f64());
        if self.ok("expert upload", self.stream.wait(&end)).is_some() {
            self.products(&mut waiting, xp, x.quantized(), x_stride, op, out_stride);
        }
    }
    fn matmul_t(&self, w: &CudaMatrix, r0: usize, m: usize, x: &CudaBuf, x_stride: usize, x_off: usize, n: usize, out: &mut CudaBuf) {
        if self.faulted() || n == 0 {
            return;
        }
        assert!(r0 + m <= w.rows, "matmul_t: rows {r0}..{} of a {}-row matrix", r0 + m, w.rows);
        check_rows("matmul_t input", x, 0, n, x_stride, x_off, m);
        check("matmul_t", out, n, w.cols);
        let wp = dptr(&w.data, &self.stream) + (r0 * w.row_bytes) as u64;
        let xp = x.at(&self.stream) + (x_off * 4) as u64;
        let op = out.at_mut(&self.stream);
        let (rb, m_i, cols, xs, n_i) = (w.row_bytes as u64, m as i32, w.cols as i32, x_stride as i32, n as i32);
        let mut a = Launch::new(&self.k.format(w.format).mt);
        a.arg(&wp).arg(&rb).arg(&m_i).arg(&cols).arg(&xp).arg(&xs).arg(&n_i).arg(&op);
        let threads = n * w.cols.div_ceil(32);
        let cfg = LaunchConfig { grid_dim: (threads.div_ceil(64) as u32, 1, 1), block_dim: (64, 1, 1), shared_mem_bytes: 0 };
        self.launch(a, cfg, "matmul_t");
    }

    fn rms_norm(&self, x: &CudaBuf, n: usize, dim: usize, w: &CudaVector, eps: f32, out: &mut CudaBuf) {
        if self.faulted() || n == 0 {
            return;
        }
        check("rms_norm input", x, n, dim);
        check("rms_norm", out, n, dim);
        assert!(w.len >= dim, "rms_norm: {} weights for rows of {dim}", w.len);
        let (xp, wp, op) = (x.at(&self.stream), dptr(&w.data, &self.stream), out.at_mut(&self.stream));
        let (qx, qs) = self.quant_out(out, n, dim);
        let (d, zero) = (dim as i32, 0i32);
        let mut a = Launch::new(&self.k.rms_norm);
        a.arg(&xp).arg(&d).arg(&zero).arg(&wp).arg(&op).arg(&d).arg(&zero).arg(&d).arg(&eps).arg(&qx).arg(&qs);
        self.launch(a, LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (norm_threads(dim), 1, 1), shared_mem_bytes: 0 }, "rms_norm");
    }
    fn rms_norm_strided(&self, x: &mut CudaBuf, n: usize, stride: usize, off: usize, dim: usize, w: &CudaVector, eps: f32) {
        if self.faulted() || n == 0 {
            return;
        }
        check_rows("rms_norm_strided", x, 0, n, stride, off, dim);
        assert!(w.len >= dim, "rms_norm_strided: {} weights for rows of {dim}", w.len);
        let (xp, wp) = (x.at_mut(&self.stream), dptr(&w.data, &self.stream));
        let (s, o, d, none) = (stride as i32, off as i32, dim as i32, (0u64, 0i32));
        let mut a = Launch::new(&self.k.rms_norm);
        a.arg(&xp).arg(&s).arg(&o).arg(&wp).arg(&xp).arg(&s).arg(&o).arg(&d).arg(&eps).arg(&none.0).arg(&none.1);
        self.launch(
            a,
            LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (norm_threads(dim), 1, 1), shared_mem_bytes: 0 },
            "rms_norm_strided",
        );
    }
    fn layer_norm_strided(
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
        self.layer_norm_rows(x, n, stride, off, dim, w, b, eps);
    }
    fn index_select(&self, cache: &CudaKvCache, layer: usize, q: &CudaBuf, weights: &CudaBuf, at: IndexQueries, out: &mut [u32]) {
        self.index_select_rows(cache, layer, q, weights, at, out);
    }
    /// Qwen3-Next's Gated DeltaNet: `backend/delta.rs`.
    fn runs_linear_attention(&self) -> bool {
        true
    }
    fn gated_delta_net(
        &self,
        p: smoe_engine::backend::DeltaNetParams<'_, CudaVector>,
        x: &CudaBuf,
        row0: usize,
        n: usize,
        state: &mut CudaBuf,
        fresh: bool,
        out: &mut CudaBuf,
    ) {
        self.delta_net(p, x, row0, n, state, fresh, out);
    }
    fn sigmoid_gate(&self, x: &mut CudaBuf, n: usize, width: usize, gate: &CudaBuf, gate_stride: usize, gate_off: usize) {
        self.gate_rows(x, n, width, gate, gate_stride, gate_off);
    }
    fn compress_windows(&self, cache: &mut CudaKvCache, c: CompressWindows<'_, CudaVector>) {
        self.compress(cache, c);
    }
    fn attention_compressed(
        &self,
        cache: &CudaKvCache,
        layer: usize,
        q: &CudaBuf,
        n: usize,
        pos0: usize,
        p: CompressedParams<'_>,
        out: &mut CudaBuf,
    ) {
        self.attend_compressed(cache, layer, q, n, pos0, p, out);
    }
    fn hc_collapse(&self, x: &CudaBuf, n: usize, mult: usize, dim: usize, pre: &[f32], out: &mut CudaBuf) {
        self.collapse_streams(x, n, mult, dim, pre, out);
    }
    fn hc_expand(&self, x: &mut CudaBuf, y: &CudaBuf, n: usize, mult: usize, dim: usize, post: &[f32], comb: &[f32]) {
        self.expand_streams(x, y, n, mult, dim, post, comb);
    }
    fn silu_mul_clamped(&self, g: &mut CudaBuf, u: &CudaBuf, len: usize, limit: f32) {
        check("silu_mul_clamped", g, 1, len);
        check("silu_mul_clamped input", u, 1, len);
        let up = u.at(&self.stream);
        self.clamped_silu_rows(g, 0, 0, up, 0, 1, len, limit);
    }
    fn silu_clamped_halves(&self, x: &mut CudaBuf, row0: usize, n: usize, stride: usize, w: usize, limit: f32) {
        check_rows("silu_clamped_halves", x, row0, n, stride, 0, 2 * w);
        let up = x.at(&self.stream) + (4 * (row0 * stride + w)) as u64;
        self.clamped_silu_rows(x, row0 * stride, stride, up, stride, n, w, limit);
    }
    fn rms_norm_heads(&self, x: &mut CudaBuf, n: usize, stride: usize, off: usize, heads: usize, dim: usize, w: &CudaVector, eps: f32) {
        if self.faulted() || n == 0 || heads == 0 {
            return;
        }
        check_rows("rms_norm_heads", x, 0, n, stride, off, heads * dim);
        assert!(w.len >= dim, "rms_norm_heads: {} weights for heads of {dim}", w.len);
        let (xp, wp) = (x.at_mut(&self.stream), dptr(&w.data, &self.stream));
        let (s, o, h, d) = (stride as i32, off as i32, heads as i32, dim as i32);
        let mut a = Launch::new(&self.k.rms_norm_heads);
        a.arg(&xp).arg(&s).arg(&o).arg(&h).arg(&wp).arg(&d).arg(&eps);
        let cfg = LaunchConfig { grid_dim: ((n * heads) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        self.launch(a, cfg, "rms_norm_heads");
    }
    fn add_rms_norm(&self, x: &mut CudaBuf, y: &CudaBuf, n: usize, dim: usize, w: &CudaVector, eps: f32, out: &mut CudaBuf) {
        self.fused_add_rms_norm(x, y, n, dim, w, eps, out);
    }
    fn matmul_add_rms_norm(
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
    ) {
        if !self.product_add_norm(proj, input, n, dim, y, x, w, eps, out) {
            self.matmul(proj, None, input, n, y);
            self.fused_add_rms_norm(x, y, n, dim, w, eps, out);
        }
    }
    fn qk_rope_store(
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
        self.fused_qk_rope_store(qkv, n, rows, norm, rope, cache, layer, pos0);
    }
    fn add_bias(&self, x: &mut CudaBuf, n: usize, stride: usize, off: usize, b: &CudaVector) {
        if self.faulted() || n == 0 || b.len == 0 {
            return;
        }
        check_rows("add_bias", x, 0, n, stride, off, b.len);
        let (xp, bp) = (x.at_mut(&self.stream), dptr(&b.data, &self.stream));
        let (n_i, s, o, l) = (n as i32, stride as i32, off as i32, b.len as i32);
        let mut a = Launch::new(&self.k.add_bias);
        a.arg(&xp).arg(&n_i).arg(&s).arg(&o).arg(&bp).arg(&l);
        self.launch(a, cfg_elems(n * b.len), "add_bias");
    }
    fn add(&self, x: &mut CudaBuf, y: &CudaBuf, len: usize) {
        if self.faulted() || len == 0 {
            return;
        }
        check("add", x, 1, len);
        check("add input", y, 1, len);
        let (xp, yp, l) = (x.at_mut(&self.stream), y.at(&self.stream), len as i32);
        let mut a = Launch::new(&self.k.add);
        a.arg(&xp).arg(&yp).arg(&l);
        self.launch(a, cfg_elems(len), "add");
    }
    fn silu_mul(&self, g: &mut CudaBuf, u: &CudaBuf, len: usize) {
        if self.faulted() || len == 0 {
            return;
        }
        check("silu_mul", g, 1, len);
        check("silu_mul input", u, 1, len);
        let (gp, up, l) = (g.at_mut(&self.stream), u.at(&self.stream), len as i32);
        let mut a = Launch::new(&self.k.silu_mul);
        a.arg(&gp).arg(&up).arg(&l);
        self.launch(a, cfg_elems(len), "silu_mul");
    }
    fn silu_mul_halves(&self, x: &mut CudaBuf, row0: usize, n: usize, stride: usize, w: usize) {
        if self.faulted() || n == 0 || w == 0 {
            return;
        }
        check_rows("silu_mul_halves", x, row0, n, stride, 0, 2 * w);
        let xp = x.at_mut(&self.stream);
        if row0 == 0 && n > MV_TOKENS && self.int8_tiles && w.is_multiple_of(32) {
            // Many rows for the int8 tiles of the down products: quantized on the way, into
            // the buffer's int8 copy (a launch of `quantize_rows` fewer, and one pass). The copy
            // holds rows from 0, so a later batch of a streamed layer (row0 > 0) quantizes in
            // its products instead.
            let Some(q) = self.int8_copy(x, n, w, stride) else { return };
            let (s, r, w_i, qs) = (stride as i32, n as i32, w as i32, q.stride as i32);
            let mut a = Launch::new(&self.k.silu_quantize);
            a.arg(&xp).arg(&s).arg(&r).arg(&w_i).arg(&q.ptr).arg(&qs);
            self.launch(a, cfg_elems(n * w), "silu_quantize");
            return;
        }
        let (r, n_i, s, w_i) = (row0 as i32, n as i32, stride as i32, w as i32);
        let mut a = Launch::new(&self.k.silu_mul_halves);
        a.arg(&xp).arg(&r).arg(&n_i).arg(&s).arg(&w_i);
        self.launch(a, cfg_elems(n * w), "silu_mul_halves");
    }
    fn swiglu_clamped_halves(&self, x: &mut CudaBuf, row0: usize, n: usize, stride: usize, w: usize, alpha: f32, limit: f32) {
        if self.faulted() || n == 0 || w == 0 {
            return;
        }
        check_rows("swiglu_clamped_halves", x, row0, n, stride, 0, 2 * w);
        let xp = x.at_mut(&self.stream);
        let (r, n_i, s, w_i) = (row0 as i32, n as i32, stride as i32, w as i32);
        let mut a = Launch::new(&self.k.swiglu_clamped_halves);
        a.arg(&xp).arg(&r).arg(&n_i).arg(&s).arg(&w_i).arg(&alpha).arg(&limit);
        self.launch(a, cfg_elems(n * w), "swiglu_clamped_halves");
    }
    fn rope(
        &self,
        x: &mut CudaBuf,
        n: usize,
        stride: usize,
        off: usize,
        heads: usize,
        head_stride: usize,
        cos: &[f32],
        sin: &[f32],
        interleaved: bool,
    ) {
        if self.faulted() || n == 0 || heads == 0 {
            return;
        }
        let half = cos.len() / n;
        check_rows("rope", x, 0, n, stride, off, (heads - 1) * head_stride + 2 * half);
        // The kernel reads the cosines, then the sines, from one staged table.
        let Some(cp) = self.stage_f32("rope", &[&cos[..n * half], &sin[..n * half]]) else { return };
        let xp = x.at_mut(&self.stream);
        let (n_i, s, o, h, hs, hf, il) =
            (n as i32, stride as i32, off as i32, heads as i32, head_stride as i32, half as i32, interleaved as i32);
        let mut a = Launch::new(&self.k.rope);
        a.arg(&xp).arg(&n_i).arg(&s).arg(&o).arg(&h).arg(&hs).arg(&cp).arg(&hf).arg(&il);
        self.launch(a, cfg_elems(n * heads * half), "rope");
    }
    fn copy_strided(
        &self,
        src: &CudaBuf,
        src_stride: usize,
        src_off: usize,
        dst: &mut CudaBuf,
        dst_stride: usize,
        dst_off: usize,
        width: usize,
        n: usize,
    ) {
        if self.faulted() || n == 0 || width == 0 {
            return;
        }
        check_rows("copy_strided input", src, 0, n, src_stride, src_off, width);
        check_rows("copy_strided", dst, 0, n, dst_stride, dst_off, width);
        let (s, d) = (src.at(&self.stream), dst.at_mut(&self.stream));
        self.copy_rows(s, src_stride, src_off, d, dst_stride, dst_off, width, n);
    }
    fn gather_rows(&self, src: &CudaBuf, dim: usize, rows: &[usize], dst: &mut CudaBuf) {
        if self.faulted() {
            return;
        }
        check("gather_rows", dst, rows.len(), dim);
        if let Some(&last) = rows.iter().max() {
            check("gather_rows input", src, last + 1, dim);
        }
        self.move_rows(src, dst, dim, rows, false);
    }
    fn scatter_rows(&self, src: &CudaBuf, dim: usize, rows: &[usize], dst: &mut CudaBuf) {
        if self.faulted() {
            return;
        }
        check("scatter_rows input", src, rows.len(), dim);
        if let Some(&last) = rows.iter().max() {
            check("scatter_rows", dst, last + 1, dim);
        }
        self.move_rows(src, dst, dim, rows, true);
    }
    fn add_weighted_slots(&self, src: &CudaBuf, dim: usize, n: usize, k: usize, weights: &[f32], out: &mut CudaBuf) {
        if self.faulted() || n == 0 {
            return;
        }
        check("add_weighted_slots input", src, n * k, dim);
        check("add_weighted_slots", out, n, dim);
        assert!(weights.len() >= n * k, "add_weighted_slots: {} weights for {n} tokens of {k}", weights.len());
        let Some(wp) = self.stage_f32("add_weighted_slots", &[&weights[..n * k]]) else { return };
        self.mix_slots(src, out, dim, n, k, (wp, k, 0));
    }
    fn scale_rows(&self, x: &mut CudaBuf, dim: usize, s: &[f32]) {
        if self.faulted() || s.is_empty() {
            return;
        }
        check("scale_rows", x, s.len(), dim);
        let Some(sp) = self.stage_f32("scale_rows", &[s]) else { return };
        let xp = x.at_mut(&self.stream);
        let (d, n) = (dim as i32, s.len() as i32);
        let mut a = Launch::new(&self.k.scale_rows);
        a.arg(&xp).arg(&d).arg(&sp).arg(&n);
        self.launch(a, cfg_elems(s.len() * dim), "scale_rows");
    }

    fn route(&self, rule: &RouterRule, logits: &CudaBuf, bias: Option<&CudaVector>, n: usize, routes: &mut CudaBuf, at: usize) {
        if self.faulted() || n == 0 {
            return;
        }
        check("route input", logits, n, rule.num_experts());
        let r = self.route_args(rule, bias, routes, at, n);
        let lp = logits.at(&self.stream);
        let mut a = Launch::new(&self.k.route);
        a.arg(&lp);
        r.push(&mut a);
        let cfg = LaunchConfig { grid_dim: (n as u32, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: r.shared_bytes() };
        self.launch(a, cfg, "route");
    }

    #[allow(clippy::too_many_arguments)]
    fn router_and_route(
        &self,
        router: &CudaMatrix,
        input: &CudaBuf,
        n: usize,
        logits: &mut CudaBuf,
        rule: &RouterRule,
        bias: Option<&CudaVector>,
        routes: &mut CudaBuf,
        at: usize,
    ) {
        // One launch where a decoded token's router goes to `mvs_f32` anyway (see `products`).
        if !self.fused_route || n != 1 || router.format != Format::F32 || self.faulted() {
            self.matmul(router, None, input, n, logits);
            return self.route(rule, logits, bias, n, routes, at);
        }
        let e = rule.num_experts();
        assert_eq!(router.rows, e, "router_and_route: a router of {} rows for {e} experts", router.rows);
        check("router input", input, 1, router.cols);
        check("router logits", logits, 1, e);
        let r = self.route_args(rule, bias, routes, at, 1);
        let Some(ticket) = self.float_scratch(&self.ticket, 1, "last-block ticket") else { return };
        let wp = dptr(&router.data, &self.stream);
        let mut table = Jobs { count: 1, prefetch: self.prefetch as i32, job: [Job::default(); MAX_JOBS] };
        table.job[0] = Self::job(wp, router.row_bytes, e, router.cols, 0, 1, 0, 0);
        let (xp, op) = (input.at(&self.stream), logits.at_mut(&self.stream));
        let (xs, os) = (router.cols as i32, e as i32);
        let mut a = Launch::new(&self.k.mvs_f32_route);
        a.arg(&table).arg(&xp).arg(&xs).arg(&op).arg(&os);
        r.push(&mut a);
        a.arg(&ticket);
        // A block per router row, as `mvs_f32`; the last one routes with `route`'s memory.
        let cfg = LaunchConfig { grid_dim: (e as u32, 1, 1), block_dim: (128, 1, 1), shared_mem_bytes: r.shared_bytes() };
        self.launch(a, cfg, "router and route");
        self.fused_route_steps.fetch_add(1, Ordering::Relaxed);
    }

    fn keep_room(&self) -> u64 {
        if self.no_keep || self.faulted() {
            return 0;
        }
        if let Some(cap) = self.expert_cap {
            return cap;
        }
        // Loading comes first: leave room for the KV cache and work buffers still to come.
        let (free, total) = self.ctx.mem_get_info().unwrap_or((0, 0));
        (free as u64).saturating_sub(HEADROOM + total as u64 / 10)
    }

    fn keep_experts(&self, layer: usize, experts: usize, batch: &[(u32, ExpertView<'_>)]) -> bool {
        self.settle();
        if self.faulted() || self.no_keep {
            return false;
        }
        let r = self.kept.lock().expect("kept experts lock").keep(&self.stream, layer, experts, batch);
        // The host views go when this returns: the copies must have read them.
        let synced = self.ok("keeping experts", self.stream.synchronize());
        match r {
            Ok(()) => synced.is_some(),
            Err(e) => {
                self.record("keeping experts", e);
                false
            }
        }
    }

    fn kept_takes(&self, layer: usize, limit: Option<f32>, n: usize, run: usize) -> bool {
        if n <= self.kept_tokens {
            return true;
        }
        // Past `kept_tokens` only where the tiles take every such step (with the tiles from
        // beyond it, the steps between would go pair by pair, which nobody measured). Only
        // these steps look at the layer: a decoded token's never takes the lock.
        if n > self.kept_tile_tokens || run > self.kept_tile_run || self.kept_tiles_from > self.kept_tokens + 1 {
            return false;
        }
        let kept = self.kept.lock().expect("kept experts lock");
        kept.layer(layer).is_some_and(|l| self.tiles_take(l, limit))
    }
    fn kept_experts(
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
    ) {
        self.kept_experts_with(layer, routes, at, k, h, n, gu, slots, x, limit, None);
    }
    fn kept_experts_norm(
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
    ) {
        if !self.kept_experts_and_norm(layer, routes, at, k, h, n, gu, slots, x, limit, dim, w, eps) {
            self.rms_norm(x, n, dim, w, eps, h);
        }
    }

    fn kv_store(
        &self,
        cache: &mut CudaKvCache,
        layer: usize,
        pos0: usize,
        n: usize,
        k: &CudaBuf,
        k_stride: usize,
        k_off: usize,
        v: Option<(&CudaBuf, usize, usize)>,
    ) {
        if self.faulted() {
            return;
        }
        let l = &cache.layers[layer];
        let (kw, vw) = (l.k_width(), l.shape.heads * l.shape.v_dim);
        check_rows("kv_store keys", k, 0, n, k_stride, k_off, kw);
        if let Some((v, v_stride, v_off)) = v {
            check_rows("kv_store values", v, 0, n, v_stride, v_off, vw);
        }
        let Some((kp, vp)) = self.kv_room(cache, layer, pos0, n) else { return };
        if n == 0 {
            return;
        }
        self.copy_rows(k.at(&self.stream), k_stride, k_off, kp + (pos0 * kw * 4) as u64, kw, 0, kw, n);
        if let (Some((v, v_stride, v_off)), true) = (v, vp != 0) {
            self.copy_rows(v.at(&self.stream), v_stride, v_off, vp + (pos0 * vw * 4) as u64, vw, 0, vw, n);
        }
    }
    fn attention(
        &self,
        cache: &CudaKvCache,
        layer: usize,
        q: &CudaBuf,
        q_stride: usize,
        n: usize,
        pos0: usize,
        p: AttnParams<'_>,
        out: &mut CudaBuf,
    ) {
        if self.faulted() || n == 0 {
            return;
        }
        let l = &cache.layers[layer];
        let s = l.shape;
        check_rows("attention queries", q, 0, n, q_stride, 0, p.q_heads * s.k_dim);
        check("attention", out, n, p.q_heads * s.v_dim);
        if let Some(sinks) = p.sinks {
            assert!(sinks.len() >= p.q_heads, "attention: {} sinks for {} query heads", sinks.len(), p.q_heads);
        }
        if p.selected.is_some() {
            if p.window.is_some() || p.sinks.is_some() {
                // No model combines them; the selected kernels would apply neither.
                self.record("attention", "sliding windows and sinks with sparse attention are not implemented on CUDA; use --device cpu");
                return;
            }
            return self.attention_selected(cache, layer, q, q_stride, n, p, out);
        }
        l.check_attention(n, pos0, &p);
        let (qp, op) = (q.at(&self.stream), out.at_mut(&self.stream));
        // The decode kernel leaves an int8 copy of its output; the tiled ones do not.
        let few = !attention_tiles(s, n, &p) && n <= MV_TOKENS && s.v_dim.is_multiple_of(32);
        let quant = if few { self.quant_out(out, n, p.q_heads * s.v_dim) } else { (0, 0) };
        self.attention_at(l, qp, q_stride, n, pos0, p, op, quant);
    }
    /// Dense attention ([`seqs`]); selected positions go sequence by sequence.
    fn batches_attention(&self, p: &AttnParams<'_>) -> bool {
        self.batch_attention && p.selected.is_none()
    }
    fn attention_batch(
        &self,
        layer: usize,
        seqs: &[SeqQueries<'_, CudaKvCache>],
        q: &CudaBuf,
        q_stride: usize,
        p: AttnParams<'_>,
        out: &mut CudaBuf,
    ) {
        self.attention_seqs(layer, seqs, q, q_stride, p, out);
    }
    fn qk_rope_store_batch(
        &self,
        qkv: &mut CudaBuf,
        n: usize,
        rows: QkvRows,
        norm: Option<(&CudaVector, &CudaVector, f32)>,
        rope: RopeTables<'_>,
        seqs: &mut [SeqStore<'_, CudaKvCache>],
        layer: usize,
    ) {
        self.fused_qk_rope_store_seqs(qkv, n, rows, norm, rope, seqs, layer);
    }
}

/// Keys per run of the tensor-core prefill attention for `n` queries after `pos0` positions,
/// and the runs of one head (its blocks). Runs of `run` keys (128: four tiles, 20 blocks a
/// head for 512 queries, whose last ones wait out 4 tiles one after another rather than 16;
/// 0: unsplit). Longer runs where that would take more than 2,048 blocks (a long context),
/// which bounds the partial results at 2,048 × 64 rows × (v_dim + 2) floats (68 MiB for heads
/// of 128; the scratch holding them grows to twice what is asked, and does not shrink).
fn attention_runs(n: usize, pos0: usize, q_heads: usize, run: usize) -> (usize, usize) {
    let items = |chunk: usize| (0..n.div_ceil(64)).map(|qt| (pos0 + ((qt + 1) * 64).min(n) - 1) / chunk + 1).sum::<usize>();
    let mut chunk = if run == 0 { pos0 + n } else { run.next_multiple_of(32) };
    while items(chunk) * q_heads > 2048 && chunk < pos0 + n {
        chunk *= 2;
    }
    (chunk, items(chunk))
}

impl CudaBackend {
    /// Attention of `n` queries at `qp` (rows `q_stride` apart) over layer `l`, into `op`
    /// (with the int8 copy at `quant`, where the decode kernel runs; `(0, 0)`: none): the
    /// tiled kernels for many queries without windows or sinks, else the decode kernel.
    #[allow(clippy::too_many_arguments)]
    fn attention_at(&self, l: &KvLayer, qp: u64, q_stride: usize, n: usize, pos0: usize, p: AttnParams<'_>, op: u64, quant: (u64, i32)) {
        let s = l.shape;
        let kp = l.keys(&self.stream);
        let (vp, v_row, v_head) =
            if s.values_in_keys { (kp, l.k_width(), s.k_dim) } else { (l.values(&self.stream), l.v_width(), s.v_dim) };
        // Windows and sinks (gpt-oss) go to the one-block-per-row kernel, whatever the count
        // of queries: a sliding layer's row sees at most its window.
        if attention_tiles(s, n, &p) {
            // Many queries: key tiles shared by 32 queries of a head (attention_tiles).
            let (heads, kd, vd, vr, vh) = (s.heads as i32, s.k_dim as i32, s.v_dim as i32, v_row as i32, v_head as i32);
            let (qs, qh, p0, n_i) = (q_stride as i32, p.q_heads as i32, pos0 as i32, n as i32);
            // On tensor cores (3xTF32) where the heads are whole k-steps of 8: 64 queries a block.
            // (rows staged four floats at a time: value rows and heads at multiples of 4).
            let mma = self.tensor_core_attention
                && s.k_dim.is_multiple_of(8)
                && s.v_dim.is_multiple_of(8)
                && v_row.is_multiple_of(4)
                && v_head.is_multiple_of(4);
            let (func, per_block, threads, what) = if mma {
                let d128 = s.k_dim == 128 && s.v_dim == 128;
                (if d128 { &self.k.attention_mma_d128 } else { &self.k.attention_mma }, 64, 128, "attention, tensor cores")
            } else {
                (&self.k.attention_tiles, 32, 256, "attention, tiled")
            };
            let mut a = Launch::new(func);
            a.arg(&kp).arg(&vp).arg(&heads).arg(&kd).arg(&vd).arg(&vr).arg(&vh).arg(&qp).arg(&qs).arg(&qh);
            a.arg(&n_i).arg(&p0).arg(&p.scale).arg(&op);
            let tiles = n.div_ceil(per_block);
            let mut grid = (tiles as u32, p.q_heads as u32, 1);
            // The tensor-core kernel splits each query tile's keys in runs (see attention.cu).
            let (chunk, items) = attention_runs(n, pos0, p.q_heads, self.attention_run);
            let floats = p.q_heads * items * per_block * (s.v_dim + 2);
            let scratch = if !mma || items == tiles {
                Some((0, 0))
            } else {
                self.split_scratch(&self.tile_part, &self.tile_tickets, floats, p.q_heads * tiles)
            };
            let Some(scratch) = scratch else { return };
            let chunk = chunk as i32;
            if mma {
                a.arg(&chunk).arg(&scratch.0).arg(&scratch.1);
                grid.0 = items as u32;
            }
            self.launch(a, LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: 0 }, what);
            return;
        }
        self.attention_decode(kp, vp, s, v_row, v_head, qp, q_stride, n, pos0, p, op, quant);
    }
}

impl CudaBackend {
    /// The one-block-per-row attention kernel (flash-decoding splits past 32 positions for a
    /// few queries) over keys at `kp` and values at `vp` (rows of `v_row` floats, a head every
    /// `v_head`) for positions `0..pos0 + n`, or the window of `p`, with its sinks: queries at
    /// `qp`, outputs at `op`, their int8 copy at `quant` (`(0, 0)`: none).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_decode(
        &self,
        kp: u64,
        vp: u64,
        s: KvShape,
        v_row: usize,
        v_head: usize,
        qp: u64,
        q_stride: usize,
        n: usize,
        pos0: usize,
        p: AttnParams<'_>,
        op: u64,
        (qx, qstride): (u64, i32),
    ) {
        let (heads, kd, vd, vr, vh) = (s.heads as i32, s.k_dim as i32, s.v_dim as i32, v_row as i32, v_head as i32);
        let (qs, qh, p0) = (q_stride as i32, p.q_heads as i32, pos0 as i32);
        let threads = 128u32;
        let shared = ((s.k_dim + threads as usize + s.v_dim) * 4) as u32;
        // The context is split in runs of `split` positions over blocks, merged by the last
        // of each row (flash-decoding): one block per query head left most SMs idle (32
        // blocks on 132 SMs), and a decoded token's attention grew with every position.
        // Positions before the first query's window are seen by no row: the splits start at
        // `first`. Many queries fill the GPU by themselves and are not split.
        let first = p.first_seen(pos0);
        let (split, splits) = attention_splits(n, pos0, &p);
        let rows = n * p.q_heads;
        let sinks = match p.sinks {
            Some(s) => match self.stage_f32("attention sinks", &[s]) {
                Some(ptr) => ptr,
                None => return,
            },
            None => 0,
        };
        let (first_i, window) = (first as i32, p.window.unwrap_or(0) as i32);
        // The partial results, and the tickets (one int a row, left at 0 by each launch) in a
        // buffer of their own: when they shared one, a call of more rows than the one before
        // found that call's partial results where its own tickets lay, never counted to its
        // last split and left those rows unwritten (seen on the H200 as zeros for the second
        // and third queries of a windowed case).
        let scratch = if splits > 1 {
            self.split_scratch(&self.attention_part, &self.attention_tickets, rows * splits * (s.v_dim + 2), rows)
        } else {
            Some((0, 0))
        };
        let Some((pp, tp)) = scratch else { return };
        let split_i = split as i32;
        let mut a = Launch::new(&self.k.attention);
        a.arg(&kp).arg(&vp).arg(&heads).arg(&kd).arg(&vd).arg(&vr).arg(&vh).arg(&qp).arg(&qs).arg(&qh);
        a.arg(&p0).arg(&p.scale).arg(&op).arg(&qx).arg(&qstride).arg(&split_i).arg(&pp).arg(&tp);
        let prefetch = self.prefetch as i32;
        a.arg(&first_i).arg(&window).arg(&sinks).arg(&prefetch);
        let grid = (rows as u32, splits as u32, 1);
        self.launch(a, LaunchConfig { grid_dim: grid, block_dim: (threads, 1, 1), shared_mem_bytes: shared }, "attention");
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Frees are stream-ordered: let them finish before the context may go.
        self.settle();
        let _ = self.stream.synchronize();
        let _ = self.copy_stream.synchronize();
        if let Some(p) = &self.profile {
            let mut rows: Vec<_> = p.lock().map(|p| p.iter().map(|(k, v)| (*k, *v)).collect()).unwrap_or_default();
            rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
            eprintln!("cuda profile ({}): kernel, launches, seconds, microseconds each", self.info.short());
            let listed: f64 = rows.iter().map(|r| r.1 .1).sum();
            for (op, (n, secs)) in rows {
                eprintln!("  {op:<24} {n:>9} {secs:>9.3} {:>9.1}", secs * 1e6 / n.max(1) as f64);
            }
            // The rest of the wall time went to host work between the profiled calls.
            if let Some(t0) = self.profile_start.get() {
                let wall = t0.elapsed().as_secs_f64();
                eprintln!("  (wall since the first row) {wall:.3} s; outside the rows above {:.3} s", wall - listed);
            }
        }
    }
}

/// `route`'s parameters after the logits, in the kernel's order (kernels.cu; `mvs_f32_route`
/// takes them too).
struct RouteArgs {
    e: i32,
    bias: u64,
    sigmoid: i32,
    n_group: i32,
    topk_group: i32,
    k: i32,
    norm: i32,
    scaling: f32,
    routes: u64,
}

impl RouteArgs {
    /// The kernel's dynamic shared memory: 2 e + 2 k floats.
    fn shared_bytes(&self) -> u32 {
        ((2 * self.e + 2 * self.k) * 4) as u32
    }

    fn push<'a>(&'a self, a: &mut Launch<'a>) {
        a.arg(&self.e).arg(&self.bias).arg(&self.sigmoid).arg(&self.n_group).arg(&self.topk_group);
        a.arg(&self.k).arg(&self.norm).arg(&self.scaling).arg(&self.routes);
    }
}

#[cfg(test)]
mod tests {
    use super::attention_runs;

    /// The prefill attention's runs: 128 keys each while that takes at most 2,048 blocks,
    /// longer past that; unsplit on request.
    #[test]
    fn attention_runs_split_long_tiles_and_stay_bounded() {
        // 512 queries from the start: tiles of 64 see 64..512 keys, 1+1+2+2+3+3+4+4 runs.
        assert_eq!(attention_runs(512, 0, 32, 128), (128, 20));
        // Short prompts stay one run a tile.
        assert_eq!(attention_runs(100, 0, 32, 128), (128, 2));
        // After a long context the runs grow until 32 heads take at most 2,048 blocks.
        let (chunk, items) = attention_runs(512, 32_768, 32, 128);
        assert!(items * 32 <= 2048 && chunk % 32 == 0 && chunk > 128, "{chunk} {items}");
        // Runs of 64 for 512 queries: 1 + 2 + ... + 8 a head.
        assert_eq!(attention_runs(512, 0, 32, 64), (64, 36));
        // Unsplit: one run of every key per tile.
        assert_eq!(attention_runs(300, 200, 8, 0), (500, 5));
    }
}
