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
// d · scale of the sub-block, b_w dmin · its minimum; Q6_K: a_w d · scale of each half of 16,
// b_w 0, as two m16n8k16 products a group, q_i - 32 staged as signed bytes), the arithmetic of
// the int8 mat-vec (`mvq_task`) in another order. A block computes 64 weight rows by 64 tokens; each of its four
// warps 16 rows by all the tokens, an m16n8k32 product per 8 tokens and group. The weights of
// eight groups (a Q4_K super-block) and the inputs' are staged in shared memory per step, rows
// 272 bytes apart so that a warp's fragment loads (eight rows by four words) fall in 32
// different banks.

#define MMQ_TILE 64
#define MMQ_GROUPS 8
#define MMQ_STRIDE 272

#if __CUDA_ARCH__ >= 800
__device__ __forceinline__ void mma_s8(int* d, const u32* a, const u32* b) {
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// Half of m16n8k32's depth: its a[0], a[1] and b[0] (or a[2], a[3] and b[1]) are exactly this
// product's fragments, so a staged group of 32 splits into its two halves of 16 (Q6_K's scales).
__device__ __forceinline__ void mma_s8_k16(int* d, u32 a0, u32 a1, u32 b) {
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
                 : "r"(a0), "r"(a1), "r"(b));
}
#endif

// Byte l (< 12, known only at run time) of three words, by selection rather than indexing, which
// would put the words in local memory.
__device__ __forceinline__ u32 byte_of3(const u32* s, int l) {
    u32 w = l < 4 ? s[0] : (l < 8 ? s[1] : s[2]);
    return (w >> (8 * (l & 3))) & 0xFF;
}

// Words of raw bytes a thread stages per step (see `mmq`): its four groups of a row.
#define MMQ_RAW(F) ((F) == 8 ? 34 : (F) == 14 ? 27 : 20)
// Weight scales a staged row keeps per step: one a group, Q6_K's two (a half of 16 each); odd,
// so that the rows a warp reads fall in different banks.
#define MMQ_WA(F) ((F) == 14 ? 2 * MMQ_GROUPS + 1 : MMQ_GROUPS + 1)

// N 16-byte values as 4 N words, in order.
template <int N>
__device__ __forceinline__ void words_of(const uint4* v, u32* raw) {
#pragma unroll
    for (int k = 0; k < N; k++) {
        raw[4 * k] = v[k].x;
        raw[4 * k + 1] = v[k].y;
        raw[4 * k + 2] = v[k].z;
        raw[4 * k + 3] = v[k].w;
    }
}

// Half h of the Q6_K super-block at b (2-byte aligned, global or shared memory) as `mmq_load`
// gives it: its 64 bytes of low nibbles, 32 of high bits, 8 scales and d, as 27 words; zeros
// where not `in`.
__device__ __forceinline__ void q6k_half_words(const u8* b, int h, bool in, u32* raw) {
    const u16 *ql = (const u16*)(b + 64 * h), *qh = (const u16*)(b + 128 + 32 * h), *sc = (const u16*)(b + 192 + 8 * h);
#pragma unroll
    for (int k = 0; k < 16; k++) raw[k] = in ? (u32)ql[2 * k] | ((u32)ql[2 * k + 1] << 16) : 0u;
#pragma unroll
    for (int k = 0; k < 8; k++) raw[16 + k] = in ? (u32)qh[2 * k] | ((u32)qh[2 * k + 1] << 16) : 0u;
#pragma unroll
    for (int k = 0; k < 2; k++) raw[24 + k] = in ? (u32)sc[2 * k] | ((u32)sc[2 * k + 1] << 16) : 0u;
    raw[26] = in ? *(const u16*)(b + 208) : 0u;
}

