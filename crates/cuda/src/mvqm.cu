// A few tokens' Q8_0 products on int8 tensor cores, appended after mmq.cu (whose mma_s8 it uses).
//
// The few-token mat-vec (`mvqn`: 2 to 8 tokens, a batched decode step's dense products, up to 64
// tokens as launches of eight) reads a task's weights once for all its tokens, but every token's
// inputs again for each row: at eight tokens fifteen times as many bytes through L1 as weights,
// and eight dp4a per row, token and group. On an H100 eight tokens' q/k/v products took 25 µs
// against one token's 9 (ncu, 2026-12-06). Here one m16n8k32 product gives a group's 32-bit sums
// for 16 rows by 8 tokens.
//
// Each token keeps the bits of its one-token product (`mvq`): the float terms (q8_term) are added
// in mvq's order. There lane L of warp part p (`mvq_split` warps share a row) adds the terms of
// groups L + 32 p, L + 32 p + 32 split, ... in turn, from 0; the lanes' sums are then added by a
// shuffle tree (offsets 16, 8, 4, 2, 1), which is the pairwise sum of the 32 lane sums taken in
// bit-reversed order of L; then the parts' sums in order. A thread here holds four (row, token)
// sums of each product, so it adds each pair's terms lane by lane in that order, and the lane
// sums pairwise through a stack of partial sums (a binary counter, indexed at compile time). With
// one part, the block's four warps take eight consecutive places of the bit-reversed order each
// (a subtree of the shuffle tree); with four, a part each; warp 0 then adds theirs as mvq does.
// (Integer sums are exact in any order, so A and B may take a group's bytes in any order they
// share: a thread's bytes 8q .. 8q + 7, as one word of each.)

#define MVQM_ROWS 16
#define MVQM_WARPS 4
// Lanes (of mvq's order) whose groups' loads are issued together.
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
    // k = 4q .. 4q + 3 are quants 8q .. 8q + 3, k = 16 + 4q .. are 8q + 4 .. 8q + 7.
    const u8* ba = m.wa + (size_t)t * 34;
    const u8* bb = m.wb + (size_t)t * 34;
    const u8 *pa = ba + 2 + 8 * m.q, *pb = bb + 2 + 8 * m.q;
    uint2 x = *(const uint2*)(m.xb + 32 * t + 8 * m.q);
    return MvqmW{{(u32)load_i32_u16(pa), (u32)load_i32_u16(pb), (u32)load_i32_u16(pa + 4), (u32)load_i32_u16(pb + 4)},
                 {x.x, x.y},
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
// lanes at a time, their k-th groups' loads issued together: with four parts a lane has one
// group of a 4096-wide row, and lane after lane, a warp waited out 32 round trips to memory.
template <int LOG>
__device__ __forceinline__ void mvqm_lanes(const MvqmRows& m, int i0, int part, int split, int tasks, float* sum) {
    float stack[LOG][4];
    int stride = 32 * split;
#pragma unroll
    for (int i = 0; i < (1 << LOG); i += MVQM_AHEAD) {
        int first[MVQM_AHEAD];
        float v[MVQM_AHEAD][4];
#pragma unroll
        for (int e = 0; e < MVQM_AHEAD; e++) {
            first[e] = (__brev(i0 + i + e) >> 27) + 32 * part;
#pragma unroll
            for (int c = 0; c < 4; c++) v[e][c] = 0.0f;
        }
        for (int off = 0;; off += stride) {
            bool any = false;
            MvqmW w[MVQM_AHEAD];
#pragma unroll
            for (int e = 0; e < MVQM_AHEAD; e++)
                if (first[e] + off < tasks) {
                    w[e] = mvqm_load(m, first[e] + off);
                    any = true;
                }
            if (!any) break;
#pragma unroll
            for (int e = 0; e < MVQM_AHEAD; e++)
                if (first[e] + off < tasks) mvqm_add(w[e], v[e]);
        }
        // Push the lanes' sums in order: while the counter's low bits are ones, add the sum to
        // the level's left part (the shuffle tree's add, own value first).
#pragma unroll
        for (int e = 0; e < MVQM_AHEAD; e++) {
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
#endif

// Job blockIdx.y's rows r0 .. r0 + 16 (r0 = 16 blockIdx.x) against its 2 to 8 input rows,
// token c's quantized at qx + (j.x_row + c - lo) * qstride: each token's sums with mvq's bits.
// Four warps; rows of more than 16 groups (`mvqn` takes the half-warp rows of at most 16).
extern "C" __global__ void mvqm_q8_0(const Jobs js, const u8* qx, int qstride, int lo, float* out, int os) {
    const Job& j = js.job[blockIdx.y];
    int r0 = blockIdx.x * MVQM_ROWS;
    if (js.prefetch && threadIdx.x == 0 && r0 < j.rows)
        prefetch_l2((const u8*)j.w + (u64)r0 * j.row_bytes, (u64)min(MVQM_ROWS, j.rows - r0) * j.row_bytes);
    PDL_START;
#if __CUDA_ARCH__ >= 800
    __shared__ float sums[MVQM_WARPS][32][4];
    if (r0 >= j.rows) return;  // the whole block
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
    int n = j.n, tasks = j.cols / 32, split = mvq_split<8>(j.cols);
    auto input = [&](int c) { return qx + (size_t)(j.x_row + (c < n ? c : 0) - lo) * qstride; };
    MvqmRows m{(const u8*)j.w + (size_t)min(r0 + g, j.rows - 1) * j.row_bytes,
               (const u8*)j.w + (size_t)min(r0 + g + 8, j.rows - 1) * j.row_bytes,
               (const signed char*)input(g),
               (const float*)(input(2 * q) + j.cols),
               (const float*)(input(2 * q + 1) + j.cols),
               q};
    float s[4];
    if (split == 1) mvqm_lanes<3>(m, 8 * warp, 0, 1, tasks, s);
    else mvqm_lanes<5>(m, 0, warp, split, tasks, s);
#pragma unroll
    for (int c = 0; c < 4; c++) sums[warp][lane][c] = s[c];
    __syncthreads();
    if (warp != 0) return;
    float r[4];
#pragma unroll
    for (int c = 0; c < 4; c++) {
        float (*p)[32][4] = sums;
        // One part: the subtrees of eight lanes, pairwise; four parts: in order, as mvq adds them.
        r[c] = split == 1 ? (p[0][lane][c] + p[1][lane][c]) + (p[2][lane][c] + p[3][lane][c])
                          : ((p[0][lane][c] + p[1][lane][c]) + p[2][lane][c]) + p[3][lane][c];
    }
#pragma unroll
    for (int c = 0; c < 4; c++) {
        int row = r0 + g + 8 * (c / 2), token = 2 * q + c % 2;
        if (row < j.rows && token < n) out[(size_t)(j.out_row + token) * os + j.out_col + row] = r[c];
    }
#endif
}
