// A decoded token's kept experts in two launches instead of four, appended to kernels.cu (whose
// int8 mat-vec it uses): gate and up with SiLU(gate) · up and its int8 copy in one, the down
// products with their weighted sum into the residual in the other. The separate launches
// (`mvkq` gate and up, `silu_quantize`, `mvkq` down, `add_weighted_slots`) were four waits for
// the kernel before, and the down products, one half-warp per row of 12 tasks, had a single
// task's loads in flight per lane (0.66 TB/s). The sums run as in those kernels, in the same
// order, so the results are the same bits.

#define SWIGLU_WARPS 8  // a block: one group of 32 outputs, four per warp

// Grid order, both kernels: blocks start in launch order, x fastest. `pairs_first` puts the pairs
// (tokens, for the mix) on x, so that every pair's blocks for the same rows run at about the same
// time: in a batched step the pairs that chose one expert (16 sequences' 128 pairs fall on ~80 of
// 128 experts, 64 sequences' 512 on nearly all) then read those rows from HBM once and from L2
// after. With the rows on x, a pair's rows all ran before the next pair's, and each pair read its
// expert from HBM again. Each block computes what it did either way: the same bits.

// Gate and up rows [32 b, 32 b + 32) of pair `pair`'s expert (kp.parts 2: gate, up; rows
// the intermediate width, a multiple of 32), against the token's input quantized at
// qx + t * qstride; then v = SiLU(gate) · up per row, written to out (row `pair`, columns
// [32 b ..) of the gate half, as silu_quantize leaves it) and quantized as group b of row
// `pair` of dq (dqstride apart), for the down products. Each warp takes four rows, gate and up
// of each: eight rows' loads in flight per lane.
template <int F>
__device__ void mvq_swiglu(const Kept& kp, const float* routes, const u8* qx, int qstride, float* out, int os, u8* dq,
                           int dqstride, int pairs_first) {
    __shared__ float v[32];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int pair = pairs_first ? blockIdx.x : blockIdx.y, t = pair / kp.k;
    int b = pairs_first ? blockIdx.y : blockIdx.x;
    float id = routes[(size_t)t * 2 * kp.k + pair % kp.k];
    int e = id >= 0.0f && id < (float)kp.experts ? (int)id : 0;  // as kept_job
    const u8* qrow = qx + (size_t)t * qstride;
    const signed char* xq = (const signed char*)qrow;
    const float* xd = (const float*)(qrow + kp.cols);
    const float* xsum = xd + kp.cols / 32;
    int tasks = mvq_tasks<F>(kp.cols);
    int r0 = 32 * b + 4 * warp;
    const u8* g = (const u8*)(kp.base[0] + (u64)e * kp.expert_bytes[0]);
    const u8* u = (const u8*)(kp.base[1] + (u64)e * kp.expert_bytes[1]);
    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; i++) acc[i] = 0.0f;
    if (tasks <= 16) {
        // Half a warp a row, as mvq: lanes 0-15 rows r0 + 2i, 16-31 rows r0 + 2i + 1.
        int tl = lane % 16, h = lane / 16;
        if (tl < tasks)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                int r = r0 + 2 * i + h;
                acc[2 * i] = mvq_task<F>(g + (size_t)r * kp.row_bytes, tl, xq, xd, xsum);
                acc[2 * i + 1] = mvq_task<F>(u + (size_t)r * kp.row_bytes, tl, xq, xd, xsum);
            }
#pragma unroll
        for (int i = 0; i < 4; i++)
            for (int o = 8; o > 0; o >>= 1) acc[i] += __shfl_down_sync(0xffffffff, acc[i], o, 16);
        if (tl == 0)
#pragma unroll
            for (int i = 0; i < 2; i++) {
                float a = acc[2 * i];
                v[4 * warp + 2 * i + h] = a / (1.0f + expf(-a)) * acc[2 * i + 1];
            }
    } else {
        for (int tk = lane; tk < tasks; tk += 32)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                acc[2 * i] += mvq_task<F>(g + (size_t)(r0 + i) * kp.row_bytes, tk, xq, xd, xsum);
                acc[2 * i + 1] += mvq_task<F>(u + (size_t)(r0 + i) * kp.row_bytes, tk, xq, xd, xsum);
            }
