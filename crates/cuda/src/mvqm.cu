// A few tokens' Q8_0 and Q4_K products on int8 tensor cores, appended after mmq.cu (whose mma_s8
// it uses).
//
// The few-token mat-vec (`mvqn`: 2 to 8 tokens, a batched decode step's dense products, up to 64
// tokens as launches of eight) reads a task's weights once for all its tokens, but every token's
// inputs again for each row: at eight tokens fifteen times as many bytes through L1 as weights,
// and eight dp4a per row, token and group. Here one m16n8k32 product gives a group's 32-bit sums
// for 16 rows by 8 tokens, from a block's 16 rows and the tokens' inputs staged in shared memory.
// A task is mvq's: a Q8_0 group (one product), or a Q4_K pair of sub-blocks (two: the low
// nibbles of its 32 quant bytes, then the high).
//
// Each token keeps the bits of its one-token product (`mvq`): the float terms (q8_term,
// q4k_pair_term) are added in mvq's order. There lane L of warp part p (`mvq_split` warps share
// a row) adds the terms of tasks L + 32 p, L + 32 p + 32 split, ... in turn, from 0; the lanes'
// sums are then added by a shuffle tree (offsets 16, 8, 4, 2, 1), which is the pairwise sum of
// the 32 lane sums taken in bit-reversed order of L; then the parts' sums in order. A thread here
// holds four (row, token) sums of each product, so it adds each pair's terms lane by lane in that
// order, and the lane sums pairwise through a stack of partial sums (a binary counter, indexed at
// compile time). The block's warps take consecutive places of the bit-reversed order (subtrees of
// the shuffle tree), and warp 0 adds their sums as the tree's top and mvq's parts do. (Integer
// sums are exact in any order, so A and B may take a group's bytes in any order they share.)
//
// Measured on an H100 (docs/bench-results/gpu-2026-12-07c): reading its weights from global
// memory (a group's 16 rows in eight 2-byte loads that each touched eight lines), the Q8_0 kernel
// was slower than mvqn at 2 to 8 tokens whatever its warps (4 to 16) or loads in flight; staged,
// an eight-sequence step ran 9-14% faster (1,130-1,164 against 1,022-1,040 tok/s).

#define MVQM_ROWS 16
// Places (of mvq's order) whose groups' loads are issued together.
#define MVQM_AHEAD 4

#if __CUDA_ARCH__ >= 800
// Where a thread's operands live: rows g and g + 8 of the tile (wa, wb; the last row stands in
// past the matrix's end), the inputs of token g (xb; token 0's past the job's tokens) and the
// input scales and sums of its output tokens 2q and 2q + 1 (xd0, xd1, xs0, xs1).
struct MvqmRows {
    const u8* wa;
    const u8* wb;
    const signed char* xb;
    const float* xd0;
    const float* xd1;
    const float* xs0;
    const float* xs1;
    int q;
};

// One task's operands, loaded before any is used.
template <int F>
struct MvqmW;
template <>
struct MvqmW<8> {
    u32 a[4], b[2];
    u16 da, db;
    float x0, x1;
};
template <>
struct MvqmW<12> {
    u32 wa[2], wb[2];  // rows g and g + 8: the pair's quant bytes 4q .. 4q + 3 and 16 + 4q ..
    u32 b0[2], b1[2];  // token g's inputs of the pair's two groups, the same bytes
    float2 xd0, xd1, xs0, xs1;  // tokens 2q and 2q + 1: the two groups' scales and sums
};

template <int F>
__device__ __forceinline__ MvqmW<F> mvqm_load(const MvqmRows& m, int t);
template <>
__device__ __forceinline__ MvqmW<8> mvqm_load<8>(const MvqmRows& m, int t) {
    // Group t's 34-byte blocks (an f16 scale, then 32 quants) of the two rows; the product's
    // k = 4q .. 4q + 3 and 16 + 4q .. 16 + 4q + 3 are quants of those numbers (in shared memory
    // the four lanes of a row then read four consecutive words: no bank conflicts).
    const u8* ba = m.wa + (size_t)t * 34;
    const u8* bb = m.wb + (size_t)t * 34;
    const u8 *pa = ba + 2 + 4 * m.q, *pb = bb + 2 + 4 * m.q;
    const u32* x = (const u32*)(m.xb + 32 * t + 4 * m.q);
    return MvqmW<8>{{(u32)load_i32_u16(pa), (u32)load_i32_u16(pb), (u32)load_i32_u16(pa + 16), (u32)load_i32_u16(pb + 16)},
                 {x[0], x[4]},
                 *(const u16*)ba,
                 *(const u16*)bb,
                 m.xd0[t],
                 m.xd1[t]};
}

