// A batched step's kept experts on int8 tensor cores, appended after mmq.cu (whose tile
// arithmetic they use) and kept.cu (the `Kept` table).
//
// The fused kept kernels (kept.cu) run one (token, slot) pair at a time: a pair's block reads its
// expert's rows and multiplies them with one token. Sixty-four sequences put 512 pairs on some
// 126 of 128 experts a layer, and those kernels read each expert's rows once per pair (from L2
// after the first, with the pairs first on the grid), at some 220 + 220 µs a layer on an H100
// where the bytes of the experts take some 100 µs. Here a block takes one expert's rows and every
// pair that chose it: it scans the step's routes for its expert (no sort, no table: at most a few
// hundred ids, read from L2 by every block), stages the rows a step of eight groups at a time
// (kt_copy_step), decodes them as `mmq` does and multiplies them with its pairs' inputs, up to 16
// at a time, eight tokens to a product. The host sends steps of 24 tokens and more here
// (KEPT_TILES_FROM); at fewer an expert has a pair or two and the pair kernels are faster.
// The sums are mmq's, in mmq's order, not the mat-vec's: a token's result here equals its result
// through the pair kernels to rounding, not to the bit.
//
// Two kernels and the existing mix:
//   kept_tiles_swiglu: grid (width / 32, experts). A block's 64 rows are gate rows 32 b .. 32 b
//     + 31 and the same up rows; SiLU(gate) · up of each pair is written to `out` (row `pair`,
//     the gate half, as silu_quantize leaves it) and quantized as group b of row `pair` of dq.
//   kept_tiles_down: grid (⌈hidden / 64⌉, experts). Down rows 64 b .. of each pair's expert
//     against the pair's quantized row of dq, written to row `pair` of `out` (the slots);
//     add_weighted_slots then sums each token's slots in slot order.

// The pairs a block's list holds at a time. A token chooses an expert once, so a step of n
// tokens puts at most n pairs on one; NaN routes, read as expert 0, can put up to n·k there. A
// block takes its expert's pairs a list at a time (see kept_pairs_of), so any step fits.
#define KT_LIST 512

// The pairs of this step (n tokens, k slots) routed to expert e, in ascending order, from the
// `skip`-th on: at most KT_LIST of them into list. Returns how many there are from `skip` on
// (more than KT_LIST: the caller comes back for the rest). A route outside [0, experts) reads
// expert 0, as kept_job does. The ids are read 512 at a time, four per thread, all four
// loads in flight before any is looked at, then one ballot per 128 and a wait for the counts.
__device__ int kept_pairs_of(const Kept& kp, const float* routes, int n, int e, int skip, int* list) {
    __shared__ int warp_counts[4][4];
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, pairs = n * kp.k;
    int count = 0;
    for (int base = 0; base < pairs; base += 512) {
        u32 ballots[4];
#pragma unroll
        for (int c = 0; c < 4; c++) {
            int p = base + 128 * c + tid;
            float id = p < pairs ? routes[(size_t)(p / kp.k) * 2 * kp.k + p % kp.k] : -1.0f;
            bool mine = p < pairs && (id >= 0.0f && id < (float)kp.experts ? (int)id : 0) == e;
            ballots[c] = __ballot_sync(0xffffffff, mine);
            if (lane == 0) warp_counts[c][warp] = __popc(ballots[c]);
        }
        __syncthreads();
#pragma unroll
        for (int c = 0; c < 4; c++) {
            int at = count - skip;
            for (int w = 0; w < warp; w++) at += warp_counts[c][w];
            at += __popc(ballots[c] & ((1u << lane) - 1));
            if ((ballots[c] >> lane & 1) && at >= 0 && at < KT_LIST) list[at] = base + 128 * c + tid;
            count += warp_counts[c][0] + warp_counts[c][1] + warp_counts[c][2] + warp_counts[c][3];
        }
        // The counts are read; the next round may write them.
        __syncthreads();
    }
    return count - skip;
}

// Bytes of a row that one step (eight groups) covers: a Q4_K or Q6_K super-block, or eight
// Q8_0 blocks.
#define KT_STEP_BYTES(F) ((F) == 8 ? 272 : (F) == 14 ? 210 : 144)

