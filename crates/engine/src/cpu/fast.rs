//! The production matrix products: activations quantized to int8 blocks once per call, SIMD
//! dot products (smoe-kernels), output rows split across the persistent pool.

use super::pool::Pool;
use smoe_kernels::arena::QuantRows;
use smoe_kernels::gemm::{self, ActTile};
use smoe_kernels::{ActArena, Kernels};
use smoe_quant::{Layout, QMatrix};
use std::cell::RefCell;
use std::sync::Mutex;

thread_local! {
    /// The calling thread's buffers for one product, reused across calls (on decode's path
    /// the only allocation per call is `matmul_many`'s list of its weight views).
    static CALLER: RefCell<Caller> = RefCell::new(Caller::default());
    /// A task's outputs, row-major.
    static ROWOUT: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// An input `matmul_many` needs: rows `x_row..x_row + n` of `cols` quantized as `ActKind`,
/// the first job that reads it, and whether any of its jobs needs the interleaved tile.
struct Input {
    key: (usize, usize, usize, smoe_kernels::act::ActKind),
    first_job: usize,
    tiled: bool,
}

/// What the calling thread keeps between products.
#[derive(Default)]
struct Caller {
    /// Every input of one product (or batch of products) quantized, and interleaved for the
    /// many-token kernels, in one arena sized by the largest batch.
    arena: ActArena,
    /// Task row ranges `(job, first, end)`.
    tasks: Vec<(usize, usize, usize)>,
    /// `matmul_many`: the inputs one call needs, and which of them each job reads.
    needs: Vec<Input>,
    input_of: Vec<usize>,
}

/// Rows `r0..r1` of `w` against a tile of tokens (a format with a many-token kernel), eight
/// rows at a time: an interleaved matrix's group per call ([`Kernels::gemm_group8`]), plain
/// rows through [`Kernels::gemm_block`]. The products collect row-major in a task buffer and
/// leave for `dest(token)`, that token's `r1 - r0` outputs, eight tokens at a time
/// ([`Kernels::scatter_tokens`]): outputs are token-major, and scattering each product to its
/// own token row cost more than the kernel on prefill's short expert jobs.
#[inline]
fn gemm_rows<'o>(k: &Kernels, w: &QMatrix<'_>, r0: usize, r1: usize, tile: &ActTile<'_>, dest: impl Fn(usize) -> &'o mut [f32]) {
    ROWOUT.with(|buf| {
        let buf = &mut *buf.borrow_mut();
        let (n, m, rb, f) = (tile.n, r1 - r0, w.row_bytes(), w.format);
        buf.resize(m * n, 0.0);
        for c in (r0..r1).step_by(TASK_ROWS) {
            let (rows, out) = (&w.data[c * rb..(c + TASK_ROWS).min(r1) * rb], &mut buf[(c - r0) * n..]);
            let done = match w.layout {
                Layout::Rows => k.gemm_block(f, rows, rb, tile, out),
                Layout::Interleaved8 => k.gemm_group8(f, rows, tile, out),
            };
            assert!(done, "no many-token kernel for {f}");
        }
        k.scatter_tokens(&buf[..m * n], m, n, dest);
    })
}

/// Rows `r0..r1` of `w` against one token's activations, into `out` (`r1 - r0` values): the
/// row kernel, or eight rows per call on an interleaved matrix.
#[inline]
fn dot_rows(k: &Kernels, w: &QMatrix<'_>, r0: usize, r1: usize, a: smoe_kernels::ActRow<'_>, out: &mut [f32]) {
    let rb = w.row_bytes();
    match w.layout {
        Layout::Rows => k.dot_rows(w.format, &w.data[r0 * rb..r1 * rb], rb, a, out),
        Layout::Interleaved8 => {
            // Tasks start and end on whole groups (TASK_ROWS); zip must not drop a remainder.
            assert!(r0.is_multiple_of(8) && out.len() == r1 - r0 && out.len().is_multiple_of(8), "rows {r0}..{r1} are not whole groups");
            for (g, o) in (r0..r1).step_by(8).zip(out.chunks_exact_mut(8)) {
                let o: &mut [f32; 8] = o.try_into().expect("eight rows");
                k.dot_group8(w.format, &w.data[g * rb..(g + 8) * rb], w.cols, a, o);
            }
        }
    }
}

