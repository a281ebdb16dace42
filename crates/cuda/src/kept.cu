// A decoded token's kept experts in two launches instead of four, appended to kernels.cu (whose
// int8 mat-vec it uses): gate and up with SiLU(gate) · up and its int8 copy in one, the down
// products with their weighted sum into the residual in the other. The separate launches
// (`mvkq` gate and up, `silu_quantize`, `mvkq` down, `add_weighted_slots`) were four waits for
// the kernel before, and the down products, one half-warp per row of 12 tasks, had a single
// task's loads in flight per lane (0.66 TB/s). The sums run as in those kernels, in the same
// order, so the results are the same bits.

#define SWIGLU_WARPS 8  // a block: one group of 32 outputs, four per warp
#define MIX_ROWS 2      // output rows of a down-and-mix warp

// Gate and up rows [32 b, 32 b + 32) of pair blockIdx.y's expert (kp.parts 2: gate, up; rows
// the intermediate width, a multiple of 32), against the token's input quantized at
// qx + t * qstride; then v = SiLU(gate) · up per row, written to out (row `pair`, columns
// [32 b ..) of the gate half, as silu_quantize leaves it) and quantized as group b of row
// `pair` of dq (dqstride apart), for the down products. Each warp takes four rows, gate and up
// of each: eight rows' loads in flight per lane.
template <int F>
__device__ void mvq_swiglu(const Kept& kp, const float* routes, const u8* qx, int qstride, float* out, int os, u8* dq,
                           int dqstride) {
    __shared__ float v[32];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int pair = blockIdx.y, t = pair / kp.k;
    float id = routes[(size_t)t * 2 * kp.k + pair % kp.k];
    int e = id >= 0.0f && id < (float)kp.experts ? (int)id : 0;  // as kept_job
    const u8* qrow = qx + (size_t)t * qstride;
    const signed char* xq = (const signed char*)qrow;
    const float* xd = (const float*)(qrow + kp.cols);
    const float* xsum = xd + kp.cols / 32;
    int tasks = F == 8 ? kp.cols / 32 : kp.cols / 64;
    int r0 = 32 * blockIdx.x + 4 * warp;
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
        out[(size_t)pair * os + 32 * blockIdx.x + lane] = x;
        quantize_group(x, dq + (size_t)pair * dqstride, kp.rows, blockIdx.x);
    }
}

// Rows [r0, r0 + MIX_ROWS) of token blockIdx.y: x[t][r] += sum over its k slots, in slot order,
// of the slot's weight times the row of its expert's down matrix (kp.parts 1) against the
// pair's input quantized at qx + pair * qstride. For rows of at most 16 tasks (a down
// projection from 768: 12) half a warp takes a slot, two slots at once; else the warp. Each
// slot's sum as mvq's (split 1) and the mixing as add_weighted_slots's: the same bits.
template <int F>
__device__ void mvq_mix(const Kept& kp, const float* routes, const u8* qx, int qstride, float* x, int xs) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int t = blockIdx.y;
    int r0 = (blockIdx.x * MVQ_WARPS + warp) * MIX_ROWS;
    if (r0 >= kp.rows) return;
    int tasks = F == 8 ? kp.cols / 32 : kp.cols / 64;
    bool half = tasks <= 16;
    int per = half ? 2 : 1, width = half ? 16 : 32, tl = lane % width;
    const float* rt = routes + (size_t)t * 2 * kp.k;
    float acc[MIX_ROWS];
#pragma unroll
    for (int i = 0; i < MIX_ROWS; i++) acc[i] = r0 + i < kp.rows ? x[(size_t)t * xs + r0 + i] : 0.0f;
#pragma unroll 4
    for (int s0 = 0; s0 < kp.k; s0 += per) {
        int s = s0 + (half ? lane / 16 : 0);
        bool live = s < kp.k;
        float id = live ? rt[s] : 0.0f;
        int e = id >= 0.0f && id < (float)kp.experts ? (int)id : 0;
        const u8* w = (const u8*)(kp.base[0] + (u64)e * kp.expert_bytes[0]);
        const u8* qrow = qx + (size_t)(t * kp.k + (live ? s : 0)) * qstride;
        const signed char* xq = (const signed char*)qrow;
        const float* xd = (const float*)(qrow + kp.cols);
        const float* xsum = xd + kp.cols / 32;
        float d[MIX_ROWS];
#pragma unroll
        for (int i = 0; i < MIX_ROWS; i++) d[i] = 0.0f;
        if (live)
            for (int tk = tl; tk < tasks; tk += width)
#pragma unroll
                for (int i = 0; i < MIX_ROWS; i++)
                    if (r0 + i < kp.rows) d[i] += mvq_task<F>(w + (size_t)(r0 + i) * kp.row_bytes, tk, xq, xd, xsum);
#pragma unroll
        for (int i = 0; i < MIX_ROWS; i++) {
            for (int o = width / 2; o > 0; o >>= 1) d[i] += __shfl_down_sync(0xffffffff, d[i], o, width);
            float d1 = __shfl_sync(0xffffffff, d[i], 16);
            acc[i] += rt[kp.k + s0] * d[i];
            if (half && s0 + 1 < kp.k) acc[i] += rt[kp.k + s0 + 1] * d1;
        }
    }
    if (lane == 0)
#pragma unroll
        for (int i = 0; i < MIX_ROWS; i++)
            if (r0 + i < kp.rows) x[(size_t)t * xs + r0 + i] = acc[i];
}

#define KEPT_FUSED_KERNELS(name, id)                                                                          \
    extern "C" __global__ void mvkq_swiglu_##name(const Kept kp, const float* routes, const u8* qx, int qstride, \
                                                  float* out, int os, u8* dq, int dqstride) { PDL_START;         \
        mvq_swiglu<id>(kp, routes, qx, qstride, out, os, dq, dqstride);                                       \
    }                                                                                                         \
    extern "C" __global__ void mvkq_mix_##name(const Kept kp, const float* routes, const u8* qx, int qstride,    \
                                               float* x, int xs) { PDL_START;                                    \
        mvq_mix<id>(kp, routes, qx, qstride, x, xs);                                                          \
    }

KEPT_FUSED_KERNELS(q8_0, 8)
KEPT_FUSED_KERNELS(q4_k, 12)