// Pair t % 4 of super-block t / 4 (144 bytes: d, dmin, 12 bytes of scales, 128 of quants): the
// 32 bytes of quants it shares, sub-block 2p in their low nibbles and 2p + 1 in their high, and
// its two groups of the inputs (8 sb + 2p and the next).
template <>
__device__ __forceinline__ MvqmW<12> mvqm_load<12>(const MvqmRows& m, int t) {
    int sb = t >> 2, p = t & 3, g0 = 8 * sb + 2 * p;
    const u8 *pa = m.wa + 144 * sb + 16 + 32 * p + 4 * m.q, *pb = m.wb + 144 * sb + 16 + 32 * p + 4 * m.q;
    const u32* x = (const u32*)(m.xb + 32 * g0 + 4 * m.q);
    return MvqmW<12>{{*(const u32*)pa, *(const u32*)(pa + 16)},
                     {*(const u32*)pb, *(const u32*)(pb + 16)},
                     {x[0], x[4]},
                     {x[8], x[12]},
                     *(const float2*)(m.xd0 + g0),
                     *(const float2*)(m.xd1 + g0),
                     *(const float2*)(m.xs0 + g0),
                     *(const float2*)(m.xs1 + g0)};
}

// Task t's four terms added to the thread's (row g, token 2q), (g, 2q + 1), (g + 8, 2q),
// (g + 8, 2q + 1) sums, as mvq adds them.
template <int F>
__device__ __forceinline__ void mvqm_add(const MvqmRows& m, const MvqmW<F>& w, int t, float* acc);
template <>
__device__ __forceinline__ void mvqm_add<8>(const MvqmRows& m, const MvqmW<8>& w, int t, float* acc) {
    int s[4] = {0, 0, 0, 0};
    mma_s8(s, w.a, w.b);
    acc[0] += q8_term(w.da, w.x0, s[0]);
    acc[1] += q8_term(w.da, w.x1, s[1]);
    acc[2] += q8_term(w.db, w.x0, s[2]);
    acc[3] += q8_term(w.db, w.x1, s[3]);
}
template <>
__device__ __forceinline__ void mvqm_add<12>(const MvqmRows& m, const MvqmW<12>& w, int t, float* acc) {
    const u32 low = 0x0F0F0F0F;
    u32 a0[4] = {w.wa[0] & low, w.wb[0] & low, w.wa[1] & low, w.wb[1] & low};
    u32 a1[4] = {(w.wa[0] >> 4) & low, (w.wb[0] >> 4) & low, (w.wa[1] >> 4) & low, (w.wb[1] >> 4) & low};
    int s0[4] = {0, 0, 0, 0}, s1[4] = {0, 0, 0, 0};
    mma_s8(s0, a0, w.b0);
    mma_s8(s1, a1, w.b1);
    // The rows' scales from shared memory (a quarter-warp reads two rows' 16 bytes: broadcasts).
    int sb = t >> 2, p = t & 3;
    uint4 ha = *(const uint4*)(m.wa + 144 * sb), hb = *(const uint4*)(m.wb + 144 * sb);
    acc[0] += q4k_pair_term(ha, p, w.xd0.x, w.xd0.y, w.xs0.x, w.xs0.y, s0[0], s1[0]);
    acc[1] += q4k_pair_term(ha, p, w.xd1.x, w.xd1.y, w.xs1.x, w.xs1.y, s0[1], s1[1]);
    acc[2] += q4k_pair_term(hb, p, w.xd0.x, w.xd0.y, w.xs0.x, w.xs0.y, s0[2], s1[2]);
    acc[3] += q4k_pair_term(hb, p, w.xd1.x, w.xd1.y, w.xs1.x, w.xs1.y, s0[3], s1[3]);
}