/// Whether `n` tokens against `w` take the many-token kernels (an interleaved tile of
/// activations), not the one-token kernels once per token. An interleaved matrix with group
/// kernels for several tokens keeps them for more tokens, since they read and unpack a group's
/// weights once for all of them and give each token the bits it gets alone:
/// - Q8_0 (dense matrices, [`crate::Backend::prepare_dense`]), four tokens a call, up to
///   [`GROUP_TOKENS`]: on the 2-core EPYC a 16- or 32-sequence batch decoded 5-10% faster
///   than through the tiles; prefill's longer steps take the tiled kernels on the group's rows
///   taken apart (on the H200 host the group kernel cost 23% of prefill(512) at 2 threads).
/// - Q8_0 left in rows (a slice of rows, as MLA's per-head `kv_b`; experts streamed through a
///   partial cache) keeps the one-token kernel below [`ROWS_Q8_TOKENS`] where the table has the
///   Q8_0 group kernel, so that a token's Q8_0 products take the same bits alone and in a step
///   of up to 15 tokens: with tiles from 4, DeepSeek-V3 (YaRN) and V4 had drifted 2-3e-2 from
///   alone in a batch on AVX2, as int8 activations turned last-bit differences into rounding
///   flips. Not up to 64 as interleaved matrices: one token at a time, 8-15 tokens of a row
///   matrix ran 2-3× slower than the tiles on AVX2 (`mvspeed`), and a streamed expert in
///   prefill often has that many.
/// - Q4_K (experts), three or two tokens a call, below the table's
///   [`Kernels::group8_tiles_from`] (16 tokens with VNNI, 8 with AVX2): a batch's experts and
///   prefill's less chosen ones. `SMOE_TILES_FROM=N` overrides it (read once; 4 was the rule
///   before, to compare).
fn many_tokens(k: &Kernels, w: &QMatrix<'_>, n: usize) -> bool {
    let from = match (w.layout, w.format) {
        (Layout::Interleaved8, smoe_quant::Format::Q8_0) => GROUP_TOKENS,
        (Layout::Interleaved8, f) if k.has_group8_few(f) => tiles_from_override().unwrap_or(k.group8_tiles_from(f)),
        (Layout::Rows, smoe_quant::Format::Q8_0) if k.has_group8(smoe_quant::Format::Q8_0) => ROWS_Q8_TOKENS,
        _ => 4,
    };
    n >= from && k.has_gemm(w.format)
}

/// Tokens from which interleaved Q8_0 takes the tiled kernels (see [`many_tokens`]).
const GROUP_TOKENS: usize = 64;

/// Tokens from which Q8_0 in row layout takes the tiled kernels where the table has the Q8_0
/// group kernel (see [`many_tokens`]); 4 elsewhere.
const ROWS_Q8_TOKENS: usize = 16;

/// `SMOE_TILES_FROM`, read once (see [`many_tokens`]).
fn tiles_from_override() -> Option<usize> {
    static FROM: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    *FROM.get_or_init(|| std::env::var("SMOE_TILES_FROM").ok().and_then(|v| v.parse().ok()).filter(|&n| n >= 2))
}

