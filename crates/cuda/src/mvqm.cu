// A few tokens' Q8_0 products on int8 tensor cores, appended after mmq.cu (whose mma_s8 it uses).
//
// The few-token mat-vec (`mvqn`: 2 to 8 tokens, a batched decode step's dense products, up to 64
// tokens as launches of eight) reads a task's weights once for all its tokens, but every token's
// inputs again for each row: at eight tokens fifteen times as many bytes through L1 as weights,
// and eight dp4a per row, token and group. Here one m16n8k32 product gives a group's 32-bit sums
// for 16 rows by 8 tokens, from a block's 16 rows and the tokens' inputs staged in shared memory.
//
// Each token keeps the bits of its one-token product (`mvq`): the float terms (q8_term) are added
// in mvq's order. There lane L of warp part p (`mvq_split` warps share a row) adds the terms of
// groups L + 32 p, L + 32 p + 32 split, ... in turn, from 0; the lanes' sums are then added by a
// shuffle tree (offsets 16, 8, 4, 2, 1), which is the pairwise sum of the 32 lane sums taken in
// bit-reversed order of L; then the parts' sums in order. A thread here holds four (row, token)
// sums of each product, so it adds each pair's terms lane by lane in that order, and the lane
// sums pairwise through a stack of partial sums (a binary counter, indexed at compile time). The
// block's warps take consecutive places of the bit-reversed order (subtrees of the shuffle tree),
// and warp 0 adds their sums as the tree's top and mvq's parts do. (Integer sums are exact in any
// order, so A and B may take a group's bytes in any order they share.)
//
// Measured on an H100 (docs/bench-results/gpu-2026-12-07c): reading its weights from global
// memory (a group's 16 rows in eight 2-byte loads that each touched eight lines), the kernel was
// slower than mvqn at 2 to 8 tokens whatever its warps (4 to 16) or loads in flight; staged, an
// eight-sequence step ran 9-14% faster (1,130-1,164 against 1,022-1,040 tok/s).

#define MVQM_ROWS 16
// Places (of mvq's order) whose groups' loads are issued together.
#define MVQM_AHEAD 4

#if __CUDA_ARCH__ >= 800
// Where a thread's operands live: rows g and g + 8 of the tile (wa, wb; the last row stands in
// past the matrix's end), the inputs of token g (xb; token 0's past the job's tokens) and the
// input scales of its output tokens 2q and 2q + 1 (xd0, xd1).
struct MvqmRows {
    const u8* wa;
    const u8* wb;
    const signed char* xb;
    const float* xd0;
    const float* xd1;
    int q;
};

// One group's operands, loaded before any is used.
struct MvqmW {
    u32 a[4], b[2];
    u16 da, db;
    float x0, x1;
};

__device__ __forceinline__ MvqmW mvqm_load(const MvqmRows& m, int t) {
    // Group t's 34-byte blocks (an f16 scale, then 32 quants) of the two rows; the product's
    // k = 4q .. 4q + 3 and 16 + 4q .. 16 + 4q + 3 are quants of those numbers (in shared memory
    // the four lanes of a row then read four consecutive words: no bank conflicts).
    const u8* ba = m.wa + (size_t)t * 34;
    const u8* bb = m.wb + (size_t)t * 34;
    const u8 *pa = ba + 2 + 4 * m.q, *pb = bb + 2 + 4 * m.q;
    const u32* x = (const u32*)(m.xb + 32 * t + 4 * m.q);
    return MvqmW{{(u32)load_i32_u16(pa), (u32)load_i32_u16(pb), (u32)load_i32_u16(pa + 16), (u32)load_i32_u16(pb + 16)},
                 {x[0], x[4]},
                 *(const u16*)ba,
                 *(const u16*)bb,
                 m.xd0[t],
                 m.xd1[t]};
}

// The group's four terms added to the thread's (row g, token 2q), (g, 2q + 1), (g + 8, 2q),
// (g + 8, 2q + 1) sums, as mvq adds them.
__device__ __forceinline__ void mvqm_add(const MvqmW& w, float* acc) {
    int s[4] = {0, 0, 0, 0};
    mma_s8(s, w.a, w.b);
    acc[0] += q8_term(w.da, w.x0, s[0]);
    acc[1] += q8_term(w.da, w.x1, s[1]);
    acc[2] += q8_term(w.db, w.x0, s[2]);
    acc[3] += q8_term(w.db, w.x1, s[3]);
}

