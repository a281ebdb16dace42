// Prefill products on int8 tensor cores, appended to kernels.cu (whose helpers they use).
//
// The 3xTF32 tiles (`mm_tc`) took 0.2 s of a 0.3 s 512-token prefill of the 30B shape: three
// m16n8k8 products per eight inputs, after decoding every weight to f32. Here the weights stay
// small integers and the inputs are the int8 rows `quantize_rows` writes (a scale and a scaled
// sum per group of 32), so one m16n8k32 integer product covers a whole group, four times the
// inputs of a TF32 one, and the group's float scales are applied to its 32-bit sums after it:
//
//   sum_i w_i x_i = a_w * d_x * sum_i q_i xq_i - b_w * (d_x * sum_i xq_i)
//
// with w_i = a_w q_i - b_w in every group of 32 (Q8_0: a_w the block's scale, b_w 0; Q4_K: a_w
// d · scale of the sub-block, b_w dmin · its minimum), the arithmetic of the int8 mat-vec
// (`mvq_task`) in another order. A block computes 64 weight rows by 32 or 64 tokens; each of its four
// warps 16 rows by all the tokens, an m16n8k32 product per 8 tokens and group. The weights of eight groups
// (a Q4_K super-block) and the inputs' are staged in shared memory per step, rows 272 bytes apart
// so that a warp's fragment loads (eight rows by four words) fall in 32 different banks.

#define MMQ_TILE 64
#define MMQ_GROUPS 8
#define MMQ_STRIDE 272

#if __CUDA_ARCH__ >= 800
__device__ __forceinline__ void mma_s8(int* d, const u32* a, const u32* b) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// Groups g and g + 1 of a row of format F as 64 small integers (dst: 16 words) and each group's
// a_w, b_w (see above); `two` false: group g only (an odd count of groups, Q8_0 alone).
template <int F>
__device__ __forceinline__ void mmq_pair(const u8* row, int g, bool two, u32* dst, float* a, float* b) {
    if (F == 8) {
        // Two 34-byte blocks from an even group start 4-byte aligned where the row does (row
        // lengths are multiples of 68 bytes but for odd group counts): 17 words, the first
        // block's quants two bytes into them. Two-byte loads (load_i32_u16) made the dense
        // products' weight staging the slowest part of a chunk.
        const u8* blk = row + (size_t)g * 34;
        if (two && ((size_t)blk & 3) == 0) {
            u32 w[17];
#pragma unroll
            for (int k = 0; k < 17; k++) w[k] = ((const u32*)blk)[k];
#pragma unroll
            for (int k = 0; k < 8; k++) dst[k] = __funnelshift_r(w[k], w[k + 1], 16);
#pragma unroll
            for (int k = 0; k < 8; k++) dst[8 + k] = w[9 + k];
            a[0] = half_bits((u16)(w[0] & 0xFFFF));
            a[1] = half_bits((u16)(w[8] >> 16));
            b[0] = b[1] = 0.0f;
            return;
        }
#pragma unroll
        for (int h = 0; h < 2; h++) {
            if (h == 1 && !two) break;
            const u8* bh = blk + h * 34;
            a[h] = f16(bh);
            b[h] = 0.0f;
#pragma unroll
            for (int k = 0; k < 8; k++) dst[8 * h + k] = (u32)load_i32_u16(bh + 2 + 4 * k);
        }
    } else {  // Q4_K: groups g, g + 1 are sub-blocks 2p, 2p + 1 of super-block g / 8 (g even)
        int sb = g >> 3, p = (g & 7) >> 1;
        const u8* blk = row + (size_t)sb * 144;
        uint4 qa = *(const uint4*)(blk + 16 + 32 * p), qb = *(const uint4*)(blk + 32 + 32 * p);
        u32 q[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
        for (int k = 0; k < 8; k++) {
            dst[k] = q[k] & 0x0F0F0F0F;
            dst[8 + k] = (q[k] >> 4) & 0x0F0F0F0F;
        }
        float sc0, mn0, sc1, mn1;
        scale_min_k4(2 * p, blk + 4, &sc0, &mn0);
        scale_min_k4(2 * p + 1, blk + 4, &sc1, &mn1);
        float d = f16(blk), dmin = f16(blk + 2);
        a[0] = d * sc0;
        b[0] = dmin * mn0;
        a[1] = d * sc1;
        b[1] = dmin * mn1;
    }
}

// Job blockIdx.z's rows r0.. (64) by tokens t0.. (NT) against its input rows,
// quantized at qx + (j.x_row - lo) * qstride. Grid (row tiles, token tiles, jobs), 128 threads.
// Tiles of 32 tokens (NT = 32) fit an expert's few dozen tokens of a prefill chunk better (with
// 64, half of each tile's products and scalings are of padding), yet measured 8% slower on the
// 30B shape than 64, the only size built.
template <int F, int NT>
__device__ void mmq(const Jobs& js, const u8* qx, int qstride, int lo, float* out, int os) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) u8 ws[MMQ_TILE * MMQ_STRIDE];
    __shared__ __align__(16) u8 xq[NT * MMQ_STRIDE];
    // Odd row lengths: the four tokens a warp's lanes read at once fall in different banks.
    __shared__ float wa[MMQ_TILE][MMQ_GROUPS + 1], wb[MMQ_TILE][MMQ_GROUPS + 1];
    __shared__ float xd[NT][MMQ_GROUPS + 1], xm[NT][MMQ_GROUPS + 1];
    const Job& j = js.job[blockIdx.z];
    int r0 = blockIdx.x * MMQ_TILE, t0 = blockIdx.y * NT;
    if (r0 >= j.rows || t0 >= j.n) return;
    int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gid = lane >> 2, tig = lane & 3;
    float c[NT / 8][4];