/// Rows `r0..r1` of `w` against tokens `0..n` of `act` through the one-token kernels, token
/// `t`'s outputs into `dest(t, first row, rows)`. An interleaved matrix goes group by group,
/// each group's tokens four at a time where it has a four-token kernel (Q8_0), then three or
/// two at a time where it has those (Q4_K), then one by one: the same bits as one at a time.
/// Others go by blocks of rows, every token against each block while it is in cache.
fn dot_tokens<'o>(
    k: &Kernels,
    w: &QMatrix<'_>,
    r0: usize,
    r1: usize,
    act: QuantRows<'_>,
    n: usize,
    dest: impl Fn(usize, usize, usize) -> &'o mut [f32],
) {
    if w.layout == Layout::Interleaved8 && n >= 2 {
        // Tasks start and end on whole groups (TASK_ROWS): `dest` hands out rows r0..r1 only.
        assert!(r0.is_multiple_of(8) && (r1 - r0).is_multiple_of(8), "rows {r0}..{r1} are not whole groups");
        let (rb, few) = (w.row_bytes(), k.has_group8_few(w.format));
        for g in (r0..r1).step_by(8) {
            let group = &w.data[g * rb..(g + 8) * rb];
            let o = |t: usize| -> &mut [f32; 8] { dest(t, g, 8).try_into().expect("eight rows") };
            let mut t = 0;
            while n - t >= 4
                && k.dot_group8_x4(w.format, group, w.cols, std::array::from_fn(|i| act.row(t + i)), std::array::from_fn(|i| o(t + i)))
            {
                t += 4;
            }
            while few && n - t >= 2 {
                let m = Kernels::group8_few_next(n - t);
                let a = [act.row(t), act.row(t + 1), act.row(t + m - 1)];
                let done = match m {
                    2 => k.dot_group8_few(w.format, group, w.cols, &a[..2], &mut [o(t), o(t + 1)]),
                    _ => k.dot_group8_few(w.format, group, w.cols, &a, &mut [o(t), o(t + 1), o(t + 2)]),
                };
                assert!(done, "{} has few-token group kernels", w.format);
                t += m;
            }
            for t in t..n {
                dot_rows(k, w, g, g + 8, act.row(t), dest(t, g, 8));
            }
        }
        return;
    }
    for (b0, b1) in row_blocks(r0, r1, n) {
        for t in 0..n {
            dot_rows(k, w, b0, b1, act.row(t), dest(t, b0, b1 - b0));
        }
    }
}

/// Rows a task's one-row-kernel products take per pass over its tokens: 32 rows of a Q4_K
/// expert (2048 wide) are 36 KiB, so every token after the first reads them from L1/L2
/// instead of streaming the whole task's rows again (a batch of decode tokens puts two or three
/// tokens on many experts).
const BLOCK_ROWS: usize = 32;
const _: () = assert!(BLOCK_ROWS.is_multiple_of(TASK_ROWS));

/// Rows `r0..r1` as blocks of [`BLOCK_ROWS`] when `n` tokens share them, else whole: each
/// row's product is the same either way, only the order of rows and tokens changes.
fn row_blocks(r0: usize, r1: usize, n: usize) -> impl Iterator<Item = (usize, usize)> {
    let step = if n > 1 { BLOCK_ROWS } else { (r1 - r0).max(1) };
    (r0..r1).step_by(step).map(move |b| (b, (b + step).min(r1)))
}

/// Task row ranges `(job, first, end)` over jobs of `(rows, work per row)`, largest first:
/// each task takes half a thread's share of the work still left (guided self-scheduling),
/// never less than a minimum that amortises taking it, in whole row groups. The pool hands
/// tasks out in order, so the last ones are small and the threads finish within a small task
/// of each other (equal tasks left the caller waiting ~7% of decode for the last one).
///
/// `SMOE_TASK_SHARE=K` takes `1/K` of a thread's share instead of half (read once; K ≥ 1): a
/// task handed to a thread that runs K times slower than the others (a busy hyperthread, a
/// far memory node) still ends with them, so smaller shares guard a host whose cores do not
/// run alike (the Intel host's 16 cores ran one kernel at 46–80 GMAC/s side by side, #23), at
/// the price of more tasks to take.
fn guided_tasks(jobs: impl Iterator<Item = (usize, usize)> + Clone, threads: usize, tasks: &mut Vec<(usize, usize, usize)>) {
    guided_tasks_by(jobs, task_share() * threads.max(1), tasks)
}

/// [`guided_tasks`] with each task taking `1/share` of the work left.
fn guided_tasks_by(jobs: impl Iterator<Item = (usize, usize)> + Clone, share: usize, tasks: &mut Vec<(usize, usize, usize)>) {
    const MIN_WORK: usize = 16384;
    let share = share.max(1);
    let mut left: usize = jobs.clone().map(|(rows, wpr)| rows * wpr).sum();
    for (ji, (rows, wpr)) in jobs.enumerate() {
        let mut r = 0;
        while r < rows {
            let want = (left / share).max(MIN_WORK);
            let n = whole_row_groups((want / wpr.max(1)).max(1)).min(rows - r);
            tasks.push((ji, r, r + n));
            left = left.saturating_sub(n * wpr);
            r += n;
        }
    }
}