// Places i0 .. i0 + 2^LOG of the bit-reversed lane order of part `part`: each lane's sum of
// tasks lane + 32 part + 32 split k (k = 0, 1, ...), then their pairwise sum into `sum`. Four
// places at a time, their k-th tasks' loads issued together.
template <int F, int LOG>
__device__ __forceinline__ void mvqm_lanes(const MvqmRows& m, int i0, int part, int split, int tasks, float* sum) {
    constexpr int AHEAD = MVQM_AHEAD < (1 << LOG) ? MVQM_AHEAD : (1 << LOG);
    float stack[LOG][4];
    int stride = 32 * split;
#pragma unroll
    for (int i = 0; i < (1 << LOG); i += AHEAD) {
        int first[AHEAD];
        float v[AHEAD][4];
#pragma unroll
        for (int e = 0; e < AHEAD; e++) {
            first[e] = (__brev(i0 + i + e) >> 27) + 32 * part;
#pragma unroll
            for (int c = 0; c < 4; c++) v[e][c] = 0.0f;
        }
        for (int off = 0;; off += stride) {
            bool any = false;
            MvqmW<F> w[AHEAD];
#pragma unroll
            for (int e = 0; e < AHEAD; e++)
                if (first[e] + off < tasks) {
                    w[e] = mvqm_load<F>(m, first[e] + off);
                    any = true;
                }
            if (!any) break;
#pragma unroll
            for (int e = 0; e < AHEAD; e++)
                if (first[e] + off < tasks) mvqm_add<F>(m, w[e], first[e] + off, v[e]);
        }
        // Push the lanes' sums in order: while the counter's low bits are ones, add the sum to
        // the level's left part (the shuffle tree's add, own value first).
#pragma unroll
        for (int e = 0; e < AHEAD; e++) {
            int at = i + e;
            bool placed = false;
#pragma unroll
            for (int l = 0; l < LOG; l++) {
                if (placed) continue;
                if ((at >> l) & 1) {
#pragma unroll
                    for (int c = 0; c < 4; c++) v[e][c] = stack[l][c] + v[e][c];
                } else {
#pragma unroll
                    for (int c = 0; c < 4; c++) stack[l][c] = v[e][c];
                    placed = true;
                }
            }
            if (at == (1 << LOG) - 1)
#pragma unroll
                for (int c = 0; c < 4; c++) sum[c] = v[e][c];
        }
    }
}

// The pairwise sum of N (a power of two) warps' sums, `step` apart, in order: the top of the
// shuffle tree over their consecutive subtrees of places.
template <int N>
__device__ __forceinline__ float mvqm_tree(const float* v, int step) {
    float level[N];
#pragma unroll
    for (int i = 0; i < N; i++) level[i] = v[i * step];
#pragma unroll
    for (int w = N; w > 1; w /= 2)
#pragma unroll
        for (int i = 0; i < w / 2; i++) level[i] = level[2 * i] + level[2 * i + 1];
    return level[0];
}
#endif

// Bytes between staged rows in shared memory (`mvqm_stage_bytes` in backend.rs): 16 past a
// multiple of 128, so that row g starts at bank 4 g and a fragment's 32 words fall in 32 banks.
__device__ __forceinline__ int mvqm_stage_stride(int bytes) { return (bytes + 127) / 128 * 128 + 16; }

// `rows` spans of `bytes` each, `from` apart in global memory, to `stride` apart in shared: a warp
// a span, each copied by mv_fetch (cp.async of 16 or 4 bytes as its alignment allows, else plain
// loads; a Q8_0 row of an odd number of groups is only 2-byte aligned).
__device__ __forceinline__ void mvqm_stage(u8* dst, int stride, const u8* src, size_t from, int rows, int bytes) {
    int warps = blockDim.x / 32, lane = threadIdx.x % 32;
    for (int r = threadIdx.x / 32; r < rows; r += warps) mv_fetch(dst + r * stride, src + r * from, bytes, lane);
}