#pragma unroll
        for (int i = 0; i < 8; i++)
            for (int o = 16; o > 0; o >>= 1) acc[i] += __shfl_down_sync(0xffffffff, acc[i], o);
        if (lane == 0)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float a = acc[2 * i];
                v[4 * warp + i] = a / (1.0f + expf(-a)) * acc[2 * i + 1];
            }
    }
    __syncthreads();
    if (warp == 0) {
        float x = v[lane];
        out[(size_t)pair * os + 32 * b + lane] = x;
        quantize_group(x, dq + (size_t)pair * dqstride, kp.rows, b);
    }
}

// Row r of token t, a warp's: x[t][r] += sum over its k slots, in slot order, of the
// slot's weight times the row of its expert's down matrix (kp.parts 1) against the pair's input
// quantized at qx + pair * qstride. For rows of at most 16 tasks (a down projection from 768:
// 12) half a warp takes a slot, two slots at once, and every lane issues the loads of MIX_CHUNK
// pairs of slots before it sums any: one pair at a time, a lane had a single task's loads in
// flight between reductions, and the launch took 15 µs for 7 MB (a warp per two rows, 8 warps
// an SM). Longer rows take a warp per slot. Each slot's sum as mvq's (split 1) and the mixing as
// add_weighted_slots's: the same bits.
#define MIX_CHUNK 4
template <int F>
__device__ void mvq_mix(const Kept& kp, const float* routes, const u8* qx, int qstride, float* x, int xs,
                        int pairs_first) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int t = pairs_first ? blockIdx.x : blockIdx.y;
    int r = (pairs_first ? blockIdx.y : blockIdx.x) * MVQ_WARPS + warp;
    if (r >= kp.rows) return;
    int tasks = mvq_tasks<F>(kp.cols);
    const float* rt = routes + (size_t)t * 2 * kp.k;
    float acc = x[(size_t)t * xs + r];
    if (tasks <= 16) {
        int tl = lane % 16, h = lane / 16;
        for (int c0 = 0; c0 < kp.k; c0 += 2 * MIX_CHUNK) {
            // Loads first: every lane reads a valid task (idle ones the first task of their
            // slot's row, or of slot 0) and drops it, so nothing branches around the loads.
            MvqW<F> w[MIX_CHUNK];
            const u8* qrow[MIX_CHUNK];
            bool live[MIX_CHUNK];
            // The slots' expert ids all before any weights (the SASS had each slot's weights
            // wait on its own id's load; measured level on an H100, 2026-12-06).
            int e[MIX_CHUNK];
#pragma unroll
            for (int c = 0; c < MIX_CHUNK; c++) {
                int s = c0 + 2 * c + h;
                live[c] = s < kp.k && tl < tasks;
                int sv = s < kp.k ? s : 0;
                float id = rt[sv];
                int ei = __float2int_rz(id);  // saturates; used only where in range, as kept_job
                e[c] = id >= 0.0f && id < (float)kp.experts ? ei : 0;
                qrow[c] = qx + (size_t)(t * kp.k + sv) * qstride;
            }
#pragma unroll
            for (int c = 0; c < MIX_CHUNK; c++)
                w[c] = mvq_load<F>((const u8*)(kp.base[0] + (u64)e[c] * kp.expert_bytes[0]) + (size_t)r * kp.row_bytes, live[c] ? tl : 0);
            float d[MIX_CHUNK];
#pragma unroll
            for (int c = 0; c < MIX_CHUNK; c++) {
                const float* xd = (const float*)(qrow[c] + kp.cols);
                float v = mvq_dot<F>(w[c], live[c] ? tl : 0, (const signed char*)qrow[c], xd, xd + kp.cols / 32);
                d[c] = live[c] ? v : 0.0f;
            }
#pragma unroll
            for (int c = 0; c < MIX_CHUNK; c++) {
                int s0 = c0 + 2 * c;
                if (s0 >= kp.k) break;  // the same for the whole warp
                float v = d[c];
                for (int o = 8; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffff, v, o, 16);
                float v1 = __shfl_sync(0xffffffff, v, 16);
                acc += rt[kp.k + s0] * v;
                if (s0 + 1 < kp.k) acc += rt[kp.k + s0 + 1] * v1;
            }
        }
    } else {
        for (int s = 0; s < kp.k; s++) {
            float id = rt[s];
            int e = id >= 0.0f && id < (float)kp.experts ? (int)id : 0;
            const u8* w = (const u8*)(kp.base[0] + (u64)e * kp.expert_bytes[0]) + (size_t)r * kp.row_bytes;
            const u8* qrow = qx + (size_t)(t * kp.k + s) * qstride;
            const float* xd = (const float*)(qrow + kp.cols);
            float v = 0.0f;
            for (int tk = lane; tk < tasks; tk += 32) v += mvq_task<F>(w, tk, (const signed char*)qrow, xd, xd + kp.cols / 32);
            for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffff, v, o);
            acc += rt[kp.k + s] * __shfl_sync(0xffffffff, v, 0);
        }
    }
    if (lane == 0) x[(size_t)t * xs + r] = acc;
}