/// The divisor of a thread's share in [`guided_tasks`]: 2, or `SMOE_TASK_SHARE` (read once).
fn task_share() -> usize {
    static SHARE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *SHARE.get_or_init(|| std::env::var("SMOE_TASK_SHARE").ok().and_then(|v| v.parse().ok()).filter(|&k| k >= 1).unwrap_or(2))
}

/// Tasks start on multiples of this many rows: whole groups of an interleaved matrix, and of
/// the many-row kernels' [`gemm::ROWS`].
const TASK_ROWS: usize = 8;
const _: () = assert!(TASK_ROWS.is_multiple_of(gemm::ROWS) && TASK_ROWS == smoe_quant::interleave::ROWS);

/// `rows` rounded up to whole multiples of [`TASK_ROWS`], so that tasks end on group
/// boundaries and only a matrix's last rows take the one-row kernel.
fn whole_row_groups(rows: usize) -> usize {
    rows.div_ceil(TASK_ROWS) * TASK_ROWS
}

/// Quantizes (and interleaves) every input laid out in `arena`, input `i`'s row `t` being
/// `row(i)(t)`: a pass over every activation, on the pool in pieces of rows when there is
/// enough of it (prefill's attention input, whose one input had kept the caller busy alone
/// while the other threads waited: with the other serial stretches, 10% of prefill's wall time
/// at 2 threads on the EPYC; moving them took prefill at 16 threads on the Intel host from
/// 554 to 858 tok/s), else on the caller. `rows` is the inputs' total, `cols` their widest.
fn fill_inputs<'x, R: Fn(usize) -> &'x [f32]>(
    arena: &mut ActArena,
    pool: &Pool,
    rows: usize,
    cols: usize,
    row: &(dyn Fn(usize) -> R + Sync),
) {
    let threads = pool.threads();
    if rows * cols < 1 << 16 || threads == 1 {
        (0..arena.len()).for_each(|i| arena.fill(i, row(i)));
        return;
    }
    // About two pieces a thread; each task fills its own piece's disjoint part of the arena.
    let parts: Vec<Mutex<_>> = arena.pieces(rows.div_ceil(2 * threads)).into_iter().map(Mutex::new).collect();
    pool.run(parts.len(), &|i| {
        let mut part = parts[i].lock().unwrap_or_else(|e| e.into_inner());
        let input = part.input();
        part.fill(row(input));
    });
}

/// `out[t, r] = w[r, :] · x[t, :]` for `t < n`.
pub(crate) fn matmul(k: &Kernels, pool: &Pool, w: &QMatrix<'_>, x: &[f32], n: usize, out: &mut [f32]) {
    let (m, cols) = (w.rows, w.cols);
    assert!(x.len() >= n * cols && out.len() >= n * m, "matmul buffers too small");
    CALLER.with(|c| {
        let Caller { arena, tasks, .. } = &mut *c.borrow_mut();
        let tiled = many_tokens(k, w, n);
        arena.layout(std::iter::once((w.format, n, cols, tiled)));
        fill_inputs(arena, pool, n, cols, &|_| move |t: usize| &x[t * cols..(t + 1) * cols]);
        let sink = super::DisjointOut::new(&mut out[..n * m]);
        tasks.clear();
        guided_tasks(std::iter::once((m, cols * n)), pool.threads(), tasks);
        if let Some(tile) = arena.tile(0).filter(|_| tiled) {
            // Prefill: every row against tiles of 8 interleaved tokens.
            pool.run(tasks.len(), &|i| {
                let (_, r0, r1) = tasks[i];
                // SAFETY: this task alone computes rows r0..r1 of every token.
                gemm_rows(k, w, r0, r1, &tile, |t| unsafe { sink.range(t * m + r0, r1 - r0) });
            });
            return;
        }
        let act = arena.rows(0);
        pool.run(tasks.len(), &|i| {
            let (_, r0, r1) = tasks[i];
            // SAFETY: this task alone computes rows r0..r1 of every token.
            dot_tokens(k, w, r0, r1, act, n, |t, r, len| unsafe { sink.range(t * m + r, len) });
        });
    })
}