// The raw bytes of groups g .. g + 3 of a row of format F (g a multiple of 4), read with loads
// that do not depend on each other, so that they are in flight together; zeros for groups past
// `groups` or when the row is not `live`. Q8_0: four 34-byte blocks as 34 words (16 bits at a
// time where the row is not 4-byte aligned or ends inside them). Q4_K: the super-block's head (f16
// d and dmin, 12 bytes of 6-bit scales and minimums) and the 64 bytes of quants of pairs
// 2h and 2h + 1 (h = g % 8 / 4; a pair is sub-blocks 2p and 2p + 1, low and high nibbles).
// Q6_K: half h of the super-block, 16 bits at a time (210-byte blocks): its 64 bytes of low
// nibbles, 32 of high bits, 8 scales and d, as 27 words.
template <int F>
__device__ __forceinline__ void mmq_load(const u8* row, int g, int groups, bool live, u32* raw) {
    if (F == 8) {
        const u8* blk = row + (size_t)g * 34;
        int bytes = live ? 34 * max(0, min(4, groups - g)) : 0;
        if (((size_t)blk & 3) == 0 && bytes % 4 == 0) {
#pragma unroll
            for (int k = 0; k < 34; k++) raw[k] = 4 * k < bytes ? ((const u32*)blk)[k] : 0u;
        } else {
            const u16* h = (const u16*)blk;
#pragma unroll
            for (int k = 0; k < 34; k++) {
                u32 lo = 4 * k < bytes ? h[2 * k] : 0u, hi = 4 * k + 2 < bytes ? h[2 * k + 1] : 0u;
                raw[k] = lo | (hi << 16);
            }
        }
    } else if (F == 14) {
        q6k_half_words(row + (size_t)(g >> 3) * 210, (g & 7) >> 2, live && g < groups, raw);
    } else {
        bool in = live && g < groups;
        const uint4* b = (const uint4*)(row + (size_t)(g >> 3) * 144);
        int h = (g & 7) >> 2;
        uint4 v[5];
        v[0] = in ? b[0] : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int k = 0; k < 4; k++) v[1 + k] = in ? b[1 + 4 * h + k] : make_uint4(0, 0, 0, 0);
        words_of<5>(v, raw);
    }
}

// `mmq_load`'s four groups as small integers into dst (32 words, a group's 32 values 8 words
// apart) and each group's a_w, b_w (see above; Q6_K: a_w of each half, eight, and no b_w);
// `first`: the first of the four in its Q4_K super-block (0 or 4). Zero bytes give zero
// scales, so missing groups add nothing.
template <int F>
__device__ __forceinline__ void mmq_decode(const u32* raw, int first, u32* dst, float* a, float* b) {
    if (F == 8) {
#pragma unroll
        for (int q = 0; q < 2; q++) {
            // Blocks 2q and 2q + 1 start at words 17q and 17q + 8, two bytes in.
            const u32* w = raw + 17 * q;
#pragma unroll
            for (int k = 0; k < 8; k++) dst[16 * q + k] = __funnelshift_r(w[k], w[k + 1], 16);
#pragma unroll
            for (int k = 0; k < 8; k++) dst[16 * q + 8 + k] = w[9 + k];
            a[2 * q] = half_bits((u16)(w[0] & 0xFFFF));
            a[2 * q + 1] = half_bits((u16)(w[8] >> 16));
            b[2 * q] = b[2 * q + 1] = 0.0f;
        }
    } else if (F == 14) {
        float d = half_bits((u16)(raw[26] & 0xFFFF));
#pragma unroll
        for (int e = 0; e < 4; e++) {
            // Group e of the half: low (e < 2) or high nibbles of ql bytes 32 (e % 2) .., bits
            // 2e of qh.
#pragma unroll
            for (int k = 0; k < 8; k++) dst[8 * e + k] = q6k_quads(raw[8 * (e & 1) + k], raw[16 + k], 4 * (e >> 1), 2 * e);
#pragma unroll
            for (int i = 0; i < 2; i++) {
                int l = 2 * e + i;
                a[l] = d * (float)(signed char)((raw[24 + l / 4] >> (8 * (l & 3))) & 0xFF);
            }
        }
    } else {
        float d = half_bits((u16)(raw[0] & 0xFFFF)), dmin = half_bits((u16)(raw[0] >> 16));
        const u32* s = raw + 1;
#pragma unroll
        for (int q = 0; q < 2; q++) {
            const u32* qs = raw + 4 + 8 * q;
#pragma unroll
            for (int k = 0; k < 8; k++) {
                dst[16 * q + k] = qs[k] & 0x0F0F0F0F;
                dst[16 * q + 8 + k] = (qs[k] >> 4) & 0x0F0F0F0F;
            }
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float sc, mn;  // of sub-block first + 2q + e
                scale_min_k4_of(first + 2 * q + e, [s](int l) { return byte_of3(s, l); }, &sc, &mn);
                a[2 * q + e] = d * sc;
                b[2 * q + e] = dmin * mn;
            }
        }
    }
}