// Places i0 .. i0 + 2^LOG of the bit-reversed lane order of part `part`: each lane's sum of
// groups lane + 32 part + 32 split k (k = 0, 1, ...), then their pairwise sum into `sum`. Four
// places at a time, their k-th groups' loads issued together.
template <int LOG>
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
            MvqmW w[AHEAD];
#pragma unroll
            for (int e = 0; e < AHEAD; e++)
                if (first[e] + off < tasks) {
                    w[e] = mvqm_load(m, first[e] + off);
                    any = true;
                }
            if (!any) break;
#pragma unroll
            for (int e = 0; e < AHEAD; e++)
                if (first[e] + off < tasks) mvqm_add(w[e], v[e]);
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

// `rows` spans of `bytes` each, `from` apart in global memory, to `stride` apart in shared, by the
// whole block: cp.async of 16 bytes where all is 16-byte aligned (the dense matrices, the
// quantized inputs), else 2-byte loads (a Q8_0 row is an even number of bytes).
__device__ __forceinline__ void mvqm_stage(u8* dst, int stride, const u8* src, size_t from, int rows, int bytes) {
#if __CUDA_ARCH__ >= 800
    if ((((size_t)src | from | bytes) & 15) == 0) {
        int per = bytes / 16;
        u32 d = (u32)__cvta_generic_to_shared(dst);
        for (int i = threadIdx.x; i < rows * per; i += blockDim.x) {
            int r = i / per, o = 16 * (i % per);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d + r * stride + o), "l"(src + r * from + o));
        }
        asm volatile("cp.async.commit_group;");
        return;
    }
#endif
    int per = bytes / 2;
    for (int i = threadIdx.x; i < rows * per; i += blockDim.x) {
        int r = i / per, o = 2 * (i % per);
        *(u16*)(dst + r * stride + o) = *(const u16*)(src + r * from + o);
    }
}

// Job blockIdx.y's rows r0 .. r0 + 16 (r0 = 16 blockIdx.x) against its 2 to 8 input rows,
// token c's quantized at qx + (j.x_row + c - lo) * qstride: each token's sums with mvq's bits.
// The block first copies its rows and the tokens' int8 inputs into shared memory (dynamic,
// `mvqm_stage_bytes` in backend.rs), all of it in flight at once, the weights before PDL_START
// (no kernel writes them, so their copy overlaps the kernel before). WARPS warps share the 16
// rows' places of mvq's order: with one part (rows of fewer than 128 groups) 32 / WARPS
// consecutive places each; with four, WARPS / 4 warps a part, 128 / WARPS places each. Rows of
// more than 16 groups (`mvqn` takes the half-warp rows of at most 16).
template <int WARPS>
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
    int n = j.n, tasks = j.cols / 32, split = mvq_split<8>(j.cols);
    auto input = [&](int c) { return qx + (size_t)(j.x_row + (c < n ? c : 0) - lo) * qstride; };
    u8* xstage = staged + MVQM_ROWS * ws;
    mvqm_stage(xstage, xs, input(0), qstride, n, j.cols);
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
    // Past the rows' end the last row stands in, past the tokens token 0; the input scales stay
    // in global memory (two floats a group).
    MvqmRows m{staged + min(g, live - 1) * ws,
               staged + min(g + 8, live - 1) * ws,
               (const signed char*)(xstage + (g < n ? g : 0) * xs),
               (const float*)(input(2 * q) + j.cols),
               (const float*)(input(2 * q + 1) + j.cols),
               q};
    float s[4];
    if (split == 1) mvqm_lanes<LOG1>(m, (32 / WARPS) * warp, 0, 1, tasks, s);
    else mvqm_lanes<LOG4>(m, (128 / WARPS) * (warp % PER_PART), warp / PER_PART, split, tasks, s);
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

// Four or eight warps a block (`CudaOptions::few_mma_warps`).
extern "C" __global__ void __launch_bounds__(128) mvqm_q8_0(const Jobs js, const u8* qx, int qstride, int lo, float* out, int os) {
    mvqm<4>(js, qx, qstride, lo, out, os);
}
extern "C" __global__ void __launch_bounds__(256) mvqm8_q8_0(const Jobs js, const u8* qx, int qstride, int lo, float* out, int os) {
    mvqm<8>(js, qx, qstride, lo, out, os);
}