/// Several products in one pool dispatch. Jobs reading the same input rows with the same
/// activation format share one quantization.
pub(crate) fn matmul_many<M: Sync>(
    k: &Kernels,
    pool: &Pool,
    jobs: &[(QMatrix<'_>, &crate::backend::MatJob<'_, M>)],
    x: &[f32],
    x_stride: usize,
    out: &mut [f32],
    out_stride: usize,
) {
    CALLER.with(|c| {
        let Caller { arena, needs, input_of, tasks } = &mut *c.borrow_mut();
        // The distinct inputs, and which one each job reads. A job that shares an input with
        // a format that has no many-token kernel may still need the tile for its own.
        input_of.clear();
        needs.clear();
        for (ji, (w, j)) in jobs.iter().enumerate() {
            let key = (j.x_row, j.n, w.cols, smoe_kernels::act_kind(w.format));
            let idx = needs.iter().position(|n| n.key == key).unwrap_or_else(|| {
                needs.push(Input { key, first_job: ji, tiled: false });
                needs.len() - 1
            });
            needs[idx].tiled |= many_tokens(k, w, j.n);
            input_of.push(idx);
        }
        arena.layout(needs.iter().map(|n| (jobs[n.first_job].0.format, n.key.1, n.key.2, n.tiled)));
        let input_rows = |i: usize| {
            let (j, cols) = (jobs[needs[i].first_job].1, needs[i].key.2);
            move |t: usize| &x[(j.x_row + t) * x_stride..][..cols]
        };
        let (rows, cols) = needs.iter().fold((0, 0), |(r, c), n| (r + n.key.1, c.max(n.key.2)));
        fill_inputs(arena, pool, rows, cols, &input_rows);
        let arena = &*arena;
        // Tasks: row chunks of every job.
        tasks.clear();
        guided_tasks(jobs.iter().map(|(w, j)| (w.rows, w.cols * j.n)), pool.threads(), tasks);
        let sink = super::DisjointOut::new(out);
        pool.run(tasks.len(), &|ti| {
            let (ji, r0, r1) = tasks[ti];
            let (w, j) = &jobs[ji];
            let input = input_of[ji];
            let at = |t: usize, r: usize| (j.out_row + t) * out_stride + j.out_col + r;
            if let Some(tile) = arena.tile(input).filter(|_| many_tokens(k, w, j.n)) {
                // SAFETY: this task alone computes rows r0..r1 of this job's outputs.
                gemm_rows(k, w, r0, r1, &tile, |t| unsafe { sink.range(at(t, r0), r1 - r0) });
            } else {
                // SAFETY: this task alone computes rows r0..r1 of this job's outputs.
                dot_tokens(k, w, r0, r1, arena.rows(input), j.n, |t, r, len| unsafe { sink.range(at(t, r), len) });
            }
        });
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{MatJob, WeightRef};
    use smoe_quant::Format;

    /// Guided tasks cover every row of every job once, in order, on row-group boundaries
    /// (but a job's end), and shrink towards the end.
    #[test]
    fn guided_tasks_cover_each_row_once_and_shrink() {
        let jobs = [(4096usize, 2048usize), (768, 2048), (3, 512), (768, 65536)];
        let work = |&(ji, r0, r1): &(usize, usize, usize)| (r1 - r0) * jobs[ji].1;
        let mut first_tasks = Vec::new();
        // 4 is two threads at the default share; 8 and 32 two threads at `SMOE_TASK_SHARE=4`
        // and sixteen at the default.
        for share in [2, 4, 8, 32] {
            let mut tasks = Vec::new();
            guided_tasks_by(jobs.iter().copied(), share, &mut tasks);
            let mut next = vec![0usize; jobs.len()];
            for &(ji, r0, r1) in &tasks {
                assert_eq!(r0, next[ji], "share {share}: job {ji} rows in order without gaps");
                assert!(r1 > r0 && (r1 % TASK_ROWS == 0 || r1 == jobs[ji].0), "share {share}: task {ji} {r0}..{r1}");
                next[ji] = r1;
            }
            assert!(next.iter().zip(&jobs).all(|(&n, &(rows, _))| n == rows), "share {share}: every row");
            let (first, last) = (work(&tasks[0]), work(tasks.last().unwrap()));
            assert!(last * 2 < first, "share {share}: the last task ({last}) is smaller than the first ({first})");
            first_tasks.push(first);
        }
        let shrinks = first_tasks.windows(2).all(|w| w[1] <= w[0]) && first_tasks[3] < first_tasks[0];
        assert!(shrinks, "larger shares start with smaller tasks (a first job's whole rows at most): {first_tasks:?}");
    }

    /// Two to fifteen tokens on an interleaved Q4_K matrix (a batch's expert, or one prefill
    /// chose less often) take the few-token group kernels, in threes and twos; each token gets
    /// exactly the outputs it gets alone.
    #[test]
    fn two_to_fifteen_tokens_on_interleaved_q4k_give_each_token_its_bits_alone() {
        let (k, pool) = (smoe_kernels::best(), Pool::new(2));
        let (rows, cols) = (64, 512);
        let plain = pattern_rows(Format::Q4_K, rows, cols);
        let mut inter = vec![0u8; plain.len()];
        smoe_quant::interleave::interleave(Format::Q4_K, &plain, rows, cols, &mut inter);
        let mut m = QMatrix::new(Format::Q4_K, rows, cols, &inter).unwrap();
        m.layout = Layout::Interleaved8;
        // This CPU's best table and, where it is another, AVX2 (tiles from 8 tokens).
        let avx2 = smoe_kernels::available().into_iter().find(|t| t.isa == "avx2");
        for t in avx2.iter().chain([k]) {
            for n in 2..t.group8_tiles_from(Format::Q4_K) {
                assert!(!many_tokens(t, &m, n) || tiles_from_override().is_some(), "{n} tokens take the few-token kernels");
                assert_each_token_alone(t, &pool, &m, n, 0.0);
            }
        }
    }

    /// Q8_0 in row layout (a slice of rows, a streamed expert) gives each of up to 15 tokens
    /// its bits alone where the table has the Q8_0 group kernel, and takes the tiles from 16.
    #[test]
    fn up_to_fifteen_tokens_on_q8_0_rows_give_each_token_its_bits_alone() {
        let pool = Pool::new(2);
        let (rows, cols) = (40, 512);
        let q = pattern_rows(Format::Q8_0, rows, cols);
        let m = QMatrix::new(Format::Q8_0, rows, cols, &q).unwrap();
        let mut checked = 0;
        for k in smoe_kernels::available().iter().filter(|k| k.has_group8(Format::Q8_0)) {
            assert!(many_tokens(k, &m, ROWS_Q8_TOKENS) && !many_tokens(k, &m, ROWS_Q8_TOKENS - 1), "{}", k.isa);
            for n in 2..ROWS_Q8_TOKENS {
                assert_each_token_alone(k, &pool, &m, n, 0.0);
            }
            checked += 1;
        }
        assert!(checked > 0 || !cfg!(target_arch = "x86_64") || !smoe_kernels::best().has_gemm(Format::Q8_0));
    }

    /// `n` tokens through `m` at once give each token, in its own place, what it gets alone:
    /// the same bits with `rel` 0, else within `rel` relative (plus `rel` absolute).
    fn assert_each_token_alone(k: &Kernels, pool: &Pool, m: &QMatrix<'_>, n: usize, rel: f32) {
        let (rows, cols) = (m.rows, m.cols);
        let x: Vec<f32> = (0..n * cols).map(|i| ((i * 31 % 97) as f32 - 48.0) / 17.0).collect();
        let mut together = vec![0f32; n * rows];
        matmul(k, pool, m, &x, n, &mut together);
        for t in 0..n {
            let mut alone = vec![0f32; rows];
            matmul(k, pool, m, &x[t * cols..(t + 1) * cols], 1, &mut alone);
            let got = &together[t * rows..(t + 1) * rows];
            if rel == 0.0 {
                assert_eq!(got, &alone[..], "{} token {t} of {n}", m.format);
            } else {
                for (i, (a, b)) in got.iter().zip(&alone).enumerate() {
                    assert!((a - b).abs() <= rel * (1.0 + b.abs()), "{} token {t} of {n}, row {i}: {a} vs {b}", m.format);
                }
            }
        }
    }

    /// Q2_K and Q3_K rows against 4 to 9 tokens (the many-token kernels where the table has
    /// them): each token's outputs, in its own place, are what it gets alone, to the float
    /// rounding of the per-block scales (`many_token_kernels_match_single_dots` in the kernels).
    #[test]
    fn low_bit_rows_against_several_tokens_give_each_its_products_alone() {
        let (k, pool) = (smoe_kernels::best(), Pool::new(2));
        let (rows, cols) = (40, 512);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7 % 53) as f32 - 26.0) / 9.0).collect();
        for f in [Format::Q2_K, Format::Q3_K] {
            let rb = f.row_bytes(cols).unwrap();
            let mut q = vec![0u8; rb * rows];
            for (d, s) in q.chunks_mut(rb).zip(w.chunks(cols)) {
                smoe_quant::quantize(f, s, d).unwrap();
            }
            let m = QMatrix::new(f, rows, cols, &q).unwrap();
            for n in [4usize, 6, 9] {
                assert_each_token_alone(k, &pool, &m, n, 1e-4);
            }
        }
    }

    const SLOT: smoe_store::SlotHandle = smoe_store::SlotHandle { slot: 0, load: 0 };

    /// Rows of an `f` matrix (`rows × cols`) quantized from a fixed pattern.
    fn pattern_rows(f: Format, rows: usize, cols: usize) -> Vec<u8> {
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7 % 53) as f32 - 26.0) / 9.0).collect();
        let rb = f.row_bytes(cols).unwrap();
        let mut q = vec![0u8; rb * rows];
        for (d, s) in q.chunks_mut(rb).zip(w.chunks(cols)) {
            smoe_quant::quantize(f, s, d).unwrap();
        }
        q
    }

    /// Two products on one input, the first in a format without a many-token kernel and the
    /// second with one: each must compute exactly what it computes alone.
    #[test]
    fn jobs_sharing_an_input_each_take_their_own_kernel_path() {
        let (k, pool) = (smoe_kernels::best(), Pool::new(2));
        assert!(!k.has_gemm(Format::Q6_K), "the test wants Q6_K without a many-token kernel");
        let (rows, cols, n) = (16, 512, 8);
        let x: Vec<f32> = (0..n * cols).map(|i| ((i * 31 % 97) as f32 - 48.0) / 17.0).collect();
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7 % 53) as f32 - 26.0) / 9.0).collect();
        let quant = |f: Format| {
            let rb = f.row_bytes(cols).unwrap();
            let mut b = vec![0u8; rb * rows];
            for (d, s) in b.chunks_mut(rb).zip(w.chunks(cols)) {
                smoe_quant::quantize(f, s, d).unwrap();
            }
            b
        };
        let (qa, qb) = (quant(Format::Q6_K), quant(Format::Q4_K));
        let a = QMatrix::new(Format::Q6_K, rows, cols, &qa).unwrap();
        let b = QMatrix::new(Format::Q4_K, rows, cols, &qb).unwrap();
        let (mut alone_a, mut alone_b) = (vec![0f32; n * rows], vec![0f32; n * rows]);
        matmul(k, &pool, &a, &x, n, &mut alone_a);
        matmul(k, &pool, &b, &x, n, &mut alone_b);
        let ja: MatJob<'_, ()> = MatJob { w: WeightRef::Expert(a, SLOT), x_row: 0, n, out_row: 0, out_col: 0 };
        let jb: MatJob<'_, ()> = MatJob { w: WeightRef::Expert(b, SLOT), x_row: 0, n, out_row: 0, out_col: rows };
        let mut out = vec![0f32; n * 2 * rows];
        matmul_many(k, &pool, &[(a, &ja), (b, &jb)], &x, cols, &mut out, 2 * rows);
        for t in 0..n {
            assert_eq!(&out[t * 2 * rows..t * 2 * rows + rows], &alone_a[t * rows..(t + 1) * rows], "Q6_K token {t}");
            assert_eq!(&out[t * 2 * rows + rows..(t + 1) * 2 * rows], &alone_b[t * rows..(t + 1) * rows], "Q4_K token {t}");
        }
    }
}