// A thread's four groups of row wi (`mmq_load`'s raw words, groups 4 half ..) decoded into the
// staged weights: small integers into ws (the row MMQ_STRIDE bytes long, the half's 128 bytes)
// and each group's a_w, b_w into wa, wb. Decoded in registers, stored 16 bytes at a time: word
// by word, the lanes' rows (68 words apart) met four to a bank.
template <int F>
__device__ __forceinline__ void mmq_stage_weights(const u32* raw, int wi, int half, u8* ws, float (*wa)[MMQ_WA(F)],
                                                  float (*wb)[MMQ_GROUPS + 1]) {
    float a[8], b[4];
    u32 dq[32];
    mmq_decode<F>(raw, 4 * half, dq, a, b);
    uint4* dst = (uint4*)(ws + wi * MMQ_STRIDE + 128 * half);
#pragma unroll
    for (int k = 0; k < 8; k++) dst[k] = make_uint4(dq[4 * k], dq[4 * k + 1], dq[4 * k + 2], dq[4 * k + 3]);
    if (F == 14) {
#pragma unroll
        for (int e = 0; e < 8; e++) wa[wi][8 * half + e] = a[e];
    } else {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            wa[wi][4 * half + e] = a[e];
            wb[wi][4 * half + e] = b[e];
        }
    }
}