// The mix with a warp per (row, two slots) instead of a warp per row: rows of at most 16 tasks
// and at most 16 slots (`mvkq_mix_split`). A warp per row issued its slots' loads two by two,
// ptxas interleaving each pair's loads with the previous pair's products (62 registers), and
// one token's 2048 rows were 2048 warps, 16 an SM: 0.76 TB/s, 9.3 µs (ncu). Here each warp
// loads its two slots' task once, the block's warps for a row leave their sums in shared memory,
// and one lane mixes them into the residual in slot order: every slot's sum and the mixing as in
// mvq_mix, the same bits. A block is 8 / ((k + 1) / 2) rows of (k + 1) / 2 warps (host:
// mix_split_rows). One-token steps take it (SMOE_CUDA_KEPT_WARPS=split: every step, =rows:
// none; CudaOptions::kept_split): one sequence decoded 1-2% faster on an H100 and 2% on an
// H200, 8 and 16 sequences 2-4% slower (docs/benchmarks.md, 2026-12-06). Its eight-slot
// rows (four warps a row) pass the conformance suite's one-token case on a GPU.
template <int F>
__device__ void mvq_mix_split(const Kept& kp, const float* routes, const u8* qx, int qstride, float* x, int xs,
                              int pairs_first) {
    __shared__ float v[8][2];  // a warp's two slots' sums; blocks are at most 8 warps
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int wr = (kp.k + 1) / 2, rows = blockDim.x / 32 / wr;
    int t = pairs_first ? blockIdx.x : blockIdx.y;
    int ri = warp / wr, c = warp % wr;
    int r = (pairs_first ? blockIdx.y : blockIdx.x) * rows + ri;
    int tasks = mvq_tasks<F>(kp.cols);
    const float* rt = routes + (size_t)t * 2 * kp.k;
    int tl = lane % 16, h = lane / 16, s = 2 * c + h;
    // Idle lanes (past the row's tasks, the last slot of an odd k, rows past the end) read a
    // valid task of slot 0's row 0 and drop it.
    bool live = s < kp.k && tl < tasks && r < kp.rows;
    int sv = s < kp.k ? s : 0;
    float id = rt[sv];
    int e = id >= 0.0f && id < (float)kp.experts ? (int)id : 0;
    const u8* qrow = qx + (size_t)(t * kp.k + sv) * qstride;
    const float* xd = (const float*)(qrow + kp.cols);
    const u8* wrow = (const u8*)(kp.base[0] + (u64)e * kp.expert_bytes[0]) + (size_t)(r < kp.rows ? r : 0) * kp.row_bytes;
    float d = mvq_dot<F>(mvq_load<F>(wrow, live ? tl : 0), live ? tl : 0, (const signed char*)qrow, xd, xd + kp.cols / 32);
    d = live ? d : 0.0f;
    for (int o = 8; o > 0; o >>= 1) d += __shfl_down_sync(0xffffffff, d, o, 16);
    float d1 = __shfl_sync(0xffffffff, d, 16);
    if (lane == 0) {
        v[warp][0] = d;
        v[warp][1] = d1;
    }
    __syncthreads();
    if (c == 0 && lane == 0 && r < kp.rows) {
        float acc = x[(size_t)t * xs + r];
        for (int s0 = 0; s0 < kp.k; s0++) acc += rt[kp.k + s0] * v[ri * wr + s0 / 2][s0 % 2];
        x[(size_t)t * xs + r] = acc;
    }
}