// Step s's bytes of the tile's 64 rows copied into rs (KT_STEP_BYTES apart) with cp.async:
// consecutive threads take consecutive 16-byte pieces of a row, so that a warp's copies fall on
// a few lines of memory. (Each thread reading its own row, as mmq does, had every load of a
// warp touch 32 lines: the L1 was 86% busy at a third of HBM's bandwidth.) The copies bypass
// L1 and hold no registers, so the next step's are in flight while this one computes. Rows past
// the matrix, and a last step's groups past a row's end, are zeros (zero scales: they add
// nothing); a piece is copied whole or not at all, so the host sends only rows whose length is
// a multiple of 16 bytes (a Q8_0 row of a multiple of 256 values; every Q4_K row).
// Q6_K's 210-byte super-blocks leave rows and steps 2-byte aligned only, which cp.async cannot
// copy: its steps are read 16 bits at a time, a thread's loads issued 14 at a time before they
// are stored (the block waits for them; the SM's other blocks compute meanwhile).
// Row i of the tile is row r0 + i of part 0, or, from `split`, row r0 + i - split of part 1.
// Blocks of 128 threads.
template <int F>
__device__ __forceinline__ void kt_copy_step(const Kept& kp, const u8* p0, const u8* p1, int split, int r0, int s, u8* rs) {
#if __CUDA_ARCH__ >= 800
    if (F == 14) {
        // In rounds of 14 loads a thread: all 53 at once, or 27, spilled registers.
        constexpr int per_row = KT_STEP_BYTES(F) / 2, total = MMQ_TILE * per_row, each = (total + 127) / 128, round = 14;
#pragma unroll 1
        for (int k0 = 0; k0 < each; k0 += round) {
            u16 v[round];
#pragma unroll
            for (int k = 0; k < round; k++) {
                int q = threadIdx.x + 128 * (k0 + k), i = q / per_row, off = s * KT_STEP_BYTES(F) + 2 * (q % per_row);
                int r = r0 + (i < split ? i : i - split);
                bool live = q < total && r < kp.rows && off + 2 <= (int)kp.row_bytes;
                v[k] = live ? *(const u16*)((i < split ? p0 : p1) + (size_t)r * kp.row_bytes + off) : (u16)0;
            }
#pragma unroll
            for (int k = 0; k < round; k++) {
                int q = threadIdx.x + 128 * (k0 + k);
                if (q < total) ((u16*)rs)[q] = v[k];
            }
        }
        return;
    }
    constexpr int per_row = KT_STEP_BYTES(F) / 16;
    for (int q = threadIdx.x; q < MMQ_TILE * per_row; q += blockDim.x) {
        int i = q / per_row, piece = q % per_row, off = s * KT_STEP_BYTES(F) + 16 * piece;
        int r = r0 + (i < split ? i : i - split);
        bool live = r < kp.rows && off + 16 <= (int)kp.row_bytes;
        const u8* src = (i < split ? p0 : p1) + (size_t)r * kp.row_bytes + off;
        copy16_async(rs + i * KT_STEP_BYTES(F) + 16 * piece, live ? src : p0, live);
    }
#endif
}

// This thread's words of a staged step, as mmq_load would read them from memory: row wi, groups
// 4 half .. 4 half + 3. Q4_K: the super-block's head and the 64 bytes of quants of its pairs;
// Q8_0: four 34-byte blocks (136 bytes, word-aligned in rs).
template <int F>
__device__ __forceinline__ void kt_raw(const u8* rs, int wi, int half, u32* raw) {
    const u8* row = rs + wi * KT_STEP_BYTES(F);
    if (F == 14) {
        q6k_half_words(row, half, true, raw);
    } else if (F == 8) {
        const u32* w = (const u32*)(row + 136 * half);
#pragma unroll
        for (int k = 0; k < 34; k++) raw[k] = w[k];
    } else {
        const uint4* b = (const uint4*)row;
        uint4 v[5];
        v[0] = b[0];
#pragma unroll
        for (int k = 0; k < 4; k++) v[1 + k] = b[1 + 4 * half + k];
        words_of<5>(v, raw);
    }
}