#pragma unroll
    for (int a = 0; a < NT / 8; a++)
#pragma unroll
        for (int b = 0; b < 4; b++) c[a][b] = 0.0f;
    int groups = j.cols / 32;
    const u8* xrows = qx + (size_t)(j.x_row - lo + t0) * qstride;
    for (int g0 = 0; g0 < groups; g0 += MMQ_GROUPS) {
        // Weights: two threads a row, two pairs of groups each.
        {
            int r = tid % MMQ_TILE, half = tid / MMQ_TILE;
            const u8* row = (const u8*)j.w + (size_t)(r0 + r) * j.row_bytes;
            u32* dst = (u32*)(ws + r * MMQ_STRIDE);
#pragma unroll
            for (int q = 0; q < 2; q++) {
                int gl = 4 * half + 2 * q, g = g0 + gl;
                float a[2] = {0.0f, 0.0f}, b[2] = {0.0f, 0.0f};
                if (r0 + r < j.rows && g < groups) mmq_pair<F>(row, g, g + 1 < groups, dst + 8 * gl, a, b);
                wa[r][gl] = a[0];
                wa[r][gl + 1] = a[1];
                wb[r][gl] = b[0];
                wb[r][gl + 1] = b[1];
            }
        }
        // Inputs: 16-byte pieces (rows and column offsets are multiples of 16 bytes), then
        // each group's scale and scaled sum; zeros past the job's tokens or the row's end.
        for (int e = tid; e < NT * 16; e += blockDim.x) {
            int t = e / 16, piece = e % 16, col = 32 * g0 + 16 * piece;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (t0 + t < j.n && col < j.cols) v = *(const uint4*)(xrows + (size_t)t * qstride + col);
            *(uint4*)(xq + t * MMQ_STRIDE + 16 * piece) = v;
        }
        for (int e = tid; e < NT * MMQ_GROUPS; e += blockDim.x) {
            int t = e / MMQ_GROUPS, gl = e % MMQ_GROUPS, g = g0 + gl;
            bool ok = t0 + t < j.n && g < groups;
            const float* s = (const float*)(xrows + (size_t)t * qstride + j.cols);
            xd[t][gl] = ok ? s[g] : 0.0f;
            xm[t][gl] = ok ? s[groups + g] : 0.0f;
        }
        __syncthreads();
        int ra = 16 * warp + gid;
        int steps = min(MMQ_GROUPS, groups - g0);
        for (int gl = 0; gl < steps; gl++) {
            const u8* wr = ws + ra * MMQ_STRIDE + 32 * gl + 4 * tig;
            u32 a[4] = {*(const u32*)wr, *(const u32*)(wr + 8 * MMQ_STRIDE), *(const u32*)(wr + 16),
                        *(const u32*)(wr + 8 * MMQ_STRIDE + 16)};
            float a0 = wa[ra][gl], a1 = wa[ra + 8][gl], b0 = wb[ra][gl], b1 = wb[ra + 8][gl];
#pragma unroll
            for (int jn = 0; jn < NT / 8; jn++) {
                // Past the job's tokens (an expert's few dozen in a tile of 64): no product, no
                // scaling (the same for the whole block).
                if (t0 + 8 * jn >= j.n) break;
                const u8* xr = xq + (8 * jn + gid) * MMQ_STRIDE + 32 * gl + 4 * tig;
                u32 bq[2] = {*(const u32*)xr, *(const u32*)(xr + 16)};
                int s[4] = {0, 0, 0, 0};
                mma_s8(s, a, bq);
                int t = 8 * jn + 2 * tig;
                float d0 = xd[t][gl], d1 = xd[t + 1][gl];
                c[jn][0] += a0 * d0 * (float)s[0];
                c[jn][1] += a0 * d1 * (float)s[1];
                c[jn][2] += a1 * d0 * (float)s[2];
                c[jn][3] += a1 * d1 * (float)s[3];
                if (F != 8) {
                    float m0 = xm[t][gl], m1 = xm[t + 1][gl];
                    c[jn][0] -= b0 * m0;
                    c[jn][1] -= b0 * m1;
                    c[jn][2] -= b1 * m0;
                    c[jn][3] -= b1 * m1;
                }
            }
        }
        __syncthreads();
    }
    store_tile<NT / 8>(j, r0 + 16 * warp + gid, t0 + 2 * tig, c, out, os);
#endif
}

#define MMQ_KERNELS(name, id)                                                                         \
    extern "C" __global__ void mmq_##name(const Jobs js, const u8* qx, int qstride, int lo, float* out, \
                                          int os) { PDL_START;                                        \
        mmq<id, 64>(js, qx, qstride, lo, out, os);                                                    \
    }

MMQ_KERNELS(q8_0, 8)
MMQ_KERNELS(q4_k, 12)