// One step's products of `steps` groups, for NJ tiles of eight tokens, all of which the job
// has: a group's NJ products are issued back to back and scaled after, so that each waits out
// its latency behind the others. (With a test for the job's end between products, each one's
// scaling waited for it: "stall wait" and "short scoreboard" led the kernel's stalls, and the
// tensor pipe was busy 6% of the time.)
template <int F, int NT, int NJ>
__device__ __forceinline__ void mmq_step(const u8* ws, const u8* xq, const float (*wa)[MMQ_WA(F)],
                                         const float (*wb)[MMQ_GROUPS + 1], const float (*xd)[NT + 4],
                                         const float (*xm)[NT + 4], int steps, int ra, int gid, int tig, float (*c)[4]) {
#if __CUDA_ARCH__ >= 800
    for (int gl = 0; gl < steps; gl++) {
        const u8* wr = ws + ra * MMQ_STRIDE + 32 * gl + 4 * tig;
        u32 a[4] = {*(const u32*)wr, *(const u32*)(wr + 8 * MMQ_STRIDE), *(const u32*)(wr + 16),
                    *(const u32*)(wr + 8 * MMQ_STRIDE + 16)};
        if (F == 14) {
            // Two products a group, one per half of 16 and its scale.
            float a0 = wa[ra][2 * gl], a0h = wa[ra][2 * gl + 1], a1 = wa[ra + 8][2 * gl], a1h = wa[ra + 8][2 * gl + 1];
            int s[NJ][4], sh[NJ][4];
#pragma unroll
            for (int jn = 0; jn < NJ; jn++) {
                const u8* xr = xq + (8 * jn + gid) * MMQ_STRIDE + 32 * gl + 4 * tig;
                s[jn][0] = s[jn][1] = s[jn][2] = s[jn][3] = 0;
                sh[jn][0] = sh[jn][1] = sh[jn][2] = sh[jn][3] = 0;
                mma_s8_k16(s[jn], a[0], a[1], *(const u32*)xr);
                mma_s8_k16(sh[jn], a[2], a[3], *(const u32*)(xr + 16));
            }
#pragma unroll
            for (int jn = 0; jn < NJ; jn++) {
                int t = 8 * jn + 2 * tig;
                float2 d = *(const float2*)&xd[gl][t];
                c[jn][0] += d.x * (a0 * itof(s[jn][0]) + a0h * itof(sh[jn][0]));
                c[jn][1] += d.y * (a0 * itof(s[jn][1]) + a0h * itof(sh[jn][1]));
                c[jn][2] += d.x * (a1 * itof(s[jn][2]) + a1h * itof(sh[jn][2]));
                c[jn][3] += d.y * (a1 * itof(s[jn][3]) + a1h * itof(sh[jn][3]));
            }
            continue;
        }
        float a0 = wa[ra][gl], a1 = wa[ra + 8][gl];
        int s[NJ][4];
#pragma unroll
        for (int jn = 0; jn < NJ; jn++) {
            const u8* xr = xq + (8 * jn + gid) * MMQ_STRIDE + 32 * gl + 4 * tig;
            u32 bq[2] = {*(const u32*)xr, *(const u32*)(xr + 16)};
            s[jn][0] = s[jn][1] = s[jn][2] = s[jn][3] = 0;
            mma_s8(s[jn], a, bq);
        }
        // The sums as floats by `itof` (|s| < 32 · 127 · 127 < 2^22): the conversion
        // instruction runs at a quarter of the float rate.
#pragma unroll
        for (int jn = 0; jn < NJ; jn++) {
            int t = 8 * jn + 2 * tig;
            float2 d = *(const float2*)&xd[gl][t];
            c[jn][0] += a0 * d.x * itof(s[jn][0]);
            c[jn][1] += a0 * d.y * itof(s[jn][1]);
            c[jn][2] += a1 * d.x * itof(s[jn][2]);
            c[jn][3] += a1 * d.y * itof(s[jn][3]);
        }
        if (F == 12) {
            float b0 = wb[ra][gl], b1 = wb[ra + 8][gl];
#pragma unroll
            for (int jn = 0; jn < NJ; jn++) {
                float2 m = *(const float2*)&xm[gl][8 * jn + 2 * tig];
                c[jn][0] -= b0 * m.x;
                c[jn][1] -= b0 * m.y;
                c[jn][2] -= b1 * m.x;
                c[jn][3] -= b1 * m.y;
            }
        }
    }
#endif
}