// Rows [r0, r0 + 64) of the block's matrices (see kt_copy_step) for tokens list[t0 ..] (at most
// NT of them, nt), each token's input the quantized row at qx + row(pair) * qstride; the m16n8
// accumulators as mmq leaves them in c. Per step: the inputs' copies, a wait for them and for
// the step's weights, the weights decoded from rs into ws (the next step's copies issued as
// soon as rs is read), the products.
template <int F, int NT>
__device__ void kept_tile_products(const Kept& kp, const int* list, int t0, int nt, const u8* qx, int qstride,
                                   const u8* p0, const u8* p1, int split, int r0, u8* rs, u8* ws, u8* xq,
                                   float (*wa)[MMQ_WA(F)], float (*wb)[MMQ_GROUPS + 1], float (*xd)[NT + 4],
                                   float (*xm)[NT + 4], float (*c)[4]) {
#if __CUDA_ARCH__ >= 800
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
    int wi = tid % MMQ_TILE, half = tid / MMQ_TILE, groups = kp.cols / 32;
    int nj = (nt + 7) / 8, staged = 8 * nj;
#pragma unroll
    for (int a = 0; a < NT / 8; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) c[a][b] = 0.0f;
    kt_copy_step<F>(kp, p0, p1, split, r0, 0, rs);
    for (int g0 = 0, s = 0; g0 < groups; g0 += MMQ_GROUPS, s++) {
        // Inputs of the staged tokens only (a few for most experts): 16-byte pieces, then
        // each group's scale and scaled sum; zeros past the pairs or the row's end.
        for (int e = tid; e < staged * 16; e += 128) {
            int t = e / 16, piece = e % 16, col = 32 * g0 + 16 * piece;
            bool live = t < nt && col < kp.cols;
            int p = live ? list[t0 + t] : 0;
            const u8* row = qx + (size_t)(kp.x_per_pair ? p : p / kp.k) * qstride;
            copy16_async(xq + t * MMQ_STRIDE + 16 * piece, live ? row + col : qx, live);
        }
        for (int e = tid; e < staged * MMQ_GROUPS; e += 128) {
            int t = e / MMQ_GROUPS, gl = e % MMQ_GROUPS, g = g0 + gl;
            bool live = t < nt && g < groups;
            int p = live ? list[t0 + t] : 0;
            const float* sc = (const float*)(qx + (size_t)(kp.x_per_pair ? p : p / kp.k) * qstride + kp.cols);
            copy4_async(&xd[gl][t], live ? sc + g : (const float*)qx, live);
            if (F == 12) copy4_async(&xm[gl][t], live ? sc + groups + g : (const float*)qx, live);
        }
        copies_wait();
        __syncthreads();
        u32 raw[MMQ_RAW(F)];
        kt_raw<F>(rs, wi, half, raw);
        __syncthreads();
        if (g0 + MMQ_GROUPS < groups) kt_copy_step<F>(kp, p0, p1, split, r0, s + 1, rs);
        mmq_stage_weights<F>(raw, wi, half, ws, wa, wb);
        __syncthreads();
        int steps = min(MMQ_GROUPS, groups - g0), ra = 16 * warp + gid;
        // Tiles of 16 tokens: one product of eight per group, or two.
        static_assert(NT == 16, "the products below are written for tiles of 16 tokens");
        if (nj == 1)
            mmq_step<F, NT, 1>(ws, xq, wa, wb, xd, xm, steps, ra, gid, tig, c);
        else
            mmq_step<F, NT, 2>(ws, xq, wa, wb, xd, xm, steps, ra, gid, tig, c);
        __syncthreads();
    }
#endif
}

// Shared memory of a tile block: a step's raw weights, mmq's (decoded weights, inputs of NT
// tokens, their scales) and the pair list.
#define KT_SHARED                                                                    \
    __shared__ __align__(16) u8 rs[MMQ_TILE * KT_STEP_BYTES(F)];                     \
    __shared__ __align__(16) u8 ws[MMQ_TILE * MMQ_STRIDE];                           \
    __shared__ __align__(16) u8 xq[NT * MMQ_STRIDE];                                 \
    __shared__ float wa[MMQ_TILE][MMQ_WA(F)], wb[MMQ_TILE][MMQ_GROUPS + 1];          \
    __shared__ __align__(8) float xd[MMQ_GROUPS][NT + 4];                            \
    __shared__ __align__(8) float xm[F == 12 ? MMQ_GROUPS : 1][NT + 4];              \
    __shared__ int list[KT_LIST];