// Job blockIdx.y's rows r0 .. r0 + 16 (r0 = 16 blockIdx.x) against its 2 to 8 input rows,
// token c's quantized at qx + (j.x_row + c - lo) * qstride: each token's sums with mvq's bits.
// The block first copies its rows and the tokens' int8 inputs into shared memory (dynamic,
// `mvqm_stage_bytes` in backend.rs), all of it in flight at once, the weights before PDL_START
// (no kernel writes them, so their copy overlaps the kernel before). WARPS warps share the 16
// rows' places of mvq's order: with one part (rows of fewer than 128 tasks) 32 / WARPS
// consecutive places each; with four, WARPS / 4 warps a part, 128 / WARPS places each. Rows of
// more than 16 tasks (`mvqn` takes the half-warp rows of at most 16).
template <int F, int WARPS>
__device__ void mvqm(const Jobs& js, const u8* qx, int qstride, int lo, float* out, int os) {
    extern __shared__ __align__(16) u8 staged[];
    const Job& j = js.job[blockIdx.y];
    int r0 = blockIdx.x * MVQM_ROWS, live = min(MVQM_ROWS, j.rows - r0);
    int ws = mvqm_stage_stride(j.row_bytes), xs = mvqm_stage_stride(j.cols);
    if (live > 0) mvqm_stage(staged, ws, (const u8*)j.w + (size_t)r0 * j.row_bytes, j.row_bytes, live, j.row_bytes);
    PDL_START;
#if __CUDA_ARCH__ >= 800
    constexpr int LOG1 = WARPS == 4 ? 3 : 2;  // log2(32 / WARPS)
    constexpr int LOG4 = LOG1 + 2;            // log2(128 / WARPS)
    constexpr int PER_PART = WARPS / 4;
    __shared__ float sums[4][WARPS][32];
    if (live <= 0) return;  // the whole block
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    int n = j.n, tasks = mvq_tasks<F>(j.cols), split = mvq_split<F>(j.cols);
    auto input = [&](int c) { return qx + (size_t)(j.x_row + (c < n ? c : 0) - lo) * qstride; };
    u8* xstage = staged + MVQM_ROWS * ws;
    mvqm_stage(xstage, xs, input(0), qstride, n, j.cols);
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    // Past the rows' end the last row stands in, past the tokens token 0; the input scales and
    // sums stay in global memory (a float each a group).
    const float *xd0 = (const float*)(input(2 * q) + j.cols), *xd1 = (const float*)(input(2 * q + 1) + j.cols);
    MvqmRows m{staged + min(g, live - 1) * ws,
               staged + min(g + 8, live - 1) * ws,
               (const signed char*)(xstage + (g < n ? g : 0) * xs),
               xd0,
               xd1,
               xd0 + j.cols / 32,
               xd1 + j.cols / 32,
               q};
    float s[4];
    if (split == 1) mvqm_lanes<F, LOG1>(m, (32 / WARPS) * warp, 0, 1, tasks, s);
    else mvqm_lanes<F, LOG4>(m, (128 / WARPS) * (warp % PER_PART), warp / PER_PART, split, tasks, s);
#pragma unroll
    for (int c = 0; c < 4; c++) sums[c][warp][lane] = s[c];
    __syncthreads();
    if (warp != 0) return;
    float r[4];
#pragma unroll
    for (int c = 0; c < 4; c++) {
        // One part: the warps' subtrees, pairwise; four parts: each part's warps pairwise, then
        // the parts in order, as mvq adds them.
        if (split == 1) {
            r[c] = mvqm_tree<WARPS>(&sums[c][0][lane], 32);
        } else {
            float a = mvqm_tree<PER_PART>(&sums[c][0][lane], 32);
            for (int p = 1; p < 4; p++) a += mvqm_tree<PER_PART>(&sums[c][p * PER_PART][lane], 32);
            r[c] = a;
        }
    }
#pragma unroll
    for (int c = 0; c < 4; c++) {
        int row = r0 + g + 8 * (c / 2), token = 2 * q + c % 2;
        if (row < j.rows && token < n) out[(size_t)(j.out_row + token) * os + j.out_col + row] = r[c];
    }
#endif
}

// Four or eight warps a block (`CudaOptions::few_mma_warps`), for each format.
#define MVQM_KERNELS(name, id)                                                                                   \
    extern "C" __global__ void __launch_bounds__(128)                                                            \
        mvqm_##name(const Jobs js, const u8* qx, int qstride, int lo, float* out, int os) {                      \
        mvqm<id, 4>(js, qx, qstride, lo, out, os);                                                               \
    }                                                                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                                            \
        mvqm8_##name(const Jobs js, const u8* qx, int qstride, int lo, float* out, int os) {                     \
        mvqm<id, 8>(js, qx, qstride, lo, out, os);                                                               \
    }
MVQM_KERNELS(q8_0, 8)
MVQM_KERNELS(q4_k, 12)