// Job blockIdx.z's rows r0.. (64) by tokens t0.. (NT) against its input rows,
// quantized at qx + (j.x_row - lo) * qstride. Grid (row tiles, token tiles, jobs), 128 threads.
// Tiles of 32 tokens (NT = 32) would fit an expert's few dozen tokens of a prefill chunk better,
// yet measured 15% slower over the whole prefill of the 30B shape than 64, the only size built
// (2026-12-04: 6,973–7,146 tok/s against 8,017–8,376, at 80 registers and six blocks an SM;
// 32 for the experts' launches and 64 for the dense ones, 8,046–8,200): each tile of weights
// staged serves half the tokens.
//
// Staging: a step's inputs are copied asynchronously (`copy16_async`), its weights read into
// registers with independent loads and decoded into shared memory. Reading the next step's
// weights while this step's products run measured 4–6% slower (more live registers), so the
// weights are read after them.
template <int F, int NT>
__device__ void mmq(const Jobs& js, const u8* qx, int qstride, int lo, float* out, int os) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) u8 ws[MMQ_TILE * MMQ_STRIDE];
    __shared__ __align__(16) u8 xq[NT * MMQ_STRIDE];
    // Odd row lengths: the rows a warp's lanes read at once fall in different banks. The inputs'
    // scales by group, a lane's two tokens side by side (one 8-byte load); rows NT + 4 apart so
    // that the copies of eight groups by four tokens land in 32 banks.
    __shared__ float wa[MMQ_TILE][MMQ_WA(F)], wb[MMQ_TILE][MMQ_GROUPS + 1];
    __shared__ __align__(8) float xd[MMQ_GROUPS][NT + 4];
    __shared__ __align__(8) float xm[F == 12 ? MMQ_GROUPS : 1][NT + 4];
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
    // Weights: two threads a row, four groups each.
    int wi = tid % MMQ_TILE, half = tid / MMQ_TILE;
    const u8* wrow = (const u8*)j.w + (size_t)(r0 + wi) * j.row_bytes;
    bool wlive = r0 + wi < j.rows;
    u32 raw[MMQ_RAW(F)];
    mmq_load<F>(wrow, 4 * half, groups, wlive, raw);
    for (int g0 = 0; g0 < groups; g0 += MMQ_GROUPS) {
        // Inputs: 16-byte pieces (rows and column offsets are multiples of 16 bytes), then
        // each group's scale and scaled sum; zeros past the job's tokens or the row's end.
#pragma unroll
        for (int i = 0; i < NT * 16 / 128; i++) {
            int e = tid + 128 * i, t = e / 16, piece = e % 16, col = 32 * g0 + 16 * piece;
            bool live = t0 + t < j.n && col < j.cols;
            copy16_async(xq + t * MMQ_STRIDE + 16 * piece, live ? xrows + (size_t)t * qstride + col : qx, live);
        }
#pragma unroll
        for (int i = 0; i < NT * MMQ_GROUPS / 128; i++) {
            int e = tid + 128 * i, t = e / MMQ_GROUPS, gl = e % MMQ_GROUPS, g = g0 + gl;
            bool live = t0 + t < j.n && g < groups;
            const float* s = (const float*)(xrows + (size_t)t * qstride + j.cols);
            copy4_async(&xd[gl][t], live ? s + g : (const float*)qx, live);
            if (F == 12) copy4_async(&xm[gl][t], live ? s + groups + g : (const float*)qx, live);
        }
        mmq_stage_weights<F>(raw, wi, half, ws, wa, wb);
        copies_wait();
        __syncthreads();
        // Only the tiles of eight tokens the job has (an expert's few dozen in a tile of 64),
        // each in every step: the count fixed per block, so nothing branches between products.
        int steps = min(MMQ_GROUPS, groups - g0), nj = min(NT / 8, (j.n - t0 + 7) / 8);
        int ra = 16 * warp + gid;
        switch (nj) {
#define MMQ_CASE(k) \
    case k: mmq_step<F, NT, (k <= NT / 8 ? k : NT / 8)>(ws, xq, wa, wb, xd, xm, steps, ra, gid, tig, c); break;
            MMQ_CASE(1) MMQ_CASE(2) MMQ_CASE(3) MMQ_CASE(4) MMQ_CASE(5) MMQ_CASE(6) MMQ_CASE(7) MMQ_CASE(8)
#undef MMQ_CASE
        }
        __syncthreads();
        mmq_load<F>(wrow, g0 + MMQ_GROUPS + 4 * half, groups, wlive, raw);
    }
    store_tile<NT / 8>(j, r0 + 16 * warp + gid, t0 + 2 * tig, c, out, os);
#endif
}

#define MMQ_KERNELS(name, id)                                                                         \
    extern "C" __global__ void __launch_bounds__(128, 4) mmq_##name(const Jobs js, const u8* qx, int qstride, \
                                                                    int lo, float* out, int os) { PDL_START; \
        mmq<id, 64>(js, qx, qstride, lo, out, os);                                                    \
    }

MMQ_KERNELS(q8_0, 8)
MMQ_KERNELS(q4_k, 12)
MMQ_KERNELS(q6_k, 14)