// Gate and up rows 32 b .. of expert blockIdx.y (kp.parts 2, rows the intermediate width)
// against the tokens of every pair that chose it (inputs one row per token at qx), NT at a
// time; then SiLU(gate) · up per pair, as mvq_swiglu writes it.
template <int F, int NT>
__device__ void kept_tiles_swiglu(const Kept& kp, const float* routes, int n, const u8* qx, int qstride, float* out,
                                  int os, u8* dq, int dqstride) {
#if __CUDA_ARCH__ >= 800
    KT_SHARED
    int e = blockIdx.y, b = blockIdx.x, r0 = 32 * b;
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
    // Tile rows 0-31 gate, 32-63 up, of the same intermediate rows.
    const u8* g = (const u8*)(kp.base[0] + (u64)e * kp.expert_bytes[0]);
    const u8* u = (const u8*)(kp.base[1] + (u64)e * kp.expert_bytes[1]);
    float c[NT / 8][4];
    // The accumulators, by token then tile row, over the weights' staging (free after the
    // products): NT × 65 floats fit in its 64 × 272 bytes.
    float* ct = (float*)ws;
    for (int skip = 0;; skip += KT_LIST) {
        int left = kept_pairs_of(kp, routes, n, e, skip, list), count = min(left, KT_LIST);
        for (int t0 = 0; t0 < count; t0 += NT) {
            int nt = min(NT, count - t0);
            kept_tile_products<F, NT>(kp, list, t0, nt, qx, qstride, g, u, 32, r0, rs, ws, xq, wa, wb, xd, xm, c);
            int ra = 16 * warp + gid;
#pragma unroll
            for (int jn = 0; jn < NT / 8; jn++) {
                int t = 8 * jn + 2 * tig;
                ct[t * 65 + ra] = c[jn][0];
                ct[(t + 1) * 65 + ra] = c[jn][1];
                ct[t * 65 + ra + 8] = c[jn][2];
                ct[(t + 1) * 65 + ra + 8] = c[jn][3];
            }
            __syncthreads();
            for (int t = warp; t < nt; t += 4) {
                int pair = list[t0 + t];
                float gv = ct[t * 65 + lane], uv = ct[t * 65 + 32 + lane];
                float v = gv / (1.0f + expf(-gv)) * uv;
                out[(size_t)pair * os + r0 + lane] = v;
                quantize_group(v, dq + (size_t)pair * dqstride, kp.rows, b);
            }
            __syncthreads();
        }
        if (left <= KT_LIST) break;
    }
#endif
}

// Down rows 64 b .. of expert blockIdx.y (kp.parts 1) against the quantized SiLU row of every
// pair that chose it (one row per pair at qx), NT at a time, into row `pair` of out.
template <int F, int NT>
__device__ void kept_tiles_down(const Kept& kp, const float* routes, int n, const u8* qx, int qstride, float* out, int os) {
#if __CUDA_ARCH__ >= 800
    KT_SHARED
    int e = blockIdx.y, r0 = MMQ_TILE * blockIdx.x;
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
    const u8* w = (const u8*)(kp.base[0] + (u64)e * kp.expert_bytes[0]);
    float c[NT / 8][4];
    for (int skip = 0;; skip += KT_LIST) {
        int left = kept_pairs_of(kp, routes, n, e, skip, list), count = min(left, KT_LIST);
        for (int t0 = 0; t0 < count; t0 += NT) {
            int nt = min(NT, count - t0);
            kept_tile_products<F, NT>(kp, list, t0, nt, qx, qstride, w, w, MMQ_TILE, r0, rs, ws, xq, wa, wb, xd, xm, c);
            int ra = r0 + 16 * warp + gid, rb = ra + 8;
#pragma unroll
            for (int jn = 0; jn < NT / 8; jn++) {
                int t = 8 * jn + 2 * tig;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    if (t + h >= nt) continue;
                    float* o = out + (size_t)list[t0 + t + h] * os;
                    if (ra < kp.rows) o[ra] = c[jn][h];
                    if (rb < kp.rows) o[rb] = c[jn][2 + h];
                }
            }
        }
        if (left <= KT_LIST) break;
    }
#endif
}

// Tiles of 16 tokens (a few pairs an expert is the usual case; an expert with more takes them
// 16 at a time, its rows from L2 after the first pass). Tiles of 64, before the weights were
// staged with cp.async, measured slower at 64 sequences (2,075 against 2,163 tok/s on an H100),
// for their shared memory; with the staging buffer they would pass the 48 KB of static shared
// memory.
#define KEPT_TILE_KERNELS(name, id, blocks)                                                                            \
    extern "C" __global__ void __launch_bounds__(128, blocks)                                                          \
        kept_tiles_swiglu_##name(const Kept kp, const float* routes, int n, const u8* qx, int qstride, float* out,     \
                                 int os, u8* dq, int dqstride) {                                                       \
        PDL_START;                                                                                                     \
        kept_tiles_swiglu<id, 16>(kp, routes, n, qx, qstride, out, os, dq, dqstride);                                  \
    }                                                                                                                  \
    extern "C" __global__ void __launch_bounds__(128, blocks)                                                          \
        kept_tiles_down_##name(const Kept kp, const float* routes, int n, const u8* qx, int qstride, float* out,       \
                               int os) {                                                                               \
        PDL_START;                                                                                                     \
        kept_tiles_down<id, 16>(kp, routes, n, qx, qstride, out, os);                                                  \
    }

// Blocks an SM on Hopper (228 KB of shared memory an SM): Q8_0's 46 KB allow four, Q4_K's 39 KB
// five, Q6_K's 43 KB four; the bound caps the registers for that (GPUs with less shared memory
// run fewer).
KEPT_TILE_KERNELS(q8_0, 8, 4)
KEPT_TILE_KERNELS(q4_k, 12, 5)
KEPT_TILE_KERNELS(q6_k, 14, 4)