// The experts of a step's first `pairs` (token, slot) pairs, gate, up and down (at `down`,
// `down_bytes` an expert), asked of L2 as soon as the routes are known: right after this
// kernel's wait, in 64 KiB pieces spread over the grid's blocks (thread 0 of each). The blocks'
// own loads of a one-token step are one round of a few rows each, latency-bound at 1.3 TB/s
// (ncu: 11 µs for 14 MB), and the mix after them fetched its down rows the same way; the copy
// engine's requests keep HBM busy meanwhile, and both kernels then read mostly from L2. For a
// step's few pairs only (the host's choice): the experts of many pairs do not fit in L2.
#define KEPT_PIECE 65536
__device__ void kept_prefetch(const Kept& kp, const float* routes, int pairs, u64 down, u64 down_bytes) {
#if __CUDA_ARCH__ >= 900
    if (threadIdx.x != 0 || pairs <= 0) return;
    // (Named values, not arrays: an array indexed by the part put them on the stack.)
    u64 b0 = kp.expert_bytes[0], b1 = kp.expert_bytes[1];
    int p0 = (int)((b0 + KEPT_PIECE - 1) / KEPT_PIECE), p1 = (int)((b1 + KEPT_PIECE - 1) / KEPT_PIECE);
    int per_pair = p0 + p1 + (int)((down_bytes + KEPT_PIECE - 1) / KEPT_PIECE);
    int blocks = gridDim.x * gridDim.y;
    for (int g = blockIdx.x + blockIdx.y * gridDim.x; g < pairs * per_pair; g += blocks) {
        int pair = g / per_pair, i = g % per_pair;
        float id = routes[(size_t)(pair / kp.k) * 2 * kp.k + pair % kp.k];
        u64 e = id >= 0.0f && id < (float)kp.experts ? (u64)id : 0;  // as kept_job
        u64 base = i < p0 ? kp.base[0] + e * b0 : i < p0 + p1 ? kp.base[1] + e * b1 : down + e * down_bytes;
        u64 bytes = i < p0 ? b0 : i < p0 + p1 ? b1 : down_bytes;
        u64 off = (u64)(i < p0 ? i : i < p0 + p1 ? i - p0 : i - p0 - p1) * KEPT_PIECE, left = bytes - off;
        prefetch_l2((const void*)(base + off), left < KEPT_PIECE ? left : KEPT_PIECE);
    }
#endif
}

#define KEPT_FUSED_KERNELS(name, id)                                                                          \
    extern "C" __global__ void mvkq_swiglu_##name(const Kept kp, const float* routes, const u8* qx, int qstride, \
                                                  float* out, int os, u8* dq, int dqstride, int pairs_first,     \
                                                  u64 down, u64 down_bytes, int prefetch) {                      \
        PDL_START;                                                                                            \
        kept_prefetch(kp, routes, prefetch, down, down_bytes);                                                \
        mvq_swiglu<id>(kp, routes, qx, qstride, out, os, dq, dqstride, pairs_first);                          \
    }                                                                                                         \
    extern "C" __global__ void mvkq_mix_##name(const Kept kp, const float* routes, const u8* qx, int qstride,    \
                                               float* x, int xs, int pairs_first) { PDL_START;                   \
        mvq_mix<id>(kp, routes, qx, qstride, x, xs, pairs_first);                                             \
    }                                                                                                         \
    extern "C" __global__ void mvkq_mix_split_##name(const Kept kp, const float* routes, const u8* qx,          \
                                                     int qstride, float* x, int xs, int pairs_first) {          \
        PDL_START;                                                                                            \
        mvq_mix_split<id>(kp, routes, qx, qstride, x, xs, pairs_first);                                       \
    }

KEPT_FUSED_KERNELS(q8_0, 8)
KEPT_FUSED_KERNELS(q4_k, 12)
KEPT_FUSED_KERNELS(q6_k, 14)

// A decoded token's split mix (mvq_mix_split, one token) and the next layer's input norm of
// the residual it leaves (rms_norm of x's row 0 with w into out, quantized at oq when given):
// the last block to finish (fused.cu's last_block) norms the row with rms_norm's bits
// (norm_row, as that kernel's `threads`). One launch, and one wait, fewer a layer.
#define KEPT_MIX_NORM_KERNEL(name, id)                                                                          \
    extern "C" __global__ void mvkq_mix_split_norm_##name(const Kept kp, const float* routes, const u8* qx,     \
                                                          int qstride, float* x, const float* w, float* out,    \
                                                          float eps, u8* oq, int threads, int* ticket) {        \
        PDL_START;                                                                                            \
        mvq_mix_split<id>(kp, routes, qx, qstride, x, kp.rows, 0);                                            \
        if (last_block(ticket)) norm_row(x, nullptr, w, out, kp.rows, eps, oq, threads);                       \
    }
KEPT_MIX_NORM_KERNEL(q8_0, 8)
KEPT_MIX_NORM_KERNEL(q4_k, 12)
KEPT_MIX_NORM_KERNEL(q6_k, 14)
